"""Questions asked of SGLang's real code in a fresh process: patches are process-global, and
SGLang's processes are fresh interpreters too. The child prints one ``MARKER {json}`` line.

    answer, stderr = run_child([sys.executable, "script.py", ...], env, "SCENARIO")
"""

from __future__ import annotations

import json
import subprocess


def parse_report(returncode: int, stdout: str, stderr: str, marker: str) -> dict:
    """The child's last ``marker`` line as JSON; fails the test with the child's stderr."""
    prefix = f"{marker} "
    lines = [line for line in stdout.splitlines() if line.startswith(prefix)]
    assert returncode == 0 and lines, stderr[-3000:]
    return json.loads(lines[-1].removeprefix(prefix))


def run_child(argv: list[str], env: dict, marker: str, timeout: int = 300) -> tuple[dict, str]:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    return parse_report(proc.returncode, proc.stdout, proc.stderr, marker), proc.stderr
