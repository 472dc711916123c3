"""One-script CUDA check: what a GPU does with DFlash, with random weights, in a few minutes.

    python -m blockspec.bench.cudacheck --out cudacheck.json              # on a CUDA machine
    python -m blockspec.bench.cudacheck --device cpu --tiny --out c.json  # the same code at tiny shapes

Three parts, each timed and reported on its own (one failing does not stop the others):

1. step cost: a DFlash step (5-layer drafter, block 16) against a plain step of a random target
   of Qwen3-8B's shapes, bf16, batch 1, 8 and 32 (`blockspec.bench.stepcost`);
2. hybrid step: a random Qwen3.5 text model (Gated DeltaNet : attention 3 : 1, the published
   sizes, 8 layers) through the Hugging Face adapter in bf16: verify a block with rollback
   against a plain step, next to the same model with attention only (`blockspec.bench.hybrid_step`);
3. greedy decoding of a random Qwen3-8B-shaped target: speculative output (random drafter plus
   n-gram lookup, fixed blocks of 16, as chains and as token trees of 15 nodes) against plain
   decoding. In float32 both must be identical (lossless); in bfloat16 the agreement is reported, not required: GPU kernels are not batch
   invariant, so a 16-token verify pass may round a near-tie the other way than a 1-token step.

Random weights say nothing about acceptance (no real weights travel to a rented GPU): the step
costs and the exactness are what they measure. Prints a compact report, writes JSON to --out,
and exits with status 1 when a part failed. --tiny runs every part at tiny shapes (the test
suite runs it on a CPU); the figures of a GPU run go to BENCHMARKS.md ("CUDA check").
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from blockspec.errors import ConfigError
from blockspec.targets.base import DTYPES


@dataclass(frozen=True)
class Plan:
    """The sizes of each part: the GPU run's, or tiny ones for a CPU test."""

    step_shape: str = "qwen3-8b"  # a stepcost.SHAPES name
    step_draft_layers: int = 5
    step_blocks: str = "16"
    step_batches: str = "1,8,32"
    step_context: int = 512
    step_steps: int = 20
    step_rounds: int = 3  # plain and DFlash alternate; a GPU host just started is slow for a while
    hybrid_shape: str = "qwen3.5"  # a hybrid_step.SHAPES name
    hybrid_hidden: int = 0  # with hybrid_shape "scaled" only
    hybrid_vocab: int = 0
    hybrid_layers: int = 8
    hybrid_block: int = 16
    hybrid_context: int = 512
    hybrid_batches: tuple[int, ...] = (1, 4)
    hybrid_repeats: int = 10
    decode_shape: str = "qwen3-8b"
    decode_prompts: tuple[int, ...] = (40, 73, 101, 128)  # prompt lengths
    decode_new_tokens: int = 64
    decode_block: int = 16
    decode_tree_nodes: int = 15  # the token-tree run's largest tree

    def __post_init__(self) -> None:
        from blockspec.bench.hybrid_step import SHAPES as HYBRID_SHAPES
        from blockspec.bench.stepcost import SHAPES

        for name in (self.step_shape, self.decode_shape):
            if name not in SHAPES:
                raise ConfigError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
        if self.hybrid_shape not in HYBRID_SHAPES:
            raise ConfigError(f"hybrid shape must be one of {', '.join(HYBRID_SHAPES)}, got {self.hybrid_shape!r}")
        if self.decode_block < 2 or self.decode_new_tokens < 1 or not self.decode_prompts:
            raise ConfigError("decoding needs a block of >= 2 tokens, >= 1 new token and a prompt")


FULL = Plan()
TINY = Plan(step_shape="tiny", step_draft_layers=1, step_blocks="4", step_batches="1", step_context=16,
            step_steps=2, step_rounds=2, hybrid_shape="scaled", hybrid_hidden=160, hybrid_vocab=64, hybrid_layers=4,
            hybrid_block=4, hybrid_context=8, hybrid_batches=(1,), hybrid_repeats=1, decode_shape="tiny",
            decode_prompts=(5, 9), decode_new_tokens=12, decode_block=4, decode_tree_nodes=3)

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def check_device(device: str) -> str:
    """`device` if this check can run there: cpu, or cuda[:N] on a machine that has that GPU."""
    if not _DEVICE.fullmatch(device):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: this machine has no CUDA device (torch {torch.__version__}); "
                              "run with --device cpu --tiny to check the script itself")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ConfigError(f"--device {device}: there are {torch.cuda.device_count()} CUDA device(s)")
    return device


