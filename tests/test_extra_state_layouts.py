"""Transformer Engine ``_extra_state`` across layout changes: carried where the rank grid allows it,
dropped (with a notice) where it does not, and placed in the model chunk that owns its module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.tiny_models import MOE_GROUPED_TE, QK_NORM_TE
from support.megatron_fixtures import load_for_test, make_full_model, write_megatron_checkpoint

import pgconvert
from pgconvert.errors import PgconvertError

QKV_STATE = "decoder.layers.0.self_attention.linear_qkv._extra_state"
EXPERT_STATE = "decoder.layers.0.mlp.experts.linear_fc1._extra_state"
OUTPUT_STATE = "output_layer._extra_state"


def _rank_files(root: Path) -> list[Path]:
    return sorted(root.glob("iter_*/mp_rank_*/model_optim_rng.pt"))


def _set_extra_state(path: Path, chunk_key: str, key: str, value: torch.Tensor) -> None:
    state = load_for_test(path)
    model = state[chunk_key]
    assert isinstance(model, dict), path
    model[key] = value
    torch.save(state, path)


def test_extra_state_saved_at_another_ep_size_is_dropped_with_a_notice(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", MOE_GROUPED_TE, make_full_model(MOE_GROUPED_TE), 1, 1, ep=2)
    for ep_rank, path in enumerate(_rank_files(src)):
        marker = torch.full((6,), 10 + ep_rank, dtype=torch.uint8)
        _set_extra_state(path, "model", QKV_STATE, marker)
        _set_extra_state(path, "model", EXPERT_STATE, marker + 100)

    report = pgconvert.convert(src, tmp_path / "ep4", dst_ep=4)

    outputs = _rank_files(tmp_path / "ep4")
    assert len(outputs) == 4
    for path in outputs:
        model = load_for_test(path)["model"]
        assert isinstance(model, dict)
        assert model[QKV_STATE] is None, path
        assert model[EXPERT_STATE] is None, path
    assert any("_extra_state" in notice and "saved with (tp=1, ep=2)" in notice and "written empty (None)" in notice
               for notice in report.notices), report.notices


def test_extra_state_is_carried_per_ep_rank_when_the_ep_size_is_unchanged(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", MOE_GROUPED_TE, make_full_model(MOE_GROUPED_TE), 1, 1, ep=2)
    markers = [torch.full((6,), 10 + ep_rank, dtype=torch.uint8) for ep_rank in range(2)]
    for marker, path in zip(markers, _rank_files(src)):
        _set_extra_state(path, "model", EXPERT_STATE, marker)

    pgconvert.convert(src, tmp_path / "pp2", dst_pp=2, strict=True)

    for ep_rank, marker in enumerate(markers):
        path = tmp_path / "pp2" / "iter_0000100" / f"mp_rank_00_000_{ep_rank:03d}" / "model_optim_rng.pt"
        assert torch.equal(load_for_test(path)["model"][EXPERT_STATE], marker)


def test_output_layer_extra_state_lands_in_the_last_virtual_chunk(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", QK_NORM_TE, make_full_model(QK_NORM_TE), 1, 1)
    marker = torch.arange(8, dtype=torch.uint8)
    _set_extra_state(_rank_files(src)[0], "model", OUTPUT_STATE, marker)

    pgconvert.convert(src, tmp_path / "vpp", dst_pp=2, dst_vpp=2, strict=True)

    ranks = {path.parent.name: load_for_test(path) for path in _rank_files(tmp_path / "vpp")}
    assert sorted(ranks) == ["mp_rank_00_000", "mp_rank_00_001"]
    holders = [(rank, chunk) for rank, state in ranks.items() for chunk in ("model0", "model1")
               if OUTPUT_STATE in state[chunk]]
    assert holders == [("mp_rank_00_001", "model1")]
    assert torch.equal(ranks["mp_rank_00_001"]["model1"][OUTPUT_STATE], marker)
    assert "output_layer.weight" in ranks["mp_rank_00_001"]["model1"]


def test_grouped_expert_extra_state_is_renamed_for_a_sequential_target_and_dropped_with_a_notice(
        tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", MOE_GROUPED_TE, make_full_model(MOE_GROUPED_TE), 1, 1, ep=2)
    for ep_rank, path in enumerate(_rank_files(src)):
        _set_extra_state(path, "model", EXPERT_STATE, torch.full((6,), 10 + ep_rank, dtype=torch.uint8))

    report = pgconvert.convert(src, tmp_path / "seq", dst_expert_layout="sequential")

    # 8 experts over ep 2: each rank's SequentialMLP holds local experts 0..3, each linear its own state
    expected = sorted(f"decoder.layers.{layer}.mlp.experts.local_experts.{j}.linear_fc{fc}._extra_state"
                      for layer in (0, 2) for j in range(4) for fc in (1, 2))
    for path in _rank_files(tmp_path / "seq"):
        model = load_for_test(path)["model"]
        experts = sorted(key for key in model if key.endswith("_extra_state") and ".mlp.experts." in key)
        assert experts == expected, path
        assert all(model[key] is None for key in experts)
    assert any("SequentialMLP" in notice and "routed-expert _extra_state" in notice for notice in report.notices), \
        report.notices
    with pytest.raises(PgconvertError, match=r"mlp\.experts\.linear_fc1\._extra_state: .* would be dropped"):
        pgconvert.convert(src, tmp_path / "strict", dst_expert_layout="sequential", strict=True)


def test_verify_notes_uncompared_extra_state_only_where_an_entry_holds_some(tmp_path: Path) -> None:
    golden_local_spec = Path(__file__).parent / "data" / "megatron_lm" / "train_tp2pp2_torch"  # entries, all empty
    te = write_megatron_checkpoint(tmp_path / "te", QK_NORM_TE, make_full_model(QK_NORM_TE), 1, 1)
    first = _rank_files(te)[0]
    key = next(name for name in load_for_test(first)["model"] if name.endswith("_extra_state"))
    _set_extra_state(first, "model", key, torch.arange(4, dtype=torch.uint8))

    note = "opaque _extra_state entries (TE FP8 metadata) are not compared"
    assert note not in pgconvert.verify(golden_local_spec, golden_local_spec).notes
    assert note in pgconvert.verify(te, te).notes
