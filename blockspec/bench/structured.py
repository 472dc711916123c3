"""Speculative decoding's speedup with a JSON-schema constraint and without one.

    python -m blockspec.bench.structured [--target smollm2-135m-instruct] [--max-new-tokens 96] [--rounds 2]

Greedy, one request at a time, on prompts that ask for JSON: for free text and for the same
prompts under a JSON schema, the tokens per second of DFlash (the pipeline's drafter and
adaptive block) and of plain decoding (block size 1), interleaved round by round. Prints each
rate, the speedups, and checks that the constrained speculative output equals the constrained
plain output token for token.
"""

from __future__ import annotations

import argparse
import json
import time

from blockspec.api import load
from blockspec.config import SamplingParams
from blockspec.engine.grammar import Grammars, OutputFormat

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "hobbies": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
QUESTIONS = [
    "Describe a fictional person as JSON with name, age, city and hobbies.",
    "Give me a JSON record of a made-up chef: name, age, city, hobbies.",
    "Invent a character for a novel and answer in JSON (name, age, city, hobbies).",
    "Return a JSON object for an imaginary astronaut with name, age, city and hobbies.",
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    pipe = load(args.target)
    info = pipe.target.info
    grammars = Grammars(pipe.tokenizer, info.vocab_size, info.eos_token_ids)
    fmt = OutputFormat("json_schema", SCHEMA)
    grammars.compile(fmt)
    prompts = [pipe.encode([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    rates: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    taus: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for constrained in ("free", "json_schema"):
            for mode, block in (("dflash", None), ("plain", 1)):
                tokens, seconds = 0, 0.0
                outs = []
                for p in prompts:  # one request at a time: the latency a single client sees
                    constraint = [grammars.matcher(fmt)] if constrained == "json_schema" else None
                    t0 = time.perf_counter()
                    r = pipe.decoder.generate([p], params, block_size=block, constraints=constraint)[0]
                    seconds += time.perf_counter() - t0
                    tokens += len(r.token_ids)
                    outs.append(r.token_ids)
                    taus.setdefault((constrained, mode), []).append(r.stats.mean_tau)
                rates.setdefault((constrained, mode), []).append(tokens / seconds)
                outputs[(constrained, mode)] = outs
    for key, values in rates.items():
        tau = sum(taus[key]) / len(taus[key])
        print(f"{key[0]:12s} {key[1]:7s} {max(values):7.1f} tok/s (best of {len(values)}), mean tau {tau:.2f}")
    for constrained in ("free", "json_schema"):
        speedup = max(rates[(constrained, "dflash")]) / max(rates[(constrained, "plain")])
        print(f"speedup {constrained}: {speedup:.2f}x")
    same = outputs[("json_schema", "dflash")] == outputs[("json_schema", "plain")]
    valid = sum(_parses(pipe.tokenizer.decode(ids, skip_special_tokens=True)) for ids in outputs[("json_schema", "plain")])
    print(f"constrained dflash == constrained plain: {same}; outputs that parse as JSON: {valid}/{len(prompts)}")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    main()
