"""The e2e harness's own logic, on CPU: stats files, accept length, launch flags, plan skips."""

from __future__ import annotations

import dis
import gc
import json
import os
import re
import signal
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
from code_in_module import frame_in
from processes import gone, server_pids
from sglang_sm120.commands import e2e as h
from sglang_sm120.commands import selftest


def _write_stats(folder: Path, pid: int, tp_rank: int | None, replays: int, **extra) -> None:
    body = {
        "pid": pid,
        "tp_rank": tp_rank,
        "fusion_backend": None,
        "plain_allreduce": "nccl",
        "graph_captures": {h.VERIFY_MODE: 3},
        "graph_replays": {h.VERIFY_MODE: replays},
        "fused_allreduce_in_capture": {},
        **extra,
    }
    (folder / f"sm120-stats-{pid}.json").write_text(json.dumps(body))


def test_read_stats_keys_tp_ranks_and_skips_other_processes(tmp_path) -> None:
    _write_stats(tmp_path, 10, 0, 5)
    _write_stats(tmp_path, 11, 1, 6)
    _write_stats(tmp_path, 12, None, 0)  # detokenizer / tokenizer manager
    (tmp_path / "sm120-stats-13.json").write_text('{"pid": 13, "tp_ra')  # being rewritten
    stats = h.read_stats(tmp_path)
    assert sorted(stats) == [0, 1]
    assert h.count(stats[1], "graph_replays") == 6
    assert h.count(stats[1], "fused_allreduce_in_capture") == 0


def test_sync_stats_waits_for_files_rewritten_after_the_nudge(tmp_path) -> None:
    _write_stats(tmp_path, 10, 0, 4)
    _write_stats(tmp_path, 11, 1, 4)

    def nudge() -> None:  # what a 2-token request does: a count changes, files rewritten
        _write_stats(tmp_path, 10, 0, 5)
        _write_stats(tmp_path, 11, 1, 5)

    stats, problem = h.sync_stats(tmp_path, 2, nudge, timeout_s=5)
    assert problem is None
    assert [h.count(stats[r], "graph_replays") for r in (0, 1)] == [5, 5]


def test_sync_stats_takes_a_rewrite_stamped_by_the_coarse_file_clock(tmp_path) -> None:
    """A file's mtime comes from the kernel's coarse clock, a tick (a few ms) behind
    time.time(): a file rewritten right after the nudge was sent can carry an earlier stamp."""
    _write_stats(tmp_path, 10, 0, 4)
    _write_stats(tmp_path, 11, 1, 4)

    def nudge() -> None:
        stamp = time.time() - 0.004
        for pid, rank in ((10, 0), (11, 1)):
            _write_stats(tmp_path, pid, rank, 5)
            os.utime(tmp_path / f"sm120-stats-{pid}.json", (stamp, stamp))

    stats, problem = h.sync_stats(tmp_path, 2, nudge, timeout_s=1)
    assert problem is None
    assert [h.count(stats[r], "graph_replays") for r in (0, 1)] == [5, 5]


def test_sync_stats_names_ranks_whose_files_stayed_stale(tmp_path) -> None:
    _write_stats(tmp_path, 10, 0, 4)
    _write_stats(tmp_path, 11, 1, 4)

    def nudge() -> None:  # only rank 0 writes
        _write_stats(tmp_path, 10, 0, 5)

    stats, problem = h.sync_stats(tmp_path, 2, nudge, timeout_s=0.5)
    assert problem is not None and "[0] of 2" in problem and h.STATS_ENV in problem
    assert sorted(stats) == [0, 1]


def test_accept_length_is_completion_tokens_per_verify_pass() -> None:
    launch = h.Launch("m", 1, "off", "d", prompts=("a", "b"))
    meta = [
        {"completion_tokens": 32, "spec_verify_ct": 16},
        {"completion_tokens": 32, "spec_verify_ct": 12},
    ]
    result = h.RunResult(launch, [], [], meta, {}, {}, Path("log"))
    assert result.verify_count == 28
    assert result.accept_length() == pytest.approx(64 / 28)
    plain = h.RunResult(launch, [], [], [{"completion_tokens": 32}], {}, {}, Path("log"))
    assert plain.accept_length() == 0.0


