"""Headless Chromium driven over the DevTools protocol (for the dashboard test).

``chromium --headless --screenshot/--dump-dom`` captures at the load event (or when
the virtual-time budget runs out, and virtual time does not wait for WebSocket
traffic); a Streamlit page only fills in after its script has run on the server and
streamed the elements over a WebSocket. So the test starts Chromium with the same
flags plus ``--remote-debugging-port``, waits until the page shows what it expects,
and then takes the DOM and the screenshot through the DevTools protocol.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import count
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-dev-shm-usage",
)


# The size of the rendered app while the script has finished (None while it runs).
SETTLED = (
    "(() => { const app = document.querySelector('[data-testid=stMain]'); "
    "if (!app || document.querySelector('[data-testid=stStatusWidgetRunningIcon]') || "
    "document.querySelector('[data-testid=stSkeleton]')) return null; "
    "return app.innerHTML.length; })()"
)


def executable() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws, self.ids = ws, count(1)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv(timeout=60))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result

    def evaluate(self, expression: str) -> Any:
        got = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return got.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.evaluate(expression):
            if time.monotonic() > deadline:
                raise TimeoutError(f"page never satisfied {expression!r} in {timeout:g} s")
            time.sleep(0.5)

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def settle(self, timeout: float, *, quiet_s: float = 1.5) -> None:
        """Wait until Streamlit has run the script and painted: the page has its app
        view, no "running" status, and the DOM has not changed for ``quiet_s``."""
        deadline = time.monotonic() + timeout
        last, since = -1, time.monotonic()
        while True:
            size = self.evaluate(SETTLED)
            now = time.monotonic()
            if size != last or size is None:
                last, since = size, now
            elif now - since >= quiet_s:
                return
            if now > deadline:
                raise TimeoutError(f"the page did not settle in {timeout:g} s")
            time.sleep(0.25)

    def click(self, selector: str, text: str) -> None:
        """Click (a real mouse press, which React's handlers hear) the first visible
        ``selector`` element whose text is ``text``."""
        box = self.evaluate(
            f"(() => {{ const el = [...document.querySelectorAll({json.dumps(selector)})]"
            f".find(e => e.offsetParent !== null && e.innerText.trim() === {json.dumps(text)});"
            " if (!el) return null; el.scrollIntoView({block: 'center'});"
            " const r = el.getBoundingClientRect();"
            " return [r.left + r.width / 2, r.top + r.height / 2]; })()"
        )
        if not box:
            raise LookupError(f"no {selector} reading {text!r} on the page")
        x, y = box
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def dom(self) -> str:
        return str(self.evaluate("document.documentElement.outerHTML"))

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))


@contextmanager
def open_page(url: str, profile: Path, *, size: str = "1400,1000") -> Iterator[Page]:
    """Chromium (headless) showing ``url``."""
    exe = executable()
    if exe is None:
        raise FileNotFoundError("chromium")
    proc = subprocess.Popen(
        [
            exe,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={size}",
            "--remote-debugging-port=0",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit {proc.poll()})")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=10) as r:
            targets = json.load(r)
        target = next(t for t in targets if t.get("type") == "page")
        with connect(target["webSocketDebuggerUrl"], max_size=2**26) as ws:
            page = Page(ws)
            page.call("Page.enable")
            page.call("Page.navigate", url=url)
            yield page
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
