"""Hostile and broken input files (the reading side): bounded resources, no silent
corruption, no tracebacks, every message naming the file (and the limit, where one is hit)."""

from __future__ import annotations

import json
import math
import pickle
import shutil
import struct
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from support.tiny_models import GQA_SWIGLU
from support.megatron_fixtures import load_for_test, make_full_model, merge_megatron_checkpoint, write_megatron_checkpoint
from support.torch_dist_forms import FOR_MCORE_016

import pgconvert
from pgconvert.io import limits
from pgconvert.cli import main


def run_cli(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args])


def rank_file(root: Path, name: str = "mp_rank_00") -> Path:
    return root / "iter_0000100" / name / "model_optim_rng.pt"


def assert_refused(result: Result, path: Path, *fragments: str, codes: tuple[int, ...] = (1,)) -> None:
    assert result.exit_code in codes, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    assert str(path) in result.output, result.output
    for fragment in fragments:
        assert fragment in result.output, result.output
    # The error names the file once, briefly; inspect prints its report (a line per semantic setting,
    # more as families add settings) before it, so the bound is on each line and a generous total.
    longest = max(map(len, result.output.splitlines()), default=0)
    assert longest < 2000, f"unbounded message line of {longest} characters"
    assert len(result.output) < 8000, f"unbounded output of {len(result.output)} characters"


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)


