"""``--dst-dp N``: the carried optimizer state written for another data-parallel size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from support.megatron_fixtures import assert_same_tree, load_for_test

from pgconvert.cli import main
from pgconvert.errors import ValidationError
from pgconvert.model.layout import ParallelLayout
from pgconvert.formats.registry import get_saver
from pgconvert.optimizer.data_parallel import check_dst_dp

DISTOPT = Path(__file__).parent / "data" / "megatron_lm" / "train_tp2dp2_distopt_bf16_torch"
ITER = "iter_0000002"


def _run(src: Path, dst: Path, *flags: str) -> Result:
    return CliRunner().invoke(main, ["convert", str(src), str(dst), "-q", *flags], prog_name="pgconvert")



def test_dp2_to_dp4_and_back_is_bit_exact(tmp_path: Path) -> None:
    four = _run(DISTOPT, tmp_path / "dp4", "--dst-dp", "4")
    assert four.exit_code == 0, four.output
    back = _run(tmp_path / "dp4", tmp_path / "back", "--dst-dp", "2")
    assert back.exit_code == 0, back.output
    for rank in ("mp_rank_00", "mp_rank_01"):
        original = load_for_test(DISTOPT / ITER / rank / "model_optim_rng.pt")
        at_four = load_for_test(tmp_path / "dp4" / ITER / rank / "model_optim_rng.pt")
        again = load_for_test(tmp_path / "back" / ITER / rank / "model_optim_rng.pt")
        assert (original["args"].data_parallel_size, original["args"].world_size) == (2, 4)
        assert (at_four["args"].data_parallel_size, at_four["args"].world_size) == (4, 8)
        assert (again["args"].data_parallel_size, again["args"].world_size) == (2, 4)
        for key in ("optimizer", "model", "iteration", "opt_param_scheduler"):
            assert_same_tree(original[key], again[key], f"{rank}.{key}")
        # One DP-gathered file per model-parallel rank, the same at every DP size (DP rank 0 scatters it).
        flat = torch.load(DISTOPT / ITER / rank / "distrib_optim.pt", weights_only=True)
        for root in (tmp_path / "dp4", tmp_path / "back"):
            assert_same_tree(flat, torch.load(root / ITER / rank / "distrib_optim.pt", weights_only=True), f"{root.name}/{rank}")


def test_invalid_dst_dp_values_are_refused(tmp_path: Path) -> None:
    zero = _run(DISTOPT, tmp_path / "zero", "--dst-dp", "0")
    assert zero.exit_code == 2 and "--dst-dp" in zero.output and "Traceback" not in zero.output
    skipped = _run(DISTOPT, tmp_path / "skip", "--dst-dp", "4", "--skip-optimizer")
    assert skipped.exit_code == 2, skipped.output
    assert "--dst-dp 4: sizes the carried optimizer state" in skipped.output and not (tmp_path / "skip").exists()
    with pytest.raises(ValidationError, match=r"--dst-dp 2: tp\*cp\*dp = 1\*1\*2 is not a multiple of expert_tp\*ep = 1\*4"):
        check_dst_dp(2, ParallelLayout(tp=1, pp=1, ep=4), None, False, get_saver("megatron"))
    with pytest.raises(ValidationError, match="--dst-dp 2: applies to a Megatron per-rank destination, not hf"):
        check_dst_dp(2, ParallelLayout(tp=1, pp=1), None, False, get_saver("hf"))
