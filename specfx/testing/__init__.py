"""Helpers for tests and benchmarks: tiny random HF models, and the reduced-precision
comparison rule.
"""
