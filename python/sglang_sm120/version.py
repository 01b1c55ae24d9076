"""The plugin's version and the one sglang release it is written against (imports nothing)."""

__version__ = "0.5.23.1"  # 0.5.23.N: the N-th release of this plugin for sglang 0.5.23
SGLANG_PIN = "0.5.23"
