"""The DCP plan and metadata types the writers use in place of torch.distributed.checkpoint's: the global plan and
``.metadata`` they make are torch's own, byte for byte, and writing a store imports none of torch's checkpoint
package."""

from __future__ import annotations

import pickle
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint
from support.tiny_models import GQA_SWIGLU
from support.optimizer_cli import rewrite_metadata
from support.torch_dcp_save import torch_item
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import SavePlan as TorchSavePlan

from pgconvert import convert
from pgconvert.errors import CheckpointError, PgconvertError
from pgconvert.formats.torch_dist import read_dcp_metadata
from pgconvert.io import dcp_plan
from pgconvert.io.sizes import nbytes

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.float8_e4m3fn, torch.uint8]


def random_plan(seed: int) -> tuple[list[dcp_plan.WriteItem], dict[str, tuple[str, ...]] | None]:
    """Keys of random rank in chunks along their first dimension (one chunk or several), scalars, bytes entries."""
    rng = random.Random(seed)
    items = []
    for number in range(rng.randint(1, 12)):
        key = f"module.layer_{number}.weight"
        if rng.random() < 0.2:
            items.append(dcp_plan.bytes_item(key + "/extra"))
        shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(0, 3)))
        dtype = rng.choice(DTYPES)
        cuts = sorted(rng.sample(range(1, shape[0]), rng.randint(0, shape[0] - 1))) if shape and shape[0] > 1 else []
        for start, end in zip([0, *cuts], [*cuts, shape[0] if shape else 0], strict=True):
            offsets = (start, *(0 for _ in shape[1:])) if shape else ()
            sizes = (end - start, *shape[1:]) if shape else ()
            items.append(dcp_plan.tensor_item(key, offsets, sizes, shape, dtype))
    planner_data = {item.index.fqn: tuple(item.index.fqn.split(".")) for item in items} if seed % 2 else None
    return items, planner_data


def record_length(item: dcp_plan.WriteItem | object) -> int:
    """A length each item's record could have: its values and an archive's worth of bytes around them."""
    data = getattr(item, "tensor_data")
    if data is None:
        return 100
    return nbytes(tuple(data.chunk.sizes), data.properties.dtype) + 1000


def finished(items: list[dcp_plan.WriteItem], metadata: dcp_plan.Metadata) -> dcp_plan.Metadata:
    """``metadata`` as the writer finishes it: each item laid out after the one before in one data file."""
    name = "__0_0.distcp"
    offsets = [0]
    for item in items:
        offsets.append(offsets[-1] + record_length(item))
    metadata.version = dcp_plan.DCP_VERSION
    metadata.storage_data = {item.index: dcp_plan.StorageInfo(name, start, end - start)
                             for item, start, end in zip(items, offsets, offsets[1:])}
    metadata.storage_meta = dcp_plan.StorageMeta()
    return metadata


