"""The policy as a table: each row is a docs/routing.md rule a reviewer can check by eye.

Columns: host profile x tp x nnodes x attention-DP x MoE a2a x model arch x user flags ->
expected fusion backend and plain all-reduce. Pure: no sglang, no GPU.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from sglang_sm120.machine.facts import KERNEL_NOT_INSTALLED, facts_from_json, load_profile
from sglang_sm120.planning.policy import Deployment, hardware_capability, plan_allreduce

ARCHS = frozenset({"DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"})
KIMI = "KimiK25ForConditionalGeneration"
DSV3 = "DeepseekV3ForCausalLM"

PCIE8 = load_profile("rtx-pro-6000-x8-pcie")
NOP2P2 = load_profile("rtx-5090-x2-nop2p")
H200 = load_profile("h200-x8-nvlink")


def host(p2p="all", nvlink=False, n=8, cap=(12, 0), nnodes=1):
    gpus = [{"name": "GPU", "capability": list(cap), "numa_node": 0} for _ in range(n)]
    return facts_from_json({"gpus": gpus, "p2p": p2p, "nvlink": nvlink, "nnodes": nnodes}, "table")


def one_pair_missing():
    matrix = [[True] * 8 for _ in range(8)]
    matrix[2][6] = matrix[6][2] = False
    return host(p2p=matrix)


def mixed_host():
    """GPUs 0-3 SM90, 4-7 SM120, P2P everywhere."""
    gpus = [{"name": "H100", "capability": [9, 0]}] * 4 + [
        {"name": "PRO", "capability": [12, 0]}
    ] * 4
    return facts_from_json({"gpus": gpus, "p2p": "all"}, "mixed")


WITH_KERNEL = dataclasses.replace(
    PCIE8, versions={**PCIE8.versions, "sgl-kernel-sm120": "0.5.23.1"}, sm120_kernel_problem=None
)
SM120_PCIE = "sm120_pcie"

D = Deployment
ROWS = [
    # id, facts, deployment, fusion_backend, plain_allreduce
    ("tp2 auto fusion", PCIE8, D(2, model_arch=KIMI), "trtllm", "pcie_ipc"),
    ("tp4 fusion off by default", PCIE8, D(4, model_arch=KIMI), None, "pcie_ipc"),
    ("tp8 fusion off by default", PCIE8, D(8, model_arch=DSV3), None, "pcie_ipc"),
    (
        "tp8 user asks trtllm",
        PCIE8,
        D(8, model_arch=KIMI, fusion_backend_flag="trtllm"),
        "trtllm",
        "pcie_ipc",
    ),
    (
        "user mnnvl refused",
        PCIE8,
        D(8, model_arch=KIMI, fusion_backend_flag="mnnvl"),
        None,
        "pcie_ipc",
    ),
    (
        "user cutedsl refused",
        PCIE8,
        D(2, model_arch=KIMI, fusion_backend_flag="cutedsl"),
        None,
        "pcie_ipc",
    ),
    (
        "enforce-disable wins at tp2",
        PCIE8,
        D(2, model_arch=KIMI, enforce_disable_fusion=True),
        None,
        "pcie_ipc",
    ),
    (
        "enforce-disable beats explicit trtllm",
        PCIE8,
        D(8, model_arch=KIMI, fusion_backend_flag="trtllm", enforce_disable_fusion=True),
        None,
        "pcie_ipc",
    ),
    ("arch without fused path", PCIE8, D(2, model_arch="LlamaForCausalLM"), None, "pcie_ipc"),
    ("arch unknown", PCIE8, D(2), None, "pcie_ipc"),
    (
        "attention DP",
        PCIE8,
        D(8, model_arch=KIMI, attention_dp=True, fusion_backend_flag="trtllm"),
        None,
        "pcie_ipc",
    ),
    ("MoE all-to-all", PCIE8, D(8, model_arch=KIMI, moe_a2a_backend="deepep"), None, "pcie_ipc"),
    ("multi-node", PCIE8, D(8, model_arch=KIMI, nnodes=2), None, "nccl"),
    (
        "multi-node explicit trtllm refused",
        PCIE8,
        D(8, model_arch=KIMI, nnodes=2, fusion_backend_flag="trtllm"),
        None,
        "nccl",
    ),
    # PP across nodes: SGLang gives one TP group max(nnodes // pp_size, 1) nodes (engine.py
    # _calculate_rank_ranges). Inside one node the PCIe paths stay; trtllm is refused whenever
    # nnodes > 1 (flashinfer_comm_fusion.resolve_flashinfer_allreduce_fusion_backend).
    (
        "PP2 over 2 nodes, TP8 inside each",
        PCIE8,
        D(8, model_arch=KIMI, nnodes=2, pp_size=2),
        None,
        "pcie_ipc",
    ),
    (
        "PP4 over 2 nodes, two stages a node",
        PCIE8,
        D(4, model_arch=KIMI, nnodes=2, pp_size=4),
        None,
        "pcie_ipc",
    ),
    (
        "PP2 over 2 nodes, TP2 auto trtllm off",
        PCIE8,
        D(2, model_arch=KIMI, nnodes=2, pp_size=2),
        None,
        "pcie_ipc",
    ),
    (
        "PP2 over 2 nodes, explicit trtllm refused",
        PCIE8,
        D(8, model_arch=KIMI, nnodes=2, pp_size=2, fusion_backend_flag="trtllm"),
        None,
        "pcie_ipc",
    ),
    (
        "PP2 over 2 nodes, sm120_pcie",
        WITH_KERNEL,
        D(8, model_arch=KIMI, nnodes=2, pp_size=2, plugin_backend=SM120_PCIE),
        SM120_PCIE,
        SM120_PCIE,
    ),
    (
        "PP2 over 2 nodes, 4 GPUs a node for 8",
        host(n=4),
        D(8, model_arch=KIMI, nnodes=2, pp_size=2),
        None,
        "nccl",
    ),
    ("TP16 spans 2 nodes", PCIE8, D(16, model_arch=KIMI, nnodes=2), None, "nccl"),
    (
        "PP2 over 4 nodes: TP spans 2",
        PCIE8,
        D(8, model_arch=KIMI, nnodes=4, pp_size=2),
        None,
        "nccl",
    ),
    (
        "TP16 spans 2 nodes, sm120_pcie refused",
        WITH_KERNEL,
        D(16, model_arch=KIMI, nnodes=2, plugin_backend=SM120_PCIE),
        None,
        "nccl",
    ),
    (
        "single-node PP2 x TP4 judges all 8 GPUs",
        one_pair_missing(),
        D(4, model_arch=KIMI, pp_size=2),
        None,
        "nccl",
    ),
    ("tp1", PCIE8, D(1, model_arch=KIMI), None, "none"),
    ("tp6 no PCIe-IPC kernels", PCIE8, D(6, model_arch=KIMI), None, "nccl"),
    ("tp larger than GPUs", NOP2P2, D(8, model_arch=KIMI), None, "nccl"),
    (
        "no P2P: NCCL even if trtllm asked",
        NOP2P2,
        D(2, model_arch=KIMI, fusion_backend_flag="trtllm"),
        None,
        "nccl",
    ),
    ("no P2P at tp2 auto", NOP2P2, D(2, model_arch=KIMI), None, "nccl"),
    ("one pair without P2P", one_pair_missing(), D(8, model_arch=KIMI), None, "nccl"),
    (
        "missing pair outside the tp group",
        one_pair_missing(),
        D(2, model_arch=KIMI),
        "trtllm",
        "pcie_ipc",
    ),
    ("user turned PCIe-IPC off", PCIE8, D(8, model_arch=KIMI, pcie_ipc_env=False), None, "nccl"),
    ("deterministic inference", PCIE8, D(8, model_arch=KIMI, deterministic=True), None, "nccl"),
    ("fp16 model", PCIE8, D(8, model_arch=KIMI, dtype="float16"), None, "nccl"),
    (
        "deterministic turns tp2 fusion off",
        PCIE8,
        D(2, model_arch=KIMI, deterministic=True),
        None,
        "nccl",
    ),
    ("--use-ray", PCIE8, D(2, model_arch=KIMI, ray=True), None, "nccl"),
    (
        "sm120_pcie, user PCIe-IPC=1 keeps plain all-reduces on PCIe-IPC",
        WITH_KERNEL,
        D(8, model_arch=KIMI, plugin_backend=SM120_PCIE, pcie_ipc_env=True),
        SM120_PCIE,
        "pcie_ipc",
    ),
    (
        "sm120_pcie, user PCIe-IPC=0 keeps plain all-reduces on NCCL",
        WITH_KERNEL,
        D(8, model_arch=KIMI, plugin_backend=SM120_PCIE, pcie_ipc_env=False),
        SM120_PCIE,
        "nccl",
    ),
    (
        "sm120_pcie refused with PD disaggregation",
        WITH_KERNEL,
        D(8, model_arch=KIMI, plugin_backend=SM120_PCIE, disaggregation=True),
        None,
        "pcie_ipc",
    ),
    (
        "--base-gpu-id 4 on SM120 GPUs",
        mixed_host(),
        D(4, model_arch=KIMI, gpu_ids=(4, 5, 6, 7)),
        None,
        "pcie_ipc",
    ),
    ("default GPUs 0-3 are SM90", mixed_host(), D(4, model_arch=KIMI), None, "upstream"),
    (
        "a second replica's GPUs lack P2P",
        one_pair_missing(),
        D(2, model_arch=KIMI, gpu_ids=(0, 1, 2, 6)),
        None,
        "nccl",
    ),
    (
        "GPUs past the visible ones",
        PCIE8,
        D(4, model_arch=KIMI, gpu_ids=(6, 7, 8, 9)),
        None,
        "nccl",
    ),
    ("SM120 with NVLink tp4", host(nvlink=True), D(4, model_arch=KIMI), None, "upstream"),
    ("SM120 with NVLink tp2", host(nvlink=True), D(2, model_arch=KIMI), "trtllm", "upstream"),
    ("SM121 counts as SM12x", host(cap=(12, 1), n=2), D(2, model_arch=KIMI), "trtllm", "pcie_ipc"),
    ("SM90 untouched", H200, D(8, model_arch=KIMI), None, "upstream"),
    (
        "SM100 untouched",
        host(cap=(10, 0)),
        D(8, model_arch=KIMI, fusion_backend_flag="mnnvl"),
        None,
        "upstream",
    ),
]


@pytest.mark.parametrize(
    ("facts", "deployment", "fusion", "plain"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_plan_table(facts, deployment, fusion, plain):
    plan = plan_allreduce(facts, deployment, ARCHS)
    assert (plan.fusion_backend, plan.plain_allreduce) == (fusion, plain), plan.reasons
    assert plan.reasons and all(isinstance(r, str) and r for r in plan.reasons)


def test_tp_spanning_nodes_says_so():
    plan = plan_allreduce(PCIE8, Deployment(16, model_arch=KIMI, nnodes=2), ARCHS)
    assert any(
        r.startswith("plain all-reduce NCCL: the TP group spans 2 nodes") for r in plan.reasons
    ), plan.reasons
    assert any(r.startswith("fusion off: the TP group spans 2 nodes") for r in plan.reasons)


def test_pp_across_nodes_refuses_trtllm_citing_upstream():
    deployment = Deployment(8, model_arch=KIMI, nnodes=2, pp_size=2, fusion_backend_flag="trtllm")
    plan = plan_allreduce(PCIE8, deployment, ARCHS)
    assert any("requested trtllm refused" in r and "nnodes > 1" in r for r in plan.reasons)
    assert any("TP group inside one node" in r for r in plan.reasons), plan.reasons


def test_non_sm12x_is_not_managed():
    assert not plan_allreduce(H200, Deployment(8, model_arch=KIMI), ARCHS).managed
    assert plan_allreduce(PCIE8, Deployment(8, model_arch=KIMI), ARCHS).managed


def test_refused_user_choice_names_the_backend_and_the_reason():
    plan = plan_allreduce(PCIE8, Deployment(8, model_arch=KIMI, fusion_backend_flag="mnnvl"), ARCHS)
    assert any("mnnvl refused" in r for r in plan.reasons)
    plan = plan_allreduce(
        NOP2P2, Deployment(2, model_arch=KIMI, fusion_backend_flag="trtllm"), ARCHS
    )
    assert any(
        "requested trtllm refused" in r and "no P2P between GPUs 0-1" in r for r in plan.reasons
    )


def test_tp8_reasons_cite_the_upstream_regression_and_pcie_ipc():
    plan = plan_allreduce(PCIE8, Deployment(8, model_arch=KIMI), ARCHS)
    text = " ".join(plan.reasons)
    assert "#32330" in text and "PCIe-IPC" in text and "NUMA nodes [0, 1]" in text


def test_tp8_fusion_reason_states_the_rule_and_both_measurements():
    """The rule (on by default at TP2 only) and its evidence: the TP2 gain, the TP4 regression."""
    plan = plan_allreduce(PCIE8, Deployment(8, model_arch=KIMI), ARCHS)
    reason = next(r for r in plan.reasons if r.startswith("fusion off by default at TP8"))
    assert "on by default at TP2 only" in reason
    assert "#3903 measured +2-5% decode at TP2" in reason
    assert "#32330" in reason and "closed after a TP4 regression" in reason


def test_plan_is_pure():
    deployment = Deployment(2, model_arch=KIMI)
    assert plan_allreduce(PCIE8, deployment, ARCHS) == plan_allreduce(PCIE8, deployment, ARCHS)
    assert dataclasses.is_dataclass(deployment)


def test_capability_without_gpus_says_so():
    cap = hardware_capability(host(n=0))
    assert not cap.sm12x and cap.reasons == ("no NVIDIA GPU visible",)


def test_capability_lists_missing_pairs():
    cap = hardware_capability(one_pair_missing())
    assert cap.sm12x and not cap.fusion_capable and "2-6" in cap.reasons[0]


# --- sgl-kernel-sm120 backend and tuning tables ------------------------------------------------

WITH_KERNEL = dataclasses.replace(
    PCIE8, versions={**PCIE8.versions, "sgl-kernel-sm120": "0.5.23.1"}, sm120_kernel_problem=None
)
WITHOUT_KERNEL = dataclasses.replace(
    PCIE8,
    versions={**PCIE8.versions, "sgl-kernel-sm120": None},
    sm120_kernel_problem=KERNEL_NOT_INSTALLED,
)
LIBRARY_ERROR = "sgl-kernel-sm120 0.5.23.1 is installed, but its library does not load: /x.so"
BROKEN_KERNEL = dataclasses.replace(WITH_KERNEL, sm120_kernel_problem=LIBRARY_ERROR)


def table(rows, fingerprint=None):
    from sglang_sm120.planning.tuning import Measurement, TuningTable

    ms = tuple(Measurement(b, t, us, ok) for b, t, us, ok in rows)
    return TuningTable(
        fingerprint=fingerprint or {}, tp=8, hidden=7168, dtype="bfloat16", measurements=ms
    )


SM120_WINS_SMALL = table(
    [
        ("nccl", 4, 200.0, True),
        ("sm120_pcie", 4, 9.0, True),
        ("trtllm", 4, 30.0, True),
        ("nccl", 64, 300.0, True),
        ("sm120_pcie", 64, 20.0, True),
        ("nccl", 2048, 900.0, True),
        ("sm120_pcie", 2048, 1500.0, True),
    ]
)
SM120_WRONG = table(
    [("nccl", 4, 200.0, True), ("sm120_pcie", 4, 5.0, False), ("pcie_ipc", 4, 8.0, True)]
)
TRTLLM_EVERYWHERE = table(
    [
        ("trtllm", 4, 10.0, True),
        ("nccl", 4, 200.0, True),
        ("trtllm", 64, 20.0, True),
        ("sm120_pcie", 64, 25.0, True),
    ]
)

BACKEND_ROWS = [
    (
        "table: trtllm fastest, PP over 2 nodes: trtllm refused, sm120_pcie",
        WITH_KERNEL,
        D(8, model_arch=KIMI, nnodes=2, pp_size=2, tuning=TRTLLM_EVERYWHERE),
        "sm120_pcie",
        "sm120_pcie",
    ),
    (
        "env sm120_pcie",
        WITH_KERNEL,
        D(8, model_arch=KIMI, plugin_backend="sm120_pcie"),
        "sm120_pcie",
        "sm120_pcie",
    ),
    (
        "env sm120_pcie without the kernel package",
        WITHOUT_KERNEL,
        D(8, model_arch=KIMI, plugin_backend="sm120_pcie"),
        None,
        "pcie_ipc",
    ),
    (
        "env sm120_pcie, the kernel's library does not load",
        BROKEN_KERNEL,
        D(8, model_arch=KIMI, plugin_backend="sm120_pcie"),
        None,
        "pcie_ipc",
    ),
    (
        "table: sm120_pcie wins, the kernel's library does not load",
        BROKEN_KERNEL,
        D(8, model_arch=KIMI, tuning=SM120_WINS_SMALL),
        None,
        "pcie_ipc",
    ),
    (
        "env sm120_pcie at tp6",
        WITH_KERNEL,
        D(6, model_arch=KIMI, plugin_backend="sm120_pcie"),
        None,
        "nccl",
    ),
    (
        "env sm120_pcie fp32 model",
        WITH_KERNEL,
        D(8, model_arch=KIMI, dtype="float32", plugin_backend="sm120_pcie"),
        None,
        "nccl",
    ),
    (
        "env off beats tp2 auto",
        WITH_KERNEL,
        D(2, model_arch=KIMI, plugin_backend="off"),
        None,
        "pcie_ipc",
    ),
    (
        "env trtllm",
        WITH_KERNEL,
        D(8, model_arch=KIMI, plugin_backend="trtllm"),
        "trtllm",
        "pcie_ipc",
    ),
    (
        "flag beats env",
        WITH_KERNEL,
        D(8, model_arch=KIMI, fusion_backend_flag="trtllm", plugin_backend="sm120_pcie"),
        "trtllm",
        "pcie_ipc",
    ),
    (
        "enforce-disable beats env",
        WITH_KERNEL,
        D(8, model_arch=KIMI, enforce_disable_fusion=True, plugin_backend="sm120_pcie"),
        None,
        "pcie_ipc",
    ),
    (
        "worker: resolved sm120_pcie, arch unknown",
        WITH_KERNEL,
        D(8, fusion_backend_flag="sm120_pcie"),
        "sm120_pcie",
        "sm120_pcie",
    ),
    (
        "table: sm120_pcie wins small sizes",
        WITH_KERNEL,
        D(8, model_arch=KIMI, tuning=SM120_WINS_SMALL),
        "sm120_pcie",
        "sm120_pcie",
    ),
    (
        "table: sm120_pcie measured wrong is excluded",
        WITH_KERNEL,
        D(8, model_arch=KIMI, tuning=SM120_WRONG),
        None,
        "pcie_ipc",
    ),
    (
        "table: trtllm wins every size",
        WITH_KERNEL,
        D(8, model_arch=KIMI, tuning=TRTLLM_EVERYWHERE),
        "trtllm",
        "pcie_ipc",
    ),
    (
        "table ignored when the user chose",
        WITH_KERNEL,
        D(8, model_arch=KIMI, tuning=SM120_WINS_SMALL, enforce_disable_fusion=True),
        None,
        "pcie_ipc",
    ),
]


# "auto" (--flashinfer-allreduce-fusion-backend auto, or the deprecated
# --enable-flashinfer-allreduce-fusion, which upstream turns into auto) is no request: the plan
# decides, the tuning table first, then the TP default. Only an explicit backend is a request.
AUTO_ROWS = [
    (
        "auto flag at tp2: the TP2 default",
        PCIE8,
        D(2, model_arch=KIMI, fusion_backend_flag="auto"),
        "trtllm",
    ),
    (
        "auto flag at tp4: the TP4 default",
        PCIE8,
        D(4, model_arch=KIMI, fusion_backend_flag="auto"),
        None,
    ),
    (
        "auto flag at tp8: the TP8 default",
        PCIE8,
        D(8, model_arch=KIMI, fusion_backend_flag="auto"),
        None,
    ),
    (
        "auto flag with a table: the table",
        WITH_KERNEL,
        D(8, model_arch=KIMI, fusion_backend_flag="auto", tuning=SM120_WINS_SMALL),
        "sm120_pcie",
    ),
    (
        "auto flag, table measured wrong: the default",
        WITH_KERNEL,
        D(8, model_arch=KIMI, fusion_backend_flag="auto", tuning=SM120_WRONG),
        None,
    ),
    (
        "explicit trtllm skips the table",
        WITH_KERNEL,
        D(8, model_arch=KIMI, fusion_backend_flag="trtllm", tuning=SM120_WINS_SMALL),
        "trtllm",
    ),
    (
        "explicit trtllm at tp8",
        PCIE8,
        D(8, model_arch=KIMI, fusion_backend_flag="trtllm"),
        "trtllm",
    ),
]


@pytest.mark.parametrize(
    ("facts", "deployment", "fusion"), [r[1:] for r in AUTO_ROWS], ids=[r[0] for r in AUTO_ROWS]
)
def test_auto_means_the_plan_decides(facts, deployment, fusion):
    plan = plan_allreduce(facts, deployment, ARCHS)
    assert plan.fusion_backend == fusion, plan.reasons
    requested = any("requested" in r for r in plan.reasons)
    assert requested == (deployment.fusion_backend_flag == "trtllm"), plan.reasons


@pytest.mark.parametrize(
    ("facts", "deployment", "fusion", "plain"),
    [r[1:] for r in BACKEND_ROWS],
    ids=[r[0] for r in BACKEND_ROWS],
)
def test_backend_and_tuning_table(facts, deployment, fusion, plain):
    plan = plan_allreduce(facts, deployment, ARCHS)
    assert (plan.fusion_backend, plan.plain_allreduce) == (fusion, plain), plan.reasons


def test_a_kernel_library_that_does_not_load_is_the_reason_sm120_pcie_is_refused():
    plan = plan_allreduce(BROKEN_KERNEL, D(8, model_arch=KIMI, plugin_backend="sm120_pcie"), ARCHS)
    assert f"fusion off (requested sm120_pcie refused): {LIBRARY_ERROR}" in plan.reasons


def test_table_routes_sm120_pcie_only_where_it_won():
    plan = plan_allreduce(WITH_KERNEL, D(8, model_arch=KIMI, tuning=SM120_WINS_SMALL), ARCHS)
    assert [plan.uses_sm120_pcie_at(n) for n in (1, 4, 5, 64, 65, 2048, 4096)] == [
        True,
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    # Published as ranges, one per run of sizes with the same backend.
    assert plan.to_json()["routes"] == [[1, 64, "sm120_pcie"], [65, 2048, "nccl"]]


SM120_FUSES_SMALL_REDUCES_LARGE = table(
    [
        # Shaped like 2x H200, hidden 7168 (benchmark/results/2xH200-2026-11-30): the fused
        # kernel wins at 4 tokens, our all-reduce + a separate norm by a clear margin at 256
        # and 2048 (the table's 16 and 64 token rows were within noise of each other).
        ("nccl", 4, 11.6, True),
        ("sm120_pcie", 4, 6.7, True),
        ("sm120_pcie_unfused", 4, 6.7 + 0.1, True),
        ("nccl", 256, 37.8, True),
        ("sm120_pcie", 256, 25.5, True),
        ("sm120_pcie_unfused", 256, 24.4, True),  # 1.1 us, 4.3% faster
        ("nccl", 2048, 166.2, True),
        ("sm120_pcie", 2048, 157.8, True),
        ("sm120_pcie_unfused", 2048, 141.0, True),
    ]
)


def test_sizes_where_our_all_reduce_plus_norm_won_stay_on_our_kernel_unfused():
    """The fused call is declined there (SGLang then all-reduces and norms separately) and the
    all-reduce it makes instead still runs on sgl-kernel-sm120."""
    plan = plan_allreduce(
        WITH_KERNEL, D(8, model_arch=KIMI, tuning=SM120_FUSES_SMALL_REDUCES_LARGE), ARCHS
    )
    assert (plan.fusion_backend, plan.plain_allreduce) == ("sm120_pcie", "sm120_pcie")
    sizes = (1, 4, 5, 256, 257, 2048, 4096)
    assert [plan.uses_sm120_pcie_at(n) for n in sizes] == [True, True] + [False] * 5
    assert [plan.reduces_with_sm120_pcie_at(n) for n in sizes] == [True] * 6 + [False]
    assert any("unfused at [256, 2048]" in r for r in plan.reasons), plan.reasons


@pytest.mark.parametrize(("pcie_ipc_env", "plain"), [(True, "pcie_ipc"), (False, "nccl")])
def test_unfused_route_fuses_when_the_plain_all_reduce_is_not_ours(pcie_ipc_env, plain):
    """The user kept plain all-reduces off sgl-kernel-sm120 (SGLANG_ENABLE_PCIE_IPC_ALLREDUCE):
    a declined fused point would run their all-reduce + norm, slower than our fused kernel."""
    d = D(8, model_arch=KIMI, tuning=SM120_FUSES_SMALL_REDUCES_LARGE, pcie_ipc_env=pcie_ipc_env)
    plan = plan_allreduce(WITH_KERNEL, d, ARCHS)
    assert (plan.fusion_backend, plan.plain_allreduce) == ("sm120_pcie", plain)
    assert all(plan.uses_sm120_pcie_at(n) for n in (1, 4, 256, 2048))
    assert not plan.uses_sm120_pcie_at(4096)
    assert any(
        r.startswith("sm120_pcie_unfused fastest at [256, 2048] tokens")
        and f"the plan uses {plain}): sm120_pcie there" in r
        for r in plan.reasons
    ), plan.reasons


def test_wrong_backend_is_named_in_the_reasons():
    plan = plan_allreduce(WITH_KERNEL, D(8, model_arch=KIMI, tuning=SM120_WRONG), ARCHS)
    assert any("sm120_pcie (wrong at 4 tokens)" in r for r in plan.reasons)


def test_requested_sm120_pcie_serves_every_size_its_workspace_takes():
    plan = plan_allreduce(WITH_KERNEL, D(8, model_arch=KIMI, plugin_backend="sm120_pcie"), ARCHS)
    assert plan.uses_sm120_pcie_at(1) and plan.uses_sm120_pcie_at(2048)


# Shaped like a PCIe host: PCIe-IPC + a separate norm wins the smallest sizes, our fused kernel
# the verify sizes, NCCL the largest; trtllm (TP8 over PCIe) nowhere.
PCIE_IPC_SMALLEST = table(
    [
        ("pcie_ipc", 1, 5.0, True),
        ("sm120_pcie", 1, 6.0, True),
        ("trtllm", 1, 15.0, True),
        ("nccl", 1, 60.0, True),
        ("pcie_ipc", 16, 10.0, True),
        ("sm120_pcie", 16, 8.0, True),
        ("trtllm", 16, 30.0, True),
        ("nccl", 16, 70.0, True),
        ("pcie_ipc", 64, 25.0, True),
        ("sm120_pcie", 64, 15.0, True),
        ("trtllm", 64, 60.0, True),
        ("nccl", 64, 90.0, True),
    ]
)
# Shaped like TP2: trtllm wins the smallest sizes, our fused kernel the middle ones.
TRTLLM_SMALL_SM120_MIDDLE = table(
    [
        ("trtllm", 1, 5.0, True),
        ("sm120_pcie", 1, 6.0, True),
        ("pcie_ipc", 1, 5.5, True),
        ("nccl", 1, 12.0, True),
        ("trtllm", 4, 5.5, True),
        ("sm120_pcie", 4, 6.5, True),
        ("pcie_ipc", 4, 6.0, True),
        ("nccl", 4, 12.0, True),
        ("trtllm", 64, 12.0, True),
        ("sm120_pcie", 64, 9.0, True),
        ("pcie_ipc", 64, 24.0, True),
        ("nccl", 64, 17.0, True),
        ("trtllm", 256, 30.0, True),
        ("sm120_pcie", 256, 20.0, True),
        ("pcie_ipc", 256, 88.0, True),
        ("nccl", 256, 37.0, True),
    ]
)


def served_by_the_server(plan) -> bool:
    """Every route is a backend this server runs: no other fusion backend than its own."""
    return all(
        b not in ("trtllm", "sm120_pcie") or b == plan.fusion_backend for _, b in plan.routes
    )


def test_sizes_where_pcie_ipc_won_run_pcie_ipc_behind_our_kernel():
    """The table's PCIe-IPC sizes: our hooks decline them, so PCIe-IPC must be on to take them
    (without it they would fall to NCCL, 12x slower there)."""
    plan = plan_allreduce(WITH_KERNEL, D(8, model_arch=KIMI, tuning=PCIE_IPC_SMALLEST), ARCHS)
    assert (plan.fusion_backend, plan.plain_allreduce) == ("sm120_pcie", "sm120_pcie")
    assert plan.route_ranges() == [(1, 1, "pcie_ipc"), (2, 64, "sm120_pcie")]
    assert plan.pcie_ipc_on
    assert [plan.reduces_with_sm120_pcie_at(n) for n in (1, 2, 64, 65)] == [
        False,
        True,
        True,
        False,
    ]
    assert any(
        r.startswith("PCIe-IPC on behind sgl-kernel-sm120: the points at [1]") for r in plan.reasons
    )


@pytest.mark.parametrize(("pcie_ipc_env", "dtype"), [(False, "bfloat16"), (None, "float16")])
def test_pcie_ipc_sizes_go_to_the_next_best_where_pcie_ipc_cannot_be_on(pcie_ipc_env, dtype):
    d = D(8, model_arch=KIMI, tuning=PCIE_IPC_SMALLEST, pcie_ipc_env=pcie_ipc_env, dtype=dtype)
    plan = plan_allreduce(WITH_KERNEL, d, ARCHS)
    assert plan.route_at(1) == "sm120_pcie"  # 6 us: the best this server can run there
    assert not plan.pcie_ipc_on
    assert any(
        r.startswith("pcie_ipc fastest at [1] tokens (a server has one path for declined points")
        for r in plan.reasons
    )


def test_a_table_split_between_trtllm_and_sm120_pcie_routes_every_size_to_what_the_server_runs():
    """One FlashInfer fusion backend per server: the plan picks the one whose routes come
    closest to the per-size best, and routes the other's sizes to the next best it can run."""
    d = D(2, model_arch=KIMI, tuning=TRTLLM_SMALL_SM120_MIDDLE, custom_all_reduce=False)
    plan = plan_allreduce(WITH_KERNEL, d, ARCHS)
    assert served_by_the_server(plan), plan.routes
    # 1.05x of the per-size best with PCIe-IPC behind it; trtllm 1.19x.
    assert plan.fusion_backend == "sm120_pcie"
    assert plan.route_ranges() == [(1, 4, "pcie_ipc"), (5, 256, "sm120_pcie")]
    assert any(
        "1.05x the per-size best (geometric mean; off 1.94x; trtllm 1.19x; sm120_pcie 1.09x)" in r
        for r in plan.reasons
    )
    assert any(
        r.startswith("trtllm fastest at [1, 4] tokens (one fusion backend per server")
        for r in plan.reasons
    )


