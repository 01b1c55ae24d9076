"""Tuning tables on disk, keyed by host fingerprint; missing, stale or shared-GPU ones unused."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import pytest
from sglang_sm120.machine.cache import host_fingerprint
from sglang_sm120.machine.facts import load_profile
from sglang_sm120.planning.tuning import (
    Measurement,
    TuningTable,
    VariantMeasurement,
    load_table,
    save_table,
    winners,
    wrong_backends,
)

PCIE8 = load_profile("rtx-pro-6000-x8-pcie")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(tmp_path))
    return tmp_path


def make_table(facts=PCIE8, tp=8, share=False):
    ms = (Measurement("nccl", 1, 200.0, True), Measurement("sm120_pcie", 1, 8.0, True))
    return TuningTable(host_fingerprint(facts, tp), tp, 7168, "bfloat16", ms, ranks_share_gpu=share)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (os.mkfifo, "unreadable: a FIFO, not a regular file"),  # would block the reader
        (lambda p: p.write_text('{"tp": 8, "tp": 4}'), "unreadable: duplicate key 'tp'"),
        (lambda p: p.write_text("{" + " " * (16 << 20) + "}"), "unreadable: over 16 MiB"),
    ],
    ids=["fifo", "duplicate key", "over 16 MiB"],
)
def test_a_table_file_that_is_not_a_strict_json_document_is_unreadable(make, reason):
    """Anyone who can write the cache directory can put anything under a table's name; the
    server must not hang or fill its memory on it."""
    path = save_table(make_table())
    path.unlink()
    make(path)
    table, note = load_table(PCIE8, 8, 7168, "bfloat16")
    assert table is None and note.startswith(f"tuning table {path} {reason}")


def test_round_trip_and_fresh_table_is_used():
    save_table(make_table())
    table, note = load_table(PCIE8, 8, 7168, "bfloat16")
    assert table == make_table() and note.startswith("tuning table allreduce-")
    assert winners(table, prefer=None) == {1: "sm120_pcie"}


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


NOBODY = 65534


def as_unprivileged(fn):
    """``fn()`` as a user whom permission bits bind: this process when it is not root, else a
    forked child that dropped to nobody (uid 65534; a fork, so nothing is imported from
    directories nobody may read). Returns fn's result, or the exception it raised."""
    if os.geteuid() != 0:
        try:
            return fn()
        except Exception as exc:
            return exc
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, never return into pytest
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                answer = fn()
            except Exception as exc:
                answer = exc
            os.write(write, pickle.dumps(answer))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return pickle.loads(data)


