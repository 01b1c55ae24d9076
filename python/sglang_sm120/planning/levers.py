"""Every all-reduce switch SGLang 0.5.23 has, judged for one launch: can it run here, does the
plan use it, and what a user who sets it gets. ``doctor`` and ``plan`` print these rows as
"all-reduce options".

Pure, like the policy: the rows come from the facts, the deployment, the plan and upstream's
own conditions as ``planning.upstream`` states them (each proven equal to the installed sglang
by ``server.upstream_tables``, which ``test/unit/test_contract.py`` runs). Nothing here
imports SGLang or probes hardware; whether the ``mscclpp`` package imports is a fact the caller
passes (``None`` where it cannot know, as ``plan`` for another machine).

Example::

    rows = allreduce_levers(facts, deployment, plan, FUSION_ARCHS, mscclpp=None)
    [row.line() for row in rows]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from sglang_sm120.machine.facts import GpuInfo, HostFacts
from sglang_sm120.planning.policy import (
    UPSTREAM_DECIDES,
    AllReducePlan,
    Deployment,
    plan_allreduce,
)
from sglang_sm120.planning.upstream import (
    CUSTOM_ALL_REDUCE_MAX_BYTES,
    CUSTOM_ALL_REDUCE_PCIE_MAX_WORLD,
    CUSTOM_ALL_REDUCE_WORLD_SIZES,
    MSCCLPP_WORLD_SIZES,
    TORCH_SYMM_MEM_MAX_BYTES,
)
from sglang_sm120.version import SGLANG_PIN

MSCCLPP_MISSING = (
    "the mscclpp package does not import (it is not on PyPI: build it from "
    "github.com/microsoft/mscclpp)"
)
NOT_MEASURED = "not measured on SM12x: `sglang-sm120 tune` does not time it"
# Upstream's communicators `tune` times where they can run (commands.tune.upstream_refusals).
TUNED = "`sglang-sm120 tune` times it here, and a tuning table turns it on where it clearly wins"


@dataclass(frozen=True)
class Lever:
    """One upstream switch for this launch. ``can_run`` None: the facts cannot tell (``why``
    says what decides); ``used`` None: upstream decides, not this plan."""

    switch: str
    can_run: bool | None
    used: bool | None
    why: str
    if_set: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def line(self) -> str:
        run = {True: "can run", False: "cannot run", None: "may run"}[self.can_run]
        used = {True: "used", False: "not used", None: "upstream decides"}[self.used]
        return f"{self.switch}: {run}, {used}: {self.why}; if set: {self.if_set}"


@dataclass(frozen=True)
class _Group:
    """The TP group's GPUs and links, as upstream's checks see them."""

    size: int
    gpus: tuple[GpuInfo, ...]
    missing_p2p: tuple[tuple[int, int], ...]
    nvlink: bool
    spans_nodes: bool

    @classmethod
    def of(cls, facts: HostFacts, d: Deployment) -> _Group:
        ids = d.first_tp_group()
        return cls(
            size=d.tp_size,
            gpus=facts.gpus_at(ids),
            missing_p2p=tuple(facts.missing_p2p_pairs(i for i in ids if i < len(facts.gpus))),
            nvlink=facts.has_nvlink,
            spans_nodes=d.nnodes > 1 and d.tp_size > len(facts.gpus),
        )

    def majors(self) -> list[int]:
        return sorted({g.capability[0] for g in self.gpus})

    def no_p2p(self) -> str:
        pairs = ", ".join(f"{a}-{b}" for a, b in self.missing_p2p[:4])
        return f"no P2P between GPUs {pairs}" + (" ..." if len(self.missing_p2p) > 4 else "")


def _unmanaged(plan: AllReducePlan) -> str:
    """Why upstream decides: the plugin stood down (``policy.upstream_decides``), or these GPUs
    are not ones it manages."""
    if plan.reasons and plan.reasons[0].startswith(UPSTREAM_DECIDES):
        return "the plugin applies nothing here"
    return "this plan does not manage these GPUs"


def serving(plan: AllReducePlan) -> str:
    """Where the plan sends all-reduces, in a few words."""
    if not plan.managed:
        return f"upstream's own choice ({_unmanaged(plan)})"
    plain = {
        "none": "no all-reduce (tp=1)",
        "pcie_ipc": "PCIe-IPC for decode/verify sizes, NCCL above",
        "sm120_pcie": "sgl-kernel-sm120 up to its workspace, NCCL above",
        "nccl": "NCCL",
        "upstream": "upstream's custom all-reduce or NCCL",
    }[plan.plain_allreduce]
    fused = f"; fused points on {plan.fusion_backend}" if plan.fusion_backend else ""
    return plain + fused


def on(plan: AllReducePlan) -> str:
    """The plan's reasons for the upstream switches its tuning table turns on."""
    return "; ".join(r for r in plan.reasons if " on from the tuning table" in r)


