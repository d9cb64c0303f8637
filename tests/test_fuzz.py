"""Property-based fuzzing of every input pgconvert reads: rank files, torch_dist
(.distcp, .metadata, common.pt, metadata.json), HF safetensors (bytes and header), config.json,
the index, pgconvert.json, the tracker file and batch plans; the counts and sizes config.json holds,
over a tiny checkpoint of every family; and the optimizer state of Megatron-LM's own training
checkpoints (distrib_optim.pt, the rank files' optimizer entries, torch_dist's optimizer records and
common.pt).

Every mutated input must convert to an output ``verify`` finds equal, or fail with exit 1 or 2 and
a message naming a file or option: no traceback, bounded memory and time, nothing that looks like
an output after a failure, the source untouched (see tests/support/fuzz_harness.py).

CI runs a fixed, derandomized budget. ``PGCONVERT_FUZZ_EXAMPLES=2000`` runs that many examples per
test with a random seed; ``PGCONVERT_FUZZ_REPORT=file.jsonl`` records failures there and goes on.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from support.declared_fixtures import count_keys, counted_keys, write_family_checkpoint
from support.fuzz_harness import (
    Case,
    assert_properties,
    build_pristine,
    copy_source,
    deep_json,
    mutate_bytes,
    mutate_json,
    mutate_safetensors_header,
    mutate_optimizer,
    restructure_model,
    rewrite_framework_pickle,
    rewrite_pickle,
    set_arg,
    source_files,
)
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from pgconvert.families import ORDERED

LONG_RUN = os.environ.get("PGCONVERT_FUZZ_EXAMPLES")


def budget(ci_examples: int, long_share: int = 1) -> Any:
    """CI: ``ci_examples``, derandomized; a long run: PGCONVERT_FUZZ_EXAMPLES / ``long_share`` each, random seed."""
    return settings(
        max_examples=max(int(LONG_RUN) // long_share, 1) if LONG_RUN else ci_examples,
        derandomize=not LONG_RUN,
        deadline=None,
        database=None,
        print_blob=True,
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                               HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_pristine(tmp_path_factory.mktemp("fuzz-pristine"))


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-examples")


class Workspace:
    """A fresh directory per example (hypothesis runs many examples inside one test call)."""

    def __init__(self, scratch: Path, pristine: dict[str, Path]) -> None:
        self.scratch = scratch
        self.pristine = pristine

    def __call__(self, fmt: str) -> tuple[Path, Path]:
        where = self.scratch / uuid.uuid4().hex[:10]
        where.mkdir()
        return copy_source(self.pristine[fmt], where / "src"), where / "dst"

    @staticmethod
    def done(src: Path) -> None:
        shutil.rmtree(src.parent, ignore_errors=True)


@pytest.fixture
def workspace(scratch: Path, pristine: dict[str, Path]) -> Iterator[Workspace]:
    yield Workspace(scratch, pristine)


FORMATS = ("megatron", "torch_dist", "hf")
TARGETS = st.sampled_from([
    ["--dst-format", "megatron", "--dst-tp", "1"],
    ["--dst-format", "megatron", "--dst-tp", "2"],
    ["--dst-format", "torch_dist", "--dst-tp", "1"],
    ["--dst-format", "hf"],
]).map(lambda args: [*args, "--quiet"])
SUFFIXES = {
    "megatron": (".pt",),
    "torch_dist": (".distcp", ".metadata", "common.pt", "metadata.json"),
    "hf": (".safetensors", ".json"),
}
BYTE_KINDS = st.sampled_from(["flip", "truncate", "insert", "overwrite"])
FRACTIONS = st.one_of(st.sampled_from([0.0, 0.001, 0.01, 0.5, 0.99, 0.999]), st.floats(0, 1))


def _run(workspace: Workspace, case: Case, subprocess_run: bool = False) -> None:
    try:
        assert_properties(case, subprocess_run)
    finally:
        workspace.done(case.src)


# ------------------------------------------------------------------------------------ bytes

def _mutate_one_file(src: Path, suffixes: tuple[str, ...], pick: int, kind: str, at: float, payload: bytes) -> str:
    """Mutate the bytes of one of the source's files (``pick`` chooses it); what was done, for the report."""
    files = source_files(src, suffixes)
    path = files[pick % len(files)]
    mutate_bytes(path, kind, at, payload)
    return f"{kind} {path.relative_to(src)} at {at:.4f} with {payload!r}"


