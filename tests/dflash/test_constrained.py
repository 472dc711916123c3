"""Grammar-constrained decoding inside speculative decoding (dflash/constraint.py,
engine/grammar.py): the output of a spec-decoded constrained request is the constrained plain
(block size 1) output, greedy and sampled, and it matches the grammar. The tiny random target's
own output is garbage, so the grammar decides every structural token."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from conftest import build_tiny_tokenizer
from scripted import ScriptedDrafter
from support import native

from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash.constraint import mask_width, walk
from blockspec.dflash.drafter import new_drafter_for_target
from blockspec.engine.decoder import SpecDecoder
from blockspec.engine.grammar import Grammars, OutputFormat
from blockspec.errors import ConfigError
from blockspec.targets.hf import HFTarget

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["ok", "tag", "n"], "additionalProperties": False}
FMT = OutputFormat("json_schema", SCHEMA)


@pytest.fixture(scope="module")
def setup():
    import transformers as tf

    tok = build_tiny_tokenizer()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    model = tf.LlamaForCausalLM(cfg).to(torch.float64).eval()
    target = HFTarget(model, eos_token_ids=(eos,))
    grammars = Grammars(tok, len(tok), (eos,))
    prompts = [tok.encode(t) for t in ("Janet has 16 ducks", "def add(a, b):", "Please reason")]
    return tok, model, target, grammars, prompts


def _generate(target, drafter, block, prompts, params, grammars, fmt=FMT):
    dec = SpecDecoder(target, drafter, SpecConfig(block_size=block))
    return dec.generate(prompts, params, constraints=[grammars.matcher(fmt) for _ in prompts])


def test_grammar_bites_on_the_tiny_model(setup) -> None:
    tok, _, target, grammars, prompts = setup
    free = SpecDecoder(target, None, SpecConfig(block_size=1)).generate(prompts, SamplingParams(max_new_tokens=40))
    for r in free:
        with pytest.raises(ValueError):
            json.loads(tok.decode(r.token_ids, skip_special_tokens=True))
    for r in _generate(target, None, 1, prompts, SamplingParams(max_new_tokens=60), grammars):
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(tok.decode(r.token_ids, skip_special_tokens=True)), SCHEMA)


@pytest.mark.parametrize("block,error_rate", [(3, 0.0), (6, 0.3), (8, 0.7)])
def test_greedy_spec_equals_constrained_plain(setup, block: int, error_rate: float) -> None:
    tok, model, target, grammars, prompts = setup
    params = SamplingParams(max_new_tokens=60)
    plain = _generate(target, None, 1, prompts, params, grammars)
    # a drafter that proposes the constrained truth with errors (which the grammar mostly rejects)
    drafter = ScriptedDrafter(model, prompts, [r.token_ids for r in plain], error_rate=error_rate, seed=block)
    spec = _generate(target, drafter, block, prompts, params, grammars)
    for p, s in zip(plain, spec):
        assert s.token_ids == p.token_ids
        assert s.finish_reason == p.finish_reason == "stop"
    if error_rate < 0.5:
        assert max(s.stats.mean_tau for s in spec) > 1.5


def test_greedy_with_a_real_drafter(setup) -> None:
    tok, model, target, grammars, prompts = setup
    params = SamplingParams(max_new_tokens=60)
    drafter = new_drafter_for_target(model.config, mask_token_id=3, num_layers=1, block_size=8,
                                     dtype=torch.float64, seed=0)
    plain = _generate(target, None, 1, prompts, params, grammars)
    spec = _generate(target, drafter, 8, prompts, params, grammars)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]


@pytest.mark.parametrize("error_rate", [0.0, 0.4])
def test_sampled_spec_equals_constrained_plain_for_a_seed(setup, error_rate: float) -> None:
    tok, model, target, grammars, prompts = setup
    params = [SamplingParams(max_new_tokens=60, temperature=1.0, top_p=0.95, seed=s) for s in (1, 2, 3)]
    plain = _generate(target, None, 1, prompts, params, grammars)
    drafter = ScriptedDrafter(model, prompts, [r.token_ids for r in plain], error_rate=error_rate, seed=5)
    spec = _generate(target, drafter, 6, prompts, params, grammars)
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    real = new_drafter_for_target(model.config, mask_token_id=3, num_layers=1, block_size=8,
                                  dtype=torch.float64, seed=1)
    assert [s.token_ids for s in _generate(target, real, 8, prompts, params, grammars)] == \
        [p.token_ids for p in plain]
    for p in plain:
        if p.finish_reason == "stop":
            jsonschema.validate(json.loads(tok.decode(p.token_ids, skip_special_tokens=True)), SCHEMA)


def test_constrained_row_leaves_the_argmax_path_to_its_batch_mates(setup) -> None:
    """A greedy batch with one constrained row never computes the full logits of the whole batch
    (`forward`): the other rows keep the argmax-only head, and each row's output is its own."""
    tok, model, _, grammars, prompts = setup
    eos = grammars.stop_token_ids
    target = native(model)
    target.info = type(target.info)(**{**target.info.__dict__, "eos_token_ids": eos})
    params = SamplingParams(max_new_tokens=40)
    dec = SpecDecoder(target, None, SpecConfig(block_size=1))
    alone_free = dec.generate(prompts[1:2], params)[0].token_ids
    alone_json = dec.generate(prompts[:1], params, constraints=[grammars.matcher(FMT)])[0].token_ids

    def refuse(*args, **kwargs):
        raise AssertionError("a full-logits forward ran for an all-greedy batch")

    target.forward = refuse
    together = dec.generate(prompts[:2], params, constraints=[grammars.matcher(FMT), None])
    assert together[0].token_ids == alone_json
    assert together[1].token_ids == alone_free


