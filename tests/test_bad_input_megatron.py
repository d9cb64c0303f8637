"""Bad Megatron input: each case fails early with a message naming the file, value and constraint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from support.tiny_models import GQA_SWIGLU, MHA_GELU_TIED
from support.megatron_fixtures import load_for_test, make_full_model, write_megatron_checkpoint

from pgconvert.cli import main


def run_cli(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(arg) for arg in args])


def rank_file(root: Path, name: str, iteration: int = 100) -> Path:
    return root / f"iter_{iteration:07d}" / name / "model_optim_rng.pt"


@pytest.fixture
def tp2_checkpoint(tmp_path: Path) -> Path:
    return write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)


def assert_no_output(dst: Path) -> None:
    assert not dst.exists(), f"{dst} was left behind"
    leftovers = [p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.pgconvert")]
    assert leftovers == []


def test_missing_src_is_a_usage_error(tmp_path: Path) -> None:
    result = run_cli(tmp_path / "nope", tmp_path / "dst")

    assert result.exit_code == 2
    assert "nope" in result.output and "does not exist" in result.output
    assert_no_output(tmp_path / "dst")


def test_src_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "notes.txt").write_text("hello")

    result = run_cli(tmp_path / "src", tmp_path / "dst")

    assert result.exit_code == 2
    assert f"{tmp_path / 'src'}: not a checkpoint of any known format" in result.output
    assert_no_output(tmp_path / "dst")


def test_missing_rank_file_is_named(tp2_checkpoint: Path, tmp_path: Path) -> None:
    rank_file(tp2_checkpoint, "mp_rank_01").unlink()

    result = run_cli(tp2_checkpoint, tmp_path / "dst", "--dst-tp", "1")

    assert result.exit_code == 1
    assert "mp_rank_01/model_optim_rng.pt" in result.output and "missing rank file" in result.output
    assert_no_output(tmp_path / "dst")


def test_missing_rank_directory_is_named_with_the_layout(tp2_checkpoint: Path, tmp_path: Path) -> None:
    rank_file(tp2_checkpoint, "mp_rank_01").unlink()
    rank_file(tp2_checkpoint, "mp_rank_01").parent.rmdir()

    result = run_cli(tp2_checkpoint, tmp_path / "dst", "--dst-tp", "1")

    assert result.exit_code == 1
    assert "missing rank files for tp=2,pp=1 (from args): mp_rank_01/model_optim_rng.pt" in result.output
    assert_no_output(tmp_path / "dst")


def test_extra_rank_directory_is_refused(tp2_checkpoint: Path, tmp_path: Path) -> None:
    extra = rank_file(tp2_checkpoint, "mp_rank_02")
    extra.parent.mkdir()
    extra.write_bytes(rank_file(tp2_checkpoint, "mp_rank_01").read_bytes())

    result = run_cli(tp2_checkpoint, tmp_path / "dst", "--dst-tp", "1")

    assert result.exit_code == 1
    assert "unexpected rank directories for tp=2,pp=1 (from args): mp_rank_02" in result.output


def test_ranks_whose_shapes_disagree_are_refused(tp2_checkpoint: Path, tmp_path: Path) -> None:
    path = rank_file(tp2_checkpoint, "mp_rank_01")
    state = load_for_test(path)
    key = "decoder.layers.1.mlp.linear_fc2.weight"
    state["model"][key] = state["model"][key][:, :-1].clone()
    torch.save(state, path)

    result = run_cli(tp2_checkpoint, tmp_path / "dst", "--dst-tp", "1")

    assert result.exit_code == 1
    assert f"{path}: {key} has shape [64, 63], expected [64, 64]" in result.output
    assert_no_output(tmp_path / "dst")


def test_diverged_replicas_name_the_tensor_and_both_files(tp2_checkpoint: Path, tmp_path: Path) -> None:
    path = rank_file(tp2_checkpoint, "mp_rank_01")
    state = load_for_test(path)
    state["model"]["decoder.layers.2.input_layernorm.weight"][3] += 1.0
    torch.save(state, path)

    result = run_cli(tp2_checkpoint, tmp_path / "dst", "--dst-tp", "1")

    assert result.exit_code == 1
    assert "decoder.layers.2.input_layernorm.weight: replicated tensor differs between ranks" in result.output
    assert "mp_rank_00" in result.output and "mp_rank_01" in result.output
    assert_no_output(tmp_path / "dst")


def test_tied_output_copy_that_differs_from_the_embedding_is_refused(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", MHA_GELU_TIED, make_full_model(MHA_GELU_TIED), 1, 2)
    path = rank_file(src, "mp_rank_00_001")
    state = load_for_test(path)
    state["model"]["output_layer.weight"][0, 0] += 1.0
    torch.save(state, path)

    result = run_cli(src, tmp_path / "dst", "--dst-pp", "1")

    assert result.exit_code == 1
    assert "embedding.word_embeddings.weight: the copies in" in result.output and "differ" in result.output


def test_truncated_pt_file_is_named(tp2_checkpoint: Path, tmp_path: Path) -> None:
    path = rank_file(tp2_checkpoint, "mp_rank_01")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])

    result = run_cli(tp2_checkpoint, tmp_path / "dst", "--dst-tp", "1")

    assert result.exit_code == 1
    assert f"{path}: truncated or corrupt torch checkpoint" in result.output
    assert "Traceback" not in result.output
    assert_no_output(tmp_path / "dst")


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_pickle_with_a_global_outside_the_allowlist_is_not_executed(tp2_checkpoint: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = rank_file(tp2_checkpoint, "mp_rank_00")
    state = load_for_test(path)
    state["payload"] = _Exploit(marker)
    torch.save(state, path)

    result = run_cli(tp2_checkpoint, tmp_path / "dst", "--dst-tp", "1")

    assert result.exit_code == 1
    assert f"{path}: refuses to unpickle global" in result.output and "system" in result.output
    assert not marker.exists()
    assert_no_output(tmp_path / "dst")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dst-tp", "3"], "--dst-tp 3: num_attention_heads=16 is not divisible by 3"),
        (["--dst-tp", "16"], "--dst-tp 16: num_query_groups=8 is not divisible by 16"),
        (["--dst-pp", "3"], "--dst-pp 3: num_layers=4 is not divisible by 3"),
        (["--dst-pp", "8"], "--dst-pp 8: more pipeline stages than num_layers=4"),
        (["--dst-pp", "2", "--dst-decoder-first-pipeline-num-layers", "5"],
         "--dst-decoder-first-pipeline-num-layers 5, --dst-decoder-last-pipeline-num-layers None: more than num_layers=4"),
        (["--dst-pp", "3", "--dst-decoder-first-pipeline-num-layers", "1"],
         "--dst-pp 3: the 3 layers left after the first/last stages do not divide evenly over 2 stages"),
    ],
)
def test_impossible_target_layout_is_refused_before_writing(
    tp2_checkpoint: Path, tmp_path: Path, flags: list[str], message: str
) -> None:
    result = run_cli(tp2_checkpoint, tmp_path / "dst", *flags)

    assert result.exit_code == 2
    assert message in result.output
    assert_no_output(tmp_path / "dst")


def test_ffn_not_divisible_by_target_tp_is_refused(tmp_path: Path) -> None:
    from dataclasses import replace

    model = replace(GQA_SWIGLU, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=90)
    src = write_megatron_checkpoint(tmp_path / "src", model, make_full_model(model), 1, 1)

    result = run_cli(src, tmp_path / "dst", "--dst-tp", "4")

    assert result.exit_code == 2
    assert "--dst-tp 4: ffn_hidden_size=90 is not divisible by 4" in result.output


def test_existing_non_empty_dst_is_refused_without_overwrite(tp2_checkpoint: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")

    result = run_cli(tp2_checkpoint, dst, "--dst-tp", "1")

    assert result.exit_code == 2
    assert f"DST {dst} exists and is not empty; pass --overwrite" in result.output
    assert (dst / "keep.txt").read_text() == "precious"


def test_overwrite_replaces_dst_only_with_a_complete_output(tp2_checkpoint: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old.txt").write_text("old")

    result = run_cli(tp2_checkpoint, dst, "--dst-tp", "1", "--overwrite", "--quiet")

    assert result.exit_code == 0, result.output
    assert not (dst / "old.txt").exists()
    assert (dst / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt").is_file()


def test_empty_existing_dst_is_used(tp2_checkpoint: Path, tmp_path: Path) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()

    result = run_cli(tp2_checkpoint, dst, "--dst-tp", "1", "--quiet")

    assert result.exit_code == 0, result.output
    assert (dst / "latest_checkpointed_iteration.txt").read_text() == "100"


@pytest.mark.parametrize("relative", ["inside", "iter_0000100/inside", "."])
def test_dst_inside_src_is_refused(tp2_checkpoint: Path, relative: str) -> None:
    result = run_cli(tp2_checkpoint, tp2_checkpoint / relative, "--dst-tp", "1", "--overwrite")

    assert result.exit_code == 2
    assert "is inside SRC" in result.output
    assert not (tp2_checkpoint / "inside").exists()


def test_src_tp_that_contradicts_the_checkpoint_is_refused(tp2_checkpoint: Path, tmp_path: Path) -> None:
    result = run_cli(tp2_checkpoint, tmp_path / "dst", "--src-tp", "8", "--dst-tp", "1")

    assert result.exit_code == 2
    assert "--src-tp 8: the checkpoint's args say 2" in result.output


def test_tracker_naming_a_missing_iteration_is_refused(tp2_checkpoint: Path, tmp_path: Path) -> None:
    (tp2_checkpoint / "latest_checkpointed_iteration.txt").write_text("300")

    result = run_cli(tp2_checkpoint, tmp_path / "dst")

    assert result.exit_code == 1
    assert "names iteration 300 but iter_0000300 is missing (present: 100)" in result.output


def test_unknown_key_in_a_rank_file_is_reported_not_dropped(tp2_checkpoint: Path, tmp_path: Path) -> None:
    path = rank_file(tp2_checkpoint, "mp_rank_00")
    state = load_for_test(path)
    state["model"]["decoder.layers.0.mlp.router.weight"] = torch.zeros(4, 64)
    torch.save(state, path)

    result = run_cli(tp2_checkpoint, tmp_path / "dst", "--dst-tp", "1")

    assert result.exit_code == 1
    assert "unexpected: ['decoder.layers.0.mlp.router.weight']" in result.output


def test_failure_while_writing_leaves_no_output(tp2_checkpoint: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    import pgconvert.savers.megatron as megatron_saver  # rank files go through its stream writer

    real_save = megatron_saver.save_stream

    def failing_save(obj: object, path: object, *args: object, **kwargs: object) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(megatron_saver, "save_stream", failing_save)

    result = run_cli(tp2_checkpoint, tmp_path / "dst", "--dst-tp", "2")

    assert result.exit_code != 0
    assert len(calls) == 2
    assert_no_output(tmp_path / "dst")


def test_interrupt_while_writing_leaves_no_output(tp2_checkpoint: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import pgconvert.savers.megatron as megatron_saver  # rank files go through its stream writer

    real_save = megatron_saver.save_stream
    calls = []

    def interrupted_save(obj: object, path: object, *args: object, **kwargs: object) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(megatron_saver, "save_stream", interrupted_save)

    result = run_cli(tp2_checkpoint, tmp_path / "dst", "--dst-tp", "2")

    assert result.exit_code == 130
    assert "interrupted: no output was left behind" in result.output
    assert_no_output(tmp_path / "dst")
