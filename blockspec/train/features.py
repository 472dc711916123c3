"""Target features for training: computed once per datagen shard and cached on disk.

The target is frozen, so the features of its `target_layer_ids` for a training sequence never
change; recomputing them every epoch would cost a full target forward per sequence. The cache
keeps one safetensors file per datagen shard and layer set: `features` [T, L*H] (all sequences
concatenated; bf16 by default) and `offsets` [n + 1], with the example ids in the metadata so a
shard that grew since (resumed datagen) is recomputed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from blockspec.targets.slots import EMPTY
from blockspec.train.data import Example, read_shard, shard_files


@torch.no_grad()
def target_features(
    target: object, sequences: Sequence[Sequence[int]], layer_ids: Sequence[int], batch_size: int = 4
) -> list[torch.Tensor]:
    """Features [S_i, L*H] of each sequence (right-padded batches, fresh cache per batch)."""
    out: list[torch.Tensor] = []
    device = target.device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    result: dict[int, torch.Tensor] = {}
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = max(len(sequences[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long, device=device)
        pos = torch.full((len(idx), width), EMPTY, dtype=torch.long, device=device)
        for r, i in enumerate(idx):
            n = len(sequences[i])
            ids[r, :n] = torch.tensor(list(sequences[i]), device=device)
            pos[r, :n] = torch.arange(n, device=device)
        cache = target.new_cache(len(idx))
        _, feats = target.forward(ids, pos, cache, layer_ids=tuple(layer_ids), last_logits_only=True)
        for r, i in enumerate(idx):
            result[i] = feats[r, : len(sequences[i])].float().cpu()
    for i in range(len(sequences)):
        out.append(result[i])
    return out


def _layers_tag(layer_ids: Sequence[int]) -> str:
    return "layers-" + "-".join(str(i) for i in layer_ids)


def _cache_name(shard: Path, layer_ids: Sequence[int]) -> str:
    return f"{shard.stem}.{_layers_tag(layer_ids)}.safetensors"


def parts_dir(cache_dir: str | Path, layer_ids: Sequence[int]) -> Path:
    """Where datagen leaves the features it captured while generating, one file per batch."""
    return Path(cache_dir) / "parts" / _layers_tag(layer_ids)


def write_part(cache_dir: str | Path, layer_ids: Sequence[int], ids: Sequence[str], feats: Sequence[torch.Tensor],
               dtype: torch.dtype = torch.bfloat16) -> Path:
    """Stores the captured features of one datagen batch (atomic), for FeatureStore.build to use."""
    import hashlib

    from safetensors.torch import save_file

    folder = parts_dir(cache_dir, layer_ids)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"part-{hashlib.sha256('|'.join(ids).encode()).hexdigest()[:16]}.safetensors"
    offsets = torch.tensor([0] + [f.shape[0] for f in feats]).cumsum(0)
    tmp = path.with_suffix(".tmp")
    save_file({"features": torch.cat(list(feats)).to(dtype).contiguous(), "offsets": offsets}, str(tmp),
              metadata={"ids": json.dumps(list(ids)), "layer_ids": json.dumps(list(layer_ids))})
    tmp.replace(path)
    return path


class _Parts:
    """Index of captured-feature parts: id -> features, read on demand."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        self._where: dict[str, tuple[object, int, int]] = {}
        for path in sorted(folder.glob("part-*.safetensors")) if folder.is_dir() else []:
            try:
                f = safe_open(str(path), "pt")
                ids = json.loads(f.metadata()["ids"])
                offsets = f.get_tensor("offsets").tolist()
            except Exception:  # a part cut short by an interrupted datagen: recompute those
                continue
            for j, ex_id in enumerate(ids):
                self._where[ex_id] = (f, offsets[j], offsets[j + 1])

    def get(self, ex_id: str, length: int) -> torch.Tensor | None:
        found = self._where.get(ex_id)
        if found is None or found[2] - found[1] != length:
            return None
        f, a, b = found
        return f.get_slice("features")[a:b]


