"""DeepSeek-V2/V3 (multi-latent attention, shared experts, DeepSeek's routers, YaRN) through pgconvert.

* HF -> Megatron (TP2/EP4/PP2, a VPP layout, torch_dist) -> HF is bit-exact and transformers'
  logits of the output equal the source's;
* the TP split of the MLA projections, checked against shards cut by hand from the HF tensors
  (not through pgconvert's merge), for megatron-core's local spec (down projections column-parallel)
  and its Transformer Engine spec (down projections duplicated, latent norms fused into the up
  projections);
* megatron-core's own GPTModel with the MLA decoder block spec, built from the written args, loads
  the rank file with ``strict=True`` and its CPU forward equals transformers' logits.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from support.deepseek_helpers import CASES, build_deepseek, logits, save
from support.torch_dist_forms import FOR_MCORE_016
from safetensors.torch import load_file

import pgconvert
from pgconvert.cli import main

TOL = dict(rtol=1e-5, atol=1e-5)
# megatron-core's forward sums in another order (MoE unpermute, router, rotary): float32 round-off of
# logits of size ~1 reaches 2e-5 on a few elements of 10000.
MCORE_TOL = dict(rtol=1e-4, atol=5e-5)
SEQ = 20  # past YaRN's original context of 8 positions
# config.json keys the families carry (compared after a round trip through Megatron args alone).
CARRIED = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
           "num_experts_per_tok", "moe_intermediate_size", "intermediate_size", "first_k_dense_replace",
           "n_shared_experts", "routed_scaling_factor", "rope_parameters", "vocab_size")


def input_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 250, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def rank_state(root: Path, tp: int, pp: int | None = None, ep: int | None = None) -> dict[str, Any]:
    """One rank file of a Megatron checkpoint, read as plain torch (names mp_rank_TT[_PPP][_EEE])."""
    name = f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if pp is not None else "") + (f"_{ep:03d}" if ep is not None else "")
    (path,) = root.glob(f"*/{name}/model_optim_rng.pt")
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)


def source(tmp_path: Path, case: str) -> tuple[Any, Path]:
    model = build_deepseek(case)
    return model, save(model, tmp_path / f"hf-{case}")


def from_args_alone(megatron: Path, out: Path) -> Path:
    """Megatron -> HF with the config.json built from the rank files' args (the hf/ copy removed)."""
    shutil.rmtree(megatron / "hf", ignore_errors=True)
    pgconvert.convert(megatron, out, dst_format="hf", dst_tp=1, dst_pp=1, dst_ep=1)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_megatron_tp2_ep4_pp2_hf_is_exact_and_logits_match(tmp_path: Path, case: str) -> None:
    model, src = source(tmp_path, case)
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=2, dst_ep=4)
    out = from_args_alone(tmp_path / "megatron", tmp_path / "out")

    before, after = hf_tensors(src), hf_tensors(out)
    assert sorted(before) == sorted(after)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    written, original = json.loads((out / "config.json").read_text()), json.loads((src / "config.json").read_text())
    for key in CARRIED:
        assert written.get(key) == original.get(key), key
    ids = input_ids()
    torch.testing.assert_close(logits(out, ids), logits(model, ids), **TOL)


def test_vpp_and_torch_dist_round_trips_are_exact(tmp_path: Path) -> None:
    model, src = source(tmp_path, "v3")
    pgconvert.convert(src, tmp_path / "vpp", dst_format="megatron", dst_tp=2, dst_pp=2, dst_vpp=2, dst_ep=2)
    pgconvert.convert(tmp_path / "vpp", tmp_path / "dist", dst_format="torch_dist", dst_tp=1, dst_pp=2, dst_ep=4, **FOR_MCORE_016,
                      dst_vpp=1)
    out = from_args_alone(tmp_path / "dist", tmp_path / "out")

    before, after = hf_tensors(src), hf_tensors(out)
    assert sorted(before) == sorted(after)
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())
    ids = input_ids()
    torch.testing.assert_close(logits(out, ids), logits(model, ids), **TOL)


