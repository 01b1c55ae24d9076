"""Programmatic dependent launch (the workspaces' early_launch) against plain launches.

With early_launch every kernel may be launched, and its blocks made resident, while the kernel
before it in the stream is still running (all_reduce.cu, wait_for_previous_kernel and
let_next_kernel_launch). Two things could go wrong, and each has a test here:
- a kernel reads memory the kernel before it has not written yet: chains of calls where each
  call reads the previous call's outputs must give the same bits as with plain launches, eager
  and in CUDA graphs;
- with ranks sharing a GPU, a rank's next kernel, resident early, keeps a block its peers wait
  for off the GPU: chains with one rank far behind, at the largest grids the GPU holds, must
  finish without a timeout, and the same chain with the trigger moved before the waits (an
  UNSAFE debug switch) must time out, which shows the test can fail.
Ranks are streams of this process on one GPU (see test_sgl_kernel_allreduce.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import sys
from pathlib import Path

import pytest
import torch

try:
    import sgl_kernel_sm120 as sk
except ImportError:  # not installed: use the sources (the library then comes from the env var)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sgl-kernel-sm120" / "python"))
    import sgl_kernel_sm120 as sk

from sgl_kernel_sm120.testing import LocalRanks, rank_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("kernel_library_loaded"),
]

HIDDEN = 7168
EPS = 1e-6
STEPS = 3  # each step: all-reduce, then fused all-reduce + add + RMSNorm of its output
# (tokens, variant, fused_rows_per_block): the paths a fused call takes at these sizes on
# 2-8 ranks: the row split (1, 16), block-per-row or row split (64), two-shot in whole-row
# pieces or one-shot (300), two-shot with strided rows (7, forced), split into an all-reduce
# and a norm launch (64, one row per block), and the Lamport two-shot (16 and 64 at 4 and 8
# ranks by default; 7, forced, also at 2).
CHAINS = [
    (1, None, None),
    (16, None, None),
    (64, None, None),
    (300, None, None),
    (7, "twoshot", None),
    (64, None, 1),
    (7, "twoshot_lamport", None),
]
LAGGARD_SLEEP_CYCLES = 20_000_000  # ~10 ms: the last rank starts long after the others
STEP_SLEEP_CYCLES = 30_000  # ~15 us before each of its steps


def _ranks(world_size: int, early_launch: bool, **kw) -> LocalRanks:
    return LocalRanks(
        sk.CommWorkspace.create_local(
            world_size, 512, HIDDEN, early_launch=early_launch, timeout_ms=2000, **kw
        )
    )


def _chain(x, residual, weight, ws, variant, lag: bool) -> list[torch.Tensor]:
    """STEPS layers of a TP layer stack, every call reading the outputs of the call before it
    (back to back on this rank's stream). lag: this rank starts late and sleeps before each
    step, so its peers' kernels run ahead of its own."""
    if lag:
        torch.cuda._sleep(LAGGARD_SLEEP_CYCLES)
    outs = []
    for _ in range(STEPS):
        if lag:
            torch.cuda._sleep(STEP_SLEEP_CYCLES)
        reduced = sk.all_reduce(x, ws, variant=variant)
        x, residual = sk.fused_allreduce_add_rmsnorm(
            reduced, residual, weight, EPS, ws, variant=variant
        )
        outs += [reduced, x, residual]
    return outs


def _run_chain(
    ranks: LocalRanks, data, variant, lag: bool, graph: bool
) -> list[list[torch.Tensor]]:
    xs, residual, weight = data
    last = ranks.world_size - 1

    def body(rank, ws):
        return _chain(xs[rank], residual, weight, ws, variant, lag and rank == last)

    if not graph:
        outs = ranks.run(body)
    else:
        ranks.run(body)  # warm-up outside capture (the JIT-free path, the workspaces' state)
        torch.cuda.synchronize()
        graphs, outs = [], []
        for rank, ws in enumerate(ranks.workspaces):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=ranks.streams[rank]):
                outs.append(body(rank, ws))
            graphs.append(g)
        for _ in range(2):  # two replays: the second starts from the state the first left
            ranks.run(lambda rank, ws: graphs[rank].replay())
    torch.cuda.synchronize()
    ranks.check_errors()
    return [[t.clone() for t in per_rank] for per_rank in outs]


