"""The plugin's worker-side patches driven from SGLang's own call sites, in processes started
like SGLang's, on CPU.

``launcher``: loads plugins as ``launch_server`` does and resolves real ServerArgs once per
plan variant (``sm120_pcie``: ``SGLANG_SM120_FUSION_BACKEND=sm120_pcie``; ``default``: the
planned defaults, PCIe-IPC for plain all-reduces). It pickles each resolved ServerArgs (SGLang
hands them to its schedulers the same way) and prints the plan it published for each
(``SGLANG_SM120_LAUNCH_PLAN``).

``worker``: one TP rank of a 2-rank world, started with that plan in its environment: SGLang's
scheduler module is imported before ``load_plugins()``, the server args are published with the
rank's placement (as ``run_scheduler_process`` does), then SGLang's own
``bootstrap.init_parallel_runtime`` builds a real gloo world and the model-parallel groups. Our
kernel library is replaced by ``recording_kernel``; SGLang is not stubbed. Then, each through
SGLang's call site: the workspace setup before capture, plain all-reduces
(``GroupCoordinator.all_reduce``), the fused point (``RMSNorm.forward_with_allreduce_fusion``),
fused points during a verify-graph capture (``DecodeCudaGraphRunner.capture_one_shape``), the
peer check (``SchedulerOutputStreamer.stream_output``), and upstream's invariants at the
patched seams. It prints one JSON line.

What a CPU box cannot give is said where it is set: no NCCL library (SGLang then disables
PyNccl, as on any non-GPU host), ``flashinfer`` not installed (a placeholder stands for
``flashinfer.comm`` where upstream only tests it for None), and activations on the ``meta``
device (CPU tensors go straight to gloo in ``GroupCoordinator.all_reduce``), for which
``SglangOpsOnMeta`` runs the body SGLang registered for the CUDA key of the op under test.

    python callsite_rehearsal.py launcher <model_dir> <out_dir>
    python callsite_rehearsal.py worker <out_dir> <variant> <rank> <port>
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import types
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

VARIANTS = {"sm120_pcie": {"SGLANG_SM120_FUSION_BACKEND": "sm120_pcie"}, "default": {}}
WORLD = 2
HIDDEN = 7168  # the model's hidden size (Kimi-K2.5 / DeepSeek-V3 config)
TRACED = ("/sglang/srt/distributed/", "/sglang/srt/layers/", "/sglang_sm120/server/patches/")
CONTEXT_READS = ("/sglang/srt/runtime_context.py",)


def launcher(model_dir: str, out_dir: str) -> dict:
    from plugin_scenario import capability, platform_facts
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.server_args import ServerArgs

    with override_platform(**platform_facts(capability())):
        load_plugins()
        from sglang_sm120.server.runtime import LAUNCH_PLAN_ENV

        result = {}
        for variant, env in VARIANTS.items():
            os.environ.pop("SGLANG_SM120_FUSION_BACKEND", None)
            os.environ.update(env)
            # No custom all-reduce: the rehearsal has no CUDA IPC for it, and at TP2 a real
            # server builds v1 and resolves declined points to it first (the plan then declines
            # none); without it, declined points reach PCIe-IPC / NCCL as routed here.
            args = ServerArgs(
                model_path=model_dir, tp_size=WORLD, device="cuda", disable_custom_all_reduce=True
            )
            args.resolve_once()
            (Path(out_dir) / f"{variant}.args").write_bytes(pickle.dumps(args))
            result[variant] = {
                "fusion_backend": args.resolved_dict()["flashinfer_allreduce_fusion_backend"],
                "launch_plan": os.environ[LAUNCH_PLAN_ENV],
            }
        return result


class CallTrace:
    """Names (``co_qualname``) of the upstream and plugin functions called while active, in
    files whose path holds one of ``paths``: which path SGLang's code really took."""

    def __init__(self, paths: tuple[str, ...] = TRACED) -> None:
        self.paths = paths
        self.calls: list[str] = []

    def _profile(self, frame, event, arg) -> None:
        if event == "call" and any(p in frame.f_code.co_filename for p in self.paths):
            self.calls.append(frame.f_code.co_qualname)

    def __enter__(self) -> CallTrace:
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)


