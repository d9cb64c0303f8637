"""pgconvert's ``torch_dist`` format against megatron-core 0.16.1 itself.

Three kinds of check, each against megatron-core's own code:

1. Key naming, in this process: the keys, global shapes and chunks pgconvert writes are exactly what
   ``GPTModel.sharded_state_dict()`` declares for a single-rank model (dense and MoE, local spec),
   built on fake process groups as ``mcore_helpers`` does. No process group is needed for that.
2. megatron-core saves (``dist_checkpointing.save``) checkpoints of fixture weights at TP1, TP2×PP2,
   tied TP1×PP2, TP2×EP2 and PP2×EP2 (MoE); pgconvert's own TP1 output must equal the TP1 one file
   for file, and pgconvert must read all of them back to the fixtures' tensors, bit for bit.
3. megatron-core loads (``dist_checkpointing.load``) pgconvert's output into models built at
   another layout than its args record (TP1 recorded → TP2, TP2×PP2, EP2, TP2×EP2; TP2 recorded →
   TP1 in a single process), one per rank; every loaded tensor must be the fixtures' independent
   slice for that rank, padding rows included.

megatron-core runs as a job of gloo CPU ranks in a child process (``support.mcore_torch_dist_job``, which says
why): one job makes every save of 2, one makes every load of 3, a case after another. pgconvert's torch_dist
outputs here keep the common state in common.pt (``--dst-torch-dist-common legacy``, the default): megatron-core
0.18 and older read it only there (0.19.2's form: ``test_torch_dist_mcore019.py``).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    pytest.importorskip(
        "megatron.core",
        reason="megatron-core is not installed (pip install 'megatron-core==0.16.1' --no-deps, the test extra)",
    )
    from support.mcore_gpt_models import build_model, megatron_core_layout, read_layout
    from support.mcore_torch_dist_job import (ITERATION_DIR, MODELS, loaded_ranks, run_megatron_core,
                                              run_megatron_core_cases)

from support.checkpoint_compare import assert_same_ranks, read_common, read_dcp
from support.torch_dist_forms import FOR_MCORE_016
from support.megatron_fixtures import (
    _rank_state_dict,
    make_full_model,
    padded_vocab_size,
    write_megatron_checkpoint,
)

import pgconvert

# --------------------------------------------------------------------------- test helpers


@pytest.fixture(autouse=True)
def _leaves_torch_distributed_alone():
    yield
    assert torch.distributed.is_initialized() is False


def pgconvert_torch_dist(tmp_path: Path, name: str, seed: int = 0, tp: int = 1, pp: int = 1, ep: int = 1) -> Path:
    """Fixture weights written by the independent Megatron writer, converted by pgconvert into the form
    megatron-core 0.16.1 reads."""
    m = MODELS[name]
    src = write_megatron_checkpoint(tmp_path / f"{name}_megatron", m, make_full_model(m, seed=seed), 2, 1,
                                    ep=2 if m.is_moe else 1)
    dst = tmp_path / f"{name}_dist"
    pgconvert.convert(src, dst, dst_format="torch_dist", dst_tp=tp, dst_pp=pp, dst_ep=ep, **FOR_MCORE_016)
    return dst


def assert_loaded_equal_fixture_slices(out: Path, name: str, tp: int, pp: int, ep: int, seed: int = 0) -> None:
    m = MODELS[name]
    full = make_full_model(m, seed=seed)
    ranks = loaded_ranks(out)
    assert sorted(ranks) == sorted((t, p, e) for t in range(tp) for p in range(pp) for e in range(ep))
    for (tp_rank, pp_rank, ep_rank), loaded in ranks.items():
        layers = loaded["layers"]
        expected = _rank_state_dict(m, full, tp_rank, tp, pp_rank, pp, range(layers[0], layers[-1] + 1), ep_rank, ep)
        state = loaded["state"]
        where = (tp_rank, pp_rank, ep_rank)
        assert sorted(state) == sorted(k for k, v in expected.items() if v is not None), where
        for key, tensor in state.items():
            assert tensor.dtype == expected[key].dtype and torch.equal(tensor, expected[key]), (where, key)


# --------------------------------------------------------------------------- 1. key naming


@pytest.mark.parametrize("name", sorted(MODELS))
def test_keys_shapes_and_chunks_are_what_megatron_core_declares_for_one_rank(tmp_path: Path, name: str) -> None:
    m = MODELS[name]
    expected_tensors, expected_objects = megatron_core_layout(build_model(m, 1, 1, 1, 0, 0, 0))

    dist = pgconvert_torch_dist(tmp_path, name)

    tensors, objects = read_layout(dist / ITERATION_DIR)
    assert objects == expected_objects
    assert sorted(tensors) == sorted(expected_tensors)
    for key, (shape, dtype, chunks) in expected_tensors.items():
        assert tensors[key][0] == shape and tensors[key][2] == chunks, key
        if not m.is_moe:
            assert tensors[key][1] == dtype, key


# --------------------------------------------------------------------------- 2. megatron-core saves


# (model, tp, pp, ep, singleton_local_shards: one key per layer and expert, gated linear_fc1 halves apart)
SAVE_CASES = [("gqa_swiglu_rmsnorm_untied", 2, 2, 1, False), ("mha_gelu_layernorm_bias_tied", 1, 2, 1, False),
              ("moe_list_freq", 2, 1, 2, False), ("moe_every_layer", 1, 2, 2, False),
              ("gqa_swiglu_rmsnorm_untied", 2, 2, 1, True), ("moe_every_layer", 2, 1, 2, True)]
SAVE_IDS = [f"{c[0]}-tp{c[1]}pp{c[2]}ep{c[3]}" + ("-singleton" if c[4] else "") for c in SAVE_CASES]
SINGLE_RANK = "gqa_swiglu_rmsnorm_untied"


@pytest.fixture(scope="module")
def saved_by_megatron_core(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One megatron-core job saves every SAVE_CASES checkpoint (fixture seed 5), each as a checkpoint root
    ``<id>`` (its ``ITERATION_DIR``), and the single-rank one (seed 4) as ``single_rank``."""
    root = tmp_path_factory.mktemp("mcore_saves")
    cases = {case_id: {"action": "save", "model": name, "ckpt": root / case_id / ITERATION_DIR, "tp": tp, "pp": pp,
                       "ep": ep, "seed": 5, "singleton": singleton}
             for case_id, (name, tp, pp, ep, singleton) in zip(SAVE_IDS, SAVE_CASES)}
    cases["single_rank"] = {"action": "save", "model": SINGLE_RANK, "ckpt": root / "single_rank" / ITERATION_DIR,
                            "seed": 4}
    run_megatron_core_cases(cases, root / "job")
    return root


