"""Test helpers for the families whose decoder layer runs attention and MLP side by side (GPT-NeoX, Cohere,
Cohere2): tiny seeded models as ``save_pretrained`` writes them, and an independent tensor-parallel forward over
Megatron rank files driven by the files' own ``args``.

Nothing here imports pgconvert. The reference forward reads each TP rank's ``model`` dict with ``torch.load``
(hf_helpers.read_megatron_tp_ranks) and the settings from the rank file's ``args`` (normalization and
norm_epsilon, add_bias_linear, rotary_percent, rotary_base and rotary_interleaved, the activation, and the carried
``use_parallel_residual``: ``x + attn(ln1(x)) + mlp(ln2(x))`` where true, else the sequential layer;
``shared_input_layernorm``: ``ln2`` is ``ln1``; ``logit_scale``; the window and NoPE layers), so it checks the args
pgconvert writes as well as the tensors; a norm bias is applied where the files hold one.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from support.family_helpers import rank_qkv, save_with_side_files, seeded_model, tp_swiglu
from support.family_helpers import vocab_parallel_embedding, vocab_parallel_logits
from support.hf_helpers import _replicated
from support.hf_side_helpers import BOS, EOS, PAD
from transformers import PreTrainedModel

Ranks = list[dict[str, torch.Tensor]]
VOCAB = 300  # not a multiple of 128: Megatron pads it


def parallel_block_configs() -> dict[str, tuple[Any, Any, dict[str, Any]]]:
    """name -> (config class, model class, kwargs) in the releases' configuration."""
    import transformers as t

    return {
        # c4ai-command-r-v01's: one norm (LayerNorm without bias) shared by attention and MLP side by side, MHA,
        # SwiGLU, interleaved rotary over the whole head with base 8e6, logits x 0.0625, no biases, tied.
        "cohere": (t.CohereConfig, t.CohereForCausalLM, dict(
            hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, intermediate_size=176,
            vocab_size=VOCAB, max_position_embeddings=131072, layer_norm_eps=1e-5, logit_scale=0.0625,
            rope_parameters={"rope_type": "default", "rope_theta": 8000000.0}, use_qk_norm=False,
            attention_bias=False, tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)),
        # c4ai-command-r7b-12-2024's: Cohere's layer without q/k norms, a window on three layers in four (the
        # release's sliding_window_pattern 4) and RoPE on those alone, 4:1 GQA, head_dim given, base 5e4, logits x 0.25,
        # 128K positions, tied.
        "cohere2": (t.Cohere2Config, t.Cohere2ForCausalLM, dict(
            hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=8,
            intermediate_size=176, vocab_size=VOCAB, max_position_embeddings=132096, layer_norm_eps=1e-5,
            logit_scale=0.25, sliding_window=5, layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, attention_bias=False,
            tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)),
        # pythia-160m / 1.4b's: MHA, head 16 here (64 there) with a quarter of it rotated (rotary_pct 0.25), base
        # 1e4, FFN 4 x hidden, exact GELU, LayerNorm eps 1e-5, biases everywhere, parallel residual, untied
        # embed_out, 2048 positions.
        "gpt_neox": (t.GPTNeoXConfig, t.GPTNeoXForCausalLM, dict(
            hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256, vocab_size=VOCAB,
            max_position_embeddings=2048, layer_norm_eps=1e-5, hidden_act="gelu", attention_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            use_parallel_residual=True, tie_word_embeddings=False, attention_dropout=0.0, hidden_dropout=0.0,
            bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)),
    }


