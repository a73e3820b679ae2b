"""Logits processing, the counter-based random stream, and acceptance (greedy and rejection).
"""