def test_launch_args_turn_on_eagle3_only_with_a_draft() -> None:
    plain = h.Launch("/m/target", 4, "trtllm").server_args(30000)
    spec = h.Launch("/m/target", 4, "off", draft="/m/draft").server_args(30000)
    assert "--speculative-algorithm" not in plain
    assert plain[plain.index("--tp-size") + 1] == "4"
    assert plain[-2:] == ["--flashinfer-allreduce-fusion-backend", "trtllm"]
    steps, topk, tokens = h.SMALL_TREE
    for flag, value in (
        ("--speculative-algorithm", "EAGLE3"),
        ("--speculative-draft-model-path", "/m/draft"),
        ("--speculative-num-steps", str(steps)),
        ("--speculative-eagle-topk", str(topk)),
        ("--speculative-num-draft-tokens", str(tokens)),
    ):
        assert spec[spec.index(flag) + 1] == value
    assert "--enforce-disable-flashinfer-allreduce-fusion" in spec
    assert "--disable-cuda-graph" not in spec  # the point is to run verify from graphs
    assert "--max-total-tokens" not in spec  # SGLang sizes the KV pool unless told


def test_a_capped_kv_pool_is_asked_for_before_the_extra_args() -> None:
    capped = h.Launch("/m/t", 1, "auto", max_total_tokens=4096, extra_args=("--x", "1"))
    args = capped.server_args(30000)
    assert args[-4:] == ["--max-total-tokens", "4096", "--x", "1"]


def test_equal_launches_share_one_server() -> None:
    a = h.Launch("t", 2, "auto", "d", prompts=("p",))
    b = h.Launch("t", 2, "auto", "d", prompts=("p",))
    assert a == b and hash(a) == hash(b)
    assert a != h.Launch("t", 2, "auto", None, prompts=("p",))


