"""pgconvert reads a config.json as transformers' config class resolves it: absent keys, nulls, older spellings.

For every family and every config.json key its table reads (``support.hf_config_variants`` generates
the variants from the tables, so a new family or key gets its cases), pgconvert's reading of the
variant must be its reading of transformers' resolution of it (``AutoConfig.for_model(model_type,
**variant).to_dict()``): pgconvert(variant) == pgconvert(transformers(variant)). Both may refuse; a
variant transformers itself rejects is skipped. Where transformers keeps a null (or its own
``to_dict()`` does not read back the same), the resolution says nothing about what the model computes:
``KEPT_NULLS`` records that from transformers' modeling code, and every such case must be listed
there. An absent key pgconvert requires (the dimensions) is refused, naming it. What pgconvert writes
for each model it read, transformers reads as the same model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.hf_config_variants import Variant, resolve, variants

from pgconvert.errors import PgconvertError
from pgconvert.families import ORDERED
from pgconvert.families import mtp
from pgconvert.families.table import REQUIRED, Family
from pgconvert.formats.hf import get_path, hf_config_from_model, model_config_from_hf
from pgconvert.model.config import ModelConfig

PATH = Path("config.json")


class Refused:
    """pgconvert refuses the config.json (with ``message``)."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Refused)

    def __repr__(self) -> str:
        return f"refused ({self.message})"


Reading = dict[str, Any] | Refused
# What pgconvert must read where transformers keeps a null: refused (transformers' model computes
# nothing from it), or the reference's reading changed by these settings (given the reference doc).
REFUSED = "refused"
Expected = str | Callable[[dict[str, Any]], dict[str, Any]]


def _same(doc: dict[str, Any]) -> dict[str, Any]:
    return {}


def _no_window(doc: dict[str, Any]) -> dict[str, Any]:
    return {"sliding_window": None, "window_layers": None}


