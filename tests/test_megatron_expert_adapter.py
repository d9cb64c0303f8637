"""A Megatron-Bridge LoRA adapter on a MoE model's routed experts: merged by ``--merge-adapter`` and exported as PEFT's
fused experts parameters.

The adapter is made by megatron-core 0.16.1 as Megatron-Bridge makes one (``support/mcore_bridge_lora.py`` names the
Megatron-Bridge source lines it follows): a tiny Qwen3-MoE (every layer MoE) converted to a TP2/EP2 Megatron
checkpoint, SequentialMLP experts, every linear Megatron-Bridge's ``LoRA`` matches wrapped (attention and each routed
expert's ``linear_fc1``/``linear_fc2``) on four gloo ranks, the adapter-only state saved with
``dist_checkpointing.save`` (the experts' pairs under ``mlp.experts.experts.linear_fc<n>.adapter`` with a global
expert axis). The reference merges every rank's weights on the Megatron side from what each rank held.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import pgconvert
from pgconvert.cli import main
from support.hf_helpers import build_hf_model, hf_logits, input_ids, save_hf_model
from support.mcore_bridge_lora import megatron_merged_logits, peft_logits, rewrite_store

pytest.importorskip("peft")

DIM, ALPHA = 4, 6
EXPERTS = 4


@pytest.fixture(scope="module")
def bridge(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The HF Qwen3-MoE base, its TP2/EP2 Megatron form, the Megatron-Bridge LoRA run's checkpoint and what each of
    the four ranks held."""
    from support.mcore_bridge_lora import exported_bridge_run

    root = tmp_path_factory.mktemp("bridge_expert_lora")
    hf = save_hf_model(build_hf_model("qwen3_moe", seed=2, mlp_only_layers=[]), root / "hf")
    return exported_bridge_run(root, hf, {"dst_tp": 2, "dst_ep": 2}, DIM, ALPHA)


