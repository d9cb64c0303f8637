"""The benchmark's results as markdown (``bench_convert.py --markdown docs/benchmarks.md``): one current
table of the conversion cases, one of the shape-only planning cases, and the command, machine and load
they ran under. It reads the same document ``--json-out`` writes."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from pgconvert.version import __version__

DIGEST_CHARS = 12

COLUMNS = """\
What the columns say:

- **wall s**: median wall time of the conversion, a child process `python -m pgconvert --quiet …`
  (start-up and imports included; the package byte-compiled first, as installing it does).
- **floor s**: median of the durable copies `cp -r SRC X && sync` of the case's source, run in
  alternating pairs with the conversions; **× floor** is wall s over floor s.
- **CPU s**: median user + system CPU seconds of the conversion process and its children (GNU time
  `%U` + `%S`); **CPU s/GiB**: CPU s per GiB written.
- **peak RSS**: the largest resident set over the runs (GNU time `%M`), against the goal *2 × the
  largest tensor + 300 MB*; **anon**: the peak of the anonymous memory alone (RssAnon sampled every
  20 ms), without file-backed pages (the libraries' code, any file a process maps).
- **written**: the bytes of the output; **output sha256**: the first 12 hex digits of a sha256 over
  every output file's relative path, size and bytes, `pgconvert.json` aside (it records when it was
  written), a torch_dist `.metadata` without its `storage_meta` (the staging path and a random save id
  torch.distributed.checkpoint records). Equal digests mean byte-identical outputs; the JSON
  (`--json-out`) holds the whole digest.

The cases: a Llama-shaped TP8 Megatron checkpoint of seeded bf16 weights (`--scale`, 1: about 1 B
parameters) converted to other layouts and formats; `HF-FP8` cases read a copy of the `TP8 -> HF`
output with every linear weight FP8 block-scaled as DeepSeek-V3 stores it; `HF-FP8(DeepSeek)` cases
read a DeepSeek-V3-shaped FP8 checkpoint (`benchmarks/deepseek_fp8.py`, sized by `--scale`); `opt`
cases convert a Megatron-LM distributed-optimizer run (`--optim-scale`) with its optimizer state, and
`skip` ones the same with `--skip-optimizer`. `TP8 -> torch_dist` writes megatron-core 0.19's form (the common
state inside the checkpoint), `legacy` writes `common.pt` instead, both with `--digest`'s XXH3; `sha256` adds the
`integrity.json` Megatron-LM's `--verify-integrity` needs, a sha256 of every data file (about 0.6 CPU-seconds per
GiB, what megatron-core's own save pays for it). The shape-only cases plan and
dry-run, from metadata alone, models no one could hold here. Without `--cold` the copy reads the case's
source just before its conversion, so the conversion finds it in the page cache; with `--cold` both read
it from the device (its pages dropped before each), as a checkpoint larger than memory is read.
"""


def _git_revision() -> str | None:
    try:
        found = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "describe", "--always", "--dirty"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (found.stdout.strip() or None) if found.returncode == 0 else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def run_context(load_before: tuple[float, float, float], load_after: tuple[float, float, float],
                torch_threads: int) -> dict[str, Any]:
    """The command, the machine and the load a run had: what its figures depend on."""
    import torch

    return {
        "command": shlex.join(["python", "benchmarks/bench_convert.py", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "pgconvert": __version__, "revision": _git_revision(),
        "nproc": len(os.sched_getaffinity(0)), "cpu_model": _cpu_model(), "memory_bytes": _memory_bytes(),
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "torch_threads": torch_threads, "load_before": list(load_before), "load_after": list(load_after),
    }


def _size(count: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{int(count)} B"


def _cell(text: str) -> str:
    """``text`` inside a table cell (a pipe would end the cell)."""
    return text.replace("|", "\\|")


def _load(values: list[float]) -> str:
    return ", ".join(f"{value:.2f}" for value in values)


def _header(doc: dict[str, Any]) -> list[str]:
    run = doc["run"]
    memory = _size(run["memory_bytes"]) if run["memory_bytes"] else "unknown"
    revision = f" ({run['revision']})" if run["revision"] else ""
    rows = [
        ("command", f"`{_cell(run['command'])}`"),
        ("date", run["date"]),
        ("pgconvert", f"{run['pgconvert']}{revision}"),
        ("machine", f"{run['nproc']} CPUs (nproc), {run['cpu_model']}, {memory} memory; {run['platform']}, "
                    f"Python {run['python']}, torch {run['torch']}"),
        ("torch threads", str(run["torch_threads"])),
        ("load average (1, 5, 15 min)", f"before {_load(run['load_before'])}; after {_load(run['load_after'])}"),
    ]
    if "config" in doc:
        config = doc["config"]
        rows.append(("model", f"Llama-shaped: hidden {config['hidden_size']}, {config['num_layers']} layers, "
                              f"ffn {config['ffn_hidden_size']}, vocab {config['vocab_size']}; source "
                              f"{_size(doc['source_bytes'])} (TP8, bf16), largest tensor "
                              f"{_size(doc['largest_tensor'])}; "
                              f"`--scale {doc['scale']}`, `--optim-scale {doc['optim_scale']}`"))
        rows.append(("runs", f"{doc['repeat']} alternating (durable copy, conversion) pair(s) per case; medians"))
    return ["# Benchmarks", "",
            "Written by `benchmarks/bench_convert.py --markdown docs/benchmarks.md`: run it again (on an idle",
            "machine) to replace these figures rather than editing them.", "",
            "| | |", "|---|---|", *(f"| {key} | {value} |" for key, value in rows), ""]


def _case_table(cases: list[dict[str, Any]]) -> list[str]:
    if not cases:
        return []
    baseline = any(case["baseline"] for case in cases)
    head = ["case", *(["python"] if baseline else []), "wall s", "floor s", "× floor", "CPU s", "CPU s/GiB",
            "peak RSS MiB", "RSS goal MiB", "anon MiB", "written", "output sha256"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in cases:
        cells = [_cell(case["label"]), *(["baseline" if case["baseline"] else "this"] if baseline else []),
                 f"{case['seconds']:.2f}", f"{case['floor_seconds']:.2f}", f"{case['ratio_to_floor'] or 0:.2f}",
                 f"{case['cpu_seconds']:.2f}", f"{case['cpu_seconds_per_gib']:.2f}",
                 f"{case['peak_rss_bytes'] / 2**20:.0f}", f"{case['rss_goal_bytes'] / 2**20:.0f}",
                 f"{case['peak_anon_bytes'] / 2**20:.0f}", _size(case["bytes_written"]),
                 f"`{case['digest'][:DIGEST_CHARS]}`"]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


# Hosts a shape-only plan's conversion time is projected for (split with --shard-index), and the measured
# case whose bytes per second the projection uses.
PROJECTED_HOSTS = (1, 8, 32)
PROJECTION_CASE = "TP8 -> TP2"


def projection_rate(cases: list[Any]) -> float | None:
    """Bytes per second of this version's one-process ``PROJECTION_CASE`` (None when it was not run)."""
    for case in cases:
        fields = case if isinstance(case, dict) else vars(case)
        if fields["name"] == PROJECTION_CASE and fields["workers"] == 1 and fields.get("baseline") is not True \
                and fields["seconds"] and fields.get("python") == sys.executable:
            return float(fields["bytes_written"] / fields["seconds"])
    return None


