"""The sm120_pcie backend, routed by the plugin's plan, in a captured layer stack gives the
layer outputs of all-reduce + norm.

A small DeepSeek-shaped stack per rank (two fused points per layer: after the attention output
projection and after the MoE down projection, each a row-parallel GEMM on the rank's weight
shard) is captured in one CUDA graph per rank and replayed with new inputs. Its hidden states and
residuals must match the unfused path computed separately: the sum over ranks of the same bf16
partials, then residual add and RMSNorm, rounded to bf16 at the same points as the kernel. On one
GPU the ranks are streams of this process (NCCL cannot run two ranks on one GPU, so the unfused
reference is computed in float32 torch rather than by NCCL). Each point is checked against the
reference fed by that point's own inputs, captured in the graph, so bf16 drift along the stack
does not hide or fake a per-point error."""

from __future__ import annotations

import pytest
import torch
from layer_stack_plan import sm120_pcie_plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HIDDEN, LAYERS, EPS = 2048, 4, 1e-6


def make_weights(world_size: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def shard():
        return (torch.randn(HIDDEN, HIDDEN, generator=g, device="cuda") / HIDDEN**0.5).bfloat16()

    layers = []
    for _ in range(LAYERS):
        layers.append(
            {
                "attn": [shard() for _ in range(world_size)],
                "moe": [shard() for _ in range(world_size)],
                "norm1": (1 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda")).bfloat16(),
                "norm2": (1 + 0.1 * torch.randn(HIDDEN, generator=g, device="cuda")).bfloat16(),
            }
        )
    return layers


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("tokens", [4, 32])
def test_captured_stack_matches_allreduce_plus_norm(world_size, tokens):
    sk = pytest.importorskip("sgl_kernel_sm120", reason="sgl-kernel-sm120 is not importable")
    from sgl_kernel_sm120.testing import TOLERANCES, LocalRanks, max_violation, reference_fused
    from sglang_sm120.commands.tune import make_add_rmsnorm

    plan = sm120_pcie_plan(world_size, HIDDEN)
    assert plan.fusion_backend == "sm120_pcie" and plan.plain_allreduce == "sm120_pcie"
    fused_here = plan.uses_sm120_pcie_at(tokens)  # the plan's word, as the server follows it
    add_rmsnorm, _ = make_add_rmsnorm(HIDDEN, torch.bfloat16)

    def point(partial, residual, weight, ws):
        """What the server runs at one point: the fused kernel where the plan routes it, else
        the unfused path: all-reduce (ours standing in for NCCL, which cannot run two ranks on
        one GPU), then a separate add + RMSNorm kernel."""
        if fused_here:
            return sk.fused_allreduce_add_rmsnorm(partial, residual, weight, EPS, ws)
        return add_rmsnorm(sk.all_reduce(partial, ws), residual, weight)

    layers = make_weights(world_size)
    # Ranks share one GPU here: a rank's GEMM must find SMs free of its peers' spinning
    # all-reduce blocks (each needs much shared memory), so cap the blocks per all-reduce.
    # One rank per GPU (a real server) has no such constraint.
    ranks = LocalRanks(sk.CommWorkspace.create_local(world_size, 64, HIDDEN, max_blocks=8))
    static_in = torch.zeros(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    # points[rank] = [(partial, residual_in, norm_out, residual_out), ...] of the last run
    points: list = [None] * world_size

    def stack(rank, ws):
        h, residual, seen = static_in, static_in, []
        for layer in layers:
            for proj, norm in (("attn", "norm1"), ("moe", "norm2")):
                partial = h @ layer[proj][rank]
                h, residual_out = point(partial, residual, layer[norm], ws)
                seen.append((partial, residual, h, residual_out))
                residual = residual_out
        points[rank] = seen

    def warm_up_stream(rank, ws):
        # Run before any rank spins on its peers: cuBLAS sets up on first use per stream, and
        # the caching allocator keeps blocks per stream, so an allocation that needs a new
        # cudaMalloc would wait for the spinning kernels. Grow this stream's pool to the
        # stack's peak (a partial and up to three outputs per point) without communicating.
        kept = []
        for layer in layers:
            for proj in ("attn", "moe"):
                partial = static_in @ layer[proj][rank]
                kept += [partial] + [torch.empty_like(partial) for _ in range(3)]

    try:
        ranks.run(warm_up_stream)
        torch.cuda.synchronize()
        ranks.run(stack)  # eager: loads every kernel before capture
        torch.cuda.synchronize()
        ranks.check_errors()
        graphs = [torch.cuda.CUDAGraph() for _ in range(world_size)]
        for rank, ws in enumerate(ranks.workspaces):
            with torch.cuda.graph(graphs[rank], stream=ranks.streams[rank]):
                stack(rank, ws)
        rtol, atol = TOLERANCES[torch.bfloat16]
        for step in range(5):
            g = torch.Generator(device="cuda").manual_seed(100 + step)
            static_in.copy_(torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16())
            ranks.run(lambda rank, ws: graphs[rank].replay())
            torch.cuda.synchronize()
            ranks.check_errors()
            for index in range(2 * LAYERS):
                partials = [points[r][index][0] for r in range(world_size)]
                residual_in = points[0][index][1]
                weight = layers[index // 2]["norm1" if index % 2 == 0 else "norm2"]
                want_norm, want_residual = reference_fused(partials, residual_in, weight, EPS)
                for rank in range(world_size):
                    _, _, norm_out, residual_out = points[rank][index]
                    assert float(max_violation(norm_out, want_norm, rtol)) <= atol, (step, index)
                    assert float(max_violation(residual_out, want_residual, rtol)) <= atol
            # Every rank ends with the same hidden states, as tensor parallelism needs.
            final = [points[r][-1][2] for r in range(world_size)]
            assert all(torch.equal(final[0], other) for other in final[1:])
    finally:
        ranks.close()
