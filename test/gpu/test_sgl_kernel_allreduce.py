"""sgl_kernel_sm120 ops against a float32 reference, ranks emulated in one process.

N ranks live in this process on one GPU, one stream each, sharing buffer pointers directly:
a synchronisation round costs ~1 us there (against ~2.4 ms between processes time-slicing one
GPU), which makes the heavy cases affordable (all sizes, 1000 graph replays). The CUDA-IPC
exchange itself is covered by test_sgl_kernel_multiprocess.py.

CUDA_MODULE_LOADING=EAGER is set before CUDA starts: with lazy loading, the first launch of any
kernel loads its module, which waits for the running kernels, i.e. for a rank's spinning kernel
whose peer this very thread has not launched yet (deadlock until the timeout).
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

try:
    import sgl_kernel_sm120 as sk
except ImportError:  # not installed: use the sources (the library then comes from the env var)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sgl-kernel-sm120" / "python"))
    import sgl_kernel_sm120 as sk

from sgl_kernel_sm120 import _lib, config
from sgl_kernel_sm120.testing import (
    TOLERANCES,
    LocalRanks,
    max_violation,
    rank_inputs,
    reference_all_reduce,
    reference_fused,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("kernel_library_loaded"),
]

WORLD_SIZES = [2, 4, 8]
TOKENS = [1, 2, 3, 8, 16, 64, 127, 256, 512, 1024, 2048]
HIDDENS = [2048, 4096, 7168]
MAX_TOKENS = 2048
EPS = 1e-6
VARIANTS = ["oneshot", "twoshot", "twoshot_lamport"]
VARIANT_CODES = {
    "oneshot": _lib.VARIANT_ONESHOT,
    "twoshot": _lib.VARIANT_TWOSHOT,
    "twoshot_lamport": _lib.VARIANT_TWOSHOT_LAMPORT,
}


def _make_ranks(world_size: int, max_tokens: int = MAX_TOKENS, hidden: int = 7168, **kw):
    return LocalRanks(sk.CommWorkspace.create_local(world_size, max_tokens, hidden, **kw))


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"world{n}")
def forced_ranks(request):
    """Workspaces whose push slots hold a whole max-size message, so that either variant can
    be forced at every size."""
    ranks = _make_ranks(request.param, oneshot_max_bytes=MAX_TOKENS * 7168 * 2)
    yield ranks
    ranks.close()


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    rtol, atol = TOLERANCES[actual.dtype]
    violation = max_violation(actual, expected, rtol).item()
    assert violation <= atol, f"{what}: max(|err| - {rtol}|ref|) = {violation:.4g} > {atol}"


def _assert_identical(outs: list[torch.Tensor], what: str) -> None:
    for rank, out in enumerate(outs[1:], start=1):
        assert torch.equal(out, outs[0]), f"{what}: rank {rank} differs from rank 0"


def _check_plain(ranks: LocalRanks, xs, outs, what: str) -> None:
    ranks.check_errors()
    expected = reference_all_reduce(xs)
    for rank, out in enumerate(outs):
        _assert_close(out, expected, f"{what} rank {rank}")
    _assert_identical(outs, what)


def _check_fused(ranks: LocalRanks, xs, residual, weight, outs, what: str) -> None:
    ranks.check_errors()
    norm_ref, residual_ref = reference_fused(xs, residual, weight, EPS)
    for rank, (norm, res) in enumerate(outs):
        _assert_close(res, residual_ref, f"{what} residual_out rank {rank}")
        _assert_close(norm, norm_ref, f"{what} norm_out rank {rank}")
    _assert_identical([n for n, _ in outs], what + " norm_out")
    _assert_identical([r for _, r in outs], what + " residual_out")


def _fused_matches_reference(
    ranks: LocalRanks, tokens: int, hidden: int, variant: str | None, seed: int, what: str
) -> None:
    """One fused call of `variant` on every rank, checked against the fp32 reference."""
    xs, residual, weight = rank_inputs(ranks.world_size, tokens, hidden, seed=seed)
    outs = ranks.run(
        lambda r, ws: sk.fused_allreduce_add_rmsnorm(
            xs[r], residual, weight, EPS, ws, variant=variant
        )
    )
    _check_fused(ranks, xs, residual, weight, outs, what)


@pytest.mark.parametrize("variant", VARIANTS)
def test_all_reduce_matches_fp32_reference_at_all_sizes(forced_ranks, variant):
    n = forced_ranks.world_size
    for tokens in TOKENS:
        for hidden in HIDDENS:
            xs, _, _ = rank_inputs(n, tokens, hidden, seed=tokens * 7 + hidden)
            outs = forced_ranks.run(lambda r, ws, xs=xs: sk.all_reduce(xs[r], ws, variant=variant))
            _check_plain(forced_ranks, xs, outs, f"world {n} {variant} {tokens}x{hidden}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_matches_fp32_reference_at_all_sizes(forced_ranks, variant):
    n = forced_ranks.world_size
    for tokens in TOKENS:
        for hidden in HIDDENS:
            xs, residual, weight = rank_inputs(
                n, tokens, hidden, torch.bfloat16, seed=tokens + hidden
            )
            outs = forced_ranks.run(
                lambda r, ws, xs=xs, res=residual, w=weight: sk.fused_allreduce_add_rmsnorm(
                    xs[r], res, w, EPS, ws, variant=variant
                )
            )
            _check_fused(
                forced_ranks, xs, residual, weight, outs, f"world {n} {variant} {tokens}x{hidden}"
            )


@pytest.mark.parametrize("world_size", [2, 8])
@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_split_into_all_reduce_and_norm_launches_matches_reference(world_size, variant):
    """fused_rows_per_block=1: every fused call with more rows than blocks runs as the
    all-reduce, then the add + RMSNorm launch with one block per row."""
    ranks = _make_ranks(
        world_size, max_tokens=512, oneshot_max_bytes=512 * 7168 * 2, fused_rows_per_block=1
    )
    code = VARIANT_CODES
    try:
        for tokens in (1, 3, 64, 300, 512):
            nbytes = tokens * 7168 * 2
            blocks = ranks.workspaces[0].plan(nbytes)[1]
            split = sk.split_fused(tokens, blocks, ranks.workspaces[0].tuning, code[variant])
            assert split == (tokens > blocks)
            xs, residual, weight = rank_inputs(
                world_size, tokens, 7168, torch.bfloat16, seed=tokens
            )
            outs = ranks.run(
                lambda r, ws, xs=xs, res=residual, w=weight: sk.fused_allreduce_add_rmsnorm(
                    xs[r], res, w, EPS, ws, variant=variant
                )
            )
            _check_fused(ranks, xs, residual, weight, outs, f"split {variant} {tokens}")
    finally:
        ranks.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("hidden", [2048, 7168])
def test_two_shot_fused_with_whole_row_pieces_matches_reference(world_size, hidden):
    """With at least as many rows in a chunk as blocks (4 here), a two-shot fused call
    reduces whole rows in each block and normalises them after waiting for that block index
    alone. Row counts not divisible by the world size or the blocks, a last chunk shorter than
    the others, and blocks whose piece is partly or wholly past the chunk's end included."""
    ranks = _make_ranks(world_size, max_tokens=256, hidden=hidden, max_blocks=4)
    try:
        for tokens in (4 * world_size + 1, 8 * world_size - 1, 100, 255):
            _, blocks = ranks.workspaces[0].plan(tokens * hidden * 2, _lib.VARIANT_TWOSHOT)
            assert blocks == 4 and -(-tokens // world_size) >= blocks
            what = f"whole-row pieces {hidden} {tokens}"
            _fused_matches_reference(ranks, tokens, hidden, "twoshot", seed=tokens, what=what)
    finally:
        ranks.close()


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("hidden", [8192, 8200, 16384])
def test_two_shot_epilogue_taking_several_rows_per_pass_matches_reference(world_size, hidden):
    """Two-shot fused calls with more rows than blocks run in one launch (the default), the
    epilogue taking three rows per pass up to hidden 8192 and two past it; row counts that
    leave a pass partly empty included."""
    ranks = _make_ranks(world_size, max_tokens=300, hidden=hidden, max_blocks=16)
    try:
        for tokens in (17, 48, 100, 300):
            nbytes = tokens * hidden * 2
            variant, blocks = ranks.workspaces[0].plan(nbytes, _lib.VARIANT_TWOSHOT)
            assert tokens > blocks and not sk.split_fused(
                tokens, blocks, ranks.workspaces[0].tuning, variant
            )
            what = f"rows per pass {hidden} {tokens}"
            _fused_matches_reference(ranks, tokens, hidden, "twoshot", seed=hidden, what=what)
    finally:
        ranks.close()


@pytest.mark.parametrize("op", ["plain", "fused"])
def test_inputs_holding_the_not_arrived_pattern_still_arrive(op):
    """One-shot buffers start as 0xFFFF lanes ("not arrived"); an input lane with that bit
    pattern (a bf16 NaN) is sent as another NaN, so the call completes instead of timing out."""
    world_size, tokens, hidden = 4, 4, 2048
    ranks = _make_ranks(world_size, max_tokens=tokens, hidden=hidden, timeout_ms=2000)
    try:
        xs, residual, weight = rank_inputs(world_size, tokens, hidden, seed=9)
        xs[1].view(torch.int16)[2, 100] = -1  # 0xFFFF
        if op == "plain":
            outs = ranks.run(lambda r, ws: sk.all_reduce(xs[r], ws, variant="oneshot"))
        else:
            outs = [
                norm
                for norm, _ in ranks.run(
                    lambda r, ws: sk.fused_allreduce_add_rmsnorm(
                        xs[r], residual, weight, EPS, ws, variant="oneshot"
                    )
                )
            ]
        torch.cuda.synchronize()
        ranks.check_errors()
        for out in outs:
            assert torch.isnan(out[2, 100]), "the NaN lane must stay a NaN"
            if op == "plain":  # other elements are unaffected (a NaN row poisons the norm)
                mask = torch.ones_like(out, dtype=torch.bool)
                mask[2, 100] = False
                expected = reference_all_reduce(xs)
                rtol, atol = TOLERANCES[torch.bfloat16]
                err = (out.float() - expected).abs() - rtol * expected.abs()
                assert err[mask].max().item() <= atol
    finally:
        ranks.close()


def test_inputs_are_not_modified(forced_ranks):
    n = forced_ranks.world_size
    xs, residual, weight = rank_inputs(n, 5, 2048, seed=3)
    copies = [x.clone() for x in xs], residual.clone(), weight.clone()
    forced_ranks.run(lambda r, ws: sk.fused_allreduce_add_rmsnorm(xs[r], residual, weight, EPS, ws))
    forced_ranks.run(lambda r, ws, xs=xs: sk.all_reduce(xs[r], ws))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(xs, copies[0], strict=True))
    assert torch.equal(residual, copies[1]) and torch.equal(weight, copies[2])


