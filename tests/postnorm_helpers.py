"""Test-only helpers for the post-sublayer-norm families (Gemma 3, Gemma 2): tiny seeded models as
``save_pretrained`` writes them, and an independent forward pass over Megatron TP rank files.

Nothing here imports pgconvert. The reference forward reads rank files with plain ``torch.load``
(``hf_helpers.read_megatron_tp_ranks``) and the settings from the HF config.json, and computes what
the architecture computes, rank by rank (column-parallel pieces, row-parallel partial sums added
as an all-reduce would, vocab-parallel embedding and logits), so a misplaced norm, a wrong q/k
group, a lost window or soft-cap shows up whatever pgconvert's merge would do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hf_side_helpers import BOS, EOS, PAD, build_tokenizer
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
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
}
ARCHITECTURES = {"gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}


def build_postnorm_model(name: str, seed: int = 0) -> PreTrainedModel:
    """A tiny fp32 model: every parameter seeded; norm weights near zero (Gemma stores w of 1 + w)."""
    config_class, model_class, kwargs = POSTNORM_MODELS[name]
    torch.manual_seed(seed)
    model = model_class(config_class(**kwargs)).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for param_name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            param.copy_((0.1 if "norm" in param_name else 0.05) * noise)
    return model


def save_postnorm_model(name: str, path: Path, seed: int = 0) -> Path:
    """The model, a generation config and a real tokenizer with a chat template, as releases ship."""
    model = build_postnorm_model(name, seed)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=[EOS, PAD], pad_token_id=PAD,
                                               do_sample=True, temperature=0.6, top_p=0.9, max_new_tokens=32)
    model.save_pretrained(path, max_shard_size="100KB")
    build_tokenizer().save_pretrained(path)
    return path


# --- an independent tensor-parallel forward pass over Megatron rank files ---------------------

def _zero_centred_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def _replicated(models: list[dict[str, torch.Tensor]], key: str) -> torch.Tensor:
    for tp_rank, model in enumerate(models[1:], start=1):
        assert torch.equal(model[key], models[0][key]), f"{key}: replica on tp rank {tp_rank} differs"
    return models[0][key]


def _norm(models: list[dict[str, torch.Tensor]], key: str, x: torch.Tensor, eps: float) -> torch.Tensor:
    return _zero_centred_rms(x, _replicated(models, key), eps)


def _rope(x: torch.Tensor, theta: float, factor: float) -> torch.Tensor:
    """Rotate-half RoPE over ``x`` [batch, heads, seq, d]; ``factor`` divides the frequencies (linear)."""
    d, seq = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)) / factor
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    first, second = x.chunk(2, dim=-1)
    return x * angles.cos() + torch.cat([-second, first], dim=-1) * angles.sin()


def _layer_rope(hf: dict[str, Any], sliding: bool) -> tuple[float, float]:
    params = hf["rope_parameters"]
    if "full_attention" in params:  # Gemma 3: one RoPE per layer type
        params = params["sliding_attention" if sliding else "full_attention"]
    return params["rope_theta"], params.get("factor", 1.0) if params.get("rope_type") == "linear" else 1.0


def _attention(models: list[dict[str, torch.Tensor]], prefix: str, h: torch.Tensor, hf: dict[str, Any],
               layer: int) -> torch.Tensor:
    """Column-parallel QKV by query group, per-head q/k norms, RoPE, scaled and capped scores,
    window, row-parallel output summed over ranks."""
    tp, (batch, seq, _) = len(models), h.shape
    heads, groups, d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    per_group, local_groups = heads // groups, groups // tp
    sliding = hf["layer_types"][layer] == "sliding_attention"
    theta, factor = _layer_rope(hf, sliding)
    positions = torch.arange(seq)
    allowed = positions[None, :] <= positions[:, None]
    if sliding:
        allowed &= positions[None, :] > positions[:, None] - hf["sliding_window"]
    out = torch.zeros_like(h)
    for model in models:
        qkv = (h @ model[prefix + "self_attention.linear_qkv.weight"].T).view(batch, seq, local_groups, per_group + 2, d)
        q = qkv[..., :per_group, :].reshape(batch, seq, local_groups * per_group, d)
        k, v = qkv[..., per_group, :], qkv[..., per_group + 1, :]
        if prefix + "self_attention.q_layernorm.weight" in model:
            q = _norm(models, prefix + "self_attention.q_layernorm.weight", q, hf["rms_norm_eps"])
            k = _norm(models, prefix + "self_attention.k_layernorm.weight", k, hf["rms_norm_eps"])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = _rope(q, theta, factor), _rope(k, theta, factor)
        k, v = k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)
        scores = (q @ k.transpose(-1, -2)) * hf["query_pre_attn_scalar"] ** -0.5
        if hf.get("attn_logit_softcapping") is not None:
            scores = torch.tanh(scores / hf["attn_logit_softcapping"]) * hf["attn_logit_softcapping"]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        context = (probs @ v).transpose(1, 2).reshape(batch, seq, -1)
        out += context @ model[prefix + "self_attention.linear_proj.weight"].T
    return out


def _mlp(models: list[dict[str, torch.Tensor]], prefix: str, h: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(h)
    for model in models:
        gate, up = (h @ model[prefix + "mlp.linear_fc1.weight"].T).chunk(2, dim=-1)  # this rank's [gate_r; up_r]
        out += (F.gelu(gate, approximate="tanh") * up) @ model[prefix + "mlp.linear_fc2.weight"].T
    return out


def _embed(models: list[dict[str, torch.Tensor]], ids: torch.Tensor, hidden: int) -> torch.Tensor:
    """Vocab-parallel lookup (other ranks add zeros), times sqrt(hidden) as Gemma scales it."""
    rows = models[0]["embedding.word_embeddings.weight"].shape[0]
    x = torch.zeros(*ids.shape, hidden, dtype=torch.float64)
    for tp_rank, model in enumerate(models):
        local = ids - tp_rank * rows
        inside = (local >= 0) & (local < rows)
        found = model["embedding.word_embeddings.weight"][local.clamp(0, rows - 1)]
        x += torch.where(inside[..., None], found, torch.zeros_like(found))
    return x * torch.tensor(hidden ** 0.5, dtype=torch.float32).double()


def postnorm_tp_logits(models: list[dict[str, torch.Tensor]], hf: dict[str, Any], ids: torch.Tensor) -> torch.Tensor:
    """Logits of a sandwich-norm decoder (Gemma 2/3) from TP-sharded rank files, float64."""
    eps = hf["rms_norm_eps"]
    x = _embed(models, ids, hf["hidden_size"])
    assert models[0]["embedding.word_embeddings.weight"].shape[0] * len(models) > hf["vocab_size"], "not padded"
    for layer in range(hf["num_hidden_layers"]):
        p = f"decoder.layers.{layer}."
        attention = _attention(models, p, _norm(models, p + "input_layernorm.weight", x, eps), hf, layer)
        x = x + _norm(models, p + "self_attention.linear_proj.post_layernorm.weight", attention, eps)
        mlp = _mlp(models, p, _norm(models, p + "pre_mlp_layernorm.weight", x, eps))
        x = x + _norm(models, p + "mlp.linear_fc2.post_layernorm.weight", mlp, eps)
    x = _norm(models, "decoder.final_layernorm.weight", x, eps)
    output = "output_layer.weight" if "output_layer.weight" in models[0] else "embedding.word_embeddings.weight"
    logits = torch.cat([x @ model[output].T for model in models], dim=-1)[..., : hf["vocab_size"]]
    cap = hf.get("final_logit_softcapping")
    return logits if cap is None else torch.tanh(logits / cap) * cap

