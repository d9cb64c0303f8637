"""Arcee (``ArceeForCausalLM``, arcee-ai/AFM-4.5B): Llama with a non-gated squared-ReLU MLP.

transformers' ArceeMLP is ``down_proj(relu2(up_proj(x)))`` (``hidden_act`` ``relu2``: ``relu(x) ** 2``), no
gate: megatron-core's MLP with ``gated_linear_unit=False`` and squared ReLU (Megatron-LM's
``--squared-relu``), the one Nemotron-H's MLP layers have, so ``up_proj`` is the whole ``linear_fc1``
(column-parallel, not ``[gate; up]``). Attention, norms and biases are Llama's (``attention_bias`` for
q, k, v and o, ``mlp_bias`` for up and down: one Megatron switch, so they must agree).

AFM-4.5B: 36 layers, hidden 2560, 20 heads of 128 with 4 KV heads, FFN 18432, untied, no biases, RoPE
base 1e4 with YaRN (factor 20 over 4096 original positions, ``beta_fast`` 32, ``beta_slow`` 1,
``mscale`` 1) to 65536 positions: megatron-core's ``position_embedding_type='yarn'``
(``pgconvert.semantics.yarn``).
"""

from __future__ import annotations

from pgconvert.families.llama import LLAMA, max_positions
from pgconvert.families.table import ConfigField, TensorMapping

_MLP = "model.layers.{}.mlp."

ARCEE = LLAMA.derive(
    "ArceeForCausalLM", "arcee",
    # up_proj alone is linear_fc1 (no gate).
    rows=(TensorMapping("decoder.layers.{}.mlp.linear_fc1.weight", (_MLP + "up_proj.weight",)),
          TensorMapping("decoder.layers.{}.mlp.linear_fc1.bias", (_MLP + "up_proj.bias",))),
    # ArceeConfig's defaults: 4096 positions, eps 1e-5 (a null or absent num_key_value_heads is one group
    # per head, head_dim hidden_size / num_attention_heads, as Llama's).
    fields=(max_positions(4096), ConfigField(("rms_norm_eps",), "norm_epsilon", float, default=1e-5)),
    fixed={"gated_linear_unit": False, "activation": "squared_relu"},
    hf_fixed={"hidden_act": "relu2"},
    hf_notes={"activation": "hidden_act = relu2 (fixed; no gate_proj)"},
)
