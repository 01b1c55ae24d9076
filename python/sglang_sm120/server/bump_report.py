"""The bump report: what a maintainer must change before this plugin supports another sglang.

It reads an sglang release without installing it: a wheel is unpacked into a temporary
directory (a source checkout is read where it is), and a fresh interpreter with that directory
first on its path imports it, beside the dependencies installed here, and runs the checks the
plugin and the tests run themselves: every contract symbol (``contract.check``, as the plugin
checks before it applies anything), every table ``planning.upstream`` copies
(``upstream_tables``, as ``test/unit/test_contract.py`` checks) and the version gate. A module
that no longer imports beside these dependencies shows as its symbols not found, with the
ImportError.

Usage::

    python -m sglang_sm120.server.bump_report --against sglang-0.5.24-...whl
    python -m sglang_sm120.server.bump_report --against ~/src/sglang --json
    python -m sglang_sm120.server.bump_report --out report.md --json-out report.json
    python -m sglang_sm120.server.bump_report          # the installed sglang

Exit status: 0 when every symbol and table holds (the pin may still need its bump), 1 when
something moved (each one is named), 2 when the sglang given cannot be read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from sglang_sm120.version import SGLANG_PIN, __version__

MODULE = "sglang_sm120.server.bump_report"
CHILD_FLAG = "--inspect-imported"
CHILD_TIMEOUT_S = 600
REPORT_PREFIX = "BUMP-REPORT "


class ReportError(Exception):
    """The sglang given cannot be read: one line for the maintainer."""


def _inspect_imported() -> dict[str, Any]:
    """The checks, in this process, against whichever sglang imports first on its path."""
    import sglang

    from sglang_sm120.server.contract import check
    from sglang_sm120.server.patches import PATCHES, patch_name
    from sglang_sm120.server.plugin import REGISTRY_CONTRACT
    from sglang_sm120.server.upstream_tables import TABLES

    symbols = {patch_name(m): check(m.CONTRACT) for m in PATCHES}
    symbols["(plugin loader)"] = check(REGISTRY_CONTRACT)
    declared = sum(len(m.CONTRACT) for m in PATCHES) + len(REGISTRY_CONTRACT)
    return {
        "sglang_version": str(getattr(sglang, "__version__", "unknown")),
        "sglang_path": str(Path(sglang.__file__).parent),
        "symbols_declared": declared,
        "symbols": symbols,
        "tables": {
            t.name: {"upstream": t.upstream, "differences": t.differences()} for t in TABLES
        },
    }


def sglang_root(against: Path, workdir: Path) -> Path:
    """The directory holding the ``sglang`` package to read: a wheel unpacked into ``workdir``
    (its ``sglang/`` and ``*.dist-info/`` only), a tree with ``sglang/`` or a checkout with
    ``python/sglang/``."""
    if against.is_file():
        if not zipfile.is_zipfile(against):
            raise ReportError(f"{against} is not a wheel (zip) file")
        with zipfile.ZipFile(against) as wheel:
            names = [n for n in wheel.namelist() if n.split("/")[0] == "sglang"]
            if "sglang/__init__.py" not in names:
                raise ReportError(f"{against} holds no sglang package")
            meta = [n for n in wheel.namelist() if n.split("/")[0].endswith(".dist-info")]
            wheel.extractall(workdir, [*names, *meta])
        return workdir
    for root in (against, against / "python"):
        if (root / "sglang" / "__init__.py").is_file():
            return root
    raise ReportError(f"{against}: no sglang/__init__.py there or under python/")


def inspect_release(root: Path | None) -> dict[str, Any]:
    """The checks run in a fresh interpreter with ``root`` first on its path (None: the sglang
    installed here). ``-P``: the working directory does not shadow it."""
    env = dict(os.environ)
    if root is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(root), env.get("PYTHONPATH"))))
    proc = subprocess.run(
        [sys.executable, "-P", "-m", MODULE, CHILD_FLAG],
        capture_output=True,
        text=True,
        env=env,
        timeout=CHILD_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
        errors="backslashreplace",
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith(REPORT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise ReportError(f"sglang does not import from {root or 'this environment'}: {tail}")
    found = json.loads(lines[-1].removeprefix(REPORT_PREFIX))
    if root is not None and not Path(found["sglang_path"]).resolve().is_relative_to(root):
        raise ReportError(f"{found['sglang_path']} imported instead of the sglang under {root}")
    return found


def summarize(found: dict[str, Any], source: str) -> dict[str, Any]:
    """The report: the gate, every symbol that differs, the patches whose seam is gone or
    changed, the copied tables and whether each holds."""
    version = found["sglang_version"]
    seams = {}
    for patch, problems in found["symbols"].items():
        if problems:
            gone = any(": not found (" in p for p in problems)
            seams[patch] = {"seam": "gone" if gone else "changed", "problems": problems}
    tables = {name: t["differences"] for name, t in found["tables"].items()}
    moved = bool(seams) or any(tables.values())
    return {
        "sglang_sm120": __version__,
        "source": source,
        "sglang_version": version,
        "sglang_path": found["sglang_path"],
        "version_gate": {
            "pin": SGLANG_PIN,
            "passes": version == SGLANG_PIN,
            "note": (
                f"SGLANG_PIN is {SGLANG_PIN}: the plugin applies its patches on this sglang"
                if version == SGLANG_PIN
                else f"SGLANG_PIN is {SGLANG_PIN}: on sglang {version} the plugin applies "
                "nothing until the pin (and pyproject's sglang== requirement) says "
                f"{version}"
            ),
        },
        "symbols_declared": found["symbols_declared"],
        "patches": seams,
        "tables": tables,
        "moved": moved,
    }


def report_lines(report: dict[str, Any]) -> list[str]:
    """The report as Markdown a person reads (and a maintainer commits)."""
    problems = [p for seam in report["patches"].values() for p in seam["problems"]]
    lines = [
        f"# Bump report: sglang-sm120 {report['sglang_sm120']} against sglang "
        f"{report['sglang_version']}",
        "",
        f"Read from `{report['source']}` (`python -m sglang_sm120.server.bump_report`).",
        "",
        "## Version gate",
        "",
        report["version_gate"]["note"] + ".",
        "",
        f"## Contract symbols: {len(problems)} of {report['symbols_declared']} differ",
        "",
    ]
    lines += [f"- {p}" for p in problems] or ["Every declared symbol matches."]
    lines += ["", f"## Patches whose seam is gone or changed: {len(report['patches'])}", ""]
    if report["patches"]:
        lines += ["| patch | seam | first problem |", "|---|---|---|"]
        lines += [
            f"| {patch} | {seam['seam']} | {seam['problems'][0].replace('|', '/')} |"
            for patch, seam in report["patches"].items()
        ]
    else:
        lines.append("None: every patch's seam is where the contract says.")
    differ = sum(bool(d) for d in report["tables"].values())
    lines += ["", f"## Copied upstream tables (planning/upstream.py): {differ} differ", ""]
    for name, differences in report["tables"].items():
        lines.append(f"- {name}: " + ("equal" if not differences else "DIFFERS"))
        lines += [f"  - {d}" for d in differences]
    verdict = (
        "Something moved: update the contract and the copies above before bumping the pin."
        if report["moved"]
        else "Nothing moved: bump the pin and the version, then re-run test/gpu and a selftest."
    )
    return [*lines, "", "## Verdict", "", verdict]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_sm120.server.bump_report",
        description="What moved in another sglang release, for the plugin's contract and copies.",
    )
    parser.add_argument(
        "--against",
        type=Path,
        help="an sglang wheel, an unpacked tree or a source checkout (default: the installed one)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--out", type=Path, help="also write the Markdown report to this file")
    parser.add_argument("--json-out", type=Path, help="also write the JSON report to this file")
    parser.add_argument(CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inspect_imported:
        print(REPORT_PREFIX + json.dumps(_inspect_imported()))
        return 0
    try:
        with tempfile.TemporaryDirectory(prefix="sglang-sm120-bump-") as workdir:
            against = None if args.against is None else args.against.resolve()
            root = None if against is None else sglang_root(against, Path(workdir).resolve())
            found = inspect_release(root)
    except (ReportError, OSError, zipfile.BadZipFile, subprocess.TimeoutExpired) as exc:
        print(f"bump_report: {exc}", file=sys.stderr)
        return 2
    source = args.against.name if args.against is not None else "the installed sglang"
    report = summarize(found, source)
    markdown, document = "\n".join(report_lines(report)), json.dumps(report, indent=1)
    print(document if args.json else markdown)
    for path, text in ((args.out, markdown), (args.json_out, document)):
        if path is not None:
            path.write_text(text + "\n")
    return 1 if report["moved"] else 0


if __name__ == "__main__":
    sys.exit(main())
