"""Megatron-FSDP checkpoints (``--ckpt-format fsdp_dtensor``) as a source: the golden is Megatron-LM's own
``save_checkpoint`` of a TP2 DP2 Megatron-FSDP run (tests/data/megatron_lm/train_tp2dp2_fsdp_dtensor, see the
README there). Its tensors are read here with torch.distributed.checkpoint's own reader (the reference), and
every output pgconvert writes from it is read back by the real client: megatron-core's GPTModel
(``load_state_dict(strict=True)``), torch's DCP reader, transformers' ``from_pretrained``."""

from __future__ import annotations

import dataclasses
import shutil
import warnings
from pathlib import Path
from typing import Callable

import pytest
import torch
from support.checkpoint_compare import read_dcp, rewrite_dcp_metadata

import pgconvert
from pgconvert.errors import CheckpointError, PluginError
from pgconvert.formats import LoadOptions
from pgconvert.formats.registry import detect_format, get_loader

GOLDEN = Path(__file__).parent / "data" / "megatron_lm" / "train_tp2dp2_fsdp_dtensor"
ITERATION = GOLDEN / "iter_0000002"
PREFIX = "model.module."
LAYERS = 2
TRUE_VOCAB = 63
# the golden's model (scripts/make_megatron_lm_goldens.py SMALL_MODEL_FLAGS): 4 heads of 4, 2 query groups
HEADS, GROUPS, HEAD_DIM = 4, 2, 4


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """The golden's model tensors as torch's own DCP reader reads them, under their stored names."""
    _, tensors = read_dcp(ITERATION)
    return {key[len(PREFIX):]: value for key, value in tensors.items() if key.startswith(PREFIX)}


