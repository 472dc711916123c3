"""Packed weights kept on disk beside a converted model, so that loading a model converted from a
4- or 8-bit GGUF file does not pack its matrices again: packing fits scales block by block, which
takes far longer than reading them back (docs/DESIGN.md section 12).

One safetensors file per model and dtype (where: `cache_dir.packed_weights_file`) holds
`<weight name>.qs` and `<weight name>.sc` of every packed matrix, and in its metadata:
  key       what the packed forms were made from: FORMAT and a digest of packed_weights.py
            (how they were made), the dtype, and the name, size and modification time of the
            model's weight files and config (what they were made from);
  entries   every matrix tried: its bits, or null where it does not pack;
  checksum  crc32 of every tensor's bytes, in the order of `entries`.
A file of another key, a damaged or truncated one, or one whose packed rows do not rebuild the
model's weights (the first and last rows of every matrix are checked at each load) is not used:
the weights are packed again and the file rewritten. Files are written under a temporary name
and renamed into place, so a reader never sees half a file; a file that cannot be written (a
read-only cache) only costs the next load its packing time.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path

import torch

from blockspec.cache_dir import PACKED_PREFIX
from blockspec.cpu import packed_weights
from blockspec.cpu.packed_weights import PackedWeight, identity, pack_linears, unpack

FORMAT = 1  # raise when PackedWeight's layout changes in a way packed_weights.py's text does not show
_CHECKED_ROWS = 8  # rows of each matrix, first and last, rebuilt and compared at every load
_STALE_S = 3600.0  # temporary files older than this were left by an interrupted writer
_SLOW_S = 2.0  # packing that takes longer shows a progress bar (on a terminal) and says where it went


def source_key(model_dir: str | os.PathLike[str], dtype: torch.dtype) -> dict:
    """What a model's packed forms depend on: how packing works, the dtype, and the model's
    weight files as they are now."""
    model = Path(model_dir)
    files = sorted(p for p in model.iterdir() if p.is_file() and not p.name.startswith((".", PACKED_PREFIX)) and (
        p.suffix == ".safetensors" or p.name == "config.json"))  # the model's, not the packed forms' own
    code = hashlib.sha256(Path(packed_weights.__file__).read_bytes()).hexdigest()[:16]
    return {"format": FORMAT, "packing": code, "dtype": str(dtype).removeprefix("torch."),
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def _tensor_names(entries: dict[str, int | None]) -> list[str]:
    return [f"{n}.{part}" for n, bits in entries.items() if bits is not None for part in ("qs", "sc")]


def _checksum(tensors: list[torch.Tensor]) -> str:
    crc = 0
    for t in tensors:
        crc = zlib.crc32(memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B"), crc)
    return f"{crc:08x}"


def save(path: str | os.PathLike[str], packed: dict[str, PackedWeight | None], key: dict) -> None:
    """Writes the packed forms of `packed` (weight name -> PackedWeight, None where it did not
    pack) to `path`, atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for name, p in packed.items():
        if p is not None:
            tensors[f"{name}.qs"], tensors[f"{name}.sc"] = p.qs.contiguous(), p.sc.contiguous()
    entries = {name: None if p is None else p.bits for name, p in packed.items()}
    meta = {"key": json.dumps(key, sort_keys=True), "entries": json.dumps(entries),
            "checksum": _checksum([tensors[n] for n in _tensor_names(entries)])}
    now = time.time()
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        try:
            if now - stale.stat().st_mtime > _STALE_S:
                stale.unlink()
        except OSError:  # another process's, just renamed or removed
            pass
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def load(path: str | os.PathLike[str], key: dict, weights: dict[str, torch.Tensor]
         ) -> dict[str, PackedWeight | None] | None:
    """The packed form of each of `weights` (weight name -> the model's weight), or None where
    the file is missing, of another key, damaged, or does not rebuild these weights."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("key") != json.dumps(key, sort_keys=True):
                return None
            entries = json.loads(meta["entries"])
            if not isinstance(entries, dict) or set(entries) != set(weights):
                return None
            names = _tensor_names(entries)
            tensors = {n: f.get_tensor(n) for n in names}
    except Exception:  # a truncated or overwritten file: safetensors raises errors of several kinds
        return None
    if _checksum([tensors[n] for n in names]) != meta.get("checksum"):
        return None
    out: dict[str, PackedWeight | None] = {}
    for name, bits in entries.items():
        if bits is None:
            out[name] = None
            continue
        weight = weights[name]
        try:
            p = PackedWeight(int(bits), tensors[f"{name}.qs"], tensors[f"{name}.sc"], identity(weight), weight.dtype)
        except (ValueError, TypeError):
            return None
        if p.shape != tuple(weight.shape) or not _rebuilds(p, weight):
            return None
        out[name] = p
    return out


def _rebuilds(p: PackedWeight, weight: torch.Tensor) -> bool:
    """Whether the first and last rows of `p` rebuild those of `weight` exactly (for a bf16
    weight: their bf16 roundings, as `packed_weights.pack_for` requires)."""
    out = p.shape[0]
    rows = sorted({*range(min(_CHECKED_ROWS, out)), *range(max(0, out - _CHECKED_ROWS), out)})
    part = PackedWeight(p.bits, p.qs[rows].contiguous(), p.sc[rows].contiguous(), p.source, p.dtype)
    return torch.equal(unpack(part).to(weight.dtype), weight.detach()[rows])


def pack_cached(named: list[tuple[str, torch.nn.Linear]], sources: list[torch.Tensor | None] | None,
                path: Path | None, key: dict | None) -> int:
    """`pack_linears` over the modules of `named` (weight name, module), reading their packed
    forms from `path` where it holds valid ones for `key`, else packing them (with progress when
    slow) and writing them there when any packed. path None: pack, keep nothing. Returns how many
    were packed."""
    modules = [m for _, m in named]
    if path is not None and key is not None:
        found = load(path, key, {n: m.weight for n, m in named})
        if found is not None:
            for name, module in named:
                module.packed = found[name]
            return sum(p is not None for p in found.values())
    from tqdm.auto import tqdm

    start = time.monotonic()
    bar = tqdm(total=len(modules), desc="packing weights", unit="matrix", delay=_SLOW_S, file=sys.stderr,
               disable=None, leave=False)
    with bar:
        done = pack_linears(modules, sources, on_each=bar.update)
    seconds = time.monotonic() - start
    if path is None or key is None or not done:
        return done
    try:
        save(path, {n: m.packed for n, m in named}, key)
    except OSError as e:
        warnings.warn(f"blockspec: could not keep the packed weights in {path} ({e}); the next load packs "
                      "them again", stacklevel=2)
        return done
    if seconds > _SLOW_S:
        print(f"blockspec: packed {done} weight matrices in {seconds:.0f} s, once: kept in {path}",
              file=sys.stderr, flush=True)
    return done
