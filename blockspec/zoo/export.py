"""Export a drafter for the engines users serve it with: vLLM, SGLang, Transformers and llama.cpp.

Works on the checkpoint files (config.json + safetensors), not on our model class, so a DFlash 2
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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from blockspec.dflash.drafter import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    DrafterConfig,
    _read_state,
    check_compatible,
    read_drafter_config,
)
from blockspec.errors import CheckpointError, CompatibilityError, ConfigError

FORMATS = ("hf", "vllm", "sglang", "llama.cpp")
DFLASH_ARCH = "DFlashDraftModel"
DFLASH2_ARCH = "DFlash2DraftModel"
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Target tokenizer files copied beside an exported directory (Hub convention; the engines take the
# target's tokenizer themselves, but tools that open the drafter directory alone find one).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DFlash2Sizes:
    """The DFlash 2 sizes of a checkpoint (DESIGN section 7)."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"DFlash 2 config: {name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class DrafterCheckpoint:
    """A drafter directory read and checked: its config and its tensors by published name."""

    path: Path
    cfg: DrafterConfig
    dflash2: DFlash2Sizes | None
    tensors: dict[str, torch.Tensor]

    @property
    def architecture(self) -> str:
        return DFLASH2_ARCH if self.dflash2 else DFLASH_ARCH


def _dflash2_sizes(raw: dict, path: Path) -> DFlash2Sizes | None:
    arch = (raw.get("architectures") or [DFLASH_ARCH])[0]
    if arch not in (DFLASH_ARCH, DFLASH2_ARCH):
        raise CheckpointError(f"{path / CONFIG_NAME} declares architecture {arch!r}; "
                              f"only {DFLASH_ARCH} and {DFLASH2_ARCH} drafters can be exported")
    if arch == DFLASH_ARCH:
        return None
    section = raw.get("dflash_config") or {}
    values = {k: section.get(k, raw.get(k)) for k in DFLASH2_KEYS}
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise CheckpointError(f"{path / CONFIG_NAME} declares {DFLASH2_ARCH} but has no {', '.join(missing)} "
                              "(in dflash_config or at the top level)")
    sizes = DFlash2Sizes(**values)
    if raw["hidden_size"] % sizes.conv_group_size:
        raise ConfigError(f"DFlash 2 config: conv_group_size {sizes.conv_group_size} does not divide "
                          f"hidden_size {raw['hidden_size']}")
    return sizes


def expected_tensors(cfg: DrafterConfig, dflash2: DFlash2Sizes | None) -> dict[str, tuple[int, ...]]:
    """Every tensor of a published DFlash (2) checkpoint with its shape, from the config alone."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(cfg.target_layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        }
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,)}
        if dflash2:
            taps, projected = dflash2.conv_kernel_size, 2 * dflash2.conv_kernel_size * (h // dflash2.conv_group_size)
            for conv in ("attention_conv", "mlp_conv"):
                shapes |= {p + f"{conv}.base_kernel": (2, taps, h), p + f"{conv}.kernel_projection.weight": (projected, h)}
    if dflash2:
        rank = dflash2.selector_rank
        shapes |= {"candidate_selector.hidden_projection.weight": (rank, h),
                   "candidate_selector.predecessor_codebook": (cfg.vocab_size, rank),
                   "candidate_selector.successor_codebook": (cfg.vocab_size, rank)}
    return shapes


def read_checkpoint(path: str | Path) -> DrafterCheckpoint:
    """Reads and checks a drafter directory; a missing, unexpected or misshapen tensor is named."""
    path = Path(path)
    cfg = read_drafter_config(path)
    dflash2 = _dflash2_sizes(json.loads((path / CONFIG_NAME).read_text()), path)
    tensors = _read_state(path)
    want = expected_tensors(cfg, dflash2)
    for name, shape in want.items():
        if name not in tensors:
            raise CheckpointError(f"{path}: tensor {name} is missing (expected shape {list(shape)} for a "
                                  f"{DFLASH2_ARCH if dflash2 else DFLASH_ARCH} with this config.json)")
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"{path}: tensor {name} has shape {list(tensors[name].shape)}, "
                                  f"config.json implies {list(shape)}")
    for name in tensors:
        if name not in want:
            hint = (f"; it is a DFlash 2 tensor but config.json declares {DFLASH_ARCH}"
                    if not dflash2 and ("_conv." in name or name.startswith("candidate_selector.")) else "")
            raise CheckpointError(f"{path}: unexpected tensor {name}{hint}")
    return DrafterCheckpoint(path, cfg, dflash2, tensors)


def layer_causality(cfg: DrafterConfig) -> set[bool]:
    """Whether each layer's block attention is causal, as our drafter and the reference read it:
    `is_causal` when the config sets it, else causal exactly on sliding layers."""
    if cfg.is_causal is not None:
        return {bool(cfg.is_causal)}
    return {t == "sliding_attention" for t in cfg.layer_types}


def engine_config(ckpt: DrafterCheckpoint, mask_token: str | None) -> dict:
    """config.json for vLLM, SGLang and Transformers: every key the engines read, where they read it."""
    cfg = ckpt.cfg
    out = cfg.to_dict()
    dflash = dict(out["dflash_config"])
    for key in DFLASH2_KEYS:  # vLLM and SGLang read these from dflash_config only
        out.pop(key, None)
        dflash.pop(key, None)
    if ckpt.dflash2:
        dflash |= asdict(ckpt.dflash2)
    out["block_size"] = dflash["block_size"] = cfg.block_size  # SGLang and llama.cpp read either place
    # vLLM's DFlash 2 class and SGLang read the logit/embedding transforms from dflash_config only.
    for key, value, default in (("input_embedding_scale", cfg.input_embedding_scale, 1.0),
                                ("output_multiplier", cfg.output_multiplier, 1.0),
                                ("final_logit_softcapping", cfg.final_logit_softcapping, None)):
        if value != default:
            out[key] = dflash[key] = value
    # transformers' Qwen3Config (which vLLM and SGLang parse) drops sliding_window unless this is true
    out["use_sliding_window"] = "sliding_attention" in cfg.layer_types
    causal = layer_causality(cfg)
    if len(causal) == 1:  # explicit, so no engine falls back to its own default for sliding layers
        out["is_causal"] = causal.pop()
    if mask_token is not None:  # SGLang checks it against the target tokenizer (default "<|MASK|>")
        dflash["mask_token"] = mask_token
    out["architectures"] = [ckpt.architecture]
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
        return {k: v.contiguous() for k, v in tensors.items()}
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose auto, {', '.join(DTYPES)}")
    return {k: v.to(DTYPES[dtype]).contiguous() for k, v in tensors.items()}


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
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):  # e.g. a draft vocabulary or shards of an earlier export
        stale.unlink()
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    save_file(_cast(ckpt.tensors, dtype), str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    for f in tokenizer_files:
        shutil.copyfile(f, out / f.name)
    for f in out.iterdir():  # safetensors writes 0600; an export is meant to be shared
        f.chmod(0o644)
    return [CONFIG_NAME, WEIGHTS_NAME, *(f.name for f in tokenizer_files)]


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
