"""``sglang-sm120 tune``: measure every all-reduce backend this host has, check each against a
float32 reference first, and write the tuning table the policy reads.

For each token count a decode/verify step can have and the model's hidden size, per backend
(one all-reduce + residual add + RMSNorm point of a layer, CUDA-graph timed):

    nccl         NCCL all-reduce + a separate add+RMSNorm kernel
    pcie_ipc     FlashInfer PCIe-IPC all-reduce + the same add+RMSNorm kernel, after
                 FlashInfer's own PcieIpcAllReduceWorkspace.tune([hidden]) at these token
                 counts (its default samples: ~33 s per token count on a 2x H200 box, where it
                 kept its seed; the note in the table says what it changed)
    trtllm       FlashInfer allreduce_fusion (kARResidualRMSNorm, trtllm backend)
    sm120_pcie   sgl-kernel-sm120's fused kernel
    sm120_pcie_unfused  sgl-kernel-sm120's all-reduce + the same add+RMSNorm kernel (the plan
                 routes a size here when this beats the fused kernel)
    custom_ar, mscclpp, torch_symm_mem  upstream's own communicators (custom all-reduce,
                 PyMscclppCommunicator, TorchSymmMemCommunicator), built as SGLang's
                 GroupCoordinator builds them, + the same add+RMSNorm kernel; measured where
                 doctor's "all-reduce options" say they can run (``upstream_refusals``), each
                 size they decline written as declined (``tuning.DECLINES``)

Then NCCL variants (``planning.tuning.NCCL_VARIANTS``: NCCL_PROTO LL / Simple, NCCL_ALGO Ring /
Tree, each for the all-reduce only (``allreduce:LL``, as a worker sets it), beside NCCL's
defaults; never LL128, which NCCL warns may corrupt data where it did not enable it): NCCL reads
these once per process, so each variant is measured in freshly spawned rank processes, nccl
only, at the token counts and one chunked-prefill size (``PREFILL_TOKENS``), timed and checked
like every backend; a variant failing capture or the check keeps its reason in the table. The
estimate of their time is printed before anything is measured. They are measured as a worker
would apply them: the user's NCCL tuning variables (``USER_NCCL_TUNING``) are cleared in the
ranks and the table's notes name them; one set in NCCL's config files (which the ranks would
read, and the environment cannot clear) or a config file that cannot be read leaves every
variant unmeasured, with that reason.

Ranks are one process per GPU when there are enough GPUs. Otherwise they share one GPU as
streams of one process: only sm120_pcie can run there (NCCL refuses two ranks on one GPU), the
numbers are kernel overhead rather than interconnect, and the table is marked so (the policy
does not use such a table). Progress over backends x token counts is a tqdm bar on stderr (rank 0
draws it). The timing core (``time_local``, ``per_call_us``,
``make_add_rmsnorm``) is also what ``benchmark/bench_allreduce.py`` uses.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_sm120.commands.args import positive_int
from sglang_sm120.env_values import shown
from sglang_sm120.machine.cache import cache_write_problem, host_fingerprint
from sglang_sm120.machine.facts import current_facts
from sglang_sm120.machine.nccl_conf import nccl_settings
from sglang_sm120.planning.nccl_settings import USER_NCCL_TUNING
from sglang_sm120.planning.tuning import (
    BACKENDS,
    DECLINES,
    NCCL_VARIANTS,
    PREFILL_TOKENS,
    UPSTREAM_BACKENDS,
    Measurement,
    NcclEnv,
    TuningTable,
    VariantMeasurement,
    save_table,
    scoped_env,
    variant_name,
)

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
EPS = 1e-6
# One NCCL variant's cost, for the estimate printed first: spawning the rank processes (torch
# import, NCCL communicator, the add+RMSNorm kernel's compile), then per token count the check,
# the capture and the replays (2x H200: ~25 s and well under 1 s).
VARIANT_SPAWN_S = 30.0
# The backends' spawn: FlashInfer's PCIe-IPC tuner alone takes ~33 s per token count.
BACKENDS_DEADLINE_S = 1800.0
VARIANT_CELL_S = 1.0


@dataclass(frozen=True)
class TuneSettings:
    tp: int
    hidden: int = 7168
    dtype: str = "bfloat16"
    tokens: tuple[int, ...] = TOKENS
    calls: int = 20
    replays: int = 10
    seed: int = 1234


# ----------------------------------------------------------------------------- timing core


def make_add_rmsnorm(hidden: int, dtype: Any) -> tuple[Callable, str]:
    """(fn(x, residual, weight) -> (norm, residual_out), description): one Triton kernel, or
    torch eager where Triton cannot compile. Compiled here, before ranks start waiting on
    each other, so that no JIT happens between two ranks' launches. On SM90 and later it is
    launched with programmatic dependent launch, as SGLang launches its add+RMSNorm there
    (sgl_kernel's enable_pdl default) and as sgl-kernel-sm120 launches its kernels."""
    import torch

    try:
        import triton
        import triton.language as tl

        @triton.jit
        def _add_rmsnorm(
            x_ptr,
            r_ptr,
            w_ptr,
            out_ptr,
            r_out_ptr,
            hidden,
            eps,
            BLOCK: tl.constexpr,
            PDL: tl.constexpr,
        ):
            if PDL:
                tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
            row = tl.program_id(0)
            offs = tl.arange(0, BLOCK)
            mask = offs < hidden
            base = row * hidden
            s = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
            s += tl.load(r_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
            if PDL:
                tl.extra.cuda.gdc_launch_dependents()
            tl.store(r_out_ptr + base + offs, s.to(r_out_ptr.dtype.element_ty), mask=mask)
            scale = tl.rsqrt(tl.sum(s * s, axis=0) / hidden + eps)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + base + offs, (s * scale * w).to(out_ptr.dtype.element_ty), mask=mask)

        block = triton.next_power_of_2(hidden)

        def launcher(pdl: bool) -> Callable:
            def add_rmsnorm(x, residual, weight):
                out, res_out = torch.empty_like(x), torch.empty_like(residual)
                _add_rmsnorm[(x.shape[0],)](
                    *(x, residual, weight, out, res_out, x.shape[1], EPS),
                    BLOCK=block,
                    PDL=pdl,
                    num_warps=8,
                    launch_pdl=pdl,
                )
                return out, res_out

            probe = torch.ones(1, hidden, dtype=dtype, device="cuda")
            add_rmsnorm(probe, probe, probe[0])
            torch.cuda.synchronize()
            return add_rmsnorm

        if torch.cuda.get_device_capability()[0] >= 9:
            try:
                return launcher(True), "Triton add+RMSNorm kernel (PDL)"
            except Exception:  # a Triton without launch_pdl: the same kernel, launched plainly
                pass
        return launcher(False), "Triton add+RMSNorm kernel"
    except Exception as exc:

        def add_rmsnorm_eager(x, residual, weight):
            s = x.float() + residual.float()
            scale = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)
            return (s * scale * weight.float()).to(x.dtype), s.to(x.dtype)

        return add_rmsnorm_eager, f"torch eager add+RMSNorm (Triton unavailable: {exc})"


