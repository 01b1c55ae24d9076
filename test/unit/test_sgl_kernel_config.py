"""CPU tests of sgl_kernel_sm120's pure-Python parts: workspace sizing, variant and grid
choice, settings resolution, input validation messages, fake (tracing) op shapes, and the
P2P refusal message. No GPU and no built library needed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    import sgl_kernel_sm120 as sk
except ImportError:  # not installed: the pure-Python parts import from the sources
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sgl-kernel-sm120" / "python"))
    import sgl_kernel_sm120 as sk

from sgl_kernel_sm120 import _lib, config, env, workspace

KIB, MIB = 1 << 10, 1 << 20
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name, old_names in env.DEPRECATED.items():
        for variable in (name, *old_names):
            monkeypatch.delenv(variable, raising=False)
    monkeypatch.delenv(env.FUSED_ROWS_PER_BLOCK, raising=False)
    monkeypatch.setattr(env, "_warned", set())  # each test sees its process's first warning


# --------------------------------------------------------------------------- sizing


def test_workspace_bytes_follow_the_readme_formula_at_8_ranks_hidden_7168():
    # README: bytes = 40 KiB + 3 N L + 2 N C + S, C = ceil(S / N), and L the larger of
    # min(O, S) (a one-shot message) and 2 ceil(min(T, S) / N) (two Lamport two-shot chunks).
    for max_tokens in (8, 64, 256, 512, 2048):
        s = max_tokens * 7168 * 2
        lamport = max(min(32 * KIB, s), 2 * min(512 * KIB, s) // 8)
        expected = 40 * KIB + 3 * 8 * lamport + 2 * 8 * (s // 8) + s
        assert sk.workspace_bytes(8, max_tokens, 7168) == expected


def test_workspace_bytes_at_8_ranks_256_tokens_hidden_7168_is_about_13_5_mib():
    assert sk.workspace_bytes(8, 256, 7168) == 14_196_736


@pytest.mark.parametrize(
    ("variable", "value"),
    [(env.ONESHOT_MAX_BYTES, 256 * KIB), (env.TWOSHOT_LAMPORT_MAX_BYTES, 1 * MIB)],
)
def test_workspace_bytes_read_the_bounds_from_the_environment_as_the_workspace_does(
    monkeypatch, variable, value
):
    """doctor's memory estimate (workspace_bytes) must size the workspace a server with these
    variables would allocate; it kept the defaults before."""
    default = sk.workspace_bytes(8, 256, 7168)
    monkeypatch.setenv(variable, str(value))
    tuning = config.resolve_tuning(8)
    allocated = sk.workspace_layout(
        8, 256 * 7168 * 2, tuning.oneshot_max_bytes, tuning.twoshot_lamport_max_bytes
    ).total_bytes
    assert sk.workspace_bytes(8, 256, 7168) == allocated > default


def test_workspace_bytes_refuse_a_bound_the_workspace_refuses(monkeypatch):
    monkeypatch.setenv(env.ONESHOT_MAX_BYTES, str(config.MAX_MESSAGE_BYTES + 16))
    with pytest.raises(ValueError, match="ONESHOT_MAX_BYTES"):
        config.resolve_tuning(8)
    with pytest.raises(ValueError, match="ONESHOT_MAX_BYTES"):
        sk.workspace_bytes(8, 256, 7168)


@pytest.mark.parametrize(("world_size", "bound"), [(2, 1 * MIB), (4, 1 * MIB), (8, 512 * KIB)])
def test_default_lamport_two_shot_bounds(world_size, bound):
    assert config.default_twoshot_lamport_max_bytes(world_size) == bound


def test_lamport_two_shot_off_keeps_the_one_shot_slot():
    """A Lamport two-shot bound at or below the one-shot's adds nothing to the slots."""
    without = sk.workspace_layout(8, 1 * MIB, 32 * KIB, 32 * KIB)
    assert without.lamport_slot_bytes == 32 * KIB
    assert sk.workspace_layout(8, 1 * MIB, 32 * KIB, 512 * KIB).lamport_slot_bytes == 128 * KIB


@pytest.mark.parametrize(
    ("world_size", "max_bytes", "oneshot", "lamport", "slot"),
    [
        (2, 1 * MIB, 4 * MIB, 1 * MIB, 512 * KIB),  # one-shot covers everything
        (8, 1 * MIB, 32 * KIB, 32 * KIB, 128 * KIB),
        (8, 16 * KIB, 32 * KIB, 16 * KIB, 2 * KIB),  # one-shot slot no larger than the message
        (4, 16 * 3 * 1000, 1 * KIB, 1 * KIB, 12_032),  # chunk 12000 rounded up to 256
    ],
)
def test_slots_hold_a_oneshot_message_or_a_twoshot_chunk(
    world_size, max_bytes, oneshot, lamport, slot
):
    layout = sk.workspace_layout(world_size, max_bytes, oneshot)
    assert (layout.lamport_slot_bytes, layout.slot_bytes) == (lamport, slot)
    assert layout.push_offset == layout.lamport_offset + 3 * world_size * lamport
    assert layout.gather_offset == layout.push_offset + 2 * world_size * slot
    assert layout.total_bytes >= layout.gather_offset + max_bytes


