"""Patch hooks that the plugin scenarios cannot exercise on CPU, run against the real upstream
functions they wrap (the CUDA driver and the clock are what is faked, not sglang)."""

from __future__ import annotations

import json
import os
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
    from sglang_sm120.server.patches.workspace_preflight import UnicastDriver

    prop = SimpleNamespace(requestedHandleTypes=1)
    args = (prop, 8, 2048, 7168, torch.bfloat16)
    with pytest.raises(RuntimeError, match="cuMulticastGetGranularity failed"):
        upstream_sizes(fake_cuda_driver(multicast_works=False), *args)
    sizes = upstream_sizes(UnicastDriver(fake_cuda_driver(multicast_works=False)), *args)
    rounded = upstream_sizes(fake_cuda_driver(multicast_works=True), *args)
    assert len(sizes) == 3 and all(s % MIB2 == 0 for s in sizes)
    assert all(s <= r for s, r in zip(sizes, rounded, strict=True))


def test_graph_stats_file_reports_counts_per_mode(tmp_path):
    from sglang_sm120.server.patches.graph_stats import GraphStats

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


@pytest.fixture
def pcie_worker(monkeypatch):
    """A worker whose facts are the 8x SM120 PCIe profile and which got no launcher plan."""
    from sglang_sm120.machine import facts
    from sglang_sm120.server import runtime

    monkeypatch.setenv("SGLANG_SM120_TOPOLOGY", "rtx-pro-6000-x8-pcie")
    monkeypatch.delenv(runtime.LAUNCH_PLAN_ENV, raising=False)
    caches = (facts.current_facts, runtime.sm12x_capability, runtime._launch_plan)
    for cached in caches:
        cached.cache_clear()
    yield
    for cached in caches:
        cached.cache_clear()


def test_preflight_hook_sizes_with_the_unicast_driver(pcie_worker):
    """The hook itself must hand upstream's sizing the multicast-free driver on SM12x."""
    from sglang.srt.layers.flashinfer_comm_fusion import (
        _flashinfer_trtllm_workspace_allocation_sizes as upstream_sizes,
    )
    from sglang_sm120.server.patches.workspace_preflight import size_without_multicast

    prop = SimpleNamespace(requestedHandleTypes=1)
    driver = fake_cuda_driver(multicast_works=False)
    sizes = size_without_multicast(upstream_sizes, driver, prop, 8, 2048, 7168, torch.bfloat16)
    rounded = upstream_sizes(fake_cuda_driver(multicast_works=True), *args_of(prop))
    assert len(sizes) == 3 and all(s % MIB2 == 0 for s in sizes)
    assert all(s <= r for s, r in zip(sizes, rounded, strict=True))


def args_of(prop) -> tuple:
    return (prop, 8, 2048, 7168, torch.bfloat16)


def test_preflight_hook_leaves_other_hosts_to_upstream(monkeypatch):
    from sglang.srt.layers.flashinfer_comm_fusion import (
        _flashinfer_trtllm_workspace_allocation_sizes as upstream_sizes,
    )
    from sglang_sm120.machine import facts
    from sglang_sm120.server import runtime
    from sglang_sm120.server.patches.workspace_preflight import size_without_multicast

    monkeypatch.setenv("SGLANG_SM120_TOPOLOGY", "h200-x8-nvlink")
    monkeypatch.delenv(runtime.LAUNCH_PLAN_ENV, raising=False)
    for cached in (facts.current_facts, runtime.sm12x_capability, runtime._launch_plan):
        cached.cache_clear()
    prop = SimpleNamespace(requestedHandleTypes=1)
    with pytest.raises(RuntimeError, match="cuMulticastGetGranularity failed"):
        size_without_multicast(
            upstream_sizes, fake_cuda_driver(False), prop, 8, 2048, 7168, torch.bfloat16
        )
    for cached in (facts.current_facts, runtime.sm12x_capability, runtime._launch_plan):
        cached.cache_clear()


@pytest.fixture
def stats(tmp_path, monkeypatch):
    from sglang_sm120.server.patches import graph_stats

    recorder = graph_stats.GraphStats(tmp_path)
    monkeypatch.setattr(graph_stats, "_stats", recorder)
    return recorder


def test_fused_calls_that_fell_back_are_not_counted(stats):
    from sglang_sm120.server.patches.graph_stats import count_fused_in_capture

    stats.capturing_mode = "TARGET_VERIFY"
    fused = torch.zeros(4, 8), torch.zeros(4, 8)
    count_fused_in_capture(lambda *a, **k: (None, None))  # upstream's unfused fallback
    count_fused_in_capture(lambda *a, **k: fused)
    stats.capturing_mode = None
    count_fused_in_capture(lambda *a, **k: fused)  # eager, outside any capture
    assert stats.fused_in_capture == {"TARGET_VERIFY": 1}


