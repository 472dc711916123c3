"""`blockspec generate`: one prompt (or chat), streamed to the terminal; --compare times DFlash
against plain decoding of the same target on the same prompt."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

from blockspec.commands.heap import freeze_loaded
from blockspec.commands.model_args import add_runtime_arguments, load_kwargs

HELP = "generate text with DFlash speculative decoding"


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_runtime_arguments(p)
    add_sampling_arguments(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message (chat template applied unless --raw)")
    src.add_argument("--messages", help="JSON file with a chat message list")
    p.add_argument("--system", help="system message to put before --prompt")
    p.add_argument("--raw", action="store_true", help="send --prompt as raw text, no chat template")
    p.add_argument("--thinking", choices=["on", "off"], default=None,
                   help="enable_thinking for chat templates that support it")
    p.add_argument("--compare", action="store_true",
                   help="also run plain decoding of the same target and print both speeds and the speedup: each "
                        f"side first runs one uncounted {WARMUP_TOKENS}-token warm-up, then --compare-runs timed runs "
                        "of each alternate (D P P D), as `blockspec bench` times them")
    p.add_argument("--compare-runs", type=int, default=2,
                   help="timed runs of each side with --compare (default 2; the first DFlash run is the one shown)")
    p.add_argument("--no-stream", action="store_true", help="print the text at the end only")
    p.add_argument("--json", action="store_true", help="print the result and statistics as JSON")


def sampling_from_args(args: argparse.Namespace) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))


def prompt_from_args(args: argparse.Namespace) -> object:
    from blockspec.errors import ConfigError

    if args.messages:
        try:
            with open(args.messages) as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--messages {args.messages}: cannot read a JSON message list ({e})") from e
    if args.raw:
        return args.prompt
    messages = [{"role": "system", "content": args.system}] if args.system else []
    return messages + [{"role": "user", "content": args.prompt}]


def run(args: argparse.Namespace) -> int:
    from blockspec.api import load
    from blockspec.config import SamplingParams
    from blockspec.errors import ConfigError

    sampling = sampling_from_args(args)
    SamplingParams(**sampling)  # validate before the slow model load
    if args.compare_runs < 1:
        raise ConfigError(f"--compare-runs must be >= 1, got {args.compare_runs}")
    if args.compare and args.drafter == "none":
        raise ConfigError("--compare times DFlash against plain decoding, so it needs a drafter: drop "
                          "--drafter none (or pass a drafter directory, or --drafter fresh)")
    pipe = load(**load_kwargs(args))
    freeze_loaded()
    kwargs = {"enable_thinking": args.thinking == "on"} if args.thinking else {}
    ids = pipe.encode(prompt_from_args(args), chat=not args.raw, **kwargs)
    params = SamplingParams(**sampling)
    stream = not (args.no_stream or args.json)
    if args.compare:
        cmp = compare(pipe, ids, params, runs=args.compare_runs, stream=stream)
        out = cmp.dflash[0]
    else:
        before = pipe.decoder.block_choices
        out = run_one(pipe, ids, params, stream=stream)
    report = {"text": out.text, "finish_reason": out.finish_reason, "compute": pipe.compute,
              "dflash": out.stats.as_dict(len(out.token_ids))}
    if pipe.adaptive_block:
        report["block_choices"] = cmp.block_choices if args.compare else _since(before, pipe.decoder.block_choices)
    if args.compare:
        report["dflash"]["tokens_per_s"] = round(cmp.tokens_per_s(cmp.dflash), 3)
        report["plain"] = cmp.plain[0].stats.as_dict(len(cmp.plain[0].token_ids))
        report["plain"]["tokens_per_s"] = round(cmp.tokens_per_s(cmp.plain), 3)
        report["speedup"] = round(cmp.speedup, 3)
        report["identical"] = cmp.identical if params.temperature == 0 else None
        report["timed"] = cmp.describe()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if not stream:
        print(out.text)
    print_summary(out, report, block_label(pipe, report.get("block_choices")), args.compare)
    return 0


WARMUP_TOKENS = 32  # as `blockspec bench` (bench/runner.py SuitePlan.warmup_tokens)


@dataclass
class Comparison:
    """Timed DFlash and plain runs of one prompt, each side warmed up alike (`compare`)."""

    order: list[str]  # "dflash" / "plain", in the order they ran
    warmup_tokens: int
    dflash: list = field(default_factory=list)  # Completions
    plain: list = field(default_factory=list)
    block_choices: dict[int, int] = field(default_factory=dict)  # steps per block size of the timed DFlash runs

    @staticmethod
    def tokens_per_s(runs: list) -> float:
        """Generated tokens over prefill plus decode time, summed over `runs`."""
        seconds = sum(r.stats.prefill_s + r.stats.decode_s for r in runs)
        return sum(len(r.token_ids) for r in runs) / seconds if seconds > 0 else 0.0

    @property
    def speedup(self) -> float:
        return self.tokens_per_s(self.dflash) / max(self.tokens_per_s(self.plain), 1e-9)

    @property
    def identical(self) -> bool:
        return all(r.token_ids == self.dflash[0].token_ids for r in self.dflash + self.plain)

    def describe(self) -> str:
        sides = {"dflash": "D", "plain": "P"}
        return (f"{len(self.dflash)} run(s) of each side, in the order {' '.join(sides[s] for s in self.order)} "
                f"(D = DFlash, P = plain decoding), after one uncounted {self.warmup_tokens}-token warm-up of each; "
                "tokens/s = generated tokens / (prefill + decode) time")


def compare(pipe, ids: list[int], params, *, runs: int = 2, stream: bool = False,
            warmup_tokens: int = WARMUP_TOKENS) -> Comparison:
    """DFlash against plain decoding of the same prompt, timed as `blockspec bench` times them:
    first one uncounted warm-up generation of each side (lazy initialisation, first-call costs and
    the adaptive policy's calibration stay out of the numbers), then `runs` timed runs of each,
    alternating D P P D ... so that drift of the machine's load hits both sides alike. The first
    DFlash run streams its text when `stream`."""
    from dataclasses import replace

    order = [side for i in range(runs) for side in (("dflash", "plain") if i % 2 == 0 else ("plain", "dflash"))]
    cmp = Comparison(order, min(warmup_tokens, params.max_new_tokens))
    warm = replace(params, max_new_tokens=cmp.warmup_tokens)
    pipe.generate_ids([ids], warm, block_size=1)
    pipe.generate_ids([ids], warm)
    before = pipe.decoder.block_choices
    for side in order:
        if side == "plain":
            cmp.plain.append(pipe.generate_ids([ids], params, block_size=1)[0])
        else:
            cmp.dflash.append(run_one(pipe, ids, params, stream=stream and not cmp.dflash))
    cmp.block_choices = _since(before, pipe.decoder.block_choices)
    return cmp


def _since(before: dict[int, int], after: dict[int, int]) -> dict[int, int]:
    """Steps per block size taken between two readings of `block_choices`."""
    return {b: n - before.get(b, 0) for b, n in sorted(after.items()) if n > before.get(b, 0)}


def block_label(pipe, used: dict[int, int] | None = None) -> str:
    """'block 16', or for the adaptive policy the sizes its steps used (`used`, else all so far)."""
    if not pipe.adaptive_block:
        return f"block {pipe.block_size}"
    used = pipe.decoder.block_choices if used is None else used
    most = ", ".join(f"{b}: {n}" for b, n in sorted(used.items(), key=lambda kv: -kv[1])[:4])
    return f"adaptive block <= {pipe.block_size}; steps per block size {most or 'none yet'}"


def run_one(pipe, ids: list[int], params, *, stream: bool):
    """Generates one completion, printing text deltas as they are committed when `stream`."""
    if not stream:
        return pipe.generate_ids([ids], params)[0]
    from blockspec.text import IncrementalDetokenizer, StopStrings

    stops = StopStrings(pipe.tokenizer, params.stop)
    detok = IncrementalDetokenizer(stops)

    def show(_row: int, new: list[int]) -> None:
        sys.stdout.write(detok.push(new))
        sys.stdout.flush()

    out = pipe.generate_ids([ids], params, on_tokens=show, stops=stops)[0]
    sys.stdout.write(detok.push([], final=True) + "\n")
    return out


def print_summary(out, report: dict, block: str, compare: bool) -> None:
    s = out.stats
    err = sys.stderr
    rate = report["dflash"]["tokens_per_s"] if compare else out.tokens_per_s
    print(f"\n[dflash] {len(out.token_ids)} tokens, {rate:.1f} tok/s, mean tau {s.mean_tau:.2f} "
          f"({block}), prefill {s.prefill_s * 1000:.0f} ms, finish: {out.finish_reason}", file=err)
    if compare:
        p = report["plain"]
        same = {True: "identical", False: "DIFFERENT (lossless check failed!)",
                None: "not compared token by token (sampled: the same distribution, other draws)"}[report["identical"]]
        print(f"[plain ] {p['generated_tokens']} tokens, {p['tokens_per_s']:.1f} tok/s", file=err)
        print(f"[result] speedup {report['speedup']:.2f}x over plain decoding; outputs {same}", file=err)
        print(f"[timed ] {report['timed']}", file=err)