TRTLLM_THEN_PCIE_IPC = table(
    [
        ("trtllm", 4, 5.5, True),
        ("pcie_ipc", 4, 6.0, True),
        ("nccl", 4, 12.0, True),
        ("trtllm", 64, 12.0, True),
        ("pcie_ipc", 64, 24.0, True),
        ("nccl", 64, 17.0, True),
        ("trtllm", 256, 90.0, True),
        ("pcie_ipc", 256, 60.0, True),
        ("nccl", 256, 40.0, True),
    ]
)


def test_trtllm_plan_declines_the_sizes_its_table_routes_to_pcie_ipc():
    """A declined point is all-reduced by the first communicator it fits (PCIe-IPC here), not
    by a per-size choice: NCCL's 40 us at 256 tokens is not on offer, PCIe-IPC's 60 is."""
    d = D(2, model_arch=KIMI, tuning=TRTLLM_THEN_PCIE_IPC, custom_all_reduce=False)
    plan = plan_allreduce(WITH_KERNEL, d, ARCHS)
    assert (plan.fusion_backend, plan.plain_allreduce) == ("trtllm", "pcie_ipc")
    assert plan.route_ranges() == [(1, 64, "trtllm"), (65, 256, "pcie_ipc")]
    # Above the largest measured size trtllm keeps fusing (upstream's own 2048-row limit).
    assert [plan.fuses_at(n) for n in (1, 64, 65, 256, 257, 2048)] == [
        True,
        True,
        False,
        False,
        True,
        True,
    ]
    assert any(
        r.startswith("nccl fastest at [256] tokens (a server has one path for declined points")
        for r in plan.reasons
    ), plan.reasons


