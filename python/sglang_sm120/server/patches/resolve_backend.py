"""Patch: FlashInfer fusion backend resolution accepts SM12x.

Why: ``flashinfer_comm_fusion._resolve_backend`` raises ValueError unless the GPU is SM90 or
    SM100, and nothing catches it on the warmup path: forcing
    ``--flashinfer-allreduce-fusion-backend trtllm`` on SM120 crashes the server in warmup,
    although FlashInfer's trtllm kernel is compiled for SM12x.
How: AROUND hook. On SM12x hosts whose TP GPUs all have P2P (as the launcher saw them: a
    worker may see only its own GPU), on a single node, ``auto`` and
    ``trtllm`` resolve to ``trtllm`` and ``sm120_pcie`` (this distribution's backend) to itself;
    on several nodes ``sm120_pcie`` resolves where the launcher's plan chose it (a TP group
    inside one node, PP stages across nodes) and trtllm stays refused, as upstream refuses it;
    ``mnnvl``/``cutedsl``, multi-node, or missing P2P raise a ValueError that says why (the
    server-args patch normally refuses these before warmup).
    Other GPUs go to the original unchanged.
Upstream: sgl-project/sglang PR #32330 (SM12x enablement, closed after a TP4 regression);
    FlashInfer PR #3903 (SM120 TP2 measurements).
Removal: when upstream's ``_resolve_backend`` accepts SM12x for trtllm.
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType

from sglang_sm120.planning.policy import FUSION_BACKENDS_RUNNABLE_ON_SM12X, Capability
from sglang_sm120.server.contract import Symbol
from sglang_sm120.server.runtime import worker_capability, worker_plan

TARGET = "sglang.srt.layers.flashinfer_comm_fusion._resolve_backend"
CONTRACT = (Symbol(TARGET, "function", params=("backend", "is_multi_node")),)
ROLES = ("scheduler",)


def not_needed(cap: Capability) -> str | None:
    return None if cap.sm12x else cap.reasons[0]


def planned(backend: str) -> bool:
    """Whether the launcher's plan chose ``backend``: on several nodes it does so only for a TP
    group inside one node (policy ``tp_group_nodes``), which ``is_multi_node`` cannot tell."""
    plan = worker_plan()
    return plan is not None and plan.fusion_backend == backend


def resolve_backend_on_sm12x(original, backend: str, is_multi_node: bool = False) -> str:
    cap = worker_capability()
    if not cap.sm12x:
        return original(backend, is_multi_node)
    if backend == "sm120_pcie" and cap.fusion_capable:
        if not is_multi_node or planned(backend):
            return backend
        raise ValueError(
            "sglang-sm120: sm120_pcie on several nodes serves a TP group inside one node only, "
            "and the launcher's plan did not choose it"
        )
    if backend not in FUSION_BACKENDS_RUNNABLE_ON_SM12X:
        raise ValueError(
            f"sglang-sm120: FlashInfer allreduce fusion backend {backend!r} cannot run on SM12x "
            "(mnnvl needs an NVLink fabric, cutedsl needs SM100); use trtllm, sm120_pcie or "
            "leave it unset"
        )
    if is_multi_node:
        raise ValueError("sglang-sm120: the trtllm fused all-reduce on SM12x is single-node only")
    if not cap.fusion_capable:
        raise ValueError(f"sglang-sm120: fused all-reduce refused on this host: {cap.reasons[0]}")
    return "trtllm"


HOOKS = ((TARGET, resolve_backend_on_sm12x, HookType.AROUND),)
