"""The HTTP API in front of the serving engine (`xpod serve`): the OpenAI protocol's request
checks (`protocol`), the server's options (`options`), the aiohttp server (`server`) and its
Prometheus metrics (`metrics`). `server` and `metrics` need the `serve` extra (aiohttp,
prometheus-client) and are imported by whoever runs them, not here. Imports the engine, the
model and the pod.
"""

from runtime.api.options import ServerOptions
from runtime.api.protocol import APIError, ModelInfo, parse_chat, parse_completion

__all__ = ["APIError", "ModelInfo", "ServerOptions", "parse_chat", "parse_completion"]
