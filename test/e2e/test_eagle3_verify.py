"""EAGLE-3 verify with the plugin on: exact, graph-replayed, fused where the plan says so.

For every TP size the GPUs allow and every all-reduce backend the plan can choose, on the tiny
fixture pairs (Llama; DeepSeek-V3 with MLA + MoE), a server with ``--speculative-algorithm
EAGLE3`` and a small tree is compared with the same server without speculation:

- greedy outputs are token for token the same (one request at a time, and batched);
- every TP rank replayed its TARGET_VERIFY CUDA graph at least once per verify pass;
- where the plan turns fusion on, fused all-reduce + RMSNorm calls were recorded while the verify
  graphs were captured (and none where it is off);
- the tiny pair reaches its designed accept length (2.0; ~1.0 means verify or the draft's
  hidden states are broken).

With a real pair given by ``SGLANG_SM120_E2E_TARGET`` / ``SGLANG_SM120_E2E_DRAFT``, the accept
length must reach the threshold recorded for that pair (``KNOWN_PAIRS`` in the harness), and
greedy equality must hold.

The harness and its environment knobs: ``sglang_sm120.commands.e2e`` (``sglang-sm120
selftest`` runs the same checks on one configuration).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sglang_sm120.commands import tiny_models
from sglang_sm120.commands.e2e import (
    BACKENDS,
    REAL_MAX_NEW_TOKENS,
    SMALL_TREE,
    TP_SIZES,
    Launch,
    RunResult,
    ServerRuns,
    chat_prompts,
    env_list,
    env_server_args,
    gpu_count,
    hidden_size,
    known_threshold,
    missing_prerequisite,
    model_arch,
    model_dtype,
    num_layers,
    plan_for,
    refused_backend,
)
from sglang_sm120.commands.selftest import (
    MEMORY_FLAGS,
    SHARED_GPU_KV_TOKENS,
    Check,
    designed_tokens_check,
    graph_checks,
    greedy_check,
    plan_checks,
)
from sglang_sm120.server.env_report import E2E_MIN_ACCEPT

_MISSING = missing_prerequisite()
if _MISSING:
    pytest.skip(_MISSING, allow_module_level=True)

pytestmark = pytest.mark.e2e

TINY_ARCHS = ("llama", "deepseek_v3")


def require_gpus(tp: int) -> None:
    have = gpu_count()
    if tp > have:
        pytest.skip(f"tp={tp} needs {tp} GPUs; this host has {have}")


def case_plan(tp: int, model: str, backend: str) -> dict[str, Any]:
    """The plan for this model at ``tp`` with the backend asked for."""
    return plan_for(tp, model_arch(model), backend, hidden_size(model), model_dtype(model))


def expected_fusion(tp: int, model: str, backend: str) -> str | None:
    """The fusion backend the plan promises, or skip when it refuses the one asked for."""
    refused = refused_backend(
        tp, model_arch(model), backend, hidden_size(model), model_dtype(model)
    )
    if refused:
        pytest.skip(refused)
    return case_plan(tp, model, backend).get("fusion_backend")


def _enabled_tp() -> tuple[int, ...]:
    return tuple(t for t in env_list("SGLANG_SM120_E2E_TP", TP_SIZES) if t in TP_SIZES)


def _enabled_backends() -> tuple[str, ...]:
    return tuple(b for b in env_list("SGLANG_SM120_E2E_BACKENDS", BACKENDS) if b in BACKENDS)


@dataclass
class Case:
    """A (model pair, tp, backend) combination; launches its servers on first use."""

    runs: ServerRuns
    target: str
    draft: str
    tp: int
    backend: str
    fusion: str | None
    prompts: tuple[str, ...]
    max_new_tokens: int = 32
    tree: tuple[int, int, int] = SMALL_TREE
    max_total_tokens: int | None = None  # a capped KV pool, for servers sharing the GPUs

    def launches(self) -> tuple[Launch, Launch]:
        """(the reference, the EAGLE-3 server)."""
        return self._launch(draft=None), self._launch(draft=self.draft)

    def plain(self) -> RunResult:
        return self.runs.get(self._launch(draft=None))

    def spec(self) -> RunResult:
        return self.runs.get(self._launch(draft=self.draft))

    def _launch(self, draft: str | None) -> Launch:
        return Launch(
            self.target,
            self.tp,
            self.backend,
            draft,
            self.tree,
            self.prompts,
            self.max_new_tokens,
            max_total_tokens=self.max_total_tokens,
            extra_args=env_server_args(),
        )


def _tiny_params() -> list[Any]:
    return [
        pytest.param((arch, tp, backend), id=f"{arch}-tp{tp}-{backend}")
        for arch in TINY_ARCHS
        for tp in _enabled_tp()
        for backend in _enabled_backends()
    ]


# Backends whose plan can refuse them (the case skips): their servers start once the plan is in.
REFUSABLE = ("trtllm", "sm120_pcie")


class TinyServers:
    """The tiny-pair servers of one TP size, all started in the background by the first case of
    that size (``server_runs`` keeps ``SGLANG_SM120_E2E_PARALLEL`` alive at once), each with a
    capped KV pool (as selftest starts its pair): a case then waits only for its own two. Only
    the cases pytest collected count, so ``-k llama`` starts no DeepSeek server. Backends the
    plan may refuse start after their plan is in; the others start before any plan is asked for.

    No pre-start (each case starts its own servers when it runs) under pytest-xdist, where
    every worker collects all cases but runs only its share, and when the extra server args
    size the memory (selftest's ``MEMORY_FLAGS``): then, as in selftest, servers run one at a
    time with SGLang's own KV pool."""

    def __init__(self, runs: ServerRuns, pairs: dict[str, Any], collected: set[tuple]) -> None:
        self.runs, self.pairs, self.collected = runs, pairs, collected
        self.started: set[int] = set()
        sized = any(arg.split("=")[0] in MEMORY_FLAGS for arg in env_server_args())
        self.together = not sized
        self.pre_start = not sized and "PYTEST_XDIST_WORKER" not in os.environ

    def case(self, arch: str, tp: int, backend: str, fusion: str | None) -> Case:
        pair = self.pairs[arch]
        return Case(
            self.runs,
            str(pair.target),
            str(pair.draft),
            tp,
            backend,
            fusion,
            tiny_models.PROMPTS,
            max_total_tokens=SHARED_GPU_KV_TOKENS if self.together else None,
        )

    def start(self, tp: int) -> None:
        if not self.pre_start or tp in self.started:
            return
        self.started.add(tp)
        cases = sorted((a, b) for a, t, b in self.collected if t == tp)
        sure = [self.case(a, tp, b, None) for a, b in cases if b not in REFUSABLE]
        self._start([launch for case in sure for launch in case.launches()])
        planned = []
        for arch, backend in cases:
            if backend in REFUSABLE:
                target = str(self.pairs[arch].target)
                args = (tp, model_arch(target), backend, hidden_size(target), model_dtype(target))
                if refused_backend(*args) is None:
                    planned.append(self.case(arch, tp, backend, None))
        self._start([launch for case in planned for launch in case.launches()])

    def _start(self, launches: list[Launch]) -> None:
        if launches:  # memoised: each case's get() waits for its own servers
            self.runs.start(launches, at_once=True).__enter__()


@pytest.fixture(scope="session")
def tiny_servers(request, tiny_pairs, server_runs) -> TinyServers:
    collected = {
        item.callspec.params["tiny_case"]
        for item in request.session.items
        if "tiny_case" in getattr(getattr(item, "callspec", None), "params", {})
    }
    return TinyServers(server_runs, tiny_pairs, collected)


@pytest.fixture
def tiny_case(request, tiny_servers) -> Case:
    arch, tp, backend = request.param
    require_gpus(tp)
    tiny_servers.start(tp)
    target = str(tiny_servers.pairs[arch].target)
    return tiny_servers.case(arch, tp, backend, expected_fusion(tp, target, backend))


def assert_passed(checks: list[Check]) -> None:
    """``sglang-sm120 selftest``'s own checks (its verdict logic is tested on CPU)."""
    failed = [f"{c.check}: expected {c.expected}, seen {c.seen}" for c in checks if not c.passed]
    assert not failed, "\n".join(failed)


def assert_same_greedy(case: Case) -> None:
    assert_passed([greedy_check(case.plain(), case.spec())])


def assert_verify_replayed(case: Case) -> None:
    assert_passed(graph_checks(case.spec(), case.tp))


# ---------------------------------------------------------------- tiny pairs


@pytest.mark.parametrize("tiny_case", _tiny_params(), indirect=True)
def test_speculative_greedy_matches_plain(tiny_case: Case) -> None:
    assert_same_greedy(tiny_case)


@pytest.mark.parametrize("tiny_case", _tiny_params(), indirect=True)
def test_target_verify_replays_cuda_graph(tiny_case: Case) -> None:
    assert_verify_replayed(tiny_case)


@pytest.mark.parametrize("tiny_case", _tiny_params(), indirect=True)
def test_verify_graph_fusion_matches_plan(tiny_case: Case) -> None:
    """Every rank runs the plan; at least one fused all-reduce + norm per layer in every
    captured verify graph where it fuses, none where it does not."""
    spec = tiny_case.spec()
    assert spec.stats_problem is None, spec.stats_problem
    plan = case_plan(tiny_case.tp, tiny_case.target, tiny_case.backend)
    assert_passed(plan_checks(spec, plan, num_layers(tiny_case.target)))


@pytest.mark.parametrize("tiny_case", _tiny_params(), indirect=True)
def test_tiny_pair_reaches_designed_accept_length(tiny_case: Case) -> None:
    accept = tiny_case.spec().accept_length()
    floor, designed = tiny_models.MIN_ACCEPT_LENGTH, tiny_models.DESIGNED_ACCEPT_LENGTH
    assert accept >= floor, (
        f"accept length {accept:.2f} < {floor} (designed {designed}): the verify step or the "
        "draft's hidden states are wrong"
    )


@pytest.mark.parametrize("tiny_case", _tiny_params(), indirect=True)
def test_plain_output_follows_designed_successor(tiny_case: Case) -> None:
    fixture = json.loads((Path(tiny_case.target) / tiny_models.FIXTURE_FILE).read_text())
    assert_passed([designed_tokens_check(tiny_case.plain(), fixture["successor"])])


# ---------------------------------------------------------------- a real pair


def _real_pair() -> tuple[str, str] | None:
    target = os.environ.get("SGLANG_SM120_E2E_TARGET")
    draft = os.environ.get("SGLANG_SM120_E2E_DRAFT")
    return (target, draft) if target and draft else None


def real_pair_threshold(target: str, draft: str) -> tuple[float, str]:
    """(min accept length, where it comes from); the env override wins."""
    override = E2E_MIN_ACCEPT.read()  # a finite number in (0, 64]; else one warning, unset
    if override is not None:
        return override, E2E_MIN_ACCEPT.name
    known = known_threshold(target, draft)
    if known is None:
        pytest.fail(
            f"no accept-length threshold recorded for {target} + {draft}: add it to KNOWN_PAIRS "
            "(sglang_sm120/commands/e2e.py) or set SGLANG_SM120_E2E_MIN_ACCEPT"
        )
    return known


def _real_params() -> list[Any]:
    default_tp = max((t for t in TP_SIZES if t <= max(gpu_count(), 1)), default=1)
    sizes = env_list("SGLANG_SM120_E2E_REAL_TP", (default_tp,))
    return [
        pytest.param((tp, backend), id=f"tp{tp}-{backend}")
        for tp in sizes
        for backend in _enabled_backends()
    ]


@pytest.fixture
def real_case(request, e2e_ready, server_runs) -> Case:
    pair = _real_pair()
    if pair is None:
        pytest.skip("no real pair: set SGLANG_SM120_E2E_TARGET and SGLANG_SM120_E2E_DRAFT")
    tp, backend = request.param
    require_gpus(tp)
    target, draft = pair
    fusion = expected_fusion(tp, target, backend)
    tree = env_list("SGLANG_SM120_E2E_REAL_TREE", SMALL_TREE)
    return Case(
        server_runs,
        target,
        draft,
        tp,
        backend,
        fusion,
        chat_prompts(target),
        REAL_MAX_NEW_TOKENS,
        tuple(tree),
    )


@pytest.mark.parametrize("real_case", _real_params(), indirect=True)
def test_real_pair_reaches_recorded_accept_length(real_case: Case) -> None:
    threshold, source = real_pair_threshold(real_case.target, real_case.draft)
    accept = real_case.spec().accept_length()
    assert accept >= threshold, f"accept length {accept:.3f} < {threshold} ({source})"


@pytest.mark.parametrize("real_case", _real_params(), indirect=True)
def test_real_pair_greedy_matches_plain(real_case: Case) -> None:
    assert_same_greedy(real_case)


@pytest.mark.parametrize("real_case", _real_params(), indirect=True)
def test_real_pair_verify_replays_cuda_graph(real_case: Case) -> None:
    assert_verify_replayed(real_case)
