"""Shared helpers for the benchmarks: a readable table, JSON a program can read, an optional PNG.

Every benchmark here prints a table for people, writes JSON for programs (with the machine it ran
on, so numbers from different hosts are never mixed up), and draws a PNG where a curve says more
than numbers. matplotlib is optional: without it the PNG is skipped and the reason is printed.

All-reduce latency tables travel between benchmarks as JSON records
``{"backend": str, "world_size": int, "bytes": int, "us": float}`` in a top-level list
``"allreduce"``; :func:`load_allreduce_records` reads them and :func:`latency_us` interpolates.

Usage::

    from _common import format_table, write_json
    print(format_table(["backend", "us"], [["nccl", 205.0]]))
    write_json(".out/x.json", {"rows": [...]})
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import os
import platform
import socket
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_OUT_DIR = Path(".out")


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Left-aligned text table; floats get 3 significant decimals, None prints as '-'."""

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            if math.isnan(value):
                return "nan"
            return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
        return str(value)

    text_rows = [[cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in text_rows:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells, table has {len(headers)} columns: {row}")
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in text_rows
    ]
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    """Where the numbers came from: host, Python, torch/CUDA versions and GPU names if present."""
    env: dict[str, Any] = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "argv": sys.argv,
        "time_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    try:
        import torch
    except ImportError:
        return env
    env["torch"] = torch.__version__
    env["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["device_capability"] = list(torch.cuda.get_device_capability(0))
    else:
        env["gpus"] = []
    return env


def write_json(path: str | os.PathLike[str], payload: dict[str, Any]) -> Path:
    """Write ``payload`` plus an ``environment`` block; creates the parent folder."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    body = {"environment": environment(), **payload}
    out.write_text(json.dumps(body, indent=2, sort_keys=False) + "\n")
    return out


def save_png(path: str | os.PathLike[str], draw: Callable[[Any], None]) -> str:
    """Draw with ``draw(pyplot)`` into ``path``; returns a line saying what happened.

    The PNG is a convenience: a missing matplotlib must not fail a benchmark run on a bare
    GPU host, so the reason is returned for the caller to print instead of raising.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"PNG skipped: matplotlib is not importable ({exc})"
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    plt.figure(figsize=(8, 5))
    try:
        draw(plt)
        plt.tight_layout()
        plt.savefig(out, dpi=120)
    finally:
        plt.close("all")
    return f"PNG written: {out}"


@dataclass(frozen=True)
class LatencyPoint:
    """One measured (or reported) all-reduce latency at a message size."""

    nbytes: int
    us: float


def latency_us(points: Sequence[LatencyPoint], nbytes: int) -> float:
    """Latency at ``nbytes``: log-log interpolation between the nearest measured sizes.

    Below the smallest size the smallest size's latency is used (small messages are latency
    bound, they do not get faster); above the largest, the last segment's slope is extended
    (bandwidth bound). Callers label such numbers as modelled.
    """
    if not points:
        raise ValueError("latency table is empty")
    if nbytes <= 0:
        raise ValueError(f"message size must be positive, got {nbytes} bytes")
    pts = sorted(points, key=lambda p: p.nbytes)
    if len(pts) == 1 or nbytes <= pts[0].nbytes:
        return pts[0].us
    lo, hi = pts[-2], pts[-1]
    for a, b in itertools.pairwise(pts):
        if nbytes <= b.nbytes:
            lo, hi = a, b
            break
    slope = math.log(hi.us / lo.us) / math.log(hi.nbytes / lo.nbytes)
    return lo.us * math.exp(slope * math.log(nbytes / lo.nbytes))


@dataclass(frozen=True)
class LatencyTable:
    """Per-call latency of one all-reduce backend at one world size, by message size.

    ``includes_norm``: the call also does the residual add + RMSNorm (a fused kernel, or a
    measurement of all-reduce followed by the norm), so it replaces the norm rather than adds.
    """

    points: tuple[LatencyPoint, ...]
    includes_norm: bool
    source: str

    def us(self, nbytes: int) -> float:
        return latency_us(self.points, nbytes)


# Columns of benchmark/bench_allreduce.py's JSON rows, and whether each includes add + RMSNorm.
BENCH_ALLREDUCE_COLUMNS = {
    "ours_plain": False,
    "ours_fused": True,
    "ours_unfused": True,
    "nccl_norm": True,
    "fi_trtllm_fused": True,
    "fi_pcie": False,
}


def load_allreduce_records(
    path: str | os.PathLike[str], world_size: int
) -> dict[str, LatencyTable]:
    """All-reduce latency tables for one world size, from either JSON layout:

    - ``{"allreduce": [{"backend", "world_size", "bytes", "us", "includes_norm"?}, ...]}``;
    - bench_allreduce.py's ``{"results": [{"world_size", "mode", "rows": [{"bytes",
      "ours_fused": us, ...}]}]}``.

    Raises ValueError naming what is missing, so a table of another world size is never used.
    """
    data = json.loads(Path(path).read_text())
    name = Path(path).name
    points: dict[str, list[LatencyPoint]] = {}
    norm: dict[str, bool] = {}
    sources: dict[str, str] = {}
    if isinstance(data.get("allreduce"), list):
        for rec in data["allreduce"]:
            try:
                if int(rec["world_size"]) != world_size:
                    continue
                backend = str(rec["backend"])
                points.setdefault(backend, []).append(
                    LatencyPoint(int(rec["bytes"]), float(rec["us"]))
                )
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}: bad all-reduce record {rec!r}: {exc}") from exc
            norm[backend] = bool(rec.get("includes_norm", False))
            sources[backend] = name
    elif isinstance(data.get("results"), list):
        for result in data["results"]:
            if result.get("world_size") != world_size:
                continue
            for row in result.get("rows", []):
                for column, includes_norm in BENCH_ALLREDUCE_COLUMNS.items():
                    us = row.get(column)
                    if isinstance(us, (int, float)):
                        points.setdefault(column, []).append(LatencyPoint(int(row["bytes"]), us))
                        norm[column] = includes_norm
                        sources[column] = f"{name}: {result.get('mode', '?')}"
    else:
        raise ValueError(f"{path}: neither an 'allreduce' list nor bench_allreduce 'results'")
    if not points:
        raise ValueError(f"{path}: no all-reduce latencies for world_size={world_size}")
    return {
        backend: LatencyTable(tuple(pts), norm[backend], sources[backend])
        for backend, pts in points.items()
    }
