"""Mixtral and Qwen3-MoE: HF <-> Megatron with expert parallelism is bit-exact, and logits survive.

The tiny models come from hf_helpers.FAMILY_MODELS (Mixtral: 8 experts, every layer MoE; Qwen3-MoE:
4 experts, layer 1 dense through mlp_only_layers), saved by transformers' save_pretrained in small
shards, so the source is the legacy per-expert layout transformers itself writes.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed
from support.hf_helpers import (
    FAMILY_MODELS,
    MOE_FAMILIES,
    assert_same_hf_tensors,
    build_hf_model,
    edit_json,
    hf_logits,
    input_ids,
    load_hf_tensors,
    megatron_tp_logits,
    read_megatron_tp_ranks,
    rewrite_as_single_file,
    save_hf_model,
)

import pgconvert
from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError, ConfigError
from pgconvert.families import FAMILIES
from pgconvert.families.table import Family
from pgconvert.formats.hf import family_mismatches, hf_config_from_model, infer_family

# (tp, ep, pp, expert naming of the Megatron files)
LAYOUTS = [
    (1, 1, 1, "sequential"),
    (2, 2, 1, "sequential"),
    (1, 4, 1, "sequential"),
    (2, 2, 2, "sequential"),
    (2, 2, 2, "grouped"),
]


def _layout_id(layout: tuple[int, int, int, str]) -> str:
    tp, ep, pp, naming = layout
    return f"tp{tp}ep{ep}pp{pp}-{naming}"


@pytest.fixture(scope="module")
def moe_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_moe_sources")
    return {name: save_hf_model(build_hf_model(name, seed=4), root / name) for name in MOE_FAMILIES}


def _to_megatron(src: Path, dst: Path, layout: tuple[int, int, int, str]) -> pgconvert.Report:
    tp, ep, pp, naming = layout
    return pgconvert.convert(src, dst, dst_format="megatron", dst_tp=tp, dst_ep=ep, dst_pp=pp,
                             dst_expert_layout=naming)


def _vocab(family: str) -> int:
    vocab = FAMILY_MODELS[family][2]["vocab_size"]
    assert isinstance(vocab, int)
    return vocab


# --- round trips ----------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_hf_moe_to_megatron_and_back_is_bit_exact(moe_sources: dict[str, Path], tmp_path: Path, family: str,
                                                  layout: tuple[int, int, int, str]) -> None:
    tp, ep, pp, _ = layout
    src = moe_sources[family]

    to_megatron = _to_megatron(src, tmp_path / "megatron", layout)
    back = pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1, dst_ep=1)

    assert to_megatron.dst_layout == f"tp={tp},pp={pp}" + (f",ep={ep}" if ep > 1 else "")
    assert (back.src_format, back.dst_format) == ("megatron", "hf")
    assert_same_hf_tensors(src, tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == json.loads((src / "config.json").read_text())["architectures"]
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("layout", [LAYOUTS[3], LAYOUTS[4]], ids=_layout_id)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_round_tripped_moe_checkpoint_gives_source_logits_in_transformers(
        moe_sources: dict[str, Path], tmp_path: Path, family: str, layout: tuple[int, int, int, str]) -> None:
    src = moe_sources[family]
    _to_megatron(src, tmp_path / "megatron", layout)
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1, dst_ep=1)
    ids = input_ids(_vocab(family), batch=2, seq=6)

    expected = hf_logits(src, ids)
    actual = hf_logits(tmp_path / "hf", ids)

    assert actual.dtype == torch.float32 and actual.shape == (2, 6, _vocab(family))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_hf_to_hf_keeps_the_moe_config_json(moe_sources: dict[str, Path], tmp_path: Path) -> None:
    src = moe_sources["qwen3_moe"]

    pgconvert.convert(src, tmp_path / "hf")

    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert_same_hf_tensors(src, tmp_path / "hf")


# --- what the Megatron files hold -------------------------------------------------------------------

@pytest.mark.parametrize("naming", ["sequential", "grouped"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_megatron_ep_tp_shards_compute_the_hf_models_logits(moe_sources: dict[str, Path], tmp_path: Path,
                                                           family: str, naming: str) -> None:
    """The rank files, read with torch.load and joined by an independent reader, compute HF's logits."""
    src = moe_sources[family]
    hf_config = json.loads((src / "config.json").read_text())
    ids = input_ids(_vocab(family))

    _to_megatron(src, tmp_path / "megatron", (2, 2, 1, naming))
    ranks = read_megatron_tp_ranks(tmp_path / "megatron")
    actual = megatron_tp_logits(ranks, hf_config, ids)

    expected = hf_logits(src, ids).to(torch.float64)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_reference_forward_pass_detects_two_swapped_experts(moe_sources: dict[str, Path], tmp_path: Path) -> None:
    """The check is sensitive to expert order: exchanging experts 0 and 5 of one layer changes the logits."""
    src = moe_sources["mixtral"]
    hf_config = json.loads((src / "config.json").read_text())
    ids = input_ids(_vocab("mixtral"))
    _to_megatron(src, tmp_path / "megatron", (1, 2, 1, "sequential"))
    ranks = read_megatron_tp_ranks(tmp_path / "megatron")
    first, second = (f"decoder.layers.2.mlp.experts.local_experts.{e}.linear_fc1.weight" for e in (0, 5))

    ranks[0][first], ranks[0][second] = ranks[0][second], ranks[0][first]
    actual = megatron_tp_logits(ranks, hf_config, ids)

    expected = hf_logits(src, ids).to(torch.float64)
    assert not torch.allclose(actual, expected, rtol=1e-4, atol=1e-4)


