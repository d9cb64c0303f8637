"""Optimizer state of grouped-GEMM experts (TEGroupedMLP) through TP, EP and PP changes.

Neither Transformer Engine (TEGroupedMLP) nor the grouped_gemm package (the legacy GroupedMLP) is installed here,
so megatron-core cannot build a grouped-GEMM MoE on this machine. The state is megatron-core's own for the same model
with SequentialMLP experts (``mcore_moe_optimizer.py``: TP2 x EP2, two AdamW steps, megatron-core's param groups and
``_ParamAndGradBuffer`` offsets), converted by pgconvert to the Transformer Engine spec with grouped experts. The
per-expert tensors are the same values under other names in another order; the order each test expects is written
here from Transformer Engine's source, independently of pgconvert's:

- TEGroupedMLP (megatron/core/transformer/moe/experts.py, 0.16.1) registers ``linear_fc1`` then ``linear_fc2``;
- te.pytorch.GroupedLinear.__init__ (transformer_engine/pytorch/module/grouped_linear.py, v2.9 lines 646-678,
  d0067d0 lines 1738-1770) registers, for i in range(num_gemms), ``weight{i}`` then, with a bias, ``bias{i}``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from support.cli_helpers import assert_clean_refusal
from support.megatron_fixtures import assert_same_tree, load_for_test
from support.moe_optimizer_runs import ITER, assert_optimizer_files_equal, generate, rank_files
from support.checkpoint_compare import read_common
from pgconvert.cli import main
from pgconvert.formats import LoadOptions
from pgconvert.model.grid import RankCoord
from pgconvert.model.layout import ParallelLayout
from pgconvert.loaders.megatron import MegatronSource
from pgconvert.optimizer.flat import flat_buffers
from pgconvert.optimizer.order import OptimizerRules, chained_slots, named_parameters

pytest.importorskip("megatron.core", reason="megatron-core lays out the reference optimizer state")


GROUPED = ("--dst-transformer-impl", "transformer_engine", "--dst-expert-layout", "grouped")
BUFFER_SCRIPT = Path(__file__).parent / "support" / "mcore_grouped_buffer.py"
MOE_LAYERS = (0, 2, 3)  # support.tiny_models.MOE: moe_layer_freq [1, 0, 1, 1]


def te_grouped_order(experts: int, bias: bool) -> list[str]:
    """TEGroupedMLP's parameters relative to ``mlp.experts.``, in registration order (see the module docstring)."""
    kinds = ("weight", "bias") if bias else ("weight",)
    return [f"{fc}.{kind}{i}" for fc in ("linear_fc1", "linear_fc2") for i in range(experts) for kind in kinds]


def sequential_name(grouped: str) -> str:
    """``…mlp.experts.linear_fc1.weight3`` -> ``…mlp.experts.local_experts.3.linear_fc1.weight``."""
    match = re.fullmatch(r"(.*mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)", grouped)
    assert match is not None, grouped
    return f"{match[1]}local_experts.{match[4]}.{match[2]}.{match[3]}"


def _cli(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args], prog_name="pgconvert")


def _convert(src: Path, dst: Path, *flags: str) -> None:
    result = _cli("convert", src, dst, "-q", "--strict", *flags)
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate(tmp_path_factory.mktemp("grouped_gemm") / "plain", 2, 1, 2, "fp32")


@pytest.fixture(scope="module")
def grouped(plain: Path) -> Path:
    _convert(plain, plain.parent / "grouped", *GROUPED)
    return plain.parent / "grouped"


@pytest.fixture(scope="module")
def distributed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = generate(tmp_path_factory.mktemp("grouped_gemm") / "dist", 2, 1, 2, "distributed")
    _convert(root, root.parent / "grouped", *GROUPED)
    return root


