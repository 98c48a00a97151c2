"""Where trials run: Dask distributed, one single-threaded worker process per GPU.

Embedded: a local cluster of Nanny-managed workers, each pinned to one GPU with
CUDA_VISIBLE_DEVICES and advertising the resource GPU=1. Scaled out: a client
of an existing scheduler that GPU workers (``kernelmill worker``) join. A
worker whose CUDA context a kernel poisoned is restarted by its Nanny; the
trial is recorded as failed with the reason and the job goes on.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kernelmill.agents.evaluator import SKIPPED, DeviceFacts, Evaluator, FakeEvaluator, TrialResult
from kernelmill.agents.space import Candidate
from kernelmill.kernels.device import GpuUnavailable
from kernelmill.settings import Settings

log = logging.getLogger(__name__)

#: How often a call waiting on a worker checks that the process its task is pinned to is still there (s).
_POLL_S = 2.0
#: The most seconds a finished task's result may take to reach the service (it takes milliseconds).
_FETCH_S = 30.0
#: The scheduler's stimuli for a worker process it lost (distributed.scheduler): its connection broke, or it sent
#: no heartbeat within the worker TTL.
_PROCESS_LOST = ("handle-worker-cleanup-", "check-worker-ttl-")
#: The most seconds the scheduler may take to answer a question (it takes milliseconds).
_SCHEDULER_ANSWER_S = 10.0
#: Seconds a GPU worker of `kernelmill worker` that lost its scheduler waits before it joins again.
_REJOIN_S = 2.0
#: Seconds `kernelmill worker` lets a GPU task in flight run on after SIGTERM (`docker stop`) before it closes the
#: worker anyway, handing the task back (docker/compose.yaml's stop_grace_period of 60 s leaves room for the close).
STOP_GRACE_S = 45.0
#: The most seconds a task whose worker process left (closed, or replaced) waits for a process of that worker to
#: join, before its job goes back to the queue: a worker stopped for good never comes back.
_REJOIN_WAIT_S = 120.0
#: Seconds between attempts to connect again to a scheduler whose connection closed.
_RECONNECT_S = 10.0
#: Restarts of one GPU worker allowed within _RESTART_WINDOW_S seconds with no GPU task of it answered in between
#: (a search whose kernels fault restarts it often, each time to good use). One more is not made (a worker that
#: fails on every start was restarted for ever, its job bouncing on it): the worker takes no job, and a task for it
#: is WorkerGone (its job goes back to the queue), until the window allows the restart it is owed.
_MAX_RESTARTS = 5
_RESTART_WINDOW_S = 600.0


class WorkerDied(Exception):
    """The worker's process died while it ran the task (a scheduler that retries such tasks kept it): as Dask's
    KilledWorker, its candidates are to blame, one of them at least."""


class WorkerGone(GpuUnavailable):
    """No live process of a GPU worker joined in time, or the scheduler's connection was lost: nothing of the
    task is known to have run, so no trial is blamed; the job goes back to the queue (service.jobs)."""


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
    visible = visible_devices()
    if visible is not None:  # nvidia-smi lists every GPU of the host; this process sees those named only
        n = min(n, len(visible))
    return n, "nvidia-smi" if n else "nvidia-smi lists no GPU"


def visible_devices() -> list[str] | None:
    """The GPUs CUDA_VISIBLE_DEVICES names for this process (ordinals, UUIDs or MIG names), None where unset."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [entry.strip() for entry in value.split(",") if entry.strip()]


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


def task_baseline(
    op: str, shape: list[int], dtype: str, attrs: dict[str, Any], precision: str | None = None
) -> float | None:
    return _local_evaluator().baseline_ms(op, shape, dtype, attrs, precision)


def task_profile(op, shape, dtype, attrs, family: str, params_json: str) -> dict[str, Any]:
    return _local_evaluator().profile(op, shape, dtype, attrs, Candidate(family, params_json))


def task_evaluate(op, shape, dtype, attrs, candidates: list[tuple[str, str]]) -> list[TrialResult]:
    crash_on = os.environ.get("KERNELMILL_FAKE_CRASH_ON")  # tests: a worker that dies mid-task
    cands = [Candidate(family, params_json) for family, params_json in candidates]
    if crash_on and any(crash_on in c.key for c in cands):
        os._exit(17)
    return _local_evaluator().evaluate(op, shape, dtype, attrs, cands)


