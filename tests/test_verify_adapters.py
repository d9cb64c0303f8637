"""``verify A B`` of two LoRA adapters: a PEFT adapter made by PEFT, its export-adapter export as a Megatron-Bridge
checkpoint and that exported back compare equal (across forms on the base model, ``--base``); a changed lora_B
value, another alpha and a missing target are each reported by name; mixed forms without ``--base`` are refused by
name. An adapter megatron-core saved from two TP ranks verifies equal to its exports too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import pgconvert
from pgconvert.adapters.peft import WEIGHTS_FILE
from pgconvert.cli import main
from pgconvert.errors import ValidationError
from support.hf_helpers import build_hf_model, save_hf_model

pytest.importorskip("peft")

R, ALPHA = 2, 5
Q_PROJ = "model.layers.0.self_attn.q_proj"
O_PROJ = "model.layers.1.self_attn.o_proj"
LINEAR_QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
LINEAR_PROJ = "decoder.layers.1.self_attention.linear_proj.weight"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The HF base, an adapter PEFT made on it, that adapter written by export-adapter as a Megatron-Bridge
    checkpoint ("bridge"), and that written back as a PEFT adapter ("back")."""
    from support.peft_adapters import make_adapter

    root = tmp_path_factory.mktemp("verify_adapters")
    hf = save_hf_model(build_hf_model("llama", seed=2), root / "hf")
    made = make_adapter(hf, root / "peft", seed=4, r=R, lora_alpha=ALPHA,
                        target_modules=["q_proj", "o_proj", "up_proj", "down_proj"])
    pgconvert.export_adapter(made, root / "bridge", base=hf)
    pgconvert.export_adapter(root / "bridge", root / "back", base=hf)
    pgconvert.export_adapter(root / "back", root / "bridge_again", base=hf)
    return {"hf": hf, "peft": made, "bridge": root / "bridge", "back": root / "back",
            "bridge_again": root / "bridge_again"}


def _edited_copy(adapter: Path, out: Path, tensors: bool = True, **settings: object) -> dict[str, torch.Tensor]:
    """A copy of PEFT adapter ``adapter`` with ``settings`` in its adapter_config.json; its tensors returned for
    editing (written back by ``_save``)."""
    shutil.copytree(adapter, out)
    doc = json.loads((out / "adapter_config.json").read_text())
    doc.update(settings)
    (out / "adapter_config.json").write_text(json.dumps(doc))
    return load_file(str(out / WEIGHTS_FILE)) if tensors else {}


def _save(tensors: dict[str, torch.Tensor], out: Path) -> None:
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})


def _names(report: pgconvert.VerifyReport) -> list[str]:
    return [difference.name for difference in report.differences]


def test_a_peft_adapter_and_its_megatron_bridge_export_verify_equal(adapters: dict[str, Path]) -> None:
    """Across forms on the base's canonical weights (4 layers x linear_qkv, proj, fc1, fc2), and each form with its
    own round trip key by key; the k/v and gate rows the export gives zero updates are notes, not differences."""
    for a, b in (("peft", "bridge"), ("bridge", "back"), ("peft", "back")):
        report = pgconvert.verify(adapters[a], adapters[b], base=adapters["hf"])
        assert report.equal and report.compared == 16, (a, b, report.differences)
    same_form = pgconvert.verify(adapters["peft"], adapters["back"])
    assert same_form.equal and same_form.compared == 16, same_form.differences
    assert any("k_proj.weight: adapted in B only, with a zero update" in note for note in same_form.notes)
    bridges = pgconvert.verify(adapters["bridge"], adapters["bridge_again"])
    assert bridges.equal and bridges.compared == 16 and (bridges.format_a, bridges.format_b) == (
        "megatron-bridge-lora", "megatron-bridge-lora"), bridges.differences
    result = CliRunner().invoke(main, ["verify", str(adapters["peft"]), str(adapters["bridge"]),
                                       "--base", str(adapters["hf"])])
    assert result.exit_code == 0 and "16 adapted weights compared (bit-exact): equal" in result.output, result.output


