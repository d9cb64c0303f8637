"""Whether a conversion carries its source's optimizer state, and ``convert``'s step that carries it.

One decision for ``convert``, ``--dry-run``, sharded runs and ``--workers`` (``carried_optimizer``; with several
processes ``sharded_optimizer`` adds the files they share out, each writes its share with ``carry_share``, and one
what they have in common with ``finalize_carried``): the state is carried when
the source holds it (``CanonicalSource.holds_optimizer``), the destination writes it (``Saver.writes_optimizer``)
and ``--skip-optimizer`` is not given; it is opened and checked by ``pgconvert.optimizer.checks.open_checked``, and
its values are checked for NaN/Inf on their way to the output (``--check-finite``: refused). State that is held but
not carried is named in a notice (``guess: optimizer state not carried: ...``), refused under --strict; a broken one
is a named error. Everything a format
reads or writes goes through the hooks of ``pgconvert.formats``: the source opens its state
(``open_optimizer``), the saver writes it after the model (``save_optimizer``), or with it where its model files
hold it (``Saver.optimizer_in_model_files``: decided while planning, ``attach_optimizer``).

Carried: the optimizer, scheduler state, iteration, ``num_floating_point_operations_so_far``, the grad scaler
and the consumed-samples counters (in ``args``). Not carried: RNG state (it depends on the rank count).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pgconvert.errors import ValidationError
from pgconvert.formats import (TRAINING_STATE_NOT_CARRIED, CarriedOptimizer, OptimizerFile, OptimizerInModelFiles,
                               OptimizerOptions, PlannedFile, Saver, target_config)
from pgconvert.formats.names import saver_names
from pgconvert.formats.registry import get_saver
from pgconvert.formats.strict import fallback
from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.model.provider import target_vocab_rows
from pgconvert.optimizer.checks import open_checked
from pgconvert.optimizer.data_parallel import check_dst_dp
from pgconvert.optimizer.mla_weight_decay import qk_norm_decay_notice
from pgconvert.optimizer.order import OptimizerLayoutError, layer_wise_target_refusal, optimizer_count
from pgconvert.optimizer.retype import float32_load_notice, masters_for_destination, retype_refusal, retyped
from pgconvert.optimizer.scaler import lost_scaler
from pgconvert.optimizer.source import OptimizerSource

if TYPE_CHECKING:
    from pgconvert.run.convert import Plan

RNG_NOTICE = ("RNG state is not carried (it depends on the rank count): resume with --no-load-rng")


def optimizer_options(request: Any) -> OptimizerOptions:
    """``--dst-optim-form`` and ``--dst-dp`` of a conversion request."""
    return OptimizerOptions(form=getattr(request, "dst_optim_form", None), dp=getattr(request, "dst_dp", None))


def _check_form(requested: str, saver: Saver, dst_format: str, skip_optimizer: bool) -> None:
    """``--dst-optim-form``: one of the forms the destination's saver writes (``Saver.optimizer_forms``)."""
    if requested not in saver.optimizer_forms:
        forms = {name: get_saver(name).optimizer_forms for name in saver_names()}
        known = list(dict.fromkeys(form for name in sorted(forms) for form in forms[name]))
        if requested not in known:
            raise ValidationError(f"--dst-optim-form {quote(requested)}: must be one of {', '.join(known)}")
        takers = " or ".join(name for name in sorted(forms) if requested in forms[name])
        raise ValidationError(f"--dst-optim-form {requested}: applies to a {takers} destination, not {dst_format}")
    if skip_optimizer:
        raise ValidationError(f"--dst-optim-form {requested}: chooses the carried optimizer state's form; "
                              "drop --skip-optimizer or --dst-optim-form")


def check_optimizer_options(conversion: Plan) -> None:
    """``--dst-optim-form`` and ``--dst-dp`` checked while planning, before anything is written."""
    request, source = conversion.request, conversion.source
    options = optimizer_options(request)
    if options.form is not None:
        _check_form(options.form, conversion.saver, conversion.dst_format, request.skip_optimizer)
    if options.dp is None:
        return
    check_dst_dp(options.dp, conversion.save_options.layout, source.megatron_args, request.skip_optimizer,
                 conversion.saver)
    if not _carries(conversion):
        raise ValidationError(f"--dst-dp {options.dp}: the source holds no Megatron optimizer state to size")


@dataclass(frozen=True)
class ShardedOptimizer:
    """What every process of a sharded run (or ``--workers`` pool) carries: the opened state, the form the destination
    writes it in, and the destination's optimizer files (``Saver.plan_optimizer``), which the run's plan shares out
    with the model's."""

    optimizer: OptimizerSource
    form: str
    files: list[OptimizerFile]


