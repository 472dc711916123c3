"""Response regeneration: the target answers the training prompts itself, in batches.

Generation runs through our `SpecDecoder` (block_size=1 is plain decoding; with a drafter it is
the same output, faster), and every finished batch is appended to the shards right away, so an
interrupted run resumes where it stopped (`ShardWriter.done_ids`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from blockspec.config import SamplingParams, SpecConfig
from blockspec.errors import ConfigError
from blockspec.text import encode_prompt
from blockspec.train.data import Example, Prompt, ShardWriter
from blockspec.train.features import write_part


def _seed_of(prompt_id: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{prompt_id}".encode()).digest()[:7], "little")


def regenerate(
    target: object,
    tokenizer: object,
    prompts: Sequence[Prompt],
    out_dir: str | Path,
    *,
    drafter: object | None = None,
    block_size: int = 1,
    batch_size: int = 16,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 512,
    temperature: float = 0.0,
    seed: int = 0,
    shard_size: int = 1000,
    progress: bool = True,
    backend: str = "spec",
    feature_layer_ids: Sequence[int] = (),
) -> dict:
    """Generates target responses for the prompts not yet in `out_dir`; returns a summary.

    backend "spec": our SpecDecoder (block_size=1 or with a drafter); "hf": transformers'
    `generate` on the target model (left-padded batches), a reference path.
    feature_layer_ids: also keep the target features of these layers (backend "spec"), so
    training does not pay a second target pass over the data (`out_dir/features/parts`).
    """
    if feature_layer_ids and backend != "spec":
        raise ConfigError("capturing features needs backend 'spec'; drop --features-for or use --backend spec")
    n_layers = target.info.num_layers
    if any(not 0 <= i < n_layers for i in feature_layer_ids):
        raise ConfigError(f"feature layer ids must be in [0, {n_layers}) for this target, got {list(feature_layer_ids)}")
    from tqdm import tqdm

    from blockspec.engine.decoder import SpecDecoder

    writer = ShardWriter(out_dir, shard_size)
    done = writer.done_ids()
    encoded: list[tuple[Prompt, list[int]]] = []
    skipped = 0
    for p in prompts:
        if p.id in done:
            continue
        ids = encode_prompt(tokenizer, [dict(m) for m in p.messages], chat=True)
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        encoded.append((p, ids))
    # Similar lengths in a batch waste less work on padding slots; keep the order otherwise.
    window = batch_size * 8
    ordered = []
    for i in range(0, len(encoded), window):
        ordered.extend(sorted(encoded[i : i + window], key=lambda x: len(x[1])))
    decoder = SpecDecoder(target, drafter, SpecConfig(block_size=block_size if drafter is not None else 1))
    t0, tokens, written = time.perf_counter(), 0, 0
    bar = tqdm(total=len(ordered), desc="datagen", unit="prompt", disable=not progress, dynamic_ncols=True)
    try:
        for i in range(0, len(ordered), batch_size):
            batch = ordered[i : i + batch_size]
            params = [
                SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=_seed_of(p.id, seed))
                for p, _ in batch
            ]
            feats = None
            if backend == "hf":
                outs = _hf_generate(target, [ids for _, ids in batch], max_new_tokens, temperature,
                                    _seed_of(batch[0][0].id, seed))
            else:
                results = decoder.generate([ids for _, ids in batch], params,
                                           capture_layer_ids=tuple(feature_layer_ids))
                outs = [list(r.token_ids) for r in results]
                if feature_layer_ids:
                    feats = [r.features for r in results]
            if feats is not None:  # before the shard line: a written example always has its part
                write_part(Path(out_dir) / "features", feature_layer_ids, [p.id for p, _ in batch], feats)
            examples = []
            for (p, ids), gen in zip(batch, outs):
                examples.append(Example(p.id, ids + gen, [0] * len(ids) + [1] * len(gen)))
                tokens += len(gen)
            writer.write(examples)
            written += len(examples)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{tokens / max(1e-9, time.perf_counter() - t0):.0f}")
    finally:
        bar.close()
    return {
        "already_done": len(done),
        "written": written,
        "skipped_long_prompts": skipped,
        "generated_tokens": tokens,
        "seconds": round(time.perf_counter() - t0, 2),
    }


@torch.no_grad()
def _hf_generate(
    target: object, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int
) -> list[list[int]]:
    """Batched `transformers` generation; returns each row's new tokens up to and including EOS."""
    eos = set(target.info.eos_token_ids)
    width = max(len(p) for p in prompts)
    pad = next(iter(eos), 0)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        attn[r, width - len(p) :] = 1
    kwargs = {"do_sample": temperature > 0}
    if temperature > 0:
        torch.manual_seed(seed)
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    out = target.model.generate(
        input_ids=ids.to(target.device), attention_mask=attn.to(target.device), max_new_tokens=max_new_tokens,
        eos_token_id=sorted(eos) or None, pad_token_id=pad, **kwargs,
    )
    result = []
    for row in out[:, width:].tolist():
        gen = []
        for t in row:
            gen.append(t)
            if t in eos:
                break
        result.append(gen)
    return result
