"""The layout-independent per-parameter form of optimizer state (``export-optimizer``).

One ``<canonical name>.pt`` per parameter holding ``param`` (fp32 master), ``exp_avg``, ``exp_avg_sq`` and
``step`` (a Muon run's Muon parameters: ``param`` and ``momentum_buffer``), written one parameter at a time, and
``optimizer.json`` (form, the optimizer's kind, groups' hyperparameters per chained optimizer, each parameter's
optimizer and group, scheduler, iteration, floating-point operations, consumed samples). Vocab tables keep the
source's padded rows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pgconvert.errors import DestinationError
from pgconvert.formats import LoadOptions
from pgconvert.formats.registry import detect_format, get_loader
from pgconvert.optimizer.checks import open_checked
from pgconvert.optimizer.order import MEGATRON_CORE_VERSIONS
from pgconvert.optimizer.source import COUNTERS, OptimizerSource


def _safe_name(name: str) -> str:
    return name.replace("/", "_")


def export_parameters(source: OptimizerSource, out_dir: Path) -> int:
    """Write the per-parameter form into ``out_dir`` (created); returns the parameter count."""
    out_dir.mkdir(parents=True, exist_ok=True)
    groups: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    for name in source.names():
        tensors = source.parameter(name)
        torch.save(tensors, out_dir / f"{_safe_name(name)}.pt")
        groups[name] = source.group_of(name)
        shapes[name] = list(tensors["param"].shape)
        del tensors
    chained = sorted({source.optimizer_of(name) for name in groups})
    extra = source.first.extra
    args = extra.get("args")
    index = {
        "format": "pgconvert per-parameter optimizer state v1",
        "megatron_core_versions": list(MEGATRON_CORE_VERSIONS),
        "form": source.form,
        "iteration": extra.get("iteration"),
        "num_floating_point_operations_so_far": extra.get("num_floating_point_operations_so_far"),
        "opt_param_scheduler": extra.get("opt_param_scheduler"),
        "counters": {key: getattr(args, key, None) for key in COUNTERS},
        "optimizer": source.rules.kind,
        "param_groups": source.param_group_settings(),  # the first chained optimizer's
        "chained_param_groups": [source.param_group_settings(index) for index in chained],
        "parameters": {name: {"optimizer": source.optimizer_of(name), "group": groups[name], "shape": shapes[name],
                              "file": f"{_safe_name(name)}.pt"} for name in groups},
        "padded_vocab_rows": source.vocab_rows,
        "not_carried": ["rng_state"],
    }
    (out_dir / "optimizer.json").write_text(json.dumps(index, indent=1, default=str) + "\n")
    return len(groups)


def export_from_path(src: Path, out_dir: Path, iteration: int | None) -> int:
    """``export-optimizer``: open the checkpoint ``src`` (of a format whose source opens its optimizer state,
    ``CanonicalSource.open_optimizer``) and write its per-parameter optimizer state into ``out_dir`` (which must
    not exist or be empty)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise DestinationError(f"OUT {out_dir}: exists and is not an empty directory")
    source = get_loader(detect_format(src)).open(src, LoadOptions(iteration=iteration))
    try:
        return export_parameters(open_checked(source), out_dir)
    finally:
        source.close()
