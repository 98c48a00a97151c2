"""End to end over REST on the real GPU: a softmax job reaches done, its served cubin verifies when loaded fresh."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from kernelmill.kernels.compile import CompiledKernel
from kernelmill.kernels.variant import BoundVariant, Variant
from kernelmill.kernels.verify import verify
from kernelmill.service.app import create_app
from kernelmill.settings import Settings
from tests.api.conftest import wait_state

pytestmark = pytest.mark.gpu


def test_softmax_job_on_gpu_serves_a_verified_kernel(tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path}/gpu.db", executor="dask", batch_size=6)
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 120
        while not client.get("/api/workers").json()["workers"]:
            assert time.monotonic() < deadline, client.get("/api/workers").json()
            time.sleep(0.5)
        body = {
            "op": "softmax",
            "shapes": [[333, 4099]],
            "dtype": "float32",
            "strategy": "random",
            "budget": {"trials": 12, "seconds": 300},
        }
        job = client.post("/api/jobs", json=body).json()
        job = wait_state(client, job["id"], timeout_s=600)
        assert job["state"] == "done", job
        shape = job["per_shape"][0]
        assert shape["trials"] == 12 and shape["best_ms"] and shape["baseline_ms"]
        best = client.get("/api/kernels/best", params={"op": "softmax", "shape": "333x4099", "dtype": "float32"})
        assert best.status_code == 200, best.text
        kernel = best.json()
        assert kernel["exact"] and kernel["arch"].startswith("sm_")
        cubin = client.get(f"/api/kernels/{kernel['id']}/cubin").content

    from kernelmill.kernels.device import get_device

    device = get_device()
    variant = Variant.create("softmax", kernel["family"], "float32", kernel["params"])
    served = CompiledKernel(cubin, kernel["arch"], key=f"served-{kernel['id']}")
    bound = BoundVariant(device, variant, served, (333, 4099))
    assert [launch.entry for launch in bound.launches] == [entry["entry"] for entry in kernel["launches"]]
    result = verify(device, bound, seeds=3)
    assert result.ok, result.reason
