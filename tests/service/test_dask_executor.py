"""The Dask executor on CPU: fake-device worker processes (one per 'GPU'), a worker that dies mid-task."""

import contextlib
import json
import socket
import time

import pytest

from kernelmill.agents.space import Candidate, Space
from kernelmill.kernels.ops import get_op
from kernelmill.service.db.store import Store
from kernelmill.service.executor import (
    DaskEvaluator,
    DaskExecutor,
    FakeExecutor,
    WorkerDied,
    task_baseline,
    task_evaluate,
)
from kernelmill.service.jobs import JobRunner
from kernelmill.settings import Settings

#: The local cluster's GPU workers, named as `kernelmill worker` names its own: <hostname>-gpu<i>.
GPU0, GPU1 = f"{socket.gethostname()}-gpu0", f"{socket.gethostname()}-gpu1"


@pytest.fixture
def crash_family_key(monkeypatch):
    space = Space(get_op("softmax"), "float16")
    victim = space.candidates[5]
    # Worker processes inherit this: evaluating the victim kills the process (os._exit).
    monkeypatch.setenv("KERNELMILL_FAKE_CRASH_ON", victim.params_json)
    return victim


@pytest.fixture
def executor(crash_family_key, tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path}/d.db", worker_answer_timeout_s=60)
    ex = DaskExecutor(settings, gpus=2, fake_device=True)
    deadline = time.monotonic() + 60
    while len(ex.worker_names()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    yield ex
    ex.close()


def test_workers_pinned_one_per_gpu(executor):
    # Named after the host: two services sharing one database took each other's plain gpu0 for their own.
    assert executor.worker_names() == [GPU0, GPU1]
    facts = {w: executor.facts(w)["name"] for w in executor.worker_names()}
    assert facts == {GPU0: "FakeGPU 0", GPU1: "FakeGPU 1"}  # CUDA_VISIBLE_DEVICES per worker
    # The built-in scheduler runs whatever its clients send: it and its HTTP routes listen on loopback only.
    assert executor.cluster.scheduler_address.startswith("tcp://127.0.0.1:")
    http = executor.cluster.scheduler.http_server
    assert {sock.getsockname()[0] for sock in http._sockets.values()} == {"127.0.0.1"}


def test_dead_worker_is_replaced_and_batch_recorded_as_fault(executor, crash_family_key):
    evaluator = executor.evaluator(GPU1)
    ok = Candidate.of(
        crash_family_key.family, {**crash_family_key.params, "fast_exp": not crash_family_key.params["fast_exp"]}
    )
    results = evaluator.evaluate("softmax", (64, 64), "float16", {}, [crash_family_key])
    assert [r.status for r in results] == ["fault"]
    assert "died" in results[0].reason
    deadline = time.monotonic() + 60
    while GPU1 not in executor.worker_names() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert GPU1 in executor.worker_names()
    again = evaluator.evaluate("softmax", (64, 64), "float16", {}, [ok])
    assert again[0].status in ("ok", "wrong_result")  # a fresh process answers again


def test_job_through_dask_completes_despite_crash(executor, tmp_path, crash_family_key):
    store = Store(f"sqlite:///{tmp_path}/jobs.db")
    settings = Settings(database_url=store.url, batch_size=4)
    runner = JobRunner(store, executor, settings, poll_s=0.1)
    job = store.create_job(
        op="softmax",
        shapes=[[64, 64]],
        dtype="float16",
        attrs={},
        strategy="exhaustive",
        budget_trials=12,
        budget_seconds=120,
    )
    runner.start()
    try:
        deadline = time.monotonic() + 120
        while store.get_job(job.id).state not in ("done", "failed") and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        runner.stop()
    final = store.get_job(job.id)
    assert final.state == "done", final.error
    trials = store.trials(job.id)
    assert len(trials) == 12
    assert len({(t.family, t.params_key) for t in trials}) == 12  # no duplicates
    crashed = [
        t for t in trials if t.params_key == crash_family_key.params_json and t.family == crash_family_key.family
    ]
    assert len(crashed) == 1 and crashed[0].status == "fault"


def test_a_task_pinned_to_a_process_that_left_is_pinned_to_the_workers_new_one(executor, monkeypatch, caplog):
    """After a restart the scheduler may still map the worker's name to the process being replaced: a task pinned
    there would wait for ever (a hang seen on the GPU, where a poisoned worker takes a while to go)."""
    import logging

    from kernelmill.service import executor as executor_module

    monkeypatch.setattr(executor_module, "_POLL_S", 0.2)
    old = executor.address(GPU1)
    executor.restart(GPU1)
    new = executor.address(GPU1, timeout=60)  # the replaced process never again, even while it lingers
    assert new != old and executor.alive(new)
    gone = "tcp://127.0.0.1:9"  # a process that has left (no worker listens there)
    real, first = executor.address, []

    def stale_once(worker, timeout=120.0):  # the first submission meets it
        if not first:
            first.append(worker)
            return gone
        return real(worker, timeout)

    monkeypatch.setattr(executor, "address", stale_once)
    with caplog.at_level(logging.INFO, logger="kernelmill.service.executor"):
        facts = executor.run_on(GPU1, executor_module.task_facts, timeout=30, gpu=False)
    assert facts["name"] == "FakeGPU 1" and f"worker {GPU1} left {gone} before running a task" in caplog.text
    monkeypatch.setattr(executor, "address", real)
    # No process of the worker at all: the worker is gone (the job goes back to the queue), no trial timed out.
    with pytest.raises(
        executor_module.WorkerGone, match="no process of GPU worker gpu7 joined the scheduler within 0.3 s"
    ):
        executor.run_on("gpu7", executor_module.task_facts, timeout=0.3)


def test_a_batch_that_kills_its_worker_is_evaluated_again_one_by_one(executor, crash_family_key):
    """Which candidate killed the process is not known: only that one is recorded as the fault."""
    evaluator = executor.evaluator(GPU0)
    space = Space(get_op("softmax"), "float16")
    others = [c for c in space.candidates[:8] if c != crash_family_key][:2]
    results = evaluator.evaluate("softmax", (64, 64), "float16", {}, [others[0], crash_family_key, others[1]])
    statuses = [r.status for r in results]
    assert statuses[1] == "fault" and "died" in results[1].reason
    assert statuses[0] != "fault" and statuses[2] != "fault", [r.reason for r in results]


def test_a_task_cancelled_under_it_is_a_lost_worker_not_a_failed_trial(executor, monkeypatch):
    """The scheduler's connection lost: the tasks' futures are cancelled. That is no trial's fault."""
    import threading

    from kernelmill.service import executor as executor_module

    submitted = []
    real_submit = executor.submit

    def keep(*args, **kwargs):
        submitted.append(real_submit(*args, **kwargs))
        return submitted[-1]

    monkeypatch.setattr(executor, "submit", keep)

    def cancel_once_it_runs() -> None:  # a fixed 1 s timer found nothing submitted yet on a loaded machine
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if submitted and any(submitted[0][1].key in keys for keys in executor.client.processing().values()):
                submitted[0][1].cancel()
                return
            time.sleep(0.05)

    threading.Thread(target=cancel_once_it_runs, daemon=True).start()
    with pytest.raises(executor_module.WorkerGone, match=f"lost the scheduler while GPU worker {GPU0} ran a task"):
        executor.run_on(GPU0, time.sleep, 30, timeout=20)


def test_a_closed_connection_to_the_scheduler_is_opened_again(executor):
    """Away longer than its reconnect window, the client closes for good: the service never saw a worker again."""
    executor.settings = executor.settings.model_copy(update={"scheduler": executor.cluster.scheduler_address})
    executor.client.close()
    assert executor.worker_names() == [GPU0, GPU1]
    assert executor.client.status == "running"


def test_a_scheduler_outage_is_logged_once_and_its_end_once(executor, monkeypatch, caplog):
    """Each question the silent scheduler left unanswered (the job runner's poll, every /api/health) logged its own
    warning, and each failed attempt to connect again another, every 10 s, for as long as the outage lasted."""
    import asyncio
    import logging

    import distributed

    from kernelmill.service import executor as executor_module

    async def never(**kwargs):  # a frozen scheduler: the connection stays open, no answer comes
        await asyncio.sleep(60)

    def unreachable(*args, **kwargs):
        raise OSError("Timed out trying to connect")

    monkeypatch.setattr(executor_module, "_SCHEDULER_ANSWER_S", 0.1)
    monkeypatch.setattr(executor_module, "_RECONNECT_S", 0.0)
    address = executor.cluster.scheduler_address
    executor.settings = executor.settings.model_copy(update={"scheduler": address})
    with caplog.at_level(logging.WARNING, logger="kernelmill.service.executor"):
        for _ in range(3):
            with pytest.raises(executor_module.WorkerGone, match="did not answer within 0.1 s"):
                executor._ask_scheduler(never)
        assert [w.name for w in executor.workers()] == [GPU0, GPU1]
        executor.client.close()  # then gone: the connection closed, and connecting again fails
        with monkeypatch.context() as refused:
            refused.setattr(distributed, "Client", unreachable)
            for _ in range(3):
                assert executor.workers() == []
            assert executor.why_none().startswith(f"the scheduler at {address} ")
        assert [w.name for w in executor.workers()] == [GPU0, GPU1]
        assert [w.name for w in executor.workers()] == [GPU0, GPU1]
    said = [r.getMessage() for r in caplog.records if r.name == "kernelmill.service.executor"]
    assert said == [
        f"the scheduler at {address} did not answer within 0.1 s; said once until it answers again",
        f"the scheduler at {address} answers again",
        f"the scheduler at {address} is unreachable (Timed out trying to connect); trying again every 0 s, said once"
        " until it is back",
        f"connected again to the scheduler at {address}",
    ]


def _linger_at_exit(seconds: float) -> None:
    """Make this worker process slow to leave, as one whose kernel hangs was seen to be on the GPU: it does not exit
    on its own, and the nanny kills it after its grace period."""
    import atexit

    atexit.register(time.sleep, seconds)


def test_two_restarts_in_a_row_keep_the_workers_nanny(tmp_path):
    """A restart soon after another, of a process slow to leave (a hung kernel): the GPU worker stays absent for
    seconds, past the moment the local cluster checks on the worker removed by the first restart. The cluster must
    not close the worker's nanny then (seen on the GPU: the worker never came back and its job hung)."""
    import dask

    from kernelmill.service import executor as executor_module

    # Dask's distributed.deploy.lost-worker-timeout (15 s by default), cut short as the cluster starts: the
    # executor's own value must replace it, or the check falls while the lingering worker is away.
    check_at = 3.0
    with contextlib.ExitStack() as stack:  # the whole test in it: leaving it restores the value from before it
        stack.enter_context(dask.config.set({"distributed.deploy.lost-worker-timeout": f"{check_at:g}s"}))
        executor = DaskExecutor(Settings(database_url=f"sqlite:///{tmp_path}/r.db"), gpus=1, fake_device=True)
        stack.callback(executor.close)
        nanny = executor.cluster.workers[GPU0]
        executor.client.run(_linger_at_exit, 60, workers=[executor.address(GPU0, timeout=60)])
        start = time.monotonic()
        executor.restart(GPU0)  # returns once the new process has joined; the old one lingers ~4 s (then killed)
        assert time.monotonic() - start > check_at, "the first restart ended before the check it is meant to straddle"
        executor.client.run(_linger_at_exit, 60, workers=[executor.address(GPU0, timeout=60)])
        start = time.monotonic()
        executor.restart(GPU0)  # right after the first: its check falls while this one's process is away too
        assert time.monotonic() - start > check_at, "the second restart ended before the check it is meant to straddle"
        facts = executor.run_on(GPU0, executor_module.task_facts, timeout=60, gpu=False)
        assert facts["name"] == "FakeGPU 0"
        assert executor.cluster.workers[GPU0] is nanny  # the same nanny throughout, not one started again
        assert executor.worker_names() == [GPU0]


@pytest.mark.parametrize("first", ["task", "restart", "listing"])
def test_a_gpu_workers_nanny_that_closed_is_started_again(executor, caplog, first):
    """Whatever closes a local GPU worker's nanny (the cluster did, after a lost-worker timeout), the next listing
    of the workers (the job runner's poll), task or restart for that worker starts it again instead of waiting for
    a process that no nanny will bring."""
    import logging

    from kernelmill.service import executor as executor_module

    nanny = executor.cluster.workers.pop(GPU1)  # as SpecCluster drops a worker it believes lost
    executor.cluster.sync(nanny.close)
    assert GPU1 not in executor.worker_names()
    with caplog.at_level(logging.WARNING, logger="kernelmill.service.executor"):
        if first == "restart":
            executor.restart(GPU1)
            assert f"no process of worker {GPU1} to restart" in caplog.text
        elif first == "listing":
            deadline = time.monotonic() + 60
            while GPU1 not in [w.name for w in executor.workers()]:
                assert time.monotonic() < deadline, f"the listing never brought {GPU1} back"
                time.sleep(0.2)
        facts = executor.run_on(GPU1, executor_module.task_facts, timeout=60, gpu=False)
    assert facts["name"] == "FakeGPU 1"
    assert f"the nanny of GPU worker {GPU1} had closed; starting it again" in caplog.text
    assert executor.worker_names() == [GPU0, GPU1]


def test_a_worker_restarted_too_often_takes_no_job_until_it_may_be_restarted_again(executor, monkeypatch, caplog):
    """restart() had no limit: a worker failing on every start (its GPU gone, each fresh process's context unusable)
    was restarted for ever, its job bouncing on it. Past _MAX_RESTARTS within the window, with no GPU task answered in
    between, it is not restarted, takes no job, and a task for it sends its job back to the queue, until the window
    allows the restart it is owed."""
    import logging

    from kernelmill.service import executor as executor_module

    monkeypatch.setattr(executor_module, "_MAX_RESTARTS", 1)
    restarted = []

    def restart_workers(workers, timeout):  # as if each process were replaced in place: no wait for real restarts
        restarted.extend(workers)
        executor._replaced.clear()

    monkeypatch.setattr(executor.client, "restart_workers", restart_workers)
    with caplog.at_level(logging.WARNING, logger="kernelmill.service.executor"):
        executor.restart(GPU1)
        executor.run_on(GPU1, time.sleep, 0, timeout=30)  # a GPU task answered: that restart did its work
        for worker in (GPU0, GPU0, GPU1, GPU1, GPU1):
            executor.restart(worker)
    assert restarted == [GPU1, GPU0, GPU1]
    refused = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert refused == [  # said once a refusal, not at each call
        f"GPU worker {w} was restarted 1 times within 600 s, and answered no task in between: it takes no job for"
        " 600 s, then it is restarted"
        for w in (GPU0, GPU1)
    ]
    assert executor.workers() == []
    assert executor.why_none() == "; ".join(refused)
    with pytest.raises(executor_module.WorkerGone, match=f"GPU worker {GPU1} was restarted 1 times within 600 s"):
        executor.run_on(GPU1, time.sleep, 0, timeout=30)
    assert restarted == [GPU1, GPU0, GPU1]
    executor._restarts[GPU1] = [time.monotonic() - 600]  # the window has passed for gpu1
    assert [w.name for w in executor.workers()] == [GPU1]
    assert executor.run_on(GPU1, executor_module.task_facts, timeout=30, gpu=False)["name"] == "FakeGPU 1"
    assert restarted == [GPU1, GPU0, GPU1, GPU1]  # the restart it was owed, before its task


def test_two_local_clusters_on_one_host_do_not_fight_over_port_8787():
    """The built-in scheduler's HTTP server took Dask's default :8787, so a second `serve` on the host warned
    "Port 8787 is already in use" (and neither port was documented)."""
    import warnings

    from kernelmill.service.executor import _local_cluster

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Dask's warning about a taken port fails the test
        with _local_cluster(0, fake_device=True) as first, _local_cluster(0, fake_device=True) as second:
            ports = {c.scheduler.http_server.port for c in (first, second)}
            assert len(ports) == 2 and 8787 not in ports
            assert all(c.scheduler.address.startswith("tcp://127.0.0.1:") for c in (first, second))


def test_workers_run_on_the_gpus_cuda_visible_devices_names(monkeypatch):
    """With CUDA_VISIBLE_DEVICES=2,3 the workers ran on GPUs 0 and 1: each got its index, which replaced the
    inherited variable; and nvidia-smi counted every GPU of the host."""
    import subprocess
    from types import SimpleNamespace

    from kernelmill.service import executor

    def device(index: int) -> str:
        return executor._worker_spec(index, "", fake_device=False)["options"]["env"]["CUDA_VISIBLE_DEVICES"]

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [device(0), device(1)] == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, GPU-5f1c")
    assert [device(0), device(1)] == ["2", "GPU-5f1c"]

    listing = "".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i})\n" for i in range(8))
    monkeypatch.setitem(__import__("sys").modules, "pycuda", None)  # the nvidia-smi path, as without pycuda
    monkeypatch.setattr(executor.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(stdout=listing))
    assert executor.count_gpus() == (2, "nvidia-smi")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert executor.count_gpus() == (8, "nvidia-smi")


