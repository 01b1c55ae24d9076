"""Tuning tables: which all-reduce backend is fastest, and correct, on this host, per token count.

``sglang-sm120 tune`` measures and writes one table per (host fingerprint, tp, hidden, dtype)
under the cache directory; the policy reads it. A table whose fingerprint does not match the
host (other GPUs, topology, driver or package versions) is stale and ignored, with the reason.

Backends, as measured (each is one all-reduce + residual add + RMSNorm point of a layer):

    nccl          NCCL all-reduce, then a separate add + RMSNorm
    pcie_ipc      FlashInfer PCIe-IPC all-reduce, then a separate add + RMSNorm
    trtllm        FlashInfer allreduce_fusion (trtllm, one-shot/two-shot as it picks)
    sm120_pcie    sgl-kernel-sm120 fused all-reduce + add + RMSNorm (one kernel)
    sm120_pcie_unfused  sgl-kernel-sm120 all-reduce, then a separate add + RMSNorm (where this
                  wins by UNFUSED_MIN_GAIN, the plan declines the fused point and serves
                  SGLang's all-reduce)
    custom_ar     upstream's custom all-reduce (CustomAllreduce, v2 where it applies), then a
                  separate add + RMSNorm; upstream builds it at TP2 over PCIe or with NVLink
    mscclpp       upstream's MSCCL++ all-reduce (PyMscclppCommunicator, --enable-mscclpp), then
                  a separate add + RMSNorm; where the ``mscclpp`` package imports, TP 4-64
    torch_symm_mem  upstream's torch symmetric-memory all-reduce (--enable-torch-symm-mem), then
                  a separate add + RMSNorm; SM90/SM100 with multicast only

The three upstream communicators take only the sizes their own checks accept (custom
all-reduce up to 8 MiB, MSCCL++ where it has a tuned configuration, torch symmetric memory
below its size limit); ``tune`` writes a cell they decline as ``us=None`` with a note starting
with DECLINES, and SGLang's next communicator serves that size (``policy``).

NCCL variants (``nccl_variants``): NCCL's own all-reduce under other NCCL_PROTO / NCCL_ALGO
settings, set for the all-reduce only (``scoped_env``), each measured in fresh processes (NCCL
reads them once per process) beside the default; ``planning.nccl_settings.tuned_nccl_env``
picks one for the sizes the plan leaves on NCCL (tables of version 3 may also carry
NCCL_MAX_NCHANNELS rows, from before channel counts were dropped: read, never chosen).

Example::

    table = TuningTable.from_json(read_json_file(path, TABLE_MAX_BYTES))
    winners(table, prefer=None)   # {1: "sm120_pcie", 2: "sm120_pcie", ..., 2048: "nccl"}
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sglang_sm120.env_values import ascii_digits
from sglang_sm120.machine.cache import (
    cache_dir,
    cache_name,
    fingerprint_id,
    host_fingerprint,
    list_cache,
)
from sglang_sm120.machine.facts import HostFacts
from sglang_sm120.machine.topology import MAX_TP_SIZE
from sglang_sm120.strict_json import FieldError, fields, read_json_file, require, require_list

# Upstream's own communicators, each served by SGLang's all-reduce when its switch is on.
UPSTREAM_BACKENDS = ("custom_ar", "mscclpp", "torch_symm_mem")
BACKENDS = (
    "nccl",
    "pcie_ipc",
    "trtllm",
    "sm120_pcie",
    "sm120_pcie_unfused",
    *UPSTREAM_BACKENDS,
)  # as measured
FUSED_BACKENDS = ("trtllm", "sm120_pcie")
# 3: NCCL variants; 2: sgl-kernel-sm120 ABI 3 (up to 128 blocks). The upstream backends did not
# bump it: a table without them is still right about what it measured, and the policy treats a
# backend a table lacks as unmeasured (as before they existed).
TABLE_VERSION = 3
# Versions whose backend measurements still hold: a table of 2 has no NCCL variants (the plan
# then sets no NCCL_* and says to re-run tune); tables of 1 are stale.
READABLE_VERSIONS = (2, 3)
# The NCCL_* variables a variant sets, and the ones that, set by the user, keep every tuned
# variant off (NCCL reads them together to pick a protocol, algorithm and channel count).
# NCCL_MAX_NCHANNELS: read from tables of version 3, never chosen (``SCOPED_KEYS``).
NCCL_VARIANT_KEYS = ("NCCL_PROTO", "NCCL_ALGO", "NCCL_MAX_NCHANNELS")
NCCL_TUNING_FAMILY = (*NCCL_VARIANT_KEYS, "NCCL_MIN_NCHANNELS")
# The variables a plan may set: those NCCL (>= 2.24) reads per collective ("allreduce:LL"), so
# the setting reaches only the all-reduce tune timed, not the worker's gathers, broadcasts or
# its other groups. A channel count has no per-collective form: it is not a variant any more.
SCOPED_KEYS = ("NCCL_PROTO", "NCCL_ALGO")
SCOPE = "allreduce"
# The first table version whose NCCL variants a plan may apply (2: before tune timed them).
NCCL_VARIANTS_VERSION = 3
# The values a variant may hold: what tune measures, so a table or a published plan cannot make
# a worker set anything else.
# Not LL128: NCCL enables it by default only where it was tested (NVLink on Volta to Blackwell);
# named in NCCL_PROTO it runs anyway, and NCCL's tuning.cc warns that other cases "may cause
# silent data corruption" (it relies on 128-byte stores arriving in order; NVIDIA/nccl#786).
NCCL_VARIANT_CHOICES = {"NCCL_PROTO": ("LL", "Simple"), "NCCL_ALGO": ("Ring", "Tree")}
MAX_NCHANNELS = 64  # NCCL's MAXCHANNELS: it takes no larger channel count
# One chunked-prefill all-reduce beside the decode sizes: a variant serves every NCCL call of
# the process, so it must not lose there (8192: SGLang's chunked_prefill_size on large GPUs).
PREFILL_TOKENS = 8192
# What tune measures: NCCL's defaults, then one variable changed at a time (five spawns of the
# TP group; one variable at a time keeps the grid linear, not a product), each set in its
# scoped form (``scoped_env``), as a worker sets it.
NCCL_VARIANTS: tuple[tuple[tuple[str, str], ...], ...] = (
    (),
    (("NCCL_PROTO", "LL"),),
    (("NCCL_PROTO", "Simple"),),
    (("NCCL_ALGO", "Ring"),),
    (("NCCL_ALGO", "Tree"),),
)
# A table of every size 1..2048 for the eight backends takes ~2 MiB as `tune` writes it.
TABLE_MAX_BYTES = 16 << 20
MAX_ROWS = 1 << 16  # 2048 sizes x 8 backends is ~16k
# The note of a cell whose upstream communicator does not take that size (its own check said
# no): SGLang hands such an all-reduce to the next communicator in its order.
DECLINES = "declines this size: "
MAX_TOKENS = 1 << 20
MAX_HIDDEN = 1 << 20
MAX_TEXT = 1000  # a note: an exception's message, cut at 300 characters by `tune`


@dataclass(frozen=True)
class Measurement:
    """One backend at one token count: its time (None when it could not run) and whether its
    result matched the float32 reference."""

    backend: str
    tokens: int
    us: float | None
    correct: bool
    note: str = ""

    @classmethod
    def from_json(cls, data: Any, where: str) -> Measurement:
        """One cell as ``asdict`` writes it; FieldError naming the field for anything else."""
        data = fields(data, where, known=cls.__dataclass_fields__)
        return cls(
            backend=require(data, "backend", str, where, choices=BACKENDS),
            tokens=require(data, "tokens", int, where, minimum=1, maximum=MAX_TOKENS),
            us=require(data, "us", float, where, minimum=0, null=True),
            correct=require(data, "correct", bool, where),
            note=require(data, "note", str, where, limit=MAX_TEXT, default=""),
        )


NcclEnv = tuple[tuple[str, str], ...]  # sorted (NCCL_* name, value) pairs; () = NCCL's defaults


def variant_env(data: Any, where: str) -> NcclEnv:
    """A variant's NCCL_* settings read from JSON ({name: value}), each checked against what
    tune measures (``NCCL_VARIANT_CHOICES``, a channel count 1..MAX_NCHANNELS); FieldError
    naming the field for anything else."""
    data = fields(data, where, known=NCCL_VARIANT_KEYS)
    env = []
    for key in sorted(data):
        choices = NCCL_VARIANT_CHOICES.get(key)
        value = require(data, key, str, where, choices=choices, limit=8)
        # ASCII digits only: str.isdigit() and int() also take other scripts' digits ('٤')
        if choices is None and not (ascii_digits(value) and 1 <= int(value) <= MAX_NCHANNELS):
            raise FieldError(f"{where}.{key} must be a channel count 1..{MAX_NCHANNELS}")
        env.append((key, value))
    return tuple(env)


def scoped_env(env: NcclEnv) -> NcclEnv:
    """``env`` as a worker (and tune's ranks) set it: NCCL_PROTO / NCCL_ALGO for the all-reduce
    only (``allreduce:LL``); NCCL applies its own choice to every other collective."""
    return tuple((k, f"{SCOPE}:{v}" if k in SCOPED_KEYS else v) for k, v in env)


def variant_name(env: NcclEnv) -> str:
    """'NCCL_PROTO=LL', or 'default' for NCCL's own choice."""
    return " ".join(f"{k}={v}" for k, v in env) or "default"


@dataclass(frozen=True)
class VariantMeasurement:
    """NCCL's all-reduce (+ the same add+RMSNorm) under one set of NCCL_* variables at one token
    count: its CUDA-graph time (None when it failed, capture included: ``note`` says why) and
    whether its result matched the float32 reference."""

    env: NcclEnv
    tokens: int
    us: float | None
    correct: bool
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "env": dict(self.env)}

    @classmethod
    def from_json(cls, data: Any, where: str) -> VariantMeasurement:
        """One cell as ``to_json`` writes it; FieldError naming the field for anything else."""
        data = fields(data, where, known=cls.__dataclass_fields__)
        return cls(
            env=variant_env(require(data, "env", dict, where), f"{where}.env"),
            tokens=require(data, "tokens", int, where, minimum=1, maximum=MAX_TOKENS),
            us=require(data, "us", float, where, minimum=0, null=True),
            correct=require(data, "correct", bool, where),
            note=require(data, "note", str, where, limit=MAX_TEXT, default=""),
        )


