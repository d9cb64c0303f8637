"""Test-only helpers for the post-sublayer-norm families (Gemma 3, Gemma 2, OLMo 2, OLMo 3, OLMoE, GLM-4, EXAONE 4) and
Gemma (1), which has Gemma's norms and embedding scale without the post norms: tiny seeded models as
``save_pretrained`` writes them, and an independent forward pass over Megatron TP rank files.

Nothing here imports pgconvert. The reference forward reads rank files with plain ``torch.load``
(``hf_helpers.read_megatron_tp_ranks``) and the settings from the HF config.json, and computes what
the architecture computes, rank by rank (column-parallel pieces, row-parallel partial sums added
as an all-reduce would, vocab-parallel embedding and logits), so a misplaced norm, a wrong q/k
group, a lost window or soft-cap shows up whatever pgconvert's merge would do.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from support.family_helpers import save_with_side_files, seeded_model, vocab_parallel_embedding, vocab_parallel_logits
from support.hf_side_helpers import BOS, EOS, PAD
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    Exaone4Config,
    Exaone4ForCausalLM,
    Glm4Config,
    Glm4ForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Olmo3Config,
    Olmo3ForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

VOCAB = 1030  # not a multiple of 128: Megatron pads it
WINDOW = 5  # shorter than the test sequences, so a lost window changes the logits
_COMMON: dict[str, Any] = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
    vocab_size=VOCAB, max_position_embeddings=256, sliding_window=WINDOW, query_pre_attn_scalar=24,
    bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
)

_PLAIN: dict[str, Any] = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=VOCAB,
    max_position_embeddings=256, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
)
# LGAI-EXAONE/EXAONE-4.0-32B's and -1.2B's config.json RoPE.
EXAONE4_ROPE: dict[str, Any] = {"rope_type": "llama3", "rope_theta": 1_000_000.0, "factor": 16.0,
                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}
# name -> (config class, model class, config kwargs), realistic options on.
POSTNORM_MODELS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, Any]]] = {
    # 6 layers: transformers' default 5:1 pattern (layers 0-4 sliding, layer 5 full); the full
    # layers' RoPE linearly scaled as Gemma 3 4B+ ship it; tied embeddings; final soft-capping on.
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, dict(
        _COMMON, num_hidden_layers=6, final_logit_softcapping=3.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
    )),
    # Sliding and full alternate; both soft-caps on (small, so they matter at this scale).
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(
        _COMMON, num_hidden_layers=4, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
    )),
    # gemma-7b's shape: one KV head per query head, head_dim apart from hidden / heads (heads x head_dim =
    # 1.5 x hidden; 4/3 in the release), FFN 8 x hidden, tied embeddings, RoPE base 1e4, eps 1e-6, 8K positions.
    "gemma": (GemmaConfig, GemmaForCausalLM, dict(
        _PLAIN, num_hidden_layers=4, num_key_value_heads=4, head_dim=24, intermediate_size=512, rms_norm_eps=1e-6,
        max_position_embeddings=8192, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )),
    # Norms after attention and MLP only; q/k norms over the whole projection; Llama-3 RoPE scaling.
    "olmo2": (Olmo2Config, Olmo2ForCausalLM, dict(
        _PLAIN, num_hidden_layers=4, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )),
    # Olmo-3-7B's: OLMo 2's layers, one KV head per query head, a window on three layers in four (transformers'
    # default layer_types), RoPE base 5e5 on both layer types (the base release's; the long-context ones' YaRN on
    # the full-attention layers alone is refused), eps 1e-6, 64K positions, untied.
    "olmo3": (Olmo3Config, Olmo3ForCausalLM, dict(
        _PLAIN, num_hidden_layers=4, num_key_value_heads=4, intermediate_size=172, rms_norm_eps=1e-6,
        sliding_window=WINDOW, max_position_embeddings=65536, tie_word_embeddings=False,
        rope_parameters={kind: {"rope_type": "default", "rope_theta": 500000.0}
                         for kind in ("sliding_attention", "full_attention")},
    )),
    # Every layer MoE (intermediate_size is the experts'), softmax over all experts first
    # (norm_topk_prob false, transformers' default), q/k norms over the whole projection.
    "olmoe": (OlmoeConfig, OlmoeForCausalLM, dict(
        _PLAIN, num_hidden_layers=2, num_key_value_heads=4, intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=False,
    )),
    # EXAONE-4.0-32B's: OLMo 2's layers with q/k norms per head, a window on three layers in four ("LLLG") and no
    # RoPE on the fourth, head_dim given, 5:1 GQA, Llama-3 RoPE scaling, 128K positions, untied.
    "exaone4": (Exaone4Config, Exaone4ForCausalLM, dict(
        _PLAIN, num_hidden_layers=4, num_attention_heads=10, num_key_value_heads=2, head_dim=8, sliding_window=WINDOW,
        sliding_window_pattern="LLLG", layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=131072, tie_word_embeddings=False, rope_parameters=dict(EXAONE4_ROPE),
    )),
    # EXAONE-4.0-1.2B's: no window (every layer full attention, every layer rotated), 4:1 GQA, tied embeddings.
    "exaone4-1.2b": (Exaone4Config, Exaone4ForCausalLM, dict(
        _PLAIN, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=8, sliding_window=None,
        layer_types=["full_attention"] * 4, max_position_embeddings=65536, tie_word_embeddings=True,
        rope_parameters=dict(EXAONE4_ROPE),
    )),
    # Norms around both sublayers, q/k/v biases, interleaved rotary over half of each head.
    "glm4": (Glm4Config, Glm4ForCausalLM, dict(
        _PLAIN, num_hidden_layers=4, head_dim=16, attention_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )),
}
ARCHITECTURES = {"gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma": "GemmaForCausalLM",
                 "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM", "olmoe": "OlmoeForCausalLM",
                 "glm4": "Glm4ForCausalLM", "exaone4": "Exaone4ForCausalLM", "exaone4-1.2b": "Exaone4ForCausalLM"}
MOE = ("olmoe",)
_ZERO_CENTRED = ("Gemma3ForCausalLM", "Gemma2ForCausalLM", "GemmaForCausalLM")
_ACROSS_HEADS = ("Olmo2ForCausalLM", "Olmo3ForCausalLM", "OlmoeForCausalLM")


def build_postnorm_model(name: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A tiny fp32 model (its config kwargs with ``overrides``): every parameter seeded; norm weights near
    zero for Gemma (it stores w of 1 + w), near one for the others; routers well separated."""
    config_class, model_class, kwargs = POSTNORM_MODELS[name]

    def value(param_name: str, noise: torch.Tensor) -> torch.Tensor:
        if "norm" in param_name:
            return 0.1 * noise + (0.0 if name.startswith("gemma") else 1.0)
        return (1.0 if param_name.endswith("mlp.gate.weight") else 0.05) * noise
    return seeded_model(model_class, config_class(**{**kwargs, **overrides}), seed, value)[0]


