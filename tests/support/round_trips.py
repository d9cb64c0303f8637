"""The round trip every HF family's tests run: HF -> Megatron per-rank -> torch_dist -> HF through pgconvert,
checked against the source (every tensor torch.equal, config.json and side files byte for byte, transformers'
logits at rtol=atol=1e-5 in fp32)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from support.hf_helpers import assert_same_hf_tensors, hf_logits

import pgconvert

SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def assert_round_trip(src: Path, tmp_path: Path, ids: torch.Tensor, side_files: tuple[str, ...] = SIDE_FILES,
                      **megatron_layout: Any) -> pgconvert.Report:
    """``src`` through Megatron at ``megatron_layout`` (and any other convert option), torch_dist and back to HF in
    ``tmp_path``; returns the report of the conversion to Megatron."""
    report = pgconvert.convert(src, tmp_path / "megatron", dst_format="megatron", **megatron_layout)
    pgconvert.convert(tmp_path / "megatron", tmp_path / "dist", dst_format="torch_dist")
    back = pgconvert.convert(tmp_path / "dist", tmp_path / "hf", dst_format="hf", dst_tp=1, dst_pp=1, dst_ep=1)
    assert back.src_format == "torch_dist"
    assert_same_model(src, tmp_path / "hf", ids, side_files)
    return report


def assert_same_model(src: Path, converted: Path, ids: torch.Tensor, side_files: tuple[str, ...] = SIDE_FILES) -> None:
    """``converted`` is ``src``: every tensor torch.equal, config.json and side files byte for byte, logits."""
    assert_same_hf_tensors(src, converted)
    assert json.loads((converted / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    for name in side_files:
        assert (converted / name).read_bytes() == (src / name).read_bytes(), name
    torch.testing.assert_close(hf_logits(converted, ids), hf_logits(src, ids), rtol=1e-5, atol=1e-5)


def assert_config_refused(src: Path, tmp_path: Path, change: dict[str, object], expected: str) -> None:
    """A copy of ``src`` whose config.json has ``change`` (a None value: the key removed) converts to Megatron with
    an error matching ``expected`` and leaves no destination."""
    import shutil

    import pytest

    from pgconvert.errors import PgconvertError

    copy = Path(shutil.copytree(src, tmp_path / "src"))
    doc = json.loads((copy / "config.json").read_text())
    for key, value in change.items():
        if value is None:
            doc.pop(key, None)
        else:
            doc[key] = value
    (copy / "config.json").write_text(json.dumps(doc))
    with pytest.raises(PgconvertError, match=expected):
        pgconvert.convert(copy, tmp_path / "out", dst_format="megatron")
    assert not (tmp_path / "out").exists()
