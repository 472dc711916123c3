"""Prompt sources of `blockspec datagen`: held-out questions stay out, test splits are refused."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from blockspec.errors import ConfigError
from blockspec.train.data import _stub, heldout_prompts, load_prompts


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
    with pytest.raises(ConfigError, match="held-out prompts come from one of gsm8k_train, gsm8k_code, py_stubs"):
        heldout_prompts(2, data_dir=data_dir, source="sharegpt")


def test_test_splits_and_unknown_sources_are_refused(data_dir: Path) -> None:
    (data_dir / "humaneval_test.jsonl").write_text('{"prompt": "def f(): pass"}\n')
    with pytest.raises(ConfigError, match="benchmark test split"):
        load_prompts([str(data_dir / "humaneval_test.jsonl")], data_dir=data_dir)
    with pytest.raises(ConfigError, match="unknown prompt source 'gsm8k_tset'"):
        load_prompts(["gsm8k_tset"], data_dir=data_dir)


def test_stub_of_a_method_drops_self_and_keeps_defaults_aligned() -> None:
    src = 'class C:\n    def pad(self, text: str, width=8, *, fill=" ") -> str:\n        """Pad."""\n        return text\n'
    node = ast.parse(src).body[0].body[0]
    stub = _stub(node, "Pad text on the left to width.\n\n>>> pad('a', 3)\n'  a'")
    assert stub.startswith("def pad(text: str, width=8, *, fill=' ') -> str:\n    \"\"\"\n    Pad text on the left")
    assert "\n    >>> pad('a', 3)\n" in stub and stub.endswith('    """\n')
    ast.parse(stub + "    pass\n")  # a valid function to complete


def test_py_stubs_are_standard_library_functions_with_a_spread_holdout(data_dir: Path) -> None:
    all_stubs = heldout_prompts(10**6, data_dir=data_dir, source="py_stubs")
    ids = [p.id for p in all_stubs]
    assert len(ids) > 1000 and len(set(ids)) == len(ids)  # resumable: one id per function
    assert not any(".test." in i or i.startswith("py_stub:test.") or "idlelib" in i for i in ids)
    for p in all_stubs[:50]:
        code = p.messages[-1]["content"].split("```python\n", 1)[1].rsplit("```", 1)[0]
        ast.parse(code + "    pass\n")
    held = {p.id for p in heldout_prompts(64, data_dir=data_dir, source="py_stubs")}
    train = load_prompts(["py_stubs"], data_dir=data_dir, holdout=64)
    assert len(train) == len(ids) - 64 and held.isdisjoint(p.id for p in train)
    # hash order, not file order: the held-out set spans the library, not its first modules
    assert len({i.split(":")[1].split(".")[0] for i in held}) > 20
