"""Every bad input to ``sglang-sm120`` is one line on stderr and exit status 2: no traceback, and
nothing on stdout (no plan), within seconds and bounded memory. Each row runs the installed
console script in a subprocess, as a user would, under a time and an address-space limit; the
topology rows write the file the row describes (FIFO: a named pipe nobody writes)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sglang_sm120
from test_cli import run_cli

PCIE8 = ("--profile", "rtx-pro-6000-x8-pcie")
GPU = {"name": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "capability": [12, 0]}
FIFO = "<a named pipe that no one writes>"  # the row's topology file is made a FIFO
HUGE_INT = '{"gpus": [], "p2p": "none", "nnodes": 1' + "0" * 5000 + "}"
OVER_1_MIB = '{"gpus": [], "p2p": "none", "description": "' + "x" * (1 << 20) + '"}'
DUPLICATE_KEY = '{"gpus": [], "p2p": "none", "gpus": [{"name": "X", "capability": [12, 0]}]}'
TOPOLOGY_ENV = "SGLANG_SM120_TOPOLOGY"


def topology(**changes) -> dict:
    """A valid 2-GPU topology with ``changes`` applied (a value of None removes the key)."""
    document = {"gpus": [dict(GPU), dict(GPU)], "p2p": "all", "nvlink": False, "nnodes": 1}
    document.update(changes)
    return {key: value for key, value in document.items() if value is not None}


def with_gpu(**changes) -> dict:
    gpu = {**GPU, **changes}
    return topology(gpus=[{k: v for k, v in gpu.items() if v is not None}, dict(GPU)])


# id, arguments ({file} is replaced by the row's topology file), topology file content (a JSON
# document, or raw text when a str), environment, a fragment the one line must contain
ROWS = [
    ("tp zero", ["plan", *PCIE8, "--tp", "0"], None, {}, "--tp: 0 is not a positive integer"),
    ("tp negative", ["plan", *PCIE8, "--tp", "-2"], None, {}, "-2 is not a positive integer"),
    ("tp not a number", ["plan", *PCIE8, "--tp", "eight"], None, {}, "'eight' is not an integer"),
    ("tp of 5000 digits", ["plan", *PCIE8, "--tp", "9" * 5000], None, {}, "'99999999999"),
    ("tp above the GPUs", ["plan", *PCIE8, "--tp", "16"], None, {}, "--tp 16 needs 16 GPUs"),
    (
        "tp above a 2-GPU profile",
        ["plan", "--profile", "rtx-5090-x2-nop2p", "--tp", "4"],
        None,
        {},
        "profile:rtx-5090-x2-nop2p has 2",
    ),
    (
        "pp-size of 30 digits",
        ["plan", *PCIE8, "--tp", "8", "--pp-size", "9" * 30],
        None,
        {},
        "--pp-size: 999999999999999999999999999999 is above 65536",
    ),
    (
        "tp x pp above the GPUs",  # as --tp 16 is: 16 ranks on 8 GPUs
        ["plan", *PCIE8, "--tp", "8", "--pp-size", "2"],
        None,
        {},
        "--tp 8 x --pp-size 2 needs 16 GPUs; profile:rtx-pro-6000-x8-pcie has 8 (pass --nnodes",
    ),
    (
        "tp of Arabic-Indic digits",
        ["plan", *PCIE8, "--tp", "\u0668"],
        None,
        {},
        "is not an integer",
    ),
    ("hidden zero", ["plan", *PCIE8, "--tp", "8", "--hidden", "0"], None, {}, "--hidden: 0 is"),
    ("nnodes zero", ["plan", *PCIE8, "--tp", "8", "--nnodes", "0"], None, {}, "--nnodes: 0 is"),
    ("unknown profile", ["plan", "--profile", "dgx", "--tp", "2"], None, {}, "invalid choice"),
    ("no machine given", ["plan", "--tp", "2"], None, {}, "--profile --topology is required"),
    ("unknown command", ["serve"], None, {}, "invalid choice: 'serve'"),
    ("p2p GPUs not numbers", ["p2p", "--gpus", "0,x"], None, {}, "'0,x' is not a comma list"),
    ("p2p GPU named twice", ["p2p", "--gpus", "0,0"], None, {}, "must be distinct and >= 0"),
    ("missing file", ["plan", "--topology", "/nonexistent.json", "--tp", "2"], None, {}, "No such"),
    ("directory", ["plan", "--topology", "/", "--tp", "2"], None, {}, "a directory, not a"),
    ("device", ["plan", "--topology", "/dev/zero", "--tp", "2"], None, {}, "character device"),
    ("fifo", ["plan", "--topology", "{file}", "--tp", "2"], FIFO, {}, "a FIFO, not a regular"),
    ("over 1 MiB", ["plan", "--topology", "{file}", "--tp", "2"], OVER_1_MIB, {}, "over 1 MiB"),
    ("huge int", ["plan", "--topology", "{file}", "--tp", "1"], HUGE_INT, {}, "5001 digits"),
    ("duplicate key", ["plan", "--topology", "{file}", "--tp", "1"], DUPLICATE_KEY, {}, "'gpus'"),
    (
        "NaN",
        ["plan", "--topology", "{file}", "--tp", "2"],
        json.dumps(with_gpu(memory_gib=float("nan"))),
        {},
        "NaN is not JSON",
    ),
    (
        "a number past float's range",
        ["plan", "--topology", "{file}", "--tp", "2"],
        json.dumps(with_gpu(memory_gib=1.0)).replace("1.0", "1e400"),
        {},
        "1e400 is out of range",
    ),
    ("invalid JSON", ["plan", "--topology", "{file}", "--tp", "2"], "{not json", {}, "line 1"),
    ("not UTF-8", ["plan", "--topology", "{file}", "--tp", "2"], "\udcff", {}, "decode"),
    ("a list", ["plan", "--topology", "{file}", "--tp", "1"], [1, 2], {}, "must be a JSON object"),
    ("empty object", ["plan", "--topology", "{file}", "--tp", "1"], {}, {}, "key 'gpus'"),
    (
        "capability a string",
        ["plan", "--topology", "{file}", "--tp", "2"],
        with_gpu(capability="12.0"),
        {},
        "gpus[0].capability must be [major, minor] integers",
    ),
    (
        "capability one number",
        ["plan", "--topology", "{file}", "--tp", "2"],
        with_gpu(capability=[12]),
        {},
        "got [12]",
    ),
    (
        "capability out of range",
        ["plan", "--topology", "{file}", "--tp", "2"],
        with_gpu(capability=[120, 0]),
        {},
        "out of range",
    ),
    (
        "capability missing",
        ["plan", "--topology", "{file}", "--tp", "2"],
        with_gpu(capability=None),
        {},
        "gpus[0]: missing required key 'capability'",
    ),
    (
        "gpu name empty",
        ["plan", "--topology", "{file}", "--tp", "2"],
        with_gpu(name=""),
        {},
        "name must be one printable line",
    ),
    (
        "gpu name with a newline",
        ["plan", "--topology", "{file}", "--tp", "2"],
        with_gpu(name="NVIDIA RTX\nPRO 6000"),
        {},
        "gpus[0].name must be one printable line of at most 96 characters, got 'NVIDIA RTX\\nPRO",
    ),
    (
        "gpu name with an escape sequence",
        ["plan", "--topology", "{file}", "--tp", "2"],
        with_gpu(name="\x1b[2J RTX"),
        {},
        "gpus[0].name must be one printable line",
    ),
    (
        "gpu name too long",
        ["plan", "--topology", "{file}", "--tp", "2"],
        with_gpu(name="RTX " * 100),
        {},
        "at most 96 characters",
    ),
    (
        "description on two lines",
        ["plan", "--topology", "{file}", "--tp", "2"],
        topology(description="one\ntwo"),
        {},
        "'description' must be one printable line",
    ),
    (
        "numa node negative",
        ["plan", "--topology", "{file}", "--tp", "2"],
        with_gpu(numa_node=-1),
        {},
        "numa_node must be an integer 0..1023",
    ),
    (
        "memory zero",
        ["plan", "--topology", "{file}", "--tp", "2"],
        with_gpu(memory_gib=0),
        {},
        "memory_gib must be a number > 0",
    ),
    (
        "gpu not an object",
        ["plan", "--topology", "{file}", "--tp", "2"],
        topology(gpus=["RTX PRO 6000"]),
        {},
        "gpus[0] must be an object",
    ),
    (
        "gpus not a list",
        ["plan", "--topology", "{file}", "--tp", "1"],
        topology(gpus={"0": GPU}),
        {},
        "'gpus' must be a list of at most 64",
    ),
    (
        "tp on a host without GPUs",
        ["plan", "--topology", "{file}", "--tp", "1"],
        topology(gpus=[], p2p="none"),
        {},
        "--tp 1 needs 1 GPU; file:",
    ),
    (
        "no p2p",
        ["plan", "--topology", "{file}", "--tp", "2"],
        topology(p2p=None),
        {},
        "missing required key 'p2p'",
    ),
    (
        "p2p wrong shape",
        ["plan", "--topology", "{file}", "--tp", "2"],
        topology(p2p=[[True, True]]),
        {},
        "2x2 matrix",
    ),
    (
        "p2p numbers",
        ["plan", "--topology", "{file}", "--tp", "2"],
        topology(p2p=[[1, 1], [1, 1]]),
        {},
        "p2p[0][0] is 1",
    ),
    (
        "p2p unknown word",
        ["plan", "--topology", "{file}", "--tp", "2"],
        topology(p2p="some"),
        {},
        "got 'some'",
    ),
    (
        "nvlink a string",
        ["plan", "--topology", "{file}", "--tp", "2"],
        topology(nvlink="yes"),
        {},
        "'nvlink' must be true or false",
    ),
    (
        "nnodes zero in file",
        ["plan", "--topology", "{file}", "--tp", "2"],
        topology(nnodes=0),
        {},
        "'nnodes' must be an integer 1..1024",
    ),
    (
        "misspelled key",
        ["plan", "--topology", "{file}", "--tp", "2"],
        {**topology(), "nvlinks": True},
        {},
        "unknown key 'nvlinks'",
    ),
    (
        "env: not a profile or file",
        ["doctor"],
        None,
        {"SGLANG_SM120_TOPOLOGY": "garbage"},
        "SGLANG_SM120_TOPOLOGY: 'garbage' is neither an embedded profile (h200-x8-nvlink",
    ),
    (
        "env: invalid JSON file",
        ["doctor"],
        "[1, 2",
        {"SGLANG_SM120_TOPOLOGY": "{file}"},
        "SGLANG_SM120_TOPOLOGY: cannot read topology file",
    ),
    (
        "env: file against the schema",
        ["doctor", "--json"],
        with_gpu(capability="12.0"),
        {"SGLANG_SM120_TOPOLOGY": "{file}"},
        "SGLANG_SM120_TOPOLOGY: file:",
    ),
    (
        "doctor tp above the GPUs",
        ["doctor", "--tp", "16"],
        None,
        {"SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie"},
        "--tp 16 needs 16 GPUs",
    ),
    ("env: device", ["doctor"], None, {TOPOLOGY_ENV: "/dev/zero"}, "character device, not a"),
    ("env: fifo", ["doctor"], FIFO, {TOPOLOGY_ENV: "{file}"}, "a FIFO, not a regular file"),
    ("env: huge int", ["doctor"], HUGE_INT, {TOPOLOGY_ENV: "{file}"}, "5001 digits"),
    ("env: duplicate key", ["doctor"], DUPLICATE_KEY, {TOPOLOGY_ENV: "{file}"}, "duplicate key"),
    (
        "env: gpu name with a newline",
        ["doctor"],
        with_gpu(name="RTX\nPRO"),
        {TOPOLOGY_ENV: "{file}"},
        "SGLANG_SM120_TOPOLOGY: file:",
    ),
    ("doctor capability", ["doctor", "--capability", "twelve"], None, {}, "'twelve' is not a"),
    ("dtype int8", ["plan", *PCIE8, "--tp", "8", "--dtype", "int8"], None, {}, "'int8' is not"),
    ("dtype empty", ["plan", *PCIE8, "--tp", "8", "--dtype", ""], None, {}, "--dtype: '' is not"),
    ("dtype auto", ["plan", *PCIE8, "--tp", "8", "--dtype", "auto"], None, {}, "model's config"),
    (
        "doctor dtype int8",
        ["doctor", "--dtype", "int8"],
        None,
        {TOPOLOGY_ENV: "rtx-pro-6000-x8-pcie"},
        "--dtype: 'int8' is not a model dtype",
    ),
    (
        "unknown fusion backend",
        ["plan", *PCIE8, "--tp", "8", "--fusion-backend", "nvlink"],
        None,
        {},
        "--fusion-backend 'nvlink' is not one of SGLang's choices (auto, trtllm, mnnvl, cutedsl)",
    ),
    (
        "unknown MoE all-to-all backend",
        ["plan", *PCIE8, "--tp", "8", "--moe-a2a-backend", "deep_ep"],
        None,
        {},
        "--moe-a2a-backend 'deep_ep' is not one of SGLang's choices (none, deepep,",
    ),
    (
        "doctor unknown MoE all-to-all backend",
        ["doctor", "--moe-a2a-backend", "nccl"],
        None,
        {TOPOLOGY_ENV: "rtx-pro-6000-x8-pcie"},
        "--moe-a2a-backend 'nccl' is not one of SGLang's choices",
    ),
    ("model arch empty", ["plan", *PCIE8, "--tp", "8", "--model-arch", ""], None, {}, "'' is not"),
    (
        "model arch on two lines",
        ["plan", *PCIE8, "--tp", "8", "--model-arch", "DeepseekV3ForCausalLM\nX"],
        None,
        {},
        "--model-arch: 'DeepseekV3ForCausalLM\\nX' is not an architecture class name",
    ),
    (
        "nnodes above the schema's cap",
        ["plan", *PCIE8, "--tp", "8", "--nnodes", "1025"],
        None,
        {},
        "--nnodes: 1025 is above 1024",
    ),
    ("unknown top-level flag", ["--bogus"], None, {}, "unrecognized arguments: --bogus"),
    ("unknown flag before a command", ["--bogus", "profiles"], None, {}, "arguments: --bogus"),
    ("no command", [], None, {}, "a command is required (doctor, plan,"),
    (
        "selftest target that does not exist",
        ["selftest", "--target", "/nonexistent", "--draft", "/nonexistent-draft"],
        None,
        {},
        "--target /nonexistent: no such directory",
    ),
    (
        "selftest draft that does not exist",
        ["selftest", "--target", "{dir}", "--draft", "./no-such-draft"],
        None,
        {},
        "--draft ./no-such-draft: no such directory",
    ),
    (
        "selftest repo id not in the HF cache",  # org/name is still a repo id, as before
        ["selftest", "--target", "org/name", "--draft", "org/draft"],
        None,
        {"HF_HUB_OFFLINE": "1"},
        "cannot read the config of --target org/name: ",
    ),
    (
        "selftest target a file",
        ["selftest", "--target", "{file}", "--draft", "{file}"],
        {},
        {},
        "is a file, not a model directory",
    ),
    (
        "tune cache dir a file",
        ["tune", "--tp", "2"],
        {},
        {"SGLANG_SM120_CACHE_DIR": "{file}"},
        "tune: SGLANG_SM120_CACHE_DIR={file} is not writable (a file, not a directory)",
    ),
    (
        "p2p cache dir a file",  # said before it measures, as tune does
        ["p2p"],
        {},
        {"SGLANG_SM120_CACHE_DIR": "{file}"},
        "p2p: SGLANG_SM120_CACHE_DIR={file} is not writable (a file, not a directory)",
    ),
    (
        "tune cache dir relative",  # each process would name another directory below its own
        ["tune", "--tp", "2"],
        None,
        {"SGLANG_SM120_CACHE_DIR": "rel/cache"},
        "tune: SGLANG_SM120_CACHE_DIR=rel/cache is not usable (a relative path",
    ),
    ("tune tp zero", ["tune", "--tp", "0"], None, {}, "--tp: 0 is not a positive integer"),
    ("tune tokens zero", ["tune", "--tp", "2", "--tokens", "0"], None, {}, "--tokens: 0 is"),
    ("warmup vocab zero", ["warmup", "--vocab-size", "0"], None, {}, "--vocab-size: 0 is"),
]


def _cuda_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


NO_GPU_ROWS = [
    ("tune without a GPU", ["tune", "--tp", "2"], "tune: needs CUDA GPUs; torch sees none"),
    ("warmup without a GPU", ["warmup"], "warmup: no CUDA GPU visible to torch"),
    (
        "p2p without a GPU",
        ["p2p"],
        "p2p: needs at least 2 CUDA GPUs to measure P2P; torch sees none",
    ),
    ("p2p naming GPUs without one", ["p2p", "--gpus", "0,1"], "torch sees none"),
]


MEMORY_LIMIT = 6 << 30  # address space: importing sglang and torch takes ~2.5 GiB of it
TIME_LIMIT_S = 90  # importing sglang takes ~8 s alone on 2 busy cores


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def run_bounded(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli(*args, env=env, timeout=TIME_LIMIT_S, preexec_fn=_limit_memory)


def assert_one_line_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == "", proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sglang-sm120"), proc.stderr
    assert len(lines[0]) < 1000, lines[0][:1000]  # a line a person reads, not a value echoed
    assert fragment in lines[0], lines[0]


def test_the_table_has_at_least_twenty_rows():
    assert len(ROWS) + len(NO_GPU_ROWS) + 1 >= 20


@pytest.mark.parametrize(
    ("args", "content", "env", "fragment"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_bad_input_is_one_line_and_exit_2(args, content, env, fragment, tmp_path):
    path = tmp_path / "topology.json"
    if content is FIFO:
        os.mkfifo(path)
    elif isinstance(content, str):
        path.write_bytes(content.encode("utf-8", "surrogateescape"))
    elif content is not None:
        path.write_text(json.dumps(content))
    fill = {"{file}": str(path), "{dir}": str(tmp_path)}
    args = [fill.get(a, a) for a in args]
    env = {k: fill.get(v, v) for k, v in env.items()}
    assert_one_line_error(run_bounded(*args, env=env), fragment.replace("{file}", str(path)))


@pytest.mark.skipif(_cuda_visible(), reason="a GPU is visible: these commands would run")
@pytest.mark.parametrize(
    ("args", "fragment"), [r[1:] for r in NO_GPU_ROWS], ids=[r[0] for r in NO_GPU_ROWS]
)
def test_gpu_commands_without_a_gpu_say_so_in_one_line(args, fragment):
    assert_one_line_error(run_bounded(*args), fragment)


def test_doctor_where_sglang_is_not_importable(tmp_path):
    """An interpreter without site-packages (``-S``) that sees only a copy of the plugin."""
    shutil.copytree(Path(sglang_sm120.__file__).parent, tmp_path / "sglang_sm120")
    proc = subprocess.run(
        [sys.executable, "-S", "-m", "sglang_sm120.commands.cli", "doctor"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert_one_line_error(proc, "sglang is not installed; sglang-sm120")


def test_doctor_where_sglang_is_installed_but_does_not_import(tmp_path):
    """sglang is found (doctor no longer imports it to know) but its import fails: one line
    naming the failure, and the TP-worker check started beside it is stopped."""
    shutil.copytree(Path(sglang_sm120.__file__).parent, tmp_path / "sglang_sm120")
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    proc = subprocess.run(
        [sys.executable, "-S", "-m", "sglang_sm120.commands.cli", "doctor"],
        capture_output=True,
        text=True,
        env={
            "PYTHONPATH": str(tmp_path),
            "PATH": "/usr/bin:/bin",
            "SGLANG_SM120_CACHE_DIR": str(tmp_path / "cache"),
        },
        timeout=120,
    )
    progress, error = proc.stderr.strip().splitlines()  # what doctor began, then why it stopped
    assert progress.endswith("loading SGLang, as the launcher and a TP worker ...")
    proc.stderr = error
    assert_one_line_error(proc, "sglang does not import (no torch here)")


def test_a_bad_topology_variable_in_a_server_process_is_one_error_and_no_patch():
    """What every SGLang process runs: load_plugins() with SGLANG_SM120_TOPOLOGY=garbage."""
    code = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stderr, format='%(levelname)s %(message)s')\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang_sm120.server.runtime import PATCH_STATUS\n"
        "import json; print(json.dumps(sorted(set(PATCH_STATUS.values()))))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_SM120_")}
    env["SGLANG_SM120_TOPOLOGY"] = "garbage"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "sglang-sm120" in line]
    assert errors == [
        "ERROR sglang-sm120: applying nothing: SGLANG_SM120_TOPOLOGY: 'garbage' is neither an "
        "embedded profile (h200-x8-nvlink, rtx-5090-x2-nop2p, rtx-pro-6000-x8-pcie) nor an "
        "existing topology JSON file"
    ]
    statuses = json.loads(proc.stdout.strip().splitlines()[-1])
    assert statuses == [f"refused ({errors[0].split('applying nothing: ')[1]})"]


# ---- issue 27 kinds 1-2: sysfs read with bounds
# Each row runs `python -m sglang_sm120.machine.host_checks --tp 2 --json` (and one row `doctor`)
# on a copy of a fixture host whose one file is replaced as the row says, under a time and an
# address-space limit: it must finish, and the check reading that file says `unknown (reason)`.

HOST_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hosts"
SYSFS_ENV = "SGLANG_SM120_SYSFS_ROOT"
HOST_MEMORY_LIMIT = 1 << 30  # the host checks import neither torch nor sglang
GPU0 = "sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:03:00.0"
SWITCH_PORT = "sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0"

# id, fixture host, file (below the root), made into, check, fragment of its unknown detail
SYSFS_FILE_ROWS = [
    ("cmdline FIFO", "healthy", "proc/cmdline", "fifo", "iommu", "a FIFO, not a regular file"),
    ("cmdline /dev/zero", "healthy", "proc/cmdline", "zero", "iommu", "a character device"),
    ("cmdline of 1 MiB", "healthy", "proc/cmdline", "big", "iommu", "over 4096 bytes"),
    ("cmdline directory", "healthy", "proc/cmdline", "dir", "iommu", "a directory"),
    ("group type FIFO", "iommu-on", f"{GPU0}/iommu_group/type", "fifo", "iommu", "a FIFO"),
    ("gpu vendor FIFO", "healthy", f"{GPU0}/vendor", "fifo", "acs", "vendor: a FIFO"),
    ("gpu class /dev/zero", "healthy", f"{GPU0}/class", "zero", "acs", "a character device"),
    ("gpu vendor not UTF-8", "healthy", f"{GPU0}/vendor", "binary", "acs", "not UTF-8"),
    ("bridge config FIFO", "healthy", f"{SWITCH_PORT}/config", "fifo", "acs", "config: a FIFO"),
    ("bridge config /dev/zero", "healthy", f"{SWITCH_PORT}/config", "zero", "acs", "character"),
    ("bridge config of 8 KiB", "healthy", f"{SWITCH_PORT}/config", "big", "acs", "over 4096"),
    (
        "driver params FIFO",
        "direct-staged",
        "proc/driver/nvidia/params",
        "fifo",
        "p2p_driver",
        "params: a FIFO",
    ),
    (
        "driver params /dev/zero",
        "direct-staged",
        "proc/driver/nvidia/params",
        "zero",
        "p2p_driver",
        "a character device",
    ),
]


def _host_copy(tmp_path: Path, case: str, relative: str, kind: str) -> Path:
    root = tmp_path / "host"
    shutil.copytree(HOST_FIXTURES / case, root, symlinks=True)
    target = root / relative
    target = target.parent.resolve() / target.name  # below the fixture's own symlinks
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "zero":
        target.symlink_to("/dev/zero")
    elif kind == "big":
        target.write_bytes(b"0" * (1 << 20))
    elif kind == "dir":
        target.mkdir()
    elif kind == "binary":
        target.write_bytes(b"\xff\xfe0x10de\n")
    return root


def run_host_checks_cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_SM120_")}
    full_env.update(env)
    command = args or ("-m", "sglang_sm120.machine.host_checks", "--tp", "2", "--json")
    return subprocess.run(
        [sys.executable, *command],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=30,
        preexec_fn=lambda: resource.setrlimit(
            resource.RLIMIT_AS, (HOST_MEMORY_LIMIT, HOST_MEMORY_LIMIT)
        ),
    )


def _checks(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return {c["name"]: c for c in json.loads(proc.stdout)}


@pytest.mark.parametrize(
    ("case", "relative", "kind", "name", "fragment"),
    [r[1:] for r in SYSFS_FILE_ROWS],
    ids=[r[0] for r in SYSFS_FILE_ROWS],
)
def test_a_sysfs_file_that_cannot_be_read_in_bounds_makes_its_check_unknown(
    case, relative, kind, name, fragment, tmp_path
):
    root = _host_copy(tmp_path, case, relative, kind)
    check = _checks(run_host_checks_cli({SYSFS_ENV: str(root)}))[name]
    assert check["status"] == "unknown", check
    assert fragment in check["detail"] and Path(relative).name in check["detail"], check


def test_doctor_on_a_sysfs_root_with_a_fifo_finishes(tmp_path):
    root = _host_copy(tmp_path, "healthy", "proc/cmdline", "fifo")
    proc = run_cli("doctor", "--json", env={SYSFS_ENV: str(root)}, timeout=TIME_LIMIT_S)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    iommu = next(c for c in json.loads(proc.stdout)["host_checks"] if c["name"] == "iommu")
    assert iommu["status"] == "unknown" and "a FIFO" in iommu["detail"], iommu


def _empty_dir(tmp_path: Path) -> str:
    (tmp_path / "empty").mkdir()
    return str(tmp_path / "empty")


def _regular_file(tmp_path: Path) -> str:
    (tmp_path / "a-file").write_text("sys\n")
    return str(tmp_path / "a-file")


# id, the variable's value (from tmp_path), a fragment of every check's detail
SYSFS_ROOT_ROWS = [
    ("missing", lambda t: str(t / "nowhere"), "does not exist"),
    ("regular file", _regular_file, "not a directory"),
    ("empty directory", _empty_dir, "holds neither sys/ nor proc/"),
    ("empty value", lambda t: "", "empty"),
    ("control characters", lambda t: "/\n\x1b[2J", "\\n\\x1b"),
    ("not UTF-8", lambda t: os.fsdecode(b"/tmp/\xff\xfe-root"), "not UTF-8"),
]


@pytest.mark.parametrize(
    ("value", "fragment"), [r[1:] for r in SYSFS_ROOT_ROWS], ids=[r[0] for r in SYSFS_ROOT_ROWS]
)
def test_a_sysfs_root_that_cannot_be_used_makes_every_check_unknown(value, fragment, tmp_path):
    checks = _checks(run_host_checks_cli({SYSFS_ENV: value(tmp_path)}))
    for check in checks.values():
        assert check["status"] == "unknown", check
        assert check["detail"].startswith(f"{SYSFS_ENV}="), check
        assert fragment in check["detail"] and len(check["detail"]) < 200, check


# ---- issue 26 item 1 / issue 27 kind 3: document values
# A document of the right syntax whose values are of the wrong type or range (a string where a
# number or a boolean belongs, NaN, a negative bandwidth, a missing field, a field nested in the
# wrong place) is refused whole, in one line naming the file and the field, and the server plans
# as if it were absent. Each row changes a valid document the way its id says.

import logging  # noqa: E402
import re  # noqa: E402

from sglang_sm120.machine.cache import host_fingerprint  # noqa: E402
from sglang_sm120.machine.facts import facts_from_json, load_profile  # noqa: E402
from sglang_sm120.machine.host_checks import P2PSummary  # noqa: E402
from sglang_sm120.machine.p2p_probe import load_probe, probe_path, save_probe  # noqa: E402
from sglang_sm120.machine.topology import TopologyError  # noqa: E402
from sglang_sm120.planning.tuning import Measurement, TuningTable, load_table, save_table  # noqa: E402
from sglang_sm120.server import runtime  # noqa: E402
from sglang_sm120.strict_json import FieldError  # noqa: E402

PCIE8_FACTS = load_profile("rtx-pro-6000-x8-pcie")
NAN = float("nan")
REMOVE = object()  # a row's value that deletes the key


def _set(path: str, value):
    """A row's change: set the value at ``path`` ("a.b[0].c") of a document, or delete it."""

    def change(document):
        *parents, last = path.replace("[", ".").replace("]", "").split(".")
        node = document
        for part in parents:
            node = node[int(part) if part.isdigit() else part]
        key = int(last) if last.isdigit() else last
        if value is REMOVE:
            del node[key]
        else:
            node[key] = value
        return document

    return change