def test_exported_expert_adapter_gives_peft_the_megatron_merged_logits(bridge: dict[str, Path]) -> None:
    ids = input_ids(1000)
    expected = megatron_merged_logits(bridge, ids, ALPHA / DIM)
    torch.testing.assert_close(peft_logits(bridge["hf"], bridge["exported"], ids), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(hf_logits(bridge["hf"], ids), expected, rtol=1e-3, atol=1e-3)  # the adapter matters
    config = json.loads((bridge["exported"] / "adapter_config.json").read_text())
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert config["target_parameters"] == ["down_proj", "gate_up_proj"]
    assert (config["r"], config["lora_alpha"], config["rank_pattern"]) == (DIM, ALPHA, {})


def test_merge_adapter_merges_the_experts_pairs_at_any_layout(bridge: dict[str, Path], tmp_path: Path) -> None:
    """--merge-adapter into HF computes the Megatron-side merge; into Megatron TP1/EP1 the same bytes, and a dropped
    expert pair would change the logits (every expert's linear_out is random and nonzero)."""
    ids = input_ids(1000)
    pgconvert.convert(bridge["hf"], tmp_path / "merged", dst_format="hf", merge_adapter=bridge["lora"])
    expected = megatron_merged_logits(bridge, ids, ALPHA / DIM)
    torch.testing.assert_close(hf_logits(tmp_path / "merged", ids), expected, rtol=1e-5, atol=1e-5)
    pgconvert.convert(bridge["megatron"], tmp_path / "tp1", dst_format="megatron", dst_tp=1, dst_ep=1,
                      merge_adapter=bridge["lora"])
    pgconvert.convert(tmp_path / "tp1", tmp_path / "back", dst_format="hf")
    from support.hf_helpers import assert_same_hf_tensors

    assert_same_hf_tensors(tmp_path / "merged", tmp_path / "back")
    report = pgconvert.verify(bridge["megatron"], tmp_path / "tp1", merge_adapter=bridge["lora"])
    assert report.equal and report.compared > 0, report.to_dict()
    # The two forms' updates, weight by weight: 4 layers' linear_qkv and linear_proj, and 4 experts' fc1 and fc2.
    report = pgconvert.verify(bridge["lora"], bridge["exported"], base=bridge["megatron"])
    assert report.equal and report.compared == 4 * 2 + 4 * EXPERTS * 2, report.to_dict()


def test_inspect_describes_the_experts_pairs(bridge: dict[str, Path]) -> None:
    result = CliRunner().invoke(main, ["inspect", str(bridge["lora"]), "--json"])
    assert result.exit_code == 0, result.output
    adapter = json.loads(result.output)["adapter"]
    assert adapter["pairs"] == 4 * (2 + 2 * EXPERTS)  # per layer: linear_qkv, linear_proj, and two per expert


def _store_edit(bridge: dict[str, Path], tmp_path: Path, edit: object) -> Path:
    lora = Path(shutil.copytree(bridge["lora"], tmp_path / "bad_lora"))
    rewrite_store(lora, edit)
    return lora


def test_a_side_shared_by_all_experts_is_every_experts(bridge: dict[str, Path], tmp_path: Path) -> None:
    """Megatron-Bridge's ``experts_shared_outer_loras`` (``SharedOuterGroupedExpertAdapter``, peft/utils.py:2522-2700)
    shares fc1's ``linear_in`` and fc2's ``linear_out`` by all experts: a plain column/row-parallel linear saved
    without an expert axis, the other side ``PackedPerExpertLinear``'s ``[experts, rows, columns]`` with one
    (utils.py:2510-2519, 1729-1775). Read so, it is the adapter whose every expert holds that side: the same export."""
    def shared_outer(tensors: dict[str, torch.Tensor]) -> None:
        for key in ("decoder.layers.mlp.experts.experts.linear_fc1.adapter.linear_in.weight",
                    "decoder.layers.mlp.experts.experts.linear_fc2.adapter.linear_out.weight"):
            tensors[key] = tensors[key][:, 1].contiguous()

    def broadcast(tensors: dict[str, torch.Tensor]) -> None:
        for key in ("decoder.layers.mlp.experts.experts.linear_fc1.adapter.linear_in.weight",
                    "decoder.layers.mlp.experts.experts.linear_fc2.adapter.linear_out.weight"):
            tensors[key] = tensors[key][:, 1:2].expand_as(tensors[key]).contiguous()

    from support.hf_helpers import load_hf_tensors

    exported = {}
    for name, edit in (("shared_outer", shared_outer), ("broadcast", broadcast)):
        lora = Path(shutil.copytree(bridge["lora"], tmp_path / name))
        rewrite_store(lora, edit)
        exported[name] = load_hf_tensors(pgconvert.export_adapter(lora, tmp_path / f"{name}_peft",
                                                                  base=bridge["megatron"]).path)
    assert sorted(exported["shared_outer"]) == sorted(exported["broadcast"])
    assert all(torch.equal(value, exported["broadcast"][key]) for key, value in exported["shared_outer"].items())
    original = load_hf_tensors(bridge["exported"])
    assert not torch.equal(original["base_model.model.model.layers.0.mlp.experts.lora_B.weight"],
                           exported["broadcast"]["base_model.model.model.layers.0.mlp.experts.lora_B.weight"])


FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.adapter."  # every layer's, stacked: [layers, experts, …]


@pytest.mark.parametrize("damage, message", [
    (lambda tensors: tensors.pop("decoder.layers.mlp.experts.experts.linear_fc2.adapter.linear_out.weight"),
     "decoder.layers.0.mlp.experts.experts.linear_fc2.adapter has linear_in without linear_out"),
    (lambda tensors: tensors.update({key: torch.cat([value, value[:, :1]], dim=1) for key, value in tensors.items()
                                     if key.startswith(FC1)}),
     "model.layers.0.mlp.experts: the adapter has linear_fc1 of experts [0, 1, 2, 3, 4], the model 4 experts"),
    (lambda tensors: tensors.update({key: value[:, 0] for key, value in tensors.items() if key.startswith(FC1)}),
     "decoder.layers.0.mlp.experts.experts.linear_fc1.adapter: linear_in [4, 64] and linear_out [64, 4] have no "
     "expert axis"),
    (lambda tensors: tensors.update({key.replace(".adapter.", ".adapter.adapter_gate."): tensors.pop(key)
                                     for key in list(tensors) if key.startswith(FC1)}),
     "mlp.experts.experts.linear_fc1.adapter.adapter_gate: CanonicalLoRA's separate gate and up adapters on routed "
     "experts are not read yet"),
], ids=["missing-linear-out", "expert-out-of-range", "no-expert-axis", "canonical-gate-on-experts"])
def test_bad_expert_adapters_are_named_errors(bridge: dict[str, Path], tmp_path: Path, damage: object,
                                              message: str) -> None:
    lora = _store_edit(bridge, tmp_path, damage)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export-adapter", str(lora), str(out), "--base", str(bridge["megatron"])])
    assert result.exit_code in (1, 2) and "Traceback" not in result.output, result.output  # checkpoint or input error
    assert message in result.output, result.output
    assert not out.exists()


# --------------------------------------------------------------------------- shared experts


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Qwen2-MoE base (a gated shared expert beside the routed ones, q/k/v biases) at TP2/EP2 and a Megatron-Bridge
    LoRA run's checkpoint that adapts the shared expert's linear_fc1/linear_fc2 as well (``SharedExpertMLP``'s
    linears are plain column/row-parallel ones, not expert linears: peft/utils.py:682-700)."""
    from support.llama_like_helpers import build_model
    from support.mcore_bridge_lora import bridge_lora_checkpoint

    root = tmp_path_factory.mktemp("bridge_shared_expert_lora")
    hf = save_hf_model(build_model("qwen2_moe", seed=2, mlp_only_layers=[], use_sliding_window=False), root / "hf")
    pgconvert.convert(hf, root / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)
    lora = bridge_lora_checkpoint(root / "megatron", root / "lora", root / "held", DIM, ALPHA)
    return {"hf": hf, "megatron": root / "megatron", "lora": lora, "held": root / "held"}


def test_shared_and_routed_experts_adapters_merge(shared: dict[str, Path], tmp_path: Path) -> None:
    ids = input_ids(json.loads((shared["hf"] / "config.json").read_text())["vocab_size"])
    pgconvert.convert(shared["hf"], tmp_path / "merged", dst_format="hf", merge_adapter=shared["lora"])
    expected = megatron_merged_logits(shared, ids, ALPHA / DIM)
    torch.testing.assert_close(hf_logits(tmp_path / "merged", ids), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(hf_logits(shared["hf"], ids), expected, rtol=1e-3, atol=1e-3)
    held = torch.load(shared["held"] / "rank0.pt", weights_only=True)
    assert "decoder.layers.0.mlp.shared_experts.linear_fc1" in held  # the shared expert was adapted


def test_shared_expert_pairs_peft_would_drop_are_refused_on_export(shared: dict[str, Path], tmp_path: Path) -> None:
    """PEFT, loading an adapter for a transformers 5 MoE model, takes gate_proj/up_proj/down_proj target modules for the
    routed experts' pre-fusion linears: the shared expert's pairs would be left out without a word."""
    from support.mcore_bridge_lora import assert_export_refused

    assert_export_refused(shared["lora"], shared["hf"], tmp_path / "out",
                          "adapts model.layers.0.mlp.shared_expert.down_proj.weight",
                          "would leave these pairs out; merge the adapter with --merge-adapter instead")
