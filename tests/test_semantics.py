"""A model's semantics are data (pgconvert.semantics): carried both ways, seen by inspect and verify.

* HF -> Megatron -> HF for real release configurations (Llama-3.1/3.2 llama3 RoPE, Mistral's window,
  Qwen2's windowed top layers, Qwen3, Mixtral, Qwen3-MoE) gives back the settings and the logits,
  with config.json built from the Megatron args alone;
* megatron-core's own CPU forward of the model built from the written args (as Megatron-LM's
  ``megatron/training/models/gpt.py`` builds it) equals transformers' logits of the HF output, and
  the setting is shown to matter (dropping it from the args changes megatron-core's logits);
* a setting the target cannot express is named in a notice and refused under ``--strict``;
* ``verify`` fails on a config-only difference and ``inspect`` prints the settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from support.hf_helpers import build_hf_model, hf_logits, input_ids, save_hf_model

import pgconvert
from pgconvert.cli import main
from pgconvert.model.config import ModelConfig
from pgconvert.semantics import SEMANTIC_FIELDS, SEMANTICS, from_args, to_args

TOL = dict(rtol=1e-5, atol=1e-5)
SEQ = 24  # longer than every window below, so the window changes the logits

# llama3 RoPE as Llama-3.1 (factor 8) and Llama-3.2 (factor 32) ship it. rope_theta is 10000, not
# 500000, so that at head_dim 8 the scaled low frequencies change logits over 24 positions.
LLAMA3_8 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 10000.0}
LLAMA3_32 = {**LLAMA3_8, "factor": 32.0}
# YaRN with a short original context (so positions past 16 are scaled) and an mscale ratio.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16.0,
        "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5, "rope_theta": 10000.0}

# name -> (hf_helpers family, config overrides)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama31": ("llama", {"rope_parameters": dict(LLAMA3_8), "rms_norm_eps": 1e-4, "max_position_embeddings": 131072}),
    "llama32": ("llama", {"rope_parameters": dict(LLAMA3_32), "tie_word_embeddings": True,
                          "max_position_embeddings": 131072}),
    "mistral": ("mistral", {"sliding_window": 5}),
    "qwen2": ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 2}),
    "qwen3": ("qwen3", {}),
    "qwen3_linear": ("qwen3", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}),
    "llama_yarn": ("llama", {"rope_parameters": dict(YARN), "max_position_embeddings": 64}),
    "mixtral": ("mixtral", {"sliding_window": 6, "router_aux_loss_coef": 0.02}),
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": False, "router_aux_loss_coef": 0.01}),
}
# config attributes (as transformers loads them) that the table maps, compared after a round trip.
HF_SEMANTIC_ATTRIBUTES = (
    "architectures", "rope_parameters", "sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
    "rms_norm_eps", "head_dim", "num_key_value_heads", "tie_word_embeddings", "max_position_embeddings",
    "vocab_size", "attention_dropout", "hidden_act", "num_experts_per_tok", "norm_topk_prob", "router_aux_loss_coef",
)


def semantic_attribute(config: Any, name: str) -> Any:
    """A config attribute as the model uses it (Mixtral's unset head_dim is hidden / heads)."""
    value = getattr(config, name, None)
    if name == "head_dim" and value is None:
        return config.hidden_size // config.num_attention_heads
    if name == "max_window_layers" and not getattr(config, "use_sliding_window", False):
        return None  # transformers reads it only with use_sliding_window
    return value


def run_cli(*args: str | Path) -> Any:
    return CliRunner().invoke(main, [str(arg) for arg in args])


def make_source(tmp_path: Path, case: str, seed: int = 3) -> tuple[Any, Path]:
    family, overrides = CASES[case]
    model = build_hf_model(family, seed=seed, **overrides)
    return model, save_hf_model(model, tmp_path / f"hf-{case}")


def back_to_hf(megatron: Path, out: Path) -> Path:
    """Megatron -> HF from the args alone: no HF side files of the source are there to reuse."""
    shutil.rmtree(megatron / "hf", ignore_errors=True)
    pgconvert.convert(megatron, out, dst_format="hf", dst_tp=1, dst_pp=1, dst_ep=1)
    return out


def rank_paths(root: Path) -> list[Path]:
    return sorted(root.glob("iter_*/mp_rank_*/model_optim_rng.pt")) + sorted(root.glob("release/mp_rank_*/model_optim_rng.pt"))


def edit_rank_files(root: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite every rank file of a Megatron checkpoint after ``change`` (args and model)."""
    for path in rank_paths(root):
        with torch.serialization.safe_globals([argparse.Namespace]):
            state = torch.load(path, map_location="cpu", weights_only=True)
        change(state)
        torch.save(state, path)


def edited_copy(root: Path, dst: Path, **args: Any) -> Path:
    """A copy of a Megatron checkpoint with ``args`` changed (its manifest, now stale, removed)."""
    shutil.copytree(root, dst)
    (dst / "pgconvert.json").unlink(missing_ok=True)
    edit_rank_files(dst, set_args(**args))
    return dst


def set_args(**values: Any) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        for key, value in values.items():
            setattr(state["args"], key, value)
    return change


# --- the table ----------------------------------------------------------------------------------------


def test_every_row_names_model_config_fields_and_the_args_round_trip() -> None:
    fields = set(ModelConfig.setting_names())
    assert set(SEMANTIC_FIELDS) <= fields
    assert all(row.megatron and row.common_pt and row.hf for row in SEMANTICS)
    config = ModelConfig(
        num_layers=4, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128, vocab_size=1000,
        rotary_percent=0.5, rotary_interleaved=True, rope_scaling="llama3", rope_scaling_factor=32.0,
        sliding_window=7, window_layers=(0, 1, 1, 0), layernorm_zero_centered_gamma=True,
        attention_dropout=0.05, hidden_dropout=0.1, num_experts=4, moe_router_score_function="sigmoid",
        moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5, moe_aux_loss_coeff=0.01,
    )
    args = argparse.Namespace(num_layers=4, num_experts=4, **to_args(config))

    assert args.window_size == (6, 0) and args.window_attn_skip_freq == [0, 1, 1, 0]
    assert args.use_rope_scaling is True and args.rope_scaling_factor == 32.0
    read = from_args(args, Path("common.pt"))
    assert {name: read[name] for name in read} == {name: getattr(config, name) for name in read}
    linear = argparse.Namespace(num_layers=4, **to_args(config.replace(rope_scaling="linear", rope_scaling_factor=4.0)))
    assert linear.rotary_seq_len_interpolation_factor == 4.0 and linear.use_rope_scaling is False
    assert from_args(linear, Path("x"))["rope_scaling"] == "linear"


def test_megatron_arg_names_are_megatron_cores_or_megatron_lms() -> None:
    """Every Megatron name in the table is a megatron-core TransformerConfig field (Megatron-LM's
    arguments.py derives those arguments from it) or one of Megatron-LM's own arguments."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron.core.transformer.transformer_config import TransformerConfig

    core = {field.name for field in dataclasses.fields(TransformerConfig)}
    # megatron/training/arguments.py (Megatron-LM d98e8a64): arguments not from TransformerConfig.
    megatron_lm = {"rotary_base", "use_rope_scaling", "rope_scaling_factor", "rotary_seq_len_interpolation_factor",
                   "rotary_percent", "apply_layernorm_1p", "swiglu", "untie_embeddings_and_output_weights",
                   "max_position_embeddings", "seq_length", "vocab_size", "padded_vocab_size",
                   "make_vocab_size_divisible_by", "group_query_attention", "bf16", "fp16", "norm_epsilon",
                   "layernorm_epsilon", "position_embedding_type", "rope_type", "rotary_scaling_factor",
                   "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow", "mscale",
                   "mscale_all_dim", "yarn_correction_range_round_to_int", "original_max_position_embeddings",
                   "beta_fast", "beta_slow"}
    megatron_lm.update({"openai_gelu", "quick_geglu", "squared_relu"})  # --openai-gelu, --quick-geglu, --squared-relu
    megatron_lm.add("hybrid_override_pattern")  # --hybrid-override-pattern (deprecated for --hybrid-layer-pattern)
    names = {name for row in SEMANTICS for name in row.megatron}
    # Settings megatron-core does not compute that families carry under transformers' names (with a
    # notice); Megatron-Bridge's names for what megatron-core lacks, and pgconvert's own where no
    # Megatron code has a setting (pgconvert.semantics.postnorm names both).
    from pgconvert.semantics.postnorm import BRIDGE_ARGS, PGCONVERT_ARGS
    from pgconvert.families import CARRIED_ARGS

    assert set(CARRIED_ARGS) & (core | megatron_lm) == set()
    assert names - core - megatron_lm - set(CARRIED_ARGS) - BRIDGE_ARGS - PGCONVERT_ARGS == set()



def test_hf_linear_rope_reads_into_megatron_args_and_a_partial_rotary_llama_cannot_compute_is_refused() -> None:
    """Llama's attention rotates the whole head: a partial_rotary_factor with a scaled RoPE type sizes frequencies
    it cannot apply (transformers raises on the first forward), so pgconvert refuses it by name; without it the
    linear scaling is megatron-core's ``rotary_seq_len_interpolation_factor``."""
    from pgconvert.errors import PgconvertError
    from pgconvert.formats.hf import model_config_from_hf
    from pgconvert.model.layout import ParallelLayout
    from pgconvert.formats.megatron import args_for_target

    doc = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "vocab_size": 256, "hidden_act": "silu", "attention_dropout": 0.0,
           "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}}
    _, config, notices = model_config_from_hf(doc, Path("config.json"))
    args = args_for_target(config, ParallelLayout(), 256, torch.float32, None, None)

    assert (config.rotary_percent, config.rope_scaling, config.rope_scaling_factor) == (1.0, "linear", 2.0)
    assert (args.rotary_percent, args.rotary_seq_len_interpolation_factor, args.rotary_base) == (1.0, 2.0, 1000.0)
    assert notices == []
    partial = {**doc, "rope_parameters": {**doc["rope_parameters"], "partial_rotary_factor": 0.5}}
    with pytest.raises(PgconvertError, match="partial_rotary_factor=0.5 with rope_type 'linear'"):
        model_config_from_hf(partial, Path("config.json"))


# --- HF -> Megatron -> HF ------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_to_megatron_and_back_keeps_settings_and_logits(tmp_path: Path, case: str) -> None:
    from transformers import AutoConfig

    model, src = make_source(tmp_path, case)
    moe = case in ("mixtral", "qwen3_moe")
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=2, dst_ep=2 if moe else 1)
    out = back_to_hf(tmp_path / "megatron", tmp_path / "out")

    before, after = AutoConfig.from_pretrained(src), AutoConfig.from_pretrained(out)
    for name in HF_SEMANTIC_ATTRIBUTES:
        assert semantic_attribute(after, name) == semantic_attribute(before, name), name
    ids = input_ids(before.vocab_size, seq=SEQ)
    torch.testing.assert_close(hf_logits(out, ids), hf_logits(model, ids), **TOL)


def test_torch_dist_carries_the_settings_in_common_pt_args(tmp_path: Path) -> None:
    model, src = make_source(tmp_path, "qwen2")
    pgconvert.convert(src, tmp_path / "dist", dst_format="torch_dist", dst_tp=2, dst_pp=1)
    out = back_to_hf(tmp_path / "dist", tmp_path / "out")

    written = json.loads((out / "config.json").read_text())
    assert (written["use_sliding_window"], written["sliding_window"], written["max_window_layers"]) == (True, 5, 2)
    ids = input_ids(1030, seq=SEQ)
    torch.testing.assert_close(hf_logits(out, ids), hf_logits(model, ids), **TOL)


def test_megatron_args_hold_the_hf_settings_and_zero_dropout(tmp_path: Path) -> None:
    _, src = make_source(tmp_path, "qwen2")
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=1, dst_pp=1)
    with torch.serialization.safe_globals([argparse.Namespace]):
        args = torch.load(rank_paths(tmp_path / "megatron")[0], weights_only=True)["args"]

    assert args.window_size == (4, 0) and args.window_attn_skip_freq == [0, 0, 1, 1]
    assert (args.attention_dropout, args.hidden_dropout) == (0.0, 0.0)


