"""Patch: server-args resolution turns the fused all-reduce on (or refuses it) per the plan.

Why: ``overrides._flashinfer_allreduce_fusion_auto_enable`` enables FlashInfer's fused
    all-reduce + residual + RMSNorm only on SM90/SM100, so SM120 never gets it; and a backend the
    user forces that SM120 cannot run is only discovered when warmup crashes.
How: AROUND hook on the post-process pass. On SM12x hosts it returns the plan's backend:
    the tuning table's or the TP default (``trtllm`` at TP2) when the user asked for nothing or
    for ``auto`` (also the deprecated ``--enable-flashinfer-allreduce-fusion``), the user's
    explicit backend, or ``None`` with a WARNING when that is refused (mnnvl, cutedsl, no P2P,
    multi-node). Upstream's enforce-disable pass runs after it and still wins. Other GPUs get
    upstream's answer. The plan is published to the workers this process spawns
    (``runtime.plan_for_view``). The pass is run by
    ``model_hook.handle_model_specific_adjustments`` through its ``from overrides import``
    copy, which the hook registry rebinds; ``COPIES`` makes the loader check that copy.
    Registered in the launcher and in Engine processes (an ``Engine`` resolves its server args
    in-process). The pass always declares the field on SM12x hosts, so what the user asked for
    stays readable on the record as the declarations before this one.
Upstream: sgl-project/sglang PR #32330 (closed: asks for opt-in or TP gating at TP4/TP8).
Removal: when upstream's auto-enable covers SM12x with TP/topology gating.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from sglang_sm120.planning.policy import Capability
from sglang_sm120.server.contract import Symbol
from sglang_sm120.server.runtime import log_once, plan_for_view

MODULE = "sglang.srt.arg_groups.overrides"
TARGET = f"{MODULE}._flashinfer_allreduce_fusion_auto_enable"
CALLER = "sglang.srt.arg_groups.model_hook.handle_model_specific_adjustments"
CALLER_COPY = "sglang.srt.arg_groups.model_hook._flashinfer_allreduce_fusion_auto_enable"
FIELD = "flashinfer_allreduce_fusion_backend"
ROLES = ("launcher", "engine")
COPIES = {TARGET: (CALLER_COPY,)}
CONTRACT = (
    Symbol(TARGET, "function", params=("view",)),
    Symbol(CALLER, "function", reads=("_flashinfer_allreduce_fusion_auto_enable",)),
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
    if requested not in (None, "auto") and plan.fusion_backend is None:  # auto: the plan decides
        log_once(
            logging.WARNING,
            f"sglang-sm120: --flashinfer-allreduce-fusion-backend {requested} "
            f"refused, using NCCL + RMSNorm: {plan.reasons[-2]}",
        )
    # Declared even when unchanged: a process handed these server args later reads what the
    # user asked for from the declarations before this one (runtime.requested_view).
    return {**declared, FIELD: plan.fusion_backend}


HOOKS = ((TARGET, fusion_backend_from_plan, HookType.AROUND),)
