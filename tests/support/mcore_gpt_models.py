"""megatron-core 0.16.1's GPTModel built for one rank on fake process groups, and what its
``sharded_state_dict`` and a torch_dist checkpoint's metadata declare (key, global shape, dtype, chunks)."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    import support.mcore_helpers as mcore
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
        is_main_replica,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

from support.megatron_fixtures import TinyModel, make_args
from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata


# What Megatron-LM passes to sharded_state_dict (training/checkpointing.py, core >= 0.14), less the group.
CONTENT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True}


@contextlib.contextmanager
def cpu_current_device() -> Iterator[None]:
    """``torch.cuda.current_device`` answers the CPU: the MoE router allocates its buffers there."""
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]


def sharded_metadata(dp_size: int = 1, dp_rank: int = 0, singleton: bool = False) -> dict[str, Any]:
    # megatron-LM passes its data-parallel group here; a fake one stands for it. ``singleton``: Megatron-LM's
    # --ckpt-assume-constant-structure-free naming (singleton_local_shards: one key per layer, expert, gate/up half).
    return {**content_metadata(singleton), "dp_cp_group": mcore.McoreFakeGroup("dp_cp", dp_size, dp_rank)}


def content_metadata(singleton: bool = False) -> dict[str, Any]:
    """The sharding metadata Megatron-LM records in the common state (``content_metadata``)."""
    return {**CONTENT_METADATA, "singleton_local_shards": singleton}


def build_model(m: TinyModel, tp: int, pp: int, ep: int, tp_rank: int, pp_rank: int, ep_rank: int) -> GPTModel:
    """megatron-core's GPTModel (local spec) for one rank, on fake groups; MoE models get megatron-LM's
    MoE fields and the decoder block spec that mixes dense and MoE layers."""
    args = make_args(m, tp, pp, None, None, 100, ep=ep)
    if not m.is_moe:
        return mcore.build_gpt_model(args, mcore.RankLayout(tp, pp, tp_rank, pp_rank))
    freq = m.moe_layer_freq if isinstance(m.moe_layer_freq, int) else list(m.moe_layer_freq)
    config = dataclasses.replace(
        mcore.transformer_config_from_args(args),
        num_moe_experts=m.num_experts, moe_ffn_hidden_size=m.expert_ffn_hidden_size, moe_layer_freq=freq,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=m.moe_shared_expert_gate,
        moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        # megatron-core allows the expert bias only with sigmoid scores.
        moe_router_score_function="sigmoid" if m.moe_router_enable_expert_bias else "softmax",
        moe_router_topk=2, expert_model_parallel_size=ep, expert_tensor_parallel_size=tp,
        # The all-to-all dispatcher creates a CUDA stream when it is built; allgather does not.
        moe_token_dispatcher_type="allgather", add_bias_linear=False,
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                      pp_rank=pp_rank)
    collection = mcore.expert_pg_collection(tp, pp, ep, tp_rank, pp_rank, ep_rank)
    with cpu_current_device(), mcore.fake_group_queries(), mcore.restored_attention_backend_env():
        model = GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings, pre_process=pp_rank == 0,
            post_process=pp_rank == pp - 1, share_embeddings_and_output_weights=m.tied_embeddings,
            position_embedding_type=m.position_embedding_type, pg_collection=collection,
        )
    return model.eval()


def model_sharded_state_dict(model: GPTModel, dp_size: int = 1, dp_rank: int = 0,
                             singleton: bool = False) -> dict[str, Any]:
    """``dp_size``/``dp_rank``: the rank's data-parallel group, where replicated tensors have their
    replicas (with EP, dense tensors are data-parallel over the expert ranks)."""
    with mcore.fake_group_queries():
        return model.sharded_state_dict(metadata=sharded_metadata(dp_size, dp_rank, singleton))


def match_fixture_dtypes(model: GPTModel, expected: dict[str, torch.Tensor | None]) -> None:
    """Give each parameter and buffer the fixture's dtype. A training run holds its weights in the
    model dtype (megatron-LM's Float16Module) with the router in float32; a GPTModel built on the
    CPU has float32 local-spec norms and a bf16 router, which would round the fixtures' values."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        reference = expected.get(name)
        if reference is not None and tensor.dtype != reference.dtype:
            tensor.data = tensor.data.to(reference.dtype)


def read_layout(iteration_dir: Path) -> tuple[dict[str, Any], list[str]]:
    """Per tensor key its global shape, dtype and sorted chunks; the bytes keys. Read by torch alone."""
    metadata = FileSystemReader(str(iteration_dir)).read_metadata()
    tensors = {}
    objects = []
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[key] = (tuple(md.size), md.properties.dtype,
                            sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks))
        else:
            objects.append(key)
    return tensors, sorted(objects)


def megatron_core_layout(model: GPTModel) -> tuple[dict[str, Any], list[str]]:
    """What megatron-core's sharded_state_dict declares: per key global shape, dtype, main-replica chunks."""
    return sharded_layout(model_sharded_state_dict(model))


def sharded_layout(sharded_state_dict: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """What a sharded state dict declares: per key global shape, dtype, main-replica chunks; its objects."""
    tensors: dict[str, Any] = {}
    objects = []
    for value in nested_values(sharded_state_dict):
        pieces = value.build() if isinstance(value, ShardedTensorFactory) else [value]
        for piece in pieces:
            if not is_main_replica(piece.replica_id):
                continue
            if isinstance(piece, ShardedObject):
                objects.append(piece.unique_key)
                continue
            assert isinstance(piece, ShardedTensor)
            chunk = (tuple(piece.global_offset), (1,) * piece.prepend_axis_num + tuple(piece.local_shape))
            entry = tensors.setdefault(piece.key, (tuple(piece.global_shape), piece.dtype, []))
            entry[2].append(chunk)
    return {key: (shape, dtype, sorted(chunks)) for key, (shape, dtype, chunks) in tensors.items()}, sorted(objects)