def _reason(plan: AllReducePlan, *starts: str) -> str:
    """The plan's first reason that starts with one of ``starts`` ("" when none does)."""
    return next((r for r in plan.reasons if r.startswith(starts)), "")


def _changed(before: AllReducePlan, after: AllReducePlan, reason: str = "") -> str:
    """What a switch changes in the plan, said as the plan that results and its reason."""
    if (before.fusion_backend, before.plain_allreduce) == (
        after.fusion_backend,
        after.plain_allreduce,
    ):
        return f"the plan is unchanged ({serving(after)})"
    return f"the plan becomes: {serving(after)}" + (f" ({reason})" if reason else "")


def _custom_all_reduce(g: _Group, d: Deployment, plan: AllReducePlan) -> Lever:
    """custom_all_reduce_utils.can_use_custom_all_reduce_with_nvlink and should_custom_ar."""
    switch = "--disable-custom-all-reduce"
    if g.size <= 1:
        why = "tp=1 has no all-reduce"
    elif g.spans_nodes:
        why = "the TP group spans nodes; upstream builds it within one node only"
    elif g.size not in CUSTOM_ALL_REDUCE_WORLD_SIZES:
        why = f"world size {g.size} is not one upstream takes {CUSTOM_ALL_REDUCE_WORLD_SIZES}"
    elif g.missing_p2p:
        why = f"{g.no_p2p()}: upstream's P2P test disables it"
    elif g.size > CUSTOM_ALL_REDUCE_PCIE_MAX_WORLD and not g.nvlink:
        why = (
            f"upstream refuses more than {CUSTOM_ALL_REDUCE_PCIE_MAX_WORLD} PCIe-only GPUs "
            "(it needs NVLink above TP2)"
        )
    else:
        why = ""
    if why:
        return Lever(switch, False, False, why, f"no change: all-reduces stay on {serving(plan)}")
    how = "NVLink on all pairs" if g.nvlink else "TP2 over PCIe with P2P (the v1 kernel)"
    if not d.custom_all_reduce:
        return Lever(
            switch,
            True,
            False,
            f"upstream's custom all-reduce could serve here ({how}); this flag turns it off",
            f"plain all-reduces go to {serving(plan)}",
        )
    # With a fusion backend on and the plain all-reduce not PCIe-IPC, the TP group is tagged
    # for FlashInfer's all-reduce, which GroupCoordinator.all_reduce tries before this one.
    tagged = plan.managed and plan.fusion_backend is not None and not plan.pcie_ipc_on
    first = f"{plan.fusion_backend}'s all-reduce, then " if tagged else ""
    later = "PCIe-IPC (NCCL above)" if plan.managed and plan.pcie_ipc_on else "NCCL"
    mib = CUSTOM_ALL_REDUCE_MAX_BYTES >> 20
    return Lever(
        switch,
        True,
        True,
        f"upstream's custom all-reduce runs here ({how}) and is on by default: plain "
        f"all-reduces up to {mib} MiB go to {first}it, before {later}",
        f"those all-reduces go to {later} instead; `sglang-sm120 tune` times it, and a tuning "
        "table routes declined points to it where it wins",
    )


