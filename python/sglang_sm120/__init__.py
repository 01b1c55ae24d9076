"""sglang-sm120: SGLang 0.5.23 on SM120 (RTX PRO 6000 Blackwell) PCIe hosts.

Loaded by SGLang in every process through the ``sglang.srt.plugins`` entry point
(``sglang_sm120:register``). One sub-package per role; imports only go down the list:

    machine/   what the host is: GPUs, links, host checks, kernel images, the per-host cache
    planning/  pure decisions with reasons: the all-reduce plan, tuning tables
    server/    what runs inside SGLang's processes: the plugin loader, runtime, contract, patches/
    commands/  what a user types: the ``sglang-sm120`` CLI, one module per command

``strict_json`` (the one strict document reader) and ``version`` import nothing of ours.
"""

from sglang_sm120.version import SGLANG_PIN, __version__

__all__ = ["SGLANG_PIN", "__version__", "register"]


def register() -> None:
    """Entry point: apply the patches this host needs. Never raises."""
    from sglang_sm120.server.plugin import register as _register

    _register()
