"""Where one call's time goes, with every rank a stream of one process on one GPU: the per-call
time of our plain and fused all-reduce (CUDA-graph replays, as bench_allreduce.py times them),
then block 0's phase times of the last replayed call on each rank, from the kernel's debug
timeline (state read, pushed, previous buffer cleared, reduced / normalised, end), and when each
rank's kernel started relative to the first.

    python benchmark/phase_timeline_local.py --world-sizes 2 8 --hidden 7168 8

Hidden 8 is a 16-byte message: what is left there is the cost of the call itself, not of the
data (the ranks' start skew included).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # LocalRanks: no lazy load between ranks

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
# the kernel package's sources, where it is not installed (the library from the environment)
sys.path.append(str(Path(__file__).resolve().parents[1] / "sgl-kernel-sm120" / "python"))

import sgl_kernel_sm120 as sk
from sgl_kernel_sm120.testing import LocalRanks
from sglang_sm120.commands.tune import time_local

PHASES = ("state", "pushed", "cleared", "reduced", "end")
EPS = 1e-6


def phase_rows(stamps: list[torch.Tensor]) -> list[tuple[float, float, list[float]]]:
    """Per rank: (start in us after the first rank's, kernel us, each phase's us)."""
    rows = []
    for st in stamps:
        t = st.tolist()
        ns_per_cycle = (t[7] - t[6]) / max(1, t[5] - t[0])
        steps = [(t[i + 1] - t[i]) * ns_per_cycle / 1000 for i in range(len(PHASES))]
        rows.append((t[6], (t[7] - t[6]) / 1000, steps))
    first = min(start for start, _, _ in rows)
    return [((start - first) / 1000, kernel, steps) for start, kernel, steps in rows]


def one_size(world: int, hidden: int, calls: int, replays: int) -> None:
    ranks = LocalRanks(sk.CommWorkspace.create_local(world, 16, hidden))
    try:
        xs = [torch.randn(1, hidden, device="cuda").bfloat16() for _ in range(world)]
        residual = torch.randn(1, hidden, device="cuda").bfloat16()
        weight = torch.ones(hidden, device="cuda").bfloat16()
        ops = {
            "plain": lambda r, ws: sk.all_reduce(xs[r], ws),
            "fused": lambda r, ws: sk.fused_allreduce_add_rmsnorm(xs[r], residual, weight, EPS, ws),
        }
        stamps = [torch.zeros(8, dtype=torch.int64, device="cuda") for _ in range(world)]
        for name, op in ops.items():
            per_call = time_local(ranks, op, calls, replays)
            for ws, st in zip(ranks.workspaces, stamps, strict=True):
                ws._set_debug(timeline=st)
            time_local(ranks, op, calls, 2)
            print(f"world {world} hidden {hidden} {name}: {per_call:.2f} us/call")
            for rank, (start, kernel, steps) in enumerate(phase_rows(stamps)):
                phases = " ".join(f"{p} {s:.2f}" for p, s in zip(PHASES, steps, strict=True))
                print(f"   rank {rank}: starts +{start:.2f} us, kernel {kernel:.2f} us: {phases}")
            for ws in ranks.workspaces:
                ws._set_debug()
    finally:
        ranks.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--hidden", type=int, nargs="+", default=[7168, 8])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--replays", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(f"machine: 1 x {torch.cuda.get_device_name()} (ranks as streams of one process), 1 token")
    for world in args.world_sizes:
        for hidden in args.hidden:
            one_size(world, hidden, args.calls, args.replays)


if __name__ == "__main__":
    main()
