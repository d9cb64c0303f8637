"""The catalogue of bad input, faults and interruptions (issue "Bad input, faults and interruptions").

Each case asserts the message (file/tensor/value and the constraint), the exit code, and that no
destination that looks complete is left behind. Cases covered elsewhere, one test each:
truncated .pt, pickle global outside the allowlist, missing and extra rank files, shapes that
disagree, diverged replicas, tracker naming a missing iteration, non-divisible heads/groups/ffn,
DST inside SRC, DST existing: tests/test_bad_input_megatron.py; experts not divisible by ep, a
missing expert shard, duplicated expert indices: tests/test_moe_vpp_megatron.py.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from support.tiny_models import GQA_SWIGLU, QK_NORM_TE
from support.megatron_fixtures import load_for_test, make_full_model, merge_megatron_checkpoint, write_megatron_checkpoint

import pgconvert
from pgconvert.cli import main

TESTS = Path(__file__).parent


def run_cli(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args])


def rank_file(root: Path, name: str, iteration: int = 100) -> Path:
    return root / f"iter_{iteration:07d}" / name / "model_optim_rng.pt"


def looks_like_output(dst: Path) -> bool:
    return dst.exists() and any(dst.iterdir())


def partials(dst: Path) -> list[Path]:
    return sorted(dst.parent.glob(f".{dst.name}.pgconvert-partial-*"))


@pytest.fixture
def src(tmp_path: Path) -> Path:
    return write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)


def test_zero_byte_rank_file_is_named(src: Path, tmp_path: Path) -> None:
    path = rank_file(src, "mp_rank_01")
    path.write_bytes(b"")

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1")

    assert result.exit_code == 1
    assert f"{path}: truncated or corrupt torch checkpoint" in result.output
    assert not looks_like_output(tmp_path / "dst")


def test_symlink_pointing_outside_src_is_refused(src: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.pt"
    path = rank_file(src, "mp_rank_01")
    path.rename(outside)
    path.symlink_to(outside)

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1")

    assert result.exit_code == 1
    assert f"{path}: leads outside the source directory {src}" in result.output
    assert f"a symlink to {outside}" in result.output
    assert not looks_like_output(tmp_path / "dst")


def test_symlink_inside_src_is_followed(src: Path, tmp_path: Path) -> None:
    path = rank_file(src, "mp_rank_01")
    kept = src / "kept.pt"
    path.rename(kept)
    path.symlink_to(kept)

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1", "--quiet")

    assert result.exit_code == 0, result.output


def test_half_written_newer_iteration_is_named_and_older_one_still_converts(tmp_path: Path) -> None:
    full = make_full_model(GQA_SWIGLU)
    root = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, full, 2, 1, iteration=100)
    write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, full, 2, 1, iteration=200)
    rank_file(root, "mp_rank_01", 200).unlink()

    failed = run_cli(root, tmp_path / "dst", "--dst-tp", "1")
    older = run_cli(root, tmp_path / "dst", "--dst-tp", "1", "--iteration", "100", "--quiet")

    assert failed.exit_code == 1
    assert "iter_0000200/mp_rank_01/model_optim_rng.pt: missing rank file" in failed.output
    assert older.exit_code == 0, older.output
    assert (tmp_path / "dst" / "latest_checkpointed_iteration.txt").read_text() == "100"


def _poison(src: Path, value: float) -> str:
    path = rank_file(src, "mp_rank_01")
    state = load_for_test(path)
    key = "decoder.layers.3.self_attention.linear_proj.weight"
    state["model"][key][2, 5] = value
    torch.save(state, path)
    return "decoder.layers.3.self_attention.linear_proj.weight"


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_values_are_converted_with_a_warning(src: Path, tmp_path: Path, value: float) -> None:
    name = _poison(src, value)

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1")

    assert result.exit_code == 0, result.output
    assert f"{name}: 1 of 4096 values are NaN or Inf" in result.output


def test_check_finite_refuses_non_finite_values(src: Path, tmp_path: Path) -> None:
    name = _poison(src, math.nan)

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1", "--check-finite")

    assert result.exit_code == 1
    assert f"{name}: 1 of 4096 values are NaN or Inf (1 NaN) in {src / 'iter_0000100'} (refused by --check-finite)" in result.output
    assert not looks_like_output(tmp_path / "dst") and partials(tmp_path / "dst") == []


def test_unknown_true_vocab_that_a_target_needs_is_refused(tmp_path: Path) -> None:
    model = replace(GQA_SWIGLU, vocab_size=1030)
    src = write_megatron_checkpoint(tmp_path / "src", model, make_full_model(model), 1, 1)
    for path in src.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = load_for_test(path)
        del state["args"].vocab_size
        torch.save(state, path)

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "8")

    assert result.exit_code == 2
    assert "--dst-tp 8: the source's padded vocab (1152 rows) is not a multiple of" in result.output
    assert "pass --true-vocab-size" in result.output


def test_strict_refuses_an_unknown_true_vocab_size(src: Path, tmp_path: Path) -> None:
    for path in src.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = load_for_test(path)
        del state["args"].vocab_size
        torch.save(state, path)

    lenient = run_cli(src, tmp_path / "lenient", "--dst-tp", "1")
    strict = run_cli(src, tmp_path / "strict", "--dst-tp", "1", "--strict")

    assert lenient.exit_code == 0
    assert "the true vocab size is unknown" in lenient.output
    assert strict.exit_code == 2
    assert "--strict: refusing to guess:" in strict.output and "the true vocab size is unknown" in strict.output
    assert not (tmp_path / "strict").exists()


def test_strict_refuses_a_lossy_dtype_change(src: Path, tmp_path: Path) -> None:
    result = run_cli(src, tmp_path / "dst", "--dtype", "bf16", "--strict")

    assert result.exit_code == 2
    assert "--strict: refusing to guess: --dtype casts float32 tensors to bfloat16" in result.output
    assert not (tmp_path / "dst").exists()


def test_strict_refuses_dropping_transformer_engine_extra_state(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", QK_NORM_TE, make_full_model(QK_NORM_TE), 2, 1)
    for path in src.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = load_for_test(path)
        state["model"]["decoder.layers.0.self_attention.linear_qkv._extra_state"] = torch.ones(4, dtype=torch.uint8)
        torch.save(state, path)

    lenient = run_cli(src, tmp_path / "lenient", "--dst-tp", "1")
    strict = run_cli(src, tmp_path / "strict", "--dst-tp", "1", "--strict")

    assert lenient.exit_code == 0
    assert "_extra_state" in lenient.output and "written empty (None)" in lenient.output
    assert strict.exit_code == 2
    assert "decoder.layers.0.self_attention.linear_qkv._extra_state: Transformer Engine _extra_state would be dropped" in strict.output


def test_extra_state_is_carried_when_the_tp_size_is_unchanged(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", QK_NORM_TE, make_full_model(QK_NORM_TE), 2, 1)
    marker = {0: torch.full((4,), 7, dtype=torch.uint8), 1: torch.full((4,), 9, dtype=torch.uint8)}
    for tp_rank in (0, 1):
        path = rank_file(src, f"mp_rank_{tp_rank:02d}")
        state = load_for_test(path)
        state["model"]["decoder.layers.1.mlp.linear_fc1._extra_state"] = marker[tp_rank]
        torch.save(state, path)

    pgconvert.convert(src, tmp_path / "pp2", dst_pp=2, strict=True)

    for tp_rank in (0, 1):
        state = load_for_test(tmp_path / "pp2" / "iter_0000100" / f"mp_rank_{tp_rank:02d}_000" / "model_optim_rng.pt")
        assert torch.equal(state["model"]["decoder.layers.1.mlp.linear_fc1._extra_state"], marker[tp_rank])


@pytest.fixture
def small_mount(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: writes of a bigger checkpoint fail with ENOSPC."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here to simulate a full disk: {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_disk_full_while_writing_is_named_and_leaves_nothing(src: Path, small_mount: Path) -> None:
    dst = small_mount / "dst"

    result = run_cli(src, dst, "--dst-tp", "1")

    assert result.exit_code == 1
    assert f"writing DST {dst} failed: No space left on device" in result.output
    assert "nothing was left behind" in result.output
    assert sorted(p.name for p in small_mount.iterdir()) == []


def test_read_only_dst_parent_is_refused_before_writing(src: Path, small_mount: Path) -> None:
    done = subprocess.run(["mount", "-o", "remount,ro", str(small_mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot remount read-only: {done.stderr.strip()}")

    result = run_cli(src, small_mount / "dst", "--dst-tp", "1")

    assert result.exit_code == 2
    assert f"DST {small_mount / 'dst'}: parent directory {small_mount} is not writable (Read-only file system)" in result.output


def test_write_error_is_a_clear_message_not_a_traceback(src: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import pgconvert.savers.megatron as megatron_saver

    real_save = megatron_saver.save_stream
    calls: list[object] = []

    def failing_save(obj: object, handle: object, *args: object, **kwargs: object) -> None:
        calls.append(handle)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        real_save(obj, handle, *args, **kwargs)

    # The rank files are written by the streaming writer, not torch.save.
    monkeypatch.setattr(megatron_saver, "save_stream", failing_save)

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "2")

    assert result.exit_code == 1
    assert "failed: Input/output error" in result.output and "mp_rank_01/model_optim_rng.pt" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "dst").exists() and partials(tmp_path / "dst") == []


def _slow_conversion(src: Path, dst: Path, delay: float = 3.0) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(TESTS / "support" / "slow_convert.py"), str(delay), "--quiet", "--dst-tp", "2", str(src), str(dst)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _wait_for_first_rank_file(dst: Path, process: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(next(p.rglob("model_optim_rng.pt"), None) for p in partials(dst)):
            return
        if process.poll() is not None:
            raise AssertionError(f"conversion ended early: {process.communicate()}")
        time.sleep(0.05)
    raise AssertionError("the conversion never started writing")


def test_sigint_mid_conversion_removes_the_partial_output(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    process = _slow_conversion(src, dst)
    _wait_for_first_rank_file(dst, process)

    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)

    assert process.returncode == 130, stderr
    assert "interrupted: no output was left behind" in stderr
    assert not dst.exists() and partials(dst) == []


def test_sigterm_mid_conversion_removes_the_partial_output(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    process = _slow_conversion(src, dst)
    _wait_for_first_rank_file(dst, process)

    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)

    assert process.returncode == 130
    assert not dst.exists() and partials(dst) == []


def test_sigkill_leaves_only_a_hidden_partial_and_a_rerun_succeeds(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    process = _slow_conversion(src, dst)
    _wait_for_first_rank_file(dst, process)

    process.kill()
    process.communicate(timeout=60)
    left = partials(dst)
    rerun = run_cli(src, dst, "--dst-tp", "2", "--quiet")

    assert process.returncode == -signal.SIGKILL
    assert len(left) == 1 and left[0].name.startswith(".") and not (left[0] / "pgconvert.json").exists()
    assert not (left[0] / "latest_checkpointed_iteration.txt").exists()
    assert rerun.exit_code == 0, rerun.output
    assert partials(dst) == []
    merged = merge_megatron_checkpoint(dst, GQA_SWIGLU)
    full = make_full_model(GQA_SWIGLU)
    assert all(torch.equal(merged[name], full[name]) for name in full)


def test_two_conversions_to_the_same_dst_at_once_one_fails_clearly(src: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    first = _slow_conversion(src, dst, delay=1.0)
    _wait_for_first_rank_file(dst, first)

    second = run_cli(src, dst, "--dst-tp", "2")
    first.communicate(timeout=120)

    assert second.exit_code == 2
    assert f"DST {dst} is being written by another pgconvert process (pid {first.pid}" in second.output
    assert first.returncode == 0
    merged = merge_megatron_checkpoint(dst, GQA_SWIGLU)
    full = make_full_model(GQA_SWIGLU)
    assert all(torch.equal(merged[name], full[name]) for name in full)
    assert not (tmp_path / ".dst.pgconvert.lock").exists()


def test_every_written_file_is_fsynced_before_the_final_rename(src: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, Path.rename

    def recording_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def recording_rename(self: Path, target: Path) -> Path:
        events.append(("rename", str(target)))
        return real_rename(self, target)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(Path, "rename", recording_rename)

    pgconvert.convert(src, tmp_path / "dst", dst_tp=2, dst_pp=2)

    rename_at = events.index(("rename", str((tmp_path / "dst").absolute())))
    synced_before = {path for kind, path in events[:rename_at] if kind == "fsync"}
    written = [p for p in (tmp_path / "dst").rglob("*") if p.is_file()]
    assert written
    for path in written:
        staged = str(path).replace(str(tmp_path / "dst"), "")
        assert any(s.endswith(staged) and ".pgconvert-partial-" in s for s in synced_before), path


# ------------------------------------------------------------------------------------- safetensors

@pytest.fixture
def hf_src(tmp_path: Path) -> Path:
    """A small HF checkpoint (one model.safetensors) made by pgconvert from the example model."""
    mcore = tmp_path / "mcore"
    assert CliRunner().invoke(main, ["example", str(mcore), "--tp", "1"]).exit_code == 0
    pgconvert.convert(mcore, tmp_path / "hf", dst_format="hf")
    return tmp_path / "hf"


def _rewrite_safetensors(path: Path, edit: object) -> None:
    import json
    import struct

    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + length])
    new_header, body, declared = edit(header, data[8 + length:])  # type: ignore[operator]
    encoded = json.dumps(new_header).encode()
    path.write_bytes(struct.pack("<Q", declared if declared is not None else len(encoded)) + encoded + body)


def _overlap(header: dict, body: bytes) -> tuple[dict, bytes, None]:
    names = [name for name in header if name != "__metadata__"]
    first, second = header[names[0]], header[names[1]]
    second["data_offsets"] = [first["data_offsets"][0], first["data_offsets"][0] + (
        second["data_offsets"][1] - second["data_offsets"][0])]
    return header, body, None


@pytest.mark.parametrize(("case", "edit"), [
    ("header length beyond the file", lambda header, body: (header, body, 10**9)),
    ("header size bomb", lambda header, body: (header, body, 2**62)),
    ("overlapping offsets", _overlap),
    ("truncated data", lambda header, body: (header, body[: len(body) // 2], None)),
])
def test_corrupt_safetensors_is_named_and_nothing_is_written(hf_src: Path, tmp_path: Path, case: str,
                                                             edit: object) -> None:
    path = hf_src / "model.safetensors"
    _rewrite_safetensors(path, edit)

    result = run_cli(hf_src, tmp_path / "dst", "--dst-format", "megatron")

    assert result.exit_code == 1, (case, result.output)
    assert str(path) in result.output, case
    assert "Traceback" not in result.output
    assert not looks_like_output(tmp_path / "dst")


def test_zero_byte_safetensors_is_named(hf_src: Path, tmp_path: Path) -> None:
    path = hf_src / "model.safetensors"
    path.write_bytes(b"")

    result = run_cli(hf_src, tmp_path / "dst", "--dst-format", "megatron")

    assert result.exit_code == 1
    assert f"{path}: not a readable safetensors file" in result.output
    assert not looks_like_output(tmp_path / "dst")
