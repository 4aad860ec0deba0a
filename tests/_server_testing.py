"""A real ``mgx-run serve`` HTTP server on a free loopback port, in a background thread, for tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mgx.runtime import Engine, EngineConfig
from mgx.runtime.server import Server, ServerConfig, uvicorn_server

MODEL = "tiny"


@dataclass
class Running:
    url: str  # http://127.0.0.1:PORT
    server: Server
    uvicorn: Any

    @property
    def engine(self) -> Engine:
        return self.server.engine


def free_socket() -> socket.socket:
    """A listening-ready socket bound to a free port on 127.0.0.1 (no race: uvicorn takes it as is)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def running_server(
    artifact: Path, *, engine_config: EngineConfig | None = None, **server_options: Any
) -> Iterator[Running]:
    """Serve ``artifact`` until the block ends; the server is stopped (and its engine closed) after."""
    engine = Engine(artifact, config=engine_config)
    server = Server(engine, ServerConfig(model_names=(MODEL,), **server_options))
    sock = free_socket()
    uv = uvicorn_server(server, log_level="warning", shutdown_timeout=5)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield Running(f"http://127.0.0.1:{sock.getsockname()[1]}", server, uv)
    finally:
        uv.should_exit = True
        thread.join(30)
        server.close()
        sock.close()
