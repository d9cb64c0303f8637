"""Every structure a checkpoint declares is stored, or the conversion is refused naming the key that
declares it and what is missing: decoder layers, routed experts, shared experts, an untied output
layer, multi-token prediction (MTP) layers; in an HF checkpoint (every family, from its table:
tests/support/declared_fixtures.py) and in Megatron rank files. The one exception, MTP layers that
transformers' configs declare by default and its models never store, converts without them with a
notice (refused under --strict), and the written config.json declares none.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.declared_fixtures import bounded, tiny_config, write_family_checkpoint
from support.megatron_fixtures import load_for_test

import pgconvert
from pgconvert.errors import CheckpointError, StrictModeError
from pgconvert.families import FAMILIES, ORDERED
from pgconvert.families.mtp import HF_LAYER
from pgconvert.formats import LoadOptions
from pgconvert.loaders.hf import HFLoader
from pgconvert.model.provider import OUTPUT_LAYER, canonical_layer, is_routed_expert

MOE = [family.architecture for family in ORDERED if tiny_config(family).moe.num_experts is not None]
# GPT-OSS stacks a layer's experts in one tensor: one expert cannot be left out of it.
PER_EXPERT = [name for name in MOE if not any(row.stacked for row in FAMILIES[name].tensors.rows)]
SHARED = [family.architecture for family in ORDERED if tiny_config(family).moe.moe_shared_expert_intermediate_size]
UNTIED = [family.architecture for family in ORDERED if not tiny_config(family).tie_embeddings]
WITH_MTP = [family.architecture for family in ORDERED if tiny_config(family).mtp_num_layers]


@pytest.fixture(scope="module")
def family_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("structure_families")
    return {family.architecture: write_family_checkpoint(family, root / family.architecture) for family in ORDERED}


def _config_json(src: Path) -> dict[str, Any]:
    return json.loads((src / "config.json").read_text())


def _key(architecture: str, doc: dict[str, Any], setting: str) -> str:
    """The config.json key holding ``setting`` (the first spelling the file holds): a field's, else the first key of
    the rule that reads it (Nemotron-H's expert rule: ``n_routed_experts``)."""
    family = FAMILIES[architecture]
    spec = next((spec for spec in family.fields if spec.model_field == setting), None)
    if spec is None:
        rule = next(rule for rule in family.rules if setting in rule.model_fields)
        return next(key for key in (*rule.keys, *rule.legacy_keys) if key in doc)
    return next(".".join(where) for where in (spec.path, *spec.legacy) if ".".join(where) in doc)


def _without(src: Path, where: Path, leaves_out: Callable[[str], bool],
             stored: Callable[[str], bool] = lambda name: False) -> tuple[Path, list[str]]:
    """A copy of ``src`` without the HF tensors of the canonical tensors ``leaves_out`` picks, and
    without the HF tensors ``stored`` picks."""
    copy = Path(shutil.copytree(src, where / "src"))
    tensors = load_file(str(copy / "model.safetensors"))
    with HFLoader().open(copy, LoadOptions()) as source:
        dropped = sorted({hf for name in source.names() if leaves_out(name) for hf in source.stored_names(name)}
                         | {name for name in tensors if stored(name)})
    assert dropped and set(dropped) <= set(tensors)
    save_file({name: tensor for name, tensor in tensors.items() if name not in dropped},
              str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy, dropped


def _refusal(src: Path, **options: Any) -> str:
    with pytest.raises(CheckpointError) as raised:
        pgconvert.convert(src, src.parent / "out", dst_format="megatron", **options)
    assert not (src.parent / "out").exists()
    return str(raised.value)


def _in_layer(layer: int) -> Callable[[str], bool]:
    return lambda name: (canonical_layer(name) or (-1, ""))[0] == layer


@pytest.mark.parametrize("architecture", [family.architecture for family in ORDERED])
def test_a_declared_decoder_layer_that_is_not_stored_is_refused_naming_num_hidden_layers(
        family_sources: dict[str, Path], tmp_path: Path, architecture: str) -> None:
    layers = _config_json(family_sources[architecture])["num_hidden_layers"]
    src, _ = _without(family_sources[architecture], tmp_path, _in_layer(layers - 1))
    # A family whose layer count is the length of its layer kinds' list (Nemotron-H) names that list.
    counted = ("num_hidden_layers" if any(spec.model_field == "num_layers" for spec in FAMILIES[architecture].fields)
               else "len(layers_block_type)")

    message = _refusal(src)

    assert f"{src / 'config.json'}: {counted}={layers}, but the checkpoint stores {layers - 1} decoder layer(s)" \
        in message


def _last_expert(architecture: str, layers: set[int] | None = None) -> Callable[[str], bool]:
    """The last routed expert's tensors: in ``layers``, or in every layer (MTP layers included)."""
    experts = tiny_config(FAMILIES[architecture]).moe.num_experts

    def picks(name: str) -> bool:
        layer = canonical_layer(name)
        return (is_routed_expert(name) and f".local_experts.{experts - 1}." in name
                and (layers is None or (layer is not None and layer[0] in layers)))
    return picks


@pytest.mark.parametrize("architecture", PER_EXPERT)
def test_a_routed_expert_missing_from_one_layer_is_refused_naming_the_expert_count(
        family_sources: dict[str, Path], tmp_path: Path, architecture: str) -> None:
    doc = _config_json(family_sources[architecture])
    key = _key(architecture, doc, "num_experts")
    src, dropped = _without(family_sources[architecture], tmp_path, _last_expert(architecture, {2}))

    message = _refusal(src)

    assert f"missing: {dropped}" in message and f"declares by {key}={doc[key]}" in message, message


@pytest.mark.parametrize("architecture", PER_EXPERT)
def test_an_expert_count_beyond_every_layers_stored_experts_is_refused_by_the_count(
        family_sources: dict[str, Path], tmp_path: Path, architecture: str) -> None:
    doc = _config_json(family_sources[architecture])
    key = _key(architecture, doc, "num_experts")
    src, _ = _without(family_sources[architecture], tmp_path, _last_expert(architecture))

    message = _refusal(src)

    assert f"{key}={doc[key]}, but the checkpoint stores {doc[key] - 1} routed expert(s) in a layer at most" in message


@pytest.mark.parametrize("architecture", SHARED)
def test_declared_shared_experts_that_are_not_stored_are_refused_naming_the_key(
        family_sources: dict[str, Path], tmp_path: Path, architecture: str) -> None:
    src, dropped = _without(family_sources[architecture], tmp_path,
                            lambda name: name.startswith("decoder.layers.2.mlp.shared_experts."))
    family = FAMILIES[architecture]
    declaring = [key for rule in family.rules if "moe_shared_expert_intermediate_size" in rule.model_fields
                 for key in rule.keys if key in _config_json(src)] or [
        _key(architecture, _config_json(src), "moe_shared_expert_intermediate_size")]

    message = _refusal(src)

    assert f"missing: {dropped}" in message
    assert any(f"declares by {key}={_config_json(src)[key]}" in message for key in declaring), message


@pytest.mark.parametrize("architecture", UNTIED)
def test_an_untied_output_layer_that_is_not_stored_is_refused_naming_tie_word_embeddings(
        family_sources: dict[str, Path], tmp_path: Path, architecture: str) -> None:
    src, _ = _without(family_sources[architecture], tmp_path, lambda name: name == OUTPUT_LAYER)

    message = _refusal(src)

    assert "declares by tie_word_embeddings" in message, message


# ------------------------------------------------------------------------------------ MTP layers

def _mtp(name: str) -> bool:
    """A tensor of an MTP layer as the family's checkpoint stores it apart (Qwen3-Next's ``mtp.*``), or of its
    megatron-core name."""
    return name.startswith("mtp.")


def _mtp_copies(architecture: str) -> Callable[[str], bool]:
    """An MTP layer's stored copies of the embedding and output layer (HF layer num_hidden_layers)."""
    prefix = HF_LAYER.format(tiny_config(FAMILIES[architecture]).num_layers)
    return lambda name: name.startswith(prefix)


@pytest.mark.parametrize("architecture", WITH_MTP)
def test_declared_mtp_layers_none_of_which_is_stored_are_refused_under_strict(
        family_sources: dict[str, Path], tmp_path: Path, architecture: str) -> None:
    src, _ = _without(family_sources[architecture], tmp_path, _mtp, _mtp_copies(architecture))

    key = FAMILIES[architecture].hf_mtp_layers_key
    with pytest.raises(StrictModeError, match=f"{key}=1, but no tensor of a multi-token prediction"):
        pgconvert.convert(src, tmp_path / "out", dst_format="megatron", strict=True)


@pytest.mark.parametrize("architecture", WITH_MTP)
def test_declared_mtp_layers_none_of_which_is_stored_convert_without_them_and_are_not_declared_after(
        family_sources: dict[str, Path], tmp_path: Path, architecture: str) -> None:
    src, dropped = _without(family_sources[architecture], tmp_path, _mtp, _mtp_copies(architecture))

    report = pgconvert.convert(src, tmp_path / "hf", dst_format="hf")
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    back = pgconvert.convert(tmp_path / "megatron", tmp_path / "back", dst_format="hf")

    key = FAMILIES[architecture].hf_mtp_layers_key
    assert any(f"{key}=1, but no tensor" in notice for notice in report.notices)
    assert any(f"{key}=1 written as 0" in notice for notice in back.notices)
    for out in (tmp_path / "hf", tmp_path / "back"):
        assert _config_json(out) == {**_config_json(src), key: 0}
        written = load_file(str(out / "model.safetensors"))
        assert not set(dropped) & set(written)
        assert pgconvert.verify(src, out).equal


def test_hf_side_config_json_with_a_huge_layer_count_is_bounded_and_replaced_by_the_model(
        family_sources: dict[str, Path], tmp_path: Path) -> None:
    """A Megatron checkpoint's carried config.json is untrusted input too: its counts are bounded
    before a family's rules build per-layer lists from them."""
    pgconvert.convert(family_sources["DeepseekV3ForCausalLM"], tmp_path / "megatron", dst_format="megatron")
    carried = tmp_path / "megatron" / "hf" / "config.json"
    carried.write_text(json.dumps({**json.loads(carried.read_text()), "num_hidden_layers": 10**9}))

    measured = bounded(lambda: pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf"))

    assert measured.error is None, repr(measured.error)
    assert measured.seconds < 10 and measured.peak_growth < 200 << 20
    assert any(f"{carried} is not usable" in notice and "num_hidden_layers=1000000000" in notice
               for notice in measured.result.notices), measured.result.notices
    assert _config_json(tmp_path / "hf")["num_hidden_layers"] == 3
    assert pgconvert.verify(family_sources["DeepseekV3ForCausalLM"], tmp_path / "hf").equal


# ------------------------------------------------------------------------------------ Megatron rank files

@pytest.fixture(scope="module")
def megatron_source(family_sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3 at PP2 (layer 0 on stage 0, layers 1-2 on stage 1) × EP2."""
    out = tmp_path_factory.mktemp("structure_megatron") / "megatron"
    pgconvert.convert(family_sources["DeepseekV3ForCausalLM"], out, dst_format="megatron", dst_pp=2,
                      dst_first_stage_layers=1, dst_ep=2)
    return out


def _rank_file(root: Path, name: str) -> Path:
    return next(root.glob(f"*/{name}/model_optim_rng.pt"))


def _drop_keys(root: Path, rank_dirs: list[str], picks: Callable[[str], bool], where: Path) -> Path:
    copy = Path(shutil.copytree(root, where / "src"))
    for name in rank_dirs:
        path = _rank_file(copy, name)
        state = load_for_test(path)
        dropped = [key for key in state["model"] if picks(key)]
        assert dropped, name
        state["model"] = {key: value for key, value in state["model"].items() if key not in dropped}
        torch.save(state, path)
    return copy


def _megatron_refusal(src: Path) -> str:
    with pytest.raises(CheckpointError) as raised:
        pgconvert.convert(src, src.parent / "out", dst_format="hf")
    return str(raised.value)


def test_a_layer_missing_from_one_rank_file_is_refused_naming_the_file_and_args(
        megatron_source: Path, tmp_path: Path) -> None:
    src = _drop_keys(megatron_source, ["mp_rank_00_001_000"], lambda key: key.startswith("decoder.layers.1."),
                     tmp_path)

    message = _megatron_refusal(src)

    assert f"{_rank_file(src, 'mp_rank_00_001_000')}: state dict does not match" in message
    assert "'decoder.layers.1.self_attention.linear_proj.weight'" in message
    assert "the args declare them by args.num_layers=3" in message, message


def test_a_layer_missing_from_every_rank_file_of_its_stage_is_refused_by_the_layer_count(
        megatron_source: Path, tmp_path: Path) -> None:
    src = _drop_keys(megatron_source, ["mp_rank_00_001_000", "mp_rank_00_001_001"],
                     lambda key: key.startswith("decoder.layers.1."), tmp_path)

    message = _megatron_refusal(src)

    assert f"{_rank_file(src, 'mp_rank_00_000_000')}: args.num_layers=3, but the checkpoint stores 2 decoder " \
           "layer(s)" in message, message


def test_a_routed_expert_missing_from_a_rank_file_is_refused_naming_num_experts(
        megatron_source: Path, tmp_path: Path) -> None:
    src = _drop_keys(megatron_source, ["mp_rank_00_001_001"],
                     lambda key: key.startswith("decoder.layers.0.mlp.experts.local_experts.1."), tmp_path)

    message = _megatron_refusal(src)

    assert f"{_rank_file(src, 'mp_rank_00_001_001')}: state dict does not match" in message
    assert "args.num_experts=4" in message, message
