"""A stand-in for ``sglang.launch_server`` so the e2e harness can be tested on a CPU.

Speaks the few endpoints the harness uses (/health, /generate), spawns a "worker" child like
SGLang's TP processes (to prove the harness stops the whole process group), and writes plugin
stats files the way the plugin does: one per TP rank plus one without a rank. Greedy outputs
are a deterministic function of the prompt; with ``--speculative`` each request reports
``spec_verify_ct`` = half its tokens and every rank's TARGET_VERIFY replays grow by as much;
like the plugin, the files are rewritten on a change at most once a second. With
``--crash-after-s`` the launcher exits with status 3 after that long and leaves its worker
behind (the harness must still stop it). Both pids are printed to the log.

    python fake_sglang_server.py --port 30000 --tp 2 [--speculative] [--startup-s 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class State:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ready_at = time.monotonic() + args.startup_s
        self.replays = 0
        self.lock = threading.Lock()
        self.stats_dir = os.environ.get("SGLANG_SM120_STATS_DIR")
        self.last_write = 0.0
        self.write_stats()

    def bump(self) -> None:
        """Like the plugin: rewrite the files on a count change, at most once a second."""
        if time.monotonic() - self.last_write >= 1.0:
            self.write_stats()

    def write_stats(self) -> None:
        self.last_write = time.monotonic()
        if not self.stats_dir:
            return
        for rank in [*range(self.args.tp), None]:
            pid = 100000 + (rank if rank is not None else 99)
            body = {
                "pid": pid,
                "tp_rank": rank,
                "fusion_backend": None,
                "plain_allreduce": "nccl",
                "graph_captures": {"TARGET_VERIFY": 2} if self.args.speculative else {},
                "graph_replays": {"TARGET_VERIFY": self.replays},
                "fused_allreduce_in_capture": {},
            }
            path = Path(self.stats_dir) / f"sm120-stats-{pid}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(body))
            tmp.replace(path)

    def generate(self, text: str, max_new_tokens: int) -> dict:
        start = zlib.crc32(text.encode()) % 1000
        ids = [(start + 7 * i) % 1000 for i in range(max_new_tokens)]
        meta = {"completion_tokens": max_new_tokens}
        if self.args.speculative:
            meta["spec_verify_ct"] = max_new_tokens // 2
            with self.lock:
                self.replays += meta["spec_verify_ct"]
                self.bump()
        return {"text": "", "output_ids": ids, "meta_info": meta}


def handler(state: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _send(self, code: int, body: object = None) -> None:
            data = json.dumps(body).encode() if body is not None else b""
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200 if time.monotonic() >= state.ready_at else 503)
            else:
                self._send(404)

        def do_POST(self) -> None:
            if self.path != "/generate":
                self._send(404)
                return
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            n = req["sampling_params"]["max_new_tokens"]
            text = req["text"]
            if isinstance(text, list):
                self._send(200, [state.generate(t, n) for t in text])
            else:
                self._send(200, state.generate(text, n))

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--speculative", action="store_true")
    parser.add_argument("--startup-s", type=float, default=0.5)
    parser.add_argument("--crash-after-s", type=float)
    args = parser.parse_args()
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    print(f"server pid {os.getpid()}", flush=True)
    print(f"worker pid {worker.pid}", flush=True)
    if args.crash_after_s is not None:
        time.sleep(args.crash_after_s)
        print("fake crash: CUDA error: no kernel image is available", flush=True)
        os._exit(3)
    ThreadingHTTPServer(("127.0.0.1", args.port), handler(State(args))).serve_forever()


if __name__ == "__main__":
    main()