@pytest.fixture
def open_dir():
    """A directory every user may reach (pytest's own tmp_path sits in a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="sglang-sm120-test-"))
    path.chmod(0o755)
    yield path
    for sub in path.rglob("*"):
        if sub.is_dir():
            sub.chmod(0o755)
    shutil.rmtree(path)


def test_cache_dir_the_server_user_cannot_search_is_no_table_naming_it(monkeypatch, open_dir):
    locked = open_dir / "locked"
    locked.mkdir(mode=0)  # no one but root may search it
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(locked / "cache"))
    answer = as_unprivileged(lambda: load_table(PCIE8, 8, 7168, "bfloat16"))
    assert not isinstance(answer, Exception), repr(answer)
    table, note = answer
    assert table is None
    assert f"{locked / 'cache'}" in note and "Permission denied" in note


@pytest.mark.parametrize(
    ("layout", "error"),
    [
        ("a-file", "unreadable (a file, not a directory)"),  # the variable names a regular file
        ("a-file/cache", "Not a directory"),  # a directory below a regular file
        ("x" * 300, "File name too long"),  # a name the file system refuses
    ],
)
def test_a_cache_dir_that_cannot_be_read_is_no_table_naming_it(
    monkeypatch, tmp_path, layout, error
):
    (tmp_path / "a-file").write_text("not a directory")
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(tmp_path / layout))
    table, note = load_table(PCIE8, 8, 7168, "bfloat16")
    assert table is None
    assert f"SGLANG_SM120_CACHE_DIR={tmp_path / layout}" in note and error in note


def test_a_cache_dir_the_user_cannot_write_is_named_where_tune_would_fail(monkeypatch, open_dir):
    """Reading works, so there is just no table; the note says tune could not write one."""
    from sglang_sm120.machine.cache import cache_write_problem

    cache = open_dir / "read-only"
    cache.mkdir(mode=0o555)
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(cache))
    table, note = as_unprivileged(lambda: load_table(PCIE8, 8, 7168, "bfloat16"))
    problem = as_unprivileged(cache_write_problem)
    assert table is None and "run `sglang-sm120 tune --tp 8`" in note
    assert f"{cache} is not writable" in note
    assert f"SGLANG_SM120_CACHE_DIR={cache}" in problem and "not writable" in problem


def test_winners_skip_wrong_and_unmeasured():
    ms = (
        Measurement("sm120_pcie", 8, 5.0, False),
        Measurement("pcie_ipc", 8, None, True, "n/a"),
        Measurement("nccl", 8, 300.0, True),
    )
    assert winners(TuningTable({}, 8, 7168, "bfloat16", ms), prefer=None) == {8: "nccl"}


@pytest.mark.parametrize(
    ("fused_us", "unfused_us", "winner"),
    [
        (25.5, 24.4, "sm120_pcie_unfused"),  # 1.1 us and 4.3% faster: a clear win
        (7.6, 7.4, "sm120_pcie"),  # 0.2 us: noise; the fused kernel keeps the size
        (157.8, 155.0, "sm120_pcie"),  # 2.8 us but 1.8%: not clear either
    ],
)
def test_unfused_route_needs_a_clear_win_over_the_fused_kernel(fused_us, unfused_us, winner):
    ms = (
        Measurement("nccl", 16, 400.0, True),
        Measurement("sm120_pcie", 16, fused_us, True),
        Measurement("sm120_pcie_unfused", 16, unfused_us, True),
    )
    assert winners(TuningTable({}, 2, 7168, "bfloat16", ms), prefer="sm120_pcie") == {16: winner}


def test_a_backend_wrong_at_one_size_wins_at_no_size():
    ms = (
        Measurement("trtllm", 4, 5.0, True),
        Measurement("pcie_ipc", 4, 8.0, True),
        Measurement("trtllm", 64, 9.0, False),
        Measurement("pcie_ipc", 64, 20.0, True),
        Measurement("sm120_pcie", 4, 4.0, True),
        Measurement("sm120_pcie_unfused", 64, 6.0, False),  # shares sm120_pcie's all-reduce
    )
    table = TuningTable({}, 8, 7168, "bfloat16", ms)
    assert wrong_backends(table) == {"trtllm", "sm120_pcie", "sm120_pcie_unfused"}
    assert winners(table, prefer=None) == {4: "pcie_ipc", 64: "pcie_ipc"}


def test_printed_table_keeps_every_backend_in_its_column():
    from sglang_sm120.commands.tune import BACKENDS, format_table

    ms = (
        Measurement("nccl", 4, 11.6, True),
        Measurement("sm120_pcie", 4, 6.7, True),
        Measurement("sm120_pcie_unfused", 256, 24.4, True),
        Measurement("trtllm", 256, 20.5, False),
    )
    lines = format_table(TuningTable({}, 2, 7168, "bfloat16", ms)).splitlines()
    head, row4, row256 = lines[1], lines[2], lines[3]
    assert head.split()[1:-2] == list(BACKENDS)
    # every value ends where its backend's name ends in the header
    for row in (row4, row256):
        assert len(row) - len(row.split("  ")[-1]) == len(head) - len("fastest correct")
    unfused_end = head.index("sm120_pcie_unfused") + len("sm120_pcie_unfused")
    assert row256[:unfused_end].endswith("24.4")
    assert row4.endswith("sm120_pcie") and row256.endswith("sm120_pcie_unfused")
    assert "20.5!" in row256  # wrong: shown, never chosen


def test_tune_names_a_cache_dir_it_cannot_write_before_measuring(monkeypatch, tmp_path, capsys):
    from sglang_sm120.commands import cli

    (tmp_path / "a-file").write_text("not a directory")
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(tmp_path / "a-file"))
    monkeypatch.setenv("SGLANG_SM120_TOPOLOGY", "rtx-pro-6000-x8-pcie")
    assert cli.main(["tune", "--tp", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert f"SGLANG_SM120_CACHE_DIR={tmp_path / 'a-file'} is not writable" in err[0]


# --- upstream's own communicators as table backends --------------------------------------------


MSCCLPP_MISSING = "not installed: the mscclpp package does not import (it is not on PyPI"
NO_SM12X_SYMM_MEM = (
    "not available: SGLang's size table has no SM12x entry and PCIe has no multicast"
)


@pytest.mark.parametrize(
    ("profile", "tp", "refused"),
    [
        (
            "rtx-pro-6000-x8-pcie",
            8,
            {
                "custom_ar": "not available: upstream refuses more than 2 PCIe-only GPUs",
                "mscclpp": MSCCLPP_MISSING,
                "torch_symm_mem": NO_SM12X_SYMM_MEM,
            },
        ),
        (
            "rtx-pro-6000-x8-pcie",
            2,
            {"mscclpp": MSCCLPP_MISSING, "torch_symm_mem": NO_SM12X_SYMM_MEM},
        ),
        (
            "rtx-5090-x2-nop2p",
            2,
            {
                "custom_ar": "not available: no P2P between GPUs 0-1: upstream's P2P test",
                "mscclpp": MSCCLPP_MISSING,
                "torch_symm_mem": NO_SM12X_SYMM_MEM,
            },
        ),
    ],
    ids=["tp8 pcie", "tp2 pcie: custom AR measured", "no p2p"],
)
def test_tune_measures_upstreams_communicators_where_doctor_says_they_can_run(
    monkeypatch, profile, tp, refused
):
    """The reasons are doctor's "all-reduce options" rows: custom AR is measured at TP2 over
    PCIe (where upstream builds it), not at TP8 PCIe-only; MSCCL++ says how to get it."""
    import importlib.util

    from sglang_sm120.commands import tune
    from sglang_sm120.machine.facts import current_facts

    monkeypatch.setenv("SGLANG_SM120_TOPOLOGY", profile)
    assert importlib.util.find_spec("mscclpp") is None  # this CPU box: not installed
    current_facts.cache_clear()  # read once per process: this test's profile, and no other's
    try:
        got = tune.upstream_refusals(tp)
    finally:
        current_facts.cache_clear()
    assert set(got) == set(refused)
    for backend, start in refused.items():
        assert got[backend].startswith(start), got[backend]
    assert "build it from github.com/microsoft/mscclpp" in got["mscclpp"]


def test_a_declined_cell_is_read_back_and_printed_as_declined_not_as_a_failure():
    from sglang_sm120.commands.tune import format_table
    from sglang_sm120.planning.tuning import DECLINES

    ms = (
        Measurement("nccl", 2048, 90.0, True),
        Measurement("custom_ar", 4, 5.0, True),
        Measurement("custom_ar", 2048, None, False, DECLINES + "29360128 bytes (its limit: 8 MiB)"),
        Measurement("mscclpp", 2048, None, False, "failed: RuntimeError: x"),
    )
    table = TuningTable({}, 2, 7168, "bfloat16", ms)
    assert TuningTable.from_json(json.loads(json.dumps(table.to_json()))) == table
    row2048 = format_table(table).splitlines()[3].split()
    assert row2048[0] == "2048"
    columns = dict(zip(format_table(table).splitlines()[1].split()[1:], row2048[1:], strict=False))
    assert columns["custom_ar"] == "declined" and columns["mscclpp"] == "n/a"
    assert wrong_backends(table) == set()  # declining a size is not a wrong result


def test_a_table_written_before_the_upstream_backends_still_loads():
    """The upstream backends bumped no TABLE_VERSION: a table without them is what it
    measured (a version-2 table, before the NCCL variants too: test_tuning's NCCL section)."""
    from sglang_sm120.planning.tuning import TABLE_VERSION

    table = make_table()
    data = table.to_json()
    assert data["version"] == TABLE_VERSION
    assert {m["backend"] for m in data["measurements"]} <= {"nccl", "sm120_pcie"}
    save_table(table)
    loaded, reason = load_table(PCIE8, 8, 7168, "bfloat16")
    assert loaded == table, reason


# ------------------------------------------------------------------ NCCL variants (issue 25 2b)

LL = (("NCCL_PROTO", "LL"),)
TREE = (("NCCL_ALGO", "Tree"),)


def test_a_table_keeps_its_nccl_variants_through_the_file():
    variants = (
        VariantMeasurement((), 64, 30.0, True),
        VariantMeasurement(LL, 64, 20.0, True),
        VariantMeasurement(TREE, 64, None, False, "failed: RuntimeError: capture"),
    )
    save_table(dataclasses.replace(make_table(), nccl_variants=variants))
    table, _ = load_table(PCIE8, 8, 7168, "bfloat16")
    assert table is not None and table.nccl_variants == variants


def test_a_version_2_table_still_serves_its_backends_without_variants(cache):
    """Tables written before NCCL variants: their backend times still hold."""
    path = save_table(make_table())
    data = json.loads(path.read_text())
    data["version"] = 2
    del data["nccl_variants"]
    path.write_text(json.dumps(data))
    table, _ = load_table(PCIE8, 8, 7168, "bfloat16")
    assert table is not None and table.nccl_variants == () and table.version == 2
    data["version"] = 1
    path.write_text(json.dumps(data))
    assert "stale" in load_table(PCIE8, 8, 7168, "bfloat16")[1]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"NCCL_PROTO": "LL,Simple"}, "nccl_variants[0].env.NCCL_PROTO"),
        # named, LL128 runs where NCCL did not enable it: "may cause silent data corruption"
        ({"NCCL_PROTO": "LL128"}, "nccl_variants[0].env.NCCL_PROTO"),
        ({"NCCL_MAX_NCHANNELS": "0"}, "channel count 1..64"),
        ({"NCCL_MAX_NCHANNELS": "65"}, "channel count 1..64"),  # past NCCL's MAXCHANNELS
        # an Arabic-Indic 4: str.isdigit() and int() take it, NCCL does not
        ({"NCCL_MAX_NCHANNELS": "\u0664"}, "channel count 1..64"),
        ({"NCCL_MAX_NCHANNELS": "\uff14"}, "channel count 1..64"),  # a fullwidth 4
        ({"NCCL_P2P_DISABLE": "1"}, "unknown key 'NCCL_P2P_DISABLE'"),
    ],
)
def test_a_variant_tune_does_not_measure_makes_the_table_unreadable(cache, env, message):
    """A worker sets these values in its environment: only what tune measures may get there."""
    path = save_table(make_table())
    data = json.loads(path.read_text())
    data["nccl_variants"] = [{"env": env, "tokens": 1, "us": 1.0, "correct": True, "note": ""}]
    path.write_text(json.dumps(data))
    table, note = load_table(PCIE8, 8, 7168, "bfloat16")
    assert table is None and "unreadable" in note and message in note, note


