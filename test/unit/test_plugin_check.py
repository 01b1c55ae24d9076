"""doctor's cache of what the launcher and a TP worker apply: its key holds everything that
decides them and nothing a shell changes between two runs, and a check that could not run is
never kept (``sglang_sm120.commands.plugin_check``)."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
from sglang_sm120.commands import plugin_check
from sglang_sm120.machine.facts import load_profile

FACTS = load_profile("rtx-pro-6000-x8-pcie")
ENV = {"SGLANG_SM120_ANY_ARCH": "1", "PATH": "/usr/bin", "PWD": "/home/a", "TERM": "xterm"}
STATE = {
    "entry_point_discovered": True,
    "patches": {"resolve_backend": "applied"},
    "patches_by_process": {
        "launcher": {"resolve_backend": "not used in the launcher"},
        "TP worker": {"resolve_backend": "applied"},
    },
    "contract_problems": [],
}


def test_the_key_follows_what_decides_the_checks_and_not_the_shell():
    key = plugin_check.check_key(FACTS, ENV)
    assert plugin_check.check_key(FACTS, {**ENV, "PWD": "/tmp", "TERM": "dumb"}) == key
    assert plugin_check.check_key(FACTS, {**ENV, "SSH_TTY": "/dev/pts/3"}) == key
    assert plugin_check.check_key(FACTS, {k: v for k, v in ENV.items() if "ANY" not in k}) != key
    assert plugin_check.check_key(FACTS, {**ENV, "SGLANG_PLUGINS": "other"}) != key
    assert plugin_check.check_key(FACTS, {**ENV, "NCCL_PROTO": "LL"}) != key
    assert plugin_check.check_key(load_profile("rtx-5090-x2-nop2p"), ENV) != key


def test_an_edited_or_added_source_file_changes_the_key(tmp_path, monkeypatch):
    """An editable install is edited in place: its files' (name, size, mtime) are in the key,
    found without importing the package."""
    package = tmp_path / "sglang"
    package.mkdir()
    (package / "__init__.py").write_text("")
    module = package / "server_args.py"
    module.write_text("A = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    before = plugin_check.check_key(FACTS, ENV)
    assert "sglang" not in sys.modules
    module.write_text("A = 22\n")
    edited = plugin_check.check_key(FACTS, ENV)
    (package / "new.py").write_text("")
    added = plugin_check.check_key(FACTS, ENV)
    assert len({before, edited, added}) == 3


def test_a_kept_state_is_read_back_and_a_failed_check_is_never_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(tmp_path / "new" / "cache"))
    assert plugin_check.cached_state("k") is None
    checked, not_kept = plugin_check.keep_state("k", STATE)
    assert not_kept is None
    assert plugin_check.cached_state("k") == (STATE, checked)
    failed = {**STATE, "patches_by_process": {"TP worker": {"(worker)": "could not load"}}}
    plugin_check.keep_state("f", failed)
    assert plugin_check.cached_state("f") is None
    for n in range(plugin_check.CACHE_ENTRIES):  # the newest entries are kept, not every one
        plugin_check.keep_state(f"other-{n}", STATE)
    assert plugin_check.cached_state("k") is None
    assert plugin_check.cached_state(f"other-{plugin_check.CACHE_ENTRIES - 1}") is not None


def test_a_damaged_cache_is_a_miss_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(tmp_path))
    path = tmp_path / plugin_check.CACHE_FILE
    for text in ("{", "[]", '{"version": 1, "entries": {"k": {"state": 3}}}', "\0" * 10):
        path.write_text(text)
        assert plugin_check.cached_state("k") is None
    path.write_text('{"version": 1, "entries": {"k": {"checked_at": "t", "state": {"a": 1}}}}')
    assert plugin_check.cached_state("k") is None  # not the four keys doctor merges in


def test_an_install_changes_the_key_and_a_file_written_in_the_working_directory_does_not(
    tmp_path, monkeypatch
):
    """Under ``python -m`` the working directory is on the path: a file a user writes there
    does not make doctor check again; a package installed into a directory on the path does."""
    site, here = tmp_path / "site", tmp_path / "here"
    site.mkdir(), here.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(here))
    monkeypatch.chdir(here)
    key = plugin_check.check_key(FACTS, ENV)
    (here / "notes.txt").write_text("x")
    assert plugin_check.check_key(FACTS, ENV) == key
    (site / "other_plugin-1.0.dist-info").mkdir()
    assert plugin_check.check_key(FACTS, ENV) != key


def test_another_sglang_plugins_source_is_in_the_key(tmp_path, monkeypatch):
    """A second plugin hooking the same targets changes what ours reports: its source (found
    through its entry point, not imported) is in the key."""
    (tmp_path / "other_plugin.py").write_text("def register():\n    pass\n")
    info = tmp_path / "other_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: other-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[sglang.srt.plugins]\nother = other_plugin:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "other_plugin" in plugin_check._plugin_packages()
    key = plugin_check.check_key(FACTS, ENV)
    (tmp_path / "other_plugin.py").write_text("def register():\n    return 1\n")
    assert plugin_check.check_key(FACTS, ENV) != key


def _library_files(package: Path) -> list[Path]:
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_C.so").write_bytes(b"\x7fELF1")
    (package / "config.json").write_text('{"a": 1}')
    return [package / "_C.so", package / "config.json"]


@pytest.mark.parametrize("name", ["sglang", "sgl_kernel_sm120"])
def test_an_edited_library_or_json_file_of_a_package_changes_the_key(tmp_path, monkeypatch, name):
    """A rebuilt .so or an edited .json (a kernel table, a config) of SGLang or of our
    packages decides the statuses as much as a .py file does."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    library, document = _library_files(tmp_path / name)
    keys = [plugin_check.check_key(FACTS, ENV)]
    library.write_bytes(b"\x7fELF22")
    keys.append(plugin_check.check_key(FACTS, ENV))
    document.write_text('{"a": 22}')
    keys.append(plugin_check.check_key(FACTS, ENV))
    assert len(set(keys)) == 3


