"""Reading torch_dist tensor records in place (``pgconvert/io/dcp_records.py``).

The reader reads only the bytes a request needs of each ``.distcp`` record, with positional reads into
the destination, so a conversion's memory is bounded by the piece it reads, not by the stored record it
overlaps. Records are parsed
with storages on the meta device; every structural problem is a named error.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.cli_helpers import assert_clean_refusal, run_cli
from support.tiny_models import GQA_SWIGLU
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint
from support.torch_dist_forms import FOR_MCORE_016
from torch.distributed.checkpoint import FileSystemReader

import pgconvert
import pgconvert.io.ranges as ranges
import pgconvert.io.dcp_records as records
from pgconvert.errors import CheckpointError, UnsafePickleError
from pgconvert.formats import LoadOptions
from pgconvert.io.dcp_records import parse_tensor_record, read_box
from pgconvert.loaders.torch_dist import TorchDistLoader
from pgconvert.model.rules import COLUMN

ITERATION_DIR = "iter_0000100"
PREFIX = b"odd"  # three bytes: the record, and its tensor bytes, are not aligned in the file


Record = tuple[int, Path, int, int]  # an open descriptor of the file, its path, the record's offset and length


@pytest.fixture
def stored(tmp_path: Path) -> Iterator[Callable[[bytes], Record]]:
    """Writes a record between other bytes of a file and opens it (closed after the test)."""
    opened: list[int] = []

    def store(payload: bytes) -> Record:
        path = tmp_path / f"record{len(opened)}.distcp"
        path.write_bytes(PREFIX + payload + b"trailing bytes of the next record")
        opened.append(os.open(path, os.O_RDONLY))
        return opened[-1], path, len(PREFIX), len(payload)

    yield store
    for fd in opened:
        os.close(fd)


def saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def box_read(stored_record: Record, starts: list[int], lengths: list[int]) -> torch.Tensor:
    fd, path, offset, length = stored_record
    record = parse_tensor_record(fd, offset, length, "record")
    out = torch.empty(lengths, dtype=record.dtype)
    read_box(fd, path, record, starts, lengths, out, "record")
    return out


def box_of(tensor: torch.Tensor, starts: list[int], lengths: list[int]) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(starts, lengths)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


# --------------------------------------------------------------------------- reading boxes


BASE = torch.randn(6, 10, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
VIEWS = {
    # torch.save keeps a view's whole storage, its offset and its strides
    "contiguous": BASE,
    "storage offset": BASE[2:5],
    "transposed": BASE.transpose(0, 2),
    "strided slice": BASE[1:, 3:9:2, 1],
    "int64": torch.arange(60, dtype=torch.int64).reshape(5, 12)[:, 2:7],
    "scalar": torch.tensor(3.5),
}


@pytest.mark.parametrize("short_run", [1, ranges.SHORT_RUN])  # 1: every run read by itself, none gathered
@pytest.mark.parametrize("slab", [1, 8, 64, 2**20])
@pytest.mark.parametrize("name", VIEWS)
def test_every_box_of_a_stored_view_reads_back_bit_exact(stored: Callable[[bytes], Record],
                                                        monkeypatch: pytest.MonkeyPatch, name: str, slab: int,
                                                        short_run: int) -> None:
    monkeypatch.setattr(records, "SLAB_BYTES", slab)  # 1 byte: element by element
    monkeypatch.setattr(ranges, "SHORT_RUN", short_run)
    monkeypatch.setattr(ranges, "LONG_RUN", ranges.LONG_RUN if short_run > 1 else 1)  # 1: scattered
    view = VIEWS[name]
    stored_record = stored(saved(view))
    shape = list(view.shape)
    boxes = [([0] * len(shape), shape)]
    for dim, size in enumerate(shape):
        if size > 1:
            starts, lengths = [0] * len(shape), list(shape)
            starts[dim], lengths[dim] = 1, size - 2 if size > 2 else 1
            boxes.append((starts, lengths))
    for starts, lengths in boxes:
        got = box_read(stored_record, starts, lengths)
        assert got.dtype == view.dtype and torch.equal(got, box_of(view, starts, lengths)), (starts, lengths)


def test_a_box_outside_the_stored_chunk_or_of_another_dtype_is_refused(stored: Callable[[bytes], Record]) -> None:
    fd, path, offset, length = stored(saved(BASE))
    record = parse_tensor_record(fd, offset, length, "record")

    with pytest.raises(CheckpointError, match=r"record: the requested box \[5, 0, 0\] \+ \[2, 10, 4\] does not lie "
                                              r"inside the stored chunk of shape \[6, 10, 4\]"):
        read_box(fd, path, record, [5, 0, 0], [2, 10, 4], torch.empty(2, 10, 4, dtype=torch.bfloat16), "record")
    with pytest.raises(CheckpointError, match=r"record: stored as torch.bfloat16 \[6, 10, 4\], but the index "
                                              r"describes torch.float32"):
        read_box(fd, path, record, [0, 0, 0], [6, 10, 4], torch.empty(6, 10, 4), "record")


# --------------------------------------------------------------------------- malformed records


def rezipped(payload: bytes, cut_storage_to: int) -> bytes:
    """The torch.save zip ``payload`` with its storage record cut to ``cut_storage_to`` bytes."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(payload)) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = source.read(info)
            target.writestr(info.filename, data[:cut_storage_to] if "/data/" in info.filename else data)
    return out.getvalue()


