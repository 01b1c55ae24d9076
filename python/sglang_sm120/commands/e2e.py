"""End-to-end harness: start real SGLang servers, send greedy requests, read the plugin's stats.

Used by ``sglang-sm120 selftest`` and by the e2e test suite (test/e2e/, which skips with the
reason where GPUs or packages are missing). Each server runs on the first ``tp`` visible GPUs,
in its own process group; it is stopped, workers included, as soon as its results are collected,
and also when it fails or the caller is interrupted. ``ServerRuns.get`` runs one server;
``ServerRuns.start`` runs several in background threads, at the same time or one after the
other, while the caller does other work. Results, and failures, are memoised per launch, so the
checks (greedy equality, graph replays, fused all-reduce, accept length) share one server each
and a server that failed in the background is reported, not started again.

Environment knobs of the e2e test suite (all optional):

- ``SGLANG_SM120_E2E_TP``: comma list of TP sizes to try (default 1,2,4,8, capped by the GPUs).
- ``SGLANG_SM120_E2E_BACKENDS``: comma list among off,auto,trtllm,sm120_pcie (default all).
- ``SGLANG_SM120_FIXTURE_DIR``: where the tiny models are generated (default: a pytest tmp dir).
- ``SGLANG_SM120_E2E_TARGET`` / ``SGLANG_SM120_E2E_DRAFT``: a real model pair (local path or a
  hub id already in the HF cache); ``SGLANG_SM120_E2E_MIN_ACCEPT`` overrides its threshold.
- ``SGLANG_SM120_E2E_REAL_TP``: TP sizes for the real pair (default: the largest one available).
- ``SGLANG_SM120_E2E_REAL_TREE``: steps,topk,draft tokens for the real pair (default 3,1,4).
- ``SGLANG_SM120_E2E_STARTUP_S``: server start-up timeout (default 900; selftest reads it too).
- ``SGLANG_SM120_E2E_PARALLEL``: how many servers the suite runs at the same time, overall
  (``ServerRuns``'s ``max_running``); tiny-pair ones get a capped KV pool (default 4; 1: one
  after the other).
- ``SGLANG_SM120_E2E_LOG_DIR``: keep server logs there (CI uploads them); default a tmp dir.
- ``SGLANG_SM120_E2E_SERVER_ARGS``: extra arguments for every server, split as a shell would
  (e.g. ``--attention-backend triton`` where FA3 is missing); selftest's ``--server-arg``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_sm120.server.env_report import E2E_STARTUP_S, LIST_KNOBS

TP_SIZES = (1, 2, 4, 8)
BACKENDS = ("off", "auto", "trtllm", "sm120_pcie")
# How each backend choice is expressed: the plugin's env var, SGLang's own server flag where one
# exists, and the matching `sglang-sm120 doctor` flags (so the plan asked for is the one served).
BACKEND_ENV = "SGLANG_SM120_FUSION_BACKEND"
BACKEND_SERVER_ARGS = {
    "off": ["--enforce-disable-flashinfer-allreduce-fusion"],
    "auto": [],
    "trtllm": ["--flashinfer-allreduce-fusion-backend", "trtllm"],
    "sm120_pcie": [],
}
BACKEND_DOCTOR_ARGS = {
    "off": ["--enforce-disable-fusion"],
    "auto": [],
    "trtllm": ["--fusion-backend", "trtllm"],
    "sm120_pcie": [],
}
# Small trees keep the verify graphs small: steps, topk, draft tokens.
SMALL_TREE = (3, 1, 4)
STATS_ENV = "SGLANG_SM120_STATS_DIR"
DISABLE_ENV = "SGLANG_SM120_DISABLE"
VERIFY_MODE = "TARGET_VERIFY"
GREEDY_TOKENS = 32

REAL_PROMPTS = (
    "Explain how a CPU cache works in three short paragraphs.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "List five facts about the planet Mars.",
    "Summarise the plot of Romeo and Juliet.",
    "What is the difference between TCP and UDP?",
    "Give me a recipe for a simple tomato soup.",
    "Translate 'good morning, how are you?' into French and German.",
    "Why is the sky blue? Answer for a ten-year-old.",
)
REAL_MAX_NEW_TOKENS = 64


@dataclass(frozen=True)
class PairThreshold:
    """Minimum accept length for a known (target, draft) pair with the small tree."""

    target_contains: str
    draft_contains: str
    min_accept: float
    source: str


KNOWN_PAIRS = (
    PairThreshold(
        "llama-3.1-8b-instruct", "eagle3", 2.26, "SGLang's own EAGLE-3 gate for this pair"
    ),
    PairThreshold("qwen3-8b", "eagle3", 2.0, "conservative floor; not yet measured on our runners"),
)


def known_threshold(target: str, draft: str) -> tuple[float, str] | None:
    """(min accept length, where it comes from) recorded for a real pair, or None."""
    t, d = Path(target).name.lower(), Path(draft).name.lower()
    for known in KNOWN_PAIRS:
        if known.target_contains in t and known.draft_contains in d:
            return known.min_accept, known.source
    return None


def env_list(name: str, default: tuple) -> tuple:
    """A comma list: the integer knobs (``env_report.LIST_KNOBS``) checked by their reader,
    each item 1..its bound (a bad one: one warning, ``default``); other lists as words."""
    knob = next((k for k in LIST_KNOBS if k.name == name), None)
    if knob is not None:
        return dataclasses.replace(knob, default=default).read()
    raw = os.environ.get(name, "").strip()
    return tuple(x.strip() for x in raw.split(",") if x.strip()) or default


SERVER_ARGS_ENV = "SGLANG_SM120_E2E_SERVER_ARGS"


def split_server_args(values: list[str] | tuple[str, ...] | str | None) -> tuple[str, ...]:
    """Extra server arguments, each value split as a shell would ("--attention-backend triton"
    and "--attention-backend=triton" both work); ValueError on unbalanced quotes."""
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    return tuple(token for value in values for token in shlex.split(value))


def env_server_args() -> tuple[str, ...]:
    """The e2e suite's extra server arguments (SGLANG_SM120_E2E_SERVER_ARGS)."""
    return split_server_args(os.environ.get(SERVER_ARGS_ENV))


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def missing_prerequisite() -> str | None:
    """Why the e2e suite cannot run here, or None."""
    if gpu_count() == 0:
        return "needs CUDA GPUs: torch sees none here"
    if importlib.util.find_spec("sglang") is None:
        return "needs sglang (pip install sglang==0.5.23)"
    if importlib.util.find_spec("sglang_sm120") is None:
        return "needs the sglang-sm120 plugin installed (pip install -e .)"
    if shutil.which("sglang-sm120") is None:
        return "needs the sglang-sm120 console script on PATH"
    return None


