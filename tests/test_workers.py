"""``--workers`` keeps no source open beyond the conversion that opened it."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
from support.tiny_models import GQA_SWIGLU
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint

from pgconvert.run.convert import convert_request, plan
from pgconvert.run.workers import write_files

MAPS = Path("/proc/self/maps")
FDS = Path("/proc/self/fd")


def _held_under(root: Path) -> list[str]:
    """The files under ``root`` this process maps or holds open."""
    prefix = str(root.resolve())
    mapped = {line.split(maxsplit=5)[-1] for line in MAPS.read_text().splitlines()}
    opened = set()
    for fd in FDS.iterdir():
        try:
            opened.add(os.readlink(fd))
        except OSError:  # closed since it was listed
            continue
    return sorted(path for path in mapped | opened if path.startswith(prefix))


@pytest.mark.skipif(not (MAPS.exists() and FDS.exists()), reason="needs /proc/self/maps and /proc/self/fd (Linux)")
def test_write_files_outside_a_pool_closes_the_source_it_opened(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)
    request = convert_request(src, tmp_path / "dst", dst_tp=1)
    open_plan = functools.partial(plan, check_dst=False)
    conversion = open_plan(request)
    relpath = next(item.relpath for item in conversion.files if item.relpath.endswith(".pt"))
    conversion.source.load("embedding.word_embeddings.weight")  # read from both rank files
    assert _held_under(src)  # an open source holds its rank files open once it has read them
    conversion.source.close()
    assert _held_under(src) == []
    staging = tmp_path / "staging"
    staging.mkdir()

    files, _ = write_files(request, str(staging), [relpath], open_plan)

    assert [item.relpath for item in files] == [relpath]
    assert (staging / relpath).is_file()
    assert _held_under(src) == []