def _fc1(reference: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
    """The canonical [gate; up] of a SwiGLU fc1, from Megatron-FSDP's two halves."""
    stem = f"decoder.layers.{layer}.mlp.linear_fc1.weight"
    return torch.cat([reference[stem + "_w"], reference[stem + "_v"]])


def _canonical(reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The golden's tensors under Megatron's one-key names (fc1's halves joined)."""
    tensors = {key: value for key, value in reference.items() if not key.endswith(("_w", "_v"))}
    tensors.update({f"decoder.layers.{layer}.mlp.linear_fc1.weight": _fc1(reference, layer) for layer in range(LAYERS)})
    return tensors


def test_golden_is_megatron_fsdp_layout(reference: dict[str, torch.Tensor]) -> None:
    metadata, _ = read_dcp(ITERATION)
    entries = metadata.state_dict_metadata
    assert not (ITERATION / "metadata.json").exists() and not (ITERATION / "common.pt").exists()
    assert {"args", "iteration", "checkpoint_version"} <= set(entries)
    assert {"decoder.layers.0.mlp.linear_fc1.weight_w", "decoder.layers.0.mlp.linear_fc1.weight_v"} <= set(reference)
    # the data-parallel cut is uneven and not aligned to the TP pieces: more chunks than ranks of one dimension
    assert len(entries[PREFIX + "output_layer.weight"].chunks) == 4
    assert detect_format(GOLDEN) == "fsdp_dtensor"
    info = pgconvert.inspect(GOLDEN)
    assert info.format == "fsdp_dtensor" and info.iteration == 2
    assert info.layout is not None and info.layout["tp"] == 2


def test_every_tensor_reads_bit_exact(reference: dict[str, torch.Tensor]) -> None:
    expected = _canonical(reference)
    with get_loader("fsdp_dtensor").open(GOLDEN, LoadOptions()) as source:
        stored = sorted(key for name in source.names() for key in source.stored_names(name))
        assert stored == sorted(PREFIX + key for key in reference)
        assert source.config.vocab_size == TRUE_VOCAB and source.vocab_rows == 64
        for name in source.names():
            tensor = source.load(name)
            assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name
        # a TP2 piece of fc1 is the rank's gate rows over its up rows, read from both keys
        fc1 = "decoder.layers.1.mlp.linear_fc1.weight"
        for rank in range(2):
            piece = source.load_shard(fc1, _rule(source, fc1), 2, rank)
            gate, up = reference[fc1 + "_w"].chunk(2)[rank], reference[fc1 + "_v"].chunk(2)[rank]
            assert torch.equal(piece, torch.cat([gate, up])), rank


def _rule(source: object, name: str) -> object:
    from pgconvert.model.grid import build_converter_process_groups
    from pgconvert.model.layout import ParallelLayout
    from pgconvert.model.provider import provide

    shard = provide(source.config, build_converter_process_groups(ParallelLayout()), padded_vocab_size=64)
    return next(spec.rule for spec in shard.specs if spec.canonical == name)


def _tp_slice(reference: dict[str, torch.Tensor], name: str, tp: int, rank: int) -> torch.Tensor:
    """Megatron's rank piece of a golden tensor: columns of the row-parallel linears, rows of the others,
    per rank [gate_r; up_r] of fc1, norms whole."""
    canonical = _canonical(reference)[name]
    if name.endswith("linear_fc1.weight"):
        layer = name.split(".")[2]
        stem = f"decoder.layers.{layer}.mlp.linear_fc1.weight"
        return torch.cat([reference[stem + "_w"].chunk(tp)[rank], reference[stem + "_v"].chunk(tp)[rank]])
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return canonical.chunk(tp, dim=1)[rank]
    if canonical.dim() == 1:
        return canonical
    return canonical.chunk(tp)[rank]


@pytest.mark.parametrize("tp", [1, 2])
def test_per_rank_output_loads_strictly_into_megatron_core(tmp_path: Path, reference: dict[str, torch.Tensor],
                                                           tp: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from support.mcore_helpers import load_rank_into_gpt_model, rank_files

    report = pgconvert.convert(GOLDEN, tmp_path / "out", dst_format="megatron", dst_tp=tp)
    assert any("fp32 main weights" in notice for notice in report.notices), report.notices
    assert pgconvert.verify(GOLDEN, tmp_path / "out").equal
    ranks = rank_files(tmp_path / "out")
    assert len(ranks) == tp
    for rank in ranks:
        model = load_rank_into_gpt_model(rank)  # strict=True
        state = {key: value for key, value in model.state_dict().items() if not key.endswith("_extra_state")}
        assert sorted(state) == sorted(_canonical(reference)), rank.path
        for key, value in state.items():
            assert torch.equal(value, _tp_slice(reference, key, tp, rank.layout.tp_rank)), (rank.path, key)


def test_torch_dist_output_holds_the_golden_tensors(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    pgconvert.convert(GOLDEN, tmp_path / "dist", dst_format="torch_dist", dst_tp=1)
    iteration = next(p.parent for p in (tmp_path / "dist").rglob("metadata.json"))
    _, tensors = read_dcp(iteration)  # torch's own reader
    stacked = {  # megatron-core's torch_dist keys (local spec: the norms under their fused names)
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "decoder.layers.self_attention.linear_qkv.weight": "self_attention.linear_qkv.weight",
        "decoder.layers.self_attention.linear_proj.weight": "self_attention.linear_proj.weight",
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
        "decoder.layers.mlp.linear_fc1.weight": "mlp.linear_fc1.weight",
        "decoder.layers.mlp.linear_fc2.weight": "mlp.linear_fc2.weight",
    }
    whole = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    assert sorted(tensors) == sorted([*stacked, *whole])
    canonical = _canonical(reference)
    for key in whole:
        assert torch.equal(tensors[key], canonical[key]), key
    for key, name in stacked.items():
        for layer in range(LAYERS):
            assert torch.equal(tensors[key][layer], canonical[f"decoder.layers.{layer}.{name}"]), (key, layer)


def test_hf_output_loads_in_transformers_with_the_golden_weights(tmp_path: Path,
                                                                  reference: dict[str, torch.Tensor]) -> None:
    from transformers import AutoModelForCausalLM

    pgconvert.convert(GOLDEN, tmp_path / "hf", dst_format="hf")
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    hf = model.state_dict()
    assert torch.equal(hf["model.embed_tokens.weight"], reference["embedding.word_embeddings.weight"][:TRUE_VOCAB])
    assert torch.equal(hf["lm_head.weight"], reference["output_layer.weight"][:TRUE_VOCAB])
    assert torch.equal(hf["model.norm.weight"], reference["decoder.final_layernorm.weight"])
    per_group = HEADS // GROUPS
    for layer in range(LAYERS):
        megatron, ours = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        assert torch.equal(hf[ours + "mlp.gate_proj.weight"], reference[megatron + "mlp.linear_fc1.weight_w"])
        assert torch.equal(hf[ours + "mlp.up_proj.weight"], reference[megatron + "mlp.linear_fc1.weight_v"])
        assert torch.equal(hf[ours + "mlp.down_proj.weight"], reference[megatron + "mlp.linear_fc2.weight"])
        assert torch.equal(hf[ours + "self_attn.o_proj.weight"], reference[megatron + "self_attention.linear_proj.weight"])
        assert torch.equal(hf[ours + "input_layernorm.weight"], reference[megatron + "input_layernorm.weight"])
        assert torch.equal(hf[ours + "post_attention_layernorm.weight"], reference[megatron + "pre_mlp_layernorm.weight"])
        qkv = reference[megatron + "self_attention.linear_qkv.weight"].view(GROUPS, per_group + 2, HEAD_DIM, -1)
        q, k, v = qkv[:, :per_group], qkv[:, per_group], qkv[:, per_group + 1]
        assert torch.equal(hf[ours + "self_attn.q_proj.weight"], q.reshape(HEADS * HEAD_DIM, -1))
        assert torch.equal(hf[ours + "self_attn.k_proj.weight"], k.reshape(GROUPS * HEAD_DIM, -1))
        assert torch.equal(hf[ours + "self_attn.v_proj.weight"], v.reshape(GROUPS * HEAD_DIM, -1))


# ------------------------------------------------------------------ bad input


@pytest.fixture()
def copy(tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(GOLDEN, target)
    return target


def _rewrite_metadata(root: Path, change: Callable[[object], None]) -> None:
    rewrite_dcp_metadata(root / "iter_0000002", change)


def _open(root: Path) -> None:
    get_loader("fsdp_dtensor").open(root, LoadOptions())


def test_truncated_data_file_is_named(copy: Path) -> None:
    data = copy / "iter_0000002" / "__2_0.distcp"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"__2_0\.distcp: truncated"):
        _open(copy)


def test_missing_key_is_named(copy: Path) -> None:
    key = PREFIX + "decoder.layers.1.mlp.linear_fc1.weight_v"

    def drop(metadata: object) -> None:
        del metadata.state_dict_metadata[key]
        metadata.storage_data = {index: info for index, info in metadata.storage_data.items() if index.fqn != key}

    _rewrite_metadata(copy, drop)
    with pytest.raises(CheckpointError, match=r"missing: \['model\.module\.decoder\.layers\.1\.mlp\.linear_fc1\.weight_v'\]"):
        _open(copy)


def test_inconsistent_shape_is_named(copy: Path) -> None:
    key = PREFIX + "decoder.layers.0.self_attention.linear_proj.weight"

    def widen(metadata: object) -> None:
        metadata.state_dict_metadata[key].size = torch.Size([16, 24])

    _rewrite_metadata(copy, widen)
    with pytest.raises(CheckpointError, match=r"linear_proj\.weight has global shape \[16, 24\], expected \[16, 16\]"):
        _open(copy)


def test_store_without_megatron_fsdp_keys_is_named(copy: Path) -> None:
    def rename(metadata: object) -> None:
        entries = metadata.state_dict_metadata
        metadata.state_dict_metadata = {key.replace(PREFIX, "model.", 1): value for key, value in entries.items()}
        metadata.storage_data = {dataclasses.replace(index, fqn=index.fqn.replace(PREFIX, "model.", 1)): info
                                 for index, info in metadata.storage_data.items()}

    _rewrite_metadata(copy, rename)
    with pytest.raises(CheckpointError, match="not one of Megatron-FSDP"):
        _open(copy)


def test_partial_optimizer_state_is_refused_by_name(copy: Path, tmp_path: Path) -> None:
    """The golden holds no optimizer state (see the README); one ``exp_avg`` entry named as Megatron-LM names it,
    stored in a model entry's chunks, is optimizer state pgconvert cannot carry: a named error, nothing written;
    with --skip-optimizer the model is converted and the entry named in a notice
    (tests/test_fsdp_dtensor_optimizer.py carries a whole one)."""
    weight = PREFIX + "decoder.final_layernorm.weight"
    moment = "optimizer.state.module.module.module.decoder.final_layernorm.weight.exp_avg"

    def add_moment(metadata: object) -> None:
        metadata.state_dict_metadata[moment] = metadata.state_dict_metadata[weight]
        metadata.storage_data.update({dataclasses.replace(index, fqn=moment): info
                                      for index, info in metadata.storage_data.items() if index.fqn == weight})

    _rewrite_metadata(copy, add_moment)
    with pytest.raises(CheckpointError, match=r"no single optimizer record .*embedding\.word_embeddings\.weight"):
        pgconvert.convert(copy, tmp_path / "out", dst_format="megatron", dst_tp=1)
    assert not (tmp_path / "out").exists()
    report = pgconvert.convert(copy, tmp_path / "skipped", dst_format="megatron", dst_tp=1, skip_optimizer=True)
    assert any("1 optimizer/scheduler/RNG entries" in notice for notice in report.notices), report.notices
