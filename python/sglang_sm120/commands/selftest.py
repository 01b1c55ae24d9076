"""``sglang-sm120 selftest``: prove on this machine's GPUs that the EAGLE-3 fast path works.

Nothing in this project can run a live SGLang server on SM120 hardware except its users' boxes,
so this is the command they run (and the self-hosted GPU workflow runs). Two real servers
(``python -m sglang.launch_server``) run on the first ``--tp`` GPUs:

1. the reference: upstream alone (the plugin's kill switch ``SGLANG_SM120_DISABLE=1``), plain
   greedy decoding, fusion off;
2. EAGLE-3 with the plugin on and CUDA graphs on, the plan of ``sglang-sm120 doctor`` in force.

They are independent, so for the tiny pair they start at the same time, each with a KV pool
capped at ``SHARED_GPU_KV_TOKENS`` (``why_one_after_the_other`` says why only then); otherwise
one after the other, and the progress output says why. Meanwhile the main thread asks doctor
for the plan, once.

The model pair is the tiny DeepSeek-V3 (MLA + MoE) target + EAGLE-3 draft that
``commands.tiny_models`` generates in seconds, built so that greedy outputs are exact and the
accept length is 2.0 by design; or a real pair (``--target`` / ``--draft``). The verdict table
(check, expected, seen, pass/fail) covers: exact greedy equality, TARGET_VERIFY graphs captured
and replayed on every rank, fused all-reduce calls captured in the verify graph when the plan
turns fusion on, the accept length, and no peer timeout (from the plugin's ``graph_stats``
files).

Exit status: 0 every check passed; 1 a check failed; 2 it cannot run here (no GPU, fewer GPUs
than ``--tp``, bad arguments); 130/143 stopped by SIGINT/SIGTERM. Servers are always stopped,
their TP workers included; logs are kept (and their folder printed) unless every check passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sglang_sm120.commands import e2e
from sglang_sm120.commands.args import one_line
from sglang_sm120.machine.facts import HostFacts, describe_gpus, probe_host
from sglang_sm120.planning.policy import VALIDATION_NOTE
from sglang_sm120.version import __version__

FIXTURES = ("deepseek_v3", "llama")
STATS_KEY_PEER_ERROR = "peer_error"
# Each server's KV pool when both share the GPUs (--max-total-tokens): the tiny pair needs at
# most 4 requests x 1024 tokens of context, plus the draft's.
SHARED_GPU_KV_TOKENS = 16384
MEMORY_FLAGS = ("--mem-fraction-static", "--max-total-tokens")
# ``sglang_sm120.commands.tiny_models`` (torch) is imported where used, not here: every CLI command
# builds this subcommand's parser, and importing torch would add seconds to each.


@dataclass(frozen=True)
class Check:
    """One row of the verdict."""

    check: str
    expected: str
    seen: str
    passed: bool


@dataclass(frozen=True)
class AcceptFloor:
    """The accept length a run must reach, and where that number comes from."""

    minimum: float
    source: str
    strict: bool = False  # "> minimum" (no threshold known: any accepted draft token)

    def met(self, accept: float) -> bool:
        return accept > self.minimum if self.strict else accept >= self.minimum

    def __str__(self) -> str:
        return f"{'>' if self.strict else '>='} {self.minimum:.2f} ({self.source})"


@dataclass
class Outcome:
    """A server run: its result, or why it failed and the stats its ranks wrote until then."""

    result: e2e.RunResult | None
    failure: str = ""
    stats: dict[int, dict[str, Any]] = field(default_factory=dict)


def stop_requested_in(exc: BaseException) -> StopRequested | None:
    """The StopRequested behind ``exc``: a signal that lands while a C extension initialises
    (triton's, during SGLang's import) reaches us as that module's ImportError, chained."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, StopRequested):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class StopRequested(BaseException):
    """SIGINT or SIGTERM arrived: unwind (servers stop in ``finally``), then exit."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# ---------------------------------------------------------------- can it run here


def visible_gpus() -> HostFacts:
    """The GPUs this process can really use (NVML, honouring CUDA_VISIBLE_DEVICES).

    Not ``current_facts()``: ``SGLANG_SM120_TOPOLOGY`` describes a machine for planning (the
    servers' plugin and doctor still plan with it), but a profile of 8 GPUs runs no server.
    """
    return probe_host()


def default_tp(gpus: int) -> int:
    """The largest TP size the tiny models shard to that fits the GPUs (at least 1)."""
    return max((t for t in e2e.TP_SIZES if t <= gpus), default=1)


def cannot_run(facts: HostFacts, tp: int | None) -> str | None:
    """Why no selftest can run with these GPUs, as one line; None when it can."""
    have = len(facts.gpus)
    if have == 0:
        why = f" ({facts.probe_error})" if facts.probe_error else ""
        return (
            f"no NVIDIA GPU visible here{why}: the selftest starts SGLang servers on GPUs; "
            "`sglang-sm120 plan --profile ...` plans another machine"
        )
    if tp is not None and tp > have:
        return f"--tp {tp} needs {tp} GPUs; this host has {have} ({describe_gpus(facts.gpus)})"
    return None


# ---------------------------------------------------------------- the verdict


def _per_rank(values: dict[int, Any]) -> str:
    """'3 on each of 2 ranks' when all agree, else 'rank 0: 3, rank 1: 0'."""
    if not values:
        return "no rank reported"
    distinct = set(values.values())
    if len(distinct) == 1 and len(values) > 1:
        return f"{distinct.pop()} on each of {len(values)} ranks"
    return ", ".join(f"rank {rank}: {value}" for rank, value in sorted(values.items()))


def _first_difference(got: list[int], want: list[int]) -> str:
    for i, (x, y) in enumerate(zip(got, want, strict=False)):
        if x != y:
            return f"token {i}: {x} instead of {y}"
    return f"{len(got)} tokens instead of {len(want)}"


def _server_check(name: str, outcome: Outcome) -> Check:
    if outcome.result is not None:
        seen = f"ready after {outcome.result.startup_s:.0f} s"
        return Check(name, "starts and answers", seen, True)
    return Check(name, "starts and answers", outcome.failure or "not run", False)


def greedy_check(reference: e2e.RunResult, spec: e2e.RunResult) -> Check:
    """EAGLE-3 gives token for token the reference's greedy output, alone and batched."""
    n = len(reference.sequential_ids)
    differences = [
        f"{mode} prompt {i}: {_first_difference(got, want)}"
        for mode, outputs in (("one-at-a-time", spec.sequential_ids), ("batched", spec.batched_ids))
        for i, (got, want) in enumerate(zip(outputs, reference.sequential_ids, strict=False))
        if got != want
    ]
    if len(spec.sequential_ids) != n or len(spec.batched_ids) != n:
        differences.append(f"{len(spec.sequential_ids)} outputs for {n} prompts")
    return Check(
        "greedy output: EAGLE-3 == plain reference",
        f"{n}/{n} prompts identical, one at a time and batched",
        "; ".join(differences) or f"{n}/{n} identical, one at a time and batched",
        not differences,
    )


def designed_tokens_check(reference: e2e.RunResult, successor: list[int | None]) -> Check:
    """The reference itself follows the tiny fixture's designed next tokens (so equality with
    it means something)."""
    n = len(reference.sequential_ids)
    broken = [
        f"prompt {p}: token {i}"
        for p, ids in enumerate(reference.sequential_ids)
        for i in range(1, len(ids))
        if successor[ids[i - 1]] != ids[i]
    ]
    return Check(
        "reference follows the fixture's designed tokens",
        f"{n}/{n} prompts",
        "; ".join(broken[:3]) or f"{n}/{n} prompts",
        not broken,
    )


def graph_checks(spec: e2e.RunResult, tp: int) -> list[Check]:
    """Every rank captured the verify CUDA graph and replayed it once per verify pass."""
    after, before = spec.stats_after, spec.stats_before
    missing = sorted(set(range(tp)) - set(after))
    problem = spec.stats_problem or (f"no stats from ranks {missing}" if missing else None)
    captured = {rank: e2e.count(after[rank], "graph_captures") for rank in after}
    replayed = {
        rank: e2e.count(after[rank], "graph_replays")
        - e2e.count(before.get(rank, {}), "graph_replays")
        for rank in after
    }
    passes = spec.verify_count
    return [
        Check(
            f"{e2e.VERIFY_MODE} CUDA graph captured",
            f"> 0 graphs on each of {tp} rank(s)",
            problem or _per_rank(captured),
            problem is None and all(v > 0 for v in captured.values()),
        ),
        Check(
            f"{e2e.VERIFY_MODE} CUDA graph replayed",
            f">= {passes} replays (one per verify pass) on each rank",
            problem or _per_rank(replayed),
            problem is None and passes > 0 and all(v >= passes for v in replayed.values()),
        ),
    ]


def _served(stats: dict[str, Any]) -> str:
    fusion, plain = stats.get("fusion_backend"), stats.get("plain_allreduce")
    return f"fusion={fusion or 'off'}, plain all-reduce={plain}"


def plan_checks(spec: e2e.RunResult, plan: dict[str, Any] | None, layers: int) -> list[Check]:
    """The ranks run the plan; the verify graph holds fused calls exactly when they fuse."""
    ranks = spec.stats_after
    served = {rank: _served(s) for rank, s in ranks.items()}
    if plan is None:
        plan_check = Check("ranks run the plan", "the plan of doctor", "no plan", False)
    elif not plan.get("managed", True):  # not SM12x: the plugin leaves every choice to upstream
        plan_check = Check("ranks run the plan", "upstream's own choice", _per_rank(served), True)
    else:
        wanted = _served(plan)
        ok = bool(served) and all(v == wanted for v in served.values())
        plan_check = Check("ranks run the plan", wanted, _per_rank(served), ok)
    fused = {rank: e2e.count(s, "fused_allreduce_in_capture") for rank, s in ranks.items()}
    graphs = {rank: e2e.count(s, "graph_captures") for rank, s in ranks.items()}
    # A tuning table may fuse only some token counts (others go unfused or to another
    # backend): then only some captured graphs hold fused calls, or none.
    routes = (plan or {}).get("routes") or {}
    backend = (plan or {}).get("fusion_backend")
    fused_routes = [b for b in routes.values() if b == backend]
    every_graph = not routes or len(fused_routes) == len(routes)
    fuses_somewhere = not routes or bool(fused_routes)  # else it serves plain all-reduces only
    fusing = {rank for rank, s in ranks.items() if s.get("fusion_backend") and fuses_somewhere}

    def fused_ok(r: Any) -> bool:
        if r not in fusing:
            return fused[r] == 0
        return fused[r] >= (layers * graphs[r] if every_graph else layers) > 0

    ok = bool(ranks) and all(fused_ok(r) for r in ranks)
    if not fusing:
        expected = "0 (fusion off or routed unfused at every size)"
    elif every_graph:
        expected = f">= {layers} per captured verify graph ({layers} layers) on fusing ranks"
    else:
        expected = f">= {layers} ({layers} layers, one fused graph) on fusing ranks"
    fused_check = Check(
        "fused all-reduce + RMSNorm in the verify graph", expected, _per_rank(fused), ok
    )
    return [plan_check, fused_check]


def peer_errors(stats: dict[int, dict[str, Any]]) -> dict[int, str]:
    """Ranks whose sm120_pcie peer-timeout check fired (a missing key counts as none)."""
    return {
        rank: s[STATS_KEY_PEER_ERROR] for rank, s in stats.items() if s.get(STATS_KEY_PEER_ERROR)
    }


def _peer_check(stats: dict[int, dict[str, Any]]) -> Check:
    errors = peer_errors(stats)
    seen = _per_rank(errors) if errors else "none"
    return Check("no peer timeout (sm120_pcie)", "none", seen, not errors)


def evaluate(
    *,
    tp: int,
    reference: Outcome,
    spec: Outcome,
    plan: dict[str, Any] | None,
    layers: int,
    floor: AcceptFloor,
    successor: list[int | None] | None = None,
) -> list[Check]:
    """Every check of the verdict, from the two server runs."""
    checks = [
        _server_check("reference server (upstream alone, plain)", reference),
        _server_check("EAGLE-3 server (plugin on, CUDA graphs)", spec),
    ]
    run = spec.result
    if run is None:  # what its ranks wrote before it failed may still name a peer timeout
        return [*checks, _peer_check(spec.stats)]
    if reference.result is not None:
        checks.append(greedy_check(reference.result, run))
        if successor is not None:
            checks.append(designed_tokens_check(reference.result, successor))
    checks += graph_checks(run, tp)
    checks += plan_checks(run, plan, layers)
    accept = run.accept_length()
    checks.append(
        Check(
            "accept length",
            str(floor),
            f"{accept:.2f} ({run.completion_tokens} tokens / {run.verify_count} verify passes)",
            floor.met(accept),
        )
    )
    return [*checks, _peer_check(run.stats_after)]


# ---------------------------------------------------------------- reporting


def format_verdict(checks: list[Check]) -> str:
    """The verdict as a text table, one row per check."""
    rows = [("check", "expected", "seen", "result")]
    rows += [(c.check, c.expected, c.seen, "pass" if c.passed else "FAIL") for c in checks]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [
        "  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[3]])
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def plan_lines(plan: dict[str, Any] | None, tp: int, backend: str) -> list[str]:
    if plan is None:
        return [f"plan (tp={tp}, backend {backend}): unknown, sglang-sm120 doctor failed"]
    lines = [
        f"plan in force (tp={tp}, {e2e.BACKEND_ENV}={backend}): "
        f"fusion={plan.get('fusion_backend') or 'off'}, "
        f"plain all-reduce={plan.get('plain_allreduce')}"
    ]
    return lines + [f"  - {reason}" for reason in plan.get("reasons", [])]


class Progress:
    """A line per stage on stderr, with the seconds since the selftest started; whole lines
    also when two servers' threads report at once."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self.lock:
            print(f"[{time.monotonic() - self.start:5.0f} s] {line}", file=sys.stderr, flush=True)


class SignalStop:
    """The selftest's SIGINT/SIGTERM handler and its record. The handler raises StopRequested
    once, so every ``finally`` stops its server; a second signal while that cleanup runs is
    ignored rather than cutting it short. CPython runs the handler wherever the main thread is,
    in a finalizer the garbage collector runs there too, and only prints what a finalizer
    raises: ``requested`` lets the waits raise that stop again.

    It raises only in our own code or a module body (``raising_is_safe``). Raised in library
    code that had just taken a lock (importlib after taking its global lock, in a module lock's
    weakref callback), the stop left that lock held while server threads imported, and every
    thread blocked on it for good. A stop that lands elsewhere is put off: ``stop_on_signals``
    sends its signal to the main thread again until it lands where it may raise, and every
    wait that asks ``requested`` raises it."""

    NUDGE_S = 0.01  # how often a put-off stop's signal is sent to the main thread again

    def __init__(self) -> None:
        self.signum: int | None = None
        self.delivered = False  # raised by the handler, or handed to a wait by ``requested``
        self.closing = False  # stop_on_signals is restoring the handlers: record only

    def handler(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        if self.delivered or self.closing or not raising_is_safe(frame):
            return
        self.delivered = True
        raise StopRequested(self.signum)

    @property
    def put_off(self) -> bool:
        """A stop recorded and not yet raised."""
        return self.signum is not None and not self.delivered and not self.closing

    def requested(self) -> StopRequested | None:
        if self.signum is None:
            return None
        self.delivered = True
        return StopRequested(self.signum)


def raising_is_safe(frame: Any) -> bool:
    """Whether the main thread, interrupted at ``frame``, runs our own code (its waits are
    written for a raise anywhere) or the body of a module being imported (importlib unwinds
    that import and releases its locks: SGLang's import, asking for the plan, takes seconds),
    and not this handler itself, which a second signal can enter again: raised there, the
    stop would leave the first call where it was put off."""
    if frame is None:
        return False
    module = frame.f_globals.get("__name__", "")
    if module == "importlib" or module.startswith("importlib."):
        return False
    if not module.startswith("sglang_sm120.") and frame.f_code.co_name != "<module>":
        return False
    while frame is not None:
        if frame.f_code in _HANDLER_CODES:
            return False
        frame = frame.f_back
    return True


_HANDLER_CODES = frozenset({SignalStop.handler.__code__, raising_is_safe.__code__})


def _nudge(stop: SignalStop, main_thread: int, done: threading.Event) -> None:
    """Sends a put-off stop's signal to the main thread again every ``NUDGE_S`` until it is
    raised. A thread, not an interval timer: SIGALRM is the process's (libraries use it), and
    a signal sent to the main thread alone waits while ``e2e._stop`` blocks it there."""
    while not done.wait(SignalStop.NUDGE_S):
        signum = stop.signum
        if stop.put_off and signum is not None and not done.is_set():
            signal.pthread_kill(main_thread, signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[SignalStop]:
    """SIGINT and SIGTERM handled by a SignalStop while the block runs."""
    stop = SignalStop()
    previous = {s: signal.signal(s, stop.handler) for s in (signal.SIGINT, signal.SIGTERM)}
    done = threading.Event()
    nudger = threading.Thread(
        target=_nudge,
        args=(stop, threading.main_thread().ident, done),
        name="selftest-stop-nudge",
        daemon=True,
    )
    nudger.start()
    try:
        yield stop
    finally:
        stop.closing = True  # a signal from here on is recorded, not raised
        done.set()
        nudger.join(timeout=5)
        for signum, old in previous.items():
            signal.signal(signum, old)


# ---------------------------------------------------------------- the run


@dataclass(frozen=True)
class Pair:
    """The model pair under test; ``fixture`` is the tiny models' manifest when it has one."""

    target: str
    draft: str
    fixture: dict[str, Any] | None

    @classmethod
    def at(cls, target: str, draft: str) -> Pair:
        from sglang_sm120.commands import tiny_models

        manifest = Path(target) / tiny_models.FIXTURE_FILE
        fixture = json.loads(manifest.read_text()) if manifest.is_file() else None
        return cls(target, draft, fixture)

    def prompts(self) -> tuple[tuple[str, ...], int]:
        from sglang_sm120.commands import tiny_models

        if self.fixture is not None:
            return tiny_models.PROMPTS, e2e.GREEDY_TOKENS
        return e2e.chat_prompts(self.target), e2e.REAL_MAX_NEW_TOKENS

    def accept_floor(self, min_accept: float | None) -> AcceptFloor:
        from sglang_sm120.commands import tiny_models

        if min_accept is not None:
            return AcceptFloor(min_accept, "--min-accept")
        if self.fixture is not None:
            designed = self.fixture.get(
                "designed_accept_length", tiny_models.DESIGNED_ACCEPT_LENGTH
            )
            floor = self.fixture.get("min_accept_length", tiny_models.MIN_ACCEPT_LENGTH)
            return AcceptFloor(floor, f"designed {designed}, less requests cut short")
        known = e2e.known_threshold(self.target, self.draft)
        if known is not None:
            return AcceptFloor(*known)
        return AcceptFloor(1.0, "no threshold recorded for this pair; --min-accept sets one", True)


def why_one_after_the_other(pair: Pair, server_args: tuple[str, ...]) -> str | None:
    """Why the reference and the EAGLE-3 server cannot start at the same time, or None.

    SGLang 0.5.23 sizes a server's KV pool as the GPU memory free once its weights are loaded,
    less ``(1 - --mem-fraction-static)`` of what was free when that server started: two servers
    starting together both count the same free memory, so with equal shares the second to
    allocate finds none, and with unequal ones it depends on which allocates first. The tiny
    pair needs little, so each pool is capped
    (``--max-total-tokens``) and the rest stays free. A real pair's memory is SGLang's to size,
    and a user who sizes it (``MEMORY_FLAGS`` in ``--server-arg``) gets what they asked for.
    """
    if pair.fixture is None:
        return "a real --target pair: SGLang sizes its memory, one server at a time"
    sized = [arg.split("=")[0] for arg in server_args if arg.split("=")[0] in MEMORY_FLAGS]
    if sized:
        return f"--server-arg {sized[0]} sizes their memory, for one server at a time"
    return None


def _outcome(result: e2e.RunResult | e2e.ServerFailed) -> Outcome:
    """A server's outcome; a failure is summarised (first line, last log line, the log kept)."""
    if isinstance(result, e2e.RunResult):
        return Outcome(result)
    what = str(result).splitlines()[0].rstrip(":")
    try:
        lines = [line.strip() for line in result.log.read_text(errors="replace").splitlines()]
    except OSError:
        lines = []
    last = next((line for line in reversed(lines) if line), "")
    ends = f"; log ends: {last[:160]}" if last else ""
    stats = e2e.read_stats(result.stats_dir) if result.stats_dir else {}
    return Outcome(None, f"{what}{ends} (log: {result.log})", stats)


def ask_plan(tp: int, target: str, backend: str, progress: Progress) -> dict[str, Any] | None:
    """doctor's plan for the servers, or None (said in the progress output) when it fails."""
    progress(f"asking sglang-sm120 doctor for the plan at tp={tp}")
    try:
        return e2e.plan_for(
            tp, e2e.model_arch(target), backend, e2e.hidden_size(target), e2e.model_dtype(target)
        )
    except (RuntimeError, ValueError, KeyError) as exc:  # ValueError: its output was not JSON
        lines = str(exc).strip().splitlines() or [repr(exc)]
        progress(
            f"no plan: {lines[0]} ... {lines[-1]}" if len(lines) > 1 else f"no plan: {lines[0]}"
        )
        return None


def run_selftest(
    args: argparse.Namespace, tp: int, work: Path, log_dir: Path, stop: SignalStop | None = None
) -> dict[str, Any]:
    """Both servers, then the verdict; the report as data. ``stop``: the signal handler whose
    stop the wait for the servers raises (if its own raise was lost)."""
    from sglang_sm120.server.runtime import validation_mode

    progress = Progress()
    if args.target:
        pair = Pair.at(args.target, args.draft)
    else:
        from sglang_sm120.commands.tiny_models import build_all

        progress(f"generating the tiny {args.fixture} target + EAGLE-3 draft in {work}")
        built = build_all(work / "models")[args.fixture]
        pair = Pair.at(str(built.target), str(built.draft))
    arch, layers = e2e.model_arch(pair.target), e2e.num_layers(pair.target)
    prompts, max_new_tokens = pair.prompts()
    extra = e2e.split_server_args(args.server_arg)
    why_not = why_one_after_the_other(pair, extra)
    if why_not is None:
        server_start = (
            "at the same time: the tiny pair, each server's KV pool capped at "
            f"{SHARED_GPU_KV_TOKENS} tokens (--max-total-tokens)"
        )
    else:
        server_start = f"one after the other: {why_not}"
    progress(f"starting the reference and the EAGLE-3 server {server_start}")
    common = {
        "tp": tp,
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "max_total_tokens": SHARED_GPU_KV_TOKENS if why_not is None else None,
        "extra_args": extra,
    }
    launches = (
        e2e.Launch(pair.target, backend="off", plugin=False, **common),
        e2e.Launch(pair.target, backend=args.backend, draft=pair.draft, **common),
    )
    runs = e2e.ServerRuns(
        work / "runs", log_dir, progress, stop_requested=(stop or SignalStop()).requested
    )
    # The plan is asked for in this (the main) thread while the servers start: a signal
    # stops doctor's subprocess as it stops the servers.
    with runs.start(launches, at_once=why_not is None) as servers:
        plan = ask_plan(tp, pair.target, args.backend, progress)
        reference, spec = (_outcome(result) for result in servers.results())
    checks = evaluate(
        tp=tp,
        reference=reference,
        spec=spec,
        plan=plan,
        layers=layers,
        floor=pair.accept_floor(args.min_accept),
        successor=(pair.fixture or {}).get("successor"),
    )
    return {
        "ok": all(c.passed for c in checks),
        "sglang_sm120": __version__,
        "tp": tp,
        "backend": args.backend,
        "validation_mode": validation_mode(),
        "server_args": list(extra),
        "server_start": server_start,
        "target": pair.target if args.target else f"tiny {args.fixture} ({arch})",
        "draft": pair.draft if args.target else "tiny EAGLE-3 draft",
        "plan": plan,
        "checks": [asdict(c) for c in checks],
        "servers": {
            name: {"startup_s": round(o.result.startup_s, 1), "log": str(o.result.log)}
            if o.result
            else {"failure": o.failure}
            for name, o in (("reference", reference), ("eagle3", spec))
        },
        "elapsed_s": round(time.monotonic() - progress.start, 1),
    }


def local_model_problem(model: str) -> str | None:
    """What is wrong with a --target/--draft that names a local path (it starts with /, . or ~,
    or exists), or None: such a path must be a model directory, while anything else
    (``org/name``) is a Hugging Face repo id, read from the HF cache as before."""
    path = Path(model).expanduser()
    if not (model.startswith(("/", ".", "~")) or path.exists()):
        return None
    if not path.exists():
        return "no such directory"
    if not path.is_dir():
        return "is a file, not a model directory (give the folder with config.json)"
    return None


def _usage_error(args: argparse.Namespace) -> str | None:
    try:
        e2e.split_server_args(args.server_arg)
    except ValueError as exc:
        return f"--server-arg {args.server_arg}: {exc}"
    if bool(args.target) != bool(args.draft):
        return "--target and --draft go together"
    if args.tp is not None and args.tp < 1:
        return f"--tp must be at least 1, not {args.tp}"
    if not args.target and args.tp is not None and args.tp not in e2e.TP_SIZES:
        return f"the tiny models shard to tp {', '.join(map(str, e2e.TP_SIZES))}, not {args.tp}"
    models = (("--target", args.target), ("--draft", args.draft))
    for flag, model in models:
        local = local_model_problem(model) if model else None
        if local:
            return f"{flag} {model}: {local}"
    for flag, model in models:
        if model:
            try:
                e2e.model_config(model)
            except Exception as exc:  # OSError, JSON, hub errors: all say "cannot read it"
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                return f"cannot read the config of {flag} {model}: {first}"
    return None


def print_report(report: dict[str, Any], out: Any) -> None:
    checks = [Check(**c) for c in report["checks"]]
    failed = sum(not c.passed for c in checks)
    lines = []
    if report.get("validation_mode"):
        lines.append(f"VALIDATION MODE ON: {VALIDATION_NOTE}; not a result for SM12x hardware")
    if report.get("server_args"):
        lines.append(f"extra server arguments: {shlex.join(report['server_args'])}")
    lines += [*plan_lines(report["plan"], report["tp"], report["backend"]), ""]
    lines += [format_verdict(checks), ""]
    lines.append(
        f"FAIL: {failed} of {len(checks)} checks" if failed else f"PASS: all {len(checks)} checks"
    )
    if report["logs"]:
        lines.append(f"server logs kept in {report['logs']}")
    print("\n".join(lines), file=out)


def run(args: argparse.Namespace) -> int:
    """The ``selftest`` subcommand; returns the exit status."""
    from sglang_sm120.server.runtime import plugin_backend

    for name in ("target", "draft"):  # "--target=~/m" reaches us unexpanded
        if getattr(args, name):
            setattr(args, name, os.path.expanduser(getattr(args, name)))
    problem = _usage_error(args)
    gpus = visible_gpus()
    problem = problem or cannot_run(gpus, args.tp)
    if problem:
        print(f"sglang-sm120 selftest: {one_line(problem)}", file=sys.stderr)
        return 2
    tp = args.tp or default_tp(len(gpus.gpus))
    args.backend = args.backend or plugin_backend() or "auto"
    keep = Path(args.keep_logs) if args.keep_logs else None
    log_dir = keep or Path(tempfile.mkdtemp(prefix="sglang-sm120-selftest-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="sglang-sm120-selftest-"))
    out = sys.stderr if args.json else sys.stdout
    print(f"sglang-sm120 {__version__} selftest on {describe_gpus(gpus.gpus[:tp])}", file=out)
    with stop_on_signals() as signals:
        try:
            report = run_selftest(args, tp, work, log_dir, signals)
            late = signals.requested()  # a stop put off until the work was done
            if late is not None:
                raise late
        except BaseException as exc:
            stop = stop_requested_in(exc)
            if stop is None:
                raise
            print(
                f"sglang-sm120 selftest: stopped by {stop}; servers stopped; "
                f"logs kept in {log_dir}",
                file=sys.stderr,
            )
            return 128 + stop.signum
        finally:
            shutil.rmtree(work, ignore_errors=True)
        report["logs"] = str(log_dir) if keep or not report["ok"] else None
        if report["logs"] is None:
            shutil.rmtree(log_dir, ignore_errors=True)
    print_report(report, out)
    if args.json:
        print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("selftest", help="prove the EAGLE-3 fast path on this machine's GPUs")
    parser.add_argument("--tp", type=int, help="GPUs to use (default: the most of 1/2/4/8 here)")
    parser.add_argument("--target", help="a real target model (path or hub id in the HF cache)")
    parser.add_argument("--draft", help="its EAGLE-3 draft (with --target)")
    parser.add_argument(
        "--fixture",
        choices=FIXTURES,
        default="deepseek_v3",
        help="tiny pair to generate when no --target is given (default deepseek_v3: MLA + MoE, "
        "a fused-all-reduce architecture)",
    )
    parser.add_argument(
        "--backend",
        choices=e2e.BACKENDS,
        default=None,
        help=f"fused all-reduce backend to test (default: {e2e.BACKEND_ENV} or auto)",
    )
    parser.add_argument("--min-accept", type=float, help="accept length the pair must reach")
    parser.add_argument("--keep-logs", metavar="DIR", help="write server logs here and keep them")
    parser.add_argument(
        "--server-arg",
        action="append",
        metavar="ARG",
        help="extra argument for both servers, repeatable, split as a shell would; write it "
        "with '=' since it starts with '--': --server-arg=--attention-backend=triton",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON (stdout)")
    parser.set_defaults(func=run)
