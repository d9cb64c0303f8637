"""Benchmark pgconvert against the disk's floor on a synthetic Llama-shaped checkpoint.

    python benchmarks/bench_convert.py                       # ~1 B parameters in bf16 (1.66 GiB)
    python benchmarks/bench_convert.py --scale 5 --repeat 1  # ~4 B parameters (7.6 GiB)
    python benchmarks/bench_convert.py --scale 0.05          # a quick, small run
    python benchmarks/bench_convert.py --cases "TP8 -> TP1" --plan-cases none
    python benchmarks/bench_convert.py --baseline-python /other/venv/bin/python  # before/after rows
    python benchmarks/bench_convert.py --json                # machine-readable results
    python benchmarks/bench_convert.py --markdown docs/benchmarks.md  # the table the docs show
    python benchmarks/bench_convert.py --scale 5 --cold      # every source read from the device

The floor is the durable copy of the same source, ``cp -r SRC X && sync``. Each conversion runs
``--repeat`` times in alternating pairs with that copy (copy, conversion, copy, conversion, ...),
each in a child process; the medians are compared, and each run's peak RSS and CPU time (GNU time)
are kept. Each case's output gets a digest (sha256 over every file's relative path, size and bytes,
``pgconvert.json`` aside: it records when it was written), so two versions' outputs can be compared
byte for byte.
The shape-only cases plan and dry-run a Llama-405B-shaped model at TP8/PP16, a 256-expert,
61-layer MoE and DeepSeek-V3 671B (as its config.json describes it) at EP64/PP16 from metadata alone
(no tensor bytes exist) and report time, peak RSS, tensor and file counts, and the wall time their
conversion would take on 1, 8 and 32 hosts (``--shard-index``) at the bytes per second measured for
``TP8 -> TP2``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench_markdown import PROJECTED_HOSTS, PROJECTION_CASE, markdown, projected_text, projection_rate, run_context
from bench_optimizer import OPTIM_CASES, OPTIM_SCALE, optimizer_plan, optimizer_sources
from pgconvert.model.config import AttentionConfig, MLPConfig, ModelConfig, MoEConfig, NormConfig, PositionConfig
from pgconvert.formats import SaveOptions
from pgconvert.model.layout import ParallelLayout
from pgconvert.model.provider import canonical_shapes
from pgconvert.formats.names import saver_names
from pgconvert.formats.registry import get_saver
from pgconvert.formats.stream import CanonicalSource, TensorMeta

RSS_ALLOWANCE = 300 * 10**6  # the goal: peak RSS <= 2 x the largest tensor + 300 MB
PLAN_SECONDS_GOAL = 10.0
PLAN_RSS_GOAL = 10**9
MANIFEST = "pgconvert.json"  # left out of the output digest: it records when it was written
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's metadata file


@dataclass
class Case:
    name: str
    python: str
    workers: int
    seconds: float  # median over the runs
    floor_seconds: float  # median of the durable copies paired with them
    bytes_written: int
    peak_rss_bytes: int  # the largest over the runs
    ratio_to_floor: float | None = None
    largest_output_file: int = 0
    largest_tensor: int = 0
    rss_goal_bytes: int = 0
    runs: list[float] = field(default_factory=list)
    skipped: str | None = None
    peak_anon_bytes: int = 0  # the largest anonymous (not file-backed) peak over the runs
    cpu_seconds: float = 0.0  # median user + system CPU seconds of the conversion process and its children
    cpu_runs: list[float] = field(default_factory=list)
    digest: str = ""  # output_digest of the output

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_written / self.seconds if self.seconds else 0.0

    @property
    def cpu_seconds_per_gib(self) -> float:
        return self.cpu_seconds / (self.bytes_written / 2**30) if self.bytes_written else 0.0


@dataclass
class ChildRun:
    """One child process: wall seconds, peak RSS (GNU time %M) and user + system CPU seconds (%U + %S)."""

    seconds: float
    peak_rss_bytes: int
    cpu_seconds: float


@dataclass
class PlanCase:
    name: str
    layout: str
    tensors: int
    files: int
    planned_bytes: int
    seconds: float
    peak_rss_bytes: int


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="parameter count relative to ~1 B (5: 7.6 GiB)")
    parser.add_argument("--repeat", type=int, default=3, help="alternating (copy, conversion) pairs per case")
    parser.add_argument("--cases", default="all", help="comma-separated case names to run (default: all)")
    parser.add_argument("--plan-cases", choices=("all", "none", "only"), default="all",
                        help="the shape-only planning cases: with the others, skipped, or alone")
    parser.add_argument("--baseline-python", default=None,
                        help="also run each conversion with this interpreter (another pgconvert install)")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON results to this file")
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH",
                        help="also write the results as markdown (docs/benchmarks.md): one table, machine and load")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    parser.add_argument("--cold", action="store_true",
                        help="evict each case's source from the page cache before its copy and its conversion, as "
                             "a checkpoint larger than memory is read (posix_fadvise DONTNEED)")
    parser.add_argument("--threads", type=int, default=1,
                        help="also run TP8 -> TP2, TP8/PP1 -> TP2/PP2 and TP8 -> HF with --threads N (1: skip those rows)")
    parser.add_argument("--workers", type=int, default=2,
                        help="also run the Megatron-output cases with --workers N (1: skip those rows)")
    parser.add_argument("--optim-scale", type=float, default=OPTIM_SCALE,
                        help="the optimizer cases' model size, as --scale (0.07: 1.0 GB of fp32 optimizer state)")
    parser.add_argument("--plan-child", default=None, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.workdir is not None:  # the children run in another directory
        options.workdir = options.workdir.resolve()
    return options


def bench_config(scale: float) -> ModelConfig:
    """Llama-shaped: hidden 2048, 16 layers, 16 heads, 8 query groups, ffn 5632, vocab 32000 at scale 1.

    (Megatron needs num_query_groups divisible by tp, so TP8 needs 8 groups, not 4.)
    """
    factor = math.sqrt(scale)
    hidden = max(128, round(2048 * factor / 128) * 128)
    ffn = max(128, round(5632 * factor / 128) * 128)
    return ModelConfig(
        num_layers=16, hidden_size=hidden, attention=AttentionConfig(num_attention_heads=16, num_query_groups=8),
        mlp=MLPConfig(ffn_hidden_size=ffn, gated_linear_unit=True), vocab_size=32000,
        norms=NormConfig(normalization="RMSNorm"),
        positions=PositionConfig(position_embedding_type="rope", max_position_embeddings=4096), params_dtype="bfloat16",
    )


class ShapeOnlySource(CanonicalSource):
    """Names, shapes and dtypes from a config, no bytes: ``load`` fails, planning works."""

    format_name = "shape-only"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, config.vocab_size or 0)
        self._shapes = canonical_shapes(config)
        self._dtype = getattr(torch, config.params_dtype)

    def names(self) -> list[str]:
        return list(self._shapes)

    def meta(self, name: str) -> TensorMeta:
        return TensorMeta(self._shapes[name], self._dtype)

    def _load(self, name: str) -> torch.Tensor:
        raise RuntimeError(f"{name}: a shape-only source has no tensor bytes")


class SeededSource(ShapeOnlySource):
    """Seeded random bf16 tensors made one at a time (the synthetic benchmark model)."""

    format_name = "synthetic"

    def _load(self, name: str) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.names().index(name))
        shape = self._shapes[name]
        if name.endswith("layernorm_weight") or name.endswith("norm.weight"):
            return torch.ones(shape, dtype=self._dtype)
        return (torch.randn(shape, generator=generator) * 0.02).to(self._dtype)


def synthesize(config: ModelConfig, workdir: Path) -> tuple[Path, int, float]:
    """The TP8 source checkpoint (written as TP1, then converted by pgconvert); its largest tensor."""
    started = time.perf_counter()
    tp1, src = workdir / "synth_tp1", workdir / "src_tp8"
    for path in (tp1, src):
        shutil.rmtree(path, ignore_errors=True)
    source = SeededSource(config)
    get_saver("megatron").save(source, tp1, SaveOptions(layout=ParallelLayout(tp=1)), lambda nbytes: None)
    largest_tensor = max(source.meta(name).nbytes for name in source.names())
    subprocess.run([sys.executable, "-m", "pgconvert", "--quiet", "--dst-tp", "8", str(tp1), str(src)], check=True,
                   stdout=subprocess.DEVNULL)
    shutil.rmtree(tp1)
    return src, largest_tensor, time.perf_counter() - started


def dir_bytes(path: Path) -> tuple[int, int]:
    sizes = [p.stat().st_size for p in path.rglob("*") if p.is_file()]
    return sum(sizes), max(sizes, default=0)


def output_digest(root: Path) -> str:
    """sha256 over every file under ``root`` but the top-level manifest, in path order: each file's
    relative path, its size and its bytes. Equal digests mean byte-identical outputs, but for the one
    field that differs on every run: a torch_dist ``.metadata`` is hashed as its ``Metadata`` without
    ``storage_meta`` (torch.distributed.checkpoint records the staging path and a random save id there)."""
    digest = hashlib.sha256()
    files = {path.relative_to(root).as_posix(): path for path in root.rglob("*") if path.is_file()}
    files.pop(MANIFEST, None)
    for relpath, path in sorted(files.items()):
        digest.update(relpath.encode() + b"\0" + path.stat().st_size.to_bytes(8, "little"))
        if path.name == DCP_METADATA:
            digest.update(_dcp_metadata_without_run_ids(path.parent))
            continue
        with path.open("rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _dcp_metadata_without_run_ids(folder: Path) -> bytes:
    """The torch_dist checkpoint's ``.metadata`` (this run's own output), pickled again without its
    ``storage_meta``."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(folder)).read_metadata()
    metadata.storage_meta = None
    return pickle.dumps(metadata, protocol=4)


