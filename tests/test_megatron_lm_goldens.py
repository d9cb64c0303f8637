"""Files written by Megatron-LM's own tools (tests/data/megatron_lm/, see its README) are read and
converted bit-exact; what pgconvert writes for Megatron carries Megatron's enum classes and sizes."""

from __future__ import annotations

import dataclasses
import os
import pickletools
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from support.checkpoint_compare import assert_same_ranks
from support.tiny_models import GQA_SWIGLU
from support.megatron_fixtures import (load_for_test, make_full_model, read_megatron_checkpoint, read_megatron_checkpoint_ranks,
                               write_megatron_checkpoint)
from support.torch_dist_forms import FOR_MCORE_016

import pgconvert
from pgconvert.formats import megatron as megatron_format
from pgconvert.formats.megatron import _opaque, safe_torch_load

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
CONVERT_PY = sorted(GOLDENS.glob("convert_py_core_tp*"))
# Training checkpoints from Megatron-LM's pretrain_gpt.py / save_checkpoint (see the README there).
TRAIN_PER_RANK = [GOLDENS / "train_tp2pp2_torch", GOLDENS / "train_tp2dp2_distopt_bf16_torch"]
TRAIN_TORCH_DIST = GOLDENS / "train_tp2pp2_bf16_torch_dist"
# what save_checkpoint stores beside the model in a default-flag training run
TRAINING_KEYS = {"args", "checkpoint_version", "iteration", "optimizer", "opt_param_scheduler",
                 "num_floating_point_operations_so_far"}


def _globals_in(path: Path) -> set[str]:
    """The module.name of every class or function a torch.save'd file's pickle names."""
    pickled = torch._C.PyTorchFileReader(str(path)).get_record("data.pkl")
    found = set()
    for opcode, arg, _ in pickletools.genops(pickled):
        if opcode.name == "GLOBAL":
            found.add(arg.replace(" ", "."))
    return found


VOCAB_TABLES = ("embedding.word_embeddings.weight", "output_layer.weight")


def _assert_same_model_tensors(actual: Path, expected: Path, true_vocab: int | None = None) -> None:
    """Same rank files, same tensors (``torch.equal``, same dtype); Megatron-LM's own files also
    hold ``_extra_state: None`` entries for the local spec, which carry nothing.

    ``true_vocab``: ``actual`` came through HF, which keeps the true vocab only: the vocab tables'
    rows past it (Megatron's padding, trained like any row) are compared as zeros."""
    _, actual_ranks = read_megatron_checkpoint_ranks(actual)
    _, expected_ranks = read_megatron_checkpoint_ranks(expected)
    assert sorted(actual_ranks) == sorted(expected_ranks)
    for coord, chunks in expected_ranks.items():
        for chunk, model in chunks.items():
            tensors = {k: v for k, v in model.items() if v is not None}
            got = {k: v for k, v in actual_ranks[coord][chunk].items() if v is not None}
            assert sorted(got) == sorted(tensors), (coord, chunk)
            for key, value in tensors.items():
                if true_vocab is not None and key.endswith(VOCAB_TABLES):
                    value = _zero_padding(value, coord[0], true_vocab)
                assert got[key].dtype == value.dtype and torch.equal(got[key], value), (coord, chunk, key)


def _zero_padding(table: torch.Tensor, tp_rank: int, true_vocab: int) -> torch.Tensor:
    rows = table.shape[0]
    keep = max(0, min(rows, true_vocab - tp_rank * rows))
    return torch.cat([table[:keep], torch.zeros_like(table[keep:])])


