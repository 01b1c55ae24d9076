"""``sglang-sm120 profiles``: the embedded machine profiles, one line each."""

from __future__ import annotations

import argparse

from sglang_sm120.machine.facts import profile_descriptions


def run(args: argparse.Namespace) -> int:
    descriptions = profile_descriptions()
    width = max(map(len, descriptions))
    print("\n".join(f"{name:<{width}}  {text}" for name, text in descriptions.items()))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("profiles", help="list the embedded machine profiles")
    parser.set_defaults(func=run)
