"""Regenerate tests/data/megatron_lm/ with Megatron-LM's own tools (see the README there).

    PGCONVERT_MEGATRON_LM=/path/to/Megatron-LM PGCONVERT_MEGATRON_LM_PYTHON=/venv/with/triton/python \
        python scripts/make_megatron_lm_goldens.py
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interop_megatron_lm import make_hf, megatron_convert, pgconvert  # noqa: E402

GOLDENS = Path(__file__).resolve().parents[1] / "tests" / "data" / "megatron_lm"


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        make_hf(work / "hf")
        for src_tp, dst_tp in ((1, 2), (2, 1)):
            ours = work / f"pgconvert_tp{src_tp}"
            pgconvert("convert", str(work / "hf"), str(ours), "--dst-format", "megatron",
                      "--dst-tp", str(src_tp), "--dst-transformer-impl", "local")
            target = GOLDENS / f"convert_py_core_tp{dst_tp}"
            shutil.rmtree(target, ignore_errors=True)
            megatron_convert(ours, target, dst_tp, 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
