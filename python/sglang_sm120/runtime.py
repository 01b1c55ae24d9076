"""Glue between a running SGLang process and the policy: which process this is, the plan it
follows, the patch statuses it records, and its log lines.

SGLang runs the plugin in several processes (UPSTREAM.md section 7):

- the launcher (``launch_server``, ``sglang serve``, an ``Engine``) resolves the server args.
  ``plan_for_view`` plans there from the real server args, for every GPU the node's ranks will
  use (``--base-gpu-id``, ``--gpu-id-step``, PP stages, DP replicas), and publishes the plan in
  ``SGLANG_SM120_LAUNCH_PLAN``, which every process it spawns inherits;
- the TP workers (scheduler processes) follow that plan (``worker_plan``): they cannot re-derive
  it, since the resolved server args no longer say what the user asked for, and a worker may see
  one GPU only (``SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1``). Without a published plan the worker
  patches hand every call to upstream unchanged, and say so once.

Log lines: ``load_plugins()`` runs before SGLang configures logging (launcher, workers), so
``log_once`` holds INFO lines until ``logging_configured()`` is called by the ``status_line``
patch, right after SGLang's own ``configure_logger``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import sys
from typing import Any

from sglang_sm120 import strict_json
from sglang_sm120.facts import HostFacts, current_facts
from sglang_sm120.host import SYSFS_ROOT_ENV, HostFindings, run_host_checks
from sglang_sm120.policy import (
    PLUGIN_BACKEND_CHOICES,
    PLUGIN_BACKEND_ENV,
    VALIDATION_ENV,
    AllReducePlan,
    Capability,
    Deployment,
    hardware_capability,
    in_scope,
    plan_allreduce,
)
from sglang_sm120.tuning import load_table

logger = logging.getLogger("sglang_sm120")

PCIE_IPC_ENV = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"
DISABLE_ENV = "SGLANG_SM120_DISABLE"
SWITCH_ON = ("1", "true", "yes", "on")
SWITCH_OFF = ("0", "false", "no", "off")
LAUNCH_PLAN_ENV = "SGLANG_SM120_LAUNCH_PLAN"
# SGLang starts every scheduler with this environment, and Linux refuses to start a program
# whose environment holds a string over MAX_ARG_STRLEN (128 KiB: "Argument list too long").
# Half of that leaves room for the rest of the environment, which shares ARG_MAX with it.
LAUNCH_PLAN_MAX_BYTES = 64 * 1024

#: patch name -> "applied" | "registered" | "not needed (...)" | "refused (...)" | ...
PATCH_STATUS: dict[str, str] = {}
_logged: set[str] = set()
_pending: list[tuple[int, str]] = []
_logging_ready: list[bool] = [False]
_last_plan: list[AllReducePlan] = []

# Module SGLang's scheduler lives in: a process that has loaded it runs (or will import and run)
# model code; one with only the detokenizer loaded is the detokenizer.
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
DETOKENIZER_MODULE = "sglang.srt.managers.detokenizer_manager"


_role: list[str] = []


def process_role() -> str:
    """``scheduler`` (TP workers, and Engine/DP-controller processes, which import the scheduler),
    ``detokenizer``, or ``launcher``: decided once, from what SGLang had loaded when it first
    asked (``load_plugins()``); the launcher imports the scheduler later, to spawn it."""
    if not _role:
        if SCHEDULER_MODULE in sys.modules:
            _role.append("scheduler")
        elif DETOKENIZER_MODULE in sys.modules:
            _role.append("detokenizer")
        else:
            _role.append("launcher")
    return _role[0]


def log_once(level: int, message: str) -> None:
    """Log ``message`` the first time this process sees it. WARNING and above go out at once
    (Python prints them even before logging is configured); INFO waits for SGLang's logging."""
    if message in _logged:
        return
    _logged.add(message)
    if level >= logging.WARNING or _logging_ready[0]:
        logger.log(level, message)
    else:
        _pending.append((level, message))


def logging_configured(first: str) -> None:
    """SGLang has configured this process's logging: log ``first`` (the status line), then
    what waited for it."""
    _logging_ready[0] = True
    log_once(logging.INFO, first)
    waiting, _pending[:] = list(_pending), []
    for level, message in waiting:
        logger.log(level, message)