def _assert_same_files(original: Path, again: Path) -> None:
    before, after = rank_files(original), rank_files(again)
    assert set(before) == set(after) and len(before) >= 4
    for name, content in before.items():
        if name.endswith("model_optim_rng.pt"):
            for key in ("optimizer", "model", "iteration"):
                assert_same_tree(content[key], after[name][key], f"{name}.{key}")  # type: ignore[index]
        else:
            assert_same_tree(content, after[name], name)


def test_expert_positions_follow_te_grouped_linear_with_megatron_cores_values(plain: Path, grouped: Path) -> None:
    # EP 2: the expert-parallel optimizer holds the routed experts alone, one group (no biases): its positions are
    # TEGroupedMLP's registration order, layer by layer, and each holds megatron-core's state of that expert tensor.
    positions = json.loads((plain.parent / "plain.positions.json").read_text())
    originals, converted = rank_files(plain), rank_files(grouped)
    for rank, mcore_names in positions.items():
        expected = [f"decoder.layers.{layer}.mlp.experts.{name}" for layer in MOE_LAYERS
                    for name in te_grouped_order(4, bias=False)]
        source = originals[f"{rank}/model_optim_rng.pt"]
        target = converted[f"{rank}/model_optim_rng.pt"]
        optimizer = target["optimizer"][1]  # type: ignore[index]
        assert optimizer["param_groups"][0]["params"] == list(range(len(expected)))
        mcore_position = {name: index for index, name in enumerate(mcore_names[1][0])}
        for position, name in enumerate(expected):
            mine = optimizer["state"][position]
            theirs = source["optimizer"][1]["state"][mcore_position[sequential_name(name)]]  # type: ignore[index]
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(mine[key], theirs[key]), (rank, name, key)
            assert torch.equal(target["model"][name], source["model"][sequential_name(name)])  # type: ignore[index]
        loaded = MegatronSource(grouped / ITER, 2, False, LoadOptions())
        assert loaded.config.moe_grouped_gemm and loaded.config.transformer_impl == "transformer_engine"


def test_ep1_dense_positions_permute_each_layers_experts_only(plain: Path, tmp_path: Path) -> None:
    # EP 1: the experts are allreduce parameters in the one optimizer's weight-decay group, between the router and
    # the shared experts of their layer; only their run is reordered against SequentialMLP's (TE spec both ways).
    _convert(plain, tmp_path / "seq", "--dst-tp", "1", "--dst-ep", "1", "--dst-transformer-impl", "transformer_engine")
    _convert(plain, tmp_path / "grp", "--dst-tp", "1", "--dst-ep", "1", *GROUPED)
    seq, grp = (rank_files(tmp_path / name)["mp_rank_00/model_optim_rng.pt"] for name in ("seq", "grp"))
    seq_source = MegatronSource(tmp_path / "seq" / ITER, 2, False, LoadOptions())
    grp_source = MegatronSource(tmp_path / "grp" / ITER, 2, False, LoadOptions())
    coord = RankCoord(0, 0, 0)
    seq_names = [s.spec.local_name for s in chained_slots(seq_source.config, seq_source.layout, coord,
                                                          padded_vocab_size=seq_source.vocab_rows)[0][0]]
    grp_names = [s.spec.local_name for s in chained_slots(grp_source.config, grp_source.layout, coord,
                                                          padded_vocab_size=grp_source.vocab_rows)[0][0]]
    expected = list(seq_names)
    for layer in MOE_LAYERS:
        prefix = f"decoder.layers.{layer}.mlp.experts."
        run = [index for index, name in enumerate(seq_names) if name.startswith(prefix)]
        assert run == list(range(run[0], run[0] + 16))
        expected[run[0]:run[-1] + 1] = [prefix + name for name in te_grouped_order(8, bias=False)]
    assert grp_names == expected
    by_name = dict(zip(seq_names, range(len(seq_names))))
    for position, name in enumerate(grp_names):
        theirs = seq["optimizer"]["state"][by_name[sequential_name(name) if ".mlp.experts.linear" in name else name]]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(grp["optimizer"]["state"][position][key], theirs[key]), name


