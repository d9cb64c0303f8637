"""The gated delta net layer kind and gated attention: which layer is which kind, the segmented TP rules of
``in_proj`` and ``conv1d`` (checked by an independent forward over the TP pieces, and knocked out), the gated
``linear_qkv`` layout, the settings' checks and the layouts refused while planning."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pgconvert.errors import ConfigError, LayoutError
from pgconvert.families.table import QKV
from pgconvert.model.config import ModelConfig
from pgconvert.model.kinds.gated_delta_net import KIND, in_proj_rows
from pgconvert.model.layers import GATED_DELTA_NET, MOE, SELF_ATTENTION
from pgconvert.model.layout import ParallelLayout
from pgconvert.model.provider import canonical_shapes
from pgconvert.model.rules import COLUMN, Segmented, ShardRule
from support.gated_delta_net_reference import gdn_mixer

# HF-named sizes of the reference (transformers' Qwen3NextConfig keys).
SIZES: dict[str, Any] = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=4,
                             linear_value_head_dim=6, rms_norm_eps=1e-6)


def _config(**changes: object) -> ModelConfig:
    settings: dict[str, object] = dict(
        num_layers=4, hidden_size=16, num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=24,
        vocab_size=100, transformer_impl="transformer_engine", attention_output_gate=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=4, linear_conv_kernel_dim=3,
        **{name: value for name, value in SIZES.items() if name != "rms_norm_eps"})
    return ModelConfig(**{**settings, **changes})  # type: ignore[arg-type]


def test_every_fourth_layer_is_attention_as_megatron_core_reads_linear_attention_freq() -> None:
    assert [layer.mixer for layer in _config().layers] == [GATED_DELTA_NET] * 3 + [SELF_ATTENTION]
    pattern = _config(linear_attention_freq=[1, 0, 0, 1], num_experts=4)
    assert [(layer.mixer, layer.mlp) for layer in pattern.layers] == [
        (GATED_DELTA_NET, MOE), (SELF_ATTENTION, MOE), (SELF_ATTENTION, MOE), (GATED_DELTA_NET, MOE)]


def test_shapes_are_megatron_cores() -> None:
    shapes = canonical_shapes(_config())
    layer = "decoder.layers.0."
    # in_proj: q, k (2 heads x 4), v, z (4 heads x 6), beta, alpha (4 each); conv1d over q, k, v.
    assert shapes[layer + "self_attention.in_proj.weight"] == (8 + 8 + 24 + 24 + 4 + 4, 16)
    assert shapes[layer + "self_attention.conv1d.weight"] == (8 + 8 + 24, 1, 3)
    assert shapes[layer + "self_attention.out_norm.weight"] == (6,)
    assert shapes[layer + "self_attention.out_proj.weight"] == (16, 24)
    assert shapes[layer + "self_attention.A_log"] == shapes[layer + "self_attention.dt_bias"] == (4,)
    # The full attention layer's linear_qkv carries a gate head per query head.
    assert shapes["decoder.layers.3.self_attention.linear_qkv.weight"] == ((4 + 4 + 2 * 2) * 8, 16)
    assert "decoder.layers.0.self_attention.linear_qkv.weight" not in shapes


def _weights(config: ModelConfig) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    full = {}
    for row in KIND.tensors:
        assert not isinstance(row, (tuple,))
        shape = row.shape(config)  # type: ignore[union-attr]
        full[row.canonical] = torch.randn(shape, generator=generator, dtype=torch.float64) * 0.5  # type: ignore[union-attr]
    return full


def _pieces(config: ModelConfig, full: dict[str, torch.Tensor], tp: int,
            rules: dict[str, ShardRule] | None = None) -> list[dict[str, torch.Tensor]]:
    """Each TP rank's tensors, under their TE names, cut by the kind's rules (or ``rules`` in their place)."""
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for row in KIND.tensors:
        rule = (rules or {}).get(row.canonical) or row.rule_for(config)  # type: ignore[union-attr]
        for rank in range(tp):
            ranks[rank][row.local_name(config)] = rule.shard(full[row.canonical], tp, rank)  # type: ignore[union-attr]
    return ranks


@pytest.fixture(scope="module")
def reference() -> tuple[ModelConfig, dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    config = _config(linear_num_key_heads=4, linear_num_value_heads=8)
    sizes = {**SIZES, "linear_num_key_heads": 4, "linear_num_value_heads": 8}
    full = _weights(config)
    h = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return config, full, h, gdn_mixer(_pieces(config, full, 1), "self_attention.", h, sizes)


@pytest.mark.parametrize("tp", [2, 4])
def test_the_tp_pieces_compute_the_whole_mixer(reference: Any, tp: int) -> None:
    config, full, h, whole = reference
    sizes = {**SIZES, "linear_num_key_heads": 4, "linear_num_value_heads": 8}

    sharded = gdn_mixer(_pieces(config, full, tp), "self_attention.", h, sizes)

    torch.testing.assert_close(sharded, whole, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("knockout", ["contiguous in_proj", "q and k one segment", "conv1d contiguous",
                                      "beta and alpha swapped"])
def test_a_wrong_cut_changes_the_output(reference: Any, knockout: str) -> None:
    config, full, h, whole = reference
    sizes = {**SIZES, "linear_num_key_heads": 4, "linear_num_value_heads": 8}
    q, k, v, z, b, a = in_proj_rows(config)
    name = "self_attention.in_proj.weight"
    rules: dict[str, ShardRule] = {
        "contiguous in_proj": {name: COLUMN},
        "q and k one segment": {name: Segmented((q + k, v, z, b, a))},
        "conv1d contiguous": {"self_attention.conv1d.weight": COLUMN},
        "beta and alpha swapped": {},
    }[knockout]
    swapped = dict(full)
    if knockout == "beta and alpha swapped":
        rows = full[name]
        swapped[name] = torch.cat([rows[:q + k + v + z], rows[q + k + v + z + b:], rows[q + k + v + z:q + k + v + z + b]])

    sharded = gdn_mixer(_pieces(config, swapped, 2, rules), "self_attention.", h, sizes)

    assert not torch.allclose(sharded, whole, rtol=1e-3, atol=1e-3)


def test_gated_qkv_groups_query_heads_then_their_gates_then_k_and_v() -> None:
    config = _config()  # 4 query heads of 8 rows in 2 groups; q_proj holds each head's query then its gate
    head = 8
    q_proj = torch.arange(4 * 2 * head).reshape(-1, 1)
    k_proj = 1000 + torch.arange(2 * head).reshape(-1, 1)
    v_proj = 2000 + torch.arange(2 * head).reshape(-1, 1)

    fused = QKV.fuse([q_proj, k_proj, v_proj], config)

    def q_head(index: int, gate: bool) -> torch.Tensor:
        start = (2 * index + gate) * head
        return q_proj[start:start + head]

    group0 = [q_head(0, False), q_head(1, False), q_head(0, True), q_head(1, True), k_proj[:head], v_proj[:head]]
    group1 = [q_head(2, False), q_head(3, False), q_head(2, True), q_head(3, True), k_proj[head:], v_proj[head:]]
    assert torch.equal(fused, torch.cat(group0 + group1))
    assert all(torch.equal(a, b) for a, b in zip(QKV.split(fused, config), (q_proj, k_proj, v_proj)))
    # TP2 falls on the query groups: rank 1 holds group 1 whole.
    assert torch.equal(COLUMN.shard(fused, 2, 1), torch.cat(group1))


@pytest.mark.parametrize(("changes", "message"), [
    (dict(experimental_attention_variant="dsa"), "experimental_attention_variant='dsa': must be one of gated_delta_net"),
    (dict(linear_attention_freq=None), "linear_attention_freq=None: must be a positive integer"),
    (dict(linear_attention_freq=[1, 1, 0]), r"linear_attention_freq=\[1, 1, 0\]: must list 0 or 1 for each of the 4"),
    (dict(linear_num_value_heads=3), "linear_num_key_heads=2: linear_num_value_heads=3 must be a multiple of it"),
    (dict(transformer_impl="local"), "transformer_impl='local': gated delta net layers need 'transformer_engine'"),
])
def test_impossible_linear_attention_settings_are_refused_by_name(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(**changes)


@pytest.mark.parametrize(("config", "message"), [
    (_config(num_query_groups=4), "tp=4: linear_num_key_heads=2 is not divisible by 4"),
    (_config(num_query_groups=4, linear_num_key_heads=4, linear_num_value_heads=4, linear_value_head_dim=12),
     None),
    (_config(num_query_groups=4, linear_num_key_heads=1, linear_num_value_heads=4), "linear_num_key_heads=1"),
])
def test_tp_must_divide_the_linear_heads(config: ModelConfig, message: str | None) -> None:
    if message is None:
        ParallelLayout(tp=4).validate(config)
        return
    with pytest.raises(LayoutError, match=message):
        ParallelLayout(tp=4).validate(config)


def test_a_model_of_attention_only_is_not_bound_by_linear_heads() -> None:
    ParallelLayout(tp=4).validate(_config(num_query_groups=4, linear_attention_freq=1))


def test_interleaved_rotary_reorders_query_and_key_heads_and_leaves_the_gates() -> None:
    """Megatron's interleaved rotary written rotate-half (``savers.hf.rotate_half_order``): in a gated ``linear_qkv``
    each group's query and key heads get evens-then-odds, its gate and value heads keep their rows."""
    from savers.hf import rotate_half_order

    config = _config(rotary_interleaved=True, num_attention_heads=4, num_query_groups=2, kv_channels=4)
    rows = torch.arange(config.attention.qkv_rows)
    order = torch.tensor([0, 2, 1, 3])  # a head of 4 rotated dims: evens, then odds

    reordered = rotate_half_order("qkv", rows, config)

    # Per group (24 rows): q0 q1 (rotated), g0 g1 (kept), k (rotated), v (kept).
    expected = torch.cat([torch.cat([start + order if rotated else torch.arange(start, start + 4)
                                     for start, rotated in zip(range(group, group + 24, 4),
                                                               (True, True, False, False, True, False))])
                          for group in (0, 24)])
    assert torch.equal(reordered, expected)
