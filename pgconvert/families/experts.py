"""Mixture-of-experts pieces of config.json that several families share.

megatron-core says which layers are MoE with ``moe_layer_freq`` (an int k: layer i when
``i % k == 0``; or a 0/1 per layer) and the experts' FFN size with ``moe_ffn_hidden_size`` (None:
``ffn_hidden_size``); config.json spells both per family (every layer, a sparse step and a list of
dense layers, the first k dense), which each family's rule reads with these helpers.
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.model.config import ModelConfig
from pgconvert.families.llama import SWIGLU_RMS_ROPE
from pgconvert.families.table import ConfigField, ConfigRule, write_nothing

# Routed experts only: no shared experts, no router expert bias.
ROUTED_EXPERTS_ONLY: dict[str, object] = {
    **SWIGLU_RMS_ROPE,
    "moe_shared_expert_intermediate_size": None,
    "moe_router_enable_expert_bias": False,
}


def aux_loss(default: float) -> ConfigField:
    """``router_aux_loss_coef`` (the config class's ``default`` where absent)."""
    return ConfigField(("router_aux_loss_coef",), "moe_aux_loss_coeff", float, default=default)


# Every family's but OLMoE's (0.01).
AUX_LOSS = aux_loss(0.001)


def expert_count(key: str, default: int, alias: str | None = None, legacy: str | None = None) -> ConfigField:
    """The routed-expert count under ``key`` (the config class's ``default`` where absent), under the
    older ``legacy`` spelling (written too) or the ``alias`` its ``attribute_map`` also accepts; a null
    is refused (the MoE block takes the count as given, and an alias bypasses the class's type check)."""
    return ConfigField((key,), "num_experts", int, default=default, legacy=((legacy,),) if legacy else (),
                       aliases=((alias,),) if alias else (),
                       null_refused="transformers' MoE block takes the expert count as given, and null is no count")


def expert_ffn_size(config: ModelConfig) -> int:
    """The experts' FFN size as config.json holds it (``ConfigField.written``)."""
    return config.expert_ffn_size


def dense_layers(config: ModelConfig) -> list[int]:
    return [layer for layer in range(config.num_layers) if not config.layers[layer].moe]


def _moe_layer_freq_text(config: ModelConfig) -> str:
    freq = config.moe.moe_layer_freq
    return repr(list(freq) if isinstance(freq, tuple) else freq)


def _every_layer_moe(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    # Every layer is MoE and intermediate_size is the experts' FFN; Megatron still wants a dense
    # FFN size, and the experts' is the one Mixtral checkpoints converted by Megatron carry.
    return {"ffn_hidden_size": model["moe_ffn_hidden_size"], "moe_layer_freq": 1}


def refuses_dense_model(config: ModelConfig) -> str | None:
    return None if config.moe.num_experts is not None else "num_experts=None (needs routed experts)"


def _refuses_dense_layers(config: ModelConfig) -> str | None:
    if config.moe.num_experts is None:
        return "num_experts=None (needs routed experts)"
    dense = dense_layers(config)
    if dense:
        return f"moe_layer_freq={_moe_layer_freq_text(config)} (needs every layer MoE; dense layers: {dense})"
    return None


# Every layer MoE (Mixtral, OLMoE, GPT-OSS): no config.json key of its own.
EVERY_LAYER_MOE = ConfigRule(keys=(), model_fields=("ffn_hidden_size", "moe_layer_freq"), read=_every_layer_moe,
                             write=write_nothing, refuses=_refuses_dense_layers)
