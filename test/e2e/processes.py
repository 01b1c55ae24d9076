"""What the lifecycle tests ask of the operating system: is a process gone, is a port free,
which processes did the fake servers start."""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path


def gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether the process exits within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def port_free(port: int) -> bool:
    """Nothing listens there: a server may bind it again (closed connections may linger in
    TIME_WAIT, which SO_REUSEADDR, as servers set it, lets pass)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def server_pids(log_dir: Path) -> list[int]:
    """The pids of the fake servers and their workers, as their logs in ``log_dir`` print them."""
    text = "".join(p.read_text() for p in sorted(log_dir.glob("*.log")))
    return [int(pid) for pid in re.findall(r"(?:server|worker) pid (\d+)", text)]
