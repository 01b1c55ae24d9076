"""``sglang-sm120 selftest``'s verdict and its refusals, on CPU.

The verdict is computed from what two server runs produced (``e2e.RunResult``) and the plan;
each test breaks one thing a real SM120 run can get wrong and names the check that must catch
it. The server lifecycle (stop on failure and on signals) is tested against the fake server in
test/e2e/test_selftest_lifecycle.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from code_in_module import frame_in, wait_in
from sglang_sm120.commands import e2e, selftest
from sglang_sm120.commands.selftest import AcceptFloor, Outcome, evaluate
from sglang_sm120.machine.facts import GpuInfo, HostFacts

TP = 2
LAYERS = 5
PLAN_OFF = {"fusion_backend": None, "plain_allreduce": "pcie_ipc", "reasons": []}
PLAN_FUSED = {"fusion_backend": "sm120_pcie", "plain_allreduce": "sm120_pcie", "reasons": []}
OUTPUTS = [[5, 12, 19, 26], [40, 47, 54, 61], [7, 14, 21, 28]]
SUCCESSOR = [(t + 7) % 100 for t in range(100)]
FLOOR = AcceptFloor(1.8, "designed 2.0")


def stats(plan: dict, replays: int, captures: int = 3, fused: int = 0, **extra) -> dict:
    return {
        "fusion_backend": plan["fusion_backend"],
        "plain_allreduce": plan["plain_allreduce"],
        "graph_captures": {e2e.VERIFY_MODE: captures},
        "graph_replays": {e2e.VERIFY_MODE: replays},
        "fused_allreduce_in_capture": {e2e.VERIFY_MODE: fused} if fused else {},
        **extra,
    }


def runs(plan: dict = PLAN_OFF, fused: int = 0) -> tuple[e2e.RunResult, e2e.RunResult]:
    """A reference and an EAGLE-3 run that pass every check: 3 prompts x 4 tokens, 2 verify
    passes each (accept length 2.0), 6 replays on each rank."""
    launch = e2e.Launch("t", TP, "auto", prompts=("a", "b", "c"))
    outputs = [list(o) for o in OUTPUTS]
    reference = e2e.RunResult(
        launch, outputs, outputs, [{"completion_tokens": 4}] * 3, {}, {}, Path("ref.log")
    )
    meta = [{"completion_tokens": 4, "spec_verify_ct": 2}] * 3
    before = {r: stats(plan, replays=10) for r in range(TP)}
    after = {r: stats(plan, replays=16, fused=fused) for r in range(TP)}
    spec = e2e.RunResult(
        dataclasses.replace(launch, draft="d"),
        [list(o) for o in OUTPUTS],
        [list(o) for o in OUTPUTS],
        meta,
        before,
        after,
        Path("spec.log"),
    )
    return reference, spec


def checks_of(
    reference, spec, plan=PLAN_OFF, failures=None, floor=FLOOR, stats_at_failure=None
) -> list[selftest.Check]:
    """The verdict for two runs (None: that server failed, for the reason in ``failures``)."""
    failures = failures or {}
    return evaluate(
        tp=TP,
        reference=Outcome(reference, failures.get("reference", "")),
        spec=Outcome(spec, failures.get("eagle3", ""), stats_at_failure or {}),
        plan=plan,
        layers=LAYERS,
        floor=floor,
        successor=SUCCESSOR,
    )


def verdict(*args, **kwargs) -> dict[str, selftest.Check]:
    return {c.check: c for c in checks_of(*args, **kwargs)}


def failed(checks: dict[str, selftest.Check]) -> list[str]:
    return [name for name, c in checks.items() if not c.passed]


@pytest.mark.parametrize(
    ("model", "problem"),
    [
        ("/nonexistent", "no such directory"),
        ("./no-such-model", "no such directory"),
        ("~/no-such-model-here", "no such directory"),
        ("deepseek-ai/DeepSeek-V3", None),  # a Hugging Face repo id: read from the HF cache
        ("Llama-3.1-8B", None),
        ("{dir}", None),
        ("{file}", "is a file, not a model directory (give the folder with config.json)"),
    ],
)
def test_a_model_that_looks_like_a_local_path_must_be_a_directory(tmp_path, model, problem):
    (tmp_path / "config.json").write_text("{}")
    model = model.replace("{dir}", str(tmp_path)).replace("{file}", str(tmp_path / "config.json"))
    assert selftest.local_model_problem(model) == problem


def test_runs_that_did_everything_right_pass_every_check() -> None:
    checks = verdict(*runs())
    assert failed(checks) == []
    assert len(checks) == 10
    assert checks["TARGET_VERIFY CUDA graph replayed"].seen == "6 on each of 2 ranks"
    assert checks["accept length"].seen.startswith("2.00 (12 tokens / 6 verify passes)")


def test_one_token_off_in_the_speculative_output_fails_greedy_equality() -> None:
    reference, spec = runs()
    spec.sequential_ids[1][2] = 99
    checks = verdict(reference, spec)
    assert failed(checks) == ["greedy output: EAGLE-3 == plain reference"]
    assert "one-at-a-time prompt 1: token 2: 99 instead of 54" in checks[failed(checks)[0]].seen


def test_batched_speculative_output_is_compared_too() -> None:
    reference, spec = runs()
    spec.batched_ids[0] = spec.batched_ids[0][:3]
    checks = verdict(reference, spec)
    assert "batched prompt 0: 3 tokens instead of 4" in checks[failed(checks)[0]].seen


def test_a_reference_that_breaks_the_designed_chain_fails_its_own_check() -> None:
    reference, spec = runs()
    reference.sequential_ids[2][3] = 50
    spec.sequential_ids[2][3] = spec.batched_ids[2][3] = 50  # equal, but both wrong
    assert failed(verdict(reference, spec)) == ["reference follows the fixture's designed tokens"]


def test_verify_passes_run_eagerly_fail_the_replay_check() -> None:
    reference, spec = runs()
    spec.stats_after[1] = stats(PLAN_OFF, replays=13)  # 3 replays for 6 verify passes
    checks = verdict(reference, spec)
    assert failed(checks) == ["TARGET_VERIFY CUDA graph replayed"]
    assert checks["TARGET_VERIFY CUDA graph replayed"].seen == "rank 0: 6, rank 1: 3"


def test_no_verify_graph_captured_fails() -> None:
    reference, spec = runs()
    spec.stats_after[0] = stats(PLAN_OFF, replays=16, captures=0)
    assert "TARGET_VERIFY CUDA graph captured" in failed(verdict(reference, spec))


def test_a_rank_without_stats_fails_the_graph_checks_by_name() -> None:
    reference, spec = runs()
    del spec.stats_after[1]
    checks = verdict(reference, spec)
    assert checks["TARGET_VERIFY CUDA graph captured"].seen == "no stats from ranks [1]"
    assert not checks["TARGET_VERIFY CUDA graph replayed"].passed


def test_the_harness_stats_problem_is_shown() -> None:
    reference, spec = runs()
    spec.stats_problem = "fresh stats from ranks [0] of 2"
    checks = verdict(reference, spec)
    assert checks["TARGET_VERIFY CUDA graph captured"].seen == "fresh stats from ranks [0] of 2"
    assert not checks["TARGET_VERIFY CUDA graph captured"].passed


def test_fusion_on_in_the_plan_needs_a_fused_call_per_layer_in_every_verify_graph() -> None:
    reference, spec = runs(PLAN_FUSED, fused=LAYERS * 3)
    assert failed(verdict(reference, spec, PLAN_FUSED)) == []
    spec.stats_after[1]["fused_allreduce_in_capture"] = {e2e.VERIFY_MODE: LAYERS * 3 - 1}
    checks = verdict(reference, spec, PLAN_FUSED)
    assert failed(checks) == ["fused all-reduce + RMSNorm in the verify graph"]


def test_table_routed_unfused_everywhere_expects_no_fused_call() -> None:
    """sm120_pcie chosen from a tuning table that routes every size to our all-reduce + SGLang's
    norm: the verify graph holds no fused call, and that is the plan, not a failure."""
    plan = {**PLAN_FUSED, "routes": {"4": "sm120_pcie_unfused", "64": "sm120_pcie_unfused"}}
    reference, spec = runs(plan, fused=0)
    assert failed(verdict(reference, spec, plan)) == []
    reference, spec = runs(plan, fused=LAYERS)
    assert failed(verdict(reference, spec, plan)) == [
        "fused all-reduce + RMSNorm in the verify graph"
    ]


def test_table_fusing_some_sizes_expects_one_fused_graph() -> None:
    """Fused at 4 tokens, unfused above: only the graphs captured at fused sizes hold fused
    calls, so a layer's worth (one graph) is what every rank must show."""
    plan = {**PLAN_FUSED, "routes": {"4": "sm120_pcie", "64": "sm120_pcie_unfused"}}
    reference, spec = runs(plan, fused=LAYERS)
    assert failed(verdict(reference, spec, plan)) == []
    spec.stats_after[0]["fused_allreduce_in_capture"] = {e2e.VERIFY_MODE: LAYERS - 1}
    assert failed(verdict(reference, spec, plan)) == [
        "fused all-reduce + RMSNorm in the verify graph"
    ]


