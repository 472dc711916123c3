"""Native Llama-family targets: same numbers as Hugging Face, static cache, ragged batches."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from support import native
from scripted import ScriptedDrafter
from support import ragged_prompts, reference_greedy

from blockspec.config import SamplingParams, SpecConfig
from blockspec.errors import ConfigError
from blockspec.dflash.drafter import init_drafter_weights, new_drafter_for_target
from blockspec.cpu.linear import (
    CPU_MATMULS,
    SMALL_ROWS,
    linear,
    onednn_available,
    onednn_takes,
    set_cpu_matmul,
)
from blockspec.targets.native import load_native_target, load_target, unsupported_reason
from blockspec.cpu import kernels
from blockspec.dflash.static_drafter import StaticDrafter
from blockspec.targets.slots import EMPTY
from blockspec.engine.decoder import SpecDecoder


def _with_random_biases(model):
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return model


FAMILIES = {
    "llama": lambda: make_tiny_target("llama", seed=1),
    "llama_tied": lambda: make_tiny_target("llama", seed=2, tie_word_embeddings=True),
    "qwen2_bias": lambda: _with_random_biases(make_tiny_target("qwen2", seed=3)),
    "qwen3": lambda: make_tiny_target("qwen3", seed=4),
    "qwen3_tied": lambda: make_tiny_target("qwen3", seed=5, tie_word_embeddings=True),
    "llama3_rope": lambda: make_tiny_target(
        "llama", seed=6, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_native_matches_hf_logits_and_features(family: str) -> None:
    model = FAMILIES[family]()
    target = native(model)
    ids = torch.randint(0, 48, (2, 40), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(40).expand(2, 40)
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    layers = (0, 2, 3)  # the last layer's feature is taken after the final norm, as HF returns it
    logits, feats = target.forward(ids, positions, target.new_cache(2), layers)
    want = torch.cat([ref.hidden_states[i + 1] for i in layers], dim=-1)
    torch.testing.assert_close(logits, ref.logits, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(feats, want, atol=1e-6, rtol=1e-6)
    # Incremental: prefill, a block, single tokens; each chunk at its absolute positions.
    cache = target.new_cache(2)
    chunks = [target.forward(ids[:, a:b], positions[:, a:b], cache)[0] for a, b in ((0, 23), (23, 39), (39, 40))]
    torch.testing.assert_close(torch.cat(chunks, dim=1), ref.logits, atol=1e-6, rtol=1e-6)
    # Batch 1, one token at a time, with each CPU kernel (small-rows keeps transposed single-token
    # copies of the weights; oneDNN needs none).
    for kind in [k for k in CPU_MATMULS if k not in ("native", "onednn") or onednn_available()]:
        previous = set_cpu_matmul(kind)
        try:
            target.net.prepare_single_token_weights(True)
            assert (target.net.single is None) == (kind in ("native", "onednn"))
            cache = target.new_cache(1)
            target.forward(ids[:1, :37], positions[:1, :37], cache)
            steps = [target.forward(ids[:1, i : i + 1], positions[:1, i : i + 1], cache)[0] for i in range(37, 40)]
            torch.testing.assert_close(torch.cat(steps, dim=1), ref.logits[:1, 37:], atol=1e-6, rtol=1e-6)
        finally:
            set_cpu_matmul(previous)


def test_rejected_tail_is_overwritten_without_cleanup() -> None:
    model = make_tiny_target("qwen3", seed=7)
    target = native(model)
    seq = torch.randint(0, 48, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(seq).logits
    cache = target.new_cache(1)
    target.forward(seq[:, :10], torch.arange(10)[None], cache)
    junk = torch.randint(0, 48, (1, 8), generator=torch.Generator().manual_seed(2))
    target.forward(junk, torch.arange(10, 18)[None], cache)  # a block the verifier rejects
    cache.reject(torch.zeros(1, 8, dtype=torch.bool))
    assert cache.lengths().tolist() == [10]
    logits, _ = target.forward(seq[:, 10:], torch.arange(10, 20)[None], cache)
    torch.testing.assert_close(logits, ref[:, 10:], atol=1e-6, rtol=1e-6)


def test_padding_stays_out_of_the_matmuls_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block whose rows verify different lengths (the rest padding) projects only the real
    tokens, and gives each row the logits, features and cache of its real tokens alone."""
    import blockspec.targets.native.backends as backends
    import blockspec.targets.native.llama as llama

    model = make_tiny_target("qwen3", seed=10)
    target = native(model)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 48, (3, 5), generator=g)
    block = torch.randint(0, 48, (3, 4), generator=g)
    lengths = [4, 2, 1]
    positions = (5 + torch.arange(4)).expand(3, 4)
    padded = positions.masked_fill(torch.arange(4)[None] >= torch.tensor(lengths)[:, None], EMPTY)
    rows: list[int] = []

    def counting(module, x, residual=None):
        rows.append(x.numel() // x.shape[-1])
        return linear(x, module.weight, module.bias, residual=residual)

    runs = {}
    for name, packing in (("packed", llama.padding_index), ("padded", lambda p: None)):
        monkeypatch.setattr(llama, "padding_index", packing)
        monkeypatch.setattr(backends, "project", counting)
        cache = target.new_cache(3)
        target.forward(prompt, torch.arange(5).expand(3, 5), cache)
        rows.clear()
        logits, feats = target.forward(block, padded, cache, (1, 3))
        projected = set(rows)
        cache.reject(padded != EMPTY)
        after, _ = target.forward(block[:, :1], torch.tensor(lengths)[:, None] + 5, cache)  # reads the cache
        runs[name] = (logits, feats, after, projected)
    assert runs["packed"][3] == {sum(lengths)} and runs["padded"][3] == {12}
    for row, n in enumerate(lengths):
        with torch.no_grad():
            ref = model(torch.cat([prompt[row], block[row, :n]])[None], output_hidden_states=True)
        for logits, feats, _, _ in runs.values():
            torch.testing.assert_close(logits[row, :n], ref.logits[0, 5:], atol=1e-6, rtol=1e-6)
            want = torch.cat([ref.hidden_states[2], ref.hidden_states[4]], dim=-1)[0, 5:]
            torch.testing.assert_close(feats[row, :n], want, atol=1e-6, rtol=1e-6)
        assert not runs["packed"][0][row, n:].any()  # padding: zero logits
    torch.testing.assert_close(runs["packed"][2], runs["padded"][2], atol=1e-6, rtol=1e-6)


def test_left_padded_ragged_prefill_matches_single_rows() -> None:
    model = make_tiny_target("llama", seed=8)
    target = native(model)
    a, b = [5, 6, 7, 8, 9, 10], [11, 12, 13]
    ids = torch.tensor([a, [0, 0, 0] + b])
    positions = torch.tensor([list(range(6)), [EMPTY] * 3 + list(range(3))])
    logits, _ = target.forward(ids, positions, target.new_cache(2), last_logits_only=True)
    for row, p in enumerate((a, b)):
        with torch.no_grad():
            ref = model(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(logits[row, -1], ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", CPU_MATMULS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, SMALL_ROWS, SMALL_ROWS + 1])
def test_cpu_linear_kernels_equal_f_linear(rows: int, kind: str) -> None:
    """Every CPU kernel of linear gives F.linear's numbers for any input layout, with or without
    bias, chained, and under autograd."""
    if kind in ("native", "onednn") and not onednn_available():
        pytest.skip("this PyTorch build has no oneDNN linear")  # the other kernels still run
    previous = set_cpu_matmul(kind)
    try:
        _check_linear(rows)
    finally:
        set_cpu_matmul(previous)


def test_cpu_matmul_choice_is_validated() -> None:
    with pytest.raises(ValueError, match="cpu matmul must be one of"):
        set_cpu_matmul("blas")


def test_onednn_linear_keeps_bfloat16_close() -> None:
    if not onednn_available():
        pytest.skip("this PyTorch build has no oneDNN linear")
    previous = set_cpu_matmul("onednn")
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(32, 64, generator=g).bfloat16()
        for rows in (3, 6):  # 2-4 rows too: MKL's small-row path is for fp32 only
            x = torch.randn(rows, 64, generator=g).bfloat16()
            got = linear(x, w)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), x.float() @ w.float().t(), atol=0.1, rtol=0.02)
        assert onednn_takes(3, torch.bfloat16, torch.bfloat16) and onednn_takes(6, torch.float32, torch.float32)
        assert not onednn_takes(3, torch.float32, torch.float32)
        assert not onednn_takes(3, torch.bfloat16, torch.float32)
    finally:
        set_cpu_matmul(previous)


def _check_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    x = torch.randn(rows, 24, generator=g)
    for inp in (x, x.t().contiguous().t(), x.reshape(1, rows, 24)):  # row-major, column-major, 3-D
        for b in (None, bias):
            got = linear(inp, weight, b)
            assert got.shape == (*inp.shape[:-1], 40)
            torch.testing.assert_close(got, torch.nn.functional.linear(inp, weight, b), atol=1e-5, rtol=1e-5)
    # Chained as in a layer (the first output is column-major) and differentiable.
    w2 = torch.randn(24, 40, generator=g, requires_grad=True)
    torch.testing.assert_close(linear(linear(x, weight), w2), x @ weight.t() @ w2.t(), atol=1e-4, rtol=1e-4)
    linear(x, w2.t()).sum().backward()
    assert w2.grad is not None and torch.isfinite(w2.grad).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_static_drafter_equals_module_forward(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """float64: PyTorch's attention with a mask; float32: the CPU attention kernel (visible keys
    per query), which must then be the only attention that runs."""
    if dtype == torch.float32 and kernels.kernel() is None:
        pytest.skip("no C compiler: the kernel path is not built here")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the static drafter fell back to PyTorch's attention")

    model = make_tiny_target("llama", seed=9)
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=2, dtype=dtype)
    init_drafter_weights(drafter, std=0.3, seed=1)  # large weights: attention really mixes
    static = StaticDrafter(drafter)
    g = torch.Generator().manual_seed(3)
    width = len(drafter.target_layer_ids) * 32
    feats = torch.randn(2, 7, width, generator=g, dtype=dtype)
    ctx_pos = torch.tensor([[EMPTY, EMPTY, 0, 1, 2, 3, 4], list(range(7))])
    dyn_cache, st_cache = drafter.new_cache(2), static.new_cache(2)
    start = torch.tensor([5, 7])
    for step, keep_n in enumerate(([2, 3], [1, 4])):
        q = 4 + 4 * step
        block_pos = start[:, None] + torch.arange(q)
        embeds = torch.randn(2, q, 32, generator=g, dtype=dtype)
        want = drafter(feats, ctx_pos, embeds, block_pos, dyn_cache)
        st_cache.reserve(int(block_pos.max()) + 1, 64)
        with monkeypatch.context() as patch:
            if dtype == torch.float32:  # PyTorch's functional module is shared: patched for this call only
                patch.setattr(torch.nn.functional, "scaled_dot_product_attention", refuse)
            got = static(feats, ctx_pos, embeds, block_pos, st_cache)
        # The drafter's RMSNorm computes in fp32 and the static path's small-row matmuls round
        # differently, so fp32 ulps show; a wrong mask or cache slot moves values by ~0.1.
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # The next context: this block's features, rejected tail marked EMPTY.
        keep = torch.arange(q)[None] < torch.tensor(keep_n)[:, None]
        feats = torch.randn(2, q, width, generator=g, dtype=dtype)
        ctx_pos = torch.where(keep, block_pos, torch.full_like(block_pos, EMPTY))
        start = start + torch.tensor(keep_n)


@pytest.mark.parametrize("window", [12, 3])
def test_static_drafter_with_a_sliding_window_equals_module_forward(monkeypatch: pytest.MonkeyPatch,
                                                                    window: int) -> None:
    """Bidirectional layers with a sliding window (the shipped SmolLM2 drafter's config) attend
    as the module does: through the CPU kernel, from each query's first key once the context
    outgrows the window (12); through PyTorch's attention under a mask where a block is wider
    than the window (3)."""
    if kernels.kernel() is None:
        pytest.skip("no C compiler: the kernel path is not built here")
    import torch.nn.functional as F

    model = make_tiny_target("llama", seed=9)
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=2, dtype=torch.float32)
    init_drafter_weights(drafter, std=0.3, seed=1)
    whole = new_drafter_for_target(model.config, mask_token_id=47, num_layers=2, dtype=torch.float32)
    whole.load_state_dict(drafter.state_dict())  # the same weights, no window
    for layer in drafter.layers:
        layer.self_attn.sliding_window = window
    static = StaticDrafter(drafter)
    assert not static.weights.plain and static.weights.reach == window == static.weights.window
    calls: list[int] = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    g = torch.Generator().manual_seed(3)
    width = len(drafter.target_layer_ids) * 32
    dyn_cache, st_cache, whole_cache = drafter.new_cache(1), static.new_cache(1), whole.new_cache(1)
    feats = torch.randn(1, 4, width, generator=g)
    ctx_pos = torch.arange(4)[None]
    start, q = 4, 4
    for step in range(6):  # blocks end at 8, 11, 14, ..., 23
        block_pos = start + torch.arange(q)[None]
        embeds = torch.randn(1, q, 32, generator=g)
        want = drafter(feats, ctx_pos, embeds, block_pos, dyn_cache)
        unwindowed = whole(feats, ctx_pos, embeds, block_pos, whole_cache)
        st_cache.reserve(int(block_pos.max()) + 1, 64)
        calls.clear()
        got = static(feats, ctx_pos, embeds, block_pos, st_cache)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert bool(calls) == (q > window), step  # the kernel whenever a block fits in the window
        outgrown = start + q > window
        assert outgrown == (not torch.allclose(got, unwindowed, atol=1e-3)), step  # the window really cuts
        feats = torch.randn(1, 3, width, generator=g)
        ctx_pos = block_pos[:, :3]  # three accepted
        start += 3


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_ragged_batch_equals_single_rows(family: str) -> None:
    """Rows accept different numbers of tokens per step; batched output == per-row output."""
    model = make_tiny_target(family, seed=10)
    target = native(model)
    prompts = ragged_prompts(4, seed=21, vocab=48)
    truth = [reference_greedy(model, p, 24) for p in prompts]
    drafter = ScriptedDrafter(model, prompts, truth, error_rate=0.25, seed=1)
    batched = SpecDecoder(target, drafter, SpecConfig(block_size=7)).generate(prompts, SamplingParams(max_new_tokens=24))
    assert [r.token_ids for r in batched] == truth
    assert len({tuple(r.stats.acceptance_lengths) for r in batched}) > 1  # really ragged
    for p, t in zip(prompts, truth):
        single_drafter = ScriptedDrafter(model, [p], [t], error_rate=0.25, seed=2)
        one = SpecDecoder(target, single_drafter, SpecConfig(block_size=7)).generate([p], SamplingParams(max_new_tokens=24))
        assert one[0].token_ids == t