def test_goldens_are_there() -> None:
    assert [p.name for p in CONVERT_PY] == ["convert_py_core_tp1", "convert_py_core_tp2"]
    assert all(p.is_dir() for p in [*TRAIN_PER_RANK, TRAIN_TORCH_DIST])
    total = sum(f.stat().st_size for f in (Path(__file__).parent / "data").rglob("*") if f.is_file())
    # 8.2 MB with megatron-core 0.15.0's fully_sharded_model_space golden (382 kB: its own save of the
    # smallest distributed-optimizer run, TP2 DP2; that form cannot be made by the megatron-core that made the others);
    # 8.22 MB with the Megatron-FSDP fsdp_dtensor golden (128 kB, model only); 9.02 MB with the same run's save with
    # its optimizer state (808 kB, most of it Megatron-FSDP's per-parameter param-group entries, each a pickled object);
    # 9.26 MB with Megatron-Bridge's own training save (193 kB, model only) and six providers' run_config.yaml model
    # sections (tests/data/megatron_bridge/); 12.06 MB with Megatron-LM's DeepSeek-V3-shaped Megatron-FSDP save with its
    # optimizer state (2.6 MB: MLA, MoE, MTP; again mostly the per-parameter param-group entries); 12.48 MB with
    # megatron-core 0.15.0's fully_sharded_model_space save of a MoE run's chained dense and expert optimizers (440 kB,
    # most of it per-record serialization over its eight data files); 12.8 MB with megatron-core 0.19.2's save of a
    # plain Muon run (320 kB); 13.0 MB with Megatron-LM's per-rank training save of a plain Muon run (185 kB); 13.19 MB
    # with the same run's with --decoupled-lr (186 kB); 13.71 MB with Megatron-LM's torch_dist saves of a Muon run with
    # the layer-wise distributed optimizer in its two forms (415 kB and 317 kB); 14.18 MB with its torch_dist save of a
    # plain Muon run with MoE at EP2 (471 kB, most of it per-record serialization over four data files); 14.71 MB with
    # the same MoE run's with the layer-wise distributed optimizer (528 kB); 15.21 MB with its per-rank and torch_dist
    # saves of a plain Muon run with Lion (188 kB and 312 kB); 15.80 MB with its saves of a Lion run, per-rank and
    # layer-wise in torch_dist (204 kB and 432 kB)
    assert total < 15_850_000, total


def _dcp_entries(iteration_dir: Path) -> dict[str, object]:
    from torch.distributed.checkpoint import FileSystemReader

    return dict(FileSystemReader(str(iteration_dir)).read_metadata().state_dict_metadata)