class DaskEvaluator:
    """Runs each call as a Dask task on one GPU worker, named by its stable name (``DaskExecutor.run_on``)."""

    def __init__(self, executor: DaskExecutor, worker: str) -> None:
        self.executor, self.worker = executor, worker

    def _result(self, fn, *args, timeout: float) -> Any:
        try:
            return self.executor.run_on(self.worker, fn, *args, timeout=timeout)
        except WorkerGone:  # the service lost the worker or its scheduler: nothing known of the process
            raise
        except GpuUnavailable:  # raised in the worker (a poisoned CUDA context): benched, it stayed so for good
            self.executor.restart(self.worker)
            raise

    def facts(self) -> DeviceFacts:
        from distributed import KilledWorker

        try:
            data = self.executor.facts(self.worker)
        except (KilledWorker, WorkerDied, TimeoutError) as exc:  # a process hung (a task before it) or dead: benched
            # alone, it stayed so, and failed each job it was given after the bench the same way
            self.executor.restart(self.worker)
            how = "died" if isinstance(exc, KilledWorker | WorkerDied) else "did not answer"
            raise WorkerGone(f"GPU worker {self.worker} {how} while telling its GPU (it was replaced)") from None
        return DeviceFacts(data["name"], data["arch"], data.get("extra", {}))

    def baseline_ms(self, op, shape, dtype, attrs, precision=None):
        from distributed import KilledWorker

        timeout = self.executor.settings.worker_answer_timeout_s
        try:
            return self._result(task_baseline, op, list(shape), dtype, dict(attrs), precision, timeout=timeout)
        except (KilledWorker, WorkerDied, TimeoutError) as exc:  # PyTorch's own op: the worker is at fault, not the job
            self.executor.restart(self.worker)
            how = "died" if isinstance(exc, KilledWorker | WorkerDied) else f"did not answer within {_secs(timeout)} s"
            why = f"GPU worker {self.worker} {how} while timing PyTorch's baseline (it was replaced)"
            raise WorkerGone(why) from None

    def profile(self, op, shape, dtype, attrs, candidate: Candidate) -> dict[str, Any]:
        from distributed import KilledWorker

        timeout = self.executor.settings.worker_answer_timeout_s
        try:
            return self._result(
                task_profile,
                op,
                list(shape),
                dtype,
                dict(attrs),
                candidate.family,
                candidate.params_json,
                timeout=timeout,
            )
        except (KilledWorker, WorkerDied, TimeoutError) as exc:  # a process hung or dead: replaced, as after a batch
            self.executor.restart(self.worker)
            how = "died" if isinstance(exc, KilledWorker | WorkerDied) else f"did not answer within {_secs(timeout)} s"
            # This variant's failure (it hung or crashed the process under ncu), not the profiler's: the search
            # goes on to profile its next leader, on the fresh process.
            return {
                "error": f"profiling failed: GPU worker {self.worker} {how} (it was replaced)",
                "unavailable": False,
            }
        except Exception as exc:  # noqa: BLE001 - a profile is optional: record why it is missing
            return {"error": f"profiling failed on {self.worker}: {type(exc).__name__}: {exc}"}

    def evaluate(self, op, shape, dtype, attrs, candidates: Sequence[Candidate]) -> list[TrialResult]:
        from distributed import KilledWorker

        payload = [(c.family, c.params_json) for c in candidates]
        timeout = self.executor.settings.worker_answer_timeout_s
        try:
            results = self._result(task_evaluate, op, list(shape), dtype, dict(attrs), payload, timeout=timeout)
        except (KilledWorker, WorkerDied):
            self.executor.restart(self.worker)
            if len(candidates) > 1:  # which one killed it is not known: each again on its own, on a fresh process
                log.warning("worker %s died on a batch of %d: each again alone", self.worker, len(candidates))
                results = []
                for c in candidates:
                    try:
                        results += self.evaluate(op, shape, dtype, attrs, [c])
                    except WorkerGone:  # restarted too often, say: what was found is kept, the rest runs later
                        if not results:
                            raise
                        why = f"GPU worker {self.worker} was lost before this candidate ran"
                        rest = candidates[len(results) :]
                        return results + [TrialResult(o.family, o.params, SKIPPED, why) for o in rest]
                return results
            why = "the worker process died while evaluating this candidate (it was replaced)"
            return [TrialResult(c.family, c.params, "fault", why) for c in candidates]
        except TimeoutError:
            self.executor.restart(self.worker)
            why = f"the worker did not answer within {_secs(timeout)} s (it was replaced)"
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
        self._replaced: set[str] = set()  # addresses of worker processes restart() replaced
        self._revived: dict[str, float] = {}  # when _revive last started a worker's nanny
        self._restarts: dict[str, list[float]] = {}  # when restart() restarted each worker since a GPU task answered
        self._owed: set[str] = set()  # workers whose restart _MAX_RESTARTS refused
        self._reconnect_at = 0.0  # the earliest next attempt to connect again to a lost scheduler
        self._closed = False  # close() was called: the service stops, and no call connects again
        self._silent: str | None = None  # why the scheduler's last answer did not come, while it has not (logged once)
        if settings.scheduler:
            self.client = Client(settings.scheduler, timeout="20s")
            return
        n, how = (gpus, "configured") if gpus is not None else count_gpus()
        if n == 0:
            self._why = f"no GPU on this host ({how}); jobs stay queued until a GPU worker joins"
            log.warning("%s", self._why)  # at start, in serve's log: not only on /api/workers and the dashboard
        self.cluster = _local_cluster(n, fake_device)
        self.client = Client(self.cluster)

    def _registered(self) -> dict[str, dict[str, Any]]:
        """The worker processes registered with the scheduler now, by address (none while it cannot be reached);
        WorkerGone where it does not answer within _SCHEDULER_ANSWER_S."""
        if not self._connected():
            return {}
        return self._ask_scheduler(self.client.scheduler.identity, n_workers=-1).get("workers", {})

    def _ask_scheduler(self, call, **kwargs) -> Any:
        """``call(**kwargs)``, a scheduler RPC, answered within _SCHEDULER_ANSWER_S, else WorkerGone: a scheduler
        process that is frozen (stopped, swapping) keeps its connections open, and Dask waits for its answer for
        as long as it stays so (the job runner's poll, /api/health and a batch's poll did)."""
        import asyncio

        answer = asyncio.run_coroutine_threadsafe(call(**kwargs), self.client.loop.asyncio_loop)
        try:
            result = answer.result(timeout=_SCHEDULER_ANSWER_S)
        except TimeoutError:
            answer.cancel()
            why = f"the scheduler at {self._where()} did not answer within {_SCHEDULER_ANSWER_S:g} s"
            if self._silent is None:  # once an outage: every poll and health check asks
                log.warning("%s; said once until it answers again", why)
            self._silent = why
            raise WorkerGone(why) from None
        if self._silent is not None:
            log.warning("the scheduler at %s answers again", self._where())
            self._silent = None
        return result

    def _where(self) -> str:
        return self.settings.scheduler or "of the local cluster"

    def _connected(self) -> bool:
        """Whether the client is connected, connecting again where its connection to a scheduler of its own
        (``--scheduler``) closed: a scheduler away longer than the client's reconnect window (20 s) closed it
        for good, and the service never reached a worker again."""
        if self.client.status != "closed":
            return True
        if not self.settings.scheduler or self._closed:  # the local cluster's own client: nothing to connect to again
            return False
        if time.monotonic() < self._reconnect_at:
            return False
        self._reconnect_at = time.monotonic() + _RECONNECT_S
        from distributed import Client

        try:
            self.client = Client(self.settings.scheduler, timeout="5s")
        except OSError as exc:  # TimeoutError too
            why = f"the scheduler at {self.settings.scheduler} is unreachable ({exc})"
            if self._silent is None:  # once an outage, not at every try
                log.warning("%s; trying again every %.0f s, said once until it is back", why, _RECONNECT_S)
            self._silent = why
            return False
        log.warning("connected again to the scheduler at %s", self.settings.scheduler)
        self._silent = None
        return True

    def _processes(self, worker: str) -> set[str]:
        """The addresses of the registered processes of the worker named ``worker``."""
        return {address for address, info in self._registered().items() if info.get("name") == worker}

    def worker_names(self) -> list[str]:
        return sorted(w["name"] for w in self._registered().values() if w.get("resources", {}).get("GPU"))

    def address(self, worker: str, timeout: float = 120.0) -> str:
        """The scheduler address of the live process of the GPU worker named ``worker`` (not one that
        ``restart`` replaced), waiting up to ``timeout`` s for one to join; TimeoutError past that."""
        start = time.monotonic()
        said = 0
        while True:
            live = self._processes(worker) - self._replaced
            if live:
                return min(live)  # one, save for a moment during a restart
            self._revive(worker)
            waited = time.monotonic() - start
            if waited >= timeout:
                raise TimeoutError(f"no process of GPU worker {worker} joined the scheduler within {_secs(timeout)} s")
            if waited >= said + 30:
                said += 30
                log.warning("waiting for a process of GPU worker %s to join the scheduler (%d s so far)", worker, said)
            time.sleep(0.2)

    def _revive(self, worker: str) -> None:
        """Start the local cluster's nanny of ``worker`` again where it has closed: its GPU slot would stay empty
        for good (the nanny, not the scheduler, brings a worker process back)."""
        from distributed.core import Status

        cluster = self.cluster
        if cluster is None or cluster.status in (Status.closing, Status.closed):
            return  # not ours to start, or shutting down
        if worker not in cluster.worker_spec or worker in cluster.workers:
            return
        if time.monotonic() - self._revived.get(worker, -math.inf) < 30:
            return  # starting; a nanny joins cluster.workers only once it runs
        self._revived[worker] = time.monotonic()
        log.warning("the nanny of GPU worker %s had closed; starting it again", worker)
        cluster.scale(len(cluster.worker_spec))  # opens every worker of the spec that is not running

    def alive(self, address: str) -> bool:
        """Whether a worker process at ``address`` is still registered with the scheduler."""
        return address in self._registered()

    def submit(self, worker: str, fn, *args, timeout: float, gpu: bool = True) -> tuple[str, Any]:
        """``fn(*args)`` as a task pinned to the live process of GPU worker ``worker`` (waiting up to ``timeout`` s
        for one): its address and the future. ``gpu``: the task holds the worker's GPU slot.

        Pinned by address, not by name: the scheduler turns a name into an address when the task arrives, and
        right after a restart the name may still point at the process being replaced, or at nothing; a task
        pinned there would never run."""
        address = self.address(worker, timeout)
        future = self.client.submit(
            fn, *args, workers=[address], allow_other_workers=False, resources={"GPU": 1} if gpu else None,
            pure=False,
        )  # fmt: skip
        return address, future

    def run_on(self, worker: str, fn, *args, timeout: float, gpu: bool = True) -> Any:
        """``fn(*args)`` on GPU worker ``worker``; TimeoutError after ``timeout`` s without an answer (the task
        cancelled), WorkerGone where no process of the worker joins meanwhile or the scheduler is lost. A task
        still waiting on a process that has left is pinned to the worker's new process: it never started there.
        A task whose worker process dies while running it errs at once (KilledWorker), or, where the scheduler
        would retry it (its allowed-failures above 0), WorkerDied."""
        from concurrent.futures import CancelledError

        if worker in self._owed:  # a restart was refused: its process may be hung or poisoned, never given a task
            if why := self._restart_refused(worker):
                raise WorkerGone(why)
            self.restart(worker)
        deadline = time.monotonic() + timeout
        address, future = self._submit_or_gone(worker, fn, *args, timeout=timeout, gpu=gpu)
        done = _done_event(future)
        while True:
            # Waited for here, fetched once done: future.result(timeout=...) also bounds the fetch of a finished
            # task's result, and a timeout falling in it raised UnboundLocalError out of Dask's sync() (asyncio's
            # CancelledError escapes its ``except Exception``): the job failed for good.
            finished = done.wait(max(0.01, min(_POLL_S, deadline - time.monotonic())))
            if self._closed:  # the service stops: its client is closed, nothing more can be asked through it
                raise self._closing(worker)
            try:
                if finished:
                    result = self._fetch(worker, future)
                    if gpu:  # its process runs kernels again: its restarts did their work
                        self._restarts.pop(worker, None)
                    return result
                left = (future.status == "pending" and not self.alive(address)) and not self._closed
                if left and self._died_under(future):
                    # A scheduler that retries a task whose worker died (allowed-failures above 0, Dask's default)
                    # holds it for the dead process: sent to the new one, a kernel that kills its process would
                    # kill it again, until the timeout.
                    future.cancel()
                    raise WorkerDied(f"GPU worker {worker} died while running a task (its process {address} left)")
                if left:
                    log.info("worker %s left %s before running a task; pinning it to its new process", worker, address)
                    future.cancel()
                    remaining = min(max(0.0, deadline - time.monotonic()), _REJOIN_WAIT_S)
                    address, future = self._submit_or_gone(worker, fn, *args, timeout=remaining, gpu=gpu)
                    done = _done_event(future)
                    continue
            except (CancelledError, OSError) as exc:  # the scheduler went away: FutureCancelledError, CommClosedError
                if self._closed:
                    raise self._closing(worker) from None
                if future.status == "error":  # the task's own OSError, raised again here: not the scheduler's
                    raise
                why = str(exc) or type(exc).__name__
                raise WorkerGone(f"lost the scheduler while GPU worker {worker} ran a task ({why})") from None
            if self._closed:  # closed while the scheduler was asked: no worker was listed
                raise self._closing(worker)
            if time.monotonic() >= deadline:  # raised out of the try: a TimeoutError is an OSError
                with contextlib.suppress(Exception):  # the scheduler may be gone too
                    future.cancel()
                raise TimeoutError(f"GPU worker {worker} did not answer within {_secs(timeout)} s")

    def _died_under(self, future: Any) -> bool:
        """Whether ``future``'s task was running on a worker process that died: in the scheduler's transition log
        (key, start, finish, recommendations, stimulus, time) it left ``processing`` as the scheduler lost that
        process (its connection broke, or it went silent past the scheduler's worker TTL). A process that left
        gracefully, or that ``restart`` replaced, leaves its task to run elsewhere, as Dask itself does."""
        story = self._ask_scheduler(self.client.scheduler.get_story, keys_or_stimuli=[future.key])
        return any(
            len(step) > 4 and step[1] == "processing" and str(step[4]).startswith(_PROCESS_LOST) for step in story
        )

    def _closing(self, worker: str) -> WorkerGone:
        return WorkerGone(f"the service closed its connection to the scheduler while GPU worker {worker} ran a task")

    def _fetch(self, worker: str, future: Any) -> Any:
        """The result of a done ``future`` (its error raised); WorkerGone where it cannot be fetched within _FETCH_S
        (the process holding it left as it finished)."""
        try:
            return future.result(timeout=_FETCH_S)
        except TimeoutError:
            if future.status == "error":  # the task's own TimeoutError
                raise
            why = f"the answer of GPU worker {worker} could not be fetched within {_secs(_FETCH_S)} s"
            raise WorkerGone(why) from None

    def _submit_or_gone(self, worker: str, fn, *args, timeout: float, gpu: bool) -> tuple[str, Any]:
        try:
            return self.submit(worker, fn, *args, timeout=timeout, gpu=gpu)
        except TimeoutError as exc:  # no process of it to run the task: the worker, not a trial, is at fault
            raise WorkerGone(str(exc)) from None

    def _facts_future(self, worker: str) -> Any:
        """The background facts task of ``worker`` (submitted once, again where its process has left); None while
        no process of it is registered."""
        pending = self._pending_facts.get(worker)
        if pending is not None and pending[1].status == "pending" and not self.alive(pending[0]):
            pending[1].cancel()
            pending = None
        if pending is None:
            try:
                pending = self.submit(worker, task_facts, timeout=0, gpu=False)
            except TimeoutError:
                return None
            self._pending_facts[worker] = pending
        return pending[1]

    def facts(self, worker: str) -> dict[str, Any]:
        if worker not in self._facts:
            pending = self._pending_facts.pop(worker, None)  # the listing's background task, if any
            if pending is not None and pending[1].done() and pending[1].status == "finished":
                self._facts[worker] = pending[1].result()
            else:
                if pending is not None:
                    pending[1].cancel()
                self._facts[worker] = self.run_on(worker, task_facts, timeout=120, gpu=False)
        return self._facts[worker]

    def workers(self) -> list[WorkerInfo]:
        try:
            return self._workers()
        except WorkerGone:  # the scheduler is silent: no worker to give a job to (why_none says why)
            return []

    def _workers(self) -> list[WorkerInfo]:
        if self.cluster is not None:  # the listing is polled (job runner, API): a closed local nanny comes back
            for name in list(self.cluster.worker_spec):
                self._revive(name)
        out = []
        for name in self.worker_names():
            if name in self._owed and self._restart_refused(name):  # no job until it may be restarted again
                continue
            if name not in self._facts:  # asked once in the background; never blocks this listing
                future = self._facts_future(name)
                if future is not None and future.done() and future.status == "finished":
                    self._facts[name] = future.result()
                    self._pending_facts.pop(name, None)
            facts = self._facts.get(name, {})
            out.append(
                WorkerInfo(name, facts.get("name"), facts.get("arch"), self.job(name) is not None, self.job(name))
            )
        return out

    def why_none(self) -> str | None:
        if self._silent is not None:  # the listing just asked, and was not answered: not asked again
            return self._silent
        try:
            names = self.worker_names()
        except WorkerGone as exc:
            return str(exc)
        if names:
            withheld = [why for name in names if name in self._owed and (why := self._restart_refused(name))]
            return "; ".join(withheld) if len(withheld) == len(names) else None
        return self._why or "no GPU worker has joined the scheduler (start one with `kernelmill worker`)"

    def evaluator(self, worker: str) -> Evaluator:
        return DaskEvaluator(self, worker)

    def _restart_refused(self, worker: str) -> str | None:
        """Why ``worker`` may not be restarted now (_MAX_RESTARTS within _RESTART_WINDOW_S, no GPU task of it answered
        since), else None."""
        now = time.monotonic()
        recent = [at for at in self._restarts.get(worker, ()) if now - at < _RESTART_WINDOW_S]
        if len(recent) < _MAX_RESTARTS:
            return None
        wait_s = recent[0] + _RESTART_WINDOW_S - now
        return (
            f"GPU worker {worker} was restarted {len(recent)} times within {_secs(_RESTART_WINDOW_S)} s, and answered "
            f"no task in between: it takes no job for {_secs(wait_s)} s, then it is restarted"
        )

    def restart(self, worker: str) -> None:
        if why := self._restart_refused(worker):
            if worker not in self._owed:  # once a refusal, not at each call that finds it owed
                self._owed.add(worker)
                log.error("%s", why)
            return
        self._owed.discard(worker)
        now = time.monotonic()
        self._restarts[worker] = [at for at in self._restarts.get(worker, ()) if now - at < _RESTART_WINDOW_S] + [now]
        log.warning("restarting worker %s (fresh CUDA context)", worker)
        self._facts.pop(worker, None)
        self._pending_facts.pop(worker, None)
        try:
            mine = self._processes(worker)
            if not mine:  # already gone: its nanny brings a fresh one (started again here if it closed)
                log.warning("no process of worker %s to restart; waiting for a fresh one", worker)
                self._revive(worker)
                return
            self._replaced.update(mine)
            self.client.restart_workers([worker], timeout=120)
        except Exception as exc:  # noqa: BLE001 - a dead worker is replaced by its nanny anyway
            log.warning("restart of %s: %s", worker, exc)

    def close(self) -> None:
        self._closed = True  # before the client closes: a job thread polling a task then takes it for gone
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()


