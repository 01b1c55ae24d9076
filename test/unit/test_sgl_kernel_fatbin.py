"""The installed sgl-kernel-sm120 library carries SASS for sm_90 and sm_120, plus PTX.

Runs on CPU: `cuobjdump --list-elf` reads the fat binary without a GPU. cuobjdump is taken from
$CUOBJDUMP, PATH, $CUDA_HOME/bin, or the `nvidia-cuda-cuobjdump` wheel. Without the installed
package the test skips, unless SGLANG_SM120_KERNEL_REQUIRED=1 (CI), where it fails.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from kernel_library import KERNEL_REQUIRED_ENV, kernel_required

LIBRARY_NAME = "libsgl_kernel_sm120.so"


def _missing(reason: str) -> None:
    if kernel_required():
        pytest.fail(f"{KERNEL_REQUIRED_ENV}=1: {reason}")
    pytest.skip(reason)


def _installed_library() -> Path:
    spec = importlib.util.find_spec("sgl_kernel_sm120")
    if spec is None or spec.origin is None:
        _missing("sgl-kernel-sm120 is not installed (pip install ./sgl-kernel-sm120)")
    library = Path(spec.origin).with_name(LIBRARY_NAME)
    if not library.is_file():
        _missing(f"{library} is missing: the package was not built with its CUDA library")
    return library


def _cuobjdump() -> str:
    candidates = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home:
        candidates.append(str(Path(cuda_home) / "bin" / "cuobjdump"))
    nvidia = importlib.util.find_spec("nvidia")
    for root in (nvidia.submodule_search_locations or []) if nvidia else []:
        candidates += [str(p) for p in sorted(Path(root).glob("cu*/bin/cuobjdump"))]
        candidates.append(str(Path(root) / "cuda_cuobjdump" / "bin" / "cuobjdump"))
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    _missing("cuobjdump not found (pip install nvidia-cuda-cuobjdump, or set $CUOBJDUMP)")
    raise AssertionError("unreachable")


def _nvdisasm_env() -> dict[str, str]:
    """The environment for `cuobjdump -sass`, which runs nvdisasm: from PATH or $NVDISASM_PATH,
    else beside cuobjdump (the `nvidia-cuda-nvdisasm` wheel installs it there)."""
    env = dict(os.environ)
    if shutil.which("nvdisasm") or env.get("NVDISASM_PATH"):
        return env
    beside = Path(_cuobjdump()).with_name("nvdisasm")
    if not beside.is_file():
        _missing("nvdisasm not found (pip install nvidia-cuda-nvdisasm, or set $NVDISASM_PATH)")
    env["NVDISASM_PATH"] = str(beside.parent)
    return env


def _run(*args: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False, env=env)
    assert result.returncode == 0, f"{' '.join(args)} failed: {result.stderr}"
    return result.stdout


def test_library_has_sass_for_sm90_and_sm120():
    listing = _run(_cuobjdump(), "--list-elf", str(_installed_library()))
    archs = set(re.findall(r"\.(sm_\d+[af]?)\.cubin", listing))
    assert "sm_90" in archs or "sm_90a" in archs, f"no sm_90 SASS in:\n{listing}"
    assert archs & {"sm_120", "sm_120a", "sm_120f"}, f"no sm_120 SASS in:\n{listing}"


def test_library_has_ptx_for_newer_gpus():
    listing = _run(_cuobjdump(), "--list-ptx", str(_installed_library()))
    assert re.search(r"\.sm_\d+[af]?\.ptx", listing), f"no PTX in:\n{listing}"


# An SM120 block can have at most 99 KiB of shared memory (RTX PRO 6000, RTX 5090), and a
# kernel tuned on the H200 (227 KiB) could ask for more and fail only at launch there.
SM120_MAX_SHARED_BYTES = 99 * 1024
RESOURCE_LINE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resource_usage(listing: str) -> dict[str, dict[str, int]]:
    """{kernel: {REG, STACK, SHARED, LOCAL}} from `cuobjdump -res-usage -arch ARCH`."""
    usage: dict[str, dict[str, int]] = {}
    name = None
    for line in listing.splitlines():
        line = line.strip()
        if line.startswith("Function ") and line.endswith(":"):
            name = line[len("Function ") : -1]
        elif name and (match := RESOURCE_LINE.search(line)):
            reg, stack, shared, local = map(int, match.groups())
            usage[name] = {"REG": reg, "STACK": stack, "SHARED": shared, "LOCAL": local}
            name = None
    return usage


@pytest.mark.parametrize("arch", ["sm_120", "sm_90"])
def test_kernels_neither_spill_nor_exceed_sm120_shared_memory(arch):
    """sm_120 is what ships; sm_90 is where the kernels are measured, and a spill there (several
    kernels sit at the 128-register bound) would make every H200 number a spilled kernel's."""
    listing = _run(_cuobjdump(), "-res-usage", "-arch", arch, str(_installed_library()))
    usage = resource_usage(listing)
    assert any("all_reduce_kernel" in name for name in usage), listing[:2000]
    problems = [
        f"{name}: {values}"
        for name, values in usage.items()
        if values["STACK"] or values["LOCAL"] or values["SHARED"] > SM120_MAX_SHARED_BYTES
    ]
    assert not problems, "spills to local memory or too much shared memory:\n" + "\n".join(problems)


