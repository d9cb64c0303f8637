"""Nemotron-H (``NemotronHForCausalLM``): NVIDIA's hybrid Mamba-2 / attention / MLP / MoE decoder.

transformers 5.x (``models/nemotron_h``) names every layer ``backbone.layers.{i}`` (its conversion
mapping renames ``backbone.`` to ``model.`` on load and back on save) with one pre-norm ``norm`` and
one ``mixer``, whose kind ``layers_block_type`` gives per layer (older configs: the
``hybrid_override_pattern`` string, M Mamba-2, * attention, - MLP, E MoE): the same one symbol per
layer as megatron-core's MambaModel, so the layer indices are the same on both sides
(``pgconvert.model.layers``). The Mamba mixer's tensors (``in_proj`` = ``[z; x; B; C; dt]``,
``conv1d`` over ``[x; B; C]``, ``A_log``, ``D``, ``dt_bias``, the gated ``norm``, ``out_proj``) are
megatron-core's own, row for row (``pgconvert.model.kinds.mamba``); attention is grouped-query without
positions (megatron-core's ``position_embedding_type='none'``, as Megatron-Bridge's Nemotron-H
bridge sets it) and the MLP ``up_proj``/``down_proj`` with squared ReLU (``relu2``, Megatron-LM's
``--squared-relu``).

What megatron-core 0.16.1's MambaMixer fixes and config.json must agree with: a convolution 4 wide
with a bias, no projection biases, SiLU. Two computations differ, and a Megatron output names them in
a notice (``--strict`` refuses it): transformers clamps the softplus time step at ``time_step_min``
from below, where megatron-core does not clamp (carried in args as ``time_step_min``,
``pgconvert.semantics.carried``, so converting back restores it; a Megatron model without it is written
with 0.0, which clamps nothing), and its gated norm uses ``layer_norm_epsilon`` where megatron-core
fixes 1e-5 (``pgconvert.semantics.mamba``).

MoE layers (``E``, Nemotron 3 Nano): transformers' NemotronHMoE <-> megatron-core's MoELayer, whose
pre-norm is the layer's ``norm``: the router ``gate.weight`` and its ``e_score_correction_bias``
(``router.expert_bias``), non-gated relu2 experts ``experts.{j}.up_proj``/``down_proj`` (stored one
per expert; transformers merges them on load) and one shared expert of
``moe_shared_expert_intermediate_size`` (transformers ignores ``n_shared_experts``), the names Megatron-Bridge's
NemotronHBridge maps too. The router is
DeepSeek-V3's (``pgconvert.families.deepseek``): sigmoid scores plus the bias choose, the chosen scores
are renormalized (megatron-core always does with top-k > 1, so ``norm_topk_prob`` must be true) and
scaled by ``routed_scaling_factor``; groups score by their top-2 sum. ``moe_latent_size`` (latent
expert projections) is refused. The MoE keys are read only for a pattern with ``E`` (transformers'
config holds them, unused, for a dense model too).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from pathlib import Path

from pgconvert.errors import CheckpointError
from pgconvert.io.limits import quote
from pgconvert.semantics.carried import CarriedSetting
from pgconvert.model.config import HYBRID_SYMBOLS, POSTNORM_OFF, ModelConfig
from pgconvert.families.deepseek import DEEPSEEK_COMPUTES, config_count, routed_scaling, router_groups
from pgconvert.families.table import QKV, ConfigField, ConfigRule, Family, TensorMapping, TensorTable

_LAYER = "backbone.layers.{}."
_MAMBA = "mixer."
TENSORS = TensorTable((
    TensorMapping("embedding.word_embeddings.weight", ("backbone.embeddings.weight",)),
    # Every layer's pre-norm: megatron-core's name depends on the layer's kind.
    TensorMapping("decoder.layers.{}.norm.weight", (_LAYER + "norm.weight",), by_layer_kind=True),
    *(TensorMapping(f"decoder.layers.{{}}.mixer.{name}", (_LAYER + _MAMBA + name,))
      for name in ("dt_bias", "A_log", "D", "in_proj.weight", "conv1d.weight", "conv1d.bias", "norm.weight",
                   "out_proj.weight")),
    TensorMapping("decoder.layers.{}.input_layernorm.weight", (_LAYER + "norm.weight",), by_layer_kind=True),
    TensorMapping("decoder.layers.{}.self_attention.linear_qkv.weight",
                  tuple(_LAYER + f"mixer.{proj}_proj.weight" for proj in "qkv"), QKV),
    TensorMapping("decoder.layers.{}.self_attention.linear_proj.weight", (_LAYER + "mixer.o_proj.weight",)),
    TensorMapping("decoder.layers.{}.pre_mlp_layernorm.weight", (_LAYER + "norm.weight",), by_layer_kind=True),
    TensorMapping("decoder.layers.{}.mlp.linear_fc1.weight", (_LAYER + "mixer.up_proj.weight",)),
    TensorMapping("decoder.layers.{}.mlp.linear_fc2.weight", (_LAYER + "mixer.down_proj.weight",)),
    TensorMapping("decoder.layers.{}.mlp.router.weight", (_LAYER + "mixer.gate.weight",)),
    TensorMapping("decoder.layers.{}.mlp.router.expert_bias", (_LAYER + "mixer.gate.e_score_correction_bias",)),
    *(TensorMapping(f"decoder.layers.{{}}.mlp.experts.local_experts.{{}}.linear_fc{n}.weight",
                    (_LAYER + f"mixer.experts.{{}}.{proj}_proj.weight",)) for n, proj in ((1, "up"), (2, "down"))),
    *(TensorMapping(f"decoder.layers.{{}}.mlp.shared_experts.linear_fc{n}.weight",
                    (_LAYER + f"mixer.shared_experts.{proj}_proj.weight",)) for n, proj in ((1, "up"), (2, "down"))),
    TensorMapping("decoder.final_layernorm.weight", ("backbone.norm_f.weight",)),
    TensorMapping("output_layer.weight", ("lm_head.weight",)),
))


def _read_layers(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """The layer kinds as transformers' NemotronHConfig reads them: ``layers_block_type`` (or its
    attribute_map alias ``layer_types``), else the ``hybrid_override_pattern`` string; the layer count
    is their length (``num_hidden_layers`` is ignored, as transformers ignores it)."""
    kinds = present.get("layers_block_type", present.get("layer_types"))
    if kinds is not None:
        if not isinstance(kinds, list) or any(kind not in _SYMBOL_OF for kind in kinds):
            raise ValueError(f"layers_block_type={quote(kinds)}: expected a list of {', '.join(_SYMBOL_OF)}")
        pattern = "".join(_SYMBOL_OF[kind] for kind in kinds)
    else:
        # Neither given (or null): NemotronHConfig's own default layers.
        pattern = present.get("hybrid_override_pattern") or _DEFAULT_PATTERN
        if not isinstance(pattern, str) or set(pattern) - set(HYBRID_SYMBOLS):
            raise ValueError(f"hybrid_override_pattern={quote(pattern)}: expected a string of "
                             f"{' '.join(HYBRID_SYMBOLS)} (or give layers_block_type)")
    return {"num_layers": len(pattern), "hybrid_override_pattern": pattern}


def _write_layers(config: ModelConfig) -> Mapping[str, object]:
    """Both spellings (transformers 5 reads the list, older remote code the string) and the count."""
    pattern = config.hybrid_override_pattern
    assert pattern is not None
    kind_of = {symbol: kind for kind, symbol in _SYMBOL_OF.items()}
    return {"layers_block_type": [kind_of[symbol] for symbol in pattern], "hybrid_override_pattern": pattern,
            "num_hidden_layers": len(pattern)}


def _refuses_layers(config: ModelConfig) -> str | None:
    """A model without a layer pattern."""
    if config.hybrid_override_pattern is None:
        return "hybrid_override_pattern=None (needs a hybrid layer pattern)"
    return None


def _non_negative(args: argparse.Namespace, name: str, default: object, path: Path) -> object:
    """``args.<name>``, a finite number of at least 0, or ``default`` when absent or None."""
    value = getattr(args, name, None)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise CheckpointError(f"{path}: args.{name}={quote(value)}: must be a finite number of at least 0")
    return float(value)


# NemotronHConfig's defaults of the MoE keys.
_MOE_DEFAULTS: dict[str, object] = {
    "moe_intermediate_size": 7688, "num_experts_per_tok": 2,
    "moe_shared_expert_intermediate_size": 7688}
# The MoE settings of a model without E layers (ModelConfig's defaults).
_NO_EXPERTS: dict[str, object] = {
    "num_experts": None, "moe_ffn_hidden_size": None, "moe_router_topk": 2,
    "moe_shared_expert_intermediate_size": None, "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False, "moe_router_num_groups": None, "moe_router_group_topk": None,
    "moe_router_topk_scaling_factor": None}


def _moe_count(present: Mapping[str, object], key: str, minimum: int = 1) -> int:
    """``present[key]`` (NemotronHConfig's default where absent), an integer of at least ``minimum``."""
    return config_count(present.get(key, _MOE_DEFAULTS[key]), key, minimum)


def _read_experts(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    """The MoE settings of a pattern with E layers, as NemotronHMoE and its router compute them."""
    pattern = model["hybrid_override_pattern"]
    if not isinstance(pattern, str) or "E" not in pattern:
        return _NO_EXPERTS
    if present.get("moe_latent_size") is not None:
        raise ValueError(f"moe_latent_size={quote(present['moe_latent_size'])}: latent expert projections "
                         "(fc1_latent_proj/fc2_latent_proj) are not converted; needs null")
    if present.get("norm_topk_prob", True) is not True:
        raise ValueError(f"norm_topk_prob={quote(present['norm_topk_prob'])}: megatron-core renormalizes the chosen "
                         "sigmoid scores; needs true")
    topk = _moe_count(present, "num_experts_per_tok")
    if topk == 1:
        raise ValueError("num_experts_per_tok=1: transformers renormalizes the one chosen score to 1 "
                         "(norm_topk_prob), megatron-core keeps its sigmoid score; no megatron-core equivalent")
    # num_local_experts: the alias NemotronHConfig's attribute_map reads as n_routed_experts.
    # Given, the alias wins (PretrainedConfig.__init__ sets it after NemotronHConfig's own n_routed_experts).
    key = "num_local_experts" if "num_local_experts" in present else "n_routed_experts"
    experts = config_count(present.get(key, 8), key, 1)
    values = {"num_experts": experts, "moe_router_topk": topk,
              "moe_ffn_hidden_size": _moe_count(present, "moe_intermediate_size"),
              "moe_shared_expert_intermediate_size": _moe_count(present, "moe_shared_expert_intermediate_size"),
              "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
              "moe_router_topk_scaling_factor": routed_scaling(present, 1.0)}
    groups = router_groups(present, values, per_group=2, defaults=(1, 1))
    return {**values, "moe_router_num_groups": groups and groups[0], "moe_router_group_topk": groups and groups[1]}


def _write_experts(config: ModelConfig) -> Mapping[str, object]:
    moe = config.moe
    if moe.num_experts is None:
        return {}
    return {"n_routed_experts": moe.num_experts, "moe_intermediate_size": config.expert_ffn_size,
            "num_experts_per_tok": moe.moe_router_topk, "n_shared_experts": 1,
            "moe_shared_expert_intermediate_size": moe.moe_shared_expert_intermediate_size,
            "routed_scaling_factor": moe.moe_router_topk_scaling_factor or 1.0, "norm_topk_prob": True,
            "n_group": moe.moe_router_num_groups or 1, "topk_group": moe.moe_router_group_topk or 1,
            "moe_latent_size": None}


def _refuses_experts(config: ModelConfig) -> str | None:
    """What NemotronHMoE cannot compute: anything but one shared expert and DeepSeek-V3's sigmoid router."""
    moe, pattern = config.moe, config.hybrid_override_pattern or ""
    if "E" not in pattern:
        return None if moe.num_experts is None else f"num_experts={moe.num_experts} (needs E layers in the pattern)"
    needs = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
             "moe_shared_expert_gate": False}
    wrong = [f"{name}={config.setting(name)!r} (needs {value!r})" for name, value in needs.items()
             if config.setting(name) != value]
    if moe.moe_shared_expert_intermediate_size is None:
        wrong.append("moe_shared_expert_intermediate_size=None (NemotronHMoE always has a shared expert)")
    if moe.moe_router_topk < 2:
        wrong.append(f"moe_router_topk={moe.moe_router_topk} (the chosen scores are renormalized: needs top-k > 1)")
    if moe.moe_router_group_topk and moe.moe_router_topk // moe.moe_router_group_topk != 2:
        wrong.append(f"moe_router_group_topk={moe.moe_router_group_topk} with moe_router_topk={moe.moe_router_topk} "
                     "(a group scores by its best 2 experts: needs topk // group_topk = 2)")
    return ", ".join(wrong) or None


_EXPERTS = ConfigRule(
    keys=("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok", "n_shared_experts",
          "moe_shared_expert_intermediate_size", "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group",
          "moe_latent_size"),
    model_fields=tuple(_NO_EXPERTS), read=_read_experts, write=_write_experts, refuses=_refuses_experts,
    null_keys=("moe_latent_size",), legacy_keys=("num_local_experts",))


# NemotronHConfig's default layers_block_type (linear_attention, moe, full_attention, mlp), as a pattern.
_DEFAULT_PATTERN = "ME*-"
# transformers' layers_block_type values by hybrid_override_pattern symbol (NemotronHConfig._pattern_to_list).
_SYMBOL_OF = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}

