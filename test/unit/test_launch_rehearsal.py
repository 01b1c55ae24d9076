"""A real SGLang launch on this CPU machine, up to CUDA init: the launcher resolves the server
args and spawns its TP scheduler processes, which load the plugin, configure logging and only
then fail ("Found no NVIDIA driver"). Everything the plugin does before the GPU happens in
SGLang's own processes, started the way SGLang starts them (UPSTREAM.md section 7).

Checked from the server log: one status line in the launcher and in each TP worker that got as
far as logging, the launcher's plan and the same plan (reasons, tuning-table routes) in every
worker, no "requested" unless requested, and the user's switches honoured. The tuned NCCL
variant is checked inside the worker itself: a second plugin (``nccl_env_probe``) records the
worker's NCCL_* when SGLang calls ``init_distributed_environment`` (innermost in its hook chain,
after our hook set them). That covers SGLang's own launch; a scheduler that loaded plugins while
multiprocessing was still starting it is covered in-process
(``test_patch_behaviour.test_a_still_starting_child_sets_the_tuned_nccl_env_at_nccl_init``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from kernel_library import require_kernel_package
from sglang_sm120.machine.cache import host_fingerprint
from sglang_sm120.machine.facts import load_profile
from sglang_sm120.planning.tuning import Measurement, TuningTable, save_table

PROFILE = "rtx-pro-6000-x8-pcie"
STATUS = re.compile(r"^\[[^\]]*?( TP\d+)?\] sglang-sm120 0\.5\.23\.1 \((launcher|TP worker)\): ")
PLAN = re.compile(
    r"^\[[^\]]*?( TP\d+)?\] sglang-sm120 plan \((server args|from launcher), tp=2\): (.*)$"
)


def launch(
    command: list[str],
    model_dir: Path,
    env: dict[str, str],
    extra: tuple[str, ...] = (),
    until: str = "Found no NVIDIA driver",
) -> str:
    """Run a server launch to its CUDA-init failure (or to what ``until`` names); returns its
    whole log."""
    full_env = {**os.environ, "SGLANG_SM120_TOPOLOGY": PROFILE, **env}
    for name in (
        "SGLANG_SM120_DISABLE",
        "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE",
        "SGLANG_SM120_LAUNCH_PLAN",
    ):
        if name not in env:
            full_env.pop(name, None)
    args = ["--model-path", str(model_dir), "--tp", "2", "--device", "cuda", *extra]
    proc = subprocess.Popen(
        [*command, *args, "--skip-tokenizer-init"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert until in log, log[-4000:]
    return log


def lines_of(log: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Status lines and plan summaries, by process ("launcher", "TP0", "TP1")."""
    status: dict[str, list[str]] = {}
    plans: dict[str, list[str]] = {}
    for line in log.splitlines():
        if m := STATUS.match(line):
            status.setdefault((m.group(1) or " launcher").strip(), []).append(line)
        if m := PLAN.match(line):
            plans.setdefault((m.group(1) or " launcher").strip(), []).append(m.group(3))
    return status, plans


def check_same_plan_everywhere(log: str) -> str:
    status, plans = lines_of(log)
    workers = sorted(p for p in status if p.startswith("TP"))
    assert len(status.get("launcher", [])) == 1, log[-4000:]
    assert workers, f"no TP worker logged its status line:\n{log[-4000:]}"
    for worker in workers:
        assert len(status[worker]) == 1
        assert "(TP worker)" in status[worker][0]
        assert "pcie_ipc_enable=applied" in status[worker][0]
        assert plans[worker] == plans["launcher"]
    assert "pcie_ipc_enable=not used in the launcher" in status["launcher"][0]
    return plans["launcher"][0]


@pytest.fixture(scope="module")
def deepseek(model_dirs) -> Path:
    return model_dirs["DeepseekV3ForCausalLM"]


def test_launch_server_launcher_and_workers_share_the_plan(deepseek):
    plan = check_same_plan_everywhere(
        launch([sys.executable, "-m", "sglang.launch_server"], deepseek, {})
    )
    assert plan.startswith("fusion=trtllm, plain all-reduce=pcie_ipc; ")
    assert "requested" not in plan


