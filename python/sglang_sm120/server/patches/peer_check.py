"""Patch: a peer that timed out in sgl-kernel-sm120 stops the server before that step's output
leaves it.

Why: sgl-kernel-sm120 bounds every wait on a peer; on expiry the kernel records the failure in
    host-mapped memory and returns, leaving that call's outputs invalid. Graph replay is
    asynchronous, so reading the flag right after a replay is launched only sees older calls: a
    timeout in step N would surface after step N's tokens were sampled and streamed. EAGLE draft
    runners replay graphs of their own, so a check per runner would also miss those.
How: BEFORE hook on ``SchedulerOutputStreamer.stream_output``, the one place a scheduler hands
    results on to the detokenizer. Every caller runs it after the step's results were
    synchronised to the host (``copy_done.synchronize()`` / the verify step's host read of
    accept lengths), so all GPU work of that step, target and draft, has finished and the flag
    is current. Each live sm120_pcie workspace is checked (a read of host memory, no device
    sync); a recorded timeout raises ``CommTimeoutError`` there, which stops the scheduler, and
    is noted in the ``graph_stats`` file when that is on. Without our workspaces it does nothing.
    Each rank checks its own calls: a rank's outputs depend only on its own reductions, and a
    rank that timed out stops pushing, so every peer times out in its next call and stops too.
    Not covered: PD disaggregation (a prefill server sends KV, not streamed outputs; the plan
    refuses ``sm120_pcie`` there) and Ray actors (they load no plugins; the plan refuses it).
Upstream: none; the backend is this distribution's.
Removal: with the ``sm120_pcie`` backend.
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookType

from sglang_sm120.planning.policy import Capability
from sglang_sm120.server.contract import Symbol
from sglang_sm120.server.patches import sm120_pcie_backend

TARGET = (
    "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.stream_output"
)
CONTRACT = (Symbol(TARGET, "function", params=("self", "reqs", "return_logprob", "skip_req")),)
ROLES = ("scheduler",)


def not_needed(cap: Capability) -> str | None:
    return sm120_pcie_backend.not_needed(cap)


def check_peers_before_streaming(*args, **kwargs) -> None:
    for ws in sm120_pcie_backend.workspaces():
        message = ws.error()
        if message is not None:
            from sglang_sm120.server.patches import graph_stats

            graph_stats.note_peer_error(message)
            ws.check_error()


HOOKS = ((TARGET, check_peers_before_streaming, HookType.BEFORE),)