@pytest.mark.parametrize("kernel", [WITH_KERNEL, WITHOUT_KERNEL], ids=["kernel", "no-kernel"])
def test_trtllm_keeps_every_size_where_a_declined_point_would_reach_trtllms_own_all_reduce(
    kernel,
):
    """Without PCIe-IPC as the plain all-reduce the TP group stays tagged for FlashInfer's
    all-reduce, so a declined trtllm point would run trtllm's all-reduce + a norm; and without
    sgl-kernel-sm120 nothing declines a trtllm point at all."""
    d = D(2, model_arch=KIMI, tuning=TRTLLM_THEN_PCIE_IPC, custom_all_reduce=False)
    plan = plan_allreduce(kernel, dataclasses.replace(d, pcie_ipc_env=False), ARCHS)
    assert (plan.fusion_backend, plan.plain_allreduce) == ("trtllm", "nccl")
    assert set(dict(plan.routes).values()) == {"trtllm"}
    nokernel = plan_allreduce(WITHOUT_KERNEL, d, ARCHS)
    assert (nokernel.fusion_backend, nokernel.plain_allreduce) == ("trtllm", "pcie_ipc")
    assert set(dict(nokernel.routes).values()) == {"trtllm"}
    assert any("nothing declines a trtllm point" in r for r in nokernel.reasons)


