"""The plugin against the real, installed sglang 0.5.23.

First the gap, in this process, where no plugin is loaded: on a faked SM120 upstream's own code
gives no fusion backend and crashes on a forced one. Then, each in a fresh process (patches are
process-global), SGLang's ``load_plugins()`` discovers our entry point and the same upstream
code gives the planned result. Hardware is faked with ``override_platform`` (upstream's facts)
and ``SGLANG_SM120_TOPOLOGY`` (ours); no sglang module is stubbed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from child_report import run_child
from kernel_library import expected_sm120_pcie_status, require_kernel_package
from sglang_sm120.server.patches import PATCHES, patch_name
from sglang_sm120.server.runtime import LAUNCH_PLAN_ENV

SCENARIO = Path(__file__).with_name("plugin_scenario.py")
SM120 = dict(
    is_cuda=True,
    is_hip=False,
    has_flashinfer=True,
    device_capability=(12, 0),
    device_sm=120,
    is_sm90=False,
    is_sm100=False,
    is_sm120=True,
    is_blackwell=True,
)
ALL_PATCHES = {patch_name(m) for m in PATCHES}
# Without sgl-kernel-sm120 these two say "not needed (sgl-kernel-sm120 is not installed)".
KERNEL_PATCHES = {"sm120_pcie_backend", "peer_check"}
# The patches a TP worker registers; the others serve the processes that spawn schedulers.
# graph_stats is opt-in; nccl_tuned_env has something to set only with a tuning table's NCCL
# variant (test_launch_rehearsal proves it in a real worker).
BEHAVIOUR_PATCHES = {patch_name(m) for m in PATCHES if "scheduler" in m.ROLES} - {
    "graph_stats",
    "nccl_tuned_env",
}


def expected_worker_statuses() -> dict[str, str]:
    """Every behaviour patch applied in a worker on the PCIe profile (the kernel's two as the
    installed package allows)."""
    kernel_status = expected_sm120_pcie_status()
    return {n: kernel_status if n in KERNEL_PATCHES else "applied" for n in BEHAVIOUR_PATCHES}


def _run(phase: str, model_dir: Path, tps: tuple[int, ...], env: dict) -> tuple[dict, str]:
    argv = [sys.executable, str(SCENARIO), phase, str(model_dir), *map(str, tps)]
    return run_child(argv, env, "SCENARIO")


_scenarios: dict[str, dict] = {}


def run_scenario(model_dir: Path, *tps: int, **options) -> dict:
    """``rehearse`` once per distinct set of arguments (several tests read one scenario)."""
    key = json.dumps([str(model_dir), tps, options], sort_keys=True, default=str)
    if key not in _scenarios:
        _scenarios[key] = rehearse(model_dir, *tps, **options)
    return _scenarios[key]


def rehearse(
    model_dir: Path,
    *tps: int,
    profile: str = "rtx-pro-6000-x8-pcie",
    server_args: dict | None = None,
    env: dict | None = None,
    worker_env: dict | None = None,
) -> dict:
    """One launcher process resolving every TP size, then one worker process per TP size that
    inherits the launcher's environment as SGLang's schedulers do. Worker answers are keyed by
    TP size; ``patches``/``resolve``/``chains``/``add_norm_sm90_constant`` are the first
    worker's; ``log`` holds every process's stderr."""
    full_env = {
        **os.environ,
        "SGLANG_SM120_TOPOLOGY": profile,
        "SCENARIO_SERVER_ARGS": json.dumps(server_args or {}),
    }
    for name in ("SGLANG_SM120_DISABLE", "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", LAUNCH_PLAN_ENV):
        full_env.pop(name, None)
    full_env.update(env or {})
    launched, launcher_log = _run("launcher", model_dir, tps, full_env)
    result: dict = {
        "other_plugin_calls": launched["other_plugin_calls"],
        "launcher_patches": launched["patches"],
        "fusion_backend": launched["fusion_backend"],
        "launch_plan": launched["launch_plan"],
        "launcher_log": launcher_log,
        "log": launcher_log,
    }
    for tp in tps:
        spawned = {
            **full_env,
            **(worker_env or {}),
            "SCENARIO_FUSION_BACKEND": launched["fusion_backend"][str(tp)] or "",
        }
        if launched["launch_plan"][str(tp)] is not None:
            spawned[LAUNCH_PLAN_ENV] = launched["launch_plan"][str(tp)]
        answers, worker_log = _run("worker", model_dir, (tp,), spawned)
        result["log"] += worker_log
        result.setdefault("worker_log", {})[str(tp)] = worker_log
        for key in (
            "ar_fusion_applies",
            "pcie_ipc_eligible",
            "flashinfer_allreduce_only",
            "worker_plan",
            "resolve_published",
            "upstream_switches",
        ):
            result.setdefault(key, {})[str(tp)] = answers[key]
        for key in ("patches", "resolve", "chains", "add_norm_sm90_constant"):
            result.setdefault(key, answers[key])
    return result


# --- the gap, upstream alone -----------------------------------------------------------------


def test_upstream_alone_gives_sm120_no_fusion_backend(model_dirs):
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.server_args import ServerArgs

    with override_platform(**SM120):
        args = ServerArgs(
            model_path=str(model_dirs["KimiK25ForConditionalGeneration"]), tp_size=2, device="cuda"
        )
        args.resolve_once()
        assert args.resolved_dict()["flashinfer_allreduce_fusion_backend"] is None


def test_upstream_alone_raises_on_forced_backend_and_gates_fusion_off():
    from sglang.srt.layers import flashinfer_comm_fusion
    from sglang.srt.layers.layer_boundary.residual import add_norm
    from sglang.srt.runtime_context import override_platform

    with override_platform(**SM120):
        with pytest.raises(ValueError, match="SM90 or SM10X"):
            flashinfer_comm_fusion._resolve_backend("trtllm", False)
    assert add_norm._is_sm90_supported is False  # import-time constant on this (CPU) machine


# --- with the plugin, through SGLang's own plugin loader ----------------------------------------


def plan_line(log: str, where: str, tp: int) -> str:
    """The plan summary a process logged, without the prefix that says where."""
    marker = f"sglang-sm120 plan ({where}, tp={tp}): "
    lines = [line.split(marker, 1)[1] for line in log.splitlines() if marker in line]
    assert len(lines) == 1, f"expected one {marker!r} line in:\n{log[-3000:]}"
    return lines[0]


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"])
def test_pcie_x8_profile_gets_planned_backends(model_dirs, arch):
    result = run_scenario(model_dirs[arch], 2, 4, 8)
    assert {
        n: s for n, s in result["patches"].items() if n in BEHAVIOUR_PATCHES
    } == expected_worker_statuses()
    assert result["patches"]["graph_stats"] == "not needed (SGLANG_SM120_STATS_DIR unset)"
    assert result["patches"]["nccl_tuned_env"] == "not needed (nccl env: none (no tuning table))"
    assert result["fusion_backend"] == {"2": "trtllm", "4": None, "8": None}
    assert result["ar_fusion_applies"] == {"2": True, "4": False, "8": False}
    assert result["pcie_ipc_eligible"] == {"2": True, "4": True, "8": True}
    assert result["flashinfer_allreduce_only"] == {"2": False, "4": False, "8": False}
    assert result["resolve"]["auto"] == "trtllm" and result["resolve"]["trtllm"] == "trtllm"
    assert (
        result["resolve"]["mnnvl"].startswith("ValueError: sglang-sm120")
        and "NVLink" in result["resolve"]["mnnvl"]
    )
    assert result["add_norm_sm90_constant"] is True


def test_each_process_logs_its_status_line_after_sglang_configures_logging(model_dirs):
    """No logging.basicConfig in the rehearsed processes: only SGLang's configure_logger."""
    result = run_scenario(model_dirs["DeepseekV3ForCausalLM"], 2, 4, 8)
    launcher, worker = result["launcher_log"], result["worker_log"]["8"]
    assert launcher.count("sglang-sm120 0.5.23.1 (launcher): 8x NVIDIA RTX PRO 6000") == 1
    assert "fusion_auto_enable=applied" in launcher
    assert "pcie_ipc_enable=not used in the launcher" in launcher
    worker_lines = [
        line for line in worker.splitlines() if "sglang-sm120 0.5.23.1 (TP worker)" in line
    ]
    assert len(worker_lines) == 1 and " TP0]" in worker_lines[0]
    assert "pcie_ipc_enable=applied" in worker_lines[0]


