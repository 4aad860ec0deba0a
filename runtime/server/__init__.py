"""``mgx-run serve``: an OpenAI-compatible HTTP server (completions, chat, SSE streaming), Prometheus
metrics and a live dashboard, over one engine.

    from mgx.runtime.server import Server, ServerConfig, serve
    serve(Engine("model.mgx"), ServerConfig(model_names=("model",)), host="127.0.0.1", port=8000)

Needs starlette and uvicorn (imported only here, so ``import mgx.runtime`` stays light).
"""

from __future__ import annotations

from .app import Server, ServerConfig, serve, uvicorn_server
from .protocol import APIError

__all__ = ["APIError", "Server", "ServerConfig", "serve", "uvicorn_server"]