def _done_event(future: Any) -> threading.Event:
    """An event set once ``future`` is finished, erred or cancelled."""
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    return done


def _worker_spec(index: int, prefix: str, fake_device: bool) -> dict[str, Any]:
    from distributed import Nanny

    # Worker ``index`` runs on this process's ``index``-th visible GPU: with CUDA_VISIBLE_DEVICES=2,3 that is GPU 2
    # for the first (it was GPU 0: the nanny's variable replaces the inherited one).
    visible = visible_devices()
    device = visible[index] if visible is not None and index < len(visible) else str(index)
    env = {"CUDA_VISIBLE_DEVICES": device, "OMP_NUM_THREADS": "1"}
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

    dask.config.set({
        # A kernel that kills its worker process would kill the retry too: fail the task at once.
        "distributed.scheduler.allowed-failures": 0,
        # The cluster closes a worker's nanny for good when no process of that name is registered
        # lost-worker-timeout (15 s) after one left. A GPU slot is never lost: its process may be away for
        # seconds at that moment when a second restart follows the first (a hung kernel slows the exit).
        "distributed.deploy.lost-worker-timeout": "3650d",
    })  # fmt: skip

    # Named <hostname>-gpu<i>, as `kernelmill worker` names its own: services on two hosts sharing one database
    # took each other's gpu0 for busy (Store.workers_held) and wrote over each other's devices row.
    specs = [_worker_spec(i, f"{socket.gethostname()}-", fake_device) for i in range(n_gpus)]
    workers = {spec["options"]["name"]: spec for spec in specs}
    return SpecCluster(
        workers=workers,
        # The Dask protocol runs code: the built-in scheduler listens on loopback only, with no dashboard
        # (its own defaults are every interface and :8787). Workers elsewhere join a separate scheduler. Its
        # HTTP server (health, metrics) still starts: on a free port, not 8787 (a second `serve` on the host
        # warned that 8787 was taken; None means Dask's default).
        scheduler={
            "cls": Scheduler,
            "options": {"host": "127.0.0.1", "dashboard": False, "dashboard_address": "127.0.0.1:0"},
        },
        silence_logs=logging.WARNING,
        name="kernelmill",
    )