def test_peer_error_is_written_to_the_stats_file_at_once(stats, tmp_path):
    from sglang_sm120.server.patches.graph_stats import note_peer_error

    note_peer_error("rank 1/2: timed out after 60000 ms waiting for rank 0")
    data = json.loads(next(tmp_path.glob("sm120-stats-*.json")).read_text())
    assert data["peer_error"].startswith("rank 1/2: timed out")


def sm120_group(routes=(), plain="sm120_pcie", rows=16, hidden=64):
    from sglang_sm120.planning.policy import AllReducePlan
    from sglang_sm120.server.patches.sm120_pcie_backend import GroupWorkspace

    plan = AllReducePlan(True, "sm120_pcie", plain, ("test plan",), routes)
    ws = SimpleNamespace(device=torch.device("cpu"), max_bytes=rows * hidden * 2)
    return GroupWorkspace(ws, 2, ("device_group", "cpu_group"), plan, rows, hidden, torch.bfloat16)


@pytest.mark.parametrize("routes", [(), ((4, "sm120_pcie"), (64, "nccl"))])
def test_sm120_pcie_decision_traces_under_torch_compile(routes):
    """GroupCoordinator.all_reduce and RMSNorm call the hooks while Dynamo traces: the decision
    must be plain comparisons (fullgraph, no graph break), with the same answers as eager."""
    group = sm120_group(routes)
    compiled = torch.compile(
        lambda x: x * 3 if group.serves(x) else x + 1, fullgraph=True, backend="eager"
    )
    small, too_many = (
        torch.ones(4, 64, dtype=torch.bfloat16),
        torch.ones(32, 64, dtype=torch.bfloat16),
    )
    assert compiled(small)[0, 0].item() == 3.0
    assert compiled(too_many)[0, 0].item() == 2.0
    assert group.serves(small) and not group.serves(too_many)


def test_fused_point_declined_where_the_table_routes_our_all_reduce_plus_norm(monkeypatch):
    """Where the tuning table found sgl-kernel-sm120's all-reduce + a separate norm faster than
    its fused kernel, the fused hook hands the point back to upstream (which then all-reduces
    and norms separately) and the plain hook takes that all-reduce onto our kernel."""
    from sglang_sm120.server.patches import sm120_pcie_backend

    group = sm120_group(routes=((4, "sm120_pcie"), (16, "sm120_pcie_unfused")))
    monkeypatch.setattr(sm120_pcie_backend, "_workspaces", {True: group})
    weight = torch.ones(64, dtype=torch.bfloat16)
    small, large = (torch.ones(n, 64, dtype=torch.bfloat16) for n in (4, 12))
    launched = []
    monkeypatch.setattr(
        sm120_pcie_backend,
        "KERNEL",
        SimpleNamespace(
            fused_allreduce_add_rmsnorm=lambda x, *a: launched.append(x.shape[0]) or (x, x),
            validate_all_reduce=lambda *a, **k: None,
            validate_fused=lambda *a, **k: None,
        ),
    )
    results = [
        sm120_pcie_backend.fused_by_sm120_pcie(None, x, x.clone(), weight, 1e-6)
        for x in (small, large)
    ]
    assert launched == [4]
    assert results[1] == (None, None)  # 12 tokens: upstream all-reduces and norms separately
    key = ("device_group", "cpu_group")
    fits = [
        sm120_pcie_backend.plain_fits_sm120_pcie(
            None, x, use_attn_tp_group=True, expected_world_size=2, expected_group_key=key
        )
        for x in (small, large)
    ]
    assert fits == [True, True]


def test_plain_allreduce_stays_off_our_kernel_when_the_plan_says_nccl(monkeypatch):
    """sm120_pcie fuses, but the user set SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=0: plain all-reduces
    of the tagged group must not enter sgl-kernel-sm120."""
    from sglang_sm120.server.patches import sm120_pcie_backend

    key = ("device_group", "cpu_group")
    x = torch.ones(4, 64, dtype=torch.bfloat16)
    for plain, expected in (("nccl", False), ("pcie_ipc", False), ("sm120_pcie", True)):
        monkeypatch.setattr(sm120_pcie_backend, "_workspaces", {True: sm120_group(plain=plain)})
        fits = sm120_pcie_backend.plain_fits_sm120_pcie(
            None, x, use_attn_tp_group=True, expected_world_size=2, expected_group_key=key
        )
        assert fits is expected, plain


