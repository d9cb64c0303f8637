"""Megatron optimizer state through a reshard: the position -> parameter map, the per-parameter form
and the per-rank plain optimizer at a new layout, on goldens written by Megatron-LM itself."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from click.testing import Result
from pgconvert.loaders.megatron import MegatronSource
from support.megatron_fixtures import assert_same_tree, load_for_test, rank_states
from pgconvert.formats import LoadOptions
from pgconvert.formats.megatron import safe_torch_load
from pgconvert.optimizer.order import (OptimizerLayoutError, OptimizerRules, UnsupportedOptimizerError,
                                     check_param_groups, check_state_shapes, optimizer_slots)

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
PLAIN = GOLDENS / "train_tp2pp2_torch"
PLAIN_ITER = PLAIN / "iter_0000002"


def _source(iteration_dir: Path = PLAIN_ITER) -> MegatronSource:
    return MegatronSource(iteration_dir, 2, False, LoadOptions())


def test_positions_map_to_parameters_of_the_same_shape_on_every_rank() -> None:
    source = _source()
    assert len(source.files) == 4
    for coord, path in source.files.items():
        state = safe_torch_load(path)
        slots = optimizer_slots(source.config, source.layout, coord, OptimizerRules.from_args(state["args"], str(path)),
                                source.vocab_rows)
        check_param_groups(slots, state["optimizer"]["param_groups"], str(path))
        check_state_shapes(slots, state["optimizer"]["state"], str(path))
        names = [slot.spec.local_name for group in slots for slot in group]
        # megatron-core's order: linear_proj is registered before linear_qkv; norms in group 1.
        assert names.index("decoder.layers.0.self_attention.linear_proj.weight") < \
            names.index("decoder.layers.0.self_attention.linear_qkv.weight")
        assert all(len(slot.spec.local_shape) == 1 for slot in slots[1])


def test_a_missing_parameter_or_a_wrong_shape_is_refused_naming_the_field() -> None:
    source = _source()
    coord, path = next(iter(source.files.items()))
    state = safe_torch_load(path)
    slots = optimizer_slots(source.config, source.layout, coord, padded_vocab_size=source.vocab_rows)
    groups = [dict(group) for group in state["optimizer"]["param_groups"]]
    groups[1]["params"] = groups[1]["params"][:-1]
    with pytest.raises(OptimizerLayoutError, match=r"param_groups\[1\]\.params"):
        check_param_groups(slots, groups, str(path))
    tampered = dict(state["optimizer"]["state"])
    tampered[1] = dict(tampered[1], exp_avg=torch.zeros(3))
    with pytest.raises(OptimizerLayoutError, match=r"state\[1\]\.exp_avg has shape \(3,\)"):
        check_state_shapes(slots, tampered, str(path))


def test_grouped_gemm_experts_of_the_local_spec_are_refused_naming_the_field() -> None:
    source = _source()
    config = dataclasses.replace(source.config, num_experts=4, moe_grouped_gemm=True)
    with pytest.raises(UnsupportedOptimizerError, match="moe_grouped_gemm=True.*megatron-core 0.16.1"):
        optimizer_slots(config, source.layout, next(iter(source.files)))


def _convert(src: Path, dst: Path, *flags: str) -> Result:
    from click.testing import CliRunner

    from pgconvert.cli import main

    return CliRunner().invoke(main, ["convert", str(src), str(dst), "-q", *flags], prog_name="pgconvert")





def test_tp2pp2_to_tp1pp1_and_back_is_bit_exact_in_every_optimizer_tensor(tmp_path: Path) -> None:
    one = _convert(PLAIN, tmp_path / "tp1", "--dst-tp", "1", "--dst-pp", "1")
    assert one.exit_code == 0, one.output
    back = _convert(tmp_path / "tp1", tmp_path / "back", "--dst-tp", "2", "--dst-pp", "2")
    assert back.exit_code == 0, back.output
    merged = rank_states(tmp_path / "tp1" / "iter_0000002")["mp_rank_00"]
    assert len(merged["optimizer"]["state"]) == 15
    assert [len(g["params"]) for g in merged["optimizer"]["param_groups"]] == [10, 5]
    original, again = rank_states(PLAIN_ITER), rank_states(tmp_path / "back" / "iter_0000002")
    assert set(original) == set(again) and len(original) == 4
    for rank, state in original.items():
        for key in ("optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far", "iteration", "model"):
            assert_same_tree(state[key], again[rank][key], f"{rank}.{key}")
        assert again[rank]["args"].consumed_train_samples == state["args"].consumed_train_samples
        assert "rng_state" not in again[rank]


def test_the_merged_state_is_the_tp_pieces_joined_by_the_parameters_rule(tmp_path: Path) -> None:
    assert _convert(PLAIN, tmp_path / "tp1", "--dst-tp", "1", "--dst-pp", "1").exit_code == 0
    ranks = rank_states(PLAIN_ITER)
    merged = rank_states(tmp_path / "tp1" / "iter_0000002")["mp_rank_00"]["optimizer"]["state"]
    # Stage 0, group 0: word embeddings, layer 0 linear_proj (row), linear_qkv (column), fc1 (gated), fc2.
    pieces = [ranks[f"mp_rank_0{tp}_000"]["optimizer"]["state"] for tp in (0, 1)]
    assert torch.equal(merged[1]["exp_avg"], torch.cat([pieces[0][1]["exp_avg"], pieces[1][1]["exp_avg"]], dim=1))
    assert torch.equal(merged[2]["exp_avg_sq"], torch.cat([pieces[0][2]["exp_avg_sq"], pieces[1][2]["exp_avg_sq"]]))
    gate = [piece[3]["exp_avg"].chunk(2) for piece in pieces]
    assert torch.equal(merged[3]["exp_avg"], torch.cat([gate[0][0], gate[1][0], gate[0][1], gate[1][1]]))


def test_per_parameter_form_is_layout_independent(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from pgconvert.cli import main

    assert _convert(PLAIN, tmp_path / "tp1", "--dst-tp", "1", "--dst-pp", "1").exit_code == 0
    runner = CliRunner()
    for name, src in (("a", PLAIN), ("b", tmp_path / "tp1")):
        result = runner.invoke(main, ["export-optimizer", str(src), str(tmp_path / name)], prog_name="pgconvert")
        assert result.exit_code == 0, result.output
    files = sorted(p.name for p in (tmp_path / "a").glob("*.pt"))
    assert len(files) == 15 and files == sorted(p.name for p in (tmp_path / "b").glob("*.pt"))
    for name in files:
        a, b = (torch.load(tmp_path / d / name, weights_only=True) for d in ("a", "b"))
        assert set(a) == {"param", "exp_avg", "exp_avg_sq", "step"}
        assert_same_tree(a, b, name)
    model = rank_states(tmp_path / "tp1" / "iter_0000002")["mp_rank_00"]["model"]
    qkv = torch.load(tmp_path / "a" / "decoder.layers.1.self_attention.linear_qkv.weight.pt", weights_only=True)
    assert torch.equal(qkv["param"], model["decoder.layers.1.self_attention.linear_qkv.weight"])
    index = json.loads((tmp_path / "a" / "optimizer.json").read_text())
    assert index["iteration"] == 2 and index["counters"]["consumed_train_samples"] == 4
    assert index["parameters"]["decoder.final_layernorm.weight"]["group"] == 1


def test_skip_optimizer_converts_the_model_alone(tmp_path: Path) -> None:
    result = _convert(PLAIN, tmp_path / "out", "--dst-tp", "1", "--dst-pp", "1", "--skip-optimizer")
    assert result.exit_code == 0, result.output
    state = rank_states(tmp_path / "out" / "iter_0000002")["mp_rank_00"]
    assert "optimizer" not in state and "opt_param_scheduler" not in state


def _tamper(root: Path, rank: str, change: Callable[[dict], None]) -> None:
    from pgconvert.savers.megatron import save_durably

    path = root / "iter_0000002" / rank / "model_optim_rng.pt"
    state = dict(safe_torch_load(path))
    change(state)
    partial = path.with_name("partial.pt")
    save_durably(state, partial)
    partial.replace(path)


def _drop_last_parameter(state: dict) -> None:
    optimizer = state["optimizer"]
    last = optimizer["param_groups"][1]["params"][-1]
    optimizer["param_groups"][1]["params"] = optimizer["param_groups"][1]["params"][:-1]
    optimizer["state"] = {k: v for k, v in optimizer["state"].items() if k != last}


def test_a_parameter_count_that_does_not_match_the_model_is_a_named_error(tmp_path: Path) -> None:
    shutil.copytree(PLAIN, tmp_path / "src")
    _tamper(tmp_path / "src", "mp_rank_01_001", _drop_last_parameter)
    result = _convert(tmp_path / "src", tmp_path / "out", "--dst-tp", "1", "--dst-pp", "1")
    assert result.exit_code == 1, result.output
    assert "mp_rank_01_001" in result.output and "param_groups[1].params" in result.output
    assert "pass --skip-optimizer" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


DISTOPT = GOLDENS / "train_tp2dp2_distopt_bf16_torch"


def test_a_missing_distrib_optim_file_is_a_named_error(tmp_path: Path) -> None:
    shutil.copytree(DISTOPT, tmp_path / "src")
    (tmp_path / "src" / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt").unlink()
    result = _convert(tmp_path / "src", tmp_path / "out", "--dst-tp", "1")
    assert result.exit_code == 1, result.output
    assert "distrib_optim.pt is missing" in result.output and "Traceback" not in result.output


def test_an_unknown_sharding_type_is_a_named_error(tmp_path: Path) -> None:
    shutil.copytree(DISTOPT, tmp_path / "src")
    _tamper(tmp_path / "src", "mp_rank_00", lambda s: s["optimizer"].update(param_state_sharding_type="bogus"))
    result = _convert(tmp_path / "src", tmp_path / "out", "--dst-tp", "1")
    assert result.exit_code == 1, result.output
    assert "param_state_sharding_type='bogus': unknown sharding type" in result.output
    assert "Traceback" not in result.output


def test_distributed_optimizer_round_trips_tp2_tp1_tp2_bit_exact(tmp_path: Path) -> None:
    assert _convert(DISTOPT, tmp_path / "tp1", "--dst-tp", "1").exit_code == 0
    back = _convert(tmp_path / "tp1", tmp_path / "back", "--dst-tp", "2")
    assert back.exit_code == 0, back.output
    flat = torch.load(tmp_path / "tp1" / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt", weights_only=True)
    (entry,) = flat[0].values()
    # TP1 holds every parameter once: two TP2 buffers (53568 each) less one copy of the 5 replicated norms.
    assert entry["numel_unpadded"] == entry["param"].numel() == 2 * 53568 - 5 * 64
    original, again = rank_states(DISTOPT / "iter_0000002"), rank_states(tmp_path / "back" / "iter_0000002")
    assert set(original) == set(again) == {"mp_rank_00", "mp_rank_01"}
    for rank, state in original.items():
        for key in ("optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far", "model"):
            assert_same_tree(state[key], again[rank][key], f"{rank}.{key}")
        assert_same_tree(torch.load(DISTOPT / "iter_0000002" / rank / "distrib_optim.pt", weights_only=True),
                     torch.load(tmp_path / "back" / "iter_0000002" / rank / "distrib_optim.pt", weights_only=True),
                     f"{rank}/distrib_optim.pt")


def test_distributed_and_plain_exports_hold_the_same_parameters(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from pgconvert.cli import main

    for name, src in (("dist", DISTOPT), ("plain", BF16_PLAIN)):
        result = CliRunner().invoke(main, ["export-optimizer", str(src), str(tmp_path / name)], prog_name="pgconvert")
        assert result.exit_code == 0, result.output
    names = sorted(p.name for p in (tmp_path / "dist").glob("*.pt"))
    assert names == sorted(p.name for p in (tmp_path / "plain").glob("*.pt")) and len(names) == 15
    for name in names:
        dist = torch.load(tmp_path / "dist" / name, weights_only=True)
        plain = torch.load(tmp_path / "plain" / name, weights_only=True)
        assert {key: value.shape for key, value in dist.items()} == {key: value.shape for key, value in plain.items()}
        assert dist["param"].dtype == torch.float32 and float(dist["step"]) == float(plain["step"]) == 2.0


def test_a_flat_buffer_of_the_wrong_size_is_a_named_error(tmp_path: Path) -> None:
    shutil.copytree(DISTOPT, tmp_path / "src")
    path = tmp_path / "src" / "iter_0000002" / "mp_rank_01" / "distrib_optim.pt"
    content = torch.load(path, weights_only=True)
    (entry,) = content[0].values()
    entry["exp_avg"] = entry["exp_avg"][:-64].clone()
    torch.save(content, path)
    result = _convert(tmp_path / "src", tmp_path / "out", "--dst-tp", "1")
    assert result.exit_code == 1, result.output
    assert "mp_rank_01/distrib_optim.pt: buffer 0 exp_avg has shape (53504,); expected (53568,)" in result.output
    assert "Traceback" not in result.output
    content[0] = {key: dict(value, numel_unpadded=7) for key, value in content[0].items()}
    torch.save(content, path)
    result = _convert(tmp_path / "src", tmp_path / "out", "--dst-tp", "1")
    assert result.exit_code == 1 and "numel_unpadded=7, but the model's parameters" in result.output


def _adam_step(state: dict, slots: list, chunk_keys: list[str], grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One torch AdamW step (the optimizer megatron-core's FP32Optimizer wraps when Apex and Transformer
    Engine are absent) from a rank file's own state, on ``grads`` cut for the rank; updated pieces by slot."""
    params = {slot.position: torch.nn.Parameter(state[chunk_keys[slot.chunk]][slot.spec.local_name].clone())
              for group in slots for slot in group}
    for group in slots:
        for slot in group:
            spec = slot.spec
            params[slot.position].grad = spec.rule.shard(grads[spec.canonical], spec.tp_size, spec.tp_rank).clone()
    groups = [{"params": [params[slot.position] for slot in group]} for group in slots]
    optimizer = torch.optim.AdamW(groups)
    optimizer.load_state_dict(state["optimizer"])
    optimizer.step()
    return {(slot.spec.canonical, slot.spec.tp_rank): params[slot.position].detach() for group in slots for slot in group}


