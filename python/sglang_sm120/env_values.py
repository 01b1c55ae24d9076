"""Reading the values of environment variables, and showing them in messages.

Every layer reads variables (machine/ its topology, cache and sysfs root; server/ the switches;
commands/ the e2e knobs), so the words and checks live here, below them all, and say one thing
everywhere:

    switch_value(" On ")                          # True
    number("SGLANG_SM120_E2E_STARTUP_S", "abc", float, maximum=86400)
    # ValueError: SGLANG_SM120_E2E_STARTUP_S='abc' is not a number

A message shows at most ``SHOWN_CHARS`` characters of a value, escaped (``shown``): a value of
thousands of characters, a newline or undecodable bytes never reach a log line whole.
"""

from __future__ import annotations

import math
import os

SHOWN_CHARS = 40
# A superset of upstream's EnvBool words (true/1/yes/y, false/0/no/n): a value upstream reads
# one way never reads the other way here.
SWITCH_ON = ("1", "true", "yes", "y", "on")
SWITCH_OFF = ("0", "false", "no", "n", "off")


def printable(text: str | bytes | os.PathLike) -> str:
    """``text`` (a path too) as one printable line: control characters and bytes that are not
    UTF-8 (``os.fsdecode`` keeps them as surrogates, which no UTF-8 stream can print) shown
    escaped, as repr() shows them."""
    text = os.fsdecode(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def shown(value: str) -> str:
    """``value`` quoted and escaped as repr() shows it, cut at SHOWN_CHARS characters."""
    if len(value) <= SHOWN_CHARS:
        return repr(value)
    return repr(value[:SHOWN_CHARS]) + f"... ({len(value)} characters)"


def switch_value(raw: str | None) -> bool | None:
    """1, true, yes, y, on -> True; 0, false, no, n, off -> False (any case, surrounding spaces
    ignored); None or empty -> None; ValueError for anything else."""
    value = (raw or "").strip().lower()
    if value in SWITCH_ON:
        return True
    if value in SWITCH_OFF:
        return False
    if value:
        raise ValueError(
            f"{shown(raw or '')} is not a switch value "
            f"({'/'.join(SWITCH_ON)} or {'/'.join(SWITCH_OFF)})"
        )
    return None


def ascii_digits(text: str) -> bool:
    """Whether ``text`` is one or more ASCII digits 0-9, as NCCL, CUDA and SGLang read a number:
    ``str.isdigit`` (and ``int``) also take other scripts' digits ('٨' is 8 to Python) and
    superscripts, which no C reader of the same variable or file takes."""
    return text.isascii() and text.isdigit()


def number(
    name: str, raw: str, kind: type[int] | type[float], *, maximum: float, minimum: float = 0
) -> int | float:
    """``raw`` as a finite ``kind`` above ``minimum`` (an int: at least 1) and at most
    ``maximum``; ValueError naming the variable, its value (``shown``) and the bound. ASCII
    only: Python's ``int``/``float`` read other scripts' digits, a C reader does not."""
    what = "an integer" if kind is int else "a number"
    try:
        if not raw.isascii():
            raise ValueError("not ASCII")
        value = int(raw.strip(), 0) if kind is int else float(raw)
    except ValueError:  # also an int past Python's 4300 digits
        raise ValueError(f"{name}={shown(raw)} is not {what}") from None
    if not math.isfinite(value) or value <= minimum or value > maximum:
        raise ValueError(f"{name}={shown(raw)} is not {what} in ({minimum}, {maximum}]")
    return value