def per_call_us(elapsed_ms_per_rank: Sequence[Sequence[float]], calls: int) -> float:
    """Median over replays of the per-call time of the rank that started last: the op makes
    every rank wait for the last one, so the shortest rank time is the one without launch skew."""
    per_replay = [min(times) for times in zip(*elapsed_ms_per_rank, strict=True)]
    return statistics.median(per_replay) * 1000.0 / calls


def time_local(ranks: Any, body: Callable[[int, Any], None], calls: int, replays: int) -> float:
    """``calls`` repetitions of body(rank, ws) captured in one graph per rank (ranks as streams
    of this process, ``sgl_kernel_sm120.testing.LocalRanks``); microseconds per call."""
    import torch

    ranks.run(lambda r, ws: [body(r, ws) for _ in range(2)])
    torch.cuda.synchronize()
    graphs = []
    for rank, ws in enumerate(ranks.workspaces):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=ranks.streams[rank]):
            for _ in range(calls):
                body(rank, ws)
        graphs.append(graph)
    starts = [torch.cuda.Event(enable_timing=True) for _ in graphs]
    ends = [torch.cuda.Event(enable_timing=True) for _ in graphs]
    elapsed: list[list[float]] = [[] for _ in graphs]
    for _ in range(replays + 1):
        ranks.run(lambda r, ws: (starts[r].record(), graphs[r].replay(), ends[r].record()))
        torch.cuda.synchronize()
        for r in range(len(graphs)):
            elapsed[r].append(starts[r].elapsed_time(ends[r]))
    ranks.check_errors()
    return per_call_us([e[1:] for e in elapsed], calls)  # the first replay warms up


# ------------------------------------------------------------------------------ correctness


def rank_inputs(seed: int, rank: int, tokens: int, hidden: int, dtype: Any):
    """Rank ``rank``'s input; every rank can rebuild every other rank's for the reference."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed * 1_000_003 + rank * 7919 + tokens)
    return torch.randn(tokens, hidden, generator=g, device="cuda").to(dtype)


def shared_operands(seed: int, tokens: int, hidden: int, dtype: Any):
    """(residual, weight), the same on every rank, as in a real layer."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed + 17 * tokens)
    residual = torch.randn(tokens, hidden, generator=g, device="cuda").to(dtype)
    weight = (1.0 + 0.1 * torch.randn(hidden, generator=g, device="cuda")).to(dtype)
    return residual, weight


def close_to_reference(
    result: tuple[Any, Any], inputs: Sequence[Any], residual: Any, weight: Any
) -> tuple[bool, str]:
    """Whether (norm_out, residual_out) matches the float32 reference within 16-bit tolerance."""
    from sgl_kernel_sm120.testing import TOLERANCES, max_violation, reference_fused

    want_norm, want_residual = reference_fused(inputs, residual, weight, EPS)
    rtol, atol = TOLERANCES[residual.dtype]
    worst = max(
        float(max_violation(result[0], want_norm, rtol)),
        float(max_violation(result[1], want_residual, rtol)),
    )
    return worst <= atol, f"max error over tolerance {worst:.3g} (atol {atol})"


