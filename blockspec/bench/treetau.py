"""Teacher-forced tau of chains against best-first token trees (docs/DESIGN.md, "Token trees").

    python -m blockspec.bench.treetau --datasets gsm8k humaneval mt-bench --limit 8

Greedy only. Per prompt, the target's own greedy continuation is fixed; at every anchor a decode
reaches, the drafter's top-k per block position (DFlash: per-position probabilities; DFlash 2:
the selector's conditional scores) builds a chain and a best-first tree of the same number of
proposed nodes, and the greedy tree walk (dflash/tree_verify.py) against the continuation says
what each would commit. Each proposer walks its own decode, anchor to anchor, so tau is what a
real decode with that proposer would average. No tree is verified by the target here: along the
continuation the target's argmax at a node on the accepted path is the continuation's next
token, whatever else the tree holds.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from blockspec.dflash.proposers import (
    BestFirstProposer,
    ChainProposer,
    Draft,
    Distributions,
    PositionDistributions,
    Proposer,
    SelectorDistributions,
    SelectorWalkProposer,
)
from blockspec.dflash.tree_verify import walk
from blockspec.errors import ConfigError

BUDGETS = (3, 5, 7, 15)
DATASETS = ("gsm8k", "humaneval", "mt-bench")


@dataclass(frozen=True)
class TreeTauConfig:
    """budgets: proposed nodes per step (besides the last committed token); top_k: candidates
    per block position the trees choose from; max_new_tokens: the continuation's length."""

    budgets: tuple[int, ...] = BUDGETS
    top_k: int = 8
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        if not self.budgets or any(b < 1 for b in self.budgets):
            raise ConfigError(f"budgets must be positive node counts, got {self.budgets}")
        if self.top_k < 1:
            raise ConfigError(f"top_k must be >= 1, got {self.top_k}")
        if self.max_new_tokens < 2:
            raise ConfigError(f"max_new_tokens must be >= 2 (a step needs a token after the first), got "
                              f"{self.max_new_tokens}")


