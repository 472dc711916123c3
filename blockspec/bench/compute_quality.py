"""The int8 compute mode's quality against the exact mode on one native target: perplexity on
held-out text (GSM8K test questions with their answers), and greedy agreement on bench prompts.

    python -m blockspec.bench.compute_quality --target smollm2-135m-instruct

The criterion for `compute="auto"` to take int8 (targets/native/load.py): int8's perplexity
within 1% of exact's. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from blockspec.datasets import load_dataset


def perplexity(target: object, texts: list[list[int]]) -> float:
    """exp(mean next-token negative log-likelihood) over the token lists."""
    nll, count = 0.0, 0
    for ids in texts:
        t = torch.tensor([ids])
        cache = target.new_cache(1, capacity=len(ids))
        logits, _ = target.forward(t, torch.arange(len(ids))[None], cache)
        logp = torch.log_softmax(logits[0, :-1].double(), dim=-1)
        nll -= float(logp.gather(1, t[0, 1:, None]).sum())
        count += len(ids) - 1
    return math.exp(nll / count)


def greedy(target: object, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from blockspec.config import SamplingParams, SpecConfig
    from blockspec.engine.decoder import SpecDecoder

    decoder = SpecDecoder(target, None, SpecConfig(block_size=1))
    out = decoder.generate(prompts, SamplingParams(max_new_tokens=new_tokens))
    return [r.token_ids for r in out]


def step_costs(targets: dict[str, object], widths: list[int], context: int, reps: int,
               clock: object = time.perf_counter) -> dict[str, float]:
    """Median seconds of a greedy target pass of 1 token (a plain step) and of w tokens (a verify
    pass: "{mode}_{w}" with every position's id, "{mode}_{w}r" as the engine verifies, the head
    stopping at the first rejected proposal, here the first: random proposals), after `context`
    tokens, batch 1; the modes' passes interleaved, so both see the same load. clock:
    time.perf_counter (wall clock), or time.thread_time (this thread's CPU time: one thread only,
    and what other processes take of the core left out)."""
    caches = {m: t.new_cache(1, capacity=context + max(widths) + 1) for m, t in targets.items()}
    vocab = min(1000, *(t.info.vocab_size for t in targets.values()))
    ids = torch.randint(0, vocab, (1, context + max(widths)), generator=torch.Generator().manual_seed(0))
    for m, t in targets.items():
        t.forward(ids[:, :context], torch.arange(context)[None], caches[m])
    kinds = [(1, False), *((w, r) for w in widths for r in (False, True))]
    times: dict[str, list[float]] = {f"{m}_{w}{'r' * r}": [] for m in targets for w, r in kinds}
    for _ in range(reps):
        for w, r in kinds:
            for m, t in targets.items():
                t0 = clock()
                t.forward_greedy(ids[:, context : context + w], torch.arange(context, context + w)[None], caches[m],
                                 until_rejected=r)
                times[f"{m}_{w}{'r' * r}"].append(clock() - t0)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def kernel_times(targets: dict[str, object], rows: list[int], reps: int) -> dict[str, dict[str, float]]:
    """Microseconds of one product of each shape of the first layer and of the LM head, per mode
    and number of rows (the fastest of `reps` timings, each a mean of enough calls to take a
    millisecond or so; the modes interleaved). The exact mode's is its backend's product (the
    packed kernel), int8's the integer kernel."""
    nets = {m: t.net for m, t in targets.items()}
    names = ("qkv", "o", "gate_up", "down")
    out: dict[str, dict[str, float]] = {}
    g = torch.Generator().manual_seed(2)
    for name in (*names, "head"):
        mods = {m: net.lm_head if name == "head" else getattr(net.layers[0], name) for m, net in nets.items()}
        shape = tuple(mods["exact"].weight.shape)
        for n in rows:
            x = torch.randn(n, shape[1], generator=g)
            calls = max(1, int(2e5 / (shape[0] * shape[1] * max(n, 4) / 1e4)))
            best = {m: math.inf for m in nets}
            for _ in range(reps):
                for m, net in nets.items():
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        net.backend.product(mods[m], x)
                    best[m] = min(best[m], (time.perf_counter() - t0) / calls)
            key = f"{name} {shape[0]}x{shape[1]}, {n} rows"
            out[key] = {**{m: round(v * 1e6, 1) for m, v in best.items()},
                        "int8/exact": round(best["int8"] / best["exact"], 2)}
    return out


