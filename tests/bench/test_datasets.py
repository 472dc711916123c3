"""Prompt-set loaders on the shared data files: counts, templates, subsampling, the training guard."""

from __future__ import annotations

import json
import sys

import pytest

from blockspec.bench import datasets as ds
from blockspec.bench.datasets import DATASETS, Sample, load_dataset, training_prompts
from blockspec.errors import CheckpointError, ConfigError

if ds.data_dir() is None:
    pytest.skip("shared data directory not found (set BLOCKSPEC_DATA)", allow_module_level=True)

SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@pytest.mark.parametrize(
    ("name", "split", "count"),
    [
        ("gsm8k", "test", 1319),
        ("gsm8k", "train", 7473),
        ("math500", "test", 500),
        ("humaneval", "test", 164),
        ("mbpp", "test", 257),  # sanitized tasks with id 11..510
        ("mt-bench", "test", 80),
        ("alpaca", "test", 175),
        ("sharegpt", "train", 10323),
    ],
)
def test_counts(name, split, count):
    samples = load_dataset(name, split=split)
    assert len(samples) == count
    assert len({s.id for s in samples}) == count  # ids unique
    assert all(isinstance(s, Sample) and s.turns for s in samples)


def test_default_split_is_test_for_benchmarks_and_train_for_sharegpt():
    assert len(load_dataset("gsm8k")) == 1319
    assert DATASETS["sharegpt"].default_split == "train"


def test_math_templates():
    g = load_dataset("gsm8k", limit=1)[0]
    assert g.turns == ("Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes "
                       "muffins for her friends every day with four. She sells the remainder at the farmers' market "
                       "daily for $2 per fresh duck egg. How much in dollars does she make every day at the farmers' "
                       "market?" + SUFFIX,)
    assert g.reference == "18"
    m = load_dataset("math500", limit=1)[0]
    assert m.prompt.startswith("Convert the point $(0,3)$ in rectangular coordinates") and m.prompt.endswith(SUFFIX)
    assert m.reference == "\\left( 3, \\frac{\\pi}{2} \\right)"


def test_code_templates():
    h = load_dataset("humaneval", limit=1)[0]
    assert h.id == "humaneval/test/HumanEval/0"
    assert h.prompt.startswith(
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
        "from typing import List\n"
    )
    assert h.prompt.endswith('    """\n\n```')  # the raw prompt (ends in a newline) inside the fence
    b = load_dataset("mbpp", limit=1)[0]
    assert b.prompt == ("Write a python function to remove first and last occurrence of a given character "
                        "from the string.")
    assert all(11 <= int(s.id.rsplit("/", 1)[1]) <= 510 for s in load_dataset("mbpp"))


def test_mtbench_has_two_turns_each():
    samples = load_dataset("mt-bench")
    assert all(len(s.turns) == 2 for s in samples)
    assert samples[0].turns[1] == "Rewrite your previous response. Start every sentence with the letter A."


def test_alpaca_appends_input_only_when_present():
    samples = load_dataset("alpaca")
    with_input = [s for s in samples if "\n\nInput:\n" in s.prompt]
    assert 0 < len(with_input) < len(samples)
    assert samples[0].prompt.startswith("Is there anything I can eat for a breakfast")
    assert "Input:" not in samples[0].prompt


def test_sharegpt_first_turns():
    s = load_dataset("sharegpt", limit=1)[0]
    assert s.prompt.startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")
    assert s.reference and s.reference.startswith("Here are the main ideas")


def test_limit_is_first_n_by_default():
    first = load_dataset("gsm8k", limit=5)
    assert [s.id for s in first] == [f"gsm8k/test/{i}" for i in range(5)]
    assert load_dataset("gsm8k", limit=0) == []


def test_shuffle_is_seeded_and_prefix_stable():
    a = load_dataset("gsm8k", limit=10, shuffle=True, seed=3)
    b = load_dataset("gsm8k", limit=10, shuffle=True, seed=3)
    c = load_dataset("gsm8k", limit=10, shuffle=True, seed=4)
    assert a == b and a != c
    assert load_dataset("gsm8k", limit=20, shuffle=True, seed=3)[:10] == a
    assert [s.id for s in a] != [f"gsm8k/test/{i}" for i in range(10)]


