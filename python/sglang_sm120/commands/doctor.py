"""``sglang-sm120 doctor``: this machine as SGLang's processes see it: versions, GPUs and links,
host checks, the p2p probe, what the launcher and a TP worker really apply, the upstream
contract, the plan and the kernel images' coverage."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import warnings
from typing import Any

from sglang_sm120 import strict_json
from sglang_sm120.commands.allreduce_options import deployment_for, mscclpp_imports
from sglang_sm120.commands.args import (
    add_deployment_args,
    check_tp,
    check_upstream_flags,
    compute_capability,
    one_line,
    require_sglang,
)
from sglang_sm120.commands.plan import facts_lines, plan_for_args, plan_lines
from sglang_sm120.machine.facts import HostFacts, current_facts
from sglang_sm120.machine.host_checks import HostFindings, format_checks
from sglang_sm120.planning.levers import allreduce_levers, lever_lines
from sglang_sm120.planning.nccl_settings import nccl_env_to_apply, nccl_warnings, warning_lines
from sglang_sm120.planning.policy import VALIDATION_NOTE
from sglang_sm120.version import SGLANG_PIN, __version__

WORKER_TIMEOUT_S = 300


WORKER_FAILED = "could not load the plugin as a TP worker would"
# What a TP worker does before it loads plugins: SGLang's scheduler module imported first, so
# the process is judged a TP worker, then load_plugins(); it prints what it really applied.
WORKER_REPORT = (
    "import json, warnings\n"
    "warnings.filterwarnings('ignore', category=UserWarning, module=r'sglang(\\.|$)')\n"
    "import sglang.srt.managers.scheduler\n"
    "from sglang.srt.plugins import load_plugins\n"
    "load_plugins()\n"
    "from sglang_sm120.server.status import verify_applied\n"
    "print('WORKER ' + json.dumps(verify_applied()))\n"
)


class WorkerCheck:
    """The plugin loaded as a TP worker loads it, in a fresh interpreter started as doctor
    begins, so it imports SGLang while this process does the launcher's part: a fresh process,
    as SGLang spawns its schedulers (a fork of this one would carry the CUDA state SGLang's
    import creates on a GPU machine). Always stopped and reaped, whatever happens here."""

    def __init__(self, code: str = WORKER_REPORT) -> None:
        self.code = code

    def __enter__(self) -> WorkerCheck:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="backslashreplace",
        )
        return self

    def statuses(self) -> dict[str, str]:
        """The worker's report (each patch's status), or one ``(worker)`` line saying why not."""
        try:
            out, err = self.proc.communicate(timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return {"(worker)": f"{WORKER_FAILED}: no answer in {WORKER_TIMEOUT_S} s"}
        lines = [line for line in out.splitlines() if line.startswith("WORKER ")]
        try:
            report = strict_json.loads(lines[-1].removeprefix("WORKER ")) if lines else None
        except ValueError:
            report = None
        if isinstance(report, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in report.items()
        ):
            return report
        tail = (err.strip().splitlines() or [f"exit status {self.proc.returncode}"])[-1]
        return {"(worker)": f"{WORKER_FAILED}: {one_line(tail)}"}

    def __exit__(self, *exc: Any) -> None:
        if self.proc.poll() is None:  # doctor stopped before it asked: no child outlives it
            self.proc.kill()
            self.proc.communicate()


def _unvisited_status(module) -> str:
    """A patch only processes doctor does not start use (an Engine process, the DP controller):
    whether this host needs it, without claiming it was applied."""
    from sglang_sm120.server.runtime import sm12x_capability
    from sglang_sm120.server.status import ROLE_NAMES

    reason = module.not_needed(sm12x_capability())
    if reason is not None:
        return f"not needed ({reason})"
    names = " and ".join(ROLE_NAMES[role] for role in module.ROLES)
    return f"needed in the {names} (doctor starts no such process)"


def _plugin_state(worker: WorkerCheck) -> dict[str, Any]:
    """Load plugins exactly as an SGLang launcher does, then take what the TP worker process
    reported, and report what each really applied (every hook looked up in its target's
    applied chain)."""
    from importlib.metadata import entry_points

    from sglang.srt.plugins import load_plugins

    from sglang_sm120.server.contract import check
    from sglang_sm120.server.patches import PATCHES, patch_name
    from sglang_sm120.server.plugin import declared_contract
    from sglang_sm120.server.status import verify_applied

    discovered = any(
        ep.value == "sglang_sm120:register" for ep in entry_points(group="sglang.srt.plugins")
    )
    load_plugins()
    by_process = {"launcher": verify_applied(), "TP worker": worker.statuses()}
    if not by_process["launcher"]:
        unloaded = "plugin not loaded: check SGLANG_PLUGINS, which must include sglang_sm120"
        by_process["launcher"] = {"(none)": unloaded}
    patches = {}
    for module in PATCHES:  # each patch as the process that uses it reports it
        name = patch_name(module)
        seen = [statuses[name] for statuses in by_process.values() if name in statuses]
        used = [status for status in seen if not status.startswith("not used in the")]
        if not used and seen and not set(module.ROLES) & {"launcher", "scheduler"}:
            used = [_unvisited_status(module)]
        patches[name] = (used or seen or ["plugin not loaded"])[0]
    return {
        "entry_point_discovered": discovered,
        "patches": patches,
        "patches_by_process": by_process,
        "contract_problems": check(declared_contract(PATCHES)),
    }


def patch_lines(state: dict[str, Any]) -> list[str]:
    """Each patch's status, and a line for a process whose check could not run (its patches
    would otherwise read "not used in the launcher" and look fine)."""
    lines = ["patches:"]
    lines += [f"  {name:<22} {status}" for name, status in state["patches"].items()]
    for process, statuses in state["patches_by_process"].items():
        lines += [f"  {process}: {why}" for key, why in statuses.items() if key.startswith("(")]
    return lines


def _kernel_coverage(capability: tuple[int, int] | None) -> dict[str, Any]:
    """Which compiled kernel libraries have no SASS for this GPU and no PTX to JIT from."""
    if capability is None:
        return {
            "capability": None,
            "libraries": [],
            "missing": [],
            "note": "no GPU: pass --capability 12.0 to check another GPU's coverage",
        }
    from sglang_sm120.machine.kernel_images import check_coverage

    rows = [
        {
            "path": str(r.library.path),
            "package": r.library.package,
            "required": r.library.required,
            "ok": r.coverage.ok,
            "how": r.coverage.how,
            "detail": r.coverage.detail,
        }
        for r in check_coverage(capability)
    ]
    missing = [row for row in rows if not row["ok"] and row["how"] != "no-kernels"]
    return {"capability": list(capability), "libraries": rows, "missing": missing}


def _coverage_lines(report: dict[str, Any]) -> list[str]:
    if report["capability"] is None:
        return [f"kernel images: {report['note']}"]
    sm = "SM{}{}".format(*report["capability"])
    lines = [
        f"kernel images for {sm}: {len(report['libraries'])} libraries read, "
        f"{len(report['missing'])} without SASS or PTX for {sm}"
    ]
    for row in report["missing"]:
        need = "loaded by every server" if row["required"] else "loaded by some backends"
        lines.append(f"  MISSING {row['package']}: {row['path']} ({need}): {row['detail']}")
    return lines


def _probe_lines(findings: HostFindings, gpus: int) -> list[str]:
    if findings.probe is None:
        hint = " (`sglang-sm120 p2p` measures one)" if gpus >= 2 else ""
        return [f"p2p probe: {findings.probe_note}{hint}"]
    return [f"p2p probe: {findings.probe.describe()}", f"  from {findings.probe.path}"]


def progress(message: str) -> None:
    """What doctor is doing, on stderr, so a wait of seconds is not a silence."""
    print(f"sglang-sm120 doctor: {message}", file=sys.stderr, flush=True)


def describe_source(facts: HostFacts) -> str:
    gpus = f"{len(facts.gpus)} GPU{'s' if len(facts.gpus) != 1 else ''}" if facts.gpus else "no GPU"
    return f"{gpus} ({facts.source})"


def import_sglang() -> None:
    """SGLang's launcher-side modules, in this process (the worker check imports its own). The
    UserWarnings SGLang raises while importing on a machine without a GPU (AWQ, GGUF, Triton)
    are about upstream's import, not this machine: not shown."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"sglang(\.|$)")
    import sglang.srt.arg_groups.overrides
    import sglang.srt.plugins  # noqa: F401


