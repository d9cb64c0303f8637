"""decoupled_lr: the embedding and output parameters' own param group, as megatron-core 0.16.1 builds it.

megatron-core writes the runs itself (``support/mcore_tied_distopt.py``: GPTModel + DDP + ``get_megatron_optimizer``
in gloo processes, two steps, Megatron-LM's per-rank files) with ``decoupled_lr`` and ``decoupled_min_lr`` set: the
distributed optimizer at PP2 (the first stage's word embedding and the last stage's output copy of the tied embedding
are flagged ``is_embedding_or_output_parameter``) and at PP1, and the plain optimizer at PP2, whose param groups list
their parameters' positions. pgconvert derives those positions and each group's ``wd_mult``, ``max_lr`` and
``min_lr``, converts PP2 to PP1 and back bit for bit, and its PP1 output holds exactly the param groups megatron-core's
own PP1 run holds.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from support.checkpoint_compare import read_common
from support.megatron_fixtures import assert_same_tree, load_for_test

from pgconvert.cli import main
from pgconvert.errors import PgconvertError
from pgconvert.formats.megatron import config_from_args, layout_from_args
from pgconvert.model.grid import RankCoord
from pgconvert.optimizer.order import OptimizerLayoutError, OptimizerRules, check_param_groups, chained_slots

pytest.importorskip("megatron.core", reason="megatron-core writes the runs")

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
TEMPLATE = GOLDENS / "train_tp2dp2_distopt_bf16_torch" / "iter_0000002"
SCRIPT = Path(__file__).parent / "support" / "mcore_tied_distopt.py"
ITER = "iter_0000002"
DECOUPLED = {"decoupled_lr": 3e-3, "decoupled_min_lr": 2e-4}
RUN = dict(DECOUPLED, tensor_model_parallel_size=1, untie_embeddings_and_output_weights=False)
RANKS = {1: ("mp_rank_00",), 2: ("mp_rank_00_000", "mp_rank_00_001")}


def _megatron_core_run(root: Path, pp: int, **more: Any) -> Path:
    overrides = dict(RUN, pipeline_model_parallel_size=pp, **more)
    done = subprocess.run([sys.executable, "-W", "ignore", str(SCRIPT), str(TEMPLATE), json.dumps(overrides),
                           str(root)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """megatron-core's own decoupled_lr distributed-optimizer runs at PP1 and PP2 (same seed, same steps)."""
    root = tmp_path_factory.mktemp("decoupled")
    return {pp: _megatron_core_run(root / f"pp{pp}", pp) for pp in (1, 2)}


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """megatron-core's own decoupled_lr plain-optimizer run at PP2."""
    return _megatron_core_run(tmp_path_factory.mktemp("decoupled_plain") / "pp2", 2, use_distributed_optimizer=False)


def _convert(src: Path, dst: Path, *flags: str) -> Result:
    return CliRunner().invoke(main, ["convert", str(src), str(dst), "-q", "--strict", *flags], prog_name="pgconvert")


def _param_groups(root: Path, rank: str) -> list[dict[str, Any]]:
    return load_for_test(root / ITER / rank / "model_optim_rng.pt")["optimizer"]["optimizer"]["param_groups"]


def _derived(root: Path, rank: str, stage: int) -> tuple[list[Any], OptimizerRules, Any]:
    """pgconvert's dense param groups (slots) for ``rank`` of the run at ``root``, its rules and args."""
    args = load_for_test(root / ITER / rank / "model_optim_rng.pt")["args"]
    config, layout = config_from_args(args, Path("args"), "local", None), layout_from_args(args, Path("args"))
    rules = OptimizerRules.from_args(args, "args")
    (slots,) = chained_slots(config, layout, RankCoord(0, stage), rules, args.padded_vocab_size)
    return slots, rules, args


def test_megatron_core_builds_the_groups_pgconvert_derives(runs: dict[int, Path], plain_run: Path) -> None:
    flagged = {("mp_rank_00", 1): ["embedding.word_embeddings.weight"],
               ("mp_rank_00_000", 2): ["embedding.word_embeddings.weight"],
               ("mp_rank_00_001", 2): ["output_layer.weight"]}
    for stage, rank in enumerate(RANKS[2]):  # the plain optimizer's groups list positions
        slots, rules, _ = _derived(plain_run, rank, stage)
        check_param_groups(slots, _param_groups(plain_run, rank), rank, rules)
        assert [slot.spec.local_name for slot in slots[1]] == flagged[(rank, 2)]
    for pp, root in runs.items():  # the distributed optimizer's groups: overrides only
        for stage, rank in enumerate(RANKS[pp]):
            slots, rules, args = _derived(root, rank, stage)
            assert (rules.decoupled_lr, rules.decoupled_min_lr) == (3e-3, 2e-4)
            held = _param_groups(root, rank)
            assert [(group["wd_mult"], group["max_lr"], group["min_lr"]) for group in held] == [
                (1.0, args.lr, args.min_lr), (1.0, 3e-3, 2e-4), (0.0, args.lr, args.min_lr)]
            assert [slot.spec.local_name for slot in slots[1]] == flagged[(rank, pp)]


