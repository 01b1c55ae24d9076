"""The upstream surface the patches rely on, declared as data and checked before applying.

Each patch module lists the sglang symbols it touches as ``Symbol`` rows. ``check`` reads the
installed sglang and returns what does not match, so an upstream refactor is reported at load
time, naming the symbol, instead of failing on a GPU mid-warmup.

Example::

    Symbol("sglang.srt.layers.flashinfer_comm_fusion._resolve_backend",
           "function", params=("backend", "is_multi_node"))
"""

from __future__ import annotations

import inspect
import pkgutil
from dataclasses import dataclass
from typing import Any, Literal

SymbolKind = Literal["function", "attribute"]


@dataclass(frozen=True)
class Symbol:
    """One upstream name a patch depends on.

    ``params``: the exact parameter names, in order, of a function we wrap.
    ``reads``: global names the function must read (a constant we set by plain assignment only
    has an effect while the function still reads it).
    ``type_name``: the expected type of an attribute (e.g. ``bool``, ``list``).
    """

    target: str
    kind: SymbolKind
    params: tuple[str, ...] | None = None
    reads: tuple[str, ...] = ()
    type_name: str | None = None


def resolve(target: str) -> Any:
    """The object a dotted path names (module attribute or class attribute)."""
    module_path, _, attr = target.rpartition(".")
    return getattr(pkgutil.resolve_name(module_path), attr)


_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _unwrapped(fn: Any) -> Any:
    """Our own wrappers keep the upstream original in ``__wrapped__``."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def mismatch(symbol: Symbol) -> str | None:
    """Why the installed sglang does not match ``symbol``, or None when it does."""
    try:
        obj = resolve(symbol.target)
    except (ImportError, AttributeError, ValueError) as exc:
        return f"{symbol.target}: not found ({type(exc).__name__}: {exc})"
    if symbol.kind == "attribute":
        if symbol.type_name and type(obj).__name__ != symbol.type_name:
            return f"{symbol.target}: expected a {symbol.type_name}, found {type(obj).__name__}"
        return None
    fn = _unwrapped(obj)
    if not callable(fn):
        return f"{symbol.target}: expected a function, found {type(obj).__name__}"
    if symbol.params is not None:
        parameters = inspect.signature(fn).parameters.values()
        found = tuple(p.name for p in parameters)
        if found != symbol.params and all(p.kind in _VARIADIC for p in parameters):
            return (  # e.g. a custom-op wrapper: the parameters may be unchanged behind it
                f"{symbol.target}: expected parameters {symbol.params}, found a "
                f"{type(obj).__name__} taking only {found}, which hides them"
            )
        if found != symbol.params:
            return f"{symbol.target}: expected parameters {symbol.params}, found {found}"
    code = getattr(fn, "__code__", None)
    missing = [name for name in symbol.reads if code is None or name not in code.co_names]
    if missing:
        return f"{symbol.target}: no longer reads {', '.join(missing)}"
    return None


def check(symbols: tuple[Symbol, ...]) -> list[str]:
    """Every mismatch among ``symbols`` (empty when the installed sglang matches)."""
    return [problem for s in symbols if (problem := mismatch(s)) is not None]
