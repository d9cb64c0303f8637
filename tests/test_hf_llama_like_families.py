"""Qwen2-MoE, Granite, SmolLM3, Ministral, Phi-3, Seed-OSS, Arcee and Nemotron: HF -> Megatron -> torch_dist -> HF is bit-exact,
the Megatron rank files compute the HF model's logits, and config, generation config and tokenizer files survive.

The fixtures (tests/support/llama_like_helpers.py) switch each family's own options on; the semantic check reads
the TP-sharded rank files and their args with torch.load, never through pgconvert's merge.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from support.hf_helpers import assert_same_hf_tensors, edit_json, hf_logits, load_hf_tensors, read_megatron_tp_ranks
from support.round_trips import assert_round_trip
from support.llama_like_helpers import MODEL_VOCAB, MOE_FAMILIES, build_model, input_ids, megatron_args, reference_logits, save_model

import pgconvert
from pgconvert.errors import CheckpointError, StrictModeError

FAMILIES = ("qwen2_moe", "granitemoe", "granite", "smollm3", "ministral", "phi3", "seed_oss", "arcee", "nemotron")
# The reference forward below computes neither YaRN, squared ReLU nor LayerNorm: Arcee's and Nemotron's Megatron files
# are computed by megatron-core's own forward (tests/test_megatron_core_families.py).
REFERENCE_FAMILIES = tuple(family for family in FAMILIES if family not in ("arcee", "nemotron"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family_sources")
    return {name: save_model(build_model(name, seed=3), root / name) for name in FAMILIES}


def _layout(family: str, pp: int) -> dict[str, int]:
    return {"dst_tp": 2, "dst_pp": pp, "dst_ep": 2 if family in MOE_FAMILIES else 1}


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_megatron_to_torch_dist_to_hf_is_bit_exact_with_the_same_files_and_logits(
        sources: dict[str, Path], tmp_path: Path, family: str) -> None:
    assert_round_trip(sources[family], tmp_path, input_ids(), **_layout(family, pp=2))


def _megatron_logits(src: Path, dst: Path, family: str) -> torch.Tensor:
    pgconvert.convert(src, dst, dst_format="megatron", **_layout(family, pp=1))
    return reference_logits(read_megatron_tp_ranks(dst), megatron_args(dst), input_ids())


@pytest.mark.parametrize("family", REFERENCE_FAMILIES)
def test_megatron_tp_shards_and_args_compute_the_hf_models_logits(sources: dict[str, Path], tmp_path: Path,
                                                                  family: str) -> None:
    src = sources[family]

    actual = _megatron_logits(src, tmp_path / "megatron", family)

    expected = hf_logits(src, input_ids()).to(torch.float64)
    assert actual.shape == (2, 12, MODEL_VOCAB)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


# --- Qwen2-MoE ------------------------------------------------------------------------------------

def test_qwen2_moe_megatron_args_hold_the_shared_expert_gate_layers_window_and_router(
        sources: dict[str, Path], tmp_path: Path) -> None:
    pgconvert.convert(sources["qwen2_moe"], tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)

    args = megatron_args(tmp_path / "megatron")

    assert (args.moe_shared_expert_intermediate_size, args.moe_shared_expert_gate) == (48, True)
    assert (args.moe_layer_freq, args.moe_router_pre_softmax, args.add_qkv_bias) == ([1, 1, 0, 1], True, True)
    assert (args.window_size, args.window_attn_skip_freq) == ((4, 0), [1, 0, 1, 0])


def test_reference_forward_is_sensitive_to_the_shared_expert_gate(sources: dict[str, Path], tmp_path: Path) -> None:
    """Without the sigmoid gate the Megatron model computes other logits: the check sees the gate."""
    pgconvert.convert(sources["qwen2_moe"], tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)
    args = megatron_args(tmp_path / "megatron")
    args.moe_shared_expert_gate = False

    actual = reference_logits(read_megatron_tp_ranks(tmp_path / "megatron"), args, input_ids())

    expected = hf_logits(sources["qwen2_moe"], input_ids()).to(torch.float64)
    assert not torch.allclose(actual, expected, rtol=1e-4, atol=1e-4)


def written_from_args_alone(src: Path, tmp_path: Path, **megatron_layout: int) -> dict[str, Any]:
    """``src`` converted to Megatron at ``megatron_layout``, the hf/ folder it carries removed, then converted to
    HF (``tmp_path / "hf"``) from the Megatron args alone: the config.json written."""
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", **megatron_layout)
    shutil.rmtree(tmp_path / "megatron" / "hf")
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1, dst_ep=1)
    return json.loads((tmp_path / "hf" / "config.json").read_text())


def test_native_megatron_qwen2_moe_without_carried_config_is_written_as_qwen2_moe(
        sources: dict[str, Path], tmp_path: Path) -> None:
    """The Megatron checkpoint's hf/ folder removed: the family is inferred from args alone."""
    src = sources["qwen2_moe"]
    written = written_from_args_alone(src, tmp_path, dst_tp=2, dst_ep=2)
    assert written["architectures"] == ["Qwen2MoeForCausalLM"]
    assert (written["shared_expert_intermediate_size"], written["mlp_only_layers"]) == (48, [2])
    assert written["norm_topk_prob"] is False and written["layer_types"][:2] == ["sliding_attention", "full_attention"]
    assert_same_hf_tensors(src, tmp_path / "hf")
    ids = input_ids()
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