def _dcp_model_tensors(root: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a torch_dist checkpoint (global shapes), read by torch's own reader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import TensorStorageMetadata

    iteration_dir = next(p.parent for p in root.rglob("metadata.json"))
    wanted = {key: torch.empty(md.size, dtype=md.properties.dtype) for key, md in _dcp_entries(iteration_dir).items()
              if isinstance(md, TensorStorageMetadata) and key.startswith(("embedding.", "decoder.", "output_layer."))}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(wanted, checkpoint_id=str(iteration_dir), no_dist=True)
    return wanted


def _assert_same_dcp_tensors(actual: Path, expected: Path, true_vocab: int | None = None) -> None:
    got, want = _dcp_model_tensors(actual), _dcp_model_tensors(expected)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if true_vocab is not None and key.endswith(VOCAB_TABLES):  # through HF: see _assert_same_model_tensors
            # An HF source pads to Megatron's default multiple (128), not the golden's own
            assert got[key].dtype == value.dtype and torch.equal(got[key][:true_vocab], value[:true_vocab]), key
            assert not got[key][true_vocab:].any(), key
            continue
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


@pytest.mark.parametrize("golden", TRAIN_PER_RANK, ids=[p.name for p in TRAIN_PER_RANK])
def test_training_golden_holds_what_save_checkpoint_stores(golden: Path) -> None:
    files = sorted(golden.rglob("model_optim_rng.pt"))
    assert len(files) == 4 if "pp2" in golden.name else 2
    for path in files:
        state = safe_torch_load(path)
        assert TRAINING_KEYS <= set(state) and state["iteration"] == 2
        rng = state["rng_state"][0]
        assert {"random_rng_state", "np_rng_state", "torch_rng_state", "rng_tracker_states"} <= set(rng)
        distributed = (path.parent / "distrib_optim.pt").is_file()
        assert distributed == golden.name.startswith("train_tp2dp2_distopt")
        if distributed:
            assert safe_torch_load(path.parent / "distrib_optim.pt")


@pytest.mark.parametrize("golden", TRAIN_PER_RANK, ids=[p.name for p in TRAIN_PER_RANK])
def test_training_golden_converts_bit_exact(tmp_path: Path, golden: Path) -> None:
    args, _ = read_megatron_checkpoint(golden)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    report = pgconvert.convert(golden, tmp_path / "tp1", dst_tp=1, dst_pp=1)
    assert any("optimizer" in notice for notice in report.notices)
    pgconvert.convert(tmp_path / "tp1", tmp_path / "back", dst_tp=tp, dst_pp=pp)
    _assert_same_model_tensors(tmp_path / "back", golden)
    assert pgconvert.verify(golden, tmp_path / "tp1").equal

    report = pgconvert.convert(golden, tmp_path / "hf", dst_format="hf")
    # the local spec's _extra_state entries are None: nothing of Transformer Engine's is dropped
    assert not any("_extra_state" in notice for notice in report.notices), report.notices
    pgconvert.convert(tmp_path / "hf", tmp_path / "from_hf", dst_format="megatron", dst_tp=tp, dst_pp=pp,
                      dst_transformer_impl="local")
    _assert_same_model_tensors(tmp_path / "from_hf", golden, true_vocab=args.vocab_size)

    pgconvert.convert(golden, tmp_path / "dist", dst_format="torch_dist", dst_tp=1)
    pgconvert.convert(tmp_path / "dist", tmp_path / "from_dist", dst_format="megatron", dst_tp=tp, dst_pp=pp)
    _assert_same_model_tensors(tmp_path / "from_dist", golden)

    info = pgconvert.inspect(golden)
    assert not [p for p in info.problems if p.severity == "error"] and info.iteration == 2
    assert info.layout is not None and (info.layout["tp"], info.layout["pp"]) == (tp, pp)


def test_torch_dist_training_golden_stores_common_state_inside() -> None:
    iteration = TRAIN_TORCH_DIST / "iter_0000002"
    entries = _dcp_entries(iteration)
    # Megatron-LM d98e8a64 writes no common.pt: args & co. are the ShardedObject "common_state"
    assert not (iteration / "common.pt").exists() and "common_state/shard_0_1" in entries
    assert any(key.startswith("optimizer.state.fp32_param.") for key in entries)
    assert any(key.startswith("rng_state/") for key in entries)


def test_torch_dist_training_golden_converts_bit_exact(tmp_path: Path) -> None:
    golden = TRAIN_TORCH_DIST
    info = pgconvert.inspect(golden)
    assert not [p for p in info.problems if p.severity == "error"], info.problems
    assert info.layout is not None and (info.layout["tp"], info.layout["pp"]) == (2, 2)
    assert info.dtypes == {"bfloat16": info.tensor_count}

    report = pgconvert.convert(golden, tmp_path / "dist", dst_format="torch_dist", dst_tp=1)
    assert any("optimizer" in notice for notice in report.notices)
    _assert_same_dcp_tensors(tmp_path / "dist", golden)
    assert pgconvert.verify(golden, tmp_path / "dist").equal

    pgconvert.convert(golden, tmp_path / "rank", dst_format="megatron", dst_tp=2, dst_pp=2)
    pgconvert.convert(tmp_path / "rank", tmp_path / "from_rank", dst_format="torch_dist", dst_tp=1)
    _assert_same_dcp_tensors(tmp_path / "from_rank", golden)

    pgconvert.convert(golden, tmp_path / "hf", dst_format="hf")
    pgconvert.convert(tmp_path / "hf", tmp_path / "from_hf", dst_format="torch_dist", dst_tp=1,
                      dst_transformer_impl="local")
    _assert_same_dcp_tensors(tmp_path / "from_hf", golden, true_vocab=63)  # the smaller model (vocab 63)


@pytest.mark.parametrize("golden", CONVERT_PY, ids=[p.name for p in CONVERT_PY])
def test_convert_py_output_round_trips_bit_exact(tmp_path: Path, golden: Path) -> None:
    args, _ = read_megatron_checkpoint(golden)
    tp = args.tensor_model_parallel_size
    # Megatron-LM's saver copies its source's expert TP size (!= tp) into this dense model's args.
    assert args.num_experts is None and args.expert_tensor_parallel_size != tp
    pgconvert.convert(golden, tmp_path / "tp2pp2", dst_tp=2, dst_pp=2)
    pgconvert.convert(tmp_path / "tp2pp2", tmp_path / "back", dst_tp=tp, dst_pp=1)
    _assert_same_model_tensors(tmp_path / "back", golden)

    pgconvert.convert(golden, tmp_path / "hf", dst_format="hf")
    pgconvert.convert(tmp_path / "hf", tmp_path / "from_hf", dst_format="megatron", dst_tp=tp,
                      dst_transformer_impl="local")
    _assert_same_model_tensors(tmp_path / "from_hf", golden)

    pgconvert.convert(golden, tmp_path / "dist", dst_format="torch_dist", dst_tp=1)
    pgconvert.convert(tmp_path / "dist", tmp_path / "from_dist", dst_format="megatron", dst_tp=tp)
    _assert_same_model_tensors(tmp_path / "from_dist", golden)


def test_enums_are_written_back_as_megatron_classes(tmp_path: Path) -> None:
    golden = CONVERT_PY[-1]
    pgconvert.convert(golden, tmp_path / "out", dst_tp=1, dst_pp=2)
    written = sorted((tmp_path / "out").rglob("model_optim_rng.pt"))
    assert len(written) == 2
    names = _globals_in(written[0])
    for name in ("megatron.core.enums.ModelType", "megatron.core.transformer.enums.AttnBackend",
                 "megatron.core.transformer.enums.InferenceCudaGraphScope"):
        assert name in names
    source_args = safe_torch_load(next(golden.rglob("model_optim_rng.pt")))["args"]
    args = safe_torch_load(written[0])["args"]
    for field in ("model_type", "attention_backend", "inference_cuda_graph_scope"):
        value = getattr(args, field)
        assert type(value).qualified_name == type(getattr(source_args, field)).qualified_name
        assert value.value == getattr(source_args, field).value
    assert (args.world_size, args.data_parallel_size, args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size, args.expert_tensor_parallel_size) == (2, 1, 1, 2, 1)


def test_enums_unpickle_as_megatron_core_classes(tmp_path: Path) -> None:
    enums = pytest.importorskip("megatron.core.transformer.enums")
    from megatron.core.enums import ModelType
    from pgconvert.formats.megatron import SAFE_GLOBALS

    pgconvert.convert(CONVERT_PY[-1], tmp_path / "out", dst_tp=1)
    # megatron-core's classes where this version has them (a newer Megatron-LM wrote the golden).
    real = {"megatron.core.enums.ModelType": ModelType, "megatron.core.transformer.enums.AttnBackend": enums.AttnBackend}
    stand_ins = [g for g in SAFE_GLOBALS if not (isinstance(g, tuple) and g[1] in real)]
    with torch.serialization.safe_globals([*stand_ins, *real.values()]):
        state = torch.load(next((tmp_path / "out").rglob("model_optim_rng.pt")), weights_only=True)
    assert type(state["args"].model_type) is ModelType
    assert type(state["args"].attention_backend) is enums.AttnBackend
    assert state["args"].world_size == 1


def test_world_size_describes_the_target_not_the_source_run(tmp_path: Path) -> None:
    model = GQA_SWIGLU
    src = write_megatron_checkpoint(tmp_path / "src", model, make_full_model(model), 2, 1)
    raw = next(src.rglob("model_optim_rng.pt"))
    for path in src.rglob("model_optim_rng.pt"):
        state = load_for_test(path)
        state["args"].world_size, state["args"].data_parallel_size = 8, 4
        torch.save(state, path)
    pgconvert.convert(src, tmp_path / "dst", dst_tp=4, dst_pp=2)
    args, _ = read_megatron_checkpoint(tmp_path / "dst")
    assert (args.world_size, args.data_parallel_size) == (8, 1)
    pgconvert.convert(src, tmp_path / "dst1", dst_tp=1, dst_pp=1)
    args, _ = read_megatron_checkpoint(tmp_path / "dst1")
    assert (args.world_size, args.data_parallel_size) == (1, 1)
    assert raw.is_file()


def test_dense_model_with_a_different_expert_tp_converts(tmp_path: Path) -> None:
    model = GQA_SWIGLU
    full = make_full_model(model)
    src = write_megatron_checkpoint(tmp_path / "src", model, full, 2, 1)
    for path in src.rglob("model_optim_rng.pt"):
        state = load_for_test(path)
        state["args"].expert_tensor_parallel_size = 8
        torch.save(state, path)
    pgconvert.convert(src, tmp_path / "dst", dst_tp=1)
    pgconvert.convert(tmp_path / "dst", tmp_path / "back", dst_tp=2)
    assert_same_ranks(tmp_path / "back", write_megatron_checkpoint(tmp_path / "expected", model, full, 2, 1))


def _training_state(seed: int) -> dict[str, object]:
    """What save_checkpoint puts beside the model (megatron/training/checkpointing.py)."""
    random.seed(seed)
    np.random.seed(seed)
    generator = torch.Generator().manual_seed(seed)
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.empty(0, dtype=torch.uint8),
           "rng_tracker_states": {"model-parallel-rng": generator}}
    rerun = _opaque("megatron.core.rerun_state_machine.RerunMode")[0]
    return {"rng_state": [rng], "rerun_state_machine": {"mode": rerun("disabled")},
            "num_floating_point_operations_so_far": 123.0,
            "optimizer": {"optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 1e-3}]},
                          "fp32_from_fp16_params": [[torch.zeros(3)]], "grad_scaler": {"scale": 1.0}},
            "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": 10}}


