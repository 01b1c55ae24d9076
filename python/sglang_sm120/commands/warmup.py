"""Build the JIT kernels the server needs before the server starts (`sglang-sm120 warmup`).

Without this, the first server start compiles them itself, in the middle of CUDA-graph capture:
FlashInfer's TRT-LLM all-reduce fusion module took ~9 minutes on 2 cores, and SGLang's EAGLE
tree/verify/sampling kernels are tvm-ffi JIT builds for the local GPU. Each step calls the
upstream loader the server itself calls, so the build lands in the same cache (FlashInfer:
~/.cache/flashinfer/<version>/<archs>/cached_ops; SGLang: ~/.cache/sglang/jit), keyed by the
visible GPUs' archs: run it with the same CUDA_VISIBLE_DEVICES and environment as the server.

    for step in run_warmup():
        print(step.name, step.status, f"{step.seconds:.1f}s")

Statuses are data the CLI prints: 'built', 'cached' (nothing new was compiled, so a second run
reports this), 'skipped: <reason>', 'failed: <reason>'. Nothing here raises. A build can take
minutes, so ``run_warmup(progress=sys.stderr)`` says when each step starts and ends, and on a
terminal shows a tqdm bar whose elapsed time keeps moving during a step.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import logging
import math
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from sglang_sm120.commands.args import UsageError, positive_int

logger = logging.getLogger(__name__)

# Vocabulary sizes of DeepSeek-V3 (129280) and Kimi-K2.5 (163840) are multiples of 4, and
# SGLang picks its sampling kernel's vector width as gcd(4, vocab_size).
DEFAULT_VOCAB_SIZE = 163840


@dataclass(frozen=True)
class WarmupTarget:
    """One upstream loader to call, and where its build output lands.

    `function` and `cache_dir` are "module:attribute" strings resolved at run time, so an
    upstream rename fails `resolve()` (and the CPU test) rather than silently doing nothing.
    `cache_dir` names either a Path or a zero-argument function returning one; `arguments`
    maps the model's vocabulary size to the loader's arguments.
    """

    name: str
    package: str
    function: str
    cache_dir: str
    arguments: Callable[[int], tuple[Any, ...]] = lambda vocab_size: ()
    supported_majors: tuple[int, ...] | None = None
    min_gpus: int = 1  # a server with fewer GPUs never loads it


@dataclass(frozen=True)
class WarmupStep:
    name: str
    target: str
    status: str
    seconds: float


# The kernels every EAGLE-3 server needs come first: the fusion module takes minutes to build
# (over 6 on the 1x H200 with 16 cores), and a warmup cut short should still have built them.
WARMUP_TARGETS = (
    WarmupTarget(
        name="SGLang EAGLE tree build + greedy verify kernels (speculative_tree)",
        package="sglang",
        function="sglang.kernels.ops.speculative.tree:_jit_tree_module",
        cache_dir="sglang.kernels.jit.utils.compile.cache:cache_root",
    ),
    WarmupTarget(
        name="SGLang EAGLE tree sampling kernel (speculative_sampling)",
        package="sglang",
        function="sglang.kernels.ops.speculative.sampling:_jit_sampling_module",
        cache_dir="sglang.kernels.jit.utils.compile.cache:cache_root",
        # EAGLE verify (srt/speculative/eagle_utils.py) calls tree_speculative_sampling_target_only
        # with deterministic=True, which builds _jit_sampling_module(gcd(4, vocab), True).
        arguments=lambda vocab_size: (math.gcd(4, vocab_size), True),
    ),
    WarmupTarget(
        name="FlashInfer TRT-LLM all-reduce fusion module (trtllm_comm)",
        package="flashinfer",
        function="flashinfer.comm.trtllm_ar:get_trtllm_comm_module",
        cache_dir="flashinfer.jit.env:FLASHINFER_JIT_DIR",
        # flashinfer/jit/comm.py gen_trtllm_comm_module: supported_major_versions=[9, 10, 12].
        supported_majors=(9, 10, 12),
        min_gpus=2,  # the fused all-reduce runs at TP >= 2 only
    ),
)


def resolve(reference: str) -> Any:
    """Import "package.module:attribute" and return the attribute."""
    module_name, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def _cache_directory(target: WarmupTarget) -> Path:
    location = resolve(target.cache_dir)
    return Path(location() if callable(location) else location)


def _built_libraries(directory: Path) -> dict[Path, int]:
    """Shared objects under a JIT cache and their mtimes: a change means something was built."""
    if not directory.is_dir():
        return {}
    return {path: path.stat().st_mtime_ns for path in directory.rglob("*.so")}


def visible_capability() -> tuple[int, int] | None:
    """Capability of the first GPU torch sees, or None without a usable GPU."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return tuple(torch.cuda.get_device_capability(0))
    except Exception as error:  # a broken driver must read as "no GPU", not crash the CLI
        logger.debug("no usable CUDA GPU: %s", error)
        return None


