"""Regenerate tests/data/megatron_args/: the ``args`` Megatron-LM's own ``parse_args`` + ``validate_args``
make of each way a setting can be spelled on its command line, and what its own
``core_transformer_config_from_args`` (and, at the newest commit, ``gpt_builder``) make of those args.

    python scripts/make_megatron_args_goldens.py [--git DIR] [--shims DIR] [VERSION ...]

``--git``: a git clone (bare is fine) of NVIDIA/Megatron-LM holding the commits of ``VERSIONS``
(default ``$PGCONVERT_MEGATRON_LM_GIT``); ``--shims``: the CPU shims of ``/work/shared/megatron_lm_cpu``
(default ``$PGCONVERT_MEGATRON_LM_CPU``). The Python running this script runs Megatron-LM too
(``$PGCONVERT_MEGATRON_LM_PYTHON`` to choose another): it needs torch and ``six`` besides
pgconvert's dependencies. Each version's tree is exported (``git archive``) to a temporary folder
and run in a child process (``--worker``) with ``PYTHONPATH=<shims>:<tree>``; the modules of that
tree that need Triton, Apex or a GPU at import time (``Version.stubs``: kernels, none of them used by
argument parsing) are replaced by empty modules.

The cases: every flag of every args field pgconvert reads (the rows of
``pgconvert.formats.megatron_args.MEGATRON_ARGS`` and the Megatron args of every
``pgconvert.semantics.SEMANTICS`` row) that the version's parser has, each alone on a small base
model (``field:<flag>``), with a value from ``FLAG_VALUES`` and the flags it needs from
``FLAG_CONTEXT``; plus ``SPELLINGS``: groups of command lines that spell one setting in several ways
(an older flag, an int or a list pattern, a flag left out). A new row gets its cases from here; a
flag with a value and no ``FLAG_VALUES`` entry stops the script, naming it.

Each golden ``<version>.json.gz`` (gzipped JSON, one case a line) holds, per case, its flags, the args fields pgconvert reads (JSON
values; tuples, torch dtypes, enums and functions tagged, see ``encode``), the TransformerConfig
attributes of ``CONFIG_ATTRIBUTES`` and megatron-core's own per-layer patterns. The tests
(tests/test_megatron_args_spellings.py) rebuild each ``argparse.Namespace`` with
``tests/support/megatron_args_goldens.py``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GOLDENS = Path(__file__).resolve().parents[1] / "tests" / "data" / "megatron_args"


@dataclass(frozen=True)
class Version:
    """One Megatron-LM commit: its git ref, its arguments module, the vocab-padding function a training
    run calls (``module:function``) and the modules stubbed at import."""

    ref: str
    arguments: str
    padding: str
    stubs: tuple[str, ...]


# Each spells some settings its own way: d98e8a64 --norm-epsilon/--apply-layernorm-1p into
# layernorm_epsilon/layernorm_zero_centered_gamma; core_v0.15.0 the same flags into norm_epsilon/
# apply_layernorm_1p; 23.08 --layernorm-epsilon into layernorm_epsilon.
VERSIONS: dict[str, Version] = {
    "d98e8a64": Version(
        "d98e8a64ddf34856e74b24714e3bedb2f5a39553", "megatron.training.arguments",
        "megatron.core.tokenizers.utils.build_tokenizer:vocab_size_with_padding",
        ("megatron.core.transformer.moe.ops.paged_stash", "megatron.core.ssm.ops.mamba2",
         "megatron.core.ssm.ops.common.causal_conv1d_varlen")),
    "core_v0.15.0": Version(
        "core_v0.15.0", "megatron.training.arguments", "megatron.training.tokenizer.tokenizer:_vocab_size_with_padding",
        ("megatron.core.inference.contexts.fused_kv_append_kernel",)),
    "23.08": Version("23.08", "megatron.arguments", "megatron.tokenizer.tokenizer:_vocab_size_with_padding",
                     ("apex", "amp_C")),
}

# A small model every case starts from (flags given later win: argparse keeps the last).
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--vocab-size", "255",
        "--tokenizer-type", "NullTokenizer"]
# What a CPU run of Megatron-LM gives (its fused kernels need a GPU or Transformer Engine); only those the
# version's parser has. None of them is an args field pgconvert reads.
CPU_FLAGS = ["--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
             "--no-bias-swiglu-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm"]
MOE = ["--num-experts", "4"]
MLA = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16", "--qk-head-dim", "16",
       "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--position-embedding-type", "rope"]

# A value that is not the flag's default, by args field (flags that take one).
FLAG_VALUES: dict[str, str] = {
    "tensor_model_parallel_size": "2", "pipeline_model_parallel_size": "2", "expert_model_parallel_size": "2",
    "expert_tensor_parallel_size": "2", "pipeline_model_parallel_layout": "Et|tt|tL",
    "decoder_first_pipeline_num_layers": "2", "decoder_last_pipeline_num_layers": "2",
    "num_layers": "6", "hidden_size": "128", "num_attention_heads": "8", "ffn_hidden_size": "96",
    "kv_channels": "32", "num_query_groups": "2", "position_embedding_type": "rope", "vocab_size": "100",
    "padded_vocab_size": "512", "max_position_embeddings": "32", "make_vocab_size_divisible_by": "64",
    "normalization": "RMSNorm", "layernorm_epsilon": "1e-06", "norm_epsilon": "1e-06", "rotary_base": "500000",
    "transformer_impl": "local", "mtp_num_layers": "1", "num_experts": "8", "moe_ffn_hidden_size": "32",
    "moe_layer_freq": "2", "moe_router_topk": "3", "moe_shared_expert_intermediate_size": "32",
    "moe_router_score_function": "sigmoid", "moe_router_topk_scaling_factor": "2.5", "moe_aux_loss_coeff": "0.01",
    "moe_router_num_groups": "2", "moe_router_group_topk": "1", "rotary_percent": "0.5", "rope_scaling_factor": "4.0",
    "rotary_seq_len_interpolation_factor": "2", "no_rope_freq": "2", "window_size": "(8,0)",
    "window_attn_skip_freq": "2", "rotary_scaling_factor": "4.0", "mscale": "0.707", "mscale_all_dim": "0.707",
    "yarn_original_max_position_embeddings": "8", "yarn_beta_fast": "16.0", "yarn_beta_slow": "2.0",
    "rope_type": "rope", "q_lora_rank": "16", "kv_lora_rank": "8", "qk_head_dim": "32", "qk_pos_emb_head_dim": "16",
    "v_head_dim": "32", "attention_dropout": "0.0", "hidden_dropout": "0.0", "softmax_type": "learnable",
    "glu_linear_offset": "1.0", "activation_func_clamp_value": "7.0", "context_parallel_size": "2",
    "ddp_bucket_size": "1000000", "ddp_num_buckets": "2", "decoupled_lr": "0.001", "decoupled_min_lr": "0.0001",
    "optimizer": "sgd", "muon_scalar_optimizer": "adam",
    "seq_length": "32", "hybrid_override_pattern": "M*M-", "mamba_state_dim": "16", "mamba_head_dim": "32",
    "mamba_num_groups": "2", "mamba_num_heads": "4", "experimental_attention_variant": "gated_delta_net",
    "linear_attention_freq": "4", "linear_conv_kernel_dim": "3", "linear_key_head_dim": "32",
    "linear_value_head_dim": "32", "linear_num_key_heads": "4", "linear_num_value_heads": "8",
    "mrope_section": "8",
}
# Flags a field's flag needs beside it (a MoE flag: experts; a YaRN flag: YaRN; a window: the window).
_YARN = ["--position-embedding-type", "yarn"]
FLAG_CONTEXT: dict[str, list[str]] = {
    **{name: MOE for name in (
        "expert_model_parallel_size", "expert_tensor_parallel_size", "moe_ffn_hidden_size", "moe_layer_freq",
        "moe_router_topk", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
        "moe_router_enable_expert_bias", "moe_grouped_gemm", "moe_router_score_function", "moe_router_pre_softmax",
        "moe_router_topk_scaling_factor", "moe_aux_loss_coeff", "moe_single_grouped_weight",
        "moe_single_grouped_bias")},
    "moe_grouped_gemm": [*MOE, "--bf16"],
    # megatron-core's experts take the probability on their input with top-1 routing only.
    "moe_apply_probs_on_input": [*MOE, "--moe-router-topk", "1", "--disable-bias-linear"],
    "moe_router_num_groups": [*MOE, "--moe-router-group-topk", "1", "--expert-model-parallel-size", "2"],
    "moe_router_group_topk": [*MOE, "--moe-router-num-groups", "2", "--expert-model-parallel-size", "2"],
    # pgconvert refuses shared-expert biases (add_bias_linear is Megatron-LM's default): named, not read
    "moe_shared_expert_intermediate_size": [*MOE, "--disable-bias-linear"],
    "moe_shared_expert_gate": [*MOE, "--disable-bias-linear", "--moe-shared-expert-intermediate-size", "32"],
    "expert_tensor_parallel_size": [*MOE, "--disable-bias-linear"],
    "moe_router_enable_expert_bias": [*MOE, "--moe-router-score-function", "sigmoid"],
    **{name: [*MOE, "--moe-grouped-gemm"] for name in ("moe_single_grouped_weight", "moe_single_grouped_bias")},
    "pipeline_model_parallel_layout": ["--pipeline-model-parallel-size", "3"],
    "decoder_first_pipeline_num_layers": ["--pipeline-model-parallel-size", "3"],
    "decoder_last_pipeline_num_layers": ["--pipeline-model-parallel-size", "3"],
    "num_query_groups": ["--group-query-attention"],
    "num_attention_heads": ["--kv-channels", "16"],
    "hidden_size": ["--num-attention-heads", "8"],
    "rope_scaling_factor": ["--position-embedding-type", "rope", "--use-rope-scaling"],
    "use_rope_scaling": ["--position-embedding-type", "rope"],
    "rotary_seq_len_interpolation_factor": ["--position-embedding-type", "rope"],
    "rotary_percent": ["--position-embedding-type", "rope"], "rotary_base": ["--position-embedding-type", "rope"],
    "rotary_interleaved": ["--position-embedding-type", "rope"], "no_rope_freq": ["--position-embedding-type", "rope"],
    **{name: _YARN for name in ("rotary_scaling_factor", "mscale", "mscale_all_dim",
                                "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
                                "yarn_correction_range_round_to_int")},
    "window_attn_skip_freq": ["--window-size", "(8,0)"],
    # The default 8 Mamba groups do not divide the base model's two Mamba heads (hidden 64, head dim 64).
    "hybrid_override_pattern": ["--mamba-num-groups", "2"],
    **{name: MLA for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                              "rope_type")},
    "multi_latent_attention": MLA[1:],
    "mtp_num_layers": ["--position-embedding-type", "rope"],
    "decoupled_min_lr": ["--decoupled-lr", "0.001"],
    "overlap_param_gather_with_optimizer_step": ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                                 "--overlap-param-gather", "--pipeline-model-parallel-size", "2",
                                                 "--num-layers-per-virtual-pipeline-stage", "1", "--ckpt-format", "torch"],
    "ddp_pad_buckets_for_high_nccl_busbw": ["--use-distributed-optimizer"],
    "sequence_parallel": ["--tensor-model-parallel-size", "2"],
    "fp16": ["--position-embedding-type", "rope"],
    "softmax_type": ["--position-embedding-type", "rope"],
    "glu_linear_offset": ["--swiglu"], "activation_func_clamp_value": [*MOE, "--swiglu"],
    "padded_vocab_size": [],
    "mrope_section": ["--position-embedding-type", "mrope"],
    # megatron-core's TransformerConfig asserts a pattern for gated delta net layers (and the TE spec builds them).
    "experimental_attention_variant": ["--linear-attention-freq", "4", "--transformer-impl", "transformer_engine"],
}
# Fields whose flags are not cases: sizes every case gives (BASE), and flags that only run-time checks
# read (no model setting, or refused by validate_args alone).
NO_FLAG_CASE = frozenset({"seq_length"})

# Groups of command lines that spell one setting in several ways: name -> [(variant, flags, versions)]
# (versions: the Megatron-LM versions whose parser has those flags; None: every version). The first
# variant is the group's canonical spelling; the tests say where variants mean different things.
_ROPE = ["--position-embedding-type", "rope"]
ALL = None
NEWER = ("d98e8a64", "core_v0.15.0")  # flags 23.08 does not have
SPELLINGS: dict[str, list[tuple[str, list[str], tuple[str, ...] | None]]] = {
    "norm epsilon": [
        ("--norm-epsilon", ["--norm-epsilon", "1e-6"], NEWER),
        ("--layernorm-epsilon", ["--layernorm-epsilon", "1e-6"], ("23.08",)),
    ],
    "norm epsilon absent": [("absent", [], ALL)],
    "zero-centred gamma": [("--apply-layernorm-1p", ["--apply-layernorm-1p"], ALL)],
    "rope": [
        ("--position-embedding-type rope", _ROPE, ALL),
        ("--use-rotary-position-embeddings", ["--use-rotary-position-embeddings"], ALL),
        ("--no-position-embedding --position-embedding-type rope", ["--no-position-embedding", *_ROPE], ALL),
    ],
    "no position embedding": [("--position-embedding-type none", ["--position-embedding-type", "none"],
                               NEWER)],
    "learned absolute": [
        ("absent", [], ALL),
        ("--position-embedding-type learned_absolute", ["--position-embedding-type", "learned_absolute"], ALL),
    ],
    "moe every other layer": [
        ("--moe-layer-freq 2", [*MOE, "--moe-layer-freq", "2"], NEWER),
        ("--moe-layer-freq [1,0]*2", [*MOE, "--moe-layer-freq", "[1,0]*2"], NEWER),
    ],
    "moe every layer": [
        ("--moe-layer-freq absent", MOE, ALL),
        ("--moe-layer-freq 1", [*MOE, "--moe-layer-freq", "1"], NEWER),
        ("--moe-layer-freq [1]*4", [*MOE, "--moe-layer-freq", "[1]*4"], NEWER),
    ],
    "window skip every other layer": [
        ("--window-attn-skip-freq 2", ["--window-size", "(8,0)", "--window-attn-skip-freq", "2"],
         NEWER),
        ("--window-attn-skip-freq [1,0]*2", ["--window-size", "(8,0)", "--window-attn-skip-freq", "[1,0]*2"],
         NEWER),
    ],
    "window every layer": [
        ("--window-attn-skip-freq absent", ["--window-size", "(8,0)"], NEWER),
        ("--window-attn-skip-freq [1]*4", ["--window-size", "(8,0)", "--window-attn-skip-freq", "[1]*4"],
         NEWER),
    ],
    "no rope every other layer": [
        ("--no-rope-freq 2", [*_ROPE, "--no-rope-freq", "2"], NEWER),
        ("--no-rope-freq [0,1]*2", [*_ROPE, "--no-rope-freq", "[0,1]*2"], NEWER),
    ],
    "swiglu ffn": [
        ("--swiglu", ["--swiglu"], ALL),
        ("--swiglu --ffn-hidden-size 128", ["--swiglu", "--ffn-hidden-size", "128"], ALL),
    ],
    "ffn": [
        ("absent", [], ALL),
        ("--ffn-hidden-size 256", ["--ffn-hidden-size", "256"], ALL),
    ],
    "head dim": [
        ("--kv-channels 32", ["--kv-channels", "32"], ALL),
    ],
    "head dim derived": [
        ("absent", [], ALL),
        ("--kv-channels 16", ["--kv-channels", "16"], ALL),
    ],
    "query groups": [
        ("--group-query-attention --num-query-groups 2", ["--group-query-attention", "--num-query-groups", "2"], ALL),
    ],
    "multi-query": [
        ("--group-query-attention", ["--group-query-attention"], ALL),
        ("--group-query-attention --num-query-groups 1", ["--group-query-attention", "--num-query-groups", "1"], ALL),
    ],
    "multi-head": [
        ("absent", [], ALL),
        ("--num-query-groups 2 alone", ["--num-query-groups", "2"], ALL),
        ("--group-query-attention --num-query-groups 4", ["--group-query-attention", "--num-query-groups", "4"], ALL),
    ],
    "llama3 rope scaling": [
        ("--use-rope-scaling", [*_ROPE, "--use-rope-scaling"], NEWER),
        ("--use-rope-scaling --rope-scaling-factor 8", [*_ROPE, "--use-rope-scaling", "--rope-scaling-factor", "8"],
         NEWER),
    ],
    "yarn": [
        ("--position-embedding-type yarn", _YARN, ("d98e8a64",)),
        ("--position-embedding-type yarn with its defaults",
         [*_YARN, "--rotary-scaling-factor", "1.0", "--yarn-original-max-position-embeddings", "4096",
          "--yarn-beta-fast", "32", "--yarn-beta-slow", "1", "--mscale", "1.0", "--mscale-all-dim", "0.0",
          "--yarn-correction-range-round-to-int"], ("d98e8a64",)),
    ],
    "yarn scaled": [
        ("--position-embedding-type yarn scaled",
         [*_YARN, "--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "8",
          "--no-yarn-correction-range-round-to-int"], ("d98e8a64",)),
    ],
    "mla yarn": [
        ("--multi-latent-attention (rope_type yarn by default)", MLA, NEWER),
        ("--multi-latent-attention --rope-type yarn", [*MLA, "--rope-type", "yarn"], NEWER),
    ],
    "mla rope": [("--multi-latent-attention --rope-type rope", [*MLA, "--rope-type", "rope"],
                  NEWER)],
    "moe router": [
        ("--moe-router-score-function sigmoid --moe-router-enable-expert-bias ...",
         [*MOE, "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
          "--moe-router-topk-scaling-factor", "2.5", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"],
         NEWER),
    ],
    "moe defaults": [
        ("--num-experts alone", MOE, ALL),
        ("--num-experts with Megatron's defaults",
         [*MOE, "--moe-router-topk", "2", "--moe-router-score-function", "softmax", "--moe-aux-loss-coeff", "0.0"],
         NEWER),
    ],
    "untied": [("--untie-embeddings-and-output-weights", ["--untie-embeddings-and-output-weights"], ALL)],
    "qk-norm": [("--qk-layernorm", ["--qk-layernorm"], NEWER)],
    "biases": [
        ("absent (bias on)", [], ALL),
    ],
    "no biases": [("--disable-bias-linear", ["--disable-bias-linear"], ALL)],
    "qkv bias only": [("--disable-bias-linear --add-qkv-bias", ["--disable-bias-linear", "--add-qkv-bias"],
                       NEWER)],
    "rmsnorm": [("--normalization RMSNorm", ["--normalization", "RMSNorm"], ALL)],
    "gelu": [("absent", [], ALL)],
    "openai gelu": [("--openai-gelu", ["--openai-gelu"], ALL)],
    "squared relu": [("--squared-relu", ["--squared-relu"], ALL)],
    "llama": [
        ("llama flags", [*_ROPE, "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
                         "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2",
                         "--ffn-hidden-size", "128"], ALL),
    ],
    "virtual pipeline": [
        ("--num-layers-per-virtual-pipeline-stage 1", ["--pipeline-model-parallel-size", "2",
                                                        "--num-layers-per-virtual-pipeline-stage", "1"], NEWER),
        ("--num-virtual-stages-per-pipeline-rank 2", ["--pipeline-model-parallel-size", "2",
                                                       "--num-virtual-stages-per-pipeline-rank", "2"],
         NEWER),
    ],
    "expert tensor parallel": [
        ("--expert-tensor-parallel-size absent", [*MOE, "--tensor-model-parallel-size", "2",
                                                  "--disable-bias-linear"], NEWER),
        ("--expert-tensor-parallel-size 2", [*MOE, "--tensor-model-parallel-size", "2", "--disable-bias-linear",
                                             "--expert-tensor-parallel-size", "2"], NEWER),
    ],
    "bf16": [("--bf16", ["--bf16"], ALL)],
}

# TransformerConfig attributes the tests compare with pgconvert's reading (those that exist on the version).
CONFIG_ATTRIBUTES = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
    "gated_linear_unit", "activation_func", "normalization", "layernorm_epsilon", "layernorm_zero_centered_gamma",
    "add_bias_linear", "add_qkv_bias", "qk_layernorm", "rotary_interleaved", "window_size", "window_attn_skip_freq",
    "no_rope_freq", "num_moe_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_topk",
    "moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
    "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_grouped_gemm", "moe_aux_loss_coeff",
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings",
    "beta_fast", "beta_slow", "rotary_base", "rotary_percent", "attention_dropout", "hidden_dropout",
    "softmax_scale", "softmax_type", "glu_linear_offset", "activation_func_clamp_value", "params_dtype",
    "mtp_num_layers", "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "virtual_pipeline_model_parallel_size", "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage", "pipeline_model_parallel_layout", "yarn_rotary_scaling_factor",
    "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale",
    "yarn_mscale_all_dim", "yarn_correction_range_round_to_int",
)
# Args fields recorded beside the ones pgconvert reads (what a reader of a run's args also sees).
EXTRA_FIELDS = ("add_position_embedding", "squared_relu", "num_layers_per_virtual_pipeline_stage",
                "num_virtual_stages_per_pipeline_rank", "seq_length", "use_distributed_optimizer")


def pgconvert_fields() -> list[str]:
    """Every args field pgconvert reads: the args table's rows and the SEMANTICS rows' Megatron args."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pgconvert.formats.megatron_args import MEGATRON_ARGS
    from pgconvert.semantics import SEMANTICS

    names = [row.name for row in MEGATRON_ARGS] + [name for row in SEMANTICS for name in row.megatron]
    return list(dict.fromkeys(names))


