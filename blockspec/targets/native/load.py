"""Loads Hugging Face Llama-family weights (a model object or a safetensors directory) natively."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from blockspec.cache_dir import packed_weights_file
from blockspec.cpu.int8 import int8_path
from blockspec.cpu.packed_cache import source_key
from blockspec.errors import CheckpointError, ConfigError
from blockspec.targets.native.backends import COMPUTES
from blockspec.targets.native.config import native_config, unsupported_reason
from blockspec.targets.native.llama import NativeLlama, NativeTarget
from blockspec.targets.rope import Rotary, rope_inv_freq
from blockspec.targets.base import DTYPES

PACK_ENV = "BLOCKSPEC_PACK_WEIGHTS"  # "0": stream the weights themselves, packable or not
ZOO_MARKER = "blockspec-zoo.json"  # zoo/registry.py's MARKER: the directory was converted from a GGUF file
# Whether compute="auto" takes int8 for a model converted from a quantised GGUF file: its quality
# holds (perplexity on held-out text within 1% of the exact mode's) and, where the CPU has the
# integer units of AUTO_INT8_PATHS, every pass is faster than exact's (BENCHMARKS.md, "Compute
# modes"). Elsewhere (AVX2 or plain C products) int8 was not shown to be faster, so auto is exact.
AUTO_INT8_FOR_GGUF = True
AUTO_INT8_PATHS = ("vnni",)
log = logging.getLogger("blockspec.load")


def resolve_compute(compute: str, *, from_gguf: bool, packed: bool, dtype: torch.dtype, device: str | torch.device,
                    int8_units: str | None = None) -> str:
    """The compute mode "auto" means for a model: "int8" for an fp32 CPU model converted from a
    quantised GGUF file (packed: its weights kept their GGUF levels) on a CPU whose int8 products
    (`int8_units`, default `cpu.int8.int8_path()`) are in AUTO_INT8_PATHS, "exact" for anything
    else (a Hugging Face checkpoint keeps transformers' numerics unless int8 is asked for)."""
    if compute not in COMPUTES:
        raise ConfigError(f"compute must be one of {', '.join(COMPUTES)}, got {compute!r}")
    if compute != "auto":
        return compute
    cpu = torch.device(device).type == "cpu"
    if not (AUTO_INT8_FOR_GGUF and from_gguf and packed and cpu and dtype == torch.float32):
        return "exact"
    return "int8" if (int8_path() if int8_units is None else int8_units) in AUTO_INT8_PATHS else "exact"


def is_native_supported(hf_config: object) -> bool:
    """Whether `load_native_target` can run a model with this config."""
    return unsupported_reason(hf_config) is None


def _strip(name: str) -> str:
    for prefix in ("model.", "transformer."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def native_state_dict(hf_state: dict[str, torch.Tensor], net: NativeLlama) -> dict[str, torch.Tensor]:
    """Maps HF parameter names onto the native layout (q|k|v concatenated)."""
    src = {_strip(k): v for k, v in hf_state.items() if "rotary_emb" not in k}
    out: dict[str, torch.Tensor] = {}

    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise CheckpointError(f"the checkpoint lacks weight {name!r}; is it a complete {net.cfg.model_type} model?")
        return src.pop(name)

    out["embed.weight"] = take("embed_tokens.weight")
    out["norm"] = take("norm.weight")
    for i, layer in enumerate(net.layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        out[p + "input_norm"] = take(p + "input_layernorm.weight")
        out[p + "post_norm"] = take(p + "post_attention_layernorm.weight")
        out[p + "qkv.weight"] = torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"])
        if layer.qkv.bias is not None:
            out[p + "qkv.bias"] = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"])
        out[p + "o.weight"] = take(a + "o_proj.weight")
        if layer.o.bias is not None:
            out[p + "o.bias"] = take(a + "o_proj.bias")
        if layer.q_norm is not None:
            out[p + "q_norm"] = take(a + "q_norm.weight")
            out[p + "k_norm"] = take(a + "k_norm.weight")
        m = p + "mlp."
        out[p + "gate_up.weight"] = torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
        out[p + "down.weight"] = take(m + "down_proj.weight")
        if layer.down.bias is not None:
            out[p + "gate_up.bias"] = torch.cat([take(m + "gate_proj.bias"), take(m + "up_proj.bias")])
            out[p + "down.bias"] = take(m + "down_proj.bias")
    head = src.pop("lm_head.weight", None)
    if not net.cfg.tie_word_embeddings:
        if head is None:
            raise CheckpointError("the checkpoint has no lm_head.weight and tie_word_embeddings is false")
        out["lm_head.weight"] = head
    leftover = [k for k in src if not k.endswith(("inv_freq", "masked_bias"))]
    if leftover:
        raise CheckpointError(f"unexpected weights for a {net.cfg.model_type} model: {leftover[:5]}")
    return out


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"no model.safetensors (or index) in {path}; the native backend reads safetensors")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(path / f)))
    return state


