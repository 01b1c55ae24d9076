"""``sglang-sm120 plan`` and ``doctor`` as a user runs them: a subprocess, JSON parsed."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from kernel_library import expected_sm120_pcie_status, require_kernel_package
from sglang_sm120.version import SGLANG_PIN

KIMI = "KimiK25ForConditionalGeneration"
SESSION_CACHE = tempfile.mkdtemp(prefix="sglang-sm120-test-cache-")
atexit.register(shutil.rmtree, SESSION_CACHE, ignore_errors=True)


def run_cli(
    *args: str, env: dict | None = None, timeout: float = 300, preexec_fn=None
) -> subprocess.CompletedProcess:
    exe = shutil.which("sglang-sm120", path=os.path.dirname(sys.executable)) or shutil.which(
        "sglang-sm120"
    )
    assert exe, "the sglang-sm120 console script is not installed"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_SM120_")}
    # not the user's cache: one for this test session, where a doctor reuses the plugin checks
    # of an earlier one whose key (code, facts, environment) was the same
    full_env["SGLANG_SM120_CACHE_DIR"] = SESSION_CACHE
    full_env.update(env or {})
    return subprocess.run(
        [exe, *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )


def plan_json(*args: str) -> dict:
    proc = run_cli("plan", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_plan_tp8_pcie_turns_pcie_ipc_on_with_reasons():
    plan = plan_json("--profile", "rtx-pro-6000-x8-pcie", "--tp", "8", "--model-arch", KIMI)
    assert plan["tp"] == 8
    assert plan["plain_allreduce"] == "pcie_ipc" and plan["fusion_backend"] is None
    assert any("PCIe-IPC" in r for r in plan["reasons"]) and any(
        "#32330" in r for r in plan["reasons"]
    )


def test_plan_tp2_pcie_turns_trtllm_fusion_on():
    plan = plan_json("--profile", "rtx-pro-6000-x8-pcie", "--tp", "2", "--model-arch", KIMI)
    assert plan["fusion_backend"] == "trtllm" and plan["plain_allreduce"] == "pcie_ipc"


def test_plan_no_p2p_falls_back_to_nccl_with_reason():
    plan = plan_json("--profile", "rtx-5090-x2-nop2p", "--tp", "2", "--model-arch", KIMI)
    assert plan["fusion_backend"] is None and plan["plain_allreduce"] == "nccl"
    assert any("no P2P between GPUs 0-1" in r for r in plan["reasons"])


def test_plan_reads_a_topology_file(tmp_path):
    topo = {"gpus": [{"name": "NVIDIA RTX PRO 6000", "capability": [12, 0]}] * 4, "p2p": "all"}
    path = tmp_path / "box.json"
    path.write_text(json.dumps(topo))
    plan = plan_json("--topology", str(path), "--tp", "4", "--model-arch", KIMI)
    assert plan["plain_allreduce"] == "pcie_ipc" and plan["facts_source"] == f"file:{path}"


def test_version_names_the_plugin_the_pinned_sglang_and_the_kernel():
    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        "sglang-sm120 0.5.23.1: sglang 0.5.23 (pinned 0.5.23), "
        f"sgl-kernel-sm120 {_installed('sgl-kernel-sm120')} (pinned 0.5.23.1)"
    )


def _installed(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def test_profiles_lists_each_profile_with_its_description():
    from sglang_sm120.machine.facts import profile_names

    proc = run_cli("profiles")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == profile_names()
    assert any("2x GeForce RTX 5090 (SM120, 32 GB) on PCIe without P2P" in x for x in lines)


def test_doctor_json_without_gpu_exits_zero_and_says_so():
    proc = run_cli("doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    if report["gpu_present"]:
        pytest.skip("this machine has a GPU; the no-GPU report is checked on CPU CI")
    assert report["entry_point_discovered"] is True
    assert report["contract_problems"] == []
    assert all(s.startswith("not needed (") for s in report["patches"].values())
    assert report["versions"]["sglang"] == SGLANG_PIN
    checks = {c["name"]: c for c in report["host_checks"]}
    assert list(checks) == [
        "iommu",
        "acs",
        "p2p_driver",
        "pcie_link",
        "bar1",
        "topology",
        "persistence",
    ]
    for name in ("pcie_link", "bar1", "topology", "persistence"):
        assert checks[name]["status"] == "unknown" and checks[name]["detail"].startswith("no GPU")
        assert checks[name]["evidence"].startswith("nvmlDeviceGet")
    assert all(set(c) >= {"name", "status", "detail", "fix", "evidence"} for c in checks.values())
    assert report["p2p_probe"] == {"note": "no p2p probe: fewer than 2 GPUs, no peers to measure"}


def test_doctor_on_a_profiled_host_shows_applied_patches_and_plan():
    proc = run_cli(
        "doctor",
        "--json",
        "--tp",
        "8",
        "--model-arch",
        KIMI,
        env={"SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie"},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    stats = report["patches"].pop("graph_stats")
    assert report["patches"].pop("sm120_pcie_backend") == expected_sm120_pcie_status()
    assert report["patches"].pop("engine_launch_plan") == (
        "needed in the Engine (doctor starts no such process)"
    )
    assert report["patches"].pop("dp_controller_launch_plan") == (
        "needed in the DP controller (doctor starts no such process)"
    )
    # doctor's worker check starts with no launch plan: the status is what a launched worker
    # would do with this environment (here: no tuning table)
    assert report["patches"].pop("nccl_tuned_env") == (
        "not needed (nccl env: none (no tuning table))"
    )
    assert report["patches_by_process"]["TP worker"]["nccl_tuned_env"] == (
        "not needed (nccl env: none (no plan from the launcher))"
    )
    assert report["nccl_env"] == {
        "tuned": {},
        "set": {},
        "why": "nccl env: none (no tuning table)",
    }
    assert set(report["patches"].values()) == {"applied"}
    assert stats == "not needed (SGLANG_SM120_STATS_DIR unset)"
    assert report["plan"]["plain_allreduce"] == "pcie_ipc"
    assert len(report["facts"]["gpus"]) == 8 and report["facts"]["has_nvlink"] is False


def test_doctor_shows_a_kernel_library_that_does_not_load_and_plans_without_it():
    broken = "/nonexistent/libsgl_kernel_sm120.so"
    env = {
        "SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie",
        "SGLANG_SM120_FUSION_BACKEND": "sm120_pcie",
        "SGLANG_SM120_KERNEL_LIBRARY": broken,
    }
    proc = run_cli("doctor", "--tp", "8", "--model-arch", KIMI, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    library = [line for line in lines if line.startswith("  sgl-kernel-sm120 library: ")]
    assert len(library) == 1 and "does not load" in library[0] and broken in library[0]
    backend = [line.split(None, 1)[1] for line in lines if "sm120_pcie_backend " in line]
    assert backend[0].startswith("not needed (sgl-kernel-sm120") and broken in backend[0]
    assert "plan for tp=8: fusion_backend=off  plain_allreduce=pcie_ipc" in proc.stdout
    assert "requested sm120_pcie refused" in proc.stdout


def test_doctor_text_shows_p2p_matrix_and_kill_switch_state():
    proc = run_cli(
        "doctor", env={"SGLANG_SM120_TOPOLOGY": "rtx-5090-x2-nop2p", "SGLANG_SM120_DISABLE": "1"}
    )
    assert proc.returncode == 0, proc.stderr
    assert "GPU0   -  N" in proc.stdout and "disabled (SGLANG_SM120_DISABLE=1)" in proc.stdout
    assert "kill switch SGLANG_SM120_DISABLE=1: the plugin applies nothing" in proc.stdout
    assert "plain_allreduce=upstream  managed=False" in proc.stdout
    assert "upstream decides: the kill switch SGLANG_SM120_DISABLE=1 is on" in proc.stdout


def test_doctor_checks_kernel_images_for_a_given_capability():
    proc = run_cli("doctor", "--json", "--capability", "12.0")
    assert proc.returncode == 0, proc.stderr
    images = json.loads(proc.stdout)["kernel_images"]
    assert images["capability"] == [12, 0]
    required = [row for row in images["libraries"] if row["required"]]
    assert required and all(row["ok"] for row in required), required
    assert all(not row["ok"] for row in images["missing"])


def test_warmup_dry_run_lists_its_steps_and_builds_nothing():
    proc = run_cli("warmup", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 4 and all("skipped: dry run" in line for line in lines[:3])
    assert lines[3].endswith("0.0s  3 skipped")


def test_doctor_shows_the_tuning_table_in_use_and_its_routes(tmp_path, monkeypatch):
    from sglang_sm120.machine.cache import host_fingerprint
    from sglang_sm120.machine.facts import load_profile
    from sglang_sm120.planning.tuning import Measurement, TuningTable, save_table

    require_kernel_package()  # the routes use sm120_pcie, which needs the kernel
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(tmp_path))
    ms = (
        Measurement("sm120_pcie", 16, 9.0, True),
        Measurement("nccl", 16, 210.0, True),
        Measurement("sm120_pcie", 2048, 900.0, True),
        Measurement("nccl", 2048, 700.0, True),
    )
    fingerprint = host_fingerprint(load_profile("rtx-pro-6000-x8-pcie"), 8)
    save_table(TuningTable(fingerprint, 8, 7168, "bfloat16", ms))
    env = {"SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie", "SGLANG_SM120_CACHE_DIR": str(tmp_path)}
    proc = run_cli("doctor", "--json", "--tp", "8", "--model-arch", KIMI, env=env)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)["plan"]
    assert plan["fusion_backend"] == "sm120_pcie"
    assert plan["routes"] == [[1, 16, "sm120_pcie"], [17, 2048, "nccl"]]
    text = run_cli("doctor", "--tp", "8", "--model-arch", KIMI, env=env).stdout
    assert " 1-16 -> sm120_pcie" in text and " 17-2048 -> nccl" in text


def test_doctor_says_when_there_is_no_tuning_table(tmp_path):
    env = {"SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie", "SGLANG_SM120_CACHE_DIR": str(tmp_path)}
    proc = run_cli("doctor", "--json", "--tp", "8", "--model-arch", KIMI, env=env)
    reasons = json.loads(proc.stdout)["plan"]["reasons"]
    assert any("no tuning table" in r and "sglang-sm120 tune --tp 8" in r for r in reasons)


def test_doctor_in_validation_mode_manages_an_sm90_host_and_says_so():
    env = {"SGLANG_SM120_TOPOLOGY": "h200-x8-nvlink", "SGLANG_SM120_ANY_ARCH": "1"}
    proc = run_cli("doctor", "--json", "--tp", "2", "--model-arch", KIMI, env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["validation_mode"] is True
    assert report["plan"]["managed"] is True and report["plan"]["fusion_backend"] == "trtllm"
    assert "validation mode (SGLANG_SM120_ANY_ARCH=1)" in report["plan"]["reasons"][0]
    assert report["patches"]["resolve_backend"] == "applied"
    text = run_cli("doctor", "--tp", "2", "--model-arch", KIMI, env=env).stdout
    assert "VALIDATION MODE ON: validation mode (SGLANG_SM120_ANY_ARCH=1)" in text


def test_doctor_without_validation_mode_leaves_an_sm90_host_alone():
    env = {"SGLANG_SM120_TOPOLOGY": "h200-x8-nvlink"}
    report = json.loads(
        run_cli("doctor", "--json", "--tp", "2", "--model-arch", KIMI, env=env).stdout
    )
    assert report["validation_mode"] is False and report["plan"]["managed"] is False
    assert report["patches"]["resolve_backend"].startswith("not needed (8x NVIDIA H200 (SM90)")


def test_doctor_reads_a_host_dump_and_the_plan_cites_its_findings_with_the_fix():
    """A profile with SGLANG_SM120_SYSFS_ROOT naming that machine's sysfs dump: a host whose
    GPUs sit on root ports with the driver's default P2P mode plans NCCL and says why."""
    from fake_nvml import FIXTURES

    env = {
        "SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie",
        "SGLANG_SM120_SYSFS_ROOT": str(FIXTURES / "direct-staged"),
    }
    # --tp 2: the checks judge the TP group's GPUs, and the dump has two (0000:01/02:00.0)
    proc = run_cli("doctor", "--json", "--tp", "2", "--model-arch", KIMI, env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    checks = {c["name"]: c for c in report["host_checks"]}
    assert checks["p2p_driver"]["status"] == "fail" and "ForceP2P" in checks["p2p_driver"]["fix"]
    assert "no GPU (facts from profile:rtx-pro-6000-x8-pcie" in checks["bar1"]["detail"]
    assert checks["p2p_driver"]["gpus"] == [0, 1]
    assert report["host_checks_used_by_plan"] is True
    assert report["plan"]["plain_allreduce"] == "nccl"
    assert any(
        r.startswith("host p2p_driver:")
        and "IPC all-reduce kernels disfavoured: NCCL" in r
        and "(fix: options nvidia NVreg_RegistryDwords" in r
        for r in report["plan"]["reasons"]
    ), report["plan"]["reasons"]


def test_doctor_prints_the_host_checks_as_a_table_with_each_fix():
    from fake_nvml import FIXTURES

    env = {
        "SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie",
        "SGLANG_SM120_SYSFS_ROOT": str(FIXTURES / "acs-on"),
    }
    proc = run_cli("doctor", "--tp", "2", "--model-arch", KIMI, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("  acs "))
    assert lines[row].split()[:2] == ["acs", "FAIL"]
    assert lines[row + 1].strip().startswith("fix: disable ACS in the BIOS")
    assert lines[row + 2].strip().startswith("from: /sys/bus/pci/devices/<bridge>/config")
    assert "  CHECK        STATUS   DETAIL" in lines
    assert any("host acs:" in line and "PCIe-IPC (staged)" in line for line in lines)


def test_the_dtypes_doctor_and_plan_take_are_sglangs_own_but_auto():
    """--dtype names what SGLang's --dtype accepts; "auto" needs the model's config."""
    import argparse

    from sglang.srt.server_args import ServerArgs
    from sglang_sm120.commands.args import DTYPES

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    (action,) = [a for a in parser._actions if "--dtype" in a.option_strings]
    assert set(DTYPES) == set(action.choices) - {"auto"}


@pytest.mark.parametrize(("tp", "fusion"), [(2, "trtllm"), (8, None)])
def test_plan_with_fusion_backend_auto_follows_the_tp_default(tp, fusion):
    plan = plan_json(
        "--profile",
        "rtx-pro-6000-x8-pcie",
        "--tp",
        str(tp),
        "--model-arch",
        KIMI,
        "--fusion-backend",
        "auto",
    )
    assert plan["fusion_backend"] == fusion
    assert not any("requested" in r for r in plan["reasons"]), plan["reasons"]
    # the user who said auto is told the plan decided, not only "off by default"
    lead = "auto (the plan decides): fusion "
    assert any(r.startswith(lead) for r in plan["reasons"]), plan["reasons"]


def test_doctors_worker_check_reports_a_worker_that_cannot_load():
    """The TP-worker check runs in its own process; one that fails says why, in one line."""
    from sglang_sm120.commands.plugin_check import WorkerCheck

    failing = (
        "import sys\nsys.stderr.write('boom\\nImportError: no scheduler here\\n')\nsys.exit(1)"
    )
    with WorkerCheck(failing) as worker:
        statuses = worker.statuses()
    assert statuses == {
        "(worker)": "could not load the plugin as a TP worker would: ImportError: no scheduler here"
    }


def test_doctor_text_says_when_the_worker_check_could_not_run():
    """A failed worker check is a line of doctor's text, not only a JSON key: the worker's
    patches otherwise read "not used in the launcher" and look fine."""
    from sglang_sm120.commands.plugin_check import patch_lines

    why = "could not load the plugin as a TP worker would: ImportError: no scheduler"
    state = {
        "patches": {"resolve_backend": "not used in the launcher"},
        "patches_by_process": {
            "launcher": {"resolve_backend": "not used in the launcher"},
            "TP worker": {"(worker)": why},
        },
    }
    assert patch_lines(state) == [
        "patches:",
        "  resolve_backend        not used in the launcher",
        f"  TP worker: {why}",
    ]


def test_doctors_worker_check_is_always_stopped_and_reaped():
    """doctor leaving before it asked (an error, Ctrl-C) leaves no worker check behind."""
    import os

    from sglang_sm120.commands.plugin_check import WorkerCheck

    with pytest.raises(KeyboardInterrupt), WorkerCheck("import time\ntime.sleep(600)") as worker:
        raise KeyboardInterrupt
    assert worker.proc.returncode is not None  # killed and waited for: no zombie
    with pytest.raises(ProcessLookupError):
        os.kill(worker.proc.pid, 0)


def test_doctor_lists_every_variable_set_accepted_or_refused(tmp_path):
    """Issue 26.7: the server warns about SGLANG_SM120_TIMEOUT_MS=18446744073710 and uses 60 s;
    doctor says so too, in text and JSON, and creates no stats directory on the way."""
    env = {
        "SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie",
        "SGLANG_SM120_TIMEOUT_MS": "18446744073710",
        "SGLANG_SM120_STATS_DIR": "stats\x01dir",
        "SGLANG_SM120_E2E_STARTUP_S": "",  # empty counts as unset: not listed
    }
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_sm120.commands.cli", "doctor", "--json"],
        capture_output=True,
        text=True,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("SGLANG_SM120_")}, **env},
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {row["name"]: row for row in json.loads(proc.stdout)["variables"]}
    assert rows["SGLANG_SM120_TIMEOUT_MS"] == {
        "name": "SGLANG_SM120_TIMEOUT_MS",
        "value": "'18446744073710'",
        "status": "refused (SGLANG_SM120_TIMEOUT_MS='18446744073710' is above the bound 3600000)",
        "used": "60000 in a server",
    }
    assert rows["SGLANG_SM120_STATS_DIR"]["status"].startswith("refused (holds control")
    assert rows["SGLANG_SM120_TOPOLOGY"]["status"] == "accepted"
    assert "SGLANG_SM120_E2E_STARTUP_S" not in rows
    assert list(tmp_path.iterdir()) == []  # no directory named by the refused value


