"""Glue between a running SGLang process and the policy: which process this is, the plan it
follows, the patch statuses it records, and its log lines.

SGLang runs the plugin in several processes (UPSTREAM.md section 7). Which one this is
(``process_role``) is read from the call stack when ``load_plugins()`` first runs: SGLang calls
it from each process's own entry function (``ROLE_ENTRIES``), so the innermost of those on the
stack names the process, whatever modules it happened to import before.

- processes that spawn schedulers plan for them and publish the plan in
  ``SGLANG_SM120_LAUNCH_PLAN``, which every process they spawn inherits; one they inherited
  themselves is another launch's and is dropped. The launcher (``launch_server``, ``sglang
  serve``) and an Engine process (``sglang.Engine``, or ``http_server.launch_server`` called
  directly) plan while resolving the server args (``plan_for_view``), for every GPU the node's
  ranks will use (``--base-gpu-id``, ``--gpu-id-step``, PP stages, DP replicas); an Engine
  process and the DP controller plan again right before they spawn schedulers
  (``plan_for_spawn``), from the server args they spawn them with;
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
import multiprocessing
import os
import sys
from collections.abc import Collection
from typing import Any

from sglang_sm120 import strict_json
from sglang_sm120.env_values import number, shown, switch_value
from sglang_sm120.machine.facts import HostFacts, current_facts
from sglang_sm120.machine.host_checks import SYSFS_ROOT_ENV, HostFindings, run_host_checks
from sglang_sm120.machine.topology import MAX_TP_SIZE
from sglang_sm120.planning.nccl_settings import with_tuned_nccl_env
from sglang_sm120.planning.policy import (
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
from sglang_sm120.planning.tuning import load_table

logger = logging.getLogger("sglang_sm120")

PCIE_IPC_ENV = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"
DISABLE_ENV = "SGLANG_SM120_DISABLE"
LAUNCH_PLAN_ENV = "SGLANG_SM120_LAUNCH_PLAN"
# SGLang starts every scheduler with this environment, and Linux refuses to start a program
# whose environment holds a string over MAX_ARG_STRLEN (128 KiB: "Argument list too long").
# Half of that leaves room for the rest of the environment, which shares ARG_MAX with it.
LAUNCH_PLAN_MAX_BYTES = 64 * 1024
LAUNCH_PLAN_KEYS = ("tp_size", "gpu_ids", "capability", "plan")  # as launch_plan_json writes

#: patch name -> "applied" | "registered" | "not needed (...)" | "refused (...)" | ...
PATCH_STATUS: dict[str, str] = {}
_logged: set[str] = set()
_pending: list[tuple[int, str]] = []
_logging_ready: list[bool] = [False]
_last_plan: list[AllReducePlan] = []
_nccl_env_line: list[str] = []

# The functions SGLang calls load_plugins() from, and the process each one is the entry of:
# (module, qualified name, role). test_process_roles checks each row against the installed
# sglang. ``launch_server``'s and ``sglang serve``'s main call it too: the launcher.
ROLE_ENTRIES = (
    ("sglang.srt.managers.scheduler", "run_scheduler_process", "scheduler"),
    ("sglang.srt.managers.detokenizer_manager", "run_detokenizer_process", "detokenizer"),
    (
        "sglang.srt.managers.data_parallel_controller",
        "run_data_parallel_controller_process",
        "dp_controller",
    ),
    ("sglang.srt.entrypoints.engine", "Engine.__init__", "engine"),
    ("sglang.srt.entrypoints.engine", "Engine._launch_subprocesses", "engine"),
)
# Where load_plugins() is called from outside those functions (the launcher; a script, a tool or
# a test that loads plugins itself), the modules loaded say what the process is, the most telling
# first: the engine's module is loaded only where SGLang's engine runs in-process (the scheduler
# and the DP controller never import it); none of them: the launcher.
ROLE_MODULES = (
    ("sglang.srt.entrypoints.engine", "engine"),
    ("sglang.srt.managers.scheduler", "scheduler"),
    ("sglang.srt.managers.detokenizer_manager", "detokenizer"),
)
# Processes that spawn schedulers: each publishes its own plan for them.
SPAWNER_ROLES = ("launcher", "engine", "dp_controller")
# load_plugins() ran while multiprocessing was still starting this process: a module-level call
# in the parent's __main__, which a spawned child re-imports before it knows what it will run.
# Such a child registers what the processes SGLang's API may run in it need (a script's child
# may create an Engine; SGLang's children are schedulers and DP controllers), keeps the plan it
# inherited, and learns its role when SGLang's entry function reports its status.
BOOTSTRAPPING = "bootstrapping"
BOOTSTRAPPING_ROLES = ("engine", "scheduler", "dp_controller")
# The scheduler function a spawner hands its schedulers ("module:qualname"), published next to
# the plan: a fork's own ``run_scheduler_process_func`` may call load_plugins() before SGLang's
# ``run_scheduler_process`` does, and is then the scheduler's entry on the stack.
SCHEDULER_ENTRY_ENV = "SGLANG_SM120_SCHEDULER_ENTRY"

_role: list[str] = []


def _module_name(name: str | None) -> str | None:
    """A spawned child runs its parent's ``__main__`` as ``__mp_main__``: one module."""
    return "__main__" if name == "__mp_main__" else name


