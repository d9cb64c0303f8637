"""``batch``: many conversions from one TOML plan, in parallel processes, resumable.

A plan is a ``[defaults]`` table and ``[[convert]]`` entries::

    [defaults]
    dst_format = "megatron"

    [[convert]]
    name = "tp2"
    src = "runs/llama"
    dst = "out/tp2/iter_{iteration}"
    iterations = "all"
    dst_layout = "tp=2,pp=1"

An entry takes ``src``, ``dst``, an optional ``name``, ``dst_layout`` (text as in ``tp=2,pp=4``),
``iterations`` (``"all"`` or a list of numbers) and any ``ConvertRequest`` field, spelled as the
field (``dst_tp``) or as the convert command's option (``dst-tp``, ``dst-decoder-first-pipeline-num-layers``).
Relative paths (src, dst and path options such as ``hf_config``) are relative to the plan file;
``src-format = "auto"`` and ``dst-format = "same"`` mean "not given". ``{iteration}`` (or ``{iteration:07d}``) in src/dst
is replaced by the iteration. Each entry runs as one ``pgconvert.run.convert`` call in a worker process.

An entry whose destination holds a ``pgconvert.json`` matching the request (same source path and
iteration, same target format, layout, dtype and naming options, every listed file present with its
recorded size, and its digest too when asked) is skipped, so re-running a plan only does what is left.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import time
import tomllib
import typing
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from pgconvert.run.convert import ConvertRequest, convert, convert_request, destination_layout, remove_leftovers
from pgconvert.errors import PgconvertError, ValidationError
from pgconvert.formats import RELEASE, LoadOptions
from pgconvert.io.limits import MAX_PLACEHOLDER_WIDTH, quote
from pgconvert.run.manifest import UNRECORDED_OPTIONS, Manifest, file_problems, output_options, read_manifest
from pgconvert.formats.registry import detect_format, get_loader


class PlanError(ValidationError):
    """The plan file is malformed: nothing is run."""


Status = Literal["ok", "failed", "skipped"]

# Keys of an entry that are not ConvertRequest fields.
ENTRY_KEYS = ("name", "src", "dst", "iterations", "dst_layout")
# The convert command's options whose names differ from the ConvertRequest field they set.
CLI_OPTION_FIELDS: dict[str, str] = {
    "dst_decoder_first_pipeline_num_layers": "dst_first_stage_layers",
    "dst_decoder_last_pipeline_num_layers": "dst_last_stage_layers",
}
# The convert command's "detect it" / "keep it" choices, which a request spells as None.
CLI_DEFAULT_VALUES: dict[str, str] = {"src_format": "auto", "dst_format": "same"}
# Convert-command options that steer the command, not the conversion.
CLI_ONLY_OPTIONS = ("dry_run", "quiet", "verbose")
ITERATION_PLACEHOLDER = re.compile(r"\{iteration(?::([^}]*))?\}")


def _request_fields() -> dict[str, Any]:
    hints = typing.get_type_hints(ConvertRequest)
    return {item.name: hints[item.name] for item in fields(ConvertRequest) if item.name not in ("src", "dst")}


@dataclass(frozen=True)
class PlanItem:
    """One ``[[convert]]`` entry with the defaults applied, before its iterations are expanded."""

    label: str
    src: str
    dst: str
    options: dict[str, Any]
    iterations: Literal["all"] | tuple[int, ...] | None = None
    dst_layout: str | None = None


@dataclass(frozen=True)
class BatchEntry:
    """One conversion to run: a request, or the reason the plan item could not be expanded."""

    label: str
    src: str
    dst: str
    request: ConvertRequest | None
    error: str | None = None


@dataclass
class EntryResult:
    """What became of one entry; ``error`` is set when it failed."""

    label: str
    src: str
    dst: str
    status: Status
    seconds: float = 0.0
    error: str | None = None


@dataclass
class BatchReport:
    """Every entry's result, in plan order; ``ok`` when none failed."""

    plan: str
    results: list[EntryResult] = field(default_factory=list)

    def count(self, status: Status) -> int:
        return sum(result.status == status for result in self.results)

    @property
    def ok(self) -> bool:
        return self.count("failed") == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan,
            "ok": self.ok,
            "counts": {status: self.count(status) for status in ("ok", "failed", "skipped")},
            "entries": [asdict(result) for result in self.results],
        }


def _normalise_key(key: str) -> str:
    name = key.replace("-", "_")
    return CLI_OPTION_FIELDS.get(name, name)


def _check_type(where: str, key: str, value: Any, hint: Any) -> None:
    allowed = tuple(kind for kind in (typing.get_args(hint) or (hint,)) if kind is not type(None))
    if Path in allowed:
        allowed = (*allowed, str)
    # TOML's booleans are Python bools, which are ints too: keep them apart.
    if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
        names = " or ".join(kind.__name__ for kind in allowed)
        raise PlanError(f"{where}: {key} = {value!r} must be {names}")


