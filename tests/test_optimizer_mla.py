"""DeepSeek-V3-class optimizer state (multi-latent attention, MoE, a multi-token-prediction layer) through
TP, PP and EP changes, on state megatron-core 0.16.1 laid out.

A tiny HF DeepSeek-V3 with an MTP layer (``test_mtp.with_mtp``) is written per rank by pgconvert; then
``mcore_optimizer_layout.py`` (a subprocess) builds megatron-core's own GPTModel on every rank (MLA local spec, MoE,
``mtp_block_spec`` on the last stage), loads the rank's weights strictly, and records its ``_get_param_groups``
positions and its ``_ParamAndGradBuffer`` offsets after two AdamW steps (plain and distributed forms).
"""

from __future__ import annotations

import re
from pathlib import Path
from unittest import mock

import pytest
from click.testing import CliRunner
from support.megatron_fixtures import assert_same_tree, load_for_test
from support.optimizer_layouts import assert_megatron_cores_layout, assert_same_files, lay_out, per_rank_files
from support.checkpoint_compare import read_common

import pgconvert
from pgconvert.cli import main
from pgconvert.formats import LoadOptions
from pgconvert.loaders.megatron import MegatronSource
from pgconvert.formats.megatron import safe_torch_load
from pgconvert.optimizer.flat import flat_buffers
from pgconvert.optimizer.order import OptimizerRules, chained_slots

pytest.importorskip("megatron.core", reason="megatron-core lays out the reference optimizer state")

MTP = "mtp.layers.0."
MTP_ATTENTION = MTP + "transformer_layer.self_attention."
# name -> (DeepSeek case, tp, pp, ep, apply_wd_to_qk_layernorm)
CASES = {"tp2ep2": ("v3", 2, 1, 2, False), "pp2": ("v3", 1, 2, 1, False), "qkwd": ("v3", 1, 1, 1, True),
         "no_q_lora": ("v3_no_q_lora", 2, 2, 1, False)}


def _hf(root: Path, case: str) -> Path:
    import support.deepseek_helpers as deepseek_helpers
    from support.mtp_models import with_mtp

    with mock.patch.dict(deepseek_helpers.CASES, {"v3": deepseek_helpers.CASES[case]}):
        return with_mtp("v3", root / f"hf_{case}")


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per case, megatron-core's plain and distributed optimizer checkpoints."""
    root = tmp_path_factory.mktemp("mla")
    sources = {case: _hf(root, case) for case in {spec[0] for spec in CASES.values()}}
    made, jobs = {}, []
    for name, (case, tp, pp, ep, qkwd) in CASES.items():
        weights = root / f"{name}_weights"
        pgconvert.convert(sources[case], weights, dst_format="megatron", dst_tp=tp, dst_pp=pp, dst_ep=ep)
        made[name] = (root / f"{name}_plain", root / f"{name}_dist")
        jobs += ["mla", str(weights), *map(str, made[name]), "qkwd" if qkwd else "-"]
    lay_out(jobs)
    return made


def _convert(src: Path, dst: Path, *flags: str) -> None:
    result = CliRunner().invoke(main, ["convert", str(src), str(dst), "-q", "--strict", *flags], prog_name="pgconvert")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("name", sorted(CASES))
def test_positions_and_flat_offsets_are_megatron_cores_on_every_rank(made: dict[str, tuple[Path, Path]],
                                                                    name: str) -> None:
    plain, dist = made[name]
    derived = assert_megatron_cores_layout(plain, dist, CASES[name][1] * CASES[name][2] * CASES[name][3])
    last = derived[max(derived, key=lambda coord: (coord.pp, coord.tp, coord.ep))][0]  # the MTP stage's dense optimizer
    assert MTP + "eh_proj.weight" in last[0] and MTP_ATTENTION + "kv_layernorm.weight" in last[1]
    q_norm = MTP_ATTENTION + "q_layernorm.weight"
    # apply_wd_to_qk_layernorm keeps weight decay on q_layernorm, not on kv_layernorm ("kv_layernorm." is
    # not "k_layernorm.").
    assert (q_norm in last[0]) == (name == "qkwd") and (q_norm in last[1]) == (name in ("tp2ep2", "pp2"))


