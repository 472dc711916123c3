"""Per-step costs and tokens/s of the native path vs the Hugging Face adapter vs `generate`.

    python -m blockspec.bench.microbench --target smollm2-135m-instruct --threads 1 --clock cpu --adaptive

Prints a Markdown table (for BENCHMARKS.md) and a JSON line. Kept short on purpose: a few
repetitions per measurement, medians reported, one prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from blockspec.config import SamplingParams, SpecConfig
from blockspec.targets.base import greedy_forward

PROMPT = "Explain in a few sentences why the sky is blue, then give one example of Rayleigh scattering."


# With one thread, CPU time of the calling thread is robust to other processes on a shared
# machine (wall time is not); `--clock wall` measures wall time instead.
CLOCK = {"fn": time.perf_counter}


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    clock = CLOCK["fn"]
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


@torch.inference_mode()
def forward_cost(target, n: int, context: int, repeats: int, layer_ids=()) -> float:
    """Seconds for a target forward of n new tokens after `context` cached tokens (batch 1)."""
    cache = target.new_cache(1)
    ids = torch.randint(100, 1000, (1, context), generator=torch.Generator().manual_seed(0))
    target.forward(ids, torch.arange(context)[None], cache, layer_ids, last_logits_only=True)
    block = torch.randint(100, 1000, (1, n), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(context, context + n)[None]

    def run() -> None:
        if hasattr(cache, "reserve"):
            cache.reserve(context + n)
        greedy_forward(target, block, pos, cache, layer_ids)[0].tolist()  # what a greedy step computes
        cache.reject(torch.zeros(1, n, dtype=torch.bool))
        cache.compact(1.0)

    return _median_time(run, repeats)


@torch.inference_mode()
def draft_cost(target, drafter, block: int, context: int, repeats: int, static: bool) -> float:
    """Seconds for one draft pass of `block` positions + the LM head on block-1 positions."""
    from blockspec.dflash.static_drafter import StaticDrafter

    runner = StaticDrafter(drafter) if static else drafter
    width = len(drafter.target_layer_ids) * target.info.hidden_size
    feats = torch.randn(1, context, width, dtype=target.dtype)
    ids = torch.full((1, block), drafter.mask_token_id)
    pos = torch.arange(context, context + block)[None]
    ctx_pos = torch.arange(context)[None]

    def run() -> None:
        cache = runner.new_cache(1)
        hidden = runner(feats, ctx_pos, target.embed(ids), pos, cache)
        drafter.greedy_tokens(hidden[:, 1:], target.head(), ids[:, 0]).tolist()  # anchor: DFlash 2's walk

    # The context is re-encoded on every call here; subtract a 1-position pass to isolate it.
    return _median_time(run, repeats)


def generate_tps(decoder, prompt_ids, max_new: int, block: int) -> tuple[float, float]:
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    decoder.generate([prompt_ids], params, block_size=block)  # warm-up (allocations, lazy init)
    t0 = CLOCK["fn"]()
    r = decoder.generate([prompt_ids], params, block_size=block)[0]
    return len(r.token_ids) / (CLOCK["fn"]() - t0), r.stats.mean_tau


@torch.inference_mode()
def hf_generate_tps(model, prompt_ids, max_new: int) -> float:
    ids = torch.tensor([prompt_ids])
    kwargs = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0)
    model.generate(ids, **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
    t0 = CLOCK["fn"]()
    out = model.generate(ids, **kwargs)
    return (out.shape[1] - ids.shape[1]) / (CLOCK["fn"]() - t0)


def engine_tps(target, drafter, prompt_ids, max_new: int) -> tuple[float, float, dict]:
    """Tokens/s of one request through the engine with adaptive block size (calibrated first)."""
    from blockspec.engine import Engine, EngineConfig

    engine = Engine(target, drafter, EngineConfig(max_batch=1, block_size=16, adaptive_block=True))
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    try:
        engine.generate(prompt_ids, params.with_(max_new_tokens=4))  # calibration happens here
        t0 = time.perf_counter()  # the engine runs in its own thread: wall time only
        r = engine.generate(prompt_ids, params)
        tps = len(r.token_ids) / (time.perf_counter() - t0)
        return tps, r.stats.mean_tau, dict(engine.metrics.block_sizes)
    finally:
        engine.stop()


TOPICS = ("the moon", "bread", "rivers", "prime numbers", "chess", "volcanoes", "bees", "glass")


def batch_tps(target, tokenizer, n: int, max_new: int) -> dict[str, float]:
    """Plain decoding of n chat requests through the engine, max_batch 1 vs n: tokens per
    second of process CPU time; also checks batched greedy output == one at a time."""
    from blockspec.engine import Engine, EngineConfig
    from blockspec.text import encode_prompt

    prompts = [encode_prompt(tokenizer, f"Write two sentences about {TOPICS[i % len(TOPICS)]}.", chat=True)
               for i in range(n)]
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    out: dict[str, float] = {}
    outputs = {}
    for size in (1, n):
        engine = Engine(target, None, EngineConfig(max_batch=size, block_size=1))
        try:
            engine.generate(prompts[0], params.with_(max_new_tokens=2))
            cpu0 = time.process_time()
            handles = [engine.submit(p, params) for p in prompts]
            outputs[size] = [h.result().token_ids for h in handles]
            out[f"cpu_tps_batch{size}"] = n * max_new / (time.process_time() - cpu0)
        finally:
            engine.stop()
    out["batched_equals_single"] = float(outputs[1] == outputs[n])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--drafter", default=None, help="a DFlash drafter directory (default: a fresh one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--adaptive", action="store_true", help="also time the engine with adaptive block size")
    ap.add_argument("--batch", type=int, default=0, help="only: plain-decoding engine throughput, N requests")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: thread CPU time (needs --threads 1); robust on a loaded machine")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if torch.get_num_threads() != 1:
            raise SystemExit("--clock cpu needs --threads 1")
        CLOCK["fn"] = time.thread_time
    from blockspec.api import pick_mask_token, resolve_target_dir
    from blockspec.dflash.drafter import new_drafter_for_target
    from blockspec.targets.native.load import load_target
    from blockspec.dflash.batch import SpecDecoder
    from blockspec.text import encode_prompt

    path = resolve_target_dir(args.target)
    native, tok = load_target(path, backend="native", dtype=args.dtype)
    hf, _ = load_target(path, backend="hf", dtype=args.dtype)
    if args.drafter:
        from blockspec.dflash.drafter import load_drafter

        drafter = load_drafter(args.drafter, dtype=hf.dtype)
    else:  # fresh: tau ~ 1, measures costs only
        drafter = new_drafter_for_target(hf.config, mask_token_id=pick_mask_token(tok, hf.info.vocab_size),
                                         num_layers=1, dtype=hf.dtype)
    layer_ids = drafter.target_layer_ids
    prompt_ids = encode_prompt(tok, PROMPT, chat=True)
    if args.batch:
        for name, target in (("native", native), ("hf adapter", hf)):
            print(name, json.dumps(batch_tps(target, tok, args.batch, args.max_new)), flush=True)
        return
    paths = (("native", native), ("hf adapter", hf))
    decoders = {name: SpecDecoder(t, drafter, SpecConfig(block_size=16)) for name, t in paths}
    rows: dict[str, dict[str, float]] = {name: {} for name, _ in paths}
    rows["transformers.generate"] = {}

    def keep_min(row: dict, key: str, value: float, better=min) -> None:
        row[key] = better(row[key], value) if key in row else value

    # Rounds interleave the paths so that load changes on a shared machine hit them alike;
    # each number is the best round (the least disturbed one).
    for _ in range(args.rounds):
        for name, target in paths:
            r = rows[name]
            keep_min(r, "fwd1_ms", 1e3 * forward_cost(target, 1, args.context, args.repeats, layer_ids))
            keep_min(r, "fwd16_ms", 1e3 * forward_cost(target, 16, args.context, args.repeats, layer_ids))
            keep_min(r, "draft16_ms",
                     1e3 * draft_cost(target, drafter, 16, args.context, args.repeats, static=name == "native"))
            for block in (1, 16):
                tps, tau = generate_tps(decoders[name], prompt_ids, args.max_new, block)
                keep_min(r, f"tps_b{block}", tps, max)
                r[f"tau_b{block}"] = tau
        keep_min(rows["transformers.generate"], "tps_b1", hf_generate_tps(hf.model, prompt_ids, args.max_new), max)
        if args.adaptive:
            r = rows.setdefault("native engine, adaptive B<=16 (wall clock)", {})
            tps, tau, used = engine_tps(native, drafter, prompt_ids, args.max_new)
            keep_min(r, "tps_b16", tps, max)
            r["tau_b16"] = tau
            r["blocks"] = used
    meta = {"threads": torch.get_num_threads(), "clock": args.clock, "rounds": args.rounds, "load_avg": os.getloadavg()[0], "prompt_tokens": len(prompt_ids),
            "max_new": args.max_new, "context": args.context, "dtype": args.dtype}
    print(json.dumps({"meta": meta, "rows": rows}))
    print("| path | fwd 1 tok (ms) | fwd 16 tok (ms) | draft pass B=16 (ms) | tok/s B=1 | tok/s B=16 (tau) |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        def f(key: str, fmt: str = "{:.1f}") -> str:
            return fmt.format(r[key]) if key in r else "-"
        b16 = f"{r['tps_b16']:.1f} ({r['tau_b16']:.2f})" if "tps_b16" in r else "-"
        print(f"| {name} | {f('fwd1_ms')} | {f('fwd16_ms')} | {f('draft16_ms')} | {f('tps_b1')} | {b16} |")
    print(f"\n{meta}")


if __name__ == "__main__":
    main()
