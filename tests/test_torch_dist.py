"""The torch_dist format: Megatron distributed checkpoints, read and written without a process group.

Round trips go megatron → torch_dist → megatron and are compared, rank file by rank file, with the
fixtures' independent writer; the files themselves are read back with torch.distributed.checkpoint's
own reader (not pgconvert's) where a test looks at keys, shapes and values.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import warnings
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import xxhash
import torch
import torch.distributed
import torch.distributed.checkpoint as dcp
from support.checkpoint_compare import assert_same_ranks, read_common, read_dcp
from click.testing import CliRunner
from support.tiny_models import GQA_SWIGLU, MHA_GELU_TIED, MOE, MOE_GROUPED_TE, QK_NORM_TE
from support.megatron_fixtures import load_for_test, make_full_model, merge_megatron_checkpoint, write_megatron_checkpoint
from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

import pgconvert
from pgconvert.formats.dcp_store import SafeReader
from pgconvert.loaders.torch_dist import TorchDistLoader
from pgconvert.cli import main
from pgconvert.errors import CheckpointError, LayoutError, PgconvertError, StrictModeError, UnsafePickleError
from pgconvert.formats import LoadOptions, SaveOptions
from pgconvert.model.config import ModelConfig
from pgconvert.model.layout import ParallelLayout
from pgconvert.formats.names import loader_names, saver_names
from pgconvert.formats.registry import detect_format, get_loader
from pgconvert.model.rules import COLUMN
from pgconvert.formats.stream import CanonicalSource, TensorMeta
import pgconvert.savers.torch_dist as torch_dist_saver
from pgconvert.io.dcp_writer import StreamingWriter
from pgconvert.savers.torch_dist import TorchDistSaver
from pgconvert.formats.torch_dist import COMMON_STATE_KEY
from support.torch_dist_forms import FOR_MCORE_016
from support.torch_dcp_save import save_with_torch

ITERATION_DIR = "iter_0000100"
DENSE_MODELS = {"gqa_swiglu_untied": GQA_SWIGLU, "mha_gelu_tied": MHA_GELU_TIED, "qknorm_te_bf16": QK_NORM_TE}
# Every layer MoE: megatron-core stacks layers (and experts) along leading axes.
MOE_STACKED = replace(MOE, moe_layer_freq=1)
MOE_MODELS = {"moe_list_freq_local": MOE, "moe_every_layer_stacked": MOE_STACKED, "moe_grouped_te_tied": MOE_GROUPED_TE}


def to_torch_dist(src: Path, dst: Path, src_format: str | None = None, **layout: object) -> pgconvert.Report:
    """torch_dist in the form megatron-core 0.16.1 reads (``common.pt``, no manifest) unless the caller names one."""
    options = {**FOR_MCORE_016, **layout}
    return pgconvert.convert(src, dst, src_format=src_format, dst_format="torch_dist", **options)


def from_torch_dist(src: Path, dst: Path, dst_format: str = "megatron", **layout: object) -> pgconvert.Report:
    return pgconvert.convert(src, dst, src_format="torch_dist", dst_format=dst_format, **layout)


def tensor_shapes(metadata: torch.distributed.checkpoint.Metadata) -> dict[str, tuple[int, ...]]:
    return {key: tuple(md.size) for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def byte_keys(metadata: torch.distributed.checkpoint.Metadata) -> list[str]:
    return sorted(key for key, md in metadata.state_dict_metadata.items() if not isinstance(md, TensorStorageMetadata))


@pytest.fixture(autouse=True)
def _leaves_torch_distributed_alone():
    yield
    assert torch.distributed.is_initialized() is False


# --------------------------------------------------------------------------- registry and files


def test_format_is_registered_for_reading_and_writing() -> None:
    assert "torch_dist" in loader_names() and "torch_dist" in saver_names()


def test_loader_recognises_distributed_checkpoints_only(tmp_path: Path) -> None:
    full = make_full_model(GQA_SWIGLU)
    megatron = write_megatron_checkpoint(tmp_path / "megatron", GQA_SWIGLU, full, 2, 1)
    to_torch_dist(megatron, tmp_path / "dist")
    loader = get_loader("torch_dist")

    assert loader.detect(tmp_path / "dist") and loader.detect(tmp_path / "dist" / ITERATION_DIR)
    assert not loader.detect(megatron) and not loader.detect(megatron / ITERATION_DIR)
    assert detect_format(megatron) == "megatron"


def test_auto_detection_tells_torch_dist_from_megatron(tmp_path: Path) -> None:
    to_torch_dist(write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 1, 1),
                  tmp_path / "dist")

    assert detect_format(tmp_path / "dist") == "torch_dist"


def test_cli_converts_megatron_to_torch_dist_and_back(tmp_path: Path) -> None:
    model = GQA_SWIGLU
    full = make_full_model(model)
    src = write_megatron_checkpoint(tmp_path / "src", model, full, 2, 1)
    runner = CliRunner()

    to_dist = runner.invoke(main, ["--quiet", "--dst-format", "torch_dist", "--dst-tp", "1", str(src), str(tmp_path / "dist")])
    back = runner.invoke(main, ["--quiet", "--src-format", "torch_dist", "--dst-format", "megatron", "--dst-tp", "4",
                                str(tmp_path / "dist"), str(tmp_path / "back")])

    assert to_dist.exit_code == 0, to_dist.output
    assert back.exit_code == 0, back.output
    assert_same_ranks(tmp_path / "back", write_megatron_checkpoint(tmp_path / "expected", model, full, 4, 1))


# Per --dst-torch-dist-common: the files, megatron-core's CheckpointingConfig as that version's save_config writes
# it (dist_checkpointing/core.py), and the file the common state is read from. No integrity.json: as Megatron-LM
# writes without --verify-integrity (test_torch_dist_common_state.py writes it on request).
COMMON_PLACES = {
    "store": ([".metadata", "__0_0.distcp", "__0_1.distcp", "metadata.json"],
              {"sharded_backend": "torch_dist", "sharded_backend_version": 1}, "the common_state entry"),
    "legacy": ([".metadata", "__0_0.distcp", "common.pt", "metadata.json"],
               {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                "common_backend": "torch", "common_backend_version": 1}, "common.pt"),
}


@pytest.mark.parametrize("common_place", sorted(COMMON_PLACES))
def test_files_are_megatron_cores_and_args_record_the_target_layout(tmp_path: Path, common_place: str) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1, iteration=1234)

    report = to_torch_dist(src, tmp_path / "dist", dst_tp=4, dst_pp=2, dst_torch_dist_common=common_place)

    files, checkpoint_config, place = COMMON_PLACES[common_place]
    iteration_dir = tmp_path / "dist" / "iter_0001234"
    assert (tmp_path / "dist" / "latest_checkpointed_iteration.txt").read_text() == "1234"
    assert sorted(p.name for p in iteration_dir.iterdir()) == files
    assert json.loads((iteration_dir / "metadata.json").read_text()) == checkpoint_config
    common = read_common(iteration_dir)
    assert sorted(common) == ["args", "checkpoint_version", "content_metadata", "iteration"]
    assert (common["checkpoint_version"], common["iteration"]) == (3.0, 1234)
    assert common["content_metadata"] == {"distrib_optim_sharding_type": "dp_reshardable",
                                          "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    args = common["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (4, 2)
    assert args.ckpt_format == "torch_dist"
    # The files are global whatever the recorded layout: vocab padded for tp=4 (1024 rows).
    assert args.padded_vocab_size == 1024
    metadata, _ = read_dcp(iteration_dir)
    assert tensor_shapes(metadata)["embedding.word_embeddings.weight"] == (1024, 64)
    assert report.dst_layout == "tp=4,pp=2"
    assert any(f"tp=4,pp=2 recorded in {place}'s args" in notice for notice in report.notices)


# --------------------------------------------------------------------------- key contract


def test_contract_dense_layers_are_stacked_under_megatron_cores_keys(tmp_path: Path) -> None:
    full = make_full_model(GQA_SWIGLU)
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, full, 2, 2)

    to_torch_dist(src, tmp_path / "dist", dst_tp=1, dst_pp=1)

    metadata, tensors = read_dcp(tmp_path / "dist" / ITERATION_DIR)
    assert tensor_shapes(metadata) == {
        "embedding.word_embeddings.weight": (1024, 64),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (4, 64),
        "decoder.layers.self_attention.linear_qkv.weight": (4, 128, 64),
        "decoder.layers.self_attention.linear_proj.weight": (4, 64, 64),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (4, 64),
        "decoder.layers.mlp.linear_fc1.weight": (4, 256, 64),
        "decoder.layers.mlp.linear_fc2.weight": (4, 64, 128),
        "decoder.final_layernorm.weight": (64,),
        "output_layer.weight": (1024, 64),
    }
    assert byte_keys(metadata) == sorted(
        f"decoder.layers.{module}._extra_state/shard_{layer}_4"
        for module in ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
        for layer in range(4))
    # One chunk per layer; SwiGLU fc1 as megatron-core's factory saves it, gate and up apart.
    fc1 = metadata.state_dict_metadata["decoder.layers.mlp.linear_fc1.weight"]
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in fc1.chunks) == [
        ((layer, row, 0), (1, 128, 64)) for layer in range(4) for row in (0, 128)]
    for layer in range(4):
        prefix = f"decoder.layers.{layer}."
        assert torch.equal(tensors["decoder.layers.mlp.linear_fc1.weight"][layer], full[prefix + "mlp.linear_fc1.weight"])
        assert torch.equal(tensors["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][layer],
                           full[prefix + "input_layernorm.weight"])
    assert torch.equal(tensors["embedding.word_embeddings.weight"][:1000], full["embedding.word_embeddings.weight"])
    assert not tensors["embedding.word_embeddings.weight"][1000:].any()


def test_contract_tied_model_has_no_output_layer_and_keeps_layernorm_biases(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", MHA_GELU_TIED, make_full_model(MHA_GELU_TIED), 2, 2)

    to_torch_dist(src, tmp_path / "dist")

    shapes = tensor_shapes(read_dcp(tmp_path / "dist" / ITERATION_DIR)[0])
    assert "output_layer.weight" not in shapes
    assert shapes["embedding.position_embeddings.weight"] == (32, 64)
    assert shapes["decoder.layers.self_attention.linear_qkv.layer_norm_bias"] == (4, 64)
    assert shapes["decoder.layers.mlp.linear_fc1.bias"] == (4, 128)
    assert shapes["decoder.final_layernorm.bias"] == (64,)


def test_contract_moe_layers_that_differ_get_a_key_each_and_experts_an_expert_axis(tmp_path: Path) -> None:
    full = make_full_model(MOE)
    src = write_megatron_checkpoint(tmp_path / "src", MOE, full, 1, 1, ep=2)

    to_torch_dist(src, tmp_path / "dist", dst_ep=1)

    metadata, tensors = read_dcp(tmp_path / "dist" / ITERATION_DIR)
    shapes = tensor_shapes(metadata)
    assert not any(key.startswith("decoder.layers.self_attention") for key in shapes)
    assert shapes["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"] == (8, 128, 64)
    assert shapes["decoder.layers.0.mlp.experts.experts.linear_fc2.weight"] == (8, 64, 64)
    assert shapes["decoder.layers.0.mlp.router.weight"] == (8, 64)
    assert shapes["decoder.layers.0.mlp.router.expert_bias"] == (8,)
    assert shapes["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"] == (192, 64)
    assert shapes["decoder.layers.0.mlp.shared_experts.gate_weight"] == (1, 64)
    # The local spec's keys map renames an MoE layer's separate pre-MLP norm as if it were fused.
    assert shapes["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"] == (64,)
    assert shapes["decoder.layers.1.mlp.linear_fc1.weight"] == (256, 64)
    assert metadata.state_dict_metadata["decoder.layers.0.mlp.router.weight"].properties.dtype == torch.float32
    assert "decoder.layers.2.mlp.experts.experts.linear_fc2._extra_state/shard_5_8" in byte_keys(metadata)
    assert "decoder.layers.1.mlp.linear_fc1._extra_state/shard_0_1" in byte_keys(metadata)
    assert torch.equal(tensors["decoder.layers.2.mlp.experts.experts.linear_fc1.weight"][5],
                       full["decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight"])


def test_contract_moe_every_layer_stacks_layers_then_experts(tmp_path: Path) -> None:
    full = make_full_model(MOE_STACKED)
    src = write_megatron_checkpoint(tmp_path / "src", MOE_STACKED, full, 2, 1, ep=2)

    to_torch_dist(src, tmp_path / "dist")

    metadata, tensors = read_dcp(tmp_path / "dist" / ITERATION_DIR)
    shapes = tensor_shapes(metadata)
    assert shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (4, 8, 128, 64)
    assert shapes["decoder.layers.mlp.router.weight"] == (4, 8, 64)
    assert "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_3.7_4.8" in byte_keys(metadata)
    assert torch.equal(tensors["decoder.layers.mlp.experts.experts.linear_fc2.weight"][3, 7],
                       full["decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight"])


def test_contract_te_spec_moe_layer_keeps_its_own_pre_mlp_norm_name(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", MOE_GROUPED_TE, make_full_model(MOE_GROUPED_TE), 1, 1, ep=2)

    to_torch_dist(src, tmp_path / "dist")

    shapes = tensor_shapes(read_dcp(tmp_path / "dist" / ITERATION_DIR)[0])
    # Layers 0 and 2 MoE (moe_layer_freq=2, so one key per layer), 1 and 3 dense.
    assert shapes["decoder.layers.0.pre_mlp_layernorm.weight"] == (64,)
    assert shapes["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"] == (64,)
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" not in shapes
    # Grouped-GEMM experts save under SequentialMLP's naming.
    assert shapes["decoder.layers.2.mlp.experts.experts.linear_fc1.weight"] == (8, 128, 64)


# --------------------------------------------------------------------------- round trips


# (format, tp, pp): every megatron hop is compared with the fixture at that layout.
DENSE_HOPS = [("torch_dist", 1, 1), ("megatron", 1, 1), ("torch_dist", 4, 1), ("megatron", 2, 2)]


@pytest.mark.parametrize("model_name", sorted(DENSE_MODELS))
def test_dense_round_trip_through_torch_dist_is_bit_exact(tmp_path: Path, model_name: str) -> None:
    model = DENSE_MODELS[model_name]
    full = make_full_model(model, seed=1)
    current = src = write_megatron_checkpoint(tmp_path / "src", model, full, 2, 2)
    current_format = "megatron"

    for index, (fmt, tp, pp) in enumerate(DENSE_HOPS):
        out = tmp_path / f"hop{index}"
        pgconvert.convert(current, out, src_format=current_format, dst_format=fmt, dst_tp=tp, dst_pp=pp)
        if fmt == "megatron":
            assert_same_ranks(out, write_megatron_checkpoint(tmp_path / f"expected{index}", model, full, tp, pp))
        current, current_format = out, fmt

    assert_same_ranks(current, src)
    merged = merge_megatron_checkpoint(current, model)
    assert all(torch.equal(merged[name], full[name]) for name in full)


# (tp, pp, ep) of the torch_dist hop's recorded layout, then of the megatron target.
MOE_HOPS = [((1, 1, 1), (1, 1, 4)), ((2, 1, 2), (2, 1, 2))]


@pytest.mark.parametrize("model_name", sorted(MOE_MODELS))
def test_moe_round_trip_through_torch_dist_is_bit_exact(tmp_path: Path, model_name: str) -> None:
    model = MOE_MODELS[model_name]
    full = make_full_model(model, seed=3)
    current = src = write_megatron_checkpoint(tmp_path / "src", model, full, 2, 1, ep=2)

    for index, ((dtp, dpp, dep), (tp, pp, ep)) in enumerate(MOE_HOPS):
        dist = tmp_path / f"dist{index}"
        to_torch_dist(current, dist, dst_tp=dtp, dst_pp=dpp, dst_ep=dep)
        current = tmp_path / f"megatron{index}"
        from_torch_dist(dist, current, dst_tp=tp, dst_pp=pp, dst_ep=ep)
        assert_same_ranks(current, write_megatron_checkpoint(tmp_path / f"expected{index}", model, full, tp, pp, ep=ep))

    assert_same_ranks(current, src)


def test_virtual_pipeline_source_and_target_round_trip(tmp_path: Path) -> None:
    model = replace(GQA_SWIGLU, num_layers=8)
    full = make_full_model(model)
    src = write_megatron_checkpoint(tmp_path / "src", model, full, 2, 2, vpp=2)

    to_torch_dist(src, tmp_path / "dist")
    from_torch_dist(tmp_path / "dist", tmp_path / "pp4", dst_tp=1, dst_pp=4)
    from_torch_dist(tmp_path / "dist", tmp_path / "back")

    args = read_common(tmp_path / "dist" / ITERATION_DIR)["args"]
    assert args.virtual_pipeline_model_parallel_size == 2
    assert_same_ranks(tmp_path / "pp4", write_megatron_checkpoint(tmp_path / "expected", model, full, 1, 4))
    assert_same_ranks(tmp_path / "back", src)


def test_release_checkpoint_stays_release_and_iteration_option_picks_one(tmp_path: Path) -> None:
    old, new = make_full_model(GQA_SWIGLU, seed=1), make_full_model(GQA_SWIGLU, seed=2)
    release = write_megatron_checkpoint(tmp_path / "release", GQA_SWIGLU, old, 2, 1, release=True)
    to_torch_dist(release, tmp_path / "dist_release")
    for iteration, full in ((10, old), (20, new)):
        src = write_megatron_checkpoint(tmp_path / f"src{iteration}", GQA_SWIGLU, full, 2, 1, iteration=iteration)
        to_torch_dist(src, tmp_path / f"dist{iteration}")
    both = tmp_path / "both"
    both.mkdir()
    for iteration in (10, 20):
        shutil.move(tmp_path / f"dist{iteration}" / f"iter_{iteration:07d}", both)

    from_torch_dist(tmp_path / "dist_release", tmp_path / "back_release")
    from_torch_dist(both, tmp_path / "back10", iteration=10)

    assert (tmp_path / "dist_release" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert (tmp_path / "dist_release" / "release" / "metadata.json").is_file()
    assert_same_ranks(tmp_path / "back_release", release)
    assert_same_ranks(tmp_path / "back10", tmp_path / "src10")
    with pytest.raises(CheckpointError, match="several iterations \\(10, 20\\); choose one with --iteration"):
        from_torch_dist(both, tmp_path / "ambiguous")


def test_torch_dist_to_torch_dist_keeps_tensors_and_rerecords_the_layout(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", MOE, make_full_model(MOE), 2, 1, ep=2)
    to_torch_dist(src, tmp_path / "a")

    report = pgconvert.convert(tmp_path / "a", tmp_path / "b", src_format="torch_dist", dst_tp=1, dst_ep=4)

    assert report.dst_format == "torch_dist"
    metadata_a, tensors_a = read_dcp(tmp_path / "a" / ITERATION_DIR)
    metadata_b, tensors_b = read_dcp(tmp_path / "b" / ITERATION_DIR)
    assert tensor_shapes(metadata_a) == tensor_shapes(metadata_b)
    # A common.pt source, the default destination form: the common state moves into the store.
    assert byte_keys(metadata_b) == sorted([*byte_keys(metadata_a), COMMON_STATE_KEY])
    assert not (tmp_path / "b" / ITERATION_DIR / "common.pt").exists()
    assert all(torch.equal(tensors_a[key], tensors_b[key]) for key in tensors_a)
    args = read_common(tmp_path / "b" / ITERATION_DIR)["args"]
    assert (args.tensor_model_parallel_size, args.expert_model_parallel_size) == (1, 4)


def test_expert_tp_that_the_per_rank_format_refuses_is_recorded(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", MOE, make_full_model(MOE), 2, 1, ep=2)

    to_torch_dist(src, tmp_path / "dist", dst_expert_tp=1)

    args = read_common(tmp_path / "dist" / ITERATION_DIR)["args"]
    assert (args.tensor_model_parallel_size, args.expert_tensor_parallel_size) == (2, 1)
    source = TorchDistLoader().open(tmp_path / "dist", LoadOptions())
    assert source.layout.expert_tp == 1


@pytest.mark.skipif("hf" not in saver_names(), reason="the hf format is not available")
@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "mixtral"])
def test_hf_to_torch_dist_and_back_is_bit_exact(tmp_path: Path, family: str) -> None:
    from support.hf_helpers import build_hf_model, load_hf_tensors, save_hf_model

    src = save_hf_model(build_hf_model(family, seed=2), tmp_path / "hf")

    pgconvert.convert(src, tmp_path / "dist", dst_format="torch_dist", dst_tp=2)
    from_torch_dist(tmp_path / "dist", tmp_path / "back", dst_format="hf", dst_tp=1)
    from_torch_dist(tmp_path / "dist", tmp_path / "megatron", dst_format="megatron")
    pgconvert.convert(tmp_path / "megatron", tmp_path / "back2", dst_format="hf", dst_tp=1)

    expected = load_hf_tensors(src)
    for out in (tmp_path / "back", tmp_path / "back2"):
        actual = load_hf_tensors(out)
        assert sorted(actual) == sorted(expected)
        assert all(actual[name].dtype == t.dtype and torch.equal(actual[name], t) for name, t in expected.items())


def test_dtype_option_casts_weights_and_router_but_keeps_expert_bias(tmp_path: Path) -> None:
    """megatron-core holds the router's weight in the run's dtype, its expert bias (a buffer) in float32."""
    full = make_full_model(MOE)
    src = write_megatron_checkpoint(tmp_path / "src", MOE, full, 1, 1, ep=2)

    to_torch_dist(src, tmp_path / "dist", dtype="fp16")

    metadata, tensors = read_dcp(tmp_path / "dist" / ITERATION_DIR)
    dtypes = {key: md.properties.dtype for key, md in metadata.state_dict_metadata.items()
              if isinstance(md, TensorStorageMetadata)}
    assert dtypes["decoder.layers.0.mlp.router.weight"] == torch.float16
    assert dtypes["decoder.layers.0.mlp.router.expert_bias"] == torch.float32
    assert dtypes["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"] == torch.float16
    assert torch.equal(tensors["decoder.layers.3.mlp.router.weight"],
                       full["decoder.layers.3.mlp.router.weight"].to(torch.float16))
    assert torch.equal(tensors["decoder.layers.3.mlp.router.expert_bias"],
                       full["decoder.layers.3.mlp.router.expert_bias"])
    args = read_common(tmp_path / "dist" / ITERATION_DIR)["args"]
    assert args.params_dtype == torch.float16 and args.fp16


# --------------------------------------------------------------------------- memory


class _CountingSource(CanonicalSource):
    """Delegates to a source; records how many tensors it handed out still hold their memory at each load.

    Each tensor handed out lives in a numpy buffer of its own, so a weak reference to the buffer
    dies only when the last view of the tensor's memory does (a view a writer keeps counts).
    """

    def __init__(self, inner: CanonicalSource) -> None:
        super().__init__(inner.config, inner.vocab_rows, inner.iteration, inner.release)
        self.megatron_args = inner.megatron_args
        self.inner = inner
        self.alive: list[weakref.ref[object]] = []
        self.most_alive = 0
        self.loads = 0

    def _hand_out(self, tensor: torch.Tensor) -> torch.Tensor:
        self.most_alive = max(self.most_alive, sum(ref() is not None for ref in self.alive))
        self.loads += 1
        buffer = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().copy()
        self.alive.append(weakref.ref(buffer))
        return torch.from_numpy(buffer).view(tensor.dtype).reshape(tensor.shape)

    def names(self) -> list[str]:
        return self.inner.names()

    def meta(self, name: str) -> TensorMeta:
        return self.inner.meta(name)

    def _load(self, name: str) -> torch.Tensor:
        return self._hand_out(self.inner.load(name))

    def _load_shard(self, name, rule, size, rank, rows):  # type: ignore[no-untyped-def]
        return self._hand_out(self.inner.load_shard(name, rule, size, rank, rows))


def test_saver_holds_one_canonical_tensor_at_a_time(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", MOE, make_full_model(MOE), 2, 1, ep=2)
    source = _CountingSource(get_loader("megatron").open(src, LoadOptions()))

    TorchDistSaver().save(source, tmp_path / "out", SaveOptions(layout=ParallelLayout()), lambda nbytes: None)

    assert source.loads == len(source.names())
    # Each tensor's memory is gone before the next is loaded: torch's own writer loop kept one
    # tensor per key until the file was closed.
    assert source.most_alive == 0


@pytest.mark.parametrize("model", [GQA_SWIGLU, QK_NORM_TE, MOE_STACKED], ids=["swiglu", "te_extra_state", "moe_stacked"])
def test_store_is_the_one_torchs_own_save_writes(tmp_path: Path, model: object,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The data file and ``.metadata`` byte for byte as torch's ``dcp.save`` writes them from the same plan, though
    pgconvert's writer imports no torch.distributed.checkpoint (``dcp_plan`` pickles its own types under torch's
    names)."""
    src = write_megatron_checkpoint(tmp_path / "src", model, make_full_model(model), 2, 1)
    to_torch_dist(src, tmp_path / "ours")
    monkeypatch.setattr(StreamingWriter, "save", save_with_torch)
    to_torch_dist(src, tmp_path / "torch")

    ours, theirs = (tmp_path / name / ITERATION_DIR for name in ("ours", "torch"))
    data = (ours / torch_dist_saver.DATA_FILE).read_bytes()
    assert data == (theirs / torch_dist_saver.DATA_FILE).read_bytes()
    assert (ours / ".metadata").read_bytes() == (theirs / ".metadata").read_bytes()
    assert sorted(path.name for path in ours.iterdir()) == sorted(path.name for path in theirs.iterdir())
    # Hashed on the way: the manifest records the file's digest (``--digest``'s in the legacy form, which has no
    # integrity.json) without reading it back.
    manifest = json.loads((tmp_path / "ours" / "pgconvert.json").read_text())
    recorded = {item["path"]: item["digest"] for item in manifest["files"]}
    assert recorded[f"{ITERATION_DIR}/{torch_dist_saver.DATA_FILE}"] == "xxh3-128:" + xxhash.xxh3_128(data).hexdigest()


