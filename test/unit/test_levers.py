"""doctor's and plan's "all-reduce options": every upstream switch, can run / used / if set, as
a table on the embedded profiles (docs/routing.md, "Every all-reduce switch")."""

from __future__ import annotations

import pytest
from sglang_sm120.machine.facts import load_profile
from sglang_sm120.planning.levers import allreduce_levers
from sglang_sm120.planning.policy import Deployment, plan_allreduce
from sglang_sm120.planning.upstream import FUSION_ARCHS

KIMI = "KimiK25ForConditionalGeneration"
PCIE, NOP2P, NVLINK = "rtx-pro-6000-x8-pcie", "rtx-5090-x2-nop2p", "h200-x8-nvlink"
SWITCHES = (
    "--disable-custom-all-reduce",
    "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE",
    "--flashinfer-allreduce-fusion-backend",
    "--enforce-disable-flashinfer-allreduce-fusion",
    "--enable-mscclpp",
    "--enable-torch-symm-mem",
    "--enable-symm-mem",
    "--enable-nccl-nvls",
    "--pre-warm-nccl",
)


def levers(profile: str, tp: int, mscclpp: bool | None = None, **deployment):
    facts = load_profile(profile)
    d = Deployment(tp_size=tp, model_arch=KIMI, **deployment)
    plan = plan_allreduce(facts, d, FUSION_ARCHS)
    return {row.switch: row for row in allreduce_levers(facts, d, plan, FUSION_ARCHS, mscclpp)}


# profile, tp, switch, can_run, used, in why, in if_set
ROWS = [
    # upstream's custom all-reduce: TP2 over PCIe yes (v1), above TP2 only with NVLink, no P2P no
    (PCIE, 2, "--disable-custom-all-reduce", True, True, "TP2 over PCIe", "PCIe-IPC"),
    (PCIE, 8, "--disable-custom-all-reduce", False, False, "more than 2 PCIe-only", "no change"),
    (NOP2P, 2, "--disable-custom-all-reduce", False, False, "no P2P between GPUs 0-1", "NCCL"),
    (NVLINK, 8, "--disable-custom-all-reduce", True, True, "NVLink on all pairs", "NCCL"),
    # PCIe-IPC: the plan's own switch, judged by planning with it flipped
    (
        PCIE,
        8,
        "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE",
        True,
        True,
        "the plan uses it",
        "=0: the plan becomes: NCCL",
    ),
    (NOP2P, 2, "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", False, False, "no P2P", "unchanged (NCCL)"),
    (NVLINK, 8, "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", None, None, "does not manage", "=1"),
    # FlashInfer fusion: off at TP8 over PCIe (trtllm if asked), auto at TP2, refused without P2P
    (
        PCIE,
        8,
        "--flashinfer-allreduce-fusion-backend",
        True,
        False,
        "fusion off by default at TP8",
        "fused points on trtllm",
    ),
    (PCIE, 2, "--flashinfer-allreduce-fusion-backend", True, True, "auto at TP2", "unchanged"),
    (NOP2P, 2, "--flashinfer-allreduce-fusion-backend", False, False, "no P2P", "unchanged (NCCL)"),
    (
        PCIE,
        2,
        "--enforce-disable-flashinfer-allreduce-fusion",
        True,
        False,
        "not set",
        "the plan becomes: PCIe-IPC",
    ),
    # MSCCL++: world sizes 4-64; the package decides where it is known
    (
        PCIE,
        8,
        "--enable-mscclpp",
        None,
        False,
        "runs where the mscclpp package imports",
        "ahead of custom all-reduce and PCIe-IPC",
    ),
    (PCIE, 2, "--enable-mscclpp", False, False, "world size 2", "stay on PCIe-IPC"),
    (NVLINK, 8, "--enable-mscclpp", None, False, "world size 8 fits", "MSCCL++ takes"),
    # torch symmetric memory: capability 9/10 in SGLang's table, and multicast
    (
        PCIE,
        8,
        "--enable-torch-symm-mem",
        False,
        False,
        "no SM12x entry and PCIe has no multicast",
        "stay on PCIe-IPC",
    ),
    (NOP2P, 2, "--enable-torch-symm-mem", False, False, "no SM12x entry", "stay on NCCL"),
    (NVLINK, 8, "--enable-torch-symm-mem", None, False, "NVSwitch", "up to 128 MiB"),
    # NCCL symmetric memory pre-empts PCIe-IPC for plain all-reduces
    (PCIE, 8, "--enable-symm-mem", True, False, "CUDA", "PCIe-IPC serves no plain all-reduce"),
    (NOP2P, 2, "--enable-symm-mem", True, False, "CUDA", "NCCL already"),
    # NVLS needs NVSwitch
    (PCIE, 8, "--enable-nccl-nvls", False, False, "PCIe only", "no effect here"),
    (NVLINK, 8, "--enable-nccl-nvls", None, False, "NVSwitch", "NCCL_NVLS_ENABLE=1"),
    (PCIE, 8, "--pre-warm-nccl", True, False, "tp > 1", "routes unchanged"),
]


