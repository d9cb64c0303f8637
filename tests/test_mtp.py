"""Multi-token-prediction (MTP) layers of DeepSeek-V3 and GLM-4.5-MoE through pgconvert.

transformers builds no MTP module, so a tiny source is a model built with one layer more whose last
layer becomes the MTP layer (HF layer index num_hidden_layers) beside its own enorm, hnorm,
eh_proj, shared_head.norm and the copies of the embedding and output layer a release stores.

* HF -> Megatron (TP2/EP4/PP2; VPP2; torch_dist) -> HF is bit-exact on every tensor, MTP included,
  and transformers' logits of the output equal the source's;
* the Megatron side holds megatron-core's ``mtp.layers.0.*`` on the last stage only, eh_proj split
  by rows, and megatron-core's GPTModel built with ``mtp_num_layers`` loads the TP1 file strictly;
* copies that differ from the model's tensors and MTP counts that disagree with the tensors are
  named errors.
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
from support.deepseek_helpers import logits
from support.mcore_mtp_model import mtp_gpt_model
from support.mtp_models import LAYERS, assert_same_tensors, from_args_alone, hf_tensors, rank_state, with_mtp
from support.torch_dist_forms import FOR_MCORE_016
from safetensors.torch import load_file, save_file

import pgconvert
from pgconvert.cli import main

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", params=["v3", "glm"])
def source(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, with_mtp(request.param, tmp_path_factory.mktemp(f"mtp-{request.param}") / "hf")


def input_ids(family: str, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(seed))


def test_hf_megatron_tp2_ep4_pp2_hf_is_exact_with_the_mtp_layer(source: tuple[str, Path], tmp_path: Path) -> None:
    family, src = source
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=2, dst_ep=4)
    out = from_args_alone(tmp_path / "megatron", tmp_path / "out")

    assert_same_tensors(src, out)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    ids = input_ids(family)
    torch.testing.assert_close(logits(out, ids), logits(src, ids), **TOL)


def test_mtp_layer_lives_on_the_last_stage_with_eh_proj_split_by_rows(source: tuple[str, Path],
                                                                      tmp_path: Path) -> None:
    family, src = source
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=2, dst_ep=4)
    hf = hf_tensors(src)
    first, last = rank_state(tmp_path / "megatron", "mp_rank_01_000_002"), rank_state(
        tmp_path / "megatron", "mp_rank_01_001_002")

    assert not [key for key in first["model"] if key.startswith("mtp.")]
    assert first["args"].mtp_num_layers == last["args"].mtp_num_layers == 1
    model = last["model"]
    assert torch.equal(model["mtp.layers.0.eh_proj.weight"], hf[f"model.layers.{LAYERS}.eh_proj.weight"][32:])
    assert torch.equal(model["mtp.layers.0.enorm.weight"], hf[f"model.layers.{LAYERS}.enorm.weight"])
    assert torch.equal(model["mtp.layers.0.final_layernorm.weight"],
                       hf[f"model.layers.{LAYERS}.shared_head.norm.weight"])
    # EP rank 2 of 4 holds experts 4 and 5 of 8 as its local 0 and 1.
    down = "mtp.layers.0.transformer_layer.mlp.experts.local_experts.1.linear_fc2.weight"
    assert torch.equal(model[down], hf[f"model.layers.{LAYERS}.mlp.experts.5.down_proj.weight"][:, 16:])
    # megatron-core keeps an embedding copy on the MTP stage (GPTModel: pre_process or mtp_process).
    assert torch.equal(model["embedding.word_embeddings.weight"], first["model"]["embedding.word_embeddings.weight"])


def test_vpp_and_torch_dist_round_trips_are_exact(source: tuple[str, Path], tmp_path: Path) -> None:
    family, src = source
    pgconvert.convert(src, tmp_path / "vpp", dst_format="megatron", dst_tp=2, dst_pp=2, dst_vpp=2, dst_ep=2)
    pgconvert.convert(tmp_path / "vpp", tmp_path / "dist", dst_format="torch_dist", dst_tp=1, dst_pp=2, dst_ep=4, **FOR_MCORE_016,
                      dst_vpp=1)
    out = from_args_alone(tmp_path / "dist", tmp_path / "out")

    assert_same_tensors(src, out)


# --- megatron-core ------------------------------------------------------------------------------


def test_megatron_core_gpt_model_with_mtp_loads_the_written_file_and_declares_its_torch_dist_keys(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    import support.mcore_helpers as mcore
    from support.mcore_gpt_models import megatron_core_layout, read_layout

    src = with_mtp("v3", tmp_path / "hf")
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=1, dst_pp=1, dst_ep=1)
    pgconvert.convert(tmp_path / "megatron", tmp_path / "dist", dst_format="torch_dist", **FOR_MCORE_016)
    (rank,) = mcore.rank_files(tmp_path / "megatron")

    with torch.no_grad(), mtp_gpt_model(rank.args) as model:
        model.load_state_dict(dict(rank.model), strict=True)
        expected_tensors, expected_objects = megatron_core_layout(model)
    assert rank.args.mtp_num_layers == 1
    assert torch.equal(model.mtp.layers[0].eh_proj.weight, hf_tensors(src)[f"model.layers.{LAYERS}.eh_proj.weight"])
    # torch_dist: the keys, shapes and chunks megatron-core's sharded_state_dict declares, MTP included.
    (iteration,) = (tmp_path / "dist").glob("iter_*")
    tensors, objects = read_layout(iteration)
    assert [key for key in expected_tensors if key.startswith("mtp.layers.0.transformer_layer.mlp.experts.")]
    assert objects == expected_objects
    assert sorted(tensors) == sorted(expected_tensors)
    for key, (shape, _, chunks) in expected_tensors.items():
        assert tensors[key][0] == shape and tensors[key][2] == chunks, key


# --- bad input ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def v3_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_mtp("v3", tmp_path_factory.mktemp("mtp-v3-bad") / "hf")


def _edited_copy(src: Path, dst: Path, tensors: dict[str, torch.Tensor] | None = None,
                 **config: Any) -> Path:
    shutil.copytree(src, dst)
    if tensors:
        stored = load_file(dst / "model.safetensors")
        save_file({**stored, **tensors}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    doc = json.loads((dst / "config.json").read_text())
    doc.update(config)
    (dst / "config.json").write_text(json.dumps(doc))
    return dst


def _convert_fails(src: Path, out: Path, *extra: str) -> str:
    result = CliRunner().invoke(main, ["convert", str(src), str(out), "--dst-format", "megatron", *extra])
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    assert not out.exists()
    return result.output


@pytest.mark.parametrize("copy,main_name", [("embed_tokens.weight", "model.embed_tokens.weight"),
                                            ("shared_head.head.weight", "lm_head.weight")])
def test_an_mtp_copy_that_differs_from_the_model_tensor_is_refused_naming_it(
        v3_source: Path, tmp_path: Path, copy: str, main_name: str) -> None:
    name = f"model.layers.{LAYERS}.{copy}"
    changed = load_file(v3_source / "model.safetensors")[name].clone()
    changed[17, 3] += 1.0
    src = _edited_copy(v3_source, tmp_path / "src", {name: changed})

    output = _convert_fails(src, tmp_path / "out", "--dst-tp", "2")

    assert f"model.safetensors: {name} differs from {main_name}" in output.replace("\n", "")


@pytest.mark.parametrize("declared", [0, 2])
def test_num_nextn_predict_layers_that_disagrees_with_the_stored_layers_is_refused(
        v3_source: Path, tmp_path: Path, declared: int) -> None:
    src = _edited_copy(v3_source, tmp_path / "src", num_nextn_predict_layers=declared)

    output = _convert_fails(src, tmp_path / "out").replace("\n", "")

    assert f"num_nextn_predict_layers={declared}, but the checkpoint stores multi-token prediction" in output
    assert f"layers [{LAYERS}]" in output


def _set_mtp_args(root: Path, value: int | None) -> None:
    for path in root.glob("*/mp_rank_*/model_optim_rng.pt"):
        with torch.serialization.safe_globals([argparse.Namespace]):
            state = torch.load(path, map_location="cpu", weights_only=True)
        state["args"].mtp_num_layers = value
        torch.save(state, path)


@pytest.mark.parametrize("value,named", [
    (2, ("mp_rank_00_000", "args.mtp_num_layers=2, but the checkpoint stores 1 multi-token prediction layer(s)")),
    (None, ("mp_rank_00_001", "mtp.layers.0."))])
def test_megatron_mtp_num_layers_that_disagrees_with_the_rank_files_is_refused(
        v3_source: Path, tmp_path: Path, value: int | None, named: tuple[str, str]) -> None:
    pgconvert.convert(v3_source, tmp_path / "megatron", dst_format="megatron", dst_pp=2)
    _set_mtp_args(tmp_path / "megatron", value)

    result = CliRunner().invoke(main, ["convert", str(tmp_path / "megatron"), str(tmp_path / "out"),
                                       "--dst-format", "hf"])

    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    assert all(fragment in result.output.replace("\n", "") for fragment in named), result.output


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_mtp_layer(src: Path, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's MTP module written plainly on the HF tensors: the next token's embedding and
    the hidden state, each RMS-normed (enorm, hnorm), concatenated in that order, projected by
    eh_proj, through transformers' own DeepseekV3DecoderLayer holding layer num_hidden_layers, and
    normed by shared_head.norm. ``hidden`` is [batch, seq, hidden]; the last position's next token
    is id 0 (megatron-core's roll_tensor)."""
    from transformers import AutoModelForCausalLM

    # transformers loads the MTP layer's decoder tensors as its own layer LAYERS when config.json
    # counts one layer more (it fuses the experts its own way; the MTP-only tensors it ignores).
    as_layer = Path(shutil.copytree(src, src.parent / "mtp-as-layer"))
    doc = json.loads((as_layer / "config.json").read_text())
    doc.update(num_hidden_layers=LAYERS + 1, num_nextn_predict_layers=0)
    (as_layer / "config.json").write_text(json.dumps(doc))
    hf_model = AutoModelForCausalLM.from_pretrained(as_layer, dtype=torch.float32, attn_implementation="eager").eval()
    layer, rotary = hf_model.model.layers[LAYERS], hf_model.model.rotary_emb
    tensors, prefix, eps = hf_tensors(src), f"model.layers.{LAYERS}.", hf_model.config.rms_norm_eps
    following = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    embedded = tensors["model.embed_tokens.weight"][following]
    x = torch.cat([_rms_norm(embedded, tensors[prefix + "enorm.weight"], eps),
                   _rms_norm(hidden, tensors[prefix + "hnorm.weight"], eps)], dim=-1) @ tensors[prefix + "eh_proj.weight"].T
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    seq = ids.shape[1]
    mask = torch.full((seq, seq), float("-inf")).triu(1).expand(ids.shape[0], 1, seq, seq)
    with torch.no_grad():
        x = layer(x, attention_mask=mask, position_ids=positions,
                  position_embeddings=rotary(x, positions))
    return _rms_norm(x, tensors[prefix + "shared_head.norm.weight"], eps)


