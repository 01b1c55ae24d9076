"""Loading the plugin as a guest of SGLang's plugin loader.

SGLang's ``load_plugins()`` runs every plugin's ``register()`` and then applies all registered
hooks once (``HookRegistry.apply_hooks``), so two plugins hooking one target compose into one
chain. ``register()`` therefore only *registers*: it never applies hooks itself. What was really
applied is checked afterwards by ``status.verify_applied()``, which walks each target's applied
chain; the ``status_line`` patch calls it right after SGLang configures logging, which is after
``apply_hooks``. ``register_patches`` records which modules it registered
(``status.REGISTERED``), so that check never needs to import the patches.

Each process registers only what runs in it (``runtime.process_role``): the launcher the
server-args pass, an Engine process that pass and its scheduler spawn, the DP controller its
scheduler spawn, a scheduler process the worker-side seams, the detokenizer nothing (a child
that loads plugins while multiprocessing is still starting it: an Engine's, a scheduler's and a
DP controller's, since a script's child may create an Engine). Resolving a hook target imports
its module, and the worker modules cost seconds to import.

Order of refusals (first match wins; recorded as the patch status, WARNING/ERROR logged once):
``SGLANG_SM120_DISABLE=1`` -> not used in this process -> not needed on this hardware -> sglang
version is not the pinned one -> a contract symbol does not match. ``register()`` never raises.
"""

from __future__ import annotations

import logging
import os
from importlib import metadata

from sglang_sm120.machine.topology import TopologyError
from sglang_sm120.server.contract import Symbol, check
from sglang_sm120.server.runtime import (
    BOOTSTRAPPING,
    BOOTSTRAPPING_ROLES,
    DISABLE_ENV,
    PATCH_STATUS,
    SCHEDULER_ENTRY_ENV,
    SPAWNER_ROLES,
    log_once,
    logger,
    plugin_disabled,
    process_role,
    withdraw_launch_plan,
)
from sglang_sm120.server.status import REGISTERED, ROLE_NAMES, capability_for
from sglang_sm120.version import SGLANG_PIN, __version__

REGISTRY_CONTRACT = (
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


def declared_contract(modules) -> tuple[Symbol, ...]:
    """Every upstream symbol ``modules`` touch, plus the registry pieces the loader relies on."""
    return tuple(s for m in modules for s in m.CONTRACT) + REGISTRY_CONTRACT


def _record(status: str, modules=None) -> None:
    """Give ``modules`` (default: every patch) the same status."""
    from sglang_sm120.server.patches import PATCHES, patch_name

    for module in PATCHES if modules is None else modules:
        PATCH_STATUS[patch_name(module)] = status


def register_patches(role: str) -> dict[str, str]:
    """Register the hooks ``role`` needs with SGLang's registry; returns (and records) every
    patch's status. Hooks are applied by SGLang's loader, not here."""
    from sglang_sm120.server.patches import PATCHES, patch_name

    if role in SPAWNER_ROLES:  # it publishes its own plan; one it inherited is another launch's
        withdraw_launch_plan()
        os.environ.pop(SCHEDULER_ENTRY_ENV, None)  # and so is the scheduler function it named
    if plugin_disabled():
        _record(f"disabled ({DISABLE_ENV}=1)")
        return dict(PATCH_STATUS)
    cap = capability_for(role)
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
        REGISTERED[patch_name(module)] = module
        if hasattr(module, "apply_setting"):
            module.apply_setting()
    return dict(PATCH_STATUS)


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
