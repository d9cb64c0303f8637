"""Self-checks for the test-only Megatron checkpoint fixtures in megatron_fixtures.py."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_fixtures import (
    CHECKPOINT_FILE,
    TinyModel,
    load_rank_file,
    make_full_model,
    merge_megatron_checkpoint,
    padded_vocab_size,
    read_megatron_checkpoint,
    stage_layer_ranges,
    write_megatron_checkpoint,
)

_BASE = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=16,
    kv_channels=4,
    ffn_hidden_size=128,
    vocab_size=1000,
)

GQA_SWIGLU = TinyModel(
    **_BASE,
    num_query_groups=8,
    swiglu=True,
    normalization="RMSNorm",
    add_bias_linear=False,
    add_qkv_bias=False,
    qk_layernorm=False,
    tied_embeddings=False,
    position_embedding_type="rope",
)
MHA_GELU = TinyModel(
    **_BASE,
    num_query_groups=16,
    swiglu=False,
    normalization="LayerNorm",
    add_bias_linear=True,
    add_qkv_bias=False,
    qk_layernorm=False,
    tied_embeddings=True,
    position_embedding_type="learned_absolute",
)
QKNORM_TE = TinyModel(
    **_BASE,
    num_query_groups=8,
    swiglu=True,
    normalization="LayerNorm",
    add_bias_linear=False,
    add_qkv_bias=True,
    qk_layernorm=True,
    tied_embeddings=False,
    position_embedding_type="rope",
    transformer_impl="transformer_engine",
)
QKNORM_TE_BF16 = dataclasses.replace(QKNORM_TE, dtype=torch.bfloat16, tied_embeddings=True)

MODELS = {
    "gqa_swiglu_rms_untied_rope": GQA_SWIGLU,
    "mha_gelu_ln_bias_tied_learned": MHA_GELU,
    "qknorm_te": QKNORM_TE,
    "qknorm_te_bf16_tied": QKNORM_TE_BF16,
}
# (tp, pp, first, last)
LAYOUTS = [
    (1, 1, None, None),
    (2, 1, None, None),
    (8, 1, None, None),
    (2, 2, None, None),
    (2, 3, 1, 1),
    (1, 4, None, None),
    (4, 2, 3, None),
]


def _layout_id(layout: tuple[int, int, int | None, int | None]) -> str:
    tp, pp, first, last = layout
    return f"tp{tp}pp{pp}" + (f"f{first}" if first is not None else "") + (f"l{last}" if last is not None else "")


@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_roundtrip(tmp_path: Path, model_name: str, layout: tuple[int, int, int | None, int | None]) -> None:
    m = MODELS[model_name]
    tp, pp, first, last = layout
    full = make_full_model(m, seed=3)
    root = write_megatron_checkpoint(tmp_path / "ckpt", m, full, tp, pp, first, last)
    merged = merge_megatron_checkpoint(root, m)
    assert list(merged) == list(full)
    for name, tensor in full.items():
        assert merged[name].dtype == m.dtype, name
        assert torch.equal(merged[name], tensor), name


def test_full_model_values_distinct() -> None:
    full = make_full_model(GQA_SWIGLU)
    flat = torch.cat([t.flatten() for t in full.values()])
    assert flat.unique().numel() > 0.99 * flat.numel()
    assert torch.equal(make_full_model(GQA_SWIGLU, seed=0)["output_layer.weight"], full["output_layer.weight"])
    assert not torch.equal(make_full_model(GQA_SWIGLU, seed=1)["output_layer.weight"], full["output_layer.weight"])
    layer0 = "decoder.layers.0."
    assert full[layer0 + "self_attention.linear_qkv.weight"].shape == ((16 + 2 * 8) * 4, 64)
    assert full[layer0 + "mlp.linear_fc1.weight"].shape == (256, 64)
    assert full[layer0 + "self_attention.linear_proj.weight"].shape == (64, 64)
    assert "embedding.position_embeddings.weight" not in full
    assert "output_layer.weight" not in make_full_model(MHA_GELU)
    assert make_full_model(MHA_GELU)["embedding.position_embeddings.weight"].shape == (32, 64)
    assert make_full_model(QKNORM_TE_BF16)["decoder.final_layernorm.bias"].dtype == torch.bfloat16


def test_padded_vocab_size() -> None:
    assert padded_vocab_size(GQA_SWIGLU, 1) == 1024
    assert padded_vocab_size(GQA_SWIGLU, 8) == 1024
    assert padded_vocab_size(GQA_SWIGLU, 3) == 1152
    assert padded_vocab_size(dataclasses.replace(GQA_SWIGLU, vocab_size=1024), 16) == 2048
    assert padded_vocab_size(dataclasses.replace(GQA_SWIGLU, make_vocab_size_divisible_by=1), 1) == 1000


def test_stage_layer_ranges() -> None:
    assert stage_layer_ranges(4, 1, None, None) == [range(0, 4)]
    assert stage_layer_ranges(4, 2, None, None) == [range(0, 2), range(2, 4)]
    assert stage_layer_ranges(4, 3, 1, 1) == [range(0, 1), range(1, 3), range(3, 4)]
    assert stage_layer_ranges(4, 2, 3, None) == [range(0, 3), range(3, 4)]
    assert stage_layer_ranges(7, 4, None, 1) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    assert stage_layer_ranges(5, 2, 2, 3) == [range(0, 2), range(2, 5)]
    with pytest.raises(AssertionError):
        stage_layer_ranges(5, 2, None, None)


def test_directory_layout(tmp_path: Path) -> None:
    full = make_full_model(GQA_SWIGLU)
    root = write_megatron_checkpoint(tmp_path / "a", GQA_SWIGLU, full, tp=2, pp=1, iteration=100)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "100"
    assert sorted(p.name for p in (root / "iter_0000100").iterdir()) == ["mp_rank_00", "mp_rank_01"]
    assert (root / "iter_0000100" / "mp_rank_01" / CHECKPOINT_FILE).is_file()

    root = write_megatron_checkpoint(tmp_path / "b", GQA_SWIGLU, full, tp=2, pp=3, first=1, last=1, iteration=7)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "7"
    expected = sorted(f"mp_rank_{t:02d}_{p:03d}" for t in range(2) for p in range(3))
    assert sorted(p.name for p in (root / "iter_0000007").iterdir()) == expected

    root = write_megatron_checkpoint(tmp_path / "c", GQA_SWIGLU, full, tp=1, pp=2, release=True)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert sorted(p.name for p in (root / "release").iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    assert not (root / "iter_0000100").exists()
    merged = merge_megatron_checkpoint(root, GQA_SWIGLU)
    assert all(torch.equal(merged[k], v) for k, v in full.items())


def test_payload_and_args(tmp_path: Path) -> None:
    m = QKNORM_TE_BF16
    root = write_megatron_checkpoint(tmp_path, m, make_full_model(m), tp=2, pp=3, first=1, last=1, iteration=42)
    payload = load_rank_file(root / "iter_0000042" / "mp_rank_01_002" / CHECKPOINT_FILE)
    assert set(payload) == {"args", "checkpoint_version", "iteration", "model"}
    assert payload["checkpoint_version"] == 3.0
    assert payload["iteration"] == 42
    args = payload["args"]
    assert isinstance(args, argparse.Namespace)
    assert vars(args) == dict(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=3,
        expert_model_parallel_size=1,
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=16,
        num_query_groups=8,
        group_query_attention=True,
        kv_channels=4,
        padded_vocab_size=1024,
        make_vocab_size_divisible_by=128,
        vocab_size=1000,
        swiglu=True,
        normalization="LayerNorm",
        norm_epsilon=1e-5,
        add_bias_linear=False,
        add_qkv_bias=True,
        qk_layernorm=True,
        untie_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        max_position_embeddings=32,
        rotary_base=10000,
        seq_length=32,
        params_dtype=torch.bfloat16,
        bf16=True,
        fp16=False,
        transformer_impl="transformer_engine",
        decoder_first_pipeline_num_layers=1,
        decoder_last_pipeline_num_layers=1,
        virtual_pipeline_model_parallel_size=None,
        num_experts=None,
        iteration=42,
    )


def test_tensors_own_storage(tmp_path: Path) -> None:
    m = GQA_SWIGLU
    root = write_megatron_checkpoint(tmp_path, m, make_full_model(m), tp=8, pp=2)
    _, models = read_megatron_checkpoint(root)
    for sd in models.values():
        for name, tensor in sd.items():
            assert tensor.is_contiguous(), name
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name
            assert tensor.storage_offset() == 0, name


def test_padded_rows_zero(tmp_path: Path) -> None:
    m = GQA_SWIGLU
    tp = 8
    root = write_megatron_checkpoint(tmp_path, m, make_full_model(m), tp=tp, pp=2)
    args, models = read_megatron_checkpoint(root)
    assert args.padded_vocab_size == 1024
    for name, stage in (("embedding.word_embeddings.weight", 0), ("output_layer.weight", 1)):
        pieces = [models[(t, stage)][name] for t in range(tp)]
        assert all(piece.shape == (1024 // tp, 64) for piece in pieces)
        padded = torch.cat(pieces)
        assert torch.count_nonzero(padded[1000:]) == 0
        assert torch.count_nonzero(padded[:1000] == 0) == 0
        # rank 7 holds rows [896, 1024): 104 real rows, then 24 zero rows
        assert torch.count_nonzero(pieces[7][104:]) == 0


def test_raw_slices(tmp_path: Path) -> None:
    """Check rank pieces against an independent (reshape-based) formulation of the sharding."""
    m = QKNORM_TE
    tp = 4
    full = make_full_model(m)
    root = write_megatron_checkpoint(tmp_path, m, full, tp=tp, pp=2)
    _, models = read_megatron_checkpoint(root)
    ng, per_group, F = 8, (16 // 8 + 2) * 4, 128
    for t in range(tp):
        sd = models[(t, 1)]  # stage 1 holds global layers 2, 3 as local 0, 1
        src = "decoder.layers.3."
        dst = "decoder.layers.1."
        qkv = full[src + "self_attention.linear_qkv.weight"].reshape(ng, per_group, 64)
        expected_qkv = qkv[t * ng // tp : (t + 1) * ng // tp].reshape(-1, 64)
        assert torch.equal(sd[dst + "self_attention.linear_qkv.weight"], expected_qkv)
        qkv_bias = full[src + "self_attention.linear_qkv.bias"].reshape(ng, per_group)
        assert torch.equal(
            sd[dst + "self_attention.linear_qkv.bias"], qkv_bias[t * ng // tp : (t + 1) * ng // tp].reshape(-1)
        )
        fc1 = full[src + "mlp.linear_fc1.weight"].reshape(2, tp, F // tp, 64)
        assert torch.equal(sd[dst + "mlp.linear_fc1.weight"], fc1[:, t].reshape(-1, 64))
        proj = full[src + "self_attention.linear_proj.weight"]
        assert torch.equal(sd[dst + "self_attention.linear_proj.weight"], proj.tensor_split(tp, dim=1)[t])
        fc2 = full[src + "mlp.linear_fc2.weight"]
        assert torch.equal(sd[dst + "mlp.linear_fc2.weight"], fc2.tensor_split(tp, dim=1)[t])
        assert torch.equal(
            sd[dst + "self_attention.linear_qkv.layer_norm_weight"], full[src + "input_layernorm.weight"]
        )
        assert torch.equal(sd[dst + "mlp.linear_fc1.layer_norm_bias"], full[src + "pre_mlp_layernorm.bias"])
        assert torch.equal(sd[dst + "self_attention.k_layernorm.bias"], full[src + "self_attention.k_layernorm.bias"])


def test_te_key_names(tmp_path: Path) -> None:
    m = QKNORM_TE
    root = write_megatron_checkpoint(tmp_path, m, make_full_model(m), tp=2, pp=1)
    _, models = read_megatron_checkpoint(root)
    sd = models[(1, 0)]
    layer0 = [k.removeprefix("decoder.layers.0.") for k in sd if k.startswith("decoder.layers.0.")]
    assert layer0 == [
        "self_attention.linear_qkv.layer_norm_weight",
        "self_attention.linear_qkv.layer_norm_bias",
        "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv.bias",
        "self_attention.linear_qkv._extra_state",
        "self_attention.q_layernorm.weight",
        "self_attention.q_layernorm.bias",
        "self_attention.k_layernorm.weight",
        "self_attention.k_layernorm.bias",
        "self_attention.core_attention._extra_state",
        "self_attention.linear_proj.weight",
        "self_attention.linear_proj._extra_state",
        "mlp.linear_fc1.layer_norm_weight",
        "mlp.linear_fc1.layer_norm_bias",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc1._extra_state",
        "mlp.linear_fc2.weight",
        "mlp.linear_fc2._extra_state",
    ]
    assert all(sd[k] is None for k in sd if k.endswith("._extra_state"))
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in sd)
    keys = list(sd)
    assert keys[0] == "embedding.word_embeddings.weight"
    assert keys[-3:] == ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"]


def test_local_key_names_and_order(tmp_path: Path) -> None:
    m = MHA_GELU
    root = write_megatron_checkpoint(tmp_path, m, make_full_model(m), tp=2, pp=2)
    _, models = read_megatron_checkpoint(root)
    first_stage = list(models[(0, 0)])
    assert first_stage[:2] == ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"]
    assert first_stage[2] == "decoder.layers.0.input_layernorm.weight"
    assert first_stage[-1] == "decoder.layers.1.mlp.linear_fc2.bias"
    assert not any(k.startswith("decoder.layers.2.") or "_extra_state" in k for k in first_stage)
    last_stage = list(models[(1, 1)])
    assert last_stage[0] == "decoder.layers.0.input_layernorm.weight"
    assert last_stage[-3:] == ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"]
    assert "embedding.word_embeddings.weight" not in last_stage
    assert "embedding.position_embeddings.weight" not in last_stage


def test_tied_output_layer(tmp_path: Path) -> None:
    m = MHA_GELU
    full = make_full_model(m)
    root = write_megatron_checkpoint(tmp_path / "pp1", m, full, tp=2, pp=1)
    _, models = read_megatron_checkpoint(root)
    assert all("output_layer.weight" not in sd for sd in models.values())

    root = write_megatron_checkpoint(tmp_path / "pp2", m, full, tp=2, pp=2)
    _, models = read_megatron_checkpoint(root)
    for t in range(2):
        assert torch.equal(models[(t, 1)]["output_layer.weight"], models[(t, 0)]["embedding.word_embeddings.weight"])


def _rewrite_rank(root: Path, rank_dir: str, key: str, value: torch.Tensor | None) -> None:
    path = root / "iter_0000100" / rank_dir / CHECKPOINT_FILE
    payload = load_rank_file(path)
    if value is None:
        del payload["model"][key]  # type: ignore[index]
    else:
        payload["model"][key] = value  # type: ignore[index]
    torch.save(payload, path)


def test_merge_detects_inconsistencies(tmp_path: Path) -> None:
    m = MHA_GELU
    full = make_full_model(m)

    root = write_megatron_checkpoint(tmp_path / "rep", m, full, tp=2, pp=2)
    _rewrite_rank(root, "mp_rank_01_000", "decoder.layers.0.input_layernorm.weight", torch.zeros(64))
    with pytest.raises(AssertionError, match="differs"):
        merge_megatron_checkpoint(root, m)

    root = write_megatron_checkpoint(tmp_path / "tied", m, full, tp=2, pp=2)
    _rewrite_rank(root, "mp_rank_00_001", "output_layer.weight", torch.zeros(512, 64))
    with pytest.raises(AssertionError, match="tied"):
        merge_megatron_checkpoint(root, m)

    root = write_megatron_checkpoint(tmp_path / "extra", m, full, tp=2, pp=2)
    _rewrite_rank(root, "mp_rank_00_001", "decoder.layers.0.bogus", torch.zeros(1))
    with pytest.raises(AssertionError, match="unexpected"):
        merge_megatron_checkpoint(root, m)

    root = write_megatron_checkpoint(tmp_path / "missing", m, full, tp=2, pp=2)
    _rewrite_rank(root, "mp_rank_01_001", "decoder.layers.1.mlp.linear_fc1.bias", None)
    with pytest.raises(AssertionError, match="missing"):
        merge_megatron_checkpoint(root, m)
