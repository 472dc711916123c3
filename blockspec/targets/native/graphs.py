"""CUDA-graph replay of native decode steps (GPU only).

A decode step's target forward has a fixed shape once the batch is rounded up to a bucket and
attention spans the whole cache capacity under a mask, so it can be captured once per
(batch bucket, block size, cache storage) and replayed: one launch instead of ~20 per layer.
Padding rows of a bucket are free rows of the KV store (the running batch always occupies rows
0..b-1 and no request is being prefilled while a step runs), so what they write is never read.
Optionally the captured function is `torch.compile`d first (fused elementwise kernels).

STATUS: written and reviewed on a CPU-only machine; it has not run on a GPU yet. Any capture
failure falls back to eager execution with a warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from blockspec.errors import ConfigError
from blockspec.targets.native.cache import StaticCache
from blockspec.targets.native.llama import NativeLlama


def _bucket(n: int) -> int:
    size = 1
    while size < n:
        size *= 2
    return size


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor  # [B, q] static input
    positions: torch.Tensor  # [B, q] static input
    logits: torch.Tensor  # [B, q, V] static output
    features: torch.Tensor | None  # [B, q, L*H] static output


class CudaGraphs:
    """Captures and replays NativeLlama forwards for decode steps."""

    def __init__(self, net: NativeLlama, *, max_block: int = 16, compile: bool = False) -> None:
        device = net.embed.weight.device
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ConfigError("CUDA graphs need the model on a CUDA device; on CPU the eager path is used")
        self.net = net
        self.max_block = max_block
        self.fn = torch.compile(net.forward, dynamic=False) if compile else net.forward
        self.pool = torch.cuda.graph_pool_handle()
        self.captured: dict[tuple, _Captured] = {}
        self.failed: set[tuple] = set()

    def handles(self, ids: torch.Tensor, cache: StaticCache, last_logits_only: bool) -> bool:
        """Decode steps of the running batch only (prefills and joins stay eager)."""
        q = ids.shape[1]
        return isinstance(cache, StaticCache) and not last_logits_only and cache.row0 == 0 and q <= self.max_block

    def _key(self, cache: StaticCache, batch: int, q: int, layer_ids: tuple[int, ...]) -> tuple:
        store = cache.store
        return (batch, q, layer_ids, store.capacity, store.keys[0].data_ptr())

    def _capture(self, key: tuple, cache: StaticCache, layer_ids: tuple[int, ...]) -> _Captured:
        batch, q = key[0], key[1]
        device = self.net.embed.weight.device
        view = StaticCache(cache.store, 0, batch)
        ids = torch.zeros(batch, q, dtype=torch.long, device=device)
        positions = torch.arange(q, device=device).expand(batch, q).contiguous()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up (and compilation) outside the graph
                self.fn(ids, positions, view, layer_ids, False, static=True)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, features = self.fn(ids, positions, view, layer_ids, False, static=True)
        return _Captured(graph, ids, positions, logits, features)

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, cache: StaticCache, layer_ids: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, q = ids.shape
        padded = _bucket(b)
        cache.store.ensure(padded, cache.store.capacity)  # free rows for the padding
        key = self._key(cache, padded, q, layer_ids)
        if key in self.failed:
            return self._eager(ids, positions, cache, layer_ids)
        run = self.captured.get(key)
        if run is None:
            try:
                run = self._capture(key, cache, layer_ids)
            except Exception as e:  # an optimisation only: keep serving without it
                warnings.warn(f"CUDA graph capture failed for batch {padded}, block {q} ({e}); running eagerly")
                self.failed.add(key)
                return self._eager(ids, positions, cache, layer_ids)
            self.captured = {k: v for k, v in self.captured.items() if k[3:] == key[3:]}  # drop stale storage
            self.captured[key] = run
        run.ids[:b].copy_(ids)
        run.positions[:b].copy_(positions)
        if padded > b:
            run.ids[b:].zero_()
            run.positions[b:].copy_(torch.arange(q, device=ids.device).expand(padded - b, q))
        run.graph.replay()
        cache.note_written(positions)
        features = run.features[:b].clone() if run.features is not None else None
        return run.logits[:b].clone(), features

    def _eager(self, ids, positions, cache, layer_ids):
        if not cache.fresh:
            cache.reserve(int(positions.max()) + 1)
        return self.net(ids, positions, cache, layer_ids, False)