def run_child(command: list[str], anon: list[int] | None = None) -> ChildRun:
    """Wall seconds, peak RSS and CPU seconds of one child process; ``anon``: the peak of its
    anonymous resident memory (RssAnon, sampled every 20 ms) is appended, without the file-backed pages
    its mappings keep resident (the libraries' code, any file it maps).

    GNU time reports the peak RSS of a freshly exec'd child; a child forked straight from this
    process would start its ru_maxrss at our own RSS.
    """
    gnu_time = shutil.which("time") or "/usr/bin/time"
    with tempfile.NamedTemporaryFile("r", suffix=".time") as report, tempfile.TemporaryFile("w+") as errors:
        started = time.perf_counter()
        # Run outside any checkout: `python -m pgconvert` imports the package installed for that interpreter
        # (the baseline's included), not a `pgconvert/` folder in the current directory.
        process = subprocess.Popen([gnu_time, "-o", report.name, "-f", "%M %U %S", *command],
                                   stdout=subprocess.DEVNULL, stderr=errors, text=True, cwd=tempfile.gettempdir())
        peak_anon = 0
        while process.poll() is None:
            peak_anon = max(peak_anon, _anon_bytes(process.pid))
            time.sleep(0.02)
        seconds = time.perf_counter() - started
        if process.returncode != 0:
            errors.seek(0)
            raise SystemExit(f"{' '.join(command)} failed:\n{errors.read()}")
        peak_kib, user, system = report.read().strip().splitlines()[-1].split()
    if anon is not None:
        anon.append(peak_anon)
    return ChildRun(seconds, int(peak_kib) * 1024, float(user) + float(system))


