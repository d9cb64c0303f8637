"""Test-only helpers for the hf format: tiny transformers models and an independent TP forward pass.

Nothing here imports pgconvert: the reference forward pass reads Megatron rank files with plain
``torch.load`` and computes logits the way tensor-parallel ranks would, so a wrong QKV grouping or
gate/up order in the library cannot cancel itself out.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from support.family_helpers import (rank_qkv, routed_experts, seeded_model, tp_swiglu, vocab_parallel_embedding,
                                    vocab_parallel_logits)
from safetensors.torch import load_file, save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
)

# name -> (config class, model class, config kwargs). Vocab sizes are not multiples of 128, so
# Megatron pads them; kv heads = 4 so TP 1, 2 and 4 all fall on query-group boundaries.
FAMILY_MODELS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, Any]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(
        _COMMON, intermediate_size=128, vocab_size=1000, rope_theta=50000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )),
    "llama_bias": (LlamaConfig, LlamaForCausalLM, dict(
        _COMMON, intermediate_size=96, vocab_size=1030, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False,
    )),
    "mistral": (MistralConfig, MistralForCausalLM, dict(
        _COMMON, intermediate_size=96, vocab_size=1030, rope_theta=20000.0, tie_word_embeddings=True,
    )),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(
        _COMMON, intermediate_size=128, vocab_size=1030, tie_word_embeddings=True,
    )),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(
        _COMMON, intermediate_size=128, vocab_size=1000, head_dim=16, tie_word_embeddings=False,
    )),
    # Every layer MoE; intermediate_size is the experts' FFN.
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(
        _COMMON, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, vocab_size=1000,
        tie_word_embeddings=False,
    )),
    # Layer 1 dense (mlp_only_layers), layers 0, 2, 3 MoE; norm_topk_prob as megatron-core's router.
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(
        _COMMON, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[1], norm_topk_prob=True, head_dim=16, vocab_size=1030, tie_word_embeddings=False,
    )),
}
MOE_FAMILIES: tuple[str, ...] = ("mixtral", "qwen3_moe")
# What a Megatron checkpoint made from each comes back as: its own architecture, from the
# config.json the checkpoint carries in hf/ (pgconvert.formats.hf_side), and without it from args:
# Mistral's sliding window (4096 by default) is carried in args.window_size.
ARCHITECTURE_AFTER_MEGATRON: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "llama_bias": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# Router weights: transformers' MoE routers are Linear modules named "gate" of the MoE block.
ROUTER_PARAMETERS = re.compile(r"model\.layers\.\d+\.(block_sparse_moe|mlp)\.gate\.weight")
TOKENIZER_CONTENT: dict[str, str] = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}\n',
    "tokenizer_config.json": '{"model_max_length": 256}\n',
    "special_tokens_map.json": '{"bos_token": "<s>"}\n',
}


def build_hf_model(name: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A tiny fp32 model of family ``name``: every parameter seeded, norms near one (not all ones)."""
    config_class, model_class, kwargs = FAMILY_MODELS[name]
    def value(param_name: str, noise: torch.Tensor) -> torch.Tensor:
        if param_name.rsplit(".", 1)[0].endswith("norm") and param_name.endswith("weight"):
            return 1.0 + 0.1 * noise
        # Well-separated router logits: fp32 and fp64 forward passes pick the same experts.
        return noise if ROUTER_PARAMETERS.fullmatch(param_name) else 0.05 * noise
    return seeded_model(model_class, config_class(**{**kwargs, **overrides}), seed, value)[0]


def save_hf_model(model: PreTrainedModel, path: Path, max_shard_size: str = "100KB",
                  tokenizer: bool = True) -> Path:
    model.save_pretrained(path, max_shard_size=max_shard_size)
    if tokenizer:
        for file_name, content in TOKENIZER_CONTENT.items():
            (path / file_name).write_text(content)
    return path


def load_hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory (whole-model read; test sizes only)."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        loaded = load_file(str(shard))
        assert not set(loaded) & set(tensors), f"{shard}: tensors stored twice"
        tensors.update(loaded)
    return tensors


def rewrite_as_single_file(path: Path, change: Callable[[dict[str, torch.Tensor]], object]) -> None:
    """Replace the weights of ``path`` by one ``model.safetensors`` holding ``change``d tensors."""
    tensors = load_hf_tensors(path)
    change(tensors)
    for shard in path.glob("*.safetensors"):
        shard.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def edit_json(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc, indent=2))


