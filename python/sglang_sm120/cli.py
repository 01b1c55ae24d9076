"""``sglang-sm120``: show what the plugin sees and decides.

sglang-sm120 doctor [--tp N] [--model-arch A] [--json]
    this machine: versions, GPUs, P2P, NVLink, NUMA, host checks (IOMMU, ACS, the driver's P2P
    mode, PCIe links, BAR1, topology, persistence), each patch's status, the plan
sglang-sm120 plan (--profile NAME | --topology FILE) --tp N [--model-arch A] [--json]
    the plan for a machine you are not on
sglang-sm120 tune --tp N [--hidden H] [--tokens T ...]
    measure every all-reduce backend on this host's GPUs, write the tuning table
sglang-sm120 p2p [--gpus 0,1,...] [--json]
    measure P2P write/read bandwidth and latency per GPU pair, then all at once: do writes
    collapse under concurrency? (saved next to the tuning table; doctor and the plan cite it)
sglang-sm120 warmup [--dry-run] [--vocab-size V]
    compile the JIT kernels the server needs on this GPU, before the server starts
sglang-sm120 profiles
    the embedded machine profiles, one line each
sglang-sm120 selftest [--tp N] [--target PATH --draft PATH] [--json] [--keep-logs DIR]
    start SGLang servers on this machine's GPUs and check the EAGLE-3 fast path end to end
sglang-sm120 --version
    this plugin's version, the sglang it is pinned to, and the installed kernel package

Bad input (a flag out of range, a topology that does not follow the schema in topology.py, no
importable sglang) is one line on stderr and exit status 2, before anything else is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import subprocess
import sys
from importlib import metadata
from typing import Any, NoReturn

from sglang_sm120 import SGLANG_PIN, __version__
from sglang_sm120.facts import (
    HostFacts,
    current_facts,
    load_profile,
    load_topology,
    profile_descriptions,
    profile_names,
)
from sglang_sm120.host import HostFindings, format_checks
from sglang_sm120.policy import (
    PLUGIN_BACKEND_CHOICES,
    PLUGIN_BACKEND_ENV,
    VALIDATION_NOTE,
    AllReducePlan,
    Deployment,
)
from sglang_sm120.topology import MAX_NODES, TopologyError

KERNEL_DISTRIBUTION = "sgl-kernel-sm120"


class UsageError(ValueError):
    """Input the command cannot use; main() prints it as one line and exits 2."""


def one_line(text: str) -> str:
    """``text`` as one printable line: a newline or other control character a user typed (in a
    path, a flag value) is shown escaped, as repr() shows it, instead of breaking the line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (no usage block), still exit status 2."""

    commands: tuple[str, ...] = ()  # the subcommands, for "a command is required"

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {one_line(message)} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # also past Python's 4300 digits
        shown = repr(text) if len(text) <= 40 else repr(text[:37] + "...")
        raise argparse.ArgumentTypeError(f"{shown} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _node_count(text: str) -> int:
    """--nnodes: 1..MAX_NODES, the topology schema's own bound."""
    value = _positive_int(text)
    if value > MAX_NODES:
        raise argparse.ArgumentTypeError(
            f"{value} is above {MAX_NODES}, the most nodes a deployment may have here"
        )
    return value


#: --dtype: the dtype the model runs in, as the plan compares it; SGLang's aliases map to it.
DTYPES = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float32": "float32",
    "half": "float16",
    "float": "float32",
}


def _dtype(text: str) -> str:
    if text == "auto":
        raise argparse.ArgumentTypeError(
            "'auto' is SGLang's choice from the model's config, which doctor and plan do not "
            "read; give the dtype it resolves to (bfloat16, float16 or float32)"
        )
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r} is not a model dtype ({', '.join(DTYPES)})"
        )
    return DTYPES[text]