def env_switch(name: str) -> bool | None:
    """The boolean switch ``name``, read one way for every switch the package reads: 1, true,
    yes, on -> True; 0, false, no, off -> False (any case, surrounding spaces ignored); unset
    or empty -> None. Anything else is None too (the caller's default), with one warning
    naming the variable and the value."""
    raw = os.environ.get(name)
    value = (raw or "").strip().lower()
    if value in SWITCH_ON:
        return True
    if value in SWITCH_OFF:
        return False
    if value:
        log_once(
            logging.WARNING,
            f"sglang-sm120: {name}={raw!r} is not a switch value "
            f"({'/'.join(SWITCH_ON)} or {'/'.join(SWITCH_OFF)}): ignored, default kept",
        )
    return None


def plugin_disabled() -> bool:
    """The kill switch SGLANG_SM120_DISABLE (``env_switch``; default off): the plugin loads
    but registers nothing. The plugin and doctor both ask here."""
    return env_switch(DISABLE_ENV) is True


def validation_mode() -> bool:
    """SGLANG_SM120_ANY_ARCH=1: manage SM90+ GPUs as if SM12x, to validate the managed path on
    H100/H200 machines. Only "1" turns it on: a test switch is never on by accident; any other
    value but 0 is refused with one warning."""
    value = os.environ.get(VALIDATION_ENV, "").strip()
    if value not in ("", "0", "1"):
        log_once(
            logging.WARNING,
            f"sglang-sm120: {VALIDATION_ENV}={value!r} ignored: only 1 turns validation mode on",
        )
    return value == "1"


@functools.cache
def sm12x_capability() -> Capability:
    """What the visible GPUs the plugin manages allow (SM12x, or SM90+ in validation mode; every
    visible GPU when none is): the launcher's first look, before server args say which GPUs the
    TP group uses."""
    facts = current_facts()
    any_arch = validation_mode()
    managed = [g.index for g in facts.gpus if in_scope(g, any_arch)]
    return hardware_capability(facts, managed or None, any_arch=any_arch)


def fusion_archs() -> frozenset[str]:
    """Upstream's own list of architectures with a fused all-reduce path."""
    from sglang.srt.arg_groups.overrides import _FLASHINFER_ALLREDUCE_FUSION_ARCHS

    return _FLASHINFER_ALLREDUCE_FUSION_ARCHS


def pcie_ipc_env() -> bool | None:
    """The user's explicit SGLANG_ENABLE_PCIE_IPC_ALLREDUCE (``env_switch``), or None when
    unset or unreadable; the pcie_ipc_enable patch hands upstream this value, so upstream's
    own spelling rules cannot disagree with the plan."""
    return env_switch(PCIE_IPC_ENV)


