"""Host checks: the PCIe host settings that decide whether, and how fast, GPUs reach each other.

On 8-GPU PCIe boxes the largest losses and the hangs come from the host, not from kernels: the
driver staging P2P through system memory, ACS redirect and IOMMU translation sending P2P
through the root complex, downtrained links, a BAR1 window too small for the IPC buffers,
cross-socket pairs. Each check here reads its evidence (a sysfs/procfs file or an NVML call),
says ok / warn / fail / unknown, and names the fix. Facts-level: nothing is decided here
(``policy.py`` turns findings into plan reasons) and no host setting is ever changed.

    iommu        /sys/class/iommu, /proc/cmdline, the GPUs' iommu_group/type
    acs          ACS control of the PCIe bridges above each GPU (sysfs config space)
    p2p_driver   /proc/driver/nvidia/params RegistryDwords, how the GPUs attach (sysfs),
                 NVML P2P status, and the measured ``sglang-sm120 p2p`` probe when cached
    pcie_link    NVML link generation and width, current against maximum
    bar1         NVML BAR1 size against what the IPC workspaces need at this TP
    topology     NVML common ancestor of each pair (one switch ... cross-socket)
    persistence  NVML persistence mode

sysfs and procfs are read below one root, ``SGLANG_SM120_SYSFS_ROOT`` (default ``/``), so tests
and other machines' dumps are read like this one (``test/fixtures/hosts/<case>/``). A root that
cannot be one (missing, a file, empty, a name with control characters or not UTF-8) makes every
check ``unknown`` naming the variable. Every file is read through ``strict_json.
read_regular_file``: regular files only, opened non-blocking, a few KiB at most, so a FIFO or a
link to /dev/zero in a dump cannot hang or grow a check. A file or directory that cannot be read
makes its check ``unknown (reason)``, never "off". NVML is a parameter: a pynvml-like module
(tests pass a fake of the hardware); every call is wrapped, an NVMLError or a function missing
from an older nvidia-ml-py makes that check ``unknown``.

The checks judge the TP group's GPUs only (``gpu_ids``, CUDA indices; default every visible GPU),
and each finding says which: GPUs 2,3 on root ports are no finding for a server on GPUs 0,1.

Example::

    checks = run_host_checks(tp=8, hidden=7168)
    [(c.name, c.status) for c in checks]   # [("iommu", "ok"), ("acs", "fail"), ...]
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sglang_sm120.machine.facts import sysfs_bus_id, visible_nvml_indices
from sglang_sm120.machine.topology import MAX_GPUS
from sglang_sm120.strict_json import (
    UnreadableFile,
    fields,
    read_regular_file,
    require,
    require_list,
)

SYSFS_ROOT_ENV = "SGLANG_SM120_SYSFS_ROOT"
OK, WARN, FAIL, UNKNOWN = "ok", "warn", "fail", "unknown"
CHECK_NAMES = ("iommu", "acs", "p2p_driver", "pcie_link", "bar1", "topology", "persistence")

# The decode width the IPC workspaces are sized for when the server's is unknown: the plugin's
# own fallback (patches/sm120_pcie_backend.py FALLBACK_ROWS), e.g. max_bs 64 x 4 draft tokens.
DEFAULT_DECODE_ROWS = 256
TRTLLM_ROWS = 2048  # SGLang sizes FlashInfer's trtllm fusion workspace for 2048 tokens

# Staged through system memory, peer writes reach ~1/15 of a Gen5 x16 link (53-56 GB/s direct).
STAGED_BELOW_GBPS = 10.0

FORCE_P2P_FIX = (
    'options nvidia NVreg_RegistryDwords="ForceP2P=0x11;GrdmaPciTopoCheckOverride=1;'
    'EnableResizableBar=1" in /etc/modprobe.d/nvidia-p2p.conf, rebuild the initramfs, reboot '
    "(check: grep RegistryDwords /proc/driver/nvidia/params)"
)

# ACS (PCIe Access Control Services) extended capability and its control-register bits.
ACS_CAP_ID = 0x000D
ACS_SOURCE_VALIDATION = 0x01
ACS_P2P_REQUEST_REDIRECT = 0x04
ACS_P2P_COMPLETION_REDIRECT = 0x08
ACS_UPSTREAM_FORWARDING = 0x10
ACS_REDIRECT = ACS_P2P_REQUEST_REDIRECT | ACS_P2P_COMPLETION_REDIRECT
EXTENDED_CONFIG_START = 0x100

# nvmlDeviceGetTopologyCommonAncestor's answers, as nvidia-smi topo -m labels them.
TOPOLOGY_LABELS = {0: "BRD", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
TOPOLOGY_LEGEND = (
    "BRD one board, PIX one PCIe switch, PXB several switches, PHB one host bridge, "
    "NODE one socket across host bridges, SYS across sockets"
)
CROSS_SOCKET = 50

# The most read of each file: a PCI Express function's whole config space, a small sysfs/procfs
# text file (vendor, class, iommu group type; /proc/cmdline is at most 4096 bytes on x86), and
# /proc/driver/nvidia/params (~2 KiB with every key).
CONFIG_SPACE_BYTES = 4096
SMALL_FILE_BYTES = 4096
PARAMS_BYTES = 64 << 10
# NVML performance states up to P2 run work (P0 full, P2 compute); an idle GPU sits at P8 and
# lowers its link generation to save power until traffic starts.
BUSY_PSTATE = 2

_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


@dataclass(frozen=True)
class HostCheck:
    """One host check: its status, what it found, how to fix it, and where it looked."""

    name: str
    status: str
    detail: str
    fix: str = ""
    evidence: str = ""
    matrix: tuple[tuple[str, ...], ...] = ()  # topology: one row of labels per GPU
    gpus: tuple[int, ...] = ()  # the GPUs (CUDA indices) judged: the matrix's rows

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["matrix"] = [list(row) for row in self.matrix]
        data["gpus"] = list(self.gpus)
        return data


@dataclass(frozen=True)
class P2PSummary:
    """What ``sglang-sm120 p2p`` measured here (p2p_probe.py has the arithmetic).

    Bandwidths are GB/s at the largest size, the median over ordered pairs, one pair at a time;
    latencies are microseconds per smallest copy. Ratios compare every GPU moving data to every
    peer at once with the links' worth (GPUs x one pair's bandwidth): 1.0 is every link full."""

    gpus: tuple[int, ...]
    pair_write_gbps: float
    pair_read_gbps: float
    write_latency_us: float
    read_latency_us: float
    write_ratio: float  # all GPUs writing to all peers at once
    read_ratio: float  # all GPUs reading from all peers at once
    staged_ratio: float  # writes in rounds, one inbound stream per GPU
    collapse: bool
    created: str = ""
    path: str = ""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "gpus": list(self.gpus)}

    @classmethod
    def from_json(cls, data: Any, where: str = "") -> P2PSummary:
        """The inverse of ``to_json`` (``where``: its path in the document, for messages):
        bandwidths, latencies and ratios finite and >= 0, ``collapse`` a JSON boolean (not
        "false", which ``bool`` reads as True); FieldError naming the field otherwise."""
        data = fields(data, where, known=cls.__dataclass_fields__)
        numbers = {
            name: require(data, name, float, where, minimum=0)
            for name in (
                "pair_write_gbps",
                "pair_read_gbps",
                "write_latency_us",
                "read_latency_us",
                "write_ratio",
                "read_ratio",
                "staged_ratio",
            )
        }
        return cls(
            gpus=tuple(
                require_list(
                    data, "gpus", int, where, max_items=MAX_GPUS, minimum=0, maximum=MAX_GPUS - 1
                )
            ),
            **numbers,
            collapse=require(data, "collapse", bool, where),
            created=require(data, "created", str, where, limit=40, default=""),
            path=require(data, "path", str, where, limit=4096, default=""),
        )

    def describe(self) -> str:
        """One line: what was measured and the verdict."""
        gpus = ",".join(map(str, self.gpus))
        verdict = (
            f"concurrent P2P writes collapse to {self.write_ratio:.0%}"
            if self.collapse
            else f"concurrent P2P writes hold at {self.write_ratio:.0%}"
        )
        return (
            f"{verdict} of the links here (reads {self.read_ratio:.0%}, staged order "
            f"{self.staged_ratio:.0%}; a pair alone writes {self.pair_write_gbps:.1f} GB/s, reads "
            f"{self.pair_read_gbps:.1f}; measured on GPUs {gpus}"
            + (f" {self.created}" if self.created else "")
            + ")"
        )


@dataclass(frozen=True)
class HostFindings:
    """The host checks and the cached p2p probe: an input of the plan (``Deployment.host``)."""

    checks: tuple[HostCheck, ...] = ()
    probe: P2PSummary | None = None
    probe_note: str = ""

    def check(self, name: str) -> HostCheck | None:
        return next((c for c in self.checks if c.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "checks": [c.to_json() for c in self.checks],
            "probe": self.probe.to_json() if self.probe else None,
            "probe_note": self.probe_note,
        }


def sysfs_root() -> Path:
    """Where sysfs and procfs are read: ``SGLANG_SM120_SYSFS_ROOT``, default ``/``
    (``sysfs_root_problem`` says whether it can be used)."""
    raw = os.environ.get(SYSFS_ROOT_ENV)
    return Path("/" if raw is None else raw)


def _shown(text: str) -> str:
    """A value as a message shows it: escaped (control characters, bytes that are not UTF-8)
    and cut at 40 characters."""
    shown = repr(text)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def sysfs_root_problem() -> str | None:
    """Why ``SGLANG_SM120_SYSFS_ROOT`` cannot be a root of sysfs and procfs, as one line naming
    the variable; None when it is unset or can be used."""
    raw = os.environ.get(SYSFS_ROOT_ENV)
    if raw is None:
        return None
    why = None
    if not raw:
        why = "empty (unset it to read this machine's /sys and /proc)"
    elif any("\udc80" <= c <= "\udcff" for c in raw):
        why = "not UTF-8"
    elif not raw.isprintable():
        why = "holds control characters"
    else:
        try:
            if not Path(raw).is_dir():
                why = "not a directory" if Path(raw).exists() else "does not exist"
            elif not any((Path(raw) / sub).is_dir() for sub in ("sys", "proc")):
                why = "holds neither sys/ nor proc/ (a dump of /sys and /proc is wanted)"
        except OSError as exc:
            why = exc.strerror or str(exc)
    if why is None:
        return None
    return f"{SYSFS_ROOT_ENV}={_shown(raw)} refused: {why}"


# ------------------------------------------------------------------------- BAR1 arithmetic


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def ipc_workspace_bytes(
    tp: int, hidden: int, decode_rows: int = DEFAULT_DECODE_ROWS, element_bytes: int = 2
) -> dict[str, int]:
    """Bytes of each IPC workspace one GPU shares with its peers at this TP, and ``need``.

    Peers write into a GPU's workspace through that GPU's BAR1 window, so BAR1 must map each
    slab it shares (P = decode_rows x hidden x element_bytes, N = tp):

    - ``sm120_pcie``: sgl-kernel-sm120's workspace at the decode width (its
      ``config.workspace_bytes``: 40 KiB + 3 N x one-shot slot + 2 N x chunk + P); 0 when the
      package is not installed;
    - ``pcie_ipc``: FlashInfer's PCIe-IPC slab at the decode width (compute_workspace_layout in
      its pcie_ipc_all_reduce.cuh): two scratch regions of 2 N x P, the copy-engine ring's
      2 (N - 1) x P / N (7 x P / 4 at N = 8 when larger), and 64 KiB of signals and flags;
    - ``trtllm``: FlashInfer's trtllm fusion workspace at 2048 rows (trtllm_ar.py): N x rows x
      hidden x 2 bytes, plus 3 Lamport buffers of the same (capped at 2 GiB - 2 MiB), each
      rounded to 2 MiB.

    One server builds one fusion backend (trtllm or sm120_pcie) and PCIe-IPC, so
    ``need = max(trtllm, sm120_pcie) + pcie_ipc``. NCCL's own peer buffers come on top."""
    payload = _round_up(decode_rows * hidden * element_bytes, 128)
    ce_ring = 2 * (tp - 1) * _round_up(payload // tp, 128)
    if tp == 8:
        ce_ring = max(ce_ring, 7 * _round_up(payload // 4, 128))
    pcie_ipc = 2 * (2 * tp * payload) + ce_ring + (64 << 10)
    two_mib = 2 << 20
    comm = tp * TRTLLM_ROWS * hidden * 2
    lamport = min(comm, 2147483647 & ~(two_mib - 1))
    trtllm = _round_up(comm, two_mib) + _round_up(tp * 256 * 4, two_mib)
    trtllm += _round_up(3 * lamport, two_mib)
    try:
        from sgl_kernel_sm120.config import MAX_WORLD_SIZE, workspace_bytes

        sm120 = (
            workspace_bytes(tp, decode_rows, hidden, element_bytes) if tp <= MAX_WORLD_SIZE else 0
        )
    except (ImportError, ValueError):  # not installed, or a shape it refuses: it builds none
        sm120 = 0
    return {
        "sm120_pcie": sm120,
        "pcie_ipc": pcie_ipc,
        "trtllm": trtllm,
        "need": max(trtllm, sm120) + pcie_ipc,
    }


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


# ------------------------------------------------------------------------------ reading


class _Unknown(Exception):
    """A check cannot tell: its message becomes the check's detail."""


def _gpu_list(labels: Sequence[int]) -> str:
    return ",".join(map(str, labels))


def _call(nvml: Any, name: str, *args: Any) -> Any:
    """One NVML call; ``_Unknown`` naming the call when it fails or this nvidia-ml-py lacks it."""
    fn = getattr(nvml, name, None)
    if fn is None:
        raise _Unknown(f"{name} is missing from this nvidia-ml-py (upgrade nvidia-ml-py)")
    try:
        return fn(*args)
    except Exception as exc:  # NVMLError and its many subclasses
        raise _Unknown(f"{name}: {exc or type(exc).__name__}") from None


@dataclass
class _Host:
    """What the checks share: where sysfs is, the NVML module and the visible GPUs' handles."""

    root: Path
    tp: int
    hidden: int
    decode_rows: int
    probe: P2PSummary | None
    gpu_ids: tuple[int, ...] | None = None  # the TP group (CUDA indices); None: every GPU
    nvml: Any = None
    no_nvml: str = ""  # why there is no NVML (the GPU checks' unknown reason)
    out_of_range: str = ""  # why the TP group's GPUs are not there
    handles: list[Any] = field(default_factory=list)
    bus_ids: list[str] = field(default_factory=list)  # sysfs names, CUDA order
    labels: list[int] = field(default_factory=list)  # the handles' CUDA indices

    def need_gpus(self) -> None:
        if not self.handles:
            raise _Unknown(f"no GPU ({self.no_nvml or 'NVML sees none'})")

    def shown(self, path: Path) -> str:
        """A path below the root as the machine names it (/proc/cmdline), escaped."""
        for root in (self.root, Path(os.path.realpath(self.root))):
            try:
                path = Path("/") / path.relative_to(root)
                break
            except ValueError:
                continue
        return repr(str(path))[1:-1]

    def read(
        self, path: Path | str, max_bytes: int = SMALL_FILE_BYTES, optional: bool = False
    ) -> bytes | None:
        """The bytes of one sysfs/procfs file (``path``: relative to the root, or a Path below
        it), at most ``max_bytes``; None for a missing ``optional`` file; ``_Unknown`` naming
        the file and the reason otherwise (a FIFO, a device, too large, unreadable)."""
        path = self.root / path.lstrip("/") if isinstance(path, str) else path
        try:
            return read_regular_file(path, max_bytes)
        except UnreadableFile as exc:
            if optional and exc.missing:
                return None
            raise _Unknown(f"{self.shown(path)}: {exc}") from None

    def read_text(
        self, path: Path | str, max_bytes: int = SMALL_FILE_BYTES, optional: bool = False
    ) -> str | None:
        """``read``, as UTF-8 text (``_Unknown`` when it is not)."""
        data = self.read(path, max_bytes, optional)
        try:
            return None if data is None else data.decode("utf-8")
        except UnicodeDecodeError:
            path = self.root / path.lstrip("/") if isinstance(path, str) else path
            raise _Unknown(f"{self.shown(path)}: not UTF-8") from None

    def sysfs_gpus(self) -> list[str]:
        """The TP group's PCI addresses: from NVML, else the NVIDIA display devices in sysfs in
        PCI order (NVML's order) at the group's positions. ``_Unknown`` when sysfs cannot say."""
        if self.out_of_range:
            raise _Unknown(self.out_of_range)
        if self.bus_ids:
            return self.bus_ids
        devices = self.root / "sys/bus/pci/devices"
        try:
            entries = sorted(e for e in os.listdir(devices) if _BDF.match(e))
        except OSError as exc:
            raise _Unknown(f"/sys/bus/pci/devices unreadable ({exc.strerror or exc})") from None
        found = []
        for entry in entries:
            vendor = (self.read_text(devices / entry / "vendor", optional=True) or "").strip()
            klass = (self.read_text(devices / entry / "class", optional=True) or "").strip()
            if vendor.lower() == "0x10de" and klass.lower().startswith(("0x0300", "0x0302")):
                found.append(entry)
        if self.gpu_ids is None:
            self.labels = self.labels or list(range(len(found)))
            return found
        if any(i >= len(found) for i in self.gpu_ids):
            wanted = _gpu_list(self.gpu_ids)
            raise _Unknown(f"GPUs {wanted} are not among the {len(found)} NVIDIA GPUs in sysfs")
        self.labels = list(self.gpu_ids)
        return [found[i] for i in self.gpu_ids]

    def bridges_above(self, bdf: str) -> list[Path] | None:
        """The sysfs directories of the PCIe bridges between the root complex and this device,
        root port first; None when sysfs does not have the device."""
        link = self.root / "sys/bus/pci/devices" / bdf
        try:
            real = Path(os.path.realpath(link))
            if not real.exists():
                return None
        except OSError:
            return None
        return [p for p in reversed(real.parents) if _BDF.match(p.name)]


def _open_nvml(host: _Host, nvml: Any) -> None:
    try:
        _call(nvml, "nvmlInit")
    except _Unknown as exc:
        host.no_nvml = f"NVML unavailable: {exc}"
        return
    host.nvml = nvml  # started: shut down after the checks, whatever follows
    try:
        count = _call(nvml, "nvmlDeviceGetCount")
        indices = visible_nvml_indices(count, nvml)
        if not indices:
            host.no_nvml = "NVML sees none"
            return
        wanted = host.gpu_ids if host.gpu_ids is not None else tuple(range(len(indices)))
        if any(i >= len(indices) for i in wanted):
            host.no_nvml = host.out_of_range = (
                f"GPUs {_gpu_list(wanted)} are not among the {len(indices)} GPUs NVML sees"
            )
            return
        host.handles = [_call(nvml, "nvmlDeviceGetHandleByIndex", indices[i]) for i in wanted]
        host.labels = list(wanted)
        host.bus_ids = [
            sysfs_bus_id(_call(nvml, "nvmlDeviceGetPciInfo", h).busId) for h in host.handles
        ]
    except Exception as exc:  # _Unknown, or CUDA_VISIBLE_DEVICES naming what NVML lacks
        host.no_nvml = f"NVML query failed: {exc}"
        host.handles, host.bus_ids, host.labels = [], [], []


# -------------------------------------------------------------------------------- checks


def check_iommu(host: _Host) -> HostCheck:
    evidence = "/sys/class/iommu, /proc/cmdline, /sys/bus/pci/devices/<gpu>/iommu_group/type"
    fix = (
        "boot with iommu=pt (passthrough: GPU DMA untranslated, the IOMMU kept for devices "
        "that need it), or turn the IOMMU off in the BIOS where nothing needs it"
    )
    try:
        return _iommu(host, evidence, fix)
    except _Unknown as exc:
        return HostCheck("iommu", UNKNOWN, str(exc), "", evidence)


def _iommu(host: _Host, evidence: str, fix: str) -> HostCheck:
    cmdline = set((host.read_text("proc/cmdline") or "").split())
    off = {"iommu=off", "intel_iommu=off", "amd_iommu=off"} & cmdline
    passthrough_cmdline = {"iommu=pt", "iommu.passthrough=1"} & cmdline
    how = f" ({' '.join(sorted(off))} on the kernel command line)" if off else ""
    try:
        units = sorted(os.listdir(host.root / "sys/class/iommu"))
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if off:
            return HostCheck("iommu", OK, f"off{how}; /sys/class/iommu: {reason}", "", evidence)
        raise _Unknown(
            f"/sys/class/iommu: {reason} (a container or sandbox such as gVisor hides it while "
            "the host's IOMMU may be on: `ls /sys/class/iommu` on the host tells)"
        ) from None
    if not units:
        return HostCheck("iommu", OK, f"off: no IOMMU units in /sys/class/iommu{how}", "", evidence)
    types: dict[str, list[str]] = {}
    for bdf in host.sysfs_gpus():
        kind = host.read_text(f"sys/bus/pci/devices/{bdf}/iommu_group/type", optional=True)
        if kind is not None:
            types.setdefault(kind.strip(), []).append(bdf)
    translated = {t: g for t, g in types.items() if t.startswith("DMA")}
    listed = ", ".join(repr(unit)[1:-1] for unit in units[:4])
    where = f"enabled ({listed}{' ...' if len(units) > 4 else ''})"
    if translated:
        groups = "; ".join(f"{t} for {', '.join(g)}" for t, g in translated.items())
        return HostCheck(
            "iommu",
            WARN,
            f"{where}, translating the GPUs' DMA ({groups}): P2P goes through the root "
            "complex's IOMMU, ~15% less bandwidth, and with ACS redirect NCCL can hang",
            fix,
            evidence,
        )
    if types.get("identity") or passthrough_cmdline:
        why = "group type identity" if types.get("identity") else " ".join(passthrough_cmdline)
        return HostCheck("iommu", OK, f"{where}, passthrough ({why})", "", evidence)
    return HostCheck(
        "iommu",
        UNKNOWN,
        f"{where}; the GPUs' translation mode is unreadable and iommu=pt is not on the kernel "
        "command line",
        fix,
        evidence,
    )


def acs_control(config: bytes) -> int | None:
    """The ACS control register from a PCI config-space dump, or None when the device has no
    ACS capability. Raises ``_Unknown`` when the dump stops before the extended space (Linux
    gives unprivileged readers the first 64 bytes only)."""
    if len(config) < EXTENDED_CONFIG_START + 8:
        raise _Unknown(f"config space is {len(config)} bytes (extended capabilities need root)")
    offset, seen = EXTENDED_CONFIG_START, set()
    while EXTENDED_CONFIG_START <= offset <= len(config) - 8 and offset not in seen:
        seen.add(offset)
        header = int.from_bytes(config[offset : offset + 4], "little")
        if header in (0, 0xFFFFFFFF):
            return None
        if header & 0xFFFF == ACS_CAP_ID:
            return int.from_bytes(config[offset + 6 : offset + 8], "little")
        offset = (header >> 20) & 0xFFC
    return None


def _acs_flags(control: int) -> str:
    names = (
        (ACS_SOURCE_VALIDATION, "SrcValid"),
        (ACS_P2P_REQUEST_REDIRECT, "ReqRedir"),
        (ACS_P2P_COMPLETION_REDIRECT, "CmpltRedir"),
        (ACS_UPSTREAM_FORWARDING, "UpstreamFwd"),
    )
    return " ".join(name for bit, name in names if control & bit)


def check_acs(host: _Host) -> HostCheck:
    evidence = "/sys/bus/pci/devices/<bridge>/config (ACS extended capability 0x000D)"
    try:
        gpus = host.sysfs_gpus()
    except _Unknown as exc:
        return HostCheck("acs", UNKNOWN, str(exc), "", evidence)
    if not gpus:
        return HostCheck("acs", UNKNOWN, "no GPU (no NVIDIA device in sysfs)", "", evidence)
    bridges: dict[Path, bool] = {}  # bridge -> is a switch port (has a bridge above it)
    for bdf in gpus:
        chain = host.bridges_above(bdf)
        for depth, bridge in enumerate(chain or []):
            bridges[bridge] = bridges.get(bridge, False) or depth > 0
    if not bridges:
        return HostCheck("acs", UNKNOWN, "no PCIe bridge above the GPUs in sysfs", "", evidence)
    redirect: dict[str, list[str]] = {"switch": [], "root": []}
    root_only: list[str] = []  # config space cut at 64 bytes: readable past that by root only
    unreadable: list[str] = []  # the reason, naming the file
    for bridge, is_switch_port in sorted(bridges.items()):
        try:
            config = host.read(bridge / "config", CONFIG_SPACE_BYTES) or b""
        except _Unknown as exc:
            unreadable.append(str(exc))
            continue
        try:
            control = acs_control(config)
        except _Unknown as exc:
            root_only.append(str(exc))
            continue
        if control is not None and control & ACS_REDIRECT:
            redirect["switch" if is_switch_port else "root"].append(
                f"{bridge.name} [{_acs_flags(control)}]"
            )
    fix = (
        "disable ACS in the BIOS (PCIe ACS / 'ACS Control'), or boot with "
        "pci=disable_acs_redir=<bridge>;<bridge> (Linux 5.1+) naming the bridges listed"
    )
    skipped = (
        f"; {len(root_only)} bridge(s) unreadable without root (`sudo sglang-sm120 doctor`)"
        if root_only
        else ""
    ) + (f"; {len(unreadable)} unreadable ({unreadable[0]})" if unreadable else "")
    if redirect["switch"]:
        return HostCheck(
            "acs",
            FAIL,
            f"ACS redirect on PCIe switch ports above the GPUs: {', '.join(redirect['switch'])}: "
            "P2P between GPUs of one switch goes up through the root complex (~15% less "
            "bandwidth; NCCL has been seen to hang with 8 GPUs)" + skipped,
            fix,
            evidence,
        )
    if redirect["root"]:
        return HostCheck(
            "acs",
            WARN,
            f"ACS redirect on root ports above the GPUs: {', '.join(redirect['root'])}: P2P "
            "between them is checked by the IOMMU on its way through the root complex" + skipped,
            fix,
            evidence,
        )
    read = len(bridges) - len(root_only) - len(unreadable)
    if len(root_only) == len(bridges):
        return HostCheck(
            "acs",
            UNKNOWN,
            f"config space of the {len(bridges)} bridges above the GPUs is readable past 64 "
            "bytes by root only: run `sudo sglang-sm120 doctor` (or `sudo lspci -vvv | grep "
            "ACSCtl`)",
            "",
            evidence,
        )
    if root_only or unreadable:  # what was not read may redirect: no verdict
        return HostCheck(
            "acs",
            UNKNOWN,
            f"no ACS redirect on the {read} bridges read, but not every bridge above the GPUs "
            "was" + skipped,
            "",
            evidence,
        )
    return HostCheck(
        "acs",
        OK,
        f"no ACS redirect on the {len(bridges)} bridges above {len(gpus)} GPUs",
        "",
        evidence,
    )


def registry_dwords(params: str) -> dict[str, str]:
    """The ``RegistryDwords`` of /proc/driver/nvidia/params, as {key: value}."""
    for line in params.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "RegistryDwords":
            entries = value.strip().strip('"').split(";")
            pairs = (e.partition("=") for e in entries if e.strip())
            return {k.strip(): v.strip() for k, _, v in pairs}
    return {}


def _nonzero(value: str) -> bool:
    try:
        return int(value, 0) != 0
    except ValueError:
        return False


def _p2p_blocked_pairs(host: _Host) -> list[str]:
    """GPU pairs NVML reports without P2P reads or writes, as 'a-b (write: status)'."""
    nvml = host.nvml
    blocked = []
    for a in range(len(host.handles)):
        for b in range(a + 1, len(host.handles)):
            for cap, what in (
                (getattr(nvml, "NVML_P2P_CAPS_INDEX_READ", 0), "read"),
                (getattr(nvml, "NVML_P2P_CAPS_INDEX_WRITE", 1), "write"),
            ):
                status = _call(
                    nvml, "nvmlDeviceGetP2PStatus", host.handles[a], host.handles[b], cap
                )
                if status != getattr(nvml, "NVML_P2P_STATUS_OK", 0):
                    pair = f"{host.labels[a]}-{host.labels[b]}"
                    blocked.append(f"{pair} ({what}: status {status})")
    return blocked


def _staging_reported_for(host: _Host) -> bool:
    """Whether these GPUs are the kind the staged-P2P default is reported for (SM12x); True
    when NVML cannot tell."""
    try:
        majors = {
            _call(host.nvml, "nvmlDeviceGetCudaComputeCapability", h)[0] for h in host.handles
        }
    except _Unknown:
        return True
    return not majors or majors == {12}


def check_p2p_driver(host: _Host) -> HostCheck:
    evidence = (
        "/proc/driver/nvidia/params (RegistryDwords), sysfs device paths (attachment), "
        "nvmlDeviceGetP2PStatus, the cached `sglang-sm120 p2p` probe"
    )
    try:
        params = host.read_text("proc/driver/nvidia/params", PARAMS_BYTES, optional=True)
        params_problem = "" if params is not None else "/proc/driver/nvidia/params missing"
    except _Unknown as exc:
        params, params_problem = None, str(exc)
    try:
        gpus = host.sysfs_gpus()
    except _Unknown as exc:
        return HostCheck("p2p_driver", UNKNOWN, str(exc), "", evidence)
    count = len(host.handles) or len(gpus)
    if count == 0:
        driver = f", no NVIDIA driver: {params_problem}" if params_problem else ""
        return HostCheck(
            "p2p_driver", UNKNOWN, f"no GPU ({host.no_nvml or 'none in sysfs'}{driver})"
        )
    if count < 2:
        return HostCheck("p2p_driver", UNKNOWN, "one GPU: no peers", "", evidence)
    if host.handles:
        try:
            blocked = _p2p_blocked_pairs(host)
        except _Unknown as exc:
            blocked, nvml_note = [], f"; NVML P2P status unknown: {exc}"
        else:
            nvml_note = "; NVML reports P2P read and write on every pair"
        if blocked:
            listed = ", ".join(blocked[:4]) + (" ..." if len(blocked) > 4 else "")
            return HostCheck(
                "p2p_driver",
                FAIL,
                f"no P2P between GPUs {listed}: IPC all-reduce kernels cannot run",
                FORCE_P2P_FIX + " (GeForce cards need a P2P-enabled kernel module)",
                evidence,
            )
    else:
        nvml_note = f"; NVML P2P status unknown ({host.no_nvml or 'no NVML'})"
    probe = host.probe
    if probe is not None:
        measured = f"measured {probe.pair_write_gbps:.1f} GB/s per pair writing alone"
        if probe.pair_write_gbps < STAGED_BELOW_GBPS:
            return HostCheck(
                "p2p_driver",
                FAIL,
                f"{measured} (direct P2P on Gen5 x16 reaches 53-56): staged through system "
                "memory" + nvml_note,
                FORCE_P2P_FIX,
                evidence,
            )
        return HostCheck("p2p_driver", OK, f"direct: {measured}{nvml_note}", "", evidence)
    keys = registry_dwords(params or "")
    if _nonzero(keys.get("ForceP2P", "0")):
        return HostCheck(
            "p2p_driver",
            OK,
            f"direct: ForceP2P={keys['ForceP2P']} in RegistryDwords{nvml_note}",
            "",
            evidence,
        )
    chains = [host.bridges_above(bdf) for bdf in gpus]
    if not gpus or any(not chain for chain in chains):
        return HostCheck(
            "p2p_driver",
            UNKNOWN,
            "how the GPUs attach is not in sysfs (no bridge above a GPU: a virtual machine?); "
            "`sglang-sm120 p2p` measures it" + nvml_note,
            "",
            evidence,
        )
    if not _staging_reported_for(host):
        return HostCheck(
            "p2p_driver",
            UNKNOWN,
            "the driver's staged default is reported for SM12x (RTX PRO 6000, RTX 5090) hosts, "
            "not these GPUs; `sglang-sm120 p2p` measures it" + nvml_note,
            "",
            evidence,
        )
    root_ported = [bdf for bdf, chain in zip(gpus, chains, strict=True) if len(chain or []) == 1]
    if root_ported and params is None:
        return HostCheck(
            "p2p_driver",
            UNKNOWN,
            f"PCI {', '.join(root_ported)} sit on root ports (no PCIe switch), where the "
            f"driver's default stages P2P through system memory, and ForceP2P is unknown "
            f"({params_problem}): `sglang-sm120 p2p` measures it" + nvml_note,
            FORCE_P2P_FIX,
            evidence,
        )
    if root_ported:
        return HostCheck(
            "p2p_driver",
            FAIL,
            f"PCI {', '.join(root_ported)} sit on root ports (no PCIe switch) and "
            "RegistryDwords has no ForceP2P: "
            "the driver stages kernel-issued P2P through system memory there, ~15x slower "
            "(`sglang-sm120 p2p` measures it)" + nvml_note,
            FORCE_P2P_FIX,
            evidence,
        )
    return HostCheck(
        "p2p_driver",
        OK,
        f"direct: PCI {', '.join(gpus)} sit behind PCIe switches{nvml_note}",
        "",
        evidence,
    )


def _busy_pstate(host: _Host, handle: Any) -> int | None:
    """The GPU's performance state when it is running work (P0..P2), else None (idle, or NVML
    cannot tell)."""
    try:
        state = int(_call(host.nvml, "nvmlDeviceGetPerformanceState", handle))
    except (_Unknown, TypeError, ValueError):
        return None
    return state if 0 <= state <= BUSY_PSTATE else None


def check_pcie_link(host: _Host) -> HostCheck:
    """Each link against what it can train at. NVML's MaxPcieLinkGeneration is what the GPU
    and the platform both do (4 for a Gen5 GPU on a Gen4 platform): GPUs all at their platform's
    maximum are fine. A link below that maximum is a fault when the GPU is busy; an idle GPU
    lowers its link generation to save power."""
    evidence = (
        "nvmlDeviceGet{Curr,Max,GpuMax}PcieLinkGeneration, nvmlDeviceGet{Curr,Max}PcieLinkWidth, "
        "nvmlDeviceGetPerformanceState"
    )
    fix = (
        "reseat the GPU, replace the riser or cable, set the slot to Gen5/auto in the BIOS; "
        "confirm under load with `nvidia-smi -q -d PCIE`"
    )
    try:
        host.need_gpus()
        problems, idle, links, caps = [], [], set(), {}
        for label, h in zip(host.labels, host.handles, strict=True):
            gen = _call(host.nvml, "nvmlDeviceGetCurrPcieLinkGeneration", h)
            max_gen = _call(host.nvml, "nvmlDeviceGetMaxPcieLinkGeneration", h)
            width = _call(host.nvml, "nvmlDeviceGetCurrPcieLinkWidth", h)
            max_width = _call(host.nvml, "nvmlDeviceGetMaxPcieLinkWidth", h)
            try:
                gpu_gen = _call(host.nvml, "nvmlDeviceGetGpuMaxPcieLinkGeneration", h)
            except _Unknown:
                gpu_gen = max_gen  # older nvidia-ml-py: the slot's limit is all we know
            caps[label] = (max_gen, gpu_gen)
            if width < max_width:
                problems.append(f"GPU{label} runs x{width} of x{max_width}")
            if gen < max_gen:
                busy = _busy_pstate(host, h)
                if busy is not None:
                    problems.append(f"GPU{label} at Gen{gen} of Gen{max_gen} while busy (P{busy})")
                else:
                    idle.append(label)
            links.add(f"Gen{max_gen} x{max_width}")
    except _Unknown as exc:
        return HostCheck("pcie_link", UNKNOWN, str(exc), "", evidence)
    best = max(max_gen for max_gen, _ in caps.values())
    problems += [  # a slot below its peers': the TP group runs at its slowest link
        f"GPU{label} trains at most Gen{max_gen} (the GPU does Gen{gpu_gen}), its peers Gen{best}"
        for label, (max_gen, gpu_gen) in caps.items()
        if max_gen < best
    ]
    if problems:
        return HostCheck(
            "pcie_link",
            FAIL,
            "downtrained: " + "; ".join(problems) + " (each lost generation halves a pair's "
            "bandwidth)",
            fix,
            evidence,
        )
    platform = (
        f" (the platform's maximum: the GPUs do Gen{max(g for _, g in caps.values())})"
        if any(max_gen < gpu_gen for max_gen, gpu_gen in caps.values())
        else ""
    )
    note = (
        f" (GPUs {_gpu_list(idle)} below that right now: idle power saving lowers the "
        "generation until traffic starts)"
        if idle
        else ""
    )
    return HostCheck(
        "pcie_link",
        OK,
        f"{len(host.handles)} GPUs at {', '.join(sorted(links))} maximum{platform}{note}",
        "",
        evidence,
    )


def check_bar1(host: _Host) -> HostCheck:
    evidence = "nvmlDeviceGetBAR1MemoryInfo (bar1Total)"
    try:
        host.need_gpus()
        totals = [
            _call(host.nvml, "nvmlDeviceGetBAR1MemoryInfo", h).bar1Total for h in host.handles
        ]
    except _Unknown as exc:
        return HostCheck("bar1", UNKNOWN, str(exc), "", evidence)
    smallest = min(totals)
    if host.tp < 2:
        return HostCheck(
            "bar1", OK, f"BAR1 {_mib(smallest)}; TP1 shares no IPC workspace", "", evidence
        )
    sizes = ipc_workspace_bytes(host.tp, host.hidden, host.decode_rows)
    need = sizes["need"]
    at = (
        f"TP{host.tp}, hidden {host.hidden}: trtllm {_mib(sizes['trtllm'])} or sgl-kernel-sm120 "
        f"{_mib(sizes['sm120_pcie'])}, + PCIe-IPC {_mib(sizes['pcie_ipc'])} at "
        f"{host.decode_rows} rows"
    )
    if smallest < need:
        small = [f"GPU{i} {_mib(t)}" for i, t in zip(host.labels, totals, strict=True) if t < need]
        return HostCheck(
            "bar1",
            FAIL,
            f"BAR1 too small for the IPC workspaces: {', '.join(small)}, need {_mib(need)} "
            f"({at}); peers cannot map the buffers",
            "enable Above 4G Decoding and Resizable BAR in the BIOS (and EnableResizableBar=1 "
            "in NVreg_RegistryDwords); `nvidia-smi -q -d MEMORY` shows BAR1",
            evidence,
        )
    return HostCheck(
        "bar1", OK, f"BAR1 {_mib(smallest)} per GPU, need {_mib(need)} ({at})", "", evidence
    )


def check_topology(host: _Host) -> HostCheck:
    evidence = "nvmlDeviceGetTopologyCommonAncestor"
    try:
        host.need_gpus()
        n = len(host.handles)
        if n < 2:
            return HostCheck("topology", UNKNOWN, "one GPU: no pairs", "", evidence)
        levels = [[-1] * n for _ in range(n)]
        for a in range(n):
            for b in range(a + 1, n):
                level = _call(
                    host.nvml,
                    "nvmlDeviceGetTopologyCommonAncestor",
                    host.handles[a],
                    host.handles[b],
                )
                levels[a][b] = levels[b][a] = int(level)
    except _Unknown as exc:
        return HostCheck("topology", UNKNOWN, str(exc), "", evidence)
    matrix = tuple(
        tuple("X" if a == b else TOPOLOGY_LABELS.get(levels[a][b], "?") for b in range(n))
        for a in range(n)
    )
    pairs = [(a, b) for a in range(n) for b in range(a + 1, n)]
    counts: dict[str, int] = {}
    for a, b in pairs:
        label = matrix[a][b]
        counts[label] = counts.get(label, 0) + 1
    summary = ", ".join(f"{label} {count}" for label, count in sorted(counts.items()))
    labels = host.labels
    cross = [f"{labels[a]}-{labels[b]}" for a, b in pairs if levels[a][b] >= CROSS_SOCKET]
    if cross:
        listed = ", ".join(cross[:6]) + (" ..." if len(cross) > 6 else "")
        return HostCheck(
            "topology",
            WARN,
            f"{len(cross)} of {len(pairs)} pairs cross sockets ({listed}): 39-51 GB/s there "
            f"against 53-56 on one switch (pairs: {summary})",
            "keep a TP group on one socket where it fits (e.g. CUDA_VISIBLE_DEVICES of one NUMA "
            "node, or --base-gpu-id); across sockets PCIe-IPC's staged kernels suit best",
            evidence,
            matrix,
        )
    return HostCheck(
        "topology", OK, f"no pair crosses sockets (pairs: {summary})", "", evidence, matrix
    )


def check_persistence(host: _Host) -> HostCheck:
    evidence = "nvmlDeviceGetPersistenceMode"
    try:
        host.need_gpus()
        off = [
            label
            for label, h in zip(host.labels, host.handles, strict=True)
            if _call(host.nvml, "nvmlDeviceGetPersistenceMode", h)
            != getattr(host.nvml, "NVML_FEATURE_ENABLED", 1)
        ]
    except _Unknown as exc:
        return HostCheck("persistence", UNKNOWN, str(exc), "", evidence)
    if off:
        return HostCheck(
            "persistence",
            WARN,
            f"persistence mode off on GPUs {','.join(map(str, off))}: the driver tears the GPUs "
            "down between processes, so every server start and every NVML query initialises "
            "them again (seconds)",
            "run the nvidia-persistenced service, or `sudo nvidia-smi -pm 1`",
            evidence,
        )
    return HostCheck("persistence", OK, f"on for {len(host.handles)} GPUs", "", evidence)


_CHECKS = (
    check_iommu,
    check_acs,
    check_p2p_driver,
    check_pcie_link,
    check_bar1,
    check_topology,
    check_persistence,
)


def run_host_checks(
    tp: int,
    hidden: int,
    *,
    gpu_ids: Sequence[int] | None = None,
    root: str | os.PathLike[str] | None = None,
    nvml: Any = None,
    skip_nvml: str | None = None,
    probe: P2PSummary | None = None,
    decode_rows: int = DEFAULT_DECODE_ROWS,
) -> tuple[HostCheck, ...]:
    """Every host check, in ``CHECK_NAMES`` order, about the GPUs ``gpu_ids`` (the TP group's
    CUDA indices; default every visible GPU). Never raises.

    ``root``: where sysfs/procfs are read (default ``sysfs_root()``; when that variable cannot
    be a root, every check is unknown with the reason). ``nvml``: a pynvml-like module (default:
    import pynvml). ``skip_nvml``: leave NVML out, with this reason (facts from a profile
    describe another machine). ``probe``: the cached p2p measurement of these GPUs."""
    if root is None:
        refused = sysfs_root_problem()
        if refused:
            fix = f"set {SYSFS_ROOT_ENV} to a dump of /sys and /proc, or unset it"
            return tuple(
                HostCheck(name, UNKNOWN, refused, fix, SYSFS_ROOT_ENV) for name in CHECK_NAMES
            )
    host = _Host(Path(root) if root is not None else sysfs_root(), tp, hidden, decode_rows, probe)
    host.gpu_ids = tuple(gpu_ids) if gpu_ids is not None else None
    if skip_nvml:
        host.no_nvml = skip_nvml
    elif nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            host.no_nvml = "nvidia-ml-py is not installed"
    if nvml is not None and not skip_nvml:
        _open_nvml(host, nvml)
    checks = []
    try:
        for check in _CHECKS:
            name = check.__name__.removeprefix("check_")
            try:
                checks.append(check(host))
            except Exception as exc:  # a check that breaks must not take doctor or a launch down
                checks.append(
                    HostCheck(name, UNKNOWN, f"check failed: {type(exc).__name__}: {exc}")
                )
    finally:
        if host.nvml is not None:
            try:
                host.nvml.nvmlShutdown()
            except Exception:
                pass
    return tuple(_about(check, host.labels) for check in checks)


def _about(check: HostCheck, labels: Sequence[int]) -> HostCheck:
    """The check saying which GPUs it judged: "GPUs 0,1: ..." (none known: as it was)."""
    if not labels:
        return check
    return replace(check, detail=f"GPUs {_gpu_list(labels)}: {check.detail}", gpus=tuple(labels))


def format_checks(checks: Sequence[HostCheck]) -> list[str]:
    """The checks as a table (name, status, detail); under each that is not ok its fix, and
    under a warning or failure its evidence; then the topology matrix."""
    lines = ["host checks:", f"  {'CHECK':<12} {'STATUS':<8} DETAIL"]
    indent = " " * 24
    for c in checks:
        status = c.status.upper() if c.status in (WARN, FAIL) else c.status
        lines.append(f"  {c.name:<12} {status:<8} {c.detail}")
        if c.status != OK:
            lines += [f"{indent}fix: {c.fix}"] if c.fix else []
        if c.status in (WARN, FAIL):
            lines += [f"{indent}from: {c.evidence}"] if c.evidence else []
    for c in checks:
        if c.matrix:
            lines.append(f"  {c.name} ({TOPOLOGY_LEGEND}):")
            labels = c.gpus if len(c.gpus) == len(c.matrix) else range(len(c.matrix))
            lines.append("          " + " ".join(f"GPU{i:<2}" for i in labels))
            lines += [
                f"    GPU{i:<2}  " + " ".join(f"{cell:<5}" for cell in row)
                for i, row in zip(labels, c.matrix, strict=True)
            ]
    return lines


if (
    __name__ == "__main__"
):  # `python -m sglang_sm120.machine.host_checks [--tp N] [--json]`: no sglang needed
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m sglang_sm120.machine.host_checks")
    parser.add_argument("--tp", type=int, default=0, help="TP size for BAR1 (default: GPUs)")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    from sglang_sm120.machine.facts import current_facts
    from sglang_sm120.machine.topology import TopologyError

    try:
        tp = options.tp or max(len(current_facts().gpus), 1)
    except TopologyError as exc:  # a bad SGLANG_SM120_TOPOLOGY: one line, as the CLI says it
        parser.exit(2, f"{parser.prog}: {exc}\n")
    results = run_host_checks(tp, options.hidden)
    if options.json:
        print(json.dumps([c.to_json() for c in results], indent=1))
    else:
        print("\n".join(format_checks(results)))
