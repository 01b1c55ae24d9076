"""Kernel-image scanning: it reads what nvcc embedded, agrees with cuobjdump, and judges
coverage by NVIDIA's compatibility rules.

The libraries are compiled here at test time with the local nvcc (a one-line kernel, a few
seconds); the tests that need nvcc or cuobjdump skip with a reason where they are missing.
"""

from __future__ import annotations

import _ctypes
import os
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
from sglang_sm120.machine.kernel_images import (
    KernelImage,
    ServerLibrary,
    check_coverage,
    coverage,
    discover_server_libraries,
    find_cuobjdump,
    read_fatbin_entries,
    runs_on,
    scan_library,
    scan_with_cuobjdump,
)


def _find_nvcc() -> list[str] | None:
    """nvcc as the kernel build finds it (CUDACXX, PATH, /usr/local/cuda), plus the library
    folder PyPI's nvcc needs: its nvcc.profile says lib64, the wheels ship lib (CMakeLists.txt)."""
    for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            root = Path(candidate).resolve().parents[1]
            pypi_layout = not (root / "lib64" / "libcudadevrt.a").exists()
            if pypi_layout and (root / "lib" / "libcudadevrt.a").exists():
                return [candidate, f"-L{root / 'lib'}"]
            return [candidate]
    return None


NVCC = _find_nvcc()
CUOBJDUMP = find_cuobjdump()
needs_nvcc = pytest.mark.skipif(
    NVCC is None, reason="nvcc not found (CUDACXX, PATH, /usr/local/cuda)"
)
needs_cuobjdump = pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not found")

KERNEL_SOURCE = """
__global__ void add_one(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1.0f;
}
extern "C" void launch(float* x, int n) { add_one<<<(n + 255) / 256, 256>>>(x, n); }
"""

SHARED = ["-shared", "-Xcompiler", "-fPIC"]
COMPRESS = ["-Xfatbin", "-compress-all"]