def test_launcher_registers_only_the_server_args_pass(model_dirs):
    result = run_scenario(model_dirs["DeepseekV3ForCausalLM"], 2, 4, 8)
    used_in_launcher = {n for n, s in result["launcher_patches"].items() if s == "applied"}
    assert used_in_launcher == {"status_line", "fusion_auto_enable"}


@pytest.mark.parametrize("tp", [2, 8])
def test_worker_follows_the_launchers_plan_reasons_included(model_dirs, tp):
    """At TP2 the launcher turns trtllm on by itself: the worker must not call it requested."""
    result = run_scenario(model_dirs["KimiK25ForConditionalGeneration"], 2, 4, 8)
    launcher_plan = plan_line(result["launcher_log"], "server args", tp)
    assert plan_line(result["worker_log"][str(tp)], "from launcher", tp) == launcher_plan
    assert "requested" not in launcher_plan


def test_worker_keeps_the_tuning_tables_routes(model_dirs, tmp_path):
    require_kernel_package()
    from sglang_sm120.machine.cache import host_fingerprint
    from sglang_sm120.machine.facts import load_profile
    from sglang_sm120.planning.tuning import Measurement, TuningTable, save_table

    rows = [
        Measurement("sm120_pcie", tokens, us, True)
        for tokens, us in ((4, 9.0), (64, 40.0), (256, 200.0))
    ] + [
        Measurement("nccl", tokens, us, True) for tokens, us in ((4, 20.0), (64, 30.0), (256, 90.0))
    ]
    table = TuningTable(
        host_fingerprint(load_profile("rtx-pro-6000-x8-pcie"), 8), 8, 7168, "bfloat16", tuple(rows)
    )
    os.environ["SGLANG_SM120_CACHE_DIR"] = str(tmp_path)
    try:
        save_table(table)
    finally:
        del os.environ["SGLANG_SM120_CACHE_DIR"]
    result = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"],
        8,
        env={"SGLANG_SM120_CACHE_DIR": str(tmp_path)},
    )
    launched = json.loads(result["launch_plan"]["8"])["plan"]
    assert launched["fusion_backend"] == "sm120_pcie"
    assert launched["routes"] == [[1, 4, "sm120_pcie"], [5, 256, "nccl"]]
    assert result["worker_plan"]["8"]["routes"] == launched["routes"]
    assert plan_line(result["worker_log"]["8"], "from launcher", 8) == plan_line(
        result["launcher_log"], "server args", 8
    )


