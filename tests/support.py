"""Helpers shared by tests in several folders: reference decoding, prompts, small builders."""

from __future__ import annotations

import contextlib
import io
import itertools
import subprocess

import pytest
import torch
from conftest import make_tiny_target
from scripted import OracleDrafter  # noqa: F401  (the engine tests' double, beside the others)
from scipy.stats import chisquare

from blockspec.config import SamplingParams
from blockspec.engine.decoder import SpecDecoder
from blockspec.dflash.sampling import probabilities
from blockspec.dflash.static_drafter import StaticDrafter
from blockspec.engine import Engine
from blockspec.targets.hf import HFTarget
from blockspec.targets.native import load_native_target
from blockspec.targets.slots import EMPTY
from blockspec.train.data import Prompt


class CharTokenizer:
    """Enough of a tokenizer for datagen: a chat template and ids from characters."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **_):
        return " | ".join(m["content"] for m in messages) + " >"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2 + (ord(c) % 60) for c in text]}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`blockspec ARGS` run in this process (`cli.main`), its stdout and stderr captured: what a
    subprocess would return, without a fresh interpreter importing torch for every call. Tests of
    the console entry point itself (exit codes, no traceback) start real processes instead."""
    from blockspec.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return subprocess.CompletedProcess(["blockspec", *args], code, out.getvalue(), err.getvalue())