def test_walk_cuts_at_the_first_rejected_proposal_and_rolls_back(setup) -> None:
    tok, _, _, grammars, _ = setup
    width = mask_width(len(tok))
    good = tok.encode('{"ok": true, "tag": "red", "n": 5}')
    bad = tok.encode("]")[0]
    m = grammars.matcher(FMT)
    before = torch.empty(width, dtype=torch.int32)
    m.fill_mask(before)
    v, masks = walk(m, good[:4] + [bad] + good[4:], width)
    assert v == 4 and masks.shape == (5, width)
    assert torch.equal(masks[0], before)
    after = torch.empty(width, dtype=torch.int32)
    m.fill_mask(after)
    assert torch.equal(after, before)  # rolled back to the committed prefix
    v, _ = walk(m, good, width)
    assert v == len(good)


def test_regex_and_choice(setup) -> None:
    tok, _, target, grammars, prompts = setup
    params = SamplingParams(max_new_tokens=30)
    for r in _generate(target, None, 1, prompts, params, grammars, OutputFormat("regex", r"[a-d]{2,4}-[0-9]{3}")):
        assert re.fullmatch(r"[a-d]{2,4}-[0-9]{3}", tok.decode(r.token_ids, skip_special_tokens=True))
    choices = ("yes", "no", "maybe so")
    texts = [tok.decode(r.token_ids, skip_special_tokens=True)
             for r in _generate(target, None, 1, prompts, params, grammars, OutputFormat("choice", choices))]
    assert all(t in choices for t in texts)


def test_bad_formats_are_config_errors(setup) -> None:
    _, _, _, grammars, _ = setup
    with pytest.raises(ConfigError, match="cannot be compiled"):
        grammars.matcher(OutputFormat("regex", "[unclosed"))
    with pytest.raises(ConfigError, match="cannot be compiled"):
        grammars.matcher(OutputFormat("grammar", "root ::= ( oops"))
    with pytest.raises(ConfigError):
        OutputFormat("json_schema", "not a dict")
    with pytest.raises(ConfigError):
        OutputFormat("xml")


def test_bounded_strings_hold_no_raw_control_characters(setup) -> None:
    """xgrammar's rule for a string with maxLength admits raw control characters (JSON forbids
    them: json.loads refuses the text); engine/grammar.py excludes them."""
    tok, _, target, grammars, prompts = setup
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 3, "maxLength": 10}},
              "required": ["s"], "additionalProperties": False}
    params = [SamplingParams(max_new_tokens=40, temperature=1.5, seed=s) for s in range(3)]
    done = 0
    for r in _generate(target, None, 1, prompts, params, grammars, OutputFormat("json_schema", schema)):
        text = tok.decode(r.token_ids, skip_special_tokens=True)
        assert not any(ord(ch) < 32 for ch in text), repr(text)
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(text), schema)
            done += 1
    assert done


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_adaptive_block_with_lookup_equals_constrained_plain(setup, temperature: float, adaptive: bool) -> None:
    """The adaptive policy's trimmed and ragged steps and n-gram lookup proposals (which the walk
    cuts like drafted ones) keep the constrained output."""
    from blockspec.config import LookupConfig

    tok, model, target, grammars, prompts = setup
    params = [SamplingParams(max_new_tokens=60, temperature=temperature, seed=s) for s in (4, 5, 6)]
    plain = _generate(target, None, 1, prompts, params, grammars)
    # a real drafter: the policy calibrates on batches of its own, which a scripted one cannot serve
    drafter = new_drafter_for_target(model.config, mask_token_id=3, num_layers=1, block_size=8,
                                     dtype=torch.float64, seed=2)
    spec = SpecConfig(block_size=8, adaptive=adaptive, lookup=LookupConfig())
    dec = SpecDecoder(target, drafter, spec)
    got = dec.generate(prompts, params, constraints=[grammars.matcher(FMT) for _ in prompts])
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]
    if not adaptive:  # (the policy may find drafting this random drafter's blocks not worth it)
        assert sum(g.stats.lookup_steps for g in got) > 0  # lookup proposals were verified


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dflash2_drafter_equals_constrained_plain(setup, temperature: float) -> None:
    """A DFlash 2 drafter's selector walk proposes (greedy or sampled) tokens the grammar may
    reject: they are cut, and the output stays constrained plain decoding's."""
    from blockspec.dflash.drafter import DFLASH2

    tok, model, target, grammars, prompts = setup
    params = [SamplingParams(max_new_tokens=50, temperature=temperature, seed=s) for s in (7, 8, 9)]
    plain = _generate(target, None, 1, prompts, params, grammars)
    drafter = new_drafter_for_target(model.config, mask_token_id=3, num_layers=1, block_size=8, architecture=DFLASH2,
                                     seed=3, dtype=torch.float64,
                                     dflash2=dict(conv_group_size=8, selector_rank=8, selector_top_k=6)).eval()
    got = _generate(target, drafter, 8, prompts, params, grammars)
    assert [g.token_ids for g in got] == [p.token_ids for p in plain]