def _valid_table_json(tp: int = 8) -> dict:
    rows = [Measurement("trtllm", t, 5.0, True) for t in (4, 64)]
    rows += [Measurement("nccl", t, 50.0, True) for t in (4, 64)]
    fingerprint = host_fingerprint(PCIE8_FACTS, tp)
    return TuningTable(fingerprint, tp, 7168, "bfloat16", tuple(rows)).to_json()


# id, change, the field and complaint the one line names
TABLE_VALUES = [
    ("us a string", _set("measurements[0].us", "5.0"), "measurements[0].us must be a number"),
    ("us negative", _set("measurements[0].us", -5.0), "measurements[0].us must be a number >= 0"),
    ("us NaN", _set("measurements[0].us", NAN), "measurements[0].us must be a number"),
    ("correct a string", _set("measurements[1].correct", "false"), ".correct must be true or"),
    ("correct a number", _set("measurements[1].correct", 1), "measurements[1].correct must be"),
    ("tokens a string", _set("measurements[0].tokens", "4"), "measurements[0].tokens must be an"),
    ("tokens zero", _set("measurements[0].tokens", 0), "measurements[0].tokens must be an integer"),
    ("backend unknown", _set("measurements[0].backend", "nvl"), "measurements[0].backend must be"),
    ("tp a string", _set("tp", "8"), "'tp' must be an integer"),
    ("tp a bool", _set("tp", True), "'tp' must be an integer"),
    ("hidden negative", _set("hidden", -7168), "'hidden' must be an integer"),
    ("version a string", _set("version", "2"), "'version' must be an integer"),
    ("ranks_share_gpu a string", _set("ranks_share_gpu", "no"), "'ranks_share_gpu' must be true"),
    (
        "us missing",
        _set("measurements[0].us", REMOVE),
        "measurements[0]: missing required key 'us'",
    ),
    ("hidden missing", _set("hidden", REMOVE), "missing required key 'hidden'"),
    ("measurements an object", _set("measurements", {"0": {}}), "'measurements' must be a list"),
    (
        "measurement a list",
        _set("measurements[0]", ["trtllm", 4, 5.0, True]),
        "measurements[0] must",
    ),
    ("cell nested in a cell", _set("measurements[0].us", {"us": 5.0}), "measurements[0].us must"),
    ("notes a string", _set("notes", "measured"), "'notes' must be a list"),
    ("misspelt key", _set("measurements[0].micros", 5.0), "unknown key 'micros'"),
]