@pytest.mark.parametrize("entry", ["numpy_rng", "python_rng", "torch_generator", "numpy1_reconstruct",
                                   "uint32_dtype_class"])
def test_each_new_allowlist_entry_loads(tmp_path: Path, entry: str) -> None:
    np.random.seed(3)
    value = {"numpy_rng": np.random.get_state(), "python_rng": random.getstate(),
             "torch_generator": torch.Generator().manual_seed(5), "numpy1_reconstruct": np.arange(4, dtype=np.uint32),
             "uint32_dtype_class": type(np.dtype(np.uint32))}[entry]
    path = tmp_path / "f.pt"
    torch.save({"value": value}, path)
    if entry == "numpy1_reconstruct":  # as numpy 1.x names the function
        _rename_global(path, b"numpy._core.multiarray", b"numpy.core.multiarray")
        assert "numpy.core.multiarray._reconstruct" in _globals_in(path)
    loaded = safe_torch_load(path)["value"]
    if entry == "numpy_rng":
        assert loaded[0] == value[0] and np.array_equal(loaded[1], value[1]) and loaded[2:] == value[2:]
    elif entry == "torch_generator":
        assert torch.equal(loaded.get_state(), value.get_state())
    elif entry == "numpy1_reconstruct":
        assert np.array_equal(loaded, value)
    else:
        assert loaded == value


