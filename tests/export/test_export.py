"""`blockspec export`: the files vLLM, SGLang, Transformers and llama.cpp read, DFlash and DFlash 2.

The per-engine requirements below are data read from the engines' public code (cited per table);
they are what the exported files are checked against, since none of the engines runs here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec.cli import main
from blockspec.config import SamplingParams, SpecConfig
from blockspec.engine.decoder import SpecDecoder
from blockspec.dflash.drafter import DFLASH2, DFLASH2_DEFAULTS, DrafterConfig, load_drafter
from blockspec.errors import CheckpointError, CompatibilityError, ConfigError
from blockspec.targets.hf import HFTarget
from blockspec.dflash.checkpoint import expected_tensors
from blockspec.export import DrafterCheckpoint, engine_config, export_drafter, read_checkpoint
from blockspec.export.gguf import gguf_name

gguf = pytest.importorskip("gguf")

# ---- what each engine reads (facts from their code; no engine runs here) -------------------------

# vLLM: model_executor/models/registry.py maps these architectures to qwen3_dflash(2).py;
# qwen3_dflash.py @ 036a00d1 (mask_token_id, target_layer_ids read from dflash_config; layer
# attention from layer_types/sliding_window/is_causal); qwen3_dflash2.py @ 030da624 (the four
# DFlash 2 sizes read as dflash_config[...], a KeyError when absent); spec_decode/eagle/eagle3_utils.py
# @ 0cfdd2e1 (target layers = dflash_config.target_layer_ids + 1 unless
# eagle_aux_hidden_state_layer_ids is set, which we never write).
VLLM_TOP_LEVEL = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "hidden_act",
                  "vocab_size", "model_type")
VLLM_DFLASH_CONFIG = ("mask_token_id", "target_layer_ids")
# SGLang: srt/speculative/dflash_utils.py parse_dflash_draft_config @ 00731f0b (conv/selector sizes,
# output_multiplier and final_logit_softcapping read from dflash_config only; block_size from
# dflash_config or the top level; mask_token checked against the target tokenizer by
# dflash_worker.py @ 0468412f); srt/models/dflash.py (post-#35371): EntryClass DFlashDraftModel and
# DFlash2DraftModel, explicit is_causal honoured, sliding layers need sliding_window.
SGLANG_DFLASH_CONFIG = ("mask_token_id", "target_layer_ids", "block_size", "mask_token")
DFLASH2_DFLASH_CONFIG = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
ARCHITECTURES = {"DFlashDraftModel", "DFlash2DraftModel"}  # registered by vLLM and SGLang alike
# llama.cpp (as vendored in llama-cpp-python 0.3.36, commit 0c1e570): src/models/dflash.cpp reads
# these keys and tensors; conversion/qwen.py DFlashModel writes them. The names below are the ones
# its converter wrote for our shipped drafter (3 layers), checked against ours in the slow test.
LLAMA_CPP_LAYER = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                   "attn_q_norm.weight", "attn_k_norm.weight", "ffn_norm.weight", "ffn_gate.weight",
                   "ffn_up.weight", "ffn_down.weight")
LLAMA_CPP_GLOBAL = ("fc.weight", "enc.output_norm.weight", "output_norm.weight")
LLAMA_CPP_DFLASH2_LAYER = ("attn_conv_base", "attn_conv_proj.weight", "ffn_conv_base", "ffn_conv_proj.weight")
LLAMA_CPP_DFLASH2_GLOBAL = ("selector_predecessor.weight", "selector_successor.weight", "selector_hidden.weight")
LLAMA_CPP_REQUIRED_KEYS = ("general.architecture", "dflash.block_count", "dflash.embedding_length",
                           "dflash.feed_forward_length", "dflash.attention.head_count", "dflash.attention.head_count_kv",
                           "dflash.attention.layer_norm_rms_epsilon", "dflash.rope.freq_base", "dflash.target_layers",
                           "dflash.block_size", "dflash.attention.causal", "tokenizer.ggml.model",
                           "tokenizer.ggml.tokens", "tokenizer.ggml.mask_token_id")
# The converter's metadata for our shipped drafter (`convert_hf_to_gguf.py --target-model-dir`),
# tokenizer keys aside: it rebuilt SmolLM2's tokenizer as `llama` where the target GGUF says `gpt2`.
CONVERTED_SHIPPED = {
    "dflash.block_count": 3, "dflash.context_length": 8192, "dflash.embedding_length": 576,
    "dflash.feed_forward_length": 1536, "dflash.attention.head_count": 9, "dflash.attention.head_count_kv": 3,
    "dflash.attention.causal": False, "dflash.rope.freq_base": 100000.0, "dflash.attention.key_length": 64,
    "dflash.attention.value_length": 64, "dflash.block_size": 16, "dflash.target_layers": [2, 15, 28],
    "dflash.attention.sliding_window": 512, "dflash.attention.sliding_window_pattern": [True, True, True],
    "tokenizer.ggml.mask_token_id": 49151,
}


# ---- builders -----------------------------------------------------------------------------------


def tiny_config(**over) -> DrafterConfig:
    kw = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, vocab_size=48, num_target_layers=4, mask_token_id=47,
              target_layer_ids=(1, 2), block_size=8, rope_theta=10000.0, max_position_embeddings=512)
    return DrafterConfig(**(kw | over))


def dflash2_sizes(conv_kernel_size: int = 2, conv_group_size: int = 8, selector_rank: int = 6,
                  selector_top_k: int = 4) -> dict:
    """The DrafterConfig fields of a DFlash 2 drafter of these sizes."""
    return dict(architecture=DFLASH2, conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                selector_rank=selector_rank, selector_top_k=selector_top_k)


def write_checkpoint(path: Path, cfg: DrafterConfig, *, sizes_at_top_level: bool = False, seed: int = 0,
                     drop: str | None = None, reshape: str | None = None) -> Path:
    """A checkpoint in the published layout with random tensors, DFlash or DFlash 2 (DESIGN
    section 7: the layout vLLM, SGLang and llama.cpp read), from the config, not a model class."""
    g = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(s, generator=g) * 0.05 for n, s in expected_tensors(cfg).items()}
    for name in tensors:
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + tensors[name]
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][..., :-1].contiguous()
    raw = cfg.to_dict()
    if cfg.dflash2 and sizes_at_top_level:
        raw |= {k: raw["dflash_config"].pop(k) for k in DFLASH2_DEFAULTS}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def write_target_gguf(path: Path, *, hidden: int, layers: int, tokens: list[str]) -> Path:
    """A target GGUF with only what the export reads: dimensions and a byte-level BPE tokenizer."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(["a b", "ab c"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)
    w.add_chat_template("{{ messages }}")
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), hidden), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def read_gguf(path: Path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: t for t in r.tensors}
    return fields, tensors


