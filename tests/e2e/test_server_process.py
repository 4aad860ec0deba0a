"""``mgx-run serve`` as a process: it serves, and SIGTERM drains it (running streams finish, new
connections are refused) and it exits 0, also when the drain timeout cuts streams short."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest
from _server_testing import free_socket
from click.testing import CliRunner

from mgx.formats.artifact import write_artifact
from mgx.runtime.cli import main

from _tiny_graph import tiny_contents


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("serve") / "tiny.mgx"
    write_artifact(path, tiny_contents(max_position=8192))  # room for streams that last seconds
    return path


class ServeProcess:
    def __init__(self, artifact: Path, *args: str) -> None:
        sock = free_socket()
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{self.port}"
        # The numpy reference backend: these tests need streams that last seconds on the tiny model,
        # which the C++ kernels (mgx-run's default) finish in a fraction of one.
        cmd = [sys.executable, "-c", "from mgx.runtime.cli import main; main()", "serve", str(artifact),
               "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
               "--backend", "reference", *args]  # fmt: skip
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"the server did not start: {self.proc.communicate()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def stream(url: str, max_tokens: int, started: threading.Event, out: dict) -> None:
    body = {"model": "tiny", "prompt": "the cat", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    events = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    except httpx.TransportError as e:
        out["error"] = e
    out["events"] = events
    started.set()


def test_sigterm_finishes_running_streams_then_exits_0(artifact: Path) -> None:
    server = ServeProcess(artifact, "--shutdown-timeout", "60")
    try:
        outs = [{} for _ in range(3)]
        flags = [threading.Event() for _ in outs]
        threads = [threading.Thread(target=stream, args=(server.url, 600, f, o)) for f, o in zip(flags, outs)]
        for t in threads:
            t.start()
        assert all(f.wait(60) for f in flags)  # every stream is running
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.TransportError):  # no new connections
            httpx.get(f"{server.url}/health", timeout=2)
        for t in threads:
            t.join(120)
        for out in outs:
            assert "error" not in out
            events = out["events"]
            assert events[-1] == "[DONE]"
            usage = json.loads(events[-2])["usage"]
            assert usage["completion_tokens"] == 600  # the whole answer, after the signal
            assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(60) == 0
    finally:
        server.stop()


def test_sigterm_past_the_timeout_aborts_streams_and_still_exits_0(artifact: Path) -> None:
    server = ServeProcess(artifact, "--shutdown-timeout", "0.5")
    try:
        out: dict = {}
        started = threading.Event()
        # 8,000 tokens: far more than the timeout lets through (1,000 once finished within 0.5 s on a
        # fast host, and the test saw [DONE])
        thread = threading.Thread(target=stream, args=(server.url, 8000, started, out))
        thread.start()
        assert started.wait(60)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        assert time.monotonic() - t0 < 15
        thread.join(30)
        assert "[DONE]" not in out["events"]  # cut short: the client can tell it is incomplete
    finally:
        server.stop()


def test_serve_cli_help_and_errors(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0
    for option in ("--host", "--port", "--api-key", "--max-pending", "--shutdown-timeout", "--warm-up", "/dashboard"):
        assert option in result.output
    missing = CliRunner().invoke(main, ["serve", str(tmp_path / "missing.mgx")])
    assert missing.exit_code == 1 and "error: no such model file" in missing.stderr
