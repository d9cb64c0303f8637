"""The vision part of a vision-language model: the vision tower and its projector, as tensors.

Megatron-Bridge's VL models (``Qwen25VLModel``: ``src/megatron/bridge/models/qwen_vl/modeling_qwen25_vl.py``)
hold the language model as a megatron-core GPTModel under ``language_model.`` and the vision tower with its
projector as transformers' own module under ``visual.``, built only where ``pre_process`` (the first pipeline
stage's first model chunk) and registered before the language model; its bridge maps ``visual.**`` one to one
(``ReplicatedMapping``): every TP rank holds the whole tensor. So a tower is described here as the names and
shapes of its tensors, computed from HF's ``vision_config`` (its ``model_type`` picks the description), each
``<Megatron-Bridge's module>.<name inside the HF module>`` (Qwen2.5-VL's module is ``visual.``, Qwen3-VL's
``vision_model.``: ``Tower.module``; Gemma 3's tower is ``vision_tower.`` and its projector, a module of
Megatron-Bridge's own, ``multi_modal_projector.``: ``Tower.projector_module``); the provider places them on the first
chunk, each cut by its rule (whole on every TP rank unless the tower says Megatron shards it).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pgconvert.errors import ConfigError
from pgconvert.io.limits import quote

if TYPE_CHECKING:  # rules import torch; a config (and so --help) is checked without it
    from pgconvert.model.rules import ShardRule

# Megatron-Bridge's module of a VL model's language model (the vision part's is its tower's ``module``).
LANGUAGE_MODEL_MODULE = "language_model."
QWEN2_5_VL_MODULE = "visual."


@dataclass(frozen=True)
class VisionTensor:
    """One tensor of the vision part: its canonical (Megatron) name, global shape, part and TP rule."""

    name: str
    shape: tuple[int, ...]
    # "tower" (patch embedding, blocks) or "projector" (the merger into the language model's width).
    part: str
    # How TP ranks hold it: None, whole (a transformers module Megatron-Bridge replicates, ``rules.REPLICATED``), or
    # a megatron-core module's rule where Megatron shards it (Gemma 3's projector is a ColumnParallelLinear:
    # ``rules.COLUMN``).
    rule: ShardRule | None = None


@dataclass(frozen=True)
class Tower:
    """A vision tower pgconvert describes: Megatron-Bridge's module holding it, its tensors from ``vision_config`` and
    the language model's hidden size (named under that module, or ``projector_module``), and the key (with
    transformers' default) giving the projector's output width, which must be the language model's hidden size
    (None: the projector is built with that width)."""

    module: str
    tensors: Callable[[Mapping[str, Any], int], list[VisionTensor]]
    output_width: tuple[str, int] | None
    # Megatron-Bridge's module of the projector where it is not the tower's (Gemma 3's ``multi_modal_projector.``).
    projector_module: str | None = None


def _size(vision: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """A positive integer of ``vision_config`` (``default`` where absent, as transformers' class has it)."""
    value = vision.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"vision_config.{key}={quote(value)}: must be a positive integer")
    return value


# Qwen2.5-VL's vision tower (transformers' ``Qwen2_5_VisionTransformerPretrainedModel``), in state-dict order:
# each name with its shape from (hidden, intermediate, merged hidden, out hidden); ``{}`` is a block's index.
_Sizes = tuple[int, int, int, int]
_QWEN2_5_VL_BLOCK: tuple[tuple[str, Callable[[_Sizes], tuple[int, ...]]], ...] = (
    ("norm1.weight", lambda s: (s[0],)), ("norm2.weight", lambda s: (s[0],)),
    ("attn.qkv.weight", lambda s: (3 * s[0], s[0])), ("attn.qkv.bias", lambda s: (3 * s[0],)),
    ("attn.proj.weight", lambda s: (s[0], s[0])), ("attn.proj.bias", lambda s: (s[0],)),
    ("mlp.gate_proj.weight", lambda s: (s[1], s[0])), ("mlp.gate_proj.bias", lambda s: (s[1],)),
    ("mlp.up_proj.weight", lambda s: (s[1], s[0])), ("mlp.up_proj.bias", lambda s: (s[1],)),
    ("mlp.down_proj.weight", lambda s: (s[0], s[1])), ("mlp.down_proj.bias", lambda s: (s[0],)),
)
_QWEN2_5_VL_MERGER: tuple[tuple[str, Callable[[_Sizes], tuple[int, ...]]], ...] = (
    ("merger.ln_q.weight", lambda s: (s[0],)), ("merger.mlp.0.weight", lambda s: (s[2], s[2])),
    ("merger.mlp.0.bias", lambda s: (s[2],)), ("merger.mlp.2.weight", lambda s: (s[3], s[2])),
    ("merger.mlp.2.bias", lambda s: (s[3],)),
)
PATCH_EMBED = "patch_embed.proj.weight"
BLOCKS = "blocks.{}."


