"""Test-only helpers: tiny Megatron-LM legacy (per-rank ``torch.save``) checkpoints.

Everything here is written out explicitly per tensor kind, on purpose: the
slicing in :func:`write_megatron_checkpoint` and the reassembly in
:func:`merge_megatron_checkpoint` must not share code with the production
sharding rules, so that a bug there cannot cancel itself out in a test.

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
_TE_EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv",
    "self_attention.core_attention",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


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

    def __post_init__(self) -> None:
        assert self.normalization in _NORMALIZATIONS, self.normalization
        assert self.position_embedding_type in _POSITION_EMBEDDINGS, self.position_embedding_type
        assert self.transformer_impl in _TRANSFORMER_IMPLS, self.transformer_impl
        assert self.num_attention_heads % self.num_query_groups == 0

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


# --------------------------------------------------------------------------- full model


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


def make_full_model(m: TinyModel, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded full model: random normal plus a distinct offset per tensor, dtype m.dtype."""
    g = torch.Generator().manual_seed(seed)
    full: dict[str, torch.Tensor] = {}
    for index, (name, shape) in enumerate(full_model_shapes(m)):
        values = torch.randn(shape, generator=g, dtype=torch.float32) + (index + 1) * 0.125
        full[name] = values.to(m.dtype)
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


def checkpoint_dir_name(iteration: int, release: bool) -> str:
    """``release`` or ``iter_{iteration:07d}``."""
    return "release" if release else f"iter_{iteration:07d}"


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    """``mp_rank_{tp:02d}`` when pp == 1, else ``mp_rank_{tp:02d}_{pp:03d}``."""
    if pp == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


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
) -> argparse.Namespace:
    """The ``args`` Namespace stored in every rank file."""
    return argparse.Namespace(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=1,
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
        virtual_pipeline_model_parallel_size=None,
        num_experts=None,
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


def _slice_fc1(m: TinyModel, full: torch.Tensor, t: int, tp: int) -> torch.Tensor:
    """linear_fc1 (weight or bias) rows for tp rank t; swiglu: cat(gate chunk, up chunk)."""
    F = m.ffn_hidden_size
    assert F % tp == 0, (F, tp)
    step = F // tp
    if m.swiglu:
        gate = full[:F]
        up = full[F : 2 * F]
        return torch.cat([gate[t * step : (t + 1) * step], up[t * step : (t + 1) * step]], dim=0)
    return full[t * step : (t + 1) * step]


def _layer_local_state(
    m: TinyModel, full: dict[str, torch.Tensor], L: int, t: int, tp: int
) -> list[tuple[str, torch.Tensor | None]]:
    """(layer-relative stored name, value) pairs of global layer L for tp rank t."""
    p = f"decoder.layers.{L}."
    te = m.transformer_impl == "transformer_engine"
    out: list[tuple[str, torch.Tensor | None]] = []

    def put(local_name: str, value: torch.Tensor) -> None:
        out.append((_TE_RENAMES.get(local_name, local_name) if te else local_name, value))

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
    put("mlp.linear_fc1.weight", _slice_fc1(m, full[p + "mlp.linear_fc1.weight"], t, tp))
    if m.add_bias_linear:
        put("mlp.linear_fc1.bias", _slice_fc1(m, full[p + "mlp.linear_fc1.bias"], t, tp))
    extra_state("mlp.linear_fc1")
    put("mlp.linear_fc2.weight", _chunk(full[p + "mlp.linear_fc2.weight"], 1, t, tp))
    if m.add_bias_linear:
        put("mlp.linear_fc2.bias", full[p + "mlp.linear_fc2.bias"])
    extra_state("mlp.linear_fc2")
    return out


def _rank_state_dict(
    m: TinyModel,
    full: dict[str, torch.Tensor],
    t: int,
    tp: int,
    p: int,
    pp: int,
    layers: range,
) -> OrderedDict[str, torch.Tensor | None]:
    """Local model state dict of tp rank t, pp stage p."""
    padded = padded_vocab_size(m, tp)
    sd: OrderedDict[str, torch.Tensor | None] = OrderedDict()
    is_first = p == 0
    is_last = p == pp - 1
    if is_first:
        emb = _pad_vocab_rows(full["embedding.word_embeddings.weight"], padded)
        sd["embedding.word_embeddings.weight"] = _own(_chunk(emb, 0, t, tp))
        if m.position_embedding_type == "learned_absolute":
            sd["embedding.position_embeddings.weight"] = _own(full["embedding.position_embeddings.weight"])
    for local_index, L in enumerate(layers):
        for name, value in _layer_local_state(m, full, L, t, tp):
            sd[f"decoder.layers.{local_index}.{name}"] = None if value is None else _own(value)
    if is_last:
        sd["decoder.final_layernorm.weight"] = _own(full["decoder.final_layernorm.weight"])
        if m.has_norm_bias:
            sd["decoder.final_layernorm.bias"] = _own(full["decoder.final_layernorm.bias"])
        if not m.tied_embeddings:
            out = _pad_vocab_rows(full["output_layer.weight"], padded)
            sd["output_layer.weight"] = _own(_chunk(out, 0, t, tp))
        elif pp > 1:
            emb = _pad_vocab_rows(full["embedding.word_embeddings.weight"], padded)
            sd["output_layer.weight"] = _own(_chunk(emb, 0, t, tp))
    return sd


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
) -> Path:
    """Write ``full`` as a Megatron legacy per-rank checkpoint at TP=tp, PP=pp; returns root."""
    root = Path(root)
    expected = {name for name, _ in full_model_shapes(m)}
    assert set(full) == expected, sorted(set(full) ^ expected)
    ranges = stage_layer_ranges(m.num_layers, pp, first, last)
    args = make_args(m, tp, pp, first, last, iteration)
    ckpt_dir = root / checkpoint_dir_name(iteration, release)
    for p in range(pp):
        for t in range(tp):
            rank_dir = ckpt_dir / rank_dir_name(t, p, pp)
            rank_dir.mkdir(parents=True, exist_ok=True)
            payload = {
                "args": args,
                "checkpoint_version": 3.0,
                "iteration": iteration,
                "model": _rank_state_dict(m, full, t, tp, p, pp, ranges[p]),
            }
            torch.save(payload, rank_dir / CHECKPOINT_FILE)
    (root / TRACKER_FILE).write_text("release" if release else str(iteration))
    return root