def test_a_batch_whose_answer_arrives_as_a_poll_ends_is_taken(executor, monkeypatch):
    """run_on polled with future.result(timeout=...), whose timeout also bounds the fetch of a finished task's
    result: one falling during that fetch raised UnboundLocalError out of Dask's sync() (asyncio's CancelledError
    escapes its ``except Exception``) and the job failed for good (seen on a live service), or, fetch after fetch cut
    short, the answer never came. Here each fetch takes longer than a poll: the batch's results come back."""
    import asyncio

    from kernelmill.service import executor as executor_module

    monkeypatch.setattr(executor_module, "_POLL_S", 0.01)
    real_gather = executor.client._gather

    async def slow_gather(*args, **kwargs):  # a batch's results (cubins, ptxas reports) take a while to fetch
        await asyncio.sleep(0.1)
        return await real_gather(*args, **kwargs)

    monkeypatch.setattr(executor.client, "_gather", slow_gather)
    batch = [(c.family, c.params_json) for c in Space(get_op("softmax"), "float16").candidates[:4]]
    results = executor.run_on(GPU0, executor_module.task_evaluate, "softmax", [64, 64], "float16", {}, batch,
                              timeout=60)  # fmt: skip
    assert [(r.family, r.params) for r in results] == [(f, json.loads(p)) for f, p in batch]


