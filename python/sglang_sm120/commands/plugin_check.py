"""What the plugin really applies in SGLang's processes, as ``doctor`` reports it: the launcher's
part in doctor's own process, the TP worker's in a fresh one, and a cache of both.

Both parts import SGLang (about 6 s on a quiet CPU box; 17 s for ``import sglang`` and 22 s more
for the scheduler's modules on the H200 machine). What they report is decided by the installed
code, the environment and this host's facts, and by nothing else; so the result is kept in the
cache directory under a key made of exactly those (``check_key``) and reused while the key
holds. ``doctor --recheck`` runs both again; a worker check that could not run is never kept.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from sglang_sm120 import strict_json
from sglang_sm120.commands.args import UsageError, one_line
from sglang_sm120.machine.cache import cache_dir
from sglang_sm120.machine.facts import HostFacts
from sglang_sm120.version import SGLANG_PIN, __version__

WORKER_TIMEOUT_S = 300
WORKER_FAILED = "could not load the plugin as a TP worker would"
# What a TP worker does before it loads plugins: SGLang's scheduler module imported first, so
# the process is judged a TP worker, then load_plugins(); it prints what it really applied.
WORKER_REPORT = (
    "import json, warnings\n"
    "warnings.filterwarnings('ignore', category=UserWarning, module=r'sglang(\\.|$)')\n"
    "import sglang.srt.managers.scheduler\n"
    "from sglang.srt.plugins import load_plugins\n"
    "load_plugins()\n"
    "from sglang_sm120.server.status import verify_applied\n"
    "print('WORKER ' + json.dumps(verify_applied()))\n"
)


class WorkerCheck:
    """The plugin loaded as a TP worker loads it, in a fresh interpreter started as doctor
    begins, so it imports SGLang while this process does the launcher's part: a fresh process,
    as SGLang spawns its schedulers (a fork of this one would carry the CUDA state SGLang's
    import creates on a GPU machine). ``-P``: the working directory is not on its path, as it
    is not on a console script's. Always stopped and reaped, whatever happens here."""

    def __init__(self, code: str = WORKER_REPORT) -> None:
        self.code = code

    def __enter__(self) -> WorkerCheck:
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-c", self.code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="backslashreplace",
        )
        return self

    def statuses(self) -> dict[str, str]:
        """The worker's report (each patch's status), or one ``(worker)`` line saying why not."""
        try:
            out, err = self.proc.communicate(timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return {"(worker)": f"{WORKER_FAILED}: no answer in {WORKER_TIMEOUT_S} s"}
        lines = [line for line in out.splitlines() if line.startswith("WORKER ")]
        try:
            report = strict_json.loads(lines[-1].removeprefix("WORKER ")) if lines else None
        except ValueError:
            report = None
        if isinstance(report, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in report.items()
        ):
            return report
        tail = (err.strip().splitlines() or [f"exit status {self.proc.returncode}"])[-1]
        return {"(worker)": f"{WORKER_FAILED}: {one_line(tail)}"}

    def __exit__(self, *exc: Any) -> None:
        if self.proc.poll() is None:  # doctor stopped before it asked: no child outlives it
            self.proc.kill()
            self.proc.communicate()


def import_sglang() -> None:
    """SGLang's launcher-side modules, in this process (the worker check imports its own). The
    UserWarnings SGLang raises while importing on a machine without a GPU (AWQ, GGUF, Triton)
    are about upstream's import, not this machine: not shown."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"sglang(\.|$)")
    try:
        import sglang.srt.arg_groups.overrides
        import sglang.srt.plugins  # noqa: F401
    except ImportError as exc:
        raise UsageError(
            f"sglang does not import ({one_line(str(exc))}); sglang-sm120 {__version__} needs "
            f"sglang=={SGLANG_PIN} and its dependencies (pip install sglang=={SGLANG_PIN})"
        ) from None


def _unvisited_status(module, stood_down: str | None) -> str:
    """A patch only processes doctor does not start use (an Engine process, the DP controller):
    whether this host needs it, without claiming it was applied; where the launcher and the TP
    worker applied nothing (``stood_down``: why), not that it would be applied either."""
    from sglang_sm120.server.runtime import sm12x_capability
    from sglang_sm120.server.status import ROLE_NAMES

    reason = module.not_needed(sm12x_capability())
    if reason is not None:
        return f"not needed ({reason})"
    names = " and ".join(ROLE_NAMES[role] for role in module.ROLES)
    if stood_down is not None:
        return (
            f"not checked in the {names} (doctor starts no such process); the launcher and "
            f"the TP worker apply nothing: {stood_down}"
        )
    return f"needed in the {names} (doctor starts no such process)"


def plugin_state(worker: WorkerCheck) -> dict[str, Any]:
    """Load plugins exactly as an SGLang launcher does, then take what the TP worker process
    reported, and report what each really applied (every hook looked up in its target's
    applied chain)."""
    from importlib.metadata import entry_points

    from sglang.srt.plugins import load_plugins

    from sglang_sm120.server.contract import check
    from sglang_sm120.server.patches import PATCHES, patch_name
    from sglang_sm120.server.plugin import declared_contract
    from sglang_sm120.server.status import applies_nothing, verify_applied

    discovered = any(
        ep.value == "sglang_sm120:register" for ep in entry_points(group="sglang.srt.plugins")
    )
    load_plugins()
    by_process = {"launcher": verify_applied(), "TP worker": worker.statuses()}
    if not by_process["launcher"]:
        unloaded = "plugin not loaded: check SGLANG_PLUGINS, which must include sglang_sm120"
        by_process["launcher"] = {"(none)": unloaded}
    stood_down = applies_nothing(
        {f"{process}: {n}": s for process, st in by_process.items() for n, s in st.items()}
    )
    patches = {}
    for module in PATCHES:  # each patch as the process that uses it reports it
        name = patch_name(module)
        seen = [statuses[name] for statuses in by_process.values() if name in statuses]
        used = [status for status in seen if not status.startswith("not used in the")]
        if not used and seen and not set(module.ROLES) & {"launcher", "scheduler"}:
            used = [_unvisited_status(module, stood_down)]
        patches[name] = (used or seen or ["plugin not loaded"])[0]
    return {
        "entry_point_discovered": discovered,
        "patches": patches,
        "patches_by_process": by_process,
        "contract_problems": check(declared_contract(PATCHES)),
    }


def patch_lines(state: dict[str, Any]) -> list[str]:
    """Each patch's status, and a line for a process whose check could not run (its patches
    would otherwise read "not used in the launcher" and look fine)."""
    lines = ["patches:"]
    lines += [f"  {name:<22} {status}" for name, status in state["patches"].items()]
    for process, statuses in state["patches_by_process"].items():
        lines += [f"  {process}: {why}" for key, why in statuses.items() if key.startswith("(")]
    return lines


def check_failed(state: dict[str, Any]) -> bool:
    """Whether a process's check could not run (a ``(worker)``/``(none)`` line): never kept."""
    return any(
        key.startswith("(") for statuses in state["patches_by_process"].values() for key in statuses
    )


