"""Megatron-FSDP checkpoints (``--dst-format fsdp_dtensor``) as a destination, checked against the golden Megatron-LM
wrote itself (tests/data/megatron_lm/train_tp2dp2_fsdp_dtensor: a TP2 DP2 Megatron-FSDP run): what pgconvert writes
from a per-rank conversion of it is read back with torch.distributed.checkpoint's own reader, and its bytes entries
as Megatron-LM's ``_load_base_checkpoint`` reads them (``dcp.load`` of ``{'args': None, 'iteration': None,
'checkpoint_version': None}``). scripts/interop_megatron_lm.py (step 7) resumes Megatron-LM from it."""

from __future__ import annotations

import argparse
import io
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from support.checkpoint_compare import read_dcp
from support.cli_helpers import assert_clean_refusal, run_cli
from support.megatron_fixtures import allowed_globals
from support.hf_helpers import load_hf_tensors

import pgconvert
from pgconvert.errors import CheckpointError
from pgconvert.formats.registry import detect_format, get_saver

GOLDEN = Path(__file__).parent / "data" / "megatron_lm" / "train_tp2dp2_fsdp_dtensor"
GOLDEN_ITERATION = GOLDEN / "iter_0000002"
ITERATION_DIR = "iter_0000002"
# The golden's entries pgconvert does not write: a counter Megatron-LM reads as 0 when absent, carried by
# pgconvert's conversions only with the optimizer state (which this model-only golden does not hold).
NOT_WRITTEN = {"num_floating_point_operations_so_far"}


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The golden converted to Megatron per-rank files at TP2 (its own layout)."""
    out = tmp_path_factory.mktemp("fsdp_saver") / "per_rank"
    pgconvert.convert(GOLDEN, out, dst_format="megatron")
    return out


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """torch's load planner with the bytes entries unpickled weights-only (megatron-core 0.16.1 lacks some enums of
    the Megatron-LM commit that wrote the golden's args; pgconvert's stand-ins name them)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        with torch.serialization.safe_globals(allowed_globals()):
            self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def _entries(iteration_dir: Path) -> dict[str, object]:
    """The bytes entries as Megatron-LM's rank-0 load reads them: ``dcp.load`` into ``None`` values."""
    state: dict[str, object] = {"args": None, "iteration": None, "checkpoint_version": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=iteration_dir, planner=_WeightsOnlyPlanner(), no_dist=True)
    return state


def test_a_per_rank_conversion_gives_back_every_golden_tensor(per_rank: Path, tmp_path: Path) -> None:
    out = tmp_path / "fsdp"
    report = pgconvert.convert(per_rank, out, dst_format="fsdp_dtensor", dst_tp=2)

    golden_metadata, golden = read_dcp(GOLDEN_ITERATION)
    metadata, written = read_dcp(out / ITERATION_DIR)  # torch's own reader
    assert sorted(written) == sorted(golden)
    for key, tensor in golden.items():
        assert written[key].dtype == torch.float32 and torch.equal(written[key], tensor), key
    assert set(golden_metadata.state_dict_metadata) - set(metadata.state_dict_metadata) == NOT_WRITTEN
    assert set(metadata.state_dict_metadata) <= set(golden_metadata.state_dict_metadata)
    assert metadata.planner_data == {key: path for key, path in golden_metadata.planner_data.items()
                                     if key not in NOT_WRITTEN}
    assert all(len(metadata.state_dict_metadata[key].chunks) == 1 for key in written)  # one chunk per key
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert detect_format(out) == "fsdp_dtensor" and not (out / ITERATION_DIR / "metadata.json").exists()
    assert any("written with the layout tp=2,pp=1" in notice for notice in report.notices), report.notices
    assert pgconvert.verify(GOLDEN, out).equal


def test_the_bytes_entries_are_megatron_lms(tmp_path: Path) -> None:
    pgconvert.convert(GOLDEN, tmp_path / "fsdp", dst_format="fsdp_dtensor", dst_tp=1)

    golden, ours = _entries(GOLDEN_ITERATION), _entries(tmp_path / "fsdp" / ITERATION_DIR)
    assert (ours["iteration"], ours["checkpoint_version"]) == (golden["iteration"], golden["checkpoint_version"])
    args = ours["args"]
    assert isinstance(args, argparse.Namespace)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 1)
    assert (args.ckpt_format, args.use_megatron_fsdp) == ("fsdp_dtensor", True)
    # the run's precision is kept: the golden run trained in bf16 and stored its fp32 masters
    assert (args.bf16, args.params_dtype) == (True, torch.bfloat16)
    model_fields = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                    "swiglu", "vocab_size", "normalization", "untie_embeddings_and_output_weights")
    assert [getattr(args, name) for name in model_fields] == [getattr(golden["args"], name) for name in model_fields]


def test_a_bf16_source_is_widened_and_named(tmp_path: Path) -> None:
    bf16 = tmp_path / "bf16"
    pgconvert.convert(GOLDEN, bf16, dst_format="megatron", dtype="bf16")

    report = pgconvert.convert(bf16, tmp_path / "fsdp", dst_format="fsdp_dtensor")

    assert any("the source's bfloat16 values are written widened to float32, not the fp32 masters" in notice
               for notice in report.notices), report.notices
    args = _entries(tmp_path / "fsdp" / ITERATION_DIR)["args"]
    assert (args.bf16, args.params_dtype) == (True, torch.bfloat16)  # the run trains in the source's dtype
    _, golden = read_dcp(GOLDEN_ITERATION)
    _, written = read_dcp(tmp_path / "fsdp" / ITERATION_DIR)
    for key, tensor in golden.items():
        assert written[key].dtype == torch.float32, key
        assert torch.equal(written[key], tensor.to(torch.bfloat16).to(torch.float32)), key