def _model_arch(text: str) -> str:
    """A config.json architecture: a Python class name, e.g. DeepseekV3ForCausalLM."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,99}", text):
        raise argparse.ArgumentTypeError(
            f"{text[:60]!r} is not an architecture class name such as "
            "KimiK25ForConditionalGeneration (config.json's architectures[0])"
        )
    return text


#: flags doctor and plan take as SGLang's, checked against SGLang's own parser: ours -> theirs
UPSTREAM_FLAGS = {
    "fusion_backend": "--flashinfer-allreduce-fusion-backend",
    "moe_a2a_backend": "--moe-a2a-backend",
}


@functools.cache
def upstream_choices() -> dict[str, list[str]]:
    """The choices SGLang's own parser gives the UPSTREAM_FLAGS (built from ServerArgs once). A
    flag SGLang renamed, or one that lost its choices, is left out: it is then not checked,
    rather than failing every doctor and plan."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    actions = parser._option_string_actions  # argparse keeps no public map of its options
    choices = {}
    for ours, theirs in UPSTREAM_FLAGS.items():
        action = actions.get(theirs)
        if action is not None and action.choices:
            choices[ours] = [str(choice) for choice in action.choices]
    return choices


def _check_upstream_flags(args: argparse.Namespace) -> None:
    """A value SGLang would refuse is not planned as if it meant something (SGLang's parser
    is built only where such a flag was given)."""
    given = {name: getattr(args, name) for name in UPSTREAM_FLAGS}
    for name, value in given.items():
        if value is None:
            continue
        choices = upstream_choices().get(name)
        if choices is not None and value not in choices:
            flag = "--" + name.replace("_", "-")
            raise UsageError(
                f"{flag} {value[:40]!r} is not one of SGLang's choices ({', '.join(choices)})"
            )


def _capability(text: str) -> tuple[int, int]:
    """'12.0' or '12' -> (12, 0)."""
    match = re.fullmatch(r"(\d{1,2})(?:\.(\d))?", text.strip())
    if not match or not 1 <= int(match[1]) <= 20:
        raise argparse.ArgumentTypeError(f"{text!r} is not a compute capability such as 12.0")
    return int(match[1]), int(match[2] or 0)


