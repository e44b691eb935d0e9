"""The built site served on this machine and opened in headless Chromium, as a reader sees it.

    minddp site serve              # the site at http://127.0.0.1:8000/, until Ctrl-C
    minddp site shots docs/        # docs/site-home.png, site-chapter.png, site-lesson.png

Used by tests/test_site.py too, so the screenshots in docs/ are what the test looked at.
Chromium is Debian's (apt-get install chromium), started here with the flags a closed
machine needs and a fresh profile, driven by Playwright over the DevTools protocol; its
whole process group is killed at the end, or once `limit` seconds pass without
progress (a hang).
"""

import contextlib
import functools
import http.server
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-crash-reporter", "--hide-scrollbars", "--mute-audio"]
SHOTS = {  # the file's name: the page, from the site's root
    "site-home.png": "",
    "site-chapter.png": "minddp/ddp/",
    "site-lesson.png": "minddp/ddp/naive/",
}
WINDOW = {"width": 1440, "height": 900}


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        # A reader who moves on before a file is sent closes the connection: not an error.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _server(folder, port):
    handler = functools.partial(_Quiet, directory=str(folder))
    return _Server(("127.0.0.1", port), handler)


@contextlib.contextmanager
def served(folder):
    """The folder served on 127.0.0.1 at a free port, in a thread: yields its url."""
    server = _server(folder, 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def bind(folder, port):
    """`minddp site serve`'s server, its port taken (OSError if another holds it)."""
    return _server(folder, port)


def serve_forever(server, folder, port):
    """`minddp site serve`: until Ctrl-C, the usual way to stop a server (one line, status 0)."""
    print(f"serving {folder} at http://127.0.0.1:{port}/ (Ctrl-C stops)", flush=True)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # not the examples' handler
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", flush=True)
    finally:
        server.server_close()


class _Watchdog:
    """Calls `fire` once `limit` seconds pass without pet(): no progress, a hang. A bound on
    progress, not on the whole: a crawl that goes on, however slowly, is not a hang."""

    def __init__(self, limit, fire, first):
        self.limit, self._fire, self._last = first, fire, time.monotonic()  # then `limit`
        self._then, self.fired, self._done = limit, threading.Event(), threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def pet(self, *_):
        self._last, self.limit = time.monotonic(), self._then

    def _watch(self):
        while not self._done.wait(0.5):
            if time.monotonic() - self._last > self.limit:
                self.fired.set()
                self._fire()
                return

    def cancel(self):
        self._done.set()


@contextlib.contextmanager
def chromium(executable="/usr/bin/chromium", limit=600, profile=None, start_limit=600):
    """Headless Chromium, a fresh profile (an empty folder `profile`, or a new one):
    yields Playwright's Browser. Every process it started is killed on the way out, or as a
    hang: its start past `start_limit` seconds (a loaded machine's took over a minute), or
    `limit` seconds without progress (a response to any page)."""
    from playwright.sync_api import sync_playwright
    made = profile is None
    profile = tempfile.mkdtemp(prefix="minddp-chromium-") if made else str(profile)
    process = subprocess.Popen(
        [executable, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
         "about:blank"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    watchdog = _Watchdog(limit, lambda: _kill(process), first=start_limit)
    try:
        port = _devtools_port(profile, process, start_limit)
        with sync_playwright() as playwright:
            # No timeout of its own (0): on a machine busy enough, the handshake alone took
            # over a minute; the watchdog is the one bound, against a hang.
            browser = playwright.chromium.connect_over_cdp(f"http://127.0.0.1:{port}",
                                                           timeout=0)
            watchdog.pet()
            # Progress: each response any page receives (a page loaded, a search's index).
            # A busy machine slows a crawl down without stopping it: no bound on the whole.
            for context in browser.contexts:
                context.on("page", lambda page: page.on("response", watchdog.pet))
            try:
                yield browser
            finally:
                with contextlib.suppress(Exception):
                    browser.close()
    except Exception as err:
        if watchdog.fired.is_set():
            raise TimeoutError(f"chromium killed after {watchdog.limit} s without progress"
                               " (its start, or no page received a response): a hang") from err
        raise
    finally:
        watchdog.cancel()
        _kill(process)
        if made:
            shutil.rmtree(profile, ignore_errors=True)


def _devtools_port(profile, process, bound=60):
    """The port Chromium chose (it writes it into the profile), once it listens."""
    path = pathlib.Path(profile, "DevToolsActivePort")
    deadline = time.monotonic() + bound  # against a hang only: it takes ~1 s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"chromium exited with status {process.returncode} at start")
        if path.exists() and path.read_text().strip():
            return int(path.read_text().split()[0])
        time.sleep(0.05)
    raise RuntimeError(f"chromium did not listen within {bound} s")


def _kill(process):
    """End Chromium and every process it started (one process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=30)


def open_page(browser, url, errors):
    """A new page at the reader's window size, its console errors, failed loads and script
    errors appended to `errors`."""
    context = browser.contexts[0] if browser.contexts else browser.new_context()
    page = context.new_page()
    page.set_viewport_size(WINDOW)
    page.set_default_timeout(0)  # none: chromium's watchdog (`limit`) bounds a hang
    page.on("console", lambda m: m.type == "error" and errors.append(f"console: {m.text}"))
    page.on("pageerror", lambda e: errors.append(f"script: {e}"))
    page.on("requestfailed", lambda r: _failed(r, errors))
    page.on("response", lambda r: r.status >= 400 and errors.append(f"{r.status}: {r.url}"))
    page.goto(url, wait_until="load")
    return page


def _failed(request, errors):
    # net::ERR_ABORTED: a load cut short by the next navigation (the search's worker and
    # index, still loading when a reader moves on), not a failure; a missing file is a 404.
    if "ERR_ABORTED" not in (request.failure or ""):
        errors.append(f"failed: {request.url} {request.failure}")


def screenshots(browser, url, directory):
    """The home page, a chapter's first page and a lesson, as a reader's window shows them."""
    written = []
    for name, path in SHOTS.items():
        errors = []
        page = open_page(browser, url + path, errors)
        if errors:
            raise RuntimeError(f"{url + path}: {errors[0]}")
        target = pathlib.Path(directory) / name
        page.screenshot(path=str(target))
        page.close()
        written.append(target)
    return written
