"""The one validation pass over a checkpoint's optimizer state, for every command that reaches it.

``open_checked`` is where ``convert`` (``--dry-run`` included), ``inspect``, ``verify`` and ``export-optimizer`` open
a source's optimizer state: it opens it (``CanonicalSource.open_optimizer``), gives it the source's NaN/Inf policy
(``--check-finite``: the weights' own, ``pgconvert.formats.stream.apply_finite_policy``) and checks, before anything
is written, what the format's reader hands over (``OptimizerSource.stored_copies``: each rank file,
``distrib_optim.pt``, torch_dist common state or model-parallel rank's objects):

- what every rank saves alike is the same in every copy: the param groups (their number and hyperparameters:
  lr, weight_decay, betas, eps, ...; ``params`` aside, each rank's own positions), the steps, the scheduler state,
  the grad scaler, the buffers' dtype keys, the iteration (also the one its directory names) and the
  floating-point operations; a difference is a named error showing both values and both places;
- each value's range: a step finite, >= 0 and integral; lr, max_lr, min_lr, lr_mult, wd_mult and weight_decay
  finite and >= 0 (torch.optim.Adam refuses a negative lr or weight decay); betas in [0, 1) (Adam's bounds); eps
  finite and > 0 (Adam divides by ``sqrt(exp_avg_sq) + eps``); a grad scaler's scale finite and > 0;
- the number of param groups of each chained optimizer is the one megatron-core builds for the model
  (``order.group_counts``: weight decay, the embedding and output with decoupled_lr, and no weight decay);
- the distributed optimizer's buffer dtype keys are ``(parameter dtype, grad dtype)`` with the parameter dtype of
  the model's stored weights, and both what the run's args give (``flat.buffer_dtype_key``); a plain optimizer's
  form fits the weights (FP32Optimizer: float32 weights, its masters; fp32 masters beside them: bf16/fp16).

The values (fp32 masters, Adam's moments) are checked where they are read (``OptimizerSource.parameter`` and
``piece``): by ``convert`` on their way to the output, by ``verify`` as it compares them, by ``inspect`` in one pass
(``scan_values``); ``--dry-run`` reads none, as for the weights.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pgconvert.formats.stream import CanonicalSource
from pgconvert.io.limits import quote
from pgconvert.io.sizes import dtype_name
from pgconvert.optimizer.flat import buffer_dtype_key
from pgconvert.optimizer.order import (EMERGING, MEGATRON_CORE_VERSIONS, OptimizerLayoutError,
                                       UnsupportedOptimizerError, group_counts, layer_wise_kind)
from pgconvert.optimizer.source import (ABSENT, FORM_DISTRIBUTED, FORM_FP16, FORM_FP32, FORM_LAYER_WISE,
                                        OptimizerSource, StoredCopy, optimizer_label)

_VERSIONS = "megatron-core " + " / ".join(MEGATRON_CORE_VERSIONS)
# Param-group hyperparameters that are finite numbers >= 0: torch.optim.Adam refuses a negative lr or weight decay,
# and megatron-core's scheduler sets each group's lr and weight decay from max_lr, min_lr, lr_mult and wd_mult.
_NON_NEGATIVE = ("lr", "max_lr", "min_lr", "lr_mult", "wd_mult", "weight_decay")
# What each chained optimizer's groups are (order.py).
_GROUPS = ("weight decay, then no weight decay: 1-dim parameters and biases",
           "weight decay, then no weight decay only with expert biases (add_bias_linear)")
# Where a copy holds steps (a plain optimizer's per-parameter ones).
_STATE_STEPS = "optimizer.state[*].step"


class OptimizerStateError(OptimizerLayoutError):
    """Optimizer state whose values disagree between ranks, are out of range, or contradict the model."""


# Megatron-LM's --optimizer values other than Adam, and the state each keeps per parameter (megatron-core 0.19.2 and
# Megatron-LM d98e8a64; validate_args rewrites dist_muon to muon, and --use-distributed-optimizer with any of the
# emerging ones to the layer-wise distributed optimizer).
OTHER_OPTIMIZERS = {
    "sgd": "torch SGD's momentum_buffer",
    "muon": "Muon's momentum_buffer for the 2-dim weights, Adam's (or Lion's) moments for the embeddings, output "
            "layer, norms and biases, as two chained optimizers",
    "adaptive_muon": "Muon's momentum_buffer and a second moment for the 2-dim weights, Adam's moments for the rest",
    "lion": "Lion's exp_avg for the 2-dim weights, Adam's moments for the rest, as two chained optimizers",
    "soap": "SOAP's Kronecker-factored preconditioners",
}


def optimizer_kind_refusal(source: CanonicalSource) -> str | None:
    """Why the run's optimizer state is not read (None: it is Adam's, megatron-core's default, or the source records
    no Megatron args): its ``args.optimizer`` (absent: Adam) names another optimizer, whose state per parameter is
    not Adam's ``exp_avg``/``exp_avg_sq``/``step``, or the run used the layer-wise distributed optimizer."""
    args = source.megatron_args
    kind = getattr(args, "optimizer", None) or "adam"
    layer_wise = bool(getattr(args, "use_layer_wise_distributed_optimizer", False))
    if (layer_wise_kind(kind) if layer_wise and kind in EMERGING else kind) in source.optimizer_kinds:
        return None
    how = " with the layer-wise distributed optimizer (use_layer_wise_distributed_optimizer)" if layer_wise else ""
    state = OTHER_OPTIMIZERS.get(kind, "state of its own")
    read = ""
    if kind in EMERGING:
        read = (" and Muon's and Lion's: plain from torch_dist and per-rank files, with the layer-wise distributed "
                "optimizer from torch_dist")
    return (f"{source.describe()}: args.optimizer={quote(kind)}{how}: the run's optimizer state ({state}) is not "
            f"read from {source.format_name}; pgconvert carries megatron-core's Adam state (exp_avg, exp_avg_sq, step "
            f"and the fp32 masters){read}; pass --skip-optimizer to convert the model alone")


