"""Moved to `blockspec.export.gguf` (drafter export is not the model registry's job): the old
names work, with a DeprecationWarning, until the next release."""

from __future__ import annotations

from blockspec.deprecation import no_attribute, warn_moved

MOVED = ("ARCH", "GLOBAL_TENSORS", "LAYER_TENSORS", "gguf_name", "resolve_target_gguf", "write_dflash_gguf")


def __getattr__(name: str) -> object:
    if name not in MOVED:
        raise no_attribute(__name__, name)
    from blockspec.export import gguf  # the new home: the one upward import tests/test_layering.py allows here

    warn_moved(__name__, name, "blockspec.export.gguf")
    return getattr(gguf, name)
