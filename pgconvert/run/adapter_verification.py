"""``verify`` of two LoRA adapters: a PEFT adapter directory or a Megatron-Bridge adapter-only store on each side.

What is compared is each adapted weight's effective update, ``scaling * B @ A`` in float32 (the same whatever the
factorization, the TP split or a fused module's split into parts), within the report's rtol/atol; each adapted
weight's rank and scaling (a difference even where the updates agree); and, where both sides store factor tensors
under the same names, those tensors bit-exactly. Without a base model the two must be in the same form and are
compared by their own names (PEFT's HF weights, Megatron-Bridge's canonical ones); with ``base`` each side is put
in PEFT's names for the base's family as ``export-adapter`` puts it (``as_peft_adapter``) and mapped onto the base's
canonical weights by ``AdapterMerge``, so the two forms compare. One weight's two updates are held at a time.
Two DoRA adapters' magnitude vectors (per adapted weight, the canonical rows' with a base) are compared within the
same rtol/atol as the updates; a DoRA adapter against a plain LoRA one is a difference of method, named once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pgconvert.adapters import megatron, peft
from pgconvert.adapters.merge import AdapterMerge
from pgconvert.adapters.names import loaded_hf_weights, source_family
from pgconvert.errors import ValidationError
from pgconvert.formats import LoadOptions
from pgconvert.formats.registry import detect_format, get_loader
from pgconvert.formats.stream import CanonicalSource
from pgconvert.run.comparison import TensorDifference, compare_values, record_values

if TYPE_CHECKING:
    from pgconvert.run.verification import VerifyReport

AdapterRead = peft.PeftAdapter | megatron.MegatronAdapter


@dataclass
class _Side:
    """One adapter as compared: its form, each adapted weight's ranks and scalings, its update by weight, and its
    factor tensors by stored name (with the adapted weight each belongs to)."""

    form: str
    targets: dict[str, tuple[tuple[int, ...], tuple[float, ...]]]
    delta: Callable[[str], torch.Tensor]
    factors: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    factor_targets: dict[str, str] = field(default_factory=dict)
    # Whole weights it holds (PEFT's modules_to_save): compared only as factor tensors of the same name.
    saved: tuple[str, ...] = ()
    method: str = peft.LORA  # peft.DORA: each adapted weight also has a magnitude vector
    magnitude: Callable[[str], torch.Tensor | None] = lambda _weight: None


def adapter_form(path: Path) -> str | None:
    """``peft-lora`` for a PEFT adapter directory, ``megatron-bridge-lora`` for a Megatron-Bridge adapter-only
    store, None for anything else."""
    if peft.is_adapter_directory(path):
        return peft.ADAPTER_FORMAT
    return megatron.ADAPTER_FORMAT if megatron.find_adapter_store(path) is not None else None


def adapter_formats() -> tuple[str, str]:
    """What a report calls the two adapter forms (its ``format_a`` / ``format_b``)."""
    return peft.ADAPTER_FORMAT, megatron.ADAPTER_FORMAT


def adapter_forms(a: Path, b: Path, form_a: str | None, form_b: str | None) -> tuple[str, str]:
    """The forms ``adapter_form`` found for ``a`` and ``b``; refused when either is not an adapter."""
    if form_a is None or form_b is None:
        raise ValidationError(f"verify {a if form_a is None else b}: not a LoRA adapter (a PEFT adapter directory or "
                              "a Megatron-Bridge adapter-only checkpoint): --base compares two adapters; a model is "
                              "compared with its adapter merged by --merge-adapter")
    return form_a, form_b


def compare_adapters(report: VerifyReport, base: Path | None = None, base_iteration: int | None = None) -> None:
    """Compare the adapters ``report`` names (see the module's docstring) into it; ``base`` (its ``base_iteration``)
    is the model they adapt, needed when they are in different forms."""
    a, b = Path(report.a), Path(report.b)
    read_a, read_b = _read(a, report.format_a), _read(b, report.format_b)
    if base is None:
        if report.format_a != report.format_b:
            raise ValidationError(f"verify {a} ({report.format_a}) and {b} ({report.format_b}): adapters in "
                                  "different forms are compared on the base model they adapt: pass --base with the "
                                  "model they were trained on")
        _compare(_own_side(read_a), _own_side(read_b), report)
        return
    source = get_loader(detect_format(base)).open(base, LoadOptions(iteration=base_iteration))
    try:
        report.notes.append(f"compared as adapters of {base} ({source.format_name}): each adapted weight's update in "
                            "its canonical form")
        _compare(_base_side(read_a, base, source), _base_side(read_b, base, source), report)
    finally:
        source.close()


def _read(path: Path, form: str) -> AdapterRead:
    return peft.read_peft_adapter(path) if form == peft.ADAPTER_FORMAT else megatron.read_megatron_adapter(path)


def _own_side(adapter: AdapterRead) -> _Side:
    """The adapter in its own names: PEFT's HF weights, or Megatron-Bridge's canonical ones."""
    if isinstance(adapter, peft.PeftAdapter):
        targets = {weight: ((pair.rank,), (pair.scaling,)) for weight, pair in adapter.pairs.items()}
        return _Side(peft.ADAPTER_FORMAT, targets, adapter.delta, *_peft_factors(adapter),
                     tuple(sorted(adapter.replacements)), adapter.method, adapter.magnitude)
    targets = {weight: ((adapter.dim,), (adapter.alpha / adapter.dim,)) for weight in adapter.pairs}
    return _Side(megatron.ADAPTER_FORMAT, targets, adapter.delta, *_megatron_factors(adapter), method=adapter.method,
                 magnitude=lambda weight: adapter.pairs[weight].magnitude)


def _peft_factors(adapter: peft.PeftAdapter) -> tuple[dict[str, Callable[[], torch.Tensor]], dict[str, str]]:
    """Every tensor the adapter file holds, and the adapted weight of each pair's A and B."""
    factors = {key: partial(adapter.tensors.tensor, key) for key in adapter.tensors.header()}
    owners = {key: weight for weight, pair in adapter.pairs.items() for key in (pair.a_key, pair.b_key,
                                                                                 pair.magnitude_key) if key}
    return factors, owners


def _megatron_factors(bridge: megatron.MegatronAdapter) -> tuple[dict[str, Callable[[], torch.Tensor]],
                                                                 dict[str, str]]:
    """Each pair's linear_in and linear_out under its per-layer key, and the canonical weight it adapts."""
    factors: dict[str, Callable[[], torch.Tensor]] = {}
    owners = {}
    for weight, pair in bridge.pairs.items():
        for side, tensor in (("in", pair.linear_in), ("out", pair.linear_out)):
            key = f"{weight.removesuffix('.weight')}.adapter.linear_{side}.weight"
            factors[key] = partial(lambda held: held, tensor)
            owners[key] = weight
    return factors, owners


def _base_side(adapter: AdapterRead, base: Path, source: CanonicalSource) -> _Side:
    """The adapter on the base's canonical weights, as export-adapter and --merge-adapter map it; its factor tensors
    in its own names."""
    own = _own_side(adapter)
    if isinstance(adapter, megatron.MegatronAdapter):
        adapter = megatron.as_peft_adapter(adapter, source_family(source), source.config, base_model=str(base))
    merge = AdapterMerge(adapter, source)
    targets = {}
    for name in merge.targets:
        found = loaded_hf_weights(merge.family, name, source.config)
        pairs = [adapter.pairs[hf] for hf in (found[1] if found is not None else ()) if hf in adapter.pairs]
        targets[name] = (tuple(sorted({pair.rank for pair in pairs})), tuple(sorted({pair.scaling for pair in pairs})))
    return _Side(own.form, targets, merge.delta, own.factors, own.factor_targets, own.saved, own.method,
                 merge.magnitude)


def _compare(side_a: _Side, side_b: _Side, report: VerifyReport) -> None:
    """Targets, their ranks and scalings, their updates (and DoRA magnitudes) one at a time, then the factor tensors
    both store."""
    if side_a.method != side_b.method:
        report.differences.append(TensorDifference("method", "config", f"{side_a.method} in A, {side_b.method} in B: "
                                                                       "DoRA rescales each adapted weight's rows"))
    for name in sorted(side_a.targets.keys() | side_b.targets.keys()):
        if name not in side_a.targets or name not in side_b.targets:
            _one_sided(name, side_a if name in side_a.targets else side_b, "A" if name in side_a.targets else "B",
                       report)
            continue
        (ranks_a, scalings_a), (ranks_b, scalings_b) = side_a.targets[name], side_b.targets[name]
        if ranks_a != ranks_b:
            report.differences.append(TensorDifference(name, "config", f"rank {_listed(ranks_a)} in A, "
                                                                       f"{_listed(ranks_b)} in B"))
        if scalings_a != scalings_b:
            report.differences.append(TensorDifference(name, "config", f"scaling (alpha / r) {_listed(scalings_a)} "
                                                                       f"in A, {_listed(scalings_b)} in B"))
        delta_a, delta_b = side_a.delta(name), side_b.delta(name)
        if delta_a.shape != delta_b.shape:
            report.differences.append(TensorDifference(name, "shape", f"update of shape {list(delta_a.shape)} in A, "
                                                                      f"{list(delta_b.shape)} in B"))
        else:
            record_values(name, delta_a, delta_b, report.differences, report.rtol, report.atol,
                          "update scaling * B @ A")
        del delta_a, delta_b
        if side_a.method == side_b.method == peft.DORA:
            _compare_magnitudes(name, side_a.magnitude(name), side_b.magnitude(name), report)
        report.compared += 1
    _compare_factors(side_a, side_b, report)


def _compare_magnitudes(name: str, magnitude_a: torch.Tensor | None, magnitude_b: torch.Tensor | None,
                        report: VerifyReport) -> None:
    if magnitude_a is None or magnitude_b is None or magnitude_a.shape != magnitude_b.shape:
        shapes = [None if m is None else list(m.shape) for m in (magnitude_a, magnitude_b)]
        report.differences.append(TensorDifference(name, "shape", f"DoRA magnitude {shapes[0]} in A, {shapes[1]} "
                                                                  "in B"))
        return
    record_values(name, magnitude_a.to(torch.float32), magnitude_b.to(torch.float32), report.differences,
                  report.rtol, report.atol, "DoRA magnitude")


def _listed(values: tuple[float, ...]) -> str:
    return ", ".join(f"{value:g}" for value in values) if values else "none"


def _one_sided(name: str, side: _Side, label: str, report: VerifyReport) -> None:
    """A weight one adapter adapts and the other does not: a difference unless its update is zero."""
    if bool((side.delta(name) == 0).all()):
        report.notes.append(f"{name}: adapted in {label} only, with a zero update (the same as not adapted)")
    else:
        report.differences.append(TensorDifference(name, "missing", f"adapted in {label} only"))


def _compare_factors(side_a: _Side, side_b: _Side, report: VerifyReport) -> None:
    """The factor tensors both sides store under the same names, bit-exact; one side's alone named, unless it
    belongs to an adapted weight already compared or named."""
    if side_a.form != side_b.form:
        report.notes.append(f"factor tensors are stored in different forms ({side_a.form}, {side_b.form}): the "
                            "updates alone are compared")
        report.differences.extend(TensorDifference(weight, "missing", f"a whole saved weight (modules_to_save) in "
                                                                      f"{label} only: the other form holds none")
                                  for label, side in (("A", side_a), ("B", side_b)) for weight in side.saved)
        return
    for key in sorted(side_a.factors.keys() ^ side_b.factors.keys()):
        label, side = ("A", side_a) if key in side_a.factors else ("B", side_b)
        if key not in side.factor_targets:
            report.differences.append(TensorDifference(key, "missing", f"stored in {label} only"))
    for key in sorted(side_a.factors.keys() & side_b.factors.keys()):
        tensor_a, tensor_b = side_a.factors[key](), side_b.factors[key]()
        if tensor_a.dtype != tensor_b.dtype or tensor_a.shape != tensor_b.shape:
            report.differences.append(TensorDifference(
                key, "dtype" if tensor_a.dtype != tensor_b.dtype else "shape",
                f"{tensor_a.dtype} {list(tensor_a.shape)} in A, {tensor_b.dtype} {list(tensor_b.shape)} in B"))
            continue
        differing, max_abs = compare_values(tensor_a, tensor_b, 0.0, 0.0)
        if differing:
            report.differences.append(TensorDifference(
                key, "values", f"factor tensor: {differing} of {tensor_a.numel()} elements differ (bit-exact), max "
                               f"abs diff {max_abs:.6g}", max_abs_diff=max_abs, differing=differing,
                numel=tensor_a.numel()))
