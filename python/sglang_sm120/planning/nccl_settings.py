"""NCCL_* settings a user made that break or slow the all-reduces of this launch, each with
its fix: doctor's ``nccl_warnings``; and the NCCL_* settings the plan itself applies, from the
NCCL variants ``tune`` measured (``tuned_nccl_env``), which must pass the same rules.

The rules are a table (``NCCL_RULES``): the variable, the check, the fix and where the effect
is documented or measured. A check reads only the value, the TP group's links and the plan,
so ``test/unit/test_nccl_settings.py`` checks each rule as rows on the embedded profiles.

Sources (the NCCL User Guide, "Environment Variables", NCCL 2.30, the version torch 2.14
ships as nvidia-nccl-cu13 2.30.7):

- NCCL_P2P_DISABLE "disables the peer to peer (P2P) transport, which uses CUDA direct access
  between GPUs, using NVLink or PCI"; NCCL_SHM_DISABLE: "SHM is used between devices when
  peer-to-peer cannot happen, therefore, host memory is used".
- NCCL_P2P_LEVEL "defines the maximum distance between GPUs where NCCL will use the P2P
  transport": LOC never, NVL only over NVLink, PIX same PCI switch, PXB through PCI switches,
  PHB same NUMA node, SYS "between NUMA nodes"; legacy integers LOC 0, PIX 1, PXB 2, PHB 3,
  SYS 4 ("integer values are discouraged").
- NCCL_PROTO: users are discouraged from setting it except to disable a protocol suspected of a
  bug; LL is NCCL's low-latency protocol, used "under" a size limit (NCCL_LL_THRESHOLD).
- NCCL_ALGO=Tree: seen failing during CUDA-graph capture in the investigation that started
  this project (8x RTX PRO 6000, ../shared/seeds); NCCL documents captured collectives as
  supported ("Using NCCL with CUDA Graphs") and implements Tree for all-reduce only
  (NVIDIA/nccl#317, a maintainer), so the failure is measured, not documented.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from sglang_sm120.env_values import shown
from sglang_sm120.machine.facts import HostFacts
from sglang_sm120.machine.nccl_conf import ENVIRONMENT, NcclSettings
from sglang_sm120.planning.policy import AllReducePlan, Deployment
from sglang_sm120.planning.tuning import (
    NCCL_TUNING_FAMILY,
    NCCL_VARIANTS_VERSION,
    PREFILL_TOKENS,
    SCOPED_KEYS,
    UNFUSED_MIN_GAIN,
    NcclEnv,
    TuningTable,
    VariantMeasurement,
    scoped_env,
    size_ranges,
    variant_name,
)
from sglang_sm120.planning.upstream import (
    CUSTOM_ALL_REDUCE_PCIE_MAX_WORLD,
    CUSTOM_ALL_REDUCE_WORLD_SIZES,
)

NCCL_ENV_DOC = "NCCL User Guide, Environment Variables"
P2P_LEVELS = ("LOC", "NVL", "PIX", "PXB", "PHB", "SYS")  # nearest to farthest
P2P_LEVEL_INTEGERS = {"0": "LOC", "1": "PIX", "2": "PXB", "3": "PHB", "4": "SYS"}


@dataclass(frozen=True)
class Launch:
    """What a rule looks at: the TP group's links and where its all-reduces go."""

    tp_size: int
    p2p_all_pairs: bool  # every pair of the TP group has P2P
    numa_nodes: tuple[int, ...]  # the TP group's NUMA nodes
    nvlink: bool
    nccl_carries_verify: bool  # decode/verify-sized all-reduces reach NCCL
    cuda_graphs: bool = True  # SGLang's default; --disable-cuda-graph turns it off

    @classmethod
    def of(cls, facts: HostFacts, d: Deployment, plan: AllReducePlan) -> Launch:
        ids = [i for i in d.first_tp_group() if i < len(facts.gpus)]
        p2p = len(ids) == d.tp_size and not facts.missing_p2p_pairs(ids)
        return cls(
            tp_size=d.tp_size,
            p2p_all_pairs=p2p,
            numa_nodes=tuple(facts.numa_nodes(ids)),
            nvlink=facts.has_nvlink,
            nccl_carries_verify=_nccl_carries_verify(facts, d, plan, p2p),
        )

    def nccl_use(self) -> str:
        """Which all-reduces of this launch NCCL serves, for a warning's impact."""
        if self.nccl_carries_verify:
            return "every decode/verify all-reduce reaches NCCL in this plan"
        return "the plan serves decode/verify elsewhere; prefill-sized all-reduces reach NCCL"