def _eos_ids(path: Path, hf_config: object) -> tuple[int, ...]:
    ids: set[int] = set()
    sources = [getattr(hf_config, "eos_token_id", None)]
    gen = path / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for s in sources:
        if isinstance(s, int):
            ids.add(s)
        elif isinstance(s, (list, tuple)):
            ids.update(int(t) for t in s)
    return tuple(sorted(ids))


def load_native_target(
    source: str | Path | torch.nn.Module,
    dtype: str | torch.dtype | None = "float32",
    device: str | torch.device = "cpu",
    *,
    eos_token_ids: tuple[int, ...] | None = None,
    single_token_weights: bool | None = None,
    pack_weights: bool | None = None,
    compute: str = "exact",
) -> NativeTarget:
    """A NativeTarget from a Hugging Face model object or a local model directory.

    dtype: "float32" | "bfloat16" | "float16" | "float64" | a torch dtype | None (keep the
    source's). Raises ConfigError for architectures the native code does not cover.
    single_token_weights: keep transposed copies of the widest matrices for one-token forwards
    where the CPU kernel is MKL's (faster plain decoding there, for more weight memory:
    docs/DESIGN.md section 12; with oneDNN, cpu/linear.py's default, none are made); None = on
    for CPU devices.
    pack_weights: keep a packed copy of each projection (and the head) whose weights are exactly
    of a 4- or 8-bit GGUF's form, or for bf16 their roundings (cpu/packed_weights.py: the same outputs,
    bit for bit, from fewer bytes); None = on for fp32 and bf16 on the CPU unless
    $BLOCKSPEC_PACK_WEIGHTS is 0 (to compare against streaming the weights themselves). A model
    converted into the blockspec cache keeps its packed forms beside it (cpu/packed_cache.py):
    later loads read them back instead of packing again.
    compute: "exact" (bit-exact fp32 / bf16, transformers' numerics), "int8" (integer products of
    8-bit activations, cpu/int8.py: fp32 on a CPU; lossless within the mode) or "auto" (int8 for a
    zoo model converted from a quantised GGUF file, else exact: `resolve_compute`). The mode is
    `target.compute`, and is logged (logger "blockspec.load").
    """
    if compute not in COMPUTES:
        raise ConfigError(f"compute must be one of {', '.join(COMPUTES)}, got {compute!r}")
    path = None
    if isinstance(source, torch.nn.Module):
        hf_config = source.config
        state = source.state_dict()
        gen = getattr(source, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        default_eos = tuple([eos] if isinstance(eos, int) else (eos or ()))
    else:
        from transformers import AutoConfig

        path = Path(source)
        if not (path / "config.json").exists():
            raise CheckpointError(f"{path} is not a Hugging Face model directory (no config.json)")
        hf_config = AutoConfig.from_pretrained(str(path))
        state = _read_safetensors(path)
        default_eos = _eos_ids(path, hf_config)
    text_config = getattr(hf_config, "text_config", None) or hf_config
    cfg = native_config(text_config)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    if dtype is None:
        dtype = next(iter(state.values())).dtype
    with torch.device("meta"):  # no throwaway random init of a large model
        net = NativeLlama(cfg, text_config)
    mapped = native_state_dict(state, net)
    result = net.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in mapped.items()},
                                 strict=False, assign=True)
    missing = [k for k in result.missing_keys if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing:
        raise CheckpointError(f"native weights missing after loading: {missing[:5]}")
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.embed.weight
    # RoPE tables stay fp32 whatever the weight dtype (the buffer was built on the meta device).
    inv_freq, scaling = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, text_config)
    net.rotary = Rotary(inv_freq.to(device), scaling)
    if single_token_weights is None:
        single_token_weights = torch.device(device).type == "cpu"
    net.prepare_single_token_weights(single_token_weights)
    if pack_weights is None:
        pack_weights = (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                        and os.environ.get(PACK_ENV, "1") != "0")
    if pack_weights:
        name = str(dtype).removeprefix("torch.")
        cache = None if path is None else packed_weights_file(path, name)  # beside a converted model of the cache
        net.pack_weights(mapped if dtype == torch.bfloat16 else None, cache=cache,
                         key=None if cache is None else source_key(path, dtype))
    mode = resolve_compute(compute, from_gguf=path is not None and (path / ZOO_MARKER).exists(),
                           packed=net.packed_summary() is not None, dtype=dtype, device=device)
    try:
        backend = net.use(mode)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    log.info("%s: compute %s%s", path.name if path is not None else type(source).__name__, backend.describe(),
             "" if net.packed_summary() is None else f"; packed: {net.packed_summary()}")
    return NativeTarget(net, eos_token_ids if eos_token_ids is not None else default_eos, text_config)


