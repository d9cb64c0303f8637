"""``verify`` names every optimizer value that differs: one value planted at a time into a converted destination
(or into its source), for each optimizer storage form pgconvert writes, and ``verify`` must exit 1 naming it.

Sources: Megatron-LM's TP2 DP2 bf16 goldens (the plain optimizer, fp32 masters in the rank file; the distributed
optimizer, ``distrib_optim.pt``), with a dynamic grad scaler's state added where megatron-core 0.16.1 keeps it
(``optimizer.grad_scaler``). Destinations (converted once per module, to TP1): per-rank plain, per-rank
distributed, torch_dist ``dp_reshardable`` and ``fully_sharded_model_space``. The goldens' vocab is 255 padded to
256: at TP2 the last true row (254) and the trained padding row (255) lie on TP rank 1, at TP1 on the one rank.
The planted values are found without pgconvert (``support.planted_values``), and each edited copy loses its
``pgconvert.json`` so that only the optimizer comparison can tell it from the original.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from support.megatron_fixtures import load_for_test
from support.optimizer_cli import dcp_read
from support.optimizer_faults import edit_common, replace_stored_object, stored_object
from support.planted_values import bump, edit_record, flat_start, master_position, nudge, record_chunks
from support.torch_dist_forms import FOR_MCORE_016
import pgconvert
from pgconvert.cli import main
from pgconvert.formats.megatron import FRAMEWORK_PICKLE
from pgconvert.run.manifest import MANIFEST_FILE

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
ITER = "iter_0000002"
HIDDEN = 64
LAST_ROW = 254  # vocab 255: the last true row; 255 is padding
PAD_ROW = 255
EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
FC2 = "decoder.layers.1.mlp.linear_fc2.weight"
RANK_FORMS = ("rank_plain", "rank_distributed")
TORCH_DIST_FORMS = ("dp_reshardable", "fully_sharded_model_space")
SCALER = {"scale": torch.tensor([4096.0]), "growth_tracker": 7, "hysteresis_tracker": 1}
# (name, field) verify must report for each planted value.
EXPECTED = {
    "embedding_last_row": (EMBEDDING, "exp_avg"),
    "output_last_row": (OUTPUT, "exp_avg"),
    "output_padding_row": (OUTPUT, "exp_avg"),
    "exp_avg_sq": (OUTPUT, "exp_avg_sq"),
    "master": (EMBEDDING, "param"),
    "scale": ("optimizer.grad_scaler.scale", "scale"),
    "growth_tracker": ("optimizer.grad_scaler.growth_tracker", "growth_tracker"),
    "num_steps": ("optimizer.opt_param_scheduler.num_steps", "num_steps"),
    "lr": ("optimizer.param_groups[1].lr", "lr"),
    "weight_decay": ("optimizer.param_groups[0].weight_decay", "weight_decay"),
    "eps": ("optimizer.param_groups[0].eps", "eps"),
    "step": (EMBEDDING, "step"),
    "one_parameter_step": (FC2, "step"),
}
GROUP_SETTINGS = {"lr": (1, 0.5), "weight_decay": (0, 0.125), "eps": (0, 1e-6)}


def _with_scaler(golden: Path, where: Path) -> Path:
    root = Path(shutil.copytree(golden, where))
    for path in sorted((root / ITER).glob("mp_rank_*/model_optim_rng.pt")):
        state = load_for_test(path)
        state["optimizer"]["grad_scaler"] = dict(SCALER)
        torch.save(state, path, pickle_module=FRAMEWORK_PICKLE)  # args' enum stand-ins
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per destination form: (source, its TP1 conversion)."""
    root = tmp_path_factory.mktemp("planted")
    plain = _with_scaler(GOLDENS / "train_tp2dp2_bf16_torch", root / "plain")
    distributed = _with_scaler(GOLDENS / "train_tp2dp2_distopt_bf16_torch", root / "distributed")
    made = {"rank_plain": (plain, pgconvert.convert(plain, root / "rank_plain", dst_tp=1).dst),
            "rank_distributed": (distributed, pgconvert.convert(distributed, root / "rank_distributed", dst_tp=1).dst)}
    for form in TORCH_DIST_FORMS:  # common.pt, where values are planted, and no manifest whose sha256s catch them
        made[form] = (distributed, pgconvert.convert(distributed, root / form, dst_format="torch_dist", dst_tp=1,
                                                     dst_optim_form=form, **FOR_MCORE_016).dst)
    return made