def test_control_words_and_call_state_fit_before_the_buffers():
    assert config.CONTROL_OFFSET + _lib.CONTROL_WORDS * 4 <= config.LAMPORT_OFFSET
    assert config.CONTROL_OFFSET == _lib.FLAG_WORDS * _lib.FLAG_BYTES


def test_layout_refuses_sizes_that_are_not_whole_vectors():
    with pytest.raises(ValueError, match="multiple of 16"):
        sk.workspace_layout(2, 1000, 4 * KIB)


@pytest.mark.parametrize("world_size", [0, 1, 9, 16])
def test_unsupported_world_sizes_are_refused_with_the_range(world_size):
    with pytest.raises(ValueError, match="2 to 8 ranks"):
        sk.workspace_layout(world_size, 1 * MIB, 4 * KIB)


# --------------------------------------------------------------------------- choices


@pytest.mark.parametrize(
    ("world_size", "threshold"), [(2, 4 * MIB), (4, 64 * KIB), (8, 32 * KIB), (3, 87_376)]
)
def test_default_oneshot_thresholds(world_size, threshold):
    assert sk.default_oneshot_max_bytes(world_size) == threshold


def _tuned_layout(world_size: int, tuning: config.Tuning, max_bytes: int = 64 * MIB):
    return config.workspace_layout(
        world_size, max_bytes, tuning.oneshot_max_bytes, tuning.twoshot_lamport_max_bytes
    )


def test_variant_goes_one_shot_then_lamport_two_shot_then_two_shot_with_flags():
    tuning = sk.resolve_tuning(8)
    layout = _tuned_layout(8, tuning)
    threshold, lamport = tuning.oneshot_max_bytes, tuning.twoshot_lamport_max_bytes
    assert lamport == config.default_twoshot_lamport_max_bytes(8) == 512 * KIB > threshold
    assert sk.choose_variant(threshold, tuning, layout) == _lib.VARIANT_ONESHOT
    assert sk.choose_variant(threshold + 16, tuning, layout) == _lib.VARIANT_TWOSHOT_LAMPORT
    assert sk.choose_variant(lamport, tuning, layout) == _lib.VARIANT_TWOSHOT_LAMPORT
    assert sk.choose_variant(lamport + 16, tuning, layout) == _lib.VARIANT_TWOSHOT


def test_a_lamport_bound_at_or_below_the_one_shot_bound_turns_it_off(monkeypatch):
    monkeypatch.setenv(env.TWOSHOT_LAMPORT_MAX_BYTES, "16")
    tuning = sk.resolve_tuning(8)
    assert tuning.twoshot_lamport_max_bytes == 16
    layout = _tuned_layout(8, tuning)
    for nbytes in (tuning.oneshot_max_bytes + 16, 1 * MIB):
        assert sk.choose_variant(nbytes, tuning, layout) == _lib.VARIANT_TWOSHOT


@pytest.mark.parametrize(
    ("nbytes", "world_size", "slot", "fits"),
    [
        (9 * 16, 8, 1 * MIB, False),  # chunks of 2 vectors: ranks 5-7 would get none
        (57 * 16, 8, 1 * MIB, True),  # chunks of 8: the last rank's holds 1
        (56 * 16, 8, 1 * MIB, True),
        (49 * 16, 8, 1 * MIB, False),  # chunks of 7: 7 ranks take all 49, the last none
        (1 * MIB, 8, 256 * KIB, True),  # two chunks of 128 KiB fill the slot
        (1 * MIB + 16, 8, 256 * KIB, False),
    ],
)
def test_lamport_two_shot_needs_every_chunk_non_empty_and_two_in_a_slot(
    nbytes, world_size, slot, fits
):
    assert config.twoshot_lamport_fits(nbytes, world_size, slot) is fits


def test_a_message_the_workspace_cannot_take_lamport_two_shot_goes_two_shot_with_flags():
    tuning = sk.resolve_tuning(8, oneshot_max_bytes=16)
    layout = _tuned_layout(8, tuning)
    assert sk.choose_variant(9 * 16, tuning, layout) == _lib.VARIANT_TWOSHOT
    assert sk.choose_variant(64 * 16, tuning, layout) == _lib.VARIANT_TWOSHOT_LAMPORT


@pytest.mark.parametrize(
    ("nbytes", "blocks"), [(16, 1), (4096, 1), (4097, 2), (14336, 4), (1 * MIB, 128)]
)
def test_grid_grows_with_the_message_up_to_max_blocks(nbytes, blocks):
    assert sk.choose_blocks(nbytes, sk.resolve_tuning(4)) == blocks


ONESHOT, TWOSHOT = _lib.VARIANT_ONESHOT, _lib.VARIANT_TWOSHOT
LAMPORT = _lib.VARIANT_TWOSHOT_LAMPORT


@pytest.mark.parametrize(
    ("rows", "blocks", "rows_per_block", "variant", "split"),
    [
        (4, 14, 1, ONESHOT, False),  # verify sizes: one launch, each row's block polls its own row
        (64, 64, 1, ONESHOT, False),
        (65, 64, 1, ONESHOT, True),  # a block would own two rows: all-reduce, then the norm launch
        (2048, 64, 1, TWOSHOT, True),  # a bound set applies to both variants
        (2048, 64, 32, ONESHOT, False),
        (128, 64, None, ONESHOT, False),  # default: one-shot blocks of two rows stay one launch
        (129, 64, None, ONESHOT, True),  # ... of three split
        (2048, 16, None, TWOSHOT, False),  # default: two-shot never splits
    ],
)
def test_fused_call_splits_only_when_a_block_would_own_several_rows(
    rows, blocks, rows_per_block, variant, split
):
    tuning = sk.resolve_tuning(2, fused_rows_per_block=rows_per_block)
    assert sk.split_fused(rows, blocks, tuning, variant) is split


