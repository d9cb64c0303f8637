"""The model provider: the exact tensors, names and shapes each rank holds."""

from __future__ import annotations

from pgconvert.model.config import ModelConfig
from pgconvert.model.grid import build_converter_process_groups
from pgconvert.model.layout import ParallelLayout
from pgconvert.model.provider import canonical_names, provide

LLAMA = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=16, num_query_groups=8,
                    kv_channels=4, ffn_hidden_size=128, vocab_size=1000)


def shapes_of(config: ModelConfig, layout: ParallelLayout, tp: int, pp: int) -> dict[str, tuple[int, ...]]:
    groups = build_converter_process_groups(layout)
    groups.set_ranks(tp=tp, pp=pp)
    return {spec.local_name: spec.local_shape for spec in provide(config, groups).specs}


def test_first_stage_of_tp2_pp2_holds_embedding_and_local_layers() -> None:
    shapes = shapes_of(LLAMA, ParallelLayout(tp=2, pp=2), tp=1, pp=0)

    assert shapes == {
        "embedding.word_embeddings.weight": (512, 64),
        **{f"decoder.layers.{i}.{name}": shape for i in range(2) for name, shape in [
            ("input_layernorm.weight", (64,)),
            ("self_attention.linear_qkv.weight", (64, 64)),
            ("self_attention.linear_proj.weight", (64, 32)),
            ("pre_mlp_layernorm.weight", (64,)),
            ("mlp.linear_fc1.weight", (128, 64)),
            ("mlp.linear_fc2.weight", (64, 64)),
        ]},
    }


def test_last_stage_holds_final_norm_and_output_layer_with_global_layer_names() -> None:
    groups = build_converter_process_groups(ParallelLayout(tp=2, pp=2))
    groups.set_ranks(tp=0, pp=1)

    shard = provide(LLAMA, groups)

    canonical = {spec.local_name: spec.canonical for spec in shard.specs}
    assert canonical["decoder.layers.0.mlp.linear_fc2.weight"] == "decoder.layers.2.mlp.linear_fc2.weight"
    assert canonical["output_layer.weight"] == "output_layer.weight"
    assert "decoder.final_layernorm.weight" in canonical
    assert shard.layers == range(2, 4)


def test_tied_embeddings_give_the_last_stage_an_output_copy_only_when_pp_above_one() -> None:
    tied = LLAMA.replace(tie_embeddings=True)

    single = shapes_of(tied, ParallelLayout(pp=1), tp=0, pp=0)
    groups = build_converter_process_groups(ParallelLayout(pp=2))
    groups.set_ranks(pp=1)
    last = {spec.local_name: spec.canonical for spec in provide(tied, groups).specs}

    assert "output_layer.weight" not in single
    assert last["output_layer.weight"] == "embedding.word_embeddings.weight"


def test_transformer_engine_spec_fuses_norm_names_into_the_linears() -> None:
    te = LLAMA.replace(transformer_impl="transformer_engine", normalization="LayerNorm")

    names = set(shapes_of(te, ParallelLayout(), tp=0, pp=0))

    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_bias" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert not any("input_layernorm" in name or "pre_mlp_layernorm" in name for name in names)


def test_optional_tensors_follow_the_config() -> None:
    config = LLAMA.replace(add_bias_linear=True, qk_layernorm=True, normalization="LayerNorm",
                           position_embedding_type="learned_absolute", max_position_embeddings=32,
                           gated_linear_unit=False, activation="gelu")

    names = canonical_names(config)

    layer0 = [name.removeprefix("decoder.layers.0.") for name in names if name.startswith("decoder.layers.0.")]
    assert layer0 == [
        "input_layernorm.weight", "input_layernorm.bias",
        "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
        "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
        "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias",
        "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
        "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
        "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias",
    ]
    assert names[:2] == ["embedding.word_embeddings.weight", "embedding.position_embeddings.weight"]
    assert names[-3:] == ["decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight"]


def test_moe_layer_order_is_router_then_experts_then_shared_experts() -> None:
    """Routed experts sit right after the router (its expert bias included), before the shared experts."""
    config = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=16, num_query_groups=8,
                         kv_channels=4, ffn_hidden_size=128, vocab_size=1000, num_experts=2,
                         moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=96,
                         moe_router_enable_expert_bias=True)
    names = [name.removeprefix("decoder.layers.0.") for name in canonical_names(config)
             if name.startswith("decoder.layers.0.mlp.")]
    assert names == [
        "mlp.router.weight", "mlp.router.expert_bias",
        "mlp.experts.local_experts.0.linear_fc1.weight", "mlp.experts.local_experts.0.linear_fc2.weight",
        "mlp.experts.local_experts.1.linear_fc1.weight", "mlp.experts.local_experts.1.linear_fc2.weight",
        "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight",
    ]


def test_routed_experts_are_told_apart_by_the_provider_in_every_naming() -> None:
    from pgconvert.model.provider import is_routed_expert

    assert is_routed_expert("decoder.layers.3.mlp.experts.local_experts.7.linear_fc1.weight")
    assert is_routed_expert("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2._extra_state")
    # TEGroupedMLP's one module per layer (weight{j} parameters, one _extra_state per linear)
    assert is_routed_expert("decoder.layers.1.mlp.experts.linear_fc1._extra_state")
    assert is_routed_expert("decoder.layers.1.mlp.experts.linear_fc2.weight3")
    assert not is_routed_expert("decoder.layers.1.mlp.shared_experts.linear_fc1.weight")
    assert not is_routed_expert("decoder.layers.1.mlp.router.weight")
    assert not is_routed_expert("mlp.experts.local_experts.0.linear_fc1.weight")  # not a layer name


def test_the_layer_spec_is_told_by_the_fused_norm_names() -> None:
    from pgconvert.model.provider import fused_norm_name, layer_spec_of_key

    assert fused_norm_name("input_layernorm.bias") == "self_attention.linear_qkv.layer_norm_bias"
    assert fused_norm_name("pre_mlp_layernorm.weight") == "mlp.linear_fc1.layer_norm_weight"
    assert fused_norm_name("self_attention.linear_qkv.weight") is None
    assert layer_spec_of_key("decoder.layers.2.mlp.linear_fc1.layer_norm_weight") == "transformer_engine"
    assert layer_spec_of_key("decoder.layers.2.input_layernorm.weight") == "local"
    # a TE-spec MoE layer keeps its separate pre-MLP norm: it tells no spec apart
    assert layer_spec_of_key("decoder.layers.2.pre_mlp_layernorm.weight") is None
    assert layer_spec_of_key("decoder.final_layernorm.weight") is None