@budget(60)
@given(fmt=st.sampled_from(FORMATS), pick=st.integers(0, 63), kind=BYTE_KINDS, at=FRACTIONS,
       payload=st.binary(min_size=1, max_size=64), target=TARGETS)
def test_fuzz_bytes(workspace: Workspace, fmt: str, pick: int, kind: str, at: float, payload: bytes,
                    target: list[str]) -> None:
    src, dst = workspace(fmt)
    what = _mutate_one_file(src, SUFFIXES[fmt], pick, kind, at, payload)
    _run(workspace, Case("bytes", what, src, dst, target))


# ------------------------------------------------------------------------------------ safetensors header

DTYPES = st.sampled_from(["F32", "F16", "BF16", "F64", "I8", "U8", "BOOL", "F8_E4M3", "I64", "X", "", "f32"])
HEADER_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "dtype": st.one_of(DTYPES, st.integers(), st.none()),
    "shape": st.one_of(
        st.lists(st.integers(-2, 2**40), max_size=4),
        st.lists(st.sampled_from([0, 1, 16, 32, 2**31, 2**63, -1]), max_size=3),
        st.just([1.5, 2]), st.just("32"), st.none(), st.just([[32]]),
    ),
    "data_offsets": st.one_of(
        st.lists(st.integers(-2, 2**64), min_size=2, max_size=2),
        st.lists(st.integers(0, 200_000), min_size=0, max_size=3),
        st.just(["0", "4"]), st.just([0.0, 4.0]), st.none(),
    ),
    "duplicate": DTYPES,
    "header_length": st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 7, 10**9, 2**62])),
    "metadata": st.one_of(st.none(), st.integers(), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
                          st.just({"format": "tf"})),
    "delete": st.none(),
}


@budget(50)
@given(field_name=st.sampled_from(sorted(HEADER_VALUES)), pick=st.integers(0, 63), data=st.data(), target=TARGETS)
def test_fuzz_safetensors_header(workspace: Workspace, field_name: str, pick: int, data: st.DataObject,
                                 target: list[str]) -> None:
    value = data.draw(HEADER_VALUES[field_name], label="value")
    src, dst = workspace("hf")
    shards = source_files(src, (".safetensors",))
    path = shards[pick % len(shards)]
    mutate_safetensors_header(path, field_name, pick, value)
    _run(workspace, Case("safetensors-header", f"{path.name}: {field_name} of tensor #{pick} = {value!r}",
                         src, dst, target))


# ------------------------------------------------------------------------------------ pickles

ARG_NAMES = sorted([
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size", "num_layers",
    "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "group_query_attention",
    "kv_channels", "padded_vocab_size", "make_vocab_size_divisible_by", "vocab_size", "swiglu", "normalization",
    "norm_epsilon", "add_bias_linear", "qk_layernorm", "untie_embeddings_and_output_weights",
    "position_embedding_type", "max_position_embeddings", "rotary_base", "params_dtype", "bf16",
    "transformer_impl", "decoder_first_pipeline_num_layers", "virtual_pipeline_model_parallel_size",
    "num_experts", "moe_layer_freq", "expert_tensor_parallel_size", "iteration",
    "pipeline_model_parallel_layout",
])
ARG_VALUES = st.one_of(
    st.integers(-3, 10),
    st.sampled_from([0, -1, -2, 10**9, 2**63, 10**30, 10**40]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -0.0]),
    st.text(max_size=6),
    st.sampled_from(["abc", "64", "RMSNorm", "rope", "bogus", "Et*3|tL"]),
    st.none(), st.booleans(),
    st.lists(st.integers(-2, 3), max_size=5),
    st.just("<delete>"),
)


@budget(60)
@given(fmt=st.sampled_from(["megatron", "torch_dist"]), name=st.sampled_from(ARG_NAMES), value=ARG_VALUES,
       only_one=st.booleans(), target=TARGETS)