def visible_gpu_count() -> int:
    """How many GPUs torch sees (0 without a usable GPU)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    return f"{type(error).__name__}: {text[:300]}"


def _skip_reason(
    target: WarmupTarget,
    capability: tuple[int, int] | None,
    has_gpu: bool | None,
    gpu_count: int | None,
) -> str | None:
    if importlib.util.find_spec(target.package) is None:
        return f"{target.package} is not installed"
    if gpu_count is not None and 0 < gpu_count < target.min_gpus:
        plural = "s" if gpu_count > 1 else ""
        return (
            f"{gpu_count} GPU{plural} visible: no all-reduce to fuse "
            f"(a server builds it at TP >= {target.min_gpus})"
        )
    if capability is not None and target.supported_majors is not None:
        if capability[0] not in target.supported_majors:
            majors = "/".join(f"SM{major}x" for major in target.supported_majors)
            return (
                f"upstream builds it only for {majors}; this GPU is {capability[0]}.{capability[1]}"
            )
    if has_gpu is False:
        return "no CUDA GPU visible to torch (JIT builds target the local GPU)"
    return None


def run_step(target: WarmupTarget, vocab_size: int = DEFAULT_VOCAB_SIZE) -> WarmupStep:
    """Call one loader now (no GPU or package checks) and say whether it compiled anything."""
    start = time.perf_counter()
    try:
        loader: Callable[..., Any] = resolve(target.function)
        cache = _cache_directory(target)
        before = _built_libraries(cache)
        loader(*target.arguments(vocab_size))
        after = _built_libraries(cache)
    except Exception as error:
        logger.warning("warmup step %r failed", target.name, exc_info=True)
        status = f"failed: {_one_line(error)}"
    else:
        status = "built" if after != before else "cached"
    return WarmupStep(target.name, target.function, status, time.perf_counter() - start)


@contextlib.contextmanager
def _live_bar(total: int, stream: TextIO) -> Iterator[Any]:
    """A tqdm bar (terminal only) refreshed every second, since one build blocks for minutes."""
    from tqdm import tqdm

    bar = tqdm(
        total=total,
        file=stream,
        disable=None,
        bar_format="{desc} {n}/{total} steps [{elapsed}]",
        leave=False,
    )
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(1.0):
            bar.refresh()

    ticker = threading.Thread(target=tick, name="warmup-progress", daemon=True)
    ticker.start()
    try:
        yield bar
    finally:
        stop.set()
        ticker.join()
        bar.close()


def run_warmup(
    capability: tuple[int, int] | None = None,
    *,
    gpu_count: int | None = None,
    dry_run: bool = False,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    progress: TextIO | None = None,
) -> list[WarmupStep]:
    """Build (or find cached) every JIT module in WARMUP_TARGETS; safe to run repeatedly.

    `capability` is the GPU's (major, minor) and `gpu_count` how many GPUs the server gets, when
    the caller already knows them (from facts); otherwise torch is asked. A dry run lists the
    steps and what would stop them, and neither imports the upstream packages nor needs a GPU.
    `progress`: a stream for a line when each step starts and ends (with its time), plus a live
    bar when it is a terminal.
    """
    has_gpu: bool | None = None
    if not dry_run:
        visible = visible_capability()
        has_gpu = visible is not None
        capability = capability or visible
        gpu_count = gpu_count if gpu_count is not None else visible_gpu_count()
    steps = []
    total = len(WARMUP_TARGETS)
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(_live_bar(total, progress)) if progress else None
        for number, target in enumerate(WARMUP_TARGETS, 1):
            reason = _skip_reason(target, capability, has_gpu, gpu_count)
            if reason is not None:
                step = WarmupStep(target.name, target.function, f"skipped: {reason}", 0.0)
            elif dry_run:
                step = WarmupStep(target.name, target.function, "skipped: dry run", 0.0)
            else:
                if bar is not None:
                    bar.set_description_str(f"building {target.name}")
                    bar.write(f"[{number}/{total}] {target.name}: building...", file=progress)
                step = run_step(target, vocab_size)
            if bar is not None:
                bar.write(
                    f"[{number}/{total}] {target.name}: {step.status} ({step.seconds:.1f} s)",
                    file=progress,
                )
                bar.update()
            steps.append(step)
    return steps


def summary(steps: list[WarmupStep]) -> str:
    """'2 built, 1 cached' (status words, in step order)."""
    counts = Counter(step.status.split(":")[0] for step in steps)
    return ", ".join(f"{count} {status}" for status, count in counts.items())


def format_steps(steps: list[WarmupStep]) -> str:
    """A table a person reads: one line per step, then the total time and the counts."""
    width = max((len(step.name) for step in steps), default=0)
    lines = [f"{step.name:<{width}}  {step.seconds:7.1f}s  {step.status}" for step in steps]
    total = sum(step.seconds for step in steps)
    lines.append(f"{'total':<{width}}  {total:7.1f}s  {summary(steps)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if not args.dry_run and visible_capability() is None:
        raise UsageError(
            "no CUDA GPU visible to torch: the JIT builds target the local GPU, so run this on "
            "the server's machine with its CUDA_VISIBLE_DEVICES (--dry-run lists the steps)"
        )
    steps = run_warmup(dry_run=args.dry_run, vocab_size=args.vocab_size, progress=sys.stderr)
    print(format_steps(steps))
    return 1 if any(step.status.startswith("failed") for step in steps) else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("warmup", help="compile the server's JIT kernels for this GPU ahead")
    parser.add_argument("--dry-run", action="store_true", help="list the steps, build nothing")
    parser.add_argument(
        "--vocab-size", type=positive_int, default=163840, help="the model's vocabulary size"
    )
    parser.set_defaults(func=run)