@dataclass
class Tally:
    """Committed tokens and steps of one proposer's decodes."""

    tokens: float = 0
    steps: float = 0

    @property
    def tau(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    def add(self, other: Tally) -> None:
        self.tokens += other.tokens
        self.steps += other.steps


@dataclass
class TreeTauResult:
    """Per proposer name ("chain 3", "tree 3", ...) its tally over the prompts."""

    tallies: dict[str, Tally] = field(default_factory=dict)

    def add(self, other: TreeTauResult) -> None:
        for name, t in other.tallies.items():
            self.tallies.setdefault(name, Tally()).add(t)


def proposers_for(cfg: TreeTauConfig, dflash2: bool) -> dict[str, Proposer]:
    """"chain N" (the drafter's first choices; DFlash 2: the selector's walk) and "tree N"
    (best first) for each budget N."""
    out: dict[str, Proposer] = {}
    for n in cfg.budgets:
        out[f"chain {n}"] = SelectorWalkProposer(n) if dflash2 else ChainProposer(n)
        out[f"tree {n}"] = BestFirstProposer(n)
    return out


@torch.inference_mode()
def continuation(target: object, layer_ids: tuple[int, ...], prompt: list[int], n: int,
                 pick: Callable[[torch.Tensor], int]) -> tuple[list[int], torch.Tensor]:
    """A continuation of `prompt` (up to n tokens, to its first stop token included), each token
    `pick`ed from the target's last logits [1, 1, V], and the target features
    [len(prompt) + len(continuation) - 1, F] of every token fed to it, as plain decoding computes
    them."""
    cache = target.new_cache(1)
    p = len(prompt)
    cache.reserve(p, p + n)
    logits, feats = target.forward(torch.tensor([prompt]), torch.arange(p)[None], cache, layer_ids,
                                   last_logits_only=True)
    out, parts = [pick(logits[:, -1:])], [feats[0]]
    stops = set(target.info.eos_token_ids)
    while len(out) < n and out[-1] not in stops:
        pos = p + len(out) - 1
        cache.reserve(pos + 1, p + n)
        logits, feats = target.forward(torch.tensor([[out[-1]]]), torch.tensor([[pos]]), cache, layer_ids)
        out.append(pick(logits[:, -1:]))
        parts.append(feats[0])
    return out, torch.cat(parts)


def greedy_continuation(target: object, layer_ids: tuple[int, ...], prompt: list[int], n: int
                        ) -> tuple[list[int], torch.Tensor]:
    """The target's greedy continuation of `prompt` and its features (`continuation`)."""
    return continuation(target, layer_ids, prompt, n, lambda last: int(last[0, -1].argmax()))


class AnchorDrafts:
    """The drafter's distributions at anchors of one sequence, computed in increasing anchor
    order, each once, on one draft cache (the context grows as a decode's would)."""

    def __init__(self, target: object, drafter: object, features: torch.Tensor, tokens: list[int], top_k: int) -> None:
        self.target, self.drafter, self.features, self.tokens, self.top_k = target, drafter, features, tokens, top_k
        self.cache = drafter.new_cache(1)
        self.fed = 0  # context features already in the draft cache: positions < fed
        self.scale = drafter.cfg.input_embedding_scale

    @torch.inference_mode()
    def at(self, anchor: int) -> Distributions:
        """Distributions for depths 1..block-1 after the token at position `anchor`."""
        hidden = self.hidden(anchor)
        head = self.target.head()
        if self.drafter.candidate_selector is not None:
            cands = self.drafter.candidates(hidden[:, 1:], head, normaliser=True)
            return SelectorDistributions(self.drafter.candidate_selector, hidden[0, 1:], cands.ids[0], cands.logits[0],
                                         cands.logsumexp[0])
        return PositionDistributions.from_logits(self.drafter.logits(hidden[0, 1:], head), self.top_k)

    @torch.inference_mode()
    def hidden(self, anchor: int) -> torch.Tensor:
        """The drafter's hidden states [1, block, H] for the block after the token at `anchor`."""
        if anchor < self.fed:
            raise ConfigError("anchors must be asked for in increasing order")
        q = self.drafter.block_size
        ctx = self.features[self.fed: anchor][None]  # [1, c, F]
        ctx_pos = torch.arange(self.fed, anchor)[None]
        ids = torch.full((1, q), self.drafter.mask_token_id, dtype=torch.long)
        ids[0, 0] = self.tokens[anchor]
        embeds = self.target.embed(ids)
        if self.scale != 1.0:
            embeds = embeds * self.scale
        hidden = self.drafter(ctx, ctx_pos, embeds, torch.arange(anchor, anchor + q)[None], self.cache)  # [1, q, H]
        self.fed = anchor
        return hidden


def decode_taus(tokens: list[int], start: int, drafts_at, proposers: dict[str, Proposer]) -> TreeTauResult:
    """Walks each proposer's decode over the fixed sequence `tokens` from the anchor at `start`
    (the first generated token) to the end; `drafts_at(anchor)` gives the drafter's distributions
    there, asked for in increasing order."""
    end = len(tokens)
    anchors = {name: start for name in proposers}
    result = TreeTauResult({name: Tally() for name in proposers})
    while True:
        live = [name for name, a in anchors.items() if a < end - 1]
        if not live:
            return result
        a = min(anchors[name] for name in live)
        dists = drafts_at(a)
        for name in live:
            if anchors[name] != a:
                continue
            tree = proposers[name].propose(Draft(tokens[a], dists))
            # the target's greedy token at a node of depth d on the true path is tokens[a + d + 1]
            target_tokens = [tokens[a + d + 1] if a + d + 1 < end else -1 for d in tree.depths]
            committed = min(walk(tree, target_tokens).accepted + 1, end - 1 - a)
            tally = result.tallies[name]
            tally.tokens += committed
            tally.steps += 1
            anchors[name] = a + committed


def measure_prompt(target: object, drafter: object, prompt: list[int], cfg: TreeTauConfig) -> TreeTauResult:
    """Chain and tree tau of one prompt's greedy decode."""
    return measure_drafters(target, [drafter], prompt, cfg)[0]


def measure_drafters(target: object, drafters: Sequence[object], prompt: list[int], cfg: TreeTauConfig
                     ) -> list[TreeTauResult]:
    """Chain and tree tau of one prompt's greedy decode for each drafter, all on the same
    continuation (computed once per set of target layers the drafters read)."""
    runs: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}
    out = []
    for drafter in drafters:
        layers = tuple(drafter.target_layer_ids)
        if layers not in runs:
            runs[layers] = greedy_continuation(target, layers, prompt, cfg.max_new_tokens)
        cont, feats = runs[layers]
        tokens = prompt + cont
        drafts = AnchorDrafts(target, drafter, feats, tokens, cfg.top_k)
        proposers = proposers_for(cfg, drafter.candidate_selector is not None)
        out.append(decode_taus(tokens, len(prompt), drafts.at, proposers))
    return out