def test_fused_calls_when_the_plan_says_fusion_off_fail() -> None:
    reference, spec = runs(PLAN_OFF, fused=2)
    assert failed(verdict(reference, spec)) == ["fused all-reduce + RMSNorm in the verify graph"]


def test_off_sm12x_upstream_chooses_and_its_fusion_is_checked_in_the_graph() -> None:
    """The plan leaves non-SM12x hosts to upstream (e.g. trtllm on SM90): whatever the ranks
    run is fine, but a rank that fuses must have its fused calls in the verify graph."""
    upstream = {"managed": False, "fusion_backend": None, "plain_allreduce": "upstream"}
    served = {"fusion_backend": "trtllm", "plain_allreduce": "upstream", "reasons": []}
    reference, spec = runs(served, fused=LAYERS * 3)
    assert failed(verdict(reference, spec, upstream)) == []
    spec.stats_after[0]["fused_allreduce_in_capture"] = {}
    assert failed(verdict(reference, spec, upstream)) == [
        "fused all-reduce + RMSNorm in the verify graph"
    ]


def test_without_doctors_plan_the_run_cannot_pass() -> None:
    checks = verdict(*runs(), plan=None)
    assert failed(checks) == ["ranks run the plan"]
    assert checks["ranks run the plan"].seen == "no plan"


