"""torch_dist in megatron-core 0.19's form: the common state inside the DCP store (``--dst-torch-dist-common store``)
and the ``integrity.json`` SHA-256 manifest, written (with ``--digest sha256``, or when the source has one) and
checked.

The files are read back by torch.distributed.checkpoint alone (``support.checkpoint_compare.read_common``, what
megatron-core 0.19's ``load_common_state_dict`` does) and the manifest is recomputed with hashlib; megatron-core
0.19.2 itself loads these outputs in ``test_torch_dist_mcore019.py`` (where its venv exists).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.checkpoint_compare import integrity_manifest_of, read_common, read_dcp
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint
from support.tiny_models import GQA_SWIGLU
from torch.distributed.checkpoint import BytesStorageMetadata

import pgconvert
from pgconvert.cli import main
from pgconvert.errors import CheckpointError, IntegrityError
from pgconvert.formats import LoadOptions
from pgconvert.formats.registry import get_loader

ITERATION = "iter_0000100"
TRAINED = Path(__file__).parent / "data" / "megatron_lm" / "train_tp2pp2_torch"  # Megatron-LM's own training run


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("src")
    return write_megatron_checkpoint(root / "megatron", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)


def to_torch_dist(src: Path, dst: Path, common: str = "store", **options: object) -> Path:
    """``src`` as torch_dist in ``dst``; with sha256 digests (so with the integrity manifest) unless ``options``
    name another ``digest``."""
    pgconvert.convert(src, dst, dst_format="torch_dist", dst_torch_dist_common=common,
                      **{"digest": "sha256", **options})
    return dst


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_store_keeps_the_common_state_inside_the_checkpoint_with_megatron_cores_manifest(megatron: Path,
                                                                                         tmp_path: Path) -> None:
    out = to_torch_dist(megatron, tmp_path / "dist", dst_tp=1)

    iteration_dir = out / ITERATION
    assert not (iteration_dir / "common.pt").exists()
    metadata, _ = read_dcp(iteration_dir)
    assert isinstance(metadata.state_dict_metadata["common_state/shard_0_1"], BytesStorageMetadata)
    common = read_common(iteration_dir)
    assert sorted(common) == ["args", "checkpoint_version", "content_metadata", "iteration"]
    assert common["iteration"] == 100 and common["args"].tensor_model_parallel_size == 1
    assert common["content_metadata"] == {"distrib_optim_sharding_type": "dp_reshardable",
                                          "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    assert (iteration_dir / "integrity.json").read_text() == integrity_manifest_of(iteration_dir)
    assert pgconvert.verify(megatron, out).equal


@pytest.mark.parametrize("places", [("legacy",), ("store",), ("store", "legacy")], ids=["common.pt", "store", "both"])
def test_the_common_state_is_read_from_common_pt_first_else_from_the_store(megatron: Path, tmp_path: Path,
                                                                          places: tuple[str, ...]) -> None:
    out = to_torch_dist(megatron, tmp_path / "dist", places[0])
    iteration_dir = out / ITERATION
    if len(places) == 2:  # a common.pt beside the stored state, telling apart: megatron-core 0.19 reads common.pt
        common = read_common(iteration_dir)
        common["iteration"] = 4242
        torch.save(common, iteration_dir / "common.pt")

    source = get_loader("torch_dist").open(out, LoadOptions())
    try:
        assert source.common_state["iteration"] == (4242 if len(places) == 2 else 100)
        assert source.megatron_args.tensor_model_parallel_size == 2
    finally:
        source.close()
    assert pgconvert.verify(megatron, out).equal


def test_optimizer_state_goes_into_the_store_and_the_manifest_follows_it(tmp_path: Path) -> None:
    out = to_torch_dist(TRAINED, tmp_path / "dist", dst_tp=1, dst_pp=1)

    (iteration_dir,) = out.glob("iter_*")
    assert not (iteration_dir / "common.pt").exists()
    common = read_common(iteration_dir)
    # The run's plain (non-distributed) optimizer: its param groups join the stored common state, which the
    # optimizer writer rewrote after the model's finalize (its length in .metadata with it).
    assert sorted(common["optimizer"]) == ["param_groups", "state"] and common["optimizer"]["param_groups"]
    assert (iteration_dir / "__1_0.distcp").is_file()  # the optimizer's records
    assert common["args"].tensor_model_parallel_size == 1
    assert (iteration_dir / "integrity.json").read_text() == integrity_manifest_of(iteration_dir)
    report = pgconvert.verify(TRAINED, out)
    assert report.equal and report.optimizer is not None and report.optimizer.compared > 0


def test_a_changed_data_byte_is_named_with_both_digests_by_verify_integrity(megatron: Path, tmp_path: Path) -> None:
    out = to_torch_dist(megatron, tmp_path / "dist")
    data = out / ITERATION / "__0_0.distcp"
    expected = hashlib.sha256(data.read_bytes()).hexdigest()
    flip_byte(data, data.stat().st_size // 2)
    actual = hashlib.sha256(data.read_bytes()).hexdigest()

    with pytest.raises(IntegrityError) as raised:
        pgconvert.convert(out, tmp_path / "back", dst_format="megatron", verify_integrity=True)
    assert str(data) in str(raised.value) and expected in str(raised.value) and actual in str(raised.value)
    assert not (tmp_path / "back").exists()

    result = CliRunner().invoke(main, ["-q", "--verify-integrity", "--dst-format", "megatron", str(out),
                                       str(tmp_path / "cli")])
    assert result.exit_code == 1 and "integrity check failed" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "cli").exists()

    report = pgconvert.verify(megatron, out)
    assert not report.equal
    assert any(str(data) in problem and expected in problem and actual in problem for problem in report.file_problems)


def test_reading_re_hashes_the_small_files_and_requires_the_data_files(megatron: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """By default a source's .metadata, metadata.json and common state are re-hashed and its data files only
    required to be there; --verify-integrity re-hashes those too."""
    import pgconvert.formats.torch_dist_integrity as integrity

    out = to_torch_dist(megatron, tmp_path / "dist")
    directory = out / ITERATION
    hashed: list[set[str]] = []
    real = integrity.files_sha256

    def recording(paths: object) -> dict[Path, str]:
        found = real(paths)  # type: ignore[arg-type]
        hashed.append({path.name for path in found})
        return found

    monkeypatch.setattr(integrity, "files_sha256", recording)
    get_loader("torch_dist").open(out, LoadOptions())
    get_loader("torch_dist").open(out, LoadOptions(verify_integrity="full"))
    listed = set(json.loads((directory / "integrity.json").read_text())["files"])
    data = {name for name in listed if name.endswith(".distcp")}
    assert data and hashed == [listed - data, listed]

    metadata = directory / ".metadata"
    flip_byte(metadata, metadata.stat().st_size // 2)
    with pytest.raises(IntegrityError, match=r"\.metadata: sha256"):
        pgconvert.convert(out, tmp_path / "back", dst_format="megatron")
    flip_byte(metadata, metadata.stat().st_size // 2)
    (directory / sorted(data)[0]).unlink()
    with pytest.raises(IntegrityError, match="listed in integrity.json .* but missing"):
        pgconvert.convert(out, tmp_path / "back", dst_format="megatron")
    assert not (tmp_path / "back").exists()


def test_files_are_hashed_alike_one_or_several_at_a_time(megatron: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import pgconvert.formats.torch_dist_integrity as integrity

    directory = to_torch_dist(megatron, tmp_path / "dist", max_shard_size=20000) / ITERATION
    data = sorted(directory.glob("__0_*.distcp"))
    assert len(data) >= 3
    texts = []
    for threads in (1, 4):
        monkeypatch.setattr(integrity, "HASH_THREADS", threads)
        texts.append(integrity.manifest_text(directory))
    assert texts[0] == texts[1] == integrity_manifest_of(directory) == (directory / "integrity.json").read_text()
    for path in (data[0], data[-1]):
        flip_byte(path, path.stat().st_size // 2)
    present, problems = integrity.integrity_problems(directory)
    assert present and [problem.split(":")[0] for problem in problems] == [str(data[0]), str(data[-1])]


def test_a_manifest_that_lies_or_names_a_missing_file_is_refused(megatron: Path, tmp_path: Path) -> None:
    out = to_torch_dist(megatron, tmp_path / "dist")
    manifest_path = out / ITERATION / "integrity.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["metadata.json"] = "0" * 64
    manifest["files"]["__9_9.distcp"] = "1" * 64
    manifest_path.write_text(json.dumps(manifest))

    with pytest.raises(IntegrityError, match="integrity check failed for 2 file") as raised:
        get_loader("torch_dist").open(out, LoadOptions())
    assert "metadata.json: sha256" in str(raised.value) and "__9_9.distcp: listed in integrity.json" in str(raised.value)

    manifest_path.write_text(json.dumps({"algorithm": "md5", "files": {}}))
    with pytest.raises(CheckpointError, match="algorithm='md5'"):
        get_loader("torch_dist").open(out, LoadOptions())


def test_cli_writes_the_store_by_default_and_common_pt_on_request(megatron: Path, tmp_path: Path) -> None:
    runs = {"default": (), "sha256": ("--digest", "sha256"), "legacy": ("--dst-torch-dist-common", "legacy"),
            "legacy-sha256": ("--dst-torch-dist-common", "legacy", "--digest", "sha256")}
    for name, flags in runs.items():
        result = CliRunner().invoke(main, ["-q", "--dst-format", "torch_dist", *flags, str(megatron),
                                           str(tmp_path / name)])
        assert result.exit_code == 0, result.output
    store = [".metadata", "__0_0.distcp", "__0_1.distcp", "metadata.json"]
    legacy = [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    listed = {name: sorted(p.name for p in (tmp_path / name / ITERATION).iterdir()) for name in runs}
    assert listed == {"default": store, "sha256": sorted([*store, "integrity.json"]), "legacy": legacy,
                      "legacy-sha256": legacy}
    assert (tmp_path / "sha256" / ITERATION / "integrity.json").read_text() == integrity_manifest_of(
        tmp_path / "sha256" / ITERATION)
    assert read_common(tmp_path / "default" / ITERATION) == read_common(tmp_path / "legacy" / ITERATION)
    bad = CliRunner().invoke(main, ["--dst-format", "torch_dist", "--dst-torch-dist-common", "inline", str(megatron),
                                    str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "'inline' is not one of 'store', 'legacy'" in bad.output


def test_an_output_whose_manifest_predates_the_option_counts_as_common_pt(megatron: Path, tmp_path: Path) -> None:
    from pgconvert.run.batch import manifest_mismatch
    from pgconvert.run.convert import convert_request
    from pgconvert.run.manifest import MANIFEST_FILE, read_manifest

    out = to_torch_dist(megatron, tmp_path / "dist", "legacy")
    doc = json.loads((out / MANIFEST_FILE).read_text())
    del doc["options"]["dst_torch_dist_common"]  # as pgconvert wrote it before the option was recorded
    (out / MANIFEST_FILE).write_text(json.dumps(doc))
    manifest = read_manifest(out)
    assert manifest is not None

    def request(common: str) -> object:
        return convert_request(megatron, out, dst_format="torch_dist", dst_torch_dist_common=common)

    assert manifest_mismatch(manifest, request("legacy")) is None
    assert manifest_mismatch(manifest, request("store")) == "dst_torch_dist_common 'legacy', not 'store'"


def record_hashers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The algorithm of every hasher the output files are written through, in order, as they are made."""
    import pgconvert.io.output as output

    algorithms: list[str] = []
    real_hasher = output.new_hasher
    monkeypatch.setattr(output, "new_hasher", lambda algorithm: (algorithms.append(algorithm), real_hasher(algorithm))[1])
    return algorithms