def test_the_converted_state_takes_the_same_adam_step_as_the_source(tmp_path: Path) -> None:
    assert _convert(PLAIN, tmp_path / "tp1", "--dst-tp", "1", "--dst-pp", "1").exit_code == 0
    source = _source()
    target = _source(tmp_path / "tp1" / "iter_0000002")
    generator = torch.Generator().manual_seed(0)
    shapes = {slot.spec.canonical: slot.spec.global_shape
              for coord in target.files
              for group in optimizer_slots(target.config, target.layout, coord, padded_vocab_size=target.vocab_rows)
              for slot in group}
    grads = {name: torch.randn(shape, generator=generator) * 1e-3 for name, shape in shapes.items()}
    before: dict[tuple[str, int], torch.Tensor] = {}
    rules: dict[str, object] = {}
    for coord, path in source.files.items():
        slots = optimizer_slots(source.config, source.layout, coord, padded_vocab_size=source.vocab_rows)
        rules.update({slot.spec.canonical: slot.spec.rule for group in slots for slot in group})
        before.update(_adam_step(load_for_test(path), slots, ["model"], grads))
    (coord, path), = target.files.items()
    after = _adam_step(load_for_test(path), optimizer_slots(target.config, target.layout, coord,
                                                            padded_vocab_size=target.vocab_rows), ["model"], grads)
    assert len(after) == 15
    for (name, _), updated in after.items():
        merged = rules[name].merge([before[(name, tp)] for tp in range(2)])
        torch.testing.assert_close(updated, merged, rtol=1e-6, atol=1e-9)
        assert not torch.equal(updated, load_for_test(path)["model"][name])