def test_a_cache_dir_that_cannot_be_read_leaves_server_args_resolving(model_dirs, tmp_path):
    """Upstream alone starts and the default plan needs no table: a cache directory the
    launcher cannot read (here a name the file system refuses) is a reason, not a crash."""
    unreadable = tmp_path / ("x" * 300)
    result = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"],
        8,
        env={"SGLANG_SM120_CACHE_DIR": str(unreadable)},
    )
    plan = json.loads(result["launch_plan"]["8"])["plan"]
    assert (plan["fusion_backend"], plan["plain_allreduce"]) == (None, "pcie_ipc")
    assert any(
        f"SGLANG_SM120_CACHE_DIR={unreadable} unreadable (File name too long)" in r
        for r in plan["reasons"]
    )


def test_worker_that_sees_one_gpu_decides_from_the_tp_group(model_dirs, tmp_path):
    """SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS=1: each worker's NVML view is its own GPU."""
    one_gpu = tmp_path / "one-gpu.json"
    one_gpu.write_text(
        json.dumps(
            {
                "gpus": [
                    {"name": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "capability": [12, 0]}
                ],
                "p2p": "all",
            }
        )
    )
    result = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"],
        2,
        worker_env={"SGLANG_SM120_TOPOLOGY": str(one_gpu)},
    )
    assert result["fusion_backend"] == {"2": "trtllm"}
    assert {
        n: s for n, s in result["patches"].items() if n in BEHAVIOUR_PATCHES
    } == expected_worker_statuses()
    assert result["resolve"]["trtllm"] == "trtllm"
    assert result["ar_fusion_applies"] == {"2": True}
    assert result["pcie_ipc_eligible"] == {"2": True}