def test_gpu_env_pins_the_first_gpus_and_keeps_the_plugin_on(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    monkeypatch.setenv("SGLANG_SM120_DISABLE", "1")
    monkeypatch.setenv("SGLANG_PLUGINS", "other")
    env = h.gpu_env(2)
    assert env["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert "SGLANG_SM120_DISABLE" not in env
    assert env["SGLANG_PLUGINS"] == "other,sglang_sm120"


def test_a_refused_fused_backend_is_reported_with_the_plans_reasons(monkeypatch) -> None:
    plan = {"fusion_backend": None, "plain_allreduce": "nccl", "reasons": ["no P2P on 0-1"]}
    monkeypatch.setitem(h._PLANS, (2, "DeepseekV3ForCausalLM", "trtllm", None, None), plan)
    monkeypatch.setitem(h._PLANS, (2, "DeepseekV3ForCausalLM", "off", None, None), plan)
    assert "no P2P on 0-1" in h.refused_backend(2, "DeepseekV3ForCausalLM", "trtllm")
    assert h.refused_backend(2, "DeepseekV3ForCausalLM", "off") is None


# ---------------------------------------------------------------- a whole launch, faked

FAKE_SERVER = Path(__file__).with_name("fake_sglang_server.py")


def _fake_server_args(launch: h.Launch, port: int) -> list[str]:
    args = [sys.executable, str(FAKE_SERVER), "--port", str(port), "--tp", str(launch.tp)]
    return args + (["--speculative"] if launch.draft else [])


@pytest.fixture
def fake_runs(tmp_path, monkeypatch) -> h.ServerRuns:
    monkeypatch.setattr(h.Launch, "server_args", _fake_server_args)
    (tmp_path / "logs").mkdir()
    runs = h.ServerRuns(tmp_path / "runs", tmp_path / "logs")
    runs.startup_s = 60
    return runs


def test_a_launch_collects_outputs_and_stats_then_stops_its_processes(fake_runs) -> None:
    launch = h.Launch("fake", 2, "off", draft="draft", prompts=("a", "bb", "c"), max_new_tokens=8)
    result = fake_runs.get(launch)
    assert result.stats_problem is None
    assert len(result.sequential_ids) == 3 and result.sequential_ids == result.batched_ids
    assert result.verify_count == 3 * 4
    for rank in (0, 1):
        grown = h.count(result.stats_after[rank], "graph_replays") - h.count(
            result.stats_before[rank], "graph_replays"
        )
        # The fake, like the plugin, writes at most once a second; the harness's sync
        # requests bring every count in, plus up to two verify passes of their own.
        assert result.verify_count <= grown <= result.verify_count + 2
    assert fake_runs.get(launch) is result  # memoised: no second server
    worker = int(re.search(r"worker pid (\d+)", result.log.read_text()).group(1))
    assert gone(worker), "the server's worker process outlived the run"


def test_a_server_that_dies_at_start_fails_with_its_log(fake_runs, monkeypatch) -> None:
    crash = [sys.executable, "-c", "import sys; print('bad flag --x'); sys.exit(3)"]
    monkeypatch.setattr(h.Launch, "server_args", lambda self, port: crash)
    with pytest.raises(RuntimeError, match=r"exited with 3(.|\n)*bad flag --x"):
        fake_runs.get(h.Launch("fake", 1, "off", prompts=("a",)))


def test_launch_flags_parse_with_sglangs_own_parser() -> None:
    pytest.importorskip("sglang", reason="sglang is not installed")
    from sglang.srt.server_args import prepare_server_args

    for backend in h.BACKENDS:
        launch = h.Launch("/m/target", 2, backend, "/m/draft", max_total_tokens=4096)
        argv = launch.server_args(30000)
        parsed = prepare_server_args(argv[argv.index("--model-path") :])
        assert parsed.max_total_tokens == 4096
        assert parsed.tp_size == 2
        assert parsed.speculative_algorithm == "EAGLE3"
        steps, topk, tokens = h.SMALL_TREE
        assert (
            parsed.speculative_num_steps,
            parsed.speculative_eagle_topk,
            parsed.speculative_num_draft_tokens,
        ) == (steps, topk, tokens)
        assert parsed.enforce_disable_flashinfer_allreduce_fusion == (backend == "off")


# ---------------------------------------------------------------- several launches at once


def _slow_fake_server_args(launch: h.Launch, port: int) -> list[str]:
    """The fake server, ready after 2 s; a target named "crash" exits at start instead."""
    if launch.target == "crash":
        return [sys.executable, "-c", "import sys; print('bad flag --x'); sys.exit(3)"]
    return [*_fake_server_args(launch, port), "--startup-s", "2"]


class Timeline:
    """The harness's progress lines with the time each was heard."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def __call__(self, line: str) -> None:
        self.lines.append((time.monotonic(), line))

    def when(self, pattern: str) -> float:
        return next(t for t, line in self.lines if re.search(pattern, line))


@pytest.fixture
def timed_runs(fake_runs, monkeypatch) -> tuple[h.ServerRuns, Timeline]:
    monkeypatch.setattr(h.Launch, "server_args", _slow_fake_server_args)
    timeline = Timeline()
    fake_runs.progress = timeline
    return fake_runs, timeline


def test_launches_started_at_once_run_side_by_side(timed_runs) -> None:
    runs, timeline = timed_runs
    plain = h.Launch("fake", 1, "off", prompts=("a",), max_new_tokens=4, plugin=False)
    spec = h.Launch("fake", 1, "off", draft="draft", prompts=("a",), max_new_tokens=4)
    with runs.start([plain, spec], at_once=True) as servers:
        first, second = servers.results()
    assert first.launch == plain and second.launch == spec
    # Each needs 2 s to be ready: each started before the other was ready.
    assert timeline.when(f"starting server {plain.name} ") < timeline.when(f"{spec.name} ready")
    assert timeline.when(f"starting server {spec.name} ") < timeline.when(f"{plain.name} ready")
    assert runs.get(plain) is first and runs.get(spec) is second  # memoised
    ports = {int(re.search(r"on port (\d+)", line).group(1)) for _, line in timeline.lines[:2]}
    assert len(ports) == 2, timeline.lines
    logs = sorted(p.name for p in runs.log_dir.glob("*.log"))
    assert len(logs) == 2 and logs[0].startswith("00-") and logs[1].startswith("01-")


def test_launches_one_after_the_other_do_not_overlap(timed_runs) -> None:
    runs, timeline = timed_runs
    plain = h.Launch("fake", 1, "off", prompts=("a",), max_new_tokens=4, plugin=False)
    spec = h.Launch("fake", 1, "off", draft="draft", prompts=("a",), max_new_tokens=4)
    with runs.start([plain, spec], at_once=False) as servers:
        servers.results()
    stopped = timeline.when(f"server {plain.name} stopped")
    assert stopped < timeline.when(f"starting server {spec.name} ")


def test_at_most_max_running_servers_run_at_once_over_all_batches(timed_runs) -> None:
    """Three launches in two batches, on runs capped at two: the first two start together, the
    third only once one of them stopped."""
    fake, timeline = timed_runs
    runs = h.ServerRuns(fake.work_dir, fake.log_dir, timeline, max_running=2)
    runs.startup_s = 60
    launches = [
        h.Launch(f"fake{i}", 1, "off", prompts=("a",), max_new_tokens=4, plugin=False)
        for i in range(3)
    ]
    with runs.start(launches[:2], at_once=True) as pair, runs.start(launches[2:], at_once=True):
        assert [r.launch for r in pair.results()] == launches[:2]
        assert runs.get(launches[2]).launch == launches[2]
    starts = sorted(timeline.when(f"starting server {x.name} ") for x in launches)
    first_ready = min(timeline.when(f"{x.name} ready") for x in launches)
    assert starts[1] < first_ready
    first_stopped = min(timeline.when(f"server {x.name} stopped") for x in launches)
    assert first_stopped < starts[2]


def test_a_launch_that_fails_beside_another_is_reported_and_the_other_kept(timed_runs) -> None:
    runs, _ = timed_runs
    crash = h.Launch("crash", 1, "off", prompts=("a",))
    good = h.Launch("fake", 1, "off", prompts=("a",), max_new_tokens=4, plugin=False)
    with runs.start([crash, good], at_once=True) as servers:
        failed, result = servers.results()
    assert isinstance(failed, h.ServerFailed) and "bad flag --x" in str(failed)
    assert isinstance(result, h.RunResult) and len(result.sequential_ids) == 1


def test_leaving_the_block_by_an_exception_stops_every_server_it_started(timed_runs) -> None:
    """What a signal does in the selftest: it raises in the main thread, which is waiting."""
    runs, _ = timed_runs
    runs.startup_s = 600
    launches = [h.Launch(f"fake{i}", 1, "off", prompts=("a",)) for i in range(2)]
    deadline = time.monotonic() + 60
    with pytest.raises(KeyboardInterrupt):
        with runs.start(launches, at_once=True):
            while len(server_pids(runs.log_dir)) < 4:
                assert time.monotonic() < deadline, server_pids(runs.log_dir)
                time.sleep(0.1)
            raise KeyboardInterrupt
    pids = server_pids(runs.log_dir)
    assert len(pids) == 4 and all(gone(pid) for pid in pids)


def test_a_server_failed_in_the_background_is_reported_not_started_again(timed_runs) -> None:
    runs, timeline = timed_runs
    crash = h.Launch("crash", 1, "off", prompts=("a",))
    with runs.start([crash], at_once=True) as servers:
        (failed,) = servers.results()
    assert isinstance(failed, h.ServerFailed)
    for _ in range(2):
        with pytest.raises(h.ServerFailed) as raised:
            runs.get(crash)
        assert raised.value is failed
    assert len(list(runs.log_dir.glob("*.log"))) == 1
    assert sum("starting server" in line for _, line in timeline.lines) == 1


def test_no_server_starts_once_all_are_being_stopped(timed_runs) -> None:
    runs, timeline = timed_runs
    runs.stop_all()
    with pytest.raises(h.ServerFailed, match="not started"):
        runs.get(h.Launch("fake", 1, "off", prompts=("a",)))
    assert not list(runs.log_dir.glob("*.log")) and not timeline.lines


def test_a_server_started_as_stop_all_lists_them_is_stopped_at_once(
    timed_runs, monkeypatch
) -> None:
    """stop_all lists the running servers just after this one's Popen, before it is
    registered: registering it sees ``stopping`` and stops it without waiting for it."""
    runs, timeline = timed_runs
    runs.startup_s = 600
    started: list = []
    popen = h.subprocess.Popen

    def popen_then_stop_all(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        runs.stop_all()  # lists no server: this one is not registered yet
        return started[-1]

    monkeypatch.setattr(h.subprocess, "Popen", popen_then_stop_all)
    launch = h.Launch("fake", 1, "off", prompts=("a",), max_new_tokens=4, plugin=False)
    begun = time.monotonic()
    with pytest.raises(h.ServerFailed, match="stopped while starting"):
        runs.get(launch)
    assert time.monotonic() - begun < 30
    assert started[0].poll() is not None and gone(started[0].pid)
    assert not any("ready" in line for _, line in timeline.lines)
    runs.stopping.clear()
    monkeypatch.setattr(h.subprocess, "Popen", popen)
    assert runs.get(launch).launch == launch  # a stop's failure is not memoised


def test_a_signal_while_results_waits_stops_the_batch_and_starts_nothing_more(timed_runs) -> None:
    """A signal handler raising while ``results()`` waits on a thread. Python 3.11's
    ``Thread.join`` then marks that still-running thread as stopped, so a batch that trusted
    ``join`` / ``is_alive`` let its thread go on to the next launch of the series."""
    runs, timeline = timed_runs
    runs.startup_s = 600
    launches = [h.Launch(f"fake{i}", 1, "off", prompts=("a",)) for i in range(2)]

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    def send_once_the_first_server_runs() -> None:
        deadline = time.monotonic() + 60
        while len(server_pids(runs.log_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Thread(target=send_once_the_first_server_runs, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            with runs.start(launches, at_once=False) as servers:
                servers.results()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    try:
        time.sleep(2)  # time enough for a wrongly freed thread to start the second server
        starts = [line for _, line in timeline.lines if "starting server" in line]
        assert len(starts) == 1, starts
        assert len(list(runs.log_dir.glob("*.log"))) == 1
        assert all(servers.finished)
    finally:
        runs.stop_all()  # whatever a failure left running


def _handler_may_run(frame, event: str) -> bool:
    """Whether a pending signal's handler could raise at this trace event of the waiting thread.
    CPython runs it on entering a function and after a CALL instruction returns: every call
    event, and a return event when the caller called with CALL (not ``__enter__`` by a ``with``).
    Every line of e2e.py counts too, more than CPython would, so ours is safe wherever."""
    if event == "call":
        return True
    if event == "line":
        return frame.f_code.co_filename.endswith("e2e.py")
    caller = frame.f_back
    return caller is not None and dis.opname[caller.f_code.co_code[caller.f_lasti]] == "CALL"


def _raise_at_event(number: int, stop: selftest.SignalStop) -> tuple[object, list[str]]:
    """A trace function running the selftest's SIGTERM handler (``stop.handler``: it records the
    stop and raises StopRequested) in the waiting thread's code (threading.py, e2e.py) at the
    ``number``-th point where a signal handler could, and the points it saw. A point may lie in
    a finalizer the garbage collector ran in that thread, as a real signal's may."""
    seen: list[str] = []

    def local(frame, event, arg):
        if event in ("call", "line", "return") and _handler_may_run(frame, event):
            seen.append(f"{frame.f_code.co_name}:{frame.f_lineno}:{event}")
            if len(seen) == number:
                stop.handler(signal.SIGTERM, frame)
        return local

    def global_(frame, event, arg):
        if not frame.f_code.co_filename.endswith(("threading.py", "e2e.py")):
            return None
        return local(frame, event, arg)

    return global_, seen


class _StandInRuns(h.ServerRuns):
    """Stand-in servers that run until ``stop_all``, waited for as the selftest waits: told of
    its signals by ``stop``; ``live`` names those running."""

    def __init__(self, log_dir: Path, stop: selftest.SignalStop) -> None:
        super().__init__(log_dir / "runs", log_dir, stop_requested=stop.requested)
        self.live: list[str] = []

    def get(self, launch: h.Launch) -> h.RunResult:
        self.live.append(launch.name)
        try:
            self.stopping.wait(timeout=30)
            raise h.ServerFailed("stopped", self.log_dir / "log")
        finally:
            self.live.remove(launch.name)


def _batch_interrupted_at(number: int, log_dir: Path) -> tuple[list, list[str], list[str]]:
    """Two servers started at once, waited for as the selftest does, and an interrupt at the
    ``number``-th event of the waiting thread from the ``with`` on. The servers are stand-ins
    that run until ``stop_all``. Returns (how the wait ended, its events, servers left)."""
    stop = selftest.SignalStop()
    runs = _StandInRuns(log_dir, stop)
    trace, seen = _raise_at_event(number, stop)
    outcome: list[BaseException] = []

    def wait_like_the_selftest() -> None:
        launches = [h.Launch(f"fake{i}", 1, "off", prompts=("a",)) for i in range(2)]
        sys.settrace(trace)
        try:
            with runs.start(launches, at_once=True) as servers:
                servers.results()
        except BaseException as exc:
            outcome.append(exc)
        finally:
            sys.settrace(None)

    waiter = threading.Thread(target=wait_like_the_selftest, daemon=True)
    waiter.start()
    waiter.join(timeout=20)
    return outcome, seen, runs.live


def test_an_interrupt_anywhere_in_the_wait_still_stops_the_batch(tmp_path, monkeypatch) -> None:
    """The selftest's signal handler runs at whatever bytecode the main thread is at. A raise
    just after the waiting main thread took a lock its server threads need (inside
    ``threading.Event.wait``, say) leaves it held: the threads block on it and the batch never
    stops (a SIGTERM that CI saw unanswered for 90 s). So it raises in our code (e2e.py) and
    puts the stop off elsewhere (threading.py), for the wait to raise. Here the interrupt
    lands at each event in turn, from starting the threads to two rounds of the wait for them;
    every time the wait must end by it with no server left."""
    monkeypatch.setattr(h.ServerBatch, "SIGNAL_CHECK_S", 0.005)
    monkeypatch.setattr(h.ServerBatch, "STOP_WAIT_S", 5.0)
    number = 0
    while True:
        number += 1
        outcome, seen, live = _batch_interrupted_at(number, tmp_path)
        where = seen[number - 1] if len(seen) >= number else "no such event"
        assert outcome, f"interrupt at event {number} ({where}): the wait never ended"
        # The stop itself, or an error raised while it unwound (a lock released twice in
        # threading.py): the selftest finds it in the chain all the same.
        assert selftest.stop_requested_in(outcome[0]), (number, where, outcome)
        assert not live, f"interrupt at event {number} ({where}): {live} still running"
        rounds = [e for e in seen[:number] if e.startswith("results:") and e.endswith(":line")]
        if rounds and rounds.count(rounds[0]) >= 3:
            break  # two whole rounds of the wait covered
        assert number < 2000, "the wait never came round"


def test_a_stop_whose_raise_a_finalizer_swallowed_still_ends_the_wait(
    tmp_path, monkeypatch
) -> None:
    """CPython runs a signal's handler wherever the main thread is, in a finalizer the garbage
    collector runs there too, and only prints what a finalizer raises. The selftest's
    StopRequested vanished that way in CI: the wait went on, and a second signal was ignored
    as if the first one's cleanup ran. The handler's record ends the wait all the same."""
    monkeypatch.setattr(h.ServerBatch, "SIGNAL_CHECK_S", 0.005)
    monkeypatch.setattr(h.ServerBatch, "STOP_WAIT_S", 5.0)
    swallowed: list = []
    monkeypatch.setattr(sys, "unraisablehook", swallowed.append)
    stop = selftest.SignalStop()
    runs = _StandInRuns(tmp_path, stop)
    launches = [h.Launch(f"fake{i}", 1, "off", prompts=("a",)) for i in range(2)]

    class Garbage:
        pass

    in_e2e = frame_in(h.__name__)  # the handler raises only where our own code runs

    def signal_lands_in_a_finalizer() -> None:
        cycle = Garbage()
        cycle.itself = cycle
        finalizer = weakref.finalize(cycle, stop.handler, signal.SIGTERM, in_e2e)
        del cycle
        gc.collect()
        assert not finalizer.alive

    begun = time.monotonic()
    with pytest.raises(selftest.StopRequested):
        with runs.start(launches, at_once=True) as servers:
            signal_lands_in_a_finalizer()
            servers.results()
    assert time.monotonic() - begun < 10
    assert [type(s.exc_value) for s in swallowed] == [selftest.StopRequested]
    assert not runs.live and all(servers.finished)