# --- megatron-core's own forward of the written args -----------------------------------------------


def _cpu_sliding_window_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    """megatron-core's get_sliding_window_causal_mask with device="cpu" (it hard-codes "cuda")."""
    ones = torch.ones(sq, skv, dtype=torch.bool)
    upper = torch.triu(ones, diagonal=skv - sq - window_size[0])
    return ~torch.tril(upper, diagonal=skv - sq + window_size[1])


@contextmanager
def cpu_sliding_window() -> Iterator[None]:
    import megatron.core.fusions.fused_softmax as fused_softmax

    original = fused_softmax.get_sliding_window_causal_mask
    fused_softmax.get_sliding_window_causal_mask = _cpu_sliding_window_mask
    try:
        yield
    finally:
        fused_softmax.get_sliding_window_causal_mask = original


def mcore_logits(root: Path, tokens: torch.Tensor, vocab: int, **arg_changes: Any) -> torch.Tensor:
    """megatron-core's GPTModel for the TP1/PP1 checkpoint at ``root``, its settings taken from the
    rank file's args as Megatron-LM's ``gpt_config_from_args`` + ``GPTModelBuilder`` take them
    (``arg_changes`` override args, to show a setting matters). megatron-core's local spec cannot
    run zero-centred gamma (its torch norm asserts): the model then loads ``1 + gamma``, which is
    what megatron-core's fused norm computes (``weight + 1``)."""
    import support.mcore_helpers as mcore
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    (rank,) = mcore.rank_files(root)
    args = argparse.Namespace(**{**vars(rank.args), **arg_changes})
    config = dataclasses.replace(
        mcore.transformer_config_from_args(args), layernorm_epsilon=args.norm_epsilon,
        window_size=args.window_size, window_attn_skip_freq=args.window_attn_skip_freq,
        rotary_interleaved=args.rotary_interleaved)
    if args.position_embedding_type == "yarn":
        # Megatron-LM's argument_utils._apply_yarn_config_from_args: config.yarn_* from these args.
        for field, arg in (("rotary_scaling_factor", "rotary_scaling_factor"), ("mscale", "mscale"),
                           ("mscale_all_dim", "mscale_all_dim"), *((name, f"yarn_{name}") for name in (
                               "original_max_position_embeddings", "beta_fast", "beta_slow",
                               "correction_range_round_to_int"))):
            setattr(config, f"yarn_{field}", getattr(args, arg))
    weights = mcore.norms_as_computed(args, dict(rank.model))
    spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad(), mcore.fake_group_queries(), mcore.restored_attention_backend_env(), \
            mcore.cpu_forward_patches(), cpu_sliding_window():
        model = GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings, pre_process=True, post_process=True,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling,
            rope_scaling_factor=args.rope_scaling_factor,
            seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
            pg_collection=mcore.fake_pg_collection(1, 1, 0, 0)).eval()
        model.load_state_dict(weights, strict=True)
        logits = model(input_ids=tokens, position_ids=positions,
                       attention_mask=mcore.causal_attention_mask(tokens.shape[1]))
    return logits[..., :vocab]


