"""Patch: upstream's MSCCL++ / torch symmetric-memory all-reduce on where the tuning table says.

Why: ``--enable-mscclpp`` and ``--enable-torch-symm-mem`` are off by default, and SGLang's
    resolution passes may not turn them on (they are not ``resolvable`` ServerArgs fields:
    ``overrides.validate_declarations`` refuses a declaration). Where ``sglang-sm120 tune``
    measured one of them clearly faster at the sizes SGLang all-reduces, the plan says so
    (``AllReducePlan.upstream_switches``), and nothing else would act on it.
How: BEFORE hooks on ``parallel_state.set_mscclpp`` and ``set_torch_symm_mem_all_reduce``,
    which ``bootstrap._set_all_reduce_flags`` calls in each scheduler with the user's value
    before the model-parallel groups are built. Where the user left it off and the launcher's
    plan switched it on, the call gets ``enable=True``. The plan already declined a switch where
    what the user set says otherwise (``policy._extras_blocker``:
    ``--enable-symm-mem``, an explicit ``SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1`` for MSCCL++). A
    communicator that cannot build (``mscclpp`` gone since the table) is upstream's own
    warning and fallback to NCCL.
Upstream: none filed; both are opt-in by design upstream.
Removal: when upstream picks its all-reduce communicators by measurement.
"""

from __future__ import annotations

import logging

from sglang.srt.plugins.hook_registry import HookType

from sglang_sm120.planning.policy import Capability
from sglang_sm120.server.contract import Symbol
from sglang_sm120.server.runtime import log_once, worker_plan

MODULE = "sglang.srt.distributed.parallel_state"
SETTERS = {
    "enable_mscclpp": f"{MODULE}.set_mscclpp",
    "enable_torch_symm_mem": f"{MODULE}.set_torch_symm_mem_all_reduce",
}
CALLER = "sglang.srt.distributed.bootstrap._set_all_reduce_flags"
COPIES = {
    target: (f"sglang.srt.distributed.bootstrap.{target.rsplit('.', 1)[1]}",)
    for target in SETTERS.values()
}
CONTRACT = (
    *(Symbol(target, "function", params=("enable",)) for target in SETTERS.values()),
    Symbol(CALLER, "function", reads=("set_mscclpp", "set_torch_symm_mem_all_reduce")),
)
ROLES = ("scheduler",)


def not_needed(cap: Capability) -> str | None:
    return None if cap.sm12x else cap.reasons[0]


def _switch_on(field: str):
    def hook(*args, **kwargs):
        enable = kwargs.get("enable", args[0] if args else False)
        plan = worker_plan()
        if enable or plan is None or field not in plan.upstream_switches:
            return None
        log_once(
            logging.INFO,
            f"sglang-sm120: {field} on from the tuning table "
            f"({next((r for r in plan.reasons if 'on from the tuning table' in r), '')})",
        )
        return (), {"enable": True}

    hook.__name__ = f"{field}_from_plan"
    return hook


HOOKS = tuple((target, _switch_on(field), HookType.BEFORE) for field, target in SETTERS.items())
