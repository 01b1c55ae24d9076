"""The GitHub workflows: pinned, least-privilege, time-boxed, forks kept off the GPU fleet.

Structure is checked here with PyYAML; GitHub's own schema and zizmor run too where installed
(`pip install check-jsonschema zizmor`), so a broken workflow fails on a laptop, not on GitHub.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
FILES = sorted(WORKFLOWS.glob("*.yml"))
SHA_PIN = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")
FORK_GATE = "github.event.pull_request.head.repo.full_name == github.repository"
GPU_LABELS = {"self-hosted", "linux", "x64", "gpu", "sm120"}


def _tool(name: str) -> str | None:
    """A console script on PATH or beside this interpreter (a venv not on PATH)."""
    beside = Path(sys.executable).parent / name
    return shutil.which(name) or (str(beside) if beside.exists() else None)


def _load(path: Path) -> dict[str, Any]:
    # PyYAML reads the key `on` as True (YAML 1.1); normalise it back.
    data = yaml.safe_load(path.read_text())
    if True in data:
        data["on"] = data.pop(True)
    return data


def _jobs() -> list[tuple[str, str, dict[str, Any]]]:
    return [(p.name, name, job) for p in FILES for name, job in _load(p)["jobs"].items()]


def _steps() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{f}:{j}", step) for f, j, job in _jobs() for step in job.get("steps", [])]


def test_the_three_workflows_exist() -> None:
    assert {p.name for p in FILES} >= {"ci.yml", "gpu-sm120.yml", "release.yml"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_workflow_grants_nothing_by_default(path: Path) -> None:
    assert _load(path).get("permissions") == {}, "top-level permissions must be {}"


@pytest.mark.parametrize(
    "where,name,job", _jobs(), ids=[f"{where}:{name}" for where, name, _ in _jobs()]
)
def test_every_job_has_a_timeout_and_explicit_permissions(where, name, job) -> None:
    assert isinstance(job.get("timeout-minutes"), int), f"{where}:{name} has no timeout"
    assert "permissions" in job, f"{where}:{name} must state its permissions"


def test_every_action_is_pinned_by_commit_sha() -> None:
    for where, step in _steps():
        if "uses" in step:
            assert SHA_PIN.match(step["uses"]), f"{where}: {step['uses']} is not pinned by SHA"


def test_no_checkout_keeps_credentials() -> None:
    for where, step in _steps():
        if step.get("uses", "").startswith("actions/checkout@"):
            assert step.get("with", {}).get("persist-credentials") is False, where


def test_no_expression_is_expanded_inside_a_shell_script() -> None:
    """Values reach scripts through env:, never by ${{ }} inside run: (template injection)."""
    for where, step in _steps():
        assert "${{" not in step.get("run", ""), f"{where}: ${{{{ }}}} inside run:"


def test_no_workflow_runs_untrusted_code_with_secrets() -> None:
    for path in FILES:
        triggers = _load(path)["on"]
        names = triggers if isinstance(triggers, list) else list(triggers)
        assert "pull_request_target" not in names, path.name
        assert "workflow_run" not in names, path.name


def test_gpu_jobs_run_on_sm120_runners_sized_by_gpus_label_and_never_for_forks() -> None:
    gpu_jobs = [(f, n, j) for f, n, j in _jobs() if "self-hosted" in str(j.get("runs-on"))]
    assert gpu_jobs, "no job runs on the self-hosted fleet"
    for where, name, job in gpu_jobs:
        labels = job["runs-on"]
        assert GPU_LABELS <= set(labels), f"{where}:{name} labels {labels}"
        assert any(str(label).startswith("gpus-") for label in labels)
        assert FORK_GATE in " ".join(job.get("if", "").split()), f"{where}:{name} lacks the gate"
    gpus = _load(WORKFLOWS / "gpu-sm120.yml")["jobs"]["gpu"]["strategy"]["matrix"]["gpus"]
    assert gpus == [1, 2, 4, 8]


def test_gpu_workflow_limits_concurrency_and_uploads_results() -> None:
    workflow = _load(WORKFLOWS / "gpu-sm120.yml")
    assert workflow["concurrency"]["cancel-in-progress"] is True
    steps = workflow["jobs"]["gpu"]["steps"]
    upload = [s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@")]
    assert upload and upload[0].get("if") == "always()"
    scripts = " ".join(s.get("run", "") for s in steps)
    for needed in ("sglang-sm120 doctor", "test/e2e", "bench_verify_step.py",
                   "bench_eagle3_serving.py"):  # fmt: skip
        assert needed in scripts, needed


def test_gpu_workflow_runs_the_selftest_at_the_runners_size_and_keeps_its_json() -> None:
    steps = _load(WORKFLOWS / "gpu-sm120.yml")["jobs"]["gpu"]["steps"]
    selftest = [s["run"] for s in steps if "sglang-sm120 selftest" in s.get("run", "")]
    assert len(selftest) == 1
    command = " ".join(selftest[0].replace("\\\n", " ").split())
    assert '--tp "$GPUS" --json' in command and '> "$OUT/selftest.json"' in command
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload["with"]["path"] == ".out/"  # $OUT, where the verdict and its logs go


def test_only_the_publish_job_may_mint_an_id_token() -> None:
    for where, name, job in _jobs():
        perms = job.get("permissions") or {}
        writes = {k for k, v in perms.items() if v == "write"}
        if where == "release.yml" and name == "publish":
            assert writes == {"id-token"}
            assert job.get("environment", {}).get("name") == "pypi"
        else:
            assert not writes, f"{where}:{name} writes {writes}"


@pytest.mark.skipif(_tool("check-jsonschema") is None, reason="check-jsonschema not installed")
def test_workflows_match_githubs_schema() -> None:
    done = subprocess.run(
        [
            _tool("check-jsonschema"),
            "--builtin-schema",
            "vendor.github-workflows",
            *map(str, FILES),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(_tool("zizmor") is None, reason="zizmor not installed")
def test_zizmor_finds_nothing() -> None:
    done = subprocess.run(
        [_tool("zizmor"), "--offline", str(ROOT / ".github")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_upstream_canary_runs_weekly_and_by_hand_and_fails_naming_what_moved() -> None:
    """Newest sglang with the pin relaxed: the bump report, the contract test and the CPU
    tests; the report kept whatever happens; the verdict fails when any of them failed."""
    workflow = _load(WORKFLOWS / "upstream-canary.yml")
    assert set(workflow["on"]) == {"schedule", "workflow_dispatch"}
    assert workflow["defaults"]["run"]["shell"] == "bash"  # -eo pipefail: tee keeps the failure
    steps = workflow["jobs"]["canary"]["steps"]
    runs = {s.get("id"): s.get("run", "") for s in steps if s.get("id")}
    assert "python -m sglang_sm120.server.bump_report" in runs["report"]
    assert "test/unit/test_contract.py" in runs["contract"] and "-n 2 -q test" in runs["cpu"]
    assert all(next(s for s in steps if s.get("id") == i)["continue-on-error"] for i in runs)
    scripts = " ".join(s.get("run", "") for s in steps)
    assert 'pip install -q --upgrade "sglang' in scripts and "SGLANG_PIN = " in scripts
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@"))
    assert upload.get("if") == "always()" and upload["with"]["path"] == ".out/"
    verdict = steps[-1]
    assert verdict.get("if") == "always()" and 'print(f"::error title={title}::' in verdict["run"]
    assert "upstream moved (" in verdict["run"] and "%0A" in verdict["run"]  # escaped
    assert set(verdict["env"]) == {"REPORT", "CONTRACT", "CPU"}


TEMPLATES = ROOT / ".github" / "ISSUE_TEMPLATE"
FORMS = sorted(p for p in TEMPLATES.glob("*.yml") if p.name != "config.yml")


def _fields(path: Path) -> dict[str, dict[str, Any]]:
    return {f["id"]: f for f in yaml.safe_load(path.read_text())["body"] if "id" in f}


def test_the_bug_report_asks_for_doctor_json_and_a_selftest_on_a_gpu_box() -> None:
    fields = _fields(TEMPLATES / "bug_report.yml")
    assert "sglang-sm120 doctor --json" in fields["doctor"]["attributes"]["label"]
    assert fields["doctor"]["validations"]["required"] is True
    assert "selftest --json" in fields["selftest"]["attributes"]["label"]
    assert fields["selftest"]["validations"]["required"] is False  # no GPU: nothing to run


def test_my_numbers_asks_for_the_host_the_tune_table_and_bench_allreduce() -> None:
    fields = _fields(TEMPLATES / "my_numbers.yml")
    assert {"host", "doctor", "tune", "bench-allreduce"} <= set(fields)
    assert "tune --tp N --json" in fields["tune"]["attributes"]["label"]
    assert "bench_allreduce" in fields["bench-allreduce"]["attributes"]["label"]


@pytest.mark.skipif(_tool("check-jsonschema") is None, reason="check-jsonschema not installed")
def test_issue_forms_match_githubs_schema() -> None:
    for schema, files in (
        ("vendor.github-issue-forms", FORMS),
        ("vendor.github-issue-config", [TEMPLATES / "config.yml"]),
    ):
        done = subprocess.run(
            [_tool("check-jsonschema"), "--builtin-schema", schema, *map(str, files)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
