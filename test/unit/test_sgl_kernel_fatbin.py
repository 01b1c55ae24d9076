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
