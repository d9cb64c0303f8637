"""A DeepSeek-V3-shaped Megatron-FSDP checkpoint as Megatron-LM writes it, read, resharded to other expert-parallel
sizes and written back: ``train_tp1ep2dp4_mla_moe_mtp_fsdp_dtensor_optim`` in tests/data/megatron_lm, its own
``pretrain_gpt.py --use-megatron-fsdp --ckpt-format fsdp_dtensor`` of a model with multi-latent attention (q and kv
LoRA, latent norms), whose layer 0 is dense and layer 1 and the multi-token prediction layer four routed experts at
EP2 with a shared expert and a sigmoid router's expert bias, SwiGLU throughout, TP1 DP4, with the optimizer state.

What the golden shows and the reader relies on: every routed expert under its global index
(``handle_experts_in_state_dict``), its moments too; every gated fc1 (dense, routed and shared experts') as its
``_w`` (gate) and ``_v`` (up) halves; the MTP layer's inner layer as ``transformer_layer`` in the model and
state keys (``handle_mtp_in_state_dict``) but as the live ``mtp_model_layer`` in ``param_to_group_meta``; the experts in the dense param groups
(``is_expert_parallel`` False: Megatron-FSDP's parameters drop ``allreduce``); the router's ``expert_bias`` a model
entry without optimizer state. Megatron-LM resuming pgconvert's outputs at EP2 and EP4 is
``scripts/interop_megatron_lm.py WORK fsdp-moe`` (needs Megatron-LM's source).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from support.checkpoint_compare import read_dcp, read_dcp_objects, rewrite_dcp_metadata

import pgconvert
from pgconvert.errors import CheckpointError
from pgconvert.formats import LoadOptions
from pgconvert.formats.registry import get_loader

GOLDEN = Path(__file__).parent / "data" / "megatron_lm" / "train_tp1ep2dp4_mla_moe_mtp_fsdp_dtensor_optim"
ITERATION = GOLDEN / "iter_0000002"
MODEL = "model.module."
STATE = "optimizer.state.module.module.module."
GROUP_META = "optimizer.param_to_group_meta.module.module.module."
EXPERTS = 4
EXPERT = "decoder.layers.1.mlp.experts.local_experts.{}.linear_fc{}.weight"
MTP_EXPERT = "mtp.layers.0.transformer_layer.mlp.experts.local_experts.{}.linear_fc{}.weight"
FIELDS = ("exp_avg", "exp_avg_sq", "step")


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    """Every tensor entry of the golden, read by torch's DCP reader alone."""
    return read_dcp(ITERATION)[1]


def _joined(tensors: dict[str, torch.Tensor], key: str, suffix: str = "") -> torch.Tensor:
    """Entry ``key`` (+ ``suffix``), a gated fc1's as its gate and up halves joined."""
    if key + suffix in tensors:
        return tensors[key + suffix]
    return torch.cat([tensors[f"{key}_w{suffix}"], tensors[f"{key}_v{suffix}"]])


def _entries(iteration_dir: Path) -> dict[str, object]:
    """The ``param_to_group_meta`` bytes entries of a store, unpickled by torch's reader."""
    return read_dcp_objects(iteration_dir, lambda key: key.startswith(GROUP_META))


def test_golden_holds_every_expert_under_its_global_index(golden: dict[str, torch.Tensor]) -> None:
    experts = {key for key in golden if key.startswith(MODEL + "decoder.layers.1.mlp.experts.")}
    assert experts == {MODEL + EXPERT.format(e, 1) + half for e in range(EXPERTS) for half in ("_w", "_v")} | {
        MODEL + EXPERT.format(e, 2) for e in range(EXPERTS)}
    assert {MODEL + "decoder.layers.1.mlp.router.expert_bias", MODEL + "decoder.layers.0.mlp.linear_fc1.weight_w",
            MODEL + "decoder.layers.1.mlp.shared_experts.linear_fc1.weight_v", MODEL + MTP_EXPERT.format(3, 2),
            STATE + MTP_EXPERT.format(3, 1) + "_w.exp_avg",
            MODEL + "decoder.layers.1.self_attention.kv_layernorm.weight",
            MODEL + "mtp.layers.0.transformer_layer.self_attention.linear_q_up_proj.weight"} <= set(golden)
    assert GROUP_META + MTP_EXPERT.format(3, 1).replace("transformer_layer", "mtp_model_layer") + ".lr" in _entries(
        ITERATION)
    assert not any(key.startswith(STATE) and "expert_bias" in key for key in golden)
    metas = _entries(ITERATION)
    assert metas[GROUP_META + EXPERT.format(3, 1) + ".is_expert_parallel"] is False
    info = pgconvert.inspect(GOLDEN)
    assert info.layout is not None and info.layout["ep"] == 2 and info.layout["tp"] == 1


