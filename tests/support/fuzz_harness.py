"""Test-only harness of the fuzzing layer (tests/test_fuzz.py): tiny pristine checkpoints of every
format (and Megatron-LM's own training checkpoints, with their optimizer state), mutations of their
bytes, headers, pickles (the model, the args, the optimizer state), JSON and tracker, and the
properties every mutated input must satisfy when it is converted, inspected and verified.

The properties: exit 1 or 2 with a message naming a file (or an option), or exit 0 with
an output that ``pgconvert verify`` finds equal to the source; no traceback; bounded memory and
time; no complete-looking destination after a failure; the source unchanged.

``PGCONVERT_FUZZ_REPORT=path`` records each violation as one JSON line there instead of failing the
example, so a long run (``PGCONVERT_FUZZ_EXAMPLES``) collects every distinct failure it meets.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from click.testing import CliRunner, Result
from support.tiny_models import GQA_SWIGLU
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint
from support.optimizer_faults import DISTRIBUTED, PLAIN_BF16

import pgconvert
from pgconvert.cli import main

# A smaller cousin of the GQA/SwiGLU/RMSNorm/RoPE/untied model: 2 layers, 256 padded vocab rows.
FUZZ_MODEL = replace(GQA_SWIGLU, num_layers=2, hidden_size=32, num_attention_heads=8, num_query_groups=4,
                     ffn_hidden_size=64, vocab_size=200, make_vocab_size_divisible_by=64)
MEMORY_LIMIT = 1 << 30  # peak RSS (subprocess) or address-space growth (in process) allowed per example
TIME_LIMIT = 30.0  # seconds per example
EXIT_CODES = (1, 2)
REPORT = os.environ.get("PGCONVERT_FUZZ_REPORT")


# ----------------------------------------------------------------------------------- fixtures

def build_pristine(root: Path) -> dict[str, Path]:
    """The unmutated sources: megatron tp=2, torch_dist, hf (two shards + index); with optimizer state,
    Megatron-LM's own TP2 training checkpoints (``optimizer/distributed``: rank files and
    ``distrib_optim.pt``; ``optimizer/plain``: the plain optimizer in the rank files) and pgconvert's
    torch_dist outputs of the first (``optimizer/fully_reshardable``: param groups in ``common.pt``;
    ``optimizer/dp_reshardable``: per model-parallel rank objects); no manifests."""
    megatron = write_megatron_checkpoint(root / "megatron", FUZZ_MODEL, make_full_model(FUZZ_MODEL), 2, 1)
    pgconvert.convert(megatron, root / "torch_dist", dst_format="torch_dist")
    pgconvert.convert(megatron, root / "hf", dst_format="hf", max_shard_size=80_000)
    optimizer = {"optimizer/distributed": copy_source(DISTRIBUTED, root / "optimizer_distributed"),
                 "optimizer/plain": copy_source(PLAIN_BF16, root / "optimizer_plain")}
    for form in ("fully_reshardable", "dp_reshardable"):
        optimizer[f"optimizer/{form}"] = pgconvert.convert(DISTRIBUTED, root / f"optimizer_{form}",
                                                           dst_format="torch_dist", dst_optim_form=form).dst
    for name in ("torch_dist", "hf", *(path.name for path in optimizer.values() if "reshardable" in path.name)):
        # Kept aside: a manifest makes verify compare file hashes, which a byte flip rightly breaks.
        (root / name / "pgconvert.json").rename(root / f"{name}.pgconvert.json")
    assert (root / "hf" / "model.safetensors.index.json").is_file()
    return {"megatron": megatron, "torch_dist": root / "torch_dist", "hf": root / "hf", **optimizer}


def copy_source(pristine: Path, where: Path) -> Path:
    shutil.copytree(pristine, where, symlinks=True)
    return where


def source_files(src: Path, suffixes: tuple[str, ...]) -> list[Path]:
    return sorted(p for p in src.rglob("*") if p.is_file() and p.name.endswith(suffixes))


def tree_hash(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (files by sha256, directories and links by kind)."""
    digest: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            digest[rel] = f"link:{os.readlink(path)}"
        elif path.is_file():
            digest[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            digest[rel] = "dir"
    return digest


# ----------------------------------------------------------------------------------- mutations

def mutate_bytes(path: Path, kind: str, at: float, payload: bytes) -> None:
    """Flip, truncate at, insert at, or overwrite at the fraction ``at`` of the file."""
    data = bytearray(path.read_bytes())
    pos = min(int(at * len(data)), max(len(data) - 1, 0))
    if kind == "flip" and data:
        data[pos] ^= payload[0] if payload and payload[0] else 0xFF
    elif kind == "truncate":
        del data[pos:]
    elif kind == "insert":
        data[pos:pos] = payload
    elif kind == "overwrite":
        data[pos:pos + len(payload)] = payload
    path.write_bytes(bytes(data))


def read_safetensors_header(path: Path) -> tuple[dict[str, Any], bytes]:
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + length]), data[8 + length:]


