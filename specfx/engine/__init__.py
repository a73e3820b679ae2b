"""The engine: planning a round's shape, the compiled chain and tree rounds, their graphs,
the host loop's helpers (sync, streaming, criteria), ``"auto"`` K, outputs and statistics.
"""
