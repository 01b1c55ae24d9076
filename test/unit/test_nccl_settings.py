"""doctor's ``nccl_warnings``: the NCCL_* settings that break or slow this launch, each rule a
row checked against the NCCL documentation its source names (planning/nccl_settings.py)."""

from __future__ import annotations

import pytest
from sglang_sm120.machine.facts import load_profile
from sglang_sm120.planning.nccl_settings import NCCL_RULES, nccl_warnings, warning_lines
from sglang_sm120.planning.policy import Deployment, plan_allreduce
from sglang_sm120.planning.upstream import FUSION_ARCHS

KIMI = "KimiK25ForConditionalGeneration"
PCIE, NOP2P, NVLINK = "rtx-pro-6000-x8-pcie", "rtx-5090-x2-nop2p", "h200-x8-nvlink"


def warned(profile: str, tp: int, env: dict[str, str], **deployment) -> dict[str, str]:
    facts = load_profile(profile)
    d = Deployment(tp_size=tp, model_arch=KIMI, **deployment)
    plan = plan_allreduce(facts, d, FUSION_ARCHS)
    return {w.variable: w.problem for w in nccl_warnings(env, facts, d, plan)}


# profile, tp, env, deployment, the warning's variable (None: no warning), in its text
ROWS = [
    # P2P off in NCCL where every pair has it: NCCL stages through host memory (SHM)
    (PCIE, 8, {"NCCL_P2P_DISABLE": "1"}, {}, "NCCL_P2P_DISABLE", "host memory"),
    (NOP2P, 2, {"NCCL_P2P_DISABLE": "1"}, {}, None, ""),  # no P2P to lose
    (PCIE, 8, {"NCCL_P2P_DISABLE": "0"}, {}, None, ""),
    # P2P level: below SYS loses the cross-socket pairs (GPUs 0-3 on NUMA 0, 4-7 on NUMA 1)
    (PCIE, 8, {"NCCL_P2P_LEVEL": "PHB"}, {}, "NCCL_P2P_LEVEL", "NUMA nodes 0, 1"),
    (PCIE, 8, {"NCCL_P2P_LEVEL": "3"}, {}, "NCCL_P2P_LEVEL", "NUMA nodes 0, 1"),
    (PCIE, 4, {"NCCL_P2P_LEVEL": "PHB"}, {}, None, ""),  # GPUs 0-3: one NUMA node
    (PCIE, 8, {"NCCL_P2P_LEVEL": "SYS"}, {}, None, ""),
    (PCIE, 2, {"NCCL_P2P_LEVEL": "NVL"}, {}, "NCCL_P2P_LEVEL", "this host has none"),
    (NVLINK, 8, {"NCCL_P2P_LEVEL": "NVL"}, {}, None, ""),
    (PCIE, 2, {"NCCL_P2P_LEVEL": "loc"}, {}, "NCCL_P2P_LEVEL", "LOC: never"),
    # no LL for small messages, where decode/verify all-reduces reach NCCL
    (NOP2P, 2, {"NCCL_PROTO": "Simple"}, {}, "NCCL_PROTO", "LL128 or Simple"),
    (NOP2P, 2, {"NCCL_PROTO": "^LL"}, {}, "NCCL_PROTO", "low-latency"),
    (NOP2P, 2, {"NCCL_PROTO": "LL,Simple"}, {}, None, ""),
    (NOP2P, 2, {"NCCL_PROTO": "allreduce:Simple;allgather:LL"}, {}, "NCCL_PROTO", "LL"),
    (NOP2P, 2, {"NCCL_PROTO": "allgather:Simple"}, {}, None, ""),
    (PCIE, 8, {"NCCL_PROTO": "Simple"}, {}, None, ""),  # PCIe-IPC serves decode/verify
    (NVLINK, 8, {"NCCL_PROTO": "Simple"}, {}, None, ""),  # custom all-reduce serves them
    (NVLINK, 8, {"NCCL_PROTO": "Simple"}, {"custom_all_reduce": False}, "NCCL_PROTO", "LL"),
    # Tree only, under CUDA graphs: failed capture in the investigation behind this project
    (PCIE, 8, {"NCCL_ALGO": "Tree"}, {}, "NCCL_ALGO", "capture failed"),
    (PCIE, 8, {"NCCL_ALGO": "tree,ring"}, {}, None, ""),
    (PCIE, 8, {"NCCL_ALGO": "^Ring"}, {}, "NCCL_ALGO", "only Tree"),
    (PCIE, 8, {"NCCL_ALGO": "Ring"}, {}, None, ""),
    (PCIE, 1, {"NCCL_ALGO": "Tree", "NCCL_P2P_DISABLE": "1"}, {}, None, ""),  # no all-reduce
]


@pytest.mark.parametrize(("profile", "tp", "env", "deployment", "variable", "text"), ROWS)
def test_nccl_rule_row(profile, tp, env, deployment, variable, text):
    found = warned(profile, tp, env, **deployment)
    if variable is None:
        assert found == {}
    else:
        assert list(found) == [variable] and text in found[variable], found


def test_every_rule_names_its_fix_and_source():
    for rule in NCCL_RULES:
        assert rule.fix and rule.source, rule.variable
        assert "NCCL User Guide" in rule.source or "measured" in rule.source


def test_warnings_show_the_value_the_fix_and_the_source():
    facts = load_profile(PCIE)
    d = Deployment(tp_size=8, model_arch=KIMI)
    plan = plan_allreduce(facts, d, FUSION_ARCHS)
    env = {"NCCL_P2P_DISABLE": "1", "NCCL_ALGO": "Tree", "PATH": "/bin"}
    lines = warning_lines(nccl_warnings(env, facts, d, plan))
    assert lines[0] == "NCCL settings that break or slow this launch:"
    assert (
        lines[1].startswith("  NCCL_P2P_DISABLE='1': ")
        and "fix: unset NCCL_P2P_DISABLE" in lines[1]
    )
    assert "NCCL User Guide, Environment Variables: NCCL_P2P_DISABLE" in lines[1]
    assert lines[2].startswith("  NCCL_ALGO='Tree': ")
