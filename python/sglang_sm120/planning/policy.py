"""Policy: pure decisions, each with its reason, from facts and the deployment's server args.

Nothing here probes hardware or imports sglang; patches and the CLI call these functions with
facts they were given. Two questions are answered:

- ``hardware_capability(facts, gpu_ids)``: what the TP group's GPUs can run at all (used by the
  patches that load before server args exist);
- ``plan_allreduce(facts, deployment, fusion_archs)``: what a given server launch should use.

Rules (docs/routing.md's table; test/unit/test_policy.py checks each row):

* Not every TP GPU is SM12x: upstream behaviour, untouched (``managed`` is False).
* Fused all-reduce + residual + RMSNorm (FlashInfer ``trtllm``): allowed on SM12x single node
  when every GPU pair of the TP group has P2P (the kernel pushes to every peer), with no
  attention-DP and no MoE all-to-all, for model architectures upstream fuses. Turned on by
  default at TP2 only (FlashInfer PR #3903: +2-5% decode at TP2 on SM120); at TP4/TP8 over PCIe
  it stays off unless asked for (upstream PR #32330, which turned it on for SM12x, was closed
  after a TP4 regression, maintainers asking for opt-in by TP).
* Plain all-reduce: upstream's FlashInfer PCIe-IPC kernels at TP 2/4/8 on single-node, PCIe-only,
  all-pairs-P2P SM12x hosts, ahead of the fused backend's all-to-all kernel; NCCL otherwise.
* Multi-node: judged by the TP group's span (``tp_group_nodes``). A TP group inside one node
  (PP stages across nodes) keeps PCIe-IPC and ``sm120_pcie``; ``trtllm`` stays off, upstream
  refuses it whenever nnodes > 1. A TP group spanning nodes: NCCL.
* The user's explicit choices win (``--enforce-disable-flashinfer-allreduce-fusion``, an explicit
  backend, ``SGLANG_ENABLE_PCIE_IPC_ALLREDUCE``, also over ``sm120_pcie``'s plain all-reduce)
  unless the hardware cannot run them: then the choice is refused with its reason and NCCL is used.
* Validation mode (``SGLANG_SM120_ANY_ARCH=1``, ``any_arch``): GPUs of compute capability 9.0
  and above count as in scope, with the same rules and P2P requirements as SM12x, so the managed
  path can be validated on H100/H200 machines. Every reason that follows says so; never a default.
* Host findings (``Deployment.host``: doctor's host checks and the measured p2p probe) change
  what is chosen where nothing measured or asked decides: P2P staged through system memory
  (``p2p_driver`` fail) turns every IPC kernel down for NCCL; ACS redirect on switch ports or
  a measured collapse of concurrent P2P writes turns one-shot push fusion (trtllm at TP2 auto)
  off, PCIe-IPC's staged kernels stay. A tuning table measured these effects itself and the
  user's explicit choices stand; every finding is cited in the reasons with its fix.
* The GPUs judged are the ones SGLang gives this node's ranks (``Deployment.gpu_ids``:
  ``--base-gpu-id``, ``--gpu-id-step``, PP stages, DP replicas), not simply the first ``tp``
  visible ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_sm120.machine.facts import GpuInfo, HostFacts, describe_gpus
from sglang_sm120.machine.host_checks import FAIL, WARN, HostCheck, HostFindings
from sglang_sm120.planning.tuning import (
    BACKENDS,
    DECLINES,
    SM120_PCIE_ROUTES,
    UNFUSED_MIN_GAIN,
    UPSTREAM_BACKENDS,
    Measurement,
    NcclEnv,
    TuningTable,
    correct_times,
    excluded,
    size_ranges,
    variant_env,
    winners,
)
from sglang_sm120.strict_json import FieldError, fields, require, require_list, shown

PCIE_IPC_WORLD_SIZES = (2, 4, 8)
SM120_PCIE_WORLD_SIZES = (2, 4, 8)
SM120_PCIE_DTYPES = ("bfloat16", "float16")
PLUGIN_BACKEND_ENV = "SGLANG_SM120_FUSION_BACKEND"
PLUGIN_BACKEND_CHOICES = ("auto", "off", "trtllm", "sm120_pcie")
FUSION_AUTO_TP_SIZES = (2,)
FUSION_BACKENDS_RUNNABLE_ON_SM12X = ("auto", "trtllm")
VALIDATION_ENV = "SGLANG_SM120_ANY_ARCH"
VALIDATION_MIN_CAPABILITY = (9, 0)
VALIDATION_NOTE = (
    f"validation mode ({VALIDATION_ENV}=1): non-SM12x GPUs managed as if SM12x, for testing only"
)


def in_scope(gpu: GpuInfo, any_arch: bool = False) -> bool:
    """Whether the plugin manages this GPU: SM12x, or in validation mode any SM90+ GPU."""
    return gpu.capability[0] == 12 or (any_arch and gpu.capability >= VALIDATION_MIN_CAPABILITY)


PLAN_FUSION_BACKENDS = ("trtllm", "sm120_pcie")  # a plan's fusion_backend, when not None
PLAN_PLAIN_ALLREDUCES = ("upstream", "none", "nccl", "pcie_ipc", "sm120_pcie")
# Upstream's switched-off communicators a tuning table can turn on: the ServerArgs field the
# launcher sets (only where the user left it unset) and the flag that says the same.
UPSTREAM_SWITCH_FIELDS = {"mscclpp": "enable_mscclpp", "torch_symm_mem": "enable_torch_symm_mem"}
UPSTREAM_SWITCH_FLAGS = {"mscclpp": "--enable-mscclpp", "torch_symm_mem": "--enable-torch-symm-mem"}
# A published plan's bounds, above anything a launcher writes (the launch plan's size bounds
# the document as a whole).
MAX_REASONS = 1024
MAX_ROUTES = 4096  # one per token count of a table, at most (2048 sizes)


def _routes_from_ranges(value: list[Any]) -> tuple[tuple[int, str], ...]:
    """``route_ranges`` as published: [first, last, backend] rows, the first from 1, each
    starting right after the one before."""
    routes: list[tuple[int, str]] = []
    for row in value:
        expected = routes[-1][0] + 1 if routes else 1
        if not (
            isinstance(row, list)
            and len(row) == 3
            and all(isinstance(n, int) and not isinstance(n, bool) for n in row[:2])
            and row[0] == expected
            and row[1] >= row[0]
            and row[2] in BACKENDS
        ):
            raise FieldError(f"plan.routes has {shown(row)}, not [{expected}, last, backend]")
        routes.append((row[1], row[2]))
    return tuple(routes)


def tp_group_nodes(nnodes: int, pp_size: int) -> int:
    """How many nodes one TP group spans. SGLang 0.5.23 gives each PP stage
    ``max(nnodes // pp_size, 1)`` nodes and splits its TP ranks evenly over them
    (entrypoints/engine.py ``_calculate_rank_ranges``: ``nnodes_per_tp_group``; the DP
    controller's ``launch_tensor_parallel_group`` places ranks the same way), and
    ``initialize_model_parallel`` makes each TP group tp_size consecutive ranks of one stage."""
    return max(nnodes // pp_size, 1)


@dataclass(frozen=True)
class Deployment:
    """The server args the decisions depend on; ``None`` where a caller does not know."""

    tp_size: int
    nnodes: int = 1
    pp_size: int = 1  # --pp-size: pipeline stages, placed on the nodes before TP ranks are
    attention_dp: bool = False
    moe_a2a_backend: str = "none"
    model_arch: str | None = None
    dtype: str | None = "bfloat16"
    fusion_backend_flag: str | None = None
    enforce_disable_fusion: bool = False
    pcie_ipc_env: bool | None = None
    deterministic: bool = False
    plugin_backend: str | None = None
    tuning: TuningTable | None = None
    tuning_note: str = ""
    gpu_ids: tuple[int, ...] | None = None  # every GPU this node's ranks use; None: first tp
    ray: bool = False  # --use-ray: the actors never load SGLang plugins
    disaggregation: bool = False  # PD disaggregation: a prefill server sends KV, not tokens
    custom_all_reduce: bool = True  # upstream's custom all-reduce (--disable-custom-all-reduce)
    enable_mscclpp: bool = False  # --enable-mscclpp set by the user
    enable_torch_symm_mem: bool = False  # --enable-torch-symm-mem set by the user
    enable_symm_mem: bool = False  # --enable-symm-mem: NCCL symmetric memory takes plain ARs
    any_arch: bool = False  # validation mode (SGLANG_SM120_ANY_ARCH=1): SM90+ managed as SM12x
    host: HostFindings | None = None  # host checks and the p2p probe; None: not looked at

    def ranks_per_node(self) -> tuple[int, int]:
        """(TP ranks, PP stages) SGLang places on one node (``tp_group_nodes``)."""
        return (
            self.tp_size // tp_group_nodes(self.nnodes, self.pp_size),
            max(self.pp_size // self.nnodes, 1),
        )

    def used_gpu_ids(self) -> tuple[int, ...]:
        """Every GPU the node's ranks use (all must be SM12x with P2P between them); default:
        the first (TP ranks x PP stages) of this node."""
        if self.gpu_ids is not None:
            return self.gpu_ids
        tp, pp = self.ranks_per_node()
        return tuple(range(tp * pp))

    def first_tp_group(self) -> tuple[int, ...]:
        """The GPUs of TP group 0, whose shape the tuning table was measured on."""
        return self.used_gpu_ids()[: self.tp_size]


@dataclass(frozen=True)
class Capability:
    """What the hardware of a TP group allows, independent of server args."""

    sm12x: bool  # in scope: SM12x, or any SM90+ GPU in validation mode (``validation``)
    fusion_capable: bool
    pcie_ipc_capable: bool
    reasons: tuple[str, ...]
    validation: bool = False  # in scope only through validation mode

    def to_json(self) -> dict[str, Any]:
        return {
            "sm12x": self.sm12x,
            "fusion_capable": self.fusion_capable,
            "pcie_ipc_capable": self.pcie_ipc_capable,
            "reasons": list(self.reasons),
            "validation": self.validation,
        }

    @classmethod
    def from_json(cls, data: Any) -> Capability:
        """The inverse of ``to_json``; FieldError naming the field for anything else."""
        data = fields(data, "capability", known=cls.__dataclass_fields__)
        return cls(
            sm12x=require(data, "sm12x", bool, "capability"),
            fusion_capable=require(data, "fusion_capable", bool, "capability"),
            pcie_ipc_capable=require(data, "pcie_ipc_capable", bool, "capability"),
            reasons=_reasons(data, "capability"),
            validation=require(data, "validation", bool, "capability", default=False),
        )


def _reasons(data: dict[str, Any], where: str) -> tuple[str, ...]:
    return tuple(require_list(data, "reasons", str, where, max_items=MAX_REASONS))


@dataclass(frozen=True)
class AllReducePlan:
    """What one server launch uses; ``reasons`` explains every field."""

    managed: bool
    fusion_backend: str | None
    plain_allreduce: str
    reasons: tuple[str, ...] = field(default=())
    routes: tuple[tuple[int, str], ...] = field(default=())
    # ServerArgs fields the launcher turns on (UPSTREAM_SWITCH_FIELDS) where the user left them
    # unset: upstream communicators the tuning table found faster at sizes SGLang all-reduces.
    upstream_switches: tuple[str, ...] = field(default=())
    # The NCCL_* variables the TP workers set before NCCL starts, unless the user set any of
    # them (``planning.nccl_settings.tuned_nccl_env``), and why; "" where no table spoke.
    nccl_env: NcclEnv = field(default=())
    nccl_reason: str = ""

    def route_at(self, tokens: int) -> str | None:
        """The backend that serves a fused point of ``tokens`` rows: the fusion backend
        everywhere without a table; with a table, the route of the nearest measured size at or
        above. Above the largest: trtllm keeps fusing (upstream bounds it at 2048 rows), and
        sm120_pcie serves nothing (None; its workspace is sized for the decode widths)."""
        if not self.routes:
            return self.fusion_backend
        above = self.fusion_backend if self.fusion_backend == "trtllm" else None
        return next((b for t, b in self.routes if t >= tokens), above)

    def token_ranges(self, backends: Collection[str]) -> tuple[tuple[int, int | None], ...]:
        """The token counts ``route_at`` sends to one of ``backends``, as (first, last) ranges
        with neighbours merged (last None: no upper bound). A per-call check compares a token
        count with these few bounds (``tokens_in``): under torch.compile each comparison is a
        guard, and one per route would compile one graph per route."""
        if not self.routes:
            return ((1, None),) if self.fusion_backend in backends else ()
        above = self.fusion_backend if self.fusion_backend == "trtllm" else None
        ranges: list[tuple[int, int | None]] = []
        first = 1
        for last, backend in (*self.routes, (None, above)):
            if backend in backends:
                if ranges and ranges[-1][1] == first - 1:
                    ranges[-1] = (ranges[-1][0], last)
                else:
                    ranges.append((first, last))
            if last is not None:
                first = last + 1
        return tuple(ranges)

    def fuses_at(self, tokens: int) -> bool:
        """Whether the fusion backend serves a fused point of ``tokens`` rows (elsewhere the
        point is declined: SGLang all-reduces, by the route's backend, and norms separately)."""
        return self.fusion_backend is not None and self.route_at(tokens) == self.fusion_backend

    def uses_sm120_pcie_at(self, tokens: int) -> bool:
        """Whether sgl-kernel-sm120's fused kernel serves a fused point of ``tokens`` rows."""
        return self.fusion_backend == "sm120_pcie" and self.fuses_at(tokens)

    def reduces_with_sm120_pcie_at(self, tokens: int) -> bool:
        """Whether sgl-kernel-sm120's all-reduce serves ``tokens`` rows: where its fused kernel
        won, and where its all-reduce + a separate norm won (there the fused point is declined
        and the all-reduce SGLang then makes comes here)."""
        return self.fusion_backend == "sm120_pcie" and self.route_at(tokens) in SM120_PCIE_ROUTES

    @property
    def pcie_ipc_on(self) -> bool:
        """Whether upstream's PCIe-IPC all-reduce is enabled: as the plain all-reduce, or behind
        sgl-kernel-sm120 for the sizes the tuning table routes to it."""
        return self.plain_allreduce == "pcie_ipc" or (
            self.fusion_backend == "sm120_pcie" and any(b == "pcie_ipc" for _, b in self.routes)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "managed": self.managed,
            "fusion_backend": self.fusion_backend,
            "plain_allreduce": self.plain_allreduce,
            "reasons": list(self.reasons),
            "routes": [list(run) for run in self.route_ranges()],
            "upstream_switches": list(self.upstream_switches),
            "nccl_env": dict(self.nccl_env),
            "nccl_reason": self.nccl_reason,
        }

    @classmethod
    def from_json(cls, data: Any) -> AllReducePlan:
        """The inverse of ``to_json``; FieldError naming the field for anything else."""
        data = fields(data, "plan", known=cls.__dataclass_fields__)
        return cls(
            managed=require(data, "managed", bool, "plan"),
            fusion_backend=require(
                data, "fusion_backend", str, "plan", choices=PLAN_FUSION_BACKENDS, null=True
            ),
            plain_allreduce=require(
                data, "plain_allreduce", str, "plan", choices=PLAN_PLAIN_ALLREDUCES
            ),
            reasons=_reasons(data, "plan"),
            routes=_routes_from_ranges(require(data, "routes", list, "plan", limit=MAX_ROUTES)),
            upstream_switches=tuple(
                require_list(
                    data,
                    "upstream_switches",
                    str,
                    "plan",
                    max_items=len(UPSTREAM_SWITCH_FIELDS),
                    default=[],
                    choices=tuple(UPSTREAM_SWITCH_FIELDS.values()),
                )
            ),
            nccl_env=variant_env(
                require(data, "nccl_env", dict, "plan", default={}), "plan.nccl_env"
            ),
            nccl_reason=require(data, "nccl_reason", str, "plan", limit=4000, default=""),
        )

    def route_ranges(self) -> list[tuple[int, int, str]]:
        """The routes as (first, last, backend) token ranges, one per run of sizes with the
        same backend: ``route_at`` gives ``backend`` for every count from first to last. A
        table of 2048 sizes is a few ranges, so the published plan stays small."""
        ranges: list[tuple[int, int, str]] = []
        for tokens, backend in self.routes:
            if ranges and ranges[-1][2] == backend:
                ranges[-1] = (ranges[-1][0], tokens, backend)
            else:
                ranges.append((ranges[-1][1] + 1 if ranges else 1, tokens, backend))
        return ranges

    def summary(self) -> str:
        fusion = self.fusion_backend or "off"
        nccl = f"; {self.nccl_reason}" if self.nccl_reason else ""
        return (
            f"fusion={fusion}, plain all-reduce={self.plain_allreduce}; "
            + "; ".join(self.reasons)
            + nccl
        )


def tokens_in(tokens: Any, ranges: tuple[tuple[int, int | None], ...]) -> bool:
    """Whether ``tokens`` lies in one of ``ranges`` (``AllReducePlan.token_ranges``); a bound
    of 1 or None is not compared, so a traced symbolic size meets only real boundaries."""
    for first, last in ranges:
        if (first == 1 or tokens >= first) and (last is None or tokens <= last):
            return True
    return False


def hardware_capability(
    facts: HostFacts, gpu_ids: Sequence[int] | None = None, *, any_arch: bool = False
) -> Capability:
    """Whether the GPUs ``gpu_ids`` (default: every visible GPU) are SM12x (or, with
    ``any_arch``, SM90+ in validation mode), and what their links allow."""
    if facts.probe_error and not facts.gpus:
        return Capability(False, False, False, (f"no GPU facts: {facts.probe_error}",))
    gpus = facts.gpus_at(gpu_ids if gpu_ids is not None else range(len(facts.gpus)))
    if not gpus:
        return Capability(False, False, False, ("no NVIDIA GPU visible",))
    if not all(in_scope(g, any_arch) for g in gpus):
        scope = "below SM90 even in validation mode" if any_arch else "not SM12x"
        return Capability(
            False,
            False,
            False,
            (f"{describe_gpus(gpus)}: {scope}, upstream behaviour untouched",),
        )
    cap = _in_scope_capability(facts, gpus)
    if all(g.capability[0] == 12 for g in gpus):
        return cap
    first = f"{cap.reasons[0]}; {VALIDATION_NOTE}"
    return dataclasses.replace(cap, reasons=(first, *cap.reasons[1:]), validation=True)


def _in_scope_capability(facts: HostFacts, gpus: Sequence[GpuInfo]) -> Capability:
    """What the links between GPUs the plugin manages allow."""
    indices = [g.index for g in gpus]
    missing = facts.missing_p2p_pairs(indices)
    if len(gpus) < 2:
        return Capability(True, False, False, (f"{describe_gpus(gpus)}: one GPU, no all-reduce",))
    if missing:
        pairs = ", ".join(f"{a}-{b}" for a, b in missing[:4]) + (" ..." if len(missing) > 4 else "")
        reason = (
            f"no P2P between GPUs {pairs}: IPC all-reduce kernels need direct peer access "
            "(GeForce cards need a P2P-enabled driver); NCCL"
        )
        return Capability(True, False, False, (reason,))
    numa = facts.numa_nodes(indices)
    where = f", NUMA nodes {numa}" if len(numa) > 1 else ""
    links = "NVLink" if facts.has_nvlink else "PCIe only"
    reasons = [f"{describe_gpus(gpus)}, {links}, P2P on all pairs{where}"]
    return Capability(
        sm12x=True,
        fusion_capable=True,
        pcie_ipc_capable=not facts.has_nvlink,
        reasons=tuple(reasons),
    )


@dataclass(frozen=True)
class HostHazards:
    """Host findings the plan acts on, each as (what was found, its fix)."""

    staged: tuple[tuple[str, str], ...] = ()  # every IPC kernel disfavoured: P2P via sysmem
    push: tuple[tuple[str, str], ...] = ()  # one-shot push disfavoured: ACS, write collapse
    notes: tuple[tuple[str, str], ...] = ()  # cited only: IOMMU, BAR1, ACS on root ports


def _found(check: HostCheck) -> tuple[str, str]:
    return f"host {check.name}: {check.detail}", check.fix


def host_hazards(findings: HostFindings | None) -> HostHazards:
    """What the plan makes of the host findings; nothing without findings."""
    if findings is None:
        return HostHazards()
    failed = {c.name: c for c in findings.checks if c.status == FAIL}
    staged = (_found(failed["p2p_driver"]),) if "p2p_driver" in failed else ()
    push = (_found(failed["acs"]),) if "acs" in failed else ()
    if findings.probe is not None and findings.probe.collapse:
        push += ((f"host p2p probe: {findings.probe.describe()}", ""),)
    cited = {"iommu": (WARN, FAIL), "bar1": (WARN, FAIL), "acs": (WARN,)}  # failed ACS: push
    notes = tuple(_found(c) for c in findings.checks if c.status in cited.get(c.name, ()))
    return HostHazards(staged, push, notes)


_PLAIN_NAMES = {
    "pcie_ipc": "PCIe-IPC (staged)",
    "nccl": "NCCL",
    "sm120_pcie": "sgl-kernel-sm120",
    "upstream": "upstream's custom all-reduce or NCCL",
}


def _host_reasons(plan: AllReducePlan, hazards: HostHazards) -> tuple[str, ...]:
    """The host findings as reasons: what was found, what the plan did about it, the fix."""
    plain = _PLAIN_NAMES.get(plan.plain_allreduce, plan.plain_allreduce)
    measured = "the tuning table measured this host: its routes stand"
    if plan.routes:
        staged_outcome = push_outcome = measured
    else:
        fused = plan.fusion_backend
        staged_outcome = (
            "IPC all-reduce kernels disfavoured: NCCL"
            if fused is None and plan.plain_allreduce == "nccl"
            else f"kept as requested (fusion {fused or 'off'}, plain all-reduce {plain})"
        )
        push_outcome = (
            f"one-shot push all-reduce disfavoured; {plain}"
            if fused is None
            else f"{fused}'s one-shot push kept as requested"
        )

    def line(found: str, fix: str, outcome: str = "") -> str:
        return found + (f": {outcome}" if outcome else "") + (f" (fix: {fix})" if fix else "")

    return (
        *(line(found, fix, staged_outcome) for found, fix in hazards.staged),
        *(line(found, fix, push_outcome) for found, fix in hazards.push),
        *(line(found, fix) for found, fix in hazards.notes),
    )


def _tp_span(facts: HostFacts, d: Deployment) -> tuple[int, int]:
    """(nodes of the deployment, nodes one TP group spans); a topology's ``nnodes`` counts too."""
    nodes = max(d.nnodes, facts.nnodes)
    return nodes, tp_group_nodes(nodes, d.pp_size)


def _span_text(d: Deployment, nodes: int, span: int) -> str:
    return (
        f"the TP group spans {span} nodes (tp={d.tp_size}, pp={d.pp_size}, nnodes={nodes}: "
        f"{d.tp_size // span} TP ranks a node)"
    )


# Upstream refuses trtllm whenever nnodes > 1, wherever the TP group sits:
# layers/flashinfer_comm_fusion.py resolve_flashinfer_allreduce_fusion_backend passes
# ``get_parallel().nnodes > 1`` to ``_resolve_backend``, which raises for trtllm then.
TRTLLM_MULTI_NODE = (
    "upstream's trtllm backend is single-node only (flashinfer_comm_fusion._resolve_backend "
    f"raises for it whenever nnodes > 1): use {PLUGIN_BACKEND_ENV}=sm120_pcie for a TP group "
    "inside one node"
)


def _node_reasons(facts: HostFacts, d: Deployment) -> tuple[str, ...]:
    """Where a multi-node launch's TP group sits, when it is inside one node (the spanning
    case is said by the fusion and plain all-reduce reasons)."""
    nodes, span = _tp_span(facts, d)
    if nodes == 1 or span > 1:
        return ()
    stages = d.ranks_per_node()[1]
    return (
        f"PP across nodes: the TP group inside one node (tp={d.tp_size}, pp={d.pp_size}, "
        f"nnodes={nodes}: {stages} PP stage{'s' if stages > 1 else ''} a node), where PCIe-IPC "
        "(upstream's pcie_ipc_ar has no node check) and sgl-kernel-sm120 can serve it",
    )


def _fusion_blocker(
    cap: Capability, facts: HostFacts, d: Deployment, archs: Collection[str]
) -> str | None:
    """Why no fused backend can serve this launch, or None."""
    if d.enforce_disable_fusion:
        return "fusion off: --enforce-disable-flashinfer-allreduce-fusion"
    if d.plugin_backend == "off":
        return f"fusion off: {PLUGIN_BACKEND_ENV}=off"
    if d.tp_size <= 1:
        return "fusion off: tp=1 has no all-reduce"
    if d.deterministic:
        return "fusion off: deterministic inference (upstream turns the fused all-reduce off)"
    if d.ray:
        return (
            "fusion off: --use-ray (Ray actors do not load SGLang plugins, and upstream's fused "
            "backends refuse SM12x there)"
        )
    if d.model_arch is None and requested_fusion(d) is None:
        return "fusion not planned: model architecture unknown (pass --model-arch)"
    if d.model_arch is not None and d.model_arch not in archs:
        return f"fusion off: upstream has no fused all-reduce path for {d.model_arch}"
    nodes, span = _tp_span(facts, d)
    if span > 1:
        return f"fusion off: {_span_text(d, nodes, span)}: the fused kernels reach one node's peers"
    if d.attention_dp:
        return "fusion off: attention data-parallelism"
    if d.moe_a2a_backend != "none":
        return f"fusion off: MoE all-to-all backend {d.moe_a2a_backend}"
    if not cap.fusion_capable:
        requested = requested_fusion(d)
        refused = f" (requested {requested} refused)" if requested else ""
        return f"fusion off{refused}: {cap.reasons[0]}"
    return None


def _sm120_pcie_blocker(facts: HostFacts, d: Deployment) -> str | None:
    """Why sgl-kernel-sm120's fused kernel cannot serve this launch, or None."""
    if facts.sm120_kernel_problem is not None:
        return facts.sm120_kernel_problem
    if d.tp_size not in SM120_PCIE_WORLD_SIZES:
        return f"sgl-kernel-sm120 serves TP 2/4/8, not {d.tp_size}"
    if d.dtype is not None and d.dtype not in SM120_PCIE_DTYPES:
        return f"sgl-kernel-sm120 serves bf16/fp16, model dtype is {d.dtype}"
    if d.disaggregation:
        return (
            "PD disaggregation: a prefill server sends KV caches without streaming outputs, "
            "where sgl-kernel-sm120's peer-timeout check sits"
        )
    return None


FROM_TABLE = "<from the tuning table>"  # _plan_fusion's answer when the table decides


def requested_fusion(d: Deployment) -> str | None:
    """The fused backend the user asked for, or None where the plan decides. "auto" is no
    request, however it is spelled (``--flashinfer-allreduce-fusion-backend auto``, the
    deprecated ``--enable-flashinfer-allreduce-fusion``, which upstream turns into auto,
    ``SGLANG_SM120_FUSION_BACKEND=auto``): the tuning table decides, then the TP default."""
    flag = None if d.fusion_backend_flag == "auto" else d.fusion_backend_flag
    return flag or d.plugin_backend


def _plan_fusion(
    cap: Capability, facts: HostFacts, d: Deployment, archs: Collection[str]
) -> tuple[str | None, str]:
    """(fusion backend, reason); FROM_TABLE when a tuning table decides (_plan_from_table)."""
    blocker = _fusion_blocker(cap, facts, d, archs)
    requested = requested_fusion(d)
    if blocker is not None:
        return None, blocker
    if requested == "sm120_pcie":
        why_not = _sm120_pcie_blocker(facts, d)
        if why_not is not None:
            return None, f"fusion off (requested sm120_pcie refused): {why_not}"
        return (
            "sm120_pcie",
            "fusion sm120_pcie: requested; one fused kernel per point, staged for PCIe",
        )
    if requested is not None:
        if requested not in FUSION_BACKENDS_RUNNABLE_ON_SM12X:
            return (
                None,
                (
                    f"fusion off: backend {requested} refused on SM12x (mnnvl needs an NVLink "
                    "fabric, cutedsl needs SM100); use trtllm or sm120_pcie"
                ),
            )
        if _tp_span(facts, d)[0] > 1:
            return None, f"fusion off (requested {requested} refused): {TRTLLM_MULTI_NODE}"
        how = (
            "--flashinfer-allreduce-fusion-backend"
            if requested == d.fusion_backend_flag
            else PLUGIN_BACKEND_ENV
        )
        return "trtllm", f"fusion trtllm: requested with {how} {requested}"
    if d.tuning is not None:
        return FROM_TABLE, ""
    asked_auto = "auto" in (d.fusion_backend_flag, d.plugin_backend)
    lead = "auto (the plan decides): " if asked_auto else ""  # said where the user said auto
    tuning_note = f"; {d.tuning_note}" if d.tuning_note else ""
    fusion, reason = _default_fusion(facts, d)
    return fusion, lead + reason + tuning_note


def _default_fusion(facts: HostFacts, d: Deployment) -> tuple[str | None, str]:
    """(fusion backend, reason) where nobody asked for one and no tuning table decides."""
    hazards = host_hazards(d.host)
    if d.tp_size in FUSION_AUTO_TP_SIZES and _tp_span(facts, d)[0] > 1:
        return None, f"fusion off at TP{d.tp_size}: auto would pick trtllm, and {TRTLLM_MULTI_NODE}"
    if d.tp_size in FUSION_AUTO_TP_SIZES and (hazards.staged or hazards.push):
        return None, (
            f"fusion off at TP{d.tp_size}: auto would pick trtllm, whose one-shot push the host "
            "findings below disfavour"
        )
    if d.tp_size in FUSION_AUTO_TP_SIZES:
        return (
            "trtllm",
            "fusion trtllm: auto at TP2 (FlashInfer PR #3903 measured +2-5% decode on SM120)",
        )
    if facts.has_nvlink:
        return None, (
            f"fusion off by default at TP{d.tp_size}: not measured on SM12x with NVLink "
            "(opt in with --flashinfer-allreduce-fusion-backend trtllm)"
        )
    return None, (
        f"fusion off by default at TP{d.tp_size} over PCIe; on by default at TP2 only: "
        "FlashInfer PR #3903 measured +2-5% decode at TP2 on SM120, and upstream PR #32330 "
        "(trtllm fusion on SM12x) was closed after a TP4 regression, maintainers asking for "
        "opt-in by TP (opt in with --flashinfer-allreduce-fusion-backend trtllm or "
        f"{PLUGIN_BACKEND_ENV}=sm120_pcie)"
    )


def _plan_plain(
    cap: Capability, facts: HostFacts, d: Deployment, fusion: str | None
) -> tuple[str, str]:
    if d.tp_size <= 1:
        return "none", "plain all-reduce: none at tp=1"
    nodes, span = _tp_span(facts, d)
    if span > 1:
        return "nccl", (
            f"plain all-reduce NCCL: {_span_text(d, nodes, span)}: IPC all-reduce kernels "
            "reach one node's peers"
        )
    if d.ray:
        return "nccl", "plain all-reduce NCCL: --use-ray (the actors do not load SGLang plugins)"
    if not cap.fusion_capable:
        return "nccl", f"plain all-reduce NCCL: {cap.reasons[0]}"
    if not cap.pcie_ipc_capable:
        return "upstream", "plain all-reduce: NVLink present, upstream's custom all-reduce or NCCL"
    if d.tp_size not in PCIE_IPC_WORLD_SIZES:
        return (
            "nccl",
            f"plain all-reduce NCCL: PCIe-IPC kernels exist for TP 2/4/8, not {d.tp_size}",
        )
    if d.pcie_ipc_env is False:
        return "nccl", "plain all-reduce NCCL: SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=0 set by the user"
    if d.deterministic:
        return (
            "nccl",
            "plain all-reduce NCCL: deterministic inference (PCIe-IPC picks tactics per shape)",
        )
    if fusion == "sm120_pcie" and d.pcie_ipc_env is None:
        return "sm120_pcie", (
            "plain all-reduce sgl-kernel-sm120 up to its workspace "
            "(max_bs x draft tokens x hidden); larger ones: NCCL"
        )
    if d.tuning is None and d.pcie_ipc_env is None and host_hazards(d.host).staged:
        return "nccl", (
            "plain all-reduce NCCL: P2P is staged through system memory here (host finding "
            "below), which every IPC all-reduce kernel pays"
        )
    if d.dtype is not None and d.dtype != "bfloat16":
        refused = " (SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 refused)" if d.pcie_ipc_env else ""
        return "nccl", (
            f"plain all-reduce NCCL{refused}: PCIe-IPC serves bf16 only, model dtype is {d.dtype}"
        )
    ahead = ", ahead of the fused backend's all-to-all kernel" if fusion else ""
    why = ", SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 set by the user" if d.pcie_ipc_env else ""
    return "pcie_ipc", (
        f"plain all-reduce PCIe-IPC{ahead}{why}: staged push kernels for decode/verify-sized "
        "reductions (max_bs x draft tokens x hidden); larger ones stay on NCCL's ring"
    )


UPSTREAM_DECIDES = "upstream decides: "


def upstream_decides(why: str) -> AllReducePlan:
    """The plan in force where the plugin applies nothing (another sglang, a contract mismatch,
    the kill switch): upstream's own behaviour, with ``why`` as its one reason."""
    return AllReducePlan(False, None, "upstream", (UPSTREAM_DECIDES + why,))


def plan_allreduce(
    facts: HostFacts, deployment: Deployment, fusion_archs: Collection[str]
) -> AllReducePlan:
    """The all-reduce plan for one launch. Pure: same inputs, same plan."""
    gpu_ids = deployment.used_gpu_ids()
    cap = hardware_capability(facts, gpu_ids, any_arch=deployment.any_arch)
    if not cap.sm12x:
        return AllReducePlan(False, None, "upstream", cap.reasons)
    cap = dataclasses.replace(cap, reasons=(*cap.reasons, *_node_reasons(facts, deployment)))
    spans_nodes = _tp_span(facts, deployment)[1] > 1
    if not spans_nodes and len(facts.gpus_at(gpu_ids)) < len(gpu_ids):
        tp = deployment.tp_size
        stages = deployment.ranks_per_node()[1]
        shape = f"tp={tp}" + (f" x {stages} PP stages" if stages > 1 else "")
        reason = (
            f"{shape} needs GPUs [{size_ranges(gpu_ids)}], {len(facts.gpus)} visible: NCCL"
            if deployment.gpu_ids is not None
            else f"{shape} needs {len(gpu_ids)} GPUs, {len(facts.gpus)} visible: NCCL"
        )
        return AllReducePlan(True, None, "nccl", (*cap.reasons, reason))
    hazards = host_hazards(deployment.host)
    fusion, fusion_reason = _plan_fusion(cap, facts, deployment, fusion_archs)
    if fusion == FROM_TABLE:
        plan = _plan_from_table(cap, facts, deployment)
        if plan is not None:
            return dataclasses.replace(plan, reasons=(*plan.reasons, *_host_reasons(plan, hazards)))
        note = (
            "tuning table unusable here: no candidate this server can run was measured "
            "correct at every size"
        )
        deployment = dataclasses.replace(deployment, tuning=None, tuning_note=note)
        fusion, fusion_reason = _plan_fusion(cap, facts, deployment, fusion_archs)
    plain, plain_reason = _plan_plain(cap, facts, deployment, fusion)
    plan = AllReducePlan(True, fusion, plain, (*cap.reasons, fusion_reason, plain_reason))
    if deployment.tp_size <= 1:
        return plan
    return dataclasses.replace(plan, reasons=(*plan.reasons, *_host_reasons(plan, hazards)))


def _upstream_order(
    plain: str, pcie_ipc_behind: bool, custom_ar_on: bool, extras: Collection[str]
) -> tuple[str, ...]:
    """The communicators an all-reduce that SGLang makes is offered to, in upstream's order
    (parallel_state._resolve_outplace_all_reduce_method: MSCCL++ where it has a tuned
    configuration, ahead of custom all-reduce and PCIe-IPC; torch symmetric memory after them;
    NCCL last). ``extras``: the switched-on ones of MSCCL++ and torch symmetric memory."""
    order = ["mscclpp"] if "mscclpp" in extras else []
    if custom_ar_on:
        order.append("custom_ar")
    if plain == "pcie_ipc" or pcie_ipc_behind:
        order.append("pcie_ipc")
    if "torch_symm_mem" in extras:
        order.append("torch_symm_mem")
    return (*order, "nccl")


def _taker(
    cells: dict[tuple[str, int], Measurement], order: Sequence[str], tokens: int
) -> str | None:
    """The communicator of ``order`` that takes an all-reduce of ``tokens`` rows, as tune saw
    it: a cell that declines the size (``DECLINES``) passes it on, as upstream's own check
    does; a communicator with no cell at that size is untimed there (None: nothing measured
    says where the all-reduce goes)."""
    for backend in order:
        cell = cells.get((backend, tokens))
        if cell is None:
            return None
        if cell.us is None and cell.note.startswith(DECLINES):
            continue
        return backend
    return None


def _servable_at(
    fusion: str | None, plain: str, order: tuple[str, ...], cells: dict, kernel_usable: bool
) -> Callable[[int], frozenset[str]]:
    """The table backends one server can run at a fused point of a given size: its fusion
    backend (one per server: trtllm and sm120_pcie exclude each other), the communicator that
    all-reduces a declined point there (``_taker``), and under sm120_pcie with its plain
    all-reduce ours, our all-reduce + SGLang's norm (sm120_pcie_unfused). With a fusion
    backend on, the TP groups are tagged for FlashInfer's all-reduce unless the plain
    all-reduce is PCIe-IPC (patch allreduce_precedence): under trtllm a declined point would
    run trtllm's own all-reduce, and the sm120_pcie_backend patch declines trtllm points to
    PCIe-IPC only (it needs sgl-kernel-sm120: ``HostFacts.sm120_kernel_problem``)."""

    @functools.cache  # winners asks once per cell: a table of every size has ~16k
    def at(tokens: int) -> frozenset[str]:
        backends = {fusion} if fusion is not None else set()
        taker = _taker(cells, order, tokens)
        trtllm_declines = plain == "pcie_ipc" and kernel_usable and taker == "pcie_ipc"
        if taker is not None and (fusion != "trtllm" or trtllm_declines):
            backends.add(taker)
        if fusion == "sm120_pcie" and plain == "sm120_pcie":
            backends.add("sm120_pcie_unfused")
        return frozenset(backends)

    return at


def _sizes_by_backend(routes: dict[int, str]) -> str:
    by_backend: dict[str, list[int]] = {}
    for tokens, backend in routes.items():
        by_backend.setdefault(backend, []).append(tokens)
    return ", ".join(f"{b} at [{size_ranges(sizes)}]" for b, sizes in by_backend.items())


def _extras_blocker(d: Deployment, extra: str) -> str | None:
    """Why the plan does not turn on upstream's ``extra`` communicator for this launch, or
    None: only where nothing the user set says otherwise. NCCL symmetric memory
    (--enable-symm-mem) sends every plain all-reduce to NCCL first; an explicit
    SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 asks for the sizes MSCCL++ would take. (Deterministic
    inference and --use-ray never reach a table plan: fusion is off there, and the default
    rules apply.)"""
    if d.enable_symm_mem:
        return "--enable-symm-mem sends plain all-reduces to NCCL first"
    if extra == "mscclpp" and d.pcie_ipc_env:
        return "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 set by the user, which MSCCL++ would preempt"
    return None


def _plan_from_table(cap: Capability, facts: HostFacts, d: Deployment) -> AllReducePlan | None:
    """The plan a tuning table picks, or None when no candidate can serve every measured size.

    Candidates: fusion off, trtllm, sm120_pcie, and sm120_pcie with upstream's PCIe-IPC on
    behind our all-reduce; without trtllm, each also with upstream's MSCCL++ and/or torch
    symmetric memory switched on where the table measured them correct. Each serves every
    measured size with the fastest correct backend it can run there (``_servable_at``; a size
    leaves the fusion backend only by UNFUSED_MIN_GAIN). The candidate whose routes come
    closest to the per-size best wins, by the geometric mean of route time / best time over the
    measured sizes (every size weighs the same; a tie goes to the simpler candidate), except
    that fusion is turned off, or an upstream switch on, only when that beats the best
    candidate without it by UNFUSED_MIN_GAIN's ratio, as a size leaves its fusion backend.
    At TP2 or with NVLink upstream's custom all-reduce takes declined points and an unfused
    server's all-reduces first: where tune timed it, the table routes sizes there; where it did
    not, no size is declined and fusion off is no candidate."""
    table = d.tuning
    assert table is not None
    times = correct_times(table)
    best_us: dict[int, float] = {}
    for (_, tokens), us in times.items():
        best_us[tokens] = min(us, best_us.get(tokens, us))
    if not best_us:
        return None
    cells = {(m.backend, m.tokens): m for m in table.measurements}
    bad = excluded(table)
    note = f" (excluded as wrong here: {', '.join(bad)})" if bad else ""
    pcie_ipc_usable = _plan_plain(cap, facts, d, None)[0] == "pcie_ipc"
    kernel_usable = facts.sm120_kernel_problem is None
    # Upstream builds its custom all-reduce at world size 2 (v1 over PCIe) or with NVLink, and
    # resolves an untagged all-reduce to it before PCIe-IPC and NCCL.
    custom_ar_first = d.custom_all_reduce and (d.tp_size == 2 or facts.has_nvlink)
    custom_ar_timed = custom_ar_first and any(b == "custom_ar" for b, _ in cells)
    measured = {backend for backend, _ in times}
    user_on = {
        e
        for e, on in (("mscclpp", d.enable_mscclpp), ("torch_symm_mem", d.enable_torch_symm_mem))
        if on
    }
    optional = [
        e
        for e in ("mscclpp", "torch_symm_mem")
        if e in measured and e not in user_on and _extras_blocker(d, e) is None
    ]
    extra_sets = [frozenset()] + [frozenset({e}) for e in optional]
    if len(optional) == 2:
        extra_sets.append(frozenset(optional))
    candidates: list[tuple[str | None, bool, frozenset[str]]] = [
        (None, False, extras) for extras in extra_sets
    ]
    trtllm_refused = _tp_span(facts, d)[0] > 1  # TRTLLM_MULTI_NODE
    if "trtllm" in measured and not trtllm_refused:
        candidates.append(("trtllm", False, frozenset()))
    if _sm120_pcie_blocker(facts, d) is None and measured & set(SM120_PCIE_ROUTES):
        candidates += [("sm120_pcie", False, extras) for extras in extra_sets]
        behind_possible = _plan_plain(cap, facts, d, "sm120_pcie")[0] == "sm120_pcie"
        if pcie_ipc_usable and behind_possible and (custom_ar_timed or not custom_ar_first):
            candidates += [("sm120_pcie", True, extras) for extras in extra_sets]
    options = []
    for fusion, pcie_behind, extras in candidates:
        plain, plain_reason = _plan_plain(cap, facts, d, fusion)
        order = _upstream_order(plain, pcie_behind, custom_ar_first, extras | user_on)
        allowed = _servable_at(fusion, plain, order, cells, kernel_usable)
        routes = winners(table, allowed, prefer=fusion)
        if set(routes) != set(best_us):
            continue  # a measured size this candidate cannot serve
        own = SM120_PCIE_ROUTES if fusion == "sm120_pcie" else (fusion,)
        if fusion is not None and not set(routes.values()) & set(own):
            continue  # declines every size: fusion off, with a workspace for nothing
        if extras and not extras <= set(routes.values()):
            continue  # a switch that serves no size is no candidate
        ratios = [times[(routes[t], t)] / best_us[t] for t in routes]
        cost = math.prod(ratios) ** (1 / len(ratios))
        name = (
            (fusion or "off")
            + (" with PCIe-IPC behind" if pcie_behind else "")
            + "".join(f" + {e}" for e in sorted(extras))
        )
        options.append((cost, name, fusion, plain, plain_reason, routes, allowed, extras, order))
    if not options:
        return None
    margin = 1 - UNFUSED_MIN_GAIN[0]
    plain_options = [o for o in options if not o[7]]
    chosen = min(plain_options or options, key=lambda o: o[0])
    fused = [o for o in plain_options if o[2] is not None]
    if chosen[2] is None and fused:
        best_fused = min(fused, key=lambda o: o[0])
        if chosen[0] > margin * best_fused[0]:
            chosen = best_fused  # fusion off by noise only: keep fusing
    switched = [o for o in options if o[7]]
    if switched:
        best_switched = min(switched, key=lambda o: o[0])
        if not plain_options or best_switched[0] < margin * chosen[0]:
            chosen = best_switched  # an upstream switch on for a clear win only
    cost, name, fusion, plain, plain_reason, routes, allowed, extras, chosen_order = chosen
    others = "; ".join(f"{o[1]} {o[0]:.2f}x" for o in options if o[1] != name)
    reasons = [
        *cap.reasons,
        (
            f"fusion {fusion or 'off'} from the tuning table: {_sizes_by_backend(routes)} tokens, "
            f"{cost:.2f}x the per-size best (geometric mean{'; ' + others if others else ''})"
            f"{note}"
        ),
        plain_reason,
    ]
    for extra in sorted(extras):
        sizes = [t for t, b in routes.items() if b == extra]
        reasons.append(
            f"{UPSTREAM_SWITCH_FLAGS[extra]} on from the tuning table: upstream's {extra} "
            f"all-reduce serves [{size_ranges(sizes)}] tokens, ahead of what would serve them "
            "(a clear win over the best plan without it)"
        )

    def taker_of(tokens: int) -> str | None:
        return _taker(cells, chosen_order, tokens)

    displaced: dict[tuple[str, str], list[int]] = {}
    for tokens, backend in winners(table, prefer=None).items():
        if backend not in allowed(tokens):
            displaced.setdefault((backend, routes[tokens]), []).append(tokens)
    for (backend, route), sizes in displaced.items():
        family = "sm120_pcie" if backend in SM120_PCIE_ROUTES else backend  # its fusion backend
        if family == "trtllm" and trtllm_refused:
            why = "upstream refuses trtllm whenever nnodes > 1"
        elif family in ("trtllm", "sm120_pcie") and family != fusion:
            why = f"one fusion backend per server, this one {fusion or 'off'}"
        elif backend == "sm120_pcie_unfused":
            why = f"needs sgl-kernel-sm120 as the plain all-reduce, the plan uses {plain}"
        elif backend in ("mscclpp", "torch_symm_mem") and backend not in extras | user_on:
            blocker = _extras_blocker(d, backend)
            why = f"{UPSTREAM_SWITCH_FLAGS[backend]} " + (
                f"left off: {blocker}" if blocker else "not a clear win over the whole plan"
            )
        elif backend == "custom_ar" and not custom_ar_first:
            why = (
                "--disable-custom-all-reduce set"
                if not d.custom_all_reduce
                else "upstream builds custom all-reduce at TP2 or with NVLink only"
            )
        elif custom_ar_first and not custom_ar_timed and backend in ("pcie_ipc", "nccl"):
            why = "custom all-reduce would take a declined point, untimed"
        elif fusion == "trtllm" and plain != "pcie_ipc":
            why = "a declined trtllm point would run trtllm's own all-reduce"
        elif fusion == "trtllm" and not kernel_usable:
            why = "sgl-kernel-sm120 cannot run here: nothing declines a trtllm point"
        elif fusion == "trtllm" and backend in UPSTREAM_BACKENDS:
            why = "a trtllm point is declined to PCIe-IPC only (patch sm120_pcie_backend)"
        elif backend in ("pcie_ipc", "nccl") and taker_of(sizes[0]) in (None, "pcie_ipc", "nccl"):
            why = "a server has one path for declined points, here " + (
                "PCIe-IPC" if "pcie_ipc" in chosen_order else "NCCL"
            )
        elif backend in (*UPSTREAM_BACKENDS, "pcie_ipc", "nccl"):
            why = f"upstream offers an all-reduce of that size to {taker_of(sizes[0])} first"
        else:
            why = "not a backend this version runs"
        reasons.append(f"{backend} fastest at [{size_ranges(sizes)}] tokens ({why}): {route} there")
    if custom_ar_first and not custom_ar_timed:
        reasons.append(
            "no size declined off the fusion backend: "
            + ("at TP2" if d.tp_size == 2 else "with NVLink")
            + " upstream's custom all-reduce takes a declined point (and an unfused server's "
            "all-reduces) before PCIe-IPC and NCCL, and this table did not time it (`tune` "
            "times it now; --disable-custom-all-reduce lets the table route sizes)"
        )
    pcie = [t for t, b in routes.items() if b == "pcie_ipc"]
    if pcie and fusion == "trtllm":
        reasons.append(
            f"the trtllm points at {pcie} tokens are declined to PCIe-IPC where its workspace "
            "(sized by upstream for the widest decode batch) holds them; larger ones stay on "
            "trtllm"
        )
    if pcie and plain == "sm120_pcie":
        reasons.append(
            f"PCIe-IPC on behind sgl-kernel-sm120: the points at [{size_ranges(pcie)}] tokens "
            "are declined and all-reduced by PCIe-IPC where its workspace holds them (larger "
            "ones stay on our kernel), as is any all-reduce that our kernel declines and that "
            "fits PCIe-IPC's workspace"
        )
    switches = tuple(UPSTREAM_SWITCH_FIELDS[e] for e in sorted(extras))
    plan = AllReducePlan(
        True, fusion, plain, tuple(reasons), tuple(routes.items()), upstream_switches=switches
    )
    # One route per run of sizes with the same backend (its largest size): route_at answers
    # the same, and launcher and workers hold the same plan, whose JSON stays small.
    runs = tuple((last, backend) for _, last, backend in plan.route_ranges())
    return dataclasses.replace(plan, routes=runs)