def test_a_table_no_candidate_can_serve_falls_back_to_the_default_rules():
    tuning = table(
        [
            ("nccl", 4, 10.0, True),
            ("sm120_pcie", 4, 5.0, True),
            ("nccl", 64, None, False),
            ("sm120_pcie", 64, 9.0, True),
        ]
    )
    d = D(2, model_arch=KIMI, tuning=tuning, disaggregation=True)  # sm120_pcie blocked
    plan = plan_allreduce(WITH_KERNEL, d, ARCHS)
    assert (plan.fusion_backend, plan.routes) == ("trtllm", ())  # the TP2 default
    assert any("tuning table unusable here" in r for r in plan.reasons), plan.reasons
    empty = plan_allreduce(WITH_KERNEL, D(2, model_arch=KIMI, tuning=table([])), ARCHS)
    assert (empty.fusion_backend, empty.routes) == ("trtllm", ())


@pytest.mark.parametrize(
    "tuning",
    [
        SM120_WINS_SMALL,
        SM120_WRONG,
        TRTLLM_EVERYWHERE,
        SM120_FUSES_SMALL_REDUCES_LARGE,
        PCIE_IPC_SMALLEST,
        TRTLLM_SMALL_SM120_MIDDLE,
    ],
)
@pytest.mark.parametrize("tp", [2, 8])
@pytest.mark.parametrize(
    "switches",
    [
        {},
        {"pcie_ipc_env": False},
        {"pcie_ipc_env": True},
        {"dtype": "float16"},
        {"custom_all_reduce": False},
    ],
    ids=["default", "pcie-ipc=0", "pcie-ipc=1", "fp16", "no-custom-ar"],
)
def test_every_route_is_a_backend_the_server_runs(tuning, tp, switches):
    """Each route is what serves that size: the fusion backend, or for a declined point the one
    path the server has for it (PCIe-IPC when on, else NCCL; never trtllm's own all-reduce)."""
    plan = plan_allreduce(WITH_KERNEL, D(tp, model_arch=KIMI, tuning=tuning, **switches), ARCHS)
    assert served_by_the_server(plan), (plan.fusion_backend, plan.routes)
    routes = set(dict(plan.routes).values())
    assert not ({"pcie_ipc", "nccl"} <= routes), plan.routes  # one path for declined points
    if "pcie_ipc" in routes:
        assert plan.pcie_ipc_on
    if "nccl" in routes:
        assert not plan.pcie_ipc_on
        assert plan.fusion_backend != "trtllm"  # its groups stay tagged without PCIe-IPC
    if "sm120_pcie_unfused" in routes:
        assert plan.plain_allreduce == "sm120_pcie"
    if tp == 2 and switches.get("custom_all_reduce", True):
        assert not routes & {"pcie_ipc", "nccl"}  # custom all-reduce v1 would take them