@pytest.mark.parametrize(
    ("rows", "world_size", "blocks", "slot_rows", "whole"),
    [
        (256, 2, 66, 2048, True),  # 128 rows a chunk: at least one a block
        (132, 2, 66, 2048, True),  # exactly one row of each chunk a block
        (130, 2, 66, 2048, False),  # 65 rows a chunk: one block would get none
        (2048, 8, 16, 256, True),
        (2048, 8, 16, 255, False),  # a chunk of whole rows (256) passes the slot
        (9, 2, 4, 2048, True),  # chunks of 5 and 4 rows
    ],
)
def test_two_shot_pieces_are_whole_rows_when_every_block_gets_a_row_and_a_chunk_fits_a_slot(
    rows, world_size, blocks, slot_rows, whole
):
    slot_bytes = slot_rows * 7168 * 2
    assert config.twoshot_row_pieces(rows, 7168, world_size, blocks, slot_bytes) is whole


def _layout(world_size: int, max_tokens: int = 2048) -> config.WorkspaceLayout:
    return config.workspace_layout(
        world_size, max_tokens * 7168 * 2, config.default_oneshot_max_bytes(world_size)
    )


@pytest.mark.parametrize(
    ("rows", "blocks", "rows_per_block", "expected"),
    [
        (256, 66, None, TWOSHOT),  # one-shot would split; two-shot takes whole-row pieces
        (128, 66, None, ONESHOT),  # one-shot blocks of two rows stay one launch
        (256, 128, None, ONESHOT),  # one rank per GPU: 128 blocks, two rows a block
        (290, 128, None, TWOSHOT),
        (256, 66, 2, ONESHOT),  # a bound the user set keeps its split
    ],
)
def test_a_fused_call_that_one_shot_would_split_runs_two_shot_in_whole_row_pieces(
    rows, blocks, rows_per_block, expected
):
    tuning = sk.resolve_tuning(2, max_blocks=blocks, fused_rows_per_block=rows_per_block)
    layout = _layout(2)
    assert config.choose_variant(rows * 7168 * 2, tuning, layout) == ONESHOT
    assert config.fused_variant(rows, 7168, ONESHOT, blocks, tuning, layout) == expected


def test_a_row_split_one_shot_call_stays_one_shot_though_its_blocks_would_own_several_rows():
    """With 64 KiB blocks, 16 tokens take 4 blocks: split_fused counts 4 rows a block, but the
    launch splits each row across a cluster instead (row_blocks 4, one launch), which is the
    fastest path at verify sizes: it must not be sent two-shot."""
    tuning = sk.resolve_tuning(2, block_bytes=64 * KIB)
    blocks = config.choose_blocks(16 * 7168 * 2, tuning)
    assert blocks == 4 and config.split_fused(16, blocks, tuning, ONESHOT)
    assert config.row_blocks(16, 7168, ONESHOT, tuning) == 4
    assert config.fused_variant(16, 7168, ONESHOT, blocks, tuning, _layout(2)) == ONESHOT


def test_a_fused_call_keeps_one_shot_where_two_shot_pieces_would_not_be_whole_rows():
    """At 4 ranks (one-shot raised to 64 MiB), 100 rows on 33 blocks split one-shot, but a
    chunk of 25 rows leaves 8 blocks without a row: the call stays one-shot (two-shot would
    wait for every block of every rank); 140 rows (35 a chunk) go two-shot. An explicit
    variant is kept."""
    tuning = sk.resolve_tuning(4, max_blocks=33, oneshot_max_bytes=64 * MIB)
    layout = _layout(4)
    assert config.split_fused(100, 33, tuning, ONESHOT)
    assert config.fused_variant(100, 7168, ONESHOT, 33, tuning, layout) == ONESHOT
    assert config.fused_variant(140, 7168, ONESHOT, 33, tuning, layout) == TWOSHOT
    assert config.fused_variant(140, 7168, TWOSHOT, 33, tuning, layout) == TWOSHOT


