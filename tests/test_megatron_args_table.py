"""The table of every Megatron ``args`` field pgconvert reads (``pgconvert.formats.megatron_args``) tells the
truth: a None that Megatron-LM never writes reads as the table's value and is named in a notice
(``--strict`` refuses it), every field a reader asks for has a row, and the docs show the table."""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from support.megatron_args_cases import ARGS_PATH, CASES, read_all, recording_class
from support.megatron_fixtures import load_for_test, make_full_model, write_megatron_checkpoint
from support.tiny_models import GQA_SWIGLU
from support.torch_dist_forms import FOR_MCORE_016
from support.structure_reads import patch_structure_reads

import pgconvert
import pgconvert.formats.megatron as megatron_format
from pgconvert.cli import main
from pgconvert.errors import StrictModeError
from pgconvert.formats import LoadOptions
from pgconvert.formats.megatron_args import ARG_FIELDS, MEGATRON_ARGS, ArgField, markdown_table
from pgconvert.loaders.torch_dist import TorchDistLoader

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
NOTICE_ROWS = [row for row in MEGATRON_ARGS if row.notices_none]


def _case_for(row: ArgField) -> argparse.Namespace:
    """The first representative args whose model or run uses ``row``'s field."""
    for make in CASES.values():
        args = make()
        if row.when(args):
            return args
    raise AssertionError(f"no case in support.megatron_args_cases uses args.{row.name}; add one")


def _with(args: argparse.Namespace, name: str, value: Any) -> argparse.Namespace:
    changed = copy.copy(args)
    setattr(changed, name, value)
    return changed


@pytest.mark.parametrize("row", NOTICE_ROWS, ids=[row.name for row in NOTICE_ROWS])
def test_a_none_megatron_never_writes_reads_as_the_tables_value_with_a_notice(row: ArgField) -> None:
    args = _case_for(row)
    notices: list[str] = []

    read = read_all(_with(args, row.name, None), notices=notices)

    assert len(notices) == 1, notices
    assert str(ARGS_PATH) in notices[0] and f"args.{row.name}=None" in notices[0]
    if row.value is None:
        assert row.none in notices[0]
    else:
        value = row.value(args)
        assert repr(value) in notices[0] and row.why in notices[0]
        assert read == read_all(_with(args, row.name, value))