MEASURED_2XH200 = (
    Path(__file__).parents[2] / "benchmark/results/2xH200-2026-11-30/bench_allreduce.json"
)
BENCH_COLUMNS = {
    "sm120_pcie": "ours_fused",
    "sm120_pcie_unfused": "ours_unfused",
    "trtllm": "fi_trtllm_fused",
    "pcie_ipc": "fi_pcie_norm",
    "nccl": "nccl_norm",
}


def measured_table(without: tuple[str, ...] = ()):
    """The committed 2x H200 side-by-side run (benchmark/bench_allreduce.py) as a tuning table."""
    rows = json.loads(MEASURED_2XH200.read_text())["results"][0]["rows"]
    return table(
        [
            (backend, row["tokens"], row[column], True)
            for row in rows
            for backend, column in BENCH_COLUMNS.items()
            if backend not in without
        ]
    )


def test_measured_2xh200_run_routes_every_size_to_trtllm_which_wins_nearly_everywhere():
    plan = plan_allreduce(WITH_KERNEL, D(2, model_arch=KIMI, tuning=measured_table()), ARCHS)
    assert (plan.fusion_backend, plan.plain_allreduce) == ("trtllm", "pcie_ipc")
    assert set(dict(plan.routes).values()) == {"trtllm"}
    # Our all-reduce + norm won the largest sizes; one fusion backend per server: trtllm there.
    assert any(
        r.startswith("sm120_pcie_unfused fastest at [1024, 2048] tokens (one fusion backend")
        for r in plan.reasons
    ), plan.reasons