def spelling_cases(version: str) -> list[dict[str, Any]]:
    """The ``SPELLINGS`` variants that ``version`` can parse."""
    return [{"name": f"{group}: {variant}", "group": group, "variant": variant, "flags": flags}
            for group, variants in SPELLINGS.items() for variant, flags, versions in variants
            if versions is None or version in versions]


# --- the worker: runs inside the Megatron-LM tree ------------------------------------------------------------

def encode(value: Any) -> Any:
    """A JSON value for an args or config value: tuples, torch dtypes, enums and functions tagged."""
    import enum

    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [encode(item) for item in value]}
    if isinstance(value, list):
        return [encode(item) for item in value]
    if isinstance(value, dict):
        return {"dict": {str(key): encode(item) for key, item in value.items()}}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, enum.Enum):
        return {"enum": f"{type(value).__module__}.{type(value).__qualname__}", "name": value.name}
    if callable(value):
        return {"function": getattr(value, "__name__", repr(value))}
    return {"repr": repr(value)}


def _stub_finder(names: tuple[str, ...]) -> Any:
    """A meta-path finder that makes every module named in ``names`` (and under it) an empty package."""
    import importlib.abc
    import importlib.machinery
    import types

    class Stub(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            value = type(name, (), {"__init__": lambda self, *a, **k: None})
            setattr(self, name, value)
            return value

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if any(fullname == name or fullname.startswith(name + ".") for name in names):
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec: Any) -> Any:
            module = Stub(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module: Any) -> None:
            return None

    return Finder()


