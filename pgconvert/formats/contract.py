"""The contract between the orchestrator and format plugins (loaders and savers).

A format plugin subclasses ``Loader`` (a source format) and/or ``Saver`` (a destination format)
and registers it under the ``pgconvert.loaders`` / ``pgconvert.savers`` entry point group (see
``pgconvert.formats.registry``). The abstract methods must be implemented; the others have defaults that
fit a format without that feature (no saved iterations, files written in one pass, no optimizer state).

Optimizer state (megatron-core's, ``pgconvert.optimizer``) goes through declared hooks, whose defaults mean
"this format holds / writes none", so a format without it implements nothing:

- the source a loader opens (``pgconvert.formats.stream.CanonicalSource``) says whether it holds training
  state (``holds_training_state``: a saver names what it does not carry only then) and optimizer state
  (``holds_optimizer``), the name of its stored form (``stored_optimizer_form``), why it cannot be carried
  (``optimizer_refusal``), and opens it (``open_optimizer``: a ``pgconvert.optimizer.source.OptimizerSource``);
- a ``Saver`` declares whether it writes optimizer state (``writes_optimizer``) and the forms
  ``--dst-optim-form`` chooses among (``optimizer_forms``); it refuses what it cannot write
  (``optimizer_refusal``, before the state is opened), names the form it writes an opened state in
  (``optimizer_form``), lists it for ``--dry-run`` (``plan_optimizer``) and writes it after the model
  (``save_optimizer``); one whose model weights are the optimizer's fp32 masters declares ``stores_masters``.
  One whose model files hold optimizer state themselves (Megatron's rank files) declares
  ``optimizer_in_model_files``: the decision is then made while planning, and ``save`` writes the state it finds
  in ``SaveOptions.optimizer`` as it writes each model file (and the files beside it), so no file is written twice.
  ``OptimizerOptions`` carries ``--dst-optim-form`` and ``--dst-dp``. A saver that sets
  ``optimizer_partial`` also writes the state of some files only (``save_optimizer(only=...)``, each process of a
  sharded run its share) and what those shares have in common once (``finalize_optimizer``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pgconvert.model.config import ModelConfig
from pgconvert.errors import LayoutError
from pgconvert.model.layout import ParallelLayout
from pgconvert.formats.names import DTYPE_NAMES
from pgconvert.formats.stream import CanonicalSource

if TYPE_CHECKING:
    from pgconvert.optimizer.source import OptimizerSource

DTYPE_CHOICES: dict[str, torch.dtype | None] = dict(zip(
    DTYPE_NAMES, (None, torch.bfloat16, torch.float16, torch.float32), strict=True))

Progress = Callable[[int], None]

# How ``Loader.iterations`` names a checkpoint saved as a release rather than at an iteration number.
RELEASE = "release"
Iteration = int | str


@dataclass(frozen=True)
class LoadOptions:
    """What the user told us about the source; ``None`` means "detect it"."""

    iteration: int | None = None
    src_tp: int | None = None
    src_pp: int | None = None
    src_ep: int | None = None
    true_vocab_size: int | None = None
    # Refuse instead of guessing (see pgconvert.formats.strict).
    strict: bool = False
    # An hf source's quantized tensors are kept as stored for an hf target (--keep-fp8).
    keep_quantized: bool = False
    # The dtype an hf source's quantized tensors are dequantized to (--dtype; None: bfloat16).
    dequantize_dtype: torch.dtype | None = None
    # How much of the source's integrity manifest (torch_dist's integrity.json) is checked when it has one
    # (``pgconvert.formats.torch_dist_integrity.INTEGRITY_CHECKS``): "full" (every listed file re-hashed:
    # --verify-integrity), "metadata" (the data files found, the others re-hashed) or "off" (a --workers pool's
    # processes, whose source was checked by the process that planned the run; verify, which checks apart).
    verify_integrity: str = "metadata"

    def check_layout(self, layout: ParallelLayout, path: Path) -> None:
        """Refuse a ``--src-tp/pp/ep`` the user gave that the checkpoint's own layout contradicts."""
        for flag, given, found in (("--src-tp", self.src_tp, layout.tp), ("--src-pp", self.src_pp, layout.pp),
                                   ("--src-ep", self.src_ep, layout.ep)):
            if given is not None and given != found:
                raise LayoutError(f"{flag} {given}: the checkpoint's args say {found} ({path})")


