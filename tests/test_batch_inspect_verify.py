"""Scripted conversions: ``batch`` plans, ``inspect``, ``verify``, layouts as text and the Python API."""

from __future__ import annotations

import dataclasses
import json
import shutil
import typing
from collections.abc import Callable
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner
from support.tiny_models import GQA_SWIGLU, MHA_GELU_TIED
from support.megatron_fixtures import load_for_test, make_full_model, write_megatron_checkpoint

import pgconvert
from pgconvert.run.batch import CLI_ONLY_OPTIONS, PlanError, read_plan
from pgconvert.cli import LAYOUT, main
from pgconvert.run.convert import ConvertRequest
from pgconvert.errors import LayoutError, ValidationError
from pgconvert.run.manifest import MANIFEST_FILE
from pgconvert.formats.names import loader_names, saver_names

FULL_MODEL = make_full_model(GQA_SWIGLU, seed=11)
NEWER_MODEL = make_full_model(GQA_SWIGLU, seed=12)
TENSOR_COUNT = len(FULL_MODEL)
# Every format that can be both written and read, with the layout it takes from a sharded source.
FORMATS = sorted(set(saver_names()) & set(loader_names()))
TARGET_LAYOUTS: dict[str, str] = {"megatron": "tp=2,pp=2", "hf": "tp=1,pp=1"}
FLIPPED = "decoder.layers.1.mlp.linear_fc2.weight"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TP8 Megatron checkpoint with two iterations (10 and, the latest, 20) of different weights."""
    root = tmp_path_factory.mktemp("source") / "run"
    write_megatron_checkpoint(root, GQA_SWIGLU, FULL_MODEL, 8, 1, iteration=10)
    write_megatron_checkpoint(root, GQA_SWIGLU, NEWER_MODEL, 8, 1, iteration=20)
    return root


@pytest.fixture(scope="module")
def converted(source: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Iteration 10 of ``source`` written in every registered format."""
    root = tmp_path_factory.mktemp("converted")
    return {
        name: pgconvert.convert(source, root / name, dst_format=name, dst_layout=TARGET_LAYOUTS.get(name),
                                iteration=10).dst
        for name in FORMATS
    }


def _copy(path: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(path, tmp_path / path.name))


# ---------------------------------------------------------------- layouts as text and the Python API


@pytest.mark.parametrize("layout", [
    pgconvert.ParallelLayout(tp=2, pp=4, ep=8),
    pgconvert.ParallelLayout(tp=4, pp=3, first_stage_layers=1, last_stage_layers=1),
    pgconvert.ParallelLayout(tp=1, pp=2, vpp=2, expert_tp=2),
    pgconvert.ParallelLayout(pp=2, pipeline_layout="Et*3|(tt|)*2,L"),
], ids=["tp-pp-ep", "uneven", "vpp-expert-tp", "pipeline-layout-with-commas"])
def test_layout_text_parses_back_to_the_layout_it_describes(layout: pgconvert.ParallelLayout) -> None:
    spec = pgconvert.LayoutSpec.parse(layout.describe())

    assert pgconvert.ParallelLayout(**spec.given()) == layout  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "message"), [
    ("tp=two", r"layout 'tp=two': tp='two' must be an integer >= 1"),
    ("tp=0,pp=2", r"layout 'tp=0,pp=2': tp='0' must be an integer >= 1"),
    ("tp=2,xp=4", r"layout 'tp=2,xp=4': unknown key 'xp'"),
    ("tp=2,pp", r"layout 'tp=2,pp': 'pp' is not key=value"),
    ("tp=2,tp=4", r"layout 'tp=2,tp=4': 'tp' given twice"),
    ("layout=Et|tL,pp=2", r"layout 'layout=Et\|tL,pp=2': layout=… must come last"),
], ids=["not-a-number", "zero", "unknown-key", "no-value", "repeated", "layout-not-last"])
def test_layout_param_type_fails_quoting_the_bad_value(text: str, message: str) -> None:
    @click.command()
    @click.option("--dst-layout", type=LAYOUT)
    def command(dst_layout: pgconvert.LayoutSpec) -> None:
        click.echo(dst_layout.describe())

    good = CliRunner().invoke(command, ["--dst-layout", "tp=2,pp=4,ep=8"])
    bad = CliRunner().invoke(command, ["--dst-layout", text])

    assert good.exit_code == 0 and good.output == "tp=2,pp=4,ep=8\n"
    assert bad.exit_code == 2
    assert "Invalid value for '--dst-layout'" in bad.output
    with pytest.raises(LayoutError, match=message):
        pgconvert.LayoutSpec.parse(text)


