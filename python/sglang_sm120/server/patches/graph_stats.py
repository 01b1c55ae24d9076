"""Patch (instrumentation, opt-in): count CUDA-graph captures/replays and fused all-reduces.

Why: the EAGLE-3 regression suite must prove that TARGET_VERIFY ran through graph replay and
    that the fused all-reduce + residual + RMSNorm was captured inside the verify graph;
    upstream exposes neither count.
How: only when ``SGLANG_SM120_STATS_DIR`` is set to a printable name (one with control
    characters or bytes that are not UTF-8 is refused: it would be created as is). AROUND hooks on
    ``DecodeCudaGraphRunner.capture_one_shape`` (captures per forward mode),
    ``DecodeCudaGraphRunner.execute`` (replays per forward mode) and
    ``flashinfer_allreduce_residual_rmsnorm`` (fused calls that returned a result while a
    capture was running), plus a peer timeout noted by ``peer_check``. Each process writes
    ``<dir>/sm120-stats-<pid>.json`` at most once a second while counts change, and at exit;
    the directory is created with the first file, so a process that counts nothing (doctor's
    TP-worker rehearsal) creates nothing.
Upstream: none; test instrumentation.
Removal: when upstream reports graph replays per forward mode and fusion use in its metrics.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from collections import Counter
from pathlib import Path

from sglang.srt.plugins.hook_registry import HookType

from sglang_sm120.env_values import shown
from sglang_sm120.planning.policy import Capability
from sglang_sm120.server.contract import Symbol

STATS_ENV = "SGLANG_SM120_STATS_DIR"
RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
FUSED = "sglang.srt.layers.flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm"
CONTRACT = (
    Symbol(
        f"{RUNNER}.capture_one_shape",
        "function",
        params=("self", "size", "forward", "stream_idx", "variant_label", "attention_variant"),
    ),
    Symbol(f"{RUNNER}.execute", "function", params=("self", "forward_batch", "pp_proxy_tensors")),
    Symbol(FUSED, "function"),
)
ROLES = ("scheduler",)


class GraphStats:
    """Counters of one process, flushed to a JSON file."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"sm120-stats-{os.getpid()}.json"
        self.captures: Counter[str] = Counter()
        self.replays: Counter[str] = Counter()
        self.fused_in_capture: Counter[str] = Counter()
        self.capturing_mode: str | None = None
        self.peer_error: str | None = None
        self._dirty = False
        self._last_write = 0.0

    def bump(self, counter: Counter[str], mode: str) -> None:
        counter[mode] += 1
        self._dirty = True
        if time.monotonic() - self._last_write >= 1.0:
            self.flush()

    def flush(self) -> None:
        if not self._dirty:
            return
        from sglang_sm120.server.runtime import PATCH_STATUS, last_plan

        plan = last_plan()
        data = {
            "pid": os.getpid(),
            "tp_rank": _tp_rank(),
            "fusion_backend": _fusion_backend(),
            "plain_allreduce": plan.plain_allreduce if plan else None,
            "graph_captures": dict(self.captures),
            "graph_replays": dict(self.replays),
            "fused_allreduce_in_capture": dict(self.fused_in_capture),
            "peer_error": self.peer_error,
            "patches": dict(PATCH_STATUS),
        }
        tmp = self.path.with_suffix(".tmp")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        tmp.replace(self.path)
        self._dirty = False
        self._last_write = time.monotonic()


def _tp_rank() -> int | None:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_rank)
    except Exception:
        return None


def _fusion_backend() -> str | None:
    try:
        from sglang.srt.runtime_context import get_exec

        return get_exec().comm.flashinfer_allreduce_fusion_backend
    except Exception:
        return None


_stats: GraphStats | None = None


def not_needed(cap: Capability) -> str | None:
    from sglang_sm120.server.env_report import stats_dir_problem

    raw = os.environ.get(STATS_ENV, "")
    if not raw.strip():
        return f"{STATS_ENV} unset"
    problem = stats_dir_problem(raw)
    return f"{STATS_ENV}={shown(raw)} refused: {problem}" if problem else None


def count_captures(
    original, self, size, forward, stream_idx=None, variant_label=None, attention_variant=None
):
    mode = self.capture_forward_mode.name
    _stats.capturing_mode = mode
    try:
        return original(self, size, forward, stream_idx, variant_label, attention_variant)
    finally:
        _stats.capturing_mode = None
        _stats.bump(_stats.captures, mode)


def count_replays(original, self, forward_batch, pp_proxy_tensors=None):
    output = original(self, forward_batch, pp_proxy_tensors)
    _stats.bump(_stats.replays, forward_batch.forward_mode.name)
    return output


def count_fused_in_capture(original, *args, **kwargs):
    result = original(*args, **kwargs)
    if _stats.capturing_mode is not None and result[0] is not None:
        _stats.bump(_stats.fused_in_capture, _stats.capturing_mode)
    return result


def note_peer_error(message: str) -> None:
    """Record a peer timeout (from ``peer_check``) and write the file now: the process stops."""
    if _stats is not None:
        _stats.peer_error = message
        _stats._dirty = True
        _stats.flush()


def apply_setting() -> None:
    global _stats
    _stats = GraphStats(Path(os.environ[STATS_ENV]))
    atexit.register(_stats.flush)


HOOKS = (
    (f"{RUNNER}.capture_one_shape", count_captures, HookType.AROUND),
    (f"{RUNNER}.execute", count_replays, HookType.AROUND),
    (FUSED, count_fused_in_capture, HookType.AROUND),
)
