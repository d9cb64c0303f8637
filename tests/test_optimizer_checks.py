"""Every value of optimizer state read is checked, by one validation pass (``pgconvert.optimizer.checks``) that
``convert``, ``convert --dry-run``, ``inspect`` and ``verify`` share: NaN/Inf in fp32 masters and Adam's moments under
the weights' policy (a notice by default, refused under ``--check-finite``), what every rank saves alike compared
between the ranks' files, each value's range, the param groups megatron-core builds for the model, and the buffer
dtype keys against the model's weights and the run's args.

Each fault is planted in Megatron-LM's own TP2 DP2 bf16 training goldens (``tests/data/megatron_lm``: the distributed
optimizer's ``distrib_optim.pt`` files and the plain one's rank files) or in pgconvert's torch_dist output of one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import Result
from support.megatron_fixtures import load_for_test
from support.optimizer_cli import run_cli
from support.optimizer_faults import (BF16_KEY, DISTRIBUTED, ITER, PLAIN_BF16, copy_checkpoint, distributed_groups,
                                      edit_common, edit_distrib_optim, edit_rank_files, rank_files,
                                      replace_stored_object, set_in_groups, stored_object)
from support.torch_dist_forms import FOR_MCORE_016

import pgconvert
import pgconvert.optimizer.source as optimizer_source

Plant = Callable[[Path], None]


def _planted(golden: Path, plant: Plant, where: Path) -> Path:
    src = copy_checkpoint(golden, where)
    plant(src)
    return src


def _lines(result: Result, start: str) -> list[str]:
    return [line for line in result.output.splitlines() if line.startswith(start)]


def _refused_alike(src: Path, reference: Path, dst: Path, *expected: str) -> None:
    """``convert`` and ``convert --dry-run`` exit 1 naming it (nothing written), ``inspect`` lists it as its one
    error (exit 1), ``verify`` against ``reference`` as a difference (exit 1): the same message each time."""
    for extra in ((), ("--dry-run",)):
        result = run_cli("convert", src, dst, "--dst-tp", "1", "-q", *extra)
        assert result.exit_code == 1, result.output
        assert all(text in result.output for text in expected), result.output
        assert not dst.exists()
    result = run_cli("inspect", src)
    assert result.exit_code == 1, result.output
    (error,) = _lines(result, "  error: ")
    assert all(text in error for text in expected), result.output
    result = run_cli("verify", src, reference)
    assert result.exit_code == 1, result.output
    assert any(all(text in line for text in expected) for line in _lines(result, "differs: optimizer state of A: ")), \
        result.output


# ------------------------------------------------------------------------------------------------ NaN and Inf

def _nan_in_exp_avg_on_rank_1(src: Path) -> None:
    def change(state: dict[Any, Any]) -> None:
        state[0][BF16_KEY]["exp_avg"][0] = math.nan  # the flat buffer starts with the last-registered parameter
    edit_distrib_optim(src, change, ranks=[1])


def _inf_in_exp_avg_sq_on_rank_1(src: Path) -> None:
    def change(state: dict[str, Any]) -> None:
        state["optimizer"]["optimizer"]["state"][0]["exp_avg_sq"][0, 3] = math.inf  # position 0: the first parameter
    edit_rank_files(src, change, ranks=[1])


def _nan_in_a_master_and_its_weight_on_rank_0(src: Path) -> None:
    def change(state: dict[str, Any]) -> None:
        master, weight = state["optimizer"]["fp32_from_fp16_params"][0][0], state["model"][EMBEDDING]
        assert torch.equal(master.to(weight.dtype), weight)  # position 0 is the word embedding's master
        master[1, 2] = math.nan
        weight[1, 2] = math.nan  # megatron-core copies each master into its weight after every step
    edit_rank_files(src, change, ranks=[0])


EMBEDDING = "embedding.word_embeddings.weight"
NON_FINITE = {
    # GPTModel registers output_layer last; the distributed optimizer's buffer holds the parameters reversed.
    "NaN in exp_avg, distrib_optim.pt of one rank": (
        DISTRIBUTED, _nan_in_exp_avg_on_rank_1,
        "optimizer state of output_layer.weight, exp_avg: 1 of 8192 values are NaN or Inf (1 NaN) in {src}/"
        f"{ITER}/mp_rank_01/distrib_optim.pt"),
    "Inf in exp_avg_sq, rank file of one rank": (
        PLAIN_BF16, _inf_in_exp_avg_sq_on_rank_1,
        f"optimizer state of {EMBEDDING}, exp_avg_sq: 1 of 8192 values are NaN or Inf (1 Inf) in {{src}}/{ITER}/"
        "mp_rank_01/model_optim_rng.pt"),
    "NaN in an fp32 master and its weight": (
        PLAIN_BF16, _nan_in_a_master_and_its_weight_on_rank_0,
        f"optimizer state of {EMBEDDING}, fp32 param: 1 of 8192 values are NaN or Inf (1 NaN) in {{src}}/{ITER}/"
        "mp_rank_00/model_optim_rng.pt"),
}
# Under --check-finite the model is read first: its weight's NaN is refused before the master's is reached.
REFUSED_FIRST = {"NaN in an fp32 master and its weight":
                 f"{EMBEDDING}: 1 of 16384 values are NaN or Inf (1 NaN) in {{src}}/{ITER}"}


@pytest.mark.parametrize("case", sorted(NON_FINITE))
def test_nan_or_inf_in_optimizer_state_is_a_notice_naming_it_and_refused_under_check_finite(
        case: str, tmp_path: Path) -> None:
    golden, plant, text = NON_FINITE[case]
    src = _planted(golden, plant, tmp_path / "src")
    notice = text.format(src=src)

    converted = run_cli("convert", src, tmp_path / "dst", "--dst-tp", "1")
    assert converted.exit_code == 0, converted.output
    assert f"note: {notice}" in _lines(converted, "note: "), converted.output
    verified = run_cli("verify", src, tmp_path / "dst")  # carried as it is
    assert verified.exit_code == 0, verified.output
    assert {f"note: A: {notice}"} <= set(_lines(verified, "note: A: ")), verified.output
    assert any(line.startswith("note: B: optimizer state of ") for line in _lines(verified, "note: B: "))
    inspected = run_cli("inspect", src)
    assert inspected.exit_code == 0, inspected.output
    assert f"  warning: {notice}" in _lines(inspected, "  warning: "), inspected.output

    refused = run_cli("convert", src, tmp_path / "refused", "--dst-tp", "1", "--check-finite")
    assert refused.exit_code == 1, refused.output
    first = REFUSED_FIRST.get(case, text).format(src=src)
    assert f"{first} (refused by --check-finite)" in refused.output and "Traceback" not in refused.output
    assert not (tmp_path / "refused").exists()


def test_inspect_skip_finite_check_reads_no_optimizer_value(tmp_path: Path) -> None:
    src = _planted(DISTRIBUTED, _nan_in_exp_avg_on_rank_1, tmp_path / "src")
    result = run_cli("inspect", src, "--skip-finite-check")
    assert result.exit_code == 0 and "NaN" not in result.output, result.output
    assert _lines(result, "optimizer ") == ["optimizer   distributed: 15 parameters checked, values not read"]


# ------------------------------------------------------------------------------------------------ between ranks

def _on_rank_1(change: Callable[[dict[str, Any]], None]) -> Plant:
    return lambda src: edit_rank_files(src, change, ranks=[1])


def _scaler_on_rank_1(state: dict[str, Any]) -> None:
    state["optimizer"]["grad_scaler"] = {"scale": torch.tensor([4096.0]), "growth_tracker": 0, "hysteresis_tracker": 2}


def _key_on_rank_1(src: Path) -> None:
    def change(state: dict[Any, Any]) -> None:
        state[0] = {(torch.float16, torch.float32): state[0][BF16_KEY]}
    edit_distrib_optim(src, change, ranks=[1])


RANK_FILE = "{src}/" + ITER + "/mp_rank_0{rank}/model_optim_rng.pt"
DISAGREEING = {
    "lr on one rank": (_on_rank_1(lambda state: distributed_groups(state)[0].update(lr=0.5)),
                       "optimizer.param_groups[0].lr differs between ranks: 0.0001 in {r0}, 0.5 in {r1}"),
    "a group missing on one rank": (_on_rank_1(lambda state: distributed_groups(state).pop()),
                                    "the number of optimizer.param_groups differs between ranks: 2 in {r0}, 1 in {r1}"),
    "an extra group on one rank": (
        _on_rank_1(lambda state: distributed_groups(state).append(dict(distributed_groups(state)[1]))),
        "the number of optimizer.param_groups differs between ranks: 2 in {r0}, 3 in {r1}"),
    "the scheduler on one rank": (_on_rank_1(lambda state: state["opt_param_scheduler"].update(num_steps=5)),
                                  "opt_param_scheduler.num_steps differs between ranks: 4 in {r0}, 5 in {r1}"),
    "a grad scaler on one rank": (_on_rank_1(_scaler_on_rank_1),
                                  "optimizer.grad_scaler differs between ranks: None in {r0}, {{'scale': "),
    "a dtype key on one rank": (_key_on_rank_1,
                                "dtype_key[0] differs between ranks: (bfloat16, float32) in {d0}, (float16, float32) "
                                "in {d1}"),
}


@pytest.mark.parametrize("case", sorted(DISAGREEING))
def test_what_ranks_save_alike_is_compared_naming_both_values_and_files(case: str, tmp_path: Path) -> None:
    plant, text = DISAGREEING[case]
    src = _planted(DISTRIBUTED, plant, tmp_path / "src")
    r0, r1 = (RANK_FILE.format(src=src, rank=rank) for rank in (0, 1))
    d0, d1 = (path.replace("model_optim_rng.pt", "distrib_optim.pt") for path in (r0, r1))
    _refused_alike(src, DISTRIBUTED, tmp_path / "dst", text.format(r0=r0, r1=r1, d0=d0, d1=d1))


@pytest.fixture(scope="module")
def dp_reshardable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The distributed-optimizer golden in torch_dist's dp_reshardable form: one param-group object per
    model-parallel rank."""
    out = tmp_path_factory.mktemp("td") / "dp_reshardable"
    return pgconvert.convert(DISTRIBUTED, out, dst_format="torch_dist", dst_optim_form="dp_reshardable",
                             **FOR_MCORE_016).dst


