"""TestClient fixtures for the dashboard: a temp SQLite store, the fake executor, seeded or empty."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kernelmill.service import web
from kernelmill.service.app import create_app
from kernelmill.service.db.store import Store
from kernelmill.settings import Settings
from tests.web.seed import seed_demo


def make_client(tmp_path, seed: bool = True, **overrides) -> tuple[TestClient, dict[str, int]]:
    url = f"sqlite:///{tmp_path}/web.db"
    ids: dict[str, int] = {}
    if seed:
        store = Store(url)
        try:
            ids = seed_demo(store)
        finally:
            store.close()
    return client_for(url, **overrides), ids


def client_for(url: str, **overrides) -> TestClient:
    settings = Settings(database_url=url, executor="fake", **{"fake_workers": 2, **overrides})
    app = create_app(settings)
    if not any(getattr(route, "path", None) == "/jobs/new" for route in app.routes):
        web.install(app)  # until create_app installs the dashboard itself
    return TestClient(app)


@pytest.fixture(scope="session")
def seeded_db(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    """The demo data, written once; each test gets a copy of the file."""
    path = tmp_path_factory.mktemp("seeded") / "seed.db"
    store = Store(f"sqlite:///{path}")
    try:
        ids = seed_demo(store)
    finally:
        store.close()
    return path, ids


@pytest.fixture
def seeded(tmp_path, seeded_db):
    source, ids = seeded_db
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{source}{suffix}").exists():
            shutil.copy(f"{source}{suffix}", tmp_path / f"web.db{suffix}")
    with client_for(f"sqlite:///{tmp_path}/web.db") as client:
        client.ids = ids  # type: ignore[attr-defined]
        yield client


@pytest.fixture
def empty(tmp_path):
    """No jobs, no kernels and no GPU worker: submitted jobs stay queued."""
    client, _ = make_client(tmp_path, seed=False, fake_workers=0)
    with client:
        yield client


@pytest.fixture
def authed(tmp_path):
    client, _ = make_client(tmp_path, seed=False, fake_workers=0, api_token="s3cret")
    with client:
        yield client


def csrf(client: TestClient, path: str = "/jobs/new") -> str:
    """Load a page (which sets the CSRF cookie) and return the hidden field's token."""
    page = client.get(path)
    match = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert match, "no CSRF field on the page"
    return match.group(1)


def field_error(html: str, name: str) -> str | None:
    """The error paragraph rendered next to a form field, as text."""
    match = re.search(rf'<p class="field-error" id="error-{re.escape(name)}"[^>]*>(.*?)</p>', html, re.S)
    return match.group(1).strip() if match else None
