"""The native target's tree pass (NativeTarget.forward_tree, targets/native/tree_slots.py, the
tree keys of cpu/csrc/attention.c): where the C attention runs, each node's logits and features
have the bits of its root-to-node chain verified as a chain and of plain one-token decoding (fp32,
bf16, the one-call layer program and the Python loop, the int8 mode, ragged rows with padding
nodes); PyTorch's operators (no C kernels) agree to rounding. After `reject(accepted path)` the
cache decodes on as if that chain alone had been verified, and a greedy tree walk commits plain
greedy decoding's tokens. A planted mask bug (a node that sees a sibling) is caught.
(The native target has no sliding-window layers: it refuses those architectures.)"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target
from support import one_thread  # noqa: F401 (fixture)
from test_tree_forward import CHAIN, TREE, prefilled  # the adapter's trees, for the same checks

from blockspec.cpu import kernels, program
from blockspec.dflash.token_tree import TokenTree
from blockspec.dflash.tree_verify import walk_greedy
from blockspec.errors import ConfigError
from blockspec.targets.native import attention as native_attention
from blockspec.targets.native import load_native_target
from blockspec.targets.native.backends import KernelBackend, TorchBackend
from blockspec.targets.native.cache import KVStore, StaticCache
from blockspec.targets.native.tree_slots import tree_slots
from blockspec.targets.base import greedy_forward_tree
from blockspec.targets.slots import EMPTY

VOCAB = 64
LAYERS = (1, 3)  # the last layer's feature is taken after the final norm
# TREE (10 nodes, three branches, depth 4: drawn in test_tree_forward.py) and CHAIN (10 nodes) beside
SMALL = TokenTree((22, 23, 24, 25, 26, 27), (-1, 0, 0, 1, 1, 3))  # 6 nodes: 4 padding nodes in a ragged pass
PROMPTS = [list(range(30, 39)), [40, 41, 42, 43, 44], [45, 46, 47, 48, 49, 50, 51]]
needs_kernel = pytest.mark.skipif(kernels.kernel() is None, reason="the native CPU kernel did not build here")

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: thread hand-offs cost more than the work

_MODELS: dict[str, object] = {}


def model_of(family: str):
    if family not in _MODELS:
        _MODELS[family] = make_tiny_target(family, seed=3, dtype=torch.float32, hidden_size=64, intermediate_size=128,
                                           vocab_size=VOCAB)
    return _MODELS[family]


def target_of(family: str, dtype: torch.dtype = torch.float32, mode: str = "program", monkeypatch=None):
    """A native target whose forward runs one way: "program" (the one-call layer loop where a pass
    fits), "loop" (the kernels called layer by layer), "int8" (the int8 compute mode), "pytorch"
    (no C kernels at all: PyTorch's operators)."""
    if mode == "pytorch":
        monkeypatch.setattr(kernels, "_kernel", None)  # as BLOCKSPEC_CPU_KERNELS=0 has it
    if mode == "loop":
        monkeypatch.setenv(program.ENV, "0")
    target = load_native_target(model_of(family), dtype=dtype, eos_token_ids=(),
                                compute="int8" if mode == "int8" else "exact")
    backend = target.net.backend
    assert isinstance(backend, TorchBackend if mode == "pytorch" else KernelBackend)
    return target


def chain_outputs(target, prompt: list[int], tokens: list[int], plain: bool = False):
    """Logits [len, V] and features [len, F] of `tokens` after the prompt, verified as one block
    (or plain: decoded one token per forward)."""
    cache = prefilled(target, [prompt])
    n = len(prompt)
    if not plain:
        logits, feats = target.forward(torch.tensor([tokens]), torch.arange(n, n + len(tokens))[None], cache, LAYERS)
        return logits[0], feats[0]
    outs = [target.forward(torch.tensor([[t]]), torch.tensor([[n + i]]), cache, LAYERS) for i, t in enumerate(tokens)]
    return torch.cat([lg[0] for lg, _ in outs]), torch.cat([ft[0] for _, ft in outs])


def chain_reference(target, prompt: list[int], tree: TokenTree, plain: bool = False):
    """Per node [n, V] and [n, F]: its root-to-node chain's outputs at its last token."""
    logits, feats = [None] * len(tree), [None] * len(tree)
    for leaf in tree.leaves():
        path = tree.path(leaf)
        lg, ft = chain_outputs(target, prompt, [tree.tokens[i] for i in path], plain)
        for j, node in enumerate(path):
            logits[node], feats[node] = lg[j], ft[j]
    return torch.stack(logits), torch.stack(feats)


def tree_pass(target, trees: list[TokenTree], ancestors: torch.Tensor | None = None, threads: int = 1):
    """One tree pass (on `threads` threads) over rows of PROMPTS, trees padded to one width with
    EMPTY nodes."""
    prompts = PROMPTS[: len(trees)]
    cache = prefilled(target, prompts)
    n = max(map(len, trees))
    ids = torch.tensor([list(t.tokens) + [0] * (n - len(t)) for t in trees])
    pos = torch.tensor([t.positions(len(p)) + [EMPTY] * (n - len(t)) for t, p in zip(trees, prompts)])
    if ancestors is None:
        ancestors = torch.zeros(len(trees), n, n, dtype=torch.bool)
        for row, t in enumerate(trees):
            ancestors[row, : len(t), : len(t)] = t.ancestor_mask()
    torch.set_num_threads(threads)
    try:
        logits, feats = target.forward_tree(ids, pos, ancestors, cache, LAYERS)
    finally:
        torch.set_num_threads(1)
    return cache, logits, feats


def unequal_nodes(target, trees, logits, feats, plain: bool = False) -> list[tuple[int, int]]:
    """(row, node) of every node whose logits or features are not bit-identical to its chain's."""
    bad = []
    for row, (tree, prompt) in enumerate(zip(trees, PROMPTS)):
        want_logits, want_feats = chain_reference(target, prompt, tree, plain)
        for node in range(len(tree)):
            if not (torch.equal(logits[row, node], want_logits[node]) and torch.equal(feats[row, node], want_feats[node])):
                bad.append((row, node))
    return bad


SHAPES = {"full": [TREE, CHAIN], "ragged": [TREE, CHAIN, SMALL]}  # ragged: padding nodes (the Python loop)


@needs_kernel
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(("mode", "dtype"), [("program", torch.float32), ("program", torch.bfloat16),
                                             ("loop", torch.float32), ("loop", torch.bfloat16),
                                             ("int8", torch.float32)])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_each_node_has_the_bits_of_its_chain_and_of_plain_decoding(family, mode, dtype, shape, monkeypatch) -> None:
    target = target_of(family, dtype, mode, monkeypatch)
    trees = SHAPES[shape]
    _, logits, feats = tree_pass(target, trees)
    assert logits.dtype == dtype and feats.shape[:2] == logits.shape[:2]
    assert unequal_nodes(target, trees, logits, feats) == []
    assert unequal_nodes(target, trees[:1], logits, feats, plain=True) == []
    if shape == "ragged":  # padding nodes get zeros, as a ragged `forward` gives them
        assert not logits[2, len(SMALL):].any() and not feats[2, len(SMALL):].any()


@needs_kernel
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_tree_pass_has_the_same_bits_on_two_threads(shape, monkeypatch) -> None:
    """The kernels split a pass between threads by rows and key chunks; a node's arithmetic is
    its own whatever the split (a context of 300 keys crosses the attention's 256-key chunks).
    With the tests above (one thread: a node's bits are its chain's), a node's bits are its
    chain's on any number of threads. (The prefill runs on one thread both times: a prompt of
    hundreds of tokens goes through PyTorch's GEMM, which is not batch or thread invariant.)"""
    target = target_of("qwen3", torch.float32, "program", monkeypatch)
    trees = SHAPES[shape]
    monkeypatch.setattr(f"{__name__}.PROMPTS", [list(range(1, 61)) * 5, PROMPTS[1], PROMPTS[2]])
    _, one, one_feats = tree_pass(target, trees)
    _, two, two_feats = tree_pass(target, trees, threads=2)
    assert torch.equal(one, two) and torch.equal(one_feats, two_feats)


@needs_kernel
def test_the_one_call_program_runs_a_tree_pass_without_padding(monkeypatch) -> None:
    target = target_of("llama")
    runs = []
    real_run = program.LayerProgram.run
    monkeypatch.setattr(program.LayerProgram, "run", lambda self, *a, **k: runs.append(k.get("tree")) or real_run(
        self, *a, **k))
    tree_pass(target, SHAPES["full"])
    assert len(runs) == 1 and runs[0] is not None and runs[0].shape[:2] == (2, len(TREE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_without_c_kernels_each_node_matches_its_chain(shape, dtype, monkeypatch) -> None:
    """PyTorch's attention splits its work by the number of queries, so its sums are not batch
    invariant (that is why the C kernel exists): its tree pass agrees with the chain to rounding,
    and bf16's to bf16's rounding, with the same argmax at every node in fp32."""
    target = target_of("qwen3", dtype, "pytorch", monkeypatch)
    trees = SHAPES[shape]
    _, logits, feats = tree_pass(target, trees)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=0.05)
    for row, (tree, prompt) in enumerate(zip(trees, PROMPTS)):
        want_logits, want_feats = chain_reference(target, prompt, tree)
        torch.testing.assert_close(logits[row, : len(tree)], want_logits, **tol)
        torch.testing.assert_close(feats[row, : len(tree)], want_feats, **tol)
        if dtype == torch.float32:
            assert torch.equal(logits[row, : len(tree)].argmax(-1), want_logits.argmax(-1))


def after_reject(target, paths: list[list[int]], trees: list[TokenTree]):
    """Tree pass, reject to the paths, then one more token per row: its logits [b, V]."""
    cache, _, _ = tree_pass(target, trees)
    n = max(map(len, trees))
    keep = torch.zeros(len(trees), n, dtype=torch.bool)
    for row, path in enumerate(paths):
        keep[row, path] = True
    cache.reject(keep)
    assert cache.lengths().tolist() == [len(PROMPTS[r]) + len(paths[r]) for r in range(len(trees))]
    nxt = torch.tensor([[50 + r] for r in range(len(trees))])
    pos = cache.lengths()[:, None].clone()
    logits, feats = target.forward(nxt, pos, cache, LAYERS)
    return logits[:, 0], feats[:, 0]


PATHS = {  # the accepted path of each row: deep in a later branch, stopping early, the first children
    "moves": [TREE.path(8), CHAIN.path(4), SMALL.path(5)],
    "root only": [[0], [0], [0]],
    "first branch": [TREE.path(9), CHAIN.path(9), SMALL.path(4)],
}


@needs_kernel
@pytest.mark.parametrize("paths", sorted(PATHS))
@pytest.mark.parametrize(("mode", "dtype"), [("program", torch.float32), ("loop", torch.bfloat16),
                                             ("int8", torch.float32)])
def test_after_reject_the_cache_holds_the_accepted_chain_alone(paths, mode, dtype, monkeypatch) -> None:
    target = target_of("qwen3", dtype, mode, monkeypatch)
    chosen = PATHS[paths]
    trees = SHAPES["ragged"]
    logits, feats = after_reject(target, chosen, trees)
    for row, (tree, path) in enumerate(zip(trees, chosen)):
        tokens = [tree.tokens[i] for i in path] + [50 + row]
        want_logits, want_feats = chain_outputs(target, PROMPTS[row], tokens, plain=True)
        assert torch.equal(logits[row], want_logits[-1]) and torch.equal(feats[row], want_feats[-1])


@needs_kernel
def test_rows_leaving_and_joining_before_reject_keep_their_paths(monkeypatch) -> None:
    """A finished row leaves, a new one joins, between the tree pass and `reject`: each remaining
    row still keeps its own path."""
    target = target_of("llama")
    trees = SHAPES["ragged"]
    cache, _, _ = tree_pass(target, trees)
    cache.select_rows(torch.tensor([2, 0]))
    joined = cache.spawn(1)
    target.forward(torch.tensor([PROMPTS[1]]), torch.arange(len(PROMPTS[1]))[None], joined)
    cache.merge(joined)
    keep = torch.zeros(3, len(TREE), dtype=torch.bool)
    keep[0, SMALL.path(5)] = True
    keep[1, TREE.path(8)] = True
    cache.reject(keep)
    assert cache.lengths().tolist() == [len(PROMPTS[2]) + 4, len(PROMPTS[0]) + 4, len(PROMPTS[1])]
    nxt = torch.tensor([[50], [51], [52]])
    logits, _ = target.forward(nxt, cache.lengths()[:, None].clone(), cache)
    for row, (prompt, tokens) in enumerate([(PROMPTS[2], [SMALL.tokens[i] for i in SMALL.path(5)] + [50]),
                                            (PROMPTS[0], [TREE.tokens[i] for i in TREE.path(8)] + [51]),
                                            (PROMPTS[1], [52])]):
        want, _ = chain_outputs(target, prompt, tokens, plain=True)
        assert torch.equal(logits[row, 0], want[-1])


def test_after_reject_without_c_kernels_the_cache_holds_the_accepted_chain(monkeypatch) -> None:
    target = target_of("llama", torch.float32, "pytorch", monkeypatch)
    trees = SHAPES["ragged"]
    logits, _ = after_reject(target, PATHS["moves"], trees)
    for row, (tree, path) in enumerate(zip(trees, PATHS["moves"])):
        want, _ = chain_outputs(target, PROMPTS[row], [tree.tokens[i] for i in path] + [50 + row])
        torch.testing.assert_close(logits[row], want[-1], atol=2e-5, rtol=2e-5)


def test_a_path_already_in_place_and_a_chain_reject_copy_nothing(monkeypatch) -> None:
    """A path along the spine (each node's first child: a chain, or the drafter's own chain in a
    tree) sits in the slots of its positions already; a chain's reject (no tree pass) only lowers
    lengths, as before trees."""
    target = target_of("llama")
    copies = []
    move = StaticCache.move_slots
    monkeypatch.setattr(StaticCache, "move_slots", lambda self, *a: copies.append(len(a[0])) or move(self, *a))
    cache, _, _ = tree_pass(target, [TREE, CHAIN])
    keep = torch.zeros(2, len(TREE), dtype=torch.bool)
    keep[0, TREE.path(9)] = True  # 0, 1, 4, 7, 9: the first child at every depth
    keep[1, :4] = True
    copies.clear()
    cache.reject(keep)
    assert copies == [] and cache.lengths().tolist() == [9 + 5, 5 + 4]
    cache = prefilled(target, PROMPTS[:2])
    target.forward(torch.tensor([list(CHAIN.tokens)] * 2), torch.tensor([CHAIN.positions(9), CHAIN.positions(5)]),
                   cache)
    copies.clear()
    cache.reject(torch.arange(10)[None].expand(2, 10) < torch.tensor([[3], [7]]))
    assert copies == [] and cache.lengths().tolist() == [9 + 3, 5 + 7]
    cache, _, _ = tree_pass(target, [TREE, CHAIN])  # a path that moves: every layer's K/V
    keep[0] = False
    keep[0, TREE.path(8)] = True
    copies.clear()
    cache.reject(keep)
    assert copies == [3]  # one call for every layer, moving nodes 2, 6 and 8 (the path 0, 2, 6, 8)


def test_the_spine_takes_the_slots_of_its_positions_and_the_rest_follows() -> None:
    positions = torch.tensor([TREE.positions(9), CHAIN.positions(5), SMALL.positions(7) + [EMPTY] * 4])
    ancestors = torch.zeros(3, 10, 10, dtype=torch.bool)
    for row, t in enumerate((TREE, CHAIN, SMALL)):
        ancestors[row, : len(t), : len(t)] = t.ancestor_mask()
    tree = tree_slots(positions, ancestors, scratch=99)
    spine, rest = [0, 1, 4, 7, 9], [2, 3, 5, 6, 8]
    assert [tree.slots[0, i].item() for i in spine + rest] == list(range(9, 19))
    assert tree.slots[1].tolist() == CHAIN.positions(5)  # a chain: every token at its position
    assert tree.slots[2].tolist() == [7, 8, 11, 9, 12, 10] + [99] * 4  # spine 0, 1, 3, 5; then 2, 4
    assert tree.visible[0].tolist() == [9 + d + 1 for d in TREE.depths]
    ancestors[0, 5, 4] = True  # no tree's mask (node 5 sees its sibling): distinct slots all the same
    bad = tree_slots(positions, ancestors, scratch=99)
    assert sorted(bad.slots[0].tolist()) == list(range(9, 19))


@needs_kernel
def test_greedy_tree_walks_commit_plain_greedy_decoding(monkeypatch) -> None:
    """Several steps of tree verification with the target's own greedy walk (dflash/tree_verify.py)
    and `reject` of the walked path: the committed tokens are plain greedy decoding's, with
    partial acceptance at several depths and branches (each tree mixes the true continuation,
    as second or third child, with wrong tokens)."""
    target = target_of("qwen3", torch.bfloat16, "program", monkeypatch)
    prompt = PROMPTS[0]
    pcache = target.new_cache(1)
    logits, _ = target.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], pcache)
    plain = []
    for i in range(32):
        plain.append(int(logits[0, -1].argmax()))
        logits, _ = target.forward(torch.tensor([[plain[-1]]]), torch.tensor([[len(prompt) + i]]), pcache)
    cache = prefilled(target, [prompt])
    committed: list[int] = []  # plain[0] is the first root: the prompt's own next token
    gen = torch.Generator().manual_seed(5)
    accepted = set()
    while len(committed) < 24:
        root, truth = plain[len(committed)], plain[len(committed) + 1 : len(committed) + 5]
        wrong = [[int(t) for t in torch.randint(0, VOCAB, (4,), generator=gen)] for _ in range(2)]
        cut = int(torch.randint(0, len(truth) + 1, (1,), generator=gen))
        rank = int(torch.randint(0, 3, (1,), generator=gen))
        branches = wrong[:rank] + [truth[:cut] + wrong[-1][cut:]] + wrong[rank:]
        tree = TokenTree.from_paths(root, branches)
        start = len(prompt) + len(committed)
        logits, _ = target.forward_tree(torch.tensor([list(tree.tokens)]), torch.tensor([tree.positions(start)]),
                                        tree.ancestor_mask(), cache)
        walk = walk_greedy(tree, logits[0])
        keep = torch.zeros(1, len(tree), dtype=torch.bool)
        keep[0, list(walk.path)] = True
        cache.reject(keep)
        committed += [root] + walk.committed(tree)[:-1]  # the root and the accepted proposals; the bonus roots next
        accepted.add((walk.accepted, walk.path[-1] != walk.accepted))
        assert committed == plain[: len(committed)]
    assert len({a for a, _ in accepted}) >= 3 and any(branch for _, branch in accepted)  # depths, later branches