def test_native_with_real_drafter_is_lossless_and_plain_decoding_too() -> None:
    model = make_tiny_target("qwen2", seed=11)
    target = native(model)
    prompts = ragged_prompts(3, seed=22, vocab=48)
    truth = [reference_greedy(model, p, 15) for p in prompts]
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=2, dtype=torch.float64)
    for block, d in ((16, drafter), (1, None)):
        results = SpecDecoder(target, d, SpecConfig(block_size=block)).generate(prompts, SamplingParams(max_new_tokens=15))
        assert [r.token_ids for r in results] == truth


def test_plain_decoding_rows_finishing_at_different_steps() -> None:
    """No drafter, per-row lengths: finished rows leave the batch mid-run (datagen's path)."""
    model = make_tiny_target("llama", seed=12)
    target = native(model)
    prompts = ragged_prompts(4, seed=23, vocab=48)
    lengths = [3, 9, 5, 12]
    params = [SamplingParams(max_new_tokens=n) for n in lengths]
    results = SpecDecoder(target, None, SpecConfig(block_size=1)).generate(prompts, params)
    assert [r.token_ids for r in results] == [reference_greedy(model, p, n) for p, n in zip(prompts, lengths)]


def test_seeded_sampling_reproducible_on_native() -> None:
    model = make_tiny_target("llama", seed=12)
    target = native(model)
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float64)
    dec = SpecDecoder(target, drafter, SpecConfig(block_size=4))
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=123)
    a = dec.generate([[1, 2, 3]], params)[0].token_ids
    b = dec.generate([[1, 2, 3]], params)[0].token_ids
    assert a == b and len(a) == 12


