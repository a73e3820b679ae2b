"""specfx: speculative decoding for any Hugging Face causal LM, one compiled graph per round.

Top-level API: :func:`speculate`, :class:`SpeculativeGenerator`, :class:`SpecConfig`,
:class:`SpecStats`, :class:`TokenTree`, :class:`PromptLookup`, :class:`Lookahead`, :class:`EarlyExit`,
:class:`MTP`, and heads that read the target's hidden states: :class:`Medusa`, :class:`Eagle`
(EAGLE-1/2), :class:`Eagle3`. Building blocks: :mod:`specfx.passes` (FX passes and the ``specfx``
torch.compile backend), :mod:`specfx.drafters`, :mod:`specfx.sampling`.
"""

from .config import MAX_SPECULATIVE_TOKENS, SpecConfig
from .drafters import Drafter, DraftModel
from .early_exit import EarlyExit
from .generator import SpeculativeGenerator, speculate
from .lookahead import Lookahead
from .models.eagle import Eagle
from .models.eagle3 import Eagle3
from .models.medusa import Medusa
from .mtp import MTP
from .prompt_lookup import PromptLookup
from .stats import SpecStats
from .tree import MAX_TREE_NODES, TokenTree

__version__ = "0.1.0"

__all__ = [
    # top-level API
    "speculate",
    "SpeculativeGenerator",
    "SpecConfig",
    "SpecStats",
    "TokenTree",
    "PromptLookup",
    "Lookahead",
    "EarlyExit",
    "MTP",
    "Medusa",
    "Eagle",
    "Eagle3",
    "MAX_SPECULATIVE_TOKENS",
    "MAX_TREE_NODES",
    # building blocks
    "Drafter",
    "DraftModel",
]
