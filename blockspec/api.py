"""Python API: load a target and a drafter, generate text or chat replies with DFlash.

    import blockspec
    pipe = blockspec.load("smollm2-135m-instruct")            # zoo name, local dir or Hub id
    out = pipe.generate([{"role": "user", "content": "Hi!"}], max_new_tokens=64)
    print(out.text, out.stats.mean_tau)
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from blockspec.config import DEFAULT_TREE_NODES, SamplingParams, SpecConfig
from blockspec.cpu.openmp import release_thread_pool
from blockspec.cpu.threads import governor
from blockspec.errors import CheckpointError, ConfigError
from blockspec.dflash.drafter import DFlashDrafter, load_drafter, new_drafter_for_target, read_drafter_config
from blockspec.cpu.linear import cpu_bf16_matmul
from blockspec.targets.base import DTYPES, Target
from blockspec.dflash.results import GenerationResult, RequestStats
from blockspec.engine.decoder import SpecDecoder
from blockspec.dflash.lookup import LookupConfig
from blockspec.zoo.registry import resolve_target_dir
from blockspec.text import IncrementalDetokenizer, Messages, StopStrings, encode_prompt

FRESH = "fresh"  # drafter argument: a randomly initialised drafter (lossless, but tau ~ 1)


@dataclass
class Completion:
    """A finished generation: text (stop string removed), token ids and statistics."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats

    @property
    def tokens_per_s(self) -> float:
        return self.stats.tokens_per_s(len(self.token_ids))


class TextStream(Iterator[str]):
    """One streamed generation (`Pipeline.stream`): iterating yields its text deltas (str) as
    tokens are committed; `completion` is the finished Completion, whose text is the deltas
    joined."""

    def __init__(self, items: Iterator[str | Completion]) -> None:
        self._items = items  # the deltas, then the Completion
        self._completion: Completion | None = None

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        if self._completion is not None:
            raise StopIteration
        item = next(self._items)
        if isinstance(item, Completion):
            self._completion = item
            raise StopIteration
        return item

    @property
    def completion(self) -> Completion:
        """The finished generation; asked before the last delta, it decodes the rest first (the
        deltas not yet read are then skipped)."""
        for _ in self:
            pass
        if self._completion is None:  # the generation raised, and iterating re-raised it
            raise RuntimeError("this stream's generation failed with the error its iteration raised")
        return self._completion