def _rewrite_zip(path: Path, edit: Callable[[str, bytes], tuple[bytes, int]]) -> None:
    """Rewrite a torch zip file record by record: ``edit(name, data) -> (data, compress_type)``."""
    with zipfile.ZipFile(path) as archive:
        records = [(info.filename, archive.read(info.filename)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in records:
            new, compression = edit(name, data)
            archive.writestr(zipfile.ZipInfo(name), new, compress_type=compression)


def _edit_args(path: Path, **changes: object) -> None:
    state = load_for_test(path)
    for key, value in changes.items():
        setattr(state["args"], key, value)
    torch.save(state, path)


def _edit_all_args(src: Path, **changes: object) -> Path:
    for path in sorted(src.glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        _edit_args(path, **changes)
    return rank_file(src)


# ------------------------------------------------------------------------------------ torch zip records


def test_deflated_record_is_refused_before_torch_inflates_it(src: Path, tmp_path: Path) -> None:
    path = rank_file(src)
    _rewrite_zip(path, lambda name, data: (data, zipfile.ZIP_DEFLATED if name.endswith("data.pkl")
                                           else zipfile.ZIP_STORED))

    assert_refused(run_cli(src, tmp_path / "dst", "--dst-tp", "1"), path, "data.pkl", "is compressed")


def test_data_pkl_over_the_pickle_limit_is_refused_naming_the_limit(src: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "MAX_PICKLE_BYTES", 100)

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1")

    assert_refused(result, rank_file(src), "over pgconvert's limit MAX_PICKLE_BYTES=100")


def test_storage_record_shorter_than_its_tensor_is_refused(src: Path, tmp_path: Path) -> None:
    path = rank_file(src, "mp_rank_01")
    with zipfile.ZipFile(path) as archive:
        largest = max((info for info in archive.infolist() if "/data/" in info.filename), key=lambda i: i.file_size)
    _rewrite_zip(path, lambda name, data: (data[:8] if name == largest.filename else data, zipfile.ZIP_STORED))

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1")

    assert_refused(result, path, f"record data/{largest.filename.rsplit('/', 1)[1]!r} holds 8 bytes, "
                   f"its tensors need {largest.file_size}")
    assert not (tmp_path / "dst").exists()


def test_legacy_torch_save_files_are_read(src: Path, tmp_path: Path) -> None:
    for path in src.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        torch.save(load_for_test(path), path, _use_new_zipfile_serialization=False)
        assert not zipfile.is_zipfile(path)

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1", "--quiet")

    assert result.exit_code == 0, result.output
    merged = merge_megatron_checkpoint(tmp_path / "dst", GQA_SWIGLU)
    full = make_full_model(GQA_SWIGLU)
    assert sorted(merged) == sorted(full)
    assert all(torch.equal(merged[name], full[name]) for name in full)


def test_legacy_file_with_a_short_storage_is_refused(src: Path, tmp_path: Path) -> None:
    path = rank_file(src, "mp_rank_01")
    torch.save(load_for_test(path), path, _use_new_zipfile_serialization=False)
    path.write_bytes(path.read_bytes()[:-100])

    assert_refused(run_cli(src, tmp_path / "dst", "--dst-tp", "1"), path, "truncated or corrupt legacy")


def test_legacy_file_with_a_global_outside_the_allowlist_is_refused(src: Path, tmp_path: Path) -> None:
    path = rank_file(src, "mp_rank_01")
    state = load_for_test(path)
    state["evil"] = time.sleep  # any callable outside the allowlist
    torch.save(state, path, _use_new_zipfile_serialization=False)

    assert_refused(run_cli(src, tmp_path / "dst", "--dst-tp", "1"), path, "refuses to unpickle global time.sleep")


# ------------------------------------------------------------------------------------ args and model


def _shared_reference_bomb() -> list[object]:
    """A list of lists whose full repr would be 10**40 characters, pickled in a few KB."""
    value: list[object] = []
    for _ in range(40):
        value = [value] * 10
    return value


def test_shared_reference_value_in_an_error_message_is_quoted_bounded(src: Path, tmp_path: Path) -> None:
    path = _edit_all_args(src, position_embedding_type=_shared_reference_bomb())
    assert path.stat().st_size < 1_000_000

    started = time.monotonic()
    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1")

    assert_refused(result, path, "args.position_embedding_type=[[[[")
    assert time.monotonic() - started < 30


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"num_layers": 10**9}, "args.num_layers=1000000000, but the checkpoint stores 4 decoder layer(s)"),
    ({"tensor_model_parallel_size": 10**9, "expert_tensor_parallel_size": None},
     "(1000000000 rank files), but 2 mp_rank_* directories are present"),
    ({"tensor_model_parallel_size": "abc"}, "args.tensor_model_parallel_size='abc': must be an integer >= 1"),
    ({"tensor_model_parallel_size": 0}, "args.tensor_model_parallel_size=0: must be an integer >= 1"),
    ({"tensor_model_parallel_size": -2}, "args.tensor_model_parallel_size=-2: must be an integer >= 1"),
    ({"num_attention_heads": 0}, "num_attention_heads=0: must be a positive integer"),
    ({"hidden_size": "64"}, "hidden_size='64': must be a positive integer"),
    ({"norm_epsilon": "abc"}, "args.norm_epsilon='abc': must be a finite number"),
    ({"norm_epsilon": math.nan}, "args.norm_epsilon=nan: must be a finite number"),
    ({"rotary_base": math.inf}, "args.rotary_base=inf: must be a finite number"),
], ids=lambda value: str(value)[:40])
def test_bad_args_values_are_refused_naming_the_file(src: Path, tmp_path: Path, changes: dict[str, object],
                                                     fragment: str) -> None:
    path = _edit_all_args(src, **changes)

    started = time.monotonic()
    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1")

    assert_refused(result, path, fragment, codes=(1, 2))
    assert time.monotonic() - started < 30


def test_rotary_base_none_means_megatrons_default_not_a_crash(src: Path, tmp_path: Path) -> None:
    _edit_all_args(src, rotary_base=None)

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1", "--quiet")

    assert result.exit_code == 0, result.output
    assert load_for_test(rank_file(tmp_path / "dst"))["args"].rotary_base == 10000.0


