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
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_library import expected_sm120_pcie_status, require_kernel_package
from sglang_sm120.patches import PATCHES, patch_name

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
BEHAVIOUR_PATCHES = ALL_PATCHES - {"graph_stats"}


def run_scenario(
    model_dir: Path,
    *tps: int,
    profile: str = "rtx-pro-6000-x8-pcie",
    server_args: dict | None = None,
    env: dict | None = None,
) -> dict:
    full_env = {
        **os.environ,
        "SGLANG_SM120_TOPOLOGY": profile,
        "SCENARIO_SERVER_ARGS": json.dumps(server_args or {}),
    }
    full_env.pop("SGLANG_SM120_DISABLE", None)
    full_env.pop("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", None)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, str(SCENARIO), str(model_dir), *map(str, tps)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("SCENARIO ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("SCENARIO "))
    result["log"] = proc.stderr
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


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"])
def test_pcie_x8_profile_gets_planned_backends(model_dirs, arch):
    result = run_scenario(model_dirs[arch], 2, 4, 8)
    assert {n: s for n, s in result["patches"].items() if n in BEHAVIOUR_PATCHES} == {
        **{name: "applied" for name in BEHAVIOUR_PATCHES},
        "sm120_pcie_backend": expected_sm120_pcie_status(),
    }
    assert result["patches"]["graph_stats"] == "not needed (SGLANG_SM120_STATS_DIR unset)"
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
    assert result["log"].count("sglang-sm120 0.5.23.1: 8x NVIDIA RTX PRO 6000") == 1
    assert (
        "sglang-sm120 plan (server args, tp=8): fusion=off, plain all-reduce=pcie_ipc"
        in result["log"]
    )


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
        env={"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "1"},
    )
    assert result["fusion_backend"] == {"2": None}
    assert result["pcie_ipc_eligible"] == {"2": False}
    assert "no P2P" in result["resolve"]["trtllm"]
    for name in ("fusion_applies", "workspace_preflight", "allreduce_precedence"):
        assert result["patches"][name].startswith("not needed (no P2P between GPUs 0-1")
    assert "--flashinfer-allreduce-fusion-backend trtllm refused" in result["log"]
    assert "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 refused" in result["log"]


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


def test_stats_instrumentation_applies_on_request(model_dirs, tmp_path):
    result = run_scenario(
        model_dirs["DeepseekV3ForCausalLM"], 2, env={"SGLANG_SM120_STATS_DIR": str(tmp_path)}
    )
    assert result["patches"]["graph_stats"] == "applied"


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


def test_sm120_pcie_refused_without_p2p(model_dirs):
    result = run_scenario(
        model_dirs["KimiK25ForConditionalGeneration"],
        2,
        profile="rtx-5090-x2-nop2p",
        env={"SGLANG_SM120_FUSION_BACKEND": "sm120_pcie"},
    )
    assert result["fusion_backend"] == {"2": None}
    assert result["patches"]["sm120_pcie_backend"].startswith("not needed (no P2P")
