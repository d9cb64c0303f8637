"""DoRA adapters (weight-decomposed LoRA), PEFT's and Megatron-Bridge's: merged, exported, inspected and verified.

The PEFT adapter is written by PEFT's ``save_pretrained`` (``LoraConfig(use_dora=True)``) with lora_A, lora_B and
every magnitude vector drawn at random, so neither the low-rank update nor the magnitude is a no-op; the reference is
PEFT's own ``merge_and_unload`` in float32. Merged at TP2, the row-parallel pieces (o_proj, down_proj: some columns
of every row) must be scaled by the norms of whole rows. The Megatron-Bridge DoRA run is made at TP2 by
megatron-core as Megatron-Bridge makes it (``support/mcore_bridge_lora.py`` names the source lines), its reference
merged on the Megatron side from what each rank held.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import pgconvert
from pgconvert.errors import ValidationError
from support.hf_helpers import build_hf_model, hf_logits, input_ids, load_hf_tensors, save_hf_model
from support.mcore_bridge_lora import rewrite_store
from support.peft_adapters import assert_tensors_equal, edit_config, make_adapter, peft_merged

pytest.importorskip("peft")

ATTENTION_AND_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_FILE = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def dora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama (grouped query attention), a PEFT DoRA adapter on every projection (one module of another rank)
    and PEFT's merge of it."""
    root = tmp_path_factory.mktemp("dora")
    base = save_hf_model(build_hf_model("llama", seed=2), root / "base")
    adapter = make_adapter(base, root / "adapter", seed=4, r=4, lora_alpha=8, use_dora=True,
                           target_modules=ATTENTION_AND_MLP, rank_pattern={"layers.1.self_attn.q_proj": 2})
    return {"base": base, "adapter": adapter, "merged": peft_merged(base, adapter, root / "merged")}


def _adapter_tensors(adapter: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(adapter / ADAPTER_FILE))


def _save_adapter_tensors(adapter: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(adapter / ADAPTER_FILE), metadata={"format": "pt"})


def test_peft_saves_a_magnitude_per_adapted_linear(dora: dict[str, Path]) -> None:
    tensors = _adapter_tensors(dora["adapter"])
    magnitudes = {key: value for key, value in tensors.items() if key.endswith(".lora_magnitude_vector")}
    assert len(magnitudes) == 4 * 7 and len(tensors) == 4 * 7 * 3
    assert magnitudes["base_model.model.model.layers.0.self_attn.k_proj.lora_magnitude_vector"].shape == (32,)


