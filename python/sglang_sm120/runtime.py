"""Glue between a running sglang process and the policy: build ``Deployment`` from what sglang
resolved, compute the plan, record patch statuses, and log each decision once per process.

Patches call ``plan_for_view`` (launcher, while server args resolve) or ``plan_for_runtime``
(scheduler/TP workers, after the runtime context is published); they never decide themselves.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any

from sglang_sm120.facts import current_facts
from sglang_sm120.policy import (
    PLUGIN_BACKEND_CHOICES,
    PLUGIN_BACKEND_ENV,
    AllReducePlan,
    Capability,
    Deployment,
    hardware_capability,
    plan_allreduce,
)
from sglang_sm120.tuning import load_table

logger = logging.getLogger("sglang_sm120")

PCIE_IPC_ENV = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"

#: patch name -> "applied" | "not needed (...)" | "refused (...)" | "disabled (...)"
PATCH_STATUS: dict[str, str] = {}
_logged: set[str] = set()
_last_plan: list[AllReducePlan] = []


def log_once(level: int, message: str) -> None:
    """Log ``message`` the first time this process sees it."""
    if message not in _logged:
        _logged.add(message)
        logger.log(level, message)


@functools.cache
def load_capability() -> Capability:
    """What every visible GPU allows (tp size not yet known when the plugin loads)."""
    return hardware_capability(current_facts())


def fusion_archs() -> frozenset[str]:
    """Upstream's own list of architectures with a fused all-reduce path."""
    from sglang.srt.arg_groups.overrides import _FLASHINFER_ALLREDUCE_FUSION_ARCHS

    return _FLASHINFER_ALLREDUCE_FUSION_ARCHS


def pcie_ipc_env() -> bool | None:
    """The user's explicit SGLANG_ENABLE_PCIE_IPC_ALLREDUCE, or None when unset."""
    raw = os.environ.get(PCIE_IPC_ENV)
    if raw is None:
        return None
    return raw.strip().lower() in ("1", "true", "yes", "on")


def plugin_backend() -> str | None:
    """SGLANG_SM120_FUSION_BACKEND, or None when unset, "auto" or invalid (said once)."""
    raw = os.environ.get(PLUGIN_BACKEND_ENV, "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw not in PLUGIN_BACKEND_CHOICES:
        log_once(
            logging.WARNING,
            f"sglang-sm120: {PLUGIN_BACKEND_ENV}={raw!r} ignored; "
            f"choose one of {', '.join(PLUGIN_BACKEND_CHOICES)}",
        )
        return None
    return raw


def with_tuning(deployment: Deployment, hidden: int | None, dtype: str | None) -> Deployment:
    """The deployment plus this host's tuning table for its shape, if there is a fresh one."""
    if hidden is None or dtype is None or deployment.tp_size <= 1:
        return deployment
    table, note = load_table(current_facts(), deployment.tp_size, hidden, dtype)
    return dataclasses.replace(deployment, tuning=table, tuning_note=note)


def deployment_from_view(view: Any) -> Deployment:
    """Read a Deployment from sglang's resolution view (launcher / Engine process)."""
    from sglang.srt.arg_groups.model_override_base import model_config_of
    from sglang.srt.runtime_context import attn_dp_enabled_of

    model_config = model_config_of(view)
    dtype = str(model_config.dtype).removeprefix("torch.")
    deployment = Deployment(
        tp_size=view.tp_size,
        nnodes=view.nnodes,
        attention_dp=attn_dp_enabled_of(view),
        moe_a2a_backend=view.moe_a2a_backend,
        model_arch=model_config.hf_config.architectures[0],
        dtype=dtype,
        fusion_backend_flag=view.flashinfer_allreduce_fusion_backend,
        enforce_disable_fusion=bool(view.enforce_disable_flashinfer_allreduce_fusion),
        pcie_ipc_env=pcie_ipc_env(),
        deterministic=bool(view.enable_deterministic_inference),
        plugin_backend=plugin_backend(),
    )
    return with_tuning(deployment, model_config.hidden_size, dtype)


def deployment_from_runtime(
    *, deterministic: bool | None = None, hidden: int | None = None, dtype: str | None = None
) -> Deployment:
    """Read a Deployment from the published runtime context (scheduler / TP worker process).

    Only the fields the worker-side patches need are filled: the fusion backend has already
    been resolved in the launcher, so model architecture and dtype stay unknown here.
    """
    from sglang.srt.environ import envs
    from sglang.srt.runtime_context import get_exec, get_parallel

    parallel = get_parallel()
    if deterministic is None:
        deterministic = bool(envs.SGLANG_ENABLE_DETERMINISTIC_INFERENCE.get())
    deployment = Deployment(
        tp_size=parallel.tp_size,
        nnodes=parallel.nnodes,
        dtype=None,
        fusion_backend_flag=get_exec().comm.flashinfer_allreduce_fusion_backend,
        pcie_ipc_env=pcie_ipc_env(),
        deterministic=deterministic,
        plugin_backend=plugin_backend(),
    )
    return with_tuning(deployment, hidden, dtype)


def plan_for(deployment: Deployment, where: str) -> AllReducePlan:
    """Plan with this process's facts and log it once."""
    plan = plan_allreduce(current_facts(), deployment, fusion_archs())
    _last_plan[:] = [plan]
    if plan.managed:
        log_once(
            logging.INFO, f"sglang-sm120 plan ({where}, tp={deployment.tp_size}): {plan.summary()}"
        )
    return plan


def last_plan() -> AllReducePlan | None:
    """The most recent plan this process computed (for reports), or None."""
    return _last_plan[0] if _last_plan else None


def plan_for_view(view: Any) -> AllReducePlan:
    return plan_for(deployment_from_view(view), "server args")


@functools.cache
def plan_for_runtime(
    *, deterministic: bool | None = None, hidden: int | None = None, dtype: str | None = None
) -> AllReducePlan:
    """The worker's plan; cached, since the fused-point hooks ask on every eager call."""
    deployment = deployment_from_runtime(deterministic=deterministic, hidden=hidden, dtype=dtype)
    return plan_for(deployment, "worker")
