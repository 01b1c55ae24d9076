"""Patch: the ``sm120_pcie`` fusion backend, served by sgl-kernel-sm120.

Why: the fused all-reduce + residual + RMSNorm SGLang has (FlashInfer trtllm, a Lamport
    all-to-all) collapses over PCIe at TP4/TP8, and the staged PCIe all-reduce it has
    (PCIe-IPC) does not fuse the norm. sgl-kernel-sm120 does both in one kernel per point.
How: AROUND hooks on upstream's FlashInfer fusion functions. ``ensure_workspace_initialized``
    (upstream calls it from ``pre_initialize_workspaces``, before graph capture) builds one
    workspace per fusion group when the launcher's plan says ``sm120_pcie``, sized like
    upstream's PCIe-IPC (max_bs x draft tokens x hidden). From then on, and only for a group that
    has such a workspace, the fused point (``flashinfer_allreduce_residual_rmsnorm``) and the
    plain all-reduces of tagged groups (``can_use_flashinfer_allreduce`` /
    ``flashinfer_allreduce``) run our kernels for inputs the workspace holds, from the same peers
    (world size and group key, as upstream checks its own workspace), at the token counts where
    the plan's tuning table has it win; other inputs get upstream's unfused path. A group without
    our workspace (another backend, or none built) is handed to upstream unchanged, except that
    a ``trtllm`` plan whose tuning table routes a size to PCIe-IPC has that fused point
    declined too. A point routed to PCIe-IPC is handed to it only where PCIe-IPC's workspace,
    as upstream built it (read by an AFTER hook on ``PcieIpcCommunicator.prepare``), holds
    it; a larger one would land on NCCL, so it stays on the fusion backend. Every decision is
    a pure function of shapes, the group and the shared plan, so all ranks take the same
    path. The peer-timeout check is the ``peer_check`` patch.
Upstream: none; a new backend of this distribution.
Removal: when upstream ships a fused all-reduce + RMSNorm staged for PCIe on SM12x.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from sglang_sm120.machine.facts import sm120_kernel_problem
from sglang_sm120.planning.policy import AllReducePlan, Capability, tokens_in
from sglang_sm120.planning.tuning import SM120_PCIE_ROUTES
from sglang_sm120.server.contract import Symbol
from sglang_sm120.server.runtime import log_once, worker_plan

FUSION = "sglang.srt.layers.flashinfer_comm_fusion"
PCIE_IPC = "sglang.srt.distributed.device_communicators.pcie_ipc_ar"
BACKEND = "sm120_pcie"
FALLBACK_ROWS = 256  # when the runner's decode width is unknown (no CUDA-graph config)
# A server rank can trail its peers by a JIT build during warmup, far beyond the kernel
# package's 5 s default; still a bound, and SGLANG_SM120_TIMEOUT_MS overrides it.
SERVER_TIMEOUT_MS = 60_000
CONTRACT = (
    Symbol(
        f"{FUSION}.ensure_workspace_initialized",
        "function",
        params=(
            "max_token_num",
            "hidden_dim",
            "use_fp32_lamport",
            "dtype",
            "token_num",
            "use_oneshot",
            "use_attn_tp_group",
        ),
    ),
    Symbol(
        f"{FUSION}.flashinfer_allreduce_residual_rmsnorm",
        "function",
        params=(
            "input_tensor",
            "residual",
            "weight",
            "eps",
            "max_token_num",
            "use_oneshot",
            "trigger_completion_at_end",
            "fp32_acc",
            "use_attn_tp_group",
        ),
    ),
    Symbol(
        f"{FUSION}.can_use_flashinfer_allreduce",
        "function",
        params=("input_", "use_attn_tp_group", "expected_world_size", "expected_group_key"),
    ),
    Symbol(f"{FUSION}.flashinfer_allreduce", "function", params=("input_", "use_attn_tp_group")),
    Symbol(f"{FUSION}.resolve_fusion_group", "function", params=("use_attn_tp_group",)),
    Symbol(f"{PCIE_IPC}._decode_width", "function", params=()),
    Symbol(
        f"{PCIE_IPC}.PcieIpcCommunicator.prepare", "function", params=("self", "hidden", "max_rows")
    ),
)
ROLES = ("scheduler",)

Ranges = tuple[tuple[int, int | None], ...]  # token counts, as AllReducePlan.token_ranges

#: sgl_kernel_sm120, imported on first use; CPU rehearsals put a recording stand-in here.
KERNEL: Any = None


@dataclass(frozen=True)
class GroupWorkspace:
    """Our workspace of one fusion group, or ``ws=None`` when building it failed (every rank
    alike), which sends that group's points to upstream's unfused path. Holds everything the
    per-call decisions read (the plan's routes as token ranges included), so a call does no
    lookups and, under torch.compile, traces a few plain comparisons only."""

    ws: Any
    world_size: int
    group_key: tuple[Any, Any]
    plan: AllReducePlan
    rows: int
    hidden: int
    dtype: Any
    fused_ranges: Ranges = field(init=False)  # where the fused kernel won
    reduced_ranges: Ranges = field(init=False)  # where our all-reduce serves (fused or not)
    pcie_ipc_ranges: Ranges = field(init=False)  # where the table routes to PCIe-IPC

    def __post_init__(self) -> None:
        ours = self.plan.fusion_backend == BACKEND
        for name, backends in (
            ("fused_ranges", (BACKEND,)),
            ("reduced_ranges", SM120_PCIE_ROUTES),
            ("pcie_ipc_ranges", ("pcie_ipc",)),
        ):
            object.__setattr__(self, name, self.plan.token_ranges(backends) if ours else ())

    def serves(self, x: Any, residual: Any = None, weight: Any = None) -> bool:
        """Whether our kernel takes this input (fused with residual and weight, else plain): it
        fits the workspace and the plan routes its token count here (a fused point only where
        the fused kernel won; an all-reduce also where our all-reduce + a separate norm won;
        either where the table chose PCIe-IPC but PCIe-IPC's workspace cannot hold it). While
        tracing, as upstream does for its own workspace, only the static limits are compared
        (no call into the workspace object), the symbolic token count last."""
        import torch

        if self.ws is None:
            return False
        compiling = torch.compiler.is_compiling()
        if compiling and (x.dtype != self.dtype or x.shape[-1] != self.hidden):
            return False
        tokens = x.shape[0]
        ours = self.reduced_ranges if residual is None else self.fused_ranges
        if not tokens_in(tokens, ours) and not (
            tokens_in(tokens, self.pcie_ipc_ranges) and not _fits_pcie_ipc(tokens, x.shape[-1])
        ):
            return False
        if compiling:
            return tokens <= self.rows
        sk = kernel()
        try:
            if residual is None:
                sk.validate_all_reduce(x, device=self.ws.device, max_bytes=self.ws.max_bytes)
            else:
                sk.validate_fused(
                    x, residual, weight, device=self.ws.device, max_bytes=self.ws.max_bytes
                )
        except (TypeError, ValueError):  # InputTooLargeError is a ValueError too
            return False
        return True


#: use_attn_tp_group -> the workspace of that fusion group
_workspaces: dict[bool, GroupWorkspace] = {}
_UNRESOLVED = object()
#: token ranges a trtllm plan's tuning table routes to PCIe-IPC (() when none), once resolved
_trtllm_to_pcie_ipc: Any = _UNRESOLVED
#: elements PCIe-IPC's workspace holds, as upstream built it (0: not built, off or failed)
_pcie_ipc_numel = 0


def _trtllm_pcie_ipc_ranges() -> Ranges:
    """The token ranges a trtllm plan's table routes to PCIe-IPC, or () (another plan, or no
    such route). Resolved once per process, by the workspace setup upstream runs before
    capture (or the first eager call), so a call traced by torch.compile reads a global and
    compares integers."""
    global _trtllm_to_pcie_ipc
    if _trtllm_to_pcie_ipc is _UNRESOLVED:
        plan = worker_plan()
        trtllm = plan is not None and plan.fusion_backend == "trtllm"
        _trtllm_to_pcie_ipc = plan.token_ranges(("pcie_ipc",)) if trtllm else ()
    return _trtllm_to_pcie_ipc


def note_pcie_ipc_workspace(result, self, *args, **kwargs) -> None:
    """After upstream's ``PcieIpcCommunicator.prepare`` (the runner's warmup, before capture
    and compile): what PCIe-IPC's workspace really holds, sized by upstream from the runner's
    widest decode rows (clamped to the request pool), its fallback width or
    SGLANG_PCIE_IPC_MAX_NUMEL; 0 when it is off or its build failed."""
    global _pcie_ipc_numel
    _pcie_ipc_numel = 0 if self.disabled else int(self.max_numel)


def _fits_pcie_ipc(rows: int, hidden: int) -> bool:
    """Whether a point the table routes to PCIe-IPC reaches it, rather than NCCL: upstream's
    PCIe-IPC takes inputs of at most the elements its workspace holds. A larger point stays
    on the fusion backend (trtllm holds 2048 rows; our kernel its decode rows)."""
    return _pcie_ipc_numel > 0 and rows * hidden <= _pcie_ipc_numel


def kernel() -> Any:
    global KERNEL
    if KERNEL is None:
        import sgl_kernel_sm120
        import sgl_kernel_sm120.ops  # registers torch.ops.sgl_kernel_sm120 before any capture

        KERNEL = sgl_kernel_sm120
    return KERNEL


def workspaces() -> list[Any]:
    """The live workspaces of this process (for the peer-timeout check)."""
    return [g.ws for g in _workspaces.values() if g.ws is not None]


def not_needed(cap: Capability) -> str | None:
    if not cap.fusion_capable:
        return cap.reasons[0]
    return sm120_kernel_problem()  # the policy's fact: the package is there and its library loads


def _timeout_ms() -> int:
    """The peer-wait bound: SGLANG_SM120_TIMEOUT_MS (or a deprecated spelling), else the
    server default; a value that is not an integer 1..3600000 (one hour) is refused with a
    warning."""
    from sgl_kernel_sm120.config import env_timeout_ms

    try:
        return env_timeout_ms() or SERVER_TIMEOUT_MS
    except ValueError as exc:
        log_once(logging.WARNING, f"sglang-sm120: {exc}; using {SERVER_TIMEOUT_MS} ms")
        return SERVER_TIMEOUT_MS


def _build_workspace(
    plan: AllReducePlan, use_attn_tp_group: bool, hidden: int, dtype: Any
) -> GroupWorkspace | None:
    """This group's workspace, built collectively on the first call."""
    if use_attn_tp_group in _workspaces:
        return _workspaces[use_attn_tp_group]
    from sglang.srt.distributed.device_communicators.pcie_ipc_ar import _decode_width
    from sglang.srt.layers.flashinfer_comm_fusion import resolve_fusion_group

    world_size, _, coordinator = resolve_fusion_group(use_attn_tp_group=use_attn_tp_group)
    if world_size <= 1:
        return None
    import torch

    sk = kernel()
    rows = _decode_width() or FALLBACK_ROWS
    dtype = dtype or torch.bfloat16
    name = coordinator.unique_name
    try:
        ws = sk.CommWorkspace.create(
            coordinator.cpu_group,
            max_tokens=rows,
            hidden=hidden,
            dtype=dtype,
            device=coordinator.device,  # the device SGLang gave this group (cuda:<gpu>)
            timeout_ms=_timeout_ms(),
        )
        log_once(
            logging.INFO,
            f"sglang-sm120: sm120_pcie workspace for group {name}: "
            f"{world_size} ranks, {rows} rows x {hidden}, programmatic dependent launch "
            f"{'on' if ws.tuning.early_launch else 'off ($SGLANG_SM120_PDL)'}",
        )
    except sk.WorkspaceError as exc:  # raised on every rank alike
        ws = None
        log_once(
            logging.WARNING,
            f"sglang-sm120: sm120_pcie unavailable for group {name}, using the unfused path: {exc}",
        )
    group_key = (coordinator.device_group, coordinator.cpu_group)
    group = GroupWorkspace(ws, world_size, group_key, plan, rows, hidden, dtype)
    _workspaces[use_attn_tp_group] = group
    return group