async def run_workers(scheduler: str, gpus: int | None = None, grace_s: float = STOP_GRACE_S) -> None:
    """``kernelmill worker``: one Nanny per local GPU joining ``scheduler``, and joining it again after it restarts;
    runs until cancelled, or until SIGTERM (`docker stop`), on which each GPU's task in flight gets up to
    ``grace_s`` s to finish before its worker closes (a task still running then is handed back to the scheduler,
    not lost with a dead process)."""
    import asyncio
    import signal

    if gpus is not None and gpus < 1:
        raise ValueError(f"--gpus must be at least 1, not {gpus}")
    fake_device = os.environ.get("KERNELMILL_FAKE_DEVICE") == "1"
    n = gpus
    if gpus is None or not fake_device:  # a worker that cannot run kernels would take jobs only to fail them
        found, how = count_gpus()
        if found == 0:
            raise RuntimeError(f"no GPU to serve ({how})")
        if gpus is not None and gpus > found:  # workers pinned to GPUs that are not there take jobs only to bounce them
            raise ValueError(f"--gpus {gpus}: this host has {found} (counted by {how})")
        n = found if gpus is None else gpus
    if not fake_device and importlib.util.find_spec("pycuda") is None:
        raise RuntimeError("pycuda is not installed, so no kernel can run here: pip install 'kernelmill[gpu]'")
    prefix = f"{socket.gethostname()}-"
    specs = [_worker_spec(i, prefix, fake_device=fake_device) for i in range(n)]
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    if threading.current_thread() is threading.main_thread():  # Python's default for SIGTERM kills at once
        loop.add_signal_handler(signal.SIGTERM, stopping.set)
    try:
        served = await asyncio.gather(
            *(_serve_gpu(scheduler, spec["options"], stopping, grace_s) for spec in specs), return_exceptions=True
        )
        failed = [exc for exc in served if isinstance(exc, BaseException)]
        if unexpected := [exc for exc in failed if not isinstance(exc, GpuWorkerFailed)]:
            raise unexpected[0]
        if failed:  # each one was logged as it failed, while the other GPUs' workers ran on
            raise GpuWorkerFailed("; ".join(map(str, failed)))
    finally:
        if threading.current_thread() is threading.main_thread():
            loop.remove_signal_handler(signal.SIGTERM)


