"""What the HF family test helpers share (hf_helpers, llama_like_helpers, glm4_moe_gpt_oss_helpers, postnorm_helpers).

* a tiny transformers model seeded the same way for every family (each family says what a
  parameter's value is made of its noise), and saved as a release with its side files;
* the tensor-parallel building blocks of the independent reference forwards over Megatron rank
  files: the vocab-parallel embedding and a column/row-parallel SwiGLU MLP.

Nothing here imports pgconvert.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from support.hf_side_helpers import BOS, EOS, PAD, build_tokenizer
from transformers import GenerationConfig, PreTrainedModel

Ranks = list[dict[str, torch.Tensor]]


def seeded_model(model_class: Any, config: Any, seed: int,
                 value: Callable[[str, torch.Tensor], torch.Tensor]) -> tuple[PreTrainedModel, torch.Generator]:
    """``model_class(config)`` in fp32 eval mode, every parameter (in name order) set to
    ``value(name, noise)`` with standard-normal noise from a generator seeded ``1000 + seed``; the
    generator is returned for anything else the family seeds after the parameters."""
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            param.copy_(value(name, torch.randn(param.shape, generator=generator)))
    return model, generator


def save_with_side_files(model: PreTrainedModel, path: Path, max_shard_size: str = "100KB") -> Path:
    """save_pretrained in small shards, with a generation config, a tokenizer and a chat template."""
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=[EOS, PAD], pad_token_id=PAD,
                                               do_sample=True, temperature=0.6, top_p=0.9, max_new_tokens=32)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    build_tokenizer().save_pretrained(path)
    return path


def vocab_parallel_embedding(models: Ranks, ids: torch.Tensor) -> torch.Tensor:
    """Rank r holds rows ``[r*rows, (r+1)*rows)`` of the padded table; the other ranks contribute
    zeros and the all-reduce sums them (float64)."""
    rows, hidden = models[0]["embedding.word_embeddings.weight"].shape
    x = torch.zeros(*ids.shape, hidden, dtype=torch.float64)
    for tp_rank, model in enumerate(models):
        local = ids - tp_rank * rows
        inside = (local >= 0) & (local < rows)
        found = model["embedding.word_embeddings.weight"][local.clamp(0, rows - 1)]
        x += torch.where(inside[..., None], found, torch.zeros_like(found))
    return x


def tp_swiglu(models: Ranks, key: str, h: torch.Tensor) -> torch.Tensor:
    """A column/row-parallel SwiGLU MLP under ``key`` (``….mlp.``, ``….shared_experts.``, an expert):
    each rank's ``linear_fc1`` is its ``[gate_r; up_r]``, the row-parallel outputs are summed."""
    out = torch.zeros_like(h)
    for model in models:
        gate, up = (h @ model[key + "linear_fc1.weight"].T).chunk(2, dim=-1)
        out += (F.silu(gate) * up) @ model[key + "linear_fc2.weight"].T
    return out


def rank_qkv(model: dict[str, torch.Tensor], prefix: str, h: torch.Tensor, per_group: int,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank's column-parallel fused QKV, bias included: its query groups, each ``[its q heads,
    its k head, its v head]``, as q ``[batch, seq, q heads, head_dim]`` and k, v ``[batch, seq, groups, head_dim]``."""
    batch, seq, _ = h.shape
    qkv = h @ model[prefix + "self_attention.linear_qkv.weight"].T
    if prefix + "self_attention.linear_qkv.bias" in model:
        qkv = qkv + model[prefix + "self_attention.linear_qkv.bias"]
    qkv = qkv.view(batch, seq, -1, per_group + 2, head_dim)
    q = qkv[..., :per_group, :].reshape(batch, seq, -1, head_dim)
    return q, qkv[..., per_group, :], qkv[..., per_group + 1, :]


def routed_experts(models: Ranks, prefix: str, h: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                   experts: int, mlp: Callable[[Ranks, str, torch.Tensor], torch.Tensor] = tp_swiglu) -> torch.Tensor:
    """The routed experts' sum: each token's weight for an expert (zero where it was not among
    ``chosen``) times that expert's TP-split ``mlp`` (``….mlp.experts.local_experts.{e}.``)."""
    out = torch.zeros_like(h)
    for expert in range(experts):
        weight = (weights * (chosen == expert)).sum(dim=-1, keepdim=True)
        out += weight * mlp(models, f"{prefix}mlp.experts.local_experts.{expert}.", h)
    return out


def vocab_parallel_logits(models: Ranks, x: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each rank's vocab rows of the output layer (or of the tied embedding) applied to ``x``,
    gathered over the vocab and cut to the true ``vocab``."""
    key = "output_layer.weight" if "output_layer.weight" in models[0] else "embedding.word_embeddings.weight"
    return torch.cat([x @ model[key].T for model in models], dim=-1)[..., :vocab]
