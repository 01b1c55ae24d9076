"""Loading the plugin: check the upstream contract, apply the patches the hardware needs,
confirm each really took effect, and record a status per patch for ``doctor`` and the logs.

Order of refusals (first match wins; each is logged once and recorded as the patch status):
``SGLANG_SM120_DISABLE=1`` -> no patch needed here (no SM12x GPU) -> sglang version is not the
pinned one -> a contract symbol does not match. ``register()`` never raises.
"""

from __future__ import annotations

import logging
import os
from importlib import metadata

from sglang_sm120 import SGLANG_PIN, __version__
from sglang_sm120.contract import Symbol, check, resolve
from sglang_sm120.runtime import PATCH_STATUS, load_capability, log_once, logger
from sglang_sm120.topology import TopologyError

DISABLE_ENV = "SGLANG_SM120_DISABLE"
_REGISTRY = "sglang.srt.plugins.hook_registry.HookRegistry"
# The private registry pieces used to apply only our own targets.
_REGISTRY_CONTRACT = (
    Symbol(f"{_REGISTRY}._apply_target", "function", params=("target", "hooks")),
    Symbol(f"{_REGISTRY}._hooks", "attribute"),
    Symbol(f"{_REGISTRY}._patched", "attribute", type_name="set"),
)


def declared_contract(modules) -> tuple[Symbol, ...]:
    """Every upstream symbol ``modules`` touch, plus the registry pieces the loader uses."""
    return tuple(s for m in modules for s in m.CONTRACT) + _REGISTRY_CONTRACT


def _targets(module) -> tuple[str, ...]:
    return tuple(target for target, _, _ in module.HOOKS)


def _apply_hooks_for(targets: tuple[str, ...]) -> None:
    """Apply the registry's hooks for our targets only (other plugins' targets stay for
    ``load_plugins`` to apply), exactly as ``HookRegistry.apply_hooks`` does per target."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    for target in targets:
        if target not in HookRegistry._patched:
            HookRegistry._apply_target(target, HookRegistry._hooks[target])
            HookRegistry._patched.add(target)


def _hooks_in_effect(module) -> bool:
    return all(hasattr(resolve(target), "__wrapped__") for target in _targets(module))


def _set_all(status: str) -> None:
    from sglang_sm120.patches import PATCHES, patch_name

    for module in PATCHES:
        PATCH_STATUS[patch_name(module)] = status


def apply_patches() -> dict[str, str]:
    """Apply what this host needs; returns (and records) the status of every patch."""
    from sglang_sm120.patches import PATCHES, patch_name

    if os.environ.get(DISABLE_ENV, "").strip() not in ("", "0"):
        _set_all(f"disabled ({DISABLE_ENV}=1)")
        return dict(PATCH_STATUS)
    cap = load_capability()
    why_not = {module: module.not_needed(cap) for module in PATCHES}
    needed = [module for module, reason in why_not.items() if reason is None]
    for module, reason in why_not.items():  # in ledger order, which doctor keeps
        PATCH_STATUS[patch_name(module)] = "pending" if reason is None else f"not needed ({reason})"
    if not needed:
        return dict(PATCH_STATUS)
    installed = metadata.version("sglang")
    if installed != SGLANG_PIN:
        reason = (
            f"sglang {installed} installed, sglang-sm120 {__version__} supports {SGLANG_PIN} only"
        )
        log_once(logging.ERROR, f"sglang-sm120: applying nothing: {reason}")
        _set_all(f"refused ({reason})")
        return dict(PATCH_STATUS)
    from sglang.srt.plugins.hook_registry import HookRegistry

    problems = check(declared_contract(needed))
    if problems:
        reason = f"upstream contract mismatch with sglang {installed}: {problems[0]}"
        log_once(
            logging.ERROR, f"sglang-sm120 {__version__}: applying nothing: " + "; ".join(problems)
        )
        _set_all(f"refused ({reason})")
        return dict(PATCH_STATUS)
    for module in needed:
        for target, hook, hook_type in module.HOOKS:
            HookRegistry.register(target, hook, hook_type)
        _apply_hooks_for(_targets(module))
        if hasattr(module, "after_apply"):
            module.after_apply()
        verified = (
            module.is_applied() if hasattr(module, "is_applied") else _hooks_in_effect(module)
        )
        PATCH_STATUS[patch_name(module)] = (
            "applied" if verified else "refused (target not patched after applying; see the log)"
        )
    return dict(PATCH_STATUS)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point. Never raises."""
    try:
        statuses = apply_patches()
        cap = load_capability()
        summary = ", ".join(f"{name}={status}" for name, status in statuses.items())
        log_once(
            logging.INFO,
            f"sglang-sm120 {__version__}: {'; '.join(cap.reasons)}; patches: {summary}",
        )
    except TopologyError as exc:  # a bad SGLANG_SM120_TOPOLOGY: one clear line, no traceback
        logger.error("sglang-sm120: applying nothing: %s", exc)
        _set_all(f"refused ({exc})")
    except Exception:
        logger.exception("sglang-sm120: plugin failed to load; SGLang runs unpatched")
        _set_all("refused (plugin error; see the log)")
