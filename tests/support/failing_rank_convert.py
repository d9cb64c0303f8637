"""Test-only entry point: the real CLI, with rank-file writes failing in one launcher RANK.

``python tests/support/failing_rank_convert.py FAILING_RANK [pgconvert args...]``; used under torchrun.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    failing_rank = sys.argv[1]
    if os.environ.get("RANK") == failing_rank:
        def broken_save(obj: object, path: object, *args: object, **kwargs: object) -> None:
            raise OSError(5, "Input/output error (injected)", str(path))

        import pgconvert.savers.megatron as megatron_saver  # rank files go through its stream writer

        megatron_saver.save_stream = broken_save  # type: ignore[assignment]
    from pgconvert.cli import main as cli_main

    sys.argv = ["pgconvert", *sys.argv[2:]]
    cli_main()


if __name__ == "__main__":
    main()