def _anon_bytes(parent: int) -> int:
    """RssAnon of ``parent``'s children (GNU time's child: the command), 0 if gone."""
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        total = 0
        for pid in children:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    total += int(line.split()[1]) * 1024
        return total
    except (OSError, ValueError):
        return 0


def durable_copy(src: Path, dst: Path) -> list[str]:
    return ["sh", "-c", f"cp -r '{src}' '{dst}' && sync"]


def conversion_plan(src: Path, workdir: Path, workers: int, threads: int = 1) -> list[tuple[str, list[str], Path, int]]:
    """(name, pgconvert args, destination, workers) of every conversion case."""
    plan: list[tuple[str, list[str], Path, int]] = [
        ("TP8 -> TP2", ["--dst-tp", "2", str(src)], workdir / "tp2", 1),
        ("TP8 -> TP1", ["--dst-tp", "1", str(src)], workdir / "tp1", 1),
        ("TP8/PP1 -> TP2/PP2", ["--dst-tp", "2", "--dst-pp", "2", str(src)], workdir / "tp2pp2", 1),
    ]
    if "hf" in saver_names():
        plan += [
            ("TP8 -> HF", ["--dst-format", "hf", str(src)], workdir / "hf", 1),
            ("HF -> TP4", ["--dst-format", "megatron", "--dst-tp", "4", str(workdir / "hf")], workdir / "hf_tp4", 1),
            ("HF -> TP8", ["--dst-format", "megatron", "--dst-tp", "8", str(workdir / "hf")], workdir / "hf_tp8", 1),
        ]
        # The HF output with its linear weights FP8 block-scaled (DeepSeek-V3's storage, Llama-shaped).
        plan += [
            ("HF-FP8 -> HF", ["--dst-format", "hf", str(workdir / "hf_fp8")], workdir / "fp8_hf", 1),
            ("HF-FP8 -> HF keep", ["--keep-fp8", str(workdir / "hf_fp8")], workdir / "fp8_keep", 1),
            ("HF-FP8 -> TP4", ["--dst-format", "megatron", "--dst-tp", "4", str(workdir / "hf_fp8")],
             workdir / "fp8_tp4", 1),
        ]
        # A DeepSeek-V3-shaped FP8 checkpoint (benchmarks/deepseek_fp8.py, 2.25 GB as bf16 at scale 1).
        plan += [
            (DEEPSEEK_CASES[0], ["--dst-format", "megatron", "--dst-tp", "2", "--dst-ep", "4",
                                 str(workdir / "ds_fp8")], workdir / "ds_tp2ep4", 1),
            (DEEPSEEK_CASES[1], ["--dst-format", "hf", str(workdir / "ds_fp8")], workdir / "ds_hf", 1),
        ]
    if "torch_dist" in saver_names():
        plan.append(("TP8 -> torch_dist", ["--dst-format", "torch_dist", str(src)], workdir / "dist", 1))
        plan.append(("torch_dist -> TP2", ["--dst-format", "megatron", "--dst-tp", "2", str(workdir / "dist")],
                     workdir / "dist_tp2", 1))
        # The same output with common.pt instead of the store's common state, and with the integrity.json whose
        # sha256 of every data file Megatron-LM's --verify-integrity requires (about 0.6 CPU-seconds per GiB).
        plan.append(("TP8 -> torch_dist legacy", ["--dst-format", "torch_dist", "--dst-torch-dist-common", "legacy",
                                                  str(src)], workdir / "dist_legacy", 1))
        plan.append(("TP8 -> torch_dist sha256", ["--dst-format", "torch_dist", "--digest", "sha256", str(src)],
                     workdir / "dist_sha256", 1))
    plan += optimizer_plan(workdir)
    # The same conversions with the manifest's sha256 off (``--digest none``: sizes only).
    plan += [(f"{name} digest none", [*args[:-1], *NO_DIGEST, args[-1]], dst.with_name(dst.name + "_nodigest"), 1)
             for name, args, dst, _ in list(plan) if name in ("TP8 -> TP2", "TP8 -> HF", "HF -> TP4")]
    # The same conversions with their destination files written on threads (``--threads``).
    if threads > 1:
        plan += [(f"{name} threads {threads}", [*args[:-1], "--threads", str(threads), args[-1]],
                  dst.with_name(dst.name + "_threads"), 1)
                 for name, args, dst, _ in list(plan) if name in ("TP8 -> TP2", "TP8/PP1 -> TP2/PP2", "TP8 -> HF")]
    if workers > 1:
        plan += [(name, args, dst.with_name(dst.name + "_workers"), workers)
                 for name, args, dst, _ in list(plan) if name.endswith(("TP2", "TP1", "PP2", "TP4"))]
    return plan


