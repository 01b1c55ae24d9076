"""``sglang-sm120 doctor``: this machine as SGLang's processes see it: versions, GPUs and links,
host checks, the p2p probe, what the launcher and a TP worker really apply, the upstream
contract, the plan and the kernel images' coverage."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

from sglang_sm120.commands.args import (
    add_deployment_args,
    check_tp,
    check_upstream_flags,
    compute_capability,
    require_sglang,
)
from sglang_sm120.commands.plan import facts_lines, plan_for_args, plan_lines
from sglang_sm120.machine.facts import current_facts
from sglang_sm120.machine.host_checks import HostFindings, format_checks
from sglang_sm120.planning.policy import VALIDATION_NOTE
from sglang_sm120.version import SGLANG_PIN, __version__

_WORKER_REPORT = (
    "import json, sglang.srt.managers.scheduler\n"
    "from sglang.srt.plugins import load_plugins\n"
    "load_plugins()\n"
    "from sglang_sm120.server.status import verify_applied\n"
    "print('WORKER ' + json.dumps(verify_applied()))\n"
)


def _worker_statuses() -> dict[str, str]:
    """What a TP worker process applies here: loaded as SGLang's scheduler process loads it
    (scheduler imported first), in a subprocess, so this process stays a launcher."""
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER_REPORT], capture_output=True, text=True, timeout=300
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("WORKER ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"(worker)": f"could not load the plugin as a TP worker would: {tail}"}
    return json.loads(lines[-1].removeprefix("WORKER "))


def _unvisited_status(module) -> str:
    """A patch only processes doctor does not start use (an Engine process, the DP controller):
    whether this host needs it, without claiming it was applied."""
    from sglang_sm120.server.plugin import ROLE_NAMES
    from sglang_sm120.server.runtime import sm12x_capability

    reason = module.not_needed(sm12x_capability())
    if reason is not None:
        return f"not needed ({reason})"
    names = " and ".join(ROLE_NAMES[role] for role in module.ROLES)
    return f"needed in the {names} (doctor starts no such process)"


def _plugin_state() -> dict[str, Any]:
    """Load plugins exactly as an SGLang launcher does, then as a TP worker does, and report
    what each really applied (every hook looked up in its target's applied chain)."""
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
    by_process = {"launcher": verify_applied(), "TP worker": _worker_statuses()}
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
        host_findings,
        plugin_disabled,
        validation_mode,
    )

    variables = variables_report()  # before loading plugins, which drop an inherited plan
    facts = current_facts()
    tp_size = args.tp or max(len(facts.gpus), 1)
    if facts.gpus:
        check_tp(facts, tp_size, args.nnodes)
    require_sglang()
    check_upstream_flags(args)
    findings = host_findings(
        facts, tp_size, args.hidden, tuple(range(min(tp_size, len(facts.gpus)))) or None
    )
    host = findings if findings_describe(facts) else None
    plan = plan_for_args(facts, args, tp_size, local_tuning=True, host=host)
    state = _plugin_state()
    capability = args.capability or (facts.gpus[0].capability if facts.gpus else None)
    coverage = _kernel_coverage(capability)
    report = {
        "sglang_sm120": __version__,
        "sglang_pin": SGLANG_PIN,
        "versions": facts.versions,
        "facts": facts.to_json(),
        "gpu_present": bool(facts.gpus),
        "plan": {**plan.to_json(), "tp": tp_size},
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
    lines.append("patches:")
    lines += [f"  {name:<22} {status}" for name, status in state["patches"].items()]
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
