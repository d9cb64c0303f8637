"""megatron-core's own CPU forward of the Megatron checkpoints pgconvert writes for the families.

For every family whose computation megatron-core 0.16.1 expresses (docs/design.md, "megatron-core
forward coverage"), the tiny transformers model is converted to Megatron (TP1; loading a TP1 rank
file is not pgconvert's merge), megatron-core's GPTModel is built from the written args alone as
megatron-LM's gpt_builder would (tests/support/mcore_helpers.py: local layer spec, or megatron-core's decoder
block spec for MoE), loaded with ``strict=True``, and its logits are compared with transformers'.

Each case also has its family's own setting knocked out of the written args (the window, the NoPE
layers, the router's renormalization, ...): megatron-core then computes other logits, so the check
sees that setting and the match is not an accident of a setting that does nothing at this size.

MiniMax-M2's q/k norms over the whole projection have no megatron-core module; its layers get a
stand-in norm (tests/support/mcore_helpers.py), everything else is megatron-core's own.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.hf_helpers import hf_logits, input_ids

import pgconvert

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

# megatron-core sums in another order (router, expert unpermute, rotary tables): float32 round-off.
TOL = dict(rtol=1e-5, atol=5e-5)

# openai/gpt-oss-20b's config.json RoPE and context.
RELEASED_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}


def _tiny_model(name: str, **overrides: Any) -> Callable[[Path], Path]:
    def save(path: Path) -> Path:
        from support.llama_like_helpers import build_model, save_model

        return save_model(build_model(name, seed=3, **overrides), path)
    return save


def _glm4_moe(**overrides: Any) -> Callable[[Path], Path]:
    def save(path: Path) -> Path:
        from support.glm4_moe_gpt_oss_helpers import save_glm4_moe

        return save_glm4_moe(path, seed=3, **overrides)
    return save


def _minimax_m2(**overrides: Any) -> Callable[[Path], Path]:
    def save(path: Path) -> Path:
        from support.minimax_m2_helpers import save_minimax_m2

        return save_minimax_m2(path, seed=3, **overrides)
    return save


def _dots1(**overrides: Any) -> Callable[[Path], Path]:
    def save(path: Path) -> Path:
        from support.glm4_moe_gpt_oss_helpers import save_dots1

        return save_dots1(path, seed=3, **overrides)
    return save


def _parallel_block(name: str, **overrides: Any) -> Callable[[Path], Path]:
    def save(path: Path) -> Path:
        from support.parallel_block_helpers import save_parallel_block_model

        return save_parallel_block_model(name, path, seed=3, **overrides)
    return save


def _gpt_oss(**overrides: Any) -> Callable[[Path], Path]:
    def save(path: Path) -> Path:
        from support.glm4_moe_gpt_oss_helpers import save_gpt_oss

        return save_gpt_oss(path, seed=3, **overrides)
    return save


# The tiny transformers models, each with its family's options on (tests/support/llama_like_helpers.py,
# tests/support/glm4_moe_gpt_oss_helpers.py).
SOURCES: dict[str, Callable[[Path], Path]] = {
    # shared expert with its sigmoid gate, a dense layer, q/k/v biases, windows on alternate layers,
    # softmax over all experts before top-k (no renormalization)
    "qwen2_moe": _tiny_model("qwen2_moe"),
    # NoPE on every second layer, a window on the others
    "smollm3": _tiny_model("smollm3"),
    # a window on three layers in four
    "ministral": _tiny_model("ministral"),
    # Phi-3-mini-4k's plain RoPE (longrope has no megatron-core equivalent), fused qkv/gate_up,
    # partial rotary 0.75, a window on every layer
    "phi3-rope": _tiny_model("phi3", rope_scaling=None),
    # sigmoid router with expert bias, scaled weights, shared expert, dense first layer, qk-norm,
    # partial rotary 0.5
    "glm4_moe": _glm4_moe(),
    # the same with group-limited routing (4 groups of 2 experts, the best 2 groups)
    "glm4_moe-groups": _glm4_moe(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=4),
    # attention sinks, windows on alternate layers, biases everywhere, the clamped GLU
    "gpt_oss": _gpt_oss(),
    # the released YaRN RoPE and context
    "gpt_oss-yarn": _gpt_oss(rope_parameters=dict(RELEASED_YARN), max_position_embeddings=131072),
    # Seed-OSS-36B's shape: q/k/v biases only, head_dim apart from hidden / heads, 10:1 GQA, RoPE base 1e7
    "seed_oss": _tiny_model("seed_oss"),
    # the same with o and MLP biases (attention_out_bias, mlp_bias: add_bias_linear)
    "seed_oss-every-bias": _tiny_model("seed_oss", attention_out_bias=True, mlp_bias=True),
    # arcee-ai/AFM-4.5B's shape: non-gated squared-ReLU MLP, 5:1 GQA, its YaRN RoPE (factor 20 over 4096)
    "arcee": _tiny_model("arcee"),
    # ERNIE-4.5-0.3B's shape: interleaved rotary over the whole head, 8:1 GQA, head_dim apart, tied
    "ernie4_5": _tiny_model("ernie4_5"),
    # the same with use_bias (every linear layer biased)
    "ernie4_5-bias": _tiny_model("ernie4_5", use_bias=True),
    # a partial_rotary_factor in config.json, which ERNIE's rotary ignores (it turns the whole head)
    "ernie4_5-partial-rotary-key": _tiny_model("ernie4_5", partial_rotary_factor=0.5),
    # dots.llm1's release: per-head q/k norms, MHA, the DeepSeek-V3 router (sigmoid, expert bias, top-6
    # renormalized, x2.5), two shared experts, a dense first layer
    # StarCoder2-3B's shape: LayerNorm with biases, every linear biased, the tanh GELU (activation_func set from
    # pgconvert's args), a window on every layer, 8:1 GQA, tied
    "starcoder2": _tiny_model("starcoder2"),
    # Minitron-8B's shape: LayerNorm1P (zero-centred gamma, with biases), non-gated squared ReLU, RoPE on half of
    # each head, 6:1 GQA with heads x head_dim apart from hidden
    "nemotron": _tiny_model("nemotron"),
    "dots1": _dots1(),
    # windows on layers 2 and 3 (max_window_layers), 4 router groups of which the best 2
    "dots1-window-groups": _dots1(sliding_window=5, max_window_layers=2, n_group=4, topk_group=2,
                                  num_experts_per_tok=4),
    # MiniMax-M2's shape: q/k norms over the whole projection (a stand-in module: megatron-core's are
    # per head, tests/support/mcore_helpers.py), partial rotary 0.5, every layer MoE with a sigmoid
    # router and expert bias, no shared expert
    "minimax_m2": _minimax_m2(),
    # pythia's shape with the sequential layer (use_parallel_residual false; megatron-core has no parallel one):
    # per-head fused QKV, LayerNorm with biases, exact GELU with biases, rotary on a quarter of each head
    "gpt_neox-sequential": _parallel_block("gpt_neox", use_parallel_residual=False),
}

# case -> (source, one of the family's own settings knocked out of the written args)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_moe-router": ("qwen2_moe", {"moe_router_pre_softmax": False}),
    "qwen2_moe-window": ("qwen2_moe", {"window_size": None}),
    "smollm3-nope": ("smollm3", {"no_rope_freq": None}),
    "ministral-window-pattern": ("ministral", {"window_attn_skip_freq": None}),
    "phi3-rope-partial-rotary": ("phi3-rope", {"rotary_percent": 1.0}),
    "glm4_moe-scaling": ("glm4_moe", {"moe_router_topk_scaling_factor": None}),
    "glm4_moe-partial-rotary": ("glm4_moe", {"rotary_percent": 1.0}),
    "glm4_moe-groups": ("glm4_moe-groups", {"moe_router_num_groups": None, "moe_router_group_topk": None}),
    "gpt_oss-glu-offset": ("gpt_oss", {"glu_linear_offset": 0.0}),
    "gpt_oss-clamp": ("gpt_oss", {"activation_func_clamp_value": None}),
    "gpt_oss-yarn": ("gpt_oss-yarn", {"position_embedding_type": "rope"}),
    "seed_oss-rope-base": ("seed_oss", {"rotary_base": 10000.0}),
    "arcee-squared-relu": ("arcee", {"squared_relu": False}),
    "arcee-yarn": ("arcee", {"position_embedding_type": "rope"}),
    "ernie4_5-interleaved": ("ernie4_5", {"rotary_interleaved": False}),
    "dots1-scaling": ("dots1", {"moe_router_topk_scaling_factor": None}),
    "nemotron-zero-centred-gamma": ("nemotron", {"layernorm_zero_centered_gamma": False}),
    "nemotron-squared-relu": ("nemotron", {"squared_relu": False}),
    "nemotron-partial-rotary": ("nemotron", {"rotary_percent": 1.0}),
    "starcoder2-window": ("starcoder2", {"window_size": None}),
    "starcoder2-tanh-gelu": ("starcoder2", {"openai_gelu": False}),
    "dots1-window": ("dots1-window-groups", {"window_size": None}),
    "minimax_m2-partial-rotary": ("minimax_m2", {"rotary_percent": 1.0}),
    "gpt_neox-sequential-partial-rotary": ("gpt_neox-sequential", {"rotary_percent": 1.0}),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path]]:
    """source -> (HF model, its TP1/PP1/EP1 Megatron conversion), each made once per module."""
    root = tmp_path_factory.mktemp("mcore_families")
    made: dict[str, tuple[Path, Path]] = {}

    def get(source: str) -> tuple[Path, Path]:
        if source not in made:
            src = SOURCES[source](root / source)
            dst = root / f"{source}-megatron"
            pgconvert.convert(src, dst, dst_format="megatron", dst_tp=1, dst_pp=1, dst_ep=1)
            made[source] = (src, dst)
        return made[source]
    return get


def _vocab(src: Path) -> int:
    return int(json.loads((src / "config.json").read_text())["vocab_size"])


def _rewrite_args(root: Path, changes: dict[str, Any]) -> None:
    from support.hf_helpers import _load_rank

    for path in root.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        payload = _load_rank(path)
        args: argparse.Namespace = payload["args"]
        for name, value in changes.items():
            assert hasattr(args, name), name
            setattr(args, name, value)
        torch.save(payload, path)


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_megatron_core_forward_of_the_written_checkpoint_equals_transformers(
        converted: Callable[[str], tuple[Path, Path]], source: str) -> None:
    import support.mcore_helpers as mcore

    src, megatron = converted(source)
    ids = input_ids(_vocab(src))

    actual = mcore.megatron_core_logits_from_args(megatron, ids)

    expected = hf_logits(src, ids)
    assert actual.shape == expected.shape == (2, 12, _vocab(src))
    torch.testing.assert_close(actual, expected, **TOL)


@pytest.mark.parametrize("case", sorted(CASES))
def test_megatron_core_forward_sees_the_familys_own_setting(converted: Callable[[str], tuple[Path, Path]],
                                                            tmp_path: Path, case: str) -> None:
    import support.mcore_helpers as mcore

    src, megatron = converted(CASES[case][0])
    knocked_out = Path(shutil.copytree(megatron, tmp_path / "megatron"))
    _rewrite_args(knocked_out, CASES[case][1])
    ids = input_ids(_vocab(src))

    actual = mcore.megatron_core_logits_from_args(knocked_out, ids)

    assert not torch.allclose(actual, hf_logits(src, ids), **TOL)


@pytest.mark.parametrize("case", ["qwen2_moe", "glm4_moe", "minimax_m2"])
def test_megatron_core_forward_stage_by_stage_at_pp2_equals_transformers(tmp_path: Path, case: str) -> None:
    """megatron-core's MoE decoder block spec, sliced per stage by the args' pipeline layout."""
    import support.mcore_helpers as mcore

    src = SOURCES[case](tmp_path / "src")
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=1, dst_pp=2, dst_ep=1)
    ids = input_ids(_vocab(src))

    actual = mcore.megatron_core_logits_from_args(tmp_path / "megatron", ids)

    assert len(mcore.rank_files(tmp_path / "megatron")) == 2
    torch.testing.assert_close(actual, hf_logits(src, ids), **TOL)


def test_megatron_core_computes_a_parallel_gpt_neox_as_the_sequential_layer_the_notice_names(tmp_path: Path) -> None:
    """pythia's parallel attention and MLP: megatron-core's forward of the written args is the independent
    reference forward with use_parallel_residual knocked out, not transformers' (hence the notice)."""
    import support.mcore_helpers as mcore
    from support.hf_helpers import read_megatron_tp_ranks
    from support.llama_like_helpers import megatron_args
    from support.parallel_block_helpers import parallel_block_logits

    src = _parallel_block("gpt_neox")(tmp_path / "src")
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=1, dst_pp=1)
    ids = input_ids(_vocab(src))
    args = megatron_args(tmp_path / "megatron")
    sequential = argparse.Namespace(**{**vars(args), "use_parallel_residual": False})

    actual = mcore.megatron_core_logits_from_args(tmp_path / "megatron", ids)

    assert args.use_parallel_residual is True
    assert not torch.allclose(actual, hf_logits(src, ids), **TOL)
    reference = parallel_block_logits(read_megatron_tp_ranks(tmp_path / "megatron"), sequential, ids)
    torch.testing.assert_close(actual, reference.float(), **TOL)
