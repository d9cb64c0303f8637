"""Optimizer state megatron-core laid out itself (``mcore_optimizer_layout.py``, a subprocess) and the checks the
tests make of it: pgconvert's positions and flat-buffer offsets against megatron-core's on every rank, and per-rank
files compared after a conversion."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from support.megatron_fixtures import assert_same_tree, load_for_test

from pgconvert.formats import LoadOptions
from pgconvert.formats.megatron import safe_torch_load
from pgconvert.loaders.megatron import MegatronSource
from pgconvert.optimizer.flat import flat_buffers
from pgconvert.optimizer.order import OptimizerRules, chained_slots

SCRIPT = Path(__file__).parent / "mcore_optimizer_layout.py"


def lay_out(jobs: list[str], timeout: int = 900) -> None:
    """Run ``mcore_optimizer_layout.py`` on ``jobs`` (KIND SRC PLAIN DIST QKWD, repeated)."""
    done = subprocess.run([sys.executable, "-W", "ignore", str(SCRIPT), *jobs], capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def assert_megatron_cores_layout(plain: Path, dist: Path, ranks: int) -> dict[Any, list[list[list[str]]]]:
    """pgconvert's optimizer positions (per rank, optimizer, group) and flat-buffer offsets are the ones megatron-core
    recorded for ``plain`` and ``dist`` (``ranks`` rank files); returns the positions by rank coordinate."""
    positions = json.loads((plain.parent / f"{plain.name}.positions.json").read_text())
    offsets = json.loads((dist.parent / f"{dist.name}.buffers.json").read_text())
    (iteration,) = dist.glob("iter_*")
    source = MegatronSource(iteration, 2, False, LoadOptions())
    assert len(source.files) == ranks
    derived_by_rank = {}
    for coord, path in source.files.items():
        state = safe_torch_load(path)
        rules = OptimizerRules.from_args(state["args"], str(path))
        chained = chained_slots(source.config, source.layout, coord, rules, source.vocab_rows)
        derived = [[[slot.spec.local_name for slot in group] for group in groups] for groups in chained]
        assert derived == positions[path.parent.name], path.parent.name
        derived_by_rank[coord] = derived
        for index in range(len(chained)):
            buffers = flat_buffers(source.config, source.layout, coord, rules, source.vocab_rows, state["args"],
                                   1, index)
            placed = {item.slot.spec.local_name: [item.start, item.end, item.bucket_start]
                      for items, _ in buffers for item in items}
            assert placed == offsets[path.parent.name][index], (path.parent.name, index)
    return derived_by_rank


def per_rank_files(root: Path) -> dict[str, dict]:
    return {str(path.relative_to(root)): load_for_test(path) for path in sorted(root.glob("iter_*/mp_rank_*/*.pt"))}


def assert_same_files(original: Path, again: Path, keys: tuple[str, ...] = ("optimizer", "model", "iteration")) -> None:
    """Every optimizer tensor of every rank (``distrib_optim.pt`` whole), the model and the iteration: equal."""
    before, after = per_rank_files(original), per_rank_files(again)
    assert set(before) == set(after) and before
    for name, content in before.items():
        if not name.endswith("model_optim_rng.pt"):
            assert_same_tree(content, after[name], name)
            continue
        for key in keys:
            assert_same_tree(content[key], after[name][key], f"{name}.{key}")


def assert_same_through_torch_dist(original: Path, again: Path) -> None:
    """``again`` (``original`` through torch_dist and back) holds the same state: a plain optimizer's entries whole; a
    distributed one's ``distrib_optim.pt`` whole and param groups (its entry's ``param_state_sharding_type`` says how
    the state was saved, which torch_dist does not keep); and the model."""
    assert_same_files(original, again, ("model",))
    before, after = per_rank_files(original), per_rank_files(again)
    for name, content in before.items():
        if name.endswith("model_optim_rng.pt"):
            held, back = content["optimizer"], after[name]["optimizer"]
            if "optimizer" in held:  # the distributed optimizer's entry (a plain one is the state_dict itself)
                held, back = held["optimizer"]["param_groups"], back["optimizer"]["param_groups"]
            assert_same_tree(held, back, f"{name}.optimizer")