def test_fuzz_args(workspace: Workspace, fmt: str, name: str, value: Any, only_one: bool, target: list[str]) -> None:
    src, dst = workspace(fmt)
    files = source_files(src, ("model_optim_rng.pt", "common.pt"))
    for path in files[-1:] if only_one else files:
        rewrite_pickle(path, set_arg(name, value))
    where = "the last file" if only_one else "every file"
    _run(workspace, Case("args", f"{fmt}: args.{name} = {value!r} in {where}", src, dst, target))


MODEL_CHANGES = ["model_list", "int_key", "drop_key", "extra_key", "wrong_shape", "wrong_dtype", "not_a_tensor",
                 "no_model", "args_none", "args_dict"]


@budget(40)
@given(kind=st.sampled_from(MODEL_CHANGES), index=st.integers(0, 40), only_one=st.booleans(), target=TARGETS)
def test_fuzz_model_structure(workspace: Workspace, kind: str, index: int, only_one: bool, target: list[str]) -> None:
    src, dst = workspace("megatron")
    files = source_files(src, ("model_optim_rng.pt",))
    for path in files[-1:] if only_one else files:
        rewrite_pickle(path, restructure_model(kind, index))
    _run(workspace, Case("model", f"{kind} #{index} in {'one rank file' if only_one else 'every rank file'}",
                         src, dst, target))


# ------------------------------------------------------------------------------------ optimizer state

# Per pristine with optimizer state, the files whose bytes hold it: distrib_optim.pt, and torch_dist's optimizer
# records (``__1_0.distcp``), index and common state (a rank file's optimizer entry: test_fuzz_optimizer_state).
OPTIMIZER_FILES = {
    "optimizer/distributed": ("distrib_optim.pt",),
    "optimizer/fully_reshardable": ("common.pt", "__1_0.distcp", ".metadata"),
    "optimizer/dp_reshardable": ("common.pt", "__1_0.distcp", ".metadata"),
}
OPTIMIZER_VALUES = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1.0, 2.5, 1e-30, -2, 0, 10**9, 2**63, 10**40, True,
                     None, "abc", "", (0.9, 1.0), (0.9,), (), [], {}, [1, 2], {"a": 1},
                     (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)]),
    st.sampled_from(["<non-finite>", "<scalar-tensor>", "<fraction-tensor>", "<empty-tensor>", "<int-tensor>",
                     "<wide-tensor>"]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-3, 10),
)
OPTIMIZER_PICKLES = {"optimizer/distributed": ("distrib_optim.pt", "model_optim_rng.pt"),
                     "optimizer/plain": ("model_optim_rng.pt",), "optimizer/fully_reshardable": ("common.pt",),
                     "optimizer/dp_reshardable": ("common.pt",)}


TO_MEGATRON_TP1 = ["--dst-format", "megatron", "--dst-tp", "1", "--quiet"]


@budget(10)
# Found by long runs: an fp32 master group that is not a list, a param group that is not a dict, a common
# state's iteration its directory contradicts, a state position that is not a number, an fp32 masters entry
# whose optimizer is not a dict, a numel_unpadded that is a tensor, a param group keyed by NaN.
@example(fmt="optimizer/plain", pick=0, kind="set", index=937, value=2**63, only_one=False, target=TO_MEGATRON_TP1)
@example(fmt="optimizer/distributed", pick=1, kind="set", index=205, value="abc", only_one=False,
         target=TO_MEGATRON_TP1)
@example(fmt="optimizer/dp_reshardable", pick=0, kind="set", index=358, value=0, only_one=True,
         target=TO_MEGATRON_TP1)
@example(fmt="optimizer/plain", pick=0, kind="rekey", index=1961, value="<empty-tensor>", only_one=True,
         target=TO_MEGATRON_TP1)
@example(fmt="optimizer/plain", pick=0, kind="set", index=327, value=(0.9,), only_one=False, target=TO_MEGATRON_TP1)
@example(fmt="optimizer/distributed", pick=0, kind="set", index=627, value="<wide-tensor>", only_one=False,
         target=TO_MEGATRON_TP1)
@example(fmt="optimizer/fully_reshardable", pick=0, kind="rekey", index=5, value=math.nan, only_one=False,
         target=["--dst-format", "megatron", "--dst-tp", "2", "--quiet"])
@given(fmt=st.sampled_from(sorted(OPTIMIZER_PICKLES)), pick=st.integers(0, 7),
       kind=st.sampled_from(["set", "set", "set", "delete", "rekey"]), index=st.integers(0, 2000),
       value=OPTIMIZER_VALUES, only_one=st.booleans(), target=TARGETS)
