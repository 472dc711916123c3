"""The CPU backend switched off end to end: speculative decoding of a native fp32 target with the
standard (static) drafter stays lossless with no C library at all (BLOCKSPEC_CPU_KERNELS=0:
PyTorch's kernels everywhere), and with the kernels but without the one-call layer loop
(BLOCKSPEC_LAYER_LOOP=0). Each runs in its own process: the switches are read at load time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blockspec.cpu import kernels, program

TESTS = Path(__file__).resolve().parents[1]

# Decodes 3 ragged prompts with DFlash (adaptive off, blocks of 6, n-gram lookup on so that some
# blocks are partly accepted) and plainly; prints what the test checks.
SCRIPT = r"""
import json, sys
import torch
from conftest import make_tiny_target
from support import native, ragged_prompts
from blockspec.config import SamplingParams, SpecConfig
from blockspec.cpu import kernels, program
from blockspec.engine.decoder import SpecDecoder
from blockspec.dflash.drafter import init_drafter_weights, new_drafter_for_target
from blockspec.dflash.lookup import LookupConfig

runs = []
real_run = program.LayerProgram.run
def counted(self, *args, **kwargs):
    runs.append(1)
    return real_run(self, *args, **kwargs)
program.LayerProgram.run = counted

model = make_tiny_target("qwen3", seed=5, dtype=torch.float32)
target = native(model)
drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=2, dtype=torch.float32)
init_drafter_weights(drafter, std=0.05, seed=3)
prompts = ragged_prompts(3, seed=8, vocab=48)
params = SamplingParams(max_new_tokens=40)
plain = SpecDecoder(target, None, SpecConfig(block_size=1)).generate(prompts, params)
spec = SpecDecoder(target, drafter, SpecConfig(block_size=6, adaptive=False, lookup=LookupConfig())).generate(
    prompts, params)
maps = open("/proc/self/maps").read() if sys.platform.startswith("linux") else ""
print(json.dumps({
    "plain": [r.token_ids for r in plain],
    "spec": [r.token_ids for r in spec],
    "taus": [t for r in spec for t in r.stats.acceptance_lengths],
    "kernel": kernels.kernel() is not None,
    "library_mapped": "/kernels/rows-" in maps,
    "program_runs": len(runs),
}))
"""


def _decode(env: dict[str, str]) -> dict:
    full = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=TESTS, env=full, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _lossless(out: dict) -> None:
    assert out["spec"] == out["plain"]
    assert all(len(t) == 40 for t in out["plain"])
    assert max(out["taus"]) > 1  # some proposals were accepted: the commit and roll-back paths ran


def test_without_the_c_library_decoding_is_lossless_and_loads_nothing() -> None:
    out = _decode({kernels.DISABLE_ENV: "0"})
    _lossless(out)
    assert not out["kernel"] and not out["library_mapped"] and out["program_runs"] == 0


def test_without_the_layer_loop_decoding_is_lossless_and_runs_no_program() -> None:
    if kernels.kernel() is None:
        pytest.skip("no C compiler here: the layer loop switch has nothing to switch off")
    out = _decode({program.ENV: "0"})
    _lossless(out)
    assert out["kernel"] and out["library_mapped"] and out["program_runs"] == 0


def test_with_everything_on_the_same_decoding_runs_the_program() -> None:
    """The control: the counters above do see the library and the program when they run."""
    if kernels.kernel() is None:
        pytest.skip("no C compiler here")
    out = _decode({})
    _lossless(out)
    assert out["kernel"] and out["library_mapped"] and out["program_runs"] > 0