def _tower_sizes(vision: Mapping[str, Any], hidden: int, patch: int,
                 intermediate: int) -> tuple[_Sizes, tuple[int, ...]]:
    """(hidden, intermediate, merged hidden, out hidden) of a Qwen vision tower and its patch embedding's shape,
    from ``vision_config`` with its class's defaults (``hidden``, ``patch``, ``intermediate``)."""
    width = _size(vision, "hidden_size", hidden)
    heads = _size(vision, "num_heads", 16)
    if width % heads:
        raise ConfigError(f"vision_config.num_heads={heads}: must divide vision_config.hidden_size={width}")
    side = _size(vision, "patch_size", patch)
    sizes: _Sizes = (width, _size(vision, "intermediate_size", intermediate),
                     width * _size(vision, "spatial_merge_size", 2) ** 2, _size(vision, "out_hidden_size", 3584))
    embed = (width, _size(vision, "in_channels", 3), _size(vision, "temporal_patch_size", 2), side, side)
    return sizes, embed


def qwen2_5_vl_tower(vision: Mapping[str, Any], hidden_size: int) -> list[VisionTensor]:
    """transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` (defaults of ``Qwen2_5_VLVisionConfig``)."""
    sizes, embed_shape = _tower_sizes(vision, hidden=3584, patch=14, intermediate=3420)
    embed = VisionTensor(QWEN2_5_VL_MODULE + PATCH_EMBED, embed_shape, "tower")
    blocks = [VisionTensor(QWEN2_5_VL_MODULE + BLOCKS.format(index) + name, shape(sizes), "tower")
              for index in range(_size(vision, "depth", 32)) for name, shape in _QWEN2_5_VL_BLOCK]
    merger = [VisionTensor(QWEN2_5_VL_MODULE + name, shape(sizes), "projector") for name, shape in _QWEN2_5_VL_MERGER]
    return [embed, *blocks, *merger]


# Every tensor name of Qwen2.5-VL's vision part inside its module, ``{}`` for a block's index.
QWEN2_5_VL_PATTERNS: tuple[str, ...] = (PATCH_EMBED, *(BLOCKS + name for name, _ in _QWEN2_5_VL_BLOCK),
                                        *(name for name, _ in _QWEN2_5_VL_MERGER))


# Qwen3-VL's vision tower (transformers' ``Qwen3VLVisionModel``): LayerNorms, gelu MLPs, a learned position table, the
# merger and one "deepstack" merger per ``deepstack_visual_indexes`` entry (its features are added to the language
# model's first layers); shapes from (hidden, intermediate, merged hidden, out hidden). Megatron-Bridge's
# ``Qwen3VLBridge`` holds it as ``vision_model.`` (``ReplicatedMapping("vision_model.**", "model.visual.**")``).
QWEN3_VL_MODULE = "vision_model."
_QWEN3_VL_BLOCK: tuple[tuple[str, Callable[[_Sizes], tuple[int, ...]]], ...] = (
    ("norm1.weight", lambda s: (s[0],)), ("norm1.bias", lambda s: (s[0],)),
    ("norm2.weight", lambda s: (s[0],)), ("norm2.bias", lambda s: (s[0],)),
    ("attn.qkv.weight", lambda s: (3 * s[0], s[0])), ("attn.qkv.bias", lambda s: (3 * s[0],)),
    ("attn.proj.weight", lambda s: (s[0], s[0])), ("attn.proj.bias", lambda s: (s[0],)),
    ("mlp.linear_fc1.weight", lambda s: (s[1], s[0])), ("mlp.linear_fc1.bias", lambda s: (s[1],)),
    ("mlp.linear_fc2.weight", lambda s: (s[0], s[1])), ("mlp.linear_fc2.bias", lambda s: (s[0],)),
)
# A merger: its norm before the 2 x 2 merge (the main merger: the tower's width) or after it (deepstack's).
_QWEN3_VL_MERGER: tuple[tuple[str, Callable[[_Sizes], tuple[int, ...]]], ...] = (
    ("linear_fc1.weight", lambda s: (s[2], s[2])), ("linear_fc1.bias", lambda s: (s[2],)),
    ("linear_fc2.weight", lambda s: (s[3], s[2])), ("linear_fc2.bias", lambda s: (s[3],)),
)
DEEPSTACK_MERGERS = "deepstack_merger_list.{}."


