"""Gemma 3 (text), Gemma 2, OLMo 2, OLMo 3, OLMoE, GLM-4, EXAONE 4 (its 32B and 1.2B configurations): norms after the
sublayers and what each adds; Gemma (1):
Gemma's norms, embedding scale and GeGLU without the norms after the sublayers.

HF -> Megatron TP2/PP2 (OLMoE: TP2/EP2) -> torch_dist -> HF is bit-exact with the same config, generation config,
tokenizer and logits; the TP rank files compute the HF model's logits in an independent forward
(``postnorm_helpers.postnorm_tp_logits``: megatron-core 0.16 cannot run these layers on CPU).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from support.hf_helpers import assert_same_hf_tensors, hf_logits, input_ids, read_megatron_tp_ranks
from support.postnorm_helpers import (
    ARCHITECTURES,
    EXAONE4_ROPE,
    MOE,
    POSTNORM_MODELS,
    VOCAB,
    build_postnorm_model,
    postnorm_tp_logits,
    save_postnorm_model,
)
from support.round_trips import assert_config_refused

import pgconvert
from pgconvert.errors import CheckpointError, PgconvertError

FAMILIES = sorted(POSTNORM_MODELS)


def _layout(family: str) -> dict[str, int]:
    """TP2/PP2 for the dense families, TP2/EP2 for the MoE one."""
    return dict(dst_tp=2, dst_pp=1, dst_ep=2) if family in MOE else dict(dst_tp=2, dst_pp=2)
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("postnorm")
    return {name: save_postnorm_model(name, root / name, seed=3) for name in FAMILIES}


def _rank_args(root: Path) -> argparse.Namespace:
    path = next((root / "iter_0000000").glob("mp_rank_*")) / "model_optim_rng.pt"
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)["args"]


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_megatron_tp2_pp2_to_torch_dist_and_back_keeps_everything(sources: dict[str, Path], tmp_path: Path,
                                                                        family: str) -> None:
    src = sources[family]

    to_megatron = pgconvert.convert(src, tmp_path / "m", dst_format="megatron", **_layout(family))
    to_dist = pgconvert.convert(tmp_path / "m", tmp_path / "td", dst_format="torch_dist", **_layout(family))
    pgconvert.convert(tmp_path / "td", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)

    assert_same_hf_tensors(src, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    for name in SIDE_FILES:
        assert (tmp_path / "hf" / name).read_bytes() == (src / name).read_bytes(), name
    ids = input_ids(VOCAB)
    actual, expected = hf_logits(tmp_path / "hf", ids), hf_logits(src, ids)
    assert type(actual) is torch.Tensor and actual.shape == (2, 12, VOCAB)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    # Every Megatron output names what megatron-core alone would not compute.
    for report in (to_megatron, to_dist):
        assert any("Megatron-Bridge" in notice for notice in report.notices), report.notices


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_tp_ranks_compute_the_hf_models_logits(tmp_path: Path, family: str) -> None:
    model = build_postnorm_model(family, seed=5)
    src = tmp_path / "hf"
    model.save_pretrained(src)
    hf = json.loads((src / "config.json").read_text())
    ids = input_ids(VOCAB)

    pgconvert.convert(src, tmp_path / "m", dst_format="megatron", dst_tp=2, dst_pp=1,
                      dst_ep=2 if family in MOE else 1)
    ranks = read_megatron_tp_ranks(tmp_path / "m")
    actual = postnorm_tp_logits(ranks, hf, ids)

    assert len(ranks) == 2
    expected = hf_logits(model, ids).to(torch.float64)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


_CHANGED_FAMILY = {"one-rope-base": "gemma3", "full-rotary": "glm4", "no-post-norm": "olmo2",
                   "olmo3-no-window": "olmo3", "exaone4-no-window": "exaone4", "exaone4-rope-everywhere": "exaone4"}


@pytest.mark.parametrize("change", ["no-softcap", "no-window", "one-rope-base", "pre-norm-as-post", "full-rotary",
                                    "no-post-norm", "olmo3-no-window", "exaone4-no-window",
                                    "exaone4-rope-everywhere"])
def test_reference_forward_depends_on_each_setting(tmp_path: Path, change: str) -> None:
    """The check above is sensitive: dropping any one setting moves the logits beyond its tolerance."""
    family = _CHANGED_FAMILY.get(change, "gemma2")
    model = build_postnorm_model(family, seed=5)
    model.save_pretrained(tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    pgconvert.convert(tmp_path / "hf", tmp_path / "m", dst_format="megatron", dst_tp=2, dst_pp=1)
    ranks = read_megatron_tp_ranks(tmp_path / "m")
    ids = input_ids(VOCAB)
    if change == "no-softcap":
        hf["attn_logit_softcapping"] = None
    elif change in ("no-window", "olmo3-no-window", "exaone4-no-window"):
        hf["sliding_window"] = 1000
    elif change == "exaone4-rope-everywhere":  # SmolLM3's spelling, which the reference reads first
        hf["no_rope_layers"] = [1] * hf["num_hidden_layers"]
    elif change == "one-rope-base":
        hf["rope_parameters"]["sliding_attention"] = hf["rope_parameters"]["full_attention"]
    elif change == "full-rotary":
        hf["rope_parameters"]["partial_rotary_factor"] = 1.0
    elif change == "no-post-norm":
        for rank in ranks:
            del rank["decoder.layers.2.mlp.linear_fc2.post_layernorm.weight"]
    else:
        for rank in ranks:
            key = "decoder.layers.1.self_attention.linear_proj.post_layernorm.weight"
            rank[key] = rank["decoder.layers.1.pre_mlp_layernorm.weight"].clone()

    actual = postnorm_tp_logits(ranks, hf, ids)

    expected = hf_logits(model, ids).to(torch.float64)
    assert not torch.allclose(actual, expected, rtol=1e-4, atol=1e-4)


def test_megatron_args_and_manifest_carry_the_settings(sources: dict[str, Path], tmp_path: Path) -> None:
    report = pgconvert.convert(sources["gemma3"], tmp_path / "m", dst_format="megatron", dst_tp=2, dst_pp=1)

    args = _rank_args(tmp_path / "m")
    manifest = json.loads((tmp_path / "m" / "pgconvert.json").read_text())["model_config"]

    assert (args.post_self_attn_layernorm, args.post_mlp_layernorm, args.pre_layernorms) == (True, True, True)
    assert args.layernorm_zero_centered_gamma and args.embedding_scale_sqrt_hidden
    assert (args.swiglu, args.gated_linear_unit, args.openai_gelu) == (False, True, True)
    # One spelling of the attention scale in args: megatron-core's softmax_scale (pgconvert.semantics.attention_scale).
    assert args.query_pre_attn_scalar is None and args.softmax_scale == 24.0 ** -0.5
    assert (args.rotary_base, args.rotary_base_local) == (1_000_000.0, 10_000.0)
    assert args.rotary_seq_len_interpolation_factor == 8.0
    assert args.final_logit_softcapping == 3.0 and args.attn_logit_softcapping is None
    assert args.window_size == (4, 0) and args.window_attn_skip_freq == [1, 1, 1, 1, 1, 0]
    assert manifest["rotary_base_local"] == 10_000.0 and manifest["post_mlp_layernorm"] is True
    assert any("full-attention layers' RoPE only" in notice for notice in report.notices)


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_checkpoint_without_hf_folder_is_written_as_its_family(sources: dict[str, Path], tmp_path: Path,
                                                                        family: str) -> None:
    """config.json rebuilt from the Megatron args alone (the family's rules written) gives the same model."""
    src = sources[family]
    pgconvert.convert(src, tmp_path / "m", dst_format="megatron", dst_tp=2, dst_pp=2)
    shutil.rmtree(tmp_path / "m" / "hf")

    pgconvert.convert(tmp_path / "m", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)

    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == [ARCHITECTURES[family]]
    assert_same_hf_tensors(src, tmp_path / "hf")
    ids = input_ids(VOCAB)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key,value,message", [
    ("rope_parameters", {"sliding_attention": {"rope_type": "yarn", "factor": 2.0},
                         "full_attention": {"rope_type": "default"}}, "sliding_attention.rope_type='yarn'"),
    ("final_logit_softcapping", "big", "final_logit_softcapping='big'"),
    ("layer_types", ["sliding_attention"], "layer_types="),
    ("hidden_activation", "gelu", "hidden_activation='gelu'"),
])
def test_gemma3_config_pgconvert_cannot_convert_is_refused_by_name(sources: dict[str, Path], tmp_path: Path,
                                                                   key: str, value: object, message: str) -> None:
    src = tmp_path / "src"
    shutil.copytree(sources["gemma3"], src)
    doc = json.loads((src / "config.json").read_text())
    doc[key] = value
    (src / "config.json").write_text(json.dumps(doc))

    with pytest.raises(CheckpointError, match="config.json") as caught:
        pgconvert.convert(src, tmp_path / "m", dst_format="megatron", dst_tp=2)

    assert message in str(caught.value)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("family", ["olmo2", "olmo3", "exaone4"])
