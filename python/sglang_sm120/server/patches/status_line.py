"""Patch: one log line per process says what the plugin does there.

Why: ``load_plugins()`` runs before SGLang configures logging, in the launcher and in every
    scheduler process alike, so an INFO line logged while registering goes nowhere and the
    user cannot see which patches are in force.
How: AFTER hook on ``configure_logger`` (SGLang calls it once it knows the log level and the
    process's prefix, e.g. `` TP0``, which is after ``load_plugins()`` applied every plugin's
    hooks). It checks that each registered patch is really in its target's applied chain
    (``status.verify_applied``), logs the status line (facts, every patch's status) and then the
    INFO lines that waited, the plan among them.
Upstream: none; upstream has no hook for "logging is ready".
Removal: when SGLang's plugin loader reports plugin statuses itself.
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType

from sglang_sm120.planning.policy import Capability
from sglang_sm120.server import status
from sglang_sm120.server.contract import Symbol

TARGET = "sglang.srt.utils.common.configure_logger"
CONTRACT = (Symbol(TARGET, "function", params=("server_args", "prefix")),)
ROLES = ("launcher", "engine", "dp_controller", "scheduler")


def not_needed(cap: Capability) -> str | None:
    return None if cap.sm12x else cap.reasons[0]  # elsewhere nothing is planned or patched


def announce_after_logging_setup(result, *args, **kwargs) -> None:
    status.announce()


HOOKS = ((TARGET, announce_after_logging_setup, HookType.AFTER),)
