"""A recording CPU stand-in for sgl-kernel-sm120, for rehearsing SGLang's call sites on CPU.

It replaces only our kernel library (``sm120_pcie_backend.KERNEL``); SGLang stays real. What the
plugin asks of the library it records: the collective workspace build (done for real over the
group's gloo ProcessGroup, so every rank must take part, as with the kernel), and each
all-reduce / fused all-reduce + residual + RMSNorm call. The input checks are the kernel
package's own pure-Python validators; the sizing mirrors its rule (max_tokens x hidden x
element size).

The rehearsal's activations are ``meta`` tensors: ``GroupCoordinator.all_reduce`` hands CPU
tensors to gloo before any routing, so a workspace here serves the ``meta`` device and keeps
the device the plugin asked for in ``requested_device``. A peer timeout is injected with
``RecordingWorkspace.fail``; ``error()`` / ``check_error()`` then answer as the kernel's do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from sgl_kernel_sm120 import (
    CommTimeoutError,
    InputTooLargeError,
    WorkspaceError,
    config,
    validate_all_reduce,
    validate_fused,
)

__all__ = [
    "CALLS",
    "CommTimeoutError",
    "CommWorkspace",
    "InputTooLargeError",
    "WorkspaceError",
    "all_reduce",
    "fused_allreduce_add_rmsnorm",
    "validate_all_reduce",
    "validate_fused",
]

#: every call the plugin made into this library, in order
CALLS: list[dict[str, Any]] = []
DEVICE = torch.device("meta")


class RecordingWorkspace:
    """One rank's workspace: the fields the plugin reads, and an injectable peer timeout."""

    def __init__(
        self, group: Any, world_size: int, max_tokens: int, hidden: int, dtype, device
    ) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = world_size
        self.max_tokens = max_tokens
        self.hidden = hidden
        self.max_bytes = max_tokens * hidden * torch.empty((), dtype=dtype).element_size()
        self.device = DEVICE
        self.requested_device = torch.device(device)
        self.tuning = config.resolve_tuning(world_size)  # the kernel's own settings rule
        self._error: str | None = None

    def fail(self, message: str) -> None:
        """What the kernel records in host memory when a peer never arrives."""
        self._error = message

    def error(self) -> str | None:
        return self._error

    def check_error(self) -> None:
        if self._error is not None:
            raise CommTimeoutError(self._error)


class CommWorkspace:
    @staticmethod
    def create(
        group: Any,
        max_tokens: int,
        hidden: int,
        dtype: torch.dtype = torch.bfloat16,
        device: Any = None,
        *,
        timeout_ms: int | None = None,
        **_: Any,
    ) -> RecordingWorkspace:
        """Collective over ``group`` like the kernel's: every rank contributes its rank."""
        ranks = [None] * dist.get_world_size(group)
        dist.all_gather_object(ranks, dist.get_rank(), group=group)
        ws = RecordingWorkspace(group, len(ranks), max_tokens, hidden, dtype, device)
        CALLS.append(
            {
                "call": "create",
                "group_ranks": ranks,
                "max_tokens": max_tokens,
                "hidden": hidden,
                "dtype": str(dtype),
                "device": str(ws.requested_device),
                "timeout_ms": timeout_ms,
            }
        )
        return ws


def all_reduce(inp: torch.Tensor, ws: RecordingWorkspace, *, variant: str | None = None):
    validate_all_reduce(inp, device=ws.device, max_bytes=ws.max_bytes)
    CALLS.append({"call": "all_reduce", "shape": list(inp.shape)})
    return torch.empty_like(inp)


def fused_allreduce_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    ws: RecordingWorkspace,
    *,
    variant: str | None = None,
):
    validate_fused(x, residual, weight, device=ws.device, max_bytes=ws.max_bytes)
    CALLS.append({"call": "fused", "shape": list(x.shape), "eps": eps})
    return torch.empty_like(x), torch.empty_like(residual)