def _base(parser: argparse.ArgumentParser) -> list[str]:
    """``BASE`` and the ``CPU_FLAGS`` the parser has."""
    return [*BASE, *(flag for flag in CPU_FLAGS if flag in parser._option_string_actions)]


def _parser(arguments: Any) -> argparse.ArgumentParser:
    """The parser the version's ``parse_args`` builds (caught as it parses ``BASE``)."""
    caught: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_args

    def catching(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        caught.append(self)
        return original(self, *args, **kwargs)

    argparse.ArgumentParser.parse_args = catching  # type: ignore[method-assign]
    try:
        sys.argv = ["pretrain_gpt.py", *BASE]
        arguments.parse_args()
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    return caught[-1]


def field_cases(parser: argparse.ArgumentParser, fields: list[str]) -> list[dict[str, Any]]:
    """One case per flag of each of ``fields`` the parser has, alone on ``BASE`` with its context."""
    cases = []
    for action in parser._actions:
        if action.dest not in fields or action.dest in NO_FLAG_CASE or not action.option_strings:
            continue
        for flag in action.option_strings:
            takes_value = action.nargs != 0
            if takes_value and action.dest not in FLAG_VALUES:
                raise SystemExit(f"no FLAG_VALUES entry for args.{action.dest} ({flag}): add a non-default value")
            value = [FLAG_VALUES[action.dest]] if takes_value else []
            cases.append({"name": f"field:{flag}", "group": f"field:{action.dest}", "variant": flag,
                          "flags": [*_context(parser, action.dest), flag, *value]})
    return cases


def _context(parser: argparse.ArgumentParser, dest: str) -> list[str]:
    """``FLAG_CONTEXT[dest]``; a YaRN flag of a version without ``--position-embedding-type yarn``: MLA's."""
    context = FLAG_CONTEXT.get(dest, [])
    choices = parser._option_string_actions["--position-embedding-type"].choices or ()
    return MLA if context == _YARN and "yarn" not in choices else context


def _world_size(flags: list[str]) -> int:
    """tp * pp * cp * ep * expert tp: a world where every size the flags give divides."""
    world = 1
    for name in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                 "--expert-model-parallel-size", "--expert-tensor-parallel-size"):
        if name in flags:
            world *= int(flags[len(flags) - 1 - flags[::-1].index(name) + 1])
    return world


