"""Qwen3.5 text models (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``): Qwen3-Next's layers with the gated delta
net's input projections stored as four tensors.

The tiny models are ``support.qwen3_5_models``', built by transformers in the released configuration. Checked:
HF -> per-rank Megatron (TP2×PP2, ×EP2 for MoE) -> torch_dist -> HF is bit-exact with the same config.json, side
files and logits; megatron-core 0.16.1's own GPTModel (GatedDeltaNet, gated attention, a dense MLP or its MoE)
loads the TP1 rank file with ``strict=True`` and computes transformers' logits; the args record the model as
megatron-core reads it; the release's multi-token-prediction tensors are refused by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.hf_helpers import hf_logits, input_ids
from support.megatron_fixtures import load_for_test
from support.qwen3_5_models import TEXT, write_tiny_qwen3_5
from support.round_trips import assert_round_trip

import pgconvert
from pgconvert.errors import PgconvertError

KINDS = ("dense", "moe")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3_5")
    return {kind: write_tiny_qwen3_5(root / kind, kind) for kind in KINDS}


def _ids() -> torch.Tensor:
    return input_ids(TEXT["vocab_size"], seq=12)


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_through_tp2_pp2_and_torch_dist_is_bit_exact(tiny: dict[str, Path], tmp_path: Path,
                                                                  kind: str) -> None:
    experts = {"dst_ep": 2} if kind == "moe" else {}
    assert_round_trip(tiny[kind], tmp_path, _ids(), dst_tp=2, dst_pp=2, **experts)

    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == ["Qwen3_5MoeForCausalLM" if kind == "moe" else "Qwen3_5ForCausalLM"]
    assert written["rope_parameters"]["mrope_section"] == [11, 11, 10]


@pytest.mark.parametrize("kind", KINDS)
def test_the_args_record_the_model_as_megatron_core_reads_it(tiny: dict[str, Path], tmp_path: Path, kind: str) -> None:
    pgconvert.convert(tiny[kind], tmp_path / "mcore", dst_format="megatron", dst_tp=2)
    state = load_for_test(tmp_path / "mcore" / "iter_0000000" / "mp_rank_01" / "model_optim_rng.pt")
    args, model = state["args"], state["model"]

    assert (args.experimental_attention_variant, args.linear_attention_freq) == ("gated_delta_net", 4)
    assert (args.attention_output_gate, args.apply_layernorm_1p, args.rotary_percent) == (True, True, 0.25)
    assert getattr(args, "num_experts", None) == (4 if kind == "moe" else None)
    if kind == "moe":
        assert (args.moe_layer_freq, args.moe_router_pre_softmax, args.moe_shared_expert_gate) == (1, False, True)
    # TP rank 1's half of each in_proj segment: q and k (2 key heads of 8), v and z (4 value heads of 8), beta, alpha.
    assert model["decoder.layers.0.self_attention.in_proj.weight"].shape == ((16 + 16 + 32 + 32 + 4 + 4) // 2, 32)


def _megatron_core_logits(rank_dir: Path) -> torch.Tensor:
    from support.mcore_helpers import causal_attention_mask, rank_files
    from support.mcore_qwen3_next import build_qwen3_next_model, gated_delta_net_on_cpu

    rank, = rank_files(rank_dir)
    model = build_qwen3_next_model(rank.args, rank.layout)
    model.load_state_dict(rank.model, strict=True)
    ids = _ids()
    with gated_delta_net_on_cpu(), torch.no_grad():
        logits = model(ids, torch.arange(ids.shape[1])[None].expand_as(ids), causal_attention_mask(ids.shape[1]))
    return logits[..., :TEXT["vocab_size"]]


@pytest.mark.parametrize("kind", KINDS)
def test_megatron_cores_model_loads_the_rank_file_strictly_and_computes_transformers_logits(
        tiny: dict[str, Path], tmp_path: Path, kind: str) -> None:
    """megatron-core 0.16.1's GPTModel with its GatedDeltaNet (``in_proj`` = the four HF projections' rows in
    order), built from the written args alone, runs its CPU forward on the rank file."""
    pytest.importorskip("megatron.core")
    pgconvert.convert(tiny[kind], tmp_path / "mcore", dst_format="megatron", dst_expert_layout="sequential")

    # Two fp32 implementations of the chunked delta rule through eight layers: logits up to ~2 agree to ~2e-5.
    torch.testing.assert_close(_megatron_core_logits(tmp_path / "mcore"), hf_logits(tiny[kind], _ids()),
                               rtol=1e-5, atol=5e-5)


def test_megatron_cores_logits_move_when_in_proj_takes_beta_and_alpha_in_the_other_order(
        tiny: dict[str, Path], tmp_path: Path) -> None:
    """The knock-out: what a mapping that took ``in_proj_a`` for beta and ``in_proj_b`` for alpha would write (the
    two tensors, of one shape, exchanged in a copy) does not compute the model's logits."""
    pytest.importorskip("megatron.core")
    copy = Path(shutil.copytree(tiny["dense"], tmp_path / "src"))
    for shard in copy.glob("*.safetensors"):
        tensors = load_file(shard)
        for name in [name for name in tensors if name.endswith("linear_attn.in_proj_b.weight")]:
            other = name.replace("in_proj_b", "in_proj_a")
            tensors[name], tensors[other] = tensors[other], tensors[name]
        save_file(tensors, shard, metadata={"format": "pt"})
    pgconvert.convert(copy, tmp_path / "mcore", dst_format="megatron")

    assert not torch.allclose(_megatron_core_logits(tmp_path / "mcore"), hf_logits(tiny["dense"], _ids()),
                              rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_released_mtp_module_round_trips_bit_exact_through_tp2_pp2_and_torch_dist(tmp_path: Path,
                                                                                      kind: str) -> None:
    """The releases' ``mtp.*`` module (a gated-attention layer with the model's MLP or MoE block) is megatron-core's
    MTP layer, as Qwen3-Next's."""
    from support.qwen3_5_models import MODELS
    from support.qwen3_next_models import write_with_mtp_module

    source, _ = write_with_mtp_module(*MODELS[kind], 12, tmp_path / "made")
    layout = {"dst_tp": 2, "dst_pp": 2, "dst_ep": 2 if kind == "moe" else 1}

    assert_round_trip(source, tmp_path, _ids(), **layout)

    last = load_for_test(next((tmp_path / "megatron").glob("iter_*/mp_rank_00_001*/model_optim_rng.pt")))
    assert last["args"].mtp_num_layers == 1
    assert last["model"]["mtp.layers.0.eh_proj.weight"].shape == (TEXT["hidden_size"] // 2, 2 * TEXT["hidden_size"])


def test_stored_mtp_tensors_config_json_does_not_declare_are_refused_by_name(tiny: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny["dense"], tmp_path / "src"))
    shard = sorted(copy.glob("*.safetensors"))[0]
    tensors = load_file(shard)
    tensors["mtp.fc.weight"] = torch.zeros(32, 64)
    save_file(tensors, shard, metadata={"format": "pt"})
    index = copy / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        doc["weight_map"]["mtp.fc.weight"] = shard.name
        index.write_text(json.dumps(doc))

    with pytest.raises(PgconvertError, match=r"mtp_num_hidden_layers absent, but the checkpoint stores multi-token "
                                             r"prediction layer tensors of layers \[0\] .*\['mtp.fc.weight'\]"):
        pgconvert.convert(copy, tmp_path / "out", dst_format="megatron")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("kind", "written_as"), [("dense", "Qwen3_5ForCausalLM"), ("moe", "Qwen3NextForCausalLM")])
