"""A real headless Chromium for tests of pages, driven over the Chrome DevTools protocol.

``chromium --dump-dom`` prints the light DOM only, while BokehJS draws every model inside shadow roots; so the
tests open the page over the DevTools protocol instead, wait until a JavaScript condition holds, and read the text
the browser rendered, shadow roots and SVG text included. The page stays open between waits, so a test can watch
it change without a reload. Chromium is Debian's package (``.ci/run`` installs it); :func:`find_chromium`
returns None where there is none, and tests skip with the reason.

>>> with Browser() as browser:  # doctest: +SKIP
...     page = browser.open("http://127.0.0.1:8787/dask-dl")
...     text = page.wait_for("text.includes('fit-1234')")
...     page.screenshot("page.png")
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["RENDERED_TEXT", "Browser", "Page", "find_chromium"]

#: JavaScript: the rendered text of the page, one line per visible text node, through shadow roots and SVG
#: ``<text>``
RENDERED_TEXT = """(() => {
  const out = [];
  const walk = (node) => {
    if (node.nodeType === Node.TEXT_NODE) {
      const text = node.textContent.trim();
      if (text) out.push(text);
      return;
    }
    if (node.nodeName === "STYLE" || node.nodeName === "SCRIPT") return;
    if (node.nodeType === Node.ELEMENT_NODE) {
      const style = getComputedStyle(node);  // hidden (Bokeh's visible=False): not rendered
      if (style.display === "none" || style.visibility === "hidden") return;
    }
    if (node.shadowRoot) walk(node.shadowRoot);
    for (const child of node.childNodes) walk(child);
  };
  if (document.body) walk(document.body);
  return out.join("\\n");
})()"""


def find_chromium() -> str | None:
    """The path of a Chromium (or Chrome) executable on ``PATH``, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """A headless Chromium process and the event loop thread that talks to it; use it as a context manager.

    Parameters
    ----------
    width, height
        The window size, which is also a screenshot's size.

    Raises
    ------
    FileNotFoundError
        When no Chromium is installed.
    """

    def __init__(self, *, width: int = 1400, height: int = 1600) -> None:
        chromium = find_chromium()
        if chromium is None:
            raise FileNotFoundError("no chromium on PATH: install it with apt-get install -y chromium")
        self._profile = tempfile.TemporaryDirectory(prefix="dask-dl-chromium-")
        args = [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            f"--window-size={width},{height}",
            f"--user-data-dir={self._profile.name}",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            "about:blank",
        ]
        # a session of its own: closing ends Chromium's helper processes too, not only the browser process
        self._proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dask-dl-browser", daemon=True)
        self._thread.start()
        self._pages: list[Page] = []
        try:
            self.port = _devtools_port(Path(self._profile.name), self._proc, timeout=30)
        except BaseException:
            self.close()
            raise

    def open(self, url: str) -> Page:
        """Load ``url`` in the browser's tab and return the :class:`Page` (one page per browser)."""
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=10).read())
        target = next(t for t in targets if t.get("type") == "page")
        page = Page(self, self._call(_Session.connect(target["webSocketDebuggerUrl"])), url)
        self._pages.append(page)
        self._call(page.session.call("Page.navigate", url=url))
        return page

    def close(self) -> None:
        """Close the connections, stop the loop thread and end Chromium."""
        for page in self._pages:
            self._call(page.session.close())
        self._pages = []
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()
        self._end(signal.SIGTERM)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._end(signal.SIGKILL)
            self._proc.wait()
        for _ in range(20):  # helpers that outlive the browser process may still write to the profile
            try:
                self._profile.cleanup()
                break
            except OSError:
                time.sleep(0.25)
        else:
            shutil.rmtree(self._profile.name, ignore_errors=True)  # a leftover temporary directory is harmless

    def _end(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(self._proc.pid, sig)  # its own process group (start_new_session)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coroutine: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)


class Page:
    """A page open in a :class:`Browser`."""

    def __init__(self, browser: Browser, session: _Session, url: str) -> None:
        self.browser = browser
        self.session = session
        self.url = url

    def wait_for(self, condition: str, *, timeout: float = 60.0) -> str:
        """Wait until the JavaScript expression ``condition`` is true in the page and return the rendered text.

        Parameters
        ----------
        condition
            Evaluated every 0.2 s; :data:`RENDERED_TEXT` is available in it as ``text``.
        timeout
            Seconds to wait.

        Returns
        -------
        str
            The page's rendered text (:data:`RENDERED_TEXT`) when ``condition`` held.

        Raises
        ------
        TimeoutError
            When ``condition`` is not true within ``timeout``; the message holds the page's text and console errors.
        """
        return self.browser._call(self._wait_for(condition, timeout))

    def text(self) -> str:
        """The page's rendered text now (:data:`RENDERED_TEXT`)."""
        return self.browser._call(self.session.evaluate(RENDERED_TEXT))

    def screenshot(self, path: str | os.PathLike) -> None:
        """Write a PNG of the whole page to ``path``."""
        shot = self.browser._call(self.session.call("Page.captureScreenshot", format="png", captureBeyondViewport=True))
        Path(path).write_bytes(base64.b64decode(shot["data"]))

    async def _wait_for(self, condition: str, timeout: float) -> str:
        # text and condition in one evaluation: the text returned is the text the condition held on
        probe = f"(() => {{ const text = {RENDERED_TEXT}; return [Boolean({condition}), text]; }})()"
        deadline = time.monotonic() + timeout
        while True:
            held, text = await self.session.evaluate(probe)
            if held:
                return text
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.url} did not satisfy {condition!r} within {timeout} s; console errors: "
                    f"{self.session.errors}; rendered text: {text[:2000]!r}"
                )
            await asyncio.sleep(0.2)


