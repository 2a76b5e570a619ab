"""``make site-check``: the course's website as a reader meets it, in a real browser.

Headless Chromium (Debian's ``chromium`` package), driven over the DevTools protocol (a WebSocket; no driver
binary, nothing downloaded), opens the landing page, every chapter and every lab of ``build/site/html``, served
by ``http.server`` on 127.0.0.1 as a reader would serve it offline, at a desktop width (1280 x 900) and a phone
width (390 x 844). A page fails when

* the browser's console reports an error, or a script throws (a missing file the page asks for is one);
* an image has not loaded (``complete`` and a natural width above 0);
* it has no heading or no text.

Sphinx's search page must find "bubble" and "all-gather". A screenshot of each kind of page (landing, chapter,
lab, script, search) at both widths goes to ``--screenshots``. The last line is ``N passed, N failed``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import http.server
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

WIDTHS = {"desktop": (1280, 900, False), "phone": (390, 844, True)}
SEARCHES = ("bubble", "all-gather")
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


class DevTools:
    """One browser tab over the DevTools protocol: commands answered in order, events kept for reading."""

    def __init__(self, url: str):
        import websocket   # websocket-client

        self.socket = websocket.create_connection(url, timeout=30, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict] = []

    def call(self, method: str, **params) -> dict:
        """Send a command, return its answer (a page that never answers: an error after 120 s, not a hang)."""
        self.next_id += 1
        self.socket.settimeout(120)
        self.socket.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_for(self, method: str, timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, event in enumerate(self.events):
                if event.get("method") == method:
                    return self.events.pop(i)
            self.socket.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                self.events.append(json.loads(self.socket.recv()))
            except Exception:   # a read that timed out: look again until the deadline
                pass
        raise TimeoutError(f"no {method} within {timeout} s")

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return result.get("result", {}).get("value")

    def drain(self, seconds: float = 0.3) -> None:
        """Read what the page still sends for a moment (late console errors, failed loads)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.socket.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                self.events.append(json.loads(self.socket.recv()))
            except Exception:
                break