def _qwen3_vl_mergers(vision: Mapping[str, Any], sizes: _Sizes) -> list[VisionTensor]:
    """The merger (norm over the tower's width) and the deepstack mergers (norm over the merged width)."""
    indexes = vision.get("deepstack_visual_indexes", (8, 16, 24))
    if not isinstance(indexes, (list, tuple)) or not all(isinstance(index, int) for index in indexes):
        raise ConfigError(f"vision_config.deepstack_visual_indexes={quote(indexes)}: expected a list of block indices")
    mergers = [("merger.", sizes[0])] + [(DEEPSTACK_MERGERS.format(j), sizes[2]) for j in range(len(indexes))]
    return [VisionTensor(QWEN3_VL_MODULE + prefix + name, shape, "projector")
            for prefix, width in mergers
            for name, shape in (("norm.weight", (width,)), ("norm.bias", (width,)),
                                *((name, shape(sizes)) for name, shape in _QWEN3_VL_MERGER))]


def qwen3_vl_tower(vision: Mapping[str, Any], hidden_size: int) -> list[VisionTensor]:
    """transformers' ``Qwen3VLVisionModel`` (defaults of ``Qwen3VLVisionConfig``), in state-dict order."""
    sizes, embed_shape = _tower_sizes(vision, hidden=1152, patch=16, intermediate=4304)
    hidden = sizes[0]
    embed = [VisionTensor(QWEN3_VL_MODULE + PATCH_EMBED, embed_shape, "tower"),
             VisionTensor(QWEN3_VL_MODULE + "patch_embed.proj.bias", (hidden,), "tower"),
             VisionTensor(QWEN3_VL_MODULE + "pos_embed.weight", (_size(vision, "num_position_embeddings", 2304), hidden),
                          "tower")]
    blocks = [VisionTensor(QWEN3_VL_MODULE + BLOCKS.format(index) + name, shape(sizes), "tower")
              for index in range(_size(vision, "depth", 27)) for name, shape in _QWEN3_VL_BLOCK]
    return [*embed, *blocks, *_qwen3_vl_mergers(vision, sizes)]


# Every tensor name of Qwen3-VL's vision part inside its module, ``{}`` for a block's or a deepstack merger's index.
QWEN3_VL_PATTERNS: tuple[str, ...] = (
    PATCH_EMBED, "patch_embed.proj.bias", "pos_embed.weight", *(BLOCKS + name for name, _ in _QWEN3_VL_BLOCK),
    *(prefix + name for prefix in ("merger.", DEEPSTACK_MERGERS)
      for name in ("norm.weight", "norm.bias", *(name for name, _ in _QWEN3_VL_MERGER))))


# Gemma 3's vision part (transformers' ``Gemma3Model``): a SigLIP tower (``SiglipVisionTransformer``, in state-dict
# order; shapes from (hidden, intermediate)) and the projector (``Gemma3MultiModalProjector``: average pooling to
# ``mm_tokens_per_image``, an RMSNorm over the tower's width, a bias-free projection to the language model's).
# Megatron-Bridge's ``Gemma3VLModel`` holds the tower as ``vision_tower.`` (``ReplicatedMapping("vision_tower.**")``)
# and the projector as a module of its own: ``mm_soft_embed_norm`` (a TENorm, replicated) and ``proj``, a
# ColumnParallelLinear ``[text hidden, vision hidden]`` holding HF's ``mm_input_projection_weight`` transposed, its
# rows split over TP.
SIGLIP_MODULE = "vision_tower."
GEMMA3_PROJECTOR_MODULE = "multi_modal_projector."
GEMMA3_PROJECTOR_NORM = "mm_soft_embed_norm.weight"
GEMMA3_PROJECTION = "proj.weight"
SIGLIP_LAYERS = "encoder.layers.{}."
_SIGLIP_EMBEDDINGS = ("embeddings.patch_embedding.weight", "embeddings.patch_embedding.bias",
                      "embeddings.position_embedding.weight")