def gguf_as_torch(t) -> torch.Tensor:
    """A GGUF tensor's values in the published (torch) shape, as float32."""
    data = np.asarray(t.data)
    if t.tensor_type == gguf.GGMLQuantizationType.BF16:
        data = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    return torch.from_numpy(np.array(data, dtype=np.float32)).reshape([int(d) for d in reversed(t.shape)])


TOKENS = ["<s>", "</s>"] + [f"t{i}" for i in range(46)]  # 48 = tiny_config's vocabulary


# ---- the Hugging Face directory (hf / vllm / sglang) ---------------------------------------------


def test_hf_export_has_what_vllm_and_sglang_read(tiny_model_dir, tiny_drafter_dir, tmp_path, capsys) -> None:
    assert main(["export", str(tiny_drafter_dir), "--format", "sglang", "--target", str(tiny_model_dir),
                 "--out", str(tmp_path / "x")]) == 0
    out = capsys.readouterr().out
    assert "--speculative-draft-model-path" in out and "--speculative-num-draft-tokens 4" in out
    raw = json.loads((tmp_path / "x" / "config.json").read_text())
    assert raw["architectures"][0] in ARCHITECTURES and raw["architectures"] == ["DFlashDraftModel"]
    assert all(key in raw for key in VLLM_TOP_LEVEL), [k for k in VLLM_TOP_LEVEL if k not in raw]
    assert all(key in raw["dflash_config"] for key in VLLM_DFLASH_CONFIG + SGLANG_DFLASH_CONFIG)
    assert raw["model_type"] == "qwen3" and raw["dflash_config"]["block_size"] == raw["block_size"] == 4
    assert raw["dflash_config"]["mask_token"] == "<|MASK|>"  # the tiny tokenizer's id 3
    assert raw["is_causal"] is False  # explicit: no engine falls back to its own default
    assert not any(key in raw["dflash_config"] for key in DFLASH2_DFLASH_CONFIG)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {f.name for f in (tmp_path / "x").iterdir()}
    names = set(load_file(str(tmp_path / "x" / "model.safetensors")))
    assert names == set(load_file(str(tiny_drafter_dir / "model.safetensors")))
    # vLLM and SGLang fuse these names (stacked_params_mapping); they must be there to be found.
    assert {"layers.0.self_attn.q_proj.weight", "layers.0.mlp.gate_proj.weight", "fc.weight",
            "hidden_norm.weight", "norm.weight"} <= names