def progress_bar(total: int, what: str, show: bool = True) -> Any:
    """tqdm over (backend, token count) cells on stderr; drawn on a terminal only."""
    from tqdm import tqdm

    return tqdm(
        total=total, desc=what, unit="cell", file=sys.stderr, disable=None if show else True
    )


# ------------------------------------------------------------------ ranks sharing one GPU


def variants_not_measured(settings: TuneSettings) -> list[VariantMeasurement]:
    """Every NCCL variant at every size, said plainly not measured (ranks share one GPU)."""
    why = f"n/a: needs {settings.tp} GPUs, one per rank (ranks share one here)"
    return [
        VariantMeasurement(env, t, None, False, why)
        for env in NCCL_VARIANTS
        for t in variant_tokens(settings)
    ]


def _tune_local(settings: TuneSettings) -> tuple[list[Measurement], list[str]]:
    import sgl_kernel_sm120 as sk
    import torch
    from sgl_kernel_sm120.testing import LocalRanks

    dtype = getattr(torch, settings.dtype)
    tp, hidden = settings.tp, settings.hidden
    notes = [f"{tp} ranks share one GPU as streams: numbers are kernel overhead, not interconnect"]
    measurements = [
        Measurement(b, t, None, False, f"n/a: needs {tp} GPUs (ranks share one here)")
        for t in settings.tokens
        for b in ("nccl", "pcie_ipc", "trtllm", *UPSTREAM_BACKENDS)
    ]
    ranks = LocalRanks(sk.CommWorkspace.create_local(tp, max(settings.tokens), hidden, dtype))
    bar = progress_bar(len(settings.tokens), f"tune tp={tp} sm120_pcie")
    try:
        for tokens in settings.tokens:
            bar.set_postfix_str(f"{tokens} tokens")
            xs = [rank_inputs(settings.seed, r, tokens, hidden, dtype) for r in range(tp)]
            residual, weight = shared_operands(settings.seed, tokens, hidden, dtype)

            def fused(r, ws, xs=xs, residual=residual, weight=weight):
                return sk.fused_allreduce_add_rmsnorm(xs[r], residual, weight, EPS, ws)

            results = ranks.run(fused)
            torch.cuda.synchronize()
            ranks.check_errors()
            checks = [close_to_reference(res, xs, residual, weight) for res in results]
            correct = all(ok for ok, _ in checks)
            us = time_local(ranks, fused, settings.calls, settings.replays)
            note = "" if correct else next(why for ok, why in checks if not ok)
            measurements.append(Measurement("sm120_pcie", tokens, us, correct, note))
            bar.update()
    finally:
        bar.close()
        ranks.close()
    return measurements, notes


# ---------------------------------------------------------------- one process per GPU


def flashinfer_trtllm_fused(
    rank: int, world_size: int, max_tokens: int, hidden: int, dtype: Any
) -> Callable:
    """FlashInfer's fused all-reduce + residual + RMSNorm (trtllm backend) as
    fn(x, residual, weight) -> (norm_out, residual_out); raises where it cannot be set up."""
    import flashinfer.comm as fic
    import torch

    fws = fic.create_allreduce_fusion_workspace(
        backend="trtllm",
        world_size=world_size,
        rank=rank,
        max_token_num=max_tokens,
        hidden_dim=hidden,
        dtype=dtype,
    )

    def trtllm(x, residual, weight):
        norm_out, res_out = torch.empty_like(x), torch.empty_like(residual)
        fic.allreduce_fusion(
            input=x,
            workspace=fws,
            pattern=fic.AllReduceFusionPattern.kARResidualRMSNorm,
            launch_with_pdl=True,  # as SGLang 0.5.23 calls it (flashinfer_comm_fusion.py)
            residual_out=res_out,
            norm_out=norm_out,
            residual_in=residual,
            rms_gamma=weight,
            rms_eps=EPS,
            fp32_acc=True,
        )
        return norm_out, res_out

    return trtllm


def flashinfer_pcie_ipc(
    gloo: Any,
    tokens: Sequence[int],
    hidden: int,
    dtype: Any,
    *,
    repeat: int | None = None,
) -> tuple[Any, str]:
    """FlashInfer's PCIe-IPC workspace, tuned with its own ``tune([hidden])`` at the token
    counts that will be timed, before anything is timed (its seed launch configurations come
    from one PCIe host; the tuner measures this one). ``repeat``: timed iterations per
    candidate (FlashInfer's default when None; fewer are faster, and FlashInfer then keeps the
    result in this process only). Collective over ``gloo``. Returns (workspace, a note)."""
    import flashinfer.comm as fic
    import torch

    pws = fic.PcieIpcAllReduceWorkspace(
        group=gloo, max_numel=max(tokens) * hidden, tune_batches=tuple(sorted(set(tokens)))
    )
    counts = {} if repeat is None else {"warmup": 2, "repeat": repeat}
    try:
        tuned = pws.tune([hidden], dtype=dtype, **counts)
    except Exception as exc:  # an untuned baseline is still a baseline: say so
        return pws, f"FlashInfer PCIe-IPC tune([{hidden}]) failed, seed configurations used: {exc}"
    changed = sum(
        1
        for (h, batch), config in tuned.items()
        if config is not None
        and config != pws.launch_config(torch.empty(batch, h, dtype=dtype, device=pws.device))
    )
    samples = "FlashInfer's default samples" if repeat is None else f"repeat={repeat}"
    return pws, (
        f"FlashInfer PCIe-IPC tune([{hidden}]) ({samples}): {len(tuned)} shapes measured, "
        f"{changed} configurations differ from its seed (0: the seed is its best on this host)"
    )