def _rank_model(root: Path, rank_dir: str) -> dict[str, torch.Tensor]:
    import argparse

    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(root / "iter_0000000" / rank_dir / "model_optim_rng.pt", weights_only=True)
    model: dict[str, torch.Tensor] = state["model"]
    return model


@pytest.mark.parametrize("naming,fc1_key", [
    ("sequential", "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"),
    ("grouped", "decoder.layers.0.mlp.experts.linear_fc1.weight1"),
], ids=["sequential", "grouped"])
def test_ep_rank_holds_its_block_of_experts_with_local_indices(moe_sources: dict[str, Path], tmp_path: Path,
                                                              naming: str, fc1_key: str) -> None:
    src = moe_sources["mixtral"]
    hf = load_hf_tensors(src)

    report = _to_megatron(src, tmp_path / "megatron", (1, 4, 1, naming))

    assert sorted(f.relpath.split("/")[1] for f in report.files if "mp_rank" in f.relpath) == [
        f"mp_rank_00_{ep:03d}" for ep in range(4)
    ]
    ep3 = _rank_model(tmp_path / "megatron", "mp_rank_00_003")
    hf_expert = "model.layers.0.block_sparse_moe.experts.7."  # global expert 7 = local expert 1 of EP rank 3
    assert torch.equal(ep3[fc1_key], torch.cat([hf[hf_expert + "w1.weight"], hf[hf_expert + "w3.weight"]]))
    assert torch.equal(ep3["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.block_sparse_moe.gate.weight"])
    experts_here = {key for key in ep3 if ".mlp.experts." in key and key.startswith("decoder.layers.0.")}
    assert len(experts_here) == 2 * 2  # two experts per EP rank, fc1 and fc2 each


def test_qwen3_moe_dense_layer_is_a_dense_megatron_mlp(moe_sources: dict[str, Path], tmp_path: Path) -> None:
    src = moe_sources["qwen3_moe"]
    hf = load_hf_tensors(src)

    _to_megatron(src, tmp_path / "megatron", (1, 1, 1, "sequential"))

    model = _rank_model(tmp_path / "megatron", "mp_rank_00")
    assert "decoder.layers.1.mlp.router.weight" not in model
    assert torch.equal(model["decoder.layers.1.mlp.linear_fc1.weight"],
                       torch.cat([hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]]))
    assert sorted(k for k in model if k.endswith("mlp.router.weight")) == [
        f"decoder.layers.{layer}.mlp.router.weight" for layer in (0, 2, 3)
    ]