def _layer_patterns(config: Any, args: Any) -> dict[str, Any]:
    """megatron-core's own per-layer patterns: MoE layers, windowed layers, layers without RoPE."""
    patterns: dict[str, Any] = {}
    try:
        from megatron.core.transformer.utils import is_layer_window_attention
        patterns["window"] = [int(is_layer_window_attention(config.window_size, config.window_attn_skip_freq, n))
                              for n in range(1, config.num_layers + 1)]
    except ImportError:
        pass
    try:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    except ImportError:  # older megatron-core: the pattern is inside get_gpt_decoder_block_spec
        return patterns
    if getattr(config, "num_moe_experts", None):
        specs = get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization=args.normalization)
        patterns["moe"] = [int(_built_class(spec.submodules.mlp).__name__ == "MoELayer") for spec in specs]
    return patterns


def _built_class(mlp: Any) -> type:
    """The class an MLP spec builds: a ModuleSpec's ``module`` or a ``functools.partial``'s function."""
    built = getattr(mlp, "module", None) or getattr(mlp, "func", None)
    return getattr(built, "__self__", built)


def _gpt_model_kwargs(args: Any, config: Any) -> dict[str, Any] | None:
    """The GPTModel arguments Megatron-LM's ``gpt_builder`` passes (the model class and specs stubbed)."""
    try:
        import gpt_builders
    except ImportError:
        return None
    caught: dict[str, Any] = {}
    saved = {name: getattr(gpt_builders, name) for name in (
        "GPTModel", "_get_transformer_layer_spec", "get_gpt_decoder_block_spec", "get_gpt_mtp_block_spec",
        "get_gpt_decoder_layer_specs", "get_transformer_block_with_experimental_attention_variant_spec",
        "get_transformer_layer_with_experimental_attention_variant_spec") if hasattr(gpt_builders, name)}
    gpt_builders.GPTModel = lambda **kwargs: caught.update(kwargs)
    for name in saved:
        if name != "GPTModel":
            setattr(gpt_builders, name, lambda *a, **k: [None])
    try:
        gpt_builders.gpt_builder(args, True, True, config=config)
    finally:
        for name, value in saved.items():
            setattr(gpt_builders, name, value)
    keep = ("vocab_size", "max_sequence_length", "share_embeddings_and_output_weights", "position_embedding_type",
            "rotary_percent", "rotary_base", "rope_scaling", "rope_scaling_factor", "seq_len_interpolation_factor")
    return {name: encode(caught[name]) for name in keep if name in caught}


