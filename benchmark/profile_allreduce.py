"""One rank of a 2+-process all-reduce run, for Nsight Compute: ours and FlashInfer's kernels at
one size, each op's calls inside an NVTX range named after it.

Profile only rank 0, and start the others without the profiler. For every profiled call the
other ranks launch first and rank 0 waits (a gloo barrier, then 20 ms) until their data has
landed in its buffers, so rank 0 is the late rank: the profile shows what a call costs on the
rank that waits least (launch, state, push, reduce, epilogue).

Collect only metrics that fit in ONE replay pass. Between passes Nsight Compute restores every
allocation the process can reach, the peers' IPC-mapped workspaces included: a peer that
finished its call meanwhile has its call state rolled back, and the next call hangs (seen on
2x H200 with the default sections). One pass per invocation works:

    export MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 WORLD_SIZE=2
    RANK=1 python benchmark/profile_allreduce.py --tokens 4 &
    RANK=0 ncu --nvtx --nvtx-include timed_ours_plain/ --nvtx-include timed_ours_fused/ \
        --nvtx-include timed_fi_trtllm/ --clock-control none --cache-control none --csv \
        --metrics gpu__time_duration.sum,smsp__inst_executed.sum,sm__cycles_active.max,\
smsp__warp_issue_stalled_no_instruction_per_warp_active.pct,\
smsp__warp_issue_stalled_long_scoreboard_per_warp_active.pct \
        python benchmark/profile_allreduce.py --tokens 4

With --timeline (no profiler, every rank started the same way) it instead replays a CUDA graph
of our plain and fused calls and prints block 0's phase times of the last call, per rank (the
kernel's debug timeline: start, call state read, pushed, buffer cleared / first round, reduced,
end).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
try:
    import sgl_kernel_sm120 as sk
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sgl-kernel-sm120" / "python"))
    import sgl_kernel_sm120 as sk

EPS = 1e-6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--calls", type=int, default=5, help="profiled calls per op")
    parser.add_argument(
        "--ops", nargs="+", default=["ours_plain", "ours_fused", "fi_trtllm", "fi_pcie"]
    )
    parser.add_argument("--timeline", action="store_true", help="print our kernel's phases")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", rank=rank, world_size=world)
    tokens, hidden = args.tokens, args.hidden
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    residual = torch.randn(tokens, hidden, device="cuda").bfloat16()
    weight = torch.ones(hidden, device="cuda").bfloat16()
    ops = {}
    ws = sk.CommWorkspace.create(dist.group.WORLD, tokens, hidden, timeout_ms=60_000)
    ops["ours_plain"] = lambda: sk.all_reduce(x, ws)
    ops["ours_fused"] = lambda: sk.fused_allreduce_add_rmsnorm(x, residual, weight, EPS, ws)
    if args.timeline:
        timeline(ws, ops, rank)
        ws.close()
        dist.destroy_process_group()
        return
    if {"fi_trtllm", "fi_pcie"} & set(args.ops):
        import flashinfer.comm as fic
        from sglang_sm120.commands.tune import flashinfer_trtllm_fused

        trtllm = flashinfer_trtllm_fused(rank, world, tokens, hidden, torch.bfloat16)
        pws = fic.PcieIpcAllReduceWorkspace(group=dist.group.WORLD, max_numel=tokens * hidden)
        ops["fi_trtllm"] = lambda: trtllm(x, residual, weight)
        ops["fi_pcie"] = lambda: pws.all_reduce(x)
    for name in args.ops:
        for _ in range(3):  # warm-up, outside the profiled range
            ops[name]()
        torch.cuda.synchronize()
        dist.barrier()
        for _ in range(args.calls):
            if rank != 0:
                ops[name]()
                dist.barrier()  # launched
            else:
                dist.barrier()
                time.sleep(0.02)  # the peers' data has landed here
                torch.cuda.nvtx.range_push(f"timed_{name}")
                ops[name]()
                torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            dist.barrier()  # no rank starts the next call before rank 0's passes are done
        ws.check_error()
    ws.close()
    dist.destroy_process_group()
    print(f"rank {rank}: profiled {args.ops} at {tokens} x {hidden}", flush=True)


PHASES = ("state read", "pushed", "cleared / round 1", "reduced / gathered", "end")


def timeline(ws, ops: dict, rank: int, calls: int = 20) -> None:
    """Block 0's phase times (us) of the last of `calls` graph-replayed calls, per op."""
    stamps = torch.zeros(8, dtype=torch.int64, device=ws.device)
    ws._set_debug(timeline=stamps)
    stream = torch.cuda.Stream()
    for name in ("ours_plain", "ours_fused"):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ops[name]()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                ops[name]()
        for _ in range(5):
            dist.barrier()
            graph.replay()
            torch.cuda.synchronize()
        t = stamps.tolist()
        ns_per_cycle = (t[7] - t[6]) / max(1, t[5] - t[0])
        steps = [(t[i + 1] - t[i]) * ns_per_cycle / 1000 for i in range(5)]
        cells = "  ".join(f"{phase} +{us:.2f}" for phase, us in zip(PHASES, steps, strict=True))
        print(f"rank {rank} {name}: {(t[7] - t[6]) / 1000:.2f} us in block 0: {cells}", flush=True)
    ws._set_debug()


if __name__ == "__main__":
    main()