def save_postnorm_model(name: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """The model, a generation config and a real tokenizer with a chat template, as releases ship."""
    return save_with_side_files(build_postnorm_model(name, seed, **overrides), path)


# --- an independent tensor-parallel forward pass over Megatron rank files ---------------------

Ranks = list[dict[str, torch.Tensor]]


def _replicated(models: Ranks, key: str) -> torch.Tensor:
    for tp_rank, model in enumerate(models[1:], start=1):
        assert torch.equal(model[key], models[0][key]), f"{key}: replica on tp rank {tp_rank} differs"
    return models[0][key]


def _rms(x: torch.Tensor, weight: torch.Tensor, hf: dict[str, Any], mean_square: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm; Gemma's weight is w of 1 + w; ``mean_square`` over a wider span than ``x`` if given."""
    if mean_square is None:
        mean_square = x.pow(2).mean(-1, keepdim=True)
    scale = 1.0 + weight if hf["architectures"][0] in _ZERO_CENTRED else weight
    return x * torch.rsqrt(mean_square + hf["rms_norm_eps"]) * scale


def _norm(models: Ranks, key: str, x: torch.Tensor, hf: dict[str, Any]) -> torch.Tensor:
    """The norm ``key`` if the rank files hold it (pre, post norms), else ``x`` unchanged."""
    return _rms(x, _replicated(models, key), hf) if key in models[0] else x


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency scaling, from its paper's formula."""
    original, factor = params["original_max_position_embeddings"], params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    medium = (wavelength <= original / low) & (wavelength >= original / high)
    return torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def _layer_rope(hf: dict[str, Any], layer: int) -> dict[str, Any]:
    params = hf["rope_parameters"]
    if "full_attention" in params:  # Gemma 3, OLMo 3: one RoPE per layer type
        params = params[hf["layer_types"][layer]]
    return params


def _rotates(hf: dict[str, Any], layer: int) -> bool:
    """Whether ``layer`` rotates q and k: SmolLM3's ``no_rope_layers`` (1: RoPE) where given; EXAONE 4 rotates
    every layer without a window and only the sliding ones with one; the others every layer."""
    if "no_rope_layers" in hf:
        return bool(hf["no_rope_layers"][layer])
    if hf["architectures"][0] == "Exaone4ForCausalLM" and hf.get("sliding_window") is not None:
        return hf["layer_types"][layer] == "sliding_attention"
    return True


def _rope(x: torch.Tensor, params: dict[str, Any], interleaved: bool) -> torch.Tensor:
    """RoPE over the first partial_rotary_factor of ``x`` [batch, heads, seq, d]: rotate-half, or
    (interleaved) pairs (2i, 2i + 1); linear or llama3 frequency scaling."""
    d, seq = x.shape[-1], x.shape[-2]
    rot = int(d * params.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    if params.get("rope_type") == "linear":
        inv_freq = inv_freq / params["factor"]
    elif params.get("rope_type") == "llama3":
        inv_freq = _llama3(inv_freq, params)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if interleaved:
        angles = angles.repeat_interleave(2, dim=-1)
        even, odd = x_rot[..., 0::2], x_rot[..., 1::2]
        turned = torch.stack((-odd, even), dim=-1).flatten(-2)
    else:
        angles = torch.cat([angles, angles], dim=-1)
        first, second = x_rot.chunk(2, dim=-1)
        turned = torch.cat([-second, first], dim=-1)
    return torch.cat([x_rot * angles.cos() + turned * angles.sin(), x_pass], dim=-1)


def _qkv(models: Ranks, prefix: str, h: torch.Tensor, hf: dict[str, Any]) -> list[list[torch.Tensor]]:
    """Each rank's flat q [b, s, its heads * d], k and v [b, s, its groups * d], q/k-normed."""
    heads, groups = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    d = hf.get("head_dim") or hf["hidden_size"] // heads
    per_group, local_groups, (batch, seq, _) = heads // groups, groups // len(models), h.shape
    pieces = []
    for model in models:
        qkv = h @ model[prefix + "self_attention.linear_qkv.weight"].T
        if prefix + "self_attention.linear_qkv.bias" in model:
            qkv = qkv + model[prefix + "self_attention.linear_qkv.bias"]
        qkv = qkv.view(batch, seq, local_groups, per_group + 2, d)
        pieces.append([qkv[..., :per_group, :].reshape(batch, seq, -1), qkv[..., per_group, :].reshape(batch, seq, -1),
                       qkv[..., per_group + 1, :].reshape(batch, seq, -1)])
    for index, name in ((0, "q_layernorm"), (1, "k_layernorm")):
        key = prefix + f"self_attention.{name}.weight"
        if key not in models[0]:
            continue
        weight = _replicated(models, key)
        if hf["architectures"][0] in _ACROSS_HEADS:
            # One RMS over the whole projection: the ranks' sums of squares add up (an all-reduce).
            width = sum(piece[index].shape[-1] for piece in pieces)
            mean_square = sum(piece[index].pow(2).sum(-1, keepdim=True) for piece in pieces) / width
            local = pieces[0][index].shape[-1]
            for rank, piece in enumerate(pieces):
                piece[index] = _rms(piece[index], weight[rank * local:(rank + 1) * local], hf, mean_square)
        else:
            for piece in pieces:
                piece[index] = _rms(piece[index].unflatten(-1, (-1, d)), weight, hf).flatten(-2)
    return pieces


def _attention(models: Ranks, prefix: str, h: torch.Tensor, hf: dict[str, Any], layer: int) -> torch.Tensor:
    """Column-parallel QKV by query group, q/k norms, RoPE, scaled (and capped) scores, window,
    row-parallel output summed over ranks."""
    heads = hf["num_attention_heads"]
    d = hf.get("head_dim") or hf["hidden_size"] // heads
    per_group = heads // (hf.get("num_key_value_heads") or heads)
    seq = h.shape[1]
    positions = torch.arange(seq)
    allowed = positions[None, :] <= positions[:, None]
    if hf.get("layer_types") and hf["layer_types"][layer] == "sliding_attention":
        allowed &= positions[None, :] > positions[:, None] - hf["sliding_window"]
    params, interleaved = _layer_rope(hf, layer), hf["architectures"][0] == "Glm4ForCausalLM"
    scale = hf.get("query_pre_attn_scalar", d) ** -0.5
    out = torch.zeros_like(h)
    for model, (q, k, v) in zip(models, _qkv(models, prefix, h, hf), strict=True):
        q, k, v = (t.unflatten(-1, (-1, d)).transpose(1, 2) for t in (q, k, v))
        if _rotates(hf, layer):
            q, k = _rope(q, params, interleaved), _rope(k, params, interleaved)
        k, v = k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * scale
        if hf.get("attn_logit_softcapping") is not None:
            scores = torch.tanh(scores / hf["attn_logit_softcapping"]) * hf["attn_logit_softcapping"]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        context = (probs @ v).transpose(1, 2).flatten(-2)
        out += context @ model[prefix + "self_attention.linear_proj.weight"].T
    return out


def _gated(models: Ranks, key: str, h: torch.Tensor, weight: torch.Tensor | None, hf: dict[str, Any]) -> torch.Tensor:
    """A TP-split gated MLP: each rank's [gate_r; up_r] rows, its fc2 columns, partial sums added."""
    act = hf.get("hidden_activation") or hf.get("hidden_act")
    out = torch.zeros_like(h)
    for model in models:
        gate, up = (h @ model[key + "linear_fc1.weight"].T).chunk(2, dim=-1)
        gated = (F.gelu(gate, approximate="tanh") if act == "gelu_pytorch_tanh" else F.silu(gate)) * up
        out += gated @ model[key + "linear_fc2.weight"].T
    return out if weight is None else weight * out


def _mlp(models: Ranks, prefix: str, h: torch.Tensor, hf: dict[str, Any]) -> torch.Tensor:
    """Dense, or routed experts: softmax over the replicated router's logits, top k (renormalized
    when norm_topk_prob), each expert a TP-split gated MLP."""
    if prefix + "mlp.router.weight" not in models[0]:
        return _gated(models, prefix + "mlp.", h, None, hf)
    probs = (h @ _replicated(models, prefix + "mlp.router.weight").T).softmax(-1)
    top, chosen = probs.topk(hf["num_experts_per_tok"], dim=-1)
    if hf.get("norm_topk_prob"):
        top = top / top.sum(-1, keepdim=True)
    return sum(_gated(models, f"{prefix}mlp.experts.local_experts.{expert}.", h,
                      (top * (chosen == expert)).sum(-1, keepdim=True), hf)
               for expert in range(probs.shape[-1]))


def _embed(models: Ranks, ids: torch.Tensor, hf: dict[str, Any]) -> torch.Tensor:
    """Vocab-parallel lookup (other ranks add zeros); Gemma multiplies by sqrt(hidden) (an fp32 number)."""
    rows, hidden = models[0]["embedding.word_embeddings.weight"].shape
    assert rows * len(models) > hf["vocab_size"], "the Megatron table should be padded beyond the true vocab"
    x = vocab_parallel_embedding(models, ids)
    if hf["architectures"][0] in _ZERO_CENTRED:
        x = x * torch.tensor(hidden ** 0.5, dtype=torch.float32).double()
    return x


def postnorm_tp_logits(models: Ranks, hf: dict[str, Any], ids: torch.Tensor) -> torch.Tensor:
    """Logits from TP-sharded rank files (float64): pre norms and post norms where the files hold
    them, residual adds after each sublayer, final norm, vocab-parallel logits, final soft-cap."""
    x = _embed(models, ids, hf)
    for layer in range(hf["num_hidden_layers"]):
        p = f"decoder.layers.{layer}."
        attention = _attention(models, p, _norm(models, p + "input_layernorm.weight", x, hf), hf, layer)
        x = x + _norm(models, p + "self_attention.linear_proj.post_layernorm.weight", attention, hf)
        mlp = _mlp(models, p, _norm(models, p + "pre_mlp_layernorm.weight", x, hf), hf)
        x = x + _norm(models, p + "mlp.linear_fc2.post_layernorm.weight", mlp, hf)
    x = _norm(models, "decoder.final_layernorm.weight", x, hf)
    logits = vocab_parallel_logits(models, x, hf["vocab_size"])
    cap = hf.get("final_logit_softcapping")
    return logits if cap is None else torch.tanh(logits / cap) * cap
