"""``inspect`` shows a model as its dimensions and the settings that differ from its family's defaults.

The family's defaults are what pgconvert reads from a config.json of that family stating only the
dimensions (``pgconvert.run.inspection.family_default_config``); ``--all`` lists every setting and
``--json`` keeps every key it had, adding ``family_defaults``.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from support.hf_helpers import build_hf_model, load_hf_tensors, save_hf_model

import pgconvert
from pgconvert.cli import main
from pgconvert.families import FAMILIES, ORDERED
from pgconvert.formats.hf import model_config_from_hf
from pgconvert.model.config import ModelConfig
from pgconvert.run.inspection import DIMENSIONS, compare_with_defaults
from pgconvert.semantics import SEMANTIC_FIELDS, summary

# Llama's config.json defaults (transformers' LlamaConfig) for the settings the test models set.
LLAMA_DEFAULTS: dict[str, Any] = dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=2048)
LLAMA3_ROPE: dict[str, Any] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_theta": 10000.0}
# Every key ``inspect --json`` wrote before it compared with the family's defaults, in its order.
JSON_KEYS = ["path", "format", "iterations", "iteration", "release", "layout", "layout_text", "model_config",
             "semantics", "vocab_rows", "true_vocab_size", "tensor_count", "total_bytes", "dtypes", "manifest",
             "side_files", "optimizer", "notices", "problems", "ok"]
# The settings compared with a default: all but the dimensions and the dtype (a family may require more).
COMPARED = len(ModelConfig.setting_names()) - len(DIMENSIONS) - 1


def _inspect(path: Path, *options: str) -> Result:
    result = CliRunner().invoke(main, ["inspect", *options, str(path)])
    assert result.exit_code == 0, result.output
    return result


def _settings_block(output: str) -> list[str]:
    """The ``settings`` row of the text output, one line per entry."""
    lines = output.splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith("settings "))
    end = start + 1
    while end < len(lines) and lines[end].startswith(" " * 12):
        end += 1
    return [line[12:] for line in lines[start:end]]


def _at_defaults_line(count: int, family: str) -> str:
    return f"{count} other settings at {family}'s defaults (--all lists every setting)"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama of the HF tests (rope_theta 50000, rms_norm_eps 1e-5, 256 positions)."""
    return save_hf_model(build_hf_model("llama"), tmp_path_factory.mktemp("llama") / "hf")


def test_a_plain_llama_shows_its_dimensions_and_only_the_settings_that_differ(llama: Path) -> None:
    output = _inspect(llama).output

    assert "family      LlamaForCausalLM (named by config.json)\n" in output
    assert ("model       num_layers=4 hidden_size=64 num_attention_heads=8 num_query_groups=4 ffn_hidden_size=128\n"
            "            vocab_size=1000 params_dtype=float32\n") in output
    assert _settings_block(output) == [
        "norm_epsilon=1e-05 (family default: 1e-06)",
        "max_position_embeddings=256 (family default: 2048)",
        "rotary_base=50000.0 (family default: 10000.0)",
        _at_defaults_line(COMPARED - 3, "LlamaForCausalLM"),
    ]
    for hidden in ("yarn", "kv_lora_rank", "q_lora_rank", "softcapping", "semantics", "num_experts", "mtp_"):
        assert hidden not in output


def test_a_llama_with_llama3_rope_scaling_shows_exactly_the_scaling(tmp_path: Path) -> None:
    path = save_hf_model(build_hf_model("llama", **LLAMA_DEFAULTS, rope_parameters=LLAMA3_ROPE), tmp_path / "hf")

    output = _inspect(path).output
    info = pgconvert.inspect(path)

    assert info.family_defaults is not None
    assert info.family_defaults.differing == {"rope_scaling": None, "rope_scaling_factor": 1.0}
    assert _settings_block(output)[:2] == ["rope_scaling='llama3' (family default: None)",
                                           "rope_scaling_factor=8.0 (family default: 1.0)"]
    assert _settings_block(output)[2] == _at_defaults_line(info.family_defaults.at_defaults, "LlamaForCausalLM")
    assert len(_settings_block(output)) == 3


