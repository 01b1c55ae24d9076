"""Boolean switches are read one way (``runtime.env_switch``): the table below is the whole
rule, and the plugin and ``doctor`` read the kill switch through it, so they cannot disagree."""

from __future__ import annotations

import json
import logging

import pytest
from sglang_sm120.server import runtime
from test_cli import run_cli

DISABLE = "SGLANG_SM120_DISABLE"
NO_P2P = {"SGLANG_SM120_TOPOLOGY": "rtx-5090-x2-nop2p"}

# value as set (None: unset) -> what the switch reads (None: the caller's default), warned?
ROWS = [
    (None, None, False),
    ("", None, False),
    ("   ", None, False),
    ("1", True, False),
    ("true", True, False),
    ("TRUE", True, False),
    (" yes ", True, False),
    ("On", True, False),
    ("0", False, False),
    (" 0", False, False),
    ("false", False, False),
    ("No", False, False),
    ("OFF\n", False, False),
    ("2", None, True),
    ("enable", None, True),
    ("false!", None, True),
    ("y", True, False),  # upstream's EnvBool words are all switch words here
    ("N", False, False),
    ("yess", None, True),
]


def set_or_unset(monkeypatch, name: str, raw: str | None) -> None:
    """Variable ``name`` set to ``raw`` (None: unset), as a row of the table has it."""
    if raw is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, raw)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(runtime, "_logged", set())


@pytest.mark.parametrize(("raw", "expected", "warned"), ROWS, ids=[repr(r[0]) for r in ROWS])
def test_a_switch_reads_on_off_or_the_default_with_one_warning(
    monkeypatch, caplog, raw, expected, warned
):
    set_or_unset(monkeypatch, DISABLE, raw)
    with caplog.at_level(logging.WARNING, logger="sglang_sm120"):
        assert [runtime.env_switch(DISABLE) for _ in range(3)] == [expected] * 3
    warnings = [r.getMessage() for r in caplog.records]
    if warned:
        assert warnings == [
            f"sglang-sm120: {DISABLE}={raw!r} is not a switch value "
            "(1/true/yes/y/on or 0/false/no/n/off): ignored, default kept"
        ]
    else:
        assert warnings == []


@pytest.mark.parametrize(("raw", "disabled"), [("1", True), ("false", False), (" 0", False)])
def test_the_kill_switch_is_on_only_for_an_on_value(monkeypatch, raw, disabled):
    monkeypatch.setenv(DISABLE, raw)
    assert runtime.plugin_disabled() is disabled


@pytest.mark.parametrize(
    ("raw", "on", "warned"),
    [("1", True, False), (" 1 ", True, False), ("0", False, False), ("true", False, True)],
)
def test_validation_mode_is_on_only_for_1(monkeypatch, caplog, raw, on, warned):
    """SGLANG_SM120_ANY_ARCH is a test switch: "true" is refused with a warning, not taken."""
    monkeypatch.setenv("SGLANG_SM120_ANY_ARCH", raw)
    with caplog.at_level(logging.WARNING, logger="sglang_sm120"):
        assert runtime.validation_mode() is on
    assert ("only 1 turns validation mode on" in caplog.text) is warned


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("on", True), (" 1", True), ("no", False), ("n", False), ("", False), ("maybe", False)],
)
def test_pcie_ipc_variable_reads_as_a_switch(monkeypatch, raw, expected):
    monkeypatch.setenv(runtime.PCIE_IPC_ENV, raw)
    assert runtime.pcie_ipc_env() is expected


@pytest.mark.parametrize("raw", ["false", " 0"])
def test_doctor_and_the_plugin_agree_that_an_off_value_leaves_the_plugin_on(raw):
    proc = run_cli("doctor", "--json", env={**NO_P2P, DISABLE: raw})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["kill_switch"] is False
    assert not any(s.startswith("disabled") for s in report["patches"].values())


def test_doctor_says_the_kill_switch_is_on_only_when_the_patches_say_disabled():
    proc = run_cli("doctor", env={**NO_P2P, DISABLE: "yes"})
    assert proc.returncode == 0, proc.stderr
    assert "kill switch SGLANG_SM120_DISABLE=1: the plugin applies nothing" in proc.stdout
    assert "disabled (SGLANG_SM120_DISABLE=1)" in proc.stdout


@pytest.mark.parametrize(("raw", "expected", "warned"), ROWS, ids=[repr(r[0]) for r in ROWS])
def test_the_kernel_package_reads_a_switch_as_the_plugin_does(monkeypatch, raw, expected, warned):
    """sgl-kernel-sm120 sits below the plugin and keeps its own copy of the switch words
    (``config.env_switch``, for $SGLANG_SM120_PDL): every row of the table reads the same there,
    a value the plugin warns of and ignores being one the kernels refuse."""
    from sgl_kernel_sm120 import config

    set_or_unset(monkeypatch, config.ENV_PDL, raw)
    if warned:
        with pytest.raises(ValueError, match="is not a switch"):
            config.env_switch(config.ENV_PDL)
    else:
        assert config.env_switch(config.ENV_PDL) is expected