def sharded_optimizer(conversion: Plan) -> ShardedOptimizer | None:
    """A sharded run's decision, the same in every process and made before anything is written: what
    ``carried_optimizer`` carries, when the destination's saver writes it in shares (``Saver.optimizer_partial``);
    else None, with what is not carried named in ``conversion.source.notices`` (refused under --strict)."""
    if not _carries(conversion):
        return None
    notices = conversion.source.notices
    if not conversion.saver.optimizer_partial:
        fallback(f"optimizer state not carried: the {conversion.dst_format} saver writes optimizer state in one pass, "
                 "so a sharded run (--shard-index/--num-shards, or a launcher's RANK and WORLD_SIZE) writes the model "
                 "alone; convert without sharding to carry it, or pass --skip-optimizer",
                 conversion.request.strict, notices)
        return None
    carried = carried_optimizer(conversion, notices)
    if carried is None:
        return None
    optimizer, form = carried
    files = conversion.saver.plan_optimizer(conversion.source, optimizer, form, conversion.save_options,
                                            optimizer_options(conversion.request))
    return ShardedOptimizer(optimizer, form, files)


def carry_share(conversion: Plan, carried: ShardedOptimizer, staging: Path, files: list[PlannedFile],
                share: Collection[str]) -> None:
    """One process's share of the optimizer state (``Saver.save_optimizer(only=share)``) beside the model files it
    wrote (``files``, updated in place)."""
    written = conversion.saver.save_optimizer(conversion.source, carried.optimizer, carried.form, staging,
                                              conversion.save_options, optimizer_options(conversion.request), files,
                                              only=share)
    files[:] = written.files


def finalize_carried(conversion: Plan, carried: ShardedOptimizer, staging: Path, files: list[PlannedFile]) -> list[str]:
    """The finalizing process's step once every share is written (``Saver.finalize_optimizer``); returns the
    notices, as ``carry_training_state``'s."""
    written = conversion.saver.finalize_optimizer(conversion.source, carried.optimizer, carried.form, staging,
                                                  conversion.save_options, optimizer_options(conversion.request),
                                                  files)
    files[:] = written.files
    return _carried_notices(conversion, carried.optimizer, written)


def _carries(conversion: Plan) -> bool:
    """Whether this conversion is one that carries optimizer state: its source holds one, its destination
    writes one, and it is not skipped."""
    return not conversion.request.skip_optimizer and conversion.saver.writes_optimizer \
        and conversion.source.holds_optimizer()


def _not_carried(conversion: Plan) -> str | None:
    """Why the optimizer state of this conversion is not carried, decided before it is opened (None: it is)."""
    request = conversion.request
    if request.merge_adapter is not None:
        return (f"--merge-adapter {request.merge_adapter}: the optimizer state (fp32 master weights, moments) is the "
                "base model's, not the merged one's; pass --skip-optimizer")
    return retype_refusal(conversion.source, conversion.save_options.dtype) \
        or conversion.source.optimizer_refusal() or conversion.saver.optimizer_refusal(
        conversion.source, conversion.save_options, optimizer_options(request))


def carried_optimizer(conversion: Plan, notices: list[str]) -> tuple[OptimizerSource, str] | None:
    """The source's optimizer state and the form the destination writes it in, when this conversion carries
    it, else None. One rule for every source and destination: state that is held but not carried is named
    in a notice (``guess: optimizer state not carried: ...``), and refused under --strict; a broken one is
    a named error. Decided once per conversion (the state is opened and checked once); ``notices`` gets the
    decision's notices each time."""
    if conversion.optimizer_decision is None:
        said: list[str] = []
        conversion.optimizer_decision = (_decide(conversion, said), said)
    carried, said = conversion.optimizer_decision
    notices.extend(said)
    return carried


def attach_optimizer(conversion: Plan) -> None:
    """What is decided about the optimizer state while planning, before anything is written. A conversion to another
    ``--dtype``, or into a destination that stores the optimizer's masters as its model (``Saver.stores_masters``),
    reads its model weights from the carried state's masters (``retype.retyped``,
    ``retype.masters_for_destination``); a destination whose model files hold the optimizer state
    (``Saver.optimizer_in_model_files``) gets the carried state in its save options, and writes it with them."""
    saver = conversion.saver
    if conversion.save_options.dtype is None and not saver.stores_masters and not saver.optimizer_in_model_files:
        return
    carried = carried_optimizer(conversion, [])
    if carried is not None and saver.optimizer_in_model_files:
        optimizer, form = carried
        written = OptimizerInModelFiles(optimizer, form, optimizer_options(conversion.request))
        conversion.save_options = replace(conversion.save_options, optimizer=written)


def _kind_refusal(conversion: Plan, optimizer: OptimizerSource) -> str | None:
    """Why an optimizer other than Adam (a Muon run's) is not written here (None: it is): a destination that writes
    only Adam's state."""
    kind = optimizer.rules.stored_kind
    if kind not in conversion.saver.optimizer_kinds:
        writers = [name for name in saver_names() if kind in get_saver(name).optimizer_kinds]
        how = " with the layer-wise distributed optimizer" if optimizer.rules.layer_wise else ""
        return (f"optimizer state not carried: {optimizer.first.path}: args.optimizer={quote(optimizer.rules.kind)}"
                f"{how}: its state is written into {', '.join(writers)} only, not {conversion.dst_format}; pass "
                "--skip-optimizer")
    return None


