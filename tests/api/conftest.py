import time

import pytest
from fastapi.testclient import TestClient

from kernelmill.service.app import create_app
from kernelmill.settings import Settings


def make_client(tmp_path, **overrides) -> TestClient:
    settings = Settings(database_url=f"sqlite:///{tmp_path}/api.db", executor="fake", fake_workers=2, **overrides)
    return TestClient(create_app(settings))


@pytest.fixture
def client(tmp_path):
    with make_client(tmp_path) as c:
        yield c


@pytest.fixture
def authed(tmp_path):
    with make_client(tmp_path, api_token="s3cret") as c:
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
