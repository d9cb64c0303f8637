"""Test-only helpers for GLM-4.5-MoE, dots.llm1 and GPT-OSS: tiny seeded releases, and independent TP forward passes.

Nothing here imports pgconvert. The reference forward reads the Megatron rank files (joined over EP
by ``hf_helpers.read_megatron_tp_ranks``, never through pgconvert's merge) and computes what
megatron-core computes for these settings, written from the architecture: partial rotate-half RoPE
on the first ``rotary_percent`` of each head, q/k RMSNorm before it (per head, or over the whole
projection as MiniMax-M2's: tests/support/minimax_m2_helpers.py), a sigmoid router whose expert bias
only steers the top-k choice, renormalized and scaled weights, and a shared expert where there is one.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from support.family_helpers import rank_qkv, routed_experts, save_with_side_files, seeded_model, tp_swiglu
from support.family_helpers import vocab_parallel_embedding, vocab_parallel_logits
from support.hf_helpers import _layer_norm_weight, _replicated, _rms_norm, _rotate_half
from support.hf_helpers import assert_same_hf_tensors, hf_logits, input_ids
from support.megatron_fixtures import load_for_test
from support.hf_side_helpers import BOS, EOS, PAD
from transformers import (
    Dots1Config,
    Dots1ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    PreTrainedModel,
)

# Layer 0 dense (first_k_dense_replace), layers 1-3 MoE with 4 routed experts and a shared expert
# of 2 × moe_intermediate_size; half of each head rotated; q/k/v biases; qk-norm; scaled routing.
# transformers builds no MTP layer, so the release declares none (Glm4MoeConfig's default is one).
GLM4_MOE_KWARGS: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
    intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=2, first_k_dense_replace=1, use_qk_norm=True, attention_bias=True,
    routed_scaling_factor=2.5, norm_topk_prob=True, vocab_size=1030, max_position_embeddings=256,
    tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5},
    bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, num_nextn_predict_layers=0,
)
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def sigmoid_moe_value(name: str, noise: torch.Tensor) -> torch.Tensor:
    """A parameter of a sigmoid-routed MoE model from its noise: norms near one, routers well separated."""
    if "norm" in name.rsplit(".", 2)[-2]:
        return 1.0 + 0.1 * noise
    return noise if name.endswith(".gate.weight") else 0.05 * noise


def build_glm4_moe(seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """The tiny fp32 model: parameters seeded (``sigmoid_moe_value``) and the e_score_correction_bias buffers
    too, large enough to change which experts are chosen."""
    model, generator = seeded_model(Glm4MoeForCausalLM, Glm4MoeConfig(**{**GLM4_MOE_KWARGS, **overrides}), seed,
                                    sigmoid_moe_value)
    seed_correction_biases(model, generator)
    return model


# dots.llm1's release shrunk: MHA (as many KV heads as heads) with head_dim hidden / heads, q/k norms per head,
# layer 0 dense, then 8 routed experts (top-6 renormalized, scaled by 2.5) and 2 shared ones of the experts'
# FFN size, one router group, RoPE base 1e7 over the whole head, no window (max_window_layers = the layers).
DOTS1_KWARGS: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, intermediate_size=96,
    moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=6, n_shared_experts=2,
    first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, n_group=1, topk_group=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0}, max_position_embeddings=32768,
    rms_norm_eps=1e-5, sliding_window=None, max_window_layers=4, vocab_size=1030, tie_word_embeddings=False,
    attention_bias=False, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
)


def save_dots1(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A complete tiny dots.llm1 release, seeded as GLM-4.5-MoE's (routers well separated, biases that steer)."""
    model, generator = seeded_model(Dots1ForCausalLM, Dots1Config(**{**DOTS1_KWARGS, **overrides}), seed,
                                    sigmoid_moe_value)
    seed_correction_biases(model, generator)
    return save_with_side_files(model, path)


def seed_correction_biases(model: PreTrainedModel, generator: torch.Generator) -> None:
    """Every ``e_score_correction_bias`` buffer (in name order) 0.5 × standard-normal noise: large
    enough to change which experts a sigmoid router chooses."""
    with torch.no_grad():
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.5 * torch.randn(buffer.shape, generator=generator))