# file name -> (nvcc arguments, SASS targets it must hold, PTX targets it must hold)
BUILDS: dict[str, tuple[list[str], tuple[str, ...], tuple[str, ...]]] = {
    "sm90_sass_only.so": (
        [*SHARED, "-gencode", "arch=compute_90,code=sm_90"],
        ("sm_90",),
        (),
    ),
    "sm120_sass_and_ptx.so": (
        [*SHARED, "-gencode", "arch=compute_120,code=[sm_120,compute_120]"],
        ("sm_120",),
        ("compute_120",),
    ),
    "sm120_sass_and_ptx_compressed.so": (
        [*SHARED, *COMPRESS, "-gencode", "arch=compute_120,code=[sm_120,compute_120]"],
        ("sm_120",),
        ("compute_120",),
    ),
    "arch_and_family_specific_compressed.so": (
        [
            *SHARED,
            *COMPRESS,
            "-gencode",
            "arch=compute_120a,code=sm_120a",
            "-gencode",
            "arch=compute_100f,code=sm_100f",
            "-gencode",
            "arch=compute_90,code=compute_90",
        ],
        ("sm_100f", "sm_120a"),
        ("compute_90",),
    ),
    # With -rdc the PTX stays in the pre-link objects (__nv_relfatbin); the runtime loads only
    # the linked .nv_fatbin, which holds SASS alone.
    "relocatable_sm120.so": (
        [*SHARED, "-rdc=true", "-gencode", "arch=compute_120,code=[sm_120,compute_120]"],
        ("sm_120",),
        (),
    ),
    "family_sm120f.cubin": (
        ["-cubin", "-gencode", "arch=compute_120f,code=sm_120f"],
        ("sm_120f",),
        (),
    ),
    "arch_sm120a.cubin": (
        ["-cubin", "-gencode", "arch=compute_120a,code=sm_120a"],
        ("sm_120a",),
        (),
    ),
    "mixed.fatbin": (
        [
            "-fatbin",
            "-gencode",
            "arch=compute_120a,code=sm_120a",
            "-gencode",
            "arch=compute_90,code=compute_90",
        ],
        ("sm_120a",),
        ("compute_90",),
    ),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Compile every entry of BUILDS (in parallel: each nvcc call takes ~2 s)."""
    if NVCC is None:
        pytest.skip("nvcc not found (CUDACXX, PATH, /usr/local/cuda)")
    directory = tmp_path_factory.mktemp("kernel_images")
    source = directory / "add_one.cu"
    source.write_text(KERNEL_SOURCE)
    jobs = {
        name: subprocess.Popen(
            [*NVCC, *arguments, "-o", str(directory / name), str(source)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, (arguments, _, _) in BUILDS.items()
    }
    for name, job in jobs.items():
        output, _ = job.communicate()
        assert job.returncode == 0, f"nvcc failed for {name}:\n{output}"
    # Compiled for sm_120, linked by nvcc for sm_80: the link adds libcudart_static's device
    # stub, a fatbin container with no kernel, built for the link step's arch only.
    objects = directory / "add_one.o"
    link_stub = directory / "linked_with_cudart_stub.so"
    for arguments in (
        [
            "-c",
            "-Xcompiler",
            "-fPIC",
            "-gencode",
            "arch=compute_120,code=sm_120",
            "-o",
            str(objects),
            str(source),
        ],
        ["-shared", "-gencode", "arch=compute_80,code=sm_80", "-o", str(link_stub), str(objects)],
    ):
        subprocess.run([*NVCC, *arguments], check=True, capture_output=True)
    return {name: directory / name for name in BUILDS} | {link_stub.name: link_stub}


@needs_nvcc
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_scan_finds_exactly_the_targets_nvcc_was_asked_for(built: dict[str, Path], name: str):
    _, sass, ptx = BUILDS[name]
    image = scan_library(built[name])
    assert image.error is None
    assert (image.sass_archs, image.ptx_archs) == (sass, ptx)


@needs_nvcc
@needs_cuobjdump
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_scan_agrees_with_cuobjdump(built: dict[str, Path], name: str):
    ours = scan_library(built[name])
    theirs = scan_with_cuobjdump(built[name], CUOBJDUMP)
    assert theirs is not None and theirs.error is None
    # cuobjdump prints an 'f' cubin without its suffix; everything else must match exactly.
    assert tuple(t.removesuffix("f") for t in ours.sass_archs) == theirs.sass_archs
    assert ours.ptx_archs == theirs.ptx_archs


@needs_nvcc
def test_compress_all_marks_every_image_compressed_and_default_leaves_cubins_plain(
    built: dict[str, Path],
):
    compressed = read_fatbin_entries(built["sm120_sass_and_ptx_compressed.so"])
    default = read_fatbin_entries(built["sm90_sass_only.so"])
    assert compressed and all(entry.compressed for entry in compressed)
    assert default and not any(entry.compressed for entry in default)


@needs_nvcc
def test_the_kernel_less_cuda_runtime_stub_needs_no_image(built: dict[str, Path]):
    path = built["linked_with_cudart_stub.so"]
    entries = read_fatbin_entries(path)
    assert {(e.target, e.has_kernels) for e in entries} == {("sm_80", False), ("sm_120", True)}
    image = scan_library(path)
    assert image.sass_archs == ("sm_80", "sm_120")  # as cuobjdump lists them
    assert image.units == (frozenset({"sm_120"}),)
    assert coverage(image, (12, 0)).how == "sass"


@needs_nvcc
def test_a_library_runs_where_nvidia_says_its_images_run(built: dict[str, Path]):
    sm90 = scan_library(built["sm90_sass_only.so"])
    sm120 = scan_library(built["sm120_sass_and_ptx.so"])
    specific = scan_library(built["arch_and_family_specific_compressed.so"])
    relocatable = scan_library(built["relocatable_sm120.so"])
    assert coverage(sm90, (9, 0)).how == "sass"
    assert coverage(sm90, (12, 0)).how == "none" and not coverage(sm90, (12, 0)).ok
    assert coverage(sm120, (12, 0)).how == "sass"
    assert coverage(sm120, (12, 1)).how == "sass"  # plain sm_120 SASS runs on 12.1
    assert coverage(sm120, (13, 0)).how == "ptx-jit"
    assert coverage(specific, (12, 0)).how == "sass"
    assert coverage(specific, (12, 1)).how == "ptx-jit"  # sm_120a does not, compute_90 does
    assert coverage(specific, (10, 3)).how == "sass"  # sm_100f covers the 10.x family
    assert coverage(relocatable, (13, 0)).how == "none"  # its PTX is never loaded


@needs_nvcc
def test_a_directory_of_per_arch_files_is_covered_where_one_file_runs(
    built: dict[str, Path], tmp_path: Path
):
    for name in ("arch_sm120a.cubin", "sm90_sass_only.so"):
        shutil.copy(built[name], tmp_path / name)
    image = scan_library(tmp_path)
    assert image.units == (frozenset({"sm_120a", "sm_90"}),)
    assert coverage(image, (12, 0)).ok
    assert coverage(image, (9, 0)).ok
    assert not coverage(image, (12, 1)).ok


# (target, device capability, runs?) - NVIDIA's rules, see runs_on's docstring for sources.
RUNS_ON_TABLE = [
    ("sm_120", (12, 0), True),
    ("sm_120", (12, 1), True),
    ("sm_121", (12, 0), False),
    ("sm_120a", (12, 0), True),
    ("sm_120a", (12, 1), False),
    ("sm_121a", (12, 1), True),
    ("sm_120f", (12, 1), True),
    ("sm_121f", (12, 0), False),
    ("sm_90", (9, 0), True),
    ("sm_90a", (12, 0), False),
    ("sm_100", (12, 0), False),
    ("sm_100f", (10, 3), True),
    ("sm_103a", (10, 0), False),
    ("sm_86", (8, 9), True),
    ("compute_90", (12, 0), True),
    ("compute_120", (12, 0), True),
    ("compute_120", (9, 0), False),
    ("compute_121", (12, 0), False),
    ("compute_120a", (12, 1), False),
    ("compute_120f", (12, 1), True),
    ("compute_100f", (12, 0), False),
]


@pytest.mark.parametrize(("target", "capability", "expected"), RUNS_ON_TABLE)
def test_runs_on_follows_nvidia_compatibility_rules(target, capability, expected):
    assert runs_on(target, capability) is expected


def test_runs_on_rejects_a_name_that_is_not_a_gpu_target():
    with pytest.raises(ValueError, match=r"expected e\.g\. sm_120a, compute_90"):
        runs_on("sm120", (12, 0))


def test_one_uncovered_compiled_unit_makes_the_library_uncovered():
    image = KernelImage(
        Path("lib.so"),
        ("sm_90a", "sm_120a"),
        (),
        units=(frozenset({"sm_90a", "sm_120a"}), frozenset({"sm_90a"})),
    )
    result = coverage(image, (12, 0))
    assert (result.ok, result.how) == (False, "none")
    assert "1 of 2 compiled units" in result.detail and "sm_90a" in result.detail


def test_a_library_without_gpu_code_needs_no_coverage():
    image = scan_library(Path(_ctypes.__file__))  # a host-only CPython extension
    assert image.error is None and image.units == ()
    assert coverage(image, (12, 0)) == coverage(image, (9, 0))
    assert coverage(image, (12, 0)).how == "no-kernels"


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "FileNotFoundError"),
        (b"not a library at all, just some text padding it past 64 bytes" * 2, "neither an ELF"),
        # a fatbin header promising far more payload than the file holds
        (
            bytes.fromhex("50ed55ba01001000") + (1 << 40).to_bytes(8, "little") + b"\0" * 64,
            "runs past",
        ),
    ],
)
def test_an_unreadable_file_is_reported_not_raised(tmp_path: Path, content, reason):
    path = tmp_path / "broken.so"
    if content is not None:
        path.write_bytes(content)
    image = scan_library(path)
    assert reason in (image.error or "")
    result = coverage(image, (12, 0))
    assert (result.ok, result.how) == (False, "unreadable") and reason in result.detail


@needs_nvcc
def test_check_coverage_accepts_plain_paths_as_required(built: dict[str, Path]):
    [result] = check_coverage((12, 0), [built["sm90_sass_only.so"]])
    assert result.library.required and not result.coverage.ok


def _installed_sglang_kernel() -> list[ServerLibrary]:
    return [lib for lib in discover_server_libraries() if lib.package == "sglang-kernel"]


needs_sglang_kernel = pytest.mark.skipif(
    not _installed_sglang_kernel(), reason="sglang-kernel is not installed"
)


@needs_sglang_kernel
@needs_cuobjdump
def test_installed_kernel_libraries_scan_like_cuobjdump():
    for library in discover_server_libraries():
        if library.path.is_dir():
            continue
        ours = scan_library(library.path)
        theirs = scan_with_cuobjdump(library.path, CUOBJDUMP)
        assert ours.error is None, library.path
        assert theirs is not None and theirs.error is None, library.path
        assert tuple(t.removesuffix("f") for t in ours.sass_archs) == theirs.sass_archs, (
            library.path
        )
        assert ours.ptx_archs == theirs.ptx_archs, library.path


@needs_sglang_kernel
def test_sglang_kernel_main_ops_are_the_build_sgl_kernel_loads_for_the_gpu():
    def main_ops(capability):
        return [
            lib.path.parent.name
            for lib in discover_server_libraries(capability)
            if lib.package == "sglang-kernel" and lib.required
        ]

    assert main_ops((9, 0)) == ["sm90"]
    assert main_ops((12, 0)) == ["sm100"]
    assert main_ops((10, 0)) == ["sm100"]


@pytest.mark.skipif(
    not _installed_sglang_kernel() or metadata.version("sglang-kernel") != "0.4.10",
    reason="facts recorded for sglang-kernel 0.4.10 only",
)
def test_sglang_kernel_0_4_10_main_ops_run_on_sm120_but_not_sm121():
    """UPSTREAM.md: main ops ship sm_120a SASS; being arch-specific, not for 12.1 (DGX Spark)."""
    [sm120] = [
        r
        for r in check_coverage((12, 0))
        if r.library.required and r.library.package == "sglang-kernel"
    ]
    [sm121] = [
        r
        for r in check_coverage((12, 1))
        if r.library.required and r.library.package == "sglang-kernel"
    ]
    assert "sm_120a" in sm120.image.sass_archs and sm120.image.ptx_archs == ()
    assert sm120.coverage.how == "sass"
    assert sm121.coverage.how == "none"


def test_the_scan_of_an_unchanged_library_is_read_from_the_cache(tmp_path, monkeypatch):
    """doctor reads ~400 MB of kernel libraries; an unchanged file (path, size, mtime) is not
    read again, a changed one is, and nothing is written where no cache directory exists."""
    from sglang_sm120.machine import kernel_images

    library = tmp_path / "lib" / "libk.so"
    library.parent.mkdir()
    library.write_bytes(b"\0" * 64)  # no ELF: scanned as unreadable, still a scan
    cache = tmp_path / "cache"
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(cache))
    scanned = []
    real_scan = kernel_images.scan_library
    monkeypatch.setattr(kernel_images, "scan_library", lambda p: scanned.append(p) or real_scan(p))

    kernel_images.check_coverage((12, 0), [library])
    assert not cache.exists()  # the scan creates no directory
    cache.mkdir()
    first = kernel_images.check_coverage((12, 0), [library])
    again = kernel_images.check_coverage((12, 0), [library])
    assert len(scanned) == 2 and again[0].image == first[0].image
    library.write_bytes(b"\0" * 65)  # another size: scanned again
    kernel_images.check_coverage((12, 0), [library])
    assert len(scanned) == 3
