"""Launching a command under torchrun with two local processes, as a user starts a many-process conversion."""

from __future__ import annotations

import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node 2 ARGS`` on this host (``-m pgconvert ...`` or a script and its arguments)."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), *args],
        capture_output=True, text=True, timeout=300,
    )
