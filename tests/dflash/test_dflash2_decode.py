"""Decoding with DFlash 2 drafters: the selector's greedy walk keeps the output token-identical to
plain greedy decoding (batch 1, ragged batches, the engine with joins, adaptive blocks, lookup,
the server); its sampled walk keeps the output distributed as the target's (chi-square), and the
test catches a rule that lets the walk's proposals through. The drafter's fast path equals the module."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target
from support import PROMPT, VOCAB, chi2_pvalue, exact_joint, ragged_prompts, reference_greedy, sample_many

from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash.batch import DecodeBatch
from blockspec.dflash.row import make_row
from blockspec.engine.decoder import SpecDecoder
from blockspec.dflash.drafter import DFLASH2, DFlashDrafter, new_drafter_for_target, save_drafter
from blockspec.dflash.lookup import LookupConfig
from blockspec.dflash.static_drafter import StaticDrafter
from blockspec.engine import Engine, EngineConfig
from blockspec.targets.hf import HFTarget
from blockspec.targets.native import load_native_target
from blockspec.targets.slots import EMPTY


def random_dflash2(model, *, seed: int = 0, top_k: int = 6, block_size: int = 8, layers: int = 2,
                   dtype: torch.dtype = torch.float64, scale: float = 1.0) -> DFlashDrafter:
    """A random DFlash 2 drafter for `model`, convolutions off the identity, a selector whose
    transitions outweigh the unary logits (scale), so its walk differs from the argmax."""
    drafter = new_drafter_for_target(model.config, mask_token_id=model.config.vocab_size - 1, num_layers=layers,
                                     block_size=block_size, architecture=DFLASH2, seed=seed, dtype=torch.float64,
                                     dflash2=dict(conv_group_size=8, selector_rank=8, selector_top_k=top_k))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(0.3 * torch.randn(conv.base_kernel.shape, generator=g, dtype=torch.float64))
                conv.kernel_projection.weight.normal_(0.0, 0.2, generator=g)
        for p in drafter.candidate_selector.parameters():
            p.normal_(0.0, scale, generator=g)
    return drafter.to(dtype).eval()


class _Ones(torch.nn.Module):
    """W h = 1 whatever h: the selector's transitions then depend on (predecessor, candidate) only."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_ones(*hidden.shape[:-1], self.rank)


def predictable(seed: int = 0):
    """A tiny Llama whose next token depends on the current token only (attention and MLP
    outputs zeroed), and that map: greedy text follows it."""
    model = make_tiny_target("llama", seed=seed, dtype=torch.float64)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        following = model(torch.arange(48)[:, None]).logits[:, -1].argmax(-1)  # [V]
    return model, following


def knowing_walker(model, following: torch.Tensor, *, top_k: int, wrong: float, seed: int = 0) -> DFlashDrafter:
    """A random DFlash 2 drafter whose selector knows the target's next-token map (wrong for a
    `wrong` share of predecessors): its walk proposes the target's continuation wherever that is
    among the drafter's (random) top-K candidates and the map is right, so steps accept a varying
    number of leading proposals, where the unary argmax alone is almost never right."""
    v = model.config.vocab_size
    drafter = random_dflash2(model, seed=seed, top_k=top_k)
    sel = drafter.candidate_selector
    g = torch.Generator().manual_seed(seed + 7)
    known = following.clone()
    bad = torch.rand(v, generator=g) < wrong
    known[bad] = torch.randint(0, v, (int(bad.sum()),), generator=g)
    with torch.no_grad():
        sel.predecessor_codebook = torch.nn.Parameter(torch.eye(v, dtype=torch.float64) * 50.0)
        sel.successor_codebook = torch.nn.Parameter(torch.zeros(v, v, dtype=torch.float64))
        sel.successor_codebook[known, torch.arange(v)] = 1.0  # transition(a, b) = 50 [b == known[a]]
    sel.hidden_projection = _Ones(v)
    return drafter


