"""Each SGLang process registers only the patches that run in it: resolving a hook target
imports its module, and the worker modules (graph runners, FlashInfer fusion) cost the launcher
and the detokenizer seconds they would otherwise not spend. Checked in fresh processes that
import what SGLang's own entry points import before ``load_plugins()``."""

from __future__ import annotations

import os
import sys

import pytest
from child_report import run_child

PROBE = """
import json, sys, importlib
importlib.import_module(sys.argv[1])
before = set(sys.modules)
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
from sglang_sm120.runtime import PATCH_STATUS
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
