"""The inputs of the "all-reduce options" and NCCL-settings sections ``doctor`` and ``plan``
print (the rows themselves: ``planning.levers``, ``planning.nccl_settings``): the deployment as
``plan.plan_for_args`` plans it, and whether ``mscclpp`` imports here."""

from __future__ import annotations

import argparse
import dataclasses
import importlib

from sglang_sm120.commands.args import deployment_from_args
from sglang_sm120.machine.host_checks import HostFindings
from sglang_sm120.planning.policy import Deployment
from sglang_sm120.planning.upstream import MSCCLPP_MODULES


def deployment_for(
    args: argparse.Namespace,
    tp_size: int,
    local_tuning: bool = False,
    host: HostFindings | None = None,
) -> Deployment:
    """The deployment ``plan_for_args`` plans, so a switch flipped here is judged against the
    same tuning table and host findings."""
    from sglang_sm120.server.runtime import with_tuning

    deployment = dataclasses.replace(deployment_from_args(args, tp_size), host=host)
    return with_tuning(deployment, args.hidden, args.dtype) if local_tuning else deployment


def mscclpp_imports() -> bool:
    """Whether the modules upstream's PyMscclppCommunicator imports import here."""
    try:
        for name in MSCCLPP_MODULES:
            importlib.import_module(name)
    except Exception:  # ImportError, or a broken build raising anything on import
        return False
    return True
