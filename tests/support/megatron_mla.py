"""Test-only: megatron-core's GPTModel with multi-latent attention and MoE, built from Megatron args, on CPU.

The config is what Megatron-LM's ``core_transformer_config_from_args`` makes of the args
(MLATransformerConfig for ``--multi-latent-attention``, its yarn fields from args of the same name);
the spec is megatron-core's ``get_gpt_decoder_block_spec`` (local backend). What megatron-core
cannot do on CPU without Transformer Engine is swapped for one call (``mla_cpu_patches``):

* the core attention: MLA hands ``k_channels``/``v_channels`` to it, which only TE's attention takes
  (megatron-core's DotProductAttention raises TypeError), so ``CausalAttention`` stands in;
* ``multi_latent_attention.TELinear`` is a MagicMock stand-in without TE, which ``isinstance`` rejects;
* ``moe_utils.te_general_gemm`` is undefined without TE (the router's gating linear tests it).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import support.mcore_helpers as mcore
import torch
import torch.nn.functional as F


class CausalAttention(torch.nn.Module):
    """softmax(q k^T * softmax_scale + causal mask) v on [s, b, heads, d] tensors -> [s, b, heads * dv]."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 softmax_scale: float | None = None, k_channels: int | None = None, v_channels: int | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__()
        # Attention.__init__ builds one without a scale first; MultiLatentAttention replaces it.
        self.softmax_scale = softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, packed_seq_params: Any = None, **kwargs: Any) -> torch.Tensor:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        seq = q.shape[2]
        assert self.softmax_scale is not None, "the MLA core attention is built with megatron-core's scale"
        scores = (q @ k.transpose(-1, -2)) * self.softmax_scale
        future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        out = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
        return out.permute(2, 0, 1, 3).reshape(seq, q.shape[0], -1)


class _NoTELinear:
    pass


@contextlib.contextmanager
def mla_cpu_patches() -> Iterator[None]:
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla

    saved = (mla.TELinear, getattr(moe_utils, "te_general_gemm", _NoTELinear))
    mla.TELinear = _NoTELinear
    moe_utils.te_general_gemm = None
    try:
        with mcore.fake_group_queries(), mcore.restored_attention_backend_env(), mcore.cpu_forward_patches():
            yield
    finally:
        mla.TELinear = saved[0]
        if saved[1] is _NoTELinear:
            del moe_utils.te_general_gemm
        else:
            moe_utils.te_general_gemm = saved[1]


def mla_config(args: argparse.Namespace) -> Any:
    from megatron.core.transformer import MLATransformerConfig

    names = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
             "rotary_base", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_topk",
             "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups",
             "moe_router_group_topk", "moe_router_topk_scaling_factor", "moe_router_pre_softmax",
             "moe_shared_expert_intermediate_size")
    return MLATransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, gated_linear_unit=args.swiglu, activation_func=F.silu,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon, add_bias_linear=args.add_bias_linear,
        qk_layernorm=args.qk_layernorm, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=args.params_dtype,
        use_cpu_initialization=True, perform_initialization=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, num_moe_experts=args.num_experts,
        moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
        **{name: getattr(args, name) for name in names})


def build_mla_gpt_model(args: argparse.Namespace, core_attention: Any = CausalAttention,
                        config_fields: tuple[str, ...] = ()) -> Any:
    """The TP1/PP1/EP1 GPTModel of ``args`` with ``core_attention`` in every layer and ``config_fields`` of args set
    on its config as they are (fields 0.16.1's config may lack); call under ``mla_cpu_patches``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    config = mla_config(args)
    for name in config_fields:
        setattr(config, name, getattr(args, name))
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                      qk_l2_norm=False, vp_stage=None, pp_rank=0)
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = core_attention
    groups = mcore.fake_pg_collection(1, 1, 0, 0)
    mcore.add_expert_groups(groups, args)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        pg_collection=groups).eval()
