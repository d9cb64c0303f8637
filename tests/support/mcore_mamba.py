"""Test-only: megatron-core 0.16.1's own MambaModel for one rank of a hybrid checkpoint, built on a CPU.

``pretrain_mamba.py``'s ``mamba_builder`` builds ``MambaModel(config, mamba_stack_spec, vocab_size=
padded_vocab_size, hybrid_override_pattern=..., pre_process, post_process, position_embedding_type, ...)``
from the rank file's args. Three things megatron-core ships need what this machine lacks, and each is
replaced by the narrowest stand-in for construction only (no Mamba or attention forward runs here; an ``E``
layer's MoELayer is plain megatron-core and runs its own CPU forward under ``cpu_forward_patches``):

- the only Mamba stack spec megatron-core ships (``models/mamba/mamba_layer_specs.py``) is made of
  Transformer Engine modules; the spec here is megatron-core's own classes with its local linears and
  norms in the same places (MambaLayer's ``norm`` is the input norm TE fuses into ``in_proj``; an ``E``
  layer is ``MoETransformerLayer`` with a separate ``pre_mlp_layernorm`` and megatron-core's MoE module,
  whose experts are SequentialMLP's ``local_experts`` where TE's are TEGroupedMLP), i.e. the layout of a
  ``--transformer-impl local --dst-expert-layout sequential`` rank file;
- ``ssm/mamba_mixer.py`` imports three Triton kernels of dynamic-batching inference
  (``inference/contexts/attention_context/triton/tensor_ops.py``, which imports ``triton``, absent
  here) at module level; without Triton that module is stood in for by one whose three functions
  raise if called (construction calls none);
- MambaMixer refuses to be built without ``mamba_ssm`` (``HAVE_MAMBA_SSM``) and ``einops``
  (``HAVE_EINOPS``, also MambaContextParallel's), which only its forward calls; its gated norm ``ExtendedRMSNorm`` derives
  from ``mamba_ssm``'s RMSNormGated, replaced by a module holding the same one parameter, ``weight``
  of ``d_inner_local_tp`` rows. MambaStack's final norm is ``TENorm``, replaced by megatron-core's
  local ``WrappedTorchNorm``.

For a distributed checkpoint the local modules save under the TE modules' names (``MAMBA_LAYER_KEYS_MAP`` and
the local GPT spec's own keys map) and the gated norm's stand-in shards its weight as ExtendedRMSNorm does, so
``MambaModel.sharded_state_dict()`` declares the keys, shapes and chunks ``mamba_stack_spec`` does.

Everything else (the mixer's ``in_proj`` rows, ``conv1d`` channels, ``A_log``/``D``/``dt_bias`` heads, the
layers of each stage, their names) is megatron-core's own. Importing this module imports megatron-core.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import importlib.util
import sys
import types

import torch


def _triton_kernels_stand_in() -> None:
    """``tensor_ops`` without Triton: the three names mamba_mixer imports, each refusing to run."""
    name = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"
    if importlib.util.find_spec("triton") is not None or name in sys.modules:
        return
    module = types.ModuleType(name)
    for function in ("tensor_get_slice_after", "tensor_masked_update", "tensor_merge"):
        def refuse(*args: Any, _name: str = function, **kwargs: Any) -> None:
            raise RuntimeError(f"{_name}: a Triton kernel of dynamic-batching inference; Triton is not installed")
        setattr(module, function, refuse)
    sys.modules[name] = module


_triton_kernels_stand_in()

import megatron.core.ssm.mamba_block as mamba_block  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
import megatron.core.ssm.mamba_context_parallel as mamba_context_parallel  # noqa: E402
import megatron.core.ssm.mamba_mixer as mamba_mixer  # noqa: E402
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec  # noqa: E402
from megatron.core.models.mamba import MambaModel  # noqa: E402
from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules  # noqa: E402
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules  # noqa: E402
from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules  # noqa: E402
from megatron.core.ssm.mlp_layer import MLPLayer  # noqa: E402
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.transformer.transformer_layer import (MoETransformerLayer, TransformerLayer,  # noqa: E402
                                                         TransformerLayerSubmodules)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint  # noqa: E402
from support.mcore_gpt_models import sharded_metadata  # noqa: E402
from support.mcore_helpers import (RankLayout, _NoRngTracker, copied_config_fields, cpu_forward_patches,  # noqa: E402
                                   expert_pg_collection, fake_group_queries, restored_attention_backend_env)


class GatedNormWeight(torch.nn.Module):
    """Stands in for ``ExtendedRMSNorm`` (mamba_ssm's RMSNormGated): its one parameter, ``weight``, and its
    ``sharded_state_dict`` (mamba_mixer.py:88): the weight split over parallel_state's TP group along axis 0."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = False, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        assert metadata is not None
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets,
                                                   tp_group=parallel_state.get_tensor_model_parallel_group(),
                                                   dp_cp_group=metadata["dp_cp_group"])


