"""A Megatron checkpoint that holds a LoRA adapter beside its base model: refused by name by a plain conversion, its
adapter merged by ``--merge-adapter`` naming the checkpoint itself, taken out by ``export-adapter``, left out by
``--drop-adapter``, and described by ``inspect``.

The checkpoint is made by megatron-core 0.16.1 as Megatron-Bridge saves a LoRA run's model with no adapter filter
(``support/mcore_bridge_lora.py`` names the Megatron-Bridge lines): the TP2 model of a tiny Llama, each layer's
linear_qkv, linear_proj, linear_fc1 and linear_fc2 wrapped with a ParallelLinearAdapter, the whole wrapped model's
sharded state dict (the base under its plain names, the adapter under ``<module>.adapter.``) saved with
``dist_checkpointing.save`` on two gloo ranks, run_config.yaml beside it. The same run's adapter-only checkpoint
(the same adapter values) is the reference: what pgconvert already reads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import pgconvert
from pgconvert.cli import main
from support.hf_helpers import build_hf_model, hf_logits, input_ids, load_hf_tensors, save_hf_model

pytest.importorskip("peft")

DIM, ALPHA = 4, 6


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The HF base, its TP2 Megatron form, the LoRA run's checkpoint saved whole and adapter-only (one megatron-core
    job each), and the adapter-only checkpoint's PEFT export."""
    from support.mcore_bridge_lora import bridge_lora_checkpoint

    root = tmp_path_factory.mktemp("embedded_lora")
    hf = save_hf_model(build_hf_model("llama", seed=2), root / "hf")
    pgconvert.convert(hf, root / "megatron", dst_format="megatron", dst_tp=2)
    full = bridge_lora_checkpoint(root / "megatron", root / "full", root / "held_full", DIM, ALPHA, whole=True)
    lora = bridge_lora_checkpoint(root / "megatron", root / "lora", root / "held", DIM, ALPHA)
    exported = root / "exported"
    pgconvert.export_adapter(lora, exported, base=root / "megatron")
    return {"hf": hf, "megatron": root / "megatron", "full": full, "lora": lora, "exported": exported,
            "held": root / "held", "held_full": root / "held_full"}


