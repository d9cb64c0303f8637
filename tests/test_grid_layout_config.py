"""Fake process groups, layouts and model configs: construction and validation messages."""

from __future__ import annotations

import pytest

from pgconvert.model.config import ModelConfig
from pgconvert.errors import ConfigError, LayoutError
from pgconvert.model.grid import FakeProcessGroup, RankCoord, build_converter_process_groups, iter_ranks
from pgconvert.model.layout import ParallelLayout


def llama_like(**changes: object) -> ModelConfig:
    values: dict[str, object] = dict(num_layers=8, hidden_size=64, num_attention_heads=16,
                                     num_query_groups=8, ffn_hidden_size=128, vocab_size=1000)
    values.update(changes)
    return ModelConfig(**values)  # type: ignore[arg-type]


def test_fake_group_rank_is_settable_and_bounded() -> None:
    group = FakeProcessGroup("tp", 4)

    group.set_rank(3)

    assert (group.rank(), group.size()) == (3, 4)
    with pytest.raises(ValueError, match=r"rank=4 outside \[0, 4\)"):
        group.set_rank(4)


def test_collection_moves_between_ranks_of_its_layout() -> None:
    layout = ParallelLayout(tp=2, pp=3)
    groups = build_converter_process_groups(layout)

    groups.set_ranks(tp=1, pp=2)

    assert groups.coord == RankCoord(tp=1, pp=2, ep=0)
    assert (groups.tp.size(), groups.pp.size(), groups.ep.size(), groups.dp.size(), groups.cp.size()) == (2, 3, 1, 1, 1)
    assert groups.expt_tp.rank() == 1
    assert set(groups.groups()) == {"tp", "pp", "ep", "expt_tp", "dp", "cp"}


def test_iter_ranks_visits_every_rank_once_in_file_order() -> None:
    coords = list(iter_ranks(ParallelLayout(tp=2, pp=2)))

    assert coords == [RankCoord(0, 0), RankCoord(1, 0), RankCoord(0, 1), RankCoord(1, 1)]


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        (ParallelLayout(pp=1), [range(0, 8)]),
        (ParallelLayout(pp=4), [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]),
        (ParallelLayout(pp=3, first_stage_layers=2, last_stage_layers=2), [range(0, 2), range(2, 6), range(6, 8)]),
        (ParallelLayout(pp=3, first_stage_layers=2), [range(0, 2), range(2, 5), range(5, 8)]),
        (ParallelLayout(pp=3, last_stage_layers=4), [range(0, 2), range(2, 4), range(4, 8)]),
        (ParallelLayout(pp=2, first_stage_layers=3, last_stage_layers=5), [range(0, 3), range(3, 8)]),
    ],
)
def test_stage_layers_follow_megatron_core(layout: ParallelLayout, expected: list[range]) -> None:
    assert layout.stage_layers(8) == expected


def test_layout_validation_names_the_flag_value_and_constraint() -> None:
    config = llama_like()

    with pytest.raises(LayoutError, match=r"^--dst-tp 3: num_attention_heads=16 is not divisible by 3$"):
        ParallelLayout(tp=3).validate(config, "dst")
    with pytest.raises(LayoutError, match=r"^--dst-tp 16: num_query_groups=8 is not divisible by 16$"):
        ParallelLayout(tp=16).validate(llama_like(num_attention_heads=32), "dst")
    with pytest.raises(LayoutError, match=r"^tp=3: num_attention_heads=16"):
        ParallelLayout(tp=3).validate(config)
    with pytest.raises(LayoutError, match=r"^--src-pp 3: num_layers=8 is not divisible by 3"):
        ParallelLayout(pp=3).validate(config, "src")


def test_layout_rejects_bad_sizes() -> None:
    with pytest.raises(LayoutError, match=r"tp=0: must be an integer >= 1"):
        ParallelLayout(tp=0)
    with pytest.raises(LayoutError, match=r"only meaningful with pp > 1"):
        ParallelLayout(pp=1, first_stage_layers=2)


def test_padded_vocab_is_a_multiple_of_divisor_times_tp() -> None:
    assert ParallelLayout(tp=1).padded_vocab_size(1030, 128) == 1152
    assert ParallelLayout(tp=8).padded_vocab_size(1030, 128) == 2048
    assert ParallelLayout(tp=2).padded_vocab_size(1024, 128) == 1024


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_layers": 0}, r"num_layers=0: must be a positive integer"),
        ({"num_query_groups": 5}, r"num_query_groups=5: num_attention_heads=16 must be a multiple of it"),
        ({"normalization": "BatchNorm"}, r"normalization='BatchNorm': must be one of RMSNorm, LayerNorm"),
        ({"hidden_size": 60, "kv_channels": None}, r"hidden_size=60 is not divisible by num_attention_heads=16"),
        ({"position_embedding_type": "learned_absolute"}, r"max_position_embeddings: required"),
    ],
)
def test_config_validation_names_field_value_and_constraint(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        llama_like(**changes)


def test_config_derives_query_groups_and_head_dim() -> None:
    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128)

    assert (config.query_groups, config.head_dim, config.qkv_rows) == (8, 8, 192)
