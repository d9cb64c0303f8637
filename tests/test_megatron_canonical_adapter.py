"""Megatron-Bridge's CanonicalLoRA (separate adapters for q, k, v under ``linear_qkv`` and for gate, up under
``linear_fc1``): merged by ``--merge-adapter`` and exported to PEFT, each part's pair its HF projection's.

The adapter is made by megatron-core 0.16.1 as Megatron-Bridge makes one (``support/mcore_bridge_lora.py``:
``canonical_adapters`` and ``AdapterDict`` name the canonical_lora.py lines followed): a tiny Llama at TP2, its
``linear_qkv`` wrapped with ``adapter_q``/``adapter_k``/``adapter_v``, its ``linear_fc1`` with
``adapter_gate``/``adapter_up`` (saved through megatron-core's swiglu factory, as ``ParallelLinearAdapter`` saves any
adapter of a gated ``linear_fc1``), ``linear_proj`` and ``linear_fc2`` with plain adapters, on two gloo ranks. The
reference merges each rank's weights on the Megatron side from what the ranks held, the parts' deltas joined as the
wrappers join their outputs.
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
from support.hf_helpers import build_hf_model, hf_logits, input_ids, load_hf_tensors, save_hf_model
from support.mcore_bridge_lora import megatron_merged_logits, peft_logits, rewrite_store

pytest.importorskip("peft")

DIM, ALPHA = 4, 6


@pytest.fixture(scope="module")
def bridge(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from support.mcore_bridge_lora import exported_bridge_run

    root = tmp_path_factory.mktemp("bridge_canonical_lora")
    hf = save_hf_model(build_hf_model("llama", seed=2), root / "hf")
    return exported_bridge_run(root, hf, {"dst_tp": 2}, DIM, ALPHA, canonical=True)


def test_exported_canonical_adapter_gives_peft_the_megatron_merged_logits(bridge: dict[str, Path]) -> None:
    ids = input_ids(1000)
    expected = megatron_merged_logits(bridge, ids, ALPHA / DIM)
    torch.testing.assert_close(peft_logits(bridge["hf"], bridge["exported"], ids), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(hf_logits(bridge["hf"], ids), expected, rtol=1e-3, atol=1e-3)
    config = json.loads((bridge["exported"] / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (DIM, ALPHA)
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    tensors = load_hf_tensors(bridge["exported"])
    prefix = "base_model.model.model.layers.1."
    q, k, v, gate, up = (tensors[f"{prefix}{module}.lora_A.weight"] for module in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"))
    assert not torch.equal(q, k) and not torch.equal(k, v) and not torch.equal(gate, up)  # each part its own lora_A


def test_merge_adapter_merges_the_canonical_parts_at_any_layout(bridge: dict[str, Path], tmp_path: Path) -> None:
    ids = input_ids(1000)
    pgconvert.convert(bridge["hf"], tmp_path / "merged", dst_format="hf", merge_adapter=bridge["lora"])
    torch.testing.assert_close(hf_logits(tmp_path / "merged", ids), megatron_merged_logits(bridge, ids, ALPHA / DIM),
                               rtol=1e-5, atol=1e-5)
    pgconvert.convert(bridge["megatron"], tmp_path / "tp1", dst_format="megatron", dst_tp=1,
                      merge_adapter=bridge["lora"])
    report = pgconvert.verify(bridge["megatron"], tmp_path / "tp1", merge_adapter=bridge["lora"])
    assert report.equal and report.compared > 0, report.to_dict()
    report = pgconvert.verify(bridge["lora"], bridge["exported"], base=bridge["megatron"])
    assert report.equal and report.compared == 4 * 4, report.to_dict()  # qkv, proj, fc1, fc2 of 4 layers


def _without_fc1(tensors: dict[str, torch.Tensor]) -> None:
    for key in [key for key in tensors if ".linear_fc1.adapter." in key]:
        del tensors[key]


def _q_under_linear_proj(tensors: dict[str, torch.Tensor]) -> None:
    _without_fc1(tensors)
    for side in ("in", "out"):
        key = f"decoder.layers.self_attention.linear_proj.adapter.linear_{side}.weight"
        tensors[key.replace(".adapter.", ".adapter.adapter_q.")] = tensors.pop(key)


def _k_without_linear_out(tensors: dict[str, torch.Tensor]) -> None:
    _without_fc1(tensors)
    del tensors["decoder.layers.self_attention.linear_qkv.adapter.adapter_k.linear_out.weight"]


@pytest.mark.parametrize("damage, message", [
    (lambda tensors: None, "mlp.linear_fc1.adapter.adapter_gate.linear_out.weight: linear_out's 128 rows are not "
                           "saved in halves of 128 rows"),
    (_q_under_linear_proj, "decoder.layers.self_attention.linear_proj.adapter.adapter_q: CanonicalLoRA's adapter_q is "
                           "one of linear_qkv's, not of linear_proj"),
    (_k_without_linear_out, "decoder.layers.0.self_attention.linear_qkv.adapter.adapter_k has linear_in without linear_out"),
], ids=["gate-not-saved-in-halves", "q-under-linear-proj", "k-without-linear-out"])
def test_bad_canonical_adapters_are_named_errors(bridge: dict[str, Path], tmp_path: Path, damage: object,
                                                 message: str) -> None:
    """A store rewritten by one process holds each tensor as one chunk: a gated linear_fc1's part adapter then does
    not say how its rows were split over TP when saved."""
    lora = Path(shutil.copytree(bridge["lora"], tmp_path / "bad_lora"))
    rewrite_store(lora, damage)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export-adapter", str(lora), str(out), "--base", str(bridge["megatron"])])
    assert result.exit_code in (1, 2) and "Traceback" not in result.output, result.output  # checkpoint or input error
    assert message in result.output, result.output
    assert not out.exists()
