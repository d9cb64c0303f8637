"""A MoE model's chained (dense + expert) distributed optimizer in the ``fully_sharded_model_space`` torch_dist
form, on a golden that megatron-core 0.15.0 trained and saved itself (``scripts/make_fs_model_space_moe_golden.py``:
TP1 x EP2 x DP4 on gloo CPU ranks, two steps). That script also has megatron-core 0.15.0 load pgconvert's
fully_sharded_model_space output of the golden at EP1, EP2 and EP4 (``load DIR DP EP``), outside CI.

Here: every master pgconvert reads rounds to the weight megatron-core stored beside it (read by torch's own DCP
reader), and the golden's records and param groups come back bit for bit after a trip through other layouts and
forms: per-rank TP2 x EP4, dp_reshardable, fully_reshardable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pgconvert
from support.checkpoint_compare import read_common
from support.optimizer_cli import (as_megatron_core_0_13_names, assert_same_parameters, chained_name, convert_strict,
                                  dcp_read, export_optimizer, run_cli)
from support.optimizer_faults import copy_checkpoint
from support.torch_dist_forms import FOR_MCORE_016_CLI
from pgconvert.formats.torch_dist import read_dcp_metadata

GOLDEN = Path(__file__).parent / "data" / "megatron_lm" / "mcore015_tp1ep2dp4_moe_distopt_fs_model_space_torch_dist"
ITER = "iter_0000002"
PARAMETERS = 24  # 16 dense, 8 routed experts' (4 experts x fc1, fc2)
EXPERT_FC1 = "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"
FS_MODEL_SPACE = ("--dst-format", "torch_dist", "--dst-optim-form", "fully_sharded_model_space", *FOR_MCORE_016_CLI)
# The golden's own layout, as a destination.
GOLDEN_LAYOUT = ("--dst-tp", "1", "--dst-ep", "2", "--dst-dp", "4")
# Canonical name part -> the part of megatron-core 0.15.0's model key (the local spec's norms stored with the
# linear they precede, as its sharded_state_dict names them).
STORED_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    return export_optimizer(GOLDEN, tmp_path_factory.mktemp("export"))


def _stored(name: str) -> tuple[str, int | None]:
    """The model key megatron-core stored parameter ``name`` under, and its expert index there (None: not one)."""
    for part, stored in STORED_NORMS.items():
        if name.endswith(part):
            return name[: -len(part)] + stored, None
    if ".local_experts." in name:
        head, _, tail = name.partition(".local_experts.")
        expert, _, rest = tail.partition(".")
        return f"{head}.experts.{rest}", int(expert)
    return name, None


def test_the_golden_is_megatron_core_0_15s_chained_save() -> None:
    common = read_common(GOLDEN / ITER)
    assert set(common["optimizer"]) == {0, 1}  # ChainedOptimizer: dense, expert
    for entry in common["optimizer"].values():
        assert entry["param_state_sharding_type"] == "fully_sharded_model_space"
    expert_groups = common["optimizer"][1]["optimizer"]["param_groups"]
    assert [group["is_expert_parallel"] for group in expert_groups] == [True]
    assert common["content_metadata"] == {"distrib_optim_sharding_type": "fully_sharded_model_space",
                                          "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    metadata = read_dcp_metadata(GOLDEN / ITER / ".metadata").state_dict_metadata
    sizes = {key: tuple(md.size) for key, md in metadata.items() if hasattr(md, "size")}
    # the expert records are unprefixed: [4 experts, gate and up chunks, 1 chunk of columns, 8 * 16 elements]
    assert sizes["optimizer.state.exp_avg_sq." + EXPERT_FC1] == (4, 2, 1, 128) and sizes[EXPERT_FC1] == (4, 16, 16)
    assert not any(key.startswith("chained_") for key in sizes)


def test_every_master_read_rounds_to_the_weight_megatron_core_stored(
        exported: dict[str, dict[str, torch.Tensor]]) -> None:
    assert len(exported) == PARAMETERS
    stored = {key for key, _ in map(_stored, exported)}
    weights = dcp_read(GOLDEN / ITER, sorted(stored))
    for name, tensors in exported.items():
        key, expert = _stored(name)
        weight = weights[key] if expert is None else weights[key][expert]
        assert tensors["param"].dtype == torch.float32 and torch.equal(tensors["param"].bfloat16(), weight), name
        assert float(tensors["step"]) == 2.0
        assert tensors["exp_avg_sq"].min() > 0, name  # two steps on non-zero gradients: no slot left unread
    experts = [exported[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"]["exp_avg"]
               for e in range(4)]
    assert all(not torch.equal(experts[0], other) for other in experts[1:])  # each expert its own moments


def test_the_records_come_back_bit_exact_through_other_layouts_and_forms(
        tmp_path: Path, exported: dict[str, dict[str, torch.Tensor]]) -> None:
    per_rank = convert_strict(GOLDEN, tmp_path / "per_rank", "--dst-format", "megatron", "--dst-tp", "2", "--dst-ep", "4")
    assert len(list(per_rank.rglob("distrib_optim.pt"))) == 8
    dp = convert_strict(per_rank, tmp_path / "dp", "--dst-format", "torch_dist", "--dst-tp", "2", "--dst-ep", "1",
                  "--dst-optim-form", "dp_reshardable", "--dst-dp", "2", *FOR_MCORE_016_CLI)
    # at EP1 megatron-core builds one optimizer, not two chained: the state is unchained, then chained again
    assert read_common(dp / ITER)["optimizer"]["param_state_sharding_type"] == "dp_reshardable"
    back = convert_strict(dp, tmp_path / "back", *FS_MODEL_SPACE, *GOLDEN_LAYOUT)
    assert_same_parameters(export_optimizer(back, tmp_path / "export"), exported, PARAMETERS)
    _assert_same_as_golden(back)


def test_fully_reshardable_at_tp2_and_back(tmp_path: Path) -> None:
    fully = convert_strict(GOLDEN, tmp_path / "fully", "--dst-format", "torch_dist", "--dst-tp", "2", "--dst-ep", "4",
                     "--dst-optim-form", "fully_reshardable", *FOR_MCORE_016_CLI)
    back = convert_strict(fully, tmp_path / "back", *FS_MODEL_SPACE, *GOLDEN_LAYOUT)
    _assert_same_as_golden(back)
    result = pgconvert.verify(GOLDEN, fully)
    assert result.equal and result.optimizer is not None, result.differences[:5]


def _records(iteration_dir: Path) -> dict[str, torch.Tensor]:
    """Every optimizer record, prefixed or not, read whole by torch's own DCP reader."""
    metadata = read_dcp_metadata(iteration_dir / ".metadata").state_dict_metadata
    keys = [key for key, md in metadata.items() if key.startswith(("optimizer.", "chained_")) and hasattr(md, "size")]
    return dcp_read(iteration_dir, keys)


