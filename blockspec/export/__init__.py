"""Drafter export: a drafter in the files vLLM, SGLang, Transformers (`hf.py`) and llama.cpp
(`gguf.py`) load; `formats.py` is the entry point (`blockspec export`)."""

from blockspec.export.checkpoint import DTYPES, DrafterCheckpoint, read_checkpoint
from blockspec.export.formats import FORMATS, ExportResult, export_drafter, serve_command
from blockspec.export.gguf import gguf_name, resolve_target_gguf, write_dflash_gguf
from blockspec.export.hf import TOKENIZER_FILES, engine_config, export_hf_dir

__all__ = [
    "DTYPES",
    "FORMATS",
    "TOKENIZER_FILES",
    "DrafterCheckpoint",
    "ExportResult",
    "engine_config",
    "export_drafter",
    "export_hf_dir",
    "gguf_name",
    "read_checkpoint",
    "resolve_target_gguf",
    "serve_command",
    "write_dflash_gguf",
]
