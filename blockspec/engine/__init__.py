"""Continuous-batching engine over the speculative decoding step (blockspec/engine/engine.py)."""

from blockspec.deprecation import no_attribute, warn_moved
from blockspec.dflash import policy as _policy
from blockspec.engine.decoder import SpecDecoder
from blockspec.engine.engine import Engine, EngineConfig
from blockspec.engine.metrics import EngineMetrics, Histogram
from blockspec.engine.request import RequestHandle, TokenEvent
from blockspec.engine.scheduler import QueueFullError
from blockspec.dflash.results import GenerationResult, RequestStats

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineMetrics",
    "GenerationResult",
    "Histogram",
    "QueueFullError",
    "RequestHandle",
    "RequestStats",
    "SpecDecoder",
    "TokenEvent",
]

# The block-size policy lives in dflash/policy/; its old names here warn until the next release.
_MOVED = ("AdaptiveBlock", "CostModel")


def __getattr__(name: str) -> object:
    if name not in _MOVED:
        raise no_attribute(__name__, name)
    warn_moved(__name__, name, "blockspec.dflash.policy")
    return getattr(_policy, name)
