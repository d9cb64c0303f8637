"""An independent forward pass of a hybrid (Mamba-2 / attention / MLP / MoE) model over Megatron TP rank files.

Written from the layer equations and megatron-core 0.16.1's tensor-parallel layout (ssm/mamba_mixer.py),
not from either implementation: rank r's ``in_proj`` rows are its ``[z_r; x_r; B_r; C_r; dt_r]`` and its
``conv1d`` channels its ``[x_r; B_r; C_r]`` (each segment split over TP on its own), ``A_log``, ``D``,
``dt_bias`` its heads, the gated norm's weight its groups' rows, ``out_proj`` its columns (the outputs
of the ranks are summed, as the row-parallel all-reduce does). The scan is the plain recurrence, one
token at a time (transformers' torch path uses the chunked form), in float64:

    h_t = exp(dt_t · A) · h_{t-1} + dt_t · x_t ⊗ B_t      y_t = h_t · C_t + D · x_t
    dt_t = softplus(dt_raw_t + dt_bias),  A = -exp(A_log)

then ``y · silu(z)``, RMS-normalized per group of ``d_inner / ngroups`` channels (eps 1e-5, megatron-core's
RMSNormGated) and scaled by the norm's weight. Keys are the Transformer-Engine spec's (megatron-core's
``mamba_stack_spec``, the only Mamba spec it ships): each layer's input norm is fused into its first
linear, but an MoE layer's, which is a separate ``pre_mlp_layernorm``. An MoE layer (one group of experts
only) chooses each token's top-k experts by sigmoid score plus the router's expert bias, weights them by
their unbiased scores renormalized and scaled by ``routed_scaling_factor``, and adds the shared expert;
every expert is column/row-parallel over TP like the MLP. Nothing here imports pgconvert.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from support.family_helpers import Ranks, rank_qkv, vocab_parallel_embedding, vocab_parallel_logits

# megatron-core's MambaMixer builds its gated norm with eps=1e-5 whatever the model's epsilon.
GATED_NORM_EPS = 1e-5


def _replicated(models: Ranks, key: str) -> torch.Tensor:
    first = models[0][key]
    for tp_rank, model in enumerate(models[1:], start=1):
        assert torch.equal(model[key], first), f"{key}: replica on tp rank {tp_rank} differs"
    return first


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _causal_depthwise_conv(channels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``out[t, c] = bias[c] + sum_k weight[c, 0, k] · in[t - (K-1) + k, c]`` (zeros before the start)."""
    seq, width = channels.shape[-2], weight.shape[-1]
    padded = F.pad(channels, (0, 0, width - 1, 0))
    out = bias.expand_as(channels).clone()
    for k in range(width):
        out = out + padded[..., k:k + seq, :] * weight[:, 0, k]
    return out


def _scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
          d: torch.Tensor) -> torch.Tensor:
    """The recurrence over ``x [batch, seq, heads, head_dim]``, ``dt [batch, seq, heads]``, ``B``/``C``
    ``[batch, seq, heads, state]`` (each head's group's), ``A``/``D`` ``[heads]``."""
    batch, seq, heads, head_dim = x.shape
    state = torch.zeros(batch, heads, head_dim, b.shape[-1], dtype=x.dtype)
    outputs = []
    for t in range(seq):
        decay = torch.exp(dt[:, t] * a)[..., None, None]
        state = decay * state + (dt[:, t, :, None, None] * x[:, t, :, :, None] * b[:, t, :, None, :])
        outputs.append((state * c[:, t, :, None, :]).sum(-1) + d[:, None] * x[:, t])
    return torch.stack(outputs, dim=1)


def mamba_rank_output(model: dict[str, torch.Tensor], prefix: str, h: torch.Tensor, tp: int,
                      config: dict[str, Any]) -> torch.Tensor:
    """One TP rank's share of a Mamba mixer's output (before the all-reduce), from its own tensors."""
    heads, head_dim = config["mamba_num_heads"] // tp, config["mamba_head_dim"]
    groups, state = config["n_groups"] // tp, config["ssm_state_size"]
    inner = heads * head_dim
    projected = h @ model[prefix + "mixer.in_proj.weight"].T
    z, xbc, dt = projected.split([inner, inner + 2 * groups * state, heads], dim=-1)
    xbc = F.silu(_causal_depthwise_conv(xbc, model[prefix + "mixer.conv1d.weight"],
                                        model[prefix + "mixer.conv1d.bias"]))
    x, b, c = xbc.split([inner, groups * state, groups * state], dim=-1)
    batch, seq = h.shape[:2]
    per_group = heads // groups
    b = b.view(batch, seq, groups, state).repeat_interleave(per_group, dim=2)
    c = c.view(batch, seq, groups, state).repeat_interleave(per_group, dim=2)
    dt = F.softplus(dt + model[prefix + "mixer.dt_bias"])
    a = -torch.exp(model[prefix + "mixer.A_log"])
    y = _scan(x.view(batch, seq, heads, head_dim), dt, a, b, c, model[prefix + "mixer.D"]).reshape(batch, seq, inner)
    gated = (y * F.silu(z)).view(batch, seq, groups, inner // groups)
    normed = (gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + GATED_NORM_EPS)).reshape(batch, seq, inner)
    return (normed * model[prefix + "mixer.norm.weight"]) @ model[prefix + "mixer.out_proj.weight"].T


