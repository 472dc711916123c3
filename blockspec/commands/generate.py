"""`blockspec generate`: one prompt (or chat), streamed to the terminal; --compare times DFlash
against plain decoding of the same target on the same prompt."""

from __future__ import annotations

import argparse
import json
import sys

from blockspec.commands import add_drafter_dtype_argument, add_lookup_argument

HELP = "generate text with DFlash speculative decoding"


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Target/drafter/runtime flags shared by generate, demo and bench."""
    p.add_argument("--target", default="smollm2-135m-instruct",
                   help="zoo name (see `blockspec pull --list`), local HF directory or Hub id")
    p.add_argument("--drafter", default=None,
                   help="DFlash drafter directory; default: the drafter shipped for a zoo target; "
                        "'fresh' = untrained (lossless, no speedup); 'none' = plain decoding")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    add_drafter_dtype_argument(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=None, help="block size (default: the drafter's)")


def add_adaptive_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adaptive-block", action=argparse.BooleanOptionalAction, default=True,
                   help="choose each step's block size (up to --block-size) from step costs measured on this "
                        "machine and the acceptance so far, down to plain decoding where drafting does not pay; "
                        "same output (default: on; --no-adaptive-block verifies the whole block every step, "
                        "as the published DFlash does)")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_adaptive_argument(p)
    add_lookup_argument(p)
    add_sampling_arguments(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user message (chat template applied unless --raw)")
    src.add_argument("--messages", help="JSON file with a chat message list")
    p.add_argument("--system", help="system message to put before --prompt")
    p.add_argument("--raw", action="store_true", help="send --prompt as raw text, no chat template")
    p.add_argument("--thinking", choices=["on", "off"], default=None,
                   help="enable_thinking for chat templates that support it")
    p.add_argument("--compare", action="store_true",
                   help="also run plain autoregressive decoding and print tokens/s, tau and speedup")
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

    sampling = sampling_from_args(args)
    SamplingParams(**sampling)  # validate before the slow model load
    pipe = load(args.target, args.drafter, dtype=args.dtype, device=args.device, block_size=args.block_size,
                adaptive_block=args.adaptive_block, drafter_dtype=args.drafter_dtype, lookup=not args.no_lookup)
    kwargs = {"enable_thinking": args.thinking == "on"} if args.thinking else {}
    ids = pipe.encode(prompt_from_args(args), chat=not args.raw, **kwargs)
    params = SamplingParams(**sampling)
    stream = not (args.no_stream or args.json)
    out = run_one(pipe, ids, params, stream=stream)
    report = {"text": out.text, "finish_reason": out.finish_reason, "dflash": out.stats.as_dict(len(out.token_ids))}
    if pipe.adaptive_block:
        report["block_choices"] = pipe.decoder.block_choices
    if args.compare:
        plain = pipe.generate_ids([ids], params, block_size=1)[0]
        report["plain"] = plain.stats.as_dict(len(plain.token_ids))
        report["speedup"] = round(out.tokens_per_s / max(plain.tokens_per_s, 1e-9), 3)
        report["identical"] = plain.token_ids == out.token_ids
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if not stream:
        print(out.text)
    print_summary(out, report, block_label(pipe), args.compare)
    return 0


def block_label(pipe) -> str:
    """'block 16', or for the adaptive policy the sizes its steps used so far."""
    if not pipe.adaptive_block:
        return f"block {pipe.block_size}"
    used = pipe.decoder.block_choices
    most = ", ".join(f"{b}: {n}" for b, n in sorted(used.items(), key=lambda kv: -kv[1])[:4])
    return f"adaptive block <= {pipe.block_size}; steps per block size {most or 'none yet'}"


def run_one(pipe, ids: list[int], params, *, stream: bool):
    """Generates one completion, printing text deltas as they are committed when `stream`."""
    if not stream:
        return pipe.generate_ids([ids], params)[0]
    from blockspec.text import IncrementalDetokenizer, StopStrings

    detok = IncrementalDetokenizer(StopStrings(pipe.tokenizer, params.stop))

    def show(_row: int, new: list[int]) -> None:
        sys.stdout.write(detok.push(new))
        sys.stdout.flush()

    out = pipe.generate_ids([ids], params, on_tokens=show)[0]
    sys.stdout.write(detok.push([], final=True) + "\n")
    return out


def print_summary(out, report: dict, block: str, compare: bool) -> None:
    s = out.stats
    err = sys.stderr
    print(f"\n[dflash] {len(out.token_ids)} tokens, {out.tokens_per_s:.1f} tok/s, mean tau {s.mean_tau:.2f} "
          f"({block}), prefill {s.prefill_s * 1000:.0f} ms, finish: {out.finish_reason}", file=err)
    if compare:
        p = report["plain"]
        same = "identical" if report["identical"] else "DIFFERENT (lossless check failed!)"
        print(f"[plain ] {p['generated_tokens']} tokens, {p['tokens_per_s']:.1f} tok/s", file=err)
        print(f"[result] speedup {report['speedup']:.2f}x over plain decoding; outputs {same}", file=err)
