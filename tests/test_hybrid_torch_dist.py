"""A hybrid model (Nemotron-H: Mamba-2, attention and MLP layers) in Megatron's distributed checkpoint format.

megatron-core 0.16.1's MambaMixer stores ``in_proj.weight`` as one key per segment (``.z .x .B .C .dt``) and
``conv1d.weight``/``.bias`` as one per channel segment (``.x .B .C``), each segment's rows global; MambaStack keys
every layer by its global index and names its final norm ``decoder.final_norm``. Checked against megatron-core's
own MambaModel (``support.mcore_mamba``: megatron-core's classes with local linears and norms saving under the
Transformer Engine spec's names, the only Mamba spec megatron-core ships):

1. the keys, global shapes, chunks and objects pgconvert writes are those MambaModel's ``sharded_state_dict()``
   declares for one rank (in this process, on fake groups);
2. megatron-core loads pgconvert's outputs (``common.pt``: the form 0.16.1 reads) at TP1/TP2 × PP1/PP2 (and one
   recorded at TP1 into TP2×PP2) with ``dist_checkpointing.load(strict="raise_all")`` and
   ``load_state_dict(strict=True)``: one job of gloo ranks for every case, each rank's tensors ``torch.equal`` to
   the rank files pgconvert writes for that layout, which ``test_nemotron_h.py`` shows load into the same model
   and compute transformers' logits;
3. pgconvert reads what megatron-core's MambaModel itself saves at TP2×PP2 (``dist_checkpointing.save``) into TP1
   and HF, bit-exact;
4. round trips through torch_dist are bit-exact, and what pgconvert cannot convert is refused by name.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from support.checkpoint_compare import assert_same_ranks, read_common, read_dcp
from support.hf_helpers import assert_same_hf_tensors
from support.megatron_fixtures import load_for_test, read_megatron_checkpoint_ranks
from support.nemotron_h_models import write_tiny_nemotron_h
from support.torch_dist_forms import FOR_MCORE_016

import pgconvert
from pgconvert.cli import main

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    pytest.importorskip("megatron.core", reason="megatron-core is the client of the torch_dist format")
    from support.mcore_gpt_models import read_layout, sharded_layout
    from support.mcore_helpers import RankLayout, rank_files
    from support.mcore_mamba import assert_loaded_is_rank, build_mamba_model, mamba_sharded_state_dict
    from support.mcore_torch_dist_job import run_job

ITERATION_DIR = "iter_0000000"
# (name, tp and pp pgconvert records, tp and pp megatron-core loads it at)
LOAD_CASES = [("tp1pp1", 1, 1, 1, 1), ("tp2pp1", 2, 1, 2, 1), ("tp1pp2", 1, 2, 1, 2), ("tp2pp2", 2, 2, 2, 2),
              ("recorded_tp1_loaded_tp2pp2", 1, 1, 2, 2)]
LOAD_WORLD = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_nemotron_h(tmp_path_factory.mktemp("nemotron_h") / "hf")


@pytest.fixture(scope="module")
def rank_files_at(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, int], Path]:
    """pgconvert's rank files of the tiny model at a TP×PP, in the local spec's names (those megatron-core's
    stand-in holds), each layout converted once."""
    made: dict[tuple[int, int], Path] = {}

    def at(tp: int, pp: int) -> Path:
        if (tp, pp) not in made:
            made[(tp, pp)] = tmp_path_factory.mktemp(f"hybrid_ranks_tp{tp}pp{pp}") / "mcore"
            pgconvert.convert(tiny, made[(tp, pp)], dst_format="megatron", dst_tp=tp, dst_pp=pp,
                              dst_transformer_impl="local")
        return made[(tp, pp)]

    return at


# --------------------------------------------------------------------------- 1. key naming


def test_keys_shapes_chunks_and_objects_are_what_megatron_cores_mamba_model_declares(tiny: Path,
                                                                                    tmp_path: Path) -> None:
    pgconvert.convert(tiny, tmp_path / "dist", dst_format="torch_dist", dst_tp=1, **FOR_MCORE_016)
    args = read_common(tmp_path / "dist" / ITERATION_DIR)["args"]
    model = build_mamba_model(args, RankLayout(1, 1, 0, 0))
    expected_tensors, expected_objects = sharded_layout(mamba_sharded_state_dict(model))

    tensors, objects = read_layout(tmp_path / "dist" / ITERATION_DIR)

    assert "decoder.layers.0.mixer.in_proj.weight.dt" in expected_tensors  # megatron-core's own segment keys
    assert "decoder.layers.11.mlp.linear_fc1.weight" in expected_tensors and "decoder.final_norm.weight" in tensors
    assert objects == expected_objects
    assert sorted(tensors) == sorted(expected_tensors)
    for key, (shape, dtype, chunks) in expected_tensors.items():
        assert tensors[key] == (shape, dtype, chunks), key


# --------------------------------------------------------------------------- 2. megatron-core loads


@pytest.fixture(scope="module")
def loaded_by_megatron_core(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One megatron-core job loads every case's checkpoint; returns where each rank saved what it holds."""
    root = tmp_path_factory.mktemp("hybrid_loads")
    cases = []
    for name, recorded_tp, recorded_pp, tp, pp in LOAD_CASES:
        dist = root / name
        pgconvert.convert(tiny, dist, dst_format="torch_dist", dst_tp=recorded_tp, dst_pp=recorded_pp,
                          **FOR_MCORE_016)
        cases.append({"name": name, "ckpt": str(dist / ITERATION_DIR), "tp": tp, "pp": pp})
    run_job({"action": "hybrid_load", "world": LOAD_WORLD, "cases": cases}, root / "job")
    return root / "job"


