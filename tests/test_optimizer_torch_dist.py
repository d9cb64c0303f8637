"""megatron-core's distributed optimizer state in torch_dist checkpoints (dp_reshardable and
fully_reshardable; fully_sharded_model_space in test_optimizer_fs_model_space.py), on goldens written by Megatron-LM's
own training (TP2 DP2, the same seeded run in each form; see tests/data/megatron_lm/README.md)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from support.cli_helpers import assert_clean_refusal
from support.megatron_fixtures import load_for_test
from support.optimizer_cli import assert_same_parameters, dcp_read, export_optimizer, rewrite_metadata, run_cli
from support.checkpoint_compare import read_common
from pgconvert.formats import LoadOptions
from pgconvert.optimizer.order import OptimizerLayoutError, UnsupportedOptimizerError
from pgconvert.formats.registry import get_loader

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
FORMS = ("dp_reshardable", "fully_reshardable")
GOLDEN = {form: GOLDENS / f"train_tp2dp2_distopt_{form}_torch_dist" for form in FORMS}
PRESENT = [form for form in FORMS if GOLDEN[form].is_dir()]
KEYS = ("param", "exp_avg", "exp_avg_sq", "step")


def _open(golden: Path):  # noqa: ANN202
    from pgconvert.loaders.torch_dist.optimizer import TorchDistOptimizerSource

    source = get_loader("torch_dist").open(golden, LoadOptions())
    return source, TorchDistOptimizerSource(source)


def test_the_goldens_hold_both_forms() -> None:
    assert PRESENT == list(FORMS)
    for form in FORMS:
        source, optimizer = _open(GOLDEN[form])
        assert optimizer.sharding == form
        assert source.common_state["optimizer"]["param_state_sharding_type"] == form
        assert (source.layout.tp, source.layout.pp) == (2, 1) and source.megatron_args.data_parallel_size == 2
        source.close()


@pytest.mark.parametrize("form", PRESENT)
def test_each_form_reads_the_masters_of_the_model_and_the_step(form: str) -> None:
    source, optimizer = _open(GOLDEN[form])
    assert len(optimizer.names()) == 15
    for name in optimizer.names():
        state = optimizer.parameter(name)
        model = source.load(name)
        assert state["param"].dtype == torch.float32 and state["param"].shape == model.shape
        # megatron-core copies each fp32 master into its bf16 weight after every step
        assert torch.equal(state["param"].to(torch.bfloat16), model), name
        assert state["exp_avg_sq"].min() >= 0 and torch.equal(state["step"], torch.tensor(2.0))
    source.close()


def test_fully_reshardable_equals_torchs_own_read_of_the_records(tmp_path: Path) -> None:
    form = "fully_reshardable"
    exported = export_optimizer(GOLDEN[form], tmp_path / "per_parameter")
    keys = {"param": "optimizer.state.param.", "exp_avg": "optimizer.state.exp_avg.",
            "exp_avg_sq": "optimizer.state.exp_avg_sq."}
    stacked = "decoder.layers.self_attention.linear_qkv.weight"
    read = dcp_read(GOLDEN[form] / "iter_0000002", [prefix + stacked for prefix in keys.values()] +
                       [prefix + "embedding.word_embeddings.weight" for prefix in keys.values()])
    for key, prefix in keys.items():
        assert torch.equal(exported["decoder.layers.1.self_attention.linear_qkv.weight"][key], read[prefix + stacked][1])
        assert torch.equal(exported["embedding.word_embeddings.weight"][key],
                           read[prefix + "embedding.word_embeddings.weight"])


def test_dp_reshardable_flat_buffers_equal_torchs_own_read_at_the_derived_ranges() -> None:
    source, optimizer = _open(GOLDEN["dp_reshardable"])
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    key = optimizer.bucket_key(optimizer._owners[name][1][0].coord, 0, "exp_avg")
    flat = dcp_read(GOLDEN["dp_reshardable"] / "iter_0000002", [key])[key]
    owner, slot = optimizer._owners[name][1]
    placed = optimizer._placed(owner.coord, slot)
    assert torch.equal(optimizer._pieces(name, "exp_avg")[1].reshape(-1), flat[placed.start:placed.end])
    source.close()


def test_dp_reshardable_holds_the_same_state_as_fully_reshardable(tmp_path: Path) -> None:
    # The same seeded run (flags, data, gloo on the CPU) saved in each form: megatron-core's own
    # model-space form is the reference for the flat-buffer placement pgconvert derives.
    assert_same_parameters(export_optimizer(GOLDEN["dp_reshardable"], tmp_path / "dp_reshardable"),
                            export_optimizer(GOLDEN["fully_reshardable"], tmp_path / "reference"))


@pytest.mark.parametrize("form", PRESENT)
def test_torch_dist_to_per_rank_tp1_and_back_to_tp2pp2_is_bit_exact(tmp_path: Path, form: str) -> None:
    src = GOLDEN[form]
    assert run_cli("convert", src, tmp_path / "tp1", "-q", "--dst-format", "megatron", "--dst-tp", "1").exit_code == 0
    rank = load_for_test(tmp_path / "tp1" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")
    assert [group["step"] for group in rank["optimizer"]["optimizer"]["param_groups"]] == [2.0, 2.0]
    assert rank["iteration"] == 2 and "opt_param_scheduler" in rank
    assert (tmp_path / "tp1" / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt").is_file()
    result = run_cli("convert", tmp_path / "tp1", tmp_path / "tp2pp2", "-q", "--dst-tp", "2", "--dst-pp", "2")
    assert result.exit_code == 0, result.output
    result = run_cli("convert", tmp_path / "tp2pp2", tmp_path / "tp2", "-q", "--dst-tp", "2", "--dst-pp", "1")
    assert result.exit_code == 0, result.output
    source = export_optimizer(src, tmp_path / "a")
    for layout in ("tp1", "tp2pp2", "tp2"):
        assert_same_parameters(source, export_optimizer(tmp_path / layout, tmp_path / f"{layout}export_optimizer"))
    # TP2 DP2 (the golden) written at TP2 DP1: the same per-rank buffers as a direct TP2 conversion
    assert run_cli("convert", src, tmp_path / "direct", "-q", "--dst-format", "megatron", "--dst-tp", "2").exit_code == 0
    for rank_dir in ("mp_rank_00", "mp_rank_01"):
        a, b = (torch.load(tmp_path / d / "iter_0000002" / rank_dir / "distrib_optim.pt", weights_only=True)
                for d in ("direct", "tp2"))
        for index in (0,):
            ((key_a, bufs_a),), ((key_b, bufs_b),) = a[index].items(), b[index].items()
            assert key_a == key_b == (torch.bfloat16, torch.float32)
            for field in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(bufs_a[field], bufs_b[field]), f"{rank_dir}.{field}"


def _copy(form: str, tmp_path: Path) -> Path:
    target = tmp_path / form
    shutil.copytree(GOLDEN[form], target)
    return target


@pytest.mark.parametrize("form", PRESENT)
def test_missing_optimizer_records_are_a_named_error(tmp_path: Path, form: str) -> None:
    src = _copy(form, tmp_path)
    victim = ("optimizer.distributed.dp_group_idx_1.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32)"
              ".bucket_idx_0.exp_avg_sq" if form == "dp_reshardable"
              else "optimizer.state.exp_avg_sq.decoder.layers.mlp.linear_fc2.weight")

    def drop(metadata) -> None:  # noqa: ANN001
        del metadata.state_dict_metadata[victim]
        for index in [index for index in metadata.storage_data if index.fqn == victim]:
            del metadata.storage_data[index]

    rewrite_metadata(src / "iter_0000002", drop)
    result = run_cli("convert", src, tmp_path / "out", "--dst-format", "megatron", "--dst-tp", "1")
    assert_clean_refusal(result, 1, "no optimizer record", victim.split(".bucket")[0], form)
    assert not (tmp_path / "out").exists()
    skipped = run_cli("convert", src, tmp_path / "skipped", "--dst-format", "megatron", "--dst-tp", "1",
                   "--skip-optimizer")
    assert skipped.exit_code == 0, skipped.output


def test_a_flat_buffer_of_the_wrong_size_is_a_named_error(tmp_path: Path) -> None:
    src = _copy("dp_reshardable", tmp_path)
    victim = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0.param"

    def grow(metadata) -> None:  # noqa: ANN001
        entry = metadata.state_dict_metadata[victim]
        entry.size = torch.Size([entry.size[0] + 64])

    rewrite_metadata(src / "iter_0000002", grow)
    result = run_cli("convert", src, tmp_path / "out", "--dst-format", "megatron", "--dst-tp", "1")
    assert_clean_refusal(result, 1, "has global shape", "64-element alignment")


def test_an_unknown_sharding_type_and_an_unread_one_are_named_errors() -> None:
    from pgconvert.loaders.torch_dist.optimizer import TorchDistOptimizerSource

    source = get_loader("torch_dist").open(GOLDEN["fully_reshardable"], LoadOptions())
    source.common_state["optimizer"]["param_state_sharding_type"] = "bucket_space_v9"
    with pytest.raises(OptimizerLayoutError, match="param_state_sharding_type='bucket_space_v9': unknown sharding"):
        TorchDistOptimizerSource(source)
    source.common_state["optimizer"]["param_state_sharding_type"] = "dp_zero_gather_scatter"
    with pytest.raises(UnsupportedOptimizerError, match="'dp_zero_gather_scatter': not a form pgconvert reads"):
        TorchDistOptimizerSource(source)
    # fully_sharded_model_space is read (tests/test_optimizer_fs_model_space.py); the deprecated
    # bucket-space form is not
    source.common_state["optimizer"]["param_state_sharding_type"] = "fully_sharded_bucket_space"
    with pytest.raises(UnsupportedOptimizerError, match="'fully_sharded_bucket_space': not a form pgconvert reads"):
        TorchDistOptimizerSource(source)
    del source.common_state["optimizer"]
    with pytest.raises(UnsupportedOptimizerError, match="no optimizer entry"):
        TorchDistOptimizerSource(source)
    source.close()


def test_the_report_says_the_optimizer_is_carried_and_rng_is_not(tmp_path: Path) -> None:
    import pgconvert

    report = pgconvert.convert(GOLDEN["fully_reshardable"], tmp_path / "out", dst_format="megatron", dst_tp=1)
    assert any(note.startswith("optimizer (distributed), scheduler") and "--no-load-rng" in note
               for note in report.notices), report.notices
    assert not any("optimizer/RNG/rerun entries" in note for note in report.notices), report.notices
    # the plain (non-distributed) optimizer of a torch_dist run is carried too
    plain = GOLDENS / "train_tp2pp2_bf16_torch_dist"
    result = run_cli("convert", plain, tmp_path / "strict", "--dst-format", "megatron", "--dst-tp", "1", "--strict")
    assert result.exit_code == 0 and "optimizer (float16), scheduler" in result.output, result.output


@pytest.mark.parametrize("form", PRESENT)
def test_a_torch_dist_destination_holds_the_state_fully_reshardable_at_any_layout(tmp_path: Path, form: str) -> None:
    src = GOLDEN[form]
    result = run_cli("convert", src, tmp_path / "td1", "-q", "--dst-format", "torch_dist", "--dst-tp", "1",
                  "--dst-optim-form", "fully_reshardable")  # the default is the source's form
    assert result.exit_code == 0, result.output
    common = read_common(tmp_path / "td1" / "iter_0000002")
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert [group["step"] for group in common["optimizer"]["optimizer"]["param_groups"]] == [2.0, 2.0]
    assert common["iteration"] == 2 and "opt_param_scheduler" in common
    original = export_optimizer(src, tmp_path / "original")
    assert_same_parameters(original, export_optimizer(tmp_path / "td1", tmp_path / "td1_export"))
    # torch's own reader sees the records pgconvert added beside the model's
    key = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight"
    read = dcp_read(tmp_path / "td1" / "iter_0000002", [key])[key]
    assert torch.equal(read[0], original["decoder.layers.0.mlp.linear_fc1.weight"]["exp_avg"])
    # from the written form on: TP2 PP2 torch_dist, then per-rank TP2 (DP1), all bit-exact
    result = run_cli("convert", tmp_path / "td1", tmp_path / "td22", "-q", "--dst-format", "torch_dist",
                  "--dst-tp", "2", "--dst-pp", "2")
    assert result.exit_code == 0, result.output
    result = run_cli("convert", tmp_path / "td22", tmp_path / "rank", "-q", "--dst-format", "megatron", "--dst-tp", "2")
    assert result.exit_code == 0, result.output
    for layout in ("td22", "rank"):
        assert_same_parameters(original, export_optimizer(tmp_path / layout, tmp_path / f"{layout}export_optimizer"))
    assert run_cli("verify", src, tmp_path / "td22").exit_code == 0


def test_a_per_rank_distributed_optimizer_goes_into_torch_dist_and_back(tmp_path: Path) -> None:
    src = GOLDENS / "train_tp2dp2_distopt_bf16_torch"
    result = run_cli("convert", src, tmp_path / "td", "-q", "--dst-format", "torch_dist", "--dst-tp", "1")
    assert result.exit_code == 0, result.output
    result = run_cli("convert", tmp_path / "td", tmp_path / "back", "-q", "--dst-format", "megatron", "--dst-tp", "2")
    assert result.exit_code == 0, result.output
    original = export_optimizer(src, tmp_path / "original")
    assert_same_parameters(original, export_optimizer(tmp_path / "td", tmp_path / "td_export"))
    for rank_dir in ("mp_rank_00", "mp_rank_01"):
        a, b = (torch.load(d / "iter_0000002" / rank_dir / "distrib_optim.pt", weights_only=True)
                for d in (src, tmp_path / "back"))
        for field in ("param", "exp_avg", "exp_avg_sq"):
            ((_, bufs_a),), ((_, bufs_b),) = a[0].items(), b[0].items()
            assert torch.equal(bufs_a[field], bufs_b[field]), f"{rank_dir}.{field}"


def test_dp_reshardable_over_two_pipeline_stages_maps_each_model_parallel_rank(tmp_path: Path) -> None:
    # TP2 PP2 DP1: four model-parallel ranks g = tp + 2 * pp, each its own flat bucket of its stage.
    golden = GOLDENS / "train_tp2pp2_distopt_dp_reshardable_torch_dist"
    source, optimizer = _open(golden)  # checks every master against its bf16 weight
    assert (source.layout.tp, source.layout.pp) == (2, 2)
    keys = {key for key in source.tensor_keys() if key.startswith("optimizer.distributed.")}
    assert {key.split(".")[2] for key in keys} == {f"dp_group_idx_{g}" for g in range(4)}
    for name in ("embedding.word_embeddings.weight", "output_layer.weight", "decoder.layers.1.mlp.linear_fc2.weight"):
        state = optimizer.parameter(name)
        assert torch.equal(state["param"].to(torch.bfloat16), source.load(name)), name
    source.close()
    original = export_optimizer(golden, tmp_path / "original")
    result = run_cli("convert", golden, tmp_path / "tp1", "-q", "--dst-format", "megatron", "--dst-tp", "1")
    assert result.exit_code == 0, result.output
    result = run_cli("convert", golden, tmp_path / "td", "-q", "--dst-format", "torch_dist", "--dst-tp", "1")
    assert result.exit_code == 0, result.output
    for layout in ("tp1", "td"):
        assert_same_parameters(original, export_optimizer(tmp_path / layout, tmp_path / f"{layout}export_optimizer"))


def test_a_second_bucket_is_refused_naming_the_record(tmp_path: Path) -> None:
    import dataclasses

    src = _copy("dp_reshardable", tmp_path)
    first = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.bfloat16, torch.float32).bucket_idx_0.param"
    second = first.replace("bucket_idx_0", "bucket_idx_1")

    def add_bucket(metadata) -> None:  # noqa: ANN001
        metadata.state_dict_metadata[second] = metadata.state_dict_metadata[first]
        for index, info in list(metadata.storage_data.items()):
            if index.fqn == first:
                metadata.storage_data[dataclasses.replace(index, fqn=second)] = info

    rewrite_metadata(src / "iter_0000002", add_bucket)
    result = run_cli("convert", src, tmp_path / "out", "--dst-format", "megatron", "--dst-tp", "1")
    assert_clean_refusal(result, 1, "bucket_idx_1", "not ones the layout", "megatron-core 0.16.1")


@pytest.mark.parametrize("form", PRESENT)
def test_reads_are_one_parameters_range_not_a_whole_bucket(tmp_path: Path, form: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import pgconvert.io.ranges as ranges
    import pgconvert.io.torch_input as torch_input
    from pgconvert.loaders.torch_dist.reader import TorchDistSource
    from pgconvert.optimizer.export import export_parameters

    requested: list[int] = []
    read, read_in_place = TorchDistSource._read, ranges.read_region

    def recording(self, regions, objects):  # noqa: ANN001, ANN202
        requested.extend(buffer.numel() for pairs in regions.values() for _, buffer in pairs)
        return read(self, regions, objects)

    def recording_in_place(fd, region, out):  # noqa: ANN001, ANN202  # dp_reshardable's pieces, in their place
        requested.append(out.numel())
        return read_in_place(fd, region, out)

    source, optimizer = _open(GOLDEN[form])
    monkeypatch.setattr(TorchDistSource, "_read", recording)
    monkeypatch.setattr(ranges, "read_region", recording_in_place)
    monkeypatch.setattr(torch_input, "read_region", recording_in_place)
    export_parameters(optimizer, tmp_path / "out")
    largest = max(math.prod(optimizer.parameter(name)["param"].shape) for name in optimizer.names())
    bucket = max(shape[0] for key, shape in source.tensor_keys().items() if key.startswith("optimizer.distributed."))\
        if form == "dp_reshardable" else None
    source.close()
    assert requested and max(requested) <= largest
    if bucket is not None:
        assert max(requested) < bucket  # a TP piece of one parameter, never the rank's whole flat bucket