@pytest.fixture(scope="module")
def with_manifest(megatron: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torch_dist source with an integrity.json (its run verifies one on load)."""
    return to_torch_dist(megatron, tmp_path_factory.mktemp("manifest") / "dist")


# (--digest, whether the source has an integrity.json): the manifest written on request, or carried from the source
# whatever --digest says.
MANIFEST_CASES = [("sha256", False), ("xxh3-128", True), ("none", True)]


@pytest.mark.parametrize(("digest", "carried"), MANIFEST_CASES, ids=["sha256", "carried-xxh3-128", "carried-none"])
def test_the_data_files_are_hashed_once_with_sha256_as_written_and_never_read_back(
        megatron: Path, with_manifest: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, digest: str,
        carried: bool) -> None:
    import pgconvert.formats.torch_dist_integrity as integrity
    import pgconvert.run.manifest as manifest

    algorithms = record_hashers(monkeypatch)
    real_files, real_hash_file = integrity.files_sha256, manifest.hash_file
    reread: list[str] = []
    def files_sha256(paths: object) -> dict[Path, str]:
        listed = list(paths)  # type: ignore[call-overload]
        reread.extend(path.name for path in listed)
        return real_files(listed)

    monkeypatch.setattr(integrity, "files_sha256", files_sha256)
    monkeypatch.setattr(manifest, "hash_file", lambda path, relpath, algorithm: (
        reread.append(relpath), real_hash_file(path, relpath, algorithm))[1])
    out = to_torch_dist(with_manifest if carried else megatron, tmp_path / "dist", dst_tp=2, digest=digest)

    assert algorithms and set(algorithms) == {"sha256"}  # every file written through OutputFile: sha256 only
    model_files = sorted(path.name for path in (out / ITERATION).glob("*.distcp"))[:-1]  # the last: the common state
    assert model_files and not [name for name in reread if name.split("/")[-1] in model_files]
    listed = json.loads((out / ITERATION / "integrity.json").read_text())["files"]
    assert listed == json.loads(integrity_manifest_of(out / ITERATION))["files"]
    recorded = {item["path"]: item["digest"] for item in json.loads((out / "pgconvert.json").read_text())["files"]}
    data = [path for path in recorded if path.split("/")[-1] in model_files]
    assert data and all(recorded[path] == (None if digest == "none" else f"sha256:{listed[path.split('/')[-1]]}")
                        for path in data)


@pytest.mark.parametrize("digest", ["xxh3-128", "none"])
def test_without_sha256_or_a_source_manifest_there_is_none_and_no_sha256(megatron: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        digest: str) -> None:
    """As Megatron-LM saves without --verify-integrity: no integrity.json, and no file hashed with sha256 (the
    manifest's digest, if any, is --digest's)."""
    algorithms = record_hashers(monkeypatch)
    out = to_torch_dist(megatron, tmp_path / "dist", dst_tp=2, digest=digest)

    assert not (out / ITERATION / "integrity.json").exists()
    assert set(algorithms) == (set() if digest == "none" else {digest})
    recorded = [item["digest"] for item in json.loads((out / "pgconvert.json").read_text())["files"]]
    assert recorded and all((None if digest == "none" else digest) == (item and item.split(":")[0])
                            for item in recorded)
    assert pgconvert.verify(megatron, out).equal
