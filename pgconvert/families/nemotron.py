"""Nemotron (``NemotronForCausalLM``: nvidia/Minitron-4B-Base, Minitron-8B-Base, Nemotron-Mini-4B-Instruct).

transformers' Nemotron is the Nemotron-4 layer Megatron-LM trains: ``NemotronLayerNorm1P`` normalizes with
``nn.LayerNorm``'s weight and bias as ``1 + weight`` (megatron-core's ``LayerNorm`` with
``layernorm_zero_centered_gamma``, Megatron-LM's ``--apply-layernorm-1p``: the stored numbers are the same on both
sides, ``Family.hf_norms_zero_centred``), a non-gated MLP ``down_proj(relu2(up_proj(x)))`` (``--squared-relu``:
``up_proj`` alone is ``linear_fc1``, Arcee's), rotate-half RoPE on the first ``partial_rotary_factor`` of each head
(NemotronConfig's default 0.5: megatron-core's ``rotary_percent``), and Llama's attention with GQA and a head
size apart from ``hidden_size / num_attention_heads`` (Minitron-8B: 48 heads of 128 over 4096).
``attention_bias`` (q, k, v and o) and ``mlp_bias`` (up and down) are megatron-core's one ``add_bias_linear``,
so they must agree; the releases have neither.

NemotronConfig keeps a null or absent ``num_key_value_heads`` and its attention divides by it, so that is
refused, as is a top-level null ``partial_rotary_factor`` (its attention reads the factor from
``rope_parameters``, where a null leaves none); a null ``head_dim`` is ``hidden_size / num_attention_heads``.
"""

from __future__ import annotations

from pgconvert.families.arcee import ARCEE
from pgconvert.families.llama import head_dim_field, max_positions, partial_rope_rule
from pgconvert.families.table import ConfigField, TensorMapping

_L = "model.layers.{}."
_D = "decoder.layers.{}."

# NemotronConfig's kwargs.setdefault("partial_rotary_factor", 0.5).
NEMOTRON_PARTIAL_ROTARY = 0.5

NEMOTRON = ARCEE.derive(
    "NemotronForCausalLM", "nemotron",
    # Arcee's rows (up_proj alone as linear_fc1) and the LayerNorms' biases.
    rows=(TensorMapping(_D + "input_layernorm.bias", (_L + "input_layernorm.bias",)),
          TensorMapping(_D + "pre_mlp_layernorm.bias", (_L + "post_attention_layernorm.bias",)),
          TensorMapping("decoder.final_layernorm.bias", ("model.norm.bias",))),
    fields=(
        max_positions(4096),
        # NemotronConfig's default is None: absent or null, its attention cannot be built.
        ConfigField(("num_key_value_heads",), "num_query_groups", int,
                    null_refused="NemotronAttention divides num_attention_heads by num_key_value_heads as given, and "
                                 "null is no head count"),
        head_dim_field(nullable=True),
        ConfigField(("norm_eps",), "norm_epsilon", float, default=1e-5),
    ),
    rules=(partial_rope_rule(NEMOTRON_PARTIAL_ROTARY, "Nemotron", top_level_null_refused=(
        "NemotronConfig keeps it, rope_parameters then has none, and NemotronAttention reads it from there")),),
    fixed={"normalization": "LayerNorm", "layernorm_zero_centered_gamma": True},
    hf_norms_zero_centred=True,
    hf_computes=frozenset({"rotary_percent"}),
    hf_notes={"normalization": "LayerNorm with biases, as 1 + weight (NemotronLayerNorm1P; fixed)",
              "zero-centred norm gamma": "always (NemotronLayerNorm1P: the weights are copied as they are)",
              "norm epsilon": "norm_eps",
              "rotary percent": "rope_parameters.partial_rotary_factor (4.x: top level; default 0.5)",
              "activation": "hidden_act = relu2 (fixed; no gate_proj)"},
)
