"""A client nobody here wrote: the lm-eval harness (`local-completions`) against `blockspec serve`,
offline, on the tasks shipped in blockspec/bench/lm_eval_tasks, gives what lm-eval's own `hf`
backend (batch size 1) gives on the same target: the same greedy generations and GSM8K scores,
and every multiple-choice option's log-likelihood to 1e-4, with the same is-greedy flags.

The server runs the real SmolLM2-135M-Instruct with its shipped drafter (speculative decoding,
adaptive blocks, float32); lm-eval batches 4 requests into one call, so prompt lists, echo with
logprobs and stop strings are all exercised as a harness uses them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

import blockspec.bench

TASKS = Path(blockspec.bench.__file__).parent / "lm_eval_tasks"
SERVED = "smollm2-135m-instruct"
LL_TOL = 1e-4


@pytest.fixture(scope="module")
def served(smollm2_dir):
    """`blockspec serve` on the zoo's SmolLM2 (its shipped drafter), in a process of its own, in the
    exact compute mode: the comparison is with lm-eval's `hf` backend, i.e. transformers' numerics."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "blockspec.cli", "serve", "--target", SERVED, "--port", "0", "--dtype", "float32",
         "--compute", "exact", "--max-batch", "4", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()  # "serving '...' (...) at http://127.0.0.1:PORT/v1"
        found = re.search(r"(http://[\d.]+:\d+)/v1", line)
        assert found, f"no URL in {line!r}; stderr: {proc.stderr.read()[-2000:] if proc.poll() is not None else ''}"
        url = found.group(1)
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def evaluate(model: str, model_args: dict, batch_size: int) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=["blockspec_gsm8k", "blockspec_mc"],
                           batch_size=batch_size, task_manager=TaskManager(include_path=str(TASKS)),
                           log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                           fewshot_random_seed=0)


def by_doc(results: dict, task: str, kept: str) -> list[dict]:
    """The logged samples of a task, one per document (those of filter `kept`)."""
    return sorted((s for s in results["samples"][task] if s["filter"] == kept), key=lambda s: s["doc_id"])


@pytest.mark.slow
def test_lm_eval_local_completions_equals_its_hf_backend(served, smollm2_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", "EMPTY")
    ours = evaluate("local-completions", dict(model=SERVED, base_url=f"{served}/v1/completions",
                                              tokenizer_backend="huggingface", tokenizer=str(smollm2_dir),
                                              tokenized_requests=True, num_concurrent=1, max_retries=1,
                                              max_length=2048), batch_size=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside the server's process: two teams on a small CPU slow both down
    try:
        theirs = evaluate("hf", dict(pretrained=str(smollm2_dir), dtype="float32", device="cpu", max_length=2048),
                          batch_size=1)
    finally:
        torch.set_num_threads(threads)

    gen_ours = by_doc(ours, "blockspec_gsm8k", "strict-match")
    gen_theirs = by_doc(theirs, "blockspec_gsm8k", "strict-match")
    assert len(gen_ours) == len(gen_theirs) == 4
    texts = [s["resps"][0][0] for s in gen_theirs]
    assert [s["resps"][0][0] for s in gen_ours] == texts
    assert any(t.strip() for t in texts), f"the model should answer something: {texts}"
    for key in ("exact_match,strict-match", "exact_match,flexible-extract"):
        assert ours["results"]["blockspec_gsm8k"][key] == theirs["results"]["blockspec_gsm8k"][key]

    mc_ours, mc_theirs = by_doc(ours, "blockspec_mc", "none"), by_doc(theirs, "blockspec_mc", "none")
    assert len(mc_ours) == len(mc_theirs) == 8
    worst = max(abs(x[0][0] - y[0][0]) for a, b in zip(mc_ours, mc_theirs) for x, y in zip(a["resps"], b["resps"]))
    print(f"generations: {texts}; largest log-likelihood difference: {worst:.2e}")
    for a, b in zip(mc_ours, mc_theirs):
        got = [r[0] for r in a["resps"]]  # per choice: (log-likelihood, is greedy)
        want = [r[0] for r in b["resps"]]
        assert len(got) == len(want) == 4
        assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in want], abs=LL_TOL)
        assert [g for _, g in got] == [g for _, g in want]
    for key in ("acc,none", "acc_norm,none"):
        assert ours["results"]["blockspec_mc"][key] == theirs["results"]["blockspec_mc"][key]
    assert theirs["results"]["blockspec_mc"]["acc,none"] > 0.25, "a real model beats chance on these"