def evict(path: Path) -> None:
    """Drop ``path``'s files (written durably, so their cached pages are clean) from the page cache."""
    for file in (path.rglob("*") if path.is_dir() else [path]):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def measure(name: str, python: str, args: list[str], dst: Path, workers: int, src: Path,
            repeat: int, largest_tensor: int, cold: bool = False) -> Case:
    """Alternating pairs (durable copy, conversion), each reading ``src`` from the device with ``cold``; medians,
    the largest peak RSS, the output's digest."""
    floors: list[float] = []
    runs: list[ChildRun] = []
    anon: list[int] = []
    extra = ["--workers", str(workers)] if workers > 1 else []
    for _ in range(repeat):
        floor_dst = dst.with_name(dst.name + "_floor")
        shutil.rmtree(floor_dst, ignore_errors=True)
        if cold:
            evict(src)
        floors.append(run_child(durable_copy(src, floor_dst)).seconds)
        shutil.rmtree(floor_dst)
        shutil.rmtree(dst, ignore_errors=True)
        if cold:
            evict(src)
        runs.append(run_child([python, "-m", "pgconvert", "--quiet", *extra, *args, str(dst)], anon))
    written, largest = dir_bytes(dst)
    cpu = [run.cpu_seconds for run in runs]
    case = Case(name, python, workers, statistics.median(run.seconds for run in runs), statistics.median(floors),
                written, max(run.peak_rss_bytes for run in runs), largest_output_file=largest,
                largest_tensor=largest_tensor, rss_goal_bytes=2 * largest_tensor + RSS_ALLOWANCE,
                runs=[run.seconds for run in runs], peak_anon_bytes=max(anon), cpu_seconds=statistics.median(cpu),
                cpu_runs=cpu, digest=output_digest(dst))
    case.ratio_to_floor = case.seconds / case.floor_seconds
    return case