def test_editing_ncclconf_files_content_changes_the_key(tmp_path):
    """The TP worker's nccl_tuned_env keeps off what the user set in NCCL's config files: the
    key holds their content (issue 32 item 6), not only the variable that names one."""
    conf = tmp_path / "nccl.conf"
    conf.write_text("NCCL_PROTO=LL\n")
    env = {**ENV, "NCCL_CONF_FILE": str(conf)}
    key = plugin_check.check_key(FACTS, env)
    assert plugin_check.check_key(FACTS, env) == key
    conf.write_text("NCCL_PROTO=Simple\n")  # as long as before, the same name
    edited = plugin_check.check_key(FACTS, env)
    assert edited != key
    conf.unlink()
    assert plugin_check.check_key(FACTS, env) not in (key, edited)


def test_a_config_file_that_cannot_be_read_in_bounds_still_gives_a_key(tmp_path):
    """A FIFO nobody writes, a directory, /dev/zero as NCCL_CONF_FILE: the key is made at once
    (bounded reads), and differs from a readable file's."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    keys = {
        plugin_check.check_key(FACTS, {**ENV, "NCCL_CONF_FILE": str(path)})
        for path in (fifo, tmp_path, "/dev/zero")
    }
    assert len(keys) == 3


def _long_path(tmp_path: Path) -> str:
    return str(tmp_path / "/".join(["d" * 200] * 25))


def _a_file(tmp_path: Path) -> str:
    (tmp_path / "file").write_text("x")
    return str(tmp_path / "file")


def _below_a_file(tmp_path: Path) -> str:
    return str(Path(_a_file(tmp_path)) / "cache")


def _fifo(tmp_path: Path) -> str:
    os.mkfifo(tmp_path / "fifo")
    return str(tmp_path / "fifo")


def _link_loop(tmp_path: Path) -> str:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    return str(tmp_path / "a" / "cache")


def _control_characters(tmp_path: Path) -> str:
    _a_file(tmp_path)
    (tmp_path / "file\x1b[31m\n").write_text("x")
    return str(tmp_path / "file\x1b[31m\n" / "cache")


UNUSABLE_CACHE_DIRS = [
    ("a file", _a_file, "a file, not a directory"),
    ("below a file", _below_a_file, "Not a directory"),
    ("/dev/null", lambda tmp_path: "/dev/null", "/dev/null: a device, not a directory"),
    ("a FIFO", _fifo, "a FIFO, not a directory"),
    ("a 5000-character path", _long_path, "File name too long"),
    ("a loop of links", _link_loop, "Too many levels of symbolic links"),
    ("control characters", _control_characters, "\\x1b[31m\\n"),
    ("relative", lambda tmp_path: "cache", "a relative path"),
]


@pytest.mark.parametrize(
    ("make", "why"), [r[1:] for r in UNUSABLE_CACHE_DIRS], ids=[r[0] for r in UNUSABLE_CACHE_DIRS]
)
def test_a_cache_directory_that_cannot_take_the_checks_is_one_line_not_a_crash(
    tmp_path, monkeypatch, make, why
):
    """docs/configuration.md: an unusable cache directory is never an error. doctor keeps
    nothing and says so in one line naming the directory and why (issue 33 item 1)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", make(tmp_path))
    assert plugin_check.cached_state("k") is None
    checked, not_kept = plugin_check.keep_state("k", STATE)
    assert plugin_check.CHECKED_AT.fullmatch(checked)
    assert not_kept.startswith("could not keep these checks (SGLANG_SM120_CACHE_DIR="), not_kept
    assert not_kept.isprintable() and why in not_kept, not_kept
    assert not (tmp_path / "cache").exists()  # a relative name is refused, not created here
    assert plugin_check.cached_state("k") is None


