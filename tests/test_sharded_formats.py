"""hf, torch_dist and fsdp_dtensor destinations written by several processes: --workers, --shard-index/--num-shards and a
torchrun launch give the single-process output byte for byte, each process reads only what its share needs, and a
failed share leaves no complete-looking output."""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.checkpoint_compare import integrity_manifest_of
from support.format_outputs import SHARD_SIZE, assert_same_bytes, write_sources
from support.hf_helpers import build_hf_model
from support.torchrun import run_torchrun

import pgconvert
from pgconvert.cli import main
from pgconvert.formats import LoadOptions
from pgconvert.formats.registry import get_loader
from pgconvert.run.convert import convert_request, plan
from pgconvert.run.sharded import balanced_shares

FORMATS = ["hf", "torch_dist"]
# The outputs compared with their single-process conversion: each format, and torch_dist in megatron-core 0.19's
# form (common state in the store, integrity.json with sha256 digests), whose common state and manifest are written
# by the finalizer.
VARIANTS = {"hf": ("hf", ()), "torch_dist": ("torch_dist", ()),
            "torch_dist_store": ("torch_dist", ("--dst-torch-dist-common", "store", "--digest", "sha256")),
            "fsdp_dtensor": ("fsdp_dtensor", ())}
# What makes each destination loadable: without it a directory is not a checkpoint of its format.
COMPLETE_MARKERS = {"hf": ("config.json", "model.safetensors.index.json"),
                    "torch_dist": ("latest_checkpointed_iteration.txt", "iter_0000100/metadata.json",
                                   "iter_0000100/.metadata")}


def _data_files(root: Path, dst_format: str) -> list[Path]:
    return sorted(root.rglob("*.safetensors" if dst_format == "hf" else "*.distcp"))


