"""Planted faults inside real jobs on the GPU: each is caught and recorded with its reason, the service stays up,
the job and the jobs after it go on (a poisoned worker process is replaced)."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from kernelmill.service.app import create_app
from kernelmill.settings import Settings
from tests.api.conftest import wait_state

pytestmark = pytest.mark.gpu

EXPECTED = {
    "none": "ok",
    "oob": "fault",
    "hang": "timeout",
    "race": "wrong_result",
    "nan": "wrong_result",
    "wrong": "wrong_result",
    "hang_timed": "timeout",  # verified, then hangs in timing's repetitions: time_it's bounded waits
}


def test_planted_faults_are_recorded_and_jobs_go_on(tmp_path, monkeypatch):
    # Operator-enabled plugin; worker processes inherit the environment and sys.path.
    monkeypatch.setenv("KERNELMILL_PLUGINS", "tests.faults.planted")
    monkeypatch.setenv("KERNELMILL_KERNEL_TIMEOUT_S", "3")
    from kernelmill.kernels.ops import load_plugins

    load_plugins("tests.faults.planted")
    # A worker that never answers (or never comes back after its restart) fails the test in minutes, with the
    # batch recorded as a timeout, instead of holding it for the default 900 s.
    settings = Settings(
        database_url=f"sqlite:///{tmp_path}/faults.db", executor="dask", batch_size=3, worker_answer_timeout_s=120
    )
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 120
        while not client.get("/api/workers").json()["workers"]:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        planted = client.post(
            "/api/jobs",
            json={"op": "planted_softmax", "shapes": [[64, 1000]], "dtype": "float32", "strategy": "exhaustive",
                  "budget": {"trials": len(EXPECTED), "seconds": 600}},
        ).json()  # fmt: skip
        after = client.post(
            "/api/jobs",
            json={"op": "softmax", "shapes": [[256, 1000]], "dtype": "float32", "strategy": "random",
                  "budget": {"trials": 4, "seconds": 600}},
        ).json()  # fmt: skip
        planted = wait_state(client, planted["id"], timeout_s=600)
        after = wait_state(client, after["id"], timeout_s=600)
        trials = client.get(f"/api/jobs/{planted['id']}/trials", params={"limit": 100}).json()["items"]
        assert client.get("/api/health").json()["status"] == "ok"
    assert planted["state"] == "done", planted
    got = {t["params"]["fault"]: t for t in trials}
    assert set(got) == set(EXPECTED), got.keys()
    for fault, status in EXPECTED.items():
        assert got[fault]["status"] == status, (fault, got[fault]["status"], got[fault]["reason"])
        if status != "ok":
            assert got[fault]["reason"], fault
    assert "hang" in got["hang"]["reason"]
    assert got["hang_timed"]["reason"].endswith("while timed"), got["hang_timed"]["reason"]
    assert after["state"] == "done" and after["per_shape"][0]["best_ms"], after


#: A child process (the fault poisons its context): a kernel that writes to address 16, timed. The fault
#: surfaces at whichever call comes next (a launch, an event record, the wait), each a poisoning DeviceFault.
_FAULT_WHILE_TIMED = """
from kernelmill.kernels.bench import time_it
from kernelmill.kernels.compile import Compiler
from kernelmill.kernels.device import Buffer, DeviceFault, get_device

device = get_device()
compiled = Compiler().compile('extern "C" __global__ void km_bad(int* p) { p[threadIdx.x] = 1; }', device.info.arch)
bad = device.load(compiled.cubin, compiled.key).kernel("km_bad")
try:
    time_it(device, lambda: bad.launch((1, 1, 1), (32, 1, 1), 0, [Buffer(16, 128)]), warmup=0, reps=50, timeout_s=10)
    print("no fault")
except DeviceFault as exc:
    print("fault", exc.poisoned, device.poisoned)
"""


def test_a_kernel_faulting_while_timed_is_a_poisoning_device_fault_in_every_call_it_surfaces_at():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FAULT_WHILE_TIMED], capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip().splitlines()[-1:] == ["fault True True"], (proc.stdout, proc.stderr[-2000:])