def _shard(full: torch.Tensor, rank: int, size: int, dim: int = 0) -> torch.Tensor:
    step = full.shape[dim] // size
    return full.narrow(dim, rank * step, step)


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_mla_tp2_shards_are_the_hf_tensors_cut_by_hand(tmp_path: Path, impl: str) -> None:
    """megatron-core's MLASelfAttention (local spec: every projection a ColumnParallelLinear; TE spec:
    the down projections TELinear(parallel_mode='duplicated'), the up projections
    TELayerNormColumnParallelLinear holding the latent norms) and its RowParallelLinear linear_proj."""
    _, src = source(tmp_path, "v3")
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=1, dst_ep=1,
                      dst_transformer_impl=impl)
    hf = hf_tensors(src)
    te = impl == "transformer_engine"
    for rank in range(2):
        state = rank_state(tmp_path / "megatron", rank)["model"]
        for layer in (0, 1):
            a, m = f"model.layers.{layer}.self_attn.", f"decoder.layers.{layer}.self_attention."
            expected = {
                m + "linear_q_down_proj.weight": hf[a + "q_a_proj.weight"] if te else _shard(hf[a + "q_a_proj.weight"], rank, 2),
                m + "linear_kv_down_proj.weight": (hf[a + "kv_a_proj_with_mqa.weight"] if te
                                                   else _shard(hf[a + "kv_a_proj_with_mqa.weight"], rank, 2)),
                m + "linear_q_up_proj.weight": _shard(hf[a + "q_b_proj.weight"], rank, 2),
                m + "linear_kv_up_proj.weight": _shard(hf[a + "kv_b_proj.weight"], rank, 2),
                m + "linear_proj.weight": _shard(hf[a + "o_proj.weight"], rank, 2, dim=1),
                m + ("linear_q_up_proj.layer_norm_weight" if te else "q_layernorm.weight"): hf[a + "q_a_layernorm.weight"],
                m + ("linear_kv_up_proj.layer_norm_weight" if te else "kv_layernorm.weight"): hf[a + "kv_a_layernorm.weight"],
                f"decoder.layers.{layer}.input_layernorm.weight": hf[f"model.layers.{layer}.input_layernorm.weight"],
            }
            for name, tensor in expected.items():
                assert torch.equal(state[name], tensor), (rank, name)