def machine(device: str) -> dict:
    """What ran the check: the device's name and memory, torch and CUDA versions."""
    info = {"device": device, "torch": torch.__version__, "python": platform.python_version()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                 "cuda": torch.version.cuda}
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def _free(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def step_cost(plan: Plan, device: str) -> dict:
    """Part 1: `stepcost` at the plan's shape in bf16; its rows and its Markdown table."""
    from blockspec.bench import stepcost

    argv = ["--shape", plan.step_shape, "--draft-layers", str(plan.step_draft_layers), "--block", plan.step_blocks,
            "--batch", plan.step_batches, "--context", str(plan.step_context), "--steps", str(plan.step_steps),
            "--rounds", str(plan.step_rounds), "--device", device, "--dtype", "bfloat16"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        stepcost.main(argv)
    _free(device)
    lines = printed.getvalue().strip().splitlines()
    result = json.loads(lines[-1])  # its machine-readable line
    return {"command": "python -m blockspec.bench.stepcost " + " ".join(argv), "rows": result["rows"],
            "table": "\n".join(line for line in lines if line.startswith("|"))}


def hybrid(plan: Plan, device: str) -> dict:
    """Part 2: `hybrid_step` at the plan's Qwen3.5 shape in bf16 through the Hugging Face adapter."""
    from blockspec.bench import hybrid_step

    rows = hybrid_step.run(plan.hybrid_hidden, plan.hybrid_layers, plan.hybrid_vocab, plan.hybrid_block,
                           plan.hybrid_context, list(plan.hybrid_batches), plan.hybrid_repeats, torch.bfloat16,
                           device, plan.hybrid_shape)
    _free(device)
    return {"shape": plan.hybrid_shape, "layers": plan.hybrid_layers, "rows": rows,
            "table": hybrid_step.table(rows, plan.hybrid_block)}


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (or where one ends), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def decode_once(plan: Plan, device: str, dtype: str) -> dict:
    """Greedy plain and speculative decoding of random prompts by a random target in `dtype`."""
    from blockspec.bench.stepcost import random_target
    from blockspec.config import LookupConfig, SamplingParams, SpecConfig
    from blockspec.dflash.drafter import new_drafter_for_target
    from blockspec.engine.decoder import SpecDecoder

    target = random_target(plan.decode_shape, device=device, dtype=DTYPES[dtype])
    vocab = target.info.vocab_size
    drafter = new_drafter_for_target(target.config, mask_token_id=vocab - 1, num_layers=1,
                                     block_size=plan.decode_block, dtype=DTYPES[dtype]).to(device).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab - 1, (n,), generator=g).tolist() for n in plan.decode_prompts]
    params = SamplingParams(max_new_tokens=plan.decode_new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    plain = SpecDecoder(target, None, SpecConfig(block_size=1)).generate(prompts, params)
    t1 = time.perf_counter()
    spec = SpecDecoder(target, drafter, SpecConfig(block_size=plan.decode_block, adaptive=False,
                                                   lookup=LookupConfig())).generate(prompts, params)
    t2 = time.perf_counter()
    tree = SpecDecoder(target, drafter, SpecConfig(block_size=plan.decode_block, adaptive=False, lookup=LookupConfig(),
                                                   tree_nodes=plan.decode_tree_nodes)).generate(prompts, params)
    t3 = time.perf_counter()
    total = sum(len(p.token_ids) for p in plain)

    def against_plain(runs: list) -> tuple[list[int | None], float]:
        diffs = [_first_difference(p.token_ids, s.token_ids) for p, s in zip(plain, runs)]
        same = sum(len(p.token_ids) if d is None else d for p, d in zip(plain, diffs))
        return diffs, round(same / total, 4)

    diffs, agreement = against_plain(spec)
    tree_diffs, tree_agreement = against_plain(tree)
    del target, drafter
    _free(device)
    return {"dtype": dtype, "rows": len(prompts), "tokens": total, "identical": all(d is None for d in diffs),
            "first_difference": diffs,  # per row: token index, or None
            "agreement": agreement,  # tokens before each row's first difference, over all
            "mean_tau": round(sum(s.stats.mean_tau for s in spec) / len(spec), 3),
            "tree_nodes": plan.decode_tree_nodes, "tree_identical": all(d is None for d in tree_diffs),
            "tree_first_difference": tree_diffs, "tree_agreement": tree_agreement,
            "tree_steps": sum(t.stats.tree_steps for t in tree),
            "plain_s": round(t1 - t0, 3), "speculative_s": round(t2 - t1, 3), "tree_s": round(t3 - t2, 3)}


def greedy(plan: Plan, device: str) -> dict:
    """Part 3: float32 speculative output must equal plain decoding; bfloat16's agreement is reported."""
    if device.startswith("cuda"):  # float32 means float32: no TF32 products in this part
        saved = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
    try:
        exact = decode_once(plan, device, "float32")
    finally:
        if device.startswith("cuda"):
            torch.backends.cuda.matmul.allow_tf32 = saved
    result = {"float32": exact, "bfloat16": decode_once(plan, device, "bfloat16")}
    if not exact["identical"]:
        raise AssertionError(f"float32 speculative output differs from plain decoding (first differences per row: "
                             f"{exact['first_difference']}): lossless decoding is broken on {device}")
    if not exact["tree_identical"]:
        raise AssertionError(f"float32 token-tree output differs from plain decoding (first differences per row: "
                             f"{exact['tree_first_difference']}): lossless tree decoding is broken on {device}")
    return result


PARTS: dict[str, Callable[[Plan, str], dict]] = {"step_cost": step_cost, "hybrid_step": hybrid, "greedy": greedy}


def run_parts(plan: Plan, device: str, parts: tuple[str, ...] = tuple(PARTS), log=print) -> dict:
    """Each part in turn, timed; a failure is recorded with its error and the next part runs."""
    report = {"machine": machine(device), "plan": asdict(plan), "parts": {}}
    start = time.perf_counter()
    for name in parts:
        t0 = time.perf_counter()
        log(f"[{name}] running ...")
        try:
            entry = {"ok": True, **PARTS[name](plan, device)}
        except Exception as e:  # noqa: BLE001  (reported, and the exit status says so)
            entry = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=8)}
            _free(device)
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        report["parts"][name] = entry
        log(summary(name, entry))
    report["seconds"] = round(time.perf_counter() - start, 1)
    report["ok"] = all(p["ok"] for p in report["parts"].values())
    return report


