"""Self-checks for the test-only Megatron checkpoint fixtures in megatron_fixtures.py."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch
from support.megatron_fixtures import (
    CHECKPOINT_FILE,
    TinyModel,
    load_rank_file,
    make_full_model,
    merge_megatron_checkpoint,
    padded_vocab_size,
    read_megatron_checkpoint,
    read_megatron_checkpoint_ranks,
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
        num_layers_per_virtual_pipeline_stage=None,
        num_experts=None,
        moe_ffn_hidden_size=None,
        moe_layer_freq=1,
        moe_shared_expert_intermediate_size=None,
        moe_shared_expert_gate=False,
        moe_router_enable_expert_bias=False,
        moe_grouped_gemm=False,
        moe_router_topk=2,
        expert_tensor_parallel_size=2,
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


# --------------------------------------------------------------------------- MoE / EP / VPP

MOE = TinyModel(
    **_BASE,
    num_query_groups=8,
    swiglu=True,
    normalization="RMSNorm",
    add_bias_linear=False,
    add_qkv_bias=False,
    qk_layernorm=False,
    tied_embeddings=False,
    position_embedding_type="rope",
    num_experts=8,
    moe_ffn_hidden_size=64,
    moe_layer_freq=[1, 0, 1, 1],
    moe_shared_expert_intermediate_size=96,
    moe_shared_expert_gate=True,
    moe_router_enable_expert_bias=True,
)
MOE_GROUPED = dataclasses.replace(MOE, moe_grouped_gemm=True)
MOE_TE = dataclasses.replace(MOE, transformer_impl="transformer_engine")
MOE_GROUPED_TE = dataclasses.replace(MOE_GROUPED, transformer_impl="transformer_engine")
MOE_GROUPED_TE_TIED_BF16 = dataclasses.replace(MOE_GROUPED_TE, tied_embeddings=True, dtype=torch.bfloat16)
# every other layer MoE, GELU experts, LayerNorm, qk-norm, learned positions, tied, no shared experts
MOE_GELU_FREQ2_TE_TIED = TinyModel(
    **_BASE,
    num_query_groups=8,
    swiglu=False,
    normalization="LayerNorm",
    add_bias_linear=False,
    add_qkv_bias=True,
    qk_layernorm=True,
    tied_embeddings=True,
    position_embedding_type="learned_absolute",
    transformer_impl="transformer_engine",
    num_experts=8,
    moe_layer_freq=2,
)

MOE_MODELS = {
    "moe_seq_local": MOE,
    "moe_grouped_local": MOE_GROUPED,
    "moe_seq_te": MOE_TE,
    "moe_grouped_te": MOE_GROUPED_TE,
    "moe_grouped_te_tied_bf16": MOE_GROUPED_TE_TIED_BF16,
    "moe_gelu_freq2_te_tied": MOE_GELU_FREQ2_TE_TIED,
    "dense_gqa_swiglu": GQA_SWIGLU,
    "dense_mha_gelu_tied": MHA_GELU,
}
# (tp, pp, ep, vpp, first, last)
MOE_LAYOUTS = [
    (1, 1, 1, None, None, None),
    (2, 1, 2, None, None, None),
    (1, 2, 4, None, None, None),
    (2, 2, 1, 2, None, None),
    (1, 1, 1, 2, None, None),
    (1, 1, 8, None, None, None),
    (2, 2, 4, 2, None, None),
    (1, 2, 2, 1, None, None),
    (1, 1, 1, 1, None, None),
    (4, 1, 2, None, None, None),
    (2, 3, 2, None, 1, 1),
    (1, 1, 2, 4, None, None),
]


def _moe_layout_id(layout: tuple[int, int, int, int | None, int | None, int | None]) -> str:
    tp, pp, ep, vpp, first, last = layout
    text = f"tp{tp}pp{pp}ep{ep}"
    if vpp is not None:
        text += f"vpp{vpp}"
    if first is not None:
        text += f"f{first}"
    if last is not None:
        text += f"l{last}"
    return text


# expert parallelism needs an MoE model: dense models only get the ep == 1 layouts
_MOE_CASES = [
    pytest.param(name, layout, id=f"{name}-{_moe_layout_id(layout)}")
    for name in sorted(MOE_MODELS)
    for layout in MOE_LAYOUTS
    if MOE_MODELS[name].is_moe or layout[2] == 1
]


@pytest.mark.parametrize(("model_name", "layout"), _MOE_CASES)
def test_moe_ep_vpp_roundtrip(
    tmp_path: Path, model_name: str, layout: tuple[int, int, int, int | None, int | None, int | None]
) -> None:
    m = MOE_MODELS[model_name]
    tp, pp, ep, vpp, first, last = layout
    full = make_full_model(m, seed=5)
    root = write_megatron_checkpoint(tmp_path / "ckpt", m, full, tp, pp, first, last, ep=ep, vpp=vpp)
    merged = merge_megatron_checkpoint(root, m)
    assert list(merged) == list(full)
    for name, tensor in full.items():
        assert merged[name].dtype == tensor.dtype, name
        assert torch.equal(merged[name], tensor), name
    args, ranks = read_megatron_checkpoint_ranks(root)
    assert set(ranks) == {(t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)}
    chunk_keys = ["model"] if vpp is None else [f"model{c}" for c in range(vpp)]
    assert all(list(chunks) == chunk_keys for chunks in ranks.values())
    assert args.expert_model_parallel_size == ep
    assert args.expert_tensor_parallel_size == tp
    assert args.virtual_pipeline_model_parallel_size == vpp


def test_moe_full_model_shapes_and_dtypes() -> None:
    m = MOE_GROUPED_TE_TIED_BF16
    full = make_full_model(m)
    names = list(full)
    layer0 = [k.removeprefix("decoder.layers.0.") for k in names if k.startswith("decoder.layers.0.")]
    assert layer0 == [
        "input_layernorm.weight",
        "self_attention.linear_qkv.weight",
        "self_attention.linear_proj.weight",
        "pre_mlp_layernorm.weight",
        "mlp.router.weight",
        "mlp.router.expert_bias",
        *[f"mlp.experts.local_experts.{e}.linear_fc{i}.weight" for e in range(8) for i in (1, 2)],
        "mlp.shared_experts.linear_fc1.weight",
        "mlp.shared_experts.linear_fc2.weight",
        "mlp.shared_experts.gate_weight",
    ]
    # layer 1 is dense (moe_layer_freq [1, 0, 1, 1])
    assert full["decoder.layers.1.mlp.linear_fc1.weight"].shape == (256, 64)
    assert not any(k.startswith("decoder.layers.1.mlp.") and "expert" in k for k in names)
    assert "decoder.layers.2.mlp.router.weight" in full and "decoder.layers.3.mlp.router.weight" in full
    assert full["decoder.layers.0.mlp.router.weight"].shape == (8, 64)
    assert full["decoder.layers.0.mlp.router.weight"].dtype == torch.float32
    assert full["decoder.layers.0.mlp.router.expert_bias"].shape == (8,)
    assert full["decoder.layers.0.mlp.router.expert_bias"].dtype == torch.float32
    assert full["decoder.layers.0.mlp.experts.local_experts.7.linear_fc1.weight"].shape == (128, 64)
    assert full["decoder.layers.0.mlp.experts.local_experts.7.linear_fc2.weight"].shape == (64, 64)
    assert full["decoder.layers.0.mlp.experts.local_experts.7.linear_fc2.weight"].dtype == torch.bfloat16
    assert full["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"].shape == (192, 64)
    assert full["decoder.layers.0.mlp.shared_experts.linear_fc2.weight"].shape == (64, 96)
    assert full["decoder.layers.0.mlp.shared_experts.gate_weight"].shape == (1, 64)

    g = make_full_model(MOE_GELU_FREQ2_TE_TIED)
    assert [L for L in range(4) if f"decoder.layers.{L}.mlp.router.weight" in g] == [0, 2]
    # Fe defaults to ffn_hidden_size; GELU experts: fc1 is [Fe, H]
    assert g["decoder.layers.2.mlp.experts.local_experts.0.linear_fc1.weight"].shape == (128, 64)
    assert "decoder.layers.0.mlp.router.expert_bias" not in g
    assert not any("shared_experts" in k for k in g)
    # dense models are unchanged by the new fields
    assert MOE.is_moe and not GQA_SWIGLU.is_moe and not GQA_SWIGLU.is_moe_layer(0)


def test_moe_expert_placement_sequential_and_grouped(tmp_path: Path) -> None:
    for m, grouped in ((MOE, False), (MOE_GROUPED, True)):
        full = make_full_model(m)
        root = write_megatron_checkpoint(tmp_path / str(grouped), m, full, tp=1, pp=2, ep=4)
        _, ranks = read_megatron_checkpoint_ranks(root)
        # global layer 3 lives on stage 1 as local layer 1; layer 0 on stage 0 as local 0
        for (p, local, glob) in ((0, 0, 0), (1, 1, 3)):
            sd = ranks[(0, p, 2)]["model"]
            src = f"decoder.layers.{glob}.mlp.experts.local_experts.5."
            if grouped:
                fc1 = sd[f"decoder.layers.{local}.mlp.experts.linear_fc1.weight1"]
                fc2 = sd[f"decoder.layers.{local}.mlp.experts.linear_fc2.weight1"]
                assert not any("local_experts" in k for k in sd)
            else:
                fc1 = sd[f"decoder.layers.{local}.mlp.experts.local_experts.1.linear_fc1.weight"]
                fc2 = sd[f"decoder.layers.{local}.mlp.experts.local_experts.1.linear_fc2.weight"]
                assert not any(".weight1" in k or ".weight0" in k for k in sd)
            assert torch.equal(fc1, full[src + "linear_fc1.weight"])  # type: ignore[arg-type]
            assert torch.equal(fc2, full[src + "linear_fc2.weight"])  # type: ignore[arg-type]
            # each ep rank holds exactly E/ep = 2 local experts per MoE layer
            if grouped:
                assert sorted(k for k in sd if k.startswith(f"decoder.layers.{local}.mlp.experts.")) == [
                    f"decoder.layers.{local}.mlp.experts.linear_fc{i}.weight{j}" for i in (1, 2) for j in (0, 1)
                ]
        if grouped:
            layer0 = [k for k in ranks[(0, 0, 0)]["model"] if k.startswith("decoder.layers.0.mlp.experts.")]
            assert layer0 == [
                "decoder.layers.0.mlp.experts.linear_fc1.weight0",
                "decoder.layers.0.mlp.experts.linear_fc1.weight1",
                "decoder.layers.0.mlp.experts.linear_fc2.weight0",
                "decoder.layers.0.mlp.experts.linear_fc2.weight1",
            ]


def test_moe_raw_slices_tp2_ep2(tmp_path: Path) -> None:
    """Expert / shared-expert / router pieces against an independent reshape-based formulation."""
    m = MOE_TE
    tp, ep = 2, 2
    full = make_full_model(m)
    root = write_megatron_checkpoint(tmp_path, m, full, tp=tp, pp=1, ep=ep)
    _, ranks = read_megatron_checkpoint_ranks(root)
    Fe, Fs, H = 64, 96, 64
    src = "decoder.layers.2."
    dst = "decoder.layers.2."
    for t in range(tp):
        for e in range(ep):
            sd = ranks[(t, 0, e)]["model"]
            for j in range(4):
                g = e * 4 + j
                fc1 = full[f"{src}mlp.experts.local_experts.{g}.linear_fc1.weight"].reshape(2, tp, Fe // tp, H)
                got1 = sd[f"{dst}mlp.experts.local_experts.{j}.linear_fc1.weight"]
                assert torch.equal(got1, fc1[:, t].reshape(-1, H))  # type: ignore[arg-type]
                fc2 = full[f"{src}mlp.experts.local_experts.{g}.linear_fc2.weight"]
                got2 = sd[f"{dst}mlp.experts.local_experts.{j}.linear_fc2.weight"]
                assert torch.equal(got2, fc2.tensor_split(tp, dim=1)[t])  # type: ignore[arg-type]
            shared1 = full[src + "mlp.shared_experts.linear_fc1.weight"].reshape(2, tp, Fs // tp, H)
            assert torch.equal(sd[dst + "mlp.shared_experts.linear_fc1.weight"], shared1[:, t].reshape(-1, H))  # type: ignore[arg-type]
            shared2 = full[src + "mlp.shared_experts.linear_fc2.weight"]
            assert torch.equal(sd[dst + "mlp.shared_experts.linear_fc2.weight"], shared2.tensor_split(tp, dim=1)[t])  # type: ignore[arg-type]
            for name in ("mlp.shared_experts.gate_weight", "mlp.router.weight", "mlp.router.expert_bias"):
                assert torch.equal(sd[dst + name], full[src + name]), name  # type: ignore[arg-type]
            assert sd[dst + "mlp.router.weight"].dtype == torch.float32  # type: ignore[union-attr]
            assert sd[dst + "mlp.router.expert_bias"].dtype == torch.float32  # type: ignore[union-attr]
            # non-expert tensors are identical on every ep rank
            ref = ranks[(t, 0, 0)]["model"]
            for name, value in sd.items():
                if ".mlp.experts." in name or value is None:
                    continue
                assert torch.equal(value, ref[name]), name  # type: ignore[arg-type]


def test_moe_router_fp32_in_bf16_checkpoint(tmp_path: Path) -> None:
    m = MOE_GROUPED_TE_TIED_BF16
    full = make_full_model(m)
    root = write_megatron_checkpoint(tmp_path, m, full, tp=2, pp=2, ep=2)
    _, ranks = read_megatron_checkpoint_ranks(root)
    for chunks in ranks.values():
        for name, value in chunks["model"].items():
            if value is None:
                continue
            expected = torch.float32 if ".mlp.router." in name else torch.bfloat16
            assert value.dtype == expected, name  # type: ignore[union-attr]
    merged = merge_megatron_checkpoint(root, m)
    assert merged["decoder.layers.0.mlp.router.weight"].dtype == torch.float32


def _layer_keys(sd: dict[str, object], local: int) -> list[str]:
    prefix = f"decoder.layers.{local}."
    return [k.removeprefix(prefix) for k in sd if k.startswith(prefix)]


_TE_ATTENTION_KEYS = [
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv._extra_state",
    "self_attention.core_attention._extra_state",
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj._extra_state",
]


def test_moe_te_key_names(tmp_path: Path) -> None:
    root = write_megatron_checkpoint(tmp_path / "grouped", MOE_GROUPED_TE, make_full_model(MOE_GROUPED_TE), 2, 1, ep=4)
    _, ranks = read_megatron_checkpoint_ranks(root)
    sd = ranks[(1, 0, 3)]["model"]
    assert _layer_keys(sd, 0) == [
        *_TE_ATTENTION_KEYS,
        "pre_mlp_layernorm.weight",
        "mlp.router.weight",
        "mlp.router.expert_bias",
        "mlp.experts.linear_fc1.weight0",
        "mlp.experts.linear_fc1.weight1",
        "mlp.experts.linear_fc1._extra_state",
        "mlp.experts.linear_fc2.weight0",
        "mlp.experts.linear_fc2.weight1",
        "mlp.experts.linear_fc2._extra_state",
        "mlp.shared_experts.linear_fc1.weight",
        "mlp.shared_experts.linear_fc1._extra_state",
        "mlp.shared_experts.linear_fc2.weight",
        "mlp.shared_experts.linear_fc2._extra_state",
        "mlp.shared_experts.gate_weight",
    ]
    # layer 1 is dense: fused pre-MLP norm and the dense extra states as before
    assert _layer_keys(sd, 1) == [
        *_TE_ATTENTION_KEYS,
        "mlp.linear_fc1.layer_norm_weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc1._extra_state",
        "mlp.linear_fc2.weight",
        "mlp.linear_fc2._extra_state",
    ]
    assert all(sd[k] is None for k in sd if k.endswith("._extra_state"))

    root = write_megatron_checkpoint(tmp_path / "seq", MOE_TE, make_full_model(MOE_TE), 1, 1, ep=4)
    _, ranks = read_megatron_checkpoint_ranks(root)
    sd = ranks[(0, 0, 1)]["model"]
    assert _layer_keys(sd, 3) == [
        *_TE_ATTENTION_KEYS,
        "pre_mlp_layernorm.weight",
        "mlp.router.weight",
        "mlp.router.expert_bias",
        "mlp.experts.local_experts.0.linear_fc1.weight",
        "mlp.experts.local_experts.0.linear_fc1._extra_state",
        "mlp.experts.local_experts.0.linear_fc2.weight",
        "mlp.experts.local_experts.0.linear_fc2._extra_state",
        "mlp.experts.local_experts.1.linear_fc1.weight",
        "mlp.experts.local_experts.1.linear_fc1._extra_state",
        "mlp.experts.local_experts.1.linear_fc2.weight",
        "mlp.experts.local_experts.1.linear_fc2._extra_state",
        "mlp.shared_experts.linear_fc1.weight",
        "mlp.shared_experts.linear_fc1._extra_state",
        "mlp.shared_experts.linear_fc2.weight",
        "mlp.shared_experts.linear_fc2._extra_state",
        "mlp.shared_experts.gate_weight",
    ]

    # LayerNorm MoE layer under TE: pre_mlp_layernorm.weight/.bias unfused
    m = MOE_GELU_FREQ2_TE_TIED
    root = write_megatron_checkpoint(tmp_path / "ln", m, make_full_model(m), 1, 1)
    _, ranks = read_megatron_checkpoint_ranks(root)
    keys = _layer_keys(ranks[(0, 0, 0)]["model"], 2)
    assert "pre_mlp_layernorm.weight" in keys and "pre_mlp_layernorm.bias" in keys
    assert not any(k.startswith("mlp.linear_fc1") or k.startswith("mlp.linear_fc2") for k in keys)
    assert "mlp.linear_fc1.layer_norm_bias" in _layer_keys(ranks[(0, 0, 0)]["model"], 1)


def test_moe_local_key_names(tmp_path: Path) -> None:
    root = write_megatron_checkpoint(tmp_path, MOE, make_full_model(MOE), 1, 1, ep=2)
    _, ranks = read_megatron_checkpoint_ranks(root)
    sd = ranks[(0, 0, 1)]["model"]
    keys = _layer_keys(sd, 0)
    assert keys[:5] == [
        "input_layernorm.weight",
        "self_attention.linear_qkv.weight",
        "self_attention.linear_proj.weight",
        "pre_mlp_layernorm.weight",
        "mlp.router.weight",
    ]
    assert [k for k in keys if "local_experts" in k] == [
        f"mlp.experts.local_experts.{j}.linear_fc{i}.weight" for j in range(4) for i in (1, 2)
    ]
    assert not any("_extra_state" in k for k in sd)
    assert "mlp.linear_fc1.weight" in _layer_keys(sd, 1)


def test_ep_directory_names(tmp_path: Path) -> None:
    full = make_full_model(MOE)
    root = write_megatron_checkpoint(tmp_path / "a", MOE, full, tp=1, pp=1, ep=2)
    assert sorted(p.name for p in (root / "iter_0000100").iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]

    root = write_megatron_checkpoint(tmp_path / "b", MOE, full, tp=2, pp=2, ep=4)
    names = sorted(p.name for p in (root / "iter_0000100").iterdir())
    assert names == sorted(f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2) for e in range(4))
    assert (root / "iter_0000100" / "mp_rank_01_001_003" / CHECKPOINT_FILE).is_file()
    _, ranks = read_megatron_checkpoint_ranks(root)
    # (tp, pp, ep) = (1, 1, 3): stage 1 holds global layers 2, 3; ep rank 3 holds experts 6, 7
    sd = ranks[(1, 1, 3)]["model"]
    expected = full["decoder.layers.3.mlp.experts.local_experts.7.linear_fc2.weight"].tensor_split(2, dim=1)[1]
    assert torch.equal(sd["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"], expected)  # type: ignore[arg-type]

    root = write_megatron_checkpoint(tmp_path / "c", MOE, full, tp=2, pp=1, ep=1)
    assert sorted(p.name for p in (root / "iter_0000100").iterdir()) == ["mp_rank_00", "mp_rank_01"]


def test_moe_args(tmp_path: Path) -> None:
    root = write_megatron_checkpoint(tmp_path / "a", MOE_GROUPED, make_full_model(MOE_GROUPED), 2, 2, ep=4, vpp=2)
    payload = load_rank_file(root / "iter_0000100" / "mp_rank_01_001_003" / CHECKPOINT_FILE)
    assert set(payload) == {"args", "checkpoint_version", "iteration", "model0", "model1"}
    args = payload["args"]
    assert isinstance(args, argparse.Namespace)
    assert args.num_experts == 8
    assert args.moe_ffn_hidden_size == 64
    assert args.moe_layer_freq == [1, 0, 1, 1]
    assert args.moe_shared_expert_intermediate_size == 96
    assert args.moe_shared_expert_gate is True
    assert args.moe_router_enable_expert_bias is True
    assert args.moe_grouped_gemm is True
    assert args.moe_router_topk == 2
    assert args.expert_model_parallel_size == 4
    assert args.expert_tensor_parallel_size == 2
    assert args.virtual_pipeline_model_parallel_size == 2
    assert args.num_layers_per_virtual_pipeline_stage == 1
    assert args.tensor_model_parallel_size == 2 and args.pipeline_model_parallel_size == 2

    m = MOE_GELU_FREQ2_TE_TIED
    root = write_megatron_checkpoint(tmp_path / "b", m, make_full_model(m), 1, 1)
    args = load_rank_file(root / "iter_0000100" / "mp_rank_00" / CHECKPOINT_FILE)["args"]
    assert args.moe_ffn_hidden_size == 128  # defaults to ffn_hidden_size
    assert args.moe_layer_freq == 2
    assert args.moe_shared_expert_intermediate_size is None
    assert args.virtual_pipeline_model_parallel_size is None
    assert args.num_layers_per_virtual_pipeline_stage is None


def test_vpp_chunk_placement(tmp_path: Path) -> None:
    m = MHA_GELU  # tied, learned positions
    full = make_full_model(m)
    root = write_megatron_checkpoint(tmp_path / "pp2", m, full, tp=1, pp=2, vpp=2)
    _, ranks = read_megatron_checkpoint_ranks(root)
    # virtual stage s = c * pp + p holds global layer s (n = 4 / (2 * 2) = 1), as local layer 0
    for p in range(2):
        for c in range(2):
            sd = ranks[(0, p, 0)][f"model{c}"]
            s = c * 2 + p
            assert [k for k in sd if k.startswith("decoder.layers.") and not k.startswith("decoder.layers.0.")] == []
            assert torch.equal(
                sd["decoder.layers.0.input_layernorm.weight"],  # type: ignore[arg-type]
                full[f"decoder.layers.{s}.input_layernorm.weight"],
            )
            assert ("embedding.word_embeddings.weight" in sd) == (s == 0)
            assert ("embedding.position_embeddings.weight" in sd) == (s == 0)
            assert ("decoder.final_layernorm.weight" in sd) == (s == 3)
            assert ("output_layer.weight" in sd) == (s == 3)
    first = list(ranks[(0, 0, 0)]["model0"])
    assert first[:2] == ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"]
    last = list(ranks[(0, 1, 0)]["model1"])
    assert last[-3:] == ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"]

    # tied, pp == 1: the output copy goes into the last chunk when there is more than one virtual stage
    root = write_megatron_checkpoint(tmp_path / "pp1vpp2", m, full, tp=2, pp=1, vpp=2)
    _, ranks = read_megatron_checkpoint_ranks(root)
    for t in range(2):
        assert "output_layer.weight" not in ranks[(t, 0, 0)]["model0"]
        assert torch.equal(
            ranks[(t, 0, 0)]["model1"]["output_layer.weight"],  # type: ignore[arg-type]
            ranks[(t, 0, 0)]["model0"]["embedding.word_embeddings.weight"],  # type: ignore[arg-type]
        )
        assert list(k for k in ranks[(t, 0, 0)]["model1"] if k.startswith("decoder.layers.")) == [
            k for k in ranks[(t, 0, 0)]["model0"] if k.startswith("decoder.layers.")
        ]
    root = write_megatron_checkpoint(tmp_path / "pp1vpp1", m, full, tp=2, pp=1, vpp=1)
    _, ranks = read_megatron_checkpoint_ranks(root)
    assert all(list(chunks) == ["model0"] and "output_layer.weight" not in chunks["model0"] for chunks in ranks.values())
    assert all(torch.equal(v, full[k]) for k, v in merge_megatron_checkpoint(root, m).items())

    # untied MoE with vpp + ep
    full = make_full_model(MOE)
    root = write_megatron_checkpoint(tmp_path / "moe", MOE, full, tp=1, pp=1, ep=2, vpp=2)
    _, ranks = read_megatron_checkpoint_ranks(root)
    # chunk 1 = virtual stage 1 = global layers 2, 3 as local 0, 1; ep rank 1 has experts 4..7
    sd = ranks[(0, 0, 1)]["model1"]
    assert torch.equal(
        sd["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"],  # type: ignore[arg-type]
        full["decoder.layers.3.mlp.experts.local_experts.6.linear_fc1.weight"],
    )
    assert "decoder.layers.1.mlp.linear_fc1.weight" not in ranks[(0, 0, 1)]["model1"]
    assert "decoder.layers.1.mlp.linear_fc1.weight" in ranks[(0, 0, 1)]["model0"]  # global layer 1 is dense


def test_read_ranks_on_old_layout_and_old_reader_refuses_new(tmp_path: Path) -> None:
    m = GQA_SWIGLU
    root = write_megatron_checkpoint(tmp_path / "old", m, make_full_model(m), tp=2, pp=2)
    args, ranks = read_megatron_checkpoint_ranks(root)
    _, models = read_megatron_checkpoint(root)
    assert set(ranks) == {(t, p, 0) for t in range(2) for p in range(2)}
    assert set(models) == {(t, p) for t in range(2) for p in range(2)}
    for (t, p, _), chunks in ranks.items():
        assert list(chunks) == ["model"]
        assert list(chunks["model"]) == list(models[(t, p)])

    root = write_megatron_checkpoint(tmp_path / "ep", MOE, make_full_model(MOE), tp=1, pp=1, ep=2)
    with pytest.raises(AssertionError, match="read_megatron_checkpoint_ranks"):
        read_megatron_checkpoint(root)
    root = write_megatron_checkpoint(tmp_path / "vpp", m, make_full_model(m), tp=1, pp=2, vpp=2)
    with pytest.raises(AssertionError, match="read_megatron_checkpoint_ranks"):
        read_megatron_checkpoint(root)
    # an MoE model without EP and VPP still reads with the old reader
    root = write_megatron_checkpoint(tmp_path / "moe", MOE, make_full_model(MOE), tp=2, pp=1)
    _, models = read_megatron_checkpoint(root)
    assert "decoder.layers.0.mlp.experts.local_experts.7.linear_fc1.weight" in models[(1, 0)]


def test_new_layout_argument_checks(tmp_path: Path) -> None:
    full = make_full_model(MOE)
    with pytest.raises(AssertionError):
        write_megatron_checkpoint(tmp_path / "a", MOE, full, tp=1, pp=1, ep=3)  # 8 % 3
    with pytest.raises(AssertionError):
        write_megatron_checkpoint(tmp_path / "b", MOE, full, tp=1, pp=3, vpp=2)  # 4 % 6
    with pytest.raises(AssertionError):
        write_megatron_checkpoint(tmp_path / "c", MOE, full, tp=1, pp=2, first=1, vpp=2)
    with pytest.raises(AssertionError):
        write_megatron_checkpoint(tmp_path / "d", GQA_SWIGLU, make_full_model(GQA_SWIGLU), tp=1, pp=1, ep=2)
    with pytest.raises(AssertionError):
        dataclasses.replace(MHA_GELU, num_experts=4)  # experts have no biases
    with pytest.raises(AssertionError):
        dataclasses.replace(MOE, moe_layer_freq=[1, 0, 1])  # one entry per layer


def _rewrite(root: Path, rank_dir: str, chunk: str, key: str, value: torch.Tensor | None) -> None:
    path = root / "iter_0000100" / rank_dir / CHECKPOINT_FILE
    payload = load_rank_file(path)
    if value is None:
        del payload[chunk][key]  # type: ignore[index]
    else:
        payload[chunk][key] = value  # type: ignore[index]
    torch.save(payload, path)


def test_moe_merge_detects_inconsistencies(tmp_path: Path) -> None:
    m = MOE_GROUPED
    full = make_full_model(m)

    root = write_megatron_checkpoint(tmp_path / "ep_diff", m, full, tp=1, pp=1, ep=2)
    _rewrite(root, "mp_rank_00_001", "model", "decoder.layers.0.mlp.router.weight", torch.zeros(8, 64))
    with pytest.raises(AssertionError, match="ep rank 1 differs"):
        merge_megatron_checkpoint(root, m)

    root = write_megatron_checkpoint(tmp_path / "missing", m, full, tp=1, pp=1, ep=2)
    _rewrite(root, "mp_rank_00_001", "model", "decoder.layers.2.mlp.experts.linear_fc2.weight3", None)
    with pytest.raises(AssertionError, match="missing"):
        merge_megatron_checkpoint(root, m)

    root = write_megatron_checkpoint(tmp_path / "extra", m, full, tp=1, pp=1, ep=2)
    _rewrite(root, "mp_rank_00_000", "model", "decoder.layers.2.mlp.experts.linear_fc1.weight4", torch.zeros(128, 64))
    with pytest.raises(AssertionError, match="unexpected"):
        merge_megatron_checkpoint(root, m)

    root = write_megatron_checkpoint(tmp_path / "vpp_extra", m, full, tp=1, pp=2, vpp=2)
    _rewrite(root, "mp_rank_00_001", "model0", "decoder.layers.1.input_layernorm.weight", torch.zeros(64))
    with pytest.raises(AssertionError, match="unexpected"):
        merge_megatron_checkpoint(root, m)

    root = write_megatron_checkpoint(tmp_path / "tied", MHA_GELU, make_full_model(MHA_GELU), tp=1, pp=1, vpp=2)
    _rewrite(root, "mp_rank_00", "model1", "output_layer.weight", torch.zeros(1024, 64))
    with pytest.raises(AssertionError, match="tied"):
        merge_megatron_checkpoint(root, MHA_GELU)
