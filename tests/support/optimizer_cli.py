"""The optimizer tests' ways into pgconvert and torch: the CLI, ``export-optimizer``'s per-parameter files
compared, a torch_dist checkpoint's records read by torch's own DCP reader, and its ``.metadata`` rewritten."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner, Result
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from pgconvert.cli import main

# What export-optimizer writes per parameter.
EXPORTED_KEYS = ("param", "exp_avg", "exp_avg_sq", "step")


def run_cli(*args: str | Path) -> Result:
    """``pgconvert ARGS`` through click's test runner."""
    return CliRunner().invoke(main, [str(arg) for arg in args], prog_name="pgconvert")


def convert_strict(src: Path, dst: Path, *flags: str) -> Path:
    """``pgconvert convert SRC DST -q --strict FLAGS``, which must succeed; returns ``dst``."""
    result = run_cli("convert", src, dst, "-q", "--strict", *flags)
    assert result.exit_code == 0, result.output
    return dst


def float32_and_back(src: Path, work: Path) -> tuple[Path, Path, str]:
    """A bf16 TP2 DP2 per-rank run converted with ``--dtype fp32`` to TP1 DP1 and that back with ``--dtype bf16`` to
    TP2 DP2, both of which must succeed: (the float32 output, the bfloat16 one, the first conversion's output)."""
    wide = run_cli("convert", src, work / "fp32", "--dtype", "fp32", "--dst-tp", "1", "--dst-dp", "1")
    assert wide.exit_code == 0, wide.output
    back = run_cli("convert", work / "fp32", work / "bf16", "--dtype", "bf16", "--dst-tp", "2", "--dst-dp", "2")
    assert back.exit_code == 0, back.output
    return work / "fp32", work / "bf16", " ".join(wide.output.split())


def export_optimizer(src: Path, out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """``export-optimizer SRC OUT``: each parameter's exported tensors by file stem."""
    result = run_cli("export-optimizer", src, out)
    assert result.exit_code == 0, result.output
    return {path.stem: torch.load(path, weights_only=True) for path in sorted(out.glob("*.pt"))}


def assert_same_parameters(a: dict[str, dict[str, torch.Tensor]], b: dict[str, dict[str, torch.Tensor]],
                           count: int = 15) -> None:
    """Two exports of a golden's ``count`` parameters (the dense goldens' 15) hold the same tensors, bit for bit and
    dtype."""
    assert set(a) == set(b) and len(a) == count
    for name, tensors in a.items():
        assert set(tensors) == set(b[name]) == set(EXPORTED_KEYS), name
        for key in EXPORTED_KEYS:
            assert tensors[key].dtype == b[name][key].dtype and torch.equal(tensors[key], b[name][key]), f"{name}.{key}"


def torch_metadata(iteration_dir: Path) -> Metadata:
    """A store's ``.metadata`` as torch's own reader unpickles it (torch's classes; not pgconvert's reader)."""
    return dcp.FileSystemReader(str(iteration_dir)).read_metadata()


def dcp_read(iteration_dir: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """Whole global tensors read by torch's own DCP reader (not pgconvert's)."""
    metadata = torch_metadata(iteration_dir)
    wanted = {key: torch.empty(metadata.state_dict_metadata[key].size,
                               dtype=metadata.state_dict_metadata[key].properties.dtype) for key in keys}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(wanted, checkpoint_id=str(iteration_dir), no_dist=True)
    return wanted


def rewrite_metadata(iteration_dir: Path, change: Callable[[Metadata], None]) -> None:
    """A torch_dist checkpoint's ``.metadata`` changed in place by ``change``."""
    path = iteration_dir / ".metadata"
    metadata = torch_metadata(iteration_dir)
    change(metadata)
    path.write_bytes(pickle.dumps(metadata))


def chained_name(key: str) -> str:
    """A chained dense and expert optimizer's record key as megatron-core 0.13.1 names it: prefixed with its
    optimizer's ``chained_<i>.`` (the expert optimizer's for a routed expert's record)."""
    return ("chained_1." if ".experts.experts." in key else "chained_0.") + key


def as_megatron_core_0_13_names(iteration_dir: Path) -> None:
    """A torch_dist checkpoint's chained optimizers' model-space or plain records (``optimizer.state.*``) renamed as
    megatron-core 0.13.1 saves them (``chained_name``), its ``common.pt`` content metadata without
    ``chained_optim_avoid_prefix`` (0.13.1's Megatron-LM sets none): checked against 0.13.1's own saves outside CI
    (``scripts/make_fs_model_space_moe_golden.py save DIR [plain]``)."""
    path = iteration_dir / ".metadata"
    metadata = torch_metadata(iteration_dir)
    renamed = {key: chained_name(key) for key in metadata.state_dict_metadata if key.startswith("optimizer.state.")}
    storage = {MetadataIndex(renamed.get(index.fqn, index.fqn), index.offset, index.index): value
               for index, value in metadata.storage_data.items()}
    entries = {renamed.get(key, key): value for key, value in metadata.state_dict_metadata.items()}
    path.write_bytes(pickle.dumps(Metadata(entries, None, storage)))
    from support.optimizer_faults import edit_common  # it imports this module

    edit_common(iteration_dir, lambda common: common["content_metadata"].pop("chained_optim_avoid_prefix"))