def _variable_lines(rows: list[dict[str, str]]) -> list[str]:
    """The variables section: each one set, its value, accepted or refused, what is used."""
    if not rows:
        return ["variables: none of ours set"]
    lines = ["variables (set; refused ones are replaced by what is used):"]
    for row in rows:
        lines.append(f"  {row['name']}={row['value']}: {row['status']}; uses {row['used']}")
    return lines


def run(args: argparse.Namespace) -> int:
    from sglang_sm120.server.env_report import variables_report
    from sglang_sm120.server.runtime import (
        findings_describe,
        fusion_archs,
        host_findings,
        plugin_disabled,
        validation_mode,
    )

    variables = variables_report()  # before loading plugins, which drop an inherited plan
    facts = current_facts()  # NVML or a topology: well under a second
    tp_size = args.tp or max(len(facts.gpus), 1)
    if facts.gpus:
        check_tp(facts, tp_size, args.nnodes)
    require_sglang()
    check_upstream_flags(args)  # bad input is still one line, before any progress line
    progress(f"{describe_source(facts)}; loading SGLang, as the launcher and a TP worker ...")
    with WorkerCheck() as worker:
        import_sglang()
        findings = host_findings(
            facts, tp_size, args.hidden, tuple(range(min(tp_size, len(facts.gpus)))) or None
        )
        host = findings if findings_describe(facts) else None
        plan = plan_for_args(facts, args, tp_size, local_tuning=True, host=host)
        deployment = deployment_for(args, tp_size, local_tuning=True, host=host)
        levers = allreduce_levers(facts, deployment, plan, fusion_archs(), mscclpp_imports())
        nccl = nccl_warnings(os.environ, facts, deployment, plan)
        nccl_set, nccl_line = nccl_env_to_apply(plan, os.environ)  # what a TP worker here sets
        state = _plugin_state(worker)
    progress("reading the kernel images ...")
    capability = args.capability or (facts.gpus[0].capability if facts.gpus else None)
    coverage = _kernel_coverage(capability)
    report = {
        "sglang_sm120": __version__,
        "sglang_pin": SGLANG_PIN,
        "versions": facts.versions,
        "facts": facts.to_json(),
        "gpu_present": bool(facts.gpus),
        "plan": {**plan.to_json(), "tp": tp_size},
        "allreduce_options": [lever.to_json() for lever in levers],
        "nccl_warnings": [warning.to_json() for warning in nccl],
        "nccl_env": {"tuned": dict(plan.nccl_env), "set": dict(nccl_set), "why": nccl_line},
        **state,
        "kill_switch": plugin_disabled(),
        "validation_mode": validation_mode(),
        "variables": variables,
        "kernel_images": coverage,
        "host_checks": [check.to_json() for check in findings.checks],
        "host_checks_used_by_plan": host is not None,
        "p2p_probe": (
            findings.probe.to_json() if findings.probe else {"note": findings.probe_note}
        ),
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    lines = [f"sglang-sm120 {__version__} (for sglang {SGLANG_PIN})", "versions:"]
    lines += [f"  {name}: {version or 'not installed'}" for name, version in facts.versions.items()]
    lines.append(f"  sgl-kernel-sm120 library: {facts.sm120_kernel_problem or 'loads'}")
    lines += facts_lines(facts)
    if not facts.gpus:
        lines.append(
            "no GPU here: nothing to patch; "
            "use `sglang-sm120 plan --profile ...` to plan another machine"
        )
    lines.append(
        f"entry point sglang.srt.plugins -> sglang_sm120: "
        f"{'discovered' if state['entry_point_discovered'] else 'NOT discovered'}"
    )
    lines += patch_lines(state)
    problems = state["contract_problems"]
    lines.append("upstream contract: " + ("ok" if not problems else "MISMATCH"))
    lines += [f"  - {p}" for p in problems]
    if report["kill_switch"]:
        lines.append("kill switch SGLANG_SM120_DISABLE=1: the plan below is not applied")
    if report["validation_mode"]:
        lines.append(f"VALIDATION MODE ON: {VALIDATION_NOTE}")
    lines += format_checks(findings.checks)
    lines += _probe_lines(findings, len(facts.gpus))
    if host is None:
        lines.append(
            f"  (host checks read this machine; the plan below is for {facts.source} and does "
            "not use them: set SGLANG_SM120_SYSFS_ROOT to that machine's sysfs dump)"
        )
    lines += plan_lines(plan, tp_size)
    lines += lever_lines(levers)
    lines += warning_lines(nccl)
    lines.append(f"in a TP worker with this environment: {nccl_line}")
    lines += _coverage_lines(coverage)
    lines += _variable_lines(variables)
    print("\n".join(lines))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("doctor", help="this machine: facts, patch statuses, plan")
    add_deployment_args(parser, tp_required=False)
    parser.add_argument(
        "--capability",
        type=compute_capability,
        help="check kernel images for this compute capability, e.g. 12.0",
    )
    parser.set_defaults(func=run)