def test_a_task_past_its_timeout_is_a_timeout_not_a_lost_worker(executor):
    """A worker silent past its timeout is one to replace (DaskEvaluator restarts it and records the batch's
    timeout), not a lost scheduler: a TimeoutError is an OSError, and the scheduler's handler must not take it.
    A timeout under 10 s is said with its tenth (it read "within 1 s" for 0.6 s, "within 0 s" for 0.3 s)."""
    with pytest.raises(TimeoutError, match=f"GPU worker {GPU0} did not answer within 0.6 s"):
        executor.run_on(GPU0, time.sleep, 5, timeout=0.6)


@pytest.mark.parametrize("own_scheduler", [False, True])
def test_a_task_running_as_the_service_closes_the_executor_is_a_lost_worker(executor, monkeypatch, own_scheduler):
    """Ctrl-C on `serve` waits 5 s for the job threads, then closes the executor under a batch still running: the
    poll found no worker on the closed client, cancelling the task raised ClosedClientError, and the job ended
    failed for good instead of queued again. A client of its own scheduler also connected again after the close."""
    from kernelmill.service import executor as executor_module

    if own_scheduler:
        executor.settings = executor.settings.model_copy(update={"scheduler": executor.cluster.scheduler_address})
    monkeypatch.setattr(executor_module, "_POLL_S", 0.05)
    real_alive, closed = executor.alive, []

    def close_then_look(address: str) -> bool:  # the service stops as the poll looks at the worker
        if not closed:
            closed.append(executor.client)
            executor.close()
        return real_alive(address)

    monkeypatch.setattr(executor, "alive", close_then_look)
    with pytest.raises(executor_module.WorkerGone, match=f"GPU worker {GPU0}"):
        executor.run_on(GPU0, time.sleep, 30, timeout=20)
    assert executor.client is closed[0]  # no new connection after the close