def _nccl_carries_verify(facts: HostFacts, d: Deployment, plan: AllReducePlan, p2p: bool) -> bool:
    """Whether decode/verify all-reduces reach NCCL: the plan says NCCL, or upstream decides
    and its custom all-reduce cannot run (custom_all_reduce_utils: a world of 2 or NVLink)."""
    if d.tp_size <= 1:
        return False
    if plan.managed and plan.plain_allreduce != "upstream":
        return plan.plain_allreduce == "nccl"
    custom = (
        d.custom_all_reduce
        and d.tp_size in CUSTOM_ALL_REDUCE_WORLD_SIZES
        and p2p
        and (facts.has_nvlink or d.tp_size <= CUSTOM_ALL_REDUCE_PCIE_MAX_WORLD)
    )
    return not custom


def _tokens(value: str) -> list[str]:
    return [t.strip().upper() for t in value.split(",") if t.strip()]


def _allowed(value: str, name: str, collective: str = "ALLREDUCE") -> bool | None:
    """Whether a NCCL_ALGO/NCCL_PROTO value lets NCCL use ``name`` for ``collective``: a list,
    or "^list" to exclude, optionally per collective ("allreduce:...;..."). None: the value
    does not say (another collective's list only)."""
    parts = [p.strip() for p in value.split(";") if p.strip()]
    chosen = None
    for part in parts:
        key, sep, rest = part.partition(":")
        if not sep:
            chosen = chosen if chosen is not None else part
        elif key.strip().upper() == collective:
            chosen = rest
            break
    if chosen is None:
        return None
    chosen = chosen.strip()
    if chosen.startswith("^"):
        return name not in _tokens(chosen[1:])
    return name in _tokens(chosen)


def p2p_disable_problem(value: str, launch: Launch) -> str | None:
    if value.strip() != "1" or launch.tp_size <= 1 or not launch.p2p_all_pairs:
        return None
    return (
        "NCCL's P2P transport (direct GPU access over PCIe or NVLink) is off although every "
        "pair of the TP group has P2P here: NCCL stages its transfers through host memory "
        f"(SHM); {launch.nccl_use()}"
    )


def p2p_level_problem(value: str, launch: Launch) -> str | None:
    raw = value.strip().upper()
    level = P2P_LEVEL_INTEGERS.get(raw, raw)
    if level not in P2P_LEVELS or launch.tp_size <= 1 or not launch.p2p_all_pairs:
        return None  # another integer or an unknown word: NCCL's reading is not documented here
    if level == "LOC":
        lost = "no pair uses P2P (LOC: never)"
    elif level == "NVL" and not launch.nvlink:
        lost = "no pair uses P2P (NVL: NVLink only, and this host has none)"
    elif launch.nvlink:
        return None  # NVL and above keep the NVLink pairs on P2P
    elif P2P_LEVELS.index(level) < P2P_LEVELS.index("SYS") and len(launch.numa_nodes) > 1:
        nodes = ", ".join(str(n) for n in launch.numa_nodes)
        lost = (
            f"pairs across NUMA nodes {nodes} do not use P2P (only SYS allows P2P between "
            "NUMA nodes)"
        )
    else:
        return None  # same-switch / same-NUMA limits: the facts do not record PCIe switches
    return f"{lost}: those transfers go through host memory; {launch.nccl_use()}"


def proto_problem(value: str, launch: Launch) -> str | None:
    if launch.tp_size <= 1 or not launch.nccl_carries_verify:
        return None
    if _allowed(value, "LL") is not False:
        return None
    return (
        "NCCL may not use LL, its low-latency protocol for small messages, for all-reduce: "
        "the decode/verify all-reduces (tens of KiB) reach NCCL in this plan and take LL128 "
        "or Simple instead"
    )


def algo_problem(value: str, launch: Launch) -> str | None:
    if launch.tp_size <= 1 or not launch.cuda_graphs:
        return None
    if not _allowed(value, "TREE") or _allowed(value, "RING"):
        return None
    return (
        "NCCL_ALGO leaves all-reduce only Tree; with SGLang's CUDA graphs (on by default) "
        "capture failed this way on 8x RTX PRO 6000 (the investigation behind this project); "
        f"{launch.nccl_use()}"
    )


