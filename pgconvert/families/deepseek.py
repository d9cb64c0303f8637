"""DeepSeek-V2/V3 (and Kimi-K2, DeepSeek-V3.1, whose configs name DeepseekV3ForCausalLM): multi-latent
attention, shared experts and DeepSeek's routers.

Tensors (transformers' ``modeling_deepseek_v3``/``_v2`` <-> megatron-core's ``MLASelfAttention``), all
one to one: megatron-core's kv down projection is ``[kv_lora_rank latent; qk_pos_emb_head_dim rope]``
like HF's ``kv_a_proj_with_mqa``, and its q/kv up projections are per head ``[no-rope; rope]`` /
``[k no-rope; v]`` like ``q_b_proj``/``kv_b_proj``. Rotary: megatron-core's MLA takes the rope
dimensions as interleaved pairs (``_apply_rotary_pos_emb_bshd(multi_latent_attention=True)``
de-interleaves them, then rotates halves), which is DeepSeek-V3's ``rope_interleave=True`` and
DeepSeek-V2's complex-pair rotary (the same rotation up to one permutation of q and k alike, which
the attention scores do not see); V3's ``rope_interleave=false`` is refused.

Routers (transformers <-> megatron-core's ``topk_routing_with_score_function``):

* V3: sigmoid scores plus ``e_score_correction_bias`` (megatron's ``expert_bias``) choose; the chosen
  sigmoid scores are renormalized (megatron-core always does, so ``norm_topk_prob`` must be true) and
  scaled by ``routed_scaling_factor`` (``moe_router_topk_scaling_factor``). Groups: HF scores a group
  by the sum of its top-2 biased scores, megatron-core by its top ``topk // group_topk``;
* V2: softmax over all experts (``moe_router_pre_softmax``), top-k not renormalized (transformers 5
  ignores ``norm_topk_prob``), scaled; ``topk_method`` ``greedy`` or ``group_limited_greedy`` (a
  group's best score: megatron-core's top ``topk // group_topk`` = 1).

A group setting that chooses every group routes as no groups and is read as none.
GLM-4.5-MoE's router (top-2 group score, as V3) reads its groups with ``router_groups``.
Multi-token prediction layers (``num_nextn_predict_layers``; HF keeps them as layer index
``num_hidden_layers + i``) are megatron-core's ``mtp.layers.{i}`` (V3 and V3.2; ``pgconvert.families.mtp``).

DeepSeek-V3.2 (``DeepseekV32ForCausalLM``, deepseek-ai/DeepSeek-V3.2-Exp) is V3 with DeepSeek Sparse Attention:
every layer's ``self_attn.indexer`` (``wq_b``, ``wk``, LayerNorm ``k_norm`` with bias, ``weights_proj``) is
megatron-core's ``self_attention.core_attention.indexer`` (``linear_wq_b``, ``linear_wk``, ``k_norm``,
``linear_weights_proj``; Megatron-Bridge's names), one to one: from core_v0.19.0 on megatron-core's DSAIndexer,
as transformers', rotates the first ``qk_rope_head_dim`` dims of each indexer head rotate-half (not interleaved)
and leaves the rest (Megatron-LM b0eb9143; before it the rotated dims were the last ones, interleaved).
``index_n_heads``, ``index_head_dim``, ``index_topk`` are ``dsa_indexer_n_heads``, ``dsa_indexer_head_dim``,
``dsa_indexer_topk``; which layers are MoE is ``mlp_layer_types`` (``dense``/``sparse`` per layer; absent:
``first_k_dense_replace``); every layer is ``indexed_attention``. The indexer's ``k_norm`` epsilon is 1e-6 in
transformers whatever ``rms_norm_eps`` is (megatron: ``dsa_indexer_k_norm_epsilon``,
``pgconvert.semantics.mla``).
"""

from __future__ import annotations

from collections.abc import Mapping

from pgconvert.io.limits import quote
from pgconvert.model.config import ModelConfig
from pgconvert.families.llama import (
    DENSE_FFN,
    DENSE_MLP_ROWS,
    EMBEDDING_ROWS,
    FINAL_ROWS,
    HF_SILU,
    ROPE_DEFAULT,
    ROPE_RULE,
    SWIGLU_RMS_ROPE,
    query_groups_field,
    rotary_base_field,
)
from pgconvert.families.experts import expert_count, refuses_dense_model
from pgconvert.families.mtp import MTP_ROWS
from pgconvert.families.qwen import QWEN_MOE_ROWS
from pgconvert.families.table import (DROP, GATE_UP, ConfigField, ConfigRule, Family, TensorMapping, TensorTable,
                                      write_nothing)

