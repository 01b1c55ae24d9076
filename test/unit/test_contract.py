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


def test_the_custom_all_reduce_rules_levers_state_are_the_installed_sglangs():
    """Custom all-reduce: its world sizes, its size limit, more than two PCIe-only GPUs
    refused, and a world of 2 or full NVLink served."""
    import inspect

    from sglang.srt.distributed.device_communicators import custom_all_reduce_utils as utils
    from sglang.srt.distributed.device_communicators.custom_all_reduce import CustomAllreduce
    from sglang_sm120.planning import upstream

    assert tuple(CustomAllreduce._SUPPORTED_WORLD_SIZES) == upstream.CUSTOM_ALL_REDUCE_WORLD_SIZES
    assert CustomAllreduce._MAX_CAR_SIZE == upstream.CUSTOM_ALL_REDUCE_MAX_BYTES
    pcie = upstream.CUSTOM_ALL_REDUCE_PCIE_MAX_WORLD
    refusal = inspect.getsource(utils.can_use_custom_all_reduce_with_nvlink)
    assert f"world_size > {pcie} and not full_nvlink" in refusal
    assert "can_p2p(" in refusal and "in_the_same_node_as(" in refusal
    served = inspect.getsource(CustomAllreduce.should_custom_ar)
    assert f"self.world_size == {pcie} or self.full_nvlink" in served


def test_the_mscclpp_conditions_levers_state_are_the_installed_sglangs():
    import inspect

    from sglang.srt.distributed.device_communicators import pymscclpp
    from sglang_sm120.planning import upstream

    assert pymscclpp._SUPPORTED_WORLD_SIZES == upstream.MSCCLPP_WORLD_SIZES
    init = inspect.getsource(pymscclpp.PyMscclppCommunicator.__init__)
    for module in upstream.MSCCLPP_MODULES:
        assert f'importlib.import_module("{module}")' in init, module
    assert "self.world_size not in _SUPPORTED_WORLD_SIZES" in init


def test_the_torch_symm_mem_table_levers_state_is_the_installed_sglangs():
    import inspect

    from sglang.srt.distributed.device_communicators import torch_symm_mem
    from sglang.srt.distributed.device_communicators.all_reduce_utils import (
        TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES,
    )
    from sglang_sm120.planning import upstream

    assert TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES == upstream.TORCH_SYMM_MEM_MAX_BYTES
    init = inspect.getsource(torch_symm_mem.TorchSymmMemCommunicator.__init__)
    assert "handle.multicast_ptr == 0" in init  # no multicast: disabled


def test_the_pcie_ipc_conditions_the_plan_states_are_the_installed_sglangs():
    from sglang.srt.distributed.device_communicators import pcie_ipc_ar
    from sglang_sm120.planning import upstream
    from sglang_sm120.planning.policy import PCIE_IPC_WORLD_SIZES

    assert pcie_ipc_ar._SUPPORTED_WORLD_SIZES == PCIE_IPC_WORLD_SIZES
    assert pcie_ipc_ar._ELIGIBLE_GROUP_NAMES == upstream.PCIE_IPC_GROUPS


def test_the_all_reduce_order_levers_state_is_the_installed_sglangs():
    """MSCCL++ before custom all-reduce and PCIe-IPC, and NCCL with symmetric memory before
    FlashInfer and every other communicator: what "if set" says of those switches."""
    import inspect
    import re

    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang_sm120.planning import upstream

    resolve = inspect.getsource(GroupCoordinator._resolve_outplace_all_reduce_method)
    assert tuple(re.findall(r'return "(\w+)"', resolve)) == upstream.OUTPLACE_ALLREDUCE_ORDER
    assert resolve.count("not should_use_pymscclpp_allreduce") == 2  # ahead of ca and pcie_ipc
    body = inspect.getsource(GroupCoordinator.all_reduce)
    eager = body[body.index("should_use_pymscclpp_allreduce = (") :]
    symm = eager.index("self.is_symmetric_memory_enabled()")
    assert symm < eager.index("self._can_use_flashinfer_allreduce(input_)")
    assert symm < eager.index("self._resolve_outplace_all_reduce_method(")


def test_the_nccl_variables_sglang_sets_for_its_flags_are_the_installed_sglangs():
    """--enable-nccl-nvls and --enable-symm-mem set NCCL_NVLS_ENABLE (and symm-mem
    NCCL_CUMEM_ENABLE); --pre-warm-nccl runs one all-reduce on the TP group."""
    import inspect

    from sglang.srt.distributed import bootstrap
    from sglang.srt.entrypoints import engine

    envs = inspect.getsource(engine._set_envs_and_config)
    assert 'os.environ["NCCL_NVLS_ENABLE"] = str(' in envs
    assert "int(cfg.enable_nccl_nvls or cfg.enable_symm_mem)" in envs
    assert "int(cfg.enable_symm_mem or kv_shard_symmetric_scratch)" in envs
    assert "dist.all_reduce(warmup_tensor, group=tp_group_handle)" in inspect.getsource(
        bootstrap._prewarm_nccl
    )


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