# case -> the args that, reset to Megatron's defaults, give a different model (the setting matters).
MCORE_CASES: dict[str, dict[str, Any]] = {
    "llama31": {"use_rope_scaling": False, "norm_epsilon": 1e-5},
    "llama32": {"use_rope_scaling": False},
    "mistral": {"window_size": None},
    "qwen2": {"window_attn_skip_freq": None},
    "qwen3": {"rotary_base": 500000.0},
    "qwen3_linear": {"rotary_seq_len_interpolation_factor": None},
    "llama_yarn": {"mscale_all_dim": 0.0},
}


@pytest.mark.parametrize("case", sorted(MCORE_CASES))
def test_megatron_core_forward_of_the_written_args_equals_transformers_on_the_hf_output(
        tmp_path: Path, case: str) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    _, src = make_source(tmp_path, case)
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=1, dst_pp=1)
    out = back_to_hf(tmp_path / "megatron", tmp_path / "out")
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    ids = input_ids(vocab, seq=SEQ)

    megatron = mcore_logits(tmp_path / "megatron", ids, vocab)
    torch.testing.assert_close(hf_logits(out, ids), megatron, **TOL)
    without = mcore_logits(tmp_path / "megatron", ids, vocab, **MCORE_CASES[case])
    assert not torch.allclose(without, megatron, **TOL)