def hf_logits(path_or_model: Path | PreTrainedModel, input_ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    if isinstance(path_or_model, Path):
        model, info = AutoModelForCausalLM.from_pretrained(path_or_model, dtype=torch.float32,
                                                           output_loading_info=True)
        assert not any(info.get(key) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    else:
        model = path_or_model
    model.eval()
    with torch.no_grad():
        return model(input_ids).logits


def input_ids(vocab_size: int, batch: int = 2, seq: int = 12, seed: int = 7) -> torch.Tensor:
    ids = torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    ids[0, -1] = vocab_size - 1  # the last real row sits next to the padding
    return ids


# --- an independent tensor-parallel forward pass over Megatron rank files ---------------------

def _load_rank(path: Path) -> dict[str, Any]:
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)


# Expert keys inside a rank file, with the rank-local expert index: SequentialMLP's and TEGroupedMLP's.
_SEQUENTIAL_EXPERT = re.compile(r"(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(.+)")
_GROUPED_EXPERT = re.compile(r"(decoder\.layers\.\d+\.mlp\.experts\.)(linear_fc[12])\.weight(\d+)")


def _global_expert_key(key: str, ep_rank: int, experts_per_rank: int) -> str | None:
    """``…local_experts.{global}.rest`` for an expert key of EP rank ``ep_rank``; None for other keys."""
    sequential = _SEQUENTIAL_EXPERT.fullmatch(key)
    if sequential:
        prefix, local, rest = sequential.groups()
    else:
        grouped = _GROUPED_EXPERT.fullmatch(key)
        if not grouped:
            return None
        prefix, module, local = grouped.groups()
        rest = f"{module}.weight"
    return f"{prefix}local_experts.{ep_rank * experts_per_rank + int(local)}.{rest}"


def read_megatron_tp_ranks(root: Path) -> list[dict[str, torch.Tensor]]:
    """The ``model`` dicts of a PP=1 Megatron checkpoint, by TP rank, float64.

    With expert parallelism the EP ranks of one TP rank are joined into one dict: every non-expert
    tensor must be the same on all of them, and expert keys get the global index (EP rank r holds
    experts [r·E/ep, (r+1)·E/ep)), in SequentialMLP naming whatever the file used.
    """
    iteration = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    iteration_dir = root / ("release" if iteration == "release" else f"iter_{int(iteration):07d}")
    rank_dirs = sorted(iteration_dir.glob("mp_rank_*"))
    args = _load_rank(rank_dirs[0] / "model_optim_rng.pt")["args"]
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    assert pp == 1, f"{root}: pp={pp}; the reference forward pass reads PP=1 checkpoints"
    experts_per_rank = (getattr(args, "num_experts", None) or 0) // ep
    expected_dirs = [f"mp_rank_{t:02d}" + (f"_{e:03d}" if ep > 1 else "") for t in range(tp) for e in range(ep)]
    assert [d.name for d in rank_dirs] == sorted(expected_dirs), iteration_dir
    models = []
    for tp_rank in range(tp):
        joined: dict[str, torch.Tensor] = {}
        for ep_rank in range(ep):
            rank_dir = iteration_dir / (f"mp_rank_{tp_rank:02d}" + (f"_{ep_rank:03d}" if ep > 1 else ""))
            state = _load_rank(rank_dir / "model_optim_rng.pt")
            # TE's _extra_state entries are not weights.
            for key, value in state["model"].items():
                if not isinstance(value, torch.Tensor) or key.endswith("._extra_state"):
                    continue
                expert_key = _global_expert_key(key, ep_rank, experts_per_rank)
                name = expert_key if expert_key is not None else key
                if expert_key is None and name in joined:
                    assert torch.equal(joined[name], value.to(torch.float64)), f"{key}: differs between EP ranks"
                else:
                    assert name not in joined, f"{rank_dir}: {key} is {name}, already read"
                joined[name] = value.to(torch.float64)
        models.append(joined)
    return models


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _replicated(models: list[dict[str, torch.Tensor]], key: str) -> torch.Tensor:
    first = models[0][key]
    for tp_rank, model in enumerate(models[1:], start=1):
        assert torch.equal(model[key], first), f"{key}: replica on tp rank {tp_rank} differs"
    return first


# megatron-core's Transformer-Engine spec fuses the two per-layer norms into the next linear.
_TE_NORM_NAMES: dict[str, str] = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def _layer_norm_weight(models: list[dict[str, torch.Tensor]], prefix: str, local_name: str) -> torch.Tensor:
    key = prefix + local_name
    return _replicated(models, key if key in models[0] else prefix + _TE_NORM_NAMES[local_name])


def _moe_mlp(models: list[dict[str, torch.Tensor]], prefix: str, h: torch.Tensor,
             hf_config: dict[str, Any]) -> torch.Tensor:
    """A routed-experts MLP over TP ranks: softmax over the replicated router's logits, the top k
    (renormalized unless norm_topk_prob is false), each expert TP-split like a dense SwiGLU MLP; a shared expert
    (Qwen2-MoE's) added, scaled by its sigmoid gate."""
    experts = hf_config.get("num_local_experts") or hf_config["num_experts"]
    router = _replicated(models, prefix + "mlp.router.weight")
    assert router.shape[0] == experts, f"{prefix}mlp.router.weight: {router.shape[0]} rows, {experts} experts"
    probs = (h @ router.T).softmax(dim=-1)
    top, chosen = probs.topk(hf_config["num_experts_per_tok"], dim=-1)
    if hf_config.get("norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    routed = routed_experts(models, prefix, h, top, chosen, experts)
    if prefix + "mlp.shared_experts.linear_fc1.weight" not in models[0]:
        return routed
    gate = torch.sigmoid(h @ _replicated(models, prefix + "mlp.shared_experts.gate_weight").T)
    return routed + gate * tp_swiglu(models, prefix + "mlp.shared_experts.", h)


def megatron_tp_logits(models: list[dict[str, torch.Tensor]], hf_config: dict[str, Any],
                       ids: torch.Tensor) -> torch.Tensor:
    """Logits computed rank by rank from TP-sharded tensors, all-reduces done as sums (float64)."""
    tp = len(models)
    hidden = hf_config["hidden_size"]
    heads = hf_config["num_attention_heads"]
    groups = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hidden // heads
    eps = hf_config["rms_norm_eps"]
    theta = hf_config["rope_parameters"]["rope_theta"]
    vocab = hf_config["vocab_size"]
    qk_norm = hf_config["architectures"][0] in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    per_group = heads // groups
    batch, seq = ids.shape

    # Vocab-parallel embedding: rank r holds rows [r*rows, (r+1)*rows) of the padded table; the
    # other ranks contribute zeros and the all-reduce sums them.
    rows = models[0]["embedding.word_embeddings.weight"].shape[0]
    assert rows * tp > vocab, "the Megatron table should be padded beyond the true vocab"
    x = vocab_parallel_embedding(models, ids)

    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()

    for layer in range(hf_config["num_hidden_layers"]):
        prefix = f"decoder.layers.{layer}."
        h = _rms_norm(x, _layer_norm_weight(models, prefix, "input_layernorm.weight"), eps)
        attention = torch.zeros_like(x)
        for model in models:
            q, k, v = rank_qkv(model, prefix, h, per_group, head_dim)
            if qk_norm:
                q = _rms_norm(q, _replicated(models, prefix + "self_attention.q_layernorm.weight"), eps)
                k = _rms_norm(k, _replicated(models, prefix + "self_attention.k_layernorm.weight"), eps)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k = k.repeat_interleave(per_group, dim=1)
            v = v.repeat_interleave(per_group, dim=1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(head_dim)
            scores = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            context = (scores @ v).transpose(1, 2).reshape(batch, seq, -1)
            # Row-parallel linear_proj: partial products, summed by the all-reduce.
            attention += context @ model[prefix + "self_attention.linear_proj.weight"].T
        if prefix + "self_attention.linear_proj.bias" in models[0]:
            attention += _replicated(models, prefix + "self_attention.linear_proj.bias")
        x = x + attention

        h = _rms_norm(x, _layer_norm_weight(models, prefix, "pre_mlp_layernorm.weight"), eps)
        if prefix + "mlp.router.weight" in models[0]:
            x = x + _moe_mlp(models, prefix, h, hf_config)
            continue
        mlp = torch.zeros_like(x)
        for model in models:
            fc1 = h @ model[prefix + "mlp.linear_fc1.weight"].T
            if prefix + "mlp.linear_fc1.bias" in model:
                fc1 = fc1 + model[prefix + "mlp.linear_fc1.bias"]
            gate, up = fc1.chunk(2, dim=-1)  # this rank's [gate_r; up_r]
            mlp += (torch.nn.functional.silu(gate) * up) @ model[prefix + "mlp.linear_fc2.weight"].T
        if prefix + "mlp.linear_fc2.bias" in models[0]:
            mlp += _replicated(models, prefix + "mlp.linear_fc2.bias")
        x = x + mlp

    x = _rms_norm(x, _replicated(models, "decoder.final_layernorm.weight"), eps)
    return vocab_parallel_logits(models, x, vocab)


def assert_same_hf_tensors(expected_dir: Path, actual_dir: Path) -> None:
    """The same tensor names in both HF directories, each with the same dtype and ``torch.equal``."""
    expected, actual = load_hf_tensors(expected_dir), load_hf_tensors(actual_dir)
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name