@pytest.mark.parametrize("mode", ["program", "loop", "int8", "pytorch"])
def test_a_greedy_tree_pass_gives_the_argmax_of_each_nodes_logits(mode, monkeypatch) -> None:
    """`greedy_forward_tree` (the native class's `forward_tree_greedy`: most of the head skipped)
    gives every real node the argmax of the logits `forward_tree` computes, and the same features."""
    if mode != "pytorch" and kernels.kernel() is None:
        pytest.skip("the native CPU kernel did not build here")
    target = target_of("llama", mode=mode, monkeypatch=monkeypatch)
    assert type(target).forward_tree_greedy is not None
    trees = SHAPES["ragged"]
    _, logits, feats = tree_pass(target, trees)
    prompts = PROMPTS[: len(trees)]
    cache = prefilled(target, prompts)
    n = max(map(len, trees))
    ids = torch.tensor([list(t.tokens) + [0] * (n - len(t)) for t in trees])
    pos = torch.tensor([t.positions(len(p)) + [EMPTY] * (n - len(t)) for t, p in zip(trees, prompts)])
    ancestors = torch.zeros(len(trees), n, n, dtype=torch.bool)
    for row, t in enumerate(trees):
        ancestors[row, : len(t), : len(t)] = t.ancestor_mask()
    best, greedy_feats = greedy_forward_tree(target, ids, pos, ancestors, cache, LAYERS)
    assert best.shape == (len(trees), n)
    for row, t in enumerate(trees):
        assert best[row, : len(t)].tolist() == logits[row, : len(t)].argmax(-1).tolist()
        assert torch.equal(greedy_feats[row, : len(t)], feats[row, : len(t)])


