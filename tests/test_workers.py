"""``--workers`` keeps no source open beyond the conversion that opened it."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from support.tiny_models import GQA_SWIGLU
from support.megatron_fixtures import make_full_model, write_megatron_checkpoint

from pgconvert.run.convert import convert_request, plan
from pgconvert.run.workers import write_files

MAPS = Path("/proc/self/maps")


def _mapped_under(root: Path) -> list[str]:
    prefix = str(root.resolve())
    return sorted({line.split(maxsplit=5)[-1] for line in MAPS.read_text().splitlines()
                   if line.split(maxsplit=5)[-1].startswith(prefix)})


@pytest.mark.skipif(not MAPS.exists(), reason="needs /proc/self/maps (Linux)")
def test_write_files_outside_a_pool_closes_the_source_it_opened(tmp_path: Path) -> None:
    src = write_megatron_checkpoint(tmp_path / "src", GQA_SWIGLU, make_full_model(GQA_SWIGLU), 2, 1)
    request = convert_request(src, tmp_path / "dst", dst_tp=1)
    open_plan = functools.partial(plan, check_dst=False)
    conversion = open_plan(request)
    relpath = next(item.relpath for item in conversion.files if item.relpath.endswith(".pt"))
    assert _mapped_under(src)  # an open source maps its rank files
    conversion.source.close()
    assert _mapped_under(src) == []
    staging = tmp_path / "staging"
    staging.mkdir()

    files, _ = write_files(request, str(staging), [relpath], open_plan)

    assert [item.relpath for item in files] == [relpath]
    assert (staging / relpath).is_file()
    assert _mapped_under(src) == []
