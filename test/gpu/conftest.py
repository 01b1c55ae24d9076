"""Fixtures of the GPU tests that call sgl-kernel-sm120's compiled library."""

from __future__ import annotations

import pytest
from kernel_library import KERNEL_REQUIRED_ENV, kernel_required


@pytest.fixture(scope="module")
def kernel_library_loaded() -> None:
    """The library loads in this process (its ABI checked): skip with the reason where it does
    not, fail where SGLANG_SM120_KERNEL_REQUIRED=1 (a GPU runner that built it)."""
    from sgl_kernel_sm120 import _lib

    try:
        _lib.lib()
    except _lib.LibraryError as exc:
        if kernel_required():
            pytest.fail(f"{KERNEL_REQUIRED_ENV}=1 but the library is unusable: {exc}")
        pytest.skip(f"sgl-kernel-sm120 library not built: {exc}")
