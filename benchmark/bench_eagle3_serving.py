"""Serving speed with and without EAGLE-3: tok/s, TTFT, TPOT and accept length per concurrency.

Against running servers' OpenAI API (``--server NAME=URL``, repeatable), or launching them one
after the other on the same GPUs (``--launch``: a plain server, then the same with
``--speculative-algorithm EAGLE3``). For each server and concurrency (default 1, 4, 16, 32;
1 is the single-stream figure) it streams greedy chat completions and reports:

- output tok/s of the server (all streams) and per stream, TTFT and TPOT (p50 / p90);
- accept length two ways: per request from the server's own accounting (``sglext``
  spec_tokens_details: completion tokens per verify pass) summed over the level, and the
  server's running average (``/server_info`` avg_spec_accept_length); ``/metrics`` is read too
  when the server runs with ``--enable-metrics``.

Prints a table, writes JSON and a PNG (tok/s against concurrency).

Examples::

    python benchmark/bench_eagle3_serving.py --server plain=http://127.0.0.1:30000 \\
        --server eagle3=http://127.0.0.1:30001
    python benchmark/bench_eagle3_serving.py --launch --model /models/Llama-3.1-8B-Instruct \\
        --draft /models/sglang-EAGLE3-Llama-3.1-Instruct-8B --tp 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_OUT_DIR, format_table, save_png, write_json

PROMPTS = (
    "Explain how a CPU cache works in three short paragraphs.",
    "Write a Python function that merges two sorted lists, with a docstring.",
    "List ten facts about the planet Mars.",
    "Summarise the plot of Romeo and Juliet for a ten-year-old.",
    "What is the difference between TCP and UDP? Give examples.",
    "Give me a recipe for a simple tomato soup, step by step.",
    "Translate 'good morning, how are you today?' into French, German and Spanish.",
    "Why is the sky blue? Explain the physics.",
    "Write a short story about a robot who learns to paint.",
    "Describe the water cycle and its stages.",
    "How do vaccines train the immune system?",
    "Compare Python and Rust for systems programming.",
    "Write a SQL query that finds the second highest salary in a table.",
    "What were the main causes of the French Revolution?",
    "Explain gradient descent with a simple numeric example.",
    "Plan a three-day trip to Kyoto.",
)


@dataclass
class RequestResult:
    """One streamed request, times in seconds from sending it."""

    ttft: float
    latency: float
    completion_tokens: int
    spec_verify_ct: int | None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (what a reader of the stream sees)."""
        if self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


@dataclass
class Level:
    """All requests of one server at one concurrency."""

    server: str
    concurrency: int
    requests: int
    wall_s: float
    output_tokens: int
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    stream_tok_s: float
    server_tok_s: float
    accept_length: float | None
    server_avg_accept_length: float | None
    metrics_accept_length: float | None
    errors: list[str] = field(default_factory=list)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan")}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": statistics.median(ordered), "p90": pick(0.9)}


async def stream_one(session: Any, url: str, model: str, prompt: str, args) -> RequestResult:
    """One streamed chat completion; tokens counted by the server's usage report."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": args.ignore_eos,
        "return_spec_tokens_details": True,
    }
    start = time.perf_counter()
    first = last = None
    tokens, verify_ct, content_chunks = 0, None, 0
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    last = time.perf_counter()
                    first = first or last
                    content_chunks += 1
            usage = chunk.get("usage")
            if usage:
                tokens = int(usage.get("completion_tokens") or tokens)
            details = (chunk.get("sglext") or {}).get("spec_tokens_details")
            if isinstance(details, list):
                details = details[0] if details else None
            if details:
                verify_ct = int(details.get("spec_verify_ct") or 0) or verify_ct
    if first is None:
        raise RuntimeError("the stream carried no content")
    # Without a usage report, chunks undercount tokens under speculation (several per chunk).
    return RequestResult(first - start, last - start, tokens or content_chunks, verify_ct)


async def run_level(url: str, model: str, concurrency: int, args) -> tuple[list, list, float]:
    import aiohttp

    count = max(args.requests_per_level, concurrency)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(count)]
    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    results: list[RequestResult] = []
    errors: list[str] = []
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def guarded(prompt: str) -> None:
            async with gate:
                try:
                    results.append(await stream_one(session, url, model, prompt, args))
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")

        start = time.perf_counter()
        await asyncio.gather(*(guarded(p) for p in prompts))
        wall = time.perf_counter() - start
    return results, errors, wall


def http_json(url: str, timeout: float = 30) -> Any:
    import requests

    reply = requests.get(url, timeout=timeout)
    reply.raise_for_status()
    return reply.json()


def server_model(url: str) -> str:
    return http_json(url + "/v1/models")["data"][0]["id"]


def server_avg_accept_length(url: str) -> float | None:
    """The scheduler's running accept length (None without speculation)."""
    try:
        info = http_json(url + "/server_info")
    except Exception:
        return None
    values = [
        s["avg_spec_accept_length"]
        for s in info.get("internal_states") or []
        if isinstance(s, dict) and s.get("avg_spec_accept_length") is not None
    ]
    return sum(values) / len(values) if values else None


