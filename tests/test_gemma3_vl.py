"""Gemma 3 image-text (Gemma3ForConditionalGeneration) through Megatron (TP2 x PP2, torch_dist) and back, as
transformers and Megatron-Bridge name it: its language model converted as Gemma 3's, the SigLIP tower whole on every
TP rank of the first stage, the projector's norm whole and its projection transposed and split by rows; the released
checkpoints' names (the tower under SigLIP's wrapper, 4.x config.json) read as transformers 5's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.cli_helpers import assert_clean_refusal, run_cli
from support.hf_helpers import assert_same_hf_tensors, load_hf_tensors
from support.vision_language_models import build_gemma3_vl_model, gemma3_image_text_inputs, vl_logits
from support.vl_runs import config_read_by_transformers, converted, edited_copy, rank_file

import pgconvert
from pgconvert.errors import PgconvertError

SIDE = ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json", "processor_config.json",
        "generation_config.json")
PROJECTION = "multi_modal_projector.mm_input_projection_weight"
TEXT_IDS = torch.tensor([[2, 5, 6, 7, 40, 41, 42, 299, 8, 9, 10, 11, 12]])

Expected = tuple[dict[str, torch.Tensor], torch.Tensor]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma3_vl_model(tmp_path_factory.mktemp("gemma3_vl") / "hf")


@pytest.fixture(scope="module")
def expected(source: Path) -> Expected:
    """The processor's image + text input and transformers' logits on it."""
    inputs = gemma3_image_text_inputs(source)
    return inputs, vl_logits(source, inputs)


@pytest.fixture(scope="module")
def tp2_pp2(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return converted(source, tmp_path_factory.mktemp("tp2_pp2") / "megatron", dst_format="megatron", dst_tp=2,
                      dst_pp=2)




def test_hf_megatron_tp2_pp2_hf_is_the_same_model(source: Path, tp2_pp2: Path, expected: Expected,
                                                   tmp_path: Path) -> None:
    back = converted(tp2_pp2, tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)
    assert_same_hf_tensors(source, back)
    for name in SIDE:  # the processor, tokenizer and chat template carried as they are
        assert (back / name).read_bytes() == (source / name).read_bytes(), name
    inputs, logits = expected
    assert int(inputs["token_type_ids"].sum()) == 4  # the image's tokens, which attend to each other both ways
    torch.testing.assert_close(vl_logits(back, inputs), logits, rtol=1e-5, atol=1e-5)
    assert config_read_by_transformers(back) == config_read_by_transformers(source)


def test_rank_files_hold_the_tower_whole_and_the_projection_split_on_the_first_stage(source: Path,
                                                                                       tp2_pp2: Path) -> None:
    stored = load_hf_tensors(source)
    tower = [name for name in stored if name.startswith("vision_tower.")]
    projection = stored[PROJECTION].t()  # Megatron-Bridge's proj.weight: [text hidden, vision hidden]
    for tp in range(2):
        state = rank_file(tp2_pp2, f"mp_rank_0{tp}_000")
        model = state["model"]
        names = list(model)
        # Megatron-Bridge's Gemma3VLModel: vision_tower.*, then multi_modal_projector.*, then language_model.*.
        assert set(names[:len(tower)]) == set(tower)
        assert names[len(tower):len(tower) + 2] == ["multi_modal_projector.mm_soft_embed_norm.weight",
                                                    "multi_modal_projector.proj.weight"]
        assert all(name.startswith("language_model.") for name in names[len(tower) + 2:])
        assert all(torch.equal(model[name], stored[name]) for name in tower)
        assert torch.equal(model["multi_modal_projector.mm_soft_embed_norm.weight"],
                           stored["multi_modal_projector.mm_soft_emb_norm.weight"])
        assert torch.equal(model["multi_modal_projector.proj.weight"], projection[32 * tp:32 * (tp + 1)])
        args = state["args"]
        written = json.loads((source / "config.json").read_text())
        assert json.loads(args.vision_config) == written["vision_config"]
        assert json.loads(args.vision_token_ids) == {key: written[key] for key in (
            "mm_tokens_per_image", "boi_token_index", "eoi_token_index", "image_token_index")}
        last = rank_file(tp2_pp2, f"mp_rank_0{tp}_001")["model"]
        assert all(name.startswith("language_model.") for name in last), list(last)


def test_tp2_torch_dist_and_a_config_built_from_the_args(source: Path, expected: Expected, tmp_path: Path) -> None:
    megatron = converted(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    dist = converted(megatron, tmp_path / "dist", dst_format="torch_dist")
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(dist / "iter_0000000")).read_metadata().state_dict_metadata
    assert {"vision_tower.post_layernorm.weight", "multi_modal_projector.proj.weight",
            "language_model.embedding.word_embeddings.weight"} <= set(stored)
    assert list(stored["multi_modal_projector.proj.weight"].size) == [64, 32]
    (dist / "hf" / "config.json").unlink()  # config.json built from the args alone
    back = converted(dist, tmp_path / "hf", dst_format="hf", dst_tp=1)
    assert_same_hf_tensors(source, back)
    inputs, logits = expected
    torch.testing.assert_close(vl_logits(back, inputs), logits, rtol=1e-5, atol=1e-5)
    written, original = (json.loads((path / "config.json").read_text()) for path in (back, source))
    assert written["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert written["vision_config"] == original["vision_config"]
    assert written["mm_tokens_per_image"] == 4 and written["image_token_index"] == original["image_token_index"]
    assert written["text_config"]["rope_parameters"] == original["text_config"]["rope_parameters"]
    assert written["text_config"]["layer_types"] == original["text_config"]["layer_types"]


def _released_layout(source: Path, tmp_path: Path) -> Path:
    """The source as gemma-3-4b-it's release stores it (transformers 4.50): the tower under SigLIP's wrapper
    (``vision_tower.vision_model.``); config.json's text settings in 4.x's spelling (``rope_scaling`` and the top-level
    RoPE bases, ``sliding_window_pattern``, no ``layer_types``), no model_type in ``vision_config``."""
    src = Path(shutil.copytree(source, tmp_path / "released"))
    tensors = load_file(str(src / "model.safetensors"))
    renamed = {name.replace("vision_tower.", "vision_tower.vision_model.", 1): tensor
               for name, tensor in tensors.items()}
    save_file(renamed, str(src / "model.safetensors"), metadata={"format": "pt"})
    doc = json.loads((src / "config.json").read_text())
    text = doc["text_config"]
    rope = text.pop("rope_parameters")
    for key in ("layer_types", "_sliding_window_pattern", "use_bidirectional_attention"):
        text.pop(key, None)
    text.update(sliding_window_pattern=6, rope_theta=rope["full_attention"]["rope_theta"],
                rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
                rope_scaling={"rope_type": "linear", "factor": rope["full_attention"]["factor"]})
    doc["vision_config"].pop("model_type")
    (src / "config.json").write_text(json.dumps(doc))
    return src


def test_the_released_names_and_config_json_read_as_transformers_5s(source: Path, tp2_pp2: Path,
                                                                    expected: Expected, tmp_path: Path) -> None:
    released = _released_layout(source, tmp_path)
    assert any(name.startswith("vision_tower.vision_model.") for name in load_hf_tensors(released))
    inputs, logits = expected
    torch.testing.assert_close(vl_logits(released, inputs), logits, rtol=0, atol=0)  # transformers reads both alike
    megatron = converted(released, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=2)
    for rank_dir in ("mp_rank_00_000", "mp_rank_01_001"):
        ours, theirs = rank_file(megatron, rank_dir), rank_file(tp2_pp2, rank_dir)
        assert list(ours["model"]) == list(theirs["model"])
        assert all(torch.equal(ours["model"][name], theirs["model"][name]) for name in theirs["model"])
    back = converted(megatron, tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)
    assert_same_hf_tensors(source, back)  # written with transformers 5's names
    torch.testing.assert_close(vl_logits(back, inputs), logits, rtol=1e-5, atol=1e-5)


def _text_logits(path: Path) -> torch.Tensor:
    """transformers' logits on a text input, of the model config.json names (VL or text), loaded strictly."""
    import transformers

    architecture = json.loads((path / "config.json").read_text())["architectures"][0]
    model, info = getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32,
                                                                      output_loading_info=True)
    assert not any(info.get(key) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        return model.eval()(input_ids=TEXT_IDS).logits


def test_text_only_writes_the_language_model_as_gemma3_text(source: Path, tp2_pp2: Path, tmp_path: Path) -> None:
    expected = _text_logits(source)
    from_hf = pgconvert.convert(source, tmp_path / "from_hf", dst_format="hf", text_only=True)
    from_megatron = pgconvert.convert(tp2_pp2, tmp_path / "from_megatron", dst_format="hf", dst_tp=1, dst_pp=1,
                                      text_only=True)
    language_model = {name.replace("language_model.model.", "model.", 1): tensor
                      for name, tensor in load_hf_tensors(source).items() if name.startswith("language_model.")}
    for report, out in ((from_hf, tmp_path / "from_hf"), (from_megatron, tmp_path / "from_megatron")):
        doc = json.loads((out / "config.json").read_text())
        assert doc["architectures"] == ["Gemma3ForCausalLM"] and doc["model_type"] == "gemma3_text"
        assert not {"vision_config", "text_config", "mm_tokens_per_image", "image_token_index"} & set(doc)
        written = load_hf_tensors(out)
        assert sorted(written) == sorted(language_model)
        assert all(torch.equal(written[name], language_model[name]) for name in written)
        torch.testing.assert_close(_text_logits(out), expected, rtol=1e-5, atol=1e-5)
        notice = next(notice for notice in report.notices if notice.startswith("--text-only"))
        assert "the projector (multi_modal_projector.mm_soft_embed_norm.weight, multi_modal_projector.proj.weight)" \
            in notice and "mrope" not in notice  # no multimodal RoPE to leave out
        assert not (out / "processor_config.json").exists()
        assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()


def _edited(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "src"))