@pytest.mark.parametrize(("model", "fragment"), [
    ([1, 2, 3], "'model' is a list, expected a dict of tensors"),
    ({0: torch.zeros(1)}, "'model' holds the key 0, expected tensor names"),
])
def test_model_that_is_not_a_dict_of_names_is_refused(src: Path, tmp_path: Path, model: object,
                                                      fragment: str) -> None:
    path = rank_file(src, "mp_rank_01")
    state = load_for_test(path)
    state["model"] = model
    torch.save(state, path)

    assert_refused(run_cli(src, tmp_path / "dst", "--dst-tp", "1"), path, fragment)


@pytest.mark.parametrize("content", ["²".encode(), "100".encode("utf-16"), b"1" * 1000])
def test_tracker_that_is_not_an_ascii_number_is_refused(src: Path, tmp_path: Path, content: bytes) -> None:
    tracker = src / "latest_checkpointed_iteration.txt"
    tracker.write_bytes(content)

    assert_refused(run_cli(src, tmp_path / "dst", "--dst-tp", "1"), tracker)



# ------------------------------------------------------------------------------------ torch_dist


@pytest.fixture
def dist(src: Path, tmp_path: Path) -> Path:
    # common.pt and no integrity manifest (as megatron-core 0.18 and older write), so each damage reaches its check
    pgconvert.convert(src, tmp_path / "dist", dst_format="torch_dist", dst_tp=1, **FOR_MCORE_016)
    return tmp_path / "dist"


def _metadata_path(dist: Path) -> Path:
    return dist / "iter_0000100" / ".metadata"


def _edit_metadata(dist: Path, edit: Callable[[Any], None]) -> Path:
    path = _metadata_path(dist)
    with open(path, "rb") as handle:
        metadata = pickle.load(handle)  # the test's own fixture, written by pgconvert
    edit(metadata)
    with open(path, "wb") as handle:
        pickle.dump(metadata, handle)
    return path


def _first_storage(metadata: Any) -> Any:
    """The storage entry of the first tensor (not bytes) entry."""
    tensors = [key for key, md in metadata.state_dict_metadata.items() if hasattr(md, "chunks")]
    return next(info for index, info in metadata.storage_data.items() if index.fqn == tensors[0])


@pytest.mark.parametrize(("edit", "fragment"), [
    (lambda md: setattr(md, "state_dict_metadata", None), "state_dict_metadata is NoneType, expected a dict"),
    (lambda md: setattr(_first_storage(md), "offset", "abc"), "offset 'abc'"),
    (lambda md: setattr(_first_storage(md), "relative_path", _shared_reference_bomb()), "a storage entry is malformed"),
    (lambda md: setattr(_first_storage(md), "length", 8), "its chunks hold"),
], ids=["state_dict_metadata None", "offset abc", "shared-reference bomb", "short storage"])
def test_malformed_dcp_metadata_is_refused_naming_it(dist: Path, tmp_path: Path, edit: Callable[[Any], None],
                                                     fragment: str) -> None:
    path = _edit_metadata(dist, edit)

    assert_refused(run_cli(dist, tmp_path / "dst", "--dst-tp", "1"), path, fragment)


def test_allowlisted_global_called_with_a_bad_argument_is_refused(dist: Path, tmp_path: Path) -> None:
    path = _metadata_path(dist)
    name = b"torch.bogus_layout"
    path.write_bytes(b"\x80\x02ctorch.serialization\n_get_layout\nX" + struct.pack("<I", len(name)) + name + b"\x85R.")

    assert_refused(run_cli(dist, tmp_path / "dst", "--dst-tp", "1"), path, "truncated or corrupt checkpoint metadata")


def test_dcp_metadata_over_the_pickle_limit_is_refused(dist: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "MAX_PICKLE_BYTES", 100)

    result = run_cli(dist, tmp_path / "dst", "--dst-tp", "1")

    assert_refused(result, dist / "iter_0000100", "over pgconvert's limit MAX_PICKLE_BYTES=100")


