"""ab_kernels.sh prelude: the row split's caps as before this round, bounded by the default
block cap (what fits of the 512-thread kernels) as well as by the clusters that fit."""

import dataclasses

from sgl_kernel_sm120 import config, workspace

_resolve = config.resolve_tuning


def _resolve_with_old_caps(world_size, **kw):
    tuning = _resolve(world_size, **kw)
    caps = config.row_split_caps(
        tuning.max_blocks, kw.get("resident_clusters"), kw.get("ranks_per_gpu", 1)
    )
    return dataclasses.replace(tuning, row_split_blocks=caps)


config.resolve_tuning = _resolve_with_old_caps
workspace.resolve_tuning = _resolve_with_old_caps
