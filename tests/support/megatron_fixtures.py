"""Test-only helpers: tiny Megatron-LM legacy (per-rank ``torch.save``) checkpoints.

Everything here is written out explicitly per tensor kind, on purpose: the
slicing in :func:`write_megatron_checkpoint` and the reassembly in
:func:`merge_megatron_checkpoint` must not share code with the production
sharding rules, so that a bug there cannot cancel itself out in a test.

Besides dense GPT models, the fixtures cover mixture-of-experts layers
(router, routed experts in SequentialMLP or grouped-GEMM naming, shared
experts), expert parallelism (``ep``) and virtual pipelines (``vpp``).

Nothing in this module imports from ``pgconvert``, ``loaders`` or ``savers``.
"""

from __future__ import annotations

import argparse
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

CHECKPOINT_FILE = "model_optim_rng.pt"
TRACKER_FILE = "latest_checkpointed_iteration.txt"

_NORMALIZATIONS = ("RMSNorm", "LayerNorm")
_POSITION_EMBEDDINGS = ("rope", "learned_absolute")
_TRANSFORMER_IMPLS = ("local", "transformer_engine")

# local layer-relative name -> transformer_engine layer-relative name
_TE_RENAMES: dict[str, str] = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
# MoE layers: only the input norm is fused (into linear_qkv); pre_mlp_layernorm keeps its name.
_TE_RENAMES_MOE: dict[str, str] = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
}
_TE_ATTENTION_EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv",
    "self_attention.core_attention",
    "self_attention.linear_proj",
)
_TE_DENSE_MLP_EXTRA_STATE_MODULES = (
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
# dense layer (kept for backward compatibility)
_TE_EXTRA_STATE_MODULES = _TE_ATTENTION_EXTRA_STATE_MODULES + _TE_DENSE_MLP_EXTRA_STATE_MODULES

# tensors that are float32 in the full model and on every rank, whatever m.dtype is
_FP32_SUFFIXES = ("mlp.router.weight", "mlp.router.expert_bias")


@dataclass
class TinyModel:
    """Shape/feature description of a tiny GPT model in Megatron-core naming."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # == heads for MHA
    kv_channels: int  # head dim
    ffn_hidden_size: int
    vocab_size: int  # true (unpadded) vocab
    swiglu: bool  # gated MLP: linear_fc1 is [gate; up]
    normalization: str  # "RMSNorm" or "LayerNorm"
    add_bias_linear: bool  # biases on linear_qkv, linear_proj, linear_fc1, linear_fc2
    add_qkv_bias: bool  # bias on linear_qkv only
    qk_layernorm: bool
    tied_embeddings: bool
    position_embedding_type: str  # "rope" or "learned_absolute"
    max_position_embeddings: int = 32
    make_vocab_size_divisible_by: int = 128
    transformer_impl: str = "local"  # "local" or "transformer_engine"
    dtype: torch.dtype = torch.float32
    # ---- mixture of experts (all defaults: dense model)
    num_experts: int | None = None  # None: dense model
    moe_ffn_hidden_size: int | None = None  # expert FFN size; None: ffn_hidden_size
    moe_layer_freq: int | list[int] = 1  # int k: layer i is MoE iff i % k == 0; list: iff list[i] == 1
    moe_shared_expert_intermediate_size: int | None = None  # None: no shared experts
    moe_shared_expert_gate: bool = False  # shared experts carry gate_weight [1, H]
    moe_router_enable_expert_bias: bool = False  # router carries expert_bias [E] (float32)
    moe_grouped_gemm: bool = False  # local expert key names: grouped GEMM instead of SequentialMLP

    def __post_init__(self) -> None:
        assert self.normalization in _NORMALIZATIONS, self.normalization
        assert self.position_embedding_type in _POSITION_EMBEDDINGS, self.position_embedding_type
        assert self.transformer_impl in _TRANSFORMER_IMPLS, self.transformer_impl
        assert self.num_attention_heads % self.num_query_groups == 0
        if self.num_experts is not None:
            assert self.num_experts >= 1, self.num_experts
            assert not self.add_bias_linear, "experts have no biases: add_bias_linear must be False with MoE"
            if isinstance(self.moe_layer_freq, int):
                assert self.moe_layer_freq >= 1, self.moe_layer_freq
            else:
                freq = list(self.moe_layer_freq)
                assert len(freq) == self.num_layers, (freq, self.num_layers)
                assert all(x in (0, 1) for x in freq), freq

    @property
    def has_norm_bias(self) -> bool:
        """LayerNorm norms carry a bias, RMSNorm norms do not."""
        return self.normalization == "LayerNorm"

    @property
    def has_qkv_bias(self) -> bool:
        """linear_qkv has a bias if add_bias_linear or add_qkv_bias."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def heads_per_group(self) -> int:
        """Query heads per query group (nq / ng)."""
        return self.num_attention_heads // self.num_query_groups

    @property
    def qkv_rows_per_group(self) -> int:
        """Rows of linear_qkv belonging to one query group: (nq/ng + 2) * d."""
        return (self.heads_per_group + 2) * self.kv_channels

    @property
    def is_moe(self) -> bool:
        """True when the model has routed experts (num_experts is set)."""
        return self.num_experts is not None

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Fe: moe_ffn_hidden_size, defaulting to ffn_hidden_size."""
        return self.ffn_hidden_size if self.moe_ffn_hidden_size is None else self.moe_ffn_hidden_size

    @property
    def has_shared_experts(self) -> bool:
        """True when moe_shared_expert_intermediate_size is set (MoE models only)."""
        return self.is_moe and self.moe_shared_expert_intermediate_size is not None

    def is_moe_layer(self, layer: int) -> bool:
        """Megatron-core moe_layer_freq semantics for global layer index ``layer``."""
        if self.num_experts is None:
            return False
        assert 0 <= layer < self.num_layers, layer
        if isinstance(self.moe_layer_freq, int):
            return layer % self.moe_layer_freq == 0
        return list(self.moe_layer_freq)[layer] == 1


# --------------------------------------------------------------------------- full model


def _moe_layer_shapes(m: TinyModel, p: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the MoE MLP part of a layer with prefix ``p`` (after pre_mlp_layernorm)."""
    H = m.hidden_size
    E = m.num_experts
    assert E is not None
    Fe = m.expert_ffn_hidden_size
    out: list[tuple[str, tuple[int, ...]]] = [(p + "mlp.router.weight", (E, H))]
    if m.moe_router_enable_expert_bias:
        out.append((p + "mlp.router.expert_bias", (E,)))
    for e in range(E):
        q = f"{p}mlp.experts.local_experts.{e}."
        out.append((q + "linear_fc1.weight", (2 * Fe if m.swiglu else Fe, H)))
        out.append((q + "linear_fc2.weight", (H, Fe)))
    if m.has_shared_experts:
        Fs = m.moe_shared_expert_intermediate_size
        assert Fs is not None
        out.append((p + "mlp.shared_experts.linear_fc1.weight", (2 * Fs if m.swiglu else Fs, H)))
        out.append((p + "mlp.shared_experts.linear_fc2.weight", (H, Fs)))
        if m.moe_shared_expert_gate:
            out.append((p + "mlp.shared_experts.gate_weight", (1, H)))
    return out


def full_model_shapes(m: TinyModel) -> list[tuple[str, tuple[int, ...]]]:
    """Canonical (name, shape) list of the full model, in canonical order."""
    H = m.hidden_size
    nq = m.num_attention_heads
    ng = m.num_query_groups
    d = m.kv_channels
    F = m.ffn_hidden_size
    V = m.vocab_size
    out: list[tuple[str, tuple[int, ...]]] = [("embedding.word_embeddings.weight", (V, H))]
    if m.position_embedding_type == "learned_absolute":
        out.append(("embedding.position_embeddings.weight", (m.max_position_embeddings, H)))
    for L in range(m.num_layers):
        p = f"decoder.layers.{L}."
        out.append((p + "input_layernorm.weight", (H,)))
        if m.has_norm_bias:
            out.append((p + "input_layernorm.bias", (H,)))
        out.append((p + "self_attention.linear_qkv.weight", ((nq + 2 * ng) * d, H)))
        if m.has_qkv_bias:
            out.append((p + "self_attention.linear_qkv.bias", ((nq + 2 * ng) * d,)))
        if m.qk_layernorm:
            out.append((p + "self_attention.q_layernorm.weight", (d,)))
            if m.has_norm_bias:
                out.append((p + "self_attention.q_layernorm.bias", (d,)))
            out.append((p + "self_attention.k_layernorm.weight", (d,)))
            if m.has_norm_bias:
                out.append((p + "self_attention.k_layernorm.bias", (d,)))
        out.append((p + "self_attention.linear_proj.weight", (H, nq * d)))
        if m.add_bias_linear:
            out.append((p + "self_attention.linear_proj.bias", (H,)))
        out.append((p + "pre_mlp_layernorm.weight", (H,)))
        if m.has_norm_bias:
            out.append((p + "pre_mlp_layernorm.bias", (H,)))
        if m.is_moe_layer(L):
            out.extend(_moe_layer_shapes(m, p))
            continue
        fc1_rows = 2 * F if m.swiglu else F
        out.append((p + "mlp.linear_fc1.weight", (fc1_rows, H)))
        if m.add_bias_linear:
            out.append((p + "mlp.linear_fc1.bias", (fc1_rows,)))
        out.append((p + "mlp.linear_fc2.weight", (H, F)))
        if m.add_bias_linear:
            out.append((p + "mlp.linear_fc2.bias", (H,)))
    out.append(("decoder.final_layernorm.weight", (H,)))
    if m.has_norm_bias:
        out.append(("decoder.final_layernorm.bias", (H,)))
    if not m.tied_embeddings:
        out.append(("output_layer.weight", (V, H)))
    return out


def tensor_dtype(m: TinyModel, name: str) -> torch.dtype:
    """dtype of full-model tensor ``name``: float32 for the router (weight, expert_bias), else m.dtype."""
    return torch.float32 if name.endswith(_FP32_SUFFIXES) else m.dtype


def make_full_model(m: TinyModel, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded full model: random normal plus a distinct offset per tensor, dtype m.dtype (router: float32)."""
    g = torch.Generator().manual_seed(seed)
    full: dict[str, torch.Tensor] = {}
    for index, (name, shape) in enumerate(full_model_shapes(m)):
        values = torch.randn(shape, generator=g, dtype=torch.float32) + (index + 1) * 0.125
        full[name] = values.to(tensor_dtype(m, name))
    return full


# --------------------------------------------------------------------------- layout helpers


def padded_vocab_size(m: TinyModel, tp: int) -> int:
    """Megatron's padded vocab: round V up to a multiple of make_vocab_size_divisible_by * tp."""
    multiple = m.make_vocab_size_divisible_by * tp
    return int(math.ceil(m.vocab_size / multiple)) * multiple
def stage_layer_ranges(num_layers: int, pp: int, first: int | None, last: int | None) -> list[range]:
    """Global layer range held by each pipeline stage (optionally uneven first/last stage)."""
    assert pp >= 1
    if pp == 1:
        return [range(num_layers)]
    counts: list[int | None] = [None] * pp
    if first is not None:
        assert first >= 1, first
        counts[0] = first
    if last is not None:
        assert last >= 1, last
        counts[-1] = last
    remaining_layers = num_layers - (first or 0) - (last or 0)
    remaining_stages = sum(1 for c in counts if c is None)
    if remaining_stages == 0:
        assert remaining_layers == 0, (num_layers, pp, first, last)
    else:
        assert remaining_layers >= 0 and remaining_layers % remaining_stages == 0, (
            num_layers,
            pp,
            first,
            last,
        )
        per_stage = remaining_layers // remaining_stages
        counts = [per_stage if c is None else c for c in counts]
    ranges: list[range] = []
    start = 0
    for c in counts:
        assert c is not None
        ranges.append(range(start, start + c))
        start += c
    assert start == num_layers
    return ranges



def virtual_stage_layer_ranges(num_layers: int, pp: int, vpp: int) -> list[range]:
    """Global layer range of each virtual stage s = chunk * pp + stage (even split over pp * vpp)."""
    assert pp >= 1 and vpp >= 1, (pp, vpp)
    stages = pp * vpp
    assert num_layers % stages == 0, (num_layers, pp, vpp)
    n = num_layers // stages
    return [range(s * n, (s + 1) * n) for s in range(stages)]


def checkpoint_dir_name(iteration: int, release: bool) -> str:
    """``release`` or ``iter_{iteration:07d}``."""
    return "release" if release else f"iter_{iteration:07d}"


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """``mp_rank_{tp:02d}``, + ``_{pp:03d}`` when pp > 1, + ``_{ep:03d}`` when ep > 1."""
    name = f"mp_rank_{tp_rank:02d}"
    if pp > 1:
        name += f"_{pp_rank:03d}"
    if ep > 1:
        name += f"_{ep_rank:03d}"
    return name


def _own(t: torch.Tensor) -> torch.Tensor:
    """Contiguous clone with its own storage (never a view)."""
    return t.clone(memory_format=torch.contiguous_format)


def _chunk(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Chunk ``rank`` of ``world`` equal chunks along ``dim`` (must divide)."""
    size = t.shape[dim]
    assert size % world == 0, (tuple(t.shape), dim, world)
    step = size // world
    return t.narrow(dim, rank * step, step)


def _pad_vocab_rows(t: torch.Tensor, padded: int) -> torch.Tensor:
    """Append zero rows up to ``padded`` rows."""
    assert t.shape[0] <= padded
    pad = torch.zeros((padded - t.shape[0], *t.shape[1:]), dtype=t.dtype)
    return torch.cat([t, pad], dim=0)


def make_args(
    m: TinyModel,
    tp: int,
    pp: int,
    first: int | None,
    last: int | None,
    iteration: int,
    ep: int = 1,
    vpp: int | None = None,
) -> argparse.Namespace:
    """The ``args`` Namespace stored in every rank file (a MoE model's router with its expert bias scores by sigmoid:
    megatron-core's TransformerConfig refuses the bias with any other score function, so Megatron-LM records it)."""
    freq = m.moe_layer_freq if isinstance(m.moe_layer_freq, int) else list(m.moe_layer_freq)
    scores = {"moe_router_score_function": "sigmoid"} if m.is_moe and m.moe_router_enable_expert_bias else {}
    return argparse.Namespace(
        **scores,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        group_query_attention=m.num_query_groups != m.num_attention_heads,
        kv_channels=m.kv_channels,
        padded_vocab_size=padded_vocab_size(m, tp),
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        vocab_size=m.vocab_size,
        swiglu=m.swiglu,
        normalization=m.normalization,
        norm_epsilon=1e-5,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        untie_embeddings_and_output_weights=not m.tied_embeddings,
        position_embedding_type=m.position_embedding_type,
        max_position_embeddings=m.max_position_embeddings,
        rotary_base=10000,
        seq_length=m.max_position_embeddings,
        params_dtype=m.dtype,
        bf16=m.dtype == torch.bfloat16,
        fp16=m.dtype == torch.float16,
        transformer_impl=m.transformer_impl,
        decoder_first_pipeline_num_layers=first,
        decoder_last_pipeline_num_layers=last,
        virtual_pipeline_model_parallel_size=vpp,
        num_layers_per_virtual_pipeline_stage=None if vpp is None else m.num_layers // (pp * vpp),
        num_experts=m.num_experts,
        # megatron's validate_args fills moe_ffn_hidden_size from ffn_hidden_size for MoE models
        moe_ffn_hidden_size=m.expert_ffn_hidden_size if m.is_moe else None,
        moe_layer_freq=freq,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=m.moe_shared_expert_gate,
        moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        moe_grouped_gemm=m.moe_grouped_gemm,
        moe_router_topk=2,
        expert_tensor_parallel_size=tp,
        iteration=iteration,
    )


# --------------------------------------------------------------------------- writer


def _slice_qkv(m: TinyModel, full: torch.Tensor, t: int, tp: int) -> torch.Tensor:
    """Rows of linear_qkv (weight or bias) for the query groups owned by tp rank t."""
    ng = m.num_query_groups
    assert ng % tp == 0, (ng, tp)
    groups_per_rank = ng // tp
    rows = m.qkv_rows_per_group
    pieces: list[torch.Tensor] = []
    for g in range(t * groups_per_rank, (t + 1) * groups_per_rank):
        start = g * rows
        pieces.append(full[start : start + rows])
    return torch.cat(pieces, dim=0)


def _slice_gated_rows(full: torch.Tensor, F: int, swiglu: bool, t: int, tp: int) -> torch.Tensor:
    """fc1-style rows of an FFN of size F for tp rank t; swiglu: cat(gate chunk t, up chunk t)."""
    assert F % tp == 0, (F, tp)
    assert full.shape[0] == (2 * F if swiglu else F), (tuple(full.shape), F, swiglu)
    step = F // tp
    if swiglu:
        gate = full[:F]
        up = full[F : 2 * F]
        return torch.cat([gate[t * step : (t + 1) * step], up[t * step : (t + 1) * step]], dim=0)
    return full[t * step : (t + 1) * step]


def _slice_fc1(m: TinyModel, full: torch.Tensor, t: int, tp: int) -> torch.Tensor:
    """linear_fc1 (weight or bias) rows for tp rank t; swiglu: cat(gate chunk, up chunk)."""
    return _slice_gated_rows(full, m.ffn_hidden_size, m.swiglu, t, tp)


def local_expert_names(local_prefix: str, j: int, grouped: bool) -> tuple[str, str]:
    """(fc1, fc2) weight key names of local expert j in a rank dict; ``local_prefix`` ends with '.'."""
    if grouped:
        return (
            f"{local_prefix}mlp.experts.linear_fc1.weight{j}",
            f"{local_prefix}mlp.experts.linear_fc2.weight{j}",
        )
    return (
        f"{local_prefix}mlp.experts.local_experts.{j}.linear_fc1.weight",
        f"{local_prefix}mlp.experts.local_experts.{j}.linear_fc2.weight",
    )


def _experts_per_rank(m: TinyModel, ep: int) -> int:
    E = m.num_experts
    assert E is not None
    assert ep >= 1 and E % ep == 0, (E, ep)
    return E // ep


def _moe_mlp_local_state(
    m: TinyModel, full: dict[str, torch.Tensor], L: int, t: int, tp: int, e: int, ep: int
) -> list[tuple[str, torch.Tensor | None]]:
    """(layer-relative stored name, value) of the MoE MLP of global layer L on tp rank t, ep rank e."""
    p = f"decoder.layers.{L}."
    te = m.transformer_impl == "transformer_engine"
    Fe = m.expert_ffn_hidden_size
    n_local = _experts_per_rank(m, ep)
    out: list[tuple[str, torch.Tensor | None]] = []
    out.append(("mlp.router.weight", full[p + "mlp.router.weight"]))
    if m.moe_router_enable_expert_bias:
        out.append(("mlp.router.expert_bias", full[p + "mlp.router.expert_bias"]))

    def fc1(g: int) -> torch.Tensor:
        return _slice_gated_rows(full[f"{p}mlp.experts.local_experts.{g}.linear_fc1.weight"], Fe, m.swiglu, t, tp)

    def fc2(g: int) -> torch.Tensor:
        return _chunk(full[f"{p}mlp.experts.local_experts.{g}.linear_fc2.weight"], 1, t, tp)

    globals_here = [e * n_local + j for j in range(n_local)]
    if m.moe_grouped_gemm:
        for j, g in enumerate(globals_here):
            out.append((local_expert_names("", j, True)[0], fc1(g)))
        if te:
            out.append(("mlp.experts.linear_fc1._extra_state", None))
        for j, g in enumerate(globals_here):
            out.append((local_expert_names("", j, True)[1], fc2(g)))
        if te:
            out.append(("mlp.experts.linear_fc2._extra_state", None))
    else:
        for j, g in enumerate(globals_here):
            name1, name2 = local_expert_names("", j, False)
            out.append((name1, fc1(g)))
            if te:
                out.append((f"mlp.experts.local_experts.{j}.linear_fc1._extra_state", None))
            out.append((name2, fc2(g)))
            if te:
                out.append((f"mlp.experts.local_experts.{j}.linear_fc2._extra_state", None))
    if m.has_shared_experts:
        Fs = m.moe_shared_expert_intermediate_size
        assert Fs is not None
        q = p + "mlp.shared_experts."
        out.append(("mlp.shared_experts.linear_fc1.weight", _slice_gated_rows(full[q + "linear_fc1.weight"], Fs, m.swiglu, t, tp)))
        if te:
            out.append(("mlp.shared_experts.linear_fc1._extra_state", None))
        out.append(("mlp.shared_experts.linear_fc2.weight", _chunk(full[q + "linear_fc2.weight"], 1, t, tp)))
        if te:
            out.append(("mlp.shared_experts.linear_fc2._extra_state", None))
        if m.moe_shared_expert_gate:
            out.append(("mlp.shared_experts.gate_weight", full[q + "gate_weight"]))
    return out


def _layer_local_state(
    m: TinyModel,
    full: dict[str, torch.Tensor],
    L: int,
    t: int,
    tp: int,
    e: int = 0,
    ep: int = 1,
) -> list[tuple[str, torch.Tensor | None]]:
    """(layer-relative stored name, value) pairs of global layer L for tp rank t (ep rank e)."""
    p = f"decoder.layers.{L}."
    te = m.transformer_impl == "transformer_engine"
    moe = m.is_moe_layer(L)
    renames = _TE_RENAMES_MOE if moe else _TE_RENAMES
    out: list[tuple[str, torch.Tensor | None]] = []

    def put(local_name: str, value: torch.Tensor) -> None:
        out.append((renames.get(local_name, local_name) if te else local_name, value))

    def extra_state(module: str) -> None:
        if te:
            out.append((module + "._extra_state", None))

    put("input_layernorm.weight", full[p + "input_layernorm.weight"])
    if m.has_norm_bias:
        put("input_layernorm.bias", full[p + "input_layernorm.bias"])
    put("self_attention.linear_qkv.weight", _slice_qkv(m, full[p + "self_attention.linear_qkv.weight"], t, tp))
    if m.has_qkv_bias:
        put("self_attention.linear_qkv.bias", _slice_qkv(m, full[p + "self_attention.linear_qkv.bias"], t, tp))
    extra_state("self_attention.linear_qkv")
    if m.qk_layernorm:
        put("self_attention.q_layernorm.weight", full[p + "self_attention.q_layernorm.weight"])
        if m.has_norm_bias:
            put("self_attention.q_layernorm.bias", full[p + "self_attention.q_layernorm.bias"])
        put("self_attention.k_layernorm.weight", full[p + "self_attention.k_layernorm.weight"])
        if m.has_norm_bias:
            put("self_attention.k_layernorm.bias", full[p + "self_attention.k_layernorm.bias"])
    extra_state("self_attention.core_attention")
    put("self_attention.linear_proj.weight", _chunk(full[p + "self_attention.linear_proj.weight"], 1, t, tp))
    if m.add_bias_linear:
        put("self_attention.linear_proj.bias", full[p + "self_attention.linear_proj.bias"])
    extra_state("self_attention.linear_proj")
    put("pre_mlp_layernorm.weight", full[p + "pre_mlp_layernorm.weight"])
    if m.has_norm_bias:
        put("pre_mlp_layernorm.bias", full[p + "pre_mlp_layernorm.bias"])
    if moe:
        out.extend(_moe_mlp_local_state(m, full, L, t, tp, e, ep))
        return out
    put("mlp.linear_fc1.weight", _slice_fc1(m, full[p + "mlp.linear_fc1.weight"], t, tp))
    if m.add_bias_linear:
        put("mlp.linear_fc1.bias", _slice_fc1(m, full[p + "mlp.linear_fc1.bias"], t, tp))
    extra_state("mlp.linear_fc1")
    put("mlp.linear_fc2.weight", _chunk(full[p + "mlp.linear_fc2.weight"], 1, t, tp))
    if m.add_bias_linear:
        put("mlp.linear_fc2.bias", full[p + "mlp.linear_fc2.bias"])
    extra_state("mlp.linear_fc2")
    return out


def _chunk_state_dict(
    m: TinyModel,
    full: dict[str, torch.Tensor],
    t: int,
    tp: int,
    e: int,
    ep: int,
    layers: range,
    pre_process: bool,
    post_process: bool,
    tied_output_copy: bool,
) -> OrderedDict[str, torch.Tensor | None]:
    """One model chunk of tp rank t, ep rank e, holding global ``layers`` (stored from local index 0)."""
    padded = padded_vocab_size(m, tp)
    sd: OrderedDict[str, torch.Tensor | None] = OrderedDict()
    if pre_process:
        emb = _pad_vocab_rows(full["embedding.word_embeddings.weight"], padded)
        sd["embedding.word_embeddings.weight"] = _own(_chunk(emb, 0, t, tp))
        if m.position_embedding_type == "learned_absolute":
            sd["embedding.position_embeddings.weight"] = _own(full["embedding.position_embeddings.weight"])
    for local_index, L in enumerate(layers):
        for name, value in _layer_local_state(m, full, L, t, tp, e, ep):
            sd[f"decoder.layers.{local_index}.{name}"] = None if value is None else _own(value)
    if post_process:
        sd["decoder.final_layernorm.weight"] = _own(full["decoder.final_layernorm.weight"])
        if m.has_norm_bias:
            sd["decoder.final_layernorm.bias"] = _own(full["decoder.final_layernorm.bias"])
        if not m.tied_embeddings:
            out = _pad_vocab_rows(full["output_layer.weight"], padded)
            sd["output_layer.weight"] = _own(_chunk(out, 0, t, tp))
        elif tied_output_copy:
            emb = _pad_vocab_rows(full["embedding.word_embeddings.weight"], padded)
            sd["output_layer.weight"] = _own(_chunk(emb, 0, t, tp))
    return sd


def _rank_state_dict(
    m: TinyModel,
    full: dict[str, torch.Tensor],
    t: int,
    tp: int,
    p: int,
    pp: int,
    layers: range,
    e: int = 0,
    ep: int = 1,
) -> OrderedDict[str, torch.Tensor | None]:
    """Local model state dict of tp rank t, pp stage p (ep rank e), without virtual pipeline."""
    return _chunk_state_dict(
        m, full, t, tp, e, ep, layers,
        pre_process=p == 0, post_process=p == pp - 1, tied_output_copy=pp > 1,
    )


def write_megatron_checkpoint(
    root: Path,
    m: TinyModel,
    full: dict[str, torch.Tensor],
    tp: int,
    pp: int,
    first: int | None = None,
    last: int | None = None,
    iteration: int = 100,
    release: bool = False,
    ep: int = 1,
    vpp: int | None = None,
) -> Path:
    """Write ``full`` as a Megatron legacy per-rank checkpoint at TP=tp, PP=pp, EP=ep; returns root.

    ``vpp=None``: one ``"model"`` dict per rank file. ``vpp=v``: keys ``model0`` .. ``model{v-1}``,
    chunk c of stage p holding virtual stage c * pp + p (layers split evenly over pp * v stages).
    """
    root = Path(root)
    expected = {name for name, _ in full_model_shapes(m)}
    assert set(full) == expected, sorted(set(full) ^ expected)
    assert tp >= 1 and pp >= 1 and ep >= 1, (tp, pp, ep)
    if ep > 1:
        assert m.is_moe, "expert parallelism (ep > 1) needs an MoE model (num_experts set)"
    if m.is_moe:
        _experts_per_rank(m, ep)
    if vpp is not None:
        assert vpp >= 1, vpp
        assert first is None and last is None, "uneven first/last stages are not combined with vpp here"
        vranges = virtual_stage_layer_ranges(m.num_layers, pp, vpp)
        ranges: list[range] = []
    else:
        ranges = stage_layer_ranges(m.num_layers, pp, first, last)
        vranges = []
    args = make_args(m, tp, pp, first, last, iteration, ep=ep, vpp=vpp)
    ckpt_dir = root / checkpoint_dir_name(iteration, release)
    for p in range(pp):
        for t in range(tp):
            for e in range(ep):
                rank_dir = ckpt_dir / rank_dir_name(t, p, pp, e, ep)
                rank_dir.mkdir(parents=True, exist_ok=True)
                payload: dict[str, object] = {
                    "args": args,
                    "checkpoint_version": 3.0,
                    "iteration": iteration,
                }
                if vpp is None:
                    payload["model"] = _rank_state_dict(m, full, t, tp, p, pp, ranges[p], e, ep)
                else:
                    stages = pp * vpp
                    for c in range(vpp):
                        s = c * pp + p
                        payload[f"model{c}"] = _chunk_state_dict(
                            m, full, t, tp, e, ep, vranges[s],
                            pre_process=s == 0,
                            post_process=s == stages - 1,
                            tied_output_copy=stages > 1,
                        )
                torch.save(payload, rank_dir / CHECKPOINT_FILE)
    (root / TRACKER_FILE).write_text("release" if release else str(iteration))
    return root


# --------------------------------------------------------------------------- reader / merge

_RANK_DIR_RE = re.compile(r"^mp_rank_(\d{2})((?:_\d{3}){0,2})$")
_MODEL_CHUNK_RE = re.compile(r"^model(\d+)$")


def load_rank_file(path: Path) -> dict[str, object]:
    """torch.load a rank file with weights_only=True (as ``load_for_test``)."""
    return load_for_test(path)


def load_for_test(path: Path) -> dict[str, object]:
    """torch.load a checkpoint file a test wants to inspect or tamper with, weights_only=True.

    Allows argparse.Namespace and io.BytesIO, plus megatron-core's own safe globals when it is
    installed (files that megatron-core itself wrote carry its enums in ``args``).
    """
    with torch.serialization.safe_globals(allowed_globals()):
        return torch.load(path, map_location="cpu", weights_only=True)


def rank_states(iteration_dir: Path) -> dict[str, dict[str, object]]:
    """Every rank file of an iteration (``load_for_test``), by its rank directory's name."""
    files = sorted(iteration_dir.glob("mp_rank_*/model_optim_rng.pt"))
    return {path.parent.name: load_for_test(path) for path in files}


def allowed_globals() -> list[object]:
    """The classes ``load_for_test`` allows in a weights-only load."""
    import io

    from pgconvert.formats.megatron import SAFE_GLOBALS as PGCONVERT_SAFE_GLOBALS

    # pgconvert's stand-ins first: enums this megatron-core does not have yet (files written by
    # Megatron-LM's own tools), overridden by megatron-core's real classes where it has them.
    allowed: list[object] = [argparse.Namespace, io.BytesIO, *PGCONVERT_SAFE_GLOBALS]
    try:
        from megatron.core.safe_globals import SAFE_GLOBALS
    except ImportError:
        pass
    else:
        allowed += SAFE_GLOBALS
    return allowed


def resolve_checkpoint_dir(root: Path) -> Path:
    """The iteration directory named by ``latest_checkpointed_iteration.txt``."""
    root = Path(root)
    text = (root / TRACKER_FILE).read_text().strip()
    if text == "release":
        return root / "release"
    return root / checkpoint_dir_name(int(text), False)


def _size_arg(args: argparse.Namespace, name: str) -> int:
    value = getattr(args, name, None)
    return 1 if value is None else int(value)


def _shared_args(args: argparse.Namespace) -> dict[str, object]:
    return {k: v for k, v in vars(args).items() if k not in ("rank", "local_rank")}


def read_megatron_checkpoint_ranks(
    root: Path,
) -> tuple[argparse.Namespace, dict[tuple[int, int, int], dict[str, dict[str, object]]]]:
    """Raw per-(tp_rank, pp_rank, ep_rank) model dicts plus the args of rank (0, 0, 0).

    Each value maps ``"model"`` (no virtual pipeline) or ``"model0"`` .. ``"model{v-1}"``
    (virtual pipeline of size v, from args) to that chunk's state dict.
    """
    ckpt_dir = resolve_checkpoint_dir(root)
    raw: dict[tuple[int, str], tuple[str, dict[str, object]]] = {}
    for entry in sorted(ckpt_dir.iterdir()):
        match = _RANK_DIR_RE.match(entry.name)
        if match is None or not entry.is_dir():
            continue
        payload = load_rank_file(entry / CHECKPOINT_FILE)
        raw[(int(match.group(1)), match.group(2))] = (entry.name, payload)
    assert raw, f"no rank files under {ckpt_dir}"
    # the args of any file say how the suffixes are to be read; all args are checked equal below
    some_args: argparse.Namespace = next(iter(raw.values()))[1]["args"]  # type: ignore[assignment]
    pp = _size_arg(some_args, "pipeline_model_parallel_size")
    ep = _size_arg(some_args, "expert_model_parallel_size")
    vpp: int | None = getattr(some_args, "virtual_pipeline_model_parallel_size", None)

    ranks: dict[tuple[int, int, int], dict[str, dict[str, object]]] = {}
    all_args: dict[tuple[int, int, int], argparse.Namespace] = {}
    dir_names: dict[tuple[int, int, int], str] = {}
    for (t, suffix), (name, payload) in raw.items():
        parts = [int(x) for x in suffix.split("_") if x]
        expected_parts = (pp > 1) + (ep > 1)
        assert len(parts) == expected_parts, f"rank dir {name} does not fit pp={pp}, ep={ep} (from args)"
        p = parts.pop(0) if pp > 1 else 0
        e = parts.pop(0) if ep > 1 else 0
        key = (t, p, e)
        assert key not in ranks, name
        chunk_keys = sorted(k for k in payload if k == "model" or _MODEL_CHUNK_RE.match(k))
        if vpp is None:
            assert chunk_keys == ["model"], f"{name}: expected a single 'model' entry, found {chunk_keys}"
        else:
            expected_keys = sorted(f"model{c}" for c in range(vpp))
            assert chunk_keys == expected_keys, f"{name}: expected {expected_keys} (vpp={vpp}), found {chunk_keys}"
        ranks[key] = {k: payload[k] for k in (["model"] if vpp is None else [f"model{c}" for c in range(vpp)])}  # type: ignore[misc]
        all_args[key] = payload["args"]  # type: ignore[assignment]
        dir_names[key] = name
    assert (0, 0, 0) in ranks, f"no rank (0, 0, 0) file under {ckpt_dir}"
    args = all_args[(0, 0, 0)]
    tp = _size_arg(args, "tensor_model_parallel_size")
    expected = {(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)}
    assert set(ranks) == expected, sorted(set(ranks) ^ expected)
    for key, name in dir_names.items():
        assert name == rank_dir_name(key[0], key[1], pp, key[2], ep), (name, pp, ep)
        # each process of a Megatron-LM run records its own rank (save_checkpoint keeps them)
        assert _shared_args(all_args[key]) == _shared_args(args), f"args of {name} differ from rank (0, 0, 0)"
    return args, ranks


def read_megatron_checkpoint(
    root: Path,
) -> tuple[argparse.Namespace, dict[tuple[int, int], dict[str, torch.Tensor]]]:
    """Raw per-(tp_rank, pp_rank) model dicts plus the args of rank (0, 0).

    Only for checkpoints without expert parallelism and without a virtual pipeline;
    use :func:`read_megatron_checkpoint_ranks` for those.
    """
    args, ranks = read_megatron_checkpoint_ranks(root)
    ep = _size_arg(args, "expert_model_parallel_size")
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    assert ep == 1 and vpp is None, (
        f"checkpoint has expert_model_parallel_size={ep}, virtual_pipeline_model_parallel_size={vpp}: "
        "read_megatron_checkpoint only handles ep == 1 without vpp; use read_megatron_checkpoint_ranks"
    )
    models = {(t, p): chunks["model"] for (t, p, _e), chunks in ranks.items()}
    return args, models  # type: ignore[return-value]


def _replicated(pieces: list[torch.Tensor], name: str) -> torch.Tensor:
    """A tensor that every tp rank holds in full: check they agree, return one."""
    for i, piece in enumerate(pieces[1:], start=1):
        assert torch.equal(piece, pieces[0]), f"{name}: tp rank {i} differs from tp rank 0"
    return pieces[0]


def _merge_qkv(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Rank t holds query groups [t*ng/tp, (t+1)*ng/tp) contiguously: concatenate rows."""
    return torch.cat(pieces, dim=0)


def _merge_gated_rows(swiglu: bool, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Undo fc1-style slicing; swiglu: each piece is [gate_t; up_t], full is [gates...; ups...]."""
    if not swiglu:
        return torch.cat(pieces, dim=0)
    gates: list[torch.Tensor] = []
    ups: list[torch.Tensor] = []
    for piece in pieces:
        half = piece.shape[0] // 2
        assert piece.shape[0] == 2 * half
        gates.append(piece[:half])
        ups.append(piece[half:])
    return torch.cat(gates + ups, dim=0)


def _merge_fc1(m: TinyModel, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Undo fc1 slicing; swiglu: each piece is [gate_t; up_t], full is [gates...; ups...]."""
    return _merge_gated_rows(m.swiglu, pieces)


@dataclass
class _VirtualStage:
    """Where one (virtual) pipeline stage lives: stage p, chunk key, its global layers."""

    p: int
    chunk: str
    layers: range


def merge_megatron_checkpoint(root: Path, m: TinyModel) -> dict[str, torch.Tensor]:
    """Reference merge of a legacy checkpoint (any TP/PP/EP/VPP) back to the full model (true vocab rows)."""
    args, ranks = read_megatron_checkpoint_ranks(root)
    tp = _size_arg(args, "tensor_model_parallel_size")
    pp = _size_arg(args, "pipeline_model_parallel_size")
    ep = _size_arg(args, "expert_model_parallel_size")
    vpp: int | None = getattr(args, "virtual_pipeline_model_parallel_size", None)
    first: int | None = getattr(args, "decoder_first_pipeline_num_layers", None)
    last: int | None = getattr(args, "decoder_last_pipeline_num_layers", None)
    if vpp is None:
        stages = [_VirtualStage(p, "model", r) for p, r in enumerate(stage_layer_ranges(m.num_layers, pp, first, last))]
    else:
        vranges = virtual_stage_layer_ranges(m.num_layers, pp, vpp)
        stages = [_VirtualStage(s % pp, f"model{s // pp}", r) for s, r in enumerate(vranges)]
    if ep > 1:
        assert m.is_moe, f"ep={ep} but the model has no experts"
    n_local = _experts_per_rank(m, ep) if m.is_moe else 0
    padded: int = args.padded_vocab_size
    V = m.vocab_size
    te = m.transformer_impl == "transformer_engine"

    def sd_of(t: int, st: _VirtualStage, e: int) -> dict[str, torch.Tensor]:
        return ranks[(t, st.p, e)][st.chunk]  # type: ignore[return-value]

    consumed: dict[tuple[int, int, int, str], set[str]] = {
        (t, p, e, chunk): set() for (t, p, e), chunks in ranks.items() for chunk in chunks
    }

    def take_ep(st: _VirtualStage, name: str, e: int) -> list[torch.Tensor]:
        """Tensor ``name`` from every tp rank of ep rank e in stage ``st``, marking it consumed."""
        pieces: list[torch.Tensor] = []
        for t in range(tp):
            sd = sd_of(t, st, e)
            assert name in sd, f"missing {name} on tp {t} pp {st.p} ep {e} {st.chunk}"
            consumed[(t, st.p, e, st.chunk)].add(name)
            pieces.append(sd[name])
        return pieces

    def take(st: _VirtualStage, name: str) -> list[torch.Tensor]:
        """A non-expert tensor: every ep rank must hold the same pieces; return those of ep rank 0."""
        pieces = take_ep(st, name, 0)
        for e in range(1, ep):
            other = take_ep(st, name, e)
            for t in range(tp):
                assert torch.equal(other[t], pieces[t]), f"{name}: ep rank {e} differs from ep rank 0 (tp {t} pp {st.p})"
        return pieces

    def need_extra_state(st: _VirtualStage, name: str) -> None:
        for e in range(ep):
            for t in range(tp):
                assert name in sd_of(t, st, e), f"missing {name} on tp {t} pp {st.p} ep {e} {st.chunk}"
                consumed[(t, st.p, e, st.chunk)].add(name)

    merged: dict[str, torch.Tensor] = {}
    st_first = stages[0]
    st_last = stages[-1]

    # first (virtual) stage: embeddings
    emb = torch.cat(take(st_first, "embedding.word_embeddings.weight"), dim=0)
    assert emb.shape[0] == padded, (tuple(emb.shape), padded)
    merged["embedding.word_embeddings.weight"] = emb[:V].clone()
    if m.position_embedding_type == "learned_absolute":
        merged["embedding.position_embeddings.weight"] = _replicated(
            take(st_first, "embedding.position_embeddings.weight"), "embedding.position_embeddings.weight"
        ).clone()

    # layers
    for st in stages:
        for local_index, L in enumerate(st.layers):
            src = f"decoder.layers.{local_index}."
            dst = f"decoder.layers.{L}."
            moe = m.is_moe_layer(L)
            renames = _TE_RENAMES_MOE if moe else _TE_RENAMES

            def layer_name(local_name: str) -> str:
                return renames.get(local_name, local_name) if te else local_name

            def rep(local_name: str) -> None:
                merged[dst + local_name] = _replicated(take(st, src + layer_name(local_name)), dst + local_name)

            rep("input_layernorm.weight")
            if m.has_norm_bias:
                rep("input_layernorm.bias")
            merged[dst + "self_attention.linear_qkv.weight"] = _merge_qkv(
                take(st, src + "self_attention.linear_qkv.weight")
            )
            if m.has_qkv_bias:
                merged[dst + "self_attention.linear_qkv.bias"] = _merge_qkv(
                    take(st, src + "self_attention.linear_qkv.bias")
                )
            if m.qk_layernorm:
                rep("self_attention.q_layernorm.weight")
                if m.has_norm_bias:
                    rep("self_attention.q_layernorm.bias")
                rep("self_attention.k_layernorm.weight")
                if m.has_norm_bias:
                    rep("self_attention.k_layernorm.bias")
            merged[dst + "self_attention.linear_proj.weight"] = torch.cat(
                take(st, src + "self_attention.linear_proj.weight"), dim=1
            )
            if m.add_bias_linear:
                rep("self_attention.linear_proj.bias")
            rep("pre_mlp_layernorm.weight")
            if m.has_norm_bias:
                rep("pre_mlp_layernorm.bias")
            if te:
                for module in _TE_ATTENTION_EXTRA_STATE_MODULES:
                    need_extra_state(st, src + module + "._extra_state")
            if moe:
                rep("mlp.router.weight")
                if m.moe_router_enable_expert_bias:
                    rep("mlp.router.expert_bias")
                for g in range(m.num_experts or 0):
                    e, j = divmod(g, n_local)
                    fc1_name, fc2_name = local_expert_names(src, j, m.moe_grouped_gemm)
                    q = f"{dst}mlp.experts.local_experts.{g}."
                    merged[q + "linear_fc1.weight"] = _merge_gated_rows(m.swiglu, take_ep(st, fc1_name, e))
                    merged[q + "linear_fc2.weight"] = torch.cat(take_ep(st, fc2_name, e), dim=1)
                    if te and not m.moe_grouped_gemm:
                        for module in ("linear_fc1", "linear_fc2"):
                            name = f"{src}mlp.experts.local_experts.{j}.{module}._extra_state"
                            for t in range(tp):
                                assert name in sd_of(t, st, e), f"missing {name} on tp {t} pp {st.p} ep {e}"
                                consumed[(t, st.p, e, st.chunk)].add(name)
                if te and m.moe_grouped_gemm:
                    for module in ("linear_fc1", "linear_fc2"):
                        need_extra_state(st, f"{src}mlp.experts.{module}._extra_state")
                if m.has_shared_experts:
                    q = "mlp.shared_experts."
                    merged[dst + q + "linear_fc1.weight"] = _merge_gated_rows(
                        m.swiglu, take(st, src + q + "linear_fc1.weight")
                    )
                    merged[dst + q + "linear_fc2.weight"] = torch.cat(take(st, src + q + "linear_fc2.weight"), dim=1)
                    if m.moe_shared_expert_gate:
                        rep(q + "gate_weight")
                    if te:
                        need_extra_state(st, src + q + "linear_fc1._extra_state")
                        need_extra_state(st, src + q + "linear_fc2._extra_state")
                continue
            merged[dst + "mlp.linear_fc1.weight"] = _merge_fc1(m, take(st, src + "mlp.linear_fc1.weight"))
            if m.add_bias_linear:
                merged[dst + "mlp.linear_fc1.bias"] = _merge_fc1(m, take(st, src + "mlp.linear_fc1.bias"))
            merged[dst + "mlp.linear_fc2.weight"] = torch.cat(take(st, src + "mlp.linear_fc2.weight"), dim=1)
            if m.add_bias_linear:
                rep("mlp.linear_fc2.bias")
            if te:
                for module in _TE_DENSE_MLP_EXTRA_STATE_MODULES:
                    need_extra_state(st, src + module + "._extra_state")

    # last (virtual) stage: final norm and output layer
    merged["decoder.final_layernorm.weight"] = _replicated(
        take(st_last, "decoder.final_layernorm.weight"), "decoder.final_layernorm.weight"
    ).clone()
    if m.has_norm_bias:
        merged["decoder.final_layernorm.bias"] = _replicated(
            take(st_last, "decoder.final_layernorm.bias"), "decoder.final_layernorm.bias"
        ).clone()
    if not m.tied_embeddings:
        out = torch.cat(take(st_last, "output_layer.weight"), dim=0)
        assert out.shape[0] == padded, (tuple(out.shape), padded)
        merged["output_layer.weight"] = out[:V].clone()
    elif len(stages) > 1:
        out = torch.cat(take(st_last, "output_layer.weight"), dim=0)
        assert torch.equal(out, emb), "tied output_layer copy on last stage differs from embedding"
    else:
        for t in range(tp):
            for e in range(ep):
                assert "output_layer.weight" not in sd_of(t, st_first, e), "tied single stage must not store output_layer"

    # nothing unexpected left over
    for (t, p, e), chunks in ranks.items():
        for chunk, sd in chunks.items():
            leftover = set(sd) - consumed[(t, p, e, chunk)]  # type: ignore[arg-type]
            where = (t, p) if ep == 1 and vpp is None else (t, p, e, chunk)
            assert not leftover, f"unexpected keys on (tp, pp) {where}: {sorted(leftover)}"

    order = [name for name, _ in full_model_shapes(m)]
    assert set(merged) == set(order), sorted(set(merged) ^ set(order))
    return {name: merged[name] for name in order}


def assert_same_tree(a: object, b: object, where: str) -> None:
    """``a`` and ``b`` equal all the way down: tensors by dtype and ``torch.equal``, dicts by keys (the
    differing ones named), lists and tuples by length, anything else by ``==``."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (where, sorted(map(str, set(a) ^ set(b))))
        for key in a:
            assert_same_tree(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{index}]")
    else:
        assert a == b, where