def test_plan_lists_every_upstream_all_reduce_switch_for_the_profile():
    plan = plan_json("--profile", "rtx-pro-6000-x8-pcie", "--tp", "8", "--model-arch", KIMI)
    options = {row["switch"]: row for row in plan["allreduce_options"]}
    assert len(options) == 9
    assert set(options["--enable-torch-symm-mem"]) == {"switch", "can_run", "used", "why", "if_set"}
    assert options["--enable-torch-symm-mem"]["can_run"] is False
    assert options["--enable-mscclpp"]["can_run"] is None  # another machine's packages
    text = run_cli("plan", "--profile", "rtx-pro-6000-x8-pcie", "--tp", "8").stdout
    assert "all-reduce options (SGLang's switches, judged for this launch):" in text
    assert (
        "  --enable-torch-symm-mem: cannot run, not used: not available: SGLang's size table "
        "has no SM12x entry and PCIe has no multicast; if set: no change: all-reduces stay on "
        "PCIe-IPC for decode/verify sizes, NCCL above"
    ) in text


def test_doctor_lists_the_all_reduce_options_and_warns_about_nccl_settings(tmp_path):
    """NCCL_P2P_DISABLE=1 in NCCL's config file, not the environment: doctor reads what NCCL
    will see (one reader for the warnings and the tuned variant), and names the file."""
    conf = tmp_path / "nccl.conf"
    conf.write_text("NCCL_P2P_DISABLE=1\n")
    env = {"SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie", "NCCL_CONF_FILE": str(conf)}
    proc = run_cli("doctor", "--json", "--tp", "8", "--model-arch", KIMI, env=env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    options = {row["switch"]: row for row in report["allreduce_options"]}
    assert len(options) == 9
    assert options["--enable-mscclpp"]["can_run"] is False  # mscclpp is not installed here
    assert "not on PyPI" in options["--enable-mscclpp"]["why"]
    (warning,) = report["nccl_warnings"]
    assert warning["variable"] == "NCCL_P2P_DISABLE" and warning["fix"] == "unset NCCL_P2P_DISABLE"
    assert warning["set_in"] == str(conf) and report["nccl_conf_unreadable"] is None
    text = run_cli("doctor", "--tp", "8", "--model-arch", KIMI, env=env).stdout
    assert "all-reduce options (SGLang's switches, judged for this launch):" in text
    assert (
        f"NCCL settings that break or slow this launch:\n  NCCL_P2P_DISABLE='1' (set in {conf}): "
        in text
    )


# --- PP across nodes: `--nnodes 2 --pp-size 2 --tp 8` keeps the TP group on one node -------------

PP2_OVER_2_NODES = ("--tp", "8", "--nnodes", "2", "--pp-size", "2", "--model-arch", KIMI)


def test_plan_pp_across_nodes_keeps_pcie_ipc():
    plan = plan_json("--profile", "rtx-pro-6000-x8-pcie", *PP2_OVER_2_NODES)
    assert (plan["fusion_backend"], plan["plain_allreduce"]) == (None, "pcie_ipc")
    assert any("TP group inside one node" in r for r in plan["reasons"]), plan["reasons"]


def test_plan_tp_spanning_nodes_says_nccl_and_why():
    plan = plan_json("--profile", "rtx-pro-6000-x8-pcie", "--tp", "16", "--nnodes", "2")
    assert plan["plain_allreduce"] == "nccl"
    assert any(
        r.startswith("plain all-reduce NCCL: the TP group spans 2 nodes") for r in plan["reasons"]
    ), plan["reasons"]


@pytest.mark.parametrize(
    ("args", "plain", "why"),
    [
        (PP2_OVER_2_NODES, "pcie_ipc", "TP group inside one node"),
        (("--tp", "16", "--nnodes", "2"), "nccl", "TP group spans 2 nodes"),
    ],
    ids=["TP inside a node", "TP spanning nodes"],
)
def test_doctor_plans_by_the_tp_groups_span(args, plain, why):
    proc = run_cli("doctor", "--json", *args, env={"SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie"})
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)["plan"]
    assert plan["plain_allreduce"] == plain
    assert any(why in r for r in plan["reasons"]), plan["reasons"]


