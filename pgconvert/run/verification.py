"""``verify``: two checkpoints of any format and layout compared tensor by tensor in canonical form.

Streaming: one canonical tensor is loaded from A, then from B, compared in fixed-size blocks and
freed before the next, so memory stays at two tensors whatever the model size. Vocab tables are
compared over the true vocab rows when the true vocab size is known; rows beyond it are padding,
and differences there are reported apart, not as failures.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pgconvert.adapters.merge import attach_adapter
from pgconvert.errors import PgconvertError, ValidationError
from pgconvert.formats import LoadOptions
from pgconvert.run.adapter_verification import adapter_form, adapter_forms, compare_adapters
from pgconvert.run.comparison import TensorDifference, record_values
from pgconvert.run.manifest import MANIFEST_FILE, file_problems, read_manifest
from pgconvert.model.provider import VOCAB_TABLES
from pgconvert.formats.registry import detect_format, get_loader
from pgconvert.run.verify_optimizer import OptimizerReport, compare_optimizers
from pgconvert.semantics import SEMANTIC_FIELDS
from pgconvert.semantics import differences as semantic_differences
from pgconvert.formats.stream import CanonicalSource

@dataclass
class VerifyReport:
    """The outcome of ``verify``: ``equal`` when no tensor and no manifest-listed file differs."""

    a: str
    b: str
    format_a: str
    format_b: str
    layout_a: str | None
    layout_b: str | None
    rtol: float
    atol: float
    compared: int = 0
    differences: list[TensorDifference] = field(default_factory=list)
    padding_differences: list[TensorDifference] = field(default_factory=list)
    file_problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # The optimizer state compared (None: not looked at, skip_optimizer).
    optimizer: OptimizerReport | None = None

    @property
    def equal(self) -> bool:
        return not self.differences and not self.file_problems and (self.optimizer is None or self.optimizer.equal)

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["equal"] = self.equal
        optimizer = doc["optimizer"] or {"differences": [], "padding_differences": []}
        if doc["optimizer"] is None:
            doc["optimizer"] = {"status": "skipped"}
        for item in (*doc["differences"], *doc["padding_differences"], *optimizer["differences"],
                     *optimizer["padding_differences"]):
            if item["max_abs_diff"] is not None and not math.isfinite(item["max_abs_diff"]):
                item["max_abs_diff"] = str(item["max_abs_diff"])  # JSON has no inf/nan
        return doc


def _open(path: Path, iteration: int | None, true_vocab_size: int | None) -> CanonicalSource:
    # The integrity manifest is checked apart (``_check_integrity``), so a mismatch is reported, not raised.
    return get_loader(detect_format(path)).open(path, LoadOptions(iteration=iteration, true_vocab_size=true_vocab_size,
                                                                  verify_integrity="off"))


def _layout_text(source: CanonicalSource) -> str | None:
    layout = source.layout
    return layout.describe() if layout is not None else None


def verify(a: str | Path, b: str | Path, rtol: float = 0.0, atol: float = 0.0, *,
           iteration_a: int | None = None, iteration_b: int | None = None,
           true_vocab_size: int | None = None,
           progress: Callable[[str], None] | None = None, skip_optimizer: bool = False,
           merge_adapter: str | Path | None = None, base: str | Path | None = None,
           base_iteration: int | None = None) -> VerifyReport:
    """Compare checkpoints ``a`` and ``b`` (any formats and layouts) tensor by tensor.

    With ``rtol = atol = 0`` values must be bit-identical. Shapes and dtypes are compared too.
    A ``pgconvert.json`` manifest in either checkpoint has every listed file's size and digest
    checked. Raises ``PgconvertError`` only when a checkpoint cannot be opened. The optimizer state is
    compared too when both hold one (``verify_optimizer``), unless ``skip_optimizer``. ``merge_adapter``: a PEFT
    LoRA adapter directory merged into ``a`` as it is read (what ``convert --merge-adapter`` writes).

    When ``a`` and ``b`` are LoRA adapters (a PEFT adapter directory, a Megatron-Bridge adapter-only checkpoint),
    their adapted weights are compared (``adapter_verification``); ``base`` (its ``base_iteration``) is the model
    they adapt, needed when they are in different forms.
    """
    if rtol < 0 or atol < 0 or math.isnan(rtol) or math.isnan(atol):
        raise ValidationError(f"rtol={rtol}, atol={atol}: tolerances must be >= 0")
    a, b = Path(a), Path(b)
    form_a, form_b = adapter_form(a), adapter_form(b)
    if base is not None or form_a is not None or form_b is not None:
        if iteration_a is not None or iteration_b is not None:
            raise ValidationError(f"verify {a} {b}: --iteration-a/--iteration-b open a model checkpoint's iteration; "
                                  "to compare an adapter run's other iteration, name its iteration directory")
        forms = adapter_forms(a, b, form_a, form_b)
        return _verify_adapters(a, b, forms, rtol, atol, merge_adapter, base, base_iteration)
    source_a = _open(a, iteration_a, true_vocab_size)
    try:
        if merge_adapter is not None:
            attach_adapter(source_a, Path(merge_adapter), keep_quantized=False)
        source_b = _open(b, iteration_b, true_vocab_size)
    except BaseException:
        source_a.close()
        raise
    try:
        report = VerifyReport(str(a), str(b), source_a.format_name, source_b.format_name,
                              _layout_text(source_a), _layout_text(source_b), rtol, atol)
        for label, root, source in (("A", a, source_a), ("B", b, source_b)):
            _check_manifest(label, root, report)
            _check_integrity(label, source, report)
            _note_embedded_adapter(label, source, report)
        _compare_sources(source_a, source_b, report, progress or (lambda name: None))
        if not skip_optimizer:
            report.optimizer = compare_optimizers(source_a, source_b, rtol, atol, progress)
    finally:
        source_a.close()
        source_b.close()
    return report


def _verify_adapters(a: Path, b: Path, forms: tuple[str, str], rtol: float, atol: float,
                     merge_adapter: str | Path | None, base: str | Path | None,
                     base_iteration: int | None) -> VerifyReport:
    if merge_adapter is not None:
        raise ValidationError(f"--merge-adapter {merge_adapter}: merges an adapter into a model; {a} and {b} are "
                              "compared as adapters (--base names the model they adapt)")
    report = VerifyReport(str(a), str(b), *forms, None, None, rtol, atol)
    compare_adapters(report, None if base is None else Path(base), base_iteration)
    return report


def _note_embedded_adapter(label: str, source: CanonicalSource, report: VerifyReport) -> None:
    """A LoRA adapter the checkpoint holds beside its model and that is not merged: what is compared is said."""
    embedded = source.embedded_adapter
    if embedded is not None and source.adapter is None:
        report.notes.append(f"{label}: {embedded.store} holds a LoRA adapter beside the model: the base model alone is "
                            f"compared (--merge-adapter {embedded.store} compares it merged)")


def _check_manifest(label: str, root: Path, report: VerifyReport) -> None:
    try:
        manifest = read_manifest(root)
    except PgconvertError as error:
        report.file_problems.append(f"{label}: {error}")
        return
    if manifest is None:
        return
    report.notes.append(f"{label}: checked {len(manifest.files)} files against {root / MANIFEST_FILE}")
    report.file_problems.extend(f"{label} ({root}): {problem}" for problem in file_problems(root, manifest))


def _check_integrity(label: str, source: CanonicalSource, report: VerifyReport) -> None:
    """The checkpoint's own integrity manifest (torch_dist's integrity.json), where it has one."""
    try:
        present, problems = source.integrity_problems()
    except PgconvertError as exc:  # a manifest that cannot be read is itself a problem of the files
        report.file_problems.append(f"{label}: {exc}")
        return
    if present:
        report.notes.append(f"{label}: checked the files listed in its integrity.json")
    report.file_problems.extend(f"{label}: {problem}" for problem in problems)


def _true_vocab(source_a: CanonicalSource, source_b: CanonicalSource, report: VerifyReport) -> int | None:
    vocab_a, vocab_b = source_a.config.vocab_size, source_b.config.vocab_size
    if vocab_a is not None and vocab_b is not None and vocab_a != vocab_b:
        report.differences.append(TensorDifference(
            "model_config.vocab_size", "config", f"true vocab size {vocab_a} in A, {vocab_b} in B"))
        return None
    return vocab_a if vocab_a is not None else vocab_b


def _compare_sources(source_a: CanonicalSource, source_b: CanonicalSource, report: VerifyReport,
                     progress: Callable[[str], None]) -> None:
    config_a, config_b = source_a.config.to_dict(), source_b.config.to_dict()
    # A setting that changes the computation makes two checkpoints unequal whatever their tensors.
    failures, training_notes = semantic_differences(source_a.config, source_b.config)
    for field_name, text in failures:
        report.differences.append(TensorDifference(f"model_config.{field_name}", "config", text))
    if training_notes:
        report.notes.append("training-only settings differ (the forward pass does not use them): "
                            + "; ".join(training_notes))
    changed = sorted(key for key in config_a if key not in SEMANTIC_FIELDS and key != "vocab_size"
                     and config_a[key] != config_b.get(key))
    if changed:
        report.notes.append("model configs differ in " + ", ".join(
            f"{key} ({config_a[key]!r} vs {config_b.get(key)!r})" for key in changed))
    vocab = _true_vocab(source_a, source_b, report)
    names_a, names_b = source_a.names(), source_b.names()
    in_b = set(names_b)
    for name in sorted(set(names_a) - in_b):
        report.differences.append(TensorDifference(name, "missing", "in A only"))
    for name in sorted(in_b - set(names_a)):
        report.differences.append(TensorDifference(name, "missing", "in B only"))
    for name in names_a:
        if name not in in_b:
            continue
        progress(name)
        _compare_tensor(name, source_a, source_b, vocab, report)
        report.compared += 1
    if any(extra.holds_state() for source in (source_a, source_b) for extra in source.extra_states().values()):
        report.notes.append("opaque _extra_state entries (TE FP8 metadata) are not compared")


def _compare_tensor(name: str, source_a: CanonicalSource, source_b: CanonicalSource, vocab: int | None,
                    report: VerifyReport) -> None:
    meta_a, meta_b = source_a.meta(name), source_b.meta(name)
    if meta_a.dtype != meta_b.dtype:
        report.differences.append(TensorDifference(name, "dtype", f"dtype {meta_a.dtype} in A, {meta_b.dtype} in B"))
        return
    vocab_table = name in VOCAB_TABLES and vocab is not None
    if vocab_table:
        # Row counts may differ by padding alone; only the true vocab rows must agree.
        mismatched = meta_a.shape[1:] != meta_b.shape[1:] or min(meta_a.shape[0], meta_b.shape[0]) < vocab
    else:
        mismatched = meta_a.shape != meta_b.shape
    if mismatched:
        report.differences.append(TensorDifference(
            name, "shape", f"shape {list(meta_a.shape)} in A, {list(meta_b.shape)} in B"))
        return
    try:
        tensor_a = source_a.load(name)
        tensor_b = source_b.load(name)
    except PgconvertError as error:
        report.differences.append(TensorDifference(name, "unreadable", str(error)))
        return
    for label, source in (("A", source_a), ("B", source_b)):
        why = source.inexact(name)
        if why is not None:  # equal in canonical form would not mean equal as stored
            report.differences.append(TensorDifference(name, "inexact", f"{label} stores values its canonical form "
                                                                        f"does not hold: {why}"))
    if vocab_table:
        assert vocab is not None
        record_values(name, tensor_a[:vocab], tensor_b[:vocab], report.differences, report.rtol, report.atol,
                      f"first {vocab} rows")
        rows_a, rows_b = meta_a.shape[0], meta_b.shape[0]
        if rows_a != rows_b:
            report.padding_differences.append(TensorDifference(
                name, "shape", f"{rows_a} rows in A, {rows_b} in B (padding beyond the true vocab {vocab})"))
        elif rows_a > vocab:
            record_values(name, tensor_a[vocab:], tensor_b[vocab:], report.padding_differences, report.rtol,
                          report.atol, f"padding rows {vocab}..{rows_a - 1}")
    else:
        record_values(name, tensor_a, tensor_b, report.differences, report.rtol, report.atol, None)
    del tensor_a, tensor_b