@pytest.mark.parametrize(("name", "tp", "pp"), [(case[0], case[3], case[4]) for case in LOAD_CASES],
                         ids=[case[0] for case in LOAD_CASES])
def test_megatron_core_loads_pgconvert_output_strictly_with_every_value_in_place(
        loaded_by_megatron_core: Path, rank_files_at: Callable[[int, int], Path], name: str, tp: int, pp: int) -> None:
    for rank in rank_files(rank_files_at(tp, pp)):
        assert_loaded_is_rank(loaded_by_megatron_core / f"{name}_rank_{rank.layout.tp_rank}_{rank.layout.pp_rank}.pt",
                              rank)


# --------------------------------------------------------------------------- 3. megatron-core saves


def test_a_checkpoint_megatron_cores_mamba_model_saved_at_tp2_pp2_reads_back_bit_exact(
        tiny: Path, rank_files_at: Callable[[int, int], Path], tmp_path: Path) -> None:
    source = rank_files_at(2, 2)
    saved = tmp_path / "mcore"
    (saved / "iter_0000100").mkdir(parents=True)
    (saved / "latest_checkpointed_iteration.txt").write_text("100")
    run_job({"action": "hybrid_save", "world": 4, "source": str(source), "ckpt": str(saved / "iter_0000100")},
            tmp_path / "job")

    report = pgconvert.convert(saved, tmp_path / "tp1", src_format="torch_dist", dst_format="megatron", dst_tp=1,
                               dst_pp=1, dst_transformer_impl="local")
    pgconvert.convert(saved, tmp_path / "hf", dst_format="hf")

    assert report.src_layout == "tp=2,pp=2"
    assert_same_ranks(tmp_path / "tp1", rank_files_at(1, 1))
    assert_same_hf_tensors(tiny, tmp_path / "hf")
    # The keys and global shapes megatron-core wrote are those pgconvert writes (chunks: per rank there).
    pgconvert.convert(tiny, tmp_path / "ours", dst_format="torch_dist", dst_tp=2, dst_pp=2, **FOR_MCORE_016)
    theirs, ours = read_layout(saved / "iter_0000100"), read_layout(tmp_path / "ours" / ITERATION_DIR)
    assert {key: entry[0] for key, entry in theirs[0].items()} == {key: entry[0] for key, entry in ours[0].items()}
    assert theirs[1] == ours[1]