# --- config.json <-> ModelConfig ----------------------------------------------------------------------

def _loaded_config(path: Path) -> ModelConfig:
    from pgconvert.loaders.hf import HFLoader
    from pgconvert.formats import LoadOptions

    with HFLoader().open(path, LoadOptions()) as source:
        return source.config


def test_mixtral_config_json_becomes_an_all_moe_model_config(moe_sources: dict[str, Path]) -> None:
    config = _loaded_config(moe_sources["mixtral"])

    assert (config.num_experts, config.moe_router_topk, config.moe_layer_freq) == (8, 2, 1)
    assert (config.ffn_hidden_size, config.moe_ffn_hidden_size) == (32, 32)
    assert (config.qk_layernorm, config.norm_epsilon, config.rotary_base) == (False, 1e-5, 1e6)
    assert config.moe_shared_expert_intermediate_size is None and not config.moe_router_enable_expert_bias


def test_qwen3_moe_config_json_becomes_a_model_config_with_a_dense_layer(moe_sources: dict[str, Path]) -> None:
    config = _loaded_config(moe_sources["qwen3_moe"])

    assert (config.num_experts, config.moe_router_topk, config.moe_layer_freq) == (4, 2, (1, 0, 1, 1))
    assert (config.ffn_hidden_size, config.moe_ffn_hidden_size, config.kv_channels) == (96, 32, 16)
    assert config.qk_layernorm


@pytest.mark.parametrize("step,dense,pattern", [
    (1, [], 1),
    (2, [], (0, 1, 0, 1)),
    (2, [3], (0, 1, 0, 0)),
    (1, [0, 2], (0, 1, 0, 1)),
])
def test_qwen3_moe_sparse_step_and_mlp_only_layers_become_megatrons_layer_pattern(
        moe_sources: dict[str, Path], tmp_path: Path, step: int, dense: list[int],
        pattern: int | tuple[int, ...]) -> None:
    src = tmp_path / "src"
    save_hf_model(build_hf_model("qwen3_moe", seed=4, decoder_sparse_step=step, mlp_only_layers=dense), src)

    config = _loaded_config(src)

    assert config.moe_layer_freq == pattern
    doc = hf_config_from_model(FAMILIES["Qwen3MoeForCausalLM"], config, torch.float32)
    assert (doc["decoder_sparse_step"], doc["mlp_only_layers"]) == (
        1, [layer for layer in range(4) if not config.is_moe_layer(layer)])