def test_loader_reads_only_the_chunks_a_destination_piece_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 1, 1)
    to_torch_dist(src, tmp_path / "dist")
    source = TorchDistLoader().open(tmp_path / "dist", LoadOptions())
    read: list[int] = []
    original = SafeReader.read_data

    def recording(self, reads, load_bytes):  # type: ignore[no-untyped-def]
        read.extend(int(torch.Size(item.lengths).numel()) for item in reads)
        return original(self, reads, load_bytes)

    monkeypatch.setattr(SafeReader, "read_data", recording)
    piece = source.load_shard("decoder.layers.2.self_attention.linear_qkv.weight", COLUMN, 2, 1)

    # Half of one layer of the stacked [4, 128, 64] key.
    assert piece.shape == (64, 64) and sum(read) == 64 * 64


# --------------------------------------------------------------------------- validation


def test_target_layout_that_does_not_fit_is_refused_before_writing(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", MOE, make_full_model(MOE), 1, 1, ep=2)

    with pytest.raises(LayoutError, match="--dst-ep 3: num_experts=8 is not divisible by 3"):
        to_torch_dist(src, tmp_path / "dst", dst_ep=3)
    with pytest.raises(LayoutError, match="--dst-tp 3: num_attention_heads=16 is not divisible by 3"):
        to_torch_dist(src, tmp_path / "dst", dst_tp=3)
    assert not (tmp_path / "dst").exists()


def test_conversions_never_initialise_torch_distributed(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 2)

    to_torch_dist(src, tmp_path / "dist")
    from_torch_dist(tmp_path / "dist", tmp_path / "back", dst_tp=1, dst_pp=1)

    assert torch.distributed.is_available() and not torch.distributed.is_initialized()


# --------------------------------------------------------------------------- bad input


@pytest.fixture
def dist_checkpoint(tmp_path: Path) -> Path:
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)
    to_torch_dist(src, tmp_path / "dist")
    return tmp_path / "dist"


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_missing_data_file_is_named(dist_checkpoint: Path, tmp_path: Path) -> None:
    (dist_checkpoint / ITERATION_DIR / "__0_0.distcp").unlink()

    with pytest.raises(CheckpointError, match=r"missing data files named by \.metadata: __0_0\.distcp"):
        from_torch_dist(dist_checkpoint, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_truncated_data_file_is_refused(dist_checkpoint: Path, tmp_path: Path) -> None:
    data = dist_checkpoint / ITERATION_DIR / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])

    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: truncated \(1000 bytes"):
        from_torch_dist(dist_checkpoint, tmp_path / "dst")


def test_common_pt_with_a_disallowed_global_is_not_executed(dist_checkpoint: Path, tmp_path: Path) -> None:
    common_path = dist_checkpoint / ITERATION_DIR / "common.pt"
    common = load_for_test(common_path)
    marker = tmp_path / "pwned"
    common["payload"] = _Exploit(marker)
    torch.save(common, common_path)

    with pytest.raises(UnsafePickleError, match=r"common\.pt: refuses to unpickle global posix\.system"):
        from_torch_dist(dist_checkpoint, tmp_path / "dst")
    assert not marker.exists()


def test_dcp_metadata_with_a_disallowed_global_is_not_executed(dist_checkpoint: Path, tmp_path: Path) -> None:
    metadata_path = dist_checkpoint / ITERATION_DIR / ".metadata"
    metadata = FileSystemReader(str(dist_checkpoint / ITERATION_DIR)).read_metadata()
    marker = tmp_path / "pwned"
    metadata.planner_data = _Exploit(marker)
    metadata_path.write_bytes(pickle.dumps(metadata))

    with pytest.raises(UnsafePickleError, match=r"\.metadata: refuses to unpickle global posix\.system"):
        from_torch_dist(dist_checkpoint, tmp_path / "dst")
    assert not marker.exists()


def rewrite_dcp(iteration_dir: Path, target_root: Path, extra: dict[str, object] | None = None,
                objects: dict[str, object] | None = None) -> Path:
    """The checkpoint at ``iteration_dir`` rewritten by torch's own writer under ``target_root``,
    with ``extra`` entries added and ``_extra_state`` entries replaced by ``objects``' values."""
    metadata, tensors = read_dcp(iteration_dir)
    state: dict[str, object] = {**tensors, **{key: [None] for key in byte_keys(metadata)}}
    state.update(extra or {})
    state.update(objects or {})
    target = target_root / iteration_dir.name
    shutil.copytree(iteration_dir, target)
    for path in target.glob("*distcp"):
        path.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(target)), no_dist=True)
    return target_root