# Byte-compiles the package's folders for one interpreter (the baseline's layout may lack the plug-in ones).
COMPILE_PACKAGE = """
import compileall, importlib.util
for name in ("pgconvert", "pgconvert.loaders", "pgconvert.savers"):
    spec = importlib.util.find_spec(name)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        compileall.compile_dir(folder, quiet=1)
"""


def compile_package(pythons: list[str]) -> None:
    """Byte-compile pgconvert for each interpreter, as installing it does: an editable checkout under
    PYTHONDONTWRITEBYTECODE would otherwise compile its modules again in every run (about 0.15 s each)."""
    for python in pythons:
        subprocess.run([python, "-c", COMPILE_PACKAGE], check=True, stdout=subprocess.DEVNULL,
                       cwd=tempfile.gettempdir())


def run_conversions(options: argparse.Namespace, src: Path, workdir: Path, largest_tensor: int) -> list[Case]:
    wanted = None if options.cases == "all" else {name.strip() for name in options.cases.split(",")}
    pythons = [sys.executable] + ([options.baseline_python] if options.baseline_python else [])
    compile_package(pythons)
    cases = []
    for name, args, dst, workers in conversion_plan(src, workdir, options.workers, options.threads):
        # Each source made by a conversion is kept for the case that reads it.
        readers = {"TP8 -> HF": ("HF -> TP4", "HF -> TP8", "HF -> TP4 digest none", *FP8_CASES),
                   "TP8 -> torch_dist": ("torch_dist -> TP2",)}
        if wanted is not None and name not in wanted and not wanted & set(readers.get(name, ())):
            continue
        if name in FP8_CASES:
            fp8_source(workdir / "hf", workdir / "hf_fp8")
        largest = largest_tensor
        if name in DEEPSEEK_CASES:  # its own source and largest tensor
            _, largest = deepseek_source(workdir / "ds_fp8", options.scale)
        if name in OPTIM_CASES:  # the optimizer sources; the largest fp32 state tensor
            _, _, largest = optimizer_sources(workdir, options.optim_scale, bench_config, SeededSource)
        # The floor copies the files the case reads (its last argument), so the conversion finds them in the page
        # cache as the copy left them (an HF or torch_dist source, written by an earlier case with O_DIRECT, is not).
        floor_src = Path(args[-1])
        for python in pythons:
            if python != sys.executable and set(ADDED_OPTIONS) & set(args):
                continue  # an option this version added: the baseline has no such run
            cases.append(measure(name, python, args, dst, workers, floor_src, options.repeat, largest, options.cold))
        if name not in readers:
            shutil.rmtree(dst, ignore_errors=True)
    return cases