@pytest.mark.parametrize("command", ["plan", "doctor"])
def test_a_pp_size_sglang_refuses_is_one_line(command):
    """SGLang asserts (tp_size * pp_size) % nnodes == 0 (validation_hook.check_server_args)."""
    args = ("--tp", "3", "--pp-size", "1", "--nnodes", "2")
    where = ("--profile", "rtx-pro-6000-x8-pcie") if command == "plan" else ()
    proc = run_cli(command, *where, *args, env={"SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie"})
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0, proc.stderr  # one line, no progress before it
    assert proc.stderr.strip().endswith(
        "--tp 3 x --pp-size 1 = 3 ranks do not divide over --nnodes 2 (SGLang refuses it)"
    ), proc.stderr


def test_a_second_doctor_reuses_the_plugin_checks_without_importing_sglang(tmp_path):
    """doctor's launcher and TP-worker checks are what the installed code, the facts and the
    environment decide: a second doctor with none of them changed reports the same, from the
    cache, and imports no SGLang (``-X importtime`` lists every module imported); --recheck
    checks again (what changes the key: test_plugin_check.py)."""
    cache = tmp_path / "cache"
    env = {
        "SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie",
        "SGLANG_SM120_CACHE_DIR": str(cache),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }

    command = [sys.executable, "-X", "importtime", "-m", "sglang_sm120.commands.cli", "doctor"]

    def doctor(*args: str, extra: dict | None = None) -> tuple[dict, str]:
        proc = subprocess.run(
            [*command, "--json", "--tp", "8", "--model-arch", KIMI, *args],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **env, **(extra or {})},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout), proc.stderr

    def sglang_imported(stderr: str) -> bool:
        return any(line.rsplit("|", 1)[-1].strip() == "sglang" for line in stderr.splitlines())

    first, stderr = doctor()
    assert sglang_imported(stderr) and first["plugin_check"]["reused"] is False
    assert (cache / "doctor-plugin-check-v1.json").is_file()
    second, stderr = doctor()
    assert not sglang_imported(stderr) and second["plugin_check"] == {
        "reused": True,
        "checked_at": first["plugin_check"]["checked_at"],
        "not_kept": None,
        "kept_unusable": None,
    }
    del first["plugin_check"], second["plugin_check"]
    assert second == first
    rechecked, stderr = doctor("--recheck")
    assert sglang_imported(stderr) and rechecked["plugin_check"]["reused"] is False