@pytest.mark.parametrize(
    "make", [r[1] for r in UNUSABLE_CACHE_DIRS], ids=[r[0] for r in UNUSABLE_CACHE_DIRS]
)
def test_the_kernel_image_scans_are_not_kept_there_either_and_nothing_raises(
    tmp_path, monkeypatch, make
):
    """doctor's other file in the cache directory, kernel-images-v1.json, after its checks."""
    from sglang_sm120.machine.kernel_images import ScanCache

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", make(tmp_path))
    scans = ScanCache.load()
    scans.entries["lib.so"], scans.changed = {"stamp": [1, 2]}, True
    scans.save()
    assert not (tmp_path / "cache").exists()


def _entry(**changes) -> dict:
    """A kept entry with ``changes`` applied to its state (``checked_at``: to the entry)."""
    entry = {"checked_at": "2026-12-03T06:00:00", "state": copy.deepcopy(STATE)}
    for name, value in changes.items():
        (entry if name == "checked_at" else entry["state"])[name] = value
    return entry


BAD_ENTRIES = [
    ("patches a list", _entry(patches=["applied"]), "patches must be a JSON object"),
    ("patches empty", _entry(patches={}), "patches is empty"),
    ("an integer status", _entry(patches={"resolve_backend": 1}), "must be a string"),
    ("by process a string", _entry(patches_by_process="launcher"), "must be a JSON object"),
    ("a process's statuses a list", _entry(patches_by_process={"launcher": []}), "launcher"),
    ("discovered 'no'", _entry(entry_point_discovered="no"), "must be true or false"),
    ("problems a string", _entry(contract_problems="none"), "contract_problems must be a list"),
    ("problems of integers", _entry(contract_problems=[1]), "contract_problems[0]"),
    ("checked_at with ESC", _entry(checked_at="2026\n\x1b[2J"), "control characters"),
    ("checked_at not a time", _entry(checked_at="yesterday"), "must be a time such as"),
    ("checked_at a number", _entry(checked_at=5), "checked_at must be a string"),
    ("a status with ESC", _entry(patches={"resolve_backend": "ok\x1b[2J"}), "control characters"),
    ("an unknown key", {**_entry(), "extra": 1}, "unknown key 'extra'"),
]


@pytest.mark.parametrize(
    ("entry", "why"), [r[1:] for r in BAD_ENTRIES], ids=[r[0] for r in BAD_ENTRIES]
)
def test_a_kept_entry_of_the_wrong_shape_means_check_again_with_one_line(
    tmp_path, monkeypatch, entry, why
):
    """Right key, wrong types: never reused (no AttributeError, no false MISMATCH, no raw
    escape sequence printed); kept_state says in one line which field (issue 33 item 2)."""
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(tmp_path))
    document = {"version": plugin_check.CACHE_VERSION, "entries": {"k": entry}}
    (tmp_path / plugin_check.CACHE_FILE).write_text(json.dumps(document))
    assert plugin_check.cached_state("k") is None
    reused, problem = plugin_check.kept_state("k")
    assert reused is None and why in problem, problem
    assert problem.isprintable() and len(problem) < 500, problem


@pytest.mark.parametrize(
    "document",
    [{"version": True, "entries": {"k": _entry()}}, {"version": 1, "entries": []}],
    ids=["version true", "entries a list"],
)
def test_a_cache_file_of_another_shape_is_named_and_checked_again(tmp_path, monkeypatch, document):
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(tmp_path))
    (tmp_path / plugin_check.CACHE_FILE).write_text(json.dumps(document))
    reused, problem = plugin_check.kept_state("k")
    assert reused is None and "unusable" in problem, problem
    _, not_kept = plugin_check.keep_state("k", STATE)  # and rewritten in this version's shape
    assert not_kept is None and plugin_check.kept_state("k") == ((STATE, _), None)


def test_a_good_entry_is_reused_and_no_line_is_said(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(tmp_path))
    document = {"version": plugin_check.CACHE_VERSION, "entries": {"k": _entry()}}
    (tmp_path / plugin_check.CACHE_FILE).write_text(json.dumps(document))
    assert plugin_check.kept_state("k") == ((STATE, "2026-12-03T06:00:00"), None)
    assert plugin_check.kept_state("other") == (None, None)