@pytest.mark.parametrize("world_size", [2, 8])
@pytest.mark.parametrize("variant", VARIANTS)
def test_fp16_matches_fp32_reference(world_size, variant):
    ranks = _make_ranks(
        world_size,
        max_tokens=256,
        hidden=4096,
        dtype=torch.float16,
        oneshot_max_bytes=256 * 4096 * 2,
    )
    try:
        for tokens in (1, 33, 256):
            xs, residual, weight = rank_inputs(world_size, tokens, 4096, torch.float16, seed=tokens)
            outs = ranks.run(lambda r, ws, xs=xs: sk.all_reduce(xs[r], ws, variant=variant))
            _check_plain(ranks, xs, outs, f"fp16 {variant} {tokens}")
            outs = ranks.run(
                lambda r, ws, xs=xs, res=residual, w=weight: sk.fused_allreduce_add_rmsnorm(
                    xs[r], res, w, EPS, ws, variant=variant
                )
            )
            _check_fused(ranks, xs, residual, weight, outs, f"fp16 fused {variant} {tokens}")
    finally:
        ranks.close()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_variant_is_chosen_by_size_with_default_thresholds(world_size):
    ranks = _make_ranks(world_size, max_tokens=512)
    try:
        threshold = ranks.workspaces[0].tuning.oneshot_max_bytes
        assert threshold == sk.default_oneshot_max_bytes(world_size)
        lamport = ranks.workspaces[0].tuning.twoshot_lamport_max_bytes
        assert lamport == config.default_twoshot_lamport_max_bytes(world_size)
        for tokens in (1, 4, 64, 512):
            nbytes = tokens * 7168 * 2
            expected = (
                _lib.VARIANT_ONESHOT
                if nbytes <= threshold
                else _lib.VARIANT_TWOSHOT_LAMPORT
                if nbytes <= lamport
                else _lib.VARIANT_TWOSHOT
            )
            assert ranks.workspaces[0].plan(nbytes)[0] == expected
            xs, residual, weight = rank_inputs(
                world_size, tokens, 7168, torch.bfloat16, seed=tokens
            )
            outs = ranks.run(lambda r, ws, xs=xs: sk.all_reduce(xs[r], ws))
            _check_plain(ranks, xs, outs, f"auto {tokens}")
            outs = ranks.run(
                lambda r, ws, xs=xs, res=residual, w=weight: sk.fused_allreduce_add_rmsnorm(
                    xs[r], res, w, EPS, ws
                )
            )
            _check_fused(ranks, xs, residual, weight, outs, f"auto fused {tokens}")
    finally:
        ranks.close()