def _dotted(name: str, inner: tuple[str, ...] = ()) -> bool:
    parts = name.split(".")
    return all(p.isidentifier() or p in inner for p in parts) and parts[-1].isidentifier()


def scheduler_entry_problem(raw: str) -> str | None:
    """Why ``raw`` cannot be the scheduler function a spawner named (``name_scheduler_entry``
    writes ``module:qualname`` of a function), or None. Refused: anything but a module and a
    function's qualified name (``__main__:<module>`` is every module-level call of a script),
    and a function of this package (``sglang_sm120.commands.cli:main`` is doctor itself)."""
    module, _, qualname = raw.partition(":")
    if not (_dotted(module) and _dotted(qualname, inner=("<locals>",))):
        return "not a scheduler function's module:qualname, e.g. my_fork.server:run_scheduler"
    if module.split(".")[0] == "sglang_sm120":
        return "a function of sglang-sm120, which is never a scheduler's entry"
    return None


def _role_entries() -> dict[tuple[str | None, str], str]:
    entries = {(module, name): role for module, name, role in ROLE_ENTRIES}
    raw = os.environ.get(SCHEDULER_ENTRY_ENV, "")
    if not raw:
        return entries
    problem = scheduler_entry_problem(raw)
    if problem is not None:
        log_once(
            logging.WARNING,
            f"sglang-sm120: {SCHEDULER_ENTRY_ENV}={shown(raw)} ignored ({problem}): "
            "process roles are decided from SGLang's own entry functions",
        )
        return entries
    module, _, qualname = raw.partition(":")
    entries.setdefault((_module_name(module), qualname), "scheduler")
    return entries


def role_from_stack(frame: Any) -> str | None:
    """The role of the innermost ``ROLE_ENTRIES`` function (or the scheduler function this
    process's spawner named, ``SCHEDULER_ENTRY_ENV``) on the stack from ``frame``."""
    entries = _role_entries()
    while frame is not None:
        key = (_module_name(frame.f_globals.get("__name__")), frame.f_code.co_qualname)
        if key in entries:
            return entries[key]
        frame = frame.f_back
    return None


def name_scheduler_entry(run_scheduler_process_func: Any) -> None:
    """Tell the schedulers about to be spawned which function they run (``SCHEDULER_ENTRY_ENV``);
    a callable without a module and qualified name (a partial) is not named."""
    module = getattr(run_scheduler_process_func, "__module__", None)
    qualname = getattr(run_scheduler_process_func, "__qualname__", None)
    if module and qualname:
        os.environ[SCHEDULER_ENTRY_ENV] = f"{_module_name(module)}:{qualname}"
    else:
        os.environ.pop(SCHEDULER_ENTRY_ENV, None)


def _decide_role(frame: Any) -> str:
    role = role_from_stack(frame)
    if role is not None:
        return role
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        return BOOTSTRAPPING
    return next((r for module, r in ROLE_MODULES if module in sys.modules), "launcher")