def plain(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    return [reference_greedy(model, p, max_new) for p in prompts]


# ---- the fast path equals the module ----------------------------------------------------------

@pytest.mark.parametrize("windows", [None, (5, None)], ids=["full", "sliding_and_full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_drafter_equals_the_module_forward(dtype: torch.dtype, windows: tuple | None) -> None:
    """StaticDrafter (the engine's path: static context cache, PyTorch loop with the
    convolutions; the C layer program does not take DFlash 2) gives the module's hidden states,
    over two passes on a padded ragged context; also with a sliding layer (a window shorter than
    the context) beside a full one."""
    model = make_tiny_target("llama", seed=3, dtype=torch.float32)
    drafter = random_dflash2(model, seed=2, dtype=dtype)
    for layer, window in zip(drafter.layers, windows or ()):
        layer.self_attn.sliding_window = window
    static = StaticDrafter(drafter)
    g = torch.Generator().manual_seed(0)
    width = len(drafter.target_layer_ids) * 32
    feats = torch.randn(2, 7, width, generator=g).to(dtype)
    ctx_pos = torch.tensor([[EMPTY, EMPTY, 0, 1, 2, 3, 4], list(range(7))])
    cache, dcache = static.new_cache(2), drafter.new_cache(2)
    start = torch.tensor([5, 7])
    with torch.inference_mode():
        for q, keep_n in ((4, [2, 3]), (8, [1, 4])):
            block_pos = start[:, None] + torch.arange(q)
            embeds = torch.randn(2, q, 32, generator=g).to(dtype)
            cache.reserve(int(block_pos.max()) + 1, 64)
            fast = static(feats, ctx_pos, embeds, block_pos, cache)
            slow = drafter(feats, ctx_pos, embeds, block_pos, dcache)
            tol = 1e-5 if dtype == torch.float32 else 0.05
            torch.testing.assert_close(fast.float(), slow.float(), atol=tol, rtol=tol)
            keep = torch.arange(q)[None] < torch.tensor(keep_n)[:, None]
            feats = torch.randn(2, q, width, generator=g).to(dtype)
            ctx_pos = torch.where(keep, block_pos, torch.full_like(block_pos, EMPTY))
            start = start + torch.tensor(keep_n)
    assert static.weights.program(static.weights.fused()) is None


# ---- greedy: token-identical to plain decoding ------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("backend", ["hf", "native"])
@pytest.mark.parametrize("block_size,batch", [(4, 1), (8, 3)])
def test_random_dflash2_greedy_equals_plain(family: str, backend: str, block_size: int, batch: int) -> None:
    model = make_tiny_target(family, seed=block_size + batch)
    drafter = random_dflash2(model, seed=batch)
    target = HFTarget(model) if backend == "hf" else load_native_target(model, dtype=None, eos_token_ids=())
    prompts = ragged_prompts(batch, seed=block_size * 7 + batch, vocab=48)
    dec = SpecDecoder(target, drafter, SpecConfig(block_size=block_size))
    assert [r.token_ids for r in dec.generate(prompts, SamplingParams(max_new_tokens=19))] == plain(model, prompts, 19)


@pytest.mark.parametrize("backend", ["hf", "native"])
@pytest.mark.parametrize("spec", ["fixed", "adaptive", "lookup"])
def test_selector_walk_greedy_equals_plain_and_is_what_gets_accepted(backend: str, spec: str) -> None:
    """A walk that knows most of the target's transitions: steps accept varying numbers of
    leading proposals (partial acceptance and rollback), in a ragged batch with one row ending
    early; the output is the target's own; the unary argmax alone would accept far less."""
    model, following = predictable(seed=1)
    target = HFTarget(model, eos_token_ids=()) if backend == "hf" else load_native_target(model, dtype=None,
                                                                                         eos_token_ids=())
    prompts = ragged_prompts(3, seed=5, vocab=48)
    lengths = [30, 11, 30]
    truth = [reference_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    config = {"fixed": SpecConfig(block_size=8), "adaptive": SpecConfig(block_size=8, adaptive=True),
              "lookup": SpecConfig(block_size=8, lookup=LookupConfig(min_ngram=2))}[spec]
    walker = knowing_walker(model, following, top_k=40, wrong=0.25)
    dec = SpecDecoder(target, walker, config)
    results = dec.generate(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])
    assert [r.token_ids for r in results] == truth
    accepted = [a for r in results for a in r.stats.acceptance_lengths]
    if spec != "adaptive":  # (adaptive steps may verify short blocks: their choice follows this machine's timings)
        assert len(set(accepted)) >= 3, accepted  # partial acceptance at several depths
    if spec == "fixed":
        assert sum(accepted) / len(accepted) > 2.0
        walker.candidate_selector.predecessor_codebook.data.zero_()  # no transitions: the unary argmax
        unary = SpecDecoder(target, walker, config).generate(prompts, [SamplingParams(max_new_tokens=n) for n in lengths])
        assert [r.token_ids for r in unary] == truth
        assert sum(r.stats.mean_tau for r in unary) < 0.8 * sum(r.stats.mean_tau for r in results)
    if spec == "lookup":
        assert sum(r.stats.lookup_steps for r in results) > 0


def test_lookup_continuations_lead_the_walk() -> None:
    """Where an n-gram lookup continuation replaces the first proposals, the walk goes on from
    its last token (not from the drafted ones it replaced)."""
    model, following = predictable(seed=4)
    drafter = random_dflash2(model, seed=3)
    target = load_native_target(model, dtype=None, eos_token_ids=())
    batch = DecodeBatch(target, drafter, max_block=6, lookup=LookupConfig(min_ngram=2, max_ngram=2))
    a = 5
    prompt = [a, int(following[a]), 9, 11, a]  # its first token is following[a]: "a following[a]" recurs
    batch.join([prompt], [make_row(0, len(prompt), SamplingParams(max_new_tokens=20), (), 6)])
    seen = {}
    walk = drafter.walk

    def spy(hidden, cands, anchor, pick, forced=None):
        seen["forced"] = forced
        ids, kept = walk(hidden, cands, anchor, pick, forced)
        seen["ids"] = ids
        return ids, kept

    drafter.walk = spy
    plan = batch.lookup_plan()[0]
    assert plan[:3] == [9, 11, a]
    batch.step(6)
    forced = seen["forced"][0].tolist()
    assert forced[: len(plan[:5])] == plan[:5] and all(t == -1 for t in forced[len(plan[:5]):])
    assert seen["ids"][0, : len(plan[:5])].tolist() == plan[:5]


def _joins(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Two requests start; the others join once the first has streamed a few tokens."""
    handles = [engine.submit(p, sp) for p, sp in zip(prompts[:2], params[:2])]
    got = 0
    for event in handles[0].events(timeout=60):
        got += len(event.token_ids)
        if got >= 5 or event.finished:
            break
    handles += [engine.submit(p, sp) for p, sp in zip(prompts[2:], params[2:])]
    return [h.result(timeout=120).token_ids for h in handles]


@pytest.mark.parametrize("options", [dict(), dict(adaptive=True, lookup=LookupConfig(min_ngram=2)),
                                     dict(adaptive=True, ragged_verify=True)],
                         ids=["fixed", "adaptive_lookup", "ragged_verify"])
def test_engine_with_joins_is_lossless(options: dict) -> None:
    model, following = predictable(seed=2)
    target = load_native_target(model, dtype=None, eos_token_ids=())
    prompts = [[i + 1] + p for i, p in enumerate(ragged_prompts(6, seed=9, vocab=48))]
    lengths = [24, 9, 24, 17, 24, 5]
    truth = [reference_greedy(model, p, n) for p, n in zip(prompts, lengths)]
    engine = Engine(target, knowing_walker(model, following, top_k=40, wrong=0.25, seed=1),
                    EngineConfig(SpecConfig(block_size=8, **options), max_batch=3))
    try:
        assert _joins(engine, prompts, [SamplingParams(max_new_tokens=n) for n in lengths]) == truth
        if not options:  # adaptive steps follow this machine's timings
            assert engine.metrics.mean_tau > 1.5
        assert engine.recorder.row_steps > engine.metrics.steps_total  # steps really shared rows
    finally:
        engine.stop()


def test_server_streams_a_dflash2_drafters_output(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`blockspec serve`'s app with a DFlash 2 drafter directory: concurrent greedy streams equal
    plain decoding, and a sampled request runs."""
    import transformers as tf
    from openai import OpenAI

    import blockspec.api
    from blockspec.server.app import create_app
    from blockspec.server.launch import BackgroundServer

    config = tf.AutoConfig.from_pretrained(str(tiny_model_dir))
    drafter = new_drafter_for_target(config, mask_token_id=3, num_layers=1, block_size=4, architecture=DFLASH2,
                                     dflash2=dict(selector_rank=16), seed=1)
    path = save_drafter(drafter, tmp_path / "dflash2")
    assert json.loads((path / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    pipe = blockspec.api.load(str(tiny_model_dir), str(path), dtype="float64", block_size=4)
    assert pipe.drafter.cfg.dflash2
    prompts = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(4)]
    expected = [pipe.generate(p, max_new_tokens=10, temperature=0.0, block_size=1).text for p in prompts]
    engine = Engine(pipe.target, pipe.drafter, EngineConfig(SpecConfig(block_size=4), max_batch=4), tokenizer=pipe.tokenizer)
    app = create_app(pipe, engine=engine, served_model_name="tiny")
    try:
        with BackgroundServer(app) as srv:
            client = OpenAI(base_url=f"{srv.url}/v1", api_key="EMPTY", max_retries=0, timeout=60)

            def one(i: int) -> str:
                stream = client.chat.completions.create(model="tiny", messages=prompts[i % 4], max_tokens=10,
                                                        temperature=0.0, stream=True)
                return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

            with ThreadPoolExecutor(max_workers=8) as pool:
                texts = list(pool.map(one, range(8)))
            assert texts == [expected[i % 4] for i in range(8)]
            sampled = client.chat.completions.create(model="tiny", messages=prompts[0], max_tokens=10,
                                                     temperature=0.9, top_p=0.9, seed=3)
            assert sampled.usage.completion_tokens >= 1
    finally:
        engine.stop()


# ---- sampled: the target's distribution ------------------------------------------------------

def _sampling_walker(model) -> DFlashDrafter:
    """Vocabulary 10, candidates 4: q_t is zero on 6 tokens, and the selector's transitions
    (large) make q_t depend strongly on the previous proposal."""
    return random_dflash2(model, seed=5, top_k=4, layers=1, scale=1.5)


@pytest.mark.parametrize("shape,mode", [
    (dict(temperature=1.0), "plain"), (dict(temperature=0.7, top_k=3), "plain"), (dict(temperature=1.3, top_p=0.8), "plain"),
    (dict(temperature=1.0), "lookup"), (dict(temperature=0.8, top_p=0.9), "trimmed"),
], ids=["temperature", "top_k", "top_p", "lookup", "trimmed_top_p"])
def test_sampled_walk_follows_the_target_distribution(shape: dict, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """q_t: the row's temperature, top-k and top-p shape the walk's scores over the K candidates
    (as they shape p), zero elsewhere, drawn with the clocks of the target's own draw at that
    output position; exact because a proposal is kept only where it equals the target's draw. With lookup, continuations replace the first proposals (one-hot q) and the
    walk goes on from them; trimmed: the verify length comes from the confidences."""
    model = make_tiny_target("llama", vocab_size=VOCAB, seed=1)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True, **shape)
    joint = exact_joint(model, sp)
    lookup = LookupConfig(min_ngram=1, max_ngram=2) if mode == "lookup" else None
    if mode == "trimmed":  # verify 1..3 of the drafted tokens, chosen from the confidences
        step = DecodeBatch.step
        monkeypatch.setattr(DecodeBatch, "step", lambda self, block, _=None: step(
            self, block, lambda conf, looked: [1 + int(c[0] * 997) % 3 for c in conf]))
    dec = SpecDecoder(HFTarget(model), _sampling_walker(model), SpecConfig(block_size=4, lookup=lookup))
    counts = sample_many(dec, sp, n=4000, batch=400)
    assert chi2_pvalue(counts.sum((1, 2)), joint.sum((1, 2))) > 1e-3
    assert chi2_pvalue(counts.sum(0), joint.sum(0)) > 1e-3  # (x2, x3): walked and verified
    assert chi2_pvalue(counts, joint) > 1e-3


def test_chi_square_detects_walk_proposals_let_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a rule that keeps the walk's proposals whatever the target samples (the
    output then follows the walk's q_t, zero on 6 of the 10 tokens) fails the test above; and
    with the right rule the walk's proposals are accepted often (the walk is coupled to the
    target's draws), so the test above does exercise accepted walk proposals."""
    import blockspec.dflash.batch as decode

    model = make_tiny_target("llama", vocab_size=VOCAB, seed=1)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=1.0)
    joint = exact_joint(model, sp)
    dec = SpecDecoder(HFTarget(model), _sampling_walker(model), SpecConfig(block_size=4))
    results = dec.generate([PROMPT] * 200, [sp.with_(seed=i) for i in range(200)])
    steps = [a for r in results for a in r.stats.acceptance_lengths]
    assert sum(a > 1 for a in steps) >= 5  # steps that accepted a walk proposal (about 1 in 20 here)

    def keep_all(proposals, best, limit=None):
        m = proposals.shape[1]
        return torch.full((proposals.shape[0],), m, dtype=torch.long), best[:, m]

    monkeypatch.setattr(decode, "accept_greedy", keep_all)
    counts = sample_many(dec, sp, n=4000, batch=400)
    assert chi2_pvalue(counts.sum(0), joint.sum(0)) < 1e-6


def test_sampled_walk_is_seeded_and_greedy_rows_beside_it_stay_exact() -> None:
    """A seed reproduces a sampled request, also with other block sizes or the adaptive policy
    (the target's keyed draws decide every token); a greedy row in the same batch (whose q is
    one-hot on the walk's best candidate) still gets plain greedy output."""
    model = make_tiny_target("llama", seed=2)
    dec = SpecDecoder(HFTarget(model), random_dflash2(model, seed=1), SpecConfig(block_size=4))
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1234)
    alone = dec.generate([[5, 6, 7]], sp)[0].token_ids
    assert dec.generate([[5, 6, 7]], sp)[0].token_ids == alone
    assert dec.generate([[5, 6, 7]], sp.with_(seed=99))[0].token_ids != alone
    for config in (SpecConfig(block_size=1), SpecConfig(block_size=8), SpecConfig(block_size=8, adaptive=True)):
        assert SpecDecoder(HFTarget(model), random_dflash2(model, seed=1), config).generate(
            [[5, 6, 7]], sp)[0].token_ids == alone  # the seed's text whatever the block size or policy
    mixed = dec.generate([[5, 6, 7], [1, 2], [9, 4, 4]], [sp, SamplingParams(max_new_tokens=16),
                                                          SamplingParams(max_new_tokens=9)])
    assert mixed[1].token_ids == reference_greedy(model, [1, 2], 16)
    assert mixed[2].token_ids == reference_greedy(model, [9, 4, 4], 9)