def test_pp2_to_pp1_and_back_is_bit_exact_and_pp1_holds_megatron_cores_groups(runs: dict[int, Path],
                                                                               tmp_path: Path) -> None:
    one = _convert(runs[2], tmp_path / "pp1", "--dst-pp", "1")
    assert one.exit_code == 0, one.output
    back = _convert(tmp_path / "pp1", tmp_path / "back", "--dst-pp", "2")
    assert back.exit_code == 0, back.output
    for rank in RANKS[2]:
        original = load_for_test(runs[2] / ITER / rank / "model_optim_rng.pt")
        again = load_for_test(tmp_path / "back" / ITER / rank / "model_optim_rng.pt")
        for key in ("optimizer", "opt_param_scheduler", "model"):
            assert_same_tree(original[key], again[key], f"{rank}.{key}")
        assert_same_tree(torch.load(runs[2] / ITER / rank / "distrib_optim.pt", weights_only=True),
                         torch.load(tmp_path / "back" / ITER / rank / "distrib_optim.pt", weights_only=True),
                         f"{rank}/distrib_optim.pt")
    assert_same_tree(_param_groups(runs[1], "mp_rank_00"), _param_groups(tmp_path / "pp1", "mp_rank_00"), "groups")


@pytest.mark.parametrize("form", ["fully_reshardable", "dp_reshardable"])
def test_through_torch_dist_and_back_is_bit_exact(runs: dict[int, Path], tmp_path: Path, form: str) -> None:
    there = _convert(runs[2], tmp_path / "td", "--dst-format", "torch_dist", "--dst-pp", "1", "--dst-optim-form", form)
    assert there.exit_code == 0, there.output
    groups = read_common(tmp_path / "td" / ITER)["optimizer"]
    if form == "fully_reshardable":  # the param groups in the common state, the decoupled one in the middle
        assert [group["max_lr"] for group in groups["optimizer"]["param_groups"]][1] == 3e-3
    back = _convert(tmp_path / "td", tmp_path / "back", "--dst-format", "megatron", "--dst-pp", "2")
    assert back.exit_code == 0, back.output
    for rank in RANKS[2]:
        original = load_for_test(runs[2] / ITER / rank / "model_optim_rng.pt")
        again = load_for_test(tmp_path / "back" / ITER / rank / "model_optim_rng.pt")
        assert_same_tree(original["optimizer"], again["optimizer"], f"{rank}.optimizer")
        assert_same_tree(torch.load(runs[2] / ITER / rank / "distrib_optim.pt", weights_only=True),
                         torch.load(tmp_path / "back" / ITER / rank / "distrib_optim.pt", weights_only=True),
                         f"{rank}/distrib_optim.pt")


def test_a_group_that_is_not_the_decoupled_one_is_named(plain_run: Path) -> None:
    slots, rules, args = _derived(plain_run, "mp_rank_00_001", 1)
    held = _param_groups(plain_run, "mp_rank_00_001")
    changed = [dict(group) for group in held]
    changed[1]["max_lr"] = 1e-3
    with pytest.raises(OptimizerLayoutError, match=r"param_groups\[1\]: wd_mult=1\.0, max_lr=0\.001, min_lr=0\.0002"):
        check_param_groups(slots, changed, "x", rules)
    undecoupled = OptimizerRules()  # as if the run had no decoupled_lr
    config, layout = config_from_args(args, Path("args"), "local", None), layout_from_args(args, Path("args"))
    (two,) = chained_slots(config, layout, RankCoord(0, 1), undecoupled, args.padded_vocab_size)
    with pytest.raises(OptimizerLayoutError, match="holds 3 groups; megatron-core 0.16.1 / 0.20.0 builds 2"):
        check_param_groups(two, held, "x", undecoupled)


@dataclasses.dataclass
class _Args:
    decoupled_lr: Any = None
    decoupled_min_lr: Any = None


@pytest.mark.parametrize("value", ["0.1", -1.0, float("nan"), True])
def test_a_decoupled_lr_that_is_not_a_learning_rate_is_refused(value: Any) -> None:
    with pytest.raises(PgconvertError, match=r"x: args.decoupled_lr=.*not a learning rate"):
        OptimizerRules.from_args(_Args(decoupled_lr=value), "x")  # type: ignore[arg-type]