def gpu_env(tp: int, plugin: bool = True) -> dict[str, str]:
    """Environment pinning a launch to the first ``tp`` GPUs this process may use, with the
    plugin on (or off through its kill switch, for an upstream reference)."""
    env = dict(os.environ)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = [x for x in visible.split(",") if x] if visible else [str(i) for i in range(tp)]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:tp])
    plugins = env.get("SGLANG_PLUGINS")
    if plugins and "sglang_sm120" not in plugins.split(","):
        env["SGLANG_PLUGINS"] = plugins + ",sglang_sm120"
    env.pop(DISABLE_ENV, None)
    if not plugin:
        env[DISABLE_ENV] = "1"
    return env


def model_config(model: str) -> dict[str, Any]:
    """The model's config.json: a local folder, else the HF cache through transformers."""
    path = Path(model) / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model).to_dict()


def model_arch(model: str) -> str:
    return model_config(model)["architectures"][0]


def _text_config(model: str) -> dict[str, Any]:
    config = model_config(model)
    return config.get("text_config") or config  # multimodal models nest the language model


def num_layers(model: str) -> int:
    return int(_text_config(model)["num_hidden_layers"])


def hidden_size(model: str) -> int:
    return int(_text_config(model)["hidden_size"])


def model_dtype(model: str) -> str:
    """The dtype a server runs the model in (``--dtype auto``), decided by SGLang's own rule
    from the language model's config (a multimodal one nests it in ``text_config``, which may
    leave the dtype to the outer config): e.g. ``"bfloat16"``; ``float32`` runs as float16."""
    from sglang.srt.configs.model_config import _get_and_verify_dtype

    config, text = model_config(model), _text_config(model)
    declared = next(
        (c[k] for c in (text, config) for k in ("dtype", "torch_dtype") if c.get(k)), None
    )
    model_type = text.get("model_type", "")
    resolved = _get_and_verify_dtype({"dtype": declared, "model_type": model_type}, "auto")
    return str(resolved).removeprefix("torch.")


