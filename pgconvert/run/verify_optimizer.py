"""``verify``'s comparison of the two checkpoints' optimizer state, when both hold one.

Each side's state is opened and checked as ``convert``, ``inspect`` and ``export-optimizer`` open it
(``pgconvert.optimizer.checks.open_checked``: an ``OptimizerSource`` whatever the format; state that fails the checks
is a difference, below; NaN/Inf met in the values read are notes) and compared per canonical parameter, one parameter at
a time (``parameter(name)``: the fp32 master ``param``, ``exp_avg``, ``exp_avg_sq`` and ``step`` of
that parameter alone), so memory holds one parameter's state per side whatever the model size:

- ``param``, ``exp_avg``, ``exp_avg_sq``: shape and values with the model's rtol/atol (bit-exact by
  default); vocab tables over every row both sides hold, the padding rows too (a conversion carries the rows that
  fit), rows one side alone holds reported as padding only;
- ``step`` exactly, and each parameter's param group by its role (``group_role``: weight decay or not, decoupled
  learning rates), not its position;
- each parameter's param group hyperparameters (lr, weight_decay, betas, eps, ...), matched by the
  parameters a group holds, not by its position: megatron-core chains a second (expert) optimizer at
  expert parallel > 1 and not at 1, and the layer-wise optimizer gives the experts a group of their own there, so
  the same groups sit at other positions after an EP change (``is_expert_parallel`` says which, and is not
  compared; the groups' ``step`` is the per-parameter one);
- the carried counters present on both sides: iteration, ``opt_param_scheduler``,
  ``num_floating_point_operations_so_far``, the consumed-samples counters in ``args``;
- the grad scaler of each chained optimizer (its scale, growth and hysteresis trackers; one side without one is a
  difference), as a conversion carries it.

A side without optimizer state (``holds_optimizer`` False: HF, a ``--skip-optimizer`` output) is reported ("only in A"), not a
difference. A side whose form pgconvert does not read (``UnsupportedOptimizerError``, a
``ValidationError``) is named with the reason, not a difference; state that does not match its model
(``OptimizerLayoutError``) is a difference (kind ``unreadable``): nothing proves it equal.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pgconvert.errors import PgconvertError, ValidationError
from pgconvert.formats.stream import CanonicalSource
from pgconvert.io.limits import quote
from pgconvert.model.provider import VOCAB_TABLES
from pgconvert.optimizer.checks import open_checked
from pgconvert.optimizer.scaler import GRAD_SCALER, target_scalers
from pgconvert.optimizer.source import CARRIED_KEYS, COUNTERS, OptimizerSource, optimizer_label
from pgconvert.run.comparison import DifferenceKind, TensorDifference, compare_values


@dataclass(frozen=True)
class OptimizerDifference(TensorDifference):
    """A difference in optimizer state: ``name`` is the canonical parameter (or ``optimizer.<setting>``),
    ``field`` what differs: param, exp_avg, exp_avg_sq, step, group, a hyperparameter or a counter."""

    field: str = ""


@dataclass
class OptimizerReport:
    """The optimizer part of ``VerifyReport``. ``status``: compared, only in A, only in B, in neither,
    skipped (``skip_optimizer``), or not compared (a side's state unreadable: ``unreadable_a/b``)."""

    status: str = "in neither"
    form_a: str | None = None
    form_b: str | None = None
    unreadable_a: str | None = None
    unreadable_b: str | None = None
    compared: int = 0
    differences: list[OptimizerDifference] = field(default_factory=list)
    padding_differences: list[OptimizerDifference] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return not self.differences

    def add(self, name: str, field_name: str, kind: DifferenceKind, message: str) -> None:
        self.differences.append(OptimizerDifference(name, kind, message, field=field_name))


def compare_optimizers(source_a: CanonicalSource, source_b: CanonicalSource, rtol: float, atol: float,
                       progress: Callable[[str], None] | None = None) -> OptimizerReport:
    """The optimizer state of two open checkpoints compared (see the module's docstring)."""
    report = OptimizerReport()
    vocab_a, vocab_b = source_a.config.vocab_size, source_b.config.vocab_size
    # The true vocab rows of vocab tables (a disagreement is a model difference already; compare all rows then).
    vocab = vocab_b if vocab_a is None else vocab_a if vocab_b is None or vocab_a == vocab_b else None
    held = [_held(source) for source in (source_a, source_b)]
    if held != [True, True]:
        report.status = "only in A" if held[0] else "only in B" if held[1] else "in neither"
        return report
    opened = [_open_side(label, source, report) for label, source in (("A", source_a), ("B", source_b))]
    if opened[0] is None or opened[1] is None:
        report.status = "not compared"
        return report
    optimizer_a, optimizer_b = opened
    report.status = "compared"
    report.form_a, report.form_b = _form(optimizer_a), _form(optimizer_b)
    _compare_groups(optimizer_a, optimizer_b, report)
    _compare_counters(optimizer_a, optimizer_b, report)
    names_a, names_b = optimizer_a.names(), optimizer_b.names()
    in_b = set(names_b)
    for name in sorted(set(names_a) - in_b):
        report.add(name, "", "missing", "optimizer state in A only")
    for name in sorted(in_b - set(names_a)):
        report.add(name, "", "missing", "optimizer state in B only")
    for name in (name for name in names_a if name in in_b):
        if progress is not None:
            progress(f"optimizer {name}")
        _compare_parameter(name, optimizer_a, optimizer_b, rtol, atol, vocab, report)
        report.compared += 1
    # What the values read said (NaN/Inf), as convert would say it of each side.
    report.notes += [f"{label}: {notice}" for label, optimizer in (("A", optimizer_a), ("B", optimizer_b))
                     for notice in optimizer.notices]
    return report


def _held(source: CanonicalSource) -> bool:
    """Whether the checkpoint holds optimizer state (one that cannot be read is opened, and reported, below)."""
    try:
        return source.holds_optimizer()
    except PgconvertError:
        return True


def _form(optimizer: OptimizerSource) -> str:
    sharding = optimizer.sharding  # the stored form's name, where the format gives one (torch_dist)
    return f"{optimizer.form}, {sharding}" if sharding else optimizer.form


def _open_side(label: str, source: CanonicalSource, report: OptimizerReport) -> OptimizerSource | None:
    """The side's optimizer state, or None with the reason recorded (unsupported: named; broken: a difference)."""
    try:
        return open_checked(source)
    except ValidationError as error:  # UnsupportedOptimizerError: a form or model pgconvert does not read
        setattr(report, f"unreadable_{label.lower()}", str(error))
    except PgconvertError as error:  # OptimizerLayoutError: state that does not match its model
        setattr(report, f"unreadable_{label.lower()}", str(error))
        report.add(f"optimizer state of {label}", "", "unreadable", str(error))
    return None


def _compare_parameter(name: str, optimizer_a: OptimizerSource, optimizer_b: OptimizerSource, rtol: float,
                       atol: float, vocab: int | None, report: OptimizerReport) -> None:
    try:
        state_a = optimizer_a.parameter(name)
        state_b = optimizer_b.parameter(name)
    except PgconvertError as error:
        report.add(name, "", "unreadable", str(error))
        return
    fields_a, fields_b = optimizer_a.fields(name), optimizer_b.fields(name)
    if fields_a != fields_b:  # one side's Muon parameter, the other's Adam one
        report.add(name, "fields", "config", f"state {', '.join(fields_a)} in A, {', '.join(fields_b)} in B")
        return
    for key in fields_a:
        _compare_field(name, key, state_a[key], state_b[key], rtol, atol,
                       vocab if name in VOCAB_TABLES else None, report)
    if "step" in state_a:
        step_a, step_b = float(state_a["step"]), float(state_b["step"])
        if step_a != step_b and not (math.isnan(step_a) and math.isnan(step_b)):
            report.add(name, "step", "values", f"step {step_a:g} in A, {step_b:g} in B")
    role_a, role_b = optimizer_a.group_role(name), optimizer_b.group_role(name)
    if role_a != role_b:
        report.add(name, "group", "config", f"param group {optimizer_a.group_of(name)} ({_role(role_a)}) in A, "
                   f"{optimizer_b.group_of(name)} ({_role(role_b)}) in B")
    del state_a, state_b


def _role(overrides: dict[str, float]) -> str:
    return ", ".join(f"{key}={value:g}" for key, value in overrides.items())


def _compare_field(name: str, key: str, tensor_a: torch.Tensor, tensor_b: torch.Tensor, rtol: float, atol: float,
                   vocab: int | None, report: OptimizerReport) -> None:
    """One field of one parameter. A vocab table (``vocab`` set) may hold more or fewer padding rows on one side (its
    padded size follows the layout): every row both sides hold is compared, the padding ones too (a conversion
    carries the rows that fit, and megatron-core trains the padding rows of the output layer); rows one side
    alone holds are reported as padding only."""
    shape_a, shape_b = list(tensor_a.shape), list(tensor_b.shape)
    if vocab is not None:
        mismatched = shape_a[1:] != shape_b[1:] or min(shape_a[0], shape_b[0]) < vocab
    else:
        mismatched = shape_a != shape_b
    if mismatched:
        report.add(name, key, "shape", f"shape {shape_a} in A, {shape_b} in B")
        return
    if vocab is None:
        _record(name, key, tensor_a, tensor_b, rtol, atol, report.differences, None)
        return
    _record(name, key, tensor_a[:vocab], tensor_b[:vocab], rtol, atol, report.differences, f"first {vocab} rows")
    held = min(shape_a[0], shape_b[0])
    if held > vocab:
        _record(name, key, tensor_a[vocab:held], tensor_b[vocab:held], rtol, atol, report.differences,
                f"padding rows {vocab}..{held - 1}")
    if shape_a[0] != shape_b[0]:
        report.padding_differences.append(OptimizerDifference(
            name, "shape", f"{shape_a[0]} rows in A, {shape_b[0]} in B (padding beyond the true vocab {vocab}; the "
            f"{held} rows both hold are compared)", field=key))


def _record(name: str, key: str, tensor_a: torch.Tensor, tensor_b: torch.Tensor, rtol: float, atol: float,
            into: list[OptimizerDifference], where: str | None) -> None:
    differing, max_abs = compare_values(tensor_a, tensor_b, rtol, atol)
    if differing:
        into.append(OptimizerDifference(
            name, "values", f"{differing} of {tensor_a.numel()} elements differ"
            f"{f' in the {where}' if where else ''}, max abs diff {max_abs:.6g}",
            max_abs_diff=max_abs, differing=differing, numel=tensor_a.numel(), field=key))


def _compare_groups(optimizer_a: OptimizerSource, optimizer_b: OptimizerSource, report: OptimizerReport) -> None:
    """Each parameter's param group hyperparameters on both sides; one difference per setting and values,
    named by A's group (``optimizer[1].param_groups[0].lr`` where A chains two optimizers), with how many
    parameters it concerns and the first of them."""
    groups_a, groups_b = _groups_by_parameter(optimizer_a), _groups_by_parameter(optimizer_b)
    differing: dict[tuple[str, str], tuple[str, int]] = {}
    for name in (name for name in groups_a if name in groups_b):
        (label, settings_a), (_, settings_b) = groups_a[name], groups_b[name]
        if settings_a is None or settings_b is None:
            side = "A" if settings_a is None else "B"
            differing[(label, f"the param group that holds it is missing in {side}")] = (name, 1)
            continue
        probe = OptimizerReport()
        _compare_values(label, settings_a, settings_b, probe, skip=LAYOUT_GROUP_KEYS)
        for difference in probe.differences:
            first, count = differing.get((difference.name, difference.message), (name, 0))
            differing[(difference.name, difference.message)] = (first, count + 1)
    for (setting, message), (first, count) in differing.items():
        report.add(setting, setting.rsplit(".", 1)[-1], "config",
                   f"{message} for {count} parameter{'s' if count > 1 else ''} ({first}{', …' if count > 1 else ''})")


# Param-group entries that are not hyperparameters: the members, the per-parameter step, and which
# chained optimizer the group is in (it follows the expert-parallel size).
LAYOUT_GROUP_KEYS = frozenset({"params", "step", "is_expert_parallel"})


def _groups_by_parameter(optimizer: OptimizerSource) -> dict[str, tuple[str, dict[str, Any] | None]]:
    """Per canonical parameter, the name and settings of the param group that holds it (None: missing)."""
    settings: dict[int, list[dict[str, Any]]] = {}
    chained = len({optimizer.optimizer_of(name) for name in optimizer.names()}) > 1
    by_name = {}
    for name in optimizer.names():
        index, group = optimizer.optimizer_of(name), optimizer.group_of(name)
        if index not in settings:
            settings[index] = optimizer.param_group_settings(index)
        label = f"optimizer[{index}].param_groups[{group}]" if chained else f"optimizer.param_groups[{group}]"
        by_name[name] = (label, settings[index][group] if group < len(settings[index]) else None)
    return by_name


def _compare_counters(optimizer_a: OptimizerSource, optimizer_b: OptimizerSource, report: OptimizerReport) -> None:
    """The carried counters (iteration, scheduler, floating-point operations, consumed samples) both sides have, and
    the grad scaler of each chained optimizer (``optimizer.grad_scaler.scale``; None where a side has none), as a
    conversion carries it: a side without that chained optimizer gives its dense one's (``target_scalers``)."""
    _compare_values("optimizer", _counters(optimizer_a), _counters(optimizer_b), report, skip=set())
    count = max(len(optimizer.grad_scalers or [None]) for optimizer in (optimizer_a, optimizer_b))
    scalers = [target_scalers(optimizer, count) for optimizer in (optimizer_a, optimizer_b)]
    for index in range(count):
        _compare_values(optimizer_label(index, count), {GRAD_SCALER: scalers[0][index]},
                        {GRAD_SCALER: scalers[1][index]}, report, skip=set())


def _counters(optimizer: OptimizerSource) -> dict[str, Any]:
    extra = optimizer.first.extra
    values = {key: extra[key] for key in ("iteration", *CARRIED_KEYS) if extra.get(key) is not None}
    args = extra.get("args")
    values.update({key: getattr(args, key) for key in COUNTERS if getattr(args, key, None) is not None})
    return values


def _compare_values(prefix: str, values_a: dict[Any, Any], values_b: dict[Any, Any], report: OptimizerReport,
                    skip: set[str]) -> None:
    """Settings present on both sides compared (nested dicts by key); one present on one side only is a note."""
    for key in sorted(set(values_a) | set(values_b), key=str):
        if key in skip:
            continue
        name = f"{prefix}.{key}"
        if key not in values_a or key not in values_b:
            report.notes.append(f"{name} only in {'A' if key in values_a else 'B'} (not compared)")
        elif isinstance(values_a[key], dict) and isinstance(values_b[key], dict):
            _compare_values(name, values_a[key], values_b[key], report, skip)
        elif not _same(values_a[key], values_b[key]):
            report.add(name, str(key), "config",
                       f"{quote(key)} = {quote(values_a[key])} in A, {quote(values_b[key])} in B")


def _same(value_a: Any, value_b: Any) -> bool:
    """Exact equality of plain settings: tensors by ``torch.equal``, lists and tuples alike, NaN equal to NaN."""
    if isinstance(value_a, torch.Tensor) or isinstance(value_b, torch.Tensor):
        return isinstance(value_a, torch.Tensor) and isinstance(value_b, torch.Tensor) \
            and value_a.shape == value_b.shape and bool(compare_values(value_a, value_b, 0.0, 0.0)[0] == 0)
    if isinstance(value_a, (list, tuple)) and isinstance(value_b, (list, tuple)):
        return len(value_a) == len(value_b) and all(_same(a, b) for a, b in zip(value_a, value_b))
    if isinstance(value_a, float) and isinstance(value_b, float) and math.isnan(value_a) and math.isnan(value_b):
        return True
    return bool(value_a == value_b)


def text_lines(report: OptimizerReport, tolerance: str, max_listed: int) -> list[str]:
    """``verify``'s text output for the optimizer state: status, notes, differences up to ``max_listed``."""
    lines = [f"note: {note}" for note in report.notes]
    listed = {difference.name for difference in report.differences[:max_listed]}
    for label, reason in (("A", report.unreadable_a), ("B", report.unreadable_b)):
        if reason is not None and f"optimizer state of {label}" not in listed:
            lines.append(f"optimizer state of {label} unreadable: {reason}")
    for difference in report.differences[:max_listed]:
        lines.append(f"differs: {_label(difference)}: {difference.message}")
    if len(report.differences) > max_listed:
        lines.append(f"… and {len(report.differences) - max_listed} more optimizer differences (--json lists all)")
    for difference in report.padding_differences:
        lines.append(f"padding only (not a failure): {_label(difference)}: {difference.message}")
    if report.status != "compared":
        return lines + [f"optimizer state: {report.status}"]
    verdict = "equal" if report.equal else f"NOT equal: {len(report.differences)} optimizer differences"
    forms = report.form_a if report.form_a == report.form_b else f"{report.form_a} in A, {report.form_b} in B"
    return lines + [f"optimizer state ({forms}): {report.compared} parameters compared ({tolerance}): {verdict}"]


def _label(difference: OptimizerDifference) -> str:
    """``optimizer <parameter> <field>``, or the setting's own name (``optimizer.param_groups[0].lr``)."""
    if difference.name.startswith("optimizer"):
        return difference.name
    return f"optimizer {difference.name}" + (f" {difference.field}" if difference.field else "")
