"""Test-only helpers: tiny Qwen2.5-VL, Qwen3-VL, Gemma 3 and Mistral 3 checkpoints as releases ship them, and transformers'
logits.

Each model is transformers' own ``Qwen2_5_VLForConditionalGeneration`` (multimodal RoPE sections, a vision
tower with a full-attention block and windowed ones, a merger into the text width) or
``Qwen3VLForConditionalGeneration`` (interleaved sections, a tower with a position table, deepstack mergers), saved with
``save_pretrained`` beside a real word-level tokenizer holding Qwen's vision tokens, a chat template, the image
processor's ``preprocessor_config.json`` and a generation config. Image inputs are made as the models'
processors make them: transformers' image processor on a synthetic image, each image placeholder expanded to the
image's merged patch count, ``mm_token_type_ids`` marking the image tokens. (The processors themselves cannot be
built here: their video processor needs torchvision, which has no CPU build for torch 2.13.0 on the index.)

Gemma 3 (``Gemma3ForConditionalGeneration``) is gemma-3-4b-it's configuration scaled down: five sliding-window layers
to one full-attention layer, linear RoPE scaling on the full ones, tied embeddings, a SigLIP tower without its pooling
head, each image pooled to ``mm_tokens_per_image`` tokens; it is saved with transformers' own ``Gemma3Processor``
(its PIL image processor and a word-level tokenizer holding Gemma's image tokens), whose output is the input.

Mistral 3's (``Mistral3ForConditionalGeneration``: Mistral's language model, the Pixtral tower, its projector) is made
as the Qwen models are, its image placeholder expanded as ``PixtralProcessor`` does (which needs torchvision as well).
Nothing here imports pgconvert.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy
import torch
import transformers
from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, GenerationConfig, PreTrainedModel,
                          PreTrainedTokenizerFast, Qwen2_5_VLConfig,
                          Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                          Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration)

WORDS = 296
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
SPECIAL = ("<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB = len(SPECIAL) + WORDS + len(VISION_TOKENS)
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = range(len(SPECIAL) + WORDS, VOCAB)
CHAT_TEMPLATE = "{% for message in messages %}<|im_start|>{{ message['content'] }}<|im_end|>{% endfor %}"
# An image of 4 x 4 patches, merged 2 x 2 into 4 image tokens.
PATCHES = 4
TEXT = "w1 w2 <|vision_start|><|image_pad|><|vision_end|> w3 w4 w5"
QWEN2_5_VL: dict[str, Any] = dict(
    text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rope_theta=1000000.0,
                     rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=1, eos_token_id=3),
    vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
    image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
    vision_end_token_id=VISION_END, tie_word_embeddings=False,
)
QWEN3_VL: dict[str, Any] = dict(
    text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, head_dim=16,
                     num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                     rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [2, 3, 3],
                                      "mrope_interleaved": True}),
    vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                       deepstack_visual_indexes=[0, 1]),
    image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
    vision_end_token_id=VISION_END, tie_word_embeddings=False,
)
QWEN3_VL_MOE: dict[str, Any] = dict(
    QWEN3_VL, text_config=dict(QWEN3_VL["text_config"], num_hidden_layers=2, moe_intermediate_size=32, num_experts=4,
                               num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[]),
    vision_config=dict(QWEN3_VL["vision_config"], depth=2, deepstack_visual_indexes=[0]))
# name -> (config class, model class, settings, vision patch size)
MODELS: dict[str, tuple[type[Any], type[PreTrainedModel], dict[str, Any], int]] = {
    "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, QWEN2_5_VL, 14),
    "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration, QWEN3_VL, 16),
    "qwen3_vl_moe": (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration, QWEN3_VL_MOE, 16),
}


def _word_level(special: tuple[str, ...], vision: tuple[str, ...], **tokens: Any) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of ``special`` tokens, the words and the ``vision`` tokens, in that order."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate((*special, *(f"w{i}" for i in range(WORDS)), *vision))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", **tokens)


def _tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = _word_level(SPECIAL, VISION_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                            additional_special_tokens=list(VISION_TOKENS))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _image_processor(patch: int) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    side = PATCHES * patch
    return Qwen2VLImageProcessorPil(min_pixels=side * side, max_pixels=2 * side * side, patch_size=patch, merge_size=2,
                                    temporal_patch_size=2)


def build_vl_model(name: str, path: Path, seed: int = 0) -> Path:
    """The tiny VL checkpoint ``name`` (of ``MODELS``) with its tokenizer, chat template, image processor and
    generation config."""
    config_class, model_class, settings, patch = MODELS[name]
    _seeded(model_class(config_class(**settings)), seed).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    _image_processor(patch).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=3, pad_token_id=1).save_pretrained(path)
    return path


def _seeded(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    """``model`` with every parameter seeded away from its initial value (norms near one)."""
    torch.manual_seed(seed)
    model.eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name) * 7919 + seed))
            param.copy_(1.0 + 0.1 * noise if "norm" in name or "ln_q" in name else 0.05 * noise)
    return model


def _pixels(side: int) -> numpy.ndarray:
    """A synthetic ``side`` x ``side`` RGB image."""
    return (numpy.arange(side * side * 3).reshape(side, side, 3) * 37 % 251).astype(numpy.uint8)


def image_text_inputs(path: Path) -> dict[str, torch.Tensor]:
    """An image and text input as the model's processor makes it, from the processor files in ``path``."""
    from transformers import AutoImageProcessor, AutoTokenizer

    processor = AutoImageProcessor.from_pretrained(path)
    image = processor(images=[_pixels(PATCHES * processor.patch_size)], return_tensors="pt")
    merge = image["image_grid_thw"][0].prod().item() // 4  # the processor's replace_image_token
    text = TEXT.replace("<|image_pad|>", " <|image_pad|> " * merge)
    ids = AutoTokenizer.from_pretrained(path)(text, return_tensors="pt")["input_ids"]
    assert int((ids == IMAGE_TOKEN).sum()) == merge, ids
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == IMAGE_TOKEN).int(),
            **image}


