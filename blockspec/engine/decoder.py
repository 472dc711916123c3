"""Batched generation on the calling thread, through the engine's loop.

`SpecDecoder.generate(prompts, params)` submits every prompt to an Engine made with
EngineConfig(own_thread=False) and decodes them together with `run_until_idle`, so the Python
API, the command line, the benchmarks, data generation and the server all run one loop
(`Engine._tick`). It keeps one engine per setting it was asked for (a block size of a call, the
capture of features), and with them their caches and the adaptive policy's measured costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from blockspec.config import SamplingParams, SpecConfig
from blockspec.dflash.results import GenerationResult
from blockspec.dflash.constraint import TokenConstraint
from blockspec.dflash.drafter import DFlashDrafter
from blockspec.dflash.policy import AdaptiveBlock
from blockspec.engine.engine import Engine, EngineConfig
from blockspec.errors import ConfigError
from blockspec.targets.base import Target

# Called after every step with (index in the prompt list, newly committed ids).
OnTokens = Callable[[int, list[int]], None]
# Returns the number of generated tokens to keep if a stop string occurred, else None.
StopCheck = Callable[[int, list[int]], int | None]
# No queue and no batch limit: one call's prompts are decoded as one batch.
_ALL_AT_ONCE = 1 << 20


class SpecDecoder:
    """Runs target + drafter for batches of token-id prompts. Holds no request state between calls."""

    def __init__(self, target: Target, drafter: DFlashDrafter | None, spec: SpecConfig | None = None) -> None:
        self.target = target
        self.drafter = drafter
        self.spec = spec or SpecConfig()
        self._engines: dict[tuple[SpecConfig, tuple[int, ...]], Engine] = {}
        self._engine(self.spec, ())  # a drafter that does not fit the target fails here

    def _engine(self, spec: SpecConfig, capture: tuple[int, ...]) -> Engine:
        key = (spec, capture)
        if key not in self._engines:
            config = EngineConfig(spec, max_batch=_ALL_AT_ONCE, max_queue=0, own_thread=False, calibrate_first=False)
            self._engines[key] = Engine(self.target, self.drafter if spec.block_size > 1 else None, config,
                                        capture_layer_ids=capture)
        return self._engines[key]

    @property
    def block_choices(self) -> dict[int, int]:
        """Steps run at each block size by the adaptive policy so far (empty when it is off)."""
        used: dict[int, int] = {}
        for engine in self._engines.values():
            if engine.adaptive is not None:
                for n, c in engine.adaptive.used.items():
                    used[n] = used.get(n, 0) + c
        return used

    @property
    def adaptive_policy(self) -> AdaptiveBlock | None:
        """The adaptive policy of the configured setting (None when spec.adaptive is off)."""
        return self._engine(self.spec, ()).adaptive

    @adaptive_policy.setter
    def adaptive_policy(self, policy: AdaptiveBlock) -> None:
        """Replaces the policy (e.g. one with known step costs); spec.adaptive must be on."""
        if not self.spec.adaptive or policy.max_block != self.spec.block_size:
            raise ConfigError(f"an adaptive policy needs SpecConfig(adaptive=True) and max_block "
                              f"{self.spec.block_size}; got adaptive={self.spec.adaptive}, max_block {policy.max_block}")
        self._engine(self.spec, ()).adaptive = policy

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams] | SamplingParams,
        *,
        block_size: int | None = None,
        on_tokens: OnTokens | None = None,
        stop_check: StopCheck | None = None,
        capture_layer_ids: tuple[int, ...] = (),
        constraints: list[TokenConstraint | None] | None = None,
    ) -> list[GenerationResult]:
        """Generates for every prompt; returns results in prompt order.

        block_size: a fixed block size for this call; None takes the SpecConfig's (adaptive
        when `spec.adaptive`: each step's block size up to spec.block_size is chosen by cost).
        capture_layer_ids: also return the target features of these layers for every position
        (what drafter training needs), for free from the passes decoding makes anyway.
        constraints: per prompt, a fresh grammar matcher its output must match, or None.
        An error inside a step is raised here, as it was raised.
        """
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        if constraints is not None and len(constraints) != len(prompts):
            raise ConfigError(f"got {len(prompts)} prompts but {len(constraints)} constraints")
        if not prompts:
            return []
        spec = self.spec
        if block_size is not None:
            spec = replace(spec, block_size=SpecConfig(block_size=block_size).block_size, adaptive=False)
        if spec.block_size > 1 and self.drafter is None:
            raise ConfigError("block_size > 1 needs a drafter; pass one, or use block_size=1")
        engine = self._engine(spec, tuple(capture_layer_ids))
        engine.last_exception = None
        handles = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                check = (lambda ids, i=i: stop_check(i, ids)) if stop_check is not None else None
                hear = (lambda ids, i=i: on_tokens(i, ids)) if on_tokens is not None else None
                handles.append(engine.submit(p, sp, stop_check=check, on_tokens=hear,
                                             constraint=constraints[i] if constraints is not None else None))
            engine.run_until_idle()
        except BaseException:  # a refused prompt or an interrupt: nothing of this call runs on in the next
            engine.stop()
            raise
        if engine.last_exception is not None:
            raise engine.last_exception
        return [h.result() for h in handles]