def test_qwen2_moe_window_without_layer_types_follows_transformers_default(sources: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    """transformers' own default when layer_types is absent: odd 1-based layers below max_window_layers."""
    from transformers import AutoConfig

    src = tmp_path / "src"
    shutil.copytree(sources["qwen2_moe"], src)
    edit_json(src / "config.json", lambda doc: doc.pop("layer_types"))
    expected = [kind == "sliding_attention" for kind in AutoConfig.from_pretrained(src).layer_types]

    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron")

    assert megatron_args(tmp_path / "megatron").window_attn_skip_freq == [int(v) for v in expected]


# --- Granite -------------------------------------------------------------------------------------

def test_granite_multipliers_are_carried_in_args_and_named_on_every_megatron_output(
        sources: dict[str, Path], tmp_path: Path) -> None:
    report = pgconvert.convert(sources["granite"], tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    reshard = pgconvert.convert(tmp_path / "megatron", tmp_path / "tp1", dst_format="megatron", dst_tp=1)

    for root, notices in ((tmp_path / "megatron", report.notices), (tmp_path / "tp1", reshard.notices)):
        args = megatron_args(root)
        assert (args.softmax_scale, args.embedding_multiplier, args.residual_multiplier, args.logits_scaling) == (
            0.2, 12.0, 0.22, 8.0)
        named = [n for n in notices if "megatron-core has no such setting" in n]
        assert len(named) == 1 and all(f"{key}=" in named[0] for key in (
            "embedding_multiplier", "residual_multiplier", "logits_scaling"))
        manifest = json.loads((root / "pgconvert.json").read_text())
        assert manifest["model_config"]["embedding_multiplier"] == 12.0


def test_strict_refuses_a_megatron_target_that_would_drop_granites_multipliers(
        sources: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(StrictModeError, match="embedding_multiplier=12.0, residual_multiplier=0.22, "
                                              "logits_scaling=8.0: megatron-core has no such setting"):
        pgconvert.convert(sources["granite"], tmp_path / "megatron", dst_format="megatron", strict=True)
    assert not (tmp_path / "megatron").exists()


def test_native_megatron_granite_without_carried_config_is_written_as_granite(
        sources: dict[str, Path], tmp_path: Path) -> None:
    src = sources["granite"]
    written = written_from_args_alone(src, tmp_path, dst_tp=2)
    assert written["architectures"] == ["GraniteForCausalLM"]
    assert {k: written[k] for k in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                                    "logits_scaling")} == {"embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                                                           "attention_multiplier": 0.2, "logits_scaling": 8.0}
    ids = input_ids()
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


def test_granite_model_written_as_llama_is_refused_under_strict_naming_the_multipliers(tmp_path: Path) -> None:
    from pgconvert.model.config import ModelConfig
    from pgconvert.formats.hf import hf_losses

    config = ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2, ffn_hidden_size=8, vocab_size=10,
                         embedding_multiplier=2.0, softmax_scale=0.25)

    assert hf_losses("LlamaForCausalLM", config) == [
        "embedding_multiplier=2.0: LlamaForCausalLM has no such setting",
        "softmax_scale=0.25: LlamaForCausalLM has no such setting",
    ]
    assert hf_losses("GraniteForCausalLM", config) == []


# --- SmolLM3 -------------------------------------------------------------------------------------

def test_smollm3_nope_layers_are_megatron_cores_no_rope_freq(sources: dict[str, Path], tmp_path: Path) -> None:
    """SmolLM3's no_rope_layers (1: RoPE) is the complement of megatron-core's no_rope_freq (1: no RoPE)."""
    report = pgconvert.convert(sources["smollm3"], tmp_path / "megatron", dst_format="megatron", dst_tp=2)

    args = megatron_args(tmp_path / "megatron")
    assert json.loads((sources["smollm3"] / "config.json").read_text())["no_rope_layers"] == [1, 0, 1, 0]
    assert (args.no_rope_freq, args.window_size, args.window_attn_skip_freq) == ([0, 1, 0, 1], (4, 0), [0, 1, 0, 1])
    assert not any("megatron-core has no such setting" in notice for notice in report.notices)


def test_reference_forward_is_sensitive_to_the_nope_layers(sources: dict[str, Path], tmp_path: Path) -> None:
    pgconvert.convert(sources["smollm3"], tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    args = megatron_args(tmp_path / "megatron")
    args.no_rope_freq = None

    actual = reference_logits(read_megatron_tp_ranks(tmp_path / "megatron"), args, input_ids())

    expected = hf_logits(sources["smollm3"], input_ids()).to(torch.float64)
    assert not torch.allclose(actual, expected, rtol=1e-4, atol=1e-4)


def test_native_megatron_smollm3_without_carried_config_is_written_as_smollm3(
        sources: dict[str, Path], tmp_path: Path) -> None:
    src = sources["smollm3"]
    written = written_from_args_alone(src, tmp_path, dst_tp=2)
    assert written["architectures"] == ["SmolLM3ForCausalLM"]
    assert (written["no_rope_layers"], written["layer_types"][:2]) == ([1, 0, 1, 0], ["full_attention",
                                                                                      "sliding_attention"])
    ids = input_ids()
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


def test_smollm3_without_no_rope_layers_uses_transformers_interval_default(sources: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    from transformers import AutoConfig

    src = tmp_path / "src"
    shutil.copytree(sources["smollm3"], src)
    edit_json(src / "config.json", lambda doc: [doc.pop(key) for key in ("no_rope_layers", "layer_types")])
    expected = [1 - flag for flag in AutoConfig.from_pretrained(src).no_rope_layers]

    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron")

    assert megatron_args(tmp_path / "megatron").no_rope_freq == expected == [0, 1, 0, 1]


# --- Ministral -----------------------------------------------------------------------------------

def test_ministral_layer_pattern_is_megatrons_window_attn_skip_freq(sources: dict[str, Path], tmp_path: Path) -> None:
    pgconvert.convert(sources["ministral"], tmp_path / "megatron", dst_format="megatron", dst_tp=2)

    args = megatron_args(tmp_path / "megatron")

    assert (args.window_size, args.window_attn_skip_freq, args.kv_channels) == ((4, 0), [1, 1, 1, 0], 16)


def test_reference_forward_is_sensitive_to_the_window_pattern(sources: dict[str, Path], tmp_path: Path) -> None:
    pgconvert.convert(sources["ministral"], tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    args = megatron_args(tmp_path / "megatron")
    args.window_attn_skip_freq = None  # every layer windowed

    actual = reference_logits(read_megatron_tp_ranks(tmp_path / "megatron"), args, input_ids())

    expected = hf_logits(sources["ministral"], input_ids()).to(torch.float64)
    assert not torch.allclose(actual, expected, rtol=1e-4, atol=1e-4)


def test_native_megatron_model_with_a_partial_window_is_written_as_ministral(
        sources: dict[str, Path], tmp_path: Path) -> None:
    """Llama-like, a window on some layers: Mistral windows all, Llama none, so Ministral it is."""
    src = sources["ministral"]
    written = written_from_args_alone(src, tmp_path, dst_tp=2)
    assert written["architectures"] == ["MinistralForCausalLM"]
    assert (written["sliding_window"], written["layer_types"]) == (
        5, ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])
    ids = input_ids()
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


def test_ministral_without_layer_types_windows_every_layer(sources: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(sources["ministral"], src)
    edit_json(src / "config.json", lambda doc: doc.pop("layer_types"))

    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron")

    args = megatron_args(tmp_path / "megatron")
    assert (args.window_size, args.window_attn_skip_freq) == ((4, 0), None)


# --- Phi-3 / Phi-4 -------------------------------------------------------------------------------

def test_phi3_fused_qkv_is_regrouped_per_query_group_in_megatron(sources: dict[str, Path], tmp_path: Path) -> None:
    """qkv_proj is [q0..q3; k0 k1; v0 v1]; TP rank 1's linear_qkv is group 1: [q2 q3 k1 v1]."""
    from support.hf_helpers import load_hf_tensors

    hf = load_hf_tensors(sources["phi3"])["model.layers.1.self_attn.qkv_proj.weight"]
    pgconvert.convert(sources["phi3"], tmp_path / "megatron", dst_format="megatron", dst_tp=2)

    rank1 = read_megatron_tp_ranks(tmp_path / "megatron")[1]["decoder.layers.1.self_attention.linear_qkv.weight"]
    head = 16
    q, k, v = hf[:64], hf[64:96], hf[96:]
    expected = torch.cat([q[2 * head:4 * head], k[head:2 * head], v[head:2 * head]])
    assert torch.equal(rank1, expected.to(torch.float64))


def test_phi3_longrope_is_carried_in_args_with_a_notice_and_refused_under_strict(
        sources: dict[str, Path], tmp_path: Path) -> None:
    src = sources["phi3"]
    report = pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2)

    args = megatron_args(tmp_path / "megatron")
    carried = json.loads(args.hf_rope_parameters)
    assert (carried["rope_type"], carried["original_max_position_embeddings"]) == ("longrope", 64)
    assert carried["short_factor"] == [1.0, 1.25, 1.5, 1.75, 2.0, 2.25]
    assert (args.rotary_percent, args.window_size) == (0.75, (6, 0))
    assert [n for n in report.notices if "hf_rope_parameters=" in n and "megatron-core has no such setting" in n]
    assert not [n for n in report.notices if "computes plain RoPE" in n]
    with pytest.raises(StrictModeError, match="hf_rope_parameters="):
        pgconvert.convert(src, tmp_path / "strict", dst_format="megatron", strict=True)


def test_native_megatron_phi3_without_carried_config_is_written_as_phi3_with_longrope(
        sources: dict[str, Path], tmp_path: Path) -> None:
    src = sources["phi3"]
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    shutil.rmtree(tmp_path / "megatron" / "hf")

    report = pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)

    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    source = json.loads((src / "config.json").read_text())
    assert written["architectures"] == ["Phi3ForCausalLM"]
    assert written["rope_parameters"] == source["rope_parameters"]
    assert (written["partial_rotary_factor"], written["original_max_position_embeddings"]) == (0.75, 64)
    assert not [n for n in report.notices if "rotary_percent" in n]
    assert_same_hf_tensors(src, tmp_path / "hf")
    ids = input_ids()
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


def test_reference_forward_is_sensitive_to_longrope(sources: dict[str, Path], tmp_path: Path) -> None:
    pgconvert.convert(sources["phi3"], tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    args = megatron_args(tmp_path / "megatron")
    args.hf_rope_parameters = None

    actual = reference_logits(read_megatron_tp_ranks(tmp_path / "megatron"), args, input_ids())

    expected = hf_logits(sources["phi3"], input_ids()).to(torch.float64)
    assert not torch.allclose(actual, expected, rtol=1e-4, atol=1e-4)


# --- Seed-OSS ------------------------------------------------------------------------------------

def test_seed_oss_megatron_args_hold_its_biases_head_dim_rope_base_and_dropouts(
        sources: dict[str, Path], tmp_path: Path) -> None:
    """q/k/v biases without o or MLP biases (add_qkv_bias alone), head_dim 8 with 80 hidden and 20
    heads, RoPE base 1e7; residual_dropout is megatron-core's hidden_dropout."""
    pgconvert.convert(sources["seed_oss"], tmp_path / "megatron", dst_format="megatron", dst_tp=2)

    args = megatron_args(tmp_path / "megatron")
    rank = read_megatron_tp_ranks(tmp_path / "megatron")[0]

    assert (args.add_qkv_bias, args.add_bias_linear, args.kv_channels, args.num_query_groups) == (True, False, 8, 2)
    assert (args.rotary_base, args.attention_dropout, args.hidden_dropout) == (1e7, 0.1, 0.1)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in rank
    assert not [name for name in rank if name.endswith(("linear_proj.bias", "linear_fc1.bias", "linear_fc2.bias"))]


@pytest.mark.parametrize("biases, message", [
    ({"mlp_bias": True}, "attention_out_bias=false, mlp_bias=true: Megatron biases o_proj and the MLP by one "
                         "setting (add_bias_linear); they must agree"),
    ({"attention_out_bias": True}, "attention_out_bias=true, mlp_bias=false"),
    ({"attention_bias": False, "attention_out_bias": True, "mlp_bias": True},
     "attention_bias=false with attention_out_bias and mlp_bias true: Megatron's add_bias_linear biases q, k and v"),
])
def test_seed_oss_biases_megatron_cannot_express_are_refused(sources: dict[str, Path], tmp_path: Path,
                                                             biases: dict[str, bool], message: str) -> None:
    src = Path(shutil.copytree(sources["seed_oss"], tmp_path / "src"))
    edit_json(src / "config.json", lambda doc: doc.update(biases))

    with pytest.raises(CheckpointError, match=re.escape(f"{src / 'config.json'}: {message}")):
        pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron")
    assert not (tmp_path / "megatron").exists()


def test_seed_oss_absent_keys_read_as_seed_oss_configs_defaults(sources: dict[str, Path]) -> None:
    """Without the keys transformers' SeedOssConfig defaults (8 KV heads, head_dim 128, the biases,
    dropout 0.1, 512K positions), pgconvert reads the model transformers builds."""
    from transformers import SeedOssConfig

    from pgconvert.formats.hf import model_config_from_hf

    doc = json.loads((sources["seed_oss"] / "config.json").read_text())
    for key in ("num_key_value_heads", "head_dim", "attention_bias", "attention_out_bias", "mlp_bias",
                "attention_dropout", "residual_dropout", "max_position_embeddings", "rms_norm_eps",
                "tie_word_embeddings"):
        doc.pop(key)
    doc["num_attention_heads"] = 16
    hf = SeedOssConfig(**{key: value for key, value in doc.items() if key != "architectures"})

    _, config, _ = model_config_from_hf(doc, Path("config.json"))

    assert (config.num_query_groups, config.kv_channels, config.add_qkv_bias, config.add_bias_linear) == (
        hf.num_key_value_heads, hf.head_dim, hf.attention_bias, hf.mlp_bias) == (8, 128, True, False)
    assert (config.attention_dropout, config.hidden_dropout, config.max_position_embeddings, config.norm_epsilon,
            config.tie_embeddings) == (hf.attention_dropout, hf.residual_dropout, hf.max_position_embeddings,
                                       hf.rms_norm_eps, hf.tie_word_embeddings)


def test_seed_oss_released_4x_config_spelling_reads_the_same_model(sources: dict[str, Path]) -> None:
    """The release's config.json (transformers 4.55) spells RoPE as rope_theta and rope_scaling."""
    from pgconvert.formats.hf import model_config_from_hf

    doc = json.loads((sources["seed_oss"] / "config.json").read_text())
    released = {key: value for key, value in doc.items() if key != "rope_parameters"}
    released.update(rope_theta=10000000.0, rope_scaling={"rope_type": "default"})

    _, config, notices = model_config_from_hf(released, Path("config.json"))

    assert (config, notices) == model_config_from_hf(doc, Path("config.json"))[1:]
    assert (config.rotary_base, config.rope_scaling) == (1e7, None)


@pytest.fixture(scope="module")
def seed_oss_every_bias(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Seed-OSS with o and MLP biases too (attention_out_bias, mlp_bias): megatron-core's add_bias_linear."""
    root = tmp_path_factory.mktemp("seed_oss_every_bias")
    return save_model(build_model("seed_oss", seed=5, attention_out_bias=True, mlp_bias=True), root / "src")


def test_seed_oss_with_every_bias_round_trips_and_a_native_copy_is_written_as_seed_oss(
        seed_oss_every_bias: Path, tmp_path: Path) -> None:
    """add_qkv_bias with add_bias_linear fits no family before Seed-OSS; the hf/ folder removed,
    the Megatron checkpoint is written as Seed-OSS and computes the same logits."""
    src = seed_oss_every_bias
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=2)
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)
    assert_same_hf_tensors(src, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    shutil.rmtree(tmp_path / "megatron" / "hf")

    pgconvert.convert(tmp_path / "megatron", tmp_path / "native", dst_format="hf", dst_tp=1, dst_pp=1)

    written = json.loads((tmp_path / "native" / "config.json").read_text())
    assert written["architectures"] == ["SeedOssForCausalLM"]
    assert {key: written[key] for key in ("attention_bias", "attention_out_bias", "mlp_bias", "head_dim",
                                          "attention_dropout", "residual_dropout")} == {
        "attention_bias": True, "attention_out_bias": True, "mlp_bias": True, "head_dim": 8,
        "attention_dropout": 0.1, "residual_dropout": 0.1}
    assert_same_hf_tensors(src, tmp_path / "native")
    ids = input_ids()
    torch.testing.assert_close(hf_logits(tmp_path / "native", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


def test_native_megatron_seed_oss_release_is_written_as_qwen2_which_computes_the_same(
        sources: dict[str, Path], tmp_path: Path) -> None:
    """q/k/v biases alone, no window: Qwen2 fits first (the inference order is unchanged)."""
    src = sources["seed_oss"]
    written = written_from_args_alone(src, tmp_path, dst_tp=2)
    assert (written["architectures"], written["head_dim"], written["use_sliding_window"]) == (
        ["Qwen2ForCausalLM"], 8, False)
    ids = input_ids()
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


def test_hidden_dropout_is_named_only_for_an_architecture_without_a_key_for_it() -> None:
    # Seed-OSS writes hidden_dropout as residual_dropout; Llama's config.json has no such key.
    from pgconvert.formats.hf import hf_training_notes
    from pgconvert.model.config import ModelConfig

    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                         vocab_size=100, hidden_dropout=0.1)

    assert hf_training_notes("SeedOssForCausalLM", config) == []
    assert hf_training_notes("LlamaForCausalLM", config) == [
        "not carried (training only): hidden_dropout=0.1: LlamaForCausalLM has no hidden dropout; set it in your "
        "fine-tuning run"]


# --- Arcee ---------------------------------------------------------------------------------------

def test_arcee_megatron_args_hold_squared_relu_without_a_gate_and_its_yarn(sources: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    report = pgconvert.convert(sources["arcee"], tmp_path / "megatron", dst_format="megatron", dst_tp=2, strict=True)

    args = megatron_args(tmp_path / "megatron")
    ranks = read_megatron_tp_ranks(tmp_path / "megatron")

    assert (args.squared_relu, args.swiglu, args.add_bias_linear, args.untie_embeddings_and_output_weights) == (
        True, False, False, True)
    assert (args.position_embedding_type, args.rotary_scaling_factor, args.yarn_original_max_position_embeddings,
            args.yarn_beta_fast, args.yarn_beta_slow, args.rotary_base) == ("yarn", 20.0, 4096, 32.0, 1.0, 10000.0)
    assert (args.kv_channels, args.num_query_groups, args.max_position_embeddings) == (8, 2, 65536)
    # up_proj alone is linear_fc1, split by rows: rank r holds rows [288 r, 288 (r + 1)), no [gate; up] halves.
    up = load_hf_tensors(sources["arcee"])["model.layers.0.mlp.up_proj.weight"]
    for rank, rows in zip(ranks, up.split(288), strict=True):
        assert torch.equal(rank["decoder.layers.0.mlp.linear_fc1.weight"], rows)
    assert not any("not carried" in notice for notice in report.notices), report.notices


@pytest.mark.parametrize("family, change, message", [
    ("arcee", {"hidden_act": "silu"}, "hidden_act='silu': ArceeForCausalLM is converted only with hidden_act='relu2'"),
    ("arcee", {"mlp_bias": True}, "Megatron has one setting (add_bias_linear) for both; they must agree"),
    ("nemotron", {"hidden_act": "silu"},
     "hidden_act='silu': NemotronForCausalLM is converted only with hidden_act='relu2'"),
    ("nemotron", {"mlp_bias": True}, "Megatron has one setting (add_bias_linear) for both; they must agree"),
    ("nemotron", {"num_key_value_heads": None}, "NemotronAttention divides num_attention_heads by num_key_value_heads"),
    # Arcee's attention rotates the whole head; its YaRN would size the frequencies by the factor (transformers fails).
    ("arcee", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 with rope_type 'yarn': that type sizes its "
                                              "frequencies by the factor"),
])
def test_a_config_megatron_cannot_express_is_refused_by_name(sources: dict[str, Path], tmp_path: Path, family: str,
                                                             change: dict[str, object], message: str) -> None:
    src = Path(shutil.copytree(sources[family], tmp_path / "src"))
    edit_json(src / "config.json", lambda doc: doc.update(change))

    with pytest.raises(CheckpointError, match="config.json") as caught:
        pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2)

    assert message in str(caught.value)
    assert not (tmp_path / "megatron").exists()


def test_native_megatron_arcee_without_carried_config_is_written_as_arcee(sources: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """A non-gated squared-ReLU Llama from args alone: Arcee, with its YaRN RoPE."""
    src = sources["arcee"]
    written = written_from_args_alone(src, tmp_path, dst_tp=2, dst_pp=2)

    assert (written["architectures"], written["hidden_act"]) == (["ArceeForCausalLM"], "relu2")
    rope = written["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 20.0, 4096)
    assert_same_hf_tensors(src, tmp_path / "hf")
    ids = input_ids()
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


# --- Nemotron -------------------------------------------------------------------------------------

def test_nemotron_megatron_args_hold_its_norms_activation_and_partial_rotary(sources: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    src = sources["nemotron"]
    report = pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2, strict=True)

    args = megatron_args(tmp_path / "megatron")
    ranks = read_megatron_tp_ranks(tmp_path / "megatron")

    assert (args.normalization, args.layernorm_zero_centered_gamma, args.apply_layernorm_1p) == ("LayerNorm", True, True)
    assert (args.squared_relu, args.swiglu, args.add_bias_linear, args.rotary_percent) == (True, False, False, 0.5)
    assert (args.kv_channels, args.num_query_groups, args.num_attention_heads, args.hidden_size) == (8, 2, 12, 64)
    hf = load_hf_tensors(src)
    # NemotronLayerNorm1P's stored weight is megatron-core's zero-centred gamma: the same numbers, not 1 + w.
    for rank in ranks:
        assert torch.equal(rank["decoder.layers.1.input_layernorm.weight"], hf["model.layers.1.input_layernorm.weight"])
        assert torch.equal(rank["decoder.layers.1.pre_mlp_layernorm.bias"],
                           hf["model.layers.1.post_attention_layernorm.bias"])
    for rank, rows in zip(ranks, hf["model.layers.0.mlp.up_proj.weight"].split(128), strict=True):
        assert torch.equal(rank["decoder.layers.0.mlp.linear_fc1.weight"], rows)
    assert not any("not carried" in notice for notice in report.notices), report.notices


def test_native_megatron_nemotron_without_carried_config_is_written_as_nemotron(sources: dict[str, Path],
                                                                                tmp_path: Path) -> None:
    """LayerNorm with zero-centred gamma and a non-gated squared ReLU from args alone: Nemotron, its half-head RoPE."""
    src = sources["nemotron"]
    written = written_from_args_alone(src, tmp_path, dst_tp=2, dst_pp=2)

    assert (written["architectures"], written["hidden_act"], written["norm_eps"]) == (
        ["NemotronForCausalLM"], "relu2", 1e-5)
    assert written["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert_same_hf_tensors(src, tmp_path / "hf")
    ids = input_ids()
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


# --- Granite MoE ----------------------------------------------------------------------------------

def test_granitemoe_args_hold_its_router_experts_and_multipliers(sources: dict[str, Path], tmp_path: Path) -> None:
    pgconvert.convert(sources["granitemoe"], tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)
    args = megatron_args(tmp_path / "megatron")
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (4, 2, 32)
    assert (args.moe_router_score_function, args.moe_router_pre_softmax) == ("softmax", False)
    assert (args.embedding_multiplier, args.residual_multiplier, args.logits_scaling) == (12.0, 0.22, 6.0)
    assert args.softmax_scale == 0.015625


def test_granitemoe_reference_forward_sees_the_router_and_the_multipliers(sources: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """A softmax over all experts before the top-k, or no residual multiplier, computes other logits."""
    pgconvert.convert(sources["granitemoe"], tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_ep=2)
    expected = hf_logits(sources["granitemoe"], input_ids()).to(torch.float64)
    ranks = read_megatron_tp_ranks(tmp_path / "megatron")
    for change in ({"moe_router_pre_softmax": True}, {"residual_multiplier": 1.0}):
        args = megatron_args(tmp_path / "megatron")
        for name, value in change.items():
            setattr(args, name, value)
        assert not torch.allclose(reference_logits(ranks, args, input_ids()), expected, rtol=1e-4, atol=1e-4), change


def test_native_megatron_granitemoe_without_carried_config_is_written_as_granitemoe(
        sources: dict[str, Path], tmp_path: Path) -> None:
    written = written_from_args_alone(sources["granitemoe"], tmp_path, dst_tp=2, dst_ep=2)
    assert written["architectures"] == ["GraniteMoeForCausalLM"]
    assert (written["num_local_experts"], written["intermediate_size"], written["logits_scaling"]) == (4, 32, 6.0)
    assert_same_hf_tensors(sources["granitemoe"], tmp_path / "hf")