def test_a_rank_running_another_plan_fails() -> None:
    reference, spec = runs()
    spec.stats_after[1]["plain_allreduce"] = "nccl"
    checks = verdict(reference, spec)
    assert failed(checks) == ["ranks run the plan"]
    assert "rank 1: fusion=off, plain all-reduce=nccl" in checks["ranks run the plan"].seen


def test_accept_length_below_the_floor_fails() -> None:
    reference, spec = runs()
    spec.sequential_meta = [{"completion_tokens": 4, "spec_verify_ct": 3}] * 3  # 1.33
    for rank in spec.stats_after:
        spec.stats_after[rank]["graph_replays"] = {e2e.VERIFY_MODE: 19}
    checks = verdict(reference, spec)
    assert failed(checks) == ["accept length"]
    assert checks["accept length"].expected == ">= 1.80 (designed 2.0)"


def test_without_a_known_threshold_any_accepted_draft_token_is_enough() -> None:
    floor = AcceptFloor(1.0, "no threshold", strict=True)
    assert floor.met(1.01) and not floor.met(1.0)


def test_a_peer_timeout_on_one_rank_fails_and_is_quoted() -> None:
    reference, spec = runs()
    spec.stats_after[0]["peer_error"] = None  # null: the check ran and did not fire
    spec.stats_after[1]["peer_error"] = "peer 0 did not arrive within 60000 ms"
    checks = verdict(reference, spec)
    assert failed(checks) == ["no peer timeout (sm120_pcie)"]
    assert "rank 1: peer 0 did not arrive" in checks["no peer timeout (sm120_pcie)"].seen


def test_a_failed_eagle3_server_fails_with_its_reason() -> None:
    reference, _ = runs()
    why = "server exited with 1; log ends: ValueError: x (log: /tmp/l/01.log)"
    checks = verdict(reference, None, failures={"eagle3": why})
    assert checks["EAGLE-3 server (plugin on, CUDA graphs)"].seen == why
    assert failed(checks) == ["EAGLE-3 server (plugin on, CUDA graphs)"]