def test_a_fused_call_one_shot_would_split_runs_two_shot_in_whole_row_pieces():
    """Two ranks, three rows a block at one-shot size: the fused call left to the size runs
    two-shot (config.fused_variant) in one launch, and matches the reference."""
    ranks = _make_ranks(2, max_tokens=512)
    try:
        ws = ranks.workspaces[0]
        tokens = 3 * ws.tuning.max_blocks
        variant, blocks = ws.plan(tokens * 7168 * 2)
        assert variant == _lib.VARIANT_ONESHOT
        assert sk.split_fused(tokens, blocks, ws.tuning, variant)
        chosen = config.fused_variant(tokens, 7168, variant, blocks, ws.tuning, ws.layout)
        assert chosen == _lib.VARIANT_TWOSHOT
        _fused_matches_reference(ranks, tokens, 7168, None, seed=tokens, what="auto fused")
    finally:
        ranks.close()


@pytest.mark.parametrize("world_size", [2, 4])
def test_row_split_grids_fit_the_clusters_this_gpu_holds_beside_the_other_ranks(world_size):
    from sgl_kernel_sm120.workspace import _resident_clusters

    clusters = _resident_clusters(torch.cuda.current_device())
    assert all(n > 0 for n in clusters.values()), clusters
    ranks = _make_ranks(world_size, max_tokens=64)
    try:
        tuning = ranks.workspaces[0].tuning
        for k, n in clusters.items():
            bound = min(config.DEFAULT_MAX_BLOCKS, config.MAX_ROW_SPLIT_BLOCKS, n // world_size * k)
            assert tuning.row_split_cap(k) == bound, (k, n, tuning)
        for tokens in (1, 2, 4, 8, 16, 32, 64):
            per_row = config.row_blocks(tokens, 7168, _lib.VARIANT_ONESHOT, tuning)
            if per_row > 1:
                assert tokens * per_row * world_size <= clusters[per_row] * per_row
            if tokens * 7168 * 2 > tuning.oneshot_max_bytes:
                continue
            what = f"fused {tokens}, {per_row} per row"
            _fused_matches_reference(ranks, tokens, 7168, "oneshot", seed=tokens, what=what)
    finally:
        ranks.close()


def test_back_to_back_calls_of_different_sizes_without_sync(forced_ranks):
    world_size = forced_ranks.world_size
    sequence = [
        (1, "fused", "oneshot"),
        (2048, "plain", "twoshot"),
        (3, "plain", "oneshot"),
        (300, "fused", "twoshot"),
        (64, "fused", "oneshot"),
        (1024, "plain", "oneshot"),
        (7, "fused", "twoshot"),
        (2, "plain", "twoshot"),
        (16, "fused", "twoshot_lamport"),
        (5, "plain", "twoshot_lamport"),
        (1, "plain", "oneshot"),
        (300, "fused", "twoshot_lamport"),
        (33, "plain", "twoshot_lamport"),
        (3, "fused", "oneshot"),
    ]
    data = [rank_inputs(world_size, t, 7168, seed=i) for i, (t, _, _) in enumerate(sequence)]

    def enqueue_all(rank, ws):
        results = []
        for (_, op, variant), (xs, residual, weight) in zip(sequence, data, strict=True):
            if op == "plain":
                results.append(sk.all_reduce(xs[rank], ws, variant=variant))
            else:
                results.append(
                    sk.fused_allreduce_add_rmsnorm(
                        xs[rank], residual, weight, EPS, ws, variant=variant
                    )
                )
        return results

    per_rank = forced_ranks.run(enqueue_all)
    for i, ((tokens, op, variant), (xs, residual, weight)) in enumerate(
        zip(sequence, data, strict=True)
    ):
        outs = [per_rank[r][i] for r in range(world_size)]
        what = f"call {i}: {op} {variant} {tokens} tokens"
        if op == "plain":
            _check_plain(forced_ranks, xs, outs, what)
        else:
            _check_fused(forced_ranks, xs, residual, weight, outs, what)


class _DeviceWords:
    """32-bit words of device memory at `address`, for torch.as_tensor (no copy)."""

    def __init__(self, address: int, count: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (count,),
            "typestr": "<i4",
            "data": (address, False),
            "version": 3,
        }


def _state_words(ws: sk.CommWorkspace) -> torch.Tensor:
    """This rank's call state, every block's copy, as an int32 view [block, word] of the device
    memory (the workspace's internals: sk_api.h's SK_STATE_* words)."""
    address = ws._buffers[ws.rank] + config.CONTROL_OFFSET + 4 * _lib.STATE_OFFSET_WORDS
    words = _DeviceWords(address, _lib.MAX_BLOCKS * _lib.STATE_WORDS)
    return torch.as_tensor(words, device=ws.device).view(_lib.MAX_BLOCKS, _lib.STATE_WORDS)


def _as_if_served(ranks: LocalRanks, calls: int) -> None:
    """Moves every rank's call state to where `calls` one-shot calls leave it: the call number
    in its two words, and `calls` mod 2^32 in the one-shot buffer word, which is what ABI 5's
    32-bit count of one-shot calls held there (ABI 6 stores 0-2 and reads the word mod 3, so the
    same value means the same buffer to both)."""
    torch.cuda.synchronize(ranks.device)
    low, high = (w - 2**32 if w >= 2**31 else w for w in (calls % 2**32, calls >> 32))
    for ws in ranks.workspaces:
        state = _state_words(ws)
        state[:, _lib.STATE_EPOCH] = low
        state[:, _lib.STATE_ONESHOT_BUFFER] = low
        state[:, _lib.STATE_EPOCH_HIGH] = high
    torch.cuda.synchronize(ranks.device)


def _call_numbers(ranks: LocalRanks) -> set[int]:
    """The last call's number, as every block's copy of every rank's call state holds it."""
    torch.cuda.synchronize(ranks.device)
    numbers = set()
    for ws in ranks.workspaces:
        state = _state_words(ws).cpu().tolist()
        for copy in state:
            low, high = (w % 2**32 for w in (copy[_lib.STATE_EPOCH], copy[_lib.STATE_EPOCH_HIGH]))
            numbers.add(high << 32 | low)
    return numbers


def _three_calls_with_slow_rank(
    variant: str,
    single_buffer: bool,
    fused: bool = False,
    max_blocks: int | None = None,
    calls_before: int = 0,
    after: Callable[[LocalRanks], None] | None = None,
) -> list[float]:
    """Rank 0 stalls 2 ms while it still has to read its buffers (one-shot: after its push;
    two-shot: after each wait); the other ranks go straight on to the next call. No end barrier
    holds them back. calls_before: the workspaces start as if they had served that many calls;
    after(ranks) runs once the calls are done. Returns each result's violation (fused: of the
    normed output and of the residual)."""
    world_size = 4
    ranks = _make_ranks(
        world_size,
        max_tokens=64,
        hidden=2048,
        oneshot_max_bytes=64 * 2048 * 2,
        max_blocks=max_blocks,
    )
    try:
        if calls_before:
            _as_if_served(ranks, calls_before)
        for ws in ranks.workspaces:
            ws._set_debug(single_buffer=single_buffer, delay_rank=0, delay_us=2000)
        data = [rank_inputs(world_size, 64, 2048, seed=s) for s in range(3)]

        def call(r, ws, xs, residual, weight):
            if fused:
                return sk.fused_allreduce_add_rmsnorm(
                    xs[r], residual, weight, EPS, ws, variant=variant
                )
            return (sk.all_reduce(xs[r], ws, variant=variant),)

        per_rank = ranks.run(lambda r, ws: [call(r, ws, *inputs) for inputs in data])
        ranks.check_errors()
        if after is not None:
            after(ranks)
        rtol, _ = TOLERANCES[torch.bfloat16]
        violations = []
        for i, (xs, residual, weight) in enumerate(data):
            want = (
                reference_fused(xs, residual, weight, EPS) if fused else (reference_all_reduce(xs),)
            )
            for r in range(world_size):
                for got, expected in zip(per_rank[r][i], want, strict=True):
                    violations.append(max_violation(got, expected, rtol).item())
        return violations
    finally:
        ranks.close()


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_no_rank_overwrites_a_buffer_a_slow_peer_still_reads(variant, fused):
    _, atol = TOLERANCES[torch.bfloat16]
    violations = _three_calls_with_slow_rank(variant, single_buffer=False, fused=fused)
    assert max(violations) <= atol, violations


def test_fused_two_shot_with_whole_row_pieces_waits_for_a_slow_peer():
    """The whole-row-piece epilogue waits for one block index of each rank, not for every
    block: a slow rank's gather buffer must still not be overwritten by the next call (64 rows
    over 4 ranks and 4 blocks: 4 rows a piece)."""
    _, atol = TOLERANCES[torch.bfloat16]
    violations = _three_calls_with_slow_rank("twoshot", False, fused=True, max_blocks=4)
    assert max(violations) <= atol, violations


@pytest.mark.parametrize(
    ("variant", "fused", "max_blocks"),
    [
        ("oneshot", False, None),
        ("twoshot", False, None),
        ("twoshot", True, 4),
        ("twoshot_lamport", False, None),
        ("twoshot_lamport", True, None),
    ],
    ids=["oneshot", "twoshot", "twoshot-fused-pieces", "twoshot_lamport", "twoshot_lamport-fused"],
)
def test_a_workspace_stays_correct_across_the_32_bit_wrap_of_its_call_count(
    variant, fused, max_blocks
):
    """A server makes ~10^4 calls a second: 2^32 of them in days. The workspaces start as if
    they had served 2^32 - 2 calls, and make calls 2^32 - 1, 2^32 and 2^32 + 1 beside a slow
    peer: the one-shot buffers must keep rotating (a 32-bit count of one-shot calls mod 3
    repeats a buffer where it wraps), and a two-shot flag no call has set for long must not pass
    for this call's (32-bit call numbers compared by signed distance take any flag more than
    2^31 calls old, a never-written one included). Afterwards every copy of the call state
    holds 2^32 + 1, the last call's number (the high word carried)."""
    _, atol = TOLERANCES[torch.bfloat16]
    numbers: set[int] = set()
    violations = _three_calls_with_slow_rank(
        variant,
        False,
        fused=fused,
        max_blocks=max_blocks,
        calls_before=2**32 - 2,
        after=lambda ranks: numbers.update(_call_numbers(ranks)),
    )
    assert max(violations) <= atol, violations
    assert numbers == {2**32 + 1}


@pytest.mark.parametrize("variant", ["oneshot", "twoshot_lamport"])
def test_buffer_reuse_test_catches_a_kernel_without_the_rotating_buffers(variant):
    """Negative control for the test above: with one Lamport buffer instead of three (and no
    clearing), fast ranks overwrite the slow rank's data before it reads them."""
    _, atol = TOLERANCES[torch.bfloat16]
    violations = _three_calls_with_slow_rank(variant, single_buffer=True)
    assert max(violations) > atol, "the race did not show: the reuse test proves nothing"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_cuda_graph_replays_1000_times_with_changing_inputs(world_size):
    ranks = _make_ranks(world_size, max_tokens=512)
    sets = 4
    # (tokens, op, variant): auto (one-shot at small sizes), forced two-shot, mixed.
    calls = [
        (7, "fused", None),
        (256, "plain", "twoshot"),
        (96, "fused", "twoshot"),
        (5, "plain", None),
        (12, "fused", "twoshot_lamport"),
        (32, "plain", "twoshot_lamport"),
    ]
    data = [
        [rank_inputs(world_size, t, 7168, seed=100 * k + i) for i, (t, _, _) in enumerate(calls)]
        for k in range(sets)
    ]
    refs = []
    for k in range(sets):
        per_call = []
        for (_, op, _), (xs, residual, weight) in zip(calls, data[k], strict=True):
            if op == "plain":
                per_call.append((reference_all_reduce(xs),))
            else:
                per_call.append(reference_fused(xs, residual, weight, EPS))
        refs.append(per_call)
    static = [
        [(xs[r].clone(), residual.clone(), weight.clone()) for (xs, residual, weight) in data[0]]
        for r in range(world_size)
    ]

    def body(rank, ws):
        outs = []
        for (_, op, variant), (x, residual, weight) in zip(calls, static[rank], strict=True):
            if op == "plain":
                outs.append((sk.all_reduce(x, ws, variant=variant),))
            else:
                outs.append(
                    sk.fused_allreduce_add_rmsnorm(x, residual, weight, EPS, ws, variant=variant)
                )
        return outs

    try:
        ranks.run(body)  # eager warm-up
        torch.cuda.synchronize()
        graphs, outs = [], []
        for rank, ws in enumerate(ranks.workspaces):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=ranks.streams[rank]):
                outs.append(body(rank, ws))
            graphs.append(graph)
        rtol, atol = TOLERANCES[torch.bfloat16]
        worst = [torch.zeros((), device="cuda") for _ in range(world_size)]

        def replay(i):
            def step(rank, ws):
                k = i % sets
                for (x, residual, weight), (xs, res_k, w_k) in zip(
                    static[rank], data[k], strict=True
                ):
                    x.copy_(xs[rank])
                    residual.copy_(res_k)
                    weight.copy_(w_k)
                graphs[rank].replay()
                for got, want in zip(outs[rank], refs[k], strict=True):
                    for g, w in zip(got, want, strict=True):
                        torch.maximum(worst[rank], max_violation(g, w, rtol), out=worst[rank])

            return step

        start = time.perf_counter()
        for i in range(1000):
            ranks.run(replay(i))
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        ranks.check_errors()
        values = [w.item() for w in worst]
        assert max(values) <= atol, f"worst violation per rank over 1000 replays: {values}"
        print(f"world {world_size}: 1000 replays in {elapsed:.2f} s")
    finally:
        ranks.close()


