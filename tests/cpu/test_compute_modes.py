"""The native target's compute modes (targets/native/backends.py): "exact" keeps the fp32 kernels'
bits; "int8" multiplies 8-bit activations by the integer weights (cpu/int8.py) and stays batch
invariant, so speculative decoding in it equals its own plain decoding; "auto" takes int8 only for
a model converted from a quantised GGUF file."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import kept_thread_count, ragged_prompts
from test_packed import _q4_model, needs_kernel, q4_model_dir

from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash.drafter import init_drafter_weights, new_drafter_for_target
from blockspec.engine.decoder import SpecDecoder
from blockspec.errors import ConfigError
from blockspec.targets.native import load_native_target
from blockspec.targets.native.backends import Int8Backend, KernelBackend, TorchBackend
from blockspec.targets.native.load import ZOO_MARKER, load_target, resolve_compute
from blockspec.targets.slots import EMPTY

native_load = importlib.import_module("blockspec.targets.native.load")

TESTS = Path(__file__).resolve().parents[1]


def _drafter(model, seed: int = 3):
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float32)
    init_drafter_weights(drafter, std=0.05, seed=seed)
    return drafter


def _decode(target, drafter, prompts, block: int, n: int = 16) -> list[list[int]]:
    cfg = SpecConfig(block_size=block, adaptive=False) if drafter is not None else SpecConfig(block_size=1)
    return [r.token_ids for r in SpecDecoder(target, drafter, cfg).generate(prompts, SamplingParams(max_new_tokens=n))]


@needs_kernel
def test_int8_mode_runs_integer_products_and_exact_mode_keeps_its_bits() -> None:
    model = _q4_model(seed=3)
    exact = load_native_target(model, dtype="float32", compute="exact")
    int8 = load_native_target(model, dtype="float32", compute="int8")
    unpacked = load_native_target(model, dtype="float32", pack_weights=False)
    assert (exact.compute, int8.compute) == ("exact", "int8")
    assert isinstance(exact.net.backend, KernelBackend) and not isinstance(exact.net.backend, Int8Backend)
    assert int8.compute_detail.startswith("int8 (") and exact.compute_detail == "exact (kernels)"
    ids = torch.tensor([[5, 9, 11, 2, 30, 7, 7, 1]])
    outs = [t.forward(ids, torch.arange(8)[None], t.new_cache(1, 32), (1, 3)) for t in (exact, int8, unpacked)]
    assert torch.equal(outs[0][0], outs[2][0]) and torch.equal(outs[0][1], outs[2][1])  # exact: the same bits
    assert not torch.equal(outs[1][0], outs[0][0])  # int8: other numbers, close ones
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=0.05 * float(outs[0][0].abs().max()), rtol=0)
    # the one-call layer loop runs the GGUF's own 4-bit levels as integer products, the head its 8-bit ones
    assert int8.net.backend.program.kinds() == [(20, 20, 20, 20)] * len(int8.net.layers)
    assert int8.net.backend.weight(int8.net.lm_head).bits == 8


def _logits(target, steps) -> list[torch.Tensor]:
    """Prefill then the given blocks: each pass's logits, every pass through `forward`."""
    cache = target.new_cache(3, capacity=48)
    return [target.forward(ids, pos, cache)[0] for ids, pos in steps]


@needs_kernel
@pytest.mark.parametrize("loop", ["program", "python"])
def test_int8_logits_are_batch_invariant(monkeypatch: pytest.MonkeyPatch, loop: str) -> None:
    """A token's logits have the same bits alone, in a verified block, in a ragged batch and on
    any thread split, through the one-call layer loop and the Python one."""
    if loop == "python":
        monkeypatch.setattr(KernelBackend, "run_program", lambda *args, **kwargs: None)
    target = load_native_target(_q4_model(seed=4), dtype="float32", compute="int8")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 48, (3, 9), generator=g)
    block = torch.randint(0, 48, (3, 5), generator=g)
    ppos = torch.arange(9)[None].expand(3, 9).contiguous()
    bpos = torch.arange(9, 14)[None].expand(3, 5).clone()
    bpos[1, 3:] = EMPTY  # ragged: row 1 verifies 3 tokens
    _, together = _logits(target, [(prompt, ppos), (block, bpos)])
    with kept_thread_count():
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for row in range(3):  # the row alone, one token at a time
                cache = target.new_cache(1, capacity=48)
                target.forward(prompt[row : row + 1], ppos[:1], cache)
                n = 3 if row == 1 else 5
                for i in range(n):
                    alone, _ = target.forward(block[row : row + 1, i : i + 1], bpos[row : row + 1, i : i + 1], cache)
                    assert torch.equal(alone[0, 0], together[row, i]), (threads, row, i)


