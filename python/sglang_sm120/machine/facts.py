"""Facts: one frozen description of the GPUs this process sees, and the software around them.

Everything downstream (policy, patches, CLI) reads these facts and never probes the hardware
itself. Facts come from one of three places, in this order:

1. ``SGLANG_SM120_TOPOLOGY``: a topology JSON file path, or the name of an embedded profile
   (``python/sglang_sm120/machine/profiles/*.json``), for planning a machine you are not on and
   for tests;
2. NVML (``nvidia-ml-py``), which answers without creating a CUDA context, so the launcher can
   ask before it spawns its workers;
3. nothing: no NVIDIA driver or no GPU, reported as such (zero GPUs), never an exception.

Example::

    facts = load_profile("rtx-pro-6000-x8-pcie")
    facts.all_pairs_p2p(range(8)), facts.has_nvlink  # (True, False)
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from sglang_sm120.env_values import ascii_digits, printable, shown
from sglang_sm120.machine.topology import TopologyError, check_topology
from sglang_sm120.strict_json import read_json_file, read_regular_file

TOPOLOGY_ENV = "SGLANG_SM120_TOPOLOGY"
# A topology of 64 GPUs with a full P2P matrix takes ~25 KiB; anything near this is not one.
TOPOLOGY_MAX_BYTES = 1 << 20
_PROFILE_PACKAGE = "sglang_sm120.machine.profiles"
_VERSIONED_PACKAGES = (
    "sglang",
    "sglang-kernel",
    "flashinfer-python",
    "torch",
    "sgl-kernel-sm120",
    "nvidia-cuda-runtime",
)
KERNEL_NOT_INSTALLED = (
    "sgl-kernel-sm120 is not installed (pip install sgl-kernel-sm120; from a checkout: "
    "pip install ./sgl-kernel-sm120, which needs nvcc >= 12.8)"
)


@dataclass(frozen=True)
class GpuInfo:
    """One visible GPU, as CUDA numbers it in this process."""

    index: int
    name: str
    capability: tuple[int, int]
    numa_node: int | None = None
    memory_gib: float | None = None

    @property
    def sm(self) -> int:
        return self.capability[0] * 10 + self.capability[1]


@dataclass(frozen=True)
class HostFacts:
    """The hardware and software this process runs on (or a profile of another machine)."""

    source: str
    gpus: tuple[GpuInfo, ...] = ()
    p2p: tuple[tuple[bool, ...], ...] = ()
    has_nvlink: bool = False
    nnodes: int = 1
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    versions: dict[str, str | None] = field(default_factory=dict)
    probe_error: str | None = None
    # Why sgl-kernel-sm120 cannot serve this process (``sm120_kernel_problem()``); None: it loads.
    sm120_kernel_problem: str | None = KERNEL_NOT_INSTALLED

    def gpus_at(self, indices: Iterable[int]) -> tuple[GpuInfo, ...]:
        """The GPUs with these CUDA indices, in that order; indices past the last GPU are left
        out (the caller compares lengths to say that too few GPUs are visible)."""
        return tuple(self.gpus[i] for i in indices if 0 <= i < len(self.gpus))

    def missing_p2p_pairs(self, indices: Iterable[int]) -> list[tuple[int, int]]:
        """Pairs among ``indices`` that cannot access each other's memory directly."""
        chosen = list(indices)
        return [
            (a, b)
            for pos, a in enumerate(chosen)
            for b in chosen[pos + 1 :]
            if not (self.p2p[a][b] and self.p2p[b][a])
        ]

    def all_pairs_p2p(self, indices: Iterable[int]) -> bool:
        return not self.missing_p2p_pairs(indices)

    def numa_nodes(self, indices: Iterable[int]) -> list[int]:
        return sorted({g.numa_node for g in self.gpus if g.index in set(indices)} - {None})

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["gpus"] = [{**asdict(g), "sm": g.sm} for g in self.gpus]
        return data


