"""ModelConfig grouped into sub-configs: the settings' places, what it writes, and the flat names it
takes for plugins and tests (SettingsByName)."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from pgconvert.errors import ConfigError
from pgconvert.model.config import (GROUPS, SETTING_GROUPS, AttentionConfig, CarriedConfig, MLPConfig, MoEConfig,
                                    ModelConfig, NormConfig, PositionConfig)

# A config that sets something in every group (the base commit's to_dict of it is EXPECTED below).
SETTINGS: dict[str, object] = dict(
    num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=96,
    vocab_size=1000, make_vocab_size_divisible_by=64, normalization="LayerNorm", norm_epsilon=1e-6,
    add_qkv_bias=True, qk_layernorm=True, tie_embeddings=True, max_position_embeddings=4096, rotary_base=500000.0,
    params_dtype="float32", transformer_impl="transformer_engine", num_experts=4, moe_ffn_hidden_size=48,
    moe_layer_freq=[0, 1, 1, 1], moe_router_topk=1, moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True,
    moe_router_enable_expert_bias=True, moe_grouped_gemm=True, rotary_percent=0.5, rope_scaling="yarn",
    rope_scaling_factor=4.0, sliding_window=16, window_layers=[1, 0, 1, 0], layernorm_zero_centered_gamma=True,
    attention_dropout=0.1, moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5,
    yarn_original_max_position_embeddings=1024, yarn_mscale_all_dim=1.0, moe_router_num_groups=2,
    moe_router_group_topk=1, embedding_multiplier=12.0, no_rope_layers=[0, 0, 0, 1],
    hf_rope_parameters='{"rope_type": "longrope"}', post_mlp_layernorm=True, attn_logit_softcapping=50.0,
    rotary_base_local=10000.0, softmax_type="learnable", glu_linear_offset=1.0, activation_func_clamp_value=7.0,
    softmax_scale=0.25, mtp_num_layers=1, mtp_layer_module="mtp_model_layer")

# What every output's pgconvert.json and ``inspect --json`` record: keys, their order, values and types.
EXPECTED: dict[str, object] = {
    'num_layers': 4,
    'hidden_size': 64,
    'num_attention_heads': 8,
    'ffn_hidden_size': 96,
    'num_query_groups': 4,
    'kv_channels': 8,
    'vocab_size': 1000,
    'make_vocab_size_divisible_by': 64,
    'gated_linear_unit': True,
    'activation': 'silu',
    'normalization': 'LayerNorm',
    'norm_epsilon': 1e-06,
    'add_bias_linear': False,
    'add_qkv_bias': True,
    'qk_layernorm': True,
    'tie_embeddings': True,
    'position_embedding_type': 'rope',
    'max_position_embeddings': 4096,
    'rotary_base': 500000.0,
    'params_dtype': 'float32',
    'transformer_impl': 'transformer_engine',
    'num_experts': 4,
    'moe_ffn_hidden_size': 48,
    'moe_layer_freq': (0, 1, 1, 1),
    'moe_router_topk': 1,
    'moe_shared_expert_intermediate_size': 32,
    'moe_shared_expert_gate': True,
    'moe_router_enable_expert_bias': True,
    'moe_grouped_gemm': True,
    'rotary_percent': 0.5,
    'rotary_interleaved': False,
    'rope_scaling': 'yarn',
    'rope_scaling_factor': 4.0,
    'sliding_window': 16,
    'window_layers': (1, 0, 1, 0),
    'layernorm_zero_centered_gamma': True,
    'attention_dropout': 0.1,
    'hidden_dropout': 0.0,
    'moe_router_score_function': 'sigmoid',
    'moe_router_pre_softmax': False,
    'moe_router_topk_scaling_factor': 2.5,
    'moe_aux_loss_coeff': 0.0,
    'yarn_original_max_position_embeddings': 1024,
    'yarn_beta_fast': 32.0,
    'yarn_beta_slow': 1.0,
    'yarn_mscale': 1.0,
    'yarn_mscale_all_dim': 1.0,
    'yarn_correction_range_round_to_int': True,
    'multi_latent_attention': False,
    'q_lora_rank': None,
    'kv_lora_rank': 512,
    'qk_head_dim': 128,
    'qk_pos_emb_head_dim': 64,
    'v_head_dim': 128,
    'dsa_indexer_n_heads': None,
    'dsa_indexer_head_dim': None,
    'dsa_indexer_topk': None,
    'dsa_indexer_rope_interleaved': False,
    'moe_router_num_groups': 2,
    'moe_router_group_topk': 1,
    'embedding_multiplier': 12.0,
    'residual_multiplier': 1.0,
    'logits_scaling': 1.0,
    'no_rope_layers': (0, 0, 0, 1),
    'hf_rope_parameters': '{"rope_type": "longrope"}',
    'post_self_attn_layernorm': False,
    'post_mlp_layernorm': True,
    'pre_layernorms': True,
    'embedding_scale_sqrt_hidden': False,
    'attn_logit_softcapping': 50.0,
    'final_logit_softcapping': None,
    'rotary_base_local': 10000.0,
    'qk_layernorm_across_heads': False,
    'softmax_type': 'learnable',
    'glu_linear_offset': 1.0,
    'activation_func_clamp_value': 7.0,
    'softmax_scale': 0.25,
    'mtp_num_layers': 1,
    'mtp_layer_module': 'mtp_model_layer',
    'hybrid_override_pattern': None,
    'mamba_state_dim': 128,
    'mamba_head_dim': 64,
    'mamba_num_groups': 8,
    'mamba_num_heads': None,
    'time_step_min': 0.0,
    'use_parallel_residual': False,
    'shared_input_layernorm': False,
    'layernorm_bias': True,
    'logit_scale': 1.0,
    'qk_layernorm_after_rope': False,
    'attention_output_gate': False,
    'experimental_attention_variant': None,
    'linear_attention_freq': None,
    'linear_conv_kernel_dim': 4,
    'linear_key_head_dim': 128,
    'linear_value_head_dim': 128,
    'linear_num_key_heads': 16,
    'linear_num_value_heads': 32,
    'mrope_section': None,
    'vision_config': None,
    'vision_token_ids': None,
    'qk_l2_norm': False,
    'moe_apply_probs_on_input': False,
    'attention_chunk_size': None,
    'attn_temperature_tuning': False,
    'floor_scale': 8192,
    'attn_scale': 0.1,
}


def test_to_dict_lists_every_setting_in_the_recorded_order() -> None:
    written = ModelConfig(**SETTINGS).to_dict()  # type: ignore[arg-type]

    assert list(written.items()) == list(EXPECTED.items())
    assert json.dumps(written) == json.dumps(EXPECTED)
    assert ModelConfig.setting_names() == tuple(EXPECTED)


def test_every_setting_lives_in_exactly_one_place() -> None:
    own = {item.name for item in dataclasses.fields(ModelConfig)} - set(GROUPS)
    for group, cls in GROUPS.items():
        assert {item.name for item in dataclasses.fields(cls)} == {
            name for name, where in SETTING_GROUPS.items() if where == group}, group
    assert own == {name for name, where in SETTING_GROUPS.items() if where is None}
    assert len(SETTING_GROUPS) == 107


def test_the_grouped_form_builds_the_same_config() -> None:
    grouped = ModelConfig(
        num_layers=2, hidden_size=64, vocab_size=100, tie_embeddings=True,
        attention=AttentionConfig(num_attention_heads=8, num_query_groups=2, qk_layernorm=True),
        mlp=MLPConfig(ffn_hidden_size=128, gated_linear_unit=False, activation="gelu"),
        moe=MoEConfig(num_experts=4, moe_layer_freq=(0, 1)), positions=PositionConfig(rotary_base=1e6),
        norms=NormConfig(normalization="LayerNorm"), carried=CarriedConfig(logits_scaling=8.0))
    flat = ModelConfig.from_settings(dict(
        num_layers=2, hidden_size=64, vocab_size=100, tie_embeddings=True, num_attention_heads=8, num_query_groups=2,
        qk_layernorm=True, ffn_hidden_size=128, gated_linear_unit=False, activation="gelu", num_experts=4,
        moe_layer_freq=(0, 1), rotary_base=1e6, normalization="LayerNorm", logits_scaling=8.0))

    assert grouped == flat and grouped.to_dict() == flat.to_dict()
    assert grouped.attention.head_dim == 8 and grouped.attention.qkv_rows == (8 + 2 * 2) * 8
    assert grouped.mlp.fc1_rows == 128 and grouped.setting("logits_scaling") == 8.0
    # Defaults filled in by the whole config land in the sub-config, not in the one passed in.
    shared = AttentionConfig(num_attention_heads=4)
    small = ModelConfig(num_layers=1, hidden_size=32, attention=shared, mlp=MLPConfig(ffn_hidden_size=64))
    assert (small.attention.kv_channels, small.attention.num_query_groups, shared.kv_channels) == (8, 4, None)


def test_replace_takes_settings_by_name_or_sub_configs_whole() -> None:
    config = ModelConfig(**SETTINGS)  # type: ignore[arg-type]

    fewer = config.replace(num_experts=2, moe_router_num_groups=None, moe_router_group_topk=None, hidden_dropout=0.1)
    plain = config.replace(attention=AttentionConfig(num_attention_heads=8), window_layers=None)

    assert (fewer.moe.num_experts, fewer.hidden_dropout, fewer.moe.moe_ffn_hidden_size) == (2, 0.1, 48)
    assert fewer.attention is config.attention
    assert (plain.attention.num_query_groups, plain.attention.sliding_window, plain.attention.kv_channels) == (8, None, 8)
    with pytest.raises(ConfigError, match=r"^window_layers=\[1, 0\]: must list 0 or 1 for each of the 4 layers$"):
        config.replace(window_layers=[1, 0])
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_heads'"):
        config.replace(num_heads=4)


def test_flat_form_compatibility_layer() -> None:
    """The flat names plugins and tests use: ``ModelConfig(**flat)``, ``config.<flat name>``,
    ``dataclasses.replace(config, **flat)`` and the flat derived values."""
    config = ModelConfig(**SETTINGS)  # type: ignore[arg-type]

    assert config == ModelConfig.from_settings(SETTINGS)
    assert all(getattr(config, name) == value for name, value in EXPECTED.items())
    assert (config.num_experts, config.normalization, config.logits_scaling) == (4, "LayerNorm", 1.0)
    assert (config.query_groups, config.head_dim, config.qkv_rows, config.q_head_dim, config.fc1_rows) == (
        4, 8, 128, 192, 192)
    assert [config.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert [config.is_window_layer(i) for i in range(4)] == [True, False, True, False]
    assert dataclasses.replace(config, num_experts=8, moe_router_num_groups=4).moe.num_experts == 8
    assert config.replace(hidden_size=128).attention.kv_channels == 8  # derived values are kept, as before
    assert ModelConfig.make_vocab_size_divisible_by == 128
    with pytest.raises(AttributeError, match="has no attribute 'num_heads'"):
        config.num_heads  # noqa: B018
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_heads'"):
        ModelConfig(num_layers=1, hidden_size=8, num_heads=2, ffn_hidden_size=8)
    with pytest.raises(TypeError, match="num_attention_heads"):
        ModelConfig(num_layers=1, hidden_size=8, ffn_hidden_size=8)


def test_a_config_survives_pickling_and_hashing() -> None:
    config = ModelConfig(**SETTINGS)  # type: ignore[arg-type]
    assert config.layers[1].moe  # computed, then carried along

    copy = pickle.loads(pickle.dumps(config))

    assert copy == config and hash(copy) == hash(config) and copy.layers == config.layers
    assert {config: 1}[ModelConfig.from_settings(SETTINGS)] == 1
