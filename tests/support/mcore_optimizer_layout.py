"""Run as a script: optimizer state that megatron-core 0.16.1 itself laid out, for a model megatron-core builds on
the CPU: ``mla``, a DeepSeek-V3-class model (multi-latent attention with or without q-LoRA, MoE with shared experts,
one multi-token-prediction layer), ``qwen3_next``, a Qwen3-Next model (gated delta nets and gated attention, MoE
with a gated shared expert, the released MTP layer; any TP, PP1, EP1: ``support.mcore_qwen3_next``), or ``mamba``, a
hybrid model (Mamba-2 mixers, attention, MLP and MoE layers; megatron-core's MambaModel in its local layout:
``support.mcore_mamba``).

argv: KIND SRC PLAIN DIST QKWD (``qkwd`` or ``-``), repeated for several jobs. SRC is a per-rank Megatron
checkpoint of that model (pgconvert wrote it from a tiny HF model). Per rank, megatron-core builds its own GPTModel
(the MLA local spec, MoE, ``mtp_block_spec`` on the last pipeline stage only, as ``get_gpt_mtp_block_spec`` gives
it; or the Qwen3-Next block; fake process groups at the rank's coordinates) and loads the rank's weights strictly.
Its ``_get_param_groups`` groups the parameters (a one-process gloo world; ``apply_wd_to_qk_layernorm`` with
QKWD) into the dense and, at EP > 1, the expert-parallel optimizer (``get_megatron_optimizer``'s chain),
each torch's AdamW, two steps on gradients that are a fixed function of each parameter's value.

PLAIN gets the plain optimizer's state (``mcore_moe_optimizer`` writes it as megatron-core does); DIST the
distributed optimizer's ``distrib_optim.pt``, every parameter where megatron-core's own
``_ParamAndGradBuffer`` puts it (buckets coalesced: the shared embedding's own bucket at PP > 1). Beside
each: ``NAME.positions.json`` (megatron-core's parameter name per rank, optimizer, group and position) and
``NAME.buffers.json`` (per rank and optimizer, each parameter's start and end in the coalesced buffer and
its bucket's start there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: `support` is found from tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


@contextlib.contextmanager
def _mla_model(args: Any, tp_rank: int, pp_rank: int, ep_rank: int) -> Iterator[Any]:
    """megatron-core's GPTModel of one rank of ``args`` (MLA local spec, MoE, MTP on the last stage)."""
    from unittest import mock

    import support.mcore_helpers as mcore
    import megatron.core.transformer.multi_token_prediction as mtp_module
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from support.mcore_mtp_model import mla_mtp_specs
    from support.megatron_mla import mla_config, mla_cpu_patches

    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    config = dataclasses.replace(mla_config(args), mtp_num_layers=args.mtp_num_layers, tensor_model_parallel_size=tp,
                                 pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                                 expert_tensor_parallel_size=tp, pipeline_dtype=args.params_dtype)
    collection = ProcessGroupCollection()
    # A job of tp·pp·ep ranks: dense tensors are data-parallel over the expert ranks, experts are not.
    for name, size, rank in (("tp", tp, tp_rank), ("pp", pp, pp_rank), ("cp", 1, 0), ("ep", ep, ep_rank),
                             ("expt_tp", tp, tp_rank), ("expt_dp", 1, 0), ("tp_ep", tp * ep, ep_rank * tp + tp_rank),
                             ("tp_cp", tp, tp_rank), ("tp_dp_cp", tp * ep, ep_rank * tp + tp_rank),
                             ("dp", ep, ep_rank), ("dp_cp", ep, ep_rank), ("tp_ep_pp", tp * ep * pp, 0)):
        setattr(collection, name, mcore.McoreFakeGroup(name, size, rank))
    collection.embd = None
    last = pp_rank == pp - 1

    def given_or_default(tp_group: Any, is_expert: bool = False, check_initialized: bool = True) -> Any:
        # eh_proj (and linear_q_proj) are built without a tp_group: megatron-core then takes parallel_state's.
        return tp_group if tp_group is not None else collection.expt_tp if is_expert else collection.tp

    with mock.patch.dict(mcore.GROUP_QUERY_REPLACEMENTS, get_tensor_model_parallel_group_if_none=given_or_default), \
            mla_cpu_patches(), \
            mock.patch.object(ProcessGroupCollection, "use_mpu_process_groups", return_value=collection), \
            mock.patch.object(parallel_state, "get_pipeline_model_parallel_rank", return_value=pp_rank), \
            mock.patch.object(parallel_state, "get_pipeline_model_parallel_world_size", return_value=pp), \
            mock.patch.object(parallel_state, "get_virtual_pipeline_model_parallel_world_size", return_value=None), \
            mock.patch.object(parallel_state, "get_tensor_model_parallel_group", return_value=collection.tp), \
            mock.patch.object(mtp_module, "gather_from_tensor_model_parallel_region", lambda x, group=None: x):
        spec, mtp_spec = mla_mtp_specs(config, args, pp_rank)
        yield GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings, pre_process=pp_rank == 0, post_process=last,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
            pg_collection=collection, mtp_block_spec=mtp_spec if last else None)


