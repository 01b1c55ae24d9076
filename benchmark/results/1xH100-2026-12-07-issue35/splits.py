"""The fused call's plan at each world size and token count, with the kernel library in
$SGLANG_SM120_KERNEL_LIBRARY, ranks as streams on this GPU: the GPU's cluster occupancy, and
per (world, tokens) the variant and blocks per row for each MAX_ROW_SPLIT_BLOCKS given."""

import sys

import torch
from sgl_kernel_sm120 import _lib, config
from sgl_kernel_sm120.workspace import CommWorkspace, _resident_blocks, _resident_clusters

HIDDEN = 7168
print(f"resident blocks {_resident_blocks(0)}, clusters {_resident_clusters(0)}")
for cap in [int(a) for a in sys.argv[1:]] or [config.MAX_ROW_SPLIT_BLOCKS]:
    config.MAX_ROW_SPLIT_BLOCKS = cap
    for world in (2, 4, 8):
        ranks = CommWorkspace.create_local(world, 128, HIDDEN, torch.bfloat16, 0)
        plan = []
        ws = ranks[0]
        for tokens in (1, 8, 16, 32, 64, 128):
            nbytes = tokens * HIDDEN * 2
            variant, blocks = ws.plan(nbytes)
            variant = config.fused_variant(tokens, HIDDEN, variant, blocks, ws.tuning, ws.layout)
            per_row = config.row_blocks(tokens, HIDDEN, variant, ws.tuning)
            name = "oneshot" if variant == _lib.VARIANT_ONESHOT else "twoshot"
            plan.append(f"{tokens}:{name}x{per_row}")
        print(
            f"cap {cap} world {world} row_split_blocks {ws.tuning.row_split_blocks}:",
            " ".join(plan),
        )
        for rank in ranks:
            rank.close()