def test_router_expert_bias_stays_float32_and_args_name_the_router(tmp_path: Path) -> None:
    _, src = source(tmp_path, "v3")
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=1, dst_pp=1, dst_ep=1, dtype="bf16")
    state = rank_state(tmp_path / "megatron", 0)
    model, args = state["model"], state["args"]
    bias = model["decoder.layers.1.mlp.router.expert_bias"]

    assert bias.dtype == torch.float32
    assert torch.equal(bias, hf_tensors(src)["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert model["decoder.layers.1.self_attention.linear_q_up_proj.weight"].dtype == torch.bfloat16
    assert (args.multi_latent_attention, args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim,
            args.qk_pos_emb_head_dim, args.v_head_dim) == (True, 24, 16, 16, 8, 12)
    assert (args.moe_router_score_function, args.moe_router_enable_expert_bias, args.moe_router_num_groups,
            args.moe_router_group_topk, args.moe_router_topk_scaling_factor) == ("sigmoid", True, 2, 1, 2.5)
    assert args.moe_layer_freq == [0, 1, 1, 1] and args.moe_shared_expert_intermediate_size == 32
    assert (args.position_embedding_type, args.rope_type, args.rotary_scaling_factor, args.mscale_all_dim,
            args.original_max_position_embeddings) == ("rope", "yarn", 4.0, 0.8, 8)


# --- megatron-core's own forward ----------------------------------------------------------------


def mcore_mla_logits(root: Path, tokens: torch.Tensor) -> torch.Tensor:
    """megatron-core's GPTModel (MLA decoder block spec, local backend) for the TP1/PP1/EP1 checkpoint
    at ``root``, its config built from the rank file's args, loaded with ``strict=True``.

    megatron-core cannot run MLA on CPU as shipped: MultiLatentAttention passes ``k_channels`` /
    ``v_channels`` to its core attention, which only Transformer Engine's TEDotProductAttention
    accepts (the local DotProductAttention raises TypeError), and Transformer Engine needs CUDA. The
    test swaps in ``CausalAttention`` below (softmax(q k^T * softmax_scale) v, causal), with the
    softmax scale megatron-core computes (YaRN mscale included); every projection, norm, rotary,
    router and expert is megatron-core's.
    """
    import support.mcore_helpers as mcore
    from support.megatron_mla import build_mla_gpt_model, mla_cpu_patches

    (rank,) = mcore.rank_files(root)
    with torch.no_grad(), mla_cpu_patches():
        model = build_mla_gpt_model(rank.args)
        model.load_state_dict(dict(rank.model), strict=True)
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        out = model(input_ids=tokens, position_ids=positions,
                    attention_mask=mcore.causal_attention_mask(tokens.shape[1]))
    return out[..., :250]


@pytest.mark.parametrize("case", sorted(CASES))
def test_megatron_core_mla_forward_of_the_written_checkpoint_equals_transformers(tmp_path: Path, case: str) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    model, src = source(tmp_path, case)
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=1, dst_pp=1, dst_ep=1)
    ids = input_ids()

    torch.testing.assert_close(mcore_mla_logits(tmp_path / "megatron", ids), logits(model, ids), **MCORE_TOL)


# --- what is refused -----------------------------------------------------------------------------


def _edited(src: Path, **changes: Any) -> Path:
    doc = json.loads((src / "config.json").read_text())
    doc.update(changes)
    (src / "config.json").write_text(json.dumps(doc))
    return src


@pytest.mark.parametrize("changes,named", [
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"rope_interleave": False}, "rope_interleave=False"),
    ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2}, "n_group=4, topk_group=2"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok=1"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope type 'linear'"),
], ids=["unnormalized-sigmoid", "rope-not-interleaved", "group-score", "top-1-sigmoid", "linear-rope"])
def test_v3_settings_megatron_core_computes_differently_are_refused(
        tmp_path: Path, changes: dict[str, Any], named: str) -> None:
    _, src = source(tmp_path, "v3")
    result = CliRunner().invoke(main, ["convert", str(_edited(src, **changes)), str(tmp_path / "out"),
                                       "--dst-format", "megatron"])

    assert result.exit_code != 0 and named in result.output, result.output
    assert "Traceback" not in result.output


def test_an_incomplete_multi_token_prediction_layer_is_refused_naming_what_is_missing(tmp_path: Path) -> None:
    """MTP layers convert (tests/test_mtp.py); one stored in part is a named error."""
    from safetensors.torch import save_file

    _, src = source(tmp_path, "v3")
    tensors = load_file(src / "model.safetensors")
    save_file({**tensors, "model.layers.4.eh_proj.weight": torch.zeros(64, 128)}, src / "model.safetensors",
              metadata={"format": "pt"})
    result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "--dst-format", "megatron"])

    assert result.exit_code != 0 and "missing: ['model.layers.4.enorm.weight'" in result.output, result.output
    assert "mtp.layers.0.hnorm.weight" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("case", ["v3", "v2"])
