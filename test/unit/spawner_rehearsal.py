"""Processes that spawn SGLang schedulers, started the way SGLang starts them, each with a stale
``SGLANG_SM120_LAUNCH_PLAN`` in its environment. Their scheduler children are SGLang's override
point for private forks (``run_scheduler_process_func``): ``report_plan`` writes the launch plan
the child was started with to ``$REHEARSAL_DIR/child-<pid>.json`` and exits.

``engine``: a user's script runs ``sglang.Engine(...)`` (a subclass naming its scheduler
    function, as SGLang's fork override point allows); the Engine spawns its children with
    ``mp`` spawn, which re-imports this ``__main__`` in each of them.
``engine_in_child``: a user's script starts a child with ``mp`` spawn, and the child runs
    ``sglang.Engine(...)`` (``REHEARSAL_LOAD_AT_IMPORT=1``: the script also loads plugins at
    module level, which the child's bootstrapping runs when it re-imports this ``__main__``).
``http_server``: a user's script calls ``http_server.launch_server`` itself, which loads
    plugins only after it resolved the server args.
``dp_controller``: a launcher-like parent resolves the server args with the plugin loaded, then
    starts SGLang's ``run_data_parallel_controller_process`` in a spawned process, as the Engine
    does for ``--dp``; the DP controller spawns its TP groups' children.

The hardware is faked the supported way: ``SGLANG_SM120_TOPOLOGY`` (ours) and
``override_platform`` (upstream's), which each spawned process installs at import
(``REHEARSAL_SM120``), since a spawned child starts from a fresh interpreter.
``REHEARSAL_SCHEDULER=load_plugins_then_report``: the scheduler function loads plugins itself
first, in a script that imports the Engine at the top.

    python spawner_rehearsal.py <phase> <model_dir> <tp> <dp>
"""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import time

REHEARSAL_DIR = os.environ["REHEARSAL_DIR"]


def fake_sm120() -> None:
    """Upstream's facts for an SM120 host, in every process of the rehearsal (a spawned
    process re-imports this module as ``__mp_main__``)."""
    from plugin_scenario import platform_facts
    from sglang.srt.runtime_context import override_platform

    override_platform(**platform_facts((12, 0))).install()


if os.environ.get("REHEARSAL_SM120") == "1":
    fake_sm120()

if os.environ.get("REHEARSAL_LOAD_AT_IMPORT") == "1":  # a script that loads plugins at import
    from sglang.srt.plugins import load_plugins

    load_plugins()


def report_plan(*args, **kwargs) -> None:
    """A scheduler child: say which launch plan it was started with."""
    path = os.path.join(REHEARSAL_DIR, f"child-{os.getpid()}.json")
    with open(path, "w") as out:
        json.dump({"launch_plan": os.environ.get("SGLANG_SM120_LAUNCH_PLAN")}, out)


def load_plugins_then_report(*args, **kwargs) -> None:
    """A fork's scheduler function that loads plugins itself before SGLang's scheduler would
    (``REHEARSAL_SCHEDULER=load_plugins_then_report``): say which role the plugin gave it."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_sm120.server.runtime import PATCH_STATUS, process_role

    path = os.path.join(REHEARSAL_DIR, f"child-{os.getpid()}.json")
    launch_plan = os.environ.get("SGLANG_SM120_LAUNCH_PLAN")
    report = {"launch_plan": launch_plan, "role": process_role(), "patches": PATCH_STATUS}
    with open(path, "w") as out:
        json.dump(report, out)


SCHEDULERS = {"report_plan": report_plan, "load_plugins_then_report": load_plugins_then_report}
SCHEDULER = SCHEDULERS[os.environ.get("REHEARSAL_SCHEDULER", "report_plan")]
if SCHEDULER is load_plugins_then_report:  # a script that imports the Engine at the top
    from sglang.srt.entrypoints.engine import Engine  # noqa: F401


def children(count: int, timeout: float = 240.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        paths = glob.glob(os.path.join(REHEARSAL_DIR, "child-*.json"))
        if len(paths) >= count:
            time.sleep(0.5)  # the last one may still be writing
            return [json.load(open(p)) for p in sorted(paths)]
        time.sleep(0.5)
    return [json.load(open(p)) for p in glob.glob(os.path.join(REHEARSAL_DIR, "child-*.json"))]


def engine(model_dir: str, tp: int, dp: int) -> dict:
    from sglang.srt.entrypoints.engine import Engine

    class ReportingEngine(Engine):
        run_scheduler_process_func = staticmethod(SCHEDULER)

    try:
        ReportingEngine(
            model_path=model_dir,
            tp_size=tp,
            dp_size=dp,
            device="cuda",
            skip_tokenizer_init=True,
            log_level="info",
        )
    except BaseException as exc:  # the children report and exit without saying "ready"
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = None
    return {"children": children(tp * dp), "error": error}


def engine_in_child(model_dir: str, tp: int, dp: int) -> dict:
    """A user's script runs ``sglang.Engine(...)`` in a child it starts with ``mp`` spawn from
    under ``if __name__ == "__main__"``; with ``REHEARSAL_LOAD_AT_IMPORT`` the script also loads
    plugins at module level, so the child loads them while its bootstrapping re-imports this
    ``__main__``, before the Engine's own entry function calls ``load_plugins()``."""
    import multiprocessing as mp

    context = mp.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    child = context.Process(target=_engine_child, args=(writer, model_dir, tp, dp))
    child.start()
    result = reader.recv() if reader.poll(300) else {"children": [], "error": "no answer"}
    child.join(30)
    return result