def run_case(arguments: Any, version: Version, case: dict[str, Any], fields: list[str],
             base: list[str]) -> dict[str, Any]:
    """parse_args + validate_args on ``BASE`` + the case's flags; the recorded fields and config."""
    import importlib

    flags = case["flags"]
    os.environ["WORLD_SIZE"] = str(_world_size(flags))
    sys.argv = ["pretrain_gpt.py", *base, *flags]
    try:
        args = arguments.parse_args()
        arguments.validate_args(args, {})
    except (Exception, SystemExit) as exc:  # a spelling Megatron-LM refuses: recorded as such
        return {**case, "refused": f"{type(exc).__name__}: {exc}"[:300]}
    module, function = version.padding.split(":")
    args.padded_vocab_size = getattr(importlib.import_module(module), function)(args.vocab_size, args)
    record = {**case, "world_size": int(os.environ["WORLD_SIZE"]),
              "args": {name: encode(getattr(args, name)) for name in fields if hasattr(args, name)}}
    try:
        config = arguments.core_transformer_config_from_args(args)
    except (ValueError, AssertionError) as exc:  # megatron-core's checks of this machine (no Transformer Engine)
        return {**record, "transformer_config_error": f"{type(exc).__name__}: {exc}"[:300]}
    record["transformer_config"] = {name: encode(getattr(config, name)) for name in CONFIG_ATTRIBUTES
                                    if hasattr(config, name)}
    record["layers"] = _layer_patterns(config, args)
    record["gpt_model"] = _gpt_model_kwargs(args, config)
    return record


