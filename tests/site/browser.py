"""The built site in a real browser: headless Chromium (Debian's `chromium` package) loads each page of a site that
`mkdocs build` wrote, served from this process on a free loopback port, and reports what a reader would see go wrong
(`check_page.js`). Only the standard library and the browser: no driver, nothing fetched."""
from __future__ import annotations

import contextlib
import html
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
CHECKER = "/__check__.html"
SCRIPT = (Path(__file__).parent / "check_page.js").read_text()


def chromium() -> Optional[str]:
    """The Chromium on PATH (Debian names it `chromium`), or None."""
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


def build_site(folder: Path) -> Path:
    """`mkdocs build --strict` of this repository into `folder` (its pictures drawn from real plans on the way)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(folder)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    if run.returncode:
        raise RuntimeError(f"mkdocs build --strict failed ({run.returncode}):\n{run.stderr[-4000:]}")
    return folder


def checker_page(pages: list[str], *, width: int, height: int) -> bytes:
    """The page that loads every page of `pages` in turn at `width` × `height` and writes what it found."""
    return (f"<!doctype html><html><body style='margin:0'><script>{SCRIPT}</script>"
            f"<script>checkAll({json.dumps(pages)}, {width}, {height});</script></body></html>").encode()


class _Handler(http.server.SimpleHTTPRequestHandler):
    """The site's files, and the checker page at `CHECKER`; quiet."""

    checker = b""

    def do_GET(self):
        if self.path != CHECKER:
            return super().do_GET()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(self.checker)))
        self.end_headers()
        self.wfile.write(self.checker)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serve(site: Path, checker: bytes):
    """Serve `site` (and `checker`) on 127.0.0.1 at a free port; yields the base URL."""
    handler = type("Handler", (_Handler,), {"checker": checker})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def check_pages(browser: str, site: Path, pages: list[str], *, width: int = 1280, height: int = 900) -> dict:
    """`{page: findings}` for each page path of `site` (e.g. "guides/plan/"), loaded by headless Chromium in a
    window `width` pixels wide: its images, the tables and code blocks wider than their container, and the rows of
    console output that wrap (`check_page.js`)."""
    with serve(site, checker_page([f"/{p}" for p in pages], width=width, height=height)) as base:
        run = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                              "--disable-dev-shm-usage", f"--window-size={width},{height}", "--virtual-time-budget=120000",
                              "--dump-dom", base + CHECKER], capture_output=True, text=True, timeout=300)
    found = re.search(r'<pre id="hfsplit-results">(.*?)</pre>', run.stdout, re.S)
    if found is None:
        raise RuntimeError(f"chromium wrote no results (exit {run.returncode}): {run.stderr[-2000:]}")
    return {page.lstrip("/"): result for page, result in json.loads(html.unescape(found.group(1))).items()}
