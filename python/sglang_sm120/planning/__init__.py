"""Pure decisions with reasons: the all-reduce plan (``policy``) and the measured tuning tables
it may follow (``tuning``). Imports only ``machine``.
"""
