"""Prompt sets for benchmarks and training: loaders, published prompt templates, a test-split guard.

Where a split's rows come from, first match wins:
1. its file in the `data_dir` argument (the CLI's `--data-dir`), then in `$BLOCKSPEC_DATA`;
2. the copy bundled in this package (`data/`, the benchmark splits only; sources and licences in
   `data/README.md`), so benchmarks run offline out of the box;
3. the Hugging Face Hub, with the `datasets` library if it is installed and the machine is online.
Training paths ask with `bundled=False`: they never read a bundled benchmark split.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import os
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blockspec.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

ENV_VAR = "BLOCKSPEC_DATA"
BUNDLED_DIR = "data"  # beside this module: gzip JSON-lines copies of the benchmark splits

MATH_TEMPLATE = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{prompt}\n```"
)

Row = dict[str, Any]


@dataclass(frozen=True)
class Sample:
    """One prompt: the user turns in order (turn k+1 is asked after the model's answer to turn k)."""

    id: str
    turns: tuple[str, ...]
    reference: str | None = None

    def __post_init__(self) -> None:
        if not self.id:
            raise ConfigError("Sample.id must be a non-empty string")
        if not isinstance(self.turns, tuple) or not self.turns:
            raise ConfigError(f"Sample {self.id}: turns must be a non-empty tuple of strings")
        if not all(isinstance(t, str) and t for t in self.turns):
            raise ConfigError(f"Sample {self.id}: every turn must be a non-empty string")

    @property
    def prompt(self) -> str:
        """The first user turn (all there is for single-turn sets)."""
        return self.turns[0]


@dataclass(frozen=True)
class HubSource:
    """Where the Hub copy of a split lives (`datasets.load_dataset(path, config, split=split)`)."""

    path: str
    config: str | None
    split: str
    data_files: str | None = None


@dataclass(frozen=True)
class SplitSpec:
    """One split of a data set: its file, an optional row filter, and whether it is held out."""

    file: str
    hub: HubSource | None
    held_out: bool  # a benchmark split: never to be used for training
    keep: Callable[[Row], bool] | None = None
    bundled: str | None = None  # its copy shipped in BUNDLED_DIR, if any

    def __post_init__(self) -> None:
        if self.bundled is not None and not self.held_out:
            raise ConfigError(f"{self.bundled}: only benchmark (held-out) splits are bundled")


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    description: str
    splits: dict[str, SplitSpec]
    to_sample: Callable[[str, str, int, Row], Sample | None]  # (name, split, index, row); None: skip row

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", self.name):
            raise ConfigError(f"dataset name {self.name!r}: use lower-case letters, digits and '-'")
        if not self.splits:
            raise ConfigError(f"dataset {self.name!r} needs at least one split")

    @property
    def default_split(self) -> str:
        """`test` when the set has one (benchmark use), else its first split."""
        return "test" if "test" in self.splits else next(iter(self.splits))


# --- row -> Sample converters -------------------------------------------------------------------


def _gsm8k(name: str, split: str, i: int, row: Row) -> Sample:
    answer = str(row.get("answer", ""))
    final = answer.rsplit("####", 1)[-1].strip() if "####" in answer else None
    return Sample(f"{name}/{split}/{i}", (MATH_TEMPLATE.format(question=row["question"]),), final)


def _math500(name: str, split: str, i: int, row: Row) -> Sample:
    key = row.get("unique_id") or i
    return Sample(f"{name}/{split}/{key}", (MATH_TEMPLATE.format(question=row["problem"]),), row.get("answer"))


def _humaneval(name: str, split: str, i: int, row: Row) -> Sample:
    prompt = HUMANEVAL_TEMPLATE.format(prompt=row["prompt"])  # unstripped, as the published benchmark
    return Sample(f"{name}/{split}/{row['task_id']}", (prompt,), row.get("canonical_solution"))


def _mbpp(name: str, split: str, i: int, row: Row) -> Sample:
    # The Hub's `sanitized` config names the field `prompt`; the full config names it `text`.
    prompt = row.get("prompt") or row["text"]
    return Sample(f"{name}/{split}/{row['task_id']}", (prompt,), row.get("code"))


def _mtbench(name: str, split: str, i: int, row: Row) -> Sample:
    turns = row.get("turns") or row["prompt"]  # local file: `turns`; HuggingFaceH4 Hub copy: `prompt`
    key = row.get("question_id") or row.get("prompt_id") or i
    ref = row.get("reference")
    ref_text = ref[0] if isinstance(ref, list) and ref else (ref if isinstance(ref, str) and ref else None)
    return Sample(f"{name}/{split}/{key}", tuple(turns), ref_text)


def _alpaca(name: str, split: str, i: int, row: Row) -> Sample:
    if "instances" in row:  # seed tasks: one instruction, first instance's input/output
        inst = row["instances"][0] if row["instances"] else {}
        inp, out = inst.get("input", ""), inst.get("output")
    else:  # tatsu-lab/alpaca: flat instruction/input/output
        inp, out = row.get("input", ""), row.get("output")
    prompt = row["instruction"] + (f"\n\nInput:\n{inp}" if inp and inp.strip() else "")
    return Sample(f"{name}/{split}/{row.get('id', i)}", (prompt,), out)


def sharegpt_messages(row: Row) -> list[dict[str, str]]:
    """A ShareGPT record's turns as [{role, content}]: the local file has `messages` in that form,
    the raw dump (the Hub copy) `conversations` [{from, value}]."""
    return row.get("messages") or [
        {"role": "user" if m.get("from") == "human" else "assistant", "content": m.get("value", "")}
        for m in row.get("conversations", [])
    ]


def _sharegpt(name: str, split: str, i: int, row: Row) -> Sample | None:
    msgs = sharegpt_messages(row)
    user = next((m["content"] for m in msgs if m["role"] == "user"), "")
    reply = next((m["content"] for m in msgs if m["role"] == "assistant"), None)
    if not user.strip():  # raw dumps hold conversations without a user turn
        return None
    return Sample(f"{name}/{split}/{row.get('id', i)}", (user,), reply)


def _mbpp_split(split: str, held_out: bool, lo: int, hi: int, bundled: str | None = None) -> SplitSpec:
    hub = HubSource("google-research-datasets/mbpp", "sanitized", split)
    return SplitSpec("mbpp_sanitized.json", hub, held_out, lambda row: lo <= int(row["task_id"]) <= hi, bundled)


DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in (
        DatasetSpec(
            "gsm8k",
            "grade-school maths word problems (answer: the number after ####)",
            {
                "test": SplitSpec("gsm8k_test.jsonl", HubSource("openai/gsm8k", "main", "test"), True,
                                  bundled="gsm8k_test.jsonl.gz"),
                "train": SplitSpec("gsm8k_train.jsonl", HubSource("openai/gsm8k", "main", "train"), False),
            },
            _gsm8k,
        ),
        DatasetSpec(
            "math500",
            "MATH-500 competition maths",
            {"test": SplitSpec("math500_test.jsonl", HubSource("HuggingFaceH4/MATH-500", None, "test"), True,
                               bundled="math500_test.jsonl.gz")},
            _math500,
        ),
        DatasetSpec(
            "humaneval",
            "HumanEval Python function completion",
            {"test": SplitSpec("humaneval_test.jsonl", HubSource("openai/openai_humaneval", None, "test"), True,
                               bundled="humaneval_test.jsonl.gz")},
            _humaneval,
        ),
        DatasetSpec(
            "mbpp",
            "MBPP (sanitized) Python problems; the prompt as-is, no test case appended",
            {
                # The original MBPP task-id ranges of each split; the Hub copy is split the same way.
                "test": _mbpp_split("test", True, 11, 510, "mbpp_sanitized_test.jsonl.gz"),
                "validation": _mbpp_split("validation", True, 511, 600),
                "train": _mbpp_split("train", False, 601, 974),
                "prompt": _mbpp_split("prompt", False, 1, 10),
            },
            _mbpp,
        ),
        DatasetSpec(
            "mt-bench",
            "MT-Bench, two user turns per sample",
            {
                "test": SplitSpec(
                    "mtbench_questions.jsonl", HubSource("HuggingFaceH4/mt_bench_prompts", None, "train"), True,
                    bundled="mtbench_questions.jsonl.gz",
                )
            },
            _mtbench,
        ),
        DatasetSpec(
            "alpaca",
            "Stanford Alpaca human-written seed tasks (instruction plus input when present)",
            # Used as a benchmark here, so held out from training; the Hub fallback is the full set.
            {"test": SplitSpec("alpaca_seed_tasks.jsonl", HubSource("tatsu-lab/alpaca", None, "train"), True,
                               bundled="alpaca_seed_tasks.jsonl.gz")},
            _alpaca,
        ),
        DatasetSpec(
            "sharegpt",
            "ShareGPT first user turns (first assistant reply as reference); training prompts",
            {
                "train": SplitSpec(
                    "sharegpt_first_turns.jsonl",
                    HubSource(
                        "anon8231489123/ShareGPT_Vicuna_unfiltered",
                        None,
                        "train",
                        "ShareGPT_V3_unfiltered_cleaned_split.json",
                    ),
                    False,
                )
            },
            _sharegpt,
        ),
    )
}