FP8_CASES = ("HF-FP8 -> HF", "HF-FP8 -> HF keep", "HF-FP8 -> TP4")
NO_DIGEST = ("--digest", "none")
ADDED_OPTIONS = ("--digest", "--threads")  # options a baseline version may not have
DEEPSEEK_CASES = ("HF-FP8(DeepSeek) -> TP2/EP4", "HF-FP8(DeepSeek) -> HF")


def deepseek_source(path: Path, scale: float) -> tuple[Path, int]:
    """The DeepSeek-V3-shaped FP8 checkpoint at ``scale``, written once, in a child process (bounded
    memory); its largest dequantized tensor (the bf16 embedding)."""
    from deepseek_fp8 import deepseek_config

    if not path.exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("deepseek_fp8.py")), str(path),
                        "--scale", str(scale)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    config = deepseek_config(scale)
    return path, config["vocab_size"] * config["hidden_size"] * 2


def fp8_source(hf: Path, fp8: Path) -> None:
    """``hf`` with every 2-d linear weight (not the vocab tables) stored as DeepSeek-V3 stores its
    weights: float8_e4m3fn with float32 ``weight_scale_inv`` per 128 x 128 block (amax / 448)."""
    if fp8.exists():
        return
    from deepseek_fp8 import FP8_BLOCK, quantize_fp8
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf, fp8, ignore=shutil.ignore_patterns("*.safetensors"))
    weight_map = {}
    for shard in sorted(hf.glob("*.safetensors")):
        tensors = load_file(str(shard))
        for name in sorted(tensors):
            tensor = tensors[name]
            if tensor.dim() == 2 and "embed" not in name and "lm_head" not in name:
                tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(tensor, FP8_BLOCK)
        save_file(tensors, str(fp8 / shard.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard.name))
        del tensors
    index = fp8 / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        index.write_text(json.dumps(doc | {"weight_map": dict(sorted(weight_map.items()))}))
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(FP8_BLOCK),
                                     "activation_scheme": "dynamic"}
    (fp8 / "config.json").write_text(json.dumps(config))


def plan_models() -> dict[str, tuple[ModelConfig, ParallelLayout]]:
    """The shape-only cases: models at the sizes and layouts users run."""
    llama_405b = ModelConfig(
        num_layers=126, hidden_size=16384, attention=AttentionConfig(num_attention_heads=128, num_query_groups=8),
        mlp=MLPConfig(ffn_hidden_size=53248), vocab_size=128256, positions=PositionConfig(rotary_base=500000.0),
        params_dtype="bfloat16",
    )
    moe_256 = ModelConfig(
        num_layers=61, hidden_size=7168,
        attention=AttentionConfig(num_attention_heads=128, num_query_groups=128, kv_channels=128),
        mlp=MLPConfig(ffn_hidden_size=18432), vocab_size=129280, params_dtype="bfloat16",
        moe=MoEConfig(num_experts=256, moe_ffn_hidden_size=2048, moe_layer_freq=(0,) * 3 + (1,) * 58,
                      moe_router_topk=8, moe_shared_expert_intermediate_size=2048),
    )
    return {
        "Llama-405B TP8/PP16": (llama_405b, ParallelLayout(tp=8, pp=16, first_stage_layers=7, last_stage_layers=7)),
        "MoE 256x61 EP64/PP16": (moe_256, ParallelLayout(tp=1, pp=16, ep=64, first_stage_layers=3, last_stage_layers=2)),
        "DeepSeek-V3 671B EP64/PP16": (deepseek_v3_671b(), ParallelLayout(tp=1, pp=16, ep=64, first_stage_layers=3,
                                                                          last_stage_layers=2)),
    }


