"""A PEFT adapter merged into a source's canonical tensors: ``W' = W + (B @ A) * scaling``, or for DoRA
``W' = m / ||W + delta||_row * (W + delta)``.

Each adapted HF weight is one part of a canonical tensor (a fused ``linear_qkv`` is q, k and v
regrouped by query group; ``linear_fc1`` is gate and up): the canonical delta is the family's own
transform applied to the parts' deltas (zeros for a part without an adapter), which is exact because
those transforms only move rows. A piece of the tensor gets the same piece of the delta, cut by the
piece's own rule, so a merge works at any destination layout without gathering more than one
tensor's delta. The sum is computed in float32 and rounded once to the tensor's stored dtype.

DoRA's norm is taken of each output row over the whole input dimension, as PEFT's ``get_weight_norm`` takes it
(``torch.linalg.norm(W + delta, dim=1)``, float32), so it needs whole rows: it is computed once per canonical tensor
from the whole stored tensor plus its delta, and each piece (a row-parallel piece holds some columns of every row)
is scaled by its rows' ``m / norm``. The HF parts of a fused tensor are rows of it, so the canonical tensor's row
norms are the parts' row norms; each part's magnitude divides its own rows (a part without a pair keeps scale 1).
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pgconvert.adapters.megatron import as_peft_adapter, find_adapter_store, moves_rows, read_megatron_adapter
from pgconvert.adapters.names import loaded_hf_weights, source_family
from pgconvert.adapters.peft import ExpertsPair, PeftAdapter, is_adapter_directory, read_peft_adapter
from pgconvert.errors import PgconvertError, ValidationError
from pgconvert.families.table import TensorMapping
from pgconvert.formats.stream import CanonicalSource
from pgconvert.model.provider import VOCAB_TABLES
from pgconvert.model.rules import ShardRule

log = logging.getLogger(__name__)
# An expert's weight as HF stores it one by one: ``<experts module>.<expert>.<linear>.weight``.
_EXPERT_WEIGHT = re.compile(r"(.+)\.(\d+)\.\w+\.weight")


@dataclass(frozen=True)
class _Target:
    """A canonical tensor some adapter pairs change: its table row and the HF weights it is made of."""

    row: TensorMapping
    hf_names: tuple[str, ...]
    part_shapes: tuple[tuple[int, ...], ...]
    # For one expert of a fused experts parameter's pair: the pair, the expert, how many, the scaling.
    expert: tuple[ExpertsPair, int, int, float] | None = None
    # Whether the adapter file holds a whole weight for one of the parts, and a pair for one.
    replaced: bool = False
    has_delta: bool = True
    # Whether its pairs are DoRA's: the merged rows are scaled by magnitude / row norm.
    dora: bool = False


class AdapterMerge:
    """The adapter's deltas by canonical tensor of one source, checked against its shapes."""

    def __init__(self, adapter: PeftAdapter, source: CanonicalSource) -> None:
        self.adapter = adapter
        self._source = source
        self.family = source_family(source)
        self._targets = self._find_targets()
        self._targets.update(self._find_expert_targets())

    def __contains__(self, name: str) -> bool:
        return name in self._targets

    @property
    def targets(self) -> list[str]:
        return list(self._targets)

    def _find_targets(self) -> dict[str, _Target]:
        config = self._source.config
        wanted = set(self.adapter.pairs) | set(self.adapter.replacements)
        targets: dict[str, _Target] = {}
        for name in self._source.names():
            found = self._to_hf(name)
            if found is None or not wanted.intersection(found[1]):
                continue
            row, hf_names = found
            self._refuse_unmergeable(name, row, hf_names)
            shapes = self._part_shapes(name, row)
            for hf, shape in zip(hf_names, shapes, strict=True):
                self._check_shape(hf, shape)
            dora = any(self.adapter.pairs[hf].magnitude_key is not None for hf in hf_names if hf in self.adapter.pairs)
            if dora:
                self._refuse_unscalable(name, row, hf_names)
            targets[name] = _Target(row, hf_names, shapes, replaced=bool(self.adapter.replacements.keys() & hf_names),
                                    has_delta=bool(self.adapter.pairs.keys() & hf_names), dora=dora)
        matched = {hf for target in targets.values() for hf in target.hf_names}
        unmatched = sorted(wanted - matched)
        if unmatched:
            raise ValidationError(f"{self.adapter.where}: adapts {unmatched[:4]}{' …' if len(unmatched) > 4 else ''}, "
                                  f"which the model ({self.family.architecture}, {config.num_layers} layers) "
                                  "does not have as a weight")
        return targets

    def _part_shapes(self, name: str, row: TensorMapping) -> tuple[tuple[int, ...], ...]:
        """The HF weights' shapes (a vocab table's: the true vocab's rows, not the source's padding)."""
        shape = self._source.meta(name).shape
        if name in VOCAB_TABLES:
            return ((self._source.config.vocab_size, *shape[1:]),)
        return tuple(tuple(part) for part in row.transform.part_shapes(shape, self._source.config))

    def _check_shape(self, hf: str, shape: tuple[int, ...]) -> None:
        pair = self.adapter.pairs.get(hf)
        saved = self.adapter.replacements.get(hf)
        given = pair.shape if pair is not None else saved.shape if saved is not None else None
        if given is not None and tuple(given) != tuple(shape):
            what = "delta" if pair is not None else "saved weight"
            raise ValidationError(f"{self.adapter.where}: {hf}: the adapter's {what} is {list(given)}, the model's "
                                  f"weight {list(shape)}: an adapter trained for another base model (or a resized "
                                  "vocabulary)")

    def _refuse_unscalable(self, name: str, row: TensorMapping, hf_names: tuple[str, ...]) -> None:
        """DoRA scales whole rows: refused on a vocab table (its padding rows) and where the family's transform does
        more than move the HF parts' rows."""
        shape = tuple(self._source.meta(name).shape)
        if name in VOCAB_TABLES or not moves_rows(row.transform, shape, self._source.config):
            raise ValidationError(f"{self.adapter.where}: DoRA on {', '.join(hf_names)} (pgconvert's {name}) is not "
                                  "merged: its rows are not the canonical tensor's rows"
                                  + (" (a vocab table, padded)" if name in VOCAB_TABLES else ""))

    def _find_expert_targets(self) -> dict[str, _Target]:
        """Each expert's tensor that a fused experts parameter's pair changes, found by the pair's module (the
        HF experts' common prefix) and the per-expert delta's shape."""
        if not self.adapter.experts_pairs:
            return {}
        by_module = self._stored_experts()
        targets: dict[str, _Target] = {}
        for pair in self.adapter.experts_pairs:
            experts = by_module.get(pair.module)
            if not experts or pair.a_shape[0] % len(experts):
                raise ValidationError(
                    f"{self.adapter.where}: adapts the parameters of {pair.module} ({len(experts or ())} experts "
                    f"for lora_A's {pair.a_shape[0]} rows), which the model ({self.family.architecture}) does not "
                    "have as experts stored one by one")
            for expert, tensors in experts.items():
                name, target = self._expert_target(pair, expert, len(experts), tensors)
                targets[name] = target
        return targets

    def _stored_experts(self) -> dict[str, dict[int, list[tuple[str, TensorMapping, tuple[str, ...]]]]]:
        """The source's expert tensors by their HF module prefix (``model.layers.3.mlp.experts``) and expert."""
        found: dict[str, dict[int, list[tuple[str, TensorMapping, tuple[str, ...]]]]] = {}
        for name in self._source.names():
            mapped = self._to_hf(name)
            match = _EXPERT_WEIGHT.fullmatch(mapped[1][0]) if mapped is not None else None
            if match is not None and all(hf.startswith(f"{match[1]}.{match[2]}.") for hf in mapped[1]):
                found.setdefault(match[1], {}).setdefault(int(match[2]), []).append((name, *mapped))
        return found

    def _expert_target(self, pair: ExpertsPair, expert: int, count: int,
                       tensors: list[tuple[str, TensorMapping, tuple[str, ...]]]) -> tuple[str, _Target]:
        shape = (pair.b_shape[0], pair.a_shape[1])
        fitting = [tensor for tensor in tensors if self._source.meta(tensor[0]).shape == shape]
        if len(fitting) != 1:
            raise ValidationError(f"{self.adapter.where}: {pair.module}: an expert's delta is {list(shape)}, which "
                                  f"{'none' if not fitting else 'more than one'} of expert {expert}'s weights "
                                  f"{[list(self._source.meta(t[0]).shape) for t in tensors]} has")
        name, row, hf_names = fitting[0]
        self._refuse_unmergeable(name, row, hf_names)
        rank, parameter = pair.a_shape[0] // count, self._parameter(pair, name)
        given = self.adapter.settings.rank(parameter)
        if given != rank:
            raise ValidationError(f"{self.adapter.where}: {parameter}: lora_A's {pair.a_shape[0]} rows over {count} "
                                  f"experts are rank {rank}, adapter_config.json gives r={given}")
        shapes = tuple(row.transform.part_shapes(shape, self._source.config))
        return name, _Target(row, hf_names, shapes, (pair, expert, count,
                                                     self.adapter.settings.scaling(parameter, rank)))

    def _parameter(self, pair: ExpertsPair, name: str) -> str:
        """The fused parameter a pair adapts, ``<module>.<target_parameters name>``: ``down`` for linear_fc2."""
        down = name.endswith("linear_fc2.weight")
        names = [short for short in self.adapter.settings.parameters if ("down" in short) == down]
        if len(names) != 1:
            raise ValidationError(f"{self.adapter.where}: {pair.module}: target_parameters "
                                  f"{list(self.adapter.settings.parameters)} do not say which one adapts {name}")
        return f"{pair.module}.{names[0]}"

    def _to_hf(self, name: str) -> tuple[TensorMapping, tuple[str, ...]] | None:
        return loaded_hf_weights(self.family, name, self._source.config)

    def _refuse_unmergeable(self, name: str, row: TensorMapping, hf_names: tuple[str, ...]) -> None:
        config = self._source.config
        paired = bool(self.adapter.pairs.keys() & hf_names)
        why = None
        if row.stacked:
            why = "experts stored stacked are not merged"
        elif paired and len(self._source.meta(name).shape) != 2:
            why = "only matrices are merged"
        elif config.positions.rotary_interleaved and not self.family.hf_rotary_interleaved:
            why = "the source's rotary rows are interleaved, the adapter's in rotate-half order"
        elif (config.norms.layernorm_zero_centered_gamma and not self.family.hf_norms_zero_centred
              and len(self._source.meta(name).shape) == 1):
            why = "the source's norms are zero-centred (1 + gamma), the adapter's saved ones are not"
        if why is not None:
            raise ValidationError(f"{self.adapter.where}: adapts {', '.join(hf_names)} (pgconvert's {name}): {why}")

    def delta(self, name: str) -> torch.Tensor:
        """The canonical tensor's whole delta, float32 (a vocab table's padding rows zero)."""
        target = self._targets[name]
        if target.expert is not None:  # transformers' fused parameter holds the HF parts' rows back to back
            whole = self.adapter.expert_delta(*target.expert)
            parts = list(whole.split([shape[0] for shape in target.part_shapes], dim=0))
            return target.row.transform.fuse(parts, self._source.config)
        parts = [self.adapter.delta(hf) if hf in self.adapter.pairs else torch.zeros(shape, dtype=torch.float32)
                 for hf, shape in zip(target.hf_names, target.part_shapes, strict=True)]
        if name in VOCAB_TABLES:
            rows = self._source.meta(name).shape[0]
            return torch.nn.functional.pad(parts[0], (0, 0, 0, rows - parts[0].shape[0]))
        return target.row.transform.fuse(parts, self._source.config)

    def needs_whole(self, name: str) -> bool:
        """Whether a piece of ``name`` is made from the whole tensor (a saved weight takes the place of a part)."""
        return self._targets[name].replaced

    def merged(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The whole canonical tensor with its saved weights in place and its delta added, rounded once to its
        dtype."""
        target = self._targets[name]
        base = self._replaced(name, tensor) if target.replaced else tensor
        if not target.has_delta:
            return base
        summed = base.to(torch.float32) + self.delta(name)
        return (self._row_scales(name, summed) * summed if target.dora else summed).to(tensor.dtype)

    def merged_piece(self, name: str, piece: torch.Tensor, rule: ShardRule, size: int, rank: int,
                     rows: int | None) -> torch.Tensor:
        """Piece ``rank`` of ``size`` under ``rule`` plus the same piece of the delta (``rows``: a vocab table's
        padded rows, as the piece was cut)."""
        vocab = self._source.config.vocab_size
        summed = piece.to(torch.float32) + rule.reshard_rows([self.delta(name)], rows, vocab, size, rank)
        if self._targets[name].dora:  # each element's row scale, cut as the piece was
            scales = self._whole_row_scales(name).expand(tuple(self._source.meta(name).shape))
            summed = rule.reshard_rows([scales], rows, vocab, size, rank) * summed
        return summed.to(piece.dtype)

    @functools.lru_cache(maxsize=4)  # noqa: B019 - one adapter per conversion; a tensor's pieces are read together
    def _whole_row_scales(self, name: str) -> torch.Tensor:
        """``_row_scales`` of the whole stored tensor: computed once for all of its pieces."""
        return self._row_scales(name, self._source.load_base(name).to(torch.float32) + self.delta(name))

    def _row_scales(self, name: str, summed: torch.Tensor) -> torch.Tensor:
        """DoRA's ``m / ||W + delta||`` per row of the canonical tensor (``summed``: ``W + delta``, float32), a
        column ``[rows, 1]``: each HF part's magnitude over its own rows' norms (PEFT's ``get_weight_norm``, over
        the input dimension), 1 for a part without a pair."""
        target, config = self._targets[name], self._source.config
        norms = target.row.transform.split(torch.linalg.norm(summed, dim=1).unsqueeze(1), config)
        scales = [torch.ones_like(norm) if (magnitude := self._magnitude(hf)) is None else magnitude.unsqueeze(1) / norm
                  for hf, norm in zip(target.hf_names, norms, strict=True)]
        return target.row.transform.fuse(scales, config)

    def magnitude(self, name: str) -> torch.Tensor | None:
        """A DoRA target's magnitudes in the canonical rows' order (zeros for a part without a pair), float32; None
        for a plain LoRA target."""
        target = self._targets[name]
        if not target.dora:
            return None
        columns = [torch.zeros((shape[0], 1)) if (magnitude := self._magnitude(hf)) is None else magnitude.unsqueeze(1)
                   for hf, shape in zip(target.hf_names, target.part_shapes, strict=True)]
        return target.row.transform.fuse(columns, self._source.config)[:, 0]

    def _magnitude(self, hf: str) -> torch.Tensor | None:
        return self.adapter.magnitude(hf) if hf in self.adapter.pairs else None

    def _replaced(self, name: str, base: torch.Tensor) -> torch.Tensor:
        """``base`` with the adapter's saved weights in place of its HF parts (a vocab table: its true rows)."""
        target, config = self._targets[name], self._source.config
        if name in VOCAB_TABLES:
            whole = base.clone()
            whole[:config.vocab_size] = self.adapter.replacement(target.hf_names[0]).to(base.dtype)
            return whole
        parts = target.row.transform.split(base, config)
        saved = [self.adapter.replacement(hf).to(part.dtype) if hf in self.adapter.replacements else part
                 for hf, part in zip(target.hf_names, parts, strict=True)]
        return target.row.transform.fuse(saved, config)


def read_adapter(directory: Path, source: CanonicalSource) -> PeftAdapter:
    """The adapter at ``directory`` as PEFT pairs: a PEFT adapter directory, or a Megatron-Bridge LoRA checkpoint
    put in PEFT's names for ``source``'s family."""
    embedded = source.embedded_adapter
    if not is_adapter_directory(directory) and (find_adapter_store(directory, beside_model=True) is not None or (
            embedded is not None and _same_store(directory, embedded.store))):
        return as_peft_adapter(read_megatron_adapter(directory), source_family(source), source.config)
    return read_peft_adapter(directory)


def attach_adapter(source: CanonicalSource, directory: Path, keep_quantized: bool) -> None:
    """Read the adapter at ``directory`` (PEFT or Megatron-Bridge) and merge it into ``source``'s tensors as they
    are read."""
    if keep_quantized:
        raise ValidationError(f"--merge-adapter {directory} with --keep-fp8: a merged weight is not the stored "
                              "quantized one; drop --keep-fp8 to merge into the dequantized weights")
    merge = AdapterMerge(read_adapter(directory, source), source)
    source.adapter = merge
    log.info("merging the LoRA adapter in %s into %d tensors of %s", directory, len(merge.targets), source.describe())


def attach_adapters(source: CanonicalSource, merge_adapter: Path | None, drop_adapter: bool,
                    keep_quantized: bool) -> None:
    """What a conversion does with adapters: ``--merge-adapter`` merged (``attach_adapter``), and a LoRA adapter the
    checkpoint holds beside its model merged (``--merge-adapter`` names the same checkpoint), left out with a notice
    (``--drop-adapter``) or refused: converting the base alone would lose it without a word."""
    embedded = source.embedded_adapter
    if embedded is None:
        if drop_adapter:
            raise ValidationError(f"--drop-adapter: {source.describe()} holds no LoRA adapter beside its model")
    elif merge_adapter is not None and _same_store(merge_adapter, embedded.store):
        if drop_adapter:
            raise ValidationError(f"--merge-adapter {merge_adapter} with --drop-adapter: the adapter {embedded.store} "
                                  "holds is either merged or left out; pass one of them")
    elif drop_adapter:
        source.notices.append(f"{embedded.store}: the LoRA adapter it holds beside the model ({len(embedded.keys)} "
                              "tensors) is left out (--drop-adapter): the base model alone is converted")
    else:
        raise ValidationError(
            f"{embedded.store}: holds a LoRA adapter beside the model ({len(embedded.keys)} adapter keys, e.g. "
            f"{embedded.keys[0]}): pass --merge-adapter {embedded.store} to merge it, --drop-adapter to convert the "
            f"base model alone, or take the adapter out with 'pgconvert export-adapter {embedded.store} DST'")
    beside = adapter_beside(source)
    if beside is not None and (merge_adapter is None or merge_adapter.resolve() != beside.resolve()):
        source.notices.append(f"{beside}: a PEFT LoRA adapter beside this model is not merged (verl's model merger "
                              "writes a LoRA run's adapter there, unmerged, and the model beside it is the base): "
                              f"pass --merge-adapter {beside} to merge it")
    if merge_adapter is not None:
        attach_adapter(source, merge_adapter, keep_quantized)


# Where verl's model merger writes a LoRA run's adapter, beside the base model it saves (``save_lora_adapter``).
ADAPTER_BESIDE_HF = "lora_adapter"


def adapter_beside(source: CanonicalSource) -> Path | None:
    """The PEFT adapter directory an HF source's directory holds (``lora_adapter/``), None if it holds none."""
    origin = source.hf_origin
    beside = origin.directory / ADAPTER_BESIDE_HF if origin is not None else None
    return beside if beside is not None and is_adapter_directory(beside) else None


def _same_store(directory: Path, store: Path) -> bool:
    """Whether the Megatron checkpoint ``directory`` (a run's or an iteration's) is the store ``store``."""
    from pgconvert.formats.torch_dist import resolve_iteration_dir

    try:
        return resolve_iteration_dir(directory, None)[0].resolve() == store.resolve()
    except (PgconvertError, OSError):
        return False