def test_sglang_serve_loads_the_plugin_in_every_process(deepseek):
    sglang_cli = Path(sys.executable).with_name("sglang")
    plan = check_same_plan_everywhere(launch([str(sglang_cli), "serve"], deepseek, {}))
    assert plan.startswith("fusion=trtllm, plain all-reduce=pcie_ipc; ")


VALIDATION = {"SGLANG_SM120_TOPOLOGY": "h200-x8-nvlink", "SGLANG_SM120_ANY_ARCH": "1"}


def test_validation_mode_manages_an_sm90_host_in_the_launcher_and_its_workers(deepseek):
    log = launch([sys.executable, "-m", "sglang.launch_server"], deepseek, VALIDATION)
    plan = check_same_plan_everywhere(log)
    assert plan.startswith("fusion=trtllm, plain all-reduce=upstream; ")
    assert "validation mode (SGLANG_SM120_ANY_ARCH=1)" in plan
    status, _ = lines_of(log)
    for lines in status.values():
        assert "validation mode (SGLANG_SM120_ANY_ARCH=1)" in lines[0]


def test_without_validation_mode_an_sm90_host_is_left_to_upstream(deepseek):
    env = {**VALIDATION, "SGLANG_SM120_ANY_ARCH": "0"}
    log = launch([sys.executable, "-m", "sglang.launch_server"], deepseek, env)
    status, plans = lines_of(log)
    assert status == {} and plans == {}, log[-4000:]
    assert "sglang-sm120" not in log, log[-4000:]


def test_launcher_plans_with_the_host_findings_and_workers_follow(deepseek):
    """The profile's machine described by a sysfs dump with ACS redirect on its switch ports:
    the launcher's plan turns TP2's auto trtllm (a one-shot push) off for PCIe-IPC, says why
    with the fix, and every worker follows that plan."""
    from fake_nvml import FIXTURES

    env = {"SGLANG_SM120_SYSFS_ROOT": str(FIXTURES / "acs-on")}
    plan = check_same_plan_everywhere(
        launch([sys.executable, "-m", "sglang.launch_server"], deepseek, env)
    )
    assert plan.startswith("fusion=off, plain all-reduce=pcie_ipc; ")
    assert "host acs: GPUs 0,1: ACS redirect on PCIe switch ports" in plan
    assert "one-shot push all-reduce disfavoured; PCIe-IPC (staged)" in plan
    assert "(fix: disable ACS in the BIOS" in plan


