"""`python -m blockspec.bench.treetau`: teacher-forced tau of chains and best-first trees.

The walk is checked by hand on a crafted sequence, and end to end against a real decode: with a
drafter whose first choice is wrong at known positions (its second choice right there), the
tool's chain tau equals the mean acceptance length `SpecDecoder` itself reaches, and its trees
recover the second choices."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target

from blockspec.bench import treetau
from blockspec.bench.treetau import TreeTauConfig, decode_taus, measure_prompt, proposers_for
from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash.drafter import DFlashDrafter, new_drafter_for_target
from blockspec.dflash.proposers import PositionDistributions
from blockspec.engine.decoder import SpecDecoder
from blockspec.errors import ConfigError
from blockspec.targets.hf import HFTarget

V = 48


def crafted(second_at: set[int], tokens: list[int], depth: int = 15):
    """drafts_at(anchor): at position p the true token tokens[p] is the near-certain first choice,
    except where p is in second_at: there a wrong token comes first, the true one a close second."""
    def at(anchor: int) -> PositionDistributions:
        ids, lp = [], []
        for d in range(1, depth + 1):
            p = anchor + d
            true = tokens[p] if p < len(tokens) else 0
            wrong = (true + 1) % V
            ids.append([wrong, true] if p in second_at else [true, wrong])
            lp.append([-0.69, -0.70] if p in second_at else [-0.01, -5.0])
        return PositionDistributions(torch.tensor(ids), torch.tensor(lp))
    return at


def test_walk_by_hand() -> None:
    tokens = list(range(10, 24))  # a prompt of 4, the first generated token at 4, then 9 more
    cfg = TreeTauConfig(budgets=(3, 4), max_new_tokens=10)
    res = decode_taus(tokens, 4, crafted({7}, tokens), proposers_for(cfg, dflash2=False))
    got = {name: (t.tokens, t.steps) for name, t in res.tallies.items()}
    # chain 3: from 4 accepts 5 6 (7 wrong) +bonus: 3; from 7: 8 9 10 +bonus: 4; from 11: 12 13, the end: 2
    # chain 4: from 4: 3 as before; from 7: 8 9 10 11 +bonus: 5; from 12: 13, the end: 1
    # tree 3: the chain 3 (the true 7 at -1.72 loses to the chain's third node at -0.71)
    # tree 4: from 4: 5 6 and the true 7 (4th node) +bonus: 4; from 8: 9 10 11 12 +bonus: 5, the end
    assert got == {"chain 3": (9, 3), "tree 3": (9, 3), "chain 4": (9, 3), "tree 4": (9, 2)}


class SecondChoiceDrafter(DFlashDrafter):
    """Knows the prompt's greedy continuation; its first choice is wrong (the true token second)
    at positions divisible by 3 or 7, right elsewhere: steps accept 0, 1 or 2 proposals."""

    def __init__(self, config, prompt: list[int], cont: list[int]) -> None:
        super().__init__(new_drafter_for_target(config, mask_token_id=V - 1, block_size=16).cfg)
        self.seq = prompt + cont

    def forward(self, ctx_features, ctx_positions, block_embeds, block_positions, cache=None, attn_mask=None,
                block_len=None):
        b, q, _ = block_embeds.shape
        logits = torch.zeros(b, q, V, dtype=torch.float64)
        for k in range(q):
            p = int(block_positions[0, k])
            true = self.seq[p] if p < len(self.seq) else 0
            first, second = ((true + 1) % V, true) if p % 3 == 0 or p % 7 == 0 else (true, (true + 1) % V)
            logits[0, k, first], logits[0, k, second] = 10.0, 9.8
        return logits

    def logits(self, hidden, head):
        return hidden


@pytest.mark.parametrize("budget", [2, 3, 6])
def test_chain_tau_is_what_the_decoder_reaches(budget: int) -> None:
    model = make_tiny_target("llama", seed=5, vocab_size=V)
    target = HFTarget(model)
    prompt = [5, 9, 13, 2, 7]
    cont, _ = treetau.greedy_continuation(target, (1,), prompt, 40)
    drafter = SecondChoiceDrafter(model.config, prompt, cont)
    res = measure_prompt(target, drafter, prompt, TreeTauConfig(budgets=(budget,), top_k=4, max_new_tokens=40))
    out = SpecDecoder(target, drafter, SpecConfig(block_size=budget + 1)).generate(
        [prompt], [SamplingParams(max_new_tokens=40)])[0]
    assert out.token_ids == cont
    lengths = out.stats.acceptance_lengths
    chain = res.tallies[f"chain {budget}"]
    assert (chain.tokens, chain.steps) == (sum(lengths), len(lengths))
    assert sorted(set(lengths)) == [1, 2, 3]  # partial acceptance at several depths
    tree = res.tallies[f"tree {budget}"]  # (what trees gain is checked by hand above)
    assert tree.tokens == chain.tokens and tree.steps * (budget + 1) >= tree.tokens


def test_bad_settings_are_refused() -> None:
    for kw in (dict(budgets=()), dict(budgets=(0,)), dict(top_k=0), dict(max_new_tokens=1)):
        with pytest.raises(ConfigError):
            TreeTauConfig(**kw)


def test_command_line_on_a_tiny_model(tiny_model_dir, tiny_drafter_dir, tmp_path, capsys) -> None:
    out = tmp_path / "tau.json"
    code = treetau.main(["--target", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir), "--datasets", "gsm8k",
                         "humaneval", "--limit", "1", "--max-new-tokens", "6", "--budgets", "1", "3", "--json", str(out)])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| nodes per step | chain: gsm8k / humaneval | best-first tree: gsm8k / humaneval |"
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| 1", "| 3"]
    import json

    tallies = json.loads(out.read_text())
    for name in ("gsm8k", "humaneval"):
        chain = tallies[name]["chain 1"]
        assert 0 < chain["tokens"] <= 5 and chain["steps"] * 2 >= chain["tokens"]  # 2 a step at most
    assert treetau.main(["--target", str(tiny_model_dir), "--budgets", "0"]) == 2
    assert "budgets" in capsys.readouterr().err


def test_skipped_prompts_are_the_ones_after_the_first(tiny_model_dir, tiny_drafter_dir, capsys,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """--skip measures the prompts after the skipped ones (as sampletau's does), and a negative
    skip is refused."""
    asked: list[tuple[str, int, int]] = []
    real = treetau.set_prompts

    def recorded(pipe: object, name: str, skip: int, limit: int, data_dir: str | None = None):
        asked.append((name, skip, limit))
        return real(pipe, name, skip, limit, data_dir)

    monkeypatch.setattr(treetau, "set_prompts", recorded)
    assert treetau.main(["--target", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir), "--datasets", "gsm8k",
                         "--skip", "3", "--limit", "1", "--max-new-tokens", "6", "--budgets", "3"]) == 0
    assert asked == [("gsm8k", 3, 1)]
    assert "gsm8k: 1/1 prompts" in capsys.readouterr().err  # one prompt measured, the fourth
    assert treetau.main(["--target", str(tiny_model_dir), "--skip", "-1"]) == 2
    assert "--skip" in capsys.readouterr().err


def test_drafters_measured_together_score_as_alone() -> None:
    """measure_drafters: one continuation for drafters reading the same target layers, each
    drafter's tallies those it gets measured alone; a DFlash 2 drafter beside a DFlash one."""
    model = make_tiny_target("llama", seed=5, vocab_size=V)
    target = HFTarget(model)
    prompt = [5, 9, 13, 2, 7]
    cfg = TreeTauConfig(budgets=(2, 5), top_k=4, max_new_tokens=24)
    plain = new_drafter_for_target(model.config, mask_token_id=V - 1, block_size=8, seed=1).double()
    two = new_drafter_for_target(model.config, mask_token_id=V - 1, block_size=8, seed=2, architecture="DFlash2DraftModel",
                                 dflash2=dict(conv_group_size=16, selector_rank=8, selector_top_k=4)).double()
    calls = []
    real = treetau.greedy_continuation
    try:
        treetau.greedy_continuation = lambda *a: calls.append(a) or real(*a)
        together = treetau.measure_drafters(target, [plain, two], prompt, cfg)
    finally:
        treetau.greedy_continuation = real
    assert len(calls) == 1
    for drafter, res in zip((plain, two), together):
        alone = measure_prompt(target, drafter, prompt, cfg)
        assert {n: vars(t) for n, t in res.tallies.items()} == {n: vars(t) for n, t in alone.tallies.items()}


def test_evaluate_trees_on_heldout_prompts(tiny_model_dir, tiny_drafter_dir, tmp_path) -> None:
    """`blockspec evaluate --trees`: chain and tree tau per drafter on the held-out prompts."""
    import json

    from support import run_cli

    data = tmp_path / "data"
    data.mkdir()
    with open(data / "gsm8k_train.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"question": f"Tom has {i + 3} apples and eats {i}. How many?", "answer": "#### 3"}) + "\n")
    args = ("evaluate", "--target", str(tiny_model_dir), "--drafter", str(tiny_drafter_dir), "--drafter",
            str(tiny_drafter_dir), "--prompts", "2", "--max-new-tokens", "8", "--data-dir", str(data), "--trees",
            "--budgets", "1", "3")
    r = run_cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 2 and rows[0] == {**rows[1], "drafter": rows[0]["drafter"]}  # the same drafter twice
    assert rows[0]["prompts"] == 2 and set(rows[0]) >= {"chain 1", "tree 1", "chain 3", "tree 3"}
    assert 1.0 <= rows[0]["chain 1"] <= 2.0 and 1.0 <= rows[0]["tree 3"] <= 4.0
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("held-out gsm8k_train prompts: 2, teacher-forced")
    assert lines[1].split() == ["chain", "1", "tree", "1", "chain", "3", "tree", "3", "drafter"]
    assert lines[2].endswith(str(tiny_drafter_dir)) and len(lines) == 4
