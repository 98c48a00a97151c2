"""First-use checks on the GPU (marker gpu): a nearest-shape kernel served for a problem is verified at the
problem's shape before it runs. Planted kernels (tests/faults/planted.py) stand in for a served kernel that is
wrong at that shape, and for one that faults; a fault is recorded before the error, so the next process
passes that kernel over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.gpu

SHAPE = (64, 512)


def _served_planted(fault: str) -> httpx.Client:
    """A service that serves, for planted_softmax, a kernel tuned at 64x384 that plants ``fault``."""
    from kernelmill.kernels.arch import default_arch
    from kernelmill.kernels.compile import Compiler, normalize_arch
    from kernelmill.kernels.ops import get_op, load_plugins
    from kernelmill.kernels.render import render

    load_plugins("tests.faults.planted")
    family = get_op("planted_softmax").family("planted")
    params = family.resolve({"fault": fault}, "float32")
    arch = normalize_arch(default_arch())
    cubin = Compiler().compile(render(family, params, "float32", {}), arch).cubin
    kernel = {"id": 11, "op": "planted_softmax", "dtype": "float32", "family": "planted", "params": params}
    kernel.update(shape=[64, 384], arch=arch, exact=False)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/kernels/best" and request.url.params.get("arch") == arch:
            return httpx.Response(200, json={**kernel, "speedup": 1.5, "median_ms": 0.003})
        if request.url.path == "/api/kernels/11/cubin":
            return httpx.Response(200, content=cubin)
        return httpx.Response(404, json={"detail": "none"})

    return httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))


def resolve(cache_dir: str, fault: str) -> dict:
    """One process's registry resolving planted_softmax at SHAPE with a served nearest kernel planting ``fault``;
    returns its report row (a child process calls it, see the fault test)."""
    from kernelmill.runtime.backend import get_backend
    from kernelmill.runtime.registry import KernelRegistry

    client = _served_planted(fault)
    registry = KernelRegistry(backend=get_backend(), client=client, cache_dir=Path(cache_dir))
    registry.get("planted_softmax", SHAPE, "float32")
    return registry.report()[0]


def test_a_nearest_kernel_wrong_at_this_shape_gives_way_to_a_checked_default(tmp_path):
    row = resolve(str(tmp_path / "cache"), "wrong")
    assert row["source"] == "default" and row["params"] == {"fault": "none"}
    assert row["checked"].startswith("here ") and float(row["checked"].split()[1]) <= 1
    assert "nearest kernel #11 planted failed its first-use check" in row["note"]
    (failed,) = [
        json.loads(p.read_text()) for p in (tmp_path / "cache" / "verified").rglob("*.json") if "wrong" in p.read_text()
    ]
    assert failed["ok"] is False and failed["status"] == "wrong_result" and "wrong result" in failed["reason"]

    right = resolve(str(tmp_path / "right"), "none")  # the same kernel without its fault passes and is used
    assert right["source"] == "nearest" and right["checked"].startswith("here ")


@pytest.mark.parametrize(("fault", "why"), [("oob", "illegal"), ("hang_timed", "run again: kernel still running")])
def test_a_fault_at_first_use_is_recorded_and_the_next_process_passes_the_kernel_over(tmp_path, fault, why):
    """oob faults when verified; hang_timed is right when verified and hangs when run again on its last
    output, as a forward would run it (no forward waits with a timeout: the check does)."""
    tests_root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests_root), os.environ.get("PYTHONPATH", "")])}
    env["KERNELMILL_KERNEL_TIMEOUT_S"] = "3"
    child = (
        "import json, sys; from tests.gpu.test_runtime_check_gpu import resolve; "
        f"print(json.dumps(resolve({str(tmp_path / 'cache')!r}, {fault!r})))"
    )
    # A hung kernel still runs when the error is raised, and the driver waits for it at exit: the process is
    # ended as its message says, once the error is out.
    first = subprocess.Popen([sys.executable, "-c", child], env=env, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(first.stderr.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and first.poll() is None and "can run no more kernels" not in "".join(lines):
            time.sleep(0.2)
    finally:
        first.kill()
        first.wait(60)
        reader.join(10)
    stderr = "".join(lines)
    assert "KernelCheckFault" in stderr and "CUDA context is lost" in stderr and why in stderr, stderr[-3000:]
    second = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    row = json.loads(second.stdout.strip().splitlines()[-1])
    assert row["source"] == "default" and row["params"] == {"fault": "none"} and row["checked"].startswith("here ")
    assert "nearest kernel #11 planted failed its first-use check" in row["note"]
