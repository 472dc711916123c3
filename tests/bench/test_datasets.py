"""Prompt-set loaders: the bundled benchmark sets (counts, templates, subsampling), the look-up
order (data directory, $BLOCKSPEC_DATA, bundled copy, Hub), and the training guard."""

from __future__ import annotations

import fnmatch
import json
import re
import sys
from pathlib import Path

import pytest

import blockspec
from blockspec.datasets import prompt_sets as ds
from blockspec.datasets import DATASETS, HubSource, Sample, SplitSpec, load_dataset, training_prompts
from blockspec.errors import CheckpointError, ConfigError

SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def train_dir(tmp_path: Path) -> Path:
    """A data directory with small training splits: gsm8k train, ShareGPT, all of MBPP's ranges."""
    _jsonl(tmp_path / "gsm8k_train.jsonl", [{"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}
                                            for i in range(20)])
    _jsonl(tmp_path / "sharegpt_first_turns.jsonl", [
        {"id": f"s{i}", "messages": [{"role": "user", "content": f"Tell me about topic {i}."},
                                     {"role": "assistant", "content": f"Topic {i} is ..."}]} for i in range(20)
    ] + [{"id": "empty", "messages": [{"role": "user", "content": "  "}]}])
    mbpp = [{"task_id": t, "prompt": f"Write a function number {t}.", "code": "def f():\n    pass",
             "test_list": ["assert f() is None"]} for t in (1, 5, 11, 300, 510, 511, 600, 601, 700)]
    (tmp_path / "mbpp_sanitized.json").write_text(json.dumps(mbpp), encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize(
    ("name", "count"),
    [("gsm8k", 1319), ("math500", 500), ("humaneval", 164), ("mbpp", 257),  # MBPP: sanitized tasks 11..510
     ("mt-bench", 80), ("alpaca", 175)],
)
def test_benchmark_sets_load_from_the_bundled_copy(name, count):
    assert ds.data_dir() is None  # no data directory: the copy shipped in the package
    samples = load_dataset(name)
    assert len(samples) == count
    assert len({s.id for s in samples}) == count  # ids unique
    assert all(isinstance(s, Sample) and s.turns for s in samples)


def test_bundled_files_are_package_data_with_a_notice():
    """Each bundled file loads through importlib.resources (as from an installed wheel), is matched
    by pyproject's package-data patterns, and the notice names its licence."""
    bundled = [sp.bundled for spec in DATASETS.values() for sp in spec.splits.values() if sp.bundled]
    assert len(bundled) == 6
    pyproject = (Path(blockspec.__file__).parent.parent / "pyproject.toml").read_text(encoding="utf-8")
    table = pyproject.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    patterns = re.findall(r'"([^"]+)"', table.split("blockspec = ", 1)[1].split("]", 1)[0])
    for file in [*bundled, "README.md"]:
        assert ds.bundled_path(file).is_file(), file
        assert any(fnmatch.fnmatch(f"datasets/{ds.BUNDLED_DIR}/{file}", p) for p in patterns), (file, patterns)
    notice = ds.bundled_path("README.md").read_text(encoding="utf-8")
    for file, licence in [("gsm8k_test", "MIT"), ("math500_test", "MIT"), ("humaneval_test", "MIT"),
                          ("mbpp_sanitized_test", "CC-BY-4.0"), ("mtbench_questions", "Apache-2.0"),
                          ("alpaca_seed_tasks", "Apache-2.0")]:
        row = next(line for line in notice.splitlines() if line.startswith(f"| `{file}.jsonl.gz`"))
        assert row.rstrip(" |").endswith(licence), row


def test_only_benchmark_splits_may_be_bundled():
    with pytest.raises(ConfigError, match="only benchmark"):
        SplitSpec("x_train.jsonl", HubSource("x/y", None, "train"), False, bundled="x_train.jsonl.gz")


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


def test_sharegpt_first_turns_from_a_data_dir_in_both_record_forms(train_dir, tmp_path):
    s = load_dataset("sharegpt", limit=1, data_dir=train_dir)[0]
    assert s.id == "sharegpt/train/s0" and s.prompt == "Tell me about topic 0." and s.reference == "Topic 0 is ..."
    assert len(load_dataset("sharegpt", data_dir=train_dir)) == 20  # the record without a user turn is skipped
    raw = tmp_path / "raw"
    raw.mkdir()
    _jsonl(raw / "sharegpt_first_turns.jsonl", [{"id": "r", "conversations": [
        {"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello"}]}])
    (only,) = load_dataset("sharegpt", data_dir=raw)
    assert (only.prompt, only.reference) == ("Hi there", "Hello")


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


def test_training_prompts_mix_train_splits(train_dir):
    mixed = training_prompts(["sharegpt", "gsm8k", "mbpp:train"], limit=30, seed=1, data_dir=train_dir)
    assert len(mixed) == 30
    assert mixed == training_prompts(["sharegpt", "gsm8k", "mbpp:train"], limit=30, seed=1, data_dir=train_dir)
    prefixes = {s.id.split("/")[0] + "/" + s.id.split("/")[1] for s in mixed}
    assert prefixes == {"sharegpt/train", "gsm8k/train", "mbpp/train"}
    assert {s.id for s in mixed if s.id.startswith("mbpp")} <= {"mbpp/train/601", "mbpp/train/700"}
    with pytest.raises(ConfigError):
        training_prompts([])


def test_a_data_dir_file_replaces_the_bundled_copy_and_the_argument_comes_first(tmp_path, monkeypatch):
    env_dir, arg_dir = tmp_path / "env", tmp_path / "arg"
    env_dir.mkdir()
    arg_dir.mkdir()
    _jsonl(env_dir / "gsm8k_test.jsonl", [{"question": "What is 2+2?", "answer": "2+2=4\n#### 4"},
                                          {"question": "1+1?", "answer": "#### 2"}])
    _jsonl(arg_dir / "gsm8k_test.jsonl", [{"question": "3*3?", "answer": "#### 9"}])
    monkeypatch.setenv(ds.ENV_VAR, str(env_dir))
    samples = load_dataset("gsm8k")
    assert [s.reference for s in samples] == ["4", "2"]
    assert samples[0].prompt == "What is 2+2?" + SUFFIX
    assert ds.data_dir() == env_dir
    assert [s.reference for s in load_dataset("gsm8k", data_dir=arg_dir)] == ["9"]  # the argument first
    assert len(load_dataset("math500", data_dir=arg_dir)) == 500  # neither holds it: the bundled copy
    mbpp = [{"task_id": t, "prompt": f"task {t}"} for t in (3, 11, 510, 511)]
    (arg_dir / "mbpp_sanitized.json").write_text(json.dumps(mbpp))
    assert [s.id for s in load_dataset("mbpp", data_dir=arg_dir)] == ["mbpp/test/11", "mbpp/test/510"]


def test_a_missing_split_says_what_to_pass(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails: no Hub fallback
    with pytest.raises(CheckpointError, match=r"pass --data-dir DIR \(or set BLOCKSPEC_DATA=DIR\) .* "
                                              r"sharegpt_first_turns.jsonl \(looked in: no --data-dir given"):
        load_dataset("sharegpt")
    monkeypatch.setenv(ds.ENV_VAR, str(tmp_path))
    with pytest.raises(CheckpointError, match=rf"gsm8k_train.jsonl \(looked in: {re.escape(str(tmp_path))}\).*"
                                              r"install `datasets`"):
        load_dataset("gsm8k", split="train")


def test_training_never_reads_the_bundled_benchmark_copies(monkeypatch):
    """With no data anywhere, asking for a training split fails, even where the package ships the
    same set's test split."""
    from blockspec.train.data import heldout_prompts, load_prompts

    monkeypatch.setitem(sys.modules, "datasets", None)
    assert load_dataset("gsm8k", limit=1) and load_dataset("alpaca", limit=1)  # bundled
    with pytest.raises(CheckpointError, match="gsm8k_train.jsonl"):
        training_prompts(["gsm8k"])
    with pytest.raises(CheckpointError, match="gsm8k_train.jsonl"):
        heldout_prompts(4)
    with pytest.raises(CheckpointError, match="alpaca_seed_tasks.jsonl"):
        load_prompts(["alpaca"])
    with pytest.raises(CheckpointError, match="mbpp_sanitized.json"):
        load_prompts(["mbpp_train"])
    assert list(ds.split_rows("gsm8k", "test", bundled=True))
    with pytest.raises(CheckpointError, match="gsm8k_test.jsonl"):
        list(ds.split_rows("gsm8k", "test", bundled=False))


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
