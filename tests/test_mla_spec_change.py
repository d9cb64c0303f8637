"""A multi-latent-attention checkpoint converted between megatron-core's layer specs at TP > 1.

megatron-core 0.16.1 splits MLA's down projections (``linear_q_down_proj``, ``linear_kv_down_proj``) by
rows in the local spec (ColumnParallelLinear, get_gpt_layer_local_spec) and keeps them whole on every
rank in the Transformer Engine spec (TELinear, parallel_mode='duplicated'). A per-rank source's pieces
are merged with the rule of the spec that wrote them and cut with the target's: the round trips through
both specs are bit-exact, and each spec's pieces are what megatron-core holds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.mtp_models import LAYERS, assert_same_tensors, from_args_alone, hf_tensors, rank_state, with_mtp

import pgconvert

DOWN = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V3 (MLA with q-LoRA, MoE, one MTP layer) in HF form."""
    return with_mtp("v3", tmp_path_factory.mktemp("mla_spec") / "hf")


def _hf_down(hf: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """The HF tensors of layer ``layer``'s down projections, as megatron-core's full weights."""
    prefix = f"model.layers.{layer}.self_attn."
    return {DOWN[0]: hf[prefix + "q_a_proj.weight"], DOWN[1]: hf[prefix + "kv_a_proj_with_mqa.weight"]}


def _assert_down_pieces(root: Path, hf: dict[str, torch.Tensor], impl: str, tp: int) -> None:
    """Each TP rank of decoder layer 1 and of the MTP layer holds its down projections as ``impl`` cuts them."""
    for rank in range(tp):
        model = rank_state(root, f"mp_rank_{rank:02d}" if tp > 1 else "mp_rank_00")["model"]
        for prefix, layer in (("decoder.layers.1.", 1), ("mtp.layers.0.transformer_layer.", LAYERS)):
            for name, full in _hf_down(hf, layer).items():
                expected = full if impl == "transformer_engine" else full.chunk(tp)[rank]
                assert torch.equal(model[prefix + name], expected), (root, rank, prefix + name)


def test_local_tp2_to_te_tp2_to_local_tp1_is_exact(source: Path, tmp_path: Path) -> None:
    hf = hf_tensors(source)
    pgconvert.convert(source, tmp_path / "local2", dst_format="megatron", dst_tp=2)
    pgconvert.convert(tmp_path / "local2", tmp_path / "te2", dst_format="megatron", dst_tp=2,
                      dst_transformer_impl="transformer_engine")
    pgconvert.convert(tmp_path / "te2", tmp_path / "local1", dst_format="megatron", dst_tp=1,
                      dst_transformer_impl="local")

    _assert_down_pieces(tmp_path / "local2", hf, "local", 2)
    _assert_down_pieces(tmp_path / "te2", hf, "transformer_engine", 2)
    _assert_down_pieces(tmp_path / "local1", hf, "local", 1)
    for stage in ("te2", "local1"):
        assert_same_tensors(source, from_args_alone(tmp_path / stage, tmp_path / f"{stage}-hf"))


def test_te_tp2_to_local_tp2_is_exact(source: Path, tmp_path: Path) -> None:
    hf = hf_tensors(source)
    pgconvert.convert(source, tmp_path / "te2", dst_format="megatron", dst_tp=2,
                      dst_transformer_impl="transformer_engine")
    pgconvert.convert(tmp_path / "te2", tmp_path / "local2", dst_format="megatron", dst_tp=2,
                      dst_transformer_impl="local")

    _assert_down_pieces(tmp_path / "local2", hf, "local", 2)
    assert_same_tensors(source, from_args_alone(tmp_path / "local2", tmp_path / "out"))


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_per_rank_spec_change_through_torch_dist_is_exact(source: Path, tmp_path: Path, impl: str) -> None:
    """A per-rank source of one spec into torch_dist and back into per-rank files of the other spec."""
    other = "local" if impl == "transformer_engine" else "transformer_engine"
    pgconvert.convert(source, tmp_path / "src", dst_format="megatron", dst_tp=2, dst_transformer_impl=impl)
    pgconvert.convert(tmp_path / "src", tmp_path / "dist", dst_format="torch_dist", dst_tp=2,
                      dst_transformer_impl=other)
    pgconvert.convert(tmp_path / "dist", tmp_path / "back", dst_format="megatron", dst_tp=2,
                      dst_transformer_impl=impl)

    _assert_down_pieces(tmp_path / "back", hf_tensors(source), impl, 2)
    assert_same_tensors(source, from_args_alone(tmp_path / "dist", tmp_path / "out"))
