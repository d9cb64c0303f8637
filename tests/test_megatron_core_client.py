"""pgconvert's ``megatron`` output is what megatron-core itself expects.

For checkpoints converted by pgconvert, every destination rank is loaded into megatron-core's own
``GPTModel`` (local layer spec, built on CPU from the rank file's args, on a collection of fake
process groups for that rank) with ``load_state_dict(strict=True)``; at TP1 megatron-core's forward
is compared with an independent plain-torch forward of the source model. The workarounds needed to
run megatron-core without ``torch.distributed`` or CUDA are in ``mcore_helpers`` with their reasons.

Needs megatron-core (the ``test`` extra pins it); without it the module is skipped.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed

with warnings.catch_warnings():
    # megatron-core warns at import that Apex / Transformer Engine are absent; the local spec needs neither.
    warnings.simplefilter("ignore", UserWarning)
    pytest.importorskip(
        "megatron.core",
        reason="megatron-core is not installed (pip install 'megatron-core==0.16.1' --no-deps, "
        "the test extra); these tests load pgconvert's output into megatron-core's GPTModel",
    )
    import support.mcore_helpers as mcore
    import megatron.core.utils as mcore_utils
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random

from support.megatron_fixtures import (
    TinyModel,
    _rank_state_dict,
    make_full_model,
    padded_vocab_size,
    stage_layer_ranges,
    write_megatron_checkpoint,
)

import pgconvert

# Vocab 200 padded to a multiple of 32·tp: 224 rows at tp1, 256 at tp2 and tp4, so converting
# from the tp2 source strips and re-pads the vocab tables.
_SHAPE = dict(num_layers=6, hidden_size=64, num_attention_heads=8, kv_channels=8, ffn_hidden_size=96,
              vocab_size=200, make_vocab_size_divisible_by=32, max_position_embeddings=16)

MODELS = {
    "gqa_swiglu_rmsnorm_rope_untied": TinyModel(
        **_SHAPE, num_query_groups=4, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
        add_qkv_bias=False, qk_layernorm=False, tied_embeddings=False, position_embedding_type="rope",
    ),
    "mha_gelu_layernorm_bias_tied_learned": TinyModel(
        **_SHAPE, num_query_groups=8, swiglu=False, normalization="LayerNorm", add_bias_linear=True,
        add_qkv_bias=False, qk_layernorm=False, tied_embeddings=True,
        position_embedding_type="learned_absolute",
    ),
    "qknorm_rmsnorm_qkv_bias_untied": TinyModel(
        **_SHAPE, num_query_groups=4, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
        add_qkv_bias=True, qk_layernorm=True, tied_embeddings=False, position_embedding_type="rope",
    ),
    # Gated fc1 *with* a bias: its [gate_r; up_r] split applies to the bias too.
    "qknorm_layernorm_swiglu_bias_tied": TinyModel(
        **_SHAPE, num_query_groups=4, swiglu=True, normalization="LayerNorm", add_bias_linear=True,
        add_qkv_bias=False, qk_layernorm=True, tied_embeddings=True, position_embedding_type="rope",
    ),
}
SOURCE_LAYOUT = dict(tp=2, pp=2)
# (tp, pp, first stage layers, last stage layers)
DST_LAYOUTS = {
    "tp1pp1": (1, 1, None, None),
    "tp2pp1": (2, 1, None, None),
    "tp4pp2": (4, 2, None, None),
    "tp2pp3_first1_last3": (2, 3, 1, 3),
}
TOKENS = torch.tensor([[3, 17, 199, 42, 0, 101, 7, 64, 150, 9], [199, 1, 2, 3, 120, 55, 55, 8, 0, 77]])
# fp32 on CPU, two implementations summing in different orders over 6 layers of width 64.
LOGITS_TOLERANCE = dict(rtol=1e-4, atol=1e-4)


def _convert(tmp_path: Path, m: TinyModel, full: dict[str, torch.Tensor], dst_layout: tuple) -> Path:
    src = write_megatron_checkpoint(tmp_path / "src", m, full, **SOURCE_LAYOUT)
    tp, pp, first, last = dst_layout
    dst = tmp_path / "dst"
    pgconvert.convert(src, dst, dst_tp=tp, dst_pp=pp, dst_first_stage_layers=first, dst_last_stage_layers=last)
    return dst


@pytest.fixture(params=sorted(MODELS))
def model_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(autouse=True)
def _leaves_torch_distributed_alone():
    yield
    assert torch.distributed.is_initialized() is False


# --------------------------------------------------------------------------- strict load, every rank


@pytest.mark.parametrize("dst_name", sorted(DST_LAYOUTS))
def test_every_converted_rank_loads_strictly_into_megatron_core_gpt_model(
    tmp_path: Path, model_name: str, dst_name: str
) -> None:
    m = MODELS[model_name]
    full = make_full_model(m)
    tp, pp, first, last = DST_LAYOUTS[dst_name]
    dst = _convert(tmp_path, m, full, DST_LAYOUTS[dst_name])
    expected_stage_layers = stage_layer_ranges(m.num_layers, pp, first, last)

    ranks = mcore.rank_files(dst)

    assert [(r.layout.tp_rank, r.layout.pp_rank) for r in ranks] == [(t, p) for p in range(pp) for t in range(tp)]
    for rank in ranks:
        model = mcore.load_rank_into_gpt_model(rank)  # raises on any missing/unexpected key or shape
        # megatron-core's own idea of which global layers this stage holds agrees with the layout …
        layers = mcore.global_layer_indices(model)
        assert layers == list(expected_stage_layers[rank.layout.pp_rank]), rank.path
        # … and every loaded tensor is the slice of the *source* model for that rank and those
        # layers, cut by the fixtures' independent slicing (padding rows zero), bit for bit.
        expected = _rank_state_dict(
            m, full, rank.layout.tp_rank, tp, rank.layout.pp_rank, pp, range(layers[0], layers[-1] + 1)
        )
        loaded = {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
        assert sorted(loaded) == sorted(expected), rank.path
        for name, tensor in loaded.items():
            assert torch.equal(tensor, expected[name]), f"{rank.path}: {name}"


# --------------------------------------------------------------------------- tied embeddings


@pytest.mark.parametrize("dst_name", ["tp1pp1", "tp2pp1"])
def test_tied_embeddings_at_pp1_have_no_output_layer_weight_in_file_or_model(tmp_path: Path, dst_name: str) -> None:
    m = MODELS["mha_gelu_layernorm_bias_tied_learned"]
    dst = _convert(tmp_path, m, make_full_model(m), DST_LAYOUTS[dst_name])

    for rank in mcore.rank_files(dst):
        model = mcore.load_rank_into_gpt_model(rank)
        assert "output_layer.weight" not in rank.model
        # megatron-core allocates no output weight (skip_weight_param_allocation) and reuses the embedding.
        assert model.output_layer.weight is None
        assert model.shared_embedding_or_output_weight() is model.embedding.word_embeddings.weight


@pytest.mark.parametrize("dst_name", ["tp4pp2", "tp2pp3_first1_last3"])
@pytest.mark.parametrize("tied_model", ["mha_gelu_layernorm_bias_tied_learned", "qknorm_layernorm_swiglu_bias_tied"])
def test_tied_embeddings_at_pp_gt1_last_stage_holds_output_layer_copy_of_embedding(
    tmp_path: Path, dst_name: str, tied_model: str
) -> None:
    m = MODELS[tied_model]
    tp, pp, _, _ = DST_LAYOUTS[dst_name]
    dst = _convert(tmp_path, m, make_full_model(m), DST_LAYOUTS[dst_name])
    ranks = {(r.layout.tp_rank, r.layout.pp_rank): r for r in mcore.rank_files(dst)}

    for tp_rank in range(tp):
        first = mcore.load_rank_into_gpt_model(ranks[(tp_rank, 0)])
        last = mcore.load_rank_into_gpt_model(ranks[(tp_rank, pp - 1)])
        assert "output_layer.weight" not in ranks[(tp_rank, 0)].model
        assert not hasattr(first, "output_layer")
        # megatron-core's last stage owns a real output weight (zero-filled at build, then expected
        # to equal the first stage's embedding); the file's copy makes it so.
        assert isinstance(last.output_layer.weight, torch.nn.Parameter)
        assert getattr(last.output_layer.weight, "shared_embedding", False)
        assert torch.equal(last.output_layer.weight, first.embedding.word_embeddings.weight)
        for middle in range(1, pp - 1):
            assert not any(k.startswith(("embedding.", "output_layer.")) for k in ranks[(tp_rank, middle)].model)


# --------------------------------------------------------------------------- args


@pytest.mark.parametrize("dst_name", sorted(DST_LAYOUTS))
def test_rank_args_describe_the_destination_layout_for_megatron_lm(tmp_path: Path, dst_name: str) -> None:
    m = MODELS["gqa_swiglu_rmsnorm_rope_untied"]
    tp, pp, first, last = DST_LAYOUTS[dst_name]
    dst = _convert(tmp_path, m, make_full_model(m), DST_LAYOUTS[dst_name])

    for rank in mcore.rank_files(dst):
        args = rank.args
        # Top-level keys megatron-LM's load_checkpoint reads from a legacy rank file.
        assert rank.payload["checkpoint_version"] == 3.0
        assert isinstance(rank.payload["iteration"], int)
        assert isinstance(rank.payload["model"], dict) and "model0" not in rank.payload
        # check_checkpoint_args (megatron/training/checkpointing.py) compares these against the run,
        # reading them with getattr and no default (vocab ones only when the run has --vocab-file).
        for name in ("num_layers", "hidden_size", "num_attention_heads", "tensor_model_parallel_size",
                     "pipeline_model_parallel_size", "max_position_embeddings",
                     "make_vocab_size_divisible_by", "padded_vocab_size"):
            assert hasattr(args, name), name
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp)
        assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (first, last)
        assert args.padded_vocab_size == padded_vocab_size(m, tp)
        assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups,
                args.kv_channels, args.ffn_hidden_size) == (m.num_layers, m.hidden_size, m.num_attention_heads,
                                                             m.num_query_groups, m.kv_channels, m.ffn_hidden_size)
        assert args.group_query_attention is (m.num_query_groups != m.num_attention_heads)
        assert args.untie_embeddings_and_output_weights is (not m.tied_embeddings)
        assert args.transformer_impl == "local"


# --------------------------------------------------------------------------- forward


def test_megatron_core_logits_at_tp1pp1_match_reference_forward(tmp_path: Path, model_name: str) -> None:
    m = MODELS[model_name]
    full = mcore.forward_test_model(m)
    dst = _convert(tmp_path, m, full, DST_LAYOUTS["tp1pp1"])

    logits = mcore.megatron_core_logits(dst, m, TOKENS)
    expected = mcore.reference_logits(m, full, TOKENS)

    assert logits.shape == (*TOKENS.shape, m.vocab_size)
    # The comparison is meaningful: logits move with the tokens far more than the tolerance.
    assert (expected[:, 1:] - expected[:, :-1]).abs().amax() > 1.0
    torch.testing.assert_close(logits, expected, **LOGITS_TOLERANCE)


@pytest.mark.parametrize("stage_model", ["gqa_swiglu_rmsnorm_rope_untied", "mha_gelu_layernorm_bias_tied_learned"])
def test_megatron_core_logits_stage_by_stage_at_tp1_uneven_pp3_match_reference(tmp_path: Path, stage_model: str) -> None:
    # The tied model's logits come from the last stage's own output_layer copy of the embedding.
    m = MODELS[stage_model]
    full = mcore.forward_test_model(m)
    dst = _convert(tmp_path, m, full, (1, 3, 1, 3))

    logits = mcore.megatron_core_logits(dst, m, TOKENS)

    torch.testing.assert_close(logits, mcore.reference_logits(m, full, TOKENS), **LOGITS_TOLERANCE)


def test_reference_forward_is_sensitive_to_a_swapped_query_group(tmp_path: Path) -> None:
    """Guards the guard: a QKV slice in the wrong place must not survive the logits comparison."""
    m = MODELS["gqa_swiglu_rmsnorm_rope_untied"]
    full = mcore.forward_test_model(m)
    broken = dict(full)
    qkv = full["decoder.layers.0.self_attention.linear_qkv.weight"]
    rows = qkv.shape[0] // m.num_query_groups
    broken["decoder.layers.0.self_attention.linear_qkv.weight"] = torch.cat(
        [qkv[rows : 2 * rows], qkv[:rows], qkv[2 * rows :]]
    )
    dst = _convert(tmp_path, m, broken, DST_LAYOUTS["tp1pp1"])

    logits = mcore.megatron_core_logits(dst, m, TOKENS)

    assert not torch.allclose(logits, mcore.reference_logits(m, full, TOKENS), **LOGITS_TOLERANCE)


# --------------------------------------------------------------------------- key names


def test_transformer_engine_names_are_megatron_cores_own_local_to_te_key_map() -> None:
    """megatron-core's local spec declares how its norm keys are named in the TE spec (the
    ``sharded_state_dict_keys_map`` it applies for distributed checkpoints); pgconvert's TE-spec
    names must be exactly that mapping of its local names (TE itself cannot be installed on CPU)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from pgconvert.model.config import ModelConfig
    from pgconvert.model.grid import build_converter_process_groups
    from pgconvert.model.layout import ParallelLayout
    from pgconvert.model.provider import provide

    keys_map = get_gpt_layer_local_spec(normalization="LayerNorm").submodules.sharded_state_dict_keys_map
    assert keys_map == {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}

    def te_name(local: str) -> str:
        # The map applies under a layer's prefix: decoder.layers.{i}.input_layernorm.weight → …
        for old, new in keys_map.items():
            local = local.replace(f".{old}", f".{new}")
        return local

    config = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=8, ffn_hidden_size=96,
                         vocab_size=200, normalization="LayerNorm", add_bias_linear=True, qk_layernorm=True)
    groups = build_converter_process_groups(ParallelLayout())
    local = provide(config, groups).specs
    te = provide(config.replace(transformer_impl="transformer_engine"), groups).specs

    assert {s.canonical: te_name(s.local_name) for s in local} == {s.canonical: s.local_name for s in te}


