"""Test-only: megatron-core 0.16.1's own GPTModel of a Qwen3-Next or Qwen3.5 checkpoint (TP1, PP1), built and run on
a CPU.

Megatron-LM's ``gpt_builder`` builds a model with ``--experimental-attention-variant gated_delta_net`` from
``get_transformer_block_with_experimental_attention_variant_spec`` (models/gpt/experimental_attention_variant_module_specs.py),
which takes Transformer Engine's modules only. The block here is made the same way, layer by layer: which layer
is a gated delta net and which is MoE come from megatron-core's own ``get_linear_attention_pattern`` and
``get_moe_layer_pattern``; a gated delta net layer is a TransformerLayer around megatron-core's ``GatedDeltaNet``
(no input norm of its own: it is fused into ``in_proj``), an attention layer megatron-core's ``SelfAttention``
(with ``attention_output_gate``), each with megatron-core's local MoE module (SequentialMLP experts, the shared
expert and its gate) or, in a dense layer, megatron-core's MLP. Only what stands for a Transformer Engine module is not megatron-core's:

- ``NormedColumnParallelLinear``: TELayerNormColumnParallelLinear's parameters (``layer_norm_weight``, ``weight``)
  and computation, a zero-centred RMSNorm (``1 + w``, TE's ``zero_centered_gamma``) then megatron-core's own
  ColumnParallelLinear (``in_proj``, ``linear_qkv``);
- ``ZeroCentredRMSNorm``: TENorm's ``weight`` and its zero-centred RMSNorm (the q/k norms, ``out_norm``, the
  pre-MLP and final norms; megatron-core's local norm refuses zero-centred gamma, ``transformer/torch_norm.py:26``);
- ``CoreAttention``: megatron-core's local DotProductAttention with TEDotProductAttention's ``_extra_state``.

GatedDeltaNet refuses to be built without flash-linear-attention (``HAVE_FLA``), whose ``l2norm`` its forward
calls: here ``l2norm`` is ``x / sqrt(sum(x^2) + 1e-6)`` (fla's ``l2norm_fwd``), and ``deterministic_mode``
selects megatron-core's own torch delta rule (``torch_chunk_gated_delta_rule``) over fla's kernel; with no
``causal_conv1d`` it runs its own ``nn.Conv1d``. Rank files are read as ``mcore_helpers.rank_files`` reads them
and compared with ``strict=True``; a distributed checkpoint's keys come from the model's own ``sharded_state_dict()``. Importing this module imports megatron-core.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Iterator
from pathlib import Path
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.nn.functional as F

import megatron.core.ssm.gated_delta_net as gated_delta_net
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.experimental_attention_variant_module_specs import (get_linear_attention_pattern,
                                                                                  get_moe_layer_pattern)
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.multi_token_prediction import (MultiTokenPredictionBlockSubmodules,
                                                               MultiTokenPredictionLayer,
                                                               MultiTokenPredictionLayerSubmodules)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from support.mcore_gpt_models import CONTENT_METADATA, sharded_metadata
from support.mcore_mtp_model import mtp_process_groups
from support.mcore_helpers import (McoreFakeGroup, RankLayout, copied_config_fields, cpu_forward_patches, expert_pg_collection,
                                   fake_group_queries, rank_files, restored_attention_backend_env)

CORE_ATTENTION_EXTRA_STATE = "self_attention.core_attention._extra_state"
# fla's l2norm epsilon (fla.modules.l2norm), as megatron-core's forward calls it.
L2NORM_EPS = 1e-6


def _zero_centred_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return ((1 + weight.float()) * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


class ZeroCentredRMSNorm(torch.nn.Module):
    """TENorm (RMSNorm, ``zero_centered_gamma``): ``(1 + weight) * x / rms(x)``."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        assert config.layernorm_zero_centered_gamma and config.normalization == "RMSNorm"
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _zero_centred_rms(x, self.weight, self.eps)


