"""Mistral 3 (Mistral-Small-3.1's shape): through Megatron (TP2 x PP2, torch_dist) and back as transformers and
Megatron-Bridge's Ministral3Bridge name it; its language model converted as Mistral's, the Pixtral tower
(``vision_tower.``) and the projector (``multi_modal_projector.``) whole on every TP rank of the first stage; its
top-level projector settings carried; ``--text-only`` writes Mistral; Ministral 3's text model refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.hf_helpers import assert_same_hf_tensors, load_hf_tensors
from support.vision_language_models import build_mistral3_model, mistral3_inputs, text_logits, vl_logits
from support.vl_runs import config_read_by_transformers, converted, edited_copy, rank_file

import pgconvert
from pgconvert.errors import PgconvertError

SIDE = ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json",
        "generation_config.json")
VISION = ("vision_tower.", "multi_modal_projector.")
IDS = torch.tensor([[1, 15, 16, 17, 40, 41, 42, 299, 18, 19, 20, 21]])
Expected = tuple[dict[str, torch.Tensor], torch.Tensor]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mistral3_model(tmp_path_factory.mktemp("mistral3") / "hf")


@pytest.fixture(scope="module")
def expected(source: Path) -> Expected:
    inputs = mistral3_inputs(source)
    return inputs, vl_logits(source, inputs)


@pytest.fixture(scope="module")
def tp2_pp2(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return converted(source, tmp_path_factory.mktemp("tp2_pp2") / "megatron", dst_format="megatron", dst_tp=2,
                      dst_pp=2)




def test_hf_megatron_tp2_pp2_hf_is_the_same_model(source: Path, tp2_pp2: Path, expected: Expected,
                                                   tmp_path: Path) -> None:
    back = converted(tp2_pp2, tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)
    assert_same_hf_tensors(source, back)
    for name in SIDE:
        assert (back / name).read_bytes() == (source / name).read_bytes(), name
    inputs, logits = expected
    torch.testing.assert_close(vl_logits(back, inputs), logits, rtol=1e-5, atol=1e-5)
    # The image changes these logits: a vision part lost or misplaced would not pass the comparison above.
    blank = {**inputs, "pixel_values": torch.zeros_like(inputs["pixel_values"])}
    assert not torch.allclose(vl_logits(back, blank), logits, rtol=1e-4, atol=1e-4)
    assert config_read_by_transformers(back) == config_read_by_transformers(source)


def test_rank_files_hold_the_vision_part_whole_on_the_first_stage(source: Path, tp2_pp2: Path) -> None:
    stored = load_hf_tensors(source)
    vision = [name for name in stored if name.startswith(VISION)]
    assert any(name.startswith("multi_modal_projector.patch_merger.") for name in vision)
    config = json.loads((source / "config.json").read_text())
    for tp in range(2):
        state = rank_file(tp2_pp2, f"mp_rank_0{tp}_000")
        names = list(state["model"])
        # Megatron-Bridge's Ministral3Model registers vision_tower, multi_modal_projector, then language_model.
        assert names[:len(vision)] == sorted(vision, key=lambda name: (not name.startswith("vision_tower."),
                                                                       names.index(name)))
        assert all(name.startswith("language_model.") for name in names[len(vision):])
        assert all(torch.equal(state["model"][name], stored[name]) for name in vision)
        held = json.loads(state["args"].vision_config)
        assert {key: held.pop(key) for key in ("spatial_merge_size", "vision_feature_layer",
                                                "multimodal_projector_bias", "projector_hidden_act")} == {
            "spatial_merge_size": 2, "vision_feature_layer": -1, "multimodal_projector_bias": False,
            "projector_hidden_act": "gelu"}
        assert held == config["vision_config"]
        assert json.loads(state["args"].vision_token_ids) == {"image_token_index": 10}
        last = rank_file(tp2_pp2, f"mp_rank_0{tp}_001")["model"]
        assert all(name.startswith("language_model.") for name in last) and "language_model.output_layer.weight" in last
    first = rank_file(tp2_pp2, "mp_rank_00_000")["model"]
    assert torch.equal(first["language_model.decoder.layers.0.self_attention.linear_proj.weight"],
                       stored["language_model.model.layers.0.self_attn.o_proj.weight"][:, :16])


def test_tp2_torch_dist_and_a_config_built_from_the_args(source: Path, expected: Expected, tmp_path: Path) -> None:
    megatron = converted(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    dist = converted(megatron, tmp_path / "dist", dst_format="torch_dist")
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(dist / "iter_0000000")).read_metadata().state_dict_metadata
    assert {"vision_tower.patch_conv.weight", "multi_modal_projector.linear_2.weight",
            "language_model.embedding.word_embeddings.weight"} <= set(stored)
    (dist / "hf" / "config.json").unlink()  # config.json built from the args alone
    back = converted(dist, tmp_path / "hf", dst_format="hf", dst_tp=1)
    assert_same_hf_tensors(source, back)
    inputs, logits = expected
    torch.testing.assert_close(vl_logits(back, inputs), logits, rtol=1e-5, atol=1e-5)
    written, original = (json.loads((path / "config.json").read_text()) for path in (back, source))
    for key in ("vision_config", "image_token_index", "spatial_merge_size", "vision_feature_layer",
                "multimodal_projector_bias", "projector_hidden_act"):
        assert written[key] == original[key], key
    assert written["text_config"]["model_type"] == "mistral" and written["text_config"]["sliding_window"] is None


def test_projector_biases_and_other_feature_layers_round_trip(tmp_path: Path) -> None:
    source = build_mistral3_model(tmp_path / "hf", seed=1, multimodal_projector_bias=True, vision_feature_layer=-2,
                                  projector_hidden_act="silu")
    megatron = converted(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    assert "multi_modal_projector.linear_2.bias" in rank_file(megatron, "mp_rank_01")["model"]
    back = converted(megatron, tmp_path / "back", dst_format="hf", dst_tp=1)
    assert_same_hf_tensors(source, back)
    inputs = mistral3_inputs(source)
    torch.testing.assert_close(vl_logits(back, inputs), vl_logits(source, inputs), rtol=1e-5, atol=1e-5)
    # Several feature layers widen linear_1's input (transformers 5.24 builds it so, though its projector's norm
    # then fails on the concatenated features: tensors only).
    several = build_mistral3_model(tmp_path / "several", vision_feature_layer=[-1, -2])
    assert load_hf_tensors(several)["multi_modal_projector.linear_1.weight"].shape == (64, 64)
    megatron = converted(several, tmp_path / "several_megatron", dst_format="megatron", dst_tp=2)
    assert_same_hf_tensors(several, converted(megatron, tmp_path / "several_back", dst_format="hf", dst_tp=1))


def test_text_only_writes_the_language_model_as_mistral(source: Path, tp2_pp2: Path, tmp_path: Path) -> None:
    expected = text_logits(source, IDS)
    stored = load_hf_tensors(source)
    language = {name.removeprefix("language_model."): tensor for name, tensor in stored.items()
                if name.startswith("language_model.")}
    for src in (source, tp2_pp2):
        out = tmp_path / src.name
        report = pgconvert.convert(src, out, dst_format="hf", dst_tp=1, dst_pp=1, text_only=True)
        notice = next(notice for notice in report.notices if notice.startswith("--text-only"))
        assert ("the vision tower (20 tensors: vision_tower.patch_conv.weight … vision_tower.transformer.layers.1"
                ".feed_forward.down_proj.weight), the projector (4 tensors: multi_modal_projector.norm.weight … "
                "multi_modal_projector.linear_2.weight)") in notice and "mrope" not in notice, notice
        doc = json.loads((out / "config.json").read_text())
        assert doc["architectures"] == ["MistralForCausalLM"] and doc["model_type"] == "mistral"
        assert not {"vision_config", "text_config", "image_token_index", "spatial_merge_size"} & set(doc)
        written = load_hf_tensors(out)
        assert sorted(written) == sorted(language)
        assert all(torch.equal(written[name], language[name]) for name in written)
        torch.testing.assert_close(text_logits(out, IDS), expected, rtol=1e-5, atol=1e-5)
        assert not (out / "preprocessor_config.json").exists()


def _edited(source: Path, tmp_path: Path, change: dict[str, object] | None = None) -> Path:
    src = Path(shutil.copytree(source, tmp_path / "src"))
    doc = json.loads((src / "config.json").read_text())
    for path, value in (change or {}).items():
        *parents, key = path.split(".")
        node = doc
        for parent in parents:
            node = node[parent]
        node[key] = value
    (src / "config.json").write_text(json.dumps(doc))
    return src


@pytest.mark.parametrize("change, message", [
    ({"vision_config.hidden_size": 48},
     r"vision_tower\.patch_conv\.weight.*\[32, 3, 14, 14\].*vision_config"),
    ({"multimodal_projector_bias": True}, r"multi_modal_projector\.linear_1\.bias"),
    ({"spatial_merge_size": 1}, r"multi_modal_projector\.patch_merger\.merging_layer\.weight.*\[32, 128\]"),
    ({"text_config.model_type": "ministral3"},
     r"text_config\.model_type='ministral3': Ministral 3's attention scales the queries by 1 \+ llama_4_scaling_beta"),
    ({"vision_config.model_type": "siglip_vision_model"}, r"vision_config\.model_type='siglip_vision_model'"),
])
def test_a_config_that_disagrees_with_the_tensors_or_another_text_model_is_a_named_error(
        source: Path, tmp_path: Path, change: dict[str, object], message: str) -> None:
    src = _edited(source, tmp_path, change)
    with pytest.raises(PgconvertError, match=message):
        pgconvert.convert(src, tmp_path / "out", dst_format="megatron")
    assert not (tmp_path / "out").exists()


def test_a_missing_projector_tensor_is_a_named_error(source: Path, tp2_pp2: Path, tmp_path: Path) -> None:
    src = _edited(source, tmp_path)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["multi_modal_projector.patch_merger.merging_layer.weight"]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(PgconvertError, match=r"multi_modal_projector\.patch_merger\.merging_layer\.weight"):
        pgconvert.convert(src, tmp_path / "out", dst_format="megatron")
    assert not (tmp_path / "out").exists()
    copy = edited_copy(tp2_pp2, tmp_path / "megatron", "mp_rank_01_000",
                       lambda state: state["model"].pop("multi_modal_projector.linear_1.weight"))
    with pytest.raises(PgconvertError, match=r"mp_rank_01_000.*missing: \['multi_modal_projector\.linear_1\.weight'\]"):
        pgconvert.convert(copy, tmp_path / "back", dst_format="hf", dst_tp=1, dst_pp=1)
    assert not (tmp_path / "back").exists()


def test_megatron_core_and_the_hf_modules_load_the_tp1_rank_file_and_compute_transformers_logits(
        source: Path, expected: Expected, tmp_path: Path) -> None:
    """As Megatron-Bridge's Ministral3Model: transformers' vision tower and projector built from the rank file's args
    (vision_tower.*, multi_modal_projector.*) and megatron-core's GPTModel (language_model.*), each loaded strictly,
    give the source's logits on an image + text input."""
    from support.mcore_helpers import rank_files
    from support.mcore_vision_language import mistral3_bridge_logits

    (rank,) = rank_files(converted(source, tmp_path / "megatron", dst_format="megatron", dst_tp=1))
    inputs, logits = expected
    torch.testing.assert_close(mistral3_bridge_logits(rank, inputs)[..., :logits.shape[-1]], logits, rtol=1e-5,
                               atol=1e-5)
