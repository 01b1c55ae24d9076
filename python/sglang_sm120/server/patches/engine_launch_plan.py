"""Patch: an Engine process hands the schedulers it spawns its own plan.

Why: SGLang has no hook for "about to spawn schedulers", and a scheduler inherits its parent's
    environment: a process that runs SGLang's engine in-process (``sglang.Engine``, or
    ``http_server.launch_server`` called directly) would pass on a ``SGLANG_SM120_LAUNCH_PLAN``
    it inherited from another launch. ``http_server.launch_server`` loads plugins only after it
    resolved the server args, so no plan is made while resolving there.
How: BEFORE hook on ``Engine._launch_scheduler_processes`` (also where the DP controller is
    spawned): plan afresh from the server args the schedulers get and publish it, or publish
    nothing when those server args were resolved without the plugin
    (``runtime.publish_for_schedulers``).
    Where plugins loaded after SGLang configured logging, the status line is logged here.
Upstream: none; upstream has no plugin hook around spawning schedulers.
Removal: when SGLang hands plugins per-launch state for its child processes.
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType

from sglang_sm120.planning.policy import Capability
from sglang_sm120.server import runtime, status
from sglang_sm120.server.contract import Symbol

TARGET = "sglang.srt.entrypoints.engine.Engine._launch_scheduler_processes"
ROLES = ("engine",)
CONTRACT = (
    Symbol(
        TARGET,
        "function",
        params=("server_args", "port_args", "run_scheduler_process_func", "placement_group"),
    ),
    Symbol("sglang.srt.arg_groups.overrides.resolution_result", "function"),
    Symbol("sglang.srt.arg_groups.model_override_base.ResolvedView", "function"),
)


def not_needed(cap: Capability) -> str | None:
    return None if cap.sm12x else cap.reasons[0]


def plan_before_spawning_schedulers(
    cls, server_args, port_args, run_scheduler_process_func, *args, **kwargs
) -> None:
    if not runtime.logging_ready():
        status.announce()  # plugins loaded after SGLang configured this process's logging
    runtime.publish_for_schedulers(server_args, run_scheduler_process_func)


HOOKS = ((TARGET, plan_before_spawning_schedulers, HookType.BEFORE),)