# --------------------------------------------------- upstream's own all-reduce communicators

# Each upstream backend and the switch doctor's "all-reduce options" judge it by.
UPSTREAM_SWITCHES = {
    "custom_ar": "--disable-custom-all-reduce",
    "mscclpp": "--enable-mscclpp",
    "torch_symm_mem": "--enable-torch-symm-mem",
}


class Declines(Exception):
    """An upstream communicator's own check refuses this size: SGLang hands such an
    all-reduce to its next communicator, so the cell says so (``tuning.DECLINES``)."""


def upstream_refusals(tp: int) -> dict[str, str]:
    """backend -> why it is not measured here: what doctor's "all-reduce options" say of its
    switch (``planning.levers``), so tune measures each where upstream would build it and
    gives the same reason where it would not."""
    from sglang_sm120.commands.allreduce_options import mscclpp_imports
    from sglang_sm120.planning.levers import MSCCLPP_MISSING, allreduce_levers
    from sglang_sm120.planning.policy import Deployment, plan_allreduce
    from sglang_sm120.planning.upstream import FUSION_ARCHS

    facts = current_facts()
    d = Deployment(tp_size=tp)
    plan = plan_allreduce(facts, d, FUSION_ARCHS)
    levers = allreduce_levers(facts, d, plan, FUSION_ARCHS, mscclpp_imports())
    by_switch = {lever.switch: lever for lever in levers}
    refused = {}
    for backend, switch in UPSTREAM_SWITCHES.items():
        lever = by_switch[switch]
        if lever.can_run is False:
            missing = backend == "mscclpp" and lever.why == MSCCLPP_MISSING
            prefix = "not installed" if missing else "not available"
            refused[backend] = (
                lever.why if lever.why.startswith(prefix) else f"{prefix}: {lever.why}"
            )
    return refused


def _custom_ar(gloo: Any, device: Any, add_rmsnorm: Callable) -> Callable:
    """Upstream's custom all-reduce as parallel_state.GroupCoordinator builds it (the class
    ``dispatch_custom_allreduce`` picks, on the gloo group); ``capture`` registers the graph's
    buffers as SGLang's graph capture does."""
    from sglang.srt.distributed.device_communicators.custom_all_reduce import (
        dispatch_custom_allreduce,
    )

    cls = dispatch_custom_allreduce(group=gloo, device=device)
    comm = cls(group=gloo, device=device)
    if getattr(comm, "disabled", False):
        raise RuntimeError(f"upstream's {cls.__name__} disabled itself here (its warning says why)")

    def custom_ar(x, residual, weight):
        if not comm.should_custom_ar(x):
            limit = getattr(comm, "max_size", None)
            raise Declines(f"{x.numel() * x.element_size()} bytes (its limit: {limit} bytes)")
        return add_rmsnorm(comm.custom_all_reduce(x), residual, weight)

    custom_ar.capture = comm.capture  # type: ignore[attr-defined]
    return custom_ar


def _mscclpp(gloo: Any, device: Any, add_rmsnorm: Callable) -> Callable:
    """Upstream's PyMscclppCommunicator as GroupCoordinator builds it, enabled as SGLang
    enables it for graph capture (``change_state``), held so for this process."""
    from sglang.srt.distributed.device_communicators.pymscclpp import PyMscclppCommunicator

    comm = PyMscclppCommunicator(group=gloo, device=device, group_name="tp")
    if not comm.available:
        raise RuntimeError("upstream's MSCCL++ communicator produced no tuned configuration here")
    state = comm.change_state(enable=True)
    state.__enter__()

    def mscclpp(x, residual, weight):
        if not comm.should_mscclpp_allreduce(x):
            raise Declines(f"no tuned MSCCL++ configuration for {x.numel() * x.element_size()} B")
        return add_rmsnorm(comm.all_reduce(x.clone()), residual, weight)

    mscclpp.state = state  # type: ignore[attr-defined]  # the enabled state lives as long as fn
    return mscclpp


def _torch_symm_mem(gloo: Any, device: Any, add_rmsnorm: Callable) -> Callable:
    """Upstream's TorchSymmMemCommunicator as GroupCoordinator builds it."""
    from sglang.srt.distributed.device_communicators.torch_symm_mem import (
        TorchSymmMemCommunicator,
    )

    comm = TorchSymmMemCommunicator(group=gloo, device=device)
    if comm.disabled:
        raise RuntimeError(
            "upstream's TorchSymmMemCommunicator disabled itself here (no multicast address, "
            "or a capability or world size not in its size table; its warning says which)"
        )

    def torch_symm_mem(x, residual, weight):
        if not comm.should_torch_symm_mem_allreduce(x):
            raise Declines(f"{x.numel() * x.element_size()} bytes (bf16 below {comm.max_size})")
        return add_rmsnorm(comm.all_reduce(x), residual, weight)

    return torch_symm_mem


