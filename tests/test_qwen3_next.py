"""Qwen3-Next (``Qwen3NextForCausalLM``): gated delta net and gated attention layers, a MoE with a gated shared
expert in every layer.

The tiny model is ``support.qwen3_next_models``'s, built by transformers in the released configuration. Checked:
HF -> per-rank Megatron (TP2×PP2×EP2, megatron-core's TE names) -> HF is bit-exact with transformers' logits;
the config.json written from the Megatron args alone is the source's; the TP2×EP2 rank files compute
transformers' logits through the independent forward of ``support.gated_delta_net_reference`` (and do not
when ``in_proj``'s segments are swapped in the rule); the args record the model as megatron-core reads it;
layouts the linear heads refuse are refused by name while planning.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from support.gated_delta_net_reference import qwen3_next_logits
from support.hf_helpers import assert_same_hf_tensors, hf_logits, input_ids, read_megatron_tp_ranks
from support.megatron_fixtures import load_for_test
from support.qwen3_next_models import TINY, write_tiny_qwen3_next, write_tiny_qwen3_next_with_mtp

import pgconvert
from pgconvert.cli import main
from pgconvert.model.kinds import gated_delta_net
from pgconvert.model.rules import Segmented, Window

ITERATION_DIR = "iter_0000000"
# Keys transformers writes that are not the model: its version, the saved tensors' dtype, training and generation
# switches (initialisation, router logits in the output, the cache); and the top-level rope_theta pgconvert
# writes beside rope_parameters for transformers 4.x.
UNCOMPARED = ("transformers_version", "dtype", "initializer_range", "output_router_logits", "use_cache", "rope_theta")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen3_next(tmp_path_factory.mktemp("qwen3_next") / "hf")


@pytest.fixture(scope="module")
def tp2pp2ep2(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3_next_tp2pp2ep2") / "mcore"
    pgconvert.convert(tiny, out, dst_format="megatron", dst_tp=2, dst_pp=2, dst_ep=2)
    return out


def _ids() -> torch.Tensor:
    return input_ids(TINY["vocab_size"], seq=12)


def test_round_trip_through_tp2_pp2_ep2_is_bit_exact_with_the_same_logits(tiny: Path, tp2pp2ep2: Path,
                                                                          tmp_path: Path) -> None:
    pgconvert.convert(tp2pp2ep2, tmp_path / "hf", dst_format="hf")

    assert_same_hf_tensors(tiny, tmp_path / "hf")
    torch.testing.assert_close(hf_logits(tmp_path / "hf", _ids()), hf_logits(tiny, _ids()), rtol=1e-5, atol=1e-5)


def test_config_json_written_from_the_args_alone_is_the_sources(tiny: Path, tp2pp2ep2: Path, tmp_path: Path) -> None:
    """Without the carried config.json the family is inferred from the args and config.json built from the model."""
    bare = tmp_path / "bare"
    shutil.copytree(tp2pp2ep2, bare)
    shutil.rmtree(bare / "hf")

    pgconvert.convert(bare, tmp_path / "hf", dst_format="hf")

    source = json.loads((tiny / "config.json").read_text())
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    differing = sorted(key for key in set(source) | set(written)
                       if key not in UNCOMPARED and source.get(key) != written.get(key))
    assert differing == []
    assert written["architectures"] == ["Qwen3NextForCausalLM"]
    assert written["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    assert_same_hf_tensors(tiny, tmp_path / "hf")
    torch.testing.assert_close(hf_logits(tmp_path / "hf", _ids()), hf_logits(tiny, _ids()), rtol=1e-5, atol=1e-5)


def test_the_args_record_the_model_as_megatron_core_reads_it(tp2pp2ep2: Path) -> None:
    state = load_for_test(tp2pp2ep2 / ITERATION_DIR / "mp_rank_01_001_001" / "model_optim_rng.pt")
    args, model = state["args"], state["model"]

    assert (args.experimental_attention_variant, args.linear_attention_freq) == ("gated_delta_net", 4)
    assert (args.linear_num_key_heads, args.linear_num_value_heads, args.linear_key_head_dim,
            args.linear_value_head_dim, args.linear_conv_kernel_dim) == (2, 4, 8, 8, 4)
    assert (args.attention_output_gate, args.apply_layernorm_1p, args.qk_layernorm) == (True, True, True)
    assert (args.rotary_percent, args.rotary_base, args.moe_shared_expert_gate) == (0.25, 10000000, True)
    assert (args.transformer_impl, args.moe_grouped_gemm, args.num_experts) == ("transformer_engine", True, 4)
    # Stage 1 holds layers 4..7 as 0..3: layer 0 (global 4) a gated delta net, TP rank 1's halves of each segment.
    # q and k: 2 key heads of 8; v and z: 4 value heads of 8; beta and alpha: one per value head.
    assert model["decoder.layers.0.self_attention.in_proj.weight"].shape == ((16 + 16 + 32 + 32 + 4 + 4) // 2, 32)
    assert model["decoder.layers.0.self_attention.conv1d.weight"].shape == ((16 + 16 + 32) // 2, 1, 4)
    assert model["decoder.layers.0.self_attention.in_proj.layer_norm_weight"].shape == (32,)
    # Layer 3 (global 7) gated attention: 8 query heads, their 8 gates and a key and a value head per rank.
    assert model["decoder.layers.3.self_attention.linear_qkv.weight"].shape == ((8 + 8 + 2) * 8, 32)


def test_the_rank_files_compute_transformers_logits(tiny: Path, tmp_path: Path) -> None:
    pgconvert.convert(tiny, tmp_path / "mcore", dst_format="megatron", dst_tp=2, dst_ep=2)
    config = json.loads((tiny / "config.json").read_text())

    reference = qwen3_next_logits(read_megatron_tp_ranks(tmp_path / "mcore"), config, _ids())

    torch.testing.assert_close(reference.to(torch.float32), hf_logits(tiny, _ids()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("swap", [(0, 1), (2, 3), (4, 5)], ids=["query-key", "value-z", "beta-alpha"])
def test_a_rule_that_swaps_two_in_proj_segments_gives_other_logits(tiny: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   swap: tuple[int, int]) -> None:
    """The knock-out: in_proj cut with two equal-sized segments' pieces swapped (every shape unchanged)."""
    first, second = swap

    class Swapped(Segmented):
        def piece_windows(self, *args: Any, **kwargs: Any) -> tuple[Window, ...]:
            windows = list(super().piece_windows(*args, **kwargs))
            if self.names == gated_delta_net.IN_PROJ_SEGMENTS:
                windows[first], windows[second] = windows[second], windows[first]
            return tuple(windows)

    monkeypatch.setattr(gated_delta_net, "Segmented", Swapped)
    pgconvert.convert(tiny, tmp_path / "mcore", dst_format="megatron", dst_tp=2, dst_ep=2)
    config = json.loads((tiny / "config.json").read_text())

    reference = qwen3_next_logits(read_megatron_tp_ranks(tmp_path / "mcore"), config, _ids())

    assert not torch.allclose(reference.to(torch.float32), hf_logits(tiny, _ids()), rtol=1e-2, atol=1e-2)