def test_torch_dist_keys_shapes_and_chunks_are_what_megatron_core_declares_for_mla(tmp_path: Path, case: str) -> None:
    """megatron-core's MLA layer specs set no sharded_state_dict_keys_map: the local spec's norms keep
    their module names (not the dense spec's ``linear_qkv.layer_norm_weight``)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    import support.mcore_helpers as mcore
    from support.megatron_mla import build_mla_gpt_model, mla_cpu_patches
    from support.mcore_gpt_models import megatron_core_layout, read_layout

    _, src = source(tmp_path, case)
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=1, dst_pp=1, dst_ep=1)
    pgconvert.convert(tmp_path / "megatron", tmp_path / "dist", dst_format="torch_dist", **FOR_MCORE_016)
    (rank,) = mcore.rank_files(tmp_path / "megatron")
    with mla_cpu_patches():
        expected_tensors, expected_objects = megatron_core_layout(build_mla_gpt_model(rank.args))

    (iteration,) = (tmp_path / "dist").glob("iter_*")
    tensors, objects = read_layout(iteration)
    assert objects == expected_objects
    assert sorted(tensors) == sorted(expected_tensors)
    for key, (shape, _, chunks) in expected_tensors.items():
        assert tensors[key][0] == shape and tensors[key][2] == chunks, key


# --- release configurations ----------------------------------------------------------------------

_V3_RELEASE: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "attention_dropout": 0.0, "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}
# Kimi-K2 names DeepseekV3ForCausalLM: one expert group, 384 experts, its own YaRN.
_KIMI_K2 = {**_V3_RELEASE, "model_type": "kimi_k2", "n_group": 1, "topk_group": 1, "n_routed_experts": 384,
            "num_attention_heads": 64, "num_key_value_heads": 64, "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.827, "rope_theta": 50000.0, "max_position_embeddings": 131072,
            "vocab_size": 163840, "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                                                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                   "type": "yarn"}}
_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "attention_bias": False,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 10944, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 1408, "first_k_dense_replace": 1, "n_group": 1,
    "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "routed_scaling_factor": 1.0,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "scoring_func": "softmax", "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "greedy", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 102400,
}


@pytest.mark.parametrize("doc,expected", [
    (_V3_RELEASE, dict(q_lora_rank=1536, groups=(8, 4), dense=3, scaling=2.5, rope=(40.0, 1.0, 1.0, 32.0),
                       shared=2048, score="sigmoid")),
    (_KIMI_K2, dict(q_lora_rank=1536, groups=(None, None), dense=1, scaling=2.827, rope=(32.0, 1.0, 1.0, 1.0),
                    shared=2048, score="sigmoid")),
    (_V2_LITE, dict(q_lora_rank=None, groups=(None, None), dense=1, scaling=1.0, rope=(40.0, 0.707, 0.707, 32.0),
                    shared=2816, score="softmax")),
], ids=["deepseek-v3", "kimi-k2", "deepseek-v2-lite"])
def test_release_configs_read_into_megatron_args(doc: dict[str, Any], expected: dict[str, Any]) -> None:
    from pgconvert.formats.hf import model_config_from_hf
    from pgconvert.model.layout import ParallelLayout
    from pgconvert.formats.megatron import args_for_target

    family, config, notices = model_config_from_hf(doc, Path("config.json"))
    args = args_for_target(config, ParallelLayout(), 163840, torch.bfloat16, None, None)

    assert notices == [] and family.architecture == doc["architectures"][0]
    assert (args.multi_latent_attention, args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim,
            args.qk_pos_emb_head_dim, args.v_head_dim) == (True, expected["q_lora_rank"], 512, 128, 64, 128)
    assert (args.moe_router_num_groups, args.moe_router_group_topk) == expected["groups"]
    assert args.moe_layer_freq == [0] * expected["dense"] + [1] * (doc["num_hidden_layers"] - expected["dense"])
    assert args.moe_router_topk_scaling_factor == expected["scaling"]
    assert args.moe_shared_expert_intermediate_size == expected["shared"]
    assert args.moe_router_score_function == expected["score"]
    assert (args.rope_type, args.rotary_scaling_factor, args.mscale, args.mscale_all_dim, args.beta_fast) == (
        "yarn", *expected["rope"])
    assert args.original_max_position_embeddings == 4096 and args.rotary_base == float(doc["rope_theta"])
