"""Helpers for tests and benchmarks: tiny random HF models (:mod:`.tiny`), the reduced-precision
comparison rule (:mod:`.precision`) and the soak test's call mix (:mod:`.soak`).
"""
