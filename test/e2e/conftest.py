"""Fixtures of the e2e suite; the harness itself is ``sglang_sm120.commands.e2e`` (see its
docstring)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Test modules import their helpers (processes.py) by name, whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang_sm120.commands.e2e import ServerRuns, missing_prerequisite
from sglang_sm120.server.env_report import E2E_PARALLEL

# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def e2e_ready() -> None:
    reason = missing_prerequisite()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def tiny_pairs(e2e_ready, tmp_path_factory) -> dict[str, Any]:
    """The tiny fixture models (generated once per session, a few seconds on CPU)."""
    from sglang_sm120.commands.tiny_models import build_all

    root = os.environ.get("SGLANG_SM120_FIXTURE_DIR")
    out = Path(root) if root else tmp_path_factory.mktemp("tiny-models")
    return build_all(out)


@pytest.fixture(scope="session")
def server_runs(e2e_ready, tmp_path_factory) -> Iterator[ServerRuns]:
    log_root = os.environ.get("SGLANG_SM120_E2E_LOG_DIR")
    log_dir = Path(log_root) if log_root else tmp_path_factory.mktemp("server-logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    # The servers share the GPUs: at most SGLANG_SM120_E2E_PARALLEL alive at once, overall.
    runs = ServerRuns(
        tmp_path_factory.mktemp("server-runs"), log_dir, max_running=E2E_PARALLEL.read()
    )
    yield runs
    runs.stop_all()  # servers started in the background for cases that never ran
