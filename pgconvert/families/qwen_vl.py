"""Qwen2.5-VL: a Qwen2 language model with Qwen2.5-VL's vision tower and merger.

A checkpoint (released, or saved by transformers 5's ``Qwen2_5_VLForConditionalGeneration``) stores Qwen2's
tensors under Qwen2's names and ``visual.*`` (the tower: ``patch_embed``, ``blocks``; the projector: ``merger``);
its config.json nests Qwen2's settings in ``text_config`` (``model_type`` ``qwen2_5_vl_text``, with
``rope_parameters.mrope_section``), the tower's in ``vision_config``, the image and video token ids at the top
level. Megatron-Bridge's ``Qwen25VLBridge`` (``src/megatron/bridge/models/qwen_vl/qwen25_vl_bridge.py``) maps
the language model as Qwen2's under ``language_model.`` and ``visual.**`` one to one, replicated.
"""

from __future__ import annotations

from pgconvert.families.qwen import QWEN2
from pgconvert.families.table import TensorTable, VisionLanguage
from pgconvert.families.vision_language import MROPE_RULE, vision_rule, vision_rows
from pgconvert.model.vision import QWEN2_5_VL_MODULE, QWEN2_5_VL_PATTERNS

QWEN_VL_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")

QWEN2_5_VL = QWEN2.derive(
    "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl",
    tensors=TensorTable((*vision_rows(QWEN2_5_VL_MODULE, "visual.", QWEN2_5_VL_PATTERNS), *QWEN2.tensors.rows)),
    rules=(MROPE_RULE, vision_rule(QWEN_VL_TOKEN_KEYS)),
    vision_language=VisionLanguage(text=QWEN2, text_model_type="qwen2_5_vl_text",
                                   vision_keys=("vision_config", *QWEN_VL_TOKEN_KEYS)),
    # A 4.x config.json's rope_scaling of type "mrope": its sections are read by MROPE_RULE.
    hf_rope_types_carried=("mrope",),
)
