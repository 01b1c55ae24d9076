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
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in text_rows]
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    """Where the numbers came from: host, Python, torch/CUDA versions and GPU names if present."""
    env: dict[str, Any] = {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "argv": sys.argv,
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
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
    """Latency at ``nbytes``, interpolated log-log between the nearest points.

    Outside the measured range the end segment is extended (a single point is used as a
    constant): modelled numbers are labelled as such by callers, so a coarse estimate is fine.
    """
    if not points:
        raise ValueError("latency table is empty")
    pts = sorted(points, key=lambda p: p.nbytes)
    if len(pts) == 1:
        return pts[0].us
    if nbytes <= 0:
        raise ValueError(f"message size must be positive, got {nbytes} bytes")
    lo, hi = pts[0], pts[1]
    for a, b in zip(pts, pts[1:]):
        lo, hi = a, b
        if nbytes <= b.nbytes:
            break
    slope = math.log(hi.us / lo.us) / math.log(hi.nbytes / lo.nbytes)
    return lo.us * math.exp(slope * math.log(nbytes / lo.nbytes))


def load_allreduce_records(
    path: str | os.PathLike[str], world_size: int
) -> dict[str, list[LatencyPoint]]:
    """Read ``{"allreduce": [{"backend", "world_size", "bytes", "us"}, ...]}`` for one world size.

    Returns backend name -> latency points. Raises ValueError naming what is missing, so a
    table from another host or world size is not silently used.
    """
    data = json.loads(Path(path).read_text())
    records = data.get("allreduce")
    if not isinstance(records, list):
        raise ValueError(f"{path}: no 'allreduce' list of records")
    table: dict[str, list[LatencyPoint]] = {}
    for rec in records:
        try:
            if int(rec["world_size"]) != world_size:
                continue
            point = LatencyPoint(int(rec["bytes"]), float(rec["us"]))
            table.setdefault(str(rec["backend"]), []).append(point)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: bad all-reduce record {rec!r}: {exc}") from exc
    if not table:
        raise ValueError(f"{path}: no all-reduce records for world_size={world_size}")
    return table