def test_a_variant_that_fails_as_a_whole_keeps_its_reason_and_the_others_run(monkeypatch):
    from sglang_sm120.commands.tune import NCCL_VARIANTS, TuneSettings, measure_variants

    monkeypatch.setenv("NCCL_PROTO", "Simple")  # the user's: not the default's, not kept
    seen = []

    def spawn(settings, env):
        seen.append((env, os.environ.get("NCCL_PROTO"), os.environ.get("NCCL_ALGO")))
        if env == TREE:
            raise RuntimeError("process 0 terminated with exit code 1")
        if env == LL:  # the graph capture failed in the ranks: their row says so
            return [["nccl", 8, None, False, "failed: RuntimeError: operation not permitted"]]
        return [["nccl", 8, 9.0, True, ""]]

    rows = measure_variants(TuneSettings(tp=2, tokens=(8,)), spawn)
    assert [env for env, _, _ in seen] == list(NCCL_VARIANTS)
    assert seen[0][1:] == (None, None)  # each for the all-reduce only, as a worker sets it
    assert (LL, "allreduce:LL", None) in seen and (TREE, None, "allreduce:Tree") in seen
    assert os.environ["NCCL_PROTO"] == "Simple" and "NCCL_ALGO" not in os.environ
    by_env = {m.env: m for m in rows if m.tokens == 8}
    assert by_env[TREE] == VariantMeasurement(
        TREE, 8, None, False, "failed: RuntimeError: process 0 terminated with exit code 1"
    )
    assert by_env[LL].us is None and "operation not permitted" in by_env[LL].note
    assert by_env[()] == VariantMeasurement((), 8, 9.0, True, "")


