"""The canonical stream: global tensors by canonical name, in layer order, produced lazily.

A loader turns a checkpoint into a ``CanonicalSource``; a saver consumes one. Neither knows the
other's format. Sources load one tensor at a time, so no step needs the whole model in memory.
"""

from __future__ import annotations

import argparse
import io
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy
import torch

from pgconvert.io import sizes
from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError, ValidationError
from pgconvert.model.rules import ShardRule, window_places

if TYPE_CHECKING:
    from pgconvert.adapters.merge import AdapterMerge
    from pgconvert.optimizer.retype import MasterWeights
    from pgconvert.formats.hf import HFOrigin
    from pgconvert.formats.hf_side import SideFiles
    from pgconvert.model.layout import ParallelLayout
    from pgconvert.optimizer.source import OptimizerSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedAdapter:
    """The LoRA adapter a checkpoint holds beside its model: the store it is in and its tensor keys."""

    store: Path
    keys: tuple[str, ...]


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a global tensor, known without loading it."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return sizes.nbytes(self.shape, self.dtype)


@dataclass
class ExtraState:
    """Opaque per-rank module state (Transformer Engine's FP8 metadata): meaningful only at the
    TP and EP sizes it was saved with, so it is carried per (tp rank, ep rank) and never merged."""

    tp_size: int
    ep_size: int = 1
    by_rank: dict[tuple[int, int], object] = field(default_factory=dict)

    def holds_state(self) -> bool:
        """Whether any rank's entry carries something (see ``holds_state``)."""
        return holds_state(self.by_rank.values())


def holds_state(values: Iterable[object]) -> bool:
    """Whether any of a module's ``_extra_state`` values carries something (Transformer Engine's FP8
    metadata), rather than None or an empty tensor or buffer (the local spec's linears)."""
    for value in values:
        if value is None or (isinstance(value, torch.Tensor) and value.numel() == 0):
            continue
        if isinstance(value, io.BytesIO) and len(value.getbuffer()) == 0:
            continue
        return True
    return False


# Elements looked at a time for NaN/Inf: the chunk and its masked copy stay in the CPU's cache.
FINITE_CHECK_CHUNK = 1 << 19
# Per floating dtype, how its bits show a non-finite value: viewed as the signed integer ``bits`` of its
# width with the sign bit cleared (``mask``), a value is NaN or Inf iff it is at least ``least`` (the
# exponent all ones; e4m3fn has no Inf and its only NaN is S.1111.111; e5m2 is IEEE-like).
_NONFINITE_BITS: dict[torch.dtype, tuple[torch.dtype, int, int]] = {
    torch.float64: (torch.int64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000),
    torch.float32: (torch.int32, 0x7FFF_FFFF, 0x7F80_0000),
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.float8_e4m3fn: (torch.uint8, 0x7F, 0x7F),
    torch.float8_e5m2: (torch.uint8, 0x7F, 0x7C),
}


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or Inf among a floating tensor's values, decided on the bits: a chunk at a time, the sign
    bit masked off into a cache-sized scratch and its maximum compared with the exponent's all-ones
    pattern (two integer passes, no float conversion, no tensor-sized mask). The passes run in numpy, on the
    calling thread: torch would hand each chunk to its intra-op thread pool, whose threads spin between the
    thousands of small regions while the other cores read and write. A float type without an entry in
    ``_NONFINITE_BITS`` is widened to float32 a chunk at a time."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return True
    known = _NONFINITE_BITS.get(tensor.dtype)
    if known is None:
        return all(bool(torch.isfinite(flat[start:start + FINITE_CHECK_CHUNK].float()).all())
                   for start in range(0, flat.numel(), FINITE_CHECK_CHUNK))
    bits, mask, least = known
    values = flat.view(bits).numpy()
    scratch = numpy.empty(min(values.size, FINITE_CHECK_CHUNK), dtype=values.dtype)
    for start in range(0, values.size, FINITE_CHECK_CHUNK):
        chunk = values[start:start + FINITE_CHECK_CHUNK]
        masked = scratch[:chunk.size]
        numpy.bitwise_and(chunk, mask, out=masked)
        if int(masked.max()) >= least:
            return False
    return True


