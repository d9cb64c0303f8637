"""An independent forward pass of a gated delta net mixer over Megatron TP rank files.

Written from the layer's equations and megatron-core 0.16.1's tensor-parallel layout
(ssm/gated_delta_net.py), not from either implementation: rank r's ``in_proj`` rows are its
``[q_r; k_r; v_r; z_r; beta_r; alpha_r]`` and its ``conv1d`` channels its ``[q_r; k_r; v_r]`` (each segment
split over TP on its own), ``A_log`` and ``dt_bias`` its value heads, ``out_proj`` its columns (the
ranks' outputs are summed, as the row-parallel all-reduce does). The delta rule is the plain
recurrence, one token at a time (transformers' and megatron-core's torch paths use the chunked form), in
the input's dtype (float64 in the tests):

    S_t = exp(g_t) · S_{t-1};   S_t += k_t ⊗ β_t (v_t − S_tᵀ k_t);   o_t = S_tᵀ q_t
    g_t = −exp(A_log) · softplus(α_t + dt_bias),   β_t = sigmoid(b_t)

with q and k the SiLU'd causal convolution's channels, L2-normalized per head (eps 1e-6), q scaled by
1/sqrt(key head dim), each key head read by ``value heads / key heads`` consecutive value heads. The
output is RMS-normalized per value head (weight ``1 + w`` where the model's norms are zero-centred),
times silu(z), then ``out_proj``. Keys are the Transformer Engine spec's (the only one megatron-core
builds the layer with). Nothing here imports pgconvert.

``qwen3_next_logits`` is a whole Qwen3-Next model so (megatron-core's TE spec, zero-centred ``1 + w`` norms
everywhere): gated delta net layers as above; gated attention layers whose ``linear_qkv`` rows hold, per query
group, its query heads, their gate heads, a key and a value head (per-head q/k norms, partial rotate-half
RoPE over the first ``partial_rotary_factor`` of each head, the context times sigmoid(gate) before the
row-parallel ``linear_proj``); MoE blocks with a softmax router (top-k renormalized) and a shared expert
scaled by sigmoid(``gate_weight`` · h).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import math

from support.family_helpers import Ranks, routed_experts, tp_swiglu, vocab_parallel_embedding, vocab_parallel_logits
from support.mamba_reference import _causal_depthwise_conv, _replicated

L2_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)


def _delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The recurrence over ``q``/``k`` ``[batch, seq, heads, dk]``, ``v`` ``[batch, seq, heads, dv]``,
    ``g``/``beta`` ``[batch, seq, heads]``."""
    batch, seq, heads, dk = k.shape
    state = torch.zeros(batch, heads, dk, v.shape[-1], dtype=v.dtype)
    outputs = []
    for t in range(seq):
        state = state * torch.exp(g[:, t])[..., None, None]
        remembered = (state * k[:, t, :, :, None]).sum(-2)
        delta = (v[:, t] - remembered) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outputs.append((state * q[:, t, :, :, None]).sum(-2))
    return torch.stack(outputs, dim=1)


def gdn_rank_output(model: dict[str, torch.Tensor], prefix: str, h: torch.Tensor, tp: int,
                    config: dict[str, Any], zero_centred: bool = True) -> torch.Tensor:
    """One TP rank's share of a gated delta net's output (before the all-reduce) for the normed input ``h``."""
    key_heads, value_heads = config["linear_num_key_heads"] // tp, config["linear_num_value_heads"] // tp
    dk, dv = config["linear_key_head_dim"], config["linear_value_head_dim"]
    batch, seq = h.shape[:2]
    projected = h @ model[prefix + "in_proj.weight"].T
    qkv, z, b, a = projected.split([2 * key_heads * dk + value_heads * dv, value_heads * dv, value_heads,
                                    value_heads], dim=-1)
    conv = model[prefix + "conv1d.weight"]
    qkv = F.silu(_causal_depthwise_conv(qkv, conv, torch.zeros(conv.shape[0], dtype=conv.dtype)))
    q, k, v = qkv.split([key_heads * dk, key_heads * dk, value_heads * dv], dim=-1)
    per_key = value_heads // key_heads
    q = _l2norm(q.view(batch, seq, key_heads, dk)).repeat_interleave(per_key, dim=2) * dk ** -0.5
    k = _l2norm(k.view(batch, seq, key_heads, dk)).repeat_interleave(per_key, dim=2)
    g = -torch.exp(model[prefix + "A_log"]) * F.softplus(a + model[prefix + "dt_bias"])
    out = _delta_rule(q, k, v.view(batch, seq, value_heads, dv), g, torch.sigmoid(b))
    weight = model[prefix + "out_norm.weight"] + (1 if zero_centred else 0)
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"]) * weight
    gated = normed * F.silu(z.view(batch, seq, value_heads, dv))
    return gated.reshape(batch, seq, value_heads * dv) @ model[prefix + "out_proj.weight"].T