def test_torch_dist_param_groups_of_one_model_parallel_rank_are_compared(dp_reshardable: Path, tmp_path: Path) -> None:
    src = copy_checkpoint(dp_reshardable, tmp_path / "src")
    (src / "pgconvert.json").unlink()
    key = "optimizer.distributed.dp_group_idx_1.optimizer/shard_0_1"
    held = stored_object(src / ITER, key)
    held["param_groups"][1]["lr"] = 0.25
    replace_stored_object(src / ITER, key, held)
    prefix = f"{src}/{ITER}: optimizer.distributed.dp_group_idx_"
    _refused_alike(src, dp_reshardable, tmp_path / "dst",
                   f"optimizer.param_groups[1].lr differs between ranks: 0.0001 in {prefix}0, 0.25 in {prefix}1")


# ------------------------------------------------------------------------------------------------ ranges

def _on_every_rank(change: Callable[[list[dict[str, Any]]], None]) -> Plant:
    return lambda src: edit_rank_files(src, lambda state: change(distributed_groups(state)))


def _plain_steps(value: float) -> Plant:
    def change(state: dict[str, Any]) -> None:
        for entry in state["optimizer"]["optimizer"]["state"].values():
            entry["step"] = torch.tensor(value)
    return lambda src: edit_rank_files(src, change)