def _assert_same_as_golden(written: Path) -> None:
    """Every optimizer record (torch's DCP reader) equals the golden's under its ``chained_<i>.`` name, as
    megatron-core 0.13.1 saves the same run (and 0.14.0 and 0.15.0 load it by the content metadata); each chained
    optimizer's param groups equal the golden's."""
    golden, again = _records(GOLDEN / ITER), _records(written / ITER)
    assert set(map(chained_name, golden)) == set(again) and len(golden) == 54  # 3 fields x (16 dense + experts' 2)
    for key, tensor in golden.items():
        assert again[chained_name(key)].dtype == tensor.dtype and torch.equal(again[chained_name(key)], tensor), key
    expected, common = read_common(GOLDEN / ITER), read_common(written / ITER)
    for index in (0, 1):
        assert common["optimizer"][index]["optimizer"] == expected["optimizer"][index]["optimizer"], index
        assert common["optimizer"][index]["param_state_sharding_type"] == "fully_sharded_model_space"
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_sharded_model_space"
    assert common["content_metadata"]["chained_optim_avoid_prefix"] is False  # the records say chained_<i>.


def test_megatron_core_0_13s_prefixed_records_are_read(tmp_path: Path,
                                                       exported: dict[str, dict[str, torch.Tensor]]) -> None:
    src = copy_checkpoint(GOLDEN, tmp_path / "src")
    as_megatron_core_0_13_names(src / ITER)
    assert all(key.startswith("chained_") for key in _records(src / ITER))
    assert_same_parameters(export_optimizer(src, tmp_path / "export"), exported, PARAMETERS)
    _assert_same_as_golden(convert_strict(src, tmp_path / "again", *FS_MODEL_SPACE, *GOLDEN_LAYOUT))


def test_a_dry_run_lists_the_expert_records(tmp_path: Path) -> None:
    result = run_cli("convert", GOLDEN, tmp_path / "out", "--dry-run", *FS_MODEL_SPACE, "--dst-tp", "1",
                     "--dst-ep", "4")
    assert result.exit_code == 0, result.output
    assert "fully_sharded_model_space" in result.output and "not carried" not in result.output
    assert not (tmp_path / "out").exists()
