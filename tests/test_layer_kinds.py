"""Layer kinds as data: which kind each layer is (per-layer MoE, window and RoPE settings included),
and a new kind is one table plus one registry entry, with no change to the provider."""

from __future__ import annotations

import pytest
import torch

from pgconvert.model.config import ModelConfig
from pgconvert.model.grid import build_converter_process_groups, iter_ranks
from pgconvert.model.kinds import LAYER_KINDS
from pgconvert.model.kinds.table import LayerKind, TEModule, TensorKind, hidden
from pgconvert.model.layers import (DENSE_MLP, MOE, MULTI_LATENT_ATTENTION, SELF_ATTENTION, LayerSpec, MTPLayerSpec)
from pgconvert.model.layout import ParallelLayout
from pgconvert.model.provider import (canonical_names, canonical_shapes, keep_dtype_names, layer_kinds,
                                      norm_weight_names, provide, te_extra_state_names)
from pgconvert.model.rules import COLUMN, REPLICATED, ROW

BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=128,
            vocab_size=1000)


def test_each_layer_spec_carries_its_kinds_and_per_layer_settings() -> None:
    config = ModelConfig(**BASE, num_experts=4, moe_layer_freq=[0, 1, 1, 0], sliding_window=8,  # type: ignore[arg-type]
                         window_layers=[1, 0, 0, 1], no_rope_layers=[0, 0, 1, 0], mtp_num_layers=2)

    assert config.layers == (
        LayerSpec(SELF_ATTENTION, DENSE_MLP, window=True, rope=True),
        LayerSpec(SELF_ATTENTION, MOE, window=False, rope=True),
        LayerSpec(SELF_ATTENTION, MOE, window=False, rope=False),
        LayerSpec(SELF_ATTENTION, DENSE_MLP, window=True, rope=True),
    )
    assert [spec.moe for spec in config.layers] == [False, True, True, False]
    # Megatron-LM builds the MTP layers' inner layer with the last decoder layer's spec.
    assert config.mtp_layers == (MTPLayerSpec(config.layers[-1]),) * 2 and not config.mtp_layers[0].moe


@pytest.mark.parametrize(("settings", "mixers", "mlps", "windows", "ropes"), [
    ({}, {SELF_ATTENTION}, [DENSE_MLP] * 4, [False] * 4, [True] * 4),
    ({"num_experts": 4, "moe_layer_freq": 2, "sliding_window": 8}, {SELF_ATTENTION}, [MOE, DENSE_MLP] * 2, [True] * 4,
     [True] * 4),
    ({"multi_latent_attention": True, "num_experts": 2, "position_embedding_type": "none"}, {MULTI_LATENT_ATTENTION},
     [MOE] * 4, [False] * 4, [False] * 4),
])
def test_which_kind_each_layer_is_comes_from_the_settings(settings: dict[str, object], mixers: set[str],
                                                          mlps: list[str], windows: list[bool], ropes: list[bool]) -> None:
    config = ModelConfig(**{**BASE, **settings})  # type: ignore[arg-type]

    assert {spec.mixer for spec in config.layers} == mixers
    assert [spec.mlp for spec in config.layers] == mlps
    assert [spec.window for spec in config.layers] == windows and [spec.rope for spec in config.layers] == ropes
    assert all(kind in LAYER_KINDS for spec in config.layers for kind in spec.kinds)


# A made-up mixer (a state-space-like block: its own norm, an input projection split by rows, a per-head
# parameter kept in float32, an output projection split by columns), defined only here.
TOY_MIXER = LayerKind("toy_mixer", tensors=(
    TensorKind("norm.weight", hidden, REPLICATED, norm_weight=True),
    TensorKind("mixer.in_proj.weight", lambda c: (4 * c.hidden_size, c.hidden_size), COLUMN),
    TensorKind("mixer.A_log", lambda c: (c.attention.num_attention_heads,), COLUMN, keep_dtype=True),
    TensorKind("mixer.out_proj.weight", lambda c: (c.hidden_size, 2 * c.hidden_size), ROW),
), te_modules=(TEModule("mixer.in_proj"), TEModule("mixer.out_proj")))