@pytest.fixture
def value_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    ("change", "fragment"), [r[1:] for r in TABLE_VALUES], ids=[r[0] for r in TABLE_VALUES]
)
def test_a_tuning_table_with_a_bad_value_is_refused_whole(value_cache, change, fragment):
    path = save_table(TuningTable.from_json(_valid_table_json()))
    assert load_table(PCIE8_FACTS, 8, 7168, "bfloat16")[0] is not None  # the valid one is used
    path.write_text(json.dumps(change(_valid_table_json())))  # NaN: as Python writes it
    table, note = load_table(PCIE8_FACTS, 8, 7168, "bfloat16")
    assert table is None and note.startswith(f"tuning table {path} unreadable: "), note
    assert "\n" not in note and (fragment in note or "NaN is not JSON" in note), note
    with pytest.raises(FieldError, match=re.escape(fragment)):  # the same value, parsed
        TuningTable.from_json(change(_valid_table_json()))


def test_a_table_with_a_string_time_lets_the_launcher_plan_without_it(model_dirs, value_cache):
    """Before: ``"us": "5.0"`` loaded, and SGLang's fusion auto-enable pass raised TypeError
    in the launcher. Now the real ServerArgs resolve, planned without the table (TP8's default:
    fusion off), and the plan says why the table was not used."""
    from test_plugin_sglang import resolve_in_launcher

    path = save_table(TuningTable.from_json(_valid_table_json()))
    path.write_text(json.dumps(_set("measurements[0].us", "5.0")(_valid_table_json())))
    launched = resolve_in_launcher(
        model_dirs["KimiK25ForConditionalGeneration"],
        8,
        server_args={"flashinfer_allreduce_fusion_backend": "auto"},
        env={"SGLANG_SM120_CACHE_DIR": str(value_cache)},
    )
    assert launched["fusion_backend"]["8"] is None
    reasons = json.loads(launched["launch_plan"]["8"])["plan"]["reasons"]
    expected = f"tuning table {path} unreadable: measurements[0].us must be a number"
    assert any(expected in reason for reason in reasons), reasons


