"""Test helpers for the families whose decoder layer runs attention and MLP side by side (GPT-NeoX): tiny
seeded models as ``save_pretrained`` writes them, and an independent tensor-parallel forward over Megatron
rank files driven by the files' own ``args``.

Nothing here imports pgconvert. The reference forward reads each TP rank's ``model`` dict with ``torch.load``
(hf_helpers.read_megatron_tp_ranks) and the settings from the rank file's ``args`` (normalization and
norm_epsilon, add_bias_linear, rotary_percent and rotary_base, the activation, and the carried
``use_parallel_residual``: ``x + attn(ln1(x)) + mlp(ln2(x))`` where true, else the sequential layer), so it
checks the args pgconvert writes as well as the tensors.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from support.family_helpers import save_with_side_files, seeded_model
from support.family_helpers import vocab_parallel_embedding, vocab_parallel_logits
from support.hf_helpers import _replicated
from support.hf_side_helpers import BOS, EOS, PAD
from support.llama_like_helpers import _attention as llama_like_attention
from support.llama_like_helpers import _rope_tables
from transformers import PreTrainedModel

Ranks = list[dict[str, torch.Tensor]]
VOCAB = 300  # not a multiple of 128: Megatron pads it


def parallel_block_configs() -> dict[str, tuple[Any, Any, dict[str, Any]]]:
    """name -> (config class, model class, kwargs) in the releases' configuration."""
    import transformers as t

    return {
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


def _attention(models: Ranks, prefix: str, h: torch.Tensor, args: argparse.Namespace,
               rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The Llama-like reference's causal attention (column-parallel QKV by query group with its bias, rotate-half
    RoPE on the first rotary_percent of each head, row-parallel output summed), then linear_proj's bias."""
    mask = torch.ones(h.shape[1], h.shape[1], dtype=torch.bool).tril()
    out = llama_like_attention(models, prefix, h, args, rope, mask)
    return out + _bias(models, prefix + "self_attention.linear_proj.bias", args)


def _activation(args: argparse.Namespace) -> Any:
    """Megatron-LM's non-gated choices as pgconvert's args record them: the exact GELU, or the tanh one."""
    assert not args.swiglu and not getattr(args, "gated_linear_unit", False), "a gated MLP"
    return (lambda x: F.gelu(x, approximate="tanh")) if getattr(args, "openai_gelu", False) else F.gelu


def _mlp(models: Ranks, prefix: str, h: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    """Column-parallel fc1 (its bias split with it), the activation, row-parallel fc2 summed, then its bias."""
    act, out = _activation(args), torch.zeros_like(h)
    for model in models:
        up = h @ model[prefix + "mlp.linear_fc1.weight"].T
        if args.add_bias_linear:
            up = up + model[prefix + "mlp.linear_fc1.bias"]
        out += act(up) @ model[prefix + "mlp.linear_fc2.weight"].T
    return out + _bias(models, prefix + "mlp.linear_fc2.bias", args)


def parallel_block_logits(models: Ranks, args: argparse.Namespace, ids: torch.Tensor) -> torch.Tensor:
    """Logits (float64) of TP-sharded rank files as ``args`` describe the model: each layer
    ``x + attn(ln1(x)) + mlp(ln2(x))`` where ``args.use_parallel_residual``, else the MLP after the attention's
    residual add; final norm and vocab-parallel logits."""
    rope = _rope_tables(args, ids.shape[1])
    parallel = getattr(args, "use_parallel_residual", False)
    x = vocab_parallel_embedding(models, ids)
    for layer in range(args.num_layers):
        prefix = f"decoder.layers.{layer}."
        attention = _attention(models, prefix, _norm(models, prefix + "input_layernorm", x, args), args, rope)
        mlp_input = x if parallel else x + attention
        mlp = _mlp(models, prefix, _norm(models, prefix + "pre_mlp_layernorm", mlp_input, args), args)
        x = mlp_input + mlp + (attention if parallel else 0.0)
    x = _norm(models, "decoder.final_layernorm", x, args)
    return vocab_parallel_logits(models, x, args.vocab_size)