class _DiesUnderTheBaseline(FakeExecutor):
    """One fake GPU worker whose process dies (or goes silent) while it times PyTorch's baseline, once; its
    evaluator is the Dask one, over a stand-in for the Dask calls."""

    def __init__(self, how: str, settings: Settings) -> None:
        super().__init__(1)
        self.how, self.settings, self.restarted = how, settings, []

    def evaluator(self, worker):
        return DaskEvaluator(self, worker)

    def facts(self, worker):
        facts = self._evaluators[worker].facts()
        return {"name": facts.name, "arch": facts.arch, "extra": facts.extra}

    def run_on(self, worker, fn, *args, timeout, gpu=True):
        from types import SimpleNamespace

        from distributed import KilledWorker

        if fn is task_baseline and not self.restarted:
            if self.how == "died":
                raise KilledWorker("task_baseline-1", SimpleNamespace(address="tcp://127.0.0.1:9"), 0)
            raise TimeoutError(f"GPU worker {worker} did not answer within {timeout:.0f} s")
        method = {task_baseline: "baseline_ms", task_evaluate: "evaluate"}[fn]
        if fn is task_evaluate:
            args = (*args[:4], [Candidate(family, params) for family, params in args[4]])
        return getattr(self._evaluators[worker], method)(*args)

    def restart(self, worker):
        self.restarted.append(worker)


