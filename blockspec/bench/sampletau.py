"""Expected tau of lossless sampled verification rules, along real sampled decodes.

    python -m blockspec.bench.sampletau --datasets gsm8k --skip 64 --limit 16

Per prompt, a continuation is sampled from the target (temperature / top-p, a fixed generator):
a lossless decode commits text with exactly this distribution, so every prefix of it is a state
a decode reaches. At every anchor of it the drafter drafts its block once, and each rule builds
what it would verify there: a chain drawn from q (the drafter's distribution shaped as the
request asks, then sharpened to f times its temperature on the same support,
`sampling.sharpened`; f = 1: the request's q, f = STANDARD_DRAFT_FACTOR: what the engine's
standard-rule rows draw from), the drafter's argmax chain, and a best-first tree (dflash/proposers). All of them
go through the target in one tree pass, so p at every node is conditioned on exactly the tokens
before it. Per anchor and verify width w (w - 1 proposals), with P(accepted >= k):

- standard rule (`dflash/verify.verify_standard`) on a chain drawn from q: prod_{d<k}
  min(1, p_d(x_d) / q_d(x_d)) * sum min(p_k, q_k), an unbiased estimate over the drawn chain
  (a DFlash drafter draws each position independently of the earlier ones, so x_k's draw does
  not depend on the acceptance of x_1..x_{k-1});
- keyed rule on the same chain: 1 while each x_d equals the target's keyed draw there, drawn
  with the clocks the chain's own draws used (one realisation, not an expectation);
- the argmax chain (q one-hot; standard and keyed rule alike): prod_{d<=k} p_d(x*_d), exact;
- the keyed walk (dflash/tree_verify.py) on the best-first tree of w - 1 nodes grown from the
  shaped q (as a sampled engine step grows it): the sum over depth-k nodes of their path's
  probability under p, exact.

tau is then what a decode along the continuation averages: anchors are weighted by the
probability a decode steps on them (from each rule's own distribution of committed tokens),
tokens / steps as in treetau. The approximation: the continuation after a step is the sampled
one whatever that step accepted, where a real decode's next anchors follow its own accepted
tokens (distributed as p overall, but not independently of how many were accepted). Calibrate
knobs on prompts that are not reported ones (`--skip`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from blockspec.bench import treetau
from blockspec.bench.treetau import AnchorDrafts, continuation
from blockspec.dflash.proposers import BestFirstProposer, Draft, PositionDistributions
from blockspec.dflash.sampling import RowRandom, probabilities, sample_from, sharpened
from blockspec.dflash.token_tree import TokenTree
from blockspec.errors import ConfigError

WIDTHS = (4, 8, 16)
FACTORS = (1.0, 0.75, 0.5, 0.35)
DATASETS = ("gsm8k",)


@dataclass(frozen=True)
class SampleTauConfig:
    """temperature / top_p: the request's shaping; widths: verified tokens per step (the last
    committed one and w - 1 proposals); factors: the chains' draft sharpening (fractions of the
    request's temperature); top_k: candidates per depth the best-first tree chooses from; chain_depth: the
    chains' proposals verified at most (wider widths count a chain's acceptance up to it: a
    cheaper pass, where the chains' deep proposals are rarely reached)."""

    temperature: float = 0.7
    top_p: float = 0.9
    widths: tuple[int, ...] = WIDTHS
    factors: tuple[float, ...] = FACTORS
    top_k: int = 8
    max_new_tokens: int = 96
    seed: int = 0
    chain_depth: int = 15

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ConfigError(f"temperature must be > 0 (sampled decoding), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.widths or any(w < 2 for w in self.widths):
            raise ConfigError(f"widths must be >= 2 (a step verifies at least one proposal), got {self.widths}")
        if any(not f > 0 for f in self.factors):
            raise ConfigError(f"draft temperature factors must be > 0, got {self.factors}")
        if self.top_k < 1:
            raise ConfigError(f"top_k must be >= 1, got {self.top_k}")
        if self.max_new_tokens < 2:
            raise ConfigError(f"max_new_tokens must be >= 2, got {self.max_new_tokens}")
        if self.chain_depth < 1:
            raise ConfigError(f"chain_depth must be >= 1, got {self.chain_depth}")


@dataclass
class Walk:
    """One rule's expected decode at one width: anchor weights (the probability a decode steps
    on each anchor) and the expected tokens and steps they add up to."""

    tokens: float = 0.0
    steps: float = 0.0
    first: float = 0.0  # sum over steps of P(first proposal accepted), weighted like them
    weight: dict[int, float] = field(default_factory=dict)

    def visit(self, anchor: int, at_least: list[float], mean: list[float] | None = None) -> None:
        """at_least[k] = P(accepted >= k + 1) at this anchor, k < the proposals it may accept,
        non-increasing (it says where the next step is); `mean`: a lower-variance estimate of
        the same probabilities for the tokens counted, unbiased but not monotone (default:
        at_least)."""
        w = self.weight.pop(anchor, 0.0)
        if w == 0.0:
            return
        est = at_least if mean is None else mean
        self.tokens += w * (1.0 + sum(est))
        self.steps += w
        self.first += w * (est[0] if est else 0.0)
        s = [1.0] + [min(1.0, max(0.0, v)) for v in at_least] + [0.0]
        for n in range(1, len(s)):  # n committed with probability P(acc >= n-1) - P(acc >= n)
            p = s[n - 1] - s[n]
            if p > 0:
                self.weight[anchor + n] = self.weight.get(anchor + n, 0.0) + w * p


@dataclass
class Tally(treetau.Tally):
    """Expected tokens and steps of one rule at one width, summed over prompts, and the
    expected acceptances of its first proposal."""

    first: float = 0.0

    @property
    def first_rate(self) -> float:
        return self.first / self.steps if self.steps else 0.0

    def add(self, other: Tally) -> None:
        super().add(other)
        self.first += other.first


@dataclass
class SampleTauResult:
    """tallies: per rule and width; siblings: per sibling count k, the first proposal's
    acceptance summed over anchors (`anchors` of them) for a deterministic set of the drafter's
    k likeliest tokens under the keyed walk (p of the set), and an upper bound for any lossless
    rule over k tokens drawn from q (SpecInfer's recursive rejection included): it can keep only
    a drawn token, so at most E[p(drawn set)] = sum_x p(x) (1 - (1 - q(x))^k)."""

    tallies: dict[str, dict[int, Tally]] = field(default_factory=dict)
    siblings: dict[int, tuple[float, float]] = field(default_factory=dict)
    anchors: int = 0

    def add(self, other: SampleTauResult) -> None:
        for name, by_w in other.tallies.items():
            for w, t in by_w.items():
                self.tallies.setdefault(name, {}).setdefault(w, Tally()).add(t)
        for k, (top, bound) in other.siblings.items():
            a, b = self.siblings.get(k, (0.0, 0.0))
            self.siblings[k] = (a + top, b + bound)
        self.anchors += other.anchors


SIBLINGS = (2, 4, 8)


def rule_names(cfg: SampleTauConfig) -> list[str]:
    """The rules measured, in table order."""
    names = [f"standard f={f:g}" for f in cfg.factors] + ["argmax chain"]
    names += [f"keyed f={f:g}" for f in cfg.factors] + ["keyed tree"]
    return names


def sampled_continuation(target: object, layer_ids: tuple[int, ...], prompt: list[int], cfg: SampleTauConfig,
                         generator: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """A continuation of `prompt` sampled from the target at the config's temperature / top-p
    (up to max_new_tokens, to its first stop token included) and the target features of every
    token fed, as plain decoding computes them."""
    t, k, tp = _shaping(cfg)

    def draw(last: torch.Tensor) -> int:
        probs = probabilities(last, t, k, tp)[0, 0]  # [V]
        return int(sample_from(probs, torch.rand((), generator=generator, dtype=torch.float64)))

    return continuation(target, layer_ids, prompt, cfg.max_new_tokens, draw)


def _shaping(cfg: SampleTauConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.tensor([cfg.temperature]), torch.tensor([0]), torch.tensor([cfg.top_p]))


def _node_index(tree: TokenTree) -> dict[tuple[int, ...], int]:
    """Each node's proposed-token path (the root's excluded) -> its index."""
    keys: list[tuple[int, ...]] = [()]
    for i in range(1, len(tree)):
        keys.append(keys[tree.parents[i]] + (tree.tokens[i],))
    return {key: i for i, key in enumerate(keys)}


@torch.inference_mode()
def measure_prompt(target: object, drafter: object, prompt: list[int], cfg: SampleTauConfig,
                   generator: torch.Generator) -> SampleTauResult:
    """Per rule and width, the expected tokens and steps of one prompt's sampled decode."""
    cont, feats = sampled_continuation(target, drafter.target_layer_ids, prompt, cfg, generator)
    tokens = prompt + cont
    end, start = len(tokens), len(prompt)
    drafts = AnchorDrafts(target, drafter, feats, tokens, cfg.top_k)
    head = target.head()
    t, k, tp = _shaping(cfg)
    budget = min(drafter.block_size, max(cfg.widths)) - 1  # the tree's nodes and depths
    depth = min(budget, cfg.chain_depth)  # the chains'
    random = RowRandom([int(torch.randint(0, 2**62, (1,), generator=generator))])
    names = rule_names(cfg)
    walks = {name: {w: Walk(weight={start: 1.0}) for w in cfg.widths} for name in names}
    siblings = {k: [0.0, 0.0] for k in SIBLINGS}
    # the verify passes' cache: it holds the continuation before each anchor
    cache = target.new_cache(1)
    cache.reserve(start, end + budget + 1)
    target.forward(torch.tensor([prompt]), torch.arange(start)[None], cache, (), last_logits_only=True)
    for a in range(start, end - 1):
        full = drafter.logits(drafts.hidden(a)[0, 1:budget + 1], head).float()[None]  # [1, budget, V]
        logits = full[:, :depth]
        shaped = probabilities(full, t, k, tp)[0]  # [budget, V]: what a sampled engine step grows its tree from
        qs = {f: sharpened(shaped[:depth], f) for f in cfg.factors}  # each [D, V]
        # chains drawn from each q with common clocks (those of output positions a .. a + D - 1)
        chains = {f: random.sample(q[None], [a])[0].tolist() for f, q in qs.items()}
        argmax = logits[0].argmax(dim=-1).tolist()
        ranked = BestFirstProposer(budget).ranked(Draft(tokens[a], PositionDistributions.from_logits(
            shaped.log(), cfg.top_k)))
        paths = [c for c in chains.values()] + [argmax] + [list(path) for path, _ in ranked]
        tree = TokenTree.from_paths(tokens[a], paths)
        index = _node_index(tree)
        n = len(tree)
        cache.reserve(a + n, end + budget + 1)
        out, _ = target.forward_tree(torch.tensor([tree.tokens]), torch.tensor([tree.positions(a)]),
                                     tree.ancestor_mask(), cache, ())
        keep = torch.zeros(1, n, dtype=torch.bool)
        keep[0, 0] = True
        cache.reject(keep)  # the root stays: the next anchor's context
        p = probabilities(out.float(), t, k, tp)[0]  # [n, V]
        room = end - 2 - a  # proposals a step here may still commit before the continuation ends
        for sib, acc in siblings.items():
            top = shaped[0].topk(sib)
            acc[0] += float(p[0, top.indices[top.values > 0]].sum())
            acc[1] += float((p[0] * (1 - (1 - shaped[0].double()) ** sib)).sum())

        def along(path: Sequence[int]) -> list[int]:
            """The nodes whose distributions predict each token of a path: root, then its prefixes."""
            return [index[tuple(path[:d])] for d in range(len(path))]

        for f, chain in chains.items():
            nodes = along(chain)
            pc, q = p[nodes], qs[f]  # [D, V] each
            x = torch.tensor(chain)[:, None]
            ratio = (pc.gather(-1, x) / q.gather(-1, x))[:, 0].clamp(max=1.0).tolist()  # [D]
            overlap = torch.minimum(pc, q).sum(dim=-1).tolist()  # [D]
            draws = random.sample(pc[None], [a])[0].tolist()  # the target's keyed draws, same clocks
            for w in cfg.widths:
                m = min(w - 1, room, depth)
                standard, kept, keyed, run, same = [], [], [], 1.0, 1.0
                for d in range(m):
                    standard.append(run * overlap[d])  # given x_1..x_d-1 kept, x_d's draw is kept w.p. the overlap
                    run *= ratio[d]
                    kept.append(run)
                    same *= float(draws[d] == chain[d])
                    keyed.append(same)
                walks[f"standard f={f:g}"][w].visit(a, kept, standard)
                walks[f"keyed f={f:g}"][w].visit(a, keyed)
        nodes = along(argmax)
        p_star = p[nodes].gather(-1, torch.tensor(argmax)[:, None])[:, 0].tolist()
        path_prob = {(): 1.0}
        for path, _ in ranked:
            path = tuple(path)
            path_prob[path] = path_prob[path[:-1]] * float(p[index[path[:-1]], path[-1]])
        for w in cfg.widths:
            m = min(w - 1, room)
            run, chain_s = 1.0, []
            for d in range(min(m, depth)):
                run *= p_star[d]
                chain_s.append(run)
            walks["argmax chain"][w].visit(a, chain_s)
            by_depth = [0.0] * m
            for path, _ in ranked[: w - 1]:
                if len(path) <= m:
                    by_depth[len(path) - 1] += path_prob[tuple(path)]
            walks["keyed tree"][w].visit(a, by_depth)
    return SampleTauResult({name: {w: Tally(x.tokens, x.steps, x.first) for w, x in by_w.items()}
                            for name, by_w in walks.items()},
                           {k: (v[0], v[1]) for k, v in siblings.items()}, end - 1 - start)


def table(results: dict[str, SampleTauResult], cfg: SampleTauConfig) -> str:
    """Markdown tables: per rule, tau at each width (first-proposal acceptance in brackets), one
    column group per data set; then the first proposal's acceptance from k siblings."""
    sets = list(results)
    cols = [f"{d} w={w}" for d in sets for w in cfg.widths]
    lines = ["| rule | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]
    for name in rule_names(cfg):
        cells = [f"{results[d].tallies[name][w].tau:.3f} ({results[d].tallies[name][w].first_rate:.2f})"
                 for d in sets for w in cfg.widths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| first proposal, k siblings | " + " | ".join(f"{d}: top-k set (keyed walk) / any rule on k draws "
                                                             "(bound)" for d in sets) + " |",
              "| --- |" + " --- |" * len(sets)]
    for k in SIBLINGS:
        cells = [f"{results[d].siblings[k][0] / max(1, results[d].anchors):.3f} / "
                 f"{results[d].siblings[k][1] / max(1, results[d].anchors):.3f}" for d in sets]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(target: str, drafter: str | None, datasets: Sequence[str], skip: int, limit: int, cfg: SampleTauConfig,
        data_dir: str | None = None, progress: bool = False) -> dict[str, SampleTauResult]:
    """Loads the target and drafter (as `blockspec.load` does) and measures prompts skip ..
    skip + limit - 1 of each data set, chat-templated; `progress` prints the running table after
    each prompt (to stderr)."""
    pipe = treetau.load_drafting(target, drafter)
    if pipe.drafter.candidate_selector is not None:
        raise ConfigError("sampletau measures DFlash drafters (per-position distributions), not DFlash 2 walks")
    if not getattr(pipe.target, "supports_trees", False):
        raise ConfigError(f"{target}'s target cannot verify token trees, which this measurement needs")
    generator = torch.Generator().manual_seed(cfg.seed)
    out: dict[str, SampleTauResult] = {}
    for name in datasets:
        total = SampleTauResult()
        for prompt in treetau.set_prompts(pipe, name, skip, limit, data_dir):
            total.add(measure_prompt(pipe.target, pipe.drafter, prompt, cfg, generator))
            if progress:
                print(table({name: total}, cfg), file=sys.stderr, flush=True)
        out[name] = total
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blockspec.bench.sampletau", description=__doc__.split("\n\n")[0])
    treetau.model_arguments(parser, DATASETS)
    parser.add_argument("--skip", type=int, default=64, help="prompts skipped first (keep calibration off reported sets)")
    parser.add_argument("--limit", type=int, default=16, help="prompts per data set after the skipped ones")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    parser.add_argument("--factors", type=float, nargs="+", default=list(FACTORS),
                        help="draft temperatures as fractions of the request's")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chain-depth", type=int, default=15, help="proposals of a chain verified at most")
    parser.add_argument("--progress", action="store_true", help="print the running table after each prompt")
    args = parser.parse_args(argv)
    try:
        if args.skip < 0 or args.limit < 1:
            raise ConfigError(f"--skip must be >= 0 and --limit >= 1, got {args.skip} and {args.limit}")
        cfg = SampleTauConfig(args.temperature, args.top_p, tuple(args.widths), tuple(args.factors), args.top_k,
                              args.max_new_tokens, args.seed, args.chain_depth)
        results = run(args.target, args.drafter, args.datasets, args.skip, args.limit, cfg, args.data_dir, args.progress)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(results, cfg))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({d: {"tallies": {r: {w: vars(t) for w, t in by_w.items()} for r, by_w in res.tallies.items()},
                           "siblings": res.siblings, "anchors": res.anchors} for d, res in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