def process_role() -> str:
    """``launcher``, ``engine``, ``dp_controller``, ``scheduler`` (a TP worker), ``detokenizer``
    (or ``bootstrapping``): decided when ``load_plugins()`` first runs, from the SGLang entry
    function that called it (``ROLE_ENTRIES``), not from the modules loaded (an Engine process
    and the DP controller import the scheduler module too, and a child that multiprocessing
    spawns re-imports its parent's ``__main__`` with whatever that imports). Only a caller
    outside SGLang's entries is judged by its modules (``ROLE_MODULES``)."""
    if not _role:
        _role.append(_decide_role(sys._getframe(1)))
    elif _role[0] == BOOTSTRAPPING:  # the entry function may be on the stack by now
        _role[0] = role_from_stack(sys._getframe(1)) or BOOTSTRAPPING
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


def logging_ready() -> bool:
    """Whether this process's status line is out (SGLang configured its logging)."""
    return _logging_ready[0]


def withdraw_launch_plan() -> None:
    """Publish no plan: the processes this one spawns leave every decision to upstream."""
    os.environ.pop(LAUNCH_PLAN_ENV, None)
    _launch_plan.cache_clear()


def logging_configured(first: str) -> None:
    """SGLang has configured this process's logging: log ``first`` (the status line), then
    what waited for it."""
    _logging_ready[0] = True
    log_once(logging.INFO, first)
    waiting, _pending[:] = list(_pending), []
    for level, message in waiting:
        logger.log(level, message)


def env_switch(name: str, unreadable: bool | None = None) -> bool | None:
    """The boolean switch ``name``, read one way for every switch the package reads
    (``env_values.switch_value``): 1, true, yes, y, on -> True; 0, false, no, n, off -> False;
    unset or empty -> None. Anything else is ``unreadable`` (None: the caller's default), with
    one warning naming the variable and the value."""
    try:
        return switch_value(os.environ.get(name))
    except ValueError as exc:
        taken = "ignored, default kept" if unreadable is None else f"read as {_onoff(unreadable)}"
        log_once(logging.WARNING, f"sglang-sm120: {name}={exc}: {taken}")
        return unreadable


def env_int(name: str, default: int, *, maximum: int) -> int:
    """The integer variable ``name``, 1..``maximum`` (``env_values.number``); unset or empty ->
    ``default``, and so is a value refused, with one warning naming the variable, the value
    and the bound."""
    return _env_number(name, default, int, maximum)


def env_float(name: str, default: float, *, maximum: float) -> float:
    """``env_int``'s twin for a finite number above 0 and at most ``maximum`` (no nan, inf)."""
    return _env_number(name, default, float, maximum)


def _env_number(name: str, default: Any, kind: type, maximum: float) -> Any:
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        return number(name, raw, kind, maximum=maximum)
    except ValueError as exc:
        log_once(logging.WARNING, f"sglang-sm120: {exc}: using {default}")
        return default