def _rename_global(path: Path, old: bytes, new: bytes) -> None:
    with zipfile.ZipFile(path) as archive:
        entries = [(info, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for info, data in entries:
            archive.writestr(info.filename, data.replace(old, new) if info.filename.endswith("data.pkl") else data)


def test_training_checkpoint_state_is_read_and_reported_not_carried(tmp_path: Path) -> None:
    model = GQA_SWIGLU
    full = make_full_model(model)
    src = write_megatron_checkpoint(tmp_path / "src", model, full, 2, 1)
    for tp_rank, path in enumerate(sorted(src.rglob("model_optim_rng.pt"))):
        state = load_for_test(path)
        state.update(_training_state(tp_rank))
        torch.save(state, path, pickle_module=megatron_format.FRAMEWORK_PICKLE)
        torch.save({"param_state": {0: {"exp_avg": torch.ones(4)}}}, path.parent / "distrib_optim.pt")
    # This optimizer state is made up (it does not match the model), so it is skipped explicitly.
    report = pgconvert.convert(src, tmp_path / "dst", dst_tp=1, skip_optimizer=True)
    assert any("optimizer" in notice for notice in report.notices)
    pgconvert.convert(tmp_path / "dst", tmp_path / "back", dst_tp=2)
    assert_same_ranks(tmp_path / "back", write_megatron_checkpoint(tmp_path / "expected", model, full, 2, 1))


@pytest.mark.skipif(not os.environ.get("PGCONVERT_MEGATRON_LM"),
                    reason="needs a Megatron-LM source tree in PGCONVERT_MEGATRON_LM (CI cannot fetch Megatron-LM)")
def test_megatron_lm_accepts_pgconvert_outputs(tmp_path: Path) -> None:
    script = Path(__file__).parents[1] / "scripts" / "interop_megatron_lm.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "interop OK" in done.stdout


def test_torch_dist_without_common_state_is_refused_naming_both_places(tmp_path: Path) -> None:
    pgconvert.convert(CONVERT_PY[0], tmp_path / "dist", dst_format="torch_dist", dst_tp=1, **FOR_MCORE_016)
    common = next((tmp_path / "dist").rglob("common.pt"))
    common.unlink()
    with pytest.raises(pgconvert.PgconvertError, match=r"common.pt: missing, and .metadata has no common_state"):
        pgconvert.convert(tmp_path / "dist", tmp_path / "out", dst_format="hf")


def test_hf_output_names_dropped_transformer_engine_state_only_when_there_is_some(tmp_path: Path) -> None:
    model = dataclasses.replace(GQA_SWIGLU, transformer_impl="transformer_engine")
    src = write_megatron_checkpoint(tmp_path / "src", model, make_full_model(model), 1, 1)
    report = pgconvert.convert(src, tmp_path / "none", dst_format="hf")
    assert not any("_extra_state" in notice for notice in report.notices)
    for path in src.rglob("model_optim_rng.pt"):
        state = load_for_test(path)
        key = next(k for k in state["model"] if k.endswith("._extra_state"))
        state["model"][key] = torch.ones(4, dtype=torch.uint8)  # FP8 scaling metadata, as TE stores it
        torch.save(state, path)
    report = pgconvert.convert(src, tmp_path / "some", dst_format="hf")
    assert any("_extra_state" in notice for notice in report.notices), report.notices


def test_written_args_hold_the_fields_megatron_lm_loaders_read_unconditionally(tmp_path: Path) -> None:
    # tools/checkpoint/saver_base.py: margs.sequence_parallel = md.checkpoint_args.sequence_parallel,
    # and the same for apply_query_key_layer_scaling (no getattr default)
    hf_src = tmp_path / "hf"
    pgconvert.convert(CONVERT_PY[0], hf_src, dst_format="hf")
    pgconvert.convert(hf_src, tmp_path / "tp2pp2", dst_format="megatron", dst_tp=2, dst_pp=2)
    args, _ = read_megatron_checkpoint(tmp_path / "tp2pp2")
    assert (args.sequence_parallel, args.apply_query_key_layer_scaling) == (False, False)
    assert (args.world_size, args.data_parallel_size, args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size, args.transformer_pipeline_model_parallel_size) == (4, 1, 2, 2, 2)
    # a source's own values are kept
    golden = TRAIN_PER_RANK[0]
    pgconvert.convert(golden, tmp_path / "from_golden", dst_tp=1)
    args, _ = read_megatron_checkpoint(tmp_path / "from_golden")
    source = safe_torch_load(next(golden.rglob("model_optim_rng.pt")))["args"]
    assert args.sequence_parallel == source.sequence_parallel
    assert args.apply_query_key_layer_scaling == source.apply_query_key_layer_scaling
