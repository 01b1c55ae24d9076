"""Patch: the trtllm workspace preflight does not require multicast.

Why: before creating the fusion workspace, ``_preflight_check_workspace_memory`` sizes each
    buffer with ``_flashinfer_trtllm_workspace_allocation_sizes``, which also queries
    ``cuMulticastGetGranularity``. A PCIe host without multicast fails that query, the vote
    says SKIP and fusion is silently disabled, although the trtllm workspace uses plain IPC
    buffers and no multicast object.
How: AROUND hook. On SM12x hosts the sizing function receives a view of the CUDA driver whose
    multicast granularity is 1 (no rounding), so the probe allocates the unicast sizes and the
    cross-rank vote still runs. Every other driver call is the real one.
Upstream: none filed yet; the preflight came with sglang 0.5.2x's workspace probing.
Removal: when upstream skips the multicast query for backends that use no multicast.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from sglang_sm120.planning.policy import Capability
from sglang_sm120.server.contract import Symbol
from sglang_sm120.server.runtime import worker_capability

TARGET = "sglang.srt.layers.flashinfer_comm_fusion._flashinfer_trtllm_workspace_allocation_sizes"
CONTRACT = (
    Symbol(
        TARGET,
        "function",
        params=("cuda_driver", "prop", "world_size", "max_token_num", "hidden_dim", "dtype"),
        reads=("cuMulticastGetGranularity",),
    ),
)
ROLES = ("scheduler",)


def not_needed(cap: Capability) -> str | None:
    return None if cap.fusion_capable else cap.reasons[0]


class UnicastDriver:
    """The CUDA driver bindings, except that multicast granularity is 1 (no rounding)."""

    def __init__(self, driver: Any) -> None:
        self._driver = driver

    def __getattr__(self, name: str) -> Any:
        return getattr(self._driver, name)

    def cuMulticastGetGranularity(self, prop: Any, flags: Any) -> tuple[Any, int]:
        return self._driver.CUresult.CUDA_SUCCESS, 1


def size_without_multicast(
    original, cuda_driver, prop, world_size, max_token_num, hidden_dim, dtype
):
    if worker_capability().fusion_capable:
        cuda_driver = UnicastDriver(cuda_driver)
    return original(cuda_driver, prop, world_size, max_token_num, hidden_dim, dtype)


HOOKS = ((TARGET, size_without_multicast, HookType.AROUND),)
