"""--merge-adapter: a LoRA adapter made by PEFT, merged while converting, equals PEFT's own merge_and_unload.

Every adapter here is written by PEFT's ``save_pretrained`` (A and B drawn at random, as a trained
adapter's are); the reference is PEFT's ``merge_and_unload`` computed in float32, saved by
transformers. Bad adapters are named errors and leave no destination.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import pgconvert
from pgconvert.errors import ValidationError
from support.deepseek_helpers import build_deepseek
from support.hf_helpers import build_hf_model, hf_logits, input_ids, load_hf_tensors, save_hf_model
from support.peft_adapters import assert_tensors_equal, edit_config, make_adapter, peft_merged

pytest.importorskip("peft")

ATTENTION_AND_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def changed(base_dir: Path, merged_dir: Path) -> set[str]:
    base, merged = load_hf_tensors(base_dir), load_hf_tensors(merged_dir)
    return {name for name in base if not torch.equal(base[name], merged[name])}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama, a PEFT adapter on every projection (one module of another rank, one of another alpha)
    and PEFT's merge of it."""
    root = tmp_path_factory.mktemp("llama_lora")
    base = save_hf_model(build_hf_model("llama", seed=2), root / "base")
    adapter = make_adapter(base, root / "adapter", r=4, lora_alpha=8, target_modules=ATTENTION_AND_MLP,
                           rank_pattern={"layers.1.self_attn.q_proj": 2}, alpha_pattern={"down_proj": 3})
    return {"base": base, "adapter": adapter, "merged": peft_merged(base, adapter, root / "merged")}