def chat_prompts(target: str, prompts: tuple[str, ...] = REAL_PROMPTS) -> tuple[str, ...]:
    """The prompts in the target's chat format when it has one (drafts are trained on it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    if not getattr(tokenizer, "chat_template", None):
        return prompts
    return tuple(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    )


# ---------------------------------------------------------------- plan (what the plugin chooses)

_PLANS: dict[tuple[int, str, str, int | None, str | None], dict[str, Any]] = {}


def plan_for(
    tp: int, model_arch: str, backend: str, hidden: int | None = None, dtype: str | None = None
) -> dict[str, Any]:
    """``sglang-sm120 doctor --json`` plan for this host at ``tp`` with the backend asked for,
    in the environment the server gets; ``hidden`` and ``dtype`` (``model_dtype``; doctor
    assumes bfloat16) are the model's, which pick the tuning table and PCIe-IPC (bf16 only)."""
    key = (tp, model_arch, backend, hidden, dtype)
    if key not in _PLANS:
        env = gpu_env(tp)
        env[BACKEND_ENV] = backend
        cli = [sys.executable, "-m", "sglang_sm120.commands.cli"]
        cmd = [*cli, "doctor", "--json", "--tp", str(tp), "--model-arch", model_arch]
        cmd += ["--hidden", str(hidden)] if hidden else []
        cmd += ["--dtype", dtype] if dtype else []
        try:
            done = subprocess.run(
                cmd + BACKEND_DOCTOR_ARGS[backend],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"{' '.join(cmd)} did not finish in {exc.timeout} s") from exc
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr}")
        _PLANS[key] = json.loads(done.stdout)["plan"]
    return _PLANS[key]


def refused_backend(
    tp: int, model_arch: str, backend: str, hidden: int | None = None, dtype: str | None = None
) -> str | None:
    """Why the plan does not give the fused backend asked for by name, or None."""
    plan = plan_for(tp, model_arch, backend, hidden, dtype)
    fusion = plan.get("fusion_backend")
    if backend in ("trtllm", "sm120_pcie") and fusion != backend:
        reasons = "; ".join(plan.get("reasons", []))
        return f"plan gives fusion={fusion} for {backend} at tp={tp} here: {reasons}"
    return None


# ---------------------------------------------------------------- servers


@dataclass(frozen=True)
class Launch:
    """One server launch; equal launches share one server and one result. ``plugin=False``
    launches upstream alone (the plugin's kill switch), fusion off: the reference."""

    target: str
    tp: int
    backend: str
    draft: str | None = None
    tree: tuple[int, int, int] = SMALL_TREE
    prompts: tuple[str, ...] = ()
    max_new_tokens: int = GREEDY_TOKENS
    plugin: bool = True
    max_total_tokens: int | None = None  # a KV pool of this many tokens; None: SGLang sizes it
    extra_args: tuple[str, ...] = ()  # site-specific flags, after ours (the last one wins)

    @property
    def name(self) -> str:
        mode = "eagle3" if self.draft else "plain"
        plugin = "" if self.plugin else "-plugin-off"
        return f"{Path(self.target).name}-tp{self.tp}-{self.backend}-{mode}{plugin}"

    def server_args(self, port: int) -> list[str]:
        args = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.target,
            "--tp-size",
            str(self.tp),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--random-seed",
            "0",
            "--cuda-graph-max-bs-decode",
            "4",
            "--max-running-requests",
            "4",
            "--mem-fraction-static",
            "0.6",
            "--context-length",
            "1024",
        ]
        if self.draft is not None:
            steps, topk, draft_tokens = self.tree
            args += [
                "--speculative-algorithm",
                "EAGLE3",
                "--speculative-draft-model-path",
                self.draft,
                "--speculative-num-steps",
                str(steps),
                "--speculative-eagle-topk",
                str(topk),
                "--speculative-num-draft-tokens",
                str(draft_tokens),
            ]
        if self.max_total_tokens is not None:
            args += ["--max-total-tokens", str(self.max_total_tokens)]
        return [*args, *BACKEND_SERVER_ARGS[self.backend], *self.extra_args]


