"""The optimizer hooks of the format contract: a third-party format that implements none of them converts from
and to every format, and "optimizer, scheduler and RNG state are not carried" is said only when the source holds
such state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from support.toy_format import FILE, register

import pgconvert
from pgconvert.cli import main
from pgconvert.errors import PgconvertError, ValidationError
from pgconvert.formats import Saver
from pgconvert.formats.registry import get_saver
from pgconvert.formats.stream import CanonicalSource
from pgconvert.optimizer.export import export_from_path
from pgconvert.optimizer.plan import plan_lines
from pgconvert.run.convert import convert_request, plan

GOLDENS = Path(__file__).parent / "data" / "megatron_lm"
# A Megatron-LM training checkpoint: optimizer, scheduler and RNG state beside the model (TP2 PP2, fp32).
TRAINED = GOLDENS / "train_tp2pp2_torch"
NOT_CARRIED = "optimizer, scheduler and RNG state are not carried"


def _example(root: Path) -> Path:
    result = CliRunner().invoke(main, ["example", str(root)])
    assert result.exit_code == 0, result.output
    return root


def _not_carried(notices: list[str]) -> list[str]:
    return [notice for notice in notices if NOT_CARRIED in notice]


def test_the_contract_says_a_format_holds_and_writes_no_optimizer_state_by_default() -> None:
    assert Saver.writes_optimizer is False and Saver.optimizer_forms == ()
    assert get_saver("hf").writes_optimizer is False
    assert get_saver("megatron").writes_optimizer is True and get_saver("megatron").optimizer_forms == ()
    assert get_saver("torch_dist").optimizer_forms == ("fully_reshardable", "dp_reshardable",
                                                       "fully_sharded_model_space")
    assert CanonicalSource.training_state_notice is None
    for hook in ("holds_training_state", "holds_optimizer"):
        assert getattr(CanonicalSource, hook)(None) is False  # type: ignore[arg-type]


def test_converting_the_example_model_names_no_training_state(tmp_path: Path) -> None:
    demo = _example(tmp_path / "demo")

    result = CliRunner().invoke(main, ["--dst-tp", "1", str(demo), str(tmp_path / "out")])
    to_torch_dist = pgconvert.convert(demo, tmp_path / "td", dst_format="torch_dist")

    assert result.exit_code == 0, result.output
    assert NOT_CARRIED not in result.output and "optimizer" not in result.output
    assert _not_carried(to_torch_dist.notices) == []
    assert "torch_dist written with the layout tp=8,pp=1 recorded in the common_state entry's args" in to_torch_dist.notices


@pytest.mark.parametrize(("dst_format", "dst_layout"), [("megatron", None), ("torch_dist", None),
                                                       ("fsdp_dtensor", "tp=2,pp=1")])
def test_a_source_with_training_state_names_what_is_not_carried(tmp_path: Path, dst_format: str,
                                                               dst_layout: str | None) -> None:
    report = pgconvert.convert(TRAINED, tmp_path / "out", dst_layout, dst_format=dst_format, skip_optimizer=True)

    assert len(_not_carried(report.notices)) == 1, report.notices


def test_a_format_without_optimizer_hooks_converts_to_and_from_megatron(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    register(monkeypatch)
    demo = _example(tmp_path / "demo")

    to_toy = pgconvert.convert(demo, tmp_path / "toy", dst_format="toy")
    back = pgconvert.convert(tmp_path / "toy", tmp_path / "back", dst_format="megatron", dst_tp=2)
    torch_dist = pgconvert.convert(tmp_path / "toy", tmp_path / "td", dst_format="torch_dist")

    assert (to_toy.src_format, back.src_format, torch_dist.src_format) == ("megatron", "toy", "toy")
    assert _not_carried(to_toy.notices + back.notices + torch_dist.notices) == []
    assert not [notice for notice in back.notices + torch_dist.notices if notice.startswith("optimizer")]
    assert pgconvert.verify(demo, tmp_path / "back").equal
    assert pgconvert.verify(tmp_path / "toy", tmp_path / "td").equal


def test_optimizer_state_is_not_written_into_a_format_without_optimizer_hooks(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    register(monkeypatch)

    report = pgconvert.convert(TRAINED, tmp_path / "toy", dst_format="toy")
    conversion = plan(convert_request(TRAINED, tmp_path / "dry", dst_format="toy"))
    try:
        dry_run = plan_lines(conversion)
    finally:
        conversion.source.close()
    verified = pgconvert.verify(TRAINED, tmp_path / "toy")

    stored = torch.load(tmp_path / "toy" / FILE, weights_only=True)
    assert set(stored) == {"config", "iteration", "tensors"} and stored["iteration"] == 2
    assert not [notice for notice in report.notices if "optimizer" in notice]
    assert dry_run == []
    assert verified.equal and verified.optimizer is not None and verified.optimizer.status == "only in A"


def test_optimizer_options_for_a_format_without_optimizer_hooks_are_refused_by_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    register(monkeypatch)

    with pytest.raises(ValidationError, match="--dst-dp 2: applies to a Megatron per-rank destination, not toy"):
        pgconvert.convert(TRAINED, tmp_path / "a", dst_format="toy", dst_dp=2)
    with pytest.raises(ValidationError, match="--dst-optim-form dp_reshardable: applies to a torch_dist "
                                              "destination, not toy"):
        pgconvert.convert(TRAINED, tmp_path / "b", dst_format="toy", dst_optim_form="dp_reshardable")


def test_export_optimizer_of_a_format_without_optimizer_hooks_is_a_named_error(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    register(monkeypatch)
    pgconvert.convert(_example(tmp_path / "demo"), tmp_path / "toy", dst_format="toy")

    with pytest.raises(PgconvertError, match="toy checkpoints hold no optimizer state pgconvert reads"):
        export_from_path(tmp_path / "toy", tmp_path / "exported", None)
    assert not (tmp_path / "exported").exists()
