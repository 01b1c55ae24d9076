"""The p2p probe's arithmetic on recorded timings and its cache beside the tuning table (the
command's refusals without two GPUs are rows of test_bad_input.py)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from sglang_sm120.commands.p2p import format_probe
from sglang_sm120.machine.cache import host_fingerprint
from sglang_sm120.machine.facts import load_profile
from sglang_sm120.machine.p2p_probe import (
    ConcurrentTiming,
    PairTiming,
    gbps,
    is_collapse,
    link_ratio,
    load_probe,
    save_probe,
    staged_rounds,
    summarize,
)

PCIE8 = load_profile("rtx-pro-6000-x8-pcie")
MIB4 = 4 << 20
KIB4 = 4 << 10
REPS = 20


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(tmp_path))
    return tmp_path


def recorded(gpus=(0, 1, 2, 3), write_us=80.0, read_us=84.0, all_write=0.12, all_read=0.85):
    """Timings as a 4-GPU PCIe host gives them: a pair alone moves 4 MiB in 80 us (52.4 GB/s)
    writing, 84 us reading, a 4 KiB copy takes 2.0 / 2.6 us; all at once, writes reach
    ``all_write`` of the links' worth and reads ``all_read``; the staged order 80%."""
    pairs = []
    for a in gpus:
        for b in gpus:
            if a != b:
                pairs += [
                    PairTiming(a, b, "write", MIB4, write_us * 1e-6),
                    PairTiming(a, b, "read", MIB4, read_us * 1e-6),
                    PairTiming(a, b, "write", KIB4, 2.0e-6),
                    PairTiming(a, b, "read", KIB4, 2.6e-6),
                ]
    n = len(gpus)
    moved = MIB4 * REPS * n * (n - 1)
    links_write, links_read = n * gbps(MIB4, write_us * 1e-6), n * gbps(MIB4, read_us * 1e-6)
    concurrent = [
        ConcurrentTiming("all_write", moved, moved / (all_write * links_write * 1e9)),
        ConcurrentTiming("all_read", moved, moved / (all_read * links_read * 1e9)),
        ConcurrentTiming("staged_write", moved, moved / (0.8 * links_write * 1e9)),
    ]
    return pairs, concurrent


def test_bandwidth_is_bytes_over_time_in_gb_per_s():
    assert gbps(MIB4, 80e-6) == pytest.approx(52.43, abs=0.01)
    assert gbps(MIB4, 0.0) == 0.0 and gbps(MIB4, math.nan) == 0.0 and gbps(MIB4, math.inf) == 0.0


def test_link_ratio_compares_with_every_link_carrying_one_pair():
    assert link_ratio(200.0, 50.0, 4) == 1.0
    assert link_ratio(24.0, 50.0, 4) == pytest.approx(0.12)
    assert link_ratio(24.0, 0.0, 4) == 0.0


COLLAPSE_ROWS = [
    # write ratio, read ratio, staged ratio, collapse
    (0.12, 0.85, 0.80, True),  # the public reports: writes fall 75-93%, reads unaffected
    (0.49, 0.90, 0.90, True),
    (0.50, 0.90, 0.90, False),  # half the links' worth is not collapse
    (0.30, 0.30, 0.30, False),  # everything slow at once: the fabric, not posted writes
    (0.30, 0.44, 0.30, False),  # reads ahead by less than 1.5x
    (0.30, 0.46, 0.30, True),
    (0.30, 0.30, 0.46, True),  # the staged order avoids it
]


@pytest.mark.parametrize(("write", "read", "staged", "collapse"), COLLAPSE_ROWS)
def test_collapse_verdict(write, read, staged, collapse):
    assert is_collapse(write, read, staged) is collapse


def test_summary_of_recorded_timings_finds_the_collapse():
    pairs, concurrent = recorded()
    summary = summarize((0, 1, 2, 3), pairs, concurrent, "2026-12-01T10:00:00")
    assert summary.pair_write_gbps == pytest.approx(52.43, abs=0.01)
    assert summary.pair_read_gbps == pytest.approx(49.93, abs=0.01)
    assert summary.write_latency_us == pytest.approx(2.0) and summary.read_latency_us == 2.6
    assert (summary.write_ratio, summary.read_ratio, summary.staged_ratio) == (0.12, 0.85, 0.8)
    assert summary.collapse
    assert summary.describe().startswith("concurrent P2P writes collapse to 12% of the links")


def test_summary_of_a_host_whose_writes_hold():
    pairs, concurrent = recorded(all_write=0.9, all_read=0.9)
    summary = summarize((0, 1, 2, 3), pairs, concurrent)
    assert not summary.collapse and "hold at 90%" in summary.describe()