def test_olmo2_under_strict_is_refused_for_a_megatron_target_and_converts_with_a_notice_without(
        sources: dict[str, Path], tmp_path: Path, family: str) -> None:
    """No megatron-core or Megatron-Bridge layer spec computes OLMo 2's (OLMo 3's, EXAONE 4's) missing pre-norms."""
    from pgconvert.errors import StrictModeError

    with pytest.raises(StrictModeError, match="pre_layernorms=False"):
        pgconvert.convert(sources[family], tmp_path / "strict", dst_format="megatron", dst_tp=2, strict=True)
    report = pgconvert.convert(sources[family], tmp_path / "m", dst_format="megatron", dst_tp=2)

    assert not (tmp_path / "strict").exists()
    assert any("not carried: pre_layernorms=False" in notice for notice in report.notices), report.notices
    args = _rank_args(tmp_path / "m")
    assert (args.pre_layernorms, args.post_self_attn_layernorm, args.qk_layernorm) == (False, True, True)
    assert args.qk_layernorm_across_heads == (family != "exaone4")


@pytest.mark.parametrize("family, named", [("gemma2", "attn_logit_softcapping=2.0"),
                                           ("gemma", "embedding_scale_sqrt_hidden=True")])
def test_gemma_under_strict_converts_to_megatron(sources: dict[str, Path], tmp_path: Path, family: str,
                                                 named: str) -> None:
    """Megatron-Bridge's Gemma layers compute every Gemma setting: a notice, no refusal."""
    report = pgconvert.convert(sources[family], tmp_path / "m", dst_format="megatron", dst_tp=2, strict=True)

    assert any(named in notice and "Megatron-Bridge" in notice for notice in report.notices), report.notices