def test_bad_timeout_value_falls_back_with_a_warning(monkeypatch, caplog):
    from sglang_sm120.server.patches import sm120_pcie_backend

    monkeypatch.setenv("SGLANG_SM120_TIMEOUT_MS", "abc")
    with caplog.at_level("WARNING", logger="sglang_sm120"):
        assert sm120_pcie_backend._timeout_ms() == sm120_pcie_backend.SERVER_TIMEOUT_MS
    assert "SGLANG_SM120_TIMEOUT_MS='abc' is not an integer" in caplog.text
    monkeypatch.setenv("SGLANG_SM120_TIMEOUT_MS", "2000")
    assert sm120_pcie_backend._timeout_ms() == 2000


def test_a_timeout_past_one_hour_keeps_the_server_default_with_a_warning(monkeypatch, caplog):
    """18446744073710 ms would wrap the kernels' 64-bit nanosecond bound to 0.45 ms."""
    from sglang_sm120.server.patches import sm120_pcie_backend

    monkeypatch.setenv("SGLANG_SM120_TIMEOUT_MS", "18446744073710")
    with caplog.at_level("WARNING", logger="sglang_sm120"):
        assert sm120_pcie_backend._timeout_ms() == sm120_pcie_backend.SERVER_TIMEOUT_MS
    assert "SGLANG_SM120_TIMEOUT_MS='18446744073710' is above the bound 3600000" in caplog.text


def publish_plan(monkeypatch, plan, tp: int) -> None:
    """This worker received ``plan`` from its launcher (as runtime.plan_for_view publishes)."""
    from sglang_sm120.planning.policy import Capability
    from sglang_sm120.server import runtime

    capability = Capability(True, True, True, ("test host",))
    launched = {
        "tp_size": tp,
        "gpu_ids": list(range(tp)),
        "capability": capability.to_json(),
        "plan": plan.to_json(),
    }
    monkeypatch.setenv(runtime.LAUNCH_PLAN_ENV, json.dumps(launched))
    runtime._launch_plan.cache_clear()
    monkeypatch.delenv("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", raising=False)


@pytest.fixture
def fresh_launch_plan(monkeypatch):
    from sglang_sm120.server import runtime
    from sglang_sm120.server.patches import sm120_pcie_backend

    runtime._launch_plan.cache_clear()
    monkeypatch.setattr(sm120_pcie_backend, "_trtllm_to_pcie_ipc", sm120_pcie_backend._UNRESOLVED)
    if hasattr(sm120_pcie_backend, "_pcie_ipc_numel"):
        monkeypatch.setattr(sm120_pcie_backend, "_pcie_ipc_numel", 0)
    yield
    runtime._launch_plan.cache_clear()


@pytest.mark.parametrize(
    ("routes", "eligible"),
    [(((1, "pcie_ipc"), (16, "sm120_pcie")), True), (((16, "sm120_pcie"),), False)],
)
def test_pcie_ipc_is_on_behind_our_kernel_where_the_table_routes_sizes_to_it(
    monkeypatch, fresh_launch_plan, routes, eligible
):
    """Sizes the table gave to PCIe-IPC are declined by our hooks; upstream's real
    ``eligible_group`` must then build the PCIe-IPC communicator for the TP group, or they
    would fall to NCCL."""
    from sglang.srt.distributed.device_communicators import pcie_ipc_ar
    from sglang_sm120.planning.policy import AllReducePlan
    from sglang_sm120.server.patches import pcie_ipc_enable

    plan = AllReducePlan(True, "sm120_pcie", "sm120_pcie", ("test plan",), routes)
    publish_plan(monkeypatch, plan, tp=8)
    upstream = getattr(pcie_ipc_ar.eligible_group, "__wrapped__", pcie_ipc_ar.eligible_group)
    call = dict(group_name="tp", world_size=8, deterministic=False)
    assert upstream(**call) is False  # opt-in upstream
    assert pcie_ipc_enable.eligible_by_plan(upstream, **call) is eligible