def upstream_backends(
    gloo: Any, device: Any, add_rmsnorm: Callable, skipped: dict[str, str]
) -> dict[str, Callable]:
    """Upstream's custom all-reduce, MSCCL++ and torch symmetric memory, each + add_rmsnorm,
    where they can run here; ``skipped`` gets the reason for each that cannot. Collective
    over ``gloo``: every rank reaches the same refusals from the same facts."""
    import torch.distributed as dist

    refused = upstream_refusals(dist.get_world_size(gloo))
    skipped.update(refused)
    builders = {"custom_ar": _custom_ar, "mscclpp": _mscclpp, "torch_symm_mem": _torch_symm_mem}
    backends: dict[str, Callable] = {}
    for name, build in builders.items():
        if name in refused:
            continue
        try:
            backends[name] = build(gloo, device, add_rmsnorm)
        except Exception as exc:  # one backend that cannot start must not hide the others
            skipped[name] = f"unavailable: {type(exc).__name__}: {exc}"[:300]
    return backends


def _rank_backends(
    rank: int,
    settings: TuneSettings,
    gloo: Any,
    add_rmsnorm: Callable,
    skipped: dict[str, str],
    notes: list[str],
    nccl_only: bool = False,
) -> dict[str, Callable]:
    """name -> fn(x, residual, weight) -> (norm_out, residual_out), for what this host has
    (``nccl_only``: NCCL alone, for an NCCL variant's processes)."""
    import torch
    import torch.distributed as dist

    dtype = getattr(torch, settings.dtype)
    max_tokens, hidden = max(settings.tokens), settings.hidden

    def nccl(x, residual, weight):
        y = x.clone()
        dist.all_reduce(y)
        return add_rmsnorm(y, residual, weight)

    backends: dict[str, Callable] = {"nccl": nccl}
    if nccl_only:
        return backends
    try:
        import sgl_kernel_sm120 as sk

        ws = sk.CommWorkspace.create(gloo, max_tokens, hidden, dtype)
        backends["sm120_pcie"] = lambda x, r, w: sk.fused_allreduce_add_rmsnorm(x, r, w, EPS, ws)
        backends["sm120_pcie_unfused"] = lambda x, r, w: add_rmsnorm(sk.all_reduce(x, ws), r, w)
    except Exception as exc:
        why = f"unavailable: {type(exc).__name__}: {exc}"[:300]
        skipped["sm120_pcie"] = skipped["sm120_pcie_unfused"] = why
    backends.update(upstream_backends(gloo, torch.device("cuda", rank), add_rmsnorm, skipped))
    try:
        import flashinfer.comm  # noqa: F401
    except Exception as exc:
        skipped["trtllm"] = skipped["pcie_ipc"] = f"flashinfer not importable: {exc}"[:300]
        return backends
    try:
        backends["trtllm"] = flashinfer_trtllm_fused(rank, settings.tp, max_tokens, hidden, dtype)
    except Exception as exc:
        skipped["trtllm"] = f"unavailable: {type(exc).__name__}: {exc}"[:300]
    if dtype == torch.bfloat16:
        try:
            pws, note = flashinfer_pcie_ipc(gloo, settings.tokens, hidden, dtype)
            notes.append(note)
            backends["pcie_ipc"] = lambda x, r, w: add_rmsnorm(pws.all_reduce(x), r, w)
        except Exception as exc:
            skipped["pcie_ipc"] = f"unavailable: {type(exc).__name__}: {exc}"[:300]
    else:
        skipped["pcie_ipc"] = "PCIe-IPC serves bf16 only"
    return backends


def _rank_main(
    rank: int, settings: TuneSettings, init_file: str, result_file: str, nccl_only: bool = False
) -> None:
    import json

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{init_file}", rank=rank, world_size=settings.tp
    )
    gloo = dist.new_group(backend="gloo")
    dtype = getattr(torch, settings.dtype)
    add_rmsnorm, _ = make_add_rmsnorm(settings.hidden, dtype)
    skipped: dict[str, str] = {}
    notes: list[str] = []
    backends = _rank_backends(rank, settings, gloo, add_rmsnorm, skipped, notes, nccl_only)
    stream = torch.cuda.Stream()
    rows = []
    bar = progress_bar(
        len(settings.tokens) * len(backends),
        f"tune tp={settings.tp} {'/'.join(backends)}",
        show=rank == 0,
    )
    for tokens in settings.tokens:
        xs = [
            rank_inputs(settings.seed, r, tokens, settings.hidden, dtype)
            for r in range(settings.tp)
        ]
        residual, weight = shared_operands(settings.seed, tokens, settings.hidden, dtype)
        for name, fn in backends.items():
            bar.set_postfix_str(f"{name} {tokens} tokens")
            try:
                ok, why = close_to_reference(fn(xs[rank], residual, weight), xs, residual, weight)
                everyone = [None] * settings.tp
                dist.all_gather_object(everyone, (ok, why), group=gloo)
                correct = all(o for o, _ in everyone)

                def call(fn=fn, x=xs[rank], residual=residual, weight=weight):
                    return fn(x, residual, weight)

                capture = getattr(fn, "capture", None)
                us = time_graph(call, stream, settings.calls, settings.replays, gloo, capture)
                rows.append((name, tokens, us, correct, "" if correct else why))
            except Declines as exc:  # every rank declines the same size
                rows.append((name, tokens, None, False, f"{DECLINES}{exc}"[:300]))
            except Exception as exc:  # a backend failing must not hide the others
                rows.append(
                    (name, tokens, None, False, f"failed: {type(exc).__name__}: {exc}"[:300])
                )
            bar.update()
    bar.close()
    if rank == 0:
        Path(result_file).write_text(json.dumps({"rows": rows, "skipped": skipped, "notes": notes}))
    dist.destroy_process_group()