def sglang_ops_on_meta(bodies: dict[str, Callable]):
    """A dispatch mode that records every ``sglang::`` op dispatched and, for the ops in
    ``bodies``, runs the Python body SGLang registered for the CUDA key (meta tensors would
    otherwise get the op's fake implementation)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class SglangOpsOnMeta(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            if name.startswith("sglang::"):
                self.ops.append(name)
            if name in bodies:
                return bodies[name](*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))

    return SglangOpsOnMeta()


def guarded(result: dict, key: str, fn: Callable[[], Any]) -> None:
    """Run one rehearsal step; its answer, or the exception it raised, goes under ``key``."""
    try:
        result[key] = fn()
    except Exception as exc:  # the tests assert on it
        result[key] = {"exception": f"{type(exc).__name__}: {exc}"}


def meta(*shape: int, dtype=None):
    import torch

    return torch.empty(*shape, dtype=dtype or torch.bfloat16, device="meta")


def take_calls() -> list[dict]:
    import recording_kernel

    calls = list(recording_kernel.CALLS)
    recording_kernel.CALLS.clear()
    return calls


def plain_route(group, x) -> dict:
    """One plain all-reduce through ``GroupCoordinator.all_reduce``: the sglang ops it
    dispatched, our kernel's calls, and the functions on the path."""
    from sglang.srt.distributed import parallel_state

    mode = sglang_ops_on_meta(
        {"sglang::flashinfer_allreduce": parallel_state.flashinfer_allreduce.__wrapped__}
    )
    with mode, CallTrace() as trace:
        out = group.all_reduce(x)
    return {
        "ops": mode.ops,
        "kernel": take_calls(),
        "trace": trace.calls,
        "shape": list(out.shape),
    }


def fused_route(
    norm, x, residual, bodies: dict[str, Callable] | None = None, attention: bool = True
) -> dict:
    """One fused point through ``RMSNorm.forward_with_allreduce_fusion`` (after attention, or
    after the MoE); ``bodies``: sglang ops to run for real (by default each only records)."""
    mode = sglang_ops_on_meta(bodies or {})
    with mode, CallTrace() as trace:
        out = norm.forward_with_allreduce_fusion(x, residual, use_attn_tp_group=attention)
    shapes = [list(t.shape) for t in out] if isinstance(out, tuple) else [list(out.shape)]
    return {"ops": mode.ops, "kernel": take_calls(), "trace": trace.calls, "shapes": shapes}


def fused_where_the_table_chose_unfused(norm) -> dict:
    """Fused points of 4 rows after attention and after the MoE, with this process's
    sm120_pcie groups following a tuning table in which our all-reduce + a separate norm won
    from 3 rows on (the fused kernel below)."""
    from dataclasses import replace

    from sglang.srt.distributed import parallel_state
    from sglang_sm120.server.patches import sm120_pcie_backend

    saved = dict(sm120_pcie_backend._workspaces)
    routes = ((2, "sm120_pcie"), (64, "sm120_pcie_unfused"))
    for key, group in saved.items():
        plan = replace(group.plan, routes=routes)
        sm120_pcie_backend._workspaces[key] = replace(group, plan=plan)
    try:
        body = {"sglang::flashinfer_allreduce": parallel_state.flashinfer_allreduce.__wrapped__}
        return {
            where: fused_route(norm, meta(4, HIDDEN), meta(4, HIDDEN), body, where == "attention")
            for where in ("attention", "moe")
        }
    finally:
        sm120_pcie_backend._workspaces.clear()
        sm120_pcie_backend._workspaces.update(saved)


def fused_where_the_table_routed_off_trtllm(norm) -> dict:
    """Fused points of 4 rows after attention and after the MoE, with this process's trtllm plan
    following a tuning table in which PCIe-IPC + a separate norm won from 3 to 64 rows (as the
    launcher would publish it)."""
    from sglang_sm120.server import runtime
    from sglang_sm120.server.patches import sm120_pcie_backend

    def republish(value: str) -> None:
        os.environ[runtime.LAUNCH_PLAN_ENV] = value
        runtime._launch_plan.cache_clear()
        sm120_pcie_backend._trtllm_to_pcie_ipc = sm120_pcie_backend._UNRESOLVED

    published = os.environ[runtime.LAUNCH_PLAN_ENV]
    launched = json.loads(published)
    launched["plan"]["routes"] = [[1, 2, "trtllm"], [3, 64, "pcie_ipc"], [65, 2048, "trtllm"]]
    republish(json.dumps(launched))
    try:
        return {
            where: fused_route(norm, meta(4, HIDDEN), meta(4, HIDDEN), None, where == "attention")
            for where in ("attention", "moe")
        }
    finally:
        republish(published)


