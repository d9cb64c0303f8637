"""A PEFT adapter merged into a source's canonical tensors: ``W' = W + (B @ A) * scaling``.

Each adapted HF weight is one part of a canonical tensor (a fused ``linear_qkv`` is q, k and v
regrouped by query group; ``linear_fc1`` is gate and up): the canonical delta is the family's own
transform applied to the parts' deltas (zeros for a part without an adapter), which is exact because
those transforms only move rows. A piece of the tensor gets the same piece of the delta, cut by the
piece's own rule, so a merge works at any destination layout without gathering more than one
tensor's delta. The sum is computed in float32 and rounded once to the tensor's stored dtype.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from pgconvert.adapters.peft import PeftAdapter, read_peft_adapter
from pgconvert.errors import ValidationError
from pgconvert.families import mtp
from pgconvert.families.table import Family, TensorMapping
from pgconvert.formats.hf import infer_family
from pgconvert.formats.stream import CanonicalSource
from pgconvert.model.provider import VOCAB_TABLES
from pgconvert.model.rules import ShardRule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Target:
    """A canonical tensor some adapter pairs change: its table row and the HF weights it is made of."""

    row: TensorMapping
    hf_names: tuple[str, ...]
    part_shapes: tuple[tuple[int, ...], ...]


class AdapterMerge:
    """The adapter's deltas by canonical tensor of one source, checked against its shapes."""

    def __init__(self, adapter: PeftAdapter, source: CanonicalSource) -> None:
        self.adapter = adapter
        self._source = source
        self.family = source.hf_origin.family if source.hf_origin is not None else infer_family(source.config)
        self._targets = self._find_targets()

    def __contains__(self, name: str) -> bool:
        return name in self._targets

    @property
    def targets(self) -> list[str]:
        return list(self._targets)

    def _find_targets(self) -> dict[str, _Target]:
        config = self._source.config
        wanted = set(self.adapter.pairs)
        targets: dict[str, _Target] = {}
        for name in self._source.names():
            found = self.family.tensors.to_hf(mtp.table_name(name, config))
            if found is None or not wanted.intersection(found[1]):
                continue
            row, hf_names = found
            self._refuse_unmergeable(name, row, hf_names)
            shapes = tuple(row.transform.part_shapes(self._source.meta(name).shape, config))
            for hf, shape in zip(hf_names, shapes, strict=True):
                if hf in wanted and self.adapter.pairs[hf].shape != tuple(shape):
                    raise ValidationError(f"{self.adapter.where}: {hf}: the adapter's delta is "
                                          f"{list(self.adapter.pairs[hf].shape)}, the model's weight {list(shape)}: an "
                                          "adapter trained for another base model")
            targets[name] = _Target(row, hf_names, shapes)
        matched = {hf for target in targets.values() for hf in target.hf_names}
        unmatched = sorted(wanted - matched)
        if unmatched:
            raise ValidationError(f"{self.adapter.where}: adapts {unmatched[:4]}{' …' if len(unmatched) > 4 else ''}, "
                                  f"which the model ({self.family.architecture}, {config.num_layers} layers) "
                                  "does not have as a linear weight")
        return targets

    def _refuse_unmergeable(self, name: str, row: TensorMapping, hf_names: tuple[str, ...]) -> None:
        config = self._source.config
        why = None
        if name in VOCAB_TABLES:
            why = "the vocab tables are not merged (their padding rows depend on the layout)"
        elif row.stacked:
            why = "experts stored stacked are not merged"
        elif len(self._source.meta(name).shape) != 2:
            why = "only matrices are merged"
        elif config.positions.rotary_interleaved and not self.family.hf_rotary_interleaved:
            why = "the source's rotary rows are interleaved, the adapter's in rotate-half order"
        if why is not None:
            raise ValidationError(f"{self.adapter.where}: adapts {', '.join(hf_names)} (pgconvert's {name}): {why}")

    def delta(self, name: str) -> torch.Tensor:
        """The canonical tensor's whole delta, float32."""
        target = self._targets[name]
        parts = [self.adapter.delta(hf) if hf in self.adapter.pairs else torch.zeros(shape, dtype=torch.float32)
                 for hf, shape in zip(target.hf_names, target.part_shapes, strict=True)]
        return target.row.transform.fuse(parts, self._source.config)

    def merged(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The whole canonical tensor plus its delta, rounded once to its dtype."""
        return (tensor.to(torch.float32) + self.delta(name)).to(tensor.dtype)

    def merged_piece(self, name: str, piece: torch.Tensor, rule: ShardRule, size: int, rank: int) -> torch.Tensor:
        """Piece ``rank`` of ``size`` under ``rule`` plus the same piece of the delta."""
        delta = rule.reshard_rows([self.delta(name)], None, None, size, rank)
        return (piece.to(torch.float32) + delta).to(piece.dtype)


def attach_adapter(source: CanonicalSource, directory: Path, keep_quantized: bool) -> None:
    """Read the PEFT adapter in ``directory`` and merge it into ``source``'s tensors as they are read."""
    if keep_quantized:
        raise ValidationError(f"--merge-adapter {directory} with --keep-fp8: a merged weight is not the stored "
                              "quantized one; drop --keep-fp8 to merge into the dequantized weights")
    merge = AdapterMerge(read_peft_adapter(directory), source)
    source.adapter = merge
    log.info("merging the LoRA adapter in %s into %d tensors of %s", directory, len(merge.targets), source.describe())
