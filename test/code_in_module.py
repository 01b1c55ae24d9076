"""Code that runs as if a given module defined it: the selftest's signal handler decides by the
module of the frame it interrupts (``selftest.raising_is_safe``), and tests hand it such frames."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType


def _define(module: str, source: str) -> dict:
    namespace = {"__name__": module, "sys": sys}
    exec(compile(source, module, "exec"), namespace)
    return namespace


def frame_in(module: str) -> FrameType:
    """A real frame of a function that module ``module`` defines."""
    return _define(module, "def here():\n    return sys._getframe()\n")["here"]()


def wait_in(module: str) -> Callable[[float], None]:
    """``wait(seconds)``, a sleep that module ``module`` defines."""
    return _define(module, "import time\ndef wait(s):\n    time.sleep(s)\n")["wait"]