BF16_PLAIN = GOLDENS / "train_tp2dp2_bf16_torch"


def test_bf16_masters_grad_scaler_and_moments_round_trip_tp2_tp1_tp2_bit_exact(tmp_path: Path) -> None:
    import pgconvert

    report = pgconvert.convert(BF16_PLAIN, tmp_path / "tp1", dst_tp=1)
    assert any(note.startswith("optimizer (float16)") and "--no-load-rng" in note for note in report.notices)
    assert not any(note.startswith("optimizer, scheduler and RNG state are not carried") for note in report.notices)
    assert _convert(tmp_path / "tp1", tmp_path / "back", "--dst-tp", "2").exit_code == 0
    merged = rank_states(tmp_path / "tp1" / "iter_0000002")["mp_rank_00"]
    masters = merged["optimizer"]["fp32_from_fp16_params"]
    assert [len(group) for group in masters] == [10, 5] and masters[0][0].dtype == torch.float32
    assert merged["model"]["embedding.word_embeddings.weight"].dtype == torch.bfloat16
    original, again = rank_states(BF16_PLAIN / "iter_0000002"), rank_states(tmp_path / "back" / "iter_0000002")
    assert set(original) == set(again) == {"mp_rank_00", "mp_rank_01"}
    for rank, state in original.items():
        for key in ("optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far", "model"):
            assert_same_tree(state[key], again[rank][key], f"{rank}.{key}")