@dataclass(frozen=True)
class SaveOptions:
    """How the destination is written."""

    layout: ParallelLayout
    dtype: torch.dtype | None = None
    # Key naming of the target where the format has a choice; None keeps the source's.
    transformer_impl: str | None = None
    expert_layout: str | None = None
    strict: bool = False
    # Largest file a saver that splits its output writes, in bytes; None: the format's default
    # (hf: 5 GB, as transformers' save_pretrained).
    max_shard_size: int | None = None
    # A config.json to write instead of one built from the model (hf); it must describe the model.
    hf_config: Path | None = None
    # HF side files the user gives (pgconvert.formats.hf_side): a generation_config.json, a tokenizer folder.
    generation_config: Path | None = None
    tokenizer: Path | None = None
    # The MTP inner layer's per-rank key (pgconvert.formats.mtp_naming); None keeps the source's.
    mtp_layer_module: str | None = None
    # torch_dist: where the common state goes, "store" (inside the DCP store, as megatron-core >= 0.19 writes it)
    # or "legacy" (common.pt, which megatron-core <= 0.18 reads); names.COMMON_PLACES.
    torch_dist_common: str = "store"
    # torch_dist in the "store" form: also write megatron-core's integrity.json (the sha256 of every file, what
    # ``save(verify_integrity=True)`` and Megatron-LM's --verify-integrity write and their loads require).
    integrity_manifest: bool = False
    # Threads producing independent destination files at once within this process (``--threads``;
    # pgconvert.io.threads): a saver whose files are independent writes up to this many at a time.
    threads: int = 1
    # The optimizer state a saver with ``optimizer_in_model_files`` writes with its model files (set while planning
    # when the conversion carries it; ``pgconvert.optimizer.carry.attach_optimizer``).
    optimizer: OptimizerInModelFiles | None = None


@dataclass(frozen=True)
class OptimizerInModelFiles:
    """The carried optimizer state a saver writes as it writes its model files: the opened state, the form the
    destination writes it in (``Saver.optimizer_form``) and ``--dst-optim-form``/``--dst-dp``."""

    optimizer: OptimizerSource
    form: str
    options: OptimizerOptions




def target_dtype(source_dtype: torch.dtype, requested: torch.dtype | None, keep: bool = False) -> torch.dtype:
    """The dtype a saver writes a tensor in: ``requested`` (``--dtype``) for floating-point tensors
    not ``keep``-ed at their own dtype (e.g. a router's float32 expert bias), else the source's."""
    if requested is None or keep or not source_dtype.is_floating_point:
        return source_dtype
    return requested


def target_config(config: ModelConfig, options: SaveOptions) -> ModelConfig:
    """The source's architecture with the target's key-naming choices applied."""
    changes: dict[str, object] = {}
    if options.transformer_impl is not None:
        changes["transformer_impl"] = options.transformer_impl
    if options.expert_layout is not None:
        changes["moe_grouped_gemm"] = options.expert_layout == "grouped"
    if options.mtp_layer_module is not None:
        changes["mtp_layer_module"] = options.mtp_layer_module
    return config.replace(**changes) if changes else config


@dataclass(frozen=True)
class PlannedFile:
    """One destination file: its path relative to the output root, tensor count and size."""

    relpath: str
    tensors: int
    nbytes: int
    # Filled in by savers for files they wrote: the size on disk and the labelled digest
    # (``pgconvert.io.digest``; None when digests are off), so the manifest need not read the file again.
    digest: str | None = None
    size: int | None = None


@dataclass
class SaveResult:
    files: list[PlannedFile] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)


# How a saver's notice begins that names the training state of the source it does not carry; given only when the
# source holds such state (``CanonicalSource.holds_training_state``), and dropped when the optimizer is carried.
TRAINING_STATE_NOT_CARRIED = "optimizer, scheduler and RNG state are not carried"


@dataclass(frozen=True)
class OptimizerOptions:
    """How a destination writes the optimizer state it carries: ``form`` (``--dst-optim-form``, None: the
    saver's default) and ``dp`` (``--dst-dp``, the data-parallel size it is written for; None: the source's)."""

    form: str | None = None
    dp: int | None = None


