"""A hybrid MoE target (Qwen3.6-shaped: Gated DeltaNet layers, MoE MLPs, no dense MLP size) and
gpt-oss, loaded from directories the way users load them: the adapter picks the attention each
model takes, the load-time exactness check passes, a fresh drafter is sized from the config, and
concurrent requests through the server get the target's own greedy text."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from conftest import build_tiny_tokenizer, make_tiny_target

import blockspec.api
from blockspec.engine import Engine, EngineConfig
from blockspec.server.app import create_app
from blockspec.server.launch import BackgroundServer


def save_tiny(family: str, path, *, seed: int = 3):
    """A tiny random model of `family` with the test tokenizer (eos <|im_end|>), float32 on disk."""
    import transformers as tf

    tokenizer = build_tiny_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = make_tiny_target(family, seed=seed, dtype=torch.float32, vocab_size=len(tokenizer), hidden_size=64,
                             intermediate_size=128, eos_token_id=eos, pad_token_id=0, max_position_embeddings=1024)
    model.generation_config = tf.GenerationConfig(eos_token_id=eos, pad_token_id=0)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_gpt_oss_loads_with_eager_attention(tmp_path, one_thread) -> None:
    save_tiny("gpt_oss", tmp_path)
    pipe = blockspec.api.load(str(tmp_path), "none", dtype="float64", backend="auto")
    assert pipe.target.model.config._attn_implementation == "eager"  # it refuses SDPA (attention sinks)
    assert pipe.target.info.model_type == "gpt_oss"


def test_hybrid_moe_target_through_the_server(tmp_path, one_thread) -> None:
    save_tiny("qwen3_5_moe_text", tmp_path)
    pipe = blockspec.api.load(str(tmp_path), "fresh", dtype="float64", block_size=4, adaptive_block=False)
    assert pipe.drafter.cfg.intermediate_size == 3 * 64  # no dense MLP in the config: 3 x hidden
    model = pipe.target.model
    questions = [[{"role": "user", "content": f"Question {i}: what is {i} + {3 * i}?"}] for i in range(4)]
    expected = []
    for q in questions:
        ids = pipe.encode(q)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=12, do_sample=False)
        theirs = out[0, len(ids):].tolist()
        mine = pipe.generate(q, max_new_tokens=12, temperature=0.0)
        assert mine.token_ids == theirs
        expected.append(mine.text)
    engine = Engine(pipe.target, pipe.drafter, EngineConfig(max_batch=4, block_size=4), tokenizer=pipe.tokenizer)
    try:
        with BackgroundServer(create_app(pipe, engine=engine, served_model_name="tiny-hybrid")) as srv:
            def ask(i: int) -> str:
                body = {"model": "tiny-hybrid", "messages": questions[i % 4], "max_tokens": 12, "temperature": 0}
                r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=120)
                return r.json()["choices"][0]["message"]["content"]

            with ThreadPoolExecutor(max_workers=8) as pool:
                texts = list(pool.map(ask, range(8)))
        assert texts == [expected[i % 4] for i in range(8)]
        assert engine.recorder.row_steps > engine.metrics.steps_total  # requests shared steps
    finally:
        engine.stop()


def test_a_qwen3_5_multimodal_checkpoint_decodes_through_its_text_model(tmp_path, one_thread) -> None:
    """Published Qwen3.5/3.6 checkpoints are image-text models (model_type qwen3_5): the target is
    their language model, which decodes as `generate` does."""
    import transformers as tf

    from blockspec.config import SamplingParams, SpecConfig
    from blockspec.dflash.batch import SpecDecoder
    from blockspec.targets.hf import load_hf_target

    tokenizer = build_tiny_tokenizer()
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=512)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(0)
    tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text, vision_config=vision)).save_pretrained(
        str(tmp_path))
    tokenizer.save_pretrained(str(tmp_path))
    target, _ = load_hf_target(tmp_path, dtype="float64")
    ids = [5, 6, 7, 8, 9]
    got = SpecDecoder(target, None, SpecConfig(block_size=1)).generate(
        [ids], SamplingParams(max_new_tokens=10, ignore_eos=True))[0].token_ids
    target.model.generation_config.eos_token_id = None  # like ignore_eos
    with torch.no_grad():
        want = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, 5, dtype=torch.long),
                                     max_new_tokens=10, do_sample=False)[0, 5:].tolist()
    assert got == want