# --------------------------------------------------------------------------- reader / merge

_RANK_DIR_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


def load_rank_file(path: Path) -> dict[str, object]:
    """torch.load a rank file with weights_only=True (argparse.Namespace allow-listed)."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)


def resolve_checkpoint_dir(root: Path) -> Path:
    """The iteration directory named by ``latest_checkpointed_iteration.txt``."""
    root = Path(root)
    text = (root / TRACKER_FILE).read_text().strip()
    if text == "release":
        return root / "release"
    return root / checkpoint_dir_name(int(text), False)


def read_megatron_checkpoint(
    root: Path,
) -> tuple[argparse.Namespace, dict[tuple[int, int], dict[str, torch.Tensor]]]:
    """Raw per-(tp_rank, pp_rank) model dicts plus the args of rank (0, 0)."""
    ckpt_dir = resolve_checkpoint_dir(root)
    models: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    all_args: dict[tuple[int, int], argparse.Namespace] = {}
    dir_names: dict[tuple[int, int], str] = {}
    for entry in sorted(ckpt_dir.iterdir()):
        match = _RANK_DIR_RE.match(entry.name)
        if match is None or not entry.is_dir():
            continue
        key = (int(match.group(1)), int(match.group(2) or 0))
        assert key not in models, entry
        payload = load_rank_file(entry / CHECKPOINT_FILE)
        models[key] = payload["model"]  # type: ignore[assignment]
        all_args[key] = payload["args"]  # type: ignore[assignment]
        dir_names[key] = entry.name
    assert (0, 0) in models, f"no rank files under {ckpt_dir}"
    args = all_args[(0, 0)]
    tp = args.tensor_model_parallel_size
    pp = args.pipeline_model_parallel_size
    assert set(models) == {(t, p) for t in range(tp) for p in range(pp)}, sorted(models)
    for key, name in dir_names.items():
        assert name == rank_dir_name(key[0], key[1], pp), (name, pp)
        assert vars(all_args[key]) == vars(args), f"args of {name} differ from rank (0, 0)"
    return args, models


def _replicated(pieces: list[torch.Tensor], name: str) -> torch.Tensor:
    """A tensor that every tp rank holds in full: check they agree, return one."""
    for i, piece in enumerate(pieces[1:], start=1):
        assert torch.equal(piece, pieces[0]), f"{name}: tp rank {i} differs from tp rank 0"
    return pieces[0]


def _merge_qkv(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Rank t holds query groups [t*ng/tp, (t+1)*ng/tp) contiguously: concatenate rows."""
    return torch.cat(pieces, dim=0)


