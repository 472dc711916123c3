"""Native (own-code) targets for common families, over a position-indexed static KV cache."""

from blockspec.targets.native.cache import KVStore, StaticCache
from blockspec.targets.native.config import NativeConfig, native_config, unsupported_reason
from blockspec.targets.native.llama import NativeLlama, NativeTarget
from blockspec.targets.native.load import BACKENDS, is_native_supported, load_native_target, load_target

__all__ = [
    "KVStore",
    "NativeConfig",
    "NativeLlama",
    "NativeTarget",
    "StaticCache",
    "is_native_supported",
    "load_native_target",
    "load_target",
    "BACKENDS",
    "native_config",
    "unsupported_reason",
]
