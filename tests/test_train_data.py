"""Prompt sources of `blockspec datagen`: held-out questions stay out, test splits are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blockspec.errors import ConfigError
from blockspec.train.data import heldout_prompts, load_prompts


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    with open(tmp_path / "gsm8k_train.jsonl", "w") as f:
        for i in range(10):
            f.write(json.dumps({"question": f"Ann has {i}  apples\nand buys 2. How many now?", "answer": "#### 2"}) + "\n")
    return tmp_path


def _question(prompt) -> int:
    """The apple count in a prompt's question: which gsm8k row it came from."""
    text = prompt.messages[-1]["content"]
    return int(text.split("Ann has ", 1)[1].split()[0])


def test_gsm8k_code_holds_out_the_same_questions_as_gsm8k_train(data_dir: Path) -> None:
    maths = load_prompts(["gsm8k_train"], data_dir=data_dir, holdout=3)
    code = load_prompts(["gsm8k_code"], data_dir=data_dir, holdout=3)
    assert sorted(map(_question, maths)) == sorted(map(_question, code)) == list(range(3, 10))
    assert {p.id for p in code}.isdisjoint({p.id for p in maths})  # both can live in one data dir
    stub = code[0].messages[-1]["content"]
    # HumanEval's form: a signature and a docstring to complete, in a fenced block; whitespace folded
    assert "```python\ndef solution() -> float:\n    \"\"\"Ann has" in stub and "apples and buys" in stub
    held = heldout_prompts(3, data_dir=data_dir, source="gsm8k_code")
    assert [_question(p) for p in held] == [0, 1, 2]
    assert [_question(p) for p in heldout_prompts(2, data_dir=data_dir)] == [0, 1]
    with pytest.raises(ConfigError, match="held-out prompts come from one of gsm8k_train, gsm8k_code"):
        heldout_prompts(2, data_dir=data_dir, source="sharegpt")


def test_test_splits_and_unknown_sources_are_refused(data_dir: Path) -> None:
    (data_dir / "humaneval_test.jsonl").write_text('{"prompt": "def f(): pass"}\n')
    with pytest.raises(ConfigError, match="benchmark test split"):
        load_prompts([str(data_dir / "humaneval_test.jsonl")], data_dir=data_dir)
    with pytest.raises(ConfigError, match="unknown prompt source 'gsm8k_tset'"):
        load_prompts(["gsm8k_tset"], data_dir=data_dir)