def test_base_gpu_id_picks_the_tp_groups_gpus(model_dirs, tmp_path):
    """GPUs 0-3 are not SM12x, 4-7 are: --base-gpu-id 4 --tp 4 runs on SM120 only."""
    mixed = tmp_path / "mixed.json"
    gpus = [{"name": "NVIDIA H100", "capability": [9, 0]}] * 4 + [
        {"name": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "capability": [12, 0]}
    ] * 4
    mixed.write_text(json.dumps({"gpus": gpus, "p2p": "all"}))
    on_sm120 = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"],
        4,
        profile=str(mixed),
        server_args={"base_gpu_id": 4},
    )
    launched = json.loads(on_sm120["launch_plan"]["4"])
    assert launched["gpu_ids"] == [4, 5, 6, 7]
    assert launched["plan"]["managed"] and launched["plan"]["plain_allreduce"] == "pcie_ipc"
    on_h100 = run_scenario(model_dirs["KimiK25ForConditionalGeneration"], 4, profile=str(mixed))
    assert json.loads(on_h100["launch_plan"]["4"])["plan"]["managed"] is False


def test_fp16_model_keeps_nccl_in_the_worker(model_dirs):
    """Upstream's PCIe-IPC serves bf16 only: the launcher plans NCCL and the worker follows."""
    result = run_scenario(model_dirs["DeepseekV3ForCausalLM"], 8, server_args={"dtype": "float16"})
    assert json.loads(result["launch_plan"]["8"])["plan"]["plain_allreduce"] == "nccl"
    assert result["pcie_ipc_eligible"] == {"8": False}


def test_users_pcie_ipc_switch_wins_over_sm120_pcie_plain_allreduce(model_dirs):
    require_kernel_package()
    result = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"],
        8,
        env={"SGLANG_SM120_FUSION_BACKEND": "sm120_pcie", "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "1"},
    )
    assert result["fusion_backend"] == {"8": "sm120_pcie"}
    assert result["pcie_ipc_eligible"] == {"8": True}
    assert result["flashinfer_allreduce_only"] == {"8": False}
    assert "refused" not in result["log"]


def test_hooks_on_one_target_compose_in_the_applied_chain(model_dirs, tmp_path):
    """graph_stats and sm120_pcie_backend both hook the fused point; both must run."""
    require_kernel_package()
    result = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"],
        2,
        env={"SGLANG_SM120_FUSION_BACKEND": "sm120_pcie", "SGLANG_SM120_STATS_DIR": str(tmp_path)},
    )
    assert result["patches"]["graph_stats"] == "applied"
    assert result["patches"]["sm120_pcie_backend"] == "applied"
    fused = "sglang.srt.layers.flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm"
    assert set(result["chains"][fused]) == {"fused_by_sm120_pcie", "count_fused_in_capture"}
    runner = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
    assert result["chains"][f"{runner}.execute"] == ["count_replays"]