def pick_mask_token(tokenizer: object, vocab_size: int) -> int:
    """A mask token id for a new drafter: an existing `<|MASK|>`-like token, else the last id."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for name in ("<|MASK|>", "<mask>", "[MASK]"):
        if name in vocab and vocab[name] < vocab_size:
            return int(vocab[name])
    return vocab_size - 1


def default_drafter_for(target_name: str) -> Path | None:
    """The drafter shipped in the package for a zoo target, if any."""
    from blockspec.zoo import shipped_drafter

    return shipped_drafter(str(target_name))


def check_drafter(target: str | Path, drafter: str | Path | None) -> str | Path:
    """What `load` will load as the drafter, checked before anything is loaded or downloaded:
    "none", FRESH, or a drafter directory (the one shipped for a zoo target when `drafter` is
    None). Raises CheckpointError, phrased for Python and for the command line, when no drafter
    ships for the target or the directory is not a drafter."""
    if drafter is None:
        shipped = default_drafter_for(str(target))
        if shipped is not None:
            return shipped
        from blockspec.zoo import model_kind, models_with_drafters

        model_kind(str(target))  # a target that does not exist says so first

        have = ", ".join(models_with_drafters()) or "none yet"
        what = f"no drafter ships for target {str(target)!r} (zoo models with one: {have})"
        raise CheckpointError(
            f"{what}; pass drafter=\"DIR\" (a DFlash drafter directory), drafter=\"{FRESH}\" (untrained: lossless, "
            f"no speedup) or drafter=\"none\" (plain decoding)",
            cli=f"{what}; pass --drafter DIR (a DFlash drafter directory), --drafter {FRESH} (untrained: lossless, "
                f"no speedup) or --drafter none (plain decoding)")
    if str(drafter) in ("none", FRESH):
        return str(drafter)
    read_drafter_config(drafter)  # a missing or broken directory fails now, not after the target's load
    return Path(drafter)


class Pipeline:
    """A target, its tokenizer, an optional drafter and the decoder that runs them (the engine's
    loop on the calling thread: engine/decoder.py)."""

    def __init__(
        self,
        target: Target,
        tokenizer: object,
        drafter: DFlashDrafter | None,
        *,
        block_size: int | None = None,
        adaptive_block: bool = True,
        lookup: LookupConfig | None = None,
        tree_nodes: int = 0,
        drafter_source: str = "",
        target_source: str = "",
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        size = block_size or (drafter.block_size if drafter is not None else 1)
        lookup = lookup if size > 1 else None
        self.decoder = SpecDecoder(target, drafter, SpecConfig(block_size=size, adaptive=adaptive_block and size > 1,
                                                               lookup=lookup, tree_nodes=tree_nodes if size > 1 else 0))
        self.drafter_source = drafter_source
        self.target_source = target_source

    @property
    def compute(self) -> str:
        """The target's compute mode: "exact" or "int8" (`load`'s compute)."""
        return getattr(self.target, "compute", "exact")

    @property
    def block_size(self) -> int:
        """The block size, or with adaptive_block the largest one a step may use."""
        return self.decoder.spec.block_size

    @property
    def adaptive_block(self) -> bool:
        return self.decoder.spec.adaptive

    @property
    def lookup(self) -> LookupConfig | None:
        """The n-gram lookup proposals' settings, None when every proposal is drafted."""
        return self.decoder.spec.lookup

    @property
    def tree_nodes(self) -> int:
        """The largest token tree a step verifies (0: chains only; `load`'s tree_nodes)."""
        return self.decoder.spec.tree_nodes

    def encode(self, prompt: str | Messages, *, chat: bool | None = None, **template_kwargs: object) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat=chat, chat_template_kwargs=template_kwargs or None)

    def sampling(self, **kwargs: object) -> SamplingParams:
        return SamplingParams(**kwargs)

    def generate(
        self,
        prompt: str | Messages,
        *,
        chat: bool | None = None,
        block_size: int | None = None,
        enable_thinking: bool | None = None,
        **sampling: object,
    ) -> Completion:
        """Generates one completion. `sampling`: fields of SamplingParams (max_new_tokens, ...)."""
        return self.generate_batch([prompt], chat=chat, block_size=block_size,
                                   enable_thinking=enable_thinking, **sampling)[0]

    def generate_batch(
        self,
        prompts: list[str | Messages],
        *,
        chat: bool | None = None,
        block_size: int | None = None,
        enable_thinking: bool | None = None,
        **sampling: object,
    ) -> list[Completion]:
        params = SamplingParams(**sampling)
        kwargs = {"enable_thinking": enable_thinking} if enable_thinking is not None else {}
        ids = [encode_prompt(self.tokenizer, p, chat=chat, chat_template_kwargs=kwargs) for p in prompts]
        return self.generate_ids(ids, params, block_size=block_size)

    def generate_ids(
        self, prompts: list[list[int]], params: SamplingParams, *, block_size: int | None = None, on_tokens=None,
        stops: StopStrings | None = None,
    ) -> list[Completion]:
        """Generates for token-id prompts through the engine's loop; `stops`: the StopStrings of
        params.stop when the caller already built them (streaming)."""
        stops = stops or StopStrings(self.tokenizer, params.stop)
        check = (lambda _i, ids: stops.tokens_to_keep(ids)) if params.stop else None
        results = self.decoder.generate(prompts, params, block_size=block_size, on_tokens=on_tokens, stop_check=check)
        return [self._completion(r, stops) for r in results]

    def _completion(self, r: GenerationResult, stops: StopStrings) -> Completion:
        return Completion(stops.visible_text(r.token_ids), r.token_ids, r.finish_reason, r.stats)

    def stream(
        self,
        prompt: str | Messages,
        *,
        chat: bool | None = None,
        block_size: int | None = None,
        **sampling: object,
    ) -> TextStream:
        """Text deltas as tokens are committed: iterate the returned `TextStream` for str pieces;
        its `completion` is the finished Completion (`sampling`: fields of SamplingParams).
        Nothing is decoded until the first piece is asked for."""
        params = SamplingParams(**sampling)
        ids = encode_prompt(self.tokenizer, prompt, chat=chat)
        return TextStream(self._stream_items(ids, params, block_size))

    def _stream_items(self, ids: list[int], params: SamplingParams, block_size: int | None
                      ) -> Iterator[str | Completion]:
        """The text deltas of one generation, then its Completion."""
        stops = StopStrings(self.tokenizer, params.stop)
        detok = IncrementalDetokenizer(stops)
        events: queue.Queue = queue.Queue()

        def on_tokens(_row: int, new: list[int]) -> None:
            delta = detok.push(new)
            if delta:
                events.put(delta)

        def work() -> None:
            try:
                events.put(self.generate_ids([ids], params, block_size=block_size, on_tokens=on_tokens,
                                             stops=stops)[0])
            except BaseException as e:  # re-raised in the consumer's thread
                events.put(e)

        release_thread_pool()  # this thread only waits now; its OpenMP team would slow `work` (cpu/openmp.py)
        threading.Thread(target=work, daemon=True).start()
        while True:
            item = events.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, Completion):
                tail = detok.push([], final=True)
                if tail:
                    yield tail
                yield item
                return
            yield item