# --------------------------------------------------------------------------- global state


def _module_globals(module: object) -> dict[str, object]:
    return {name: value for name, value in vars(module).items() if name.startswith("_") and name[1:2].isupper()}


def test_building_loading_and_forward_leave_megatron_core_and_torch_distributed_state_alone(tmp_path: Path) -> None:
    m = MODELS["mha_gelu_layernorm_bias_tied_learned"]
    full = mcore.forward_test_model(m)
    dst = _convert(tmp_path, m, full, (1, 3, 1, 3))
    before = {module.__name__: _module_globals(module) for module in (parallel_state, mcore_random)}
    env_before = {name: os.environ.get(name) for name in mcore.NVTE_BACKEND_VARIABLES}
    helpers_before = {name: getattr(mcore_utils, name) for name in mcore.GROUP_QUERY_REPLACEMENTS}
    current_device_before = torch.cuda.current_device

    mcore.megatron_core_logits(dst, m, TOKENS)

    after = {module.__name__: _module_globals(module) for module in (parallel_state, mcore_random)}
    for module_name, values in before.items():
        changed = sorted(name for name, value in values.items() if after[module_name].get(name) is not value)
        assert changed == [], f"{module_name} globals changed: {changed}"
    assert parallel_state.model_parallel_is_initialized() is False
    assert {name: os.environ.get(name) for name in mcore.NVTE_BACKEND_VARIABLES} == env_before
    assert {name: getattr(mcore_utils, name) for name in mcore.GROUP_QUERY_REPLACEMENTS} == helpers_before
    assert torch.cuda.current_device is current_device_before
    assert torch.distributed.is_initialized() is False


