"""The NCCL_* settings NCCL itself will see: the environment's, and those of NCCL's own
configuration files, which it applies for every variable the environment leaves unset
(``NCCL_CONF_FILE``, or else ``~/.nccl.conf``, then ``/etc/nccl.conf``; NCCL User Guide,
"Environment Variables", and NCCL's ``initEnv``). The home directory depends on the NCCL: 2.30
(the pinned nvidia-nccl-cu13 2.30.7) takes ``$HOME``, 2.29 and older took the passwd entry's
(``getpwuid(getuid())``). Both files are read, ``$HOME``'s first, so a setting in either counts
whichever NCCL the worker loads. A user who chose a protocol in ``/etc/nccl.conf`` chose it as
surely as one who exported it: the plugin's tuned NCCL variant must not override either, and
doctor's NCCL warnings read the same settings. Lines are read as NCCL reads them: split at the
first ``=``, nothing trimmed but the line end, ``#`` lines skipped.

NCCL reads each file whole. A file that is absent sets nothing (NCCL skips it too); one that
cannot be read here within bounds (over ``MAX_BYTES``, not a regular file, no permission, not
UTF-8) may set anything: ``NcclSettings.unreadable`` says which and why, and the plan then sets
no NCCL variable of its own."""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterator, Mapping
from pathlib import Path

from sglang_sm120.strict_json import UnreadableFile, read_regular_file

CONF_FILE_ENV = "NCCL_CONF_FILE"
SYSTEM_CONF = Path("/etc/nccl.conf")
MAX_BYTES = 1 << 20  # a site file of a few lines is ~100 bytes; past this, unreadable here
ENVIRONMENT = "the environment"


def passwd_home() -> str | None:
    """The home directory NCCL takes ``~/.nccl.conf`` from: the passwd entry of this user."""
    try:
        return pwd.getpwuid(os.getuid()).pw_dir or None
    except KeyError:  # no passwd entry (a container's arbitrary uid): NCCL reads no home file
        return None


def conf_files(environ: Mapping[str, str]) -> list[Path]:
    """NCCL's configuration files, in the order it applies them: ``NCCL_CONF_FILE`` or the
    home file(s) (``$HOME``'s for NCCL 2.30, the passwd home's for older ones), then /etc."""
    user = environ.get(CONF_FILE_ENV)
    if user:
        return [Path(user), SYSTEM_CONF]
    homes: list[Path] = []
    for home in (environ.get("HOME"), passwd_home()):
        path = Path(f"{home}/.nccl.conf")  # as NCCL builds it: HOME="" is /.nccl.conf
        if home is not None and path not in homes:
            homes.append(path)
    return [*homes, SYSTEM_CONF]


class NcclSettings(Mapping[str, str]):
    """Every NCCL_* variable NCCL will see, by name, with where each came from (``source``) and,
    when a configuration file could not be read, why (``unreadable``: then NCCL may see more)."""

    def __init__(
        self,
        values: Mapping[str, str],
        sources: Mapping[str, str] | None = None,
        unreadable: str | None = None,
    ) -> None:
        self._values = dict(values)
        self._sources = dict(sources or {})
        self.unreadable = unreadable

    def __getitem__(self, name: str) -> str:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def source(self, name: str) -> str:
        """Where NCCL gets ``name`` from: ``the environment`` or a configuration file's path."""
        return self._sources.get(name, ENVIRONMENT)


def _conf_text(path: Path) -> str | None:
    """A configuration file's text; None when it is absent (NCCL skips it); UnreadableFile
    (or UnicodeDecodeError) when it exists but cannot be read whole here."""
    try:
        return read_regular_file(path, MAX_BYTES).decode("utf-8")
    except UnreadableFile as exc:
        if exc.missing:
            return None
        raise


def nccl_settings(environ: Mapping[str, str]) -> NcclSettings:
    """What NCCL will see: the environment's NCCL_* first, then each configuration file's
    ``NAME=value`` lines (``#`` lines skipped) for a name still unset."""
    values = {k: v for k, v in environ.items() if k.startswith("NCCL_")}
    sources: dict[str, str] = {}
    for path in conf_files(environ):
        try:
            text = _conf_text(path)
        except (UnreadableFile, UnicodeDecodeError) as exc:
            why = "not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else str(exc)
            return NcclSettings(values, sources, f"NCCL's config file {path} unreadable ({why})")
        for line in (text or "").split("\n"):
            line = line.removesuffix("\r")
            if line.startswith("#") or "=" not in line:
                continue
            name, value = line.split("=", 1)  # as NCCL: no trimming ("NCCL_X =" is not NCCL_X)
            if name.startswith("NCCL_") and name not in values:
                values[name] = value
                sources[name] = str(path)
    return NcclSettings(values, sources)