def _mscclpp(g: _Group, plan: AllReducePlan, mscclpp: bool | None) -> Lever:
    """pymscclpp.PyMscclppCommunicator.__init__: the package imports, the world size fits."""
    switch = "--enable-mscclpp"
    sizes = f"{MSCCLPP_WORLD_SIZES[0]}-{MSCCLPP_WORLD_SIZES[-1]}"
    stay = f"SGLang logs a warning and leaves it off; all-reduces stay on {serving(plan)}"
    if g.size <= 1:
        return Lever(switch, False, False, "tp=1 has no all-reduce", stay)
    if mscclpp is False:
        return Lever(switch, False, False, MSCCLPP_MISSING, stay)
    if g.size not in MSCCLPP_WORLD_SIZES:
        why = f"world size {g.size}: upstream's MSCCL++ communicator takes {sizes}"
        return Lever(switch, False, False, why, stay)
    takes = (
        "MSCCL++ takes the all-reduces it has a tuned configuration for, inside CUDA graphs, "
        "ahead of custom all-reduce and PCIe-IPC (upstream checks it first); the rest stay on "
        f"{serving(plan)}; {TUNED}"
    )
    if "enable_mscclpp" in plan.upstream_switches:
        why = f"the tuning table measured it faster at the sizes SGLang all-reduces: {on(plan)}"
        return Lever(switch, True, True, why, takes)
    if mscclpp is None:
        why = f"world size {g.size} fits ({sizes}); runs where the mscclpp package imports"
        return Lever(switch, None, False, why, takes)
    why = f"mscclpp imports and world size {g.size} fits ({sizes}); the plan leaves it off"
    return Lever(switch, True, False, why, takes)


def _torch_symm_mem(g: _Group, d: Deployment, plan: AllReducePlan) -> Lever:
    """torch_symm_mem.TorchSymmMemCommunicator.__init__: capability and world size in the size
    table, and a multicast address for the buffer."""
    switch = "--enable-torch-symm-mem"
    stay = f"all-reduces stay on {serving(plan)}"
    if g.size <= 1:
        return Lever(switch, False, False, "tp=1 has no all-reduce", f"no change: {stay}")
    blockers = []
    majors = g.majors()
    missing = [m for m in majors if m not in TORCH_SYMM_MEM_MAX_BYTES]
    if missing:
        blockers.append(
            "SGLang's size table has no " + ", ".join(f"SM{m}x" for m in missing) + " entry"
        )
    elif any(g.size not in TORCH_SYMM_MEM_MAX_BYTES[m] for m in majors):
        blockers.append(f"SGLang's size table has no world size {g.size}")
    if not g.nvlink:
        blockers.append("PCIe has no multicast")
    if blockers:
        return Lever(
            switch, False, False, "not available: " + " and ".join(blockers), f"no change: {stay}"
        )
    mib = min(TORCH_SYMM_MEM_MAX_BYTES[m][g.size] for m in majors) >> 20
    bf16 = "" if d.dtype in (None, "bfloat16") else f" (this model is {d.dtype}: none of its)"
    if "enable_torch_symm_mem" in plan.upstream_switches:  # it ran in tune: multicast is here
        why = f"the tuning table measured it faster at the sizes SGLang all-reduces: {on(plan)}"
        return Lever(switch, True, True, why, f"bf16 all-reduces up to {mib} MiB as planned")
    return Lever(
        switch,
        None,
        False,
        "capability and world size are in SGLang's table; multicast needs an NVSwitch fabric, "
        "which the facts do not record (upstream checks it at start)",
        f"bf16 all-reduces up to {mib} MiB{bf16} that custom all-reduce, PCIe-IPC and MSCCL++ "
        f"leave go to torch symmetric memory instead of NCCL; {TUNED}",
    )