def _ids(encoded: object) -> list[int]:
    """Token ids from apply_chat_template, whichever form this transformers version returns."""
    if hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def profile_parts(target: object, widths: list[int], context: int, reps: int) -> dict[str, dict[str, float]]:
    """Where a greedy target pass of w tokens (batch 1, after `context` tokens) spends its time,
    by part, in milliseconds per pass (medians would need per-part samples; these are means):
    the Python layer loop with each part of the backend timed (the one-call C loop cannot be
    split), its total, and the one-call loop's total beside it. "python and dispatch": the
    loop's total less its timed parts ("product head", where the head is a product, is inside
    "head")."""
    from blockspec.targets.native import backends

    backend = target.net.backend
    kinds = {m: n for layer in target.net.layers for n, m in
             (("qkv", layer.qkv), ("o", layer.o), ("gate_up", layer.gate_up), ("down", layer.down))}
    parts: dict[str, float] = {}

    def timed(name: str, fn: object) -> object:
        def run(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            key = name if name != "product" else f"product {kinds.get(args[0], 'head')}"
            parts[key] = parts.get(key, 0.0) + time.perf_counter() - t0
            return out
        return run

    ids = torch.randint(0, 1000, (1, context + max(widths)), generator=torch.Generator().manual_seed(1))
    out: dict[str, dict[str, float]] = {}
    for w in (1, *widths):
        step_ids, pos = ids[:, context : context + w], torch.arange(context, context + w)[None]
        cache = target.new_cache(1, capacity=context + w + 1)
        target.forward(ids[:, :context], torch.arange(context)[None], cache)
        t0 = time.perf_counter()
        for _ in range(reps):
            target.forward_greedy(step_ids, pos, cache)
        one_call = (time.perf_counter() - t0) / reps
        saved = {n: getattr(backend, n) for n in ("norm", "queries", "attention", "head", "product", "run_program")}
        saved_silu = backends.silu_mul
        try:
            for n in ("norm", "queries", "attention", "head", "product"):
                setattr(backend, n, timed(n, saved[n]))
            backend.run_program = lambda *args, **kwargs: None
            backends.silu_mul = timed("activation", saved_silu)
            target.forward_greedy(step_ids, pos, cache)  # warm
            parts.clear()
            t0 = time.perf_counter()
            for _ in range(reps):
                target.forward_greedy(step_ids, pos, cache)
            loop = (time.perf_counter() - t0) / reps
        finally:
            for n in saved:
                delattr(backend, n)
            backends.silu_mul = saved_silu
        row = {k: round(v / reps * 1e3, 3) for k, v in sorted(parts.items())}
        inner = row.get("product head", 0.0)  # inside "head" (the int8 head is a product)
        row["python and dispatch"] = round(loop * 1e3 - sum(row.values()) + inner, 3)
        row["total (python loop)"] = round(loop * 1e3, 3)
        row["total (one-call loop)"] = round(one_call * 1e3, 3)
        out[str(w)] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--texts", type=int, default=24,
                    help="held-out texts for perplexity (GSM8K test, from the end); 0 skips it")
    ap.add_argument("--prompts", type=int, default=4,
                    help="bench prompts for greedy agreement (GSM8K test, first); 0 skips it")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--costs", default="", help="also time verify passes of these widths against a plain step, "
                    "e.g. 8,16 (ratios: the modes interleaved)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cpu-time", action="store_true", help="time --costs in CPU time (with --threads 1: a "
                    "shared machine's other processes left out) instead of wall clock")
    ap.add_argument("--kernels", default="", help="also time each product shape (first layer, LM head) at these "
                    "numbers of rows, e.g. 1,8,16 (the modes interleaved)")
    ap.add_argument("--profile", action="store_true", help="also split a plain and the verify passes by part")
    ap.add_argument("--threads", type=int, default=0, help="torch's (and the kernels') threads; 0 keeps the default")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from blockspec.zoo.registry import resolve_target_dir
    from blockspec.targets.native.load import load_target

    path = resolve_target_dir(args.target)
    targets, tokenizer = {}, None
    for mode in ("exact", "int8"):
        targets[mode], tokenizer = load_target(path, backend="native", compute=mode)
    rows = load_dataset("gsm8k", split="test")
    texts = [tokenizer(f"Question: {s.prompt}\nAnswer: {s.reference}").input_ids
             for s in rows[len(rows) - args.texts:]]
    prompts = [_ids(tokenizer.apply_chat_template([{"role": "user", "content": s.prompt}], add_generation_prompt=True))
               for s in rows[: args.prompts]]
    report: dict[str, object] = {"target": args.target, "texts": len(texts),
                                 "tokens": sum(len(t) - 1 for t in texts), "prompts": len(prompts),
                                 "new_tokens": args.new_tokens,
                                 "int8_path": targets["int8"].compute_detail}
    outs = {}
    for mode, target in targets.items():
        t0 = time.perf_counter()
        if texts:
            report[f"ppl_{mode}"] = round(perplexity(target, texts), 4)
        if prompts:
            outs[mode] = greedy(target, prompts, args.new_tokens)
        report[f"seconds_{mode}"] = round(time.perf_counter() - t0, 1)
    if texts:
        report["ppl_ratio"] = round(report["ppl_int8"] / report["ppl_exact"], 4)
    if prompts:
        pairs = list(zip(outs["exact"], outs["int8"]))
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))) for a, b in pairs]
        report["greedy_identical"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
        report["greedy_mean_common_prefix"] = round(sum(prefix) / len(prefix), 1)
        report["greedy_token_agreement"] = round(sum(x == y for a, b in pairs for x, y in zip(a, b))
                                                 / max(1, sum(min(len(a), len(b)) for a, b in pairs)), 3)
    if args.costs:
        widths = [int(w) for w in args.costs.split(",")]
        if args.cpu_time and torch.get_num_threads() != 1:
            ap.error("--cpu-time measures one thread: add --threads 1")
        med = step_costs(targets, widths, context=300, reps=args.reps,
                         clock=time.thread_time if args.cpu_time else time.perf_counter)
        report["plain_ms"] = {m: round(med[f"{m}_1"] * 1e3, 2) for m in targets}
        report["verify_ms"] = {m: {k.split("_", 1)[1]: round(v * 1e3, 2) for k, v in med.items()
                                   if k.startswith(f"{m}_") and k != f"{m}_1"} for m in targets}
        report["verify_in_plain_steps"] = {m: {w: round(med[f"{m}_{w}"] / med[f"{m}_1"], 2) for w in widths}
                                           for m in targets}
        report["verify_until_rejected_in_plain_steps"] = {
            m: {w: round(med[f"{m}_{w}r"] / med[f"{m}_1"], 2) for w in widths} for m in targets}
        report["int8_over_exact"] = {w: round(med[f"int8_{w}"] / med[f"exact_{w}"], 2) for w in (1, *widths)}
    if args.kernels:
        report["kernel_us"] = kernel_times(targets, [int(n) for n in args.kernels.split(",")], args.reps)
    if args.profile:
        widths = [int(w) for w in args.costs.split(",")] if args.costs else [8]
        report["profile_ms"] = {m: profile_parts(t, widths, context=300, reps=args.reps) for m, t in targets.items()}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
