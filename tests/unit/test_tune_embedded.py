"""`kernelmill tune` without a server (client.tune_embedded) on a fake GPU: the job is leased to the process
while it runs, so a service on the same database leaves it alone, and it never stays "running" after an
error; a fault that poisons the process's context ends it "failed", saying so."""

from __future__ import annotations

import pytest
from rich.console import Console

from kernelmill import client
from kernelmill.agents import evaluator as evaluators
from kernelmill.kernels.device import GpuUnavailable
from kernelmill.service.db.store import Store
from kernelmill.settings import Settings

FIELDS = {
    "op": "softmax",
    "shapes": [[256, 1024]],
    "dtype": "float16",
    "attrs": {},
    "families": None,
    "strategy": "random",
    "budget_trials": 12,
    "budget_seconds": 60.0,
}


class Watched(evaluators.FakeEvaluator):
    """The fake GPU, with what a service's runner on the same database would find at each batch."""

    def __init__(self, url: str, fail_at: int | None = None, error: BaseException | None = None) -> None:
        super().__init__(fail_every=0)
        self.store, self.fail_at, self.error, self.batches, self.lapsed = Store(url), fail_at, error, 0, []

    def evaluate(self, op, shape, dtype, attrs, candidates):
        self.batches += 1
        self.lapsed.append([j.id for j in self.store.lapsed_jobs()])
        if self.batches == self.fail_at:
            raise self.error
        return super().evaluate(op, shape, dtype, attrs, candidates)


@pytest.fixture
def run(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/km.db"
    settings = Settings(database_url=url, batch_size=4)

    def start(**watched):
        fake = Watched(url, **watched)
        monkeypatch.setattr(evaluators, "LocalEvaluator", lambda *args: fake)
        console = Console(record=True, width=200)
        return fake, lambda: client.tune_embedded(settings, dict(FIELDS), console), console, Store(url)

    return start


def test_a_job_run_here_is_leased_to_this_process_and_not_taken_over(run):
    fake, tune, _, store = run()
    out = tune()
    assert out["state"] == "done" and fake.batches == 3
    assert fake.lapsed == [[], [], []]  # a service's runner would not have requeued it at any batch
    job = store.get_job(out["id"])
    assert job.runner.startswith("tune@") and job.lease_until is not None


def test_a_poisoned_context_ends_the_job_failed_with_the_trials_kept(run):
    _, tune, console, store = run(fail_at=2, error=GpuUnavailable("a kernel faulted and left this process's context"))
    out = tune()
    assert out["state"] == "failed" and store.list_trials(out["id"])[1] == 4  # the first batch's
    assert "stopped: a kernel faulted" in store.get_job(out["id"]).error
    assert "stopped: a kernel faulted" in console.export_text()


def test_any_other_error_ends_the_job_failed_not_running(run):
    _, tune, _, store = run(fail_at=1, error=RuntimeError("the evaluator broke"))
    with pytest.raises(RuntimeError, match="the evaluator broke"):
        tune()
    (job,) = store.list_jobs()[0]
    assert job.state == "failed" and job.error == "RuntimeError: the evaluator broke"


def test_no_nvcc_here_ends_the_job_failed_saying_so_not_with_a_compile_error_a_trial(run):
    from kernelmill.kernels.compile import NvccMissing

    _, tune, console, store = run(fail_at=2, error=NvccMissing("nvcc not found (/nonexistent/nvcc)"))
    out = tune()
    assert out["state"] == "failed" and store.list_trials(out["id"])[1] == 4
    assert store.get_job(out["id"]).error.startswith("stopped: nvcc not found (/nonexistent/nvcc)")
    assert "stopped: nvcc not found" in console.export_text()


def test_the_database_is_named_without_its_password(tmp_path, monkeypatch):
    """The line naming where the job is recorded showed KERNELMILL_DATABASE_URL whole, PostgreSQL password and
    all, in the terminal (and a CI log)."""
    from kernelmill.service.db import store as store_module

    url = f"sqlite:///{tmp_path}/km.db"
    monkeypatch.setattr(store_module, "Store", lambda _url: Store(url))  # the job on SQLite all the same
    monkeypatch.setattr(evaluators, "LocalEvaluator", lambda *args: Watched(url))
    settings = Settings(database_url="postgresql://kernelmill:hunter2@db.internal/kernelmill", batch_size=4)
    console = Console(record=True, width=200)
    assert client.tune_embedded(settings, dict(FIELDS), console)["state"] == "done"
    text = console.export_text()
    assert "hunter2" not in text and "recorded in postgresql://kernelmill:***@db.internal/kernelmill" in text