def _nccl_symm_mem(g: _Group, plan: AllReducePlan) -> Lever:
    """GroupCoordinator.all_reduce sends a plain all-reduce to NCCL with symmetric memory
    before FlashInfer's tagged all-reduce and before _resolve_outplace_all_reduce_method."""
    switch = "--enable-symm-mem"
    if g.size <= 1:
        return Lever(switch, False, False, "tp=1 has no all-reduce", "no change")
    displaced = {
        "pcie_ipc": "PCIe-IPC serves no plain all-reduce any more",
        "sm120_pcie": "sgl-kernel-sm120 serves no plain all-reduce any more",
    }.get(plan.plain_allreduce if plan.managed else "", "the plain route was NCCL already")
    return Lever(
        switch,
        True,
        False,
        "upstream needs CUDA and torch >= 2.8 only; the plan leaves it off",
        "every plain all-reduce that custom all-reduce and MSCCL++ do not take goes to NCCL on "
        f"symmetric-memory buffers, checked before PCIe-IPC and FlashInfer ({displaced}; fused "
        "points keep their backend); SGLang also sets NCCL_NVLS_ENABLE=1 and "
        f"NCCL_CUMEM_ENABLE=1; {NOT_MEASURED}",
    )


def _nccl_nvls(g: _Group, plan: AllReducePlan) -> Lever:
    """entrypoints/engine.py _set_envs_and_config sets NCCL_NVLS_ENABLE from this flag (0 when
    neither it nor --enable-symm-mem is set, unless the user set the variable)."""
    switch = "--enable-nccl-nvls"
    nccl = (
        "NCCL_NVLS_ENABLE=1: NCCL's NVLink SHARP, which needs NVSwitch (NCCL docs, "
        "NCCL_NVLS_ENABLE)"
    )
    if g.size <= 1 or not g.nvlink:
        why = "tp=1 has no all-reduce" if g.size <= 1 else "PCIe only: no NVSwitch for NVLS"
        return Lever(switch, False, False, why, f"{nccl}: no effect here")
    return Lever(
        switch,
        None,
        False,
        "NVLink present; NVLS needs an NVSwitch fabric, which the facts do not record",
        f"{nccl}; NCCL may use NVLS for the all-reduces that reach it; routes stay {serving(plan)}",
    )


def _pre_warm_nccl(g: _Group, plan: AllReducePlan) -> Lever:
    """distributed/bootstrap.py: _prewarm_nccl runs one all-reduce on the TP group at start."""
    switch = "--pre-warm-nccl"
    if g.size <= 1:
        return Lever(switch, False, False, "tp=1: nothing to warm", "no change")
    return Lever(
        switch,
        True,
        False,
        "runs on CUDA at tp > 1; off by default on NVIDIA",
        "one small NCCL all-reduce at start-up, so the first request does not pay NCCL's "
        f"connection set-up; routes unchanged ({serving(plan)})",
    )


def _pcie_ipc(
    facts: HostFacts, d: Deployment, plan: AllReducePlan, archs: Collection[str]
) -> Lever:
    """SGLANG_ENABLE_PCIE_IPC_ALLREDUCE: the plan decides it (policy._plan_plain); the other
    value is judged by planning again with it flipped."""
    switch = "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"
    if not plan.managed:
        return Lever(
            switch,
            None,
            None,
            f"upstream's default (off); {_unmanaged(plan)}",
            "=1: upstream builds PCIe-IPC for the TP group (world sizes 2/4/8, bf16), after "
            "custom all-reduce",
        )
    used = plan.pcie_ipc_on
    flipped = not used
    other = plan_allreduce(facts, dataclasses.replace(d, pcie_ipc_env=flipped), archs)
    can = used or other.pcie_ipc_on
    why = (
        "on: the plan uses it"
        if used
        else (
            "the plan leaves it off"
            if can
            else f"cannot serve here: {_reason(other, 'plain all-reduce') or 'refused'}"
        )
    )
    reason = _reason(other, "plain all-reduce")
    return Lever(switch, can, used, why, f"={int(flipped)}: {_changed(plan, other, reason)}")