def test_errors_name_the_fix():
    with pytest.raises(ConfigError, match="known: .*gsm8k"):
        load_dataset("gsm9k")
    with pytest.raises(ConfigError, match="has no split 'validation'"):
        load_dataset("gsm8k", split="validation")
    with pytest.raises(ConfigError, match="limit"):
        load_dataset("gsm8k", limit=-1)


@pytest.mark.parametrize("name", ["gsm8k:test", "math500", "humaneval", "mbpp:test", "mbpp:validation", "mt-bench",
                                  "alpaca"])
def test_training_guard_refuses_benchmark_splits(name):
    with pytest.raises(ConfigError, match="must not be used for training"):
        training_prompts([name], limit=4)


def test_training_prompts_mix_train_splits():
    mixed = training_prompts(["sharegpt", "gsm8k", "mbpp:train"], limit=50, seed=1)
    assert len(mixed) == 50
    assert mixed == training_prompts(["sharegpt", "gsm8k", "mbpp:train"], limit=50, seed=1)
    prefixes = {s.id.split("/")[0] + "/" + s.id.split("/")[1] for s in mixed}
    assert prefixes <= {"sharegpt/train", "gsm8k/train", "mbpp/train"}
    assert "gsm8k/test" not in {s.id.rsplit("/", 1)[0] for s in mixed}
    with pytest.raises(ConfigError):
        training_prompts([])


def test_blockspec_data_override(tmp_path, monkeypatch):
    shared = ds.data_dir()
    rows = [{"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}, {"question": "1+1?", "answer": "#### 2"}]
    (tmp_path / "gsm8k_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv(ds.ENV_VAR, str(tmp_path))
    samples = load_dataset("gsm8k")
    assert [s.reference for s in samples] == ["4", "2"]
    assert samples[0].prompt == "What is 2+2?" + SUFFIX
    assert ds.data_dir() == tmp_path
    assert len(load_dataset("gsm8k", data_dir=shared)) == 1319  # the argument beats the variable


def test_missing_file_offline_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(ds.ENV_VAR, str(tmp_path))
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails: no Hub fallback
    with pytest.raises(CheckpointError, match="BLOCKSPEC_DATA"):
        load_dataset("math500")


def test_sample_validation():
    with pytest.raises(ConfigError):
        Sample("x", ())
    with pytest.raises(ConfigError):
        Sample("", ("hi",))
    with pytest.raises(ConfigError):
        Sample("x", ["hi"])  # type: ignore[arg-type]


def test_with_context_puts_other_problems_in_front_until_long_enough():
    pool = load_dataset("gsm8k", limit=40)
    words = lambda text: len(text.split())  # noqa: E731  (a stand-in tokenizer)
    got = ds.with_context(pool[:3], pool, 300, words)
    for sample, padded in zip(pool[:3], got):
        assert padded.id == sample.id and padded.reference == sample.reference
        first = padded.prompt
        assert first.startswith(ds.CONTEXT_INTRO) and first.endswith(ds.CONTEXT_OUTRO + sample.prompt)
        assert words(first) >= 300
        context = first[len(ds.CONTEXT_INTRO) : -len(ds.CONTEXT_OUTRO + sample.prompt)]
        pieces = context.split("\n\n")
        assert sample.prompt not in pieces  # never itself
        position = [p.id for p in pool].index(sample.id)
        assert pieces[0].startswith(pool[position + 1].prompt.split("\n\n")[0])  # the ones after it, in order
        assert words(first) - words(pieces[-1]) < 300 + 20  # no more than needed
    assert [s.prompt for s in got] != [s.prompt for s in pool[:3]] and len({s.prompt for s in got}) == 3
    two_turns = load_dataset("mt-bench", limit=2)
    padded = ds.with_context(two_turns, two_turns, 50, words)
    assert padded[0].turns[1:] == two_turns[0].turns[1:]  # only the first turn grows
    assert ds.with_context(pool[:2], pool, 0, words) == pool[:2]
    with pytest.raises(ConfigError, match="ask for fewer"):
        ds.with_context(pool[:1], pool[:3], 100_000, words)