def _derived_head_dim(doc: dict[str, Any]) -> dict[str, Any]:
    return {"kv_channels": doc["hidden_size"] // doc["num_attention_heads"]}


# (architecture or "*", reference, variant) -> what transformers' model computes, from its modeling code
# (transformers 5.24; reference "*": any).
KEPT_NULLS: dict[tuple[str, str, str], Expected] = {
    # modeling_rope_utils / each family's rotary: base ** (arange / dim) with base None.
    ("*", "*", "null rope_parameters.rope_theta"): REFUSED,
    ("*", "*", "older spelling of rope_theta, null rope_theta"): REFUSED,
    ("Gemma3ForCausalLM", "*", "older spelling of rope_theta, null rope_local_base_freq"): REFUSED,
    # OLMo 3's class has no rope_local_base_freq (Gemma 3's older key for the sliding layers' base): kept as an
    # unknown attribute and never read; its sliding layers take default_theta.
    ("Olmo3ForCausalLM", "*", "older spelling of rope_theta, null rope_local_base_freq"): _same,
    # GPTNeoXConfig has no top-level rope_theta or partial_rotary_factor (its older keys are rotary_emb_base and
    # rotary_pct): kept as unknown attributes and never read; its RoPE takes default_theta and 0.25.
    ("GPTNeoXForCausalLM", "*", "older spelling of rope_theta, null rope_theta"): _same,
    ("GPTNeoXForCausalLM", "*", "older spelling of rope_theta, null partial_rotary_factor"): _same,
    # CohereLayerNorm: rsqrt(variance + eps) with eps None; CohereForCausalLM: logits * logit_scale with None.
    # GlmMoeDsaConfig keeps these schedule keys as given; a stated indexer_types wins over them, as in pgconvert.
    **{("GlmMoeDsaForCausalLM", "*", f"{spelling}null {key}"): _same
       for key in ("index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")
       for spelling in ("", "older spelling of index_topk_pattern, ", "older spelling of index_topk_freq, ")},
    ("CohereForCausalLM", "*", "null layer_norm_eps"): REFUSED,
    ("CohereForCausalLM", "*", "null logit_scale"): REFUSED,
    # CohereAttention: `if self.use_qk_norm` builds and applies no q/k norm for None.
    ("CohereForCausalLM", "*", "null use_qk_norm"): _same,
    # eager_attention_forward: dropout only while training (p=None raises there, not at inference).
    ("*", "*", "null attention_dropout"): _same,
    # Attention modules of classes without head_dim: getattr(config, "head_dim", hidden // heads) is None.
    ("*", "*", "null head_dim"): REFUSED,
    # Mixtral's: getattr(config, "head_dim", None) or hidden_size // num_attention_heads.
    ("MixtralForCausalLM", "*", "null head_dim"): _derived_head_dim,
    # StarCoder2's: getattr(config, "head_dim", None) or hidden_size // num_attention_heads.
    ("Starcoder2ForCausalLM", "*", "null head_dim"): _derived_head_dim,
    # Sliding-window attention: no window where sliding_window is None (the masks' create_causal_mask).
    ("MistralForCausalLM", "*", "null sliding_window"): _no_window,
    ("MixtralForCausalLM", "*", "null sliding_window"): _no_window,
    ("Phi3ForCausalLM", "*", "null sliding_window"): _no_window,
    ("Starcoder2ForCausalLM", "*", "null sliding_window"): _no_window,
    ("Qwen3MoeForCausalLM", "*", "null sliding_window"): _no_window,
    # Layers layer_types marks sliding: create_sliding_window_causal_mask cannot take None.
    ("*", "*", "null sliding_window"): REFUSED,
    # ... where use_sliding_window is off, no layer is marked and the window is never read.
    **{(architecture, "base", "null sliding_window"): _same
       for architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "SmolLM3ForCausalLM")},
    # Gemma 3's softcapping is off by default; Gemma 2's null turns it off (`if config.…softcapping is not None`).
    ("Gemma3ForCausalLM", "*", "null final_logit_softcapping"): _same,
    ("Gemma3ForCausalLM", "*", "null attn_logit_softcapping"): _same,
    ("Gemma2ForCausalLM", "*", "null final_logit_softcapping"): lambda doc: {"final_logit_softcapping": None},
    ("Gemma2ForCausalLM", "*", "null attn_logit_softcapping"): lambda doc: {"attn_logit_softcapping": None},
    # Gemma 3: layer_types given, so the older period (kwargs.get("sliding_window_pattern", 6)) is unused.
    ("Gemma3ForCausalLM", "*", "null sliding_window_pattern"): _same,
    # Cohere2: the same (kwargs.pop("sliding_window_pattern", 4) only where layer_types is absent).
    ("Cohere2ForCausalLM", "*", "null sliding_window_pattern"): _same,
    # EXAONE 4: layer_types given, so the period is unused; without a window none of its layers is marked sliding.
    ("Exaone4ForCausalLM", "*", "null sliding_window_pattern"): _same,
    ("Exaone4ForCausalLM", "sliding_window=None, layer_types=['full_attention', 'full_attention', 'full_attention', "
                           "'full_attention']", "null sliding_window"): _same,
    # Phi-3: a top-level null is no partial rotary (rope_parameters.setdefault(..., 1.0) keeps the block's).
    ("Phi3ForCausalLM", "*", "null partial_rotary_factor"): _same,
    # GLM: a top-level null passes Glm4Config's kwargs.setdefault(0.5) and reaches no rope_parameters:
    # the whole head rotates (its to_dict() then reads back as 0.5).
    ("Glm4ForCausalLM", "*", "older spelling of rope_theta, null partial_rotary_factor"):
        lambda doc: {"rotary_percent": 1.0},
    ("Glm4MoeForCausalLM", "*", "older spelling of rope_theta, null partial_rotary_factor"):
        lambda doc: {"rotary_percent": 1.0},
    ("Qwen3NextForCausalLM", "*", "older spelling of rope_theta, null partial_rotary_factor"):
        lambda doc: {"rotary_percent": 1.0},
    # Qwen3-Next: layer_types given, so full_attention_interval (kwargs.pop(..., 4)) is unused; without
    # layer_types a null interval is no period ((i + 1) % None raises).
    ("Qwen3NextForCausalLM", "*", "null full_attention_interval"): _same,
    ("Qwen3NextForCausalLM", "*", "older spelling of full_attention_interval, null full_attention_interval"): REFUSED,
    # Qwen3.5 (dense and MoE): Qwen3-Next's config class in these (Qwen3_5TextConfig's __post_init__ is its own).
    **{(architecture, "*", variant): resolution
       for architecture in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
       for variant, resolution in (("older spelling of rope_theta, null partial_rotary_factor",
                                    lambda doc: {"rotary_percent": 1.0}),
                                   ("null full_attention_interval", _same),
                                   ("older spelling of full_attention_interval, null full_attention_interval",
                                    REFUSED))},
    # Nemotron: NemotronAttention computes heads // num_key_value_heads with None; a top-level null partial rotary
    # reaches no rope_parameters, where NemotronAttention reads it (KeyError).
    ("NemotronForCausalLM", "*", "null num_key_value_heads"): REFUSED,
    ("NemotronForCausalLM", "*", "older spelling of rope_theta, null partial_rotary_factor"): REFUSED,
    # ERNIE 4.5: nn.Linear(bias=None) builds no bias.
    ("Ernie4_5ForCausalLM", "*", "null use_bias"): lambda doc: {"add_qkv_bias": False, "add_bias_linear": False},
    # ERNIE 4.5 MoE: the attention, router, statics, decoder layer and MoE block take these as given (heads // None,
    # topk(k=None), zeros(1, None), (i + 1) % None, None > 0, clamp(min=None)); the aux loss is a training term.
    **{("Ernie4_5_MoeForCausalLM", "*", f"null {key}"): REFUSED
       for key in ("num_key_value_heads", "moe_num_experts", "moe_k", "moe_layer_start_index", "moe_layer_end_index",
                   "moe_layer_interval", "moe_num_shared_experts", "moe_norm_min")},
    ("Ernie4_5_MoeForCausalLM", "*", "null router_aux_loss_coef"): _same,
    ("Ernie4_5_MoeForCausalLM", "*", "null use_bias"): _same,
    # HunYuan: transformers' model never reads Tencent's switches and per-layer sizes (it always applies its q/k
    # norms and shared MLP, sizes every expert by intermediate_size); its router takes moe_topk[layer] of a null.
    **{(architecture, "*", f"null {key}"): _same
       for architecture in ("HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM")
       for key in ("use_qk_norm", "use_cla", "moe_intermediate_size", "num_shared_expert", "use_mixed_mlp_moe")},
    ("HunYuanMoEV1ForCausalLM", "*",
     "older spelling num_experts_per_tok (attribute_map alias of moe_topk), null num_experts_per_tok"): REFUSED,
    # MiniMax-M2: a top-level null passes MiniMaxM2Config's kwargs.setdefault(rotary_dim / head_dim) and
    # reaches no rope_parameters: the whole head rotates. A null rotary_dim is no partial rotary
    # (kwargs.get(...) is None); attn_type_list is read by no transformers code (softmax attention everywhere).
    ("MiniMaxM2ForCausalLM", "*", "older spelling of rope_theta, null partial_rotary_factor"):
        lambda doc: {"rotary_percent": 1.0},
    ("MiniMaxM2ForCausalLM", "*", "null rotary_dim"): _same,
    ("MiniMaxM2ForCausalLM", "*", "null attn_type_list"): _same,
    # dots.llm1: its MoE block takes the counts as given (None experts, None x the shared size); a null
    # norm_topk_prob does not renormalize (`if self.norm_topk_prob`), which megatron-core cannot compute.
    # Llama 4: layer_types given marks chunked layers, whose mask transformers cannot build without a chunk size.
    ("Llama4ForCausalLM", "*", "null attention_chunk_size"): REFUSED,
    ("Dots1ForCausalLM", "*", "null n_routed_experts"): REFUSED,
    ("Dots1ForCausalLM", "*", "null n_shared_experts"): REFUSED,
    ("Dots1ForCausalLM", "*", "null norm_topk_prob"): REFUSED,
    # ... a null window marks no layer sliding (its layer_types default), and layer_types given, the period
    # max_window_layers is unused.
    **{("Dots1ForCausalLM", variant, "null sliding_window"): _no_window
       for variant in ("base", "n_group=4, topk_group=2")},
    ("Dots1ForCausalLM", "*", "null max_window_layers"): _same,
    # Granite MoE: GraniteMoeConfig keeps a null multiplier, and its model multiplies by it (or scales the
    # attention by it) as given.
    **{("GraniteMoeForCausalLM", "*", f"null {key}"): REFUSED
       for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling", "attention_multiplier")},
    # Granite MoE: the auxiliary loss is a training term (its coefficient is read only with output_router_logits).
    ("GraniteMoeForCausalLM", "*", "null router_aux_loss_coef"): _same,
    # DeepSeek: q_lora_rank None builds q_proj without the low-rank path.
    ("DeepseekV3ForCausalLM", "*", "null q_lora_rank"): lambda doc: {"q_lora_rank": None},
    ("DeepseekV2ForCausalLM", "*", "null q_lora_rank"): lambda doc: {"q_lora_rank": None},
    # DeepSeek's routers and layers take these as given: topk(k=None), n_group // None, i >= None.
    ("*", "*", "null num_experts_per_tok"): REFUSED,
    ("*", "*", "null v_head_dim"): REFUSED,
    ("*", "*", "null first_k_dense_replace"): REFUSED,
    ("*", "*", "null n_group"): REFUSED,
    ("*", "*", "null topk_group"): REFUSED,
    ("*", "*", "null topk_method"): REFUSED,
    # DeepSeek-V2's greedy router never reads its groups.
    ("DeepseekV2ForCausalLM", "base", "null n_group"): _same,
    ("DeepseekV2ForCausalLM", "base", "null topk_group"): _same,
    # Qwen3-MoE's experts and Qwen2-MoE's attention take the counts as given.
    # MoE blocks take the expert count as given (an attribute_map alias bypasses the class's type check).
    ("*", "*", "null num_local_experts"): REFUSED,
    **{("*", "*", f"older spelling {alias} (attribute_map alias of {real}), null {alias}"): REFUSED
       for alias, real in (("num_experts", "num_local_experts"), ("num_local_experts", "num_experts"),
                           ("num_local_experts", "n_routed_experts"), ("num_experts", "n_routed_experts"))},
    # A dense Nemotron-H (the base) builds no NemotronHMoE: its expert count and latent size are never read.
    ("NemotronHForCausalLM", "base", "null num_local_experts"): _same,
    ("NemotronHForCausalLM", "base",
     "older spelling num_local_experts (attribute_map alias of n_routed_experts), null num_local_experts"): _same,
    ("NemotronHForCausalLM", "*", "null moe_latent_size"): _same,
    ("Qwen2MoeForCausalLM", "*", "null num_key_value_heads"): REFUSED,
    # The MTP layer count (num_mtp_layers) null with an MTP layer stored: no count to convert it by.
    ("*", "*", "null num_nextn_predict_layers"): REFUSED,
    # Qwen3-Next's and Qwen3.5's count of their separate MTP module (not a config class attribute: kept as given).
    ("*", "*", "null mtp_num_hidden_layers"): REFUSED,
    ("*", "*", "older spelling num_mtp_layers (attribute_map alias of num_nextn_predict_layers), "
               "null num_mtp_layers"): REFUSED,
}


def _reading(family: Family, doc: dict[str, Any]) -> Reading:
    """pgconvert's model of a config.json, with one MTP layer stored where the family has them (where config.json
    counts them, if its absence means none)."""
    try:
        _, config, _ = model_config_from_hf(copy.deepcopy(doc), PATH)
        block = family.hf_mtp_block
        if family.hf_mtp_layers_key is not None and (family.hf_mtp_layers_absent or family.hf_mtp_layers_key in doc):
            stored = {(block.own["eh_proj.weight"] if block is not None
                       else f"model.layers.{config.num_layers}.eh_proj.weight"): None}
            config, _ = mtp.resolve_hf_count(family, doc, config, stored, PATH)
    except PgconvertError as exc:
        return Refused(str(exc))
    return config.to_dict()


def _expected_kept_null(family: Family, variant: Variant) -> Expected | None:
    for architecture in (family.architecture, "*"):
        for reference in (variant.reference, "*"):
            found = KEPT_NULLS.get((architecture, reference, variant.what))
            if found is not None:
                return found
    return None


def _required(family: Family, variant: Variant) -> bool:
    return variant.kind == "absent" and any(spec.key == variant.key and spec.default is REQUIRED
                                            for spec in family.fields)


def _keeps_null(family: Family, variant: Variant, resolved: dict[str, Any]) -> bool:
    """transformers' resolution holds the null, or does not read back as itself: it says nothing about
    what transformers' model computes."""
    if variant.kind == "null" and get_path(resolved, tuple(str(variant.key).split("."))) is None:
        return True
    try:
        return resolve(family, resolved) != resolved
    except Exception:
        return True


def _brief(reading: Reading) -> str:
    return repr(reading) if isinstance(reading, Refused) else "read"


def _differs(reading: Reading, expected: Reading) -> str | None:
    if reading == expected and isinstance(reading, Refused):
        return None
    if isinstance(reading, Refused) or isinstance(expected, Refused):
        return f"pgconvert: {_brief(reading)}; expected: {_brief(expected)}"
    changed = {name: (reading[name], expected[name]) for name in reading if reading[name] != expected[name]}
    return None if not changed else f"pgconvert (first) and expected (second) differ: {changed}"


def _kept_null_problem(family: Family, variant: Variant, reading: Reading) -> str | None:
    expected = _expected_kept_null(family, variant)
    if expected is None:
        return f"transformers keeps the null or reads its own resolution otherwise: add it to KEPT_NULLS ({_brief(reading)})"
    if expected == REFUSED:
        key = str(variant.key).rsplit(".", 1)[-1]
        ok = isinstance(reading, Refused) and key in reading.message
        return None if ok else f"transformers computes nothing from it, so it must be refused naming {key}: {_brief(reading)}"
    assert callable(expected)
    reference = _reading(family, variant.base)
    assert not isinstance(reference, Refused), reference
    return _differs(reading, {**reference, **expected(variant.base)})


def _problem(family: Family, variant: Variant, resolved: dict[str, Any], reading: Reading) -> str | None:
    """Why pgconvert's ``reading`` of ``variant`` is not transformers' ``resolved`` (None: it is)."""
    if _required(family, variant):
        ok = isinstance(reading, Refused) and f"{variant.key} is missing" in reading.message
        return None if ok else f"{variant.key} is required, so its absence must be refused: {_brief(reading)}"
    if _keeps_null(family, variant, resolved):
        return _kept_null_problem(family, variant, reading)
    return _differs(reading, _reading(family, resolved))


CASES = [(family, variant) for family in ORDERED for variant in variants(family)]


@pytest.mark.parametrize(("family", "variant"), CASES,
                         ids=[f"{family.architecture}: [{variant.reference}] {variant.what}" for family, variant in CASES])
def test_pgconvert_reads_a_config_json_as_transformers_resolves_it(family: Family, variant: Variant) -> None:
    try:
        resolved = resolve(family, variant.doc)
    except Exception as exc:
        pytest.skip(f"transformers rejects it: {type(exc).__name__}: {str(exc).splitlines()[0]}")

    problem = _problem(family, variant, resolved, _reading(family, variant.doc))

    assert problem is None, problem


def _readings_transformers_accepts(family: Family) -> list[dict[str, Any]]:
    readings: dict[str, dict[str, Any]] = {}
    for case_family, variant in CASES:
        if case_family is not family:
            continue
        try:
            resolve(family, variant.doc)
        except Exception:
            continue
        reading = _reading(family, variant.doc)
        if not isinstance(reading, Refused):
            readings.setdefault(repr(sorted(reading.items())), reading)
    return list(readings.values())


@pytest.mark.parametrize("family", ORDERED, ids=lambda family: family.architecture)
def test_what_pgconvert_writes_for_a_model_it_read_transformers_reads_as_that_model(family: Family) -> None:
    problems = []
    for reading in _readings_transformers_accepts(family):
        doc = hf_config_from_model(family, ModelConfig.from_settings(reading), torch.float32)
        try:
            resolved = resolve(family, doc)
        except Exception as exc:
            problems.append(f"transformers rejects what pgconvert writes: {type(exc).__name__}: {exc}")
            continue
        problem = _differs(_reading(family, resolved), reading)
        if problem is not None:
            problems.append(problem)

    assert not problems, "\n".join(problems)
