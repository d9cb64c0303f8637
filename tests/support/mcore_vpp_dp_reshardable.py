"""Run as a script: megatron-core loads, and saves again, a torch_dist checkpoint's dp_reshardable optimizer state
at a virtual pipeline layout.

    python tests/support/mcore_vpp_dp_reshardable.py ITERATION_DIR OUT_DIR DP

One forked gloo process per rank of the checkpoint's TP x PP layout (common.pt's args) times DP. Each does what
Megatron-LM's ``get_model`` + ``get_megatron_optimizer`` + ``load_checkpoint`` do with megatron-core 0.16.1's own
classes: ``initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size)``; per model chunk ``vp`` a
GPTModel (local spec; ``vp_stage=vp``, the args' ``pipeline_model_parallel_layout``, pre/post process of that
virtual stage) in ``Float16Module`` for bf16 and ``DistributedDataParallel`` with ``disable_bucketing`` for chunks
after the first (the args' ``overlap_grad_reduce`` / ``ddp_bucket_size``); ``get_megatron_optimizer`` over all
chunks; then ``DistributedOptimizer.sharded_state_dict(is_loading=True, metadata={'distrib_optim_sharding_type':
'dp_reshardable'})``, ``dist_checkpointing.load`` and ``load_state_dict`` (which checks
``per_bucket_numel_unpadded`` against its own buffers). Written to OUT_DIR/rank{R}.pt: what the optimizer then
holds per canonical name (``mcore_optimizer_step.optimizer_tensors``), the ShardedObjects megatron-core declares
(key -> value) and the ShardedTensors (key -> global shape, offset, local size). Then ``dist_checkpointing.save``
of the same optimizer's sharded state dict for saving into OUT_DIR/saved: megatron-core's own dp_reshardable
records of the state it loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: `support` is found from tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from support.gloo_ranks import run_ranks

METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _chunk(args: Any, vp: int, vpp: int | None) -> Any:
    """Model chunk ``vp`` of this rank, wrapped as Megatron-LM's ``get_model`` wraps it."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.module import Float16Module
    from support.mcore_helpers import transformer_config_from_args

    config = dataclasses.replace(transformer_config_from_args(args), bf16=args.bf16, fp16=args.fp16,
                                 perform_initialization=True, virtual_pipeline_model_parallel_size=vpp,
                                 pipeline_model_parallel_layout=getattr(args, "pipeline_model_parallel_layout", None))
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=args.normalization),
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                     post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base, vp_stage=vp)
    if args.bf16 or args.fp16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=bool(getattr(args, "overlap_grad_reduce", False)), overlap_param_gather=False,
        use_distributed_optimizer=True, bucket_size=getattr(args, "ddp_bucket_size", None),
        pad_buckets_for_high_nccl_busbw=bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False)))
    return DistributedDataParallel(config, ddp_config, model, disable_bucketing=vp > 0)


def _names(chunks: list[Any]) -> dict[int, str]:
    """id(param) -> canonical name: each layer by its global ``layer_number``."""
    from support.mcore_optimizer_step import _gpt

    names = {}
    for ddp in chunks:
        gpt = _gpt(ddp)
        for name, param in gpt.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(gpt.decoder.layers[int(parts[2])].layer_number - 1)
            names[id(param)] = ".".join(parts)
    return names


def _declared(sharded: Any) -> tuple[dict[str, Any], dict[str, list[tuple[tuple[int, ...], ...]]]]:
    """The ShardedObjects' values and each ShardedTensor's (global shape, global offset, local shape)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    objects: dict[str, Any] = {}
    tensors: dict[str, list[tuple[tuple[int, ...], ...]]] = {}
    for value in nested_values(sharded):
        if isinstance(value, ShardedObject):
            objects[value.unique_key] = value.data
        elif isinstance(value, ShardedTensor):
            tensors.setdefault(value.key, []).append(
                (tuple(value.global_shape), tuple(value.global_offset), tuple(value.local_shape)))
    return objects, tensors


def _rank(rank: int, world: int, store: str, iteration_dir: Path, out_dir: Path) -> None:
    import support.mcore_cpu_shim as mcore_cpu_shim
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from support.mcore_optimizer_step import optimizer_tensors
    from support.megatron_fixtures import load_for_test

    mcore_cpu_shim.install()
    args = load_for_test(iteration_dir / "common.pt")["args"]
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    vpp = vpp if vpp and vpp > 1 else None
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp)
    chunks = [_chunk(args, vp, vpp) for vp in range(vpp or 1)]
    fields = {field.name: getattr(args, field.name) for field in dataclasses.fields(OptimizerConfig)
              if hasattr(args, field.name) and field.name != "timers"}  # as mcore_optimizer_step._optimizer
    optimizer = get_megatron_optimizer(OptimizerConfig(**fields), chunks)
    inner = optimizer.chained_optimizers[0] if isinstance(optimizer, ChainedOptimizer) else optimizer
    from megatron.core.safe_globals import SAFE_GLOBALS
    from pgconvert.formats.megatron import SAFE_GLOBALS as PGCONVERT_SAFE_GLOBALS
    torch.serialization.add_safe_globals([argparse.Namespace, io.BytesIO, *PGCONVERT_SAFE_GLOBALS, *SAFE_GLOBALS])
    sharded = inner.sharded_state_dict({}, is_loading=True, metadata=METADATA)
    inner.load_state_dict(dist_checkpointing.load({"optimizer": sharded}, str(iteration_dir))["optimizer"])
    saving = inner.sharded_state_dict({}, is_loading=False, metadata=METADATA)
    objects, tensors = _declared(saving)
    torch.save({"loaded": optimizer_tensors(optimizer, _names(chunks)), "objects": objects, "tensors": tensors,
                "coord": (parallel_state.get_tensor_model_parallel_rank(),
                          parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_data_parallel_rank()),
                "gbuf_chunks": dict(inner.gbuf_idx_to_model_idx_map)}, out_dir / f"rank{rank}.pt")
    from support.mcore_cpu_shim import allow_cpu_save

    allow_cpu_save()
    dist_checkpointing.save({"optimizer": saving}, str(out_dir / "saved"))
    torch.distributed.destroy_process_group()


def run(iteration_dir: Path, out_dir: Path, dp: int) -> None:
    from support.megatron_fixtures import load_for_test

    args = load_for_test(iteration_dir / "common.pt")["args"]
    world = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * dp
    (out_dir / "saved").mkdir(parents=True, exist_ok=True)
    run_ranks(_rank, world, iteration_dir, out_dir, where=str(iteration_dir))


if __name__ == "__main__":
    from support.gloo_ranks import prepare_forks

    prepare_forks()
    run(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