def _copy(root: Path, where: Path) -> Path:
    copy = Path(shutil.copytree(root, where))
    (copy / MANIFEST_FILE).unlink(missing_ok=True)  # its sha256s would catch any edit
    return copy


def _verify(a: Path, b: Path) -> tuple[int, dict[str, Any], str]:
    runner = CliRunner()
    text = runner.invoke(main, ["verify", str(a), str(b)], prog_name="pgconvert")
    doc = runner.invoke(main, ["verify", str(a), str(b), "--json"], prog_name="pgconvert")
    assert doc.exit_code == text.exit_code, doc.output
    return text.exit_code, json.loads(doc.output), text.output


def _assert_named(a: Path, b: Path, expected: tuple[str, str]) -> None:
    code, doc, text = _verify(a, b)
    assert code == 1, text
    named = [(d["name"], d["field"]) for d in doc["optimizer"]["differences"]]
    assert expected in named, (named, text)
    assert "differs: " in text and expected[0] in text, text


# Rank files: the plain optimizer's Adam state and masters, the distributed optimizer's flat buffers.

def _rank_paths(root: Path) -> list[Path]:
    return sorted((root / ITER).glob("mp_rank_*/model_optim_rng.pt"))


def _edit_rank_files(root: Path, change: Callable[[dict[str, Any]], None], ranks: list[int] | None = None) -> None:
    for index, path in enumerate(_rank_paths(root)):
        if ranks is None or index in ranks:
            state = load_for_test(path)
            change(state)
            torch.save(state, path, pickle_module=FRAMEWORK_PICKLE)


def _groups(state: dict[str, Any]) -> list[dict[str, Any]]:
    return state["optimizer"]["optimizer"]["param_groups"]


def _plant_in_plain_rank(state: dict[str, Any], name: str, field: str, row: int, column: int) -> None:
    position = master_position(state, name)
    optimizer = state["optimizer"]
    if field == "param":
        masters = [m for group in optimizer["fp32_from_fp16_params"] for m in group]
        flat = [p for group in optimizer["optimizer"]["param_groups"] for p in group["params"]]
        nudge(masters[flat.index(position)], (row, column))
    else:
        bump(optimizer["optimizer"]["state"][position][field], (row, column))


def _plant_in_flat_buffer(path: Path, weight: torch.Tensor, field: str, row: int, column: int) -> None:
    loaded = torch.load(path, weights_only=True)
    ((_, buffers),) = loaded[0].items()
    at = flat_start(buffers["param"], weight) + row * weight.shape[1] + column
    (nudge if field == "param" else bump)(buffers[field], (at,))
    torch.save(loaded, path)


def _plant_tensor_in_rank_files(form: str, root: Path, name: str, field: str, row: int, rank: int = 0) -> None:
    """Element [row, 3] of ``name``'s ``field`` in the rank file (or its distrib_optim.pt) of TP rank ``rank``."""
    path = _rank_paths(root)[rank]
    if form == "rank_plain":
        _edit_rank_files(root, lambda state: _plant_in_plain_rank(state, name, field, row, 3), [rank])
    else:
        weight = load_for_test(path)["model"][name]
        _plant_in_flat_buffer(path.parent / "distrib_optim.pt", weight, field, row, 3)


