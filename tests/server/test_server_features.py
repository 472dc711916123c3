"""The OpenAI features clients use, through the official `openai` client: n > 1, logprobs and
top_logprobs (from the target's own distribution), stop sequences, and seeds echoed with
`system_fingerprint` so that an answer can be reproduced."""

from __future__ import annotations

import math

import pytest
import torch
from server_support import HELLO, MODEL, client, pipe, server  # noqa: F401 (fixtures)

SAMPLED = dict(temperature=1.0, top_p=0.95)


@pytest.fixture(scope="module")
def reference(pipe):
    """The target as a plain transformers model (float64), to compute logprobs independently."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(pipe.target_source, torch_dtype=torch.float64).eval()


def target_logprobs(model, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """log-softmax of the target's logits at each generated position, by one plain forward: [n, V]."""
    ids = torch.tensor([prompt_ids + generated])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1: len(prompt_ids) - 1 + len(generated)]
    return torch.log_softmax(logits.double(), dim=-1)


def test_n_choices_are_distinct_samples_and_the_first_is_the_single_answer(client):
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=10, seed=11, **SAMPLED, extra_body={"ignore_eos": True})
    many = client.chat.completions.create(n=4, **kwargs)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in many.choices]
    assert len(set(texts)) > 1  # independent samples, not one answer four times
    one = client.chat.completions.create(n=1, **kwargs)
    assert one.choices[0].message.content == texts[0]  # choice 0 is sampled with the seed itself
    assert many.usage.completion_tokens == 40 and many.usage.prompt_tokens == one.usage.prompt_tokens
    again = client.chat.completions.create(n=4, **kwargs)
    assert [c.message.content for c in again.choices] == texts


def test_n_choices_stream_interleaved_with_indices(client):
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=8, seed=5, n=3, **SAMPLED, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    pieces = {0: "", 1: "", 2: ""}
    finals = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            pieces[c.index] += c.delta.content or ""
            if c.finish_reason:
                finals[c.index] = c.finish_reason
    assert pieces == {c.index: c.message.content for c in full.choices}
    assert finals == {0: "length", 1: "length", 2: "length"}


def test_completions_n(client):
    out = client.completions.create(model=MODEL, prompt="Janet has", max_tokens=6, n=3, seed=3, **SAMPLED,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 18


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_chat_logprobs_come_from_the_targets_distribution(client, pipe, reference, temperature):
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=temperature,
                                           seed=2, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 8
    token_ids = _ids_from_bytes(pipe, [bytes(e.bytes) for e in content])
    want = target_logprobs(reference, pipe.encode(HELLO), token_ids)  # [8, V]: unshaped, whatever the temperature
    for pos, entry in enumerate(content):
        assert entry.logprob == pytest.approx(float(want[pos, token_ids[pos]]), abs=1e-6)
        top = torch.topk(want[pos], 3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-6)
        if temperature == 0.0:  # greedy: the chosen token is the most likely one
            assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-9)
    assert pipe.tokenizer.decode(token_ids, skip_special_tokens=True) == reply.choices[0].message.content


def _ids_from_bytes(pipe, pieces: list[bytes]) -> list[int]:
    """Token ids of the tiny byte-level tokenizer from each token's exact bytes."""
    from blockspec.server.logprobs import TokenTexts

    texts = TokenTexts(pipe.tokenizer)
    by_bytes = {bytes(texts.get(i)[1]): i for i in range(len(pipe.tokenizer))}
    return [by_bytes[p] for p in pieces]


def test_completion_logprobs_shape_and_stream(client, pipe):
    kwargs = dict(model=MODEL, prompt="Janet has 16 ducks", max_tokens=6, temperature=0.0, logprobs=2,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == full.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(len(alts) <= 2 and max(alts.values()) == pytest.approx(v) for alts, v in zip(lp.top_logprobs,
                                                                                           lp.token_logprobs))
    streamed = []
    for chunk in client.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed.extend(chunk.choices[0].logprobs.token_logprobs)
    assert streamed == pytest.approx(lp.token_logprobs)
    assert all(v <= 0 and math.isfinite(v) for v in lp.token_logprobs)


def test_stop_sequences_as_openai(client, pipe):
    base = pipe.generate(HELLO, max_new_tokens=30, temperature=0.0, ignore_eos=True).text
    assert len(base) >= 12, "the tiny model should produce some text"
    early, late = base[8:11], base[3:6]
    if base.find(early) > base.find(late):
        early, late = late, early
    cut = base[: base.find(early)]
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=30, temperature=0.0, stop=[late, early, "\u2603never"],
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.content == cut  # cut before the earliest stop; the stop is not returned
    assert full.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    # a stop that never occurs changes nothing; max_tokens then ends the answer with "length"
    none = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0.0, stop="\u2603",
                                          extra_body={"ignore_eos": True})
    assert none.choices[0].finish_reason == "length"
    text = client.completions.create(model=MODEL, prompt="Janet has", max_tokens=20, temperature=0.0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    if len(text) > 4:
        stopped = client.completions.create(model=MODEL, prompt="Janet has", max_tokens=20, temperature=0.0,
                                            stop=text[2:4], extra_body={"ignore_eos": True})
        assert stopped.choices[0].text == text[: text.find(text[2:4])]


def test_seed_is_echoed_and_replays_the_answer(client):
    """A seed is echoed and replays the answer (the keyed rule); without one the answer says it
    was verified by the standard rule and carries no seed (no seed could replay it)."""
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=10, **SAMPLED, extra_body={"ignore_eos": True})
    unseeded = client.chat.completions.create(**kwargs)
    assert "seed" not in unseeded.model_extra and unseeded.model_extra["sampling_rule"] == "standard"
    seed = 12345
    first = client.chat.completions.create(seed=seed, **kwargs)
    assert first.model_extra["seed"] == seed and first.model_extra["sampling_rule"] == "keyed"
    assert first.system_fingerprint and first.system_fingerprint.startswith("fp_")
    assert first.system_fingerprint == unseeded.system_fingerprint
    replay = client.chat.completions.create(seed=seed, **kwargs)
    assert replay.model_extra["seed"] == seed
    assert replay.choices[0].message.content == first.choices[0].message.content
    assert replay.system_fingerprint == first.system_fingerprint
    chunks = list(client.chat.completions.create(seed=seed, stream=True, **kwargs))
    assert {c.model_extra["seed"] for c in chunks} == {seed}
    assert {c.model_extra["sampling_rule"] for c in chunks} == {"keyed"}
    assert {c.system_fingerprint for c in chunks} == {first.system_fingerprint}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == first.choices[0].message.content
