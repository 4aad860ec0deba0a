"""The /dashboard page in headless Chromium, driven over the DevTools protocol: it loads, its numbers
and charts change while a load runs, nothing is logged to the console as an error, and a screenshot
is saved to test-artifacts/dashboard.png."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest
import websockets.sync.client as websockets_sync
from _server_testing import MODEL, running_server

from mgx.formats.artifact import write_artifact

from _tiny_graph import tiny_contents

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (apt-get install -y chromium)"
)

# What the page shows, read in the page: tile texts, how many non-zero points each chart drew.
PROBE = """JSON.stringify({
  status: document.getElementById("status").textContent,
  tiles: Object.fromEntries([...document.querySelectorAll("[id^=tile-]")].map(e => [e.id.slice(5), e.textContent])),
  points: Object.fromEntries(CHARTS.map(c => [c.id, c.data.flat().filter(v => v > 0).length])),
})"""


class DevTools:
    """A minimal Chrome DevTools protocol client: calls and the events that arrive meanwhile."""

    def __init__(self, ws) -> None:  # noqa: ANN001
        self.ws = ws
        self.events: list[dict] = []
        self._id = 0

    def call(self, method: str, **params) -> dict:  # noqa: ANN003
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_event(self, method: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for e in self.events:
                if e.get("method") == method:
                    return e
            msg = json.loads(self.ws.recv(timeout=max(deadline - time.monotonic(), 0.01)))
            self.events.append(msg)

    def evaluate(self, expression: str):  # noqa: ANN201
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"]["value"]

    def errors(self) -> list[dict]:
        """Console errors, uncaught exceptions and browser log errors (failed loads included)."""
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown" or (
                m == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert")
            ):
                out.append(e)
            elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(e)
        return out


def chromium(profile: Path) -> tuple[subprocess.Popen, str]:
    """Headless Chromium with its DevTools endpoint on a free loopback port; returns the page's ws URL."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-extensions", "--disable-default-apps", f"--user-data-dir={profile}",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", "--window-size=1400,1000",
             "about:blank"]  # fmt: skip
    proc = subprocess.Popen([CHROMIUM, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("Chromium did not open its DevTools port")
        time.sleep(0.1)
    port = int(port_file.read_text().split()[0])
    while True:
        pages = [
            t
            for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
            if t["type"] == "page"
        ]
        if pages or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return proc, pages[0]["webSocketDebuggerUrl"]


def run_load(url: str, seconds: float, stop: threading.Event) -> int:
    """Streaming requests from 32 clients for ``seconds`` (at most 2000); returns how many finished."""

    async def main() -> int:
        done = 0
        deadline = time.monotonic() + seconds
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:

            async def worker(k: int) -> None:
                nonlocal done
                i = 0
                while time.monotonic() < deadline and not stop.is_set() and done < 2000:
                    body = {"model": MODEL, "prompt": f"the cat {k} sat {i}", "max_tokens": 24, "stream": True,
                            "temperature": 0.7, "seed": i}  # fmt: skip
                    async with client.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        async for _ in r.aiter_lines():
                            pass
                    done += 1
                    i += 1

            await asyncio.gather(*(worker(k) for k in range(32)))
        return done

    return asyncio.run(main())


def test_dashboard_updates_live_in_headless_chromium(tmp_path: Path) -> None:
    artifact = tmp_path / "tiny.mgx"
    write_artifact(artifact, tiny_contents())
    with running_server(artifact) as s:
        proc, ws_url = chromium(tmp_path / "profile")
        stop = threading.Event()
        stack = contextlib.ExitStack()
        try:
            page = DevTools(
                stack.enter_context(websockets_sync.connect(ws_url, max_size=None, open_timeout=30))
            )
            for domain in ("Runtime", "Log", "Page"):
                page.call(f"{domain}.enable")
            page.call("Page.navigate", url=f"{s.url}/dashboard")
            page.wait_event("Page.loadEventFired")
            deadline = time.monotonic() + 15
            while (idle := json.loads(page.evaluate(PROBE)))["status"] != "live":
                assert time.monotonic() < deadline, idle
                time.sleep(0.1)
            assert idle["tiles"]["finished"] == "0" and idle["tiles"]["tokens_per_s"] == "0.0"

            finished: list[int] = []
            loader = threading.Thread(target=lambda: finished.append(run_load(s.url, 6.0, stop)))
            loader.start()
            samples = []
            for _ in range(12):  # ~6 s of the page while the load runs
                time.sleep(0.5)
                samples.append(json.loads(page.evaluate(PROBE)))
                if len(samples) == 6:
                    ARTIFACTS.mkdir(exist_ok=True)
                    shot = page.call("Page.captureScreenshot", format="png")
                    (ARTIFACTS / "dashboard.png").write_bytes(base64.b64decode(shot["data"]))
            loader.join(60)
            assert finished and finished[0] > 0

            throughput = {x["tiles"]["tokens_per_s"] for x in samples}
            done = [int(x["tiles"]["finished"]) for x in samples]
            assert len(throughput - {"0.0"}) >= 2, throughput  # the number moves while requests run
            assert done == sorted(done) and done[-1] > done[0]
            last = samples[-1]
            assert all(x["status"] == "live" for x in samples)
            assert (
                last["points"]["throughput"] >= 3
                and last["points"]["ttft"] >= 3
                and last["points"]["tpot"] >= 3
            )
            assert (
                max(x["points"]["batch"] for x in samples) >= 1
                and max(x["points"]["kv"] for x in samples) >= 1
            )
            assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
            page.evaluate("1")  # collect the events that came meanwhile
            assert page.errors() == []
        finally:
            stop.set()
            stack.close()
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
            shutil.rmtree(tmp_path / "profile", ignore_errors=True)
