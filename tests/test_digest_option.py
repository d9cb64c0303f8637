"""``--digest``: the manifest records each file's digest labelled with its algorithm (xxh3-128 by default,
sha256 on request); ``none`` records sizes only, no file is hashed or read back, and every check that reads the
manifest falls back to sizes (verify still compares every tensor). A manifest written before digests named their
algorithm (a bare ``sha256`` field) is read and checked as before."""

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
    monkeypatch.setattr(output, "new_hasher", lambda algorithm: pytest.fail("hashed with digests off"))
    data = bytes(range(256)) * 70000
    with digests(None), OutputFile(tmp_path / "out.bin") as out:
        out.write(data)
    assert (tmp_path / "out.bin").read_bytes() == data
    assert out.hexdigest() is None and out.size == len(data)


def test_digest_none_records_sizes_and_reads_no_file_back(source: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest, "hash_file", lambda path, relpath, algorithm: pytest.fail(f"read back {relpath}"))
    monkeypatch.setattr(output, "new_hasher", lambda algorithm: pytest.fail("hashed with --digest none"))
    dst = tmp_path / "dst"
    _convert(source, dst, "--digest", "none")
    doc = json.loads((dst / MANIFEST_FILE).read_text())
    files = {item["path"]: item for item in doc["files"]}
    assert files and all(item["digest"] is None for item in files.values())
    assert all(item["size"] == (dst / path).stat().st_size for path, item in files.items())


@pytest.mark.parametrize("digest", ["none", "sha256", "xxh3-128"])
def test_a_worker_writes_its_files_hashed_as_the_request_says(source: Path, tmp_path: Path, digest: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from pgconvert.run.convert import ConvertRequest, plan
    from pgconvert.run.workers import write_files

    hashed: list[str] = []
    real = output.new_hasher
    monkeypatch.setattr(output, "new_hasher", lambda algorithm: (hashed.append(algorithm), real(algorithm))[1])
    request = ConvertRequest(src=source, dst=tmp_path / "dst", dst_tp=1, digest=digest)
    planned = plan(request)
    relpaths = [item.relpath for item in planned.files]
    planned.source.close()
    files, _ = write_files(request, str(tmp_path / "staging"), relpaths, plan)
    assert [item.digest is None for item in files] == [digest == "none"] * len(relpaths)
    assert hashed == ([] if digest == "none" else [digest] * len(relpaths))
    assert all(item.digest is None or item.digest.startswith(f"{digest}:") for item in files)


def _expected(algorithm: str, data: bytes) -> str:
    import hashlib

    import xxhash

    hexdigest = xxhash.xxh3_128(data).hexdigest() if algorithm == "xxh3-128" else hashlib.sha256(data).hexdigest()
    return f"{algorithm}:{hexdigest}"


@pytest.mark.parametrize("option", [(), ("--digest", "sha256")], ids=["default", "sha256"])
def test_each_file_is_recorded_with_the_digest_of_its_bytes_labelled_by_algorithm(source: Path, tmp_path: Path,
                                                                                  option: tuple[str, ...]) -> None:
    dst = tmp_path / "dst"
    _convert(source, dst, *option)
    algorithm = option[1] if option else "xxh3-128"
    record = read_manifest(dst)
    assert record is not None and record.files
    assert [item.digest for item in record.files] == [
        _expected(algorithm, (dst / item.path).read_bytes()) for item in record.files]
    assert file_problems(dst, record) == []


def test_a_manifest_with_bare_sha256_fields_is_read_and_checked(source: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    _convert(source, dst, "--digest", "sha256")
    path = dst / MANIFEST_FILE
    doc = json.loads(path.read_text())
    for item in doc["files"]:  # as pgconvert wrote it before digests named their algorithm
        item["sha256"] = item.pop("digest").removeprefix("sha256:")
    path.write_text(json.dumps(doc))
    record = read_manifest(dst)
    assert record is not None and all(item.digest and item.digest.startswith("sha256:") for item in record.files)
    assert file_problems(dst, record) == []
    rank_file = next(dst.rglob("model_optim_rng.pt"))
    data = bytearray(rank_file.read_bytes())
    data[-1] ^= 1
    rank_file.write_bytes(bytes(data))
    assert [problem.split(": ")[1].split(" ")[0] for problem in file_problems(dst, record)] == ["digest"]


@pytest.mark.parametrize("value", ["md5:" + "0" * 32, "xxh3-128:" + "0" * 64, "sha256:" + "G" * 64, "0" * 64])
def test_a_recorded_digest_that_is_not_a_known_labelled_one_is_a_named_error(source: Path, tmp_path: Path,
                                                                             value: str) -> None:
    from pgconvert.errors import CheckpointError

    dst = tmp_path / "dst"
    _convert(source, dst, "--digest", "none")
    path = dst / MANIFEST_FILE
    doc = json.loads(path.read_text())
    doc["files"][0]["digest"] = value
    path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"files\[0\]: digest '.*': (the algorithm must be one of|a )"):
        read_manifest(dst)


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


def test_carried_optimizer_files_are_hashed_as_written_and_never_read_back(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron-LM's own distributed-optimizer run to TP1: ``distrib_optim.pt`` and the rewritten rank file are
    recorded with the digest computed while they were written (a file read back to be hashed would double the
    cost of carrying optimizer state, which is most of a training checkpoint's bytes)."""
    source = Path(__file__).parent / "data" / "megatron_lm" / "train_tp2dp2_distopt_bf16_torch"
    reread: list[str] = []
    real = manifest.hash_file
    monkeypatch.setattr(manifest, "hash_file", lambda path, relpath, algorithm: (
        reread.append(relpath), real(path, relpath, algorithm))[1])
    dst = tmp_path / "dst"
    _convert(source, dst)
    record = read_manifest(dst)
    assert record is not None
    optimizer_files = [item.path for item in record.files if item.path.endswith("distrib_optim.pt")]
    assert optimizer_files and not [path for path in reread if path.endswith(".pt")]
    assert [item.digest for item in record.files] == [
        _expected("xxh3-128", (dst / item.path).read_bytes()) for item in record.files]
