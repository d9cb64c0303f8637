"""A distributed optimizer's flat buffers (``distrib_optim.pt``) are written part by part
(zero gaps and one parameter's piece at a time), never whole: the torch zip writer's ``parts``."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.megatron_fixtures import load_for_test
from support.torch_save import torch_save_bytes
from support.structure_reads import patch_structure_reads

import pgconvert.io.torchzip as torchzip
from pgconvert.cli import main
from pgconvert.io.torchzip import PlannedTensor, TensorMismatchError, save_stream

DISTOPT = Path(__file__).parent / "data" / "megatron_lm" / "train_tp2dp2_distopt_bf16_torch"
ITER = "iter_0000002"


def _in_parts(tensor: torch.Tensor, cuts: list[int]) -> PlannedTensor:
    flat = tensor.reshape(-1)
    bounds = [0, *cuts, flat.numel()]
    return PlannedTensor(tuple(tensor.shape), tensor.dtype, lambda: pytest.fail("produce called"),
                         lambda: [flat[a:b].clone() for a, b in zip(bounds, bounds[1:])])


@pytest.mark.parametrize("crc32", [False, True], ids=["no-crc", "crc"])
def test_a_record_written_in_parts_is_torch_saves_bytes(crc32: bool) -> None:
    # Starts like a zip data descriptor (torch folds its CRC field into the serialization id), split
    # inside those 8 bytes, with an empty part.
    head = torch.tensor(list(b"PK\x07\x08\x01\x02\x03\x04"), dtype=torch.uint8)
    descriptor = torch.cat([head, torch.arange(100, dtype=torch.uint8)])
    matrix = torch.randn(6, 5)
    state = {"d": _in_parts(descriptor, [2, 2, 5]), "m": _in_parts(matrix, [7, 19]), "x": torch.ones(3)}
    streamed = io.BytesIO()

    save_stream(state, streamed, crc32=crc32)

    expected = {"d": descriptor, "m": matrix, "x": state["x"]}
    assert streamed.getvalue() == torch_save_bytes(expected, crc32)


def test_parts_of_another_dtype_or_total_size_are_refused() -> None:
    wrong_dtype = PlannedTensor((4,), torch.float32, torch.zeros, lambda: [torch.zeros(4, dtype=torch.float64)])
    short = PlannedTensor((4,), torch.float32, torch.zeros, lambda: [torch.zeros(3)])

    with pytest.raises(TensorMismatchError, match="produced a part torch.float64"):
        save_stream({"w": wrong_dtype}, io.BytesIO())
    with pytest.raises(TensorMismatchError, match="planned 16 bytes, produced 12"):
        save_stream({"w": short}, io.BytesIO())


def test_distrib_optim_buffers_are_written_one_parameter_at_a_time(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[int] = []
    write = torchzip._ZipStream._write

    def recording(self, data):  # noqa: ANN001, ANN202
        writes.append(len(data))
        return write(self, data)

    monkeypatch.setattr(torchzip._ZipStream, "_write", recording)
    runner = CliRunner()
    result = runner.invoke(main, ["convert", str(DISTOPT), str(tmp_path / "tp1"), "-q", "--dst-tp", "1"])
    assert result.exit_code == 0, result.output
    monkeypatch.undo()

    model = load_for_test(tmp_path / "tp1" / ITER / "mp_rank_00" / "model_optim_rng.pt")["model"]
    largest_parameter = max(4 * math.prod(t.shape) for t in model.values() if isinstance(t, torch.Tensor))
    flat = torch.load(tmp_path / "tp1" / ITER / "mp_rank_00" / "distrib_optim.pt", weights_only=True)
    ((_, buffers),) = flat[0].items()
    assert 4 * buffers["param"].numel() > 2 * largest_parameter  # the buffer holds many parameters
    assert max(writes) <= largest_parameter  # old code: one write of the whole buffer per field

    result = runner.invoke(main, ["convert", str(tmp_path / "tp1"), str(tmp_path / "back"), "-q", "--dst-tp", "2"])
    assert result.exit_code == 0, result.output
    for rank_dir in ("mp_rank_00", "mp_rank_01"):
        a, b = (torch.load(d / ITER / rank_dir / "distrib_optim.pt", weights_only=True)
                for d in (DISTOPT, tmp_path / "back"))
        ((_, bufs_a),), ((_, bufs_b),) = a[0].items(), b[0].items()
        for field in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(bufs_a[field], bufs_b[field]), f"{rank_dir}.{field}"


def test_opening_a_dp_reshardable_source_checks_the_masters_reading_only_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from pgconvert.formats import LoadOptions
    from pgconvert.loaders.torch_dist.reader import TorchDistSource
    from pgconvert.loaders.torch_dist.optimizer import TorchDistOptimizerSource
    from pgconvert.formats.registry import get_loader

    golden = DISTOPT.with_name("train_tp2dp2_distopt_dp_reshardable_torch_dist")
    read: list[str] = []
    flat_meta = TorchDistSource.flat_meta

    def recording(self, key, start, length):  # noqa: ANN001, ANN202
        read.append(key.rsplit(".", 1)[1])
        return flat_meta(self, key, start, length)

    source = get_loader("torch_dist").open(golden, LoadOptions())
    monkeypatch.setattr(TorchDistSource, "flat_meta", recording)
    try:
        optimizer = TorchDistOptimizerSource(source)  # checks every master against its weight
        assert read and set(read) == {"param"}  # old code: the moments were read too, three times the bytes
        read.clear()
        state = optimizer.parameter("output_layer.weight")
    finally:
        source.close()
    assert set(read) == {"param", "exp_avg", "exp_avg_sq"} and set(state) == {"param", "exp_avg", "exp_avg_sq", "step"}


def test_a_dp_reshardable_source_reads_each_piece_straight_into_its_place(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Its TP pieces are located in their flat records and read into their place in the merged or cut tensor (a
    replicated parameter's whole, to compare the replicas), never read whole and then joined."""
    from pgconvert.loaders.torch_dist.reader import TorchDistSource

    golden = DISTOPT.with_name("train_tp2dp2_distopt_dp_reshardable_torch_dist")
    whole: list[str] = []
    load_flat = TorchDistSource.load_flat

    def recording(self, key, start, length):  # noqa: ANN001, ANN202
        whole.append(key)
        return load_flat(self, key, start, length)

    monkeypatch.setattr(TorchDistSource, "load_flat", recording)
    runner = CliRunner()
    result = runner.invoke(main, ["convert", str(golden), str(tmp_path / "tp1"), "-q", "--dst-format", "megatron",
                                  "--dst-tp", "1"])
    assert result.exit_code == 0, result.output
    assert whole == []  # old code: every piece of every field read whole, then joined
    monkeypatch.setattr(TorchDistSource, "flat_meta", lambda self, key, start, length: None)  # read whole, joined
    result = runner.invoke(main, ["convert", str(golden), str(tmp_path / "joined"), "-q", "--dst-format", "megatron",
                                  "--dst-tp", "1"])
    assert result.exit_code == 0, result.output
    assert whole
    for name in ("distrib_optim.pt", "model_optim_rng.pt"):
        assert (tmp_path / "tp1" / ITER / "mp_rank_00" / name).read_bytes() == \
            (tmp_path / "joined" / ITER / "mp_rank_00" / name).read_bytes(), name


