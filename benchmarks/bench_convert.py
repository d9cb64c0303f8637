"""Benchmark pgconvert against the disk's floor (``cp -r``) on a synthetic Llama-shaped checkpoint.

    python benchmarks/bench_convert.py                 # ~1 B parameters in bf16 (about 2 GB)
    python benchmarks/bench_convert.py --scale 0.05    # a quick, small run
    python benchmarks/bench_convert.py --json          # machine-readable results

Each case runs as a child process; wall time and that child's peak RSS (``wait4``) are recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pgconvert.config import ModelConfig
from pgconvert.example import example_source
from pgconvert.formats import SaveOptions
from pgconvert.layout import ParallelLayout
from pgconvert.registry import get_saver, saver_names


@dataclass
class Case:
    name: str
    workers: int
    seconds: float
    bytes_written: int
    peak_rss_bytes: int
    ratio_to_floor: float | None = None
    largest_output_file: int = 0
    largest_tensor: int = 0
    skipped: str | None = None

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_written / self.seconds if self.seconds else 0.0


def bench_config(scale: float) -> ModelConfig:
    """Llama-shaped: hidden 2048, 16 layers, 16 heads, 8 query groups, ffn 5632, vocab 32000 at scale 1.

    (Megatron needs num_query_groups divisible by tp, so TP8 needs 8 groups, not 4.)
    """
    factor = math.sqrt(scale)
    hidden = max(128, round(2048 * factor / 128) * 128)
    ffn = max(128, round(5632 * factor / 128) * 128)
    return ModelConfig(
        num_layers=16, hidden_size=hidden, num_attention_heads=16, num_query_groups=8,
        ffn_hidden_size=ffn, vocab_size=32000, gated_linear_unit=True, normalization="RMSNorm",
        position_embedding_type="rope", max_position_embeddings=4096, params_dtype="bfloat16",
    )


def dir_bytes(path: Path) -> tuple[int, int]:
    sizes = [p.stat().st_size for p in path.rglob("*") if p.is_file()]
    return sum(sizes), max(sizes, default=0)


def run_child(command: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one child process.

    GNU time reports the peak RSS of a freshly exec'd child; a child forked straight from this
    process would start its ru_maxrss at our own (large) RSS.
    """
    gnu_time = shutil.which("time") or "/usr/bin/time"
    with tempfile.NamedTemporaryFile("r", suffix=".time") as report:
        started = time.perf_counter()
        completed = subprocess.run([gnu_time, "-o", report.name, "-f", "%M", *command],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        seconds = time.perf_counter() - started
        if completed.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{completed.stderr}")
        peak_kib = int(report.read().strip().splitlines()[-1])
    return seconds, peak_kib * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="parameter count relative to ~1 B")
    parser.add_argument("--workdir", type=Path, default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints afterwards")
    parser.add_argument("--workers", type=int, default=2,
                        help="also run the Megatron-output cases with --workers N (1: skip those rows)")
    options = parser.parse_args()

    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="pgconvert-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = bench_config(options.scale)
    src = workdir / "src_tp8"
    try:
        started = time.perf_counter()
        source = example_source(config, seed=0)
        saver = get_saver("megatron")
        if src.exists():
            shutil.rmtree(src)
        saver.save(source, src, SaveOptions(layout=ParallelLayout(tp=8)), lambda nbytes: None)
        largest_tensor = max(t.numel() * t.element_size() for _, t in source)
        del source
        src_bytes, _ = dir_bytes(src)
        synth_seconds = time.perf_counter() - started
        params = src_bytes // 2
        cases: list[Case] = []

        seconds, rss = run_child(["cp", "-r", str(src), str(workdir / "floor_copy")])
        floor = Case("floor (cp -r)", 1, seconds, src_bytes, rss)
        cases.append(floor)
        # pgconvert fsyncs what it writes; this is the same copy made durable, for comparison.
        seconds, rss = run_child(["sh", "-c", f"cp -r '{src}' '{workdir / 'floor_copy_synced'}' && sync"])
        cases.append(Case("cp -r + sync", 1, seconds, src_bytes, rss, seconds / floor.seconds))

        cli = [sys.executable, "-m", "pgconvert", "--quiet"]
        # (name, args, destination, workers): HF output is one pass, so it has no --workers row.
        plan: list[tuple[str, list[str], Path, int]] = [
            ("TP8 -> TP2", ["--dst-tp", "2", str(src)], workdir / "tp2", 1),
            ("TP8/PP1 -> TP2/PP2", ["--dst-tp", "2", "--dst-pp", "2", str(src)], workdir / "tp2pp2", 1),
        ]
        has_hf = "hf" in saver_names()
        if has_hf:
            plan += [
                ("TP8 -> HF", ["--dst-format", "hf", str(src)], workdir / "hf", 1),
                ("HF -> TP4", ["--dst-format", "megatron", "--dst-tp", "4", str(workdir / "hf")], workdir / "hf_tp4", 1),
            ]
        if options.workers > 1:
            plan += [(name, args, dst.with_name(dst.name + "_workers"), options.workers)
                     for name, args, dst, _ in list(plan) if name != "TP8 -> HF"]
        for name, args, dst, workers in plan:
            if dst.exists():
                shutil.rmtree(dst)
            extra = ["--workers", str(workers)] if workers > 1 else []
            seconds, rss = run_child([*cli, *extra, *args, str(dst)])
            written, largest = dir_bytes(dst)
            cases.append(Case(name, workers, seconds, written, rss, seconds / floor.seconds, largest, largest_tensor))
        if not has_hf:
            cases.append(Case("TP8 -> HF / HF -> TP4", 1, 0, 0, 0, skipped="the hf format is not installed"))
    finally:
        if not options.keep and options.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    if options.json:
        print(json.dumps({
            "config": config.to_dict(), "source_bytes": src_bytes, "parameters": params,
            "synthesis_seconds": synth_seconds, "torch_threads": torch.get_num_threads(),
            "cases": [asdict(case) | {"bytes_per_second": case.bytes_per_second} for case in cases],
        }, indent=2))
        return
    print(f"model: hidden {config.hidden_size}, {config.num_layers} layers, ffn {config.ffn_hidden_size}, "
          f"vocab {config.vocab_size}, ~{params / 1e9:.2f} B params, source {src_bytes / 2**30:.2f} GiB (TP8, bf16)")
    header = (f"{'case':<22} {'workers':>7} {'wall s':>8} {'MiB/s':>8} {'peak RSS MiB':>13} {'x floor':>8} "
              f"{'RSS/largest file':>17} {'RSS/largest tensor':>19}")
    print(header)
    print("-" * len(header))
    for case in cases:
        if case.skipped:
            print(f"{case.name:<22} skipped: {case.skipped}")
            continue
        ratio = f"{case.ratio_to_floor:.2f}" if case.ratio_to_floor is not None else "1.00"
        rss_ratio = f"{case.peak_rss_bytes / case.largest_output_file:.2f}" if case.largest_output_file else "-"
        tensor_ratio = f"{case.peak_rss_bytes / case.largest_tensor:.2f}" if case.largest_tensor else "-"
        print(f"{case.name:<22} {case.workers:>7} {case.seconds:>8.2f} {case.bytes_per_second / 2**20:>8.1f} "
              f"{case.peak_rss_bytes / 2**20:>13.1f} {ratio:>8} {rss_ratio:>17} {tensor_ratio:>19}")
    print("(peak RSS of a --workers row is the largest of the parent and its worker processes)")


if __name__ == "__main__":
    main()