def _valid_probe_json(gpus=(0, 1, 2, 3)) -> dict:
    summary = P2PSummary(tuple(gpus), 52.4, 49.9, 2.0, 2.6, 0.12, 0.85, 0.8, True, "2026-12-01")
    return {
        "version": 1,
        "fingerprint": host_fingerprint(PCIE8_FACTS, len(gpus), tuple(gpus)),
        "gpus": list(gpus),
        "created": "2026-12-01T10:00:00",
        "pairs": [],
        "concurrent": [],
        "summary": summary.to_json(),
        "notes": [],
    }


# id, change, the field and complaint the one line names
PROBE_VALUES = [
    ("collapse the string false", _set("summary.collapse", "false"), "summary.collapse must be"),
    ("collapse the string no", _set("summary.collapse", "no"), "summary.collapse must be true or"),
    ("collapse a number", _set("summary.collapse", 0), "summary.collapse must be true or false"),
    ("bandwidth the string nan", _set("summary.pair_write_gbps", "nan"), "pair_write_gbps must"),
    ("bandwidth NaN", _set("summary.pair_read_gbps", NAN), "summary.pair_read_gbps must be"),
    ("bandwidth negative", _set("summary.pair_write_gbps", -50.0), "pair_write_gbps must be a"),
    ("ratio negative", _set("summary.write_ratio", -0.1), "summary.write_ratio must be a number"),
    ("latency a string", _set("summary.write_latency_us", "2"), "write_latency_us must be a"),
    ("gpus strings", _set("summary.gpus", ["0", "1", "2", "3"]), "summary.gpus[0] must be an"),
    ("gpu negative", _set("summary.gpus[0]", -1), "summary.gpus[0] must be an integer"),
    ("ratio missing", _set("summary.staged_ratio", REMOVE), "summary: missing required key"),
    ("summary a list", _set("summary", [0.12, 0.85]), "'summary' must be a JSON object"),
    ("summary flattened", _set("summary", {"summary": {}}), "summary: unknown key 'summary'"),
    ("version a string", _set("version", "1"), "'version' must be an integer"),
]