def write_safetensors_raw(path: Path, header_text: str, body: bytes, declared: int | None = None) -> None:
    encoded = header_text.encode()
    size = len(encoded) if declared is None else declared
    path.write_bytes(struct.pack("<Q", size % (1 << 64)) + encoded + body)


def mutate_safetensors_header(path: Path, field_name: str, tensor_index: int, value: Any) -> None:
    """Set one header field of one tensor (``dtype``, ``shape``, ``data_offsets``), duplicate a
    tensor's entry with ``value`` as its dtype, or declare ``value`` as the header length."""
    header, body = read_safetensors_header(path)
    names = [name for name in header if name != "__metadata__"]
    name = names[tensor_index % len(names)]
    if field_name == "header_length":
        write_safetensors_raw(path, json.dumps(header), body, declared=int(value))
        return
    if field_name == "duplicate":
        text = json.dumps(header)
        entry = dict(header[name], dtype=value)
        # JSON with the same key twice: the later entry names the same bytes with another dtype.
        text = text[:-1] + f", {json.dumps(name)}: {json.dumps(entry)}}}"
        write_safetensors_raw(path, text, body)
        return
    if field_name == "delete":
        del header[name]
    elif field_name == "metadata":
        header["__metadata__"] = value
    else:
        header[name][field_name] = value
    write_safetensors_raw(path, json.dumps(header, allow_nan=True), body)


