"""Saved iterations come from the format contract (``Loader.iterations``), so ``inspect`` and
batch plans' ``iterations = "all"`` work for every format that saves iterations, torch_dist included."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.tiny_models import GQA_SWIGLU
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint

import pgconvert
from pgconvert.cli import main
from pgconvert.formats import RELEASE
from pgconvert.run.manifest import MANIFEST_FILE
from pgconvert.formats.registry import get_loader

TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("megatron") / "run"
    write_megatron_checkpoint(root, GQA_SWIGLU, make_full_model(GQA_SWIGLU, seed=1), 2, 1, iteration=10)
    write_megatron_checkpoint(root, GQA_SWIGLU, make_full_model(GQA_SWIGLU, seed=2), 2, 1, iteration=20)
    return root


@pytest.fixture(scope="module")
def torch_dist_run(megatron_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torch_dist run directory holding iterations 10 and 20 (the tracker names 20)."""
    work = tmp_path_factory.mktemp("torch_dist")
    root = pgconvert.convert(megatron_run, work / "run", dst_format="torch_dist", iteration=10).dst
    later = pgconvert.convert(megatron_run, work / "later", dst_format="torch_dist", iteration=20).dst
    shutil.copytree(later / "iter_0000020", root / "iter_0000020")
    (root / TRACKER).write_text("20")
    (root / MANIFEST_FILE).unlink()
    return root


def test_inspect_lists_the_iterations_of_a_torch_dist_run(torch_dist_run: Path) -> None:
    result = CliRunner().invoke(main, ["inspect", "--json", str(torch_dist_run)])

    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert (info["format"], info["iterations"], info["iteration"]) == ("torch_dist", [10, 20], 20)
    assert pgconvert.inspect(torch_dist_run / "iter_0000010").iterations == [10]


def test_batch_iterations_all_converts_every_iteration_of_a_torch_dist_run(
        torch_dist_run: Path, megatron_run: Path, tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(f'[[convert]]\nname = "dist"\nsrc = "{torch_dist_run}"\n'
                    f'dst = "{tmp_path}/out/iter_{{iteration}}"\niterations = "all"\ndst-format = "megatron"\n')

    report = pgconvert.run_batch(plan)

    assert [(r.label, r.status) for r in report.results] == [("dist@10", "ok"), ("dist@20", "ok")], report.results
    for iteration in (10, 20):
        check = pgconvert.verify(megatron_run, tmp_path / "out" / f"iter_{iteration}", iteration_a=iteration)
        assert check.equal, check.differences


def test_every_builtin_loader_lists_iterations_through_the_contract(
        megatron_run: Path, torch_dist_run: Path, tmp_path: Path) -> None:
    hf = pgconvert.convert(megatron_run, tmp_path / "hf", dst_format="hf", iteration=10).dst
    release = tmp_path / "released"
    shutil.copytree(megatron_run / "iter_0000010", release / RELEASE)

    assert get_loader("megatron").iterations(megatron_run) == [10, 20]
    assert get_loader("megatron").iterations(release) == [RELEASE]
    assert get_loader("torch_dist").iterations(torch_dist_run) == [10, 20]
    assert get_loader("hf").iterations(hf) == []