# The local modules save under the names of the Transformer Engine modules they stand for (a norm fused into the
# linear after it), as megatron-core's own local GPT spec does (``sharded_state_dict_keys_map``): so the keys of
# ``sharded_state_dict()`` are those of ``mamba_stack_spec`` in a torch_dist checkpoint.
MAMBA_LAYER_KEYS_MAP = {"norm.": "mixer.in_proj.layer_norm_"}


def local_mamba_stack_spec() -> ModuleSpec:
    """``mamba_stack_spec`` with megatron-core's local modules in place of Transformer Engine's."""
    local = get_gpt_layer_local_spec(normalization="RMSNorm").submodules
    mamba = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=WrappedTorchNorm,
        mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear,
                                                                            out_proj=RowParallelLinear)),
        mamba_bda=get_bias_dropout_add, sharded_state_dict_keys_map=MAMBA_LAYER_KEYS_MAP))
    attention = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=local.input_layernorm, self_attention=local.self_attention,
        self_attn_bda=get_bias_dropout_add, sharded_state_dict_keys_map=local.sharded_state_dict_keys_map))
    mlp = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=local.pre_mlp_layernorm, mlp=local.mlp, mlp_bda=get_bias_dropout_add,
        sharded_state_dict_keys_map=local.sharded_state_dict_keys_map))
    # As mamba_stack_spec's: the pre-MLP norm separate (TENorm there), the experts the local backend's.
    moe = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
        # num_experts only guards the spec's construction (mamba_stack_spec passes 8); the config sets the count.
        pre_mlp_layernorm=local.pre_mlp_layernorm, mlp=get_moe_module_spec(use_te=False, num_experts=8),
        mlp_bda=get_bias_dropout_add))
    return ModuleSpec(module=MambaStack, submodules=MambaStackSubmodules(
        mamba_layer=mamba, attention_layer=attention, mlp_layer=mlp, moe_layer=moe))