def test_a_layout_spec_is_validated_on_construction() -> None:
    with pytest.raises(LayoutError, match=r"tp=0: must be an integer >= 1"):
        pgconvert.LayoutSpec(tp=0)
    with pytest.raises(LayoutError, match=r"first_stage_layers=-1: must be an integer >= 0"):
        pgconvert.LayoutSpec(first_stage_layers=-1)
    assert pgconvert.LayoutSpec(pp=4, first_stage_layers=0).describe() == "pp=4,first=0"


@pytest.mark.parametrize("dst_layout", [pgconvert.ParallelLayout(tp=2, pp=2), "tp=2,pp=2",
                                        pgconvert.LayoutSpec(tp=2, pp=2)], ids=["ParallelLayout", "text", "LayoutSpec"])
def test_convert_takes_the_layout_as_an_object_or_text(source: Path, tmp_path: Path,
                                                       dst_layout: object) -> None:
    by_fields = pgconvert.convert(source, tmp_path / "fields", dst_tp=2, dst_pp=2)
    by_layout = pgconvert.convert(source, tmp_path / "layout", dst_layout=dst_layout)

    assert by_layout.dst_layout == by_fields.dst_layout == "tp=2,pp=2"
    assert pgconvert.verify(tmp_path / "fields", tmp_path / "layout").equal


def test_convert_refuses_a_layout_field_given_twice(source: Path, tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"dst_layout 'tp=2': dst_tp also given as keyword arguments"):
        pgconvert.convert(source, tmp_path / "dst", dst_layout="tp=2", dst_tp=4)
    with pytest.raises(ValidationError, match=r"unknown options \['dst_tensor_parallel'\]"):
        pgconvert.convert(source, tmp_path / "dst", dst_tensor_parallel=2)


@pytest.mark.parametrize("command", sorted(main.commands))
def test_help_of_every_command_exits_zero(command: str) -> None:
    result = CliRunner().invoke(main, [command, "--help"])

    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_main_help_lists_inspect_verify_and_batch() -> None:
    result = CliRunner().invoke(main, ["--help"])

    assert all(f"  {name} " in result.output for name in ("batch", "convert", "example", "inspect", "verify"))


# ---------------------------------------------------------------- inspect


def test_inspect_json_of_a_megatron_source_lists_layout_iterations_and_tensors(source: Path) -> None:
    result = CliRunner().invoke(main, ["inspect", "--json", str(source)])

    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["format"] == "megatron"
    assert info["iterations"] == [10, 20]
    assert info["iteration"] == 20  # the tracker file's
    assert info["layout"]["tp"] == 8 and info["layout_text"] == "tp=8,pp=1"
    assert info["tensor_count"] == TENSOR_COUNT
    assert info["total_bytes"] == sum(t.numel() * t.element_size() for t in FULL_MODEL.values()) + 24 * 64 * 4 * 2
    assert info["dtypes"] == {"float32": TENSOR_COUNT}
    assert info["model_config"]["num_query_groups"] == 8
    assert (info["vocab_rows"], info["true_vocab_size"]) == (1024, 1000)
    assert [p["kind"] for p in info["problems"]] == ["padded-vocab"]
    assert info["ok"] is True


