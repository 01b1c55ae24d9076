"""Patch: the ``sm120_pcie`` fusion backend, served by sgl-kernel-sm120.

Why: the fused all-reduce + residual + RMSNorm SGLang has (FlashInfer trtllm, a Lamport
    all-to-all) collapses over PCIe at TP4/TP8, and the staged PCIe all-reduce it has
    (PCIe-IPC) does not fuse the norm. sgl-kernel-sm120 does both in one kernel per point.
How: when the resolved ``flashinfer_allreduce_fusion_backend`` is ``sm120_pcie`` (set by the
    plan: ``SGLANG_SM120_FUSION_BACKEND=sm120_pcie`` or a tuning table where it wins), AROUND
    hooks on upstream's FlashInfer fusion functions route to sgl-kernel-sm120:
    ``ensure_workspace_initialized`` builds one workspace per TP group before graph capture,
    sized like upstream's PCIe-IPC (max_bs x draft tokens x hidden); the fused point
    (``flashinfer_allreduce_residual_rmsnorm``) and plain all-reduces of tagged groups
    (``can_use_flashinfer_allreduce`` / ``flashinfer_allreduce``) run our kernels for inputs
    the workspace holds (and, with a tuning table, at the token counts where it won); other
    inputs get upstream's unfused path. After each decode/verify graph replay the workspace's
    error flag is read (host memory, no sync): a peer that never arrived raises there instead
    of leaving silently wrong hidden states. Every decision is a pure function of shapes and
    the shared plan, so all ranks take the same path. Other backends run upstream's code.
Upstream: none; a new backend of this distribution.
Removal: when upstream ships a fused all-reduce + RMSNorm staged for PCIe on SM12x.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from sglang_sm120.contract import Symbol
from sglang_sm120.policy import Capability
from sglang_sm120.runtime import log_once, plan_for_runtime

FUSION = "sglang.srt.layers.flashinfer_comm_fusion"
RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
BACKEND = "sm120_pcie"
FALLBACK_ROWS = 256  # when the runner's decode width is unknown (no CUDA-graph config)
# A server rank can trail its peers by a JIT build during warmup, far beyond the kernel
# package's 5 s default; still a bound, and SGL_KERNEL_SM120_TIMEOUT_MS overrides it.
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
    Symbol(f"{FUSION}.flashinfer_allreduce_residual_rmsnorm", "function"),
    Symbol(
        f"{FUSION}.can_use_flashinfer_allreduce",
        "function",
        params=("input_", "use_attn_tp_group", "expected_world_size", "expected_group_key"),
    ),
    Symbol(f"{FUSION}.flashinfer_allreduce", "function", params=("input_", "use_attn_tp_group")),
    Symbol(f"{FUSION}.resolve_fusion_group", "function", params=("use_attn_tp_group",)),
    Symbol(f"{RUNNER}.execute", "function", params=("self", "forward_batch", "pp_proxy_tensors")),
    Symbol(
        "sglang.srt.distributed.device_communicators.pcie_ipc_ar._decode_width",
        "function",
        params=(),
    ),
)

#: coordinator unique name -> CommWorkspace (or None after a failed build, for every rank)
_workspaces: dict[str, Any] = {}


def not_needed(cap: Capability) -> str | None:
    if not cap.fusion_capable:
        return cap.reasons[0]
    from importlib.util import find_spec

    return None if find_spec("sgl_kernel_sm120") else "sgl-kernel-sm120 is not installed"


def _active() -> bool:
    from sglang.srt.runtime_context import get_exec

    return get_exec().comm.flashinfer_allreduce_fusion_backend == BACKEND


def _workspace(use_attn_tp_group: bool, hidden: int | None = None, dtype: Any = None):
    """This group's workspace; built (collectively) on the first call, which upstream makes
    from ``pre_initialize_workspaces`` before graph capture."""
    from sglang.srt.layers.flashinfer_comm_fusion import resolve_fusion_group

    world_size, _, coordinator = resolve_fusion_group(use_attn_tp_group=use_attn_tp_group)
    if world_size <= 1:
        return None
    key = coordinator.unique_name
    if key in _workspaces or hidden is None:
        return _workspaces.get(key)
    import sgl_kernel_sm120 as sk
    import torch
    from sgl_kernel_sm120.config import ENV_TIMEOUT_MS
    from sglang.srt.distributed.device_communicators.pcie_ipc_ar import _decode_width

    rows = _decode_width() or FALLBACK_ROWS
    timeout_ms = int(os.environ.get(ENV_TIMEOUT_MS) or SERVER_TIMEOUT_MS)
    try:
        _workspaces[key] = sk.CommWorkspace.create(
            coordinator.cpu_group,
            max_tokens=rows,
            hidden=hidden,
            dtype=dtype or torch.bfloat16,
            device=torch.cuda.current_device(),
            timeout_ms=timeout_ms,
        )
        log_once(
            logging.INFO,
            f"sglang-sm120: sm120_pcie workspace for group {key}: "
            f"{world_size} ranks, {rows} rows x {hidden}",
        )
    except sk.WorkspaceError as exc:  # raised on every rank alike
        _workspaces[key] = None
        log_once(
            logging.WARNING,
            f"sglang-sm120: sm120_pcie unavailable for group {key}, using the unfused path: {exc}",
        )
    return _workspaces[key]


def _accepts(ws: Any, x: Any, residual: Any = None, weight: Any = None) -> bool:
    import sgl_kernel_sm120 as sk

    try:
        if residual is None:
            sk.validate_all_reduce(x, device=ws.device, max_bytes=ws.max_bytes)
        else:
            sk.validate_fused(x, residual, weight, device=ws.device, max_bytes=ws.max_bytes)
    except (TypeError, ValueError):  # InputTooLargeError is a ValueError too
        return False
    plan = plan_for_runtime(hidden=x.shape[-1], dtype=str(x.dtype).removeprefix("torch."))
    return x.is_contiguous() and plan.uses_sm120_pcie_at(x.shape[0])


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
    if not _active():
        return original(
            max_token_num,
            hidden_dim,
            use_fp32_lamport,
            dtype,
            token_num,
            use_oneshot,
            use_attn_tp_group,
        )
    return _workspace(use_attn_tp_group, hidden_dim, dtype) is not None


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
    if not _active():
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
    ws = _workspace(use_attn_tp_group)
    if ws is None or not _accepts(ws, input_tensor, residual, weight):
        return None, None  # upstream then all-reduces and norms separately
    import sgl_kernel_sm120 as sk

    return sk.fused_allreduce_add_rmsnorm(input_tensor, residual, weight, eps, ws)


def plain_fits_sm120_pcie(
    original, input_, *, use_attn_tp_group, expected_world_size, expected_group_key
):
    if not _active():
        return original(
            input_,
            use_attn_tp_group=use_attn_tp_group,
            expected_world_size=expected_world_size,
            expected_group_key=expected_group_key,
        )
    ws = _workspace(use_attn_tp_group)
    return (
        ws is not None
        and ws.world_size == expected_world_size
        and input_.dim() == 2
        and _accepts(ws, input_)
    )


def plain_by_sm120_pcie(original, input_, *, use_attn_tp_group):
    if not _active():
        return original(input_, use_attn_tp_group=use_attn_tp_group)
    import sgl_kernel_sm120 as sk

    return sk.all_reduce(input_, _workspace(use_attn_tp_group))


def check_peers_after_replay(original, self, forward_batch, pp_proxy_tensors=None):
    output = original(self, forward_batch, pp_proxy_tensors)
    for ws in _workspaces.values():
        if ws is not None:
            ws.check_error()
    return output


HOOKS = (
    (f"{FUSION}.ensure_workspace_initialized", ensure_sm120_pcie_workspace, HookType.AROUND),
    (f"{FUSION}.flashinfer_allreduce_residual_rmsnorm", fused_by_sm120_pcie, HookType.AROUND),
    (f"{FUSION}.can_use_flashinfer_allreduce", plain_fits_sm120_pcie, HookType.AROUND),
    (f"{FUSION}.flashinfer_allreduce", plain_by_sm120_pcie, HookType.AROUND),
    (f"{RUNNER}.execute", check_peers_after_replay, HookType.AROUND),
)
