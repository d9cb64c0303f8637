"""Mistral 3 (``Mistral3ForConditionalGeneration``): Mistral's language model with the Pixtral vision tower and
Mistral 3's multimodal projector (Mistral-Small-3.1 and 3.2).

A checkpoint, released or saved by transformers 5 (its checkpoint conversion mapping writes the released names back),
stores Mistral's tensors under ``language_model.`` (``language_model.model.layers.{i}…``,
``language_model.lm_head.weight``), the tower under ``vision_tower.`` and the projector under
``multi_modal_projector.``; its config.json nests Mistral's settings in ``text_config`` (``model_type`` ``mistral``),
the tower's in ``vision_config`` (``pixtral``), and holds the image token (``image_token_index``) and the
projector's settings (``spatial_merge_size``, ``vision_feature_layer``, ``multimodal_projector_bias``,
``projector_hidden_act``) at the top level. Megatron-Bridge's ``Ministral3Bridge``
(``src/megatron/bridge/models/ministral3/ministral3_bridge.py``) maps the language model as Mistral's under
``language_model.`` and ``vision_tower.**`` and ``multi_modal_projector.**`` one to one, replicated.

Ministral 3 (``text_config.model_type`` ``ministral3``) is refused: its attention scales the queries by
1 + ``llama_4_scaling_beta`` · log(1 + ⌊position / ``original_max_position_embeddings``⌋), which megatron-core does
not compute (Megatron-Bridge computes it in its own attention class) and no pgconvert family carries (Llama 4's
attention temperature is another formula, on its NoPE layers only).
"""

from __future__ import annotations

from pgconvert.families.mistral import MISTRAL
from pgconvert.families.table import TensorTable, VisionLanguage
from pgconvert.families.vision_language import language_model_rows, vision_rows, vision_rule
from pgconvert.model.vision import (
    MISTRAL3_PROJECTOR_KEYS,
    MISTRAL3_PROJECTOR_MODULE,
    MISTRAL3_PROJECTOR_PATTERNS,
    MISTRAL3_TOWER_MODULE,
    PIXTRAL_PATTERNS,
)

# The image token, and the other name Mistral3Config takes for it (attribute_map), carried as config.json spells it.
MISTRAL3_TOKEN_KEYS = ("image_token_index", "image_token_id")
MINISTRAL3_REFUSAL = ("Ministral 3's attention scales the queries by 1 + llama_4_scaling_beta * log(1 + "
                      "floor(position / original_max_position_embeddings)), which megatron-core does not compute and "
                      "pgconvert does not carry; converted with text_config.model_type 'mistral' (Mistral-Small-3.x)")

MISTRAL3 = MISTRAL.derive(
    "Mistral3ForConditionalGeneration", "mistral3",
    tensors=TensorTable((*vision_rows(MISTRAL3_TOWER_MODULE, MISTRAL3_TOWER_MODULE, PIXTRAL_PATTERNS),
                         *vision_rows(MISTRAL3_PROJECTOR_MODULE, MISTRAL3_PROJECTOR_MODULE,
                                      MISTRAL3_PROJECTOR_PATTERNS),
                         *language_model_rows(MISTRAL.tensors, prefix="", nested="language_model."))),
    rules=(vision_rule("pixtral", MISTRAL3_TOKEN_KEYS, folded=MISTRAL3_PROJECTOR_KEYS),),
    vision_language=VisionLanguage(text=MISTRAL, text_model_type="mistral",
                                   vision_keys=("vision_config", *MISTRAL3_TOKEN_KEYS, *MISTRAL3_PROJECTOR_KEYS),
                                   refused_text_models={"ministral3": MINISTRAL3_REFUSAL}),
)