def _loaded(path: Path) -> PreTrainedModel:
    """The model config.json names (VL or text), in fp32, loaded strictly, in eval mode."""
    architecture = json.loads((path / "config.json").read_text())["architectures"][0]
    model, info = getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32,
                                                                      output_loading_info=True)
    assert not any(info.get(key) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def vl_logits(path: Path, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' fp32 logits of the VL checkpoint at ``path`` (loaded strictly) on ``inputs``."""
    with torch.no_grad():
        return _loaded(path)(**inputs).logits


GEMMA3_SPECIAL = ("<pad>", "<eos>", "<bos>", "<unk>")
GEMMA3_VISION_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
GEMMA3_VOCAB = len(GEMMA3_SPECIAL) + WORDS + len(GEMMA3_VISION_TOKENS)
GEMMA3_BOI, GEMMA3_EOI, GEMMA3_IMAGE = range(len(GEMMA3_SPECIAL) + WORDS, GEMMA3_VOCAB)
# A 28 x 28 image of 4 x 4 patches, pooled to 4 image tokens; longer than the sliding window.
GEMMA3_IMAGE_SIDE = 28
GEMMA3_TEXT = "w1 w2 <start_of_image> w3 w4 w5 w6 w7 w8"
GEMMA3_VL: dict[str, Any] = dict(
    text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, vocab_size=GEMMA3_VOCAB,
                     max_position_embeddings=256, sliding_window=4, sliding_window_pattern=6,
                     rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                     bos_token_id=2, eos_token_id=1, pad_token_id=0),
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       image_size=GEMMA3_IMAGE_SIDE, patch_size=7, vision_use_head=False),
    mm_tokens_per_image=4, boi_token_index=GEMMA3_BOI, eoi_token_index=GEMMA3_EOI, image_token_index=GEMMA3_IMAGE,
    tie_word_embeddings=True,
)


def _gemma3_processor() -> Any:
    """transformers' Gemma3Processor: its PIL image processor and a tokenizer holding Gemma's image tokens."""
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokens = dict(zip(("boi_token", "eoi_token", "image_token"), GEMMA3_VISION_TOKENS))
    tokenizer = _word_level(GEMMA3_SPECIAL, GEMMA3_VISION_TOKENS, pad_token="<pad>", eos_token="<eos>",
                            bos_token="<bos>", extra_special_tokens=tokens)
    image_processor = Gemma3ImageProcessorPil(size={"height": GEMMA3_IMAGE_SIDE, "width": GEMMA3_IMAGE_SIDE})
    return Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
                           image_seq_length=GEMMA3_VL["mm_tokens_per_image"])


def build_gemma3_vl_model(path: Path, seed: int = 0) -> Path:
    """The tiny Gemma 3 image-text checkpoint with its processor (tokenizer, chat template, image processor) and
    generation config."""
    _seeded(Gemma3ForConditionalGeneration(Gemma3Config(**GEMMA3_VL)), seed).save_pretrained(path)
    _gemma3_processor().save_pretrained(path)
    GenerationConfig(bos_token_id=2, eos_token_id=1, pad_token_id=0).save_pretrained(path)
    return path


