"""Every way Megatron-LM's command line spells a setting reads as megatron-core computes it.

The args are Megatron-LM's own: its ``parse_args`` + ``validate_args`` at three commits (d98e8a64,
core_v0.15.0, 23.08) for each flag of every args field pgconvert reads and for groups of spellings of
one setting (an older flag, an int or a list pattern, a flag left out), with what its
``core_transformer_config_from_args`` and ``gpt_builder`` made of them (tests/data/megatron_args/,
scripts/make_megatron_args_goldens.py). pgconvert's ``ModelConfig`` and ``ParallelLayout`` read from those
args must hold megatron-core's values, and every spelling of a setting must read as its canonical one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.megatron_args_cases import recording_class
from support.megatron_args_goldens import (
    VERSIONS, GoldenCase, cases, differing, golden, megatron_core_layout, megatron_core_layers, megatron_core_values,
    spelling_groups,
)

from pgconvert.formats.megatron import config_from_args, layout_from_args
from pgconvert.formats.megatron_args import MEGATRON_ARGS
from pgconvert.loaders.megatron import _detect_impl
from pgconvert.model.config import ModelConfig
from pgconvert.model.layout import ParallelLayout
from pgconvert.semantics import SEMANTICS

PATH = Path("ckpt/iter_0000001/mp_rank_00/model_optim_rng.pt")
CASES = cases()
GROUPS = spelling_groups()


# Where pgconvert reads what newer Megatron-LM computes, not what an older one's megatron-core did:
# version -> {args field set: the ModelConfig setting}. Megatron-LM 23.08's core_transformer_config_from_args
# maps only --swiglu to an activation (megatron/arguments.py:423); its --squared-relu reached only the legacy
# model (megatron/model/transformer.py:114); from core_v0.4.0 on, megatron-core computes it.
NEWER_MEANING = {"23.08": {"squared_relu": "activation"}}


def _newer_meaning(case: GoldenCase) -> set[str]:
    return {setting for name, setting in NEWER_MEANING.get(case.version, {}).items() if case.args.get(name)}


@dataclass(frozen=True)
class Read:
    layout: ParallelLayout
    config: ModelConfig
    notices: list[str]


def read(args: Any) -> Read:
    """What pgconvert's Megatron loaders read from ``args`` (strict: a None Megatron never writes is refused)."""
    notices: list[str] = []
    layout = layout_from_args(args, PATH, strict=True, notices=notices)
    config = config_from_args(args, PATH, _detect_impl({}, args), None,
                              grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)))
    return Read(layout, config, notices)


def _layout_values(layout: ParallelLayout) -> dict[str, Any]:
    return {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "first_stage_layers": layout.first_stage_layers,
            "last_stage_layers": layout.last_stage_layers, "pipeline_layout": layout.pipeline_layout,
            "vpp": layout.virtual_size if layout.has_virtual_chunks else None, "expert_tp_size": layout.expert_tp_size}


def _layer_values(config: ModelConfig) -> dict[str, list[int]]:
    return {"moe": [int(layer.moe) for layer in config.layers], "window": [int(layer.window) for layer in config.layers],
            "rope": [int(layer.rope) for layer in config.layers]}


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_megatron_lms_own_args_read_as_megatron_core_computes_them(case: GoldenCase) -> None:
    got = read(case.namespace())

    assert got.notices == []
    differs = differing(megatron_core_values(case), got.config.to_dict())
    assert set(differs) == _newer_meaning(case), differs
    assert differing(megatron_core_layout(case), _layout_values(got.layout)) == {}
    layers = _layer_values(got.config)
    assert {name: pattern for name, pattern in megatron_core_layers(case).items() if layers[name] != pattern} == {}


def _comparable(case: GoldenCase, config: ModelConfig, canonical: GoldenCase) -> ModelConfig:
    """``config`` with the settings whose Megatron-LM default differs between versions set as the canonical
    version's: transformer_impl (23.08's default is 'local'; a per-rank checkpoint's keys decide it)."""
    if case.version == canonical.version:
        return config
    return config.replace(transformer_impl=read(canonical.namespace()).config.transformer_impl)


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_spelling_of_a_setting_reads_as_its_canonical_spelling(group: str) -> None:
    canonical, *variants = GROUPS[group]
    expected = read(canonical.namespace())

    for variant in variants:
        got = read(variant.namespace())
        assert got.layout == expected.layout, variant.id
        assert _comparable(variant, got.config, canonical) == expected.config, variant.id


def test_the_spelling_groups_span_the_versions() -> None:
    """Each group holds a spelling from the newest commit, and the older flags are spelled by the older ones."""
    spelled = {(case.version, case.variant) for case in CASES}

    assert all(members[0].version == VERSIONS[0] for members in GROUPS.values())
    assert ("23.08", "--layernorm-epsilon") in spelled and ("core_v0.15.0", "--norm-epsilon") in spelled
    assert {case.version for case in GROUPS["zero-centred gamma"]} == set(VERSIONS)


def _table_fields() -> set[str]:
    return {row.name for row in MEGATRON_ARGS} | {name for row in SEMANTICS for name in row.megatron}


@pytest.mark.parametrize("version", VERSIONS)
def test_the_goldens_record_every_field_the_tables_name(version: str) -> None:
    """Each field a table row names is recorded or known absent from the version's args, and each of its
    flags has a case: a new row needs the goldens regenerated (scripts/make_megatron_args_goldens.py)."""
    data = golden(version)
    cased = {f"field:{case['variant']}" for case in data["cases"] if case["group"].startswith("field:")}

    assert sorted(_table_fields() - set(data["base_args"]) - set(data["absent_fields"])) == []
    assert sorted(f"field:{flag}" for name, flags in data["flags"].items() if name not in data["uncased_fields"]
                  for flag in flags if f"field:{flag}" not in cased) == []


@pytest.mark.parametrize("version", VERSIONS)
def test_the_goldens_hold_every_field_the_readers_read(version: str) -> None:
    """A field the readers ask a golden's args for is one the golden recorded, or one the version never writes."""
    recording, reads = recording_class()
    for case in CASES:
        if case.version == version:
            read(recording(**vars(case.namespace())))
    data = golden(version)

    assert reads and sorted(reads - set(data["base_args"]) - set(data["absent_fields"])) == []