def deepseek_v3_671b() -> ModelConfig:
    """DeepSeek-V3 as its released config.json describes it (MLA, 256 routed experts, one MTP layer, YaRN)."""
    from pgconvert.formats.hf import model_config_from_hf

    doc = dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280, hidden_size=7168,
        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
        topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=3, q_lora_rank=1536,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, rms_norm_eps=1e-6,
        max_position_embeddings=163840, tie_word_embeddings=False, torch_dtype="bfloat16", rope_theta=10000,
        num_nextn_predict_layers=1, scoring_func="sigmoid", topk_method="noaux_tc",
        rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
    )
    return model_config_from_hf(doc, Path("DeepSeek-V3/config.json"))[1]


def plan_child(name: str, report: Path) -> None:
    """In a child process: validate, plan and print (as --dry-run does) one shape-only case."""
    started = time.perf_counter()
    config, layout = plan_models()[name]
    source = ShapeOnlySource(config)
    saver = get_saver("megatron")
    options = SaveOptions(layout=layout)
    saver.validate(source, options)
    files = saver.plan(source, options)
    for item in files:
        print(f"  {item.relpath}  {item.tensors} tensors  {item.nbytes} bytes")
    print(f"total: {len(files)} files, {sum(item.nbytes for item in files)} bytes")
    report.write_text(json.dumps({
        "layout": layout.describe(), "tensors": sum(item.tensors for item in files), "files": len(files),
        "planned_bytes": sum(item.nbytes for item in files), "seconds": time.perf_counter() - started,
    }))


def run_plan_cases() -> list[PlanCase]:
    cases = []
    for name in plan_models():
        with tempfile.NamedTemporaryFile("r", suffix=".json") as report:
            child = run_child([sys.executable, __file__, "--plan-child", name, "--workdir", report.name])
            found = json.loads(report.read())
        cases.append(PlanCase(name, found["layout"], found["tensors"], found["files"], found["planned_bytes"],
                              child.seconds, child.peak_rss_bytes))
    return cases


def case_label(case: Case) -> str:
    """The case's name, with its worker count when it runs several."""
    return case.name + (f" (--workers {case.workers})" if case.workers > 1 else "")


def print_cases(cases: list[Case]) -> None:
    header = (f"{'case':<42} {'python':<8} {'wall s':>7} {'floor s':>8} {'x floor':>8} {'CPU s':>7} {'MiB/s':>7} "
              f"{'peak RSS MiB':>13} {'RSS goal MiB':>13} {'RSS/largest file':>17} {'anon MiB':>9} {'digest':>13}")
    print(header)
    print("-" * len(header))
    for case in cases:
        label = "this" if case.python == sys.executable else "baseline"
        goal = f"{case.rss_goal_bytes / 2**20:.0f}" + (" ok" if case.peak_rss_bytes <= case.rss_goal_bytes else " over")
        file_ratio = f"{case.peak_rss_bytes / case.largest_output_file:.2f}" if case.largest_output_file else "-"
        print(f"{case_label(case):<42} {label:<8} {case.seconds:>7.2f} {case.floor_seconds:>8.2f} "
              f"{case.ratio_to_floor or 0:>8.2f} {case.cpu_seconds:>7.2f} {case.bytes_per_second / 2**20:>7.1f} "
              f"{case.peak_rss_bytes / 2**20:>13.1f} {goal:>13} {file_ratio:>17} {case.peak_anon_bytes / 2**20:>9.1f} "
              f"{case.digest[:12]:>13}")


