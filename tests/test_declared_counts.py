"""A count or size a checkpoint declares (config.json, Megatron args) is bounded by what it stores
before it drives any work: each one set to 10**9, or to one more than stored, ends in an error naming
the key as written, its value and the file, within a memory and time bound; or, for a setting
that shapes no tensor, converts the same tensors.

The HF cases are generated from the family tables (every integer config.json field, every key a
family's rules read, the MTP layer count) over a tiny checkpoint of each family made from its
table (tests/support/declared_fixtures.py): a new family gets its cases without a line here. The
Megatron cases are generated from the model's integer settings the args hold. Everything runs in
this process through the plan (``--dry-run``) API; the CLI, inspect and verify are checked on a few.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from support.declared_fixtures import Measured, bounded, count_keys, counted_keys, tiny_config, write_family_checkpoint
from support.megatron_fixtures import load_for_test
from support.torch_dist_forms import FOR_MCORE_016

import pgconvert
from pgconvert.cli import main
from pgconvert.errors import PgconvertError
from pgconvert.families import FAMILIES, ORDERED
from pgconvert.families.table import Family
from pgconvert.formats import LoadOptions
from pgconvert.formats.registry import detect_format, get_loader
from pgconvert.model.declared import shape_settings
from pgconvert.model.provider import layer_kinds
from pgconvert.run.convert import ConvertRequest, plan

HUGE = 10**9
SECONDS = 5.0
PEAK_GROWTH = 200 << 20


HF_CASES = [(family.architecture, key) for family in ORDERED for key in count_keys(family)]


@pytest.fixture(scope="module")
def family_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("declared_families")
    return {architecture: write_family_checkpoint(family, root / architecture)
            for architecture, family in FAMILIES.items()}


def _tensors(src: Path) -> dict[str, tuple[int, ...]]:
    """The canonical tensors a conversion of ``src`` plans (the ``--dry-run`` path), by shape."""
    planned = plan(ConvertRequest(src=src, dst=src.parent / "dst", dst_format="megatron"), check_dst=False)
    try:
        return {name: planned.source.meta(name).shape for name in planned.source.names()}
    finally:
        planned.source.close()


@pytest.fixture(scope="module")
def pristine(family_sources: dict[str, Path]) -> dict[str, dict[str, tuple[int, ...]]]:
    return {architecture: _tensors(src) for architecture, src in family_sources.items()}


def _edited(src: Path, where: Path, changes: dict[str, Any]) -> Path:
    copy = Path(shutil.copytree(src, where / "src"))
    doc = json.loads((copy / "config.json").read_text())
    doc.update(changes)
    (copy / "config.json").write_text(json.dumps(doc))
    return copy


def assert_bounded(measured: Measured, what: str) -> None:
    assert not isinstance(measured.error, MemoryError), f"{what}: ran out of memory"
    assert measured.seconds < SECONDS, f"{what}: took {measured.seconds:.1f} s"
    assert measured.peak_growth < PEAK_GROWTH, f"{what}: resident memory grew {measured.peak_growth >> 20} MiB"


def assert_named_error(measured: Measured, src: Path, *fragments: str) -> None:
    assert isinstance(measured.error, PgconvertError), repr(measured.error)
    message = str(measured.error)
    assert str(src) in message, message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize(("architecture", "key"), HF_CASES)
def test_a_config_json_count_of_a_billion_is_refused_by_name_or_shapes_no_tensor(
        family_sources: dict[str, Path], pristine: dict[str, dict[str, tuple[int, ...]]], tmp_path: Path,
        architecture: str, key: str) -> None:
    src = _edited(family_sources[architecture], tmp_path, {key: HUGE})

    measured = bounded(lambda: _tensors(src))

    assert_bounded(measured, f"{architecture} {key}={HUGE}")
    if measured.error is None:
        assert measured.result == pristine[architecture]
    else:
        assert_named_error(measured, src, f"{key}={HUGE}")


def _one_more(family: Family, doc: dict[str, Any]) -> list[tuple[str, int]]:
    """Each integer count or size config.json holds, one more than it is."""
    return [(key, doc[key] + 1) for key in count_keys(family)
            if isinstance(doc.get(key), int) and not isinstance(doc.get(key), bool)]


ONE_MORE_FAMILIES = [family.architecture for family in ORDERED]


@pytest.mark.parametrize("architecture", ONE_MORE_FAMILIES)
def test_a_config_json_count_one_more_than_stored_is_refused_by_name_or_shapes_no_tensor(
        family_sources: dict[str, Path], pristine: dict[str, dict[str, tuple[int, ...]]], tmp_path: Path,
        architecture: str) -> None:
    family = FAMILIES[architecture]
    doc = json.loads((family_sources[architecture] / "config.json").read_text())
    must_refuse = set(counted_keys(family))
    refused = []
    for key, value in _one_more(family, doc):
        where = tmp_path / key
        where.mkdir()
        src = _edited(family_sources[architecture], where, {key: value})

        measured = bounded(lambda: _tensors(src))

        assert_bounded(measured, f"{architecture} {key}={value}")
        if measured.error is None:
            assert key not in must_refuse and measured.result == pristine[architecture], key
        else:
            assert_named_error(measured, src, f"{key}={value}")
            refused.append(key)
    assert must_refuse & {key for key, _ in _one_more(family, doc)} <= set(refused)


def test_every_family_has_a_checkpoint_and_counts_to_fuzz(pristine: dict[str, dict[str, tuple[int, ...]]]) -> None:
    assert set(pristine) == set(FAMILIES)
    assert all(len(tensors) > 10 for tensors in pristine.values())
    assert all("num_hidden_layers" in count_keys(family) for family in ORDERED)


# ------------------------------------------------------------------------------------ every command

@pytest.mark.parametrize("key", ["num_hidden_layers", "n_routed_experts", "num_nextn_predict_layers"])
def test_convert_dry_run_inspect_and_verify_refuse_a_huge_count_quickly(
        family_sources: dict[str, Path], tmp_path: Path, key: str) -> None:
    src = _edited(family_sources["DeepseekV3ForCausalLM"], tmp_path, {key: HUGE})
    commands = {
        "convert": lambda: pgconvert.convert(src, tmp_path / "out"),
        "dry-run": lambda: CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "dry"), "--dry-run"]),
        "inspect": lambda: pgconvert.inspect(src),
        "verify": lambda: pgconvert.verify(src, src),
    }
    for command, call in commands.items():
        measured = bounded(call)

        assert_bounded(measured, command)
        if command == "dry-run":
            assert measured.result.exit_code == 1 and f"{key}={HUGE}" in measured.result.output, measured.result.output
        elif command == "inspect":
            assert not measured.result.ok and f"{key}={HUGE}" in measured.result.problems[0].message
        else:
            assert_named_error(measured, src, f"{key}={HUGE}")
    assert not (tmp_path / "out").exists() and not (tmp_path / "dry").exists()


# ------------------------------------------------------------------------------------ Megatron args

@pytest.fixture(scope="module")
def megatron_sources(family_sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """DeepSeek-V3 (MLA, a dense layer among MoE ones, shared experts, an MTP layer) per rank at
    PP2·EP2 and as torch_dist, and Mixtral (every layer MoE: stacked torch_dist keys)."""
    root = tmp_path_factory.mktemp("declared_megatron")
    deepseek, mixtral = family_sources["DeepseekV3ForCausalLM"], family_sources["MixtralForCausalLM"]
    pgconvert.convert(deepseek, root / "megatron", dst_format="megatron", dst_pp=2, dst_first_stage_layers=1, dst_ep=2)
    pgconvert.convert(deepseek, root / "torch_dist", dst_format="torch_dist", dst_ep=2, **FOR_MCORE_016)
    pgconvert.convert(mixtral, root / "torch_dist_stacked", dst_format="torch_dist", dst_ep=2, **FOR_MCORE_016)
    return {name: root / name for name in ("megatron", "torch_dist", "torch_dist_stacked")}


def _args_files(src: Path) -> list[Path]:
    return sorted(src.glob("*/mp_rank_*/model_optim_rng.pt")) + sorted(src.glob("*/common.pt"))


def _model_arg_ints(src: Path) -> dict[str, int]:
    """The model's integer settings (ModelConfig names) its args hold."""
    with get_loader(detect_format(src)).open(src, LoadOptions()) as source:
        settings = source.config.to_dict()
        args = source.megatron_args
    return {name: value for name, value in settings.items()
            if isinstance(value, int) and not isinstance(value, bool) and isinstance(getattr(args, name, None), int)}