def test_per_rank_through_fsdp_dtensor_to_hf_equals_per_rank_to_hf(per_rank: Path, tmp_path: Path) -> None:
    pgconvert.convert(per_rank, tmp_path / "fsdp", dst_format="fsdp_dtensor", dst_tp=1)
    pgconvert.convert(tmp_path / "fsdp", tmp_path / "via_fsdp", dst_format="hf")
    pgconvert.convert(per_rank, tmp_path / "direct", dst_format="hf")

    via, direct = load_hf_tensors(tmp_path / "via_fsdp"), load_hf_tensors(tmp_path / "direct")
    assert sorted(via) == sorted(direct) and len(direct) > 10
    assert [name for name, tensor in direct.items() if not torch.equal(via[name], tensor)] == []
    assert (tmp_path / "via_fsdp" / "config.json").read_text() == (tmp_path / "direct" / "config.json").read_text()


def test_the_default_destination_of_an_fsdp_dtensor_source_is_fsdp_dtensor(tmp_path: Path) -> None:
    pgconvert.convert(GOLDEN, tmp_path / "out", dst_tp=1)

    assert detect_format(tmp_path / "out") == "fsdp_dtensor"
    assert pgconvert.verify(GOLDEN, tmp_path / "out").equal


def test_the_saver_is_registered() -> None:
    saver = get_saver("fsdp_dtensor")
    assert saver.parallel is True and saver.supports_partial is True and saver.writes_optimizer is True
    assert saver.stores_masters is True and saver.optimizer_partial is True and saver.optimizer_forms == ()


# ------------------------------------------------------------------ bad destinations


def test_an_existing_destination_is_refused_without_overwrite(per_rank: Path, tmp_path: Path) -> None:
    dst = tmp_path / "fsdp"
    assert run_cli("-q", "--dst-format", "fsdp_dtensor", per_rank, dst).exit_code == 0
    before = {path: path.read_bytes() for path in dst.rglob("*") if path.is_file()}

    refused = run_cli("-q", "--dst-format", "fsdp_dtensor", "--dst-tp", "1", per_rank, dst)

    assert_clean_refusal(refused, 2, str(dst), "--overwrite")
    assert {path: path.read_bytes() for path in dst.rglob("*") if path.is_file()} == before
    again = run_cli("-q", "--dst-format", "fsdp_dtensor", "--dst-tp", "1", "--overwrite", per_rank, dst)
    assert again.exit_code == 0, again.output
    assert _entries(dst / ITERATION_DIR)["args"].tensor_model_parallel_size == 1


@pytest.mark.parametrize(("flags", "fragment"), [
    (["--dst-pp", "2"], "layout tp=2,pp=2: pgconvert writes Megatron-FSDP checkpoints of tensor- and expert-parallel runs"),
    (["--dst-tp", "3"], "--dst-tp 3: num_attention_heads=4 is not divisible by 3"),
])
def test_a_layout_fsdp_dtensor_cannot_hold_is_refused_up_front(per_rank: Path, tmp_path: Path, flags: list[str],
                                                                fragment: str) -> None:
    refused = run_cli("-q", "--dst-format", "fsdp_dtensor", *flags, per_rank, tmp_path / "out")

    assert_clean_refusal(refused, 2, fragment)
    assert list(tmp_path.iterdir()) == []


def test_gated_experts_are_written_as_megatron_lm_splits_them_and_read_back(tmp_path: Path) -> None:
    """A SwiGLU MoE (routed experts at EP2, a gated shared expert, the router's expert bias): every gated fc1, the
    experts' and the shared expert's too, as its ``_w`` (gate) and ``_v`` (up) halves under the global expert index
    (``handle_swiglu_in_state_dict``'s patterns and ``handle_experts_in_state_dict`` in Megatron-LM d98e8a64; its
    own save of a gated MoE fails on CPU ranks, so this naming has no golden), read back to the source's tensors."""
    from support.format_outputs import write_sources
    from support.megatron_fixtures import read_megatron_checkpoint_ranks

    moe = write_sources(tmp_path / "src")["megatron"]
    pgconvert.convert(moe, tmp_path / "fsdp", dst_format="fsdp_dtensor", dst_tp=1, dst_ep=4)
    _, stored = read_dcp(next((tmp_path / "fsdp").glob("iter_*")))
    expert = "model.module.decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    assert {expert.format(7) + half for half in ("_w", "_v")} <= set(stored)
    assert expert.format(7) not in stored
    assert "model.module.decoder.layers.0.mlp.shared_experts.linear_fc1.weight_w" in stored
    pgconvert.convert(tmp_path / "fsdp", tmp_path / "back", dst_format="megatron", dst_tp=2, dst_ep=2)
    _, expected = read_megatron_checkpoint_ranks(moe)
    _, found = read_megatron_checkpoint_ranks(tmp_path / "back")
    assert expected.keys() == found.keys()
    for coord, rank in expected.items():  # Megatron-FSDP's fp32 main weights: the source's values widened
        model = found[coord]["model"]
        bad = [key for key, value in rank["model"].items() if isinstance(value, torch.Tensor)
               and not (model[key].dtype == torch.float32 and torch.equal(model[key], value.float()))]
        assert bad == [], coord
