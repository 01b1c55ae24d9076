"""``sglang-sm120 tune`` end to end on the GPUs here (tp 2 and 4; ranks share one GPU when there
are fewer GPUs than ranks). It must measure, check every backend against the float32 reference,
write the table under the cache directory, and the policy must read it back (or, for a table
measured with ranks sharing one GPU, refuse it with that reason)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("tp", [2, 4])
def test_tune_writes_a_checked_table(tp, tmp_path, monkeypatch):
    pytest.importorskip("sgl_kernel_sm120", reason="sgl-kernel-sm120 is not importable")
    monkeypatch.setenv("SGLANG_SM120_CACHE_DIR", str(tmp_path))
    from sglang_sm120.commands.tune import TuneSettings, format_table, run_tune
    from sglang_sm120.machine.facts import current_facts
    from sglang_sm120.planning.tuning import BACKENDS, load_table, winners

    settings = TuneSettings(tp=tp, hidden=2048, tokens=(1, 8, 64, 512), calls=5, replays=3)
    table, path = run_tune(settings)
    print(format_table(table))
    assert path.exists() and path.parent == tmp_path
    ours = [m for m in table.measurements if m.backend == "sm120_pcie"]
    assert [m.tokens for m in ours] == [1, 8, 64, 512]
    assert all(m.correct and m.us is not None and m.us > 0 for m in ours), ours
    assert set(winners(table, prefer=None).values()) <= set(BACKENDS)
    loaded, note = load_table(current_facts(), tp, 2048, "bfloat16")
    if table.ranks_share_gpu:
        assert loaded is None and "sharing one GPU" in note
        assert table.nccl_variants and all(
            m.us is None and "one per rank" in m.note for m in table.nccl_variants
        )
    else:
        assert loaded == table
