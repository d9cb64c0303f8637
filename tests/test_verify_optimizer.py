"""``verify`` compares the optimizer state of two checkpoints when both hold one.

Sources are Megatron-LM's own training checkpoints (``tests/data/megatron_lm``), converted to TP1 by
pgconvert and compared with the original. The tampered copies are edited in the written files (the
rank file's Adam state or param groups, torch_dist's ``common.pt``), and their ``pgconvert.json``
manifest is removed, so that only the optimizer comparison can tell them apart from the original.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from support.megatron_fixtures import load_for_test
from support.torch_dist_forms import FOR_MCORE_016

import pgconvert
from pgconvert.cli import main
from pgconvert.run.manifest import MANIFEST_FILE
from pgconvert.formats.megatron import FRAMEWORK_PICKLE

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
ITER = "iter_0000002"
PLAIN = "train_tp2pp2_torch"
DISTRIBUTED = "train_tp2dp2_distopt_bf16_torch"
DP_RESHARDABLE = "train_tp2dp2_distopt_dp_reshardable_torch_dist"
FULLY = "train_tp2dp2_distopt_fully_reshardable_torch_dist"
PLAIN_BF16 = "train_tp2dp2_bf16_torch"
PARAMETERS = 15  # the goldens' tiny Llama: 2 layers x 6 + embedding, final norm, output layer


def _cli(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args], prog_name="pgconvert")


@pytest.fixture(scope="module")
def tp1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each golden converted to TP1 PP1 by pgconvert, optimizer state carried."""
    root = tmp_path_factory.mktemp("tp1")
    return {name: pgconvert.convert(GOLDENS / name, root / name, dst_tp=1, dst_pp=1).dst
            for name in (PLAIN, DISTRIBUTED, DP_RESHARDABLE, FULLY, PLAIN_BF16)}


def _tampered_copy(src: Path, tmp_path: Path) -> Path:
    copy = Path(shutil.copytree(src, tmp_path / f"{src.name}_edited"))
    (copy / MANIFEST_FILE).unlink()  # its sha256s would catch the edit without any optimizer comparison
    return copy


def _rank_file(root: Path) -> Path:
    return root / ITER / "mp_rank_00" / "model_optim_rng.pt"


def _edit_exp_avg(root: Path) -> str:
    """Add 0.5 to element [3, 5] of one parameter's exp_avg in the TP1 bf16 plain-optimizer rank file; returns
    the parameter's name, found without pgconvert: the model tensor its fp32 master rounds to (megatron-core
    copies each master into its parameter after every step), the only matrix that does."""
    path = _rank_file(root)
    state = load_for_test(path)
    optimizer = state["optimizer"]
    groups = optimizer["optimizer"]["param_groups"]
    model = {key: value for key, value in state["model"].items() if isinstance(value, torch.Tensor)}
    for position, master in zip(groups[0]["params"], optimizer["fp32_from_fp16_params"][0]):
        matches = [key for key, value in model.items() if value.shape == master.shape and master.dim() == 2
                   and torch.equal(master.to(value.dtype), value)]
        if len(matches) == 1 and ".layers.1." in matches[0]:
            optimizer["optimizer"]["state"][position]["exp_avg"][3, 5] += 0.5
            torch.save(state, path, pickle_module=FRAMEWORK_PICKLE)  # args' enum stand-ins
            return matches[0]
    raise AssertionError(f"{path}: no layer-1 matrix's master matched one model tensor")


@pytest.mark.parametrize("golden", [PLAIN, DISTRIBUTED, DP_RESHARDABLE])
def test_a_conversion_to_tp1_is_equal_including_the_optimizer(golden: str, tp1: dict[str, Path]) -> None:
    result = _cli("verify", GOLDENS / golden, tp1[golden])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("optimizer state (")]
    assert len(lines) == 1, result.output
    assert lines[0].endswith(f"): {PARAMETERS} parameters compared (bit-exact): equal"), result.output
    report = pgconvert.verify(GOLDENS / golden, tp1[golden])
    assert report.equal and report.optimizer is not None
    assert (report.optimizer.status, report.optimizer.compared) == ("compared", PARAMETERS)
    assert report.optimizer.differences == [] and report.optimizer.padding_differences == []


def test_one_changed_exp_avg_element_is_named(tp1: dict[str, Path], tmp_path: Path) -> None:
    edited = _tampered_copy(tp1[PLAIN_BF16], tmp_path)
    name = _edit_exp_avg(edited)
    result = _cli("verify", GOLDENS / PLAIN_BF16, edited)
    assert result.exit_code == 1, result.output
    assert f"{PARAMETERS} tensors compared (bit-exact): equal" in result.output  # the model is unchanged
    assert f"differs: optimizer {name} exp_avg: 1 of " in result.output, result.output
    assert "max abs diff 0.5" in result.output
    assert "NOT equal: 1 optimizer differences" in result.output
    # The same copy within a tolerance that covers the edit is equal.
    assert _cli("verify", GOLDENS / PLAIN_BF16, edited, "--atol", "0.6").exit_code == 0