# --------------------------------------------------------------------------- 4. round trips and refusals


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_per_rank_to_torch_dist_to_per_rank_is_bit_exact(tiny: Path, tmp_path: Path, impl: str) -> None:
    pgconvert.convert(tiny, tmp_path / "tp2", dst_format="megatron", dst_tp=2, dst_transformer_impl=impl)

    pgconvert.convert(tmp_path / "tp2", tmp_path / "dist", dst_format="torch_dist", dst_tp=1, dst_pp=2)
    pgconvert.convert(tmp_path / "dist", tmp_path / "back", dst_format="megatron", dst_tp=2, dst_pp=1)

    assert_same_ranks(tmp_path / "back", tmp_path / "tp2")
    # A TE-spec rank file holds each TE module's _extra_state key (strict loading expects it), from HF too.
    extra = {key for chunks in read_megatron_checkpoint_ranks(tmp_path / "tp2")[1].values()
             for key in chunks["model"] if key.endswith("._extra_state")}
    if impl == "local":
        assert extra == set()
    else:
        assert {"decoder.layers.0.mixer.in_proj._extra_state", "decoder.layers.0.mixer.out_proj._extra_state",
                "decoder.layers.1.mlp.linear_fc1._extra_state",
                "decoder.layers.3.self_attention.linear_qkv._extra_state"} <= extra


def test_hf_to_torch_dist_to_hf_is_bit_exact_and_each_segment_is_its_rows(tiny: Path, tmp_path: Path) -> None:
    pgconvert.convert(tiny, tmp_path / "dist", dst_format="torch_dist", dst_tp=2, dst_pp=2)

    pgconvert.convert(tmp_path / "dist", tmp_path / "hf", dst_format="hf")

    assert_same_hf_tensors(tiny, tmp_path / "hf")
    _, stored = read_dcp(tmp_path / "dist" / ITERATION_DIR)
    hf = {key: value for path in tiny.glob("*.safetensors") for key, value in load_file(path).items()}
    in_proj = hf["backbone.layers.0.mixer.in_proj.weight"]  # rows [z; x; B; C; dt]: 128, 128, 16, 16, 8
    segments = [stored[f"decoder.layers.0.mixer.in_proj.weight.{name}"] for name in ("z", "x", "B", "C", "dt")]
    assert [segment.shape[0] for segment in segments] == [128, 128, 16, 16, 8]
    assert torch.equal(torch.cat(segments), in_proj)


@pytest.mark.parametrize(("options", "message"), [
    (["--dst-tp", "4"], "--dst-tp 4: num_query_groups=2 is not divisible by 4"),
    (["--dst-pp", "2", "--dst-vpp", "2"],
     "--dst-vpp 2: the hybrid model 'M-M*-M-M*-M-' cannot take a virtual pipeline"),
])
def test_layouts_a_hybrid_torch_dist_cannot_take_are_refused_by_name_while_planning(
        tiny: Path, tmp_path: Path, options: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["--dst-format", "torch_dist", *options, str(tiny), str(tmp_path / "out")])

    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "out").exists()


def test_a_segment_whose_shape_the_args_contradict_is_named(tiny: Path, tmp_path: Path) -> None:
    pgconvert.convert(tiny, tmp_path / "dist", dst_format="torch_dist", **FOR_MCORE_016)  # a common.pt to edit
    common_path = tmp_path / "dist" / ITERATION_DIR / "common.pt"
    common: dict[str, Any] = load_for_test(common_path)
    common["args"].mamba_num_groups = 4  # B and C: 4 groups of 8 rows, where 2 are stored
    torch.save(common, common_path)

    result = CliRunner().invoke(main, ["--dst-format", "hf", str(tmp_path / "dist"), str(tmp_path / "out")])

    assert result.exit_code != 0 and not isinstance(result.exception, (AssertionError, TypeError)), result.output
    assert ("decoder.layers.0.mixer.in_proj.weight.B has global shape [16, 64], expected [32, 64]" in result.output
            and "mamba_num_groups=4" in result.output), result.output
    assert not (tmp_path / "out").exists()