def projected_text(planned_bytes: int, rate: float | None, hosts: int) -> str:
    """The projected wall time of writing ``planned_bytes`` on ``hosts`` hosts at ``rate`` bytes/s each."""
    if not rate:
        return "-"
    seconds = planned_bytes / rate / hosts
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _plan_table(cases: list[dict[str, Any]], rate: float | None) -> list[str]:
    if not cases:
        return []
    hosts = [f"projected, {count} host{'s' if count > 1 else ''}" for count in PROJECTED_HOSTS]
    lines = ["| shape-only plan + dry-run | layout | tensors | files | planned | wall s | peak RSS MiB | "
             + " | ".join(hosts) + " |", "|---|---|---|---|---|---|---|" + "---|" * len(hosts)]
    for case in cases:
        projected = " | ".join(projected_text(case["planned_bytes"], rate, count) for count in PROJECTED_HOSTS)
        lines.append(f"| {_cell(case['name'])} | `{_cell(case['layout'])}` | {case['tensors']:,} | {case['files']:,} | "
                     f"{_size(case['planned_bytes'])} | {case['seconds']:.2f} | {case['peak_rss_bytes'] / 2**20:.0f} | "
                     f"{projected} |")
    note = (f"Projected: the planned bytes at the measured bytes per second of `{PROJECTION_CASE}` (one process, "
            f"{rate / 2**20:.0f} MiB/s), divided among hosts that split the files with `--shard-index` "
            "(each reading and writing its own share at that rate)." if rate else
            f"No projection: `{PROJECTION_CASE}` was not measured in this run.")
    return [*lines, "", note, ""]


def markdown(doc: dict[str, Any]) -> str:
    """docs/benchmarks.md from the results document."""
    lines = [*_header(doc), *_case_table(doc["cases"]), *_plan_table(doc["plan_cases"], doc.get("projection_rate")),
             COLUMNS]
    return "\n".join(lines)