@dataclass
class RunResult:
    """What one launch produced: greedy outputs, request metadata and plugin stats per rank."""

    launch: Launch
    sequential_ids: list[list[int]]
    batched_ids: list[list[int]]
    sequential_meta: list[dict[str, Any]]
    stats_before: dict[int, dict[str, Any]]
    stats_after: dict[int, dict[str, Any]]
    log: Path
    stats_problem: str | None = None
    startup_s: float = 0.0

    @property
    def verify_count(self) -> int:
        """Verify passes of the sequential phase (one request at a time: one pass each)."""
        return sum(int(m.get("spec_verify_ct", 0)) for m in self.sequential_meta)

    @property
    def completion_tokens(self) -> int:
        return sum(int(m.get("completion_tokens", 0)) for m in self.sequential_meta)

    def accept_length(self) -> float:
        """Completion tokens per verify pass: SGLang's own definition (meta spec_accept_length,
        the number its accept-length gates use), so thresholds carry over."""
        if self.verify_count == 0:
            return 0.0
        return self.completion_tokens / self.verify_count


class ServerFailed(RuntimeError):
    """A server exited, never became ready or broke off while answering; ``log`` keeps why,
    ``stats_dir`` what the plugin counted until then (a peer timeout, say)."""

    def __init__(self, message: str, log: Path, stats_dir: Path | None = None) -> None:
        super().__init__(message)
        self.log = log
        self.stats_dir = stats_dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http_json(method: str, url: str, body: Any = None, timeout: float = 600) -> Any:
    import requests

    reply = requests.request(method, url, json=body, timeout=timeout)
    reply.raise_for_status()
    return reply.json()


def read_stats(stats_dir: Path, newer_than: float = 0.0) -> dict[int, dict[str, Any]]:
    """Stats of every TP rank (files written by the plugin, keyed by tp_rank); with
    ``newer_than``, only files rewritten after that time."""
    by_rank: dict[int, dict[str, Any]] = {}
    for path in stats_dir.glob("sm120-stats-*.json"):
        try:
            if path.stat().st_mtime < newer_than:
                continue
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # being rewritten right now; the next poll reads it
        if isinstance(data.get("tp_rank"), int):
            by_rank[data["tp_rank"]] = data
    return by_rank


def count(stats: dict[str, Any], key: str, mode: str = VERIFY_MODE) -> int:
    return int((stats.get(key) or {}).get(mode, 0))


