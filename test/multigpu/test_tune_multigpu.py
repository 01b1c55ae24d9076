"""``tune`` with one process per GPU: every backend this host has (NCCL + norm always, FlashInfer
trtllm and PCIe-IPC where flashinfer imports, sm120_pcie where sgl-kernel-sm120 does, upstream's
custom all-reduce / MSCCL++ / torch symmetric memory where doctor says they can run) is checked
against the float32 reference over the real interconnect, and the table is one the plan uses.

Needs as many GPUs as ranks; skipped with the reason elsewhere (the single-GPU version with
ranks as streams is test/gpu/test_tune.py)."""

from __future__ import annotations

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.multigpu


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_every_backend_is_correct_over_the_interconnect(tp, tmp_path, monkeypatch):
    if GPUS < tp:
        pytest.skip(f"needs {tp} GPUs, {GPUS} visible")
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(tmp_path))
    from sglang_sm120.commands.tune import TuneSettings, format_table, run_tune, upstream_refusals
    from sglang_sm120.machine.facts import current_facts
    from sglang_sm120.planning.tuning import UPSTREAM_BACKENDS, load_table

    table, _ = run_tune(TuneSettings(tp=tp, tokens=(1, 4, 16, 64, 256), calls=5, replays=3))
    print(format_table(table))
    assert not table.ranks_share_gpu
    measured = [m for m in table.measurements if m.us is not None]
    assert {"nccl", "sm120_pcie", "sm120_pcie_unfused"} <= {m.backend for m in measured}
    wrong = [m for m in measured if not m.correct]
    assert not wrong, wrong
    assert load_table(current_facts(), tp, 7168, "bfloat16")[0] == table
    refused = upstream_refusals(tp)
    for backend in UPSTREAM_BACKENDS:  # measured where doctor says it runs, else the reason
        cells = [m for m in table.measurements if m.backend == backend]
        said = [n for n in table.notes if n.startswith(f"{backend}: ")]
        if backend in refused:
            assert not cells and said == [f"{backend}: {refused[backend]}"], (cells, said)
        else:
            assert cells or (said and said[0].startswith(f"{backend}: unavailable")), said


@pytest.mark.parametrize("tp", [2])
def test_nccl_variants_run_in_fresh_processes_and_keep_their_reasons(tp, tmp_path, monkeypatch):
    """Every variant has a row at every size: timed under capture and correct, or its reason
    (a variant NCCL cannot capture is excluded, never dropped); NCCL's default runs correct."""
    if GPUS < tp:
        pytest.skip(f"needs {tp} GPUs, {GPUS} visible")
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("NCCL_PROTO", "Simple")  # the user's: the default must not inherit it
    from sglang_sm120.commands.tune import TuneSettings, format_table, run_tune
    from sglang_sm120.planning.tuning import NCCL_VARIANTS, PREFILL_TOKENS

    tokens = (1, 64, 1024)
    table, _ = run_tune(TuneSettings(tp=tp, tokens=tokens, calls=5, replays=3))
    print(format_table(table))
    cells = {(m.env, m.tokens): m for m in table.nccl_variants}
    sizes = (*tokens, PREFILL_TOKENS)  # and one chunked-prefill all-reduce
    assert set(cells) == {(env, t) for env in NCCL_VARIANTS for t in sizes}
    assert all(cells[((), t)].correct and cells[((), t)].us for t in sizes)
    for m in table.nccl_variants:
        assert (m.us is not None and m.correct) or m.note, m
