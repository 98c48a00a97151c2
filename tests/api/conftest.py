import os
import time

import pytest
from fastapi.testclient import TestClient

from kernelmill.service.app import create_app
from kernelmill.settings import Settings
from tests.store.pg import fresh_database, postgres_url, skip_or_fail_without_postgres


def make_client(tmp_path, database_url: str | None = None, **overrides) -> TestClient:
    url = database_url or f"sqlite:///{tmp_path}/api.db"
    settings = Settings(database_url=url, executor="fake", fake_workers=2, **overrides)
    return TestClient(create_app(settings))


@pytest.fixture
def api_db(tmp_path):
    """SQLite; with KERNELMILL_TEST_API_ON_POSTGRES=1 a fresh PostgreSQL database per test instead."""
    if os.environ.get("KERNELMILL_TEST_API_ON_POSTGRES") != "1":
        yield f"sqlite:///{tmp_path}/api.db"
        return
    skip_or_fail_without_postgres()
    with fresh_database(postgres_url()) as url:
        yield url


@pytest.fixture
def client(tmp_path, api_db):
    with make_client(tmp_path, api_db) as c:
        yield c


@pytest.fixture
def authed(tmp_path, api_db):
    with make_client(tmp_path, api_db, api_token="s3cret") as c:
        yield c


def wait_state(client, job_id, states=("done", "failed", "cancelled"), timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/api/jobs/{job_id}").json()
        if job["state"] in states:
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} still {job['state']} after {timeout_s} s")


SOFTMAX_JOB = {
    "op": "softmax",
    "shapes": [[1024, 1024], "4096x512"],
    "dtype": "float16",
    "strategy": "random",
    "budget": {"trials": 24, "seconds": 60},
}
