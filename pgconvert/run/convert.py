"""Orchestration: detect the source, plan the destination, write it completely or not at all."""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pgconvert.adapters.merge import attach_adapters
from pgconvert.formats.text_only import LanguageModelSource
from pgconvert.io.durable import fsync_dir
from pgconvert.run.destination import (
    LOCK_SUFFIX,
    PARTIAL_MARKER,
    RETIRED_MARKER,
    SHARED_STAGING_MARKER,
    recover_retired,
    refuse_unusable_name,
    replace_output,
    sibling,
    siblings,
)
from pgconvert.errors import ConversionError, DestinationError, PluginError, StrictModeError, ValidationError
from pgconvert.formats import DTYPE_CHOICES, LoadOptions, PlannedFile, SaveOptions, Saver, SaveResult
from pgconvert.model.layout import ParallelLayout
from pgconvert.model.layout_spec import LayoutSpec
from pgconvert.formats.names import COMMON_PLACES, DEFAULT_DIGEST, DIGEST_CHOICES, saver_names
from pgconvert.io.output import OUTPUT_STAGING_BYTES, digests, staging_bytes
from pgconvert.io.threads import serialized
from pgconvert.io.sizes import dtype_name, itemsize, numel
from pgconvert.run.manifest import Manifest, hashing, record_files, write_manifest, writing_digest
from pgconvert.formats.hf_quantized import check_keep_fp8
from pgconvert.formats.torch_dist_integrity import INTEGRITY_ALGORITHM
from pgconvert.optimizer.carry import (attach_optimizer, carry_training_state, check_optimizer_options,
                                       finalize_carried, replace_saver_notice)
from pgconvert.optimizer.source import OptimizerSource
from pgconvert.formats.registry import detect_format, get_loader, get_saver
from pgconvert.families import CARRIED_SETTINGS
from pgconvert.semantics import check_target
from pgconvert.formats.stream import CanonicalSource
from pgconvert.formats.strict import fallback
from pgconvert.run.workers import carried_in_processes, save_with_workers

log = logging.getLogger(__name__)

CHECK_FINITE_CHOICES = ("warn", "error", "off")


@dataclass(frozen=True)
class ConvertRequest:
    """One conversion as the user asked for it; ``None`` fields are detected or kept from the source."""

    src: Path
    dst: Path
    src_format: str | None = None
    dst_format: str | None = None
    dst_tp: int | None = None
    dst_pp: int | None = None
    dst_first_stage_layers: int | None = None
    dst_last_stage_layers: int | None = None
    dst_ep: int | None = None
    dst_expert_tp: int | None = None
    dst_vpp: int | None = None
    dst_pipeline_layout: str | None = None
    dst_transformer_impl: str | None = None
    dst_expert_layout: str | None = None
    src_tp: int | None = None
    src_pp: int | None = None
    src_ep: int | None = None
    iteration: int | None = None
    true_vocab_size: int | None = None
    dtype: str = "keep"
    overwrite: bool = False
    strict: bool = False
    check_finite: str = "warn"
    digest: str = DEFAULT_DIGEST
    max_shard_size: int | None = None
    hf_config: Path | None = None
    # HF side files to write (or carry in hf/) instead of the source's: see pgconvert.formats.hf_side.
    generation_config: Path | None = None
    tokenizer: Path | None = None
    # Local worker processes over independent destination files, and the bytes of destination
    # files they may hold in memory at once.
    workers: int = 1
    max_memory: int | None = None
    # Threads writing independent destination files at once within each process (megatron rank files,
    # hf shards): pgconvert.io.threads.
    threads: int = 1
    # Write an hf source's quantized tensors unchanged with their scales (hf -> hf only).
    keep_fp8: bool = False
    # Convert the model alone, without the source's optimizer state (pgconvert.optimizer.carry).
    skip_optimizer: bool = False
    # The data-parallel size the carried optimizer state is written for (pgconvert.optimizer.data_parallel).
    dst_dp: int | None = None
    # The optimizer state's form in DST, one of its saver's ``optimizer_forms`` (torch_dist: the distributed
    # optimizer's form).
    dst_optim_form: str | None = None
    # A Megatron per-rank DST's MTP inner-layer key (pgconvert.formats.mtp_naming); None: the source's.
    dst_mtp_layer_name: str | None = None
    # Where a torch_dist DST keeps its common state: "store" (megatron-core >= 0.19; with integrity.json when
    # ``digest`` is sha256 or the source has one) or "legacy" (common.pt, which megatron-core <= 0.18 reads).
    dst_torch_dist_common: str = "store"
    # A Hugging Face PEFT LoRA adapter directory merged into the model as it is converted (pgconvert.adapters).
    merge_adapter: Path | None = None
    # A LoRA adapter the source holds beside its model left out, the base model alone converted (with a notice).
    drop_adapter: bool = False
    # A vision-language source's language model alone (pgconvert.formats.text_only).
    text_only: bool = False
    # Re-hash every file a torch_dist source's integrity.json lists, its data files too (by default those are
    # only required to be there): pgconvert.formats.torch_dist_integrity.
    verify_integrity: bool = False