def metrics_accept_length(url: str) -> float | None:
    """``sglang:spec_accept_length`` from /metrics (servers run with --enable-metrics)."""
    import requests

    try:
        text = requests.get(url + "/metrics", timeout=10).text
    except Exception:
        return None
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sglang:spec_accept_length")
    ]
    return sum(values) / len(values) if values else None


def measure_server(name: str, url: str, args) -> tuple[list[Level], dict[str, Any]]:
    model = server_model(url)
    info: dict[str, Any] = {"url": url, "model": model}
    try:
        full = http_json(url + "/server_info")
        keys = (
            "tp_size",
            "speculative_algorithm",
            "speculative_num_steps",
            "speculative_eagle_topk",
            "speculative_num_draft_tokens",
            "speculative_draft_model_path",
            "version",
        )
        info.update({k: full.get(k) for k in keys if k in full})
    except Exception as exc:
        info["server_info_error"] = str(exc)
    asyncio.run(run_level(url, model, 2, argparse.Namespace(**{**vars(args), "max_tokens": 16})))
    levels = []
    for concurrency in args.concurrency:
        results, errors, wall = asyncio.run(run_level(url, model, concurrency, args))
        tokens = sum(r.completion_tokens for r in results)
        verify = [r for r in results if r.spec_verify_ct]
        accept = (
            sum(r.completion_tokens for r in verify) / sum(r.spec_verify_ct for r in verify)
            if verify
            else None
        )
        streams = [(r.completion_tokens - 1) / (r.latency - r.ttft) for r in results if r.tpot]
        level = Level(
            server=name,
            concurrency=concurrency,
            requests=len(results),
            wall_s=wall,
            output_tokens=tokens,
            ttft_ms=percentiles([1e3 * r.ttft for r in results]),
            tpot_ms=percentiles([1e3 * r.tpot for r in results if r.tpot]),
            stream_tok_s=statistics.mean(streams) if streams else float("nan"),
            server_tok_s=tokens / wall if wall > 0 else float("nan"),
            accept_length=accept,
            server_avg_accept_length=server_avg_accept_length(url),
            metrics_accept_length=metrics_accept_length(url),
            errors=errors[:5],
        )
        levels.append(level)
        print(
            f"{name} c={concurrency}: {level.server_tok_s:.1f} tok/s, {len(errors)} errors",
            file=sys.stderr,
            flush=True,
        )
    return levels, info


# ---------------------------------------------------------------- launching servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LaunchedServer:
    """A server this script started (its own process group), stopped on exit."""

    def __init__(self, server_args: list[str], log: Path, startup_s: float) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            *server_args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._wait(startup_s)

    def _wait(self, startup_s: float) -> None:
        import requests

        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}); log: {self.log}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"server not ready in {startup_s:.0f} s; log: {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


