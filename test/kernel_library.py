"""Whether sgl-kernel-sm120 is here, for the tests that need it.

Two questions. Is the compiled library loadable in this process (tests that call the kernel)?
Would a child process (a server, the CLI) be served by it, as the plugin judges it (the package
is there and its library loads; tests whose expected plans and patch statuses depend on it:
without it the plugin reports ``sm120_pcie_backend`` as not needed)? Where the
answer is no, such tests skip with the reason, or fail where SGLANG_SM120_KERNEL_REQUIRED=1 (CI).

    from kernel_library import require_kernel_library

    def test_something_on_the_kernel():
        require_kernel_library()
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest

KERNEL_REQUIRED_ENV = "SGLANG_SM120_KERNEL_REQUIRED"


def kernel_required() -> bool:
    """SGLANG_SM120_KERNEL_REQUIRED on (or a deprecated spelling, read by the kernel package's
    own env module, which is pure Python and importable from the checkout's sources), in the
    package's switch words (``env_values.switch_value``: true, on, ... too); a value that is
    no switch word fails the test that asks, naming it."""
    from sgl_kernel_sm120 import env
    from sglang_sm120.env_values import switch_value

    try:
        return switch_value(env.get(env.KERNEL_REQUIRED)) is True
    except ValueError as exc:
        pytest.fail(f"{KERNEL_REQUIRED_ENV}={exc}")


def library_missing() -> str | None:
    """Why sgl-kernel-sm120's compiled library cannot be loaded here, or None when it can."""
    try:
        from sgl_kernel_sm120 import _lib
    except ImportError as exc:
        return f"sgl-kernel-sm120 is not importable ({exc})"
    if not _lib.library_path().is_file():
        return (
            f"sgl-kernel-sm120 is not installed: no {_lib.library_path()} "
            "(pip install ./sgl-kernel-sm120, which needs nvcc >= 12.8)"
        )
    return None


@functools.cache
def package_missing_in_children() -> str | None:
    """Why sgl-kernel-sm120 cannot serve a child process with this environment, or None: the
    plugin's own fact (``facts.sm120_kernel_problem``: the package is there and its library
    loads), asked of a real child, since this process also sees the checkout's sources
    (conftest.py), which a server started by a test does not."""
    probe = (
        "import json\n"
        "try:\n"
        "    from sglang_sm120.machine.facts import sm120_kernel_problem\n"
        "except ImportError as exc:\n"
        "    print(json.dumps(f'sglang-sm120 is not importable ({exc})'))\n"
        "else:\n"
        "    print(json.dumps(sm120_kernel_problem()))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], env=os.environ, capture_output=True, text=True, timeout=120
    )
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else f"the probe failed: {proc.stderr[-300:]}"


def _require(reason: str | None) -> None:
    if reason is None:
        return
    if kernel_required():
        pytest.fail(f"{KERNEL_REQUIRED_ENV}=1: {reason}")
    pytest.skip(reason)


def require_kernel_library() -> None:
    """Skip (or, in CI, fail) the calling test unless the compiled library loads here."""
    _require(library_missing())


def require_kernel_package() -> None:
    """Skip (or, in CI, fail) the calling test unless child processes find the package."""
    _require(package_missing_in_children())


def expected_sm120_pcie_status() -> str:
    """The plugin's sm120_pcie_backend status on an SM120 all-P2P host started from here."""
    missing = package_missing_in_children()
    if missing and kernel_required():
        pytest.fail(f"{KERNEL_REQUIRED_ENV}=1: {missing}")
    return "applied" if missing is None else f"not needed ({missing})"
