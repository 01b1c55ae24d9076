"""What the plugin really applies in SGLang's processes, as ``doctor`` reports it: the launcher's
part in doctor's own process, the TP worker's in a fresh one, and a cache of both.

Both parts import SGLang (about 6 s on a quiet CPU box; 17 s for ``import sglang`` and 22 s more
for the scheduler's modules on the H200 machine). What they report is decided by the installed
code, the environment and this host's facts, and by nothing else; so the result is kept in the
cache directory under a key made of exactly those (``check_key``) and reused while the key
holds. ``doctor --recheck`` runs both again; a worker check that could not run is never kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from sglang_sm120 import strict_json
from sglang_sm120.commands.args import UsageError, one_line
from sglang_sm120.env_values import printable
from sglang_sm120.machine.cache import (
    CACHE_ENV,
    cache_dir,
    cache_name,
    relative_problem,
    why_unusable,
)
from sglang_sm120.machine.facts import HostFacts
from sglang_sm120.machine.nccl_conf import conf_files
from sglang_sm120.strict_json import fields, require, require_list
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
    except Exception as exc:  # e.g. HOME a file: torch's cache directory, NotADirectoryError
        cause = one_line(f"{type(exc).__name__}: {exc}")[:500]
        raise UsageError(
            f"sglang does not import ({cause}); the environment it imports in is the cause "
            "(HOME, a cache directory), not the install"
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
CONTENT_MAX_BYTES = 4 << 20  # NCCL reads a config file whole; past this, its stat stands in
KERNEL_LIBRARY_ENV = "SGLANG_SM120_KERNEL_LIBRARY"


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


def _content_stamp(path: str | os.PathLike[str]) -> str:
    """A digest of the content of file ``path`` (a config file NCCL reads whole), read within
    bounds; one that cannot be (absent, a FIFO, too large) by why, its size, mtime and inode."""
    try:
        return hashlib.sha256(strict_json.read_regular_file(path, CONTENT_MAX_BYTES)).hexdigest()
    except (strict_json.UnreadableFile, ValueError) as exc:
        try:
            info = os.stat(path)
            stamp = f"{info.st_size}:{info.st_mtime_ns}:{info.st_ino}"
        except (OSError, ValueError):
            stamp = "-"
        return f"unread ({exc}) {stamp}"


def _read_files(environ: dict[str, str]) -> dict[str, str]:
    """The files besides the sources whose content decides a status: NCCL's config files
    (the TP worker's ``nccl_tuned_env`` keeps off what the user set in them) and the kernel
    library ``SGLANG_SM120_KERNEL_LIBRARY`` names (outside every package's directory)."""
    try:
        paths = [str(path) for path in conf_files(environ)]
    except (OSError, RuntimeError, KeyError, ValueError) as exc:  # no home directory to look in
        paths = [f"(no NCCL config files: {type(exc).__name__})"]
    library = environ.get(KERNEL_LIBRARY_ENV)
    return {path: _content_stamp(path) for path in [*paths, *([library] if library else [])]}


def check_key(facts: HostFacts, environ: dict[str, str] | None = None) -> str:
    """Everything that decides what the launcher and a TP worker apply: the interpreter and its
    path, the source of SGLang, of both our packages and of every other SGLang plugin, every
    installed version, this host's facts, every environment variable but a shell's own, and
    the content of the files those variables name (``_read_files``)."""
    environ = dict(os.environ if environ is None else environ)
    packages = [*SOURCE_PACKAGES, *_plugin_packages()]
    document = {
        "version": CACHE_VERSION,
        "python": [sys.executable, sys.version],
        "path": _path_stamps(),
        "sources": {name: _source_stamp(name) for name in packages},
        "files": _read_files(environ),
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


CHECKED_AT = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", re.ASCII)  # as keep_state writes
MAX_SHOWN_CHARS = 2000  # a status, a contract problem: one line of a report, not a document
STATE_KEYS = ("entry_point_discovered", "patches", "patches_by_process", "contract_problems")


def _line(value: Any, where: str) -> str:
    """A string doctor prints as is: at most MAX_SHOWN_CHARS, no control characters."""
    text = strict_json.check_value(value, str, where, limit=MAX_SHOWN_CHARS)
    if not text.isprintable():
        raise strict_json.FieldError(f"{where} holds control characters: {strict_json.shown(text)}")
    return text


def _statuses(value: Any, where: str) -> dict[str, str]:
    """A non-empty JSON object of patch name -> status (each a printable line)."""
    statuses = strict_json.fields(value, where)
    if not statuses:
        raise strict_json.FieldError(f"{where} is empty (every check reports each patch)")
    for name, status in statuses.items():
        _line(name, f"{where} key")
        _line(status, strict_json.field_path(where, name))
    return statuses


def _entry(entry: Any, where: str) -> tuple[dict[str, Any], str]:
    """A kept entry checked field by field, as doctor prints and merges it; FieldError naming
    the field otherwise (a list where a JSON object is due, ``"no"`` for a boolean...)."""
    entry = fields(entry, where, known=("checked_at", "state"))
    checked = _line(require(entry, "checked_at", str, where), f"{where}.checked_at")
    if not CHECKED_AT.fullmatch(checked):
        raise strict_json.FieldError(
            f"{where}.checked_at must be a time such as 2026-12-03T06:00:00, "
            f"got {strict_json.shown(checked)}"
        )
    at = f"{where}.state"
    state = fields(require(entry, "state", dict, where), at, known=STATE_KEYS)
    require(state, "entry_point_discovered", bool, at)
    _statuses(require(state, "patches", dict, at), f"{at}.patches")
    by_process = require(state, "patches_by_process", dict, at)
    if not by_process:
        raise strict_json.FieldError(f"{at}.patches_by_process is empty")
    for process, statuses in by_process.items():
        where_process = strict_json.field_path(f"{at}.patches_by_process", _line(process, at))
        _statuses(statuses, where_process)
    problems = require_list(state, "contract_problems", str, at, max_items=1000)
    for i, problem in enumerate(problems):
        _line(problem, f"{at}.contract_problems[{i}]")
    return state, checked


def _read_cache() -> tuple[dict[str, Any], str | None]:
    """(the kept entries, why the file could not be used or None). A missing file is no
    problem: nothing was kept yet."""
    path = "the cache file"
    try:
        path = printable(_cache_path())
        document = strict_json.read_json_file(_cache_path(), CACHE_MAX_BYTES)
    except strict_json.JsonInputError as exc:  # nothing there (no directory yet) is no problem
        return {}, f"{path} unreadable ({exc})" if _there(_cache_path()) else None
    except (OSError, ValueError, RecursionError, RuntimeError, KeyError) as exc:
        return {}, f"{path} unreadable ({type(exc).__name__}: {one_line(str(exc))})"
    try:
        document = strict_json.fields(document, "", known=("version", "entries"))
        version = strict_json.require(document, "version", int)
        entries = strict_json.require(document, "entries", dict)
    except strict_json.FieldError as exc:
        return {}, f"{path} unusable ({exc})"
    if version != CACHE_VERSION:
        return {}, None  # another version's file: rewritten in this one's format
    return entries, None


def _there(path: Path) -> bool:
    """Whether anything is at ``path`` (a cache directory below a file has nothing there)."""
    try:
        return os.path.lexists(path)
    except (OSError, ValueError):
        return False


def kept_state(key: str) -> tuple[tuple[dict[str, Any], str] | None, str | None]:
    """((the state kept under ``key``, when it was checked) or None, why what was kept could
    not be used or None). Every field is checked before doctor prints or merges it: a bad
    entry, or a file that is not the cache's, means "check again", never a traceback."""
    entries, problem = _read_cache()
    if key not in entries:
        return None, problem
    try:
        return _entry(entries[key], "entry"), None
    except (strict_json.JsonInputError, RecursionError) as exc:
        return None, f"{printable(_cache_path())}: its entry for this check is unusable ({exc})"


def cached_state(key: str) -> tuple[dict[str, Any], str] | None:
    """(the state kept under ``key``, when it was checked), or None (``kept_state``)."""
    return kept_state(key)[0]


def keep_state(key: str, state: dict[str, Any]) -> tuple[str, str | None]:
    """Keep ``state`` under ``key`` (the newest CACHE_ENTRIES keys); returns (when it was
    checked, why it could not be kept or None). Creates the cache directory. Never raises: a
    cache that cannot be written (a file, below a file, /dev/null, a FIFO, a loop of links,
    a name too long) costs only the next doctor's time, and doctor says so in one line."""
    checked = time.strftime("%Y-%m-%dT%H:%M:%S")
    if check_failed(state):
        return checked, None
    entries, _ = _read_cache()
    entries.pop(key, None)
    entries[key] = {"checked_at": checked, "state": state}
    entries = dict(list(entries.items())[-CACHE_ENTRIES:])
    tmp: Path | None = None
    try:
        path = _cache_path()
        relative = relative_problem(path.parent)
        if relative:  # refused as every reader and writer of the cache refuses it
            return checked, f"could not keep these checks ({_where(path.parent)}: {relative})"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}))
        tmp.replace(path)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        if tmp is not None:
            with contextlib.suppress(OSError, ValueError):
                tmp.unlink(missing_ok=True)
        return checked, f"could not keep these checks ({_where_not_kept(exc)})"
    return checked, None


def _where_not_kept(exc: BaseException) -> str:
    """The cache directory and why it took nothing, in one line."""
    try:
        directory = cache_dir()
    except (RuntimeError, KeyError):  # no home directory to put the default under
        return f"no cache directory: {one_line(str(exc))}; set {CACHE_ENV}"
    why = why_unusable(exc, directory) if isinstance(exc, OSError) else str(exc)
    return f"{_where(directory)}: {one_line(why)}"


def _where(directory: Path) -> str:
    return printable(cache_name(directory))
