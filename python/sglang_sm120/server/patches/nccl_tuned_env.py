"""Patch: a TP worker sets the NCCL_* variables the tuning table chose, before NCCL starts.

Why: NCCL picks its protocol, algorithm and channel count per message from a model of the
    link, and reads NCCL_PROTO / NCCL_ALGO / NCCL_MAX_NCHANNELS once per process, when its
    first communicator is made (SGLang's ``init_distributed_environment``). Where ``tune``
    measured a variant clearly faster than NCCL's own choice at the sizes the plan leaves on
    NCCL (``planning.nccl_settings.tuned_nccl_env``), nothing in SGLang can ask for it.
How: a plain setting, no hook: when the plugin registers in a scheduler process (SGLang's
    ``run_scheduler_process`` calls ``load_plugins()`` first, before it builds the Scheduler
    that calls ``init_distributed_environment``), each variable of the plan's ``nccl_env`` is
    put in ``os.environ``, only when none of ``USER_NCCL_TUNING`` is set, in the environment or
    NCCL's config files (``machine.nccl_conf``): a user's own value (or SGLang's, for
    deterministic inference) wins, and the status line says so. Set in the worker,
    not the launcher: a launcher's variable would look like the user's to its workers, and would
    leak into an Engine user's own process.
Upstream: none; NCCL tuning is the deployer's job upstream.
Removal: when NCCL's own model picks the measured winner on SM12x PCIe hosts.
"""

from __future__ import annotations

import os

from sglang_sm120.machine.nccl_conf import nccl_settings
from sglang_sm120.planning.nccl_settings import nccl_env_to_apply
from sglang_sm120.planning.policy import Capability
from sglang_sm120.server.contract import Symbol
from sglang_sm120.server.runtime import (
    NO_LAUNCH_PLAN_NCCL,
    process_role,
    record_nccl_env,
    worker_plan,
)

CONTRACT = (
    # The order this patch relies on: plugins load before the Scheduler exists.
    Symbol(
        "sglang.srt.managers.scheduler.run_scheduler_process",
        "function",
        reads=("load_plugins", "Scheduler"),
    ),
    Symbol("sglang.srt.distributed.bootstrap.init_distributed_environment", "function"),
)
HOOKS = ()
ROLES = ("scheduler",)
_set: dict[str, str] = {}


def _to_apply() -> tuple[tuple[tuple[str, str], ...], str]:
    plan = worker_plan()
    if plan is None or not plan.managed:
        return (), NO_LAUNCH_PLAN_NCCL
    return nccl_env_to_apply(plan, nccl_settings(os.environ))


def not_needed(cap: Capability) -> str | None:
    if not cap.sm12x:
        return cap.reasons[0]
    env, line = _to_apply()
    return None if env else line


def apply_setting() -> None:
    if process_role() != "scheduler":  # a child still starting may become anything
        return
    env, line = _to_apply()
    for name, value in env:
        os.environ[name] = value
        _set[name] = value
    record_nccl_env(line)


def is_applied() -> bool:
    return all(os.environ.get(name) == value for name, value in _set.items())