class ServerRuns:
    """Launch servers on demand and memoise their results, from any thread. ``progress``, when
    given, hears a line per stage, each naming its server, and one every ``progress_every_s``
    while a server starts; it must be safe to call from several threads. ``max_running`` caps
    the servers alive at once over all callers and batches (None: no cap), since they share
    the GPUs; a launch over the cap waits for a slot. ``stop_requested`` returns the stop a
    signal asked for (None: none); a batch's wait raises it (see ``ServerBatch.results``)."""

    def __init__(
        self,
        work_dir: Path,
        log_dir: Path,
        progress: Callable[[str], None] | None = None,
        max_running: int | None = None,
        stop_requested: Callable[[], BaseException | None] = lambda: None,
    ) -> None:
        self.work_dir = work_dir
        self.log_dir = log_dir
        self.results: dict[Launch, RunResult] = {}
        self.failures: dict[Launch, ServerFailed] = {}
        self.startup_s = E2E_STARTUP_S.read()
        self.progress = progress or (lambda line: None)
        self.progress_every_s = 15.0
        self.stop_requested = stop_requested
        self.started = 0
        self.stopping = threading.Event()  # set by stop_all: no server starts or waits on
        self._lock = threading.Lock()  # guards started, the sets below and _launch_locks
        self._launch_locks: dict[Launch, threading.Lock] = {}
        self._running: set[subprocess.Popen] = set()
        self._ports: set[int] = set()
        self._slots = threading.Semaphore(max_running) if max_running else None

    def get(self, launch: Launch) -> RunResult:
        """The launch's result, running its server unless an earlier call did (a second
        thread asking for the same launch waits for the first one's server). Its ServerFailed
        is memoised too and raised again; one caused by ``stop_all`` is not (a later call may
        start it)."""
        with self._lock:
            launch_lock = self._launch_locks.setdefault(launch, threading.Lock())
        with launch_lock:
            if launch in self.failures:
                raise self.failures[launch]
            if launch not in self.results:
                try:
                    self.results[launch] = self._run(launch)
                except ServerFailed as exc:
                    if not self.stopping.is_set():
                        self.failures[launch] = exc
                    raise
            return self.results[launch]

    def start(self, launches: Sequence[Launch], at_once: bool) -> ServerBatch:
        """Run ``launches`` in the background, at the same time (within ``max_running``) or one
        after the other; use it as ``with runs.start(...) as batch: ...; batch.results()``."""
        return ServerBatch(self, launches, at_once)

    def stop_all(self) -> None:
        """Stop every running server now and start no new one (until ``stopping`` is cleared):
        all are sent SIGTERM first, so their grace periods run side by side."""
        self.stopping.set()
        with self._lock:
            running = list(self._running)
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in running:
            _stop(proc)

    def _reserve(self) -> tuple[int, int]:
        """(this launch's index, a port no other running server of ours was given)."""
        with self._lock:
            index = self.started
            self.started += 1
            port = _free_port()
            while port in self._ports:
                port = _free_port()
            self._ports.add(port)
        return index, port

    def _run(self, launch: Launch) -> RunResult:
        """Run the server holding a slot (``max_running``) for its whole life; waiting for
        one ends when all servers are being stopped."""
        if self._slots is None:
            return self._run_in_slot(launch)
        while not self._slots.acquire(timeout=0.5):
            if self.stopping.is_set():
                raise self._not_started(launch)
        try:
            return self._run_in_slot(launch)
        finally:
            self._slots.release()

    def _not_started(self, launch: Launch) -> ServerFailed:
        log = self.log_dir / f"{launch.name}.log"  # not written: no server started
        return ServerFailed("not started: all servers are being stopped", log)

    def _run_in_slot(self, launch: Launch) -> RunResult:
        if self.stopping.is_set():  # stop_all may have listed the servers already
            raise self._not_started(launch)
        index, port = self._reserve()
        stats_dir = self.work_dir / f"stats-{index}"
        stats_dir.mkdir(parents=True)
        log = self.log_dir / f"{index:02d}-{launch.name}.log"
        env = gpu_env(launch.tp, plugin=launch.plugin)
        env[BACKEND_ENV] = launch.backend
        env[STATS_ENV] = str(stats_dir)
        url = f"http://127.0.0.1:{port}"
        self.progress(f"starting server {launch.name} on port {port} (log {log})")
        try:
            with open(log, "w") as log_file:
                proc = subprocess.Popen(
                    launch.server_args(port),
                    env=env,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: stopped as one below
                )
        except BaseException:
            with self._lock:
                self._ports.discard(port)
            raise
        with self._lock:
            # stop_all sets stopping, then lists _running: either it lists this server or
            # this step sees stopping, so none is left running.
            self._running.add(proc)
            stopped = self.stopping.is_set()
            if stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        try:
            if stopped:
                raise ServerFailed("stopped while starting: all servers are being stopped", log)
            startup_s = self._wait_ready(proc, url, log, launch.name)
            self.progress(f"server {launch.name} ready after {startup_s:.0f} s; sending requests")
            result = self._collect(launch, url, stats_dir, log)
            result.startup_s = startup_s
            return result
        except ServerFailed as exc:
            exc.stats_dir = stats_dir
            raise
        except Exception as exc:
            raise ServerFailed(
                f"server stopped answering ({exc}); exit code {proc.poll()}:\n{_tail(log)}",
                log,
                stats_dir,
            ) from exc
        finally:
            _stop(proc)
            with self._lock:
                self._running.discard(proc)
                self._ports.discard(port)
            self.progress(f"server {launch.name} stopped")

    def _wait_ready(self, proc: subprocess.Popen, url: str, log: Path, name: str) -> float:
        """Seconds until /health answered 200; ServerFailed when it exits, times out or all
        servers are being stopped."""
        import requests

        start = time.monotonic()
        next_note = start + self.progress_every_s
        while time.monotonic() < start + self.startup_s:
            if self.stopping.is_set():
                raise ServerFailed("stopped while starting: all servers are being stopped", log)
            if proc.poll() is not None:
                raise ServerFailed(f"server exited with {proc.returncode}:\n{_tail(log)}", log)
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    return time.monotonic() - start
            except requests.RequestException:
                pass
            if time.monotonic() >= next_note:
                self.progress(f"server {name} still starting, {time.monotonic() - start:.0f} s")
                next_note += self.progress_every_s
            time.sleep(1)
        raise ServerFailed(f"server not ready after {self.startup_s:.0f} s:\n{_tail(log)}", log)

    def _collect(self, launch: Launch, url: str, stats_dir: Path, log: Path) -> RunResult:
        sampling = {"temperature": 0.0, "max_new_tokens": launch.max_new_tokens, "ignore_eos": True}

        def generate(text: Any, max_new_tokens: int = launch.max_new_tokens) -> Any:
            params = {**sampling, "max_new_tokens": max_new_tokens}
            return _http_json("POST", url + "/generate", {"text": text, "sampling_params": params})

        # Warm-up outside the measured window: lazy JIT or first-use work settles here.
        generate(launch.prompts[0], 4)

        def sync() -> Any:  # the tiny request that makes the plugin rewrite its stats
            return generate(launch.prompts[0], 2)

        def stats() -> tuple[dict[int, dict[str, Any]], str | None]:
            if not launch.plugin:  # upstream alone writes no stats
                return {}, None
            return sync_stats(stats_dir, launch.tp, sync)

        before, problem = stats()
        seq_ids, seq_meta = [], []
        for prompt in launch.prompts:
            out = generate(prompt)
            seq_ids.append(list(out["output_ids"]))
            seq_meta.append(out["meta_info"])
        after, problem_after = stats()
        result = RunResult(
            launch, seq_ids, [], seq_meta, before, after, log, problem or problem_after
        )
        result.batched_ids = [list(item["output_ids"]) for item in generate(list(launch.prompts))]
        return result