def open_checked(source: CanonicalSource) -> OptimizerSource:
    """``source``'s optimizer state, opened and checked (the module's docstring), its values under the source's
    NaN/Inf policy. Raises ``OptimizerLayoutError`` (``OptimizerStateError`` among them) naming what is wrong, and
    a reader's ``ValidationError`` for a form or model it does not read, state its source does not carry
    (``CanonicalSource.optimizer_refusal``), or an optimizer other than Adam (``optimizer_kind_refusal``)."""
    refused = source.optimizer_refusal() or optimizer_kind_refusal(source)
    if refused:
        raise UnsupportedOptimizerError(refused)
    optimizer = source.open_optimizer()
    optimizer.check_finite = source.check_finite
    held = set(source.names())
    check_state(optimizer, {name: source.meta(name).dtype for name in optimizer.names() if name in held},
                None if source.release else source.iteration)
    return optimizer


def check_state(optimizer: OptimizerSource, weight_dtypes: dict[str, torch.dtype], iteration: int | None) -> None:
    """Everything but the values: ranges, agreement between the stored copies and with the checkpoint's
    ``iteration`` (its directory's; None: a release or unknown), group counts and dtype keys (``weight_dtypes``:
    the stored dtype of each parameter's model weight)."""
    copies = optimizer.stored_copies()
    for copy in copies:
        _check_ranges(copy)
    _check_agreement(copies)
    for copy in copies:
        held = copy.values.get("iteration", ABSENT)
        if iteration is not None and held is not ABSENT and not _same(held, iteration):
            raise _refuse(copy, "iteration", held, f"the checkpoint is iteration {iteration} (its directory); "
                                                   "the optimizer state is carried for that one")
    _check_group_counts(optimizer, copies)
    if optimizer.form in (FORM_DISTRIBUTED, FORM_LAYER_WISE):
        _check_dtype_keys(optimizer, copies, weight_dtypes)
    else:
        _check_plain_form(optimizer, weight_dtypes)


