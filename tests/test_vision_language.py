"""Vision-language models: Qwen2.5-VL through Megatron (TP2, TP2 x PP2, torch_dist) and back, as transformers
and Megatron-Bridge name it; its language model converted as Qwen2's, its vision tower and merger whole on
every TP rank of the first stage; Qwen3-VL (dense) the same way, its language model as Qwen3's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.hf_helpers import assert_same_hf_tensors, load_hf_tensors
from support.megatron_fixtures import load_for_test
from support.vision_language_models import build_vl_model, image_text_inputs, text_logits, vl_logits
from support.vl_runs import config_read_by_transformers, converted, edited_copy, rank_file

import pgconvert
from pgconvert.errors import PgconvertError

SIDE = ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json",
        "generation_config.json")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vl_model("qwen2_5_vl", tmp_path_factory.mktemp("qwen2_5_vl") / "hf")


@pytest.fixture(scope="module")
def expected(source: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The source's image + text input and transformers' logits on it."""
    inputs = image_text_inputs(source)
    return inputs, vl_logits(source, inputs)


@pytest.fixture(scope="module")
def tp2_pp2(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return converted(source, tmp_path_factory.mktemp("tp2_pp2") / "megatron", dst_format="megatron", dst_tp=2,
                      dst_pp=2)




def _assert_same_vl_model(src: Path, converted: Path, expected: tuple[dict[str, torch.Tensor], torch.Tensor]) -> None:
    assert_same_hf_tensors(src, converted)
    for name in SIDE:
        assert (converted / name).read_bytes() == (src / name).read_bytes(), name
    inputs, logits = expected
    torch.testing.assert_close(vl_logits(converted, inputs), logits, rtol=1e-5, atol=1e-5)


def test_hf_megatron_tp2_pp2_hf_is_the_same_model(source: Path, tp2_pp2: Path, expected: tuple[dict[str, torch.Tensor],
                                                                                                 torch.Tensor],
                                                   tmp_path: Path) -> None:
    back = converted(tp2_pp2, tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)
    _assert_same_vl_model(source, back, expected)
    # config.json (nested text_config / vision_config) is read back by transformers as the source's.
    assert config_read_by_transformers(back) == config_read_by_transformers(source)


def test_rank_files_hold_the_vision_part_whole_on_the_first_stage(source: Path, tp2_pp2: Path) -> None:
    stored = load_hf_tensors(source)
    vision = {name for name in stored if name.startswith("visual.")}
    first = [rank_file(tp2_pp2, f"mp_rank_0{tp}_000") for tp in range(2)]
    last = [rank_file(tp2_pp2, f"mp_rank_0{tp}_001") for tp in range(2)]
    for state in first:  # Megatron-Bridge's names: visual.* first (registered first), then language_model.*
        model = state["model"]
        names = list(model)
        assert set(names[:len(vision)]) == vision
        assert all(name.startswith("language_model.") for name in names[len(vision):])
        for name in vision:
            assert torch.equal(model[name], stored[name]), name
        args = state["args"]
        assert args.position_embedding_type == "mrope" and args.mrope_section == [2, 3, 3]
        assert json.loads(args.vision_config) == json.loads((source / "config.json").read_text())["vision_config"]
    for state in last:
        assert all(name.startswith("language_model.") for name in state["model"]), list(state["model"])
    assert "language_model.embedding.word_embeddings.weight" in first[0]["model"]
    assert "language_model.output_layer.weight" in last[0]["model"]


def test_tp2_torch_dist_and_a_config_built_from_the_args(source: Path, expected: tuple[dict[str, torch.Tensor],
                                                                                       torch.Tensor],
                                                         tmp_path: Path) -> None:
    megatron = converted(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    dist = converted(megatron, tmp_path / "dist", dst_format="torch_dist")
    # Without the carried config.json, config.json is built from the args alone.
    (dist / "hf" / "config.json").unlink()
    back = converted(dist, tmp_path / "hf", dst_format="hf", dst_tp=1)
    assert_same_hf_tensors(source, back)
    inputs, logits = expected
    torch.testing.assert_close(vl_logits(back, inputs), logits, rtol=1e-5, atol=1e-5)
    written = json.loads((back / "config.json").read_text())
    original = json.loads((source / "config.json").read_text())
    assert written["vision_config"] == original["vision_config"]
    assert written["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    # The sections change these logits: a config.json that lost them would not pass the comparison above.
    written["text_config"]["rope_parameters"]["mrope_section"] = [3, 3, 2]
    (back / "config.json").write_text(json.dumps(written))
    assert not torch.allclose(vl_logits(back, inputs), logits, rtol=1e-4, atol=1e-4)
    keys = json.loads((dist / "iter_0000000" / "metadata.json").read_text())
    assert keys["sharded_backend"] == "torch_dist"
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(dist / "iter_0000000")).read_metadata().state_dict_metadata
    assert "visual.merger.mlp.0.weight" in stored
    assert "language_model.embedding.word_embeddings.weight" in stored


def _edited(source: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(source, tmp_path / "src"))


def test_a_vision_config_that_disagrees_with_the_tensors_is_a_named_error(source: Path, tmp_path: Path) -> None:
    src = _edited(source, tmp_path)
    doc = json.loads((src / "config.json").read_text())
    doc["vision_config"]["hidden_size"] = 48
    (src / "config.json").write_text(json.dumps(doc))
    with pytest.raises(PgconvertError, match=r"visual\.patch_embed\.proj\.weight.*\[32, 3, 2, 14, 14\].*"
                                             r"vision_config"):
        pgconvert.convert(src, tmp_path / "out", dst_format="megatron")
    assert not (tmp_path / "out").exists()


def test_a_missing_merger_tensor_is_a_named_error(source: Path, tmp_path: Path) -> None:
    src = _edited(source, tmp_path)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["visual.merger.mlp.2.weight"]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(PgconvertError, match=r"visual\.merger\.mlp\.2\.weight"):
        pgconvert.convert(src, tmp_path / "out", dst_format="megatron")
    assert not (tmp_path / "out").exists()


def test_text_only_writes_the_language_model_as_qwen2(source: Path, tp2_pp2: Path, tmp_path: Path) -> None:
    ids = torch.tensor([[5, 6, 7, 40, 41, 42, 299, 8, 9, 10, 11, 12]])
    expected = text_logits(source, ids)
    from_hf = pgconvert.convert(source, tmp_path / "from_hf", dst_format="hf", text_only=True)
    from_megatron = pgconvert.convert(tp2_pp2, tmp_path / "from_megatron", dst_format="hf", dst_tp=1, dst_pp=1,
                                      text_only=True)
    stored = load_hf_tensors(source)
    for report, out in ((from_hf, tmp_path / "from_hf"), (from_megatron, tmp_path / "from_megatron")):
        doc = json.loads((out / "config.json").read_text())
        assert doc["architectures"] == ["Qwen2ForCausalLM"] and "vision_config" not in doc and "text_config" not in doc
        written = load_hf_tensors(out)
        assert sorted(written) == sorted(name for name in stored if not name.startswith("visual."))
        assert all(torch.equal(written[name], stored[name]) for name in written)
        torch.testing.assert_close(text_logits(out, ids), expected, rtol=1e-5, atol=1e-5)
        notice = next(notice for notice in report.notices if notice.startswith("--text-only"))
        assert "5 tensors: visual.merger.ln_q.weight … visual.merger.mlp.2.bias" in notice
        assert "mrope_section=[2, 3, 3]" in notice
        assert not (out / "preprocessor_config.json").exists()
        assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
        # HF's own text config is kept (token ids, window settings; through Megatron, the carried config.json),
        # less the vision part.
        assert doc["bos_token_id"] == 1 and doc["rope_parameters"] == {"rope_theta": 1000000.0, "rope_type": "default"}
        assert doc["max_window_layers"] == json.loads((source / "config.json").read_text())["text_config"][
            "max_window_layers"]
        assert not any("built from the model" in notice for notice in report.notices), report.notices
    assert "preprocessor_config.json" in next(n for n in from_hf.notices if n.startswith("--text-only"))


def test_text_only_megatron_output_is_a_text_model(source: Path, tmp_path: Path) -> None:
    out = converted(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2, text_only=True)
    state = rank_file(out, "mp_rank_00")
    assert not any(name.startswith(("visual.", "language_model.")) for name in state["model"])
    assert state["args"].position_embedding_type == "rope" and not hasattr(state["args"], "vision_config")
    assert not (out / "hf" / "preprocessor_config.json").exists()
    # Its carried VL config.json is read as the text model's.
    back = converted(out, tmp_path / "hf", dst_format="hf", dst_tp=1)
    assert json.loads((back / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    stored = load_hf_tensors(source)
    assert all(torch.equal(tensor, stored[name]) for name, tensor in load_hf_tensors(back).items())


def test_text_only_refuses_a_text_model(tmp_path: Path) -> None:
    from support.hf_helpers import build_hf_model, save_hf_model

    src = save_hf_model(build_hf_model("qwen2"), tmp_path / "qwen2")
    with pytest.raises(PgconvertError, match="--text-only: .* is a text model"):
        pgconvert.convert(src, tmp_path / "out", dst_format="megatron", text_only=True)
    assert not (tmp_path / "out").exists()


def test_a_virtual_pipeline_and_the_te_spec_keep_the_vision_part_on_the_first_chunk(source: Path, tp2_pp2: Path,
                                                                                     tmp_path: Path) -> None:
    vpp = converted(tp2_pp2, tmp_path / "vpp", dst_tp=1, dst_pp=2, dst_vpp=2,
                     dst_transformer_impl="transformer_engine")
    first, last = rank_file(vpp, "mp_rank_00_000"), rank_file(vpp, "mp_rank_00_001")
    assert [sum(name.startswith("visual.") for name in state[chunk]) for state in (first, last)
            for chunk in ("model0", "model1")] == [30, 0, 0, 0]
    assert "language_model.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in first["model0"]
    back = converted(vpp, tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)
    assert_same_hf_tensors(source, back)


def test_optimizer_state_and_fsdp_dtensor_refuse_the_vision_part_by_name(tp2_pp2: Path, tmp_path: Path) -> None:
    with pytest.raises(PgconvertError, match="fsdp_dtensor .*vision_config"):
        pgconvert.convert(tp2_pp2, tmp_path / "fsdp", dst_format="fsdp_dtensor")
    from pgconvert.optimizer.order import UnsupportedOptimizerError, check_supported
    from pgconvert.formats.registry import get_loader
    from pgconvert.formats import LoadOptions

    with get_loader("megatron").open(tp2_pp2, LoadOptions()) as megatron:
        with pytest.raises(UnsupportedOptimizerError, match="vision_config is set.*--skip-optimizer"):
            check_supported(megatron.config, "here")


def test_a_rank_file_without_the_merger_or_with_a_vision_config_of_other_sizes_is_a_named_error(
        tp2_pp2: Path, tmp_path: Path) -> None:
    for case, change in (("missing", lambda state: state["model"].pop("visual.merger.mlp.2.weight")),
                         ("sizes", lambda state: setattr(state["args"], "vision_config", state["args"].vision_config
                                                         .replace('"hidden_size":32', '"hidden_size":48')))):
        copy = edited_copy(tp2_pp2, tmp_path / case, "mp_rank_01_000", change)
        expected = (r"mp_rank_01_000.*missing: \['visual\.merger\.mlp\.2\.weight'\]" if case == "missing" else
                    r"mp_rank_01_000.*visual\.patch_embed\.proj\.weight has shape \[32, 3, 2, 14, 14\], expected "
                    r"\[48, 3, 2, 14, 14\].*vision_config")
        if case == "sizes":  # every rank file records the args; the first one read names the model
            for other in copy.glob("iter_0000000/mp_rank_*/model_optim_rng.pt"):
                other_state = load_for_test(other)
                change(other_state)
                torch.save(other_state, other)
            expected = expected.replace("mp_rank_01_000", "mp_rank_0[01]_000")
        with pytest.raises(PgconvertError, match=expected):
            pgconvert.convert(copy, tmp_path / f"{case}_out", dst_format="hf", dst_tp=1, dst_pp=1)
        assert not (tmp_path / f"{case}_out").exists()


def test_a_projector_that_does_not_write_the_language_models_width_is_a_named_error(source: Path,
                                                                                      tmp_path: Path) -> None:
    src = _edited(source, tmp_path)
    doc = json.loads((src / "config.json").read_text())
    doc["vision_config"]["out_hidden_size"] = 32
    (src / "config.json").write_text(json.dumps(doc))
    with pytest.raises(PgconvertError, match=r"config\.json: describes an impossible model: "
                                             r"vision_config\.out_hidden_size=32: must equal the language model's "
                                             r"hidden_size=64"):
        pgconvert.convert(src, tmp_path / "out", dst_format="megatron")


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vl_model("qwen3_vl", tmp_path_factory.mktemp("qwen3_vl") / "hf")


def test_qwen3_vl_through_megatron_tp2_pp2_and_text_only(qwen3_vl: Path, tmp_path: Path) -> None:
    inputs = image_text_inputs(qwen3_vl)
    megatron = converted(qwen3_vl, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=2)
    first = rank_file(megatron, "mp_rank_01_000")["model"]
    stored = load_hf_tensors(qwen3_vl)
    vision = [name for name in stored if name.startswith("model.visual.")]
    # Megatron-Bridge's Qwen3VLModel: the vision part as vision_model.*, whole on every TP rank of the first stage.
    assert set(list(first)[:len(vision)]) == {name.replace("model.visual.", "vision_model.") for name in vision}
    assert all(torch.equal(first[name.replace("model.visual.", "vision_model.")], stored[name]) for name in vision)
    assert "vision_model.deepstack_merger_list.1.linear_fc2.weight" in first
    back = converted(megatron, tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)
    assert_same_hf_tensors(qwen3_vl, back)
    torch.testing.assert_close(vl_logits(back, inputs), vl_logits(qwen3_vl, inputs), rtol=1e-5, atol=1e-5)
    text = converted(megatron, tmp_path / "text", dst_format="hf", dst_tp=1, dst_pp=1, text_only=True)
    doc = json.loads((text / "config.json").read_text())
    assert doc["architectures"] == ["Qwen3ForCausalLM"] and "mrope_interleaved" not in doc["rope_parameters"]
    ids = torch.tensor([[5, 6, 7, 40, 41, 42, 299, 8, 9, 10, 11, 12]])
    torch.testing.assert_close(text_logits(text, ids), text_logits(qwen3_vl, ids), rtol=1e-5, atol=1e-5)


def test_megatron_core_and_the_hf_vision_module_load_the_tp1_rank_file_and_compute_transformers_logits(
        source: Path, expected: tuple[dict[str, torch.Tensor], torch.Tensor], tmp_path: Path) -> None:
    """As Megatron-Bridge's Qwen25VLModel: transformers' vision module (visual.*) and megatron-core's GPTModel with
    multimodal RoPE (language_model.*), each loaded strictly, give the source's logits on an image + text input."""
    from support.mcore_helpers import rank_files
    from support.mcore_vision_language import bridge_logits

    (rank,) = rank_files(converted(source, tmp_path / "megatron", dst_format="megatron", dst_tp=1))
    inputs, logits = expected
    computed = bridge_logits(rank, inputs)[..., :logits.shape[-1]]
    torch.testing.assert_close(computed, logits, rtol=1e-5, atol=1e-5)
    # Without the image's 3D positions (every position id alike) the logits move: megatron-core computes the sections.
    assert rank.args.position_embedding_type == "mrope" and rank.args.mrope_section == [2, 3, 3]
    flat = bridge_logits(rank, inputs, image_positions=False)[..., :logits.shape[-1]]
    assert not torch.allclose(flat, logits, rtol=1e-4, atol=1e-4)


def test_qwen3_vl_moe_through_megatron_tp2_pp2_ep2_and_text_only(tmp_path: Path) -> None:
    source = build_vl_model("qwen3_vl_moe", tmp_path / "hf")
    inputs = image_text_inputs(source)
    megatron = converted(source, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=2, dst_ep=2)
    last = rank_file(megatron, "mp_rank_01_001_001")["model"]
    stored = load_hf_tensors(source)
    # EP rank 1 holds experts 2 and 3 of the stacked HF tensor, as local experts 0 and 1.
    local = last["language_model.decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"]
    assert torch.equal(local, stored["model.language_model.layers.1.mlp.experts.down_proj"][3][:, 16:])
    back = converted(megatron, tmp_path / "back", dst_format="hf", dst_tp=1, dst_pp=1, dst_ep=1)
    assert_same_hf_tensors(source, back)
    torch.testing.assert_close(vl_logits(back, inputs), vl_logits(source, inputs), rtol=1e-5, atol=1e-5)
    text = converted(megatron, tmp_path / "text", dst_format="hf", dst_tp=1, dst_pp=1, dst_ep=1, text_only=True)
    doc = json.loads((text / "config.json").read_text())
    assert doc["architectures"] == ["Qwen3MoeForCausalLM"] and doc["norm_topk_prob"] is True
    ids = torch.tensor([[5, 6, 7, 40, 41, 42, 299, 8, 9, 10, 11, 12]])
    torch.testing.assert_close(text_logits(text, ids), text_logits(source, ids), rtol=1e-5, atol=1e-5)


def test_a_towers_tensor_megatron_shards_is_cut_by_its_rule(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A made-up tower whose projector is a column-parallel linear (as Megatron-Bridge's Gemma 3 projector): one
    entry in TOWERS; the provider cuts it by its rule and the Megatron format merges it back."""
    from pgconvert.formats.stream import InMemorySource
    from pgconvert.model.config import ModelConfig
    from pgconvert.model.grid import build_converter_process_groups, iter_ranks
    from pgconvert.model.layout import ParallelLayout
    from pgconvert.formats import SaveOptions
    from pgconvert.model.provider import canonical_shapes, provide
    from pgconvert.model.rules import COLUMN
    from pgconvert.savers.megatron import MegatronSaver
    from pgconvert.model.vision import TOWERS, Tower, VisionTensor

    def tower(vision: dict[str, object], hidden_size: int) -> list[VisionTensor]:
        return [VisionTensor("visual.norm.weight", (4,), "tower"),
                VisionTensor("visual.proj.weight", (16, 4), "projector", COLUMN)]

    monkeypatch.setitem(TOWERS, "made_up_vision", Tower("visual.", tower, ("out_hidden_size", 16)))
    config = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, vocab_size=64,
                         params_dtype="float32", vision_config=json.dumps({"model_type": "made_up_vision"}),
                         vision_token_ids="{}")
    layout = ParallelLayout(tp=2, pp=2)
    groups = build_converter_process_groups(layout)
    held = {}
    for coord in iter_ranks(layout):
        groups.set_coord(coord)
        held[(coord.tp, coord.pp)] = {spec.local_name: spec.local_shape for spec in provide(config, groups).specs
                                      if spec.local_name.startswith("visual.")}
    assert held[(0, 0)] == held[(1, 0)] == {"visual.norm.weight": (4,), "visual.proj.weight": (8, 4)}
    assert held[(0, 1)] == held[(1, 1)] == {}
    tensors = {name: torch.randn(shape, generator=torch.Generator().manual_seed(index))
               for index, (name, shape) in enumerate(canonical_shapes(config).items())}
    out = tmp_path / "megatron"
    MegatronSaver().save(InMemorySource(config, tensors), out, SaveOptions(layout=layout), lambda nbytes: None)
    first = [rank_file(out, f"mp_rank_0{tp}_000")["model"] for tp in range(2)]
    assert torch.equal(torch.cat([model["visual.proj.weight"] for model in first]), tensors["visual.proj.weight"])
    from pgconvert.formats import LoadOptions
    from pgconvert.formats.registry import get_loader

    dist = converted(out, tmp_path / "dist", dst_format="torch_dist")
    for path, format_name in ((out, "megatron"), (dist, "torch_dist")):
        with get_loader(format_name).open(path, LoadOptions()) as loaded:  # vocab tables come back padded
            assert [name for name, tensor in tensors.items()
                    if not torch.equal(loaded.load(name)[:len(tensor)], tensor)] == [], format_name


def _released_layout(source: Path, tmp_path: Path) -> Path:
    """The source with config.json as Qwen2.5-VL's release ships it (transformers 4.x): the text settings at the top
    level, RoPE as ``rope_scaling`` of type "mrope", no ``model_type`` in ``vision_config``."""
    src = _edited(source, tmp_path)
    doc = json.loads((src / "config.json").read_text())
    text = doc.pop("text_config")
    rope = text.pop("rope_parameters")
    doc["vision_config"].pop("model_type")
    doc.update({key: value for key, value in text.items() if key not in ("model_type", "layer_types")},
               rope_theta=rope["rope_theta"], rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    (src / "config.json").write_text(json.dumps(doc))
    return src


def test_the_released_flat_config_json_reads_as_the_nested_one(source: Path, tp2_pp2: Path, expected: tuple[
        dict[str, torch.Tensor], torch.Tensor], tmp_path: Path) -> None:
    released = _released_layout(source, tmp_path)
    inputs, logits = expected
    torch.testing.assert_close(vl_logits(released, inputs), logits, rtol=0, atol=0)  # transformers reads both alike
    megatron = converted(released, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=2)
    for rank_dir in ("mp_rank_00_000", "mp_rank_01_001"):
        assert vars(rank_file(megatron, rank_dir)["args"]) == vars(rank_file(tp2_pp2, rank_dir)["args"])
    (megatron / "hf" / "config.json").unlink()  # config.json built from the args: the nested form
    back = converted(megatron, tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)
    assert "text_config" in json.loads((back / "config.json").read_text())
    assert_same_hf_tensors(source, back)
    torch.testing.assert_close(vl_logits(back, inputs), logits, rtol=1e-5, atol=1e-5)
