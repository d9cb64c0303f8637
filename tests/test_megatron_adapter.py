"""A LoRA adapter as Megatron-Bridge saves it for a Megatron model: exported unmerged as a PEFT adapter, merged by
``--merge-adapter``, described by ``inspect``.

The adapter is made by megatron-core 0.16.1 as Megatron-Bridge makes one (``support/mcore_bridge_lora.py`` names the
Megatron-Bridge source lines it follows): a tiny Llama converted to a TP2 Megatron checkpoint, each layer's
linear_qkv, linear_proj, linear_fc1 and linear_fc2 wrapped with a ParallelLinearAdapter on two gloo ranks, the
adapter-only state saved with ``dist_checkpointing.save``. The reference is computed on the Megatron side from what
each rank holds: every rank's weight merged as Megatron-Bridge's ``LoRAMerge`` merges it (written out below), the
model run rank by rank (``megatron_tp_logits``). The export must give transformers + PEFT the same logits.
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
from support.hf_helpers import build_hf_model, input_ids, load_hf_tensors
from support.hf_helpers import save_hf_model
from support.mcore_bridge_lora import megatron_merged_logits, peft_logits, rewrite_store

pytest.importorskip("peft")

DIM, ALPHA = 4, 6  # Megatron-Bridge's scaling alpha / dim = 1.5


@pytest.fixture(scope="module")
def bridge(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The HF base, its TP2 Megatron form, the Megatron-Bridge LoRA run's checkpoint at TP2 and what each rank
    held."""
    from support.mcore_bridge_lora import exported_bridge_run

    root = tmp_path_factory.mktemp("bridge_lora")
    hf = save_hf_model(build_hf_model("llama", seed=2), root / "hf")
    return exported_bridge_run(root, hf, {"dst_tp": 2}, DIM, ALPHA)


