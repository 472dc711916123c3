"""What DFlash 2 adds to a decoding step: its block convolutions and its candidate selector, beside
the DFlash drafter they extend (batch 1, greedy; interleaved repetitions, medians).

    python -m blockspec.bench.dflash2_cost --target smollm2-135m-instruct --blocks 8 16

Without --dflash2 the DFlash 2 drafter is the target's DFlash drafter with random DFlash 2 modules
added (the published sizes: kernel 2, group 16, rank 256, top 16): its costs are a trained one's,
its proposals are not. Times are the CPU time of the calling thread with --threads 1 (robust on a
shared machine) and wall time otherwise; the shares printed are of the DFlash 2 step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from blockspec.dflash.drafter import DFLASH2, DFLASH2_DEFAULTS, DFlashDrafter, DrafterConfig, init_drafter_weights
from blockspec.dflash.static_drafter import StaticDrafter
from blockspec.targets.base import greedy_forward


def with_dflash2_modules(drafter: DFlashDrafter, seed: int = 0) -> DFlashDrafter:
    """The DFlash drafter's backbone with random DFlash 2 modules (published sizes)."""
    raw = drafter.cfg.to_dict()
    raw["architectures"] = [DFLASH2]
    raw["dflash_config"].update(DFLASH2_DEFAULTS)
    two = DFlashDrafter(DrafterConfig.from_dict(raw))
    init_drafter_weights(two, seed=seed)
    two.load_state_dict(drafter.state_dict(), strict=False)
    with torch.no_grad():
        for layer in two.layers:  # off the identity; the cost does not depend on the values
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.kernel_projection.weight.normal_(0.0, 0.02)
    two = two.to(drafter.fc.weight.dtype).eval()
    two.set_draft_vocab(drafter.draft_vocab, drafter.cfg.vocab_size)
    return two


def without_convs(drafter: DFlashDrafter) -> DFlashDrafter:
    """A copy of a DFlash 2 drafter whose layers skip their convolutions (what they cost, by difference)."""
    copy = DFlashDrafter(drafter.cfg)
    copy.load_state_dict(drafter.state_dict())
    copy = copy.to(drafter.fc.weight.dtype).eval()
    for layer in copy.layers:
        layer.attention_conv = layer.mlp_conv = None
    return copy


@torch.inference_mode()
def measure(target, d1: DFlashDrafter, d2: DFlashDrafter, d2_plain: DFlashDrafter, q: int, context: int, reps: int,
            clock) -> dict[str, float]:
    """Median milliseconds of each part of a step drafting and verifying q tokens (d2_plain:
    d2 without its convolutions)."""
    layer_ids = d1.target_layer_ids
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 1000, (1, context), generator=g)
    tcache = target.new_cache(1)
    if hasattr(tcache, "reserve"):
        tcache.reserve(context)
    _, feats = target.forward(ids, torch.arange(context)[None], tcache, layer_ids, last_logits_only=True)

    def draft(static: StaticDrafter):
        cache = static.new_cache(1, capacity=context + 64)
        cache.reserve(context, context)
        static(feats[:, :-1], torch.arange(context - 1)[None], target.embed(ids[:, -1:]), torch.tensor([[context - 1]]),
               cache)
        block = torch.full((1, q), d1.mask_token_id)
        embeds, pos = target.embed(block), torch.arange(context, context + q)[None]

        def run():  # one new context token per pass, as after a step that accepted nothing
            cache.reserve(context + q, context + q)
            return static(feats[:, -1:], torch.tensor([[context - 1]]), embeds, pos, cache)
        return run

    def verify():
        block, pos = torch.randint(100, 1000, (1, q), generator=g), torch.arange(context, context + q)[None]
        if hasattr(tcache, "reserve"):
            tcache.reserve(context + q)
        greedy_forward(target, block, pos, tcache, layer_ids)[0].tolist()
        tcache.reject(torch.zeros(1, q, dtype=torch.bool))
        tcache.compact(1.0)

    from blockspec.cpu import program  # after the targets package, which it imports from

    head, anchor = target.head(), torch.tensor([7])
    with_program = StaticDrafter(d1)
    hidden = draft(with_program)()[:, 1:q].clone()
    previous = os.environ.get(program.ENV)
    os.environ[program.ENV] = "0"  # the others' layer programs are built (on first use) without
    try:
        runs = {
            "draft DFlash (C layer program)": draft(with_program),
            "draft DFlash (PyTorch loop)": draft(StaticDrafter(d1)),
            "draft DFlash 2 without convs": draft(StaticDrafter(d2_plain)),
            "draft DFlash 2": draft(StaticDrafter(d2)),
            "propose DFlash (argmax + confidence)": lambda: d1.greedy_with_confidence(hidden, head)[1].tolist(),
            "propose DFlash 2 (walk + confidence)": lambda: d2.greedy_with_confidence(hidden, head, anchor)[1].tolist(),
            "propose DFlash 2 (walk)": lambda: d2.greedy_tokens(hidden, head, anchor).tolist(),
            "verify": verify,
        }
        for f in runs.values():
            f()
    finally:
        if previous is None:
            os.environ.pop(program.ENV, None)
        else:
            os.environ[program.ENV] = previous
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for k, f in runs.items():  # interleaved: load on the machine hits every part alike
            t0 = clock()
            f()
            times[k].append(clock() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default=None, help="a DFlash drafter directory (default: the shipped one)")
    ap.add_argument("--dflash2", default=None, help="a DFlash 2 drafter directory of the same backbone")
    ap.add_argument("--blocks", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import blockspec.api
    from blockspec.dflash.drafter import load_drafter

    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    pipe = blockspec.api.load(args.target, args.drafter)
    d1 = pipe.drafter
    d2 = (load_drafter(args.dflash2, dtype=d1.fc.weight.dtype) if args.dflash2 else with_dflash2_modules(d1))
    d2_plain = without_convs(d2)
    for q in args.blocks:
        ms = measure(pipe.target, d1, d2, d2_plain, q, args.context, args.reps, clock)
        for k, v in ms.items():
            print(f"block {q:2d}  {k:40s} {v:8.3f} ms")
        step1 = ms["draft DFlash (C layer program)"] + ms["propose DFlash (argmax + confidence)"] + ms["verify"]
        step2 = ms["draft DFlash 2"] + ms["propose DFlash 2 (walk + confidence)"] + ms["verify"]
        convs = ms["draft DFlash 2"] - ms["draft DFlash 2 without convs"]
        selector = ms["propose DFlash 2 (walk + confidence)"] - ms["propose DFlash (argmax + confidence)"]
        loop = ms["draft DFlash (PyTorch loop)"] - ms["draft DFlash (C layer program)"]
        print(f"block {q:2d}  step DFlash {step1:.2f} ms, DFlash 2 {step2:.2f} ms ({step2 / step1:.3f}x); shares of "
              f"the DFlash 2 step: convolutions {convs / step2:.3f}, selector beyond the argmax {selector / step2:.3f}, "
              f"the C layer program DFlash 2 does without {loop / step2:.3f}")


if __name__ == "__main__":
    main()
