"""The worker-side patches, driven from SGLang's own call sites in processes started like
SGLang's (``callsite_rehearsal.py``): one launcher process publishes a plan per variant, then
two 2-rank gloo worlds (plan ``sm120_pcie``, and the default plan: PCIe-IPC for plain
all-reduces) run SGLang's real ``init_parallel_runtime``, workspace setup before capture,
``GroupCoordinator.all_reduce``, ``RMSNorm.forward_with_allreduce_fusion``, the capture of a
verify graph and ``SchedulerOutputStreamer.stream_output``, with a recording stand-in for
sgl-kernel-sm120. Hardware is faked as in ``test_plugin_sglang`` (2x RTX PRO 6000, PCIe).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from child_report import parse_report
from kernel_library import require_kernel_package
from sglang_sm120.server.runtime import LAUNCH_PLAN_ENV

REHEARSAL = Path(__file__).with_name("callsite_rehearsal.py")
HIDDEN = 7168
SMALL = [4, HIDDEN]  # a decode-sized reduction, within the workspace
FUSED = ["sglang::flashinfer_allreduce"]  # upstream's op for tagged groups
UNFUSED = ["sglang::inplace_all_reduce"]  # upstream's default (NCCL) path
WORKER_ENV = {
    "SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie",
    # A CPU box: one OpenMP core per rank (SGLang asks for it with more ranks than NUMA
    # nodes) and no NCCL library, so SGLang disables PyNccl as on any host without GPUs.
    "SGLANG_CPU_OMP_THREADS_BIND": "0|1",
    "SGLANG_NCCL_SO_PATH": "/nonexistent/libnccl.so.2",
}


def _answer(returncode: int, stdout: str, stderr: str) -> dict:
    return parse_report(returncode, stdout, stderr, "REHEARSAL")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rehearsal(model_dirs, tmp_path_factory) -> dict:
    """{"launcher": ..., "sm120_pcie": [rank0, rank1], "default": [rank0, rank1]}; each
    worker's answer also holds its stderr under "log"."""
    require_kernel_package()  # the sm120_pcie plan needs the package in the children
    out = tmp_path_factory.mktemp("callsites")
    env = {**os.environ, **WORKER_ENV}
    for name in ("SGLANG_SM120_DISABLE", "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", LAUNCH_PLAN_ENV):
        env.pop(name, None)
    model = str(model_dirs["KimiK25ForConditionalGeneration"])
    launcher = subprocess.run(
        [sys.executable, str(REHEARSAL), "launcher", model, str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    launched = _answer(launcher.returncode, launcher.stdout, launcher.stderr)
    worlds = {
        "sm120_pcie": {
            "SGLANG_SM120_FUSION_BACKEND": "sm120_pcie",
            "SGLANG_SM120_STATS_DIR": str(out / "stats"),
        },
        "default": {},
    }
    # The sm120_pcie launch again, with a tuning table that sent 1-2 rows to PCIe-IPC.
    plans = {variant: launched[variant]["launch_plan"] for variant in worlds}
    behind = json.loads(plans["sm120_pcie"])
    behind["plan"]["routes"] = [[1, 2, "pcie_ipc"], [3, 64, "sm120_pcie"]]
    plans["sm120_pcie_behind"] = json.dumps(behind)
    worlds["sm120_pcie_behind"] = worlds["sm120_pcie"]
    procs = {}
    for variant, extra in worlds.items():
        port = _free_port()
        worker_env = {**env, **extra, LAUNCH_PLAN_ENV: plans[variant]}
        procs[variant] = [
            subprocess.Popen(
                [sys.executable, str(REHEARSAL), "worker", str(out), variant, str(r), str(port)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=worker_env,
            )
            for r in range(2)
        ]
    result: dict = {"launcher": launched}
    for variant, ranks in procs.items():
        result[variant] = []
        for proc in ranks:
            stdout, stderr = proc.communicate(timeout=300)
            answer = _answer(proc.returncode, stdout, stderr)
            result[variant].append({**answer, "log": stderr})
    return result


# --- the launcher's plans, which the workers follow ----------------------------------------


def test_launcher_publishes_each_plan(rehearsal):
    launched = rehearsal["launcher"]
    assert launched["sm120_pcie"]["fusion_backend"] == "sm120_pcie"
    assert launched["default"]["fusion_backend"] == "trtllm"
    plans = {v: json.loads(launched[v]["launch_plan"])["plan"] for v in ("sm120_pcie", "default")}
    assert plans["sm120_pcie"]["plain_allreduce"] == "sm120_pcie"
    assert plans["default"]["plain_allreduce"] == "pcie_ipc"
    for variant in ("sm120_pcie", "default"):
        for rank in rehearsal[variant]:
            assert rank["patches"]["sm120_pcie_backend"] == "applied"
            assert rank["patches"]["peer_check"] == "applied"
    assert all(r["patches"]["graph_stats"] == "applied" for r in rehearsal["sm120_pcie"])


# --- 2. workspace setup before capture (BaseRunner -> pre_initialize_workspaces) ------------


def test_sm120_pcie_workspace_is_built_collectively_before_capture(rehearsal):
    for rank in rehearsal["sm120_pcie"]:
        setup = rank["workspace_setup"]
        creates = [c for c in setup["kernel"] if c["call"] == "create"]
        # One per fusion group (MoE and attention; both are the TP group at TP2), over both
        # ranks, on the group's device, sized from the CUDA-graph decode width.
        assert len(creates) == 2, setup
        for create in creates:
            assert create["group_ranks"] == [0, 1]
            assert create["hidden"] == HIDDEN and create["dtype"] == "torch.bfloat16"
            assert create["device"] == "cpu"  # the TP coordinator's device on this host
            assert create["max_tokens"] > 0
        assert "pre_initialize_workspaces" in setup["trace"]
        assert "ensure_workspace_initialized" not in setup["trace"]  # upstream's not built
        assert rank["workspaces"] == 2
        # the once-per-process line says whether the kernels launch early (on by default)
        assert setup["logged"] and all(
            m.endswith("programmatic dependent launch on") for m in setup["logged"]
        ), setup["logged"]


def test_other_backend_workspace_setup_is_upstreams(rehearsal):
    for rank in rehearsal["default"]:
        setup = rank["workspace_setup"]
        assert setup["kernel"] == []
        assert setup["trace"].count("ensure_workspace_initialized") == 2, setup["trace"]
        assert rank["workspaces"] == 0


# --- 1. GroupCoordinator.all_reduce routing -----------------------------------------------


def test_plain_allreduce_that_fits_goes_to_the_kernel(rehearsal):
    for rank in rehearsal["sm120_pcie"]:
        assert rank["tp"]["fi_workspace_hint"] == "attn_tp"  # tagged by upstream's bootstrap
        route = rank["plain_fits"]
        assert route["ops"] == FUSED, route
        assert route["kernel"] == [{"call": "all_reduce", "shape": SMALL}]
        assert route["shape"] == SMALL


def test_plain_allreduce_beyond_the_workspace_goes_to_upstreams_path(rehearsal):
    for rank in rehearsal["sm120_pcie"]:
        route = rank["plain_too_big"]
        assert route["ops"] == UNFUSED, route
        assert route["kernel"] == []


def test_plain_allreduce_of_another_group_stays_off_the_workspace(rehearsal):
    """Defect 9: the world group has the TP group's size but other peers (group key)."""
    for rank in rehearsal["sm120_pcie"]:
        route = rank["plain_other_group"]
        assert route["ops"] == UNFUSED, route
        assert route["kernel"] == []
        assert rank["invariants"]["other_group_key"] is False
        assert rank["invariants"]["world_size_4"] is False


def test_pcie_ipc_plan_keeps_plain_allreduce_off_the_flashinfer_path(rehearsal):
    for rank in rehearsal["default"]:
        # Not tagged, although a fusion backend (trtllm) is on: upstream's order applies, and
        # GroupCoordinator built its PCIe-IPC communicator (eligible_group said yes).
        assert rank["tp"]["fi_workspace_hint"] is None
        assert rank["tp"]["pcie_ipc_comm"] is True
        for key in ("plain_fits", "plain_too_big"):
            route = rank[key]
            assert "sglang::flashinfer_allreduce" not in route["ops"], route
            assert "plain_fits_sm120_pcie" not in route["trace"]
            assert route["kernel"] == []
        assert "sglang-sm120: plain all-reduces stay on PCIe-IPC" in rank["log"]


# --- 3. the fused point: RMSNorm.forward_with_allreduce_fusion -----------------------------


def test_fused_point_that_fits_runs_the_fused_kernel(rehearsal):
    for rank in rehearsal["sm120_pcie"]:
        route = rank["fused_fits"]
        assert route["kernel"] == [{"call": "fused", "shape": SMALL, "eps": 1e-6}]
        assert route["ops"] == []  # no separate all-reduce
        assert route["shapes"] == [SMALL, SMALL]


def test_fused_point_the_table_routes_unfused_reduces_on_our_kernel_then_norms(rehearsal):
    """Where the tuning table found our all-reduce + a separate norm faster: SGLang's fused
    point is declined, and the all-reduce its fallback makes runs on sgl-kernel-sm120."""
    for rank in rehearsal["sm120_pcie"]:
        for where in ("attention", "moe"):  # attention_... / deferred_post_experts_all_reduce
            route = rank["fused_routed_unfused"][where]
            assert route["kernel"] == [{"call": "all_reduce", "shape": SMALL}], (where, route)
            assert route["ops"] == FUSED, route  # upstream's op for our plain all-reduce
            assert route["shapes"] == [SMALL, SMALL]


def test_fused_point_beyond_the_workspace_takes_upstreams_unfused_path(rehearsal):
    for rank in rehearsal["sm120_pcie"]:
        route = rank["fused_too_big"]
        assert route["kernel"] == []
        assert route["ops"] == UNFUSED, route  # all-reduce, then add + norm
        assert "attention_tensor_model_parallel_all_reduce" in route["trace"]


def test_trtllm_point_the_table_routes_to_pcie_ipc_is_declined_to_the_plain_path(rehearsal):
    """A trtllm plan whose tuning table found PCIe-IPC + norm faster at this size: SGLang's fused
    point, after attention and after the MoE, is declined, and its fallback all-reduce takes
    the same path as any plain all-reduce of this server (on a GPU host, PCIe-IPC: the TP group
    is not tagged for FlashInfer; this CPU rehearsal has PCIe-IPC disabled, so upstream's
    NCCL op), never FlashInfer's kernels."""
    fallback = {
        "attention": "attention_tensor_model_parallel_all_reduce",
        "moe": "deferred_post_experts_all_reduce",
    }
    for rank in rehearsal["default"]:
        for where, caller in fallback.items():
            route = rank["fused_routed_off_trtllm"][where]
            assert "sglang::flashinfer_allreduce_residual_rmsnorm" not in route["ops"], route
            assert route["ops"] == rank["plain_fits"]["ops"], (where, route)
            assert caller in route["trace"], (where, route["trace"])
            assert route["kernel"] == []
            assert route["shapes"] == [SMALL, SMALL]


def test_fused_point_of_another_backend_is_upstreams(rehearsal):
    for rank in rehearsal["default"]:
        route = rank["fused_fits"]
        assert route["kernel"] == []
        assert route["ops"] == ["sglang::flashinfer_allreduce_residual_rmsnorm"], route


# --- 4. the peer check where results leave the scheduler ----------------------------------


def test_peer_timeout_stops_the_step_before_its_output_is_sent(rehearsal):
    for rank in rehearsal["sm120_pcie"]:
        assert rank["stream_ok"] == {"raised": None, "sent": ["BatchTokenIDOutput"]}
        after = rank["stream_after_timeout"]
        assert after["raised"].startswith("sgl_kernel_sm120.errors.CommTimeoutError: rank ")
        assert after["sent"] == []


def test_without_our_workspace_streaming_is_unchanged(rehearsal):
    for rank in rehearsal["default"]:
        for key in ("stream_ok", "stream_after_timeout"):
            assert rank[key] == {"raised": None, "sent": ["BatchTokenIDOutput"]}


def test_stats_file_records_the_peer_error(rehearsal):
    for rank in rehearsal["sm120_pcie"]:
        assert rank["stats"]["peer_error"].startswith(f"rank {rank['rank']}/2: timed out")


# --- 5. upstream's invariants with the plugin loaded ---------------------------------------


def test_seams_answer_as_upstream_with_nothing_published(rehearsal):
    for variant in ("sm120_pcie", "default"):
        for rank in rehearsal[variant]:
            rows = rank["unpublished"]
            assert isinstance(rows, list) and len(rows) == 4, rows
            for row in rows:
                assert row["patched"] == row["upstream"], row
                assert isinstance(row["patched"], bool), row


def test_eligible_group_stays_a_pure_function_of_its_arguments(rehearsal):
    # PCIe-IPC on for the TP group is the plan's decision on purpose; off under sm120_pcie.
    for variant, answer in (("default", True), ("sm120_pcie", False)):
        for rank in rehearsal[variant]:
            assert rank["invariants"]["eligible_group"] == [answer, answer]
            assert rank["invariants"]["eligible_group_context_reads"] == []


def test_upstream_guards_still_refuse_with_our_workspace_present(rehearsal):
    for rank in rehearsal["sm120_pcie"]:
        answers = rank["invariants"]
        assert answers["fits"] is True
        refused = ("ndim3", "non_contiguous", "float32", "over_workspace")
        assert {k: answers[k] for k in refused} == dict.fromkeys(refused, False)


def test_fused_calls_in_capture_count_only_kernel_results(rehearsal):
    """Defect 11: of a fitting and a too-large fused point during a verify-graph capture,
    only the one our kernel served is counted."""
    for rank in rehearsal["sm120_pcie"]:
        assert rank["fused_chain"] == ["count_fused_in_capture", "fused_by_sm120_pcie"]
        assert rank["capture"]["kernel"] == [{"call": "fused", "shape": SMALL, "eps": 1e-6}]
        assert rank["stats"]["graph_captures"] == {"TARGET_VERIFY": 1}
        assert rank["stats"]["fused_allreduce_in_capture"] == {"TARGET_VERIFY": 1}


# --- 5. sm120_pcie with PCIe-IPC behind it (the table sent 1-2 rows to PCIe-IPC) ----------


def test_pcie_ipc_is_built_behind_our_kernel_and_takes_the_sizes_routed_to_it(rehearsal):
    """Our hook declines the sizes routed to PCIe-IPC, and upstream's communicator choice
    (where PCIe-IPC, built for this group, comes first) takes them: the same path as in a
    PCIe-IPC plan. (Without a GPU the communicator is built disabled, so its own size check is
    not reached here.)"""
    pcie_plan_ops = rehearsal["default"][0]["plain_fits"]["ops"]
    for rank in rehearsal["sm120_pcie_behind"]:
        assert rank["tp"]["pcie_ipc_comm"] is True  # eligible_group said yes for the TP group
        assert rank["tp"]["fi_workspace_hint"] is not None  # still tagged: ours comes first
        ours = rank["plain_routed_ours"]
        assert ours["kernel"] == [{"call": "all_reduce", "shape": SMALL}], ours
        declined = rank["plain_routed_pcie_ipc"]
        assert declined["kernel"] == []
        assert "plain_fits_sm120_pcie" in declined["trace"]  # asked first, said no
        assert "GroupCoordinator._resolve_outplace_all_reduce_method" in declined["trace"]
        assert declined["ops"] == pcie_plan_ops, declined
        fused = rank["fused_routed_pcie_ipc"]
        assert fused["kernel"] == []
        assert "sglang::flashinfer_allreduce_residual_rmsnorm" not in fused["ops"], fused
        assert fused["ops"] == declined["ops"], fused
        assert fused["shapes"] == [[2, HIDDEN], [2, HIDDEN]]
