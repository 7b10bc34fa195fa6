"""Support for tests that look at the MLflow UI in a real headless browser (a helper module, not a test file).

Why this exists: what the registry *stores* (aliases, tags) is tested through the client elsewhere; only a
browser proves that the UI a person opens actually *shows* it. MLflow's UI is a React single-page app, so a
plain HTTP GET of `/#/models/NAME` returns an empty shell -- the page has to run its JavaScript.

The pieces, each usable on its own:

* `chromium_path()` -- the system chromium (Debian's `apt-get install chromium`), or None. Playwright's own
  browser download needs the internet, so we always launch an existing binary via `executable_path`.
* `mlflow_ui_server(uri)` -- a real `mlflow server` subprocess on a free 127.0.0.1 port, stopped cleanly.
* `headless_page()` -- a Playwright sync `Page` from that chromium, with flags for a closed network.
* `page_text(page, url, wait_for_text, timeout_s)` / `save_screenshot(page, path)` -- read and capture a page.

Nothing here calls `pytest.skip`: whether a missing browser is a skip or a failure is each test's decision.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from artifacts.common.net import free_port, wait_until_ready

if TYPE_CHECKING:  # playwright is an optional test dependency: import it only when a browser is opened
    from playwright.sync_api import Page

SERVER_START_TIMEOUT_S = 120.0  # the first start on a fresh sqlite store creates and migrates every table
SERVER_STOP_TIMEOUT_S = 15.0
LOG_TAIL_CHARS = 4000

# Flags for chromium on a headless CI box with no internet. Playwright adds `--headless` itself
# (launch(headless=True)). Without the background-networking/component/sync flags chromium keeps dialling
# Google services, and on a closed network those refused connections are noise in the log and slow it down.
CHROMIUM_ARGS: tuple[str, ...] = (
    "--no-sandbox",  # root in a container: the setuid/user-namespace sandbox is unavailable
    "--disable-gpu",
    "--disable-dev-shm-usage",  # containers often mount a tiny /dev/shm; chromium crashes when it fills
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def chromium_path() -> str | None:
    """The chromium binary on PATH (`chromium`, or the `chromium-browser` name some distros use), else None."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _log_tail(log_path: Path) -> str:
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        return f"<log unreadable: {exc}>"
    return text[-LOG_TAIL_CHARS:]


