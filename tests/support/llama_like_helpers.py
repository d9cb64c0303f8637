"""Test helpers: tiny Qwen2-MoE / Granite / SmolLM3 / Ministral / Phi-3 / Seed-OSS / ERNIE 4.5 (dense, MoE) / Arcee /
Nemotron / HunYuan (dense, MoE) models,
and an independent tensor-parallel forward pass over Megatron rank files driven by the files' own ``args``.

Nothing here imports pgconvert. The reference forward reads each rank's ``model`` dict with
``torch.load`` (hf_helpers.read_megatron_tp_ranks) and the model's settings from the rank file's
``args`` (megatron-core's names: window_size, window_attn_skip_freq, no_rope_freq, softmax_scale,
moe_shared_expert_gate, …), so it checks the args pgconvert writes as well as the tensors.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from support.family_helpers import rank_qkv, routed_experts, save_with_side_files, seeded_model, tp_swiglu
from support.family_helpers import vocab_parallel_embedding, vocab_parallel_logits
from support.hf_helpers import _load_rank, _replicated, _rms_norm, _rotate_half
from support.hf_side_helpers import BOS, EOS, PAD
from transformers import PreTrainedModel

MODEL_VOCAB = 300  # not a multiple of 128; the tokenizer's 256 tokens are its first rows
_COMMON: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                               max_position_embeddings=256, vocab_size=MODEL_VOCAB, rms_norm_eps=1e-5,
                               bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)


# arcee-ai/AFM-4.5B's config.json RoPE (its rope_scaling, as transformers 5 reads it).
AFM_YARN: dict[str, Any] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 20.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 1.0, "original_max_position_embeddings": 4096}


# tencent/Hunyuan-7B-Instruct's and Hunyuan-A13B-Instruct's config.json rope_scaling: transformers' NTK-alpha.
HUNYUAN_NTK_ALPHA: dict[str, Any] = {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                                     "mscale_all_dim": 1.0, "type": "dynamic"}


def family_configs() -> dict[str, tuple[Any, Any, dict[str, Any]]]:
    """name -> (config class, model class, kwargs): realistic options on."""
    import transformers as t

    return {
        # Layer 2 dense (mlp_only_layers), shared expert with its sigmoid gate, q/k/v biases, a window
        # on layers 0 and 2, no top-k renormalization (megatron-core's pre-softmax router).
        "qwen2_moe": (t.Qwen2MoeConfig, t.Qwen2MoeForCausalLM, dict(
            _COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=4, num_experts_per_tok=2, mlp_only_layers=[2], norm_topk_prob=False,
            use_sliding_window=True, sliding_window=5, max_window_layers=3, tie_word_embeddings=False)),
        # granite-3.1-1b-a400m's: every layer MoE (4 of 32 experts here 2 of 4, softmax over the top-k logits), its
        # muP multipliers (embedding 12, residual 0.22, attention 1/64, logits 6), 2:1 GQA, tied output.
        "granitemoe": (t.GraniteMoeConfig, t.GraniteMoeForCausalLM, dict(
            _COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
            residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=6.0, rms_norm_eps=1e-6,
            max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            tie_word_embeddings=True)),
        # Granite 3's muP multipliers (attention_multiplier other than 1/sqrt(head_dim)), tied output.
        "granite": (t.GraniteConfig, t.GraniteForCausalLM, dict(
            _COMMON, intermediate_size=128, embedding_multiplier=12.0, residual_multiplier=0.22,
            attention_multiplier=0.2, logits_scaling=8.0, rope_theta=10000.0, tie_word_embeddings=True)),
        # NoPE on every 2nd layer (1-based) and, as SmolLM3's config fills layer_types, a window there.
        "smollm3": (t.SmolLM3Config, t.SmolLM3ForCausalLM, dict(
            _COMMON, intermediate_size=128, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=5,
            rope_theta=5000.0, tie_word_embeddings=True)),
        # A window on three layers in four, full attention on the last (layer_types), head_dim 16.
        "ministral": (t.MinistralConfig, t.MinistralForCausalLM, dict(
            _COMMON, intermediate_size=128, head_dim=16, sliding_window=5, rope_theta=100000.0,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            tie_word_embeddings=False)),
        # Phi-3.5 / Phi-4-mini style: fused qkv_proj and gate_up_proj, GQA (head_dim 16), longrope
        # with its short/long factors, partial rotary 0.75 (Phi-4-mini), a window on every layer.
        "phi3": (t.Phi3Config, t.Phi3ForCausalLM, dict(
            _COMMON, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, sliding_window=7,
            original_max_position_embeddings=64, partial_rotary_factor=0.75, tie_word_embeddings=False,
            rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.25 * i for i in range(6)],
                          "long_factor": [2.0 + 0.5 * i for i in range(6)]})),
        # Seed-OSS-36B's ratios: 10 query heads per KV head, head_dim 8 with 80 hidden and 20 heads
        # (heads x head_dim = 2 x hidden), FFN 5.4 x hidden; q/k/v biases only, RoPE base 1e7, eps 1e-6,
        # 512K positions, untied, dropout 0.1 on the attention and the residual branches.
        "seed_oss": (t.SeedOssConfig, t.SeedOssForCausalLM, dict(
            _COMMON, hidden_size=80, num_attention_heads=20, num_key_value_heads=2, head_dim=8,
            intermediate_size=432, rms_norm_eps=1e-6, max_position_embeddings=524288,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7}, attention_bias=True,
            attention_out_bias=False, mlp_bias=False, attention_dropout=0.1, residual_dropout=0.1,
            tie_word_embeddings=False)),
        # ERNIE-4.5-0.3B's ratios: 8 query heads per KV head, head_dim 8 apart from hidden / heads (64 / 16),
        # FFN 3 x hidden, RoPE base 500000 (interleaved pairs), eps 1e-5, 131072 positions, tied, no biases.
        "ernie4_5": (t.Ernie4_5Config, t.Ernie4_5ForCausalLM, dict(
            _COMMON, num_attention_heads=16, num_key_value_heads=2, head_dim=8, intermediate_size=192,
            max_position_embeddings=131072, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            use_bias=False, tie_word_embeddings=True)),
        # baidu/ERNIE-4.5-21B-A3B-PT's config.json shrunk: layer 0 dense, layers 1 to the last MoE (start 1, end the
        # last index, interval 1), top-6 routing (of 64 experts, here 8) steered by e_score_correction_bias, two shared
        # experts of moe_intermediate_size, 5 query heads per KV head with head_dim hidden / heads (no head_dim key),
        # interleaved RoPE base 500000, eps 1e-5, 131072 positions, tied, no biases, moe_norm_min 1e-12.
        "ernie4_5_moe": (t.Ernie4_5_MoeConfig, t.Ernie4_5_MoeForCausalLM, dict(
            _COMMON, hidden_size=80, num_attention_heads=10, num_key_value_heads=2, intermediate_size=96,
            moe_intermediate_size=16, moe_num_experts=8, moe_k=6, moe_num_shared_experts=2, moe_layer_start_index=1,
            moe_layer_end_index=3, moe_layer_interval=1, moe_norm_min=1e-12, max_position_embeddings=131072,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, use_bias=False,
            tie_word_embeddings=True)),
        # tencent/Hunyuan-7B-Instruct's config.json shrunk: 4 query heads per KV head, head_dim hidden / heads given,
        # FFN 3.5 x hidden, per-head q/k norms after RoPE, its NTK-alpha RoPE (rope_scaling type dynamic, alpha 1000,
        # as 4.x wrote it, with its unused YaRN-style keys), eps 1e-5, 32768 positions, tied, no biases, no CLA.
        "hunyuan_dense": (t.HunYuanDenseV1Config, t.HunYuanDenseV1ForCausalLM, dict(
            _COMMON, num_key_value_heads=2, head_dim=8, intermediate_size=224, max_position_embeddings=32768,
            rope_theta=10000.0, rope_scaling=dict(HUNYUAN_NTK_ALPHA), attention_bias=False, mlp_bias=False,
            use_qk_norm=True, use_cla=False, tie_word_embeddings=True)),
        # tencent/Hunyuan-A13B-Instruct's shrunk: Hunyuan-7B's attention and RoPE, every layer MoE with 8 experts
        # (of 64) and top-2 (of 8) per layer, one shared MLP per layer, experts and shared MLP intermediate_size wide
        # (0.75 x hidden), the releases' per-layer lists.
        "hunyuan_moe": (t.HunYuanMoEV1Config, t.HunYuanMoEV1ForCausalLM, dict(
            _COMMON, num_key_value_heads=2, head_dim=8, intermediate_size=48, max_position_embeddings=32768,
            rope_theta=10000.0, rope_scaling=dict(HUNYUAN_NTK_ALPHA), attention_bias=False, mlp_bias=False,
            use_qk_norm=True, use_cla=False, tie_word_embeddings=True, num_experts=8, moe_topk=[2] * 4,
            num_shared_expert=[1] * 4, moe_intermediate_size=[48] * 4, use_mixed_mlp_moe=True)),
        # arcee-ai/AFM-4.5B's: up_proj -> relu2 -> down_proj (no gate), 5 query heads per KV head with
        # heads x head_dim = hidden, FFN 7.2 x hidden, no biases, untied, eps 1e-5, and its YaRN RoPE
        # (factor 20 over 4096 original positions, 65536 positions).
        "arcee": (t.ArceeConfig, t.ArceeForCausalLM, dict(
            _COMMON, hidden_size=80, num_attention_heads=10, num_key_value_heads=2, head_dim=8, intermediate_size=576,
            hidden_act="relu2", max_position_embeddings=65536, attention_bias=False, mlp_bias=False,
            tie_word_embeddings=False, rope_parameters=dict(AFM_YARN))),
        # nvidia/Minitron-8B-Base's shape: 6 query heads per KV head with heads x head_dim = 1.5 x hidden (48 x 128
        # over 4096), FFN 4 x hidden, LayerNorm1P (1 + weight, with biases), up_proj -> relu2 -> down_proj, RoPE on
        # half of each head (its top-level partial_rotary_factor 0.5), base 1e4, eps 1e-5, 4096 positions, untied.
        "nemotron": (t.NemotronConfig, t.NemotronForCausalLM, dict(
            hidden_size=64, num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=2, head_dim=8,
            intermediate_size=256, vocab_size=MODEL_VOCAB, max_position_embeddings=4096, norm_eps=1e-5,
            hidden_act="relu2", partial_rotary_factor=0.5, rope_theta=10000.0, attention_bias=False, mlp_bias=False,
            tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)),
        # StarCoder2-3B's shape: 12 query heads per KV head (here 8 : 1), LayerNorm, biases everywhere, the
        # tanh GELU, a window on every layer, RoPE base ~1e6, dropout 0.1 as released, tied.
        "starcoder2": (t.Starcoder2Config, t.Starcoder2ForCausalLM, dict(
            hidden_size=64, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2,
            intermediate_size=256, vocab_size=MODEL_VOCAB, max_position_embeddings=16384, norm_epsilon=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 999999.4420358813}, sliding_window=5,
            use_bias=True, attention_dropout=0.1, residual_dropout=0.1, embedding_dropout=0.1,
            hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=EOS,
            pad_token_id=PAD)),
    }


MOE_FAMILIES = ("qwen2_moe", "granitemoe")


def build_model(name: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A tiny fp32 model: every parameter seeded, norms near one, routers well separated."""
    config_class, model_class, kwargs = family_configs()[name]

    def value(param_name: str, noise: torch.Tensor) -> torch.Tensor:
        module = param_name.rsplit(".", 1)[0]
        if module.endswith("norm"):
            return 1.0 + 0.1 * noise
        if module.endswith(("mlp.gate", "block_sparse_moe.router", "gate.wg")):
            return noise
        if module.endswith("moe_statics"):  # ERNIE's expert bias: large enough to change the softmax's choice
            return 0.2 * noise
        return (0.5 if module.endswith("shared_expert_gate") else 0.05) * noise
    return seeded_model(model_class, config_class(**{**kwargs, **overrides}), seed, value)[0]


