"""Anchor sampling and the block attention mask for DFlash training (docs/DESIGN.md section 7).

One training sequence of S tokens yields many blocks at once: each anchor p makes a block
[token[p], MASK x (B-1)] at positions p..p+B-1, and all blocks share one drafter pass over the
sequence's context features. The mask keeps the blocks independent and causal with respect to the
context: a block sees context features at positions STRICTLY before its anchor (the feature of
token p itself is not known at inference: token p is the freshly committed bonus token), its own
block bidirectionally, and no other block.
"""

from __future__ import annotations

import torch


def anchor_candidates(loss_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """Positions p that may anchor a block: p <= S - B and token[p] is an assistant token.

    loss_mask [S] (bool or 0/1) marks assistant tokens; returns sorted positions [n] (long).
    """
    seq_len = int(loss_mask.shape[0])
    last = seq_len - block_size  # the whole block p..p+B-1 must fit in the sequence
    if last < 0:
        return torch.zeros(0, dtype=torch.long)
    ok = loss_mask[: last + 1].bool()
    # A block whose labels are all prompt tokens teaches nothing; require the first label to count.
    ok = ok & loss_mask[1 : last + 2].bool()
    return ok.nonzero().flatten()


def sample_anchors(
    loss_mask: torch.Tensor, block_size: int, max_anchors: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Up to `max_anchors` distinct anchor positions, sorted [n] (all of them when fewer exist)."""
    cands = anchor_candidates(loss_mask, block_size)
    if cands.numel() <= max_anchors:
        return cands
    pick = torch.randperm(cands.numel(), generator=generator)[:max_anchors]
    return cands[pick].sort().values


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Absolute positions of all packed blocks [n * B]: p..p+B-1 for each anchor p."""
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors[:, None] + offsets[None, :]).reshape(-1)


def block_attention_mask(anchors: torch.Tensor, block_size: int, ctx_len: int,
                         window: int | None = None) -> torch.Tensor:
    """Boolean mask [n*B, ctx_len + n*B] (True = may attend) for packed blocks.

    Query i belongs to block a = i // B and sits at position anchors[a] + i % B. Context key j is
    visible iff j < anchors[a] (and, for a drafter whose layers have a sliding `window`, the
    query's position - j < window, as it attends at inference); block key m is visible iff
    m // B == a.
    """
    n = int(anchors.shape[0])
    q_block = torch.arange(n * block_size, device=anchors.device) // block_size  # [nB]
    keys = torch.arange(ctx_len, device=anchors.device)[None, :]  # [1, c]
    ctx = keys < anchors[q_block][:, None]  # [nB, c]
    if window is not None:
        position = anchors[q_block] + torch.arange(n * block_size, device=anchors.device) % block_size  # [nB]
        ctx &= position[:, None] - keys < window
    own = q_block[:, None] == q_block[None, :]  # [nB, nB]
    return torch.cat([ctx, own], dim=1)


def block_labels(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and validity for block positions k = 1..B-1: label = token[p + k].

    Returns (labels [n, B-1] long, valid [n, B-1] bool: the label is an assistant token).
    """
    k = torch.arange(1, block_size, device=anchors.device)
    idx = anchors[:, None] + k[None, :]  # [n, B-1]
    return input_ids[idx], loss_mask[idx].bool()
