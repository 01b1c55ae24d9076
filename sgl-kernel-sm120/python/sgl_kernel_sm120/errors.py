"""Exceptions a caller may want to catch separately."""

from __future__ import annotations

from ._lib import LibraryError

__all__ = ["CommTimeoutError", "InputTooLargeError", "LibraryError", "WorkspaceError"]


class WorkspaceError(RuntimeError):
    """The workspace cannot be built or used (no P2P, IPC failure, closed, rank mismatch)."""


class InputTooLargeError(ValueError):
    """The input is beyond what the workspace or kernel serves: the caller should fall back to
    NCCL (these kernels are for decode/verify sizes, not prefill)."""


class CommTimeoutError(RuntimeError):
    """A peer did not arrive within the timeout. The call's outputs are garbage and the
    workspace stays failed (later calls do nothing): close it and build a new one."""