@dataclass(frozen=True)
class TuningTable:
    fingerprint: dict[str, Any]
    tp: int
    hidden: int
    dtype: str
    measurements: tuple[Measurement, ...]
    created: str = ""
    ranks_share_gpu: bool = False
    version: int = TABLE_VERSION
    notes: tuple[str, ...] = field(default=())
    nccl_variants: tuple[VariantMeasurement, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)  # tuples as lists: what from_json reads, with or without a file
        data["measurements"] = [asdict(m) for m in self.measurements]
        data["notes"] = list(self.notes)
        data["nccl_variants"] = [v.to_json() for v in self.nccl_variants]
        data["fingerprint_id"] = fingerprint_id(self.fingerprint)
        return data

    @classmethod
    def from_json(cls, data: Any) -> TuningTable:
        """The inverse of ``to_json``: every field checked (``strict_json.require``), so a
        table that loads cannot fail later in the plan; FieldError naming the field."""
        data = fields(data, "", known=[*cls.__dataclass_fields__, "fingerprint_id"])
        rows = require(data, "measurements", list, limit=MAX_ROWS)
        variants = require(data, "nccl_variants", list, limit=MAX_ROWS, default=[])
        return cls(
            fingerprint=require(data, "fingerprint", dict),
            tp=require(data, "tp", int, minimum=1, maximum=MAX_TP_SIZE),
            hidden=require(data, "hidden", int, minimum=1, maximum=MAX_HIDDEN),
            dtype=require(data, "dtype", str, limit=40),
            measurements=tuple(
                Measurement.from_json(row, f"measurements[{i}]") for i, row in enumerate(rows)
            ),
            created=require(data, "created", str, limit=MAX_TEXT, default=""),
            ranks_share_gpu=require(data, "ranks_share_gpu", bool, default=False),
            version=require(data, "version", int, minimum=0, default=0),
            notes=tuple(require_list(data, "notes", str, max_items=MAX_ROWS, default=[])),
            nccl_variants=tuple(
                VariantMeasurement.from_json(row, f"nccl_variants[{i}]")
                for i, row in enumerate(variants)
            ),
        )


