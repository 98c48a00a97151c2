"""Where trials run: Dask distributed, one single-threaded worker process per GPU.

Embedded: a local cluster of Nanny-managed workers, each pinned to one GPU with
CUDA_VISIBLE_DEVICES and advertising the resource GPU=1. Scaled out: a client
of an existing scheduler that GPU workers (``kernelmill worker``) join. A
worker whose CUDA context a kernel poisoned is restarted by its Nanny; the
trial is recorded as failed with the reason and the job goes on.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kernelmill.agents.evaluator import DeviceFacts, Evaluator, FakeEvaluator, TrialResult
from kernelmill.agents.space import Candidate
from kernelmill.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class WorkerInfo:
    name: str
    gpu: str | None
    arch: str | None
    busy: bool
    job_id: int | None = None


def count_gpus() -> tuple[int, str]:
    """(visible GPUs, how we know) without creating a CUDA context in this process."""
    try:
        import pycuda.driver as cuda

        cuda.init()
        return cuda.Device.count(), "pycuda"
    except ImportError:
        pass
    except Exception as exc:  # noqa: BLE001 - the driver's own error type varies
        return 0, f"CUDA driver unavailable: {exc}"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, "no GPU: pycuda is not installed and nvidia-smi is not on PATH"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 0, f"nvidia-smi failed: {exc}"
    n = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    return n, "nvidia-smi" if n else "nvidia-smi lists no GPU"


class Executor(Protocol):
    def workers(self) -> list[WorkerInfo]:
        """GPU workers attached now."""
        ...

    def why_none(self) -> str | None:
        """Why there are no GPU workers (None when there are)."""
        ...

    def evaluator(self, worker: str) -> Evaluator:
        """An evaluator whose work runs on ``worker``'s GPU."""
        ...

    def close(self) -> None: ...


class _Busy:
    """Which worker runs which job (shared by both executors)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, int] = {}

    def claim(self, worker: str, job_id: int) -> bool:
        with self._lock:
            if worker in self._jobs:
                return False
            self._jobs[worker] = job_id
            return True

    def release(self, worker: str) -> None:
        with self._lock:
            self._jobs.pop(worker, None)

    def job(self, worker: str) -> int | None:
        return self._jobs.get(worker)


# -- fake (tests of the loop and the API only) -------------------------------------------


class FakeExecutor(_Busy):
    def __init__(self, n_workers: int = 2, delay_s: float = 0.0) -> None:
        super().__init__()
        self._evaluators = {f"fake-gpu{i}": FakeEvaluator(f"FakeGPU {i}", delay_s=delay_s) for i in range(n_workers)}

    def workers(self) -> list[WorkerInfo]:
        return [
            WorkerInfo(name, ev.name, ev.arch, self.job(name) is not None, self.job(name))
            for name, ev in self._evaluators.items()
        ]

    def why_none(self) -> str | None:
        return None if self._evaluators else "the fake executor was configured with 0 workers"

    def evaluator(self, worker: str) -> Evaluator:
        return self._evaluators[worker]

    def close(self) -> None:
        pass


# -- Dask --------------------------------------------------------------------------------

_worker_evaluator: Any = None


def _local_evaluator():
    """The worker process's evaluator (one CUDA context per worker process)."""
    global _worker_evaluator
    if _worker_evaluator is None:
        if os.environ.get("KERNELMILL_FAKE_DEVICE") == "1":
            _worker_evaluator = FakeEvaluator(
                f"FakeGPU {os.environ.get('CUDA_VISIBLE_DEVICES', '?')}",
                delay_s=float(os.environ.get("KERNELMILL_FAKE_DELAY_S", "0")),
            )
        else:
            from kernelmill.agents.evaluator import LocalEvaluator
            from kernelmill.settings import get_settings

            s = get_settings()
            _worker_evaluator = LocalEvaluator(0, s.verify_seeds, s.bench_reps, s.kernel_timeout_s)
    return _worker_evaluator


def task_facts() -> dict[str, Any]:
    facts = _local_evaluator().facts()
    return {"name": facts.name, "arch": facts.arch, "extra": facts.extra}