def test_unsupported_architectures_are_refused_with_a_reason(tmp_path) -> None:
    gemma = make_tiny_target("gemma3", seed=0)
    assert "gemma3" in unsupported_reason(gemma.config)
    with pytest.raises(ConfigError, match="backend='hf'"):
        load_native_target(gemma)
    assert unsupported_reason(make_tiny_target("llama").config) is None


def test_load_target_backends_from_directory(tmp_path) -> None:
    from conftest import build_tiny_tokenizer

    model = make_tiny_target("llama", seed=13, vocab_size=320).to(torch.float32)
    model.save_pretrained(tmp_path)
    build_tiny_tokenizer(320).save_pretrained(tmp_path)
    native, _ = load_target(tmp_path, backend="auto")
    hf, _ = load_target(tmp_path, backend="hf")
    assert type(native).__name__ == "NativeTarget" and type(hf).__name__ == "HFTarget"
    assert 2 in native.info.eos_token_ids  # the tokenizer's <|im_end|>
    ids = torch.tensor([[5, 6, 7, 8]])
    pos = torch.arange(4)[None]
    a, _ = native.forward(ids, pos, native.new_cache(1))
    b, _ = hf.forward(ids, pos, hf.new_cache(1))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError):
        load_target(tmp_path, backend="fast")


def test_static_drafter_sees_weights_updated_in_place() -> None:
    """Training evaluates the live drafter: an optimizer step (in-place) must reach the stacked
    q/k/v and gate/up weights of the static pass."""
    model = make_tiny_target("llama", seed=9)
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=2, dtype=torch.float64)
    init_drafter_weights(drafter, std=0.3, seed=1)
    static = StaticDrafter(drafter)
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(1, 5, len(drafter.target_layer_ids) * 32, generator=g, dtype=torch.float64)
    embeds = torch.randn(1, 4, 32, generator=g, dtype=torch.float64)
    ctx_pos, block_pos = torch.arange(5)[None], torch.arange(5, 9)[None]

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        cache = static.new_cache(1)
        cache.reserve(9, 16)
        return static(feats, ctx_pos, embeds, block_pos, cache), drafter(feats, ctx_pos, embeds, block_pos, drafter.new_cache(1))

    before, _ = both()
    with torch.no_grad():
        drafter.layers[1].self_attn.k_proj.weight.mul_(1.5)
        drafter.layers[0].mlp.up_proj.weight.add_(0.1)
    got, want = both()
    assert not torch.allclose(got, before)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
