"""The two torch ops and their input checks.

Both ops are `torch.library.custom_op`s (namespace `sgl_kernel_sm120`) with fake
implementations, so they trace under torch.compile and record into CUDA graphs. They launch on
`torch.cuda.current_stream()`. The workspace travels as its integer id.
"""

from __future__ import annotations

import torch

from .config import MAX_HIDDEN, MAX_TOKENS, VARIANT_NAMES, VECTOR_BYTES
from .errors import InputTooLargeError
from .workspace import CommWorkspace, get_workspace

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
_VARIANTS = {None: -1, **{name: code for code, name in VARIANT_NAMES.items()}}
_ELEMS_PER_VECTOR = VECTOR_BYTES // 2


def validate_all_reduce(inp: torch.Tensor, *, device: torch.device, max_bytes: int) -> None:
    """Raises with the violated limit; InputTooLargeError means "use NCCL for this one"."""
    if inp.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"all_reduce: dtype {inp.dtype} is not supported (bfloat16 or float16)")
    if inp.device != device:
        raise ValueError(f"all_reduce: input is on {inp.device}, the workspace on {device}")
    if not inp.is_contiguous():
        raise ValueError("all_reduce: input must be contiguous")
    if inp.numel() % _ELEMS_PER_VECTOR:
        raise ValueError(
            f"all_reduce: numel {inp.numel()} must be a multiple of {_ELEMS_PER_VECTOR} "
            f"(the kernels move {VECTOR_BYTES}-byte vectors)"
        )
    nbytes = inp.numel() * inp.element_size()
    if nbytes > max_bytes:
        raise InputTooLargeError(
            f"all_reduce: {nbytes} bytes exceed the workspace's {max_bytes} "
            "(sized for max_tokens x hidden of decode/verify): use NCCL for this message"
        )


def validate_fused(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    *,
    device: torch.device,
    max_bytes: int,
) -> None:
    """Raises with the violated limit; InputTooLargeError means "use the unfused path"."""
    name = "fused_allreduce_add_rmsnorm"
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: dtype {x.dtype} is not supported (bfloat16 or float16)")
    if residual.dtype != x.dtype or weight.dtype != x.dtype:
        raise TypeError(
            f"{name}: x, residual and weight must share one dtype, got "
            f"{x.dtype}, {residual.dtype}, {weight.dtype}"
        )
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be [tokens, hidden], got shape {tuple(x.shape)}")
    tokens, hidden = x.shape
    if residual.shape != x.shape:
        raise ValueError(
            f"{name}: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}"
        )
    if weight.shape != (hidden,):
        raise ValueError(f"{name}: weight shape {tuple(weight.shape)} != ({hidden},)")
    for label, t in (("x", x), ("residual", residual), ("weight", weight)):
        if t.device != device:
            raise ValueError(f"{name}: {label} is on {t.device}, the workspace on {device}")
        if not t.is_contiguous():
            raise ValueError(f"{name}: {label} must be contiguous")
    if hidden % _ELEMS_PER_VECTOR:
        raise ValueError(f"{name}: hidden {hidden} must be a multiple of {_ELEMS_PER_VECTOR}")
    if hidden > MAX_HIDDEN:
        raise InputTooLargeError(f"{name}: hidden {hidden} exceeds the kernel's {MAX_HIDDEN}")
    if tokens > MAX_TOKENS:
        raise InputTooLargeError(f"{name}: {tokens} tokens exceed the kernel's {MAX_TOKENS}")
    nbytes = x.numel() * x.element_size()
    if nbytes > max_bytes:
        raise InputTooLargeError(
            f"{name}: {nbytes} bytes exceed the workspace's {max_bytes} "
            "(sized for max_tokens x hidden of decode/verify): use the unfused path"
        )


# ------------------------------------------------------------------------------ torch ops


@torch.library.custom_op("sgl_kernel_sm120::all_reduce", mutates_args=(), device_types="cuda")
def _all_reduce_op(inp: torch.Tensor, workspace_id: int, variant: int) -> torch.Tensor:
    ws = get_workspace(workspace_id)
    ws.check_error()
    validate_all_reduce(inp, device=ws.device, max_bytes=ws.max_bytes)
    out = torch.empty_like(inp)
    if inp.numel():
        ws.launch(inp=inp, out=out, variant=variant)
    return out


@_all_reduce_op.register_fake
def _(inp: torch.Tensor, workspace_id: int, variant: int) -> torch.Tensor:
    return torch.empty_like(inp)


@torch.library.custom_op(
    "sgl_kernel_sm120::fused_allreduce_add_rmsnorm", mutates_args=(), device_types="cuda"
)
def _fused_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    workspace_id: int,
    variant: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    ws = get_workspace(workspace_id)
    ws.check_error()
    validate_fused(x, residual, weight, device=ws.device, max_bytes=ws.max_bytes)
    norm_out = torch.empty_like(x)
    residual_out = torch.empty_like(residual)
    if x.numel():
        ws.launch(
            inp=x,
            out=norm_out,
            variant=variant,
            residual_in=residual,
            residual_out=residual_out,
            weight=weight,
            eps=eps,
        )
    return norm_out, residual_out


@_fused_op.register_fake
def _(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    workspace_id: int,
    variant: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(residual)


# ------------------------------------------------------------------------------ wrappers


def _variant_code(variant: str | None) -> int:
    try:
        return _VARIANTS[variant]
    except KeyError:
        names = ", ".join(repr(name) for name in VARIANT_NAMES.values())
        raise ValueError(f"variant {variant!r} unknown: None (by size), {names}") from None


def all_reduce(inp: torch.Tensor, ws: CommWorkspace, *, variant: str | None = None) -> torch.Tensor:
    """Sum of `inp` over the workspace's ranks, as a new tensor (input untouched).

    variant None picks by size (one-shot up to ws.tuning.oneshot_max_bytes, the Lamport
    two-shot up to ws.tuning.twoshot_lamport_max_bytes, the two-shot with flags above);
    every rank must pass the same. Raises InputTooLargeError beyond the workspace's max_bytes.
    """
    return torch.ops.sgl_kernel_sm120.all_reduce(inp, ws.id, _variant_code(variant))


def fused_allreduce_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    ws: CommWorkspace,
    *,
    variant: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-reduce + residual add + RMSNorm in one kernel; returns (norm_out, residual_out).

    Contract (the same as SGLang 0.5.23's `flashinfer_allreduce_residual_rmsnorm`, which
    RMSNorm.forward_with_allreduce_fusion calls after attention and after the MoE):
        reduced      = sum over ranks of x                       (fp32 accumulation)
        residual_out = (reduced + residual)  rounded to x.dtype  (new tensor)
        norm_out     = (reduced + residual) * rsqrt(mean((reduced + residual)^2) + eps)
                       * weight, rounded to x.dtype              (new tensor)
    The variance uses the fp32 sum before rounding, as SGLang's RMSNorm does (two-shot rounds
    `reduced` to x.dtype once, when it is gathered, like an all-reduce followed by a separate
    add + RMSNorm). x, residual and
    weight are not modified. x and residual are [tokens, hidden] (tokens <= 2048, hidden a
    multiple of 8 and <= 16384), weight is [hidden], all of x's dtype (bf16 or fp16). For
    Gemma-style norms pass 1 + weight, as SGLang does.
    """
    return torch.ops.sgl_kernel_sm120.fused_allreduce_add_rmsnorm(
        x, residual, weight, float(eps), ws.id, _variant_code(variant)
    )
