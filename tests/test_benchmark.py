"""The benchmark script runs end to end and writes its table; its output digest means byte-identical.

The benchmark measures each conversion as its own child process (`python -m pgconvert`, which imports
torch: ~3 s here), so the end-to-end run takes a subset of the cases, once each: one of every kind of
source and target (per-rank, torch_dist, HF, FP8 HF, optimizer state with and without it), the sources
they read, and the two shape-only plans. It asserts nothing about time; it exists because the script
broke unnoticed before.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
# Asked for; "TP8 -> HF" and "TP8 -> torch_dist" also run, as the sources "HF-FP8 -> TP4" and
# "torch_dist -> TP2" read.
ASKED = ["TP8 -> TP2", "TP8 -> TP1", "HF-FP8 -> TP4", "torch_dist -> TP2", "opt TP2 -> TP1", "opt TP2 -> TP1 skip",
         "opt torch_dist(dp) -> TP1 skip"]
CASES = ["TP8 -> TP2", "TP8 -> TP1", "TP8 -> HF", "HF-FP8 -> TP4", "TP8 -> torch_dist", "torch_dist -> TP2",
         "opt TP2 -> TP1", "opt TP2 -> TP1 skip", "opt torch_dist(dp) -> TP1 skip"]
PLAN_CASES = ["Llama-405B TP8/PP16", "MoE 256x61 EP64/PP16"]


@pytest.fixture(scope="module")
def bench_convert() -> object:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_convert
    finally:
        sys.path.remove(str(BENCHMARKS))
    return bench_convert


def test_the_benchmark_runs_its_cases_and_writes_one_table_with_digests(tmp_path: Path) -> None:
    markdown, results = tmp_path / "benchmarks.md", tmp_path / "results.json"
    command = [sys.executable, str(BENCHMARKS / "bench_convert.py"), "--scale", "0.0001", "--optim-scale", "0.0001",
               "--repeat", "1", "--workers", "1", "--workdir", str(tmp_path / "work"), "--cases", ",".join(ASKED),
               "--markdown", str(markdown), "--json-out", str(results)]

    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1200)

    assert run.returncode == 0, run.stderr[-3000:]
    doc, text = json.loads(results.read_text()), markdown.read_text()
    digests = {case["label"]: case["digest"] for case in doc["cases"]}
    assert list(digests) == CASES
    assert all(re.fullmatch(r"[0-9a-f]{64}", digest) for digest in digests.values())
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    assert [label for label in CASES if f"`{digests[label][:12]}`" not in rows.get(label, "")] == []
    assert [name for name in PLAN_CASES if name not in rows] == []
    for key in ("command", "date", "machine", "torch threads", "load average (1, 5, 15 min)"):
        assert key in rows, key
    assert "--markdown" in rows["command"] and "nproc" in rows["machine"] and "after" in rows[
        "load average (1, 5, 15 min)"]
    # Exact conversions to the same target write the same bytes, whichever source they read.
    assert digests["TP8 -> TP2"] == digests["torch_dist -> TP2"] != digests["TP8 -> TP1"]
    assert digests["opt TP2 -> TP1 skip"] == digests["opt torch_dist(dp) -> TP1 skip"] != digests["opt TP2 -> TP1"]


def test_the_output_digest_sees_every_byte_and_name_but_not_the_manifest(tmp_path: Path, bench_convert: object) -> None:
    digest = bench_convert.output_digest  # type: ignore[attr-defined]
    (tmp_path / "iter_0000001").mkdir()
    (tmp_path / "iter_0000001" / "model.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "pgconvert.json").write_text('{"created": "today"}')
    before = digest(tmp_path)

    (tmp_path / "pgconvert.json").write_text('{"created": "tomorrow"}')
    after_manifest = digest(tmp_path)
    (tmp_path / "iter_0000001" / "model.bin").write_bytes(b"\x00\x01\x03")
    after_byte = digest(tmp_path)
    (tmp_path / "iter_0000001" / "model.bin").write_bytes(b"\x00\x01\x02")
    (tmp_path / "a.json").rename(tmp_path / "b.json")
    after_rename = digest(tmp_path)

    assert after_manifest == before
    assert len({before, after_byte, after_rename}) == 3