@pytest.mark.parametrize(
    ("raw", "eligible"),
    [("n", False), ("", False), ("maybe", False), ("0", False), ("y", True), ("on", True)],
)
def test_a_users_pcie_ipc_value_means_what_upstream_makes_of_it_or_more(
    monkeypatch, fresh_launch_plan, raw, eligible
):
    """A plan that turns PCIe-IPC on must not turn a value the user set into "on": upstream
    reads ``n`` as off and an empty or unknown value as invalid (off), and the patch hands
    upstream its value for the TP group."""
    from sglang.srt.distributed.device_communicators import pcie_ipc_ar
    from sglang_sm120.planning.policy import AllReducePlan
    from sglang_sm120.server.patches import pcie_ipc_enable

    publish_plan(monkeypatch, AllReducePlan(True, None, "pcie_ipc", ("test plan",)), tp=8)
    monkeypatch.setenv("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", raw)
    upstream = getattr(pcie_ipc_ar.eligible_group, "__wrapped__", pcie_ipc_ar.eligible_group)
    call = dict(group_name="tp", world_size=8, deterministic=False)
    assert pcie_ipc_enable.eligible_by_plan(upstream, **call) is eligible


def trtllm_points(monkeypatch, routes, tp: int, sizes) -> dict[int, tuple]:
    """Fused points of ``sizes`` rows (hidden 64) under a published trtllm plan with ``routes``,
    no sgl-kernel-sm120 workspace: each answer, upstream's (x, x) where upstream was called."""
    from sglang_sm120.planning.policy import AllReducePlan
    from sglang_sm120.server.patches import sm120_pcie_backend

    publish_plan(monkeypatch, AllReducePlan(True, "trtllm", "pcie_ipc", ("t",), routes), tp=tp)
    monkeypatch.setattr(sm120_pcie_backend, "_workspaces", {})
    weight = torch.ones(64, dtype=torch.bfloat16)
    return {
        n: sm120_pcie_backend.fused_by_sm120_pcie(lambda x, *a: (x, x), x, x.clone(), weight)
        for n in sizes
        for x in [torch.ones(n, 64, dtype=torch.bfloat16)]
    }


def test_trtllm_point_declined_where_the_table_routes_the_size_elsewhere(
    monkeypatch, fresh_launch_plan, prepared_pcie_ipc
):
    """A trtllm plan whose table found PCIe-IPC or NCCL faster at some sizes: those fused
    points are handed back (SGLang then all-reduces and norms separately), the others reach
    upstream's trtllm call unchanged."""
    prepared_pcie_ipc(hidden=64, max_rows=64)
    routes = ((4, "trtllm"), (64, "pcie_ipc"), (2048, "trtllm"))
    answers = trtllm_points(monkeypatch, routes, 2, (4, 16, 64, 65))
    declined = [n for n, (out, _) in answers.items() if out is None]
    assert declined == [16, 64]


class RecordingPcieIpcWorkspace:
    """FlashInfer's PcieIpcAllReduceWorkspace, which needs CUDA GPUs: records its sizing."""

    def __init__(self, *, group, max_numel, dtype, tune_batches, tune_cache):
        self.max_numel = max_numel


@pytest.fixture
def prepared_pcie_ipc(monkeypatch):
    """Upstream's PCIe-IPC communicator of an 8-rank TP group, built and prepared as the runner
    does before graph capture (``prepare(hidden, max_rows=<its widest decode rows>)``), with
    the plugin's hooks on ``prepare`` applied as SGLang's registry applies them. Faked: the
    process group (torch's fake backend), the device and FlashInfer's CUDA workspace."""
    import torch.distributed as dist
    from sglang.srt.distributed.device_communicators import pcie_ipc_ar
    from sglang.srt.plugins.hook_registry import _wrap_fn
    from sglang_sm120.server.patches import sm120_pcie_backend
    from torch.testing._internal.distributed.fake_pg import FakeStore

    target = f"{pcie_ipc_ar.__name__}.PcieIpcCommunicator.prepare"
    prepare = pcie_ipc_ar.PcieIpcCommunicator.prepare
    for hook_target, hook, hook_type in sm120_pcie_backend.HOOKS:
        if hook_target == target:
            prepare = _wrap_fn(prepare, hook, hook_type)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)

    def build(hidden: int, max_rows: int | None):
        comm = pcie_ipc_ar.PcieIpcCommunicator(dist.group.WORLD, torch.device("cuda:0"))
        assert not comm.disabled
        comm._workspace_cls, comm._device = RecordingPcieIpcWorkspace, torch.device("cpu")
        prepare(comm, hidden=hidden, max_rows=max_rows)
        return comm

    yield build
    dist.destroy_process_group()