def scan_values(optimizer: OptimizerSource) -> int:
    """Every value read once, one parameter at a time, under the NaN/Inf policy (``inspect``, which writes
    nothing); returns the parameter count."""
    names = optimizer.names()
    for name in names:
        optimizer.parameter(name)  # checked as read, then freed
    return len(names)


def _number(value: Any) -> float | None:
    """A real number, or a one-element real tensor's, as a float; None for anything else (a bool included)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            return None
        return float(value.reshape(()).double())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _text(value: Any) -> str:
    """An untrusted value for a message (``quote``), with dtypes by name and small tensors by their values."""
    if value is ABSENT:
        return "absent"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, torch.Tensor) and value.numel() <= 8:
        return f"tensor({quote(value.tolist())})"
    if isinstance(value, (list, tuple)) and len(value) <= 8 \
            and any(isinstance(item, (torch.dtype, torch.Tensor)) for item in value):
        inner = ", ".join(_text(item) for item in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    return quote(value)


def _refuse(copy: StoredCopy, label: str, value: Any, constraint: str) -> OptimizerStateError:
    return OptimizerStateError(f"{copy.where}: {label} = {_text(value)}: {constraint}")


def _check_ranges(copy: StoredCopy) -> None:
    for label, value in copy.values.items():
        if label.endswith(".param_groups"):
            _check_groups(copy, label, value)
        elif label == _STATE_STEPS:
            steps = value if isinstance(value, list) else [value]
            for step in steps:
                if not isinstance(step, torch.Tensor):
                    raise _refuse(copy, label, step, "expected the step tensor torch.optim.Adam saves per parameter")
                _check_step(copy, label, step)
        elif label.endswith(".grad_scaler"):
            _check_scaler(copy, label, value)


def _check_step(copy: StoredCopy, label: str, step: Any) -> None:
    number = _number(step)
    if number is None or not math.isfinite(number) or number < 0 or not number.is_integer():
        raise _refuse(copy, label, step, "a step count is a whole number >= 0 (the optimizer steps taken)")


def _check_groups(copy: StoredCopy, label: str, groups: Any) -> None:
    if not isinstance(groups, list) or not all(isinstance(group, dict) for group in groups):
        raise _refuse(copy, label, groups, "expected a list of param groups (dicts)")
    for index, group in enumerate(groups):
        name = f"{label}[{index}]"
        unnamed = [key for key in group if not isinstance(key, str)]
        if unnamed:
            raise _refuse(copy, f"{name} key", unnamed[0], "expected the names of torch.optim settings (str)")
        for key in (key for key in _NON_NEGATIVE if key in group):
            number = _number(group[key])
            if number is None or not math.isfinite(number) or number < 0:
                raise _refuse(copy, f"{name}.{key}", group[key], "expected a finite number >= 0")
        if "betas" in group:
            betas = group["betas"]
            numbers = [_number(beta) for beta in betas] if isinstance(betas, (list, tuple)) else []
            if len(numbers) != 2 or not all(beta is not None and 0.0 <= beta < 1.0 for beta in numbers):
                raise _refuse(copy, f"{name}.betas", betas, "expected two numbers in [0, 1) (torch.optim.Adam's bounds)")
        if "momentum" in group:  # Muon's (megatron-core 0.19.2's TensorParallelMuon): an EMA factor
            number = _number(group["momentum"])
            if number is None or not 0.0 <= number < 1.0:
                raise _refuse(copy, f"{name}.momentum", group["momentum"], "expected a number in [0, 1)")
        if "eps" in group:
            number = _number(group["eps"])
            if number is None or not math.isfinite(number) or number <= 0:
                raise _refuse(copy, f"{name}.eps", group["eps"],
                              "expected a finite number > 0 (Adam divides by sqrt(exp_avg_sq) + eps)")
        # megatron-core 0.14.0's ChainedOptimizer sets every group's step to None where none holds one (torch's Adam
        # keeps it per parameter); 0.15.0 leaves such groups without the key
        if group.get("step") is not None:
            _check_step(copy, f"{name}.step", group["step"])


def _check_scaler(copy: StoredCopy, label: str, scaler: Any) -> None:
    """megatron-core's grad scaler state: None (no scaler), ConstantGradScaler's ``{}``, DynamicGradScaler's
    ``{scale, growth_tracker, hysteresis_tracker}``."""
    if scaler is None or scaler is ABSENT:
        return
    if not isinstance(scaler, dict):
        raise _refuse(copy, label, scaler, "expected megatron-core's grad scaler state (a dict)")
    if "scale" in scaler:
        number = _number(scaler["scale"])
        if number is None or not math.isfinite(number) or number <= 0:
            raise _refuse(copy, f"{label}.scale", scaler["scale"], "expected a finite loss scale > 0")


def _comparable(label: str, value: Any) -> Any:
    """What is compared between copies: a plain optimizer's steps as their distinct values (a rank holds one per
    parameter), a file's buffer dtype keys as the distinct keys."""
    if label == _STATE_STEPS and isinstance(value, list):
        return sorted({_number(step) for step in value}, key=float)
    if label == "dtype_key" and isinstance(value, list):
        return list(dict.fromkeys(value))
    return value


