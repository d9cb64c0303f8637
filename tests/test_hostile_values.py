"""Hostile and broken values (and two fuzz finds): replicas holding NaN,
a full disk under torch_dist, manifest paths leading out, unbounded options, misnamed options,
tensors of one torch_dist key stored in different dtypes."""

from __future__ import annotations

import os
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.cli_helpers import assert_clean_refusal, run_cli
from support.full_disk import FillingDisk
from support.tiny_models import GQA_SWIGLU, MOE
from support.megatron_fixtures import load_for_test, make_full_model, write_megatron_checkpoint
from support.checkpoint_compare import read_common

import pgconvert
from pgconvert.errors import CheckpointError, LayoutError, PgconvertError
from pgconvert.model.layout_spec import LayoutSpec
from pgconvert.model.rules import Replicated, ReplicaMismatchError, bitwise_equal

NORM = "decoder.layers.1.input_layernorm.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine")
    return write_megatron_checkpoint(root / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)


@pytest.fixture
def src(pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "src"))


def rank_files(root: Path) -> list[Path]:
    return sorted(root.glob("iter_*/mp_rank_*/model_optim_rng.pt"))


def edit_every_rank(root: Path, edit: Any) -> None:
    for path in rank_files(root):
        state = load_for_test(path)
        edit(state)
        torch.save(state, path)


# ------------------------------------------------------------------------------------ replicas


def test_bitwise_equal_treats_an_identical_nan_as_equal_and_signed_zeros_as_different() -> None:
    a = torch.tensor([1.0, float("nan"), 0.0])
    assert bitwise_equal(a, a.clone())
    assert not bitwise_equal(a, torch.tensor([1.0, float("nan"), -0.0]))
    assert not bitwise_equal(a, a.double())
    assert Replicated().merge([a, a.clone()]) is a


def test_replica_mismatch_is_a_checkpoint_error_naming_tensor_and_files() -> None:
    with pytest.raises(ReplicaMismatchError) as caught:
        Replicated().merge([torch.zeros(2), torch.ones(2)])
    assert isinstance(caught.value, CheckpointError) and isinstance(caught.value, PgconvertError)
    error = ReplicaMismatchError(0, 1, "x.weight", ("a.pt", "b.pt"))
    assert str(error) == "x.weight: replicated tensor differs between ranks (a.pt and b.pt)"
    assert (error.name, error.files, error.ranks) == ("x.weight", ("a.pt", "b.pt"), (0, 1))


def _same_nan_on_every_rank(src: Path) -> None:
    def edit(state: dict[str, Any]) -> None:
        state["model"][NORM][3] = float("nan")
    edit_every_rank(src, edit)


def test_identical_nan_on_every_tp_rank_converts_and_verifies(src: Path, tmp_path: Path) -> None:
    _same_nan_on_every_rank(src)

    converted = run_cli(src, tmp_path / "dst", "--dst-tp", "1")
    verified = run_cli("verify", src, tmp_path / "dst")

    assert_clean_refusal(converted, 0, f"{NORM}: 1 of 64 values are NaN or Inf (1 NaN)")
    assert_clean_refusal(verified, 0, "equal")
    merged = load_for_test(rank_files(tmp_path / "dst")[0])["model"][NORM]
    assert bitwise_equal(merged, load_for_test(rank_files(src)[0])["model"][NORM])


def test_check_finite_names_the_nan(src: Path, tmp_path: Path) -> None:
    _same_nan_on_every_rank(src)

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1", "--check-finite")

    assert_clean_refusal(result, 1, f"{NORM}: 1 of 64 values are NaN or Inf (1 NaN) in", "refused by --check-finite")
    assert not (tmp_path / "dst").exists()


def test_replicas_that_really_differ_are_still_refused_naming_both_files(src: Path, tmp_path: Path) -> None:
    last = rank_files(src)[-1]
    state = load_for_test(last)
    state["model"][NORM][3] = float("nan")
    torch.save(state, last)

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1")

    assert_clean_refusal(result, 1, f"{NORM}: replicated tensor differs between ranks", str(rank_files(src)[0]), str(last))


# ------------------------------------------------------------------------------------ full disk


