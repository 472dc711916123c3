"""Python API and `blockspec generate` on a tiny model directory with a real tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import blockspec
from blockspec.errors import CheckpointError, ConfigError
from blockspec.text import IncrementalDetokenizer, StopStrings
from support import run_cli

MESSAGES = [{"role": "user", "content": "How much does Janet make?"}]


@pytest.fixture(scope="module")
def pipe(tiny_model_dir: Path, tiny_drafter_dir: Path):
    return blockspec.load(str(tiny_model_dir), str(tiny_drafter_dir))


def test_generate_chat_equals_plain_decoding(pipe) -> None:
    fast = pipe.generate(MESSAGES, max_new_tokens=24, ignore_eos=True)
    plain = pipe.generate(MESSAGES, max_new_tokens=24, ignore_eos=True, block_size=1)
    assert fast.token_ids == plain.token_ids
    assert len(fast.token_ids) == 24 and fast.finish_reason == "length"
    assert fast.text == pipe.tokenizer.decode(fast.token_ids, skip_special_tokens=True)
    assert fast.stats.block_size == 4 and plain.stats.block_size == 1
    assert fast.stats.prefill_s > 0 and fast.tokens_per_s > 0
    assert pipe.adaptive_block  # the default: each step picks its block size, up to the drafter's


def test_fixed_blocks_on_request(tiny_model_dir: Path, tiny_drafter_dir: Path) -> None:
    fixed = blockspec.load(str(tiny_model_dir), str(tiny_drafter_dir), adaptive_block=False)
    out = fixed.generate(MESSAGES, max_new_tokens=12, ignore_eos=True)
    assert not fixed.adaptive_block and fixed.decoder.block_choices == {}
    plain = fixed.generate(MESSAGES, max_new_tokens=12, ignore_eos=True, block_size=1)
    assert out.token_ids == plain.token_ids


def test_chat_template_applied_and_thinking_switch(pipe) -> None:
    ids = pipe.encode(MESSAGES)
    text = pipe.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    off = pipe.tokenizer.decode(pipe.encode(MESSAGES, enable_thinking=False))
    assert off.endswith("<think>\n\n</think>\n\n")


def test_batch_with_different_prompt_lengths(pipe) -> None:
    prompts = [MESSAGES, [{"role": "user", "content": "def add(a, b): return a + b. Explain it in detail."}]]
    batch = pipe.generate_batch(prompts, max_new_tokens=16, ignore_eos=True)
    alone = [pipe.generate(p, max_new_tokens=16, ignore_eos=True) for p in prompts]
    assert [c.token_ids for c in batch] == [c.token_ids for c in alone]


def test_stop_string_truncates_text_and_tokens(pipe) -> None:
    full = pipe.generate(MESSAGES, max_new_tokens=30, ignore_eos=True)
    # Choose a stop string that appears in the middle of the greedy text.
    visible = full.text
    assert len(visible) > 6
    stop = visible[len(visible) // 2 : len(visible) // 2 + 3]
    cut = pipe.generate(MESSAGES, max_new_tokens=30, ignore_eos=True, stop=(stop,))
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and visible.startswith(cut.text)
    assert cut.text == visible[: visible.find(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]


def test_stream_yields_the_same_text(pipe) -> None:
    stream = pipe.stream(MESSAGES, chat=True, max_new_tokens=20, ignore_eos=True)
    assert isinstance(stream, blockspec.TextStream)
    pieces = list(stream)
    assert pieces and all(isinstance(p, str) for p in pieces)  # text only, as typed
    done = stream.completion
    assert isinstance(done, blockspec.Completion)
    assert "".join(pieces) == done.text
    assert done.token_ids == pipe.generate(MESSAGES, max_new_tokens=20, ignore_eos=True).token_ids
    assert list(stream) == []  # a finished stream stays finished


def test_stream_completion_decodes_what_was_not_read(pipe) -> None:
    """Asked before the stream ends, `completion` finishes the generation: the same result."""
    stream = pipe.stream(MESSAGES, chat=True, max_new_tokens=20, ignore_eos=True)
    first = next(stream)
    done = stream.completion
    assert done.text.startswith(first)
    assert done.token_ids == pipe.generate(MESSAGES, max_new_tokens=20, ignore_eos=True).token_ids
    assert list(stream) == []


def test_stream_reraises_a_failed_generation(pipe, monkeypatch) -> None:
    def fail(*_a, **_k):
        raise RuntimeError("decoder broke")

    monkeypatch.setattr(pipe, "generate_ids", fail)
    stream = pipe.stream(MESSAGES, chat=True, max_new_tokens=5)
    with pytest.raises(RuntimeError, match="decoder broke"):
        list(stream)
    with pytest.raises(RuntimeError, match="generation failed"):
        stream.completion


def test_incremental_detokenizer_holds_back_stop_prefix(pipe) -> None:
    tok = pipe.tokenizer
    ids = tok("Janet has 16 ducks", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(StopStrings(tok, ("ducks",)))
    out = "".join(detok.push([t]) for t in ids) + detok.push([], final=True)
    assert out == "Janet has 16 "


def test_load_errors(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no drafter ships"):
        blockspec.load(str(tiny_model_dir))
    with pytest.raises(CheckpointError, match="does not exist"):
        blockspec.load(str(tiny_model_dir), str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="dtype must be"):
        blockspec.load(str(tiny_model_dir), "none", dtype="int8")
    with pytest.raises(ConfigError, match="lookup must be True, False or a LookupConfig"):
        blockspec.load(str(tiny_model_dir), "none", lookup="yes")


def _process(*args: str) -> subprocess.CompletedProcess:
    """`blockspec ARGS` as a real process: what a shell sees (exit code, no traceback)."""
    return subprocess.run([sys.executable, "-m", "blockspec.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_generate_compare_json(tiny_model_dir: Path, tiny_drafter_dir: Path) -> None:
    r = run_cli("generate", "--target", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir),
             "--prompt", "How much does Janet make?", "--max-new-tokens", "12", "--compare", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["identical"] is True
    assert report["dflash"]["block_size"] == 4 and report["plain"]["block_size"] == 1
    assert report["speedup"] > 0 and report["dflash"]["generated_tokens"] >= 1


def test_cli_generate_lookup_on_by_default_and_off_on_request(tiny_model_dir: Path, tiny_drafter_dir: Path) -> None:
    base = ("generate", "--target", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir),
            "--prompt", "one two three one two three one two", "--max-new-tokens", "40", "--compare", "--json",
            "--no-adaptive-block")  # every step drafts, so proposals come from lookup whatever the timing
    on, off = run_cli(*base), run_cli(*base, "--no-lookup")
    assert on.returncode == 0 and off.returncode == 0, on.stderr + off.stderr
    on, off = json.loads(on.stdout), json.loads(off.stdout)
    assert on["identical"] and off["identical"] and on["text"] == off["text"]
    assert on["dflash"]["lookup_steps"] > 0 and off["dflash"]["lookup_steps"] == 0


def test_cli_generate_adaptive_block_by_default(tiny_model_dir: Path, tiny_drafter_dir: Path) -> None:
    base = ("generate", "--target", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir),
            "--prompt", "How much does Janet make?", "--max-new-tokens", "12", "--compare", "--json")
    for extra in ((), ("--adaptive-block",)):  # the default, and the flag of earlier versions
        r = run_cli(*base, *extra)
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        assert report["identical"] is True
        choices = {int(b): n for b, n in report["block_choices"].items()}
        assert choices and set(choices) <= set(range(1, 5)) and sum(choices.values()) >= 1
    r = run_cli(*base, "--no-adaptive-block")  # the published behaviour: the whole block every step
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["identical"] is True and "block_choices" not in report
    assert report["dflash"]["block_size"] == 4


def test_cli_demo_adaptive_by_default(tiny_model_dir: Path, tiny_drafter_dir: Path) -> None:
    r = run_cli("demo", "--target", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir), "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert "block size adaptive, up to 4" in r.stderr and "steps per block size" in r.stderr
    assert "output identical to plain decoding: True" in r.stderr
    r = run_cli("demo", "--target", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir), "--max-new-tokens", "12",
             "--block-size", "3", "--no-adaptive-block")  # the flags of every verb that decodes
    assert r.returncode == 0, r.stderr
    assert "block size 3" in r.stderr and "block 3)" in r.stderr


def test_cli_demo_beside_busy_processes(tiny_model_dir: Path, tiny_drafter_dir: Path) -> None:
    r = run_cli("demo", "--target", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir), "--max-new-tokens", "8",
             "--busy", "1")
    assert r.returncode == 0, r.stderr
    assert "Running beside 1 CPU-bound process" in r.stderr and "output identical to plain decoding: True" in r.stderr
    r = run_cli("demo", "--target", str(tiny_model_dir), "--busy", "-1")
    assert r.returncode == 2 and "--busy must be >= 0" in r.stderr


def test_cli_generate_streams_and_summarises(tiny_model_dir: Path, tiny_drafter_dir: Path) -> None:
    r = _process("generate", "--target", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir),
             "--prompt", "Hello", "--max-new-tokens", "8", "--compare")
    assert r.returncode == 0, r.stderr
    assert "[dflash]" in r.stderr and "speedup" in r.stderr and "identical" in r.stderr


def test_cli_bad_input_is_one_clear_line(tiny_model_dir: Path) -> None:
    r = _process("generate", "--target", str(tiny_model_dir), "--drafter", "none", "--prompt", "x",
             "--temperature", "-1")
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: temperature must be") and "Traceback" not in r.stderr
    r = _process("generate", "--target", "/nonexistent/model", "--prompt", "x")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith("error: model '/nonexistent/model' not found")  # not "no drafter ships"


def test_cli_evaluate_compares_drafters_on_heldout_prompts(tiny_model_dir: Path, tiny_drafter_dir: Path,
                                                            tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "gsm8k_train.jsonl", "w") as f:
        for i in range(5):
            f.write(json.dumps({"question": f"Tom has {i + 3} apples and eats {i}. How many are left?",
                                "answer": f"#### {3}"}) + "\n")
    args = ("evaluate", "--target", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir), "--drafter",
            str(tiny_drafter_dir), "--prompts", "3", "--max-new-tokens", "8", "--data-dir", str(data))
    r = run_cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 2 and all(row["prompts"] == 3 and row["block_size"] == 4 for row in rows)
    assert 0 < rows[0]["generated_tokens"] <= 3 * 8 and rows[0]["steps"] >= rows[0]["generated_tokens"] / 4
    # the prefill makes each prompt's first token; every step after it commits tau tokens on average
    assert 1.0 <= rows[0]["tau"] <= 4.0 and rows[0]["tau"] * rows[0]["steps"] + 3 >= rows[0]["generated_tokens"]
    assert rows[0]["tau"] == rows[1]["tau"]  # greedy: the same drafter scores the same
    r = run_cli(*args[:5], "--prompts", "2", "--max-new-tokens", "4", "--data-dir", str(data), "--block-size", "2")
    assert r.returncode == 0, r.stderr
    assert "held-out gsm8k_train prompts: 2" in r.stdout and str(tiny_drafter_dir) in r.stdout
    r = run_cli(*args[:5], "--prompts", "2", "--max-new-tokens", "4", "--data-dir", str(data), "--heldout", "gsm8k_code")
    assert r.returncode == 0, r.stderr
    assert "held-out gsm8k_code prompts: 2" in r.stdout
    r = run_cli(*args[:5], "--prompts", "2", "--max-new-tokens", "4", "--data-dir", str(data), "--heldout", "py_stubs")
    assert r.returncode == 0, r.stderr
    assert "held-out py_stubs prompts: 2" in r.stdout
    r = run_cli(*args[:5], "--prompts", "0")
    assert r.returncode == 2 and r.stderr.strip() == "error: --prompts must be >= 1, got 0"
    # --context: the other held-out prompts in front of each one
    r = run_cli(*args[:5], "--prompts", "5", "--max-new-tokens", "4", "--data-dir", str(data), "--json")
    alone = json.loads(r.stdout)["prompt_tokens"]
    r = run_cli(*args[:5], "--prompts", "5", "--max-new-tokens", "4", "--data-dir", str(data), "--context", "100")
    assert r.returncode == 0, r.stderr
    assert "at least 100 tokens of context" in r.stdout
    r = run_cli(*args[:5], "--prompts", "5", "--max-new-tokens", "4", "--data-dir", str(data), "--context", "100", "--json")
    assert json.loads(r.stdout)["prompt_tokens"] >= max(100, alone + 40)  # the other prompts in front


class _Recording:
    """A pipeline whose generate_ids calls are recorded as (block_size, max_new_tokens)."""

    def __init__(self, pipe) -> None:
        self._pipe, self.calls = pipe, []

    def __getattr__(self, name: str):
        return getattr(self._pipe, name)

    def generate_ids(self, prompts, params, *, block_size=None, on_tokens=None):
        self.calls.append((block_size, params.max_new_tokens))
        return self._pipe.generate_ids(prompts, params, block_size=block_size, on_tokens=on_tokens)


def test_compare_warms_both_sides_alike_then_alternates(pipe) -> None:
    from blockspec.commands.generate import compare
    from blockspec.config import SamplingParams

    rec = _Recording(pipe)
    ids = pipe.encode(MESSAGES)
    cmp = compare(rec, ids, SamplingParams(max_new_tokens=40, ignore_eos=True), runs=2, warmup_tokens=8)
    # one uncounted warm-up of each side, of the same length, then timed runs D P P D
    assert rec.calls == [(1, 8), (None, 8), (None, 40), (1, 40), (1, 40), (None, 40)]
    assert cmp.order == ["dflash", "plain", "plain", "dflash"] and len(cmp.dflash) == len(cmp.plain) == 2
    assert cmp.identical and all(len(r.token_ids) == 40 for r in cmp.dflash + cmp.plain)
    n, seconds = 80, sum(r.stats.prefill_s + r.stats.decode_s for r in cmp.plain)
    assert cmp.tokens_per_s(cmp.plain) == pytest.approx(n / seconds)
    assert cmp.speedup == pytest.approx(cmp.tokens_per_s(cmp.dflash) / cmp.tokens_per_s(cmp.plain))
    assert sum(cmp.block_choices.values()) == sum(r.stats.steps for r in cmp.dflash)  # timed steps only
    assert "D P P D" in cmp.describe() and "8-token warm-up of each" in cmp.describe()


def test_cli_generate_compare_says_what_was_timed(tiny_model_dir: Path, tiny_drafter_dir: Path) -> None:
    base = ("generate", "--target", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir),
            "--prompt", "How much does Janet make?", "--max-new-tokens", "12", "--compare")
    r = run_cli(*base, "--compare-runs", "1")
    assert r.returncode == 0, r.stderr
    assert "[timed ] 1 run(s) of each side, in the order D P" in r.stderr and "warm-up of each" in r.stderr
    r = run_cli(*base, "--temperature", "0.8", "--seed", "1", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["identical"] is None and "D P P D" in report["timed"]  # sampled: not compared token by token
    r = run_cli(*base, "--compare-runs", "0")
    assert r.returncode == 2 and r.stderr.strip() == "error: --compare-runs must be >= 1, got 0"


def test_no_shipped_drafter_fails_before_loading_or_downloading(tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(cache))
    for target in ("qwen2.5-coder-0.5b-instruct", "someorg/some-model"):  # a zoo model not pulled; a Hub id
        r = run_cli("generate", "--target", target, "--prompt", "x")
        assert r.returncode == 2
        line = r.stderr.strip()
        assert line.count("\n") == 0 and line.startswith(f"error: no drafter ships for target '{target}'")
        assert "--drafter fresh" in line and "--drafter none" in line and "--drafter DIR" in line
        assert "drafter=" not in line and "smollm2-135m-instruct" in line  # names the models that have one
    assert not cache.exists()  # nothing downloaded, nothing converted
    with pytest.raises(CheckpointError, match='drafter="fresh"') as e:  # Python phrasing for the Python API
        blockspec.load("qwen2.5-coder-0.5b-instruct")
    assert "--drafter" not in str(e.value)
    assert not cache.exists()


def test_broken_drafter_directory_fails_before_the_target_loads(tmp_path: Path) -> None:
    r = run_cli("generate", "--target", "/nonexistent/model", "--drafter", str(tmp_path / "missing"), "--prompt", "x")
    # the drafter is checked first: its error, not the target's
    assert r.returncode == 2 and r.stderr.strip() == f"error: drafter directory {tmp_path / 'missing'} does not exist"


def test_version() -> None:
    for cmd in (["-m", "blockspec"], ["-m", "blockspec.cli"]):
        r = subprocess.run([sys.executable, *cmd, "--version"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == f"blockspec {blockspec.__version__}"
    from importlib.metadata import version

    assert version("blockspec") == blockspec.__version__  # one source: pyproject reads __version__


def test_every_verb_defaults_to_the_demo_model_adaptive_with_lookup(capsys) -> None:
    from blockspec.cli import build_parser, main
    from blockspec.commands import DEFAULT_TARGET

    assert DEFAULT_TARGET == "smollm2-135m-instruct"
    required = {"datagen": ["--out", "o"], "train": ["--data", "d"], "evaluate": ["--drafter", "d"]}
    for verb, extra in required.items():  # the verbs that do not decode take the same model
        assert build_parser(verb).parse_args([verb, *extra]).target == DEFAULT_TARGET, verb
    for verb, extra in (("generate", ["--prompt", "x"]), ("serve", []), ("bench", []), ("demo", [])):
        args = build_parser(verb).parse_args([verb, *extra])
        assert args.target == DEFAULT_TARGET, verb
        assert args.lookup in (True, "on"), verb  # bench: on|off|both
        assert getattr(args, "adaptive_block", getattr(args, "adaptive", None)) is True, verb
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        assert f"(default {DEFAULT_TARGET})" in " ".join(capsys.readouterr().out.split()), verb


def test_trees_are_on_by_default_and_off_on_request(tiny_model_dir: Path, tiny_drafter_dir: Path) -> None:
    """`load` verifies token trees of up to DEFAULT_TREE_NODES nodes where they pay unless told
    otherwise; tree_nodes=0 verifies chains; the output is plain decoding's either way."""
    from blockspec.config import DEFAULT_TREE_NODES

    trees = blockspec.load(str(tiny_model_dir), str(tiny_drafter_dir), adaptive_block=False)
    chains = blockspec.load(str(tiny_model_dir), str(tiny_drafter_dir), adaptive_block=False, tree_nodes=0)
    assert DEFAULT_TREE_NODES == 15 and trees.tree_nodes == 15 and chains.tree_nodes == 0
    prompt = "Count: one, two, three,"
    plain = trees.generate(prompt, max_new_tokens=12, temperature=0.0, block_size=1).text
    assert trees.generate(prompt, max_new_tokens=12, temperature=0.0).text == plain
    assert chains.generate(prompt, max_new_tokens=12, temperature=0.0).text == plain
