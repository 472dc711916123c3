"""A drafter checkpoint as export reads it: its config and tensors, checked, and cast to an output dtype.

Works on the checkpoint files (config.json + safetensors, read and checked by
`blockspec.dflash.checkpoint` as loading a drafter does; compact DFlash 2 codebooks expanded to the
published layout), not on our model class, so a DFlash 2
checkpoint (`architectures: ["DFlash2DraftModel"]`) goes through the same path as a DFlash one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from blockspec.dflash.checkpoint import (
    CODEBOOK_NAMES,
    SAVE_DTYPES,
    check_tensors,
    compact_codebooks,
    read_draft_vocab,
    read_drafter_config,
    read_tensors,
)
from blockspec.dflash.drafter_config import DrafterConfig
from blockspec.dflash.selector import expand_rows
from blockspec.errors import ConfigError

DTYPES = SAVE_DTYPES  # the name export's callers know


@dataclass(frozen=True)
class DrafterCheckpoint:
    """A drafter directory read and checked: its config and its tensors by published name, in
    the published shapes (a DFlash 2 selector's codebooks [V, r])."""

    path: Path
    cfg: DrafterConfig
    tensors: dict[str, torch.Tensor]


def read_checkpoint(path: str | Path) -> DrafterCheckpoint:
    """Reads and checks a drafter directory as `load_drafter` does, without building the model;
    a missing, unexpected or misshapen tensor is named. Codebooks stored over the draft
    vocabulary come out in the published [V, r] layout, zero rows for the other tokens (what our
    loader reads into the same scores: dflash/selector.py)."""
    path = Path(path)
    cfg = read_drafter_config(path)
    tensors = read_tensors(path)
    ids = read_draft_vocab(path, cfg.vocab_size)
    check_tensors(cfg, tensors, path, draft_vocab=ids)
    if compact_codebooks(cfg, tensors):
        tensors = {**tensors, **{name: expand_rows(tensors[name], ids, cfg.vocab_size) for name in CODEBOOK_NAMES}}
    return DrafterCheckpoint(path, cfg, tensors)


def check_dtype(dtype: str) -> None:
    """Raises ConfigError unless `dtype` is "auto" (as stored) or a name in DTYPES."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")


def cast_tensors(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """The tensors in `dtype` ("auto": as stored)."""
    check_dtype(dtype)
    if dtype == "auto":
        return tensors
    return {k: v.to(DTYPES[dtype]) for k, v in tensors.items()}