def plugin_backend() -> str | None:
    """SGLANG_SM120_FUSION_BACKEND, or None when unset, "auto" or invalid (said once)."""
    raw = os.environ.get(PLUGIN_BACKEND_ENV, "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw not in PLUGIN_BACKEND_CHOICES:
        log_once(
            logging.WARNING,
            f"sglang-sm120: {PLUGIN_BACKEND_ENV}={raw!r} ignored; "
            f"choose one of {', '.join(PLUGIN_BACKEND_CHOICES)}",
        )
        return None
    return raw


def with_tuning(deployment: Deployment, hidden: int | None, dtype: str | None) -> Deployment:
    """The deployment plus this host's tuning table for its shape, if there is a fresh one."""
    if hidden is None or dtype is None or deployment.tp_size <= 1:
        return deployment
    table, note = load_table(
        current_facts(), deployment.tp_size, hidden, dtype, deployment.first_tp_group()
    )
    return dataclasses.replace(deployment, tuning=table, tuning_note=note)


def host_findings(
    facts: HostFacts, tp: int, hidden: int, gpu_ids: tuple[int, ...] | None = None
) -> HostFindings:
    """This host's checks and its cached p2p probe for the GPUs ``gpu_ids`` (default every
    visible one). NVML is asked only when the facts came from it: a profile describes another
    machine. Never raises."""
    from sglang_sm120.p2p_probe import load_probe

    probe, note = load_probe(facts, gpu_ids)
    skip = None if facts.source == "nvml" else f"facts from {facts.source}, not this machine"
    return HostFindings(run_host_checks(tp, hidden, skip_nvml=skip, probe=probe), probe, note)


def findings_describe(facts: HostFacts) -> bool:
    """Whether this machine's host checks describe the facts' machine: facts from NVML, or a
    profile together with SGLANG_SM120_SYSFS_ROOT naming that machine's sysfs dump."""
    return facts.source == "nvml" or bool(os.environ.get(SYSFS_ROOT_ENV))


def with_host_findings(deployment: Deployment, hidden: int | None) -> Deployment:
    """The deployment plus this host's findings, where a plan can use them (managed GPUs, TP > 1,
    checks that describe these GPUs). Diagnostics never stop a launch: a failure is logged."""
    facts = current_facts()
    gpu_ids = deployment.first_tp_group()
    if deployment.tp_size <= 1 or not findings_describe(facts):
        return deployment
    cap = hardware_capability(facts, deployment.used_gpu_ids(), any_arch=deployment.any_arch)
    if not cap.sm12x:
        return deployment
    try:
        findings = host_findings(facts, deployment.tp_size, hidden or 7168, gpu_ids)
    except Exception as exc:
        log_once(logging.WARNING, f"sglang-sm120: host checks failed, not used: {exc}")
        return deployment
    return dataclasses.replace(deployment, host=findings)


def node_gpu_ids(
    *, tp: int, pp: int, replicas: int, base_gpu_id: int, gpu_id_step: int
) -> tuple[int, ...]:
    """The CUDA indices SGLang gives the ranks of one node, as its engine and DP controller
    compute them: TP rank t of PP stage p of data-parallel replica r uses
    base + r * tp * pp * step + p * tp + t * step."""
    ids = {
        base_gpu_id + r * tp * pp * gpu_id_step + p * tp + t * gpu_id_step
        for r in range(replicas)
        for p in range(pp)
        for t in range(tp)
    }
    first_group = [base_gpu_id + t * gpu_id_step for t in range(tp)]
    return (*first_group, *sorted(ids - set(first_group)))


def deployment_from_view(view: Any) -> Deployment:
    """Read a Deployment from SGLang's resolution view (launcher / Engine process)."""
    from sglang.srt.arg_groups.model_override_base import model_config_of
    from sglang.srt.runtime_context import attn_dp_enabled_of

    model_config = model_config_of(view)
    dtype = str(model_config.dtype).removeprefix("torch.")
    attention_dp = attn_dp_enabled_of(view)
    single_node = view.nnodes == 1
    gpu_ids = node_gpu_ids(
        tp=view.tp_size,
        pp=view.pp_size if single_node else 1,
        replicas=view.dp_size if view.dp_size > 1 and not attention_dp and single_node else 1,
        base_gpu_id=view.base_gpu_id,
        gpu_id_step=view.gpu_id_step,
    )
    deployment = Deployment(
        tp_size=view.tp_size,
        nnodes=view.nnodes,
        attention_dp=attention_dp,
        moe_a2a_backend=view.moe_a2a_backend,
        model_arch=model_config.hf_config.architectures[0],
        dtype=dtype,
        fusion_backend_flag=view.flashinfer_allreduce_fusion_backend,
        enforce_disable_fusion=bool(view.enforce_disable_flashinfer_allreduce_fusion),
        pcie_ipc_env=pcie_ipc_env(),
        deterministic=bool(view.enable_deterministic_inference),
        plugin_backend=plugin_backend(),
        gpu_ids=gpu_ids,
        ray=bool(view.use_ray),
        disaggregation=view.disaggregation_mode not in (None, "null"),
        custom_all_reduce=not view.disable_custom_all_reduce,
        any_arch=validation_mode(),
    )
    deployment = with_tuning(deployment, model_config.hidden_size, dtype)
    return with_host_findings(deployment, model_config.hidden_size)


def last_plan() -> AllReducePlan | None:
    """The most recent plan this process computed or received (for reports), or None."""
    return _last_plan[0] if _last_plan else None


def launch_plan_json(facts: HostFacts, deployment: Deployment, plan: AllReducePlan) -> str:
    """What a launcher publishes in SGLANG_SM120_LAUNCH_PLAN for ``plan``."""
    capability = hardware_capability(facts, deployment.used_gpu_ids(), any_arch=deployment.any_arch)
    document = {
        "tp_size": deployment.tp_size,
        "gpu_ids": list(deployment.used_gpu_ids()),
        "capability": capability.to_json(),
        "plan": plan.to_json(),
    }
    return json.dumps(document, separators=(",", ":"))


def plan_to_publish(facts: HostFacts, deployment: Deployment) -> tuple[AllReducePlan, str | None]:
    """The plan for a launch and the launch plan its processes get (None: publish nothing).

    The launch plan must fit the environment (LAUNCH_PLAN_MAX_BYTES). A tuning table whose plan
    would not fit is not used: the plan without it, which says why, is published instead; a plan
    that still would not fit is not published, and upstream decides (said as an ERROR)."""
    plan = plan_allreduce(facts, deployment, fusion_archs())
    published = launch_plan_json(facts, deployment, plan)
    size = len(published.encode())
    if size > LAUNCH_PLAN_MAX_BYTES and deployment.tuning is not None:
        note = (
            f"tuning table not used: the plan it gives takes {size // 1024} KiB, over the "
            f"{LAUNCH_PLAN_MAX_BYTES // 1024} KiB a launch plan may take in the environment "
            f"(its routes change backend {len(plan.routes) - 1} times across the sizes; "
            "re-run `sglang-sm120 tune` with fewer --tokens)"
        )
        log_once(logging.WARNING, f"sglang-sm120: {note}")
        deployment = dataclasses.replace(deployment, tuning=None, tuning_note=note)
        plan = plan_allreduce(facts, deployment, fusion_archs())
        published = launch_plan_json(facts, deployment, plan)
        size = len(published.encode())
    if size > LAUNCH_PLAN_MAX_BYTES:
        reason = (
            f"plan not published: it takes {size // 1024} KiB, over the "
            f"{LAUNCH_PLAN_MAX_BYTES // 1024} KiB a launch plan may take in the environment; "
            "upstream behaviour, untouched"
        )
        log_once(logging.ERROR, f"sglang-sm120: {reason}")
        return AllReducePlan(False, None, "upstream", (reason,)), None
    return plan, published


def plan_for_view(view: Any) -> AllReducePlan:
    """The launcher's plan, logged once and published to the processes it spawns."""
    deployment = deployment_from_view(view)
    plan, published = plan_to_publish(current_facts(), deployment)
    _last_plan[:] = [plan]
    if plan.managed:
        tp = deployment.tp_size
        log_once(logging.INFO, f"sglang-sm120 plan (server args, tp={tp}): {plan.summary()}")
    if published is None:
        os.environ.pop(LAUNCH_PLAN_ENV, None)
    else:
        os.environ[LAUNCH_PLAN_ENV] = published
    _launch_plan.cache_clear()
    return plan


@functools.cache
def _launch_plan() -> tuple[int, Capability, AllReducePlan] | None:
    raw = os.environ.get(LAUNCH_PLAN_ENV)
    if not raw:
        return None
    try:
        data = strict_json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError(f"not a JSON object but {type(data).__name__}")
        tp_size = data.get("tp_size")
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
            raise ValueError(f"tp_size {tp_size!r} is not a positive integer")
        capability = Capability.from_json(data.get("capability"))
        plan = AllReducePlan.from_json(data.get("plan"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        log_once(logging.WARNING, f"sglang-sm120: {LAUNCH_PLAN_ENV} unreadable ({reason}): ignored")
        return None
    _last_plan[:] = [plan]
    if plan.managed:
        log_once(logging.INFO, f"sglang-sm120 plan (from launcher, tp={tp_size}): {plan.summary()}")
    return tp_size, capability, plan


def worker_plan() -> AllReducePlan | None:
    """The launcher's plan, in a worker; None when the launcher published none (the worker
    patches then leave every decision to upstream)."""
    launched = _launch_plan()
    return launched[2] if launched else None


def worker_tp_size() -> int | None:
    launched = _launch_plan()
    return launched[0] if launched else None


def worker_capability() -> Capability:
    """What the TP group's GPUs allow, as the launcher saw them (a worker may see only its own
    GPU); the visible GPUs when no launcher published a plan."""
    launched = _launch_plan()
    return launched[1] if launched else sm12x_capability()