OUT_OF_RANGE = {
    "a negative step": (DISTRIBUTED, _on_every_rank(set_in_groups("step", -2.0)),
                        "optimizer.param_groups[0].step = -2.0: a step count is a whole number >= 0"),
    "a non-integral step": (DISTRIBUTED, _on_every_rank(set_in_groups("step", 2.5)),
                            "optimizer.param_groups[0].step = 2.5: a step count is a whole number >= 0"),
    "beta2 = 1": (DISTRIBUTED, _on_every_rank(set_in_groups("betas", (0.9, 1.0))),
                  "optimizer.param_groups[0].betas = (0.9, 1.0): expected two numbers in [0, 1)"),
    "eps = 0": (DISTRIBUTED, _on_every_rank(set_in_groups("eps", 0.0)),
                "optimizer.param_groups[0].eps = 0.0: expected a finite number > 0"),
    "an infinite lr": (DISTRIBUTED, _on_every_rank(set_in_groups("lr", math.inf)),
                       "optimizer.param_groups[0].lr = inf: expected a finite number >= 0"),
    "a negative per-parameter step": (PLAIN_BF16, _plain_steps(-1.0),
                                      "optimizer.state[*].step = tensor(-1.0): a step count is a whole number >= 0"),
    "an iteration its directory contradicts": (
        DISTRIBUTED, lambda src: edit_rank_files(src, lambda state: state.update(iteration=3)),
        "iteration = 3: the checkpoint is iteration 2 (its directory)"),
}


