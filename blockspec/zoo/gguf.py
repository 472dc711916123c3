"""Convert a GGUF file into a Hugging Face model directory (safetensors, config, tokenizer, template).

`transformers` does the dequantising load; this module repairs what its GGUF path gets wrong and
checks the result instead of trusting it:
- special tokens come from the GGUF metadata (transformers 5.x swaps bos/eos for Llama-type vocabularies);
- SentencePiece-BPE vocabularies (Gemma) are rebuilt as a real BPE with merges ranked by piece score
  (transformers builds a Unigram model from BPE scores, which splits "capital" into c/ap/it/al) and
  get the BOS that the GGUF asks for;
- an output head present in the file must be loaded (untied), an absent one must be tied;
- the saved directory is reloaded and must tokenize and template exactly as the in-memory one.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockspec.errors import CheckpointError

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_PROBE = "Hello world!\n\n    def f(x):  return 12345  # héllo 日本"


@dataclass(frozen=True)
class GGUFInfo:
    """The metadata key/values of a GGUF file and the names of its tensors."""

    metadata: dict[str, Any]
    tensor_names: tuple[str, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "?"))

    def token_id(self, kind: str) -> int | None:
        value = self.metadata.get(f"tokenizer.ggml.{kind}_token_id")
        return None if value is None else int(value)


def read_gguf_info(path: Path) -> GGUFInfo:
    """Parse the header of a GGUF file (v2/v3) without touching tensor data; fast for big vocabularies."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise CheckpointError(f"{path} is not a GGUF file (bad magic); delete it and pull again")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise CheckpointError(f"{path}: GGUF version {version} is too old (need 2 or newer)")
        pos = 24

        def read(fmt: str) -> Any:
            nonlocal pos
            (value,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return value

        def read_str() -> str:
            nonlocal pos
            n = read("<Q")
            s = bytes(buf[pos : pos + n]).decode("utf-8", errors="replace")
            pos += n
            return s

        def read_value(vtype: int) -> Any:
            nonlocal pos
            if vtype in _SCALAR:
                return read(_SCALAR[vtype])
            if vtype == _STRING:
                return read_str()
            if vtype == _ARRAY:
                itype, count = read("<I"), read("<Q")
                if itype in _SCALAR:  # one unpack for the whole array (scores, token types)
                    fmt = f"<{count}{_SCALAR[itype][1]}"
                    values = list(struct.unpack_from(fmt, buf, pos))
                    pos += struct.calcsize(fmt)
                    return values
                if itype == _STRING:  # vocabularies: hundreds of thousands of strings
                    out, unpack, p = [], struct.unpack_from, pos
                    for _ in range(count):
                        (n,) = unpack("<Q", buf, p)
                        out.append(buf[p + 8 : p + 8 + n].decode("utf-8", errors="replace"))
                        p += 8 + n
                    pos = p
                    return out
                return [read_value(itype) for _ in range(count)]
            raise CheckpointError(f"{path}: unknown GGUF value type {vtype}; the file may be corrupt")

        metadata = {}
        for _ in range(n_kv):
            key = read_str()
            metadata[key] = read_value(read("<I"))
        names = []
        for _ in range(n_tensors):
            names.append(read_str())
            n_dims = read("<I")
            pos += 8 * n_dims + 4 + 8  # dims, type, offset
    return GGUFInfo(metadata, tuple(names))


def _spm_bpe_tokenizer(info: GGUFInfo) -> Any:
    """A fast BPE tokenizer equivalent to a SentencePiece-BPE vocabulary stored in GGUF (Gemma)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import generate_merges

    md = info.metadata
    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    scores: list[float] = list(md["tokenizer.ggml.scores"])
    types: list[int] = list(md.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    # GGUF stores user-defined whitespace runs with real spaces; the model text uses U+2581 for them.
    tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = [(t, s) for t, s, ty in zip(tokens, scores, types) if ty == 1]
    unk_id = info.token_id("unknown")
    unk = tokens[unk_id] if unk_id is not None else None
    merges = generate_merges(vocab, normal)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    norm = [normalizers.Replace(" ", "\u2581")]
    if md.get("tokenizer.ggml.add_space_prefix", False):
        norm.insert(0, normalizers.Prepend("\u2581"))
    tk.normalizer = normalizers.Sequence(norm)
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    # SentencePiece matches control and user-defined pieces whole, before any merge.
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    tk.add_tokens([AddedToken(t, special=False, normalized="\u2581" in t) for t, ty in zip(tokens, types) if ty == 4])
    bos_id = info.token_id("bos")
    if md.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    kinds = (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding"))
    special = {kind: tokens[i] for kind, key in kinds if (i := info.token_id(key)) is not None}
    return PreTrainedTokenizerFast(tokenizer_object=tk, clean_up_tokenization_spaces=False, **special)


def load_tokenizer(gguf_path: Path, info: GGUFInfo) -> Any:
    """Tokenizer for the GGUF file, with special tokens, template and BOS behaviour as the file says."""
    from transformers import AutoTokenizer

    md = info.metadata
    if md.get("tokenizer.ggml.model") == "llama" and "tokenizer.ggml.scores" in md:
        tok = _spm_bpe_tokenizer(info)
    else:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        ids = {k: info.token_id(k) for k in ("bos", "eos", "padding")}
        if ids["eos"] is not None:
            tok.eos_token = tok.convert_ids_to_tokens(ids["eos"])
        if ids["padding"] is not None:
            tok.pad_token = tok.convert_ids_to_tokens(ids["padding"])
        if ids["bos"] is not None and tok.bos_token is not None:  # keep "no BOS" vocabularies (Qwen) that way
            tok.bos_token = tok.convert_ids_to_tokens(ids["bos"])
        tok.clean_up_tokenization_spaces = False
    template = md.get("tokenizer.chat_template")
    tok.chat_template = template if template else None
    ctx = md.get(f"{info.architecture}.context_length")
    if ctx:
        tok.model_max_length = int(ctx)
    _check_bos(tok, info)
    return tok


def _check_bos(tok: Any, info: GGUFInfo) -> None:
    wants = bool(info.metadata.get("tokenizer.ggml.add_bos_token", False))
    bos = info.token_id("bos")
    first = tok("Hello").input_ids[0]
    if wants and first != bos:
        raise CheckpointError(f"converted tokenizer does not add BOS (id {bos}) although the GGUF asks for it")
    if not wants and bos is not None and first == bos:
        raise CheckpointError(f"converted tokenizer adds BOS (id {bos}) although the GGUF does not ask for it")


def _tidy(x: float) -> float:
    """1e-05 rather than 9.999999747378752e-06: GGUF stores float32, configs read better as decimals."""
    return float(f"{x:.7g}")


def convert(
    gguf_path: Path,
    out_dir: Path,
    *,
    dtype: str,
    stop_tokens: tuple[str, ...] = (),
    expect_chat_template: bool = True,
) -> dict[str, Any]:
    """Dequantise `gguf_path` into an HF directory `out_dir` (created); returns facts for the record."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    info = read_gguf_info(gguf_path)
    if expect_chat_template and not info.metadata.get("tokenizer.chat_template"):
        raise CheckpointError(f"{gguf_path.name} has no chat template although this zoo entry expects one")
    tok = load_tokenizer(gguf_path, info)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model, loading = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch_dtype, output_loading_info=True
    )
    tied = bool(model.config.tie_word_embeddings)
    missing = [k for k in loading.get("missing_keys", []) if not (k == "lm_head.weight" and tied)]
    if missing:
        raise CheckpointError(f"{gguf_path.name}: weights not found in the GGUF (would be random): {missing[:5]}")
    has_head = "output.weight" in info.tensor_names
    if has_head == bool(model.config.tie_word_embeddings):
        raise CheckpointError(
            f"{gguf_path.name}: output head {'present' if has_head else 'absent'} in the GGUF but "
            f"tie_word_embeddings={model.config.tie_word_embeddings}; the conversion would use the wrong LM head"
        )
    if hasattr(model.config, "rms_norm_eps"):
        model.config.rms_norm_eps = _tidy(model.config.rms_norm_eps)

    vocab = tok.get_vocab()
    eos = [i for i in (info.token_id("eos"),) if i is not None]
    eos += [vocab[t] for t in stop_tokens if t in vocab and vocab[t] not in eos]
    if not eos:
        raise CheckpointError(f"{gguf_path.name}: no end-of-sequence token; generation would never stop")
    pad = info.token_id("padding")
    model.config.eos_token_id = eos[0]
    model.config.pad_token_id = pad
    model.generation_config = GenerationConfig(
        bos_token_id=info.token_id("bos"),
        eos_token_id=eos if len(eos) > 1 else eos[0],
        pad_token_id=pad if pad is not None else eos[0],
    )

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))

    # Reload what a user will load and compare with what we built.
    again = AutoTokenizer.from_pretrained(str(out_dir))
    if again(_PROBE).input_ids != tok(_PROBE).input_ids:
        raise CheckpointError(f"saved tokenizer in {out_dir} tokenizes differently from the GGUF one")
    if (again.chat_template or None) != (tok.chat_template or None):
        raise CheckpointError(f"chat template was lost when saving the tokenizer to {out_dir}")
    if again.eos_token_id != eos[0]:
        raise CheckpointError(f"saved tokenizer has eos id {again.eos_token_id}, expected {eos[0]}")
    return {
        "architecture": info.architecture,
        "model_type": model.config.model_type,
        "dtype": dtype,
        "tie_word_embeddings": bool(model.config.tie_word_embeddings),
        "eos_token_ids": eos,
        "chat_template": bool(tok.chat_template),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