def _set_args(src: Path, where: Path, name: str, value: int) -> Path:
    copy = Path(shutil.copytree(src, where / "src"))
    for path in _args_files(copy):
        state = load_for_test(path)
        setattr(state["args"], name, value)
        torch.save(state, path)
    return copy


MEGATRON_FORMATS = ("megatron", "torch_dist", "torch_dist_stacked")
# The counts each fixture must refuse one more of (the rest may equally be settings that shape nothing).
COUNTED_ARGS = ("num_layers", "num_experts", "mtp_num_layers")


@pytest.mark.parametrize("fmt", MEGATRON_FORMATS)
def test_megatron_args_of_a_billion_or_one_more_are_refused_by_name_or_shape_no_tensor(
        megatron_sources: dict[str, Path], tmp_path: Path, fmt: str) -> None:
    src = megatron_sources[fmt]
    expected = _tensors(src)
    ints = _model_arg_ints(src)
    assert {"num_layers", "hidden_size", "num_attention_heads", "num_experts"} <= set(ints)
    for name, stored in sorted(ints.items()):
        for value in (HUGE, stored + 1):
            where = tmp_path / f"{name}-{value}"
            where.mkdir()
            copy = _set_args(src, where, name, value)

            measured = bounded(lambda: _tensors(copy))

            assert_bounded(measured, f"{fmt} args.{name}={value}")
            if measured.error is None:
                assert name not in COUNTED_ARGS and measured.result == expected, (name, value)
            else:
                assert_named_error(measured, copy, name, str(value))


# ------------------------------------------------------------------------------------ naming what a shape reads

@pytest.mark.parametrize("architecture", [family.architecture for family in ORDERED])
def test_shape_settings_read_every_kinds_shape_as_the_config_gives_it(architecture: str) -> None:
    config = tiny_config(FAMILIES[architecture])
    names = set(config.setting_names())

    for name, kind in layer_kinds(config).items():
        read: list[tuple[int, ...]] = []
        settings = shape_settings(lambda c: read.append(tuple(kind.shape(c))), config)

        assert read == [tuple(kind.shape(config))], name
        assert settings and set(settings) <= names, (name, settings)
    assert shape_settings(lambda c: c.attention.qkv_rows * c.hidden_size, config) == [
        "num_attention_heads", "num_query_groups", "kv_channels", "attention_output_gate", "hidden_size"]
