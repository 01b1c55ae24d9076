"""What the two distributions declare: one version, the kernel as a pinned dependency of the
plugin, and the Apache-2.0 text shipped with each (the built wheels are checked by .ci/run)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import sgl_kernel_sm120
import sglang_sm120

ROOT = Path(__file__).resolve().parents[2]


def _project(path: Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


PLUGIN = _project(ROOT / "pyproject.toml")
KERNEL = _project(ROOT / "sgl-kernel-sm120" / "pyproject.toml")


def test_plugin_and_kernel_are_released_with_one_version():
    assert PLUGIN["version"] == KERNEL["version"] == sglang_sm120.__version__
    assert sgl_kernel_sm120.__version__ == KERNEL["version"]


def test_plugin_depends_on_the_kernel_of_its_own_version():
    assert f"sgl-kernel-sm120=={KERNEL['version']}" in PLUGIN["dependencies"]
    assert f"sglang=={sglang_sm120.SGLANG_PIN}" in PLUGIN["dependencies"]


def test_both_distributions_ship_the_apache_license_text():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert (ROOT / "sgl-kernel-sm120" / "LICENSE").read_text() == text
    for project in (PLUGIN, KERNEL):
        assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
