"""DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention: a lightning indexer beside multi-latent attention) through
pgconvert.

The source is transformers' own tiny DeepSeek-V3.2 in the released configuration (``support.deepseek_v32_models``),
whose indexer keeps 4 of up to 12 keys per query:

* HF -> Megatron TP2/PP2/EP2 -> torch_dist -> HF (config.json rebuilt from the Megatron args alone) is bit-exact
  and transformers' logits of the output equal the source's;
* the rank files hold the indexer as megatron-core's sparse attention spec does: whole on every TP rank, the q/kv
  latent norms apart from the up projections even in the Transformer Engine spec;
* megatron-core's own GPTModel with DSAttention/DSAIndexer, built from the written args, loads the TP1 rank file
  with ``strict=True`` and its CPU forward equals transformers' (``support.mcore_dsa`` says what stands in);
* knock-outs: the indexer's rotary dims placed as megatron-core 0.16.1 takes them, another top-k, or the
  indexers of two layers swapped change the logits; settings with no equivalent are refused by name;
* GLM-5 (transformers' GlmMoeDsa: V3.2's layers, its indexer's RoPE interleaved): the same round trip and
  megatron-core forward, the interleaving knocked out, cross-layer top-k sharing refused by name.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.deepseek_v32_models import GLM5_TINY, RELEASED, SEQ, TINY, input_ids, logits, write_tiny
from support.torch_dist_forms import FOR_MCORE_016

import pgconvert
from pgconvert.errors import PgconvertError
from pgconvert.semantics import mla

TOL = dict(rtol=1e-5, atol=1e-5)
# megatron-core sums in another order (MoE unpermute, router, rotary); measured 5e-6 on logits of size ~9.
MCORE_TOL = dict(rtol=1e-4, atol=5e-5)
_INDEXER = "model.layers.{}.self_attn.indexer."


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("v32") / "hf")


@pytest.fixture(scope="module")
def source_logits(source: Path) -> torch.Tensor:
    return logits(source, input_ids())


@pytest.fixture(scope="module")
def megatron_tp2(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("v32-megatron") / "megatron"
    pgconvert.convert(source, out, dst_format="megatron", dst_tp=2, dst_pp=2, dst_ep=2)
    return out


def _rank(root: Path, name: str) -> dict[str, Any]:
    (path,) = root.glob(f"*/{name}/model_optim_rng.pt")
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, map_location="cpu", weights_only=True)


def test_the_indexer_chooses_a_subset_that_changes_the_logits(source: Path, source_logits: torch.Tensor,
                                                              tmp_path: Path) -> None:
    dense = tmp_path / "dense"
    shutil.copytree(source, dense)
    (dense / "config.json").write_text(json.dumps({**TINY, "index_topk": SEQ}))

    assert TINY["index_topk"] < SEQ
    assert not torch.allclose(logits(dense, input_ids()), source_logits, **TOL)


def test_hf_megatron_tp2_pp2_ep2_torch_dist_hf_is_exact_and_logits_equal(
        source: Path, source_logits: torch.Tensor, megatron_tp2: Path, tmp_path: Path) -> None:
    args_alone = tmp_path / "megatron"
    shutil.copytree(megatron_tp2, args_alone)
    shutil.rmtree(args_alone / "hf")
    pgconvert.convert(args_alone, tmp_path / "dist", dst_format="torch_dist", dst_tp=1, dst_pp=2, dst_ep=1)
    pgconvert.convert(tmp_path / "dist", tmp_path / "out", dst_format="hf")

    before, after = hf_tensors(source), hf_tensors(tmp_path / "out")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["DeepseekV32ForCausalLM"]
    assert {key: written[key] for key in ("index_n_heads", "index_head_dim", "index_topk")} == {
        "index_n_heads": 4, "index_head_dim": 16, "index_topk": 4}
    assert written["mlp_layer_types"] == ["dense", "sparse", "sparse", "sparse"]
    assert written["layer_types"] == ["indexed_attention"] * 4
    torch.testing.assert_close(logits(tmp_path / "out", input_ids()), source_logits, **TOL)


def test_rank_files_hold_the_indexer_whole_and_the_latent_norms_apart(source: Path, megatron_tp2: Path) -> None:
    hf = hf_tensors(source)
    ranks = [_rank(megatron_tp2, f"mp_rank_{tp:02d}_000_000") for tp in (0, 1)]
    layer = "decoder.layers.0.self_attention."
    pairs = {"core_attention.indexer.linear_wq_b.weight": "wq_b.weight", "core_attention.indexer.linear_wk.weight":
             "wk.weight", "core_attention.indexer.k_norm.weight": "k_norm.weight",
             "core_attention.indexer.k_norm.bias": "k_norm.bias",
             "core_attention.indexer.linear_weights_proj.weight": "weights_proj.weight"}

    for rank in ranks:
        for megatron, name in pairs.items():
            assert torch.equal(rank["model"][layer + megatron], hf[_INDEXER.format(0) + name])
        assert torch.equal(rank["model"][layer + "linear_q_down_proj.weight"], hf["model.layers.0.self_attn.q_a_proj.weight"])
        assert {layer + "q_layernorm.weight", layer + "kv_layernorm.weight"} <= set(rank["model"])
        assert not any(name.endswith("up_proj.layer_norm_weight") for name in rank["model"])
        assert layer + "core_attention.indexer.linear_wq_b._extra_state" in rank["model"]
        assert layer + "core_attention._extra_state" not in rank["model"]
    args = ranks[0]["args"]
    assert (args.experimental_attention_variant, args.dsa_indexer_n_heads, args.dsa_indexer_head_dim,
            args.dsa_indexer_topk, args.transformer_impl) == ("dsa", 4, 16, 4, "transformer_engine")
    assert (args.dsa_indexer_rope_interleaved, args.dsa_indexer_k_norm_epsilon, args.dsa_indexer_topk_freq) == (
        False, 1e-6, 1)


# --- megatron-core's own model ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_tp1(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("v32-tp1") / "megatron"
    pgconvert.convert(source, out, dst_format="megatron", dst_tp=1, dst_pp=1, dst_ep=1, dst_transformer_impl="local")
    return out


def _mcore_logits(root: Path) -> torch.Tensor:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from support.mcore_dsa import dsa_logits

    return dsa_logits(root, input_ids(), TINY["vocab_size"])


def test_megatron_core_sparse_attention_forward_of_the_written_checkpoint_equals_transformers(
        megatron_tp1: Path, source_logits: torch.Tensor) -> None:
    torch.testing.assert_close(_mcore_logits(megatron_tp1), source_logits, **MCORE_TOL)


def test_local_names_for_sparse_attention_are_named_and_refused_under_strict(source: Path, tmp_path: Path) -> None:
    no_mtp = tmp_path / "hf"
    shutil.copytree(source, no_mtp)
    (no_mtp / "config.json").write_text(json.dumps({**TINY, "num_nextn_predict_layers": 0}))
    report = pgconvert.convert(no_mtp, tmp_path / "local", dst_format="megatron", dst_transformer_impl="local")
    assert any("Transformer Engine's linears only" in notice for notice in report.notices)
    with pytest.raises(PgconvertError, match="--strict: transformer_impl='local' with sparse attention"):
        pgconvert.convert(no_mtp, tmp_path / "strict", dst_format="megatron", dst_transformer_impl="local",
                          strict=True)


def test_a_config_json_without_an_mtp_count_declares_none_as_its_config_class_reads_it(source: Path,
                                                                                    tmp_path: Path) -> None:
    """DeepseekV32Config has no MTP attribute: an absent num_nextn_predict_layers is no MTP layer (not V3's default 1),
    so nothing declared is missing and --strict converts it; written back, the count stays absent."""
    bare = tmp_path / "hf"
    shutil.copytree(source, bare)
    (bare / "config.json").write_text(json.dumps({key: value for key, value in TINY.items()
                                                  if key != "num_nextn_predict_layers"}))

    report = pgconvert.convert(bare, tmp_path / "megatron", dst_format="megatron", strict=True)
    shutil.rmtree(tmp_path / "megatron" / "hf")
    pgconvert.convert(tmp_path / "megatron", tmp_path / "back", dst_format="hf", strict=True)

    assert not any("multi-token" in notice for notice in report.notices), report.notices
    assert "num_nextn_predict_layers" not in json.loads((tmp_path / "back" / "config.json").read_text())


def test_torch_dist_keys_shapes_and_chunks_are_what_megatron_core_declares_for_sparse_attention(
        megatron_tp1: Path, tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    import support.mcore_helpers as mcore
    from support.mcore_dsa import build_dsa_gpt_model, dsa_cpu_patches
    from support.mcore_gpt_models import megatron_core_layout, read_layout

    pgconvert.convert(megatron_tp1, tmp_path / "dist", dst_format="torch_dist", **FOR_MCORE_016)
    (rank,) = mcore.rank_files(megatron_tp1)
    with dsa_cpu_patches():
        expected_tensors, expected_objects = megatron_core_layout(build_dsa_gpt_model(rank.args))

    (iteration,) = (tmp_path / "dist").glob("iter_*")
    tensors, objects = read_layout(iteration)
    assert objects == expected_objects
    assert sorted(tensors) == sorted(expected_tensors)
    assert "decoder.layers.0.self_attention.core_attention.indexer.linear_wq_b.weight" in tensors
    for key, (shape, _, chunks) in expected_tensors.items():
        assert tensors[key][0] == shape and tensors[key][2] == chunks, key


def test_parameter_order_is_megatron_cores(megatron_tp1: Path) -> None:
    """The order megatron-core's optimizer takes the parameters in (pgconvert.optimizer.order) holds the indexer's
    where megatron-core's model registers them."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    import support.mcore_helpers as mcore
    from support.mcore_dsa import build_dsa_gpt_model, dsa_cpu_patches

    from pgconvert.formats.megatron import config_from_args
    from pgconvert.model.grid import RankCoord
    from pgconvert.model.layout import ParallelLayout
    from pgconvert.optimizer.order import named_parameters

    (rank,) = mcore.rank_files(megatron_tp1)
    with dsa_cpu_patches():
        expected = [name for name, _ in build_dsa_gpt_model(rank.args).named_parameters()]
    config = config_from_args(rank.args, megatron_tp1, "local", TINY["vocab_size"])
    ordered = [spec.local_name for _, spec in named_parameters(config, ParallelLayout(), RankCoord(0, 0))]

    assert ordered == expected


def test_the_released_config_reads_into_megatron_args() -> None:
    from pgconvert.formats.hf import model_config_from_hf
    from pgconvert.formats.megatron import args_for_target
    from pgconvert.model.layout import ParallelLayout

    family, config, notices = model_config_from_hf(RELEASED, Path("config.json"))
    args = args_for_target(config, ParallelLayout(), 129280, torch.bfloat16, None, None)

    assert notices == [] and family.architecture == "DeepseekV32ForCausalLM"
    assert (args.experimental_attention_variant, args.dsa_indexer_n_heads, args.dsa_indexer_head_dim,
            args.dsa_indexer_topk, args.dsa_indexer_rope_interleaved) == ("dsa", 64, 128, 2048, False)
    assert (args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim) == (
        1536, 512, 128, 64, 128)
    assert (args.moe_router_num_groups, args.moe_router_group_topk, args.moe_router_topk_scaling_factor) == (8, 4, 2.5)
    assert args.moe_layer_freq == [0] * 3 + [1] * 58
    assert (args.rope_type, args.rotary_scaling_factor, args.transformer_impl) == ("yarn", 40.0, "transformer_engine")


def _edit_rank(root: Path, tmp_path: Path, edit: Any) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(root, copy)
    (path,) = copy.glob("*/mp_rank_00/model_optim_rng.pt")
    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(path, map_location="cpu", weights_only=True)
    edit(state)
    torch.save(state, path)
    return copy


def _rope_dims_last_interleaved(state: dict[str, Any]) -> None:
    """The indexer rows as megatron-core 0.16.1's DSAIndexer takes them: per head [no-rope; rope interleaved]."""
    rope, head = TINY["qk_rope_head_dim"], TINY["index_head_dim"]
    order = torch.cat([torch.arange(rope, head), torch.stack([torch.arange(rope // 2),
                                                             torch.arange(rope // 2, rope)], 1).flatten()])
    for name, tensor in state["model"].items():
        if name.endswith(("indexer.linear_wq_b.weight",)):
            heads = tensor.view(-1, head, tensor.shape[-1])
            state["model"][name] = heads[:, order].reshape(tensor.shape).clone()
        elif name.endswith(("indexer.linear_wk.weight", "indexer.k_norm.weight", "indexer.k_norm.bias")):
            state["model"][name] = tensor[order].clone()


def _swap_layers_indexers(state: dict[str, Any]) -> None:
    model = state["model"]
    for name in [name for name in model if name.startswith("decoder.layers.1.") and ".indexer." in name]:
        other = name.replace("decoder.layers.1.", "decoder.layers.2.")
        model[name], model[other] = model[other], model[name]


def _other_topk(state: dict[str, Any]) -> None:
    state["args"].dsa_indexer_topk = TINY["index_topk"] + 2


@pytest.mark.parametrize("edit", [_rope_dims_last_interleaved, _swap_layers_indexers, _other_topk])
def test_a_knocked_out_indexer_setting_changes_megatron_cores_logits(
        megatron_tp1: Path, source_logits: torch.Tensor, tmp_path: Path, edit: Any) -> None:
    mcore = _mcore_logits(_edit_rank(megatron_tp1, tmp_path, edit))

    assert not torch.allclose(mcore, source_logits, **MCORE_TOL)


# --- what is refused -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("changes,named", [
    ({"index_n_heads": 8}, r"indexer.wq_b.weight has shape \[64, 24\], expected \[128, 24\].*index_n_heads=8"),
    ({"index_head_dim": 32}, r"indexer.wq_b.weight has shape \[64, 24\], expected \[128, 24\].*index_head_dim=32"),
    ({"index_topk": None}, "index_topk"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"layer_types": ["indexed_attention", "full_attention", "indexed_attention", "indexed_attention"]}, "layer_types"),
    ({"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types"),
    ({"index_head_dim": 4}, "dsa_indexer_head_dim"),
])
def test_a_config_json_that_does_not_describe_the_stored_indexer_is_refused_by_name(
        source: Path, tmp_path: Path, changes: dict[str, Any], named: str) -> None:
    edited = tmp_path / "hf"
    shutil.copytree(source, edited)
    (edited / "config.json").write_text(json.dumps({**TINY, **changes}))

    with pytest.raises(PgconvertError, match=named):
        pgconvert.convert(edited, tmp_path / "out", dst_format="megatron")
    assert not (tmp_path / "out").exists()


def test_mlp_layer_types_decide_the_moe_layers_as_transformers_builds_them(source: Path, tmp_path: Path) -> None:
    edited = tmp_path / "hf"
    shutil.copytree(source, edited)
    tensors = hf_tensors(source)
    (edited / "config.json").write_text(json.dumps({**TINY, "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}))
    for name in [name for name in tensors if name.startswith("model.layers.2.mlp.")]:
        del tensors[name]
    tensors.update({f"model.layers.2.mlp.{part}.weight": tensors[f"model.layers.0.mlp.{part}.weight"].clone()
                    for part in ("gate_proj", "up_proj", "down_proj")})
    for file in edited.glob("*.safetensors"):
        file.unlink()
    (edited / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, edited / "model.safetensors", metadata={"format": "pt"})

    pgconvert.convert(edited, tmp_path / "megatron", dst_format="megatron")
    args = _rank(tmp_path / "megatron", "mp_rank_00")["args"]
    assert args.moe_layer_freq == [0, 1, 0, 1]
    pgconvert.convert(tmp_path / "megatron", tmp_path / "out", dst_format="hf")
    torch.testing.assert_close(logits(tmp_path / "out", input_ids()), logits(edited, input_ids()), **TOL)


def _args(**changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{"multi_latent_attention": True, "experimental_attention_variant": "dsa",
                                 "dsa_indexer_n_heads": 4, "dsa_indexer_head_dim": 16, "dsa_indexer_topk": 4,
                                 "norm_epsilon": 1e-6, **changes})


@pytest.mark.parametrize("changes,named", [
    ({"dsa_indexer_rope_interleaved": "yes"}, "dsa_indexer_rope_interleaved='yes': expected true or false"),
    ({"dsa_indexer_topk_freq": 2}, "dsa_indexer_topk_freq=2"),
    ({"dsa_indexer_skip_topk_offset": 1}, "dsa_indexer_skip_topk_offset=1"),
    ({"dsa_indexer_scoring_relu": False}, "dsa_indexer_scoring_relu=False"),
    ({"dsa_indexer_k_norm_epsilon": 1e-5}, "k_norm epsilon is 1e-05"),
    ({"norm_epsilon": 1e-5}, "k_norm epsilon is 1e-05"),
    ({"dsa_indexer_topk": None}, "args.dsa_indexer_topk is missing"),
    ({"multi_latent_attention": False}, "without multi_latent_attention"),
])
def test_megatron_args_of_another_indexer_are_refused_by_name(changes: dict[str, Any], named: str) -> None:
    with pytest.raises(PgconvertError, match=named):
        mla.from_args(_args(**changes), Path("args"))


def test_megatron_args_of_a_dsa_run_read_as_the_indexer() -> None:
    read = mla.from_args(_args(dsa_indexer_k_norm_epsilon=1e-6, norm_epsilon=1e-5, dsa_indexer_rope_interleaved=True),
                         Path("args"))
    assert (read["dsa_indexer_topk"], read["dsa_indexer_rope_interleaved"]) == (4, True)
    assert mla.from_args(_args(), Path("args"))["dsa_indexer_rope_interleaved"] is False


# --- GLM-5 -----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def glm5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("glm5") / "hf", base=GLM5_TINY)


def test_glm5_round_trips_exactly_through_megatron_args_alone_and_torch_dist(glm5: Path, tmp_path: Path) -> None:
    pgconvert.convert(glm5, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=2, dst_ep=2)
    shutil.rmtree(tmp_path / "megatron" / "hf")
    assert _rank(tmp_path / "megatron", "mp_rank_00_000_000")["args"].dsa_indexer_rope_interleaved is True
    pgconvert.convert(tmp_path / "megatron", tmp_path / "dist", dst_format="torch_dist", dst_tp=1, dst_pp=1)
    pgconvert.convert(tmp_path / "dist", tmp_path / "out", dst_format="hf")

    before, after = hf_tensors(glm5), hf_tensors(tmp_path / "out")
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[name], after[name]) for name in before)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["architectures"], written["indexer_types"]) == (["GlmMoeDsaForCausalLM"], ["full"] * 4)
    torch.testing.assert_close(logits(tmp_path / "out", input_ids()), logits(glm5, input_ids()), **TOL)


def _rotate_half_indexer(state: dict[str, Any]) -> None:
    state["args"].dsa_indexer_rope_interleaved = False


@pytest.mark.parametrize("edit", [None, _rotate_half_indexer])
def test_glm5_megatron_core_forward_equals_transformers_and_needs_the_interleaved_indexer(
        glm5: Path, tmp_path: Path, edit: Any) -> None:
    pgconvert.convert(glm5, tmp_path / "megatron", dst_format="megatron", dst_transformer_impl="local")
    root = tmp_path / "megatron" if edit is None else _edit_rank(tmp_path / "megatron", tmp_path, edit)

    mcore, hf = _mcore_logits(root), logits(glm5, input_ids())

    assert torch.allclose(mcore, hf, **MCORE_TOL) == (edit is None)


@pytest.mark.parametrize("changes", [{"indexer_types": ["full", "shared", "full", "shared"]},
                                     {"index_topk_freq": 2, "index_skip_topk_offset": 1},
                                     {"index_topk_pattern": "FSFS"}])
def test_glm5_cross_layer_top_k_sharing_is_refused_by_name(glm5: Path, tmp_path: Path,
                                                           changes: dict[str, Any]) -> None:
    edited = tmp_path / "hf"
    shutil.copytree(glm5, edited)
    (edited / "config.json").write_text(json.dumps({**GLM5_TINY, **changes}))

    with pytest.raises(PgconvertError, match="cross-layer top-k sharing"):
        pgconvert.convert(edited, tmp_path / "out", dst_format="megatron")


def test_a_stored_multi_token_prediction_layer_keeps_its_indexer_through_megatron(source: Path, tmp_path: Path) -> None:
    """transformers' V3.2 builds no MTP module (it ignores layer num_hidden_layers); a stored one (as the release
    stores layer 61) converts with its transformer layer's indexer as a decoder layer's, bit-exact both ways."""
    edited = tmp_path / "hf"
    shutil.copytree(source, edited)
    tensors, last = hf_tensors(source), TINY["num_hidden_layers"] - 1
    mtp = {name.replace(f"model.layers.{last}.", f"model.layers.{last + 1}."): tensor.clone()
           for name, tensor in tensors.items() if name.startswith(f"model.layers.{last}.")}
    hidden = TINY["hidden_size"]
    mtp.update({f"model.layers.{last + 1}.{name}": torch.rand(shape) for name, shape in (
        ("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)), ("eh_proj.weight", (hidden, 2 * hidden)),
        ("shared_head.norm.weight", (hidden,)))})
    mtp[f"model.layers.{last + 1}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    mtp[f"model.layers.{last + 1}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    for file in edited.glob("*.safetensors"):
        file.unlink()
    save_file({**tensors, **mtp}, edited / "model.safetensors", metadata={"format": "pt"})

    pgconvert.convert(edited, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=2)
    last_stage = _rank(tmp_path / "megatron", "mp_rank_01_001")["model"]
    assert "mtp.layers.0.transformer_layer.self_attention.core_attention.indexer.linear_wq_b.weight" in last_stage
    pgconvert.convert(tmp_path / "megatron", tmp_path / "out", dst_format="hf")

    after = hf_tensors(tmp_path / "out")
    assert sorted(after) == sorted({**tensors, **mtp})
    assert all(torch.equal(after[name], tensor) for name, tensor in {**tensors, **mtp}.items())