_ATTN = "model.layers.{}.self_attn."
_MLA = "decoder.layers.{}.self_attention."
_MLA_ROWS = (
    TensorMapping("decoder.layers.{}.input_layernorm.weight", ("model.layers.{}.input_layernorm.weight",)),
    TensorMapping(_MLA + "linear_q_proj.weight", (_ATTN + "q_proj.weight",)),
    TensorMapping(_MLA + "linear_q_down_proj.weight", (_ATTN + "q_a_proj.weight",)),
    TensorMapping(_MLA + "q_layernorm.weight", (_ATTN + "q_a_layernorm.weight",)),
    TensorMapping(_MLA + "linear_q_up_proj.weight", (_ATTN + "q_b_proj.weight",)),
    TensorMapping(_MLA + "linear_kv_down_proj.weight", (_ATTN + "kv_a_proj_with_mqa.weight",)),
    TensorMapping(_MLA + "kv_layernorm.weight", (_ATTN + "kv_a_layernorm.weight",)),
    TensorMapping(_MLA + "linear_kv_up_proj.weight", (_ATTN + "kv_b_proj.weight",)),
    TensorMapping(_MLA + "linear_proj.weight", (_ATTN + "o_proj.weight",)),
    TensorMapping("decoder.layers.{}.pre_mlp_layernorm.weight", ("model.layers.{}.post_attention_layernorm.weight",)),
)
# Sigmoid routing's bias and the shared experts: the rows DeepSeek and GLM-4.5-MoE add to Qwen's MoE rows.
EXPERT_BIAS_ROW = TensorMapping("decoder.layers.{}.mlp.router.expert_bias",
                                ("model.layers.{}.mlp.gate.e_score_correction_bias",))
SHARED_EXPERTS_ROWS = (
    TensorMapping("decoder.layers.{}.mlp.shared_experts.linear_fc1.weight", (
        "model.layers.{}.mlp.shared_experts.gate_proj.weight",
        "model.layers.{}.mlp.shared_experts.up_proj.weight",
    ), GATE_UP),
    TensorMapping("decoder.layers.{}.mlp.shared_experts.linear_fc2.weight",
                  ("model.layers.{}.mlp.shared_experts.down_proj.weight",)),
)
_MOE_ROWS = (QWEN_MOE_ROWS[0], EXPERT_BIAS_ROW, *QWEN_MOE_ROWS[1:], *SHARED_EXPERTS_ROWS)
DEEPSEEK_TENSORS = TensorTable((*EMBEDDING_ROWS, *_MLA_ROWS, *DENSE_MLP_ROWS, *_MOE_ROWS, *FINAL_ROWS, *MTP_ROWS))
_INDEXER = _ATTN + "indexer."
_DSA_INDEXER = _MLA + "core_attention.indexer."
# DeepSeek Sparse Attention's lightning indexer (transformers' DeepseekV32Indexer <-> megatron-core's DSAIndexer).
DSA_INDEXER_ROWS = (
    TensorMapping(_DSA_INDEXER + "linear_wq_b.weight", (_INDEXER + "wq_b.weight",)),
    TensorMapping(_DSA_INDEXER + "linear_wk.weight", (_INDEXER + "wk.weight",)),
    TensorMapping(_DSA_INDEXER + "k_norm.weight", (_INDEXER + "k_norm.weight",)),
    TensorMapping(_DSA_INDEXER + "k_norm.bias", (_INDEXER + "k_norm.bias",)),
    TensorMapping(_DSA_INDEXER + "linear_weights_proj.weight", (_INDEXER + "weights_proj.weight",)),
)


# DeepseekV3Config keeps these nulls, and its modules compute nothing from them.
_TOPK_NULL = "transformers' router takes the top-k as given, and null is no count"
_V_HEAD_NULL = "transformers' attention takes v_head_dim as given, and null is no size"