# ------------------------------------------------------------------------------- the cache

CACHE_VERSION = 1
CACHE_FILE = f"doctor-plugin-check-v{CACHE_VERSION}.json"
CACHE_MAX_BYTES = 1 << 20
CACHE_ENTRIES = 16  # one per environment a user alternates between (validation mode on/off...)
# Packages whose source decides the statuses: each file's (name, size, mtime) is in the key,
# so an edit of an editable install counts. Other packages count by version (``facts``) and
# by the mtime of every directory on sys.path (an install or removal changes it).
SOURCE_PACKAGES = ("sglang", "sglang_sm120", "sgl_kernel_sm120")
PLUGIN_GROUP = "sglang.srt.plugins"
SOURCE_SUFFIXES = (".py", ".so", ".json")
# Variables a shell sets that decide nothing in SGLang's processes; every other one is in the key.
SHELL_NOISE = frozenset(
    {"_", "PWD", "OLDPWD", "SHLVL", "TERM", "COLUMNS", "LINES", "PS1", "PS2", "LS_COLORS",
     "COLORTERM", "DISPLAY", "MAIL", "TMUX", "TMUX_PANE", "STY", "WINDOW", "WINDOWID",
     "LESSOPEN", "LESSCLOSE", "HISTFILE", "HISTSIZE", "HISTCONTROL"}
)  # fmt: skip
SHELL_NOISE_PREFIXES = ("SSH_", "XDG_", "TERM_", "VSCODE_", "KITTY_", "ITERM_")