def gdn_mixer(models: Ranks, prefix: str, h: torch.Tensor, config: dict[str, Any], zero_centred: bool = True) -> torch.Tensor:
    """A gated delta net over every TP rank: the ranks' outputs summed."""
    return sum(gdn_rank_output(model, prefix, h, len(models), config, zero_centred)  # type: ignore[return-value]
               for model in models)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A zero-centred RMSNorm (``1 + w``)."""
    return (1 + weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """Rotate-half RoPE over the first ``partial_rotary_factor`` of each head of ``x [batch, heads, seq, dim]``."""
    params = config["rope_parameters"]
    rotary = int(x.shape[-1] * params.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary))
    freqs = torch.arange(x.shape[-2], dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    rotated, kept = x[..., :rotary], x[..., rotary:]
    first, second = rotated.chunk(2, dim=-1)
    return torch.cat([rotated * cos + torch.cat([-second, first], dim=-1) * sin, kept], dim=-1)


def gated_attention(models: Ranks, prefix: str, h: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """Causal grouped-query attention with an output gate, over every TP rank (outputs summed)."""
    heads, groups, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    per_group, eps = heads // groups, config["rms_norm_eps"]
    batch, seq, _ = h.shape
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    q_norm = _replicated(models, prefix + "self_attention.q_layernorm.weight")
    k_norm = _replicated(models, prefix + "self_attention.k_layernorm.weight")
    out = torch.zeros_like(h)
    for model in models:
        rows = (h @ model[prefix + "self_attention.linear_qkv.weight"].T).view(batch, seq, -1, 2 * per_group + 2, head_dim)
        q = _norm(rows[..., :per_group, :].reshape(batch, seq, -1, head_dim), q_norm, eps).transpose(1, 2)
        gate = rows[..., per_group:2 * per_group, :].reshape(batch, seq, -1)
        k = _norm(rows[..., 2 * per_group, :], k_norm, eps).transpose(1, 2).repeat_interleave(per_group, dim=1)
        v = rows[..., 2 * per_group + 1, :].transpose(1, 2).repeat_interleave(per_group, dim=1)
        scores = (_rope(q, config) @ _rope(k, config).transpose(-1, -2)) / math.sqrt(head_dim)
        context = (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, -1)
        out += (context * torch.sigmoid(gate)) @ model[prefix + "self_attention.linear_proj.weight"].T
    return out


def shared_expert_moe(models: Ranks, prefix: str, h: torch.Tensor, config: dict[str, Any]) -> torch.Tensor:
    """Softmax routing (top-k renormalized where ``norm_topk_prob``), the routed experts, and the shared expert
    scaled by its sigmoid gate."""
    probs = (h @ _replicated(models, prefix + "mlp.router.weight").T).softmax(-1)
    top, chosen = probs.topk(config["num_experts_per_tok"], dim=-1)
    if config["norm_topk_prob"]:
        top = top / top.sum(-1, keepdim=True)
    shared = torch.sigmoid(h @ _replicated(models, prefix + "mlp.shared_experts.gate_weight").T)
    return (routed_experts(models, prefix, h, top, chosen, config["num_experts"])
            + shared * tp_swiglu(models, prefix + "mlp.shared_experts.", h))


def qwen3_next_logits(models: Ranks, config: dict[str, Any], ids: torch.Tensor) -> torch.Tensor:
    """Logits of a Qwen3-Next model (``config``: its config.json) from TP rank files (EP joined)."""
    eps = config["rms_norm_eps"]
    x = vocab_parallel_embedding(models, ids)
    for layer, kind in enumerate(config["layer_types"]):
        prefix = f"decoder.layers.{layer}."
        if kind == "linear_attention":
            h = _norm(x, _replicated(models, prefix + "self_attention.in_proj.layer_norm_weight"), eps)
            x = x + gdn_mixer(models, prefix + "self_attention.", h, config)
        else:
            h = _norm(x, _replicated(models, prefix + "self_attention.linear_qkv.layer_norm_weight"), eps)
            x = x + gated_attention(models, prefix, h, config)
        x = x + shared_expert_moe(models, prefix, _norm(x, _replicated(models, prefix + "pre_mlp_layernorm.weight"),
                                                         eps), config)
    x = _norm(x, _replicated(models, "decoder.final_layernorm.weight"), eps)
    return vocab_parallel_logits(models, x, config["vocab_size"])