def _transformer_config(args: argparse.Namespace) -> TransformerConfig:
    """What Megatron-LM's ``core_transformer_config_from_args`` copies for a Nemotron-H-style model (the MoE
    fields by name, as for a GPT model, and the expert layout)."""
    experts = {name: value for name, value in copied_config_fields(args).items() if name.startswith(("moe_", "num_moe"))}
    if experts:
        experts.update(expert_model_parallel_size=args.expert_model_parallel_size,
                       expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    return TransformerConfig(
        **experts,
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size, gated_linear_unit=False,
        activation_func=lambda x: torch.relu(x).square(), normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon, add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias,
        mamba_state_dim=args.mamba_state_dim, mamba_head_dim=args.mamba_head_dim,
        mamba_num_groups=args.mamba_num_groups, mamba_num_heads=args.mamba_num_heads, is_hybrid_model=True,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=args.params_dtype, pipeline_dtype=args.params_dtype,
        use_cpu_initialization=True, perform_initialization=False,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False)


@contextmanager
def _construction_stand_ins() -> Iterator[None]:
    """The stand-ins of the module docstring, and the CPU patches megatron-core's construction needs."""
    with ExitStack() as stack:
        stack.enter_context(fake_group_queries())
        stack.enter_context(restored_attention_backend_env())
        stack.enter_context(cpu_forward_patches())
        patch = stack.enter_context(_attributes())
        patch(mamba_mixer, "HAVE_MAMBA_SSM", True)
        patch(mamba_mixer, "HAVE_EINOPS", True)
        patch(mamba_context_parallel, "HAVE_EINOPS", True)
        patch(mamba_mixer, "ExtendedRMSNorm", GatedNormWeight)
        patch(mamba_mixer, "get_cuda_rng_tracker", lambda *args, **kwargs: _NoRngTracker())
        patch(mamba_block, "TENorm", WrappedTorchNorm)
        yield


@contextmanager
def _attributes() -> Iterator[Any]:
    saved: list[tuple[object, str, object]] = []

    def patch(owner: object, name: str, value: object) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    try:
        yield patch
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def build_mamba_model(args: argparse.Namespace, layout: RankLayout) -> MambaModel:
    """megatron-core's MambaModel for one rank, as ``mamba_builder`` builds it from ``args``."""
    groups = expert_pg_collection(layout.tp, layout.pp, layout.ep, layout.tp_rank, layout.pp_rank, layout.ep_rank)
    with _construction_stand_ins():
        model = MambaModel(
            config=_transformer_config(args), mamba_stack_spec=local_mamba_stack_spec(),
            vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
            pre_process=layout.is_first_stage, post_process=layout.is_last_stage,
            hybrid_attention_ratio=args.hybrid_attention_ratio, hybrid_mlp_ratio=args.hybrid_mlp_ratio,
            hybrid_override_pattern=args.hybrid_override_pattern,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type, pg_collection=groups)
    return model.eval()


def assert_loads_strictly(rank: Any) -> dict[str, torch.Tensor]:
    """megatron-core's MambaModel for a rank file (``mcore_helpers.rank_files``) loads its model with
    ``strict=True``, every tensor in place; its state dict after the load."""
    model = build_mamba_model(rank.args, rank.layout)
    model.load_state_dict(rank.model, strict=True)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in rank.model.items()
               if isinstance(tensor, torch.Tensor)), rank.path
    return loaded


def assert_loaded_is_rank(loaded_path: Path, rank: Any) -> None:
    """What a megatron-core load job saved for one rank (``mcore_mamba_dist``) is that rank file's tensors, key for
    key, dtype and value."""
    loaded = torch.load(loaded_path, weights_only=True)
    tensors = {key: value for key, value in rank.model.items() if isinstance(value, torch.Tensor)}
    assert sorted(loaded) == sorted(tensors), rank.path
    for key, value in tensors.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), (rank.path, key)


def mamba_sharded_state_dict(model: MambaModel, dp_size: int = 1, dp_rank: int = 0) -> dict[str, Any]:
    """``model.sharded_state_dict()`` as in a run. megatron-core 0.16.1's Mamba modules ask parallel_state for
    groups where the GPT ones use their ``pg_collection`` (MambaLayer keeps no ``tp_group``, so
    ``MegatronModule.sharded_state_dict`` falls back to it; MambaMixer passes no group for its own parameters;
    ExtendedRMSNorm takes parallel_state's TP group): here parallel_state answers the model's TP group and the
    metadata's data-parallel group, as an initialised one does in a run."""
    metadata = sharded_metadata(dp_size, dp_rank)
    tp_group = model.decoder.tp_group
    with fake_group_queries(run_tp_group=tp_group), _attributes() as patch:
        patch(parallel_state, "get_tensor_model_parallel_group", lambda *args, **kwargs: tp_group)
        patch(parallel_state, "get_data_parallel_group", lambda *args, **kwargs: metadata["dp_cp_group"])
        return model.sharded_state_dict(metadata=metadata)
