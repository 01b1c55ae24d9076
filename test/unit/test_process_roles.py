"""Each SGLang process registers only the patches that run in it: resolving a hook target
imports its module, and the worker modules (graph runners, FlashInfer fusion) cost the launcher
and the detokenizer seconds they would otherwise not spend. Checked in fresh processes that
import what SGLang's own entry points import before ``load_plugins()``."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest
from child_report import run_child
from sglang_sm120.server.runtime import ROLE_ENTRIES

PROBE = """
import json, sys, importlib
importlib.import_module(sys.argv[1])
before = set(sys.modules)
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
from sglang_sm120.server.runtime import PATCH_STATUS
ours = sorted(t for t, hooks in HookRegistry._hooks.items()
              if any(getattr(h, "__module__", "").startswith("sglang_sm120") for _, h, _ in hooks))
print("PROBE " + json.dumps({"patches": PATCH_STATUS, "hooked": ours,
                             "new_sglang_modules": sorted(m for m in set(sys.modules) - before
                                                          if m.startswith("sglang."))}))
"""
WORKER_MODULES = (
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
    "sglang.srt.layers.flashinfer_comm_fusion",
    "sglang.srt.managers.scheduler",
)


def probe(entry_module: str) -> dict:
    env = {**os.environ, "SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie"}
    env.pop("SGLANG_SM120_DISABLE", None)
    return run_child([sys.executable, "-c", PROBE, entry_module], env, "PROBE")[0]


@pytest.mark.parametrize("entry", ["sglang.launch_server", "sglang.cli.serve"])
def test_launcher_imports_no_worker_module(entry):
    result = probe(entry)
    assert not set(WORKER_MODULES) & set(result["new_sglang_modules"])
    assert result["hooked"] == [
        "sglang.srt.arg_groups.overrides._flashinfer_allreduce_fusion_auto_enable",
        "sglang.srt.utils.common.configure_logger",
    ]
    assert result["patches"]["pcie_ipc_enable"] == "not used in the launcher"


def test_detokenizer_registers_nothing():
    result = probe("sglang.srt.managers.detokenizer_manager")
    assert result["hooked"] == []
    assert set(result["patches"].values()) == {"not used in the detokenizer"}


def test_scheduler_process_registers_the_worker_seams():
    result = probe("sglang.srt.managers.scheduler")
    assert "sglang.srt.layers.flashinfer_comm_fusion._resolve_backend" in result["hooked"]
    assert result["patches"]["pcie_ipc_enable"] == "registered"  # checked once logging is up


# --- processes that spawn schedulers plan for them, whatever they inherited ---------------------

REHEARSAL = Path(__file__).with_name("spawner_rehearsal.py")
KIMI = "KimiK25ForConditionalGeneration"
STALE_PLAN = {
    "tp_size": 8,
    "gpu_ids": list(range(8)),
    "capability": {
        "sm12x": True,
        "fusion_capable": True,
        "pcie_ipc_capable": True,
        "reasons": ["a stale capability from another launch"],
        "validation": False,
    },
    "plan": {
        "managed": True,
        "fusion_backend": "sm120_pcie",
        "plain_allreduce": "nccl",
        "reasons": ["a stale plan from another launch"],
        "routes": [],
    },
}


def rehearse_spawner(
    phase: str,
    model_dir: Path,
    tp: int,
    dp: int,
    tmp_path: Path,
    server_args: dict | None = None,
    **script: str,
):
    env = {
        **script,
        "REHEARSAL_SERVER_ARGS": json.dumps(server_args or {}),
        **os.environ,
        "SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie",
        "SGLANG_SM120_LAUNCH_PLAN": json.dumps(STALE_PLAN),
        "REHEARSAL_STALE_PLAN": json.dumps(STALE_PLAN),
        "REHEARSAL_DIR": str(tmp_path),
        "REHEARSAL_SM120": "1",
    }
    for name in ("SGLANG_SM120_DISABLE", "SGLANG_SM120_FUSION_BACKEND"):
        env.pop(name, None)
    argv = [sys.executable, str(REHEARSAL), phase, str(model_dir), str(tp), str(dp)]
    return run_child(argv, env, "REHEARSAL", timeout=400)


def status_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "sglang-sm120 0.5.23.1 (" in line]


def test_an_engine_process_is_named_and_hands_its_children_a_fresh_plan(model_dirs, tmp_path):
    result, log = rehearse_spawner("engine", model_dirs[KIMI], 2, 1, tmp_path)
    assert [line for line in status_lines(log) if "(Engine)" in line], log[-3000:]
    assert not [line for line in status_lines(log) if "(TP worker)" in line], log[-3000:]
    plans = [json.loads(child["launch_plan"]) for child in result["children"]]
    assert len(plans) == 2, result
    for plan in plans:
        assert plan["tp_size"] == 2 and plan["gpu_ids"] == [0, 1]
        assert plan["plan"]["fusion_backend"] == "trtllm"  # TP2's default, not the stale plan's
        assert "a stale plan from another launch" not in plan["plan"]["reasons"]


def test_an_engine_in_a_spawned_child_of_a_script_loading_plugins_plans(model_dirs, tmp_path):
    """The script loads plugins at module level and runs the Engine in a child it spawns: the
    child loads plugins while bootstrapping, before Engine.__init__ is on its stack, and must
    still register the Engine's seams and hand the schedulers a fresh plan."""
    result, log = rehearse_spawner(
        "engine_in_child", model_dirs[KIMI], 2, 1, tmp_path, REHEARSAL_LOAD_AT_IMPORT="1"
    )
    assert [line for line in status_lines(log) if "(Engine)" in line], log[-3000:]
    plans = [json.loads(child["launch_plan"] or "null") for child in result["children"]]
    assert len(plans) == 2, result
    for plan in plans:
        assert plan is not None, log[-3000:]
        assert plan["tp_size"] == 2 and plan["plan"]["fusion_backend"] == "trtllm"


