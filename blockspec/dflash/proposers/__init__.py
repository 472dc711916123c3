"""Proposers: what a speculative step verifies, as a token tree (dflash/token_tree.py).

One interface (`Proposer`, base.py) and one file per kind: a chain along the drafter's first
choices (chain.py), a best-first tree under a node budget (best_first.py), an n-gram lookup
continuation as one more branch (lookup.py), and DFlash 2's selector walk (dflash2.py, which
also gives the selector's conditional scores to the other two).
"""

from blockspec.dflash.proposers.base import Draft, Distributions, PositionDistributions, Proposer
from blockspec.dflash.proposers.best_first import BestFirstProposer
from blockspec.dflash.proposers.chain import ChainProposer
from blockspec.dflash.proposers.dflash2 import SelectorDistributions, SelectorWalkProposer
from blockspec.dflash.proposers.lookup import LookupProposer

__all__ = ["BestFirstProposer", "ChainProposer", "Distributions", "Draft", "LookupProposer", "PositionDistributions",
           "Proposer", "SelectorDistributions", "SelectorWalkProposer"]
