"""JobRunner.stop: running jobs stop at their next batch and are queued again; their threads are joined,
within the timeout even when a batch never returns."""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime

import pytest

from kernelmill.agents.evaluator import FakeEvaluator, TrialResult
from kernelmill.kernels.compile import NvccMissing
from kernelmill.kernels.device import GpuUnavailable
from kernelmill.kernels.ops import get_op
from kernelmill.service.db.store import Store
from kernelmill.service.executor import FakeExecutor
from kernelmill.service.jobs import JobRunner
from kernelmill.settings import Settings


@pytest.fixture
def store(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/runner.db")
    yield store
    store.close()


_JOB = dict(
    op="softmax", shapes=[[1024, 1024]], dtype="float16", attrs={}, strategy="random",
    budget_trials=400, budget_seconds=600.0,
)  # fmt: skip


def softmax_job(store: Store, trials: int = 400):
    return store.create_job(**{**_JOB, "budget_trials": trials})


def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_database_outage_is_said_once_not_a_traceback_a_poll(store, monkeypatch, caplog):
    """The poll (every 0.5 s) logged a traceback each time while a database server was away: 120 a minute."""
    from sqlalchemy.exc import OperationalError

    runner = JobRunner(store, FakeExecutor(1), Settings(database_url=store.url), poll_s=0.01)
    polls, answering = [], store.jobs_in_state

    def away(*states):
        polls.append(states)
        raise OperationalError("SELECT", {}, Exception("server closed the connection unexpectedly"))

    monkeypatch.setattr(store, "jobs_in_state", away)
    with caplog.at_level(logging.INFO, logger="kernelmill.service.jobs"):
        runner.start()
        try:
            wait_for(lambda: len(polls) >= 5)
            monkeypatch.setattr(store, "jobs_in_state", answering)
            wait_for(lambda: "answers again" in caplog.text)
        finally:
            runner.stop()
    said = [r for r in caplog.records if "database" in r.getMessage()]
    assert [r.levelname for r in said] == ["WARNING", "INFO"] and not any(r.exc_info for r in said)
    assert "unavailable (server closed the connection unexpectedly)" in said[0].getMessage()


def test_stop_joins_job_threads_and_queues_their_jobs_again(store, tmp_path):
    settings = Settings(database_url=store.url, batch_size=2)
    runner = JobRunner(store, FakeExecutor(1, delay_s=0.02), settings, poll_s=0.05)
    job = softmax_job(store)
    runner.start()
    wait_for(lambda: len(store.trials(job.id)) >= 4)
    threads = list(runner._running.values())
    assert len(threads) == 1

    started = time.monotonic()
    runner.stop(timeout_s=10)
    assert time.monotonic() - started < 5  # a batch is two 20 ms trials: it stops at the next one
    assert not threads[0].is_alive() and not any(t.is_alive() for t in runner._threads)
    stopped = store.get_job(job.id)
    assert stopped.state == "queued" and not stopped.cancel_requested  # not cancelled, not failed: resumes
    recorded = len(store.trials(job.id))
    assert 4 <= recorded < 400

    again = JobRunner(store, FakeExecutor(1), Settings(database_url=store.url, batch_size=50), poll_s=0.05)
    again.start()
    try:
        wait_for(lambda: store.get_job(job.id).state == "done", 60)
    finally:
        again.stop()
    assert len(store.trials(job.id)) > recorded


def test_a_job_cancelled_as_the_service_stops_ends_cancelled_not_queued_again(store):
    """The stop and the user's cancel both end the loop at its next batch: the cancel wins, or the job would
    run again at the next start."""
    runner = JobRunner(store, FakeExecutor(1, delay_s=0.05), Settings(database_url=store.url, batch_size=2), 0.05)
    job = softmax_job(store)
    runner.start()
    wait_for(lambda: len(store.trials(job.id)) >= 2)
    store.request_cancel(job.id)
    runner.stop(timeout_s=10)
    assert store.get_job(job.id).state == "cancelled"


class _StuckEvaluator(FakeEvaluator):
    """A batch that does not return until released (a hung GPU task)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def evaluate(self, op, shape, dtype, attrs, candidates):
        self.entered.set()
        self.release.wait(30)
        return super().evaluate(op, shape, dtype, attrs, candidates)


def test_stop_is_bounded_when_a_batch_hangs(store, caplog):
    executor = FakeExecutor(1)
    stuck = executor._evaluators["fake-gpu0"] = _StuckEvaluator()
    runner = JobRunner(store, executor, Settings(database_url=store.url), poll_s=0.05)
    job = softmax_job(store)
    runner.start()
    try:
        assert stuck.entered.wait(20)
        with caplog.at_level(logging.WARNING, logger="kernelmill.service.jobs"):
            started = time.monotonic()
            runner.stop(timeout_s=0.3)
            assert time.monotonic() - started < 2
        assert f"job-{job.id} still running" in caplog.text
    finally:
        stuck.release.set()
    wait_for(lambda: store.get_job(job.id).state == "queued")  # the batch returned: recorded, then queued
    wait_for(lambda: not runner._running)
    assert store.trials(job.id)


def test_a_job_for_another_arch_waits_for_a_worker_of_that_arch_and_says_so_once(store, caplog):
    executor = FakeExecutor(1)  # one sm_90 worker
    runner = JobRunner(store, executor, Settings(database_url=store.url, batch_size=8), poll_s=0.02)
    ampere = store.create_job(**{**_JOB, "arch": "sm_80"})
    hopper = store.create_job(**{**_JOB, "arch": "sm_90", "budget_trials": 8})
    with caplog.at_level(logging.WARNING, logger="kernelmill.service.jobs"):
        runner.start()
        try:
            wait_for(lambda: store.get_job(hopper.id).state == "done")  # queued after the sm_80 job, run first
            time.sleep(0.2)  # several more polls
        finally:
            runner.stop()
    assert store.get_job(ampere.id).state == "queued" and not store.trials(ampere.id)
    said = [r.getMessage() for r in caplog.records if "waits" in r.getMessage()]
    assert said == [f"job {ampere.id} waits: no GPU worker has sm_80; the workers have sm_90"]


class _LosesItsGpu(FakeEvaluator):
    """A worker whose GPU goes away: ``facts`` or ``evaluate`` raise GpuUnavailable while ``gone`` is set."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where, self.gone, self.calls = where, threading.Event(), 0

    def facts(self):
        if self.where == "facts" and self.gone.is_set():
            raise GpuUnavailable("no CUDA device is visible")
        return super().facts()

    def evaluate(self, op, shape, dtype, attrs, candidates):
        self.calls += 1
        if self.where == "evaluate" and self.calls == 3:  # mid-job, after two recorded batches
            raise GpuUnavailable("CUDA driver unavailable: device lost")
        if self.where == "nvcc" and self.calls == 3:  # a worker with no nvcc: every trial a "compile_error" before
            raise NvccMissing("nvcc not found (/nonexistent/nvcc)")
        return super().evaluate(op, shape, dtype, attrs, candidates)


def _run_until_done(runner: JobRunner, store: Store, job_id: int, caplog) -> None:
    """Starts ``runner``, its warnings captured, until the job is done; then stops it."""
    with caplog.at_level(logging.WARNING, logger="kernelmill.service.jobs"):
        runner.start()
        try:
            wait_for(lambda: store.get_job(job_id).state == "done")
        finally:
            runner.stop()


@pytest.mark.parametrize("where", ["facts", "evaluate", "nvcc"])
def test_a_worker_whose_gpu_is_unavailable_is_benched_and_its_job_queued_again(store, caplog, where):
    executor = FakeExecutor(2)
    lost = executor._evaluators["fake-gpu0"] = _LosesItsGpu(where)
    lost.gone.set()
    runner = JobRunner(store, executor, Settings(database_url=store.url, batch_size=2), poll_s=0.02)
    runner.bench_s = 60.0
    job = softmax_job(store, trials=12)
    _run_until_done(runner, store, job.id, caplog)
    done = store.get_job(job.id)
    assert done.worker == "fake-gpu1" and done.error is None  # the other worker finished it
    assert len(store.trials(job.id)) == 12  # batches recorded before the GPU went stay: nothing twice
    said = [r.getMessage() for r in caplog.records if "cannot run" in r.getMessage()]
    error = "NvccMissing" if where == "nvcc" else "GpuUnavailable"
    assert len(said) == 1 and said[0].startswith(f"worker fake-gpu0 cannot run job {job.id} ({error}: ")
    assert "the worker gets no job for 60 s" in said[0]


class _SlowFacts(FakeEvaluator):
    """Reading the GPU's facts takes a while (on a GPU it measures copy and matrix speeds)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked, self.release = threading.Event(), threading.Event()

    def facts(self):
        self.asked.set()
        self.release.wait(30)  # until the test has cancelled (a fixed sleep let a late test thread lose the race)
        return super().facts()


def _runner_on(store, evaluator, trials: int = 8):
    """A runner whose one fake GPU worker is ``evaluator``, batches of 2, and a softmax job of ``trials``."""
    executor = FakeExecutor(1)
    executor._evaluators["fake-gpu0"] = evaluator
    return JobRunner(store, executor, Settings(database_url=store.url, batch_size=2), poll_s=0.02), softmax_job(
        store, trials=trials
    )


class _WrongEvaluator(FakeEvaluator):
    """Every kernel it runs gives a wrong result."""

    def evaluate(self, op, shape, dtype, attrs, candidates):
        return [TrialResult(c.family, c.params, "wrong_result", "planted", "sm_90") for c in candidates]


def test_a_job_none_of_whose_trials_verified_fails_saying_so(store):
    """It ended "done", with nothing served and no reason on the job."""
    runner, job = _runner_on(store, _WrongEvaluator(), trials=4)
    runner.start()
    try:
        wait_for(lambda: store.get_job(job.id).state not in ("queued", "running"))
    finally:
        runner.stop()
    ended = store.get_job(job.id)
    assert ended.state == "failed" and len(store.trials(job.id)) == 4
    assert ended.error.startswith("no trial verified, so nothing is served: 1024x1024: 4 trials: 4 wrong_result")


class _ClosedUnderEvaluator(_StuckEvaluator):
    """Its batch, once released, ends as the service stops: the executor closed under it (WorkerGone)."""

    def evaluate(self, op, shape, dtype, attrs, candidates):
        super().evaluate(op, shape, dtype, attrs, candidates)
        raise GpuUnavailable("the executor was closed under the batch")


def test_a_batch_cut_by_the_service_stopping_queues_the_job_without_blaming_the_worker(store, caplog):
    """The service stopping closed the executor under a batch: the job went back to the queue, rightly, but the
    log said the worker could not run it and benched it for 30 s."""
    evaluator = _ClosedUnderEvaluator()
    runner, job = _runner_on(store, evaluator)
    runner.start()
    try:
        assert evaluator.entered.wait(20)
        with caplog.at_level(logging.INFO, logger="kernelmill.service.jobs"):
            runner._stop.set()
            evaluator.release.set()
            runner.stop()
    finally:
        evaluator.release.set()
        runner.stop()
    assert store.get_job(job.id).state == "queued" and runner._benched == {}
    assert f"job {job.id} interrupted by the service stopping: queued again to resume" in caplog.text
    assert "cannot run job" not in caplog.text


def test_a_cancel_while_the_runner_reads_the_gpus_facts_wins(store):
    slow = _SlowFacts()
    runner, job = _runner_on(store, slow)
    runner.start()
    try:
        assert slow.asked.wait(10)
        assert store.request_cancel(job.id).state == "cancelled"  # claimed, not yet started
        slow.release.set()
        wait_for(lambda: not runner._running)
    finally:
        slow.release.set()
        runner.stop()
    after = store.get_job(job.id)
    assert after.state == "cancelled" and not store.trials(job.id)


def test_a_resumed_job_has_only_the_rest_of_its_time_budget(store):
    """budget.seconds spans restarts: a job that ran 11 of its 12 s before the service stopped gets 1 s more,
    not 12 (each batch's time is counted as it is recorded)."""
    runner = JobRunner(store, FakeExecutor(1, delay_s=0.05), Settings(database_url=store.url, batch_size=2), 0.02)
    job = store.create_job(**{**_JOB, "budget_trials": 400, "budget_seconds": 12.0})
    store.add_job_seconds(job.id, 11.0)  # what earlier starts used
    started = time.monotonic()
    runner.start()
    try:
        wait_for(lambda: store.get_job(job.id).state == "done", timeout_s=20)
    finally:
        runner.stop()
    took, done = time.monotonic() - started, store.get_job(job.id)
    assert 0 < len(store.trials(job.id)) < 400  # stopped by the budget, not the trial count (400 take 20 s)
    assert 12.0 <= done.seconds_used < 12.0 + took  # this start's time was added


def test_a_restart_ends_a_job_cancelled_before_the_stop_and_requeues_the_rest_without_their_gpu(store):
    """A cancel asked while the service ran, which the job never reached, is not lost by a restart; a job
    queued again to resume no longer shows the GPU it ran on."""
    cancelled, resumed = (store.create_job(**{**_JOB, "budget_trials": 400}) for _ in range(2))
    for job in (cancelled, resumed):
        store.start_job(job.id, "gpu0", "NVIDIA H200")
    store.request_cancel(cancelled.id)
    runner = JobRunner(store, FakeExecutor(0), Settings(database_url=store.url), poll_s=0.05)
    runner.start()
    runner.stop()
    ended, queued = store.get_job(cancelled.id), store.get_job(resumed.id)
    assert ended.state == "cancelled" and ended.finished_at is not None
    assert queued.state == "queued" and queued.worker is None and queued.device_name is None


def test_a_job_another_live_service_runs_is_left_alone_with_its_gpu_and_resumed_once_its_lease_lapses(store):
    """Two services on one database (a second ``serve``, an API replica): neither requeues the other's running
    jobs nor gives the other's GPU a job; a job whose service died is resumed once its lease lapses."""
    held, waiting = softmax_job(store, trials=8), softmax_job(store, trials=8)
    store.start_job(held.id, "fake-gpu0", "FakeGPU 0", runner="the-other-service", lease_s=60)
    runner = JobRunner(store, FakeExecutor(1), Settings(database_url=store.url, batch_size=2), poll_s=0.02)
    runner.lease_s = 0.3
    runner.start()
    try:
        time.sleep(0.5)  # polls, lease checks
        still = store.get_job(held.id)
        assert still.state == "running" and still.runner == "the-other-service" and not store.trials(held.id)
        assert store.get_job(waiting.id).state == "queued"  # fake-gpu0 is the other service's
        store.update_job(held.id, lease_until=datetime(2000, 1, 1))  # the other service died
        wait_for(lambda: store.get_job(held.id).state == store.get_job(waiting.id).state == "done")
    finally:
        runner.stop()
    resumed = store.get_job(held.id)
    assert resumed.runner == runner.name and 0 < len(store.trials(held.id)) <= 8


class _HeldUpEvaluator(FakeEvaluator):
    """Its second batch waits until released (a service held up past its lease, frozen or swapping)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls, self.entered, self.release = 0, threading.Event(), threading.Event()

    def evaluate(self, op, shape, dtype, attrs, candidates):
        self.calls += 1
        if self.calls == 2:
            self.entered.set()
            self.release.wait(30)
        return super().evaluate(op, shape, dtype, attrs, candidates)


def test_a_job_taken_over_while_a_batch_ran_stops_here_and_records_nothing_more(store, caplog):
    """A service held up past its lease went on running the job another service had taken over: both ran it,
    60 trials recorded against a budget of 40 and its time counted twice."""
    held_up = _HeldUpEvaluator()
    runner, job = _runner_on(store, held_up, trials=40)
    runner.start()
    try:
        assert held_up.entered.wait(20)
        recorded, used = len(store.trials(job.id)), store.get_job(job.id).seconds_used
        assert recorded == 2  # the first batch's
        store.update_job(job.id, runner="the-other-service")  # its lease lapsed and the other service took it
        with caplog.at_level(logging.WARNING, logger="kernelmill.service.jobs"):
            held_up.release.set()
            wait_for(lambda: not runner._running)
    finally:
        held_up.release.set()
        runner.stop()
    assert held_up.calls == 2  # no batch after the one it was in
    after = store.get_job(job.id)
    assert len(store.trials(job.id)) == recorded and after.seconds_used == used
    assert after.state == "running" and after.runner == "the-other-service"  # neither ended nor queued by this one
    assert f"job {job.id} stopped here: its lease lapsed" in caplog.text
    assert "trials of 1024x1024 not recorded: this runner no longer holds the job" in caplog.text


def test_a_runner_never_takes_its_own_running_job_for_lapsed(store):
    """A poll that stalled past the lease between renewing and recovering found the runner's own running job
    lapsed and queued it again: it then started a second time beside itself."""
    held_up = _HeldUpEvaluator()
    runner, job = _runner_on(store, held_up)
    runner.start()
    try:
        assert held_up.entered.wait(20)
        store.update_job(job.id, lease_until=datetime(2000, 1, 1))  # as found after the stall
        runner._recover()
        assert store.get_job(job.id).state == "running" and store.get_job(job.id).runner == runner.name
        held_up.release.set()
        wait_for(lambda: store.get_job(job.id).state == "done")
    finally:
        held_up.release.set()
        runner.stop()
    assert len(store.trials(job.id)) == 8


def test_a_running_job_keeps_its_lease_and_gets_no_second_start(store):
    """The runner renews the leases of its jobs: a job running longer than a lease is never taken as lapsed."""
    runner = JobRunner(store, FakeExecutor(1, delay_s=0.05), Settings(database_url=store.url, batch_size=2), 0.02)
    runner.lease_s = 0.3
    job = softmax_job(store, trials=40)  # about 1 s: several leases
    starts, recovered, leases = [], [], []
    start_job, recover_lapsed = store.start_job, store.recover_lapsed
    store.start_job = lambda job_id, *args: starts.append(job_id) or start_job(job_id, *args)
    store.recover_lapsed = lambda job_id: recovered.append(job_id) or recover_lapsed(job_id)

    def done() -> bool:
        now = store.get_job(job.id)
        if now.state == "running":
            leases.append(now.lease_until)
        return now.state == "done"

    runner.start()
    try:
        wait_for(done)
    finally:
        runner.stop()
    assert starts == [job.id] and recovered == []  # started once, never taken for lapsed
    assert len(leases) > 1 and max(leases) > min(leases)  # renewed while it ran
    assert store.lapsed_jobs() == [] and len(store.trials(job.id)) == 40


class _StallingExecutor(FakeExecutor):
    """Its workers() blocks while ``stalled`` is set (a Dask scheduler slow to answer), until ``resume``."""

    def __init__(self) -> None:
        super().__init__(1, delay_s=0.05)
        self.stalled, self.resume = threading.Event(), threading.Event()

    def workers(self):
        if self.stalled.is_set():
            self.resume.wait(30)
        return super().workers()


def test_a_poll_held_up_past_the_lease_does_not_let_running_jobs_leases_lapse(store):
    """Leases were renewed by the poll thread, between asking the executor for its workers: a Dask call that
    hung past the lease let the job running here lapse, and another service would take it over."""
    executor = _StallingExecutor()
    runner = JobRunner(store, executor, Settings(database_url=store.url, batch_size=2), poll_s=0.02)
    runner.lease_s = 1.0  # renewed every third of it: a stall of a whole lease would flake the test
    running = softmax_job(store, trials=400)
    runner.start()
    try:
        wait_for(lambda: store.get_job(running.id).state == "running")
        executor.stalled.set()
        softmax_job(store)  # queued: the next poll asks for workers, and hangs there
        time.sleep(3 * runner.lease_s)
        assert store.lapsed_jobs() == [] and store.holds(running.id, runner.name)
    finally:
        executor.resume.set()
        runner.stop()


def test_a_runner_started_again_after_a_stop_runs_jobs(store):
    """Its poll thread ended at once (the stop flag was never cleared): new jobs stayed queued for ever."""
    runner = JobRunner(store, FakeExecutor(1), Settings(database_url=store.url, batch_size=8), poll_s=0.02)
    runner.start()
    runner.stop()
    runner.start()
    try:
        job = store.create_job(**{**_JOB, "budget_trials": 8})
        wait_for(lambda: store.get_job(job.id).state == "done")
    finally:
        runner.stop()


def test_a_job_resumed_on_another_gpu_model_is_timed_and_served_on_that_model_alone(store):
    """Its first GPU's trials and PyTorch baseline were compared with the second's: a kernel timed on an H200
    was served for an H100 with an H200's speedup, and blocked that H100's own later kernels."""
    from kernelmill.agents.evaluator import TrialResult
    from kernelmill.service.jobs import StoreRecorder

    def trial(ms: float, block: int) -> TrialResult:
        return TrialResult("warp_row", {"BLOCK": block}, "ok", None, "sm_90", "vk", median_ms=ms, max_rel_err=1e-6)

    def served(family, params):
        return {"source": "// k", "launches": [], "workspace": {}}

    job = store.create_job(**{**_JOB, "budget_trials": 8})
    store.start_job(job.id, "w0", "NVIDIA H200", runner="a", lease_s=60)
    fast = StoreRecorder(store, job.id)
    fast.record_baseline("1024x1024", 0.050, "NVIDIA H200")
    fast.record("1024x1024", [trial(0.010, 1)])  # timed on the H200
    store.requeue_job(job.id, "a")
    store.start_job(job.id, "w1", "NVIDIA H100", runner="b", lease_s=60)
    resumed = StoreRecorder(store, job.id)
    assert resumed.baseline("1024x1024") == (False, None)  # the H200's PyTorch is not the H100's: timed again
    resumed.record_baseline("1024x1024", 0.080, "NVIDIA H100")
    resumed.record("1024x1024", [trial(0.030, 2)])
    resumed.publish_best("1024x1024", served)
    (kernel,), _ = store.list_kernels()
    assert (kernel.device_name, kernel.median_ms, kernel.params) == ("NVIDIA H100", 0.030, {"BLOCK": 2})
    assert kernel.baseline_ms == 0.080
    # A baseline of no recorded GPU model (rows from before the column) is the job's own: kept, not timed again.
    store.record_baseline(job.id, "4096x512", 0.2, None)
    assert resumed.baseline("4096x512") == (True, 0.2)


def test_a_best_trial_this_version_cannot_build_is_passed_over_for_the_next(store, caplog):
    """A job resumed past an upgrade that changed a family's knobs: its fastest trial, recorded before, raised
    KeyError as what to serve was built from it, and the job failed at its last step."""
    from kernelmill.agents.evaluator import TrialResult
    from kernelmill.agents.loop import served_fields
    from kernelmill.service.jobs import StoreRecorder

    current = get_op("softmax").family("warp_row").resolve({}, "float16")
    stale = {k: v for k, v in current.items() if k != "rows_per_block"}  # a knob this version added
    renamed = TrialResult("row_warp", current, "ok", None, "sm_90", "vk", median_ms=0.005, cubin=b"c0")
    old = TrialResult("warp_row", stale, "ok", None, "sm_90", "vk", median_ms=0.010, cubin=b"c1")
    kept = TrialResult("warp_row", current, "ok", None, "sm_90", "vk", median_ms=0.020, cubin=b"c2")
    job = store.create_job(**_JOB)
    store.record_trials(job.id, "1024x1024", [renamed.row(), old.row(), kept.row()])
    with caplog.at_level(logging.WARNING, logger="kernelmill.service.jobs"):
        StoreRecorder(store, job.id).publish_best("1024x1024", served_fields("softmax", (1024, 1024), "float16", {}))
    (kernel,), _ = store.list_kernels()
    assert (kernel.family, kernel.params, kernel.median_ms) == ("warp_row", current, 0.020)
    assert caplog.text.count("not served: this version cannot build it") == 2


def test_a_best_trial_built_from_code_this_version_no_longer_renders_is_passed_over(store, caplog):
    """A job resumed past an upgrade that changed a family's template but not its knobs: its fastest trial's
    cubin, built before, was served beside the source this version renders, and the runtime, finding that source
    its own, launched the old cubin with the new template's geometry. The served kernel now says what its cubin
    was built from."""
    from kernelmill.agents.evaluator import TrialResult
    from kernelmill.agents.loop import served_fields
    from kernelmill.kernels.render import code_digest
    from kernelmill.service.jobs import StoreRecorder

    build = served_fields("softmax", (1024, 1024), "float16", {})
    fast, slow = ({"BLOCK": 1}, {"BLOCK": 2})  # the fake served_fields below renders any params
    fields = {"source": "// kernelmill variant: x\nnew code", "launches": [], "workspace": {}}
    now = code_digest(fields["source"])

    def trial(params, ms, code, cubin):
        return TrialResult(
            "warp_row", params, "ok", None, "sm_90", "vk", code_sha256=code, median_ms=ms, cubin=cubin
        ).row()

    job = store.create_job(**_JOB)
    before = code_digest("// kernelmill variant: x\nold code")
    store.record_trials(job.id, "1024x1024", [trial(fast, 0.010, before, b"old"), trial(slow, 0.020, now, b"new")])
    with caplog.at_level(logging.WARNING, logger="kernelmill.service.jobs"):
        StoreRecorder(store, job.id).publish_best("1024x1024", lambda family, params: dict(fields))
    (kernel,), _ = store.list_kernels()
    served = store.kernel(kernel.id, with_cubin=True)
    assert (served.params, served.cubin, served.code_sha256) == (slow, b"new", now)
    assert "not served: its cubin was built from code this version's template no longer renders" in caplog.text
    # The knobs comment is no code: a trial recorded with other knobs in it (a parameter added since) is served.
    again = store.create_job(**{**_JOB, "shapes": [[2048, 2048]]})
    current = get_op("softmax").family("warp_row").resolve({}, "float16")
    source = build("warp_row", current)["source"]
    other_knobs = code_digest("// kernelmill variant: older knobs\n" + source.partition("\n")[2])
    store.record_trials(again.id, "2048x2048", [trial(current, 0.010, other_knobs, b"kept")])
    StoreRecorder(store, again.id).publish_best("2048x2048", build)
    assert store.best_kernel("softmax", (2048, 2048), "float16", None)[0].code_sha256 == other_knobs


def test_warm_starts_come_nearest_problem_first_from_this_arch_each_once(store):
    """Other jobs' best parameters: the same dtype and a close shape first, another dtype after, nothing
    tuned on another arch, and a candidate two jobs found best once."""
    from kernelmill.agents.evaluator import TrialResult
    from kernelmill.service.jobs import StoreRecorder

    def finished(shape, dtype, arch, block, ms=1.0):
        job = store.create_job(**{**_JOB, "shapes": [shape], "dtype": dtype, "arch": arch})
        key = "x".join(map(str, shape))
        fast = TrialResult("warp_row", {"BLOCK": block}, "ok", None, arch, "vk", median_ms=ms, cubin=b"c").row()
        slow = TrialResult("warp_row", {"BLOCK": block + 1}, "ok", None, arch, "vk", median_ms=ms * 2, cubin=b"c")
        store.record_trials(job.id, key, [fast, slow.row()])
        return job

    same = finished([1024, 1024], "float16", "sm_90", block=1)
    finished([1024, 1024], "float32", "sm_90", block=2)  # another dtype: 2 further
    finished([4096, 4096], "float16", "sm_90", block=3)
    finished([1024, 1024], "float16", "sm_80", block=4)  # another arch: never
    finished([2048, 1024], "float16", "sm_90", block=1)  # the same parameters again: once
    job = store.create_job(**{**_JOB, "arch": "sm_90"})
    warm = StoreRecorder(store, job.id).warm_start("1024x1024")
    assert [c.params["BLOCK"] for c in warm] == [1, 2, 3]  # distances 0, 2 (dtype), 2 x ln 4 = 2.77
    assert warm[0].note == f"warm start: best of softmax 1024x1024 float16 on ? (job {same.id})"
    assert len(StoreRecorder(store, job.id).warm_start("1024x1024", limit=2)) == 2
    # Another GPU model of the arch counts 0.5 further: this model's job at a shape ln(1300 / 1024) = 0.24 away
    # comes before the other model's at this very shape.
    store.update_job(job.id, device_name="NVIDIA H200")
    store.update_job(same.id, device_name="NVIDIA H100")
    near = finished([1300, 1024], "float16", "sm_90", block=7)
    store.update_job(near.id, device_name="NVIDIA H200")
    warm = StoreRecorder(store, job.id).warm_start("1024x1024")
    assert [c.params["BLOCK"] for c in warm][:2] == [7, 1]  # 0.24 against 0 + 0.5


def test_a_job_for_an_arch_waits_for_a_worker_of_that_arch():
    from kernelmill.service.jobs import no_worker_for, runs_on

    assert runs_on("auto", None) and runs_on(None, "sm_80") and runs_on("sm_90", "sm_90a")
    assert not runs_on("sm_90", None)  # a worker whose GPU is not known yet is not taken for one
    assert not runs_on("sm_80", "sm_90")
    job = {**_JOB, "arch": "sm_80", "families": None}
    assert no_worker_for(job, ["sm_90", "sm_90"]) == "no GPU worker has sm_80; the workers have sm_90"
    assert no_worker_for(job, ["sm_90", None]) is None  # one is not known yet: it may have it
    assert no_worker_for(job, []) is None and no_worker_for({**job, "arch": "auto"}, ["sm_90"]) is None


_WGMMA_JOB = dict(
    op="matmul", shapes=[[256, 256, 256]], dtype="float16", attrs={}, strategy="random", budget_trials=4,
    budget_seconds=600.0, arch="auto", families=["wgmma"],
)  # fmt: skip


def test_a_job_whose_families_run_on_one_gpu_alone_goes_to_a_worker_with_it(store, caplog):
    """wgmma runs on sm_90 alone: a job for any arch naming it alone was given the first idle worker, an sm_80,
    and failed there ("no variant ... runs at this shape on sm_80") while an sm_90 stood idle."""
    executor = FakeExecutor(2)
    executor.evaluator("fake-gpu0").arch = "sm_80"
    runner = JobRunner(store, executor, Settings(database_url=store.url), poll_s=0.02)
    job = store.create_job(**_WGMMA_JOB)
    _run_until_done(runner, store, job.id, caplog)
    assert store.get_job(job.id).worker == "fake-gpu1" and store.get_job(job.id).error is None


def test_a_job_whose_families_run_on_no_workers_gpu_waits_saying_why(store, caplog):
    from kernelmill.service.jobs import fits, no_worker_for

    executor = FakeExecutor(1)
    executor.evaluator("fake-gpu0").arch = "sm_80"
    runner = JobRunner(store, executor, Settings(database_url=store.url), poll_s=0.02)
    job = store.create_job(**_WGMMA_JOB)
    with caplog.at_level(logging.WARNING, logger="kernelmill.service.jobs"):
        runner.start()
        try:
            wait_for(lambda: "waits" in caplog.text)
            time.sleep(0.1)  # polls more: still queued, said once
        finally:
            runner.stop()
    said = "no GPU worker runs matmul float16 (wgmma) at 256x256x256; the workers have sm_80"
    assert store.get_job(job.id).state == "queued" and caplog.text.count(said) == 1
    # A GPU not known yet may run the default families, not a job naming its own; other families run on sm_80.
    assert not fits(job, None) and fits({**_WGMMA_JOB, "families": None}, None)
    assert fits({**_WGMMA_JOB, "families": ["tensorcore"]}, "sm_80")
    assert no_worker_for(job, ["sm_80", None]) is None and no_worker_for(job, ["sm_80", "sm_90"]) is None


def test_a_database_error_in_a_batch_queues_the_job_again_to_resume(store, caplog):
    """SQLite busy past its timeout (or a database server gone a while) as a batch was recorded ended the job
    failed for good, though the job had done nothing wrong."""
    from sqlalchemy.exc import OperationalError

    record_trials, calls = store.record_trials, []

    def busy_once(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise OperationalError("INSERT INTO trials", {}, Exception("database is locked"))
        return record_trials(*args, **kwargs)

    store.record_trials = busy_once
    runner = JobRunner(store, FakeExecutor(1), Settings(database_url=store.url, batch_size=2), poll_s=0.02)
    job = softmax_job(store, trials=8)
    _run_until_done(runner, store, job.id, caplog)
    assert f"job {job.id}: the database failed it (database is locked): queued again to resume" in caplog.text
    assert len(store.trials(job.id)) == 8 and store.get_job(job.id).error is None  # resumed to its full budget
