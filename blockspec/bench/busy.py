"""Plain decoding and DFlash on the demo prompt, quiet and beside N CPU-bound processes, interleaved.

    python -m blockspec.bench.busy --busy 1 --rounds 3

Each round runs both machine states (the busy processes are started and stopped by this command,
and stopped on Ctrl-C or if it dies), and in each state plain decoding and DFlash (the demo's
adaptive policy), their order swapped from round to round so that drift in the machine's other
work hits both alike. Reports the median tokens/s of each, DFlash's speedup, tau, the share of
steps DFlash decoded plainly, the thread count decoding ran on (cpu/threads.py), what each keeps
of its quiet speed beside the busy processes, and the shipped drafter's whole-block tau on the
prompt (fixed block, quiet). Set BLOCKSPEC_THREADS=off to measure without the thread governor.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

SETTLE_S = 1.0  # after starting or stopping the busy processes: the thread governor's window sees only the new state
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: the kernel kills it when this process dies, however it dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the `finally` below still stops them


@contextmanager
def busy_processes(n: int) -> Iterator[list[subprocess.Popen]]:
    """N CPU-bound processes (`python -c 'while True: pass'`) while the block runs; stopped on the
    way out, Ctrl-C included."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                          preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None))
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


@dataclass(frozen=True)
class Run:
    """One generation: tokens/s, mean acceptance length, share of steps decoded plainly, threads."""

    tokens_per_s: float
    tau: float
    plain_share: float
    threads: int


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def measure(pipe: object, ids: list[int], params: object, dflash: bool) -> Run:
    """Plain decoding (block 1) or the pipeline's own DFlash setting, once."""
    before = pipe.decoder.block_choices
    r = pipe.generate_ids([ids], params, block_size=None if dflash else 1)[0]
    steps = {n: c - before.get(n, 0) for n, c in pipe.decoder.block_choices.items()}
    total = sum(steps.values())
    plain = (steps.get(1, 0) / total if total else 0.0) if dflash else 1.0
    return Run(r.tokens_per_s, r.stats.mean_tau, plain, _threads())


def _settle(pipe: object, ids: list[int]) -> None:
    """Lets the machine settle into its new state and the thread governor look at it."""
    from blockspec.config import SamplingParams

    time.sleep(SETTLE_S)
    pipe.generate_ids([ids[:8]], SamplingParams(max_new_tokens=4), block_size=1)


def table(runs: dict[tuple[str, str], list[Run]], busy: int) -> list[str]:
    """The markdown table of the medians, and the busy/quiet ratios."""
    def med(state: str, mode: str, field: str) -> float:
        return statistics.median(getattr(r, field) for r in runs[(state, mode)])

    states = [("quiet", "quiet")] + ([("busy", f"beside {busy} busy process{'es' if busy > 1 else ''}")] if busy else [])
    lines = ["| machine | plain tokens/s | DFlash tokens/s | DFlash / plain | tau | DFlash steps plain | threads |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for state, label in states:
        plain, fast = med(state, "plain", "tokens_per_s"), med(state, "dflash", "tokens_per_s")
        threads = sorted({r.threads for mode in ("plain", "dflash") for r in runs[(state, mode)]})
        lines.append(f"| {label} | {plain:.1f} | {fast:.1f} | {fast / plain:.2f}x | {med(state, 'dflash', 'tau'):.2f} "
                     f"| {med(state, 'dflash', 'plain_share'):.0%} | {'/'.join(map(str, threads))} |")
    if busy:
        keep = [med("busy", m, "tokens_per_s") / med("quiet", m, "tokens_per_s") for m in ("plain", "dflash")]
        lines.append(f"| busy / quiet | {keep[0]:.2f} | {keep[1]:.2f} | | | | |")
    return lines


def main(argv: list[str] | None = None) -> int:
    from blockspec.api import load
    from blockspec.zoo.registry import DEFAULT_PROMPT, DEFAULT_TARGET
    from blockspec.config import SamplingParams
    from blockspec.errors import BlockspecError

    p = argparse.ArgumentParser(prog="python -m blockspec.bench.busy", description=__doc__.split("\n")[0])
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--drafter", default=None, help="default: the shipped one")
    p.add_argument("--busy", type=int, default=1, help="CPU-bound processes beside decoding (0: quiet only)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    args = p.parse_args(argv)
    if args.busy < 0 or args.rounds < 1 or args.max_new_tokens < 1:
        p.error("--busy must be >= 0, --rounds and --max-new-tokens >= 1")
    try:
        pipe = load(args.target, args.drafter)
    except BlockspecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ids = pipe.encode([{"role": "user", "content": args.prompt}])
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    load0 = os.getloadavg()
    started = _dt.datetime.now().isoformat(timespec="minutes")
    pipe.generate_ids([ids[:8]], SamplingParams(max_new_tokens=4))  # warm-up, and the policy's calibration
    whole = pipe.generate_ids([ids], params, block_size=pipe.block_size)[0]
    runs: dict[tuple[str, str], list[Run]] = {}
    try:
        for r in range(args.rounds):
            states = ["quiet", "busy"] if args.busy else ["quiet"]
            for state in states if r % 2 == 0 else states[::-1]:
                with busy_processes(args.busy if state == "busy" else 0):
                    _settle(pipe, ids)
                    for mode in ("plain", "dflash") if r % 2 == 0 else ("dflash", "plain"):
                        run = measure(pipe, ids, params, mode == "dflash")
                        runs.setdefault((state, mode), []).append(run)
                        print(f"round {r + 1} {state:5s} {mode:6s}: {run.tokens_per_s:6.1f} tokens/s, tau "
                              f"{run.tau:.2f}, {run.threads} thread(s), load {os.getloadavg()[0]:.2f}",
                              file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("interrupted; the busy processes are stopped", file=sys.stderr)
        return 130
    print(f"\n{cpu_name()}, {os.cpu_count()} CPUs, {started}; load average "
          f"{load0[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; {args.rounds} rounds, medians; "
          f"{args.max_new_tokens} new tokens of the demo prompt")
    print(f"the drafter's whole-block tau on this prompt (block {pipe.block_size} every step): {whole.stats.mean_tau:.2f}\n")
    print("\n".join(table(runs, args.busy)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
