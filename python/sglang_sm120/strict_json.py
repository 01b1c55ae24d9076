"""One strict reader for every JSON document the package reads from users: topology files, the
launch plan in the environment, and the tuning tables and p2p probes in the cache directory
(anyone who can write there can put any file under those names). Its bounded read,
``read_regular_file``, is also how the host checks read every sysfs/procfs file.

A bad document is a ``JsonInputError`` (a ValueError) whose message is one line saying why, and
saying it takes bounded time and memory:

- only a regular file is read: ``/dev/zero`` never ends, and a FIFO blocks its reader until
  someone writes. The path is checked with ``stat`` first, then opened non-blocking (a FIFO put
  there in between cannot block the open) and checked again on the open descriptor;
- at most ``max_bytes`` are read, and the message names that bound;
- duplicate keys are refused (JSON leaves them to the reader; Python keeps the last one
  silently), and so are NaN and Infinity (not JSON), numbers past a float's range (``1e400``),
  and numbers longer than ``MAX_NUMBER_CHARS`` (Python's int() refuses past 4300 digits with
  advice about ``sys.set_int_max_str_digits``).

Example::

    data = read_json_file("box.json", max_bytes=1 << 20)
    # JsonInputError: "a FIFO, not a regular file", "over 1 MiB (the most read)", ...
"""

from __future__ import annotations

import json
import math
import os
import stat
from typing import Any

MAX_NUMBER_CHARS = 100

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class JsonInputError(ValueError):
    """A JSON document that cannot be used; the message is one line."""


class UnreadableFile(ValueError):
    """A file that cannot be read within bounds; the message is one line saying why.
    ``missing``: it does not exist (which a caller may read as "absent", not as a failure)."""

    def __init__(self, reason: str, missing: bool = False) -> None:
        super().__init__(reason)
        self.missing = missing


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise JsonInputError(f"duplicate key {key!r}")
        document[key] = value
    return document


def _number(text: str, parse: type) -> Any:
    if len(text) > MAX_NUMBER_CHARS:
        digits = sum(c.isdigit() for c in text)
        raise JsonInputError(
            f"a number of {digits} digits ({text[:12]}...; at most {MAX_NUMBER_CHARS} characters)"
        )
    value = parse(text)
    if parse is float and not math.isfinite(value):  # 1e400: infinity, which JSON cannot say
        raise JsonInputError(f"{text} is out of range for a number")
    return value


def _not_json(name: str) -> Any:
    raise JsonInputError(f"{name} is not JSON (write a number, or null)")


def loads(text: str) -> Any:
    """``json.loads`` with the refusals above; JsonInputError (or RecursionError, for
    nesting deeper than Python's stack) on a bad document."""
    try:
        return json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_int=lambda t: _number(t, int),
            parse_float=lambda t: _number(t, float),
            parse_constant=_not_json,
        )
    except JsonInputError:
        raise
    except ValueError as exc:  # json.JSONDecodeError: the message says line and column
        raise JsonInputError(str(exc)) from None


def _kind(mode: int) -> str:
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit % (1 << 20) == 0 else f"{limit} bytes"


def read_regular_file(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The bytes of regular file ``path``, at most ``max_bytes``; ``UnreadableFile`` with the
    reason otherwise (OSError's own words, e.g. "No such file or directory"). Every file the
    package reads from users or from sysfs/procfs goes through here: bounded time and memory."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise UnreadableFile(f"{_kind(mode)}, not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise UnreadableFile(f"{_kind(mode)}, not a regular file")
            chunks, size = [], 0
            while size <= max_bytes:
                chunk = os.read(fd, max_bytes + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
    except OSError as exc:
        missing = isinstance(exc, FileNotFoundError)
        raise UnreadableFile(exc.strerror or str(exc), missing=missing) from None
    if size > max_bytes:
        raise UnreadableFile(f"over {_size(max_bytes)} (the most read)")
    return b"".join(chunks)


def read_json_file(path: str | os.PathLike[str], max_bytes: int) -> Any:
    """The JSON document in regular file ``path``; JsonInputError with the reason otherwise
    (OSError's own words, e.g. "No such file or directory", for a file that cannot be opened)."""
    try:
        data = read_regular_file(path, max_bytes)
    except UnreadableFile as exc:
        raise JsonInputError(str(exc)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonInputError(f"not UTF-8 ({exc})") from None
    return loads(text)
