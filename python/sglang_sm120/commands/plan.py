"""``sglang-sm120 plan``: the plan for a machine you are not on (an embedded profile or a
topology file), and the facts and plan lines ``doctor`` prints too. It imports no SGLang: what
it needs of upstream is in ``planning.upstream``, proven equal to the installed sglang."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Collection

from sglang_sm120.commands.allreduce_options import deployment_for
from sglang_sm120.commands.args import (
    add_deployment_args,
    check_tp,
    check_upstream_flags,
    deployment_from_args,
)
from sglang_sm120.machine.facts import HostFacts, load_profile, load_topology, profile_names
from sglang_sm120.machine.host_checks import HostFindings
from sglang_sm120.planning.levers import allreduce_levers, lever_lines
from sglang_sm120.planning.policy import AllReducePlan
from sglang_sm120.planning.upstream import FUSION_ARCHS


def plan_for_args(
    facts: HostFacts,
    args: argparse.Namespace,
    tp_size: int,
    local_tuning: bool = False,
    host: HostFindings | None = None,
    archs: Collection[str] | None = None,
) -> AllReducePlan:
    """The plan a launcher would publish; ``local_tuning`` adds this host's tuning table and
    ``host`` its findings (doctor, not planning); ``archs``: the architectures with a fused point
    (default: the installed sglang's own, which imports SGLang)."""
    from sglang_sm120.server.runtime import plan_to_publish, with_tuning

    deployment = dataclasses.replace(deployment_from_args(args, tp_size), host=host)
    if local_tuning:
        deployment = with_tuning(deployment, args.hidden, args.dtype)
    return plan_to_publish(facts, deployment, archs)[0]


def facts_lines(facts: HostFacts) -> list[str]:
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


def plan_lines(plan: AllReducePlan, tp_size: int) -> list[str]:
    lines = [
        f"plan for tp={tp_size}: fusion_backend={plan.fusion_backend or 'off'}  "
        f"plain_allreduce={plan.plain_allreduce}  managed={plan.managed}"
    ]
    lines += [f"  - {reason}" for reason in plan.reasons]
    if plan.nccl_reason:
        lines.append(f"  - {plan.nccl_reason}")
    if plan.routes:
        lines.append("  tuned routes (tokens -> the fastest correct backend this server runs):")
        lines += [f"  {f'{a}-{b}':>9} -> {backend}" for a, b, backend in plan.route_ranges()]
    return lines


def run(args: argparse.Namespace) -> int:
    facts = load_profile(args.profile) if args.profile else load_topology(args.topology)
    check_tp(facts, args.tp, args.nnodes, args.pp_size)
    check_upstream_flags(args)
    plan = plan_for_args(facts, args, args.tp, archs=FUSION_ARCHS)  # no SGLang import: seconds
    # another machine: whether mscclpp imports there is unknown (None)
    levers = allreduce_levers(facts, deployment_for(args, args.tp), plan, FUSION_ARCHS, None)
    if args.json:
        options = [lever.to_json() for lever in levers]
        print(
            json.dumps(
                {
                    **plan.to_json(),
                    "tp": args.tp,
                    "facts_source": facts.source,
                    "allreduce_options": options,
                },
                indent=1,
            )
        )
    else:
        print("\n".join(facts_lines(facts) + plan_lines(plan, args.tp) + lever_lines(levers)))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("plan", help="the plan for a machine described by a profile or file")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--profile", choices=profile_names(), help="an embedded machine profile (see: profiles)"
    )
    source.add_argument("--topology", help="topology JSON file (format of the embedded profiles)")
    add_deployment_args(parser, tp_required=True)
    parser.set_defaults(func=run)
