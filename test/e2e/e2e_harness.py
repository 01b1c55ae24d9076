"""End-to-end harness: start SGLang servers with the plugin, send greedy requests, read stats.

Needs CUDA GPUs, sglang and the installed ``sglang-sm120`` plugin; every test skips with the
reason where one is missing. One server runs at a time, on the first ``tp`` visible GPUs, and is
stopped as soon as its results are collected; results are memoised per launch so the tests
(greedy equality, graph replays, fused all-reduce, accept length) share one server each.

Environment knobs (all optional):

- ``SGLANG_SM120_E2E_TP``: comma list of TP sizes to try (default 1,2,4,8, capped by the GPUs).
- ``SGLANG_SM120_E2E_BACKENDS``: comma list among off,auto,trtllm,sm120_pcie (default all).
- ``SGLANG_SM120_FIXTURE_DIR``: where the tiny models are generated (default: a pytest tmp dir).
- ``SGLANG_SM120_E2E_TARGET`` / ``SGLANG_SM120_E2E_DRAFT``: a real model pair (local path or a
  hub id already in the HF cache); ``SGLANG_SM120_E2E_MIN_ACCEPT`` overrides its threshold.
- ``SGLANG_SM120_E2E_REAL_TP``: TP sizes for the real pair (default: the largest one available).
- ``SGLANG_SM120_E2E_REAL_TREE``: steps,topk,draft tokens for the real pair (default 3,1,4).
- ``SGLANG_SM120_E2E_STARTUP_S``: server start-up timeout (default 900).
- ``SGLANG_SM120_E2E_LOG_DIR``: keep server logs there (CI uploads them); default a tmp dir.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

FIXTURES_DIR = Path(__file__).resolve().parents[1] / "fixtures"
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
VERIFY_MODE = "TARGET_VERIFY"
GREEDY_TOKENS = 32


def _env_list(name: str, default: tuple) -> tuple:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    cast = type(default[0])
    return tuple(cast(x.strip()) for x in raw.split(",") if x.strip())


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def missing_prerequisite() -> str | None:
    """Why the e2e suite cannot run here, or None."""
    if _gpu_count() == 0:
        return "needs CUDA GPUs: torch sees none here"
    if importlib.util.find_spec("sglang") is None:
        return "needs sglang (pip install sglang==0.5.23)"
    if importlib.util.find_spec("sglang_sm120") is None:
        return "needs the sglang-sm120 plugin installed (pip install -e .)"
    if shutil.which("sglang-sm120") is None:
        return "needs the sglang-sm120 console script on PATH"
    return None


def require_gpus(tp: int) -> None:
    have = _gpu_count()
    if tp > have:
        pytest.skip(f"tp={tp} needs {tp} GPUs; this host has {have}")


def gpu_env(tp: int) -> dict[str, str]:
    """Environment pinning a launch to the first ``tp`` GPUs this test process may use."""
    env = dict(os.environ)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = [x for x in visible.split(",") if x] if visible else [str(i) for i in range(tp)]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:tp])
    plugins = env.get("SGLANG_PLUGINS")
    if plugins and "sglang_sm120" not in plugins.split(","):
        env["SGLANG_PLUGINS"] = plugins + ",sglang_sm120"
    env.pop("SGLANG_SM120_DISABLE", None)
    return env


# ---------------------------------------------------------------- plan (what the plugin chooses)

_PLANS: dict[tuple[int, str, str], dict[str, Any]] = {}


def plan_for(tp: int, model_arch: str, backend: str) -> dict[str, Any]:
    """``sglang-sm120 doctor --json`` plan for this host at ``tp`` with the backend asked for."""
    key = (tp, model_arch, backend)
    if key not in _PLANS:
        env = gpu_env(tp)
        env[BACKEND_ENV] = backend
        cmd = ["sglang-sm120", "doctor", "--json", "--tp", str(tp), "--model-arch", model_arch]
        done = subprocess.run(
            cmd + BACKEND_DOCTOR_ARGS[backend],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr}")
        _PLANS[key] = json.loads(done.stdout)["plan"]
    return _PLANS[key]


def expected_fusion(tp: int, model_arch: str, backend: str) -> str | None:
    """The fusion backend the plan promises, or skip when it refuses the one asked for."""
    plan = plan_for(tp, model_arch, backend)
    fusion = plan.get("fusion_backend")
    reasons = "; ".join(plan.get("reasons", []))
    if backend in ("trtllm", "sm120_pcie") and fusion != backend:
        pytest.skip(f"plan gives fusion={fusion} for {backend} at tp={tp} here: {reasons}")
    return fusion


# ---------------------------------------------------------------- servers


@dataclass(frozen=True)
class Launch:
    """One server launch; equal launches share one server and one result."""

    target: str
    tp: int
    backend: str
    draft: str | None = None
    tree: tuple[int, int, int] = SMALL_TREE
    prompts: tuple[str, ...] = ()
    max_new_tokens: int = GREEDY_TOKENS

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
        return args + BACKEND_SERVER_ARGS[self.backend]


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
    """Launch servers on demand, one at a time, and memoise their results."""

    def __init__(self, work_dir: Path, log_dir: Path) -> None:
        self.work_dir = work_dir
        self.log_dir = log_dir
        self.results: dict[Launch, RunResult] = {}
        self.startup_s = float(os.environ.get("SGLANG_SM120_E2E_STARTUP_S", "900"))

    def get(self, launch: Launch) -> RunResult:
        if launch not in self.results:
            self.results[launch] = self._run(launch)
        return self.results[launch]

    def _run(self, launch: Launch) -> RunResult:
        index = len(self.results)
        stats_dir = self.work_dir / f"stats-{index}"
        stats_dir.mkdir(parents=True)
        name = f"{index:02d}-{Path(launch.target).name}-tp{launch.tp}-{launch.backend}"
        name += "-eagle3" if launch.draft else "-plain"
        log = self.log_dir / f"{name}.log"
        env = gpu_env(launch.tp)
        env[BACKEND_ENV] = launch.backend
        env[STATS_ENV] = str(stats_dir)
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        with open(log, "w") as log_file:
            proc = subprocess.Popen(
                launch.server_args(port),
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stopped as one below
            )
        try:
            self._wait_ready(proc, url, log)
            return self._collect(launch, url, stats_dir, log)
        finally:
            _stop(proc)

    def _wait_ready(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        import requests

        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{_tail(log)}")
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        raise RuntimeError(f"server not ready after {self.startup_s:.0f} s:\n{_tail(log)}")

    def _collect(self, launch: Launch, url: str, stats_dir: Path, log: Path) -> RunResult:
        sampling = {"temperature": 0.0, "max_new_tokens": launch.max_new_tokens, "ignore_eos": True}

        def generate(text: Any, max_new_tokens: int = launch.max_new_tokens) -> Any:
            params = {**sampling, "max_new_tokens": max_new_tokens}
            return _http_json("POST", url + "/generate", {"text": text, "sampling_params": params})

        # Warm-up outside the measured window: lazy JIT or first-use work settles here.
        generate(launch.prompts[0], 4)

        def sync() -> Any:  # the tiny request that makes the plugin rewrite its stats
            return generate(launch.prompts[0], 2)

        before, problem = sync_stats(stats_dir, launch.tp, sync)
        seq_ids, seq_meta = [], []
        for prompt in launch.prompts:
            out = generate(prompt)
            seq_ids.append(list(out["output_ids"]))
            seq_meta.append(out["meta_info"])
        after, problem_after = sync_stats(stats_dir, launch.tp, sync)
        result = RunResult(
            launch, seq_ids, [], seq_meta, before, after, log, problem or problem_after
        )
        result.batched_ids = [list(item["output_ids"]) for item in generate(list(launch.prompts))]
        return result


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
    started = time.time()
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


def _stop(proc: subprocess.Popen) -> None:
    """Stop the server we started and its workers (its own process group)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass


def _tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
