"""Megatron-LM's plain Muon optimizer (``--optimizer muon`` without the distributed optimizer) through torch_dist, on
a golden megatron-core 0.19.2 trained and saved itself (``scripts/make_muon_golden.py``: TP2 on gloo CPU ranks, two
steps). megatron-core chains a Muon optimizer (every 2-dim weight but the word embedding and output layer: an fp32
master and a ``momentum_buffer`` each, no step) and an Adam one (the embedding, output layer and norms). The same
script has megatron-core 0.19.2 load pgconvert's output at TP1 and TP2 and hold the golden's state
(``load DIR TP``, outside CI: CI has megatron-core 0.16.1, which has no Muon)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pgconvert
from support.checkpoint_compare import read_common
from support.cli_helpers import assert_clean_refusal
from support.optimizer_cli import convert_strict, dcp_read, export_optimizer, run_cli
from support.optimizer_faults import edit_common
from support.torch_dist_forms import FOR_MCORE_016_CLI
from pgconvert.formats.torch_dist import read_dcp_metadata
from pgconvert.optimizer.export import export_from_path
from pgconvert.optimizer.order import UnsupportedOptimizerError

GOLDEN = Path(__file__).parent / "data" / "megatron_lm" / "mcore019_tp2_muon_bf16_torch_dist"
ITER = "iter_0000002"
FC1 = "decoder.layers.mlp.linear_fc1.weight"
ADAM_KEYS = {"param", "exp_avg", "exp_avg_sq", "step"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    return export_optimizer(GOLDEN, tmp_path_factory.mktemp("export"))


def _records(iteration_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the store (model and optimizer), read whole by torch's own DCP reader."""
    metadata = read_dcp_metadata(iteration_dir / ".metadata").state_dict_metadata
    return dcp_read(iteration_dir, [key for key, md in metadata.items() if hasattr(md, "size")])


def test_the_golden_is_megatron_core_0_19s_chained_muon_and_adam() -> None:
    common = read_common(GOLDEN / ITER)
    muon, adam = (common["optimizer"][index]["optimizer"] for index in (0, 1))
    assert set(muon) == {"param_groups"} and [group["momentum"] for group in muon["param_groups"]] == [0.9]
    assert float(adam["state"]["common_step"]) == 2.0
    assert [group["wd_mult"] for group in adam["param_groups"]] == [1.0, 0.0]
    keys = set(read_dcp_metadata(GOLDEN / ITER / ".metadata").state_dict_metadata)
    momentum = {key for key in keys if key.startswith("optimizer.state.momentum_buffer.")}
    assert len(momentum) == 4 and "optimizer.state.momentum_buffer." + FC1 in momentum  # the stacked 2-dim weights
    assert "optimizer.state.exp_avg.output_layer.weight" in keys and "optimizer.state.exp_avg." + FC1 not in keys


def test_each_parameter_is_read_with_its_own_optimizers_state(exported: dict[str, dict[str, torch.Tensor]]) -> None:
    muon = sorted(name for name, tensors in exported.items() if "momentum_buffer" in tensors)
    assert len(muon) == 8 and all(set(exported[name]) == {"param", "momentum_buffer"} for name in muon)
    adam = [name for name in exported if name not in muon]
    assert sorted(adam)[:2] == ["decoder.final_layernorm.weight", "decoder.layers.0.input_layernorm.weight"]
    assert all(set(exported[name]) == ADAM_KEYS and float(exported[name]["step"]) == 2.0 for name in adam)
    # the records as torch's DCP reader gives them (layers stacked; fc1's global tensor is [gate; up])
    held = dcp_read(GOLDEN / ITER, [FC1, "optimizer.state.momentum_buffer." + FC1, "optimizer.state.fp32_param." + FC1])
    for layer in range(2):
        tensors = exported[f"decoder.layers.{layer}.mlp.linear_fc1.weight"]
        assert torch.equal(tensors["momentum_buffer"], held["optimizer.state.momentum_buffer." + FC1][layer])
        assert torch.equal(tensors["param"], held["optimizer.state.fp32_param." + FC1][layer])
        assert torch.equal(tensors["param"].bfloat16(), held[FC1][layer])  # the master rounds to the weight
        assert tensors["momentum_buffer"].abs().min() > 0  # two steps of non-zero gradients


def test_other_layouts_give_megatron_cores_records_back_bit_for_bit(tmp_path: Path) -> None:
    tp1 = convert_strict(GOLDEN, tmp_path / "tp1", "--dst-format", "torch_dist", "--dst-tp", "1", *FOR_MCORE_016_CLI)
    pp2 = convert_strict(tp1, tmp_path / "pp2", "--dst-format", "torch_dist", "--dst-pp", "2")
    back = convert_strict(pp2, tmp_path / "back", "--dst-format", "torch_dist", "--dst-tp", "2", "--dst-pp", "1")
    golden, again = _records(GOLDEN / ITER), _records(back / ITER)
    assert set(golden) == set(again) and len(golden) == 32
    for key, tensor in golden.items():
        assert again[key].dtype == tensor.dtype and torch.equal(again[key], tensor), key
    expected, written = read_common(GOLDEN / ITER)["optimizer"], read_common(back / ITER)["optimizer"]
    assert written[0] == expected[0]  # Muon's groups, no step
    assert written[1]["optimizer"]["param_groups"] == expected[1]["optimizer"]["param_groups"]
    assert torch.equal(written[1]["optimizer"]["state"]["common_step"], expected[1]["optimizer"]["state"]["common_step"])
    result = pgconvert.verify(GOLDEN, pp2)
    assert result.equal and result.optimizer is not None, result.differences[:5]
    inspected = run_cli("inspect", GOLDEN)
    assert "muon and adam, float16, plain: 15 parameters checked" in inspected.output, inspected.output


def test_a_destination_that_writes_adam_only_names_the_muon_state(tmp_path: Path) -> None:
    result = run_cli("convert", GOLDEN, tmp_path / "per_rank", "--dst-format", "megatron", "--dst-tp", "1")
    assert result.exit_code == 0, result.output
    assert "args.optimizer='muon': its state is written into torch_dist only, not megatron" in \
        " ".join(result.output.split())
    strict = run_cli("convert", GOLDEN, tmp_path / "strict", "--dst-format", "megatron", "--dst-tp", "1", "--strict")
    assert strict.exit_code != 0 and not (tmp_path / "strict").exists()
    retyped = run_cli("convert", GOLDEN, tmp_path / "fp32", "--dst-format", "torch_dist", "--dtype", "fp32")
    assert "args.optimizer='muon' with --dtype" in " ".join(retyped.output.split()), retyped.output


@pytest.mark.parametrize("setting", [{"use_layer_wise_distributed_optimizer": True},
                                     {"muon_scalar_optimizer": "lion"}])
def test_a_muon_run_whose_layout_is_not_mapped_is_named(setting: dict[str, object], tmp_path: Path) -> None:
    src = convert_strict(GOLDEN, tmp_path / "src", "--dst-format", "torch_dist", *FOR_MCORE_016_CLI)
    edit_common(src / ITER, lambda common: vars(common["args"]).update(setting))
    (name,) = setting
    assert_clean_refusal(run_cli("export-optimizer", src, tmp_path / "export"), 2, "args.optimizer='muon'",
                         "--skip-optimizer")
    with pytest.raises(UnsupportedOptimizerError, match=rf"args.optimizer='muon' with .*{name}"):
        export_from_path(src, tmp_path / "again", None)
