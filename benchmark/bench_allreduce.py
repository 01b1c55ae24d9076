"""All-reduce and fused all-reduce + residual + RMSNorm latency, CUDA-graph timed.

For each world size and tokens in {1, 2, ..., 2048} x hidden (default 7168), bf16:
  floor            an empty kernel of the plain all-reduce's grid (512 threads a block),
                   launched (with PDL), captured and replayed the same way: what a launch
                   alone costs
  ours plain       sgl_kernel_sm120.all_reduce
  ours fused       sgl_kernel_sm120.fused_allreduce_add_rmsnorm (default settings)
  ours fused 2-launch  the same with fused_rows_per_block=1: all-reduce, then add+RMSNorm
                   with one block per row, whenever a block would own several rows
  ours unfused     ours plain + a separate add+RMSNorm kernel (what the fusion saves)
  nccl + norm      torch.distributed all_reduce (NCCL) + the same add+RMSNorm kernel
  fi trtllm fused  FlashInfer allreduce_fusion(kARResidualRMSNorm), trtllm backend, with
                   launch_with_pdl=True as SGLang 0.5.23 calls it
  fi pcie-ipc      FlashInfer PcieIpcAllReduceWorkspace.all_reduce (plain), after its own
                   tune([hidden]) on this host
  fi pcie + norm   the same + the separate add+RMSNorm kernel
  CA / MSCCL++ / torch symm + norm  upstream's custom all-reduce, MSCCL++ and torch symmetric
                   memory communicators (as `sglang-sm120 tune` builds them, where doctor says they
                   can run; otherwise the reason) + the same add+RMSNorm kernel; a size one of
                   them does not take is n/a with its reason
Ratios: ours AR / FI PCIe-IPC, and ours fused / the best of FI trtllm fused, FI PCIe-IPC + norm
and NCCL + norm (the issue-9 goals: <= 1.0x and <= 0.9x at 1-16 tokens), and
ours fused / ours AR+norm (issue 35: <= 0.95x at every size), ours fused - ours AR (<= 1 us at
1-16 tokens) and ours AR / floor (how many launches' worth a call costs).
Each cell is microseconds per call: every rank captures --calls identical calls in one CUDA
graph, the graphs are replayed --replays times, and a cell is the median over replays of the
per-call time of the rank that started last (see `sglang_sm120.commands.tune.per_call_us`).

Ranks run as one process per GPU when the machine has >= world_size GPUs. Otherwise they run
as streams of one process sharing one GPU: then the numbers are the kernels' own overhead
(synchronisation through L2, no interconnect), NCCL cannot run (it refuses two ranks on one
GPU) and is reported as n/a.

    python benchmark/bench_allreduce.py                    # all world sizes, all sizes
    python benchmark/bench_allreduce.py --world-sizes 8 --tokens 1 16 128

Writes bench_allreduce.json and bench_allreduce.png into --out-dir and prints a table.
"""

from __future__ import annotations

import os

# Ranks sharing one process: a lazily loaded kernel would wait for the spinning ranks.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import argparse
import importlib.util
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

try:
    import sgl_kernel_sm120 as sk
except ImportError:  # not installed: use the sources (library from $SGLANG_SM120_KERNEL_LIBRARY)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sgl-kernel-sm120" / "python"))
    import sgl_kernel_sm120 as sk

from sgl_kernel_sm120 import config as sk_config
from sgl_kernel_sm120.testing import LocalRanks

if importlib.util.find_spec("sglang_sm120") is None:  # plugin not installed: use the sources
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from sglang_sm120.commands.tune import TOKENS as TUNE_TOKENS
from sglang_sm120.commands.tune import (
    Declines,
    flashinfer_pcie_ipc,
    flashinfer_trtllm_fused,
    make_add_rmsnorm,
    time_local,
    upstream_backends,
)
from sglang_sm120.commands.tune import time_graph as time_graph_in_step