def test_grouped_plain_reshards_ep_tp_pp_and_back_bit_exact(plain: Path, grouped: Path, tmp_path: Path) -> None:
    _convert(grouped, tmp_path / "ep1", "--dst-ep", "1")
    _convert(tmp_path / "ep1", tmp_path / "ep2", "--dst-ep", "2")
    _assert_same_files(grouped, tmp_path / "ep2")
    _convert(grouped, tmp_path / "tp1ep4", "--dst-tp", "1", "--dst-ep", "4")
    (state,) = [v for k, v in rank_files(tmp_path / "tp1ep4").items() if k.startswith("mp_rank_00_003")]
    assert "decoder.layers.3.mlp.experts.linear_fc2.weight1" in state["model"]  # type: ignore[index]
    assert [len(g["params"]) for g in state["optimizer"][1]["param_groups"]] == [12]  # type: ignore[index]
    _convert(tmp_path / "tp1ep4", tmp_path / "back", "--dst-tp", "2", "--dst-ep", "2")
    _assert_same_files(grouped, tmp_path / "back")
    _convert(grouped, tmp_path / "pp2", "--dst-tp", "1", "--dst-pp", "2")
    _convert(tmp_path / "pp2", tmp_path / "pp1", "--dst-tp", "2", "--dst-pp", "1")
    _assert_same_files(grouped, tmp_path / "pp1")
    # and to megatron-core's own SequentialMLP state, local spec, from the EP4 grouped files
    _convert(tmp_path / "tp1ep4", tmp_path / "local", "--dst-tp", "2", "--dst-ep", "2", "--dst-transformer-impl",
             "local", "--dst-expert-layout", "sequential")
    _assert_same_files(plain, tmp_path / "local")


def test_grouped_float16_optimizer_round_trips(tmp_path: Path) -> None:
    source = generate(tmp_path / "bf16", 2, 1, 2, "bf16")
    _convert(source, tmp_path / "grp", "--dst-ep", "1", "--dst-tp", "1", *GROUPED)
    optimizer = rank_files(tmp_path / "grp")["mp_rank_00/model_optim_rng.pt"]["optimizer"]  # type: ignore[index]
    assert [len(group) for group in optimizer["fp32_from_fp16_params"]] == [24 + 48, 9]
    _convert(tmp_path / "grp", tmp_path / "back", "--dst-ep", "2", "--dst-tp", "2", "--dst-transformer-impl", "local",
             "--dst-expert-layout", "sequential")
    _assert_same_files(source, tmp_path / "back")


