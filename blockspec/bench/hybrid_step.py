"""The verify step of a hybrid target against its plain step, through the Hugging Face adapter.

    python -m blockspec.bench.hybrid_step --hidden 1024 --batch 1,4 --repeats 15
    python -m blockspec.bench.hybrid_step --shape qwen3.5 --layers 8 --dtype bfloat16 --device cuda

A random Qwen3.5-shaped model (three Gated DeltaNet layers to one attention layer; head sizes
as published, other sizes from the flags) and the same model with attention in every layer, each
after a prefill: a plain step (one token) and a verify step (a block, then each row's rollback to
a random number of kept tokens), interleaved, medians. On a CPU the clock is the process's CPU
time with one thread (robust to other processes on a shared machine); on CUDA, wall time between
synchronisations. Random weights: this times the rollback, not acceptance. Prints a Markdown
table (for BENCHMARKS.md, "Hybrid targets") and a JSON line. `python -m blockspec.bench.cudacheck`
runs it on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from blockspec.errors import ConfigError
from blockspec.targets.base import DTYPES
from blockspec.targets.hf import HFTarget


SHAPES = ("scaled", "qwen3.5")


def qwen35_like(hidden: int, layers: int, vocab: int, hybrid: bool, dtype: torch.dtype,
                device: str = "cpu", shape: str = "scaled") -> HFTarget:
    """A random Qwen3.5 text model (`qwen3_5_text`) of `layers` layers. shape "scaled": 128-wide
    linear-attention heads (hidden/160 key heads, twice as many value heads), 256-wide attention
    heads, MLP 3.6 x hidden, `vocab` tokens; "qwen3.5": transformers' Qwen3_5TextConfig sizes
    (the published model's: hidden 4096, MLP 12288, 16 + 4 attention heads, 16 + 32 linear-attention
    heads, 248320 tokens), whatever `hidden` and `vocab` say."""
    import transformers as tf

    if shape not in SHAPES:
        raise ConfigError(f"shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    kinds = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4) if hybrid else ["full_attention"] * layers
    if shape == "qwen3.5":
        cfg = tf.Qwen3_5TextConfig(num_hidden_layers=len(kinds), layer_types=kinds, max_position_embeddings=4096)
    else:
        heads = max(1, hidden // 160)
        cfg = tf.Qwen3_5TextConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=int(3.6 * hidden) // 64 * 64,
            num_hidden_layers=len(kinds), num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
            head_dim=256, layer_types=kinds, linear_num_key_heads=heads, linear_num_value_heads=2 * heads,
            linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=4096,
        )
    torch.manual_seed(0)
    with torch.device(device):  # built where it runs: no CPU copy of a large model first
        model = tf.Qwen3_5ForCausalLM(cfg).to(dtype).eval()
    model.config._attn_implementation = "sdpa"
    return HFTarget(model)


def _clock(device: torch.device):
    """CPU time on a CPU; wall time after the queued kernels finish on CUDA."""
    if device.type != "cuda":
        return time.process_time

    def wall() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return wall


def measure(target: HFTarget, batch: int, block: int, context: int, repeats: int) -> dict:
    """Median milliseconds of a plain step and of a verify step (with rollback), same cache."""
    d = target.device
    clock = _clock(d)
    g = torch.Generator().manual_seed(batch)
    vocab = target.info.vocab_size
    cache = target.new_cache(batch)
    target.forward(torch.randint(0, vocab, (batch, context), generator=g).to(d),
                   torch.arange(context, device=d).expand(batch, context).contiguous(), cache)
    cache.reject(torch.ones(batch, context, dtype=torch.bool, device=d))

    saved = {i: (state.conv.clone(), state.rec.clone()) for i, state in cache.linear.items()}

    def step(q: int) -> float:
        ids = torch.randint(0, vocab, (batch, q), generator=g).to(d)
        positions = (context + torch.arange(q, device=d)).expand(batch, q).contiguous()
        kept = torch.randint(1, q + 1, (batch, 1), generator=g).to(d)
        t0 = clock()
        target.forward(ids, positions, cache)
        cache.reject(torch.arange(q, device=d)[None] < kept)
        spent = clock() - t0
        # back to the context alone, so that every call starts alike
        cache.slots.reject(torch.zeros(batch, q, dtype=torch.bool, device=d))
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
    return {"batch": batch, "plain_ms": round(p * 1e3, 3), "verify_ms": round(v * 1e3, 3), "ratio": round(v / p, 2)}


def run(hidden: int, layers: int, vocab: int, block: int, context: int, batches: list[int], repeats: int,
        dtype: torch.dtype, device: str = "cpu", shape: str = "scaled") -> list[dict]:
    """One row per (layer kinds, batch): the hybrid model first, then the attention-only one."""
    if layers < 4 or layers % 4:
        raise ConfigError(f"--layers must be a multiple of 4 (3 linear-attention + 1 attention), got {layers}")
    rows = []
    for hybrid in (True, False):
        target = qwen35_like(hidden, layers, vocab, hybrid, dtype, device, shape)
        for b in batches:
            with torch.inference_mode():
                rows.append({"layers": "3 Gated DeltaNet : 1 attention" if hybrid else "attention only",
                             **measure(target, b, block, context, repeats)})
        del target
    return rows


def table(rows: list[dict], block: int) -> str:
    """The rows as the Markdown table of BENCHMARKS.md."""
    lines = [f"| layers | batch | plain step (ms) | verify {block} + rollback (ms) | verify / plain |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['layers']} | {r['batch']} | {r['plain_ms']} | {r['verify_ms']} | {r['ratio']} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="scaled", choices=SHAPES,
                    help="scaled: sizes from --hidden and --vocab; qwen3.5: the published Qwen3.5 text sizes")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4, help="a multiple of 4 (3 linear-attention + 1 attention)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: CPU time is then robust)")
    args = ap.parse_args(argv)
    try:
        batches = [int(x) for x in args.batch.split(",")]
    except ValueError:
        raise ConfigError(f"--batch takes comma-separated integers, got {args.batch!r}") from None
    torch.set_num_threads(args.threads)
    rows = run(args.hidden, args.layers, args.vocab, args.block, args.context, batches, args.repeats,
               DTYPES[args.dtype], args.device, args.shape)
    print(table(rows, args.block))
    print(json.dumps({"args": vars(args), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