def time_graph(
    body: Callable[[], Any],
    stream: Any,
    calls: int,
    replays: int,
    gloo: Any,
    capture: Callable[[], Any] | None = None,
) -> float:
    """``calls`` repetitions of body() captured in one graph, replayed in step with the other
    ranks of ``gloo`` (one process per GPU); microseconds per call. ``capture``: a context the
    backend needs around graph capture (upstream's custom all-reduce registers the graph's
    buffers on leaving it, as SGLang's ``GroupCoordinator.graph_capture`` does)."""
    from contextlib import nullcontext

    import torch
    import torch.distributed as dist

    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with (capture or nullcontext)(), torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            body()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    mine = []
    for _ in range(replays + 1):
        dist.barrier(group=gloo)
        with torch.cuda.stream(stream):
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        mine.append(start.elapsed_time(end))
    everyone: list[Any] = [None] * dist.get_world_size(gloo)
    dist.all_gather_object(everyone, mine[1:], group=gloo)
    return per_call_us(everyone, calls)


def run_ranks(settings: TuneSettings, deadline_s: float, nccl_only: bool = False) -> dict:
    """One process per GPU running ``_rank_main``; rank 0's result document."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        args = (settings, str(Path(tmp) / "init"), str(result), nccl_only)
        spawn_ranks(_rank_main, args, settings.tp, deadline_s)
        return json.loads(result.read_text())


def _tune_multiprocess(settings: TuneSettings) -> tuple[list[Measurement], list[str]]:
    data = run_ranks(settings, BACKENDS_DEADLINE_S)
    measurements = [Measurement(*row) for row in data["rows"]]
    notes = [f"{name}: {why}" for name, why in sorted(data["skipped"].items())]
    return measurements, notes + data.get("notes", [])


# ------------------------------------------------------------------------------ NCCL variants


def variant_tokens(settings: TuneSettings) -> tuple[int, ...]:
    """The token counts a variant is timed at: tune's, and one chunked-prefill size."""
    return tuple(sorted({*settings.tokens, PREFILL_TOKENS}))


def variant_estimate_s(settings: TuneSettings) -> float:
    """Seconds one NCCL variant takes, about: a spawn of the TP group and its cells."""
    return VARIANT_SPAWN_S + len(variant_tokens(settings)) * VARIANT_CELL_S


def variants_estimate_s(settings: TuneSettings) -> float:
    """Seconds the NCCL variants take, about: one spawn of the TP group each."""
    return len(NCCL_VARIANTS) * variant_estimate_s(settings)


def estimate_line(settings: TuneSettings) -> str:
    names = ", ".join(variant_name(env) for env in NCCL_VARIANTS)
    minutes = variants_estimate_s(settings) / 60
    return (
        f"tune: after the backends, {len(NCCL_VARIANTS)} NCCL variants ({names}), each in "
        f"{settings.tp} fresh processes over {len(variant_tokens(settings))} token counts: "
        f"about {minutes:.1f} min"
    )