def _swap(group: int, first: int, second: int) -> Callable[[dict], None]:
    def swap(state: dict) -> None:
        masters = state["optimizer"]["fp32_from_fp16_params"][group]
        masters[first], masters[second] = masters[second], masters[first]
    return swap


@pytest.mark.parametrize(("group", "first", "second", "expected"), [
    # layer 0 linear_qkv and linear_fc2: both (64, 64) at TP2; the masters no longer round to the weights.
    (0, 2, 4, "fp32_from_fp16_params entry at position 2 (group 0) does not round to the model"),
    # the two norms of layer 0 round to the same bf16 weights; TP rank 0 and 1 then disagree.
    (1, 0, 1, "optimizer param of a replicated parameter differs between"),
])
def test_masters_in_another_order_than_megatron_cores_are_refused(tmp_path: Path, group: int, first: int,
                                                                  second: int, expected: str) -> None:
    shutil.copytree(BF16_PLAIN, tmp_path / "src")
    _tamper(tmp_path / "src", "mp_rank_01", _swap(group, first, second))
    result = _convert(tmp_path / "src", tmp_path / "out", "--dst-tp", "1")
    assert result.exit_code == 1, result.output
    assert expected in result.output and "Traceback" not in result.output


RESUME_CHECK = Path(__file__).parents[1] / "scripts" / "megatron_lm_resume_check.py"