def worker(version_name: str, request: Path, output: Path) -> None:
    """Inside the Megatron-LM tree: every case of ``request`` (fields, spelling cases) into ``output``."""
    import contextlib
    import importlib
    import io
    import logging

    version = VERSIONS[version_name]
    sys.meta_path.insert(0, _stub_finder(version.stubs))
    logging.disable(logging.WARNING)
    wanted = json.loads(request.read_text())
    fields = wanted["fields"]
    recorded = list(dict.fromkeys([*fields, *EXTRA_FIELDS]))
    with contextlib.redirect_stdout(io.StringIO()):
        arguments = importlib.import_module(version.arguments)
        parser = _parser(arguments)
        base = _base(parser)
        written = set(vars(parser.parse_args(base)))
        cases = field_cases(parser, fields) + wanted["spellings"]
        plain = run_case(arguments, version, {"name": "base", "flags": []}, recorded, base)
        records = [_difference(run_case(arguments, version, case, recorded, base), plain) for case in cases]
    flags = {action.dest: action.option_strings for action in parser._actions
             if action.dest in fields and action.option_strings}
    head: dict[str, Any] = {"version": version_name, "ref": version.ref, "base": base, "flags": flags,
            "uncased_fields": sorted(NO_FLAG_CASE),
            "absent_fields": sorted(set(recorded) - written), "base_args": plain["args"],
            "base_transformer_config": plain["transformer_config"], "base_layers": plain["layers"],
            "base_gpt_model": plain["gpt_model"]}
    lines = ",\n".join(json.dumps(record, sort_keys=True) for record in records)
    output.write_text(json.dumps(head, indent=1)[:-2] + ',\n "cases": [\n' + lines + "\n]}\n")


