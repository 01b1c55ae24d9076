"""doctor's cache of what the launcher and a TP worker apply: its key holds everything that
decides them and nothing a shell changes between two runs, and a check that could not run is
never kept (``sglang_sm120.commands.plugin_check``)."""

from __future__ import annotations

import sys

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
    checked = plugin_check.keep_state("k", STATE)
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