def save_model(model: PreTrainedModel, path: Path) -> Path:
    """save_pretrained in small shards, with a generation config, a tokenizer and a chat template."""
    return save_with_side_files(model, path)


def input_ids(batch: int = 2, seq: int = 12, seed: int = 7) -> torch.Tensor:
    ids = torch.randint(0, MODEL_VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    ids[0, -1] = MODEL_VOCAB - 1
    return ids


def megatron_args(root: Path) -> argparse.Namespace:
    iteration = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    iteration_dir = root / ("release" if iteration == "release" else f"iter_{int(iteration):07d}")
    args: argparse.Namespace = _load_rank(sorted(iteration_dir.glob("mp_rank_*"))[0] / "model_optim_rng.pt")["args"]
    return args


# --- the reference forward pass ------------------------------------------------------------------

def _per_layer(value: Any, layers: int, default: int) -> list[int]:
    """megatron-core's int-or-list layer patterns (window_attn_skip_freq, no_rope_freq): 0/1 per layer."""
    if value is None:
        return [default] * layers
    if isinstance(value, int):
        return [int((layer + 1) % value == 0) for layer in range(layers)]
    return list(value)


def _attention(models: list[dict[str, torch.Tensor]], prefix: str, h: torch.Tensor, args: argparse.Namespace,
               rope: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor) -> torch.Tensor:
    heads, groups, head_dim = args.num_attention_heads, args.num_query_groups, args.kv_channels
    per_group = heads // groups
    batch, seq, _ = h.shape
    scale = args.softmax_scale if getattr(args, "softmax_scale", None) is not None else 1 / math.sqrt(head_dim)
    out = torch.zeros_like(h)
    for model in models:
        q, k, v = (t.transpose(1, 2) for t in rank_qkv(model, prefix, h, per_group, head_dim))
        q, k = _positioned_qk(models, prefix, q, k, args, rope)
        k, v = (t.repeat_interleave(per_group, dim=1) for t in (k, v))
        scores = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~mask, float("-inf")).softmax(-1)
        context = (scores @ v).transpose(1, 2).reshape(batch, seq, -1)
        out += context @ model[prefix + "self_attention.linear_proj.weight"].T  # row-parallel: summed
    return out