def test_a_storage_record_shorter_than_its_tensor_is_named(stored: Callable[[bytes], Record]) -> None:
    tensor = torch.arange(100, dtype=torch.float32)
    fd, _, offset, length = stored(rezipped(saved(tensor), 40))

    with pytest.raises(CheckpointError, match=r"record: truncated or corrupt record \(storage '0' holds 40 bytes, "
                                              r"the tensor's storage needs 400\)"):
        parse_tensor_record(fd, offset, length, "record")


def test_bytes_that_are_not_a_torch_zip_are_named(stored: Callable[[bytes], Record]) -> None:
    fd, _, offset, length = stored(b"\0" * 200)

    with pytest.raises(CheckpointError, match=r"record: truncated or corrupt torch checkpoint"):
        parse_tensor_record(fd, offset, length, "record")
    # A record cut short: its zip directory, at its end, is gone.
    fd, _, offset, length = stored(saved(BASE))
    with pytest.raises(CheckpointError, match=r"record: truncated or corrupt torch checkpoint"):
        parse_tensor_record(fd, offset, length - 30, "record")


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_a_record_whose_pickle_runs_code_is_refused_unexecuted(tmp_path: Path,
                                                               stored: Callable[[bytes], Record]) -> None:
    marker = tmp_path / "pwned"
    fd, _, offset, length = stored(saved([torch.zeros(2), _Exploit(marker)]))

    with pytest.raises(UnsafePickleError, match=r"record: refuses to unpickle it"):
        parse_tensor_record(fd, offset, length, "record")
    assert not marker.exists()


# --------------------------------------------------------------------------- through the loader and the CLI


@pytest.fixture
def dist_checkpoint(tmp_path: Path) -> Path:
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)
    pgconvert.convert(src, tmp_path / "dist", dst_format="torch_dist", **FOR_MCORE_016)  # no manifest in front
    return tmp_path / "dist"


def write_metadata(iteration_dir: Path, metadata: object) -> None:
    (iteration_dir / ".metadata").write_bytes(pickle.dumps(metadata))