@pytest.mark.parametrize(
    ("rows", "hidden", "variant", "max_blocks", "expected"),
    [
        (1, 7168, _lib.VARIANT_ONESHOT, 128, 4),  # 896 vectors: 4 slices of 224
        (8, 7168, _lib.VARIANT_ONESHOT, 128, 4),
        (16, 7168, _lib.VARIANT_ONESHOT, 128, 4),  # 64 blocks: MAX_ROW_SPLIT_BLOCKS
        (17, 7168, _lib.VARIANT_ONESHOT, 128, 2),  # powers of two only: not 3
        (32, 7168, _lib.VARIANT_ONESHOT, 128, 2),
        (33, 7168, _lib.VARIANT_ONESHOT, 128, 1),  # not even 2 slices fit 64 blocks
        (16, 7168, _lib.VARIANT_ONESHOT, 16, 1),  # 8 ranks sharing one H200: 16 blocks each
        (4, 7168, _lib.VARIANT_ONESHOT, 16, 4),
        (6, 7168, _lib.VARIANT_ONESHOT, 16, 2),
        (1, 16384, _lib.VARIANT_ONESHOT, 128, 8),  # never past the portable cluster size
        (4, 16384, _lib.VARIANT_ONESHOT, 16, 4),  # 16 blocks: 4 slices of 512
        (8, 16384, _lib.VARIANT_ONESHOT, 16, 1),  # 2 slices of 1024: more than a block holds
        (1, 2048, _lib.VARIANT_ONESHOT, 128, 1),  # 256 vectors: one block is enough
        (1, 4096, _lib.VARIANT_ONESHOT, 128, 2),
        (1, 7168, _lib.VARIANT_TWOSHOT, 128, 1),  # two-shot keeps its own epilogue
    ],
)
def test_row_blocks_splits_small_one_shot_rows_across_a_cluster(
    rows, hidden, variant, max_blocks, expected
):
    tuning = sk.resolve_tuning(2, max_blocks=max_blocks)
    assert config.row_blocks(rows, hidden, variant, tuning) == expected


def test_row_split_is_bounded_by_the_clusters_the_gpu_holds_beside_the_other_ranks():
    # 8 clusters of each size at once, 2 ranks sharing the GPU: 4 clusters each.
    clusters = dict.fromkeys(range(2, config.MAX_ROW_BLOCKS + 1), 8)
    tuning = sk.resolve_tuning(2, resident_clusters=clusters, ranks_per_gpu=2)
    assert tuning.row_split_blocks == ((2, 8), (4, 16), (8, 32))
    assert tuning.row_split_cap(4) == 16 and tuning.row_split_cap(3) == 0
    assert config.row_blocks(1, 7168, _lib.VARIANT_ONESHOT, tuning) == 4
    assert config.row_blocks(4, 7168, _lib.VARIANT_ONESHOT, tuning) == 4  # 16 blocks
    assert config.row_blocks(8, 7168, _lib.VARIANT_ONESHOT, tuning) == 1  # 16 > 8 in pairs
    alone = sk.resolve_tuning(2, resident_clusters=clusters, ranks_per_gpu=1)
    assert config.row_blocks(8, 7168, _lib.VARIANT_ONESHOT, alone) == 4  # 32 of 32
    # The clusters bound the row split's grid, not the cap of 512-thread blocks: four ranks on
    # a GPU holding 132 of those (33 each) and 66 clusters of two 256-thread blocks (16 of
    # them each, 32 blocks) split 32 rows in two (64 blocks) where 33 blocks could not; a cap
    # the user set still holds.
    shared = sk.resolve_tuning(
        4, resident_blocks=132, resident_clusters={2: 132, 4: 60, 8: 28}, ranks_per_gpu=4
    )
    assert shared.max_blocks == 33 and shared.row_split_cap(2) == 64
    assert config.row_blocks(32, 7168, _lib.VARIANT_ONESHOT, shared) == 2
    capped = sk.resolve_tuning(
        4,
        max_blocks=33,
        resident_blocks=132,
        resident_clusters={2: 132, 4: 60, 8: 28},
        ranks_per_gpu=4,
    )
    assert capped.row_split_cap(2) == 33
    assert config.row_blocks(32, 7168, _lib.VARIANT_ONESHOT, capped) == 1
    # No cluster of the size fits at all: that size is never chosen (nor 3: powers of two).
    none_of_4 = {**clusters, 4: 0}
    tuning = sk.resolve_tuning(2, resident_clusters=none_of_4, ranks_per_gpu=1)
    assert config.row_blocks(1, 7168, _lib.VARIANT_ONESHOT, tuning) == 2
    # The 1x H200 as measured (sk_max_active_clusters), 2 ranks: 30 clusters of 4 hold 15
    # rows each, so 16 tokens take 2 slices (4.8 us) where 64 blocks of 4 would not all fit.
    h200 = {2: 66, 3: 39, 4: 30, 5: 22, 6: 17, 7: 15, 8: 15}
    tuning = sk.resolve_tuning(2, resident_blocks=132, resident_clusters=h200, ranks_per_gpu=2)
    picks = [config.row_blocks(n, 7168, _lib.VARIANT_ONESHOT, tuning) for n in (8, 15, 16, 32, 33)]
    assert picks == [4, 4, 2, 2, 1]


def test_a_cluster_query_that_fails_counts_as_none_fitting_not_as_an_error(monkeypatch):
    from sgl_kernel_sm120 import workspace

    class Library:
        def sk_max_active_clusters(self, device, size, out):
            if size == 4:
                return 1  # cudaErrorInvalidValue, as an SM without clusters of 4 might say
            out._obj.value = 10 * size
            return 0

    monkeypatch.setattr(workspace._lib, "lib", lambda: Library())
    clusters = workspace._resident_clusters(0)
    assert clusters == {2: 20, 4: 0, 8: 80}
    tuning = sk.resolve_tuning(2, resident_clusters=clusters, ranks_per_gpu=1)
    assert config.row_blocks(1, 7168, _lib.VARIANT_ONESHOT, tuning) == 2  # 4 refused, 2 fits