@dataclass(frozen=True)
class OptimizerFile:
    """The optimizer state one destination file will hold (``--dry-run``); ``written_with``: the model file
    (a ``Saver.plan`` path) whose process writes it in a sharded run (None: a file of its own there)."""

    relpath: str
    what: str
    tensors: int
    nbytes: int
    written_with: str | None = None


@dataclass
class CarriedOptimizer:
    """What ``Saver.save_optimizer`` wrote: every destination file (``files``: the model saver's, those it
    rewrote without their digest, and those it added), the form as the notice names it, and its own notices."""

    files: list[PlannedFile]
    form: str
    notices: list[str] = field(default_factory=list)


class Loader(ABC):
    """A source format. Subclasses set ``name`` and implement ``detect`` and ``open``; a format
    whose checkpoints hold several saved iterations also implements ``iterations``."""

    name: str = "?"
    # Whether its sources can hand over quantized tensors as stored, with their scales
    # (``LoadOptions.keep_quantized``, ``--keep-fp8``).
    keeps_quantized: bool = False

    @abstractmethod
    def detect(self, path: Path) -> bool:
        """Whether ``path`` is a checkpoint of this format (cheap: file names, no tensor data)."""

    @abstractmethod
    def open(self, path: Path, options: LoadOptions) -> CanonicalSource:
        """The checkpoint at ``path`` as a canonical source (``options.iteration`` picks one)."""

    def iterations(self, path: Path) -> list[Iteration]:
        """The iterations saved under ``path``: numbers ascending, then ``RELEASE`` if present.

        Each entry (``RELEASE`` aside) is a valid ``LoadOptions.iteration``. A path that is itself
        one saved iteration lists just that one. ``inspect`` shows this list and batch plans'
        ``iterations = "all"`` expand it. Default: empty (a format without saved iterations).
        """
        return []