def test_gemma_megatron_args_carry_its_norms_embedding_scale_geglu_and_head_dim(sources: dict[str, Path],
                                                                                 tmp_path: Path) -> None:
    pgconvert.convert(sources["gemma"], tmp_path / "m", dst_format="megatron", dst_tp=2, dst_pp=1)

    args = _rank_args(tmp_path / "m")

    assert args.layernorm_zero_centered_gamma and args.embedding_scale_sqrt_hidden
    assert (args.swiglu, args.gated_linear_unit, args.openai_gelu) == (False, True, True)
    assert (args.post_self_attn_layernorm, args.post_mlp_layernorm, args.qk_layernorm) == (False, False, False)
    assert (args.kv_channels, args.num_query_groups, args.untie_embeddings_and_output_weights) == (24, 4, False)
    assert args.softmax_scale is None and args.window_size is None and args.final_logit_softcapping is None


def test_gemma_releases_hidden_act_gelu_is_the_tanh_gelu_and_kept(sources: dict[str, Path], tmp_path: Path) -> None:
    """gemma-2b/7b ship hidden_act "gelu", which GemmaConfig reads as gelu_pytorch_tanh."""
    src = Path(shutil.copytree(sources["gemma"], tmp_path / "src"))
    doc = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**doc, "hidden_act": "gelu"}))

    pgconvert.convert(src, tmp_path / "m", dst_format="megatron", dst_tp=2, dst_pp=2)
    pgconvert.convert(tmp_path / "m", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)

    assert json.loads((tmp_path / "hf" / "config.json").read_text())["hidden_act"] == "gelu"
    ids = input_ids(VOCAB)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(sources["gemma"], ids), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("key, value, message", [
    ("hidden_act", "silu", "hidden_act='silu': Gemma is converted with gelu_pytorch_tanh"),
    ("hidden_act", None, "hidden_act=None"),
    ("attention_bias", True, "attention_bias=True: GemmaForCausalLM is converted only with attention_bias=False"),
])
def test_gemma_config_pgconvert_cannot_convert_is_refused_by_name(sources: dict[str, Path], tmp_path: Path,
                                                                  key: str, value: object, message: str) -> None:
    src = Path(shutil.copytree(sources["gemma"], tmp_path / "src"))
    doc = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**doc, key: value}))

    with pytest.raises(CheckpointError, match="config.json") as caught:
        pgconvert.convert(src, tmp_path / "m", dst_format="megatron", dst_tp=2)

    assert message in str(caught.value)
    assert not (tmp_path / "m").exists()