def test_another_plugin_on_the_same_target_is_applied_too(model_dirs, tmp_path):
    """A second plugin, discovered after ours, hooks the auto-enable pass we hook: SGLang's
    loader applies both, and the server-args resolution runs both."""
    dist = tmp_path / "other_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: other-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nother_plugin = other_plugin:register\n"
    )
    (tmp_path / "other_plugin.py").write_text(
        "import os\n"
        "from sglang.srt.plugins.hook_registry import HookRegistry, HookType\n"
        "def count(original, view):\n"
        "    calls = int(os.environ.get('OTHER_PLUGIN_CALLS', 0))\n"
        "    os.environ['OTHER_PLUGIN_CALLS'] = str(calls + 1)\n"
        "    return original(view)\n"
        "def register():\n"
        "    HookRegistry.register(\n"
        "        'sglang.srt.arg_groups.overrides._flashinfer_allreduce_fusion_auto_enable',\n"
        "        count, HookType.AROUND)\n"
    )
    result = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"],
        2,
        env={"SCENARIO_APPEND_PATH": str(tmp_path)},
    )
    assert result["other_plugin_calls"] == 1
    assert result["fusion_backend"] == {"2": "trtllm"}
    assert result["launcher_patches"]["fusion_auto_enable"] == "applied"


def test_explicit_trtllm_at_tp8_is_honoured(model_dirs):
    result = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"],
        8,
        server_args={"flashinfer_allreduce_fusion_backend": "trtllm"},
    )
    assert result["fusion_backend"] == {"8": "trtllm"}
    # Plain all-reduces still go to PCIe-IPC, not the fused backend's all-to-all kernel.
    assert result["flashinfer_allreduce_only"] == {"8": False}


def test_enforce_disable_wins(model_dirs):
    result = run_scenario(
        model_dirs["DeepseekV3ForCausalLM"],
        2,
        server_args={"enforce_disable_flashinfer_allreduce_fusion": True},
    )
    assert result["fusion_backend"] == {"2": None}


def test_user_can_turn_pcie_ipc_off(model_dirs):
    result = run_scenario(
        model_dirs["DeepseekV3ForCausalLM"], 8, env={"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "0"}
    )
    assert result["pcie_ipc_eligible"] == {"8": False}


def test_no_p2p_host_refuses_fusion_and_pcie_ipc(model_dirs):
    result = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"],
        2,
        profile="rtx-5090-x2-nop2p",
        server_args={"flashinfer_allreduce_fusion_backend": "trtllm"},
        env={"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "on"},
    )
    assert result["fusion_backend"] == {"2": None}
    assert result["pcie_ipc_eligible"] == {"2": False}
    assert "no P2P" in result["resolve"]["trtllm"]
    for name in ("fusion_applies", "workspace_preflight", "allreduce_precedence"):
        assert result["patches"][name].startswith("not needed (no P2P between GPUs 0-1")
    assert "--flashinfer-allreduce-fusion-backend trtllm refused" in result["log"]
    assert "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE='on' refused" in result["log"]  # what the user wrote


def test_sm90_host_is_left_to_upstream(model_dirs):
    result = run_scenario(model_dirs["DeepseekV3ForCausalLM"], 8, profile="h200-x8-nvlink")
    assert all(
        result["patches"][name].startswith("not needed (8x NVIDIA H200 (SM90): not SM12x")
        for name in BEHAVIOUR_PATCHES
    )
    assert result["fusion_backend"] == {"8": "auto"}
    assert result["pcie_ipc_eligible"] == {"8": False}
    assert result["flashinfer_allreduce_only"] == {"8": True}


def test_kill_switch_loads_but_applies_nothing(model_dirs):
    result = run_scenario(model_dirs["DeepseekV3ForCausalLM"], 2, env={"SGLANG_SM120_DISABLE": "1"})
    assert result["patches"] == {name: "disabled (SGLANG_SM120_DISABLE=1)" for name in ALL_PATCHES}
    assert result["fusion_backend"] == {"2": None}
    assert result["ar_fusion_applies"] == {"2": False}
    assert result["resolve"]["trtllm"].startswith(
        "ValueError: FlashInfer allreduce fusion requires"
    )
    assert result["add_norm_sm90_constant"] is False


def test_sm120_pcie_backend_is_chosen_through_upstream_code_paths(model_dirs):
    """SGLANG_SM120_FUSION_BACKEND=sm120_pcie: resolution, backend resolve and the per-call gate
    all go through upstream's code; plain all-reduces stay routed to the (our) fused backend."""
    require_kernel_package()
    result = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"],
        2,
        8,
        env={"SGLANG_SM120_FUSION_BACKEND": "sm120_pcie"},
    )
    assert result["patches"]["sm120_pcie_backend"] == "applied"
    assert result["fusion_backend"] == {"2": "sm120_pcie", "8": "sm120_pcie"}
    assert result["resolve"]["sm120_pcie"] == "sm120_pcie"
    assert result["ar_fusion_applies"] == {"2": True, "8": True}
    assert result["flashinfer_allreduce_only"] == {"2": True, "8": True}
    assert result["pcie_ipc_eligible"] == {"2": False, "8": False}
    assert "fusion=sm120_pcie, plain all-reduce=sm120_pcie" in result["log"]