def test_every_tensor_and_its_optimizer_state_read_bit_exact(golden: dict[str, torch.Tensor], tmp_path: Path) -> None:
    with get_loader("fsdp_dtensor").open(GOLDEN, LoadOptions()) as source:
        names = source.names()
        stored = sorted(key for name in names for key in source.stored_names(name))
        assert stored == sorted(key for key in golden if key.startswith(MODEL))
        for name in names:
            assert torch.equal(source.load(name), _joined(golden, MODEL + name)), name
    done = subprocess.run([sys.executable, "-m", "pgconvert", "export-optimizer", str(GOLDEN), str(tmp_path / "opt")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    index = json.loads((tmp_path / "opt" / "optimizer.json").read_text())
    parameters = index["parameters"]
    assert len(parameters) == 58 and "decoder.layers.1.mlp.router.expert_bias" not in parameters
    for name, entry in parameters.items():
        held = torch.load(tmp_path / "opt" / entry["file"], weights_only=True)
        assert torch.equal(held["param"], _joined(golden, MODEL + name)), name
        for field in FIELDS[:2]:
            assert torch.equal(held[field], _joined(golden, STATE + name, "." + field)), (name, field)
        step = golden.get(f"{STATE}{name}.step", golden.get(f"{STATE}{name}_w.step"))
        assert step is not None and torch.equal(held["step"], step), name


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_per_rank_output_holds_each_ranks_experts_and_loads_into_megatron_core(
        tmp_path: Path, golden: dict[str, torch.Tensor], ep: int) -> None:
    """Each EP rank's file holds its own experts, the MTP layer's too; at EP1 megatron-core 0.16.1's GPTModel of the
    file's args (MLA local spec, MoE, MTP block) loads it strictly and holds the golden's tensors."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from support.mcore_helpers import rank_files
        from support.mcore_mtp_model import mtp_gpt_model

    # megatron-core 0.16.1's MTP layer holds its inner layer as transformer_layer
    pgconvert.convert(GOLDEN, tmp_path / "out", dst_format="megatron", dst_ep=ep, skip_optimizer=True,
                      dst_mtp_layer_name="transformer_layer")
    ranks = rank_files(tmp_path / "out")
    assert len(ranks) == ep
    local = EXPERTS // ep
    for rank in ranks:
        state = dict(rank.model)
        if ep == 1:
            with torch.no_grad(), mtp_gpt_model(rank.args) as model:
                model.load_state_dict(state, strict=True)
                state = {key: value.clone() for key, value in model.state_dict().items()
                         if not key.endswith("_extra_state")}
            canonical = {key[len(MODEL):].removesuffix("_w").removesuffix("_v") for key in golden
                         if key.startswith(MODEL)}
            assert canonical == set(state)
            assert [key for key, value in state.items() if not torch.equal(value, _joined(golden, MODEL + key))] == []
        for j in range(local):
            for fc, expert in ((fc, expert) for fc in (1, 2) for expert in (EXPERT, MTP_EXPERT)):
                expected = _joined(golden, MODEL + expert.format(rank.layout.ep_rank * local + j, fc))
                assert torch.equal(state[expert.format(j, fc)], expected), (rank.path, j, fc)
        assert torch.equal(state["decoder.layers.1.mlp.router.expert_bias"],
                           golden[MODEL + "decoder.layers.1.mlp.router.expert_bias"])


@pytest.mark.parametrize("route", [("fsdp_dtensor",), ("megatron", "fsdp_dtensor"), ("torch_dist", "fsdp_dtensor")])
def test_round_trips_through_other_expert_layouts_give_the_golden_store(
        tmp_path: Path, golden: dict[str, torch.Tensor], route: tuple[str, ...]) -> None:
    """Every tensor entry (weights, moments, steps) and every parameter's group hyperparameters come back bit for
    bit, the store written at EP4 (the args' layout; the store is global) after a hop at EP1 where there is one. The
    MTP inner layer's live name in ``param_to_group_meta`` is the source's (per-rank files keep it); torch_dist keys
    do not hold it, so from there ``--dst-mtp-layer-name`` gives it."""
    source = GOLDEN
    for index, fmt in enumerate(route):
        last = index == len(route) - 1
        target = tmp_path / f"{index}_{fmt}"
        spelling = "mtp_model_layer" if last and "torch_dist" in route else None
        # --dtype bf16 is the run's precision in the args: the store keeps fp32 main weights, so nothing is cast
        # and --strict has no guess to refuse
        report = pgconvert.convert(source, target, dst_format=fmt, dst_ep=4 if last else 1,
                                   dtype="bf16" if last else "keep", dst_mtp_layer_name=spelling, strict=last)
        source = target
    assert any("param_to_group_meta" in notice and "'mtp_model_layer'" in notice for notice in report.notices)
    assert pgconvert.verify(GOLDEN, source).equal
    tensors, metas = read_dcp(source / "iter_0000002")[1], _entries(source / "iter_0000002")
    assert tensors.keys() == golden.keys()
    assert [key for key in golden if not torch.equal(tensors[key], golden[key])] == []
    assert metas == _entries(ITERATION)
    assert pgconvert.inspect(source).layout["ep"] == 4


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    target = tmp_path / "golden"
    shutil.copytree(GOLDEN, target)
    return target


def _renamed(old: str, new: str) -> Any:
    """Entry ``old`` stored under ``new``: its index and its chunks' storage records."""
    def change(metadata: Any) -> None:
        metadata.state_dict_metadata[new] = metadata.state_dict_metadata.pop(old)
        for index in [index for index in metadata.storage_data if index.fqn == old]:
            metadata.storage_data[dataclasses.replace(index, fqn=new)] = metadata.storage_data.pop(index)
    return change


@pytest.mark.parametrize("old, new, named", [
    (MODEL + EXPERT.format(3, 2), MODEL + EXPERT.format(7, 2), "local_experts.7"),
    (STATE + EXPERT.format(2, 1) + "_w.exp_avg", STATE + EXPERT.format(5, 1) + "_w.exp_avg", "local_experts.2"),
])
def test_an_expert_stored_under_another_index_is_named(copy: Path, tmp_path: Path, old: str, new: str,
                                                       named: str) -> None:
    rewrite_dcp_metadata(copy / "iter_0000002", _renamed(old, new))
    with pytest.raises(CheckpointError, match=named):
        pgconvert.convert(copy, tmp_path / "out", dst_format="megatron")
    assert not (tmp_path / "out").exists()


def test_a_bf16_per_rank_output_reads_back_with_its_optimizer_state(tmp_path: Path) -> None:
    """``--dtype bf16`` writes the router's weight in bf16 beside the other parameters, as megatron-core holds it, so
    the distributed optimizer's one (bf16, fp32) buffer holds them all and the files read back; the masters carried
    through them give the golden's store again."""
    pgconvert.convert(GOLDEN, tmp_path / "bf16", dst_format="megatron", dst_ep=2, dtype="bf16")
    from support.megatron_fixtures import read_megatron_checkpoint_ranks

    _, ranks = read_megatron_checkpoint_ranks(tmp_path / "bf16")
    model = ranks[(0, 0, 1)]["model"]
    assert model["decoder.layers.1.mlp.router.weight"].dtype == torch.bfloat16
    assert model["decoder.layers.1.mlp.router.expert_bias"].dtype == torch.float32
    pgconvert.convert(tmp_path / "bf16", tmp_path / "back", dst_format="fsdp_dtensor", dst_ep=2)
    assert pgconvert.verify(GOLDEN, tmp_path / "back").equal