NEMOTRON_H = Family(
    architecture="NemotronHForCausalLM",
    model_type="nemotron_h",
    tensors=TENSORS,
    fields=(
        ConfigField(("hidden_size",), "hidden_size", int),
        ConfigField(("num_attention_heads",), "num_attention_heads", int, default=32),
        ConfigField(("num_key_value_heads",), "num_query_groups", int, default=8, nullable=True),
        ConfigField(("head_dim",), "kv_channels", int, default=128),
        ConfigField(("intermediate_size",), "ffn_hidden_size", int, default=21504),
        ConfigField(("layer_norm_epsilon",), "norm_epsilon", float, default=1e-5),
        ConfigField(("max_position_embeddings",), "max_position_embeddings", int, default=4096),
        ConfigField(("vocab_size",), "vocab_size", int, default=131072),
        ConfigField(("tie_word_embeddings",), "tie_embeddings", bool, default=False),
        ConfigField(("attention_dropout",), "attention_dropout", float, default=0.0),
        ConfigField(("hidden_dropout",), "hidden_dropout", float, default=0.0),
        ConfigField(("mamba_num_heads",), "mamba_num_heads", int, default=128),
        ConfigField(("mamba_head_dim",), "mamba_head_dim", int, default=64),
        ConfigField(("n_groups",), "mamba_num_groups", int, default=8),
        ConfigField(("ssm_state_size",), "mamba_state_dim", int, default=128),
        ConfigField(("time_step_min",), "time_step_min", float, default=0.001),
    ),
    rules=(ConfigRule(keys=("layers_block_type", "hybrid_override_pattern", "num_hidden_layers"),
                      model_fields=("num_layers", "hybrid_override_pattern"), read=_read_layers,
                      write=_write_layers, refuses=_refuses_layers, legacy_keys=("layer_types",)), _EXPERTS),
    fixed={**POSTNORM_OFF, "gated_linear_unit": False, "activation": "squared_relu", "normalization": "RMSNorm",
           "position_embedding_type": "none", "multi_latent_attention": False, "moe_router_pre_softmax": False,
           "qk_layernorm": False, "add_qkv_bias": False, "add_bias_linear": False, "sliding_window": None},
    # What megatron-core's MambaMixer and the tensor table assume.
    # megatron-core ships one Mamba stack spec, of Transformer Engine modules (mamba_stack_spec).
    # Its E layers' experts are TEGroupedMLP (get_moe_module_spec(moe_grouped_gemm=True)): grouped names.
    megatron_defaults={"transformer_impl": "transformer_engine", "moe_grouped_gemm": True},
    hf_computes=DEEPSEEK_COMPUTES,
    megatron_carried=(CarriedSetting("time_step_min", 0.0, _non_negative),),
    hf_fixed={"mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "conv_kernel": 4, "use_conv_bias": True,
              "use_bias": False, "mamba_proj_bias": False, "mlp_bias": False, "attention_bias": False,
              "num_nextn_predict_layers": 0},
    hf_notes={"moe score function": "sigmoid with E layers (fixed)",
              "moe expert bias": "e_score_correction_bias with E layers (fixed)",
              "moe top-k scaling": "routed_scaling_factor",
              "moe router groups": "n_group, topk_group (group score: top-2 sum)"},
)
