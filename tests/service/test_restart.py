"""kill -9 the service mid-job, start it again: the job resumes and completes with no duplicated trials."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.api.conftest import SOFTMAX_JOB


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(env, port):
    cmd = [sys.executable, "-m", "kernelmill", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/api/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    pytest.fail("the service did not start")


def test_sigkill_mid_job_resumes_without_duplicates(tmp_path):
    env = {
        **os.environ,
        "KERNELMILL_DATABASE_URL": f"sqlite:///{tmp_path}/restart.db",
        "KERNELMILL_EXECUTOR": "fake",
        "KERNELMILL_FAKE_WORKERS": "1",
        "KERNELMILL_FAKE_DELAY_S": "0.03",
        "KERNELMILL_BATCH_SIZE": "4",
    }
    port = _free_port()
    proc, url = _start(env, port)
    try:
        job = httpx.post(f"{url}/api/jobs", json={**SOFTMAX_JOB, "budget": {"trials": 80, "seconds": 120}}).json()
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/api/jobs/{job['id']}").json()["trials_done"] < 12:
            assert time.monotonic() < deadline, "no progress before the kill"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = {}
    proc, url = _start(env, port)
    try:
        # What the dead service had recorded is still there, untouched.
        page = httpx.get(f"{url}/api/jobs/{job['id']}/trials", params={"limit": 1000}).json()
        before = {t["id"]: (t["shape_key"], t["family"], str(t["params"])) for t in page["items"]}
        assert 12 <= len(before) < 80
        deadline = time.monotonic() + 60
        while (state := httpx.get(f"{url}/api/jobs/{job['id']}").json())["state"] != "done":
            assert state["state"] in ("queued", "running"), state
            assert time.monotonic() < deadline, f"job did not finish after the restart: {state}"
            time.sleep(0.1)
        page = httpx.get(f"{url}/api/jobs/{job['id']}/trials", params={"limit": 1000}).json()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    after = {t["id"]: (t["shape_key"], t["family"], str(t["params"])) for t in page["items"]}
    assert len(after) == 80
    assert len(set(after.values())) == 80  # no candidate ran twice for a shape
    assert all(after[i] == v for i, v in before.items())  # recorded trials were not re-run
