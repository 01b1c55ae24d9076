"""What a user types: ``cli`` parses and dispatches, one module per command (``doctor``,
``plan``, ``profiles``, ``tune``, ``warmup``, ``p2p``, ``selftest``), shared argument checks in
``args``. ``selftest`` drives the e2e harness (``e2e``) on generated pairs (``tiny_models``).
"""