def test_measured_2xh200_run_without_trtllm_splits_sizes_between_pcie_ipc_and_our_kernel():
    """As on a PCIe host where trtllm collapses (TP4/TP8): PCIe-IPC + norm where it beat our
    fused kernel (1 and 4 tokens), our all-reduce + norm where that beat it by the margin."""
    tuning = measured_table(without=("trtllm",))
    d = D(2, model_arch=KIMI, tuning=tuning, custom_all_reduce=False)
    plan = plan_allreduce(WITH_KERNEL, d, ARCHS)
    assert (plan.fusion_backend, plan.plain_allreduce) == ("sm120_pcie", "sm120_pcie")
    route = plan.route_at
    assert route(1) == route(4) == "pcie_ipc" and plan.pcie_ipc_on
    assert route(64) == "sm120_pcie_unfused"
    assert route(16) == route(256) == route(2048) == "sm120_pcie"


# trtllm fastest everywhere but wrong at 64 tokens (review r4, finding 1).
TRTLLM_WRONG_ONCE = table(
    [
        ("trtllm", 4, 5.0, True),
        ("pcie_ipc", 4, 10.0, True),
        ("nccl", 4, 40.0, True),
        ("trtllm", 64, 8.0, False),
        ("pcie_ipc", 64, 20.0, True),
        ("nccl", 64, 60.0, True),
        ("trtllm", 256, 20.0, True),
        ("pcie_ipc", 256, 60.0, True),
        ("nccl", 256, 80.0, True),
    ]
)


@pytest.mark.parametrize("tp", [2, 8])
def test_a_backend_wrong_at_one_size_is_used_at_none(tp):
    """A wrong result is evidence against the kernel, not against one size: the same code path
    serves the sizes around it."""
    d = D(tp, model_arch=KIMI, tuning=TRTLLM_WRONG_ONCE, custom_all_reduce=False)
    plan = plan_allreduce(WITH_KERNEL, d, ARCHS)
    assert plan.fusion_backend != "trtllm"
    assert "trtllm" not in dict(plan.routes).values()
    assert any("excluded as wrong here: trtllm (wrong at 64 tokens)" in r for r in plan.reasons)


def test_one_wrong_route_of_our_kernel_excludes_both():
    """sm120_pcie and sm120_pcie_unfused share sgl-kernel-sm120's all-reduce."""
    tuning = table(
        [
            ("sm120_pcie", 4, 5.0, True),
            ("sm120_pcie_unfused", 4, 9.0, False),
            ("pcie_ipc", 4, 10.0, True),
            ("sm120_pcie", 64, 9.0, True),
            ("sm120_pcie_unfused", 64, 12.0, True),
            ("pcie_ipc", 64, 20.0, True),
        ]
    )
    plan = plan_allreduce(WITH_KERNEL, D(8, model_arch=KIMI, tuning=tuning), ARCHS)
    assert plan.fusion_backend is None and plan.plain_allreduce == "pcie_ipc"
    assert set(dict(plan.routes).values()) == {"pcie_ipc"}


def test_fusion_is_not_turned_off_by_noise():
    """Unfused (off) only for a clear win over the best fused candidate, as for one size."""
    rows = []
    for tokens, us in ((4, 6.0), (16, 7.0), (64, 10.0), (256, 20.0)):
        rows += [("trtllm", tokens, us, True), ("pcie_ipc", tokens, us * 0.99, True)]
    d = D(8, model_arch=KIMI, tuning=table(rows), fusion_backend_flag=None)
    plan = plan_allreduce(WITH_KERNEL, d, ARCHS)
    assert plan.fusion_backend == "trtllm", plan.reasons
    assert set(dict(plan.routes).values()) == {"trtllm"}
    clear = [(b, t, us * 0.9 if b == "pcie_ipc" else us, ok) for b, t, us, ok in rows]
    off = plan_allreduce(WITH_KERNEL, dataclasses.replace(d, tuning=table(clear)), ARCHS)
    assert off.fusion_backend is None and off.plain_allreduce == "pcie_ipc"


