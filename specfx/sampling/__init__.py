"""Logits processing (processors), the counter-based random stream (rng), and acceptance:
greedy, rejection and the token-tree walk (accept)."""