def _set_scaler(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        state["optimizer"]["grad_scaler"][key] = value
    return change


def _plant_in_rank_files(form: str, root: Path, mutation: str) -> None:
    tensors = {"embedding_last_row": (EMBEDDING, "exp_avg", LAST_ROW), "output_last_row": (OUTPUT, "exp_avg", LAST_ROW),
               "output_padding_row": (OUTPUT, "exp_avg", PAD_ROW), "exp_avg_sq": (OUTPUT, "exp_avg_sq", 10),
               "master": (EMBEDDING, "param", 7)}
    if mutation in tensors:
        _plant_tensor_in_rank_files(form, root, *tensors[mutation])
    elif mutation in ("scale", "growth_tracker"):
        value = torch.tensor([2048.0]) if mutation == "scale" else 3
        _edit_rank_files(root, _set_scaler(mutation, value))
    elif mutation == "num_steps":
        _edit_rank_files(root, lambda state: state["opt_param_scheduler"].update(num_steps=5))
    elif mutation in GROUP_SETTINGS:
        index, value = GROUP_SETTINGS[mutation]
        _edit_rank_files(root, lambda state: _groups(state)[index].update({mutation: value}))
    elif mutation == "step":  # the distributed optimizer's step: its param groups'
        _edit_rank_files(root, lambda state: [group.update(step=3.0) for group in _groups(state)])
    elif mutation == "one_parameter_step":  # a plain optimizer's: one parameter's own
        def change(state: dict[str, Any]) -> None:
            state["optimizer"]["optimizer"]["state"][master_position(state, FC2)]["step"] += 1
        _edit_rank_files(root, change)
    else:
        raise AssertionError(mutation)


# torch_dist: the records and objects of dp_reshardable, the records and common state of fully_sharded_model_space.

def _bucket(iteration: Path, field: str) -> str:
    (key,) = [key for key in _record_keys(iteration) if key.startswith("optimizer.distributed.dp_group_idx_0.")
              and key.endswith(f".bucket_idx_0.{field}")]
    return key


def _record_keys(iteration: Path) -> list[str]:
    from pgconvert.formats.torch_dist import read_dcp_metadata

    return list(read_dcp_metadata(iteration / ".metadata").state_dict_metadata)


def _plant_torch_dist_tensor(form: str, iteration: Path, name: str, field: str, row: int) -> None:
    edit = (lambda chunk, at: nudge(chunk, at)) if field == "param" else (lambda chunk, at: bump(chunk, at))
    if form == "dp_reshardable":
        weight = dcp_read(iteration, [name])[name]
        flat = dcp_read(iteration, [_bucket(iteration, "param")])[_bucket(iteration, "param")]
        edit_record(iteration, _bucket(iteration, field), (flat_start(flat, weight) + row * HIDDEN + 3,), edit)
    else:
        stored = {"param": "fp32_param"}.get(field, field)
        key = f"optimizer.state.{stored}.{name}"
        assert [sizes for _, _, sizes in record_chunks(iteration, key)][0][:2] == (1, 1)  # TP1: one chunk per axis
        edit_record(iteration, key, (0, 0, row * HIDDEN + 3), edit)


def _dp_object(iteration: Path, name: str, change: Callable[[Any], None]) -> None:
    key = f"optimizer.distributed.dp_group_idx_0.{name}/shard_0_1"
    value = stored_object(iteration, key)
    change(value)
    replace_stored_object(iteration, key, value)


def _plant_in_torch_dist(form: str, root: Path, mutation: str) -> None:
    iteration = root / ITER
    tensors = {"embedding_last_row": (EMBEDDING, "exp_avg", LAST_ROW), "output_last_row": (OUTPUT, "exp_avg", LAST_ROW),
               "output_padding_row": (OUTPUT, "exp_avg", PAD_ROW), "exp_avg_sq": (OUTPUT, "exp_avg_sq", 10),
               "master": (EMBEDDING, "param", 7)}
    dp = form == "dp_reshardable"
    if mutation in tensors:
        _plant_torch_dist_tensor(form, iteration, *tensors[mutation])
    elif mutation in ("scale", "growth_tracker"):
        value = torch.tensor([2048.0]) if mutation == "scale" else 3
        if dp:
            _dp_object(iteration, "grad_scaler", lambda scaler: scaler.update({mutation: value}))
        else:
            edit_common(iteration, lambda common: common["optimizer"]["grad_scaler"].update({mutation: value}))
    elif mutation == "num_steps":
        edit_common(iteration, lambda common: common["opt_param_scheduler"].update(num_steps=5))
    elif mutation in GROUP_SETTINGS or mutation == "step":
        index, value = GROUP_SETTINGS.get(mutation, (None, 3.0))

        def change(groups: list[dict[str, Any]]) -> None:
            for at, group in enumerate(groups):
                if index is None or at == index:
                    group[mutation] = value
        if dp:
            _dp_object(iteration, "optimizer", lambda held: change(held["param_groups"]))
        else:
            edit_common(iteration, lambda common: change(common["optimizer"]["optimizer"]["param_groups"]))
    else:
        raise AssertionError(mutation)


COMMON = ("embedding_last_row", "output_last_row", "output_padding_row", "exp_avg_sq", "master", "scale",
          "growth_tracker", "num_steps", "lr", "weight_decay", "eps")
CASES = [(form, mutation) for form in (*RANK_FORMS, *TORCH_DIST_FORMS) for mutation in COMMON] + [
    ("rank_plain", "one_parameter_step"), ("rank_distributed", "step"), ("dp_reshardable", "step"),
    ("fully_sharded_model_space", "step")]


def test_every_unmutated_conversion_is_equal(runs: dict[str, tuple[Path, Path]]) -> None:
    for form, (source, converted) in runs.items():
        code, doc, text = _verify(source, converted)
        assert code == 0 and doc["optimizer"]["status"] == "compared", (form, text)


@pytest.mark.parametrize(("form", "mutation"), CASES)
def test_a_value_planted_in_the_destination_is_named(form: str, mutation: str, runs: dict[str, tuple[Path, Path]],
                                                     tmp_path: Path) -> None:
    source, converted = runs[form]
    edited = _copy(converted, tmp_path / "edited")
    (_plant_in_rank_files if form in RANK_FORMS else _plant_in_torch_dist)(form, edited, mutation)
    _assert_named(source, edited, EXPECTED[mutation])


@pytest.mark.parametrize("form", RANK_FORMS)
@pytest.mark.parametrize("mutation", ["embedding_last_row", "output_last_row", "output_padding_row", "scale",
                                      "num_steps", "lr"])
def test_a_value_planted_in_the_tp2_source_is_named(form: str, mutation: str, runs: dict[str, tuple[Path, Path]],
                                                    tmp_path: Path) -> None:
    source, converted = runs[form]
    edited = _copy(source, tmp_path / "source")
    if mutation in ("embedding_last_row", "output_last_row", "output_padding_row"):
        # TP rank 1 holds rows 128..255: the row is local row 126 (or 127) there, row 254 (255) at TP1.
        name = EMBEDDING if mutation.startswith("embedding") else OUTPUT
        _plant_tensor_in_rank_files(form, edited, name, "exp_avg", (LAST_ROW if "last" in mutation else PAD_ROW) - 128,
                                    rank=1)
    else:
        _plant_in_rank_files(form, edited, mutation)
    _assert_named(edited, converted, EXPECTED[mutation])


def test_one_parameters_step_planted_in_every_tp_rank_of_the_source_is_named(runs: dict[str, tuple[Path, Path]],
                                                                            tmp_path: Path) -> None:
    source, converted = runs["rank_plain"]
    edited = _copy(source, tmp_path / "source")
    _plant_in_rank_files("rank_plain", edited, "one_parameter_step")  # FC2 on both TP ranks, nothing else
    _assert_named(edited, converted, (FC2, "step"))


# Mixture of experts through an EP change: megatron-core's own state (``support.moe_optimizer_runs``) at TP1 EP2,
# 8 experts, 4 per EP rank; converted to EP1, where the experts join the one (dense) optimizer.
EXPERT_LOCAL = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"  # on EP rank 1: expert 5
EXPERT = "decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight"
DENSE = "decoder.layers.1.mlp.linear_fc1.weight"
EP1_RANK = "mp_rank_00_001"


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per form (fp32 plain, distributed): (the EP2 source, its EP1 conversion)."""
    pytest.importorskip("megatron.core", reason="megatron-core lays out the MoE optimizer state")
    from support.moe_optimizer_runs import generate

    root = tmp_path_factory.mktemp("moe")
    made = {}
    for form in ("fp32", "distributed"):
        source = generate(root / form, 1, 1, 2, form)
        made[form] = (source, pgconvert.convert(source, root / f"{form}_ep1", dst_ep=1).dst)
    return made


def _source_position(source: Path, rank: str, optimizer: int, name: str) -> int:
    """megatron-core's own position of ``name`` in chained optimizer ``optimizer`` of ``rank``'s file."""
    positions = json.loads((source.parent / f"{source.name}.positions.json").read_text())[rank][optimizer]
    state = load_for_test(source / ITER / rank / "model_optim_rng.pt")
    groups = state["optimizer"][optimizer]["param_groups"]
    (found,) = [group["params"][index] for group, names in zip(groups, positions)
                for index, held in enumerate(names) if held == name]
    return found


@pytest.mark.parametrize("form", ["fp32", "distributed"])
def test_an_ep2_to_ep1_conversion_is_equal(form: str, moe: dict[str, tuple[Path, Path]]) -> None:
    code, doc, text = _verify(*moe[form])
    assert code == 0 and doc["optimizer"]["status"] == "compared", text


def test_one_element_of_one_experts_state_planted_after_an_ep_change_is_named(moe: dict[str, tuple[Path, Path]],
                                                                            tmp_path: Path) -> None:
    source, converted = moe["fp32"]
    expert_avg = load_for_test(source / ITER / EP1_RANK / "model_optim_rng.pt")["optimizer"][1]["state"][
        _source_position(source, EP1_RANK, 1, EXPERT_LOCAL)]["exp_avg"]
    edited = _copy(converted, tmp_path / "edited")

    def change(state: dict[str, Any]) -> None:
        (position,) = [p for p, entry in state["optimizer"]["state"].items() if torch.equal(entry["exp_avg"], expert_avg)]
        bump(state["optimizer"]["state"][position]["exp_avg"], (3, 5))
    _edit_rank_files(edited, change)
    _assert_named(source, edited, (EXPERT, "exp_avg"))


def test_one_element_of_one_experts_flat_state_planted_after_an_ep_change_is_named(
        moe: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    source, converted = moe["distributed"]
    edited = _copy(converted, tmp_path / "edited")
    (path,) = _rank_paths(edited)
    _plant_in_flat_buffer(path.parent / "distrib_optim.pt", load_for_test(path)["model"][EXPERT], "exp_avg_sq", 3, 5)
    _assert_named(source, edited, (EXPERT, "exp_avg_sq"))


@pytest.mark.parametrize(("rank", "optimizer", "name", "named"), [
    (EP1_RANK, 1, EXPERT_LOCAL, (EXPERT, "exp_avg")),  # the expert's only copy
    # the dense optimizer's copy on EP rank 1, which megatron-core keeps equal to EP rank 0's: named as unreadable
    (EP1_RANK, 0, DENSE, (DENSE, "")),
])
def test_a_value_planted_in_the_ep2_source_is_named(rank: str, optimizer: int, name: str, named: tuple[str, str],
                                                    moe: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    source, converted = moe["fp32"]
    edited = _copy(source, tmp_path / "source")
    path = edited / ITER / rank / "model_optim_rng.pt"
    state = load_for_test(path)
    bump(state["optimizer"][optimizer]["state"][_source_position(source, rank, optimizer, name)]["exp_avg"], (3, 5))
    torch.save(state, path, pickle_module=FRAMEWORK_PICKLE)
    _assert_named(edited, converted, named)
    if not named[1]:
        text = _verify(edited, converted)[2]
        assert "optimizer exp_avg differs between " in text and f"{EP1_RANK}/model_optim_rng.pt" in text, text