@pytest.mark.parametrize("how", ["died", "silent"])
def test_a_worker_lost_while_timing_the_baseline_queues_the_job_again(tmp_path, how):
    """A worker process that died (KilledWorker) or went silent (TimeoutError) while it timed PyTorch's baseline
    ended the job failed for good: the worker, not the job, is at fault. The worker is replaced, the job queued
    again, and it completes once the worker is back."""
    store = Store(f"sqlite:///{tmp_path}/baseline.db")
    settings = Settings(database_url=store.url, batch_size=4, worker_answer_timeout_s=60)
    executor = _DiesUnderTheBaseline(how, settings)
    runner = JobRunner(store, executor, settings, poll_s=0.02)
    runner.bench_s = 0.0  # the worker back at once
    job = store.create_job(
        op="softmax", shapes=[[64, 64]], dtype="float16", attrs={}, strategy="random", budget_trials=8,
        budget_seconds=120,
    )  # fmt: skip
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while store.get_job(job.id).state not in ("done", "failed"):
            assert time.monotonic() < deadline, store.get_job(job.id).state
            time.sleep(0.02)
    finally:
        runner.stop()
        store.close()
    final = store.get_job(job.id)
    assert (final.state, final.error) == ("done", None)
    assert executor.restarted == ["fake-gpu0"]


class _Raises(FakeExecutor):
    """One fake GPU worker whose every Dask call raises ``exc``; its evaluator is the Dask one."""

    def __init__(self, exc: Exception, settings: Settings) -> None:
        super().__init__(1)
        self.exc, self.settings, self.restarted = exc, settings, []

    def evaluator(self, worker):
        return DaskEvaluator(self, worker)

    def run_on(self, worker, fn, *args, timeout, gpu=True):
        raise self.exc

    def facts(self, worker):  # DaskExecutor.facts: a Dask call too
        return self.run_on(worker, None, timeout=120, gpu=False)

    def restart(self, worker):
        self.restarted.append(worker)


_SOFTMAX = ("softmax", (64, 64), "float16", {})


@pytest.mark.parametrize(
    ("exc", "said", "restarted"),
    [
        (TimeoutError("GPU worker fake-gpu0 did not answer within 60 s"), "did not answer within 60 s", True),
        (WorkerDied("GPU worker fake-gpu0 died while running a task"), "died (it was replaced)", True),
        (RuntimeError("ncu is not installed"), "RuntimeError: ncu is not installed", False),
    ],
)
def test_a_worker_that_hangs_or_dies_while_profiling_is_replaced(tmp_path, exc, said, restarted):
    """A profile's task past worker_answer_timeout_s left the worker's one thread busy with it, and the worker was
    not restarted (a batch's timeout restarts it): every later task of the job queued behind the hung one."""
    executor = _Raises(exc, Settings(database_url=f"sqlite:///{tmp_path}/p.db", worker_answer_timeout_s=60))
    candidate = Space(get_op("softmax"), "float16").candidates[0]
    profile = executor.evaluator("fake-gpu0").profile(*_SOFTMAX, candidate)
    assert said in profile["error"]  # a profile is optional: its failure is data, not the job's end
    # A hung or dead process is this variant's failure: the search profiles its next leader. Anything else may
    # be the profiler's (ncu missing), which stops the search's profiling.
    assert profile.get("unavailable", True) is (not restarted)
    assert executor.restarted == (["fake-gpu0"] if restarted else [])


@pytest.mark.parametrize("call", ["evaluate", "baseline_ms"])
def test_a_gpu_unavailable_in_the_worker_restarts_it(tmp_path, call):
    """GpuUnavailable raised in the worker (its CUDA context poisoned) sent the job back to the queue and benched the
    worker, but left its process as it was: after the bench it failed every job it took, the same way."""
    from kernelmill.kernels.device import GpuUnavailable
    from kernelmill.service.executor import WorkerGone

    settings = Settings(database_url=f"sqlite:///{tmp_path}/g.db")
    args = [Space(get_op("softmax"), "float16").candidates[:2]] if call == "evaluate" else []
    poisoned = _Raises(GpuUnavailable("a kernel faulted and left this process's CUDA context unusable"), settings)
    with pytest.raises(GpuUnavailable, match="context unusable"):  # the job still goes back to the queue
        getattr(poisoned.evaluator("fake-gpu0"), call)(*_SOFTMAX, *args)
    assert poisoned.restarted == ["fake-gpu0"]
    lost = _Raises(WorkerGone("lost the scheduler while GPU worker fake-gpu0 ran a task"), settings)
    with pytest.raises(WorkerGone):  # the service's own verdict: no process of the worker is known to be at fault
        getattr(lost.evaluator("fake-gpu0"), call)(*_SOFTMAX, *args)
    assert lost.restarted == []


