"""Hybrid (Nemotron-H) optimizer state, Mamba-2 mixers beside attention, MLP and MoE layers, through TP and PP changes,
on state megatron-core 0.16.1 laid out.

The tiny Nemotron-H MoE model (``support.nemotron_h_models``: Nemotron 3 Nano's rhythm) is written per rank by
pgconvert in megatron-core's local layout at TP1, TP2 and PP2; ``mcore_optimizer_layout.py`` (a subprocess) builds
megatron-core's own MambaModel on every rank (``support.mcore_mamba``), loads the rank's weights strictly, and records
its ``_get_param_groups`` positions and ``_ParamAndGradBuffer`` offsets after two AdamW steps (plain and
distributed forms). Gradients and AdamW are elementwise functions of each parameter, so megatron-core's state at one
layout is its state at another resharded: pgconvert must give it bit for bit, the mixers' segmented ``in_proj`` and
``conv1d`` and their per-head ``A_log``, ``D`` and ``dt_bias`` included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from support.nemotron_h_models import write_tiny_nemotron_h_moe
from support.optimizer_layouts import (assert_megatron_cores_layout, assert_same_files, assert_same_through_torch_dist,
                                      lay_out)

import pgconvert
from pgconvert.cli import main

pytest.importorskip("megatron.core", reason="megatron-core lays out the reference optimizer state")

MIXER = "decoder.layers.0.mixer."
# name -> (tp, pp)
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per layout, megatron-core's plain and distributed optimizer checkpoints of the tiny Nemotron-H MoE model."""
    root = tmp_path_factory.mktemp("hybrid_optimizer")
    source = write_tiny_nemotron_h_moe(root / "hf")
    made, jobs = {}, []
    for name, (tp, pp) in LAYOUTS.items():
        weights = root / f"{name}_weights"
        pgconvert.convert(source, weights, dst_format="megatron", dst_tp=tp, dst_pp=pp, dst_transformer_impl="local",
                          dst_expert_layout="sequential")
        made[name] = (root / f"{name}_plain", root / f"{name}_dist")
        jobs += ["mamba", str(weights), *map(str, made[name]), "-"]
    lay_out(jobs)
    return made


def _convert(src: Path, dst: Path, *flags: str) -> None:
    """Not --strict: every Megatron output of Nemotron-H names time_step_min, which megatron-core does not compute;
    the optimizer state is carried, and nothing is named about it."""
    result = CliRunner().invoke(main, ["convert", str(src), str(dst), *flags], prog_name="pgconvert")
    assert result.exit_code == 0, result.output
    assert "optimizer state not carried" not in result.output and "optimizer (" in result.output, result.output


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_positions_and_flat_offsets_are_megatron_cores_on_every_rank(made: dict[str, tuple[Path, Path]],
                                                                    name: str) -> None:
    tp, pp = LAYOUTS[name]
    derived = assert_megatron_cores_layout(*made[name], ranks=tp * pp)
    (decay, no_decay), = derived[min(derived, key=lambda coord: (coord.pp, coord.tp))]
    # MambaMixer's own dt_bias, A_log and D come before its children's parameters, its layer's norm after them.
    assert no_decay.index(MIXER + "dt_bias") < no_decay.index(MIXER + "A_log") < no_decay.index(MIXER + "D") \
        < no_decay.index(MIXER + "conv1d.bias") < no_decay.index(MIXER + "norm.weight") \
        < no_decay.index("decoder.layers.0.norm.weight")
    assert decay.index(MIXER + "in_proj.weight") < decay.index(MIXER + "conv1d.weight") < decay.index(
        MIXER + "out_proj.weight")


@pytest.mark.parametrize("form", [0, 1], ids=["plain", "distributed"])
@pytest.mark.parametrize("source, target", [("tp1", "tp2"), ("tp2", "pp2")])
def test_a_layout_reaches_megatron_cores_own_state_at_another_and_back(made: dict[str, tuple[Path, Path]], form: int,
                                                                       source: str, target: str,
                                                                       tmp_path: Path) -> None:
    def layout(name: str) -> tuple[str, ...]:
        tp, pp = LAYOUTS[name]
        return "--dst-tp", str(tp), "--dst-pp", str(pp)

    _convert(made[source][form], tmp_path / "there", *layout(target))
    assert_same_files(made[target][form], tmp_path / "there")
    _convert(tmp_path / "there", tmp_path / "back", *layout(source))
    assert_same_files(made[source][form], tmp_path / "back")


@pytest.mark.parametrize("form", [0, 1], ids=["plain", "distributed"])
def test_through_torch_dist_at_another_layout_and_back_is_bit_exact(made: dict[str, tuple[Path, Path]], form: int,
                                                                    tmp_path: Path) -> None:
    _convert(made["tp2"][form], tmp_path / "td", "--dst-format", "torch_dist", "--dst-tp", "1", "--dst-pp", "2")
    _convert(tmp_path / "td", tmp_path / "back", "--dst-format", "megatron", "--dst-tp", "2", "--dst-pp", "1")
    assert_same_through_torch_dist(made["tp2"][form], tmp_path / "back")