def launch_configs(args) -> list[tuple[str, list[str]]]:
    base = ["--model-path", args.model, "--tp-size", str(args.tp), "--enable-metrics"]
    base += args.server_arg
    steps, topk, tokens = args.tree
    spec = [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        args.draft,
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-draft-tokens",
        str(tokens),
    ]
    return [("plain", base), ("eagle3", base + spec)]


# ---------------------------------------------------------------- reporting


def report(levels: list[Level]) -> str:
    headers = [
        "server",
        "conc",
        "reqs",
        "tok/s",
        "tok/s/stream",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "TPOT p50 ms",
        "TPOT p90 ms",
        "accept",
        "accept (server)",
        "errors",
    ]
    rows = [
        [
            lv.server,
            lv.concurrency,
            lv.requests,
            lv.server_tok_s,
            lv.stream_tok_s,
            lv.ttft_ms["p50"],
            lv.ttft_ms["p90"],
            lv.tpot_ms["p50"],
            lv.tpot_ms["p90"],
            lv.accept_length,
            lv.server_avg_accept_length,
            len(lv.errors),
        ]
        for lv in levels
    ]
    return format_table(headers, rows)


def draw(levels: list[Level]):
    def paint(plt) -> None:
        _, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        for name in dict.fromkeys(lv.server for lv in levels):
            mine = [lv for lv in levels if lv.server == name]
            xs = [lv.concurrency for lv in mine]
            left.plot(xs, [lv.server_tok_s for lv in mine], marker="o", label=name)
            right.plot(xs, [lv.tpot_ms["p50"] for lv in mine], marker="o", label=name)
        for ax, label in ((left, "output tok/s (all streams)"), (right, "TPOT p50 (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
            ax.legend()
        left.set_title("throughput")
        right.set_title("time per output token")

    return paint


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--server", action="append", default=[], metavar="NAME=URL")
    p.add_argument("--launch", action="store_true", help="start plain and EAGLE-3 servers")
    p.add_argument("--model", help="--launch: target model path")
    p.add_argument("--draft", help="--launch: EAGLE-3 draft path")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--tree", default="3,1,4", help="--launch: steps,topk,draft tokens")
    p.add_argument("--server-arg", action="append", default=[], help="extra server argument")
    p.add_argument("--startup-s", type=float, default=1200)
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--requests-per-level", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly --max-tokens (comparable runs)",
    )
    p.add_argument("--request-timeout-s", type=float, default=600)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / "bench_eagle3_serving.json")
    p.add_argument("--png", type=Path, default=DEFAULT_OUT_DIR / "bench_eagle3_serving.png")
    p.add_argument("--log-dir", type=Path, default=DEFAULT_OUT_DIR / "serving-logs")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    args.tree = tuple(int(x) for x in args.tree.split(","))
    if len(args.tree) != 3:
        p.error("--tree is steps,topk,draft_tokens")
    if args.launch and not (args.model and args.draft):
        p.error("--launch needs --model and --draft")
    if not args.launch and not args.server:
        p.error("give --server NAME=URL (repeatable) or --launch")
    for spec in args.server:
        if "=" not in spec:
            p.error(f"--server {spec!r}: expected NAME=URL")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels: list[Level] = []
    servers: dict[str, Any] = {}
    if args.launch:
        for name, server_args in launch_configs(args):
            server = LaunchedServer(server_args, args.log_dir / f"{name}.log", args.startup_s)
            try:
                got, servers[name] = measure_server(name, server.url, args)
                levels += got
            finally:
                server.stop()
    for spec in args.server:
        name, url = spec.split("=", 1)
        got, servers[name] = measure_server(name, url.rstrip("/"), args)
        levels += got
    print(report(levels))
    for lv in levels:
        for error in lv.errors:
            print(f"error ({lv.server} c={lv.concurrency}): {error}")
    payload = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "png", "log_dir")},
        "servers": servers,
        "levels": [asdict(lv) for lv in levels],
    }
    print(f"JSON written: {write_json(args.out, json.loads(json.dumps(payload, default=str)))}")
    print(save_png(args.png, draw(levels)))
    return 1 if any(lv.requests == 0 for lv in levels) else 0


if __name__ == "__main__":
    sys.exit(main())