def torch_finished(items: list[dcp_plan.WriteItem], planner_data: dict[str, tuple[str, ...]] | None) -> Any:
    """The same plan made global by torch's own planner, finished as torch's ``FileSystemWriter`` finishes it."""
    plans, metadata = create_default_global_save_plan([TorchSavePlan([torch_item(item) for item in items])])
    if planner_data is not None:
        metadata.planner_data = dict(planner_data)
    name = "__0_0.distcp"
    offsets = [0]
    for item in plans[0].items:
        offsets.append(offsets[-1] + record_length(item))
    metadata.version = "1.0.0"
    metadata.storage_data = {item.index: _StorageInfo(name, start, end - start)
                             for item, start, end in zip(plans[0].items, offsets, offsets[1:])}
    metadata.storage_meta = StorageMeta()
    return metadata


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("pickler", ["python", "torch_classes"])
def test_metadata_of_a_plan_is_the_pickle_torchs_planner_and_writer_make(seed: int, pickler: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways ``dump_metadata`` pickles (Python's pickler under torch's names, or, for a large store, C's on
    torch's own objects) give torch's bytes."""
    if pickler == "torch_classes":
        monkeypatch.setattr(dcp_plan, "PURE_PYTHON_ENTRIES", 0)
    items, planner_data = random_plan(seed)
    global_items, metadata = dcp_plan.global_save_plan(dcp_plan.SavePlan(items, planner_data=planner_data))

    ours = dcp_plan.dump_metadata(finished(global_items, metadata))
    assert ours == pickle.dumps(torch_finished(items, planner_data))
    # Read back with torch's classes, and the chunk index hints torch's planner gives.
    loaded = pickle.loads(ours)
    assert type(loaded).__module__ == "torch.distributed.checkpoint.metadata"
    assert [index.index for index in loaded.storage_data] == [item.index.index for item in global_items]


def test_entries_added_to_a_metadata_read_back_pickle_as_torchs_own(tmp_path: Path) -> None:
    """A ``.metadata`` read into pgconvert's types pickles back to its bytes, and with the optimizer records' index
    merged into it (``_merge_metadata``), to the pickle of the same merge of torch's own objects."""
    model, _ = random_plan(3)
    records = [dcp_plan.tensor_item("optimizer." + item.index.fqn, item.tensor_data.chunk.offsets,
                                    item.tensor_data.chunk.sizes, item.tensor_data.size, torch.float32)
               for item in random_plan(4)[0] if item.tensor_data is not None]
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(torch_finished(model, None)))

    theirs = pickle.loads(path.read_bytes())  # torch's classes, as torch's reader unpickles it
    added = torch_finished(records, None)
    theirs.state_dict_metadata.update(added.state_dict_metadata)
    theirs.storage_data.update(added.storage_data)
    ours = read_dcp_metadata(path)
    assert dcp_plan.dump_metadata(ours) == path.read_bytes()
    added = finished(*dcp_plan.global_save_plan(dcp_plan.SavePlan(records)))
    ours.state_dict_metadata.update(added.state_dict_metadata)
    ours.storage_data.update(added.storage_data)
    assert dcp_plan.dump_metadata(ours) == pickle.dumps(theirs)


@pytest.mark.parametrize(("offsets", "sizes", "message"), [
    ((0, 0), (4, 5), "is not inside its shape"),
    ((2, 0), (3, 4), "is not inside its shape"),
    ((0, 0), (3, 4), "hold 12 elements; its shape"),
])
def test_a_plan_whose_chunks_do_not_tile_their_tensor_is_refused(offsets: tuple[int, ...], sizes: tuple[int, ...],
                                                                 message: str) -> None:
    item = dcp_plan.tensor_item("w", offsets, sizes, (4, 4), torch.bfloat16)
    with pytest.raises(PgconvertError, match=message):
        dcp_plan.global_save_plan(dcp_plan.SavePlan([item]))


def test_a_key_planned_as_bytes_twice_is_refused() -> None:
    with pytest.raises(PgconvertError, match="holds 'w' twice"):
        dcp_plan.global_save_plan(dcp_plan.SavePlan([dcp_plan.bytes_item("w"), dcp_plan.bytes_item("w")]))


_CONVERT_AND_LIST_IMPORTS = """
import sys
import pgconvert
pgconvert.convert(sys.argv[1], sys.argv[2], dst_format=sys.argv[3], dst_tp=1)
print(sorted(name for name in sys.modules if name.startswith("torch.distributed.checkpoint")))
"""
GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
# Megatron-LM's own runs: TP2 DP2 with the distributed optimizer (its state is written as the optimizer records,
# and the common state rewritten in the store, of a torch_dist target, and into an fsdp_dtensor target's store),
# and the same with Megatron-FSDP (an fsdp_dtensor store read with its optimizer state).
OPTIMIZER_RUN = GOLDENS / "train_tp2dp2_distopt_bf16_torch"
FSDP_RUN = GOLDENS / "train_tp2dp2_fsdp_dtensor_optim"


def _imports_of(src: Path, dst: Path, dst_format: str) -> str:
    done = subprocess.run([sys.executable, "-c", _CONVERT_AND_LIST_IMPORTS, str(src), str(dst), dst_format],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(("source", "dst_format"), [("model", "torch_dist"), ("model", "fsdp_dtensor"),
                                                    ("optimizer", "torch_dist"), ("optimizer", "fsdp_dtensor")])
def test_writing_a_store_imports_no_torch_distributed_checkpoint(tmp_path: Path, source: str, dst_format: str) -> None:
    """The package costs most of a second to import (DTensor, sympy): a writer has no need of it."""
    src = OPTIMIZER_RUN if source == "optimizer" else write_megatron_checkpoint(
        tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)
    assert _imports_of(src, tmp_path / "dst", dst_format) == "[]"
    metadata = next((tmp_path / "dst").rglob(".metadata"))
    if source == "optimizer":
        assert any("optimizer" in key or "exp_avg" in key for key in read_dcp_metadata(metadata).state_dict_metadata)


@pytest.mark.parametrize("source", ["torch_dist", "fsdp_dtensor"])
def test_reading_a_store_imports_no_torch_distributed_checkpoint(tmp_path: Path, source: str) -> None:
    """A torch_dist source (with its optimizer records) and an fsdp_dtensor one read into per-rank files."""
    if source == "torch_dist":
        src = tmp_path / "src"
        assert _imports_of(OPTIMIZER_RUN, src, "torch_dist") == "[]"
    else:
        src = FSDP_RUN
    assert _imports_of(src, tmp_path / "dst", "megatron") == "[]"
    assert any((tmp_path / "dst").rglob("model_optim_rng.pt"))
    assert any((tmp_path / "dst").rglob("distrib_optim.pt"))


def test_a_record_stored_transformed_is_refused_by_name(tmp_path: Path) -> None:
    """torch can store a record compressed (its ``_extensions``); pgconvert reads records as they are, and says so."""
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 1, 1)
    convert(src, tmp_path / "dist", dst_format="torch_dist")
    iteration = next((tmp_path / "dist").rglob(".metadata")).parent

    def compressed(metadata: Any) -> None:
        index = next(index for index in metadata.storage_data if index.fqn == "embedding.word_embeddings.weight")
        metadata.storage_data[index].transform_descriptors = ["zstd"]

    rewrite_metadata(iteration, compressed)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: 'embedding\.word_embeddings\.weight' is stored "
                                              r"transformed \(\['zstd'\]\)"):
        convert(tmp_path / "dist", tmp_path / "out", dst_format="megatron")
    assert not (tmp_path / "out").exists()