def test_a_table_of_every_size_reaches_the_workers_with_its_routes_and_the_users_switch(
    deepseek, tmp_path
):
    """``tune --tokens $(seq 1 2048)``: the launch plan once outgrew the environment, and
    starting the TP workers failed with "Argument list too long". The workers keep the table's
    routes (sm120_pcie up to ~300 tokens, NCCL above) and the user's switch."""
    require_kernel_package()
    from test_launch_plan import every_size_table

    os.environ["SGLANG_SM120_CACHE_DIR"] = str(tmp_path)
    try:
        save_table(every_size_table(load_profile(PROFILE), 2))
    finally:
        del os.environ["SGLANG_SM120_CACHE_DIR"]
    env = {"SGLANG_SM120_CACHE_DIR": str(tmp_path), "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "0"}
    # Without custom all-reduce (which at TP2 would take the table's declined sizes, untimed)
    # the table may route a size off the fusion backend: the launcher reads the flag.
    command = [sys.executable, "-m", "sglang.launch_server"]
    plan = check_same_plan_everywhere(
        launch(command, deepseek, env, extra=("--disable-custom-all-reduce",))
    )
    assert plan.startswith("fusion=sm120_pcie, plain all-reduce=nccl; "), plan
    routes = re.search(
        r"from the tuning table: sm120_pcie at \[1-(\d+)\], nccl at \[(\d+)-2048\] tokens", plan
    )
    assert routes and int(routes[2]) == int(routes[1]) + 1, plan
    assert "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=0 set by the user" in plan


def nccl_launch(deepseek: Path, tmp_path: Path, user_env: dict[str, str]) -> tuple[str, list[dict]]:
    """A TP2 launch whose tuning table leaves every size on NCCL and measured NCCL_PROTO=LL
    clearly faster than NCCL's default, with a second plugin (``nccl_env_probe``) recording each
    TP worker's NCCL_* at SGLang's ``init_distributed_environment``. Returns (log, records)."""
    from nccl_env_probe import PROBE_DIR_ENV, STOP, install
    from sglang_sm120.planning.tuning import PREFILL_TOKENS, VariantMeasurement

    fingerprint = host_fingerprint(load_profile(PROFILE), 2)
    rows = [Measurement("trtllm", t, us, True) for t, us in ((4, 50.0), (64, 80.0))]
    rows += [Measurement("nccl", t, us, True) for t, us in ((4, 20.0), (64, 30.0))]
    ll = (("NCCL_PROTO", "LL"),)
    prefill = (PREFILL_TOKENS, 400.0)  # as fast as the default at the prefill chunk
    variants = [VariantMeasurement((), t, us, True) for t, us in ((4, 20.0), (64, 30.0), prefill)]
    variants += [VariantMeasurement(ll, t, us, True) for t, us in ((4, 12.0), (64, 20.0), prefill)]
    cache, probe, plugin = tmp_path / "cache", tmp_path / "probe", tmp_path / "plugin"
    probe.mkdir()
    install(plugin)
    os.environ["SGLANG_SM120_CACHE_DIR"] = str(cache)
    try:
        save_table(
            TuningTable(
                fingerprint, 2, 7168, "bfloat16", tuple(rows), nccl_variants=tuple(variants)
            )
        )
    finally:
        del os.environ["SGLANG_SM120_CACHE_DIR"]
    path = os.pathsep.join(
        [str(plugin), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    )
    env = {
        "SGLANG_SM120_CACHE_DIR": str(cache),
        "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "0",
        "PYTHONPATH": path,
        PROBE_DIR_ENV: str(probe),
        **user_env,
    }
    command = [sys.executable, "-m", "sglang.launch_server"]
    log = launch(command, deepseek, env, extra=("--disable-custom-all-reduce",), until=STOP)
    records = [json.loads(f.read_text()) for f in sorted(probe.iterdir())]
    assert records, f"no TP worker reached init_distributed_environment:\n{log[-4000:]}"
    return log, records


def test_a_tuned_nccl_variant_is_in_the_workers_environment_before_nccl_starts(deepseek, tmp_path):
    log, records = nccl_launch(deepseek, tmp_path, {})
    assert records, log[-4000:]
    for record in records:  # for the all-reduce only, which tune timed
        assert record["env"] == {
            "NCCL_PROTO": "allreduce:LL",
            "NCCL_ALGO": None,
            "NCCL_MAX_NCHANNELS": None,
            "NCCL_MIN_NCHANNELS": None,
        }
    status, plans = lines_of(log)
    assert (
        "nccl env NCCL_PROTO=LL from the tuning table: 0.63x NCCL's default" in plans["launcher"][0]
    )
    workers = [p for p in status if p.startswith("TP")]
    assert workers, log[-4000:]
    for worker in workers:  # logged before the Scheduler exists: not applied yet
        assert (
            "nccl_tuned_env=pending (NCCL_PROTO=allreduce:LL set when init_distributed_environment "
            "runs)" in status[worker][0]
        )
    applied = [line for line in log.splitlines() if "nccl_tuned_env=applied at init_" in line]
    assert len(applied) == len(records), log[-4000:]
    assert all(
        "nccl env: NCCL_PROTO=allreduce:LL set before NCCL starts; " in line for line in applied
    )


def test_the_users_own_nccl_proto_wins_in_the_worker(deepseek, tmp_path):
    log, records = nccl_launch(deepseek, tmp_path, {"NCCL_PROTO": "Simple"})
    assert all(record["env"]["NCCL_PROTO"] == "Simple" for record in records)
    status, _ = lines_of(log)
    workers = [p for p in status if p.startswith("TP")]
    assert workers, log[-4000:]
    for worker in workers:
        assert (
            "nccl_tuned_env=not needed (nccl env: tuned NCCL_PROTO=allreduce:LL not set: the "
            "user's NCCL_PROTO='Simple' wins)" in status[worker][0]
        )
