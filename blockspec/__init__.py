"""blockspec: DFlash block-diffusion speculative decoding, lossless."""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["load", "Pipeline", "Completion", "TextStream", "SamplingParams", "SpecConfig"]


def __getattr__(name: str) -> object:
    # Lazy, so `import blockspec` (and the CLI's help) does not pay for importing torch.
    if name in ("load", "Pipeline", "Completion", "TextStream"):
        from blockspec import api

        return getattr(api, name)
    if name in ("SamplingParams", "SpecConfig"):
        from blockspec import config

        return getattr(config, name)
    raise AttributeError(f"module 'blockspec' has no attribute {name!r}")
