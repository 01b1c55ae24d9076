"""Patch hooks that the plugin scenarios cannot exercise on CPU, run against the real upstream
functions they wrap (the CUDA driver and the clock are what is faked, not sglang)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

MIB2 = 2 << 20


def fake_cuda_driver(multicast_works: bool):
    """The few CUDA driver bindings the trtllm sizing calls: 2 MiB allocation granularity, and a
    multicast query that fails as it does on a PCIe host without multicast."""
    success, unsupported = "CUDA_SUCCESS", "CUDA_ERROR_NOT_SUPPORTED"
    return SimpleNamespace(
        CUresult=SimpleNamespace(CUDA_SUCCESS=success),
        CUmemAllocationGranularity_flags=SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_RECOMMENDED=0),
        CUmulticastGranularity_flags=SimpleNamespace(CU_MULTICAST_GRANULARITY_RECOMMENDED=0),
        CUmulticastObjectProp=SimpleNamespace,
        cuMemGetAllocationGranularity=lambda prop, flags: (success, MIB2),
        cuMulticastGetGranularity=lambda prop, flags: (
            (success, 64 * MIB2) if multicast_works else (unsupported, 0)
        ),
    )


def test_preflight_sizing_without_multicast_uses_unicast_sizes():
    from sglang.srt.layers.flashinfer_comm_fusion import (
        _flashinfer_trtllm_workspace_allocation_sizes as upstream_sizes,
    )
    from sglang_sm120.patches.workspace_preflight import UnicastDriver

    prop = SimpleNamespace(requestedHandleTypes=1)
    args = (prop, 8, 2048, 7168, torch.bfloat16)
    with pytest.raises(RuntimeError, match="cuMulticastGetGranularity failed"):
        upstream_sizes(fake_cuda_driver(multicast_works=False), *args)
    sizes = upstream_sizes(UnicastDriver(fake_cuda_driver(multicast_works=False)), *args)
    rounded = upstream_sizes(fake_cuda_driver(multicast_works=True), *args)
    assert len(sizes) == 3 and all(s % MIB2 == 0 for s in sizes)
    assert all(s <= r for s, r in zip(sizes, rounded, strict=True))


def test_graph_stats_file_reports_counts_per_mode(tmp_path):
    from sglang_sm120.patches.graph_stats import GraphStats

    stats = GraphStats(tmp_path)
    stats.bump(stats.captures, "TARGET_VERIFY")
    stats.bump(stats.replays, "TARGET_VERIFY")
    stats.bump(stats.replays, "TARGET_VERIFY")
    stats.bump(stats.fused_in_capture, "TARGET_VERIFY")
    stats.flush()
    data = json.loads(next(tmp_path.glob("sm120-stats-*.json")).read_text())
    assert data["graph_captures"] == {"TARGET_VERIFY": 1}
    assert data["graph_replays"] == {"TARGET_VERIFY": 2}
    assert data["fused_allreduce_in_capture"] == {"TARGET_VERIFY": 1}
