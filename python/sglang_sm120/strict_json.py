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

Syntax is not enough: ``"us": "5.0"`` or ``"collapse": "false"`` parse, and then raise deep
inside SGLang or flip a decision (``bool("false")`` is True). So each reader states its
document's fields with ``fields`` and ``require`` below: type, range, finite numbers, booleans
that are real JSON booleans. A value that does not fit is a ``FieldError`` (a JsonInputError)
whose one line names the field's path and shows the value (escaped, at most 40 characters).

Example::

    data = read_json_file("box.json", max_bytes=1 << 20)
    # JsonInputError: "a FIFO, not a regular file", "over 1 MiB (the most read)", ...
    cell = fields(data["measurements"][0], "measurements[0]", known=("backend", "us", ...))
    us = require(cell, "us", float, "measurements[0]", minimum=0, null=True)
    # FieldError: "measurements[0].us must be a number >= 0 or null, got '5.0'"
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Collection
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


# ------------------------------------------------------------------------------ field values

REQUIRED: Any = object()  # ``require``'s default: the key must be there
_KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


class FieldError(JsonInputError):
    """A parsed document with a value of the wrong type or range; the message is one line
    naming the field's path (``measurements[3].us``; a top-level key quoted: ``'tp'``)."""


def shown(value: Any) -> str:
    """``value`` as a message shows it: escaped (``repr``), at most 40 characters."""
    try:
        text = repr(value)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        text = f"<a {type(value).__name__} too long to show>"
    return text if len(text) <= 40 else text[:37] + "..."


def field_path(where: str, key: str | int) -> str:
    """The path of ``key`` inside the value at ``where`` ("" is the document itself)."""
    if isinstance(key, int):  # an item of a top-level list: gpu_ids[0], not 'gpu_ids'[0]
        return f"{where.strip(chr(39))}[{key}]"
    return f"{where}.{key}" if where else repr(key)


def fields(value: Any, where: str = "", known: Collection[str] | None = None) -> dict[str, Any]:
    """``value`` as a JSON object; with ``known``, one without other keys (a misspelt or
    misplaced key is refused, not ignored)."""
    if not isinstance(value, dict):
        raise FieldError(f"{where or 'the document'} must be a JSON object, got {shown(value)}")
    unknown = sorted(set(value) - set(known)) if known is not None else ()
    if unknown:
        at = f"{where}: " if where else ""
        raise FieldError(f"{at}unknown key {shown(unknown[0])} (known: {', '.join(known)})")
    return value


def _bounds(minimum: float | None, maximum: float | None, above: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f" {minimum}..{maximum}"
    lower = f" >= {minimum}" if minimum is not None else f" > {above}" if above is not None else ""
    upper = f" <= {maximum}" if maximum is not None else ""
    return lower + (" and" if lower and upper else "") + upper


def check_value(
    value: Any,
    kind: type,
    where: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    choices: Collection[Any] | None = None,
    limit: int | None = None,
    null: bool = False,
) -> Any:
    """``value`` if it is of ``kind`` and in range, else FieldError naming ``where``.

    Kinds: bool (a JSON boolean only), int (not a bool, not 2.0), float (any finite number,
    returned as float), str (at most ``limit`` characters), list (at most ``limit`` items),
    dict. ``minimum``/``maximum`` (inclusive), ``above`` (exclusive) bound numbers;
    ``choices`` names the allowed values; ``null`` also allows None."""
    if value is None and null:
        return None
    if kind is list:
        ok, word = isinstance(value, list), "a list"
    elif kind is dict:
        ok, word = isinstance(value, dict), "a JSON object"
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)
        word = "a number"
    else:
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        word = _KIND_WORDS[kind]
    if kind is int or kind is float:
        ok = ok and (
            (minimum is None or value >= minimum)
            and (maximum is None or value <= maximum)
            and (above is None or value > above)
        )
        word += _bounds(minimum, maximum, above)
    if choices is not None:
        ok = ok and value in choices
        word = "one of " + ", ".join(map(str, choices))
    if limit is not None and kind in (str, list):
        ok = ok and len(value) <= limit
        word += f" of at most {limit} {'characters' if kind is str else 'items'}"
    if not ok:
        raise FieldError(f"{where} must be {word}{' or null' if null else ''}, got {shown(value)}")
    return float(value) if kind is float and value is not None else value


def require(
    document: dict[str, Any],
    key: str,
    kind: type,
    where: str = "",
    *,
    default: Any = REQUIRED,
    **bounds: Any,
) -> Any:
    """``document[key]`` checked by ``check_value`` (``bounds``: its keyword arguments);
    ``default`` when the key is absent, or FieldError when there is none."""
    if key not in document:
        if default is not REQUIRED:
            return default
        at = f"{where}: " if where else ""
        raise FieldError(f"{at}missing required key {key!r}")
    return check_value(document[key], kind, field_path(where, key), **bounds)


def require_list(
    document: dict[str, Any],
    key: str,
    kind: type,
    where: str = "",
    *,
    max_items: int,
    default: Any = REQUIRED,
    **bounds: Any,
) -> list[Any]:
    """``document[key]``: a list of at most ``max_items`` values, each checked as ``kind``
    (``bounds``: ``check_value``'s keyword arguments, for each value)."""
    if key not in document and default is not REQUIRED:
        return default
    items = require(document, key, list, where, limit=max_items)
    path = field_path(where, key)
    return [check_value(item, kind, field_path(path, i), **bounds) for i, item in enumerate(items)]