def test_gemma_2b_multi_query_attention_converts_at_pp2_and_is_refused_at_tp2_by_name(tmp_path: Path) -> None:
    """gemma-2b's one KV head: megatron-core splits query groups over TP ranks, so TP2 cannot hold it."""
    src = save_postnorm_model("gemma", tmp_path / "src", seed=4, num_key_value_heads=1, head_dim=32)

    with pytest.raises(PgconvertError, match="num_query_groups=1 is not divisible by 2"):
        pgconvert.convert(src, tmp_path / "tp2", dst_format="megatron", dst_tp=2)
    pgconvert.convert(src, tmp_path / "m", dst_format="megatron", dst_tp=1, dst_pp=2)
    pgconvert.convert(tmp_path / "m", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)

    assert not (tmp_path / "tp2").exists()
    assert_same_hf_tensors(src, tmp_path / "hf")
    ids = input_ids(VOCAB)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


def test_olmoe_and_glm4_args(sources: dict[str, Path], tmp_path: Path) -> None:
    pgconvert.convert(sources["olmoe"], tmp_path / "olmoe", dst_format="megatron", dst_tp=2, dst_ep=2)
    pgconvert.convert(sources["glm4"], tmp_path / "glm4", dst_format="megatron", dst_tp=2)

    olmoe, glm4 = _rank_args(tmp_path / "olmoe"), _rank_args(tmp_path / "glm4")

    assert (olmoe.num_experts, olmoe.moe_router_topk, olmoe.moe_router_pre_softmax) == (4, 2, True)
    assert olmoe.qk_layernorm and olmoe.qk_layernorm_across_heads and olmoe.swiglu
    assert (glm4.rotary_interleaved, glm4.rotary_percent, glm4.add_qkv_bias) == (True, 0.5, True)
    assert glm4.post_self_attn_layernorm and glm4.post_mlp_layernorm and glm4.pre_layernorms


def test_interleaved_rotary_reorders_a_whole_projection_q_norm_head_by_head() -> None:
    from pgconvert.model.config import ModelConfig
    from savers.hf import rotate_half_order

    config = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=8, kv_channels=4,
                         qk_layernorm=True, qk_layernorm_across_heads=True, rotary_interleaved=True)
    weight = torch.arange(8.0)

    reordered = rotate_half_order("head", weight, config)  # the q-norm kind's rotary

    assert reordered.tolist() == [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]


def test_transformer_engine_naming_is_megatron_bridges_for_gemma3(sources: dict[str, Path], tmp_path: Path) -> None:
    """Megatron-Bridge's Gemma 3 mapping (gemma3_bridge.py): pre norms fused into linear_qkv / linear_fc1,
    post norms inside linear_proj / linear_fc2."""
    src = sources["gemma3"]
    pgconvert.convert(src, tmp_path / "m", dst_format="megatron", dst_tp=2, dst_transformer_impl="transformer_engine")
    pgconvert.convert(tmp_path / "m", tmp_path / "hf", dst_format="hf")

    ranks = read_megatron_tp_ranks(tmp_path / "m")
    layer = {key.removeprefix("decoder.layers.0.") for key in ranks[0] if key.startswith("decoder.layers.0.")}
    assert {"self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_proj.post_layernorm.weight",
            "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc2.post_layernorm.weight",
            "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"} <= layer
    assert "input_layernorm.weight" not in layer and "pre_mlp_layernorm.weight" not in layer
    assert_same_hf_tensors(src, tmp_path / "hf")


