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


def wait_until_main_thread_blocks(pid: int, timeout_s: float = 60.0) -> None:
    """Until the main thread of process ``pid`` sleeps in the kernel (a timed sleep, or a lock
    or event wait on a futex), as it does once it waits for its servers; TimeoutError
    otherwise."""
    deadline = time.monotonic() + timeout_s
    task = f"/proc/{pid}/task/{pid}"
    while time.monotonic() < deadline:
        with open(f"{task}/stat") as stat, open(f"{task}/wchan") as wchan:
            state, waits_in = stat.read().rsplit(")", 1)[1].split()[0], wchan.read()
            if state == "S" and ("nanosleep" in waits_in or "futex" in waits_in):
                return
        time.sleep(0.2)
    raise TimeoutError(f"the main thread of {pid} never blocked within {timeout_s:.0f} s")


def signal_a_thread_other_than_main(pid: int, signum: int) -> int:
    """Send ``signum`` to one thread of process ``pid`` that is not its main thread (Linux
    tgkill), as the kernel may deliver a signal sent to the process; returns that thread's id.
    Raises LookupError where the process has no other thread."""
    import ctypes

    threads = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    if not threads:
        raise LookupError(f"process {pid} has no thread besides its main one")
    libc = ctypes.CDLL(None, use_errno=True)
    sys_tgkill = {"aarch64": 131}.get(os.uname().machine, 234)  # 234 on x86-64
    if libc.syscall(sys_tgkill, pid, threads[0], signum) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {threads[0]}, {signum})")
    return threads[0]
