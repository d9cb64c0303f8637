"""``--digest none``: the manifest records sizes only, no file is hashed or read back, and every check that
reads the manifest falls back to sizes (verify still compares every tensor)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint
from support.tiny_models import GQA_SWIGLU

import pgconvert.io.output as output
import pgconvert.run.manifest as manifest
from pgconvert.cli import main
from pgconvert.io.output import OutputFile, digests
from pgconvert.run.manifest import MANIFEST_FILE, file_problems, read_manifest


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digest")
    return write_megatron_checkpoint(root / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU, seed=5), 2, 1)


def _convert(source: Path, dst: Path, *extra: str) -> None:
    result = CliRunner().invoke(main, ["--quiet", "--dst-tp", "1", *extra, str(source), str(dst)])
    assert result.exit_code == 0, result.output


def test_an_output_file_without_digests_is_written_whole_and_hashes_nothing(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output, "sha256", lambda: pytest.fail("hashed with digests off"))
    data = bytes(range(256)) * 70000
    with digests(False), OutputFile(tmp_path / "out.bin") as out:
        out.write(data)
    assert (tmp_path / "out.bin").read_bytes() == data
    assert out.hexdigest() is None and out.size == len(data)


def test_digest_none_records_sizes_and_reads_no_file_back(source: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest, "hash_file", lambda path, relpath: pytest.fail(f"read back {relpath}"))
    monkeypatch.setattr(output, "sha256", lambda: pytest.fail("hashed with --digest none"))
    dst = tmp_path / "dst"
    _convert(source, dst, "--digest", "none")
    doc = json.loads((dst / MANIFEST_FILE).read_text())
    files = {item["path"]: item for item in doc["files"]}
    assert files and all(item["sha256"] is None for item in files.values())
    assert all(item["size"] == (dst / path).stat().st_size for path, item in files.items())


@pytest.mark.parametrize("digest", ["none", "sha256"])
def test_a_worker_writes_its_files_hashed_as_the_request_says(source: Path, tmp_path: Path, digest: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from pgconvert.run.convert import ConvertRequest, plan
    from pgconvert.run.workers import write_files

    hashed: list[int] = []
    real = output.sha256
    monkeypatch.setattr(output, "sha256", lambda: (hashed.append(1), real())[1])
    request = ConvertRequest(src=source, dst=tmp_path / "dst", dst_tp=1, digest=digest)
    planned = plan(request)
    relpaths = [item.relpath for item in planned.files]
    planned.source.close()
    files, _ = write_files(request, str(tmp_path / "staging"), relpaths, plan)
    assert [item.sha256 is None for item in files] == [digest == "none"] * len(relpaths)
    assert len(hashed) == (0 if digest == "none" else len(relpaths))


def test_the_default_records_each_files_sha256(source: Path, tmp_path: Path) -> None:
    import hashlib

    dst = tmp_path / "dst"
    _convert(source, dst)
    record = read_manifest(dst)
    assert record is not None and record.files
    for item in record.files:
        assert item.sha256 == hashlib.sha256((dst / item.path).read_bytes()).hexdigest()


def test_a_size_only_manifest_is_checked_by_size_and_verify_still_compares_tensors(source: Path,
                                                                                   tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    _convert(source, dst, "--digest", "none")
    record = read_manifest(dst)
    assert record is not None
    assert file_problems(dst, record) == []
    rank_file = next(dst.rglob("model_optim_rng.pt"))
    with open(rank_file, "ab") as handle:
        handle.write(b"x")
    assert [problem.split(":")[0] for problem in file_problems(dst, record)] == [
        rank_file.relative_to(dst).as_posix()]
    result = CliRunner().invoke(main, ["verify", str(source), str(dst)])
    assert result.exit_code != 0 and "bytes" in result.output


def test_an_unknown_digest_is_an_argument_error(source: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["--digest", "md5", "--dst-tp", "1", str(source), str(tmp_path / "dst")])
    assert result.exit_code == 2 and "md5" in result.output and not (tmp_path / "dst").exists()