def test_every_user_nccl_tuning_variable_is_cleared_in_every_variants_ranks(monkeypatch, tmp_path):
    """A worker sets no variant while any of USER_NCCL_TUNING is set: the variants are timed
    without them (the default too), and the table's note names what was cleared."""
    from sglang_sm120.commands.tune import (
        TuneSettings,
        measure_variants,
        variant_conditions,
    )
    from sglang_sm120.planning.nccl_settings import USER_NCCL_TUNING

    for name in USER_NCCL_TUNING:
        monkeypatch.setenv(name, "2")
    monkeypatch.setenv("NCCL_TUNER_PLUGIN", "libnccl-tuner.so")
    monkeypatch.setenv("NCCL_CONF_FILE", str(tmp_path / "absent.conf"))
    seen = []

    def spawn(settings, env):
        seen.append({k: os.environ[k] for k in USER_NCCL_TUNING if k in os.environ})
        return [["nccl", 8, 9.0, True, ""]]

    measure_variants(TuneSettings(tp=2, tokens=(8,)), spawn)
    assert seen[0] == {}  # NCCL's own default, not the user's
    assert all(set(s) <= {"NCCL_PROTO", "NCCL_ALGO"} for s in seen)
    assert os.environ["NCCL_MIN_CTAS"] == "2"  # restored afterwards
    note, refused = variant_conditions(os.environ)
    assert refused is None
    assert note.startswith("NCCL variants timed without the user's NCCL_PROTO='2', ")
    assert "NCCL_TUNER_PLUGIN='libnccl-tuner.so', NCCL_ENV_PLUGIN='2' (cleared" in note