def _layout_refusal(conversion: Plan, optimizer: OptimizerSource) -> str | None:
    """Why the state cannot be written at the destination's layout (None: it can): one megatron-core does not build."""
    refused = layer_wise_target_refusal(optimizer.rules, target_of(conversion)[0], conversion.save_options.layout)
    if refused is None:
        return None
    return f"optimizer state not carried: {optimizer.first.path}: {refused}; pass --skip-optimizer"


def _decide(conversion: Plan, notices: list[str]) -> tuple[OptimizerSource, str] | None:
    if not _carries(conversion):
        return None
    strict = conversion.request.strict
    refused = _not_carried(conversion)
    if refused:
        fallback(refused, strict, notices)
        return None
    try:
        optimizer = open_checked(conversion.source)
    except ValidationError as exc:
        fallback(f"optimizer state not carried: {exc}", strict, notices)
        return None
    except OptimizerLayoutError as exc:
        if "--skip-optimizer" in str(exc):
            raise
        raise OptimizerLayoutError(f"{exc}; pass --skip-optimizer to convert the model alone") from exc
    refused = _kind_refusal(conversion, optimizer) or _layout_refusal(conversion, optimizer)
    if refused:
        fallback(refused, strict, notices)
        return None
    optimizer = retyped(conversion.source, optimizer, conversion.save_options.dtype)
    if conversion.saver.stores_masters:
        masters_for_destination(conversion.source, optimizer, conversion.dst_format)
    try:
        form = conversion.saver.optimizer_form(optimizer, optimizer_options(conversion.request))
    except ValidationError as exc:
        fallback(f"optimizer state not carried: {optimizer.first.path}: {exc}", strict, notices)
        return None
    lost = lost_scaler(optimizer, optimizer_count(target_of(conversion)[0], conversion.save_options.layout,
                                                  optimizer.rules))
    if lost:
        fallback(lost, strict, notices)
    return optimizer, form


def target_of(conversion: Plan) -> tuple[ModelConfig, int]:
    """The destination's model config and padded vocab rows."""
    options = conversion.save_options
    config = target_config(conversion.source.config, options)
    return config, target_vocab_rows(config, conversion.source.vocab_rows, options.layout)


def carry_training_state(conversion: Plan, staging: Path, files: list[PlannedFile]) -> list[str]:
    """``convert``'s step after the model is written: the source's optimizer state written by the destination's
    saver (``Saver.save_optimizer``) beside the model under ``staging``; ``files`` (the model saver's) become the
    destination's files. Returns the notices to add."""
    notices: list[str] = []
    carried = carried_optimizer(conversion, notices)
    if carried is None:
        return notices
    optimizer, form = carried
    written = conversion.saver.save_optimizer(conversion.source, optimizer, form, staging, conversion.save_options,
                                              optimizer_options(conversion.request), files)
    files[:] = written.files
    return notices + _carried_notices(conversion, optimizer, written)


def _carried_notices(conversion: Plan, optimizer: OptimizerSource, written: CarriedOptimizer) -> list[str]:
    """What a conversion that carried the optimizer state says; the source's notice that its training state is not
    converted is dropped (the optimizer state now is)."""
    source, options = conversion.source, conversion.save_options
    source.notices[:] = [note for note in source.notices if note != source.training_state_notice]
    return [f"optimizer ({written.form}), scheduler, iteration, floating-point operations and consumed "
            f"samples carried to {options.layout.describe()}; " + RNG_NOTICE, *written.notices] \
        + qk_norm_decay_notice(optimizer.rules, source.config, target_of(conversion)[0]) \
        + float32_load_notice(optimizer, written.form) + optimizer.notices


def plan_optimizer(conversion: Plan) -> tuple[list[OptimizerFile], list[str]]:
    """``--dry-run``: the destination files' optimizer state (``Saver.plan_optimizer``) and the notices (what is
    not carried, and why), from the same decision as ``convert``."""
    notices: list[str] = []
    carried = carried_optimizer(conversion, notices)
    if carried is None:
        return [], notices
    optimizer, form = carried
    return conversion.saver.plan_optimizer(conversion.source, optimizer, form, conversion.save_options,
                                           optimizer_options(conversion.request)), notices + optimizer.notices


def replace_saver_notice(notices: list[str], carried: list[str]) -> list[str]:
    """The saver's "not carried" notice replaced by what was carried, when something was."""
    if not any(note.startswith("optimizer (") for note in carried):
        return notices + carried
    # A saver's notice may end with "; optimizer, scheduler and RNG state are not carried..." (torch_dist's).
    kept = [note.split("; " + TRAINING_STATE_NOT_CARRIED)[0] for note in notices]
    return [note for note in kept if not note.startswith(TRAINING_STATE_NOT_CARRIED)] + carried
