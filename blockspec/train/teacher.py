"""The target as a teacher: its own next-token distribution at every position of a training
sequence, for distillation (`blockspec train --distill`).

The data holds the target's greedy tokens, so the published loss teaches the drafter only which
token the target picked. The target's whole distribution also says how close the runners-up
were. Computing it costs a forward of the target, unless a captured feature is close to the
top: then only the layers above it run (for SmolLM2's [1, 14, 27] of 30 layers, two layers and
the norm, about a fifteenth of a forward).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blockspec.train.loss import head_logits

# The captured features are bf16: the fewer layers carry them to the top, the closer the result
# is to a full forward's (SmolLM2's 2: total variation at most 0.006). Beyond this many, a full
# forward is used.
MAX_TAIL_LAYERS = 8


def teacher_target(target: object) -> object:
    """The target to read teacher distributions from: itself when native, else a native copy of
    a Hugging Face target's weights where the architecture allows (so that only the layers above
    the top captured feature run), else the target itself (a full forward per sequence)."""
    if hasattr(target, "final_hidden") or not isinstance(getattr(target, "model", None), torch.nn.Module):
        return target
    from blockspec.errors import ConfigError
    from blockspec.targets.native import load_native_target

    try:
        return load_native_target(target.model, dtype=None, device=target.device, eos_token_ids=(),
                                  single_token_weights=False)
    except ConfigError:
        return target


@torch.no_grad()
def teacher_hidden(
    target: object, ids: torch.Tensor, features: torch.Tensor, layer_ids: Sequence[int]
) -> torch.Tensor:
    """What the target's LM head reads at each position [S, H] (fp32) of one sequence ids [S].

    features [S, L*H] are the captured outputs of `layer_ids` for the same sequence. The last
    layer's entry is already that (taken after the final norm); a layer at most MAX_TAIL_LAYERS
    below the top is continued through the rest on a native target; otherwise the target runs
    the whole sequence.
    """
    info = target.info
    last, width = info.num_layers - 1, info.hidden_size
    layer_ids = list(layer_ids)
    if last in layer_ids:
        j = layer_ids.index(last)
        return features[:, j * width : (j + 1) * width].float()
    top = max(layer_ids)
    if hasattr(target, "final_hidden") and last - top <= MAX_TAIL_LAYERS:
        j = layer_ids.index(top)
        x = features[:, j * width : (j + 1) * width]  # [S, H]
        # clone: an inference-mode tensor may not enter the training step's autograd graph
        return target.final_hidden(ids[None], top + 1, x[None])[0].float().clone()
    from blockspec.train.features import target_features

    return target_features(target, [ids.tolist()], (last,))[0].float()


@torch.no_grad()
def teacher_probs(hidden: torch.Tensor, head: torch.nn.Module, output_multiplier: float = 1.0) -> torch.Tensor:
    """softmax(head(hidden) * output_multiplier) [m, V] in fp32: the target's distribution over
    the head's rows (all of its vocabulary, or the training's candidate tokens, renormalised over
    them). The multiplier is the drafter's copy of the target's logit scale, as in the loss."""
    return torch.softmax(head_logits(hidden, head.weight, getattr(head, "bias", None), output_multiplier), dim=-1)