@pytest.mark.parametrize(
    ("exc", "said"),
    [
        (TimeoutError("GPU worker fake-gpu0 did not answer within 120 s"), "did not answer"),
        (WorkerDied("GPU worker fake-gpu0 died while running a task"), "died"),
    ],
)
def test_a_worker_that_hangs_or_dies_while_telling_its_gpu_is_replaced(tmp_path, exc, said):
    """A worker whose process was stuck in a task before (one the service, restarted, no longer waits for) did not
    answer the facts of the next job: benched without a restart, it failed every job it was given, one a bench."""
    from kernelmill.service.executor import WorkerGone

    executor = _Raises(exc, Settings(database_url=f"sqlite:///{tmp_path}/f.db"))
    with pytest.raises(WorkerGone, match=f"GPU worker fake-gpu0 {said} while telling its GPU"):
        executor.evaluator("fake-gpu0").facts()
    assert executor.restarted == ["fake-gpu0"]


class _Scripted(_Raises):
    """One fake GPU worker whose Dask calls raise, or run on the fake GPU (None), in turn."""

    def __init__(self, outcomes: list, settings: Settings) -> None:
        super().__init__(RuntimeError("not scripted"), settings)
        self.outcomes = outcomes

    def run_on(self, worker, fn, *args, timeout, gpu=True):
        outcome = self.outcomes.pop(0)
        if outcome is not None:
            raise outcome
        candidates = [Candidate(family, params) for family, params in args[4]]
        return self._evaluators[worker].evaluate(*args[:4], candidates)


def test_a_worker_lost_while_a_killed_batch_runs_again_alone_keeps_what_was_found(tmp_path):
    """A batch that killed its worker runs again one candidate at a time; a worker lost meanwhile (the restart limit
    reached, the scheduler gone) raised out of the whole batch: the faults found were never recorded, and the
    candidate that kills its process ran again, and killed again, wherever the job resumed."""
    from types import SimpleNamespace

    from distributed import KilledWorker

    from kernelmill.agents.evaluator import SKIPPED
    from kernelmill.service.executor import WorkerGone

    settings = Settings(database_url=f"sqlite:///{tmp_path}/k.db")
    batch = Space(get_op("softmax"), "float16").candidates[:3]
    killed = KilledWorker("task_evaluate-1", SimpleNamespace(address="tcp://127.0.0.1:9"), 0)
    executor = _Scripted([killed, killed, WorkerGone("GPU worker fake-gpu0 was restarted 5 times")], settings)
    results = executor.evaluator("fake-gpu0").evaluate(*_SOFTMAX, batch)
    assert [r.status for r in results] == ["fault", SKIPPED, SKIPPED]  # the loop runs the skipped ones later
    assert [(r.family, r.params) for r in results] == [(c.family, c.params) for c in batch]
    assert results[1].reason == "GPU worker fake-gpu0 was lost before this candidate ran"
    executor = _Scripted([killed, WorkerGone("lost the scheduler")], settings)
    with pytest.raises(WorkerGone, match="lost the scheduler"):  # nothing found: the job goes back to the queue
        executor.evaluator("fake-gpu0").evaluate(*_SOFTMAX, batch)


def test_a_batch_that_kills_its_worker_is_not_run_again_where_the_scheduler_retries(executor, crash_family_key):
    """A scheduler started without DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES=0 (a plain `dask scheduler`, which
    `serve --scheduler` and `kernelmill worker` join) retries a task whose worker died: pinned to the dead process,
    it waited, and the poll took it for one that never ran, sent it to the fresh process, which the kernel killed
    again, until worker_answer_timeout_s; then every candidate of the batch was recorded as a timeout."""
    executor.cluster.scheduler.allowed_failures = 3  # Dask's default
    executor.settings = executor.settings.model_copy(update={"worker_answer_timeout_s": 20})
    evaluator = executor.evaluator(GPU0)
    space = Space(get_op("softmax"), "float16")
    other = next(c for c in space.candidates[:8] if c != crash_family_key)
    results = evaluator.evaluate("softmax", (64, 64), "float16", {}, [crash_family_key, other])
    assert [r.status for r in results][0] == "fault" and "died" in results[0].reason
    assert results[1].status != "fault" and results[1].status != "timeout", results[1].reason