def _write_gzip(path: Path, text: str) -> None:
    """``text`` gzipped into ``path`` (no file name or time in the header: the same text, the same bytes)."""
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as packed:
        packed.write(text.encode())


def _difference(record: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """``record`` with its args and TransformerConfig values that equal the base case's left out."""
    for key in ("args", "transformer_config", "layers", "gpt_model"):
        if record.get(key) is not None and plain.get(key) is not None:
            record[key] = {name: value for name, value in record[key].items()
                           if name not in plain[key] or plain[key][name] != value}
    record.pop("name")  # the tests name a case by its group and variant
    return record


# --- the driver ------------------------------------------------------------------------------------------

def _commit(git: Path, ref: str) -> str:
    return subprocess.run(["git", "--git-dir", str(git), "rev-parse", f"{ref}^{{commit}}"], check=True,
                          capture_output=True, text=True).stdout.strip()


def make(version_name: str, git: Path, shims: Path, python: str) -> Path:
    """Export the version's tree, run the worker in it, write the golden; its path."""
    version = VERSIONS[version_name]
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp, "megatron-lm")
        tree.mkdir()
        archive = subprocess.run(["git", "--git-dir", str(git), "archive", version.ref], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        request = Path(tmp, "request.json")
        request.write_text(json.dumps({"fields": pgconvert_fields(), "spellings": spelling_cases(version_name)}))
        output = Path(tmp, f"{version_name}.json")
        env = dict(os.environ, PYTHONPATH=f"{shims}:{tree}", CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONWARNINGS="ignore")
        subprocess.run([python, __file__, "--worker", version_name, str(request), str(output)], check=True,
                       env=env, cwd=tmp)
        text = output.read_text()
    golden = GOLDENS / f"{version_name}.json.gz"
    _write_gzip(golden, '{\n "commit": ' + json.dumps(_commit(git, version.ref)) + "," + text[1:])
    return golden


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        worker(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--git", type=Path, default=os.environ.get("PGCONVERT_MEGATRON_LM_GIT"))
    parser.add_argument("--shims", type=Path, default=os.environ.get("PGCONVERT_MEGATRON_LM_CPU"))
    parser.add_argument("versions", nargs="*", help=f"of {', '.join(VERSIONS)} (default: all)")
    options = parser.parse_args()
    unknown = sorted(set(options.versions) - set(VERSIONS))
    if unknown:
        parser.error(f"unknown versions {unknown}: choose from {', '.join(VERSIONS)}")
    if options.git is None or options.shims is None:
        parser.error("give --git and --shims (or PGCONVERT_MEGATRON_LM_GIT and PGCONVERT_MEGATRON_LM_CPU)")
    python = os.environ.get("PGCONVERT_MEGATRON_LM_PYTHON", sys.executable)
    GOLDENS.mkdir(parents=True, exist_ok=True)
    for name in options.versions or VERSIONS:
        path = make(name, options.git, options.shims, python)
        cases = json.loads(gzip.decompress(path.read_bytes()))["cases"]
        refused = [case["name"] for case in cases if "refused" in case]
        print(f"{path}: {len(cases)} cases, {len(refused)} refused by Megatron-LM: {refused}")


if __name__ == "__main__":
    main()