def errors_in(events: list[dict]) -> list[str]:
    """The console errors, thrown exceptions and failed loads among DevTools events."""
    found = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            found.append("console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            found.append("exception: " + details.get("exception", {}).get("description", details.get("text", "")))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            found.append(f"log: {entry.get('text', '')} {entry.get('url', '')}".strip())
    return found


def pages_to_open(html: Path) -> list[str]:
    """The landing page, the conventions, every page of every chapter and every lab, as paths under ``html``."""
    from coursetools import site

    pages = ["index.html", "chapters/00_conventions.html"]
    for chapter in site.chapter_links():
        pages += [f"chapters/{page.stem}.html" for page in site.chapter_pages(chapter.number)]
        pages += [lab.replace(".ipynb", ".html") for lab in chapter.labs]
    missing = [p for p in pages if not (html / p).exists()]
    if missing:
        raise FileNotFoundError(f"not built: {', '.join(missing)} (run make site)")
    return pages


def find_browser() -> str | None:
    """Chromium's executable, or None after saying (one line, stderr) how to install it."""
    found = next((shutil.which(name) for name in BROWSERS if shutil.which(name)), None)
    if found is None:
        print("config error: no Chromium here: install Debian's package (apt-get install chromium)", file=sys.stderr)
    return found


@contextlib.contextmanager
def serve(folder: Path):
    """``python -m http.server`` on 127.0.0.1, a free port, in a thread."""
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@contextlib.contextmanager
def browser(executable: str):
    """Headless Chromium with its DevTools port; yields the HTTP endpoint of that port."""
    profile = tempfile.mkdtemp(prefix="distlab-chromium-")
    process = subprocess.Popen([executable, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                "--disable-dev-shm-usage", "--remote-debugging-port=0", "--remote-allow-origins=*",
                                f"--user-data-dir={profile}", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        endpoint = None
        while time.monotonic() < deadline and endpoint is None:
            line = process.stderr.readline()
            if "DevTools listening on ws://" in line:
                endpoint = "http://" + line.split("ws://", 1)[1].split("/", 1)[0]
            elif not line and process.poll() is not None:
                break
        if endpoint is None:
            raise RuntimeError(f"{executable} did not open its DevTools port")
        yield endpoint
    finally:
        stop(process)
        shutil.rmtree(profile, ignore_errors=True)


def stop(process: subprocess.Popen, seconds: float = 15) -> None:
    """End a helper process (the browser, JupyterLab): asked first, killed if it lingers."""
    process.terminate()
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()


def new_tab(endpoint: str) -> DevTools:
    request = urllib.request.Request(f"{endpoint}/json/new?about:blank", method="PUT")
    with urllib.request.urlopen(request, timeout=30) as response:
        target = json.loads(response.read())
    tab = DevTools(target["webSocketDebuggerUrl"])
    for domain in ("Page", "Runtime", "Log", "Network"):
        tab.call(f"{domain}.enable")
    return tab


def open_page(tab: DevTools, url: str, width: str) -> dict:
    w, h, mobile = WIDTHS[width]
    tab.call("Emulation.setDeviceMetricsOverride", width=w, height=h, deviceScaleFactor=1, mobile=mobile)
    tab.events.clear()
    tab.call("Page.navigate", url=url)
    tab.wait_for("Page.loadEventFired")
    tab.drain()
    broken = tab.evaluate("Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0))"
                          ".map(i => i.getAttribute('src'))")
    images = tab.evaluate("document.images.length")
    heading = tab.evaluate("(document.querySelector('h1') || {}).textContent || ''")
    text = tab.evaluate("document.body ? document.body.innerText.length : 0")
    problems = errors_in(tab.events) + [f"image not loaded: {src}" for src in broken or []]
    if not heading.strip():
        problems.append("no heading")
    if not text:
        problems.append("no text")
    return {"url": url, "width": width, "images": images, "problems": problems}


def search(tab: DevTools, base: str, word: str, timeout: float = 20) -> dict:
    tab.call("Emulation.setDeviceMetricsOverride", width=1280, height=900, deviceScaleFactor=1, mobile=False)
    tab.events.clear()
    tab.call("Page.navigate", url=f"{base}/search.html?q={word}")
    tab.wait_for("Page.loadEventFired")
    deadline = time.monotonic() + timeout
    hits = []
    while time.monotonic() < deadline:   # Sphinx's search says when it has finished ("... found N pages")
        finished = tab.evaluate("((document.querySelector('#search-progress') || {}).textContent || '')"
                                ".toLowerCase().includes('found')")
        hits = tab.evaluate("Array.from(document.querySelectorAll('#search-results li a'))"
                            ".map(a => a.getAttribute('href'))") or []
        if finished:
            break
        time.sleep(0.25)
    return {"word": word, "hits": hits, "problems": errors_in(tab.events) + ([] if hits else ["no result"])}


def screenshot(tab: DevTools, path: Path) -> None:
    data = tab.call("Page.captureScreenshot", format="png")["data"]
    path.write_bytes(base64.b64decode(data))


def check(html: Path, screenshots: Path | None, executable: str) -> dict:
    pages = pages_to_open(html)
    kinds = {"landing": "index.html", "chapter": "chapters/05_fully_sharded.html",
             "lab": "notebooks/07_pipeline_parallel.html", "script": "scripts/05_fully_sharded/train_fsdp.py.html"}
    results, searches = [], []
    with serve(html) as base, browser(executable) as endpoint:
        tab = new_tab(endpoint)
        for width in WIDTHS:
            for page in pages + [p for p in kinds.values() if p not in pages]:
                results.append(open_page(tab, f"{base}/{page}", width))
                kind = next((k for k, p in kinds.items() if p == page), None)
                if screenshots and kind:
                    screenshot(tab, screenshots / f"{kind}-{width}.png")
        for word in SEARCHES:
            searches.append(search(tab, base, word))
            if screenshots and word == SEARCHES[0]:
                screenshot(tab, screenshots / "search-desktop.png")
        tab.socket.close()
    failed = [r for r in results + searches if r["problems"]]
    return {"pages": results, "searches": searches, "passed": len(results) + len(searches) - len(failed),
            "failed": len(failed)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("html", type=Path, help="the built site (build/site/html)")
    p.add_argument("--screenshots", type=Path, default=None, help="a folder for one screenshot of each page kind")
    p.add_argument("--report", type=Path, default=None, help="write every page's result here (JSON)")
    args = p.parse_args(argv)
    executable = find_browser()
    if executable is None:
        return 2
    if not (args.html / "index.html").exists():
        print(f"config error: no site in {args.html}: run make site first", file=sys.stderr)
        return 2
    if args.screenshots:
        args.screenshots.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    result = check(args.html, args.screenshots, executable)
    for row in result["pages"] + result["searches"]:
        if row["problems"]:
            what = row.get("url") or f"search {row['word']!r}"
            print(f"FAIL {what} ({row.get('width', 'desktop')}): " + "; ".join(row["problems"][:5]))
    for row in result["searches"]:
        print(f"search {row['word']!r}: {len(row['hits'])} pages")
    if args.report:
        args.report.write_text(json.dumps(result, indent=1))
    print(f"{len(result['pages'])} page views at {len(WIDTHS)} widths and {len(result['searches'])} searches in "
          f"{time.monotonic() - started:.0f} s" + (f"; screenshots in {args.screenshots}" if args.screenshots else ""))
    print(f"{result['passed']} passed, {result['failed']} failed")
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
