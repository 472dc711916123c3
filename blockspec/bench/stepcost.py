"""Cost of one DFlash step over one plain decoding step, on a model of a given SHAPE.

    python -m blockspec.bench.stepcost --shape qwen3-8b --draft-layers 5 --batch 1,8,32 --device cuda
    python -m blockspec.bench.stepcost --shape smollm2-135m --draft-layers 2 --block 2,4,8,16 --batch 1,8,16
    python -m blockspec.bench.stepcost --shape smollm2-135m --draft-layers 1 --block 2,4 --batch 1 --thread worker
    python -m blockspec.bench.stepcost --shape smollm2-135m --draft-layers 2 --block 4,16 --batch 1 --cpu-matmul mkl
    python -m blockspec.bench.stepcost --shape smollm2-135m --draft-layers 2 --block 4,16 --batch 1 \
        --draft-dtype float32,bfloat16 --draft-vocab 16385

The target and drafter get random weights: the cost of a step depends on the shapes, not on the
values (with random weights nothing is accepted, so every step commits one token and the context
grows alike on both paths). A DFlash step is a draft pass over the block plus the target's verify
pass over it; a plain step is a one-token target pass. The ratio is the price of a step: with
acceptance length tau, DFlash is tau / ratio times faster than plain decoding. The published
6.08x at tau 7.87 on Qwen3-8B implies a ratio of about 1.29.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable

import torch

from blockspec.config import SamplingParams
from blockspec.errors import ConfigError
from blockspec.cpu.linear import CPU_MATMULS
from blockspec.targets.base import DTYPES

# Shapes of public models (config.json of each), and a tiny one for tests.
SHAPES: dict[str, dict] = {
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1_000_000.0, tie_word_embeddings=False),
    "qwen3-4b": dict(model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1_000_000.0, tie_word_embeddings=True),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100_000.0, tie_word_embeddings=True),
    "tiny": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                 max_position_embeddings=4096, rope_theta=10_000.0, tie_word_embeddings=False),
}


def random_target(shape: str, *, device: str, dtype: torch.dtype, seed: int = 0) -> object:
    """A NativeTarget of the named shape with N(0, 0.02) weights, built directly on `device`."""
    from transformers import AutoConfig

    from blockspec.targets.native.config import native_config
    from blockspec.targets.native.llama import NativeLlama, NativeTarget
    from blockspec.targets.rope import Rotary, rope_inv_freq

    if shape not in SHAPES:
        raise ConfigError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    spec = dict(SHAPES[shape])
    hf_config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    cfg = native_config(hf_config)
    with torch.device("meta"):  # no throwaway CPU initialisation of a multi-GB model
        net = NativeLlama(cfg, hf_config)
    net = net.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.dim() == 1:  # norms
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.embed.weight
    inv_freq, scaling = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, hf_config)
    net.rotary = Rotary(inv_freq.to(device), scaling)
    net.prepare_single_token_weights(torch.device(device).type == "cpu")
    return NativeTarget(net, (), hf_config)


THREADS = ("main", "worker", "worker-released")


def on_thread(fn: Callable[[], float], thread: str) -> float:
    """fn() on the calling thread ("main") or on a second one (see --thread)."""
    if thread not in THREADS:
        raise ConfigError(f"thread must be one of {', '.join(THREADS)}, got {thread!r}")
    if thread == "main":
        return fn()
    if thread == "worker-released":
        from blockspec.cpu.openmp import release_thread_pool

        release_thread_pool()
    out: list = []

    def work() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # re-raised on the caller's thread
            out.append(e)

    worker = threading.Thread(target=work, name="stepcost-worker")
    worker.start()
    worker.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def linear_kind() -> str:
    from blockspec.cpu import linear

    return linear.CPU_MATMUL


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def step_seconds(target: object, drafter: object | None, block: int, batch: int, context: int, steps: int,
                 device: str, seed: int = 0) -> float:
    """Median seconds of one decode step (block 1 without drafter: plain) for `batch` rows that
    each hold `context` tokens; the first steps are warm-up."""
    from blockspec.dflash.batch import DecodeBatch
    from blockspec.dflash.row import make_row

    vocab = target.info.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab - 1, (batch, context), generator=g).tolist()
    total = steps + 3
    params = SamplingParams(max_new_tokens=total * block + 1, ignore_eos=True)
    dec = DecodeBatch(target, drafter if block > 1 else None, max_block=block)
    dec.join(prompts, [make_row(i, context, params, (), block) for i in range(batch)])
    times = []
    for i in range(total):
        _sync(device)
        t0 = time.perf_counter()
        dec.step(block)
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--block", default="16", help="comma-separated block sizes of the DFlash steps")
    ap.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--context", type=int, default=512, help="tokens already in each row's cache")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time plain and DFlash steps alternately this many times and keep each side's "
                         "fastest round's median: a machine that is still settling (a GPU host just "
                         "started) slows one round, not the figure")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--thread", default="main", choices=THREADS,
                    help="where the steps run: main = the thread that built the models; worker = a second "
                         "thread while the main one keeps its OpenMP team; worker-released = a second thread "
                         "after the main one released its team (what the engine does; cpu/openmp.py)")
    ap.add_argument("--small-rows", type=int, default=None,
                    help="CPU: largest row count of the small-row matmul path (cpu/linear.py); 1 turns it off")
    ap.add_argument("--draft-dtype", default="auto",
                    help="comma-separated drafter dtypes, measured side by side (auto: what `blockspec.load` "
                         "picks beside the target's dtype on this device)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="restrict the drafter's head to this many token ids, as a shipped draft_vocab does "
                         "(0: the whole vocabulary)")
    ap.add_argument("--cpu-matmul", default=None, choices=CPU_MATMULS,
                    help="CPU kernel of the projections (cpu/linear.py); default: the library's choice")
    args = ap.parse_args(argv)
    from blockspec.cpu import linear

    saved = linear.SMALL_ROWS
    if args.small_rows is not None:
        linear.SMALL_ROWS = args.small_rows
    try:
        saved_kind = linear.set_cpu_matmul(args.cpu_matmul) if args.cpu_matmul else None
    except ValueError as e:
        raise ConfigError(f"--cpu-matmul: {e}") from None
    try:
        return _run(args)
    finally:
        linear.SMALL_ROWS = saved
        if saved_kind is not None:
            linear.set_cpu_matmul(saved_kind)


def _run(args: argparse.Namespace) -> int:
    from blockspec.api import resolve_drafter_dtype

    try:
        blocks = [int(b) for b in args.block.split(",")]
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        raise ConfigError(f"--block and --batch take comma-separated integers, got {args.block!r} and {args.batch!r}") from None
    if not blocks or min(blocks) < 2 or not batches or min(batches) < 1:
        raise ConfigError("--block sizes must be >= 2 (1 is the plain step) and --batch sizes >= 1")
    from blockspec.dflash.drafter import new_drafter_for_target

    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if dtype_name not in DTYPES:
        raise ConfigError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype_name!r}")
    dtype = DTYPES[dtype_name]
    draft_dtypes = [resolve_drafter_dtype(d.strip(), dtype_name, args.device) for d in args.draft_dtype.split(",")]
    target = random_target(args.shape, device=args.device, dtype=dtype)
    vocab = target.info.vocab_size
    if not 0 <= args.draft_vocab <= vocab:
        raise ConfigError(f"--draft-vocab must be in [0, {vocab}] for shape {args.shape}, got {args.draft_vocab}")
    drafters = {}
    for draft_dtype in dict.fromkeys(draft_dtypes):
        drafter = new_drafter_for_target(target.config, mask_token_id=vocab - 1, num_layers=args.draft_layers,
                                         block_size=max(blocks), dtype=draft_dtype).to(args.device).eval()
        if args.draft_vocab:
            ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[: args.draft_vocab]
            drafter.set_draft_vocab(ids, vocab)
        drafters[str(draft_dtype).removeprefix("torch.")] = drafter
    if args.rounds < 1:
        raise ConfigError(f"--rounds must be >= 1, got {args.rounds}")
    rows = []
    for b in batches:
        plain = float("inf")
        spec: dict[tuple[int, str], float] = {}
        for _ in range(args.rounds):  # sides alternate, so drift and warm-up hit them alike
            plain = min(plain, on_thread(lambda: step_seconds(target, None, 1, b, args.context, args.steps,
                                                              args.device), args.thread))
            for block in blocks:
                for name, drafter in drafters.items():
                    s = on_thread(lambda: step_seconds(target, drafter, block, b, args.context, args.steps,
                                                       args.device), args.thread)
                    spec[block, name] = min(spec.get((block, name), float("inf")), s)
        for (block, name), s in spec.items():
            rows.append({"batch": b, "block": block, "draft_dtype": name, "plain_ms": round(plain * 1e3, 3),
                         "dflash_ms": round(s * 1e3, 3), "ratio": round(s / plain, 3)})
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    head = f"draft vocabulary {args.draft_vocab}" if args.draft_vocab else "full-vocabulary draft head"
    print(f"shape {args.shape}, {args.draft_layers}-layer drafter ({head}), context {args.context}, "
          f"{dtype_name} target, {device}, "
          f"{args.thread} thread, CPU matmul {linear_kind()}, fastest of {args.rounds} round(s)\n")
    print("| batch | block | drafter dtype | plain step (ms) | DFlash step (ms) | DFlash / plain |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['block']} | {r['draft_dtype']} | {r['plain_ms']:.2f} | {r['dflash_ms']:.2f} "
              f"| {r['ratio']:.2f} |")
    print(json.dumps({"shape": args.shape, "device": device, "dtype": str(dtype), "thread": args.thread,
                      "cpu_matmul": linear_kind(), "draft_vocab": args.draft_vocab, "rounds": args.rounds,
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
