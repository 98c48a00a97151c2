"""`kernelmill tune --server`: the CLI against a running service (the app behind FastAPI's TestClient, the fake
executor), through the same httpx calls it makes to a real server."""

from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from kernelmill import client as cli_client
from kernelmill.cli import app
from kernelmill.service.app import create_app
from kernelmill.settings import Settings

SERVER = "http://testserver"
TUNE = ["tune", "softmax", "--shape", "1024x1024", "--budget", "6", "--server", SERVER]


@pytest.fixture
def serve(tmp_path, api_db, monkeypatch):
    """Starts the app with ``workers`` fake GPUs and routes the CLI's httpx requests to it."""

    def start(workers: int) -> TestClient:
        settings = Settings(database_url=api_db, executor="fake", fake_workers=workers, fake_delay_s=0.0)
        tc = TestClient(create_app(settings)).__enter__()
        started.append(tc)

        def request(method, url, headers=None, timeout=None, **kw):
            return tc.request(method, url, headers=headers, **kw)

        monkeypatch.setattr(httpx, "request", request)
        return tc

    started: list[TestClient] = []
    yield start
    for tc in started:
        tc.__exit__(None, None, None)


def test_tune_against_a_server_follows_the_job_to_its_summary(serve, monkeypatch):
    serve(workers=1)
    monkeypatch.setattr(cli_client, "time", SimpleNamespace(sleep=lambda s: time.sleep(0.02), monotonic=time.monotonic))
    result = CliRunner().invoke(app, TUNE)
    assert result.exit_code == 0, result.output
    assert "job 1 submitted to http://testserver" in result.output
    assert "job 1 done" in result.output
    assert "1024x1024: best" in result.output and "6 trials, 0 failed" in result.output
    assert "no GPU worker" not in result.output


def test_a_job_queued_on_a_server_without_gpu_workers_says_why(serve, monkeypatch):
    tc = serve(workers=0)
    sleeps = []

    def stop_watching(seconds):  # Ctrl-C while the job waits
        sleeps.append(seconds)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_client, "time", SimpleNamespace(sleep=stop_watching, monotonic=time.monotonic))
    result = CliRunner().invoke(app, TUNE)
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())  # rich wraps long lines
    assert "http://testserver has no GPU worker: the fake executor was configured with 0 workers" in out
    assert "Job 1 waits in the queue until one joins" in out
    assert "stopped watching; job 1 goes on" in out
    assert sleeps and tc.get("/api/jobs/1").json()["state"] == "queued"


def test_tune_against_an_unreachable_server_is_one_line_and_exit_2():
    result = CliRunner().invoke(app, ["tune", "softmax", "--shape", "64x64", "--server", "http://127.0.0.1:9"])
    assert result.exit_code == 2
    assert "cannot reach http://127.0.0.1:9/api/jobs" in result.output and "Traceback" not in result.output


def test_a_server_that_cannot_list_its_workers_still_has_its_job_followed(serve, monkeypatch):
    serve(workers=1)
    routed = httpx.request

    def no_workers_route(method, url, **kw):
        if url.endswith("/api/workers"):
            return httpx.Response(404, json={"detail": "Not Found"})
        return routed(method, url, **kw)

    monkeypatch.setattr(httpx, "request", no_workers_route)
    monkeypatch.setattr(cli_client, "time", SimpleNamespace(sleep=lambda s: time.sleep(0.02), monotonic=time.monotonic))
    result = CliRunner().invoke(app, TUNE)
    assert result.exit_code == 0, result.output
    assert "job 1 done" in result.output and "no GPU worker" not in result.output