def rewrite_pickle(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    import argparse
    import io

    with torch.serialization.safe_globals([argparse.Namespace, io.BytesIO]):
        state = torch.load(path, map_location="cpu", weights_only=True)
    change(state)
    torch.save(state, path)


def rewrite_framework_pickle(path: Path, change: Callable[[Any], None]) -> None:
    """``rewrite_pickle`` for files whose args hold Megatron-LM's classes (its own training checkpoints, and
    pgconvert's torch_dist ``common.pt`` of one): loaded with megatron-core's safe globals and pgconvert's stand-ins,
    saved with them."""
    from pgconvert.formats.megatron import FRAMEWORK_PICKLE
    from support.megatron_fixtures import load_for_test

    state = load_for_test(path)
    change(state)
    torch.save(state, path, pickle_module=FRAMEWORK_PICKLE)


def set_arg(name: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(state: dict[str, Any]) -> None:
        if value == "<delete>":
            if hasattr(state["args"], name):
                delattr(state["args"], name)
        else:
            setattr(state["args"], name, value)
    return change


def restructure_model(kind: str, index: int) -> Callable[[dict[str, Any]], None]:
    """Break the structure of the ``model`` dict of a rank file (or the file's top level)."""
    def change(state: dict[str, Any]) -> None:
        model = state["model"]
        keys = sorted(model)
        key = keys[index % len(keys)]
        if kind == "model_list":
            state["model"] = list(model.values())
        elif kind == "int_key":
            model[index] = model.pop(key)
        elif kind == "drop_key":
            del model[key]
        elif kind == "extra_key":
            model[f"decoder.layers.{index}.bogus.weight"] = torch.zeros(3)
        elif kind == "wrong_shape" and isinstance(model[key], torch.Tensor):
            model[key] = model[key].reshape(-1)[: max(model[key].numel() - 1 - index, 0)].clone()
        elif kind == "wrong_dtype" and isinstance(model[key], torch.Tensor):
            model[key] = model[key].to(torch.float64 if index % 2 else torch.int32)
        elif kind == "not_a_tensor":
            model[key] = [None, "x", index][index % 3]
        elif kind == "no_model":
            del state["model"]
        elif kind == "args_none":
            state["args"] = None
        elif kind == "args_dict":
            state["args"] = dict(vars(state["args"]))
    return change


# A file's parts that hold optimizer state (a rank file's and a torch_dist common state's entries;
# a distrib_optim.pt is optimizer state throughout).
OPTIMIZER_ENTRIES = ("optimizer", "opt_param_scheduler", "iteration", "num_floating_point_operations_so_far")
# Places visited at most per file, and how deep.
MAX_PLACES = 2000
MAX_DEPTH = 8


def optimizer_places(state: Any) -> list[tuple[Any, ...]]:
    """Every place (a key path) in a file's optimizer parts, containers and leaves, in a fixed order: under
    ``OPTIMIZER_ENTRIES`` of a dict holding a model or args (a rank file, ``common.pt``), else anywhere."""
    places: list[tuple[Any, ...]] = []
    whole = not (isinstance(state, dict) and ("args" in state or "model" in state))
    roots = [()] if whole else [(key,) for key in OPTIMIZER_ENTRIES if key in state]
    for root in roots:
        _walk(_at(state, root), root, places)
    return [place for place in places if place]


def _walk(value: Any, place: tuple[Any, ...], places: list[tuple[Any, ...]]) -> None:
    if len(places) >= MAX_PLACES:
        return
    places.append(place)
    if len(place) >= MAX_DEPTH:
        return
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            _walk(value[key], (*place, key), places)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _walk(item, (*place, index), places)


def _at(state: Any, place: tuple[Any, ...]) -> Any:
    for key in place:
        state = state[key]
    return state


def _replaced(container: Any, key: Any, value: Any) -> Any:
    """``container`` with ``key`` set to ``value`` (a tuple rebuilt; ``<delete>``: removed)."""
    if isinstance(container, tuple):
        items = list(container)
        if value == "<delete>":
            del items[key]
        else:
            items[key] = value
        return tuple(items)
    if value == "<delete>":
        del container[key]
    else:
        container[key] = value
    return container


def _materialized(value: Any, old: Any) -> Any:
    """A drawn value, the tensor-shaped ones made from the value they replace."""
    if value == "<non-finite>":  # one element of a float tensor set to NaN or Inf, the rest kept
        if isinstance(old, torch.Tensor) and old.is_floating_point() and old.numel():
            changed = old.clone()
            changed.view(-1)[old.numel() // 2] = math.nan if old.numel() % 2 else math.inf
            return changed
        return math.nan
    tensors = {"<scalar-tensor>": lambda: torch.tensor(-1.0), "<fraction-tensor>": lambda: torch.tensor(2.5),
               "<empty-tensor>": lambda: torch.zeros(0), "<int-tensor>": lambda: torch.arange(3),
               "<wide-tensor>": lambda: torch.zeros(3, 2)}
    return tensors[value]() if isinstance(value, str) and value in tensors else value


def mutate_optimizer(kind: str, index: int, value: Any) -> Callable[[Any], None]:
    """Change place ``index`` (``optimizer_places``) of a file's optimizer state: ``set`` it to ``value``,
    ``delete`` it, or ``rekey`` it (its key in the dict holding it replaced by ``value``, when hashable)."""
    def change(state: Any) -> None:
        places = optimizer_places(state)
        if not places:
            return
        place = places[index % len(places)]
        parent = _at(state, place[:-1])
        key = place[-1]
        if kind == "rekey" and isinstance(parent, dict):
            try:
                parent[value] = parent.pop(key)
            except TypeError:  # an unhashable drawn value: no key
                parent[key] = parent.get(key)
            return
        new = "<delete>" if kind == "delete" else _materialized(value, parent[key])
        rebuilt = _replaced(parent, key, new)
        if rebuilt is not parent:  # a tuple: set the rebuilt one where it was
            _replaced(_at(state, place[:-2]), place[-2], rebuilt)
    return change


def deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


def mutate_json(path: Path, key_index: int, value: Any, raw: str | None) -> None:
    """Set one top-level key (by index; -1 adds a new one) to ``value``, or replace the whole text."""
    if raw is not None:
        path.write_text(raw)
        return
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict):
        return
    keys = sorted(doc)
    key = keys[key_index % len(keys)] if keys and key_index >= 0 else "fuzz_extra"
    if value == "<delete>":
        doc.pop(key, None)
    else:
        doc[key] = value
    path.write_text(json.dumps(doc, allow_nan=True))


# ----------------------------------------------------------------------------------- running

@dataclass
class Outcome:
    command: list[str]
    exit_code: int
    output: str
    traceback: str | None = None
    seconds: float = 0.0
    peak_bytes: int = 0


class _Timeout(Exception):
    """Raised by the alarm when an in-process example runs past TIME_LIMIT."""


@contextmanager
def _bounded() -> Iterator[None]:
    """Address space limited to its current size + MEMORY_LIMIT, and an alarm at TIME_LIMIT."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    current = _address_space()

    def alarm(signum: int, frame: FrameType | None) -> None:
        raise _Timeout(f"ran past {TIME_LIMIT} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    resource.setrlimit(resource.RLIMIT_AS, (min(current + MEMORY_LIMIT, hard) if hard > 0 else current + MEMORY_LIMIT, hard))
    signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGALRM, previous)


def _address_space() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


def run_in_process(*args: str | Path) -> Outcome:
    command = [str(arg) for arg in args]
    started = time.perf_counter()
    with _bounded():
        try:
            result: Result = CliRunner().invoke(main, command)
        except _Timeout as timeout:  # raised outside click's own handler
            return Outcome(command, -1, "", f"timeout: {timeout}", time.perf_counter() - started)
    seconds = time.perf_counter() - started
    trace = None
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        trace = "".join(traceback.format_exception(result.exception))[-3000:]
    return Outcome(command, result.exit_code, result.output, trace, seconds)


def run_subprocess(*args: str | Path) -> Outcome:
    """``python -m pgconvert`` with its own peak RSS (from wait4) and wall time; killed at TIME_LIMIT
    (+ the interpreter's start-up)."""
    command = [str(arg) for arg in args]
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log, open(os.devnull, "rb") as stdin:
        process = subprocess.Popen([sys.executable, "-m", "pgconvert", *command], stdin=stdin, stdout=log,
                                   stderr=subprocess.STDOUT)
        deadline = started + TIME_LIMIT + 15
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                process.kill()
                pid, status, usage = os.wait4(process.pid, 0)
                break
            time.sleep(0.05)
        process.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        output = log.read()
    trace = output if "Traceback (most recent call last)" in output else None
    return Outcome(command, process.returncode, output, trace, time.perf_counter() - started, usage.ru_maxrss * 1024)


# ----------------------------------------------------------------------------------- properties

@dataclass
class Case:
    """One mutated input: what was done, the source, the conversion's arguments."""

    group: str
    description: str
    src: Path
    dst: Path
    convert_args: list[str] = field(default_factory=list)
    reference: Path | None = None  # what verify compares DST with (default: src)
    named: list[Path] = field(default_factory=list)  # more paths an error may name (a batch plan)


def _violations(case: Case, outcome: Outcome, before: dict[str, str]) -> list[str]:
    found = []
    if outcome.traceback:
        found.append(f"traceback: {outcome.traceback.strip().splitlines()[-1]}")
    if "Traceback (most recent call last)" in outcome.output:
        found.append("traceback in the output")
    if outcome.seconds > TIME_LIMIT:
        found.append(f"took {outcome.seconds:.1f} s")
    if outcome.peak_bytes > MEMORY_LIMIT:
        found.append(f"peak RSS {outcome.peak_bytes >> 20} MiB")
    if outcome.exit_code not in (0, *EXIT_CODES):
        found.append(f"exit code {outcome.exit_code}")
    if outcome.exit_code in EXIT_CODES and not _names_a_file_or_option(case, outcome.output):
        found.append("the message names no file and no option")
    if tree_hash(case.src) != before:
        found.append("the source changed")
    return found


def _names_a_file_or_option(case: Case, output: str) -> bool:
    paths = [case.src, case.dst, *case.named]
    return any(str(path) in output for path in paths) or " --" in f" {output}" or "\n--" in output


def _destination_violations(case: Case, outcome: Outcome) -> list[str]:
    dst = case.dst
    leftovers = sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))
    found = [f"left behind {leftovers}"] if leftovers else []
    if outcome.exit_code != 0:
        if dst.exists():
            found.append("a destination exists after a failure")
        return found
    if outcome.exit_code == 0 and case.convert_args and not dst.exists():
        found.append("exit 0 but no destination")
    elif case.convert_args:
        verdict = run_in_process("verify", case.reference or case.src, dst)
        if verdict.traceback or (verdict.exit_code != 0 and not _only_unhashed_data(case.reference or case.src, dst)):
            found.append(f"converted, but verify says: {_tail(verdict.traceback or verdict.output)}")
    return found


def _only_unhashed_data(reference: Path, dst: Path) -> bool:
    """Whether verify's one objection is that data files of the (torch_dist) source differ from its integrity.json:
    a conversion hashes them only with --verify-integrity (docs/safety.md), so the output is what the source holds
    and every tensor of it verifies equal."""
    import pgconvert
    from pgconvert.errors import PgconvertError

    try:
        report = pgconvert.verify(reference, dst)
    except PgconvertError:
        return False
    unhashed = [problem for problem in report.file_problems
                if problem.startswith("A: ") and ".distcp: sha256 " in problem and "but integrity.json records" in problem]
    return (not report.differences and (report.optimizer is None or report.optimizer.equal)
            and bool(unhashed) and len(unhashed) == len(report.file_problems))


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


def check_case(case: Case, subprocess_run: bool = False) -> list[str]:
    """Convert, then inspect and verify the mutated source; every property violated, as text."""
    before = tree_hash(case.src)
    runner = run_subprocess if subprocess_run else run_in_process
    problems: list[str] = []
    if case.convert_args:
        outcome = runner(case.src, case.dst, *case.convert_args)
        problems += [f"convert: {p}" for p in _violations(case, outcome, before)]
        problems += [f"convert: {p}" for p in _destination_violations(case, outcome)]
        if problems:
            problems.append(f"convert exit {outcome.exit_code}: {_tail(outcome.traceback or outcome.output)}")
    if not subprocess_run:
        for command in (["inspect", case.src], ["verify", case.src, case.reference or case.src]):
            outcome = run_in_process(*command)
            found = _violations(case, outcome, before)
            if found:
                problems += [f"{command[0]}: {p}" for p in found]
                problems.append(f"{command[0]} exit {outcome.exit_code}: {_tail(outcome.traceback or outcome.output)}")
    return problems


def assert_properties(case: Case, subprocess_run: bool = False) -> None:
    assert_no_problems(case, check_case(case, subprocess_run))


def assert_no_problems(case: Case, problems: list[str]) -> None:
    if problems and REPORT:
        with open(REPORT, "a") as report:
            report.write(json.dumps({"group": case.group, "input": case.description, "args": case.convert_args,
                                     "problems": problems}) + "\n")
        return
    assert not problems, f"{case.group}: {case.description} {case.convert_args}\n" + "\n".join(problems)


def check_batch(src: Path, plan_text: str) -> None:
    """``pgconvert batch`` of a plan next to ``src``: the same properties, for each entry."""
    plan = src.parent / "plan.toml"
    plan.write_text(plan_text)
    before = tree_hash(src)
    started = time.perf_counter()
    with _bounded():
        result = CliRunner().invoke(main, ["batch", str(plan), "--json"])
    case = Case("batch", f"plan {plan_text!r}", src, src.parent / "out", named=[plan, src.parent])
    outcome = Outcome(["batch"], result.exit_code, result.output, None, time.perf_counter() - started)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        outcome.traceback = "".join(traceback.format_exception(result.exception))[-3000:]
    problems = _violations(case, outcome, before)
    if not problems and outcome.exit_code in (0, 1) and result.stdout.lstrip().startswith("{"):
        problems += _batch_entry_violations(src, json.loads(result.stdout))
    if problems:
        problems.append(f"batch exit {outcome.exit_code}: {_tail(outcome.traceback or outcome.output)}")
    assert_no_problems(case, problems)


def _batch_entry_violations(src: Path, summary: dict[str, Any]) -> list[str]:
    found = []
    for entry in summary.get("entries", []):
        dst = Path(entry["dst"])
        if entry["status"] == "failed" and dst.exists() and not src.resolve().is_relative_to(dst.resolve()):
            found.append(f"entry {entry.get('label')}: failed ({entry.get('error')}) but {dst} exists")
        elif entry["status"] == "ok":
            verdict = run_in_process("verify", src, dst)
            if verdict.exit_code != 0 or verdict.traceback:
                found.append(f"entry {entry.get('label')}: ok, but verify says {_tail(verdict.traceback or verdict.output)}")
    return found
