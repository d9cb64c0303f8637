"""A megatron-core job on gloo CPU ranks that saves fixture weights as a torch_dist checkpoint or loads one, for the
tests of pgconvert's torch_dist format against megatron-core itself (``test_torch_dist_mcore.py`` with the
installed 0.16.1, ``test_torch_dist_mcore019.py`` with 0.19.2 in a venv of its own).

Why a child job. ``dist_checkpointing.save``/``load`` need an initialised default process group:
they call ``torch.distributed.get_rank``/``get_world_size``, ``all_gather_object`` (access
validation), ``barrier`` and torch.distributed.checkpoint with collectives. A world of one process
suffices for a single-rank model, but not for a TP2 one: for tensors stacked along the layer axis megatron-core builds a
torch ``ShardedTensor`` that places the other TP ranks' pieces on rank ``(rank + 1) % world_size``,
which in a one-process world is the process itself, and torch refuses ("Number of local shards (4)
does not match number of local shards metadata in sharded_tensor_metadata (8)"). So megatron-core
runs as the job it is written for: a child process (``python this_file.py <spec>``, any interpreter with
megatron-core and torch) forks one process per rank, on a gloo group over a FileStore. The ranks of the *model*
still come from fake groups (megatron-core's ``pg_collection``); only dist_checkpointing uses the real group, and the
test process never initialises torch.distributed. Three CPU-only shims in each child rank, for the
duration of the job: ``torch.cuda.current_device`` answers the CPU (the save's failure flag and the
MoE router's buffers are allocated there), ``torch.cuda.synchronize`` does nothing
(``FileSystemWriterAsync.preload_tensors``), and megatron-core's ``filesystem_async._process_memory``
answers 0 (it only logs memory use, through psutil, which megatron-core does not declare). And each rank makes
the queue through which ``dist_checkpointing.save``'s writer processes report (``filesystem_async._results_queue``,
made on first use by a multiprocessing Manager megatron-core starts with "spawn") from a forked Manager: a spawned
one starts a fresh interpreter that imports this job's modules again (``mcore_cpu_shim.forked_results_queue``).

Verified with megatron-core 0.16.1 and 0.19.2: the same calls build, save and load in both; 0.19.2's
``dist_checkpointing.save``/``load`` also take ``verify_integrity`` (the spec's ``verify_integrity``).
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

import torch
import torch.distributed

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    import support.mcore_helpers as mcore
    from support.mcore_cpu_shim import forked_results_queue
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt import GPTModel
    from support.mcore_gpt_models import (build_model, content_metadata, match_fixture_dtypes,
                                          model_sharded_state_dict)

from support.megatron_fixtures import TinyModel, _rank_state_dict, make_args, make_full_model
from support.tiny_models import MOE

REPO = Path(__file__).resolve().parents[2]
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
    # Llama's architecture (no qk norm, no biases): one an hf destination can hold.
    "gqa_swiglu_rmsnorm_llama": TinyModel(
        **_SHAPE, num_query_groups=4, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
        add_qkv_bias=False, qk_layernorm=False, tied_embeddings=False, position_embedding_type="rope",
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


def _world(spec: dict[str, Any]) -> int:
    """The job's ranks: the spec's ``world``, else one per rank of its model's layout (``cases``: the most any of
    its cases has)."""
    if spec["action"] == "cases":
        return max(_world(case) for case in spec["cases"])
    return spec.get("world") or spec["tp"] * spec["pp"] * spec["ep"]


def _child_rank(rank: int, spec: dict[str, Any]) -> None:
    """One rank of the child job: the spec's run, or (``cases``) each of its cases' runs in turn, each on a group of
    the case's own ranks (a rank past a case's world waits for the next)."""
    warnings.simplefilter("ignore")
    _cpu_only_shims()
    forked_results_queue()  # before the rank has a process group (and gloo's threads)
    for case in spec["cases"] if spec["action"] == "cases" else [spec]:
        if rank < _world(case):
            _run_in_group(rank, case)


def _run_in_group(rank: int, spec: dict[str, Any]) -> None:
    """The run ``spec`` describes, on a gloo group of its ``_world`` ranks over a FileStore in its ``out``: save
    fixture weights with megatron-core, or load a checkpoint; a hybrid model's job is ``support.mcore_mamba_dist``'s,
    a Qwen3-Next model's ``support.mcore_qwen3_next``'s."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{spec['out']}/store", rank=rank,
                                         world_size=_world(spec))
    try:
        if spec["action"].startswith("hybrid_"):
            from support.mcore_mamba_dist import run_hybrid_rank

            run_hybrid_rank(rank, _world(spec), spec)
            return
        if spec["action"].startswith("bridge_lora"):
            from support.mcore_bridge_lora import run_bridge_lora_rank

            run_bridge_lora_rank(rank, _world(spec), spec)
            return
        if spec["action"].startswith("qwen3_next_"):
            from support.mcore_qwen3_next import run_qwen3_next_rank

            run_qwen3_next_rank(rank, _world(spec), spec)
            return
        _gpt_rank(rank, spec)
    finally:
        torch.distributed.destroy_process_group()