def test_extra_state_entry_with_a_disallowed_global_is_not_executed(dist_checkpoint: Path, tmp_path: Path) -> None:
    iteration_dir = dist_checkpoint / ITERATION_DIR
    marker = tmp_path / "pwned"
    key = byte_keys(read_dcp(iteration_dir)[0])[0]
    rewritten = rewrite_dcp(iteration_dir, tmp_path / "rewritten", objects={key: [_Exploit(marker)]})

    with pytest.raises(UnsafePickleError, match="_extra_state/shard_.*refuses to unpickle"):
        from_torch_dist(rewritten, tmp_path / "dst")
    assert not marker.exists()


def test_extra_state_holding_fp8_metadata_is_reported_and_refused_under_strict(dist_checkpoint: Path,
                                                                              tmp_path: Path) -> None:
    iteration_dir = dist_checkpoint / ITERATION_DIR
    key = byte_keys(read_dcp(iteration_dir)[0])[0]
    # What Transformer Engine's get_extra_state returns (a serialized buffer), in megatron-core's list.
    rewritten = rewrite_dcp(iteration_dir, tmp_path / "rewritten", objects={key: [io.BytesIO(b"fp8 scales")]})

    with pytest.raises(StrictModeError, match="1 _extra_state entries hold Transformer Engine state"):
        from_torch_dist(rewritten, tmp_path / "strict", strict=True)
    report = from_torch_dist(rewritten, tmp_path / "dst")
    assert any(f"e.g. {key}); it is not carried" in notice for notice in report.notices)