def test_a_kernel_library_that_does_not_load_is_planned_as_absent(model_dirs):
    """sgl-kernel-sm120 installed, its compiled library missing: every rank would fail to
    build its workspace, so launcher and workers judge the package by loading the library,
    plan without it and say why."""
    broken = "/nonexistent/libsgl_kernel_sm120.so"
    result = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"],
        8,
        env={"SGLANG_SM120_FUSION_BACKEND": "sm120_pcie", "SGLANG_SM120_KERNEL_LIBRARY": broken},
    )
    plan = json.loads(result["launch_plan"]["8"])["plan"]
    assert (plan["fusion_backend"], plan["plain_allreduce"]) == (None, "pcie_ipc")
    assert any("requested sm120_pcie refused" in r and broken in r for r in plan["reasons"])
    assert result["pcie_ipc_eligible"] == {"8": True}
    status = result["patches"]["sm120_pcie_backend"]
    assert status.startswith("not needed (sgl-kernel-sm120") and broken in status
    assert result["launcher_patches"]["sm120_pcie_backend"] == "not used in the launcher"


def test_sm120_pcie_refused_without_p2p(model_dirs):
    result = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"],
        2,
        profile="rtx-5090-x2-nop2p",
        env={"SGLANG_SM120_FUSION_BACKEND": "sm120_pcie"},
    )
    assert result["fusion_backend"] == {"2": None}
    assert result["patches"]["sm120_pcie_backend"].startswith("not needed (no P2P")


# --- PP across nodes: planned by the TP group's span ---------------------------------------------

# This node's launcher of `--nnodes 2 --pp-size 2 --tp 8`: one PP stage a node, TP inside it.
PP2_OVER_2_NODES = {"nnodes": 2, "pp_size": 2, "dist_init_addr": "127.0.0.1:5000"}


def test_pp_across_nodes_keeps_pcie_ipc_in_the_worker(model_dirs):
    result = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"], 8, server_args=PP2_OVER_2_NODES
    )
    launched = json.loads(result["launch_plan"]["8"])
    assert launched["gpu_ids"] == list(range(8))
    plan = launched["plan"]
    assert (plan["fusion_backend"], plan["plain_allreduce"]) == (None, "pcie_ipc"), plan
    assert any("TP group inside one node" in r for r in plan["reasons"])
    assert result["fusion_backend"] == {"8": None}
    assert result["pcie_ipc_eligible"] == {"8": True}
    assert result["resolve_published"] == {"8": None}
    assert result["resolve"]["trtllm"].startswith("ValueError: sglang-sm120: the trtllm fused")