def pool_clamped_eagle_server():
    """max_bs 256, 4 draft tokens, 16 running requests: the decode config says 256 x 4 = 1024
    rows, the runner (clamped to the request pool) captures at most 16 x 4 = 64."""
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig
    from sglang.srt.runtime_context import get_context

    return get_context().override_server_args(
        cuda_graph_config=CudaGraphConfig.from_dict({"decode": {"max_bs": 256}}),
        speculative_algorithm="EAGLE3",
        speculative_num_steps=3,
        speculative_num_draft_tokens=4,
        max_running_requests=16,
    )


def test_trtllm_point_declined_only_where_pcie_ipc_really_holds_it(
    monkeypatch, fresh_launch_plan, prepared_pcie_ipc
):
    """PCIe-IPC's workspace is what upstream built it for (the runner's widest decode rows,
    64 here), not the unclamped decode width (1024): points of 65-1024 rows declined off
    trtllm would land on NCCL, so they stay on trtllm."""
    from sglang.srt.distributed.device_communicators import pcie_ipc_ar

    monkeypatch.delenv("SGLANG_PCIE_IPC_MAX_NUMEL", raising=False)
    routes = ((4, "trtllm"), (1024, "pcie_ipc"), (2048, "trtllm"))
    with pool_clamped_eagle_server():
        assert pcie_ipc_ar._decode_width() == 1024
        comm = prepared_pcie_ipc(hidden=64, max_rows=64)
        answers = trtllm_points(monkeypatch, routes, 8, (4, 16, 64, 65, 1024, 1025))
    assert comm.max_numel == 64 * 64
    assert [n for n, (out, _) in answers.items() if out is None] == [16, 64]


@pytest.mark.parametrize(
    ("max_numel", "declined"), [(None, [16, 64]), (128 * 64, [16, 64, 65, 128])]
)
def test_trtllm_point_declined_only_where_pcie_ipc_can_take_it(
    monkeypatch, fresh_launch_plan, prepared_pcie_ipc, max_numel, declined
):
    """Without a server config upstream sizes PCIe-IPC from its fallback width (64 rows);
    SGLANG_PCIE_IPC_MAX_NUMEL overrides it. A larger point declined off trtllm would run
    NCCL, so it stays on trtllm whatever the table's route."""
    if max_numel is None:
        monkeypatch.delenv("SGLANG_PCIE_IPC_MAX_NUMEL", raising=False)
    else:
        monkeypatch.setenv("SGLANG_PCIE_IPC_MAX_NUMEL", str(max_numel))
    prepared_pcie_ipc(hidden=64, max_rows=None)
    routes = ((4, "trtllm"), (256, "pcie_ipc"))
    answers = trtllm_points(monkeypatch, routes, 8, (4, 16, 64, 65, 128, 129, 300))
    assert [n for n, (out, _) in answers.items() if out is None] == declined


def test_without_pcie_ipc_no_trtllm_point_is_declined(monkeypatch, fresh_launch_plan):
    """No PCIe-IPC workspace was built (the communicator is off or its build failed): a
    declined point would run NCCL, so trtllm keeps every size."""
    routes = ((4, "trtllm"), (64, "pcie_ipc"), (2048, "trtllm"))
    answers = trtllm_points(monkeypatch, routes, 2, (4, 16, 64))
    assert all(out is not None for out, _ in answers.values())


def test_pcie_ipc_routes_behind_our_kernel_stay_on_it_where_pcie_ipc_cannot_hold_them(
    monkeypatch, fresh_launch_plan, prepared_pcie_ipc
):
    """sm120_pcie with PCIe-IPC behind it: a size the table gave to PCIe-IPC is handed to it
    only where its workspace holds the input; larger ones stay on sgl-kernel-sm120 (fused and
    plain) instead of falling to NCCL."""
    from sglang_sm120.server.patches import sm120_pcie_backend

    monkeypatch.delenv("SGLANG_PCIE_IPC_MAX_NUMEL", raising=False)
    routes = ((4, "sm120_pcie"), (256, "pcie_ipc"))
    group = sm120_group(routes, rows=256)
    monkeypatch.setattr(sm120_pcie_backend, "_workspaces", {True: group})
    monkeypatch.setattr(
        sm120_pcie_backend,
        "KERNEL",
        SimpleNamespace(
            validate_all_reduce=lambda *a, **k: None, validate_fused=lambda *a, **k: None
        ),
    )
    prepared_pcie_ipc(hidden=64, max_rows=32)
    weight = torch.ones(64, dtype=torch.bfloat16)
    sizes = (4, 16, 32, 33, 256)
    fused = {
        n: group.serves(torch.ones(n, 64, dtype=torch.bfloat16), weight, weight) for n in sizes
    }
    plain = {n: group.serves(torch.ones(n, 64, dtype=torch.bfloat16)) for n in sizes}
    assert fused == plain == {4: True, 16: False, 32: False, 33: True, 256: True}