def test_hf_export_loads_back_alike_in_blockspec_and_the_reference(tiny_model_dir, tiny_drafter_dir,
                                                                    tmp_path) -> None:
    """Same drafter pass in blockspec before and after export; the reference package reads the
    export and decodes greedily to the same tokens as blockspec on it."""
    from dflash.model import DFlashDraftModel, dflash_generate
    from transformers import AutoModelForCausalLM

    result = export_drafter(tiny_drafter_dir, "hf", tiny_model_dir, tmp_path / "x", dtype="float32")
    before, after = load_drafter(tiny_drafter_dir), load_drafter(result.path)
    g = torch.Generator().manual_seed(0)
    n = len(before.target_layer_ids)
    ctx, emb, pos = torch.randn(1, 9, 64 * n, generator=g), torch.randn(1, 4, 64, generator=g), torch.arange(13)[None]
    with torch.no_grad():
        ours = after(ctx, pos[:, :9], emb, pos[:, 9:])
        assert torch.equal(before(ctx, pos[:, :9], emb, pos[:, 9:]), ours)
        ref = DFlashDraftModel.from_pretrained(str(result.path)).float().eval()
        theirs = ref(position_ids=pos, noise_embedding=emb, target_hidden=ctx)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    target = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    dec = SpecDecoder(HFTarget(target), after, SpecConfig(block_size=4))
    for prompt in ([5, 6, 7, 8, 9], list(range(20, 40))):
        mine = dec.generate([prompt], SamplingParams(max_new_tokens=24))[0].token_ids
        ref_out = dflash_generate(ref, target, torch.tensor([prompt]), 24, None, block_size=4)
        assert mine == ref_out[0, len(prompt):].tolist()


