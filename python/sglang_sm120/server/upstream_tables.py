"""The upstream tables and conditions ``planning.upstream`` copies, each compared with the sglang
that imports here, in one place: ``test/unit/test_contract.py`` runs every check against the
installed sglang, and the bump report (``server.bump_report``) against another release.

A check imports what it reads of SGLang and returns the differences, one line each naming the
copy and what upstream has now; an empty list is a copy that still holds. A check that cannot
read upstream (the module moved, the name is gone) says so as its one difference.

Example::

    for table in TABLES:
        print(table.name, table.differences() or "equal")
"""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from sglang_sm120.planning import upstream
from sglang_sm120.planning.policy import PCIE_IPC_WORLD_SIZES


@dataclass(frozen=True)
class CopiedTable:
    """One copy of upstream's: our name(s) for it, where upstream keeps it, the comparison."""

    name: str
    upstream: str
    compare: Callable[[], list[str]]

    def differences(self) -> list[str]:
        """What no longer equals upstream's; a failure to read upstream is one difference."""
        try:
            return self.compare()
        except Exception as exc:  # ImportError, AttributeError, OSError (no source) ...
            return [f"{self.name}: cannot read {self.upstream} ({type(exc).__name__}: {exc})"]


def _equal(name: str, ours: Any, theirs: Any) -> list[str]:
    return [] if ours == theirs else [f"{name}: our copy {ours!r}, upstream now {theirs!r}"]


def _set_difference(name: str, ours: Collection[str], theirs: Collection[str]) -> list[str]:
    """Two sets' differences, each side named, so a long table shows only what moved."""
    added, dropped = sorted(set(theirs) - set(ours)), sorted(set(ours) - set(theirs))
    found = [f"{name}: upstream now also has {added}"] if added else []
    return found + ([f"{name}: upstream no longer has {dropped}"] if dropped else [])


def _contains(name: str, source: str, where: str, fragments: Collection[str]) -> list[str]:
    """Upstream code that states a condition we copy (a rule, not a table): each fragment is
    the condition as upstream writes it; one that is gone means the rule may have moved."""
    return [
        f"{name}: {where} no longer says {fragment!r}"
        for fragment in fragments
        if fragment not in source
    ]


def _fusion_archs() -> list[str]:
    from sglang.srt.arg_groups.overrides import _FLASHINFER_ALLREDUCE_FUSION_ARCHS

    theirs = _FLASHINFER_ALLREDUCE_FUSION_ARCHS
    return _set_difference("FUSION_ARCHS", upstream.FUSION_ARCHS, theirs)