def gemma3_image_text_inputs(path: Path) -> dict[str, torch.Tensor]:
    """An image and text input as the Gemma3Processor saved in ``path`` makes it (``token_type_ids`` marking the
    image tokens, which attend to each other both ways)."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    inputs = dict(processor(text=GEMMA3_TEXT, images=[_pixels(GEMMA3_IMAGE_SIDE)], return_tensors="pt"))
    assert int((inputs["input_ids"] == GEMMA3_IMAGE).sum()) == GEMMA3_VL["mm_tokens_per_image"], inputs
    return inputs


# Mistral 3 (Mistral-Small-3.1's config.json scaled down: head_dim apart from hidden / heads, no window, RoPE base
# 1e9, an untied head; the Pixtral tower; the image tokens at Mistral's ids [IMG] 10, [IMG_BREAK] 12, [IMG_END] 13).
MISTRAL3_SPECIAL = ("<unk>", "<s>", "</s>", *(f"<SPECIAL_{i}>" for i in range(3, 10)), "[IMG]", "<pad>",
                    "[IMG_BREAK]", "[IMG_END]")
MISTRAL3_VOCAB = len(MISTRAL3_SPECIAL) + WORDS
MISTRAL3_IMAGE_TOKEN = 10
MISTRAL3_PATCH = 14
MISTRAL3: dict[str, Any] = dict(
    text_config=dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=MISTRAL3_VOCAB,
                     max_position_embeddings=256, rope_theta=1000000000.0, sliding_window=None, rms_norm_eps=1e-5,
                     tie_word_embeddings=False),
    vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, head_dim=16, patch_size=MISTRAL3_PATCH, image_size=112),
    image_token_index=MISTRAL3_IMAGE_TOKEN, spatial_merge_size=2, vision_feature_layer=-1,
    multimodal_projector_bias=False, projector_hidden_act="gelu", tie_word_embeddings=False,
)
MISTRAL3_TEXT = "w1 w2 [IMG] w3 w4 w5"


def _mistral3_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with Mistral's image tokens at their ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate((*MISTRAL3_SPECIAL, *(f"w{i}" for i in range(WORDS))))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>",
                                        additional_special_tokens=["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _mistral3_image_processor() -> Any:
    """The Pixtral image processor as ``PixtralProcessor`` runs it: images resized to whole merged patches (the patch
    times ``spatial_merge_size``), at most 4 x 4 patches."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    merged = 2 * MISTRAL3_PATCH
    return PixtralImageProcessorPil(size={"longest_edge": PATCHES * MISTRAL3_PATCH},
                                    patch_size={"height": merged, "width": merged})


def build_mistral3_model(path: Path, seed: int = 0, **changes: Any) -> Path:
    """A tiny ``Mistral3ForConditionalGeneration`` (``MISTRAL3`` with ``changes``) saved with its processor (tokenizer,
    chat template, image processor) and a generation config."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(seed)
    model = Mistral3ForConditionalGeneration(Mistral3Config(**{**MISTRAL3, **changes})).eval()
    with torch.no_grad():  # every parameter seeded away from its initial value (norms near one)
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name) * 7919 + seed))
            param.copy_(1.0 + 0.1 * noise if "norm" in name or "ln_pre" in name else 0.05 * noise)
    model.save_pretrained(path)
    _mistral3_tokenizer().save_pretrained(path)
    _mistral3_image_processor().save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=11).save_pretrained(path)
    return path


def mistral3_inputs(path: Path) -> dict[str, torch.Tensor]:
    """An image and text input as ``PixtralProcessor`` makes it (its ``replace_image_token``: a row of [IMG] per merged
    patch row, each ended by [IMG_BREAK], the last by [IMG_END]), from the files in ``path`` on a synthetic image.
    (The processor itself needs torchvision, which has no CPU build for torch 2.13.0 on the index.)"""
    from transformers import AutoImageProcessor, AutoTokenizer

    side = PATCHES * MISTRAL3_PATCH
    pixels = (numpy.arange(side * side * 3).reshape(side, side, 3) * 37 % 251).astype(numpy.uint8)
    image = AutoImageProcessor.from_pretrained(path)(images=[pixels], return_tensors="pt")
    height, width = (int(size) // (2 * MISTRAL3_PATCH) for size in image["image_sizes"][0])
    tokens = ((["[IMG]"] * width + ["[IMG_BREAK]"]) * height)[:-1] + ["[IMG_END]"]
    text = MISTRAL3_TEXT.replace("[IMG]", " ".join(tokens))
    ids = AutoTokenizer.from_pretrained(path)(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert int((ids == MISTRAL3_IMAGE_TOKEN).sum()) == height * width == (PATCHES // 2) ** 2, ids
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **image}


def text_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits on a text input of the model config.json names (VL or text), loaded strictly."""
    with torch.no_grad():
        return _loaded(path)(input_ids=ids).logits