def test_a_fake_group_refuses_anything_but_rank_and_size() -> None:
    group = mcore.McoreFakeGroup("tp", 2, 1)

    assert (group.rank(), group.size()) == (1, 2)
    with pytest.raises(AttributeError, match="megatron-core asked for 'allreduce'"):
        group.allreduce  # noqa: B018


# --------------------------------------------------------------------------- checkpoints written by megatron-core


def _resave_from_megatron_core(root: Path) -> None:
    """Rewrite every rank's ``model`` as megatron-core's own ``state_dict()`` — what megatron-LM saves
    (``state_dict_for_save_checkpoint``): the local spec adds ``<linear>._extra_state`` (None) keys."""
    for rank in mcore.rank_files(root):
        payload = dict(rank.payload)
        payload["model"] = mcore.load_rank_into_gpt_model(rank).state_dict_for_save_checkpoint()
        torch.save(payload, rank.path)


def test_checkpoint_saved_by_megatron_core_local_spec_converts_and_loads(tmp_path: Path) -> None:
    m = MODELS["gqa_swiglu_rmsnorm_rope_untied"]
    full = mcore.forward_test_model(m)
    src = write_megatron_checkpoint(tmp_path / "src", m, full, **SOURCE_LAYOUT)
    _resave_from_megatron_core(src)
    assert any(k.endswith("._extra_state") for r in mcore.rank_files(src) for k in r.model)

    pgconvert.convert(src, tmp_path / "dst", dst_tp=1, dst_pp=1)

    logits = mcore.megatron_core_logits(tmp_path / "dst", m, TOKENS)
    torch.testing.assert_close(logits, mcore.reference_logits(m, full, TOKENS), **LOGITS_TOLERANCE)