def test_a_server_killed_by_a_peer_timeout_still_names_it_from_the_stats_it_wrote() -> None:
    reference, _ = runs()
    written = {0: stats(PLAN_OFF, replays=3, peer_error="peer 1 did not arrive")}
    checks = verdict(reference, None, failures={"eagle3": "exited"}, stats_at_failure=written)
    assert checks["no peer timeout (sm120_pcie)"].seen == "rank 0: peer 1 did not arrive"
    assert not checks["no peer timeout (sm120_pcie)"].passed


def test_a_failed_reference_fails_the_run_but_the_eagle3_checks_still_report() -> None:
    _, spec = runs()
    checks = verdict(None, spec, failures={"reference": "server not ready after 900 s"})
    assert failed(checks) == ["reference server (upstream alone, plain)"]
    assert "greedy output: EAGLE-3 == plain reference" not in checks
    assert "accept length" in checks


def test_the_verdict_table_has_a_row_per_check_and_says_fail() -> None:
    reference, spec = runs()
    spec.stats_after[1]["peer_error"] = "timeout"
    checks = checks_of(reference, spec)
    lines = selftest.format_verdict(checks).splitlines()
    assert lines[0].split() == ["check", "expected", "seen", "result"]
    assert len(lines) == 2 + len(checks)
    assert lines[-1].startswith("no peer timeout") and lines[-1].endswith("FAIL")


# ---------------------------------------------------------------- can it run here


def gpus(n: int) -> HostFacts:
    return HostFacts(
        "test", gpus=tuple(GpuInfo(i, "NVIDIA RTX PRO 6000", (12, 0)) for i in range(n))
    )


def test_no_gpu_is_one_line_with_the_probe_error() -> None:
    reason = selftest.cannot_run(HostFacts("nvml", probe_error="NVML unavailable: x"), None)
    assert "no NVIDIA GPU" in reason and "NVML unavailable: x" in reason and "\n" not in reason


def test_fewer_gpus_than_tp_is_refused_with_the_count() -> None:
    assert "--tp 4 needs 4 GPUs; this host has 2" in selftest.cannot_run(gpus(2), 4)
    assert selftest.cannot_run(gpus(2), 2) is None and selftest.cannot_run(gpus(1), None) is None


@pytest.mark.parametrize("have,tp", [(1, 1), (2, 2), (3, 2), (7, 4), (8, 8), (16, 8)])
def test_default_tp_is_the_largest_size_the_tiny_models_shard_to(have, tp) -> None:
    assert selftest.default_tp(have) == tp


def test_a_topology_profile_plans_but_does_not_count_as_gpus(monkeypatch) -> None:
    """SGLANG_SM120_TOPOLOGY describes 8 GPUs for the plan; the GPUs to run on come from NVML."""
    from sglang_sm120.machine.facts import current_facts

    monkeypatch.setenv("SGLANG_SM120_TOPOLOGY", "rtx-pro-6000-x8-pcie")
    current_facts.cache_clear()
    try:
        assert len(current_facts().gpus) == 8
        assert selftest.visible_gpus().source == "nvml"
    finally:
        current_facts.cache_clear()


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("sglang-sm120", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "sglang_sm120.commands.cli"]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_SM120_")}
    full_env.update(env or {})
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=full_env, timeout=120)


