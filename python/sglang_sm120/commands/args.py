"""What the commands share: bad input as one line (``UsageError``, ``one_line``, ``Parser``), the
argument types, the deployment flags of ``doctor`` and ``plan`` and the check of SGLang's own
flag choices."""

from __future__ import annotations

import argparse
import importlib.util
import re
from typing import NoReturn

from sglang_sm120.machine.facts import HostFacts
from sglang_sm120.machine.topology import MAX_GPUS, MAX_NODES, MAX_TP_SIZE
from sglang_sm120.planning.policy import PLUGIN_BACKEND_CHOICES, PLUGIN_BACKEND_ENV, Deployment
from sglang_sm120.planning.upstream import FLAG_CHOICES
from sglang_sm120.version import SGLANG_PIN, __version__


class UsageError(ValueError):
    """Input the command cannot use; main() prints it as one line and exits 2."""


def one_line(text: str) -> str:
    """``text`` as one printable line: a newline or other control character a user typed (in a
    path, a flag value) is shown escaped, as repr() shows it, instead of breaking the line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (no usage block), still exit status 2."""

    commands: tuple[str, ...] = ()  # the subcommands, for "a command is required"

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {one_line(message)} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    try:
        if not text.isascii():  # int() reads other scripts' digits ('٨' is 8); SGLang does not
            raise ValueError(text)
        value = int(text)
    except ValueError:  # also past Python's 4300 digits
        shown = repr(text) if len(text) <= 40 else repr(text[:37] + "...")
        raise argparse.ArgumentTypeError(f"{shown} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _at_most(text: str, maximum: int, what: str) -> int:
    value = positive_int(text)
    if value > maximum:
        raise argparse.ArgumentTypeError(
            f"{value} is above {maximum}, the most {what} a deployment may have here"
        )
    return value


def stage_count(text: str) -> int:
    """--pp-size: 1..MAX_TP_SIZE (each stage has at least one rank)."""
    return _at_most(text, MAX_TP_SIZE, "ranks")


def node_count(text: str) -> int:
    """--nnodes: 1..MAX_NODES, the topology schema's own bound."""
    return _at_most(text, MAX_NODES, "nodes")


#: --dtype: the dtype the model runs in, as the plan compares it; SGLang's aliases map to it.
DTYPES = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float32": "float32",
    "half": "float16",
    "float": "float32",
}


def model_dtype(text: str) -> str:
    if text == "auto":
        raise argparse.ArgumentTypeError(
            "'auto' is SGLang's choice from the model's config, which doctor and plan do not "
            "read; give the dtype it resolves to (bfloat16, float16 or float32)"
        )
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r} is not a model dtype ({', '.join(DTYPES)})"
        )
    return DTYPES[text]


