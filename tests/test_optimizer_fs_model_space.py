"""The distributed optimizer's ``fully_sharded_model_space`` torch_dist form (megatron-core <= 0.15.0),
on a golden saved by megatron-core 0.15.0 itself (``scripts/make_fs_model_space_golden.py``) from the state
of the Megatron-LM golden ``train_tp2dp2_distopt_fully_reshardable_torch_dist``, which is the reference."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from support.cli_helpers import assert_clean_refusal
from support.megatron_fixtures import load_for_test
from support.optimizer_cli import assert_same_parameters, export_optimizer, run_cli, torch_metadata
from support.checkpoint_compare import read_common
from pgconvert.formats import LoadOptions
from pgconvert.loaders.torch_dist.fs_model_space import chunk_shape, flatten, unflatten
from pgconvert.optimizer.order import OptimizerLayoutError
from pgconvert.formats.registry import get_loader
from pgconvert.formats.torch_dist import read_dcp_metadata
from pgconvert.io import dcp_plan

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
GOLDEN = GOLDENS / "mcore015_tp2dp2_distopt_fs_model_space_torch_dist"
REFERENCE = GOLDENS / "train_tp2dp2_distopt_fully_reshardable_torch_dist"
FC1 = "decoder.layers.mlp.linear_fc1.weight"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    return export_optimizer(REFERENCE, tmp_path_factory.mktemp("reference"))


def test_the_golden_is_megatron_core_0_15s_own_fs_model_space_save() -> None:
    iteration = GOLDEN / "iter_0000002"
    common = read_common(iteration)
    assert common["optimizer"]["param_state_sharding_type"] == "fully_sharded_model_space"
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_sharded_model_space"
    metadata = read_dcp_metadata(iteration / ".metadata")  # megatron-core 0.15's MCoreMetadata, read inert
    assert isinstance(metadata, dcp_plan.Metadata) and hasattr(metadata, "mcore_data")
    sizes = {key: tuple(md.size) for key, md in metadata.state_dict_metadata.items() if hasattr(md, "size")}
    # [layers, 2 * TP chunks of ffn / TP rows (gate, then up), 1 chunk of columns, 16 * 16 elements]
    assert sizes["optimizer.state.fp32_param." + FC1] == (2, 4, 1, 256) and sizes[FC1] == (2, 64, 16)
    assert sizes["optimizer.state.exp_avg.embedding.word_embeddings.weight"] == (2, 1, 512)


def test_fs_model_space_holds_the_state_of_the_fully_reshardable_reference(tmp_path: Path, reference) -> None:  # noqa: ANN001
    # the form used to be refused ("cannot save it")
    assert_same_parameters(export_optimizer(GOLDEN, tmp_path / "fs_model_space"), reference)


def test_the_records_are_the_model_tensor_permuted_by_its_chunks(tmp_path: Path, reference) -> None:  # noqa: ANN001
    # pgconvert's reader of the raw record (no unflattening) against the reference, flattened by chunk
    source = get_loader("torch_dist").open(GOLDEN, LoadOptions())
    for key, field in (("exp_avg", "exp_avg"), ("param", "fp32_param")):
        raw = torch.empty(2, 4, 1, 256)
        source._read({f"optimizer.state.{field}.{FC1}": [((0, 0, 0, 0), raw)]}, [])
        for layer in range(2):
            whole = reference[f"decoder.layers.{layer}.mlp.linear_fc1.weight"][key]
            assert torch.equal(raw[layer], flatten(whole, (16, 16))), (layer, key)
            # TP rank 1's up half is chunk 3: rows 48..63 of [gate; up]
            assert torch.equal(raw[layer, 3, 0], whole[48:64].reshape(-1))
    source.close()


def test_flatten_and_unflatten_are_inverse_for_any_chunk_grid() -> None:
    tensor = torch.arange(4 * 6 * 10, dtype=torch.float32).reshape(4, 6, 10)
    for local in ((1, 6, 10), (2, 3, 5), (4, 1, 2)):
        record = flatten(tensor, local)
        assert record.shape == tuple(n // m for n, m in zip(tensor.shape, local)) + (local[0] * local[1] * local[2],)
        assert torch.equal(unflatten(record, local, tensor.shape), tensor)
        assert chunk_shape(tuple(record.shape), tuple(tensor.shape), "t") == local
    with pytest.raises(OptimizerLayoutError, match="is not a fully_sharded_model_space record"):
        chunk_shape((3, 1, 1, 60), (4, 6, 10), "t")
    with pytest.raises(OptimizerLayoutError, match="hold 120 elements, not 60"):
        chunk_shape((2, 1, 1, 60), (4, 6, 10), "t")


def test_to_per_rank_tp1_and_to_torch_dist_at_other_layouts_is_bit_exact(tmp_path: Path, reference) -> None:  # noqa: ANN001
    result = run_cli("convert", GOLDEN, tmp_path / "tp1", "-q", "--dst-format", "megatron", "--dst-tp", "1")
    assert result.exit_code == 0, result.output
    rank = load_for_test(tmp_path / "tp1" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")
    assert [group["step"] for group in rank["optimizer"]["optimizer"]["param_groups"]] == [2.0, 2.0]
    assert_same_parameters(export_optimizer(tmp_path / "tp1", tmp_path / "tp1_export"), reference)
    result = run_cli("convert", GOLDEN, tmp_path / "tp1pp2", "--dst-format", "torch_dist", "--dst-tp", "1",
                  "--dst-pp", "2", "--dst-optim-form", "fully_reshardable")
    assert result.exit_code == 0, result.output
    assert "fully_sharded_model_space form is written as fully_reshardable" in " ".join(result.output.split())
    common = read_common(tmp_path / "tp1pp2" / "iter_0000002")
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert_same_parameters(export_optimizer(tmp_path / "tp1pp2", tmp_path / "tp1pp2_export"), reference)
    result = run_cli("convert", GOLDEN, tmp_path / "dp", "-q", "--dst-format", "torch_dist", "--dst-tp", "1",
                  "--dst-optim-form", "dp_reshardable", "--dst-dp", "4")
    assert result.exit_code == 0, result.output
    assert read_common(tmp_path / "dp" / "iter_0000002")["optimizer"][
        "param_state_sharding_type"] == "dp_reshardable"
    assert_same_parameters(export_optimizer(tmp_path / "dp", tmp_path / "dp_export"), reference)


def test_a_record_of_the_wrong_shape_is_a_named_error(tmp_path: Path) -> None:
    src = tmp_path / "fs_model_space"
    shutil.copytree(GOLDEN, src)
    path = src / "iter_0000002" / ".metadata"
    metadata = torch_metadata(path.parent)
    victim = "optimizer.state.exp_avg_sq." + FC1
    metadata.state_dict_metadata[victim].size = torch.Size([2, 4, 1, 512])
    plain = Metadata(metadata.state_dict_metadata, metadata.planner_data, metadata.storage_data)
    path.write_bytes(pickle.dumps(plain))
    result = run_cli("convert", src, tmp_path / "out", "--dst-format", "megatron", "--dst-tp", "1")
    assert_clean_refusal(result, 1, victim, "hold 256 elements, not 512")
    skipped = run_cli("convert", src, tmp_path / "skipped", "--dst-format", "megatron", "--dst-tp", "1",
                   "--skip-optimizer")
    assert skipped.exit_code == 0, skipped.output


def test_a_torch_dist_destination_keeps_the_form_and_reads_back_bit_exact(tmp_path: Path, reference) -> None:  # noqa: ANN001
    # the default for this source is its own form; megatron-core 0.15.0 loads these records (checked by
    # scripts/make_fs_model_space_golden.py load, outside CI)
    result = run_cli("convert", GOLDEN, tmp_path / "td1", "--dst-format", "torch_dist", "--dst-tp", "1")
    assert result.exit_code == 0, result.output
    assert "written as" not in result.output
    iteration = tmp_path / "td1" / "iter_0000002"
    common = read_common(iteration)
    assert common["optimizer"]["param_state_sharding_type"] == "fully_sharded_model_space"
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_sharded_model_space"
    assert [group["step"] for group in common["optimizer"]["optimizer"]["param_groups"]] == [2.0, 2.0]
    # torch's own Metadata with megatron-core's mcore_data (the original global shapes it needs on load), as
    # megatron-core 0.13.1 / 0.14.0 store it: no megatron class for 0.14.0 to miss
    metadata = torch_metadata(iteration)
    assert type(metadata) is Metadata and b"megatron" not in (iteration / ".metadata").read_bytes()
    key = "optimizer.state.exp_avg." + FC1
    assert metadata.mcore_data[key] == {"nd_reformulated_orig_global_shape": (2, 64, 16)}
    assert tuple(metadata.state_dict_metadata[key].size) == (2, 2, 1, 512)  # TP1: the gate and up chunks
    assert_same_parameters(export_optimizer(tmp_path / "td1", tmp_path / "td1_export"), reference)
    result = run_cli("convert", tmp_path / "td1", tmp_path / "td2", "-q", "--dst-format", "torch_dist", "--dst-tp", "2")
    assert result.exit_code == 0, result.output
    assert_same_parameters(export_optimizer(tmp_path / "td2", tmp_path / "td2_export"), reference)
