"""What the plugin reports about itself in a process: the status line, and the check of what
SGLang really applied.

``plugin.register_patches`` registers hooks and records each module it registered in
``REGISTERED``; SGLang's loader applies them; ``verify_applied`` then walks each target's
applied chain (the registry's wrappers, down ``__wrapped__``) looking for our hook functions.
The ``status_line`` patch (and ``engine_launch_plan``, where plugins load after logging is set
up) calls ``announce`` once logging is ready. This module imports no patch and not the loader,
so both can import it.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_sm120.planning.policy import Capability
from sglang_sm120.server import runtime
from sglang_sm120.server.contract import resolve
from sglang_sm120.server.runtime import (
    BOOTSTRAPPING,
    PATCH_STATUS,
    log_once,
    sm12x_capability,
    worker_capability,
)
from sglang_sm120.version import __version__

ROLE_NAMES = {
    "launcher": "launcher",
    "engine": "Engine",
    "dp_controller": "DP controller",
    "scheduler": "TP worker",
    "detokenizer": "detokenizer",
    BOOTSTRAPPING: "child multiprocessing was still starting",
}
# Patch name -> module, for every patch registered in this process (filled by the loader).
REGISTERED: dict[str, Any] = {}
_WRAPPER_HOOK_NAME = "hook"  # the closure variable of the registry's wrappers holding the hook


def capability_for(role: str) -> Capability:
    """A worker: the TP group's GPUs as the launcher saw them. The launcher: the visible SM12x
    GPUs (a host may also hold other cards; the plan decides on the TP group's own GPUs)."""
    return worker_capability() if role in ("scheduler", BOOTSTRAPPING) else sm12x_capability()


def applied_hooks(target: str) -> list[Any]:
    """The hook functions in ``target``'s applied chain, outermost first."""
    hooks, fn, seen = [], resolve(target), set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        code = getattr(fn, "__code__", None)
        if code is not None and _WRAPPER_HOOK_NAME in code.co_freevars and fn.__closure__:
            hooks.append(fn.__closure__[code.co_freevars.index(_WRAPPER_HOOK_NAME)].cell_contents)
        fn = getattr(fn, "__wrapped__", None)
    return hooks


def _missing_effect(module) -> str | None:
    """Why ``module`` is not in effect, or None when every hook of it is in its target's chain,
    every copy SGLang calls is the patched object, and its setting holds."""
    for target, hook, _ in module.HOOKS:
        if hook not in applied_hooks(target):
            return f"{hook.__name__} is not in the applied chain of {target}"
    for target, copies in getattr(module, "COPIES", {}).items():
        for copy in copies:
            if resolve(copy) is not resolve(target):
                return f"{copy} still holds the unpatched {target}"
    if hasattr(module, "is_applied") and not module.is_applied():
        return "its setting did not take effect"
    return None


def verify_applied() -> dict[str, str]:
    """Check, after SGLang applied the registered hooks, that each registered patch is in effect;
    returns (and records) every patch's status. A patch whose effect only its hook can see
    (``pending()``: what it waits for) is ``pending (...)`` until that hook records it."""
    for name, module in REGISTERED.items():
        if PATCH_STATUS.get(name) != "registered":
            continue
        problem = _missing_effect(module)
        waiting = getattr(module, "pending", lambda: None)() if problem is None else None
        if waiting is not None:  # its hook decides, when its target runs (it records then)
            PATCH_STATUS[name] = f"pending ({waiting})"
            continue
        PATCH_STATUS[name] = "applied" if problem is None else f"refused ({problem})"
        if problem is not None:
            log_once(logging.ERROR, f"sglang-sm120: patch {name} not in effect: {problem}")
    return dict(PATCH_STATUS)


def applies_nothing(statuses: dict[str, str]) -> str | None:
    """Why the plugin applies nothing at all, read from the patches' statuses (doctor's merged
    view of the launcher and a TP worker), or None where a patch is applied or none is needed.
    Then the plan is not in force: upstream decides (``policy.upstream_decides``)."""
    if any(status == "applied" for status in statuses.values()):
        return None
    for status in statuses.values():
        if status.startswith(("refused (", "disabled (")) and status.endswith(")"):
            why = status[status.index("(") + 1 : -1]
            return f"the kill switch {why} is on" if status.startswith("disabled") else why
        if status == "plugin not loaded":
            return "the plugin is not loaded (SGLANG_PLUGINS must include sglang_sm120)"
    return None


def status_line(role: str) -> str:
    """The one line per process that says what the plugin does here."""
    cap = capability_for(role)
    summary = ", ".join(f"{name}={status}" for name, status in PATCH_STATUS.items())
    nccl = runtime.nccl_env_line()
    return (
        f"sglang-sm120 {__version__} ({ROLE_NAMES[role]}): {'; '.join(cap.reasons)}; "
        f"patches: {summary}" + (f"; {nccl}" if nccl else "")
    )


def announce() -> None:
    """Check the registered patches, log the status line and what waited for logging."""
    try:
        role = runtime.process_role()
        verify_applied()
        runtime.logging_configured(first=status_line(role))
        if role == "scheduler":
            runtime.worker_plan()  # logs the plan this worker follows, if the launcher sent one
    except Exception:  # a report must never stop SGLang's start-up
        runtime.logger.exception("sglang-sm120: could not report the plugin's status")