def _buffer_layouts(lists: dict[str, list[tuple[str, list[int]]]], tmp: Path) -> dict[str, dict]:
    (tmp / "in.json").write_text(json.dumps(lists))
    done = subprocess.run([sys.executable, "-W", "ignore", str(BUFFER_SCRIPT), str(tmp / "in.json"),
                           str(tmp / "out.json")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((tmp / "out.json").read_text())


def test_grouped_expert_buffer_is_megatron_cores_param_and_grad_buffer(distributed: Path, tmp_path: Path) -> None:
    # The expert-parallel DDP buffer of EP rank 1: megatron-core's _ParamAndGradBuffer given TEGroupedMLP's
    # parameters in TE's registration order puts each one where pgconvert wrote its state, and that state is the
    # one megatron-core's own buffer (SequentialMLP order) held for the same expert tensor.
    positions = json.loads((distributed.parent / "dist.positions.json").read_text())
    rank = "mp_rank_00_001"
    source = load_for_test(distributed / ITER / rank / "model_optim_rng.pt")
    shapes = {name: list(tensor.shape) for name, tensor in source["model"].items() if "experts.local" in name}
    grouped_names = [f"decoder.layers.{layer}.mlp.experts.{name}" for layer in MOE_LAYERS
                     for name in te_grouped_order(4, bias=False)]
    layouts = _buffer_layouts({"sequential": [(name, shapes[name]) for name in positions[rank][1][0]],
                               "grouped": [(name, shapes[sequential_name(name)]) for name in grouped_names]}, tmp_path)
    ours = torch.load(distributed.parent / "grouped" / ITER / rank / "distrib_optim.pt", weights_only=True)[1][0]
    theirs = torch.load(distributed / ITER / rank / "distrib_optim.pt", weights_only=True)[1][0]
    ((_, ours),), ((_, theirs),) = ours.items(), theirs.items()
    assert ours["numel_unpadded"] == layouts["grouped"]["numel"] == layouts["sequential"]["numel"]
    for name, (start, end) in layouts["grouped"]["ranges"].items():
        other = layouts["sequential"]["ranges"][sequential_name(name)]
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(ours[key][start:end], theirs[key][other[0]:other[1]]), (name, key)


def test_grouped_distributed_reshards_and_comes_back(distributed: Path, tmp_path: Path) -> None:
    grouped = distributed.parent / "grouped"
    _convert(grouped, tmp_path / "one", "--dst-tp", "1", "--dst-ep", "1")
    assert isinstance(rank_files(tmp_path / "one")["mp_rank_00/distrib_optim.pt"], dict)
    _convert(tmp_path / "one", tmp_path / "back", "--dst-tp", "2", "--dst-ep", "2")
    _assert_same_files(grouped, tmp_path / "back")
    _convert(tmp_path / "one", tmp_path / "local", "--dst-tp", "2", "--dst-ep", "2", "--dst-transformer-impl", "local",
             "--dst-expert-layout", "sequential")
    _assert_same_files(distributed, tmp_path / "local")


def test_grouped_torch_dist_records_are_sequential_ones(distributed: Path, tmp_path: Path) -> None:
    # TEGroupedLinear._sharded_state_dict_grouped keys each expert as SequentialMLP does (experts.linear_fc1.weight on
    # the global expert axis), so the fully_reshardable records of both expert layouts (TE spec) are the same, bit
    # for bit.
    import torch.distributed.checkpoint as dcp

    from pgconvert.formats.torch_dist import read_dcp_metadata

    _convert(distributed.parent / "grouped", tmp_path / "grp", "--dst-format", "torch_dist")
    _convert(distributed, tmp_path / "seq", "--dst-format", "torch_dist", "--dst-transformer-impl", "transformer_engine")
    records = []
    for name in ("grp", "seq"):
        metadata = read_dcp_metadata(tmp_path / name / ITER / ".metadata").state_dict_metadata
        wanted = {key: torch.empty(md.size, dtype=md.properties.dtype) for key, md in metadata.items()
                  if key.startswith("optimizer.") and hasattr(md, "size")}
        with pytest.warns(UserWarning, match="single process"):
            dcp.load(wanted, checkpoint_id=str(tmp_path / name / ITER), no_dist=True)
        records.append(wanted)
    assert set(records[0]) == set(records[1]) and len(records[0]) == 117
    assert "optimizer.state.exp_avg.decoder.layers.3.mlp.experts.experts.linear_fc2.weight" in records[0]
    for key, tensor in records[0].items():
        assert torch.equal(tensor, records[1][key]), key
    common = read_common(tmp_path / "grp" / ITER)
    assert common["args"].moe_grouped_gemm is True
    _convert(tmp_path / "grp", tmp_path / "back", "--dst-format", "megatron")
    # distrib_optim.pt bit for bit; the rank files' model, iteration and param groups
    assert_optimizer_files_equal(distributed.parent / "grouped", tmp_path / "back")


def test_local_spec_grouped_gemm_and_its_variants_are_refused_by_name(grouped: Path, plain: Path,
                                                                       tmp_path: Path) -> None:
    # The local spec never builds per-expert weight{i}: megatron-core 0.16.1 builds the legacy GroupedMLP.
    result = _cli("convert", plain, tmp_path / "local", "--dst-expert-layout", "grouped")
    assert_clean_refusal(result, 2, "moe_grouped_gemm=True with transformer_impl='local'", "GroupedMLP",
                         "--skip-optimizer")
    assert not (tmp_path / "local").exists()
    for flag in ("moe_use_legacy_grouped_gemm", "moe_single_grouped_weight"):
        copy = tmp_path / flag
        _convert(grouped, copy, "--dst-ep", "1", "--dst-tp", "1")
        path = copy / ITER / "mp_rank_00" / "model_optim_rng.pt"
        state = load_for_test(path)
        setattr(state["args"], flag, True)
        torch.save(state, path)
        result = _cli("convert", copy, tmp_path / f"{flag}_out", "--strict")
        assert_clean_refusal(result, 2, f"args.{flag}=True with moe_grouped_gemm", "pass --skip-optimizer")
        loose = _cli("convert", copy, tmp_path / f"{flag}_loose")
        assert loose.exit_code == 0 and f"optimizer state not carried: {path}: args.{flag}=True" in loose.output
        assert _cli("convert", copy, tmp_path / f"{flag}_skip", "--skip-optimizer", "-q", "--strict").exit_code == 0


def test_a_grouped_expert_count_that_does_not_match_is_a_named_error(grouped: Path, tmp_path: Path) -> None:
    _convert(grouped, tmp_path / "src", "--dst-ep", "1", "--dst-tp", "1")
    path = tmp_path / "src" / ITER / "mp_rank_00" / "model_optim_rng.pt"
    state = load_for_test(path)
    # A grouped-GEMM MoE layer's optimizer with one expert parameter short: the positions no longer fit the model.
    group = state["optimizer"]["param_groups"][0]
    dropped = group["params"].pop()
    state["optimizer"]["state"].pop(dropped)
    torch.save(state, path)
    result = _cli("convert", tmp_path / "src", tmp_path / "out")
    assert_clean_refusal(result, 1, "mp_rank_00/model_optim_rng.pt", "optimizer.param_groups[0].params",
                         "48 of them are grouped-GEMM expert parameters", "8 local experts in 3 MoE layer(s)")
    assert not (tmp_path / "out").exists()


def test_expert_biases_follow_each_weight_in_module_and_buffer_order(grouped: Path, tmp_path: Path) -> None:
    # add_bias_linear (GPT-OSS-like experts): GroupedLinear registers bias{i} right after weight{i}; the biases
    # (1-dim) go to the no-weight-decay group, and megatron-core's _ParamAndGradBuffer, given the parameters in that
    # order, puts each where pgconvert's flat_buffers does.
    source = MegatronSource(grouped / ITER, 2, False, LoadOptions())
    config = dataclasses.replace(source.config, add_bias_linear=True, moe_shared_expert_intermediate_size=None,
                                 moe_shared_expert_gate=False)
    layout = ParallelLayout(tp=1, pp=1, ep=2)
    coord = RankCoord(0, 0, 1)
    names = [spec.local_name for _, spec in named_parameters(config, layout, coord)]
    prefix = "decoder.layers.2.mlp.experts."
    assert [name[len(prefix):] for name in names if name.startswith(prefix)] == te_grouped_order(4, bias=True)
    expert_groups = chained_slots(config, layout, coord)[1]
    assert [slot.spec.local_name[len(prefix):] for slot in expert_groups[1] if slot.spec.local_name.startswith(prefix)] \
        == [name for name in te_grouped_order(4, bias=True) if ".bias" in name]
    specs = {spec.local_name: spec for _, spec in named_parameters(config, layout, coord)}
    listed = [f"decoder.layers.{layer}.mlp.experts.{name}" for layer in MOE_LAYERS
              for name in te_grouped_order(4, bias=True)]
    layouts = _buffer_layouts({"experts": [(name, list(specs[name].local_shape)) for name in listed]}, tmp_path)
    ((placed, numel),) = flat_buffers(config, layout, coord, OptimizerRules(), None, optimizer=1)
    assert numel == layouts["experts"]["numel"]
    assert {item.slot.spec.local_name: [item.start, item.end] for item in placed} == layouts["experts"]["ranges"]
