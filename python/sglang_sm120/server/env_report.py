"""Every variable the package reads, as ``doctor`` shows it: its value, accepted or refused, and
what is used instead.

Each row reads the variable with the reader the package itself uses (``runtime.env_switch``'s
words, ``env_values.number``'s bounds, the kernel package's ``config.env_int``, ...), so what
doctor says is what a server does. The e2e suite's and selftest's numeric knobs are declared
here (``NumberKnob``) for the same reason: one reader, one bound, one report.

    for row in variables_report():
        print(row["name"], row["value"], row["status"], row["used"])
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from sglang_sm120.env_values import number, printable, shown, switch_value
from sglang_sm120.machine.cache import CACHE_ENV, cache_dir, cache_read_problem
from sglang_sm120.machine.facts import TOPOLOGY_ENV, facts_from_spec, sm120_kernel_problem
from sglang_sm120.machine.host_checks import SYSFS_ROOT_ENV
from sglang_sm120.machine.topology import TopologyError
from sglang_sm120.planning.policy import PLUGIN_BACKEND_CHOICES, PLUGIN_BACKEND_ENV, VALIDATION_ENV
from sglang_sm120.server import runtime

PREFIX = "SGLANG_SM120_"
STATS_ENV = "SGLANG_SM120_STATS_DIR"
KERNEL_PREFIXES = ("SGL_KERNEL_SM120_", "SGLANG_KERNEL_SM120_")  # old names (sgl_kernel_sm120.env)
Reading = tuple[str | None, str]  # (why the value is refused, or None; what is used)


@dataclass(frozen=True)
class NumberKnob:
    """A numeric variable of the e2e suite or selftest: finite, above 0, at most ``maximum``;
    unset, empty or refused (one warning) -> ``default``."""

    name: str
    kind: type[int] | type[float]
    default: Any
    maximum: float
    unit: str = ""

    def read(self) -> Any:
        if self.kind is int:
            return runtime.env_int(self.name, self.default, maximum=int(self.maximum))
        return runtime.env_float(self.name, self.default, maximum=self.maximum)

    def reading(self, raw: str) -> Reading:
        try:
            return None, f"{number(self.name, raw, self.kind, maximum=self.maximum)}{self.unit}"
        except ValueError as exc:
            return str(exc), f"{self.default}{self.unit}"


E2E_STARTUP_S = NumberKnob("SGLANG_SM120_E2E_STARTUP_S", float, 900.0, 86400.0, " s")
E2E_MIN_ACCEPT = NumberKnob("SGLANG_SM120_E2E_MIN_ACCEPT", float, None, 64.0)
E2E_PARALLEL = NumberKnob("SGLANG_SM120_E2E_PARALLEL", int, 4, 64.0)
NUMBER_KNOBS = (E2E_STARTUP_S, E2E_MIN_ACCEPT, E2E_PARALLEL)


@dataclass(frozen=True)
class ListKnob:
    """A comma list of integers of the e2e suite (TP sizes, the tree): each 1..``maximum``,
    exactly ``length`` of them where the list has a fixed shape (the tree's steps, topk, draft
    tokens); unset, empty or refused (one warning) -> ``default``. An empty item (``',,,'``,
    ``'2,,4'``) is refused, not skipped: a list of nothing is not a choice."""

    name: str
    default: tuple[int, ...]
    maximum: int
    length: int | None = None
    items: str = "items"  # what the ``length`` items are, for the refusal

    def parse(self, raw: str) -> tuple[int, ...]:
        parts = raw.split(",")
        if any(not part.strip() for part in parts):
            raise ValueError(f"{self.name}={shown(raw)} has an empty item (write 1,2,4)")
        if self.length is not None and len(parts) != self.length:
            raise ValueError(
                f"{self.name}={shown(raw)} has {len(parts)} items, not {self.length} ({self.items})"
            )
        return tuple(int(number(self.name, part, int, maximum=self.maximum)) for part in parts)

    def read(self) -> tuple[int, ...]:
        raw = os.environ.get(self.name, "")
        if not raw.strip():
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            runtime.log_once(logging.WARNING, f"sglang-sm120: {exc}: using {self.default}")
            return self.default

    def reading(self, raw: str) -> Reading:
        try:
            return None, ",".join(map(str, self.parse(raw)))
        except ValueError as exc:
            return str(exc), ",".join(map(str, self.default))


E2E_TP = ListKnob("SGLANG_SM120_E2E_TP", (1, 2, 4, 8), 8)
E2E_REAL_TP = ListKnob("SGLANG_SM120_E2E_REAL_TP", (), 8)
E2E_REAL_TREE = ListKnob(
    "SGLANG_SM120_E2E_REAL_TREE", (3, 1, 4), 64, length=3, items="steps,topk,draft tokens"
)
LIST_KNOBS = (E2E_TP, E2E_REAL_TP, E2E_REAL_TREE)


def _switch(default: str) -> Callable[[str], Reading]:
    def read(raw: str) -> Reading:
        try:
            return None, "on" if switch_value(raw) else "off"
        except ValueError as exc:
            return str(exc), default

    return read


def _validation(raw: str) -> Reading:
    if raw.strip() in ("0", "1"):
        return None, "on" if raw.strip() == "1" else "off"
    return "only 1 turns validation mode on", "off"


def _backend(raw: str) -> Reading:
    if raw.strip().lower() in PLUGIN_BACKEND_CHOICES:
        return None, raw.strip().lower()
    return f"not one of {', '.join(PLUGIN_BACKEND_CHOICES)}", "auto"


def _topology(raw: str) -> Reading:
    try:
        return None, facts_from_spec(raw).source
    except TopologyError as exc:
        return str(exc), "nothing: every command stops (exit 2), every server applies nothing"


def _cache_dir(raw: str) -> Reading:
    problem = cache_read_problem()
    return problem, "no tuning table, no p2p probe" if problem else printable(cache_dir())


def stats_dir_problem(raw: str) -> str | None:
    """Why ``raw`` is refused as the graph_stats directory: a name with control characters or
    bytes that are not UTF-8 (a typo, or a value not meant as a path) would be created as is."""
    if not raw.isprintable():
        return "holds control characters or bytes that are not UTF-8"
    return None


def _stats_dir(raw: str) -> Reading:
    problem = stats_dir_problem(raw)
    return problem, "graph_stats off" if problem else f"graph_stats writes into {raw}"


def _scheduler_entry(raw: str) -> Reading:
    problem = runtime.scheduler_entry_problem(raw)
    if problem is not None:
        return problem, "SGLang's own entry functions decide the process roles"
    return None, "internal: set by an Engine or DP controller"


def _plain(what: str) -> Callable[[str], Reading]:
    return lambda raw: (None, what)


def _by_kernel_config(value: Callable[[ModuleType], str], default: str) -> Callable[[str], Reading]:
    """A variable of sgl-kernel-sm120, read by its own config module (``value(config)``), so
    that doctor shows what the kernels get; where the kernels refuse it, why, and ``default``,
    what they use instead."""

    def read(raw: str) -> Reading:
        try:
            from sgl_kernel_sm120 import config
        except ImportError:
            return None, "not read: sgl-kernel-sm120 is not installed"
        try:
            return None, value(config)
        except ValueError as exc:
            return str(exc).removeprefix("$"), default

    return read


def _kernel_int(name: str, bound: str, default: str) -> Callable[[str], Reading]:
    """A number, read by ``config.env_int`` with its bound (the config constant ``bound``)."""
    return _by_kernel_config(
        lambda config: str(config.env_int(name, maximum=getattr(config, bound))), default
    )


# sgl-kernel-sm120's variables -> the constant of its config module that bounds them
KERNEL_BOUNDS = {
    "SGLANG_SM120_TIMEOUT_MS": "MAX_TIMEOUT_MS",
    "SGLANG_SM120_ONESHOT_MAX_BYTES": "MAX_MESSAGE_BYTES",
    "SGLANG_SM120_BLOCK_BYTES": "MAX_MESSAGE_BYTES",
    "SGLANG_SM120_MAX_BLOCKS": "MAX_BLOCKS",
    "SGLANG_SM120_FUSED_ROWS_PER_BLOCK": "MAX_FUSED_ROWS_PER_BLOCK",
    "SGLANG_SM120_TWOSHOT_LAMPORT_MAX_BYTES": "MAX_MESSAGE_BYTES",
}
_NO_WORKSPACE = "sm120_pcie builds no workspace (unfused path)"


def _kernel_library(raw: str) -> Reading:
    problem = sm120_kernel_problem()
    return problem, "sgl-kernel-sm120 not used" if problem else printable(raw)


def _kernel_required(raw: str) -> Reading:
    return _switch("off")(raw)


def _plugins(raw: str) -> Reading:
    names = [name.strip() for name in raw.split(",")]
    if "sglang_sm120" in names:
        return None, "sglang_sm120 loads"
    return "does not name sglang_sm120", "the plugin does not load"


def _pcie_ipc(raw: str) -> Reading:
    try:
        value = switch_value(raw)
    except ValueError as exc:
        return str(exc), "off (as upstream reads it)"
    return None, "off (as upstream reads it)" if value is None else ("on" if value else "off")


READERS: dict[str, Callable[[str], Reading]] = {
    "SGLANG_SM120_DISABLE": _switch("off"),
    VALIDATION_ENV: _validation,
    PLUGIN_BACKEND_ENV: _backend,
    TOPOLOGY_ENV: _topology,
    CACHE_ENV: _cache_dir,
    STATS_ENV: _stats_dir,
    SYSFS_ROOT_ENV: lambda raw: (None, printable(raw)),
    runtime.LAUNCH_PLAN_ENV: _plain("internal: a launcher drops an inherited plan"),
    runtime.SCHEDULER_ENTRY_ENV: _scheduler_entry,
    **{
        name: _kernel_int(
            name, bound, "60000 in a server" if bound == "MAX_TIMEOUT_MS" else _NO_WORKSPACE
        )
        for name, bound in KERNEL_BOUNDS.items()
    },
    # what the kernels decide from it (config.resolve_early_launch: on unless switched off)
    "SGLANG_SM120_PDL": _by_kernel_config(
        lambda config: "on" if config.resolve_early_launch() else "off", "on"
    ),
    "SGLANG_SM120_KERNEL_LIBRARY": _kernel_library,
    "SGLANG_SM120_KERNEL_REQUIRED": _kernel_required,
    "SGLANG_SM120_CUDA_ARCHS": _plain("read when sgl-kernel-sm120 is built"),
    **{knob.name: knob.reading for knob in (*NUMBER_KNOBS, *LIST_KNOBS)},
    "SGLANG_SM120_E2E_BACKENDS": _plain("read by the e2e suite"),
    "SGLANG_SM120_E2E_TARGET": _plain("read by the e2e suite"),
    "SGLANG_SM120_E2E_DRAFT": _plain("read by the e2e suite"),
    "SGLANG_SM120_E2E_LOG_DIR": _plain("read by the e2e suite"),
    "SGLANG_SM120_E2E_SERVER_ARGS": _plain("read by the e2e suite"),
    "SGLANG_SM120_FIXTURE_DIR": _plain("read by the e2e suite"),
    # upstream's switches the plugin reads
    runtime.PCIE_IPC_ENV: _pcie_ipc,
    "SGLANG_PLUGINS": _plugins,
}


def _reading(name: str, raw: str) -> Reading:
    if name in READERS:
        return READERS[name](raw)
    if name.startswith(KERNEL_PREFIXES):
        try:
            from sgl_kernel_sm120.env import DEPRECATED
        except ImportError:
            return None, "not read: sgl-kernel-sm120 is not installed"
        new = next((new for new, old in DEPRECATED.items() if name in old), None)
        if new is not None:
            return f"a deprecated name: set {new}", f"its value, unless {new} is set"
    return "not a variable of sglang-sm120 (a typo?)", "nothing: not read"


def variables_report() -> list[dict[str, Any]]:
    """Every variable of ours that is set (``SGLANG_SM120_*``, the kernel package's old names)
    and the upstream switches we read, in name order: ``name``, ``value`` (``shown``: escaped,
    cut at 40 characters), ``status`` (``accepted`` | ``refused (why)``), ``used``. Empty
    values count as unset, and are not listed. Never raises."""
    rows = []
    for name in sorted(os.environ):
        raw = os.environ[name]
        if not raw.strip():
            continue
        if not (name.startswith((PREFIX, *KERNEL_PREFIXES)) or name in READERS):
            continue
        try:
            problem, used = _reading(name, raw)
        except Exception as exc:  # a reader's own failure is a finding, not a crash
            problem, used = f"could not be read ({type(exc).__name__}: {exc})", "unknown"
        status = "accepted" if problem is None else f"refused ({printable(problem)})"
        rows.append({"name": name, "value": shown(raw), "status": status, "used": printable(used)})
    return rows
