"""What runs inside SGLang's processes: the plugin loader (``plugin``), per-process state and
the plan's hand-over (``runtime``), the status line and the check of what SGLang applied
(``status``), the upstream contract (``contract``) and the patches, one module per seam
(``patches``). Imports ``planning``, ``machine`` and sglang; never ``commands``.
"""
