"""``sglang-sm120 doctor``: this machine as SGLang's processes see it: versions, GPUs and links,
host checks, the p2p probe, what the launcher and a TP worker really apply, the upstream
contract, the plan and the kernel images' coverage."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

from sglang_sm120.commands.allreduce_options import deployment_for, mscclpp_imports
from sglang_sm120.commands.args import (
    add_deployment_args,
    check_rank_count,
    check_tp,
    check_upstream_flags,
    compute_capability,
    require_sglang,
)
from sglang_sm120.commands.plan import facts_lines, plan_for_args, plan_lines
from sglang_sm120.commands.plugin_check import (
    WorkerCheck,
    check_key,
    import_sglang,
    keep_state,
    kept_state,
    patch_lines,
    plugin_state,
)
from sglang_sm120.machine.facts import HostFacts, current_facts
from sglang_sm120.machine.host_checks import HostFindings, format_checks
from sglang_sm120.machine.nccl_conf import nccl_settings
from sglang_sm120.planning.levers import allreduce_levers, lever_lines
from sglang_sm120.planning.nccl_settings import nccl_env_to_apply, nccl_warnings, warning_lines
from sglang_sm120.planning.policy import VALIDATION_NOTE, AllReducePlan, upstream_decides
from sglang_sm120.planning.upstream import FUSION_ARCHS
from sglang_sm120.server.runtime import NO_LAUNCH_PLAN_NCCL
from sglang_sm120.server.status import applies_nothing
from sglang_sm120.version import SGLANG_PIN, __version__


def with_nccl_status(state: dict[str, Any], nccl_set: tuple, nccl_line: str) -> dict[str, Any]:
    """nccl_tuned_env as a launched TP worker would report it: doctor's worker check has no
    launch plan, so its own status ("no plan from the launcher") says nothing about this host;
    what a worker started with this environment would set does."""
    if state["patches"].get("nccl_tuned_env") != f"not needed ({NO_LAUNCH_PLAN_NCCL})":
        return state  # not loaded, refused, or not an SM12x host: the worker's word stands
    status = f"needed in the TP worker ({nccl_line})" if nccl_set else f"not needed ({nccl_line})"
    return {**state, "patches": {**state["patches"], "nccl_tuned_env": status}}


def plan_in_force(
    plan: AllReducePlan, patches: dict[str, str], by_process: dict[str, dict[str, str]]
) -> AllReducePlan:
    """The plan SGLang's processes follow: the plugin's, or, where the plugin applies nothing
    (another sglang, a contract mismatch, the kill switch, a target that does not import, the
    plugin not loaded), upstream's own behaviour and why: what a user reads is what the server
    does. Judged per process as well: each checks the contract of its own patches only, and a
    TP worker that applies nothing carries no route of the plan, whatever the launcher did."""
    why = applies_nothing(patches)
    for process, statuses in by_process.items():
        if why is None and (alone := applies_nothing(statuses)) is not None:
            why = f"{alone} (in the {process})"
    return plan if why is None else upstream_decides(why)


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
    facts = current_facts()  # NVML or a topology: well under a second
    tp_size = args.tp or max(len(facts.gpus), 1)
    if facts.gpus:
        check_tp(facts, tp_size, args.nnodes, args.pp_size)
    else:  # nothing to run on here, but a plan of more ranks than any machine has is refused
        check_rank_count(tp_size, args.pp_size)
    require_sglang()
    check_upstream_flags(args)  # bad input is still one line, before any progress line
    key = check_key(facts)
    reused, unusable = (None, None) if args.recheck else kept_state(key)
    if unusable is not None:  # a damaged or foreign cache: checked again, and said so
        progress(f"kept patch checks not used: {unusable}; checking again")
    if reused is None:
        progress(f"{describe_source(facts)}; loading SGLang, as the launcher and a TP worker ...")
    else:
        progress(f"{describe_source(facts)}; patch checks reused (checked {reused[1]}) ...")
    with WorkerCheck() if reused is None else contextlib.nullcontext() as worker:
        if worker is not None:
            import_sglang()
        findings = host_findings(
            facts, tp_size, args.hidden, tuple(range(min(tp_size, len(facts.gpus)))) or None
        )
        host = findings if findings_describe(facts) else None
        plan = plan_for_args(facts, args, tp_size, local_tuning=True, host=host, archs=FUSION_ARCHS)
        deployment = deployment_for(args, tp_size, local_tuning=True, host=host)
        mscclpp = mscclpp_imports()
        if worker is not None:
            state = plugin_state(worker)
            checked, not_kept = keep_state(key, state)
        else:
            (state, checked), not_kept = reused, None
    plugin_plan = plan
    plan = plan_in_force(plan, state["patches"], state["patches_by_process"])
    levers = allreduce_levers(facts, deployment, plan, FUSION_ARCHS, mscclpp)
    # what NCCL will see: the environment over its config files, one reader for both
    settings = nccl_settings(os.environ)
    nccl = nccl_warnings(settings, facts, deployment, plan)
    # what a TP worker started with this environment (and NCCL's config files) would set
    nccl_set, nccl_line = nccl_env_to_apply(plan, settings)
    state = with_nccl_status(state, nccl_set, nccl_line)
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
        "plan_not_in_force": None if plan is plugin_plan else plugin_plan.to_json(),
        "allreduce_options": [lever.to_json() for lever in levers],
        "nccl_warnings": [warning.to_json() for warning in nccl],
        "nccl_conf_unreadable": settings.unreadable,
        "nccl_env": {"tuned": dict(plan.nccl_env), "set": dict(nccl_set), "why": nccl_line},
        **state,
        "plugin_check": {
            "reused": reused is not None,
            "checked_at": checked,
            "not_kept": not_kept,
            "kept_unusable": unusable,
        },
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
    if reused is not None:
        lines.append(
            f"  (checked {checked} in a launcher and a TP worker; nothing that decides them has "
            "changed since; `doctor --recheck` checks again)"
        )
    if not_kept is not None:
        lines.append(f"  ({not_kept}: the next doctor checks again)")
    problems = state["contract_problems"]
    lines.append("upstream contract: " + ("ok" if not problems else "MISMATCH"))
    lines += [f"  - {p}" for p in problems]
    if report["kill_switch"]:
        lines.append("kill switch SGLANG_SM120_DISABLE=1: the plugin applies nothing")
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
    if plan is not plugin_plan:
        lines.append(
            f"  (the plugin's plan, not in force: fusion_backend="
            f"{plugin_plan.fusion_backend or 'off'}  plain_allreduce={plugin_plan.plain_allreduce})"
        )
    lines += lever_lines(levers)
    lines += warning_lines(nccl, settings.unreadable)
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
    parser.add_argument(
        "--recheck",
        action="store_true",
        help="load the plugin as the launcher and a TP worker again, even where nothing that "
        "decides what they apply has changed since the last check",
    )
    parser.set_defaults(func=run)
