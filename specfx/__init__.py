"""specfx: speculative decoding for any Hugging Face causal LM, one compiled graph per round.

Top-level API: :func:`speculate`, :class:`SpeculativeGenerator`, :func:`wait_for_graphs`, :class:`SpecConfig`,
:class:`SpecStats`, :class:`TokenTree`, :class:`PromptLookup`, :class:`Lookahead`, :class:`EarlyExit`,
:class:`MTP`, :class:`Pard`, and heads that read the target's hidden states: :class:`Medusa`, :class:`Eagle`
(EAGLE-1/2), :class:`Eagle3`, and the DFlash block drafter over them: :class:`DFlash`. Building blocks: :mod:`specfx.passes` (FX passes and the ``specfx``
torch.compile backend), :mod:`specfx.drafters`, :mod:`specfx.sampling.processors`.
"""

from specfx.api import SpeculativeGenerator, speculate, wait_for_graphs
from specfx.config import MAX_SPECULATIVE_TOKENS, SpecConfig
from specfx.drafters import Drafter, DraftModel
from specfx.drafters.early_exit import EarlyExit
from specfx.drafters.heads.dflash import DFlash
from specfx.drafters.heads.eagle import Eagle
from specfx.drafters.heads.eagle3 import Eagle3
from specfx.drafters.heads.medusa import Medusa
from specfx.drafters.lookahead import Lookahead
from specfx.drafters.mtp import MTP
from specfx.drafters.pard import Pard
from specfx.drafters.prompt_lookup import PromptLookup
from specfx.engine.stats import SpecStats
from specfx.trees.types import MAX_TREE_NODES, TokenTree

__version__ = "0.1.0"

__all__ = [
    # top-level API
    "speculate",
    "SpeculativeGenerator",
    "wait_for_graphs",
    "SpecConfig",
    "SpecStats",
    "TokenTree",
    "PromptLookup",
    "Lookahead",
    "EarlyExit",
    "MTP",
    "Pard",
    "Medusa",
    "Eagle",
    "Eagle3",
    "DFlash",
    "MAX_SPECULATIVE_TOKENS",
    "MAX_TREE_NODES",
    # building blocks
    "Drafter",
    "DraftModel",
]