def _gpt_rank(rank: int, spec: dict[str, Any]) -> None:
    """A rank of ``MODELS[spec["model"]]`` at the spec's layout: ``save`` fixture weights, or ``load`` ``ckpt`` and
    save what the model then holds as ``rank_<tp>_<pp>_<ep>.pt`` in ``out``."""
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
        singleton = bool(spec.get("singleton"))
        state = {"args": args, "checkpoint_version": 3.0, "iteration": 100,
                 "model": model_sharded_state_dict(model, ep, ep_rank, singleton)}
        dist_checkpointing.save(state, spec["ckpt"], content_metadata=content_metadata(singleton), **_integrity(spec))
        return
    # As megatron-LM's load_checkpoint: the model under "model", the common state's entries beside it.
    # "raise_all": every key of the checkpoint is one the model asks for, and the other way round.
    strict = {"strict": "raise_all"} if spec.get("strict") else {}
    loaded = dist_checkpointing.load({"model": model_sharded_state_dict(model, ep, ep_rank)}, spec["ckpt"],
                                     **strict, **_integrity(spec))
    assert loaded["iteration"] == 100 and loaded["checkpoint_version"] == 3.0
    with mcore.fake_group_queries():
        model.load_state_dict(loaded["model"], strict=True)
    tensors = {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
    torch.save({"layers": mcore.global_layer_indices(model), "state": tensors},
               Path(spec["out"]) / f"rank_{tp_rank}_{pp_rank}_{ep_rank}.pt")


def _integrity(spec: dict[str, Any]) -> dict[str, bool]:
    """``verify_integrity=True`` for ``save``/``load`` where the spec asks (megatron-core 0.17.1 and later)."""
    return {"verify_integrity": True} if spec.get("verify_integrity") else {}


def _child_main(spec: dict[str, Any]) -> None:
    """Fork the job's ranks from this process, which has imported megatron-core and computed nothing, so each rank
    starts from its imports (as ``support.gloo_ranks`` forks the other gloo scripts' ranks)."""
    import torch.multiprocessing

    torch.multiprocessing.start_processes(_child_rank, args=(spec,), nprocs=_world(spec), join=True,
                                          start_method="fork")


def run_megatron_core(action: str, model: str, ckpt: Path, out: Path, tp: int = 1, pp: int = 1, ep: int = 1,
                      seed: int = 0, python: str = sys.executable, check: bool = True,
                      **options: bool) -> subprocess.CompletedProcess[str]:
    """Run megatron-core's save or load as a job of tp·pp·ep gloo ranks in a child process of ``python`` (an
    interpreter with megatron-core; default: this one). ``options``: ``verify_integrity``, ``strict`` (load).
    ``check``: the job must succeed."""
    if action == "save":
        ckpt.mkdir(parents=True, exist_ok=True)
    spec = {"action": action, "model": model, "ckpt": str(ckpt), "out": str(out), "tp": tp, "pp": pp, "ep": ep,
            "seed": seed, **options}
    return run_job(spec, out, python, check)


def run_megatron_core_cases(cases: dict[str, dict[str, Any]], out: Path) -> dict[str, Path]:
    """``run_megatron_core``'s save or load runs, by name (``cases``: each one's ``action``, ``model``, ``ckpt``,
    ``tp``, ``pp``, ``ep``, ``seed`` and options), in one job of as many gloo ranks as the largest needs, one run
    after another; returns each run's ``out`` (what a load's ranks saved: ``loaded_ranks``)."""
    outs = {name: out / name for name in cases}
    specs = []
    for name, case in cases.items():
        outs[name].mkdir(parents=True)
        if case["action"] == "save":
            Path(case["ckpt"]).mkdir(parents=True, exist_ok=True)
        specs.append({"tp": 1, "pp": 1, "ep": 1, "seed": 0, **case, "ckpt": str(case["ckpt"]), "out": str(outs[name])})
    run_job({"action": "cases", "cases": specs}, out / "job")
    return outs


def run_job(spec: dict[str, Any], out: Path, python: str = sys.executable,
            check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the job ``spec`` describes (its ``action``; its ranks: ``_world``) in a child process of ``python``,
    its store and outputs in ``out``. ``check``: the job must succeed."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(out)}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([python, __file__, json.dumps(spec)], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=CHILD_TIMEOUT_S)
    assert not check or result.returncode == 0, f"megatron-core {spec['action']} failed:\n{result.stderr[-6000:]}"
    return result


def loaded_ranks(out: Path) -> dict[tuple[int, int, int], dict[str, Any]]:
    ranks = {}
    for path in sorted(out.glob("rank_*.pt")):
        tp_rank, pp_rank, ep_rank = map(int, path.stem.split("_")[1:])
        ranks[(tp_rank, pp_rank, ep_rank)] = torch.load(path, weights_only=True)
    return ranks




if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))