@pytest.mark.parametrize("source", [DISTOPT, DISTOPT.with_name("train_tp2dp2_muon_bf16_torch")],
                         ids=["distributed", "plain"])
def test_a_per_rank_destination_writes_each_rank_file_once_and_never_reads_one_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: Path) -> None:
    import pgconvert.formats.megatron as megatron_format
    import pgconvert.savers.megatron as megatron_saver

    saved: list[str] = []
    loaded: list[Path] = []
    save, read = megatron_saver.save_durably, megatron_format.safe_torch_structure

    def saving(state, path, **kwargs):  # noqa: ANN001, ANN003, ANN202
        saved.append("/".join(Path(path).parts[-3:]))  # under the staging directory
        return save(state, path, **kwargs)

    def reading(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        loaded.append(Path(path))
        return read(path, *args, **kwargs)

    monkeypatch.setattr(megatron_saver, "save_durably", saving)
    patch_structure_reads(monkeypatch, reading)
    result = CliRunner().invoke(main, ["convert", str(source), str(tmp_path / "out"), "-q", "--dst-tp", "1"])
    assert result.exit_code == 0, result.output
    monkeypatch.undo()

    beside = [f"{ITER}/mp_rank_00/distrib_optim.pt"] if source == DISTOPT else []
    # old code: the rank file written, read back, and written again (as model_optim_rng.pt.optim, then renamed)
    assert saved == [f"{ITER}/mp_rank_00/model_optim_rng.pt", *beside]
    assert any(path.name == "model_optim_rng.pt" and str(path).startswith(str(source)) for path in loaded), loaded
    assert not any(str(path).startswith(str(tmp_path)) for path in loaded)
    state = load_for_test(tmp_path / "out" / ITER / "mp_rank_00" / "model_optim_rng.pt")
    assert "optimizer" in state and "model" in state and state["iteration"] == 2
    assert (tmp_path / "out" / ITER / "mp_rank_00" / "distrib_optim.pt").exists() == (source == DISTOPT)
