"""Test-only: megatron-core 0.16.1's GPTModel with DeepSeek Sparse Attention (DSAttention, DSAIndexer) and MoE,
built from a written TP1/PP1/EP1 rank file's args and run on CPU.

megatron-core 0.16.1 cannot build a sparse attention GPT model as Megatron-LM would: its
``get_experimental_attention_variant_module_spec`` raises for ``'dsa'``, its ``get_dsa_module_spec_for_backend``
fuses the q latent norm into ``linear_q_up_proj`` (the indexer then takes the q latent before the norm) and builds
the indexer's linears with ``backend.linear()``, which only Transformer Engine's provider has (TELinear, CUDA).
core_v0.19.0 (Megatron-LM b0eb9143, d98e8a64) builds it from AbsorbedMLASelfAttention with the latent norms kept
apart, whose state dict is MLASelfAttention's. The model here is megatron-core's MLA local decoder block spec
(``support.megatron_mla``) with megatron-core's own DSAttention and DSAIndexer as the core attention, and
``experimental_attention_variant='dsa'`` in its config (MLASelfAttention then hands the indexer the hidden states
and the normalized q latent). Stand-ins, each for what needs Transformer Engine or CUDA or changed after 0.16.1:

- ``DuplicatedLinear``: TELinear ``parallel_mode='duplicated'`` (``weight`` whole on every rank, ``x W^T``), with an
  ``_extra_state`` as megatron-core's local linears hold it (None, defaulted when a state dict has none);
- ``IndexerKeyNorm``: TENorm as a LayerNorm (``weight``, ``bias``) with core_v0.19.0's epsilon
  (``dsa_indexer_k_norm_epsilon``, else the one DSAIndexer passes, the norm epsilon);
- ``DSAIndexer._apply_rope``: core_v0.19.0's (the first ``qk_pos_emb_head_dim`` dims of each head rotated,
  rotate-half or, with ``dsa_indexer_rope_interleaved``, as interleaved pairs; the rest left; 0.16.1 rotated the
  last ones, always interleaved: the bug b0eb9143 fixed);
- ``dsa.rotate_activation``: the identity. Its Hadamard rotation (fast_hadamard_transform, CUDA, bf16 only) is
  orthogonal, so it leaves every q.k product, and so the index scores, as they are (transformers skips it too).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from megatron.core.transformer.experimental_attention_variant import dsa
from megatron.core.transformer.spec_utils import ModuleSpec

import support.mcore_helpers as mcore
from support.megatron_mla import build_mla_gpt_model, mla_cpu_patches

DSA_FIELDS = ("experimental_attention_variant", "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk",
              "dsa_indexer_rope_interleaved", "dsa_indexer_k_norm_epsilon")


class DuplicatedLinear(torch.nn.Module):
    """TELinear(parallel_mode='duplicated'): the whole weight on every rank, ``x W^T``, no bias."""

    def __init__(self, input_size: int, output_size: int, *, config: Any, parallel_mode: str | None = None,
                 bias: bool = False, **kwargs: Any) -> None:
        super().__init__()
        assert parallel_mode == "duplicated" and not bias
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        self._register_load_state_dict_pre_hook(
            lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(f"{prefix}_extra_state"))

    def get_extra_state(self) -> None:
        return None

    def set_extra_state(self, state: Any) -> None:
        pass

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.weight), None


class IndexerKeyNorm(torch.nn.LayerNorm):
    """TENorm with ``normalization='LayerNorm'`` (DSAIndexer's k_norm): weight and bias."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5) -> None:
        assert config.normalization == "LayerNorm"
        super().__init__(hidden_size, eps=getattr(config, "dsa_indexer_k_norm_epsilon", None) or eps,
                         dtype=config.params_dtype)


def _apply_rope_first_dims(self: Any, x: torch.Tensor, rotary_pos_emb: torch.Tensor, mscale: float) -> torch.Tensor:
    """core_v0.19.0's DSAIndexer._apply_rope (``mla_rotary_interleaved=dsa_indexer_rope_interleaved``, unfused)."""
    x_pe, x_nope = torch.split(x, [self.qk_pos_emb_head_dim, self.index_head_dim - self.qk_pos_emb_head_dim], dim=-1)
    x_pe = _apply_rotary_pos_emb_bshd(x_pe, rotary_pos_emb, rotary_interleaved=False,
                                      multi_latent_attention=self.config.dsa_indexer_rope_interleaved, mscale=mscale)
    return torch.cat([x_pe, x_nope], dim=-1)


@contextlib.contextmanager
def dsa_cpu_patches() -> Iterator[None]:
    saved = (dsa.rotate_activation, dsa.DSAIndexer._apply_rope)
    dsa.rotate_activation = lambda x: x
    dsa.DSAIndexer._apply_rope = _apply_rope_first_dims
    try:
        with mla_cpu_patches():
            yield
    finally:
        dsa.rotate_activation, dsa.DSAIndexer._apply_rope = saved


def build_dsa_gpt_model(args: argparse.Namespace) -> Any:
    """The TP1/PP1/EP1 GPTModel of ``args`` (sparse attention in every layer); call under ``dsa_cpu_patches``."""
    indexer = ModuleSpec(module=dsa.DSAIndexer, submodules=dsa.DSAIndexerSubmodules(
        linear_wq_b=DuplicatedLinear, linear_wk=DuplicatedLinear, k_norm=IndexerKeyNorm,
        linear_weights_proj=DuplicatedLinear))
    core_attention = ModuleSpec(module=dsa.DSAttention, submodules=dsa.DSAttentionSubmodules(indexer=indexer))
    # core_v0.19.0's fields that 0.16.1's config lacks are set on it as well.
    model = build_mla_gpt_model(args, core_attention, DSA_FIELDS)
    # 0.16.1's DSAttention and DSAIndexer keep no tp_group, so MegatronModule.sharded_state_dict asks parallel_state
    # for the one a run initializes: here the model's own.
    for module in model.modules():
        if isinstance(module, (dsa.DSAttention, dsa.DSAIndexer)):
            module.tp_group = (module.indexer if isinstance(module, dsa.DSAttention) else module).pg_collection.tp
    return model


def dsa_logits(root: Any, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """megatron-core's logits of the TP1/PP1/EP1 checkpoint at ``root`` (loaded with ``strict=True``)."""
    (rank,) = mcore.rank_files(root)
    with torch.no_grad(), dsa_cpu_patches():
        model = build_dsa_gpt_model(rank.args)
        model.load_state_dict(dict(rank.model), strict=True)
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        out = model(input_ids=tokens, position_ids=positions,
                    attention_mask=mcore.causal_attention_mask(tokens.shape[1]))
    return out[..., :vocab]
