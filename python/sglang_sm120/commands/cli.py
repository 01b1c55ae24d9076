"""``sglang-sm120``: show what the plugin sees and decides.

sglang-sm120 doctor [--tp N] [--model-arch A] [--json]
    this machine: versions, GPUs, P2P, NVLink, NUMA, host checks (IOMMU, ACS, the driver's P2P
    mode, PCIe links, BAR1, topology, persistence), each patch's status, the plan
sglang-sm120 plan (--profile NAME | --topology FILE) --tp N [--model-arch A] [--json]
    the plan for a machine you are not on
sglang-sm120 tune --tp N [--hidden H] [--tokens T ...]
    measure every all-reduce backend on this host's GPUs, write the tuning table
sglang-sm120 p2p [--gpus 0,1,...] [--reps N] [--json]
    measure P2P write/read bandwidth and latency per GPU pair, then all at once: do writes
    collapse under concurrency? (saved next to the tuning table; doctor and the plan cite it)
sglang-sm120 warmup [--dry-run] [--vocab-size V]
    compile the JIT kernels the server needs on this GPU, before the server starts
sglang-sm120 profiles
    the embedded machine profiles, one line each
sglang-sm120 selftest [--tp N] [--target PATH --draft PATH] [--json] [--keep-logs DIR]
    start SGLang servers on this machine's GPUs and check the EAGLE-3 fast path end to end
sglang-sm120 --version
    this plugin's version, the sglang it is pinned to, and the installed kernel package

Bad input (a flag out of range, a topology that does not follow the schema in topology.py, no
importable sglang) is one line on stderr and exit status 2, before anything else is printed.
"""

from __future__ import annotations

import sys
from argparse import RawDescriptionHelpFormatter as RawHelp
from importlib import metadata

from sglang_sm120.commands import doctor, p2p, plan, profiles, selftest, tune, warmup
from sglang_sm120.commands.args import Parser, UsageError, one_line
from sglang_sm120.machine.topology import TopologyError
from sglang_sm120.version import SGLANG_PIN, __version__

KERNEL_DISTRIBUTION = "sgl-kernel-sm120"
COMMANDS = (doctor, plan, tune, p2p, warmup, profiles, selftest)  # each: add_parser(sub), run(args)


def _installed(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def version_text() -> str:
    """Plugin version, the pinned sglang and the kernel package, each with what is installed."""
    return (
        f"sglang-sm120 {__version__}: sglang {_installed('sglang')} (pinned {SGLANG_PIN}), "
        f"{KERNEL_DISTRIBUTION} {_installed(KERNEL_DISTRIBUTION)} (pinned {__version__})"
    )


def build_parser() -> Parser:
    parser = Parser(prog="sglang-sm120", description=__doc__, formatter_class=RawHelp)
    parser.add_argument("--version", action="version", version=version_text())
    # Not required=True: argparse would then answer "arguments are required: command" to an
    # unknown flag (``sglang-sm120 --bogus``) instead of naming it; main() asks for a command.
    sub = parser.add_subparsers(dest="command", metavar="command")
    for command in COMMANDS:
        command.add_parser(sub)
    parser.commands = tuple(sub.choices)
    return parser


def main(argv: list[str] | None = None) -> int:
    # A path from the environment may hold bytes that are not UTF-8 (os.fsdecode keeps them as
    # surrogates): shown escaped, never a UnicodeEncodeError, whatever the locale's stdio says.
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error(f"a command is required ({', '.join(parser.commands)})")
    try:
        return args.func(args)
    except (UsageError, TopologyError) as exc:
        print(f"{parser.prog} {args.command}: {one_line(str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
