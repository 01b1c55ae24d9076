"""The launch plan a launcher publishes in ``SGLANG_SM120_LAUNCH_PLAN`` for the processes it
spawns: what a worker does with one it cannot use (ignore it, with one warning), checked on
the worker's own reader, in-process."""

from __future__ import annotations

import json
import logging

import pytest
from sglang_sm120 import facts, runtime
from sglang_sm120.policy import AllReducePlan, Capability

CAPABILITY = Capability(True, True, True, ("test host",)).to_json()
PLAN = AllReducePlan(True, "trtllm", "pcie_ipc", ("fusion trtllm", "plain pcie_ipc")).to_json()


def published(**changes) -> dict:
    """A valid launch plan with top-level ``changes`` (a value of None removes the key)."""
    document = {"tp_size": 2, "gpu_ids": [0, 1], "capability": CAPABILITY, "plan": PLAN}
    document.update(changes)
    return {key: value for key, value in document.items() if value is not None}


def with_plan(**changes) -> dict:
    plan = {**PLAN, **changes}
    return published(plan={key: value for key, value in plan.items() if value is not None})


def with_capability(**changes) -> dict:
    return published(capability={**CAPABILITY, **changes})


# id, the variable's value (a str as is, anything else as JSON)
MALFORMED = [
    ("not JSON", "{"),
    ("JSON null", None),
    ("a list", [1, 2]),
    ("a string", "plan"),
    ("tp_size missing", published(tp_size=None)),
    ("tp_size a word", published(tp_size="two")),
    ("tp_size a bool", published(tp_size=True)),
    ("tp_size zero", published(tp_size=0)),
    ("capability a list", published(capability=[True])),
    ("capability reasons a string", with_capability(reasons="test host")),
    ("capability flag a string", with_capability(sm12x="yes")),
    ("plan missing", published(plan=None)),
    ("plan a list", published(plan=[])),
    ("routes a list", with_plan(routes=[[4, "trtllm"]])),
    ("routes a string", with_plan(routes="4:trtllm")),
    ("route size not a number", with_plan(routes={"four": "trtllm"})),
    ("route backend unknown", with_plan(routes={"4": "magic"})),
    ("reasons a string", with_plan(reasons="fusion trtllm")),
    ("reasons with a number", with_plan(reasons=["fusion", 3])),
    ("managed a string", with_plan(managed="true")),
    ("fusion backend a number", with_plan(fusion_backend=5)),
    ("fusion backend unknown", with_plan(fusion_backend="mnnvl")),
    ("plain all-reduce unknown", with_plan(plain_allreduce="ring")),
    ("nested too deep", "[" * 100_000 + "]" * 100_000),
]


@pytest.fixture
def worker(monkeypatch):
    """A worker process on the 8x SM120 profile, before it read any launch plan."""
    monkeypatch.setenv("SGLANG_SM120_TOPOLOGY", "rtx-pro-6000-x8-pcie")
    caches = (facts.current_facts, runtime.sm12x_capability, runtime._launch_plan)
    for cached in caches:
        cached.cache_clear()
    yield monkeypatch
    for cached in caches:
        cached.cache_clear()


@pytest.mark.parametrize("value", [row[1] for row in MALFORMED], ids=[row[0] for row in MALFORMED])
def test_a_malformed_launch_plan_is_ignored_with_one_warning(worker, caplog, value):
    raw = value if isinstance(value, str) else json.dumps(value)
    worker.setenv(runtime.LAUNCH_PLAN_ENV, raw)
    with caplog.at_level(logging.WARNING, logger="sglang_sm120"):
        for _ in range(2):  # every patch asks; the answer and the warning come once
            assert runtime.worker_plan() is None
            assert runtime.worker_tp_size() is None
            assert runtime.worker_capability() == runtime.sm12x_capability()
    warnings = [r.getMessage() for r in caplog.records if r.name == "sglang_sm120"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"sglang-sm120: {runtime.LAUNCH_PLAN_ENV} unreadable (")
    assert warnings[0].endswith("): ignored") and "\n" not in warnings[0]


def test_a_valid_launch_plan_is_followed(worker, caplog):
    worker.setenv(runtime.LAUNCH_PLAN_ENV, json.dumps(published()))
    with caplog.at_level(logging.WARNING, logger="sglang_sm120"):
        assert runtime.worker_plan() == AllReducePlan.from_json(PLAN)
        assert runtime.worker_tp_size() == 2
    assert not [r for r in caplog.records if r.name == "sglang_sm120"]
