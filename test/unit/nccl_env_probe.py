"""A second SGLang plugin, for the launch rehearsal only: it records the NCCL_* variables a TP
worker holds at the moment SGLang's ``init_distributed_environment`` is called, and stops the
worker there (nothing after it could run on a CPU box).

``install(directory)`` writes the distribution metadata that makes SGLang's ``load_plugins()``
discover this module (an ``sglang.srt.plugins`` entry point), so the launch runs it in SGLang's
own processes beside sglang-sm120, each plugin registering and SGLang applying both. In a TP
worker it fakes one piece of hardware: ``torch.cuda.set_device`` does nothing, so that
SGLang's ``init_parallel_runtime`` (which selects the device first) goes on to
``init_distributed_environment``.
The record is ``$NCCL_ENV_PROBE_DIR/worker-<pid>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PROBE_DIR_ENV = "NCCL_ENV_PROBE_DIR"
FAMILY = ("NCCL_PROTO", "NCCL_ALGO", "NCCL_MAX_NCHANNELS", "NCCL_MIN_NCHANNELS")
TARGET = "sglang.srt.distributed.bootstrap.init_distributed_environment"
STOP = "nccl_env_probe: stopped at init_distributed_environment"


def install(directory: Path) -> None:
    """Make ``directory`` (put on PYTHONPATH with this file's directory) hold this plugin."""
    meta = directory / "nccl_env_probe-0.0.dist-info"
    meta.mkdir(parents=True, exist_ok=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: nccl-env-probe\nVersion: 0.0\n")
    (meta / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nnccl_env_probe = nccl_env_probe:register\n"
    )


def record_and_stop(*args, **kwargs):
    """What a TP worker holds when SGLang is about to start NCCL: a REPLACE hook, which the
    registry puts innermost, so every other plugin's BEFORE/AROUND hook on the target (ours
    sets the tuned variables there) has run when it records."""
    path = Path(os.environ[PROBE_DIR_ENV]) / f"worker-{os.getpid()}.json"
    record = {"rank": kwargs.get("rank"), "env": {k: os.environ.get(k) for k in FAMILY}}
    path.write_text(json.dumps(record))
    raise RuntimeError(STOP)


def _in_scheduler() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "run_scheduler_process":
            return True
        frame = frame.f_back
    return False


def register() -> None:
    if not _in_scheduler():
        return
    import torch
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    torch.cuda.set_device = lambda device: None  # no GPU here: select nothing
    HookRegistry.register(TARGET, record_and_stop, HookType.REPLACE)
