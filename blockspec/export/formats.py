"""Export a drafter for the engines users serve it with: vLLM, SGLang, Transformers and llama.cpp.

One entry point, `export_drafter`, over the format families: vLLM, SGLang and Transformers read
one Hub-style directory (`blockspec.export.hf`); llama.cpp reads one GGUF file
(`blockspec.export.gguf`), whose vocabulary must match the target's GGUF token for token: its
tokenizer keys are copied from the target GGUF. What each engine reads is recorded in docs
(export section).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from blockspec.errors import ConfigError
from blockspec.export.checkpoint import DrafterCheckpoint, check_dtype, read_checkpoint
from blockspec.export.gguf import resolve_target_gguf, write_dflash_gguf
from blockspec.export.hf import export_hf_dir
from blockspec.zoo.registry import resolve_target_dir

FORMATS = ("hf", "vllm", "sglang", "llama.cpp")


@dataclass(frozen=True)
class ExportResult:
    """What was written and how to run it."""

    path: Path
    files: tuple[str, ...]
    command: str


def serve_command(fmt: str, ckpt: DrafterCheckpoint, target: str, drafter: Path) -> str:
    """The command line that points an engine at the exported drafter."""
    block = ckpt.cfg.block_size
    if fmt == "vllm":
        # DFlash 2's convolution spans 1 + num_speculative_tokens positions: it must be block_size - 1.
        spec = json.dumps({"method": "dflash", "model": str(drafter), "num_speculative_tokens": block - 1})
        return f"vllm serve {target} --speculative-config '{spec}' --attention-backend flash_attn"
    if fmt == "sglang":
        return (f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
                f"--speculative-draft-model-path {drafter} --speculative-num-draft-tokens {block}")
    if fmt == "llama.cpp":
        return (f"llama-server -m {target} -md {drafter} --spec-type draft-dflash "
                f"--spec-draft-n-max {block - 1}")
    return f"blockspec generate --target {target} --drafter {drafter} --prompt 'Hello'"


def export_drafter(drafter: str | Path, fmt: str, target: str | Path, out: str | Path, *,
                   dtype: str = "auto") -> ExportResult:
    """Exports `drafter` (a directory in the published format) for `fmt` next to `target`:
    a directory for hf/vllm/sglang (target: its HF directory or zoo name), a GGUF file for
    llama.cpp (target: its GGUF file or zoo name)."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    out = Path(out)
    if out.resolve() == Path(drafter).resolve():
        raise ConfigError(f"--out {out} is the drafter's own directory; export into a new one")
    check_dtype(dtype)
    ckpt = read_checkpoint(drafter)
    if fmt == "llama.cpp":
        target_gguf = resolve_target_gguf(target)
        path = out / "drafter.gguf" if out.suffix != ".gguf" else out
        write_dflash_gguf(ckpt, target_gguf, path, dtype=dtype)
        return ExportResult(path, (path.name,), serve_command(fmt, ckpt, str(target_gguf), path))
    target_dir = resolve_target_dir(target)
    files = export_hf_dir(ckpt, target_dir, out, dtype=dtype)
    return ExportResult(out, tuple(files), serve_command(fmt, ckpt, str(target_dir), out))