class GpuWorkerFailed(RuntimeError):
    """A GPU's Nanny of `kernelmill worker` failed to start for another reason than its scheduler's connection."""


def _start_failure(exc: BaseException) -> str:
    """Why a Nanny failed to start, in one line: the first cause Dask's "Nanny failed to start." and "Worker failed
    to start." wrap (the scheduler's refusal, say: "name taken, host-gpu0")."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    said = (str(exc).strip().splitlines() or [""])[0]
    if refused := re.search(r"'message': '([^']*)'", said):  # the scheduler's answer to the worker's registration
        said = f"the scheduler refused it: {refused.group(1)}"
    return said or type(exc).__name__


async def _serve_gpu(scheduler: str, options: dict[str, Any], stopping: Any, grace_s: float) -> None:
    """One GPU's Nanny, started again whenever it closes: Dask's workers close when their scheduler's connection
    breaks (a scheduler restarted), and do not reconnect; a Nanny started while the scheduler is away waits for it.
    Ends when cancelled (Ctrl-C), closing the Nanny, or once ``stopping`` is set, closing it after its task in
    flight (``_drain``)."""
    import asyncio

    from distributed import Nanny

    name = options["name"]
    while not stopping.is_set():
        nanny = Nanny(scheduler, **options)
        try:
            try:
                await nanny
            except RuntimeError as exc:  # "Nanny failed to start."
                if not isinstance(exc.__cause__, OSError):  # not the scheduler's connection breaking as it started
                    why = f"GPU worker {name} failed to start: {_start_failure(exc)}"
                    log.error("%s; the other GPUs' workers run on", why)
                    raise GpuWorkerFailed(why) from None
            else:
                await _first(nanny.finished(), stopping.wait())
                if stopping.is_set() and nanny.status.name == "running":
                    await _drain(nanny, name, grace_s)
                    await _hand_back(nanny)
        finally:
            if nanny.status.name not in ("closed", "failed"):  # cancelled or stopping: the worker process goes with it
                await asyncio.shield(nanny.close(reason="kernelmill-worker-stopping"))
        if stopping.is_set():
            log.warning("GPU worker %s stopped (SIGTERM)", name)
            return
        log.warning("GPU worker %s lost the scheduler at %s; it joins again once that is back", name, scheduler)
        await _first(asyncio.sleep(_REJOIN_S), stopping.wait())


async def _first(*aws: Any) -> None:
    """Wait until the first of ``aws`` is done; the others are cancelled."""
    import asyncio

    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


async def _drain(nanny: Any, name: str, grace_s: float) -> None:
    """Wait up to ``grace_s`` s until the scheduler lists no task running on ``nanny``'s worker process and no result
    held there that its client has not fetched yet: closed then, its last batch is recorded, not re-run."""
    import asyncio

    address = nanny.worker_address
    deadline = time.monotonic() + grace_s
    said = False
    while address is not None:
        try:
            running = await asyncio.wait_for(nanny.scheduler.processing(workers=[address]), _SCHEDULER_ANSWER_S)
            held = await asyncio.wait_for(nanny.scheduler.has_what(workers=[address]), _SCHEDULER_ANSWER_S)
        except Exception:  # noqa: BLE001 - the scheduler gone, or the process left it: nothing left to wait for
            return
        if not running.get(address) and not held.get(address):
            return
        if time.monotonic() >= deadline:
            log.warning("GPU worker %s still ran a task %s s after SIGTERM: it is handed back", name, _secs(grace_s))
            return
        if not said:
            log.warning("GPU worker %s stops once its task in flight ends (at most %s s)", name, _secs(grace_s))
            said = True
        await asyncio.sleep(0.1)


async def _hand_back(nanny: Any) -> None:
    """Take ``nanny``'s worker process off the scheduler as one leaving on purpose: a task still on it (past the
    grace, or sent as the drain ended) goes back to waiting, not to a KilledWorker as from a process that died, and
    the service queues its job again (run_on) instead of re-running its batch one candidate at a time."""
    import asyncio

    if nanny.worker_address is None:
        return
    nanny.close_gracefully(reason="kernelmill-worker-stopping")  # its process, leaving, is not started again
    with contextlib.suppress(Exception):  # the scheduler gone: nothing to hand back to
        await asyncio.wait_for(
            nanny.scheduler.unregister(
                address=nanny.worker_address, stimulus_id=f"kernelmill-worker-stopping-{time.time()}", expected=True,
                close=False,
            ),
            _SCHEDULER_ANSWER_S,
        )  # fmt: skip


def _secs(seconds: float) -> str:
    """A duration as a message says it: one decimal under 10 s (0.5, not 0), whole seconds above."""
    return f"{seconds:.1f}" if seconds < 10 else f"{seconds:.0f}"


def make_executor(settings: Settings) -> Executor:
    if settings.executor == "fake":
        return FakeExecutor(settings.fake_workers, settings.fake_delay_s)
    return DaskExecutor(settings)