def test_pgconvert_writes_the_files_megatron_core_writes_for_a_single_rank(saved_by_megatron_core: Path,
                                                                            tmp_path: Path) -> None:
    theirs = saved_by_megatron_core / "single_rank" / ITERATION_DIR

    ours = pgconvert_torch_dist(tmp_path, SINGLE_RANK, seed=4) / ITERATION_DIR

    assert json.loads((ours / "metadata.json").read_text()) == json.loads((theirs / "metadata.json").read_text())
    common_ours = read_common(ours)
    common_theirs = read_common(theirs)
    assert sorted(common_ours) == sorted(common_theirs)
    assert common_ours["content_metadata"] == common_theirs["content_metadata"]
    assert read_layout(ours) == read_layout(theirs)
    _, ours_tensors = read_dcp(ours)
    _, theirs_tensors = read_dcp(theirs)
    assert all(torch.equal(ours_tensors[key], theirs_tensors[key]) for key in theirs_tensors)


@pytest.mark.parametrize(("case_id", "name", "tp", "pp", "ep", "singleton"),
                         [(case_id, *case) for case_id, case in zip(SAVE_IDS, SAVE_CASES)], ids=SAVE_IDS)
def test_checkpoint_saved_by_megatron_core_reads_back_bit_exact(saved_by_megatron_core: Path, tmp_path: Path,
                                                               case_id: str, name: str, tp: int, pp: int, ep: int,
                                                               singleton: bool) -> None:
    m = MODELS[name]
    full = make_full_model(m, seed=5)
    root = tmp_path / "mcore"
    shutil.copytree(saved_by_megatron_core / case_id, root)
    if singleton:  # the naming read: gate and up halves apart, one key per layer and per expert
        keys = set(read_layout(root / ITERATION_DIR)[0])
        halves = ["decoder.layers.3.mlp.shared_experts.linear_fc1.weight_w",
                  "decoder.layers.3.mlp.experts.experts.7.linear_fc1.weight_v"] if m.is_moe else [
                  "decoder.layers.3.mlp.linear_fc1.weight_w", "decoder.layers.3.mlp.linear_fc1.weight_v"]
        assert set(halves) <= keys and "decoder.layers.self_attention.linear_qkv.weight" not in keys
    (root / "latest_checkpointed_iteration.txt").write_text("100")

    report = pgconvert.convert(root, tmp_path / "megatron", src_format="torch_dist", dst_format="megatron",
                               dst_tp=1, dst_pp=1, dst_ep=1)

    # The layout megatron-core recorded is the source's; converted to TP1 it is the fixture's TP1.
    assert report.src_layout == f"tp={tp},pp={pp}" + (f",ep={ep}" if ep > 1 else "")
    assert_same_ranks(tmp_path / "megatron", write_megatron_checkpoint(tmp_path / "expected", m, full, 1, 1))


