"""The sm120_pcie backend in a captured layer stack gives the layer outputs of all-reduce + norm.

A small DeepSeek-shaped stack per rank (two fused points per layer: after the attention output
projection and after the MoE down projection, each a row-parallel GEMM on the rank's weight
shard) is captured in one CUDA graph per rank and replayed with new inputs. Its hidden states and
residuals must match the unfused path computed separately: the sum over ranks of the same bf16
partials, then residual add and RMSNorm, rounded to bf16 at the same points as the kernel. On one
GPU the ranks are streams of this process (NCCL cannot run two ranks on one GPU, so the unfused
reference is computed in float32 torch rather than by NCCL)."""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "sgl-kernel-sm120" / "python") not in sys.path:
    sys.path.append(str(ROOT / "sgl-kernel-sm120" / "python"))

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


def reference_stack(hidden: torch.Tensor, layers) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce (fp32 sum of the bf16 partials) + add + RMSNorm, rounded like the kernel."""
    from sgl_kernel_sm120.testing import reference_fused

    h, residual = hidden, hidden
    for layer in layers:
        for proj, norm in (("attn", "norm1"), ("moe", "norm2")):
            partials = [h @ w for w in layer[proj]]
            norm_out, residual_out = reference_fused(partials, residual, layer[norm], EPS)
            h, residual = norm_out.bfloat16(), residual_out.bfloat16()
    return h, residual


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("tokens", [4, 32])
def test_captured_stack_matches_allreduce_plus_norm(world_size, tokens):
    sk = pytest.importorskip("sgl_kernel_sm120", reason="sgl-kernel-sm120 is not importable")
    from sgl_kernel_sm120.testing import LocalRanks

    layers = make_weights(world_size)
    ranks = LocalRanks(sk.CommWorkspace.create_local(world_size, 64, HIDDEN))
    static_in = torch.zeros(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    outputs: list = [None] * world_size

    def stack(rank, ws):
        h, residual = static_in, static_in
        for layer in layers:
            for proj, norm in (("attn", "norm1"), ("moe", "norm2")):
                h, residual = sk.fused_allreduce_add_rmsnorm(
                    h @ layer[proj][rank], residual, layer[norm], EPS, ws
                )
        outputs[rank] = (h, residual)

    try:
        ranks.run(stack)  # eager warm-up: loads every kernel before capture
        torch.cuda.synchronize()
        graphs = [torch.cuda.CUDAGraph() for _ in range(world_size)]
        for rank, ws in enumerate(ranks.workspaces):
            with torch.cuda.graph(graphs[rank], stream=ranks.streams[rank]):
                stack(rank, ws)
        for step in range(5):
            g = torch.Generator(device="cuda").manual_seed(100 + step)
            static_in.copy_(torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16())
            ranks.run(lambda rank, ws: graphs[rank].replay())
            torch.cuda.synchronize()
            ranks.check_errors()
            want_h, want_residual = reference_stack(static_in.clone(), layers)
            for rank in range(world_size):
                h, residual = outputs[rank]
                torch.testing.assert_close(residual, want_residual, rtol=3e-2, atol=3e-2)
                torch.testing.assert_close(h, want_h, rtol=3e-2, atol=3e-2)
            # Every rank holds the same hidden states, as tensor parallelism needs.
            assert all(torch.equal(outputs[0][0], outputs[r][0]) for r in range(world_size))
    finally:
        ranks.close()