def _onoff(value: bool) -> str:
    return "on" if value else "off"


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
            f"sglang-sm120: {VALIDATION_ENV}={shown(value)} ignored: "
            "only 1 turns validation mode on",
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
    unset. Set to a value that is no switch word (empty included) it is off, as upstream reads
    such a value (its default, off, with a warning): a plan never turns it into "on". The
    pcie_ipc_enable patch hands upstream this value, so the two cannot disagree."""
    if PCIE_IPC_ENV not in os.environ:
        return None
    choice = env_switch(PCIE_IPC_ENV, unreadable=False)
    return False if choice is None else choice


def plugin_backend() -> str | None:
    """SGLANG_SM120_FUSION_BACKEND, or None when unset, "auto" or invalid (said once)."""
    raw = os.environ.get(PLUGIN_BACKEND_ENV, "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw not in PLUGIN_BACKEND_CHOICES:
        log_once(
            logging.WARNING,
            f"sglang-sm120: {PLUGIN_BACKEND_ENV}={shown(raw)} ignored; "
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
    """This host's checks and its cached p2p probe, both about the GPUs ``gpu_ids`` (the TP
    group; default every visible one): GPUs the server does not use are no finding. NVML is
    asked only when the facts came from it: a profile describes another machine. Never raises."""
    from sglang_sm120.machine.p2p_probe import load_probe

    probe, note = load_probe(facts, gpu_ids)
    skip = None if facts.source == "nvml" else f"facts from {facts.source}, not this machine"
    checks = run_host_checks(tp, hidden, gpu_ids=gpu_ids, skip_nvml=skip, probe=probe)
    return HostFindings(checks, probe, note)


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
    base + r * tp * pp * step + p * tp + t * step, with ``tp`` and ``pp`` the ranks and stages
    on this node (``Deployment.ranks_per_node``)."""
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
    deployment = Deployment(
        tp_size=view.tp_size,
        nnodes=view.nnodes,
        pp_size=view.pp_size,
        attention_dp=attention_dp,
        moe_a2a_backend=view.moe_a2a_backend,
        model_arch=model_config.hf_config.architectures[0],
        dtype=dtype,
        fusion_backend_flag=view.flashinfer_allreduce_fusion_backend,
        enforce_disable_fusion=bool(view.enforce_disable_flashinfer_allreduce_fusion),
        pcie_ipc_env=pcie_ipc_env(),
        deterministic=bool(view.enable_deterministic_inference),
        plugin_backend=plugin_backend(),
        ray=bool(view.use_ray),
        disaggregation=view.disaggregation_mode not in (None, "null"),
        custom_all_reduce=not view.disable_custom_all_reduce,
        enable_mscclpp=bool(view.enable_mscclpp),
        enable_torch_symm_mem=bool(view.enable_torch_symm_mem),
        enable_symm_mem=bool(view.enable_symm_mem),
        any_arch=validation_mode(),
    )
    tp_here, pp_here = deployment.ranks_per_node()
    gpu_ids = node_gpu_ids(
        tp=tp_here,
        pp=pp_here,
        # Multi-node DP replicas are refused upstream (validation_hook.check_server_args).
        replicas=view.dp_size if view.dp_size > 1 and not attention_dp and view.nnodes == 1 else 1,
        base_gpu_id=view.base_gpu_id,
        gpu_id_step=view.gpu_id_step,
    )
    deployment = dataclasses.replace(deployment, gpu_ids=gpu_ids)
    deployment = with_tuning(deployment, model_config.hidden_size, dtype)
    return with_host_findings(deployment, model_config.hidden_size)


def record_nccl_env(line: str) -> None:
    """What the ``nccl_tuned_env`` patch set in this worker, or why nothing: its status line."""
    _nccl_env_line[:] = [line]


def nccl_env_line() -> str | None:
    """The line ``record_nccl_env`` kept, or None where the patch did not run."""
    return _nccl_env_line[0] if _nccl_env_line else None


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


def plan_to_publish(
    facts: HostFacts, deployment: Deployment, archs: Collection[str] | None = None
) -> tuple[AllReducePlan, str | None]:
    """The plan for a launch and the launch plan its processes get (None: publish nothing).
    ``archs``: the architectures with a fused point (default: the installed sglang's own).

    The launch plan must fit the environment (LAUNCH_PLAN_MAX_BYTES). A tuning table whose plan
    would not fit is not used: the plan without it, which says why, is published instead; a plan
    that still would not fit is not published, and upstream decides (said as an ERROR)."""
    archs = fusion_archs() if archs is None else archs
    plan = with_tuned_nccl_env(plan_allreduce(facts, deployment, archs), facts, deployment)
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
        plan = with_tuned_nccl_env(plan_allreduce(facts, deployment, archs), facts, deployment)
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
    """This process's plan for the server args ``view`` shows, logged once and published to the
    processes it spawns."""
    deployment = deployment_from_view(view)
    plan, published = plan_to_publish(current_facts(), deployment)
    return _publish(deployment, plan, published)


def _publish(deployment: Deployment, plan: AllReducePlan, published: str | None) -> AllReducePlan:
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


AUTO_ENABLE_PASS = "_flashinfer_allreduce_fusion_auto_enable"  # its declarations' source
FUSION_FIELD = "flashinfer_allreduce_fusion_backend"


def requested_view(server_args: Any) -> Any:
    """The server args as the fusion auto-enable pass saw them: the record's declarations made
    before that pass's (which the ``fusion_auto_enable`` patch always makes on a managed host).
    Resolution keeps its declarations on the record, also across pickling to child processes,
    so a process handed resolved server args sees what the user asked for."""
    from sglang.srt.arg_groups.model_override_base import ResolvedView

    overlay: dict[str, Any] = {}
    for source, declared in getattr(server_args, "_resolved_overrides", None) or ():
        if source == AUTO_ENABLE_PASS:
            break
        overlay.update(declared)
    return ResolvedView(server_args, overlay=overlay)


