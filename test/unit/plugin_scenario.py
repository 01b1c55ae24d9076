"""SGLang's two kinds of process, rehearsed in fresh processes against the real sglang 0.5.23.

``launcher``: loads plugins the way ``launch_server`` does (nothing of the scheduler imported
yet), resolves real ServerArgs for each TP size and configures logging with SGLang's own
``configure_logger``; prints the resolved fusion backend and the plan it published for its
workers (``SGLANG_SM120_LAUNCH_PLAN``).

``worker``: started with that plan in its environment, like a scheduler process: SGLang's
scheduler module is imported before ``load_plugins()`` (``run_scheduler_process`` lives there),
logging is configured with a ``TP0`` prefix, the resolved server args are published, and the real
upstream seams are asked what they decide.

The hardware is faked the supported way: ``SGLANG_SM120_TOPOLOGY`` (our facts) and
``override_platform`` (upstream's facts), both from the profile's compute capability.

    python plugin_scenario.py launcher <model_dir> <tp> [<tp> ...]
    python plugin_scenario.py worker <model_dir> <tp>
"""

from __future__ import annotations

import json
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


def capability() -> tuple[int, int]:
    from sglang_sm120.machine.facts import current_facts

    facts = current_facts()
    return facts.gpus[0].capability if facts.gpus else (0, 0)


def server_args(model_dir: str, tp: int):
    from sglang.srt.server_args import ServerArgs

    extra = json.loads(os.environ.get("SCENARIO_SERVER_ARGS", "{}"))
    return ServerArgs(model_path=model_dir, tp_size=tp, device="cuda", **extra)


def launcher(model_dir: str, tps: list[int]) -> dict:
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import override_platform

    if os.environ.get("SCENARIO_APPEND_PATH"):  # another plugin, discovered after ours
        sys.path.append(os.environ["SCENARIO_APPEND_PATH"])
    with override_platform(**platform_facts(capability())):
        load_plugins()
        from sglang.srt.utils.common import configure_logger
        from sglang_sm120.server.runtime import LAUNCH_PLAN_ENV, PATCH_STATUS

        result: dict = {"fusion_backend": {}, "launch_plan": {}}
        for tp in tps:
            args = server_args(model_dir, tp)
            args.resolve_once()
            result["fusion_backend"][tp] = args.resolved_dict()[
                "flashinfer_allreduce_fusion_backend"
            ]
            result["launch_plan"][tp] = os.environ.get(LAUNCH_PLAN_ENV)
            if tp == tps[0]:
                configure_logger(args)
        result["patches"] = dict(PATCH_STATUS)
        result["other_plugin_calls"] = int(os.environ.get("OTHER_PLUGIN_CALLS", 0))
        return result


def applied_chain(target: str) -> list[str]:
    from sglang_sm120.server.status import applied_hooks

    return [hook.__name__ for hook in applied_hooks(target)]


def worker(model_dir: str, tp: int) -> dict:
    import sglang.srt.managers.scheduler  # noqa: F401  (as in run_scheduler_process)
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_context, override_platform

    with override_platform(**platform_facts(capability())):
        load_plugins()
        from sglang.srt.distributed import parallel_state
        from sglang.srt.distributed.device_communicators import pcie_ipc_ar
        from sglang.srt.layers import flashinfer_comm_fusion
        from sglang.srt.layers.layer_boundary.residual import add_norm
        from sglang.srt.utils.common import configure_logger
        from sglang_sm120.server.patches import PATCHES
        from sglang_sm120.server.runtime import PATCH_STATUS, worker_plan

        configure_logger(server_args(model_dir, tp), prefix=" TP0")
        # An import-time hardware fact the CPU box cannot fake through override_platform
        # (add_norm probes flashinfer+CUDA directly): what a CUDA host with flashinfer has.
        add_norm._is_flashinfer_available = True
        extra = json.loads(os.environ.get("SCENARIO_SERVER_ARGS", "{}"))
        published = {
            **extra,
            "flashinfer_allreduce_fusion_backend": os.environ.get("SCENARIO_FUSION_BACKEND")
            or None,
        }
        result: dict = {"patches": dict(PATCH_STATUS), "resolve": {}}
        with get_context().override_server_args(tp_size=tp, **published):
            result["ar_fusion_applies"] = add_norm.flashinfer_ar_fusion_applies(4)
            result["pcie_ipc_eligible"] = pcie_ipc_ar.eligible_group(
                group_name="tp", world_size=tp, deterministic=False
            )
            flag = published["flashinfer_allreduce_fusion_backend"] is not None
            parallel_state.set_flashinfer_allreduce_only(flag)
            result["flashinfer_allreduce_only"] = parallel_state._ENABLE_FLASHINFER_ALLREDUCE_ONLY
            # Upstream's own caller, with the published enable_mscclpp / enable_torch_symm_mem.
            from sglang.srt.distributed import bootstrap

            bootstrap._set_all_reduce_flags()
            result["upstream_switches"] = {
                "enable_mscclpp": parallel_state._ENABLE_MSCCLPP,
                "enable_torch_symm_mem": parallel_state._ENABLE_TORCH_SYMM_MEM_ALL_REDUCE,
            }
            # Upstream's own caller: the published backend, and nnodes > 1 as is_multi_node.
            try:
                resolved = flashinfer_comm_fusion.resolve_flashinfer_allreduce_fusion_backend()
            except ValueError as exc:
                resolved = f"ValueError: {exc}"
            result["resolve_published"] = resolved
        multi_node = extra.get("nnodes", 1) > 1  # as upstream's caller passes it
        for backend in ("auto", "trtllm", "mnnvl", "sm120_pcie"):
            try:
                result["resolve"][backend] = flashinfer_comm_fusion._resolve_backend(
                    backend, multi_node
                )
            except ValueError as exc:
                result["resolve"][backend] = f"ValueError: {exc}"
        result["add_norm_sm90_constant"] = add_norm._is_sm90_supported
        plan = worker_plan()
        result["worker_plan"] = plan.to_json() if plan else None
        result["chains"] = {
            target: applied_chain(target)
            for module in PATCHES
            for target, _, _ in module.HOOKS
            if PATCH_STATUS.get(module.__name__.rsplit(".", 1)[-1]) == "applied"
        }
        return result


def main() -> None:
    phase, model_dir, tps = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3:]]
    result = launcher(model_dir, tps) if phase == "launcher" else worker(model_dir, tps[0])
    print("SCENARIO " + json.dumps(result))


if __name__ == "__main__":
    main()