def _check_agreement(copies: list[StoredCopy]) -> None:
    """Every value held by several copies is the same in each, or a named error shows the first difference."""
    for label in dict.fromkeys(label for copy in copies for label in copy.values):
        holders = [copy for copy in copies if label in copy.values]
        first = holders[0]
        for other in holders[1:]:
            found = _difference(label, _comparable(label, first.values[label]),
                                _comparable(label, other.values[label]))
            if found is not None:
                name, value_a, value_b = found
                raise OptimizerStateError(
                    f"{name} differs between ranks: {_text(value_a)} in {first.where}, {_text(value_b)} in "
                    f"{other.where} ({_VERSIONS} saves the same on every rank)")


def _difference(name: str, value_a: Any, value_b: Any) -> tuple[str, Any, Any] | None:
    """The first place where two stored values differ (name, A's, B's), None when they are the same: dicts by key
    (``params``, each rank's own positions, aside), lists by length then entry (a dtype key whole), tensors and NaN
    bit for bit."""
    if value_a is ABSENT or value_b is ABSENT:
        return None if value_a is value_b else (name, value_a, value_b)
    if isinstance(value_a, dict) and isinstance(value_b, dict):
        # Keys paired by their text: a NaN key read from two files is two objects that are not equal.
        keys_a, keys_b = ({quote(key): key for key in value} for value in (value_a, value_b))
        for text in sorted(set(keys_a) | set(keys_b)):
            key = keys_a[text] if text in keys_a else keys_b[text]
            if isinstance(key, str) and key == "params":
                continue
            found = _difference(f"{name}.{key}" if isinstance(key, str) else f"{name}[{text}]",
                                value_a[keys_a[text]] if text in keys_a else ABSENT,
                                value_b[keys_b[text]] if text in keys_b else ABSENT)
            if found is not None:
                return found
        return None
    if isinstance(value_a, (list, tuple)) and isinstance(value_b, (list, tuple)) and not _is_dtype_key(value_a):
        if len(value_a) != len(value_b):
            return (f"the number of {name}", len(value_a), len(value_b))
        for index, (item_a, item_b) in enumerate(zip(value_a, value_b)):
            found = _difference(f"{name}[{index}]", item_a, item_b)
            if found is not None:
                return found
        return None
    return None if _same(value_a, value_b) else (name, value_a, value_b)


def _is_dtype_key(value: Any) -> bool:
    """A buffer's ``(param dtype, grad dtype)``: compared whole."""
    return isinstance(value, tuple) and any(isinstance(item, torch.dtype) for item in value)


def _same(value_a: Any, value_b: Any) -> bool:
    if isinstance(value_a, torch.Tensor) or isinstance(value_b, torch.Tensor):
        if not (isinstance(value_a, torch.Tensor) and isinstance(value_b, torch.Tensor)) \
                or value_a.shape != value_b.shape or value_a.dtype != value_b.dtype:
            return False
        nan = value_a.isnan() & value_b.isnan() if value_a.is_floating_point() else torch.zeros((), dtype=torch.bool)
        return torch.equal(value_a, value_b) or bool(((value_a == value_b) | nan).all())
    if isinstance(value_a, float) and isinstance(value_b, float) and math.isnan(value_a) and math.isnan(value_b):
        return True
    if type(value_a) is type(value_b):
        return bool(value_a == value_b)
    number = _number(value_a)
    return number is not None and number == _number(value_b)  # 2 and 2.0 alike


