"""A real headless Chromium for tests of pages, driven over the Chrome DevTools protocol.

``chromium --dump-dom`` prints the light DOM only, while BokehJS draws every model inside shadow roots; so the
tests open the page over the DevTools protocol instead, wait until a JavaScript condition holds, and read the text
the browser rendered, shadow roots and SVG text included. Chromium is Debian's package (``.ci/run`` installs it);
:func:`find_chromium` returns None where there is none, and tests skip with the reason.
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
import time
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["RENDERED_TEXT", "find_chromium", "open_page"]

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


def open_page(
    url: str,
    *,
    until: str,
    timeout: float = 60.0,
    screenshot: str | os.PathLike | None = None,
    width: int = 1400,
    height: int = 1600,
) -> str:
    """Open ``url`` in headless Chromium, wait until the JavaScript expression ``until`` is true, return the text.

    Parameters
    ----------
    url
        The page to open.
    until
        A JavaScript expression evaluated in the page every 0.2 s; the page counts as rendered when it is truthy.
        ``RENDERED_TEXT`` is available in it as the variable ``text``.
    timeout
        Seconds to wait for ``until``.
    screenshot
        Where to write a PNG of the page, when given.
    width, height
        The window size.

    Returns
    -------
    str
        The page's rendered text (see :data:`RENDERED_TEXT`).

    Raises
    ------
    FileNotFoundError
        When no Chromium is installed.
    TimeoutError
        When ``until`` is not true within ``timeout``; the message holds the page's text and console errors.
    """
    chromium = find_chromium()
    if chromium is None:
        raise FileNotFoundError("no chromium on PATH: install it with apt-get install -y chromium")
    with tempfile.TemporaryDirectory(prefix="dask-dl-chromium-") as profile:
        args = [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            f"--window-size={width},{height}",
            f"--user-data-dir={profile}",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            "about:blank",
        ]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            port = _devtools_port(Path(profile), proc, timeout=30)
            return asyncio.run(_run(port, url, until, timeout, screenshot))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


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


async def _run(port: int, url: str, until: str, timeout: float, screenshot: Any) -> str:
    from tornado.websocket import websocket_connect

    targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
    page = next(t for t in targets if t.get("type") == "page")
    ws = await websocket_connect(page["webSocketDebuggerUrl"], max_message_size=256 * 2**20)
    session = _Session(ws)
    try:
        await session.call("Runtime.enable")
        await session.call("Page.enable")
        await session.call("Page.navigate", url=url)
        condition = f"(() => {{ const text = {RENDERED_TEXT}; return Boolean({until}); }})()"
        deadline = time.monotonic() + timeout
        while True:
            if await session.evaluate(condition):
                break
            if time.monotonic() > deadline:
                text = await session.evaluate(RENDERED_TEXT)
                raise TimeoutError(
                    f"{url} did not satisfy {until!r} within {timeout} s; console errors: {session.errors}; "
                    f"rendered text: {text[:2000]!r}"
                )
            await asyncio.sleep(0.2)
        if screenshot is not None:
            shot = await session.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
            Path(screenshot).write_bytes(base64.b64decode(shot["data"]))
        return await session.evaluate(RENDERED_TEXT)
    finally:
        ws.close()


class _Session:
    """Calls over one DevTools websocket; console errors and uncaught exceptions are collected in ``errors``."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.next_id = 0
        self.errors: list[str] = []

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
