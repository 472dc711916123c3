"""The share of a sampled decoding step spent sampling, per verification rule.

    python -m blockspec.bench.sampling_cost --limit 4 --max-new-tokens 64 --temperature 0.7 --top-p 0.9

Decodes the first prompts of a set (batch 1, the settings every verb uses: adaptive blocks and
n-gram lookup) with sampled requests verified by the keyed rule, then the standard rule
(alternating per prompt), and times, inside every step, what sampling adds to the model work:
temperature / top-k / top-p shaping of the target's and the drafter's logits
(`probabilities`, `shaped`), the standard rule's sharper draft distribution (`sharpened`), a
draft step's nucleus and draws (`nucleus_draws`), the keyed draws and their keys
(`RowRandom.sample`, `sample_pairs`, `race`, `uniforms`, `keys`), the one-hot drafts of lookup
proposals and the standard rule itself (`verify_standard_keyed`: acceptance tests and the
residual draw). Prints a Markdown table: per rule, steps, milliseconds per step, of which
sampling, and its share. `--seed N` gives every request that seed, so two builds decode the
same text and their shares compare run to run (unseeded requests, as chat clients send them,
decode different text each run).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

# (module path, attribute) of every sampling function a step calls; class methods as "Class.method"
SAMPLING = (
    ("blockspec.dflash.batch", "probabilities"),
    ("blockspec.dflash.batch", "shaped"),
    ("blockspec.dflash.proposers.batched", "probabilities"),
    ("blockspec.dflash.proposers.dflash_block", "sharpened"),
    ("blockspec.dflash.proposers.dflash_block", "nucleus_draws"),
    ("blockspec.dflash.batch", "verify_standard_keyed"),
    ("blockspec.dflash.batch", "_one_hot_where"),
    ("blockspec.dflash.sampling", "RowRandom.sample"),
    ("blockspec.dflash.sparse_probs", "sample_pairs"),
    ("blockspec.dflash.sampling", "RowRandom.race"),
    ("blockspec.dflash.sampling", "RowRandom.uniforms"),
    ("blockspec.dflash.sampling", "RowRandom.keys"),
)
STEPS = (("blockspec.dflash.batch", "DecodeBatch.step"), ("blockspec.dflash.batch", "DecodeBatch.step_lookup"))


class Clocks:
    """Seconds spent in the timed functions (outermost calls only, so nothing counts twice)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
                self._depth -= 1
        return timed


@contextmanager
def patched(functions: tuple[tuple[str, str], ...], wrap: Callable[[Callable, str], Callable]) -> Iterator[None]:
    """Replaces every one of `functions` ((module path, attribute)) by wrap(it, attribute) while
    inside; restores them after."""
    import importlib

    saved = []
    for module_name, attr in functions:
        owner = importlib.import_module(module_name)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrap(getattr(owner, name), attr))
    try:
        yield
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


@contextmanager
def timing(functions: tuple[tuple[str, str], ...], clocks: Clocks) -> Iterator[None]:
    """Times every call of `functions` into `clocks` while inside; restores them after."""
    with patched(functions, lambda fn, _: clocks.wrap(fn)):
        yield


def dataset_prompts(tokenizer: object, dataset: str, limit: int) -> list[list[int]]:
    """The token ids of the first user turn of a shipped set's first `limit` samples, through the
    chat template."""
    from blockspec.datasets import load_dataset
    from blockspec.text import encode_prompt

    return [encode_prompt(tokenizer, s.prompt, chat=True) for s in load_dataset(dataset, limit=limit)]


def measure(decoder: object, prompts: list[list[int]], params: object, rules: tuple[str, ...]) -> dict[str, dict]:
    """Per rule: steps, step seconds and sampling seconds over `prompts` (each prompt run once per
    rule, the rules alternating, so drifting load hits them alike)."""
    out = {rule: {"steps": 0, "step_s": 0.0, "sampling_s": 0.0, "tokens": 0, "tau": []} for rule in rules}
    for prompt in prompts:
        for rule in rules:
            steps, sampling = Clocks(), Clocks()
            with timing(STEPS, steps), timing(SAMPLING, sampling):
                result = decoder.generate([prompt], params.with_(sampling_rule=rule))[0]
            row = out[rule]
            row["steps"] += steps.calls
            row["step_s"] += steps.seconds
            row["sampling_s"] += sampling.seconds
            row["tokens"] += len(result.token_ids)
            row["tau"].append(result.stats.mean_tau)
    return out


def table(results: dict[str, dict]) -> str:
    lines = ["| rule | steps | tokens | tau | ms per step | of which sampling (ms) | sampling share |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for rule, r in results.items():
        n = max(1, r["steps"])
        tau = sum(r["tau"]) / max(1, len(r["tau"]))
        lines.append(f"| {rule} | {r['steps']} | {r['tokens']} | {tau:.2f} | {1000 * r['step_s'] / n:.2f} | "
                     f"{1000 * r['sampling_s'] / n:.2f} | {100 * r['sampling_s'] / max(r['step_s'], 1e-12):.1f}% |")
    return "\n".join(lines)


def run_arguments(description: str, *, limit: int, max_new_tokens: int, temperature: float,
                  top_p: float) -> argparse.ArgumentParser:
    """The arguments of the tools that decode a prompt set's first prompts (this one and
    bench/tickparts.py): the model pair, the set and its size, the sampling settings, the seed and
    the threads, with each tool's defaults."""
    from blockspec.zoo.registry import DEFAULT_TARGET

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--drafter", default=None, help="default: the drafter shipped for a zoo target")
    ap.add_argument("--dataset", default="gsm8k")
    ap.add_argument("--limit", type=int, default=limit, help=f"prompts (default {limit})")
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    ap.add_argument("--temperature", type=float, default=temperature)
    ap.add_argument("--top-p", type=float, default=top_p)
    ap.add_argument("--seed", type=int, default=None,
                    help="every sampled request's seed (default: none, as chat clients send them)")
    ap.add_argument("--threads", type=int, default=None)
    return ap


def load_pinned(args: argparse.Namespace) -> object:
    """The `run_arguments` model pair, loaded after pinning `--threads` (where given)."""
    from blockspec.api import load

    if args.threads:
        from blockspec.cpu.threads import pin

        pin(args.threads)
    return load(args.target, args.drafter)


def main(argv: list[str] | None = None) -> int:
    from blockspec.config import SamplingParams

    ap = run_arguments(__doc__.splitlines()[0], limit=4, max_new_tokens=64, temperature=0.7, top_p=0.9)
    ap.add_argument("--top-k", type=int, default=0)
    args = ap.parse_args(argv)
    pipe = load_pinned(args)
    prompts = dataset_prompts(pipe.tokenizer, args.dataset, args.limit)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    pipe.decoder.generate([prompts[0]], params.with_(max_new_tokens=8))  # warm-up (and calibration)
    results = measure(pipe.decoder, prompts, params, ("keyed", "standard"))
    print(table(results))
    print(json.dumps({"threads": torch.get_num_threads(), **{k: {kk: vv for kk, vv in v.items() if kk != "tau"}
                                                             for k, v in results.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
