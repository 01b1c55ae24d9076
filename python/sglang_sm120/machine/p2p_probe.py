"""P2P probes: GPU-to-GPU traffic on this host, pair by pair and all at once, as ``sglang-sm120
p2p`` (``commands.p2p``) measures it; here the judgement and the cached document.

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

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_sm120.machine.cache import (
    cache_dir,
    cache_read_problem,
    fingerprint_id,
    host_fingerprint,
    relative_problem,
)
from sglang_sm120.machine.facts import HostFacts
from sglang_sm120.machine.host_checks import P2PSummary
from sglang_sm120.strict_json import fields, read_json_file, require

SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
PROBE_VERSION = 1
PROBE_MAX_BYTES = 4 << 20  # a probe of 8 GPUs takes ~100 KiB
# Writes collapse below half the links' worth, when reads or the staged order do 1.5x better.
COLLAPSE_BELOW = 0.5
WRITES_BEHIND = 1 / 1.5
PATTERNS = ("all_write", "all_read", "staged_write")
# What ``commands.p2p`` writes; only version, fingerprint and summary are used here.
PROBE_KEYS = (
    "version",
    "fingerprint",
    "fingerprint_id",
    "gpus",
    "created",
    "sizes",
    "reps",
    "pairs",
    "concurrent",
    "summary",
    "notes",
)


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
        if relative_problem(path.parent):  # not a file below whichever directory this is
            return None, f"no p2p probe ({cache_read_problem()})"
        if not (path.is_file() or os.path.lexists(path)):  # a FIFO, a link: read_json_file says
            unreadable = cache_read_problem()
            where = f" ({unreadable})" if unreadable else ""
            return None, f"no p2p probe for GPUs {','.join(map(str, gpus))}{where}"
        document = read_json_file(path, PROBE_MAX_BYTES)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        return None, f"no p2p probe ({path} unreadable: {reason})"
    try:
        document = fields(document, "", known=PROBE_KEYS)
        version = require(document, "version", int)
        if version != PROBE_VERSION or require(document, "fingerprint", dict) != fingerprint:
            return None, f"p2p probe {Path(path).name} stale: written for another host or version"
        summary = P2PSummary.from_json(require(document, "summary", dict), "summary")
    except (ValueError, RecursionError) as exc:  # FieldError: one line naming the field
        return None, f"no p2p probe ({path} malformed: {exc or type(exc).__name__})"
    return dataclasses.replace(summary, path=str(path)), f"p2p probe {Path(path).name}"


def load_probe(
    facts: HostFacts, gpu_ids: Sequence[int] | None = None
) -> tuple[P2PSummary | None, str]:
    """The cached probe of exactly these GPUs (default: every visible one); None with the reason
    otherwise. A probe of more GPUs is not used: what all 8 do at once (a collapse) says nothing
    certain about a TP group of 4. Never raises: an unreadable cache directory is 'no p2p probe
    (reason)'."""
    wanted = tuple(gpu_ids) if gpu_ids is not None else tuple(range(len(facts.gpus)))
    if len(wanted) < 2:
        return None, "no p2p probe: fewer than 2 GPUs, no peers to measure"
    return _read_probe(facts, wanted)