def _installed(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def version_text() -> str:
    """Plugin version, the pinned sglang and the kernel package, each with what is installed."""
    return (
        f"sglang-sm120 {__version__}: sglang {_installed('sglang')} (pinned {SGLANG_PIN}), "
        f"{KERNEL_DISTRIBUTION} {_installed(KERNEL_DISTRIBUTION)} (pinned {__version__})"
    )


def _require_sglang() -> None:
    """Planning reads upstream's own tables, so sglang must import; say so in one line."""
    try:
        import sglang  # noqa: F401
    except ImportError as exc:
        raise UsageError(
            f"sglang is not importable ({exc}); sglang-sm120 {__version__} needs "
            f"sglang=={SGLANG_PIN} (pip install sglang=={SGLANG_PIN})"
        ) from None


def _check_tp(facts: HostFacts, tp_size: int, nnodes: int) -> None:
    """A tensor-parallel group cannot be larger than the GPUs it would run on."""
    available = len(facts.gpus) * nnodes
    if tp_size > available:
        raise UsageError(
            f"--tp {tp_size} needs {tp_size} GPU{'s' if tp_size > 1 else ''}; "
            f"{facts.source} has {len(facts.gpus)}"
            + (f" x {nnodes} nodes" if nnodes > 1 else "")
            + " (pass --nnodes for a multi-node deployment)"
        )


def _add_deployment_args(parser: argparse.ArgumentParser, tp_required: bool) -> None:
    parser.add_argument(
        "--tp",
        type=_positive_int,
        required=tp_required,
        help="tensor-parallel size" + ("" if tp_required else " (default: every GPU here)"),
    )
    parser.add_argument(
        "--model-arch",
        type=_model_arch,
        help="the model's architecture (config.json), e.g. KimiK25ForConditionalGeneration",
    )
    parser.add_argument(
        "--nnodes",
        type=_node_count,
        default=1,
        help=f"as SGLang's --nnodes (default 1, at most {MAX_NODES})",
    )
    parser.add_argument(
        "--attention-dp", action="store_true", help="as SGLang's --enable-dp-attention"
    )
    parser.add_argument(
        "--moe-a2a-backend", default="none", help="as SGLang's --moe-a2a-backend (default none)"
    )
    parser.add_argument(
        "--dtype",
        type=_dtype,
        default="bfloat16",
        help="the dtype the model runs in: bfloat16 (default), float16 (half) or float32 (float)",
    )
    parser.add_argument(
        "--fusion-backend", help="as --flashinfer-allreduce-fusion-backend (auto, trtllm, ...)"
    )
    parser.add_argument(
        "--enforce-disable-fusion",
        action="store_true",
        help="as SGLang's --enforce-disable-flashinfer-allreduce-fusion",
    )
    parser.add_argument(
        "--disable-custom-all-reduce",
        action="store_true",
        help="as SGLang's flag (at TP2 or with NVLink it takes the points fusion declines)",
    )
    parser.add_argument(
        "--plugin-backend",
        choices=PLUGIN_BACKEND_CHOICES,
        help=f"as {PLUGIN_BACKEND_ENV} (default: that variable)",
    )
    parser.add_argument(
        "--hidden",
        type=_positive_int,
        default=7168,
        help="the model's hidden size, to pick the tuning table (default 7168)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (for a program)")


def _deployment(args: argparse.Namespace, tp_size: int) -> Deployment:
    from sglang_sm120.runtime import pcie_ipc_env, plugin_backend, validation_mode

    chosen = args.plugin_backend or plugin_backend()
    return Deployment(
        tp_size=tp_size,
        nnodes=args.nnodes,
        attention_dp=args.attention_dp,
        moe_a2a_backend=args.moe_a2a_backend,
        model_arch=args.model_arch,
        dtype=args.dtype,
        fusion_backend_flag=args.fusion_backend,
        enforce_disable_fusion=args.enforce_disable_fusion,
        pcie_ipc_env=pcie_ipc_env(),
        plugin_backend=None if chosen == "auto" else chosen,
        custom_all_reduce=not args.disable_custom_all_reduce,
        any_arch=validation_mode(),
    )


def _plan(
    facts: HostFacts,
    args: argparse.Namespace,
    tp_size: int,
    local_tuning: bool = False,
    host: HostFindings | None = None,
) -> AllReducePlan:
    """The plan a launcher would publish; ``local_tuning`` adds this host's tuning table and
    ``host`` its findings (doctor, not planning)."""
    from sglang_sm120.runtime import plan_to_publish, with_tuning

    deployment = dataclasses.replace(_deployment(args, tp_size), host=host)
    if local_tuning:
        deployment = with_tuning(deployment, args.hidden, args.dtype)
    return plan_to_publish(facts, deployment)[0]


def _facts_lines(facts: HostFacts) -> list[str]:
    lines = [f"facts from: {facts.source}"]
    if facts.probe_error:
        lines.append(f"  probe: {facts.probe_error}")
    if facts.driver_version:
        lines.append(
            f"  driver {facts.driver_version}, CUDA driver API {facts.cuda_driver_version}"
        )
    if not facts.gpus:
        lines.append("  no NVIDIA GPU visible")
        return lines
    for g in facts.gpus:
        numa = "?" if g.numa_node is None else g.numa_node
        lines.append(f"  GPU{g.index}: {g.name}  SM{g.sm}  NUMA {numa}  {g.memory_gib or '?'} GiB")
    lines.append(f"  NVLink: {'yes' if facts.has_nvlink else 'no'}   nodes: {facts.nnodes}")
    lines.append("  P2P   " + " ".join(f"{i:>2}" for i in range(len(facts.gpus))))
    for i, row in enumerate(facts.p2p):
        cells = " ".join(" -" if i == j else (" Y" if ok else " N") for j, ok in enumerate(row))
        lines.append(f"  GPU{i:<2} {cells}")
    return lines


def _plan_lines(plan: AllReducePlan, tp_size: int) -> list[str]:
    lines = [
        f"plan for tp={tp_size}: fusion_backend={plan.fusion_backend or 'off'}  "
        f"plain_allreduce={plan.plain_allreduce}  managed={plan.managed}"
    ]
    lines += [f"  - {reason}" for reason in plan.reasons]
    if plan.routes:
        lines.append("  tuned routes (tokens -> the fastest correct backend this server runs):")
        lines += [f"  {f'{a}-{b}':>9} -> {backend}" for a, b, backend in plan.route_ranges()]
    return lines


def cmd_plan(args: argparse.Namespace) -> int:
    facts = load_profile(args.profile) if args.profile else load_topology(args.topology)
    _check_tp(facts, args.tp, args.nnodes)
    _require_sglang()
    _check_upstream_flags(args)
    plan = _plan(facts, args, args.tp)
    if args.json:
        print(json.dumps({**plan.to_json(), "tp": args.tp, "facts_source": facts.source}, indent=1))
    else:
        print("\n".join(_facts_lines(facts) + _plan_lines(plan, args.tp)))
    return 0


_WORKER_REPORT = (
    "import json, sglang.srt.managers.scheduler\n"
    "from sglang.srt.plugins import load_plugins\n"
    "load_plugins()\n"
    "from sglang_sm120.plugin import verify_applied\n"
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
    from sglang_sm120.plugin import ROLE_NAMES
    from sglang_sm120.runtime import sm12x_capability

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

    from sglang_sm120.contract import check
    from sglang_sm120.patches import PATCHES, patch_name
    from sglang_sm120.plugin import declared_contract, verify_applied

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
    from sglang_sm120.kernel_images import check_coverage

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


def cmd_doctor(args: argparse.Namespace) -> int:
    from sglang_sm120.runtime import (
        findings_describe,
        host_findings,
        plugin_disabled,
        validation_mode,
    )

    facts = current_facts()
    tp_size = args.tp or max(len(facts.gpus), 1)
    if facts.gpus:
        _check_tp(facts, tp_size, args.nnodes)
    _require_sglang()
    _check_upstream_flags(args)
    findings = host_findings(
        facts, tp_size, args.hidden, tuple(range(min(tp_size, len(facts.gpus)))) or None
    )
    host = findings if findings_describe(facts) else None
    plan = _plan(facts, args, tp_size, local_tuning=True, host=host)
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
    lines += _facts_lines(facts)
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
    lines += _plan_lines(plan, tp_size)
    lines += _coverage_lines(coverage)
    print("\n".join(lines))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from sglang_sm120.tune import TOKENS, TuneSettings, format_table, run_tune

    settings = TuneSettings(
        tp=args.tp,
        hidden=args.hidden,
        dtype=args.dtype,
        tokens=tuple(args.tokens or TOKENS),
        calls=args.calls,
        replays=args.replays,
    )
    current_facts()  # a bad SGLANG_SM120_TOPOLOGY is reported now, not after measuring
    try:
        table, path = run_tune(settings)
    except (RuntimeError, ValueError) as exc:
        print(f"sglang-sm120 tune: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(table.to_json(), indent=1) if args.json else format_table(table))
    print(f"written: {path}", file=sys.stderr)
    return 0


def _gpu_list(text: str) -> tuple[int, ...]:
    """'0,1,3' -> (0, 1, 3): distinct CUDA indices."""
    try:
        gpus = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of GPU indices") from None
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"{text!r}: GPU indices must be distinct and >= 0")
    return gpus


def cmd_p2p(args: argparse.Namespace) -> int:
    from sglang_sm120.p2p_probe import format_probe, run_probe, save_probe

    try:
        import torch
    except ImportError as exc:
        raise UsageError(f"needs torch with CUDA to copy between GPUs ({exc})") from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        seen = "none" if count == 0 else f"1 ({torch.cuda.get_device_name(0)})"
        raise UsageError(f"needs at least 2 CUDA GPUs to measure P2P; torch sees {seen}")
    gpus = args.gpus or tuple(range(count))
    if len(gpus) < 2:
        raise UsageError(f"--gpus {','.join(map(str, gpus))}: name at least 2 GPUs")
    if max(gpus) >= count:
        raise UsageError(f"--gpus {','.join(map(str, gpus))}: torch sees GPUs 0-{count - 1}")
    facts = current_facts()
    try:
        document = run_probe(facts, gpus, reps=args.reps)
    except RuntimeError as exc:
        print(f"sglang-sm120 p2p: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(document, indent=1) if args.json else format_probe(document))
    try:
        print(f"written: {save_probe(document)}", file=sys.stderr)
    except OSError as exc:
        print(f"sglang-sm120 p2p: not saved ({exc})", file=sys.stderr)
    return 0


def cmd_warmup(args: argparse.Namespace) -> int:
    from sglang_sm120.warmup import format_steps, run_warmup, visible_capability

    if not args.dry_run and visible_capability() is None:
        raise UsageError(
            "no CUDA GPU visible to torch: the JIT builds target the local GPU, so run this on "
            "the server's machine with its CUDA_VISIBLE_DEVICES (--dry-run lists the steps)"
        )
    steps = run_warmup(dry_run=args.dry_run, vocab_size=args.vocab_size, progress=sys.stderr)
    print(format_steps(steps))
    return 1 if any(step.status.startswith("failed") for step in steps) else 0


def cmd_profiles(args: argparse.Namespace) -> int:
    descriptions = profile_descriptions()
    width = max(map(len, descriptions))
    print("\n".join(f"{name:<{width}}  {text}" for name, text in descriptions.items()))
    return 0


def cmd_selftest(args: argparse.Namespace) -> int:
    from sglang_sm120.selftest import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="sglang-sm120",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=version_text())
    # Not required=True: argparse would then answer "arguments are required: command" to an
    # unknown flag (``sglang-sm120 --bogus``) instead of naming it; main() asks for a command.
    sub = parser.add_subparsers(dest="command", metavar="command")
    doctor = sub.add_parser("doctor", help="this machine: facts, patch statuses, plan")
    _add_deployment_args(doctor, tp_required=False)
    doctor.add_argument(
        "--capability",
        type=_capability,
        help="check kernel images for this compute capability, e.g. 12.0",
    )
    doctor.set_defaults(func=cmd_doctor)
    plan = sub.add_parser("plan", help="the plan for a machine described by a profile or file")
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--profile", choices=profile_names(), help="an embedded machine profile (see: profiles)"
    )
    source.add_argument("--topology", help="topology JSON file (format of the embedded profiles)")
    _add_deployment_args(plan, tp_required=True)
    plan.set_defaults(func=cmd_plan)
    tune = sub.add_parser("tune", help="measure all-reduce backends here, write the tuning table")
    tune.add_argument(
        "--tp", type=_positive_int, required=True, help="ranks to measure, one per GPU"
    )
    tune.add_argument(
        "--hidden", type=_positive_int, default=7168, help="the model's hidden size (default 7168)"
    )
    tune.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16"),
        help="the model's dtype (default bfloat16)",
    )
    tune.add_argument(
        "--tokens", type=_positive_int, nargs="+", help="token counts (default 1..2048)"
    )
    tune.add_argument(
        "--calls", type=_positive_int, default=20, help="calls per captured graph (default 20)"
    )
    tune.add_argument(
        "--replays", type=_positive_int, default=10, help="graph replays timed (median; default 10)"
    )
    tune.add_argument("--json", action="store_true", help="print the table as JSON")
    tune.set_defaults(func=cmd_tune)
    p2p = sub.add_parser("p2p", help="measure P2P bandwidth per pair and all at once, here")
    p2p.add_argument("--gpus", type=_gpu_list, help="CUDA indices, e.g. 0,1,2,3 (default: all)")
    p2p.add_argument("--reps", type=_positive_int, default=20, help="copies per measurement")
    p2p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    p2p.set_defaults(func=cmd_p2p)
    warmup = sub.add_parser("warmup", help="compile the server's JIT kernels for this GPU ahead")
    warmup.add_argument("--dry-run", action="store_true", help="list the steps, build nothing")
    warmup.add_argument(
        "--vocab-size", type=_positive_int, default=163840, help="the model's vocabulary size"
    )
    warmup.set_defaults(func=cmd_warmup)
    profiles = sub.add_parser("profiles", help="list the embedded machine profiles")
    profiles.set_defaults(func=cmd_profiles)
    selftest = sub.add_parser("selftest", help="prove the EAGLE-3 fast path on this machine's GPUs")
    from sglang_sm120.selftest import add_arguments

    add_arguments(selftest)
    selftest.set_defaults(func=cmd_selftest)
    parser.commands = tuple(sub.choices)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error(f"a command is required ({', '.join(parser.commands)})")
    try:
        return args.func(args)
    except (UsageError, TopologyError) as exc:
        print(f"{parser.prog} {args.command}: {one_line(str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
