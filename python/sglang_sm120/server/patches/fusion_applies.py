"""Patch: the per-call fusion gate counts SM12x as fusion-capable.

Why: ``add_norm.flashinfer_ar_fusion_applies`` reads the import-time constants
    ``_is_sm90_supported``/``_is_sm100_supported``; on SM120 both are False, so even with a
    fusion backend resolved every layer falls back to all-reduce + separate RMSNorm.
How: plain ``setattr`` of ``add_norm._is_sm90_supported = True`` when every GPU is SM12x with
    P2P on all pairs. In worker processes the module is imported before plugins load, so a
    REPLACE hook cannot be used (the registry would rebind every equal ``True`` global
    everywhere). The constant is read by that one function only (checked by the contract).
    The other conditions of the gate (backend set, no DP attention, <= 2048 tokens) stay upstream's.
Upstream: sgl-project/sglang PR #32330 (closed; same gate).
Removal: when upstream's gate includes SM12x.
"""

from __future__ import annotations

from sglang_sm120.planning.policy import Capability
from sglang_sm120.server.contract import Symbol, resolve

MODULE = "sglang.srt.layers.layer_boundary.residual.add_norm"
CONSTANT = f"{MODULE}._is_sm90_supported"
CONTRACT = (
    Symbol(
        f"{MODULE}.flashinfer_ar_fusion_applies",
        "function",
        params=("batch_size",),
        reads=("_is_sm90_supported",),
    ),
    Symbol(CONSTANT, "attribute", type_name="bool"),
)
HOOKS = ()
ROLES = ("scheduler",)


def not_needed(cap: Capability) -> str | None:
    return None if cap.fusion_capable else cap.reasons[0]


def apply_setting() -> None:
    import importlib

    importlib.import_module(MODULE)._is_sm90_supported = True


def is_applied() -> bool:
    return resolve(CONSTANT) is True
