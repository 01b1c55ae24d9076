"""Patch: plain all-reduces use PCIe-IPC, not the fused backend's all-to-all kernel.

Why: with a FlashInfer fusion backend on, ``bootstrap._set_all_reduce_flags`` calls
    ``set_flashinfer_allreduce_only(True)``; the TP groups are then tagged and
    ``GroupCoordinator.all_reduce`` sends every plain all-reduce to the TRT-LLM Lamport
    all-to-all kernel before custom all-reduce and PCIe-IPC are even considered. Over PCIe that
    kernel collapses as concurrent writers grow (TP4/TP8), while PCIe-IPC stages its pushes.
How: BEFORE hook: when the launcher's plan says plain all-reduces use ``pcie_ipc``, the flag
    is passed as False, so groups are not tagged and plain reductions follow upstream's normal
    order (custom AR -> PCIe-IPC -> NCCL). The fused points (all-reduce + residual + RMSNorm)
    still use the fused backend; they do not go through this flag.
Upstream: none filed; precedence is upstream's deliberate default for NVLink hosts.
Removal: when upstream orders PCIe-IPC ahead of the fused backend's plain all-reduce on PCIe.
"""

from __future__ import annotations

import logging

from sglang.srt.plugins.hook_registry import HookType

from sglang_sm120.planning.policy import Capability
from sglang_sm120.server.contract import Symbol
from sglang_sm120.server.runtime import log_once, worker_plan

TARGET = "sglang.srt.distributed.parallel_state.set_flashinfer_allreduce_only"
CONTRACT = (
    Symbol(TARGET, "function", params=("enable",)),
    Symbol(
        "sglang.srt.distributed.parallel_state._tag_groups_for_flashinfer_allreduce_only",
        "function",
        params=(),
        reads=("_ENABLE_FLASHINFER_ALLREDUCE_ONLY",),
    ),
)
ROLES = ("scheduler",)


def not_needed(cap: Capability) -> str | None:
    return None if cap.pcie_ipc_capable else cap.reasons[0]


def keep_plain_allreduce_on_pcie_ipc(*args, **kwargs):
    enable = kwargs.get("enable", args[0] if args else False)
    plan = worker_plan()
    if not enable or plan is None or plan.plain_allreduce != "pcie_ipc":
        return None
    log_once(
        logging.INFO,
        "sglang-sm120: plain all-reduces stay on PCIe-IPC; the fused backend "
        "serves only the all-reduce + residual + RMSNorm points",
    )
    return (), {"enable": False}


HOOKS = ((TARGET, keep_plain_allreduce_on_pcie_ipc, HookType.BEFORE),)