def test_merged_llama_equals_peft_merge_and_unload(llama: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    pgconvert.convert(llama["base"], out, dst_format="hf", merge_adapter=llama["adapter"])
    assert_tensors_equal(llama["merged"], out)
    assert len(changed(llama["base"], out)) == 4 * 7  # every adapted projection of the four layers, nothing else
    ids = input_ids(1000)
    torch.testing.assert_close(hf_logits(out, ids), hf_logits(llama["merged"], ids), rtol=1e-6, atol=1e-6)
    recorded = json.loads((out / "pgconvert.json").read_text())["options"]["merge_adapter"]
    assert recorded == str(llama["adapter"].resolve())


def test_merging_at_tp2_pp2_writes_the_merged_pieces(llama: dict[str, Path], tmp_path: Path) -> None:
    """The delta is cut by each piece's own rule (q/k/v regrouped by query group, gate/up halves, row-parallel
    columns): converting the TP2/PP2 output back gives PEFT's merge exactly."""
    megatron = tmp_path / "megatron"
    pgconvert.convert(llama["base"], megatron, dst_format="megatron", dst_tp=2, dst_pp=2,
                      merge_adapter=llama["adapter"])
    back = tmp_path / "back"
    pgconvert.convert(megatron, back, dst_format="hf")
    assert_tensors_equal(llama["merged"], back)


def test_bf16_merge_is_peft_float32_merge_rounded_once(llama: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base_bf16"
    AutoModelForCausalLM.from_pretrained(llama["base"], dtype=torch.bfloat16).save_pretrained(base)
    reference = peft_merged(base, llama["adapter"], tmp_path / "reference", dtype=torch.bfloat16)
    out = tmp_path / "out"
    pgconvert.convert(base, out, dst_format="hf", merge_adapter=llama["adapter"])
    assert_tensors_equal(reference, out)
    assert next(iter(load_hf_tensors(out).values())).dtype == torch.bfloat16


def test_qwen3_moe_attention_and_experts_adapter_merges_at_tp2_ep2(tmp_path: Path) -> None:
    """An rsLoRA adapter (alpha / sqrt(r)) on the attention and the MLP of a Qwen3-MoE model, merged into a
    TP2/EP2 Megatron checkpoint. PEFT turns the MLP targets of an MoE model into target_parameters on
    transformers' fused experts (gate_up_proj at twice the rank and alpha, down_proj nested around it)."""
    base = save_hf_model(build_hf_model("qwen3_moe", seed=4), tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter", seed=1, r=4, lora_alpha=16, use_rslora=True,
                           target_modules=ATTENTION_AND_MLP)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["down_proj", "gate_up_proj"]
    reference = peft_merged(base, adapter, tmp_path / "reference")
    # 3 MoE layers x 4 experts x gate, up and down; the dense layer's MLP PEFT leaves alone; q, k, v, o x 4
    assert len(changed(base, reference)) == 3 * 4 * 3 + 4 * 4
    megatron = tmp_path / "megatron"
    pgconvert.convert(base, megatron, dst_format="megatron", dst_tp=2, dst_ep=2, merge_adapter=adapter)
    back = tmp_path / "back"
    pgconvert.convert(megatron, back, dst_format="hf")
    assert_tensors_equal(reference, back)


def test_deepseek_v3_mla_and_experts_adapter_merges_at_tp2_ep2(tmp_path: Path) -> None:
    """MLA's low-rank projections (fused kv_a_proj_with_mqa included) and the routed experts' fused parameters."""
    base = build_deepseek("v3", seed=3)
    base.save_pretrained(tmp_path / "base")
    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
               "down_proj"]
    adapter = make_adapter(tmp_path / "base", tmp_path / "adapter", seed=2, r=2, lora_alpha=4,
                           target_modules=targets)
    reference = peft_merged(tmp_path / "base", adapter, tmp_path / "reference")
    assert sum(".experts." in name for name in changed(tmp_path / "base", reference)) == 3 * 8 * 3  # MoE layers 1-3
    megatron = tmp_path / "megatron"
    pgconvert.convert(tmp_path / "base", megatron, dst_format="megatron", dst_tp=2, dst_ep=2, merge_adapter=adapter)
    back = tmp_path / "back"
    pgconvert.convert(megatron, back, dst_format="hf")
    assert_tensors_equal(reference, back)


def _bad_copy(adapter: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(adapter, tmp_path / "bad_adapter"))


def _rename_keys(adapter: Path, old: str, new: str) -> None:
    from safetensors.torch import load_file, save_file

    path = adapter / "adapter_model.safetensors"
    tensors = {name.replace(old, new): value for name, value in load_file(str(path)).items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("damage, expected", [
    (lambda a: edit_config(a, r=8), r"down_proj: lora_A \[4, 128\] and lora_B \[64, 4\] do not make a rank-8 pair"),
    (lambda a: edit_config(a, lora_alpha=None), "lora_alpha is missing: expected a positive number"),
    (lambda a: _rename_keys(a, "layers.3.", "layers.9."), r"adapts \['model.layers.9.mlp.down_proj.weight', .*which the "
                                                          r"model \(LlamaForCausalLM, 4 layers\) does not have"),
    (lambda a: edit_config(a, use_dora=True), r"use_dora: true, but no base_model.model.model.layers.0.mlp.down_proj"
                                               r".lora_magnitude_vector"),
    (lambda a: edit_config(a, init_lora_weights="pissa"), "init_lora_weights='pissa': this initialisation changed"),
    (lambda a: edit_config(a, peft_type="IA3"), "peft_type='IA3': only LORA adapters are merged"),
], ids=["rank", "alpha", "target", "dora", "pissa", "ia3"])
def test_bad_adapter_is_a_named_error_and_writes_nothing(llama: dict[str, Path], tmp_path: Path, damage: object,
                                                         expected: str) -> None:
    adapter = _bad_copy(llama["adapter"], tmp_path)
    damage(adapter)  # type: ignore[operator]
    out = tmp_path / "out"
    with pytest.raises(ValidationError, match=expected) as caught:
        pgconvert.convert(llama["base"], out, dst_format="hf", merge_adapter=adapter)
    assert str(adapter) in str(caught.value)
    assert not out.exists()


def test_adapter_for_another_base_shape_is_refused(llama: dict[str, Path], tmp_path: Path) -> None:
    other = save_hf_model(build_hf_model("llama", intermediate_size=96), tmp_path / "other_base")
    adapter = make_adapter(other, tmp_path / "adapter", r=2, lora_alpha=2, target_modules=["down_proj"])
    with pytest.raises(ValidationError, match=r"down_proj.weight: the adapter's delta is \[64, 96\], the model's "
                                              r"weight \[64, 128\]: an adapter trained for another base model"):
        pgconvert.convert(llama["base"], tmp_path / "out", dst_format="hf", merge_adapter=adapter)
    assert not (tmp_path / "out").exists()


def test_merge_adapter_from_the_command_line(llama: dict[str, Path], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from pgconvert.cli import main

    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(llama["base"]), str(out), "--dst-format", "hf",
                                       "--merge-adapter", str(llama["adapter"]), "-q"])
    assert result.exit_code == 0, result.output
    assert_tensors_equal(llama["merged"], out)
    bad = _bad_copy(llama["adapter"], tmp_path)
    edit_config(bad, r=8)
    result = CliRunner().invoke(main, ["convert", str(llama["base"]), str(tmp_path / "out2"), "--dst-format", "hf",
                                       "--merge-adapter", str(bad), "-q"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "do not make a rank-8 pair" in result.output


def test_adapter_merges_into_a_megatron_lm_checkpoint_without_its_optimizer_state(tmp_path: Path) -> None:
    """Megatron-LM's own TP2 DP2 run (distributed optimizer): the adapter is made by PEFT on its HF form, mapped
    onto the Megatron tensors through the inferred family; the optimizer state, the base model's, is not carried
    (named, and refused under --strict)."""
    from pgconvert.errors import StrictModeError
    from support.format_outputs import DISTRIBUTED_OPTIMIZER_RUN

    as_hf = tmp_path / "as_hf"
    pgconvert.convert(DISTRIBUTED_OPTIMIZER_RUN, as_hf, dst_format="hf", dst_tp=1)
    adapter = make_adapter(as_hf, tmp_path / "adapter", seed=5, r=2, lora_alpha=4, target_modules=ATTENTION_AND_MLP)
    with pytest.raises(StrictModeError, match="--merge-adapter .*: the optimizer state .* is the base model's"):
        pgconvert.convert(DISTRIBUTED_OPTIMIZER_RUN, tmp_path / "strict", dst_tp=1, merge_adapter=adapter, strict=True)
    assert not (tmp_path / "strict").exists()
    megatron = tmp_path / "megatron"
    report = pgconvert.convert(DISTRIBUTED_OPTIMIZER_RUN, megatron, dst_tp=1, merge_adapter=adapter)
    assert any("--merge-adapter" in notice and "base model's" in notice for notice in report.notices), report.notices
    back = tmp_path / "back"
    pgconvert.convert(megatron, back, dst_format="hf")
    assert_tensors_equal(peft_merged(as_hf, adapter, tmp_path / "reference", dtype=torch.bfloat16), back)


def test_inspect_describes_an_adapter_and_fails_on_a_bad_one(llama: dict[str, Path], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from pgconvert.cli import main

    result = CliRunner().invoke(main, ["inspect", str(llama["adapter"]), "--json"])
    assert result.exit_code == 0, result.output
    described = json.loads(result.output)
    assert described["format"] == "peft-lora" and described["ok"]
    adapter = described["adapter"]
    # r=4, alpha 8 everywhere but layer 1's q_proj (rank 2: 8 / 2) and every down_proj (alpha 3: 3 / 4)
    assert (adapter["pairs"], adapter["ranks"], adapter["scalings"]) == (4 * 7, [2, 4], [0.75, 2.0, 4.0])
    assert adapter["modules"] == sorted(f"{part}.{name}" for part, names in (
        ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))
        for name in names)
    assert adapter["layers"] == [0, 1, 2, 3] and adapter["saved_weights"] == []
    bad = _bad_copy(llama["adapter"], tmp_path)
    edit_config(bad, use_dora=True)
    result = CliRunner().invoke(main, ["inspect", str(bad)])
    assert result.exit_code == 1 and "use_dora: true, but no" in result.output and "Traceback" not in result.output


def test_verify_merges_the_adapter_into_a_before_comparing(llama: dict[str, Path], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from pgconvert.cli import main

    megatron = tmp_path / "megatron"
    pgconvert.convert(llama["base"], megatron, dst_format="megatron", dst_tp=2, merge_adapter=llama["adapter"])
    merged = ["verify", str(llama["base"]), str(megatron), "--merge-adapter", str(llama["adapter"])]
    result = CliRunner().invoke(main, merged)
    assert result.exit_code == 0, result.output
    assert "tensors compared (bit-exact): equal" in result.output
    result = CliRunner().invoke(main, merged[:3])  # the base alone differs in every adapted canonical tensor:
    assert result.exit_code == 1 and "16 tensor differences" in result.output  # linear_qkv, proj, fc1, fc2 x 4


def test_mixtral_experts_adapter_finds_its_tensors_under_their_stored_names(tmp_path: Path) -> None:
    """transformers loads Mixtral's block_sparse_moe as mlp, and PEFT names the adapter's modules so (its w1, w3
    and w2 targets become the fused experts' parameters)."""
    base = save_hf_model(build_hf_model("mixtral", seed=6), tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter", seed=3, r=2, lora_alpha=4,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"])
    reference = peft_merged(base, adapter, tmp_path / "reference")
    assert sum(".experts." in name for name in changed(base, reference)) == 4 * 8 * 3
    out = tmp_path / "out"
    pgconvert.convert(base, out, dst_format="hf", merge_adapter=adapter)
    assert_tensors_equal(reference, out)


def test_embedding_and_output_layer_adapters_merge_at_any_vocab_padding(llama: dict[str, Path], tmp_path: Path) -> None:
    """LoRA on embed_tokens (lora_embedding_A/B, delta (B @ A)^T) and lm_head (a Linear pair), with the base weights
    PEFT saves beside them: merged at TP2, where Megatron pads the vocab tables, the padding rows untouched."""
    adapter = make_adapter(llama["base"], tmp_path / "adapter", seed=7, r=2, lora_alpha=4,
                           target_modules=["q_proj", "embed_tokens", "lm_head"])
    keys = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    assert sorted(keys) == ["embed_tokens", "lm_head", "q_proj"]
    reference = peft_merged(llama["base"], adapter, tmp_path / "reference")
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= changed(llama["base"], reference)
    megatron = tmp_path / "megatron"
    pgconvert.convert(llama["base"], megatron, dst_format="megatron", dst_tp=2, merge_adapter=adapter)
    back = tmp_path / "back"
    pgconvert.convert(megatron, back, dst_format="hf")
    assert_tensors_equal(reference, back)


def test_modules_to_save_take_the_place_of_the_models_weights(llama: dict[str, Path], tmp_path: Path) -> None:
    """modules_to_save (a trained copy of the output layer and of one layer's input norm) replace the model's; the
    LoRA pairs beside them still merge."""
    adapter = make_adapter(llama["base"], tmp_path / "adapter", seed=8, r=2, lora_alpha=4, target_modules=["v_proj"],
                           modules_to_save=["lm_head", "layers.2.input_layernorm"])
    reference = peft_merged(llama["base"], adapter, tmp_path / "reference")
    assert {"lm_head.weight", "model.layers.2.input_layernorm.weight"} <= changed(llama["base"], reference)
    out = tmp_path / "out"
    pgconvert.convert(llama["base"], out, dst_format="megatron", dst_tp=2, dst_pp=2, merge_adapter=adapter)
    pgconvert.convert(out, tmp_path / "back", dst_format="hf")
    assert_tensors_equal(reference, tmp_path / "back")


def test_an_adapter_for_a_resized_vocabulary_is_refused(llama: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    resized = tmp_path / "resized"
    model = AutoModelForCausalLM.from_pretrained(llama["base"], dtype=torch.float32)
    model.resize_token_embeddings(1010)
    model.save_pretrained(resized)
    adapter = make_adapter(resized, tmp_path / "adapter", r=2, lora_alpha=4, target_modules=["embed_tokens"])
    with pytest.raises(ValidationError, match=r"model.embed_tokens.weight: the adapter's (delta|saved weight) is "
                                              r"\[1010, 64\], the model's weight \[1000, 64\]"):
        pgconvert.convert(llama["base"], tmp_path / "out", dst_format="hf", merge_adapter=adapter)
    assert not (tmp_path / "out").exists()


def test_shards_and_workers_merge_the_adapter_as_one_process_does(llama: dict[str, Path], tmp_path: Path) -> None:
    """Each process of a sharded run (and each --workers process) attaches the adapter while planning: the output
    is the single process's, byte for byte."""
    from click.testing import CliRunner
    from support.format_outputs import assert_same_bytes

    from pgconvert.cli import main

    def run(dst: Path, *flags: str) -> None:
        result = CliRunner().invoke(main, ["convert", "-q", "--dst-format", "megatron", "--dst-tp", "2", "--dst-pp", "2",
                                           "--merge-adapter", str(llama["adapter"]), *flags, str(llama["base"]),
                                           str(dst)])
        assert result.exit_code == 0, result.output

    run(tmp_path / "single")
    run(tmp_path / "sharded", "--shard-index", "1", "--num-shards", "2")
    run(tmp_path / "sharded", "--shard-index", "0", "--num-shards", "2")
    run(tmp_path / "workers", "--workers", "2")
    assert_same_bytes(tmp_path / "sharded", tmp_path / "single")
    assert_same_bytes(tmp_path / "workers", tmp_path / "single")
    base = tmp_path / "base_only"
    run_plain = CliRunner().invoke(main, ["convert", "-q", "--dst-format", "megatron", "--dst-tp", "2", "--dst-pp", "2",
                                          str(llama["base"]), str(base)])
    assert run_plain.exit_code == 0, run_plain.output
    with pytest.raises(AssertionError):  # the check sees the adapter: the base alone writes other bytes
        assert_same_bytes(base, tmp_path / "single")


def test_an_adapter_left_beside_the_model_as_verl_leaves_it_is_named_until_merged(llama: dict[str, Path],
                                                                                 tmp_path: Path) -> None:
    # verl's model merger saves a LoRA run as the base model with its adapter, unmerged, in lora_adapter/ beside it
    run = Path(shutil.copytree(llama["base"], tmp_path / "verl_hf"))
    shutil.copytree(llama["adapter"], run / "lora_adapter")
    plain = pgconvert.convert(run, tmp_path / "plain", dst_format="hf")
    named = [notice for notice in plain.notices if "lora_adapter: a PEFT LoRA adapter beside this model is not merged"
             in notice and f"--merge-adapter {run / 'lora_adapter'}" in notice]
    assert len(named) == 1, plain.notices
    assert_tensors_equal(llama["base"], tmp_path / "plain")
    merged = pgconvert.convert(run, tmp_path / "merged", dst_format="hf", merge_adapter=run / "lora_adapter")
    assert not any("beside this model" in notice for notice in merged.notices), merged.notices
    assert_tensors_equal(llama["merged"], tmp_path / "merged")
