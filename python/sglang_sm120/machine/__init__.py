"""What the host is: GPUs and links (``facts``, ``topology``), the host checks
(``host_checks``), the kernel images on disk (``kernel_images``), cached P2P probes
(``p2p_probe``) and the per-host cache directory (``cache``).

Imports nothing above it: no planning, no server, no sglang.
"""
