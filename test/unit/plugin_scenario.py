"""Runs in a fresh process: load SGLang's plugins the way every SGLang process does, then ask
the real sglang 0.5.23 code what it decides. Prints one JSON line for the tests to check.

The hardware is faked the supported way: ``SGLANG_SM120_TOPOLOGY`` (our facts) and
``override_platform`` (upstream's facts), both from the profile's compute capability.

    python plugin_scenario.py <model_dir> [tp ...]
"""

from __future__ import annotations

import json
import logging
import os
import sys


def platform_facts(capability: tuple[int, int]) -> dict:
    major = capability[0]
    return dict(
        is_cuda=True,
        is_hip=False,
        has_flashinfer=True,
        device_capability=capability,
        device_sm=major * 10 + capability[1],
        is_sm90=major == 9,
        is_sm100=major == 10,
        is_sm120=major == 12,
        is_blackwell=major in (10, 12),
    )


def main() -> None:
    model_dir, tps = sys.argv[1], [int(t) for t in sys.argv[2:]] or [2, 4, 8]
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    from sglang_sm120.facts import current_facts

    facts = current_facts()
    capability = facts.gpus[0].capability if facts.gpus else (0, 0)
    from sglang.srt.runtime_context import get_context, override_platform

    with override_platform(**platform_facts(capability)):
        from sglang.srt.plugins import load_plugins

        load_plugins()
        from sglang.srt.distributed import parallel_state
        from sglang.srt.distributed.device_communicators import pcie_ipc_ar
        from sglang.srt.layers import flashinfer_comm_fusion
        from sglang.srt.layers.layer_boundary.residual import add_norm
        from sglang.srt.server_args import ServerArgs
        from sglang_sm120.runtime import PATCH_STATUS

        # An import-time hardware fact the CPU box cannot fake through override_platform
        # (add_norm probes flashinfer+CUDA directly): what a CUDA host with flashinfer has.
        add_norm._is_flashinfer_available = True
        extra = json.loads(os.environ.get("SCENARIO_SERVER_ARGS", "{}"))
        result: dict = {
            "patches": dict(PATCH_STATUS),
            "fusion_backend": {},
            "resolve": {},
            "pcie_ipc_eligible": {},
            "flashinfer_allreduce_only": {},
            "ar_fusion_applies": {},
        }
        for tp in tps:
            args = ServerArgs(model_path=model_dir, tp_size=tp, device="cuda", **extra)
            args.resolve_once()
            backend = args.resolved_dict()["flashinfer_allreduce_fusion_backend"]
            result["fusion_backend"][tp] = backend
            published = {**extra, "flashinfer_allreduce_fusion_backend": backend}
            with get_context().override_server_args(tp_size=tp, **published):
                result["ar_fusion_applies"][tp] = add_norm.flashinfer_ar_fusion_applies(4)
                result["pcie_ipc_eligible"][tp] = pcie_ipc_ar.eligible_group(
                    group_name="tp", world_size=tp, deterministic=False
                )
                parallel_state.set_flashinfer_allreduce_only(True)
                result["flashinfer_allreduce_only"][tp] = (
                    parallel_state._ENABLE_FLASHINFER_ALLREDUCE_ONLY
                )
        for backend in ("auto", "trtllm", "mnnvl", "sm120_pcie"):
            try:
                result["resolve"][backend] = flashinfer_comm_fusion._resolve_backend(backend, False)
            except ValueError as exc:
                result["resolve"][backend] = f"ValueError: {exc}"
        result["add_norm_sm90_constant"] = add_norm._is_sm90_supported
        print("SCENARIO " + json.dumps(result))


if __name__ == "__main__":
    main()