class ServerBatch:
    """Launches running in background threads: one thread each (at the same time, within
    ``ServerRuns``'s ``max_running``), or one thread running them all in order. Each
    server is a subprocess in its own process group, so a thread only waits on it. Signals
    reach the main thread alone: leaving the ``with`` block by any exception (a signal's
    included) stops every server of ``runs`` before it propagates.

    The main thread waits by polling flags the threads set, sleeping in between, and takes no
    lock the threads need: a signal handler raises at whatever bytecode the main thread is at,
    and one that lands just after it took a lock (inside ``threading.Event.wait``, say) leaves
    that lock held, so a thread setting the event would block for good."""

    STOP_WAIT_S = 180.0  # a server stopped by stop_all leaves its thread within seconds
    # The main thread looks at the flags this often; a signal sent to the process may be handed
    # to any thread, and the main thread runs its handler (it alone does) when it next wakes.
    SIGNAL_CHECK_S = 0.2

    def __init__(
        self,
        runs: ServerRuns,
        launches: Sequence[Launch],
        at_once: bool,
    ) -> None:
        self.runs = runs
        self.launches = tuple(launches)
        self.outcomes: dict[int, RunResult | BaseException] = {}
        everything = list(range(len(self.launches)))
        groups = [[i] for i in everything] if at_once else [everything]
        # Set by each thread, read by the main thread: plain assignments, no lock. Thread.join
        # is not used to wait: on Python 3.11 a join interrupted by a signal marks the
        # still-running thread stopped.
        self.begun = [False] * len(groups)
        self.finished = [False] * len(groups)
        self.threads = [
            threading.Thread(target=self._run, args=(group, slot), daemon=True)
            for slot, group in enumerate(groups)
        ]

    def _run(self, indices: list[int], slot: int) -> None:
        self.begun[slot] = True
        try:
            for i in indices:
                if self.runs.stopping.is_set():
                    return
                try:
                    self.outcomes[i] = self.runs.get(self.launches[i])
                except BaseException as exc:  # handed to the caller's thread by results()
                    self.outcomes[i] = exc
        finally:
            self.finished[slot] = True

    def __enter__(self) -> ServerBatch:
        try:
            for thread in self.threads:
                thread.start()
            return self
        except BaseException:  # a signal while a thread starts: stop what the others began
            self.__exit__(*sys.exc_info())
            raise

    def results(self) -> list[RunResult | ServerFailed]:
        """Each launch's result or its ServerFailed, in order, once all are done; any other
        error of a launch is raised here. A stop a signal asked for is raised here too: its
        handler's own raise is lost where it lands in a finalizer."""
        while not all(self.finished):
            stop = self.runs.stop_requested()
            if stop is not None:
                raise stop
            time.sleep(self.SIGNAL_CHECK_S)  # a pending signal's handler runs as it wakes
        outcomes = [self.outcomes[i] for i in range(len(self.launches))]
        for outcome in outcomes:
            if not isinstance(outcome, (RunResult, ServerFailed)):
                raise outcome
        return outcomes  # type: ignore[return-value]

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """On an exception, stop every server and wait for the threads that began; one that has
        not begun starts nothing, since ``stopping`` stays set until every thread finished."""
        if exc_type is None:
            return
        self.runs.stop_all()
        deadline = time.monotonic() + self.STOP_WAIT_S
        while time.monotonic() < deadline and any(
            begun and not finished
            for begun, finished in zip(self.begun, self.finished, strict=True)
        ):
            time.sleep(self.SIGNAL_CHECK_S)
        if all(self.finished):
            self.runs.stopping.clear()  # else a thread still running must not start another