@pytest.mark.parametrize(
    ("change", "fragment"), [r[1:] for r in PROBE_VALUES], ids=[r[0] for r in PROBE_VALUES]
)
def test_a_p2p_probe_with_a_bad_value_is_refused_whole(value_cache, change, fragment):
    path = save_probe(_valid_probe_json())
    assert load_probe(PCIE8_FACTS, (0, 1, 2, 3))[0] is not None  # the valid one is read
    path.write_text(json.dumps(change(_valid_probe_json())))
    summary, note = load_probe(PCIE8_FACTS, (0, 1, 2, 3))
    assert summary is None and note.startswith(f"no p2p probe ({path} "), note
    assert "\n" not in note and (fragment in note or "NaN is not JSON" in note), note


@pytest.mark.parametrize(
    ("make", "fragment"),
    [(os.mkfifo, "a FIFO, not a regular file"), (lambda p: p.symlink_to("/dev/zero"), "device")],
    ids=["fifo", "link to /dev/zero"],
)
def test_a_p2p_probe_that_is_not_a_regular_file_is_refused_at_once(value_cache, make, fragment):
    """Not read as absent: the note names the file and what it is (read_json_file's check)."""
    path = probe_path(host_fingerprint(PCIE8_FACTS, 2, (0, 1)), (0, 1))
    make(path)
    summary, note = load_probe(PCIE8_FACTS, (0, 1))
    assert summary is None and note.startswith(f"no p2p probe ({path} unreadable: "), note
    assert fragment in note, note


def test_a_summary_with_nan_from_python_is_refused():
    data = {**_valid_probe_json()["summary"], "pair_write_gbps": NAN}
    with pytest.raises(FieldError, match="pair_write_gbps must be a number >= 0, got nan"):
        P2PSummary.from_json(data, "summary")


def _gpu(**changes) -> dict:
    gpu = {**GPU, **changes}
    return {key: value for key, value in gpu.items() if value is not REMOVE}


# id, topology document, the field and complaint the one line names
TOPOLOGY_VALUES = [
    ("numa node a string", topology(gpus=[_gpu(numa_node="0")] * 2), "gpus[0].numa_node must be"),
    ("numa node past the bound", topology(gpus=[_gpu(numa_node=10**30)] * 2), ".numa_node must"),
    ("numa node a bool", topology(gpus=[_gpu(numa_node=True)] * 2), "gpus[0].numa_node must be"),
    ("memory a string", topology(gpus=[_gpu(memory_gib="96")] * 2), "gpus[0].memory_gib must be"),
    ("memory NaN", topology(gpus=[_gpu(memory_gib=NAN)] * 2), "gpus[0].memory_gib must be"),
    ("memory negative", topology(gpus=[_gpu(memory_gib=-96.0)] * 2), "gpus[0].memory_gib must"),
    ("memory past the bound", topology(gpus=[_gpu(memory_gib=1e300)] * 2), ".memory_gib must be"),
    ("nvlink the string false", topology(nvlink="false"), "'nvlink' must be true or false"),
    ("nnodes a string", topology(nnodes="1"), "'nnodes' must be an integer 1..1024"),
    ("nnodes a float", topology(nnodes=1.0), "'nnodes' must be an integer 1..1024"),
    ("capability a bool", topology(gpus=[_gpu(capability=[True, 0])] * 2), ".capability must"),
    ("name missing", topology(gpus=[_gpu(name=REMOVE)] * 2), "missing required key 'name'"),
    ("gpu nested in a list", topology(gpus=[[GPU], [GPU]]), "gpus[0] must be an object"),
    ("driver version a number", topology(driver_version=580.95), "'driver_version' must be"),
]