def deepseek_fields(experts: int, experts_alias: str, topk: int | None, max_positions: int,
                    query_groups: int | None, norm_epsilon: float = 1e-6,
                    head_dims: tuple[int, int] = (128, 128)) -> tuple[ConfigField, ...]:
    """config.json fields of DeepSeek's and its derivatives' config classes, with their defaults: ``head_dims``
    are ``qk_nope_head_dim`` and ``v_head_dim``."""
    return (
        ConfigField(("hidden_size",), "hidden_size", int),
        ConfigField(("num_hidden_layers",), "num_layers", int),
        ConfigField(("num_attention_heads",), "num_attention_heads", int),
        query_groups_field(query_groups),
        ConfigField(("rms_norm_eps",), "norm_epsilon", float, default=norm_epsilon),
        rotary_base_field(10000.0),
        ConfigField(("max_position_embeddings",), "max_position_embeddings", int, default=max_positions),
        ConfigField(("vocab_size",), "vocab_size", int),
        ConfigField(("tie_word_embeddings",), "tie_embeddings", bool, default=False),
        ConfigField(("attention_dropout",), "attention_dropout", float, default=0.0),
        DENSE_FFN,
        ConfigField(("moe_intermediate_size",), "moe_ffn_hidden_size", int),
        expert_count("n_routed_experts", experts, experts_alias),
        ConfigField(("num_experts_per_tok",), "moe_router_topk", int, default=topk, null_refused=_TOPK_NULL),
        ConfigField(("kv_lora_rank",), "kv_lora_rank", int, default=512),
        ConfigField(("qk_nope_head_dim",), "qk_head_dim", int, default=head_dims[0]),
        ConfigField(("qk_rope_head_dim",), "qk_pos_emb_head_dim", int, default=64),
        ConfigField(("v_head_dim",), "v_head_dim", int, default=head_dims[1], null_refused=_V_HEAD_NULL),
    )


def _given(present: Mapping[str, object], key: str, default: object) -> object:
    """``present[key]`` (``default`` where absent); None (a null of a ``null_keys`` key, or absent with
    no default) is refused: the routers and layers of transformers' DeepSeek (and GLM-4.5-MoE) take
    the value as given and compute nothing from None."""
    value = present.get(key, default)
    if value is None:
        said = f"{key}=null" if key in present else f"{key} is absent and transformers' config class has no default"
        raise ValueError(f"{said}: the model takes it as given and computes nothing from None; config.json must "
                         "give a value")
    return value