@contextlib.contextmanager
def _qwen3_next_model(args: Any, tp_rank: int, pp_rank: int, ep_rank: int) -> Iterator[Any]:
    """megatron-core's GPTModel of one rank of a Qwen3-Next checkpoint (``support.mcore_qwen3_next``: PP1, EP1)."""
    from support.mcore_helpers import RankLayout
    from support.mcore_qwen3_next import build_qwen3_next_model

    assert (pp_rank, ep_rank) == (0, 0)
    yield build_qwen3_next_model(args, RankLayout(args.tensor_model_parallel_size, 1, tp_rank, 0))


@contextlib.contextmanager
def _mamba_model(args: Any, tp_rank: int, pp_rank: int, ep_rank: int) -> Iterator[Any]:
    """megatron-core's MambaModel of one rank of a hybrid checkpoint (``support.mcore_mamba``: its local layout)."""
    from support.mcore_helpers import RankLayout
    from support.mcore_mamba import build_mamba_model

    layout = RankLayout(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, tp_rank, pp_rank,
                        ep=args.expert_model_parallel_size, ep_rank=ep_rank)
    yield build_mamba_model(args, layout)


MODELS = {"mla": _mla_model, "qwen3_next": _qwen3_next_model, "mamba": _mamba_model}


def _buffer_ranges(model: torch.nn.Module, expert: bool, group: Any) -> list[dict[str, Any]]:
    """megatron-core's ``_ParamAndGradBuffer`` (distributed optimizer, no bucket size) for the dense (or
    expert-parallel) parameters: each parameter's range in the coalesced buffer (every bucket's padding
    dropped, as ``get_parameter_state_dp_zero`` writes it) and that buffer's size."""
    from support.mcore_moe_optimizer import param_and_grad_buffer

    made = param_and_grad_buffer(model, expert, group)
    if made is None:
        return []
    buffer, params = made
    names = {p: n for n, p in model.named_parameters()}
    starts, total = [], 0
    for bucket in buffer.buckets:  # each bucket's start in the coalesced buffer
        starts.append((bucket.offset, total))
        total += bucket.numel_unpadded
    ranges, bucket_starts = {}, {}
    for param in params:
        start, end, bucket = buffer.param_index_map[param]
        offset, coalesced = starts[bucket]
        ranges[param] = (coalesced + start - offset, coalesced + end - offset)
        bucket_starts[param] = coalesced
    assert total == buffer.numel_unpadded
    return [{"numel": total, "ranges": ranges,
             "names": {names[p]: [*r, bucket_starts[p]] for p, r in ranges.items()}}]