def workspace_setup(mr_dtype) -> dict:
    """The runner's own step before graph capture (``BaseRunner`` method, on a runner that has
    only the fields it reads)."""
    from sglang.srt.model_executor.runner.base_runner import BaseRunner
    from sglang_sm120.server import runtime

    runner = types.SimpleNamespace(
        model_runner=types.SimpleNamespace(
            model_config=types.SimpleNamespace(hidden_size=HIDDEN),
            dtype=mr_dtype,
            is_draft_worker=False,
        )
    )
    with CallTrace() as trace:
        BaseRunner._pre_initialize_flashinfer_allreduce_workspace(runner)
    # what the plugin logs once per process about the workspaces it built
    logged = sorted(m for m in runtime._logged if "sm120_pcie workspace for group" in m)
    return {"kernel": take_calls(), "trace": trace.calls, "logged": logged}


def output_streamer(server_args, name: str):
    """A real SchedulerOutputStreamer whose detokenizer socket is a zmq PAIR over inproc;
    returns it, the receiving socket and one finished generation request."""
    import zmq
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
    from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper
    from sglang.srt.managers.scheduler_components.output_streamer import (
        SchedulerOutputStreamer,
    )
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    context = zmq.Context.instance()
    send, receive = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    send.bind(f"inproc://{name}")
    receive.connect(f"inproc://{name}")
    streamer = SchedulerOutputStreamer(
        send_to_detokenizer=SenderWrapper(send),
        tree_cache=None,
        server_args=server_args,
        is_generation=True,
        spec_algorithm=SpeculativeAlgorithm.NONE,
        disaggregation_mode=DisaggregationMode.NULL,
        enable_hicache_storage=lambda: False,
    )
    req = Req("r0", "hi", array("q", [1, 2, 3]), SamplingParams(max_new_tokens=1))
    req.output_ids.append(7)
    req.finished_reason = FINISH_LENGTH(length=1)
    return streamer, receive, req


def stream_once(streamer, receive, req) -> dict:
    import zmq

    try:
        streamer.stream_output([req], return_logprob=False)
        raised = None
    except Exception as exc:
        raised = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    sent = []
    while receive.poll(200, zmq.POLLIN):
        sent.append(type(receive.recv_pyobj()).__name__)
    return {"raised": raised, "sent": sent}


def invariants(tp) -> dict:
    """Upstream's guards at the patched seams, asked directly, with our workspace present."""
    import torch
    from sglang.srt.distributed.device_communicators import pcie_ipc_ar
    from sglang.srt.layers import flashinfer_comm_fusion as fcf

    key = (tp.device_group, tp.cpu_group)

    def can(x, world=WORLD, group_key=key) -> bool:
        return fcf.can_use_flashinfer_allreduce(
            x, use_attn_tp_group=True, expected_world_size=world, expected_group_key=group_key
        )

    big = fcf_rows_over_workspace()
    answers = {
        "fits": can(meta(4, HIDDEN)),
        "ndim3": can(meta(1, 4, HIDDEN)),
        "non_contiguous": can(meta(HIDDEN, 4).t()),
        "float32": can(meta(4, HIDDEN, dtype=torch.float32)),
        "over_workspace": can(meta(big, HIDDEN)),
        "world_size_4": can(meta(4, HIDDEN), world=4),
        "other_group_key": can(meta(4, HIDDEN), group_key=(None, None)),
    }
    with CallTrace(CONTEXT_READS) as reads:
        first = pcie_ipc_ar.eligible_group(group_name="tp", world_size=WORLD, deterministic=False)
        again = pcie_ipc_ar.eligible_group(group_name="tp", world_size=WORLD, deterministic=False)
    answers["eligible_group"] = [first, again]
    answers["eligible_group_context_reads"] = reads.calls
    return answers