def _edit_config(src: Path, change: dict[str, object]) -> None:
    doc = json.loads((src / "config.json").read_text())
    doc["vision_config"].update(change)
    (src / "config.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(("change", "message"), [
    ({"hidden_size": 48}, r"vision_tower\.embeddings\.patch_embedding\.weight has shape \[32, 3, 7, 7\], expected "
                          r"\[48, 3, 7, 7\].*vision_config"),
    ({"image_size": 35}, r"vision_tower\.embeddings\.position_embedding\.weight has shape \[16, 32\], expected "
                         r"\[25, 32\].*vision_config"),
    ({"vision_use_head": True}, r"vision_config\.vision_use_head=True: Gemma 3's tower has no pooling head"),
])
def test_a_vision_config_that_disagrees_with_the_tensors_is_a_named_error(
        source: Path, tmp_path: Path, change: dict[str, object], message: str) -> None:
    src = _edited(source, tmp_path)
    _edit_config(src, change)
    with pytest.raises(PgconvertError, match=message):
        pgconvert.convert(src, tmp_path / "out", dst_format="megatron", dst_tp=2)
    assert not (tmp_path / "out").exists()


def test_a_missing_projector_tensor_is_a_named_error(source: Path, tmp_path: Path) -> None:
    src = _edited(source, tmp_path)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors[PROJECTION]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    result = run_cli(src, tmp_path / "out", "--dst-format", "megatron", "--dst-tp", "2")
    assert_clean_refusal(result, 1, "missing: ['multi_modal_projector.mm_input_projection_weight']")
    assert not (tmp_path / "out").exists()