def test_the_json_report_lists_optimizer_differences(tp1: dict[str, Path], tmp_path: Path) -> None:
    edited = _tampered_copy(tp1[PLAIN_BF16], tmp_path)
    name = _edit_exp_avg(edited)
    result = _cli("verify", GOLDENS / PLAIN_BF16, edited, "--json")
    assert result.exit_code == 1, result.output
    doc = json.loads(result.output)
    assert doc["equal"] is False and doc["differences"] == []
    optimizer = doc["optimizer"]
    assert optimizer["status"] == "compared" and optimizer["compared"] == PARAMETERS
    assert optimizer["form_a"] == optimizer["form_b"] == "float16"
    assert optimizer["unreadable_a"] is None and optimizer["unreadable_b"] is None
    (difference,) = optimizer["differences"]
    assert (difference["name"], difference["field"], difference["kind"]) == (name, "exp_avg", "values")
    assert difference["differing"] == 1 and difference["max_abs_diff"] == pytest.approx(0.5, rel=0, abs=1e-6)
    assert difference["numel"] == load_for_test(_rank_file(edited))["model"][name].numel()


def test_a_changed_learning_rate_in_a_param_group_is_named(tp1: dict[str, Path], tmp_path: Path) -> None:
    edited = _tampered_copy(tp1[PLAIN], tmp_path)
    path = _rank_file(edited)
    state = load_for_test(path)
    assert state["optimizer"]["param_groups"][1]["lr"] != 0.5
    state["optimizer"]["param_groups"][1]["lr"] = 0.5
    torch.save(state, path, pickle_module=FRAMEWORK_PICKLE)
    result = _cli("verify", GOLDENS / PLAIN, edited, "--json")
    assert result.exit_code == 1, result.output
    (difference,) = json.loads(result.output)["optimizer"]["differences"]
    assert (difference["name"], difference["field"], difference["kind"]) == ("optimizer.param_groups[1].lr", "lr",
                                                                              "config")
    result = _cli("verify", GOLDENS / PLAIN, edited)
    assert result.exit_code == 1
    assert "differs: optimizer.param_groups[1].lr: 'lr' = " in result.output and " in A, 0.5 in B" in result.output


def test_a_changed_learning_rate_in_torch_dist_common_state_is_named(tmp_path: Path) -> None:
    legacy = pgconvert.convert(GOLDENS / FULLY, tmp_path / "legacy", dst_tp=1, dst_pp=1, **FOR_MCORE_016).dst
    edited = _tampered_copy(legacy, tmp_path)  # common.pt, and no integrity manifest to catch the edit first
    path = edited / ITER / "common.pt"
    common = load_for_test(path)
    common["optimizer"]["optimizer"]["param_groups"][0]["lr"] = 0.25
    torch.save(common, path, pickle_module=FRAMEWORK_PICKLE)
    result = _cli("verify", GOLDENS / FULLY, edited)
    assert result.exit_code == 1, result.output
    assert "differs: optimizer.param_groups[0].lr: 'lr' = " in result.output and " in A, 0.25 in B" in result.output
    assert f"{PARAMETERS} parameters compared (bit-exact): NOT equal: 1 optimizer differences" in result.output


def test_changed_counters_are_named(tp1: dict[str, Path], tmp_path: Path) -> None:
    edited = _tampered_copy(tp1[PLAIN], tmp_path)
    path = _rank_file(edited)
    state = load_for_test(path)
    state["opt_param_scheduler"]["num_steps"] += 2
    state["args"].consumed_train_samples += 2
    torch.save(state, path, pickle_module=FRAMEWORK_PICKLE)
    report = pgconvert.verify(GOLDENS / PLAIN, edited)
    assert report.optimizer is not None and not report.equal
    assert sorted(d.name for d in report.optimizer.differences) == [
        "optimizer.consumed_train_samples", "optimizer.opt_param_scheduler.num_steps"]


def test_hf_against_megatron_compares_the_model_and_names_the_optimizer_only_in_a(tp1: dict[str, Path],
                                                                                   tmp_path: Path) -> None:
    hf = pgconvert.convert(tp1[PLAIN], tmp_path / "hf", dst_format="hf").dst
    result = _cli("verify", GOLDENS / PLAIN, hf)
    assert result.exit_code == 0, result.output
    assert f"{PARAMETERS} tensors compared (bit-exact): equal" in result.output
    assert result.output.splitlines()[-1] == "optimizer state: only in A"
    assert pgconvert.verify(hf, GOLDENS / PLAIN).optimizer.status == "only in B"  # type: ignore[union-attr]
    doc = json.loads(_cli("verify", GOLDENS / PLAIN, hf, "--json").output)
    assert doc["equal"] is True and doc["optimizer"]["status"] == "only in A" and doc["optimizer"]["compared"] == 0


def test_a_skip_optimizer_output_is_only_in_a_not_a_difference(tmp_path: Path) -> None:
    model_only = pgconvert.convert(GOLDENS / PLAIN, tmp_path / "m", dst_tp=1, dst_pp=1, skip_optimizer=True).dst
    report = pgconvert.verify(GOLDENS / PLAIN, model_only)
    assert report.equal and report.optimizer is not None and report.optimizer.status == "only in A"


