"""Megatron-LM's plain Muon optimizer with MoE, on Megatron-LM d98e8a64's own torch_dist save of a TP1 EP2 DP4 run (4
experts, top-2 routing, bf16, two iterations; ``scripts/make_megatron_lm_goldens.py``).

With experts at expert parallel size > 1 megatron-core buckets the param groups by ``(optimizer,
is_expert_parallel)`` and chains Muon's dense optimizer (attention and router weights), Muon's expert one (the
experts' weights) and Adam's (embedding, output layer, norms): ``{0, 1, 2}`` in the common state. At expert parallel
size 1 the experts are dense: Muon's one optimizer and Adam's. ``scripts/megatron_lm_resume_check.py
muon_moe_ep2_torch_dist`` has Megatron-LM resume the EP1 conversion (outside CI)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import pgconvert
from support.checkpoint_compare import read_common
from support.megatron_fixtures import rank_states
from support.optimizer_cli import convert_strict, dcp_read, export_optimizer
from pgconvert.formats.torch_dist import read_dcp_metadata
from pgconvert.model.config import ModelConfig
from pgconvert.model.layout import ParallelLayout
from pgconvert.optimizer.order import ADAM, MUON, ChainMember, OptimizerRules
from pgconvert.optimizer.source import OptimizerSource, SourceRank

GOLDEN = Path(__file__).parent / "data" / "megatron_lm" / "train_tp1ep2dp4_muon_moe_bf16_torch_dist"
ITER = "iter_0000002"
EXPERT_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"


def _records(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist iteration (model and optimizer), read by torch's own DCP reader."""
    metadata = read_dcp_metadata(root / ITER / ".metadata").state_dict_metadata
    return dcp_read(root / ITER, [key for key, md in metadata.items() if hasattr(md, "size")])


def _groups(entry: Any) -> list[list[tuple[Any, bool, float]]]:
    """Per chained optimizer of a common state's ``optimizer``, its groups' (optimizer, is_expert_parallel,
    wd_mult)."""
    return [[(group.get("optimizer"), group["is_expert_parallel"], group["wd_mult"])
             for group in entry[index]["optimizer"]["param_groups"]] for index in sorted(entry)]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _assert_golden(out: Path) -> None:
    want, got = _records(GOLDEN), _records(out)
    assert sorted(want) == sorted(got)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    assert _same(read_common(out / ITER)["optimizer"], read_common(GOLDEN / ITER)["optimizer"])


def test_the_golden_chains_muons_dense_and_expert_optimizers_and_adams() -> None:
    common = read_common(GOLDEN / ITER)
    assert common["args"].optimizer == "muon" and common["args"].expert_model_parallel_size == 2
    assert _groups(common["optimizer"]) == [[(None, False, 1.0)], [(None, True, 1.0)],
                                            [("adam", False, 1.0), ("adam", False, 0.0)]]
    keys = read_dcp_metadata(GOLDEN / ITER / ".metadata").state_dict_metadata
    assert f"optimizer.state.momentum_buffer.{EXPERT_FC1}" in keys and "common_step" not in str(common["optimizer"][1])


@pytest.mark.parametrize("there", [("--dst-ep", "1"), ("--dst-ep", "4"), ("--dst-format", "megatron", "--dst-ep", "2"),
                                   ("--dst-format", "megatron", "--dst-ep", "1", "--dst-pp", "2")])
def test_resharded_across_experts_and_back_it_is_the_golden(tmp_path: Path, there: tuple[str, ...]) -> None:
    middle = convert_strict(GOLDEN, tmp_path / "there", "--dst-tp", "1", *there)
    assert pgconvert.verify(GOLDEN, middle).equal
    back = convert_strict(middle, tmp_path / "back", "--dst-format", "torch_dist", "--dst-tp", "1", "--dst-pp", "1",
                          "--dst-ep", "2", "--dst-dp", "4")
    _assert_golden(back)


