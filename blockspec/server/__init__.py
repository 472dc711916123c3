"""OpenAI-compatible HTTP server over the continuous-batching engine (`blockspec serve`)."""

from blockspec.server.app import create_app
from blockspec.server.launch import BackgroundServer

__all__ = ["BackgroundServer", "create_app"]