@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_early_launch_gives_the_bits_of_plain_launches_with_a_rank_far_behind(world_size, mode):
    for tokens, variant, rows_per_block in CHAINS:
        data = rank_inputs(world_size, tokens, HIDDEN, seed=tokens)
        results = {}
        for early in (False, True):
            ranks = _ranks(world_size, early, fused_rows_per_block=rows_per_block)
            try:
                results[early] = _run_chain(
                    ranks, data, variant, lag=early, graph=early and mode == "graph"
                )
            finally:
                ranks.close()
        what = (
            f"world {world_size}, {tokens} tokens, variant {variant}, rows/block {rows_per_block}"
        )
        for rank in range(world_size):
            for i, (plain, early) in enumerate(
                zip(results[False][rank], results[True][rank], strict=True)
            ):
                assert torch.equal(plain, early), f"{what}: rank {rank}, output {i} differs"
            assert all(torch.isfinite(t).all() for t in results[True][rank]), what


def _full_grid_chain(trigger_at_start: bool, graph: bool) -> str | None:
    """Two ranks at the largest one-shot grid the GPU holds for them; rank 1 starts ~10 ms
    late, rank 0 runs three calls back to back, eagerly or replaying a graph of them (captured
    after a plain warm-up, with the debug switch set, so the graph holds it). Returns the
    recorded error, or None."""
    ranks = LocalRanks(
        sk.CommWorkspace.create_local(2, 64, HIDDEN, early_launch=True, timeout_ms=300)
    )
    try:
        xs, _, _ = rank_inputs(2, 64, HIDDEN, seed=7)

        def body(rank, ws):
            if rank == 1:
                torch.cuda._sleep(LAGGARD_SLEEP_CYCLES)
            return [sk.all_reduce(xs[rank], ws, variant="oneshot") for _ in range(3)]

        if graph:
            ranks.run(body)
            torch.cuda.synchronize()
            ranks.check_errors()
        for ws in ranks.workspaces:
            ws._set_debug(trigger_at_start=trigger_at_start)
        if graph:
            graphs = [torch.cuda.CUDAGraph() for _ in ranks.workspaces]
            for rank, ws in enumerate(ranks.workspaces):
                with torch.cuda.graph(graphs[rank], stream=ranks.streams[rank]):
                    body(rank, ws)
            ranks.run(lambda rank, ws: graphs[rank].replay())
        else:
            ranks.run(body)
        torch.cuda.synchronize()
        return next((e for e in (ws.error() for ws in ranks.workspaces) if e), None)
    finally:
        ranks.close()


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_trigger_before_the_peer_waits_is_caught_by_the_full_grid_test(mode):
    """The negative control: the kernels with launch_dependents before any wait. Rank 0's
    second call, resident early, takes the SMs rank 1's first call needs, and rank 0's first
    call times out. With the real trigger placement the same chain finishes. In a graph the
    timeout also shows that capture kept the launches early (programmatic edges): with plain
    edges the control would finish."""
    resident = sk.workspace._resident_blocks(torch.cuda.current_device())
    tuning = sk.resolve_tuning(2, resident_blocks=resident, ranks_per_gpu=2)
    blocks = sk.config.choose_blocks(64 * HIDDEN * 2, tuning)
    if 2 * blocks < resident - 1:
        pytest.skip(f"2 x {blocks} blocks leave room on this GPU ({resident} resident)")
    graph = mode == "graph"
    assert _full_grid_chain(trigger_at_start=False, graph=graph) is None
    error = _full_grid_chain(trigger_at_start=True, graph=graph)
    assert error is not None and "timed out" in error, error
