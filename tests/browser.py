"""A real headless browser for tests: Debian's ``chromium``, driven over the Chrome DevTools Protocol (a websocket,
with aiohttp's client) on 127.0.0.1.

    with Chromium.start() as browser:
        page = browser.render("file:///tmp/report.html", ready="document.querySelectorAll('svg').length > 3")
        page.errors, page.requests, page.screenshot (PNG bytes), page.evaluate(...) results

One browser process serves many pages (each :meth:`Chromium.render` opens a tab and closes it). A render records
everything the page reports as an error: uncaught exceptions (``Runtime.exceptionThrown``), ``console.error`` and
``console.assert`` calls, and the browser's own error log entries (a failed load, a refused resource); and every URL
the page requested (``Network.requestWillBeSent``). ``CHROMIUM`` (environment) names another binary than
``/usr/bin/chromium``. Start-up and every wait are bounded; a browser that exits raises with the tail of its log.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

START_TIMEOUT_S = 60.0
_LISTENING = re.compile(rb"DevTools listening on (ws://\S+)")


def binary() -> str | None:
    """The chromium binary to run (None: not installed)."""
    for path in (os.environ.get("CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium",
                 shutil.which("chromium-browser")):
        if path and os.path.exists(path) and os.access(path, os.X_OK):
            return path
    return None


@dataclass
class RenderedPage:
    """What a page did while it loaded and rendered: its ``errors`` (text of each), the URLs it ``requests``, a
    full-page ``screenshot`` (PNG) and the ``values`` of the expressions asked for."""

    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    screenshot: bytes = b""
    values: dict[str, Any] = field(default_factory=dict)


class _Session:
    """One websocket to one page target: numbered commands, their answers, the page's events."""

    def __init__(self, ws: Any, page: RenderedPage) -> None:
        self.ws = ws
        self.page = page
        self.next_id = 0
        self.waiting: dict[int, asyncio.Future[Any]] = {}
        self.loaded = asyncio.Event()

    async def listen(self) -> None:
        async for message in self.ws:
            data = json.loads(message.data)
            if "id" in data:
                future = self.waiting.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
                continue
            method, params = data.get("method"), data.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                text = details.get("exception", {}).get("description") or details.get("text")
                self.page.errors.append(f"uncaught: {text}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                args = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
                self.page.errors.append(f"console.{params['type']}: {args}")
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                entry = params["entry"]
                self.page.errors.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}")
            elif method == "Network.requestWillBeSent":
                self.page.requests.append(params["request"]["url"])
            elif method == "Page.loadEventFired":
                self.loaded.set()

    async def send(self, method: str, timeout: float = 60.0, **params: Any) -> Any:
        self.next_id += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiting[self.next_id] = future
        await self.ws.send_str(json.dumps({"id": self.next_id, "method": method, "params": params}))
        answer = await asyncio.wait_for(future, timeout)
        if "error" in answer:
            raise RuntimeError(f"{method} failed: {answer['error']}")
        return answer.get("result", {})

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")


@dataclass
class Chromium:
    """A running headless Chromium with its DevTools endpoint on 127.0.0.1 (see the module docs)."""

    http: str
    process: subprocess.Popen[bytes] = field(repr=False)
    workdir: str = field(repr=False)

    @classmethod
    @contextmanager
    def start(cls) -> Iterator[Chromium]:
        path = binary()
        if path is None:
            raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
        workdir = tempfile.mkdtemp(prefix="keygroups-chromium-")
        log_path = os.path.join(workdir, "chromium.log")
        log = open(log_path, "wb")
        process = subprocess.Popen(
            [path, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
             "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
             "--disable-sync", "--disable-dev-shm-usage", "--mute-audio", f"--user-data-dir={workdir}/profile",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", "about:blank"],
            stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            endpoint = None
            while endpoint is None:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"chromium did not start (exit code {process.poll()}):\n"
                                       f"{cls._tail(log_path)}")
                with open(log_path, "rb") as f:
                    m = _LISTENING.search(f.read())
                if m is None:
                    time.sleep(0.1)
                    continue
                endpoint = m.group(1).decode()
            port = int(endpoint.split(":")[2].split("/")[0])
            yield cls(f"http://127.0.0.1:{port}", process, workdir)
        finally:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()
            shutil.rmtree(workdir, ignore_errors=True)

    @staticmethod
    def _tail(path: str) -> str:
        try:
            with open(path, "rb") as f:
                return f.read()[-3000:].decode(errors="replace")
        except OSError:
            return ""

    def render(self, url: str, *, ready: str, expressions: dict[str, str] | None = None, width: int = 1280,
               timeout: float = 90.0) -> RenderedPage:
        """Open ``url`` in a new tab ``width`` pixels wide, wait for its load event and then until the JavaScript
        ``ready`` is true, evaluate ``expressions`` (name -> JavaScript, values as JSON), take a full-page
        screenshot, close the tab."""
        return _run(self._render(url, ready, expressions or {}, width, timeout))

    async def _render(self, url: str, ready: str, expressions: dict[str, str], width: int,
                      timeout: float) -> RenderedPage:
        import aiohttp

        request = urllib.request.Request(f"{self.http}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(request, timeout=30) as r:
            target = json.load(r)
        page = RenderedPage()
        try:
            async with aiohttp.ClientSession() as client, \
                    client.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                session = _Session(ws, page)
                listener = asyncio.ensure_future(session.listen())
                try:
                    for domain in ("Runtime", "Log", "Network", "Page"):
                        await session.send(f"{domain}.enable")
                    await session.send("Emulation.setDeviceMetricsOverride", width=width, height=900,
                                       deviceScaleFactor=1, mobile=False)
                    await session.send("Page.navigate", url=url)
                    await asyncio.wait_for(session.loaded.wait(), timeout)
                    deadline = time.monotonic() + timeout
                    while not await session.evaluate(f"Boolean({ready})"):
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"{url}: {ready!r} still false after {timeout} s; errors: "
                                               f"{page.errors}")
                        await asyncio.sleep(0.2)
                    for name, expression in expressions.items():
                        page.values[name] = json.loads(await session.evaluate(f"JSON.stringify({expression})"))
                    height = await session.evaluate("document.documentElement.scrollHeight")
                    shot = await session.send("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                                              clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1})
                    page.screenshot = base64.b64decode(shot["data"])
                finally:
                    listener.cancel()
        finally:
            urllib.request.urlopen(f"{self.http}/json/close/{target['id']}", timeout=30).close()
        return page


def _run(coroutine: Any) -> Any:
    """Run ``coroutine`` to its end, in a thread of its own if this one already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    result: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(coroutine))
        except BaseException as e:   # noqa: BLE001  # re-raised in the caller's thread
            errors.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


# ---- the pytest fixture (tests/conftest.py loads this module as a plugin) -------------------------------------------

import pytest  # noqa: E402  # the helper above needs no pytest


@pytest.fixture(scope="session")
def chromium() -> Iterator[Chromium]:
    """One headless Chromium for the whole test run (skips, saying why, when it is not installed)."""
    if binary() is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium; or set CHROMIUM to its binary)")
    pytest.importorskip("aiohttp", reason="the DevTools client needs aiohttp")
    with Chromium.start() as browser:
        yield browser