def test_trtllm_decline_traces_under_torch_compile(
    monkeypatch, fresh_launch_plan, prepared_pcie_ipc
):
    """The fused point is traced by torch.compile (--enable-torch-compile): once the workspace
    setup resolved the plan, the decision is integer comparisons (fullgraph, no graph break),
    with the eager answers."""
    from sglang_sm120.planning.policy import AllReducePlan
    from sglang_sm120.server.patches import sm120_pcie_backend

    prepared_pcie_ipc(hidden=8, max_rows=64)

    routes = ((4, "trtllm"), (64, "pcie_ipc"), (2048, "trtllm"))
    publish_plan(monkeypatch, AllReducePlan(True, "trtllm", "pcie_ipc", ("t",), routes), tp=2)
    monkeypatch.setattr(sm120_pcie_backend, "_workspaces", {})
    sm120_pcie_backend._trtllm_pcie_ipc_ranges()  # as ensure_sm120_pcie_workspace does first

    def point(x):
        out, _ = sm120_pcie_backend.fused_by_sm120_pcie(lambda x, *a: (x * 3, x), x, x, x[0], 1e-6)
        return x + 1 if out is None else out

    compiled = torch.compile(point, fullgraph=True, backend="eager", dynamic=False)
    for rows, fused in ((4, True), (16, False), (65, True)):
        x = torch.ones(rows, 8)
        assert compiled(x)[0, 0].item() == (3.0 if fused else 2.0), rows


TWELVE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
UNEVEN_SIZES = (3, 5, 9, 17, 33, 63, 65, 129, 257, 513, 1025, 2047)  # one in each route's range


def graphs_compiled(decide, sizes=UNEVEN_SIZES, hidden: int = 8) -> int:
    """Graphs torch.compile builds for ``decide(x) -> bool`` over inputs of ``sizes`` rows,
    with the token dimension dynamic (as SGLang's piecewise graphs trace it)."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(
        lambda x: x * 3 if decide(x) else x + 1, backend=counter, dynamic=True, fullgraph=True
    )
    with torch._dynamo.config.patch(recompile_limit=64):  # count them all, past the default 8
        for rows in sizes:
            x = torch.ones(rows, hidden, dtype=torch.bfloat16)
            assert compiled(x)[0, 0].item() == (3.0 if decide(x) else 2.0), rows
    torch._dynamo.reset()
    return counter.frame_count


def test_a_twelve_route_trtllm_plan_compiles_a_graph_per_decision_not_per_route(
    monkeypatch, fresh_launch_plan, prepared_pcie_ipc
):
    """PCIe-IPC at 1-64 tokens, trtllm above, 12 routes: a decision that changes once gives
    2 graphs, as upstream's own size check does (fused up to its limit, not above); a lookup
    comparing each route would give one graph per route."""
    from sglang_sm120.planning.policy import AllReducePlan
    from sglang_sm120.server.patches import sm120_pcie_backend

    routes = tuple((t, "pcie_ipc" if t <= 64 else "trtllm") for t in TWELVE_SIZES)
    publish_plan(monkeypatch, AllReducePlan(True, "trtllm", "pcie_ipc", ("t",), routes), tp=8)
    monkeypatch.setattr(sm120_pcie_backend, "_workspaces", {})
    prepared_pcie_ipc(hidden=8, max_rows=2048)
    sm120_pcie_backend.ensure_sm120_pcie_workspace(lambda *a: True)  # before capture/compile

    def fused(x):
        out, _ = sm120_pcie_backend.fused_by_sm120_pcie(lambda x, *a: (x, x), x, x, x[0], 1e-6)
        return out is not None

    assert graphs_compiled(fused) == 2


def test_a_twelve_route_sm120_pcie_plan_compiles_a_graph_per_decision_not_per_route():
    """Our kernel at 1-64 tokens, NCCL above: the group's decision compiles 2 graphs."""
    routes = tuple((t, "sm120_pcie" if t <= 64 else "nccl") for t in TWELVE_SIZES)
    group = sm120_group(routes, plain="nccl", rows=2048, hidden=8)
    weight = torch.ones(8, dtype=torch.bfloat16)
    assert graphs_compiled(lambda x: group.serves(x, x, weight)) == 2