@needs_kernel
@pytest.mark.parametrize("mode", ["program", "loop"])
def test_planted_mask_bug_a_node_that_sees_a_sibling_is_caught(mode, monkeypatch) -> None:
    target = target_of("llama", torch.float32, mode, monkeypatch)
    trees = SHAPES["full"]
    ancestors = torch.stack([t.ancestor_mask() for t in trees])
    ancestors[0, 5, 4] = True  # node 5 also sees its sibling 4
    _, logits, feats = tree_pass(target, trees, ancestors)
    assert unequal_nodes(target, trees, logits, feats) == [(0, 5)]


def test_planted_mask_bug_is_caught_without_c_kernels(monkeypatch) -> None:
    target = target_of("llama", torch.float32, "pytorch", monkeypatch)
    trees = SHAPES["full"]
    ancestors = torch.stack([t.ancestor_mask() for t in trees])
    ancestors[0, 8, 3] = True  # node 8 also sees node 3, a cousin's parent
    _, logits, _ = tree_pass(target, trees, ancestors)
    want, _ = chain_reference(target, PROMPTS[0], TREE)
    assert float((logits[0, 8] - want[8]).abs().max()) > 1e-3
    torch.testing.assert_close(logits[0, :8], want[:8], atol=2e-5, rtol=2e-5)