class NormedColumnParallelLinear(ColumnParallelLinear):
    """TELayerNormColumnParallelLinear: its zero-centred RMSNorm (``layer_norm_weight``), then the linear."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.layer_norm_weight = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))
        # te.pytorch.LayerNormLinear registers layer_norm_weight before weight: the order named_parameters() gives
        # megatron-core's optimizer and its flat buffers.
        self._parameters = type(self._parameters)(
            sorted(self._parameters.items(), key=lambda item: item[0] != "layer_norm_weight"))
        self.norm_eps = config.layernorm_epsilon

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return super().forward(_zero_centred_rms(x, self.layer_norm_weight, self.norm_eps), *args, **kwargs)


class CoreAttention(DotProductAttention):
    """megatron-core's local core attention, holding TEDotProductAttention's (empty) ``_extra_state``."""

    def get_extra_state(self) -> None:
        return None

    def set_extra_state(self, state: Any) -> None:
        pass


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = L2NORM_EPS) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(dim, keepdim=True) + eps)


def transformer_config(args: argparse.Namespace) -> TransformerConfig:
    """What Megatron-LM's ``core_transformer_config_from_args`` makes of a Qwen3-Next rank file's args (its
    TransformerConfig fields by name), for a CPU fp32 forward (no fusions, deterministic delta rule)."""
    fields = {**copied_config_fields(args), "moe_grouped_gemm": False}
    linear = {name: getattr(args, name) for name in (
        "experimental_attention_variant", "linear_attention_freq", "linear_conv_kernel_dim", "linear_key_head_dim",
        "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "attention_output_gate")}
    return TransformerConfig(
        **fields, **linear, num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None, kv_channels=args.kv_channels,
        ffn_hidden_size=args.ffn_hidden_size, gated_linear_unit=args.swiglu, activation_func=F.silu,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p, add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=args.params_dtype, use_cpu_initialization=True, perform_initialization=False,
        deterministic_mode=True, bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)


def _layer_spec(linear: bool, moe: bool, config: TransformerConfig) -> ModuleSpec:
    mixer = (ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
        in_proj=NormedColumnParallelLinear, out_norm=ZeroCentredRMSNorm, out_proj=RowParallelLinear)) if linear
        else ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                        submodules=SelfAttentionSubmodules(
                            linear_qkv=NormedColumnParallelLinear, core_attention=CoreAttention,
                            linear_proj=RowParallelLinear, q_layernorm=ZeroCentredRMSNorm,
                            k_layernorm=ZeroCentredRMSNorm)))
    if moe:
        pre_mlp_norm, mlp = ZeroCentredRMSNorm, get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts,
                                                                    moe_grouped_gemm=False)
    else:  # a dense MLP (Qwen3.5): its norm fused into linear_fc1, as TE's layer spec holds it
        pre_mlp_norm, mlp = IdentityOp, ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=NormedColumnParallelLinear, linear_fc2=RowParallelLinear))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=IdentityOp, self_attention=mixer, self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=pre_mlp_norm, mlp=mlp, mlp_bda=get_bias_dropout_add))


def block_spec(config: TransformerConfig) -> TransformerBlockSubmodules:
    """The block megatron-core's experimental-attention spec builds, layer for layer (PP1)."""
    layers = [_layer_spec(linear == 1, moe == 1 and config.num_moe_experts is not None, config)
              for linear, moe in zip(get_linear_attention_pattern(config), get_moe_layer_pattern(config))]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=ZeroCentredRMSNorm)


@contextmanager
def gated_delta_net_on_cpu(run_tp_group: Any = None) -> Iterator[None]:
    """GatedDeltaNet built and run without flash-linear-attention (the module docstring), on the CPU patches
    (``run_tp_group``: what a module built without a TP group takes, ``fake_group_queries``)."""
    with ExitStack() as stack:
        stack.enter_context(fake_group_queries(run_tp_group))
        stack.enter_context(restored_attention_backend_env())
        stack.enter_context(cpu_forward_patches())
        saved = (gated_delta_net.HAVE_FLA, getattr(gated_delta_net, "l2norm", None))
        gated_delta_net.HAVE_FLA, gated_delta_net.l2norm = True, _l2norm
        stack.callback(lambda: (setattr(gated_delta_net, "HAVE_FLA", saved[0]), setattr(gated_delta_net, "l2norm", saved[1])))
        yield


def build_qwen3_next_model(args: argparse.Namespace, layout: RankLayout, dp_size: int = 1,
                           dp_rank: int = 0) -> GPTModel:
    """megatron-core's GPTModel of one rank (any TP, PP1, EP1; data-parallel replica ``dp_rank`` of ``dp_size``)
    on fake groups, as ``gpt_builder`` builds it from ``args`` (the layout's sizes in place of the recorded ones)."""
    assert (layout.pp, layout.ep) == (1, 1), layout
    args = copy.copy(args)
    args.tensor_model_parallel_size = args.expert_tensor_parallel_size = layout.tp
    args.expert_model_parallel_size = 1
    config = transformer_config(args)
    groups = expert_pg_collection(layout.tp, 1, 1, layout.tp_rank, 0, 0)
    for name in ("dp", "dp_cp", "expt_dp"):
        setattr(groups, name, McoreFakeGroup(name, dp_size, dp_rank))
    config.mtp_num_layers = getattr(args, "mtp_num_layers", None)
    block = block_spec(config)
    # The MTP layer's eh_proj is built without a TP group: megatron-core then takes parallel_state's.
    with gated_delta_net_on_cpu(groups.tp), mtp_process_groups(groups):
        model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=args.padded_vocab_size,
                         max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
                         share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                         position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                         rotary_base=args.rotary_base, pg_collection=groups,
                         mtp_block_spec=mtp_block_spec(block, config.mtp_num_layers))
    return model.eval()


