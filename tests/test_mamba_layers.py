"""The Mamba-2 layer kind and hybrid layer patterns: the segmented TP rule, which layer is which kind,
the settings' checks, the layouts a hybrid model refuses, and its Megatron args."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from pgconvert.errors import ConfigError, LayoutError
from pgconvert.formats.megatron import args_for_target, config_from_args
from pgconvert.model.config import ModelConfig
from pgconvert.model.layers import DENSE_MLP, MAMBA, SELF_ATTENTION
from pgconvert.model.layout import ParallelLayout
from pgconvert.model.provider import canonical_shapes
from pgconvert.model.rules import GATED, Segmented

SEGMENTS = (8, 8, 4, 4, 2)  # z, x, B, C, dt of a mixer with 8 inner rows, 4 group-state rows, 2 heads


def _hybrid(**changes: object) -> ModelConfig:
    settings: dict[str, object] = dict(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=48,
        vocab_size=100, hybrid_override_pattern="M*M-", mamba_num_heads=8, mamba_head_dim=8, mamba_num_groups=2,
        mamba_state_dim=4, position_embedding_type="none", gated_linear_unit=False, activation="squared_relu")
    return ModelConfig(**{**settings, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize("tp", [1, 2])
def test_segmented_piece_is_each_segments_own_chunk_in_order(tp: int) -> None:
    rule = Segmented(SEGMENTS, ("z", "x", "B", "C", "dt"))
    full = torch.arange(sum(SEGMENTS) * 3).reshape(sum(SEGMENTS), 3)
    starts = [sum(SEGMENTS[:index]) for index in range(len(SEGMENTS))]

    for rank in range(tp):
        expected = torch.cat([full[start + rank * rows // tp: start + (rank + 1) * rows // tp]
                              for start, rows in zip(starts, SEGMENTS)])
        assert torch.equal(rule.shard(full, tp, rank), expected)
        assert rule.local_shape(full.shape, tp) == tuple(expected.shape)


@pytest.mark.parametrize("tp", [1, 2])
def test_segmented_merge_undoes_split_and_reshards_without_the_whole(tp: int) -> None:
    rule = Segmented(SEGMENTS)
    full = torch.randn(sum(SEGMENTS), 1, 4, generator=torch.Generator().manual_seed(tp))

    pieces = rule.split(full, tp)

    assert torch.equal(rule.merge(pieces), full)
    for rank in range(2 // tp):
        assert torch.equal(rule.reshard(pieces, 2 // tp, rank), rule.shard(full, 2 // tp, rank))


def test_two_equal_segments_cut_as_the_gated_rule() -> None:
    full = torch.randn(12, 5, generator=torch.Generator().manual_seed(1))

    assert all(torch.equal(Segmented((6, 6)).shard(full, 3, rank), GATED.shard(full, 3, rank)) for rank in range(3))


def test_segmented_refuses_a_size_that_does_not_divide_a_segment() -> None:
    with pytest.raises(ValueError, match=r"segments \['dt'\] of \(8, 8, 4, 4, 2\) rows do not divide by 4"):
        Segmented(SEGMENTS, ("z", "x", "B", "C", "dt")).local_shape((26, 3), 4)


def test_each_pattern_symbol_is_one_layer_of_one_kind() -> None:
    config = _hybrid()

    assert [(layer.mixer, layer.mlp) for layer in config.layers] == [
        (MAMBA, None), (SELF_ATTENTION, None), (MAMBA, None), (None, DENSE_MLP)]
    shapes = canonical_shapes(config)
    assert shapes["decoder.layers.0.mixer.in_proj.weight"] == (2 * 64 + 2 * 8 + 8, 32)
    assert shapes["decoder.layers.2.mixer.conv1d.weight"] == (64 + 2 * 8, 1, 4)
    assert shapes["decoder.layers.3.mlp.linear_fc1.weight"] == (48, 32)
    assert "decoder.layers.1.mlp.linear_fc1.weight" not in shapes


def test_the_mamba_heads_default_to_megatron_cores_expand_two() -> None:
    assert _hybrid(mamba_num_heads=None).mamba.mamba_num_heads == 32 * 2 // 8


@pytest.mark.parametrize(("changes", "message"), [
    (dict(hybrid_override_pattern="M*X-"), "hybrid_override_pattern='M\\*X-': must be one of M \\* - E for each of the 4"),
    (dict(hybrid_override_pattern="M*M"), "for each of the 4 layers"),
    (dict(hybrid_override_pattern="M*ME"), "hybrid_override_pattern='M\\*ME': E \\(MoE\\) layers need num_experts"),
    (dict(mamba_num_heads=6, mamba_num_groups=4), "mamba_num_groups=4: mamba_num_heads=6 must be a multiple of it"),
    (dict(mamba_state_dim=0), "mamba_state_dim=0: must be a positive integer"),
])
def test_impossible_hybrid_settings_are_refused_by_name(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _hybrid(**changes)


@pytest.mark.parametrize(("config", "layout", "message"), [
    (_hybrid(), ParallelLayout(tp=4), "tp=4: num_query_groups=2 is not divisible by 4"),
    (_hybrid(num_query_groups=4, mamba_num_groups=2), ParallelLayout(tp=4), "tp=4: mamba_num_groups=2 is not divisible"),
    (_hybrid(num_query_groups=4, mamba_num_heads=6, mamba_num_groups=2), ParallelLayout(tp=4),
     "tp=4: mamba_num_heads=6 is not divisible"),
    (_hybrid(), ParallelLayout(pp=2, vpp=2), "vpp=2: the hybrid model 'M\\*M-' cannot take a virtual pipeline"),
    (_hybrid(), ParallelLayout(pp=2, pipeline_layout="Ett|ttL"), "places its layers by the pattern"),
    (_hybrid(), ParallelLayout(pp=3), "pp=3: num_layers=4 is not divisible by 3"),
])
def test_layouts_a_hybrid_model_cannot_take_are_refused_while_planning(config: ModelConfig, layout: ParallelLayout,
                                                                      message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        layout.validate(config)


def test_only_the_layer_kinds_of_the_pattern_bound_tensor_parallelism() -> None:
    """Three attention heads and an odd MLP do not bound TP in a model that has neither."""
    mamba_only = _hybrid(hybrid_override_pattern="MMMM", num_attention_heads=3, num_query_groups=3, ffn_hidden_size=33)

    ParallelLayout(tp=2, pp=2).validate(mamba_only)
    with pytest.raises(LayoutError, match="num_attention_heads=3"):
        ParallelLayout(tp=2).validate(mamba_only.replace(hybrid_override_pattern="M*MM"))


def test_megatron_args_read_back_as_the_model_they_were_written_for() -> None:
    config = _hybrid(transformer_impl="transformer_engine")
    layout = ParallelLayout(tp=2, pp=2)

    args = args_for_target(config, layout, 128, torch.bfloat16, 1, None)
    read = config_from_args(args, Path("args.pt"), "transformer_engine", None)

    assert read == config
    assert (args.hybrid_override_pattern, args.is_hybrid_model, args.hybrid_attention_ratio) == ("M*M-", True, 0.0)


def test_args_without_a_pattern_are_a_gpt_model() -> None:
    config = _hybrid(hybrid_override_pattern=None, mamba_num_heads=None, position_embedding_type="rope")
    args = args_for_target(config, ParallelLayout(), 128, torch.float32, 1, argparse.Namespace())

    assert not hasattr(args, "hybrid_override_pattern")
    assert config_from_args(args, Path("args.pt"), "local", None).layers[0].mixer == SELF_ATTENTION
