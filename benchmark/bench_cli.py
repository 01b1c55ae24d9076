"""How long a user waits for our own commands: each one timed in fresh processes, several runs.

    python benchmark/bench_cli.py [--runs 3] [--doctor-runs 2] [--selftest] [--out FILE.json]

Times ``--version``, ``plan`` (the 8x RTX PRO 6000 profile), a refused flag, ``doctor
--recheck`` (its plugin checks run), then ``doctor`` and ``doctor --json`` (their checks
reused), on this machine or on ``SGLANG_SM120_TOPOLOGY`` where set, each in a new process, and
prints min / median / max of wall time and of CPU time (user + system of the command and its
children: on a loaded machine, CPU seconds are the fair number). ``--selftest`` adds one
``selftest --tp 1`` (a GPU and SGLang needed; extra selftest arguments after ``--``) and the
phases it prints. Writes the table as JSON with the machine named.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import DEFAULT_OUT_DIR, format_table, write_json

PLAN = ["plan", "--profile", "rtx-pro-6000-x8-pcie", "--tp", "8"]
ARCH = ["--model-arch", "KimiK25ForConditionalGeneration"]
CASES = {
    "--version": (["--version"], 0),
    "plan (8x RTX PRO 6000 profile)": ([*PLAN, *ARCH], 0),
    "plan, refused --fusion-backend": ([*PLAN, "--fusion-backend", "bogus"], 2),
    # --recheck first: it loads the plugin as the launcher and a TP worker every time, and
    # leaves the cache the two after it reuse (a user's every doctor after the first).
    "doctor --recheck": (["doctor", "--recheck", *ARCH], 0),
    "doctor": (["doctor", *ARCH], 0),
    "doctor --json": (["doctor", "--json", *ARCH], 0),
}


CLI_MODULE = "sglang_sm120.commands.cli"  # sglang_sm120.cli: a tree before the layout (0179fab)


def cli(module: str = CLI_MODULE) -> list[str]:
    return [sys.executable, "-m", module]


def timed(argv: list[str], expect: int) -> tuple[float, float, str]:
    """(wall s, CPU s of the command and its children, its stdout) of one fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode != expect:
        command = " ".join(argv[3:])
        tail = proc.stderr[-2000:]
        raise SystemExit(f"{command}: exit {proc.returncode}, expected {expect}\n{tail}")
    return wall, cpu, proc.stdout


def summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of the fast commands")
    parser.add_argument("--doctor-runs", type=int, default=2, help="runs of each doctor")
    parser.add_argument("--selftest", action="store_true", help="also one selftest --tp 1")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / "bench_cli.json")
    parser.add_argument("--cli-module", default=CLI_MODULE, help="the CLI module to run")
    args, selftest_args = parser.parse_known_args()
    rows, results = [], {}
    for name, (argv, expect) in CASES.items():
        runs = args.doctor_runs if name.startswith("doctor") else args.runs
        if runs < 1:
            continue
        walls, cpus = [], []
        for _ in range(runs):
            wall, cpu, _ = timed([*cli(args.cli_module), *argv], expect)
            walls.append(wall)
            cpus.append(cpu)
        results[name] = {"argv": argv, "wall_s": summary(walls), "cpu_s": summary(cpus)}
        rows.append([name, runs, *summary(walls).values(), *summary(cpus).values()])
        print(f"{name}: median {statistics.median(walls):.2f} s", file=sys.stderr, flush=True)
    if args.selftest:
        argv = ["selftest", "--tp", "1", "--json", *[a for a in selftest_args if a != "--"]]
        wall, cpu, out = timed([*cli(args.cli_module), *argv], 0)
        results["selftest --tp 1"] = {"argv": argv, "wall_s": wall, "cpu_s": cpu, "report": out}
        rows.append(["selftest --tp 1", 1, wall, wall, wall, cpu, cpu, cpu])
    headers = ["command", "runs", "wall min", "wall median", "wall max"]
    headers += ["cpu min", "cpu median", "cpu max"]
    print(format_table(headers, rows))
    topology = os.environ.get("SGLANG_SM120_TOPOLOGY")
    payload = {"cpus": os.cpu_count(), "cli": args.cli_module, "topology": topology}
    write_json(args.out, {**payload, "commands": results})
    print(f"written: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
