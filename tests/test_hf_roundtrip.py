"""HF -> Megatron -> HF is bit-exact for every family, and the result loads in transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed
from click.testing import CliRunner
from support.hf_helpers import (
    ARCHITECTURE_AFTER_MEGATRON,
    FAMILY_MODELS,
    TOKENIZER_CONTENT,
    assert_same_hf_tensors,
    build_hf_model,
    hf_logits,
    input_ids,
    load_hf_tensors,
    save_hf_model,
)

import pgconvert
from pgconvert.cli import main

FAMILIES = sorted(FAMILY_MODELS)
# (tp, pp)
LAYOUTS = [(1, 1), (2, 1), (4, 2)]


@pytest.fixture(scope="module")
def hf_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_sources")
    return {name: save_hf_model(build_hf_model(name, seed=3), root / name) for name in FAMILIES}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"tp{layout[0]}pp{layout[1]}")
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_megatron_and_back_is_bit_exact(hf_sources: dict[str, Path], tmp_path: Path,
                                              family: str, layout: tuple[int, int]) -> None:
    tp, pp = layout
    src = hf_sources[family]

    to_megatron = pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=tp, dst_pp=pp)
    back = pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)

    assert (to_megatron.src_format, to_megatron.dst_format) == ("hf", "megatron")
    assert to_megatron.src_layout is None and to_megatron.dst_layout == f"tp={tp},pp={pp}"
    assert (back.src_format, back.dst_format) == ("megatron", "hf")
    assert_same_hf_tensors(src, tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["architectures"] == [ARCHITECTURE_AFTER_MEGATRON[family]]
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_checkpoint_gives_source_logits_in_transformers(hf_sources: dict[str, Path], tmp_path: Path,
                                                                  family: str) -> None:
    src = hf_sources[family]
    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=4, dst_pp=2)
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1)
    ids = input_ids(FAMILY_MODELS[family][2]["vocab_size"])

    expected = hf_logits(src, ids)
    actual = hf_logits(tmp_path / "hf", ids)

    assert actual.shape == (2, 12, FAMILY_MODELS[family][2]["vocab_size"])
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_hf_to_hf_keeps_config_json_and_copies_tokenizer_files(hf_sources: dict[str, Path], tmp_path: Path,
                                                               family: str) -> None:
    src = hf_sources[family]

    report = pgconvert.convert(src, tmp_path / "hf")

    assert report.dst_format == "hf"
    assert [item.relpath for item in report.files] == ["model.safetensors"]  # 5 GB default: one file
    assert not (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    for name, content in TOKENIZER_CONTENT.items():
        assert (tmp_path / "hf" / name).read_text() == content
    assert (tmp_path / "hf" / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    assert_same_hf_tensors(src, tmp_path / "hf")


def test_megatron_source_writes_no_tokenizer_files_and_says_so(hf_sources: dict[str, Path], tmp_path: Path) -> None:
    pgconvert.convert(hf_sources["llama"], tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    # A Megatron checkpoint that does not carry the HF side files of its model (not made from one).
    shutil.rmtree(tmp_path / "megatron" / "hf")

    report = pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1)

    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors", "pgconvert.json"]
    assert any("no tokenizer files" in notice for notice in report.notices)


def test_dtype_option_casts_tensors_and_config(hf_sources: dict[str, Path], tmp_path: Path) -> None:
    src = hf_sources["qwen2"]

    pgconvert.convert(src, tmp_path / "bf16", dtype="bf16")

    expected = load_hf_tensors(src)
    actual = load_hf_tensors(tmp_path / "bf16")
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == torch.bfloat16, name
        assert torch.equal(actual[name], tensor.to(torch.bfloat16)), name
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_cli_converts_hf_to_megatron_tp2_and_back(hf_sources: dict[str, Path], tmp_path: Path) -> None:
    src = hf_sources["qwen3"]
    runner = CliRunner()

    to_megatron = runner.invoke(main, ["--dst-format", "megatron", "--dst-tp", "2", str(src), str(tmp_path / "m")])
    back = runner.invoke(main, ["--dst-format", "hf", "--dst-tp", "1", "--dst-pp", "1", "-q",
                                str(tmp_path / "m"), str(tmp_path / "hf")])

    assert to_megatron.exit_code == 0, to_megatron.output
    assert "wrote" in to_megatron.output and "(megatron tp=2,pp=1): 2 files" in to_megatron.output
    assert back.exit_code == 0, back.output
    assert "(hf tp=1,pp=1)" in back.output
    assert_same_hf_tensors(src, tmp_path / "hf")
    assert not torch.distributed.is_initialized()


def test_cli_dry_run_lists_hf_shards_and_writes_nothing(hf_sources: dict[str, Path], tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["--dry-run", "--dst-format", "hf", str(hf_sources["llama"]),
                                       str(tmp_path / "out")])

    assert result.exit_code == 0, result.output
    assert "plan: hf  -> hf tp=1,pp=1" in result.output
    assert "model.safetensors" in result.output
    assert not (tmp_path / "out").exists()


def test_tied_checkpoint_that_also_stores_lm_head_is_accepted(hf_sources: dict[str, Path], tmp_path: Path) -> None:
    from support.hf_helpers import rewrite_as_single_file

    src = tmp_path / "src"
    shutil.copytree(hf_sources["qwen2"], src)
    rewrite_as_single_file(src, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))

    pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1)

    assert_same_hf_tensors(hf_sources["qwen2"], tmp_path / "hf")


def test_safetensors_shards_are_hashed_as_written_not_read_back(hf_sources: dict[str, Path], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import xxhash

    import pgconvert.run.manifest as manifest

    pgconvert.convert(hf_sources[FAMILIES[0]], tmp_path / "megatron", dst_format="megatron", dst_tp=2)
    real_hash_file = manifest.hash_file

    def no_shard_rereads(path: Path, relpath: str, algorithm: str) -> object:
        assert not relpath.endswith(".safetensors"), f"{relpath} was read back to be hashed"
        return real_hash_file(path, relpath, algorithm)

    monkeypatch.setattr(manifest, "hash_file", no_shard_rereads)
    pgconvert.convert(tmp_path / "megatron", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1,
                      max_shard_size=20_000)

    recorded = {item["path"]: item for item in json.loads((tmp_path / "hf" / "pgconvert.json").read_text())["files"]}
    shards = sorted(path for path in recorded if path.endswith(".safetensors"))
    assert len(shards) > 1
    for relpath in shards:
        data = (tmp_path / "hf" / relpath).read_bytes()
        assert recorded[relpath]["digest"] == "xxh3-128:" + xxhash.xxh3_128(data).hexdigest()
        assert recorded[relpath]["size"] == len(data)
    assert_same_hf_tensors(hf_sources[FAMILIES[0]], tmp_path / "hf")
