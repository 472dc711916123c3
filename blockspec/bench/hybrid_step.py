"""The verify step of a hybrid target against its plain step, through the Hugging Face adapter.

    python -m blockspec.bench.hybrid_step --hidden 1024 --batch 1,4 --repeats 15

A random Qwen3.5-shaped model (three Gated DeltaNet layers to one attention layer; head sizes
as published, other sizes from the flags) and the same model with attention in every layer, each
after a prefill: a plain step (one token) and a verify step (a block, then each row's rollback to
a random number of kept tokens), interleaved, medians of CPU time with one thread (robust to other
processes on a shared machine). Random weights: this times the rollback, not acceptance. Prints a
Markdown table (for BENCHMARKS.md) and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from blockspec.targets.base import DTYPES
from blockspec.targets.hf import HFTarget


def qwen35_like(hidden: int, layers: int, vocab: int, hybrid: bool, dtype: torch.dtype) -> HFTarget:
    """A random Qwen3.5 text model: 128-wide linear-attention heads (hidden/160 key heads, twice
    as many value heads), 256-wide attention heads, MLP 3.6 x hidden."""
    import transformers as tf

    heads = max(1, hidden // 160)
    kinds = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4) if hybrid else ["full_attention"] * layers
    cfg = tf.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=int(3.6 * hidden) // 64 * 64, num_hidden_layers=len(kinds),
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=256, layer_types=kinds,
        linear_num_key_heads=heads, linear_num_value_heads=2 * heads, linear_key_head_dim=128,
        linear_value_head_dim=128, max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = tf.Qwen3_5ForCausalLM(cfg).to(dtype).eval()
    model.config._attn_implementation = "sdpa"
    return HFTarget(model)


def measure(target: HFTarget, batch: int, block: int, context: int, repeats: int) -> dict:
    """Median CPU seconds of a plain step and of a verify step (with rollback), same cache."""
    g = torch.Generator().manual_seed(batch)
    vocab = target.info.vocab_size
    cache = target.new_cache(batch)
    target.forward(torch.randint(0, vocab, (batch, context), generator=g),
                   torch.arange(context).expand(batch, context).contiguous(), cache)
    cache.reject(torch.ones(batch, context, dtype=torch.bool))

    saved = {i: (state.conv.clone(), state.rec.clone()) for i, state in cache.linear.items()}

    def step(q: int) -> float:
        ids = torch.randint(0, vocab, (batch, q), generator=g)
        positions = (context + torch.arange(q)).expand(batch, q).contiguous()
        kept = torch.randint(1, q + 1, (batch, 1), generator=g)
        t0 = time.process_time()
        target.forward(ids, positions, cache)
        cache.reject(torch.arange(q)[None] < kept)
        spent = time.process_time() - t0
        # back to the context alone, so that every call starts alike
        cache.slots.reject(torch.zeros(batch, q, dtype=torch.bool))
        cache.compact(0.0)
        for i, state in cache.linear.items():
            state.conv, state.rec = saved[i][0].clone(), saved[i][1].clone()
        return spent

    step(1), step(block)  # warm-up
    plain, verify = [], []
    for _ in range(repeats):
        plain.append(step(1))
        verify.append(step(block))
    p, v = statistics.median(plain), statistics.median(verify)
    return {"batch": batch, "plain_ms": round(p * 1e3, 2), "verify_ms": round(v * 1e3, 2), "ratio": round(v / p, 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4, help="a multiple of 4 (3 linear-attention + 1 attention)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for hybrid in (True, False):
        target = qwen35_like(args.hidden, args.layers, args.vocab, hybrid, DTYPES[args.dtype])
        for b in (int(x) for x in args.batch.split(",")):
            with torch.inference_mode():
                rows.append({"layers": "3 Gated DeltaNet : 1 attention" if hybrid else "attention only",
                             **measure(target, b, args.block, args.context, args.repeats)})
    print(f"| layers | batch | plain step (ms) | verify {args.block} + rollback (ms) | verify / plain |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['layers']} | {r['batch']} | {r['plain_ms']} | {r['verify_ms']} | {r['ratio']} |")
    print(json.dumps({"args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