def test_fuzz_optimizer_state(workspace: Workspace, fmt: str, pick: int, kind: str, index: int, value: Any,
                              only_one: bool, target: list[str]) -> None:
    """One place of the optimizer state (a param group's value, a step, a moment, a dtype key, the scheduler, the
    grad scaler, ...) set, deleted or re-keyed, in one rank's file or in every rank's."""
    src, dst = workspace(fmt)
    names = OPTIMIZER_PICKLES[fmt]
    files = source_files(src, (names[pick % len(names)],))
    for path in files[-1:] if only_one else files:
        rewrite_framework_pickle(path, mutate_optimizer(kind, index, value))
    where = "the last file" if only_one else "every file"
    _run(workspace, Case("optimizer", f"{fmt}: {kind} place #{index} of {names[pick % len(names)]} = {value!r} in "
                                      f"{where}", src, dst, target))


@budget(6)
# Found by a long run: a fully_reshardable fp32 master record that no longer rounds to its weight.
@example(fmt="optimizer/fully_reshardable", pick=1, kind="flip", at=0.01, payload=b"r", target=TO_MEGATRON_TP1)
@given(fmt=st.sampled_from(sorted(OPTIMIZER_FILES)), pick=st.integers(0, 63), kind=BYTE_KINDS, at=FRACTIONS,
       payload=st.binary(min_size=1, max_size=16), target=TARGETS)
def test_fuzz_optimizer_bytes(workspace: Workspace, fmt: str, pick: int, kind: str, at: float, payload: bytes,
                              target: list[str]) -> None:
    src, dst = workspace(fmt)
    what = _mutate_one_file(src, OPTIMIZER_FILES[fmt], pick, kind, at, payload)
    _run(workspace, Case("optimizer-bytes", what, src, dst, target))


# ------------------------------------------------------------------------------------ JSON

JSON_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([-1, 0, 10**9]),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6))
JSON_VALUES = st.one_of(
    st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                            max_size=3), max_leaves=6),
    st.just("<delete>"),
)
RAW_JSON = st.one_of(
    st.sampled_from([deep_json(100), deep_json(2000), deep_json(100_000), "", "{", "[]", "null", "NaN", '{"a": NaN}',
                     '{"a": 1, "a": 2}', "\ufeff{}", '{"weight_map": {"x": "../outside.safetensors"}}']),
    st.text(max_size=20),
)
JSON_FILES = {
    "config.json": "hf", "model.safetensors.index.json": "hf", "metadata.json": "torch_dist",
}


@budget(60)
@given(file_name=st.sampled_from(sorted(JSON_FILES)), key_index=st.integers(-1, 40), value=JSON_VALUES,
       raw=st.one_of(st.none(), st.none(), st.none(), RAW_JSON), target=TARGETS)
def test_fuzz_json(workspace: Workspace, file_name: str, key_index: int, value: Any, raw: str | None,
                   target: list[str]) -> None:
    src, dst = workspace(JSON_FILES[file_name])
    path = next(src.rglob(file_name))
    mutate_json(path, key_index, value, raw)
    what = f"replaced by {raw[:60]!r} ({len(raw)} chars)" if raw is not None else f"key #{key_index} = {value!r}"
    _run(workspace, Case("json", f"{path.relative_to(src)}: {what}", src, dst, target))


@budget(30)
@given(fmt=st.sampled_from(["torch_dist", "hf"]), key_index=st.integers(-1, 20), value=JSON_VALUES,
       raw=st.one_of(st.none(), RAW_JSON), target=TARGETS)
def test_fuzz_manifest(workspace: Workspace, pristine: dict[str, Path], fmt: str, key_index: int, value: Any,
                       raw: str | None, target: list[str]) -> None:
    src, dst = workspace(fmt)
    manifest = src / "pgconvert.json"
    shutil.copy(pristine[fmt].parent / f"{fmt}.pgconvert.json", manifest)
    mutate_json(manifest, key_index, value, raw)
    what = f"replaced by {raw[:60]!r}" if raw is not None else f"key #{key_index} = {value!r}"
    # Converting ignores the source's manifest: DST must equal the tensors, read without it.
    _run(workspace, Case("manifest", f"{fmt}/pgconvert.json: {what}", src, dst, target, reference=pristine[fmt]))


