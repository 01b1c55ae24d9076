"""The declared upstream contract matches the installed sglang, and a mismatch applies nothing."""

from __future__ import annotations

import logging

import pytest
from sglang_sm120.server import plugin
from sglang_sm120.server.contract import Symbol, check, mismatch
from sglang_sm120.server.patches import PATCHES, patch_name
from sglang_sm120.server.runtime import PATCH_STATUS

FULL_CONTRACT = plugin.declared_contract(PATCHES)


def test_installed_sglang_matches_every_declared_symbol():
    assert check(FULL_CONTRACT) == []


def test_every_hook_target_is_declared_in_its_patch_contract():
    for module in PATCHES:
        declared = {s.target for s in module.CONTRACT}
        for target, _, _ in module.HOOKS:
            assert target in declared, f"{patch_name(module)} hooks {target} without declaring it"


def test_missing_symbol_is_named():
    problem = mismatch(
        Symbol("sglang.srt.layers.flashinfer_comm_fusion._resolve_backend_v2", "function")
    )
    assert problem.startswith(
        "sglang.srt.layers.flashinfer_comm_fusion._resolve_backend_v2: not found"
    )


def test_changed_signature_is_named():
    problem = mismatch(
        Symbol(
            "sglang.srt.layers.flashinfer_comm_fusion._resolve_backend",
            "function",
            params=("backend",),
        )
    )
    assert "expected parameters ('backend',), found ('backend', 'is_multi_node')" in problem


def test_reordered_parameters_are_a_mismatch():
    """Positional calls break when upstream reorders parameters, even with the same names."""
    problem = mismatch(
        Symbol(
            "sglang.srt.layers.flashinfer_comm_fusion._resolve_backend",
            "function",
            params=("is_multi_node", "backend"),
        )
    )
    assert problem is not None and "expected parameters" in problem


def test_constant_no_longer_read_is_named():
    problem = mismatch(
        Symbol(
            "sglang.srt.layers.layer_boundary.residual.add_norm.flashinfer_ar_fusion_applies",
            "function",
            reads=("_is_sm120_supported",),
        )
    )
    assert "no longer reads _is_sm120_supported" in problem


@pytest.fixture
def pcie_host(monkeypatch):
    """Our facts say 8x SM120 PCIe; restore the cached capability and statuses afterwards."""
    from sglang_sm120.machine import facts
    from sglang_sm120.server import runtime

    monkeypatch.setenv("SGLANG_SM120_TOPOLOGY", "rtx-pro-6000-x8-pcie")
    monkeypatch.delenv("SGLANG_SM120_DISABLE", raising=False)
    for cached in (facts.current_facts, runtime.sm12x_capability):
        cached.cache_clear()
    yield
    for cached in (facts.current_facts, runtime.sm12x_capability):
        cached.cache_clear()
    PATCH_STATUS.clear()


def test_renamed_upstream_symbol_applies_nothing_and_logs_one_error(pcie_host, monkeypatch, caplog):
    """Simulate an upstream rename on the real module: the seam disappears."""
    from sglang.srt.layers import flashinfer_comm_fusion
    from sglang_sm120.server.patches import workspace_preflight

    monkeypatch.delattr(flashinfer_comm_fusion, "_flashinfer_trtllm_workspace_allocation_sizes")
    with caplog.at_level(logging.ERROR, logger="sglang_sm120"):
        statuses = plugin.register_patches("scheduler")
    assert set(statuses) == {patch_name(m) for m in PATCHES}
    refused = {n: s for n, s in statuses.items() if not s.startswith(("not needed", "not used in"))}
    assert set(refused) >= {"status_line", "workspace_preflight", "pcie_ipc_enable"}
    assert all(
        s.startswith("refused (upstream contract mismatch with sglang 0.5.23:")
        and workspace_preflight.TARGET in s
        for s in refused.values()
    )
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert (
        len(errors) == 1
        and "0.5.23.1" in errors[0].message
        and workspace_preflight.TARGET in errors[0].message
    )
    from sglang.srt.plugins.hook_registry import HookRegistry

    registered = [hook for hooks in HookRegistry._hooks.values() for _, hook, _ in hooks]
    assert not any(hook in registered for m in PATCHES for _, hook, _ in m.HOOKS)


def test_changed_signature_upstream_applies_nothing(pcie_host, monkeypatch):
    from sglang.srt.distributed.device_communicators import pcie_ipc_ar

    def eligible_group(*, group_name, world_size):  # upstream dropped a parameter
        return False

    monkeypatch.setattr(pcie_ipc_ar, "eligible_group", eligible_group)
    statuses = plugin.register_patches("scheduler")
    assert statuses["pcie_ipc_enable"].startswith("refused (")
    assert all(
        "expected parameters ('group_name', 'world_size', 'deterministic')" in s
        for s in statuses.values()
        if not s.startswith(("not needed", "not used in"))
    )


def test_wrong_sglang_version_applies_nothing(pcie_host, monkeypatch):
    monkeypatch.setattr(plugin, "SGLANG_PIN", "0.5.99")
    statuses = plugin.register_patches("scheduler")
    assert statuses["status_line"].startswith("refused (")
    assert all(
        s == "refused (sglang 0.5.23 installed, sglang-sm120 0.5.23.1 supports 0.5.99 only)"
        for s in statuses.values()
        if not s.startswith(("not needed", "not used in"))
    )


def test_register_never_raises(monkeypatch):
    def broken(role: str) -> dict:
        raise RuntimeError("boom")

    monkeypatch.setattr(plugin, "register_patches", broken)
    plugin.register()
    assert all(s == "refused (plugin error; see the log)" for s in PATCH_STATUS.values())
    PATCH_STATUS.clear()


def test_the_fusion_archs_plan_uses_are_the_installed_sglangs():
    """``plan`` answers without importing SGLang, from a copy that must stay upstream's table."""
    from sglang.srt.arg_groups.overrides import _FLASHINFER_ALLREDUCE_FUSION_ARCHS
    from sglang_sm120.planning.upstream import FUSION_ARCHS

    assert frozenset(_FLASHINFER_ALLREDUCE_FUSION_ARCHS) == FUSION_ARCHS


def test_the_flag_choices_doctor_and_plan_check_are_the_installed_sglangs():
    import argparse

    from sglang.srt.server_args import ServerArgs
    from sglang_sm120.commands.args import UPSTREAM_FLAGS
    from sglang_sm120.planning.upstream import FLAG_CHOICES

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    actions = parser._option_string_actions  # argparse keeps no public map of its options
    assert set(UPSTREAM_FLAGS.values()) <= set(FLAG_CHOICES)
    for flag, choices in FLAG_CHOICES.items():
        assert tuple(str(c) for c in actions[flag].choices) == choices, flag


def test_plan_imports_neither_sglang_nor_torch(tmp_path):
    """What makes plan answer in a second: a refused flag and a plan, in a fresh process."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from sglang_sm120.commands.cli import main\n"
        "for argv in (['plan', '--profile', 'rtx-pro-6000-x8-pcie', '--tp', '8'],\n"
        "             ['plan', '--profile', 'rtx-pro-6000-x8-pcie', '--tp', '8',\n"
        "              '--fusion-backend', 'bogus']):\n"
        "    main(argv)\n"
        "print(sorted(m for m in ('sglang', 'torch') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout[-2000:] + proc.stderr[-2000:]