def _check_group_counts(optimizer: OptimizerSource, copies: list[StoredCopy]) -> None:
    """Each chained optimizer holds the param groups megatron-core builds for the model."""
    expected = group_counts(optimizer.config, optimizer.layout, optimizer.rules)
    for copy in copies:
        for index, count in enumerate(expected):
            label = f"{optimizer_label(index, len(expected))}.param_groups"
            held = copy.values.get(label)
            if isinstance(held, list) and len(held) != count:
                raise OptimizerStateError(
                    f"{copy.where}: {label} holds {len(held)} groups, but {_VERSIONS} builds {count} for this model "
                    f"({_group_names(index, optimizer)}; layout {optimizer.layout.describe()})")


def _group_names(index: int, optimizer: OptimizerSource) -> str:
    """What chained optimizer ``index``'s groups are, for a message."""
    if index == 0 and optimizer.rules.decoupled_lr is not None:
        return "weight decay, the embedding and output layer (decoupled_lr), then no weight decay: 1-dim parameters " \
               "and biases"
    return _GROUPS[index]


def _check_dtype_keys(optimizer: OptimizerSource, copies: list[StoredCopy],
                      weight_dtypes: dict[str, torch.dtype]) -> None:
    """Each buffer's ``(param dtype, grad dtype)`` key: DDP keys a buffer by its parameters' dtype (the model's
    stored weights) and the grad dtype the run's args give (``accumulate_allreduce_grads_in_fp32``)."""
    args = optimizer.first.extra.get("args")
    expected = buffer_dtype_key(args) if args is not None else None
    for copy in copies:
        for key in _comparable("dtype_key", copy.values.get("dtype_key", [])):
            if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(d, torch.dtype) for d in key)):
                raise _refuse(copy, "buffer dtype key", key, "expected (parameter dtype, grad dtype)")
            other = sorted(name for name, dtype in weight_dtypes.items() if dtype != key[0])
            if other:
                held = dtype_name(weight_dtypes[other[0]])
                raise _refuse(copy, "buffer dtype key", key,
                              f"the model's {other[0]} is stored in {held} ({len(other)} of its "
                              f"{len(weight_dtypes)} parameters are not {dtype_name(key[0])}); DDP keys a buffer by "
                              "its parameters' dtype")
            if expected is not None and key != expected:
                raise _refuse(copy, "buffer dtype key", key,
                              f"the run's args (bf16={quote(getattr(args, 'bf16', None))}, "
                              f"fp16={quote(getattr(args, 'fp16', None))}, accumulate_allreduce_grads_in_fp32="
                              f"{quote(getattr(args, 'accumulate_allreduce_grads_in_fp32', None))}) give "
                              f"{_text(expected)}")


def _check_plain_form(optimizer: OptimizerSource, weight_dtypes: dict[str, torch.dtype]) -> None:
    """FP32Optimizer keeps no masters (the float32 weights are), Float16OptimizerWithFloat16Params keeps fp32
    masters beside bf16/fp16 weights: the form must fit the weights."""
    dtypes = sorted({dtype_name(dtype) for dtype in weight_dtypes.values()})
    if optimizer.form == FORM_FP32 and dtypes not in ([], ["float32"]):
        raise OptimizerStateError(
            f"{optimizer.first.path}: FP32Optimizer state (its masters are the weights), but the model's weights are "
            f"{', '.join(dtypes)}: {_VERSIONS} keeps fp32 masters beside bf16/fp16 weights")
    if optimizer.form == FORM_FP16 and dtypes == ["float32"]:
        raise OptimizerStateError(
            f"{optimizer.first.path}: fp32 masters beside the weights (Float16OptimizerWithFloat16Params), but the "
            f"model's weights are float32: {_VERSIONS} uses FP32Optimizer for float32 training")
