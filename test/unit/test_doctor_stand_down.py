"""When the plugin applies nothing, doctor's plan is upstream's: ``managed=False``, "upstream
decides: <why>", and the all-reduce options judged for upstream's behaviour. One test per cause
(kill switch, another sglang version, a contract mismatch, a patch target that does not import),
each from the statuses the real loader records against the installed sglang; and, where an
sglang 0.5.22 wheel or tree is given (``SGLANG_SM120_PREVIOUS_SGLANG``), doctor itself on it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from sglang_sm120.commands.doctor import plan_in_force
from sglang_sm120.machine.facts import load_profile
from sglang_sm120.planning.levers import allreduce_levers
from sglang_sm120.planning.policy import Deployment, plan_allreduce, upstream_decides
from sglang_sm120.planning.upstream import FUSION_ARCHS
from sglang_sm120.server import plugin
from sglang_sm120.version import SGLANG_PIN, __version__

KIMI = "KimiK25ForConditionalGeneration"
PROFILE = "rtx-pro-6000-x8-pcie"
PREVIOUS_ENV = "SGLANG_SM120_PREVIOUS_SGLANG"
BOTH = {"launcher": "launcher", "TP worker": "scheduler"}
# A worker-side symbol: the launcher checks only its own patches' contract and would apply
# them (registering real hooks in this process), so these causes are judged by the worker.
WORKER = {"TP worker": "scheduler"}
INSTALLED = metadata.version("sglang")


def doctors_view(roles: dict[str, str]) -> tuple:
    """The statuses each process of ``roles`` (doctor's name -> role) records, merged as doctor
    merges them (each patch as the process that uses it reports it), then doctor's plan and
    all-reduce options."""
    by_process = {process: plugin.register_patches(role) for process, role in roles.items()}
    statuses = {}
    for name in next(iter(by_process.values())):
        seen = [s[name] for s in by_process.values()]
        statuses[name] = next((s for s in seen if not s.startswith("not used in")), seen[0])
    facts, d = load_profile(PROFILE), Deployment(tp_size=8, model_arch=KIMI)
    plugin_plan = plan_allreduce(facts, d, FUSION_ARCHS)
    assert plugin_plan.managed and plugin_plan.plain_allreduce == "pcie_ipc"  # what it would do
    plan = plan_in_force(plugin_plan, statuses, by_process)
    levers = {row.switch: row for row in allreduce_levers(facts, d, plan, FUSION_ARCHS, None)}
    return plan, levers


def assert_upstream_decides(plan, levers, why: str) -> None:
    assert not plan.managed and plan.plain_allreduce == "upstream" and plan.fusion_backend is None
    assert plan.reasons[0].startswith("upstream decides: ") and why in plan.reasons[0], plan.reasons
    pcie_ipc = levers["SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"]
    assert (pcie_ipc.can_run, pcie_ipc.used) == (None, None)
    assert "upstream's default (off); the plugin applies nothing here" == pcie_ipc.why
    fusion = levers["--flashinfer-allreduce-fusion-backend"]
    assert fusion.used is False and "raises ValueError for SM12x" in fusion.if_set
    custom = levers["--disable-custom-all-reduce"]
    assert "upstream's own choice (the plugin applies nothing here)" in custom.if_set


def test_the_kill_switch_leaves_the_plan_to_upstream(pcie_host, monkeypatch):
    monkeypatch.setenv("SGLANG_SM120_DISABLE", "1")
    assert_upstream_decides(*doctors_view(BOTH), "the kill switch SGLANG_SM120_DISABLE=1 is on")


def test_another_sglang_version_leaves_the_plan_to_upstream(pcie_host, monkeypatch):
    monkeypatch.setattr(plugin, "SGLANG_PIN", "0.5.99")  # as if the installed were another
    why = f"sglang {INSTALLED} installed, sglang-sm120 {__version__} supports 0.5.99 only"
    assert_upstream_decides(*doctors_view(BOTH), why)


def test_a_contract_mismatch_leaves_the_plan_to_upstream(pcie_host, monkeypatch):
    from sglang.srt.distributed.device_communicators import pcie_ipc_ar

    def eligible_group(*, group_name, world_size):  # upstream dropped a parameter
        return False

    monkeypatch.setattr(pcie_ipc_ar, "eligible_group", eligible_group)
    plan, levers = doctors_view(WORKER)
    assert_upstream_decides(plan, levers, f"upstream contract mismatch with sglang {INSTALLED}")


def test_a_patch_target_that_does_not_import_leaves_the_plan_to_upstream(pcie_host, monkeypatch):
    import sglang.srt.layers
    from sglang.srt.layers import flashinfer_comm_fusion  # noqa: F401  (so delattr has a target)

    monkeypatch.setitem(sys.modules, "sglang.srt.layers.flashinfer_comm_fusion", None)
    monkeypatch.delattr(sglang.srt.layers, "flashinfer_comm_fusion")
    plan, levers = doctors_view(WORKER)
    assert_upstream_decides(plan, levers, "sglang.srt.layers.flashinfer_comm_fusion")
    assert "not found (" in plan.reasons[0]


def test_a_plan_with_an_applied_patch_in_each_process_stays_in_force():
    facts, d = load_profile(PROFILE), Deployment(tp_size=8, model_arch=KIMI)
    plan = plan_allreduce(facts, d, FUSION_ARCHS)
    launcher = {"status_line": "applied", "pcie_ipc_enable": "not used in the launcher"}
    worker = {"status_line": "applied", "sm120_pcie_backend": "refused (no kernel library)"}
    statuses = {**launcher, **worker}
    assert plan_in_force(plan, statuses, {"launcher": launcher, "TP worker": worker}) is plan
    idle = {"status_line": "not needed (no SM12x GPU)"}
    assert plan_in_force(plan, idle, {"launcher": idle}) is plan


def test_a_tp_worker_that_applies_nothing_takes_the_plan_out_of_force():
    """The launcher checks only its own patches' symbols: where a worker-side one moved, the
    launcher applies its part and the worker nothing, and no route of the plan runs."""
    facts, d = load_profile(PROFILE), Deployment(tp_size=8, model_arch=KIMI)
    plan = plan_allreduce(facts, d, FUSION_ARCHS)
    launcher = {"status_line": "applied", "pcie_ipc_enable": "not used in the launcher"}
    worker = {"status_line": "refused (upstream contract mismatch with sglang X: moved)"}
    in_force = plan_in_force(
        plan,
        {**launcher, "pcie_ipc_enable": worker["status_line"]},
        {
            "launcher": launcher,
            "TP worker": worker,
        },
    )
    assert not in_force.managed
    assert in_force.reasons == (
        "upstream decides: upstream contract mismatch with sglang X: moved (in the TP worker)",
    )


def _previous_sglang(tmp_path: Path) -> Path:
    """The directory holding an sglang 0.5.22 package: the tree or the unpacked wheel that
    ``SGLANG_SM120_PREVIOUS_SGLANG`` names (`pip download sglang==0.5.22 --no-deps`);
    the upstream canary sets it, a plain test run skips."""
    given = os.environ.get(PREVIOUS_ENV)
    if not given:
        pytest.skip(f"{PREVIOUS_ENV} names no sglang 0.5.22 wheel or tree (the canary sets it)")
    path = Path(given)
    if path.is_file():
        with zipfile.ZipFile(path) as wheel:
            wheel.extractall(tmp_path / "sglang-previous")
        path = tmp_path / "sglang-previous"
    if not (path / "sglang" / "__init__.py").is_file():  # named, but wrong: fail, never skip
        pytest.fail(f"{PREVIOUS_ENV}={given} holds no sglang package")
    return path


def test_doctor_on_a_real_previous_sglang_shows_upstream_decides(tmp_path):
    """The user's case: sglang 0.5.22 importable instead of 0.5.23, an 8x SM120 PCIe host."""
    root = _previous_sglang(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_SM120_")}
    env.update(
        PYTHONPATH=str(root),
        SGLANG_SM120_TOPOLOGY=PROFILE,
        SGLANG_SM120_CACHE_DIR=str(tmp_path / "cache"),
    )
    command = [sys.executable, "-P", "-m", "sglang_sm120.commands.cli", "doctor", "--json"]
    proc = subprocess.run(
        [*command, "--tp", "8", "--model-arch", KIMI],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["versions"]["sglang"] != SGLANG_PIN, report["versions"]
    plan = report["plan"]
    assert plan["managed"] is False and plan["plain_allreduce"] == "upstream", plan
    assert plan["reasons"][0].startswith("upstream decides: sglang "), plan["reasons"]
    assert report["plan_not_in_force"]["plain_allreduce"] == "pcie_ipc"
    assert report["patches"]["engine_launch_plan"].startswith("not checked in the Engine")
    options = {row["switch"]: row for row in report["allreduce_options"]}
    assert options["SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"]["used"] is None


def _fusion_advice(installed: str | None) -> tuple[str, str]:
    """The fusion-backend option's why and if-set, for a plan left to upstream, on the 8x RTX
    PRO 6000 profile with ``installed`` as the sglang the host reports."""
    facts = dataclasses.replace(load_profile(PROFILE), versions={"sglang": installed})
    plan = upstream_decides(f"sglang {installed} installed, sglang-sm120 supports {SGLANG_PIN}")
    d = Deployment(tp_size=8, model_arch=KIMI)
    rows = {row.switch: row for row in allreduce_levers(facts, d, plan, FUSION_ARCHS, None)}
    fusion = rows["--flashinfer-allreduce-fusion-backend"]
    return fusion.why, fusion.if_set


def test_with_another_sglang_the_fusion_advice_says_whose_behaviour_it_states():
    """What the options say of upstream's fusion is the pinned sglang's behaviour (the copied
    tables are proven equal to it only): with another sglang installed, doctor says so instead
    of stating it as that version's."""
    why, if_set = _fusion_advice("0.5.22")
    qualifier = f"sglang {SGLANG_PIN}'s behaviour; sglang 0.5.22 is installed, not checked"
    assert qualifier in why and qualifier in if_set, (why, if_set)
    why, if_set = _fusion_advice(SGLANG_PIN)
    assert "not checked" not in why + if_set and "raises ValueError for SM12x" in if_set