@pytest.mark.parametrize("case", sorted(OUT_OF_RANGE))
def test_a_value_out_of_its_range_is_named_with_the_file_and_the_constraint(case: str, tmp_path: Path) -> None:
    golden, plant, text = OUT_OF_RANGE[case]
    src = _planted(golden, plant, tmp_path / "src")
    _refused_alike(src, golden, tmp_path / "dst", f"{RANK_FILE.format(src=src, rank=0)}: {text}")


@pytest.fixture(scope="module")
def fully_reshardable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The distributed-optimizer golden in torch_dist's fully_reshardable form: param groups in common.pt."""
    out = tmp_path_factory.mktemp("td") / "fully_reshardable"
    return pgconvert.convert(DISTRIBUTED, out, dst_format="torch_dist", **FOR_MCORE_016).dst


def test_torch_dist_common_state_values_are_range_checked(fully_reshardable: Path, tmp_path: Path) -> None:
    src = copy_checkpoint(fully_reshardable, tmp_path / "src")
    (src / "pgconvert.json").unlink()
    edit_common(src / ITER, lambda common: common["optimizer"]["optimizer"]["param_groups"][1].update(
        betas=(0.9, 1.0)))
    _refused_alike(src, fully_reshardable, tmp_path / "dst",
                   f"{src}/{ITER} (common state): optimizer.param_groups[1].betas = (0.9, 1.0): expected two numbers in [0, 1)")


# ------------------------------------------------------------------------------------------------ groups, dtypes

def test_a_model_that_needs_two_param_groups_given_one_is_named(tmp_path: Path) -> None:
    src = _planted(DISTRIBUTED, _on_every_rank(lambda groups: groups.pop()), tmp_path / "src")
    _refused_alike(src, DISTRIBUTED, tmp_path / "dst",
                   f"{RANK_FILE.format(src=src, rank=0)}: optimizer.param_groups holds 1 groups, but megatron-core "
                   "0.16.1 / 0.20.0 builds 2 for this model (weight decay, then no weight decay")


def _every_key(key: tuple[torch.dtype, torch.dtype]) -> Plant:
    def change(state: dict[Any, Any]) -> None:
        state[0] = {key: state[0][BF16_KEY]}
    return lambda src: edit_distrib_optim(src, change)


DTYPE_KEYS = {
    "the model's dtype": ((torch.float16, torch.float32),
                          "buffer dtype key = (float16, float32): the model's decoder.final_layernorm.weight is stored "
                          "in bfloat16 (15 of its 15 parameters are not float16)"),
    "the args' grad dtype": ((torch.bfloat16, torch.bfloat16),
                             "buffer dtype key = (bfloat16, bfloat16): the run's args (bf16=True, fp16=False, "
                             "accumulate_allreduce_grads_in_fp32=True) give (bfloat16, float32)"),
}


@pytest.mark.parametrize("case", sorted(DTYPE_KEYS))
def test_a_buffer_dtype_key_that_contradicts_the_model_or_the_args_is_named(case: str, tmp_path: Path) -> None:
    key, text = DTYPE_KEYS[case]
    src = _planted(DISTRIBUTED, _every_key(key), tmp_path / "src")
    assert len(rank_files(src, "distrib_optim.pt")) == 2
    _refused_alike(src, DISTRIBUTED, tmp_path / "dst", f"{src}/{ITER}/mp_rank_00/distrib_optim.pt: {text}")


# ------------------------------------------------------------------------------------------------ not Adam