def test_inspect_of_a_megatron_source_compares_with_the_family_an_hf_target_is_written_as(
        source: Path, converted: dict[str, Path]) -> None:
    result = CliRunner().invoke(main, ["inspect", str(source)])
    info = pgconvert.inspect(source)

    assert result.exit_code == 0, result.output
    assert info.family_defaults is not None
    written = json.loads((converted["hf"] / "config.json").read_text())["architectures"]
    assert [info.family_defaults.family] == written == ["LlamaForCausalLM"]
    assert "family      LlamaForCausalLM (inferred: the family an hf target is written as)\n" in result.output
    assert ("model       num_layers=4 hidden_size=64 num_attention_heads=16 num_query_groups=8 ffn_hidden_size=128\n"
            "            vocab_size=1000 params_dtype=float32\n") in result.output
    # Megatron-LM's dropout defaults and the fixture's epsilon and positions, against Llama's.
    assert info.family_defaults.differing == {"norm_epsilon": 1e-6, "max_position_embeddings": 2048,
                                              "attention_dropout": 0.0, "hidden_dropout": 0.0}
    assert ("settings    norm_epsilon=1e-05 (family default: 1e-06)\n"
            "            max_position_embeddings=32 (family default: 2048)\n"
            "            attention_dropout=0.1 (family default: 0.0)\n"
            "            hidden_dropout=0.1 (family default: 0.0)\n"
            f"            {info.family_defaults.at_defaults} other settings at LlamaForCausalLM's defaults "
            "(--all lists every setting)\n") in result.output
    assert "yarn" not in result.output and "kv_lora_rank" not in result.output


