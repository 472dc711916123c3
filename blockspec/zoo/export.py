"""Moved to `blockspec.export` (drafter export is not the model registry's job): the old names
work, with a DeprecationWarning, until the next release."""

from __future__ import annotations

from blockspec.deprecation import no_attribute, warn_moved

MOVED = ("DTYPES", "FORMATS", "TOKENIZER_FILES", "DrafterCheckpoint", "ExportResult", "engine_config",
         "export_drafter", "export_hf_dir", "read_checkpoint", "serve_command")


def __getattr__(name: str) -> object:
    if name not in MOVED:
        raise no_attribute(__name__, name)
    import blockspec.export as export  # the new home: the one upward import tests/test_layering.py allows here

    warn_moved(__name__, name, "blockspec.export")
    return getattr(export, name)
