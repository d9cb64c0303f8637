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
"""

from __future__ import annotations

from pgconvert.families.qwen import QWEN2, QWEN3
from pgconvert.families.table import TensorTable, VisionLanguage
from pgconvert.families.vision_language import language_model_rows, mrope_rule, vision_rule, vision_rows
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