def test_inspect_of_a_megatron_model_of_no_family_compares_with_modelconfigs_defaults(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", MHA_GELU_TIED, make_full_model(MHA_GELU_TIED, seed=3), 2, 1)

    result = CliRunner().invoke(main, ["inspect", str(src)])

    assert result.exit_code == 0, result.output
    assert "family      none (fits no supported family: compared with ModelConfig's defaults)\n" in result.output
    assert "settings    gated_linear_unit=False (default: True)\n" in result.output
    assert "            normalization='LayerNorm' (default: 'RMSNorm')\n" in result.output
    assert "other settings at ModelConfig's defaults (--all lists every setting)\n" in result.output


def test_inspect_iteration_option_opens_that_iteration(source: Path) -> None:
    result = CliRunner().invoke(main, ["inspect", "--iteration", "10", str(source)])

    assert result.exit_code == 0, result.output
    assert "iterations  10, 20 (opened: 10)" in result.output
    assert "layout      tp=8,pp=1" in result.output


@pytest.mark.parametrize("name", FORMATS)
def test_inspect_every_format(source: Path, converted: dict[str, Path], name: str) -> None:
    result = CliRunner().invoke(main, ["inspect", "--json", str(converted[name])])

    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["format"] == name
    assert info["tensor_count"] == TENSOR_COUNT
    assert info["true_vocab_size"] == 1000
    assert info["manifest"]["source_path"] == str(source.resolve())
    assert info["manifest"]["source_iteration"] == 10
    if info["layout"] is not None:
        spec = pgconvert.LayoutSpec.parse(TARGET_LAYOUTS.get(name, "tp=8,pp=1"))
        assert {key: info["layout"][key] for key in spec.given()} == spec.given()


def test_inspect_of_a_checkpoint_with_a_missing_rank_file_exits_nonzero_naming_it(
        converted: dict[str, Path], tmp_path: Path) -> None:
    broken = _copy(converted["megatron"], tmp_path)
    (broken / "iter_0000010" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()

    result = CliRunner().invoke(main, ["inspect", str(broken)])
    as_json = CliRunner().invoke(main, ["inspect", "--json", str(broken)])

    assert result.exit_code == 1
    assert "error: " in result.output
    assert "mp_rank_01_001/model_optim_rng.pt: missing rank file" in result.output
    # The manifest says so too, without opening anything.
    assert "iter_0000010/mp_rank_01_001/model_optim_rng.pt: listed in pgconvert.json but missing" in result.output
    assert as_json.exit_code == 1
    assert json.loads(as_json.stdout)["ok"] is False


def test_inspect_of_a_checkpoint_missing_a_whole_rank_directory_names_the_rank(
        source: Path, tmp_path: Path) -> None:
    broken = _copy(source, tmp_path)
    shutil.rmtree(broken / "iter_0000020" / "mp_rank_05")

    info = pgconvert.inspect(broken)

    assert not info.ok
    assert info.format == "megatron" and info.iterations == [10, 20]
    assert [p.kind for p in info.problems] == ["unreadable"]
    assert "missing rank files for tp=8,pp=1 (from args): mp_rank_05/model_optim_rng.pt" in info.problems[0].message


def test_inspect_reports_an_unknown_true_vocab_as_a_warning(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, FULL_MODEL, 2, 1)
    for path in src.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = load_for_test(path)
        del state["args"].vocab_size
        torch.save(state, path)

    result = CliRunner().invoke(main, ["inspect", str(src)])

    assert result.exit_code == 0, result.output
    assert "warning: the true vocab size is unknown: the vocab tables have 1024 rows" in result.output


def test_inspect_of_a_directory_that_is_no_checkpoint_exits_nonzero(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["inspect", str(tmp_path)])

    assert result.exit_code == 1
    assert "format      unknown" in result.output
    assert "not a checkpoint of any known format" in result.output


# ---------------------------------------------------------------- verify


@pytest.mark.parametrize("name", FORMATS)
def test_verify_of_a_conversion_in_every_format_against_its_source_is_equal(
        source: Path, converted: dict[str, Path], name: str) -> None:
    result = CliRunner().invoke(main, ["verify", "--json", str(converted[name]), str(source)])

    report = json.loads(result.stdout)
    assert result.exit_code == 1  # the source's latest iteration is 20, not the converted 10
    assert {d["kind"] for d in report["differences"]} == {"values"}

    equal = pgconvert.verify(converted[name], source, iteration_b=10)
    assert equal.equal, equal.differences[:3]
    assert equal.compared == TENSOR_COUNT
    assert any("checked" in note and MANIFEST_FILE in note for note in equal.notes)


def test_verify_of_tp8_and_tp2_conversions_of_the_same_model_is_equal(source: Path, tmp_path: Path) -> None:
    pgconvert.convert(source, tmp_path / "tp8", dst_layout="tp=8")
    pgconvert.convert(source, tmp_path / "tp2", dst_layout="tp=2")

    result = CliRunner().invoke(main, ["verify", str(tmp_path / "tp8"), str(tmp_path / "tp2")])

    assert result.exit_code == 0, result.output
    assert f"{TENSOR_COUNT} tensors compared (bit-exact): equal" in result.output


# (format, how to flip one element of one stored file of that format)
def _flip_megatron(root: Path) -> None:
    rank_file = root / "iter_0000010" / "mp_rank_01_000" / "model_optim_rng.pt"
    state = load_for_test(rank_file)
    state["model"][FLIPPED][3, 5] += 1.0
    torch.save(state, rank_file)


def _flip_hf(root: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = root / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] += 1.0
    save_file(tensors, path, metadata={"format": "pt"})


def _flip_torch_dist(root: Path) -> None:
    """Rewrite the checkpoint from a copy with one element changed, keeping the old manifest.

    The .distcp data is torch.distributed.checkpoint's own encoding; going through a per-rank copy
    changes exactly one stored value without a home-made .distcp writer.
    """
    manifest = (root / "pgconvert.json").read_bytes()
    per_rank = root.parent / f"{root.name}-as-megatron"
    pgconvert.convert(root, per_rank, src_format="torch_dist", dst_format="megatron", dst_layout="tp=1,pp=1")
    rank_file = per_rank / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    state = load_for_test(rank_file)
    state["model"][FLIPPED][3, 5] += 1.0
    torch.save(state, rank_file)
    pgconvert.convert(per_rank, root, dst_format="torch_dist", overwrite=True)
    (root / "pgconvert.json").write_bytes(manifest)


FLIPPERS: dict[str, Callable[[Path], None]] = {
    "megatron": _flip_megatron, "hf": _flip_hf, "torch_dist": _flip_torch_dist,
}


@pytest.mark.parametrize("name", FORMATS)
def test_verify_catches_a_single_flipped_element_and_names_the_tensor(
        source: Path, converted: dict[str, Path], tmp_path: Path, name: str) -> None:
    if name not in FLIPPERS:
        pytest.skip(f"no way to flip an element of a {name} checkpoint in this test yet")
    flipped = _copy(converted[name], tmp_path)
    FLIPPERS[name](flipped)

    result = CliRunner().invoke(main, ["verify", str(source), str(flipped), "--iteration-a", "10"])
    report = pgconvert.verify(source, flipped, iteration_a=10)

    assert result.exit_code == 1
    assert f"differs: {FLIPPED}: 1 of {FULL_MODEL[FLIPPED].numel()} elements differ" in result.output
    assert [(d.name, d.kind, d.differing) for d in report.differences] == [(FLIPPED, "values", 1)]
    assert report.differences[0].max_abs_diff == pytest.approx(1.0, rel=1e-3)
    # The converted output's manifest names the file that changed.
    assert report.file_problems and all("B (" in problem for problem in report.file_problems)
    # Re-writing a torch_dist checkpoint also rewrites its .metadata and common.pt.
    assert name == "torch_dist" or len(report.file_problems) == 1
    assert any(".distcp" in p or ".pt" in p or ".safetensors" in p for p in report.file_problems)


def test_verify_tolerances_accept_a_small_change_and_dtypes_must_match(
        source: Path, converted: dict[str, Path], tmp_path: Path) -> None:
    nudged = _copy(converted["megatron"], tmp_path)
    rank_file = nudged / "iter_0000010" / "mp_rank_01_000" / "model_optim_rng.pt"
    state = load_for_test(rank_file)
    state["model"][FLIPPED][3, 5] += 1e-4
    torch.save(state, rank_file)
    (nudged / MANIFEST_FILE).unlink()
    pgconvert.convert(source, tmp_path / "bf16", dtype="bf16", iteration=10)

    exact = pgconvert.verify(source, nudged, iteration_a=10)
    tolerant = CliRunner().invoke(main, ["verify", "--atol", "1e-3", "--iteration-a", "10", str(source), str(nudged)])
    cast = pgconvert.verify(source, tmp_path / "bf16", iteration_a=10)

    assert [d.name for d in exact.differences] == [FLIPPED]
    assert tolerant.exit_code == 0, tolerant.output
    assert "(rtol=0.0, atol=0.001): equal" in tolerant.output
    assert {d.kind for d in cast.differences} == {"dtype"}
    assert len(cast.differences) == TENSOR_COUNT


def test_verify_reports_padding_rows_apart_and_compares_only_the_true_vocab(source: Path, tmp_path: Path) -> None:
    a = pgconvert.convert(source, tmp_path / "a", iteration=10).dst
    b = _copy(a, tmp_path / "b_parent")
    rank_file = b / "iter_0000010" / "mp_rank_07" / "model_optim_rng.pt"
    state = load_for_test(rank_file)
    state["model"]["embedding.word_embeddings.weight"][-1] += 1.0  # row 1023: padding
    torch.save(state, rank_file)
    (b / MANIFEST_FILE).unlink()

    report = pgconvert.verify(a, b)
    result = CliRunner().invoke(main, ["verify", str(a), str(b)])

    assert report.equal and report.differences == []
    assert [(d.name, d.differing) for d in report.padding_differences] == [("embedding.word_embeddings.weight", 64)]
    assert result.exit_code == 0
    assert "padding only (not a failure): embedding.word_embeddings.weight" in result.output


def test_verify_json_lists_every_difference(source: Path, converted: dict[str, Path]) -> None:
    result = CliRunner().invoke(main, ["verify", "--json", str(source), str(converted["megatron"])])

    report = json.loads(result.stdout)
    assert result.exit_code == 1
    assert report["equal"] is False
    assert len(report["differences"]) == TENSOR_COUNT  # iteration 20 against 10: every tensor differs
    assert all(d["differing"] > 0 and d["max_abs_diff"] > 0 for d in report["differences"])


# ---------------------------------------------------------------- batch


def _mtimes(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_mtime_ns for p in sorted(root.rglob("*")) if p.is_file()}


def _plan(tmp_path: Path, source: Path) -> Path:
    hf_entry = """
[[convert]]
name = "hf"
src = "{src}"
dst = "out/hf"
iteration = 10
dst-format = "hf"
dst_layout = "tp=1,pp=1"
""" if "hf" in saver_names() else """
[[convert]]
name = "uneven"
src = "{src}"
dst = "out/uneven"
iteration = 10
dst-pp = 4
dst-decoder-first-pipeline-num-layers = 1
dst-decoder-last-pipeline-num-layers = 1
dst-tp = 1
"""
    plan = tmp_path / "plan.toml"
    plan.write_text(f"""
[defaults]
dtype = "keep"
src-format = "auto"

[[convert]]
name = "tp2"
src = "{{src}}"
dst = "out/tp2"
dst-tp = 2

[[convert]]
name = "every-iteration"
src = "{{src}}"
dst = "out/tp1pp2/iter_{{iteration}}"
iterations = "all"
dst_layout = "tp=1,pp=2"

[[convert]]
name = "impossible"
src = "{{src}}"
dst = "out/tp3"
dst_tp = 3
{hf_entry}""".replace("{src}", str(source)))
    return plan


def test_batch_runs_good_entries_reports_the_bad_one_skips_complete_ones_and_force_reruns(
        source: Path, tmp_path: Path) -> None:
    plan = _plan(tmp_path, source)
    out = tmp_path / "out"
    good = ["tp2", "every-iteration@10", "every-iteration@20", "hf" if "hf" in saver_names() else "uneven"]

    first = CliRunner().invoke(main, ["batch", "--jobs", "2", "--json", str(plan)])

    assert first.exit_code == 1, first.output
    summary = json.loads(first.stdout)
    statuses = {e["label"]: e["status"] for e in summary["entries"]}
    assert statuses == {**dict.fromkeys(good, "ok"), "impossible": "failed"}
    errors = {e["label"]: e["error"] for e in summary["entries"]}
    assert "num_attention_heads=16 is not divisible by 3" in errors["impossible"]
    assert not (out / "tp3").exists()
    assert summary["counts"] == {"ok": 4, "failed": 1, "skipped": 0}
    # iterations = "all" wrote one output per saved iteration, each from its own iteration.
    assert sorted(p.name for p in (out / "tp1pp2").iterdir()) == ["iter_10", "iter_20"]
    assert pgconvert.verify(out / "tp1pp2" / "iter_10", source, iteration_b=10).equal
    assert pgconvert.verify(out / "tp1pp2" / "iter_20", source, iteration_b=20).equal
    assert pgconvert.inspect(out / "tp2").layout_text == "tp=2,pp=1"
    outputs = [out / "tp2", out / "tp1pp2" / "iter_10", out / "tp1pp2" / "iter_20", out / good[3]]
    assert all((path / MANIFEST_FILE).is_file() for path in outputs)
    before = {path: _mtimes(path) for path in outputs}

    rerun = CliRunner().invoke(main, ["batch", "--jobs", "2", str(plan)])

    assert rerun.exit_code == 1, rerun.output
    rows = {line.split()[0]: line.split()[3] for line in rerun.stdout.splitlines()[1:-1]}
    assert rows == {**dict.fromkeys(good, "skipped"), "impossible": "failed"}
    assert rerun.stdout.splitlines()[-1] == "0 ok, 1 failed, 4 skipped"
    assert {path: _mtimes(path) for path in outputs} == before

    forced = CliRunner().invoke(main, ["batch", "--force", "--json", str(plan)])

    assert forced.exit_code == 1
    assert {e["label"]: e["status"] for e in json.loads(forced.stdout)["entries"]} == statuses
    for path in outputs:
        assert _mtimes(path).keys() == before[path].keys()
        assert all(_mtimes(path)[name] != mtime for name, mtime in before[path].items())


def test_batch_reconverts_an_output_that_no_longer_matches_its_manifest(source: Path, tmp_path: Path) -> None:
    dst = tmp_path / "out"
    plan = tmp_path / "plan.toml"
    plan.write_text(f'[[convert]]\nsrc = "{source}"\ndst = "out"\niteration = 10\ndst_tp = 4\noverwrite = true\n')
    pgconvert.run_batch(plan)
    rank_file = dst / "iter_0000010" / "mp_rank_03" / "model_optim_rng.pt"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    rank_file.write_bytes(bytes(data))

    sizes_only = pgconvert.run_batch(plan)
    hashed = pgconvert.run_batch(plan, verify_hashes=True)
    other_layout = pgconvert.run_plan([dataclasses.replace(item, options={**item.options, "dst_tp": 2})
                                       for item in read_plan(plan)])

    assert [r.status for r in sizes_only.results] == ["skipped"]  # a same-size change needs the hashes
    assert [r.status for r in hashed.results] == ["ok"]
    assert pgconvert.verify(dst, source, iteration_b=10).equal
    assert [r.status for r in other_layout.results] == ["ok"]
    assert pgconvert.inspect(dst).layout_text == "tp=2,pp=1"


def test_batch_without_overwrite_explains_why_an_existing_output_was_not_skipped(
        source: Path, tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(f'[[convert]]\nsrc = "{source}"\ndst = "out"\ndst_tp = 4\n')
    pgconvert.run_batch(plan)
    plan.write_text(f'[[convert]]\nsrc = "{source}"\ndst = "out"\ndst_tp = 2\n')

    report = pgconvert.run_batch(plan)

    assert [r.status for r in report.results] == ["failed"]
    assert "exists and is not empty" in (report.results[0].error or "")
    assert "not skipped: target layout tp=4,pp=1, not tp=2,pp=1" in (report.results[0].error or "")


def test_plan_accepts_every_convert_option_that_sets_a_request_field_by_its_cli_name(tmp_path: Path) -> None:
    hints = typing.get_type_hints(ConvertRequest)
    samples = {int: 1, str: "keep", bool: True, Path: "config.json"}
    renamed = {"dst_decoder_first_pipeline_num_layers": "dst_first_stage_layers",
               "dst_decoder_last_pipeline_num_layers": "dst_last_stage_layers"}
    options = [param for param in main.commands["convert"].params
               if isinstance(param, click.Option) and renamed.get(param.name or "", param.name) in hints]
    assert {"dst_tp", "dst_decoder_first_pipeline_num_layers", "dtype", "iteration"} <= {p.name for p in options}
    for param in options:
        flag = max(param.opts, key=len).removeprefix("--")
        field = renamed.get(param.name or "", param.name or "")
        kind = next(k for k in typing.get_args(hints[field]) or (hints[field],) if k is not type(None))
        plan = tmp_path / f"{flag}.toml"
        plan.write_text(f'[[convert]]\nsrc = "a"\ndst = "b"\n"{flag}" = {json.dumps(samples[kind])}\n')

        (item,) = read_plan(plan)

        assert field in item.options, flag


@pytest.mark.parametrize("flag", [f"{name.replace('_', '-')}" for name in CLI_ONLY_OPTIONS])
def test_plan_refuses_options_that_steer_the_command_rather_than_the_conversion(tmp_path: Path, flag: str) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(f'[[convert]]\nsrc = "a"\ndst = "b"\n{flag} = true\n')

    with pytest.raises(PlanError, match=f"'{flag}' is an option of the convert command, not of a conversion"):
        read_plan(plan)


@pytest.mark.parametrize(("body", "message"), [
    ('[[convert]]\nsrc = "a"\ndst = "b"\ndst_tensor_parallel = 2\n', r"#1: unknown key 'dst_tensor_parallel'"),
    ('[[convert]]\nsrc = "a"\ndst = "b"\ndst-tp = "2"\n', r"#1: dst-tp = '2' must be int"),
    ('[[convert]]\nsrc = "a"\ndst = "b"\ndry-run = true\n', r"'dry-run' is an option of the convert command"),
    ('[[convert]]\nsrc = "a"\ndst = "b_{iteration}"\n', r"dst has an \{iteration\} placeholder but no iteration"),
    ('[[convert]]\nsrc = "a"\ndst = "b"\niterations = "all"\n', r"several iterations need an \{iteration\}"),
    ('[[convert]]\nsrc = "a"\ndst = "b"\ndst_layout = "tp=x"\n', r"#1: layout 'tp=x': tp='x' must be an integer"),
    ('[[convert]]\ndst = "b"\n', r"#1: src is missing"),
    ('[defaults]\nsrc = "a"\n[[convert]]\nsrc = "a"\ndst = "b"\n', r"\[defaults\]: src belongs in each"),
    ('[[convert]]\nsrc = "a"\ndst = "b"\n[[convert]]\nsrc = "c"\ndst = "b"\n', r"entries 1 and 2 both write \S*/b$"),
    ('[[convert]]\nsrc = "a"\ndst = "b"\n[[convert]]\nsrc = "b"\ndst = "c"\n', r"entry 2 reads \S*/b, which overlaps"),
    ('convert = 3\n', r"no \[\[convert\]\] entries"),
    ('[[convert]\n', r"not a valid TOML plan"),
], ids=["unknown-key", "wrong-type", "cli-only", "placeholder", "all-without-placeholder", "bad-layout",
        "no-src", "src-in-defaults", "same-dst", "chained", "no-entries", "bad-toml"])
def test_a_malformed_plan_is_refused_before_anything_runs(tmp_path: Path, body: str, message: str) -> None:
    (tmp_path / "a").mkdir()
    plan = tmp_path / "plan.toml"
    plan.write_text(body)

    result = CliRunner().invoke(main, ["batch", str(plan)])

    assert result.exit_code == 2, result.output
    with pytest.raises(PlanError, match=message):
        pgconvert.run_batch(plan)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "plan.toml"]


def test_the_usage_docs_plan_example_is_a_valid_plan(tmp_path: Path) -> None:
    usage = (Path(__file__).parent.parent / "docs" / "usage.md").read_text()
    plan = tmp_path / "plan.toml"
    plan.write_text(usage.split("```toml\n", 1)[1].split("```", 1)[0])

    items = read_plan(plan)

    assert [item.label for item in items] == ["tp2", "every-iteration", "hf"]
    assert items[1].iterations == "all" and items[1].options["dst_first_stage_layers"] == 6
    assert all(item.options["dtype"] == "bf16" for item in items)
    assert items[0].src == str(tmp_path / "runs" / "llama")


def test_iterations_all_over_a_source_without_iterations_fails_that_entry_only(
        converted: dict[str, Path], source: Path, tmp_path: Path) -> None:
    if "hf" not in FORMATS:
        pytest.skip("needs a format without iterations")
    plan = tmp_path / "plan.toml"
    plan.write_text(f'[[convert]]\nsrc = "{converted["hf"]}"\ndst = "x/{{iteration}}"\niterations = "all"\n'
                    f'[[convert]]\nsrc = "{source}"\ndst = "y"\niteration = 10\n')

    report = pgconvert.run_batch(plan)

    assert [(r.label, r.status) for r in report.results] == [("1", "failed"), ("2", "ok")]
    assert "has no numbered iterations" in (report.results[0].error or "")