def ensure_sm120_pcie_workspace(
    original,
    max_token_num=2048,
    hidden_dim=4096,
    use_fp32_lamport=False,
    dtype=None,
    token_num=None,
    use_oneshot=None,
    use_attn_tp_group=True,
):
    plan = worker_plan()
    _trtllm_pcie_ipc_ranges()  # resolved before capture and compile
    if plan is None or plan.fusion_backend != BACKEND:
        return original(
            max_token_num,
            hidden_dim,
            use_fp32_lamport,
            dtype,
            token_num,
            use_oneshot,
            use_attn_tp_group,
        )
    group = _build_workspace(plan, use_attn_tp_group, hidden_dim, dtype)
    return group is not None and group.ws is not None


def fused_by_sm120_pcie(
    original,
    input_tensor,
    residual,
    weight,
    eps=1e-6,
    max_token_num=2048,
    use_oneshot=None,
    trigger_completion_at_end=False,
    fp32_acc=True,
    use_attn_tp_group=True,
):
    group = _workspaces.get(use_attn_tp_group)
    if group is None:
        to_pcie_ipc = _trtllm_pcie_ipc_ranges()
        rows, hidden = input_tensor.shape[0], input_tensor.shape[-1]
        if to_pcie_ipc and _fits_pcie_ipc(rows, hidden) and tokens_in(rows, to_pcie_ipc):
            return None, None  # the table routes this size to PCIe-IPC (policy._servable)
        return original(
            input_tensor,
            residual,
            weight,
            eps,
            max_token_num,
            use_oneshot,
            trigger_completion_at_end,
            fp32_acc,
            use_attn_tp_group,
        )
    if not group.serves(input_tensor, residual, weight):
        return None, None  # upstream then all-reduces and norms separately
    return kernel().fused_allreduce_add_rmsnorm(input_tensor, residual, weight, eps, group.ws)


