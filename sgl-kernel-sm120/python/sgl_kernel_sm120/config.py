"""Sizing and tuning rules: pure functions, no GPU needed.

Everything a rank derives here must come out identical on every rank (the kernels of one call
must agree on variant and grid), so it depends only on the message size and on workspace
settings that `CommWorkspace.create` checks to be equal across ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from . import _lib, env

ENV_ONESHOT_MAX_BYTES = env.ONESHOT_MAX_BYTES
ENV_TWOSHOT_LAMPORT_MAX_BYTES = env.TWOSHOT_LAMPORT_MAX_BYTES
ENV_BLOCK_BYTES = env.BLOCK_BYTES
ENV_MAX_BLOCKS = env.MAX_BLOCKS
ENV_TIMEOUT_MS = env.TIMEOUT_MS
ENV_FUSED_ROWS_PER_BLOCK = env.FUSED_ROWS_PER_BLOCK
ENV_PDL = env.PDL
SWITCH_ON = ("1", "true", "yes", "y", "on")
SWITCH_OFF = ("0", "false", "no", "n", "off")

MIN_WORLD_SIZE = 2
MAX_WORLD_SIZE = _lib.MAX_RANKS
MAX_HIDDEN = 16384
MAX_TOKENS = 2048
ELEMENT_BYTES = 2  # bf16 / fp16
VECTOR_BYTES = 16  # the kernels move 16-byte vectors: sizes must be multiples of 8 elements
DEFAULT_TIMEOUT_MS = 5000
# The kernels compare against timeout_ms x 10^6 in a 64-bit nanosecond word: a value past
# ~1.8e13 ms wraps (18446744073710 would become 0.45 ms). An hour is far beyond any wait a
# working peer needs and far inside the word.
MAX_TIMEOUT_MS = 3_600_000
DEFAULT_BLOCK_BYTES = 4096
# The largest message a workspace carries (MAX_TOKENS x MAX_HIDDEN bf16/fp16 elements): a
# one-shot threshold or a block size past it changes nothing (every message is one-shot, one
# block), so SGLANG_SM120_ONESHOT_MAX_BYTES and SGLANG_SM120_BLOCK_BYTES are bounded by it.
MAX_MESSAGE_BYTES = MAX_TOKENS * MAX_HIDDEN * ELEMENT_BYTES  # 64 MiB
# Up to one block per SM (capped by what the GPU holds): a one-shot push scales with the SMs
# that push (2x H200, 256 tokens: 20.6 us at 64 blocks, 17.2 at 128). Measured over NVLink only.
DEFAULT_MAX_BLOCKS = 128
MAX_BLOCKS = _lib.MAX_BLOCKS  # the grid the kernels' flags are laid out for
# When no bound is set, a fused call splits into two launches (all-reduce, then add + RMSNorm)
# only when it is one-shot and a block would own more than ONESHOT_FUSED_ROWS_PER_BLOCK rows.
# 1x H200, ranks as streams, hidden 7168 (benchmark/results/1xH200-2026-12-03-issue35): one
# launch won wherever the two-shot epilogue normalises three rows per pass (world 2, 1024-2048
# tokens: 0.91-0.93x the split; worlds 4 and 8, 32-2048 tokens: 0.76-0.93x) and for one-shot
# blocks of two rows (world 2, 128 tokens: 11.4 us against 12.3); one-shot blocks of four rows
# (256 tokens) still ran faster split (22.0 against 24.1), their epilogue takes one row at a time.
ONESHOT_FUSED_ROWS_PER_BLOCK = 2
# A call has at most MAX_TOKENS rows: a bound past it never splits either.
MAX_FUSED_ROWS_PER_BLOCK = MAX_TOKENS

CONTROL_OFFSET = _lib.FLAG_WORDS * _lib.FLAG_BYTES  # 32 KiB of flags, then control and call state
LAMPORT_OFFSET = 40960  # the buffers start 40 KiB in
REGION_ALIGN = 256
assert CONTROL_OFFSET + _lib.CONTROL_WORDS * 4 <= LAMPORT_OFFSET, "control words overlap buffers"


def default_oneshot_max_bytes(world_size: int) -> int:
    """Largest message sent one-shot by default (untuned seed; override per host).

    One-shot sends (N-1) x S per rank in one round; two-shot sends 2 (N-1)/N x S in two
    rounds. At N = 2 the traffic is equal, so one-shot always wins; at larger N the extra
    round (a PCIe flag round trip, ~2 us) pays off once one-shot's extra bytes take longer.
    """
    if world_size <= 2:
        return 4 << 20
    return (256 << 10) // world_size // VECTOR_BYTES * VECTOR_BYTES


VARIANT_NAMES = {
    _lib.VARIANT_ONESHOT: "oneshot",
    _lib.VARIANT_TWOSHOT: "twoshot",
    _lib.VARIANT_TWOSHOT_LAMPORT: "twoshot_lamport",
}


def default_twoshot_lamport_max_bytes(world_size: int) -> int:
    """Largest message the Lamport two-shot takes by default (above the one-shot, which at 2
    ranks covers these sizes; the two-shot with flags above it). Its buffers hold 3 x N slots
    of two chunks: up to 6 x this many bytes per GPU. 1x H100, ranks as streams, hidden 7168
    (benchmark/results/1xH100-2026-12-07c-issue35): against the two-shot with flags it took the
    all-reduce from 11.1-12.4 to 5.3-8.5 us at 4 ranks, 8-64 tokens (up to 896 KiB), and from
    15.7-16.5 to 7.2-10.9 at 8 ranks, 4-32 tokens (up to 448 KiB); at 8 ranks and 64 tokens it
    lost (21.0 against 19.7): there each rank clears 1.53 MiB of its buffers a call, 12.25 MiB
    for the 8 ranks on the one GPU, where one GPU per rank clears its own. So 1 MiB up to 4
    ranks, 512 KiB at 5-8."""
    return (1 << 20) if world_size <= 4 else (512 << 10)


def twoshot_lamport_fits(nbytes: int, world_size: int, lamport_slot_bytes: int) -> bool:
    """Whether a message can run the Lamport two-shot (sk_launch's rule, kept in step with it):
    every rank's chunk is non-empty (each peer must wait for data of every rank in every call,
    or the buffer rotation is unsafe) and a Lamport slot holds two chunks."""
    nvec = nbytes // VECTOR_BYTES
    chunk = math.ceil(nvec / world_size)
    return (world_size - 1) * chunk < nvec and 2 * chunk * VECTOR_BYTES <= lamport_slot_bytes


def env_int(name: str, maximum: int | None = None) -> int | None:
    """Positive integer from variable `name` (or its deprecated spelling, see env.py), at most
    `maximum`; None when unset; ValueError naming the variable when it is not one."""
    raw = env.get(name)
    if raw is None:
        return None
    try:
        if not raw.isascii():  # int() reads other scripts' digits ('٨' is 8); C readers do not
            raise ValueError(raw)
        value = int(raw, 0)
    except ValueError:  # also past Python's 4300 digits
        raise ValueError(f"${name}={raw[:40]!r} is not an integer") from None
    if value <= 0:
        raise ValueError(f"${name}={raw[:40]!r} must be positive")
    if maximum is not None and value > maximum:
        raise ValueError(f"${name}={raw[:40]!r} is above the bound {maximum}")
    return value


def env_timeout_ms() -> int | None:
    """SGLANG_SM120_TIMEOUT_MS: 1..MAX_TIMEOUT_MS (one hour), None when unset; ValueError
    naming the variable and the bound otherwise."""
    return env_int(ENV_TIMEOUT_MS, maximum=MAX_TIMEOUT_MS)


def env_switch(name: str) -> bool | None:
    """Variable `name` as a switch: one of SWITCH_ON -> True, SWITCH_OFF -> False (any case,
    spaces around ignored), None when unset; ValueError naming the variable otherwise."""
    raw = env.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in SWITCH_ON:
        return True
    if value in SWITCH_OFF:
        return False
    raise ValueError(
        f"${name}={raw[:40]!r} is not a switch ({'/'.join(SWITCH_ON)} or {'/'.join(SWITCH_OFF)})"
    )


def resolve_early_launch(argument: bool | None = None) -> bool:
    """Programmatic dependent launch: the argument, else $SGLANG_SM120_PDL, else on."""
    if argument is not None:
        return bool(argument)
    return env_switch(ENV_PDL) is not False


def check_timeout_ms(timeout_ms: int) -> int:
    if not 1 <= timeout_ms <= MAX_TIMEOUT_MS:
        raise ValueError(f"timeout_ms={timeout_ms} must be in [1, {MAX_TIMEOUT_MS}] (one hour)")
    return timeout_ms


@dataclass(frozen=True)
class Tuning:
    """Settings every rank must share (checked at workspace creation)."""

    oneshot_max_bytes: int
    block_bytes: int
    max_blocks: int
    timeout_ms: int
    # Two-shot messages up to this size run the Lamport two-shot (none where it is at most
    # oneshot_max_bytes, as in a Tuning built by hand: resolve_tuning sets the default).
    twoshot_lamport_max_bytes: int = 0
    fused_rows_per_block: int | None = None  # None: the measured default (split_fused)
    # (k, most blocks a row-split grid of k blocks per row may have), for each k in
    # ROW_SPLIT_SIZES (row_split_caps); empty in a Tuning built by hand.
    row_split_blocks: tuple[tuple[int, int], ...] = ()
    # Programmatic dependent launch (the kernels' early_launch): each kernel may be launched
    # while the one before it in the stream finishes. Off only where asked ($SGLANG_SM120_PDL=0):
    # the kernels are written for it (all_reduce.cu, wait_for_previous_kernel), and ranks need
    # not agree on it.
    early_launch: bool = True

    def row_split_pairs(self) -> tuple[tuple[int, int], ...]:
        """row_split_blocks, or for a Tuning built by hand (no caps) the grid bounds alone."""
        return self.row_split_blocks or row_split_caps(self.max_blocks, None, 1)

    def row_split_cap(self, per_row: int) -> int:
        """Most blocks a grid of `per_row` blocks per row may have (0: never split so)."""
        return dict(self.row_split_pairs()).get(per_row, 0)


def resolve_tuning(
    world_size: int,
    *,
    oneshot_max_bytes: int | None = None,
    block_bytes: int | None = None,
    max_blocks: int | None = None,
    timeout_ms: int | None = None,
    fused_rows_per_block: int | None = None,
    twoshot_lamport_max_bytes: int | None = None,
    resident_blocks: int | None = None,
    resident_clusters: Mapping[int, int] | None = None,
    ranks_per_gpu: int = 1,
    early_launch: bool | None = None,
) -> Tuning:
    """Explicit argument > environment variable > default, for each setting.

    The default block cap keeps every rank's grid resident at once when `ranks_per_gpu` ranks
    share one GPU (`resident_blocks` is what one GPU holds): the kernels spin on their peers,
    so a rank whose blocks cannot be scheduled would stall everyone until the timeout.
    `resident_clusters` (cluster size -> clusters the GPU holds at once) bounds the row split
    the same way (row_split_caps), in place of the default cap.
    """
    check_world_size(world_size)
    oneshot, lamport = resolve_lamport_bounds(
        world_size, oneshot_max_bytes, twoshot_lamport_max_bytes
    )
    block = _setting("block_bytes", block_bytes, MAX_MESSAGE_BYTES) or DEFAULT_BLOCK_BYTES
    requested_blocks = blocks = _setting("max_blocks", max_blocks, MAX_BLOCKS)
    if blocks is None:
        blocks = DEFAULT_MAX_BLOCKS
        if resident_blocks is not None:
            blocks = min(blocks, resident_blocks // max(1, ranks_per_gpu))
    if blocks < 1:
        raise ValueError(
            f"max_blocks={blocks} must be in [1, {MAX_BLOCKS}]"
            + (
                f" (the GPU holds {resident_blocks} blocks for {ranks_per_gpu} ranks)"
                if resident_blocks is not None
                else ""
            )
        )
    if resident_blocks is not None and blocks * ranks_per_gpu > resident_blocks:
        raise ValueError(
            f"max_blocks={blocks} x {ranks_per_gpu} ranks on one GPU exceeds the "
            f"{resident_blocks} blocks it can hold at once: the spinning kernels would deadlock"
        )
    timeout = check_timeout_ms(timeout_ms or env_timeout_ms() or DEFAULT_TIMEOUT_MS)
    rows_per_block = _setting(
        "fused_rows_per_block", fused_rows_per_block, MAX_FUSED_ROWS_PER_BLOCK
    )
    # The row split's 256-thread blocks fit two an SM: where the clusters that fit at once are
    # known, they bound its grid (row_split_caps), not the default cap, which is what fits of
    # the other kernels' 512-thread blocks. A cap the user set holds for every grid.
    row_grid = blocks
    if requested_blocks is None and resident_clusters is not None:
        row_grid = DEFAULT_MAX_BLOCKS
    return Tuning(
        oneshot_max_bytes=oneshot,
        twoshot_lamport_max_bytes=lamport,
        block_bytes=_round_up(block, VECTOR_BYTES),
        max_blocks=blocks,
        timeout_ms=timeout,
        fused_rows_per_block=rows_per_block,
        row_split_blocks=row_split_caps(row_grid, resident_clusters, ranks_per_gpu),
        early_launch=resolve_early_launch(early_launch),
    )


def resolve_lamport_bounds(
    world_size: int, oneshot_max_bytes: int | None, twoshot_lamport_max_bytes: int | None
) -> tuple[int, int]:
    """(one-shot bound, Lamport two-shot bound), each the argument, else its variable, else
    the default, in whole vectors: what sizes a workspace's Lamport slots (workspace_layout),
    so a size estimate reads them as the workspace does."""
    oneshot = _setting("oneshot_max_bytes", oneshot_max_bytes, MAX_MESSAGE_BYTES)
    oneshot = oneshot or default_oneshot_max_bytes(world_size)
    lamport = _setting("twoshot_lamport_max_bytes", twoshot_lamport_max_bytes, MAX_MESSAGE_BYTES)
    lamport = lamport or default_twoshot_lamport_max_bytes(world_size)
    return _round_up(oneshot, VECTOR_BYTES), _round_up(lamport, VECTOR_BYTES)


ENV_OF_SETTING = {
    "oneshot_max_bytes": ENV_ONESHOT_MAX_BYTES,
    "block_bytes": ENV_BLOCK_BYTES,
    "max_blocks": ENV_MAX_BLOCKS,
    "fused_rows_per_block": ENV_FUSED_ROWS_PER_BLOCK,
    "twoshot_lamport_max_bytes": ENV_TWOSHOT_LAMPORT_MAX_BYTES,
}


def _setting(name: str, argument: int | None, maximum: int) -> int | None:
    """An explicit argument, else its variable (``ENV_OF_SETTING``), else None; either one
    past ``maximum`` is refused with the bound named."""
    if not argument:
        return env_int(ENV_OF_SETTING[name], maximum=maximum)
    if not 1 <= argument <= maximum:
        raise ValueError(f"{name}={argument} must be in [1, {maximum}]")
    return argument


def check_world_size(world_size: int) -> None:
    if not MIN_WORLD_SIZE <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(
            f"world_size={world_size} is not supported: the kernels handle "
            f"{MIN_WORLD_SIZE} to {MAX_WORLD_SIZE} ranks"
        )


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class WorkspaceLayout:
    """Byte layout of one rank's buffer (identical on every rank).

    [flags 32 KiB][control][pad to 40 KiB][Lamport: 3 buffers x world x lamport_slot]
    [two-shot push: 2 parities x world x slot][gather: max_bytes]
    """

    world_size: int
    max_bytes: int
    lamport_slot_bytes: int
    slot_bytes: int
    lamport_offset: int
    push_offset: int
    gather_offset: int
    total_bytes: int


def workspace_layout(
    world_size: int, max_bytes: int, oneshot_max_bytes: int, twoshot_lamport_max_bytes: int = 0
) -> WorkspaceLayout:
    """Buffer sizes for messages up to `max_bytes`.

    A Lamport slot holds a whole one-shot message, min(O, S), and, where Lamport two-shot
    messages exist (T > O), two chunks of the largest, 2 ceil(min(T, S) / N): L is the larger
    of the two. Three rotating buffers of N slots each (each is cleared one call after it was
    read). A two-shot slot holds one rank's reduce-scatter chunk (C = ceil(S / N)), two parities
    of N slots. Total per GPU: 40 KiB + 3 N L + 2 N C + S (about 40 KiB + 3 N L + 3 S).
    """
    check_world_size(world_size)
    if max_bytes <= 0 or max_bytes % VECTOR_BYTES:
        raise ValueError(f"max_bytes={max_bytes} must be a positive multiple of {VECTOR_BYTES}")
    chunk_bytes = math.ceil(max_bytes / VECTOR_BYTES / world_size) * VECTOR_BYTES
    lamport_slot = min(oneshot_max_bytes, max_bytes)
    if twoshot_lamport_max_bytes > oneshot_max_bytes:
        lamport_chunk = math.ceil(
            min(twoshot_lamport_max_bytes, max_bytes) / VECTOR_BYTES / world_size
        )
        lamport_slot = max(lamport_slot, 2 * lamport_chunk * VECTOR_BYTES)
    lamport_slot = _round_up(lamport_slot, REGION_ALIGN)
    slot = _round_up(chunk_bytes, REGION_ALIGN)
    push_offset = LAMPORT_OFFSET + _lib.LAMPORT_BUFFERS * world_size * lamport_slot
    gather_offset = push_offset + 2 * world_size * slot
    total = gather_offset + _round_up(max_bytes, REGION_ALIGN)
    return WorkspaceLayout(
        world_size,
        max_bytes,
        lamport_slot,
        slot,
        LAMPORT_OFFSET,
        push_offset,
        gather_offset,
        total,
    )


def workspace_bytes(
    world_size: int,
    max_tokens: int,
    hidden: int,
    element_bytes: int = ELEMENT_BYTES,
    oneshot_max_bytes: int | None = None,
    twoshot_lamport_max_bytes: int | None = None,
) -> int:
    """Bytes each GPU allocates for a workspace sized max_tokens x hidden, with the bounds it
    would resolve (resolve_lamport_bounds: the environment included)."""
    oneshot, lamport = resolve_lamport_bounds(
        world_size, oneshot_max_bytes, twoshot_lamport_max_bytes
    )
    max_bytes = max_tokens * hidden * element_bytes
    return workspace_layout(world_size, max_bytes, oneshot, lamport).total_bytes


def choose_variant(nbytes: int, tuning: Tuning, layout: WorkspaceLayout) -> int:
    """One-shot up to oneshot_max_bytes; above, the Lamport two-shot up to
    twoshot_lamport_max_bytes where the message fits it in this workspace
    (twoshot_lamport_fits), else the two-shot with flags."""
    if nbytes <= tuning.oneshot_max_bytes:
        return _lib.VARIANT_ONESHOT
    if nbytes <= tuning.twoshot_lamport_max_bytes and twoshot_lamport_fits(
        nbytes, layout.world_size, layout.lamport_slot_bytes
    ):
        return _lib.VARIANT_TWOSHOT_LAMPORT
    return _lib.VARIANT_TWOSHOT


def split_fused(rows: int, blocks: int, tuning: Tuning, variant: int) -> bool:
    """Whether a fused call runs as two launches (all-reduce, then add + RMSNorm with one block
    per row): when a block of the all-reduce grid would own more than `fused_rows_per_block`
    rows, or, with no bound set, when a Lamport (one-shot or two-shot) block would own more
    than ONESHOT_FUSED_ROWS_PER_BLOCK (their epilogue takes one row at a time; the two-shot
    epilogue takes several rows per pass and is never split by default)."""
    bound = tuning.fused_rows_per_block
    if bound is None:
        if variant == _lib.VARIANT_TWOSHOT:
            return False
        bound = ONESHOT_FUSED_ROWS_PER_BLOCK
    return math.ceil(rows / blocks) > bound


def twoshot_row_pieces(
    rows: int, hidden: int, world_size: int, blocks: int, slot_bytes: int
) -> bool:
    """Whether a two-shot fused call runs in whole-row pieces (sk_launch's rule, kept in step
    with it): a rank's chunk has at least as many rows as there are blocks, and a chunk of
    whole rows fits a push slot. Each block's piece is then ceil(chunk rows / blocks) whole
    rows (the last blocks' pieces may be short or empty), and block b normalises the rows block
    b of each rank reduced, after waiting for those blocks alone (else for every block of
    every rank)."""
    chunk_rows = math.ceil(rows / world_size)
    return chunk_rows >= blocks and chunk_rows * hidden * ELEMENT_BYTES <= slot_bytes


def fused_variant(
    rows: int, hidden: int, variant: int, blocks: int, tuning: Tuning, layout: WorkspaceLayout
) -> int:
    """The variant of a fused call whose variant was left to the size (choose_variant): the
    two-shot with flags where a Lamport call (one-shot or two-shot) would split into two
    launches (split_fused, and no row split takes it in one: row_blocks), one launch instead of
    an all-reduce and a norm launch that reads the sum again; from the one-shot only where the
    two-shot call takes whole-row pieces. 1x H200, ranks as streams, world 2, 256 tokens x 7168
    (66 blocks): 18.6-18.9 us against 23.1 split (all-reduce + separate norm: 22.2-22.3). A
    fused_rows_per_block bound the user set keeps the split as it asks."""
    if (
        variant != _lib.VARIANT_TWOSHOT
        and tuning.fused_rows_per_block is None
        and split_fused(rows, blocks, tuning, variant)
        and row_blocks(rows, hidden, variant, tuning) == 1
        and (
            variant == _lib.VARIANT_TWOSHOT_LAMPORT
            or twoshot_row_pieces(rows, hidden, layout.world_size, blocks, layout.slot_bytes)
        )
    ):
        return _lib.VARIANT_TWOSHOT
    return variant


MAX_ROW_BLOCKS = 8  # SK_MAX_ROW_BLOCKS: the portable cluster size
ROW_SPLIT_SIZES = (2, 4, 8)  # the blocks per row row_blocks chooses from (powers of two)
ROW_SLICE_VECTORS = 256  # a row slice of at least this many 16-byte vectors per block
MAX_ROW_SLICE_VECTORS = 512  # and at most this many (the kernel's 256 threads x 2 in registers)
# 1x H200, ranks as streams, world 2, hidden 7168: split rows won up to 64 blocks (32 tokens
# in 2 slices: 4.8 us against 6.2 with a block per row), where the clusters fit at once. That
# was with 512-thread blocks; in 256-thread blocks 32 tokens in 2 slices took 5.3 us (1x
# H100). A cap of 128 changed no measured plan there, two ranks on one GPU: the grid cap (66,
# which bounded the row split then) and the clusters of 4 that fit (31 a rank) bound it first
# (benchmark/results/1xH100-2026-12-07b-issue35); the clusters alone still would (124 blocks).
# On one GPU per rank it would allow 32 tokens in 4 slices, which is unmeasured.
MAX_ROW_SPLIT_BLOCKS = 64


def row_split_caps(
    max_blocks: int, resident_clusters: Mapping[int, int] | None, ranks_per_gpu: int
) -> tuple[tuple[int, int], ...]:
    """For each k in ROW_SPLIT_SIZES, (k, the most blocks a row-split grid of k blocks per row
    may have): the grid cap, MAX_ROW_SPLIT_BLOCKS and, where the GPU's cluster occupancy is
    known, what fits at once beside the other ranks' grids on that GPU. A cluster is placed
    whole on one GPC, so fewer blocks fit in clusters than blocks per SM x SMs; blocks that wait
    for a peer's blocks that cannot be scheduled stall the call (1x H200, world 2, 16 tokens
    in 4 slices: 7.6 us against 4.8 in 2)."""
    caps = []
    for k in ROW_SPLIT_SIZES:
        cap = min(max_blocks, MAX_ROW_SPLIT_BLOCKS)
        if resident_clusters is not None:
            cap = min(cap, resident_clusters.get(k, 0) // max(1, ranks_per_gpu) * k)
        caps.append((k, cap))
    return tuple(caps)


def row_blocks(rows: int, hidden: int, variant: int, tuning: Tuning) -> int:
    """Blocks per row of a fused Lamport call, one-shot or two-shot (one thread-block cluster
    per row), 1 for the one-block-per-row epilogue.

    One block reducing a whole row is what made the fused call ~2 us slower than the plain
    all-reduce at 1-16 tokens (1x H200, ranks as streams): the plain one spreads the same
    vectors over the grid. A row is split into slices of at least ROW_SLICE_VECTORS vectors
    (hidden 7168: 4 blocks of 224), in a power of two of them, halved where rows x slices
    would pass the grid cap for that cluster size (Tuning.row_split_blocks), none where even
    2 would. Powers of two only: 1x H200, world 2, 16 tokens in 3 slices of 299 vectors took
    5.3 us, in 2 slices of 448 4.8 (two device calls), with the clusters of 3 fitting.
    """
    if variant == _lib.VARIANT_TWOSHOT:
        return 1
    row_vecs = hidden * ELEMENT_BYTES // VECTOR_BYTES
    wanted = math.ceil(row_vecs / ROW_SLICE_VECTORS)
    for per_row, cap in reversed(tuning.row_split_pairs()):  # one walk: this runs per call
        fits = row_vecs <= per_row * MAX_ROW_SLICE_VECTORS
        if per_row <= wanted and rows * per_row <= cap and fits:
            return per_row
    return 1


def choose_blocks(nbytes: int, tuning: Tuning) -> int:
    """Grid size: one block per block_bytes of message, capped at max_blocks."""
    return max(1, min(tuning.max_blocks, math.ceil(nbytes / tuning.block_bytes)))