class Saver(ABC):
    """A destination format. ``plan`` must not write anything; ``save`` writes under ``out_dir``."""

    name: str = "?"

    def validate(self, source: CanonicalSource, options: SaveOptions) -> None:
        """Raise a ValidationError when the target cannot be produced from this source."""

    @abstractmethod
    def plan(self, source: CanonicalSource, options: SaveOptions) -> list[PlannedFile]:
        """The files ``save`` will write, without writing anything."""

    # Whether the format has parallel layouts whose files are written independently, one per
    # (tp, pp, ep) rank. A saver of one unsharded model (hf) sets False: the destination layout
    # then starts unsharded instead of from the source's layout.
    parallel: bool = True

    # Whether it writes quantized tensors as a source hands them over, with their scales (``--keep-fp8``).
    keeps_quantized: bool = False

    # Savers that can write any subset of their planned files (``save(only=...)``) and then
    # ``finalize`` the shared metadata support --workers and sharded (multi-process) runs.
    supports_partial: bool = False

    # A saver that writes every floating-point tensor in this dtype whatever ``--dtype`` says (Megatron-FSDP's fp32
    # main weights), ``--dtype`` then naming only the run's precision its args record; None: tensors take ``--dtype``.
    stored_float_dtype: torch.dtype | None = None

    # Savers that write their files on ``SaveOptions.threads`` threads (``pgconvert.io.threads.run_each``);
    # the others write one file at a time whatever ``--threads`` says.
    threaded: bool = False

    # Records a saver leaves to be written from their own memory while it produces the next (``OutputFile.
    # write_in_place``): a file being written holds that many records besides the one being produced.
    records_in_flight: int = 0

    def file_groups(self, source: CanonicalSource, options: SaveOptions) -> list[tuple[str, ...]]:
        """The planned files (relative paths, as ``plan`` names them) its writing tasks produce together, best
        written by one process (megatron: a TP group's rank files, where they share a read;
        ``pgconvert.formats.sibling_pieces``); a file named in none is written alone. Default: none."""
        return []

    @abstractmethod
    def save(self, source: CanonicalSource, out_dir: Path, options: SaveOptions,
             progress: Progress) -> SaveResult:
        """Write the planned files under ``out_dir``, calling ``progress`` with bytes written."""

    def finalize(self, source: CanonicalSource, out_dir: Path, options: SaveOptions) -> list[str]:
        """Write what depends on every file being there (trackers, indexes); returns notices."""
        raise NotImplementedError

    def seal(self, source: CanonicalSource, out_dir: Path, options: SaveOptions,
             files: list[PlannedFile]) -> None:
        """Write what must follow every other file of the destination, the optimizer state's included (torch_dist:
        the integrity manifest), just before the output is renamed into place. ``files``: what was written (a
        file's digest where it was computed on the way). Default: nothing."""

    def file_digest(self, options: SaveOptions) -> str | None:
        """The digest algorithm (``pgconvert.io.digest``) this format records of its own files, computed while they
        are written in place of ``--digest``'s (torch_dist with ``integrity_manifest``: sha256, for
        ``integrity.json``); None (the default): ``--digest``'s."""
        return None

    # Optimizer state (see the module docstring). Whether the format writes megatron-core's optimizer state
    # the source holds, and the forms ``--dst-optim-form`` may name (empty: the format has no choice).
    writes_optimizer: bool = False
    optimizer_forms: tuple[str, ...] = ()
    # The optimizers (``OptimizerRules.kind``) whose state it writes: Adam's by default.
    optimizer_kinds: tuple[str, ...] = ("adam",)
    # Whether the model weights it writes are the optimizer's fp32 masters (Megatron-FSDP's main weights): when it
    # carries a source's optimizer state, the model is read from that state's masters (``CanonicalSource.masters``),
    # not from the source's weights widened.
    stores_masters: bool = False
    # Whether its model files hold the optimizer state themselves (see the module docstring): ``save`` writes the
    # state of ``SaveOptions.optimizer`` into them and beside them, and ``save_optimizer`` only reports those files.
    # Such a saver writes each share's state with its model files, so it declares ``optimizer_partial`` too.
    optimizer_in_model_files: bool = False

    def optimizer_refusal(self, source: CanonicalSource, options: SaveOptions,
                          optimizer_options: OptimizerOptions) -> str | None:
        """Why the source's optimizer state cannot be written here, decided before it is opened (None: it
        can). The text is a notice (``optimizer state not carried: ...``), refused under ``--strict``."""
        return None

    def optimizer_form(self, optimizer: OptimizerSource, optimizer_options: OptimizerOptions) -> str:
        """The form this destination writes the opened ``optimizer`` in; a ``ValidationError`` says why it
        cannot (a notice, refused under ``--strict``). Default: the source's own form."""
        return optimizer.form

    def plan_optimizer(self, source: CanonicalSource, optimizer: OptimizerSource, form: str, options: SaveOptions,
                       optimizer_options: OptimizerOptions) -> list[OptimizerFile]:
        """The destination files' optimizer state in ``form``, without writing anything (``--dry-run``)."""
        return []

    # Whether ``save_optimizer`` writes the state of some files alone (``only``) and ``finalize_optimizer`` the rest:
    # sharded runs carry optimizer state into this format only then.
    optimizer_partial: bool = False

    def save_optimizer(self, source: CanonicalSource, optimizer: OptimizerSource, form: str, out_dir: Path,
                       options: SaveOptions, optimizer_options: OptimizerOptions,
                       files: list[PlannedFile], only: Collection[str] | None = None) -> CarriedOptimizer:
        """Write ``optimizer`` in ``form`` into the destination ``save`` wrote under ``out_dir`` (``files``).

        ``only`` (``optimizer_partial``): the paths of one process's share, model files (``plan``) and optimizer
        files of their own (``plan_optimizer``, ``written_with`` None): write the state that goes into or beside
        them and nothing ``finalize_optimizer`` writes; ``files`` are then the share's."""
        raise NotImplementedError(f"{self.name}: writes no optimizer state")

    def finalize_optimizer(self, source: CanonicalSource, optimizer: OptimizerSource, form: str, out_dir: Path,
                           options: SaveOptions, optimizer_options: OptimizerOptions,
                           files: list[PlannedFile]) -> CarriedOptimizer:
        """After every share's ``save_optimizer(only=...)`` and ``finalize``: what the shares' optimizer state has
        in common, written once (``optimizer_partial``); the same bytes as ``save_optimizer`` without ``only``."""
        raise NotImplementedError(f"{self.name}: writes no optimizer state in shares")
