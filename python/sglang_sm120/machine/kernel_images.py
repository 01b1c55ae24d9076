"""Which GPUs can run the compiled kernel libraries the server loads, read before it starts.

"CUDA error: no kernel image is available for execution on the device" is the failure SM120
users hit most: a wheel built without SASS for their GPU and without PTX the driver could JIT.
It surfaces late, inside CUDA-graph capture. This module reads the GPU code embedded in each
library (pure Python, no torch, no GPU) so `doctor` can list the gaps up front:

    from sglang_sm120.machine.kernel_images import check_coverage
    for result in check_coverage((12, 0)):
        print(result.library.path.name, result.coverage.how, result.coverage.detail)

Format notes (learned from public fatbin parsers and checked against `cuobjdump --list-elf
--list-ptx` on nvcc 13.0 output; the tests re-check this on every run):
- A host shared object keeps its GPU code in the ELF section `.nv_fatbin` (linked, what the
  CUDA runtime loads) and, with -rdc, also `__nv_relfatbin` (pre-link objects). Like cuobjdump
  we read the executable one and fall back to the relocatable one only when it is absent.
- The section holds fatbin containers, one per compiled unit: a 16-byte header (magic
  0xBA55ED50, version, header size, payload size), then entries. Each entry header says its
  kind (1 = PTX, 2 = ELF cubin), SM number, flags and payload sizes. Headers are never
  compressed, so targets are read without unpacking anything; payloads (zstd in CUDA 13
  output, LZ4 in older toolkits) are unpacked only to tell kernel-less containers apart (the
  CUDA runtime stub nvcc links into every library), via `zstandard`, an sglang dependency.
- Entry flag 0x100000 marks an arch-specific target (sm_120a), 0x200000 a family one
  (sm_120f). cuobjdump prints an 'f' cubin as plain sm_120 (the cubin itself does not record
  'f'); we keep the 'f' from the fatbin header.
- A bare cubin (ELF machine EM_CUDA) records its SM in e_flags; its a/f suffix is only in the
  ptxas command line kept in the `.note.nv.tkinfo` note, which we read when present.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import mmap
import os
import re
import shutil
import struct
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_sm120.machine.cache import cache_dir, relative_problem
from sglang_sm120.strict_json import read_json_file

FATBIN_MAGIC = 0xBA55ED50
_FATBIN_MAGIC_BYTES = struct.pack("<I", FATBIN_MAGIC)
_KIND_PTX = 1
_KIND_ELF = 2
_FLAG_COMPRESSED_LZ4 = 0x2000
_FLAG_COMPRESSED_ZSTD = 0x8000
_FLAG_ARCH_SPECIFIC = 0x100000  # "a" targets
_FLAG_FAMILY_SPECIFIC = 0x200000  # "f" targets
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_EM_CUDA = 190
_SHT_NOBITS = 8
_EXECUTABLE_FATBIN = ".nv_fatbin"
_RELOCATABLE_FATBIN = "__nv_relfatbin"
_KERNEL_FILE_SUFFIXES = (".so", ".cubin", ".fatbin")
_TARGET_PATTERN = re.compile(r"^(sm|compute)_(\d+)([af]?)$")


class _FormatError(Exception):
    """The bytes do not look like what the ELF or fatbin layout promises."""


@dataclass(frozen=True)
class FatbinEntry:
    """One image inside a fatbin container: SASS ('sm_120a') or PTX ('compute_120')."""

    container: int
    target: str
    compressed: bool
    has_kernels: bool | None = None  # None: compressed in a format this Python cannot unpack


@dataclass(frozen=True)
class KernelImage:
    """The GPU targets embedded in one library (or one directory of cubins).

    `units` holds the targets of each fatbin container that defines kernels: every container
    is a compiled unit whose kernels need their own runnable image, so a library is covered
    only when every unit is (a union of all archs would hide a unit built for sm_90a only).
    `sass_archs`/`ptx_archs` list every target present, as cuobjdump does.
    """

    path: Path
    sass_archs: tuple[str, ...]
    ptx_archs: tuple[str, ...]
    units: tuple[frozenset[str], ...] = ()
    error: str | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Coverage:
    """Whether a library can run on a GPU, and how.

    how: 'sass' (native code), 'ptx-jit' (driver compiles PTX at first load), 'none' (the
    "no kernel image is available" case), 'no-kernels' (no GPU code to check) or 'unreadable'.
    """

    ok: bool
    how: str
    detail: str


@dataclass(frozen=True)
class ServerLibrary:
    """A compiled kernel library on disk and whether every server start loads it."""

    path: Path
    package: str
    required: bool
    why: str


@dataclass(frozen=True)
class LibraryCoverage:
    library: ServerLibrary
    image: KernelImage
    coverage: Coverage


# ----------------------------------------------------------------------------- coverage rule


def _parse_target(target: str) -> tuple[str, int, int, str]:
    match = _TARGET_PATTERN.match(target)
    if match is None:
        raise ValueError(f"not a GPU target name: {target!r} (expected e.g. sm_120a, compute_90)")
    kind, number, suffix = match.group(1), int(match.group(2)), match.group(3)
    return kind, number // 10, number % 10, suffix


def runs_on(target: str, capability: tuple[int, int]) -> bool:
    """Whether the driver can run `target` ('sm_120a' SASS or 'compute_90' PTX) on a GPU.

    Rules, from NVIDIA's documentation:
    - SASS sm_XY runs on X.Z for Z >= Y, same major only ("a cubin generated for compute
      capability 8.6 is supported to run on a GPU with compute capability 8.9", CUDA
      application compatibility guides, e.g. docs.nvidia.com/cuda/ada-compatibility-guide).
      So plain sm_120 SASS runs on SM121 (12.1, DGX Spark).
    - 'a' (arch-specific) code runs only on exactly X.Y: sm_120a does NOT run on 12.1.
    - 'f' (family-specific, CUDA 12.9+) code runs on the same major with minor >= Y, e.g.
      sm_100f on 10.0 and 10.3, sm_120f on 12.0 and 12.1 (NVIDIA blog "NVIDIA Blackwell and
      NVIDIA CUDA 12.9 Introduce Family-Specific Architecture Features"). FlashInfer's
      `cuda_binary_target_compatibility_score` encodes the same rule. (SGLang's JIT still
      builds sm_121a for 12.1, citing illegal-instruction errors of some CUTLASS kernels,
      which is about those kernels' features, not about loading.)
    - Plain PTX compute_XY is JIT-compiled by the driver for any GPU of capability >= X.Y;
      'a'/'f' PTX follows the same exact/family limits as its SASS.
    """
    kind, major, minor, suffix = _parse_target(target)
    device_major, device_minor = capability
    if suffix == "a":
        return (major, minor) == (device_major, device_minor)
    if suffix == "f" or kind == "sm":
        return major == device_major and minor <= device_minor
    return (major, minor) <= (device_major, device_minor)


def _describe(targets: Iterable[str]) -> str:
    return ", ".join(sorted(targets, key=_target_sort_key)) or "nothing"


def coverage(image: KernelImage, capability: tuple[int, int]) -> Coverage:
    """Whether every compiled unit of `image` has an image the GPU `capability` can run."""
    device = f"{capability[0]}.{capability[1]}"
    if image.error is not None:
        return Coverage(False, "unreadable", f"could not read GPU code: {image.error}")
    if not image.units:
        return Coverage(True, "no-kernels", "defines no GPU kernels, so needs no image")
    uncovered = [unit for unit in image.units if not any(runs_on(t, capability) for t in unit)]
    if uncovered:
        missing = set().union(*uncovered)
        return Coverage(
            False,
            "none",
            f"{len(uncovered)} of {len(image.units)} compiled units have no SASS for {device} "
            f"and no PTX to JIT (they carry {_describe(missing)}): their kernels fail with "
            "'no kernel image is available'",
        )
    sass = [t for t in image.sass_archs if runs_on(t, capability)]
    if all(
        any(runs_on(t, capability) for t in unit if t.startswith("sm_")) for unit in image.units
    ):
        return Coverage(True, "sass", f"native code for {device}: {_describe(sass)}")
    ptx = [t for t in image.ptx_archs if runs_on(t, capability)]
    return Coverage(
        True,
        "ptx-jit",
        f"some compiled units have no SASS for {device}; the driver JIT-compiles their "
        f"{_describe(ptx)} PTX at first load (slow first start, cached by the driver after)",
    )


# ----------------------------------------------------------------------------- parsing


def _target_sort_key(target: str) -> tuple[int, str, str]:
    kind, major, minor, suffix = _parse_target(target)
    return major * 10 + minor, suffix, kind


def _target_name(kind: int, sm: int, flags: int) -> str:
    suffix = ""
    if flags & _FLAG_ARCH_SPECIFIC:
        suffix = "a"
    elif flags & _FLAG_FAMILY_SPECIFIC:
        suffix = "f"
    prefix = "compute" if kind == _KIND_PTX else "sm"
    return f"{prefix}_{sm}{suffix}"


def _unpack(fmt: str, data: mmap.mmap | bytes, offset: int, limit: int) -> tuple:
    if offset < 0 or offset + struct.calcsize(fmt) > limit:
        raise _FormatError(f"truncated structure at offset {offset:#x}")
    return struct.unpack_from(fmt, data, offset)


def _zstd_decompress(payload: bytes, size: int) -> bytes | None:
    """zstd is how CUDA 13 compresses fatbin entries; sglang 0.5.23 requires `zstandard`."""
    try:
        import zstandard
    except ImportError:
        return None
    try:
        return zstandard.ZstdDecompressor().decompress(payload, max_output_size=size)
    except zstandard.ZstdError:
        return None


def _payload_has_kernels(kind: int, payload: bytes) -> bool | None:
    """Whether an image defines any kernel: PTX with an .entry, a cubin with a .text section.

    nvcc links libcudart_static's device stub into every library it links: a container
    whose cubins define nothing, built for the link step's archs. No kernel in it can be
    launched, so no image is needed for it; counting it would raise false alarms.
    """
    if kind == _KIND_PTX:
        return b".entry" in payload
    try:
        return any(name.startswith(".text.") for name in _elf_sections(payload))
    except (_FormatError, struct.error, IndexError):
        return None


def _entry_has_kernels(data: mmap.mmap | bytes, entry: int, kind: int, flags: int) -> bool | None:
    entry_header_size, padded_size = _unpack("<IQ", data, entry + 4, len(data))
    compressed_size, _ = _unpack("<II", data, entry + 16, len(data))
    (uncompressed_size,) = _unpack("<Q", data, entry + 56, len(data))
    start = entry + entry_header_size
    if not flags & (_FLAG_COMPRESSED_LZ4 | _FLAG_COMPRESSED_ZSTD):
        return _payload_has_kernels(kind, data[start : start + padded_size])
    payload = data[start : start + (compressed_size or padded_size)]
    if not flags & _FLAG_COMPRESSED_ZSTD or not payload.startswith(_ZSTD_MAGIC):
        return None  # LZ4 (older toolkits) is not unpacked here: assume it has kernels
    unpacked = _zstd_decompress(payload, uncompressed_size or 16 * len(payload))
    return None if unpacked is None else _payload_has_kernels(kind, unpacked)


def _walk_fatbin(data: mmap.mmap | bytes, start: int, end: int) -> list[FatbinEntry]:
    """Read every container between `start` and `end`; containers may be padded apart."""
    entries: list[FatbinEntry] = []
    container = 0
    position = start
    while True:
        position = data.find(_FATBIN_MAGIC_BYTES, position, end)
        if position < 0:
            return entries
        _, _, header_size, payload_size = _unpack("<IHHQ", data, position, end)
        container_end = position + header_size + payload_size
        if header_size < 16 or container_end > end:
            raise _FormatError(f"fatbin container at {position:#x} runs past its section")
        entry = position + header_size
        while entry < container_end:
            kind, _, entry_header_size, padded_size = _unpack("<HHIQ", data, entry, container_end)
            (sm,) = _unpack("<I", data, entry + 28, container_end)
            (flags,) = _unpack("<Q", data, entry + 40, container_end)
            if entry_header_size < 64 or entry + entry_header_size + padded_size > container_end:
                raise _FormatError(f"fatbin entry at {entry:#x} runs past its container")
            if kind in (_KIND_PTX, _KIND_ELF):
                entries.append(
                    FatbinEntry(
                        container,
                        _target_name(kind, sm, flags),
                        bool(flags & (_FLAG_COMPRESSED_LZ4 | _FLAG_COMPRESSED_ZSTD)),
                        _entry_has_kernels(data, entry, kind, flags),
                    )
                )
            entry += entry_header_size + padded_size
        container += 1
        position = container_end


def _elf_sections(data: mmap.mmap | bytes) -> dict[str, tuple[int, int, int]]:
    """Section name -> (offset, size, type) of a 64-bit little-endian ELF file."""
    size = len(data)
    if data[4] != 2 or data[5] != 1:
        raise _FormatError("only 64-bit little-endian ELF files are supported")
    (section_table,) = _unpack("<Q", data, 0x28, size)
    entry_size, count, names_index = _unpack("<HHH", data, 0x3A, size)
    if count == 0 and section_table:  # more than 0xff00 sections: real count in section 0
        (count,) = _unpack("<Q", data, section_table + 0x20, size)
    if names_index == 0xFFFF:
        (names_index,) = _unpack("<I", data, section_table + 0x28, size)
    headers = [_unpack("<IIQQQQ", data, section_table + i * entry_size, size) for i in range(count)]
    if names_index >= len(headers):
        raise _FormatError("section name table index out of range")
    names_offset = headers[names_index][4]
    sections = {}
    for name_offset, section_type, _, _, offset, length in headers:
        name_start = names_offset + name_offset
        name_end = data.find(b"\0", name_start, size)
        if name_end < 0:
            raise _FormatError("unterminated section name")
        name = data[name_start:name_end].decode("latin-1")
        sections[name] = (offset, length, section_type)
    return sections


def _fatbin_entries_of_host_elf(data: mmap.mmap) -> list[FatbinEntry]:
    sections = _elf_sections(data)
    for name in (_EXECUTABLE_FATBIN, _RELOCATABLE_FATBIN):
        if name in sections:
            offset, length, section_type = sections[name]
            if section_type == _SHT_NOBITS or offset + length > len(data):
                raise _FormatError(f"section {name} has no data in the file")
            return _walk_fatbin(data, offset, offset + length)
    return []


def _cubin_target(data: mmap.mmap) -> tuple[str, tuple[str, ...]]:
    """Target of a bare cubin: SM from e_flags, a/f suffix from the ptxas note if present."""
    (flags,) = _unpack("<I", data, 0x30, len(data))
    abi_version = data[8]
    # The CUDA ELF ABI moved the SM number from bits 0-7 to bits 8-15 of e_flags in version 8.
    sm = (flags >> 8) & 0xFF if abi_version >= 8 else flags & 0xFF
    note = _elf_sections(data).get(".note.nv.tkinfo")
    if note is not None:
        text = data[note[0] : note[0] + note[1]].decode("latin-1")
        match = re.search(rf"-arch[= ]sm_{sm}([af]?)\b", text)
        if match is not None:
            return f"sm_{sm}{match.group(1)}", ()
    return f"sm_{sm}", (f"sm_{sm}: could not tell whether it is an a/f variant (no ptxas note)",)


def _read_entries(path: str | os.PathLike[str]) -> tuple[list[FatbinEntry], tuple[str, ...]]:
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size < 64:
            raise _FormatError("file too small to hold GPU code")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] == _FATBIN_MAGIC_BYTES:
                return _walk_fatbin(data, 0, len(data)), ()
            if data[:4] != b"\x7fELF":
                raise _FormatError("neither an ELF file nor a fatbin")
            (machine,) = _unpack("<H", data, 18, len(data))
            if machine == _EM_CUDA:
                target, notes = _cubin_target(data)
                return [FatbinEntry(0, target, False, _payload_has_kernels(_KIND_ELF, data))], notes
            return _fatbin_entries_of_host_elf(data), ()


def read_fatbin_entries(path: str | os.PathLike[str]) -> list[FatbinEntry]:
    """Every SASS/PTX entry in a host ELF, a bare cubin or a fatbin file. Raises on bad input."""
    return _read_entries(path)[0]


def _image_from_entries(
    path: Path, entries: list[FatbinEntry], error: str | None, notes: tuple[str, ...]
) -> KernelImage:
    containers: dict[int, list[FatbinEntry]] = {}
    for entry in entries:
        containers.setdefault(entry.container, []).append(entry)
    units = []
    for key in sorted(containers):
        verdicts = {entry.has_kernels for entry in containers[key]}
        if False in verdicts and True not in verdicts:
            continue  # defines no kernel, so needs no image (see _payload_has_kernels)
        units.append(frozenset(entry.target for entry in containers[key]))
    if len(units) < len(containers):
        skipped = len(containers) - len(units)
        notes += (f"{skipped} fatbin container(s) define no kernels and need no image",)
    targets = {entry.target for entry in entries}
    return KernelImage(
        path=path,
        sass_archs=tuple(sorted((t for t in targets if t.startswith("sm_")), key=_target_sort_key)),
        ptx_archs=tuple(
            sorted((t for t in targets if t.startswith("compute_")), key=_target_sort_key)
        ),
        units=tuple(units),
        error=error,
        notes=notes,
    )


def _scan_file(path: Path) -> KernelImage:
    try:
        entries, notes = _read_entries(path)
    except (OSError, ValueError, _FormatError, struct.error) as error:
        return KernelImage(path, (), (), (), f"{type(error).__name__}: {error}")
    return _image_from_entries(path, entries, None, notes)


def _scan_directory(path: Path) -> KernelImage:
    """A directory of per-arch cubins/modules: one unit, the union of what its files hold.

    The loader (e.g. FlashInfer) picks the file matching the GPU, so one runnable file is
    enough; unreadable files are reported in `notes`.
    """
    files = sorted(p for p in path.rglob("*") if p.suffix in _KERNEL_FILE_SUFFIXES and p.is_file())
    targets: set[str] = set()
    notes = []
    for file in files:
        image = _scan_file(file)
        targets.update(image.sass_archs, image.ptx_archs)
        if image.error is not None:
            notes.append(f"{file.name}: {image.error}")
    entries = [FatbinEntry(0, target, False, None) for target in targets]
    error = None if files else "no .so/.cubin/.fatbin files in this directory"
    return _image_from_entries(path, entries, error, tuple(notes))


def scan_library(path: str | os.PathLike[str]) -> KernelImage:
    """The GPU targets embedded in a library file or a directory of them. Never raises."""
    path = Path(path)
    try:
        if path.is_dir():
            return _scan_directory(path)
    except OSError as error:
        return KernelImage(path, (), (), (), f"{type(error).__name__}: {error}")
    return _scan_file(path)


# ----------------------------------------------------------------------------- cuobjdump


def find_cuobjdump() -> Path | None:
    """cuobjdump from PATH, CUDA_HOME, /usr/local/cuda, or the copy Triton ships."""
    candidates = [shutil.which("cuobjdump")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "cuobjdump"))
    triton = importlib.util.find_spec("triton")
    if triton is not None and triton.origin:
        candidates.append(
            os.path.join(os.path.dirname(triton.origin), "backends/nvidia/bin/cuobjdump")
        )
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


_CUOBJDUMP_LINE = re.compile(r"^(ELF|PTX) file\s+\d+:\s+\S*?\.(sm_\d+[af]?)\.(?:cubin|ptx)\s*$")


def scan_with_cuobjdump(
    path: str | os.PathLike[str], cuobjdump: str | os.PathLike[str] | None = None
) -> KernelImage | None:
    """Cross-check: the targets `cuobjdump --list-elf --list-ptx` names, or None without it.

    cuobjdump names an 'f' cubin without its suffix (sm_120f SASS shows as sm_120); it lists
    no per-unit grouping, so `units` is left empty.
    """
    tool = Path(cuobjdump) if cuobjdump else find_cuobjdump()
    if tool is None:
        return None
    result = subprocess.run(
        [str(tool), "--list-elf", "--list-ptx", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    sass, ptx = set(), set()
    for line in result.stdout.splitlines():
        match = _CUOBJDUMP_LINE.match(line.strip())
        if match is None:
            continue
        if match.group(1) == "ELF":
            sass.add(match.group(2))
        else:
            ptx.add(match.group(2).replace("sm_", "compute_", 1))
    error = None
    if result.returncode not in (0, 255) or "fatal" in result.stderr:
        error = result.stderr.strip() or f"cuobjdump exited with {result.returncode}"
    return KernelImage(
        Path(path),
        tuple(sorted(sass, key=_target_sort_key)),
        tuple(sorted(ptx, key=_target_sort_key)),
        error=error,
    )


# ----------------------------------------------------------------------------- discovery


def _package_dir(module: str) -> Path | None:
    """Directory of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _sgl_kernel_libraries(capability: tuple[int, int] | None) -> list[ServerLibrary]:
    package = _package_dir("sgl_kernel")
    if package is None:
        return []
    # sgl_kernel/load_utils.py::_load_architecture_specific_ops loads sm90/common_ops on a
    # 9.0 GPU and sm100/common_ops on every other GPU (SM120 included); nothing else at import.
    if capability is None:
        variants = {"sm90", "sm100"}
    else:
        variants = {"sm90" if capability == (9, 0) else "sm100"}
    libraries = []
    for file in sorted(package.rglob("*.so")):
        variant = file.parent.name
        if file.name.startswith("common_ops"):
            if variant not in variants:
                continue
            why = (
                f"sglang-kernel's main ops ({variant} build), loaded when sglang imports sgl_kernel"
            )
            libraries.append(ServerLibrary(file, "sglang-kernel", True, why))
        else:
            why = "loaded only by the attention backend or feature that uses it"
            libraries.append(ServerLibrary(file, "sglang-kernel", False, why))
    return libraries


def _flashinfer_bundles() -> list[ServerLibrary]:
    """Prebuilt FlashInfer kernels, if their optional packages are installed (else JIT)."""
    bundles = []
    for module, package, why in (
        ("flashinfer_cubin", "flashinfer-cubin", "FlashInfer's prebuilt cubins (picked per GPU)"),
        (
            "flashinfer_jit_cache",
            "flashinfer-jit-cache",
            "FlashInfer's AOT modules (picked per GPU)",
        ),
    ):
        directory = _package_dir(module)
        if directory is not None:
            bundles.append(ServerLibrary(directory, package, False, why))
    flashinfer = _package_dir("flashinfer")
    if flashinfer is not None and (flashinfer / "data" / "aot").is_dir():
        why = "FlashInfer's AOT modules shipped inside flashinfer-python"
        bundles.append(ServerLibrary(flashinfer / "data" / "aot", "flashinfer-python", False, why))
    return bundles


# Kernel wheels SGLang imports only for particular backends (MLA decode, expert parallelism).
_OPTIONAL_KERNEL_PACKAGES = (
    ("flash_mla", "sgl-flash-mla", "loaded only by the FlashMLA attention backend"),
    ("deep_ep", "sgl-deep-ep", "loaded only with --moe-a2a-backend deepep"),
    ("deep_gemm", "sgl-deep-gemm", "loaded only by DeepGEMM paths (its kernels are JIT)"),
)


def discover_server_libraries(capability: tuple[int, int] | None = None) -> list[ServerLibrary]:
    """Compiled kernel libraries the server may load; absent packages are simply skipped.

    With `capability`, sglang-kernel's common_ops is narrowed to the build it loads there.
    """
    libraries = _sgl_kernel_libraries(capability)
    ours = _package_dir("sgl_kernel_sm120")
    if ours is not None:
        for file in sorted(ours.rglob("*.so")):
            why = "sgl-kernel-sm120's PCIe all-reduce kernels"
            libraries.append(ServerLibrary(file, "sgl-kernel-sm120", True, why))
    for module, package, why in _OPTIONAL_KERNEL_PACKAGES:
        directory = _package_dir(module)
        if directory is not None:
            libraries += [
                ServerLibrary(f, package, False, why) for f in sorted(directory.rglob("*.so"))
            ]
    return libraries + _flashinfer_bundles()


def check_coverage(
    capability: tuple[int, int],
    libraries: Iterable[ServerLibrary | str | os.PathLike[str]] | None = None,
) -> list[LibraryCoverage]:
    """Scan each library and judge it for `capability`; bare paths count as required."""
    if libraries is None:
        libraries = discover_server_libraries(capability)
    results = []
    scans = ScanCache.load()
    for library in libraries:
        if not isinstance(library, ServerLibrary):
            library = ServerLibrary(Path(library), "", True, "given explicitly")
        image = scans.scan(library.path)
        results.append(LibraryCoverage(library, image, coverage(image, capability)))
    scans.save()
    return results


# ----------------------------------------------------------------------------- scan cache


class ScanCache:
    """Scans of library files kept in the cache directory, keyed by (path, size, mtime): the
    same file is not read again (sglang-kernel alone is ~370 MB of libraries). Written only
    into a cache directory that exists (``tune``, ``p2p`` and doctor's
    plugin check create it); a cache that cannot be read or written only costs the scan."""

    VERSION = 1
    MAX_BYTES = 4 << 20

    def __init__(self, path: Path, entries: dict[str, Any]) -> None:
        self.path, self.entries, self.changed = path, entries, False

    @classmethod
    def load(cls) -> ScanCache:
        path = cache_dir() / f"kernel-images-v{cls.VERSION}.json"
        try:
            if relative_problem(path.parent):  # refused, as every reader of the cache does
                raise ValueError(relative_problem(path.parent))
            document = read_json_file(path, cls.MAX_BYTES)
            entries = document["libraries"] if document.get("version") == cls.VERSION else {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            entries = {}
        return cls(path, entries if isinstance(entries, dict) else {})

    def scan(self, path: Path) -> KernelImage:
        try:
            info = path.stat()
        except OSError:
            return scan_library(path)
        if not path.is_file():  # a directory of cubins: its mtime misses edits inside it
            return scan_library(path)
        key, stamp = str(path), [info.st_size, info.st_mtime_ns]
        cached = self.entries.get(key)
        if isinstance(cached, dict) and cached.get("stamp") == stamp:
            try:
                return _image_from_json(path, cached["image"])
            except (KeyError, TypeError, ValueError):
                pass
        image = scan_library(path)
        self.entries[key] = {"stamp": stamp, "image": _image_to_json(image)}
        self.changed = True
        return image

    def save(self) -> None:
        """Never raises: a directory that is a file, /dev/null, a loop of links or a name too
        long is only a scan the next doctor does again."""
        if not self.changed or relative_problem(self.path.parent):
            return
        document = {"version": self.VERSION, "libraries": self.entries}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            if not self.path.parent.is_dir():
                return
            tmp.write_text(json.dumps(document))
            tmp.replace(self.path)
        except (OSError, ValueError):
            with contextlib.suppress(OSError, ValueError):
                tmp.unlink(missing_ok=True)


def _image_to_json(image: KernelImage) -> dict[str, Any]:
    return {
        "sass_archs": list(image.sass_archs),
        "ptx_archs": list(image.ptx_archs),
        "units": [sorted(unit) for unit in image.units],
        "error": image.error,
        "notes": list(image.notes),
    }


def _image_from_json(path: Path, data: dict[str, Any]) -> KernelImage:
    def strings(value: Any) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError("not a list of strings")
        return tuple(value)

    error = data["error"]
    if error is not None and not isinstance(error, str):
        raise ValueError("error is not a string")
    return KernelImage(
        path,
        strings(data["sass_archs"]),
        strings(data["ptx_archs"]),
        tuple(frozenset(strings(unit)) for unit in data["units"]),
        error,
        strings(data["notes"]),
    )
