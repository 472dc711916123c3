"""Proposers: what a speculative step verifies.

Per row, one interface (`Proposer`, base.py) that turns a row's draft into a token tree
(dflash/token_tree.py), one file per kind: a chain along the drafter's first choices (chain.py),
a best-first tree under a node budget (best_first.py), an n-gram lookup continuation as one more
branch (lookup.py), and DFlash 2's selector walk (dflash2.py, which also gives the selector's
conditional scores to the other two).

Per batch, one interface (`BatchProposer`, batched.py) that turns one draft head pass into a
step's chain proposals and its rows' tree distributions: a DFlash block (dflash_block.py), a
DFlash 2 walk (dflash2_walk.py), and the lookup continuation over either (lookup_override.py).
"""

from blockspec.dflash.proposers.base import Draft, Distributions, PositionDistributions, Proposer
from blockspec.dflash.proposers.batched import BatchDraft, BatchProposal, BatchProposer
from blockspec.dflash.proposers.best_first import BestFirstProposer
from blockspec.dflash.proposers.chain import ChainProposer
from blockspec.dflash.proposers.dflash2 import SelectorDistributions, SelectorWalkProposer
from blockspec.dflash.proposers.dflash2_walk import DFlash2WalkProposer
from blockspec.dflash.proposers.dflash_block import DFlashBlockProposer, draft_confidence
from blockspec.dflash.proposers.lookup import LookupProposer
from blockspec.dflash.proposers.lookup_override import LookupOverride

__all__ = ["BatchDraft", "BatchProposal", "BatchProposer", "BestFirstProposer", "ChainProposer", "DFlash2WalkProposer",
           "DFlashBlockProposer", "Distributions", "Draft", "LookupOverride", "LookupProposer", "PositionDistributions",
           "Proposer", "SelectorDistributions", "SelectorWalkProposer", "draft_confidence"]
