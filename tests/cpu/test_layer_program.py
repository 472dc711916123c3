"""The native target's layer loop as one kernel call (cpu/program.py): the Python loop's bits."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from test_packed import gguf_round_trip, needs_kernel
from support import draft_passes
from support import ragged_prompts

from blockspec.config import SamplingParams, SpecConfig
from blockspec.cpu import kernels
from blockspec.dflash.drafter import init_drafter_weights, new_drafter_for_target
from blockspec.targets.native import load_native_target
from blockspec.dflash.static_drafter import StaticDrafter, StaticWeights
from blockspec.targets.native.backends import KernelBackend
from blockspec.engine.decoder import SpecDecoder

pytestmark = needs_kernel


def _model(family: str, seed: int, gguf: bool = False):
    model = make_tiny_target(family, seed=seed, dtype=torch.float32, hidden_size=64, intermediate_size=96,
                             num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, vocab_size=200)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.3)  # Qwen2's q/k/v biases: nonzero, so a misplaced one shows
            elif gguf and p.dim() == 2 and "proj" in name:
                p.copy_(gguf_round_trip(p))
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _python_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(KernelBackend, "run_program", lambda *args, **kwargs: None)


def _passes(target, layer_ids: tuple[int, ...]) -> list:
    """A 9-token prefill, then blocks of 1, 4 and 3 tokens for 3 rows: logits, features and the
    caches' contents after each."""
    g = torch.Generator().manual_seed(0)
    cache = target.new_cache(3, capacity=48)
    prompts = torch.randint(0, 200, (3, 9), generator=g)
    out = [target.forward(prompts, torch.arange(9)[None].expand(3, 9).contiguous(), cache, layer_ids)]
    start = 9
    for q in (1, 4, 3):
        ids = torch.randint(0, 200, (3, q), generator=g)
        pos = torch.arange(start, start + q)[None].expand(3, q).contiguous()
        out.append(target.forward(ids, pos, cache, layer_ids))
        out.append(target.forward_greedy(ids, pos, cache, layer_ids))
        start += q
    keys = [k.clone() for k in cache.store.keys]
    return out, keys


@pytest.mark.parametrize("family,gguf,dtype", [("llama", False, "float32"), ("llama", True, "float32"),
                                               ("qwen2", False, "float32"), ("qwen3", False, "float32"),
                                               ("llama", True, "bfloat16"), ("qwen2", False, "bfloat16")])