def table_path(fingerprint: dict[str, Any], tp: int, hidden: int, dtype: str) -> Path:
    name = f"allreduce-{fingerprint_id(fingerprint)}-tp{tp}-h{hidden}-{dtype}.json"
    return cache_dir() / name


def save_table(table: TuningTable) -> Path:
    path = table_path(table.fingerprint, table.tp, table.hidden, table.dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table.to_json(), indent=1))
    tmp.replace(path)
    return path


def load_table(
    facts: HostFacts, tp: int, hidden: int, dtype: str, gpu_ids: tuple[int, ...] | None = None
) -> tuple[TuningTable | None, str]:
    """The table for this host and shape, or None with the reason (missing, stale, unreadable).
    Never raises: a cache directory that cannot be read (not a directory, no permission) is
    named in the reason, and the server plans without a table."""
    fingerprint = host_fingerprint(facts, tp, gpu_ids)
    path = table_path(fingerprint, tp, hidden, dtype)
    directory = path.parent
    names, unreadable = list_cache(directory)
    if unreadable:
        return None, f"no tuning table: {unreadable}"
    if names is None or path.name not in names:
        others = fnmatch.filter(names or [], f"allreduce-*-tp{tp}-h{hidden}-{dtype}.json")
        if others:
            return None, f"tuning table stale: {len(others)} table(s) for other hosts or versions"
        unwritable = names is not None and not os.access(directory, os.W_OK | os.X_OK)
        where = f" ({cache_name(directory)} is not writable)" if unwritable else ""
        return None, f"no tuning table ({path.name}); run `sglang-sm120 tune --tp {tp}`{where}"
    try:
        table = TuningTable.from_json(read_json_file(path, TABLE_MAX_BYTES))
    except (ValueError, RecursionError) as exc:  # JsonInputError, FieldError: one line
        return None, f"tuning table {path} unreadable: {exc or type(exc).__name__}"
    if table.version not in READABLE_VERSIONS or table.fingerprint != fingerprint:
        return None, f"tuning table {path.name} stale: written for another host or version"
    if table.ranks_share_gpu:
        return None, f"tuning table {path.name} measured with ranks sharing one GPU: not used"
    return table, f"tuning table {path.name}"