def test_the_checkpoint_holds_the_base_and_the_adapter_only_runs_adapter(run: dict[str, Path]) -> None:
    """What the fixture is: the base's keys under their plain names beside the adapter's, whose values are the
    adapter-only checkpoint's on every rank."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(next(run["full"].glob("iter_*")))).read_metadata().state_dict_metadata
    assert "decoder.layers.self_attention.linear_qkv.weight" in keys and not any("to_wrap" in key for key in keys)
    assert "decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight" in keys
    for rank in range(2):
        held = torch.load(run["held"] / f"rank{rank}.pt", weights_only=True)
        held_full = torch.load(run["held_full"] / f"rank{rank}.pt", weights_only=True)
        assert all(torch.equal(held[module][side], held_full[module][side])
                   for module in held for side in held[module])


def _matches(pattern: str, output: str) -> bool:
    return re.search(pattern, " ".join(output.split())) is not None


def test_a_plain_conversion_is_refused_by_name_and_writes_nothing(run: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(run["full"]), str(out), "--dst-format", "hf", "-q"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    store = str(next(run["full"].glob("iter_*")))
    assert _matches(rf"{re.escape(store)}: holds a LoRA adapter beside the model \(8 adapter keys, e.g. "
                    r"decoder.layers.mlp.linear_fc1.adapter.linear_in.weight\): pass --merge-adapter "
                    rf"{re.escape(store)} to merge it, --drop-adapter to convert the base model alone, or take the "
                    rf"adapter out with 'pgconvert export-adapter {re.escape(store)} DST'",
                    result.output), result.output
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_merge_adapter_names_the_checkpoint_itself(run: dict[str, Path], tmp_path: Path) -> None:
    """The embedded adapter merged: the same tensors as the adapter-only checkpoint merged into the base, and the
    logits of PEFT's own merge of the exported adapter; at a Megatron TP1 destination too, which verify
    --merge-adapter checks against the checkpoint."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    pgconvert.convert(run["full"], tmp_path / "merged", dst_format="hf", merge_adapter=run["full"])
    pgconvert.convert(run["megatron"], tmp_path / "reference", dst_format="hf", merge_adapter=run["lora"])
    expected, actual = load_hf_tensors(tmp_path / "reference"), load_hf_tensors(tmp_path / "merged")
    assert sorted(expected) == sorted(actual)
    assert all(torch.equal(expected[name], actual[name]) for name in expected)
    ids = input_ids(1000)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run["hf"], dtype=torch.float32),
                                           run["exported"]).merge_and_unload()
    torch.testing.assert_close(hf_logits(tmp_path / "merged", ids), hf_logits(peft_model, ids), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(hf_logits(run["hf"], ids), hf_logits(peft_model, ids), rtol=1e-3, atol=1e-3)
    pgconvert.convert(run["full"], tmp_path / "tp1", dst_format="megatron", dst_tp=1, merge_adapter=run["full"])
    pgconvert.convert(tmp_path / "tp1", tmp_path / "back", dst_format="hf")
    back = load_hf_tensors(tmp_path / "back")
    assert all(torch.equal(expected[name], back[name]) for name in expected)
    report = pgconvert.verify(run["full"], tmp_path / "tp1", merge_adapter=run["full"])
    assert report.equal and report.compared > 0, report.to_dict()


def test_export_adapter_takes_the_adapter_out(run: dict[str, Path], tmp_path: Path) -> None:
    """Without --base the checkpoint is its own base; with it, the same: the adapter-only checkpoint's export."""
    from safetensors.torch import load_file

    expected = load_file(str(run["exported"] / "adapter_model.safetensors"))
    result = CliRunner().invoke(main, ["export-adapter", str(run["full"]), str(tmp_path / "own")])
    assert result.exit_code == 0 and "28 LoRA pairs (peft)" in result.output, result.output
    pgconvert.export_adapter(run["full"], tmp_path / "based", base=run["megatron"])
    for out in ("own", "based"):
        actual = load_file(str(tmp_path / out / "adapter_model.safetensors"))
        assert sorted(actual) == sorted(expected)
        assert all(torch.equal(expected[key], actual[key]) for key in expected)
        config = json.loads((tmp_path / out / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"]) == (DIM, ALPHA)


def test_drop_adapter_converts_the_base_alone(run: dict[str, Path], tmp_path: Path) -> None:
    report = pgconvert.convert(run["full"], tmp_path / "base", dst_format="hf", drop_adapter=True)
    assert any("is left out (--drop-adapter)" in notice for notice in report.notices), report.notices
    expected, actual = load_hf_tensors(run["hf"]), load_hf_tensors(tmp_path / "base")
    assert sorted(expected) == sorted(actual)
    assert all(torch.equal(expected[name], actual[name]) for name in expected)
    verified = pgconvert.verify(run["full"], tmp_path / "base")
    assert verified.equal and any("the base model alone is compared" in note for note in verified.notes), \
        verified.to_dict()


def test_inspect_describes_the_model_and_its_adapter(run: dict[str, Path]) -> None:
    result = CliRunner().invoke(main, ["inspect", str(run["full"]), "--json"])
    assert result.exit_code == 0, result.output
    described = json.loads(result.output)
    assert described["format"] == "torch_dist" and described["ok"]
    assert described["layout"]["tp"] == 2 and described["model_config"]["num_layers"] == 4
    adapter = described["adapter"]
    assert (adapter["pairs"], adapter["ranks"], adapter["scalings"], adapter["layers"]) == (16, [DIM], [1.5],
                                                                                            [0, 1, 2, 3])
    assert any("holds a LoRA adapter beside the model" in notice for notice in described["notices"])


@pytest.mark.parametrize("source, options, expected", [
    ("megatron", ["--drop-adapter"], r"--drop-adapter: .* holds no LoRA adapter beside its model"),
    ("full", ["--drop-adapter", "--merge-adapter", "FULL"], r"with --drop-adapter: the adapter .* holds is either "
                                                              r"merged or left out"),
    ("full", ["--merge-adapter", "LORA"], r"holds a LoRA adapter beside the model"),
], ids=["nothing-to-drop", "merge-and-drop", "another-adapter"])
def test_contradictory_adapter_options_are_refused(run: dict[str, Path], tmp_path: Path, source: str,
                                                   options: list[str], expected: str) -> None:
    """--drop-adapter where there is nothing to drop, merged and dropped at once, or another adapter merged over a
    base whose own adapter would be lost without a word."""
    out = tmp_path / "out"
    given = [{"FULL": str(run["full"]), "LORA": str(run["lora"])}.get(option, option) for option in options]
    result = CliRunner().invoke(main, ["convert", str(run[source]), str(out), "--dst-format", "hf", "-q", *given])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert _matches(expected, result.output), result.output
    assert not out.exists()


def test_export_adapter_of_an_adapter_alone_needs_a_base(run: dict[str, Path], tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["export-adapter", str(run["lora"]), str(tmp_path / "out")])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert _matches(r"holds an adapter alone, not its base model: name the model it was trained on with --base",
                    result.output), result.output
    assert not (tmp_path / "out").exists()


def test_a_rank_file_holding_an_adapter_is_refused_by_name(run: dict[str, Path], tmp_path: Path) -> None:
    """Per-rank files with a wrapped model's adapter keys (its ``state_dict``, adapter_wrapper.py:204-229: the base
    under its plain names, the adapter under ``<module>.adapter.``): not read, and said so, nothing written."""
    import shutil

    from pgconvert.formats.megatron import FRAMEWORK_PICKLE
    from support.megatron_fixtures import load_for_test

    megatron = Path(shutil.copytree(run["megatron"], tmp_path / "megatron"))
    for path in sorted(megatron.glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        state = load_for_test(path)
        state["model"]["decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight"] = torch.zeros(2, 64)
        torch.save(state, path, pickle_module=FRAMEWORK_PICKLE)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(megatron), str(out), "--dst-format", "hf", "-q"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert _matches(r"model_optim_rng.pt: holds LoRA adapter keys beside the model \(1, e.g. "
                    r"decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight\): an adapter is read beside "
                    r"its model from a torch_dist checkpoint only", result.output), result.output
    assert not out.exists()
