"""The NCCL_* settings NCCL itself will see: the environment's, and those of NCCL's own
configuration files, which it applies for every variable the environment leaves unset
(``NCCL_CONF_FILE`` or ``~/.nccl.conf``, then ``/etc/nccl.conf``; NCCL User Guide,
"Environment Variables"). A user who chose a protocol in ``/etc/nccl.conf`` chose it as surely
as one who exported it: the plugin's tuned NCCL variant must not override either."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from sglang_sm120.strict_json import read_regular_file

CONF_FILE_ENV = "NCCL_CONF_FILE"
SYSTEM_CONF = Path("/etc/nccl.conf")
MAX_BYTES = 1 << 16


def conf_files(environ: Mapping[str, str]) -> list[Path]:
    """NCCL's configuration files, in the order it applies them."""
    home = environ.get("HOME") or str(Path.home())
    return [Path(environ.get(CONF_FILE_ENV) or Path(home) / ".nccl.conf"), SYSTEM_CONF]


def nccl_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """Every NCCL_* variable NCCL will see, by name: the environment's first, then each
    configuration file's ``NAME=value`` lines (``#`` comments) for a name still unset. A file
    that is missing or unreadable sets nothing."""
    seen = {k: v for k, v in environ.items() if k.startswith("NCCL_")}
    for path in conf_files(environ):
        try:
            text = read_regular_file(path, MAX_BYTES).decode(errors="replace")
        except (OSError, ValueError):  # absent, a directory, too large: NCCL reads nothing
            continue
        for line in text.splitlines():
            line = line.strip()
            if line.startswith("#") or "=" not in line:
                continue
            name, value = (part.strip() for part in line.split("=", 1))
            if name.startswith("NCCL_"):
                seen.setdefault(name, value)
    return seen