def nonfinite_text(tensor: torch.Tensor) -> str | None:
    """How many of a floating tensor's values are NaN or Inf (``"2 of 64 values are NaN or Inf (2 NaN)"``);
    None when it holds none (or is not floating)."""
    if not tensor.is_floating_point() or tensor.numel() == 0 or all_finite(tensor):
        return None
    values = tensor.float() if tensor.element_size() == 1 else tensor
    nans = int(torch.isnan(values).sum())
    infs = int(torch.isinf(values).sum())
    kinds = " and ".join(f"{count} {kind}" for count, kind in ((nans, "NaN"), (infs, "Inf")) if count)
    return f"{nans + infs} of {tensor.numel()} values are NaN or Inf ({kinds})"


def apply_finite_policy(check_finite: str, message: str, notices: list[str]) -> None:
    """The one policy for NaN/Inf found in a source's values (``message`` names them), weights and optimizer
    state alike: refused under ``--check-finite`` (``check_finite="error"``), else logged and noted once."""
    if check_finite == "error":
        raise CheckpointError(f"{message} (refused by --check-finite)")
    log.warning("%s", message)
    notices.append(message)


class CanonicalSource:
    """Base of every loaded checkpoint: names, metadata and lazy tensors in canonical form.

    ``vocab_rows`` is the row count of the vocab tables in this stream: the source's padded table
    (padding rows are kept so same-size targets stay bit-exact) or the true vocab size.

    What a source declares beyond its tensors (each has a default for a format without it):

    - ``layout``: the parallel layout the checkpoint was saved with; ``None`` when it is unsharded
      (hf). A destination of a parallel format starts from it for the sizes the user leaves out.
    - ``megatron_args``: the Megatron-LM args the checkpoint was saved with, which a Megatron
      target carries over (settings pgconvert does not model); ``None`` for other formats.
    - ``hf_origin``: the HF directory, config.json and family the checkpoint came from, which an
      HF target copies; ``None`` for other formats.
    - ``side_files``: the HF side files (tokenizer, generation config) the source carries.
    - ``unrepresentable``: settings of the source a Megatron target cannot hold, each one line
      (refused under ``--strict``, else a notice); empty for a source that has none.
    - ``training_state_notice``: the notice among ``notices`` that says the source's training state is not
      converted, dropped when its optimizer state is carried; None for a source that gives none.
    - ``optimizer_kinds``: the ``args.optimizer`` values whose state its optimizer reader reads (Adam's).

    Training and optimizer state (hooks; the defaults say the source holds none): ``holds_training_state``,
    ``holds_optimizer``, ``stored_optimizer_form``, ``optimizer_refusal`` and ``open_optimizer``.
    """

    format_name: str = "?"
    layout: ParallelLayout | None = None
    megatron_args: argparse.Namespace | None = None
    hf_origin: HFOrigin | None = None
    unrepresentable: Sequence[str] = ()
    training_state_notice: str | None = None
    optimizer_kinds: tuple[str, ...] = ("adam",)

    def __init__(self, config: ModelConfig, vocab_rows: int, iteration: int | None = None,
                 release: bool = False) -> None:
        self.config = config
        self.vocab_rows = vocab_rows
        self.iteration = iteration
        self.release = release
        # The HF side files (tokenizer, config.json, …) the source carries; set by its loader.
        self.side_files: SideFiles | None = None
        self.notices: list[str] = []
        # An adapter merged into the tensors as they are read (pgconvert.adapters.merge; set by the conversion).
        self.adapter: AdapterMerge | None = None
        # A LoRA adapter the checkpoint holds beside the model (set by its loader; its keys are not the model's):
        # what a conversion does with it is ``pgconvert.adapters.merge.attach_adapters``' choice.
        self.embedded_adapter: EmbeddedAdapter | None = None
        # The optimizer's fp32 masters read in place of the stored weights: a run carried to another --dtype
        # (pgconvert.optimizer.retype; set by the conversion).
        self.masters: MasterWeights | None = None
        self.check_finite = "warn"
        self._nonfinite_seen: set[str] = set()
        self._notices_lock = threading.Lock()

    def names(self) -> list[str]:
        raise NotImplementedError

    def meta(self, name: str) -> TensorMeta:
        raise NotImplementedError

    def load(self, name: str) -> torch.Tensor:
        """The full canonical tensor (it may alias the source's memory: do not modify it), with the merged
        adapter's delta added where one changes it."""
        if self.masters is not None and name in self.masters:
            return self._checked(name, self.masters.whole(name))
        tensor = self._load(name)
        if self.adapter is not None and name in self.adapter:
            tensor = self.adapter.merged(name, tensor)
        return self._checked(name, tensor)

    def load_base(self, name: str) -> torch.Tensor:
        """The full canonical tensor as stored, no adapter merged and not yet checked (it may alias the source's
        memory: do not modify it): what a DoRA merge takes its row norms of, and what ``read_pieces`` cuts sibling
        pieces from, checking each."""
        return self._load(name)

    def load_shard(self, name: str, rule: ShardRule, size: int, rank: int,
                   rows: int | None = None) -> torch.Tensor:
        """Piece ``rank`` of ``size`` of a canonical tensor under ``rule``, owning its memory.

        ``rows`` fits a vocab table to a padded row count first.
        """
        if self.masters is not None and name in self.masters:
            return self._checked(name, self.masters.piece(name, rule, size, rank, rows))
        if self.adapter is not None and name in self.adapter:
            if self.adapter.needs_whole(name):  # a saved weight in place of a part: cut from the whole merged tensor
                whole = self.adapter.merged(name, self._load(name))
                return self._checked(name, rule.reshard_rows([whole], rows, self.config.vocab_size, size, rank))
            piece = self.adapter.merged_piece(name, self._load_shard(name, rule, size, rank, rows), rule, size, rank,
                                              rows)
        else:
            piece = self._load_shard(name, rule, size, rank, rows)
        return self._checked(name, piece)

    def shares_piece_reads(self, name: str, rule: ShardRule, size: int, rows: int | None = None) -> bool:
        """Whether reading one of ``size`` pieces of ``name`` under ``rule`` reads (or merges) the stored bytes of
        the others too, so that sibling writers should take them from one read (``formats.sibling_pieces``).

        Never for a tensor read from the optimizer's masters or changed by a merged adapter: those pieces are
        made their own way.
        """
        if size <= 1 or (self.masters is not None and name in self.masters) or (
                self.adapter is not None and name in self.adapter):
            return False
        return self._shares_piece_reads(name, rule, size, rows)

    def _shares_piece_reads(self, name: str, rule: ShardRule, size: int, rows: int | None) -> bool:
        # Formats whose pieces are read apart without reading each other's bytes keep this default.
        return False

    def read_pieces(self, name: str, rule: ShardRule, size: int, pieces: Mapping[int, torch.Tensor],
                    rows: int | None = None) -> None:
        """Fill each of ``pieces`` (piece ``rank`` of ``size``: contiguous, its shape and the tensor's dtype) with
        what ``load_shard`` gives it, from one read of the tensor (for the sibling writers of a TP group:
        ``shares_piece_reads``), each piece checked."""
        self._read_pieces(name, rule, size, pieces, rows)
        for piece in pieces.values():
            self._checked(name, piece)

    def _read_pieces(self, name: str, rule: ShardRule, size: int, pieces: Mapping[int, torch.Tensor],
                     rows: int | None) -> None:
        # The whole tensor as stored, each piece's windows copied from it; formats that can fill them from one
        # pass over their bytes override this.
        whole = self.load_base(name)
        for rank, piece in pieces.items():
            windows = rule.piece_windows(tuple(whole.shape), size, rank, rows, self.config.vocab_size)
            if not windows:
                piece.copy_(whole)
            for window, place in window_places(piece, windows):
                place.copy_(whole.narrow(window.dim, window.start, window.length))

    def _load(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def _load_shard(self, name: str, rule: ShardRule, size: int, rank: int,
                    rows: int | None) -> torch.Tensor:
        # Formats stored in pieces override this to cut the piece straight from their own pieces.
        return rule.reshard_rows([self._load(name)], rows, self.config.vocab_size, size, rank)

    def _checked(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """NaN/Inf are reported once per tensor (``check_finite="warn"``) or refused (``"error"``)."""
        return self._finite_checked(name, tensor, lambda: self.named(name, self.nonfinite_parts(name)))

    def checked_stored(self, part: str, tensor: torch.Tensor) -> torch.Tensor:
        """A stored tensor written out as it is (a quantized part kept by ``--keep-fp8``), under the
        same finiteness policy as the canonical tensors."""
        return self._finite_checked(part, tensor, lambda: part)

    def _finite_checked(self, key: str, tensor: torch.Tensor, label: Callable[[], str]) -> torch.Tensor:
        if self.check_finite == "off" or key in self._nonfinite_seen:
            return tensor
        found = nonfinite_text(tensor)
        if found is None:
            return tensor
        with self._notices_lock:  # two files produced at once (``--threads``) report a tensor once
            if key in self._nonfinite_seen:
                return tensor
            apply_finite_policy(self.check_finite, f"{label()}: {found} in {self.describe()}", self.notices)
            self._nonfinite_seen.add(key)
        return tensor

    def describe(self) -> str:
        """Where this source comes from, for messages."""
        return self.format_name

    def stored_names(self, name: str) -> list[str]:
        """The tensors this source stores that make up canonical tensor ``name``, as its files name them
        (a format whose names differ from the canonical ones overrides this)."""
        return [name]

    def nonfinite_parts(self, name: str) -> list[str]:
        """Of ``stored_names(name)``, those that hold NaN or Inf (all of them where a format cannot tell);
        asked only once a non-finite value is found."""
        return self.stored_names(name)

    def inexact(self, name: str) -> str | None:
        """Why canonical tensor ``name``, as loaded, does not hold every value this source stores for it (a
        transform that computes in the tensor's dtype changed some), asked after it was loaded; None: it does."""
        return None

    @staticmethod
    def named(name: str, stored: list[str]) -> str:
        """A canonical tensor as the source names it, with pgconvert's name beside it where they differ."""
        return name if stored == [name] else f"{', '.join(stored)} (pgconvert's {name})"

    def extra_states(self) -> dict[str, ExtraState]:
        """Opaque ``_extra_state`` entries by canonical name (empty for formats without them)."""
        return {}

    def integrity_problems(self) -> tuple[bool, list[str]]:
        """Whether the checkpoint has an integrity manifest of its files (torch_dist's ``integrity.json``), and
        each listed file that is missing or does not have the digest it records."""
        return False, []

    def has_integrity_manifest(self) -> bool:
        """Whether the checkpoint has an integrity manifest of its files (cheap: whether it is there): its run
        verifies one on load, so a torch_dist destination writes one too."""
        return False

    def holds_training_state(self) -> bool:
        """Whether the checkpoint holds training state a resumed run reads besides the model (optimizer,
        scheduler, RNG): a destination that does not carry it says so only then."""
        return False

    def holds_optimizer(self) -> bool:
        """Whether the checkpoint holds optimizer state (cheap: whether it is there, not whether it reads)."""
        return False

    def stored_optimizer_form(self) -> str | None:
        """The name the format gives the form its optimizer state is stored in, read without opening it
        (None: none, or not known before it is opened)."""
        return None

    def optimizer_refusal(self) -> str | None:
        """Why this source's optimizer state is not carried into any destination, decided before it is
        opened (None: it may be). The text is a notice (``optimizer state not carried: ...``)."""
        return None

    def open_optimizer(self) -> OptimizerSource:
        """The checkpoint's optimizer state, by canonical parameter (``pgconvert.optimizer.source``)."""
        raise ValidationError(f"{self.describe()}: {self.format_name} checkpoints hold no optimizer state "
                              "pgconvert reads")

    def total_bytes(self) -> int:
        return sum(self.meta(name).nbytes for name in self.names())

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.names():
            yield name, self.load(name)

    def close(self) -> None:
        """Release files and mappings; the source is unusable afterwards."""

    def __enter__(self) -> CanonicalSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InMemorySource(CanonicalSource):
    """A canonical source over tensors already in memory (examples, tests, small models)."""

    format_name = "memory"

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], vocab_rows: int | None = None,
                 iteration: int | None = None, release: bool = False) -> None:
        from pgconvert.model.provider import WORD_EMBEDDINGS, canonical_names

        expected = canonical_names(config)
        missing = sorted(set(expected) - set(tensors))
        unexpected = sorted(set(tensors) - set(expected))
        if missing or unexpected:
            raise CheckpointError(f"in-memory model: missing {missing}, unexpected {unexpected}")
        rows = tensors[WORD_EMBEDDINGS].shape[0]
        super().__init__(config, vocab_rows if vocab_rows is not None else rows, iteration, release)
        self._order = expected
        self._tensors = tensors

    def names(self) -> list[str]:
        return list(self._order)

    def meta(self, name: str) -> TensorMeta:
        tensor = self._tensors[name]
        return TensorMeta(tuple(tensor.shape), tensor.dtype)

    def _load(self, name: str) -> torch.Tensor:
        return self._tensors[name]
