"""What the lifecycle tests ask of the operating system: is a process gone, is a port free."""

from __future__ import annotations

import os
import socket
import time


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