def test_metadata_json_naming_another_backend_is_refused(dist_checkpoint: Path, tmp_path: Path) -> None:
    config_path = dist_checkpoint / ITERATION_DIR / "metadata.json"
    config = json.loads(config_path.read_text())
    config["sharded_backend"] = "zarr"
    config_path.write_text(json.dumps(config))

    with pytest.raises(CheckpointError, match="sharded_backend='zarr': pgconvert reads Megatron distributed "
                       "checkpoints of the 'torch_dist' backend only"):
        from_torch_dist(dist_checkpoint, tmp_path / "dst")


def test_singleton_local_shards_metadata_with_stacked_keys_is_named(dist_checkpoint: Path, tmp_path: Path) -> None:
    # The metadata says one key per layer, gate/up halves apart (test_torch_dist_mcore reads megatron-core's own
    # such save); the keys are stacked: the mismatch is named with the naming the metadata asked for.
    common_path = dist_checkpoint / ITERATION_DIR / "common.pt"
    common = load_for_test(common_path)
    common["content_metadata"]["singleton_local_shards"] = True
    torch.save(common, common_path)

    with pytest.raises(CheckpointError, match=r"one key per layer, singleton_local_shards\); missing: \[.*"
                                              r"'decoder\.layers\.0\.mlp\.linear_fc1\.weight_w'"):
        from_torch_dist(dist_checkpoint, tmp_path / "dst")


