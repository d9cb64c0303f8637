"""Gemma 3 image-text (``Gemma3ForConditionalGeneration``): Gemma 3's language model, a SigLIP tower, a projector.

A checkpoint (released, or saved by transformers 5) stores Gemma 3's tensors under ``language_model.model.`` (the
output layer is tied: no ``lm_head``), the tower under ``vision_tower.`` (the releases: under SigLIP's wrapper,
``vision_tower.vision_model.``, which transformers 5 still loads: ``Family.hf_stored_prefixes``; pgconvert writes
transformers 5's names) and the projector as ``multi_modal_projector.mm_soft_emb_norm.weight`` (Gemma's ``1 + w``
RMSNorm over the tower's width) and ``multi_modal_projector.mm_input_projection_weight`` ``[vision hidden, text
hidden]`` (the features times it). config.json nests Gemma 3's settings in ``text_config`` (``gemma3_text``; the
releases leave most to Gemma3TextConfig's defaults, ``vocab_size`` 262208 among them), the tower's in
``vision_config`` (``siglip_vision_model``, ``vision_use_head: false``), and at the top level the image tokens:
``mm_tokens_per_image`` (the projector pools each image to that many), ``boi_token_index``, ``eoi_token_index``,
``image_token_index``; carried with the vision config.

Megatron-Bridge's ``Gemma3VLBridge`` (``src/megatron/bridge/models/gemma_vl/gemma3_vl_bridge.py``) maps the language
model as Gemma 3's under ``language_model.``, ``ReplicatedMapping("vision_tower.**")`` and the projector into its
``Gemma3VLMultimodalProjector``: ``mm_soft_embed_norm.weight`` as it is (a zero-centred TENorm) and ``proj.weight``,
HF's weight transposed (``permute_dims=(1, 0)``), a ColumnParallelLinear whose rows TP splits
(``pgconvert.model.vision``). Its ``Gemma3VLModel`` lets each image's tokens attend to each other both ways, as
transformers' Gemma3Model does: the architecture's, no setting.
"""

from __future__ import annotations

from pgconvert.families.gemma import GEMMA3
from pgconvert.families.table import TRANSPOSED, ConfigField, TensorMapping, TensorTable, VisionLanguage
from pgconvert.families.vision_language import language_model_rows, vision_rule, vision_rows
from pgconvert.model.vision import (GEMMA3_PROJECTION, GEMMA3_PROJECTOR_MODULE, GEMMA3_PROJECTOR_NORM, SIGLIP_MODULE,
                                    SIGLIP_PATTERNS)

GEMMA3_VL_KEYS = ("mm_tokens_per_image", "boi_token_index", "eoi_token_index", "image_token_index")
_HF_PROJECTOR = "multi_modal_projector."

_PROJECTOR_ROWS = (
    TensorMapping(GEMMA3_PROJECTOR_MODULE + GEMMA3_PROJECTOR_NORM, (_HF_PROJECTOR + "mm_soft_emb_norm.weight",)),
    TensorMapping(GEMMA3_PROJECTOR_MODULE + GEMMA3_PROJECTION, (_HF_PROJECTOR + "mm_input_projection_weight",),
                  TRANSPOSED),
)

GEMMA3_VL = GEMMA3.derive(
    "Gemma3ForConditionalGeneration", "gemma3",
    tensors=TensorTable((*vision_rows(SIGLIP_MODULE, "vision_tower.", SIGLIP_PATTERNS), *_PROJECTOR_ROWS,
                         *language_model_rows(GEMMA3.tensors, nested="language_model.model."))),
    # Gemma3TextConfig's default, which the releases' text_config leaves out.
    fields=(ConfigField(("vocab_size",), "vocab_size", int, default=262_208),),
    rules=(vision_rule("siglip_vision_model", GEMMA3_VL_KEYS),),
    vision_language=VisionLanguage(text=GEMMA3, text_model_type="gemma3_text",
                                   vision_keys=("vision_config", *GEMMA3_VL_KEYS)),
    hf_stored_prefixes=(("vision_tower.vision_model.", "vision_tower."),),
)