@pytest.mark.parametrize("form", [0, 1], ids=["plain", "distributed"])
def test_tp2_ep2_to_one_rank_and_back_is_bit_exact(made: dict[str, tuple[Path, Path]], form: int,
                                                   tmp_path: Path) -> None:
    source = made["tp2ep2"][form]
    _convert(source, tmp_path / "one", "--dst-tp", "1", "--dst-ep", "1")
    (one,) = [state for key, state in per_rank_files(tmp_path / "one").items() if key.endswith("model_optim_rng.pt")]
    assert isinstance(one["optimizer"], dict)  # EP 1: one optimizer, the experts among the dense parameters
    _convert(tmp_path / "one", tmp_path / "back", "--dst-tp", "2", "--dst-ep", "2")
    assert_same_files(source, tmp_path / "back")


@pytest.mark.parametrize("form", [0, 1], ids=["plain", "distributed"])
def test_pp2_reaches_megatron_cores_own_tp2_ep2_state_and_back(made: dict[str, tuple[Path, Path]], form: int,
                                                              tmp_path: Path) -> None:
    # The gradients and AdamW are elementwise functions of each parameter, so megatron-core's own TP2·EP2 state
    # is the PP2 state resharded: pgconvert's conversion must give it bit for bit.
    _convert(made["pp2"][form], tmp_path / "tp2ep2", "--dst-tp", "2", "--dst-pp", "1", "--dst-ep", "2")
    assert_same_files(made["tp2ep2"][form], tmp_path / "tp2ep2")
    _convert(tmp_path / "tp2ep2", tmp_path / "back", "--dst-tp", "1", "--dst-pp", "2", "--dst-ep", "1")
    assert_same_files(made["pp2"][form], tmp_path / "back")


def test_distributed_vpp2_with_mtp_in_the_last_chunk_and_back_is_bit_exact(made: dict[str, tuple[Path, Path]],
                                                                             tmp_path: Path) -> None:
    source = made["tp2ep2"][1]
    _convert(source, tmp_path / "vpp", "--dst-tp", "1", "--dst-pp", "2", "--dst-vpp", "2", "--dst-ep", "1")
    vpp = MegatronSource(next(tmp_path.glob("vpp/iter_*")), 2, False, LoadOptions())
    last = max(vpp.files, key=lambda coord: coord.pp)
    state = safe_torch_load(vpp.files[last])
    buffers = flat_buffers(vpp.config, vpp.layout, last, OptimizerRules(), vpp.vocab_rows, state["args"])
    chunks = [{item.slot.spec.local_name for item in placed} for placed, _ in buffers]
    assert len(chunks) == 2 and MTP + "eh_proj.weight" in chunks[1] and not any(n.startswith(MTP) for n in chunks[0])
    assert "embedding.word_embeddings.weight" in chunks[1]  # the MTP chunk's embedding copy
    _convert(tmp_path / "vpp", tmp_path / "back", "--dst-tp", "2", "--dst-pp", "1", "--dst-vpp", "1", "--dst-ep", "2")
    assert_same_files(source, tmp_path / "back", ("optimizer", "iteration"))  # --dst-vpp 1 names the chunk model0


@pytest.mark.parametrize("name", ["qkwd", "no_q_lora"])
def test_qk_weight_decay_and_no_q_lora_round_trips_are_bit_exact(made: dict[str, tuple[Path, Path]], name: str,
                                                                 tmp_path: Path) -> None:
    source = made[name][0]
    flags = ("--dst-tp", "2", "--dst-ep", "2") if name == "qkwd" else \
        ("--dst-tp", "1", "--dst-pp", "1", "--dst-ep", "2")
    _convert(source, tmp_path / "other", *flags)
    _convert(tmp_path / "other", tmp_path / "back", "--dst-tp", str(CASES[name][1]), "--dst-pp", str(CASES[name][2]),
             "--dst-ep", str(CASES[name][3]))
    assert_same_files(source, tmp_path / "back")