def _merge_fc1(m: TinyModel, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Undo fc1 slicing; swiglu: each piece is [gate_t; up_t], full is [gates...; ups...]."""
    if not m.swiglu:
        return torch.cat(pieces, dim=0)
    gates: list[torch.Tensor] = []
    ups: list[torch.Tensor] = []
    for piece in pieces:
        half = piece.shape[0] // 2
        assert piece.shape[0] == 2 * half
        gates.append(piece[:half])
        ups.append(piece[half:])
    return torch.cat(gates + ups, dim=0)


def merge_megatron_checkpoint(root: Path, m: TinyModel) -> dict[str, torch.Tensor]:
    """Reference merge of a legacy checkpoint back to the full model (true vocab rows only)."""
    args, models = read_megatron_checkpoint(root)
    tp: int = args.tensor_model_parallel_size
    pp: int = args.pipeline_model_parallel_size
    first: int | None = getattr(args, "decoder_first_pipeline_num_layers", None)
    last: int | None = getattr(args, "decoder_last_pipeline_num_layers", None)
    ranges = stage_layer_ranges(m.num_layers, pp, first, last)
    padded: int = args.padded_vocab_size
    V = m.vocab_size
    te = m.transformer_impl == "transformer_engine"

    consumed: dict[tuple[int, int], set[str]] = {key: set() for key in models}

    def take(p: int, name: str) -> list[torch.Tensor]:
        """Tensor ``name`` from every tp rank of stage p, marking it consumed."""
        pieces: list[torch.Tensor] = []
        for t in range(tp):
            sd = models[(t, p)]
            assert name in sd, f"missing {name} on tp {t} pp {p}"
            consumed[(t, p)].add(name)
            pieces.append(sd[name])
        return pieces

    def layer_name(local_name: str) -> str:
        return _TE_RENAMES.get(local_name, local_name) if te else local_name

    merged: dict[str, torch.Tensor] = {}

    # stage 0: embeddings
    emb = torch.cat(take(0, "embedding.word_embeddings.weight"), dim=0)
    assert emb.shape[0] == padded, (tuple(emb.shape), padded)
    merged["embedding.word_embeddings.weight"] = emb[:V].clone()
    if m.position_embedding_type == "learned_absolute":
        merged["embedding.position_embeddings.weight"] = _replicated(
            take(0, "embedding.position_embeddings.weight"), "embedding.position_embeddings.weight"
        ).clone()

    # layers
    for p, layers in enumerate(ranges):
        for local_index, L in enumerate(layers):
            src = f"decoder.layers.{local_index}."
            dst = f"decoder.layers.{L}."

            def rep(local_name: str) -> None:
                merged[dst + local_name] = _replicated(take(p, src + layer_name(local_name)), dst + local_name)

            rep("input_layernorm.weight")
            if m.has_norm_bias:
                rep("input_layernorm.bias")
            merged[dst + "self_attention.linear_qkv.weight"] = _merge_qkv(
                take(p, src + "self_attention.linear_qkv.weight")
            )
            if m.has_qkv_bias:
                merged[dst + "self_attention.linear_qkv.bias"] = _merge_qkv(
                    take(p, src + "self_attention.linear_qkv.bias")
                )
            if m.qk_layernorm:
                rep("self_attention.q_layernorm.weight")
                if m.has_norm_bias:
                    rep("self_attention.q_layernorm.bias")
                rep("self_attention.k_layernorm.weight")
                if m.has_norm_bias:
                    rep("self_attention.k_layernorm.bias")
            merged[dst + "self_attention.linear_proj.weight"] = torch.cat(
                take(p, src + "self_attention.linear_proj.weight"), dim=1
            )
            if m.add_bias_linear:
                rep("self_attention.linear_proj.bias")
            rep("pre_mlp_layernorm.weight")
            if m.has_norm_bias:
                rep("pre_mlp_layernorm.bias")
            merged[dst + "mlp.linear_fc1.weight"] = _merge_fc1(m, take(p, src + "mlp.linear_fc1.weight"))
            if m.add_bias_linear:
                merged[dst + "mlp.linear_fc1.bias"] = _merge_fc1(m, take(p, src + "mlp.linear_fc1.bias"))
            merged[dst + "mlp.linear_fc2.weight"] = torch.cat(take(p, src + "mlp.linear_fc2.weight"), dim=1)
            if m.add_bias_linear:
                rep("mlp.linear_fc2.bias")
            if te:
                for module in _TE_EXTRA_STATE_MODULES:
                    for t in range(tp):
                        name = src + module + "._extra_state"
                        assert name in models[(t, p)], f"missing {name} on tp {t} pp {p}"
                        consumed[(t, p)].add(name)

    # last stage: final norm and output layer
    p_last = pp - 1
    merged["decoder.final_layernorm.weight"] = _replicated(
        take(p_last, "decoder.final_layernorm.weight"), "decoder.final_layernorm.weight"
    ).clone()
    if m.has_norm_bias:
        merged["decoder.final_layernorm.bias"] = _replicated(
            take(p_last, "decoder.final_layernorm.bias"), "decoder.final_layernorm.bias"
        ).clone()
    if not m.tied_embeddings:
        out = torch.cat(take(p_last, "output_layer.weight"), dim=0)
        assert out.shape[0] == padded, (tuple(out.shape), padded)
        merged["output_layer.weight"] = out[:V].clone()
    elif pp > 1:
        out = torch.cat(take(p_last, "output_layer.weight"), dim=0)
        assert torch.equal(out, emb), "tied output_layer copy on last stage differs from embedding"
    else:
        for t in range(tp):
            assert "output_layer.weight" not in models[(t, 0)], "tied pp=1 must not store output_layer"

    # nothing unexpected left over
    for key, sd in models.items():
        leftover = set(sd) - consumed[key]
        assert not leftover, f"unexpected keys on (tp, pp) {key}: {sorted(leftover)}"

    order = [name for name, _ in full_model_shapes(m)]
    assert set(merged) == set(order), sorted(set(merged) ^ set(order))
    return {name: merged[name] for name in order}