def mtp_block_spec(block: TransformerBlockSubmodules, layers: int | None) -> MultiTokenPredictionBlockSubmodules | None:
    """Megatron-LM's ``gpt_builder`` MTP block: ``layers`` of megatron-core's MultiTokenPredictionLayer around the
    last decoder layer's spec (TE's backend: its norms zero-centred, here the stand-in; eh_proj megatron-core's
    ColumnParallelLinear)."""
    if not layers:
        return None
    layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=ZeroCentredRMSNorm, hnorm=ZeroCentredRMSNorm, eh_proj=ColumnParallelLinear,
        transformer_layer=block.layer_specs[-1], layer_norm=ZeroCentredRMSNorm))
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * layers)


def mtp_layer_output(model: GPTModel, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The model's first MTP layer on ``hidden`` ([batch, seq, hidden]: the decoder's output) for tokens ``ids``, as
    GPTModel's forward calls it (the rotary embedding of the sequence, the causal mask, the model's embedding):
    [batch, seq, hidden]."""
    from support.mcore_helpers import causal_attention_mask

    seq = ids.shape[1]
    positions = torch.arange(seq)[None].expand_as(ids)
    with gated_delta_net_on_cpu(), mtp_process_groups(model.pg_collection), torch.no_grad():
        out = model.mtp.layers[0](input_ids=ids, position_ids=positions, hidden_states=hidden.transpose(0, 1),
                                  attention_mask=causal_attention_mask(seq), rotary_pos_emb=model.rotary_pos_emb(seq),
                                  embedding=model.embedding)
    return (out[0] if isinstance(out, tuple) else out).transpose(0, 1)


def qwen3_next_sharded_state_dict(model: GPTModel, dp_size: int = 1, dp_rank: int = 0) -> dict[str, Any]:
    """``model.sharded_state_dict()`` as in a run (data-parallel replica ``dp_rank`` of ``dp_size``), on the fake groups."""
    with fake_group_queries():
        return model.sharded_state_dict(metadata=sharded_metadata(dp_size, dp_rank))


def run_qwen3_next_rank(rank: int, world: int, spec: dict[str, Any]) -> None:
    """One rank of ``support.mcore_torch_dist_job``'s ``qwen3_next_*`` job.

    ``qwen3_next_save``: the rank loads its rank file of the TP-``world`` checkpoint ``source`` (``strict=True``) and
    ``dist_checkpointing.save`` writes the model's ``sharded_state_dict()`` to ``ckpt`` with that file's args.
    ``qwen3_next_load``: for each case (``name``, ``ckpt``, ``tp``) it builds rank ``rank % tp`` (the others are
    data-parallel replicas) from the checkpoint's own args, ``dist_checkpointing.load``s the model's
    ``sharded_state_dict()`` with ``strict="raise_all"``, then ``load_state_dict(strict=True)``; the first replica
    saves its tensors as ``<name>_rank_<tp rank>.pt``."""
    from megatron.core import dist_checkpointing

    if spec["action"] == "qwen3_next_save":
        source = rank_files(Path(spec["source"]))[rank]
        model = build_qwen3_next_model(source.args, source.layout)
        with fake_group_queries():
            model.load_state_dict(source.model, strict=True)
        state = {"args": source.args, "checkpoint_version": 3.0, "iteration": 100,
                 "model": qwen3_next_sharded_state_dict(model)}
        dist_checkpointing.save(state, spec["ckpt"], content_metadata=dict(CONTENT_METADATA))
        return
    for case in spec["cases"]:
        tp = case["tp"]
        args = dist_checkpointing.load_common_state_dict(case["ckpt"])["args"]
        model = build_qwen3_next_model(args, RankLayout(tp, 1, rank % tp, 0), world // tp, rank // tp)
        sharded = qwen3_next_sharded_state_dict(model, world // tp, rank // tp)
        loaded = dist_checkpointing.load({"model": sharded}, case["ckpt"], strict="raise_all")
        # TEDotProductAttention's sharded_state_dict holds no _extra_state (nor does the checkpoint): the stand-in's
        # empty one is given back as the model holds it; every other key is loaded strictly.
        state = {**{key: None for key in model.state_dict() if key.endswith(CORE_ATTENTION_EXTRA_STATE)},
                 **loaded["model"]}
        with fake_group_queries():
            model.load_state_dict(state, strict=True)
        if rank < tp:
            tensors = {name: value for name, value in model.state_dict().items() if not name.endswith("._extra_state")}
            torch.save(tensors, Path(spec["out"]) / f"{case['name']}_rank_{rank}.pt")
