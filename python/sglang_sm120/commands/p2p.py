"""``sglang-sm120 p2p``: measure GPU-to-GPU traffic on this host, pair by pair and all at once.

What is measured and how a result is judged is described in ``machine.p2p_probe``, which also
holds the arithmetic and the cached document that doctor and the plan read. This module holds
the measuring (CUDA copies on streams we pick, through the runtime torch loaded) and the
command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sglang_sm120.commands.args import UsageError, gpu_list, positive_int
from sglang_sm120.commands.tune import progress_bar
from sglang_sm120.machine.cache import cache_write_problem, fingerprint_id, host_fingerprint
from sglang_sm120.machine.facts import HostFacts, current_facts
from sglang_sm120.machine.host_checks import P2PSummary
from sglang_sm120.machine.p2p_probe import (
    PROBE_VERSION,
    SIZES,
    ConcurrentTiming,
    PairTiming,
    gbps,
    link_ratio,
    save_probe,
    staged_rounds,
    summarize,
)

# ------------------------------------------------------------------------------ measuring


class _Runtime:
    """The CUDA runtime torch loaded, through ctypes: copies issued on a stream we choose."""

    def __init__(self) -> None:
        import ctypes
        import ctypes.util

        path = None
        try:
            with open("/proc/self/maps") as maps:
                path = next((ln.split()[-1] for ln in maps if "libcudart.so" in ln), None)
        except OSError:
            pass
        try:
            lib = ctypes.CDLL(path or ctypes.util.find_library("cudart") or "libcudart.so")
        except OSError as exc:
            raise RuntimeError(f"cannot load the CUDA runtime library: {exc}") from None
        c_int, c_void_p = ctypes.c_int, ctypes.c_void_p
        lib.cudaMemcpyAsync.argtypes = [c_void_p, c_void_p, ctypes.c_size_t, c_int, c_void_p]
        lib.cudaMemcpyAsync.restype = c_int
        lib.cudaSetDevice.argtypes = [c_int]
        lib.cudaSetDevice.restype = c_int
        lib.cudaDeviceEnablePeerAccess.argtypes = [c_int, ctypes.c_uint]
        lib.cudaDeviceEnablePeerAccess.restype = c_int
        lib.cudaGetLastError.restype = c_int
        lib.cudaGetErrorString.argtypes = [c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        self.lib = lib

    def check(self, code: int, what: str) -> None:
        if code != 0:
            self.lib.cudaGetLastError()  # clear it, or torch's next launch check reports it
            raise RuntimeError(f"{what}: {self.lib.cudaGetErrorString(code).decode()}")

    def enable_peer_access(self, device: int, peer: int) -> None:
        self.check(self.lib.cudaSetDevice(device), f"cudaSetDevice({device})")
        code = self.lib.cudaDeviceEnablePeerAccess(peer, 0)
        if code == 704:  # cudaErrorPeerAccessAlreadyEnabled
            self.lib.cudaGetLastError()
            return
        self.check(code, f"cudaDeviceEnablePeerAccess({device} -> {peer})")

    def copy(self, device: int, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.check(self.lib.cudaSetDevice(device), f"cudaSetDevice({device})")
        code = self.lib.cudaMemcpyAsync(dst, src, nbytes, 4, stream.cuda_stream)  # Default kind
        self.check(code, f"cudaMemcpyAsync on GPU{device}")


@dataclass
class _Buffers:
    """A source per GPU and a landing buffer per ordered pair, each the largest size."""

    src: dict[int, Any]
    dst: dict[tuple[int, int], Any]


def _time_pair(rt: _Runtime, device: int, dst: Any, src: Any, nbytes: int, reps: int) -> float:
    import torch

    stream = torch.cuda.Stream(device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):
        rt.copy(device, dst.data_ptr(), src.data_ptr(), nbytes, stream)
    start.record(stream)
    for _ in range(reps):
        rt.copy(device, dst.data_ptr(), src.data_ptr(), nbytes, stream)
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def _time_together(
    rt: _Runtime, jobs: Sequence[tuple[int, Any, Any]], nbytes: int, reps: int
) -> float:
    """Seconds until the slowest of ``jobs`` (issuing device, dst, src) has done ``reps``
    copies, all streams released together by one gate (a sleeping kernel on the first device,
    so that enqueueing the copies does not stagger their start)."""
    import torch

    gate_device = jobs[0][0]
    gate_stream = torch.cuda.Stream(device=gate_device)
    gate = torch.cuda.Event()
    with torch.cuda.device(gate_device), torch.cuda.stream(gate_stream):
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is not None:
            sleep(50_000_000)  # ~25 ms at 2 GHz: longer than enqueueing every copy
        gate.record(gate_stream)
    timed = []
    for device, dst, src in jobs:
        stream = torch.cuda.Stream(device=device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.wait_event(gate)
        start.record(stream)
        for _ in range(reps):
            rt.copy(device, dst.data_ptr(), src.data_ptr(), nbytes, stream)
        end.record(stream)
        timed.append((start, end))
    for _, end in timed:
        end.synchronize()
    return max(start.elapsed_time(end) for start, end in timed) / 1e3


def measure(
    gpus: Sequence[int], sizes: Sequence[int] = SIZES, reps: int = 20, show: bool = True
) -> tuple[list[PairTiming], list[ConcurrentTiming], list[str]]:
    """Every measurement of the module docstring on CUDA devices ``gpus``; (pairs, concurrent,
    notes). Progress is a tqdm bar on stderr."""
    import torch

    torch.cuda.init()  # loads the CUDA runtime that _Runtime then finds among the mapped libraries
    rt = _Runtime()
    original = torch.cuda.current_device()
    notes = []
    pairs_ab = [(a, b) for a in gpus for b in gpus if a != b]
    for a, b in pairs_ab:
        if torch.cuda.can_device_access_peer(a, b):
            rt.enable_peer_access(a, b)
        else:
            notes.append(f"GPU{a} has no peer access to GPU{b}: the driver stages those copies")
    largest = max(sizes)
    buffers = _Buffers(
        src={g: torch.ones(largest, dtype=torch.uint8, device=f"cuda:{g}") for g in gpus},
        dst={
            (a, b): torch.empty(largest, dtype=torch.uint8, device=f"cuda:{b}") for a, b in pairs_ab
        },
    )
    n = len(gpus)
    bar = progress_bar(len(pairs_ab) * len(sizes) * 2 + 2 + (n - 1), "p2p", show)
    pairs: list[PairTiming] = []
    concurrent: list[ConcurrentTiming] = []
    try:
        for a, b in pairs_ab:
            for nbytes in sizes:
                for mode, device in (("write", a), ("read", b)):
                    bar.set_postfix_str(f"GPU{a}->GPU{b} {mode} {nbytes >> 10} KiB")
                    dst, src = buffers.dst[(a, b)], buffers.src[a]
                    seconds = _time_pair(rt, device, dst, src, nbytes, reps)
                    pairs.append(PairTiming(a, b, mode, nbytes, seconds))
                    bar.update()
        moved = largest * reps
        for pattern, issuer in (("all_write", 0), ("all_read", 1)):
            bar.set_postfix_str(pattern)
            jobs = [((a, b)[issuer], buffers.dst[(a, b)], buffers.src[a]) for a, b in pairs_ab]
            seconds = _time_together(rt, jobs, largest, reps)
            concurrent.append(ConcurrentTiming(pattern, moved * len(jobs), seconds))
            bar.update()
        staged = 0.0
        for rounds in staged_rounds(n):
            bar.set_postfix_str("staged_write")
            jobs = [
                (gpus[i], buffers.dst[(gpus[i], gpus[j])], buffers.src[gpus[i]]) for i, j in rounds
            ]
            staged += _time_together(rt, jobs, largest, reps)
            bar.update()
        concurrent.append(ConcurrentTiming("staged_write", moved * len(pairs_ab), staged))
    finally:
        bar.close()
        rt.lib.cudaSetDevice(original)
        torch.cuda.set_device(original)
    return pairs, concurrent, notes


def run_probe(facts: HostFacts, gpus: Sequence[int], reps: int = 20) -> dict[str, Any]:
    """Measure ``gpus`` and build the document that is saved and printed."""
    import torch

    started = time.monotonic()
    pairs, concurrent, notes = measure(gpus, reps=reps)
    created = time.strftime("%Y-%m-%dT%H:%M:%S")
    summary = summarize(gpus, pairs, concurrent, created)
    fingerprint = host_fingerprint(facts, len(gpus), tuple(gpus))
    notes.append(
        f"measured in {time.monotonic() - started:.0f} s on "
        + ", ".join(sorted({torch.cuda.get_device_name(g) for g in gpus}))
    )
    return {
        "version": PROBE_VERSION,
        "fingerprint": fingerprint,
        "fingerprint_id": fingerprint_id(fingerprint),
        "gpus": list(gpus),
        "created": created,
        "sizes": list(SIZES),
        "reps": reps,
        "pairs": [asdict(p) for p in pairs],
        "concurrent": [asdict(c) for c in concurrent],
        "summary": summary.to_json(),
        "notes": notes,
    }


def format_probe(document: dict[str, Any]) -> str:
    """Pair matrices (write/read GB/s at the largest size, latency at the smallest), the
    all-at-once figures against the links' worth, and the verdict."""
    gpus = document["gpus"]
    pairs = [PairTiming(**p) for p in document["pairs"]]
    concurrent = [ConcurrentTiming(**c) for c in document["concurrent"]]
    summary = P2PSummary.from_json(document["summary"])
    largest = max(p.nbytes for p in pairs)
    smallest = min(p.nbytes for p in pairs)
    cell = {(p.src, p.dst, p.mode, p.nbytes): p.seconds for p in pairs}
    head = "          " + " ".join(f"{'GPU' + str(g):>13}" for g in gpus)
    lines = [f"p2p probe, GPUs {','.join(map(str, gpus))} ({document['created']})"]
    for what, nbytes, fmt in (
        (f"GB/s at {largest >> 20} MiB, write/read (row: source)", largest, "bw"),
        (f"us per {smallest >> 10} KiB copy, write/read", smallest, "us"),
    ):
        lines += [f"one pair at a time, {what}:", head]
        for a in gpus:
            row = []
            for b in gpus:
                if a == b:
                    row.append(f"{'-':>13}")
                    continue
                w, r = (cell.get((a, b, m, nbytes), 0.0) for m in ("write", "read"))
                if fmt == "bw":
                    row.append(f"{gbps(nbytes, w):6.1f}/{gbps(nbytes, r):<6.1f}")
                else:
                    row.append(f"{w * 1e6:6.1f}/{r * 1e6:<6.1f}")
            lines.append(f"  GPU{a:<4} " + " ".join(row))
    worth = {
        "all_write": summary.pair_write_gbps,
        "all_read": summary.pair_read_gbps,
        "staged_write": summary.pair_write_gbps,
    }
    labels = {
        "all_write": "every GPU writing to every peer",
        "all_read": "every GPU reading from every peer",
        "staged_write": "writes in staged order (one inbound stream per GPU)",
    }
    lines.append(f"all at once, {largest >> 20} MiB copies (links' worth: {len(gpus)} x one pair):")
    for c in concurrent:
        aggregate = gbps(c.nbytes, c.seconds)
        ratio = link_ratio(aggregate, worth[c.pattern], len(gpus))
        lines.append(f"  {labels[c.pattern]:<52} {aggregate:7.1f} GB/s  {ratio:4.0%}")
    lines.append(
        "verdict: "
        + summary.describe()
        + (
            ": one-shot push all-reduce disfavoured here; PCIe-IPC (staged)"
            if summary.collapse
            else ""
        )
    )
    lines += [f"note: {n}" for n in document.get("notes", [])]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    problem = cache_write_problem()  # said now, not after the measuring
    if problem:
        raise UsageError(problem)
    try:
        import torch
    except ImportError as exc:
        raise UsageError(f"needs torch with CUDA to copy between GPUs ({exc})") from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        seen = "none" if count == 0 else f"1 ({torch.cuda.get_device_name(0)})"
        raise UsageError(f"needs at least 2 CUDA GPUs to measure P2P; torch sees {seen}")
    gpus = args.gpus or tuple(range(count))
    if len(gpus) < 2:
        raise UsageError(f"--gpus {','.join(map(str, gpus))}: name at least 2 GPUs")
    if max(gpus) >= count:
        raise UsageError(f"--gpus {','.join(map(str, gpus))}: torch sees GPUs 0-{count - 1}")
    facts = current_facts()
    try:
        document = run_probe(facts, gpus, reps=args.reps)
    except RuntimeError as exc:
        print(f"sglang-sm120 p2p: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(document, indent=1) if args.json else format_probe(document))
    try:
        print(f"written: {save_probe(document)}", file=sys.stderr)
    except OSError as exc:
        print(f"sglang-sm120 p2p: not saved ({exc})", file=sys.stderr)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("p2p", help="measure P2P bandwidth per pair and all at once, here")
    parser.add_argument("--gpus", type=gpu_list, help="CUDA indices, e.g. 0,1,2,3 (default: all)")
    parser.add_argument("--reps", type=positive_int, default=20, help="copies per measurement")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")
    parser.set_defaults(func=run)
