"""Loading the plugin as a guest of SGLang's plugin loader.

SGLang's ``load_plugins()`` runs every plugin's ``register()`` and then applies all registered
hooks once (``HookRegistry.apply_hooks``), so two plugins hooking one target compose into one
chain. ``register()`` therefore only *registers*: it never applies hooks itself. What was really
applied is checked afterwards by ``verify_applied()``, which walks each target's applied chain
(the registry's wrappers, down ``__wrapped__``) looking for our hook functions; the
``status_line`` patch calls it right after SGLang configures logging, which is after
``apply_hooks``.

Each process registers only what runs in it (``runtime.process_role``): the launcher the
server-args pass, an Engine process that pass and its scheduler spawn, the DP controller its
scheduler spawn, a scheduler process the worker-side seams, the detokenizer nothing (a child
that loads plugins while multiprocessing is still starting it: a scheduler's and a DP
controller's). Resolving a
hook target imports its module, and the worker modules cost seconds to import.

Order of refusals (first match wins; recorded as the patch status, WARNING/ERROR logged once):
``SGLANG_SM120_DISABLE=1`` -> not used in this process -> not needed on this hardware -> sglang
version is not the pinned one -> a contract symbol does not match. ``register()`` never raises.
"""

from __future__ import annotations

import logging
from importlib import metadata
from typing import Any

from sglang_sm120 import SGLANG_PIN, __version__
from sglang_sm120.contract import Symbol, check, resolve
from sglang_sm120.runtime import (
    BOOTSTRAPPING,
    BOOTSTRAPPING_ROLES,
    DISABLE_ENV,
    PATCH_STATUS,
    SPAWNER_ROLES,
    log_once,
    logger,
    plugin_disabled,
    process_role,
    sm12x_capability,
    withdraw_launch_plan,
    worker_capability,
)
from sglang_sm120.topology import TopologyError

_WRAPPER_HOOK_NAME = "hook"  # the closure variable of the registry's wrappers holding the hook
_REGISTRY_CONTRACT = (
    Symbol(
        "sglang.srt.plugins.hook_registry.HookRegistry.register",
        "function",
        params=("target", "hook", "hook_type", "source"),
    ),
    Symbol(
        "sglang.srt.plugins.hook_registry._wrap_fn",
        "function",
        params=("original_fn", "hook", "hook_type"),
    ),
)
ROLE_NAMES = {
    "launcher": "launcher",
    "engine": "Engine",
    "dp_controller": "DP controller",
    "scheduler": "TP worker",
    "detokenizer": "detokenizer",
    BOOTSTRAPPING: "child multiprocessing was still starting",
}


def declared_contract(modules) -> tuple[Symbol, ...]:
    """Every upstream symbol ``modules`` touch, plus the registry pieces the loader relies on."""
    return tuple(s for m in modules for s in m.CONTRACT) + _REGISTRY_CONTRACT


def _record(status: str, modules=None) -> None:
    """Give ``modules`` (default: every patch) the same status."""
    from sglang_sm120.patches import PATCHES, patch_name

    for module in PATCHES if modules is None else modules:
        PATCH_STATUS[patch_name(module)] = status


def _capability_for(role: str):
    """A worker: the TP group's GPUs as the launcher saw them. The launcher: the visible SM12x
    GPUs (a host may also hold other cards; the plan decides on the TP group's own GPUs)."""
    return worker_capability() if role in ("scheduler", BOOTSTRAPPING) else sm12x_capability()


def register_patches(role: str) -> dict[str, str]:
    """Register the hooks ``role`` needs with SGLang's registry; returns (and records) every
    patch's status. Hooks are applied by SGLang's loader, not here."""
    from sglang_sm120.patches import PATCHES, patch_name

    if role in SPAWNER_ROLES:  # it publishes its own plan; one it inherited is another launch's
        withdraw_launch_plan()
    if plugin_disabled():
        _record(f"disabled ({DISABLE_ENV}=1)")
        return dict(PATCH_STATUS)
    cap = _capability_for(role)
    serves = BOOTSTRAPPING_ROLES if role == BOOTSTRAPPING else (role,)
    needed = []
    for module in PATCHES:  # in ledger order, which doctor keeps
        name = patch_name(module)
        if not set(serves) & set(module.ROLES):
            PATCH_STATUS[name] = f"not used in the {ROLE_NAMES[role]}"
            continue
        reason = module.not_needed(cap)
        PATCH_STATUS[name] = "registered" if reason is None else f"not needed ({reason})"
        if reason is None:
            needed.append(module)
    if not needed:
        return dict(PATCH_STATUS)
    installed = metadata.version("sglang")
    if installed != SGLANG_PIN:
        reason = (
            f"sglang {installed} installed, sglang-sm120 {__version__} supports {SGLANG_PIN} only"
        )
        log_once(logging.ERROR, f"sglang-sm120: applying nothing: {reason}")
        _record(f"refused ({reason})", needed)
        return dict(PATCH_STATUS)
    from sglang.srt.plugins.hook_registry import HookRegistry

    problems = check(declared_contract(needed))
    if problems:
        reason = f"upstream contract mismatch with sglang {installed}: {problems[0]}"
        log_once(
            logging.ERROR, f"sglang-sm120 {__version__}: applying nothing: " + "; ".join(problems)
        )
        _record(f"refused ({reason})", needed)
        return dict(PATCH_STATUS)
    for module in needed:
        for target, hook, hook_type in module.HOOKS:
            HookRegistry.register(target, hook, hook_type)
        if hasattr(module, "apply_setting"):
            module.apply_setting()
    return dict(PATCH_STATUS)


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
    returns (and records) every patch's status."""
    from sglang_sm120.patches import PATCHES, patch_name

    for module in PATCHES:
        name = patch_name(module)
        if PATCH_STATUS.get(name) != "registered":
            continue
        problem = _missing_effect(module)
        PATCH_STATUS[name] = "applied" if problem is None else f"refused ({problem})"
        if problem is not None:
            log_once(logging.ERROR, f"sglang-sm120: patch {name} not in effect: {problem}")
    return dict(PATCH_STATUS)


def status_line(role: str) -> str:
    """The one line per process that says what the plugin does here."""
    cap = _capability_for(role)
    summary = ", ".join(f"{name}={status}" for name, status in PATCH_STATUS.items())
    return (
        f"sglang-sm120 {__version__} ({ROLE_NAMES[role]}): {'; '.join(cap.reasons)}; "
        f"patches: {summary}"
    )


def register() -> None:
    """The ``sglang.srt.plugins`` entry point. Never raises."""
    try:
        register_patches(process_role())
    except TopologyError as exc:  # a bad SGLANG_SM120_TOPOLOGY: one clear line, no traceback
        logger.error("sglang-sm120: applying nothing: %s", exc)
        _record(f"refused ({exc})")
    except Exception:
        logger.exception("sglang-sm120: plugin failed to load; SGLang runs unpatched")
        _record("refused (plugin error; see the log)")