@functools.cache
def sm120_kernel_problem() -> str | None:
    """Why sgl-kernel-sm120 cannot serve this process, or None when it can. "Installed" means
    its compiled library loads, as the kernels load it (a package whose library is missing or
    of another ABI would have every rank fail to build its workspace). Decided once per
    process, the same way in the launcher, the workers and doctor."""
    try:
        from sgl_kernel_sm120 import _lib
    except ImportError:
        return KERNEL_NOT_INSTALLED
    try:
        _lib.lib()
    except Exception as exc:  # LibraryError (missing, stale ABI), OSError (dlopen), ...
        try:
            version = metadata.version("sgl-kernel-sm120")
        except metadata.PackageNotFoundError:
            version = "(from sources)"
        # the message names the library's path, which $SGLANG_SM120_KERNEL_LIBRARY may have
        # filled with any bytes
        return (
            f"sgl-kernel-sm120 {version} is installed, but its library does not load: "
            f"{printable(str(exc))}"
        )
    return None


def _package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in _VERSIONED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def facts_from_json(data: Any, source: str) -> HostFacts:
    """Build facts from a topology document (schema in ``topology.py``; the embedded profiles
    are examples). Raises TopologyError, one line naming the source and the field."""
    check_topology(data, source)
    gpus = tuple(
        GpuInfo(
            index=i,
            name=g["name"],
            capability=(g["capability"][0], g["capability"][1]),
            numa_node=g.get("numa_node"),
            memory_gib=g.get("memory_gib"),
        )
        for i, g in enumerate(data["gpus"])
    )
    if data["p2p"] == "all":
        p2p = tuple(tuple(True for _ in gpus) for _ in gpus)
    elif data["p2p"] == "none":
        p2p = tuple(tuple(a == b for b in range(len(gpus))) for a in range(len(gpus)))
    else:
        p2p = tuple(tuple(row) for row in data["p2p"])
    return HostFacts(
        source=source,
        gpus=gpus,
        p2p=p2p,
        has_nvlink=data.get("nvlink", False),
        nnodes=data.get("nnodes", 1),
        driver_version=data.get("driver_version"),
        cuda_driver_version=data.get("cuda_driver_version"),
        versions=_package_versions(),
        sm120_kernel_problem=sm120_kernel_problem(),
    )


def profile_names() -> list[str]:
    files = resources.files(_PROFILE_PACKAGE).iterdir()
    return sorted(f.name.removesuffix(".json") for f in files if f.name.endswith(".json"))


def _profile_document(name: str) -> dict[str, Any]:
    if name not in profile_names():
        raise TopologyError(
            f"unknown profile {name!r}; embedded profiles: {', '.join(profile_names())}"
        )
    return json.loads(resources.files(_PROFILE_PACKAGE).joinpath(f"{name}.json").read_text())


def profile_descriptions() -> dict[str, str]:
    """Embedded profile name -> its one-line description."""
    return {name: _profile_document(name).get("description", "") for name in profile_names()}


def load_profile(name: str) -> HostFacts:
    """An embedded machine profile by name (see ``profile_names()``)."""
    return facts_from_json(_profile_document(name), source=f"profile:{name}")


def load_topology(path: str | os.PathLike[str]) -> HostFacts:
    """A topology JSON file describing another machine (a regular file of at most
    TOPOLOGY_MAX_BYTES, strict JSON: ``strict_json``)."""
    try:
        data = read_json_file(path, TOPOLOGY_MAX_BYTES)
    except (ValueError, RecursionError) as exc:
        reason = exc if str(exc) else type(exc).__name__
        raise TopologyError(f"cannot read topology file {path}: {reason}") from None
    return facts_from_json(data, source=f"file:{path}")


def visible_nvml_indices(count: int, nvml: Any) -> list[int]:
    """NVML numbers GPUs physically; CUDA_VISIBLE_DEVICES picks and orders what CUDA sees."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    chosen: list[int] = []
    for token in (t.strip() for t in visible.split(",")):
        if not token:
            break
        if ascii_digits(token):  # as CUDA reads it: '٨' is a UUID prefix, not GPU 8
            if int(token) >= count:
                break
            chosen.append(int(token))
            continue
        matches = [
            i
            for i in range(count)
            if _text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))).startswith(token)
        ]
        if not matches:
            break
        chosen.append(matches[0])
    return chosen


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def sysfs_bus_id(nvml_bus_id: Any) -> str:
    """NVML's PCI bus id ('00000000:03:00.0', 8-digit domain) as sysfs names it ('0000:03:00.0')."""
    bus_id = _text(nvml_bus_id).lower()
    return bus_id[-12:] if len(bus_id) > 12 else bus_id


