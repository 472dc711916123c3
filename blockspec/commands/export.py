"""`blockspec export DRAFTER --format F --target T --out O`: a drafter in the files an engine loads.

hf, vllm and sglang write one Hub-style directory (config.json, model.safetensors, the target's
tokenizer files); llama.cpp writes one GGUF file. The command prints how to point the engine at it.
"""

from __future__ import annotations

import argparse

from blockspec.export import FORMATS

HELP = "write a drafter in the files vLLM, SGLang, Transformers (hf) or llama.cpp load"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("drafter", help="drafter directory in the published format (DFlash or DFlash 2), "
                                   "or a zoo target name for the drafter shipped with blockspec")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="hf / vllm / sglang: the same directory, different launch command; llama.cpp: a GGUF file")
    p.add_argument("--target", required=True,
                   help="the target model: its Hugging Face directory or zoo name (hf, vllm, sglang); "
                        "its GGUF file or zoo name (llama.cpp)")
    p.add_argument("--out", required=True, help="output directory (llama.cpp: a directory or a .gguf path)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="weight dtype (auto: as stored); GGUF keeps norms and conv kernels in float32")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from blockspec.api import default_drafter_for
    from blockspec.export import export_drafter

    drafter = Path(args.drafter)
    if not drafter.is_dir() and (shipped := default_drafter_for(args.drafter)) is not None:
        drafter = shipped
    result = export_drafter(drafter, args.format, args.target, args.out, dtype=args.dtype)
    print(f"wrote {result.path} ({', '.join(result.files)})")
    print(f"run it with:\n  {result.command}")
    return 0