def variant_conditions(environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(a table note naming the user's NCCL tuning variables that ``variant_environment``
    clears in the ranks, or None; why no variant can be timed as a worker would run it, or
    None). A worker sets no variant while any of USER_NCCL_TUNING is set, so a variant is only
    worth timing without them; one set in NCCL's config files stays in every rank, the default's
    too, as does anything an unreadable config file sets: then nothing is timed."""
    cleared = [f"{k}={shown(environ[k])}" for k in USER_NCCL_TUNING if k in environ]
    note = (
        f"NCCL variants timed without the user's {', '.join(cleared)} (cleared in their ranks; "
        "a TP worker sets no variant while any is set)"
        if cleared
        else None
    )
    files = nccl_settings({k: v for k, v in environ.items() if k not in USER_NCCL_TUNING})
    if files.unreadable:
        return note, f"{files.unreadable}: it may set NCCL's tuning in every variant's ranks"
    in_files = [
        f"{k}={shown(files[k])} in {files.source(k)}" for k in USER_NCCL_TUNING if k in files
    ]
    if in_files:
        return note, (
            f"{', '.join(in_files)} would apply to every variant, NCCL's default included "
            "(config files cannot be cleared for the ranks): remove it and re-run tune"
        )
    return note, None


def variants_refused(settings: TuneSettings, why: str) -> list[VariantMeasurement]:
    """Every NCCL variant at every size, not measured, with ``variant_conditions``' reason."""
    return [
        VariantMeasurement(env, t, None, False, f"n/a: {why}")
        for env in NCCL_VARIANTS
        for t in variant_tokens(settings)
    ]


@contextlib.contextmanager
def variant_environment(env: NcclEnv) -> Iterator[None]:
    """os.environ with none of USER_NCCL_TUNING (the default is NCCL's own choice, not a user's
    or a tuner plugin's) and the variant's variables in the form a worker sets them
    (``scoped_env``), restored afterwards; spawned ranks inherit it."""
    saved = {name: os.environ.pop(name, None) for name in USER_NCCL_TUNING}
    os.environ.update(dict(scoped_env(env)))
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def variant_deadline_s(settings: TuneSettings) -> float:
    """How long one variant's spawn may take before it counts as hung: four times its share of
    the estimate, and at least two minutes (a rank blocked in NCCL never returns by itself)."""
    return max(120.0, 4 * variant_estimate_s(settings))


def spawn_ranks(fn: Callable, args: tuple, nprocs: int, deadline_s: float) -> None:
    """``torch.multiprocessing.spawn`` with a deadline: ranks still running after
    ``deadline_s`` (a collective that never completes) are killed and TimeoutError raised, so
    one setting that hangs NCCL costs its deadline, not the whole tune."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False)
    end = time.monotonic() + deadline_s
    try:
        while not context.join(timeout=max(0.0, min(5.0, end - time.monotonic()))):
            if time.monotonic() >= end:
                raise TimeoutError(f"ranks still running after {deadline_s:.0f} s: stopped")
    except ProcessException as exc:  # a rank raised or died: its last line, not a traceback
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        raise RuntimeError(f"rank {exc.error_index} failed: {lines[-1] if lines else exc}") from exc
    finally:
        for proc in context.processes:
            if proc.is_alive():
                proc.kill()
                proc.join()


def _spawn_variant(settings: TuneSettings, env: NcclEnv) -> list[list[Any]]:
    """One variant's rows (backend, tokens, us, correct, note), from fresh rank processes,
    which inherit the variant's environment (``variant_environment``)."""
    measured = dataclasses.replace(settings, tokens=variant_tokens(settings))
    return run_ranks(measured, variant_deadline_s(settings), nccl_only=True)["rows"]


def measure_variants(
    settings: TuneSettings,
    spawn: Callable[[TuneSettings, NcclEnv], list[list[Any]]] = _spawn_variant,
) -> list[VariantMeasurement]:
    """Every NCCL variant at every token count, one fresh spawn each (``spawn``); a spawn that
    fails as a whole (a rank crashed, NCCL refused the setting, its deadline passed) gives
    every size of that variant its reason."""
    rows: list[VariantMeasurement] = []
    for env in NCCL_VARIANTS:
        try:
            with variant_environment(env):
                measured = spawn(settings, env)
            cells = {int(t): (us, ok, note) for _, t, us, ok, note in measured}
        except Exception as exc:  # one variant failing must not hide the others
            why = f"failed: {type(exc).__name__}: {exc}"[:300]
            cells = {t: (None, False, why) for t in variant_tokens(settings)}
        for tokens in variant_tokens(settings):
            us, ok, note = cells.get(tokens, (None, False, "not measured"))
            rows.append(VariantMeasurement(env, tokens, us, ok, note))
    return rows


# ------------------------------------------------------------------------------------ entry


def run_tune(settings: TuneSettings) -> tuple[TuningTable, Path]:
    """Measure, build the table for this host and save it; returns (table, path)."""
    import torch

    problem = cache_write_problem()  # said now, not after minutes of measuring
    if problem:
        raise ValueError(problem)
    if not torch.cuda.is_available():
        raise RuntimeError("needs CUDA GPUs; torch sees none")
    if settings.tp < 2:
        raise ValueError("tune needs --tp >= 2: tp=1 has no all-reduce")
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # ranks as streams: no lazy loads
    share = torch.cuda.device_count() < settings.tp
    cleared, refused = variant_conditions(os.environ)  # said now, not after the backends
    if refused and not share:
        print(f"tune: NCCL variants will not be timed: {refused}", file=sys.stderr, flush=True)
    elif not share:
        print(estimate_line(settings), file=sys.stderr, flush=True)
    started = time.monotonic()
    measurements, notes = (_tune_local if share else _tune_multiprocess)(settings)
    if share:
        variants = variants_not_measured(settings)
    elif refused:
        variants = variants_refused(settings, refused)
    else:
        variants = measure_variants(settings)
        notes += [cleared] if cleared else []
    notes.append(
        f"measured in {time.monotonic() - started:.0f} s on {torch.cuda.get_device_name()}"
    )
    table = TuningTable(
        fingerprint=host_fingerprint(current_facts(), settings.tp),
        tp=settings.tp,
        hidden=settings.hidden,
        dtype=settings.dtype,
        measurements=tuple(measurements),
        created=time.strftime("%Y-%m-%dT%H:%M:%S"),
        ranks_share_gpu=share,
        notes=tuple(notes),
        nccl_variants=tuple(variants),
    )
    return table, save_table(table)


def format_table(table: TuningTable) -> str:
    """Microseconds per backend and token count, the winner per row, and what was excluded."""
    from sglang_sm120.planning.tuning import winners

    by_cell = {(m.backend, m.tokens): m for m in table.measurements}
    tokens = sorted({m.tokens for m in table.measurements})
    best = winners(table, prefer=None)
    widths = {b: max(12, len(b)) for b in BACKENDS}
    head = f"{'tokens':>6} " + " ".join(f"{b:>{widths[b]}}" for b in BACKENDS) + "  fastest correct"
    lines = [
        f"tp={table.tp} hidden={table.hidden} {table.dtype}"
        + (" (ranks share one GPU: kernel overhead only)" if table.ranks_share_gpu else ""),
        head,
    ]
    for t in tokens:
        cells = []
        for b in BACKENDS:
            m = by_cell.get((b, t))
            if m is not None and m.us is None and m.note.startswith(DECLINES):
                cell = "declined"
            else:
                cell = (
                    "n/a"
                    if m is None or m.us is None
                    else f"{m.us:.1f}" + ("" if m.correct else "!")
                )
            cells.append(f"{cell:>{widths[b]}}")
        lines.append(f"{t:>6} " + " ".join(cells) + f"  {best.get(t, '-')}")
    lines.append(
        "(us per call; '!' = wrong result, excluded; declined = upstream's communicator does "
        "not take that size, SGLang's next one does)"
    )
    lines += variant_lines(table)
    lines += [f"note: {n}" for n in table.notes]
    return "\n".join(lines)


def variant_lines(table: TuningTable) -> list[str]:
    """NCCL's all-reduce per variant and token count; a variant that failed (capture included)
    or was wrong is named with its reason, as excluded."""
    if not table.nccl_variants:
        return []
    envs = list(dict.fromkeys(m.env for m in table.nccl_variants))
    names = [variant_name(e).replace("NCCL_", "") for e in envs]
    by_cell = {(m.env, m.tokens): m for m in table.nccl_variants}
    widths = [max(9, len(n)) for n in names]
    lines = [
        "NCCL variants (nccl, each in fresh processes):",
        f"{'tokens':>6} " + " ".join(f"{n:>{w}}" for n, w in zip(names, widths, strict=True)),
    ]
    for t in sorted({m.tokens for m in table.nccl_variants}):
        cells = []
        for env, w in zip(envs, widths, strict=True):
            m = by_cell.get((env, t))
            cell = (
                "n/a" if m is None or m.us is None else f"{m.us:.1f}" + ("" if m.correct else "!")
            )
            cells.append(f"{cell:>{w}}")
        lines.append(f"{t:>6} " + " ".join(cells))
    unmeasured = {m.note for m in table.nccl_variants if m.note.startswith("n/a")}
    if len(unmeasured) == 1 and all(m.note in unmeasured for m in table.nccl_variants):
        return [*lines, f"not measured: {unmeasured.pop()}"]  # ranks sharing one GPU: say it once
    for env in envs:
        bad = [m for m in table.nccl_variants if m.env == env and (m.us is None or not m.correct)]
        if bad:
            why = bad[0].note or "wrong result"
            lines.append(f"excluded: {variant_name(env)} at {len(bad)} size(s): {why}")
    return lines


# ------------------------------------------------------------------------------ the command


def run(args: argparse.Namespace) -> int:
    settings = TuneSettings(
        tp=args.tp,
        hidden=args.hidden,
        dtype=args.dtype,
        tokens=tuple(args.tokens or TOKENS),
        calls=args.calls,
        replays=args.replays,
    )
    current_facts()  # a bad SGLANG_SM120_TOPOLOGY is reported now, not after measuring
    try:
        table, path = run_tune(settings)
    except (RuntimeError, ValueError, TimeoutError) as exc:
        print(f"sglang-sm120 tune: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(table.to_json(), indent=1) if args.json else format_table(table))
    print(f"written: {path}", file=sys.stderr)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("tune", help="measure all-reduce backends here, write the tuning table")
    parser.add_argument(
        "--tp", type=positive_int, required=True, help="ranks to measure, one per GPU"
    )
    parser.add_argument(
        "--hidden", type=positive_int, default=7168, help="the model's hidden size (default 7168)"
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16"),
        help="the model's dtype (default bfloat16)",
    )
    parser.add_argument(
        "--tokens", type=positive_int, nargs="+", help="token counts (default 1..2048)"
    )
    parser.add_argument(
        "--calls", type=positive_int, default=20, help="calls per captured graph (default 20)"
    )
    parser.add_argument(
        "--replays", type=positive_int, default=10, help="graph replays timed (median; default 10)"
    )
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    parser.set_defaults(func=run)