FS_MODEL_SPACE_MOE = DISTRIBUTED.parent / "mcore015_tp1ep2dp4_moe_distopt_fs_model_space_torch_dist"


def _run_args(**values: Any) -> Callable[[Any], None]:
    """A change of the ``args`` that Megatron-LM records (a rank file's or a common state's)."""
    def change(state: dict[str, Any]) -> None:
        for key, value in values.items():
            if value is None:
                delattr(state["args"], key)
            else:
                setattr(state["args"], key, value)
    return change


# How Megatron-LM's validate_args records each run (d98e8a64, megatron-core 0.19.2): --optimizer muon
# --use-distributed-optimizer is the layer-wise distributed optimizer, its use_distributed_optimizer turned off.
OTHER_RUNS = {
    "layer-wise muon": ({"optimizer": "muon", "use_layer_wise_distributed_optimizer": True},
                        "args.optimizer='muon' with the layer-wise distributed optimizer "
                        "(use_layer_wise_distributed_optimizer): the run's optimizer state (Muon's momentum_buffer"),
    "sgd": ({"optimizer": "sgd"}, "args.optimizer='sgd': the run's optimizer state (torch SGD's momentum_buffer)"),
}


@pytest.mark.parametrize("case", sorted(OTHER_RUNS))
def test_an_optimizer_other_than_adam_is_named_and_not_read_as_adam(case: str, tmp_path: Path) -> None:
    values, text = OTHER_RUNS[case]
    src = _planted(DISTRIBUTED, lambda root: edit_rank_files(root, _run_args(**values)), tmp_path / "src")
    result = run_cli("convert", src, tmp_path / "dst", "--dst-tp", "1")
    assert result.exit_code == 0, result.output
    assert text in " ".join(result.output.split()) and "--skip-optimizer" in result.output
    assert "optimizer" not in load_for_test(rank_files(tmp_path / "dst")[0])  # the model alone
    strict = run_cli("convert", src, tmp_path / "strict", "--dst-tp", "1", "--strict")
    assert strict.exit_code != 0 and text in " ".join(strict.output.split()) and not (tmp_path / "strict").exists()
    exported = run_cli("export-optimizer", src, tmp_path / "export")
    assert exported.exit_code != 0 and text in " ".join(exported.output.split()), exported.output


def test_a_torch_dist_run_of_another_optimizer_is_named(tmp_path: Path) -> None:
    src = copy_checkpoint(FS_MODEL_SPACE_MOE, tmp_path / "src")
    edit_common(src / ITER, _run_args(optimizer="soap"))
    result = run_cli("convert", src, tmp_path / "dst", "--dst-format", "torch_dist", "--strict")
    assert result.exit_code != 0 and "args.optimizer='soap'" in result.output, result.output


def test_a_run_that_records_no_optimizer_is_adams(tmp_path: Path) -> None:
    # Megatron-LM's default is adam; args without the key (older releases) are Adam's
    src = _planted(DISTRIBUTED, lambda root: edit_rank_files(root, _run_args(optimizer=None)), tmp_path / "src")
    result = run_cli("convert", src, tmp_path / "dst", "--dst-tp", "1", "--strict", "-q")
    assert result.exit_code == 0, result.output
    assert "optimizer" in load_for_test(rank_files(tmp_path / "dst")[0])


@pytest.mark.parametrize("at", [0, 6, 7, 20])  # the first slice, its last element, the next slice, the last one
def test_a_master_that_does_not_round_to_its_weight_is_found_in_any_slice(at: int,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(optimizer_source, "ROUNDED_AT_ONCE", 7)  # rounded seven elements at a time
    master = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    master[1, 3] = float("nan")  # NaN rounds to NaN: for the NaN/Inf policy, not this check
    weight = master.to(torch.bfloat16)
    assert optimizer_source.rounds_to(master, weight)
    moved = weight.clone()
    moved.view(-1)[at] = moved.view(-1)[at] * 2 + 1  # another value: the master no longer rounds to it
    assert not optimizer_source.rounds_to(master, moved)
    assert not optimizer_source.rounds_to(master, weight[:, :6])  # another shape
    assert optimizer_source.rounds_to(master[:, 1:], weight[:, 1:])  # a view that is not contiguous

