"""The args Megatron-LM's own ``parse_args`` + ``validate_args`` made of each spelling of a setting
(tests/data/megatron_args/, made by scripts/make_megatron_args_goldens.py), rebuilt as the
``argparse.Namespace`` a checkpoint holds, and what megatron-core's ``TransformerConfig`` (and
Megatron-LM's ``gpt_builder``) made of them, as the values pgconvert's ``ModelConfig`` and
``ParallelLayout`` hold.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

GOLDENS = Path(__file__).resolve().parents[1] / "data" / "megatron_args"
VERSIONS = ("d98e8a64", "core_v0.15.0", "23.08")
# megatron-core's activation functions, by name, as pgconvert names them (core_transformer_config_from_args:
# --swiglu F.silu, --quick-geglu quick_gelu, --squared-relu squared_relu; otherwise F.gelu).
ACTIVATION_NAMES = {"silu": "silu", "gelu": "gelu", "quick_gelu": "quick_gelu", "squared_relu": "squared_relu"}


def decode(value: Any) -> Any:
    """A golden's JSON value as Megatron-LM held it (tuples and torch dtypes rebuilt; functions and
    enums as their names)."""
    if isinstance(value, list):
        return [decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    if "tuple" in value:
        return tuple(decode(item) for item in value["tuple"])
    if "dtype" in value:
        return getattr(torch, value["dtype"])
    if "dict" in value:
        return {key: decode(item) for key, item in value["dict"].items()}
    if "function" in value:
        return value["function"]
    if "enum" in value:
        return f"{value['enum']}.{value['name']}"
    if "repr" in value:  # an object of megatron-core's (a parsed pipeline layout): its text
        return value["repr"]
    raise ValueError(f"unknown golden value {value!r}")


@dataclass(frozen=True)
class GoldenCase:
    """One command line of one Megatron-LM version and what Megatron-LM made of it."""

    version: str
    name: str
    group: str
    variant: str
    flags: tuple[str, ...]
    args: dict[str, Any]
    transformer_config: dict[str, Any] | None
    layers: dict[str, list[int]]
    gpt_model: dict[str, Any] | None

    @property
    def id(self) -> str:
        return f"{self.version} {self.name}"

    def namespace(self) -> argparse.Namespace:
        """The args a checkpoint of this run holds."""
        return argparse.Namespace(**self.args)


@cache
def golden(version: str) -> dict[str, Any]:
    return json.loads(gzip.decompress((GOLDENS / f"{version}.json.gz").read_bytes()))


@cache
def cases() -> tuple[GoldenCase, ...]:
    """Every case Megatron-LM accepted, of every version (refused spellings: no checkpoint holds them)."""
    found = []
    for version in VERSIONS:
        data = golden(version)
        for case in data["cases"]:
            if "refused" in case:
                continue
            config, model = case.get("transformer_config"), case.get("gpt_model")
            group, variant = case["group"], case["variant"]
            found.append(GoldenCase(
                version, f"field:{variant}" if group.startswith("field:") else f"{group}: {variant}", group, variant,
                tuple(case["flags"]),
                {name: decode(value) for name, value in {**data["base_args"], **case["args"]}.items()},
                None if config is None else {name: decode(value) for name, value in
                                             {**data["base_transformer_config"], **config}.items()},
                {} if config is None else {**data["base_layers"], **case.get("layers", {})},
                None if model is None or data["base_gpt_model"] is None else {**data["base_gpt_model"], **model}))
    return tuple(found)


def spelling_groups() -> dict[str, list[GoldenCase]]:
    """The cases of each spelling group (every version), canonical spelling first."""
    groups: dict[str, list[GoldenCase]] = {}
    for case in cases():
        if not case.group.startswith("field:"):
            groups.setdefault(case.group, []).append(case)
    for members in groups.values():
        members.sort(key=lambda case: (VERSIONS.index(case.version) != 0, VERSIONS.index(case.version)))
    return groups


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12)
    return bool(a == b)


def megatron_core_values(case: GoldenCase) -> dict[str, Any]:
    """What megatron-core computes with, by pgconvert's ``ModelConfig`` setting name, from the case's
    TransformerConfig and GPTModel arguments (only the settings they hold)."""
    config = case.transformer_config or {}
    values: dict[str, Any] = {}
    direct = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "kv_channels",
              "gated_linear_unit", "normalization", "layernorm_zero_centered_gamma", "add_bias_linear", "add_qkv_bias",
              "qk_layernorm", "rotary_interleaved", "moe_router_topk", "moe_router_score_function",
              "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
              "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_grouped_gemm",
              "multi_latent_attention", "attention_dropout", "hidden_dropout", "softmax_scale", "softmax_type",
              "glu_linear_offset", "activation_func_clamp_value", "mtp_num_layers")
    values.update({name: config[name] for name in direct if name in config})
    if "add_qkv_bias" not in config and "add_bias_linear" in config:
        # Megatron-LM 23.08's megatron-core has no add_qkv_bias: linear_qkv's bias is add_bias_linear's
        # (megatron/core/transformer/attention.py:263, bias=self.config.add_bias_linear).
        values["add_qkv_bias"] = config["add_bias_linear"]
    if "num_query_groups" in config:
        values["num_query_groups"] = config["num_query_groups"]
    if "layernorm_epsilon" in config:
        values["norm_epsilon"] = config["layernorm_epsilon"]
    if "activation_func" in config:
        values["activation"] = ACTIVATION_NAMES.get(config["activation_func"], config["activation_func"])
    if "params_dtype" in config:
        values["params_dtype"] = str(config["params_dtype"]).removeprefix("torch.")
    if "mtp_num_layers" in config:
        values["mtp_num_layers"] = config["mtp_num_layers"] or 0  # pgconvert's "no MTP" is 0
    values.update(_moe_values(config))
    values.update(_mla_values(config))
    return {**values, **_gpt_model_values(case)}


def _moe_values(config: dict[str, Any]) -> dict[str, Any]:
    if "num_moe_experts" not in config:  # Megatron-LM 23.08: megatron-core has no experts (the legacy model's)
        return {}
    if not config["num_moe_experts"]:
        return {"num_experts": None}
    coeff = config.get("moe_aux_loss_coeff", 0.0)
    groups = {"moe_router_num_groups": config.get("moe_router_num_groups"),
              "moe_router_group_topk": config.get("moe_router_group_topk")}
    return {"num_experts": config["num_moe_experts"], "moe_ffn_hidden_size": config.get("moe_ffn_hidden_size"),
            "moe_aux_loss_coeff": coeff[0] if isinstance(coeff, list) and len(coeff) == 1 else coeff,
            **(groups if None not in groups.values() else {})}


def _mla_values(config: dict[str, Any]) -> dict[str, Any]:
    if not config.get("multi_latent_attention"):
        return {}
    values = {name: config[name] for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                                              "v_head_dim")}
    if config.get("rope_type") == "yarn":
        values.update(rope_scaling="yarn", rope_scaling_factor=config["rotary_scaling_factor"],
                      yarn_mscale=config["mscale"], yarn_mscale_all_dim=config["mscale_all_dim"],
                      yarn_original_max_position_embeddings=config["original_max_position_embeddings"],
                      yarn_beta_fast=config["beta_fast"], yarn_beta_slow=config["beta_slow"])
    else:
        values["rope_scaling"] = None
    return values


def _gpt_model_values(case: GoldenCase) -> dict[str, Any]:
    """What Megatron-LM's gpt_builder hands GPTModel (d98e8a64 and core_v0.15.0), and YaRN's config."""
    model, config = case.gpt_model, case.transformer_config or {}
    if not model:
        return {}
    position = model["position_embedding_type"]
    values = {"max_position_embeddings": model["max_sequence_length"],
              "tie_embeddings": model["share_embeddings_and_output_weights"],
              "position_embedding_type": "rope" if position == "yarn" else position,
              "rotary_percent": model["rotary_percent"], "rotary_base": float(model["rotary_base"])}
    if position == "yarn" and not config.get("multi_latent_attention"):
        values.update(rope_scaling="yarn", rope_scaling_factor=config["yarn_rotary_scaling_factor"],
                      **{name: config[name] for name in (
                          "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale",
                          "yarn_mscale_all_dim", "yarn_correction_range_round_to_int")})
    elif model["rope_scaling"]:
        values["rope_scaling"] = "llama3"
    return values


def megatron_core_layout(case: GoldenCase) -> dict[str, Any]:
    """The parallel layout megatron-core's TransformerConfig holds, by ``ParallelLayout`` attribute."""
    config = case.transformer_config or {}
    names = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
             "first_stage_layers": "num_layers_in_first_pipeline_stage",
             "last_stage_layers": "num_layers_in_last_pipeline_stage", "pipeline_layout": "pipeline_model_parallel_layout"}
    values = {name: config[attribute] for name, attribute in names.items() if attribute in config}
    if "virtual_pipeline_model_parallel_size" in config:
        values["vpp"] = config["virtual_pipeline_model_parallel_size"]
    if config.get("num_moe_experts"):
        values.update(ep=config["expert_model_parallel_size"], expert_tp_size=config["expert_tensor_parallel_size"])
    return values


def megatron_core_layers(case: GoldenCase) -> dict[str, list[int]]:
    """megatron-core's per-layer patterns: MoE and windowed layers (``get_gpt_decoder_layer_specs``,
    ``is_layer_window_attention``) and, in a RoPE model, the layers that rotate (``no_rope_freq``)."""
    patterns = dict(case.layers)
    config = case.transformer_config or {}
    model = case.gpt_model or {}
    if model.get("position_embedding_type") in ("rope", "yarn") and "no_rope_freq" in config:
        skipped = config["no_rope_freq"] or [0] * config["num_layers"]
        patterns["rope"] = [1 - int(skip) for skip in skipped]
    return patterns


def differing(expected: dict[str, Any], read: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The settings where ``read`` (pgconvert's) is not ``expected`` (megatron-core's): name -> (expected, read)."""
    return {name: (value, read.get(name)) for name, value in expected.items() if not _same(value, read.get(name))}