def _read_table(where: str, table: Any, request_fields: dict[str, Any], base: Path) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise PlanError(f"{where}: expected a table, found {type(table).__name__}")
    values: dict[str, Any] = {}
    for raw_key, value in table.items():
        key = _normalise_key(raw_key)
        if key in values:
            raise PlanError(f"{where}: {raw_key!r} given twice (as {key})")
        if key in CLI_ONLY_OPTIONS:
            raise PlanError(f"{where}: {raw_key!r} is an option of the convert command, not of a conversion")
        if key in CLI_DEFAULT_VALUES and value == CLI_DEFAULT_VALUES[key]:
            value = None
        elif key in request_fields:
            _check_type(where, raw_key, value, request_fields[key])
            if Path in typing.get_args(request_fields[key]) or request_fields[key] is Path:
                value = base / Path(value).expanduser()
        elif key in ("name", "src", "dst", "dst_layout"):
            if not isinstance(value, str) or not value:
                raise PlanError(f"{where}: {raw_key} = {value!r} must be a non-empty string")
        elif key == "iterations":
            if not (value == "all" or (isinstance(value, list) and value
                                       and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                               for v in value))):
                raise PlanError(f"{where}: iterations = {value!r} must be \"all\" or a list of iteration numbers")
        else:
            known = sorted({*ENTRY_KEYS, *request_fields})
            raise PlanError(f"{where}: unknown key {raw_key!r}; known keys: {', '.join(known)}")
        values[key] = value
    return values


def read_plan(path: str | Path) -> list[PlanItem]:
    """Parse and check a plan file; relative paths become relative to the plan's directory."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise PlanError(f"{path}: cannot read the plan: {error.strerror or error}") from error
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise PlanError(f"{path}: not a valid TOML plan: {error}") from error
    unknown = sorted(set(doc) - {"defaults", "convert"})
    if unknown:
        raise PlanError(f"{path}: unknown top-level keys {unknown}; a plan has [defaults] and [[convert]] entries")
    request_fields = _request_fields()
    base = path.absolute().parent
    defaults = _read_table(f"{path} [defaults]", doc.get("defaults", {}), request_fields, base)
    for key in ("name", "src", "dst"):
        if key in defaults:
            raise PlanError(f"{path} [defaults]: {key} belongs in each [[convert]] entry")
    entries = doc.get("convert")
    if not isinstance(entries, list) or not entries:
        raise PlanError(f"{path}: no [[convert]] entries")
    items = []
    for index, table in enumerate(entries, start=1):
        where = f"{path} [[convert]] #{index}"
        values = {**defaults, **_read_table(where, table, request_fields, base)}
        for key in ("src", "dst"):
            if key not in values:
                raise PlanError(f"{where}: {key} is missing")
        iterations = values.pop("iterations", None)
        if iterations is not None and values.get("iteration") is not None:
            raise PlanError(f"{where}: give iteration or iterations, not both")
        if isinstance(iterations, list):
            iterations = tuple(iterations)
        dst_layout = values.pop("dst_layout", None)
        label = values.pop("name", None) or str(index)
        src, dst = (str(base / Path(values.pop(key)).expanduser()) for key in ("src", "dst"))
        item = PlanItem(label, src, dst, values, iterations, dst_layout)
        _check_item(where, item)
        items.append(item)
    labels = [item.label for item in items]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise PlanError(f"{path}: entry names used more than once: {repeated}")
    return items


def _check_item(where: str, item: PlanItem) -> None:
    """What can be refused without touching the file system: bad layouts, unusable placeholders."""
    try:
        convert_request(item.src, item.dst, item.dst_layout, **item.options)
    except PgconvertError as error:
        raise PlanError(f"{where}: {error}") from error
    if item.iterations == "all" and ITERATION_PLACEHOLDER.search(item.src):
        raise PlanError(f"{where}: iterations = \"all\" lists the iterations under src, which cannot hold {{iteration}}")
    has_iteration = item.iterations is not None or item.options.get("iteration") is not None
    for key in ("src", "dst"):
        template = getattr(item, key)
        if ITERATION_PLACEHOLDER.search(template) and not has_iteration:
            raise PlanError(f"{where}: {key} has an {{iteration}} placeholder but no iteration or iterations is given")
        try:
            _fill(template, 0)
        except ValueError as error:
            raise PlanError(f"{where}: {key} = {template!r}: {error}") from error
    if isinstance(item.iterations, tuple) or item.iterations == "all":
        if not ITERATION_PLACEHOLDER.search(item.dst):
            raise PlanError(f"{where}: several iterations need an {{iteration}} placeholder in dst")


def _fill(template: str, iteration: int | None) -> str:
    if iteration is None:
        return template
    return ITERATION_PLACEHOLDER.sub(lambda match: _format_iteration(iteration, match.group(1) or ""), template)


def _format_iteration(iteration: int, spec: str) -> str:
    """``format(iteration, spec)``, refusing a width or precision that would build a huge string."""
    widths = re.findall(r"\d+", spec)
    if any(len(width) > 3 or int(width) > MAX_PLACEHOLDER_WIDTH for width in widths):
        raise ValueError(f"the format {quote(spec)} is wider than pgconvert's limit "
                         f"MAX_PLACEHOLDER_WIDTH={MAX_PLACEHOLDER_WIDTH}")
    return format(iteration, spec)


def expand(item: PlanItem) -> list[BatchEntry]:
    """The conversions of one plan item: one per iteration when it names several."""
    iterations: list[int | None]
    if item.iterations == "all":
        try:
            source_format = item.options.get("src_format") or detect_format(Path(item.src))
        except PgconvertError as error:
            return [BatchEntry(item.label, item.src, item.dst, None, f"iterations = \"all\": {error}")]
        saved = get_loader(source_format).iterations(Path(item.src))
        iterations = [number for number in saved if isinstance(number, int)]
        if not iterations:
            return [BatchEntry(item.label, item.src, item.dst, None,
                               f"iterations = \"all\": {item.src} ({source_format}) has no numbered iterations")]
    elif isinstance(item.iterations, tuple):
        iterations = list(item.iterations)
    else:
        iterations = [item.options.get("iteration")]
    entries = []
    for iteration in iterations:
        label = item.label if item.iterations is None else f"{item.label}@{iteration}"
        src, dst = _fill(item.src, iteration), _fill(item.dst, iteration)
        options = dict(item.options)
        if iteration is not None:
            options["iteration"] = iteration
        request = convert_request(src, dst, item.dst_layout, **options)
        entries.append(BatchEntry(label, src, dst, request))
    return entries


def _check_independent(entries: list[BatchEntry], plan_name: str = "") -> None:
    """Entries run in parallel and in any order: none may write where another writes or reads,
    nor inside (or around) another's destination."""
    where = f"{plan_name}: " if plan_name else ""
    written: dict[Path, str] = {}
    for entry in entries:
        if entry.request is None:
            continue
        dst = entry.request.dst.resolve()
        if dst in written:
            raise PlanError(f"{where}entries {written[dst]} and {entry.label} both write {entry.dst}")
        for other, label in written.items():
            if other in dst.parents or dst in other.parents:
                outer, inner = (other, dst) if other in dst.parents else (dst, other)
                raise PlanError(f"{where}entries {label} and {entry.label} write nested destinations: {inner} "
                                f"is inside {outer}; every entry needs a destination of its own")
        written[dst] = entry.label
    for entry in entries:
        if entry.request is None:
            continue
        src = entry.request.src.resolve()
        for dst, label in written.items():
            if label != entry.label and (src == dst or dst in src.parents or src in dst.parents):
                raise PlanError(
                    f"{where}entry {entry.label} reads {entry.src}, which overlaps what entry {label} writes; entries "
                    "of one plan run independently and in any order: put the second step in another plan"
                )


