"""sgl_kernel_sm120: PCIe all-reduce and fused all-reduce + residual add + RMSNorm.

For tensor-parallel decode/verify on GPUs joined by PCIe only (8x RTX PRO 6000, SM120): a push
all-reduce (one-shot for the smallest messages, two-shot above) whose RMSNorm epilogue runs in
the same kernel, so each all-reduce + add + norm point of a layer is one launch inside the
CUDA graph. Larger (prefill) messages belong to NCCL: the workspace refuses them.

    import sgl_kernel_sm120 as sk

    ws = sk.CommWorkspace.create(tp_cpu_group, max_tokens=bs * draft_tokens, hidden=7168)
    out = sk.all_reduce(x, ws)                                    # new tensor
    norm_out, residual_out = sk.fused_allreduce_add_rmsnorm(x, residual, weight, eps, ws)
    ws.check_error()            # raises CommTimeoutError if a peer never arrived (no sync)
    ws.close()                  # collective

    # All ranks in one process on one GPU (tests, benchmarks): one workspace per rank,
    # each rank's calls on its own stream.
    wss = sk.CommWorkspace.create_local(4, max_tokens=256, hidden=7168)

Ops (registered by ``import sgl_kernel_sm120.ops``, or by the first use of ``all_reduce`` ...
through the package: the package import itself stays free of torch):
torch.ops.sgl_kernel_sm120.all_reduce(inp, workspace_id, variant) and
torch.ops.sgl_kernel_sm120.fused_allreduce_add_rmsnorm(x, residual, weight, eps, workspace_id,
variant) (variant -1 = by size, 0 one-shot, 1 two-shot). Sizing: `workspace_bytes`. Settings:
SGLANG_SM120_ONESHOT_MAX_BYTES, _BLOCK_BYTES, _MAX_BLOCKS, _TIMEOUT_MS (see README.md; the old
SGL_KERNEL_SM120_* names still work, with a warning: `env.py`).
"""

from .config import (
    MAX_HIDDEN,
    MAX_TOKENS,
    MAX_WORLD_SIZE,
    MIN_WORLD_SIZE,
    Tuning,
    WorkspaceLayout,
    choose_blocks,
    choose_variant,
    default_oneshot_max_bytes,
    resolve_tuning,
    split_fused,
    workspace_bytes,
    workspace_layout,
)
from .errors import CommTimeoutError, InputTooLargeError, LibraryError, WorkspaceError

# The ops and the workspace import torch (seconds); they load on first use, so that a process
# asking only whether the library loads (``_lib``, ``config``: the plugin's planning) stays light.
_LAZY = {
    "all_reduce": "ops",
    "fused_allreduce_add_rmsnorm": "ops",
    "validate_all_reduce": "ops",
    "validate_fused": "ops",
    "CommWorkspace": "workspace",
    "get_workspace": "workspace",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__version__ = "0.5.23.1"

__all__ = [
    "MAX_HIDDEN",
    "MAX_TOKENS",
    "MAX_WORLD_SIZE",
    "MIN_WORLD_SIZE",
    "CommTimeoutError",
    "CommWorkspace",
    "InputTooLargeError",
    "LibraryError",
    "Tuning",
    "WorkspaceError",
    "WorkspaceLayout",
    "all_reduce",
    "choose_blocks",
    "choose_variant",
    "default_oneshot_max_bytes",
    "fused_allreduce_add_rmsnorm",
    "get_workspace",
    "resolve_tuning",
    "split_fused",
    "validate_all_reduce",
    "validate_fused",
    "workspace_bytes",
    "workspace_layout",
]