# --------------------------------------------------------------------------- 3. megatron-core loads


# (model, tp recorded in pgconvert's args, tp, pp, ep of the megatron-core job that loads it)
LOAD_CASES = [
    ("gqa_swiglu_rmsnorm_untied", 1, 2, 1, 1),
    # A single process (a world of one) loading a checkpoint recorded at TP2.
    ("gqa_swiglu_rmsnorm_untied", 2, 1, 1, 1),
    ("mha_gelu_layernorm_bias_tied", 1, 2, 2, 1),
    ("moe_list_freq", 1, 1, 1, 2),
    ("moe_every_layer", 1, 2, 1, 2),
]
LOAD_IDS = [f"{c[0]}-recorded_tp{c[1]}-tp{c[2]}pp{c[3]}ep{c[4]}" for c in LOAD_CASES]


@pytest.fixture(scope="module")
def loaded_by_megatron_core(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per LOAD_CASES id: (pgconvert's torch_dist output at the recorded TP, fixture seed 6; where the ranks of the
    one megatron-core job that loads every case saved what they hold at that case's layout)."""
    root = tmp_path_factory.mktemp("mcore_loads")
    dists = {case_id: pgconvert_torch_dist(root / case_id, name, seed=6, tp=recorded_tp)
             for case_id, (name, recorded_tp, *_) in zip(LOAD_IDS, LOAD_CASES)}
    cases = {case_id: {"action": "load", "model": name, "ckpt": dists[case_id] / ITERATION_DIR, "tp": tp, "pp": pp,
                       "ep": ep, "seed": 6}
             for case_id, (name, _, tp, pp, ep) in zip(LOAD_IDS, LOAD_CASES)}
    outs = run_megatron_core_cases(cases, root / "job")
    return {case_id: (dists[case_id], outs[case_id]) for case_id in LOAD_IDS}


@pytest.mark.parametrize(("case_id", "name", "recorded_tp", "tp", "pp", "ep"),
                         [(case_id, *case) for case_id, case in zip(LOAD_IDS, LOAD_CASES)], ids=LOAD_IDS)
def test_megatron_core_loads_pgconvert_output_into_another_layout(
        loaded_by_megatron_core: dict[str, tuple[Path, Path]], case_id: str, name: str, recorded_tp: int, tp: int,
        pp: int, ep: int) -> None:
    dist, loaded = loaded_by_megatron_core[case_id]
    args = read_common(dist / ITERATION_DIR)["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (recorded_tp, 1)
    assert args.padded_vocab_size == padded_vocab_size(MODELS[name], recorded_tp)

    assert_loaded_equal_fixture_slices(loaded, name, tp, pp, ep, seed=6)


def test_megatron_core_0_16_cannot_load_the_store_form_which_is_why_common_pt_is_the_default(tmp_path: Path) -> None:
    # megatron-core 0.18 and older read the common state from common.pt only (0.16.1: TorchCommonLoadStrategy);
    # the LOAD_CASES above load the default output.
    name = "gqa_swiglu_rmsnorm_untied"
    m = MODELS[name]
    src = write_megatron_checkpoint(tmp_path / "megatron", m, make_full_model(m, seed=6), 2, 1)
    pgconvert.convert(src, tmp_path / "store", dst_format="torch_dist", dst_tp=1, dst_torch_dist_common="store")

    result = run_megatron_core("load", name, tmp_path / "store" / ITERATION_DIR, tmp_path / "job", seed=6, check=False)

    assert result.returncode != 0, result.stderr[-3000:]
    assert "No such file or directory" in result.stderr and "common.pt" in result.stderr, result.stderr[-3000:]