def test_pp_across_nodes_refuses_explicit_trtllm(model_dirs):
    """Upstream refuses trtllm whenever nnodes > 1; the plan says so before warmup would."""
    result = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"],
        8,
        server_args={**PP2_OVER_2_NODES, "flashinfer_allreduce_fusion_backend": "trtllm"},
    )
    plan = json.loads(result["launch_plan"]["8"])["plan"]
    assert (plan["fusion_backend"], plan["plain_allreduce"]) == (None, "pcie_ipc"), plan
    assert "--flashinfer-allreduce-fusion-backend trtllm refused" in result["launcher_log"]
    assert "nnodes > 1" in result["launcher_log"]


def test_pp_across_nodes_serves_sm120_pcie(model_dirs):
    require_kernel_package()
    result = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"],
        8,
        server_args=PP2_OVER_2_NODES,
        env={"SGLANG_SM120_FUSION_BACKEND": "sm120_pcie"},
    )
    plan = json.loads(result["launch_plan"]["8"])["plan"]
    assert (plan["fusion_backend"], plan["plain_allreduce"]) == ("sm120_pcie", "sm120_pcie")
    assert result["fusion_backend"] == {"8": "sm120_pcie"}
    assert result["resolve_published"] == {"8": "sm120_pcie"}
    assert result["resolve"]["sm120_pcie"] == "sm120_pcie"
    assert result["ar_fusion_applies"] == {"8": True}


def test_tp_spanning_nodes_stays_on_nccl(model_dirs):
    """`--nnodes 2 --tp 16`: 8 TP ranks on each node, one TP group across both."""
    result = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"],
        16,
        server_args={"nnodes": 2, "dist_init_addr": "127.0.0.1:5000"},
        env={"SGLANG_SM120_FUSION_BACKEND": "sm120_pcie"},
    )
    launched = json.loads(result["launch_plan"]["16"])
    assert launched["gpu_ids"] == list(range(8))
    plan = launched["plan"]
    assert (plan["fusion_backend"], plan["plain_allreduce"]) == (None, "nccl"), plan
    assert any(
        r.startswith("plain all-reduce NCCL: the TP group spans 2 nodes") for r in plan["reasons"]
    )
    assert result["pcie_ipc_eligible"] == {"16": False}
    assert result["resolve"]["sm120_pcie"].startswith(
        "ValueError: sglang-sm120: sm120_pcie on several nodes serves a TP group inside one node"
    )


# --- "auto" means the plan decides, however it is spelled ----------------------------------------

AUTO_SPELLINGS = [
    # id, server args, plugin env, fusion backend the launcher resolves at TP2 / TP8
    (
        "--flashinfer-allreduce-fusion-backend auto",
        {"flashinfer_allreduce_fusion_backend": "auto"},
        {},
        ("trtllm", None),
    ),
    (
        "deprecated --enable-flashinfer-allreduce-fusion",
        {"enable_flashinfer_allreduce_fusion": True},
        {},
        ("trtllm", None),
    ),
    (
        "SGLANG_SM120_FUSION_BACKEND=auto",
        {},
        {"SGLANG_SM120_FUSION_BACKEND": "auto"},
        ("trtllm", None),
    ),
    (
        "explicit trtllm",
        {"flashinfer_allreduce_fusion_backend": "trtllm"},
        {},
        ("trtllm", "trtllm"),
    ),
]


def resolve_in_launcher(model_dir: Path, *tps: int, server_args: dict, env: dict) -> dict:
    """Only the launcher: real ServerArgs resolved for each TP size on the faked PCIe host."""
    full_env = {
        **os.environ,
        "SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie",
        "SCENARIO_SERVER_ARGS": json.dumps(server_args),
    }
    for name in ("SGLANG_SM120_DISABLE", "SGLANG_SM120_FUSION_BACKEND", LAUNCH_PLAN_ENV):
        full_env.pop(name, None)
    return _run("launcher", model_dir, tps, {**full_env, **env})[0]