def test_zero_centred_gamma_is_written_as_one_plus_gamma(tmp_path: Path) -> None:
    """A Megatron model trained with --apply-layernorm-1p stores gamma - 1; the HF output must
    compute what megatron-core computes, i.e. the original model."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    model, src = make_source(tmp_path, "llama31")
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=1, dst_pp=1)

    def zero_centre(state: dict[str, Any]) -> None:
        state["args"].layernorm_zero_centered_gamma = True
        for key in [key for key in state["model"] if key.endswith("layernorm.weight")]:
            state["model"][key] = state["model"][key] - 1

    edit_rank_files(tmp_path / "megatron", zero_centre)
    out = back_to_hf(tmp_path / "megatron", tmp_path / "out")
    ids = input_ids(1000, seq=SEQ)

    megatron = mcore_logits(tmp_path / "megatron", ids, 1000)
    torch.testing.assert_close(hf_logits(out, ids), megatron, **TOL)
    torch.testing.assert_close(hf_logits(out, ids), hf_logits(model, ids), **TOL)


@pytest.mark.parametrize("case", ["qwen3", "qwen2"])
def test_interleaved_rotary_is_written_as_reordered_query_and_key_rows(tmp_path: Path, case: str) -> None:
    """A Megatron model with --rotary-interleaved (Qwen3: with q/k norms; Qwen2: with q/k/v biases)
    becomes an HF model that computes megatron-core's logits."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    _, src = make_source(tmp_path, case)
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=1, dst_pp=1)
    edit_rank_files(tmp_path / "megatron", set_args(rotary_interleaved=True))
    (tmp_path / "megatron" / "pgconvert.json").unlink(missing_ok=True)
    out = back_to_hf(tmp_path / "megatron", tmp_path / "out")
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    ids = input_ids(vocab, seq=SEQ)

    megatron = mcore_logits(tmp_path / "megatron", ids, vocab)
    torch.testing.assert_close(hf_logits(out, ids), megatron, **TOL)
    assert not torch.allclose(mcore_logits(tmp_path / "megatron", ids, vocab, rotary_interleaved=False), megatron,
                              **TOL)