def build_parallel_block_model(name: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A tiny fp32 model: every parameter seeded, norm weights near one."""
    config_class, model_class, kwargs = parallel_block_configs()[name]

    def value(param_name: str, noise: torch.Tensor) -> torch.Tensor:
        is_norm_weight = "norm" in param_name and param_name.endswith("weight")
        return 0.1 * noise + 1.0 if is_norm_weight else 0.1 * noise
    return seeded_model(model_class, config_class(**{**kwargs, **overrides}), seed, value)[0]


def save_parallel_block_model(name: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """The model, a generation config and a real tokenizer with a chat template, as releases ship."""
    return save_with_side_files(build_parallel_block_model(name, seed, **overrides), path)


def input_ids(batch: int = 2, seq: int = 12, seed: int = 7) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    ids[0, -1] = VOCAB - 1
    return ids


# --- an independent tensor-parallel forward pass over Megatron rank files ---------------------

def _norm(models: Ranks, key: str, x: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    """The replicated norm ``key`` (``….weight``, with its bias where the files hold one)."""
    weight = _replicated(models, key + ".weight")
    bias = _replicated(models, key + ".bias") if key + ".bias" in models[0] else None
    if args.normalization == "LayerNorm":
        return F.layer_norm(x, weight.shape, weight, bias, args.norm_epsilon)
    assert bias is None, key
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + args.norm_epsilon)


def _bias(models: Ranks, key: str, args: argparse.Namespace) -> torch.Tensor | float:
    """A row-parallel linear's replicated bias, added once after the ranks' partial sums."""
    return _replicated(models, key) if args.add_bias_linear else 0.0


def _rope(t: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    """RoPE over the first rotary_percent of each head of ``t`` [batch, heads, seq, d]: rotate-half, or with
    args.rotary_interleaved pairs of neighbouring channels (2i, 2i + 1) turned by the same angle."""
    dim, seq = int(args.kv_channels * getattr(args, "rotary_percent", 1.0)), t.shape[-2]
    inv_freq = 1.0 / (args.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    turned, rest = t[..., :dim], t[..., dim:]
    if getattr(args, "rotary_interleaved", False):
        angles = angles.repeat_interleave(2, dim=-1)
        rotated = torch.stack((-turned[..., 1::2], turned[..., 0::2]), dim=-1).flatten(-2)
    else:
        angles = torch.cat([angles, angles], dim=-1)
        first, second = turned.chunk(2, dim=-1)
        rotated = torch.cat([-second, first], dim=-1)
    return torch.cat([turned * angles.cos() + rotated * angles.sin(), rest], dim=-1)


def _mask(seq: int, args: argparse.Namespace, layer: int) -> torch.Tensor:
    """Causal, and on the layers ``args.window_attn_skip_freq`` marks 1 (every layer without it) within
    ``args.window_size`` = (W - 1, 0) positions back."""
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    window, marked = getattr(args, "window_size", None), getattr(args, "window_attn_skip_freq", None)
    if window is not None and (marked is None or marked[layer]):
        positions = torch.arange(seq)
        mask &= positions[None, :] >= positions[:, None] - window[0]
    return mask


def _attention(models: Ranks, prefix: str, h: torch.Tensor, args: argparse.Namespace, layer: int) -> torch.Tensor:
    """Column-parallel QKV by query group (biased where the files hold a bias), RoPE (not on the layers
    ``args.no_rope_freq`` marks 1), causal (windowed) softmax, row-parallel output summed over the ranks, then
    linear_proj's bias."""
    per_group, head_dim = args.num_attention_heads // args.num_query_groups, args.kv_channels
    batch, seq, _ = h.shape
    mask = _mask(seq, args, layer)
    no_rope = getattr(args, "no_rope_freq", None)
    out = torch.zeros_like(h)
    for model in models:
        q, k, v = (t.transpose(1, 2) for t in rank_qkv(model, prefix, h, per_group, head_dim))
        if not (no_rope and no_rope[layer]):
            q, k = _rope(q, args), _rope(k, args)
        k, v = (t.repeat_interleave(per_group, dim=1) for t in (k, v))
        scores = ((q @ k.transpose(-1, -2)) / math.sqrt(head_dim)).masked_fill(~mask, float("-inf")).softmax(-1)
        out += (scores @ v).transpose(1, 2).reshape(batch, seq, -1) @ model[prefix + "self_attention.linear_proj.weight"].T
    return out + _bias(models, prefix + "self_attention.linear_proj.bias", args)


def _activation(args: argparse.Namespace) -> Any:
    """Megatron-LM's non-gated choices as pgconvert's args record them: the exact GELU, or the tanh one."""
    assert not args.swiglu and not getattr(args, "gated_linear_unit", False), "a gated MLP"
    return (lambda x: F.gelu(x, approximate="tanh")) if getattr(args, "openai_gelu", False) else F.gelu


def _mlp(models: Ranks, prefix: str, h: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    """SwiGLU (``args.swiglu``), or column-parallel fc1 (its bias split with it), the activation, row-parallel fc2
    summed, then its bias."""
    if args.swiglu:
        assert not args.add_bias_linear, "a SwiGLU with biases"
        return tp_swiglu(models, prefix + "mlp.", h)
    act, out = _activation(args), torch.zeros_like(h)
    for model in models:
        up = h @ model[prefix + "mlp.linear_fc1.weight"].T
        if args.add_bias_linear:
            up = up + model[prefix + "mlp.linear_fc1.bias"]
        out += act(up) @ model[prefix + "mlp.linear_fc2.weight"].T
    return out + _bias(models, prefix + "mlp.linear_fc2.bias", args)


def parallel_block_logits(models: Ranks, args: argparse.Namespace, ids: torch.Tensor) -> torch.Tensor:
    """Logits (float64) of TP-sharded rank files as ``args`` describe the model: each layer
    ``x + attn(ln1(x)) + mlp(ln2(x))`` where ``args.use_parallel_residual`` (``ln2`` = ``ln1`` where
    ``args.shared_input_layernorm``), else the MLP after the attention's residual add; final norm, vocab-parallel
    logits times ``args.logit_scale``."""
    parallel = getattr(args, "use_parallel_residual", False)
    shared = getattr(args, "shared_input_layernorm", False)
    x = vocab_parallel_embedding(models, ids)
    for layer in range(args.num_layers):
        prefix = f"decoder.layers.{layer}."
        attention_input = _norm(models, prefix + "input_layernorm", x, args)
        attention = _attention(models, prefix, attention_input, args, layer)
        mlp_input = x if parallel else x + attention
        normed = attention_input if shared else _norm(models, prefix + "pre_mlp_layernorm", mlp_input, args)
        x = mlp_input + _mlp(models, prefix, normed, args) + (attention if parallel else 0.0)
    x = _norm(models, "decoder.final_layernorm", x, args)
    return vocab_parallel_logits(models, x, args.vocab_size) * (getattr(args, "logit_scale", None) or 1.0)
