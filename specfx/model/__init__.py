"""One model as specfx runs it: the forward with static KV, explicit masks and positions
(:mod:`~specfx.model.runner`), its capture as an FX graph, admission checks and probes, and the
architecture table.
"""