def test_singleton_local_shards_of_grouped_gemm_experts_is_refused_by_name() -> None:
    from pgconvert.formats.torch_dist import refuse_singleton

    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, vocab_size=128,
                         num_experts=4, moe_ffn_hidden_size=32, moe_grouped_gemm=True)
    with pytest.raises(CheckpointError, match="x: saved with singleton_local_shards=True and moe_grouped_gemm=True"):
        refuse_singleton(config, "x")


def test_unknown_tensor_key_is_named_and_training_state_is_reported(dist_checkpoint: Path, tmp_path: Path) -> None:
    iteration_dir = dist_checkpoint / ITERATION_DIR
    unknown = rewrite_dcp(iteration_dir, tmp_path / "mtp", {"mtp.layers.0.enorm.weight": torch.ones(64)})
    training = rewrite_dcp(iteration_dir, tmp_path / "training",
                           {"optimizer.state.exp_avg.decoder.final_layernorm.weight": torch.ones(64)})

    with pytest.raises(CheckpointError, match=r"unexpected: \['mtp\.layers\.0\.enorm\.weight'\]"):
        from_torch_dist(unknown, tmp_path / "dst")
    report = from_torch_dist(training, tmp_path / "dst2", dst_tp=1)
    assert any("1 optimizer/RNG/rerun entries of the source are not converted" in n for n in report.notices)