def mamba_mixer(models: Ranks, prefix: str, h: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """A Mamba mixer over every TP rank: the ranks' outputs summed."""
    return sum(mamba_rank_output(model, prefix, h, len(models), config) for model in models)  # type: ignore[return-value]


def _attention(models: Ranks, prefix: str, h: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """Grouped-query causal attention without positions, column-parallel QKV, row-parallel projection."""
    heads, groups, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    per_group = heads // groups
    batch, seq, _ = h.shape
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    out = torch.zeros_like(h)
    for model in models:
        q, k, v = (t.transpose(1, 2) for t in rank_qkv(model, prefix, h, per_group, head_dim))
        k, v = k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)
        scores = ((q @ k.transpose(-1, -2)) / math.sqrt(head_dim)).masked_fill(~causal, float("-inf"))
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, -1)
        out += context @ model[prefix + "self_attention.linear_proj.weight"].T
    return out


def _squared_relu_mlp(models: Ranks, module: str, h: torch.Tensor) -> torch.Tensor:
    """``module``'s ``linear_fc1``/``linear_fc2`` (column/row-parallel) with squared ReLU between."""
    return sum(torch.relu(h @ model[module + "linear_fc1.weight"].T).square()  # type: ignore[return-value]
               @ model[module + "linear_fc2.weight"].T for model in models)


def _moe(models: Ranks, prefix: str, h: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """Sigmoid routing with the expert bias choosing, the chosen scores renormalized and scaled; every expert
    computed for every token and weighted (zero where not chosen); plus the shared expert."""
    assert config.get("n_group", 1) == 1, "the reference routes without expert groups"
    scores = torch.sigmoid(h @ _replicated(models, prefix + "mlp.router.weight").T)
    chosen = (scores + _replicated(models, prefix + "mlp.router.expert_bias")).topk(
        config["num_experts_per_tok"], dim=-1).indices
    weights = scores.gather(-1, chosen)
    weights = weights / weights.sum(-1, keepdim=True) * config["routed_scaling_factor"]
    out = _squared_relu_mlp(models, prefix + "mlp.shared_experts.", h)
    for expert in range(config["n_routed_experts"]):
        weight = (weights * (chosen == expert)).sum(-1, keepdim=True)
        out = out + weight * _squared_relu_mlp(models, prefix + f"mlp.experts.local_experts.{expert}.", h)
    return out


# Each layer kind: its (TE-spec) input norm, and its sublayer.
_LAYERS = {
    "M": ("mixer.in_proj.layer_norm_weight", lambda models, prefix, h, config: mamba_mixer(models, prefix, h, config)),
    "*": ("self_attention.linear_qkv.layer_norm_weight", _attention),
    "-": ("mlp.linear_fc1.layer_norm_weight",
          lambda models, prefix, h, config: _squared_relu_mlp(models, prefix + "mlp.", h)),
    "E": ("pre_mlp_layernorm.weight", _moe),
}


# transformers' NemotronHConfig layers_block_type values, as pattern symbols.
SYMBOLS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}


def hybrid_logits(models: Ranks, config: dict[str, Any], ids: torch.Tensor) -> torch.Tensor:
    """Logits of a Nemotron-H-style model (``config``: its config.json) from TP rank files."""
    eps = config["layer_norm_epsilon"]
    x = vocab_parallel_embedding(models, ids)
    for layer, symbol in enumerate(SYMBOLS[kind] for kind in config["layers_block_type"]):
        prefix = f"decoder.layers.{layer}."
        norm, sublayer = _LAYERS[symbol]
        x = x + sublayer(models, prefix, _rms_norm(x, _replicated(models, prefix + norm), eps), config)
    x = _rms_norm(x, _replicated(models, "decoder.final_norm.weight"), eps)
    return vocab_parallel_logits(models, x, config["vocab_size"])
