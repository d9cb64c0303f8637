"""Qwen2.5-VL and Qwen3-VL: a Qwen2 (Qwen3) language model with its vision tower and mergers.

A checkpoint (released, or saved by transformers 5's ``Qwen2_5_VLForConditionalGeneration``) stores Qwen2's
tensors under Qwen2's names and ``visual.*`` (the tower: ``patch_embed``, ``blocks``; the projector: ``merger``);
its config.json nests Qwen2's settings in ``text_config`` (``model_type`` ``qwen2_5_vl_text``, with
``rope_parameters.mrope_section``), the tower's in ``vision_config``, the image and video token ids at the top
level. Megatron-Bridge's ``Qwen25VLBridge`` (``src/megatron/bridge/models/qwen_vl/qwen25_vl_bridge.py``) maps
the language model as Qwen2's under ``language_model.`` and ``visual.**`` one to one, replicated.

Qwen3-VL (``Qwen3VLForConditionalGeneration``, dense) stores transformers' own names: Qwen3's under
``model.language_model.``, the tower (LayerNorms, gelu MLPs, a learned position table) and its mergers (the
merger and the deepstack mergers, whose features transformers and Megatron-Bridge add to the first decoder layers:
``vision_config.deepstack_visual_indexes`` says which, carried with the vision config) under ``model.visual.``;
its text config's RoPE always interleaves the sections (``mrope_interleaved``). Megatron-Bridge's ``Qwen3VLBridge``
(``qwen3_vl_bridge.py``) maps the language model as Qwen3's under ``language_model.`` and
``ReplicatedMapping("vision_model.**", "model.visual.**")``.

Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``) is Qwen3-MoE's language model the same way, its routed experts
stacked per layer (``mlp.experts.gate_up_proj`` [E, 2·I, hidden], gate rows first, and ``down_proj`` [E, hidden, I]:
each expert's slice is megatron-core's ``linear_fc1`` / ``linear_fc2``), its router always renormalizing the top-k
weights (Qwen3-MoE's ``norm_topk_prob: true``); its tower is Qwen3-VL's.
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.families.qwen import QWEN2, QWEN3, QWEN3_MOE
from pgconvert.families.table import IDENTITY, ConfigRule, TensorMapping, TensorTable, VisionLanguage, write_nothing
from pgconvert.families.vision_language import language_model_rows, mrope_rule, vision_rule, vision_rows
from pgconvert.model.config import ModelConfig
from pgconvert.model.vision import QWEN2_5_VL_MODULE, QWEN2_5_VL_PATTERNS, QWEN3_VL_MODULE, QWEN3_VL_PATTERNS

QWEN_VL_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")

QWEN2_5_VL = QWEN2.derive(
    "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl",
    tensors=TensorTable((*vision_rows(QWEN2_5_VL_MODULE, "visual.", QWEN2_5_VL_PATTERNS), *QWEN2.tensors.rows)),
    rules=(mrope_rule({"type": "mrope"}), vision_rule("qwen2_5_vl_vision", QWEN_VL_TOKEN_KEYS)),
    vision_language=VisionLanguage(text=QWEN2, text_model_type="qwen2_5_vl_text",
                                   vision_keys=("vision_config", *QWEN_VL_TOKEN_KEYS)),
    # A 4.x config.json's rope_scaling of type "mrope": its sections are read by the mrope rule.
    hf_rope_types_carried=("mrope",),
)

QWEN3_VL = QWEN3.derive(
    "Qwen3VLForConditionalGeneration", "qwen3_vl",
    tensors=TensorTable((*vision_rows(QWEN3_VL_MODULE, "model.visual.", QWEN3_VL_PATTERNS),
                         *language_model_rows(QWEN3.tensors))),
    rules=(mrope_rule({"mrope_interleaved": True}), vision_rule("qwen3_vl_vision", QWEN_VL_TOKEN_KEYS)),
    vision_language=VisionLanguage(text=QWEN3, text_model_type="qwen3_vl_text",
                                   vision_keys=("vision_config", *QWEN_VL_TOKEN_KEYS)),
)

_STACKED = "model.language_model.layers.{}.mlp.experts."
_QWEN3_VL_MOE_EXPERTS = (
    TensorMapping("decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc1.weight", (_STACKED + "gate_up_proj",),
                  IDENTITY, stacked=True),
    TensorMapping("decoder.layers.{}.mlp.experts.local_experts.{}.linear_fc2.weight", (_STACKED + "down_proj",),
                  IDENTITY, stacked=True),
)


def _renormalized(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    return {"moe_router_pre_softmax": False}


def _refuses_pre_softmax(config: ModelConfig) -> str | None:
    return "moe_router_pre_softmax=True (needs False: the router renormalizes the top-k weights)" \
        if config.moe.moe_router_pre_softmax else None


# Qwen3VLMoeTextTopKRouter: softmax over every expert, then the top-k weights renormalized; no config key.
_RENORMALIZED_ROUTER = ConfigRule(keys=(), model_fields=("moe_router_pre_softmax",), read=_renormalized,
                                  write=write_nothing, refuses=_refuses_pre_softmax)

QWEN3_VL_MOE = QWEN3_MOE.derive(
    "Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe",
    tensors=TensorTable((*vision_rows(QWEN3_VL_MODULE, "model.visual.", QWEN3_VL_PATTERNS),
                         *language_model_rows(QWEN3_MOE.tensors))),
    rows=_QWEN3_VL_MOE_EXPERTS,
    rules=(mrope_rule({"mrope_interleaved": True}), vision_rule("qwen3_vl_moe_vision", QWEN_VL_TOKEN_KEYS),
           _RENORMALIZED_ROUTER),
    vision_language=VisionLanguage(text=QWEN3_MOE, text_model_type="qwen3_vl_moe_text",
                                   vision_keys=("vision_config", *QWEN_VL_TOKEN_KEYS),
                                   text_settings={"norm_topk_prob": True}),
    hf_computes=frozenset(),
    hf_notes={"moe pre-softmax": "never (the router renormalizes the top-k weights)"},
)
