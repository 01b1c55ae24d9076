"""Float32 references and an in-process rank runner, shared by the tests and the benchmark."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from .workspace import CommWorkspace

T = TypeVar("T")

# Tolerances against the float32 reference: one rounding of the result to the 16-bit type
# (two for the fused two-shot path, which rounds the reduced sum before the add).
TOLERANCES = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}


def reference_all_reduce(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of all ranks' inputs in float32."""
    total = torch.zeros_like(inputs[0], dtype=torch.float32)
    for x in inputs:
        total += x.float()
    return total


def reference_fused(
    inputs: Sequence[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm_out, residual_out) in float32: sum, then add residual, then RMSNorm * weight."""
    summed = reference_all_reduce(inputs) + residual.float()
    scale = torch.rsqrt(summed.pow(2).mean(dim=-1, keepdim=True) + eps)
    return summed * scale * weight.float(), summed


def max_violation(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> torch.Tensor:
    """max(|actual - expected| - rtol |expected|) as a 0-d tensor; <= atol means close.
    Stays on the GPU so that graph-replay loops need no host synchronisation."""
    return ((actual.float() - expected).abs() - rtol * expected.abs()).amax()


def rank_inputs(
    world_size: int, tokens: int, hidden: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Every rank's input, a residual and a norm weight near 1, drawn on the GPU from `seed`:
    the same tensors in every process that asks with the same seed (one rank per process)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda")

    xs = [randn(tokens, hidden).to(dtype) for _ in range(world_size)]
    residual = randn(tokens, hidden).to(dtype)
    weight = (1.0 + 0.1 * randn(hidden)).to(dtype)
    return xs, residual, weight


class LocalRanks:
    """Runs one closure per rank, each on its own stream, for `create_local` workspaces.

    All ranks' kernels must run at the same time (they wait for each other), hence one stream
    per rank; `run` orders the streams after the current stream and the current stream after
    them, so inputs made before and results read after need no extra synchronisation.

    Nothing may wait for the GPU between the first and the last rank's launch: loading a CUDA
    module does (it waits for running kernels), so set CUDA_MODULE_LOADING=EAGER before CUDA
    starts and run JIT kernels (Triton, Inductor) once before they go between rank launches.
    """

    def __init__(self, workspaces: Sequence[CommWorkspace]) -> None:
        if os.environ.get("CUDA_MODULE_LOADING", "").upper() != "EAGER":
            warnings.warn(
                "LocalRanks without CUDA_MODULE_LOADING=EAGER: a kernel loaded lazily between "
                "two ranks' launches deadlocks them until the timeout",
                stacklevel=2,
            )
        self.workspaces = list(workspaces)
        self.device = self.workspaces[0].device
        self.streams = [torch.cuda.Stream(self.device) for _ in self.workspaces]

    @property
    def world_size(self) -> int:
        return len(self.workspaces)

    def run(self, fn: Callable[[int, CommWorkspace], T]) -> list[T]:
        current = torch.cuda.current_stream(self.device)
        for stream in self.streams:
            stream.wait_stream(current)
        results = []
        for rank, (ws, stream) in enumerate(zip(self.workspaces, self.streams, strict=True)):
            with torch.cuda.stream(stream):
                results.append(fn(rank, ws))
        for stream in self.streams:
            current.wait_stream(stream)
        return results

    def check_errors(self) -> None:
        for ws in self.workspaces:
            ws.check_error()

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        for ws in self.workspaces:
            ws.close()
