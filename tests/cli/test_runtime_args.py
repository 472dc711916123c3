"""The verbs that load a model to decode take one set of runtime flags (commands/model_args.py):
the same values accepted and handed to `blockspec.load`, the same values refused by argparse."""

from __future__ import annotations

import pytest
from support import run_cli

import blockspec.api
from blockspec.commands import model_args
from blockspec.errors import ConfigError

# each verb with what it needs besides the runtime flags (serve: any free port; bench: one prompt)
VERBS = {"generate": ["--prompt", "x"], "demo": [], "serve": ["--port", "0"], "bench": ["--limit", "1"]}
DECODING_VERBS = ("generate", "demo", "serve")  # bench sweeps block sizes, adaptive and lookup instead
TREE_VERBS = (*DECODING_VERBS, "bench")  # bench: --tree-nodes N runs chains and trees of N

GOOD_MODEL = [
    *((["--dtype", d], "dtype", d) for d in ("float32", "bfloat16", "float16", "float64")),
    *((["--drafter-dtype", d], "drafter_dtype", d) for d in ("auto", "float32", "bfloat16", "float16")),
    *((["--device", d], "device", d) for d in ("cpu", "cuda", "cuda:1", "mps")),
    *((["--compute", c], "compute", c) for c in ("exact", "int8", "auto")),
    (["--target", "some/model"], "target", "some/model"),
    (["--drafter", "fresh"], "drafter", "fresh"),
]
GOOD_DECODING = [
    (["--block-size", "4"], "block_size", 4),
    (["--no-adaptive-block"], "adaptive_block", False),
    (["--adaptive-block"], "adaptive_block", True),
    (["--no-lookup"], "lookup", False),
    (["--lookup"], "lookup", True),
]
GOOD_TREES = [(["--tree-nodes", "8"], "tree_nodes", 8), (["--tree-nodes", "1"], "tree_nodes", 1),
              (["--tree-nodes", "0"], "tree_nodes", 0)]
BAD_MODEL = [["--dtype", "fp32"], ["--dtype", "int8"], ["--dtype", "auto"], ["--drafter-dtype", "int4"],
             ["--device", "gpu"], ["--device", "cuda:x"], ["--device", "CPU"], ["--device", ""],
             ["--compute", "int4"], ["--compute", "fast"]]
BAD_DECODING = [["--block-size", "0"], ["--block-size", "-2"], ["--block-size", "four"]]
BAD_TREES = [["--tree-nodes", "-1"], ["--tree-nodes", "many"]]


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """`blockspec.load` replaced by one that records its keywords and stops the verb there."""
    calls: list[dict] = []

    def load(**kwargs):
        calls.append(kwargs)
        raise ConfigError("recorded")

    monkeypatch.setattr(blockspec.api, "load", load)
    return calls


def _run(verb: str, flags: list[str]):
    return run_cli(verb, *VERBS[verb], *flags)


@pytest.mark.parametrize("verb", VERBS)
def test_each_verb_hands_load_the_same_accepted_values(verb: str, recorded: list[dict]) -> None:
    cases = (GOOD_MODEL + (GOOD_DECODING if verb in DECODING_VERBS else [])
             + (GOOD_TREES if verb in TREE_VERBS else []))
    for flags, key, value in cases:
        r = _run(verb, flags)
        assert r.returncode == 2 and r.stderr.strip().endswith("error: recorded"), (verb, flags, r.stderr)
        assert recorded[-1][key] == value, (verb, flags)
    assert len(recorded) == len(cases)
    defaults = _run(verb, [])
    assert defaults.returncode == 2
    expected = {"target": model_args.DEFAULT_TARGET, "drafter": None, "dtype": "float32", "drafter_dtype": "auto",
                "device": "cpu", "compute": "auto"}
    if verb in DECODING_VERBS:
        expected |= {"block_size": None, "adaptive_block": True, "lookup": True}
    if verb in TREE_VERBS:
        expected |= {"tree_nodes": None}  # load's default (DEFAULT_TREE_NODES)
    assert {k: recorded[-1][k] for k in expected} == expected


@pytest.mark.parametrize("verb", VERBS)
def test_each_verb_refuses_the_same_values_with_a_usage_error(verb: str, recorded: list[dict]) -> None:
    for flags in BAD_MODEL + BAD_DECODING + (BAD_TREES if verb in TREE_VERBS else []):
        r = _run(verb, flags)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (verb, flags)
        assert r.stderr.startswith("usage: blockspec " + verb), (verb, flags, r.stderr)
        assert f"argument {flags[0]}" in r.stderr, r.stderr  # bench: its --block-sizes, abbreviated
    assert recorded == []  # nothing loaded


def test_the_flag_table_matches_what_load_takes() -> None:
    import inspect

    from blockspec.targets.base import DTYPES
    from blockspec.targets.native.backends import COMPUTES

    assert set(model_args.DTYPE_NAMES) == set(DTYPES)
    assert set(model_args.COMPUTE_NAMES) == set(COMPUTES)
    parameters = inspect.signature(blockspec.api.load).parameters
    assert all(f.kwarg in parameters for f in model_args.FLAGS)
    with pytest.raises(ValueError, match="unknown runtime flags"):
        model_args.add_runtime_arguments(__import__("argparse").ArgumentParser(), ("dtype", "colour"))


def test_a_command_line_repeats_the_runtime_flags() -> None:
    from blockspec.cli import build_parser

    flags = ["--target", "t", "--dtype", "bfloat16", "--device", "cuda:1", "--block-size", "4", "--no-lookup"]
    args = build_parser("generate").parse_args(["generate", "--prompt", "x", *flags])
    spelled = model_args.command_args(args)
    assert spelled == ["--target", "t", "--dtype", "bfloat16", "--drafter-dtype", "auto", "--device", "cuda:1",
                       "--compute", "auto", "--block-size", "4", "--adaptive-block", "--no-lookup"]  # --drafter None: left out
    again = build_parser("generate").parse_args(["generate", "--prompt", "x", *spelled])
    assert model_args.load_kwargs(again) == model_args.load_kwargs(args)
    bench = build_parser("bench").parse_args(["bench", "--drafter", "fresh", "--dtype", "float16"])
    from blockspec.commands.bench import command_line

    line = command_line(bench)
    assert "--drafter fresh --dtype float16 --drafter-dtype auto --device cpu --compute auto" in line
    assert "--block-size" not in line


def test_the_verbs_with_their_own_device_flag_refuse_the_same_strings(recorded: list[dict]) -> None:
    """train declares its own --device (its default: cuda when there is one); datagen and evaluate
    take the shared one. The same strings are refused."""
    for verb, extra in (("train", ["--data", "d"]), ("datagen", ["--out", "o"]), ("evaluate", ["--drafter", "d"])):
        r = run_cli(verb, *extra, "--device", "gpu")
        assert r.returncode == 2 and r.stderr.startswith(f"usage: blockspec {verb}"), (verb, r.stderr)
        assert "argument --device: expected cpu, cuda, cuda:N or mps, got 'gpu'" in r.stderr