def plain_fits_sm120_pcie(
    original, input_, *, use_attn_tp_group, expected_world_size, expected_group_key
):
    group = _workspaces.get(use_attn_tp_group)
    if group is None:
        return original(
            input_,
            use_attn_tp_group=use_attn_tp_group,
            expected_world_size=expected_world_size,
            expected_group_key=expected_group_key,
        )
    return (
        group.plan.plain_allreduce == BACKEND  # else the user's PCIe-IPC / NCCL choice
        and group.world_size == expected_world_size
        and group.group_key == expected_group_key
        and input_.dim() == 2
        and group.serves(input_)
    )


def plain_by_sm120_pcie(original, input_, *, use_attn_tp_group):
    group = _workspaces.get(use_attn_tp_group)
    if group is None:
        return original(input_, use_attn_tp_group=use_attn_tp_group)
    return kernel().all_reduce(input_, group.ws)


HOOKS = (
    (f"{PCIE_IPC}.PcieIpcCommunicator.prepare", note_pcie_ipc_workspace, HookType.AFTER),
    (f"{FUSION}.ensure_workspace_initialized", ensure_sm120_pcie_workspace, HookType.AROUND),
    (f"{FUSION}.flashinfer_allreduce_residual_rmsnorm", fused_by_sm120_pcie, HookType.AROUND),
    (f"{FUSION}.can_use_flashinfer_allreduce", plain_fits_sm120_pcie, HookType.AROUND),
    (f"{FUSION}.flashinfer_allreduce", plain_by_sm120_pcie, HookType.AROUND),
)
