"""Test-only: a Qwen2.5-VL rank file computed as Megatron-Bridge's ``Qwen25VLModel`` computes it (and a Mistral 3
one as its ``Ministral3Model`` does: ``mistral3_bridge_logits``).

Megatron-Bridge's model (``src/megatron/bridge/models/qwen_vl/modeling_qwen25_vl.py``) is transformers'
``Qwen2_5_VisionTransformerPretrainedModel`` as ``visual`` and megatron-core's GPTModel (``mrope``) as
``language_model``; its forward embeds the tokens with the GPTModel's embedding, puts the image features of
``get_image_features`` where the image tokens are (``get_placeholder_mask``), takes the 3D positions of
``get_rope_index`` and runs the GPTModel on that ``decoder_input``. Here transformers' ``Qwen2_5_VLModel`` built
from the rank file's ``args.vision_config`` with no weights of its own lends those three methods and its vision
module, into which the rank file's ``visual.*`` tensors load strictly; the rank file's ``language_model.*`` load
strictly into megatron-core's GPTModel (megatron-core 0.16.1, local spec, CPU). Bridge itself is not installed.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from support.mcore_helpers import (RankFile, build_gpt_model, causal_attention_mask, cpu_forward_patches,
                                   fake_group_queries)


def _hf_parts(rank: RankFile) -> torch.nn.Module:
    """transformers' Qwen2_5_VLModel of the rank's config (for its methods), its vision module holding the rank's
    ``visual.*`` tensors."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    args = rank.args
    text = dict(hidden_size=args.hidden_size, num_hidden_layers=1, num_attention_heads=args.num_attention_heads,
                num_key_value_heads=args.num_query_groups, intermediate_size=args.ffn_hidden_size,
                vocab_size=args.padded_vocab_size, rope_scaling={"type": "mrope", "mrope_section": args.mrope_section})
    config = Qwen2_5_VLConfig(text_config=text, vision_config=json.loads(args.vision_config),
                              **json.loads(args.vision_token_ids))
    model = Qwen2_5_VLModel(config).eval()
    visual = {name.removeprefix("visual."): tensor for name, tensor in rank.model.items() if name.startswith("visual.")}
    model.visual.load_state_dict(visual, strict=True)
    return model


def _language_model_logits(rank: RankFile, ids: torch.Tensor, image_features: Callable[[torch.Tensor], torch.Tensor],
                           positions: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The rank's ``language_model.*`` loaded strictly into megatron-core's GPTModel, run as Megatron-Bridge's VL
    models run it: the tokens embedded, ``image_features(embeds)`` (the embeddings with the image features where the
    image tokens are) as ``decoder_input``, at ``positions()``."""
    language = {name.removeprefix("language_model."): tensor for name, tensor in rank.model.items()
                if name.startswith("language_model.")}
    with torch.no_grad(), fake_group_queries(), cpu_forward_patches():
        gpt = build_gpt_model(rank.args, rank.layout)
        gpt.load_state_dict(language, strict=True)
        embeds = gpt.embedding(input_ids=ids, position_ids=None).transpose(0, 1)  # [b, s, h]
        embeds = image_features(embeds)
        return gpt(input_ids=None, position_ids=positions(), decoder_input=embeds.transpose(0, 1).contiguous(),
                   attention_mask=causal_attention_mask(ids.shape[1]))


def bridge_logits(rank: RankFile, inputs: dict[str, torch.Tensor], image_positions: bool = True) -> torch.Tensor:
    """The logits of a TP1 PP1 rank file on an image + text input (vocab padding included); ``image_positions``
    False: every token's three position ids alike, as for text (a knock-out of the multimodal positions)."""
    hf = _hf_parts(rank)
    ids = inputs["input_ids"]

    def placed(embeds: torch.Tensor) -> torch.Tensor:
        image = torch.cat(hf.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output)
        mask, _ = hf.get_placeholder_mask(ids, inputs_embeds=embeds, image_features=image)
        return embeds.masked_scatter(mask, image)

    def positions() -> torch.Tensor:
        positions, _ = hf.get_rope_index(ids, inputs["mm_token_type_ids"], inputs["image_grid_thw"])
        return positions if image_positions else torch.arange(ids.shape[1]).expand_as(positions)

    return _language_model_logits(rank, ids, placed, positions)


# Mistral 3's top-level projector settings, which the rank file's vision_config holds with the language model's width.
_MISTRAL3_TOP_LEVEL = ("spatial_merge_size", "vision_feature_layer", "multimodal_projector_bias", "projector_hidden_act")


def _mistral3_parts(rank: RankFile) -> torch.nn.Module:
    """transformers' Mistral3Model built from the rank's args alone (for its methods), its vision tower and projector
    holding the rank's ``vision_tower.*`` and ``multi_modal_projector.*`` tensors."""
    from transformers import Mistral3Config
    from transformers.models.mistral3.modeling_mistral3 import Mistral3Model

    args = rank.args
    vision = json.loads(args.vision_config)
    top = {key: vision.pop(key) for key in _MISTRAL3_TOP_LEVEL}
    text = dict(model_type="mistral", hidden_size=args.hidden_size, num_hidden_layers=1, head_dim=args.kv_channels,
                num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_query_groups,
                intermediate_size=args.ffn_hidden_size, vocab_size=args.padded_vocab_size, rms_norm_eps=args.norm_epsilon)
    config = Mistral3Config(text_config=text, vision_config=vision, **top, **json.loads(args.vision_token_ids))
    model = Mistral3Model(config).eval()
    for module in ("vision_tower", "multi_modal_projector"):
        getattr(model, module).load_state_dict({name.removeprefix(module + "."): tensor for name, tensor
                                                in rank.model.items() if name.startswith(module + ".")}, strict=True)
    return model


def mistral3_bridge_logits(rank: RankFile, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits of a Mistral 3 TP1 PP1 rank file on an image + text input as Megatron-Bridge's ``Ministral3Model``
    computes them (``src/megatron/bridge/models/ministral3/modeling_ministral3.py``: transformers' vision tower and
    projector, ``get_image_features`` placed at the image tokens, megatron-core's GPTModel with RoPE), vocab padding
    included."""
    hf = _mistral3_parts(rank)
    ids = inputs["input_ids"]

    def placed(embeds: torch.Tensor) -> torch.Tensor:
        image = torch.cat(hf.get_image_features(inputs["pixel_values"], inputs["image_sizes"]).pooler_output)
        return embeds.masked_scatter(hf.get_placeholder_mask(ids, inputs_embeds=embeds, image_features=image), image)

    return _language_model_logits(rank, ids, placed, lambda: torch.arange(ids.shape[1]).unsqueeze(0))