def test_megatron_core_mtp_layer_forward_equals_a_plain_reference_on_the_hf_tensors(tmp_path: Path) -> None:
    """megatron-core's MultiTokenPredictionLayer, loaded from the written TP1 file, against the MTP
    computation written in the test on the source's HF tensors: a swapped enorm/hnorm, a transposed
    or reordered eh_proj or a wrong final norm would differ."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    import support.mcore_helpers as mcore

    src = with_mtp("v3", tmp_path / "hf")
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=1, dst_pp=1, dst_ep=1)
    (rank,) = mcore.rank_files(tmp_path / "megatron")
    ids = input_ids("v3")
    hidden = torch.randn(*ids.shape, 64, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)

    with torch.no_grad(), mtp_gpt_model(rank.args) as model:
        model.load_state_dict(dict(rank.model), strict=True)
        out = model.mtp.layers[0](input_ids=ids, position_ids=positions, hidden_states=hidden.transpose(0, 1),
                                  attention_mask=mcore.causal_attention_mask(ids.shape[1]),
                                  embedding=model.embedding)
    out = out[0] if isinstance(out, tuple) else out

    torch.testing.assert_close(out.transpose(0, 1), reference_mtp_layer(src, ids, hidden), rtol=1e-4, atol=5e-5)


def test_transformer_engine_spec_names_the_mtp_layer_as_its_decoder_layers(source: tuple[str, Path],
                                                                           tmp_path: Path) -> None:
    """The MTP transformer layer takes the TE spec's fused norm names like a decoder layer, and a TE
    target gets the _extra_state entries of eh_proj and the layer's linears on the last stage only."""
    family, src = source
    pgconvert.convert(src, tmp_path / "te", dst_format="megatron", dst_tp=2, dst_pp=2, dst_ep=2,
                      dst_transformer_impl="transformer_engine")
    first = rank_state(tmp_path / "te", "mp_rank_00_000_001")["model"]
    last = rank_state(tmp_path / "te", "mp_rank_00_001_001")["model"]
    hf = hf_tensors(src)

    assert not [key for key in first if key.startswith("mtp.")]
    assert last["mtp.layers.0.eh_proj._extra_state"] is None
    assert "mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc2._extra_state" in last
    if family == "glm":
        norm = last["mtp.layers.0.transformer_layer.self_attention.linear_qkv.layer_norm_weight"]
    else:
        norm = last["mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.layer_norm_weight"]
    hf_norm = "input_layernorm.weight" if family == "glm" else "self_attn.kv_a_layernorm.weight"
    assert torch.equal(norm, hf[f"model.layers.{LAYERS}.{hf_norm}"])
    out = from_args_alone(tmp_path / "te", tmp_path / "out")
    assert_same_tensors(src, out)


