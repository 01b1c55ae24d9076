"""The NCCL torch ships reads the per-collective form a TP worker exports (``allreduce:LL``,
``planning.tuning.scoped_env``): the tuned variant reaches the all-reduce only, and every other
collective keeps NCCL's own choice. Two ranks, one per GPU, in fresh processes (NCCL reads
NCCL_PROTO once per process, and a one-rank communicator never reads it: NCCL 2.28 skips its
tuning model there), with NCCL's INFO log: the value is read, nothing warns about it, an
all-reduce and a broadcast under it are right, and NCCL's enabled-protocol matrix has LL alone
on for AllReduce while the other collectives keep Simple.

Needs 2 GPUs; skipped with the reason elsewhere (NCCL refuses two ranks on one GPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.multigpu

TWO_RANKS = """
import torch, torch.distributed as dist, torch.multiprocessing as mp
def rank(r):
    torch.cuda.set_device(r)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=r, world_size=2,
                            device_id=torch.device("cuda", r))
    x = torch.full((4096,), float(r + 1), device="cuda")
    dist.all_reduce(x)
    dist.broadcast(x, 0)
    torch.cuda.synchronize()
    assert torch.all(x == 3).item(), "wrong result"
    print("COLLECTIVES OK", r, flush=True)
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(rank, nprocs=2)
"""


def run_two_ranks(proto: str, tmp_path) -> str:
    """The ranks' whole log under ``NCCL_PROTO=proto`` and none of the user's NCCL tuning."""
    from sglang_sm120.planning.nccl_settings import USER_NCCL_TUNING

    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    env = {k: v for k, v in os.environ.items() if k not in USER_NCCL_TUNING}
    env.update(
        NCCL_PROTO=proto,
        NCCL_DEBUG="INFO",
        NCCL_DEBUG_SUBSYS="INIT,ENV,TUNING",
        NCCL_CONF_FILE=str(tmp_path / "absent.conf"),
    )
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and log.count("COLLECTIVES OK") == 2, log[-4000:]
    return log


def protocol_matrix(log: str) -> dict[str, list[int]]:
    """NCCL's "Enabled NCCL Func/Proto/Algo Matrix" (the first rank's), by function:
    [LL, LL128, Simple]."""
    rows: dict[str, list[int]] = {}
    for line in log.splitlines():
        m = re.match(r"\s*(\w+) \|\s+(\d+)\s+(\d+)\s+(\d+)\s+\|", line)
        if m and m.group(1) not in rows:
            rows[m.group(1)] = [int(m.group(i)) for i in (2, 3, 4)]
    return rows


def test_nccl_reads_the_per_collective_protocol_the_worker_exports(tmp_path):
    if GPUS < 2:
        pytest.skip(f"needs 2 GPUs, {GPUS} visible")
    from sglang_sm120.planning.tuning import scoped_env

    ((name, value),) = scoped_env((("NCCL_PROTO", "LL"),))
    assert (name, value) == ("NCCL_PROTO", "allreduce:LL")
    log = run_two_ranks(value, tmp_path)
    assert f"NCCL_PROTO set by environment to {value}" in log, log[-4000:]
    warned = [
        line
        for line in log.splitlines()
        if "NCCL WARN" in line or re.search(r"(?i)\b(unknown|invalid)\b.*proto", line)
    ]
    assert warned == [], "\n".join(warned)
    matrix = protocol_matrix(log)
    assert matrix.get("AllReduce") == [1, 0, 0], log[-4000:]
    others = {f: row for f, row in matrix.items() if f != "AllReduce"}
    assert others and all(row[2] == 1 for row in others.values()), matrix