@dataclass(frozen=True)
class NcclRule:
    """One NCCL variable, the check that finds a problem in its value, the fix, the source."""

    variable: str
    problem: Callable[[str, Launch], str | None]
    fix: str
    source: str


NCCL_RULES = (
    NcclRule(
        "NCCL_P2P_DISABLE",
        p2p_disable_problem,
        "unset NCCL_P2P_DISABLE",
        f"{NCCL_ENV_DOC}: NCCL_P2P_DISABLE, NCCL_SHM_DISABLE",
    ),
    NcclRule(
        "NCCL_P2P_LEVEL",
        p2p_level_problem,
        "unset NCCL_P2P_LEVEL (NCCL then picks from the topology) or set NCCL_P2P_LEVEL=SYS",
        f"{NCCL_ENV_DOC}: NCCL_P2P_LEVEL",
    ),
    NcclRule(
        "NCCL_PROTO",
        proto_problem,
        "unset NCCL_PROTO, or keep LL in it (NCCL discourages setting it except to disable a "
        "protocol suspected of a bug)",
        f"{NCCL_ENV_DOC}: NCCL_PROTO, NCCL_LL_THRESHOLD",
    ),
    NcclRule(
        "NCCL_ALGO",
        algo_problem,
        "unset NCCL_ALGO (NCCL picks per size), or keep Ring in it",
        "measured: ../shared/seeds (capture failed with NCCL_ALGO=Tree); not documented by "
        "NCCL, whose CUDA-graph guide supports captured collectives (Tree is all-reduce only: "
        "NVIDIA/nccl#317)",
    ),
)


@dataclass(frozen=True)
class NcclWarning:
    """A user's NCCL setting that breaks or slows this launch, with its fix and source."""

    variable: str
    value: str
    problem: str
    fix: str
    source: str
    set_in: str = ENVIRONMENT  # or the NCCL config file that sets it

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        where = "" if self.set_in == ENVIRONMENT else f" (set in {self.set_in})"
        return (
            f"{self.variable}={self.value}{where}: {self.problem} (fix: {self.fix}; {self.source})"
        )


def nccl_warnings(
    settings: Mapping[str, str], facts: HostFacts, d: Deployment, plan: AllReducePlan
) -> tuple[NcclWarning, ...]:
    """The rules that find a problem in what NCCL will see for this launch (``settings``:
    ``machine.nccl_conf.nccl_settings``, the environment over NCCL's config files)."""
    launch = Launch.of(facts, d, plan)
    found = []
    for rule in NCCL_RULES:
        value = settings.get(rule.variable)
        if value is None:
            continue
        problem = rule.problem(value, launch)
        if problem is not None:
            where = (
                settings.source(rule.variable)
                if isinstance(settings, NcclSettings)
                else ENVIRONMENT
            )
            found.append(
                NcclWarning(rule.variable, shown(value), problem, rule.fix, rule.source, where)
            )
    return tuple(found)


def warning_lines(warnings: tuple[NcclWarning, ...], unreadable: str | None = None) -> list[str]:
    """doctor's NCCL section: one line per warning, or that none applies; and a config file
    that could not be read (its settings are not checked)."""
    tail = [f"  {unreadable}: its settings are not checked"] if unreadable else []
    if not warnings:
        return [
            "NCCL settings: none of NCCL_P2P_DISABLE/P2P_LEVEL/PROTO/ALGO set against this "
            "launch (environment and NCCL's config files)",
            *tail,
        ]
    lines = ["NCCL settings that break or slow this launch:"]
    return lines + [f"  {w.line()}" for w in warnings] + tail


# ------------------------------------------------------------------ tuned NCCL variants

# A variant replaces NCCL's own choice only by a clear margin, as a size leaves its fusion
# backend: NCCL's per-size choice is already tuned by NVIDIA, and one variant serves every
# size of the process, prefill included, which tune does not time.
NCCL_MIN_GAIN = UNFUSED_MIN_GAIN


def nccl_served_sizes(plan: AllReducePlan, measured: set[int]) -> list[int]:
    """The measured token counts whose all-reduce the plan leaves on NCCL: routed to nccl by a
    table, or every size where NCCL is the plain all-reduce and nothing fuses."""
    if not plan.managed:
        return []
    if plan.routes:
        return sorted(t for t in measured if plan.route_at(t) == "nccl")
    if plan.fusion_backend is None and plan.plain_allreduce == "nccl":
        return sorted(measured)
    return []


