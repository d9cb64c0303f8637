"""Megatron-LM d98e8a64's per-rank MTP keys, ``mtp.layers.{i}.mtp_model_layer.*``.

megatron-core 0.16.1's MultiTokenPredictionLayer names its inner layer ``transformer_layer``; Megatron-LM
d98e8a64 names it ``mtp_model_layer`` in ``state_dict`` (what a ``--ckpt-format torch`` save writes) and maps
it back to ``transformer_layer`` only in ``sharded_state_dict``. A per-rank source in either spelling
converts to the same model; a Megatron target keeps the source's spelling unless
``--dst-mtp-layer-name`` asks otherwise; torch_dist keys are ``transformer_layer`` either way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.checkpoint_compare import read_dcp
from support.cli_helpers import assert_clean_refusal
from support.megatron_fixtures import load_for_test
from support.mtp_models import (
    NEW,
    OLD,
    assert_same_tensors,
    from_args_alone,
    model_keys,
    rank_files,
    respelled,
    with_mtp,
)

import pgconvert
from pgconvert.cli import main

@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny V3 with an MTP layer in HF form, per rank (TP2/PP2/EP2, local and TE spec) as megatron-core
    0.16.1 names it, and the same files as Megatron-LM d98e8a64 names them."""
    root = tmp_path_factory.mktemp("mtpname")
    made = {"hf": with_mtp("v3", root / "hf")}
    for impl in ("local", "transformer_engine"):
        pgconvert.convert(made["hf"], root / impl, dst_format="megatron", dst_tp=2, dst_pp=2, dst_ep=2,
                          dst_transformer_impl=impl)
        made[impl] = root / impl
        made[f"{impl}_d98"] = respelled(root / impl, root / f"{impl}_d98")
    return made


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_a_d98_per_rank_source_converts_to_the_same_hf_model(made: dict[str, Path], tmp_path: Path,
                                                             impl: str) -> None:
    keys = model_keys(made[f"{impl}_d98"])
    assert any(NEW in key for key in keys) and not any(OLD in key for key in keys if key.startswith("mtp."))
    ours = from_args_alone(made[impl], tmp_path / "ours")
    theirs = from_args_alone(made[f"{impl}_d98"], tmp_path / "theirs")

    assert_same_tensors(ours, theirs)
    assert_same_tensors(made["hf"], theirs)


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_megatron_to_megatron_keeps_the_sources_spelling(made: dict[str, Path], tmp_path: Path, impl: str) -> None:
    pgconvert.convert(made[f"{impl}_d98"], tmp_path / "tp1", dst_format="megatron", dst_tp=1, dst_pp=1, dst_ep=1)
    pgconvert.convert(made[impl], tmp_path / "tp1_ours", dst_format="megatron", dst_tp=1, dst_pp=1, dst_ep=1)
    theirs, ours = (load_for_test(rank_files(tmp_path / name)[0])["model"] for name in ("tp1", "tp1_ours"))

    # Every key (TE _extra_state entries included) is the 0.16.1 file's key respelled, every tensor equal.
    assert sorted(theirs) == sorted(key.replace(OLD, NEW, 1) if key.startswith("mtp.") else key for key in ours)
    for key, value in ours.items():
        mine = theirs[key.replace(OLD, NEW, 1) if key.startswith("mtp.") else key]
        assert (torch.equal(mine, value) if isinstance(value, torch.Tensor) else type(mine) is type(value)), key
    assert_same_tensors(made["hf"], from_args_alone(tmp_path / "tp1", tmp_path / "out"))


