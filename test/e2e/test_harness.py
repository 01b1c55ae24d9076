"""The e2e harness's own logic, on CPU: stats files, accept length, launch flags, plan skips."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
from processes import gone
from sglang_sm120.commands import e2e as h


def _write_stats(folder: Path, pid: int, tp_rank: int | None, replays: int, **extra) -> None:
    body = {
        "pid": pid,
        "tp_rank": tp_rank,
        "fusion_backend": None,
        "plain_allreduce": "nccl",
        "graph_captures": {h.VERIFY_MODE: 3},
        "graph_replays": {h.VERIFY_MODE: replays},
        "fused_allreduce_in_capture": {},
        **extra,
    }
    (folder / f"sm120-stats-{pid}.json").write_text(json.dumps(body))


def test_read_stats_keys_tp_ranks_and_skips_other_processes(tmp_path) -> None:
    _write_stats(tmp_path, 10, 0, 5)
    _write_stats(tmp_path, 11, 1, 6)
    _write_stats(tmp_path, 12, None, 0)  # detokenizer / tokenizer manager
    (tmp_path / "sm120-stats-13.json").write_text('{"pid": 13, "tp_ra')  # being rewritten
    stats = h.read_stats(tmp_path)
    assert sorted(stats) == [0, 1]
    assert h.count(stats[1], "graph_replays") == 6
    assert h.count(stats[1], "fused_allreduce_in_capture") == 0


def test_sync_stats_waits_for_files_rewritten_after_the_nudge(tmp_path) -> None:
    _write_stats(tmp_path, 10, 0, 4)
    _write_stats(tmp_path, 11, 1, 4)

    def nudge() -> None:  # what a 2-token request does: a count changes, files rewritten
        _write_stats(tmp_path, 10, 0, 5)
        _write_stats(tmp_path, 11, 1, 5)

    stats, problem = h.sync_stats(tmp_path, 2, nudge, timeout_s=5)
    assert problem is None
    assert [h.count(stats[r], "graph_replays") for r in (0, 1)] == [5, 5]


def test_sync_stats_takes_a_rewrite_stamped_by_the_coarse_file_clock(tmp_path) -> None:
    """A file's mtime comes from the kernel's coarse clock, a tick (a few ms) behind
    time.time(): a file rewritten right after the nudge was sent can carry an earlier stamp."""
    _write_stats(tmp_path, 10, 0, 4)
    _write_stats(tmp_path, 11, 1, 4)

    def nudge() -> None:
        stamp = time.time() - 0.004
        for pid, rank in ((10, 0), (11, 1)):
            _write_stats(tmp_path, pid, rank, 5)
            os.utime(tmp_path / f"sm120-stats-{pid}.json", (stamp, stamp))

    stats, problem = h.sync_stats(tmp_path, 2, nudge, timeout_s=1)
    assert problem is None
    assert [h.count(stats[r], "graph_replays") for r in (0, 1)] == [5, 5]


def test_sync_stats_names_ranks_whose_files_stayed_stale(tmp_path) -> None:
    _write_stats(tmp_path, 10, 0, 4)
    _write_stats(tmp_path, 11, 1, 4)

    def nudge() -> None:  # only rank 0 writes
        _write_stats(tmp_path, 10, 0, 5)

    stats, problem = h.sync_stats(tmp_path, 2, nudge, timeout_s=0.5)
    assert problem is not None and "[0] of 2" in problem and h.STATS_ENV in problem
    assert sorted(stats) == [0, 1]


def test_accept_length_is_completion_tokens_per_verify_pass() -> None:
    launch = h.Launch("m", 1, "off", "d", prompts=("a", "b"))
    meta = [
        {"completion_tokens": 32, "spec_verify_ct": 16},
        {"completion_tokens": 32, "spec_verify_ct": 12},
    ]
    result = h.RunResult(launch, [], [], meta, {}, {}, Path("log"))
    assert result.verify_count == 28
    assert result.accept_length() == pytest.approx(64 / 28)
    plain = h.RunResult(launch, [], [], [{"completion_tokens": 32}], {}, {}, Path("log"))
    assert plain.accept_length() == 0.0


def test_launch_args_turn_on_eagle3_only_with_a_draft() -> None:
    plain = h.Launch("/m/target", 4, "trtllm").server_args(30000)
    spec = h.Launch("/m/target", 4, "off", draft="/m/draft").server_args(30000)
    assert "--speculative-algorithm" not in plain
    assert plain[plain.index("--tp-size") + 1] == "4"
    assert plain[-2:] == ["--flashinfer-allreduce-fusion-backend", "trtllm"]
    steps, topk, tokens = h.SMALL_TREE
    for flag, value in (
        ("--speculative-algorithm", "EAGLE3"),
        ("--speculative-draft-model-path", "/m/draft"),
        ("--speculative-num-steps", str(steps)),
        ("--speculative-eagle-topk", str(topk)),
        ("--speculative-num-draft-tokens", str(tokens)),
    ):
        assert spec[spec.index(flag) + 1] == value
    assert "--enforce-disable-flashinfer-allreduce-fusion" in spec
    assert "--disable-cuda-graph" not in spec  # the point is to run verify from graphs


def test_equal_launches_share_one_server() -> None:
    a = h.Launch("t", 2, "auto", "d", prompts=("p",))
    b = h.Launch("t", 2, "auto", "d", prompts=("p",))
    assert a == b and hash(a) == hash(b)
    assert a != h.Launch("t", 2, "auto", None, prompts=("p",))


def test_gpu_env_pins_the_first_gpus_and_keeps_the_plugin_on(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    monkeypatch.setenv("SGLANG_SM120_DISABLE", "1")
    monkeypatch.setenv("SGLANG_PLUGINS", "other")
    env = h.gpu_env(2)
    assert env["CUDA_VISIBLE_DEVICES"] == "3,5"
    assert "SGLANG_SM120_DISABLE" not in env
    assert env["SGLANG_PLUGINS"] == "other,sglang_sm120"


def test_a_refused_fused_backend_is_reported_with_the_plans_reasons(monkeypatch) -> None:
    plan = {"fusion_backend": None, "plain_allreduce": "nccl", "reasons": ["no P2P on 0-1"]}
    monkeypatch.setitem(h._PLANS, (2, "DeepseekV3ForCausalLM", "trtllm", None, None), plan)
    monkeypatch.setitem(h._PLANS, (2, "DeepseekV3ForCausalLM", "off", None, None), plan)
    assert "no P2P on 0-1" in h.refused_backend(2, "DeepseekV3ForCausalLM", "trtllm")
    assert h.refused_backend(2, "DeepseekV3ForCausalLM", "off") is None


# ---------------------------------------------------------------- a whole launch, faked

FAKE_SERVER = Path(__file__).with_name("fake_sglang_server.py")


def _fake_server_args(launch: h.Launch, port: int) -> list[str]:
    args = [sys.executable, str(FAKE_SERVER), "--port", str(port), "--tp", str(launch.tp)]
    return args + (["--speculative"] if launch.draft else [])


@pytest.fixture
def fake_runs(tmp_path, monkeypatch) -> h.ServerRuns:
    monkeypatch.setattr(h.Launch, "server_args", _fake_server_args)
    (tmp_path / "logs").mkdir()
    runs = h.ServerRuns(tmp_path / "runs", tmp_path / "logs")
    runs.startup_s = 60
    return runs


def test_a_launch_collects_outputs_and_stats_then_stops_its_processes(fake_runs) -> None:
    launch = h.Launch("fake", 2, "off", draft="draft", prompts=("a", "bb", "c"), max_new_tokens=8)
    result = fake_runs.get(launch)
    assert result.stats_problem is None
    assert len(result.sequential_ids) == 3 and result.sequential_ids == result.batched_ids
    assert result.verify_count == 3 * 4
    for rank in (0, 1):
        grown = h.count(result.stats_after[rank], "graph_replays") - h.count(
            result.stats_before[rank], "graph_replays"
        )
        # The fake, like the plugin, writes at most once a second; the harness's sync
        # requests bring every count in, plus up to two verify passes of their own.
        assert result.verify_count <= grown <= result.verify_count + 2
    assert fake_runs.get(launch) is result  # memoised: no second server
    worker = int(re.search(r"worker pid (\d+)", result.log.read_text()).group(1))
    assert gone(worker), "the server's worker process outlived the run"


def test_a_server_that_dies_at_start_fails_with_its_log(fake_runs, monkeypatch) -> None:
    crash = [sys.executable, "-c", "import sys; print('bad flag --x'); sys.exit(3)"]
    monkeypatch.setattr(h.Launch, "server_args", lambda self, port: crash)
    with pytest.raises(RuntimeError, match=r"exited with 3(.|\n)*bad flag --x"):
        fake_runs.get(h.Launch("fake", 1, "off", prompts=("a",)))


def test_launch_flags_parse_with_sglangs_own_parser() -> None:
    pytest.importorskip("sglang", reason="sglang is not installed")
    from sglang.srt.server_args import prepare_server_args

    for backend in h.BACKENDS:
        argv = h.Launch("/m/target", 2, backend, "/m/draft").server_args(30000)
        parsed = prepare_server_args(argv[argv.index("--model-path") :])
        assert parsed.tp_size == 2
        assert parsed.speculative_algorithm == "EAGLE3"
        steps, topk, tokens = h.SMALL_TREE
        assert (
            parsed.speculative_num_steps,
            parsed.speculative_eagle_topk,
            parsed.speculative_num_draft_tokens,
        ) == (steps, topk, tokens)
        assert parsed.enforce_disable_flashinfer_allreduce_fusion == (backend == "off")
