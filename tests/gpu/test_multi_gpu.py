"""Two jobs submitted together run at the same time, one on each GPU (needs 2 GPUs)."""

from __future__ import annotations

import socket
import time

import pytest
from fastapi.testclient import TestClient

from kernelmill.service.app import create_app
from kernelmill.service.executor import count_gpus
from kernelmill.settings import Settings

pytestmark = pytest.mark.gpu


def test_two_jobs_run_concurrently_on_two_gpus(tmp_path):
    n, how = count_gpus()
    if n < 2:
        pytest.skip(f"needs 2 GPUs, found {n} ({how})")
    settings = Settings(database_url=f"sqlite:///{tmp_path}/multi.db", executor="dask", batch_size=4)
    body = {
        "op": "softmax",
        "shapes": [[4096, 4096]],
        "dtype": "float16",
        "strategy": "random",
        "budget": {"trials": 16, "seconds": 600},
    }
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 180
        while len(client.get("/api/workers").json()["workers"]) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        ids = [client.post("/api/jobs", json=body).json()["id"] for _ in range(2)]
        seen_both_running = False
        while True:
            jobs = [client.get(f"/api/jobs/{i}").json() for i in ids]
            if all(j["state"] == "running" for j in jobs):
                seen_both_running = True
            if all(j["state"] in ("done", "failed") for j in jobs):
                break
            assert time.monotonic() < deadline + 600, jobs
            time.sleep(0.2)
    assert all(j["state"] == "done" for j in jobs), jobs
    assert seen_both_running
    host = socket.gethostname()  # the local cluster names its workers <hostname>-gpu<i>
    assert {j["worker"] for j in jobs} == {f"{host}-gpu0", f"{host}-gpu1"}
    # Overlapping lifetimes: each started before the other finished.
    a, b = jobs
    assert a["started_at"] < b["finished_at"] and b["started_at"] < a["finished_at"]