def test_a_megatron_checkpoint_without_its_hf_config_is_written_as_the_first_family_that_computes_it(
        tiny: dict[str, Path], tmp_path: Path, kind: str, written_as: str) -> None:
    """Without the carried config.json the family is inferred from the args: a dense model is Qwen3.5's; a MoE
    one (every layer MoE, renormalized top-k, gated shared expert) is also Qwen3-Next's, which comes first and
    computes the same."""
    experts = {"dst_ep": 2} if kind == "moe" else {}
    pgconvert.convert(tiny[kind], tmp_path / "mcore", dst_format="megatron", dst_tp=2, **experts)
    shutil.rmtree(tmp_path / "mcore" / "hf")

    pgconvert.convert(tmp_path / "mcore", tmp_path / "hf", dst_format="hf")

    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [written_as]
    torch.testing.assert_close(hf_logits(tmp_path / "hf", _ids()), hf_logits(tiny[kind], _ids()), rtol=1e-5, atol=1e-5)


def test_an_output_norm_weight_the_zero_centred_storage_rounds_is_named_and_refused_under_strict(
        tmp_path: Path) -> None:
    """bf16 ``linear_attn.norm`` weights below 0.5 lose low bits to ``w - 1`` (megatron-core's zero-centred out
    norm): the conversion names the first such tensor, --strict refuses it; weights in [0.5, 2] pass silently."""
    src = write_tiny_qwen3_5(tmp_path / "hf", "dense", dtype="bfloat16")
    for shard in src.glob("*.safetensors"):
        tensors = {name: tensor.to(torch.bfloat16) for name, tensor in load_file(shard).items()}
        for name in [name for name in tensors if name == "model.layers.1.linear_attn.norm.weight"]:
            tensors[name][0] = 0.0107421875  # exact in bf16; 1 - it is not
        save_file(tensors, shard, metadata={"format": "pt"})

    for workers in (1, 2):  # named also when a worker process reads the tensor
        report = pgconvert.convert(src, tmp_path / f"mcore{workers}", dst_format="megatron", workers=workers)
        named = [note for note in report.notices if "not kept exactly" in note]
        assert named == ["guess: model.layers.1.linear_attn.norm.weight: 1 of 8 values are not kept exactly by the "
                         "plain-as-zero-centred transform (computed in the tensor's dtype; other tensors of this row "
                         "may lose bits too)"], workers
    # verify compares in canonical form, where the rounded weight is equal on both sides: the stored value it
    # cannot hold is named as a difference, not hidden.
    pgconvert.convert(tmp_path / "mcore1", tmp_path / "back", dst_format="hf")
    verified = pgconvert.verify(src, tmp_path / "back")
    assert not verified.equal
    assert [(item.name, item.kind) for item in verified.differences] == [
        ("decoder.layers.1.self_attention.out_norm.weight", "inexact")]
    assert "A stores values its canonical form does not hold: model.layers.1.linear_attn.norm.weight: 1 of 8" in (
        verified.differences[0].message)
    with pytest.raises(PgconvertError, match="--strict: refusing to guess: model.layers.1.linear_attn.norm.weight"):
        pgconvert.convert(src, tmp_path / "strict", dst_format="megatron", strict=True)
    assert not (tmp_path / "strict").exists()
    clean = write_tiny_qwen3_5(tmp_path / "clean", "dense")
    assert not [note for note in pgconvert.convert(clean, tmp_path / "ok", dst_format="megatron").notices
                if "not kept exactly" in note]
    assert pgconvert.verify(clean, tmp_path / "ok").equal