def model_arch(text: str) -> str:
    """A config.json architecture: a Python class name, e.g. DeepseekV3ForCausalLM."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,99}", text):
        raise argparse.ArgumentTypeError(
            f"{text[:60]!r} is not an architecture class name such as "
            "KimiK25ForConditionalGeneration (config.json's architectures[0])"
        )
    return text


#: flags doctor and plan take as SGLang's: ours -> theirs (their choices: planning.upstream)
UPSTREAM_FLAGS = {
    "fusion_backend": "--flashinfer-allreduce-fusion-backend",
    "moe_a2a_backend": "--moe-a2a-backend",
}


def check_ranks_divide(tp_size: int, pp_size: int, nnodes: int) -> None:
    """SGLang asserts that tp x pp ranks divide over the nodes (arg_groups/validation_hook.py
    ``check_server_args``)."""
    if (tp_size * pp_size) % nnodes:
        raise UsageError(
            f"--tp {tp_size} x --pp-size {pp_size} = {tp_size * pp_size} ranks do not "
            f"divide over --nnodes {nnodes} (SGLang refuses it)"
        )


def check_upstream_flags(args: argparse.Namespace) -> None:
    """A value SGLang would refuse is not planned as if it meant something (doctor without
    --tp plans every GPU here: its ranks are checked when the deployment is built)."""
    if args.tp is not None:
        check_ranks_divide(args.tp, args.pp_size, args.nnodes)
    for name, flag in UPSTREAM_FLAGS.items():
        value = getattr(args, name)
        choices = FLAG_CHOICES[flag]
        if value is not None and value not in choices:
            raise UsageError(
                f"--{name.replace('_', '-')} {value[:40]!r} is not one of SGLang's choices "
                f"({', '.join(choices)})"
            )


def compute_capability(text: str) -> tuple[int, int]:
    """'12.0' or '12' -> (12, 0)."""
    match = re.fullmatch(r"(\d{1,2})(?:\.(\d))?", text.strip(), re.ASCII)
    if not match or not 1 <= int(match[1]) <= 20:
        raise argparse.ArgumentTypeError(f"{text!r} is not a compute capability such as 12.0")
    return int(match[1]), int(match[2] or 0)


def require_sglang() -> None:
    """doctor reports on SGLang's processes, so sglang must be installed; say so in one line.
    Found, not imported: a doctor whose checks are cached imports no SGLang at all."""
    if importlib.util.find_spec("sglang") is None:
        raise UsageError(
            f"sglang is not installed; sglang-sm120 {__version__} needs "
            f"sglang=={SGLANG_PIN} (pip install sglang=={SGLANG_PIN})"
        )


def _shape(tp_size: int, pp_size: int) -> str:
    """The flags a rank count came from, as a refusal names them."""
    return f"--tp {tp_size}" + (f" x --pp-size {pp_size}" if pp_size > 1 else "")


def check_rank_count(tp_size: int, pp_size: int = 1) -> None:
    """tp x pp ranks are at most MAX_TP_SIZE, what a deployment of the largest topology has
    (so no plan lists more GPUs than any machine has, whether or not this one has a GPU)."""
    if tp_size * pp_size > MAX_TP_SIZE:
        shape = _shape(tp_size, pp_size)
        raise UsageError(
            f"{shape} = {tp_size * pp_size} ranks, above {MAX_TP_SIZE}: the most a deployment "
            f"of {MAX_NODES} nodes of {MAX_GPUS} GPUs has"
        )


def check_tp(facts: HostFacts, tp_size: int, nnodes: int, pp_size: int = 1) -> None:
    """A deployment's ranks (a TP group per PP stage) cannot be more than the GPUs they would
    run on: ``--tp 8 --pp-size 2`` needs 16, as ``--tp 16`` does."""
    check_rank_count(tp_size, pp_size)
    ranks = tp_size * pp_size
    available = len(facts.gpus) * nnodes
    if ranks > available:
        shape = _shape(tp_size, pp_size)
        raise UsageError(
            f"{shape} needs {ranks} GPU{'s' if ranks > 1 else ''}; "
            f"{facts.source} has {len(facts.gpus)}"
            + (f" x {nnodes} nodes" if nnodes > 1 else "")
            + " (pass --nnodes for a multi-node deployment)"
        )


def add_deployment_args(parser: argparse.ArgumentParser, tp_required: bool) -> None:
    parser.add_argument(
        "--tp",
        type=positive_int,
        required=tp_required,
        help="tensor-parallel size" + ("" if tp_required else " (default: every GPU here)"),
    )
    parser.add_argument(
        "--model-arch",
        type=model_arch,
        help="the model's architecture (config.json), e.g. KimiK25ForConditionalGeneration",
    )
    parser.add_argument(
        "--nnodes",
        type=node_count,
        default=1,
        help=f"as SGLang's --nnodes (default 1, at most {MAX_NODES})",
    )
    parser.add_argument(
        "--pp-size",
        type=stage_count,
        default=1,
        help="as SGLang's --pp-size (default 1); with --nnodes, PP stages across nodes keep a "
        "TP group on one node",
    )
    parser.add_argument(
        "--attention-dp", action="store_true", help="as SGLang's --enable-dp-attention"
    )
    parser.add_argument(
        "--moe-a2a-backend", default="none", help="as SGLang's --moe-a2a-backend (default none)"
    )
    parser.add_argument(
        "--dtype",
        type=model_dtype,
        default="bfloat16",
        help="the dtype the model runs in: bfloat16 (default), float16 (half) or float32 (float)",
    )
    parser.add_argument(
        "--fusion-backend", help="as --flashinfer-allreduce-fusion-backend (auto, trtllm, ...)"
    )
    parser.add_argument(
        "--enforce-disable-fusion",
        action="store_true",
        help="as SGLang's --enforce-disable-flashinfer-allreduce-fusion",
    )
    parser.add_argument(
        "--disable-custom-all-reduce",
        action="store_true",
        help="as SGLang's flag (at TP2 or with NVLink it takes the points fusion declines)",
    )
    for flag, what in (
        ("--enable-mscclpp", "the plan then routes the sizes MSCCL++ takes to it"),
        ("--enable-torch-symm-mem", "the plan then routes the sizes it takes to it"),
        ("--enable-symm-mem", "NCCL symmetric memory: the plan turns no upstream switch on"),
    ):
        parser.add_argument(flag, action="store_true", help=f"as SGLang's flag ({what})")
    parser.add_argument(
        "--plugin-backend",
        choices=PLUGIN_BACKEND_CHOICES,
        help=f"as {PLUGIN_BACKEND_ENV} (default: that variable)",
    )
    parser.add_argument(
        "--hidden",
        type=positive_int,
        default=7168,
        help="the model's hidden size, to pick the tuning table (default 7168)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (for a program)")


def deployment_from_args(args: argparse.Namespace, tp_size: int) -> Deployment:
    from sglang_sm120.server.runtime import pcie_ipc_env, plugin_backend, validation_mode

    check_ranks_divide(tp_size, args.pp_size, args.nnodes)
    chosen = args.plugin_backend or plugin_backend()
    return Deployment(
        tp_size=tp_size,
        nnodes=args.nnodes,
        pp_size=args.pp_size,
        attention_dp=args.attention_dp,
        moe_a2a_backend=args.moe_a2a_backend,
        model_arch=args.model_arch,
        dtype=args.dtype,
        fusion_backend_flag=args.fusion_backend,
        enforce_disable_fusion=args.enforce_disable_fusion,
        pcie_ipc_env=pcie_ipc_env(),
        plugin_backend=None if chosen == "auto" else chosen,
        custom_all_reduce=not args.disable_custom_all_reduce,
        enable_mscclpp=args.enable_mscclpp,
        enable_torch_symm_mem=args.enable_torch_symm_mem,
        enable_symm_mem=args.enable_symm_mem,
        any_arch=validation_mode(),
    )


def gpu_list(text: str) -> tuple[int, ...]:
    """'0,1,3' -> (0, 1, 3): distinct CUDA indices."""
    try:
        if not text.isascii():
            raise ValueError(text)
        gpus = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of GPU indices") from None
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"{text!r}: GPU indices must be distinct and >= 0")
    return gpus