def test_exported_adapter_gives_peft_the_megatron_merged_logits(bridge: dict[str, Path]) -> None:
    ids = input_ids(1000)
    expected = megatron_merged_logits(bridge, ids, ALPHA / DIM)
    actual = peft_logits(bridge["hf"], bridge["exported"], ids)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    from support.hf_helpers import hf_logits

    assert not torch.allclose(hf_logits(bridge["hf"], ids), expected, rtol=1e-3, atol=1e-3)  # the adapter matters
    config = json.loads((bridge["exported"] / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["use_rslora"]) == ("LORA", DIM, ALPHA, False)
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    tensors = load_hf_tensors(bridge["exported"])
    assert len(tensors) == 4 * 7 * 2
    prefix = "base_model.model.model.layers.1."
    shared = [tensors[f"{prefix}{module}.lora_A.weight"] for module in ("self_attn.q_proj", "self_attn.k_proj",
                                                                        "self_attn.v_proj")]
    assert all(torch.equal(shared[0], other) for other in shared[1:])  # q, k and v share linear_qkv's linear_in


def test_export_reads_the_base_family_from_any_format(bridge: dict[str, Path], tmp_path: Path) -> None:
    """The HF base (its config.json) and the TP2 Megatron base name the same modules: the same export."""
    pgconvert.export_adapter(bridge["lora"], tmp_path / "from_hf", base=bridge["hf"])
    expected, actual = load_hf_tensors(bridge["exported"]), load_hf_tensors(tmp_path / "from_hf")
    assert sorted(expected) == sorted(actual)
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


def test_merge_adapter_merges_a_megatron_adapter_as_its_peft_export(bridge: dict[str, Path], tmp_path: Path) -> None:
    """--merge-adapter takes the Megatron-Bridge checkpoint itself: the same bytes as merging its PEFT export, and the
    merged model computes the Megatron-side merge's logits; verify --merge-adapter checks such an output."""
    pgconvert.convert(bridge["hf"], tmp_path / "merged", dst_format="hf", merge_adapter=bridge["lora"])
    pgconvert.convert(bridge["hf"], tmp_path / "merged_peft", dst_format="hf", merge_adapter=bridge["exported"])
    expected, actual = load_hf_tensors(tmp_path / "merged_peft"), load_hf_tensors(tmp_path / "merged")
    assert all(torch.equal(expected[name], actual[name]) for name in expected)
    from support.hf_helpers import hf_logits

    ids = input_ids(1000)
    torch.testing.assert_close(hf_logits(tmp_path / "merged", ids), megatron_merged_logits(bridge, ids, ALPHA / DIM),
                               rtol=1e-5, atol=1e-5)
    pgconvert.convert(bridge["megatron"], tmp_path / "tp1", dst_format="megatron", dst_tp=1,
                      merge_adapter=bridge["lora"])
    pgconvert.convert(tmp_path / "tp1", tmp_path / "back", dst_format="hf")
    back = load_hf_tensors(tmp_path / "back")
    assert all(torch.equal(expected[name], back[name]) for name in expected)
    report = pgconvert.verify(bridge["megatron"], tmp_path / "tp1", merge_adapter=bridge["lora"])
    assert report.equal and report.compared > 0, report.to_dict()
    assert not pgconvert.verify(bridge["megatron"], tmp_path / "tp1").equal  # the base alone differs


def test_the_runs_optimizer_state_beside_the_adapter_is_left_out(bridge: dict[str, Path], tmp_path: Path) -> None:
    """A LoRA run saves its optimizer state in the same store (megatron-core's ``optimizer.state.<state>.<key>``):
    the export is the adapter's alone."""
    lora = _copy(bridge, tmp_path)

    def add_optimizer_state(tensors: dict[str, torch.Tensor]) -> None:
        for key in list(tensors):
            tensors[f"optimizer.state.exp_avg.{key}"] = torch.ones_like(tensors[key])

    rewrite_store(lora, add_optimizer_state)
    pgconvert.export_adapter(lora, tmp_path / "out", base=bridge["megatron"])
    expected, actual = load_hf_tensors(bridge["exported"]), load_hf_tensors(tmp_path / "out")
    assert sorted(expected) == sorted(actual)
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


def test_export_adapter_from_the_command_line_and_inspect(bridge: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export-adapter", str(bridge["lora"]), str(out), "--base", str(bridge["hf"])])
    assert result.exit_code == 0, result.output
    assert "28 LoRA pairs (peft)" in result.output
    assert (out / "adapter_model.safetensors").read_bytes() == (bridge["exported"] / "adapter_model.safetensors").read_bytes()
    result = CliRunner().invoke(main, ["inspect", str(bridge["lora"]), "--json"])
    assert result.exit_code == 0, result.output
    described = json.loads(result.output)
    assert described["format"] == "megatron-bridge-lora" and described["ok"]
    adapter = described["adapter"]
    assert (adapter["pairs"], adapter["ranks"], adapter["scalings"], adapter["layers"]) == (16, [DIM], [1.5],
                                                                                            [0, 1, 2, 3])
    assert adapter["modules"] == ["mlp.linear_fc1", "mlp.linear_fc2", "self_attention.linear_proj",
                                  "self_attention.linear_qkv"]


# --------------------------------------------------------------------------- PEFT -> Megatron-Bridge


def store_tensors(root: Path) -> dict[str, torch.Tensor]:
    """A torch_dist store's tensors, read whole by torch.distributed.checkpoint alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

    from pgconvert.formats.torch_dist import resolve_iteration_dir

    store = resolve_iteration_dir(root, None)[0]
    metadata = FileSystemReader(str(store)).read_metadata()
    tensors = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
               for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}
    dcp.load(tensors, checkpoint_id=str(store), no_dist=True)
    return tensors


def test_peft_export_goes_back_to_the_megatron_bridge_checkpoint(bridge: dict[str, Path], tmp_path: Path) -> None:
    """Megatron-Bridge -> PEFT -> Megatron-Bridge gives the run's adapter tensors back, and megatron-core loads the
    written store into the TP2 model wrapped as Megatron-Bridge wraps it: every rank holds what the run held."""
    from support.mcore_bridge_lora import load_bridge_lora

    back = tmp_path / "back"
    written = pgconvert.export_adapter(bridge["exported"], back, base=bridge["megatron"])
    assert (written.form, written.pairs) == ("megatron-bridge", 16)
    expected, actual = store_tensors(bridge["lora"]), store_tensors(back)
    assert sorted(expected) == sorted(actual)
    assert all(torch.equal(expected[key], actual[key]) for key in expected)
    import yaml

    peft = yaml.safe_load((back / "release" / "run_config.yaml").read_text())["peft"]
    assert (peft["_target_"], peft["dim"], peft["alpha"]) == ("megatron.bridge.peft.lora.LoRA", DIM, ALPHA)
    pgconvert.export_adapter(back / "release", tmp_path / "again", base=bridge["hf"])  # read back by pgconvert
    again, exported = load_hf_tensors(tmp_path / "again"), load_hf_tensors(bridge["exported"])
    assert sorted(again) == sorted(exported) and all(torch.equal(exported[key], again[key]) for key in exported)
    load_bridge_lora(bridge["megatron"], back / "release", tmp_path / "loaded", DIM, ALPHA)
    for rank in range(2):
        held = torch.load(bridge["held"] / f"rank{rank}.pt", weights_only=True)
        loaded = torch.load(tmp_path / "loaded" / f"rank{rank}.pt", weights_only=True)
        assert all(torch.equal(held[module][side], loaded[module][side]) for module in held for side in held[module])


def test_a_peft_adapter_becomes_a_megatron_bridge_adapter_megatron_core_loads(bridge: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    """An adapter PEFT made on the HF model (q_proj alone of q/k/v, up_proj alone of gate/up: the others' rows are
    zero, their lora_A the one present), written as Megatron-Bridge's and loaded by megatron-core at TP1: the
    Megatron-side merge computes PEFT's logits."""
    from support.mcore_bridge_lora import load_bridge_lora
    from support.peft_adapters import make_adapter

    adapter = make_adapter(bridge["hf"], tmp_path / "peft", seed=4, r=2, lora_alpha=5,
                           target_modules=["q_proj", "o_proj", "up_proj", "down_proj"])
    pgconvert.convert(bridge["hf"], tmp_path / "tp1", dst_format="megatron", dst_tp=1)
    result = CliRunner().invoke(main, ["export-adapter", str(adapter), str(tmp_path / "lora"), "--base",
                                       str(tmp_path / "tp1")])
    assert result.exit_code == 0 and "16 LoRA pairs (megatron-bridge)" in result.output, result.output
    load_bridge_lora(tmp_path / "tp1", tmp_path / "lora" / "release", tmp_path / "held", 2, 5)
    ids = input_ids(1000)
    paths = {"hf": bridge["hf"], "megatron": tmp_path / "tp1", "held": tmp_path / "held"}
    torch.testing.assert_close(peft_logits(bridge["hf"], adapter, ids), megatron_merged_logits(paths, ids, 5 / 2),
                               rtol=1e-5, atol=1e-5)


def test_a_peft_adapter_with_no_exact_megatron_bridge_form_is_refused(bridge: dict[str, Path], tmp_path: Path) -> None:
    """PEFT trains q_proj, k_proj and v_proj with a lora_A each; Megatron-Bridge's linear_qkv has one."""
    from support.peft_adapters import make_adapter

    adapter = make_adapter(bridge["hf"], tmp_path / "peft", r=2, lora_alpha=4, target_modules=["q_proj", "k_proj"])
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export-adapter", str(adapter), str(out), "--base", str(bridge["megatron"])])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert _matches(r"model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj have different lora_A: "
                    r"Megatron-Bridge's one linear_in of decoder.layers.0.self_attention.linear_qkv cannot hold them",
                    result.output), result.output
    assert not out.exists() and not list(tmp_path.glob(".out*"))


# --------------------------------------------------------------------------- bad adapters


def _copy(bridge: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(bridge["lora"], tmp_path / "bad_lora"))


def _edit_run_config(lora: Path, **changes: object) -> None:
    import yaml

    path = next(lora.glob("iter_*")) / "run_config.yaml"
    doc = yaml.safe_load(path.read_text())
    for key, value in changes.items():
        if value is None:
            doc["peft"].pop(key)
        else:
            doc["peft"][key] = value
    path.write_text(yaml.safe_dump(doc))


def _narrow_linear_out(tensors: dict[str, torch.Tensor]) -> None:
    key = "decoder.layers.mlp.linear_fc2.adapter.linear_out.weight"
    tensors[key] = tensors[key][:, :, :2].contiguous()


def _layer_nine(tensors: dict[str, torch.Tensor]) -> None:
    """Layer 3's linear_qkv adapter stored under its own key as layer 9's (megatron-core's per-layer naming)."""
    for side in ("in", "out"):
        key = f"decoder.layers.self_attention.linear_qkv.adapter.linear_{side}.weight"
        tensors[f"decoder.layers.9.self_attention.linear_qkv.adapter.linear_{side}.weight"] = tensors[key][3].clone()
        tensors[key] = tensors[key][:3].contiguous()


def _expert_adapter(tensors: dict[str, torch.Tensor]) -> None:
    """An experts' fc1 adapter under a name megatron-core gives no experts' state (SequentialMLP and TEGroupedMLP both
    save theirs under ``mlp.experts.experts.``)."""
    tensors["decoder.layers.mlp.experts.linear_fc1.adapter.linear_in.weight"] = torch.zeros(4, 4, 64)


@pytest.mark.parametrize("damage, expected", [
    (lambda lora: rewrite_store(lora, _narrow_linear_out),
     r"decoder.layers.\d.mlp.linear_fc2.adapter: linear_in \[4, 128\] and linear_out \[64, 2\] do not make a "
     r"rank-4 pair \(run_config.yaml gives dim=4\)"),
    (lambda lora: rewrite_store(lora, _layer_nine),
     r"adapts \['model.layers.9.self_attn.k_proj.weight', .*which the model \(LlamaForCausalLM, 4 layers\) does not "
     r"have"),
    (lambda lora: rewrite_store(lora, _expert_adapter),
     r"decoder.layers.mlp.experts.linear_fc1.adapter.linear_in.weight: not a LoRA adapter key of a decoder or MTP "
     r"layer .*a routed experts' module mlp.experts.experts.linear_fc1/2"),
    (lambda lora: _edit_run_config(lora, alpha=None), r"run_config.yaml: peft.alpha is missing: expected a positive"),
    (lambda lora: _edit_run_config(lora, _target_="megatron.bridge.peft.dora.DoRA"),
     r"decoder.layers.0.mlp.linear_fc1.adapter.weight_magnitude is missing: a DoRA run saves one magnitude per output "
     r"row \(256\)"),
    (lambda lora: _edit_run_config(lora, _target_="megatron.bridge.peft.multi_lora.MultiLoRA"),
     r"peft._target_='megatron.bridge.peft.multi_lora.MultiLoRA': only Megatron-Bridge's LoRA, CanonicalLoRA and "
     r"DoRA"),
], ids=["rank", "target", "experts", "alpha", "dora-without-magnitudes", "other-method"])
def test_bad_megatron_adapter_is_a_named_error_and_writes_nothing(bridge: dict[str, Path], tmp_path: Path,
                                                                  damage: object, expected: str) -> None:
    lora = _copy(bridge, tmp_path)
    damage(lora)  # type: ignore[operator]
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export-adapter", str(lora), str(out), "--base", str(bridge["megatron"])])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert str(lora) in result.output and _matches(expected, result.output), result.output
    assert not out.exists() and not list(tmp_path.glob(".out*"))
    result = CliRunner().invoke(main, ["convert", str(bridge["hf"]), str(out), "--dst-format", "hf",
                                       "--merge-adapter", str(lora), "-q"])
    assert result.exit_code == 2 and _matches(expected, result.output), result.output
    assert not out.exists()
    result = CliRunner().invoke(main, ["inspect", str(lora)])
    if "layers.9" not in expected:  # inspect reads the adapter alone: it has no model to miss a layer of
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output


def _matches(pattern: str, output: str) -> bool:
    import re

    return re.search(pattern, " ".join(output.split())) is not None


def test_megatron_adapter_for_another_base_shape_is_refused(bridge: dict[str, Path], tmp_path: Path) -> None:
    other = save_hf_model(build_hf_model("llama", intermediate_size=96), tmp_path / "other_base")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export-adapter", str(bridge["lora"]), str(out), "--base", str(other)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert _matches(r"model.layers.0.mlp.gate_proj.weight: the adapter's delta is \[128, 64\], the model's weight "
                    r"\[96, 64\]: an adapter trained for another base model", result.output), result.output
    assert not out.exists()
