"""pgconvert.json: written into every complete output, never into an interrupted one, and checked by verify."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from pathlib import Path

import pytest
import torch
import xxhash
from click.testing import CliRunner
from support.tiny_models import GQA_SWIGLU
from support.megatron_fixtures import load_for_test, make_full_model, write_megatron_checkpoint

import pgconvert
from pgconvert.cli import main
from pgconvert.model.config import ModelConfig
from pgconvert.errors import CheckpointError
from pgconvert.run.manifest import MANIFEST_FILE, file_problems, read_manifest
from pgconvert.formats.names import saver_names

# The destination layout each format takes from a TP2 Megatron source (hf holds one unsharded model).
TARGET_LAYOUTS = {"megatron": "tp=4,pp=2", "hf": "tp=1,pp=1"}
TARGET_FORMATS = [name for name in saver_names() if name in TARGET_LAYOUTS]


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU, seed=4), 2, 1,
                                     iteration=100)


def _files_on_disk(root: Path) -> dict[str, tuple[int, str]]:
    return {
        path.relative_to(root).as_posix(): (path.stat().st_size, "xxh3-128:" + xxhash.xxh3_128(path.read_bytes()).hexdigest())
        for path in sorted(root.rglob("*")) if path.is_file() and path.name != MANIFEST_FILE
    }


@pytest.mark.parametrize("dst_format", TARGET_FORMATS)
def test_every_output_has_a_manifest_describing_the_conversion_and_each_written_file(
        source: Path, tmp_path: Path, dst_format: str) -> None:
    dst = tmp_path / "dst"

    report = pgconvert.convert(source, dst, dst_format=dst_format, dst_layout=TARGET_LAYOUTS[dst_format])

    doc = json.loads((dst / MANIFEST_FILE).read_text())
    assert doc["tool_version"] == pgconvert.__version__
    assert doc["created"].endswith("+00:00")
    assert doc["source"] == {
        "path": str(source.resolve()), "format": "megatron",
        "layout": dataclasses.asdict(pgconvert.ParallelLayout(tp=2)), "iteration": 100, "release": False,
        "requested_iteration": None,
    }
    target = pgconvert.LayoutSpec.parse(TARGET_LAYOUTS[dst_format])
    assert doc["target"] == {"format": dst_format,
                             "layout": dataclasses.asdict(pgconvert.ParallelLayout(**target.given()))}
    assert doc["options"]["dtype"] == "keep"
    assert ModelConfig(**doc["model_config"]).vocab_size == 1000
    listed = {item["path"]: (item["size"], item["digest"]) for item in doc["files"]}
    assert listed == _files_on_disk(dst)
    assert {item.relpath for item in report.files} <= set(listed)


def test_manifest_records_the_dtype_option_and_round_trips(source: Path, tmp_path: Path) -> None:
    pgconvert.convert(source, tmp_path / "dst", dtype="bf16", iteration=100)

    manifest = read_manifest(tmp_path / "dst")

    assert manifest is not None
    assert manifest.options["dtype"] == "bf16"
    assert manifest.requested_iteration == 100
    assert manifest.model_config["params_dtype"] == "bfloat16"
    assert manifest.target_parallel_layout == pgconvert.ParallelLayout(tp=2)
    assert pgconvert.Manifest.from_dict(manifest.to_dict(), tmp_path / "x") == manifest


@pytest.mark.parametrize(("edit", "message"), [
    (lambda doc: doc.pop("created"), r"pgconvert.json: created is missing"),
    (lambda doc: doc["files"][0].update(size="12"), r"pgconvert.json: files\[0\].size='12' must be int"),
    (lambda doc: doc.update(manifest_version=7), r"manifest_version 7 is not supported"),
], ids=["missing-field", "wrong-type", "future-version"])
def test_a_malformed_manifest_is_refused_naming_the_field(source: Path, tmp_path: Path, edit: object,
                                                          message: str) -> None:
    dst = tmp_path / "dst"
    pgconvert.convert(source, dst)
    doc = json.loads((dst / MANIFEST_FILE).read_text())
    edit(doc)  # type: ignore[operator]
    (dst / MANIFEST_FILE).write_text(json.dumps(doc))

    with pytest.raises(CheckpointError, match=message):
        read_manifest(dst)


def test_verify_fails_naming_a_file_modified_after_conversion(source: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    pgconvert.convert(source, dst, dst_tp=4)
    # Still a valid checkpoint with the same tensors: only the manifest can tell.
    (dst / "latest_checkpointed_iteration.txt").write_text("100\n")

    report = pgconvert.verify(source, dst)
    result = CliRunner().invoke(main, ["verify", str(source), str(dst)])

    assert report.differences == []
    assert not report.equal
    assert len(report.file_problems) == 1
    assert "latest_checkpointed_iteration.txt: 4 bytes, pgconvert.json records 3" in report.file_problems[0]
    assert result.exit_code == 1, result.output
    assert "file differs: " in result.output and "latest_checkpointed_iteration.txt" in result.output


def test_verify_names_a_rewritten_rank_file_and_the_replica_it_broke(source: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    pgconvert.convert(source, dst, dst_tp=4)
    rank_file = dst / "iter_0000100" / "mp_rank_02" / "model_optim_rng.pt"
    state = load_for_test(rank_file)
    state["model"]["decoder.final_layernorm.weight"][7] += 1.0
    torch.save(state, rank_file)

    report = pgconvert.verify(dst, source)

    assert len(report.file_problems) == 1
    assert "iter_0000100/mp_rank_02/model_optim_rng.pt" in report.file_problems[0]
    # The replicas of the final norm now disagree between ranks: the loader refuses the tensor.
    assert [(d.name, d.kind) for d in report.differences] == [("decoder.final_layernorm.weight", "unreadable")]
    assert "mp_rank_02" in report.differences[0].message


def test_a_same_size_change_is_caught_by_the_digest_and_missed_by_the_size_only_check(
        source: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    pgconvert.convert(source, dst, dst_tp=4)
    rank_file = dst / "iter_0000100" / "mp_rank_01" / "model_optim_rng.pt"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    rank_file.write_bytes(bytes(data))
    manifest = read_manifest(dst)
    assert manifest is not None

    with_hashes = file_problems(dst, manifest, hashes=True)
    sizes_only = file_problems(dst, manifest, hashes=False)

    assert len(with_hashes) == 1 and with_hashes[0].startswith("iter_0000100/mp_rank_01/model_optim_rng.pt: digest xxh3-128:")
    assert sizes_only == []


def test_a_conversion_interrupted_before_the_rename_leaves_no_manifest_anywhere(
        source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "out" / "dst"
    seen_in_staging: list[bool] = []
    real_rename = pathlib.Path.rename

    def interrupted_rename(self: Path, target: str | Path) -> Path:
        if Path(target) == dst.absolute():
            seen_in_staging.append((self / MANIFEST_FILE).is_file())
            raise KeyboardInterrupt
        return real_rename(self, target)

    monkeypatch.setattr(pathlib.Path, "rename", interrupted_rename)

    with pytest.raises(KeyboardInterrupt):
        pgconvert.convert(source, dst, dst_tp=4)

    assert seen_in_staging == [True]  # written into the staging directory, just before the rename
    assert not dst.exists()
    assert list(tmp_path.rglob(MANIFEST_FILE)) == []
    assert list((tmp_path / "out").iterdir()) == []


def test_a_conversion_failing_in_the_saver_leaves_no_manifest(
        source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pgconvert.savers.megatron as megatron_saver  # rank files go through its stream writer

    real_save = megatron_saver.save_stream
    calls: list[object] = []

    def failing_save(obj: object, path: object, *args: object, **kwargs: object) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(path))
        real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(megatron_saver, "save_stream", failing_save)

    with pytest.raises(pgconvert.PgconvertError, match="No space left on device"):
        pgconvert.convert(source, tmp_path / "dst", dst_tp=4)

    assert not (tmp_path / "dst").exists()
    assert [path for path in tmp_path.rglob(MANIFEST_FILE)] == []
