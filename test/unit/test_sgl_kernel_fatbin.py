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


def _run(*args: str) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
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