TOKENS = list(TUNE_TOKENS)
EPS = 1e-6
COLUMNS = [
    "floor",
    "ours_plain",
    "ours_fused",
    "ours_fused_split",
    "ours_unfused",
    "nccl_norm",
    "fi_trtllm_fused",
    "fi_pcie",
    "fi_pcie_norm",
    "custom_ar_norm",
    "mscclpp_norm",
    "torch_symm_mem_norm",
]
# tune's name of each upstream communicator -> its column here
UPSTREAM_COLUMNS = {
    "custom_ar": "custom_ar_norm",
    "mscclpp": "mscclpp_norm",
    "torch_symm_mem": "torch_symm_mem_norm",
}
HEADERS = {
    "floor": "floor",
    "ours_plain": "ours AR",
    "ours_fused": "ours fused",
    "ours_fused_split": "ours fused 2-launch",
    "ours_unfused": "ours AR+norm",
    "nccl_norm": "NCCL+norm",
    "fi_trtllm_fused": "FI trtllm fused",
    "fi_pcie": "FI pcie AR",
    "fi_pcie_norm": "FI pcie AR+norm",
    "custom_ar_norm": "CA+norm",
    "mscclpp_norm": "MSCCL++ +norm",
    "torch_symm_mem_norm": "torch symm+norm",
}
# What "ours fused" is compared with: every other way to get all-reduce + residual + RMSNorm.
FUSED_RIVALS = (
    "fi_trtllm_fused",
    "fi_pcie_norm",
    "nccl_norm",
    "custom_ar_norm",
    "mscclpp_norm",
    "torch_symm_mem_norm",
)


# --------------------------------------------------------------------- ranks on one GPU