def test_output_layer_extra_state_is_written_only_where_megatron_core_has_an_output_layer(tmp_path: Path) -> None:
    # A Transformer-Engine-spec source (its layers carry _extra_state, so it is read as TE) whose last
    # stage also holds megatron-core's output_layer._extra_state, as real TE-spec checkpoints do.
    m = dataclasses.replace(MODELS["gqa_swiglu_rmsnorm_rope_untied"], transformer_impl="transformer_engine")
    src = write_megatron_checkpoint(tmp_path / "src", m, make_full_model(m), tp=2, pp=1)
    for rank in mcore.rank_files(src):
        payload = dict(rank.payload)
        payload["model"] = dict(rank.model, **{"output_layer._extra_state": None})
        torch.save(payload, rank.path)

    pgconvert.convert(src, tmp_path / "dst", dst_tp=2, dst_pp=2)

    # megatron-core builds output_layer only with post_process (the last stage): see the tied test.
    ranks = mcore.rank_files(tmp_path / "dst")
    misplaced = sorted(
        f"{rank.path.parent.name}: {key}"
        for rank in ranks if not rank.layout.is_last_stage
        for key in rank.model if key.startswith("output_layer.")
    )
    assert misplaced == []
    # Same TP size as the source, so the state is carried, on the stage that has the module.
    assert all("output_layer._extra_state" in rank.model for rank in ranks if rank.layout.is_last_stage)