def _current_iteration(request: ConvertRequest) -> tuple[int | None, bool]:
    """The iteration the loader picks for this request today (the latest one may have moved on)."""
    source_format = request.src_format or detect_format(request.src)
    source = get_loader(source_format).open(request.src, LoadOptions(
        iteration=request.iteration, src_tp=request.src_tp, src_pp=request.src_pp, src_ep=request.src_ep,
        true_vocab_size=request.true_vocab_size,
    ))
    try:
        return source.iteration, source.release
    finally:
        source.close()


def manifest_mismatch(manifest: Manifest, request: ConvertRequest, verify_hashes: bool = False) -> str | None:
    """Why the output described by ``manifest`` is not what ``request`` would write (None: it is)."""
    if Path(manifest.source_path) != request.src.resolve():
        return f"converted from {manifest.source_path}, not {request.src.resolve()}"
    if request.src_format is not None and request.src_format != manifest.source_format:
        return f"source format {manifest.source_format}, not {request.src_format}"
    target_format = request.dst_format or request.src_format or manifest.source_format
    if target_format != manifest.target_format:
        return f"target format {manifest.target_format}, not {target_format}"
    recorded = (manifest.source_iteration, manifest.source_release)
    if request.iteration is not None:
        wanted = (request.iteration, False)
    elif recorded == (None, False):
        wanted = recorded  # a format without iterations
    else:
        wanted = _current_iteration(request)
    if wanted != recorded:
        return f"source iteration {_iteration_text(*recorded)}, not {_iteration_text(*wanted)}"
    layout = destination_layout(request, manifest.source_parallel_layout)
    if layout != manifest.target_parallel_layout:
        return f"target layout {manifest.target_parallel_layout.describe()}, not {layout.describe()}"
    wanted_options = output_options(request)
    for name, value in wanted_options.items():
        recorded_value = manifest.options.get(name, UNRECORDED_OPTIONS.get(name))
        if recorded_value != value:
            return f"{name} {recorded_value!r}, not {value!r}"
    problems = file_problems(request.dst, manifest, hashes=verify_hashes)
    return "; ".join(problems) if problems else None