def test_num_layers_beyond_the_stored_tensors_is_refused_in_common_pt(dist: Path, tmp_path: Path) -> None:
    path = dist / "iter_0000100" / "common.pt"
    common = load_for_test(path)
    common["args"].num_layers = 10**9
    torch.save(common, path)

    started = time.monotonic()
    result = run_cli(dist, tmp_path / "dst", "--dst-tp", "1")

    assert_refused(result, _metadata_path(dist), "args.num_layers=1000000000")
    assert time.monotonic() - started < 30


# ------------------------------------------------------------------------------------ JSON


def test_deeply_nested_metadata_json_is_refused_by_depth(dist: Path, tmp_path: Path) -> None:
    path = dist / "iter_0000100" / "metadata.json"
    path.write_text("[" * 100_000)

    assert_refused(run_cli(dist, tmp_path / "dst", "--dst-tp", "1"), path,
                   f"the JSON nesting depth is 100000, over pgconvert's limit MAX_JSON_DEPTH={limits.MAX_JSON_DEPTH}")


# ------------------------------------------------------------------------------------ HF safetensors


@pytest.fixture(scope="module")
def pristine_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small HF checkpoint (one model.safetensors) made by pgconvert from the example model."""
    root = tmp_path_factory.mktemp("hf")
    assert CliRunner().invoke(main, ["example", str(root / "mcore"), "--tp", "1"]).exit_code == 0
    pgconvert.convert(root / "mcore", root / "hf", dst_format="hf")
    return root / "hf"


@pytest.fixture
def hf_src(pristine_hf: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine_hf, tmp_path / "hf"))


def test_safetensors_header_naming_a_tensor_twice_is_refused(hf_src: Path, tmp_path: Path) -> None:
    path = hf_src / "model.safetensors"
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    name = next(key for key in header if key != "__metadata__" and header[key]["dtype"] in ("BF16", "F32"))
    twin = dict(header[name], dtype="F16" if header[name]["dtype"] == "BF16" else "I32")
    text = json.dumps(header)[:-1] + f", {json.dumps(name)}: {json.dumps(twin)}}}"
    encoded = text.encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length:])

    result = run_cli(hf_src, tmp_path / "dst", "--dst-format", "megatron")

    assert_refused(result, path, f"the key {name!r} appears twice in one JSON object")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_number_in_config_json_is_refused(hf_src: Path, tmp_path: Path, value: str) -> None:
    path = hf_src / "config.json"
    doc = json.loads(path.read_text())
    key = "rms_norm_eps" if "rms_norm_eps" in doc else "rope_theta"
    doc[key] = 0.5
    path.write_text(json.dumps(doc).replace("0.5", value))

    result = run_cli(hf_src, tmp_path / "dst", "--dst-format", "megatron")

    assert_refused(result, path, f"{key}={value.lower().replace('infinity', 'inf')}: expected a finite number")


def test_num_hidden_layers_beyond_the_stored_tensors_is_refused(hf_src: Path, tmp_path: Path) -> None:
    path = hf_src / "config.json"
    doc = json.loads(path.read_text())
    doc["num_hidden_layers"] = 10**9
    path.write_text(json.dumps(doc))

    started = time.monotonic()
    result = run_cli(hf_src, tmp_path / "dst", "--dst-format", "megatron")

    assert_refused(result, path, "num_hidden_layers=1000000000, but the checkpoint stores 4 decoder layer(s)")
    assert time.monotonic() - started < 30


@pytest.mark.parametrize(("command", "name"), [
    ("convert", "config.json"),
    ("inspect", "pgconvert.json"),
    ("verify", "pgconvert.json"),
])
def test_deeply_nested_json_is_refused_by_depth(hf_src: Path, tmp_path: Path, command: str, name: str) -> None:
    path = hf_src / name
    path.write_text("[" * 100_000)
    args = {"convert": [hf_src, tmp_path / "dst", "--dst-format", "megatron"], "inspect": [hf_src],
            "verify": [hf_src, hf_src]}[command]

    result = run_cli(command, *args)

    assert_refused(result, path, f"over pgconvert's limit MAX_JSON_DEPTH={limits.MAX_JSON_DEPTH}", codes=(1, 2))