def _engine_child(writer, model_dir: str, tp: int, dp: int) -> None:
    from sglang.srt.utils.common import kill_process_tree

    writer.send(engine(model_dir, tp, dp))
    kill_process_tree(os.getpid(), include_parent=False)  # the Engine's detokenizer outlives it


def http_server(model_dir: str, tp: int, dp: int) -> dict:
    """A user's script calls ``http_server.launch_server`` directly: SGLang loads plugins only
    inside it, after it resolved the server args."""
    from sglang.srt.entrypoints.http_server import launch_server
    from sglang.srt.server_args import ServerArgs

    extra = json.loads(os.environ.get("REHEARSAL_SERVER_ARGS", "{}"))
    args = ServerArgs(
        model_path=model_dir,
        tp_size=tp,
        dp_size=dp,
        device="cuda",
        skip_tokenizer_init=True,
        log_level="info",
        **extra,
    )
    try:
        launch_server(args, run_scheduler_process_func=report_plan)
    except BaseException as exc:  # the children report and exit without saying "ready"
        error = f"{type(exc).__name__}: {exc}"
    else:
        error = None
    return {"children": children(tp * dp), "error": error}


def dp_controller(model_dir: str, tp: int, dp: int) -> dict:
    import multiprocessing as mp

    from sglang.srt.plugins import load_plugins

    load_plugins()  # first, as launch_server's main does
    from sglang.srt.managers.data_parallel_controller import run_data_parallel_controller_process
    from sglang.srt.server_args import PortArgs, ServerArgs

    args = ServerArgs(model_path=model_dir, tp_size=tp, dp_size=dp, device="cuda")
    args.resolve_once()
    launcher_plan = os.environ.get("SGLANG_SM120_LAUNCH_PLAN")
    os.environ["SGLANG_SM120_LAUNCH_PLAN"] = os.environ["REHEARSAL_STALE_PLAN"]
    mp.set_start_method("spawn", force=True)  # as SGLang's engine does
    _reader, writer = mp.Pipe(duplex=False)  # kept open: the controller reports into it
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)  # a failing DP controller signals its parent
    proc = mp.Process(
        target=run_data_parallel_controller_process,
        kwargs=dict(
            server_args=args,
            port_args=PortArgs.init_new(args),
            pipe_writer=writer,
            run_scheduler_process_func=report_plan,
        ),
    )
    proc.start()
    try:
        found = children(tp * dp)
    finally:
        proc.kill()
        proc.join()
    return {"children": found, "launcher_plan": launcher_plan}


def main() -> None:
    phase, model_dir, tp, dp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    phases = {
        "engine": engine,
        "engine_in_child": engine_in_child,
        "http_server": http_server,
        "dp_controller": dp_controller,
    }
    result = phases[phase](model_dir, tp, dp)
    print("REHEARSAL " + json.dumps(result), flush=True)
    from sglang.srt.utils.common import kill_process_tree

    # What launch_server's own main does on the way out: the detokenizer outlives a failed start.
    kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