@pytest.mark.parametrize(
    ("server_args", "env", "expected"),
    [r[1:] for r in AUTO_SPELLINGS],
    ids=[r[0] for r in AUTO_SPELLINGS],
)
def test_auto_in_any_spelling_follows_the_tp_default(model_dirs, server_args, env, expected):
    launched = resolve_in_launcher(
        model_dirs["KimiK25ForConditionalGeneration"], 2, 8, server_args=server_args, env=env
    )
    assert (launched["fusion_backend"]["2"], launched["fusion_backend"]["8"]) == expected
    reasons = json.loads(launched["launch_plan"]["8"])["plan"]["reasons"]
    explicit = server_args.get("flashinfer_allreduce_fusion_backend") == "trtllm"
    assert any("requested" in r for r in reasons) == explicit, reasons


def plant_table(directory, winner: str) -> None:
    """A TP8 tuning table for the 8x RTX PRO 6000 profile in ``directory`` (the cache directory
    the launcher is given), where ``winner`` takes 5 us and NCCL and PCIe-IPC 50 us."""
    from sglang_sm120.machine.cache import host_fingerprint
    from sglang_sm120.machine.facts import load_profile
    from sglang_sm120.planning.tuning import Measurement, TuningTable, save_table

    rows = [Measurement(winner, t, 5.0, True) for t in (4, 64)]
    rows += [Measurement(b, t, 50.0, True) for b in ("nccl", "pcie_ipc") for t in (4, 64)]
    fingerprint = host_fingerprint(load_profile("rtx-pro-6000-x8-pcie"), 8)
    os.environ["SGLANG_SM120_CACHE_DIR"] = str(directory)
    try:
        save_table(TuningTable(fingerprint, 8, 7168, "bfloat16", tuple(rows)))
    finally:
        del os.environ["SGLANG_SM120_CACHE_DIR"]


def test_auto_flag_follows_the_tuning_table(model_dirs, tmp_path):
    """TP8, where the default is fusion off: a table in which trtllm wins every size turns it on."""
    plant_table(tmp_path, "trtllm")
    launched = resolve_in_launcher(
        model_dirs["KimiK25ForConditionalGeneration"],
        8,
        server_args={"flashinfer_allreduce_fusion_backend": "auto"},
        env={"SGLANG_SM120_CACHE_DIR": str(tmp_path)},
    )
    assert launched["fusion_backend"]["8"] == "trtllm"
    reasons = json.loads(launched["launch_plan"]["8"])["plan"]["reasons"]
    assert any("fusion trtllm from the tuning table" in r for r in reasons), reasons


@pytest.mark.parametrize(
    ("server_args", "turned_on"),
    [({}, True), ({"enable_symm_mem": True}, False)],
    ids=["table wins", "user chose NCCL symmetric memory"],
)
def test_a_tuning_table_where_mscclpp_wins_turns_mscclpp_on_in_the_worker_unless_the_user_chose(
    model_dirs, tmp_path, server_args, turned_on
):
    """Launcher and worker against the real sglang: the launcher's plan lists the switch, and
    in the worker upstream's own ``bootstrap._set_all_reduce_flags`` (which reads the user's
    ``enable_mscclpp``, off) leaves MSCCL++ on for the groups it builds. ``--enable-symm-mem``
    sends plain all-reduces to NCCL first: then the plan switches nothing on."""
    plant_table(tmp_path, "mscclpp")
    result = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"],
        8,
        server_args=server_args,
        env={"SGLANG_SM120_CACHE_DIR": str(tmp_path)},
    )
    plan = json.loads(result["launch_plan"]["8"])["plan"]
    assert plan["upstream_switches"] == (["enable_mscclpp"] if turned_on else [])
    assert result["upstream_switches"]["8"] == {
        "enable_mscclpp": turned_on,
        "enable_torch_symm_mem": False,
    }
    assert result["patches"]["upstream_switches"] == "applied"