def _train_rank(kind: str, src: Path, outs: tuple[Path, Path], coords: tuple[int, int, int], qkwd: bool,
                group: Any) -> tuple[list[list[list[str]]], list[dict[str, list[int]]]]:
    """Train one rank; write its plain and distributed forms; return megatron-core's names per optimizer,
    group and position, and per optimizer each parameter's range in the coalesced buffer."""
    import support.mcore_helpers as mcore
    from support.mcore_moe_optimizer import _distributed_entry, _flat_state, two_steps
    from megatron.core.optimizer import OptimizerConfig
    from support.megatron_fixtures import load_for_test
    from support.mcore_gpt_models import match_fixture_dtypes

    payload = load_for_test(src)
    args = payload["args"]
    with MODELS[kind](args, *coords) as model:
        match_fixture_dtypes(model, payload["model"])
        with mcore.fake_group_queries():
            model.load_state_dict(payload["model"], strict=True)
    config = OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, weight_decay=0.1, apply_wd_to_qk_layernorm=qkwd)
    positions, optimizers = two_steps(model, config)
    payload["model"] = {k: v for k, v in model.state_dict().items() if k in payload["model"]}
    args.apply_wd_to_qk_layernorm = qkwd
    ranges = [_buffer_ranges(model, index == 1, group) for index in range(len(optimizers))]
    for form, out in zip(("fp32", "distributed"), outs):
        path = out / src.relative_to(src.parents[2])
        path.parent.mkdir(parents=True, exist_ok=True)
        args.use_distributed_optimizer = form == "distributed"
        if form == "fp32":
            states = [optimizer.state_dict() for optimizer in optimizers]
        else:
            states = [_distributed_entry(optimizer) for optimizer in optimizers]
            flats = [_flat_state(optimizer, ranges[index]) for index, optimizer in enumerate(optimizers)]
            if len(flats) > 1 and coords[2] > 0:
                flats[0] = None  # ChainedOptimizer.save_parameter_state: only the dense optimizer's DP rank 0
            torch.save(flats[0] if len(flats) == 1 else flats, path.parent / "distrib_optim.pt")
        torch.save(dict(payload, optimizer=states[0] if len(states) == 1 else states), path)
    return positions, [buffer["names"] for index in range(len(optimizers)) for buffer in ranges[index]]


def main(jobs: list[tuple[str, Path, Path, Path, bool]]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    warnings.simplefilter("ignore")
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            group = torch.distributed.new_group([0], backend="gloo")
            for kind, src, plain, dist, qkwd in jobs:
                _job(kind, src, plain, dist, qkwd, group)
        finally:
            torch.distributed.destroy_process_group()


def _job(kind: str, src: Path, plain: Path, dist: Path, qkwd: bool, group: Any) -> None:
    for out in (plain, dist):
        shutil.copytree(src, out, ignore=shutil.ignore_patterns("model_optim_rng.pt"))
    positions, buffers = {}, {}
    for path in sorted(src.glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        # mp_rank_TT[_PPP][_EEE], as the rank's args lay it out.
        fields = [int(part) for part in path.parent.name.split("_")[2:]]
        args = _args_of(path)
        coords = (fields[0], fields[1] if args.pipeline_model_parallel_size > 1 else 0,
                  fields[-1] if args.expert_model_parallel_size > 1 else 0)
        positions[path.parent.name], buffers[path.parent.name] = _train_rank(kind, path, (plain, dist), coords, qkwd,
                                                                             group)
    for out in (plain, dist):
        (out.parent / f"{out.name}.positions.json").write_text(json.dumps(positions))
        (out.parent / f"{out.name}.buffers.json").write_text(json.dumps(buffers))


def _args_of(path: Path) -> Any:
    from support.megatron_fixtures import load_for_test

    return load_for_test(path)["args"]


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    words = sys.argv[1:]
    main([(words[i], Path(words[i + 1]), Path(words[i + 2]), Path(words[i + 3]), words[i + 4] == "qkwd")
          for i in range(0, len(words), 5)])
