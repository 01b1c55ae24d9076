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
        "numa_node must be an integer >= 0",
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
    assert_one_line_error(proc, "sglang is not importable (No module named 'sglang')")


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
