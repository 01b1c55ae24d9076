"""The plan's reactions to host findings, as a table (the policy's README rules for the host).

Findings come from the fixture hosts of test/fixtures/hosts/ (read through the fake NVML) and
from recorded p2p probes. Columns: host -> deployment -> expected fusion backend, plain
all-reduce, and words the reasons must contain (each finding is cited with its fix and with
what the plan did about it). Pure: no sglang, no GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
from fake_nvml import FIXTURES, FakeNvml
from sglang_sm120.machine.facts import load_profile
from sglang_sm120.machine.host_checks import HostFindings, P2PSummary, run_host_checks
from sglang_sm120.planning.policy import Deployment, plan_allreduce
from sglang_sm120.planning.tuning import Measurement, TuningTable

ARCHS = frozenset({"KimiK25ForConditionalGeneration"})
KIMI = "KimiK25ForConditionalGeneration"
PCIE8 = load_profile("rtx-pro-6000-x8-pcie")
WITH_KERNEL = dataclasses.replace(
    PCIE8, versions={**PCIE8.versions, "sgl-kernel-sm120": "0.5.23.1"}
)
H200 = load_profile("h200-x8-nvlink")


@functools.cache
def fixture(case: str) -> HostFindings:
    checks = run_host_checks(8, 7168, root=FIXTURES / case, nvml=FakeNvml.of(case))
    return HostFindings(checks)


def measured(write_ratio: float, read_ratio: float = 0.85, staged: float = 0.8) -> HostFindings:
    """The healthy host with a recorded p2p probe (collapse as p2p_probe.is_collapse judges)."""
    from sglang_sm120.machine.p2p_probe import is_collapse

    probe = P2PSummary(
        gpus=tuple(range(8)),
        pair_write_gbps=52.0,
        pair_read_gbps=50.0,
        write_latency_us=2.0,
        read_latency_us=2.4,
        write_ratio=write_ratio,
        read_ratio=read_ratio,
        staged_ratio=staged,
        collapse=is_collapse(write_ratio, read_ratio, staged),
        created="2026-12-01T10:00:00",
    )
    return dataclasses.replace(fixture("healthy"), probe=probe)


SM120_WINS = TuningTable(
    {},
    8,
    7168,
    "bfloat16",
    (
        Measurement("nccl", 4, 200.0, True),
        Measurement("sm120_pcie", 4, 9.0, True),
        Measurement("nccl", 2048, 900.0, True),
        Measurement("sm120_pcie", 2048, 1500.0, True),
    ),
)

D = Deployment
PUSH_OFF_PCIE_IPC = "one-shot push all-reduce disfavoured; PCIe-IPC (staged)"
ROWS = [
    # id, facts, deployment, fusion, plain, words in the reasons
    ("no findings: tp2 auto trtllm", PCIE8, D(2, model_arch=KIMI), "trtllm", "pcie_ipc", ()),
    (
        "healthy host: as without findings",
        PCIE8,
        D(2, model_arch=KIMI, host=fixture("healthy")),
        "trtllm",
        "pcie_ipc",
        (),
    ),
    (
        "staged P2P at tp8: NCCL, with the registry fix",
        PCIE8,
        D(8, model_arch=KIMI, host=fixture("direct-staged")),
        None,
        "nccl",
        ("host p2p_driver", "ForceP2P=0x11", "IPC all-reduce kernels disfavoured: NCCL"),
    ),
    (
        "staged P2P at tp2: fusion off too",
        PCIE8,
        D(2, model_arch=KIMI, host=fixture("direct-staged")),
        None,
        "nccl",
        ("fusion off at TP2: auto would pick trtllm", "host p2p_driver"),
    ),
    (
        "staged P2P, the user's PCIe-IPC=1 stands",
        PCIE8,
        D(8, model_arch=KIMI, pcie_ipc_env=True, host=fixture("direct-staged")),
        None,
        "pcie_ipc",
        ("kept as requested (fusion off, plain all-reduce PCIe-IPC (staged))",),
    ),
    (
        "staged P2P, the user's trtllm stands",
        PCIE8,
        D(8, model_arch=KIMI, fusion_backend_flag="trtllm", host=fixture("direct-staged")),
        "trtllm",
        "nccl",
        ("kept as requested (fusion trtllm",),
    ),
    (
        "driver forced to direct P2P: as without findings",
        PCIE8,
        D(8, model_arch=KIMI, host=fixture("direct-forcep2p")),
        None,
        "pcie_ipc",
        (),
    ),
    (
        "ACS redirect at tp2: fusion off, PCIe-IPC",
        PCIE8,
        D(2, model_arch=KIMI, host=fixture("acs-on")),
        None,
        "pcie_ipc",
        ("host acs", "pci=disable_acs_redir", PUSH_OFF_PCIE_IPC),
    ),
    (
        "ACS redirect at tp8: PCIe-IPC, cited",
        PCIE8,
        D(8, model_arch=KIMI, host=fixture("acs-on")),
        None,
        "pcie_ipc",
        ("host acs", PUSH_OFF_PCIE_IPC),
    ),
    (
        "measured write collapse at tp2: fusion off, PCIe-IPC",
        PCIE8,
        D(2, model_arch=KIMI, host=measured(0.12)),
        None,
        "pcie_ipc",
        ("concurrent P2P writes collapse to 12% of the links here", PUSH_OFF_PCIE_IPC),
    ),
    (
        "measured write collapse, the user's sm120_pcie stands",
        WITH_KERNEL,
        D(8, model_arch=KIMI, plugin_backend="sm120_pcie", host=measured(0.12)),
        "sm120_pcie",
        "sm120_pcie",
        ("sm120_pcie's one-shot push kept as requested",),
    ),
    (
        "writes hold under concurrency: as without findings",
        PCIE8,
        D(2, model_arch=KIMI, host=measured(0.8)),
        "trtllm",
        "pcie_ipc",
        (),
    ),
    (
        "everything slow at once is no write collapse",
        PCIE8,
        D(2, model_arch=KIMI, host=measured(0.3, read_ratio=0.3, staged=0.3)),
        "trtllm",
        "pcie_ipc",
        (),
    ),
    (
        "a tuning table measured the collapse itself: its routes stand",
        WITH_KERNEL,
        D(8, model_arch=KIMI, tuning=SM120_WINS, host=measured(0.12)),
        "sm120_pcie",
        "sm120_pcie",
        ("the tuning table measured this host: its routes stand",),
    ),
    (
        "a tuning table on a staged host: its routes stand",
        WITH_KERNEL,
        D(8, model_arch=KIMI, tuning=SM120_WINS, host=fixture("direct-staged")),
        "sm120_pcie",
        "sm120_pcie",
        ("host p2p_driver", "the tuning table measured this host"),
    ),
    (
        "ACS redirect on root ports only: cited, plan unchanged",
        PCIE8,
        D(2, model_arch=KIMI, host=fixture("acs-root-ports")),
        "trtllm",
        "pcie_ipc",
        ("host acs: GPUs 0,1: ACS redirect on root ports", "pci=disable_acs_redir"),
    ),
    (
        "IOMMU translating: cited with iommu=pt, plan unchanged",
        PCIE8,
        D(2, model_arch=KIMI, host=fixture("iommu-on")),
        "trtllm",
        "pcie_ipc",
        ("host iommu", "iommu=pt"),
    ),
    (
        "BAR1 too small: cited with the BIOS fix",
        PCIE8,
        D(8, model_arch=KIMI, host=fixture("small-bar1")),
        None,
        "pcie_ipc",
        ("host bar1", "Resizable BAR"),
    ),
    (
        "tp1: nothing to reduce",
        PCIE8,
        D(1, model_arch=KIMI, host=fixture("direct-staged")),
        None,
        "none",
        (),
    ),
    (
        "SM90 untouched",
        H200,
        D(8, model_arch=KIMI, host=fixture("direct-staged")),
        None,
        "upstream",
        (),
    ),
]


@pytest.mark.parametrize(
    ("facts", "deployment", "fusion", "plain", "words"),
    [r[1:] for r in ROWS],
    ids=[r[0] for r in ROWS],
)
def test_plan_reacts_to_host_findings(facts, deployment, fusion, plain, words):
    plan = plan_allreduce(facts, deployment, ARCHS)
    assert (plan.fusion_backend, plan.plain_allreduce) == (fusion, plain), plan.reasons
    text = " | ".join(plan.reasons)
    assert all(word in text for word in words), plan.reasons
    if not words:
        assert not any(r.startswith("host ") for r in plan.reasons), plan.reasons


def test_without_findings_the_plan_is_the_one_it_was():
    for tp in (2, 4, 8):
        d = D(tp, model_arch=KIMI)
        assert plan_allreduce(PCIE8, d, ARCHS) == plan_allreduce(
            PCIE8, dataclasses.replace(d, host=fixture("healthy")), ARCHS
        )


def test_findings_keep_the_plan_pure():
    d = D(2, model_arch=KIMI, host=fixture("acs-on"))
    assert plan_allreduce(PCIE8, d, ARCHS) == plan_allreduce(PCIE8, d, ARCHS)


# ---- issue 26.2: a TP group is planned on findings about its own GPUs
SPLIT = "split-switch-root"  # GPUs 0,1 behind one switch; 2,3 on root ports without ForceP2P


def split_findings(gpu_ids: tuple[int, ...]) -> HostFindings:
    nvml = FakeNvml.of(SPLIT)
    return HostFindings(run_host_checks(2, 7168, gpu_ids=gpu_ids, root=FIXTURES / SPLIT, nvml=nvml))


def test_a_tp2_server_is_planned_on_its_own_gpus_findings():
    healthy = plan_allreduce(PCIE8, D(2, model_arch=KIMI, host=fixture("healthy")), ARCHS)
    ours = plan_allreduce(
        PCIE8, D(2, model_arch=KIMI, gpu_ids=(0, 1), host=split_findings((0, 1))), ARCHS
    )
    assert (ours.fusion_backend, ours.plain_allreduce) == ("trtllm", "pcie_ipc"), ours.reasons
    assert ours.reasons == healthy.reasons
    theirs = plan_allreduce(
        PCIE8, D(2, model_arch=KIMI, gpu_ids=(2, 3), host=split_findings((2, 3))), ARCHS
    )
    assert theirs.plain_allreduce == "nccl", theirs.reasons
    assert "host p2p_driver: GPUs 2,3: PCI 0000:05:00.0, 0000:06:00.0 sit on root ports" in (
        " | ".join(theirs.reasons)
    )


def test_the_server_reads_host_findings_for_its_tp_group_only(monkeypatch):
    """What the launcher runs (runtime.host_findings): a profile with a sysfs dump, no NVML."""
    from sglang_sm120.server.runtime import host_findings

    monkeypatch.setenv("SGLANG_SM120_SYSFS_ROOT", str(FIXTURES / SPLIT))
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", "/nonexistent-cache")
    ours = host_findings(PCIE8, 2, 7168, (0, 1)).check("p2p_driver")
    assert ours.status == "ok" and ours.gpus == (0, 1), ours
    theirs = host_findings(PCIE8, 2, 7168, (2, 3)).check("p2p_driver")
    assert theirs.status == "fail" and theirs.gpus == (2, 3), theirs
