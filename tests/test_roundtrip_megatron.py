"""Megatron → Megatron resharding is bit-exact against independently sliced fixtures."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from support.checkpoint_compare import assert_same_megatron_checkpoint
from support.megatron_fixtures import (
    TinyModel,
    load_for_test,
    make_full_model,
    merge_megatron_checkpoint,
    read_megatron_checkpoint,
    write_megatron_checkpoint,
)

import pgconvert

# (tp, pp, first, last) hops: each conversion's output must equal the fixture written at that layout.
ROUND_TRIPS = {
    "tp8-tp2-tp8": [(8, 1, None, None), (2, 1, None, None), (8, 1, None, None)],
    "tp1-tp4pp2-tp1": [(1, 1, None, None), (4, 2, None, None), (1, 1, None, None)],
    "tp2pp3uneven-tp4pp1-back": [(2, 3, 1, 1), (4, 1, None, None), (2, 3, 1, 1)],
}


@pytest.mark.parametrize("hops", list(ROUND_TRIPS.values()), ids=list(ROUND_TRIPS))
def test_round_trip_matches_fixtures_at_every_hop(tmp_path: Path, tiny_model: TinyModel, hops: list) -> None:
    full = make_full_model(tiny_model, seed=1)
    tp, pp, first, last = hops[0]
    current = write_megatron_checkpoint(tmp_path / "hop0", tiny_model, full, tp, pp, first, last)
    original = current

    for index, (tp, pp, first, last) in enumerate(hops[1:], start=1):
        converted = tmp_path / f"hop{index}"
        pgconvert.convert(current, converted, dst_tp=tp, dst_pp=pp,
                          dst_first_stage_layers=first, dst_last_stage_layers=last)
        expected = write_megatron_checkpoint(tmp_path / f"expected{index}", tiny_model, full, tp, pp, first, last)
        assert_same_megatron_checkpoint(converted, expected)
        current = converted

    assert_same_megatron_checkpoint(current, original)
    merged = merge_megatron_checkpoint(current, tiny_model)
    assert merged.keys() == full.keys()
    assert all(torch.equal(merged[name], full[name]) for name in full)


def test_pp_change_keeps_iteration_version_and_describes_target_in_args(tmp_path: Path) -> None:
    model = replace(_model("gqa_swiglu_untied"))
    src = write_megatron_checkpoint(tmp_path / "src", model, make_full_model(model), 2, 1, iteration=1234)

    pgconvert.convert(src, tmp_path / "dst", dst_tp=1, dst_pp=4)

    assert (tmp_path / "dst" / "latest_checkpointed_iteration.txt").read_text() == "1234"
    args, ranks = read_megatron_checkpoint(tmp_path / "dst")
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 4)
    assert args.padded_vocab_size == 1024
    assert sorted(ranks) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    state = load_for_test(tmp_path / "dst" / "iter_0001234" / "mp_rank_00_002" / "model_optim_rng.pt")
    assert state["checkpoint_version"] == 3.0
    assert state["iteration"] == 1234
    assert "optimizer" not in state and "rng_state" not in state


def test_uneven_first_stage_only_splits_the_rest_evenly(tmp_path: Path) -> None:
    model = _model("gqa_swiglu_untied")
    full = make_full_model(model)
    src = write_megatron_checkpoint(tmp_path / "src", model, full, 1, 1)

    pgconvert.convert(src, tmp_path / "dst", dst_pp=3, dst_first_stage_layers=2)

    expected = write_megatron_checkpoint(tmp_path / "expected", model, full, 1, 3, first=2)
    assert_same_megatron_checkpoint(tmp_path / "dst", expected)


def test_release_checkpoint_converts_to_release(tmp_path: Path) -> None:
    model = _model("mha_gelu_tied")
    full = make_full_model(model)
    src = write_megatron_checkpoint(tmp_path / "src", model, full, 2, 1, release=True)

    pgconvert.convert(src, tmp_path / "dst", dst_tp=4)

    assert (tmp_path / "dst" / "latest_checkpointed_iteration.txt").read_text() == "release"
    expected = write_megatron_checkpoint(tmp_path / "expected", model, full, 4, 1, release=True)
    assert_same_megatron_checkpoint(tmp_path / "dst", expected)


def test_iteration_option_picks_an_older_iteration(tmp_path: Path) -> None:
    model = _model("gqa_swiglu_untied")
    old, new = make_full_model(model, seed=1), make_full_model(model, seed=2)
    write_megatron_checkpoint(tmp_path / "src", model, old, 2, 1, iteration=10)
    write_megatron_checkpoint(tmp_path / "src", model, new, 2, 1, iteration=20)

    pgconvert.convert(tmp_path / "src", tmp_path / "dst", dst_tp=1, iteration=10)

    merged = merge_megatron_checkpoint(tmp_path / "dst", model)
    assert torch.equal(merged["decoder.layers.0.mlp.linear_fc2.weight"], old["decoder.layers.0.mlp.linear_fc2.weight"])


@pytest.mark.parametrize(("flag", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)])
def test_dtype_option_casts_every_tensor_and_the_args(tmp_path: Path, flag: str, dtype: torch.dtype) -> None:
    model = _model("gqa_swiglu_untied")
    full = make_full_model(model)
    src = write_megatron_checkpoint(tmp_path / "src", model, full, 2, 1)

    pgconvert.convert(src, tmp_path / "dst", dtype=flag)

    args, ranks = read_megatron_checkpoint(tmp_path / "dst")
    assert args.params_dtype == dtype
    assert args.bf16 == (dtype == torch.bfloat16) and args.fp16 == (dtype == torch.float16)
    for model_dict in ranks.values():
        assert {tensor.dtype for tensor in model_dict.values()} == {dtype}
    merged = merge_megatron_checkpoint(tmp_path / "dst", replace(model, dtype=dtype))
    for name, tensor in full.items():
        assert torch.equal(merged[name], tensor.to(dtype)), name


def test_padded_vocab_that_changes_with_tp_keeps_real_rows_and_zero_fills(tmp_path: Path) -> None:
    # 1030 rows pad to 1152 at tp1 (multiple 128) but to 2048 at tp8 (multiple 1024).
    model = replace(_model("gqa_swiglu_untied"), vocab_size=1030)
    full = make_full_model(model)
    src = write_megatron_checkpoint(tmp_path / "src", model, full, 1, 1)

    pgconvert.convert(src, tmp_path / "tp8", dst_tp=8)
    pgconvert.convert(tmp_path / "tp8", tmp_path / "tp1", dst_tp=1)

    expected = write_megatron_checkpoint(tmp_path / "expected8", model, full, 8, 1)
    assert_same_megatron_checkpoint(tmp_path / "tp8", expected)
    assert_same_megatron_checkpoint(tmp_path / "tp1", src)


def test_true_vocab_size_option_strips_padding_when_args_lack_it(tmp_path: Path) -> None:
    model = replace(_model("gqa_swiglu_untied"), vocab_size=1030)
    full = make_full_model(model)
    src = write_megatron_checkpoint(tmp_path / "src", model, full, 1, 1)
    _drop_vocab_size_from_args(src)

    with pytest.raises(pgconvert.PgconvertError, match=r"--dst-tp 8: .*1152 rows.*--true-vocab-size"):
        pgconvert.convert(src, tmp_path / "refused", dst_tp=8)
    assert not (tmp_path / "refused").exists()

    pgconvert.convert(src, tmp_path / "tp8", dst_tp=8, true_vocab_size=1030)
    merged = merge_megatron_checkpoint(tmp_path / "tp8", model)
    assert torch.equal(merged["embedding.word_embeddings.weight"], full["embedding.word_embeddings.weight"])


def test_unknown_true_vocab_with_same_padding_keeps_the_padded_table(tmp_path: Path) -> None:
    model = _model("gqa_swiglu_untied")
    full = make_full_model(model)
    src = write_megatron_checkpoint(tmp_path / "src", model, full, 8, 1)
    _drop_vocab_size_from_args(src)

    pgconvert.convert(src, tmp_path / "dst", dst_tp=2)

    expected = write_megatron_checkpoint(tmp_path / "expected", model, full, 2, 1)
    assert_same_megatron_checkpoint(tmp_path / "dst", expected)


def _drop_vocab_size_from_args(root: Path) -> None:
    for path in root.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = load_for_test(path)
        del state["args"].vocab_size
        torch.save(state, path)


def _model(name: str) -> TinyModel:
    from support.tiny_models import MODELS

    return MODELS[name]


def test_fixture_checkpoint_is_what_the_saver_writes_for_the_same_layout(tmp_path: Path, tiny_model: TinyModel) -> None:
    full = make_full_model(tiny_model)
    src = write_megatron_checkpoint(tmp_path / "src", tiny_model, full, 2, 2)

    pgconvert.convert(src, tmp_path / "same", dst_tp=2, dst_pp=2)

    assert_same_megatron_checkpoint(tmp_path / "same", src)
    _, ranks = read_megatron_checkpoint(tmp_path / "same")
    assert all(tensor is None or tensor.is_contiguous() for model in ranks.values() for tensor in model.values())
