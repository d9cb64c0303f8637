"""Representative Megatron ``args`` and everything pgconvert reads from them, for the tests of the args table
(``pgconvert.formats.megatron_args``).

Each case is the ``args`` pgconvert writes for a model (``args_for_target``) plus the run settings a
Megatron-LM training run records; ``read_all`` runs every reader of ``args`` that does not need the
checkpoint's tensors (layout, model config, transformer impl, data-parallel size, param groups, flat
buffers, bucket padding, buffer dtypes, the target's sizes). ``RecordingArgs`` remembers every attribute
a reader asks for.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pgconvert.loaders.megatron import _detect_impl
from pgconvert.formats.megatron import args_for_target, config_from_args, layout_from_args
from pgconvert.model.config import ModelConfig
from pgconvert.model.grid import RankCoord
from pgconvert.model.layout import ParallelLayout
from pgconvert.optimizer.data_parallel import dp_size
from pgconvert.optimizer.flat import bucket_divisor, buffer_dtype_key, flat_buffers
from pgconvert.optimizer.order import OptimizerRules

ARGS_PATH = Path("ckpt/iter_0000001/mp_rank_00/model_optim_rng.pt")
PADDED_VOCAB = 256
_DENSE: dict[str, Any] = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                              ffn_hidden_size=128, vocab_size=250, max_position_embeddings=64)
# What a Megatron-LM training run records besides the model (its defaults, as validate_args leaves them).
_RUN: dict[str, Any] = dict(world_size=2, data_parallel_size=1, context_parallel_size=1, overlap_grad_reduce=False,
                            ddp_bucket_size=None, ddp_num_buckets=None, overlap_param_gather_with_optimizer_step=False,
                            ddp_pad_buckets_for_high_nccl_busbw=False, decoupled_lr=None, decoupled_min_lr=None,
                            apply_wd_to_qk_layernorm=False, accumulate_allreduce_grads_in_fp32=False,
                            moe_single_grouped_weight=False, moe_single_grouped_bias=False,
                            moe_use_legacy_grouped_gemm=False, layernorm_epsilon=1e-5,
                            use_rotary_position_embeddings=False, consumed_train_samples=8,
                            consumed_valid_samples=0, skipped_train_samples=0)


def _args(config: ModelConfig, layout: ParallelLayout, dtype: torch.dtype = torch.float32,
          **run: Any) -> argparse.Namespace:
    args = args_for_target(config, layout, PADDED_VOCAB, dtype, 1, argparse.Namespace(**_RUN))
    for name, value in run.items():
        if value is _DELETE:
            delattr(args, name)
        else:
            setattr(args, name, value)
    return args


_DELETE = object()
_MLA = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
            v_head_dim=16, rope_scaling="yarn", rope_scaling_factor=4.0, yarn_original_max_position_embeddings=16,
            yarn_mscale=1.0, yarn_mscale_all_dim=1.0, num_experts=4, moe_ffn_hidden_size=32,
            moe_router_num_groups=2, moe_router_group_topk=1, moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, mtp_num_layers=1)


def _cases() -> dict[str, Callable[[], argparse.Namespace]]:
    tp2, one = ParallelLayout(tp=2), ParallelLayout()
    return {
        "dense GQA SwiGLU": lambda: _args(ModelConfig(**_DENSE), tp2),
        "MHA GELU learned positions": lambda: _args(ModelConfig(
            **{**_DENSE, "num_query_groups": 4}, gated_linear_unit=False, activation="gelu", add_bias_linear=True,
            normalization="LayerNorm", position_embedding_type="learned_absolute", tie_embeddings=True), tp2),
        "MoE grouped GEMM": lambda: _args(ModelConfig(
            **_DENSE, num_experts=4, moe_ffn_hidden_size=32, moe_layer_freq=(0, 1), moe_grouped_gemm=True,
            moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True, transformer_impl="transformer_engine",
            moe_aux_loss_coeff=0.01), ParallelLayout(ep=2), torch.bfloat16, moe_grouped_gemm=True),
        "MLA (DeepSeek)": lambda: _args(ModelConfig(**_DENSE, **_MLA), ParallelLayout(pp=2)),
        "yarn": lambda: _args(ModelConfig(**_DENSE, rope_scaling="yarn", rope_scaling_factor=4.0,
                                          yarn_original_max_position_embeddings=16), one),
        "llama3 scaling": lambda: _args(ModelConfig(**_DENSE, rope_scaling="llama3", rope_scaling_factor=8.0), one),
        "sliding window": lambda: _args(ModelConfig(
            **_DENSE, sliding_window=8, window_layers=(1, 0), rotary_base_local=10000.0,
            attn_logit_softcapping=50.0, layernorm_zero_centered_gamma=True), one),
        "VPP fp16": lambda: _args(ModelConfig(**{**_DENSE, "num_layers": 4}), ParallelLayout(pp=2, vpp=2),
                                  torch.float16),
        "distributed optimizer": lambda: _args(ModelConfig(**_DENSE), tp2, torch.bfloat16, overlap_grad_reduce=True,
                                               use_distributed_optimizer=True, context_parallel_size=2, world_size=8,
                                               data_parallel_size=2, accumulate_allreduce_grads_in_fp32=True),
        # Megatron-LM's --optimizer muon without the distributed optimizer (as validate_args records it)
        "plain Muon": lambda: _args(ModelConfig(**_DENSE), tp2, torch.bfloat16, optimizer="muon",
                                    muon_scalar_optimizer="adam", use_layer_wise_distributed_optimizer=False,
                                    use_distributed_optimizer=False),
        # --optimizer muon --use-distributed-optimizer: the layer-wise distributed optimizer (validate_args turns
        # use_distributed_optimizer off)
        "layer-wise Muon": lambda: _args(ModelConfig(**_DENSE), tp2, torch.bfloat16, optimizer="muon",
                                         muon_scalar_optimizer="adam", use_layer_wise_distributed_optimizer=True,
                                         use_layer_wise_param_layout=True, use_distributed_optimizer=False),
        "hybrid Mamba (Nemotron-H)": lambda: _args(ModelConfig(
            **{**_DENSE, "num_layers": 4}, hybrid_override_pattern="M*M-", mamba_num_heads=8, mamba_head_dim=16,
            mamba_num_groups=2, mamba_state_dim=8, position_embedding_type="none", gated_linear_unit=False,
            activation="squared_relu", transformer_impl="transformer_engine"), tp2, torch.bfloat16),
        "gated delta net (Qwen3-Next)": lambda: _args(ModelConfig(
            **{**_DENSE, "num_layers": 4}, experimental_attention_variant="gated_delta_net", linear_attention_freq=(1, 1, 0, 1),
            # The heads megatron-core's defaults (16 key, 32 value), so a None read as the default still divides.
            linear_conv_kernel_dim=3, linear_key_head_dim=8, linear_value_head_dim=4, linear_num_key_heads=16,
            linear_num_value_heads=32, attention_output_gate=True, layernorm_zero_centered_gamma=True,
            transformer_impl="transformer_engine"), tp2, torch.bfloat16),
        "older Megatron-LM": lambda: _args(ModelConfig(**_DENSE), tp2, position_embedding_type=_DELETE,
                                           use_rotary_position_embeddings=True, norm_epsilon=_DELETE,
                                           layernorm_epsilon=1e-6, data_parallel_size=_DELETE, world_size=8),
    }


CASES: dict[str, Callable[[], argparse.Namespace]] = _cases()


def read_all(args: argparse.Namespace, strict: bool = False, notices: list[str] | None = None) -> dict[str, Any]:
    """What pgconvert's readers make of ``args`` (those that need no tensors)."""
    layout = layout_from_args(args, ARGS_PATH, strict, notices)
    impl = _detect_impl({}, args)
    config = config_from_args(args, ARGS_PATH, impl, None, grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)))
    dp = dp_size(args)
    rules = OptimizerRules.from_args(args, str(ARGS_PATH))
    # pgconvert does not carry a hybrid model's optimizer state (the Mamba and gated delta net parameters' order
    # is refused).
    buffers = (None if config.hybrid_override_pattern is not None
               or config.linear_attention.experimental_attention_variant is not None
               else flat_buffers(config, layout, RankCoord(0, 0, 0), rules, PADDED_VOCAB, args, dp))
    target = args_for_target(config, layout, PADDED_VOCAB, torch.float32, 1, args)
    return {"layout": layout, "config": config, "dp": dp, "rules": rules, "buffers": buffers,
            "bucket divisor": bucket_divisor(dp, args), "buffer dtypes": buffer_dtype_key(args),
            "target sizes": {name: getattr(target, name) for name in ("world_size", "data_parallel_size",
                                                                      "context_parallel_size")}}


def recording_class() -> tuple[type[argparse.Namespace], set[str]]:
    """A Namespace subclass that adds the name of every attribute read from its instances to the set."""
    reads: set[str] = set()

    class RecordingArgs(argparse.Namespace):
        def __getattribute__(self, name: str) -> Any:
            if not name.startswith("__"):
                reads.add(name)
            return super().__getattribute__(name)

    return RecordingArgs, reads
