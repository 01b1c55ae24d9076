"""Environment variables of sgl-kernel-sm120 and their deprecated spellings.

The variables are named ``SGLANG_SM120_*``. The package's first names were
``SGL_KERNEL_SM120_*``, but SGLang rewrites every ``SGL_*`` variable to ``SGLANG_*`` (with a
deprecation warning of its own), so inside a server such a variable arrives as
``SGLANG_KERNEL_SM120_*``. Both old spellings are still read; the first read of one logs one
warning per process naming the new variable. A new name that is set wins over the old ones.

    from sgl_kernel_sm120 import env

    env.get(env.TIMEOUT_MS)   # "2000", or None when unset
"""

from __future__ import annotations

import os
import warnings

TIMEOUT_MS = "SGLANG_SM120_TIMEOUT_MS"
KERNEL_REQUIRED = "SGLANG_SM120_KERNEL_REQUIRED"
CUDA_ARCHS = "SGLANG_SM120_CUDA_ARCHS"  # read by CMakeLists.txt at build time
KERNEL_LIBRARY = "SGLANG_SM120_KERNEL_LIBRARY"
BLOCK_BYTES = "SGLANG_SM120_BLOCK_BYTES"
MAX_BLOCKS = "SGLANG_SM120_MAX_BLOCKS"
ONESHOT_MAX_BYTES = "SGLANG_SM120_ONESHOT_MAX_BYTES"
FUSED_ROWS_PER_BLOCK = "SGLANG_SM120_FUSED_ROWS_PER_BLOCK"  # new with this name: no old one
PDL = "SGLANG_SM120_PDL"  # new with this name: no old one
TWOSHOT_LAMPORT_MAX_BYTES = "SGLANG_SM120_TWOSHOT_LAMPORT_MAX_BYTES"  # new: no old one


def _old_names(suffix: str) -> tuple[str, str]:
    """The package's first name and the name SGLang's SGL_* -> SGLANG_* rewrite makes of it."""
    return f"SGL_KERNEL_SM120_{suffix}", f"SGLANG_KERNEL_SM120_{suffix}"


DEPRECATED: dict[str, tuple[str, ...]] = {
    TIMEOUT_MS: _old_names("TIMEOUT_MS"),
    KERNEL_REQUIRED: _old_names("REQUIRED"),
    CUDA_ARCHS: _old_names("CUDA_ARCHS"),
    KERNEL_LIBRARY: _old_names("LIBRARY"),
    BLOCK_BYTES: _old_names("BLOCK_BYTES"),
    MAX_BLOCKS: _old_names("MAX_BLOCKS"),
    ONESHOT_MAX_BYTES: _old_names("ONESHOT_MAX_BYTES"),
}

_warned: set[str] = set()


class DeprecatedVariableWarning(FutureWarning):
    """An old ``SGL_KERNEL_SM120_*`` name was read (FutureWarning: shown to users by default)."""


def get(name: str) -> str | None:
    """The value of variable ``name`` (one of the constants above), else of its first set
    deprecated spelling, else None. Empty values count as unset."""
    value = os.environ.get(name)
    if value is not None and value.strip() != "":
        return value
    for old in DEPRECATED.get(name, ()):
        value = os.environ.get(old)
        if value is not None and value.strip() != "":
            _warn_once(old, name)
            return value
    return None


def _warn_once(old: str, new: str) -> None:
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(
        f"${old} is deprecated: set ${new} instead (SGLang renames SGL_* variables, so the old "
        "name stops working in servers); using its value for now",
        DeprecatedVariableWarning,
        stacklevel=3,
    )