def print_plan_cases(cases: list[PlanCase], rate: float | None) -> None:
    hosts = " ".join(f"{f'{count} host(s)':>11}" for count in PROJECTED_HOSTS)
    print(f"{'shape-only plan + dry-run':<28} {'layout':<22} {'tensors':>9} {'files':>6} {'planned GiB':>12} "
          f"{'wall s':>7} {'peak RSS MiB':>13}   projected wall: {hosts}")
    for case in cases:
        verdict = "ok" if case.seconds < PLAN_SECONDS_GOAL and case.peak_rss_bytes < PLAN_RSS_GOAL else "over"
        projected = " ".join(f"{projected_text(case.planned_bytes, rate, count):>11}" for count in PROJECTED_HOSTS)
        print(f"{case.name:<28} {case.layout:<22} {case.tensors:>9} {case.files:>6} "
              f"{case.planned_bytes / 2**30:>12.1f} {case.seconds:>7.2f} {case.peak_rss_bytes / 2**20:>13.1f} {verdict:<4}"
              f"                   {projected}")


def results_doc(summary: dict[str, object], cases: list[Case], plan_cases: list[PlanCase]) -> dict[str, object]:
    """Everything measured, as the JSON output and the markdown table read it."""
    return summary | {
        "cases": [asdict(case) | {"label": case_label(case), "baseline": case.python != sys.executable,
                                  "bytes_per_second": case.bytes_per_second,
                                  "cpu_seconds_per_gib": case.cpu_seconds_per_gib} for case in cases],
        "plan_cases": [asdict(case) for case in plan_cases],
        "projection_rate": projection_rate(cases),
    }


def report(options: argparse.Namespace, summary: dict[str, object], cases: list[Case],
           plan_cases: list[PlanCase]) -> None:
    doc = results_doc(summary, cases, plan_cases)
    results = json.dumps(doc, indent=2)
    if options.json_out:
        options.json_out.write_text(results)
    if options.markdown:
        options.markdown.write_text(markdown(doc))
    if options.json:
        print(results)
        return
    if "config" in summary:
        config = summary["config"]
        assert isinstance(config, dict)
        print(f"model: hidden {config['hidden_size']}, {config['num_layers']} layers, ffn {config['ffn_hidden_size']}, "
              f"vocab {config['vocab_size']}, source {int(summary['source_bytes']) / 2**30:.2f} GiB (TP8, bf16), "
              f"largest tensor {int(summary['largest_tensor']) / 2**20:.0f} MiB; {options.repeat} pair(s) per case")
        print_cases(cases)
    if plan_cases:
        rate = doc.get("projection_rate")
        print_plan_cases(plan_cases, rate if isinstance(rate, float) else None)
        if isinstance(rate, float):
            print(f"projected at {rate / 2**20:.0f} MiB/s per host ({PROJECTION_CASE}, one process, measured above); "
                  "hosts split the files with --shard-index, each reading and writing its own share")


def convert_all(options: argparse.Namespace) -> tuple[dict[str, object], list[Case]]:
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="pgconvert-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = bench_config(options.scale)
    try:
        src, largest_tensor, synth_seconds = synthesize(config, workdir)
        src_bytes, _ = dir_bytes(src)
        cases = run_conversions(options, src, workdir, largest_tensor)
    finally:
        if not options.keep:
            for path in workdir.iterdir() if options.workdir else [workdir]:
                shutil.rmtree(path, ignore_errors=True)
    summary: dict[str, object] = {
        "config": config.to_dict(), "source_bytes": src_bytes, "largest_tensor": largest_tensor,
        "synthesis_seconds": synth_seconds, "torch_threads": torch.get_num_threads(), "repeat": options.repeat,
        "scale": options.scale, "optim_scale": options.optim_scale,
    }
    return summary, cases


def main() -> None:
    options = parse_args()
    if options.plan_child:
        plan_child(options.plan_child, options.workdir)
        return
    load_before = os.getloadavg()
    summary: dict[str, object] = {}
    cases: list[Case] = []
    if options.plan_cases != "only":
        summary, cases = convert_all(options)
    plan_cases = run_plan_cases() if options.plan_cases != "none" else []
    summary["run"] = run_context(load_before, os.getloadavg(), torch.get_num_threads())
    report(options, summary, cases, plan_cases)


if __name__ == "__main__":
    main()