def test_a_hand_built_tuning_without_row_split_bounds_gets_the_grid_bounds():
    tuning = sk.Tuning(oneshot_max_bytes=1 << 20, block_bytes=4096, max_blocks=128, timeout_ms=1)
    assert config.row_blocks(16, 7168, _lib.VARIANT_ONESHOT, tuning) == 4


def test_row_blocks_matches_the_kernels_cluster_bound():
    kernel_sources = Path(__file__).resolve().parents[2] / "sgl-kernel-sm120" / "csrc"
    header = (kernel_sources / "sk_api.h").read_text()
    assert f"#define SK_MAX_ROW_BLOCKS {config.MAX_ROW_BLOCKS} " in header


def test_the_python_mirror_has_the_headers_abi_flag_width_and_error_words():
    """The ABI number says the layout changed; the flags' width, the error record's words and
    the call state's are what the Python side sizes, reads and (GPU tests) sets (64-bit call
    numbers since ABI 6)."""
    kernel_sources = Path(__file__).resolve().parents[2] / "sgl-kernel-sm120" / "csrc"
    header = (kernel_sources / "sk_api.h").read_text()
    assert f"#define SK_ABI_VERSION {_lib.ABI_VERSION}\n" in header
    assert f"uint{8 * _lib.FLAG_BYTES}_t* flags[SK_MAX_RANKS];" in header
    assert f"#define SK_CTRL_ERR_EPOCH {_lib.CTRL_ERR_EPOCH} " in header
    assert f"#define SK_CTRL_ERR_EPOCH_HIGH {_lib.CTRL_ERR_EPOCH_HIGH} " in header
    assert _lib.CTRL_ERR_EPOCH_HIGH < _lib.CTRL_WORDS  # inside the host-mapped mirror
    for name in ("STATE_EPOCH", "STATE_ONESHOT_BUFFER", "STATE_EPOCH_HIGH"):
        assert f"#define SK_{name} {getattr(_lib, name)} " in header  # the GPU tests set them


def test_the_python_mirror_has_the_headers_launch_fields_in_order():
    """sk_launch reads SkLaunchParams at the header's offsets: a field the mirror lacks, or
    holds in another place, shifts every field after it (early_launch is the last one)."""
    kernel_sources = Path(__file__).resolve().parents[2] / "sgl-kernel-sm120" / "csrc"
    header = (kernel_sources / "sk_api.h").read_text()
    body = header.split("typedef struct {", 1)[1].split("} SkLaunchParams;", 1)[0]
    declared = re.findall(r"^\s*[\w ]+?\**\s*\**(\w+)(?:\[\w+\])?;", body, flags=re.M)
    assert declared == [name for name, _ in _lib.LaunchParams._fields_]
    assert declared[-1] == "early_launch"
    assert f"#define SK_DEBUG_TRIGGER_AT_START {_lib.DEBUG_TRIGGER_AT_START} " in header


def test_ranks_of_two_kernel_versions_refuse_to_share_a_workspace(monkeypatch):
    """CommWorkspace.create compares every rank's settings: a rank whose package has another
    ABI (here 5, before the 64-bit flags) or another buffer layout is named, value by rank."""
    tuning = sk.resolve_tuning(2)

    def settings():
        layout = config.workspace_layout(2, 1 << 20, tuning.oneshot_max_bytes)
        return workspace._shared_settings(1 << 20, tuning, layout)

    current, abi = settings(), _lib.ABI_VERSION
    assert workspace._disagreement([current, current]) is None
    monkeypatch.setattr(_lib, "ABI_VERSION", 5)
    monkeypatch.setattr(config, "LAMPORT_OFFSET", 32768)
    older = settings()
    message = workspace._disagreement([current, older])
    assert message.startswith(f"ranks disagree on kernel ABI: [{abi}, 5]; buffer layout: [")
    assert "max_bytes: [" not in message and "use the same sgl-kernel-sm120 version" in message
    before_abi_6 = (1 << 20, tuning.oneshot_max_bytes, 4096, 128, None, ())  # bare values
    message = workspace._disagreement([current, before_abi_6])
    assert message.startswith("ranks run different sgl-kernel-sm120 versions")
    assert workspace._disagreement([before_abi_6, current]).startswith("ranks run different")


def test_fused_rows_per_block_defaults_to_unset_and_reads_its_variable(monkeypatch):
    assert sk.resolve_tuning(2).fused_rows_per_block is None
    monkeypatch.setenv("SGLANG_SM120_FUSED_ROWS_PER_BLOCK", "8")
    assert sk.resolve_tuning(2).fused_rows_per_block == 8


def test_early_launch_is_on_unless_its_switch_or_the_argument_turns_it_off(monkeypatch):
    monkeypatch.delenv(config.ENV_PDL, raising=False)
    assert sk.resolve_tuning(2).early_launch is True
    for off in ("0", "off", " False "):
        monkeypatch.setenv(config.ENV_PDL, off)
        assert sk.resolve_tuning(2).early_launch is False, off
    assert sk.resolve_tuning(2, early_launch=True).early_launch is True
    monkeypatch.setenv(config.ENV_PDL, "yes")
    assert sk.resolve_tuning(2).early_launch is True
    assert sk.resolve_tuning(2, early_launch=False).early_launch is False


def test_a_bad_early_launch_switch_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv(config.ENV_PDL, "maybe")
    with pytest.raises(ValueError, match=r"\$SGLANG_SM120_PDL='maybe' is not a switch"):
        sk.resolve_tuning(2)