@pytest.mark.parametrize(
    ("document", "fragment"), [r[1:] for r in TOPOLOGY_VALUES], ids=[r[0] for r in TOPOLOGY_VALUES]
)
def test_a_topology_with_a_bad_value_is_refused_naming_the_field(document, fragment):
    with pytest.raises(TopologyError, match=re.escape("file:box.json: ")) as raised:
        facts_from_json(document, "file:box.json")
    assert fragment in str(raised.value) and "\n" not in str(raised.value)


def test_a_topology_file_with_a_string_for_a_number_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "box.json"
    path.write_text(json.dumps(topology(gpus=[_gpu(memory_gib="96")] * 2)))
    proc = run_bounded("plan", "--topology", str(path), "--tp", "2")
    assert_one_line_error(proc, f"file:{path}: gpus[0].memory_gib must be a number > 0")


def _valid_launch_plan() -> dict:
    return {
        "tp_size": 2,
        "gpu_ids": [0, 1],
        "capability": {
            "sm12x": True,
            "fusion_capable": True,
            "pcie_ipc_capable": True,
            "reasons": ["test host"],
            "validation": False,
        },
        "plan": {
            "managed": True,
            "fusion_backend": "trtllm",
            "plain_allreduce": "pcie_ipc",
            "reasons": ["fusion trtllm"],
            "routes": [],
        },
    }


# id, change, the field and complaint the one warning names
LAUNCH_PLAN_VALUES = [
    ("tp_size a string", _set("tp_size", "2"), "'tp_size' must be an integer"),
    ("tp_size past the bound", _set("tp_size", 10**20), "'tp_size' must be an integer 1.."),
    ("tp_size a float", _set("tp_size", 2.0), "'tp_size' must be an integer"),
    ("gpu_ids a string", _set("gpu_ids", "0,1"), "'gpu_ids' must be a list"),
    ("gpu id negative", _set("gpu_ids[0]", -1), "gpu_ids[0] must be an integer"),
    ("gpu id a bool", _set("gpu_ids[1]", True), "gpu_ids[1] must be an integer"),
    ("gpu_ids missing", _set("gpu_ids", REMOVE), "missing required key 'gpu_ids'"),
    ("managed the string false", _set("plan.managed", "false"), "plan.managed must be true or"),
    ("validation a string", _set("capability.validation", "no"), "capability.validation must"),
    ("sm12x a number", _set("capability.sm12x", 1), "capability.sm12x must be true or false"),
    ("reason a number", _set("plan.reasons[0]", 3), "plan.reasons[0] must be a string"),
    ("plan flattened", _set("managed", True), "unknown key 'managed'"),
    ("plan misspelt key", _set("plan.route", []), "plan: unknown key 'route'"),
    ("route bound a float", _set("plan.routes", [[1, 4.0, "trtllm"]]), "plan.routes"),
]


@pytest.mark.parametrize(
    ("change", "fragment"),
    [r[1:] for r in LAUNCH_PLAN_VALUES],
    ids=[r[0] for r in LAUNCH_PLAN_VALUES],
)
def test_a_launch_plan_with_a_bad_value_is_ignored_naming_the_field(
    fresh_worker, caplog, change, fragment
):
    fresh_worker.setenv(runtime.LAUNCH_PLAN_ENV, json.dumps(_valid_launch_plan()))
    assert runtime.worker_plan() is not None  # the valid one is followed
    runtime._launch_plan.cache_clear()
    fresh_worker.setenv(runtime.LAUNCH_PLAN_ENV, json.dumps(change(_valid_launch_plan())))
    with caplog.at_level(logging.WARNING, logger="sglang_sm120"):
        assert runtime.worker_plan() is None and runtime.worker_tp_size() is None
    warnings = [r.getMessage() for r in caplog.records if r.name == "sglang_sm120"]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert warnings[0].startswith(f"sglang-sm120: {runtime.LAUNCH_PLAN_ENV} unreadable (")
    assert fragment in warnings[0], warnings[0]


# ---- issue 27 kinds 4-8: variables
# Each row: the variable and its value, the call that reads it, and what the one line (a
# refusal, a warning) must say; the call never raises anything but that one refusal.

HUGE = "9" * 200
LONG = "x" * 5000


def _no_ours(monkeypatch) -> None:
    for name in list(os.environ):
        if name.startswith(("SGLANG_SM120_", "SGL_KERNEL_SM120_", "SGLANG_KERNEL_SM120_")):
            monkeypatch.delenv(name)


# kind 4: sgl-kernel-sm120's tuning variables have a bound the kernels honour, named when refused
KERNEL_BOUND_ROWS = [
    ("SGLANG_SM120_ONESHOT_MAX_BYTES", str(2**40), "is above the bound 67108864"),
    ("SGLANG_SM120_BLOCK_BYTES", str(2**40), "is above the bound 67108864"),
    ("SGLANG_SM120_FUSED_ROWS_PER_BLOCK", str(2**40), "is above the bound 2048"),
    ("SGLANG_SM120_TWOSHOT_LAMPORT_MAX_BYTES", str(2**40), "is above the bound 67108864"),
    ("SGLANG_SM120_MAX_BLOCKS", str(2**40), "SGLANG_SM120_MAX_BLOCKS='1099511627776' is above"),
    ("SGLANG_SM120_BLOCK_BYTES", HUGE, "'9999999999999999999999999999999999999999' is above"),
]


@pytest.mark.parametrize(("name", "value", "line"), KERNEL_BOUND_ROWS)
def test_kernel_tuning_variables_past_their_bound_are_refused(monkeypatch, name, value, line):
    from sgl_kernel_sm120.config import resolve_tuning

    _no_ours(monkeypatch)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="bound") as refused:
        resolve_tuning(2)
    assert line in str(refused.value) and len(str(refused.value)) < 200


@pytest.mark.parametrize(
    "name", ["SGLANG_SM120_MAX_BLOCKS", "SGLANG_SM120_BLOCK_BYTES", "SGLANG_SM120_TIMEOUT_MS"]
)
def test_kernel_variables_take_ascii_digits_only(monkeypatch, name):
    """SGLANG_SM120_MAX_BLOCKS='٨' was read as 8: the kernel package's env_int, like every
    reader of ours, takes ASCII digits only; doctor shows it refused."""
    from sgl_kernel_sm120 import config
    from sglang_sm120.server.env_report import variables_report

    _no_ours(monkeypatch)
    monkeypatch.setenv(name, EIGHT)
    with pytest.raises(ValueError, match="is not an integer"):
        config.env_int(name, maximum=1 << 40)
    (row,) = [row for row in variables_report() if row["name"] == name]
    assert row["status"].startswith("refused (") and "is not an integer" in row["status"], row


def test_kernel_tuning_variables_at_their_bound_are_used(monkeypatch):
    from sgl_kernel_sm120 import config

    _no_ours(monkeypatch)
    monkeypatch.setenv("SGLANG_SM120_BLOCK_BYTES", str(config.MAX_MESSAGE_BYTES))
    monkeypatch.setenv("SGLANG_SM120_FUSED_ROWS_PER_BLOCK", str(config.MAX_TOKENS))
    tuning = config.resolve_tuning(2)
    assert (tuning.block_bytes, tuning.fused_rows_per_block) == (64 << 20, 2048)