@contextlib.contextmanager
def kept_thread_count():
    """Yields torch's thread count and restores it on leaving, whatever the block set it to
    (a test that tries several thread counts, failing or not, leaves the next test's alone)."""
    before = torch.get_num_threads()
    try:
        yield before
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: on a small shared CPU two threads fighting over the cores
    make tiny models several times slower. Use with `pytestmark = pytest.mark.usefixtures(...)`."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def predictable_target(seed: int = 0) -> HFTarget:
    """A tiny Llama whose next token depends on the current token only (attention and MLP
    outputs zeroed): greedy text follows a fixed token map, which a drafter can learn fast."""
    model = make_tiny_target("llama", seed=seed, dtype=torch.float32, vocab_size=64, hidden_size=32,
                             intermediate_size=64, num_hidden_layers=4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return HFTarget(model, eos_token_ids=())


def prompts(n: int, start: int = 0) -> list[Prompt]:
    return [Prompt(f"p{i}", ({"role": "user", "content": f"q{i * 37 % 101} x{i}"},)) for i in range(start, start + n)]


def draft_passes(static: StaticDrafter, dtype: torch.dtype) -> tuple[list[torch.Tensor], object]:
    """Two draft passes (blocks of 4, then 8) for 2 rows over a padded context whose last slot
    row 1's block overlaps, the second pass's context being the first's accepted prefix: the
    passes' outputs and the cache."""
    g = torch.Generator().manual_seed(3)
    width = len(static.target_layer_ids) * 32
    feats = torch.randn(2, 7, width, generator=g).to(dtype)
    ctx_pos = torch.tensor([[EMPTY, EMPTY, 0, 1, 2, 3, 4], list(range(7))])
    cache = static.new_cache(2)
    start = torch.tensor([5, 6])  # row 1's block starts on its last context slot
    outs = []
    for step, keep_n in enumerate(([2, 3], [1, 4])):
        q = 4 + 4 * step
        block_pos = start[:, None] + torch.arange(q)
        embeds = torch.randn(2, q, 32, generator=g).to(dtype)
        cache.reserve(int(block_pos.max()) + 1, 64)
        outs.append(static(feats, ctx_pos, embeds, block_pos, cache))
        keep = torch.arange(q)[None] < torch.tensor(keep_n)[:, None]
        feats = torch.randn(2, q, width, generator=g).to(dtype)
        ctx_pos = torch.where(keep, block_pos, torch.full_like(block_pos, EMPTY))
        start = start + torch.tensor(keep_n)
    return outs, cache


def native(model):
    """A native copy of a tiny HF model; eos off, as HFTarget(model) has it in the reference tests."""
    return load_native_target(model, dtype=None, eos_token_ids=())


def reference_greedy(model, prompt: list[int], max_new: int, stop_ids: set[int] = frozenset()) -> list[int]:
    """Plain greedy decoding with the Hugging Face model alone (full recompute, no cache)."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids])).logits[0, -1]
            t = int(logits.argmax())
            out.append(t)
            ids.append(t)
            if t in stop_ids:
                break
    return out


def reference_biased_greedy(model, prompt: list[int], max_new: int, bias: dict[int, float]) -> list[int]:
    """Plain greedy decoding with the Hugging Face model alone, `bias` added to its logits (logit_bias)."""
    ids, out = list(prompt), []
    add = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    for t, v in bias.items():
        add[t] = v
    with torch.no_grad():
        for _ in range(max_new):
            t = int((model(torch.tensor([ids])).logits[0, -1].double() + add).argmax())
            out.append(t)
            ids.append(t)
    return out


def ragged_prompts(batch: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(1, 14, (batch,), generator=g)]
    return [torch.randint(0, vocab - 1, (n,), generator=g).tolist() for n in lengths]


# ---- the engine with requests joining (the drafter that knows each request's continuation: scripted.py) ----

def distinct_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(2, 12, (1,), generator=g))
        out.append([i + 1] + torch.randint(0, 47, (length - 1,), generator=g).tolist())
    return out


def run_with_joins(engine: Engine, prompts, params) -> list[list[int]]:
    """Two requests start; the rest join once the first has streamed a few tokens."""
    handles = [engine.submit(p, params) for p in prompts[:2]]
    got = 0
    for event in handles[0].events(timeout=60):
        got += len(event.token_ids)
        if got >= 5 or event.finished:
            break
    handles += [engine.submit(p, params) for p in prompts[2:]]
    return [h.result(timeout=120).token_ids for h in handles]


# ---- sampled output against the target's exact distribution (tiny vocabulary, 3 tokens) ----

VOCAB = 10
PROMPT = [1, 2, 3]


def shaped(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    n = logits.shape[0]
    return probabilities(
        logits[:, None], torch.full((n,), sp.temperature), torch.full((n,), sp.top_k, dtype=torch.long),
        torch.full((n,), sp.top_p),
    )[:, 0].double()


def exact_joint(model, sp: SamplingParams) -> torch.Tensor:
    """P(x1, x2, x3 | PROMPT) under the target with the same shaping, by enumeration: [V, V, V]."""
    with torch.no_grad():
        p1 = shaped(model(torch.tensor([PROMPT])).logits[:, -1], sp)[0]  # [V]
        pairs = torch.tensor([PROMPT + [a] for a in range(VOCAB)])
        p2 = shaped(model(pairs).logits[:, -1], sp)  # [V, V]
        triples = torch.tensor([PROMPT + [a, b] for a, b in itertools.product(range(VOCAB), repeat=2)])
        p3 = shaped(model(triples).logits[:, -1], sp).view(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit, pooling cells with small expected counts into one."""
    n = counts.sum()
    expected = probs.flatten() * n
    counts = counts.flatten().double()
    small = expected < min_expected
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    assert float(obs[~keep].sum()) == 0.0, "sampled a token the target gives probability 0"
    obs, exp = obs[keep], exp[keep]
    exp = exp * (obs.sum() / exp.sum())  # the float32 probabilities sum to 1 only up to rounding
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def sample_many(dec: SpecDecoder, sp: SamplingParams, n: int, batch: int) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    seed = 0
    for _ in range(n // batch):
        params = [sp.with_(seed=seed + i) for i in range(batch)]
        seed += batch
        for r in dec.generate([PROMPT] * batch, params):
            a, b, c = r.token_ids
            counts[a, b, c] += 1
    return counts


def lookup_only_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Makes every DecodeBatch step verify n-gram lookup continuations alone (`step_lookup`: no
    draft pass) where a row has one, each row 1..3 tokens in turn (never looking at the target),
    else a plain step. Returns the list the verified lengths of rows with a continuation go to."""
    import blockspec.dflash.batch as decode

    plain = decode.DecodeBatch.step
    turn = itertools.count()
    seen: list[int] = []

    def step(self, block, _=None):
        plan = self.lookup_plan()
        if not any(plan):
            return plain(self, 1)
        lengths = [1 + next(turn) % 3 for _ in plan]
        seen.extend(min(n, 1 + len(cont)) for n, cont in zip(lengths, plan) if cont)
        return self.step_lookup(lengths)

    monkeypatch.setattr(decode.DecodeBatch, "step", step)
    return seen
