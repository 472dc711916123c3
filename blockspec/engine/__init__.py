"""Continuous-batching engine over the speculative decoding step (blockspec/engine/engine.py)."""

from blockspec.dflash.policy import AdaptiveBlock, CostModel
from blockspec.engine.decoder import SpecDecoder
from blockspec.engine.engine import Engine, EngineConfig
from blockspec.engine.metrics import EngineMetrics, Histogram
from blockspec.engine.request import RequestHandle, TokenEvent
from blockspec.engine.scheduler import QueueFullError
from blockspec.dflash.batch import GenerationResult, RequestStats

__all__ = [
    "AdaptiveBlock",
    "CostModel",
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