def test_dora_merge_equals_peft_merge_and_unload_in_hf_and_at_tp2(dora: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    pgconvert.convert(dora["base"], out, dst_format="hf", merge_adapter=dora["adapter"])
    assert_tensors_equal(dora["merged"], out)
    ids = input_ids(1000)
    torch.testing.assert_close(hf_logits(out, ids), hf_logits(dora["merged"], ids), rtol=1e-6, atol=1e-6)
    megatron = tmp_path / "megatron"  # fused linear_qkv and linear_fc1, row-parallel linear_proj and linear_fc2
    pgconvert.convert(dora["base"], megatron, dst_format="megatron", dst_tp=2, merge_adapter=dora["adapter"])
    pgconvert.convert(megatron, tmp_path / "back", dst_format="hf")
    assert_tensors_equal(out, tmp_path / "back")
    report = pgconvert.verify(dora["base"], megatron, merge_adapter=dora["adapter"])  # base + DoRA = the TP2 output
    assert report.equal, report.differences
    assert not pgconvert.verify(dora["base"], megatron).equal


def test_the_reference_sees_the_magnitude_and_whole_row_norms(dora: dict[str, Path], tmp_path: Path) -> None:
    """The checks above fail if the magnitude is ignored (a plain LoRA merge of the same pairs) or if a row-parallel
    piece is scaled by the norm of its own columns."""
    plain = Path(shutil.copytree(dora["adapter"], tmp_path / "plain"))
    _save_adapter_tensors(plain, {key: value for key, value in _adapter_tensors(plain).items()
                                  if not key.endswith(".lora_magnitude_vector")})
    edit_config(plain, use_dora=False)
    pgconvert.convert(dora["base"], tmp_path / "lora", dst_format="hf", merge_adapter=plain)
    merged, as_lora = load_hf_tensors(dora["merged"]), load_hf_tensors(tmp_path / "lora")
    assert all(not torch.equal(merged[name], as_lora[name]) for name in merged if "proj" in name)
    name = "model.layers.2.self_attn.o_proj"
    base = load_hf_tensors(dora["base"])[f"{name}.weight"]
    tensors = _adapter_tensors(dora["adapter"])
    a, b = (tensors[f"base_model.model.{name}.lora_{side}.weight"] for side in "AB")
    magnitude = tensors[f"base_model.model.{name}.lora_magnitude_vector"]
    summed = base + 2.0 * (b @ a)
    per_piece = torch.cat([magnitude.unsqueeze(1) / torch.linalg.norm(half, dim=1, keepdim=True) * half
                           for half in summed.chunk(2, dim=1)], dim=1)
    assert not torch.allclose(per_piece, merged[f"{name}.weight"], rtol=1e-3, atol=1e-3)


def test_bf16_dora_merge_is_peft_float32_merge_rounded_once(dora: dict[str, Path], tmp_path: Path) -> None:
    """PEFT merges a bfloat16 base in float32 (its adapter weights are float32) and rounds once: the same bits."""
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base_bf16"
    AutoModelForCausalLM.from_pretrained(dora["base"], dtype=torch.bfloat16).save_pretrained(base)
    reference = peft_merged(base, dora["adapter"], tmp_path / "reference", dtype=torch.bfloat16)
    pgconvert.convert(base, tmp_path / "megatron", dst_format="megatron", dst_tp=2, merge_adapter=dora["adapter"])
    pgconvert.convert(tmp_path / "megatron", tmp_path / "back", dst_format="hf")
    assert_tensors_equal(reference, tmp_path / "back")


def test_dora_on_some_parts_of_a_fused_tensor_scales_those_rows_alone(dora: dict[str, Path], tmp_path: Path) -> None:
    """DoRA on q_proj and up_proj only: linear_qkv's k and v rows and linear_fc1's gate rows keep scale 1."""
    adapter = make_adapter(dora["base"], tmp_path / "adapter", seed=6, r=2, lora_alpha=4, use_dora=True,
                           target_modules=["q_proj", "up_proj"])
    reference = peft_merged(dora["base"], adapter, tmp_path / "reference")
    pgconvert.convert(dora["base"], tmp_path / "megatron", dst_format="megatron", dst_tp=2, merge_adapter=adapter)
    pgconvert.convert(tmp_path / "megatron", tmp_path / "back", dst_format="hf")
    assert_tensors_equal(reference, tmp_path / "back")


def _drop_magnitude(adapter: Path) -> None:
    _save_adapter_tensors(adapter, {key: value for key, value in _adapter_tensors(adapter).items()
                                    if "layers.1.mlp.up_proj.lora_magnitude_vector" not in key})


def _shorten_magnitude(adapter: Path) -> None:
    tensors = _adapter_tensors(adapter)
    key = "base_model.model.model.layers.0.self_attn.o_proj.lora_magnitude_vector"
    tensors[key] = tensors[key][:-1].clone()
    _save_adapter_tensors(adapter, tensors)


@pytest.mark.parametrize("damage, expected", [
    (_drop_magnitude, r"model.layers.1.mlp.up_proj: use_dora: true, but no base_model.model.model.layers.1.mlp."
                      r"up_proj.lora_magnitude_vector \(DoRA's magnitude vector\)"),
    (_shorten_magnitude, r"o_proj.lora_magnitude_vector: shape \[63\], expected \[64\] \(one magnitude per output "
                         r"row of model.layers.0.self_attn.o_proj\)"),
    (lambda a: edit_config(a, use_dora=False), r"lora_magnitude_vector: a DoRA magnitude, but adapter_config.json "
                                                r"does not set use_dora: true"),
    (lambda a: edit_config(a, use_dora="yes"), r"use_dora='yes': expected true or false"),
], ids=["no-magnitude", "short-magnitude", "not-dora", "use-dora-text"])
def test_bad_dora_adapter_is_a_named_error_and_writes_nothing(dora: dict[str, Path], tmp_path: Path, damage: object,
                                                              expected: str) -> None:
    adapter = Path(shutil.copytree(dora["adapter"], tmp_path / "bad_adapter"))
    damage(adapter)  # type: ignore[operator]
    out = tmp_path / "out"
    with pytest.raises(ValidationError, match=expected) as caught:
        pgconvert.convert(dora["base"], out, dst_format="megatron", dst_tp=2, merge_adapter=adapter)
    assert str(adapter) in str(caught.value)
    assert not out.exists()


def test_dora_on_the_output_layer_is_refused_by_name(dora: dict[str, Path], tmp_path: Path) -> None:
    adapter = make_adapter(dora["base"], tmp_path / "adapter", r=2, lora_alpha=4, use_dora=True,
                           target_modules=["lm_head"])
    with pytest.raises(ValidationError, match=r"DoRA on lm_head.weight \(pgconvert's output_layer.weight\) is not "
                                              r"merged: .*a vocab table"):
        pgconvert.convert(dora["base"], tmp_path / "out", dst_format="hf", merge_adapter=adapter)
    assert not (tmp_path / "out").exists()


# Megatron-Bridge's DoRA at TP2 on the column-parallel modules, whose ranks hold whole rows (a row-parallel module's
# DoRA at TP2 takes each rank's norm: refused below).
BRIDGE_TARGETS = ("self_attention.linear_qkv", "mlp.linear_fc1")
DIM, ALPHA = 4, 6


@pytest.fixture(scope="module")
def bridge(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The HF base, its TP2 Megatron form, a Megatron-Bridge DoRA run's checkpoint made at TP2 (support/
    mcore_bridge_lora.py), what each rank held, and the checkpoint exported as a PEFT adapter."""
    from support.mcore_bridge_lora import bridge_lora_checkpoint

    root = tmp_path_factory.mktemp("bridge_dora")
    hf = save_hf_model(build_hf_model("llama", seed=2), root / "hf")
    pgconvert.convert(hf, root / "megatron", dst_format="megatron", dst_tp=2)
    store = bridge_lora_checkpoint(root / "megatron", root / "dora", root / "held", DIM, ALPHA, dora=True,
                                   targets=BRIDGE_TARGETS)
    pgconvert.export_adapter(store, root / "exported", base=root / "megatron")
    return {"hf": hf, "megatron": root / "megatron", "dora": store, "held": root / "held",
            "exported": root / "exported"}


def megatron_dora_logits(paths: dict[str, Path], ids: torch.Tensor) -> torch.Tensor:
    """The TP2 model with each rank's weights merged as Megatron-Bridge's DoRALinear computes them
    (dora_layers.py:122-160): ``m_r / ||W_r + s·B_r·A|| * (W_r + s·B_r·A)``, A gathered over the ranks, the norm of
    the rows rank r holds, run rank by rank."""
    from support.hf_helpers import megatron_tp_logits, read_megatron_tp_ranks

    models = read_megatron_tp_ranks(paths["megatron"])
    held = [torch.load(paths["held"] / f"rank{rank}.pt", weights_only=True) for rank in range(len(models))]
    for module in held[0]:
        linear_in = torch.cat([pieces[module]["linear_in"].double() for pieces in held])
        for rank, model in enumerate(models):
            pieces, weight = held[rank][module], f"{module}.weight"
            summed = model[weight].double() + ALPHA / DIM * pieces["linear_out"].double() @ linear_in
            scale = pieces["weight_magnitude"].double().unsqueeze(1) / torch.linalg.norm(summed, dim=1, keepdim=True)
            model[weight] = scale * summed
    config = json.loads((paths["hf"] / "config.json").read_text())
    return megatron_tp_logits(models, config, ids).to(torch.float32)


def test_bridge_dora_exports_to_peft_with_the_megatron_side_logits(bridge: dict[str, Path]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = input_ids(1000)
    expected = megatron_dora_logits(bridge, ids)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(bridge["hf"], dtype=torch.float32),
                                      bridge["exported"])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    config = json.loads((bridge["exported"] / "adapter_config.json").read_text())
    assert (config["use_dora"], config["r"], config["lora_alpha"]) == (True, DIM, ALPHA)
    tensors = _adapter_tensors(bridge["exported"])
    assert len(tensors) == 4 * 5 * 3  # q, k, v, gate, up: lora_A, lora_B, magnitude
    assert tensors["base_model.model.model.layers.0.mlp.up_proj.lora_magnitude_vector"].shape == (128,)


def test_bridge_dora_merges_as_its_peft_export(bridge: dict[str, Path], tmp_path: Path) -> None:
    """--merge-adapter of the Megatron-Bridge checkpoint: the bytes of merging its PEFT export, the Megatron-side
    logits, and at TP2 the same tensors."""
    pgconvert.convert(bridge["hf"], tmp_path / "merged", dst_format="hf", merge_adapter=bridge["dora"])
    pgconvert.convert(bridge["hf"], tmp_path / "merged_peft", dst_format="hf", merge_adapter=bridge["exported"])
    assert_tensors_equal(tmp_path / "merged_peft", tmp_path / "merged")
    ids = input_ids(1000)
    torch.testing.assert_close(hf_logits(tmp_path / "merged", ids), megatron_dora_logits(bridge, ids),
                               rtol=1e-5, atol=1e-5)
    pgconvert.convert(bridge["megatron"], tmp_path / "tp2", dst_format="megatron", dst_tp=2,
                      merge_adapter=bridge["dora"])
    pgconvert.convert(tmp_path / "tp2", tmp_path / "back", dst_format="hf")
    assert_tensors_equal(tmp_path / "merged", tmp_path / "back")


def test_dora_exports_back_to_megatron_bridge_and_round_trips(bridge: dict[str, Path], tmp_path: Path) -> None:
    """PEFT DoRA -> Megatron-Bridge DoRA (canonical order, TP 1) -> PEFT: the same tensors; the Megatron-Bridge form
    read at TP 2 with a row-parallel module's DoRA is refused by name."""
    import yaml

    pgconvert.export_adapter(bridge["exported"], tmp_path / "bridge", base=bridge["megatron"])
    pgconvert.export_adapter(tmp_path / "bridge", tmp_path / "again", base=bridge["hf"])
    assert_tensors_equal(bridge["exported"], tmp_path / "again")
    _assert_megatron_core_loads_it(bridge, tmp_path / "bridge", tmp_path / "loaded")
    full = make_adapter(bridge["hf"], tmp_path / "full", seed=5, r=2, lora_alpha=4, use_dora=True,
                        target_modules=["o_proj"])
    pgconvert.export_adapter(full, tmp_path / "full_bridge", base=bridge["megatron"])
    run_config = tmp_path / "full_bridge" / "release" / "run_config.yaml"
    doc = yaml.safe_load(run_config.read_text())
    assert doc["peft"]["_target_"] == "megatron.bridge.peft.dora.DoRA"
    assert doc["model"]["tensor_model_parallel_size"] == 1
    doc["model"]["tensor_model_parallel_size"] = 2
    run_config.write_text(yaml.safe_dump(doc))
    with pytest.raises(ValidationError, match=r"linear_proj.adapter.weight_magnitude: a row-parallel module's DoRA "
                                              r"trained at TP 2: Megatron-Bridge took the norm of each rank's columns"):
        pgconvert.convert(bridge["hf"], tmp_path / "out", dst_format="hf", merge_adapter=tmp_path / "full_bridge")
    assert not (tmp_path / "out").exists()
    short = Path(shutil.copytree(tmp_path / "bridge", tmp_path / "short"))
    rewrite_store(short / "release", _shorten_bridge_magnitude)
    with pytest.raises(ValidationError, match=r"decoder.layers.0.self_attention.linear_qkv.adapter.weight_magnitude "
                                              r"has shape \[127\]: a DoRA run saves one magnitude per output row "
                                              r"\(128\)"):
        pgconvert.convert(bridge["hf"], tmp_path / "out", dst_format="hf", merge_adapter=short)
    assert not (tmp_path / "out").exists()


def _shorten_bridge_magnitude(tensors: dict[str, torch.Tensor]) -> None:
    key = "decoder.layers.self_attention.linear_qkv.adapter.weight_magnitude"
    tensors[key] = tensors[key][:, :-1].contiguous()


def test_inspect_names_the_dora_method_of_either_form(bridge: dict[str, Path]) -> None:
    from click.testing import CliRunner

    from pgconvert.cli import main

    for path, form in ((bridge["exported"], "peft-lora"), (bridge["dora"], "megatron-bridge-lora")):
        result = CliRunner().invoke(main, ["inspect", str(path), "--json"])
        assert result.exit_code == 0, result.output
        described = json.loads(result.output)
        assert (described["format"], described["adapter"]["method"]) == (form, "dora")
        text = CliRunner().invoke(main, ["inspect", str(path)])
        assert "DoRA (LoRA with learned row magnitudes)" in text.output, text.output


def test_verify_compares_dora_magnitudes_and_names_a_lora_counterpart(bridge: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    report = pgconvert.verify(bridge["exported"], bridge["dora"], base=bridge["hf"])
    assert report.equal and report.compared == 4 * 2, report.differences  # linear_qkv and linear_fc1 of 4 layers
    changed = Path(shutil.copytree(bridge["exported"], tmp_path / "changed"))
    tensors = _adapter_tensors(changed)
    key = "base_model.model.model.layers.2.self_attn.k_proj.lora_magnitude_vector"
    tensors[key][5] += 1e-2
    _save_adapter_tensors(changed, tensors)
    own = pgconvert.verify(bridge["exported"], changed)
    assert [(d.name, d.kind) for d in own.differences] == [("model.layers.2.self_attn.k_proj.weight", "values"),
                                                           (key, "values")], own.differences
    assert "DoRA magnitude" in own.differences[0].message
    across = pgconvert.verify(changed, bridge["dora"], base=bridge["hf"])
    assert [d.name for d in across.differences] == ["decoder.layers.2.self_attention.linear_qkv.weight"]
    assert "DoRA magnitude" in across.differences[0].message
    plain = Path(shutil.copytree(bridge["exported"], tmp_path / "plain"))
    _save_adapter_tensors(plain, {key: value for key, value in _adapter_tensors(plain).items()
                                  if not key.endswith(".lora_magnitude_vector")})
    edit_config(plain, use_dora=False)
    mixed = pgconvert.verify(bridge["exported"], plain)
    assert [(d.name, d.kind) for d in mixed.differences] == [("method", "config")], mixed.differences
    assert "dora in A, lora in B" in mixed.differences[0].message


def _assert_megatron_core_loads_it(bridge: dict[str, Path], store: Path, out: Path) -> None:
    """megatron-core's dist_checkpointing.load (strict) of the written store into the TP2 model wrapped as
    Megatron-Bridge's DoRA wraps it gives each rank the pieces the run held: linear_in, linear_out and linear_qkv's
    magnitude (a TP 1 order store: linear_fc1's magnitude is in [gate; up] order, which a TP2 run holds per rank)."""
    from support.mcore_bridge_lora import load_bridge_lora

    load_bridge_lora(bridge["megatron"], store / "release", out, DIM, ALPHA, dora=True, targets=BRIDGE_TARGETS)
    for rank in range(2):
        made = torch.load(bridge["held"] / f"rank{rank}.pt", weights_only=True)
        loaded = torch.load(out / f"rank{rank}.pt", weights_only=True)
        assert sorted(made) == sorted(loaded)
        for module, pieces in made.items():
            sides = ("linear_in", "linear_out", *(("weight_magnitude",) if "linear_qkv" in module else ()))
            assert all(torch.equal(pieces[side], loaded[module][side]) for side in sides), (rank, module)