@pytest.mark.parametrize(
    ("conf", "reason"),
    [
        ("NCCL_MAX_CTAS=8\n", "NCCL_MAX_CTAS='8' in {conf} would apply to every variant"),
        (None, "NCCL's config file {conf} unreadable (a FIFO, not a regular file)"),
    ],
)
def test_tune_times_no_variant_under_nccl_config_file_tuning(tmp_path, conf, reason):
    """The ranks would read NCCL's config files, which the environment cannot clear: every
    variant is left unmeasured with the reason, and the plan then sets none."""
    from sglang_sm120.commands.tune import TuneSettings, variant_conditions, variants_refused

    path = tmp_path / "nccl.conf"
    if conf is None:
        os.mkfifo(path)
    else:
        path.write_text(conf)
    note, refused = variant_conditions({"NCCL_CONF_FILE": str(path)})
    assert note is None and refused.startswith(reason.format(conf=path)), refused
    rows = variants_refused(TuneSettings(tp=2, tokens=(8,)), refused)
    assert all(m.us is None and m.note == f"n/a: {refused}" for m in rows)


def test_one_shared_gpu_reports_every_variant_not_measured():
    from sglang_sm120.commands.tune import (
        NCCL_VARIANTS,
        TuneSettings,
        variant_lines,
        variants_not_measured,
    )

    rows = variants_not_measured(TuneSettings(tp=4, tokens=(1, 2)))
    assert len(rows) == 3 * len(NCCL_VARIANTS)  # and the prefill chunk
    why = "n/a: needs 4 GPUs, one per rank (ranks share one here)"
    assert all(m.us is None and m.note == why for m in rows)
    table = dataclasses.replace(make_table(), nccl_variants=tuple(rows))
    lines = variant_lines(table)  # said once, as not measured: nothing was excluded
    assert lines[-1] == f"not measured: {why}" and not any("excluded" in x for x in lines)


def test_tune_tp8_variants_are_estimated_under_ten_minutes():
    from sglang_sm120.commands.tune import TuneSettings, estimate_line, variants_estimate_s
    from sglang_sm120.planning.tuning import NCCL_VARIANTS

    settings = TuneSettings(tp=8)
    assert variants_estimate_s(settings) < 600
    assert "5 NCCL variants (default, NCCL_PROTO=LL," in estimate_line(settings)
    assert "each in 8 fresh processes over 13 token counts: about" in estimate_line(settings)
    assert not any(("NCCL_PROTO", "LL128") in env for env in NCCL_VARIANTS)


def test_printed_table_shows_the_variants_and_why_one_is_excluded():
    from sglang_sm120.commands.tune import format_table

    variants = (
        VariantMeasurement((), 8, 30.0, True),
        VariantMeasurement(LL, 8, 20.0, True),
        VariantMeasurement(TREE, 8, None, False, "failed: capture invalidated"),
    )
    text = format_table(dataclasses.replace(make_table(), nccl_variants=variants))
    lines = text.splitlines()
    head = lines.index("NCCL variants (nccl, each in fresh processes):")
    assert lines[head + 1].split() == ["tokens", "default", "PROTO=LL", "ALGO=Tree"]
    assert lines[head + 2].split() == ["8", "30.0", "20.0", "n/a"]
    assert "excluded: NCCL_ALGO=Tree at 1 size(s): failed: capture invalidated" in lines


def _rank_that_hangs(rank: int) -> None:
    import time

    time.sleep(3600 if rank == 1 else 0)


def test_a_spawn_that_hangs_is_stopped_at_its_deadline():
    """A rank blocked in a collective never returns by itself: the spawn is stopped at its
    deadline, every rank killed, and the variant gets the reason (measure_variants)."""
    import time

    from sglang_sm120.commands.tune import spawn_ranks

    started = time.monotonic()
    with pytest.raises(TimeoutError, match="still running after 3 s"):
        spawn_ranks(_rank_that_hangs, (), 2, deadline_s=3)
    assert time.monotonic() - started < 60


def _rank_that_raises(rank: int) -> None:
    if rank == 1:
        raise ValueError("NCCL said no")


def test_a_rank_that_fails_is_one_line_naming_the_rank():
    from sglang_sm120.commands.tune import spawn_ranks

    with pytest.raises(RuntimeError, match=r"rank 1 failed: ValueError: NCCL said no"):
        spawn_ranks(_rank_that_raises, (), 2, deadline_s=120)