def _source_stamp(package: str) -> str:
    """A digest of every source file of ``package`` (name, size, mtime), found without
    importing it; "absent" where it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        return "absent"
    digest = hashlib.sha256()
    if not spec.submodule_search_locations:  # a single module
        try:
            info = os.stat(spec.origin or "")
        except OSError:
            return "absent"
        return f"{spec.origin}:{info.st_size}:{info.st_mtime_ns}"
    for location in spec.submodule_search_locations:
        for root, dirs, files in os.walk(location):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(SOURCE_SUFFIXES):
                    try:
                        info = os.stat(os.path.join(root, name))
                    except OSError:
                        continue
                    digest.update(f"{root}/{name}:{info.st_size}:{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _path_stamps() -> list[list[Any]]:
    """Each directory on sys.path with its mtime, which an install or a removal changes. The
    working directory (on the path under ``python -m``) is named without one: any file a user
    writes there changes it."""
    stamps: list[list[Any]] = []
    here = os.getcwd()
    for entry in sys.path:
        path = os.path.abspath(entry or os.curdir)
        try:
            stamps.append([path, None if path == here else os.stat(path).st_mtime_ns])
        except OSError:
            stamps.append([path, "absent"])
    return stamps


def _plugin_packages() -> list[str]:
    """The top-level packages of every ``sglang.srt.plugins`` entry point installed: another
    plugin hooking the same targets changes what ours reports."""
    from importlib.metadata import entry_points

    names = {ep.value.split(":")[0].split(".")[0] for ep in entry_points(group=PLUGIN_GROUP)}
    return sorted(names - set(SOURCE_PACKAGES))


def check_key(facts: HostFacts, environ: dict[str, str] | None = None) -> str:
    """Everything that decides what the launcher and a TP worker apply: the interpreter and its
    path, the source of SGLang, of both our packages and of every other SGLang plugin, every
    installed version, this host's facts and every environment variable but a shell's own."""
    environ = dict(os.environ if environ is None else environ)
    packages = [*SOURCE_PACKAGES, *_plugin_packages()]
    document = {
        "version": CACHE_VERSION,
        "python": [sys.executable, sys.version],
        "path": _path_stamps(),
        "sources": {name: _source_stamp(name) for name in packages},
        "facts": facts.to_json(),
        "env": {
            k: v
            for k, v in sorted(environ.items())
            if k not in SHELL_NOISE and not k.startswith(SHELL_NOISE_PREFIXES)
        },
    }
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()


def _cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def _read_cache() -> dict[str, Any]:
    try:
        document = strict_json.read_json_file(_cache_path(), CACHE_MAX_BYTES)
    except (OSError, ValueError, RecursionError):
        return {}
    entries = document.get("entries") if isinstance(document, dict) else None
    if not isinstance(entries, dict) or document.get("version") != CACHE_VERSION:
        return {}
    return entries


def cached_state(key: str) -> tuple[dict[str, Any], str] | None:
    """(the state kept under ``key``, when it was checked), or None."""
    entry = _read_cache().get(key)
    if not isinstance(entry, dict):
        return None
    state, checked = entry.get("state"), entry.get("checked_at")
    expected = {"entry_point_discovered", "patches", "patches_by_process", "contract_problems"}
    if not isinstance(state, dict) or set(state) != expected or not isinstance(checked, str):
        return None
    return state, checked


def keep_state(key: str, state: dict[str, Any]) -> str:
    """Keep ``state`` under ``key`` (the newest CACHE_ENTRIES keys); returns when it was
    checked. Creates the cache directory; a cache that cannot be written costs only the next
    doctor's time."""
    checked = time.strftime("%Y-%m-%dT%H:%M:%S")
    if check_failed(state):
        return checked
    entries = _read_cache()
    entries.pop(key, None)
    entries[key] = {"checked_at": checked, "state": state}
    entries = dict(list(entries.items())[-CACHE_ENTRIES:])
    path = _cache_path()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}))
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
    return checked