def test_one_call_layer_loop_has_the_python_loops_bits(family: str, gguf: bool, dtype: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(family, seed=5, gguf=gguf)
    layer_ids = (0, 2, 3)  # the first layer, a middle one and the last (taken after the final norm)
    fast = load_native_target(model, dtype=dtype, eos_token_ids=())
    got, got_keys = _passes(fast, layer_ids)
    program = fast.net.backend.program
    assert program is not None, "the one-call loop did not run"
    assert program.kinds() == [(4, 4, 4, 4) if gguf else (0, 0, 0, 0)] * 4  # bf16: packed up to 4 rows
    slow = load_native_target(model, dtype=dtype, eos_token_ids=())
    _python_loop(monkeypatch)
    want, want_keys = _passes(slow, layer_ids)
    assert slow.net.backend.program is None
    for (a, fa), (b, fb) in zip(got, want):
        assert torch.equal(a, b)
        assert torch.equal(fa, fb)
    assert all(torch.equal(a, b) for a, b in zip(got_keys, want_keys))


def _alternating_growing_passes(target) -> list:
    """Two caches of 2 rows, stepped in turn, each from a capacity of 4 slots, so their stores grow
    (new storage) between passes of one program: logits, then every key of both stores."""
    g = torch.Generator().manual_seed(1)
    caches = [target.new_cache(2, capacity=4), target.new_cache(2, capacity=4)]
    out, start = [], [0, 0]
    for q in (6, 1, 3, 1, 20, 2):
        for i, cache in enumerate(caches):
            ids = torch.randint(0, 200, (2, q), generator=g)
            pos = torch.arange(start[i], start[i] + q)[None].expand(2, q).contiguous()
            out.append(target.forward(ids, pos, cache, (1,))[0])
            start[i] += q
    return out + [k.clone() for cache in caches for k in cache.store.keys]


def test_the_program_follows_caches_that_grow_and_take_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    # the program keeps each store's layer pointers: a store that grew has new ones
    model = _model("llama", seed=7, gguf=True)
    fast = load_native_target(model, dtype="float32", eos_token_ids=())
    got = _alternating_growing_passes(fast)
    assert fast.net.backend.program is not None
    slow = load_native_target(model, dtype="float32", eos_token_ids=())
    _python_loop(monkeypatch)
    want = _alternating_growing_passes(slow)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_threads_sharing_a_program_keep_their_own_scratch() -> None:
    # the program keeps its kernel's scratch tensors per thread: two threads stepping their own
    # caches through one program at once get what one thread gets alone
    from concurrent.futures import ThreadPoolExecutor

    target = load_native_target(_model("llama", seed=8, gguf=True), dtype="float32", eos_token_ids=())
    alone = _alternating_growing_passes(target)
    assert target.net.backend.program is not None
    with ThreadPoolExecutor(2) as pool:
        runs = [f.result() for f in [pool.submit(_alternating_growing_passes, target) for _ in range(4)]]
    assert all(len(r) == len(alone) and all(torch.equal(a, b) for a, b in zip(r, alone)) for r in runs)
    assert len(target.net.backend.program._scratches) >= 2


def test_scratch_keeps_the_most_recently_used_shapes_and_not_large_ones() -> None:
    # a lone row's verify passes come in many widths beside the plain step's: the plain step's
    # scratch set, used between every two of them, must not be pushed out by them
    import threading

    from blockspec.cpu.program import SCRATCH_KEEP_BYTES, SCRATCH_SHAPES

    target = load_native_target(_model("llama", seed=8, gguf=True), dtype="float32", eos_token_ids=())
    _alternating_growing_passes(target)
    program = target.net.backend.program
    assert program is not None

    def scratch(q: int) -> tuple:
        return program._scratch(torch.float32, 0, q, 1, q, 64, 128, 4, 2, 16, 96)

    plain = scratch(1)
    for q in range(2, 2 + 2 * SCRATCH_SHAPES):
        assert scratch(q) is scratch(q)  # kept while recent
        assert scratch(1) is plain  # the plain step's set survives every other shape
    assert len(program._scratches[threading.get_ident()]) == SCRATCH_SHAPES  # bounded
    big = SCRATCH_KEEP_BYTES // (4 * 64) + 1  # rows whose first tensor alone passes the bound
    assert scratch(big) is not scratch(big)  # allocated for its pass, not kept


def test_environment_keeps_the_python_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("llama", seed=6)
    ids, pos = torch.tensor([[3, 1, 4, 1, 5]]), torch.arange(5)[None]
    monkeypatch.setenv("BLOCKSPEC_LAYER_LOOP", "0")
    off = load_native_target(model, dtype="float32", eos_token_ids=())
    want, _ = off.forward(ids, pos, off.new_cache(1, 16))
    assert off.net.backend.program is None
    monkeypatch.setenv("BLOCKSPEC_LAYER_LOOP", "1")
    on = load_native_target(model, dtype="float32", eos_token_ids=())
    got, _ = on.forward(ids, pos, on.new_cache(1, 16))
    assert on.net.backend.program is not None and torch.equal(got, want)


def test_a_weight_changed_after_the_first_forward_is_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("llama", seed=6)
    target = load_native_target(model, dtype="float32", eos_token_ids=())
    ids, pos = torch.tensor([[3, 1, 4, 1, 5]]), torch.arange(5)[None]
    before, _ = target.forward(ids, pos, target.new_cache(1, 16))
    first = target.net.backend.program
    with torch.no_grad():
        target.net.layers[1].down.weight.mul_(-2.0)  # in place: same tensor, new version
        target.net.layers[2].input_norm.add_(0.5)
    after, _ = target.forward(ids, pos, target.new_cache(1, 16))
    assert target.net.backend.program is not first and not torch.equal(before, after)
    _python_loop(monkeypatch)
    want, _ = target.forward(ids, pos, target.new_cache(1, 16))
    assert torch.equal(after, want)


def test_greedy_dflash_through_the_one_call_loop_equals_plain_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("qwen3", seed=7, gguf=False)
    target = load_native_target(model, dtype="float32", eos_token_ids=())
    prompts = ragged_prompts(3, seed=2, vocab=200)
    drafter = new_drafter_for_target(model.config, mask_token_id=199, num_layers=1, dtype=torch.float32)
    got = SpecDecoder(target, drafter, SpecConfig(block_size=6)).generate(prompts, SamplingParams(max_new_tokens=14))
    assert target.net.backend.program is not None
    _python_loop(monkeypatch)
    plain = load_native_target(model, dtype="float32", eos_token_ids=())
    truth = SpecDecoder(plain, None, SpecConfig(block_size=1)).generate(prompts, SamplingParams(max_new_tokens=14))
    assert [r.token_ids for r in got] == [r.token_ids for r in truth]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafter_pass_as_one_call_has_the_python_loops_bits(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two draft passes over a padded context whose last slot the block overlaps: outputs and
    the context cache, with and without the one-call loop."""
    model = make_tiny_target("llama", seed=9, dtype=torch.float32)
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=2, dtype=dtype)
    init_drafter_weights(drafter, std=0.3, seed=1)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    kernel = kernels.kernel()
    name = "layers" if dtype == torch.float32 else "layers_bf16"
    calls = []
    real = getattr(kernel, name)
    monkeypatch.setattr(kernel, name, lambda *args: calls.append(1) or real(*args))
    runs = {}
    for one_call in (True, False):
        static = StaticDrafter(drafter)
        if not one_call:
            monkeypatch.setattr(StaticWeights, "program", lambda *args: None)
        with torch.inference_mode():
            outs, cache = draft_passes(static, dtype)
        # up to 12 context rows and 16 block rows: within the kernel's rows on AVX-512 (an AVX2
        # build takes 8 fp32 rows and runs the Python loop here)
        takes = kernels.max_rows(dtype, exact=False) >= 28
        assert len(calls) == (2 if one_call and takes else 0), "the one-call loop did not run"
        calls.clear()
        runs[one_call] = (outs, [t.clone() for i in range(2) for t in cache.layer(i)])
    for a, b in zip(runs[True][0], runs[False][0]):
        assert torch.equal(a, b)
    for a, b in zip(runs[True][1], runs[False][1]):
        assert torch.equal(a[:, :, :20], b[:, :, :20])  # the slots written (the scratch slot aside)


def test_silu_mul_kernel_is_pytorchs_activation_and_batch_invariant() -> None:
    g = torch.Generator().manual_seed(0)
    for inter in (16, 96, 37):  # a tail that is not a whole vector
        gate_up = torch.randn(5, 2 * inter, generator=g) * 4
        gate_up[0, :6] = torch.tensor([0.0, -0.0, 80.0, -80.0, 1e-30, -1e-30])
        gate_up[1, :4] = torch.tensor([200.0, -200.0, 1e4, -1e4])
        got = kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate.double()) * up.double()
        assert torch.allclose(got.double(), want, rtol=2e-6, atol=1e-30)
        for r in range(5):  # a row alone gets the bits it gets among others
            assert torch.equal(kernels.silu_mul(gate_up[r : r + 1].clone()), got[r : r + 1])
        # bf16: silu rounded to bf16, then the product rounded, as PyTorch's bf16 operators
        hb = gate_up.bfloat16()
        gate, up = hb.chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
        got = kernels.silu_mul(hb)
        assert got.dtype == torch.bfloat16
        assert (got.float() - want.float()).abs().le(want.float().abs() * 2**-7).all()  # at most a bf16 ulp apart
        assert (got == want).float().mean() > 0.98
    assert kernels.silu_mul(torch.randn(2, 8, dtype=torch.float64)) is None  # the caller's operators


def test_a_program_stops_fitting_when_a_weight_is_replaced_or_given_new_storage() -> None:
    """`fits`: a parameter object replaced in its module, or its storage swapped (`.data = ...`,
    as `module.to()` does), means the table's pointers are stale; putting it back fits again."""
    target = load_native_target(_model("llama", seed=6), dtype="float32", eos_token_ids=())
    target.forward(torch.tensor([[3, 1, 4]]), torch.arange(3)[None], target.new_cache(1, 16))
    program = target.net.backend.program
    assert program is not None and program.fits()
    owner, name, weight = next(w for w in program.watched if w[0] is not None)
    owner[name] = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)
    assert not program.fits()
    owner[name] = weight
    assert program.fits()
    weight.data = weight.data.clone()
    assert not program.fits()


def test_a_generation_runs_on_the_weights_it_began_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """The program checks the weights at a cache's first pass only (a prompt's prefill). A weight
    given new storage during a generation is read at the next prompt's; until then the table reads
    the storage it was built on, which stays alive though its parameter let it go."""
    import gc

    target = load_native_target(_model("llama", seed=6), dtype="float32", eos_token_ids=())
    twin = load_native_target(_model("llama", seed=6), dtype="float32", eos_token_ids=())
    ids, pos = torch.tensor([[3, 1, 4, 1, 5]]), torch.arange(5)[None]
    cache, twin_cache = target.new_cache(1, 16), twin.new_cache(1, 16)
    target.forward(ids, pos, cache)
    twin.forward(ids, pos, twin_cache)
    first = target.net.backend.program
    assert first is not None
    weight = target.net.layers[1].down.weight
    with torch.no_grad():
        weight.data = weight.data.clone() * -2.0  # new storage; the old one's last owner is the table's view
    gc.collect()
    step, step_pos = torch.tensor([[9, 2]]), torch.arange(5, 7)[None]
    mid, _ = target.forward(step, step_pos, cache)
    want, _ = twin.forward(step, step_pos, twin_cache)
    assert target.net.backend.program is first and torch.equal(mid, want)  # the weights it began with

    after, _ = target.forward(ids, pos, target.new_cache(1, 16))  # the next prompt reads the new weight
    assert target.net.backend.program is not first
    unchanged, _ = twin.forward(ids, pos, twin.new_cache(1, 16))
    assert not torch.equal(after, unchanged)
    _python_loop(monkeypatch)
    loop, _ = target.forward(ids, pos, target.new_cache(1, 16))
    assert torch.equal(after, loop)


def test_a_drafters_weights_are_checked_at_its_rows_first_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft pass reads the drafter's weights through their check (`StaticWeights.read`) at a
    cache's first pass and after rows joined it; passes that continue its rows take the last
    read. A weight changed between generations is read by the next one."""
    model = make_tiny_target("llama", seed=9, dtype=torch.float32)
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=2, dtype=torch.float32)
    init_drafter_weights(drafter, std=0.3, seed=1)
    static = StaticDrafter(drafter)
    checks = []
    real = StaticWeights._every_key
    monkeypatch.setattr(StaticWeights, "_every_key", lambda self: checks.append(1) or real(self))
    with torch.inference_mode():
        before, cache = draft_passes(static, torch.float32)  # two passes over one cache
    assert len(checks) == 1 and cache.checked
    cache.merge(cache.spawn(1))  # a row joins: the next pass checks again
    assert not cache.checked
    with torch.no_grad():
        drafter.fc.weight.mul_(-1.0)
    with torch.inference_mode():
        after, _ = draft_passes(static, torch.float32)
        fresh, _ = draft_passes(StaticDrafter(drafter), torch.float32)
    assert len(checks) == 3
    assert not torch.equal(before[0], after[0])
    for a, b in zip(after, fresh):
        assert torch.equal(a, b)


def test_a_prefill_the_program_does_not_take_still_checks_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache's first pass checks the weights whichever path it runs: after a weight changed, a
    padded prefill (the Python loop's) is followed by decoding steps through the program on the
    new weight, not by the program built on the old one."""
    target = load_native_target(_model("llama", seed=6), dtype="float32", eos_token_ids=())
    ids, pos = torch.tensor([[3, 1, 4, 1, 5]]), torch.arange(5)[None]
    target.forward(ids, pos, target.new_cache(1, 16))
    first = target.net.backend.program
    assert first is not None
    with torch.no_grad():
        target.net.layers[2].gate_up.weight.mul_(-1.5)
    padded_ids = torch.tensor([[0, 0, 7, 2, 9], [3, 1, 4, 1, 5]])
    padded_pos = torch.tensor([[-1, -1, 0, 1, 2], list(range(5))])
    step_ids, step_pos = torch.tensor([[8], [6]]), torch.tensor([[3], [5]])

    def run() -> torch.Tensor:
        cache = target.new_cache(2, 16)
        target.forward(padded_ids, padded_pos, cache)
        return target.forward(step_ids, step_pos, cache)[0]

    got = run()
    assert target.net.backend.program is not None and target.net.backend.program is not first
    _python_loop(monkeypatch)
    assert torch.equal(got, run())
