"""A drafter checkpoint as export reads it: its config and tensors, checked, and cast to an output dtype.

Works on the checkpoint files (config.json + safetensors, read and checked by
`blockspec.dflash.checkpoint` as loading a drafter does), not on our model class, so a DFlash 2
checkpoint (`architectures: ["DFlash2DraftModel"]`) goes through the same path as a DFlash one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from blockspec.dflash.checkpoint import check_tensors, read_drafter_config, read_tensors
from blockspec.dflash.drafter_config import DrafterConfig
from blockspec.errors import ConfigError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DrafterCheckpoint:
    """A drafter directory read and checked: its config and its tensors by published name."""

    path: Path
    cfg: DrafterConfig
    tensors: dict[str, torch.Tensor]


def read_checkpoint(path: str | Path) -> DrafterCheckpoint:
    """Reads and checks a drafter directory as `load_drafter` does, without building the model;
    a missing, unexpected or misshapen tensor is named."""
    path = Path(path)
    cfg = read_drafter_config(path)
    tensors = read_tensors(path)
    check_tensors(cfg, tensors, path)
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
