"""The topology document: what a machine profile or ``--topology FILE`` may say, checked here.

A topology describes one node's GPUs so that a machine you are not on can be planned (and tests
can fake hardware). The embedded profiles (``profiles/*.json``) are examples of the format::

    {
      "description": "2x GeForce RTX 5090 on PCIe without P2P",
      "nnodes": 1, "nvlink": false, "p2p": "none",
      "gpus": [{"name": "NVIDIA GeForce RTX 5090", "capability": [12, 0],
                "numa_node": 0, "memory_gib": 32.0}, ...]
    }

The schema is the data below (``TOPOLOGY_KEYS``, ``GPU_KEYS``): types, ranges, which keys are
required. ``p2p`` is required on purpose: assuming peer access that a GeForce driver does not
give would plan a backend that hangs, so a file must say it. Unknown keys are refused, so a typo
("nvlinks") cannot silently fall back to a default. Every problem is a ``TopologyError`` with
one line naming the source and the field.
"""

from __future__ import annotations

from typing import Any

from sglang_sm120.strict_json import FieldError, field_path, fields, require, shown

MAX_GPUS = 64
MAX_NODES = 1024
MAX_TP_SIZE = MAX_GPUS * MAX_NODES  # the most ranks a deployment of these nodes has
MAX_NAME_CHARS = 96  # NVML's own bound on a device name (NVML_DEVICE_NAME_V2_BUFFER_SIZE)
MAX_TEXT_CHARS = 200
MAX_NUMA_NODE = 1023  # Linux numbers at most 1024 NUMA nodes (CONFIG_NODES_SHIFT <= 10)
MAX_MEMORY_GIB = 1 << 20  # 1 PiB: far above any GPU, far below what breaks arithmetic
CAPABILITY_MAJORS = range(1, 21)
CAPABILITY_MINORS = range(10)

#: key -> (required, what it holds); the tables of docs/topology.md follow this.
TOPOLOGY_KEYS: dict[str, tuple[bool, str]] = {
    "gpus": (True, f"list of 0..{MAX_GPUS} GPU objects, in CUDA order ([]: a host without GPU)"),
    "p2p": (True, '"all", "none", or an N x N matrix of true/false (row a, column b: a -> b)'),
    "nvlink": (False, "true if any GPU has an active NVLink (default false)"),
    "nnodes": (False, f"nodes of this kind in the deployment, 1..{MAX_NODES} (default 1)"),
    "description": (False, f"one line of at most {MAX_TEXT_CHARS} characters, shown by `profiles`"),
    "driver_version": (False, 'NVIDIA driver version string, e.g. "580.95.05"'),
    "cuda_driver_version": (False, 'CUDA driver API version string, e.g. "13.0"'),
}
GPU_KEYS: dict[str, tuple[bool, str]] = {
    "name": (
        True,
        f"one printable line of at most {MAX_NAME_CHARS} characters, "
        'e.g. "NVIDIA RTX PRO 6000 Blackwell Server Edition"',
    ),
    "capability": (True, "[major, minor] integers, e.g. [12, 0] for SM120"),
    "numa_node": (False, f"integer 0..{MAX_NUMA_NODE}, or null when unknown"),
    "memory_gib": (False, f"number > 0 and <= {MAX_MEMORY_GIB}, or null when unknown"),
}


class TopologyError(ValueError):
    """A topology that cannot be used; the message is one line naming the source and field."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _line(data: dict[str, Any], key: str, where: str, limit: int) -> None:
    """A non-empty string that prints as one line (no newline, tab, escape or other control
    character) of at most ``limit`` characters: what the plan and doctor print stays intact."""
    value = data[key]
    if not (isinstance(value, str) and value.strip() and value.isprintable()):
        value = None  # refused below, with the value shown
    if value is None or len(value) > limit:
        raise FieldError(
            f"{field_path(where, key)} must be one printable line of at most {limit} "
            f"characters, got {shown(data[key])}"
        )


def _keys(data: Any, known: dict[str, tuple[bool, str]], where: str) -> dict[str, Any]:
    data = fields(data, where, known=known)
    missing = [key for key, (required, _) in known.items() if required and key not in data]
    if missing:
        at = f"{where}: " if where else ""
        raise FieldError(f"{at}missing required key {missing[0]!r} ({known[missing[0]][1]})")
    return data


def _check_gpu(gpu: Any, where: str) -> None:
    if not isinstance(gpu, dict):
        raise FieldError(
            f"{where} must be an object with 'name' and 'capability', got {shown(gpu)}"
        )
    _keys(gpu, GPU_KEYS, where)
    _line(gpu, "name", where, MAX_NAME_CHARS)
    capability = gpu["capability"]
    if not (
        isinstance(capability, list) and len(capability) == 2 and all(map(_is_int, capability))
    ):
        raise FieldError(
            f"{where}.capability must be [major, minor] integers, e.g. [12, 0]; "
            f"got {shown(capability)}"
        )
    if capability[0] not in CAPABILITY_MAJORS or capability[1] not in CAPABILITY_MINORS:
        raise FieldError(
            f"{where}.capability {capability} is out of range (major 1..20, minor 0..9)"
        )
    require(gpu, "numa_node", int, where, minimum=0, maximum=MAX_NUMA_NODE, null=True, default=None)
    require(
        gpu, "memory_gib", float, where, above=0, maximum=MAX_MEMORY_GIB, null=True, default=None
    )


def _check_p2p(p2p: Any, count: int) -> None:
    if p2p in ("all", "none"):
        return
    shape = f'\'p2p\' must be "all", "none" or a {count}x{count} matrix of true/false'
    if not isinstance(p2p, list) or len(p2p) != count:
        raise FieldError(f"{shape}, got {shown(p2p)}")
    for a, row in enumerate(p2p):
        if not isinstance(row, list) or len(row) != count:
            raise FieldError(f"{shape}; row {a} is {shown(row)}")
        for b, cell in enumerate(row):
            if not isinstance(cell, bool):
                raise FieldError(f"{shape}; p2p[{a}][{b}] is {shown(cell)}")


def _check(data: Any) -> None:
    if not isinstance(data, dict):
        raise FieldError(
            f"a topology must be a JSON object with 'gpus' and 'p2p', got {shown(data)}"
        )
    _keys(data, TOPOLOGY_KEYS, "")
    gpus = require(data, "gpus", list, limit=MAX_GPUS)
    for index, gpu in enumerate(gpus):
        _check_gpu(gpu, f"gpus[{index}]")
    _check_p2p(data["p2p"], len(gpus))
    require(data, "nvlink", bool, default=False)
    require(data, "nnodes", int, minimum=1, maximum=MAX_NODES, default=1)
    for key in ("description", "driver_version", "cuda_driver_version"):
        if key in data:
            _line(data, key, "", MAX_TEXT_CHARS)


def topology_problem(data: Any) -> str:
    """The first thing wrong with a parsed topology document, or "" when it is valid."""
    try:
        _check(data)
    except FieldError as exc:
        return str(exc)
    return ""


def check_topology(data: Any, source: str) -> None:
    """Raise TopologyError("<source>: <problem>") unless ``data`` follows the schema."""
    problem = topology_problem(data)
    if problem:
        raise TopologyError(f"{source}: {problem}")