def _variant_problem(
    rows: dict[int, VariantMeasurement], sizes: list[int], rule_problem: str | None
) -> str | None:
    """Why a variant cannot be chosen: wrong anywhere, not timed at a size NCCL serves (a
    failed capture included), or a doctor rule against it for this launch."""
    wrong = sorted(t for t, m in rows.items() if m.us is not None and not m.correct)
    if wrong:
        return f"wrong at [{size_ranges(wrong)}] tokens"
    for tokens in sizes:
        m = rows.get(tokens)
        if m is None or m.us is None or not 0 < m.us < math.inf:
            why = m.note if m is not None and m.note else "not measured"
            return f"at {tokens} tokens: {why}"
    return rule_problem


def _prefill_loss(
    variant: VariantMeasurement | None, default: VariantMeasurement | None
) -> str | None:
    """Why a variant loses at a chunked-prefill all-reduce (PREFILL_TOKENS), or None: it sets
    every NCCL call of the process, so it may not be slower than NCCL's default there by more
    than noise (NCCL_MIN_GAIN's ratio), nor be untimed there."""
    if default is None or default.us is None or not default.correct:
        return f"NCCL's default not timed at {PREFILL_TOKENS} tokens (prefill): re-run tune"
    if variant is None or variant.us is None or not variant.correct:
        why = variant.note if variant is not None and variant.note else "not measured"
        return f"at {PREFILL_TOKENS} tokens (prefill): {why}"
    if variant.us > default.us * (1 + NCCL_MIN_GAIN[0]):
        return (
            f"{variant.us / default.us:.2f}x NCCL's default at {PREFILL_TOKENS} tokens "
            "(prefill): slower where every prefill chunk's all-reduce would use it"
        )
    return None


def _rule_against(env: NcclEnv, launch: Launch) -> str | None:
    """What doctor would warn about ``env`` for this launch (``NCCL_RULES``), or None."""
    values = dict(env)
    for rule in NCCL_RULES:
        if rule.variable in values:
            problem = rule.problem(values[rule.variable], launch)
            if problem is not None:
                return f"doctor would warn: {problem}"
    return None


def _unscoped(env: NcclEnv) -> str | None:
    """Why a variant may not be set: a variable without a per-collective form (a channel
    count) would change every collective of the worker, and tune timed only the all-reduce."""
    unscoped = [k for k, _ in env if k not in SCOPED_KEYS]
    if unscoped:
        return (
            f"{', '.join(unscoped)} has no per-collective form: it would set every collective's "
            "channel count, and tune timed the all-reduce only"
        )
    return None


