"""Model factories and (later) draft architectures."""

from .tiny import tiny_causal_lm, tiny_pair

__all__ = ["tiny_causal_lm", "tiny_pair"]
