"""Warmup: it calls the real upstream loaders, skips with a reason where it cannot build, and
tells a fresh build from a cached one. Building the real modules needs a GPU (minutes each);
on CPU the tests prove the loaders exist with the arguments we pass, and that nothing raises.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sglang_sm120.commands import warmup
from sglang_sm120.commands.warmup import (
    WARMUP_TARGETS,
    WarmupStep,
    WarmupTarget,
    format_steps,
    resolve,
    run_step,
    run_warmup,
)


def _gpu_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.mark.parametrize("target", WARMUP_TARGETS, ids=lambda target: target.function)
def test_each_target_is_an_installed_loader_accepting_our_arguments(target: WarmupTarget):
    if importlib.util.find_spec(target.package) is None:
        pytest.skip(f"{target.package} is not installed")
    loader = resolve(target.function)
    assert callable(loader)
    inspect.signature(loader).bind(*target.arguments(warmup.DEFAULT_VOCAB_SIZE))
    cache = resolve(target.cache_dir)
    assert isinstance(cache() if callable(cache) else cache, os.PathLike)


@pytest.mark.skipif(_gpu_visible(), reason="a GPU is visible: warmup would really build")
@pytest.mark.parametrize("capability", [None, (12, 0)])
def test_without_a_gpu_every_step_is_skipped_with_a_reason(capability):
    steps = run_warmup(capability)
    assert [step.target for step in steps] == [target.function for target in WARMUP_TARGETS]
    for step in steps:
        assert step.status.startswith("skipped: ") and len(step.status) > len("skipped: ")
        assert step.seconds == 0.0
    pairs = zip(steps, WARMUP_TARGETS, strict=True)
    installed = [step for step, target in pairs if importlib.util.find_spec(target.package)]
    assert all("no CUDA GPU" in step.status for step in installed)


def test_dry_run_lists_every_step_in_order():
    steps = run_warmup((12, 0), dry_run=True)
    assert [(s.name, s.target) for s in steps] == [(t.name, t.function) for t in WARMUP_TARGETS]
    for step, target in zip(steps, WARMUP_TARGETS, strict=True):
        installed = importlib.util.find_spec(target.package) is not None
        expected = (
            "skipped: dry run" if installed else f"skipped: {target.package} is not installed"
        )
        assert step.status == expected


def test_dry_run_imports_no_upstream_package():
    code = textwrap.dedent(
        """
        import sys
        from sglang_sm120.commands.warmup import run_warmup
        run_warmup(dry_run=True)
        print(sorted(m for m in ("torch", "flashinfer", "sglang") if m in sys.modules))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.strip() == "[]"


def test_a_gpu_the_loader_does_not_support_is_skipped_with_the_supported_archs():
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed")
    [trtllm] = [s for s in run_warmup((8, 6), dry_run=True) if "trtllm_ar" in s.target]
    assert trtllm.status == (
        "skipped: upstream builds it only for SM9x/SM10x/SM12x; this GPU is 8.6"
    )


def test_a_missing_package_is_skipped_by_name(monkeypatch):
    absent = WarmupTarget("absent", "no_such_package_sm120", "no_such_package_sm120:f", "x:y")
    monkeypatch.setattr(warmup, "WARMUP_TARGETS", (absent,))
    [step] = run_warmup(dry_run=True)
    assert step.status == "skipped: no_such_package_sm120 is not installed"


@pytest.fixture
def fake_jit_module(tmp_path: Path, monkeypatch) -> str:
    """A loader that compiles (writes a .so into its cache) only when the cache lacks it."""
    name = "warmup_fake_jit_module"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            import json
            import pathlib

            CACHE = pathlib.Path(__file__).parent / "cache"


            def load(flavour):
                library = CACHE / flavour / "module.so"
                if not library.exists():
                    library.parent.mkdir(parents=True, exist_ok=True)
                    library.write_bytes(b"built")
                return library


            def broken(flavour):
                return json.loads("{" + flavour)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_a_step_reports_built_first_and_cached_when_run_again(fake_jit_module: str):
    target = WarmupTarget(
        "fake",
        fake_jit_module,
        f"{fake_jit_module}:load",
        f"{fake_jit_module}:CACHE",
        arguments=lambda vocab_size: (f"v{vocab_size}",),
    )
    assert run_step(target).status == "built"
    assert run_step(target).status == "cached"
    assert run_step(target, vocab_size=32000).status == "built"


def test_a_failing_loader_becomes_a_failed_step_naming_the_error(fake_jit_module: str):
    target = WarmupTarget(
        "broken",
        fake_jit_module,
        f"{fake_jit_module}:broken",
        f"{fake_jit_module}:CACHE",
        arguments=lambda vocab_size: ("oops",),
    )
    step = run_step(target)
    assert step.status.startswith("failed: JSONDecodeError: ")


def test_a_renamed_loader_becomes_a_failed_step(fake_jit_module: str):
    target = WarmupTarget("renamed", fake_jit_module, f"{fake_jit_module}:gone", "x:y")
    assert run_step(target).status.startswith("failed: AttributeError: ")


def test_format_steps_shows_each_step_and_the_total_time():
    steps = [
        WarmupStep("first", "a:b", "built", 1.25),
        WarmupStep("second", "c:d", "skipped: no CUDA GPU", 0.0),
    ]
    lines = format_steps(steps).splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("first") and lines[0].endswith("1.2s  built")
    assert lines[1].endswith("skipped: no CUDA GPU")
    assert lines[2].startswith("total") and lines[2].endswith("1.2s  1 built, 1 skipped")


def test_progress_says_when_each_step_starts_and_ends(fake_jit_module: str, monkeypatch):
    import io

    target = WarmupTarget(
        "fake",
        fake_jit_module,
        f"{fake_jit_module}:load",
        f"{fake_jit_module}:CACHE",
        arguments=lambda vocab_size: ("p",),
    )
    monkeypatch.setattr(warmup, "WARMUP_TARGETS", (target,))
    monkeypatch.setattr(warmup, "visible_capability", lambda: (12, 0))
    stream = io.StringIO()
    [step] = run_warmup(progress=stream)
    assert step.status == "built"
    assert stream.getvalue().splitlines() == [
        "[1/1] fake: building...",
        f"[1/1] fake: built ({step.seconds:.1f} s)",
    ]


def test_one_gpu_skips_the_all_reduce_fusion_build_with_the_reason():
    """Seen live on the 1x H200: trtllm_comm built for over 6 minutes although a one-GPU
    server has no all-reduce to fuse, and the EAGLE kernels waited behind it."""
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed")
    steps = {s.target: s for s in run_warmup((9, 0), gpu_count=1, dry_run=True)}
    [trtllm] = [s for t, s in steps.items() if "trtllm_ar" in t]
    assert trtllm.status == (
        "skipped: 1 GPU visible: no all-reduce to fuse (a server builds it at TP >= 2)"
    )
    two = run_warmup((9, 0), gpu_count=2, dry_run=True)
    assert [s.status for s in two if "trtllm_ar" in s.target] == ["skipped: dry run"]


def test_the_kernels_every_eagle3_server_needs_are_built_before_the_fusion_module():
    order = [target.function for target in WARMUP_TARGETS]
    fusion = next(i for i, f in enumerate(order) if "trtllm_ar" in f)
    speculative = [i for i, f in enumerate(order) if ".speculative." in f]
    assert speculative and max(speculative) < fusion
