"""One training sequence: its anchors and labels fixed up front (`prepare_sequence`), and the
drafter's loss over all its blocks in one forward (`sequence_forward`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from blockspec.errors import ConfigError
from blockspec.dflash.drafter import DFlashDrafter
from blockspec.train.anchors import block_attention_mask, block_labels, block_positions, sample_anchors
from blockspec.train.data import Example
from blockspec.train.loss import fused_head_ce
from blockspec.train.selector_loss import selector_loss
from blockspec.train.teacher import teacher_probs


def derived_seed(*parts: object) -> int:
    """A 56-bit seed from any parts (a run's seed and what it seeds), the same on every rank and run."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:7], "little")


@dataclass
class SeqBatch:
    """One sequence prepared for a step: anchors and labels fixed before any forward pass."""

    ids: torch.Tensor  # [S]
    loss_mask: torch.Tensor  # [S]
    example_id: str
    anchors: torch.Tensor  # [n]
    labels: torch.Tensor  # [n, B-1]
    weights: torch.Tensor  # [n, B-1], 0 where the label does not count

    @property
    def weight_sum(self) -> float:
        return float(self.weights.sum())


def prepare_sequence(
    ex: Example, block_size: int, max_anchors: int, max_seq_len: int, pos_weights: torch.Tensor, seed: int
) -> SeqBatch | None:
    ids = torch.tensor(ex.input_ids[:max_seq_len], dtype=torch.long)
    mask = torch.tensor(ex.loss_mask[:max_seq_len], dtype=torch.bool)
    gen = torch.Generator().manual_seed(seed)
    anchors = sample_anchors(mask, block_size, max_anchors, gen)
    if anchors.numel() == 0:
        return None
    labels, valid = block_labels(ids, mask, anchors, block_size)
    return SeqBatch(ids, mask, ex.id, anchors, labels, pos_weights[None, :] * valid.float())


def attention_windows(drafter: DFlashDrafter) -> list[int | None]:
    """The sliding windows the drafter's layers attend within (None: the whole context), one
    training mask each. Causal layers (an explicit `is_causal: true`) are refused: a block is
    trained, and drafts, bidirectionally."""
    causal = [i for i, layer in enumerate(drafter.layers) if layer.self_attn.causal]
    if causal:
        raise ConfigError(f"training needs drafter layers that attend bidirectionally within a block; layers {causal} "
                          "are causal: set is_causal to false (or remove it) in the drafter's config.json")
    return sorted({layer.self_attn.sliding_window for layer in drafter.layers}, key=lambda w: (w is not None, w or 0))


def sequence_forward(
    drafter: DFlashDrafter,
    target: object,
    seq: SeqBatch,
    features: torch.Tensor,
    *,
    head_chunk: int = 1024,
    autocast: bool = False,
    candidates: torch.Tensor | None = None,
    candidate_head: torch.nn.Module | None = None,
    teacher: torch.Tensor | None = None,
    distill: float = 0.0,
    selector_alpha: float = 1.0,
    parts: dict | None = None,
    frozen: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum(w * ce) over the sequence's blocks (graph attached) and unary top-1 correctness
    [n, B-1] (bool).

    With `candidates` (sorted token ids containing every label) and `candidate_head` (the head's
    rows for them), the softmax runs over those tokens only. With `teacher` (what the target's
    head reads at each position [S, H], train/teacher.py) and distill > 0, each label is
    distill * the target's distribution + (1 - distill) * its greedy token.

    DFlash 2 drafters add `selector_alpha` * the selector loss (train/selector_loss.py) to the
    sum. `parts`, when given, receives the float sums "unary" and "selector" and, per block
    position [n, B-1] (bool), "in_top_k" (label among the unary top K) and "selector_correct"
    (the selector's pick given the true previous token).

    `frozen`: only the selector learns (`--train selector`), so the drafter's forward and the
    unary loss run without autograd and the returned sum's graph is the selector loss's alone.
    """
    device = drafter.fc.weight.device
    B = drafter.block_size
    n = seq.anchors.numel()
    S = features.shape[0]
    anchors = seq.anchors.to(device)
    block_ids = torch.full((n, B), drafter.mask_token_id, dtype=torch.long, device=device)
    block_ids[:, 0] = seq.ids.to(device)[anchors]
    with torch.no_grad():
        embeds = target.embed(block_ids.reshape(1, n * B)).float() * drafter.cfg.input_embedding_scale  # [1, nB, H]
    masks = {w: block_attention_mask(anchors, B, S, w)[None, None]  # [1, 1, nB, S+nB] per window
             for w in attention_windows(drafter)}
    ctx_pos = torch.arange(S, device=device)[None]
    blk_pos = block_positions(anchors, B)[None]
    dtype = drafter.fc.weight.dtype
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast), torch.set_grad_enabled(
            torch.is_grad_enabled() and not frozen):
        hidden = drafter(features.to(device, dtype)[None], ctx_pos, embeds.to(dtype), blk_pos, attn_mask=masks,
                         block_len=B)
    hidden = hidden.reshape(n, B, -1)[:, 1:]  # [n, B-1, H]: position k predicts token[p + k]
    w = seq.weights.to(device)
    keep = w > 0  # [n, B-1]
    head = target.head()
    labels = seq.labels.to(device)[keep]
    if candidates is not None:
        head = candidate_head
        labels = torch.searchsorted(candidates, labels)
    h = hidden[keep]
    if h.dtype != head.weight.dtype:
        h = h.to(head.weight.dtype)
    table, rows = None, None
    if teacher is not None and distill > 0:
        # the target's distribution of token[p + k] is read at position p + k - 1; a position is
        # a label of up to B - 1 blocks, so each distribution is computed once
        at = (anchors[:, None] + torch.arange(B - 1, device=device)[None])[keep]  # [m]
        needed, rows = torch.unique(at, return_inverse=True)
        table = teacher_probs(teacher.to(device)[needed], head, drafter.cfg.output_multiplier)  # [U, V]
    selector = drafter.candidate_selector
    top_k = min(drafter.cfg.selector_top_k, head.weight.shape[0]) if selector is not None else 0
    with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
        out = fused_head_ce(
            h, head, labels, w[keep],
            output_multiplier=drafter.cfg.output_multiplier, chunk=head_chunk,
            teacher=table, teacher_rows=rows, alpha=distill, top_k=top_k,
        )
    total, correct_rows = out[0], out[1]
    correct = torch.zeros(n, B - 1, dtype=torch.bool, device=device)
    correct[keep] = correct_rows
    if parts is not None:
        parts["unary"] = float(total.detach())
    if selector is not None:
        # block position k's predecessor is the true token[p + k - 1] (the anchor for k = 1)
        prev = seq.ids.to(device)[anchors[:, None] + torch.arange(B - 1, device=device)[None]][keep]  # [m]
        sel = selector_loss(
            selector, hidden[keep], h, head.weight.detach(),
            None if getattr(head, "bias", None) is None else head.bias.detach(),
            out[2], labels, prev, w[keep],
            token_ids=candidates, output_multiplier=drafter.cfg.output_multiplier,
        )
        total = total + selector_alpha * sel.total
        if parts is not None:
            parts["selector"] = float(sel.total.detach())
            for name, rows_ in (("in_top_k", sel.in_top_k), ("selector_correct", sel.correct)):
                full = torch.zeros(n, B - 1, dtype=torch.bool, device=device)
                full[keep] = rows_
                parts[name] = full
    return total, correct
