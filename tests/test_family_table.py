"""The family tables' structure: ``Family.derive``, the ordered family list, and the one import direction
(families use semantics; semantics never imports a family)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import pgconvert
from pgconvert import families
from pgconvert.families.llama import DECODER_TENSORS, LLAMA, ROPE_RULE, max_positions
from pgconvert.families.sliding_window import EVERY_LAYER_WINDOW
from pgconvert.families.table import DROP, DROPPED, IDENTITY, ConfigField, Family, TensorMapping

SEMANTICS_DIR = Path(pgconvert.__file__).parent / "semantics"


def _fields(family: Family) -> list[tuple[str, str]]:
    return [(spec.key, spec.model_field) for spec in family.fields]


def test_derive_replaces_fields_and_rules_in_place_and_adds_the_others() -> None:
    derived = LLAMA.derive("XForCausalLM", "x", fields=(max_positions(4096),
                                                       ConfigField(("x_scale",), "logits_scaling", float, default=1.0)),
                           rules=(EVERY_LAYER_WINDOW,))

    assert (derived.architecture, derived.model_type) == ("XForCausalLM", "x")
    assert _fields(derived) == [*_fields(LLAMA), ("x_scale", "logits_scaling")]
    position = [spec.model_field for spec in derived.fields].index("max_position_embeddings")
    assert derived.fields[position].default == 4096 and LLAMA.fields[position].default == 2048
    assert derived.rules == (ROPE_RULE, EVERY_LAYER_WINDOW)
    # The window is read now, so it is no longer fixed; the rest keeps its order.
    assert list(derived.fixed) == [name for name in LLAMA.fixed if name != "sliding_window"]


def test_derive_fixing_a_setting_drops_the_fields_that_read_it() -> None:
    derived = LLAMA.derive("XForCausalLM", "x", fixed={"add_bias_linear": False, "qk_layernorm": True})

    assert "add_bias_linear" not in {spec.model_field for spec in derived.fields}
    assert [key for key, _ in _fields(derived)] == [key for key, _ in _fields(LLAMA)
                                                    if key not in ("attention_bias", "mlp_bias")]
    assert list(derived.fixed) == [*LLAMA.fixed, "add_bias_linear"]
    assert derived.fixed["qk_layernorm"] is True


def test_derive_puts_new_fixed_values_where_the_first_setting_now_read_was() -> None:
    qk_norm = ConfigField(("use_qk_norm",), "qk_layernorm", bool, default=False)
    derived = LLAMA.derive("XForCausalLM", "x", fields=(qk_norm,),
                           fixed={"moe_router_pre_softmax": False, "add_qkv_bias": True})

    base = list(LLAMA.fixed)
    at = base.index("qk_layernorm")
    assert list(derived.fixed) == [*base[:at], "moe_router_pre_softmax", *base[at + 1:]]
    assert derived.fixed["add_qkv_bias"] is True


def test_derive_refuses_fixing_a_setting_a_kept_rule_reads() -> None:
    with pytest.raises(ValueError, match="both fixed and read from config.json: \\['rotary_percent'\\]"):
        LLAMA.derive("XForCausalLM", "x", fixed={"rotary_percent": 1.0})


def test_derive_merges_the_config_json_mappings_and_drop_removes_a_key() -> None:
    base = LLAMA.derive("XForCausalLM", "x", hf_fixed={"rope_interleave": True}, hf_notes={"qk-norm": "always"})
    derived = base.derive("YForCausalLM", "y", hf_fixed={"rope_interleave": DROP, "clip_qkv": None},
                          hf_scratch={"pad_token_id": None}, hf_notes={"linear biases": DROP},
                          hf_computes=frozenset({"rotary_percent"}))

    assert dict(base.hf_fixed) == {"hidden_act": "silu", "rope_interleave": True}
    assert dict(derived.hf_fixed) == {"hidden_act": "silu", "clip_qkv": None}
    assert dict(derived.hf_scratch) == {**LLAMA.hf_scratch, "pad_token_id": None}
    assert dict(derived.hf_notes) == {"sliding window": LLAMA.hf_notes["sliding window"], "qk-norm": "always"}
    assert derived.hf_computes == {"rotary_percent"} and LLAMA.hf_computes == frozenset()


def test_derive_replaces_rows_by_their_canonical_pattern_and_dropped_rows_by_their_hf_one() -> None:
    norm = TensorMapping("decoder.final_layernorm.weight", ("model.final_norm.weight",))
    dropped = TensorMapping(None, ("model.rotary_emb.inv_freq",), DROPPED)
    extra = TensorMapping("decoder.layers.{}.extra.weight", ("model.layers.{}.extra.weight",), IDENTITY)
    derived = LLAMA.derive("XForCausalLM", "x", rows=(norm, dropped, extra))

    rows = derived.tensors.rows
    assert len(rows) == len(DECODER_TENSORS.rows) + 1 and rows[-1] == extra
    assert rows.index(norm) == [row.canonical for row in DECODER_TENSORS.rows].index("decoder.final_layernorm.weight")
    assert derived.tensors.to_hf("decoder.final_layernorm.weight") == (norm, ("model.final_norm.weight",))
    assert LLAMA.tensors.to_hf("decoder.final_layernorm.weight")[1] == ("model.norm.weight",)


def test_hf_notes_must_name_a_semantics_row() -> None:
    with pytest.raises(ValueError, match="SEMANTICS has no row for: \\['sliding windows'\\]"):
        dataclasses.replace(LLAMA, hf_notes={"sliding windows": "sliding_window"})


def test_the_family_list_gives_the_registry_and_the_inference_order() -> None:
    assert families.INFERENCE_ORDER == (
        "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
        "Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM",
        "MistralForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Gemma3ForCausalLM", "Gemma2ForCausalLM",
        "GemmaForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "Exaone4ForCausalLM", "OlmoeForCausalLM",
        "Glm4ForCausalLM",
        "Glm4MoeForCausalLM", "GptOssForCausalLM", "Qwen2MoeForCausalLM", "GraniteForCausalLM",
        "GraniteMoeForCausalLM", "MinistralForCausalLM",
        "SmolLM3ForCausalLM", "Phi3ForCausalLM", "SeedOssForCausalLM", "ArceeForCausalLM", "NemotronForCausalLM",
            "Ernie4_5ForCausalLM",
        "NemotronHForCausalLM", "MiniMaxM2ForCausalLM", "Dots1ForCausalLM", "Starcoder2ForCausalLM",
        "GPTNeoXForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM", "Qwen3NextForCausalLM",
        "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Ernie4_5_MoeForCausalLM",
        "HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM", "Llama4ForCausalLM",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
        "Gemma3ForConditionalGeneration", "Mistral3ForConditionalGeneration")
    assert list(families.FAMILIES.values()) == [*families.ORDERED, *families.VISION_LANGUAGE]
    assert families.supported_architectures() == sorted(families.INFERENCE_ORDER)
    assert families.CARRIED_ARGS == ("embedding_multiplier", "residual_multiplier", "logits_scaling",
                                     "hf_rope_parameters", "time_step_min", "use_parallel_residual",
                                     "shared_input_layernorm", "layernorm_bias", "logit_scale",
                                     "qk_layernorm_after_rope", "attention_chunk_size", "attn_temperature_tuning",
                                     "floor_scale", "attn_scale")


def test_hf_spellings_give_each_familys_note_or_the_rows_text() -> None:
    spellings = families.hf_spellings("sliding window")

    assert list(spellings) == list(families.INFERENCE_ORDER)
    assert spellings["MistralForCausalLM"] == "sliding_window"
    assert spellings["Qwen3ForCausalLM"] == spellings["Qwen2ForCausalLM"] != spellings["Gemma2ForCausalLM"]
    assert spellings["Gemma2ForCausalLM"] == spellings["DeepseekV3ForCausalLM"]


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
    return names


def test_semantics_imports_no_family_module() -> None:
    imports = {path.name: sorted(name for name in _imported_modules(path)
                                 if name == "pgconvert.families" or name.startswith("pgconvert.families."))
               for path in sorted(SEMANTICS_DIR.glob("*.py"))}

    assert "__init__.py" in imports and "carried.py" in imports
    assert {name: found for name, found in imports.items() if found} == {}


def test_the_import_check_sees_a_function_level_import(tmp_path: Path) -> None:
    (tmp_path / "x.py").write_text("def f():\n    from pgconvert.families import FAMILIES\n    return FAMILIES\n")

    assert "pgconvert.families" in _imported_modules(tmp_path / "x.py")
