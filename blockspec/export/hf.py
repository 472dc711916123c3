"""The Hub-style directory that vLLM, SGLang and Transformers load a drafter from.

`hf`, `vllm` and `sglang` write the same files and differ only in the command printed for the
user (`blockspec.export.formats`). The DFlash keys an engine reads from `dflash_config` only (the
DFlash 2 sizes, the logit transforms, `mask_token`) are put there; our `draft_vocab.safetensors`
is left out (no engine reads it: they propose from the whole vocabulary, as `blockspec` does on
the exported directory). What each engine reads is recorded in the export docs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from blockspec.dflash.checkpoint import CONFIG_NAME, write_tensors
from blockspec.dflash.drafter_config import check_compatible
from blockspec.errors import CheckpointError, CompatibilityError
from blockspec.export.checkpoint import DrafterCheckpoint, cast_tensors

# Target tokenizer files copied beside an exported directory (Hub convention; the engines take the
# target's tokenizer themselves, but tools that open the drafter directory alone find one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")


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
    weights = write_tensors(cast_tensors(ckpt.tensors, dtype), out)
    for f in tokenizer_files:
        shutil.copyfile(f, out / f.name)
    for f in out.iterdir():  # safetensors writes 0600; an export is meant to be shared
        f.chmod(0o644)
    return [CONFIG_NAME, *weights, *(f.name for f in tokenizer_files)]