def test_missing_key_is_named(dist_checkpoint: Path, tmp_path: Path) -> None:
    common_path = dist_checkpoint / ITERATION_DIR / "common.pt"
    common = load_for_test(common_path)
    common["args"].qk_layernorm = True
    torch.save(common, common_path)

    with pytest.raises(CheckpointError, match=r"missing: \['decoder\.layers\.self_attention\.k_layernorm\.weight', "
                       r"'decoder\.layers\.self_attention\.q_layernorm\.weight'\]"):
        from_torch_dist(dist_checkpoint, tmp_path / "dst")


def test_chunk_file_outside_the_checkpoint_is_refused(dist_checkpoint: Path, tmp_path: Path) -> None:
    metadata_path = dist_checkpoint / ITERATION_DIR / ".metadata"
    metadata = FileSystemReader(str(dist_checkpoint / ITERATION_DIR)).read_metadata()
    shutil.copy(dist_checkpoint / ITERATION_DIR / "__0_0.distcp", tmp_path / "elsewhere.distcp")
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    metadata_path.write_bytes(pickle.dumps(metadata))

    with pytest.raises(CheckpointError, match="leads outside the source directory"):
        from_torch_dist(dist_checkpoint, tmp_path / "dst")


def test_strict_mode_refuses_args_without_transformer_impl(dist_checkpoint: Path, tmp_path: Path) -> None:
    common_path = dist_checkpoint / ITERATION_DIR / "common.pt"
    common = load_for_test(common_path)
    del common["args"].transformer_impl
    torch.save(common, common_path)

    with pytest.raises(StrictModeError, match="args.transformer_impl=None; assuming Megatron-LM's default"):
        from_torch_dist(dist_checkpoint, tmp_path / "dst", strict=True)
    report = from_torch_dist(dist_checkpoint, tmp_path / "dst")
    assert any("guess:" in notice and "transformer_engine" in notice for notice in report.notices)


def test_all_errors_are_pgconvert_errors(dist_checkpoint: Path, tmp_path: Path) -> None:
    (dist_checkpoint / ITERATION_DIR / ".metadata").write_bytes(b"not a pickle")

    with pytest.raises(PgconvertError, match=r"\.metadata: truncated or corrupt checkpoint metadata"):
        from_torch_dist(dist_checkpoint, tmp_path / "dst")
