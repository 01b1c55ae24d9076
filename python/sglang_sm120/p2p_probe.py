"""``sglang-sm120 p2p``: measure GPU-to-GPU traffic on this host, pair by pair and all at once.

Write or read: a copy between two GPUs runs on the copy engine of the GPU whose stream carries
it (``cudaMemcpyAsync`` with unified addressing, called on a stream we pick; torch's own
``copy_`` always issues on the source's stream). Issued on the source GPU's stream, that GPU
pushes into the peer's memory: P2P writes, the posted PCIe writes that push all-reduce kernels
(sgl-kernel-sm120's, FlashInfer's one-shot) issue. Issued on the destination GPU's stream, the
destination pulls from the peer: P2P reads. Peer access is enabled for every pair that allows
it first, so copies go GPU to GPU instead of through host memory where the driver permits.

Measured for the GPUs given (default: every visible one):

1. each ordered pair alone, writes and reads, at 4 KiB ... 4 MiB: bandwidth (bytes / time per
   copy) and latency (the time of one 4 KiB copy);
2. every GPU writing to every peer at once, one stream per ordered pair, then reading the same
   way, at 4 MiB; all streams start together behind one gate, and the slowest stream's time
   counts (an all-reduce waits for its last peer);
3. the same writes in a staged order: N-1 rounds, in round s GPU i writes to GPU i+s, so every
   GPU has one inbound stream at a time.

Each all-at-once figure is compared with the links' worth, GPUs x one pair's bandwidth alone
(``link_ratio``). Writes collapse when they reach under half of it while reads or the staged
order do clearly better (``is_collapse``): push kernels lose there, staged or pull schemes not.

The result is saved next to the tuning table, one file per host fingerprint and GPU set
(``probe_path``); doctor and the plan read it (``load_probe``). The arithmetic is in pure
functions (``gbps``, ``link_ratio``, ``is_collapse``, ``summarize``) tested on recorded timings.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sglang_sm120.facts import HostFacts
from sglang_sm120.host import P2PSummary
from sglang_sm120.strict_json import read_json_file
from sglang_sm120.tuning import cache_dir, cache_read_problem, fingerprint_id, host_fingerprint

SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
PROBE_VERSION = 1
PROBE_MAX_BYTES = 4 << 20  # a probe of 8 GPUs takes ~100 KiB
# Writes collapse below half the links' worth, when reads or the staged order do 1.5x better.
COLLAPSE_BELOW = 0.5
WRITES_BEHIND = 1 / 1.5
PATTERNS = ("all_write", "all_read", "staged_write")


@dataclass(frozen=True)
class PairTiming:
    """One ordered pair alone: ``seconds`` per copy of ``nbytes`` from ``src`` to ``dst``."""

    src: int
    dst: int
    mode: str  # "write" (issued by src) or "read" (issued by dst)
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class ConcurrentTiming:
    """Many streams at once: ``nbytes`` moved in all, in ``seconds`` (the slowest stream)."""

    pattern: str  # one of PATTERNS
    nbytes: int
    seconds: float


# --------------------------------------------------------------------------------- arithmetic


def gbps(nbytes: float, seconds: float) -> float:
    """Bandwidth in GB/s (10^9 bytes per second); 0.0 for a time that is no measurement."""
    if not (seconds > 0 and math.isfinite(seconds)):
        return 0.0
    return nbytes / seconds / 1e9


def pair_gbps(pairs: Sequence[PairTiming], mode: str, nbytes: int) -> float:
    """The median bandwidth over ordered pairs for one mode and size (0.0 when none)."""
    values = [gbps(p.nbytes, p.seconds) for p in pairs if p.mode == mode and p.nbytes == nbytes]
    return statistics.median(values) if values else 0.0


def latency_us(pairs: Sequence[PairTiming], mode: str) -> float:
    """The median time of one copy at the smallest size measured, in microseconds."""
    sized = [p for p in pairs if p.mode == mode and p.seconds > 0]
    if not sized:
        return 0.0
    smallest = min(p.nbytes for p in sized)
    return statistics.median(p.seconds for p in sized if p.nbytes == smallest) * 1e6


def link_ratio(aggregate_gbps: float, one_pair_gbps: float, gpus: int) -> float:
    """All-at-once bandwidth against the links' worth: every GPU's link carrying what one pair
    moves alone (1.0: no loss to concurrency); 0.0 when there is nothing to compare with."""
    worth = one_pair_gbps * gpus
    return aggregate_gbps / worth if worth > 0 else 0.0


def is_collapse(write_ratio: float, read_ratio: float, staged_ratio: float) -> bool:
    """Concurrent writes collapse: under COLLAPSE_BELOW of the links' worth, and behind reads or
    the staged order by 1.5x (a fabric that is slow for everything is not write collapse)."""
    return write_ratio < COLLAPSE_BELOW and write_ratio < WRITES_BEHIND * max(
        read_ratio, staged_ratio
    )


def summarize(
    gpus: Sequence[int],
    pairs: Sequence[PairTiming],
    concurrent: Sequence[ConcurrentTiming],
    created: str = "",
) -> P2PSummary:
    """The verdict from recorded timings (pairs at every size, concurrent at the largest)."""
    largest = max((p.nbytes for p in pairs), default=0)
    write, read = pair_gbps(pairs, "write", largest), pair_gbps(pairs, "read", largest)
    aggregate = {c.pattern: gbps(c.nbytes, c.seconds) for c in concurrent}
    n = len(gpus)
    write_ratio = link_ratio(aggregate.get("all_write", 0.0), write, n)
    read_ratio = link_ratio(aggregate.get("all_read", 0.0), read, n)
    staged_ratio = link_ratio(aggregate.get("staged_write", 0.0), write, n)
    return P2PSummary(
        gpus=tuple(gpus),
        pair_write_gbps=round(write, 2),
        pair_read_gbps=round(read, 2),
        write_latency_us=round(latency_us(pairs, "write"), 2),
        read_latency_us=round(latency_us(pairs, "read"), 2),
        write_ratio=round(write_ratio, 3),
        read_ratio=round(read_ratio, 3),
        staged_ratio=round(staged_ratio, 3),
        collapse=is_collapse(write_ratio, read_ratio, staged_ratio),
        created=created,
    )


def staged_rounds(n: int) -> list[list[tuple[int, int]]]:
    """(src, dst) positions per round: in round s every GPU i writes to GPU (i + s) mod n, so
    each GPU has one inbound and one outbound stream at a time."""
    return [[(i, (i + s) % n) for i in range(n)] for s in range(1, n)]


# ------------------------------------------------------------------------------------ cache


def probe_path(fingerprint: dict[str, Any], gpus: Sequence[int]) -> Path:
    name = f"p2p-{fingerprint_id(fingerprint)}-gpus{'-'.join(map(str, gpus))}.json"
    return cache_dir() / name


def save_probe(document: dict[str, Any]) -> Path:
    path = probe_path(document["fingerprint"], document["gpus"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(document, indent=1))
    tmp.replace(path)
    return path


def _read_probe(facts: HostFacts, gpus: Sequence[int]) -> tuple[P2PSummary | None, str]:
    fingerprint = host_fingerprint(facts, len(gpus), tuple(gpus))
    path: Path | str = "the cache directory"
    try:
        path = probe_path(fingerprint, gpus)  # cache_dir() needs a home directory by default
        if not path.is_file():
            unreadable = cache_read_problem()
            where = f" ({unreadable})" if unreadable else ""
            return None, f"no p2p probe for GPUs {','.join(map(str, gpus))}{where}"
        document = read_json_file(path, PROBE_MAX_BYTES)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        return None, f"no p2p probe ({path} unreadable: {reason})"
    try:
        if document.get("version") != PROBE_VERSION or document["fingerprint"] != fingerprint:
            return None, f"p2p probe {Path(path).name} stale: written for another host or version"
        summary = P2PSummary.from_json({**document["summary"], "path": str(path)})
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return None, f"no p2p probe ({path} malformed: {exc})"
    return summary, f"p2p probe {Path(path).name}"


def load_probe(
    facts: HostFacts, gpu_ids: Sequence[int] | None = None
) -> tuple[P2PSummary | None, str]:
    """The cached probe for these GPUs (default: every visible one), else for every visible GPU
    when these are among them; None with the reason otherwise. Never raises: an unreadable cache
    directory is 'no p2p probe (reason)'."""
    everyone = tuple(range(len(facts.gpus)))
    wanted = tuple(gpu_ids) if gpu_ids is not None else everyone
    if len(wanted) < 2:
        return None, "no p2p probe: fewer than 2 GPUs, no peers to measure"
    summary, note = _read_probe(facts, wanted)
    if summary is None and wanted != everyone and set(wanted) <= set(everyone):
        wider, wider_note = _read_probe(facts, everyone)
        if wider is not None:
            return wider, wider_note + f" (every GPU, GPUs {','.join(map(str, wanted))} among them)"
    return summary, note


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

    from sglang_sm120.tune import progress_bar

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