@pytest.mark.parametrize("calls_before", [0, 2**32], ids=["first-call", "past-2^32"])
@pytest.mark.parametrize(
    ("tokens", "hidden"), [(64, 2048), (4, 7168)], ids=["block-per-row", "row-split-cluster"]
)
@pytest.mark.parametrize("variant", VARIANTS)
def test_missing_peer_fails_with_error_within_timeout(variant, tokens, hidden, calls_before):
    """The error names the absent rank and the call, by its whole 64-bit number."""
    world_size, timeout_ms = 4, 300
    ranks = _make_ranks(
        world_size,
        max_tokens=64,
        hidden=hidden,
        timeout_ms=timeout_ms,
        oneshot_max_bytes=64 * hidden * 2,
    )
    expected_row_blocks = 4 if variant != "twoshot" and hidden == 7168 else 1
    code = VARIANT_CODES[variant]
    tuning = ranks.workspaces[0].tuning
    assert config.row_blocks(tokens, hidden, code, tuning) == expected_row_blocks
    try:
        if calls_before:
            _as_if_served(ranks, calls_before)
        xs, residual, weight = rank_inputs(world_size, tokens, hidden, seed=1)
        absent = world_size - 1  # this rank never calls
        start = time.perf_counter()
        ranks.run(
            lambda r, ws: (
                None
                if r == absent
                else sk.fused_allreduce_add_rmsnorm(
                    xs[r], residual, weight, EPS, ws, variant=variant
                )
            )
        )
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        assert elapsed < timeout_ms / 1000 + 3.0, f"took {elapsed:.2f} s to give up"
        for ws in ranks.workspaces[:absent]:
            with pytest.raises(
                sk.CommTimeoutError,
                match=f"waiting for rank {absent} .* in call {calls_before + 1};",
            ):
                ws.check_error()
        assert ranks.workspaces[absent].error() is None
        # The failed workspace refuses further work on the host, before touching the GPU.
        with pytest.raises(sk.CommTimeoutError):
            sk.all_reduce(xs[0], ranks.workspaces[0])
    finally:
        ranks.close()


