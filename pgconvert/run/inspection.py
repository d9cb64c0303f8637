"""``inspect``: what a checkpoint holds, read through its format's loader, and what is wrong with it.

Everything comes from the registry's loader and the ``CanonicalSource`` it opens (names, metadata,
config, vocab rows, layout); no model tensor is loaded. A checkpoint that does not open is not an
exception here but a problem in the result, so the caller can show it next to what is known.

Optimizer state the checkpoint holds is opened and checked as ``convert`` checks it
(``pgconvert.optimizer.checks``), and its values are read once, one parameter at a time, for NaN/Inf
(``skip_finite_check``: not read): what ``convert`` would refuse is an error, what it would not carry or
would warn about a warning.

The model's settings are compared with its family's defaults (``family_default_config``), so that the
text output can show the dimensions and only the settings that make this model differ.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pgconvert.adapters.megatron import ADAPTER_FORMAT as MEGATRON_ADAPTER_FORMAT
from pgconvert.adapters.megatron import describe_megatron_adapter, find_adapter_store, read_megatron_adapter
from pgconvert.adapters.peft import ADAPTER_FORMAT, describe_adapter, is_adapter_directory, read_peft_adapter
from pgconvert.errors import ConfigError, PgconvertError, ValidationError
from pgconvert.families.table import REQUIRED, ConfigField, Family
from pgconvert.formats import Iteration, LoadOptions
from pgconvert.formats.hf import CONFIG_FILE, infer_family, model_config_from_hf, read_json_object, set_path
from pgconvert.formats.hf_side import carried_config
from pgconvert.formats.registry import detect_format, get_loader
from pgconvert.formats.stream import CanonicalSource
from pgconvert.io.sizes import dtype_name
from pgconvert.model.config import GROUPS, SETTING_GROUPS, ModelConfig
from pgconvert.optimizer.checks import open_checked, scan_values
from pgconvert.run.manifest import file_problems, read_manifest
from pgconvert.semantics import summary

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    """Something found wrong (``error``: the checkpoint is unusable as is) or worth knowing (``warning``)."""

    severity: Severity
    kind: str
    message: str


# What a model is, whatever its family: shown with every model, never compared with a default.
DIMENSIONS: tuple[str, ...] = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                               "ffn_hidden_size", "vocab_size", "num_experts", "moe_ffn_hidden_size")
# The dtype is the checkpoint's, not the family's: shown with the dimensions.
SHOWN_WITH_DIMENSIONS: tuple[str, ...] = ("params_dtype",)


@dataclass(frozen=True)
class FamilyDefaults:
    """How a model's settings compare with its family's defaults (``family_default_config``).

    ``family`` is the HF architecture compared with, None when the model fits no family (or that
    family's defaults describe no model of its dimensions) and ModelConfig's defaults are compared;
    ``basis`` says which and why. ``shown`` are the settings shown whatever their value: the
    dimensions, the dtype and what the family's config.json must state (it has no default for them).
    ``differing`` maps each other setting whose value is not the default to that default.
    """

    family: str | None
    basis: str
    shown: tuple[str, ...]
    differing: dict[str, Any]
    at_defaults: int


@dataclass
class CheckpointInfo:
    """What ``inspect`` found. ``layout`` is ``ParallelLayout`` fields (None for unsharded formats)."""

    path: str
    format: str | None = None
    iterations: list[Iteration] = field(default_factory=list)
    iteration: int | None = None
    release: bool = False
    layout: dict[str, Any] | None = None
    layout_text: str | None = None
    model_config: dict[str, Any] | None = None
    # The settings that change the computation (pgconvert.semantics), one text per table row.
    semantics: dict[str, str] = field(default_factory=dict)
    vocab_rows: int | None = None
    true_vocab_size: int | None = None
    tensor_count: int = 0
    total_bytes: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)
    manifest: dict[str, Any] | None = None
    # The HF side files the checkpoint carries (pgconvert.formats.hf_side), relative to its root.
    side_files: list[str] = field(default_factory=list)
    # The optimizer state held and checked: its form and parameter count (None: none, or it did not open).
    optimizer: str | None = None
    notices: list[str] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    # The settings that differ from the family's defaults (None when the checkpoint did not open).
    family_defaults: FamilyDefaults | None = None
    # An adapter's description (pgconvert.adapters.peft.describe_adapter, adapters.megatron.describe_megatron_adapter):
    # an adapter's, or the one a checkpoint holds beside its model; None for a checkpoint without one.
    adapter: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        """No error-severity problem: the checkpoint opened and is consistent."""
        return not any(problem.severity == "error" for problem in self.problems)

    def to_dict(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        doc["ok"] = self.ok
        return doc


def inspect(path: str | Path, iteration: int | None = None, skip_finite_check: bool = False) -> CheckpointInfo:
    """Describe the checkpoint at ``path`` (``iteration``: which saved iteration to open), its optimizer state
    checked (``skip_finite_check``: its values not read for NaN/Inf).

    Never raises for a broken checkpoint: the error is the first entry of ``problems``.
    """
    path = Path(path)
    info = CheckpointInfo(path=str(path.absolute()))
    if is_adapter_directory(path):
        return _inspect_adapter(path, info)
    if find_adapter_store(path) is not None:
        return _inspect_adapter(path, info, megatron=True)
    try:
        info.format = detect_format(path)
        loader = get_loader(info.format)
        info.iterations = loader.iterations(path)
        source = loader.open(path, LoadOptions(iteration=iteration))
    except PgconvertError as error:
        info.problems.append(Problem("error", "unreadable", str(error)))
        _check_manifest(path, info)
        return info
    try:
        _describe(source, info)
        _check_optimizer(source, info, not skip_finite_check)
        if source.embedded_adapter is not None:
            _describe_embedded_adapter(source.embedded_adapter.store, info)
    except PgconvertError as error:
        info.problems.append(Problem("error", "unreadable", str(error)))
    finally:
        source.close()
    _check_manifest(path, info)
    return info


def _inspect_adapter(path: Path, info: CheckpointInfo, megatron: bool = False) -> CheckpointInfo:
    """An adapter: a PEFT LoRA directory, or (``megatron``) a Megatron-Bridge LoRA checkpoint; what it adapts, checked
    as --merge-adapter and export-adapter read it."""
    info.format = MEGATRON_ADAPTER_FORMAT if megatron else ADAPTER_FORMAT
    try:
        info.adapter = describe_megatron_adapter(read_megatron_adapter(path)) if megatron else \
            describe_adapter(read_peft_adapter(path))
    except PgconvertError as error:
        info.problems.append(Problem("error", "unreadable", str(error)))
    return info


def _describe_embedded_adapter(store: Path, info: CheckpointInfo) -> None:
    """The LoRA adapter a checkpoint holds beside its model, described as a Megatron-Bridge adapter checkpoint is;
    a notice says what a conversion needs to be told."""
    info.notices.append(f"{store}: holds a LoRA adapter beside the model: convert --merge-adapter {store} merges it, "
                        "--drop-adapter leaves it out, export-adapter takes it out")
    try:
        info.adapter = describe_megatron_adapter(read_megatron_adapter(store))
    except PgconvertError as error:
        info.problems.append(Problem("error", "unreadable", f"its LoRA adapter: {error}"))


def _describe(source: CanonicalSource, info: CheckpointInfo) -> None:
    info.iteration = source.iteration
    info.release = source.release
    layout = source.layout
    if layout is not None:
        info.layout = dataclasses.asdict(layout)
        info.layout_text = layout.describe()
    config = source.config
    info.model_config = config.to_dict()
    info.semantics = summary(config)
    family, basis = _written_family(source)
    info.family_defaults = compare_with_defaults(config, family, basis)
    info.vocab_rows = source.vocab_rows
    info.true_vocab_size = config.vocab_size
    dtypes: Counter[str] = Counter()
    for name in source.names():
        meta = source.meta(name)
        info.tensor_count += 1
        info.total_bytes += meta.nbytes
        dtypes[dtype_name(meta.dtype)] += 1
    info.dtypes = dict(sorted(dtypes.items()))
    info.notices = list(source.notices)
    if source.side_files is not None:
        prefix = os.path.relpath(source.side_files.directory.absolute(), info.path)
        info.side_files = [name if prefix == "." else f"{prefix}/{name}" for name in source.side_files.names()]
    if config.vocab_size is None:
        info.problems.append(Problem(
            "warning", "unknown-true-vocab",
            f"the true vocab size is unknown: the vocab tables have {source.vocab_rows} rows, padding "
            "included; converting to a layout with other padding (or to hf) needs --true-vocab-size",
        ))
    elif source.vocab_rows > config.vocab_size:
        info.problems.append(Problem(
            "warning", "padded-vocab",
            f"the vocab tables have {source.vocab_rows - config.vocab_size} padding rows beyond the true "
            f"vocab size {config.vocab_size} ({source.vocab_rows} rows)",
        ))


def _check_optimizer(source: CanonicalSource, info: CheckpointInfo, read_values: bool) -> None:
    """The optimizer state opened and checked as ``convert`` does (``open_checked``), its values read once
    (``read_values``): a failed check is an error; state ``convert`` would not carry (a form or model pgconvert
    does not read) and NaN/Inf found are warnings."""
    try:
        if not source.holds_optimizer():
            return
        optimizer = open_checked(source)
        count = scan_values(optimizer) if read_values else len(optimizer.names())
    except ValidationError as error:
        info.problems.append(Problem("warning", "optimizer", f"optimizer state not carried by convert: {error}"))
        return
    except PgconvertError as error:
        info.problems.append(Problem("error", "optimizer", str(error)))
        return
    form = f"{optimizer.form}, {optimizer.sharding}" if optimizer.sharding else optimizer.form
    if optimizer.rules.kind != "adam":  # an emerging run's chained emerging and scalar optimizers
        form = f"{optimizer.rules.kind} and {optimizer.rules.scalar}, {form}"
    info.optimizer = f"{form}: {count} parameters checked" + ("" if read_values else ", values not read")
    info.problems += [Problem("warning", "optimizer-values", notice) for notice in optimizer.notices]


def family_default_config(family: Family | None, config: ModelConfig) -> ModelConfig:
    """The model of ``family`` with ``config``'s dimensions and dtype whose config.json states nothing
    optional: what pgconvert reads from a config.json holding only what the family requires
    (``required_fields``), i.e. the family's fixed values, its ``ConfigField`` defaults (the table's
    record of transformers' class defaults), what its rules read for an absent key, and ModelConfig's
    defaults for the rest. A conversion reads a config.json that leaves a key out the same way.

    ``family`` None: ModelConfig's defaults. Raises ``ConfigError`` when the family's defaults describe
    no model of these dimensions.
    """
    if family is None:
        shown = (*DIMENSIONS, *SHOWN_WITH_DIMENSIONS)
        return ModelConfig.from_settings({name: config.setting(name) for name in shown})
    doc: dict[str, Any] = {"architectures": [family.architecture], "dtype": config.params_dtype}
    for spec in required_fields(family):
        value = spec.value_of(config)
        if value is None and spec.model_field == "vocab_size":
            value = 1  # the true vocab is unknown: any stands in, the dimensions are not compared
        if value is not None:
            set_path(doc, spec.path, value)
    # A rule that reads a dimension (the layer count: Nemotron-H's layer kinds; the FFN size: HunYuan MoE's, with its
    # experts') states it, with what it reads with it, and so does a rule whose keys have no default that describes
    # a model (``ConfigRule.required``).
    for rule in family.rules:
        if set(rule.model_fields) & set(DIMENSIONS) or rule.required:
            doc.update({key: value for key, value in rule.write(config).items() if value is not None})
    _, defaults, _ = model_config_from_hf(doc, Path(CONFIG_FILE), error=ConfigError)
    return defaults


def required_fields(family: Family) -> tuple[ConfigField, ...]:
    """The config.json fields of ``family`` that state the dimensions, and those it has no default for:
    required ones, and those whose default None no model has (DeepSeek-V2's num_experts_per_tok)."""
    return tuple(spec for spec in family.fields if spec.model_field in DIMENSIONS or spec.default is REQUIRED
                 or (spec.default is None and not spec.nullable and _declared_default(spec.model_field) is not None))


def _declared_default(name: str) -> object:
    """ModelConfig's declared default of setting ``name`` (None also where it derives one)."""
    group = SETTING_GROUPS[name]
    owner = ModelConfig if group is None else GROUPS[group]
    (declared,) = [item for item in dataclasses.fields(owner) if item.name == name]
    return None if declared.default is dataclasses.MISSING else declared.default


def compare_with_defaults(config: ModelConfig, family: Family | None, basis: str) -> FamilyDefaults:
    """``config``'s settings against ``family``'s defaults (ModelConfig's when it is None, or when the
    family's defaults describe no model of these dimensions)."""
    try:
        defaults = family_default_config(family, config)
    except ConfigError as error:
        assert family is not None
        basis = (f"{family.architecture}, {basis}; its defaults describe no model of these dimensions ({error}): "
                 "compared with ModelConfig's defaults")
        family, defaults = None, family_default_config(None, config)
    stated = [] if family is None else [spec.model_field for spec in required_fields(family)]
    shown = tuple(dict.fromkeys((*DIMENSIONS, *stated, *SHOWN_WITH_DIMENSIONS)))
    values, default_values = config.to_dict(), defaults.to_dict()
    compared = [name for name in values if name not in shown]
    differing = {name: default_values[name] for name in compared if values[name] != default_values[name]}
    return FamilyDefaults(family=None if family is None else family.architecture, basis=basis, shown=shown,
                          differing=differing, at_defaults=len(compared) - len(differing))


def _written_family(source: CanonicalSource) -> tuple[Family | None, str]:
    """The family pgconvert writes ``source`` as on an hf target (pgconvert.savers.hf) and how it is
    chosen: its config.json's, else a carried config.json's, else the first that fits; None: none fits."""
    if source.hf_origin is not None:
        return source.hf_origin.family, "named by config.json"
    carried = source.side_files.get(CONFIG_FILE) if source.side_files is not None else None
    if carried is not None:
        try:
            family, base, _ = carried_config(read_json_object(carried.path), carried.path, source.config)
        except PgconvertError:
            base = None
        if base is not None:
            return family, "named by the config.json it carries"
    try:
        return infer_family(source.config), "inferred: the family an hf target is written as"
    except ConfigError:
        return None, "fits no supported family: compared with ModelConfig's defaults"


def _check_manifest(path: Path, info: CheckpointInfo) -> None:
    """Sizes only: a truncated or missing file shows at once; ``verify`` checks the digests too."""
    try:
        manifest = read_manifest(path)
    except PgconvertError as error:
        info.problems.append(Problem("error", "manifest", str(error)))
        return
    if manifest is None:
        return
    info.manifest = {
        "tool_version": manifest.tool_version,
        "created": manifest.created,
        "source_path": manifest.source_path,
        "source_format": manifest.source_format,
        "source_iteration": manifest.source_iteration,
        "files": len(manifest.files),
    }
    for problem in file_problems(path, manifest, hashes=False):
        info.problems.append(Problem("error", "manifest", problem))
