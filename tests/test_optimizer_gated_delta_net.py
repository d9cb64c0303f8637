"""Qwen3-Next optimizer state (gated delta nets, gated attention, MoE with a gated shared expert, the released MTP
layer) through TP changes, on state megatron-core 0.16.1 laid out.

The tiny Qwen3-Next with its MTP module (``support.qwen3_next_models``) is written per rank by pgconvert at TP1 and
TP2; ``mcore_optimizer_layout.py`` (a subprocess) builds megatron-core's own GPTModel on every rank
(``support.mcore_qwen3_next``: its GatedDeltaNet, gated SelfAttention, MoE and MTP block), loads the rank's weights
strictly, and records its ``_get_param_groups`` positions and ``_ParamAndGradBuffer`` offsets after two AdamW steps
(plain and distributed forms). The gradients and AdamW are elementwise functions of each parameter, so
megatron-core's TP2 state is its TP1 state resharded: pgconvert's conversion must give it bit for bit, the gated
delta net's segmented ``in_proj`` and ``conv1d`` states and its per-head ``A_log``/``dt_bias`` included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from support.optimizer_layouts import (assert_megatron_cores_layout, assert_same_files, assert_same_through_torch_dist,
                                      lay_out)
from support.qwen3_next_models import write_tiny_qwen3_next_with_mtp

import pgconvert
from pgconvert.cli import main

pytest.importorskip("megatron.core", reason="megatron-core lays out the reference optimizer state")

GDN = "decoder.layers.0.self_attention."
TPS = (1, 2)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, Path]]:
    """Per TP, megatron-core's plain and distributed optimizer checkpoints of the tiny Qwen3-Next."""
    root = tmp_path_factory.mktemp("gdn_optimizer")
    source, _ = write_tiny_qwen3_next_with_mtp(root / "hf")
    made, jobs = {}, []
    for tp in TPS:
        weights = root / f"tp{tp}_weights"
        pgconvert.convert(source, weights, dst_format="megatron", dst_tp=tp, dst_expert_layout="sequential")
        made[tp] = (root / f"tp{tp}_plain", root / f"tp{tp}_dist")
        jobs += ["qwen3_next", str(weights), *map(str, made[tp]), "-"]
    lay_out(jobs)
    return made


def _convert(src: Path, dst: Path, *flags: str) -> None:
    result = CliRunner().invoke(main, ["convert", str(src), str(dst), "-q", "--strict", *flags], prog_name="pgconvert")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("tp", TPS)
def test_positions_and_flat_offsets_are_megatron_cores_on_every_rank(made: dict[int, tuple[Path, Path]],
                                                                    tp: int) -> None:
    derived = assert_megatron_cores_layout(*made[tp], ranks=tp)
    (decay, no_decay), = next(iter(derived.values()))
    # GatedDeltaNet's own dt_bias and A_log come before its children's parameters; 1-dim ones are not decayed.
    assert no_decay.index(GDN + "dt_bias") < no_decay.index(GDN + "A_log") < no_decay.index(
        GDN + "in_proj.layer_norm_weight") < no_decay.index(GDN + "out_norm.weight")
    assert decay.index(GDN + "in_proj.weight") < decay.index(GDN + "conv1d.weight") < decay.index(
        GDN + "out_proj.weight")
    assert "mtp.layers.0.eh_proj.weight" in decay


@pytest.mark.parametrize("form", [0, 1], ids=["plain", "distributed"])
def test_tp1_reaches_megatron_cores_own_tp2_state_and_back(made: dict[int, tuple[Path, Path]], form: int,
                                                           tmp_path: Path) -> None:
    _convert(made[1][form], tmp_path / "tp2", "--dst-tp", "2")
    assert_same_files(made[2][form], tmp_path / "tp2")
    _convert(tmp_path / "tp2", tmp_path / "back", "--dst-tp", "1")
    assert_same_files(made[1][form], tmp_path / "back")


@pytest.mark.parametrize("form", [0, 1], ids=["plain", "distributed"])
def test_through_torch_dist_at_another_tp_and_back_is_bit_exact(made: dict[int, tuple[Path, Path]], form: int,
                                                                tmp_path: Path) -> None:
    _convert(made[2][form], tmp_path / "td", "--dst-format", "torch_dist", "--dst-tp", "1")
    _convert(tmp_path / "td", tmp_path / "back", "--dst-format", "megatron", "--dst-tp", "2")
    assert_same_through_torch_dist(made[2][form], tmp_path / "back")