def test_a_tp_the_linear_heads_cannot_take_is_refused_while_planning(tmp_path: Path) -> None:
    """Four key-value heads but two linear key heads: TP4 divides the attention, not the gated delta nets."""
    source = write_tiny_qwen3_next(tmp_path / "hf", num_key_value_heads=4)

    result = CliRunner().invoke(main, ["--dst-format", "megatron", "--dst-tp", "4", str(source), str(tmp_path / "out")])

    assert result.exit_code == 2, result.output
    assert "--dst-tp 4: linear_num_key_heads=2 is not divisible by 4" in result.output
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- megatron-core's own model


@pytest.fixture(scope="module")
def tp1(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TP1 rank files with SequentialMLP experts (megatron-core's local MoE module, as the stand-in model holds)."""
    out = tmp_path_factory.mktemp("qwen3_next_tp1") / "mcore"
    pgconvert.convert(tiny, out, dst_format="megatron", dst_expert_layout="sequential")
    return out


def _megatron_core_logits(rank: Any, state: dict[str, Any]) -> torch.Tensor:
    from support.mcore_helpers import causal_attention_mask
    from support.mcore_qwen3_next import build_qwen3_next_model, gated_delta_net_on_cpu

    model = build_qwen3_next_model(rank.args, rank.layout)
    model.load_state_dict(state, strict=True)
    ids = _ids()
    with gated_delta_net_on_cpu(), torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1])[None].expand_as(ids), causal_attention_mask(ids.shape[1]))
    return logits[..., :TINY["vocab_size"]]


