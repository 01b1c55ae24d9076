"""Patch: a TP worker sets the NCCL_* variables the tuning table chose, before NCCL starts.

Why: NCCL picks its protocol, algorithm and channel count per message from a model of the
    link, and reads NCCL_PROTO / NCCL_ALGO once per process, when its first communicator is
    made (SGLang's ``init_distributed_environment``). Where ``tune`` measured a variant clearly
    faster than NCCL's own choice at the sizes the plan leaves on NCCL
    (``planning.nccl_settings.tuned_nccl_env``), nothing in SGLang can ask for it.
How: BEFORE hook on ``init_distributed_environment``, which every process that starts NCCL
    passes first, however it was started: also a scheduler that loaded plugins while
    multiprocessing was still starting it (a script calling ``load_plugins()`` at module level),
    whose role was not known yet when it registered. There each variable of the plan's
    ``nccl_env`` is put in ``os.environ`` in its per-collective form (``allreduce:LL``), only
    when none of ``USER_NCCL_TUNING`` is set, in the environment or NCCL's config files, and
    every config file could be read (``machine.nccl_conf``): a user's own value (or SGLang's,
    for deterministic inference) wins, and the status says so. ``applied`` means the variables
    were in the process environment NCCL's getenv(3) reads (read back through libc, not
    ``os.environ``, Python's copy) when ``init_distributed_environment`` ran; until then the
    status is ``pending``. Set in the worker, not the launcher: a launcher's variable would
    look like the user's to its workers, and would leak into an Engine user's own process.
Upstream: none; NCCL tuning is the deployer's job upstream.
Removal: when NCCL's own model picks the measured winner on SM12x PCIe hosts.
"""

from __future__ import annotations

import ctypes
import logging
import os

from sglang.srt.plugins.hook_registry import HookType

from sglang_sm120.machine.nccl_conf import nccl_settings
from sglang_sm120.planning.nccl_settings import nccl_env_to_apply
from sglang_sm120.planning.policy import Capability
from sglang_sm120.planning.tuning import variant_name
from sglang_sm120.server.contract import Symbol
from sglang_sm120.server.runtime import (
    NO_LAUNCH_PLAN_NCCL,
    PATCH_STATUS,
    log_once,
    record_nccl_env,
    worker_plan,
)

TARGET = "sglang.srt.distributed.bootstrap.init_distributed_environment"
CONTRACT = (
    Symbol(TARGET, "function"),
    # where SGLang starts NCCL: if it stopped calling the target, the hook would never run
    Symbol(
        "sglang.srt.distributed.bootstrap._init_parallel_groups",
        "function",
        reads=("init_distributed_environment",),
    ),
)
ROLES = ("scheduler",)
NAME = "nccl_tuned_env"
_set: dict[str, str] = {}  # what the hook put in os.environ
_ran: list[bool] = []  # whether the hook ran in this process


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


def _missing_from_process_environment(env: tuple[tuple[str, str], ...]) -> str | None:
    """The first NAME=value that getenv(3), which NCCL calls, does not return (None: all do).
    os.environ can hold a value the C environment lacks (putenv failed or was replaced)."""
    try:
        getenv = ctypes.CDLL(None).getenv
    except (OSError, AttributeError):  # no C library to ask: Python's copy is all there is
        return next((f"{n}={v}" for n, v in env if os.environ.get(n) != v), None)
    getenv.restype, getenv.argtypes = ctypes.c_char_p, [ctypes.c_char_p]
    for name, value in env:
        raw = getenv(name.encode())
        if raw is None or raw != value.encode():
            return f"{name}={value}"
    return None


def set_before_nccl_starts(*args, **kwargs) -> None:
    """Put the plan's NCCL variables in the environment NCCL is about to read, and record
    whether they hold there (the patch's status); once per process (a second call would read
    our own values as the user's)."""
    if _ran:
        return
    _ran.append(True)
    env, line = _to_apply()
    for name, value in env:
        os.environ[name] = value
        _set[name] = value
    missing = _missing_from_process_environment(env)
    if not env:
        status = f"not needed ({line})"
    elif missing is None:
        status = "applied"
    else:
        status = f"refused ({missing} is not in the process environment NCCL reads)"
    PATCH_STATUS[NAME] = status
    record_nccl_env(line)
    log_once(logging.INFO, f"sglang-sm120: {NAME}={status} at init_distributed_environment; {line}")


def pending() -> str | None:
    """What the status waits for until the hook has run (None once it has)."""
    if _ran:
        return None
    env, _ = _to_apply()
    what = variant_name(env) if env else "the plan's NCCL variables"
    return f"{what} set when init_distributed_environment runs"


HOOKS = ((TARGET, set_before_nccl_starts, HookType.BEFORE),)
