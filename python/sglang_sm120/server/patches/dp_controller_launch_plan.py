"""Patch: the DP controller hands the schedulers it spawns its own plan.

Why: with ``--dp`` the launcher spawns the DP controller, which spawns every TP group's
    schedulers; they inherit its environment, and a ``SGLANG_SM120_LAUNCH_PLAN`` it inherited
    itself need not be its launch's. SGLang has no hook for "about to spawn schedulers".
How: BEFORE hook on ``DataParallelController.__init__``, which spawns them: plan afresh from
    the server args it was handed and publish it (``runtime.publish_for_schedulers``: what the
    user asked for is kept on the resolved record).
Upstream: none; upstream has no plugin hook around spawning schedulers.
Removal: when SGLang hands plugins per-launch state for its child processes.
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType

from sglang_sm120.planning.policy import Capability
from sglang_sm120.server import runtime
from sglang_sm120.server.contract import Symbol

TARGET = "sglang.srt.managers.data_parallel_controller.DataParallelController.__init__"
ROLES = ("dp_controller",)
CONTRACT = (
    Symbol(
        TARGET,
        "function",
        params=(
            "self",
            "server_args",
            "port_args",
            "run_scheduler_process_func",
            "prelaunched_schedulers",
        ),
    ),
    Symbol("sglang.srt.arg_groups.overrides.resolution_result", "function"),
    Symbol("sglang.srt.arg_groups.model_override_base.ResolvedView", "function"),
)


def not_needed(cap: Capability) -> str | None:
    return None if cap.sm12x else cap.reasons[0]


def plan_before_spawning_schedulers(
    self, server_args, port_args, run_scheduler_process_func, *args, **kwargs
) -> None:
    runtime.publish_for_schedulers(server_args, run_scheduler_process_func)


HOOKS = ((TARGET, plan_before_spawning_schedulers, HookType.BEFORE),)
