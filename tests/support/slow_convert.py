"""Test-only entry point: the real CLI with each rank-file write slowed down, for signal tests.

Run as ``python tests/support/slow_convert.py SECONDS [pgconvert args...]``; nothing here is used by pgconvert.
"""

from __future__ import annotations

import signal
import sys
import time


def main() -> None:
    # A CI runner may start us with SIGINT ignored (as a background job); a user's Ctrl-C is not.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    delay = float(sys.argv[1])
    import pgconvert.savers.megatron as megatron_saver  # rank files go through its stream writer

    real_save = megatron_saver.save_stream

    def slow_save(obj: object, path: object, *args: object, **kwargs: object) -> None:
        real_save(obj, path, *args, **kwargs)
        time.sleep(delay)

    megatron_saver.save_stream = slow_save  # type: ignore[assignment]
    from pgconvert.cli import main as cli_main

    sys.argv = ["pgconvert", *sys.argv[2:]]
    cli_main()


if __name__ == "__main__":
    main()