_Widths = tuple[int, int]
_SIGLIP_LAYER: tuple[tuple[str, Callable[[_Widths], tuple[int, ...]]], ...] = (
    ("layer_norm1.weight", lambda s: (s[0],)), ("layer_norm1.bias", lambda s: (s[0],)),
    *((f"self_attn.{proj}.{kind}", (lambda s: (s[0], s[0])) if kind == "weight" else (lambda s: (s[0],)))
      for proj in ("k_proj", "v_proj", "q_proj", "out_proj") for kind in ("weight", "bias")),
    ("layer_norm2.weight", lambda s: (s[0],)), ("layer_norm2.bias", lambda s: (s[0],)),
    ("mlp.fc1.weight", lambda s: (s[1], s[0])), ("mlp.fc1.bias", lambda s: (s[1],)),
    ("mlp.fc2.weight", lambda s: (s[0], s[1])), ("mlp.fc2.bias", lambda s: (s[0],)),
)
_SIGLIP_POST_NORM = ("post_layernorm.weight", "post_layernorm.bias")


def _siglip_embeddings(vision: Mapping[str, Any], width: int) -> list[VisionTensor]:
    """The patch embedding (a convolution of ``patch_size`` stride) and the position table, one row per patch."""
    patch, image = _size(vision, "patch_size", 16), _size(vision, "image_size", 224)
    shapes = ((width, _size(vision, "num_channels", 3), patch, patch), (width,), ((image // patch) ** 2, width))
    return [VisionTensor(SIGLIP_MODULE + name, shape, "tower")
            for name, shape in zip(_SIGLIP_EMBEDDINGS, shapes, strict=True)]


def gemma3_vision(vision: Mapping[str, Any], hidden_size: int) -> list[VisionTensor]:
    """transformers' ``SiglipVisionTransformer`` (defaults of ``SiglipVisionConfig``) without its pooling head, and
    Gemma 3's projector into ``hidden_size``."""
    from pgconvert.model.rules import COLUMN

    if vision.get("vision_use_head", True) is not False:
        raise ConfigError(f"vision_config.vision_use_head={quote(vision.get('vision_use_head'))}: Gemma 3's tower has "
                          "no pooling head (needs false; absent, SiglipVisionConfig builds one)")
    width = _size(vision, "hidden_size", 768)
    heads = _size(vision, "num_attention_heads", 12)
    if width % heads:
        raise ConfigError(f"vision_config.num_attention_heads={heads}: must divide vision_config.hidden_size={width}")
    widths: _Widths = (width, _size(vision, "intermediate_size", 3072))
    layers = [VisionTensor(SIGLIP_MODULE + SIGLIP_LAYERS.format(index) + name, shape(widths), "tower")
              for index in range(_size(vision, "num_hidden_layers", 12)) for name, shape in _SIGLIP_LAYER]
    post_norm = [VisionTensor(SIGLIP_MODULE + name, (width,), "tower") for name in _SIGLIP_POST_NORM]
    projector = [VisionTensor(GEMMA3_PROJECTOR_MODULE + GEMMA3_PROJECTOR_NORM, (width,), "projector"),
                 VisionTensor(GEMMA3_PROJECTOR_MODULE + GEMMA3_PROJECTION, (hidden_size, width), "projector", COLUMN)]
    return [*_siglip_embeddings(vision, width), *layers, *post_norm, *projector]


# Every tensor name of the SigLIP tower inside its module, ``{}`` for a layer's index.
SIGLIP_PATTERNS: tuple[str, ...] = (*_SIGLIP_EMBEDDINGS, *(SIGLIP_LAYERS + name for name, _ in _SIGLIP_LAYER),
                                    *_SIGLIP_POST_NORM)


# Mistral 3's vision part (transformers' ``Mistral3Model``): the Pixtral tower (``PixtralVisionModel``: a patch
# convolution, RMSNorms, gated SiLU MLPs and 2-D RoPE without tensors; no biases) and the multimodal projector
# (``Mistral3MultiModalProjector``: an RMSNorm, the patch merger's linear over ``spatial_merge_size``² patches, two
# linears with ``projector_hidden_act`` between into the language model's width). The projector's settings are
# config.json's top-level keys, folded into the vision config pgconvert holds (``MISTRAL3_PROJECTOR_KEYS``); its
# output is the language model's width. Megatron-Bridge's ``Ministral3Bridge`` holds them as transformers'
# modules ``vision_tower.`` and ``multi_modal_projector.`` (``ReplicatedMapping("vision_tower.**")``, and the same for
# the projector), on the first stage.
MISTRAL3_TOWER_MODULE = "vision_tower."
MISTRAL3_PROJECTOR_MODULE = "multi_modal_projector."
# Mistral3Config's top-level projector settings and their defaults.
MISTRAL3_PROJECTOR_KEYS: dict[str, Any] = {"spatial_merge_size": 2, "vision_feature_layer": -1,
                                           "multimodal_projector_bias": False, "projector_hidden_act": "gelu"}
PIXTRAL_LAYERS = "transformer.layers.{}."
# A Pixtral layer's tensors, shapes from (hidden, intermediate).
_PIXTRAL_LAYER: tuple[tuple[str, Callable[[tuple[int, int]], tuple[int, ...]]], ...] = (
    ("attention_norm.weight", lambda s: (s[0],)), ("ffn_norm.weight", lambda s: (s[0],)),
    *((f"attention.{name}_proj.weight", lambda s: (s[0], s[0])) for name in ("q", "k", "v", "o")),
    ("feed_forward.gate_proj.weight", lambda s: (s[1], s[0])), ("feed_forward.up_proj.weight", lambda s: (s[1], s[0])),
    ("feed_forward.down_proj.weight", lambda s: (s[0], s[1])),
)
PIXTRAL_PATTERNS: tuple[str, ...] = ("patch_conv.weight", "ln_pre.weight",
                                     *(PIXTRAL_LAYERS + name for name, _ in _PIXTRAL_LAYER))
MISTRAL3_PROJECTOR_PATTERNS: tuple[str, ...] = ("norm.weight", "patch_merger.merging_layer.weight",
                                                "linear_1.weight", "linear_1.bias", "linear_2.weight",
                                                "linear_2.bias")


def _feature_layers(vision: Mapping[str, Any]) -> int:
    """How many tower layers' outputs the projector reads, concatenated (``vision_feature_layer``: one or a list)."""
    layers = vision.get("vision_feature_layer", -1)
    if isinstance(layers, int) and not isinstance(layers, bool):
        return 1
    if isinstance(layers, list) and layers and all(isinstance(layer, int) for layer in layers):
        return len(layers)
    raise ConfigError(f"vision_feature_layer={quote(layers)}: expected a layer index or a list of them")


def _mistral3_projector(vision: Mapping[str, Any], width: int, text: int) -> list[VisionTensor]:
    """``Mistral3MultiModalProjector``'s tensors (``width``: the tower's, ``text``: the language model's); biases with
    ``multimodal_projector_bias``."""
    merged = width * _size(vision, "spatial_merge_size", 2) ** 2
    bias = vision.get("multimodal_projector_bias", False)
    if not isinstance(bias, bool):
        raise ConfigError(f"multimodal_projector_bias={quote(bias)}: must be true or false")
    shapes = {"norm.weight": (width,), "patch_merger.merging_layer.weight": (width, merged),
              "linear_1.weight": (text, width * _feature_layers(vision)), "linear_1.bias": (text,),
              "linear_2.weight": (text, text), "linear_2.bias": (text,)}
    return [VisionTensor(MISTRAL3_PROJECTOR_MODULE + name, shape, "projector") for name, shape in shapes.items()
            if bias or not name.endswith(".bias")]


def pixtral_tower(vision: Mapping[str, Any], hidden_size: int) -> list[VisionTensor]:
    """transformers' ``PixtralVisionModel`` (defaults of ``PixtralVisionConfig``) and Mistral 3's projector into
    ``hidden_size``, in state-dict order."""
    hidden = _size(vision, "hidden_size", 1024)
    heads = _size(vision, "num_attention_heads", 16)
    if hidden % heads:
        raise ConfigError(f"vision_config.num_attention_heads={heads}: must divide vision_config.hidden_size={hidden}")
    side = _size(vision, "patch_size", 16)
    sizes = (hidden, _size(vision, "intermediate_size", 4096))
    embed = [VisionTensor(MISTRAL3_TOWER_MODULE + "patch_conv.weight",
                          (hidden, _size(vision, "num_channels", 3), side, side), "tower"),
             VisionTensor(MISTRAL3_TOWER_MODULE + "ln_pre.weight", (hidden,), "tower")]
    layers = [VisionTensor(MISTRAL3_TOWER_MODULE + PIXTRAL_LAYERS.format(index) + name, shape(sizes), "tower")
              for index in range(_size(vision, "num_hidden_layers", 24)) for name, shape in _PIXTRAL_LAYER]
    return [*embed, *layers, *_mistral3_projector(vision, hidden, hidden_size)]


# The towers pgconvert describes, by their ``vision_config.model_type``.
TOWERS: dict[str, Tower] = {
    "qwen2_5_vl_vision": Tower(QWEN2_5_VL_MODULE, qwen2_5_vl_tower, ("out_hidden_size", 3584)),
    "qwen3_vl_vision": Tower(QWEN3_VL_MODULE, qwen3_vl_tower, ("out_hidden_size", 3584)),
    # Qwen3-VL-MoE's tower is Qwen3-VL's (transformers' Qwen3VLMoeVisionModel, the same modules and defaults).
    "qwen3_vl_moe_vision": Tower(QWEN3_VL_MODULE, qwen3_vl_tower, ("out_hidden_size", 3584)),
    # Gemma 3's (transformers' SiglipVisionModel, as Gemma3Model builds it from ``vision_config``).
    "siglip_vision_model": Tower(SIGLIP_MODULE, gemma3_vision, None, GEMMA3_PROJECTOR_MODULE),
    # Pixtral as Mistral 3 holds it, with Mistral 3's projector.
    "pixtral": Tower(MISTRAL3_TOWER_MODULE, pixtral_tower, None, MISTRAL3_PROJECTOR_MODULE),
}
# Every tower's module: a name under one of them is a vision part's tensor (canonically and in rank files).
VISION_MODULES: tuple[str, ...] = tuple(dict.fromkeys(module for tower in TOWERS.values()
                                                      for module in (tower.module, tower.projector_module) if module))


def is_vision_tensor(name: str) -> bool:
    """Whether ``name`` (canonical, or a VL rank file's key) is a tensor of a vision part."""
    return name.startswith(VISION_MODULES)


def parse_vision_config(text: str) -> dict[str, Any]:
    """``vision_config`` (JSON text of HF's object) as a dict; a tower pgconvert describes."""
    try:
        vision = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"vision_config={quote(text)}: not JSON text of an object ({exc})") from exc
    if not isinstance(vision, dict):
        raise ConfigError(f"vision_config={quote(text)}: must be JSON text of an object")
    if vision.get("model_type") not in TOWERS:
        raise ConfigError(f"vision_config.model_type={quote(vision.get('model_type'))}: pgconvert describes the vision "
                          f"towers {', '.join(sorted(TOWERS))}")
    return vision


def vision_config_text(vision: Mapping[str, Any]) -> str:
    """The one JSON spelling of a ``vision_config`` (keys sorted), so equal configs compare equal."""
    return json.dumps(vision, sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=8)
def tower_tensors(vision_config: str | None, hidden_size: int) -> tuple[VisionTensor, ...]:
    """The vision part's tensors, in state-dict order (none for a text model), for a language model of
    ``hidden_size``; computed once per vision config (every ModelConfig checks it, and the provider asks it per
    tensor)."""
    if vision_config is None:
        return ()
    vision = parse_vision_config(vision_config)
    return tuple(TOWERS[vision["model_type"]].tensors(vision, hidden_size))


def check_projector_width(vision_config: str, hidden_size: int) -> None:
    """The projector writes the language model's input: its output width is the hidden size."""
    vision = parse_vision_config(vision_config)
    output_width = TOWERS[vision["model_type"]].output_width
    if output_width is None:
        return
    key, default = output_width
    width = vision.get(key, default)
    if width != hidden_size:
        raise ConfigError(f"vision_config.{key}={quote(width)}: must equal the language model's hidden_size="
                          f"{hidden_size} (the projector's output is the language model's input)")