BACKENDS = ("auto", "native", "hf")


def load_target(
    path: str | Path, *, backend: str = "auto", dtype: str = "float32", device: str = "cpu", compute: str = "exact"
) -> tuple[object, object]:
    """(target, tokenizer) for a local model directory.

    backend "native" runs our own Llama-family code (ConfigError for other architectures),
    "hf" the Hugging Face adapter, "auto" native when the architecture is supported, else hf.
    compute: see `load_native_target` (the hf backend computes exactly: "int8" is refused there).
    """
    if compute not in COMPUTES:
        raise ConfigError(f"compute must be one of {', '.join(COMPUTES)}, got {compute!r}")
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    from blockspec.targets.hf import load_hf_target

    path = Path(path)
    if backend == "hf":
        _exact_only(compute, "the hf backend")
        return load_hf_target(path, dtype=dtype, device=device)
    if not (path / "config.json").exists():
        raise CheckpointError(
            f"{path} is not a Hugging Face model directory (no config.json); pass a local model "
            "directory or a known zoo name (see `blockspec pull --list`)"
        )
    from transformers import AutoConfig, AutoTokenizer

    reason = unsupported_reason(AutoConfig.from_pretrained(str(path)))
    if reason is not None:
        if backend == "native":
            raise ConfigError(f"the native backend does not support {path.name}: {reason}; use backend='hf'")
        _exact_only(compute, f"{path.name} (run by the hf backend: {reason})")
        return load_hf_target(path, dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if dtype == "auto":  # bf16 on GPUs; fp32 on CPUs (where bf16 measured slower in training)
        dtype = "bfloat16" if str(device).startswith("cuda") else "float32"
    target = load_native_target(path, dtype, device, compute=compute)
    eos = set(target.info.eos_token_ids)
    if isinstance(tokenizer.eos_token_id, int):
        eos.add(tokenizer.eos_token_id)
    if eos != set(target.info.eos_token_ids):
        target = NativeTarget(target.net, tuple(sorted(eos)), target.config)
    return target, tokenizer


def _exact_only(compute: str, what: str) -> None:
    if compute == "int8":
        raise ConfigError(f"compute='int8' needs the native backend; {what} computes exactly: use compute='exact'")
