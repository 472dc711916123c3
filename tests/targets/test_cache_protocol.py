"""Every target and draft cache implements the whole cache protocol, so callers never probe."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target

from blockspec.dflash.drafter import ConcatPass, DraftCache, DraftContextCache, DraftPass, new_drafter_for_target
from blockspec.dflash.static_drafter import StaticDraftCache, StaticDrafter, StaticPass
from blockspec.errors import ConfigError
from blockspec.targets.base import TargetCache
from blockspec.targets.hf import HFCache, HFTarget
from blockspec.targets.native import load_native_target
from blockspec.targets.native.cache import StaticCache

ROOT = Path(__file__).resolve().parents[2] / "blockspec"


def _members(protocol: type) -> set[str]:
    return {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}


def test_protocols_list_the_methods_callers_use() -> None:
    assert _members(TargetCache) == {"lengths", "reserve", "reject", "compact", "select_rows", "spawn", "merge"}
    assert _members(DraftContextCache) == {"lengths", "reserve", "compact", "select_rows", "spawn", "merge",
                                           "open_pass"}
    assert _members(DraftPass) == {"context", "linear", "norm", "attention", "mlp", "layers", "close"}


@pytest.mark.parametrize("cls, protocol", [(StaticCache, TargetCache), (HFCache, TargetCache),
                                           (StaticDraftCache, DraftContextCache), (DraftCache, DraftContextCache),
                                           (StaticPass, DraftPass), (ConcatPass, DraftPass)])
def test_every_cache_has_every_protocol_method_with_its_signature(cls: type, protocol: type) -> None:
    for name in _members(protocol):
        method = getattr(cls, name, None)
        assert callable(method), f"{cls.__name__} lacks {name}"
        want = list(inspect.signature(getattr(protocol, name)).parameters)
        have = list(inspect.signature(method).parameters)
        assert have[: len(want)] == want, f"{cls.__name__}.{name}{have} differs from the protocol's {want}"


def _hf(family: str) -> HFTarget:
    return HFTarget(make_tiny_target(family, dtype=torch.float32, num_hidden_layers=4))


def _native() -> object:
    return load_native_target(make_tiny_target("llama", dtype=torch.float32), dtype=torch.float32)


@pytest.mark.parametrize("make", [lambda: _hf("llama"), lambda: _hf("qwen3_next"), _native],
                         ids=["hf", "hf-hybrid", "native"])
def test_target_caches_spawn_prefill_and_merge(make) -> None:
    """Rows prefilled into a spawned cache and merged give the same next-token logits as the same
    rows prefilled alone: spawn + merge is how requests join a running batch."""
    target = make()
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, 47, (1, n), generator=g) for n in (5, 3))

    def prefill(cache, ids):
        cache.reserve(ids.shape[1])
        return target.forward(ids, torch.arange(ids.shape[1])[None], cache, last_logits_only=True)[0]

    first = target.new_cache(1)
    prefill(first, a)
    joining = first.spawn(1)
    assert joining.lengths().tolist() == [0]
    prefill(joining, b)
    first.merge(joining)
    assert first.lengths().tolist() == [5, 3]
    nxt = torch.tensor([[7], [9]])
    pos = torch.tensor([[5], [3]])
    first.reserve(6)
    together = target.forward(nxt, pos, first, last_logits_only=True)[0]
    for row, ids in enumerate((a, b)):
        alone = target.new_cache(1)
        prefill(alone, ids)
        alone.reserve(ids.shape[1] + 1)
        ref = target.forward(nxt[row : row + 1], pos[row : row + 1], alone, last_logits_only=True)[0]
        torch.testing.assert_close(together[row], ref[0], rtol=1e-4, atol=1e-4)
    first.select_rows(torch.zeros(0, dtype=torch.long))  # an emptied cache still spawns
    assert first.spawn(2).lengths().tolist() == [0, 0]


def test_growing_caches_take_reserve_as_a_no_op_and_spawn_like_new_cache() -> None:
    target = _hf("qwen3_next")
    cache = target.new_cache(2)
    cache.reserve(100, 200)
    assert cache.slots.num_slots == 0 and cache.lengths().tolist() == [0, 0]
    spawned, fresh = cache.spawn(3), target.new_cache(3)
    assert spawned.linear.keys() == fresh.linear.keys() and spawned.linear
    for i in fresh.linear:
        for mine, theirs in ((spawned.linear[i].conv, fresh.linear[i].conv), (spawned.linear[i].rec, fresh.linear[i].rec)):
            assert mine.shape == theirs.shape and mine.dtype == theirs.dtype and not mine.any()
    draft = DraftCache(2, 1)
    draft.reserve(50, 60)
    assert draft.spawn(4).lengths().tolist() == [0] * 4 and len(draft.spawn(1).keys) == 2


def test_draft_caches_of_both_drafters_spawn_and_the_dynamic_one_refuses_to_merge() -> None:
    model = make_tiny_target("llama", dtype=torch.float32)
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float32)
    static = StaticDrafter(drafter).new_cache(1)
    joining = static.spawn(2)
    assert isinstance(joining, StaticDraftCache) and joining.weights is static.weights  # its passes run alike
    static.merge(joining)
    assert static.lengths().tolist() == [0, 0, 0]
    dynamic = drafter.new_cache(1)
    with pytest.raises(ConfigError, match="cannot take rows joining a running batch"):
        dynamic.merge(dynamic.spawn(1))


def _probes(tree: ast.AST) -> list[str]:
    """hasattr / getattr calls whose first argument names a cache."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
            if node.args and "cache" in ast.unparse(node.args[0]).lower():
                found.append(ast.unparse(node))
    return found


def test_decoding_code_never_probes_a_cache() -> None:
    offenders = {str(p.relative_to(ROOT)): _probes(ast.parse(p.read_text()))
                 for folder in ("dflash", "engine") for p in sorted((ROOT / folder).glob("*.py"))}
    assert not {k: v for k, v in offenders.items() if v}
    assert _probes(ast.parse("hasattr(self.tcache, 'reserve')"))  # the check sees a probe


@pytest.mark.parametrize("kind", ["hf", "hf-hybrid", "native"])
def test_reserving_an_idle_batch_changes_no_output(kind) -> None:
    """`Engine.reserve` (`DecodeBatch.reserve`) goes through the cache protocol alone: every kind
    of target cache, and the drafter's, take it, and the requests decode what they do without it."""
    from blockspec.config import SamplingParams, SpecConfig
    from blockspec.engine import Engine, EngineConfig

    model = make_tiny_target("qwen3_next" if kind == "hf-hybrid" else "llama", dtype=torch.float32,
                             num_hidden_layers=4)
    target = load_native_target(model, dtype=torch.float32) if kind == "native" else HFTarget(model)
    drafter = new_drafter_for_target(model.config, mask_token_id=47, num_layers=1, dtype=torch.float32)
    prompts = [[1, 5, 9, 2], [3, 8, 8, 1, 4, 6]]

    def decode(reserve: bool) -> list[list[int]]:
        engine = Engine(target, drafter, EngineConfig(SpecConfig(block_size=4), max_batch=2, own_thread=False))
        if reserve:
            engine.reserve(2, 40)
        handles = [engine.submit(p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in prompts]
        engine.run_until_idle()
        return [h.result(timeout=0).token_ids for h in handles]

    assert decode(True) == decode(False)