def test_torch_dist_on_a_full_disk_gives_the_clean_message(src: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    dst = tmp_path / "dst"
    monkeypatch.setattr(os, "pwrite", FillingDisk(200_000).pwrite)
    result = run_cli(src, dst, "--dst-format", "torch_dist")
    monkeypatch.undo()

    assert_clean_refusal(result, 1, f"writing DST {dst} failed: No space left on device", "nothing was left behind")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["src"]


def test_torch_dist_on_a_real_full_tmpfs_gives_the_clean_message(src: Path, tmp_path: Path) -> None:
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here to fill a disk: {done.stderr.strip()}")
    try:
        result = run_cli(src, mount_point / "dst", "--dst-format", "torch_dist")

        assert_clean_refusal(result, 1, f"writing DST {mount_point / 'dst'} failed: No space left on device")
        assert list(mount_point.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


# ------------------------------------------------------------------------------------ manifest paths


def _listed(dst: Path, path: str) -> None:
    manifest = json.loads((dst / "pgconvert.json").read_text())
    manifest["files"].append({"path": path, "size": 6, "digest": "sha256:" + "0" * 64})
    (dst / "pgconvert.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_verify_does_not_read_a_manifest_path_outside_the_checkpoint(src: Path, tmp_path: Path, kind: str) -> None:
    dst = tmp_path / "dst"
    pgconvert.convert(src, dst, dst_tp=1)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"secret")
    if kind == "symlink":
        (dst / "link.bin").symlink_to(secret)
    _listed(dst, {"dotdot": "../secret.bin", "absolute": str(secret), "symlink": "link.bin"}[kind])

    result = run_cli("verify", src, dst)

    assert_clean_refusal(result, 1, str(dst))
    assert "refusing to read it" in result.output
    assert "digest" not in result.output  # nothing outside was hashed and shown


# ------------------------------------------------------------------------------------ unbounded options


@pytest.mark.parametrize("option,value", [("--max-shard-size", "inf"), ("--max-shard-size", "nan"),
                                          ("--max-shard-size", "1e400"), ("--max-memory", "1e400")])
def test_infinite_sizes_are_refused(src: Path, tmp_path: Path, option: str, value: str) -> None:
    result = run_cli(src, tmp_path / "dst", "--dst-format", "hf", option, value)

    assert_clean_refusal(result, 2, f"'{value}' is not a finite size")


@pytest.mark.parametrize("layout", ["Et*1200000000|tL", "Et*" + "9" * 5000 + "|tL", "t*999999|" * 50 + "EL"])
def test_pipeline_layout_repeats_are_bounded_before_expansion(src: Path, tmp_path: Path, layout: str) -> None:
    started = time.perf_counter()

    result = run_cli(src, tmp_path / "dst", "--dst-pp", "2", "--dst-pipeline-layout", layout)

    assert_clean_refusal(result, 2, "over pgconvert's limit MAX_PIPELINE_LAYOUT_CHARS=1000000")
    assert time.perf_counter() - started < 10
    assert len(result.output) < 1000


# ------------------------------------------------------------------------------------ option names


def test_source_expert_tp_is_named_as_its_args_not_as_an_option(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", MOE, make_full_model(MOE), 2, 1)
    edit_every_rank(src, lambda state: setattr(state["args"], "expert_tensor_parallel_size", 1))

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "1")

    assert_clean_refusal(result, 2, f"{rank_files(src)[0]}: args.expert_tensor_parallel_size=1 with "
                            "tensor_model_parallel_size=2: the megatron per-rank format")
    assert "--src-expert-tp" not in result.output


def test_example_names_its_own_tp_option(tmp_path: Path) -> None:
    result = run_cli("example", tmp_path / "out", "--tp", "3")

    assert_clean_refusal(result, 2, "--tp 3: num_attention_heads=16 is not divisible by 3")
    assert "--dst-tp" not in result.output


# ------------------------------------------------------------------------------------ fuzz find: dtypes


def _norm_in(dtype: torch.dtype) -> Any:
    def edit(state: dict[str, Any]) -> None:
        state["model"][NORM] = state["model"][NORM].to(dtype)
    return edit


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64])
def test_one_tensor_in_another_dtype_in_every_rank_file(src: Path, tmp_path: Path, dtype: torch.dtype) -> None:
    edit_every_rank(src, _norm_in(dtype))

    megatron = run_cli(src, tmp_path / "megatron", "--dst-tp", "1")
    torch_dist = run_cli(src, tmp_path / "torch_dist", "--dst-format", "torch_dist")

    assert_clean_refusal(megatron, 0)
    assert_clean_refusal(run_cli("verify", src, tmp_path / "megatron"), 0, "equal")
    assert load_for_test(rank_files(tmp_path / "megatron")[0])["model"][NORM].dtype == dtype
    assert_clean_refusal(torch_dist, 2, f"{src}", f"{NORM} is {dtype}",
                 "torch_dist stores both in the one key decoder.layers.self_attention.linear_qkv.layer_norm_weight "
                 "of a single dtype")
    assert not (tmp_path / "torch_dist").exists()


# ------------------------------------------------------------------------------------ fuzz find: layout text


@pytest.mark.parametrize("value", ["9" * 5000, "²", "1" + "0" * 9])
def test_layout_text_sizes_are_bounded_ascii_integers(value: str) -> None:
    with pytest.raises(LayoutError, match=r"must be an integer >= 1 of at most 9 digits"):
        LayoutSpec.parse(f"tp={value},pp=1")


def test_batch_plan_with_a_5000_digit_layout_size_names_the_plan(src: Path, tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(f'[[convert]]\nsrc = "{src}"\ndst = "out/"\ndst_layout = "tp={"9" * 5000}"\n')

    result = run_cli("batch", plan)

    assert_clean_refusal(result, 2, f"{plan} [[convert]] #1: layout 'tp=999", "of at most 9 digits")
    assert len(result.output) < 1000


# ------------------------------------------------------------------------------------ fuzz find: args carried


@pytest.mark.parametrize("value", ["RMSNorm", [], 0])
def test_max_position_embeddings_of_a_rope_model_is_checked_before_it_is_carried(src: Path, tmp_path: Path,
                                                                                  value: object) -> None:
    edit_every_rank(src, lambda state: setattr(state["args"], "max_position_embeddings", value))

    result = run_cli(src, tmp_path / "dst", "--dst-format", "hf")

    assert_clean_refusal(result, 1, str(rank_files(src)[0]), "max_position_embeddings=", "must be a positive integer")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("target", [["--dst-tp", "1"], ["--dst-format", "torch_dist"]])
def test_a_stray_dtype_on_the_first_tensor_does_not_become_the_args_params_dtype(src: Path, tmp_path: Path,
                                                                                 target: list[str]) -> None:
    name = "embedding.word_embeddings.weight"
    edit_every_rank(src, lambda state: state["model"].update({name: state["model"][name].double()}))
    dst = tmp_path / "dst"

    converted = run_cli(src, dst, *target)
    verified = run_cli("verify", src, dst)

    assert_clean_refusal(converted, 0)
    assert_clean_refusal(verified, 0, "equal")
    written = read_common(next(dst.glob("iter_*"))) if "torch_dist" in target else load_for_test(rank_files(dst)[0])
    assert written["args"].params_dtype == load_for_test(rank_files(src)[0])["args"].params_dtype == torch.float32