def test_dflash2_checkpoint_exports_with_its_keys_in_dflash_config(tiny_model_dir, tmp_path) -> None:
    """A hand-built DFlash 2 checkpoint with its sizes at the top level (DESIGN: read from either
    place): the export moves them into dflash_config, where vLLM and SGLang read them, and keeps
    every tensor byte for byte under its published name."""
    cfg = tiny_config(hidden_size=64, vocab_size=320, num_target_layers=4, mask_token_id=3, target_layer_ids=(1, 2),
                      **dflash2_sizes(conv_group_size=16, selector_rank=8))
    src = write_checkpoint(tmp_path / "d2", cfg, sizes_at_top_level=True)
    assert "selector_rank" not in json.loads((src / "config.json").read_text())["dflash_config"]
    result = export_drafter(src, "vllm", tiny_model_dir, tmp_path / "x")
    assert '"num_speculative_tokens": 7' in result.command  # the convolution spans 1 + that many slots
    raw = json.loads((result.path / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert {k: raw["dflash_config"][k] for k in DFLASH2_DFLASH_CONFIG} == {
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}
    assert not any(k in raw for k in DFLASH2_DFLASH_CONFIG)
    original, exported = load_file(str(src / "model.safetensors")), load_file(str(result.path / "model.safetensors"))
    assert original.keys() == exported.keys()
    assert all(torch.equal(original[k], exported[k]) for k in original)
    assert exported["layers.1.attention_conv.kernel_projection.weight"].shape == (2 * 2 * (64 // 16), 64)
    assert exported["candidate_selector.successor_codebook"].shape == (320, 8)
    back = read_checkpoint(result.path).cfg  # the export reads back as the same drafter
    assert back.dflash2 and all(getattr(back, k) == getattr(cfg, k) for k in DFLASH2_DEFAULTS)


def test_dflash2_export_runs_in_the_reference_package(tiny_model_dir, tmp_path) -> None:
    """The reference package's DFlash2DraftModel reads the exported directory with no missing or
    unexpected weight, with our tensors, and decodes with it (its greedy output is the target's
    own, as a lossless decoder's must be)."""
    from dflash.model import DFlash2DraftModel, dflash_generate
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(hidden_size=64, vocab_size=320, num_target_layers=4, mask_token_id=3, target_layer_ids=(1, 2),
                      layer_types=("sliding_attention",) * 2, sliding_window=32,
                      **dflash2_sizes(conv_group_size=16, selector_rank=8))
    result = export_drafter(write_checkpoint(tmp_path / "d2", cfg), "hf", tiny_model_dir, tmp_path / "x")
    from transformers import AutoConfig

    parsed = AutoConfig.from_pretrained(str(result.path))  # what vLLM and SGLang parse config.json into
    assert parsed.sliding_window == 32 and parsed.layer_types == ["sliding_attention"] * 2
    assert parsed.is_causal is False and parsed.dflash_config["selector_top_k"] == 4
    ref, info = DFlash2DraftModel.from_pretrained(str(result.path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert ref.candidate_selector.top_k == 4 and ref.layers[1].mlp_conv.group_size == 16
    state = load_file(str(result.path / "model.safetensors"))
    torch.testing.assert_close(ref.candidate_selector.predecessor_codebook.weight.float(),
                               state["candidate_selector.predecessor_codebook"], rtol=0, atol=0)
    torch.testing.assert_close(ref.layers[0].attention_conv.base_kernel.float(),
                               state["layers.0.attention_conv.base_kernel"], rtol=0, atol=0)
    target = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    plain = SpecDecoder(HFTarget(target), None, SpecConfig(block_size=1))
    ref = ref.float().eval()
    for prompt in ([5, 6, 7, 8, 9], list(range(20, 40))):
        truth = plain.generate([prompt], SamplingParams(max_new_tokens=24))[0].token_ids
        out = dflash_generate(ref, target, torch.tensor([prompt]), 24, None, block_size=8)
        assert out[0, len(prompt):].tolist() == truth


def test_logit_transforms_go_where_the_engines_read_them() -> None:
    cfg = tiny_config(output_multiplier=0.5, final_logit_softcapping=30.0, input_embedding_scale=2.0)
    raw = engine_config(DrafterCheckpoint(Path("d"), cfg, {}), None)
    assert raw["dflash_config"]["output_multiplier"] == 0.5 == raw["output_multiplier"]
    assert raw["dflash_config"]["final_logit_softcapping"] == 30.0
    assert raw["dflash_config"]["input_embedding_scale"] == 2.0
    assert DrafterConfig.from_dict(raw).output_multiplier == 0.5  # and blockspec reads them back


@pytest.mark.parametrize("over", [
    dict(layer_types=("sliding_attention",) * 2, sliding_window=16),
    dict(layer_types=("sliding_attention", "full_attention"), sliding_window=16),
    dict(),
    dict(is_causal=True),
    dict(layer_types=("sliding_attention", "full_attention"), sliding_window=16, is_causal=False),
])
def test_exports_state_the_drafters_causality(tmp_path, over) -> None:
    """Every export writes whether the block attention is causal, as our drafter runs it (causal
    only with is_causal true, sliding layers included: issue 42), so no engine falls back to its
    own default; the same holds for the GGUF, whose one flag covers mixed layer types too."""
    from blockspec.dflash.drafter import DFlashDrafter

    cfg = tiny_config(**over)
    runs = {layer.self_attn.causal for layer in DFlashDrafter(cfg).layers}
    assert runs == {bool(over.get("is_causal"))}
    raw = engine_config(DrafterCheckpoint(Path("d"), cfg, {}), None)
    assert "is_causal" in raw and {raw["is_causal"]} == runs
    target = write_target_gguf(tmp_path / "t.gguf", hidden=32, layers=4, tokens=TOKENS)
    result = export_drafter(write_checkpoint(tmp_path / "d", cfg), "llama.cpp", target, tmp_path / "out")
    fields, _ = read_gguf(result.path)
    assert {fields["dflash.attention.causal"]} == runs


# ---- llama.cpp ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_export_layout_metadata_and_values(tmp_path, dtype) -> None:
    cfg = tiny_config(layer_types=("sliding_attention",) * 2, sliding_window=16)  # non-causal: no is_causal key
    src = write_checkpoint(tmp_path / "d", cfg)
    target = write_target_gguf(tmp_path / "t.gguf", hidden=32, layers=4, tokens=TOKENS)
    result = export_drafter(src, "llama.cpp", target, tmp_path / "out", dtype=dtype)
    assert result.path.name == "drafter.gguf" and "--spec-type draft-dflash --spec-draft-n-max 7" in result.command
    fields, tensors = read_gguf(result.path)
    assert all(k in fields for k in LLAMA_CPP_REQUIRED_KEYS), [k for k in LLAMA_CPP_REQUIRED_KEYS if k not in fields]
    assert fields["general.architecture"] == "dflash"
    assert fields["dflash.target_layers"] == [2, 3]  # inputs of the layers after those DFlash reads
    assert fields["dflash.block_size"] == 8 and fields["dflash.attention.causal"] is False
    assert fields["dflash.attention.sliding_window"] == 16
    assert fields["dflash.attention.sliding_window_pattern"] == [True, True]
    target_fields, _ = read_gguf(target)
    for key, value in target_fields.items():  # llama.cpp compares the vocabularies token by token
        if key.startswith("tokenizer."):
            assert fields[key] == value, key
    assert fields["tokenizer.ggml.mask_token_id"] == 47
    want = set(LLAMA_CPP_GLOBAL) | {f"blk.{i}.{n}" for i in range(2) for n in LLAMA_CPP_LAYER}
    assert set(tensors) == want
    state = load_file(str(src / "model.safetensors"))
    for name, value in state.items():
        t = tensors[gguf_name(name)]
        got = gguf_as_torch(t)
        assert got.shape == value.shape, name
        expect = value if value.dim() < 2 or dtype == "float32" else value.to(torch.bfloat16).float()
        assert torch.equal(got, expect), name
        assert t.tensor_type == (gguf.GGMLQuantizationType.F32 if value.dim() < 2 or dtype == "float32"
                                 else gguf.GGMLQuantizationType.BF16), name


def test_dflash2_gguf_export(tmp_path) -> None:
    src = write_checkpoint(tmp_path / "d2", tiny_config(**dflash2_sizes()))
    target = write_target_gguf(tmp_path / "t.gguf", hidden=32, layers=4, tokens=TOKENS)
    result = export_drafter(src, "llama.cpp", target, tmp_path / "d2.gguf", dtype="bfloat16")
    assert result.path == tmp_path / "d2.gguf"
    fields, tensors = read_gguf(result.path)
    assert {k: fields[f"dflash.{k}"] for k in DFLASH2_DFLASH_CONFIG} == {
        "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 4}
    want = (set(LLAMA_CPP_GLOBAL) | set(LLAMA_CPP_DFLASH2_GLOBAL)
            | {f"blk.{i}.{n}" for i in range(2) for n in LLAMA_CPP_LAYER + LLAMA_CPP_DFLASH2_LAYER})
    assert set(tensors) == want
    # ne order, as src/models/dflash.cpp creates them: base {n_embd, kernel, 2}, proj {n_embd, 2*kernel*groups},
    # codebooks {rank, n_vocab}, hidden projection {n_embd, rank}
    assert [int(d) for d in tensors["blk.1.attn_conv_base"].shape] == [32, 2, 2]
    assert [int(d) for d in tensors["blk.1.ffn_conv_proj.weight"].shape] == [32, 2 * 2 * 4]
    assert [int(d) for d in tensors["selector_predecessor.weight"].shape] == [6, 48]
    assert [int(d) for d in tensors["selector_hidden.weight"].shape] == [32, 6]
    state = load_file(str(src / "model.safetensors"))
    base, codebook = tensors["blk.0.attn_conv_base"], tensors["selector_successor.weight"]
    assert base.tensor_type == gguf.GGMLQuantizationType.F32  # added to float32 activations as is
    assert torch.equal(gguf_as_torch(base), state["layers.0.attention_conv.base_kernel"])
    assert codebook.tensor_type == gguf.GGMLQuantizationType.BF16
    assert torch.equal(gguf_as_torch(codebook), state["candidate_selector.successor_codebook"].bfloat16().float())


# ---- errors: one line, naming the problem ------------------------------------------------------


def test_checkpoint_errors_name_the_tensor(tmp_path) -> None:
    """Export reads a checkpoint as loading a drafter does: the same checks, the same messages."""
    cfg = tiny_config(**dflash2_sizes())
    with pytest.raises(CheckpointError, match="DFlash 2 weight layers.1.mlp_conv.base_kernel is missing"):
        read_checkpoint(write_checkpoint(tmp_path / "a", cfg, drop="layers.1.mlp_conv.base_kernel"))
    with pytest.raises(CheckpointError, match="weight layers.0.mlp.up_proj.weight is missing"):
        read_checkpoint(write_checkpoint(tmp_path / "a2", cfg, drop="layers.0.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"candidate_selector.hidden_projection.weight in .* has shape \(6, 31\)"):
        read_checkpoint(write_checkpoint(tmp_path / "b", cfg, reshape="candidate_selector.hidden_projection.weight"))
    d2 = write_checkpoint(tmp_path / "c", cfg)
    raw = json.loads((d2 / "config.json").read_text())
    raw["architectures"] = ["DFlashDraftModel"]
    (d2 / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="belongs to a DFlash 2 drafter, but its config.json declares DFlashDraftModel"):
        read_checkpoint(d2)
    extra = write_checkpoint(tmp_path / "e", tiny_config())
    save_file(load_file(str(extra / "model.safetensors")) | {"lm_head.weight": torch.zeros(48, 32)},
              str(extra / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected weight lm_head.weight in"):
        read_checkpoint(extra)
    # a DFlash 2 key left out takes the published drafters' value (DFLASH2_DEFAULTS), as loading does
    raw["architectures"] = ["DFlash2DraftModel"]
    del raw["dflash_config"]["selector_top_k"]
    (d2 / "config.json").write_text(json.dumps(raw))
    assert read_checkpoint(d2).cfg.selector_top_k == DFLASH2_DEFAULTS["selector_top_k"]
    raw["dflash_config"]["selector_top_k"] = 4
    raw["dflash_config"]["conv_group_size"] = 5
    (d2 / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="conv_group_size 5 must divide hidden_size 32"):
        read_checkpoint(d2)


def test_export_errors(tiny_model_dir, tiny_drafter_dir, tmp_path, capsys) -> None:
    with pytest.raises(ConfigError, match="is the drafter's own directory"):
        export_drafter(tiny_drafter_dir, "hf", tiny_model_dir, tiny_drafter_dir)
    with pytest.raises(ConfigError, match="unknown export format 'onnx'"):
        export_drafter(tiny_drafter_dir, "onnx", tiny_model_dir, tmp_path / "x")
    with pytest.raises(SystemExit):  # argparse names the valid choices
        main(["export", str(tiny_drafter_dir), "--format", "onnx", "--target", "t", "--out", "o"])
    assert "invalid choice: 'onnx'" in capsys.readouterr().err
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (bare / f).unlink(missing_ok=True)
    assert main(["export", str(tiny_drafter_dir), "--format", "hf", "--target", str(bare),
                 "--out", str(tmp_path / "y")]) == 2
    assert capsys.readouterr().err.startswith(f"error: target {bare} has no tokenizer")
    # a drafter made for another target
    src = write_checkpoint(tmp_path / "d", tiny_config())
    with pytest.raises(CompatibilityError, match="hidden_size 32 != target hidden_size 64"):
        export_drafter(src, "hf", tiny_model_dir, tmp_path / "z")
    # llama.cpp: the target GGUF must carry a tokenizer, and the drafter what its loader supports
    no_vocab = tmp_path / "nv.gguf"
    w = gguf.GGUFWriter(str(no_vocab), "llama")
    w.add_block_count(4)
    w.add_embedding_length(32)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="has no tokenizer"):
        export_drafter(src, "llama.cpp", no_vocab, tmp_path / "g")
    target = write_target_gguf(tmp_path / "t.gguf", hidden=32, layers=4, tokens=TOKENS)
    with pytest.raises(CheckpointError, match="neither a GGUF file nor a zoo name"):
        export_drafter(src, "llama.cpp", tmp_path / "missing.gguf", tmp_path / "g")
    scaled = write_checkpoint(tmp_path / "s", tiny_config(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    with pytest.raises(ConfigError, match="plain RoPE only"):
        export_drafter(scaled, "llama.cpp", target, tmp_path / "g")
    big_k = write_checkpoint(tmp_path / "k", tiny_config(**dflash2_sizes(selector_top_k=8)))
    with pytest.raises(ConfigError, match="hidden_size >= selector_top_k"):
        export_drafter(big_k, "llama.cpp", target, tmp_path / "g")


# ---- the shipped drafter against llama.cpp's own converter --------------------------------------


@pytest.mark.slow
def test_shipped_drafter_gguf_matches_llama_cpp_converter(tmp_path) -> None:
    """The shipped SmolLM2 drafter exported for llama.cpp next to the zoo target's GGUF: the
    metadata the converter wrote for it, its tensor layout, and the target's tokenizer."""
    from blockspec.api import default_drafter_for
    from blockspec.export.gguf import resolve_target_gguf

    drafter = default_drafter_for("smollm2-135m-instruct")
    target = resolve_target_gguf("smollm2-135m-instruct")
    result = export_drafter(drafter, "llama.cpp", "smollm2-135m-instruct", tmp_path, dtype="float32")
    fields, tensors = read_gguf(result.path)
    for key, value in CONVERTED_SHIPPED.items():
        assert fields[key] == pytest.approx(value), key
    assert set(tensors) == set(LLAMA_CPP_GLOBAL) | {f"blk.{i}.{n}" for i in range(3) for n in LLAMA_CPP_LAYER}
    assert [int(d) for d in tensors["fc.weight"].shape] == [1728, 576]
    target_fields, _ = read_gguf(target)
    assert fields["tokenizer.ggml.model"] == target_fields["tokenizer.ggml.model"] == "gpt2"
    assert fields["tokenizer.ggml.tokens"] == target_fields["tokenizer.ggml.tokens"]
