"""MoE checkpoints with optimizer state made by megatron-core itself (``mcore_moe_optimizer.py``, gloo processes),
and the comparisons the MoE optimizer tests make of their per-rank files and torch_dist records."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from support.megatron_fixtures import assert_same_tree, load_for_test
from pgconvert.formats.torch_dist import read_dcp_metadata


SCRIPT = Path(__file__).parent / "mcore_moe_optimizer.py"
ITER = "iter_0000002"


# megatron-core's runs made in this process, by (tp, pp, ep, form), in a folder removed when the process ends.
_RUNS: dict[tuple[int, int, int, str], Path] = {}
_RUNS_DIR: list[tempfile.TemporaryDirectory[str]] = []


def _run_once(tp: int, pp: int, ep: int, form: str) -> Path:
    """``mcore_moe_optimizer.py``'s checkpoint at TP x PP x EP in ``form``, run once per test process."""
    if (tp, pp, ep, form) not in _RUNS:
        if not _RUNS_DIR:
            _RUNS_DIR.append(tempfile.TemporaryDirectory(prefix="moe_optimizer_runs_"))
        root = Path(_RUNS_DIR[0].name) / f"tp{tp}pp{pp}ep{ep}_{form}" / "run"
        done = subprocess.run([sys.executable, "-W", "ignore", str(SCRIPT), str(root), str(tp), str(pp), str(ep),
                               form], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        _RUNS[(tp, pp, ep, form)] = root
    return _RUNS[(tp, pp, ep, form)]


def generate(root: Path, tp: int, pp: int, ep: int, form: str) -> Path:
    """megatron-core's own MoE checkpoint with optimizer state (``mcore_moe_optimizer.py``) at TP x PP x EP, at
    ``root``, and ``ROOT.positions.json`` beside it. megatron-core trains each (tp, pp, ep, form) once per test
    process (the script is deterministic: one intra-op thread, fixed seeds); every call gets its own copy of the
    files, which the caller may change."""
    made = _run_once(tp, pp, ep, form)
    shutil.copytree(made, root)
    shutil.copyfile(made.parent / f"{made.name}.positions.json", root.parent / f"{root.name}.positions.json")
    return root


def rank_files(root: Path) -> dict[str, object]:
    """Every per-rank file (rank files and ``distrib_optim.pt``) of the iteration, loaded."""
    found = sorted((root / ITER).glob("mp_rank_*/*.pt"))
    return {f"{path.parent.name}/{path.name}": load_for_test(path) if path.name.startswith("model") else
            torch.load(path, weights_only=True) for path in found}


def assert_round_trip(original: Path, again: Path, keys: tuple[str, ...] = ("optimizer", "model", "iteration")) -> None:
    """The rank files' ``keys`` and every other file equal after a round trip."""
    before, after = rank_files(original), rank_files(again)
    assert set(before) == set(after) and len(before) >= 2
    for name, content in before.items():
        if name.endswith("model_optim_rng.pt"):
            for key in keys:
                assert_same_tree(content[key], after[name][key], f"{name}.{key}")  # type: ignore[index]
        else:
            assert_same_tree(content, after[name], name)


def assert_optimizer_files_equal(original: Path, again: Path) -> None:
    """Every tensor of every distrib_optim.pt, and every rank's param groups, model and iteration: equal."""
    before, after = rank_files(original), rank_files(again)
    assert set(before) == set(after) and len(before) == 8
    for name, content in before.items():
        if name.endswith("distrib_optim.pt"):
            assert_same_tree(content, after[name], name)
            continue
        assert_same_tree(content["model"], after[name]["model"], f"{name}.model")  # type: ignore[index]
        assert content["iteration"] == after[name]["iteration"]  # type: ignore[index]
        groups = [entry["optimizer"]["param_groups"] for entry in content["optimizer"]]  # type: ignore[index]
        assert_same_tree(groups, [entry["optimizer"]["param_groups"] for entry in after[name]["optimizer"]],  # type: ignore[index]
                     f"{name}.optimizer")


def optimizer_records(iteration_dir: Path) -> dict[str, torch.Tensor]:
    """Every optimizer record, whole, read by torch's own DCP reader (not pgconvert's)."""
    metadata = read_dcp_metadata(iteration_dir / ".metadata").state_dict_metadata
    wanted = {key: torch.empty(md.size, dtype=md.properties.dtype) for key, md in metadata.items()
              if key.startswith("optimizer.") and hasattr(md, "size")}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(wanted, checkpoint_id=str(iteration_dir), no_dist=True)
    return wanted