def test_megatron_moe_layer_freq_is_written_as_transformers_dense_layer_list(tmp_path: Path) -> None:
    """megatron-core's moe_layer_freq=2 means layers 0 and 2 (i % 2 == 0), transformers' step 2 would
    mean layers 1 and 3: the written config.json names the dense layers instead."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = _loaded_config_of("qwen3_moe", tmp_path).replace(moe_layer_freq=2)

    doc = hf_config_from_model(FAMILIES["Qwen3MoeForCausalLM"], config, torch.float32)
    (tmp_path / "written").mkdir()
    (tmp_path / "written" / "config.json").write_text(json.dumps(doc))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path / "written"))

    assert (doc["decoder_sparse_step"], doc["mlp_only_layers"]) == (1, [1, 3])
    assert [hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts") for layer in model.model.layers] == [
        True, False, True, False
    ]
    assert doc["num_local_experts"] == doc["num_experts"] == 4


def _loaded_config_of(family: str, tmp_path: Path) -> ModelConfig:
    return _loaded_config(save_hf_model(build_hf_model(family, seed=4), tmp_path / f"src_{family}"))


def test_qwen3_moe_num_experts_spelled_the_transformers_4_way_is_read(moe_sources: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(moe_sources["qwen3_moe"], src)
    edit_json(src / "config.json", lambda doc: doc.update(num_experts=doc.pop("num_local_experts")))

    assert _loaded_config(src).num_experts == 4


def test_qwen3_moe_source_without_top_k_renormalization_is_carried_as_pre_softmax(moe_sources: dict[str, Path],
                                                                                  tmp_path: Path) -> None:
    """norm_topk_prob=false (softmax over every expert, no renormalization) is megatron-core's
    moe_router_pre_softmax; it goes into args and comes back (tests/test_semantics.py runs the logits)."""
    src = tmp_path / "src"
    shutil.copytree(moe_sources["qwen3_moe"], src)
    edit_json(src / "config.json", lambda doc: doc.update(norm_topk_prob=False))

    report = pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_ep=2)
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1, dst_ep=1)

    assert not any("norm_topk_prob" in notice for notice in report.notices)
    from pgconvert.run.inspection import inspect

    assert inspect(tmp_path / "megatron").model_config["moe_router_pre_softmax"] is True
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["norm_topk_prob"] is False


def test_bad_decoder_sparse_step_is_refused_naming_the_key(moe_sources: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(moe_sources["qwen3_moe"], src)
    edit_json(src / "config.json", lambda doc: doc.update(decoder_sparse_step=0))

    with pytest.raises(CheckpointError,
                       match=re.escape("config.json: decoder_sparse_step=0: expected a positive integer")):
        pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron")
    assert not (tmp_path / "megatron").exists()


# --- families and inference ----------------------------------------------------------------------------

def _config(**changes: object) -> ModelConfig:
    settings = dict(num_layers=2, hidden_size=8, num_attention_heads=4, num_query_groups=2, kv_channels=2,
                    ffn_hidden_size=6, vocab_size=10)
    return ModelConfig(**{**settings, **changes})  # type: ignore[arg-type]


def test_megatron_moe_model_is_written_as_qwen3_moe_with_qk_norm_and_as_mixtral_without() -> None:
    assert infer_family(_config(num_experts=4, qk_layernorm=True)).architecture == "Qwen3MoeForCausalLM"
    assert infer_family(_config(num_experts=4, qk_layernorm=True, moe_layer_freq=(1, 0))).architecture == (
        "Qwen3MoeForCausalLM")
    assert infer_family(_config(num_experts=4)).architecture == "MixtralForCausalLM"
    assert infer_family(_config(num_experts=4, moe_layer_freq=(1, 1))).architecture == "MixtralForCausalLM"
    assert infer_family(_config(qk_layernorm=True)).architecture == "Qwen3ForCausalLM"
    assert infer_family(_config()).architecture == "LlamaForCausalLM"


def _shared_expert(family: Family) -> dict[str, object]:
    """A shared expert for a family whose experts have a gated one (Qwen2-MoE)."""
    return {"moe_shared_expert_intermediate_size": 6} if family.fixed.get("moe_shared_expert_gate") else {}
# What a family's rules need besides its fixed values (Gemma 3's local RoPE base).
_RULE_EXTRAS: dict[str, dict[str, object]] = {"Gemma3ForCausalLM": {"rotary_base_local": 10000.0},
                                              "Gemma3ForConditionalGeneration": {"rotary_base_local": 10000.0}}
# What a family needs beyond its fixed values to accept a model (GLM-4.5-MoE's shared expert).
_FAMILY_NEEDS: dict[str, dict[str, object]] = {
    "Glm4MoeForCausalLM": {"moe_shared_expert_intermediate_size": 6},
    # HunYuan's shared MLP is as wide as its experts and dense FFN.
    "HunYuanMoEV1ForCausalLM": {"moe_shared_expert_intermediate_size": 6},
    # A sparse attention indexer (its queries are the q latent; its head holds the rotary dims).
    **{architecture: {"q_lora_rank": 4, "dsa_indexer_n_heads": 2, "dsa_indexer_head_dim": 64, "dsa_indexer_topk": 2}
       for architecture in ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")},
    # A hybrid layer pattern (a Mamba layer, an MLP) and Mamba sizes that fit the tiny hidden size.
    "NemotronHForCausalLM": {"hybrid_override_pattern": "M-", "mamba_num_heads": 4, "mamba_head_dim": 2,
                             "mamba_num_groups": 2, "mamba_state_dim": 2},
    # A gated delta net layer and an attention layer, linear sizes that fit, the only spec megatron-core builds.
    # GPT-NeoX's fused per-head QKV: one query group per head.
    "GPTNeoXForCausalLM": {"num_query_groups": 4},
    # Llama 4: one shared expert of the experts' size.
    "Llama4ForCausalLM": {"moe_shared_expert_intermediate_size": 6},
    # Cohere2 rotates only its windowed layers: without a window, no layer rotates.
    "Cohere2ForCausalLM": {"no_rope_layers": (1, 1)},
    **{architecture: {"linear_attention_freq": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                      "linear_key_head_dim": 2, "linear_value_head_dim": 2, "transformer_impl": "transformer_engine"}
       for architecture in ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")},
    # A vision part whose projector writes the tiny hidden size, and multimodal RoPE.
    "Qwen2_5_VLForConditionalGeneration": {
        "vision_config": json.dumps({"model_type": "qwen2_5_vl_vision", "depth": 1, "hidden_size": 4, "num_heads": 2,
                                     "intermediate_size": 6, "out_hidden_size": 8, "patch_size": 2}),
        "vision_token_ids": "{}", "position_embedding_type": "mrope", "mrope_section": (1,)},
    "Qwen3VLForConditionalGeneration": {
        "vision_config": json.dumps({"model_type": "qwen3_vl_vision", "depth": 1, "hidden_size": 4, "num_heads": 2,
                                     "intermediate_size": 6, "out_hidden_size": 8, "patch_size": 2,
                                     "num_position_embeddings": 4, "deepstack_visual_indexes": [0]}),
        "vision_token_ids": "{}", "position_embedding_type": "mrope", "mrope_section": (1,)},
    "Qwen3VLMoeForConditionalGeneration": {
        "vision_config": json.dumps({"model_type": "qwen3_vl_moe_vision", "depth": 1, "hidden_size": 4, "num_heads": 2,
                                     "intermediate_size": 6, "out_hidden_size": 8, "patch_size": 2,
                                     "num_position_embeddings": 4, "deepstack_visual_indexes": [0]}),
        "vision_token_ids": "{}", "position_embedding_type": "mrope", "mrope_section": (1,)},
    "Mistral3ForConditionalGeneration": {
        "vision_config": json.dumps({"model_type": "pixtral", "num_hidden_layers": 1, "hidden_size": 4,
                                     "num_attention_heads": 2, "intermediate_size": 6, "patch_size": 2}),
        "vision_token_ids": "{}"},
    "Gemma3ForConditionalGeneration": {
        "vision_config": json.dumps({"model_type": "siglip_vision_model", "num_hidden_layers": 1, "hidden_size": 4,
                                     "num_attention_heads": 2, "intermediate_size": 6, "patch_size": 2,
                                     "image_size": 4, "vision_use_head": False}),
        "vision_token_ids": "{}"},
}
# Families that take dense and MoE models, and what their MoE model needs (Nemotron-H: an E layer, routed as its
# NemotronHMoE routes, with its shared expert).
_DENSE_AND_MOE: dict[str, dict[str, object]] = {
    "NemotronHForCausalLM": {"hybrid_override_pattern": "ME", "moe_router_score_function": "sigmoid",
                             "moe_router_enable_expert_bias": True, "moe_shared_expert_intermediate_size": 6},
}


@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_dense_families_refuse_moe_models_and_moe_families_refuse_dense_ones(architecture: str) -> None:
    family = FAMILIES[architecture]
    fixed = {name: value for name, value in family.fixed.items() if name != "num_experts"}
    fixed.update(_FAMILY_NEEDS.get(architecture, {}))
    fixed.update(_RULE_EXTRAS.get(architecture, {}))
    is_moe_family = "num_experts" not in family.fixed
    both = architecture in _DENSE_AND_MOE
    shared = _shared_expert(family)

    dense_refusals = family_mismatches(family, _config(**fixed))
    assert dense_refusals == (["num_experts=None (needs routed experts)"] if is_moe_family and not both else [])
    try:
        moe_config = _config(**{**fixed, **_DENSE_AND_MOE.get(architecture, {})}, **shared, num_experts=4)
    except ConfigError as error:  # no MoE model has the family's layer (Cohere's one norm for both sublayers)
        assert not is_moe_family and "MoE" in str(error), error
        return
    moe_refusals = family_mismatches(family, moe_config)

    assert moe_refusals == ([] if is_moe_family else ["num_experts=4 (needs None)"])


def test_mixtral_refuses_a_model_with_dense_layers() -> None:
    config = _config(num_experts=4, moe_layer_freq=(1, 0))

    assert family_mismatches(FAMILIES["MixtralForCausalLM"], config) == [
        "moe_layer_freq=[1, 0] (needs every layer MoE; dense layers: [1])"
    ]


@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_every_family_table_fills_every_canonical_tensor_of_the_models_it_accepts(architecture: str) -> None:
    from pgconvert.model.provider import canonical_names

    family = FAMILIES[architecture]
    fixed = {**family.fixed, **_RULE_EXTRAS.get(architecture, {}), **_FAMILY_NEEDS.get(architecture, {})}
    candidates = [_config(**fixed)]
    for freq in (1, (1, 0), (0, 1)):
        try:
            candidates.append(_config(**{**fixed, **_shared_expert(family), "num_experts": 4, "moe_layer_freq": freq}))
        except ConfigError:  # no MoE model has the family's layer (Cohere's one norm for both sublayers)
            continue
    accepted = [config for config in candidates if not family_mismatches(family, config)]

    assert accepted
    for config in accepted:
        for tied in (True, False):
            names = canonical_names(config.replace(tie_embeddings=tied))
            assert [name for name in names if family.tensors.to_hf(name) is None] == []


# --- dtypes -------------------------------------------------------------------------------------------

def test_dtype_option_casts_the_routers_too(moe_sources: dict[str, Path], tmp_path: Path) -> None:
    """A router's weight is in the model's dtype (megatron-core casts it with the model; transformers loads it so)."""
    src = moe_sources["mixtral"]

    pgconvert.convert(src, tmp_path / "bf16", dtype="bf16")

    tensors = load_hf_tensors(tmp_path / "bf16")
    routers = sorted(name for name in tensors if name.endswith("block_sparse_moe.gate.weight"))
    assert len(routers) == 4
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    source = load_hf_tensors(src)
    assert all(torch.equal(tensors[name], source[name].to(torch.bfloat16)) for name in routers)
    ids = input_ids(_vocab("mixtral"), batch=1, seq=4)
    assert hf_logits(tmp_path / "bf16", ids).shape == (1, 4, _vocab("mixtral"))


# --- bad input ------------------------------------------------------------------------------------------

def test_mixtral_checkpoint_missing_one_experts_up_projection_is_refused_naming_it(
        moe_sources: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(moe_sources["mixtral"], src)
    rewrite_as_single_file(src, lambda tensors: tensors.pop("model.layers.2.block_sparse_moe.experts.5.w3.weight"))

    with pytest.raises(CheckpointError, match=re.escape(
        "tensors do not match MixtralForCausalLM as config.json describes it; "
        "missing: ['model.layers.2.block_sparse_moe.experts.5.w3.weight']; unexpected: []; "
        "the missing tensors make up ['decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight']"
    )):
        pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_ep=2)
    assert not (tmp_path / "megatron").exists()


def test_qwen3_moe_checkpoint_with_experts_on_a_dense_layer_is_refused(moe_sources: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(moe_sources["qwen3_moe"], src)
    edit_json(src / "config.json", lambda doc: doc.update(mlp_only_layers=[1, 2]))

    with pytest.raises(CheckpointError, match=re.escape("missing: ['model.layers.2.mlp.down_proj.weight'")):
        pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron")


def _native_moe_checkpoint(tmp_path: Path, **changes: object) -> Path:
    """support.tiny_models.MOE (8 experts, layer 1 dense, shared experts, expert bias) with ``changes``, at TP2/EP2."""
    from support.tiny_models import MOE
    from support.megatron_fixtures import make_full_model, write_megatron_checkpoint

    tiny = replace(MOE, **changes)
    generator = torch.Generator().manual_seed(13)
    full = {  # small values, norms near one, routers well separated: fp32 and fp64 pick the same experts
        name: (1.0 + 0.1 * torch.randn(t.shape, generator=generator)).to(t.dtype) if "layernorm" in name
        else torch.randn(t.shape, generator=generator).to(t.dtype) if name.endswith("router.weight")
        else (0.05 * torch.randn(t.shape, generator=generator)).to(t.dtype)
        for name, t in make_full_model(tiny).items()
    }
    return write_megatron_checkpoint(tmp_path / "megatron", tiny, full, tp=2, pp=1, ep=2)


def test_writing_a_megatron_moe_model_with_shared_experts_as_hf_is_refused_naming_the_constraint(
        tmp_path: Path) -> None:
    root = _native_moe_checkpoint(tmp_path)

    with pytest.raises(ConfigError) as raised:
        pgconvert.convert(root, tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1, dst_ep=1)

    message = str(raised.value)
    assert "fits none of the supported families" in message
    assert "MixtralForCausalLM: moe_shared_expert_intermediate_size=96 (needs None)" in message
    assert "Qwen3MoeForCausalLM: moe_shared_expert_intermediate_size=96 (needs None)" in message
    assert "moe_router_enable_expert_bias=True (needs False)" in message
    assert not (tmp_path / "hf").exists()


def test_user_config_json_naming_mixtral_for_a_dense_model_is_refused(moe_sources: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    dense = save_hf_model(build_hf_model("llama", seed=1), tmp_path / "llama")

    with pytest.raises(ConfigError, match=re.escape("num_experts: 8 in the file, None in the model")):
        pgconvert.convert(dense, tmp_path / "hf", hf_config=moe_sources["mixtral"] / "config.json")


def test_native_megatron_moe_checkpoint_becomes_qwen3_moe_with_the_same_logits(tmp_path: Path) -> None:
    root = _native_moe_checkpoint(tmp_path, qk_layernorm=True, moe_shared_expert_intermediate_size=None,
                                     moe_shared_expert_gate=False, moe_router_enable_expert_bias=False,
                                     dtype=torch.float32)
    reference_config = {
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 4, "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10000.0},
        "vocab_size": 1000, "num_hidden_layers": 4, "num_local_experts": 8, "num_experts_per_tok": 2,
    }
    ids = input_ids(1000)

    pgconvert.convert(root, tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1, dst_ep=1)

    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (written["decoder_sparse_step"], written["mlp_only_layers"]) == (1, [1])
    assert (written["moe_intermediate_size"], written["intermediate_size"]) == (64, 128)
    assert written["norm_topk_prob"] is True
    expected = megatron_tp_logits(read_megatron_tp_ranks(root), reference_config, ids)
    actual = hf_logits(tmp_path / "hf", ids).to(torch.float64)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_family_whose_rule_and_field_read_the_same_model_field_is_refused() -> None:
    from pgconvert.families.llama import DECODER_TENSORS
    from pgconvert.families.table import ConfigField, ConfigRule, Family

    rule = ConfigRule(keys=("decoder_sparse_step",), model_fields=("num_layers",),
                      read=lambda present, model: {"num_layers": 1}, write=lambda config: {})

    with pytest.raises(ValueError, match=re.escape("fields read by more than one rule or field: ['num_layers']")):
        Family("X", "x", DECODER_TENSORS, (ConfigField(("num_hidden_layers",), "num_layers", int),), {},
               rules=(rule,))
    with pytest.raises(ValueError, match=re.escape("config.json keys mapped twice: ['decoder_sparse_step']")):
        Family("X", "x", DECODER_TENSORS, (ConfigField(("decoder_sparse_step",), "hidden_size", int),), {},
               rules=(replace(rule, model_fields=("vocab_size",)),))