@pytest.mark.parametrize(
    "routes",
    [
        (),
        ((4, "trtllm"), (64, "pcie_ipc"), (2048, "trtllm")),
        ((1, "pcie_ipc"), (2, "pcie_ipc"), (8, "trtllm"), (16, "trtllm"), (64, "pcie_ipc")),
        ((4, "sm120_pcie"), (16, "sm120_pcie_unfused"), (64, "sm120_pcie"), (256, "nccl")),
    ],
)
def test_token_ranges_answer_as_the_route_lookup_does(routes):
    from sglang_sm120.planning.policy import AllReducePlan, tokens_in

    for fusion in ("trtllm", "sm120_pcie"):
        plan = AllReducePlan(True, fusion, "pcie_ipc", ("t",), routes)
        for backends in ({"trtllm"}, {"pcie_ipc"}, {"sm120_pcie", "sm120_pcie_unfused"}):
            ranges = plan.token_ranges(backends)
            assert [tokens_in(t, ranges) for t in range(1, 3000)] == [
                plan.route_at(t) in backends for t in range(1, 3000)
            ], (fusion, backends, ranges)


# ------------------------------------- nccl_tuned_env acts where NCCL starts (issue 32 item 1)

NCCL_TARGET = "sglang.srt.distributed.bootstrap.init_distributed_environment"


@pytest.fixture
def own_hook_registry(monkeypatch):
    """SGLang's real registry with only this test's hooks, and the hooked function (every
    module's copy of it) put back afterwards: other tests see upstream's own."""
    import sys
    from collections import defaultdict

    from sglang.srt.distributed import bootstrap
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_sm120.server import runtime, status
    from sglang_sm120.server.patches import nccl_tuned_env

    original = bootstrap.init_distributed_environment
    holders = [
        (module, name)
        for module in list(sys.modules.values())
        if module is not None
        for name, value in list(getattr(module, "__dict__", {}).items())
        if value is original
    ]
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    for module, name in holders:
        monkeypatch.setattr(module, name, original)
    saved = (dict(runtime.PATCH_STATUS), dict(status.REGISTERED), list(runtime._nccl_env_line))
    monkeypatch.setattr(nccl_tuned_env, "_ran", [], raising=False)
    monkeypatch.setattr(nccl_tuned_env, "_set", {})
    yield HookRegistry
    runtime.PATCH_STATUS.clear()
    runtime.PATCH_STATUS.update(saved[0])
    status.REGISTERED.clear()
    status.REGISTERED.update(saved[1])
    runtime._nccl_env_line[:] = saved[2]


def nccl_plan_published(monkeypatch, tmp_path) -> None:
    """A launcher's plan with the tuned NCCL_PROTO=LL, and no NCCL tuning of the user's."""
    from sglang_sm120.planning.nccl_settings import USER_NCCL_TUNING
    from sglang_sm120.planning.policy import AllReducePlan

    for name in USER_NCCL_TUNING:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_CONF_FILE", str(tmp_path / "absent.conf"))
    plan = AllReducePlan(
        True, None, "nccl", ("r",), ((512, "nccl"),), nccl_env=(("NCCL_PROTO", "LL"),)
    )
    publish_plan(monkeypatch, plan, tp=2)


def test_a_still_starting_child_sets_the_tuned_nccl_env_at_nccl_init(
    own_hook_registry, monkeypatch, tmp_path
):
    """A script that calls load_plugins() at module level: each spawned scheduler registers
    while multiprocessing is still starting it (role ``bootstrapping``), and SGLang's own
    load_plugins() in run_scheduler_process is then a no-op. The variables must still be in
    the environment when SGLang's init_distributed_environment runs (a REPLACE hook, innermost
    in the chain, stands in for NCCL there), and the status says applied only after that."""
    from sglang.srt.distributed import bootstrap
    from sglang.srt.plugins.hook_registry import HookType
    from sglang_sm120.server import patches, plugin, runtime, status
    from sglang_sm120.server.patches import nccl_tuned_env

    nccl_plan_published(monkeypatch, tmp_path)
    monkeypatch.setattr(patches, "PATCHES", (nccl_tuned_env,))
    monkeypatch.setattr(runtime, "_role", [runtime.BOOTSTRAPPING])
    plugin.register_patches(runtime.process_role())
    seen = {}

    def nccl_starts(*args, **kwargs):
        seen["NCCL_PROTO"] = process_getenv("NCCL_PROTO")

    own_hook_registry.register(NCCL_TARGET, nccl_starts, HookType.REPLACE)
    own_hook_registry.apply_hooks()
    assert status.verify_applied()["nccl_tuned_env"] == (
        "pending (NCCL_PROTO=allreduce:LL set when init_distributed_environment runs)"
    )
    assert "NCCL_PROTO" not in os.environ
    bootstrap.init_distributed_environment(world_size=2, rank=0, backend="nccl")
    assert seen == {"NCCL_PROTO": "allreduce:LL"}
    assert runtime.PATCH_STATUS["nccl_tuned_env"] == "applied"
    assert runtime.nccl_env_line().startswith(
        "nccl env: NCCL_PROTO=allreduce:LL set before NCCL starts; "
    )
    monkeypatch.delenv("NCCL_PROTO")  # what the hook set, not this test's