def _convert(src: Path, dst: Path, variant: str, *flags: str) -> None:
    dst_format, variant_flags = VARIANTS[variant]
    result = CliRunner().invoke(main, ["-q", "--dst-format", dst_format, *SHARD_SIZE, *variant_flags, *flags, str(src),
                                       str(dst)])
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny HF model (for an hf destination: transformers checks what it loads against it; and fsdp_dtensor, which
    holds dense models) and a TP2 Megatron checkpoint with experts (for torch_dist), each with its single-process
    conversion."""
    root = tmp_path_factory.mktemp("sources")
    written = write_sources(root)
    made = {"hf": written["hf"], "torch_dist": written["megatron"], "torch_dist_store": written["megatron"],
            "fsdp_dtensor": written["hf"]}
    for dst_format, src in list(made.items()):
        _convert(src, root / f"{dst_format}_single", dst_format)
        made[f"{dst_format}_single"] = root / f"{dst_format}_single"
    return made


@pytest.mark.parametrize("dst_format", sorted(VARIANTS))
def test_workers_write_the_single_process_output(sources: dict[str, Path], dst_format: str, tmp_path: Path) -> None:
    single = sources[f"{dst_format}_single"]
    assert len(_data_files(single, VARIANTS[dst_format][0])) > 2  # the split is exercised

    _convert(sources[dst_format], tmp_path / "workers", dst_format, "--workers", "2")

    assert_same_bytes(tmp_path / "workers", single)
    assert (tmp_path / "workers" / "pgconvert.json").is_file()


@pytest.mark.parametrize("dst_format", sorted(VARIANTS))
def test_two_process_torchrun_writes_the_single_process_output(sources: dict[str, Path], dst_format: str,
                                                               tmp_path: Path) -> None:
    dst = tmp_path / "torchrun"

    done = run_torchrun("-m", "pgconvert", "-q", "--dst-format", VARIANTS[dst_format][0], *VARIANTS[dst_format][1],
                        *SHARD_SIZE, str(sources[dst_format]), str(dst))

    assert done.returncode == 0, done.stdout + done.stderr
    assert "every share is complete" in done.stdout
    assert [done.stdout.count(f"shard {rank}/2: wrote") for rank in (0, 1)] == [1, 1]  # each process wrote a share
    assert_same_bytes(dst, sources[f"{dst_format}_single"])
    assert (dst / "pgconvert.json").is_file()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["torchrun"]  # no staging left beside it


@pytest.mark.parametrize("dst_format", sorted(VARIANTS))
def test_two_shards_run_separately_write_the_single_process_output(sources: dict[str, Path], dst_format: str,
                                                                   tmp_path: Path) -> None:
    dst = tmp_path / "sharded"

    _convert(sources[dst_format], dst, dst_format, "--shard-index", "1", "--num-shards", "2")
    assert not dst.exists()
    _convert(sources[dst_format], dst, dst_format, "--shard-index", "0", "--num-shards", "2")

    assert_same_bytes(dst, sources[f"{dst_format}_single"])
    assert list(tmp_path.glob(".sharded*")) == []


def test_sharded_hf_output_is_the_source_model_to_transformers(sources: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    dst = tmp_path / "sharded"
    for index in ("0", "1"):
        _convert(sources["hf"], dst, "hf", "--shard-index", index, "--num-shards", "2")

    loaded, info = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(key) for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    expected = build_hf_model("llama").state_dict()
    actual = loaded.state_dict()
    assert sorted(actual) == sorted(expected)
    assert [name for name, tensor in expected.items() if not torch.equal(actual[name], tensor)] == []


def test_sharded_torch_dist_output_holds_the_source_tensors(sources: dict[str, Path], tmp_path: Path) -> None:
    dst = tmp_path / "sharded"
    for index in ("1", "0"):
        _convert(sources["torch_dist"], dst, "torch_dist", "--shard-index", index, "--num-shards", "2")

    written = get_loader("torch_dist").open(dst, LoadOptions())
    source = get_loader("megatron").open(sources["torch_dist"], LoadOptions())
    try:
        assert written.names() == source.names()
        assert [name for name in source.names() if not torch.equal(written.load(name), source.load(name))] == []
    finally:
        written.close()
        source.close()


@pytest.mark.parametrize("dst_format", FORMATS)
def test_each_share_reads_only_its_own_tensors_once(sources: dict[str, Path], dst_format: str,
                                                    tmp_path: Path) -> None:
    request = convert_request(sources[dst_format], tmp_path / "dst", dst_format=dst_format, max_shard_size=40_000)
    reads = []
    (tmp_path / "staging").mkdir()
    for share in balanced_shares(plan(request).files, 2):
        conversion = plan(request)
        loaded: Counter[str] = Counter()
        for method in ("load", "load_shard"):
            real = getattr(conversion.source, method)
            setattr(conversion.source, method,
                    lambda name, *args, real=real, **kwargs: loaded.update([name]) or real(name, *args, **kwargs))
        try:
            conversion.saver.save(conversion.source, tmp_path / "staging", conversion.save_options,
                                  lambda nbytes: None, only=set(share))
        finally:
            conversion.source.close()
        reads.append(loaded)

    assert all(count == 1 for loaded in reads for count in loaded.values())
    assert set(reads[0]) and set(reads[1]) and not set(reads[0]) & set(reads[1])
    single = plan(request)
    assert set(reads[0]) | set(reads[1]) == set(single.source.names())
    single.source.close()


@pytest.mark.parametrize("dst_format", FORMATS)
def test_a_failed_share_leaves_no_complete_looking_output_and_its_rerun_completes(
        sources: dict[str, Path], dst_format: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pgconvert.savers.hf as hf_saver
    import pgconvert.io.dcp_writer as streaming

    dst = tmp_path / "sharded"
    args = ["--dst-format", dst_format, *SHARD_SIZE, str(sources[dst_format]), str(dst)]

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device", "injected")

    with monkeypatch.context() as patched:
        patched.setattr(hf_saver._SafetensorsWriter, "write_runs", broken)  # hf shard files (every tensor)
        patched.setattr(streaming, "_write_item", broken)  # torch_dist data files
        failed = CliRunner().invoke(main, ["--shard-index", "0", "--num-shards", "2", *args])
    other = CliRunner().invoke(main, ["--shard-index", "1", "--num-shards", "2", *args])

    assert failed.exit_code == 1 and "No space left on device" in failed.output
    assert other.exit_code == 0, other.output
    assert not dst.exists()
    staging, = tmp_path.glob(".sharded*")
    assert [name for name in COMPLETE_MARKERS[dst_format] if (staging / name).exists()] == []

    rerun = CliRunner().invoke(main, ["--shard-index", "0", "--num-shards", "2", *args])

    assert rerun.exit_code == 0, rerun.output
    assert_same_bytes(dst, sources[f"{dst_format}_single"])



@pytest.mark.parametrize("shape,dtype", [((), torch.float32), ((0, 4), torch.bfloat16), ((3, 5), torch.float16),
                                         ((7,), torch.int64), ((2, 3, 4), torch.float8_e4m3fn)])
def test_a_records_planned_length_is_the_length_written(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    from pgconvert.io.torchzip import PlannedTensor, save_stream
    from pgconvert.io.dcp_writer import archive_length

    values = torch.randn(shape).to(dtype)
    written = io.BytesIO()
    save_stream(PlannedTensor(shape, dtype, lambda: values), written, crc32=True)

    assert archive_length(shape, dtype) == len(written.getvalue())


@pytest.mark.parametrize("variant", ["torch_dist", "torch_dist_store"])
def test_workers_carry_the_optimizer_state_into_torch_dist_as_one_process_does(tmp_path: Path, variant: str) -> None:
    trained = Path(__file__).parent / "data" / "megatron_lm" / "train_tp2pp2_torch"  # Megatron-LM's own training run
    _convert(trained, tmp_path / "single", variant)
    _convert(trained, tmp_path / "workers", variant, "--workers", "2")

    assert_same_bytes(tmp_path / "workers", tmp_path / "single")
    assert len(_data_files(tmp_path / "workers", "torch_dist")) > 2
    (iteration_dir,) = (tmp_path / "workers").glob("iter_*")
    if variant == "torch_dist_store":  # written after the optimizer's records, index and common state
        assert (iteration_dir / "integrity.json").read_text() == integrity_manifest_of(iteration_dir)
    result = pgconvert.verify(trained, tmp_path / "workers")
    assert result.equal and result.optimizer is not None  # the model and its optimizer state, compared