class HybridConfig(ModelConfig):
    """Odd layers are toy-mixer layers without an MLP (as a hybrid layer pattern would say)."""

    @property
    def layers(self) -> tuple[LayerSpec, ...]:  # type: ignore[override]
        return tuple(LayerSpec(TOY_MIXER.name, None) if layer % 2 else spec
                     for layer, spec in enumerate(super().layers))


def test_a_new_layer_kind_is_one_table_and_one_registry_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(LAYER_KINDS, TOY_MIXER.name, TOY_MIXER)
    config = HybridConfig(**BASE, transformer_impl="transformer_engine")  # type: ignore[arg-type]

    names = canonical_names(config)
    layer1 = [name.removeprefix("decoder.layers.1.") for name in names if name.startswith("decoder.layers.1.")]
    assert layer1 == ["norm.weight", "mixer.in_proj.weight", "mixer.A_log", "mixer.out_proj.weight"]
    assert "decoder.layers.2.mlp.linear_fc1.weight" in names and "decoder.layers.3.mlp.linear_fc1.weight" not in names
    assert canonical_shapes(config)["decoder.layers.3.mixer.in_proj.weight"] == (256, 64)
    assert "decoder.layers.1.mixer.A_log" in keep_dtype_names(config)
    assert "decoder.layers.3.norm.weight" in norm_weight_names(config)
    assert layer_kinds(config)["decoder.layers.1.mixer.out_proj.weight"] is TOY_MIXER.tensors[3]
    assert te_extra_state_names(config, range(2, 4), 1) == [
        "decoder.layers.2.self_attention.core_attention._extra_state",
        "decoder.layers.2.self_attention.linear_proj._extra_state",
        "decoder.layers.2.self_attention.linear_qkv._extra_state",
        "decoder.layers.2.mlp.linear_fc1._extra_state", "decoder.layers.2.mlp.linear_fc2._extra_state",
        "decoder.layers.3.mixer.in_proj._extra_state", "decoder.layers.3.mixer.out_proj._extra_state"]


def test_a_new_layer_kinds_tensors_are_cut_by_their_rules_at_tp2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(LAYER_KINDS, TOY_MIXER.name, TOY_MIXER)
    config = HybridConfig(**BASE)  # type: ignore[arg-type]
    layout = ParallelLayout(tp=2, pp=2)
    groups = build_converter_process_groups(layout)
    full = {name: torch.randn(shape) for name, shape in canonical_shapes(config, vocab_rows=1024).items()}
    pieces: dict[str, list[torch.Tensor]] = {}

    for coord in iter_ranks(layout):
        groups.set_coord(coord)
        for spec in provide(config, groups).specs:
            if ".mixer." in spec.canonical or spec.canonical.endswith(".norm.weight"):
                assert spec.local_shape == spec.rule.local_shape(spec.global_shape, 2) and spec.tp_size == 2
                pieces.setdefault(spec.canonical, []).append(spec.rule.shard(full[spec.canonical], 2, spec.tp_rank))
                assert spec.local_name.startswith("decoder.layers.1.")  # layers 1 and 3, second on their stage

    groups.set_ranks(tp=1, pp=1)
    by_name = {spec.canonical: spec for spec in provide(config, groups).specs}
    in_proj = by_name["decoder.layers.3.mixer.in_proj.weight"]
    assert (in_proj.local_name, in_proj.local_shape, in_proj.rule) == (
        "decoder.layers.1.mixer.in_proj.weight", (128, 64), COLUMN)
    assert (by_name["decoder.layers.3.mixer.out_proj.weight"].local_shape, by_name["decoder.layers.3.mixer.A_log"].keep_dtype,
            by_name["decoder.layers.3.norm.weight"].rule) == ((64, 64), True, REPLICATED)
    assert sorted(pieces) == sorted(name for name in full if ".mixer." in name or name.endswith(".norm.weight"))
    for name, shards in pieces.items():
        rule = layer_kinds(config)[name].rule_for(config)
        assert len(shards) == 2
        assert all(torch.equal(shard, full[name]) for shard in shards) if rule.replicated else torch.equal(
            rule.merge(shards), full[name]), name