def tuned_nccl_env(
    table: TuningTable | None, facts: HostFacts, d: Deployment, plan: AllReducePlan
) -> tuple[NcclEnv, str]:
    """(the NCCL_* settings for this launch's TP workers, why): the variant, among those tune
    measured, that was correct at every size, ran at every size the plan leaves on NCCL
    (captured in a CUDA graph) and beats NCCL's defaults there by NCCL_MIN_GAIN (geometric
    mean of the time ratios, and the mean saving); none otherwise. A variant that one of
    ``NCCL_RULES`` would warn about for this launch is never chosen. ((), "") without a table."""
    if table is None or d.tp_size <= 1 or not plan.managed:
        return (), ""
    if d.deterministic:
        return (), (
            "nccl env: none (deterministic inference: SGLang pins NCCL_ALGO and the channel "
            "count itself)"
        )
    if d.ray:
        return (), "nccl env: none (--use-ray: Ray's actors load no SGLang plugin to set it)"
    other_groups = (
        "--enable-dp-attention" if d.attention_dp else None,
        f"--moe-a2a-backend {d.moe_a2a_backend}" if d.moe_a2a_backend != "none" else None,
    )
    if any(other_groups):
        return (), (
            f"nccl env: none ({', '.join(g for g in other_groups if g)}: the variant would reach "
            "the all-reduces of groups tune did not time)"
        )
    if not table.nccl_variants:
        return (), "nccl env: none (the tuning table has no NCCL variants: re-run tune)"
    if table.version < NCCL_VARIANTS_VERSION:
        return (), (
            f"nccl env: none (a version-{table.version} tuning table: its NCCL variants are "
            "not applied; re-run tune)"
        )
    by_env: dict[NcclEnv, dict[int, VariantMeasurement]] = {}
    for m in table.nccl_variants:
        by_env.setdefault(m.env, {})[m.tokens] = m
    sizes = nccl_served_sizes(plan, {m.tokens for m in table.nccl_variants} - {PREFILL_TOKENS})
    if not sizes:
        return (), "nccl env: none (no measured size stays on NCCL in this plan)"
    where = f"at [{size_ranges(sizes)}] tokens"
    default = by_env.get((), {})
    problem = _variant_problem(default, sizes, None)
    if problem is not None:
        return (), f"nccl env: none (NCCL's default not measured {where}: {problem})"
    launch = Launch.of(facts, d, plan)
    scored, dropped = [], []
    for env, rows in by_env.items():
        if not env:
            continue
        problem = _unscoped(env) or _variant_problem(rows, sizes, _rule_against(env, launch))
        problem = problem or _prefill_loss(rows.get(PREFILL_TOKENS), default.get(PREFILL_TOKENS))
        if problem is not None:
            dropped.append(f"{variant_name(env)} ({problem})")
            continue
        ratios = [rows[t].us / default[t].us for t in sizes]
        saving = sum(default[t].us - rows[t].us for t in sizes) / len(sizes)
        scored.append((math.prod(ratios) ** (1 / len(ratios)), saving, env))
    scored.sort()
    excluded_note = f"; excluded: {', '.join(dropped)}" if dropped else ""
    others = ", ".join(f"{variant_name(e)} {r:.2f}x" for r, _, e in scored)
    ratio_min, saving_min = NCCL_MIN_GAIN
    if scored and scored[0][0] <= 1 - ratio_min and scored[0][1] >= saving_min:
        ratio, saving, env = scored[0]
        return env, (
            f"nccl env {variant_name(env)} from the tuning table: {ratio:.2f}x NCCL's default "
            f"{where} (geometric mean, {saving:.1f} us saved per call; measured: {others})"
            f"{excluded_note}"
        )
    return (), (
        f"nccl env: none (no NCCL variant beats NCCL's default by {ratio_min:.0%} and "
        f"{saving_min} us {where}; measured: {others or 'none usable'}){excluded_note}"
    )


def with_tuned_nccl_env(plan: AllReducePlan, facts: HostFacts, d: Deployment) -> AllReducePlan:
    """``plan`` with the NCCL_* settings its TP workers apply (``tuned_nccl_env``)."""
    env, reason = tuned_nccl_env(d.tuning, facts, d, plan)
    return dataclasses.replace(plan, nccl_env=env, nccl_reason=reason)


# Set by the user, any of these keeps the tuned variant off: NCCL weighs the family together
# (NCCL_MIN/MAX_CTAS are its names for the channel bounds since 2.17, NCCL_MIN/MAX_NRINGS the
# legacy ones), a tuner plugin makes NCCL's choices itself, and an env plugin (NCCL 2.30) may
# hand NCCL any value, ours included, in place of the environment's.
USER_NCCL_TUNING = (
    *NCCL_TUNING_FAMILY,
    "NCCL_MIN_CTAS",
    "NCCL_MAX_CTAS",
    "NCCL_MIN_NRINGS",
    "NCCL_MAX_NRINGS",
    "NCCL_TUNER_PLUGIN",
    "NCCL_ENV_PLUGIN",
)


def nccl_env_to_apply(plan: AllReducePlan, settings: Mapping[str, str]) -> tuple[NcclEnv, str]:
    """(what a TP worker sets, the line that says so): the plan's tuned NCCL_* settings in
    their per-collective form (``scoped_env``), unless the user set any of USER_NCCL_TUNING, in
    the environment or NCCL's config files (``settings``: ``machine.nccl_conf.nccl_settings``),
    or a config file could not be read (it may set any of them); nothing when the plan has
    none."""
    if not plan.nccl_env:
        return (), plan.nccl_reason or "nccl env: none (no tuning table)"
    env = scoped_env(plan.nccl_env)
    name = variant_name(env)
    unreadable = settings.unreadable if isinstance(settings, NcclSettings) else None
    if unreadable:
        return (), f"nccl env: tuned {name} not set: {unreadable}, which may set anything"
    users = [f"{k}={shown(settings[k])}" for k in USER_NCCL_TUNING if k in settings]
    if users:
        return (), f"nccl env: tuned {name} not set: the user's {', '.join(users)} wins"
    return env, f"nccl env: {name} set before NCCL starts; {plan.nccl_reason}"