@pytest.mark.parametrize(
    "tuning", [TRTLLM_THEN_PCIE_IPC, TRTLLM_SMALL_SM120_MIDDLE, PCIE_IPC_SMALLEST]
)
def test_at_tp2_with_custom_all_reduce_no_size_is_declined_to_an_untimed_path(tuning):
    """At TP2 upstream's custom all-reduce v1 takes a declined point (and every plain
    all-reduce of an unfused server) before PCIe-IPC or NCCL, and these tables (written before
    tune timed it) have no custom_ar cell: the plan keeps each size on a fusion backend, and
    says why."""
    plan = plan_allreduce(WITH_KERNEL, D(2, model_arch=KIMI, tuning=tuning), ARCHS)
    assert plan.fusion_backend in ("trtllm", "sm120_pcie")
    assert not {"pcie_ipc", "nccl"} & set(dict(plan.routes).values()), plan.routes
    assert any(
        "custom all-reduce" in r and "--disable-custom-all-reduce" in r for r in plan.reasons
    )
    assert not (plan.fusion_backend == "sm120_pcie" and plan.pcie_ipc_on)


def test_a_zero_or_nan_time_is_not_a_measurement():
    tuning = table(
        [
            ("trtllm", 4, 0.0, True),
            ("pcie_ipc", 4, 6.0, True),
            ("trtllm", 64, float("nan"), True),
            ("pcie_ipc", 64, 20.0, True),
        ]
    )
    plan = plan_allreduce(WITH_KERNEL, D(8, model_arch=KIMI, tuning=tuning), ARCHS)
    assert plan.fusion_backend is None and set(dict(plan.routes).values()) == {"pcie_ipc"}


def test_with_nvlink_custom_all_reduce_takes_declined_points_at_any_tp():
    """Upstream's custom all-reduce (v2 over NVLink) is built at TP8 with NVLink too."""
    rows = []
    for tokens, ours, nccl in ((4, 6.0, 5.0), (64, 10.0, 12.0), (256, 40.0, 20.0)):
        rows += [("sm120_pcie", tokens, ours, True), ("nccl", tokens, nccl, True)]
    nvlink = dataclasses.replace(
        host(nvlink=True), versions=WITH_KERNEL.versions, sm120_kernel_problem=None
    )
    d = D(8, model_arch=KIMI, tuning=table(rows))
    plan = plan_allreduce(nvlink, d, ARCHS)
    assert plan.fusion_backend == "sm120_pcie" and set(dict(plan.routes).values()) == {SM120_PCIE}
    assert any("with NVLink upstream's custom all-reduce takes" in r for r in plan.reasons)
    free = plan_allreduce(nvlink, dataclasses.replace(d, custom_all_reduce=False), ARCHS)
    assert "nccl" in dict(free.routes).values()


# --- validation mode (SGLANG_SM120_ANY_ARCH=1) --------------------------------------------------

VALIDATION_ROWS = [
    # id, facts, deployment, managed, fusion_backend, plain_allreduce
    ("h200 tp2 untouched without it", H200, D(2, model_arch=DSV3), False, None, "upstream"),
    (
        "h200 tp2 managed, NVLink rules hold",
        H200,
        D(2, model_arch=DSV3, any_arch=True),
        True,
        "trtllm",
        "upstream",
    ),
    (
        "h200 tp8 managed, fusion off by default",
        H200,
        D(8, model_arch=DSV3, any_arch=True),
        True,
        None,
        "upstream",
    ),
    (
        "sm90 over PCIe managed like SM12x",
        host(n=4, cap=(9, 0)),
        D(4, model_arch=DSV3, any_arch=True),
        True,
        None,
        "pcie_ipc",
    ),
    (
        "sm90 pair without P2P: NCCL, as on SM12x",
        host(n=2, cap=(9, 0), p2p="none"),
        D(2, model_arch=DSV3, any_arch=True),
        True,
        None,
        "nccl",
    ),
    (
        "sm80 stays out of scope",
        host(n=2, cap=(8, 0)),
        D(2, any_arch=True),
        False,
        None,
        "upstream",
    ),
    ("one h200: tp1", H200, D(1, model_arch=DSV3, any_arch=True), True, None, "none"),
]


@pytest.mark.parametrize(
    "facts,deployment,managed,fusion,plain",
    [pytest.param(*row[1:], id=row[0]) for row in VALIDATION_ROWS],
)
def test_validation_mode_table(facts, deployment, managed, fusion, plain):
    plan = plan_allreduce(facts, deployment, ARCHS)
    assert (plan.managed, plan.fusion_backend, plan.plain_allreduce) == (managed, fusion, plain)


def test_validation_mode_says_so_in_the_first_reason_and_the_capability():
    from sglang_sm120.planning.policy import VALIDATION_NOTE

    plan = plan_allreduce(H200, D(2, model_arch=DSV3, any_arch=True), ARCHS)
    assert VALIDATION_NOTE in plan.reasons[0]
    cap = hardware_capability(H200, range(2), any_arch=True)
    assert cap.validation and VALIDATION_NOTE in cap.reasons[0]
    assert type(cap).from_json(cap.to_json()) == cap


def test_validation_mode_changes_nothing_on_sm12x():
    deployment = D(8, model_arch=KIMI)
    on = plan_allreduce(PCIE8, dataclasses.replace(deployment, any_arch=True), ARCHS)
    assert on == plan_allreduce(PCIE8, deployment, ARCHS)
    assert not hardware_capability(PCIE8, any_arch=True).validation


def test_validation_mode_below_sm90_says_why():
    cap = hardware_capability(host(n=2, cap=(8, 0)), any_arch=True)
    assert not cap.sm12x and "below SM90 even in validation mode" in cap.reasons[0]


@pytest.mark.parametrize(
    ("world_size", "fused_up_to"),
    [(2, 64), (4, 8), (8, 8)],  # TP2: upstream's custom all-reduce would take a declined point
)
def test_the_layer_stack_plan_fuses_where_its_table_and_world_size_say(world_size, fused_up_to):
    """The GPU layer-stack test routes each point by this plan (sm120_pcie won up to 8 tokens,
    NCCL above): at TP2 the plan declines nothing the table measured, above TP2 it declines
    where NCCL won, so the GPU test runs both the fused and the unfused path."""
    from layer_stack_plan import sm120_pcie_plan

    plan = sm120_pcie_plan(world_size, 2048)
    fused = {tokens: plan.uses_sm120_pcie_at(tokens) for tokens in (1, 4, 8, 9, 32, 64)}
    assert fused == {tokens: tokens <= fused_up_to for tokens in fused}


# --- upstream's own communicators in the tuning table (custom_ar, mscclpp, torch_symm_mem) -----


def cells(rows):
    """A tuning table from (backend, tokens, us, note) rows, all correct where they ran."""
    from sglang_sm120.planning.tuning import Measurement, TuningTable

    ms = tuple(Measurement(b, t, us, True, note) for b, t, us, note in rows)
    return TuningTable(fingerprint={}, tp=8, hidden=7168, dtype="bfloat16", measurements=ms)


def declines(why="no tuned configuration for this size"):
    from sglang_sm120.planning.tuning import DECLINES

    return DECLINES + why


