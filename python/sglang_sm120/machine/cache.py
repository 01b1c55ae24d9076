"""The per-host cache directory, where measured documents live (tuning tables, p2p probes), and
the host fingerprint that names them.

A document measured on one host is valid on another only when the fingerprint matches: the same
GPUs and links, driver and package versions (not the GPUs' indices). ``SGLANG_SM120_CACHE_DIR``
moves the directory (default ``~/.cache/sglang-sm120``); a directory that cannot be listed or
written, or a relative path, is named, with the reason, instead of raising.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from sglang_sm120.machine.facts import HostFacts

CACHE_ENV = "SGLANG_SM120_CACHE_DIR"


def host_fingerprint(
    facts: HostFacts, tp: int, gpu_ids: tuple[int, ...] | None = None
) -> dict[str, Any]:
    """What makes measurements transferable: the TP GPUs (``gpu_ids``, default the first
    ``tp``), their links, driver and versions; not their indices."""
    gpus = facts.gpus_at(gpu_ids if gpu_ids is not None else range(tp))
    indices = [g.index for g in gpus]
    return {
        "gpus": [[g.name, g.sm] for g in gpus],
        "p2p": [[facts.p2p[a][b] for b in indices] for a in indices],
        "numa": [g.numa_node for g in gpus],
        "nvlink": facts.has_nvlink,
        "driver": facts.driver_version,
        "versions": {k: v for k, v in sorted(facts.versions.items()) if k != "nvidia-cuda-runtime"},
    }


def fingerprint_id(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def cache_dir() -> Path:
    """The cache directory as named; a relative one is named too, and refused by every reader
    and writer (``relative_problem``)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sglang-sm120")


def relative_problem(directory: Path) -> str | None:
    """Why a relative cache directory is refused: each process (a scheduler, a later doctor)
    would read and write a different directory below its own working directory."""
    if directory.is_absolute():
        return None
    return "a relative path, which names another directory in each working directory"


def cache_name(directory: Path) -> str:
    """The cache directory as a user set it: ``SGLANG_SM120_CACHE_DIR=<dir>``, or the default."""
    if os.environ.get(CACHE_ENV):
        return f"{CACHE_ENV}={directory}"
    return f"cache directory {directory}"


def why_unusable(exc: OSError, directory: Path) -> str:
    """An OSError about the cache directory in a user's words: a path naming a regular file
    says so (mkdir calls that "File exists", listdir "Not a directory")."""
    if isinstance(exc, (FileExistsError, NotADirectoryError)):
        try:
            mode = os.stat(directory).st_mode
        except (OSError, ValueError):
            mode = None
        if mode is not None and not stat.S_ISDIR(mode):  # /dev/null, a FIFO: not a directory
            kinds = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a device", stat.S_IFSOCK: "a socket"}
            return f"{kinds.get(stat.S_IFMT(mode), 'a file')}, not a directory"
    return exc.strerror or str(exc)


def list_cache(directory: Path) -> tuple[list[str] | None, str | None]:
    """(the names in the cache directory, or None where it does not exist yet: tune creates
    it; why it cannot be listed, or None)."""
    relative = relative_problem(directory)
    if relative:
        return None, f"{cache_name(directory)} unusable ({relative}; set an absolute path)"
    try:
        return os.listdir(directory), None
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{cache_name(directory)} unreadable ({why_unusable(exc, directory)})"


def cache_read_problem() -> str | None:
    """Why the cache directory cannot be listed (a file, below a file, no permission, a name
    the file system refuses), or None: it lists, or does not exist yet (tune creates it)."""
    return list_cache(cache_dir())[1]


def cache_write_problem() -> str | None:
    """Why ``save_table`` could not write into the cache directory (not a directory, no
    permission), or None: asked before ``tune`` measures, not after."""
    directory = cache_dir()
    relative = relative_problem(directory)
    if relative:
        return (
            f"{cache_name(directory)} is not usable ({relative}); "
            f"set {CACHE_ENV} to an absolute path"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-"):
            pass
    except OSError as exc:
        return (
            f"{cache_name(directory)} is not writable ({why_unusable(exc, directory)}); "
            f"set {CACHE_ENV} to a directory"
        )
    return None