def test_early_launch_is_not_a_setting_ranks_must_share():
    """Each rank's kernels wait for the kernel before them on that rank's own stream: a rank
    with early launch and one without work together, so creation does not compare it."""
    on, off = sk.resolve_tuning(2, early_launch=True), sk.resolve_tuning(2, early_launch=False)
    layout = config.workspace_layout(2, 1 << 20, on.oneshot_max_bytes)
    assert workspace._shared_settings(1 << 20, on, layout) == workspace._shared_settings(
        1 << 20, off, layout
    )


# --------------------------------------------------------------------------- settings


def test_settings_resolve_argument_over_environment_over_default(monkeypatch):
    assert sk.resolve_tuning(4).timeout_ms == config.DEFAULT_TIMEOUT_MS
    monkeypatch.setenv(config.ENV_TIMEOUT_MS, "1500")
    monkeypatch.setenv(config.ENV_ONESHOT_MAX_BYTES, "0x2000")
    tuning = sk.resolve_tuning(4)
    assert (tuning.timeout_ms, tuning.oneshot_max_bytes) == (1500, 8192)
    assert sk.resolve_tuning(4, timeout_ms=20).timeout_ms == 20


def test_bad_environment_values_are_named(monkeypatch):
    monkeypatch.setenv(config.ENV_BLOCK_BYTES, "lots")
    with pytest.raises(ValueError, match="SGLANG_SM120_BLOCK_BYTES='lots' is not an integer"):
        sk.resolve_tuning(4)


@pytest.mark.parametrize(
    ("value", "refusal"),
    [
        ("18446744073710", "is above the bound 3600000"),  # x 10^6 ns wraps to 0.45 ms
        ("3600001", "is above the bound 3600000"),
        ("1" * 5000, "is not an integer"),  # past Python's own int() bound
        ("0", "must be positive"),
    ],
)
def test_a_timeout_past_one_hour_or_not_positive_is_refused_naming_the_variable(
    monkeypatch, value, refusal
):
    monkeypatch.setenv(config.ENV_TIMEOUT_MS, value)
    with pytest.raises(ValueError, match=f"SGLANG_SM120_TIMEOUT_MS=.* {refusal}"):
        sk.resolve_tuning(2)


def test_a_timeout_of_one_hour_is_the_largest_accepted(monkeypatch):
    monkeypatch.setenv(config.ENV_TIMEOUT_MS, "3600000")
    assert sk.resolve_tuning(2).timeout_ms == config.MAX_TIMEOUT_MS == 3_600_000
    assert config.MAX_TIMEOUT_MS * 1_000_000 < 2**64  # the kernels' nanosecond word


def test_an_explicit_timeout_past_one_hour_is_refused():
    with pytest.raises(ValueError, match=r"timeout_ms=18446744073710 must be in \[1, 3600000\]"):
        sk.resolve_tuning(2, timeout_ms=18446744073710)


def test_variables_are_named_sglang_sm120_so_sglangs_sgl_rename_leaves_them_alone():
    names = [env.TIMEOUT_MS, env.KERNEL_REQUIRED, env.CUDA_ARCHS, env.KERNEL_LIBRARY]
    names += [env.BLOCK_BYTES, env.MAX_BLOCKS, env.ONESHOT_MAX_BYTES]
    assert sorted(env.DEPRECATED) == sorted(names)
    assert all(name.startswith("SGLANG_SM120_") for name in names)
    assert config.ENV_TIMEOUT_MS == "SGLANG_SM120_TIMEOUT_MS"
    assert _lib.ENV_LIBRARY == "SGLANG_SM120_KERNEL_LIBRARY"


def test_new_name_is_read_without_a_warning(monkeypatch, recwarn):
    monkeypatch.setenv("SGLANG_SM120_TIMEOUT_MS", "1500")
    assert sk.resolve_tuning(2).timeout_ms == 1500
    assert not [w for w in recwarn if issubclass(w.category, env.DeprecatedVariableWarning)]