MTIME_SLACK_S = 0.1


def sync_stats(
    stats_dir: Path, tp: int, nudge: Callable[[], Any], timeout_s: float = 30.0
) -> tuple[dict[int, dict[str, Any]], str | None]:
    """Stats of all ``tp`` ranks, complete up to now: (stats, problem or None).

    The plugin rewrites its file at most once a second, and only when a count changes, so the
    last second of counts is missing until the next change. After a second of quiet, one tiny
    request (``nudge``, 2 tokens) changes a count and every rank rewrites its file with all
    earlier counts. Its own replays may or may not be in that write, so a window between two
    such snapshots holds the requests sent in it plus 0 to 2 verify passes of the nudges.
    """
    time.sleep(1.1)
    # File mtimes come from the kernel's coarse clock, up to a tick behind time.time(); no
    # file was rewritten in the last second of quiet, so a small slack admits no stale one.
    started = time.time() - MTIME_SLACK_S
    nudge()
    deadline = time.monotonic() + timeout_s
    while True:
        stats = read_stats(stats_dir, newer_than=started)
        if len(stats) >= tp:
            return stats, None
        if time.monotonic() > deadline:
            return read_stats(stats_dir), (
                f"fresh stats from ranks {sorted(stats)} of {tp} in {stats_dir} after "
                f"{timeout_s:.0f} s: is the plugin active and does it honour {STATS_ENV}?"
            )
        time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """Stop the server we started and every process of its group: SIGTERM, then SIGKILL to
    whatever is left, also when the launcher itself already exited and left workers behind.
    SIGINT/SIGTERM to us wait until this is done (they are delivered right after)."""
    interrupts = {signal.SIGINT, signal.SIGTERM}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, interrupts)
    try:
        _stop_group(proc, grace_s)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:  # the whole group is gone already
        proc.wait()
        return
    try:
        proc.wait(timeout=grace_s)
        settle = time.monotonic() + 10  # its workers exit right after the launcher
        while _group_alive(proc.pid) and time.monotonic() < settle:
            time.sleep(0.2)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