def test_a_llama_at_every_default_says_so(tmp_path: Path) -> None:
    path = save_hf_model(build_hf_model("llama", **LLAMA_DEFAULTS), tmp_path / "hf")

    info = pgconvert.inspect(path)

    assert info.family_defaults is not None and info.family_defaults.differing == {}
    assert _settings_block(_inspect(path).output) == [
        f"all {info.family_defaults.at_defaults} settings at LlamaForCausalLM's defaults (--all lists them)"]


def test_a_qwen2_with_a_sliding_window_shows_the_window(tmp_path: Path) -> None:
    model = build_hf_model("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=2,
                           max_position_embeddings=32768, tie_word_embeddings=False)
    path = save_hf_model(model, tmp_path / "hf")

    output = _inspect(path).output

    assert "family      Qwen2ForCausalLM (named by config.json)\n" in output
    assert _settings_block(output)[:2] == ["sliding_window=64 (family default: None)",
                                           "window_layers=(0, 0, 1, 1) (family default: None)"]
    assert len(_settings_block(output)) == 3


def test_a_megatron_checkpoint_carrying_its_config_json_compares_with_that_family(llama: Path, tmp_path: Path) -> None:
    dst = pgconvert.convert(llama, tmp_path / "megatron", dst_format="megatron", dst_layout="tp=2,pp=1").dst

    output = _inspect(dst).output

    assert "family      LlamaForCausalLM (named by the config.json it carries)\n" in output
    assert _settings_block(output)[:3] == ["norm_epsilon=1e-05 (family default: 1e-06)",
                                           "max_position_embeddings=256 (family default: 2048)",
                                           "rotary_base=50000.0 (family default: 10000.0)"]


def _deepseek_v3(path: Path, **mla: int) -> Path:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=250, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=8, n_group=1,
        topk_group=1, first_k_dense_replace=3, max_position_embeddings=4096, **mla)
    DeepseekV3ForCausalLM(config).save_pretrained(path)
    return path