@pytest.mark.parametrize(
    "old_name",
    # the package's first name, and what SGLang's SGL_* -> SGLANG_* rewrite turns it into
    ["SGL_KERNEL_SM120_TIMEOUT_MS", "SGLANG_KERNEL_SM120_TIMEOUT_MS"],
)
def test_old_name_still_works_with_one_warning_per_process_naming_the_new_one(
    monkeypatch, old_name
):
    monkeypatch.setenv(old_name, "1500")
    with pytest.warns(env.DeprecatedVariableWarning) as caught:
        timeouts = [sk.resolve_tuning(2).timeout_ms for _ in range(3)]
    assert timeouts == [1500, 1500, 1500]
    deprecations = [w for w in caught if issubclass(w.category, env.DeprecatedVariableWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in deprecations]
    assert f"${old_name} is deprecated: set $SGLANG_SM120_TIMEOUT_MS" in str(
        deprecations[0].message
    )


def test_new_name_wins_over_the_old_one(monkeypatch):
    monkeypatch.setenv("SGL_KERNEL_SM120_MAX_BLOCKS", "8")
    monkeypatch.setenv("SGLANG_SM120_MAX_BLOCKS", "4")
    assert sk.resolve_tuning(2).max_blocks == 4


@pytest.mark.parametrize(
    ("new", "old"),
    [
        ("SGLANG_SM120_KERNEL_REQUIRED", "SGL_KERNEL_SM120_REQUIRED"),
        ("SGLANG_SM120_KERNEL_LIBRARY", "SGL_KERNEL_SM120_LIBRARY"),
        ("SGLANG_SM120_CUDA_ARCHS", "SGL_KERNEL_SM120_CUDA_ARCHS"),
        ("SGLANG_SM120_BLOCK_BYTES", "SGL_KERNEL_SM120_BLOCK_BYTES"),
        ("SGLANG_SM120_ONESHOT_MAX_BYTES", "SGL_KERNEL_SM120_ONESHOT_MAX_BYTES"),
    ],
)
def test_every_old_name_maps_to_its_new_name(monkeypatch, new, old):
    monkeypatch.setenv(old, "7")
    with pytest.warns(env.DeprecatedVariableWarning, match=f"set \\${new} instead"):
        assert env.get(new) == "7"


def test_library_override_reads_the_old_name_too(monkeypatch, tmp_path):
    monkeypatch.setenv("SGL_KERNEL_SM120_LIBRARY", str(tmp_path / "lib.so"))
    with pytest.warns(env.DeprecatedVariableWarning):
        assert _lib.library_path() == tmp_path / "lib.so"


def test_an_editable_install_loads_the_library_built_beside_the_sources(tmp_path):
    """``pip install -e ./sgl-kernel-sm120`` imports these sources but builds the library into
    site-packages; the package's ``__path__`` lists both (scikit-build-core's finder). Asked
    in a child that sees exactly that layout, with this checkout's sources."""
    checkout = Path(__file__).resolve().parents[2]
    sources = checkout / "sgl-kernel-sm120" / "python" / "sgl_kernel_sm120"
    built = tmp_path / "site-packages" / "sgl_kernel_sm120"
    built.mkdir(parents=True)
    (built / _lib.LIBRARY_NAME).write_bytes(b"")
    probe = (
        "import sys, types\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'ScikitBuild' not in type(f).__name__]\n"
        "package = types.ModuleType('sgl_kernel_sm120')\n"
        f"package.__path__ = [{str(built)!r}, {str(sources)!r}]\n"
        "sys.modules['sgl_kernel_sm120'] = package\n"
        "from sgl_kernel_sm120 import _lib\n"
        "print(_lib.__file__)\n"
        "print(_lib.library_path())\n"
    )
    env = {k: v for k, v in os.environ.items() if "KERNEL" not in k and "LIBRARY" not in k}
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    loaded_from, library = proc.stdout.split()
    assert Path(loaded_from) == sources / "_lib.py"
    assert Path(library) == built / _lib.LIBRARY_NAME


def test_default_block_cap_keeps_all_ranks_resident_on_a_shared_gpu():
    # H200 with this kernel: 132 SMs x 1 block of 512 threads.
    assert sk.resolve_tuning(8, resident_blocks=132, ranks_per_gpu=8).max_blocks == 16
    assert sk.resolve_tuning(4, resident_blocks=132, ranks_per_gpu=4).max_blocks == 33
    assert sk.resolve_tuning(2, resident_blocks=132, ranks_per_gpu=2).max_blocks == 66
    assert sk.resolve_tuning(8, resident_blocks=132, ranks_per_gpu=1).max_blocks == 128
    assert sk.resolve_tuning(8, resident_blocks=100, ranks_per_gpu=1).max_blocks == 100


def test_block_cap_that_cannot_be_resident_is_refused():
    with pytest.raises(ValueError, match="would deadlock"):
        sk.resolve_tuning(8, max_blocks=32, resident_blocks=132, ranks_per_gpu=8)
    with pytest.raises(ValueError, match=r"must be in \[1, 128\]"):
        sk.resolve_tuning(2, max_blocks=129)


# --------------------------------------------------------------------------- validation


def _t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


@pytest.mark.parametrize(
    ("tensor", "error", "message"),
    [
        (_t(64, dtype=torch.float32), TypeError, "bfloat16 or float16"),
        (_t(8, 16).t(), ValueError, "contiguous"),
        (_t(12), ValueError, "multiple of 8"),
        (_t(1024), sk.InputTooLargeError, "2048 bytes exceed the workspace's 1024"),
    ],
)
def test_all_reduce_input_errors_name_the_limit(tensor, error, message):
    with pytest.raises(error, match=message):
        sk.validate_all_reduce(tensor, device=CPU, max_bytes=1024)


def test_all_reduce_refuses_a_tensor_on_another_device():
    with pytest.raises(ValueError, match="the workspace on cuda:0"):
        sk.validate_all_reduce(_t(64), device=torch.device("cuda", 0), max_bytes=1 * MIB)


def test_too_large_is_a_value_error_so_generic_fallbacks_catch_it():
    assert issubclass(sk.InputTooLargeError, ValueError)


@pytest.mark.parametrize(
    ("x", "residual", "weight", "error", "message"),
    [
        (_t(4, 64), _t(4, 64, dtype=torch.float16), _t(64), TypeError, "share one dtype"),
        (_t(256), _t(256), _t(256), ValueError, r"\[tokens, hidden\]"),
        (_t(4, 64), _t(5, 64), _t(64), ValueError, "residual shape"),
        (_t(4, 64), _t(4, 64), _t(32), ValueError, "weight shape"),
        (_t(4, 60), _t(4, 60), _t(60), ValueError, "hidden 60 must be a multiple of 8"),
        (_t(1, 16392), _t(1, 16392), _t(16392), sk.InputTooLargeError, "exceeds the kernel's"),
        (_t(2049, 8), _t(2049, 8), _t(8), sk.InputTooLargeError, "2049 tokens exceed"),
        (_t(64, 64), _t(64, 64), _t(64), sk.InputTooLargeError, "exceed the workspace"),
    ],
)
def test_fused_input_errors_name_the_limit(x, residual, weight, error, message):
    with pytest.raises(error, match=message):
        sk.validate_fused(x, residual, weight, device=CPU, max_bytes=4096)


def test_valid_inputs_pass():
    sk.validate_all_reduce(_t(4, 64), device=CPU, max_bytes=512)
    sk.validate_fused(_t(4, 64), _t(4, 64), _t(64), device=CPU, max_bytes=512)


# --------------------------------------------------------------------------- ops, errors


def test_fake_ops_give_output_shapes_for_torch_compile_tracing():
    import sgl_kernel_sm120.ops  # noqa: F401  registers the ops
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 2048, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(2048, dtype=torch.bfloat16, device="cuda")
        norm, res = torch.ops.sgl_kernel_sm120.fused_allreduce_add_rmsnorm(x, x, w, 1e-6, 1, -1)
        out = torch.ops.sgl_kernel_sm120.all_reduce(x, 1, -1)
    for t in (norm, res, out):
        assert (t.shape, t.dtype) == (x.shape, x.dtype)


def test_unknown_variant_and_workspace_are_refused():
    with pytest.raises(ValueError, match="'oneshot', 'twoshot'"):
        sk.ops._variant_code("threeshot")
    with pytest.raises(sk.WorkspaceError, match="closed or was never created"):
        sk.get_workspace(-5)


class _FakeLib:
    """Two visible GPUs; bus ids map to devices 0 and 1; P2P only from 0 to 1."""

    def sk_device_by_pci_bus_id(self, bus, device_ref):
        device_ref._obj.value = {b"0000:01:00.0": 0, b"0000:02:00.0": 1}[bus]
        return 0

    def sk_can_access_peer(self, device, peer, ok_ref):
        ok_ref._obj.value = int(device == 0 and peer == 1)
        return 0


def test_missing_p2p_is_reported_with_both_gpus_and_the_fallback(monkeypatch):
    monkeypatch.setattr(_lib, "lib", lambda: _FakeLib())
    bus_ids = ["0000:01:00.0", "0000:02:00.0"]
    assert workspace._p2p_problems(0, 0, bus_ids) is None
    problem = workspace._p2p_problems(1, 1, bus_ids)
    assert "no P2P access from 0000:02:00.0 (rank 1) to 0000:01:00.0 (rank 0)" in problem
    assert "use NCCL" in problem


def test_ranks_sharing_one_gpu_need_no_p2p(monkeypatch):
    monkeypatch.setattr(_lib, "lib", lambda: _FakeLib())
    assert workspace._p2p_problems(1, 0, ["0000:01:00.0"] * 4) is None


def test_row_blocks_slice_bound_matches_the_kernels():
    """sk_launch refuses a slice past kMaxVecPerSlice x kRowSplitThreads vectors: a
    MAX_ROW_SLICE_VECTORS above it would send calls the kernel refuses, one below it would
    give up splits the kernel holds."""
    kernel_sources = Path(__file__).resolve().parents[2] / "sgl-kernel-sm120" / "csrc"
    source = (kernel_sources / "all_reduce.cu").read_text()
    block = re.search(r"#define SK_THREADS (\d+)", (kernel_sources / "sk_api.h").read_text())
    divisor = re.search(r"constexpr int kRowSplitThreads = SK_THREADS / (\d+);", source)
    per_thread = re.search(r"constexpr int kMaxVecPerSlice = (\d+);", source)
    assert block and divisor and per_thread, "the row-split bounds are no longer spelled out"
    threads = int(block.group(1)) // int(divisor.group(1))
    assert config.MAX_ROW_SLICE_VECTORS == int(per_thread.group(1)) * threads


def test_a_fused_call_the_lamport_two_shot_would_split_runs_two_shot_with_flags():
    """Four ranks with a 16-block grid: 64 rows of 7168 are 4 a block, past the Lamport
    epilogue's two, so the call left to the size runs the two-shot with flags (one launch,
    several rows per pass) rather than two launches; 32 rows (2 a block) stay Lamport, and so
    does a call whose user-set bound asks for the split."""
    tuning = sk.resolve_tuning(4, max_blocks=16)
    layout = _tuned_layout(4, tuning)
    for rows, expected in ((32, LAMPORT), (64, TWOSHOT)):
        nbytes = rows * 7168 * 2
        assert config.choose_variant(nbytes, tuning, layout) == LAMPORT
        blocks = sk.choose_blocks(nbytes, tuning)
        assert config.fused_variant(rows, 7168, LAMPORT, blocks, tuning, layout) == expected
    bound = sk.resolve_tuning(4, max_blocks=16, fused_rows_per_block=2)
    assert config.fused_variant(64, 7168, LAMPORT, 16, bound, layout) == LAMPORT