def _positioned_qk(models: list[dict[str, torch.Tensor]], prefix: str, q: torch.Tensor, k: torch.Tensor,
                   args: argparse.Namespace, rope: tuple[torch.Tensor, torch.Tensor] | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k with RoPE and, where args.qk_layernorm, their per-head RMSNorms: before RoPE as megatron-core applies
    them, after it where args.qk_layernorm_after_rope (HunYuan)."""
    def norm(t: torch.Tensor, name: str) -> torch.Tensor:
        if not getattr(args, "qk_layernorm", False):
            return t
        return _rms_norm(t, _replicated(models, prefix + f"self_attention.{name}.weight"), args.norm_epsilon)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        return t if rope is None else _apply_rope(t, rope, getattr(args, "rotary_interleaved", False))

    if getattr(args, "qk_layernorm_after_rope", False):
        return norm(rotate(q), "q_layernorm"), norm(rotate(k), "k_layernorm")
    return rotate(norm(q, "q_layernorm")), rotate(norm(k, "k_layernorm"))


def _apply_rope(t: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], interleaved: bool = False) -> torch.Tensor:
    """Rotate-half RoPE on the first dims of each head (partial rotary), the rest passed through; ``interleaved``:
    megatron-core's rotary_interleaved, pairs of neighbouring channels turned by one frequency each."""
    cos, sin = rope
    dim = cos.shape[-1]
    rotated, rest = t[..., :dim], t[..., dim:]
    if interleaved:
        half = dim // 2
        cos, sin = cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)
        turned = torch.stack((-rotated[..., 1::2], rotated[..., 0::2]), dim=-1).flatten(-2)
        return torch.cat([rotated * cos + turned * sin, rest], dim=-1)
    return torch.cat([rotated * cos + _rotate_half(rotated) * sin, rest], dim=-1)


