"""The documents of the lm-eval tasks in this folder, read from files shipped with blockspec, so
the tasks run offline (lm-eval loads this file by path: `custom_dataset: !function docs.NAME`)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
GSM8K = HERE.parents[1] / "datasets" / "data" / "gsm8k_test.jsonl.gz"
GSM8K_SHOTS = 2  # the first records are the few-shot examples, the next ones the documents
GSM8K_DOCS = 4


def _records(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def gsm8k(**_: object) -> object:
    """A few GSM8K test problems, and the two before them as few-shot examples."""
    import datasets

    rows = _records(GSM8K)
    return datasets.DatasetDict({
        "train": datasets.Dataset.from_list(rows[:GSM8K_SHOTS]),
        "test": datasets.Dataset.from_list(rows[GSM8K_SHOTS:GSM8K_SHOTS + GSM8K_DOCS]),
    })


def multiple_choice(**_: object) -> object:
    """The questions of mc_questions.jsonl (question, choices, answer: the right choice's index)."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(_records(HERE / "mc_questions.jsonl"))})