def test_distributed_through_torch_dist_fully_reshardable_and_back_is_bit_exact(made: dict[str, tuple[Path, Path]],
                                                                                tmp_path: Path) -> None:
    source = made["tp2ep2"][1]
    _convert(source, tmp_path / "td", "--dst-format", "torch_dist", "--dst-tp", "1", "--dst-ep", "1")
    (iteration_dir,) = tmp_path.glob("td/iter_*")
    assert read_common(iteration_dir)["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    _convert(tmp_path / "td", tmp_path / "back", "--dst-format", "megatron", "--dst-tp", "2", "--dst-ep", "2")
    before, after = per_rank_files(source), per_rank_files(tmp_path / "back")
    assert set(before) == set(after)
    for name, content in before.items():
        if name.endswith("distrib_optim.pt"):
            assert_same_tree(content, after[name], name)
            continue
        assert_same_tree(content["model"], after[name]["model"], f"{name}.model")
        assert_same_tree([entry["optimizer"]["param_groups"] for entry in content["optimizer"]],
                         [entry["optimizer"]["param_groups"] for entry in after[name]["optimizer"]], name)


def test_plain_state_through_te_naming_and_back_is_bit_exact(made: dict[str, tuple[Path, Path]],
                                                             tmp_path: Path) -> None:
    # The TE spec fuses q_layernorm / kv_layernorm into the up projections (layer_norm_weight before weight) and
    # keeps the down projections whole on every TP rank (TELinear, duplicated); TP2: test_tp2_spec_change_and_back.
    source = made["pp2"][0]
    _convert(source, tmp_path / "te", "--dst-transformer-impl", "transformer_engine")
    te = MegatronSource(next(tmp_path.glob("te/iter_*")), 2, False, LoadOptions())
    coord = max(te.files, key=lambda coord: coord.pp)
    (groups,) = chained_slots(te.config, te.layout, coord, padded_vocab_size=te.vocab_rows)
    names = [slot.spec.local_name for slot in groups[1]]
    assert names.index(MTP_ATTENTION + "linear_q_up_proj.layer_norm_weight") \
        < names.index(MTP_ATTENTION + "linear_kv_up_proj.layer_norm_weight")
    state = safe_torch_load(te.files[coord])
    by_name = {slot.spec.local_name: slot.position for group in groups for slot in group}
    norm = MTP_ATTENTION + "linear_kv_up_proj.layer_norm_weight"
    assert tuple(state["optimizer"]["state"][by_name[norm]]["exp_avg"].shape) == tuple(state["model"][norm].shape) \
        == (16,)
    _convert(tmp_path / "te", tmp_path / "back", "--dst-transformer-impl", "local")
    assert_same_files(source, tmp_path / "back")


def test_a_spec_change_that_moves_the_q_norm_between_weight_decay_groups_says_so(
        made: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    # apply_wd_to_qk_layernorm: megatron-core decays "q_layernorm." by name, so the local spec's q-LoRA norm is
    # decayed and the TE spec's linear_q_up_proj.layer_norm_weight is not: carried, and said.
    source = made["qkwd"][0]
    result = CliRunner().invoke(main, ["convert", str(source), str(tmp_path / "te"), "--dst-transformer-impl",
                                       "transformer_engine"], prog_name="pgconvert")
    assert result.exit_code == 0, result.output
    assert "from local to transformer_engine its state moves to the no-weight-decay group" in result.output
    (path,) = tmp_path.glob("te/iter_*/mp_rank_00/model_optim_rng.pt")
    groups = [group["params"] for group in load_for_test(path)["optimizer"]["param_groups"]]
    te = MegatronSource(path.parents[1], 2, False, LoadOptions())
    (slots,) = chained_slots(te.config, te.layout, next(iter(te.files)), OptimizerRules(True), te.vocab_rows)
    where = {slot.spec.local_name: (slot.group, slot.position) for group in slots for slot in group}
    group, position = where[MTP_ATTENTION + "linear_q_up_proj.layer_norm_weight"]
    assert group == 1 and position in groups[1]
    plain = CliRunner().invoke(main, ["convert", str(made["pp2"][0]), str(tmp_path / "te2"), "--dst-transformer-impl",
                                      "transformer_engine"], prog_name="pgconvert")
    assert plain.exit_code == 0 and "weight-decay group" not in plain.output, plain.output


def test_an_unknown_parameter_of_an_mtp_layer_is_still_refused_by_name() -> None:
    from pgconvert.optimizer.order import UnsupportedOptimizerError, _order_key
    from pgconvert.model.provider import REPLICATED, TensorSpec

    spec = TensorSpec(MTP + "transformer_layer.self_attention.linear_bogus.weight", "x", (1,), (1,), REPLICATED, 0, 1)
    name = re.escape(spec.local_name)
    with pytest.raises(UnsupportedOptimizerError, match=f"parameter '{name}': its place in megatron-core's module"):
        _order_key(spec)


@pytest.mark.parametrize("form", [0, 1], ids=["plain", "distributed"])
def test_tp2_spec_change_and_back_is_bit_exact(made: dict[str, tuple[Path, Path]], form: int, tmp_path: Path) -> None:
    # at TP2 the down projections' pieces are split by rows in the local spec and whole in the TE spec;
    # their state (like their weights) is merged with the source spec's rule and cut with the target's.
    source = made["tp2ep2"][form]
    _convert(source, tmp_path / "te", "--dst-transformer-impl", "transformer_engine")
    te = MegatronSource(next(tmp_path.glob("te/iter_*")), 2, False, LoadOptions())
    coord = next(coord for coord in te.files if coord.tp == 1)
    (groups, *_) = chained_slots(te.config, te.layout, coord, padded_vocab_size=te.vocab_rows)
    down = MTP_ATTENTION + "linear_kv_down_proj.weight"
    state = safe_torch_load(te.files[coord])
    assert tuple(state["model"][down].shape) == (16 + 8, 64)  # whole: kv_lora_rank + qk_rope_head_dim rows
    if form == 0:
        position = {slot.spec.local_name: slot.position for group in groups for slot in group}[down]
        dense = state["optimizer"][0]  # EP2: the chained dense and expert-parallel optimizers
        assert tuple(dense["state"][position]["exp_avg"].shape) == (24, 64)
    _convert(tmp_path / "te", tmp_path / "back", "--dst-transformer-impl", "local")
    assert_same_files(source, tmp_path / "back")


@pytest.mark.parametrize("form", [0, 1], ids=["plain", "distributed"])
def test_mtp_model_layer_spelling_carries_the_same_state(made: dict[str, tuple[Path, Path]], form: int,
                                                         tmp_path: Path) -> None:
    # Megatron-LM d98e8a64 names the MTP inner layer mtp_model_layer in per-rank files, registered where
    # megatron-core 0.16.1's transformer_layer is: the same optimizer positions, read and written in that spelling.
    from support.mtp_models import model_keys, respelled

    d98 = respelled(made["pp2"][form], tmp_path / "d98")
    _convert(d98, tmp_path / "tp2ep2", "--dst-tp", "2", "--dst-pp", "1", "--dst-ep", "2")
    assert any(".mtp_model_layer." in key for key in model_keys(tmp_path / "tp2ep2"))
    assert_same_files(respelled(made["tp2ep2"][form], tmp_path / "expected"), tmp_path / "tp2ep2")
    _convert(tmp_path / "tp2ep2", tmp_path / "back", "--dst-tp", "1", "--dst-pp", "2", "--dst-ep", "1",
             "--dst-mtp-layer-name", "transformer_layer")
    assert_same_files(made["pp2"][form], tmp_path / "back")
