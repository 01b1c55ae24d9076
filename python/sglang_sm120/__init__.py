"""sglang-sm120: SGLang 0.5.23 on SM120 (RTX PRO 6000 Blackwell) PCIe hosts.

Loaded by SGLang in every process through the ``sglang.srt.plugins`` entry point
(``sglang_sm120:register``). Layers: ``facts`` (what hardware is here) -> ``policy`` (pure
decisions with reasons) -> ``patches`` (thin hooks, one module per upstream seam) -> ``cli``.
"""

__version__ = "0.5.23.1"
SGLANG_PIN = "0.5.23"


def register() -> None:
    """Entry point: apply the patches this host needs. Never raises."""
    from sglang_sm120.plugin import register as _register

    _register()