@needs_kernel
def test_int8_layer_program_has_the_python_loops_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    target = load_native_target(_q4_model(seed=8), dtype="float32", compute="int8")
    g = torch.Generator().manual_seed(1)
    steps = [(torch.randint(0, 48, (3, 7), generator=g), torch.arange(7)[None].expand(3, 7).contiguous()),
             (torch.randint(0, 48, (3, 4), generator=g), torch.arange(7, 11)[None].expand(3, 4).contiguous())]
    runs = []
    for loop in ("program", "python"):
        if loop == "python":
            monkeypatch.setattr(KernelBackend, "run_program", lambda *args, **kwargs: None)
        cache = target.new_cache(3, capacity=32)
        runs.append([target.forward(ids, pos, cache, (1, 3)) for ids, pos in steps])
    assert target.net.backend.program is not None
    for (la, fa), (lb, fb) in zip(*runs):
        assert torch.equal(la, lb) and torch.equal(fa, fb)


@needs_kernel
def test_int8_prompt_runs_in_chunks_with_the_bits_of_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass of consecutive positions longer than the int8 mode's chunk runs chunk after chunk,
    each through the one-call layer program, and gives every logit, greedy id, feature and K/V
    entry the one pass gives; a prompt after some context too."""
    backends = importlib.import_module("blockspec.targets.native.backends")
    target = load_native_target(_q4_model(seed=9), dtype="float32", compute="int8")
    assert target.net.backend.prompt_chunk() == backends.PROMPT_CHUNK
    monkeypatch.setattr(backends, "PROMPT_CHUNK", 8)
    passes: list[int] = []
    layers = Int8Backend.layers
    monkeypatch.setattr(Int8Backend, "layers", lambda self, x, p, *a: passes.append(p.q) or layers(self, x, p, *a))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 48, (1, 37), generator=g)
    runs = {}
    for way in ("chunks", "one pass"):
        if way == "one pass":
            monkeypatch.setattr(Int8Backend, "prompt_chunk", lambda self: 0)
        passes.clear()
        cache = target.new_cache(1, capacity=40)
        first = target.forward(ids[:, :21], torch.arange(21)[None], cache, (1, 3))
        then = target.forward_greedy(ids[:, 21:], torch.arange(21, 37)[None], cache, (1,), last_logits_only=True)
        k, v = cache.layer(2)
        runs[way] = (first, then, k[:, :, :37].clone(), v[:, :, :37].clone(), list(passes))
        if way == "chunks":
            assert target.net.backend.program is not None and target.net.backend.program.fits()
    (first, then, k, v, passes_c), (first1, then1, k1, v1, passes_1) = runs["chunks"], runs["one pass"]
    assert passes_c == [8, 8, 5, 8, 8] and passes_1 == [21, 16]
    assert torch.equal(first[0], first1[0]) and torch.equal(first[1], first1[1])  # logits of every position, features
    assert then[0].shape == (1, 1) and torch.equal(then[0], then1[0]) and torch.equal(then[1], then1[1])
    assert torch.equal(k, k1) and torch.equal(v, v1)
    # not consecutive (a batch, padding): one pass
    passes.clear()
    monkeypatch.setattr(Int8Backend, "prompt_chunk", lambda self: 8)
    pos = torch.arange(21)[None].repeat(2, 1)
    pos[1, :3] = EMPTY
    target.forward(ids[:, :21].repeat(2, 1), pos, target.new_cache(2, capacity=24))
    assert passes == [21]


@needs_kernel
@pytest.mark.parametrize("gguf", [True, False])
def test_int8_dflash_equals_int8_plain_decoding_on_ragged_batches(gguf: bool) -> None:
    """Lossless within the mode, for a GGUF model and for an fp32 one whose weights the mode
    quantises to 8 bits."""
    if gguf:
        model = _q4_model(seed=5)
    else:
        from conftest import make_tiny_target

        model = make_tiny_target("qwen3", seed=5, dtype=torch.float32, hidden_size=64, intermediate_size=96,
                                 num_attention_heads=4, num_key_value_heads=2)
    target = load_native_target(model, dtype="float32", compute="int8")
    assert all(not w.exact for w in target.net.backend.weights.values()) != gguf
    prompts = ragged_prompts(4, seed=6, vocab=48)
    plain = _decode(target, None, prompts, 1, n=20)
    for block in (4, 8):
        assert _decode(target, _drafter(model), prompts, block, n=20) == plain
    exact_plain = _decode(load_native_target(model, dtype="float32"), None, prompts, 1, n=20)
    agree = sum(a == b for p, q in zip(plain, exact_plain) for a, b in zip(p, q))
    assert agree > 0  # reported, not required equal: the modes differ in their numbers


# Decodes ragged prompts plainly in int8 on the GGUF model; prints the tokens and the path.
SCRIPT = r"""
import json, torch
from test_packed import _q4_model
from support import ragged_prompts
from blockspec.config import SamplingParams, SpecConfig
from blockspec.cpu.int8 import int8_path
from blockspec.engine.decoder import SpecDecoder
from blockspec.targets.native import load_native_target
target = load_native_target(_q4_model(seed=7), dtype="float32", compute="int8")
prompts = ragged_prompts(3, seed=9, vocab=48)
out = SpecDecoder(target, None, SpecConfig(block_size=1)).generate(prompts, SamplingParams(max_new_tokens=16))
print(json.dumps({"tokens": [r.token_ids for r in out], "path": int8_path(), "detail": target.compute_detail}))
"""


@needs_kernel
def test_without_kernels_the_emulation_gives_the_same_tokens() -> None:
    def run(env_kernels: str) -> dict:
        env = {**os.environ, "BLOCKSPEC_CPU_KERNELS": env_kernels,
               "PYTHONPATH": os.pathsep.join([str(TESTS / "cpu"), str(TESTS), str(TESTS.parent)])}
        proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    emulated, native = run("0"), run("1")
    assert emulated["path"] == "pytorch" and native["path"] != "pytorch"
    assert emulated["detail"] == "int8 (pytorch)"
    assert emulated["tokens"] == native["tokens"]


def test_auto_is_int8_only_for_an_fp32_cpu_model_from_a_gguf_file(monkeypatch) -> None:
    f32 = torch.float32
    assert resolve_compute("auto", from_gguf=True, packed=True, dtype=f32, device="cpu", int8_units="vnni") == "int8"
    for slower in ("avx2", "c", "pytorch"):  # int8 not shown faster there
        assert resolve_compute("auto", from_gguf=True, packed=True, dtype=f32, device="cpu", int8_units=slower) == "exact"
    monkeypatch.setattr(native_load, "AUTO_INT8_FOR_GGUF", False)
    assert resolve_compute("auto", from_gguf=True, packed=True, dtype=f32, device="cpu", int8_units="vnni") == "exact"
    monkeypatch.setattr(native_load, "AUTO_INT8_FOR_GGUF", True)
    monkeypatch.setattr(native_load, "int8_path", lambda: "vnni")
    assert resolve_compute("auto", from_gguf=True, packed=True, dtype=f32, device="cpu") == "int8"
    assert resolve_compute("auto", from_gguf=False, packed=True, dtype=f32, device="cpu") == "exact"
    assert resolve_compute("auto", from_gguf=True, packed=False, dtype=f32, device="cpu") == "exact"
    assert resolve_compute("auto", from_gguf=True, packed=True, dtype=torch.bfloat16, device="cpu") == "exact"
    assert resolve_compute("auto", from_gguf=True, packed=True, dtype=f32, device="cuda") == "exact"
    assert resolve_compute("int8", from_gguf=False, packed=False, dtype=f32, device="cpu") == "int8"
    with pytest.raises(ConfigError, match="compute must be one of"):
        resolve_compute("fast", from_gguf=True, packed=True, dtype=f32, device="cpu")


@needs_kernel
def test_auto_loads_a_zoo_conversion_in_int8_and_a_checkpoint_exactly(tmp_path, tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setattr(native_load, "int8_path", lambda: "vnni")  # whatever this CPU's units
    model_dir = q4_model_dir(tiny_model_dir, tmp_path / "q4_1")
    target, _ = load_target(model_dir, compute="auto")
    assert target.compute == "exact"  # not marked as converted from a GGUF file
    (model_dir / ZOO_MARKER).write_text("{}")
    target, _ = load_target(model_dir, compute="auto")
    assert target.compute == "int8"
    assert load_target(model_dir)[0].compute == "exact"  # the library's default stays exact
    with pytest.raises(ConfigError, match="compute must be one of"):
        load_target(model_dir, compute="int4")
    import blockspec

    with pytest.raises(ConfigError, match="compute must be one of"):
        blockspec.load(str(model_dir), "none", compute="int4")
    with pytest.raises(ConfigError, match="needs the native backend"):
        load_target(model_dir, backend="hf", compute="int8")
    with pytest.raises(ConfigError, match="fp32 models on a CPU"):
        load_native_target(model_dir, dtype="bfloat16", compute="int8")


def test_a_model_without_kernels_for_its_dtype_runs_pytorch() -> None:
    from conftest import make_tiny_target

    target = load_native_target(make_tiny_target("llama", seed=1), dtype=None)  # float64
    assert isinstance(target.net.backend, TorchBackend) and not isinstance(target.net.backend, KernelBackend)
    assert target.compute_detail == "exact (pytorch)"