def _iteration_text(iteration: int | None, release: bool) -> str:
    return RELEASE if release else ("none" if iteration is None else str(iteration))


def skip_reason(request: ConvertRequest, verify_hashes: bool) -> tuple[bool, str]:
    """(whether the destination already holds this conversion, and if not, why)."""
    if not request.dst.exists():
        return False, "no output yet"
    try:
        manifest = read_manifest(request.dst)
        if manifest is None:
            return False, f"{request.dst} has no pgconvert.json"
        mismatch = manifest_mismatch(manifest, request, verify_hashes)
    except PgconvertError as error:
        return False, str(error)
    return (mismatch is None), mismatch or "complete"


def _share_cpus(threads: int) -> None:
    """Worker initializer: jobs running side by side split the cores instead of each taking all."""
    import torch

    torch.set_num_threads(threads)


def _run_conversion(request: ConvertRequest) -> tuple[float, str | None]:
    """One entry, in a worker process: seconds taken and the error, if any (never raises)."""
    started = time.perf_counter()
    options = {item.name: getattr(request, item.name) for item in fields(request) if item.name not in ("src", "dst")}
    try:
        convert(request.src, request.dst, **options)
    except PgconvertError as error:
        return time.perf_counter() - started, str(error)
    except Exception as error:  # a bug in one entry must not stop the others
        return time.perf_counter() - started, f"{type(error).__name__}: {error}"
    return time.perf_counter() - started, None


def run_plan(items: list[PlanItem], jobs: int = 1, force: bool = False, verify_hashes: bool = False,
             on_result: Callable[[EntryResult], None] | None = None, plan_name: str = "") -> BatchReport:
    """Run every entry, ``jobs`` at a time in spawned processes; a failed entry does not stop the rest.

    ``force`` converts entries whose output is already complete (replacing it); otherwise those
    are skipped. Results are in plan order; ``on_result`` hears of each as it is decided.
    """
    if jobs < 1:
        raise ValidationError(f"jobs={jobs}: must be >= 1")
    notify = on_result or (lambda result: None)
    entries = [entry for item in items for entry in expand(item)]
    _check_independent(entries, plan_name)
    results: dict[int, EntryResult] = {}
    pending: dict[int, tuple[ConvertRequest, str]] = {}
    for index, entry in enumerate(entries):
        if entry.request is None:
            results[index] = EntryResult(entry.label, entry.src, entry.dst, "failed", error=entry.error)
        elif force:
            pending[index] = (replace(entry.request, overwrite=True), "--force")
        else:
            skipped, reason = skip_reason(entry.request, verify_hashes)
            if skipped:
                remove_leftovers(entry.request.dst.absolute())  # of a run killed after its output was complete
                results[index] = EntryResult(entry.label, entry.src, entry.dst, "skipped")
            else:
                pending[index] = (entry.request, reason)
        if index in results:
            notify(results[index])
    if pending:
        context = multiprocessing.get_context("spawn")
        workers = min(jobs, len(pending))
        threads = max(1, (os.cpu_count() or 1) // workers)
        with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_share_cpus,
                                 initargs=(threads,)) as pool:
            futures = {pool.submit(_run_conversion, request): index for index, (request, _) in pending.items()}
            try:
                for future in as_completed(futures):
                    index = futures[future]
                    results[index] = _result(entries[index], future, pending[index])
                    notify(results[index])
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    return BatchReport(plan_name, [results[index] for index in sorted(results)])


def _result(entry: BatchEntry, future: Future[tuple[float, str | None]],
            pending: tuple[ConvertRequest, str]) -> EntryResult:
    request, reason = pending
    try:
        seconds, error = future.result()
    except BrokenProcessPool:
        seconds, error = 0.0, "the worker process died (killed, or out of memory)"
    if error is not None and request.dst.exists() and not request.overwrite:
        error = f"{error} (not skipped: {reason})"
    return EntryResult(entry.label, entry.src, entry.dst, "failed" if error else "ok", seconds, error)


def run_batch(plan: str | Path, jobs: int = 1, force: bool = False, verify_hashes: bool = False,
              on_result: Callable[[EntryResult], None] | None = None) -> BatchReport:
    """Read the plan file at ``plan`` and run it (see ``run_plan``)."""
    return run_plan(read_plan(plan), jobs, force, verify_hashes, on_result, plan_name=str(plan))