def resolve_drafter_dtype(drafter_dtype: str, target_dtype: str, device: str, compute: str = "exact"
                          ) -> torch.dtype:
    """The drafter's torch dtype: explicit, or "auto" (the target's; bfloat16 beside a float32
    target on a CPU whose oneDNN runs bf16 products: drafting streams half the bytes; float32
    beside a target computing in int8, whose mode the drafter then takes: 4-bit integer weights
    stream a quarter of bf16's bytes, `DFlashDrafter.use_compute`)."""
    if drafter_dtype == "auto":
        cpu = torch.device(device).type == "cpu"
        if compute == "int8":
            return torch.float32
        if cpu and target_dtype == "float32" and cpu_bf16_matmul():
            return torch.bfloat16
        return DTYPES[target_dtype]
    if drafter_dtype not in DTYPES:
        raise ConfigError(f"drafter_dtype must be 'auto' or one of {sorted(DTYPES)}, got {drafter_dtype!r}")
    return DTYPES[drafter_dtype]


def load(
    target: str | Path,
    drafter: str | Path | None = None,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    block_size: int | None = None,
    adaptive_block: bool = True,
    drafter_layers: int = 1,
    seed: int = 0,
    backend: str = "auto",
    draft_vocab: bool = True,
    drafter_dtype: str = "auto",
    lookup: bool | LookupConfig = True,
    compute: str = "auto",
    tree_nodes: int | None = None,
) -> Pipeline:
    """Loads a target (zoo name, directory or Hub id) and a drafter.

    drafter: a DFlash drafter directory; None takes the drafter shipped for a zoo target;
    "fresh" builds a randomly initialised one (lossless but slow: tau ~ 1); "none" decodes
    without a drafter (plain autoregressive).
    backend: "native" (own Llama/Qwen2/Qwen3 code, static KV cache), "hf" (any transformers
    causal LM) or "auto" (native when the architecture is supported).
    block_size: the block size (default: the drafter's); with adaptive_block (the default), the
    largest block a step may use: each step then takes the size that maximises expected tokens per
    second from the step costs measured on this machine (a CPU favours short blocks) and the
    acceptance so far, down to plain decoding where drafting does not pay (sampling at a low
    acceptance, a large batch). adaptive_block=False verifies the whole block at every step, as
    the published DFlash does.
    draft_vocab: use the drafter's draft_vocab.safetensors when it has one (proposals from the
    tokens it was trained on; cheaper drafting, same output); False drafts from every token.
    drafter_dtype: the drafter's dtype; "auto" is the target's, except bfloat16 for a float32
    target on a CPU that runs bf16 products and float32 beside a target computing in int8 (the
    drafter then drafts in int8 too: `resolve_drafter_dtype`). Verification by the target
    keeps the output exact whatever the drafter computes in.
    lookup: where a sequence's last tokens occurred before (prompt or output), propose what
    followed them instead of the drafted block (n-gram lookup, dflash/lookup.py: targets copy
    names, numbers and code from the prompt, which a small drafter predicts poorly); True takes
    LookupConfig(), False drafts every proposal (pure DFlash). Same output either way.
    compute: how the target computes (targets/native/backends.py): "exact" (bit-exact fp32 / bf16,
    transformers' numerics), "int8" (8-bit activations times the 4- / 8-bit weights in integers:
    faster on a CPU, lossless within the mode, native backend, fp32 only), or "auto" (the
    default): int8 for a zoo model converted from a quantised GGUF file, whose perplexity stays
    within 1% of exact (BENCHMARKS.md), exact for anything else. `pipeline.compute` says which.
    tree_nodes: verify a token tree of up to this many proposed nodes per step instead of one
    chain (docs/DESIGN.md section 5.3): each step spends its verify width best-first over the
    drafter's top choices at every depth, so its second and third choices get verified too. Same
    output. None (default): DEFAULT_TREE_NODES (15); 0: chains only. With the adaptive block size each
    step verifies a tree only where it is expected to pay better than its chain. Targets with recurrent
    layers keep chains.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    from blockspec.targets.native.backends import COMPUTES

    if compute not in COMPUTES:  # before the slow load (or a pull)
        raise ConfigError(f"compute must be one of {', '.join(COMPUTES)}, got {compute!r}")
    governor()  # starts watching the other processes' load: the first step then knows it (cpu/threads.py)
    lookup_cfg = resolve_lookup(lookup)  # a bad value fails before the slow load
    tree_nodes = SpecConfig(tree_nodes=DEFAULT_TREE_NODES if tree_nodes is None else tree_nodes).tree_nodes  # likewise
    resolve_drafter_dtype(drafter_dtype, dtype, device)  # a bad value fails before the slow load
    from blockspec.targets.native.load import load_target

    chosen = check_drafter(target, drafter)
    target_dir = resolve_target_dir(target)
    hf_target, tokenizer = load_target(target_dir, backend=backend, dtype=dtype, device=device, compute=compute)
    source = str(chosen) if drafter is None else str(drafter)
    draft_dtype = resolve_drafter_dtype(drafter_dtype, dtype, device, getattr(hf_target, "compute", "exact"))
    draft: DFlashDrafter | None
    if chosen == "none":
        draft = None
    elif chosen == FRESH:
        info = hf_target.info
        draft = new_drafter_for_target(
            hf_target.config, mask_token_id=pick_mask_token(tokenizer, info.vocab_size),
            num_layers=drafter_layers, seed=seed, dtype=draft_dtype,
        ).to(device)
    else:
        draft = load_drafter(chosen, dtype=draft_dtype, device=device, draft_vocab=draft_vocab)
    return Pipeline(hf_target, tokenizer, draft, block_size=block_size, adaptive_block=adaptive_block,
                    lookup=lookup_cfg, tree_nodes=tree_nodes, drafter_source=source, target_source=str(target))


def resolve_lookup(lookup: bool | LookupConfig | None) -> LookupConfig | None:
    """`load`'s lookup argument as a LookupConfig (True: the defaults) or None (off)."""
    if isinstance(lookup, LookupConfig) or lookup is None:
        return lookup
    if isinstance(lookup, bool):
        return LookupConfig() if lookup else None
    raise ConfigError(f"lookup must be True, False or a LookupConfig, got {lookup!r}")