def test_megatron_cores_model_loads_the_rank_file_strictly_and_computes_transformers_logits(tiny: Path,
                                                                                             tp1: Path) -> None:
    """megatron-core 0.16.1's GPTModel with its GatedDeltaNet and gated SelfAttention, built from the written
    args alone (``support.mcore_qwen3_next``), loads the rank file with ``strict=True`` and runs its CPU forward."""
    pytest.importorskip("megatron.core")
    from support.mcore_helpers import rank_files

    rank, = rank_files(tp1)

    logits = _megatron_core_logits(rank, rank.model)

    torch.testing.assert_close(logits, hf_logits(tiny, _ids()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("knockout", ["beta-alpha rows swapped", "out_norm as HF stores it"])
def test_megatron_cores_logits_move_with_a_wrong_gated_delta_net_tensor(tiny: Path, tp1: Path, knockout: str) -> None:
    pytest.importorskip("megatron.core")
    from support.mcore_helpers import rank_files

    rank, = rank_files(tp1)
    state = dict(rank.model)
    layer = "decoder.layers.0.self_attention."
    if knockout == "beta-alpha rows swapped":
        rows = state[layer + "in_proj.weight"]
        heads = TINY["linear_num_value_heads"]
        state[layer + "in_proj.weight"] = torch.cat([rows[:-2 * heads], rows[-heads:], rows[-2 * heads:-heads]])
    else:
        state[layer + "out_norm.weight"] = state[layer + "out_norm.weight"] + 1

    logits = _megatron_core_logits(rank, state)

    assert not torch.allclose(logits, hf_logits(tiny, _ids()), rtol=1e-3, atol=1e-3)


# --------------------------------------------------------------------------- torch_dist


@pytest.mark.parametrize("tp", [1, 2])
def test_torch_dist_keys_shapes_and_chunks_are_what_megatron_cores_model_declares(tiny: Path, tmp_path: Path,
                                                                                 tp: int) -> None:
    """Every layer keyed by its global index (``linear_attention_freq`` > 1), GatedDeltaNet's ``in_proj`` as the keys
    ``.query .key .value .z .beta .alpha`` and ``conv1d`` as ``.query .key .value``, each a segment's global rows:
    the keys, global shapes and dtypes of megatron-core's own ``sharded_state_dict()`` over the TP ranks (main
    replicas), and at TP1 its chunks."""
    pytest.importorskip("megatron.core")
    from support.checkpoint_compare import read_common
    from support.mcore_gpt_models import read_layout, sharded_layout
    from support.mcore_helpers import RankLayout
    from support.mcore_qwen3_next import build_qwen3_next_model, qwen3_next_sharded_state_dict
    from support.torch_dist_forms import FOR_MCORE_016

    pgconvert.convert(tiny, tmp_path / "dist", dst_format="torch_dist", dst_tp=tp, **FOR_MCORE_016)
    args = read_common(tmp_path / "dist" / ITERATION_DIR)["args"]
    expected: dict[str, Any] = {}
    objects: set[str] = set()
    for tp_rank in range(tp):
        model = build_qwen3_next_model(args, RankLayout(tp, 1, tp_rank, 0))
        tensors, rank_objects = sharded_layout(qwen3_next_sharded_state_dict(model))
        objects |= set(rank_objects)
        for key, (shape, dtype, chunks) in tensors.items():
            expected.setdefault(key, (shape, dtype, []))[2].extend(chunks)

    stored, stored_objects = read_layout(tmp_path / "dist" / ITERATION_DIR)

    assert "decoder.layers.4.self_attention.in_proj.weight.alpha" in expected
    assert sorted(stored) == sorted(expected) and sorted(stored_objects) == sorted(objects)
    for key, (shape, dtype, chunks) in expected.items():
        # pgconvert writes each tensor as it chooses to cut it (at TP1 as megatron-core does); DCP reads any cut.
        assert stored[key][:2] == (shape, dtype), key
        assert tp > 1 or stored[key][2] == sorted(chunks), key


def test_hf_to_torch_dist_to_per_rank_to_hf_is_bit_exact(tiny: Path, tmp_path: Path) -> None:
    pgconvert.convert(tiny, tmp_path / "dist", dst_format="torch_dist", dst_tp=2, dst_ep=2)
    pgconvert.convert(tmp_path / "dist", tmp_path / "ranks", dst_format="megatron", dst_tp=1, dst_pp=2)
    pgconvert.convert(tmp_path / "ranks", tmp_path / "dist2", dst_format="torch_dist", dst_tp=2, dst_pp=2)
    pgconvert.convert(tmp_path / "dist2", tmp_path / "hf", dst_format="hf")

    assert_same_hf_tensors(tiny, tmp_path / "hf")


@pytest.fixture(scope="module")
def loaded_by_megatron_core(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One megatron-core job (two gloo ranks) loads pgconvert's torch_dist outputs: recorded at TP2×EP2 and loaded at
    TP1 (one replica each) and at TP2, recorded at TP1 and loaded at TP2."""
    from support.mcore_torch_dist_job import run_job
    from support.torch_dist_forms import FOR_MCORE_016

    root = tmp_path_factory.mktemp("qwen3_next_loads")
    cases = []
    for name, recorded, tp in (("tp2ep2_as_tp1", dict(dst_tp=2, dst_ep=2), 1), ("tp2ep2_as_tp2", dict(dst_tp=2, dst_ep=2), 2),
                               ("tp1_as_tp2", dict(dst_tp=1), 2)):
        pgconvert.convert(tiny, root / name, dst_format="torch_dist", **recorded, **FOR_MCORE_016)
        cases.append({"name": name, "ckpt": str(root / name / ITERATION_DIR), "tp": tp})
    run_job({"action": "qwen3_next_load", "world": 2, "cases": cases}, root / "job")
    return root / "job"


@pytest.mark.parametrize(("name", "tp"), [("tp2ep2_as_tp1", 1), ("tp2ep2_as_tp2", 2), ("tp1_as_tp2", 2)])
def test_megatron_core_loads_pgconvert_torch_dist_strictly_with_every_value_in_place(
        tiny: Path, tmp_path: Path, loaded_by_megatron_core: Path, name: str, tp: int) -> None:
    """What megatron-core's model holds after ``dist_checkpointing.load`` is the rank files pgconvert writes for that
    TP (SequentialMLP experts, as the model holds them), which the tests above show compute transformers' logits."""
    from support.mcore_helpers import rank_files

    pgconvert.convert(tiny, tmp_path / "ranks", dst_format="megatron", dst_tp=tp, dst_expert_layout="sequential")
    for rank in rank_files(tmp_path / "ranks"):
        loaded = torch.load(loaded_by_megatron_core / f"{name}_rank_{rank.layout.tp_rank}.pt", weights_only=True)
        tensors = {key: value for key, value in rank.model.items() if isinstance(value, torch.Tensor)}
        assert sorted(loaded) == sorted(tensors), rank.path
        for key, value in tensors.items():
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), (rank.path, key)


def test_a_checkpoint_megatron_cores_model_saved_at_tp2_reads_back_bit_exact(tiny: Path, tmp_path: Path) -> None:
    from support.mcore_torch_dist_job import run_job

    pgconvert.convert(tiny, tmp_path / "ranks", dst_format="megatron", dst_tp=2, dst_expert_layout="sequential")
    saved = tmp_path / "mcore"
    (saved / "iter_0000100").mkdir(parents=True)
    (saved / "latest_checkpointed_iteration.txt").write_text("100")
    run_job({"action": "qwen3_next_save", "world": 2, "source": str(tmp_path / "ranks"),
             "ckpt": str(saved / "iter_0000100")}, tmp_path / "job")

    report = pgconvert.convert(saved, tmp_path / "hf", dst_format="hf")

    assert report.src_layout == "tp=2,pp=1"
    assert_same_hf_tensors(tiny, tmp_path / "hf")


@pytest.mark.parametrize(("key", "value", "message"), [
    ("layer_types", ["linear_attention"] * 3, "layer_types=.*expected 'linear_attention' or 'full_attention' for each "
                                              "of the 8 layers"),
    ("linear_num_value_heads", 3, "linear_num_key_heads=2: linear_num_value_heads=3 must be a multiple of it"),
    ("full_attention_interval", 0, None),  # layer_types given: transformers ignores the interval, and so does pgconvert
])
def test_a_config_json_that_describes_no_model_is_refused_by_name(tiny: Path, tmp_path: Path, key: str, value: object,
                                                                  message: str | None) -> None:
    source = tmp_path / "hf"
    shutil.copytree(tiny, source)
    doc = json.loads((source / "config.json").read_text())
    doc[key] = value
    (source / "config.json").write_text(json.dumps(doc))

    result = CliRunner().invoke(main, ["--dst-format", "megatron", str(source), str(tmp_path / "out")])

    if message is None:
        assert result.exit_code == 0, result.output
        return
    assert result.exit_code in (1, 2) and isinstance(result.exception, SystemExit), result.output
    assert re.search(message, result.output), result.output
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- the released MTP module


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny model with the releases' ``mtp.*`` module, the same model with its MTP layer as a decoder layer)."""
    return write_tiny_qwen3_next_with_mtp(tmp_path_factory.mktemp("qwen3_next_mtp"))


def test_the_released_mtp_module_round_trips_bit_exact_through_tp2_pp2_ep2_and_torch_dist(
        with_mtp: tuple[Path, Path], tmp_path: Path) -> None:
    source, _ = with_mtp
    report = pgconvert.convert(source, tmp_path / "mcore", dst_format="megatron", dst_tp=2, dst_pp=2, dst_ep=2,
                               strict=True)
    pgconvert.convert(tmp_path / "mcore", tmp_path / "dist", dst_format="torch_dist")
    pgconvert.convert(tmp_path / "dist", tmp_path / "hf", dst_format="hf")

    assert_same_hf_tensors(source, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    torch.testing.assert_close(hf_logits(tmp_path / "hf", _ids()), hf_logits(source, _ids()), rtol=1e-5, atol=1e-5)
    assert not any("multi-token" in notice for notice in report.notices), report.notices


def test_the_mtp_module_is_megatron_cores_mtp_layer_on_the_last_stage(with_mtp: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    """``mtp.fc`` is eh_proj (split by rows), the pre-fc norms enorm and hnorm, ``mtp.norm`` the final norm, and the
    layer megatron-core's transformer layer with TE's fused names; the count key is written from the args alone."""
    from safetensors.torch import load_file

    source, _ = with_mtp
    pgconvert.convert(source, tmp_path / "mcore", dst_format="megatron", dst_tp=2, dst_pp=2, dst_ep=2)
    hf = load_file(source / "model.safetensors")
    first = load_for_test(tmp_path / "mcore" / ITERATION_DIR / "mp_rank_00_000_000" / "model_optim_rng.pt")
    last = [load_for_test(tmp_path / "mcore" / ITERATION_DIR / f"mp_rank_0{tp}_001_000" / "model_optim_rng.pt")
            for tp in (0, 1)]

    assert not any(name.startswith("mtp.") for name in first["model"])
    assert last[0]["args"].mtp_num_layers == 1
    for tp, state in enumerate(last):
        model = state["model"]
        assert torch.equal(model["mtp.layers.0.eh_proj.weight"], hf["mtp.fc.weight"].chunk(2)[tp])
        assert torch.equal(model["mtp.layers.0.enorm.weight"], hf["mtp.pre_fc_norm_embedding.weight"])
        assert torch.equal(model["mtp.layers.0.hnorm.weight"], hf["mtp.pre_fc_norm_hidden.weight"])
        assert torch.equal(model["mtp.layers.0.final_layernorm.weight"], hf["mtp.norm.weight"])
        assert torch.equal(model["mtp.layers.0.transformer_layer.self_attention.linear_qkv.layer_norm_weight"],
                           hf["mtp.layers.0.input_layernorm.weight"])
    bare = tmp_path / "bare"
    shutil.copytree(tmp_path / "mcore", bare)
    shutil.rmtree(bare / "hf")
    pgconvert.convert(bare, tmp_path / "hf", dst_format="hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["mtp_num_hidden_layers"], written["mtp_use_dedicated_embeddings"]) == (1, False)
    assert_same_hf_tensors(source, tmp_path / "hf")


def _zero_centred_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


def reference_mtp_layer(source: Path, as_layer: Path, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next's MTP module (vLLM's Qwen3NextMultiTokenPredictor) written plainly on the source's HF tensors: the
    next token's embedding and the hidden state, each normed (``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``,
    Qwen3NextRMSNorm's ``1 + w``), concatenated in that order, projected by ``fc``, through transformers' own
    Qwen3NextDecoderLayer holding the ``mtp.layers.0`` tensors (the ``as_layer`` model's last layer), normed by
    ``mtp.norm``. The last position's next token is id 0 (megatron-core's roll_tensor)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(as_layer, dtype=torch.float32, attn_implementation="eager").eval()
    tensors, eps = load_file(source / "model.safetensors"), model.config.rms_norm_eps
    following = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    x = torch.cat([_zero_centred_rms(tensors["model.embed_tokens.weight"][following],
                                     tensors["mtp.pre_fc_norm_embedding.weight"], eps),
                   _zero_centred_rms(hidden, tensors["mtp.pre_fc_norm_hidden.weight"], eps)], dim=-1)
    x = x @ tensors["mtp.fc.weight"].T
    seq = ids.shape[1]
    positions = torch.arange(seq)[None].expand_as(ids)
    mask = torch.full((seq, seq), float("-inf")).triu(1).expand(ids.shape[0], 1, seq, seq)
    with torch.no_grad():
        x = model.model.layers[TINY["num_hidden_layers"]](x, position_embeddings=model.model.rotary_emb(x, positions),
                                                          attention_mask=mask, position_ids=positions)
    return _zero_centred_rms(x, tensors["mtp.norm.weight"], eps)


@pytest.fixture(scope="module")
def mtp_tp1(with_mtp: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3_next_mtp_tp1") / "mcore"
    pgconvert.convert(with_mtp[0], out, dst_format="megatron", dst_expert_layout="sequential")
    return out


@pytest.mark.parametrize("knockout", [None, "enorm and hnorm swapped", "eh_proj halves swapped"])
def test_megatron_cores_mtp_layer_computes_qwens_mtp_module(with_mtp: tuple[Path, Path], mtp_tp1: Path,
                                                            knockout: str | None) -> None:
    """megatron-core's GPTModel with its MTP block, built from the written args alone, loads the rank file with
    ``strict=True``; its MultiTokenPredictionLayer computes the plain reference on the HF tensors, and does not
    when the two norms or the halves of eh_proj's input are exchanged."""
    pytest.importorskip("megatron.core")
    from support.mcore_helpers import rank_files
    from support.mcore_qwen3_next import build_qwen3_next_model, mtp_layer_output

    rank, = rank_files(mtp_tp1)
    state = dict(rank.model)
    if knockout == "enorm and hnorm swapped":
        state["mtp.layers.0.enorm.weight"], state["mtp.layers.0.hnorm.weight"] = (
            state["mtp.layers.0.hnorm.weight"], state["mtp.layers.0.enorm.weight"])
    elif knockout == "eh_proj halves swapped":
        state["mtp.layers.0.eh_proj.weight"] = state["mtp.layers.0.eh_proj.weight"].roll(TINY["hidden_size"], dims=1)
    model = build_qwen3_next_model(rank.args, rank.layout)
    model.load_state_dict(state, strict=True)
    ids = _ids()
    hidden = torch.randn(*ids.shape, TINY["hidden_size"], generator=torch.Generator().manual_seed(3))

    actual = mtp_layer_output(model, ids, hidden)

    expected = reference_mtp_layer(*with_mtp, ids, hidden)
    if knockout is None:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:
        assert not torch.allclose(actual, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("change, message", [
    ({"mtp_use_dedicated_embeddings": True}, "mtp_use_dedicated_embeddings=True: an embedding of the MTP module's own"),
    ({"mtp_num_hidden_layers": 2}, "mtp_num_hidden_layers=2: Qwen3NextForCausalLM's MTP module shares one fc"),
    ({"mtp_num_hidden_layers": 0}, "mtp_num_hidden_layers=0, but the checkpoint stores multi-token prediction layer "
                                   "tensors of layers [0]"),
    ({"layer_types": ["linear_attention"] * 8}, "with a gated delta net as the last layer"),
])
def test_an_mtp_module_megatron_core_cannot_hold_is_refused_by_name(with_mtp: tuple[Path, Path], tmp_path: Path,
                                                                    change: dict[str, object], message: str) -> None:
    source = Path(shutil.copytree(with_mtp[0], tmp_path / "hf"))
    doc = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**doc, **change}))

    result = CliRunner().invoke(main, ["--dst-format", "megatron", str(source), str(tmp_path / "out")])

    assert result.exit_code != 0, result.output
    assert message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "out").exists()


def test_a_declared_mtp_module_that_is_not_stored_is_named_and_refused_under_strict(tiny: Path, tmp_path: Path) -> None:
    source = Path(shutil.copytree(tiny, tmp_path / "hf"))
    doc = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**doc, "mtp_num_hidden_layers": 1}))

    report = pgconvert.convert(source, tmp_path / "out", dst_format="megatron")
    strict = CliRunner().invoke(main, ["--dst-format", "megatron", "--strict", str(source), str(tmp_path / "strict")])

    assert any("mtp_num_hidden_layers=1, but no tensor of a multi-token prediction layer" in notice
               for notice in report.notices), report.notices
    assert strict.exit_code != 0 and not (tmp_path / "strict").exists()