def test_summary_without_measurements_is_zero_not_an_error():
    summary = summarize((0, 1), [], [])
    assert summary.pair_write_gbps == 0.0 and summary.write_ratio == 0.0
    assert not summary.collapse


def test_staged_order_gives_each_gpu_one_inbound_stream_per_round():
    rounds = staged_rounds(4)
    assert len(rounds) == 3
    for pairs in rounds:
        assert sorted(dst for _, dst in pairs) == [0, 1, 2, 3]
        assert all(src != dst for src, dst in pairs)
    every = sorted(p for pairs in rounds for p in pairs)
    assert every == [(a, b) for a in range(4) for b in range(4) if a != b]


def document(gpus=(0, 1, 2, 3), facts=PCIE8, **kwargs):
    from dataclasses import asdict

    pairs, concurrent = recorded(gpus, **kwargs)
    fingerprint = host_fingerprint(facts, len(gpus), tuple(gpus))
    return {
        "version": 1,
        "fingerprint": fingerprint,
        "gpus": list(gpus),
        "created": "2026-12-01T10:00:00",
        "pairs": [asdict(p) for p in pairs],
        "concurrent": [asdict(c) for c in concurrent],
        "summary": summarize(gpus, pairs, concurrent, "2026-12-01T10:00:00").to_json(),
        "notes": [],
    }


def test_probe_is_saved_next_to_the_tuning_table_and_read_back(cache):
    path = save_probe(document())
    assert (
        path.parent == cache
        and path.name.startswith("p2p-")
        and path.name.endswith("-gpus0-1-2-3.json")
    )
    summary, note = load_probe(PCIE8, (0, 1, 2, 3))
    assert summary is not None and summary.collapse and note == f"p2p probe {path.name}"
    assert summary.path == str(path)


def test_a_tp_group_never_reads_a_probe_of_other_gpus():
    """Issue 26.2: a probe of all 8 GPUs says nothing certain about GPUs 0-3 alone (the
    collapse it measured may come from the other pairs): the TP group has no probe."""
    save_probe(document(gpus=tuple(range(8))))
    summary, note = load_probe(PCIE8, (0, 1, 2, 3))
    assert summary is None and note == "no p2p probe for GPUs 0,1,2,3"
    summary, _ = load_probe(PCIE8, tuple(range(8)))
    assert summary is not None and summary.gpus == tuple(range(8))


def test_probe_of_another_host_is_not_used():
    other = load_profile("rtx-5090-x2-nop2p")
    save_probe(document(gpus=(0, 1), facts=other))
    summary, note = load_probe(PCIE8, (0, 1))
    assert summary is None and note == "no p2p probe for GPUs 0,1"


def test_edited_probe_is_stale_and_a_broken_one_unreadable(cache):
    path = save_probe(document())
    data = json.loads(path.read_text())
    data["fingerprint"]["driver"] = "999.0"
    path.write_text(json.dumps(data))
    assert "stale" in load_probe(PCIE8, (0, 1, 2, 3))[1]
    path.write_bytes(b"\xff\xfe not json")
    summary, note = load_probe(PCIE8, (0, 1, 2, 3))
    assert summary is None and "unreadable" in note


def test_an_unreadable_cache_directory_is_no_probe_not_an_error(monkeypatch):
    def refuse(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "is_file", refuse)
    summary, note = load_probe(PCIE8, (0, 1))
    assert summary is None and "unreadable: Permission denied" in note


def test_a_cache_dir_that_is_a_file_is_named_in_the_no_probe_note(monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(tmp_path / "a-file"))
    summary, note = load_probe(PCIE8, (0, 1))
    assert summary is None
    assert note == (
        f"no p2p probe for GPUs 0,1 (SGLANG_SM120_CACHE_DIR={tmp_path / 'a-file'} unreadable "
        "(a file, not a directory))"
    )


def test_a_fifo_in_place_of_the_probe_is_unreadable_not_a_hang(cache):
    path = save_probe(document())
    path.unlink()
    os.mkfifo(path)
    summary, note = load_probe(PCIE8, (0, 1, 2, 3))
    assert (
        summary is None and note == f"no p2p probe ({path} unreadable: a FIFO, not a regular file)"
    )


def test_fewer_than_two_gpus_have_no_probe():
    assert load_probe(PCIE8, (0,)) == (None, "no p2p probe: fewer than 2 GPUs, no peers to measure")


def test_printout_shows_pairs_concurrency_and_the_verdict():
    text = format_probe(document())
    assert "one pair at a time, GB/s at 4 MiB, write/read (row: source):" in text
    assert "  52.4/49.9" in text and "   2.0/2.6" in text
    assert "every GPU writing to every peer" in text and " 12%" in text
    assert "verdict: concurrent P2P writes collapse to 12%" in text
    assert "one-shot push all-reduce disfavoured here; PCIe-IPC (staged)" in text