@pytest.mark.parametrize("row", NOTICE_ROWS, ids=[row.name for row in NOTICE_ROWS])
def test_strict_refuses_a_none_megatron_never_writes(row: ArgField) -> None:
    with pytest.raises(StrictModeError, match=f"{ARGS_PATH}: args.{row.name}=None"):
        read_all(_with(_case_for(row), row.name, None), strict=True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_none_megatron_writes_and_pgconverts_own_args_give_no_notice(name: str) -> None:
    notices: list[str] = []

    read_all(CASES[name](), strict=True, notices=notices)

    assert notices == []


def test_ffn_hidden_size_none_is_megatrons_swiglu_size() -> None:
    """validate_args: with --swiglu int(4 * hidden * 2 / 3 / 64) * 64, not 4 * hidden."""
    args = _with(CASES["dense GQA SwiGLU"](), "ffn_hidden_size", None)

    assert args.swiglu and args.hidden_size == 64
    assert read_all(args)["config"].mlp.ffn_hidden_size == 128


def test_the_data_parallel_size_of_args_without_one_is_megatrons() -> None:
    """validate_args: world_size // (tp * pp * cp); these args record world 8 at tp 2."""
    args = CASES["older Megatron-LM"]()

    assert not hasattr(args, "data_parallel_size") and (args.world_size, args.tensor_model_parallel_size) == (8, 2)
    assert read_all(args)["dp"] == 4


def test_every_field_the_readers_ask_for_has_a_row() -> None:
    recording, reads = recording_class()
    for make in CASES.values():
        read_all(recording(**vars(make())))

    assert reads and sorted(reads - set(ARG_FIELDS)) == []


@pytest.fixture(scope="module")
def golden_reads(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every args field read while Megatron-LM's own distributed-optimizer checkpoint is converted to
    torch_dist with its optimizer and that one's optimizer state is exported (both loaders, the
    optimizer sources and savers, the counters)."""
    recording, reads = recording_class()
    load, structure = torch.load, megatron_format.safe_torch_structure

    def recorded(loaded: Any, path: object) -> Any:
        # A source's args (not those of a file being written, which pgconvert reads back to rewrite).
        if isinstance(loaded, dict) and isinstance(loaded.get("args"), argparse.Namespace) \
                and ".pgconvert" not in str(path):
            loaded["args"] = recording(**vars(loaded["args"]))
        return loaded

    def recording_load(*args: Any, **kwargs: Any) -> Any:
        return recorded(load(*args, **kwargs), args[0])

    def recording_structure(*args: Any, **kwargs: Any) -> Any:
        return recorded(structure(*args, **kwargs), args[0])

    tmp = tmp_path_factory.mktemp("golden_reads")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "load", recording_load)
        # the rank files: read as their structure, which records them
        patch_structure_reads(patch, recording_structure)
        # common.pt: its args are read with torch.load, which records them
        pgconvert.convert(GOLDENS / "train_tp2dp2_distopt_bf16_torch", tmp / "td", dst_format="torch_dist",
                          **FOR_MCORE_016)
        result = CliRunner().invoke(main, ["export-optimizer", str(tmp / "td"), str(tmp / "exported")])
    assert result.exit_code == 0, result.output
    return reads


def test_every_field_a_conversion_reads_has_a_row(golden_reads: set[str]) -> None:
    assert "padded_vocab_size" in golden_reads and "consumed_train_samples" in golden_reads
    assert sorted(golden_reads - set(ARG_FIELDS)) == []


def test_every_row_is_a_field_some_reader_reads(golden_reads: set[str]) -> None:
    recording, reads = recording_class()
    for make in CASES.values():
        read_all(recording(**vars(make())))
    # Fields only checked for presence on the target's copy of the args have no reader to record.
    unread = {row.name for row in MEGATRON_ARGS} - reads - golden_reads

    assert sorted(unread) == ["apply_query_key_layer_scaling", "sequence_parallel"]


def test_megatron_lms_own_checkpoints_give_no_notice() -> None:
    for golden in sorted(path for path in GOLDENS.iterdir() if path.is_dir()):
        info = pgconvert.inspect(golden)

        assert info.ok and [notice for notice in info.notices if "args." in notice] == [], golden.name


def test_the_docs_show_the_table() -> None:
    safety = (Path(__file__).parent.parent / "docs" / "safety.md").read_text()

    assert markdown_table() in safety, ("docs/safety.md: regenerate the table with python -c 'from "
                                        "pgconvert.formats.megatron_args import markdown_table; print(markdown_table())'")


# --- a real checkpoint --------------------------------------------------------------------------------------

def _set_in_every_rank_file(root: Path, name: str, value: Any) -> None:
    for path in sorted(root.glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        state = load_for_test(path)
        setattr(state["args"], name, value)
        torch.save(state, path)


@pytest.fixture
def tp2(tmp_path: Path) -> Path:
    return write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)


def test_cli_strict_refuses_a_checkpoint_with_rotary_base_none(tp2: Path, tmp_path: Path) -> None:
    _set_in_every_rank_file(tp2, "rotary_base", None)

    refused = CliRunner().invoke(main, ["--strict", "--dst-tp", "1", str(tp2), str(tmp_path / "strict")])
    converted = CliRunner().invoke(main, ["--dst-tp", "1", str(tp2), str(tmp_path / "out")])

    assert refused.exit_code == 2, refused.output
    assert "mp_rank_00/model_optim_rng.pt: args.rotary_base=None" in refused.output
    assert "using 10000 (Megatron-LM's default)" in refused.output and "Traceback" not in refused.output
    assert not (tmp_path / "strict").exists()
    assert converted.exit_code == 0, converted.output
    assert "args.rotary_base=None" in converted.output


def test_a_checkpoint_with_ffn_hidden_size_none_converts_as_megatron_sized_it(tp2: Path, tmp_path: Path) -> None:
    """GQA_SWIGLU's ffn (128) is what validate_args derives for hidden 64 with --swiglu."""
    pgconvert.convert(tp2, tmp_path / "explicit", dst_tp=1)
    _set_in_every_rank_file(tp2, "ffn_hidden_size", None)

    result = pgconvert.convert(tp2, tmp_path / "derived", dst_tp=1)

    assert any("args.ffn_hidden_size=None" in notice and "using 128" in notice for notice in result.notices)
    rank_file = Path("iter_0000100", "mp_rank_00", "model_optim_rng.pt")
    explicit: Any = load_for_test(tmp_path / "explicit" / rank_file)
    derived: Any = load_for_test(tmp_path / "derived" / rank_file)
    assert derived["args"].ffn_hidden_size == 128
    tensors = {key: value for key, value in explicit["model"].items() if isinstance(value, torch.Tensor)}
    assert tensors and tensors.keys() == {key for key, value in derived["model"].items()
                                          if isinstance(value, torch.Tensor)}
    for key, tensor in tensors.items():
        assert torch.equal(tensor, derived["model"][key]), key


def test_the_torch_dist_loader_names_each_none_once_and_strict_refuses(tp2: Path, tmp_path: Path) -> None:
    pgconvert.convert(tp2, tmp_path / "td", dst_format="torch_dist", **FOR_MCORE_016)
    common_path = tmp_path / "td" / "iter_0000100" / "common.pt"
    common: Any = load_for_test(common_path)
    common["args"].transformer_impl = None
    common["args"].swiglu = None
    torch.save(common, common_path)

    with pytest.raises(StrictModeError, match=r"common\.pt: args\.swiglu=None"):
        TorchDistLoader().open(tmp_path / "td", LoadOptions(strict=True))
    with TorchDistLoader().open(tmp_path / "td", LoadOptions()) as source:
        notices = [notice for notice in source.notices if "=None" in notice]

    assert len(notices) == 2, notices
    assert any("args.swiglu=None, which Megatron-LM never writes: using False" in notice for notice in notices)
    assert any("args.transformer_impl=None, which Megatron-LM never writes: using 'transformer_engine'" in notice
               for notice in notices)
