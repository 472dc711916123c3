"""Baselines on the same target weights: `transformers` generate, prompt-lookup decoding (a
training-free speculative method in `transformers`) and the reference DFlash package.

All three run batch 1, prompt by prompt, as they are published. Each counts the target's forward
passes with a hook, so a mean acceptance length (tokens per verification pass) is known for the
speculative ones without relying on their internals.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from blockspec.bench.runner import Output, Progress, Request
from blockspec.errors import ConfigError

DEFAULT_PLD_TOKENS = 10


class _ForwardCounter:
    """Counts forward calls of a module while active (`with counter:`)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.calls = 0
        self._handle = None

    def __enter__(self) -> _ForwardCounter:
        self.calls = 0
        self._handle = self.module.register_forward_hook(self._hook)
        return self

    def _hook(self, *_args: object) -> None:
        self.calls += 1

    def __exit__(self, *_exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def _finish_reason(ids: list[int], eos: frozenset[int]) -> str:
    return "stop" if ids and ids[-1] in eos else "length"


def _seed(params: object) -> None:
    if getattr(params, "seed", None) is not None and not params.greedy:
        torch.manual_seed(params.seed)


def load_hf_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    """The target directory as a plain `transformers` causal LM (SDPA attention), for the baselines."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


class _PromptByPrompt:
    """The batch-1 loop the baselines share: one `_generate(ids [1, P], params) -> [1, P + N]`
    call per request, timed, with the target's forward passes counted."""

    max_concurrency = 1
    model: nn.Module
    eos: frozenset[int]

    def _generate(self, ids: torch.Tensor, params: object) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def run(self, requests: Sequence[Request], concurrency: int, progress: Progress | None = None) -> list[Output]:
        outputs = []
        device = self.model.get_input_embeddings().weight.device
        for req in requests:
            ids = torch.tensor([list(req.prompt_ids)], device=device)
            _seed(req.params)
            with _ForwardCounter(self.model) as counter:
                t0 = time.perf_counter()
                out = self._generate(ids, req.params)
                elapsed = time.perf_counter() - t0
            gen = out[0, ids.shape[1]:].tolist()
            outputs.append(Output(gen, _finish_reason(gen, self.eos), elapsed, steps=max(0, counter.calls - 1)))
            if progress is not None:
                progress(1)
        return outputs


class HFGenerateRunner(_PromptByPrompt):
    """`model.generate` on the target, batch 1. prompt_lookup_num_tokens > 0 turns on prompt-lookup
    decoding (candidates copied from n-gram matches in the prompt, verified by the target)."""

    block_size = 1

    def __init__(self, model: nn.Module, eos_token_ids: Sequence[int], *, prompt_lookup_num_tokens: int = 0,
                 pad_token_id: int | None = None) -> None:
        if prompt_lookup_num_tokens < 0:
            raise ConfigError(f"prompt_lookup_num_tokens must be >= 0, got {prompt_lookup_num_tokens}")
        self.model = model
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.pad = pad_token_id if pad_token_id is not None else (min(self.eos) if self.eos else 0)
        self.pld = prompt_lookup_num_tokens
        self.method = "pld" if self.pld else "hf"
        self.name = f"pld n{self.pld}" if self.pld else "hf generate"

    def _config(self, params: object) -> object:
        from transformers import GenerationConfig

        kwargs: dict = dict(max_new_tokens=params.max_new_tokens, eos_token_id=sorted(self.eos) or None,
                            pad_token_id=self.pad)
        if params.greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k or None)
        if self.pld:
            kwargs.update(prompt_lookup_num_tokens=self.pld)
        return GenerationConfig(**kwargs)

    def _generate(self, ids: torch.Tensor, params: object) -> torch.Tensor:
        return self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=self._config(params))


def reference_available() -> bool:
    """Whether the reference package `dflash` (0.1.0) can be imported."""
    try:
        from dflash.model import DFlashDraftModel, dflash_generate  # noqa: F401
    except Exception:  # any import problem means: not available here
        return False
    return True


def load_reference_drafter(
    drafter_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> nn.Module:
    """The reference package's drafter class, loaded from a drafter directory in the published format."""
    from dflash.model import DFlashDraftModel

    return DFlashDraftModel.from_pretrained(str(drafter_dir), dtype=dtype).to(device).eval()


def reference_drafter_from(drafter: nn.Module, dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    """The reference class holding the same weights as one of our drafters (e.g. a fresh one):
    saved in the published format to a temporary directory and loaded back."""
    from blockspec.dflash.drafter import save_drafter

    with tempfile.TemporaryDirectory(prefix="blockspec-refdrafter-") as tmp:
        save_drafter(drafter, tmp)
        return load_reference_drafter(tmp, dtype=dtype, device=device)


class ReferenceRunner(_PromptByPrompt):
    """`dflash.model.dflash_generate` from the reference package, batch 1, same target weights."""

    method = "reference"

    def __init__(self, ref_drafter: nn.Module, model: nn.Module, eos_token_ids: Sequence[int], block_size: int) -> None:
        self.drafter = ref_drafter
        self.model = model
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.block_size = block_size
        self.name = f"reference b{block_size}"

    def _generate(self, ids: torch.Tensor, params: object) -> torch.Tensor:
        from dflash.model import dflash_generate

        return dflash_generate(self.drafter, self.model, ids, params.max_new_tokens, sorted(self.eos) or None,
                               temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                               block_size=self.block_size)