@pytest.mark.parametrize(
    "args,env",
    [
        ((), {}),
        (("--tp", "2", "--json"), {}),
        (("--tp", "8"), {"SGLANG_SM120_TOPOLOGY": "rtx-pro-6000-x8-pcie"}),
    ],
    ids=["plain", "json", "with-a-profile"],
)
def test_selftest_without_gpus_says_so_in_one_line_and_exits_2(args, env) -> None:
    if selftest.visible_gpus().gpus:
        pytest.skip("this machine has GPUs; the no-GPU answer is checked on CPU CI")
    done = _cli("selftest", *args, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sglang-sm120 selftest: no NVIDIA GPU visible")


@pytest.mark.parametrize(
    "args,message",
    [
        (("--target", "/m/t"), "--target and --draft go together"),
        (("--tp", "3"), "the tiny models shard to tp 1, 2, 4, 8, not 3"),
        (("--tp", "0", "--target", "/m/t", "--draft", "/m/d"), "--tp must be at least 1, not 0"),
        (  # the newline a user typed is shown escaped, not printed raw (docs/commands.md)
            ("--target", "/no\nsuch", "--draft", "/m/d"),
            "--target /no\\nsuch: no such directory",
        ),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args, message, capsys) -> None:
    from sglang_sm120.commands.cli import main

    assert main(["selftest", *args]) == 2
    assert capsys.readouterr().err.strip() == f"sglang-sm120 selftest: {message}"


def test_a_target_whose_config_cannot_be_read_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    from sglang_sm120.commands.cli import main

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text("{not json")
    assert main(["selftest", "--target", str(tmp_path / "t"), "--draft", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"sglang-sm120 selftest: cannot read the config of --target {tmp_path}")
    assert "\n" not in err


# ---------------------------------------------------------------- extra server arguments


def parsed_server_args(launch: e2e.Launch):
    """The launch's command line as SGLang's own parser reads it."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    command = launch.server_args(30000)
    assert command[1:3] == ["-m", "sglang.launch_server"]
    return parser.parse_args(command[3:])


def test_extra_server_arguments_come_last_so_sglang_takes_them_over_ours() -> None:
    extra = e2e.split_server_args(["--attention-backend=triton", "--mem-fraction-static 0.2"])
    assert extra == ("--attention-backend=triton", "--mem-fraction-static", "0.2")
    launch = e2e.Launch("/m/t", 1, "off", extra_args=extra)
    args = parsed_server_args(launch)
    assert args.attention_backend == "triton"
    assert args.mem_fraction_static == 0.2  # ours is 0.6: the site's value wins
    assert args.enforce_disable_flashinfer_allreduce_fusion  # the backend's own flag stays
    assert parsed_server_args(e2e.Launch("/m/t", 1, "off")).attention_backend is None


def test_selftest_takes_repeated_server_args_in_both_spellings() -> None:
    from sglang_sm120.commands.cli import build_parser

    args = build_parser().parse_args(
        ["selftest", "--server-arg=--attention-backend=triton", "--server-arg", "--nccl-port 1"]
    )
    assert e2e.split_server_args(args.server_arg) == (
        "--attention-backend=triton",
        "--nccl-port",
        "1",
    )


def test_the_e2e_suite_reads_its_server_args_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(e2e.SERVER_ARGS_ENV, "--attention-backend triton --disable-radix-cache")
    assert e2e.env_server_args() == ("--attention-backend", "triton", "--disable-radix-cache")
    monkeypatch.delenv(e2e.SERVER_ARGS_ENV)
    assert e2e.env_server_args() == ()


def test_an_unbalanced_quote_in_a_server_arg_is_one_line_and_exit_2(capsys) -> None:
    from sglang_sm120.commands.cli import main

    assert main(["selftest", "--server-arg=--chat-template 'x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sglang-sm120 selftest: --server-arg") and "quotation" in err


def test_the_report_says_when_validation_mode_and_extra_server_args_were_on(capsys) -> None:
    report = {
        "plan": None,
        "tp": 1,
        "backend": "auto",
        "checks": [],
        "logs": None,
        "validation_mode": True,
        "server_args": ["--attention-backend", "triton"],
    }
    selftest.print_report(report, sys.stdout)
    out = capsys.readouterr().out
    assert out.startswith("VALIDATION MODE ON: validation mode (SGLANG_SM120_ANY_ARCH=1)")
    assert "extra server arguments: --attention-backend triton" in out


# ---------------------------------------------------------------- the plan asked for


PLAN_FOR = e2e.plan_for  # the real one, for its signature


def fp16_pair(root: Path) -> tuple[Path, Path]:
    """A tiny-fixture-shaped pair whose target is a float16 DeepSeek-V3 (config only)."""
    from model_configs import MODEL_CONFIGS
    from sglang_sm120.commands import tiny_models

    target, draft = root / "target", root / "draft"
    for path in (target, draft):
        path.mkdir()
    config = {**MODEL_CONFIGS["DeepseekV3ForCausalLM"], "torch_dtype": "float16"}
    (target / "config.json").write_text(json.dumps(config))
    (target / tiny_models.FIXTURE_FILE).write_text("{}")
    return target, draft


@pytest.mark.parametrize(
    ("config", "dtype"),
    [
        ({"torch_dtype": "float16"}, "float16"),
        ({"dtype": "bfloat16"}, "bfloat16"),
        ({"text_config": {"torch_dtype": "float16"}, "torch_dtype": "bfloat16"}, "float16"),
        ({"text_config": {"model_type": "x"}, "torch_dtype": "float16"}, "float16"),
        ({"torch_dtype": "float32"}, "float16"),  # SGLang's --dtype auto halves float32
    ],
)
def test_the_models_dtype_is_the_one_sglang_serves_it_in(tmp_path, config, dtype) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"], **config}))
    assert e2e.model_dtype(str(tmp_path)) == dtype


def test_selftest_asks_doctor_for_the_plan_in_the_models_dtype(monkeypatch, tmp_path) -> None:
    """doctor assumes bf16 unless told: for an fp16 model it would expect PCIe-IPC where the
    server rightly runs NCCL, and fail a correct server."""
    import argparse
    import inspect

    target, draft = fp16_pair(tmp_path)
    asked = []
    monkeypatch.setattr(e2e, "plan_for", lambda *a, **k: asked.append((a, k)) or PLAN_OFF)

    class NoServers(e2e.ServerRuns):
        def get(self, launch):
            raise e2e.ServerFailed("not started here", tmp_path / "no.log")

    monkeypatch.setattr(e2e, "ServerRuns", NoServers)
    args = argparse.Namespace(
        target=str(target),
        draft=str(draft),
        backend="auto",
        min_accept=None,
        fixture=None,
        server_arg=None,
    )
    selftest.run_selftest(args, TP, tmp_path / "work", tmp_path / "logs")
    ((call_args, call_kwargs),) = asked
    bound = inspect.signature(PLAN_FOR).bind(*call_args, **call_kwargs)
    assert bound.arguments.get("dtype") == "float16"


@pytest.mark.parametrize(
    ("fixture", "server_args", "why"),
    [
        ({}, (), None),
        ({}, ("--attention-backend", "triton"), None),
        (None, (), "a real --target pair: SGLang sizes its memory, one server at a time"),
        ({}, ("--mem-fraction-static", "0.5"), "--server-arg --mem-fraction-static sizes"),
        ({}, ("--max-total-tokens=4096",), "--server-arg --max-total-tokens sizes"),
    ],
)
def test_only_the_tiny_pair_with_memory_left_to_us_starts_both_servers_at_once(
    fixture, server_args, why
) -> None:
    pair = selftest.Pair("t", "d", fixture)
    seen = selftest.why_one_after_the_other(pair, server_args)
    assert seen == why if why is None else seen.startswith(why)


@pytest.mark.parametrize(
    ("server_arg", "capped"), [(None, True), (["--mem-fraction-static=0.3"], False)]
)
def test_servers_started_at_once_each_cap_their_kv_pool(monkeypatch, tmp_path, server_arg, capped):
    """SGLang sizes a KV pool from the memory free when that server started: two servers
    starting together would each claim what the other is about to use."""
    import argparse

    target, draft = fp16_pair(tmp_path)
    monkeypatch.setattr(e2e, "plan_for", lambda *a, **k: PLAN_OFF)
    launched = []

    class NoServers(e2e.ServerRuns):
        def get(self, launch):
            launched.append(launch)
            raise e2e.ServerFailed("not started here", tmp_path / "no.log")

    monkeypatch.setattr(e2e, "ServerRuns", NoServers)
    args = argparse.Namespace(
        target=str(target),
        draft=str(draft),
        backend="auto",
        min_accept=None,
        fixture=None,
        server_arg=server_arg,
    )
    selftest.run_selftest(args, TP, tmp_path / "work", tmp_path / "logs")
    cap = selftest.SHARED_GPU_KV_TOKENS if capped else None
    assert len(launched) == 2 and {launch.max_total_tokens for launch in launched} == {cap}


def test_doctor_plans_nccl_for_an_fp16_model_at_tp8_on_pcie(monkeypatch, tmp_path) -> None:
    """What the selftest then expects of the server: PCIe-IPC serves bf16 only."""
    monkeypatch.setenv("SGLANG_SM120_TOPOLOGY", "rtx-pro-6000-x8-pcie")
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(tmp_path))
    target, _ = fp16_pair(tmp_path)
    plan = e2e.plan_for(
        8,
        e2e.model_arch(str(target)),
        "auto",
        e2e.hidden_size(str(target)),
        e2e.model_dtype(str(target)),
    )
    assert plan["plain_allreduce"] == "nccl"
    assert any("PCIe-IPC serves bf16 only, model dtype is float16" in r for r in plan["reasons"])


# ------------------------------------------------ stats files as graph_stats writes them


def write_rank_stats(directory: Path, rank: int, replays: int, peer_error: str | None = None):
    """One rank's stats file, written by graph_stats' own recorder (and, for a peer timeout,
    by its ``note_peer_error``, as peer_check calls it), as that TP rank: 3 verify graphs
    captured, ``replays`` replays."""
    from sglang.srt.runtime_context import get_parallel
    from sglang_sm120.server.patches import graph_stats

    recorder = graph_stats.GraphStats(directory)
    recorder.path = directory / f"sm120-stats-{1000 + rank}.json"  # one process per rank
    with get_parallel().override(tp_rank=rank):
        for _ in range(3):
            recorder.bump(recorder.captures, e2e.VERIFY_MODE)
        for _ in range(replays):
            recorder.bump(recorder.replays, e2e.VERIFY_MODE)
        recorder.flush()
        if peer_error is not None:
            saved, graph_stats._stats = graph_stats._stats, recorder
            try:
                graph_stats.note_peer_error(peer_error)
            finally:
                graph_stats._stats = saved
    return recorder.path


def run_from_written_stats(monkeypatch, tmp_path, peer_errors: dict[int, str] | None = None):
    """The passing run of ``runs()``, its stats read back (``e2e.read_stats``) from files the
    plugin's writer produced under the plan PLAN_OFF."""
    from sglang_sm120.planning.policy import AllReducePlan
    from sglang_sm120.server import runtime

    plan = AllReducePlan(True, None, PLAN_OFF["plain_allreduce"], ("test plan",))
    monkeypatch.setattr(runtime, "_last_plan", [plan])
    before_dir, after_dir = tmp_path / "before", tmp_path / "after"
    for directory in (before_dir, after_dir):
        directory.mkdir()
    for rank in range(TP):
        write_rank_stats(before_dir, rank, replays=10)
        write_rank_stats(after_dir, rank, replays=16, peer_error=(peer_errors or {}).get(rank))
    reference, spec = runs()
    spec = dataclasses.replace(
        spec, stats_before=e2e.read_stats(before_dir), stats_after=e2e.read_stats(after_dir)
    )
    return reference, spec, after_dir


def test_stats_files_as_written_hold_a_null_peer_error(monkeypatch, tmp_path) -> None:
    _, spec, after_dir = run_from_written_stats(monkeypatch, tmp_path)
    raw = sorted(after_dir.glob("sm120-stats-*.json"))[0].read_text()
    assert '"peer_error": null' in raw
    assert sorted(spec.stats_after) == list(range(TP))
    assert all(s["peer_error"] is None for s in spec.stats_after.values())


def test_a_correct_run_passes_every_check_from_real_stats_files(monkeypatch, tmp_path) -> None:
    reference, spec, _ = run_from_written_stats(monkeypatch, tmp_path)
    assert selftest.peer_errors(spec.stats_after) == {}
    assert selftest._peer_check(spec.stats_after).passed
    checks = verdict(reference, spec)
    assert failed(checks) == []
    assert checks["no peer timeout (sm120_pcie)"].seen == "none"


def test_a_peer_timeout_noted_by_the_plugin_fails_only_its_check(monkeypatch, tmp_path) -> None:
    error = "rank 1/2: timed out after 60000 ms waiting for rank 0"
    reference, spec, _ = run_from_written_stats(monkeypatch, tmp_path, {1: error})
    assert selftest.peer_errors(spec.stats_after) == {1: error}
    checks = verdict(reference, spec)
    assert failed(checks) == ["no peer timeout (sm120_pcie)"]
    assert checks["no peer timeout (sm120_pcie)"].seen == f"rank 1: {error}"


def test_a_server_that_failed_otherwise_is_not_called_a_peer_timeout(monkeypatch, tmp_path) -> None:
    """The EAGLE-3 server died for another reason: the files its ranks wrote say no timeout."""
    reference, _, after_dir = run_from_written_stats(monkeypatch, tmp_path)
    written = e2e.read_stats(after_dir)
    checks = verdict(reference, None, failures={"eagle3": "exited"}, stats_at_failure=written)
    assert checks["no peer timeout (sm120_pcie)"].passed


def test_a_signal_during_a_c_extensions_import_still_counts_as_the_stop():
    """SIGTERM landing while triton's C extension initialises (SGLang's import, asking for the
    plan) surfaces as "ImportError: initialization failed" chained to StopRequested: selftest
    still exits 128 + signum, not with a traceback (seen once in CI)."""
    import signal

    from sglang_sm120.commands.selftest import StopRequested, stop_requested_in

    stop = StopRequested(signal.SIGTERM)
    try:
        try:
            raise stop
        except StopRequested as inner:
            raise ImportError("initialization failed") from inner
    except ImportError as exc:
        assert stop_requested_in(exc) is stop
    assert stop_requested_in(ValueError("unrelated")) is None


OURS = "sglang_sm120.commands.e2e"


def test_a_signal_landing_in_the_import_system_is_not_raised_there():
    """The handler runs wherever the main thread is. Raised inside importlib just after it took
    the global import lock (a module lock's weakref callback), StopRequested left that lock held
    while server threads imported `requests`: every thread blocked on it and the selftest
    ignored SIGTERM (seen in CI). The stop is recorded there and raised later, elsewhere."""
    import importlib._bootstrap
    import signal

    stop = selftest.SignalStop()
    stop.handler(signal.SIGTERM, frame_in(importlib._bootstrap.__name__))  # no raise
    assert stop.put_off
    assert stop.requested().signum == signal.SIGTERM
    assert not stop.put_off  # handed to the wait that asked


def test_a_signal_landing_in_our_code_raises_at_once_and_a_second_one_is_ignored():
    import signal

    stop = selftest.SignalStop()
    with pytest.raises(selftest.StopRequested):
        stop.handler(signal.SIGTERM, frame_in(OURS))
    stop.handler(signal.SIGINT, frame_in(OURS))  # during the cleanup: ignored


def test_a_signal_landing_in_a_module_body_raises_there_so_a_slow_import_stops_at_once():
    """importlib unwinds an import whose module body raised, releasing its locks; the import of
    SGLang that asks for the plan takes seconds, which a put-off stop would wait out."""
    import signal

    namespace = {"__name__": "some_library", "sys": sys}
    exec(compile("body = sys._getframe()", "some_library.py", "exec"), namespace)
    stop = selftest.SignalStop()
    with pytest.raises(selftest.StopRequested):
        stop.handler(signal.SIGTERM, namespace["body"])
    stop = selftest.SignalStop()
    stop.handler(signal.SIGTERM, frame_in("some_library"))  # a function of it: put off
    assert stop.put_off


def test_a_signal_that_enters_the_handler_again_is_not_raised_inside_it():
    """A second signal can run the handler inside the first call, with the first call's frame
    as its own: raised there, it would leave the first call where that one put the stop off."""
    import importlib._bootstrap
    import signal

    stop = selftest.SignalStop()
    nested: list[bool] = []

    def second_signal(frame, event, arg):
        if event == "call" and frame.f_code is selftest.raising_is_safe.__code__ and not nested:
            nested.append(False)
            try:
                stop.handler(signal.SIGINT, frame)
            except selftest.StopRequested:
                nested[0] = True
        return None

    sys.settrace(second_signal)
    try:
        stop.handler(signal.SIGTERM, frame_in(importlib._bootstrap.__name__))
    finally:
        sys.settrace(None)
    assert nested == [False]
    assert stop.put_off and stop.signum == signal.SIGTERM


def test_a_put_off_stop_is_raised_once_our_code_runs_again():
    """Within stop_on_signals the main thread is sent a put-off stop's signal again every few
    milliseconds; it is raised at the first of these that finds our code (here, a wait)."""
    import importlib._bootstrap
    import signal
    import threading
    import time

    wait = wait_in(OURS)
    before = signal.getsignal(signal.SIGTERM)
    with selftest.stop_on_signals() as stop:
        stop.handler(signal.SIGTERM, frame_in(importlib._bootstrap.__name__))
        begun = time.monotonic()
        with pytest.raises(selftest.StopRequested):
            wait(5)
        assert time.monotonic() - begun < 1
        wait(0.2)  # raised once: no second raise
    assert signal.getsignal(signal.SIGTERM) is before
    assert not any(t.name == "selftest-stop-nudge" for t in threading.enumerate())