def mscclpp_rows(factor: float, declined_at: tuple[int, ...] = ()):
    """PCIe-IPC and NCCL as measured, MSCCL++ at ``factor`` times PCIe-IPC's time."""
    rows = []
    for tokens, pcie in ((1, 6.0), (16, 8.0), (256, 30.0), (2048, 200.0)):
        rows += [("pcie_ipc", tokens, pcie, ""), ("nccl", tokens, pcie * 5, "")]
        declined = tokens in declined_at
        rows.append(
            ("mscclpp", tokens, None if declined else pcie * factor, declines() if declined else "")
        )
    return rows


def test_mscclpp_clearly_faster_where_sglang_all_reduces_turns_on_enable_mscclpp():
    """An unfused TP8 server: every all-reduce is SGLang's, and MSCCL++ (checked first by
    upstream) beats PCIe-IPC at every size by more than the margin."""
    d = D(8, model_arch=DSV3, tuning=cells(mscclpp_rows(0.8)))
    plan = plan_allreduce(PCIE8, d, ARCHS)
    assert plan.fusion_backend is None
    assert plan.upstream_switches == ("enable_mscclpp",)
    assert set(dict(plan.routes).values()) == {"mscclpp"}
    assert any(r.startswith("--enable-mscclpp on from the tuning table") for r in plan.reasons)


def test_mscclpp_faster_by_noise_only_stays_off():
    d = D(8, model_arch=DSV3, tuning=cells(mscclpp_rows(0.99)))
    plan = plan_allreduce(PCIE8, d, ARCHS)
    assert plan.upstream_switches == ()
    assert set(dict(plan.routes).values()) == {"pcie_ipc"}
    assert any(
        "mscclpp fastest at [1, 16, 256, 2048]" in r and "not a clear win" in r
        for r in plan.reasons
    )


def test_sizes_mscclpp_declines_go_to_the_next_communicator_in_upstreams_order():
    d = D(8, model_arch=DSV3, tuning=cells(mscclpp_rows(0.5, declined_at=(2048,))))
    plan = plan_allreduce(PCIE8, d, ARCHS)
    assert plan.upstream_switches == ("enable_mscclpp",)
    assert plan.route_at(256) == "mscclpp" and plan.route_at(2048) == "pcie_ipc"


@pytest.mark.parametrize(
    "setting, said",
    [
        ({"pcie_ipc_env": True}, "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 set by the user"),
        ({"enable_symm_mem": True}, "--enable-symm-mem"),
    ],
)
def test_what_the_user_set_keeps_mscclpp_off(setting, said):
    d = D(8, model_arch=DSV3, tuning=cells(mscclpp_rows(0.5)), **setting)
    plan = plan_allreduce(PCIE8, d, ARCHS)
    assert plan.upstream_switches == ()
    assert "mscclpp" not in dict(plan.routes).values()
    assert any(f"--enable-mscclpp left off: {said}" in r for r in plan.reasons), plan.reasons


def test_mscclpp_the_user_turned_on_is_planned_with_and_not_switched_again():
    d = D(8, model_arch=DSV3, tuning=cells(mscclpp_rows(0.99)), enable_mscclpp=True)
    plan = plan_allreduce(PCIE8, d, ARCHS)
    assert plan.upstream_switches == ()
    assert set(dict(plan.routes).values()) == {"mscclpp"}  # upstream checks it first


def test_at_tp2_a_timed_custom_all_reduce_takes_declined_points_up_to_its_limit():
    """Custom all-reduce v1 runs at TP2 over PCIe and takes up to 8 MiB: where tune timed it,
    the table routes declined sizes to it, and larger ones (declined) to the next path."""
    rows = []
    for tokens, ours, ca in ((1, 9.0, 5.0), (16, 10.0, 6.0), (2048, 300.0, None)):
        note = declines("above custom all-reduce's 8 MiB") if ca is None else ""
        rows += [("sm120_pcie", tokens, ours, ""), ("custom_ar", tokens, ca, note)]
        rows.append(("pcie_ipc", tokens, 150.0 if tokens == 2048 else 8.0, ""))
    d = D(2, model_arch=KIMI, tuning=cells(rows))
    plan = plan_allreduce(WITH_KERNEL, d, ARCHS)
    assert plan.fusion_backend is None and plan.upstream_switches == ()  # on by default
    assert plan.route_at(1) == plan.route_at(16) == "custom_ar"
    assert plan.route_at(2048) == "pcie_ipc"
    assert not any("untimed" in r or "did not time it" in r for r in plan.reasons)


def test_torch_symm_mem_takes_what_nccl_would_serve_where_custom_ar_is_off():
    """On an NVLink SM90 box in validation mode (torch symmetric memory needs SM90/SM100 and
    multicast): faster than NCCL at every size, it is switched on."""
    rows = []
    for tokens in (1, 16, 256):
        rows += [("nccl", tokens, 30.0, ""), ("torch_symm_mem", tokens, 10.0, "")]
    d = D(8, model_arch=DSV3, tuning=cells(rows), any_arch=True, custom_all_reduce=False)
    plan = plan_allreduce(H200, d, ARCHS)
    assert plan.upstream_switches == ("enable_torch_symm_mem",)
    assert set(dict(plan.routes).values()) == {"torch_symm_mem"}
    # Deterministic inference turns fusion off, and with it the table: no switch.
    deterministic = plan_allreduce(H200, dataclasses.replace(d, deterministic=True), ARCHS)
    assert deterministic.upstream_switches == () and not deterministic.routes


def test_a_plan_with_upstream_switches_round_trips_and_a_foreign_switch_is_refused():
    from sglang_sm120.planning.policy import AllReducePlan
    from sglang_sm120.strict_json import FieldError

    plan = plan_allreduce(PCIE8, D(8, model_arch=DSV3, tuning=cells(mscclpp_rows(0.8))), ARCHS)
    assert AllReducePlan.from_json(plan.to_json()) == plan
    data = {**plan.to_json(), "upstream_switches": ["disable_custom_all_reduce"]}
    with pytest.raises(FieldError, match="upstream_switches"):
        AllReducePlan.from_json(data)
    older = {k: v for k, v in plan.to_json().items() if k != "upstream_switches"}
    assert AllReducePlan.from_json(older).upstream_switches == ()


def test_under_trtllm_a_faster_custom_all_reduce_is_named_not_routed():
    """The sm120_pcie_backend patch declines trtllm points to PCIe-IPC only: a size where the
    timed custom all-reduce was fastest stays on trtllm, and the plan says why."""
    rows = []
    for tokens, trtllm, ca in ((1, 5.0, 9.0), (16, 6.0, 9.0), (64, 20.0, 8.0)):
        rows += [("trtllm", tokens, trtllm, ""), ("custom_ar", tokens, ca, "")]
        rows.append(("pcie_ipc", tokens, 30.0, ""))
    plan = plan_allreduce(WITH_KERNEL, D(2, model_arch=KIMI, tuning=cells(rows)), ARCHS)
    assert plan.fusion_backend == "trtllm"
    assert set(dict(plan.routes).values()) == {"trtllm"}
    assert any(
        r.startswith("custom_ar fastest at [64] tokens (a trtllm point is declined to PCIe-IPC")
        for r in plan.reasons
    ), plan.reasons