@pytest.mark.parametrize("layout,accepted", [("Ett|ttmL", True), ("Ett|ttL", False), ("Etm|tttL", False)])
def test_a_pipeline_layout_places_the_mtp_layers_on_the_last_stage(v3_source: Path, tmp_path: Path, layout: str,
                                                                   accepted: bool) -> None:
    """megatron-core's layout strings name MTP layers "m"; they may only sit on the last stage, all of them."""
    if not accepted:
        output = _convert_fails(v3_source, tmp_path / "out", "--dst-pp", "2", "--dst-pipeline-layout", layout)
        assert f"pipeline layout '{layout}'" in output and "mtp_num_layers=1" in output
        return
    pgconvert.convert(v3_source, tmp_path / "megatron", dst_format="megatron", dst_pp=2, dst_pipeline_layout=layout)
    assert "mtp.layers.0.eh_proj.weight" in rank_state(tmp_path / "megatron", "mp_rank_00_001")["model"]
    assert_same_tensors(v3_source, from_args_alone(tmp_path / "megatron", tmp_path / "out"))


def test_an_mtp_copy_of_another_shape_is_refused_before_anything_is_read(v3_source: Path, tmp_path: Path) -> None:
    name = f"model.layers.{LAYERS}.shared_head.head.weight"
    src = _edited_copy(v3_source, tmp_path / "src", {name: torch.zeros(249, 64)})

    output = _convert_fails(src, tmp_path / "out").replace("\n", "")

    assert f"model.safetensors: {name}" in output and "does not match lm_head.weight" in output


def test_a_megatron_mtp_stage_embedding_copy_that_differs_is_refused_naming_both_files(
        v3_source: Path, tmp_path: Path) -> None:
    """The last stage's embedding copy (megatron-core keeps one for its MTP layers) must equal the
    first stage's: a differing copy would otherwise be dropped."""
    pgconvert.convert(v3_source, tmp_path / "megatron", dst_format="megatron", dst_pp=2)
    (path,) = (tmp_path / "megatron").glob("*/mp_rank_00_001/model_optim_rng.pt")
    state = rank_state(tmp_path / "megatron", "mp_rank_00_001")
    state["model"]["embedding.word_embeddings.weight"][3, 3] += 1.0
    torch.save(state, path)

    result = CliRunner().invoke(main, ["convert", str(tmp_path / "megatron"), str(tmp_path / "out"),
                                       "--dst-format", "hf"])

    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    assert "embedding.word_embeddings.weight: the copies in" in result.output and "mp_rank_00_001" in result.output