def test_a_changed_lora_b_value_is_reported_by_weight(adapters: dict[str, Path], tmp_path: Path) -> None:
    changed = tmp_path / "changed"
    tensors = _edited_copy(adapters["peft"], changed)
    key = f"base_model.model.{Q_PROJ}.lora_B.weight"
    tensors[key][3, 1] += 1e-3
    _save(tensors, changed)
    result = CliRunner().invoke(main, ["verify", str(adapters["peft"]), str(changed)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert f"differs: {Q_PROJ}.weight: " in result.output, result.output
    assert f"differs: {key}: factor tensor: 1 of " in result.output, result.output
    as_json = CliRunner().invoke(main, ["verify", "--json", str(adapters["peft"]), str(changed)])
    doc = json.loads(as_json.output)
    assert as_json.exit_code == 1 and not doc["equal"] and doc["format_b"] == "peft-lora"
    assert [item["name"] for item in doc["differences"]] == [f"{Q_PROJ}.weight", key]
    across = pgconvert.verify(changed, adapters["bridge"], base=adapters["hf"])
    assert _names(across) == [LINEAR_QKV] and across.differences[0].kind == "values", across.differences
    assert across.differences[0].differing == pgconvert.verify(changed, adapters["peft"]).differences[0].differing
    within = pgconvert.verify(changed, adapters["bridge"], atol=1e-2, base=adapters["hf"])
    assert within.equal, within.differences


def test_a_different_alpha_is_reported_even_where_the_updates_agree(adapters: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    """alpha doubled and every lora_B halved: the same updates (exactly: powers of two), another scaling."""
    rescaled = tmp_path / "rescaled"
    tensors = _edited_copy(adapters["peft"], rescaled, lora_alpha=2 * ALPHA)
    _save({key: tensor / 2 if ".lora_B." in key else tensor for key, tensor in tensors.items()}, rescaled)
    report = pgconvert.verify(adapters["peft"], rescaled)
    scalings = [d for d in report.differences if d.kind == "config"]
    assert len(scalings) == 16 and scalings[0].message == "scaling (alpha / r) 2.5 in A, 5 in B", report.differences
    assert not [d for d in report.differences if d.kind == "values" and ".lora_" not in d.name], report.differences
    bridge = tmp_path / "bridge"
    shutil.copytree(adapters["bridge"], bridge)
    run_config = bridge / "release" / "run_config.yaml"
    doc = yaml.safe_load(run_config.read_text())
    doc["peft"]["alpha"] = 2 * ALPHA
    run_config.write_text(yaml.safe_dump(doc))
    across = pgconvert.verify(adapters["peft"], bridge, base=adapters["hf"])
    assert f"{LINEAR_QKV}" in _names(across) and any(
        d.message == "scaling (alpha / r) 2.5 in A, 5 in B" for d in across.differences), across.differences


def test_a_missing_target_is_reported(adapters: dict[str, Path], tmp_path: Path) -> None:
    fewer = tmp_path / "fewer"
    tensors = _edited_copy(adapters["peft"], fewer)
    _save({key: tensor for key, tensor in tensors.items() if f".{O_PROJ}." not in key}, fewer)
    report = pgconvert.verify(adapters["peft"], fewer)
    assert [(d.name, d.message) for d in report.differences] == [(f"{O_PROJ}.weight", "adapted in A only")]
    across = pgconvert.verify(adapters["bridge"], fewer, base=adapters["hf"])
    assert [(d.name, d.message) for d in across.differences] == [(LINEAR_PROJ, "adapted in A only")]
    result = CliRunner().invoke(main, ["verify", str(fewer), str(adapters["peft"])])
    assert result.exit_code == 1 and f"differs: {O_PROJ}.weight: adapted in B only" in result.output, result.output


def test_mixed_forms_without_base_is_a_named_error(adapters: dict[str, Path]) -> None:
    result = CliRunner().invoke(main, ["verify", str(adapters["peft"]), str(adapters["bridge"])])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "(peft-lora) and" in result.output and "(megatron-bridge-lora): adapters in different forms" in \
        result.output and "pass --base" in result.output, result.output
    with pytest.raises(ValidationError, match="not a LoRA adapter"):
        pgconvert.verify(adapters["hf"], adapters["peft"])
    with pytest.raises(ValidationError, match="name its iteration directory"):
        pgconvert.verify(adapters["bridge"], adapters["bridge_again"], iteration_b=1)
    with pytest.raises(ValidationError, match="compared as adapters"):
        pgconvert.verify(adapters["peft"], adapters["back"], merge_adapter=adapters["peft"])


def test_a_saved_whole_weight_the_other_form_cannot_hold_is_named(adapters: dict[str, Path], tmp_path: Path) -> None:
    """modules_to_save: PEFT saves the module's whole weight, which a Megatron-Bridge adapter has no form for."""
    from support.peft_adapters import make_adapter

    saving = make_adapter(adapters["hf"], tmp_path / "saving", seed=4, r=R, lora_alpha=ALPHA,
                          target_modules=["q_proj", "o_proj", "up_proj", "down_proj"], modules_to_save=["lm_head"])
    report = pgconvert.verify(saving, adapters["bridge"], base=adapters["hf"])
    assert ("lm_head.weight", "a whole saved weight (modules_to_save) in A only: the other form holds none") in [
        (d.name, d.message) for d in report.differences], report.differences
    same_form = pgconvert.verify(saving, adapters["peft"])
    assert ("base_model.model.lm_head.weight", "stored in A only") in [
        (d.name, d.message) for d in same_form.differences], same_form.differences


def test_a_megatron_core_saved_tp2_adapter_and_its_peft_export_verify_equal(adapters: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    """An adapter megatron-core saved from two TP ranks as Megatron-Bridge saves one (support/mcore_bridge_lora.py),
    against its PEFT export (on the base, TP2 Megatron or HF: the updates are the same whatever the TP split) and
    against its export back (key by key, factor tensors bit-exact); against another rank's adapter, the ranks are
    named."""
    from support.mcore_bridge_lora import bridge_lora_checkpoint

    megatron_base = tmp_path / "megatron"
    pgconvert.convert(adapters["hf"], megatron_base, dst_format="megatron", dst_tp=2)
    saved = bridge_lora_checkpoint(megatron_base, tmp_path / "lora", tmp_path / "held", 4, 6)
    pgconvert.export_adapter(saved, tmp_path / "peft", base=megatron_base)
    pgconvert.export_adapter(tmp_path / "peft", tmp_path / "back", base=adapters["hf"])
    for base in (megatron_base, adapters["hf"]):
        report = pgconvert.verify(saved, tmp_path / "peft", base=base)
        assert report.equal and report.compared == 16, report.differences
    same_form = pgconvert.verify(saved, tmp_path / "back")
    assert same_form.equal and same_form.compared == 16, same_form.differences
    against_other = pgconvert.verify(saved, adapters["bridge"])
    assert not against_other.equal and any(d.message == "rank 4 in A, 2 in B" for d in against_other.differences)