def test_skip_optimizer_compares_the_model_alone(tp1: dict[str, Path], tmp_path: Path) -> None:
    edited = _tampered_copy(tp1[PLAIN_BF16], tmp_path)
    _edit_exp_avg(edited)
    result = _cli("verify", GOLDENS / PLAIN_BF16, edited, "--skip-optimizer")
    assert result.exit_code == 0, result.output
    assert "optimizer state" not in result.output and "differs" not in result.output
    doc = json.loads(_cli("verify", GOLDENS / PLAIN_BF16, edited, "--skip-optimizer", "--json").output)
    assert doc["equal"] is True and doc["optimizer"] == {"status": "skipped"}
    assert pgconvert.verify(GOLDENS / PLAIN_BF16, edited, skip_optimizer=True).optimizer is None


def test_an_unsupported_optimizer_form_is_named_without_failing_the_model(tmp_path: Path) -> None:
    # Bucketed with DDP's default size at context parallel 32: megatron-core 0.16.1 sizes it from DP (40M),
    # 0.20.0 from DP x CP (64M), and the checkpoint does not say which made it.
    from pgconvert.savers.megatron import save_durably

    run = tmp_path / "default_bucket"
    shutil.copytree(GOLDENS / DISTRIBUTED, run)
    for path in sorted(run.glob(f"{ITER}/mp_rank_*/model_optim_rng.pt")):
        state = dict(load_for_test(path))
        state["args"].overlap_grad_reduce, state["args"].context_parallel_size = True, 32
        save_durably(state, path)
    result = _cli("verify", run, run)
    assert result.exit_code == 0, result.output
    assert "tensors compared (bit-exact): equal" in result.output
    assert "optimizer state of A unreadable: " in result.output and "context_parallel_size=32" in result.output
    assert result.output.splitlines()[-1] == "optimizer state: not compared"
    doc = json.loads(_cli("verify", run, run, "--json").output)
    assert doc["optimizer"]["status"] == "not compared" and "0.20.0" in doc["optimizer"]["unreadable_b"]


def test_a_plain_optimizer_in_torch_dist_is_compared() -> None:
    # megatron-core's plain optimizer in a torch_dist checkpoint is read, so verify compares it.
    golden = GOLDENS / "train_tp2pp2_bf16_torch_dist"
    result = _cli("verify", golden, golden)
    assert result.exit_code == 0, result.output
    assert f"{PARAMETERS} parameters compared (bit-exact): equal" in result.output


def test_optimizer_state_that_does_not_open_is_a_named_difference(tp1: dict[str, Path], tmp_path: Path) -> None:
    edited = _tampered_copy(tp1[DISTRIBUTED], tmp_path)
    (edited / ITER / "mp_rank_00" / "distrib_optim.pt").unlink()
    result = _cli("verify", GOLDENS / DISTRIBUTED, edited)
    assert result.exit_code == 1, result.output
    assert f"{PARAMETERS} tensors compared (bit-exact): equal" in result.output  # the model was compared
    assert "differs: optimizer state of B: " in result.output and "distrib_optim.pt is missing" in result.output
    assert result.output.splitlines()[-1] == "optimizer state: not compared"
    doc = json.loads(_cli("verify", GOLDENS / DISTRIBUTED, edited, "--json").output)
    optimizer = doc["optimizer"]
    assert optimizer["unreadable_a"] is None and "distrib_optim.pt is missing" in optimizer["unreadable_b"]
    assert [d["kind"] for d in optimizer["differences"]] == ["unreadable"]


def test_the_optimizer_state_is_read_and_freed_one_parameter_at_a_time(tp1: dict[str, Path],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each side's state of a parameter is loaded next to the other side's of the same parameter only:
    every tensor handed out for an earlier parameter is freed before the next parameter is read."""
    import weakref

    from pgconvert.optimizer.source import OptimizerSource
    from pgconvert.loaders.torch_dist.optimizer import TorchDistOptimizerSource

    handed: list[tuple[str, weakref.ref[torch.Tensor]]] = []
    calls: list[str] = []
    stale: list[str] = []

    Read = Callable[[OptimizerSource, str], dict[str, torch.Tensor]]

    def spy(original: Read) -> Read:
        def parameter(self: OptimizerSource, name: str) -> dict[str, torch.Tensor]:
            stale.extend(f"{held} alive while reading {name}" for held, ref in handed
                         if held != name and ref() is not None)
            state = original(self, name)
            handed.extend((name, weakref.ref(tensor)) for tensor in state.values())
            calls.append(name)
            return state
        return parameter

    for cls in (OptimizerSource, TorchDistOptimizerSource):
        if "parameter" in vars(cls):  # each class that reads on its own (the base checks every reader's values)
            monkeypatch.setattr(cls, "parameter", spy(cls.parameter))
    report = pgconvert.verify(GOLDENS / DP_RESHARDABLE, tp1[DP_RESHARDABLE])
    assert report.equal and report.optimizer is not None and report.optimizer.compared == PARAMETERS
    assert len(calls) == 2 * PARAMETERS and calls[0::2] == calls[1::2]  # A then B, per parameter
    assert stale == []