# ------------------------------------------------------------------------------------ config.json counts

@pytest.fixture(scope="module")
def family_pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny checkpoint of every family, made from its table (tests/support/declared_fixtures.py)."""
    root = tmp_path_factory.mktemp("fuzz-families")
    return {family.architecture: write_family_checkpoint(family, root / family.architecture) for family in ORDERED}


COUNT_CASES = [(family.architecture, key) for family in ORDERED for key in count_keys(family)]
# The keys that count layers, experts and MTP layers, drawn as often as all the others together.
COUNTED_CASES = [(family.architecture, key) for family in ORDERED for key in counted_keys(family)]


COUNT_VALUES = st.one_of(
    st.integers(-2, 8), st.sampled_from([0, -1, 10**5, 10**9, 2**31, 2**63, 10**40]),
    st.floats(allow_nan=True, allow_infinity=True), st.none(), st.booleans(), st.text(max_size=4),
    st.lists(st.integers(-1, 6), max_size=5), st.just("<delete>"),
)


@budget(30)
@given(case=st.one_of(st.sampled_from(COUNT_CASES), st.sampled_from(COUNTED_CASES)), value=COUNT_VALUES,
       target=TARGETS)
@example(case=("DeepseekV3ForCausalLM", "num_nextn_predict_layers"), value=10**9, target=["--dst-format", "hf"])
@example(case=("DeepseekV3ForCausalLM", "num_nextn_predict_layers"), value=10**40, target=["--dst-format", "hf"])
def test_fuzz_config_json_counts(scratch: Path, family_pristine: dict[str, Path], case: tuple[str, str], value: Any,
                                 target: list[str]) -> None:
    """Every count or size a family reads from config.json (its table's integer fields, rule keys
    and MTP layer count), of every family."""
    architecture, key = case
    workspace = Workspace(scratch, family_pristine)
    src, dst = workspace(architecture)
    path = src / "config.json"
    doc = json.loads(path.read_text())
    if value == "<delete>":
        doc.pop(key, None)
    else:
        doc[key] = value
    path.write_text(json.dumps(doc, allow_nan=True))
    _run(workspace, Case("config-counts", f"{architecture}: config.json {key} = {value!r}", src, dst, target))


# ------------------------------------------------------------------------------------ tracker

TRACKER_BYTES = st.one_of(
    st.binary(max_size=24),
    st.sampled_from([b"100", b"100\n", b" 100 \n", b"0000100", b"release", b"RELEASE", b"-100", b"1e2", b"\xc2\xb2",
                     "100".encode("utf-16"), b"\xff\xfe1\x000\x000\x00", b"9" * 5000, b"100\x00", b"", b"200", b"1_0_0"]),
    st.text(max_size=12).map(str.encode),
)


@budget(40)
@given(fmt=st.sampled_from(["megatron", "torch_dist"]), content=TRACKER_BYTES, target=TARGETS)
def test_fuzz_tracker(workspace: Workspace, fmt: str, content: bytes, target: list[str]) -> None:
    src, dst = workspace(fmt)
    (src / "latest_checkpointed_iteration.txt").write_bytes(content)
    _run(workspace, Case("tracker", f"{fmt}: tracker holds {content[:40]!r} ({len(content)} bytes)", src, dst, target))


# ------------------------------------------------------------------------------------ batch plans

class _InlineProcessPool(ThreadPoolExecutor):
    """The batch runner's process pool, run in threads: the plan is what is fuzzed here, and a
    spawned interpreter per entry (seconds each) would leave no budget for it."""

    def __init__(self, max_workers: int, mp_context: object = None, initializer: Any = None,
                 initargs: tuple[Any, ...] = ()) -> None:
        super().__init__(max_workers=max_workers)


TOML_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")), max_size=10)
PLAN_DSTS = st.one_of(
    st.sampled_from(["out/a", "out/{iteration}", "out/{iteration:07d}", "out/{iteration:01200000000d}",
                     "out/{bogus}", "out/{", "out/{iteration:x}", "out/{iteration:>99999}", "out", "out/a/inner",
                     "", ".", "src", "src/inner", "out/" + "x" * 300]),
    TOML_TEXT.map(lambda text: f"out/{text}"),
)
PLAN_LAYOUTS = st.one_of(st.sampled_from(["tp=1", "tp=2,pp=1", "tp=0", "tp=abc", "pp=2", "tp=1,tp=2", "", "tp=1e400",
                                          "tp=" + "9" * 5000, "ep=3"]), TOML_TEXT)
PLAN_ITERATIONS = st.sampled_from(['"all"', "[100]", "[100, 100]", "[-1]", "[200]", '"abc"', "5", "[]",
                                   "[1e400]", "[" + "9" * 400 + "]"])
PLAN_FORMATS = st.sampled_from(['"megatron"', '"torch_dist"', '"hf"', '"same"', '"bogus"', "3", "true", "[]"])
PLAN_EXTRAS = st.sampled_from(["", 'dst_tp = 2', 'dst_tp = 0', 'dst_tp = "2"', "dst_tp = 1e400", "bogus = 1",
                               'dtype = "bf16"', 'max_shard_size = "inf"', "max_shard_size = -1",
                               'dst_pipeline_layout = "Et*1200000000|tL"', "overwrite = true", "workers = 0",
                               'hf_config = "../../etc/passwd"', 'src_format = "auto"'])


@st.composite
def plan_entry(draw: st.DrawFn) -> str:
    lines = ["[[convert]]", 'src = "src"', f"dst = {_toml_string(draw(PLAN_DSTS))}"]
    if draw(st.booleans()):
        lines.append(f"dst_layout = {_toml_string(draw(PLAN_LAYOUTS))}")
    if draw(st.booleans()):
        lines.append(f"iterations = {draw(PLAN_ITERATIONS)}")
    if draw(st.booleans()):
        lines.append(f"dst_format = {draw(PLAN_FORMATS)}")
    lines.append(draw(PLAN_EXTRAS))
    return "\n".join(lines)


def _toml_string(text: str) -> str:
    import json

    return json.dumps(text)


@budget(30)
@given(fmt=st.sampled_from(FORMATS), entries=st.lists(plan_entry(), min_size=1, max_size=2),
       raw=st.one_of(st.none(), st.none(), st.none(), st.text(max_size=30), st.just("[[convert]]\n" * 3)))
def test_fuzz_batch_plan(workspace: Workspace, monkeypatch: pytest.MonkeyPatch, fmt: str, entries: list[str],
                         raw: str | None) -> None:
    import pgconvert.run.batch
    from support.fuzz_harness import check_batch

    monkeypatch.setattr(pgconvert.run.batch, "ProcessPoolExecutor", _InlineProcessPool)
    src, _ = workspace(fmt)
    text = raw if raw is not None else "\n\n".join(entries) + "\n"
    try:
        check_batch(src, text)
    finally:
        workspace.done(src)


# ------------------------------------------------------------------------------------ in a subprocess

HEAVY_ARGS = st.sampled_from([("num_layers", 10**9), ("tensor_model_parallel_size", 10**9), ("hidden_size", 10**9),
                              ("padded_vocab_size", 10**12), ("num_attention_heads", 2**40),
                              ("pipeline_model_parallel_size", 10**9), ("num_experts", 10**9)])


@budget(3, long_share=50)  # seconds per example: an interpreter with torch each
@given(kind=st.sampled_from(["args", "bytes"]), heavy=HEAVY_ARGS, at=FRACTIONS,
       payload=st.binary(min_size=1, max_size=16), target=TARGETS)
def test_fuzz_memory_and_time_in_a_subprocess(workspace: Workspace, kind: str, heavy: tuple[str, int], at: float,
                                              payload: bytes, target: list[str]) -> None:
    """Peak RSS (the child's, from wait4) and wall time of ``python -m pgconvert`` itself."""
    src, dst = workspace("megatron")
    files = source_files(src, ("model_optim_rng.pt",))
    if kind == "args":
        for path in files:
            rewrite_pickle(path, set_arg(*heavy))
        description = f"args.{heavy[0]} = {heavy[1]} in every rank file"
    else:
        mutate_bytes(files[0], "overwrite", at, payload)
        description = f"overwrite {files[0].relative_to(src)} at {at:.4f} with {payload!r}"
    _run(workspace, Case("subprocess", description, src, dst, target), subprocess_run=True)
