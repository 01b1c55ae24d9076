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

import math
from typing import Any

MAX_GPUS = 64
MAX_NODES = 1024
MAX_NAME_CHARS = 96  # NVML's own bound on a device name (NVML_DEVICE_NAME_V2_BUFFER_SIZE)
MAX_TEXT_CHARS = 200
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
    "numa_node": (False, "integer >= 0, or null when unknown"),
    "memory_gib": (False, "number > 0, or null when unknown"),
}


class TopologyError(ValueError):
    """A topology that cannot be used; the message is one line naming the source and field."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_line(value: Any, limit: int) -> bool:
    """A non-empty string that prints as one line (no newline, tab, escape or other control
    character) of at most ``limit`` characters: what the plan and doctor print stays intact."""
    if not isinstance(value, str):
        return False
    return bool(value.strip()) and value.isprintable() and len(value) <= limit


def _unknown_keys(data: dict[str, Any], known: dict[str, tuple[bool, str]], where: str) -> str:
    unknown = sorted(set(data) - set(known))
    if unknown:
        return f"{where}unknown key {unknown[0]!r} (known: {', '.join(known)})"
    missing = [key for key, (required, _) in known.items() if required and key not in data]
    if missing:
        return f"{where}missing required key {missing[0]!r} ({known[missing[0]][1]})"
    return ""


def _gpu_problem(gpu: Any, where: str) -> str:
    if not isinstance(gpu, dict):
        return f"{where} must be an object with 'name' and 'capability', got {_shown(gpu)}"
    problem = _unknown_keys(gpu, GPU_KEYS, f"{where}: ")
    if problem:
        return problem
    name, capability = gpu["name"], gpu["capability"]
    if not _is_line(name, MAX_NAME_CHARS):
        return (
            f"{where}.name must be one printable line of at most {MAX_NAME_CHARS} characters, "
            f"got {_shown(name)}"
        )
    if not (
        isinstance(capability, list) and len(capability) == 2 and all(map(_is_int, capability))
    ):
        return (
            f"{where}.capability must be [major, minor] integers, e.g. [12, 0]; "
            f"got {_shown(capability)}"
        )
    if capability[0] not in CAPABILITY_MAJORS or capability[1] not in CAPABILITY_MINORS:
        return f"{where}.capability {capability} is out of range (major 1..20, minor 0..9)"
    numa = gpu.get("numa_node")
    if numa is not None and not (_is_int(numa) and numa >= 0):
        return f"{where}.numa_node must be an integer >= 0 or null, got {_shown(numa)}"
    memory = gpu.get("memory_gib")
    if memory is not None and not (
        isinstance(memory, (int, float))
        and not isinstance(memory, bool)
        and math.isfinite(memory)
        and memory > 0
    ):
        return f"{where}.memory_gib must be a number > 0 or null, got {_shown(memory)}"
    return ""


def _p2p_problem(p2p: Any, count: int) -> str:
    if p2p in ("all", "none"):
        return ""
    shape = f'\'p2p\' must be "all", "none" or a {count}x{count} matrix of true/false'
    if not isinstance(p2p, list) or len(p2p) != count:
        return f"{shape}, got {_shown(p2p)}"
    for a, row in enumerate(p2p):
        if not isinstance(row, list) or len(row) != count:
            return f"{shape}; row {a} is {_shown(row)}"
        for b, cell in enumerate(row):
            if not isinstance(cell, bool):
                return f"{shape}; p2p[{a}][{b}] is {_shown(cell)}"
    return ""


def topology_problem(data: Any) -> str:
    """The first thing wrong with a parsed topology document, or "" when it is valid."""
    if not isinstance(data, dict):
        return f"a topology must be a JSON object with 'gpus' and 'p2p', got {_shown(data)}"
    problem = _unknown_keys(data, TOPOLOGY_KEYS, "")
    if problem:
        return problem
    gpus = data["gpus"]
    if not isinstance(gpus, list) or len(gpus) > MAX_GPUS:
        return f"'gpus' must be a list of at most {MAX_GPUS} GPU objects, got {_shown(gpus)}"
    for index, gpu in enumerate(gpus):
        problem = _gpu_problem(gpu, f"gpus[{index}]")
        if problem:
            return problem
    problem = _p2p_problem(data["p2p"], len(gpus))
    if problem:
        return problem
    if not isinstance(data.get("nvlink", False), bool):
        return f"'nvlink' must be true or false, got {_shown(data['nvlink'])}"
    nnodes = data.get("nnodes", 1)
    if not (_is_int(nnodes) and 1 <= nnodes <= MAX_NODES):
        return f"'nnodes' must be an integer 1..{MAX_NODES}, got {_shown(nnodes)}"
    for key in ("description", "driver_version", "cuda_driver_version"):
        if key in data and not _is_line(data[key], MAX_TEXT_CHARS):
            return (
                f"'{key}' must be one printable line of at most {MAX_TEXT_CHARS} characters, "
                f"got {_shown(data[key])}"
            )
    return ""


def check_topology(data: Any, source: str) -> None:
    """Raise TopologyError("<source>: <problem>") unless ``data`` follows the schema."""
    problem = topology_problem(data)
    if problem:
        raise TopologyError(f"{source}: {problem}")
