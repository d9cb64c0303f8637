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

Why a child job. ``dist_checkpointing.save``/``load`` need an initialised default process group:
they call ``torch.distributed.get_rank``/``get_world_size``, ``all_gather_object`` (access
validation), ``barrier`` and torch.distributed.checkpoint with collectives. A world of one process
suffices for a single-rank model, but not for a TP2 one: for tensors stacked along the layer axis megatron-core builds a
torch ``ShardedTensor`` that places the other TP ranks' pieces on rank ``(rank + 1) % world_size``,
which in a one-process world is the process itself, and torch refuses ("Number of local shards (4)
does not match number of local shards metadata in sharded_tensor_metadata (8)"). So megatron-core
runs as the job it is written for: a child process (``python this_file.py <spec>``) spawns one
process per rank, on a gloo group over a FileStore. The ranks of the *model* still come from fake
groups (megatron-core's ``pg_collection``); only dist_checkpointing uses the real group, and this
test process never initialises torch.distributed. Three CPU-only shims in each child rank, for the
duration of the job: ``torch.cuda.current_device`` answers the CPU (the save's failure flag and the
MoE router's buffers are allocated there), ``torch.cuda.synchronize`` does nothing
(``FileSystemWriterAsync.preload_tensors``), and megatron-core's ``filesystem_async._process_memory``
answers 0 (it only logs memory use, through psutil, which megatron-core does not declare).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    pytest.importorskip(
        "megatron.core",
        reason="megatron-core is not installed (pip install 'megatron-core==0.16.1' --no-deps, the test extra)",
    )
    import support.mcore_helpers as mcore
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from support.mcore_gpt_models import (
        CONTENT_METADATA,
        build_model,
        match_fixture_dtypes,
        megatron_core_layout,
        model_sharded_state_dict,
        read_layout,
    )

from support.checkpoint_compare import assert_same_ranks, read_dcp
from support.tiny_models import MOE
from support.megatron_fixtures import (
    TinyModel,
    _rank_state_dict,
    load_for_test,
    make_args,
    make_full_model,
    padded_vocab_size,
    write_megatron_checkpoint,
)

import pgconvert

REPO = Path(__file__).resolve().parent.parent
ITERATION_DIR = "iter_0000100"
# Vocab 200 padded to a multiple of 32·tp: 224 rows at tp1, 256 at tp2, so a TP2 model loading a
# TP1-recorded checkpoint exercises megatron-core's vocab shape mismatch (allow_shape_mismatch).
_SHAPE = dict(num_layers=4, hidden_size=64, num_attention_heads=8, kv_channels=8, ffn_hidden_size=96,
              vocab_size=200, make_vocab_size_divisible_by=32, max_position_embeddings=16)
MODELS: dict[str, TinyModel] = {
    "gqa_swiglu_rmsnorm_untied": TinyModel(
        **_SHAPE, num_query_groups=4, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
        add_qkv_bias=True, qk_layernorm=True, tied_embeddings=False, position_embedding_type="rope",
    ),
    "mha_gelu_layernorm_bias_tied": TinyModel(
        **_SHAPE, num_query_groups=8, swiglu=False, normalization="LayerNorm", add_bias_linear=True,
        add_qkv_bias=False, qk_layernorm=False, tied_embeddings=True, position_embedding_type="learned_absolute",
    ),
    # Layers 0, 2, 3 MoE and 1 dense (one key per layer), shared experts with a gate, expert bias.
    "moe_list_freq": MOE,
    # Every layer MoE: layers and experts stacked along leading axes.
    "moe_every_layer": dataclasses.replace(MOE, moe_layer_freq=1),
}
DENSE = ("gqa_swiglu_rmsnorm_untied", "mha_gelu_layernorm_bias_tied")
CHILD_TIMEOUT_S = 300


# --------------------------------------------------------------------------- megatron-core models


def expected_rank_dict(m: TinyModel, full: dict[str, torch.Tensor], model: GPTModel, tp: int, pp: int, ep: int,
                       tp_rank: int, pp_rank: int, ep_rank: int) -> dict[str, torch.Tensor]:
    layers = mcore.global_layer_indices(model)
    return _rank_state_dict(m, full, tp_rank, tp, pp_rank, pp, range(layers[0], layers[-1] + 1), ep_rank, ep)


# --------------------------------------------------------------------------- child job


def _cpu_only_shims() -> None:
    import megatron.core.dist_checkpointing.strategies.filesystem_async as filesystem_async
    from megatron.core import parallel_state

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    filesystem_async._process_memory = lambda: 0
    # LanguageModule.tie_embeddings_and_output_weights_state_dict (tied embeddings, last stage of
    # pp > 1) takes the replica id's data-parallel rank from parallel_state, ignoring the metadata's
    # dp_cp_group; these jobs have no data parallelism beyond the expert ranks, and the tied copy
    # is never the main replica whatever this rank is.
    parallel_state.get_data_parallel_rank = lambda *args, **kwargs: 0


def _rank_coords(spec: dict[str, Any], rank: int) -> tuple[int, int, int]:
    tp, ep = spec["tp"], spec["ep"]
    return rank % tp, rank // (tp * ep), (rank // tp) % ep


def _child_rank(rank: int, spec: dict[str, Any]) -> None:
    """One rank of the child job: save fixture weights with megatron-core, or load a checkpoint."""
    warnings.simplefilter("ignore")
    _cpu_only_shims()
    world = spec["tp"] * spec["pp"] * spec["ep"]
    torch.distributed.init_process_group("gloo", init_method=f"file://{spec['out']}/store", rank=rank,
                                         world_size=world)
    try:
        m = MODELS[spec["model"]]
        tp, pp, ep = spec["tp"], spec["pp"], spec["ep"]
        tp_rank, pp_rank, ep_rank = coords = _rank_coords(spec, rank)
        model = build_model(m, tp, pp, ep, *coords)
        expected = expected_rank_dict(m, make_full_model(m, seed=spec["seed"]), model, tp, pp, ep, *coords)
        match_fixture_dtypes(model, expected)
        if spec["action"] == "save":
            with mcore.fake_group_queries():
                model.load_state_dict(expected, strict=True)
            args = make_args(m, tp, pp, None, None, 100, ep=ep)
            state = {"args": args, "checkpoint_version": 3.0, "iteration": 100,
                     "model": model_sharded_state_dict(model, ep, ep_rank)}
            dist_checkpointing.save(state, spec["ckpt"], content_metadata=dict(CONTENT_METADATA))
        else:
            # As megatron-LM's load_checkpoint: the model under "model", common.pt's entries beside it.
            loaded = dist_checkpointing.load({"model": model_sharded_state_dict(model, ep, ep_rank)}, spec["ckpt"])
            assert loaded["iteration"] == 100 and loaded["checkpoint_version"] == 3.0
            with mcore.fake_group_queries():
                model.load_state_dict(loaded["model"], strict=True)
            tensors = {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
            torch.save({"layers": mcore.global_layer_indices(model), "state": tensors},
                       Path(spec["out"]) / f"rank_{tp_rank}_{pp_rank}_{ep_rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def _child_main(spec: dict[str, Any]) -> None:
    import torch.multiprocessing

    world = spec["tp"] * spec["pp"] * spec["ep"]
    torch.multiprocessing.start_processes(_child_rank, args=(spec,), nprocs=world, join=True, start_method="spawn")


def run_megatron_core(action: str, model: str, ckpt: Path, out: Path, tp: int = 1, pp: int = 1, ep: int = 1,
                      seed: int = 0) -> None:
    """Run megatron-core's save or load as a job of tp·pp·ep gloo ranks in a child process."""
    out.mkdir(parents=True, exist_ok=True)
    if action == "save":
        ckpt.mkdir(parents=True, exist_ok=True)
    spec = {"action": action, "model": model, "ckpt": str(ckpt), "out": str(out), "tp": tp, "pp": pp, "ep": ep,
            "seed": seed}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, __file__, json.dumps(spec)], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=CHILD_TIMEOUT_S)
    assert result.returncode == 0, f"megatron-core {action} failed:\n{result.stderr[-6000:]}"


def loaded_ranks(out: Path) -> dict[tuple[int, int, int], dict[str, Any]]:
    ranks = {}
    for path in sorted(out.glob("rank_*.pt")):
        tp_rank, pp_rank, ep_rank = map(int, path.stem.split("_")[1:])
        ranks[(tp_rank, pp_rank, ep_rank)] = torch.load(path, weights_only=True)
    return ranks


# --------------------------------------------------------------------------- test helpers


@pytest.fixture(autouse=True)
def _leaves_torch_distributed_alone():
    yield
    assert torch.distributed.is_initialized() is False


def pgconvert_torch_dist(tmp_path: Path, name: str, seed: int = 0, tp: int = 1, pp: int = 1, ep: int = 1) -> Path:
    """Fixture weights written by the independent Megatron writer, converted by pgconvert."""
    m = MODELS[name]
    src = write_megatron_checkpoint(tmp_path / f"{name}_megatron", m, make_full_model(m, seed=seed), 2, 1,
                                    ep=2 if m.is_moe else 1)
    dst = tmp_path / f"{name}_dist"
    pgconvert.convert(src, dst, dst_format="torch_dist", dst_tp=tp, dst_pp=pp, dst_ep=ep)
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


def test_pgconvert_writes_the_files_megatron_core_writes_for_a_single_rank(tmp_path: Path) -> None:
    name = "gqa_swiglu_rmsnorm_untied"
    theirs = tmp_path / "mcore" / ITERATION_DIR
    run_megatron_core("save", name, theirs, tmp_path / "job", seed=4)

    ours = pgconvert_torch_dist(tmp_path, name, seed=4) / ITERATION_DIR

    assert json.loads((ours / "metadata.json").read_text()) == json.loads((theirs / "metadata.json").read_text())
    common_ours = load_for_test(ours / "common.pt")
    common_theirs = load_for_test(theirs / "common.pt")
    assert sorted(common_ours) == sorted(common_theirs)
    assert common_ours["content_metadata"] == common_theirs["content_metadata"]
    assert read_layout(ours) == read_layout(theirs)
    _, ours_tensors = read_dcp(ours)
    _, theirs_tensors = read_dcp(theirs)
    assert all(torch.equal(ours_tensors[key], theirs_tensors[key]) for key in theirs_tensors)


SAVE_CASES = [("gqa_swiglu_rmsnorm_untied", 2, 2, 1), ("mha_gelu_layernorm_bias_tied", 1, 2, 1),
              ("moe_list_freq", 2, 1, 2), ("moe_every_layer", 1, 2, 2)]


@pytest.mark.parametrize(("name", "tp", "pp", "ep"), SAVE_CASES,
                         ids=[f"{c[0]}-tp{c[1]}pp{c[2]}ep{c[3]}" for c in SAVE_CASES])
def test_checkpoint_saved_by_megatron_core_reads_back_bit_exact(tmp_path: Path, name: str, tp: int, pp: int,
                                                               ep: int) -> None:
    m = MODELS[name]
    full = make_full_model(m, seed=5)
    root = tmp_path / "mcore"
    run_megatron_core("save", name, root / ITERATION_DIR, tmp_path / "job", tp=tp, pp=pp, ep=ep, seed=5)
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


@pytest.mark.parametrize(("name", "recorded_tp", "tp", "pp", "ep"), LOAD_CASES,
                         ids=[f"{c[0]}-recorded_tp{c[1]}-tp{c[2]}pp{c[3]}ep{c[4]}" for c in LOAD_CASES])
def test_megatron_core_loads_pgconvert_output_into_another_layout(tmp_path: Path, name: str, recorded_tp: int,
                                                                  tp: int, pp: int, ep: int) -> None:
    dist = pgconvert_torch_dist(tmp_path, name, seed=6, tp=recorded_tp)
    args = load_for_test(dist / ITERATION_DIR / "common.pt")["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (recorded_tp, 1)
    assert args.padded_vocab_size == padded_vocab_size(MODELS[name], recorded_tp)

    run_megatron_core("load", name, dist / ITERATION_DIR, tmp_path / "job", tp=tp, pp=pp, ep=ep, seed=6)

    assert_loaded_equal_fixture_slices(tmp_path / "job", name, tp, pp, ep, seed=6)


if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))