def test_a_scheduler_function_loading_plugins_itself_is_a_tp_worker(model_dirs, tmp_path):
    """A fork's run_scheduler_process_func that calls load_plugins() before SGLang's scheduler
    does, in a script that imported the Engine: the child's modules say "engine", yet it is a
    TP worker and follows the plan its Engine published."""
    result, log = rehearse_spawner(
        "engine", model_dirs[KIMI], 2, 1, tmp_path, REHEARSAL_SCHEDULER="load_plugins_then_report"
    )
    assert len(result["children"]) == 2, result
    for child in result["children"]:
        assert child["role"] == "scheduler", (child, log[-3000:])
        assert child["patches"]["resolve_backend"] == "registered"
        assert json.loads(child["launch_plan"])["plan"]["fusion_backend"] == "trtllm"


def test_a_direct_launch_server_caller_plans_for_its_children(model_dirs, tmp_path):
    """http_server.launch_server resolves the server args before it loads plugins: the plan is
    made right before the schedulers are spawned, from those server args (here fusion off by
    the user's switch, so server args and plan agree)."""
    switch = {"enforce_disable_flashinfer_allreduce_fusion": True}
    result, log = rehearse_spawner("http_server", model_dirs[KIMI], 2, 1, tmp_path, switch)
    assert [line for line in status_lines(log) if "(Engine)" in line], log[-3000:]
    plans = [json.loads(child["launch_plan"]) for child in result["children"]]
    assert len(plans) == 2, result
    for plan in plans:
        assert plan["tp_size"] == 2 and plan["plan"]["fusion_backend"] is None
        reasons = plan["plan"]["reasons"]
        assert "fusion off: --enforce-disable-flashinfer-allreduce-fusion" in reasons


def test_a_dp_controller_is_named_and_hands_its_children_a_fresh_plan(model_dirs, tmp_path):
    result, log = rehearse_spawner("dp_controller", model_dirs[KIMI], 2, 2, tmp_path)
    assert [line for line in status_lines(log) if "(DP controller)" in line], log[-3000:]
    plans = [json.loads(child["launch_plan"]) for child in result["children"]]
    assert len(plans) == 4, (result, log[-3000:])
    launcher_plan = json.loads(result["launcher_plan"])
    assert launcher_plan["gpu_ids"] == [0, 1, 2, 3]  # both replicas' GPUs
    for plan in plans:
        assert plan == launcher_plan  # planned afresh from the same server args: the same plan


@pytest.mark.parametrize(("module", "qualname", "role"), ROLE_ENTRIES)
def test_each_role_entry_is_an_sglang_function_that_loads_plugins(module, qualname, role):
    """The role is read from the SGLang function that called load_plugins(): each row must
    still name one that does."""
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    assert fn.__code__.co_qualname == qualname
    assert "load_plugins" in fn.__code__.co_names, f"{module}.{qualname} no longer loads plugins"


SPAWNING_SCRIPT = """
from sglang.srt.plugins import load_plugins

load_plugins()  # at module level: each spawned child re-imports this __main__ and runs it too


def report():
    import json, os
    from sglang_sm120.server.runtime import PATCH_STATUS, process_role

    print("CHILD " + json.dumps({"role": process_role(), "patches": PATCH_STATUS,
                                 "launch_plan": os.environ.get("SGLANG_SM120_LAUNCH_PLAN")}))


if __name__ == "__main__":
    import multiprocessing as mp, os

    os.environ["SGLANG_SM120_LAUNCH_PLAN"] = "the parent's plan"
    child = mp.get_context("spawn").Process(target=report)
    child.start()
    child.join()
"""


def test_a_spawned_child_reimporting_main_keeps_its_parents_plan(tmp_path):
    """A module-level load_plugins() in the parent's __main__ runs in every child that
    multiprocessing spawns, before the child knows what it runs: it must neither pass for a
    launcher (which would drop the parent's plan) nor skip the worker seams a scheduler needs."""
    script = tmp_path / "user_script.py"
    script.write_text(SPAWNING_SCRIPT)
    env = {**os.environ, "SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie"}
    env.pop("SGLANG_SM120_DISABLE", None)
    child = run_child([sys.executable, str(script)], env, "CHILD")[0]
    assert child["role"] == "bootstrapping"
    assert child["launch_plan"] == "the parent's plan"
    assert child["patches"]["resolve_backend"] == "registered"  # a scheduler's seams
    assert child["patches"]["dp_controller_launch_plan"] == "registered"


@pytest.mark.parametrize("role", ["launcher", "engine", "dp_controller"])
def test_a_spawner_drops_an_inherited_scheduler_function_name(role, monkeypatch):
    """A spawner names the scheduler function of its own children; one it inherited is
    another launch's (review finding)."""
    from sglang_sm120.server import plugin, runtime

    monkeypatch.setenv(runtime.SCHEDULER_ENTRY_ENV, "some_script:my_scheduler")
    monkeypatch.setenv(plugin.DISABLE_ENV, "1")  # registers nothing; the drop comes first
    plugin.register_patches(role)
    assert runtime.SCHEDULER_ENTRY_ENV not in os.environ