def test_a_deepseek_v3_shows_the_mla_dims_that_differ_from_deepseek_v3s(tmp_path: Path) -> None:
    # qk_nope_head_dim, qk_rope_head_dim and v_head_dim at DeepSeek-V3's 128, 64, 128.
    path = _deepseek_v3(tmp_path / "hf", kv_lora_rank=16, q_lora_rank=24)

    output = _inspect(path).output
    block = _settings_block(output)

    assert "family      DeepseekV3ForCausalLM (named by config.json)\n" in output
    assert "num_experts=8 moe_ffn_hidden_size=32 params_dtype=float32\n" in output
    # No router groups (n_group=1), where DeepseekV3Config's default routes by 8 groups, 4 chosen.
    assert block == ["q_lora_rank=24 (family default: 1536)", "kv_lora_rank=16 (family default: 512)",
                     "moe_router_num_groups=None (family default: 8)", "moe_router_group_topk=None (family default: 4)",
                     _at_defaults_line(COMPARED - 4, "DeepseekV3ForCausalLM")]
    for at_default in ("qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "multi_latent_attention"):
        assert at_default not in output


def test_a_deepseek_v3_with_other_head_dims_shows_them(tmp_path: Path) -> None:
    path = _deepseek_v3(tmp_path / "hf", kv_lora_rank=512, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                        v_head_dim=12)

    info = pgconvert.inspect(path)

    assert info.family_defaults is not None
    assert info.family_defaults.differing == {"qk_head_dim": 128, "qk_pos_emb_head_dim": 64, "v_head_dim": 128,
                                              "q_lora_rank": 1536, "moe_router_num_groups": 8, "moe_router_group_topk": 4}


def test_all_lists_every_setting_as_the_model_and_semantics_rows(llama: Path) -> None:
    output = _inspect(llama, "--all").output
    _, config, _ = model_config_from_hf(json.loads((llama / "config.json").read_text()), llama / "config.json")
    model = " ".join(f"{key}={value}" for key, value in config.to_dict().items() if key not in SEMANTIC_FIELDS)
    semantics = "; ".join(f"{name}: {text}" for name, text in summary(config).items())

    assert "settings " not in output
    assert f"model       {textwrap.fill(model, width=100, subsequent_indent=' ' * 12)}\n" in output
    assert f"semantics   {textwrap.fill(semantics, width=100, subsequent_indent=' ' * 12)}\n" in output
    for name in ModelConfig.setting_names():
        assert f"{name}=" in output, name


def test_json_keeps_every_key_and_value_and_adds_the_family_defaults(llama: Path) -> None:
    doc = json.loads(_inspect(llama, "--json").stdout)
    config_json = json.loads((llama / "config.json").read_text())
    _, config, _ = model_config_from_hf(config_json, llama / "config.json")

    assert list(doc) == [*JSON_KEYS[:-1], "family_defaults", "adapter", "ok"]
    assert doc["adapter"] is None  # a checkpoint, not an adapter directory
    # The full flat model config, as before: every setting, not only those that differ.
    assert doc["model_config"] == json.loads(json.dumps(config.to_dict()))
    assert list(doc["model_config"]) == list(ModelConfig.setting_names())
    assert doc["semantics"] == summary(config)
    assert {key: doc[key] for key in JSON_KEYS if key not in ("path", "model_config", "semantics")} == {
        "format": "hf", "iterations": [], "iteration": None, "release": False, "layout": None, "layout_text": None,
        "vocab_rows": 1000, "true_vocab_size": 1000, "tensor_count": 27, "total_bytes": doc["total_bytes"],
        "dtypes": {"float32": 27}, "manifest": None,
        "side_files": ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                       "special_tokens_map.json"],
        "optimizer": None, "notices": [], "problems": [], "ok": True,
    }
    tensors = load_hf_tensors(llama).values()
    assert doc["total_bytes"] == sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    assert doc["family_defaults"] == {
        "family": "LlamaForCausalLM", "basis": "named by config.json", "shown": [*DIMENSIONS, "params_dtype"],
        "differing": {"norm_epsilon": 1e-6, "max_position_embeddings": 2048, "rotary_base": 10000.0},
        "at_defaults": COMPARED - 3,
    }


@pytest.mark.parametrize("architecture", [family.architecture for family in ORDERED])
def test_the_family_defaults_are_transformers_class_defaults(architecture: str) -> None:
    from transformers import AutoConfig

    family = FAMILIES[architecture]
    # transformers' DeepSeek-V2 has no default top-k (None; V2-Lite routes to 6 experts), and Ministral
    # no default head_dim (its attention takes it as given).
    # NemotronHConfig's default layers hold a MoE layer, which the dense Nemotron-H family refuses.
    needed = {"DeepseekV2ForCausalLM": {"num_experts_per_tok": 6}, "MinistralForCausalLM": {"head_dim": 8},
              "NemotronHForCausalLM": {"layers_block_type": ["linear_attention", "mlp", "full_attention", "mlp"]},
              # Dots1Config has no expert or shared-expert counts, and does not renormalize by default.
              # HunYuan's attention takes head_dim as given (its class default is None).
              "HunYuanDenseV1ForCausalLM": {"head_dim": 8}, "HunYuanMoEV1ForCausalLM": {"head_dim": 8},
              "Dots1ForCausalLM": {"n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
                                   "norm_topk_prob": True}}
    doc = AutoConfig.for_model(family.model_type, hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
                               num_key_value_heads=4, intermediate_size=128, vocab_size=1000,
                               **needed.get(architecture, {})).to_dict()
    doc["architectures"] = [architecture]
    _, config, _ = model_config_from_hf(doc, Path("config.json"))

    compared = compare_with_defaults(config, family, "named by config.json")

    assert compared.family == architecture
    assert compared.differing == {}


def test_a_model_of_no_family_is_compared_with_modelconfigs_defaults() -> None:
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128,
                         normalization="LayerNorm", activation="gelu", gated_linear_unit=False)

    compared = compare_with_defaults(config, None, "fits no supported family")

    assert compared.family is None
    assert compared.differing == {"gated_linear_unit": True, "activation": "silu", "normalization": "RMSNorm"}