def save_glm4_moe(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A complete tiny release: weights in small shards, generation config, tokenizer, chat template."""
    return save_with_side_files(build_glm4_moe(seed, **overrides), path)


def _rope(seq: int, head_dim: int, partial: float, theta: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    rotary = int(head_dim * partial)
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary))
    freqs = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], -1)
    return angles.cos(), angles.sin(), rotary


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: int) -> torch.Tensor:
    turned, kept = x[..., :rotary], x[..., rotary:]
    return torch.cat([turned * cos + _rotate_half(turned) * sin, kept], dim=-1)


def _attention(models: list[dict[str, torch.Tensor]], prefix: str, h: torch.Tensor, c: dict[str, Any],
               window: int | None = None) -> torch.Tensor:
    """Column-parallel fused QKV (rows by query group), row-parallel output projection; a sliding
    ``window`` (a query sees itself and window - 1 keys before), per-head sinks where the rank holds them."""
    batch, seq, _ = h.shape
    heads, groups, head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    per_group = heads // groups
    params = c["rope_parameters"]
    cos, sin, rotary = _rope(seq, head_dim, params.get("partial_rotary_factor", 1.0), params["rope_theta"])
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    if window is not None:
        causal &= ~torch.ones(seq, seq, dtype=torch.bool).tril(-window)
    out = torch.zeros_like(h)
    for model, (q, k, v) in zip(models, _normed_qkv(models, prefix, h, c), strict=True):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = _apply_rope(q, cos, sin, rotary), _apply_rope(k, cos, sin, rotary)
        k, v = k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)
        scores = ((q @ k.transpose(-1, -2)) / math.sqrt(head_dim)).masked_fill(~causal, float("-inf"))
        sinks = model.get(prefix + "self_attention.core_attention.softmax_offset")
        if sinks is not None:  # this rank's heads' sink logits: in the denominator, attending nowhere
            sink = sinks.view(1, -1, 1, 1).expand(batch, -1, seq, 1)
            scores = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            scores = scores.softmax(-1)
        out += (scores @ v).transpose(1, 2).reshape(batch, seq, -1) @ model[
            prefix + "self_attention.linear_proj.weight"].T
    return out


def _normed_qkv(models: list[dict[str, torch.Tensor]], prefix: str, h: torch.Tensor,
                c: dict[str, Any]) -> list[list[torch.Tensor]]:
    """Each rank's q ``[batch, seq, its heads, head_dim]``, k and v ``[batch, seq, its groups, head_dim]``;
    q and k RMS-normed per head (``use_qk_norm``), or over the whole projection
    (``qk_norm_across_heads``: the ranks' sums of squares add up, an all-reduce; the replicated
    weight's rows of each rank's heads)."""
    per_group = c["num_attention_heads"] // c["num_key_value_heads"]
    pieces = [list(rank_qkv(model, prefix, h, per_group, c["head_dim"])) for model in models]
    for index, name in enumerate(("q_layernorm", "k_layernorm") if c.get("use_qk_norm") else ()):
        weight = _replicated(models, prefix + f"self_attention.{name}.weight")
        if not c.get("qk_norm_across_heads"):
            for piece in pieces:
                piece[index] = _rms_norm(piece[index], weight, c["rms_norm_eps"])
            continue
        width = sum(piece[index][0, 0].numel() for piece in pieces)
        mean_square = sum(piece[index].pow(2).sum((-2, -1), keepdim=True) for piece in pieces) / width
        start = 0
        for piece in pieces:
            rows = piece[index].shape[-2:]
            scale = weight[start:start + rows.numel()].view(rows)
            piece[index] = piece[index] * torch.rsqrt(mean_square + c["rms_norm_eps"]) * scale
            start += rows.numel()
    return pieces


def _clamped_glu(models: list[dict[str, torch.Tensor]], key: str, h: torch.Tensor, limit: float,
                 alpha: float) -> torch.Tensor:
    """A TP-split biased MLP with GPT-OSS's activation: (clamp(up, ±limit) + 1) · g·σ(alpha·g),
    g = clamp(gate, max=limit); fc2's bias added once, after the row-parallel sum."""
    out = torch.zeros_like(h)
    for model in models:
        fc1 = h @ model[key + "linear_fc1.weight"].T + model[key + "linear_fc1.bias"]
        gate, up = fc1.chunk(2, dim=-1)
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        out += ((up + 1) * gate * torch.sigmoid(alpha * gate)) @ model[key + "linear_fc2.weight"].T
    return out + _replicated(models, key + "linear_fc2.bias")


def _sigmoid_moe(models: list[dict[str, torch.Tensor]], prefix: str, h: torch.Tensor, c: dict[str, Any]) -> torch.Tensor:
    experts = c["n_routed_experts"]
    scores = (h @ _replicated(models, prefix + "mlp.router.weight").T).sigmoid()
    bias = _replicated(models, prefix + "mlp.router.expert_bias")
    chosen = (scores + bias).topk(c["num_experts_per_tok"], dim=-1).indices
    weights = scores.gather(-1, chosen)
    weights = weights / weights.sum(dim=-1, keepdim=True) * c["routed_scaling_factor"]
    routed = routed_experts(models, prefix, h, weights, chosen, experts)
    if prefix + "mlp.shared_experts.linear_fc1.weight" not in models[0]:
        return routed
    return tp_swiglu(models, prefix + "mlp.shared_experts.", h) + routed


def glm4_moe_tp_logits(models: list[dict[str, torch.Tensor]], c: dict[str, Any], ids: torch.Tensor) -> torch.Tensor:
    """Logits from TP rank dicts (float64), all-reduces done as sums, vocab-parallel embedding and output."""
    vocab, eps = c["vocab_size"], c["rms_norm_eps"]
    x = vocab_parallel_embedding(models, ids)
    for layer in range(c["num_hidden_layers"]):
        prefix = f"decoder.layers.{layer}."
        x = x + _attention(models, prefix, _rms_norm(x, _layer_norm_weight(models, prefix, "input_layernorm.weight"),
                                                     eps), c)
        h = _rms_norm(x, _layer_norm_weight(models, prefix, "pre_mlp_layernorm.weight"), eps)
        moe = prefix + "mlp.router.weight" in models[0]
        x = x + (_sigmoid_moe(models, prefix, h, c) if moe else tp_swiglu(models, prefix + "mlp.", h))
    x = _rms_norm(x, _replicated(models, "decoder.final_layernorm.weight"), eps)
    return vocab_parallel_logits(models, x, vocab)


# --- GPT-OSS -----------------------------------------------------------------------------------------

# Every layer MoE (4 experts, top 2), q/k/v/o biases, sinks, a window of 4 on the even layers (the
# default layer_types), swiglu_limit lowered so the clamp bites at these sizes. RoPE is plain here, as
# the reference forward computes it (tests/test_hf_gpt_oss.py round-trips the released YaRN separately).
GPT_OSS_KWARGS: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
    intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, vocab_size=1030, sliding_window=4,
    max_position_embeddings=256, swiglu_limit=0.5, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
)


