"""The launch plan a launcher publishes in ``SGLANG_SM120_LAUNCH_PLAN`` for the processes it
spawns: small enough for the environment whatever the tuning table (routes as ranges, reasons
that name ranges of sizes), and what a worker does with one it cannot use (ignore it, with one
warning), checked on the worker's own reader, in-process."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
from sglang_sm120.machine import facts
from sglang_sm120.machine.cache import host_fingerprint
from sglang_sm120.planning.policy import AllReducePlan, Capability, Deployment
from sglang_sm120.planning.tuning import Measurement, TuningTable
from sglang_sm120.server import runtime

PROFILE = "rtx-pro-6000-x8-pcie"
DEEPSEEK = "DeepseekV3ForCausalLM"

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
    ("routes by size (not ranges)", with_plan(routes={"4": "trtllm"})),
    ("routes a string", with_plan(routes="1-4:trtllm")),
    ("route a pair", with_plan(routes=[[4, "trtllm"]])),
    ("route not from 1", with_plan(routes=[[2, 4, "trtllm"]])),
    ("routes with a gap", with_plan(routes=[[1, 4, "trtllm"], [6, 64, "nccl"]])),
    ("route backwards", with_plan(routes=[[1, 4, "trtllm"], [5, 3, "nccl"]])),
    ("route bound a word", with_plan(routes=[[1, "four", "trtllm"]])),
    ("route backend unknown", with_plan(routes=[[1, 4, "magic"]])),
    ("reasons a string", with_plan(reasons="fusion trtllm")),
    ("reasons with a number", with_plan(reasons=["fusion", 3])),
    ("managed a string", with_plan(managed="true")),
    ("fusion backend a number", with_plan(fusion_backend=5)),
    ("fusion backend unknown", with_plan(fusion_backend="mnnvl")),
    ("plain all-reduce unknown", with_plan(plain_allreduce="ring")),
    ("nested too deep", "[" * 100_000 + "]" * 100_000),
]


@pytest.mark.parametrize("value", [row[1] for row in MALFORMED], ids=[row[0] for row in MALFORMED])
def test_a_malformed_launch_plan_is_ignored_with_one_warning(fresh_worker, caplog, value):
    raw = value if isinstance(value, str) else json.dumps(value)
    fresh_worker.setenv(runtime.LAUNCH_PLAN_ENV, raw)
    with caplog.at_level(logging.WARNING, logger="sglang_sm120"):
        for _ in range(2):  # every patch asks; the answer and the warning come once
            assert runtime.worker_plan() is None
            assert runtime.worker_tp_size() is None
            assert runtime.worker_capability() == runtime.sm12x_capability()
    warnings = [r.getMessage() for r in caplog.records if r.name == "sglang_sm120"]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"sglang-sm120: {runtime.LAUNCH_PLAN_ENV} unreadable (")
    assert warnings[0].endswith("): ignored") and "\n" not in warnings[0]


def test_a_valid_launch_plan_is_followed(fresh_worker, caplog):
    fresh_worker.setenv(runtime.LAUNCH_PLAN_ENV, json.dumps(published()))
    with caplog.at_level(logging.WARNING, logger="sglang_sm120"):
        assert runtime.worker_plan() == AllReducePlan.from_json(PLAN)
        assert runtime.worker_tp_size() == 2
    assert not [r for r in caplog.records if r.name == "sglang_sm120"]


# ---------------------------------------------------------------- size


def every_size_table(host: facts.HostFacts, tp: int) -> TuningTable:
    """As ``tune --tokens $(seq 1 2048)`` writes it on a host where FlashInfer's trtllm and
    PCIe-IPC kernels came out wrong: sgl-kernel-sm120 fastest up to ~300 tokens, NCCL above."""
    times = {
        "nccl": lambda t: 10 + 0.01 * t,
        "pcie_ipc": lambda t: 6 + 0.03 * t,
        "trtllm": lambda t: 5 + 0.03 * t,
        "sm120_pcie": lambda t: 4 + 0.03 * t,
    }
    rows = tuple(
        Measurement(backend, t, us(t), backend not in ("trtllm", "pcie_ipc"))
        for t in range(1, 2049)
        for backend, us in times.items()
    )
    return TuningTable(host_fingerprint(host, tp), tp, 7168, "bfloat16", rows)


def alternating_table(host: facts.HostFacts, tp: int) -> TuningTable:
    """Every size measured, the winner changing at every size (noise between two close
    backends would look like this, by a margin each time)."""
    rows = []
    for t in range(1, 2049):
        ours, nccl = (4.0, 20.0) if t % 2 else (20.0, 4.0)
        rows += [Measurement("sm120_pcie", t, ours, True), Measurement("nccl", t, nccl, True)]
    return TuningTable(host_fingerprint(host, tp), tp, 7168, "bfloat16", tuple(rows))


@pytest.fixture
def kernel_host():
    """The 8x SM120 profile with sgl-kernel-sm120 installed (the plans route sizes to it)."""
    host = facts.load_profile(PROFILE)
    return dataclasses.replace(host, versions={**host.versions, "sgl-kernel-sm120": "test"})


def deployment_with(table: TuningTable) -> Deployment:
    return Deployment(tp_size=table.tp, model_arch=DEEPSEEK, tuning=table, custom_all_reduce=False)


def test_a_table_of_every_size_gives_a_launch_plan_of_a_few_kilobytes(kernel_host):
    plan, published = runtime.plan_to_publish(
        kernel_host, deployment_with(every_size_table(kernel_host, 4))
    )
    assert published is not None and len(published) < 4096, len(published or "")
    assert plan.fusion_backend == "sm120_pcie"
    ranges = plan.route_ranges()
    assert [backend for _, _, backend in ranges] == ["sm120_pcie", "nccl"]
    (_, split, _), _ = ranges
    table_reason = next(r for r in plan.reasons if "from the tuning table" in r)
    assert f"sm120_pcie at [1-{split}], nccl at [{split + 1}-2048] tokens" in table_reason
    assert "excluded as wrong here: pcie_ipc (wrong at 1-2048 tokens), trtllm (wrong at " in (
        table_reason
    )
    assert AllReducePlan.from_json(json.loads(published)["plan"]) == plan


def test_routes_published_as_ranges_answer_as_the_sizes_did():
    per_size = tuple((t, "sm120_pcie" if t % 7 else "nccl") for t in range(1, 2049, 3))
    plan = AllReducePlan(True, "sm120_pcie", "sm120_pcie", ("test plan",), per_size)
    received = AllReducePlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert len(received.routes) < len(per_size)
    assert [received.route_at(t) for t in range(1, 2100)] == [
        plan.route_at(t) for t in range(1, 2100)
    ]


def test_a_table_whose_plan_would_not_fit_the_environment_is_not_used(
    kernel_host, caplog, monkeypatch
):
    """A table of every size whose winner changes at every size gives 2048 routes (~50 KiB);
    checked against a 16 KiB limit."""
    monkeypatch.setattr(runtime, "LAUNCH_PLAN_MAX_BYTES", 16 * 1024)
    table = alternating_table(kernel_host, 4)
    with caplog.at_level(logging.WARNING, logger="sglang_sm120"):
        plan, published = runtime.plan_to_publish(kernel_host, deployment_with(table))
    assert published is not None and len(published) < 16 * 1024
    assert plan.routes == () and plan.fusion_backend is None  # the default at TP4 over PCIe
    assert any(
        "tuning table not used: the plan it gives takes " in r
        and "KiB, over the 16 KiB a launch plan may take in the environment" in r
        for r in plan.reasons
    ), plan.reasons
    warnings = [r.getMessage() for r in caplog.records if r.name == "sglang_sm120"]
    assert len(warnings) == 1 and "tuning table not used" in warnings[0]


def test_a_plan_that_would_not_fit_even_without_a_table_is_not_published(kernel_host, monkeypatch):
    monkeypatch.setattr(runtime, "LAUNCH_PLAN_MAX_BYTES", 200)
    plan, published = runtime.plan_to_publish(kernel_host, Deployment(tp_size=8))
    assert published is None and not plan.managed
    assert plan.reasons[0].startswith("plan not published: it takes ")


def test_an_instance_connector_publishes_no_plan_and_says_why(fresh_worker, caplog):
    """Issue 26 item 5b. With ``--model-path instance://...`` SGLang returns before its fusion
    auto-enable pass (arg_groups/model_hook.py), so the server args carry no fused backend to
    compare with: the Engine publishes nothing and says so, not "resolved before sglang-sm120
    loaded", and never raises. (A real ServerArgs with an instance path cannot be built on
    CPU: SGLang opens the remote connector on a CUDA device; the check reads only the path.)"""
    import types

    args = types.SimpleNamespace(model_path="instance://127.0.0.1:30000", tp_size=2)
    fresh_worker.setenv(runtime.LAUNCH_PLAN_ENV, json.dumps(published()))  # an inherited one
    with caplog.at_level(logging.WARNING, logger="sglang_sm120"):
        plan = runtime.plan_for_spawn(args)
    assert not plan.managed and runtime.LAUNCH_PLAN_ENV not in __import__("os").environ
    messages = [r.getMessage() for r in caplog.records if r.name == "sglang_sm120"]
    assert len(messages) == 1 and "\n" not in messages[0], messages
    assert "instance connector" in messages[0] and "resolved before" not in messages[0]
    assert "instance connector" in plan.reasons[0]