def unpublished() -> dict:
    """Before anything is published: each patched seam and upstream's own function (the end
    of its applied chain) give the same answer, and neither raises."""
    import inspect

    from sglang.srt.distributed.device_communicators import pcie_ipc_ar
    from sglang.srt.layers import flashinfer_comm_fusion as fcf

    calls = [
        (
            fcf.can_use_flashinfer_allreduce,
            dict(
                input_=meta(4, HIDDEN),
                use_attn_tp_group=True,
                expected_world_size=WORLD,
                expected_group_key=(None, None),
            ),
        ),
        (pcie_ipc_ar.eligible_group, dict(group_name="tp", world_size=4, deterministic=False)),
        (pcie_ipc_ar.eligible_group, dict(group_name="pp", world_size=WORLD, deterministic=False)),
        (pcie_ipc_ar.eligible_group, dict(group_name="tp", world_size=1, deterministic=False)),
    ]
    rows = []
    for fn, kwargs in calls:
        row = {"call": fn.__name__}
        for label, f in (("patched", fn), ("upstream", inspect.unwrap(fn))):
            try:
                row[label] = f(**kwargs)
            except Exception as exc:
                row[label] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


class StopCapture(Exception):
    """Ends a rehearsed capture where CUDA graph capture itself would begin."""


def capture_with_fused_points(norm, rows: list[int]) -> dict:
    """SGLang's ``DecodeCudaGraphRunner.capture_one_shape`` (the applied chain) for a
    TARGET_VERIFY graph, on a runner whose capture preparation runs the layer's fused points
    and then stops: the counts are those of fused calls made while a capture runs."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    class RunnerUpToCapture:
        capture_forward_mode = ForwardMode.TARGET_VERIFY
        captured_req_width = 1
        ragged_verify_mode = False

        def capture_prepare(self, bs, stream_idx=None, num_tokens=None):
            for n in rows:
                norm.forward_with_allreduce_fusion(meta(n, HIDDEN), meta(n, HIDDEN))
            raise StopCapture

    try:
        DecodeCudaGraphRunner.capture_one_shape(RunnerUpToCapture(), 4, forward=None)
    except StopCapture:
        pass
    return {"kernel": take_calls()}


def fcf_rows_over_workspace() -> int:
    """Rows of HIDDEN bf16 one past our workspace's capacity (0 without a workspace)."""
    from sglang_sm120.server.patches import sm120_pcie_backend

    spaces = sm120_pcie_backend.workspaces()
    return spaces[0].max_bytes // (HIDDEN * 2) + 1 if spaces else 4096