def _moe(models: list[dict[str, torch.Tensor]], prefix: str, h: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    """megatron-core's router: softmax then top-k (pre-softmax) or top-k then softmax over the k,
    plus the shared expert, scaled by sigmoid(gate_weight · h) when it has a gate."""
    router = _replicated(models, prefix + "mlp.router.weight")
    logits = h @ router.T
    if getattr(args, "moe_router_enable_expert_bias", False):
        assert args.moe_router_score_function == "softmax", args.moe_router_score_function
        # ERNIE 4.5 MoE: the softmax plus the bias chooses, the chosen softmax weights renormalized
        probs = logits.softmax(-1)
        chosen = (probs + _replicated(models, prefix + "mlp.router.expert_bias")).topk(args.moe_router_topk, -1).indices
        top = probs.gather(-1, chosen)
        top = top / top.sum(-1, keepdim=True)
    elif getattr(args, "moe_router_pre_softmax", False):
        top, chosen = logits.softmax(-1).topk(args.moe_router_topk, dim=-1)
    else:
        top, chosen = logits.topk(args.moe_router_topk, dim=-1)
        top = top.softmax(-1)
    out = routed_experts(models, prefix, h, top, chosen, args.num_experts)
    if getattr(args, "moe_shared_expert_intermediate_size", None):
        shared = tp_swiglu(models, prefix + "mlp.shared_experts.", h)
        if getattr(args, "moe_shared_expert_gate", False):
            shared = shared * torch.sigmoid(h @ _replicated(models, prefix + "mlp.shared_experts.gate_weight").T)
        out += shared
    return out


def _rope_tables(args: argparse.Namespace, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin over the first rotary_percent of each head; with carried longrope parameters
    (args.hf_rope_parameters), the frequencies divided by the short (or, past the original
    positions, long) factors and cos/sin scaled by the attention factor, as LongRoPE defines them."""
    dim = int(args.kv_channels * getattr(args, "rotary_percent", 1.0))
    inv_freq = 1.0 / (args.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scale = 1.0
    carried = getattr(args, "hf_rope_parameters", None)
    if carried is not None:
        params = json.loads(carried)
        assert params["rope_type"] == "longrope", params
        original = params["original_max_position_embeddings"]
        factors = params["long_factor"] if seq > original else params["short_factor"]
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float64)
        factor = params.get("factor") or args.max_position_embeddings / original
        scale = params.get("attention_factor") or (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original)))
    freqs = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    both = torch.cat([freqs, freqs], -1)
    return both.cos() * scale, both.sin() * scale


def _masks(args: argparse.Namespace, seq: int) -> list[torch.Tensor]:
    """Per layer: causal, and within args.window_size (left, 0) on the layers window_attn_skip_freq marks."""
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    window = getattr(args, "window_size", None)
    if window is None:
        return [causal] * args.num_layers
    left = window[0]
    distance = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
    windowed = causal & (distance <= left)
    pattern = _per_layer(getattr(args, "window_attn_skip_freq", None), args.num_layers, 1)
    return [windowed if pattern[layer] else causal for layer in range(args.num_layers)]


def reference_logits(models: list[dict[str, torch.Tensor]], args: argparse.Namespace,
                     ids: torch.Tensor) -> torch.Tensor:
    """Logits computed rank by rank from TP-sharded tensors (float64), as ``args`` describe the model.

    Granite's multipliers (args.embedding_multiplier, residual_multiplier, logits_scaling) are
    applied as transformers' Granite does, since megatron-core has no such settings."""
    eps, seq = args.norm_epsilon, ids.shape[1]
    rope = _rope_tables(args, seq)
    no_rope = _per_layer(getattr(args, "no_rope_freq", None), args.num_layers, 0)
    masks = _masks(args, seq)
    residual = getattr(args, "residual_multiplier", 1.0) or 1.0
    x = vocab_parallel_embedding(models, ids) * (getattr(args, "embedding_multiplier", 1.0) or 1.0)
    for layer in range(args.num_layers):
        prefix = f"decoder.layers.{layer}."
        h = _rms_norm(x, _replicated(models, prefix + "input_layernorm.weight"), eps)
        x = x + residual * _attention(models, prefix, h, args, None if no_rope[layer] else rope, masks[layer])
        h = _rms_norm(x, _replicated(models, prefix + "pre_mlp_layernorm.weight"), eps)
        mlp = _moe(models, prefix, h, args) if prefix + "mlp.router.weight" in models[0] \
            else tp_swiglu(models, prefix + "mlp.", h)
        x = x + residual * mlp
    x = _rms_norm(x, _replicated(models, "decoder.final_layernorm.weight"), eps)
    return vocab_parallel_logits(models, x, args.vocab_size) / (getattr(args, "logits_scaling", 1.0) or 1.0)
