"""The patch ledger: one module per upstream seam, each headed by Why / How / Upstream / Removal.

| module               | upstream seam                                | effect on SM12x            |
|----------------------|----------------------------------------------|----------------------------|
| status_line          | utils.common.configure_logger                | one status line / process  |
| fusion_auto_enable   | arg_groups/overrides auto-enable pass        | plan's fusion backend      |
| engine_launch_plan   | Engine._launch_scheduler_processes           | Engine's own plan, spawned |
| dp_controller_launch_plan | DataParallelController.__init__         | DP controller's own plan   |
| resolve_backend      | flashinfer_comm_fusion._resolve_backend      | trtllm resolves, no crash  |
| fusion_applies       | add_norm._is_sm90_supported (per-call gate)  | fused points run           |
| workspace_preflight  | trtllm workspace sizing (multicast query)    | preflight passes on PCIe   |
| pcie_ipc_enable      | pcie_ipc_ar.eligible_group                   | PCIe-IPC on by default     |
| allreduce_precedence | parallel_state.set_flashinfer_allreduce_only | plain AR -> PCIe-IPC first |
| upstream_switches    | parallel_state.set_mscclpp (+ torch symm mem) | table's AR switches on |
| nccl_tuned_env       | bootstrap.init_distributed_environment       | tuned NCCL variant set     |
| sm120_pcie_backend   | FlashInfer fusion entry points               | fused points -> our kernel |
| peer_check           | SchedulerOutputStreamer.stream_output        | no output after a timeout  |
| graph_stats          | decode graph runner capture/replay (opt-in)  | counts for the e2e suite   |

A patch module provides ``ROLES`` (the processes it is registered in: ``launcher``,
``engine``, ``dp_controller``, ``scheduler``), ``CONTRACT`` (the upstream symbols it touches),
``HOOKS`` (hook-registry rows),
``not_needed(capability)`` and optionally ``COPIES`` (``from X import`` copies SGLang calls,
which must be the patched object), ``apply_setting()`` / ``is_applied()`` (a plain setting
instead of a hook, and the check of its effect), and ``pending()`` (a hook that records its own
status when its target runs: what the status waits for until then).
"""

from sglang_sm120.server.patches import (
    allreduce_precedence,
    dp_controller_launch_plan,
    engine_launch_plan,
    fusion_applies,
    fusion_auto_enable,
    graph_stats,
    nccl_tuned_env,
    pcie_ipc_enable,
    peer_check,
    resolve_backend,
    sm120_pcie_backend,
    status_line,
    upstream_switches,
    workspace_preflight,
)

PATCHES = (
    status_line,
    fusion_auto_enable,
    engine_launch_plan,
    dp_controller_launch_plan,
    resolve_backend,
    fusion_applies,
    workspace_preflight,
    pcie_ipc_enable,
    allreduce_precedence,
    upstream_switches,
    nccl_tuned_env,
    sm120_pcie_backend,
    peer_check,
    graph_stats,
)


def patch_name(module) -> str:
    return module.__name__.rsplit(".", 1)[-1]
