"""Browser tests: Playwright for Python driving Debian's chromium, headless, against a real uvicorn.

They skip with the reason when chromium or the playwright package is missing,
unless KERNELMILL_REQUIRE_BROWSER=1 (CI), where a missing browser fails them.
Screenshots go to $KERNELMILL_SCREENSHOTS when set, else the test's tmp_path.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from kernelmill.service.db.store import Store
from tests.web.seed import seed_demo

CHROMIUM = os.environ.get("KERNELMILL_CHROMIUM", "/usr/bin/chromium")
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "browser-test-token"


def pytest_configure(config):
    config.addinivalue_line("markers", "browser: drives a headless chromium through Playwright (tests/browser)")


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install playwright)"
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)) and not shutil.which(CHROMIUM):
        return f"chromium is not at {CHROMIUM} (apt-get install chromium)"
    return None


def pytest_collection_modifyitems(config, items):
    ours = [item for item in items if "browser" in item.keywords]
    if not ours:
        return
    why = _missing()
    if why is None:
        return
    if os.environ.get("KERNELMILL_REQUIRE_BROWSER") == "1":
        raise pytest.UsageError(f"KERNELMILL_REQUIRE_BROWSER=1 but {why}: the browser tests cannot run")
    for item in ours:
        item.add_marker(pytest.mark.skip(reason=f"needs a headless browser: {why}"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    url: str
    ids: dict[str, int]
    process: subprocess.Popen
    log: Path
    db: str  # its database URL


def _start(tmp: Path, env_extra: dict[str, str] | None = None, seed: bool = True) -> Server:
    db = tmp / "browser.db"
    url = f"sqlite:///{db}"
    store = Store(url)
    try:
        ids = seed_demo(store) if seed else {}
    finally:
        store.close()
    port = _free_port()
    env = {
        **os.environ,
        "KERNELMILL_DATABASE_URL": url,
        "KERNELMILL_EXECUTOR": "fake",
        "KERNELMILL_FAKE_WORKERS": "2",
        "KERNELMILL_FAKE_DELAY_S": "0.1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    env.pop("KERNELMILL_API_TOKEN", None)  # only where env_extra sets one
    env.update(env_extra or {})
    log = tmp / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.browser.serve", str(port)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{base}/api/health", timeout=1).status_code == 200:
                return Server(base, ids, proc, log, url)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.terminate()
    raise RuntimeError(f"the server did not answer within 30 s:\n{log.read_text()}")


def _stop(srv: Server) -> None:
    srv.process.terminate()
    try:
        srv.process.wait(10)
    except subprocess.TimeoutExpired:
        srv.process.kill()
        srv.process.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    """Seeded with finished jobs; two fake GPUs that take 0.1 s per trial."""
    srv = _start(tmp_path_factory.mktemp("browser-server"))
    yield srv
    _stop(srv)


@pytest.fixture(scope="module")
def empty_server(tmp_path_factory) -> Iterator[Server]:
    """A fresh database and no GPU worker: the empty states."""
    srv = _start(tmp_path_factory.mktemp("browser-empty"), {"KERNELMILL_FAKE_WORKERS": "0"}, seed=False)
    yield srv
    _stop(srv)


@pytest.fixture(scope="module")
def token_server(tmp_path_factory) -> Iterator[Server]:
    """A fresh database, one fake GPU (0.1 s per trial), writes needing the API token TOKEN (as compose sets)."""
    srv = _start(
        tmp_path_factory.mktemp("browser-token"),
        {"KERNELMILL_API_TOKEN": TOKEN, "KERNELMILL_FAKE_WORKERS": "1"},
        seed=False,
    )
    yield srv
    _stop(srv)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-background-networking", "--disable-gpu", "--disable-dev-shm-usage"],
        )
        yield chromium
        chromium.close()


@dataclass
class Console:
    """Console errors and uncaught page errors seen by one page."""

    errors: list[str] = field(default_factory=list)

    def attach(self, page) -> None:
        page.on(
            "console",
            lambda msg: self.errors.append(f"console.{msg.type}: {msg.text}") if msg.type == "error" else None,
        )
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1360, "height": 900}, device_scale_factor=1)
    pg = context.new_page()
    console = Console()
    console.attach(pg)
    pg.console = console  # type: ignore[attr-defined]
    yield pg
    context.close()


@pytest.fixture
def shots(tmp_path) -> Path:
    where = os.environ.get("KERNELMILL_SCREENSHOTS")
    folder = Path(where) if where else tmp_path / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