def plan_for_spawn(server_args: Any) -> AllReducePlan:
    """The plan a process publishes right before it spawns schedulers with ``server_args``
    (an Engine process, the DP controller): planned afresh from what the user asked for, so
    it is the plan the server args were resolved with, never one inherited from elsewhere.
    Server args resolved before the plugin loaded (``http_server.launch_server`` called with
    an unresolved record) may say another fused backend than the plan: then nothing is
    published (ERROR), and the schedulers leave every decision to upstream."""
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.connector import ConnectorType
    from sglang.srt.utils.common import parse_connector_type

    if parse_connector_type(server_args.model_path) == ConnectorType.INSTANCE:
        reason = (
            "plan not published: an instance connector (--model-path instance://...) makes "
            "SGLang skip its fusion auto-enable pass and its model overrides, so there is no "
            "model to plan for; upstream behaviour, untouched"
        )
        log_once(logging.WARNING, f"sglang-sm120: {reason}")
        return _publish(
            Deployment(tp_size=server_args.tp_size),
            AllReducePlan(False, None, "upstream", (reason,)),
            None,
        )
    deployment = deployment_from_view(requested_view(server_args))
    plan, published = plan_to_publish(current_facts(), deployment)
    resolved = resolution_result(server_args, FUSION_FIELD)
    if plan.managed and published is not None and resolved != plan.fusion_backend:
        reason = (
            f"plan not published: the server args were resolved before sglang-sm120 loaded "
            f"({FUSION_FIELD}={resolved!r}, the plan says {plan.fusion_backend!r}; call "
            "sglang.srt.plugins.load_plugins() before resolving them); upstream behaviour, "
            "untouched"
        )
        log_once(logging.ERROR, f"sglang-sm120: {reason}")
        plan, published = AllReducePlan(False, None, "upstream", (reason,)), None
    return _publish(deployment, plan, published)


def publish_for_schedulers(server_args: Any, run_scheduler_process_func: Any) -> None:
    """What a process's patch calls right before it spawns schedulers running
    ``run_scheduler_process_func`` (``name_scheduler_entry``, ``plan_for_spawn``); a failure to
    plan publishes nothing, logged, and never stops SGLang's start-up."""
    name_scheduler_entry(run_scheduler_process_func)
    try:
        plan_for_spawn(server_args)
    except Exception:
        logger.exception("sglang-sm120: could not plan for the schedulers; none published")
        withdraw_launch_plan()


@functools.cache
def _launch_plan() -> tuple[int, Capability, AllReducePlan] | None:
    raw = os.environ.get(LAUNCH_PLAN_ENV)
    if not raw:
        return None
    try:
        data = strict_json.fields(strict_json.loads(raw), "", known=LAUNCH_PLAN_KEYS)
        tp_size = strict_json.require(data, "tp_size", int, minimum=1, maximum=MAX_TP_SIZE)
        # Bounds no launcher exceeds: a plan it publishes is never refused by its workers.
        strict_json.require_list(data, "gpu_ids", int, max_items=MAX_TP_SIZE, minimum=0)
        capability = Capability.from_json(strict_json.require(data, "capability", dict))
        plan = AllReducePlan.from_json(strict_json.require(data, "plan", dict))
    except (ValueError, RecursionError) as exc:  # JsonInputError, FieldError: one line
        reason = str(exc) or type(exc).__name__
        log_once(logging.WARNING, f"sglang-sm120: {LAUNCH_PLAN_ENV} unreadable ({reason}): ignored")
        return None
    _last_plan[:] = [plan]
    if plan.managed:
        log_once(logging.INFO, f"sglang-sm120 plan (from launcher, tp={tp_size}): {plan.summary()}")
    return tp_size, capability, plan


# What nccl_tuned_env says in a TP worker without a launch plan (doctor's worker check).
NO_LAUNCH_PLAN_NCCL = "nccl env: none (no plan from the launcher)"


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