def test_bad_tree_shapes_are_refused() -> None:
    target = target_of("llama")
    cache = prefilled(target, PROMPTS[:2])
    with pytest.raises(ConfigError, match="ancestors"):
        target.forward_tree(torch.zeros(2, 10, dtype=torch.long), torch.zeros(2, 10, dtype=torch.long),
                            torch.ones(9, 9, dtype=torch.bool), cache)
    assert target.supports_trees


# -- the kernel alone ---------------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 72])
@pytest.mark.parametrize("base", [5, 250, 256, 600])
def test_kernel_tree_keys_have_the_bits_of_the_same_keys_in_order(base: int, d: int, dtype: torch.dtype) -> None:
    """Tree nodes at shuffled slots after a context of `base` keys (within and across the kernel's
    256-key chunks): each node's output has the bits of the same query over the same keys laid out
    in slots 0 .. base + depth, alone; and (fp32) a node's keys taken in another order do not."""
    b, kvh, g = 1, 2, 3
    n, slots = len(TREE), base + len(TREE)
    gen = torch.Generator().manual_seed(base + d)
    k, v = (torch.randn(b, kvh, slots + 8, d, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(b, kvh, g * n, d, generator=gen).to(dtype)
    order = torch.randperm(n, generator=gen)  # node i's K/V at slot base + order[i]
    node_slot = [base + int(order[i]) for i in range(n)]
    table = torch.zeros(b, n, 1 + TREE.max_depth + 1, dtype=torch.int64)
    table[0, :, 0] = base
    for i in range(n):
        for j, a in enumerate(TREE.path(i)):
            table[0, i, 1 + j] = node_slot[a]
    visible = torch.tensor([[base + TREE.depths[i] + 1 for i in range(n)]])
    got = native_attention.cached_attention(q, k, v, visible, slots, 0.3, tree=table)
    rows = q.view(b, kvh, g, n, d)
    for i in range(n):
        plain_k, plain_v = k[:, :, : base + TREE.depths[i] + 1].clone(), v[:, :, : base + TREE.depths[i] + 1].clone()
        plain_k[:, :, base:] = k[:, :, [node_slot[a] for a in TREE.path(i)]]
        plain_v[:, :, base:] = v[:, :, [node_slot[a] for a in TREE.path(i)]]
        alone = native_attention.cached_attention(rows[:, :, :, i : i + 1].reshape(b, kvh, g, d).contiguous(),
                                                  plain_k.contiguous(), plain_v.contiguous(), visible[:, i : i + 1].clone(),
                                                  base + TREE.depths[i] + 1, 0.3)
        assert torch.equal(alone.view(kvh, g, d), got.view(b, kvh, g, n, d)[0, :, :, i])
    if dtype != torch.float32:
        return  # bf16's rounding of the output may hide the order below
    swapped = table.clone()
    swapped[0, 9, 1:6] = table[0, 9, 1:6].flip(0)  # node 9 takes its keys from base on in reverse order
    other = native_attention.cached_attention(q, k, v, visible, slots, 0.3, tree=swapped)
    assert not torch.equal(other.view(b, kvh, g, n, d)[0, :, :, 9], got.view(b, kvh, g, n, d)[0, :, :, 9])
    assert torch.equal(other.view(b, kvh, g, n, d)[0, :, :, :9], got.view(b, kvh, g, n, d)[0, :, :, :9])


@needs_kernel
def test_kernel_refuses_tree_slots_outside_the_horizon() -> None:
    q = torch.randn(1, 1, 2, 16)
    k = v = torch.randn(1, 1, 8, 16)
    table = torch.tensor([[[2, 2, 0], [2, 2, 9]]])
    with pytest.raises(ValueError, match="outside the cache"):
        native_attention.cached_attention(q, k, v, torch.tensor([[3, 4]]), 8, 1.0, tree=table)


def reference_reject(cache: StaticCache, keep: torch.Tensor) -> None:
    """`reject` after a tree pass as it moved K/V layer by layer, each layer's sources gathered
    before its writes: what the one-call copy over the stacked store must equal."""
    tree, cache.tree = cache.tree, None
    keep = keep & tree.real
    cache.length = torch.where(tree.real.any(dim=1), tree.base + keep.sum(dim=1), cache.length)
    dst = tree.base[:, None] + keep.long().cumsum(dim=1) - 1
    rows, nodes = (keep & (tree.slots != dst)).nonzero(as_tuple=True)
    src, dst = tree.slots[rows, nodes], dst[rows, nodes]
    for i in range(cache.store.num_layers):
        k, v = cache.layer(i)
        k[rows, :, dst] = k[rows, :, src]
        v[rows, :, dst] = v[rows, :, src]


@pytest.mark.parametrize("host", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_the_one_call_reject_moves_what_a_copy_per_layer_moves(seed: int, host: bool) -> None:
    """Random K/V in a window of a store's rows (rows below and above it untouched), random trees
    and random accepted paths (lookup-like branches deeper than the spine included): the stacked
    copy leaves the store bit-identical to copying layer by layer, whether the geometry is on host
    integers (`TreeSlots.host`, CPU tensors: `note_tree` and `reject` read lists) or tensors only
    (an accelerator's)."""
    from blockspec.targets.native import tree_slots as geometry

    gen = torch.Generator().manual_seed(seed)
    trees = [TREE, CHAIN, SMALL, TokenTree((1, 2, 3, 4, 5), (-1, 0, 0, 2, 3))]  # the last: its deepest branch is second
    b, n = len(trees) + 1, max(map(len, trees))  # the last row: padding only (a row that joined)
    base = torch.randint(0, 20, (b,), generator=gen)
    positions = torch.full((b, n), EMPTY)
    ancestors = torch.zeros(b, n, n, dtype=torch.bool)
    keep = torch.zeros(b, n, dtype=torch.bool)
    for row, t in enumerate(trees):
        positions[row, : len(t)] = torch.tensor(t.positions(int(base[row])))
        ancestors[row, : len(t), : len(t)] = t.ancestor_mask()
        leaf = t.leaves()[int(torch.randint(0, len(t.leaves()), (1,), generator=gen))]
        path = t.path(leaf)[: int(torch.randint(1, len(t.path(leaf)) + 1, (1,), generator=gen))]
        keep[row, path] = True
    keep[:, -1] |= positions[:, -1] == EMPTY  # as a step keeps its padding: it never took a slot
    caches = []
    for _ in range(2):
        torch.manual_seed(seed)
        store = KVStore(3, 2, 4, dtype=torch.float32, device="cpu", rows=b + 2, capacity=40)
        store.kv.normal_()
        cache = StaticCache(store, row0=1, batch=b)
        cache.length = torch.arange(b) + 100  # a row holding no node (padding only) keeps its length
        made = tree_slots if host else geometry._tensor_tree_slots
        slots = made(positions, ancestors, cache.scratch)
        assert (slots.host is not None) == host
        cache.note_tree(slots)
        caches.append(cache)
    assert caches[0].lengths().tolist() == (base[:-1] + torch.tensor([len(t) for t in trees])).tolist() + [100 + b - 1]
    caches[0].reject(keep)
    reference_reject(caches[1], keep)
    assert torch.equal(caches[0].store.kv, caches[1].store.kv)
    assert torch.equal(caches[0].lengths(), caches[1].lengths())
    assert all(torch.equal(k, kk) for k, kk in zip(caches[0].store.keys, caches[1].store.keys))


def random_tree(gen: torch.Generator, n: int) -> TokenTree:
    """A random tree of n nodes in breadth-first order (each node's parent at the depth above)."""
    parents, depths = [-1], [0]
    for i in range(1, n):
        depth = depths[-1] + int(torch.randint(0, 2, (1,), generator=gen)) if depths[-1] else 1
        above = [j for j in range(i) if depths[j] == depth - 1]
        if not above:
            depth -= 1
            above = [j for j in range(i) if depths[j] == depth - 1]
        parents.append(above[int(torch.randint(0, len(above), (1,), generator=gen))])
        depths.append(depth)
    return TokenTree(tuple(range(100, 100 + n)), tuple(parents))


def assert_same_geometry(a, b) -> None:
    for name in ("slots", "base", "real", "sees", "visible"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.keys(), b.keys()) and a.end == b.end


@pytest.mark.parametrize("seed", range(8))
def test_the_host_geometry_equals_the_tensor_geometry(seed: int) -> None:
    """`tree_slots` on CPU tensors runs on host integers: every field, the key table and the end
    equal the tensor formulation's, for ragged random trees, a row of padding only, a mask that is
    no tree's (a node that sees its sibling or cousin) and one mask for every row."""
    from blockspec.targets.native import tree_slots as geometry

    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(gen, int(torch.randint(1, 17, (1,), generator=gen))) for _ in range(4)]
    n = max(map(len, trees)) + int(torch.randint(0, 3, (1,), generator=gen))
    positions = torch.full((5, n), EMPTY)
    ancestors = torch.zeros(5, n, n, dtype=torch.bool)
    for row, t in enumerate(trees):  # row 4: padding only (a row that joined)
        positions[row, : len(t)] = torch.tensor(t.positions(int(torch.randint(0, 50, (1,), generator=gen))))
        ancestors[row, : len(t), : len(t)] = t.ancestor_mask()
    ancestors[4] = torch.rand(n, n, generator=gen) < 0.3  # padding rows' masks are never read
    assert_same_geometry(geometry._host_tree_slots(positions, ancestors, 99),
                         geometry._tensor_tree_slots(positions, ancestors, 99))
    big = max(range(4), key=lambda r: len(trees[r]))
    if len(trees[big]) > 2:
        bad = ancestors.clone()
        bad[big, len(trees[big]) - 1, 1] = True  # the last node sees node 1 as well
        assert_same_geometry(geometry._host_tree_slots(positions, bad, 99),
                             geometry._tensor_tree_slots(positions, bad, 99))
    one = trees[big]
    pos = torch.tensor([one.positions(7), one.positions(30)])
    assert_same_geometry(geometry.tree_slots(pos, one.ancestor_mask(), 64),
                         geometry._tensor_tree_slots(pos, one.ancestor_mask()[None].expand(2, -1, -1), 64))


def test_the_host_geometry_of_a_mask_that_is_no_trees_takes_node_order() -> None:
    from blockspec.targets.native import tree_slots as geometry

    positions = torch.tensor([TREE.positions(9), SMALL.positions(7) + [EMPTY] * 4])
    ancestors = torch.zeros(2, 10, 10, dtype=torch.bool)
    for row, t in enumerate((TREE, SMALL)):
        ancestors[row, : len(t), : len(t)] = t.ancestor_mask()
    ancestors[0, 1:3, 0] = False  # nodes 1 and 2 do not see the root: they and the root would share a slot
    host = geometry._host_tree_slots(positions, ancestors, 99)
    assert_same_geometry(host, geometry._tensor_tree_slots(positions, ancestors, 99))
    assert host.slots.tolist() == [list(range(9, 19)), list(range(7, 13)) + [99] * 4]


@pytest.mark.parametrize("seed", range(8))
def test_the_host_geometry_holds_the_parents_tree_parents_finds(seed: int) -> None:
    """A greedy tree pass reads each node's parent off the host geometry instead of
    `tree_parents`' tensor operations: the same parents for random ragged trees, a row of padding
    only, a garbage mask in that row and a mask that is no tree's; and the host lists name the
    tensors' slots, bases and real nodes, before and after the scratch slot moves."""
    from blockspec.targets.native import tree_slots as geometry
    from blockspec.targets.native.llama import tree_parents

    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree(gen, int(torch.randint(1, 17, (1,), generator=gen))) for _ in range(4)]
    n = max(map(len, trees)) + int(torch.randint(0, 3, (1,), generator=gen))
    positions = torch.full((5, n), EMPTY)
    ancestors = torch.zeros(5, n, n, dtype=torch.bool)
    for row, t in enumerate(trees):
        positions[row, : len(t)] = torch.tensor(t.positions(int(torch.randint(0, 50, (1,), generator=gen))))
        ancestors[row, : len(t), : len(t)] = t.ancestor_mask()
    masks = [ancestors.clone(), ancestors.clone()]
    masks[1][4] = torch.rand(n, n, generator=gen) < 0.3
    masks[1][0, -1, 1] = True  # no tree's: the last node of row 0 sees node 1 as well
    for mask in masks:
        host = geometry.tree_slots(positions, mask, 99)
        assert torch.equal(host.parents(), tree_parents(mask, 5))
        for got in (host, host.with_scratch(77)):
            assert torch.equal(got.slots, torch.tensor(got.host.slots))
            assert got.host.base == tuple(got.base.tolist()) and got.host.real == tuple(map(tuple, got.real.tolist()))
            assert got.host.ends() == (got.base + got.real.sum(dim=1)).tolist()
        moved = host.with_scratch(77)
        assert torch.equal(moved.slots, torch.where(host.real, host.slots, 77)) and moved.host.scratch == 77
    for row, t in enumerate(trees):  # a tree's parents are its own
        assert geometry.tree_slots(positions, ancestors, 99).host.parents[row][: len(t)] == t.parents


def test_reject_after_a_tree_pass_names_a_keep_of_the_wrong_shape() -> None:
    """The host geometry's `reject` reads keep row by row: a keep that is not one flag per node
    is a clear error, not a silently shortened path."""
    store = KVStore(2, 1, 4, dtype=torch.float32, device="cpu", rows=1, capacity=16)
    cache = StaticCache(store, batch=1)
    cache.note_tree(tree_slots(torch.tensor([SMALL.positions(3)]), SMALL.ancestor_mask(), cache.scratch))
    with pytest.raises(ValueError, match="one flag per node"):
        cache.reject(torch.ones(1, len(SMALL) - 1, dtype=torch.bool))