class FeatureStore:
    """Cached features of every example of a datagen directory, read lazily per example."""

    def __init__(self, data_dir: str | Path, layer_ids: Sequence[int], cache_dir: str | Path | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.cache_dir = Path(cache_dir) if cache_dir else self.data_dir / "features"
        self._index: dict[str, tuple[Path, int, int]] = {}
        self._handles: dict[Path, object] = {}

    def build(
        self, target: object, *, batch_size: int = 4, dtype: torch.dtype = torch.bfloat16, progress: bool = True
    ) -> int:
        """Computes missing or stale shard caches; returns how many shards were (re)computed."""
        from safetensors.torch import save_file
        from tqdm import tqdm

        self.cache_dir.mkdir(parents=True, exist_ok=True)
        captured = _Parts(parts_dir(self.cache_dir, self.layer_ids))
        made = 0
        for shard in shard_files(self.data_dir):
            examples = read_shard(shard)
            path = self.cache_dir / _cache_name(shard, self.layer_ids)
            if self._valid(path, examples):
                continue
            old = self._reusable(path)  # a shard that grew keeps the features it already had
            for e in examples:  # features datagen captured while generating cost nothing more
                if e.id not in old and (got := captured.get(e.id, len(e.input_ids))) is not None:
                    old[e.id] = got
            todo = [e for e in examples if e.id not in old]
            fresh: dict[str, torch.Tensor] = {}
            step = max(batch_size * 8, 1)
            for i in tqdm(range(0, len(todo), step), desc=f"features {shard.name}", disable=not progress):
                chunk = todo[i : i + step]
                got = target_features(target, [e.input_ids for e in chunk], self.layer_ids, batch_size)
                fresh.update({e.id: f for e, f in zip(chunk, got)})
            feats = [old[e.id] if e.id in old else fresh[e.id] for e in examples]
            offsets = torch.tensor([0] + [f.shape[0] for f in feats]).cumsum(0)
            tmp = path.with_suffix(".tmp")
            save_file(
                {"features": torch.cat(feats).to(dtype).contiguous(), "offsets": offsets},
                str(tmp),
                metadata={"ids": json.dumps([e.id for e in examples]), "layer_ids": json.dumps(self.layer_ids)},
            )
            tmp.replace(path)  # atomic: an interrupted build never leaves a half-written cache
            made += 1
        return made

    @staticmethod
    def _reusable(path: Path) -> dict[str, torch.Tensor]:
        if not path.exists():
            return {}
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as f:
                ids = json.loads(f.metadata()["ids"])
                feats, offsets = f.get_tensor("features"), f.get_tensor("offsets").tolist()
        except Exception:
            return {}
        return {ex_id: feats[offsets[j] : offsets[j + 1]] for j, ex_id in enumerate(ids)}

    @staticmethod
    def _valid(path: Path, examples: list[Example]) -> bool:
        if not path.exists():
            return False
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as f:
                ids = json.loads(f.metadata()["ids"])
        except Exception:
            return False
        return ids == [e.id for e in examples]

    def open(self) -> FeatureStore:
        """Indexes the caches; raises if a shard has no valid cache (run build first)."""
        from safetensors import safe_open

        from blockspec.errors import ConfigError

        for shard in shard_files(self.data_dir):
            path = self.cache_dir / _cache_name(shard, self.layer_ids)
            if not path.exists():
                raise ConfigError(f"no feature cache {path}; run `blockspec train --cache-features` first")
            f = safe_open(str(path), "pt")
            ids = json.loads(f.metadata()["ids"])
            offsets = f.get_tensor("offsets").tolist()
            self._handles[path] = f
            for j, ex_id in enumerate(ids):
                self._index[ex_id] = (path, offsets[j], offsets[j + 1])
        return self

    def __contains__(self, ex_id: str) -> bool:
        return ex_id in self._index

    def get(self, ex_id: str) -> torch.Tensor:
        """Features [S, L*H] (stored dtype) of one example."""
        path, a, b = self._index[ex_id]
        return self._handles[path].get_slice("features")[a:b]
