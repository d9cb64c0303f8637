"""pgconvert's torch_dist format against megatron-core 0.19.2, the newest release, in a venv of its own.

megatron-core 0.17 and later need Python >= 3.12, and pgconvert's test venv (and CI) runs 0.16.1; so these tests
run megatron-core's jobs (``support.mcore_torch_dist_job``: gloo CPU ranks, the same calls as for 0.16.1) with
the interpreter ``PGCONVERT_MCORE019_PYTHON`` names (default ``/work/venvs/mcore019/bin/python``), and are
skipped where it does not exist or holds another megatron-core. That venv: Python 3.12, torch 2.13.0 and
``megatron-core==0.19.2`` (README, "Tests against megatron-core 0.19").

What 0.19.2 checks:

1. It loads pgconvert's default torch_dist output, in its own form (``--dst-torch-dist-common store``: the common
   state inside the checkpoint, ``integrity.json``) with ``dist_checkpointing.load(verify_integrity=True,
   strict="raise_all")`` and ``load_state_dict(strict=True)``, into a TP2 model from TP1-recorded args; every
   tensor is the fixture's slice for its rank.
2. A checkpoint it saves itself at TP2 (gloo ranks, ``verify_integrity=True``: common state in the store and the
   manifest) is read by pgconvert, manifest checked, to the fixture's per-rank files and to HF, bit for bit.
3. A changed byte: pgconvert refuses it with ``--verify-integrity`` (``IntegrityError``), and so does 0.19.2's own
   integrity check with ``verify_integrity=True``.
4. For a single rank, pgconvert writes what 0.19.2's ``dist_checkpointing.save`` writes: ``metadata.json``, the
   common state's entries, every key, chunk and tensor, and the manifest's layout (pgconvert's manifest writer
   gives 0.19.2's own ``integrity.json`` bytes for 0.19.2's files).
5. MTP: 0.19.2's GPTModel with a multi-token-prediction layer (``mtp_model_layer`` in the module) loads
   pgconvert's per-rank file written with ``--dst-mtp-layer-name mtp_model_layer`` strictly, and its
   sharded_state_dict declares exactly the torch_dist keys and chunks pgconvert writes (``transformer_layer``).
6. Optimizer: 0.19.2's own GPTModel, DDP and DistributedOptimizer (``support/mcore_optimizer_step.py``) load
   pgconvert's TP1 torch_dist conversion of Megatron-LM's TP2 DP2 distributed-optimizer goldens (fully_reshardable
   at DP2, dp_reshardable at DP1; the default form) with ``dist_checkpointing.load`` and take one step on fixed
   gradients equal to the step 0.19.2 takes from the golden itself.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from support.checkpoint_compare import assert_same_ranks, read_common
from support.megatron_fixtures import _rank_state_dict, make_full_model, write_megatron_checkpoint

import pgconvert
from pgconvert.errors import IntegrityError
from pgconvert.formats.torch_dist_integrity import manifest_text

PYTHON = os.environ.get("PGCONVERT_MCORE019_PYTHON", "/work/venvs/mcore019/bin/python")
VERSION = "0.19.2"
ITERATION_DIR = "iter_0000100"
NAME = "gqa_swiglu_rmsnorm_llama"  # support.mcore_torch_dist_job.MODELS: Llama's architecture, so HF can hold it


def _client_version() -> str | None:
    if not Path(PYTHON).is_file():
        return None
    probe = subprocess.run([PYTHON, "-c", "import megatron.core; print(megatron.core.__version__)"],
                           capture_output=True, text=True, timeout=300)
    return probe.stdout.strip() if probe.returncode == 0 else None


_FOUND = _client_version()
pytestmark = pytest.mark.skipif(
    _FOUND != VERSION,
    reason=f"megatron-core {VERSION} venv not found: set PGCONVERT_MCORE019_PYTHON to a Python >= 3.12 with "
           f"torch and megatron-core=={VERSION} ({PYTHON}: {_FOUND or 'absent'})")


def run_job(action: str, ckpt: Path, out: Path, tp: int, check: bool = True,
            **options: bool) -> subprocess.CompletedProcess[str]:
    from support.mcore_torch_dist_job import run_megatron_core  # imports megatron-core 0.16.1 in this process

    return run_megatron_core(action, NAME, ckpt, out, tp=tp, seed=7, python=PYTHON, check=check, **options)


@pytest.fixture(scope="module")
def model() -> object:
    from support.mcore_torch_dist_job import MODELS

    return MODELS[NAME]


def pgconvert_store(tmp_path: Path, model: object, tp: int = 1, digest: str = "sha256") -> Path:
    """The default form (0.19's), with its integrity.json unless ``digest`` is another than sha256."""
    src = write_megatron_checkpoint(tmp_path / f"megatron-{digest}", model, make_full_model(model, seed=7), 2, 1)
    dst = tmp_path / f"dist-{digest}"
    pgconvert.convert(src, dst, dst_format="torch_dist", dst_tp=tp, digest=digest)
    return dst


def test_megatron_core_019_loads_pgconverts_output_in_its_own_form(tmp_path: Path, model: object) -> None:
    from support.mcore_torch_dist_job import loaded_ranks

    dist = pgconvert_store(tmp_path, model)
    assert not (dist / ITERATION_DIR / "common.pt").exists() and (dist / ITERATION_DIR / "integrity.json").is_file()

    run_job("load", dist / ITERATION_DIR, tmp_path / "job", tp=2, verify_integrity=True, strict=True)
    # The default digest: no integrity.json, as Megatron-LM saves without --verify-integrity, and loads so.
    plain = pgconvert_store(tmp_path, model, digest="xxh3-128")
    assert not (plain / ITERATION_DIR / "integrity.json").exists()
    run_job("load", plain / ITERATION_DIR, tmp_path / "job-plain", tp=2, strict=True)

    full = make_full_model(model, seed=7)
    for job in ("job", "job-plain"):
        ranks = loaded_ranks(tmp_path / job)
        assert sorted(ranks) == [(0, 0, 0), (1, 0, 0)]
        for (tp_rank, _, _), loaded in ranks.items():
            expected = _rank_state_dict(model, full, tp_rank, 2, 0, 1, range(model.num_layers))
            assert sorted(loaded["state"]) == sorted(k for k, v in expected.items() if v is not None)
            for key, tensor in loaded["state"].items():
                assert tensor.dtype == expected[key].dtype and torch.equal(tensor, expected[key]), (job, key)


def test_a_checkpoint_megatron_core_019_saves_converts_bit_exact(tmp_path: Path, model: object) -> None:
    root = tmp_path / "mcore"
    run_job("save", root / ITERATION_DIR, tmp_path / "job", tp=2, verify_integrity=True)
    (root / "latest_checkpointed_iteration.txt").write_text("100")
    iteration_dir = root / ITERATION_DIR
    assert not (iteration_dir / "common.pt").exists()  # 0.19's form: the common state in the store
    assert json.loads((iteration_dir / "metadata.json").read_text()) == {"sharded_backend": "torch_dist",
                                                                         "sharded_backend_version": 1}
    manifest = json.loads((iteration_dir / "integrity.json").read_text())
    assert manifest["algorithm"] == "sha256" and ".metadata" in manifest["files"]
    assert read_common(iteration_dir)["args"].tensor_model_parallel_size == 2

    report = pgconvert.convert(root, tmp_path / "tp1", src_format="torch_dist", dst_format="megatron", dst_tp=1)
    pgconvert.convert(root, tmp_path / "hf", src_format="torch_dist", dst_format="hf")

    assert report.src_layout == "tp=2,pp=1"
    expected = write_megatron_checkpoint(tmp_path / "expected", model, make_full_model(model, seed=7), 1, 1)
    assert_same_ranks(tmp_path / "tp1", expected)
    hf = pgconvert.verify(tmp_path / "hf", expected)
    assert hf.equal and hf.compared > 0


def test_a_changed_byte_is_caught_by_pgconvert_and_by_megatron_core_019(tmp_path: Path, model: object) -> None:
    dist = pgconvert_store(tmp_path, model)
    data = dist / ITERATION_DIR / "__0_0.distcp"
    content = bytearray(data.read_bytes())
    content[len(content) // 2] ^= 0x01
    data.write_bytes(bytes(content))

    with pytest.raises(IntegrityError, match="__0_0.distcp: sha256"):
        pgconvert.convert(dist, tmp_path / "back", dst_format="megatron", verify_integrity=True)
    theirs = run_job("load", dist / ITERATION_DIR, tmp_path / "job", tp=1, check=False, verify_integrity=True)

    assert theirs.returncode != 0
    assert "Checkpoint integrity verification failed" in theirs.stderr and "__0_0.distcp: hash mismatch" in theirs.stderr


def test_pgconvert_writes_what_megatron_core_019_writes_for_a_single_rank(tmp_path: Path, model: object) -> None:
    from support.checkpoint_compare import read_dcp
    from support.mcore_gpt_models import read_layout

    theirs = tmp_path / "mcore" / ITERATION_DIR
    run_job("save", theirs, tmp_path / "job", tp=1, verify_integrity=True)

    ours = pgconvert_store(tmp_path, model) / ITERATION_DIR

    assert json.loads((ours / "metadata.json").read_text()) == json.loads((theirs / "metadata.json").read_text())
    common_ours, common_theirs = read_common(ours), read_common(theirs)
    assert sorted(common_ours) == sorted(common_theirs)
    assert common_ours["content_metadata"] == common_theirs["content_metadata"]
    assert read_layout(ours) == read_layout(theirs)  # every key, shape, dtype and chunk; common_state among the objects
    _, ours_tensors = read_dcp(ours)
    _, theirs_tensors = read_dcp(theirs)
    assert sorted(ours_tensors) == sorted(theirs_tensors)
    assert all(torch.equal(ours_tensors[key], theirs_tensors[key]) for key in theirs_tensors)
    for directory in (ours, theirs):  # the manifest's layout: every other file of the directory, by name
        manifest = json.loads((directory / "integrity.json").read_text())
        assert list(manifest) == ["algorithm", "files"] and manifest["algorithm"] == "sha256"
        assert list(manifest["files"]) == sorted(p.name for p in directory.iterdir() if p.name != "integrity.json")
    # pgconvert's manifest writer gives megatron-core's own bytes for megatron-core's files.
    assert manifest_text(theirs) == (theirs / "integrity.json").read_text()


def test_megatron_core_019s_mtp_layer_loads_mtp_model_layer_and_declares_transformer_layer_keys(tmp_path: Path) -> None:
    # 0.19.2's MultiTokenPredictionLayer holds its layer as mtp_model_layer (a per-rank file's spelling, which
    # --dst-mtp-layer-name writes) and maps it back to transformer_layer in its sharded_state_dict (torch_dist).
    from support.mcore_gpt_models import read_layout
    from support.mcore_torch_dist_job import REPO
    from support.mtp_models import with_mtp

    src = with_mtp("v3", tmp_path / "hf")
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=1, dst_pp=1, dst_ep=1,
                      dst_mtp_layer_name="mtp_model_layer")
    pgconvert.convert(tmp_path / "megatron", tmp_path / "dist", dst_format="torch_dist", dst_torch_dist_common="store")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    job = subprocess.run([PYTHON, str(REPO / "tests" / "support" / "mcore_mtp_model.py"), str(tmp_path / "megatron"),
                          str(tmp_path / "layout.json")], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stderr[-6000:]
    declared = json.loads((tmp_path / "layout.json").read_text())

    assert any(name.startswith("mtp.layers.0.mtp_model_layer.") for name in declared["mtp_names"])
    (iteration,) = (tmp_path / "dist").glob("iter_*")
    tensors, objects = read_layout(iteration)
    assert objects == sorted([*declared["objects"], "common_state/shard_0_1"])
    assert [key for key in declared["tensors"] if key.startswith("mtp.layers.0.transformer_layer.")]
    assert sorted(tensors) == sorted(declared["tensors"])
    for key, (shape, chunks) in declared["tensors"].items():
        assert list(tensors[key][0]) == shape and [[list(o), list(s)] for o, s in tensors[key][2]] == chunks, key


GOLDENS = Path(__file__).parent / "data" / "megatron_lm"


@pytest.mark.parametrize(("form", "target_dp"), [("fully_reshardable", 2), ("dp_reshardable", 1)])
def test_megatron_core_019_loads_the_optimizer_state_and_steps_as_the_original(tmp_path: Path, form: str,
                                                                                target_dp: int) -> None:
    from support.mcore_step_check import BF16_ATOL, BF16_RTOL, assert_same_step, fixed_gradients, run_steps

    source = GOLDENS / f"train_tp2dp2_distopt_{form}_torch_dist"
    pgconvert.convert(source, tmp_path / "td1", dst_format="torch_dist", dst_tp=1)
    pgconvert.convert(source, tmp_path / "model", dst_format="megatron", dst_tp=1, skip_optimizer=True)
    fixed_gradients(tmp_path / "model", tmp_path / "grads.pt", scale=3e-2)
    runs = [(tmp_path / "td1" / "iter_0000002", tmp_path / "out_td1", target_dp),
            (source / "iter_0000002", tmp_path / "out_src", 2)]
    target, original = run_steps(tmp_path / "grads.pt", runs, python=PYTHON)
    assert len(target) == target_dp and len(original) == 4
    args = read_common(source / "iter_0000002")["args"]
    assert args.use_distributed_optimizer and args.bf16
    assert_same_step(target, original, args, (BF16_RTOL, BF16_ATOL))
