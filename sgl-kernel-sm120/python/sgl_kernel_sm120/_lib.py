"""ctypes binding of libsgl_kernel_sm120.so (C API in csrc/sk_api.h).

The library is plain CUDA with no torch inside, so one wheel serves every torch version. It is
loaded on first use, not at import, so the pure-Python parts (sizing, validation) work on
machines without a GPU or without the built library.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

from . import env

# Mirrors of the constants in csrc/sk_api.h.
ABI_VERSION = 8
MAX_RANKS = 8
MAX_BLOCKS = 128
THREADS = 512
FLAG_WORDS = 2 * 2 * MAX_RANKS * MAX_BLOCKS
FLAG_BYTES = 8  # a 64-bit call number each
CTRL_WORDS = 8
STATE_OFFSET_WORDS = 64
STATE_WORDS = 8
STATE_EPOCH = 0
STATE_ONESHOT_BUFFER = 1
STATE_EPOCH_HIGH = 5
CONTROL_WORDS = STATE_OFFSET_WORDS + MAX_BLOCKS * STATE_WORDS
LAMPORT_BUFFERS = 3
LAMPORT_EMPTY_BYTE = 0xFF  # every 16-bit lane 0xFFFF: "not arrived"
TIMELINE_WORDS = 8  # clock64 per phase 0..5, %globaltimer at phases 0 and 5
CTRL_ERR_CODE = 2
CTRL_ERR_SRC = 3
CTRL_ERR_KIND = 4
CTRL_ERR_EPOCH = 5
CTRL_ERR_EPOCH_HIGH = 6
DTYPE_BF16 = 0
DTYPE_FP16 = 1
VARIANT_ONESHOT = 0
VARIANT_TWOSHOT = 1
VARIANT_TWOSHOT_LAMPORT = 2
FUSED_NONE = 0
FUSED_RMSNORM = 1
FUSED_NORM_ONLY = 2
DEBUG_SINGLE_BUFFER = 1
DEBUG_TRIGGER_AT_START = 2
IPC_HANDLE_BYTES = 64

LIBRARY_NAME = "libsgl_kernel_sm120.so"
ENV_LIBRARY = env.KERNEL_LIBRARY

_c_ptrs = ctypes.c_void_p * MAX_RANKS


class LaunchParams(ctypes.Structure):
    """Field-for-field mirror of SkLaunchParams."""

    _fields_ = [
        ("input", ctypes.c_void_p),
        ("output", ctypes.c_void_p),
        ("residual_in", ctypes.c_void_p),
        ("residual_out", ctypes.c_void_p),
        ("weight", ctypes.c_void_p),
        ("lamport", _c_ptrs),
        ("push", _c_ptrs),
        ("gather", _c_ptrs),
        ("flags", _c_ptrs),
        ("control", ctypes.c_void_p),
        ("error_host", ctypes.c_void_p),
        ("timeline", ctypes.c_void_p),
        ("numel", ctypes.c_int64),
        ("slot_bytes", ctypes.c_int64),
        ("lamport_slot_bytes", ctypes.c_int64),
        ("timeout_ns", ctypes.c_uint64),
        ("debug_delay_ns", ctypes.c_uint64),
        ("rows", ctypes.c_int32),
        ("hidden", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("rank", ctypes.c_int32),
        ("world_size", ctypes.c_int32),
        ("variant", ctypes.c_int32),
        ("fused", ctypes.c_int32),
        ("blocks", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("debug_flags", ctypes.c_int32),
        ("debug_delay_rank", ctypes.c_int32),
        ("row_blocks", ctypes.c_int32),
        ("early_launch", ctypes.c_int32),
    ]


class LibraryError(RuntimeError):
    """The compiled library is missing, stale, or a CUDA call inside it failed."""


_lib: ctypes.CDLL | None = None


def library_path() -> Path:
    """Where the library is loaded from: $SGLANG_SM120_KERNEL_LIBRARY, else the first directory
    of this package that holds it (an editable install builds it into site-packages, apart
    from these sources, and lists both directories in the package's ``__path__``), else next
    to this file."""
    override = env.get(ENV_LIBRARY)
    if override:
        return Path(override)
    for directory in getattr(sys.modules.get(__package__), "__path__", ()):
        candidate = Path(directory) / LIBRARY_NAME
        if candidate.is_file():
            return candidate
    return Path(__file__).with_name(LIBRARY_NAME)


def _declare(lib: ctypes.CDLL) -> None:
    vp, i32, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    pvp, pi32 = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int)
    signatures = {
        "sk_abi_version": [],
        "sk_params_size": [],
        "sk_device_count": [pi32],
        "sk_device_pci_bus_id": [i32, ctypes.c_char_p, i32],
        "sk_device_by_pci_bus_id": [ctypes.c_char_p, pi32],
        "sk_can_access_peer": [i32, i32, pi32],
        "sk_max_resident_blocks": [i32, pi32],
        "sk_max_active_clusters": [i32, i32, pi32],
        "sk_alloc_zeroed": [i32, sz, pvp],
        "sk_fill": [i32, vp, i32, sz],
        "sk_free": [i32, vp],
        "sk_host_alloc_mapped": [i32, sz, pvp, pvp],
        "sk_host_free": [vp],
        "sk_ipc_get_handle": [i32, vp, ctypes.c_char_p],
        "sk_ipc_open_handle": [i32, ctypes.c_char_p, pvp],
        "sk_ipc_close_handle": [i32, vp],
        "sk_preload": [i32],
        "sk_launch": [ctypes.POINTER(LaunchParams), i32, vp],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    lib.sk_error_string.argtypes = [ctypes.c_int]
    lib.sk_error_string.restype = ctypes.c_char_p


def lib() -> ctypes.CDLL:
    """The loaded library; raises LibraryError with the fix when it is absent or stale."""
    global _lib
    if _lib is not None:
        return _lib
    path = library_path()
    if not path.is_file():
        raise LibraryError(
            f"{path} not found: build the package (pip install ./sgl-kernel-sm120) "
            f"or point ${ENV_LIBRARY} at a built {LIBRARY_NAME}"
        )
    handle = ctypes.CDLL(str(path))
    handle.sk_abi_version.restype = ctypes.c_int  # first: an older library lacks newer symbols
    if handle.sk_abi_version() != ABI_VERSION:
        raise LibraryError(
            f"{path} has ABI {handle.sk_abi_version()}, the Python code expects {ABI_VERSION}: "
            "rebuild the package"
        )
    _declare(handle)
    if handle.sk_params_size() != ctypes.sizeof(LaunchParams):
        raise LibraryError(
            f"{path}: SkLaunchParams is {handle.sk_params_size()} bytes, the ctypes mirror "
            f"{ctypes.sizeof(LaunchParams)}: csrc/sk_api.h and _lib.py disagree"
        )
    _lib = handle
    return _lib


def check(code: int, what: str) -> None:
    """Raises LibraryError naming the CUDA error when a C API call failed."""
    if code != 0:
        message = lib().sk_error_string(code).decode(errors="replace")
        raise LibraryError(f"{what} failed: CUDA error {code} ({message})")
