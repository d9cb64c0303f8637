"""Phi-3 and Phi-4-mini (``Phi3ForCausalLM``): Mistral with fused ``qkv_proj`` and ``gate_up_proj``,
partial rotary and longrope RoPE.

``qkv_proj`` is ``[all q; all k; all v]`` (``QKV_CONCAT``); ``gate_up_proj`` is ``[gate; up]``
(Phi3MLP chunks it in two, gate first), megatron-core's ``linear_fc1`` as it is. megatron-core
cannot compute longrope (nor its ``su`` alias): its parameters are carried whole, as JSON, in
``ModelConfig.carried.hf_rope_parameters`` and in Megatron args (``pgconvert.semantics.carried``), so a
Megatron checkpoint converts back bit-exactly; every Megatron output names them in a notice.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path

from pgconvert.errors import CheckpointError
from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.families.llama import (
    EMBEDDING_ROWS,
    FINAL_ROWS,
    HEAD_DIM_NULL,
    ROPE_RULE,
    head_dim_field,
    max_positions,
    query_groups_field,
    read_rope,
)
from pgconvert.families.mistral import MISTRAL
from pgconvert.families.sliding_window import EVERY_LAYER_WINDOW
from pgconvert.families.table import QKV_CONCAT, ConfigField, ConfigRule, TensorMapping, TensorTable
from pgconvert.semantics import yarn
from pgconvert.semantics.carried import CarriedSetting
from pgconvert.semantics.rope import rope_parameters, rope_type_of

PHI3_TENSORS = TensorTable((
    *EMBEDDING_ROWS,
    TensorMapping("decoder.layers.{}.input_layernorm.weight", ("model.layers.{}.input_layernorm.weight",)),
    TensorMapping("decoder.layers.{}.self_attention.linear_qkv.weight", ("model.layers.{}.self_attn.qkv_proj.weight",),
                  QKV_CONCAT),
    TensorMapping("decoder.layers.{}.self_attention.linear_proj.weight", ("model.layers.{}.self_attn.o_proj.weight",)),
    TensorMapping("decoder.layers.{}.pre_mlp_layernorm.weight", ("model.layers.{}.post_attention_layernorm.weight",)),
    TensorMapping("decoder.layers.{}.mlp.linear_fc1.weight", ("model.layers.{}.mlp.gate_up_proj.weight",)),
    TensorMapping("decoder.layers.{}.mlp.linear_fc2.weight", ("model.layers.{}.mlp.down_proj.weight",)),
    *FINAL_ROWS,
))

# HF RoPE types megatron-core computes none of, carried whole in hf_rope_parameters: longrope, and
# what transformers' Phi3Config reads as longrope (su, and Phi-3's yarn).
_CARRIED_ROPE_TYPES = ("longrope", "su", "yarn")
# Phi3Config's original_max_position_embeddings, which its longrope takes over rope_parameters' own.
PHI3_ORIGINAL_MAX_POSITIONS = 4096


def _carried(params: Mapping[str, object], present: Mapping[str, object]) -> str:
    """The longrope parameters as transformers' Phi3Config resolves them: ``su`` and ``yarn`` are
    longrope, and the top-level ``original_max_position_embeddings`` (default 4096) replaces the
    block's own; the base and the partial rotary are read into their own settings."""
    kept = {key: value for key, value in params.items() if key not in ("rope_theta", "partial_rotary_factor")}
    kept["rope_type"] = "longrope"
    kept["original_max_position_embeddings"] = present.get("original_max_position_embeddings",
                                                           PHI3_ORIGINAL_MAX_POSITIONS)
    return json.dumps(kept, sort_keys=True)


def _read_rope(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """Partial rotary (which Phi-3 computes) and RoPE scaling as ``read_rope`` reads them; a longrope type, which
    megatron-core cannot compute, is carried whole (``_carried``)."""
    params = rope_parameters(present)
    if rope_type_of(params) not in _CARRIED_ROPE_TYPES:
        return {**read_rope(present, model), "hf_rope_parameters": None}
    plain = {"rope_parameters": {key: value for key, value in params.items() if key == "partial_rotary_factor"},
             "partial_rotary_factor": present.get("partial_rotary_factor")}
    values = dict(read_rope(plain, model))
    return {**values, **yarn.YARN_DEFAULTS, "hf_rope_parameters": _carried(params, present)}


def _write_rope(config: ModelConfig) -> Mapping[str, object]:
    written = dict(ROPE_RULE.write(config))
    params = dict(written["rope_parameters"])  # type: ignore[call-overload]
    if config.carried.hf_rope_parameters is not None:
        params = {**json.loads(config.carried.hf_rope_parameters), "rope_theta": config.positions.rotary_base}
        written["rope_scaling"] = None
    # Phi3 computes partial rotary (megatron-core's rotary_percent): written where transformers reads it.
    params["partial_rotary_factor"] = config.positions.rotary_percent
    original = params.get("original_max_position_embeddings", config.positions.max_position_embeddings)
    return {**written, "rope_parameters": params, "partial_rotary_factor": config.positions.rotary_percent,
            "original_max_position_embeddings": original}


def _refuses_scaling(config: ModelConfig) -> str | None:
    # Phi3Config refuses any other type (and reads yarn as longrope).
    if config.positions.rope_scaling is not None:
        return f"rope_scaling={config.positions.rope_scaling!r} (Phi3 computes plain RoPE or longrope only)"
    return None


def _json_text(args: argparse.Namespace, name: str, default: object, path: Path) -> object:
    value = getattr(args, name, None)
    if value is not None and not isinstance(value, str):
        raise CheckpointError(f"{path}: args.{name}={quote(value)}: expected JSON text")
    return value


PHI3 = MISTRAL.derive(
    "Phi3ForCausalLM", "phi3",
    tensors=PHI3_TENSORS,
    # Phi3Config: one KV group per head, no window, where config.json says nothing; it has no head_dim,
    # which its attention takes as given.
    fields=(query_groups_field(), head_dim_field(null_refused=HEAD_DIM_NULL), max_positions(4096),
            ConfigField(("rms_norm_eps",), "norm_epsilon", float, default=1e-5)),
    rules=(ConfigRule(keys=(*ROPE_RULE.keys, "original_max_position_embeddings"),
                      model_fields=(*ROPE_RULE.model_fields, "hf_rope_parameters"),
                      read=_read_rope, write=_write_rope, refuses=_refuses_scaling),
           EVERY_LAYER_WINDOW),
    hf_computes=frozenset({"rotary_percent"}),
    hf_rope_types_carried=_CARRIED_ROPE_TYPES,
    # Phi3Config's default token ids (32000) are outside a smaller vocabulary (see SmolLM3).
    hf_scratch={"bos_token_id": None, "eos_token_id": None, "pad_token_id": None},
    megatron_carried=(CarriedSetting("hf_rope_parameters", None, _json_text),),
    hf_notes={"carried RoPE parameters": "rope_parameters (longrope, su), original_max_position_embeddings",
              "rotary percent": "rope_parameters.partial_rotary_factor (carried both ways)"},
)