def test_kernelmill_worker_joins_its_scheduler_again_after_it_restarts(monkeypatch):
    """Dask's workers close when their scheduler's connection breaks: `kernelmill worker` then returned, and after a
    scheduler restart its GPUs never joined again (jobs stayed queued, "no GPU worker has joined the scheduler")."""
    import asyncio

    from distributed import Scheduler

    from kernelmill.service.executor import run_workers

    monkeypatch.setenv("KERNELMILL_FAKE_DEVICE", "1")

    async def joined(scheduler, workers) -> None:
        deadline = time.monotonic() + 60
        while not scheduler.workers or scheduler._starting_nannies:  # the nanny's start done too
            assert not workers.done(), "kernelmill worker returned"
            assert time.monotonic() < deadline, "no GPU worker joined"
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        first = await Scheduler(host="127.0.0.1", port=0, dashboard=False, dashboard_address="127.0.0.1:0")
        address = first.address
        workers = asyncio.ensure_future(run_workers(address, gpus=1))
        try:
            await joined(first, workers)
            await first.close()
            port = int(address.rsplit(":", 1)[1])
            again = await Scheduler(host="127.0.0.1", port=port, dashboard=False, dashboard_address="127.0.0.1:0")
            try:
                await joined(again, workers)
                assert [w.name for w in again.workers.values()] == [f"{socket.gethostname()}-gpu0"]
            finally:
                workers.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await workers
                await again.close()
        finally:
            workers.cancel()

    asyncio.run(scenario())


def test_a_frozen_scheduler_does_not_hang_the_listing_of_the_workers(tmp_path, monkeypatch):
    """A scheduler process that is frozen (SIGSTOP, swapping) keeps its TCP connections open: the listing of the
    workers (the job runner's poll, /api/workers, /api/health) and a batch's poll waited for its answer for as long
    as it stayed frozen, with no timeout anywhere. Now the listing is empty after a bounded wait and says why."""
    import signal
    import subprocess
    import sys
    import threading

    from kernelmill.service import executor as executor_module

    monkeypatch.setattr(executor_module, "_SCHEDULER_ANSWER_S", 1.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port),
           "--no-dashboard"]  # fmt: skip
    scheduler = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    executor = None
    try:
        address = f"tcp://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while executor is None:
            try:
                executor = DaskExecutor(Settings(database_url=f"sqlite:///{tmp_path}/f.db", scheduler=address))
            except OSError:
                assert time.monotonic() < deadline, "the scheduler did not start"
                time.sleep(0.2)
        assert executor.workers() == []
        scheduler.send_signal(signal.SIGSTOP)
        listed = threading.Event()
        threading.Thread(target=lambda: (executor.workers(), listed.set()), daemon=True).start()
        assert listed.wait(10), "the listing waited on the frozen scheduler"
        assert executor.why_none() == f"the scheduler at {address} did not answer within 1 s"
        with pytest.raises(executor_module.WorkerGone, match="did not answer within 1 s"):
            executor.run_on("gpu0", time.sleep, 1, timeout=5)
    finally:
        scheduler.send_signal(signal.SIGCONT)
        if executor is not None:
            executor.close()
        scheduler.terminate()
        scheduler.wait(10)


def test_a_host_without_gpus_says_at_start_that_jobs_stay_queued(monkeypatch, tmp_path, caplog):
    # kernelmill serve on a CPU machine printed only "serving on ...": that no job would run was told by
    # /api/workers, the dashboard and tune alone, not in the service's own log.
    from kernelmill.service import executor as executor_module

    monkeypatch.setattr(executor_module, "count_gpus", lambda: (0, "nvidia-smi lists no GPU"))
    caplog.set_level("INFO", logger="kernelmill.service.executor")
    ex = DaskExecutor(Settings(database_url=f"sqlite:///{tmp_path}/d.db"))
    try:
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert warned == ["no GPU on this host (nvidia-smi lists no GPU); jobs stay queued until a GPU worker joins"]
        assert ex.why_none() == warned[0]
    finally:
        ex.close()


@contextlib.contextmanager
def _scheduler_and_worker(tmp_path, *worker_args: str, delay_s: str = "0.3"):
    """A `dask scheduler` (allowed-failures 0, as docker/compose.yaml starts it) and a `kernelmill worker` of one fake
    GPU joining it, as processes; yields (executor of a service using that scheduler, the worker's process)."""
    import os
    import subprocess
    import sys

    stack = contextlib.ExitStack()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    env = {**os.environ, "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0"}
    cmd = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port),
           "--no-dashboard"]  # fmt: skip
    scheduler = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {**os.environ, "KERNELMILL_FAKE_DEVICE": "1", "KERNELMILL_FAKE_DELAY_S": delay_s}
    env.pop("KERNELMILL_FAKE_CRASH_ON", None)
    cmd = [sys.executable, "-m", "kernelmill", "worker", "--scheduler", address, "--gpus", "1", *worker_args]
    log = stack.enter_context((tmp_path / "worker.log").open("w"))  # a pipe left unread would fill and block it
    worker = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    executor = None
    try:
        deadline = time.monotonic() + 60
        while executor is None or not executor.worker_names():
            assert worker.poll() is None, (tmp_path / "worker.log").read_text()
            assert time.monotonic() < deadline, "the worker did not join"
            with contextlib.suppress(OSError):  # the scheduler not listening yet
                executor = executor or DaskExecutor(
                    Settings(database_url=f"sqlite:///{tmp_path}/s.db", scheduler=address, worker_answer_timeout_s=20)
                )
            time.sleep(0.2)
        yield executor, worker
    finally:
        if executor is not None:
            executor.close()
        for proc in (worker, scheduler):
            proc.kill()
            proc.wait(10)
        stack.close()


