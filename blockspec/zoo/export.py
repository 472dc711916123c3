"""Export a drafter for the engines users serve it with: vLLM, SGLang, Transformers and llama.cpp.

Works on the checkpoint files (config.json + safetensors, read and checked by
`blockspec.dflash.checkpoint` as loading a drafter does), not on our model class, so a DFlash 2
checkpoint (`architectures: ["DFlash2DraftModel"]`) goes through the same path as a DFlash one.
What each engine reads is recorded in docs (export section); in short:

- vLLM, SGLang and Transformers read one Hub-style directory: `hf`, `vllm` and `sglang` write the
  same files and differ only in the command printed for the user. The DFlash keys an engine reads
  from `dflash_config` only (the DFlash 2 sizes, the logit transforms, `mask_token`) are put there;
  our `draft_vocab.safetensors` is left out (no engine reads it: they propose from the whole
  vocabulary, as `blockspec` does on the exported directory).
- llama.cpp reads one GGUF file (see `blockspec.zoo.export_gguf`), whose vocabulary must match the
  target's GGUF token for token: its tokenizer keys are copied from the target GGUF.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from blockspec.dflash.checkpoint import CONFIG_NAME, check_tensors, read_tensors, write_tensors
from blockspec.dflash.drafter import DrafterConfig, check_compatible, read_drafter_config
from blockspec.errors import CheckpointError, CompatibilityError, ConfigError

FORMATS = ("hf", "vllm", "sglang", "llama.cpp")
# Target tokenizer files copied beside an exported directory (Hub convention; the engines take the
# target's tokenizer themselves, but tools that open the drafter directory alone find one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
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


def engine_config(ckpt: DrafterCheckpoint, mask_token: str | None) -> dict:
    """config.json for vLLM, SGLang and Transformers: every key the engines read, where they read it."""
    cfg = ckpt.cfg
    out = cfg.to_dict()
    dflash = dict(out["dflash_config"])  # to_dict already puts the DFlash 2 sizes here, where vLLM and SGLang read them
    out["block_size"] = dflash["block_size"] = cfg.block_size  # SGLang and llama.cpp read either place
    # vLLM's DFlash 2 class and SGLang read the logit/embedding transforms from dflash_config only.
    for key, value, default in (("input_embedding_scale", cfg.input_embedding_scale, 1.0),
                                ("output_multiplier", cfg.output_multiplier, 1.0),
                                ("final_logit_softcapping", cfg.final_logit_softcapping, None)):
        if value != default:
            out[key] = dflash[key] = value
    # transformers' Qwen3Config (which vLLM and SGLang parse) drops sliding_window unless this is true
    out["use_sliding_window"] = "sliding_attention" in cfg.layer_types
    out["is_causal"] = cfg.block_causal  # explicit, so no engine falls back to its own default for sliding layers
    if mask_token is not None:  # SGLang checks it against the target tokenizer (default "<|MASK|>")
        dflash["mask_token"] = mask_token
    out["dflash_config"] = dflash
    return out


@dataclass(frozen=True)
class ExportResult:
    """What was written and how to run it."""

    path: Path
    files: tuple[str, ...]
    command: str


def _cast(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    if dtype == "auto":
        return tensors
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return {k: v.to(DTYPES[dtype]) for k, v in tensors.items()}


def _target_tokenizer(target: Path) -> tuple[object, list[Path]]:
    files = [target / f for f in TOKENIZER_FILES if (target / f).exists()]
    if not any(f.name in ("tokenizer.json", "tokenizer.model", "vocab.json") for f in files):
        raise CheckpointError(f"target {target} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json); "
                              "point --target at the target's Hugging Face directory")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target)), files


def _target_dims(target: Path) -> tuple[int, int, int]:
    try:
        raw = json.loads((target / CONFIG_NAME).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"target {target} has no readable config.json ({e})") from e
    raw = raw.get("text_config") or raw
    try:
        return int(raw["hidden_size"]), int(raw["vocab_size"]), int(raw["num_hidden_layers"])
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"target {target / CONFIG_NAME} lacks {e}; is it a causal LM directory?") from e


def _mask_token(tokenizer: object, mask_token_id: int) -> str:
    token = tokenizer.convert_ids_to_tokens(mask_token_id)
    if token is None or tokenizer.convert_tokens_to_ids(token) != mask_token_id:
        raise CompatibilityError(f"mask_token_id {mask_token_id} has no unique token in the target tokenizer; "
                                 "SGLang resolves the mask token by its text, so retrain with a mask id that has one")
    return token


def export_hf_dir(ckpt: DrafterCheckpoint, target: Path, out: Path, *, dtype: str = "auto") -> list[str]:
    """Writes the Hub-style directory that vLLM, SGLang and Transformers load; returns its file names."""
    hidden, vocab, layers = _target_dims(target)
    check_compatible(ckpt.cfg, hidden_size=hidden, vocab_size=vocab, num_layers=layers)
    tokenizer, tokenizer_files = _target_tokenizer(target)
    config = engine_config(ckpt, _mask_token(tokenizer, ckpt.cfg.mask_token_id))
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):  # e.g. a draft vocabulary of an earlier export
        stale.unlink()
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    weights = write_tensors(_cast(ckpt.tensors, dtype), out)
    for f in tokenizer_files:
        shutil.copyfile(f, out / f.name)
    for f in out.iterdir():  # safetensors writes 0600; an export is meant to be shared
        f.chmod(0o644)
    return [CONFIG_NAME, *weights, *(f.name for f in tokenizer_files)]


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
    ckpt = read_checkpoint(drafter)
    if fmt == "llama.cpp":
        from blockspec.zoo.export_gguf import resolve_target_gguf, write_dflash_gguf

        target_gguf = resolve_target_gguf(target)
        path = out / "drafter.gguf" if out.suffix != ".gguf" else out
        write_dflash_gguf(ckpt, target_gguf, path, dtype=dtype)
        return ExportResult(path, (path.name,), serve_command(fmt, ckpt, str(target_gguf), path))
    from blockspec.zoo.registry import resolve_target_dir

    target_dir = resolve_target_dir(target)
    files = export_hf_dir(ckpt, target_dir, out, dtype=dtype)
    return ExportResult(out, tuple(files), serve_command(fmt, ckpt, str(target_dir), out))