def build_gpt_oss(seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """The tiny fp32 model: norms near one, routers and sinks unit-scale, everything else small."""
    def value(name: str, noise: torch.Tensor) -> torch.Tensor:
        if "norm" in name.rsplit(".", 2)[-2]:
            return 1.0 + 0.1 * noise
        if name.endswith(("router.weight", "sinks")):
            return noise
        return 0.2 * noise if "experts" in name else 0.05 * noise
    return seeded_model(GptOssForCausalLM, GptOssConfig(**{**GPT_OSS_KWARGS, **overrides}), seed, value)[0]


def save_gpt_oss(path: Path, seed: int = 0, **overrides: Any) -> Path:
    return save_with_side_files(build_gpt_oss(seed, **overrides), path)


def _softmax_top_k_moe(models: list[dict[str, torch.Tensor]], prefix: str, h: torch.Tensor,
                       c: dict[str, Any]) -> torch.Tensor:
    logits = h @ _replicated(models, prefix + "mlp.router.weight").T + _replicated(models, prefix + "mlp.router.bias")
    top, chosen = logits.topk(c["num_experts_per_tok"], dim=-1)
    weights = top.softmax(dim=-1)
    return routed_experts(models, prefix, h, weights, chosen, c["num_local_experts"],
                          lambda ranks, key, x: _clamped_glu(ranks, key, x, c["swiglu_limit"], c["swiglu_alpha"]))


def gpt_oss_tp_logits(models: list[dict[str, torch.Tensor]], c: dict[str, Any], ids: torch.Tensor) -> torch.Tensor:
    """Logits from TP rank dicts (float64): sinks, sliding layers by layer_types, biases, clamped GLU."""
    vocab, eps = c["vocab_size"], c["rms_norm_eps"]
    x = vocab_parallel_embedding(models, ids)
    for layer in range(c["num_hidden_layers"]):
        prefix = f"decoder.layers.{layer}."
        window = c["sliding_window"] if c["layer_types"][layer] == "sliding_attention" else None
        h = _rms_norm(x, _layer_norm_weight(models, prefix, "input_layernorm.weight"), eps)
        x = x + _attention(models, prefix, h, c, window) + _replicated(models, prefix + "self_attention.linear_proj.bias")
        h = _rms_norm(x, _layer_norm_weight(models, prefix, "pre_mlp_layernorm.weight"), eps)
        x = x + _softmax_top_k_moe(models, prefix, h, c)
    x = _rms_norm(x, _replicated(models, "decoder.final_layernorm.weight"), eps)
    return vocab_parallel_logits(models, x, vocab)


def assert_same_release(src: Path, out: Path, vocab: int) -> None:
    """``out`` is ``src`` again: every tensor equal, config and side files byte-equal, and the same
    transformers logits (rtol=atol=1e-5)."""
    assert_same_hf_tensors(src, out)
    for name in ("config.json", *SIDE_FILES):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    ids = input_ids(vocab)
    torch.testing.assert_close(hf_logits(out, ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


def first_rank_args(root: Path) -> Any:
    """The Megatron args of the first rank file of the iteration-0 checkpoint at ``root``."""
    return load_for_test(root / "iter_0000000" / "mp_rank_00_000" / "model_optim_rng.pt")["args"]
