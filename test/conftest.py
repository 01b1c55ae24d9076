"""Shared setup and fixtures.

- The repository's sources stand in for packages that are not installed (GPU boxes without
  sglang get neither the plugin nor, before a build, sgl-kernel-sm120); installed ones win.
- CUDA modules load eagerly: tests that emulate ranks as streams of one process have them spin
  on each other, and a lazily loaded kernel would wait for them.
- Config-only model directories (``model_configs.py``), enough for ServerArgs resolution on CPU.
- ``kernel_library.py`` beside this file: whether sgl-kernel-sm120 is here, for the tests that
  need it (they skip with the reason without it, or fail where SGLANG_SM120_KERNEL_REQUIRED=1).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from model_configs import MODEL_CONFIGS

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
ROOT = Path(__file__).resolve().parents[1]
for source in (ROOT / "python", ROOT / "sgl-kernel-sm120" / "python"):
    if str(source) not in sys.path:
        sys.path.append(str(source))


def write_model_config(root: Path, arch: str) -> Path:
    path = root / arch
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODEL_CONFIGS[arch]))
    return path


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: write_model_config(root, arch) for arch in MODEL_CONFIGS}


@pytest.fixture
def fresh_worker(monkeypatch):
    """A worker process on the 8x SM120 profile that has not read a launch plan yet."""
    from sglang_sm120.machine import facts
    from sglang_sm120.server import runtime

    monkeypatch.setenv("SGLANG_SM120_TOPOLOGY", "rtx-pro-6000-x8-pcie")
    caches = (facts.current_facts, runtime.sm12x_capability, runtime._launch_plan)
    for cached in caches:
        cached.cache_clear()
    yield monkeypatch
    for cached in caches:
        cached.cache_clear()


@pytest.fixture
def pcie_host(monkeypatch):
    """Our facts say 8x SM120 PCIe; restore the cached capability and statuses afterwards."""
    from sglang_sm120.machine import facts
    from sglang_sm120.server import runtime
    from sglang_sm120.server.runtime import PATCH_STATUS

    monkeypatch.setenv("SGLANG_SM120_TOPOLOGY", "rtx-pro-6000-x8-pcie")
    monkeypatch.delenv("SGLANG_SM120_DISABLE", raising=False)
    for cached in (facts.current_facts, runtime.sm12x_capability):
        cached.cache_clear()
    yield
    for cached in (facts.current_facts, runtime.sm12x_capability):
        cached.cache_clear()
    PATCH_STATUS.clear()