def _devtools_port(profile: Path, proc: subprocess.Popen, *, timeout: float) -> int:
    """The port Chromium listens on: it writes it to ``DevToolsActivePort`` in its profile."""
    deadline = time.monotonic() + timeout
    active = profile / "DevToolsActivePort"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with code {proc.returncode} before it listened")
        if active.exists():
            first = active.read_text().split("\n", 1)[0].strip()
            if first.isdigit():
                return int(first)
        time.sleep(0.1)
    raise TimeoutError(f"chromium did not open its DevTools port within {timeout} s")


class _Session:
    """Calls over one DevTools websocket; console errors and uncaught exceptions are collected in ``errors``."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.next_id = 0
        self.errors: list[str] = []

    @classmethod
    async def connect(cls, url: str) -> _Session:
        from tornado.websocket import websocket_connect

        session = cls(await websocket_connect(url, max_message_size=256 * 2**20))
        await session.call("Runtime.enable")
        await session.call("Page.enable")
        return session

    async def close(self) -> None:
        self.ws.close()

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        call_id = self.next_id
        await self.ws.write_message(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            raw = await asyncio.wait_for(self.ws.read_message(), timeout=30)
            if raw is None:
                raise ConnectionError(f"chromium closed the DevTools connection during {method}")
            msg = json.loads(raw)
            if msg.get("id") == call_id:
                if "error" in msg:
                    raise RuntimeError(f"{method} failed: {msg['error']}")
                return msg.get("result", {})
            self._note(msg)

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript error: {result['exceptionDetails']}")
        return result["result"].get("value")

    def _note(self, msg: dict[str, Any]) -> None:
        method = msg.get("method")
        if method == "Runtime.exceptionThrown":
            self.errors.append(re.sub(r"\s+", " ", str(msg["params"]["exceptionDetails"]))[:500])
        elif method == "Runtime.consoleAPICalled" and msg["params"].get("type") == "error":
            self.errors.append(" ".join(str(a.get("value", a.get("description"))) for a in msg["params"]["args"]))