@dataclass
class Plan:
    """What a conversion will do, computed from the source's metadata before anything is written."""

    request: ConvertRequest
    src_format: str
    dst_format: str
    source: CanonicalSource
    src_layout: ParallelLayout | None
    saver: Saver
    save_options: SaveOptions
    files: list[PlannedFile]
    # The bytes of the largest tensor a destination file is written from (in the larger of its source and
    # target dtypes): what producing one file holds in memory besides its write buffers.
    largest_tensor: int = 0
    # The optimizer state this conversion carries (or None) and the notices that decision gave, once decided
    # (``pgconvert.optimizer.carry.carried_optimizer``).
    optimizer_decision: tuple[tuple[OptimizerSource, str] | None, list[str]] | None = None
    # The files the saver's writing tasks produce together (``Saver.file_groups``); every other file alone.
    file_groups: list[tuple[str, ...]] = field(default_factory=list)

    @property
    def files_together(self) -> int:
        """The most files one of the saver's writing tasks produces at once."""
        return max(map(len, self.file_groups), default=1)

    @property
    def total_bytes(self) -> int:
        return sum(item.nbytes for item in self.files)

    @property
    def files_at_once(self) -> int:
        """Destination files produced at the same time: one per ``--workers`` process, else one per
        ``--threads`` thread of a saver that writes on threads (``Saver.threaded``), times the files each of
        its tasks writes together (``Saver.file_groups``)."""
        at_once = self.request.workers if self.request.workers > 1 else (
            self.request.threads if self.saver.threaded else 1)
        return max(1, min(at_once * self.files_together, len(self.files)))

    @property
    def memory_in_flight(self) -> int:
        """The most bytes the files being produced hold at once: per file, its largest tensor (and as many more as
        the saver leaves records being written while it produces the next, ``Saver.records_in_flight``) and the
        write buffers of its ``OutputFile``; per group of files written together, the whole tensor their pieces are
        cut from, the pieces (together no more than it) and one file's write buffers, which they share."""
        if self.files_together == 1:
            records = 1 + self.saver.records_in_flight
            return self.files_at_once * (records * self.largest_tensor + OUTPUT_STAGING_BYTES)
        groups = max(1, self.files_at_once // self.files_together)
        return groups * (2 * self.largest_tensor + staging_bytes(self.files_together))


@dataclass
class Report:
    """What a conversion did."""

    src: Path
    dst: Path
    src_format: str
    dst_format: str
    src_layout: str | None
    dst_layout: str
    files: list[PlannedFile] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(item.nbytes for item in self.files)


def _is_within(path: Path, parent: Path) -> bool:
    try:
        path.relative_to(parent)
    except ValueError:
        return False
    return True


def check_destination(dst: Path, overwrite: bool, src: Path | None = None) -> None:
    """Refuse destinations that would destroy the source or an unrelated directory."""
    refuse_unusable_name(dst)
    remove_leftovers(dst.absolute())
    dst_real = dst.resolve()
    if src is not None:
        src_real = src.resolve()
        if _is_within(dst_real, src_real):
            raise DestinationError(f"DST {dst} is inside SRC {src}; choose a destination outside the source")
        if _is_within(src_real, dst_real):
            raise DestinationError(f"DST {dst} contains SRC {src}; choose a destination outside the source")
    if dst.exists() and not dst.is_dir():
        raise DestinationError(f"DST {dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise DestinationError(f"DST {dst} exists and is not empty; pass --overwrite to replace it")
    parent = dst_real.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise DestinationError(f"DST {dst}: {parent} is not a directory")
    # A real write, not os.access: root passes access checks even on a read-only mount.
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise DestinationError(f"DST {dst}: parent directory {parent} is not writable ({exc.strerror})") from None


def destination_layout(request: ConvertRequest, src_layout: ParallelLayout | None) -> ParallelLayout:
    """The layout ``request`` produces from a source laid out as ``src_layout`` (None: unsharded):
    what the user gave, the rest kept from the source where it still fits."""
    base = src_layout or ParallelLayout()
    pp = request.dst_pp if request.dst_pp is not None else base.pp
    stages_given = any(value is not None for value in (
        request.dst_first_stage_layers, request.dst_last_stage_layers, request.dst_vpp, request.dst_pipeline_layout))
    # Stage assignments only carry over when the pipeline is unchanged and nothing new was asked.
    keep_stages = pp == base.pp and not stages_given
    tp = request.dst_tp if request.dst_tp is not None else base.tp
    expert_tp = request.dst_expert_tp
    if expert_tp is None and request.dst_tp is None:
        expert_tp = base.expert_tp
    return ParallelLayout(
        tp=tp,
        pp=pp,
        ep=request.dst_ep if request.dst_ep is not None else base.ep,
        first_stage_layers=base.first_stage_layers if keep_stages else request.dst_first_stage_layers,
        last_stage_layers=base.last_stage_layers if keep_stages else request.dst_last_stage_layers,
        vpp=base.vpp if keep_stages else request.dst_vpp,
        expert_tp=None if expert_tp == tp else expert_tp,
        pipeline_layout=base.pipeline_layout if keep_stages else request.dst_pipeline_layout,
    )


def _check_choices(request: ConvertRequest) -> None:
    """The options that take one of a few values (a library caller passes them unchecked by click)."""
    for flag, value, choices in (("--dtype", request.dtype, tuple(DTYPE_CHOICES)),
                                 ("--check-finite", request.check_finite, CHECK_FINITE_CHOICES),
                                 ("--digest", request.digest, DIGEST_CHOICES),
                                 ("--dst-torch-dist-common", request.dst_torch_dist_common, COMMON_PLACES)):
        if value not in choices:
            raise DestinationError(f"{flag} {value}: must be one of {', '.join(choices)}")
    for flag, count in (("--threads", request.threads), ("--workers", request.workers)):
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValidationError(f"{flag} {count!r}: must be a whole number of at least 1")


def _formats(request: ConvertRequest) -> tuple[str, str]:
    """The source's format (detected unless given) and the destination's (default: the source's, where it is
    one pgconvert writes)."""
    src_format = request.src_format or detect_format(request.src)
    dst_format = request.dst_format or src_format
    if request.dst_format is None and dst_format not in saver_names():
        raise PluginError(f"{request.src}: {src_format} checkpoints are read, not written; pass --dst-format "
                          f"({', '.join(saver_names())})")
    return src_format, dst_format


def plan(request: ConvertRequest, check_dst: bool = True) -> Plan:
    """Open the source and compute every destination file; validates everything, writes nothing (it
    only removes what killed runs left beside DST, see ``remove_leftovers``).

    ``check_dst=False`` is for the worker processes of a conversion that already checked it.
    """
    src = request.src
    if not src.exists():
        raise DestinationError(f"SRC {src} does not exist")
    if check_dst:
        check_destination(request.dst, request.overwrite, src)
    src_format, dst_format = _formats(request)
    loader = get_loader(src_format)
    saver = get_saver(dst_format)
    if request.keep_fp8:
        check_keep_fp8(loader, saver)
    _check_choices(request)
    source = loader.open(src, _load_options(request, check_dst))
    if request.text_only:
        source = _language_model_only(source)
    try:
        source.check_finite = request.check_finite
        attach_adapters(source, None if request.merge_adapter is None else Path(request.merge_adapter),
                        request.drop_adapter, request.keep_fp8)
        # A format without parallel layouts (hf) starts from an unsharded layout, not the source's.
        layout_base = source.layout if saver.parallel else None
        save_options = SaveOptions(
            layout=destination_layout(request, layout_base),
            dtype=DTYPE_CHOICES[request.dtype],
            transformer_impl=request.dst_transformer_impl,
            expert_layout=request.dst_expert_layout,
            mtp_layer_module=request.dst_mtp_layer_name,
            torch_dist_common=request.dst_torch_dist_common,
            integrity_manifest=request.digest == INTEGRITY_ALGORITHM or source.has_integrity_manifest(),
            strict=request.strict,
            max_shard_size=request.max_shard_size,
            hf_config=Path(request.hf_config) if request.hf_config is not None else None,
            generation_config=Path(request.generation_config) if request.generation_config is not None else None,
            tokenizer=Path(request.tokenizer) if request.tokenizer is not None else None,
            threads=request.threads,
        )
        _note_dtype_change(source, save_options, saver)
        if saver.parallel:
            _note_unrunnable_layout(source, save_options)
        check_target(source, dst_format, request.strict, CARRIED_SETTINGS)
        saver.validate(source, save_options)
        files = saver.plan(source, save_options)
        _note_unthreaded(saver, dst_format, request, source)
        conversion = Plan(request, src_format, dst_format, source, source.layout, saver, save_options, files,
                          _largest_tensor(source, save_options))
        check_optimizer_options(conversion)  # before anything is written
        attach_optimizer(conversion)
        conversion.file_groups = saver.file_groups(source, save_options)  # once the masters are known
    except BaseException:
        source.close()
        raise
    return conversion


def _language_model_only(source: CanonicalSource) -> CanonicalSource:
    """``--text-only``: the source's language model (a text model is refused, the source closed)."""
    try:
        return LanguageModelSource(source)
    except BaseException:
        source.close()
        raise


def _load_options(request: ConvertRequest, check_dst: bool) -> LoadOptions:
    return LoadOptions(
        iteration=request.iteration,
        src_tp=request.src_tp,
        src_pp=request.src_pp,
        src_ep=request.src_ep,
        true_vocab_size=request.true_vocab_size,
        strict=request.strict,
        keep_quantized=request.keep_fp8,
        dequantize_dtype=DTYPE_CHOICES[request.dtype],  # one rounding, to the dtype asked for
        # A worker's source was checked by the process that planned the run.
        verify_integrity=("full" if request.verify_integrity else "metadata") if check_dst else "off",
    )


def _largest_tensor(source: CanonicalSource, options: SaveOptions) -> int:
    """The largest canonical tensor's bytes, in the wider of its dtype and ``--dtype``'s."""
    largest = 0
    for meta in map(source.meta, source.names()):
        size = max(itemsize(meta.dtype), itemsize(options.dtype) if options.dtype is not None else 0)
        largest = max(largest, numel(meta.shape) * size)
    return largest


def _note_unthreaded(saver: Saver, dst_format: str, request: ConvertRequest, source: CanonicalSource) -> None:
    if request.threads > 1 and not saver.threaded and request.workers == 1:
        source.notices.append(f"--threads {request.threads}: the {dst_format} saver writes its files one at a "
                              "time (one pass of the DCP writer); --workers splits them")


def _note_dtype_change(source: CanonicalSource, options: SaveOptions, saver: Saver) -> None:
    """A cast to another floating dtype can lose precision or range: a guess under --strict. A saver that stores
    every floating tensor in one dtype (``Saver.stored_float_dtype``) casts to that one, not to ``--dtype``."""
    if options.dtype is None:
        return
    stored = saver.stored_float_dtype or options.dtype
    changed = sorted({dtype_name(meta.dtype) for meta in map(source.meta, source.names())
                      if meta.dtype.is_floating_point and meta.dtype != stored})
    if changed:
        target = dtype_name(stored)
        fallback(f"--dtype casts {', '.join(changed)} tensors to {target}", options.strict, source.notices)


def _note_unrunnable_layout(source: CanonicalSource, options: SaveOptions) -> None:
    """A destination written but that no Megatron can run, named in a notice and refused under --strict: a virtual
    pipeline on one pipeline stage (megatron-core's ``initialize_model_parallel`` raises "pipeline-model-parallel
    size should be greater than 1 with interleaved schedule", parallel_state.py, 0.16.1); sparse attention under
    the local spec (megatron-core builds the indexer's linears with ``backend.linear()``, which only the Transformer
    Engine provider has)."""
    layout, messages = options.layout, []
    if layout.pp == 1 and layout.virtual_size > 1:
        messages.append(f"destination layout {layout.describe()}: {layout.virtual_size} virtual pipeline chunks on "
                        "pp=1; megatron-core refuses a virtual pipeline unless pipeline-model-parallel size > 1, so "
                        "Megatron cannot resume from it (give --dst-pp > 1)")
    if source.config.attention.sparse and (options.transformer_impl or source.config.transformer_impl) == "local":
        messages.append("transformer_impl='local' with sparse attention (dsa_indexer_*): megatron-core builds the "
                        "indexer with Transformer Engine's linears only, so Megatron cannot build this model from "
                        "local names (give --dst-transformer-impl transformer_engine)")
    for message in messages:
        if options.strict:
            raise StrictModeError(f"--strict: {message}")
        log.warning("%s", message)
        source.notices.append(message)


@contextmanager
def _destination_lock(dst: Path) -> Iterator[None]:
    """One conversion per destination at a time: a second one fails at once, nothing is touched."""
    lock_path = sibling(dst, LOCK_SUFFIX)
    locked = False
    handle = None
    try:
        handle = open(lock_path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "?"
            raise DestinationError(
                f"DST {dst} is being written by another pgconvert process (pid {owner}, lock {lock_path})"
            ) from None
        locked = True
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield
    finally:
        # Unlinked while still held, so a waiting run never locks a file that is about to vanish.
        # Interrupted before the lock was taken: the file is ours to remove only if no one holds it.
        if handle is not None:
            if locked or _try_lock(handle):
                lock_path.unlink(missing_ok=True)
            handle.close()


def _try_lock(handle: object) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # type: ignore[arg-type]
    except OSError:
        return False
    return True


def remove_leftovers(dst: Path) -> None:
    """Remove what killed runs left beside DST: its lock file, the staging directories of runs that hold
    DST's lock (a sharded run's shared staging, which its shares write without that lock, is left to
    them), and a retired output (restored where DST is missing). Nothing is touched while a live run
    holds DST's lock."""
    shared = set(siblings(dst, SHARED_STAGING_MARKER))
    partials = [path for path in siblings(dst, PARTIAL_MARKER) if path not in shared]
    if not (sibling(dst, LOCK_SUFFIX).exists() or partials or siblings(dst, RETIRED_MARKER)):
        return
    try:
        with _destination_lock(dst):  # its release removes the lock file
            _remove_stale_partials(dst, partials)
    except DestinationError:
        log.debug("leaving the hidden siblings of %s to the run that holds its lock", dst)


def _remove_stale_partials(dst: Path, partials: list[Path] | None = None) -> None:
    """Partial outputs of killed runs (we hold the lock, so no live run owns them): ``partials``, or every
    partial sibling; a retired output is restored or removed first."""
    recover_retired(dst)
    for stale in siblings(dst, PARTIAL_MARKER) if partials is None else partials:
        log.warning("removing %s, left by an interrupted conversion", stale)
        shutil.rmtree(stale, ignore_errors=True)


@contextmanager
def staged_output(dst: Path, overwrite: bool) -> Iterator[Path]:
    """A temporary sibling of ``dst`` that becomes ``dst`` only if the body finishes.

    On any failure, Ctrl-C included, the sibling is removed, so no directory is left that looks
    like a finished checkpoint; a process killed outright leaves only a hidden ``.pgconvert-partial``
    directory, never ``dst``.
    """
    dst = dst.absolute()
    dst.parent.mkdir(parents=True, exist_ok=True)
    with _destination_lock(dst):
        _remove_stale_partials(dst)
        staging = sibling(dst, f"{PARTIAL_MARKER}{uuid.uuid4().hex[:12]}")
        staging.mkdir()
        with _promoted_on_success(staging, dst, overwrite):
            yield staging


@contextmanager
def _promoted_on_success(staging: Path, dst: Path, overwrite: bool) -> Iterator[None]:
    try:
        yield
        promote(staging, dst, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def promote(staging: Path, dst: Path, overwrite: bool) -> None:
    """Make a complete staging directory the destination: fsync, then one rename."""
    fsync_dir(staging)
    refuse_unusable_name(dst)
    if dst.exists():
        if any(dst.iterdir()) and not overwrite:
            raise DestinationError(f"DST {dst} appeared during the conversion and is not empty")
        replace_output(staging, dst)
    else:
        staging.rename(dst)
        fsync_dir(dst.parent)


def _save(conversion: Plan, staging: Path, progress: Callable[[int], None]) -> SaveResult:
    """The model files, and with them the optimizer state: in the worker processes (``--workers``, a saver that
    writes it in shares), else in this process after the model."""
    request = conversion.request
    if conversion.files_at_once > 1:
        progress = serialized(progress)  # called from each file's thread
    if request.workers > 1 and conversion.saver.optimizer_partial:
        carried = carried_in_processes(conversion)  # decided before the pool starts
        result = save_with_workers(conversion, staging, request.workers, request.max_memory, progress,
                                   functools.partial(plan, check_dst=False), carried)
        if carried is not None:
            result.notices = replace_saver_notice(result.notices,
                                                  finalize_carried(conversion, carried, staging, result.files))
        return result
    if request.workers > 1:
        result = save_with_workers(conversion, staging, request.workers, request.max_memory, progress,
                                   functools.partial(plan, check_dst=False))
    else:
        result = conversion.saver.save(conversion.source, staging, conversion.save_options, progress)
    result.notices = replace_saver_notice(result.notices, carry_training_state(conversion, staging, result.files))
    return result


def execute(conversion: Plan, progress: Callable[[int], None] | None = None) -> Report:
    """Write the planned destination; the source is closed afterwards."""
    request = conversion.request
    started = time.perf_counter()
    try:
        with digests(writing_digest(conversion)), staged_output(request.dst, request.overwrite) as staging:
            result = _save(conversion, staging, progress or (lambda nbytes: None))
            conversion.saver.seal(conversion.source, staging, conversion.save_options, result.files)
            # Inside the staging directory: only an output that is complete ever has a manifest.
            records = record_files(staging, result.files, hashing(request))
            write_manifest(staging, Manifest.for_conversion(conversion, records))
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise ConversionError(
            f"writing DST {request.dst} failed: {exc.strerror or exc}{where}; nothing was left behind"
        ) from exc
    finally:
        conversion.source.close()
    notices = list(conversion.source.notices) + result.notices
    for notice in notices:
        log.info("%s", notice)
    return Report(
        src=request.src,
        dst=request.dst,
        src_format=conversion.src_format,
        dst_format=conversion.dst_format,
        src_layout=conversion.src_layout.describe() if conversion.src_layout else None,
        dst_layout=conversion.save_options.layout.describe(),
        files=result.files,
        notices=notices,
        seconds=time.perf_counter() - started,
    )


_DST_LAYOUT_FIELDS = tuple(f"dst_{name}" for name in LayoutSpec.__dataclass_fields__)


def convert_request(src: str | os.PathLike[str], dst: str | os.PathLike[str],
                    dst_layout: ParallelLayout | LayoutSpec | str | None = None,
                    **options: object) -> ConvertRequest:
    """The ``ConvertRequest`` for ``convert``'s arguments.

    ``dst_layout`` is a shorthand for the ``dst_*`` layout fields: a ``ParallelLayout`` names its
    tp, pp and ep (and any stage field it sets), a text such as ``"tp=2,pp=4,ep=8"`` only the keys
    it lists; what is not named is kept from the source. Giving a field both ways is refused.
    """
    unknown = sorted(set(options) - set(ConvertRequest.__dataclass_fields__))
    if unknown:
        raise ValidationError(f"convert: unknown options {unknown}; the options are the fields of ConvertRequest")
    fields = dict(options)
    if dst_layout is not None:
        given = LayoutSpec.coerce(dst_layout).request_fields()
        both = sorted(name for name in _DST_LAYOUT_FIELDS if name in given and fields.get(name) is not None)
        if both:
            raise ValidationError(f"dst_layout {dst_layout!r}: {', '.join(both)} also given as keyword arguments")
        fields.update(given)
    return ConvertRequest(src=Path(src), dst=Path(dst), **fields)  # type: ignore[arg-type]


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str],
            dst_layout: ParallelLayout | LayoutSpec | str | None = None,
            dst_format: str | None = None, **options: object) -> Report:
    """Convert the checkpoint at ``src`` into ``dst``, written complete (with its manifest) or not at all.

    ``dst_layout``: the target layout, a ``ParallelLayout`` or text such as ``"tp=2,pp=4,ep=8"``
    (see ``convert_request``); ``dst_format``: the target format (default: the source's);
    ``options``: any other field of ``ConvertRequest`` (``dst_tp=2``, ``iteration=1000``,
    ``dtype="bf16"``, ``overwrite=True``, …). Raises ``PgconvertError`` subclasses.
    """
    request = convert_request(src, dst, dst_layout, dst_format=dst_format, **options)
    return execute(plan(request))