# --- data directories, the bundled copies, the Hub ----------------------------------------------


def search_dirs(data_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """The directories searched for data files, in order: `data_dir`, then `$BLOCKSPEC_DATA`."""
    given = [data_dir, os.environ.get(ENV_VAR) or None]
    return [Path(d).expanduser() for d in given if d is not None]


def data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The first existing directory of `search_dirs`, or None."""
    return next((d for d in search_dirs(data_dir) if d.is_dir()), None)


def find_file(file: str, data_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """`file` in the first directory of `search_dirs` that holds it, or None."""
    return next((d / file for d in search_dirs(data_dir) if (d / file).is_file()), None)


def where_to_put(file: str, data_dir: str | os.PathLike[str] | None = None) -> str:
    """The advice for a missing data file: what to pass, and where we looked."""
    searched = ", ".join(str(d) for d in search_dirs(data_dir)) or f"no --data-dir given, {ENV_VAR} unset"
    return f"pass --data-dir DIR (or set {ENV_VAR}=DIR) naming a folder that holds {file} (looked in: {searched})"


def bundled_path(file: str) -> Traversable:
    """A bundled data file (see `data/README.md` for its source and licence)."""
    return importlib.resources.files(__package__) / BUNDLED_DIR / file


def _read_bundled(file: str) -> Iterator[Row]:
    with bundled_path(file).open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _read_rows(path: Path) -> Iterator[Row]:
    if path.suffix == ".json":
        rows = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(rows, list):
            raise CheckpointError(f"{path}: expected a JSON list of records")
        yield from rows
        return
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise CheckpointError(f"{path}:{lineno}: not valid JSON ({e}); replace the file") from e


def _hub_rows(name: str, split: str, hub: HubSource, advice: str) -> Iterable[Row]:
    hint = f"{advice}, or install `datasets` and go online to fetch {hub.path} from the Hugging Face Hub"
    try:
        import datasets as hf_datasets  # optional; imported only when a file is missing
    except ImportError as e:
        raise CheckpointError(f"data set {name}/{split} not found: {hint}") from e
    kwargs: dict[str, Any] = {"split": hub.split}
    if hub.data_files:
        kwargs["data_files"] = hub.data_files
    try:
        return hf_datasets.load_dataset(hub.path, hub.config, **kwargs)
    except Exception as e:  # offline, gated, renamed...: all end in the same advice
        raise CheckpointError(f"data set {name}/{split} not found and the Hub fetch failed ({e}): {hint}") from e


def _spec(name: str) -> DatasetSpec:
    spec = DATASETS.get(name.lower())
    if spec is None:
        raise ConfigError(f"unknown data set {name!r}; known: {', '.join(DATASETS)}")
    return spec


def _split(spec: DatasetSpec, split: str | None) -> tuple[str, SplitSpec]:
    split = spec.default_split if split is None else split
    if split not in spec.splits:
        raise ConfigError(f"data set {spec.name!r} has no split {split!r}; it has: {', '.join(spec.splits)}")
    return split, spec.splits[split]


def split_rows(
    name: str,
    split: str | None = None,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    bundled: bool = True,
) -> Iterable[Row]:
    """The raw records of one split, from the first place that has them (module docstring).

    `bundled=False` skips the copies shipped in the package: training paths pass it.
    """
    spec = _spec(name)
    split, sp = _split(spec, split)
    found = find_file(sp.file, data_dir)
    if found is not None:
        rows: Iterable[Row] = _read_rows(found)
    elif bundled and sp.bundled is not None:
        rows = _read_bundled(sp.bundled)
    else:
        advice = where_to_put(sp.file, data_dir)
        if sp.hub is None:
            raise CheckpointError(f"data set {spec.name}/{split} not found: {advice}")
        return _hub_rows(spec.name, split, sp.hub, advice)  # the Hub split is already the right range
    return (r for r in rows if sp.keep is None or sp.keep(r))


def load_dataset(
    name: str,
    *,
    split: str | None = None,
    limit: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    data_dir: str | os.PathLike[str] | None = None,
) -> list[Sample]:
    """Load a prompt set with its published template applied.

    `split=None` means the set's default split (`test` for benchmark sets, `train` for sharegpt).
    `limit=N` without `shuffle` keeps the first N samples in file order (the benchmark convention:
    "the first 64 GSM8K test prompts"); with `shuffle=True` it takes a `seed`-determined random
    subset, and a smaller limit with the same seed is a prefix of a larger one.
    """
    if limit is not None and limit < 0:
        raise ConfigError(f"limit must be >= 0, got {limit}")
    spec = _spec(name)
    split, _ = _split(spec, split)
    rows = split_rows(spec.name, split, data_dir=data_dir)
    made = (spec.to_sample(spec.name, split, i, row) for i, row in enumerate(rows))
    samples = [s for s in made if s is not None]
    if shuffle:
        random.Random(seed).shuffle(samples)
    return samples if limit is None else samples[:limit]


CONTEXT_INTRO = "Some other problems, for reference only:\n\n"
CONTEXT_OUTRO = "\n\nNow solve this one:\n\n"


def token_counter(tokenizer: Any) -> Callable[[str], int]:
    """The number of tokens a text encodes to (no special tokens): `with_context`'s count."""
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def with_context(samples: Sequence[Sample], pool: Sequence[Sample], tokens: int,
                 count: Callable[[str], int]) -> list[Sample]:
    """Each sample with other problems in front of its first turn, until that turn holds at least
    `tokens` tokens (by `count`): the same tasks, decoded over a long context.

    The other problems are the first turns of `pool` (the whole set, say) in order, starting
    after the sample itself and wrapping around, never the sample itself. tokens 0: unchanged.
    """
    if tokens < 0:
        raise ConfigError(f"context tokens must be >= 0, got {tokens}")
    if tokens == 0:
        return list(samples)
    out = []
    for sample in samples:
        ids = [s.id for s in pool]
        start = ids.index(sample.id) + 1 if sample.id in ids else 0
        others = [pool[(start + i) % len(pool)] for i in range(len(pool))]
        others = [o.prompt for o in others if o.id != sample.id]
        have = count(CONTEXT_INTRO + CONTEXT_OUTRO + sample.prompt)
        used: list[str] = []
        for text in others:
            if have >= tokens:
                break
            used.append(text)
            have += count("\n\n" + text)
        if have < tokens:
            raise ConfigError(f"{sample.id}: the other prompts hold only {have} of the {tokens} context tokens "
                              "asked for; ask for fewer")
        first = CONTEXT_INTRO + "\n\n".join(used) + CONTEXT_OUTRO + sample.prompt
        out.append(Sample(sample.id, (first, *sample.turns[1:]), sample.reference))
    return out


def is_held_out(name: str, split: str | None = None) -> bool:
    """True for benchmark splits (never train on them)."""
    spec = _spec(name)
    return _split(spec, split)[1].held_out


def training_prompts(
    names: Sequence[str],
    limit: int | None = None,
    seed: int = 0,
    *,
    data_dir: str | os.PathLike[str] | None = None,
) -> list[Sample]:
    """Training prompts from `names` ("sharegpt", "gsm8k:train", ...), mixed and seeded-shuffled.

    A bare name means its `train` split. Asking for a benchmark split (gsm8k test, math500,
    humaneval, MBPP test range, mt-bench, alpaca seed tasks) raises ConfigError: training on what
    we measure would inflate acceptance numbers.
    """
    if not names:
        raise ConfigError("training_prompts needs at least one data set name, e.g. ['sharegpt', 'gsm8k:train']")
    chosen: list[tuple[str, str]] = []
    for entry in names:
        name, _, split = entry.partition(":")
        spec = _spec(name)
        split = split or ("train" if "train" in spec.splits else spec.default_split)
        split, sp = _split(spec, split)
        if sp.held_out:
            trainable = [f"{n}:{s}" for n, d in DATASETS.items() for s, p in d.splits.items() if not p.held_out]
            raise ConfigError(
                f"{spec.name}:{split} is a benchmark split and must not be used for training; "
                f"use one of: {', '.join(trainable)}"
            )
        chosen.append((spec.name, split))
    samples = [s for name, split in chosen for s in load_dataset(name, split=split, data_dir=data_dir)]
    random.Random(seed).shuffle(samples)
    return samples if limit is None else samples[:limit]
