"""The declared upstream contract matches the installed sglang, and a mismatch applies nothing."""

from __future__ import annotations

import logging
from importlib import metadata

import pytest
from sglang_sm120.server import plugin
from sglang_sm120.server.contract import Symbol, check, mismatch
from sglang_sm120.server.patches import PATCHES, patch_name
from sglang_sm120.server.runtime import PATCH_STATUS
from sglang_sm120.server.upstream_tables import TABLES
from sglang_sm120.version import __version__

FULL_CONTRACT = plugin.declared_contract(PATCHES)
INSTALLED = metadata.version("sglang")


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


def test_parameters_hidden_behind_a_wrapper_are_named_as_hidden(monkeypatch):
    """sglang 0.5.22's custom ops take (*args, **kwargs): the report says the wrapper hides the
    parameters (still a mismatch: nothing checks them), not that they changed."""
    import sglang.srt.layers.flashinfer_comm_fusion as module

    monkeypatch.setattr(module, "_resolve_backend", lambda *args, **kwargs: None)
    problem = mismatch(
        Symbol(
            "sglang.srt.layers.flashinfer_comm_fusion._resolve_backend",
            "function",
            params=("backend", "is_multi_node"),
        )
    )
    assert "found a function taking only ('args', 'kwargs'), which hides them" in problem


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
        s.startswith(f"refused (upstream contract mismatch with sglang {INSTALLED}:")
        and workspace_preflight.TARGET in s
        for s in refused.values()
    )
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert (
        len(errors) == 1
        and __version__ in errors[0].message
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
        s == f"refused (sglang {INSTALLED} installed, sglang-sm120 {__version__} supports 0.5.99 "
        "only)"
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


@pytest.mark.parametrize("table", TABLES, ids=lambda table: table.name)
def test_every_table_planning_upstream_copies_is_the_installed_sglangs(table):
    """``plan`` and ``levers`` answer without importing SGLang, from copies that must stay
    upstream's; the bump report runs these same checks against another release."""
    assert table.differences() == []


def test_the_flags_doctor_and_plan_check_have_copied_choices():
    from sglang_sm120.commands.args import UPSTREAM_FLAGS
    from sglang_sm120.planning.upstream import FLAG_CHOICES

    assert set(UPSTREAM_FLAGS.values()) <= set(FLAG_CHOICES)


def test_a_copy_that_no_longer_holds_names_what_moved(monkeypatch):
    from sglang_sm120.planning import upstream
    from sglang_sm120.server.upstream_tables import TABLES

    table = next(t for t in TABLES if t.name == "FUSION_ARCHS")
    monkeypatch.setattr(upstream, "FUSION_ARCHS", upstream.FUSION_ARCHS - {"GptOssForCausalLM"})
    assert table.differences() == ["FUSION_ARCHS: upstream now also has ['GptOssForCausalLM']"]
    monkeypatch.setattr(upstream, "OUTPLACE_ALLREDUCE_ORDER", ("pcie_ipc", "ca"))
    order = next(t for t in TABLES if t.name == "OUTPLACE_ALLREDUCE_ORDER")
    assert order.differences()[0].startswith("OUTPLACE_ALLREDUCE_ORDER: our copy ('pcie_ipc'")


def test_a_copy_whose_upstream_is_gone_says_it_cannot_be_read(monkeypatch):
    from sglang.srt.distributed.device_communicators import pcie_ipc_ar
    from sglang_sm120.server.upstream_tables import TABLES

    monkeypatch.delattr(pcie_ipc_ar, "_ELIGIBLE_GROUP_NAMES")
    table = next(t for t in TABLES if t.name == "PCIE_IPC_*")
    (problem,) = table.differences()
    assert problem.startswith("PCIE_IPC_*: cannot read device_communicators/pcie_ipc_ar.py")


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


def test_every_all_reduce_switch_levers_judge_is_an_sglang_flag():
    import argparse

    from sglang.srt.server_args import ServerArgs
    from sglang_sm120.machine.facts import load_profile
    from sglang_sm120.planning.levers import allreduce_levers
    from sglang_sm120.planning.policy import Deployment, plan_allreduce
    from sglang_sm120.planning.upstream import FUSION_ARCHS

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    facts, d = load_profile("rtx-pro-6000-x8-pcie"), Deployment(tp_size=8)
    plan = plan_allreduce(facts, d, FUSION_ARCHS)
    for row in allreduce_levers(facts, d, plan, FUSION_ARCHS, None):
        if row.switch.startswith("--"):
            assert row.switch in parser._option_string_actions, row.switch


def test_the_switches_a_tuning_table_turns_on_are_sglang_flags_no_resolution_pass_may_set():
    """The plan names each switch by flag and ServerArgs field; the field is not one SGLang's
    resolution passes may declare, which is why patch upstream_switches applies it in the
    worker (at bootstrap's set_mscclpp / set_torch_symm_mem_all_reduce) instead."""
    import argparse

    from sglang.srt.arg_groups.arg_utils import resolvable_fields
    from sglang.srt.server_args import ServerArgs
    from sglang_sm120.planning.policy import UPSTREAM_SWITCH_FIELDS, UPSTREAM_SWITCH_FLAGS

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    assert UPSTREAM_SWITCH_FIELDS.keys() == UPSTREAM_SWITCH_FLAGS.keys()
    for backend, flag in UPSTREAM_SWITCH_FLAGS.items():
        field = UPSTREAM_SWITCH_FIELDS[backend]
        assert parser._option_string_actions[flag].dest == field
        assert field not in resolvable_fields(ServerArgs)
