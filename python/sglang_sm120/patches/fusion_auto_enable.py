"""Patch: server-args resolution turns the fused all-reduce on (or refuses it) per the plan.

Why: ``overrides._flashinfer_allreduce_fusion_auto_enable`` enables FlashInfer's fused
    all-reduce + residual + RMSNorm only on SM90/SM100, so SM120 never gets it; and a backend the
    user forces that SM120 cannot run is only discovered when warmup crashes.
How: AROUND hook on the post-process pass. On SM12x hosts it returns the plan's backend:
    ``trtllm`` at TP2 or when the user asked for trtllm/auto, ``None`` with a WARNING when the
    user's choice is refused (mnnvl, cutedsl, no P2P, multi-node). Upstream's enforce-disable
    pass runs after it and still wins. Other GPUs get upstream's answer. The pass list
    ``POST_PROCESS_PASSES`` holds the function object, so its entry is swapped for the wrapper.
Upstream: sgl-project/sglang PR #32330 (closed: asks for opt-in or TP gating at TP4/TP8).
Removal: when upstream's auto-enable covers SM12x with TP/topology gating.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from sglang_sm120.contract import Symbol, resolve
from sglang_sm120.policy import Capability
from sglang_sm120.runtime import log_once, plan_for_view

MODULE = "sglang.srt.arg_groups.overrides"
TARGET = f"{MODULE}._flashinfer_allreduce_fusion_auto_enable"
PASSES = f"{MODULE}.POST_PROCESS_PASSES"
FIELD = "flashinfer_allreduce_fusion_backend"
CONTRACT = (
    Symbol(TARGET, "function", params=("view",)),
    Symbol(PASSES, "attribute", type_name="list"),
    Symbol(f"{MODULE}._FLASHINFER_ALLREDUCE_FUSION_ARCHS", "attribute", type_name="frozenset"),
    Symbol(
        "sglang.srt.arg_groups.model_override_base.model_config_of",
        "function",
        params=("server_args",),
    ),
    Symbol("sglang.srt.runtime_context.attn_dp_enabled_of", "function", params=("cfg",)),
)


def not_needed(cap: Capability) -> str | None:
    return None if cap.sm12x else cap.reasons[0]


def fusion_backend_from_plan(original, view: Any) -> dict:
    declared = original(view)
    plan = plan_for_view(view)
    if not plan.managed:
        return declared
    requested = getattr(view, FIELD)
    if requested is not None and plan.fusion_backend is None:
        log_once(
            logging.WARNING,
            f"sglang-sm120: --flashinfer-allreduce-fusion-backend {requested} "
            f"refused, using NCCL + RMSNorm: {plan.reasons[-2]}",
        )
    if plan.fusion_backend == requested:
        return declared
    return {**declared, FIELD: plan.fusion_backend}


def after_apply() -> None:
    """Point the pass list at the wrapper that the hook registry installed."""
    passes = resolve(PASSES)
    wrapped = resolve(TARGET)
    original = getattr(wrapped, "__wrapped__", None)
    passes[:] = [wrapped if fn is original else fn for fn in passes]


def is_applied() -> bool:
    wrapped = resolve(TARGET)
    return hasattr(wrapped, "__wrapped__") and wrapped in resolve(PASSES)


HOOKS = ((TARGET, fusion_backend_from_plan, HookType.AROUND),)