def config_count(value: object, key: str, minimum: int = 0) -> int:
    """A config.json count: an integer of at least ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{key}={quote(value)}: expected an integer >= {minimum}")
    return value


def _moe_pattern(config: ModelConfig) -> list[int]:
    """1 for each MoE layer, 0 for each dense one."""
    return [int(config.layers[layer].moe) for layer in range(config.num_layers)]


def _leading_dense(pattern: list[int]) -> int:
    return pattern.index(1) if 1 in pattern else len(pattern)


def _dense_prefix(config: ModelConfig) -> int | None:
    """How many leading dense layers, when the rest are MoE (DeepSeek's only pattern); else None."""
    pattern = _moe_pattern(config)
    first = _leading_dense(pattern)
    return first if all(pattern[first:]) else None


def dense_prefix_rule(default_dense: int) -> ConfigRule:
    """``first_k_dense_replace``: the first k layers dense, the rest MoE (``default_dense``: the class's k)."""
    def read(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
        dense = config_count(_given(present, "first_k_dense_replace", default_dense), "first_k_dense_replace")
        layers = model["num_layers"]
        assert isinstance(layers, int)
        pattern = tuple(int(layer >= dense) for layer in range(layers))
        return {"moe_layer_freq": 1 if all(pattern) else pattern}

    def write(config: ModelConfig) -> Mapping[str, object]:
        return {"first_k_dense_replace": _dense_prefix(config)}

    def refuses(config: ModelConfig) -> str | None:
        dense = refuses_dense_model(config)
        if dense is not None:
            return dense
        if _dense_prefix(config) is None:
            return f"moe_layer_freq={config.moe.moe_layer_freq!r} (needs k dense layers, then MoE layers only)"
        return None

    return ConfigRule(keys=("first_k_dense_replace",), model_fields=("moe_layer_freq",), read=read, write=write,
                      refuses=refuses, null_keys=("first_k_dense_replace",))


def shared_experts_rule(default: int | None, key: str = "n_shared_experts", null_refused: bool = False) -> ConfigRule:
    """``key`` (``n_shared_experts``; ERNIE 4.5 MoE: ``moe_num_shared_experts``): shared experts of the routed
    experts' FFN size each (``default``: the class's; None: the key must be given, as a class whose MoE block
    multiplies the size by it as given needs; ``null_refused``: a null is refused too, as a class that compares
    it with 0 as given needs)."""
    def read(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
        given = present.get(key, default)
        if given is None:
            raise ValueError(f"{key} is absent or null: transformers' MoE block computes with it as given; "
                             "config.json must give a count")
        count = config_count(given, key)
        size = model["moe_ffn_hidden_size"]
        assert isinstance(size, int)
        return {"moe_shared_expert_intermediate_size": count * size if count else None}

    def write(config: ModelConfig) -> Mapping[str, object]:
        return {key: (config.moe.moe_shared_expert_intermediate_size or 0) // config.expert_ffn_size}

    def refuses(config: ModelConfig) -> str | None:
        shared = config.moe.moe_shared_expert_intermediate_size
        if shared is not None and shared % config.expert_ffn_size:
            return (f"moe_shared_expert_intermediate_size={shared} (needs a multiple of the experts' "
                    f"{config.expert_ffn_size}: {key})")
        return None

    return ConfigRule(keys=(key,), model_fields=("moe_shared_expert_intermediate_size",),
                      read=read, write=write, refuses=refuses, required=default is None,
                      null_keys=(key,) if null_refused else ())


def router_groups(present: Mapping[str, object], model: Mapping[str, object], per_group: int,
                  defaults: tuple[int | None, int | None]) -> tuple[int, int] | None:
    """(groups, chosen groups) that route as transformers does, None for no grouping; ``defaults``:
    the config class's ``n_group`` and ``topk_group`` where absent (a None one, or a null, is refused:
    transformers' grouped router divides by them as given). A setting megatron-core scores
    differently raises."""
    groups = config_count(_given(present, "n_group", defaults[0]), "n_group", 1)
    chosen = config_count(_given(present, "topk_group", defaults[1]), "topk_group", 1)
    experts, topk = model["num_experts"], model["moe_router_topk"]
    if not isinstance(topk, int):
        raise ValueError(f"num_experts_per_tok={quote(topk)}: grouped routing needs the number of experts per token")
    assert isinstance(experts, int)
    if experts % groups or chosen > groups:
        raise ValueError(f"n_group={groups}, topk_group={chosen}: the groups must divide n_routed_experts={experts} "
                         "and topk_group be at most n_group")
    if chosen == groups:
        return None
    if topk // chosen != per_group:
        raise ValueError(
            f"n_group={groups}, topk_group={chosen} with num_experts_per_tok={topk}: transformers scores a group by "
            f"its best {per_group} expert(s), megatron-core by its best num_experts_per_tok // topk_group = "
            f"{topk // chosen}; this routing has no megatron-core equivalent")
    return groups, chosen


def routed_scaling(present: Mapping[str, object], default: float) -> float:
    """``routed_scaling_factor`` (``default`` where absent), a number."""
    value = present.get("routed_scaling_factor", default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"routed_scaling_factor={quote(value)}: expected a number")
    return float(value)


_ROUTER_FIELDS = ("moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor")


def _check_renormalized(present: Mapping[str, object], default: bool) -> None:
    """``norm_topk_prob`` must be true (``default``: the config class's, where absent): megatron-core's
    sigmoid router always renormalizes the chosen scores."""
    value = present.get("norm_topk_prob", default)
    if value is not True:
        said = " absent (the config class's default false)" if "norm_topk_prob" not in present else f"={quote(value)}"
        raise ValueError(f"norm_topk_prob{said}: megatron-core's sigmoid router renormalizes the chosen scores "
                         "for top-k > 1; no megatron-core equivalent")


def sigmoid_group_router(groups: tuple[int | None, int | None], scaling: float,
                         norm_topk_default: bool | None = None) -> ConfigRule:
    """DeepSeek-V3's router (sigmoid scores steered by ``e_score_correction_bias``, groups scored by their
    best two, the chosen scores renormalized and scaled by ``routed_scaling_factor``) as a config.json rule;
    ``groups`` and ``scaling`` are the config class's defaults. ``norm_topk_default``: the class's
    ``norm_topk_prob`` default where the rule reads that key (None: the family fixes it in ``hf_fixed``)."""
    reads_norm = norm_topk_default is not None

    def read(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
        if reads_norm:
            _check_renormalized(present, bool(norm_topk_default))
        if model["moe_router_topk"] == 1:
            raise ValueError("num_experts_per_tok=1: transformers renormalizes the one chosen score to 1 "
                             "(norm_topk_prob), megatron-core keeps its sigmoid score; no megatron-core equivalent")
        chosen = router_groups(present, model, per_group=2, defaults=groups)
        return {"moe_router_num_groups": chosen and chosen[0], "moe_router_group_topk": chosen and chosen[1],
                "moe_router_topk_scaling_factor": routed_scaling(present, scaling)}

    def write(config: ModelConfig) -> Mapping[str, object]:
        moe = config.moe
        written: dict[str, object] = {"n_group": moe.moe_router_num_groups or 1,
                                      "topk_group": moe.moe_router_group_topk or 1,
                                      "routed_scaling_factor": moe.moe_router_topk_scaling_factor or 1.0}
        return {**written, "norm_topk_prob": True} if reads_norm else written

    norm = ("norm_topk_prob",) if reads_norm else ()
    return ConfigRule(keys=("n_group", "topk_group", "routed_scaling_factor", *norm), model_fields=_ROUTER_FIELDS,
                      read=read, write=write, refuses=_sigmoid_router_refuses,
                      null_keys=("n_group", "topk_group", *norm), required=norm_topk_default is False)


def _sigmoid_router_refuses(config: ModelConfig) -> str | None:
    moe = config.moe
    if moe.moe_router_topk == 1:
        return "moe_router_topk=1 (transformers renormalizes the chosen sigmoid scores: needs top-k > 1)"
    if moe.moe_router_group_topk and moe.moe_router_topk // moe.moe_router_group_topk != 2:
        return (f"moe_router_group_topk={moe.moe_router_group_topk} with moe_router_topk={moe.moe_router_topk} "
                "(transformers scores a group by its best 2 experts: needs topk // group_topk = 2)")
    return None


def _v2_router_read(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    method = _given(present, "topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"topk_method={quote(method)}: expected 'greedy' or 'group_limited_greedy'")
    # DeepseekV2Config has no group defaults: group-limited routing needs both.
    grouped = method == "group_limited_greedy"
    groups = router_groups(present, model, per_group=1, defaults=(None, None)) if grouped else None
    return {"moe_router_num_groups": groups and groups[0], "moe_router_group_topk": groups and groups[1],
            "moe_router_topk_scaling_factor": routed_scaling(present, 1.0)}


def _v2_router_write(config: ModelConfig) -> Mapping[str, object]:
    moe = config.moe
    grouped = moe.moe_router_num_groups is not None
    return {"topk_method": "group_limited_greedy" if grouped else "greedy",
            "n_group": moe.moe_router_num_groups, "topk_group": moe.moe_router_group_topk,
            "routed_scaling_factor": moe.moe_router_topk_scaling_factor or 1.0}


def _v2_router_refuses(config: ModelConfig) -> str | None:
    moe = config.moe
    if moe.moe_router_group_topk and moe.moe_router_topk // moe.moe_router_group_topk != 1:
        return (f"moe_router_group_topk={moe.moe_router_group_topk} with moe_router_topk={moe.moe_router_topk} "
                "(DeepseekV2 scores a group by its best expert: needs topk // group_topk = 1)")
    return None


def q_lora_rule(default: int) -> ConfigRule:
    """``q_lora_rank``: ``default`` where absent (the config class's), null: no q down projection."""
    def read(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
        value = present.get("q_lora_rank", default)
        return {"q_lora_rank": None if value is None else config_count(value, "q_lora_rank", 1)}

    def write(config: ModelConfig) -> Mapping[str, object]:
        # Written even when null: the class default would otherwise build a q-LoRA model.
        return {"q_lora_rank": config.attention.q_lora_rank}

    return ConfigRule(keys=("q_lora_rank",), model_fields=("q_lora_rank",), read=read, write=write,
                      null_keys=("q_lora_rank",))


def _mla_rope_read(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    if model.get("rope_scaling") not in (None, "yarn"):
        raise ValueError(f"rope type {quote(model.get('rope_scaling'))}: megatron-core's multi-latent attention "
                         "computes plain RoPE or YaRN only (MLATransformerConfig.rope_type)")
    return {}


def _mla_rope_refuses(config: ModelConfig) -> str | None:
    if config.positions.rope_scaling not in (None, "yarn"):
        return f"rope_scaling={config.positions.rope_scaling!r} (multi-latent attention computes plain RoPE or YaRN)"
    return None


# Runs after ROPE_RULE (a rule sees the values earlier rules read).
_MLA_ROPE = ConfigRule(keys=(), model_fields=(), read=_mla_rope_read, write=write_nothing,
                       refuses=_mla_rope_refuses)
# DeepseekV2Config's and DeepseekV3Config's q_lora_rank default.
_Q_LORA = q_lora_rule(default=1536)

_MLA_COMMON: dict[str, object] = {
    **SWIGLU_RMS_ROPE,
    "multi_latent_attention": True,
    # megatron-core builds MLA's q/kv latent norms only with qk_layernorm (IdentityOp otherwise).
    "qk_layernorm": True,
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "moe_shared_expert_gate": False,
    "rotary_interleaved": False,
    "sliding_window": None,
}
_HF_COMMON: dict[str, object] = {**HF_SILU, "attention_bias": False}

# DeepSeek's families carry the score function, scaling, groups and pre-softmax (their fixed values
# and rules refuse what they cannot write; pre-softmax means nothing to sigmoid scores).
DEEPSEEK_COMPUTES = frozenset({"moe_router_score_function", "moe_router_topk_scaling_factor",
                                "moe_router_num_groups", "moe_router_pre_softmax"})

DEEPSEEK_V3 = Family(
    architecture="DeepseekV3ForCausalLM",
    model_type="deepseek_v3",
    hf_computes=DEEPSEEK_COMPUTES,
    tensors=DEEPSEEK_TENSORS,
    fields=deepseek_fields(experts=256, experts_alias="num_local_experts", topk=8, max_positions=4096, query_groups=128),
    rules=(ROPE_RULE, _MLA_ROPE, _Q_LORA, dense_prefix_rule(default_dense=3), shared_experts_rule(default=1),
           sigmoid_group_router(groups=(8, 4), scaling=2.5)),
    fixed={**_MLA_COMMON, "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
    # megatron-core renormalizes the chosen sigmoid scores; its MLA rotary takes interleaved pairs.
    hf_fixed={**_HF_COMMON, "norm_topk_prob": True, "rope_interleave": True},
    hf_scratch=ROPE_DEFAULT,
    hf_mtp_layers_key="num_nextn_predict_layers",
    hf_notes={"moe score function": "sigmoid (fixed)", "moe expert bias": "e_score_correction_bias (fixed)",
              "moe top-k scaling": "routed_scaling_factor",
              "moe router groups": "n_group, topk_group (group score: top-2 sum)"},
)

DEEPSEEK_V2 = Family(
    architecture="DeepseekV2ForCausalLM",
    model_type="deepseek_v2",
    hf_computes=DEEPSEEK_COMPUTES,
    tensors=DEEPSEEK_TENSORS,
    fields=deepseek_fields(experts=64, experts_alias="num_experts", topk=None, max_positions=2048, query_groups=None),
    rules=(ROPE_RULE, _MLA_ROPE, _Q_LORA, dense_prefix_rule(default_dense=0), shared_experts_rule(default=2),
           ConfigRule(keys=("topk_method", "n_group", "topk_group", "routed_scaling_factor"),
                      model_fields=_ROUTER_FIELDS, read=_v2_router_read, write=_v2_router_write,
                      refuses=_v2_router_refuses, null_keys=("topk_method", "n_group", "topk_group"))),
    fixed={**_MLA_COMMON, "moe_router_score_function": "softmax", "moe_router_pre_softmax": True,
           "moe_router_enable_expert_bias": False},
    hf_fixed={**_HF_COMMON, "mlp_bias": False},
    hf_scratch=ROPE_DEFAULT,
    hf_notes={"moe score function": "softmax (fixed)", "moe top-k scaling": "routed_scaling_factor",
              "moe router groups": "topk_method=group_limited_greedy, n_group, topk_group (group score: best)"},
)


# DeepseekV32Config's null-free sizes: its dataclass types them int, and its indexer is built from them as given.
_INDEX_NULL = "DeepseekV32Config types it an integer and its indexer is built from it as given"


def indexer_fields(heads: int) -> tuple[ConfigField, ...]:
    """The indexer's sizes (``heads``: the config class's ``index_n_heads``)."""
    return (
        ConfigField(("index_n_heads",), "dsa_indexer_n_heads", int, default=heads, null_refused=_INDEX_NULL),
        ConfigField(("index_head_dim",), "dsa_indexer_head_dim", int, default=128, null_refused=_INDEX_NULL),
        ConfigField(("index_topk",), "dsa_indexer_topk", int, default=2048, null_refused=_INDEX_NULL),
    )


_MLP_TYPES = {"dense": 0, "sparse": 1}


def mlp_layer_types_rule(default_dense: int) -> ConfigRule:
    """``mlp_layer_types`` (``dense``/``sparse`` per layer, which transformers builds from), else the first
    ``first_k_dense_replace`` layers dense (``default_dense``: the class's k) and the rest MoE."""
    prefix = dense_prefix_rule(default_dense)

    def read(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
        layers = model["num_layers"]
        types = present.get("mlp_layer_types")
        if types is None:
            return prefix.read(present, model)
        if (not isinstance(types, list) or len(types) != layers
                or any(not isinstance(kind, str) or kind not in _MLP_TYPES for kind in types)):
            raise ValueError(f"mlp_layer_types={quote(types)}: expected 'dense' or 'sparse' for each of the {layers} "
                             "layers")
        pattern = tuple(_MLP_TYPES[kind] for kind in types)
        return {"moe_layer_freq": 1 if all(pattern) else pattern}

    def write(config: ModelConfig) -> Mapping[str, object]:
        pattern = _moe_pattern(config)
        return {"first_k_dense_replace": _leading_dense(pattern),
                "mlp_layer_types": ["sparse" if moe else "dense" for moe in pattern]}

    return ConfigRule(keys=("first_k_dense_replace", "mlp_layer_types"), model_fields=("moe_layer_freq",), read=read,
                      write=write, refuses=refuses_dense_model, null_keys=("first_k_dense_replace",))


_INDEXED = "indexed_attention"


def _indexed_layers_read(present: Mapping[str, object], model: Mapping[str, object]) -> Mapping[str, object]:
    types = present.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != model["num_layers"]
                              or any(kind != _INDEXED for kind in types)):
        raise ValueError(f"layer_types={quote(types)}: DeepSeek-V3.2 has sparse attention ('{_INDEXED}') in each of "
                         f"the {model['num_layers']} layers")
    return {}


def _indexed_layers_write(config: ModelConfig) -> Mapping[str, object]:
    return {"layer_types": [_INDEXED] * config.num_layers}


def _indexed_layers_refuses(config: ModelConfig) -> str | None:
    return None if config.attention.sparse else "dsa_indexer_n_heads=None (needs a sparse attention indexer)"


# Every layer's attention is sparse (DeepseekV32Config's layer_types); nothing else is expressible.
_INDEXED_LAYERS = ConfigRule(keys=("layer_types",), model_fields=(), read=_indexed_layers_read,
                             write=_indexed_layers_write, refuses=_indexed_layers_refuses)

DEEPSEEK_V32 = DEEPSEEK_V3.derive(
    "DeepseekV32ForCausalLM", "deepseek_v32",
    rows=DSA_INDEXER_ROWS,
    fields=(*deepseek_fields(experts=256, experts_alias="num_local_experts", topk=8, max_positions=163840,
                             query_groups=128), *indexer_fields(heads=64)),
    rules=(mlp_layer_types_rule(default_dense=3), _INDEXED_LAYERS),
    # transformers' V3.2 rotates MLA's rope dims interleaved whatever rope_interleave says (its config has none);
    # its indexer rotate-half.
    fixed={"dsa_indexer_rope_interleaved": False},
    hf_fixed={"rope_interleave": DROP},
    # megatron-core builds sparse attention with Transformer Engine's linears only (backend.linear()).
    megatron_defaults={"transformer_impl": "transformer_engine"},
    # DeepseekV32Config has no MTP attribute: an absent num_nextn_predict_layers declares none (the release gives 1).
    hf_mtp_layers_absent=0,
    hf_mtp_layers_alias=None,
)
