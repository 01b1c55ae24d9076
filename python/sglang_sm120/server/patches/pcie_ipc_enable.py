"""Patch: upstream's PCIe-IPC all-reduce is on by default where the plan says it helps.

Why: SGLang's FlashInfer PCIe-IPC all-reduce (staged push kernels, ~5-15 us vs ~205 us NCCL for
    verify-sized messages on 8x SM120) is opt-in through SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1,
    so a default launch on a PCIe-only SM120 host spends most of each EAGLE-3 verify in NCCL.
How: AROUND hook on ``pcie_ipc_ar.eligible_group``, which stays a pure function of its
    arguments and the environment: it reads the launcher's plan (``runtime.worker_plan``), never
    the runtime context. For the TP group of the planned size: PCIe-IPC on in the plan (the plain
    all-reduce, or behind sgl-kernel-sm120 for the sizes its tuning table routes to PCIe-IPC)
    and the variable unset -> the original runs with the variable set for that call (upstream
    still applies its own group-name, world-size and determinism rules); the user set it on
    on a host the plan refuses (no P2P, multi-node, non-bf16) -> False, said once; set, the
    original runs with the value the plan read (``runtime.env_switch``: "on" or " 1" mean what
    they mean to the plan, whatever upstream's own parser makes of them). Other groups and
    no plan from the launcher go to the original unchanged.
Upstream: none filed; the backend is opt-in by design upstream.
Removal: when upstream enables PCIe-IPC by topology detection.
"""

from __future__ import annotations

import logging
import os

from sglang.srt.plugins.hook_registry import HookType

from sglang_sm120.env_values import shown
from sglang_sm120.planning.policy import AllReducePlan, Capability
from sglang_sm120.server.contract import Symbol
from sglang_sm120.server.runtime import (
    PCIE_IPC_ENV,
    log_once,
    pcie_ipc_env,
    worker_plan,
    worker_tp_size,
)

TARGET = "sglang.srt.distributed.device_communicators.pcie_ipc_ar.eligible_group"
CONTRACT = (
    Symbol(
        TARGET,
        "function",
        params=("group_name", "world_size", "deterministic"),
        reads=("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE",),
    ),
    Symbol("sglang.srt.environ.envs", "attribute"),
)
ROLES = ("scheduler",)


def not_needed(cap: Capability) -> str | None:
    return None if cap.sm12x else cap.reasons[0]


def plain_reason(plan: AllReducePlan) -> str:
    """The plan's reason for its plain all-reduce (a table plan has more reasons after it)."""
    return next((r for r in plan.reasons if r.startswith("plain all-reduce")), plan.reasons[-1])


def eligible_by_plan(original, *, group_name, world_size: int, deterministic: bool) -> bool:
    call = dict(group_name=group_name, world_size=world_size, deterministic=deterministic)
    plan = worker_plan()
    if group_name != "tp" or plan is None or not plan.managed or world_size != worker_tp_size():
        return original(**call)
    user_choice = pcie_ipc_env()
    if user_choice and not plan.pcie_ipc_on:
        log_once(
            logging.WARNING,
            f"sglang-sm120: {PCIE_IPC_ENV}={shown(os.environ[PCIE_IPC_ENV])} refused: "
            f"{plain_reason(plan)}",
        )
        return False
    from sglang.srt.environ import envs

    # Upstream reads the variable with its own spelling rules; it gets the value the plan read.
    choice = plan.pcie_ipc_on if user_choice is None else user_choice
    with envs.SGLANG_ENABLE_PCIE_IPC_ALLREDUCE.override(choice):
        return original(**call)


HOOKS = ((TARGET, eligible_by_plan, HookType.AROUND),)
