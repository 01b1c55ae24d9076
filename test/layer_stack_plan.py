"""The plan the GPU layer-stack test routes by, importable on CPU so that what it says can be
checked without a GPU (test/unit/test_policy.py)."""

from __future__ import annotations

import dataclasses


def sm120_pcie_plan(world_size: int, hidden: int):
    """The plugin's plan on an 8x RTX PRO 6000 host with a tuning table in which sm120_pcie won
    up to 8 tokens and NCCL above: the stack routes each point as the server would."""
    from sglang_sm120.machine.facts import load_profile
    from sglang_sm120.planning.policy import Deployment, plan_allreduce
    from sglang_sm120.planning.tuning import Measurement, TuningTable

    facts = load_profile("rtx-pro-6000-x8-pcie")
    facts = dataclasses.replace(facts, versions={**facts.versions, "sgl-kernel-sm120": "local"})
    table = TuningTable(
        {},
        world_size,
        hidden,
        "bfloat16",
        (
            Measurement("sm120_pcie", 8, 10.0, True),
            Measurement("nccl", 8, 200.0, True),
            Measurement("sm120_pcie", 64, 90.0, True),
            Measurement("nccl", 64, 60.0, True),
        ),
    )
    deployment = Deployment(world_size, model_arch="DeepseekV3ForCausalLM", tuning=table)
    return plan_allreduce(facts, deployment, {"DeepseekV3ForCausalLM"})