def _sigterm_once_it_runs(executor, worker) -> None:
    import signal
    import threading

    def watch() -> None:
        deadline = time.monotonic() + 30
        while not any(executor.client.processing().values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        worker.send_signal(signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()


def test_sigterm_on_kernelmill_worker_lets_its_batch_in_flight_finish(tmp_path):
    """`docker stop` sends SIGTERM: `kernelmill worker` died at once, the scheduler took its process for one that
    crashed, and the service ran the batch again one candidate at a time, as after a kernel that kills its process.
    Now the batch in flight finishes and is recorded, then the worker closes and exits 0."""
    with _scheduler_and_worker(tmp_path) as (executor, worker):
        name = executor.worker_names()[0]
        batch = Space(get_op("softmax"), "float16").candidates[:4]
        _sigterm_once_it_runs(executor, worker)
        results = executor.evaluator(name).evaluate("softmax", (64, 64), "float16", {}, batch)
        assert all(r.status != "fault" and "died" not in (r.reason or "") for r in results), results
        assert worker.wait(30) == 0
        assert "stopped (SIGTERM)" in (tmp_path / "worker.log").read_text()


def test_sigterm_past_the_grace_hands_the_batch_back(tmp_path, monkeypatch):
    """A batch still running when the grace ends is handed back: the job goes back to the queue (WorkerGone), its
    candidates are not blamed for a death, nor run again one by one."""
    from kernelmill.service import executor as executor_module

    monkeypatch.setattr(executor_module, "_REJOIN_WAIT_S", 1.0)
    with _scheduler_and_worker(tmp_path, "--stop-grace", "0", delay_s="1") as (executor, worker):
        name = executor.worker_names()[0]
        batch = Space(get_op("softmax"), "float16").candidates[:20]  # 20 s
        _sigterm_once_it_runs(executor, worker)
        start = time.monotonic()
        with pytest.raises(executor_module.WorkerGone, match=f"no process of GPU worker {name} joined"):
            executor.evaluator(name).evaluate("softmax", (64, 64), "float16", {}, batch)
        assert time.monotonic() - start < 15
        assert worker.wait(30) == 0
        assert "it is handed back" in (tmp_path / "worker.log").read_text()


def test_a_batch_past_a_timeout_under_10_s_says_it_with_its_tenth(tmp_path):
    """worker_answer_timeout_s=0.5 was recorded as "did not answer within 0 s"."""
    settings = Settings(database_url=f"sqlite:///{tmp_path}/t.db", worker_answer_timeout_s=0.5)
    executor = _Raises(TimeoutError("GPU worker fake-gpu0 did not answer within 0.5 s"), settings)
    results = executor.evaluator("fake-gpu0").evaluate(*_SOFTMAX, Space(get_op("softmax"), "float16").candidates[:1])
    assert [(r.status, r.reason) for r in results] == [
        ("timeout", "the worker did not answer within 0.5 s (it was replaced)")
    ]
    profile = executor.evaluator("fake-gpu0").profile(*_SOFTMAX, Space(get_op("softmax"), "float16").candidates[0])
    assert profile["error"] == "profiling failed: GPU worker fake-gpu0 did not answer within 0.5 s (it was replaced)"


def test_a_gpu_worker_that_fails_to_start_says_why_and_the_others_run_on(monkeypatch, caplog):
    """`kernelmill worker` ended for every GPU with only "Nanny failed to start." where one GPU's worker could not
    start (here the scheduler refuses its name, which a worker of another host of the same name holds)."""
    import asyncio
    import logging

    from distributed import Scheduler

    from kernelmill.service.executor import GpuWorkerFailed, run_workers

    monkeypatch.setenv("KERNELMILL_FAKE_DEVICE", "1")
    refused = f"GPU worker {GPU0} failed to start: the scheduler refused it: name taken, {GPU0}"

    async def registered(scheduler, n: int) -> None:
        deadline = time.monotonic() + 60
        while len(scheduler.workers) < n or scheduler._starting_nannies:
            assert time.monotonic() < deadline, "no GPU worker joined"
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        scheduler = await Scheduler(host="127.0.0.1", port=0, dashboard=False, dashboard_address="127.0.0.1:0")
        first = asyncio.ensure_future(run_workers(scheduler.address, gpus=1))
        second = None
        try:
            await registered(scheduler, 1)
            with pytest.raises(GpuWorkerFailed) as failed:  # its only GPU: the command ends, saying why
                await run_workers(scheduler.address, gpus=1)
            assert str(failed.value) == refused
            second = asyncio.ensure_future(run_workers(scheduler.address, gpus=2))
            await registered(scheduler, 2)  # its gpu1 serves, though its gpu0 was refused
            assert sorted(w.name for w in scheduler.workers.values()) == [GPU0, GPU1]
            assert not second.done()
        finally:
            for task in (first, second):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, GpuWorkerFailed):
                        await task
            await scheduler.close()

    with caplog.at_level(logging.ERROR, logger="kernelmill.service.executor"):
        asyncio.run(scenario())
    assert f"{refused}; the other GPUs' workers run on" in caplog.text