@pytest.mark.parametrize(
    ("value", "status_part"), [("0", "off"), ("on", "on"), ("sometimes", "is not a switch")]
)
def test_doctor_reads_the_early_launch_switch_as_the_kernel_package_does(
    monkeypatch, value, status_part
):
    """$SGLANG_SM120_PDL is read by sgl-kernel-sm120 (config.env_switch) when a workspace is
    created; doctor asks the same function, so what it shows is what the kernels get."""
    from sgl_kernel_sm120 import config
    from sglang_sm120.server.env_report import variables_report

    _no_ours(monkeypatch)
    monkeypatch.setenv("SGLANG_SM120_PDL", value)
    (row,) = [row for row in variables_report() if row["name"] == "SGLANG_SM120_PDL"]
    assert status_part in str(row), row
    if status_part == "is not a switch":
        assert row["status"].startswith("refused ("), row
        with pytest.raises(ValueError, match="is not a switch"):
            config.resolve_tuning(2)
    else:
        assert config.resolve_tuning(2).early_launch is (value == "on")


# kind 5: every switch and every numeric knob goes through the one reader and its words
def _kernel_required() -> bool:
    from kernel_library import kernel_required

    return kernel_required()


def _startup_s() -> float:
    from sglang_sm120.server.env_report import E2E_STARTUP_S

    return E2E_STARTUP_S.read()


def _e2e_tp() -> tuple:
    from sglang_sm120.commands.e2e import TP_SIZES, env_list

    return env_list("SGLANG_SM120_E2E_TP", TP_SIZES)


def _e2e_tree() -> tuple:
    from sglang_sm120.commands.e2e import env_list

    return env_list("SGLANG_SM120_E2E_REAL_TREE", (3, 1, 4))


def _e2e_parallel() -> int:
    from sglang_sm120.server.env_report import E2E_PARALLEL

    return E2E_PARALLEL.read()


EIGHT = "\u0668"  # ARABIC-INDIC DIGIT EIGHT: str.isdigit() and int() take it, C readers do not


SWITCH_AND_KNOB_ROWS = [
    ("SGLANG_SM120_KERNEL_REQUIRED", "true", _kernel_required, True, None),
    ("SGLANG_SM120_KERNEL_REQUIRED", " On ", _kernel_required, True, None),
    ("SGLANG_SM120_KERNEL_REQUIRED", "0", _kernel_required, False, None),
    ("SGLANG_SM120_E2E_STARTUP_S", "", _startup_s, 900.0, None),
    ("SGLANG_SM120_E2E_STARTUP_S", "abc", _startup_s, 900.0, "'abc' is not a number"),
    ("SGLANG_SM120_E2E_STARTUP_S", "nan", _startup_s, 900.0, "'nan' is not a number in"),
    ("SGLANG_SM120_E2E_STARTUP_S", "inf", _startup_s, 900.0, "'inf' is not a number in"),
    ("SGLANG_SM120_E2E_STARTUP_S", "-5", _startup_s, 900.0, "'-5' is not a number in"),
    ("SGLANG_SM120_E2E_STARTUP_S", "1e400", _startup_s, 900.0, "(0, 86400.0]"),
    ("SGLANG_SM120_E2E_STARTUP_S", "120", _startup_s, 120.0, None),
    ("SGLANG_SM120_E2E_TP", "2,x", _e2e_tp, (1, 2, 4, 8), "'x' is not an integer"),
    ("SGLANG_SM120_E2E_TP", "0", _e2e_tp, (1, 2, 4, 8), "'0' is not an integer in (0, 8]"),
    ("SGLANG_SM120_E2E_TP", "2, 4", _e2e_tp, (2, 4), None),
    ("SGLANG_SM120_E2E_TP", ",,,", _e2e_tp, (1, 2, 4, 8), "',,,' has an empty item"),
    ("SGLANG_SM120_E2E_TP", "2,,4", _e2e_tp, (1, 2, 4, 8), "has an empty item"),
    ("SGLANG_SM120_E2E_REAL_TREE", "3,1", _e2e_tree, (3, 1, 4), "has 2 items, not 3 (steps"),
    ("SGLANG_SM120_E2E_REAL_TREE", "5,1,6", _e2e_tree, (5, 1, 6), None),
    ("SGLANG_SM120_E2E_TP", EIGHT, _e2e_tp, (1, 2, 4, 8), "is not an integer"),
    ("SGLANG_SM120_E2E_STARTUP_S", EIGHT, _startup_s, 900.0, "is not a number"),
    ("SGLANG_SM120_E2E_PARALLEL", EIGHT, _e2e_parallel, 4, "is not an integer"),
    ("SGLANG_SM120_E2E_PARALLEL", "8", _e2e_parallel, 8, None),
]


@pytest.mark.parametrize(
    ("name", "value", "read", "expected", "line"),
    SWITCH_AND_KNOB_ROWS,
    ids=[f"{r[0]}={r[1]!r}" for r in SWITCH_AND_KNOB_ROWS],
)
def test_switch_and_knob_words(monkeypatch, caplog, name, value, read, expected, line):
    from sglang_sm120.server import runtime

    _no_ours(monkeypatch)
    monkeypatch.setattr(runtime, "_logged", set())
    monkeypatch.setenv(name, value)
    assert read() == expected
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if line is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and f"{name}=" in warnings[0] and line in warnings[0], warnings


# kind 6: a long value is shown escaped and cut at 40 characters, never a traceback
HOST_CHECKS = (sys.executable, "-m", "sglang_sm120.machine.host_checks")
LONG_VALUE_COMMAND_ROWS = [
    ({"SGLANG_SM120_TOPOLOGY": "nope"}, "'nope' is neither an embedded profile"),
    ({"SGLANG_SM120_TOPOLOGY": LONG}, "(5000 characters) is no usable file name"),
    ({"SGLANG_SM120_TOPOLOGY": HUGE}, "'9999999999999999999999999999999999999999'..."),
    ({"SGLANG_SM120_TOPOLOGY": "a\nb"}, "'a\\nb' is neither"),
]