@pytest.mark.parametrize(("profile", "tp", "switch", "can_run", "used", "why", "if_set"), ROWS)
def test_lever_row(profile, tp, switch, can_run, used, why, if_set):
    row = levers(profile, tp)[switch]
    assert (row.can_run, row.used) == (can_run, used), row
    assert why in row.why, row.why
    assert if_set in row.if_set, row.if_set


@pytest.mark.parametrize(("profile", "tp"), [(PCIE, 8), (PCIE, 2), (NOP2P, 2), (NVLINK, 8)])
def test_every_upstream_switch_has_one_row_with_reasons(profile, tp):
    rows = levers(profile, tp)
    assert tuple(rows) == SWITCHES
    assert all(row.why and row.if_set for row in rows.values())


def test_mscclpp_not_importing_here_says_how_to_get_it():
    row = levers(PCIE, 8, mscclpp=False)["--enable-mscclpp"]
    assert (row.can_run, row.used) == (False, False)
    assert "not on PyPI" in row.why and "stay on PCIe-IPC" in row.if_set


def test_mscclpp_importing_here_can_run_at_tp8():
    assert levers(PCIE, 8, mscclpp=True)["--enable-mscclpp"].can_run is True


def test_custom_all_reduce_turned_off_by_the_user_is_not_used():
    row = levers(PCIE, 2, custom_all_reduce=False)["--disable-custom-all-reduce"]
    assert (row.can_run, row.used) == (True, False) and "turns it off" in row.why


def test_tp1_has_nothing_to_reduce():
    rows = levers(PCIE, 1)
    assert not any(row.used for row in rows.values() if row.switch.startswith("--enable"))
    assert "tp=1" in rows["--enable-mscclpp"].why


def test_a_tp_group_spanning_nodes_gets_no_custom_all_reduce():
    facts = load_profile(NVLINK)
    d = Deployment(tp_size=16, nnodes=2, model_arch=KIMI)
    plan = plan_allreduce(facts, d, FUSION_ARCHS)
    row = allreduce_levers(facts, d, plan, FUSION_ARCHS, None)[0]
    assert row.can_run is False and "spans nodes" in row.why


def test_mscclpp_the_tuning_table_turned_on_reads_used_with_the_plans_reason():
    """Where tune measured MSCCL++ clearly faster at the sizes SGLang all-reduces, doctor's row
    says the plan uses it and why (the plan's own reason), not 'the plan leaves it off'."""
    from sglang_sm120.planning.tuning import Measurement, TuningTable

    rows = [Measurement("mscclpp", t, 5.0, True) for t in (4, 64)]
    rows += [Measurement(b, t, 50.0, True) for b in ("nccl", "pcie_ipc") for t in (4, 64)]
    table = TuningTable({}, 8, 7168, "bfloat16", tuple(rows))
    row = levers(PCIE, 8, mscclpp=True, tuning=table)["--enable-mscclpp"]
    assert (row.can_run, row.used) == (True, True)
    assert "--enable-mscclpp on from the tuning table" in row.why
    untuned = levers(PCIE, 8, mscclpp=True)["--enable-mscclpp"]
    assert (untuned.used, "the plan leaves it off" in untuned.why) == (False, True)
    assert "`sglang-sm120 tune` times it here" in untuned.if_set