def summary(name: str, entry: dict) -> str:
    """A few lines on one part for the terminal."""
    head = f"[{name}] {'ok' if entry['ok'] else 'FAILED'} in {entry['seconds']} s"
    if not entry["ok"]:
        return f"{head}: {entry['error']}"
    if name == "greedy":
        lines = [f"  {d}: identical {r['identical']}, agreement {r['agreement']:.3f} over {r['tokens']} tokens, "
                 f"mean tau {r['mean_tau']}; trees of {r['tree_nodes']}: identical {r['tree_identical']}, "
                 f"agreement {r['tree_agreement']:.3f}, {r['tree_steps']} tree steps"
                 for d, r in ((k, entry[k]) for k in ("float32", "bfloat16"))]
        return "\n".join([head, *lines])
    return f"{head}\n{entry['table']}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: checks the script itself in seconds")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)} (default all)")
    ap.add_argument("--out", default="cudacheck.json", help="where the JSON report goes (default cudacheck.json)")
    args = ap.parse_args(argv)
    try:
        device = check_device(args.device)
        parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
        unknown = [p for p in parts if p not in PARTS]
        if unknown or not parts:
            raise ConfigError(f"--parts takes names from {', '.join(PARTS)}, got {args.parts!r}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plan = TINY if args.tiny else FULL
    print(f"CUDA check on {json.dumps(machine(device))}{' (tiny shapes)' if args.tiny else ''}", flush=True)
    report = run_parts(plan, device, parts, log=lambda line: print(line, flush=True))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'all parts ok' if report['ok'] else 'SOME PARTS FAILED'} in {report['seconds']} s; wrote {out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