# --- OLMo 3 ---------------------------------------------------------------------------------------

# allenai/Olmo-3-7B's config.json RoPE (4.x's rope_scaling, which Olmo3Config lays over the full-attention layers).
OLMO3_RELEASED_YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "beta_fast": 32,
                       "beta_slow": 1, "attention_factor": 1.2079441541679836}


def test_olmo3_megatron_args_hold_its_window_pattern_rope_base_and_norms(sources: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    report = pgconvert.convert(sources["olmo3"], tmp_path / "m", dst_format="megatron", dst_tp=2, dst_pp=2)

    args = _rank_args(tmp_path / "m")

    assert (args.window_size, args.window_attn_skip_freq) == ((4, 0), [1, 1, 1, 0])
    assert (args.rotary_base, args.position_embedding_type, args.num_query_groups) == (500000.0, "rope", 4)
    assert (args.pre_layernorms, args.post_self_attn_layernorm, args.qk_layernorm_across_heads) == (False, True, True)
    assert any("not carried: pre_layernorms=False" in notice for notice in report.notices), report.notices


def _olmo3_with(src: Path, dst: Path, change: dict[str, object], drop: tuple[str, ...] = ()) -> Path:
    shutil.copytree(src, dst)
    doc = {key: value for key, value in json.loads((dst / "config.json").read_text()).items() if key not in drop}
    (dst / "config.json").write_text(json.dumps({**doc, **change}))
    return dst


def test_olmo3_older_top_level_rope_theta_is_the_full_attention_layers_base_only(sources: dict[str, Path],
                                                                                tmp_path: Path) -> None:
    """Olmo3Config gives a top-level rope_theta to the full-attention layers; the sliding ones keep 500000."""
    src = _olmo3_with(sources["olmo3"], tmp_path / "src", {"rope_theta": 10000.0}, drop=("rope_parameters",))

    with pytest.raises(CheckpointError, match="Megatron applies one RoPE to every layer") as caught:
        pgconvert.convert(src, tmp_path / "m", dst_format="megatron", dst_tp=2)

    assert "'rope_theta': 10000.0" in str(caught.value) and "'rope_theta': 500000.0" in str(caught.value)


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
def test_olmo3_long_context_releases_yarn_on_full_attention_layers_only_is_refused_by_name(
        sources: dict[str, Path], tmp_path: Path, spelling: str) -> None:
    if spelling == "rope_scaling":  # as the release's config.json holds it
        change: dict[str, object] = {"rope_scaling": OLMO3_RELEASED_YARN, "rope_theta": 500000}
        src = _olmo3_with(sources["olmo3"], tmp_path / "src", change, drop=("rope_parameters",))
    else:
        blocks = {"sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
                  "full_attention": {**OLMO3_RELEASED_YARN, "rope_theta": 500000.0}}
        src = _olmo3_with(sources["olmo3"], tmp_path / "src", {"rope_parameters": blocks})

    with pytest.raises(CheckpointError, match="config.json") as caught:
        pgconvert.convert(src, tmp_path / "m", dst_format="megatron", dst_tp=2)

    assert "Megatron applies one RoPE to every layer" in str(caught.value)
    assert "'rope_type': 'yarn'" in str(caught.value)
    assert not (tmp_path / "m").exists()


def test_olmo3_yarn_on_full_attention_layers_converts_where_every_layer_is_full(sources: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    """Without sliding layers only the full-attention layers' RoPE is used: megatron-core's YaRN computes it."""
    blocks = {"sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
              "full_attention": {**OLMO3_RELEASED_YARN, "attention_factor": None, "rope_theta": 500000.0}}
    src = save_postnorm_model("olmo3", tmp_path / "src", seed=4, rope_parameters=blocks,
                              layer_types=["full_attention"] * 4)

    pgconvert.convert(src, tmp_path / "m", dst_format="megatron", dst_tp=2, dst_pp=2)
    pgconvert.convert(tmp_path / "m", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)

    args = _rank_args(tmp_path / "m")
    assert (args.position_embedding_type, args.rotary_scaling_factor, args.window_size) == ("yarn", 8.0, None)
    assert_same_hf_tensors(src, tmp_path / "hf")
    ids = input_ids(VOCAB)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


# --- EXAONE 4 -------------------------------------------------------------------------------------

def test_exaone4_megatron_args_hold_its_window_global_nope_per_head_qk_norm_and_rope(sources: dict[str, Path],
                                                                                     tmp_path: Path) -> None:
    pgconvert.convert(sources["exaone4"], tmp_path / "32b", dst_format="megatron", dst_tp=2, dst_pp=2)
    pgconvert.convert(sources["exaone4-1.2b"], tmp_path / "1.2b", dst_format="megatron", dst_tp=2, dst_pp=2)

    large, small = _rank_args(tmp_path / "32b"), _rank_args(tmp_path / "1.2b")

    assert (large.window_size, large.window_attn_skip_freq, large.no_rope_freq) == ((4, 0), [1, 1, 1, 0], [0, 0, 0, 1])
    assert (small.window_size, small.no_rope_freq) == (None, None)
    for args in (large, small):
        assert (args.qk_layernorm, args.qk_layernorm_across_heads, args.pre_layernorms) == (True, False, False)
        assert (args.rotary_base, args.rope_scaling_factor, args.kv_channels) == (1_000_000.0, 16.0, 8)
    assert (large.untie_embeddings_and_output_weights, small.untie_embeddings_and_output_weights) == (True, False)


def _exaone4_with(src: Path, dst: Path, change: dict[str, object]) -> Path:
    """A copy of ``src`` whose config.json has ``change`` (a None value: the key removed)."""
    shutil.copytree(src, dst)
    doc = json.loads((dst / "config.json").read_text())
    doc.update(change)
    (dst / "config.json").write_text(json.dumps({key: value for key, value in doc.items() if value is not None}))
    return dst


@pytest.mark.parametrize("change", [
    # the 32B release as first published (transformers 4.54): an integer period, no layer_types, 4.x's RoPE keys
    {"layer_types": None, "sliding_window_pattern": 4, "rope_parameters": None, "rope_theta": 1000000,
     "rope_scaling": {key: value for key, value in EXAONE4_ROPE.items() if key != "rope_theta"}},
    {"sliding_window_pattern": None},  # layer_types given, the period is unused
], ids=["integer-period-rope-scaling", "no-period"])
def test_exaone4_released_spellings_read_as_the_same_model(sources: dict[str, Path], tmp_path: Path,
                                                           change: dict[str, object]) -> None:
    src = _exaone4_with(sources["exaone4"], tmp_path / "src", change)

    pgconvert.convert(src, tmp_path / "m", dst_format="megatron", dst_tp=2)

    args = _rank_args(tmp_path / "m")
    assert (args.window_size, args.window_attn_skip_freq, args.no_rope_freq) == ((4, 0), [1, 1, 1, 0], [0, 0, 0, 1])
    assert (args.rotary_base, args.rope_scaling_factor) == (1_000_000.0, 16.0)
    ids = input_ids(VOCAB)
    torch.testing.assert_close(hf_logits(src, ids), hf_logits(sources["exaone4"], ids), rtol=0, atol=0)


@pytest.mark.parametrize("family, change, expected", [
    ("exaone4", {"layer_types": None}, "sliding_window_pattern='LLLG' without layer_types: Exaone4Config fills "
                                       "layer_types only from a positive integer period"),
    ("exaone4-1.2b", {"layer_types": None}, "sliding_window=null without layer_types"),
], ids=["string-period-alone", "no-window-no-layer-types"])
def test_exaone4_configs_transformers_cannot_build_are_refused_by_name(sources: dict[str, Path], tmp_path: Path,
                                                                       family: str, change: dict[str, object],
                                                                       expected: str) -> None:
    assert_config_refused(sources[family], tmp_path, change, expected)


def test_exaone4_nope_on_a_sliding_layer_is_not_written_as_exaone4() -> None:
    from pgconvert.families.exaone import EXAONE4
    from pgconvert.formats.hf import family_mismatches
    from pgconvert.model.config import ModelConfig

    config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, sliding_window=5,
                         window_layers=(1, 1, 1, 0), no_rope_layers=(1, 0, 0, 1))

    assert any("no_rope_layers=[1, 0, 0, 1] (needs [0, 0, 0, 1]" in reason
               for reason in family_mismatches(EXAONE4, config))