@pytest.mark.skipif(not os.environ.get("PGCONVERT_MEGATRON_LM"),
                    reason="needs a Megatron-LM source tree in PGCONVERT_MEGATRON_LM (CI cannot fetch Megatron-LM)")
def test_megatron_lm_resumes_from_the_converted_optimizer_as_from_the_original(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(RESUME_CHECK), str(tmp_path)], capture_output=True, text=True,
                          timeout=7200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for case in ("tp2pp2_torch", "tp2dp2_distopt_bf16_torch", "tp2pp2_distopt_bf16_torch_dist",
                 "moe_ep2_distopt_torch_dist", "muon_tp2dp2_bf16_torch", "muon_tp2dp2_bf16_torch_to_pp2"):
        assert re.search(rf"^{case}: resumed at .* agree: lm loss .* state max \|diff\|", done.stdout, re.M), \
            done.stdout[-4000:]


def test_the_resume_check_names_what_it_needs_where_megatron_lm_is_absent(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "PGCONVERT_MEGATRON_LM"}
    done = subprocess.run([sys.executable, str(RESUME_CHECK), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "PGCONVERT_MEGATRON_LM is not set" in done.stderr and "Traceback" not in done.stderr


def test_the_installed_command_carries_the_optimizer_from_any_directory(tmp_path: Path) -> None:
    # Run outside the source tree: only the installed packages (pgconvert.savers, …) are importable.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "pgconvert", "convert", str(PLAIN), str(tmp_path / "out"),
                           "--dst-tp", "1", "--dst-pp", "1"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "optimizer (fp32)" in done.stdout + done.stderr
    assert "optimizer" in load_for_test(tmp_path / "out" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt")


def _export(src: Path, out: Path) -> dict[str, dict[str, torch.Tensor]]:
    from click.testing import CliRunner

    from pgconvert.cli import main

    result = CliRunner().invoke(main, ["export-optimizer", str(src), str(out)], prog_name="pgconvert")
    assert result.exit_code == 0, result.output
    return {path.name: torch.load(path, weights_only=True) for path in sorted(out.glob("*.pt"))}


@pytest.mark.parametrize("golden", [BF16_PLAIN, DISTOPT], ids=["plain", "distributed"])
def test_a_dp_change_keeps_every_parameters_optimizer_state_bit_exact(tmp_path: Path, golden: Path) -> None:
    # The golden ran at TP2 x DP2; the same TP/PP is written at the smallest DP (1). The plain optimizer is
    # DP-replicated and distrib_optim.pt holds DP-gathered buffers, so only args' sizes may change.
    result = _convert(golden, tmp_path / "dp1", "--dst-tp", "2", "--dst-pp", "1")
    assert result.exit_code == 0, result.output
    original, converted = rank_states(golden / "iter_0000002"), rank_states(tmp_path / "dp1" / "iter_0000002")
    assert set(original) == set(converted) == {"mp_rank_00", "mp_rank_01"}
    for rank, state in original.items():
        assert (state["args"].data_parallel_size, state["args"].world_size) == (2, 4)
        assert (converted[rank]["args"].data_parallel_size, converted[rank]["args"].world_size) == (1, 2)
        assert converted[rank]["args"].consumed_train_samples == state["args"].consumed_train_samples
        for key in ("optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far", "iteration"):
            assert_same_tree(state[key], converted[rank][key], f"{rank}.{key}")
        if golden == DISTOPT:
            assert_same_tree(torch.load(golden / "iter_0000002" / rank / "distrib_optim.pt", weights_only=True),
                         torch.load(tmp_path / "dp1" / "iter_0000002" / rank / "distrib_optim.pt", weights_only=True),
                         f"{rank}/distrib_optim.pt")
    before, after = _export(golden, tmp_path / "before"), _export(tmp_path / "dp1", tmp_path / "after")
    assert set(before) == set(after) and len(before) == 15
    for name, tensors in before.items():
        assert set(tensors) == set(after[name]) == {"param", "exp_avg", "exp_avg_sq", "step"}
        for key, value in tensors.items():
            assert torch.equal(value, after[name][key]), f"{name}.{key}"


def test_a_virtual_pipeline_on_one_stage_is_named_and_refused_under_strict(tmp_path: Path) -> None:
    # megatron-core's initialize_model_parallel refuses a virtual pipeline at pipeline size 1.
    from click.testing import CliRunner

    from pgconvert.cli import main

    flags = ["--dst-tp", "1", "--dst-pp", "1", "--dst-vpp", "2", "--skip-optimizer"]
    written = CliRunner().invoke(main, ["convert", str(PLAIN), str(tmp_path / "vpp"), *flags], prog_name="pgconvert")
    assert written.exit_code == 0, written.output
    assert "2 virtual pipeline chunks on pp=1" in written.output and "give --dst-pp > 1" in written.output
    strict = CliRunner().invoke(main, ["convert", str(PLAIN), str(tmp_path / "strict"), "--strict", *flags],
                                prog_name="pgconvert")
    assert strict.exit_code == 2 and "virtual pipeline chunks on pp=1" in strict.output, strict.output
    assert "Traceback" not in strict.output and not (tmp_path / "strict").exists()
    pp2 = CliRunner().invoke(main, ["convert", str(PLAIN), str(tmp_path / "pp2"), "--strict", "--dst-tp", "1",
                                    "--dst-pp", "2", "--dst-vpp", "1", "--skip-optimizer"], prog_name="pgconvert")
    assert pp2.exit_code == 0 and "virtual pipeline chunks" not in pp2.output, pp2.output


def test_a_virtual_pipeline_round_trip_is_bit_exact_in_every_optimizer_tensor(tmp_path: Path) -> None:
    # TP2 x PP2 -> one rank with two model chunks (model0: layer 0 and the embedding, model1: layer 1, the
    # final norm and the output layer), and back: each chunk's parameters come after the previous chunk's.
    vpp = _convert(PLAIN, tmp_path / "vpp", "--dst-tp", "1", "--dst-pp", "1", "--dst-vpp", "2")
    assert vpp.exit_code == 0, vpp.output
    back = _convert(tmp_path / "vpp", tmp_path / "back", "--dst-tp", "2", "--dst-pp", "2")
    assert back.exit_code == 0, back.output
    (state,) = rank_states(tmp_path / "vpp" / "iter_0000002").values()
    assert {"model0", "model1"} <= set(state) and "model" not in state
    groups = state["optimizer"]["param_groups"]
    assert [len(g["params"]) for g in groups] == [10, 5] and len(state["optimizer"]["state"]) == 15
    shapes = [tuple(state["optimizer"]["state"][i]["exp_avg"].shape) for i in groups[0]["params"]]
    # model0's weights (word embeddings, layer 0's proj/qkv/fc1/fc2) precede model1's.
    assert shapes[0] == tuple(state["model0"]["embedding.word_embeddings.weight"].shape)
    assert shapes[-1] == tuple(state["model1"]["output_layer.weight"].shape)
    original, again = rank_states(PLAIN_ITER), rank_states(tmp_path / "back" / "iter_0000002")
    assert set(original) == set(again) and len(original) == 4
    for rank, before in original.items():
        for key in ("optimizer", "opt_param_scheduler", "num_floating_point_operations_so_far", "iteration", "model"):
            assert_same_tree(before[key], again[rank][key], f"{rank}.{key}")


def test_a_virtual_pipeline_round_trip_of_the_distributed_optimizer_is_bit_exact(tmp_path: Path) -> None:
    assert _convert(DISTOPT, tmp_path / "vpp", "--dst-tp", "1", "--dst-vpp", "2").exit_code == 0
    back = _convert(tmp_path / "vpp", tmp_path / "back", "--dst-tp", "2", "--dst-pp", "1", "--dst-vpp", "1")
    assert back.exit_code == 0, back.output
    flat = torch.load(tmp_path / "vpp" / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt", weights_only=True)
    assert sorted(k for k in flat if k != "buckets_coalesced") == [0, 1]  # one buffer per model chunk
    for rank in ("mp_rank_00", "mp_rank_01"):
        assert_same_tree(torch.load(DISTOPT / "iter_0000002" / rank / "distrib_optim.pt", weights_only=True),
                     torch.load(tmp_path / "back" / "iter_0000002" / rank / "distrib_optim.pt", weights_only=True),
                     f"{rank}/distrib_optim.pt")


def test_the_virtual_pipeline_positions_are_megatron_cores_param_groups(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core builds the reference model chunks")
    assert _convert(PLAIN, tmp_path / "vpp", "--dst-tp", "1", "--dst-pp", "1", "--dst-vpp", "2").exit_code == 0
    source = _source(tmp_path / "vpp" / "iter_0000002")
    ((coord, path),) = source.files.items()
    state = safe_torch_load(path)
    slots = optimizer_slots(source.config, source.layout, coord, OptimizerRules.from_args(state["args"], str(path)),
                            source.vocab_rows)
    script = Path(__file__).parent / "support" / "mcore_vpp_param_groups.py"
    done = subprocess.run([sys.executable, "-W", "ignore", str(script), str(path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = json.loads(done.stdout.strip().splitlines()[-1])
    assert [[[slot.chunk, slot.spec.local_name] for slot in group] for group in slots] == expected
    assert {chunk for group in expected for chunk, _ in group} == {0, 1}