def test_a_data_file_truncated_after_the_index_was_checked_is_named(dist_checkpoint: Path) -> None:
    data = dist_checkpoint / ITERATION_DIR / "__0_0.distcp"
    source = TorchDistLoader().open(dist_checkpoint, LoadOptions())
    size = data.stat().st_size
    os.truncate(data, size // 2)

    with pytest.raises(CheckpointError, match=rf"__0_0\.distcp: '[^']+' is stored at offset \d+, length \d+, which "
                                              rf"does not lie inside the file's {size // 2} bytes"):
        source.load_shard("decoder.layers.2.self_attention.linear_qkv.weight", COLUMN, 2, 0)


def test_cli_names_a_truncated_data_file(dist_checkpoint: Path, tmp_path: Path) -> None:
    data = dist_checkpoint / ITERATION_DIR / "__0_0.distcp"
    os.truncate(data, data.stat().st_size - 1)

    result = run_cli("--dst-format", "megatron", dist_checkpoint, tmp_path / "dst")
    assert_clean_refusal(result, 1, "__0_0.distcp: truncated (", "bytes, the index needs", "at offset", "length")
    assert not (tmp_path / "dst").exists()


def test_cli_names_a_storage_entry_past_the_end_of_its_file(dist_checkpoint: Path, tmp_path: Path) -> None:
    iteration_dir = dist_checkpoint / ITERATION_DIR
    metadata = FileSystemReader(str(iteration_dir)).read_metadata()
    size = (iteration_dir / "__0_0.distcp").stat().st_size
    index, info = next((index, info) for index, info in metadata.storage_data.items()
                       if index.fqn == "embedding.word_embeddings.weight")
    info.offset = size - 10
    write_metadata(iteration_dir, metadata)

    result = run_cli("--dst-format", "megatron", iteration_dir, tmp_path / "dst")
    assert_clean_refusal(result, 1, f"__0_0.distcp: truncated ({size} bytes, the index needs {size - 10 + info.length}: "
                         f"'embedding.word_embeddings.weight' at offset {size - 10}, length {info.length})")


def test_cli_names_a_storage_entry_that_points_at_another_chunk(dist_checkpoint: Path, tmp_path: Path) -> None:
    iteration_dir = dist_checkpoint / ITERATION_DIR
    metadata = FileSystemReader(str(iteration_dir)).read_metadata()
    entries = {index.fqn: info for index, info in metadata.storage_data.items()}
    embedding, norm = entries["embedding.word_embeddings.weight"], entries["decoder.final_layernorm.weight"]
    norm.offset, norm.length = embedding.offset, embedding.length
    write_metadata(iteration_dir, metadata)

    result = run_cli("--dst-format", "megatron", iteration_dir, tmp_path / "dst")
    assert_clean_refusal(result, 1, "'decoder.final_layernorm.weight' (offset", "stored as torch.float32 [1024, 64], "
                         "but the index describes the chunk at [0] as torch.float32 [64]")


# --------------------------------------------------------------------------- memory


MEASURE = """
import json, sys
from pathlib import Path
import torch
from pgconvert.formats.dcp_store import DcpStore
from pgconvert.formats.torch_dist import read_dcp_metadata

def status(field):
    with open("/proc/self/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(field + ":"))

directory = Path(sys.argv[1])
metadata = read_dcp_metadata(directory / ".metadata")
store = DcpStore(directory, metadata)
rows, cols = metadata.state_dict_metadata["w"].size
results = []
for offsets, shape, out in (((rows // 2, 0), (rows // 2, cols), "rows.pt"), ((0, cols // 2), (rows, cols // 2), "cols.pt")):
    buffer = torch.empty(shape)
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # the peak (VmHWM) starts again from the current RSS
    before = status("VmRSS")
    store.read({"w": [(offsets, buffer)]}, [])
    results.append(status("VmHWM") - before)
    torch.save(buffer, directory.parent / out)
    del buffer
print(json.dumps(results))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_reading_half_a_record_holds_the_half_not_the_record(tmp_path: Path) -> None:
    # One stored chunk of 64 MiB; each read is half of it: the top rows (contiguous in the file) or
    # the right columns (a run in every row: every page of the record is touched).
    weight = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": weight}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pytest.skip("this kernel does not reset the peak RSS (/proc/self/clear_refs)")

    result = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "dcp")], capture_output=True, text=True,
                            timeout=300, check=True)
    peaks = json.loads(result.stdout.strip().splitlines()[-1])

    piece = weight.nbytes // 2
    # torch's own reader loads the whole record first: piece + 64 MiB. Here: the piece (a slab of scratch
    # at most, were its runs gathered).
    assert all(peak <= piece + records.SLAB_BYTES + 8 * 2**20 for peak in peaks), peaks
    assert torch.equal(torch.load(tmp_path / "rows.pt", weights_only=True), weight[2048:])
    assert torch.equal(torch.load(tmp_path / "cols.pt", weights_only=True), weight[:, 2048:])