@pytest.mark.parametrize(
    ("env", "line"), LONG_VALUE_COMMAND_ROWS, ids=["nope", "long", "huge", "nl"]
)
def test_host_checks_module_with_a_bad_topology_is_one_line(env, line):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_SM120_")}
    proc = subprocess.run(
        HOST_CHECKS, capture_output=True, text=True, env={**full_env, **env}, timeout=120
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and line in lines[0] and len(lines[0]) < 400, lines


LONG_VALUE_REPORT_ROWS = [
    ("SGLANG_SM120_ANY_ARCH", HUGE, "refused (only 1 turns validation mode on)"),
    ("SGLANG_SM120_DISABLE", HUGE, "is not a switch value"),
    ("SGLANG_SM120_FUSION_BACKEND", HUGE, "refused (not one of auto, off, trtllm, sm120_pcie)"),
    ("SGLANG_SM120_TOPOLOGY", LONG, "is no usable file name"),
    ("SGLANG_SM120_TIMEOUT_MS", "9" * 5000, "is not an integer"),
]


@pytest.mark.parametrize(("name", "value", "status"), LONG_VALUE_REPORT_ROWS)
def test_doctor_variables_show_a_long_value_cut(monkeypatch, name, value, status):
    from sglang_sm120.server.env_report import variables_report

    _no_ours(monkeypatch)
    monkeypatch.setenv(name, value)
    (row,) = [r for r in variables_report() if r["name"] == name]
    assert row["value"] == repr(value[:40]) + f"... ({len(value)} characters)"
    assert status in row["status"] and value[:41] not in row["status"], row


@pytest.mark.parametrize(("name", "value", "warning"), LONG_VALUE_REPORT_ROWS[:3])
def test_the_server_warning_for_a_long_value_is_cut(monkeypatch, caplog, name, value, warning):
    from sglang_sm120.server import runtime

    _no_ours(monkeypatch)
    monkeypatch.setattr(runtime, "_logged", set())
    monkeypatch.setenv(name, value)
    runtime.plugin_disabled(), runtime.validation_mode(), runtime.plugin_backend()
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "(200 characters)" in line and value[:41] not in line and len(line) < 250, line


# kind 7: a path of bytes that are not UTF-8 is printed escaped (stdout strictly UTF-8 here)
def test_plan_prints_a_non_utf8_kernel_library_path_escaped():
    proc = run_bounded(
        "plan",
        *PCIE8,
        "--tp",
        "2",
        "--model-arch",
        "DeepseekV3ForCausalLM",
        env={
            "PYTHONIOENCODING": "utf-8",
            "SGLANG_SM120_FUSION_BACKEND": "sm120_pcie",
            "SGLANG_SM120_KERNEL_LIBRARY": os.fsdecode(b"/no/\xff\nlib.so"),
        },
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "/no/\\udcff\\nlib.so not found" in proc.stdout, proc.stdout


def test_the_variables_report_of_a_non_utf8_cache_dir_is_escaped(monkeypatch, tmp_path):
    from sglang_sm120.server.env_report import variables_report

    _no_ours(monkeypatch)
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", os.fsdecode(bytes(tmp_path) + b"/\xff\x01"))
    (row,) = variables_report()
    assert row["status"] == "accepted" and row["used"].endswith("/\\udcff\\x01"), row
    row["used"].encode("utf-8")  # printable anywhere


# kind 8: SGLANG_SM120_STATS_DIR: a name with control characters or non-UTF-8 bytes is refused,
# and reading the patch's setting never creates a directory
STATS_ROWS = [
    ("stats\x01dir", "SGLANG_SM120_STATS_DIR='stats\\x01dir' refused"),
    ("a\nb", "SGLANG_SM120_STATS_DIR='a\\nb' refused"),
    (os.fsdecode(b"st\xffats"), "SGLANG_SM120_STATS_DIR='st\\udcffats' refused"),
]


@pytest.mark.parametrize(("value", "line"), STATS_ROWS, ids=["control", "newline", "not utf-8"])
def test_a_stats_dir_name_that_is_not_printable_is_refused(monkeypatch, value, line):
    from sglang_sm120.planning.policy import Capability
    from sglang_sm120.server.patches import graph_stats

    _no_ours(monkeypatch)
    monkeypatch.setenv("SGLANG_SM120_STATS_DIR", value)
    reason = graph_stats.not_needed(Capability(True, True, True, ()))
    assert reason is not None and line in reason, reason


def test_the_stats_patch_creates_its_directory_only_when_it_writes(monkeypatch, tmp_path):
    from sglang_sm120.server.patches import graph_stats

    _no_ours(monkeypatch)
    directory = tmp_path / "stats"
    monkeypatch.setenv("SGLANG_SM120_STATS_DIR", str(directory))
    monkeypatch.setattr(graph_stats.atexit, "register", lambda fn: None)
    graph_stats.apply_setting()
    assert not directory.exists()  # doctor's TP-worker rehearsal counts nothing, writes nothing
    graph_stats._stats.bump(graph_stats._stats.captures, "DECODE")
    assert (directory / f"sm120-stats-{os.getpid()}.json").is_file()


# kind 7: values only SGLang's own spawners write, and digits of other scripts
@pytest.mark.parametrize(
    "value",
    ["__main__:<module>", "sglang_sm120.commands.cli:main", "no colon", "a b:c", "m:<lambda>"],
)
def test_a_scheduler_entry_that_no_spawner_writes_is_ignored_with_one_warning(
    monkeypatch, caplog, value
):
    """SGLANG_SM120_SCHEDULER_ENTRY='__main__:<module>' made every module-level frame of a
    script (this test run's own ``__main__``) a TP worker's entry; doctor's own ``main`` too.
    Such a value is refused with one warning naming the variable; roles stay upstream's."""
    from sglang_sm120.server import runtime
    from sglang_sm120.server.env_report import variables_report

    _no_ours(monkeypatch)
    monkeypatch.setattr(runtime, "_logged", set())
    monkeypatch.setenv(runtime.SCHEDULER_ENTRY_ENV, value)
    assert runtime.role_from_stack(sys._getframe()) is None
    assert set(runtime._role_entries()) == {(m, q) for m, q, _ in runtime.ROLE_ENTRIES}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "SGLANG_SM120_SCHEDULER_ENTRY=" in warnings[0], warnings
    (row,) = [row for row in variables_report() if row["name"] == runtime.SCHEDULER_ENTRY_ENV]
    assert row["status"].startswith("refused ("), row


def test_a_scheduler_entry_a_spawner_writes_is_taken(monkeypatch, caplog):
    from sglang_sm120.server import runtime

    monkeypatch.setattr(runtime, "_logged", set())
    for value in ("my_fork.server:run_scheduler", "__main__:Runner.run.<locals>.child"):
        monkeypatch.setenv(runtime.SCHEDULER_ENTRY_ENV, value)
        module, _, qualname = value.partition(":")
        assert runtime._role_entries()[(module, qualname)] == "scheduler"
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("kind", [int, float])
def test_numbers_take_ascii_digits_only(kind):
    """``env_values.number`` (every numeric variable) and ``ascii_digits`` (the helper a
    table field's reader can use): '٨' is not 8, as NCCL and SGLang read it."""
    from sglang_sm120.env_values import ascii_digits, number

    with pytest.raises(ValueError, match=r"is not an? (integer|number)"):
        number("SGLANG_SM120_X", EIGHT, kind, maximum=100)
    assert number("SGLANG_SM120_X", " 8 ", kind, maximum=100) == 8
    assert [ascii_digits(t) for t in ("8", "16", EIGHT, "\u00b2", "", "8 ")] == [
        True, True, False, False, False, False
    ]  # fmt: skip


def test_cuda_visible_devices_of_other_digits_is_a_uuid_prefix_not_an_index(monkeypatch):
    """CUDA reads CUDA_VISIBLE_DEVICES='٠' as a UUID prefix (none matches), not as GPU 0."""
    from sglang_sm120.machine.facts import visible_nvml_indices

    class Nvml:
        def nvmlDeviceGetHandleByIndex(self, i):
            return i

        def nvmlDeviceGetUUID(self, handle):
            return f"GPU-{handle}aaaa"

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "\u0660")
    assert visible_nvml_indices(2, Nvml()) == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert visible_nvml_indices(2, Nvml()) == [1, 0]


def test_doctors_sglang_import_failing_for_a_home_that_is_a_file_is_one_line(tmp_path):
    """HOME a regular file: torch makes its cache directory below it while SGLang imports and
    raises NotADirectoryError. doctor's import of SGLang says so in one line with the cause
    (one fresh interpreter: this one imported SGLang long ago)."""
    home = tmp_path / "home"
    home.write_text("not a directory")
    code = (
        "from sglang_sm120.commands.args import UsageError\n"
        "from sglang_sm120.commands.plugin_check import import_sglang\n"
        "try:\n    import_sglang()\nexcept UsageError as exc:\n    print('REFUSED', exc)\n"
    )
    proc = subprocess.run(  # only PATH and HOME: SGLang's import in this process set others
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)},
        timeout=TIME_LIMIT_S,
        preexec_fn=_limit_memory,
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = proc.stdout.splitlines()
    assert line.startswith("REFUSED sglang does not import (NotADirectoryError: "), line
    assert str(home) in line, line