def test_a_tower_tensor_stored_under_both_names_is_a_named_error(source: Path, tmp_path: Path) -> None:
    src = _edited(source, tmp_path)
    tensors = load_file(str(src / "model.safetensors"))
    name = "vision_tower.post_layernorm.weight"
    tensors[name.replace("vision_tower.", "vision_tower.vision_model.")] = tensors[name].clone()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(PgconvertError, match=r"stores vision_tower\.post_layernorm\.weight twice: under that name and "
                                             r"as vision_tower\.vision_model\.post_layernorm\.weight"):
        pgconvert.convert(src, tmp_path / "out", dst_format="megatron")
    assert not (tmp_path / "out").exists()


def test_a_rank_file_without_the_projection_is_a_named_error(tp2_pp2: Path, tmp_path: Path) -> None:
    copy = edited_copy(tp2_pp2, tmp_path / "megatron", "mp_rank_01_000",
                       lambda state: state["model"].pop("multi_modal_projector.proj.weight"))
    with pytest.raises(PgconvertError, match=r"mp_rank_01_000.*missing: \['multi_modal_projector\.proj\.weight'\]"):
        pgconvert.convert(copy, tmp_path / "out", dst_format="hf", dst_tp=1, dst_pp=1)
    assert not (tmp_path / "out").exists()


def test_the_first_stage_holds_megatron_bridges_vision_modules_giving_transformers_image_features(
        source: Path, tp2_pp2: Path, expected: Expected) -> None:
    """As Megatron-Bridge's Gemma3VLModel builds its vision part: transformers' SigLIP vision model from
    ``args.vision_config`` takes a rank file's ``vision_tower.*`` strictly, and its Gemma3VLMultimodalProjector (average
    pooling to mm_tokens_per_image, a zero-centred RMSNorm, the column-parallel ``proj`` gathered over TP) gives the
    image features transformers computes from the source."""
    from transformers import AutoModel, Gemma3ForConditionalGeneration, SiglipVisionConfig

    ranks = [rank_file(tp2_pp2, f"mp_rank_0{tp}_000") for tp in range(2)]
    args = ranks[1]["args"]
    vision = {key: value for key, value in json.loads(args.vision_config).items() if key != "model_type"}
    built = AutoModel.from_config(SiglipVisionConfig(**vision))
    tower = getattr(built, "vision_model", built).eval()  # Bridge's unwrapping (transformers 5 has no wrapper)
    tower.load_state_dict({name.removeprefix("vision_tower."): tensor for name, tensor in ranks[1]["model"].items()
                           if name.startswith("vision_tower.")}, strict=True)
    pixels = expected[0]["pixel_values"]
    tokens = json.loads(args.vision_token_ids)["mm_tokens_per_image"]
    with torch.no_grad():
        hidden = tower(pixel_values=pixels).last_hidden_state  # [b, patches, vision hidden]
        side = vision["image_size"] // vision["patch_size"]
        grid = hidden.transpose(1, 2).reshape(hidden.shape[0], hidden.shape[2], side, side)
        pooled = torch.nn.functional.avg_pool2d(grid, side // int(tokens ** 0.5)).flatten(2).transpose(1, 2)
        norm = ranks[0]["model"]["multi_modal_projector.mm_soft_embed_norm.weight"]
        normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm)
        features = normed @ torch.cat([rank["model"]["multi_modal_projector.proj.weight"] for rank in ranks]).t()
        hf = Gemma3ForConditionalGeneration.from_pretrained(source, dtype=torch.float32).eval()
        reference = hf.model.get_image_features(pixel_values=pixels).pooler_output
    torch.testing.assert_close(features, reference, rtol=1e-5, atol=1e-5)