def test_at_expert_parallel_size_one_the_experts_are_muons_dense_parameters(tmp_path: Path) -> None:
    ep1 = convert_strict(GOLDEN, tmp_path / "ep1", "--dst-tp", "1", "--dst-ep", "1")
    assert _groups(read_common(ep1 / ITER)["optimizer"]) == [[(None, False, 1.0)],
                                                             [("adam", False, 1.0), ("adam", False, 0.0)]]
    per_rank = convert_strict(GOLDEN, tmp_path / "per_rank", "--dst-format", "megatron", "--dst-tp", "1")
    for state in rank_states(per_rank / ITER).values():
        muon, expert, adam = state["optimizer"]
        assert [group["is_expert_parallel"] for group in expert["optimizer"]["param_groups"]] == [True]
        assert all(set(entry) == {"momentum_buffer"} for entry in expert["optimizer"]["state"].values())
        assert all("step" in entry for entry in adam["optimizer"]["state"].values())
        assert len(muon["optimizer"]["param_groups"]) == 1
    exported = export_optimizer(GOLDEN, tmp_path / "export")
    experts = [name for name in exported if ".experts." in name]
    assert len(experts) == 2 * 2 * 4 and all(set(exported[name]) == {"param", "momentum_buffer"} for name in experts)


class _HeldGroups(OptimizerSource):
    """A source's stored param groups alone: what ``param_group_settings`` derives a target's from."""

    def __init__(self, rules: OptimizerRules, layout: ParallelLayout, groups: list[list[dict[str, Any]]]) -> None:
        super().__init__()
        self.config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128,
                                  num_experts=4)
        self.layout, self.rules, self._groups = layout, rules, groups
        self.first = SourceRank(Path("held"), {})

    def _stored_group_settings(self, optimizer: int) -> list[dict[str, Any]] | None:
        return [dict(group) for group in self._groups[optimizer]]


DECAYED = {"wd_mult": 1.0, "is_expert_parallel": False, "lr": 1e-4}
UNDECAYED = {"wd_mult": 0.0, "is_expert_parallel": False, "lr": 1e-4}


def test_a_new_expert_optimizer_takes_the_dense_groups_with_the_same_overrides() -> None:
    # Adam with decoupled_lr at EP1: [weight decay, the embedding and output layer's own lr, no weight decay]; at EP2
    # the expert optimizer's groups are weight decay and no weight decay, not the first two by position
    rules = OptimizerRules(decoupled_lr=5e-4)
    decoupled = {"wd_mult": 1.0, "max_lr": 5e-4, "is_expert_parallel": False, "lr": 1e-4}
    source = _HeldGroups(rules, ParallelLayout(ep=1), [[DECAYED, decoupled, UNDECAYED]])
    assert source.param_group_settings(count=2, member=ChainMember(ADAM, True)) == [
        dict(DECAYED, is_expert_parallel=True), dict(UNDECAYED, is_expert_parallel=True)]
    # a Muon run at EP1 to EP2: Muon's expert optimizer from its dense one; an Adam expert one (the experts' biases)
    # has the no-weight-decay group alone
    muon = OptimizerRules(kind=MUON)
    source = _HeldGroups(muon, ParallelLayout(ep=1), [[DECAYED], [dict(DECAYED, optimizer="adam"),
                                                                   dict(UNDECAYED, optimizer="adam")]])
    assert source.param_group_settings(count=1, member=ChainMember(MUON, True)) == [
        dict(DECAYED, is_expert_parallel=True)]
    assert source.param_group_settings(count=1, member=ChainMember(ADAM, True)) == [
        dict(UNDECAYED, optimizer="adam", is_expert_parallel=True)]
    assert source.param_group_settings(count=2, member=ChainMember(ADAM, False)) == [
        dict(DECAYED, optimizer="adam"), dict(UNDECAYED, optimizer="adam")]
