"""Nothing an HF user relies on is lost in a round trip.

HF -> Megatron / torch_dist -> HF gives back the same config.json (architecture, RoPE scaling,
sliding window, token ids and every other key), generation_config.json, tokenizer files and chat
template, byte for byte, and the same logits in transformers. The sources are tiny releases written
by transformers' own save_pretrained (tests/support/hf_side_helpers.py).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.hf_side_helpers import RELEASES, input_ids, logits, save_release

import pgconvert
from pgconvert.cli import main
from pgconvert.errors import CheckpointError, ConfigError, StrictModeError
from pgconvert.run.inspection import inspect

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """The tiny HF checkpoint of a release in a dtype, written once per module."""
    root = tmp_path_factory.mktemp("releases")
    made: dict[tuple[str, str], Path] = {}

    def get(name: str, dtype: str = "fp32") -> Path:
        if (name, dtype) not in made:
            made[(name, dtype)] = save_release(name, root / f"{name}-{dtype}", DTYPES[dtype])
        return made[(name, dtype)]

    return get


def assert_same_hf_checkpoint(src: Path, out: Path, dtype: torch.dtype = torch.float32) -> None:
    """Same config.json, side files byte for byte, same class and logits.

    config.json is compared whole, as JSON: nothing is excluded, since the carried file is written
    back as it came (transformers' own key order and indentation are even kept byte for byte, but
    that is not what a user relies on). fp32 logits: rtol=atol=1e-5; bf16: equal (tolerance 0), as
    the weights are the same bits and transformers runs the same computation on them.
    """
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    for name in SIDE_FILES:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    ids = input_ids()
    expected, expected_class = logits(src, ids, dtype)
    actual, actual_class = logits(out, ids, dtype)
    assert actual_class == expected_class
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:
        assert actual.dtype == torch.bfloat16 and torch.equal(actual, expected)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("name", sorted(RELEASES))
def test_hf_to_megatron_tp2_pp2_and_back_keeps_everything(release: Callable[[str, str], Path], tmp_path: Path,
                                                          name: str, dtype: str) -> None:
    src = release(name, dtype)

    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2, dst_pp=2)
    back = pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)

    for file_name in ("config.json", *SIDE_FILES):
        assert (tmp_path / "megatron" / "hf" / file_name).read_bytes() == (src / file_name).read_bytes()
    assert not any("tokenizer" in notice or "built from the model" in notice for notice in back.notices)
    assert_same_hf_checkpoint(src, tmp_path / "hf", DTYPES[dtype])


def test_sliding_window_and_rope_scaling_change_the_logits(release: Callable[[str, str], Path],
                                                           tmp_path: Path) -> None:
    """The settings carried above matter at these sizes: without them the logits differ."""
    for name, key, plain in (("mistral", "sliding_window", None), ("llama3.1", "rope_parameters",
                                                                   {"rope_type": "default", "rope_theta": 500000.0})):
        copy = tmp_path / name
        shutil.copytree(release(name), copy)
        doc = json.loads((copy / "config.json").read_text())
        doc[key] = plain
        (copy / "config.json").write_text(json.dumps(doc))
        ids = input_ids()
        assert not torch.allclose(logits(copy, ids)[0], logits(release(name), ids)[0], rtol=1e-3, atol=1e-3), name


def test_hf_to_torch_dist_and_back_keeps_everything(release: Callable[[str, str], Path], tmp_path: Path) -> None:
    src = release("qwen2")

    pgconvert.convert(src, tmp_path / "dist", dst_format="torch_dist")
    pgconvert.convert(tmp_path / "dist", tmp_path / "hf", dst_format="hf")

    assert sorted(os.listdir(tmp_path / "dist" / "hf")) == sorted(["config.json", *SIDE_FILES])
    assert_same_hf_checkpoint(src, tmp_path / "hf")


def test_megatron_reshard_and_torch_dist_carry_the_hf_folder(release: Callable[[str, str], Path],
                                                             tmp_path: Path) -> None:
    src = release("mistral")
    pgconvert.convert(src, tmp_path / "tp2pp2", dst_format="megatron", dst_tp=2, dst_pp=2)

    pgconvert.convert(tmp_path / "tp2pp2", tmp_path / "tp1pp1", dst_tp=1, dst_pp=1)
    pgconvert.convert(tmp_path / "tp1pp1", tmp_path / "dist", dst_format="torch_dist")
    pgconvert.convert(tmp_path / "dist", tmp_path / "tp2", dst_format="megatron", dst_tp=2)
    pgconvert.convert(tmp_path / "tp2", tmp_path / "hf", dst_format="hf", dst_tp=1)

    for step in ("tp1pp1", "dist", "tp2"):
        for file_name in ("config.json", *SIDE_FILES):
            assert (tmp_path / step / "hf" / file_name).read_bytes() == (src / file_name).read_bytes(), step
    assert_same_hf_checkpoint(src, tmp_path / "hf")
    # SRC naming the iteration directory itself: hf/ is found beside it, in the checkpoint's root.
    pgconvert.convert(tmp_path / "dist" / "iter_0000000", tmp_path / "from_iteration", dst_format="hf")
    assert_same_hf_checkpoint(src, tmp_path / "from_iteration")


def test_options_supply_what_a_bare_megatron_checkpoint_lacks(release: Callable[[str, str], Path],
                                                              tmp_path: Path) -> None:
    src = release("mistral")
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    shutil.rmtree(tmp_path / "megatron" / "hf")
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(src / name, tokenizer / name)

    bare = pgconvert.convert(tmp_path / "megatron", tmp_path / "bare", dst_format="hf", dst_tp=1)
    given = pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1,
                              hf_config=src / "config.json", generation_config=src / "generation_config.json",
                              tokenizer=tokenizer)

    assert sorted(os.listdir(tmp_path / "bare")) == ["config.json", "model.safetensors", "pgconvert.json"]
    assert any("no tokenizer files and no generation_config.json written" in notice for notice in bare.notices)
    bare_config = json.loads((tmp_path / "bare" / "config.json").read_text())
    # built from args alone: the window (args.window_size) makes it Mistral, but the keys args do
    # not record (token ids, ...) are transformers' defaults, so it is not the source's config.json
    assert bare_config["architectures"] == ["MistralForCausalLM"]
    assert bare_config != json.loads((src / "config.json").read_text())
    assert not any("written: the megatron source carries none" in notice for notice in given.notices)
    assert_same_hf_checkpoint(src, tmp_path / "hf")


def test_tokenizer_option_replaces_the_carried_tokenizer_in_a_megatron_target(
        release: Callable[[str, str], Path], tmp_path: Path) -> None:
    src = release("qwen3")
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.model").write_bytes(b"\x00sentencepiece\xff")
    (tokenizer / "additional_chat_templates").mkdir()
    (tokenizer / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")

    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", tokenizer=tokenizer)

    assert sorted(str(path.relative_to(tmp_path / "megatron" / "hf")) for path in
                  (tmp_path / "megatron" / "hf").rglob("*") if path.is_file()) == [
        "additional_chat_templates/tool_use.jinja", "config.json", "generation_config.json", "tokenizer.model"]
    assert (tmp_path / "megatron" / "hf" / "tokenizer.model").read_bytes() == b"\x00sentencepiece\xff"


@pytest.mark.parametrize("option, make, message", [
    ("tokenizer", lambda d: d / "absent", "does not exist"),
    ("tokenizer", lambda d: d / "file.txt", "not a directory"),
    ("tokenizer", lambda d: d / "empty", "holds none of the tokenizer files"),
    ("generation_config", lambda d: d / "absent.json", "does not exist"),
    ("generation_config", lambda d: d / "broken.json", "not valid JSON"),
    ("generation_config", lambda d: d / "list.json", "expected a JSON object"),
    ("generation_config", lambda d: d / "bad_id.json", "eos_token_id=[1, 'x']: expected a token id"),
])
def test_bad_side_file_options_name_the_path(release: Callable[[str, str], Path], tmp_path: Path,
                                             option: str, make: Callable[[Path], Path], message: str) -> None:
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "bad_id.json").write_text('{"eos_token_id": [1, "x"]}')
    bad = make(tmp_path)

    with pytest.raises(ConfigError) as caught:
        pgconvert.convert(release("qwen3"), tmp_path / "out", dst_format="megatron", **{option: bad})

    assert str(bad) in str(caught.value) and message in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_cli_side_file_options(release: Callable[[str, str], Path], tmp_path: Path) -> None:
    src = release("qwen3")
    (tmp_path / "empty").mkdir()
    runner = CliRunner()

    missing = runner.invoke(main, [str(src), str(tmp_path / "a"), "--generation-config", str(tmp_path / "no.json")])
    empty = runner.invoke(main, [str(src), str(tmp_path / "b"), "--tokenizer", str(tmp_path / "empty")])
    good = runner.invoke(main, [str(src), str(tmp_path / "c"), "--dst-format", "megatron", "-q",
                                "--generation-config", str(src / "generation_config.json"), "--tokenizer", str(src)])
    shown = runner.invoke(main, ["inspect", str(tmp_path / "c")])

    assert missing.exit_code == 2 and "no.json" in missing.output and "does not exist" in missing.output
    assert empty.exit_code == 2 and f"--tokenizer {tmp_path / 'empty'}: holds none" in empty.output
    assert "Traceback" not in missing.output + empty.output
    assert good.exit_code == 0, good.output
    assert shown.exit_code == 0 and "hf/tokenizer.json" in shown.output and "hf/chat_template.jinja" in shown.output


def test_inspect_lists_carried_side_files(release: Callable[[str, str], Path], tmp_path: Path) -> None:
    pgconvert.convert(release("llama3.2"), tmp_path / "m", dst_format="megatron")

    assert inspect(tmp_path / "m").side_files == [
        "hf/config.json", "hf/generation_config.json", "hf/tokenizer.json", "hf/tokenizer_config.json",
        "hf/chat_template.jinja"]
    assert "tokenizer.json" in inspect(release("llama3.2")).side_files


def test_carried_config_that_disagrees_with_the_model_is_named_and_refused_under_strict(
        release: Callable[[str, str], Path], tmp_path: Path) -> None:
    src = release("mistral")
    pgconvert.convert(src, tmp_path / "m", dst_format="megatron")
    carried = tmp_path / "m" / "hf" / "config.json"
    doc = json.loads(carried.read_text())
    doc["rms_norm_eps"] = 1e-3
    carried.write_text(json.dumps(doc))

    with pytest.raises(StrictModeError, match="norm_epsilon: 0.001 in the file, 1e-06 in the model"):
        pgconvert.convert(tmp_path / "m", tmp_path / "strict", dst_format="hf", strict=True)
    report = pgconvert.convert(tmp_path / "m", tmp_path / "hf", dst_format="hf")

    assert any("disagrees with the model's settings: norm_epsilon" in notice for notice in report.notices)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written == {**doc, "rms_norm_eps": 1e-6}
    assert_same_hf_checkpoint(src, tmp_path / "hf")


@pytest.mark.parametrize("hostile", ["outside", "fifo", "directory"])
def test_hostile_hf_folder_is_refused(release: Callable[[str, str], Path], tmp_path: Path, hostile: str) -> None:
    pgconvert.convert(release("qwen3"), tmp_path / "m", dst_format="megatron")
    target = tmp_path / "m" / "hf" / "tokenizer.json"
    target.unlink()
    if hostile == "outside":
        (tmp_path / "secret").write_text("not yours")
        target.symlink_to(tmp_path / "secret")
    elif hostile == "fifo":
        os.mkfifo(target)
    else:
        target.mkdir()

    with pytest.raises(CheckpointError, match="tokenizer.json: ") as caught:
        pgconvert.convert(tmp_path / "m", tmp_path / "hf", dst_format="hf")

    assert str(target) in str(caught.value)
    assert ("resolves to" if hostile == "outside" else "not a regular file") in str(caught.value)
    assert not (tmp_path / "hf").exists()


def test_side_file_over_the_size_limit_is_refused(release: Callable[[str, str], Path], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import pgconvert.formats.hf_side
    import pgconvert.io.limits

    size = (release("qwen3") / "tokenizer.json").stat().st_size
    monkeypatch.setattr(pgconvert.formats.hf_side, "MAX_SIDE_FILE_BYTES", size - 1)
    monkeypatch.setattr(pgconvert.io.limits, "MAX_SIDE_FILE_BYTES", size - 1)

    with pytest.raises(CheckpointError, match=f"tokenizer.json: the side file's size in bytes is {size}, over "
                                              f"pgconvert's limit MAX_SIDE_FILE_BYTES={size - 1}"):
        pgconvert.convert(release("qwen3"), tmp_path / "m", dst_format="megatron")


def test_hf_config_option_for_a_megatron_target_must_describe_the_model(release: Callable[[str, str], Path],
                                                                        tmp_path: Path) -> None:
    src = release("qwen3")
    other = tmp_path / "config.json"
    other.write_text(json.dumps({**json.loads((src / "config.json").read_text()), "hidden_size": 128}))

    with pytest.raises(ConfigError, match="does not describe the source model: hidden_size: 128 in the file, 64"):
        pgconvert.convert(src, tmp_path / "m", dst_format="megatron", hf_config=other)

    assert not (tmp_path / "m").exists()


def test_worker_processes_write_the_hf_folder(release: Callable[[str, str], Path], tmp_path: Path) -> None:
    src = release("llama3.1")

    pgconvert.convert(src, tmp_path / "m", dst_format="megatron", dst_tp=2, workers=2)

    for file_name in ("config.json", *SIDE_FILES):
        assert (tmp_path / "m" / "hf" / file_name).read_bytes() == (src / file_name).read_bytes()
