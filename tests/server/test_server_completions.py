"""/v1/completions for evaluation harnesses, through the official `openai` client: batches of
prompts (choice i * n + j: prompt i, sample j), `echo` with the prompt's logprobs (first null,
`max_tokens: 0` to score alone), and `logit_bias` on both endpoints."""

from __future__ import annotations

import pytest
import torch
from server_support import HELLO, MODEL, client, pipe, server  # noqa: F401 (fixtures)
from support import reference_biased_greedy

SAMPLED = dict(temperature=1.0, top_p=0.95)
PROMPTS = ["Janet has 16 ducks", "def add(a, b):"]


@pytest.fixture(scope="module")
def reference(pipe):
    """The target as a plain transformers model (float64)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(pipe.target_source, dtype=torch.float64).eval()


def full_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[n - 1, V]: log-softmax of one plain forward, position t predicting token t + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), dim=-1)


def streamed(stream) -> tuple[dict[int, str], dict[int, list], dict[int, str]]:
    """Per choice index: the text, the token logprobs and the finish reason of a completion stream."""
    texts: dict[int, str] = {}
    values: dict[int, list] = {}
    reasons: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs is not None:
                values.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, values, reasons


# ---- several prompts --------------------------------------------------------------------------

@pytest.mark.parametrize("as_ids", [False, True])
def test_prompt_batch_orders_choices_prompt_major_as_openai(client, pipe, as_ids):
    prompts = [pipe.encode(p) for p in PROMPTS] if as_ids else PROMPTS
    kwargs = dict(model=MODEL, max_tokens=5, n=2, seed=9, **SAMPLED, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kwargs) for p in prompts]
    batch = client.completions.create(prompt=prompts, **kwargs)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    for c in batch.choices:
        i, j = divmod(c.index, 2)
        assert c.text == alone[i].choices[j].text  # prompt i, sample j: the answer it gets alone
    assert batch.choices[0].text != batch.choices[2].text
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone) == 20
    texts, _, reasons = streamed(client.completions.create(prompt=prompts, stream=True, **kwargs))
    assert texts == {c.index: c.text for c in batch.choices}
    assert reasons == {0: "length", 1: "length", 2: "length", 3: "length"}


def test_greedy_batch_equals_single_prompts(client, pipe):
    prompts = [PROMPTS[0], "Please reason step by step", PROMPTS[1]]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0.0)
    for c, p in zip(batch.choices, prompts):
        assert c.text == pipe.generate(p, chat=False, max_new_tokens=8, temperature=0.0).text


# ---- echo ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_echo_scores_the_prompt_alone_with_max_tokens_zero(client, pipe, reference, stream):
    ids = [pipe.encode(p) for p in PROMPTS]
    kwargs = dict(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2, temperature=0.0)
    if stream:
        texts, values, reasons = streamed(client.completions.create(stream=True, **kwargs))
        assert reasons == {0: "length", 1: "length"}
        for i, p in enumerate(ids):
            assert texts[i] == pipe.tokenizer.decode(p)
            want = full_logprobs(reference, p)
            assert values[i][0] is None
            assert values[i][1:] == pytest.approx([float(want[t, p[t + 1]]) for t in range(len(p) - 1)], abs=1e-6)
        return
    out = client.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1]
    for c, p in zip(out.choices, ids):
        lp = c.logprobs
        assert c.text == pipe.tokenizer.decode(p) and c.finish_reason == "length"
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(p)
        assert "".join(lp.tokens) == c.text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(len(p))]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = full_logprobs(reference, p)
        for t in range(1, len(p)):
            assert lp.token_logprobs[t] == pytest.approx(float(want[t - 1, p[t]]), abs=1e-6)
            assert sorted(lp.top_logprobs[t].values(), reverse=True) == \
                pytest.approx(want[t - 1].topk(2).values.tolist(), abs=1e-6)
    # OpenAI bills the echoed prompt twice: as prompt tokens, and again as completion tokens
    assert out.usage.prompt_tokens == out.usage.completion_tokens == sum(len(p) for p in ids)


def test_echo_with_generation_puts_the_prompt_first(client, pipe, reference):
    prompt = PROMPTS[0]
    ids = pipe.encode(prompt)
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0.0, logprobs=1,
                  extra_body={"ignore_eos": True})
    plain = client.completions.create(**kwargs)
    echoed = client.completions.create(echo=True, **kwargs)
    c, lp = echoed.choices[0], echoed.choices[0].logprobs
    assert c.text == prompt + plain.choices[0].text
    assert lp.tokens[len(ids):] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs)
    assert lp.text_offset[len(ids):] == [len(prompt) + o for o in plain.choices[0].logprobs.text_offset]
    want = full_logprobs(reference, ids)
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([float(want[t, ids[t + 1]]) for t in range(len(ids) - 1)],
                                                          abs=1e-6)
    assert echoed.usage.completion_tokens == len(ids) + 6
    texts, values, _ = streamed(client.completions.create(echo=True, stream=True, **kwargs))
    assert texts[0] == c.text
    assert values[0][0] is None and values[0][1:] == pytest.approx(lp.token_logprobs[1:])


def test_echo_without_logprobs(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=0, echo=True)
    assert [c.text for c in out.choices] == PROMPTS and all(c.logprobs is None for c in out.choices)
    more = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=3, echo=True, temperature=0.0)
    assert more.choices[0].text.startswith(PROMPTS[1]) and len(more.choices[0].text) > len(PROMPTS[1])


# ---- logit_bias ---------------------------------------------------------------------------------

def test_logit_bias_changes_greedy_output_as_plain_biased_decoding(client, pipe, reference):
    ids = pipe.encode(PROMPTS[0])
    plain = reference_biased_greedy(reference, ids, 10, {})
    bias = {plain[0]: -100.0, plain[1]: -100.0}
    want = reference_biased_greedy(reference, ids, 10, bias)
    assert want != plain
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0.0,
                                    logit_bias={str(t): v for t, v in bias.items()}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == pipe.tokenizer.decode(want)


def test_logit_bias_on_chat(client, pipe, reference):
    ids = pipe.encode(HELLO)
    plain = reference_biased_greedy(reference, ids, 8, {})
    bias = {plain[0]: -100.0, 7: 30.0}
    want = reference_biased_greedy(reference, ids, 8, bias)
    assert want != plain
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, temperature=0.0,
                                           logit_bias={str(t): v for t, v in bias.items()},
                                           extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == pipe.tokenizer.decode(want, skip_special_tokens=True)