def _numa_node(nvml: Any, handle: Any) -> int | None:
    sysfs_id = sysfs_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId)
    try:  # bounded, regular files only (strict_json): sysfs is read like every other input
        node = int(read_regular_file(f"/sys/bus/pci/devices/{sysfs_id}/numa_node", 64))
    except ValueError:  # UnreadableFile, or not a number
        return None
    return node if node >= 0 else None


def _has_nvlink(nvml: Any, handle: Any) -> bool:
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) == nvml.NVML_FEATURE_ENABLED:
                return True
        except nvml.NVMLError:
            continue
    return False


def _p2p_ok(nvml: Any, a: Any, b: Any) -> bool:
    """Both directions of peer reads and writes: the push kernels need writes, tuning reads."""
    for cap in (nvml.NVML_P2P_CAPS_INDEX_READ, nvml.NVML_P2P_CAPS_INDEX_WRITE):
        try:
            if nvml.nvmlDeviceGetP2PStatus(a, b, cap) != nvml.NVML_P2P_STATUS_OK:
                return False
        except nvml.NVMLError:
            return False
    return True


def probe_host() -> HostFacts:
    """Read this machine through NVML. Never raises: failures are recorded in ``probe_error``."""
    software = {"versions": _package_versions(), "sm120_kernel_problem": sm120_kernel_problem()}
    try:
        import pynvml as nvml
    except ImportError:
        return HostFacts(source="nvml", probe_error="nvidia-ml-py is not installed", **software)
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return HostFacts(source="nvml", probe_error=f"NVML unavailable: {exc}", **software)
    try:
        indices = visible_nvml_indices(nvml.nvmlDeviceGetCount(), nvml)
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        gpus = tuple(
            GpuInfo(
                index=pos,
                name=_text(nvml.nvmlDeviceGetName(h)),
                capability=tuple(nvml.nvmlDeviceGetCudaComputeCapability(h)),
                numa_node=_numa_node(nvml, h),
                memory_gib=round(nvml.nvmlDeviceGetMemoryInfo(h).total / 2**30, 1),
            )
            for pos, h in enumerate(handles)
        )
        p2p = tuple(tuple(a is b or _p2p_ok(nvml, a, b) for b in handles) for a in handles)
        cuda_driver = nvml.nvmlSystemGetCudaDriverVersion()
        return HostFacts(
            source="nvml",
            gpus=gpus,
            p2p=p2p,
            has_nvlink=any(_has_nvlink(nvml, h) for h in handles),
            driver_version=_text(nvml.nvmlSystemGetDriverVersion()),
            cuda_driver_version=f"{cuda_driver // 1000}.{cuda_driver % 1000 // 10}",
            **software,
        )
    except Exception as exc:
        return HostFacts(source="nvml", probe_error=f"NVML query failed: {exc}", **software)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def facts_from_spec(spec: str) -> HostFacts:
    """A profile name or a topology file path; TopologyError when it is neither."""
    if spec in profile_names():
        return load_profile(spec)
    try:
        exists = Path(spec).exists()
    except (OSError, ValueError) as exc:  # a name too long for the file system, a NUL
        problem = exc.strerror or str(exc)
        raise TopologyError(f"{shown(spec)} is no usable file name ({problem})") from None
    if not exists:
        raise TopologyError(
            f"{shown(spec)} is neither an embedded profile ({', '.join(profile_names())}) "
            "nor an existing topology JSON file"
        )
    return load_topology(spec)


@functools.cache
def current_facts() -> HostFacts:
    """The facts for this process, read once: ``SGLANG_SM120_TOPOLOGY`` if set, else NVML.

    A bad ``SGLANG_SM120_TOPOLOGY`` raises TopologyError naming the variable."""
    spec = os.environ.get(TOPOLOGY_ENV)
    if not spec:
        return probe_host()
    try:
        return facts_from_spec(spec)
    except TopologyError as exc:
        raise TopologyError(f"{TOPOLOGY_ENV}: {exc}") from None


def describe_gpus(gpus: Sequence[GpuInfo]) -> str:
    """'8x NVIDIA RTX PRO 6000 (SM120)' or a comma list when they differ."""
    if not gpus:
        return "no GPU"
    kinds = sorted({(g.name, g.sm) for g in gpus})
    if len(kinds) == 1:
        name, sm = kinds[0]
        return f"{len(gpus)}x {name} (SM{sm})"
    return ", ".join(f"GPU{g.index} {g.name} (SM{g.sm})" for g in gpus)