def table(results: dict[str, TreeTauResult], cfg: TreeTauConfig) -> str:
    """A markdown table: per budget, chain and tree tau on each data set."""
    names = list(results)
    head = " / ".join(names)
    lines = [f"| nodes per step | chain: {head} | best-first tree: {head} |", "| --- | --- | --- |"]
    for n in cfg.budgets:
        chain = " / ".join(f"{results[d].tallies[f'chain {n}'].tau:.2f}" for d in names)
        tree = " / ".join(f"{results[d].tallies[f'tree {n}'].tau:.2f}" for d in names)
        lines.append(f"| {n} | {chain} | {tree} |")
    return "\n".join(lines)


def model_arguments(parser: argparse.ArgumentParser, datasets: Sequence[str] = DATASETS) -> None:
    """The arguments every tau measurement here takes: the model, its drafter, the prompt sets,
    where to read them and where to write the tallies."""
    parser.add_argument("--target", default="smollm2-135m-instruct", help="zoo name or model directory")
    parser.add_argument("--drafter", default=None, help="drafter directory (default: the one shipped for the target)")
    parser.add_argument("--datasets", nargs="+", default=list(datasets))
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--json", default=None, help="also write the tallies to this file")


def load_drafting(target: str, drafter: str | None) -> object:
    """The target and drafter as `blockspec.load` loads them; a clear error without a drafter."""
    from blockspec.api import load

    pipe = load(target, drafter)
    if pipe.drafter is None:
        raise ConfigError(f"no drafter for {target}: pass --drafter")
    return pipe


def set_prompts(pipe: object, name: str, skip: int, limit: int, data_dir: str | None = None) -> Iterator[list[int]]:
    """Prompts skip .. skip + limit - 1 of data set `name`, chat-templated, each reported on
    stderr once measured."""
    from blockspec.datasets import load_dataset
    from blockspec.text import encode_prompt

    samples = load_dataset(name, limit=skip + limit, data_dir=data_dir)[skip:]
    for i, sample in enumerate(samples, 1):
        yield encode_prompt(pipe.tokenizer, sample.prompt, chat=True)
        print(f"{name}: {i}/{len(samples)} prompts", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blockspec.bench.treetau", description=__doc__.split("\n\n")[0])
    model_arguments(parser)
    parser.add_argument("--skip", type=int, default=0, help="prompts skipped first (to measure off reported sets)")
    parser.add_argument("--limit", type=int, default=8, help="prompts per data set after the skipped ones")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS))
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    try:
        if args.skip < 0 or args.limit < 1:
            raise ConfigError(f"--skip must be >= 0 and --limit >= 1, got {args.skip} and {args.limit}")
        cfg = TreeTauConfig(tuple(args.budgets), args.top_k, args.max_new_tokens)
        results = run(args.target, args.drafter, args.datasets, args.limit, cfg, args.data_dir, skip=args.skip)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(results, cfg))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({d: {n: vars(t) for n, t in r.tallies.items()} for d, r in results.items()}, f, indent=1)
    return 0


def run(target: str, drafter: str | None, datasets: Sequence[str], limit: int, cfg: TreeTauConfig,
        data_dir: str | None = None, skip: int = 0) -> dict[str, TreeTauResult]:
    """Loads the target and drafter (as `blockspec.load` does) and measures prompts skip ..
    skip + limit - 1 of each data set, chat-templated."""
    pipe = load_drafting(target, drafter)
    out: dict[str, TreeTauResult] = {}
    for name in datasets:
        total = TreeTauResult()
        for prompt in set_prompts(pipe, name, skip, limit, data_dir):
            total.add(measure_prompt(pipe.target, pipe.drafter, prompt, cfg))
        out[name] = total
    return out


if __name__ == "__main__":
    raise SystemExit(main())