def _stop(proc: subprocess.Popen[bytes], timeout_s: float = SERVER_STOP_TIMEOUT_S) -> None:
    """SIGTERM the server's whole process group (uvicorn may fork workers), then SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout_s)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait(timeout=timeout_s)


def _wait_until_ready(
    proc: subprocess.Popen[bytes], base_url: str, log_path: Path, deadline: float, timeout_s: float
) -> str | None:
    """Poll `/health` until the server answers (None), exits, or the deadline passes (a message with its log)."""
    if wait_until_ready(f"{base_url}/health", deadline - time.monotonic(), alive=lambda: proc.poll() is None,
                        interval=0.25) is None:
        return None
    if proc.poll() is not None:
        return (
            f"`mlflow server` for {base_url} exited with {proc.returncode} before answering; "
            f"log {log_path} ends:\n{_log_tail(log_path)}"
        )
    return (
        f"`mlflow server` on {base_url} did not answer HTTP within {timeout_s:.0f}s; "
        f"log {log_path} ends:\n{_log_tail(log_path)}"
    )


@contextlib.contextmanager
def mlflow_ui_server(
    backend_store_uri: str, port: int | None = None, timeout_s: float = SERVER_START_TIMEOUT_S
) -> Iterator[str]:
    """Run a real `mlflow server` on 127.0.0.1 for `backend_store_uri`; yield its base URL (`http://127.0.0.1:PORT`).

    Why a subprocess and not an in-process app: it is exactly what a person runs, UI bundle included.
    The server runs with one worker, job execution off (otherwise it starts job-runner processes and one
    SIGTERM no longer stops it all) and telemetry off, in its own temp dir (its `./mlartifacts` and log land
    there, not in the repo; the dir is removed after a good run and kept after a failed start).
    Readiness is an HTTP answer from `/health`, polled until `timeout_s`. If the server dies or never answers,
    RuntimeError carries the tail of its log. With `port=None` a free port is chosen, and a start that dies
    because that port was taken between choosing and binding ("address already in use") is retried on a new one.
    """
    workdir = Path(tempfile.mkdtemp(prefix="mlflow-ui-"))
    env = {
        **os.environ,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
        "PYTHONUNBUFFERED": "1",
    }
    attempts = 1 if port is not None else 3
    deadline = time.monotonic() + timeout_s
    failures: list[str] = []
    started = False
    for attempt in range(1, attempts + 1):
        chosen = port if port is not None else free_port()
        base_url = f"http://127.0.0.1:{chosen}"
        log_path = workdir / f"server-{attempt}.log"
        cmd = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", backend_store_uri,
            "--artifacts-destination", (workdir / "mlartifacts").as_uri(),
            "--host", "127.0.0.1",
            "--port", str(chosen),
            "--workers", "1",
        ]  # fmt: skip
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            failure = _wait_until_ready(proc, base_url, log_path, deadline, timeout_s)
            if failure is None:
                yield base_url
                started = True
                return
            failures.append(f"attempt {attempt}: {failure}")
        finally:
            _stop(proc)
            if started:  # a failed start keeps its log (the error names it); a good run leaves nothing behind
                shutil.rmtree(workdir, ignore_errors=True)
        port_taken = "address already in use" in _log_tail(log_path).lower()
        if not port_taken or time.monotonic() > deadline:
            break  # only a lost port race is worth another try; any other failure would just repeat
    raise RuntimeError("MLflow UI server failed to start.\n" + "\n\n".join(failures))


@contextlib.contextmanager
def headless_page(
    executable_path: str | None = None, viewport: tuple[int, int] = (1920, 1080), timeout_s: float = 60.0
) -> Iterator[Page]:
    """Yield a Playwright sync `Page` in headless system chromium; page, context and browser close on exit.

    `executable_path` defaults to `chromium_path()`; RuntimeError if there is none (callers skip earlier).
    The wide default viewport matters for screenshots only: MLflow's tables cut long cells with a CSS ellipsis
    (innerText still holds the whole value), and MLflow 3.17 opens an Assistant side panel that takes ~350 px.
    `timeout_s` becomes the page's default timeout for actions and navigations (the UI bundle is a few MB and
    this machine is slow, so Playwright's 30 s default is tight when the suite runs in parallel with training).
    """
    from playwright.sync_api import sync_playwright

    binary = executable_path or chromium_path()
    if binary is None:
        raise RuntimeError("no chromium binary on PATH (install Debian's `chromium` package)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=binary, headless=True, args=list(CHROMIUM_ARGS))
        try:
            context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
            try:
                page = context.new_page()
                page.set_default_timeout(timeout_s * 1000)
                page.set_default_navigation_timeout(timeout_s * 1000)
                yield page
            finally:
                context.close()
        finally:
            browser.close()


def page_text(page: Page, url: str, wait_for_text: str, timeout_s: float = 60.0) -> str:
    """Open `url` and return the body's visible text once `wait_for_text` appears in it.

    Why wait on text: the SPA's HTML arrives at once but its content is rendered later by JavaScript (after
    REST calls), so "load" fires long before the data shows. Waiting for a known string is the only signal
    that means "the part under test has rendered". On timeout, AssertionError shows what the page did show.
    """
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    page.goto(url, wait_until="domcontentloaded")
    try:
        page.wait_for_function(
            "text => document.body !== null && document.body.innerText.includes(text)",
            arg=wait_for_text,
            timeout=timeout_s * 1000,
            polling=200,
        )
    except PlaywrightTimeoutError as exc:
        shown = page.evaluate("() => document.body ? document.body.innerText : ''")
        raise AssertionError(
            f"{wait_for_text!r} did not appear on {url} within {timeout_s:.0f}s; the page shows:\n{shown[-3000:]}"
        ) from exc
    return page.inner_text("body")


def squash_whitespace(text: str) -> str:
    """Collapse every run of whitespace (newlines, and the U+00A0 no-break spaces MLflow puts in alias chips,
    `@\xa0champion`) into one plain space, so assertions can use the text a person reads: `@ champion`."""
    return " ".join(text.split())


def save_screenshot(page: Page, path: Path | str, full_page: bool = True) -> Path:
    """Save a PNG of the page (whole scrollable page by default) and return its path, for humans to look at."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out), full_page=full_page)
    return out