def task_baseline(op: str, shape: list[int], dtype: str, attrs: dict[str, Any]) -> float | None:
    return _local_evaluator().baseline_ms(op, shape, dtype, attrs)


def task_profile(op, shape, dtype, attrs, family: str, params_json: str) -> dict[str, Any]:
    return _local_evaluator().profile(op, shape, dtype, attrs, Candidate(family, params_json))


def task_evaluate(op, shape, dtype, attrs, candidates: list[tuple[str, str]]) -> list[TrialResult]:
    crash_on = os.environ.get("KERNELMILL_FAKE_CRASH_ON")  # tests: a worker that dies mid-task
    cands = [Candidate(family, params_json) for family, params_json in candidates]
    if crash_on and any(crash_on in c.key for c in cands):
        os._exit(17)
    return _local_evaluator().evaluate(op, shape, dtype, attrs, cands)


class DaskEvaluator:
    """Runs each call as a Dask task pinned to one GPU worker (by its stable name)."""

    def __init__(self, executor: DaskExecutor, worker: str) -> None:
        self.executor, self.worker = executor, worker

    def _submit(self, fn, *args):
        return self.executor.client.submit(
            fn, *args, workers=[self.worker], allow_other_workers=False, resources={"GPU": 1}, pure=False
        )

    def facts(self) -> DeviceFacts:
        data = self.executor.facts(self.worker)
        return DeviceFacts(data["name"], data["arch"], data.get("extra", {}))

    def baseline_ms(self, op, shape, dtype, attrs):
        return self._submit(task_baseline, op, list(shape), dtype, dict(attrs)).result(
            timeout=self.executor.settings.worker_answer_timeout_s
        )

    def profile(self, op, shape, dtype, attrs, candidate: Candidate) -> dict[str, Any]:
        future = self._submit(
            task_profile, op, list(shape), dtype, dict(attrs), candidate.family, candidate.params_json
        )
        try:
            return future.result(timeout=self.executor.settings.worker_answer_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a profile is optional: record why it is missing
            return {"error": f"profiling failed on {self.worker}: {type(exc).__name__}: {exc}"}

    def evaluate(self, op, shape, dtype, attrs, candidates: Sequence[Candidate]) -> list[TrialResult]:
        from distributed import KilledWorker

        payload = [(c.family, c.params_json) for c in candidates]
        future = self._submit(task_evaluate, op, list(shape), dtype, dict(attrs), payload)
        timeout = self.executor.settings.worker_answer_timeout_s
        try:
            results = future.result(timeout=timeout)
        except KilledWorker:
            self.executor.restart(self.worker)
            why = "the worker process died while evaluating this batch (it was replaced)"
            return [TrialResult(c.family, c.params, "fault", why) for c in candidates]
        except TimeoutError:
            future.cancel()
            self.executor.restart(self.worker)
            why = f"the worker did not answer within {timeout:.0f} s (it was replaced)"
            return [TrialResult(c.family, c.params, "timeout", why) for c in candidates]
        if any(r.poisoned for r in results):
            # The CUDA context of that process is unusable: start a fresh worker process.
            self.executor.restart(self.worker)
        return results


class DaskExecutor(_Busy):
    def __init__(self, settings: Settings, gpus: int | None = None, fake_device: bool = False) -> None:
        super().__init__()
        from distributed import Client

        self.settings = settings
        self.cluster = None
        self._why: str | None = None
        self._facts: dict[str, dict[str, Any]] = {}
        self._pending_facts: dict[str, Any] = {}
        if settings.scheduler:
            self.client = Client(settings.scheduler, timeout="20s")
            return
        n, how = (gpus, "configured") if gpus is not None else count_gpus()
        if n == 0:
            self._why = f"no GPU on this host ({how}); jobs stay queued until a GPU worker joins"
        self.cluster = _local_cluster(n, fake_device)
        self.client = Client(self.cluster)

    def worker_names(self) -> list[str]:
        info = self.client.scheduler_info(n_workers=-1)["workers"]
        return sorted(w["name"] for w in info.values() if w.get("resources", {}).get("GPU"))

    def _facts_future(self, worker: str):
        if worker not in self._pending_facts:
            self._pending_facts[worker] = self.client.submit(
                task_facts, workers=[worker], allow_other_workers=False, pure=False
            )
        return self._pending_facts[worker]

    def facts(self, worker: str) -> dict[str, Any]:
        if worker not in self._facts:
            self._facts[worker] = self._facts_future(worker).result(timeout=120)
            self._pending_facts.pop(worker, None)
        return self._facts[worker]

    def workers(self) -> list[WorkerInfo]:
        out = []
        for name in self.worker_names():
            if name not in self._facts:  # asked once in the background; never blocks this listing
                future = self._facts_future(name)
                if future.done() and future.status == "finished":
                    self._facts[name] = future.result()
                    self._pending_facts.pop(name, None)
            facts = self._facts.get(name, {})
            out.append(
                WorkerInfo(name, facts.get("name"), facts.get("arch"), self.job(name) is not None, self.job(name))
            )
        return out

    def why_none(self) -> str | None:
        if self.worker_names():
            return None
        return self._why or "no GPU worker has joined the scheduler (start one with `kernelmill worker`)"

    def evaluator(self, worker: str) -> Evaluator:
        return DaskEvaluator(self, worker)

    def restart(self, worker: str) -> None:
        log.warning("restarting worker %s (fresh CUDA context)", worker)
        self._facts.pop(worker, None)
        self._pending_facts.pop(worker, None)
        try:
            self.client.restart_workers([worker], timeout=120)
        except Exception as exc:  # noqa: BLE001 - a dead worker is replaced by its nanny anyway
            log.warning("restart of %s: %s", worker, exc)

    def close(self) -> None:
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()


def _worker_spec(index: int, prefix: str, fake_device: bool) -> dict[str, Any]:
    from distributed import Nanny

    env = {"CUDA_VISIBLE_DEVICES": str(index), "OMP_NUM_THREADS": "1"}
    if fake_device:
        env["KERNELMILL_FAKE_DEVICE"] = "1"
    for var in ("KERNELMILL_FAKE_DELAY_S", "KERNELMILL_FAKE_CRASH_ON", "KERNELMILL_CACHE_DIR"):
        if var in os.environ:
            env[var] = os.environ[var]
    name = f"{prefix}gpu{index}"
    return {
        "cls": Nanny,
        "options": {"nthreads": 1, "name": name, "resources": {"GPU": 1}, "env": env, "memory_limit": 0},
    }


def _local_cluster(n_gpus: int, fake_device: bool):
    import dask
    from distributed import Scheduler, SpecCluster

    # A kernel that kills its worker process would kill the retry too: fail the task at once.
    dask.config.set({"distributed.scheduler.allowed-failures": 0})

    workers = {f"gpu{i}": _worker_spec(i, "", fake_device) for i in range(n_gpus)}
    return SpecCluster(
        workers=workers,
        scheduler={"cls": Scheduler, "options": {"dashboard_address": None}},
        silence_logs=logging.WARNING,
        name="kernelmill",
    )


async def run_workers(scheduler: str, gpus: int | None = None) -> None:
    """``kernelmill worker``: one Nanny per local GPU joining ``scheduler``; returns when they close."""
    import asyncio

    from distributed import Nanny

    n, how = (gpus, "configured") if gpus is not None else count_gpus()
    if n == 0:
        raise RuntimeError(f"no GPU to serve ({how})")
    prefix = f"{socket.gethostname()}-"
    nannies = []
    for i in range(n):
        spec = _worker_spec(i, prefix, fake_device=os.environ.get("KERNELMILL_FAKE_DEVICE") == "1")
        nannies.append(Nanny(scheduler, **spec["options"]))
    await asyncio.gather(*nannies)
    await asyncio.gather(*(nanny.finished() for nanny in nannies))


def make_executor(settings: Settings) -> Executor:
    if settings.executor == "fake":
        return FakeExecutor(settings.fake_workers, settings.fake_delay_s)
    return DaskExecutor(settings)
