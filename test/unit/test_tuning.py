"""Tuning tables on disk, keyed by host fingerprint; missing, stale or shared-GPU ones unused."""

from __future__ import annotations

import dataclasses
import json

import pytest
from sglang_sm120.facts import load_profile
from sglang_sm120.tuning import (
    Measurement,
    TuningTable,
    host_fingerprint,
    load_table,
    save_table,
    winners,
)

PCIE8 = load_profile("rtx-pro-6000-x8-pcie")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(tmp_path))
    return tmp_path


def make_table(facts=PCIE8, tp=8, share=False):
    ms = (Measurement("nccl", 1, 200.0, True), Measurement("sm120_pcie", 1, 8.0, True))
    return TuningTable(host_fingerprint(facts, tp), tp, 7168, "bfloat16", ms, ranks_share_gpu=share)


def test_round_trip_and_fresh_table_is_used():
    save_table(make_table())
    table, note = load_table(PCIE8, 8, 7168, "bfloat16")
    assert table == make_table() and note.startswith("tuning table allreduce-")
    assert winners(table) == {1: "sm120_pcie"}


def test_missing_table_says_how_to_make_one():
    table, note = load_table(PCIE8, 8, 7168, "bfloat16")
    assert table is None and "run `sglang-sm120 tune --tp 8`" in note


def test_table_of_another_driver_is_stale():
    other = dataclasses.replace(PCIE8, driver_version="999.1")
    save_table(make_table(facts=other))
    table, note = load_table(PCIE8, 8, 7168, "bfloat16")
    assert table is None and "stale" in note


def test_table_with_edited_fingerprint_is_stale(cache):
    path = save_table(make_table())
    data = json.loads(path.read_text())
    data["fingerprint"]["nvlink"] = True
    path.write_text(json.dumps(data))
    table, note = load_table(PCIE8, 8, 7168, "bfloat16")
    assert table is None and "stale" in note


def test_table_measured_on_one_shared_gpu_is_not_used():
    save_table(make_table(share=True))
    table, note = load_table(PCIE8, 8, 7168, "bfloat16")
    assert table is None and "sharing one GPU" in note


def test_corrupt_table_is_reported(cache):
    path = save_table(make_table())
    path.write_text("{")
    table, note = load_table(PCIE8, 8, 7168, "bfloat16")
    assert table is None and "unreadable" in note


def test_winners_skip_wrong_and_unmeasured():
    ms = (
        Measurement("sm120_pcie", 8, 5.0, False),
        Measurement("pcie_ipc", 8, None, True, "n/a"),
        Measurement("nccl", 8, 300.0, True),
    )
    assert winners(TuningTable({}, 8, 7168, "bfloat16", ms)) == {8: "nccl"}


def test_printed_table_keeps_every_backend_in_its_column():
    from sglang_sm120.tune import BACKENDS, format_table

    ms = (
        Measurement("nccl", 4, 11.6, True),
        Measurement("sm120_pcie", 4, 6.7, True),
        Measurement("sm120_pcie_unfused", 256, 24.4, True),
        Measurement("sm120_pcie", 256, 25.5, False),
    )
    lines = format_table(TuningTable({}, 2, 7168, "bfloat16", ms)).splitlines()
    head, row4, row256 = lines[1], lines[2], lines[3]
    assert head.split()[1:-2] == list(BACKENDS)
    assert len(row4) - len(row4.split("  ")[-1]) == len(row256) - len(row256.split("  ")[-1])
    assert row4.endswith("sm120_pcie") and row256.endswith("sm120_pcie_unfused")
    assert "25.5!" in row256  # wrong: shown, never chosen