def _whose_behaviour(facts: HostFacts) -> str:
    """What these rows say of upstream's fusion is the pinned sglang's behaviour (the tables
    ``planning.upstream`` copies are proven equal to it only); "" unless the host reports
    another sglang."""
    installed = facts.versions.get("sglang")
    if installed is None or installed == SGLANG_PIN:
        return ""
    return f" (sglang {SGLANG_PIN}'s behaviour; sglang {installed} is installed, not checked)"


def _fusion_flags(
    facts: HostFacts, d: Deployment, plan: AllReducePlan, archs: Collection[str]
) -> tuple[Lever, Lever]:
    """--flashinfer-allreduce-fusion-backend and --enforce-disable-flashinfer-allreduce-fusion,
    judged by planning again with each set."""
    backend_switch = "--flashinfer-allreduce-fusion-backend"
    disable_switch = "--enforce-disable-flashinfer-allreduce-fusion"
    whose = _whose_behaviour(facts)
    if not plan.managed and {g.capability[0] for g in facts.gpus_at(d.first_tp_group())} == {12}:
        note = "upstream fuses on SM90/SM100 only: its auto-enable turns nothing on for SM12x"
        return (
            Lever(
                backend_switch,
                False,
                False,
                note + whose,
                "upstream's backend resolve raises ValueError for SM12x at warmup: the server "
                "does not start" + whose,
            ),
            Lever(disable_switch, True, None, note + whose, "no change: fusion stays off"),
        )
    if not plan.managed:
        note = "upstream decides (auto on SM90/SM100 for the architectures it fuses)" + whose
        return (
            Lever(backend_switch, None, None, note, "upstream's own rules"),
            Lever(disable_switch, True, None, note, "fusion off"),
        )
    trtllm = plan_allreduce(facts, dataclasses.replace(d, fusion_backend_flag="trtllm"), archs)
    off = plan_allreduce(facts, dataclasses.replace(d, enforce_disable_fusion=True), archs)
    fused = plan.fusion_backend is not None
    why = _reason(plan, "fusion", "auto") or f"fusion {plan.fusion_backend or 'off'}"
    return (
        Lever(
            backend_switch,
            trtllm.fusion_backend == "trtllm",
            fused,
            why,
            f"trtllm: {_changed(plan, trtllm, _reason(trtllm, 'fusion'))}",
        ),
        Lever(
            disable_switch,
            True,
            d.enforce_disable_fusion,
            "set" if d.enforce_disable_fusion else "not set",
            _changed(plan, off, _reason(off, "plain all-reduce")),
        ),
    )


def allreduce_levers(
    facts: HostFacts,
    deployment: Deployment,
    plan: AllReducePlan,
    archs: Collection[str],
    mscclpp: bool | None,
) -> tuple[Lever, ...]:
    """Every upstream all-reduce switch for this launch; ``archs``: the architectures with a
    fused point (for planning again with a switch flipped), ``mscclpp``: whether the package
    imports (None: unknown)."""
    g = _Group.of(facts, deployment)
    fusion_backend, fusion_off = _fusion_flags(facts, deployment, plan, archs)
    return (
        _custom_all_reduce(g, deployment, plan),
        _pcie_ipc(facts, deployment, plan, archs),
        fusion_backend,
        fusion_off,
        _mscclpp(g, plan, mscclpp),
        _torch_symm_mem(g, deployment, plan),
        _nccl_symm_mem(g, plan),
        _nccl_nvls(g, plan),
        _pre_warm_nccl(g, plan),
    )


def lever_lines(levers: tuple[Lever, ...]) -> list[str]:
    """The "all-reduce options" section of doctor and plan."""
    return ["all-reduce options (SGLang's switches, judged for this launch):"] + [
        f"  {lever.line()}" for lever in levers
    ]