def test_an_hf_source_is_written_with_megatron_core_0_16_1s_spelling_unless_asked(made: dict[str, Path],
                                                                                  tmp_path: Path) -> None:
    assert any(OLD in key for key in model_keys(made["local"]) if key.startswith("mtp."))
    pgconvert.convert(made["hf"], tmp_path / "asked", dst_format="megatron", dst_tp=2, dst_pp=2, dst_ep=2,
                      dst_mtp_layer_name="mtp_model_layer")
    for ours, asked in zip(rank_files(made["local"]), rank_files(tmp_path / "asked"), strict=True):
        expected = load_for_test(made["local_d98"] / ours.relative_to(made["local"]))["model"]
        got = load_for_test(asked)["model"]
        assert sorted(got) == sorted(expected)
        assert all(torch.equal(got[key], value) for key, value in expected.items() if isinstance(value, torch.Tensor))
    # And back: a d98 source written with 0.16.1's spelling when asked.
    pgconvert.convert(made["local_d98"], tmp_path / "back", dst_format="megatron",
                      dst_mtp_layer_name="transformer_layer")
    assert model_keys(tmp_path / "back") == model_keys(made["local"])


def test_torch_dist_keys_are_transformer_layer_from_either_spelling(made: dict[str, Path], tmp_path: Path) -> None:
    pgconvert.convert(made["local_d98"], tmp_path / "dist", dst_format="torch_dist", dst_tp=1, dst_pp=1, dst_ep=1)
    pgconvert.convert(made["local"], tmp_path / "dist_ours", dst_format="torch_dist", dst_tp=1, dst_pp=1, dst_ep=1)
    (theirs_dir,), (ours_dir,) = (tmp_path / "dist").glob("iter_*"), (tmp_path / "dist_ours").glob("iter_*")
    metadata, theirs = read_dcp(theirs_dir)
    ours = read_dcp(ours_dir)[1]

    assert not [key for key in metadata.state_dict_metadata if "mtp_model_layer" in key]
    assert [key for key in theirs if key.startswith("mtp.layers.0.transformer_layer.")]
    assert sorted(metadata.state_dict_metadata) == sorted(read_dcp(ours_dir)[0].state_dict_metadata)
    assert sorted(theirs) == sorted(ours) and all(torch.equal(theirs[key], ours[key]) for key in ours)
    assert_same_tensors(made["hf"], from_args_alone(tmp_path / "dist", tmp_path / "out"))


def test_a_file_with_both_spellings_is_a_named_error(made: dict[str, Path], tmp_path: Path) -> None:
    broken = respelled(made["local"], tmp_path / "both", both=True)
    result = CliRunner().invoke(main, ["convert", str(broken), str(tmp_path / "out"), "--dst-format", "hf"],
                                prog_name="pgconvert")

    assert_clean_refusal(result, 1, "named both ways in one file", "mtp_model_layer", "transformer_layer",
                         "model_optim_rng.pt")
    assert not (tmp_path / "out" / "config.json").exists()


def test_the_option_is_recorded_in_the_manifest(made: dict[str, Path], tmp_path: Path) -> None:
    pgconvert.convert(made["hf"], tmp_path / "m", dst_format="megatron", dst_mtp_layer_name="mtp_model_layer")
    manifest = json.loads((tmp_path / "m" / "pgconvert.json").read_text())
    assert "mtp_model_layer" in json.dumps(manifest)


def test_rank_files_that_disagree_on_the_spelling_are_a_named_error(made: dict[str, Path], tmp_path: Path) -> None:
    mixed = tmp_path / "mixed"
    shutil.copytree(made["local"], mixed)
    last = [path for path in rank_files(mixed) if any(key.startswith("mtp.") for key in load_for_test(path)["model"])]
    d98 = made["local_d98"] / last[0].relative_to(mixed)
    shutil.copyfile(d98, last[0])  # one MTP-stage rank as Megatron-LM d98e8a64 writes it, the others as 0.16.1
    result = CliRunner().invoke(main, ["convert", str(mixed), str(tmp_path / "out"), "--dst-format", "hf"],
                                prog_name="pgconvert")

    assert_clean_refusal(result, 1, "rank files name the MTP layer's inner layer differently",
                         "mtp_model_layer and transformer_layer")