def test_late_peer_within_timeout_is_waited_for():
    world_size = 4
    ranks = _make_ranks(world_size, max_tokens=64, hidden=2048, timeout_ms=5000)
    try:
        xs, residual, weight = rank_inputs(world_size, 16, 2048, seed=2)

        def late_last_rank(rank, ws):
            if rank == world_size - 1:
                torch.cuda._sleep(100_000_000)  # ~50 ms of GPU cycles before joining
            return sk.fused_allreduce_add_rmsnorm(xs[rank], residual, weight, EPS, ws)

        outs = ranks.run(late_last_rank)
        _check_fused(ranks, xs, residual, weight, outs, "late peer")
    finally:
        ranks.close()


def test_ops_trace_under_torch_compile():
    """Dynamo + AOT autograd with the fake implementations (Inductor, which loads generated
    kernels, runs in the multi-process test: here a module load would wait for spinning
    ranks). Each rank's workspace id is a new constant, so rank 1 recompiles while rank 0's
    kernel already waits: hence the long timeout."""
    world_size = 2
    ranks = _make_ranks(world_size, max_tokens=64, hidden=2048, timeout_ms=120_000)
    try:
        xs, residual, weight = rank_inputs(world_size, 16, 2048, seed=4)

        def layer_tail(x, res, w, workspace_id: int):
            norm, new_res = torch.ops.sgl_kernel_sm120.fused_allreduce_add_rmsnorm(
                x, res, w, EPS, workspace_id, -1
            )
            return norm * 2, new_res, torch.ops.sgl_kernel_sm120.all_reduce(x, workspace_id, -1)

        compiled = torch.compile(layer_tail, backend="aot_eager", fullgraph=True)
        for _ in range(2):  # second round: compiled code, no tracing
            outs = ranks.run(lambda r, ws: compiled(xs[r], residual, weight, ws.id))
        norm_ref, residual_ref = reference_fused(xs, residual, weight, EPS)
        ranks.check_errors()
        for norm2, res, plain in outs:
            _assert_close(norm2, 2 * norm_ref, "compiled norm_out * 2")
            _assert_close(res, residual_ref, "compiled residual_out")
            _assert_close(plain, reference_all_reduce(xs), "compiled all_reduce")
    finally:
        ranks.close()


def test_too_large_input_is_refused_so_the_caller_can_fall_back():
    ranks = _make_ranks(2, max_tokens=16, hidden=2048)
    try:
        x = torch.zeros(17, 2048, dtype=torch.bfloat16, device="cuda")
        with pytest.raises(sk.InputTooLargeError, match="exceed the workspace"):
            sk.all_reduce(x, ranks.workspaces[0])
        with pytest.raises(sk.InputTooLargeError, match="exceed the workspace"):
            sk.fused_allreduce_add_rmsnorm(x, x, x[0], EPS, ranks.workspaces[0])
    finally:
        ranks.close()


def test_closed_workspace_is_refused():
    ranks = _make_ranks(2, max_tokens=16, hidden=2048)
    ws = ranks.workspaces[0]
    ranks.close()
    x = torch.zeros(16, 2048, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(sk.WorkspaceError, match="closed"):
        sk.all_reduce(x, ws)