@pytest.mark.parametrize("case", ["qwen3_moe", "mixtral"])
def test_megatron_core_router_of_the_written_args_routes_as_transformers(tmp_path: Path, case: str) -> None:
    """megatron-core's own routing function, with the router settings of the written args, gives the
    weights and experts of transformers' router of the HF output (a whole MoE forward needs real
    expert-parallel collectives in megatron-core)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers import AutoModelForCausalLM

    _, src = make_source(tmp_path, case)
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=1, dst_pp=1)
    out = back_to_hf(tmp_path / "megatron", tmp_path / "out")
    (path,) = rank_paths(tmp_path / "megatron")
    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(path, weights_only=True)
    args = state["args"]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    block = hf.model.layers[0].mlp
    router = block.gate
    hidden = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))

    def mcore_route(pre_softmax: bool) -> torch.Tensor:
        logits = hidden @ state["model"]["decoder.layers.0.mlp.router.weight"].T
        probs, routing_map = topk_routing_with_score_function(
            logits, args.moe_router_topk, use_pre_softmax=pre_softmax,
            scaling_factor=args.moe_router_topk_scaling_factor, score_function=args.moe_router_score_function)
        return probs

    with torch.no_grad():
        _, hf_scores, hf_indices = router(hidden)
        dense_hf = torch.zeros(16, args.num_experts).scatter(1, hf_indices, hf_scores.float())
        megatron = mcore_route(args.moe_router_pre_softmax)
        other = mcore_route(not args.moe_router_pre_softmax)
    torch.testing.assert_close(megatron, dense_hf, **TOL)
    if case == "qwen3_moe":
        assert args.moe_router_pre_softmax is True and args.moe_aux_loss_coeff == 0.01
        assert not torch.allclose(other, dense_hf, **TOL)
    else:
        assert args.moe_router_pre_softmax is False and args.moe_aux_loss_coeff == 0.02


# --- what a target cannot express -------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("megatron_llama")
    _, src = make_source(tmp, "qwen3")
    pgconvert.convert(src, tmp / "megatron", dst_format="megatron", dst_tp=1, dst_pp=1)
    return tmp / "megatron"


@pytest.fixture(scope="module")
def megatron_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("megatron_moe")
    _, src = make_source(tmp, "mixtral")
    pgconvert.convert(src, tmp / "megatron", dst_format="megatron", dst_tp=1, dst_pp=1)
    return tmp / "megatron"


@pytest.mark.parametrize("args,named", [
    ({"rotary_percent": 0.5}, "rotary_percent=0.5"),
], ids=["partial-rotary"])
def test_megatron_to_hf_names_what_hf_cannot_express_and_strict_refuses(
        megatron_llama: Path, tmp_path: Path, args: dict[str, Any], named: str) -> None:
    src = edited_copy(megatron_llama, tmp_path / "src", **args)

    strict = run_cli("convert", src, tmp_path / "strict", "--dst-format", "hf", "--dst-tp", "1", "--strict")
    loose = run_cli("convert", src, tmp_path / "loose", "--dst-format", "hf", "--dst-tp", "1")

    assert strict.exit_code == 2, strict.output
    assert "--strict: refusing to drop a setting" in strict.output and named in strict.output
    assert not (tmp_path / "strict").exists()
    assert loose.exit_code == 0, loose.output
    assert f"not carried: {named}" in loose.output


def test_megatron_hidden_dropout_is_named_for_hf_but_not_refused_under_strict(
        megatron_llama: Path, tmp_path: Path) -> None:
    # Training-only: every real Megatron-LM run records hidden_dropout (0.1 by default), and the
    # trained model computes the same without it, so --strict must not refuse every real checkpoint.
    src = edited_copy(megatron_llama, tmp_path / "src", hidden_dropout=0.1)

    strict = run_cli("convert", src, tmp_path / "strict", "--dst-format", "hf", "--dst-tp", "1", "--strict")

    assert strict.exit_code == 0, strict.output
    assert "not carried (training only): hidden_dropout=0.1" in strict.output
    assert (tmp_path / "strict" / "config.json").is_file()


@pytest.mark.parametrize("args,named", [
    ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function='sigmoid'"),
    ({"moe_router_topk_scaling_factor": 2.5}, "moe_router_topk_scaling_factor=2.5"),
    ({"moe_router_pre_softmax": True}, "moe_router_pre_softmax=True: MixtralForCausalLM"),
], ids=["sigmoid", "topk-scaling", "pre-softmax-mixtral"])
def test_megatron_moe_router_settings_hf_cannot_express_are_refused_under_strict(
        megatron_moe: Path, tmp_path: Path, args: dict[str, Any], named: str) -> None:
    src = edited_copy(megatron_moe, tmp_path / "src", **args)

    strict = run_cli("convert", src, tmp_path / "strict", "--dst-format", "hf", "--dst-tp", "1", "--strict")

    assert strict.exit_code == 2, strict.output
    assert named in strict.output


@pytest.mark.parametrize("rope,named", [
    ({"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}, "rope_type='dynamic'"),
    ({**YARN, "attention_factor": 1.5}, "attention_factor=1.5"),
    ({**LLAMA3_8, "low_freq_factor": 2.0}, "low_freq_factor=2.0"),
], ids=["dynamic", "yarn-attention-factor", "llama3-other-frequencies"])
def test_hf_rope_megatron_cannot_compute_is_named_and_refused_under_strict(
        tmp_path: Path, rope: dict[str, Any], named: str) -> None:
    model = build_hf_model("llama", seed=3, rope_parameters=rope)
    src = save_hf_model(model, tmp_path / "hf")

    strict = run_cli("convert", src, tmp_path / "strict", "--dst-format", "megatron", "--strict")
    loose = run_cli("convert", src, tmp_path / "loose", "--dst-format", "megatron")
    same_format = run_cli("convert", src, tmp_path / "hf-out", "--dst-format", "hf", "--strict")

    assert strict.exit_code == 2, strict.output
    assert "--strict: refusing to drop a setting" in strict.output and named in strict.output
    assert loose.exit_code == 0 and named in loose.output
    assert same_format.exit_code == 0, same_format.output  # config.json is kept: nothing is lost


# --- verify and inspect -------------------------------------------------------------------------------


@pytest.mark.parametrize("args,fields", [
    ({"rotary_base": 20000.0}, ["rotary_base"]),
    ({"window_size": (3, 0)}, ["sliding_window"]),
    ({"use_rope_scaling": True, "rope_scaling_factor": 8.0}, ["rope_scaling", "rope_scaling_factor"]),
], ids=["theta", "window", "llama3"])
def test_verify_fails_on_a_config_only_difference_naming_the_field(
        megatron_llama: Path, tmp_path: Path, args: dict[str, Any], fields: list[str]) -> None:
    other = edited_copy(megatron_llama, tmp_path / "other", **args)

    report = pgconvert.verify(megatron_llama, other)
    result = run_cli("verify", megatron_llama, other)

    assert report.compared > 0 and not report.equal and not report.file_problems
    assert [d.name for d in report.differences if d.kind == "config"] == [f"model_config.{f}" for f in fields]
    assert [d.kind for d in report.differences] == ["config"] * len(fields)  # every tensor matches
    assert result.exit_code == 1 and all(field in result.output for field in fields)


def test_verify_reports_training_only_differences_as_notes(megatron_llama: Path, tmp_path: Path) -> None:
    other = edited_copy(megatron_llama, tmp_path / "other", attention_dropout=0.1)

    report = pgconvert.verify(megatron_llama, other)

    assert report.equal and any("attention_dropout" in note for note in report.notes)


def test_inspect_prints_the_semantic_settings(tmp_path: Path) -> None:
    _, src = make_source(tmp_path, "qwen2")
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=1, dst_pp=1)

    text = run_cli("inspect", "--all", tmp_path / "megatron")
    differing = run_cli("inspect", tmp_path / "megatron")
    doc = json.loads(run_cli("inspect", "--json", tmp_path / "megatron").output)

    printed = " ".join(text.output.split())  # the semantics row is wrapped at 100 columns
    assert text.exit_code == 0, text.output
    assert "semantics rope theta: rotary_base=10000.0;" in printed
    assert "sliding window: sliding_window=5, window_layers=(0, 0, 1, 1);" in printed
    assert "rope scaling: rope_scaling=None, rope_scaling_factor=1.0;" in printed
    assert doc["semantics"]["sliding window"] == "sliding_window=5, window_layers=(0, 0, 1, 1)"
    # Without --all, the settings that differ from Qwen2's defaults: the window, not the plain RoPE.
    assert differing.exit_code == 0, differing.output
    assert "sliding_window=5 (family default: None)\n" in differing.output
    assert "rope_scaling" not in differing.output


def test_yarn_args_round_trip_and_megatron_lms_mla_defaults() -> None:
    config = ModelConfig(
        num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128, rope_scaling="yarn",
        rope_scaling_factor=40.0, yarn_original_max_position_embeddings=4096, yarn_beta_fast=16.0,
        yarn_beta_slow=2.0, yarn_mscale=0.707, yarn_mscale_all_dim=0.707, yarn_correction_range_round_to_int=False)
    args = argparse.Namespace(num_layers=2, **to_args(config))

    assert (args.position_embedding_type, args.rotary_scaling_factor, args.mscale, args.mscale_all_dim) == (
        "yarn", 40.0, 0.707, 0.707)
    assert (args.yarn_original_max_position_embeddings, args.yarn_beta_fast, args.yarn_beta_slow,
            args.yarn_correction_range_round_to_int) == (4096, 16.0, 2.0, False)
    read = from_args(args, Path("x"))
    assert {name: read[name] for name in read} == {name: getattr(config, name) for name in read}
    # A DeepSeek run of Megatron-LM: MLA (rope_type defaults to yarn), no yarn_* args.
    mla = argparse.Namespace(num_layers=2, multi_latent_attention=True, position_embedding_type="rope",
                             rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0)
    assert {k: v for k, v in from_args(mla, Path("x")).items() if k.startswith(("yarn_", "rope_"))} == {
        "rope_scaling": "yarn", "rope_scaling_factor": 40.0, "yarn_original_max_position_embeddings": 4096,
        "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_mscale": 1.0, "yarn_mscale_all_dim": 1.0,
        "yarn_correction_range_round_to_int": True}
    assert from_args(argparse.Namespace(num_layers=2, multi_latent_attention=True, rope_type="rope"),
                     Path("x"))["rope_scaling"] is None


def test_yarn_attention_factor_transformers_would_infer_differently_is_written() -> None:
    from pgconvert.families import FAMILIES

    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128,
                         rope_scaling="yarn", rope_scaling_factor=4.0, yarn_mscale=2.0, yarn_mscale_all_dim=0.0)
    (rule,) = [rule for rule in FAMILIES["LlamaForCausalLM"].rules if "rope_parameters" in rule.keys]
    params = rule.write(config)["rope_parameters"]

    # megatron-core: get_mscale(4, 2) / get_mscale(4, 0); transformers would infer get_mscale(4).
    assert params["attention_factor"] == pytest.approx(0.2 * math.log(4.0) + 1.0, rel=1e-12)


def test_hf_losses_asks_the_family_what_it_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether a partial rotary or pre-softmax router is lost is the family's ``hf_computes``."""
    from pgconvert import families
    from pgconvert.formats.hf import hf_losses

    config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128,
                         rotary_percent=0.5)
    assert [loss for loss in hf_losses("LlamaForCausalLM", config) if loss.startswith("rotary_percent")]
    assert not hf_losses("Glm4ForCausalLM", config)
    partial = dataclasses.replace(families.FAMILIES["LlamaForCausalLM"], hf_computes=frozenset({"rotary_percent"}))
    monkeypatch.setitem(families.FAMILIES, "LlamaForCausalLM", partial)

    assert not [loss for loss in hf_losses("LlamaForCausalLM", config) if loss.startswith("rotary_percent")]
    with pytest.raises(ValueError, match="not ModelConfig fields: \\['rotary_fraction'\\]"):
        dataclasses.replace(partial, hf_computes=frozenset({"rotary_fraction"}))