def worker(out_dir: str, variant: str, rank: int, port: int) -> dict:
    import sglang.srt.managers.scheduler  # noqa: F401  (as in run_scheduler_process)
    from plugin_scenario import capability, platform_facts
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, override_platform, publish

    override_platform(**platform_facts(capability())).install()
    load_plugins()
    import recording_kernel
    import torch
    from sglang.srt.distributed import bootstrap, parallel_state
    from sglang.srt.layers import flashinfer_comm_fusion
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.utils.common import configure_logger
    from sglang_sm120.server.patches import graph_stats, sm120_pcie_backend
    from sglang_sm120.server.runtime import PATCH_STATUS
    from sglang_sm120.server.status import applied_hooks

    # sm120_pcie_behind: the sm120_pcie launch, whose tuning table sent its smallest sizes to
    # PCIe-IPC (the test publishes that plan).
    args_of = "sm120_pcie" if variant == "sm120_pcie_behind" else variant
    server_args = pickle.loads((Path(out_dir) / f"{args_of}.args").read_bytes())
    result: dict = {"variant": variant, "rank": rank}
    guarded(result, "unpublished", unpublished)
    publish(
        server_args,
        role="scheduler",
        ranks=SpawnRanks(world_rank=rank, gpu_id=rank),
    )
    configure_logger(server_args, prefix=f" TP{rank}")
    result["patches"] = dict(PATCH_STATUS)  # checked once logging is configured
    sm120_pcie_backend.KERNEL = recording_kernel
    # On a CPU device upstream's PCIe-IPC communicator stays disabled, so its prepare() never
    # sizes a workspace; what it holds on a CUDA host after prepare (64 decode rows):
    sm120_pcie_backend._pcie_ipc_numel = 64 * HIDDEN
    # flashinfer is not installed here; on a CUDA host this is flashinfer.comm, and upstream
    # only checks it for None on the paths rehearsed (attribute access would raise here).
    flashinfer_comm_fusion._flashinfer_comm = types.ModuleType("flashinfer.comm (absent)")

    with CallTrace() as trace:
        bootstrap.init_parallel_runtime(server_args=server_args, device="cpu", dist_port=port)
    tp = get_parallel().tp_group
    result["init_trace"] = [c for c in trace.calls if "sm120" in c or "flashinfer" in c]
    result["tp"] = {
        "world_size": tp.world_size,
        "fi_workspace_hint": tp._fi_workspace_hint,
        "pcie_ipc_comm": tp.pcie_ipc_comm is not None,  # built when eligible_group said so
    }
    guarded(result, "workspace_setup", lambda: workspace_setup(torch.bfloat16))
    if variant == "sm120_pcie_behind":
        norm = RMSNorm(HIDDEN, eps=1e-6).to(device="meta", dtype=torch.bfloat16)
        body = {"sglang::flashinfer_allreduce": parallel_state.flashinfer_allreduce.__wrapped__}
        guarded(result, "plain_routed_pcie_ipc", lambda: plain_route(tp, meta(2, HIDDEN)))
        guarded(result, "plain_routed_ours", lambda: plain_route(tp, meta(4, HIDDEN)))
        guarded(
            result,
            "fused_routed_pcie_ipc",
            lambda: fused_route(norm, meta(2, HIDDEN), meta(2, HIDDEN), body),
        )
        return result
    guarded(result, "plain_fits", lambda: plain_route(tp, meta(4, HIDDEN)))
    big = fcf_rows_over_workspace()
    guarded(result, "plain_too_big", lambda: plain_route(tp, meta(big, HIDDEN)))
    world = get_parallel().world_group
    world._fi_workspace_hint = tp._fi_workspace_hint  # same size, other peers' group key
    guarded(result, "plain_other_group", lambda: plain_route(world, meta(4, HIDDEN)))
    world._fi_workspace_hint = None

    norm = RMSNorm(HIDDEN, eps=1e-6).to(device="meta", dtype=torch.bfloat16)
    guarded(result, "fused_fits", lambda: fused_route(norm, meta(4, HIDDEN), meta(4, HIDDEN)))
    guarded(
        result, "fused_too_big", lambda: fused_route(norm, meta(big, HIDDEN), meta(big, HIDDEN))
    )
    if variant == "sm120_pcie":
        guarded(result, "fused_routed_unfused", lambda: fused_where_the_table_chose_unfused(norm))
    else:
        guarded(
            result, "fused_routed_off_trtllm", lambda: fused_where_the_table_routed_off_trtllm(norm)
        )
    guarded(result, "invariants", lambda: invariants(tp))
    guarded(result, "capture", lambda: capture_with_fused_points(norm, [4, big]))
    result["fused_chain"] = [h.__name__ for h in applied_hooks(graph_stats.FUSED)]

    guarded(result, "stream_ok", lambda: stream_once(*output_streamer(server_args, "ok")))
    spaces = sm120_pcie_backend.workspaces()
    for ws in spaces:
        ws.fail(f"rank {rank}/{WORLD}: timed out waiting for rank {1 - rank} (rehearsal)")
    guarded(
        result,
        "stream_after_timeout",
        lambda: stream_once(*output_streamer(server_args, "after_timeout")),
    )
    result["workspaces"] = len(spaces)
    stats_dir = os.environ.get("SGLANG_SM120_STATS_DIR")
    if stats_dir:
        result["stats"] = json.loads(
            (Path(stats_dir) / f"sm120-stats-{os.getpid()}.json").read_text()
        )
    return result


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    phase = sys.argv[1]
    if phase == "launcher":
        result = launcher(sys.argv[2], sys.argv[3])
    else:
        out_dir, variant, rank, port = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        result = worker(out_dir, variant, rank, port)
    print("REHEARSAL " + json.dumps(result))


if __name__ == "__main__":
    main()
