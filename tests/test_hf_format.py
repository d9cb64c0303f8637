"""Family tables, transforms, config.json mapping and the on-disk contract of the hf saver."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from support.hf_helpers import FAMILY_MODELS, build_hf_model, edit_json, load_hf_tensors, save_hf_model
from safetensors import safe_open

import pgconvert
from pgconvert.loaders.hf import HFLoader
from pgconvert.loaders.megatron import MegatronLoader
from pgconvert.model.config import ModelConfig
from pgconvert.errors import ConfigError
from pgconvert.run.example import example_config, example_source
from pgconvert.families import FAMILIES
from pgconvert.families.llama import DECODER_TENSORS
from pgconvert.families.table import DROPPED, GATE_UP, IDENTITY, QKV, ConfigField, Family, TensorMapping, TensorTable
from pgconvert.formats import LoadOptions, SaveOptions
from pgconvert.formats.hf import hf_config_from_model, infer_family
from pgconvert.model.layout import ParallelLayout
from pgconvert.model.provider import canonical_names
from pgconvert.model.rules import COLUMN, GATED, ROW, Window, assemble
from pgconvert.savers.hf import HFSaver


@pytest.fixture(scope="module")
def hf_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_sources")
    return {name: save_hf_model(build_hf_model(name, seed=1), root / name) for name in sorted(FAMILY_MODELS)}


def _config(heads: int = 4, groups: int = 2, head_dim: int = 2, **changes: object) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=heads, num_query_groups=groups,
                       kv_channels=head_dim, ffn_hidden_size=6, vocab_size=10, **changes)  # type: ignore[arg-type]


# --- transforms ---------------------------------------------------------------------------------

def test_qkv_fuse_orders_rows_by_query_group() -> None:
    config = _config(heads=4, groups=2, head_dim=2)
    query = torch.arange(8.0)[:, None]  # heads 0..3, two rows each
    key = 100 + torch.arange(4.0)[:, None]
    value = 200 + torch.arange(4.0)[:, None]

    fused = QKV.fuse([query, key, value], config)

    assert fused.flatten().tolist() == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1), (8, 2)], ids=["mha", "gqa2", "mqa", "gqa4"])
@pytest.mark.parametrize("with_columns", [True, False], ids=["weight", "bias"])
def test_qkv_split_inverts_fuse(heads: int, groups: int, with_columns: bool) -> None:
    config = _config(heads=heads, groups=groups, head_dim=3)
    rest = (5,) if with_columns else ()
    parts = [torch.randn(heads * 3, *rest), torch.randn(groups * 3, *rest), torch.randn(groups * 3, *rest)]

    fused = QKV.fuse(parts, config)
    back = QKV.split(fused, config)

    assert fused.shape == (config.qkv_rows, *rest)
    assert QKV.part_shapes(tuple(fused.shape), config) == [tuple(p.shape) for p in parts]
    assert all(torch.equal(a, b) for a, b in zip(back, parts, strict=True))


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize(("heads", "groups"), [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("transform", [QKV, GATE_UP, IDENTITY], ids=["qkv", "gate-up", "identity"])
def test_split_runs_give_each_part_as_runs_of_the_fused_tensor_in_order(transform: object, heads: int, groups: int,
                                                                        gated: bool) -> None:
    """Each part's runs, one after the other, are its values as ``split`` gives them; a fused QKV's runs are views
    of the fused tensor (each query group's rows), so a writer writes them with no part made apart."""
    config = _config(heads=heads, groups=groups, head_dim=3, attention_output_gate=gated)
    full = torch.randn(2 * config.qkv_rows if transform is GATE_UP else config.qkv_rows, 5)
    runs = transform.split_runs(full, config)
    parts = transform.split(full, config)
    assert len(runs) == len(parts)
    for part, part_runs in zip(parts, runs, strict=True):
        assert all(run.is_contiguous() for run in part_runs)
        assert torch.equal(torch.cat([run.reshape(-1) for run in part_runs]), part.reshape(-1))
    if transform is QKV and not gated:
        assert all(len(part_runs) == groups for part_runs in runs)
        assert all(run.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
                   for part_runs in runs for run in part_runs)


def test_gate_up_fuse_puts_gate_first_and_split_inverts_it() -> None:
    config = _config()
    gate, up = torch.arange(12.0).view(6, 2), 100 + torch.arange(12.0).view(6, 2)

    fused = GATE_UP.fuse([gate, up], config)

    assert torch.equal(fused[:6], gate) and torch.equal(fused[6:], up)
    assert all(torch.equal(a, b) for a, b in zip(GATE_UP.split(fused, config), [gate, up], strict=True))
    assert GATE_UP.part_shapes((12, 2), config) == [(6, 2), (6, 2)]


@pytest.mark.parametrize("into", [False, True], ids=["read", "into"])
@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize(("transform", "rule", "gated"), [(IDENTITY, COLUMN, False), (IDENTITY, ROW, False),
                                                           (GATE_UP, GATED, False), (GATE_UP, ROW, False),
                                                           (QKV, COLUMN, False), (QKV, COLUMN, True)],
                         ids=["identity-column", "identity-row", "gate-up-gated", "gate-up-columns", "qkv-column",
                              "gated-qkv-column"])
def test_a_transform_reads_each_window_of_a_piece_from_ranges_of_its_parts(transform: object, rule: object, gated: bool,
                                                                          size: int, into: bool) -> None:
    """Each piece read window by window (``read_window``, or ``read_window_into`` straight into the piece) equals
    the rule's cut of the fused tensor, and the parts' elements are read once in all."""
    config = _config(heads=8, groups=4, head_dim=2, attention_output_gate=gated)
    rows = {"identity": [16], "fuse-gate-up": [8, 8], "fuse-qkv-by-group": [32 if gated else 16, 8, 8]}[transform.name]
    parts = [torch.randn(n, 8) + 1000 * i for i, n in enumerate(rows)]
    full = transform.fuse(parts, config)
    reads: list[tuple[int, int, int, int]] = []

    def read_part(part: int, dim: int, start: int, stop: int) -> torch.Tensor:
        reads.append((part, dim, start, stop))
        return parts[part].narrow(dim, start, stop - start)

    def read_into(part: int, dim: int, start: int, stop: int, out: torch.Tensor) -> None:
        out.copy_(read_part(part, dim, start, stop).reshape(out.shape))

    shape = tuple(full.shape)
    for rank in range(size):
        windows = rule.piece_windows(shape, size, rank)
        assert all(transform.reads_window(w, shape, config) for w in windows)
        if into:
            piece = assemble(windows, lambda w, out: transform.read_window_into(w, shape, config, read_into, out),
                             full.shape, full.dtype)
        else:
            piece = assemble(windows, lambda w, out: out.copy_(transform.read_window(w, shape, config, read_part)),
                             full.shape, full.dtype)
        assert torch.equal(piece, rule.shard(full, size, rank))
    assert sum((stop - start) * parts[part].shape[1 - dim] for part, dim, start, stop in reads) == full.numel()


def test_a_window_read_into_a_strided_place_equals_the_window() -> None:
    """A QKV window read into a place that is not contiguous (a column slice of a larger tensor) is read and
    copied: the same values."""
    config = _config(heads=8, groups=4, head_dim=2)
    parts = [torch.randn(16, 8), torch.randn(8, 8), torch.randn(8, 8)]
    full = QKV.fuse(parts, config)
    window = Window(0, 8, 16)

    def read_into(part: int, dim: int, start: int, stop: int, out: torch.Tensor) -> None:
        out.copy_(parts[part].narrow(dim, start, stop - start).reshape(out.shape))

    wide = torch.zeros(16, 12)
    QKV.read_window_into(window, tuple(full.shape), config, read_into, wide[:, 2:10])
    assert torch.equal(wide[:, 2:10], full[8:24])
    assert torch.equal(wide[:, :2], torch.zeros(16, 2)) and torch.equal(wide[:, 10:], torch.zeros(16, 2))


def test_fused_qkv_reads_only_windows_on_query_group_boundaries() -> None:
    config = _config(heads=8, groups=4, head_dim=2)  # a group is 2 query heads, k and v: 8 rows

    assert QKV.reads_window(Window(0, 8, 16), (32, 6), config)
    assert not QKV.reads_window(Window(0, 4, 8), (32, 6), config)
    assert not QKV.reads_window(Window(1, 0, 3), (32, 6), config)
    assert not DROPPED.reads_window(Window(0, 0, 1), (1,), config)


# --- tables -------------------------------------------------------------------------------------

def test_table_rows_with_different_slot_counts_are_refused() -> None:
    with pytest.raises(ValueError, match=r"different numbers of \{\} slots"):
        TensorMapping("decoder.layers.{}.x.weight", ("model.x.weight",))


def test_table_rows_with_wrong_part_count_are_refused() -> None:
    with pytest.raises(ValueError, match="takes 3 HF tensors, 2 given"):
        TensorMapping("decoder.layers.{}.q.weight", ("a.{}.q", "a.{}.k"), QKV)
    with pytest.raises(ValueError, match="canonical=None and the dropped transform go together"):
        TensorMapping(None, ("a.{}.q",), IDENTITY)


def test_table_with_repeated_pattern_is_refused() -> None:
    with pytest.raises(ValueError, match=r"hf patterns appear more than once: \['x.{}'\]"):
        TensorTable((TensorMapping("a.{}", ("x.{}",)), TensorMapping("b.{}", ("x.{}",))))


def test_family_naming_unknown_model_fields_is_refused() -> None:
    with pytest.raises(ValueError, match=r"not ModelConfig fields: \['no_such_field'\]"):
        Family("X", "x", DECODER_TENSORS, (ConfigField(("a",), "hidden_size", int),), {"no_such_field": 1})


def test_table_maps_by_whole_name_with_layer_slots() -> None:
    row, names = DECODER_TENSORS.to_hf("decoder.layers.12.self_attention.linear_qkv.bias")  # type: ignore[misc]
    config = _config(heads=4, groups=2, head_dim=1)
    query, key, value = torch.arange(4.0), 10 + torch.arange(2.0), 20 + torch.arange(2.0)

    assert row.transform.fuse([query, key, value], config).tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert names == ("model.layers.12.self_attn.q_proj.bias", "model.layers.12.self_attn.k_proj.bias",
                     "model.layers.12.self_attn.v_proj.bias")
    assert DECODER_TENSORS.to_hf("decoder.layers.x.self_attention.linear_qkv.bias") is None
    assert DECODER_TENSORS.to_hf("decoder.layers.1.self_attention.linear_qkv.bias.extra") is None
    assert DECODER_TENSORS.is_dropped("model.layers.3.self_attn.rotary_emb.inv_freq")
    assert not DECODER_TENSORS.is_dropped("model.layers.3.self_attn.rotary_emb.inv_freq_copy")
    assert [row.hf for row in DECODER_TENSORS.rows if row.transform.drops] == [
        row.hf for row in DECODER_TENSORS.rows if row.canonical is None] != []


# What a dense family's model needs beyond its fixed values (Qwen3.5's gated delta net sizes and the only spec
# megatron-core builds them with).
_NEEDS: dict[str, dict[str, object]] = {
    "Qwen3_5ForCausalLM": {"linear_attention_freq": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                           "linear_key_head_dim": 2, "linear_value_head_dim": 2, "transformer_impl": "transformer_engine"},
}


# MoE families are covered with MoE configs by tests/test_hf_moe.py.
@pytest.mark.parametrize("architecture", sorted(a for a, f in FAMILIES.items() if f.fixed.get("num_experts", 0) is None))
def test_every_family_table_fills_every_canonical_tensor_of_its_models(architecture: str) -> None:
    family = FAMILIES[architecture]
    config = _config(heads=4, groups=2, head_dim=2, **{**family.fixed, **_NEEDS.get(architecture, {})})
    for tied in (True, False):
        names = canonical_names(config.replace(tie_embeddings=tied))
        assert [name for name in names if family.tensors.to_hf(name) is None] == []


def test_family_inference_from_a_model_config() -> None:
    assert infer_family(_config(qk_layernorm=True)).architecture == "Qwen3ForCausalLM"
    assert infer_family(_config(add_qkv_bias=True)).architecture == "Qwen2ForCausalLM"
    assert infer_family(_config()).architecture == "LlamaForCausalLM"
    assert infer_family(_config(add_bias_linear=True)).architecture == "LlamaForCausalLM"


def test_gpt2_like_model_is_refused_listing_the_supported_families() -> None:
    config = example_config().replace(
        num_query_groups=16, gated_linear_unit=False, activation="gelu", normalization="LayerNorm",
        add_bias_linear=True, position_embedding_type="learned_absolute", tie_embeddings=True,
    )
    source = example_source(config)

    from pgconvert.families import supported_architectures

    listed = ", ".join(supported_architectures())
    with pytest.raises(ConfigError, match=re.escape(f"fits none of the supported families ({listed})")):
        HFSaver().validate(source, SaveOptions(layout=ParallelLayout()))


# --- config.json <-> ModelConfig ----------------------------------------------------------------

def test_qwen3_config_json_becomes_a_model_config(hf_sources: dict[str, Path]) -> None:
    with HFLoader().open(hf_sources["qwen3"], LoadOptions()) as source:
        config = source.config
        assert source.layout is None and source.iteration is None
        assert source.vocab_rows == 1000

    assert config == ModelConfig(
        num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4, kv_channels=16,
        ffn_hidden_size=128, vocab_size=1000, make_vocab_size_divisible_by=128, gated_linear_unit=True,
        activation="silu", normalization="RMSNorm", norm_epsilon=1e-6, add_bias_linear=False,
        add_qkv_bias=False, qk_layernorm=True, tie_embeddings=False, position_embedding_type="rope",
        max_position_embeddings=256, rotary_base=10000.0, params_dtype="float32", transformer_impl="local",
    )


def test_llama_biases_and_qwen2_qkv_bias_map_to_megatron_switches(hf_sources: dict[str, Path]) -> None:
    with HFLoader().open(hf_sources["llama_bias"], LoadOptions()) as source:
        assert (source.config.add_bias_linear, source.config.add_qkv_bias) == (True, False)
    with HFLoader().open(hf_sources["qwen2"], LoadOptions()) as source:
        assert (source.config.add_bias_linear, source.config.add_qkv_bias) == (False, True)
        assert source.config.tie_embeddings


def test_transformers_4_config_spelling_is_read(hf_sources: dict[str, Path], tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(hf_sources["llama"], src)

    def to_v4(doc: dict[str, object]) -> None:
        doc["rope_theta"] = doc.pop("rope_parameters")["rope_theta"]  # type: ignore[index]
        doc["torch_dtype"] = doc.pop("dtype")

    edit_json(src / "config.json", to_v4)

    with HFLoader().open(src, LoadOptions()) as source:
        assert source.config.rotary_base == 50000.0
        assert source.config.params_dtype == "float32"


def test_config_built_from_a_model_config_loads_in_transformers() -> None:
    from transformers import Qwen3Config

    config = _config(heads=4, groups=2, head_dim=16, qk_layernorm=True, rotary_base=1e6, norm_epsilon=1e-5)
    doc = hf_config_from_model(FAMILIES["Qwen3ForCausalLM"], config, torch.bfloat16)

    loaded = Qwen3Config.from_dict(doc)
    assert (loaded.hidden_size, loaded.num_attention_heads, loaded.num_key_value_heads) == (8, 4, 2)
    assert loaded.head_dim == 16
    assert loaded.rope_parameters["rope_theta"] == 1e6
    assert doc["rope_theta"] == 1e6  # transformers 4.x reads the top-level spelling
    assert (loaded.rms_norm_eps, loaded.vocab_size, loaded.tie_word_embeddings) == (1e-5, 10, False)
    assert doc["dtype"] == "bfloat16" and doc["architectures"] == ["Qwen3ForCausalLM"]


# --- the hf saver's output ----------------------------------------------------------------------

def test_sharded_output_follows_transformers_layout(hf_sources: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    limit = 100_000
    with HFLoader().open(hf_sources["qwen3"], LoadOptions()) as source:
        options = SaveOptions(layout=ParallelLayout(), max_shard_size=limit)
        planned = HFSaver().plan(source, options)
        result = HFSaver().save(source, out, options, lambda nbytes: None)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    count = len(result.files)
    # the plan knows names, tensor counts and bytes; the written files add their size and digest
    assert count > 2 and [(f.relpath, f.tensors, f.nbytes) for f in result.files] == [
        (f.relpath, f.tensors, f.nbytes) for f in planned]
    assert all(f.digest is not None and f.size == (out / f.relpath).stat().st_size for f in result.files)
    assert [f.relpath for f in result.files] == [
        f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)
    ]
    assert set(index["weight_map"].values()) == {f.relpath for f in result.files}
    stored: dict[str, str] = {}
    total = 0
    for item in result.files:
        with safe_open(str(out / item.relpath), framework="pt") as handle:
            for name in handle.keys():
                stored[name] = item.relpath
                total += handle.get_tensor(name).nbytes
        assert item.nbytes <= limit or item.tensors <= 3, item
    assert stored == index["weight_map"]
    assert index["metadata"]["total_size"] == total
    for layer in range(4):
        prefix = f"model.layers.{layer}.self_attn."
        assert len({stored[prefix + part + "_proj.weight"] for part in "qkv"}) == 1
    assert sorted(n.removeprefix("model.layers.0.") for n in stored if n.startswith("model.layers.0.")) == [
        "input_layernorm.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "post_attention_layernorm.weight", "self_attn.k_norm.weight", "self_attn.k_proj.weight",
        "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.q_proj.weight", "self_attn.v_proj.weight",
    ]
    assert {n for n in stored if not n.startswith("model.layers.")} == {
        "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
    }
    shapes = {}
    for item in result.files:
        with safe_open(str(out / item.relpath), framework="pt") as handle:
            shapes.update({name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()})
    layer = "model.layers.2."
    assert {name.removeprefix(layer): shape for name, shape in shapes.items() if name.startswith(layer)} == {
        "input_layernorm.weight": (64,), "post_attention_layernorm.weight": (64,),
        "self_attn.q_proj.weight": (128, 64), "self_attn.k_proj.weight": (64, 64),
        "self_attn.v_proj.weight": (64, 64), "self_attn.o_proj.weight": (64, 128),
        "self_attn.q_norm.weight": (16,), "self_attn.k_norm.weight": (16,),
        "mlp.gate_proj.weight": (128, 64), "mlp.up_proj.weight": (128, 64), "mlp.down_proj.weight": (64, 128),
    }
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (1000, 64)


def test_llama_with_biases_writes_every_bias(hf_sources: dict[str, Path], tmp_path: Path) -> None:
    pgconvert.convert(hf_sources["llama_bias"], tmp_path / "m", dst_format="megatron", dst_tp=2)
    pgconvert.convert(tmp_path / "m", tmp_path / "hf", dst_format="hf", dst_tp=1)

    biases = sorted(n.removeprefix("model.layers.3.") for n in load_hf_tensors(tmp_path / "hf")
                    if n.startswith("model.layers.3.") and n.endswith(".bias"))
    assert biases == ["mlp.down_proj.bias", "mlp.gate_proj.bias", "mlp.up_proj.bias", "self_attn.k_proj.bias",
                      "self_attn.o_proj.bias", "self_attn.q_proj.bias", "self_attn.v_proj.bias"]
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["attention_bias"], written["mlp_bias"]) == (True, True)


def test_user_config_json_names_the_family_to_write(hf_sources: dict[str, Path], tmp_path: Path) -> None:
    pgconvert.convert(hf_sources["mistral"], tmp_path / "m", dst_format="megatron", dst_tp=2)
    out = tmp_path / "out"
    out.mkdir()
    with MegatronLoader().open(tmp_path / "m", LoadOptions()) as source:
        options = SaveOptions(layout=ParallelLayout(), hf_config=hf_sources["mistral"] / "config.json")
        HFSaver().validate(source, options)
        HFSaver().save(source, out, options, lambda nbytes: None)

    given = json.loads((hf_sources["mistral"] / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == given
    expected, actual = load_hf_tensors(hf_sources["mistral"]), load_hf_tensors(out)
    assert sorted(actual) == sorted(expected) and all(torch.equal(actual[k], v) for k, v in expected.items())


def test_user_config_json_that_describes_another_model_is_refused(hf_sources: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    other = tmp_path / "config.json"
    shutil.copy(hf_sources["llama"] / "config.json", other)
    edit_json(other, lambda doc: doc.update(intermediate_size=256, num_key_value_heads=2))
    with HFLoader().open(hf_sources["llama"], LoadOptions()) as source:
        with pytest.raises(ConfigError, match=re.escape(
            f"{other}: does not describe the source model: ffn_hidden_size: 256 in the file, 128 in the model; "
            "num_query_groups: 2 in the file, 4 in the model"
        )):
            HFSaver().validate(source, SaveOptions(layout=ParallelLayout(), hf_config=other))


def _drop_vocab_size_from_args(root: Path) -> None:
    for rank_file in root.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        with torch.serialization.safe_globals([argparse.Namespace]):
            state = torch.load(rank_file, weights_only=True)
        del state["args"].vocab_size
        torch.save(state, rank_file)


def test_megatron_source_without_true_vocab_size_is_refused_naming_the_flag(hf_sources: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    pgconvert.convert(hf_sources["llama"], tmp_path / "m", dst_format="megatron", dst_tp=2)
    _drop_vocab_size_from_args(tmp_path / "m")

    with pytest.raises(ConfigError, match=r"true vocab size is unknown \(its vocab tables have 1024 padded rows\); "
                                          r"pass --true-vocab-size"):
        pgconvert.convert(tmp_path / "m", tmp_path / "hf", dst_format="hf", dst_tp=1)
    assert not (tmp_path / "hf").exists()

    pgconvert.convert(tmp_path / "m", tmp_path / "hf", dst_format="hf", dst_tp=1, true_vocab_size=1000)
    expected, actual = load_hf_tensors(hf_sources["llama"]), load_hf_tensors(tmp_path / "hf")
    assert actual["model.embed_tokens.weight"].shape == (1000, 64)
    assert all(torch.equal(actual[k], v) for k, v in expected.items())


def test_true_vocab_size_that_disagrees_with_config_json_is_refused(hf_sources: dict[str, Path],
                                                                   tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--true-vocab-size 1024: .*config.json says vocab_size=1000"):
        pgconvert.convert(hf_sources["llama"], tmp_path / "m", dst_format="megatron", true_vocab_size=1024)


def test_streamed_safetensors_file_reads_back_with_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from pgconvert.savers.hf import _SafetensorsWriter

    tensors = {
        "b.weight": torch.arange(12, dtype=torch.float32).view(3, 4),
        "a.bf16": torch.randn(5, 3, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).t(),
        "c.ids": torch.arange(7, dtype=torch.int64),
        "d.scalar": torch.tensor(2.5, dtype=torch.float16),
        "e.empty": torch.zeros(0, 4),
        "f.mask": torch.tensor([True, False, True]),
    }
    path = tmp_path / "x.safetensors"

    with _SafetensorsWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)

    loaded = load_file(str(path))
    assert sorted(loaded) == sorted(tensors)
    assert all(loaded[n].dtype == t.dtype and torch.equal(loaded[n], t) for n, t in tensors.items())
    assert int.from_bytes(path.read_bytes()[:8], "little") % 8 == 0
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}


def test_mixture_of_experts_model_is_written_as_mixtral_or_qwen3_moe() -> None:
    assert infer_family(_config(num_experts=4)).architecture == "MixtralForCausalLM"
    assert infer_family(_config(num_experts=4, qk_layernorm=True)).architecture == "Qwen3MoeForCausalLM"