def test_resource_usage_reader_sees_a_spill():
    listing = (
        " Function _Z3fooPv:\n  REG:128 STACK:16 SHARED:1092 LOCAL:16 CONSTANT[0]:1304\n"
        " Function _Z3barPv:\n  REG:64 STACK:0 SHARED:102400 LOCAL:0 CONSTANT[0]:1304\n"
    )
    usage = resource_usage(listing)
    assert usage["_Z3fooPv"]["LOCAL"] == 16 and usage["_Z3fooPv"]["STACK"] == 16
    assert usage["_Z3barPv"]["SHARED"] > SM120_MAX_SHARED_BYTES


# Programmatic dependent launch: sk_launch lets every kernel launch while the kernel ahead of it
# in the stream is still running, so a kernel's first global memory access must come after
# griddepcontrol.wait (SASS ACQBULK); a load the compiler hoisted above it would read what the
# previous kernel has not written yet.
SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([.\w]*)")
GLOBAL_MEMORY_OPCODES = {
    *("LDG", "STG", "LD", "ST", "ATOMG", "ATOM", "RED", "REDG", "LDGSTS"),
    *("SULD", "SUST", "SUATOM", "SURED", "TLD", "TEX", "UBLKCP", "UTMALDG", "UTMASTG"),
}
# The scan reads the code in address order, which is the order it runs in only up to the first
# jump: one before the wait could reach an access that the scan sees after it.
CONTROL_TRANSFER_OPCODES = {"BRA", "BRX", "JMP", "JMX", "CALL"}


def global_accesses_before_wait(listing: str) -> dict[str, str]:
    """{kernel: why} for each function of `cuobjdump -sass` output that touches global memory
    or jumps before its first ACQBULK, or has none."""
    problems: dict[str, str] = {}
    name, waited = None, False
    for line in listing.splitlines():
        stripped = line.strip()
        if stripped.startswith("Function : "):
            if name and not waited:
                problems.setdefault(name, "no griddepcontrol.wait (ACQBULK)")
            name, waited = stripped[len("Function : ") :], False
        elif name and not waited and (match := SASS_LINE.search(line)):
            opcode = match.group(1)
            if opcode == "ACQBULK":
                waited = True
            elif opcode in GLOBAL_MEMORY_OPCODES or opcode in CONTROL_TRANSFER_OPCODES:
                problems[name] = f"{opcode}{match.group(2)} before ACQBULK: {stripped}"
                waited = True  # reported; nothing more to learn from this function
    if name and not waited:
        problems.setdefault(name, "no griddepcontrol.wait (ACQBULK)")
    return problems


@pytest.mark.parametrize("arch", ["sm_120", "sm_90"])
def test_every_kernel_waits_for_the_previous_kernel_before_touching_memory(arch):
    listing = _run(
        _cuobjdump(), "-sass", "-arch", arch, str(_installed_library()), env=_nvdisasm_env()
    )
    assert listing.count("Function : ") >= 14, listing[:2000]
    problems = global_accesses_before_wait(listing)
    assert not problems, "\n".join(f"{name}: {why}" for name, why in problems.items())


def test_the_wait_check_sees_a_hoisted_load_a_jump_and_a_missing_wait():
    listing = (
        "\t\tFunction : _Z4goodv\n"
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;\n"
        "        /*0010*/                   ACQBULK ;\n"
        "        /*0020*/              @!P0 LDG.E.128 R4, desc[UR4][R2.64] ;\n"
        "\t\tFunction : _Z7hoistedv\n"
        "        /*0000*/              @!P0 LDG.E.128.CONSTANT R4, desc[UR4][R2.64] ;\n"
        "        /*0010*/                   ACQBULK ;\n"
        "\t\tFunction : _Z6nowaitv\n"
        "        /*0000*/                   LDS R4, [R2] ;\n"
        "        /*0010*/                   EXIT ;\n"
        "\t\tFunction : _Z6jumpedv\n"
        "        /*0000*/               @P0 BRA 0x40 ;\n"
        "        /*0010*/                   ACQBULK ;\n"
    )
    problems = global_accesses_before_wait(listing)
    assert set(problems) == {"_Z7hoistedv", "_Z6nowaitv", "_Z6jumpedv"}
    assert problems["_Z6jumpedv"].startswith("BRA before ACQBULK")
    assert "LDG.E.128.CONSTANT before ACQBULK" in problems["_Z7hoistedv"]
    assert "no griddepcontrol.wait" in problems["_Z6nowaitv"]