def upstream_flag_actions() -> Mapping[str, argparse.Action]:
    """SGLang's own server flags, as its parser builds them (argparse keeps no public map)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    return parser._option_string_actions


def _flag_choices() -> list[str]:
    actions = upstream_flag_actions()
    found = []
    for flag, choices in upstream.FLAG_CHOICES.items():
        if flag not in actions:
            found.append(f"FLAG_CHOICES: {flag} is no longer an SGLang flag")
            continue
        now = tuple(str(c) for c in actions[flag].choices or ())
        found += _equal(f"FLAG_CHOICES[{flag!r}]", choices, now)
    return found


def _custom_all_reduce() -> list[str]:
    from sglang.srt.distributed.device_communicators import custom_all_reduce_utils as utils
    from sglang.srt.distributed.device_communicators.custom_all_reduce import CustomAllreduce

    pcie = upstream.CUSTOM_ALL_REDUCE_PCIE_MAX_WORLD
    return [
        *_equal(
            "CUSTOM_ALL_REDUCE_WORLD_SIZES",
            upstream.CUSTOM_ALL_REDUCE_WORLD_SIZES,
            tuple(CustomAllreduce._SUPPORTED_WORLD_SIZES),
        ),
        *_equal(
            "CUSTOM_ALL_REDUCE_MAX_BYTES",
            upstream.CUSTOM_ALL_REDUCE_MAX_BYTES,
            CustomAllreduce._MAX_CAR_SIZE,
        ),
        *_contains(
            "CUSTOM_ALL_REDUCE_PCIE_MAX_WORLD",
            inspect.getsource(utils.can_use_custom_all_reduce_with_nvlink),
            "can_use_custom_all_reduce_with_nvlink",
            (f"world_size > {pcie} and not full_nvlink", "can_p2p(", "in_the_same_node_as("),
        ),
        *_contains(
            "CUSTOM_ALL_REDUCE_PCIE_MAX_WORLD",
            inspect.getsource(CustomAllreduce.should_custom_ar),
            "CustomAllreduce.should_custom_ar",
            (f"self.world_size == {pcie} or self.full_nvlink",),
        ),
    ]


def _mscclpp() -> list[str]:
    from sglang.srt.distributed.device_communicators import pymscclpp

    init = inspect.getsource(pymscclpp.PyMscclppCommunicator.__init__)
    imports = tuple(f'importlib.import_module("{module}")' for module in upstream.MSCCLPP_MODULES)
    return [
        *_equal(
            "MSCCLPP_WORLD_SIZES", upstream.MSCCLPP_WORLD_SIZES, pymscclpp._SUPPORTED_WORLD_SIZES
        ),
        *_contains("MSCCLPP_MODULES", init, "PyMscclppCommunicator.__init__", imports),
        *_contains(
            "MSCCLPP_WORLD_SIZES",
            init,
            "PyMscclppCommunicator.__init__",
            ("self.world_size not in _SUPPORTED_WORLD_SIZES",),
        ),
    ]


def _torch_symm_mem() -> list[str]:
    from sglang.srt.distributed.device_communicators import torch_symm_mem
    from sglang.srt.distributed.device_communicators.all_reduce_utils import (
        TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES,
    )

    return [
        *_equal(
            "TORCH_SYMM_MEM_MAX_BYTES",
            upstream.TORCH_SYMM_MEM_MAX_BYTES,
            TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES,
        ),
        *_contains(
            "TORCH_SYMM_MEM_MAX_BYTES",
            inspect.getsource(torch_symm_mem.TorchSymmMemCommunicator.__init__),
            "TorchSymmMemCommunicator.__init__",
            ("handle.multicast_ptr == 0",),  # no multicast address: disabled
        ),
    ]


def _pcie_ipc() -> list[str]:
    from sglang.srt.distributed.device_communicators import pcie_ipc_ar

    return [
        *_equal(
            "policy.PCIE_IPC_WORLD_SIZES", PCIE_IPC_WORLD_SIZES, pcie_ipc_ar._SUPPORTED_WORLD_SIZES
        ),
        *_equal("PCIE_IPC_GROUPS", upstream.PCIE_IPC_GROUPS, pcie_ipc_ar._ELIGIBLE_GROUP_NAMES),
    ]


def _allreduce_order() -> list[str]:
    """The order of the return strings of ``_resolve_outplace_all_reduce_method``; MSCCL++
    checked ahead of custom all-reduce and PCIe-IPC; NCCL with symmetric memory before
    FlashInfer's tagged all-reduce and every other communicator."""
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    resolve = inspect.getsource(GroupCoordinator._resolve_outplace_all_reduce_method)
    found = _equal(
        "OUTPLACE_ALLREDUCE_ORDER",
        upstream.OUTPLACE_ALLREDUCE_ORDER,
        tuple(re.findall(r'return "(\w+)"', resolve)),
    )
    if resolve.count("not should_use_pymscclpp_allreduce") != 2:
        found.append("OUTPLACE_ALLREDUCE_ORDER: MSCCL++ is no longer checked before ca, pcie_ipc")
    body = inspect.getsource(GroupCoordinator.all_reduce)
    marks = (
        "should_use_pymscclpp_allreduce = (",
        "self.is_symmetric_memory_enabled()",
        "self._can_use_flashinfer_allreduce(input_)",
        "self._resolve_outplace_all_reduce_method(",
    )
    missing = _contains("OUTPLACE_ALLREDUCE_ORDER", body, "GroupCoordinator.all_reduce", marks)
    if missing:
        return found + missing
    eager = body[body.index(marks[0]) :]
    symm = eager.index(marks[1])
    if not symm < eager.index(marks[2]) or not symm < eager.index(marks[3]):
        found.append(
            "OUTPLACE_ALLREDUCE_ORDER: NCCL symmetric memory is no longer checked before "
            "FlashInfer's all-reduce and the communicators"
        )
    return found


def _nccl_flags() -> list[str]:
    """What levers say --enable-nccl-nvls, --enable-symm-mem and --pre-warm-nccl do."""
    from sglang.srt.distributed import bootstrap
    from sglang.srt.entrypoints import engine

    return [
        *_contains(
            "NCCL flag effects",
            inspect.getsource(engine._set_envs_and_config),
            "engine._set_envs_and_config",
            (
                'os.environ["NCCL_NVLS_ENABLE"] = str(',
                "int(cfg.enable_nccl_nvls or cfg.enable_symm_mem)",
                "int(cfg.enable_symm_mem or kv_shard_symmetric_scratch)",
            ),
        ),
        *_contains(
            "NCCL flag effects",
            inspect.getsource(bootstrap._prewarm_nccl),
            "bootstrap._prewarm_nccl",
            ("dist.all_reduce(warmup_tensor, group=tp_group_handle)",),
        ),
    ]


TABLES = (
    CopiedTable(
        "FUSION_ARCHS",
        "srt/arg_groups/overrides.py _FLASHINFER_ALLREDUCE_FUSION_ARCHS",
        _fusion_archs,
    ),
    CopiedTable("FLAG_CHOICES", "srt/server_args.py ServerArgs.add_cli_args", _flag_choices),
    CopiedTable(
        "CUSTOM_ALL_REDUCE_*",
        "device_communicators/custom_all_reduce.py and custom_all_reduce_utils.py",
        _custom_all_reduce,
    ),
    CopiedTable("MSCCLPP_*", "device_communicators/pymscclpp.py", _mscclpp),
    CopiedTable(
        "TORCH_SYMM_MEM_MAX_BYTES",
        "device_communicators/all_reduce_utils.py and torch_symm_mem.py",
        _torch_symm_mem,
    ),
    CopiedTable("PCIE_IPC_*", "device_communicators/pcie_ipc_ar.py", _pcie_ipc),
    CopiedTable(
        "OUTPLACE_ALLREDUCE_ORDER",
        "distributed/parallel_state.py GroupCoordinator.all_reduce",
        _allreduce_order,
    ),
    CopiedTable(
        "NCCL flag effects",
        "entrypoints/engine.py and distributed/bootstrap.py",
        _nccl_flags,
    ),
)


def check_tables() -> dict[str, list[str]]:
    """Every copied table's name -> its differences from the sglang that imports here."""
    return {table.name: table.differences() for table in TABLES}
