"""Which kind each layer is: a model as a sequence of layer specs, worked out from its settings once.

A decoder layer (``decoder.layers.{L}.``) is made of sublayer kinds, in file order: its mixer (the
token mixer: self-attention, multi-latent attention) and its MLP (dense, or MoE with a router and
routed experts). Each kind is one table of tensors, registered by name in
``pgconvert.model.kinds.LAYER_KINDS``; a spec names its kinds and carries the settings that vary per
layer (MoE or dense, sliding window, RoPE). An MTP layer is a kind too: its own tensors around a
decoder layer, built with the last decoder layer's spec.

A GPT-shaped model has every layer the same mixer and the MLP per ``moe_layer_freq``. A hybrid model
(megatron-core's ``hybrid_override_pattern``: one symbol per layer) has layers of one sublayer each,
the other ``None``: ``M`` a Mamba-2 mixer, ``*`` self-attention, ``-`` a dense MLP, ``E`` a mixture of
experts, numbered as the pattern's symbols (megatron-core's MambaStack). A GPT-shaped model with
``experimental_attention_variant`` "gated_delta_net" (Qwen3-Next) has a gated delta net mixer in the layers
``linear_attention_freq`` marks and self-attention in the others (megatron-core's
``get_linear_attention_pattern``), the MLP as any GPT layer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pgconvert.model.config import ModelConfig

# The position embeddings that rotate queries and keys: RoPE and megatron-core's multimodal RoPE (``mrope``:
# Qwen2.5-VL's, rotary with ``mrope_section``).
ROTARY_TYPES = ("rope", "mrope")

# The kinds' names in pgconvert.model.kinds.LAYER_KINDS.
SELF_ATTENTION = "self_attention"
MULTI_LATENT_ATTENTION = "multi_latent_attention"
DENSE_MLP = "mlp"
MOE = "moe"
MTP = "mtp"
MAMBA = "mamba"
GATED_DELTA_NET = "gated_delta_net"

# Each hybrid_override_pattern symbol's layer: (mixer kind, MLP kind).
HYBRID_LAYER_KINDS: dict[str, tuple[str | None, str | None]] = {
    "M": (MAMBA, None), "*": (SELF_ATTENTION, None), "-": (None, DENSE_MLP), "E": (None, MOE),
}


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: the kinds of its mixer and its MLP (None: the layer has none) and the
    settings that vary per layer."""

    mixer: str | None
    mlp: str | None
    # The attention looks through the sliding window (window_layers; every layer when not given).
    window: bool = False
    # The attention rotates queries and keys (RoPE models, less the no_rope_layers).
    rope: bool = True

    @property
    def kinds(self) -> tuple[str, ...]:
        """The layer's kinds in file order."""
        return tuple(kind for kind in (self.mixer, self.mlp) if kind is not None)

    @property
    def moe(self) -> bool:
        """Whether the MLP is a mixture of experts (megatron-core's moe_layer_freq)."""
        return self.mlp == MOE


@dataclass(frozen=True)
class MTPLayerSpec:
    """One multi-token-prediction layer: its own tensors (kind ``mtp``) around a decoder layer."""

    inner: LayerSpec

    @property
    def kinds(self) -> tuple[str, ...]:
        return (MTP,)

    @property
    def moe(self) -> bool:
        return self.inner.moe


def layer_specs(config: ModelConfig) -> tuple[LayerSpec, ...]:
    """Every decoder layer's spec, in layer order."""
    if config.hybrid_override_pattern is not None:
        return tuple(LayerSpec(*HYBRID_LAYER_KINDS[symbol], window=_is_window_layer(config, layer),
                               rope=_uses_rope(config, layer))
                     for layer, symbol in enumerate(config.hybrid_override_pattern))
    attention = MULTI_LATENT_ATTENTION if config.attention.multi_latent_attention else SELF_ATTENTION
    linear = linear_attention_layers(config)
    return tuple(
        LayerSpec(mixer=GATED_DELTA_NET if linear[layer] else attention,
                  mlp=MOE if _is_moe_layer(config, layer) else DENSE_MLP,
                  window=_is_window_layer(config, layer), rope=_uses_rope(config, layer))
        for layer in range(config.num_layers)
    )


def mtp_layer_specs(config: ModelConfig) -> tuple[MTPLayerSpec, ...]:
    """Every MTP layer's spec: Megatron-LM builds the inner layer with the last decoder layer's spec
    (gpt_builders), so MLA, router, experts and EP are those of a decoder layer."""
    if not config.mtp_num_layers:
        return ()
    return (MTPLayerSpec(config.layers[-1]),) * config.mtp_num_layers


def linear_attention_layers(config: ModelConfig) -> tuple[bool, ...]:
    """Whether each layer is a gated delta net (megatron-core 0.16.1's ``get_linear_attention_pattern``,
    models/gpt/experimental_attention_variant_module_specs.py): an int N makes layer i self-attention
    where ``(i + 1) % N == 0``, a 0/1 list says it per layer (1: linear)."""
    linear = config.linear_attention
    if linear.experimental_attention_variant is None:
        return (False,) * config.num_layers
    freq = linear.linear_attention_freq
    if isinstance(freq, tuple):
        return tuple(value == 1 for value in freq)
    assert isinstance(freq, int)
    return tuple((layer + 1) % freq != 0 for layer in range(config.num_layers))


def _is_moe_layer(config: ModelConfig, layer: int) -> bool:
    """megatron-core's ``moe_layer_freq``: every k-th layer (int) or a 0/1 pattern (list)."""
    moe = config.moe
    if moe.num_experts is None:
        return False
    if isinstance(moe.moe_layer_freq, tuple):
        return moe.moe_layer_freq[layer] == 1
    return layer % moe.moe_layer_freq == 0


def _is_window_layer(config: ModelConfig, layer: int) -> bool:
    attention = config.attention
    if attention.sliding_window is None:
        return False
    return attention.window_layers is None or attention.window_layers[layer] == 1


def _uses_rope(config: ModelConfig, layer: int) -> bool:
    positions = config.positions
    if positions.position_embedding_type not in ROTARY_TYPES:
        return False
    return positions.no_rope_layers is None or positions.no_rope_layers[layer] == 0