def process_getenv(name: str) -> str | None:
    """What NCCL's getenv(3) reads: the C environment, not Python's os.environ copy."""
    import ctypes

    getenv = ctypes.CDLL(None).getenv
    getenv.restype, getenv.argtypes = ctypes.c_char_p, [ctypes.c_char_p]
    raw = getenv(name.encode())
    return None if raw is None else raw.decode()


def test_a_tuned_nccl_env_that_never_reaches_the_process_environment_is_refused(
    own_hook_registry, monkeypatch, tmp_path
):
    """``applied`` is what NCCL will read: where putenv does not reach the C environment
    (os.environ then holds a value getenv(3) does not see), the status says refused and names
    the variable, not applied."""
    from sglang.srt.distributed import bootstrap
    from sglang.srt.plugins.hook_registry import HookType
    from sglang_sm120.server import patches, plugin, runtime
    from sglang_sm120.server.patches import nccl_tuned_env

    nccl_plan_published(monkeypatch, tmp_path)
    monkeypatch.setattr(patches, "PATCHES", (nccl_tuned_env,))
    monkeypatch.setattr(runtime, "_role", ["scheduler"])
    monkeypatch.setattr(os, "putenv", lambda name, value: None)
    plugin.register_patches("scheduler")
    seen = {}

    def nccl_starts(*args, **kwargs):
        seen["NCCL_PROTO"] = process_getenv("NCCL_PROTO")

    own_hook_registry.register(NCCL_TARGET, nccl_starts, HookType.REPLACE)
    own_hook_registry.apply_hooks()
    bootstrap.init_distributed_environment(world_size=2, rank=0, backend="nccl")
    assert seen == {"NCCL_PROTO": None}
    assert runtime.PATCH_STATUS["nccl_tuned_env"] == (
        "refused (NCCL_PROTO=allreduce:LL is not in the process environment NCCL reads)"
    )
    monkeypatch.delenv("NCCL_PROTO")  # what the hook set, not this test's


def test_a_scheduler_whose_nccl_init_never_ran_is_not_reported_applied(
    own_hook_registry, monkeypatch, tmp_path
):
    """``applied`` means the variables were there when NCCL initialised: a scheduler that
    registered but never reached init_distributed_environment (doctor's worker check) says
    pending, never applied, and has set nothing."""
    from sglang_sm120.server import patches, plugin, runtime, status
    from sglang_sm120.server.patches import nccl_tuned_env

    nccl_plan_published(monkeypatch, tmp_path)
    monkeypatch.setattr(patches, "PATCHES", (nccl_tuned_env,))
    monkeypatch.setattr(runtime, "_role", ["scheduler"])
    plugin.register_patches("scheduler")
    own_hook_registry.apply_hooks()
    assert status.verify_applied()["nccl_tuned_env"].startswith("pending (")
    assert "NCCL_PROTO" not in os.environ and runtime.nccl_env_line() is None


def test_a_setting_that_did_not_take_effect_is_reported_refused(monkeypatch):
    """A setting-type patch (no hook) is checked by its effect: add_norm's import-time constant
    put back to False after fusion_applies set it (another plugin, a reload) reads refused."""
    import importlib

    from sglang_sm120.server import runtime, status
    from sglang_sm120.server.patches import fusion_applies

    add_norm = importlib.import_module(fusion_applies.MODULE)
    monkeypatch.setattr(add_norm, "_is_sm90_supported", add_norm._is_sm90_supported)
    monkeypatch.setitem(status.REGISTERED, "fusion_applies", fusion_applies)
    monkeypatch.setitem(runtime.PATCH_STATUS, "fusion_applies", "registered")
    fusion_applies.apply_setting()
    add_norm._is_sm90_supported = False
    assert status.verify_applied()["fusion_applies"] == (
        "refused (its setting did not take effect)"
    )