# A size leaves the fused backend only by a clear margin: the table times the alternatives with
# a Triton add+RMSNorm, while a declined fused point runs the all-reduce, a residual copy and
# SGLang's own norm, which are not timed; and at verify sizes the candidates differ by less
# than run-to-run noise (2x H200: 0.1-0.6 us at 1-64 tokens).
UNFUSED_MIN_GAIN = (0.03, 0.5)  # at least 3% and 0.5 us faster


# Tuning-table routes served by sgl-kernel-sm120: its fused kernel, or its all-reduce followed
# by SGLang's own add + RMSNorm. They share its all-reduce: one measured wrong rules out both.
SM120_PCIE_ROUTES = ("sm120_pcie", "sm120_pcie_unfused")


def wrong_backends(table: TuningTable) -> set[str]:
    """Backends with a result that did not match the reference at any size. A wrong result is
    evidence against the kernel, not against one size: the same code path serves the sizes
    around it, so such a backend is not used at any size."""
    wrong = {m.backend for m in table.measurements if m.us is not None and not m.correct}
    if wrong & set(SM120_PCIE_ROUTES):
        wrong |= set(SM120_PCIE_ROUTES)
    return wrong


def correct_times(table: TuningTable) -> dict[tuple[str, int], float]:
    """(backend, tokens) -> microseconds, for every cell that ran, matched the reference and
    took a positive, finite time, of a backend never measured wrong (``wrong_backends``)."""
    wrong = wrong_backends(table)
    return {
        (m.backend, m.tokens): m.us
        for m in table.measurements
        if m.correct and m.backend not in wrong and m.us is not None and 0 < m.us < math.inf
    }


def winners(
    table: TuningTable,
    allowed: Collection[str] | Callable[[int], Collection[str]] | None = None,
    *,
    prefer: str | None,
) -> dict[int, str]:
    """Per measured token count, the fastest backend whose result was correct, among
    ``allowed`` (default: all; a function of the token count where what a server can run
    depends on the size, as upstream's communicators each take some sizes). The fused backend
    ``prefer`` keeps a size unless another backend beats it by UNFUSED_MIN_GAIN (None: plain
    fastest). A token count where no allowed backend ran correctly is left out."""
    best: dict[int, tuple[str, float]] = {}
    preferred: dict[int, float] = {}
    for (backend, tokens), us in correct_times(table).items():
        ok = allowed(tokens) if callable(allowed) else allowed
        if ok is not None and backend not in ok:
            continue
        if backend == prefer:
            preferred[tokens] = us
        if tokens not in best or us < best[tokens][1]:
            best[tokens] = (backend, us)
    routes = {}
    for tokens in sorted(best):
        backend, us = best[tokens]
        if backend != prefer and tokens in preferred:
            gain = preferred[tokens] - us
            ratio, absolute = UNFUSED_MIN_GAIN
            if gain < ratio * preferred[tokens] or gain < absolute:
                backend = prefer
        routes[tokens] = backend
    return routes


def size_ranges(sizes: Iterable[int]) -> str:
    """'1-64, 128, 256-300': token counts, consecutive ones as a range, so that a table of
    every size from 1 to 2048 is named in a few characters, not 2048 numbers."""
    runs: list[list[int]] = []
    for size in sorted(set(sizes)):
        if runs and size == runs[-1][1] + 1:
            runs[-1][1] = size
        else:
            runs.append([size, size])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def excluded(table: TuningTable) -> list[str]:
    """Backends measured wrong on this host, with where: they are never chosen, at any size
    (``wrong_backends``)."""
    wrong_at: dict[str, list[int]] = {}
    for m in table.measurements:
        if m.us is not None and not m.correct:
            wrong_at.setdefault(m.backend, []).append(m.tokens)
    return [
        f"{backend} (wrong at {size_ranges(sizes)} tokens)"
        for backend, sizes in sorted(wrong_at.items())
    ]