def make_empty_kernel() -> Callable[[int], None]:
    """launch(blocks): an empty Triton kernel of `blocks` x 512 threads (the all-reduce's
    block size), launched as sgl-kernel-sm120 launches its kernels (with programmatic
    dependent launch unless $SGLANG_SM120_PDL is off: it waits for the kernel before it, then
    lets the next one launch), compiled here, before ranks start waiting on each other."""
    import triton
    import triton.language as tl

    @triton.jit
    def _empty(x_ptr, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    anchor = torch.empty(1, device="cuda")
    pdl = sk.config.resolve_early_launch()

    def launch(blocks: int) -> None:
        _empty[(blocks,)](anchor, PDL=pdl, num_warps=16, launch_pdl=pdl)

    launch(1)
    torch.cuda.synchronize()
    return launch


def bench_local(world_size: int, tokens_list: list[int], hidden: int, args) -> dict:
    add_rmsnorm, norm_desc = make_add_rmsnorm(hidden, torch.bfloat16)
    empty = make_empty_kernel()
    max_tokens = max(tokens_list)
    ranks = LocalRanks(sk.CommWorkspace.create_local(world_size, max_tokens, hidden))
    rows = []
    try:
        for tokens in tokens_list:
            g = torch.Generator(device="cuda").manual_seed(tokens)
            xs = [
                torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
                for _ in range(world_size)
            ]
            residual = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
            weight = torch.ones(hidden, device="cuda").bfloat16()
            ws0 = ranks.workspaces[0]
            variant, blocks = ws0.plan(tokens * hidden * 2)

            def plain(r, ws, xs=xs):
                sk.all_reduce(xs[r], ws)

            def fused(r, ws, xs=xs, residual=residual, weight=weight):
                sk.fused_allreduce_add_rmsnorm(xs[r], residual, weight, EPS, ws)

            def unfused(r, ws, xs=xs, residual=residual, weight=weight):
                add_rmsnorm(sk.all_reduce(xs[r], ws), residual, weight)

            row = {
                "tokens": tokens,
                "bytes": tokens * hidden * 2,
                "variant": sk_config.VARIANT_NAMES[variant],
                "blocks": blocks,
                "floor": time_local(
                    ranks, lambda r, ws, b=blocks: empty(b), args.calls, args.replays
                ),
                "ours_plain": time_local(ranks, plain, args.calls, args.replays),
                "ours_fused": time_local(ranks, fused, args.calls, args.replays),
                "ours_fused_split": None,
                "ours_unfused": time_local(ranks, unfused, args.calls, args.replays),
                "nccl_norm": None,
                "fi_trtllm_fused": None,
                "fi_pcie": None,
                "fi_pcie_norm": None,
                **dict.fromkeys(UPSTREAM_COLUMNS.values()),
            }
            rows.append(row)
            print(f"  world {world_size} tokens {tokens:5d}: {_fmt_row(row)}", flush=True)
    finally:
        ranks.close()
    return {
        "world_size": world_size,
        "mode": "one GPU, ranks as streams of one process",
        "add_rmsnorm": norm_desc,
        "skipped": {
            "ours_fused_split": "not measured with ranks sharing one GPU",
            "nccl_norm": f"n/a (needs {world_size} GPUs: NCCL refuses two ranks on one GPU)",
            "fi_trtllm_fused": f"n/a (needs {world_size} GPUs)",
            "fi_pcie": f"n/a (needs {world_size} GPUs)",
            "fi_pcie_norm": f"n/a (needs {world_size} GPUs)",
            **dict.fromkeys(UPSTREAM_COLUMNS.values(), f"n/a (needs {world_size} GPUs)"),
        },
        "rows": rows,
    }


# ------------------------------------------------------------------- one process per GPU


def _mp_worker(rank: int, world_size: int, init_file: str, result_file: str, args) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    gloo = dist.new_group(backend="gloo")
    hidden, tokens_list = args.hidden, args.tokens
    add_rmsnorm, norm_desc = make_add_rmsnorm(hidden, torch.bfloat16)
    empty = make_empty_kernel()
    max_tokens = max(tokens_list)
    ws = sk.CommWorkspace.create(gloo, max_tokens, hidden)
    ws_split = sk.CommWorkspace.create(gloo, max_tokens, hidden, fused_rows_per_block=1)
    skipped: dict[str, str] = {}
    notes: list[str] = []
    fi_fused = fi_pcie = None
    upstream: dict[str, Callable] = {}
    if args.skip_baselines:
        for name in ("nccl_norm", "fi_trtllm_fused", "fi_pcie", "fi_pcie_norm"):
            skipped[name] = "not measured (--skip-baselines)"
        for name in UPSTREAM_COLUMNS.values():
            skipped[name] = "not measured (--skip-baselines)"
    else:
        fi_fused, fi_pcie = _flashinfer_baselines(
            rank, args, max_tokens, hidden, gloo, skipped, notes
        )
        refused: dict[str, str] = {}
        upstream = upstream_backends(gloo, torch.device("cuda", rank), add_rmsnorm, refused)
        skipped.update({UPSTREAM_COLUMNS[name]: why for name, why in refused.items()})
    stream = torch.cuda.Stream()

    def time_graph(body: Callable[[], None], capture: Callable | None = None) -> float:
        us = time_graph_in_step(body, stream, args.calls, args.replays, gloo, capture)
        ws.check_error()
        return us

    def time_upstream(name: str, x, residual, weight) -> float | None:
        """One of upstream's communicators + norm; None (and why) where it does not take
        this size or fails."""
        fn = upstream.get(name)
        if fn is None:
            return None
        try:
            return time_graph(lambda: fn(x, residual, weight), getattr(fn, "capture", None))
        except Declines as exc:
            notes.append(
                f"{HEADERS[UPSTREAM_COLUMNS[name]]} at {x.shape[0]} tokens: declines {exc}"
            )
        except Exception as exc:  # a baseline failing must not hide our numbers
            skipped[UPSTREAM_COLUMNS[name]] = f"failed: {type(exc).__name__}: {exc}"[:300]
        return None

    rows = []
    try:
        for tokens in tokens_list:
            g = torch.Generator(device="cuda").manual_seed(1000 * rank + tokens)
            x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
            residual = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
            weight = torch.ones(hidden, device="cuda").bfloat16()
            variant, blocks = ws.plan(tokens * hidden * 2)

            def nccl_norm(x=x, residual=residual, weight=weight):
                y = x.clone()
                dist.all_reduce(y)
                add_rmsnorm(y, residual, weight)

            row = {
                "tokens": tokens,
                "bytes": tokens * hidden * 2,
                "variant": sk_config.VARIANT_NAMES[variant],
                "blocks": blocks,
                "floor": time_graph(lambda b=blocks: empty(b)),
                "ours_plain": time_graph(lambda x=x: sk.all_reduce(x, ws)),
                "ours_fused": time_graph(
                    lambda x=x, r=residual, w=weight: sk.fused_allreduce_add_rmsnorm(
                        x, r, w, EPS, ws
                    )
                ),
                "ours_fused_split": time_graph(
                    lambda x=x, r=residual, w=weight: sk.fused_allreduce_add_rmsnorm(
                        x, r, w, EPS, ws_split
                    )
                ),
                "ours_unfused": time_graph(
                    lambda x=x, r=residual, w=weight: add_rmsnorm(sk.all_reduce(x, ws), r, w)
                ),
                "nccl_norm": None if args.skip_baselines else time_graph(nccl_norm),
                "fi_trtllm_fused": _maybe(
                    fi_fused and (lambda x=x, r=residual, w=weight: fi_fused(x, r, w)),
                    time_graph,
                    "fi_trtllm_fused",
                    skipped,
                ),
                "fi_pcie": _maybe(
                    fi_pcie and (lambda x=x: fi_pcie(x)), time_graph, "fi_pcie", skipped
                ),
                "fi_pcie_norm": _maybe(
                    fi_pcie and (lambda x=x, r=residual, w=weight: add_rmsnorm(fi_pcie(x), r, w)),
                    time_graph,
                    "fi_pcie_norm",
                    skipped,
                ),
                **{
                    column: time_upstream(name, x, residual, weight)
                    for name, column in UPSTREAM_COLUMNS.items()
                },
            }
            rows.append(row)
            if rank == 0:
                print(f"  world {world_size} tokens {tokens:5d}: {_fmt_row(row)}", flush=True)
    finally:
        ws.close()
        ws_split.close()
    if rank == 0:
        Path(result_file).write_text(
            json.dumps(
                {
                    "world_size": world_size,
                    "mode": "one process per GPU",
                    "add_rmsnorm": norm_desc,
                    "skipped": skipped,
                    "notes": notes,
                    "rows": rows,
                }
            )
        )
    dist.destroy_process_group()


def _maybe(body, time_graph, name: str, skipped: dict[str, str]) -> float | None:
    if not body:
        return None
    try:
        return time_graph(body)
    except Exception as exc:  # a baseline failing must not hide our numbers
        skipped[name] = f"failed: {type(exc).__name__}: {exc}"[:300]
        return None


def _flashinfer_baselines(rank, args, max_tokens, hidden, gloo, skipped, notes):
    """FlashInfer's trtllm fused kernel and PCIe-IPC all-reduce (tuned by its own tuner first),
    where flashinfer imports."""
    try:
        import flashinfer.comm  # noqa: F401
    except Exception as exc:
        reason = f"n/a (flashinfer not importable: {type(exc).__name__}: {exc})"[:300]
        skipped["fi_trtllm_fused"] = skipped["fi_pcie"] = skipped["fi_pcie_norm"] = reason
        return None, None
    fused = pcie = None
    try:
        fused = flashinfer_trtllm_fused(rank, gloo.size(), max_tokens, hidden, torch.bfloat16)
    except Exception as exc:
        skipped["fi_trtllm_fused"] = f"failed: {type(exc).__name__}: {exc}"[:300]
    try:
        pws, note = flashinfer_pcie_ipc(
            gloo, args.tokens, hidden, torch.bfloat16, repeat=args.fi_tune_repeat
        )
        notes.append(note)

        def pcie(x):
            return pws.all_reduce(x)
    except Exception as exc:
        skipped["fi_pcie"] = skipped["fi_pcie_norm"] = f"failed: {type(exc).__name__}: {exc}"[:300]
    return fused, pcie


def bench_multiprocess(world_size: int, args) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        mp.spawn(
            _mp_worker,
            args=(world_size, str(Path(tmp) / "init"), str(result), args),
            nprocs=world_size,
            join=True,
        )
        return json.loads(result.read_text())


# --------------------------------------------------------------------------------- output


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _fmt_row(row: dict) -> str:
    return "  ".join(f"{HEADERS[c]} {_fmt(row[c])}" for c in COLUMNS if row[c] is not None)


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def best_rival(row: dict) -> tuple[str | None, float | None]:
    """The fastest measured way other than ours to get all-reduce + residual + RMSNorm."""
    measured = [(row[c], c) for c in FUSED_RIVALS if row.get(c) is not None]
    if not measured:
        return None, None
    us, column = min(measured)
    return column, us


def add_ratios(row: dict) -> None:
    """The issue-9 ratios, kept in the JSON row as numbers (None where a column is missing)."""
    column, us = best_rival(row)

    def ratio(a, b):
        return None if a is None or b is None or b == 0 else round(a / b, 3)

    row["best_rival"] = column
    row["ratio_ar_vs_fi_pcie"] = ratio(row["ours_plain"], row.get("fi_pcie"))
    row["ratio_fused_vs_best_rival"] = ratio(row["ours_fused"], us)
    row["ratio_fused_vs_fi_trtllm"] = ratio(row["ours_fused"], row.get("fi_trtllm_fused"))
    row["ratio_fused_vs_ours_unfused"] = ratio(row["ours_fused"], row["ours_unfused"])
    row["ratio_ar_vs_floor"] = ratio(row["ours_plain"], row.get("floor"))
    fused, plain = row["ours_fused"], row["ours_plain"]
    row["fused_minus_ar_us"] = None if fused is None or plain is None else round(fused - plain, 2)


def print_table(result: dict) -> None:
    n = result["world_size"]
    print(f"\n### world size {n} ({result['mode']}), microseconds per call, bf16")
    print(f"separate norm: {result['add_rmsnorm']}")
    header = ["tokens", "KiB", "variant", *[HEADERS[c] for c in COLUMNS]]
    header += ["AR / FI pcie", "fused / best rival", "fused / FI trtllm", "fused / ours AR+norm"]
    header += ["fused - AR us", "AR / floor"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---:|" * len(header))
    for row in result["rows"]:
        add_ratios(row)
        cells = [str(row["tokens"]), f"{row['bytes'] / 1024:.0f}", row["variant"]]
        cells += [_fmt(row.get(c)) for c in COLUMNS]
        rival = HEADERS.get(row["best_rival"], "")
        cells += [
            _ratio(row["ours_plain"], row.get("fi_pcie")),
            _ratio(row["ours_fused"], row.get(row["best_rival"] or ""))
            + (f" ({rival})" if rival else ""),
            _ratio(row["ours_fused"], row.get("fi_trtllm_fused")),
            _ratio(row["ours_fused"], row["ours_unfused"]),
            _fmt(row["fused_minus_ar_us"]),
            _ratio(row["ours_plain"], row.get("floor")),
        ]
        print("| " + " | ".join(cells) + " |")
    for name, reason in result["skipped"].items():
        print(f"- {HEADERS.get(name, name)}: {reason}")
    for note in result.get("notes", []):
        print(f"- {note}")


def plot(results: list[dict], path: Path, machine: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        print(f"no plot: matplotlib unavailable ({exc})")
        return
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        tokens = [r["tokens"] for r in result["rows"]]
        for column in COLUMNS:
            values = [r[column] for r in result["rows"]]
            if any(v is not None for v in values):
                ax.plot(tokens, values, marker="o", label=HEADERS[column])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens (hidden 7168, bf16)")
        ax.set_ylabel("us per call")
        ax.set_title(f"world {result['world_size']}: {result['mode']}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(machine, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def machine_description() -> dict:
    count = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    return {
        "gpus": count,
        "gpu_names": names,
        "capability": list(torch.cuda.get_device_capability(0)),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "python": platform.python_version(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--calls", type=int, default=20, help="calls captured per graph")
    parser.add_argument("--replays", type=int, default=10, help="timed replays per cell")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmark/results"))
    parser.add_argument(
        "--skip-baselines", action="store_true", help="only our kernels (no NCCL, FlashInfer)"
    )
    parser.add_argument(
        "--fi-tune-repeat",
        type=int,
        default=None,
        help="timed iterations per candidate in FlashInfer's PCIe-IPC tune (default: its own, "
        "minutes per token count on some hosts)",
    )
    parser.add_argument(
        "--mode",
        choices=["auto", "local", "multiprocess"],
        default="auto",
        help="auto: one process per GPU when there are enough GPUs, else streams on one GPU",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    machine = machine_description()
    gpus = machine["gpus"]
    sm = "".join(map(str, machine["capability"]))
    print(
        f"machine: {gpus} x {', '.join(machine['gpu_names'])} (sm_{sm}), "
        f"torch {machine['torch']}, CUDA {machine['cuda']}"
    )
    results = []
    started = time.time()
    for n in args.world_sizes:
        use_local = args.mode == "local" or (args.mode == "auto" and gpus < n)
        if use_local:
            print(
                f"world size {n}: ranks share ONE GPU (streams of one process): the numbers are "
                "kernel overhead, not interconnect",
                flush=True,
            )
            results.append(bench_local(n, args.tokens, args.hidden, args))
        else:
            print(f"world size {n}: one process per GPU on {n} GPUs", flush=True)
            results.append(bench_multiprocess(n, args))
    for result in results:
        print_table(result)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    summary = f"{gpus} x {', '.join(machine['gpu_names'])}; " + "; ".join(
        f"world {r['world_size']}: {r['mode']}" for r in results
    )
    payload = {
        "machine": machine,
        "summary": summary,
        "settings": {
            "hidden": args.hidden,
            "calls": args.calls,
            "replays": args.replays,
            "dtype": "bfloat16",
            "env": {
                k: v
                for k, v in os.environ.items()
                if k.startswith(("SGLANG_SM120_", "SGL_KERNEL_SM120_"))
            },
        },
        "elapsed_s": round(time.time() - started, 1),
        "results": results,
    }
    json_path = args.out_dir / "bench_allreduce.json"
    json_path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {json_path}")
    plot(results, args.out_dir / "bench_allreduce.png", summary)


if __name__ == "__main__":
    main()
