"""The store on every database it supports: SQLite always, PostgreSQL where configured (see conftest)."""

from __future__ import annotations

import threading
import time

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from kernelmill.agents.evaluator import TrialResult
from kernelmill.service.db.models import Trial
from kernelmill.service.db.store import MIGRATIONS, Store, downgrade, migrate, shape_key

TABLES = {"jobs", "trials", "baselines", "kernels", "devices"}


def head_revision() -> str:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return ScriptDirectory.from_config(cfg).get_current_head()


def alembic_version(store: Store) -> list[str]:
    with store.engine.connect() as conn:
        return [row[0] for row in conn.execute(text("SELECT version_num FROM alembic_version"))]


def tables(store: Store) -> set[str]:
    return set(inspect(store.engine).get_table_names())


def new_job(store: Store, op: str = "softmax", shapes=((1024, 1024),), **fields):
    return store.create_job(**new_job_fields(op, shapes, **fields))


def new_job_fields(op: str = "softmax", shapes=((1024, 1024),), **fields) -> dict:
    values = {
        "op": op,
        "shapes": [list(s) for s in shapes],
        "dtype": "float16",
        "attrs": {},
        "strategy": "random",
        "budget_trials": 16,
        "budget_seconds": 60.0,
    }
    values.update(fields)
    return values


def row(family: str, status: str = "ok", ms: float | None = 1.0, **params) -> dict:
    params = params or {"BLOCK": 256}
    if status != "ok":
        return TrialResult(family, params, status, f"planted {status}", "sm_90").row()
    return TrialResult(
        family,
        params,
        "ok",
        None,
        "sm_90",
        "vk",
        max_rel_err=1e-6,
        median_ms=ms,
        min_ms=ms,
        spread=0.01,
        reps=10,
        cubin=b"cubin-" + family.encode(),
    ).row()


def served(source: str = 'extern "C" __global__ void k() {}') -> dict:
    return {
        "source": source,
        "launches": [{"entry": "k", "grid": [1, 1, 1], "block": [128, 1, 1], "smem_bytes": 0, "args": []}],
        "workspace": {},
        "cubin": b"cubin",
        "baseline_ms": 2.0,
    }


def publish(store: Store, job, shape, ms: float, family: str = "rowwise", **params):
    """Record one verified trial of ``job`` at ``shape`` and publish it; returns what is served after."""
    key = shape_key(shape)
    added = store.record_trials(job.id, key, [row(family, ms=ms, **(params or {"BLOCK": int(ms * 1000)}))])
    trial = added[0] if added else store.best_trial(job.id, key)
    return store.publish(job, trial, served(f"// {family} {ms}"))


# -- migrations -----------------------------------------------------------------------------


def test_opening_applies_migrations_to_head(store):
    assert tables(store) >= TABLES
    assert alembic_version(store) == [head_revision()]
    # Opening again is a no-op: the schema is already at head, data is kept.
    job = new_job(store)
    again = Store(store.url)
    try:
        assert alembic_version(again) == [head_revision()]
        assert again.get_job(job.id).op == "softmax"
    finally:
        again.close()


def test_a_database_url_holding_a_percent_sign_opens(tmp_path):
    """Alembic's config read "%" as interpolation: "invalid interpolation syntax" for sqlite:///:memory:
    (rendered %3A) or a file or password with a "%" in it."""
    for url in ("sqlite:///:memory:", f"sqlite:///{tmp_path}/a%b.db"):
        opened = Store(url)
        try:
            assert alembic_version(opened) == [head_revision()]
        finally:
            opened.close()
    assert (tmp_path / "a%b.db").exists()


def test_downgrade_to_base_and_upgrade_again(store):
    new_job(store)
    downgrade(store.engine, "base")
    assert not (TABLES & tables(store))
    assert alembic_version(store) == []
    migrate(store.engine)
    assert tables(store) >= TABLES
    assert alembic_version(store) == [head_revision()]
    # A fresh schema: empty, and usable at once.
    assert store.list_jobs() == ([], 0)
    assert new_job(store).id >= 1


def test_a_downgrade_and_upgrade_keep_the_rows(store):
    """SQLite rebuilds a table to drop a column; with foreign keys on, dropping the old table deleted the
    trials and baselines pointing at it, and nulled the served kernels' links."""
    job = new_job(store)
    store.record_baseline(job.id, "1024x1024", 2.0, "FakeGPU")
    kernel = publish(store, job, (1024, 1024), 1.0)
    downgrade(store.engine, "0007")  # drops columns of jobs and trials (0008, 0009)
    with store.engine.connect() as conn:
        counted = {t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar() for t in ("trials", "baselines")}
        links = conn.execute(text("SELECT job_id, trial_id FROM kernels")).one()
    assert counted == {"trials": 1, "baselines": 1} and tuple(links) == (job.id, kernel.trial_id)
    migrate(store.engine)
    assert store.kernel(kernel.id).trial_id == kernel.trial_id and store.has_baseline(job.id, "1024x1024")
    with store.engine.connect() as conn:  # the keys are enforced again afterwards
        if store.engine.dialect.name == "sqlite":
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1


def test_every_revision_steps_down_and_up_again_with_rows_and_upgrades_to_the_models(store):
    """From head down to the first revision, each one step down and up again with rows in every table; then up
    to head from the first: the rows kept and the schema the models'."""
    from alembic.autogenerate import compare_metadata
    from alembic.config import Config
    from alembic.migration import MigrationContext

    from kernelmill.service.db.models import Base

    job = new_job(store)
    store.start_job(job.id, "w0", "NVIDIA H200", runner="a", lease_s=60)
    store.record_baseline(job.id, "1024x1024", 2.0, "NVIDIA H200")
    publish(store, job, (1024, 1024), 1.0)
    store.add_job_seconds(job.id, 1.0, "a")

    def counts() -> dict[str, int]:
        with store.engine.connect() as conn:
            names = ("jobs", "trials", "baselines", "kernels")
            return {t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar() for t in names}

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    revisions = [r.revision for r in ScriptDirectory.from_config(cfg).walk_revisions()]  # head first
    before = counts()
    for revision, below in zip(revisions, revisions[1:], strict=False):
        downgrade(store.engine, below)
        assert counts() == before, below
        migrate(store.engine, revision)
        assert alembic_version(store) == [revision] and counts() == before, revision
        downgrade(store.engine, below)
    migrate(store.engine)
    assert alembic_version(store) == [head_revision()] and counts() == before
    with store.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    assert store.get_job(job.id).op == "softmax" and store.best_kernel("softmax", (1024, 1024), "float16", None)


def test_a_database_newer_than_this_kernelmill_is_one_line(tmp_path):
    from kernelmill.service.db.store import DatabaseError

    url = f"sqlite:///{tmp_path}/newer.db"
    Store(url).close()
    with Store(url, migrate_on_open=False).engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0999'"))
    with pytest.raises(DatabaseError, match=r"Can't locate revision identified by '0999'.*newer kernelmill"):
        Store(url)


def test_another_apps_database_is_refused_and_left_as_it_was(tmp_path):
    """The first migration stopped at a table of the same name, and the tables it had made stayed (pysqlite runs
    DDL outside a transaction): each attempt changed the file, and the error named another table each time."""
    import sqlite3

    from kernelmill.service.db.store import DatabaseError

    path = tmp_path / "theirs.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE jobs (what TEXT)")
    for _ in range(2):
        with pytest.raises(
            DatabaseError, match=r"is not kernelmill's \(table jobs already exists\).*nothing was chang"
        ):
            Store(f"sqlite:///{path}")
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall() == [("jobs",)]


# -- jobs -----------------------------------------------------------------------------------


def test_jobs_create_list_filter_and_page(store):
    made = []
    for i in range(7):
        made.append(
            new_job(store, op="softmax" if i % 2 == 0 else "matmul", shapes=[(64, 64, 64)] if i % 2 else [(8, 8)])
        )
    store.update_job(made[1].id, state="running")
    store.finish_job(made[2].id, "done")
    store.finish_job(made[3].id, "failed", "boom")

    jobs, total = store.list_jobs()
    assert total == 7 and [j.id for j in jobs] == [j.id for j in reversed(made)]  # newest first
    assert jobs[-1].shapes == [[8, 8]] and jobs[-1].attrs == {} and jobs[-1].state == "queued"

    first, total = store.list_jobs(limit=3)
    second, _ = store.list_jobs(limit=3, offset=3)
    last, _ = store.list_jobs(limit=3, offset=6)
    assert total == 7 and len(first) == 3 and len(second) == 3 and len(last) == 1
    assert [j.id for j in first + second + last] == [j.id for j in reversed(made)]
    assert store.list_jobs(offset=50) == ([], 7)

    softmax, total = store.list_jobs(op="softmax")
    assert total == 4 and all(j.op == "softmax" for j in softmax)
    queued, total = store.list_jobs(state="queued")
    assert total == 4 and {j.id for j in queued} == {made[i].id for i in (0, 4, 5, 6)}
    both, total = store.list_jobs(state="queued", op="matmul", limit=1)
    assert total == 1 and both[0].id == made[5].id
    assert store.list_jobs(state="done", op="matmul") == ([], 0)

    failed = store.get_job(made[3].id)
    assert failed.state == "failed" and failed.error == "boom" and failed.finished_at is not None
    assert [j.id for j in store.jobs_in_state("running", "done")] == [made[1].id, made[2].id]
    assert store.get_job(10**6) is None


def test_cancel_queued_at_once_running_on_request(store):
    queued, running = new_job(store), new_job(store)
    store.start_job(running.id, "fake-gpu0", "FakeGPU 0")
    assert store.request_cancel(queued.id).state == "cancelled"
    assert store.request_cancel(running.id).state == "running"
    assert store.cancel_requested(running.id) and not store.cancel_requested(queued.id)
    with pytest.raises(KeyError):
        store.request_cancel(10**6)


def test_a_job_cancelled_before_it_starts_is_not_started(store):
    """The runner claims a queued job, then reads the GPU's facts; a cancel in between must win."""
    job = new_job(store)
    assert store.request_cancel(job.id).state == "cancelled"
    assert store.start_job(job.id, "fake-gpu0", "FakeGPU 0") is None
    after = store.get_job(job.id)
    assert after.state == "cancelled" and after.worker is None and after.finished_at is not None
    resumed = new_job(store)
    first = store.start_job(resumed.id, "fake-gpu0", "FakeGPU 0")
    store.update_job(resumed.id, state="queued")  # the service stopped: queued again
    again = store.start_job(resumed.id, "fake-gpu1", "FakeGPU 1")
    assert again.state == "running" and again.worker == "fake-gpu1" and again.started_at == first.started_at


def test_leases_a_lapsed_job_moves_once_and_a_live_one_not_at_all(store):
    """Running jobs are leased to their runner: only the owner renews; a lapsed lease (or none, rows from
    before leases) is recovered once (queued, or cancelled where a cancel was asked); a live one never."""
    live, lapsed, cancelling = new_job(store), new_job(store), new_job(store)
    store.start_job(live.id, "w0", "GPU", runner="a", lease_s=60)
    store.start_job(lapsed.id, "w1", "GPU", runner="b", lease_s=60)
    store.start_job(cancelling.id, "w2", "GPU")  # no lease
    store.request_cancel(cancelling.id)
    store.renew_leases("a", [lapsed.id], lease_s=-1)  # not a's job: unchanged
    assert [j.id for j in store.lapsed_jobs()] == [cancelling.id]
    store.renew_leases("b", [lapsed.id], lease_s=-1)  # b renews into the past: lapsed
    assert [j.id for j in store.lapsed_jobs()] == [lapsed.id, cancelling.id]
    assert store.workers_held("c") == {"w0"} and store.workers_held("a") == set()
    assert store.recover_lapsed(live.id) is None
    assert store.recover_lapsed(lapsed.id) == "queued" and store.recover_lapsed(lapsed.id) is None
    assert store.recover_lapsed(cancelling.id) == "cancelled"
    queued = store.get_job(lapsed.id)
    assert queued.state == "queued" and queued.runner is None and queued.lease_until is None and queued.worker is None
    assert store.get_job(cancelling.id).finished_at is not None
    assert store.get_job(live.id).state == "running"


def test_only_the_runner_holding_a_job_may_queue_it_again_or_end_it(store):
    """A runner whose lease lapsed (its stop outlived the wait) queued again, or ended, a job another runner
    had taken over: the job then ran twice at once and past its trial budget."""
    job = new_job(store)
    store.start_job(job.id, "w0", "GPU", runner="a", lease_s=60)
    store.renew_leases("a", [job.id], lease_s=-1)  # a's lease lapses (its poll thread was held up) ...
    assert store.recover_lapsed(job.id) == "queued"
    assert store.start_job(job.id, "w1", "GPU", runner="b", lease_s=60) is not None  # ... and b takes it
    assert store.requeue_job(job.id, "a") is False and store.finish_job(job.id, "done", runner="a") is False
    assert store.get_job(job.id).state == "running" and store.get_job(job.id).runner == "b"
    # Nor record trials or time for it: the job ran twice at once, past its trial budget, its time counted twice.
    assert not store.holds(job.id, "a") and store.holds(job.id, "b")
    assert store.record_trials(job.id, "1024x1024", [row("rowwise", BLOCK=128)], runner="a") is None
    assert store.add_job_seconds(job.id, 5.0, runner="a") is False
    assert not store.trials(job.id) and store.get_job(job.id).seconds_used == 0
    assert len(store.record_trials(job.id, "1024x1024", [row("rowwise", BLOCK=128)], runner="b")) == 1
    assert store.add_job_seconds(job.id, 5.0, runner="b") is True and store.get_job(job.id).seconds_used == 5.0
    assert store.finish_job(job.id, "done", runner="b") is True and store.get_job(job.id).state == "done"
    assert not store.holds(job.id, "b") and store.add_job_seconds(job.id, 1.0, runner="b") is False


def test_a_local_tune_s_job_is_created_running_and_leased(store):
    """``kernelmill tune`` created its job queued, then started it: a service on the database could take it
    in between, and both ran it."""
    job = store.create_running_job("embedded", "NVIDIA H200", "tune@host:1", 30.0, **new_job_fields())
    assert job.state == "running" and job.runner == "tune@host:1" and job.worker == "embedded"
    assert job.started_at is not None and job.lease_until > job.started_at
    assert store.jobs_in_state("queued") == [] and store.lapsed_jobs() == [] and store.holds(job.id, "tune@host:1")
    assert store.start_job(job.id, "w0", "GPU", runner="a", lease_s=60) is None


def test_leases_are_set_and_read_by_the_database_server_s_clock(store, monkeypatch):
    """Two services on one PostgreSQL server whose hosts' clocks differ by minutes: each set and read leases by
    its own clock, so the one ahead took the other's live job for lapsed and ran it a second time. SQLite's
    file is local, so every process opening it shares this host's clock."""
    if store.engine.dialect.name != "postgresql":
        pytest.skip("one host's clock: SQLite's file is opened by processes of this host only")
    from datetime import timedelta

    from kernelmill.service.db import store as store_module

    real = store_module.utcnow
    job, worker_job = new_job(store), new_job(store)
    monkeypatch.setattr(store_module, "utcnow", lambda: real() - timedelta(minutes=5))  # a's host runs late
    store.start_job(job.id, "w0", "GPU", runner="a", lease_s=60)
    store.start_job(worker_job.id, "w1", "GPU", runner="a", lease_s=60)
    monkeypatch.setattr(store_module, "utcnow", lambda: real() + timedelta(minutes=5))  # b's host runs early
    assert store.lapsed_jobs() == [] and store.recover_lapsed(job.id) is None
    assert store.workers_held("b") == {"w0", "w1"}
    store.renew_leases("a", [job.id], lease_s=-1)  # lapsed by the server's clock, whatever the hosts' say
    assert [j.id for j in store.lapsed_jobs()] == [job.id]
    created = store.create_running_job("embedded", "GPU", "tune@a", 30.0, **new_job_fields())
    assert created.lease_until > created.started_at and store.holds(created.id, "tune@a")
    assert created.id not in [j.id for j in store.lapsed_jobs()]


def test_reading_leases_takes_one_statement(store):
    """The poll asks which workers other services hold whenever jobs wait (every 0.5 s): on PostgreSQL it read
    the server's clock in a statement of its own first, two round trips where one compares with it."""
    from sqlalchemy import event

    job = new_job(store)
    store.start_job(job.id, "w0", "GPU", runner="a", lease_s=60)
    statements: list[str] = []
    listener = lambda conn, cursor, statement, *rest: statements.append(statement)  # noqa: E731
    event.listen(store.engine, "before_cursor_execute", listener)
    try:
        assert store.workers_held("b") == {"w0"} and store.workers_held("a") == set()
        assert store.lapsed_jobs() == []
    finally:
        event.remove(store.engine, "before_cursor_execute", listener)
    assert len(statements) == 3, statements
    store.renew_leases("a", [job.id], lease_s=-1)
    assert store.workers_held("b") == set() and [j.id for j in store.lapsed_jobs()] == [job.id]


def test_a_device_row_inserted_by_another_service_meanwhile_is_updated(store, monkeypatch):
    """Two services meeting the same new worker both inserted its row: the loser's IntegrityError failed a
    job it had not even started."""
    from sqlalchemy.exc import IntegrityError

    first = store._upsert_device
    raced = []

    def race(worker, fields):
        if not raced:
            raced.append(worker)
            first(worker, {"name": "GPU", "arch": "sm_90"})  # the other service's row
            raise IntegrityError("INSERT", {}, Exception("UNIQUE constraint failed: devices.worker"))
        return first(worker, fields)

    monkeypatch.setattr(store, "_upsert_device", race)
    row = store.upsert_device("w9", name="NVIDIA H200", arch="sm_90")
    assert raced == ["w9"] and row.name == "NVIDIA H200" and len(store.devices()) == 1


# -- trials -----------------------------------------------------------------------------------


def test_record_trials_skips_duplicates_of_the_same_candidate(store):
    job, other = new_job(store, shapes=[(1024, 1024), (4096, 512)]), new_job(store)
    first = store.record_trials(job.id, "1024x1024", [row("rowwise", BLOCK=128), row("rowwise", BLOCK=256)])
    assert [t.seq for t in first] == [1, 2]

    # A batch repeating a recorded candidate, and one candidate twice: only the new ones are inserted,
    # and the rows after a duplicate still go in (PostgreSQL: the failed insert is rolled back alone).
    again = store.record_trials(
        job.id,
        "1024x1024",
        [row("rowwise", BLOCK=256), row("warp", BLOCK=32), row("warp", BLOCK=32), row("rowwise", "wrong_result")],
    )
    assert [(t.family, t.params, t.seq) for t in again] == [("warp", {"BLOCK": 32}, 3)]
    recorded = store.trials(job.id, "1024x1024")
    keys = [(t.family, t.params_key) for t in recorded]
    assert len(keys) == len(set(keys)) == 2 + len(again)
    assert [t.seq for t in store.trials(job.id)] == list(range(1, len(keys) + 1))

    # The same candidate for another shape of the job, or for another job, is a different trial.
    assert len(store.record_trials(job.id, "4096x512", [row("rowwise", BLOCK=128)])) == 1
    assert len(store.record_trials(other.id, "1024x1024", [row("rowwise", BLOCK=128)])) == 1
    assert store.record_trials(job.id, "4096x512", [row("rowwise", BLOCK=128)]) == []


def test_summary_counts_best_and_baseline(store):
    job = new_job(store, shapes=[(1024, 1024), (4096, 512)])
    store.record_trials(
        job.id,
        "1024x1024",
        [row("rowwise", ms=0.8, BLOCK=1), row("rowwise", ms=0.5, BLOCK=2), row("warp", "wrong_result", BLOCK=3)],
    )
    store.record_trials(job.id, "4096x512", [row("rowwise", "compile_error", BLOCK=1)])
    store.record_baseline(job.id, "1024x1024", 1.0, "FakeGPU")
    store.record_baseline(job.id, "1024x1024", 1.5, "FakeGPU")  # measured again: replaced, not duplicated
    summary = {s.shape: s for s in store.summary(store.get_job(job.id))}
    a, b = summary["1024x1024"], summary["4096x512"]
    assert (a.trials, a.failed, a.best_ms, a.baseline_ms) == (3, 1, 0.5, 1.5)
    assert a.speedup == pytest.approx(3.0)
    assert store.trial(a.best_trial_id).params == {"BLOCK": 2}
    assert (b.trials, b.failed, b.best_ms, b.best_trial_id, b.baseline_ms, b.speedup) == (1, 1, None, None, None, None)
    assert store.has_baseline(job.id, "1024x1024") and not store.has_baseline(job.id, "4096x512")

    page, total = store.list_trials(job.id, sort="median_ms", limit=2)
    assert total == 4 and [t.median_ms for t in page] == [0.5, 0.8]  # every shape of the job
    failed, total = store.list_trials(job.id, status="wrong_result")
    assert total == 1 and failed[0].reason == "planted wrong_result"
    best = store.best_trial(job.id, "1024x1024")
    assert best.median_ms == 0.5 and best.cubin == b"cubin-rowwise"


def test_summaries_of_many_jobs_in_three_queries_match_each_jobs_own(store):
    """Job lists (API, dashboard, CLI) summarised each shape of each job with three queries of its own."""
    from sqlalchemy import event

    jobs = [new_job(store, shapes=[(1024, 1024), (4096, 512), (64, 64)]) for _ in range(4)]
    for n, job in enumerate(jobs):
        rows = [row("rowwise", ms=0.5 + 0.1 * (k % 3), BLOCK=k) for k in range(n + 1)]  # ties among equal times
        store.record_trials(job.id, "1024x1024", [*rows, row("warp", "wrong_result", BLOCK=99)])
        store.record_trials(job.id, "4096x512", [row("rowwise", "compile_error", BLOCK=1)] * (n % 2))
        if n % 2:
            store.record_baseline(job.id, "1024x1024", 1.0 + n, "FakeGPU")
    jobs = [store.get_job(job.id) for job in jobs]
    statements = []

    def count(conn, cursor, statement, *rest):
        statements.append(statement)

    event.listen(store.engine, "before_cursor_execute", count)
    together = store.summaries(jobs)
    event.remove(store.engine, "before_cursor_execute", count)
    assert len(statements) == 3, statements
    for job in jobs:
        first = together[job.id][0]
        assert store.trial(first.best_trial_id).params == {"BLOCK": 0} and first.best_ms == 0.5
        assert store.best_trial(job.id, "1024x1024").id == first.best_trial_id  # what is published
    assert [s.trials for s in together[jobs[3].id]] == [5, 1, 0] and together[jobs[3].id][0].baseline_ms == 4.0
    assert store.summaries([]) == {}


def test_a_timed_trial_that_failed_its_check_after_timing_is_never_the_best(store):
    """evaluate() keeps the timing of a kernel that went wrong after its timed launches: recorded with its time
    and cubin, it must never be a job's best, a warm start elsewhere, or served."""
    job, other = new_job(store), new_job(store)
    wrong = TrialResult(
        "warp", {"BLOCK": 1}, "wrong_result", "after 40 timed launches: y: relative error 0.5", "sm_90", "vk",
        max_rel_err=0.5, median_ms=0.1, min_ms=0.1, spread=0.01, reps=10, cubin=b"cubin-wrong",
    ).row()  # fmt: skip
    store.record_trials(job.id, "1024x1024", [wrong, row("rowwise", ms=1.0, BLOCK=2)])
    best = store.best_trial(job.id, "1024x1024")
    assert (best.status, best.median_ms) == ("ok", 1.0)
    (summary,) = store.summary(store.get_job(job.id))
    assert summary.best_ms == 1.0 and summary.best_trial_id == best.id
    assert [t.median_ms for t, _ in store.best_trials_elsewhere(other)] == [1.0]
    from kernelmill.service.jobs import StoreRecorder

    StoreRecorder(store, job.id).publish_best("1024x1024", lambda family, params: served())
    served_now = store.best_kernel("softmax", (1024, 1024), "float16", None)[0]
    assert (served_now.median_ms, served_now.family) == (1.0, "rowwise")


# -- served kernels ---------------------------------------------------------------------------------


def test_publish_keeps_the_faster_kernel(store):
    first, slower, faster = new_job(store), new_job(store), new_job(store)
    served_first = publish(store, first, (1024, 1024), 1.0)
    assert served_first.median_ms == 1.0 and served_first.job_id == first.id
    assert served_first.speedup == pytest.approx(2.0)

    kept = publish(store, slower, (1024, 1024), 2.0)
    assert kept.id == served_first.id and kept.median_ms == 1.0 and kept.job_id == first.id

    replaced = publish(store, faster, (1024, 1024), 0.5, family="warp")
    assert replaced.id == served_first.id  # the problem's row is updated, not duplicated
    kernels, total = store.list_kernels(op="softmax")
    assert total == 1
    served_now = store.kernel(kernels[0].id, with_cubin=True)
    assert (served_now.median_ms, served_now.family, served_now.job_id) == (0.5, "warp", faster.id)
    assert served_now.speedup == pytest.approx(4.0) and served_now.cubin == b"cubin"
    assert served_now.source == "// warp 0.5" and served_now.launches[0]["entry"] == "k"

    # Republishing the served trial itself (a resumed job) keeps it.
    trial = store.trial(served_now.trial_id)
    assert store.publish(store.get_job(faster.id), trial, served("// warp 0.5")).median_ms == 0.5

    # Another dtype, shape or attribute set is another problem.
    publish(store, new_job(store, dtype="float32"), (1024, 1024), 3.0)
    publish(store, first, (4096, 512), 3.0)
    mlp = new_job(store, op="fused_mlp", shapes=[(64, 256, 1024, 256)], attrs={"act": "relu"})
    publish(store, mlp, (64, 256, 1024, 256), 3.0)
    mlp_gelu = new_job(store, op="fused_mlp", shapes=[(64, 256, 1024, 256)], attrs={"act": "gelu_erf"})
    publish(store, mlp_gelu, (64, 256, 1024, 256), 4.0)
    assert store.list_kernels()[1] == 5
    assert store.list_kernels(op="softmax", dtype="float16")[1] == 2
    assert store.list_kernels(arch="sm_80")[1] == 0


def test_paging_through_kernels_of_one_op_and_shape_shows_each_once(store):
    """Kernels sorted by op and shape alone tie; PostgreSQL pages ties in any order, so a walk through the pages
    repeated some kernels and skipped others."""
    for i in range(24):
        job = new_job(store, dtype=("float16", "float32", "bfloat16")[i % 3])
        store.start_job(job.id, f"w{i}", f"NVIDIA GPU {i}")
        publish(store, store.get_job(job.id), (1024, 1024), 2.0)
    for i in range(0, 24, 5):  # rows rewritten (a faster kernel published): moved in PostgreSQL's heap
        again = new_job(store, dtype=("float16", "float32", "bfloat16")[i % 3])
        store.start_job(again.id, f"w{i}", f"NVIDIA GPU {i}")
        publish(store, store.get_job(again.id), (1024, 1024), 1.0, BLOCK=i)
    seen, total = [], None
    while total is None or len(seen) < total:
        page, total = store.list_kernels(op="softmax", limit=5, offset=len(seen))
        assert page
        seen += [k.id for k in page]
    assert total == 24 and len(set(seen)) == 24


def test_each_gpu_model_of_an_arch_keeps_its_own_served_kernel(store):
    h200 = new_job(store)
    store.start_job(h200.id, "w1", "NVIDIA H200")
    served_h200 = publish(store, store.get_job(h200.id), (1024, 1024), 1.0)  # 2.0x its PyTorch (2.0 ms)
    # An H100 job: slower in time (its GPU is), 2.5x its own PyTorch: served for the H100, beside the H200's.
    h100 = new_job(store)
    store.start_job(h100.id, "w2", "NVIDIA H100 80GB HBM3")
    trial = store.record_trials(h100.id, "1024x1024", [row("warp", ms=1.6, BLOCK=7)])[0]
    served_h100 = store.publish(store.get_job(h100.id), trial, {**served("// warp 1.6"), "baseline_ms": 4.0})
    assert served_h100.id != served_h200.id and served_h100.speedup == pytest.approx(2.5)
    # Another H200 job compares times with the H200's kernel only: 0.9 ms beats 1.0 ms there.
    again = new_job(store)
    store.start_job(again.id, "w1", "NVIDIA H200")
    trial = store.record_trials(again.id, "1024x1024", [row("warp", ms=0.9, BLOCK=8)])[0]
    replaced = store.publish(store.get_job(again.id), trial, {**served(), "baseline_ms": 1.08})
    assert replaced.id == served_h200.id and replaced.median_ms == 0.9
    assert store.list_kernels()[1] == 2
    # Each GPU model is served its own, at the shape and at a nearest shape; a model with none, or a lookup
    # that names none, the highest speedup (the H100's 2.5x over the H200's 1.2x).
    for shape, exact in (((1024, 1024), True), ((1000, 1000), False)):
        for device, ms in (("NVIDIA H200", 0.9), ("NVIDIA H100 80GB HBM3", 1.6), ("NVIDIA A100", 1.6), (None, 1.6)):
            kernel, found_exact = store.best_kernel("softmax", shape, "float16", None, device=device)
            assert (kernel.median_ms, found_exact) == (ms, exact), device


def test_a_kernel_replaced_by_one_without_a_baseline_has_no_speedup(store):
    first, second = new_job(store), new_job(store)
    assert publish(store, first, (1024, 1024), 1.0).speedup == pytest.approx(2.0)
    trial = store.record_trials(second.id, "1024x1024", [row("warp", ms=0.5, BLOCK=9)])[0]
    replaced = store.publish(store.get_job(second.id), trial, {**served(), "baseline_ms": None})  # none timed
    assert (replaced.median_ms, replaced.baseline_ms, replaced.speedup) == (0.5, None, None)


def test_a_trial_only_as_fast_as_the_served_one_does_not_replace_it(store):
    first, tied = new_job(store), new_job(store)
    served_first = publish(store, first, (1024, 1024), 1.0)
    kept = publish(store, tied, (1024, 1024), 1.0, family="warp")
    assert (kept.trial_id, kept.job_id, kept.family) == (served_first.trial_id, first.id, "rowwise")
    assert store.best_kernel("softmax", (1024, 1024), "float16", None)[0].trial_id == served_first.trial_id


def test_republishing_the_served_trial_with_a_baseline_updates_its_speedup(store):
    job = new_job(store)
    trial = store.record_trials(job.id, "1024x1024", [row("warp", ms=0.5, BLOCK=9)])[0]
    assert store.publish(job, trial, {**served(), "baseline_ms": None}).speedup is None
    again = store.publish(store.get_job(job.id), store.trial(trial.id), {**served(), "baseline_ms": 2.0})
    assert again.trial_id == trial.id and again.speedup == pytest.approx(4.0)
    assert store.best_kernel("softmax", (1024, 1024), "float16", None)[0].speedup == pytest.approx(4.0)


def test_concurrent_publishes_serve_the_fastest(store):
    """Jobs for one problem finishing together: one served row, the fastest trial.

    Each publisher has a store (engine) of its own, as separate service processes would: the row lock
    (PostgreSQL) or the write lock taken before the read (SQLite), not the store's in-process lock, must keep
    a slower trial from overwriting a faster one. A race is a matter of timing, so a few rounds run, each on a
    problem of its own.
    """
    times = [0.9, 0.4, 0.7, 0.3, 0.8, 0.6]
    jobs = [new_job(store) for _ in times]
    publishers = [Store(store.url, migrate_on_open=False) for _ in jobs]
    errors = []

    def go(barrier, publisher, job, trial):
        try:
            publisher.list_kernels()  # connected before the start, so the publishes overlap
            barrier.wait(5)
            publisher.publish(job, trial, served())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        for rows in (1024, 2048, 4096, 8192):
            key = f"{rows}x1024"
            trials = [
                store.record_trials(job.id, key, [row("rowwise", ms=ms, BLOCK=int(ms * 10))])[0]
                for job, ms in zip(jobs, times, strict=True)
            ]
            barrier = threading.Barrier(len(jobs))
            threads = [
                threading.Thread(target=go, args=(barrier, *args))
                for args in zip(publishers, jobs, trials, strict=True)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert not errors, errors
            found = store.best_kernel("softmax", (rows, 1024), "float16", None)
            assert found is not None and found[1] and found[0].median_ms == min(times)
    finally:
        for publisher in publishers:
            if publisher is not store:
                publisher.close()
    assert store.list_kernels()[1] == 4


def test_a_publish_waits_for_another_that_has_read_the_served_kernel_on_sqlite(tmp_path):
    """Two processes' stores: the slower publish has read the served kernel (2.0 ms) and is about to replace it
    when the faster one publishes. The faster must read after the slower commits, not be overwritten by it."""
    from sqlalchemy import event

    url = f"sqlite:///{tmp_path}/two.db"
    slow_store, fast_store = Store(url), Store(url)
    try:
        publish(slow_store, new_job(slow_store), (1024, 1024), 2.0)
        slow_job, fast_job = new_job(slow_store), new_job(fast_store)
        slow = slow_store.record_trials(slow_job.id, "1024x1024", [row("warp", ms=1.5, BLOCK=1)])[0]
        fast = fast_store.record_trials(fast_job.id, "1024x1024", [row("warp", ms=1.0, BLOCK=2)])[0]
        read = threading.Event()

        @event.listens_for(slow_store.engine, "after_cursor_execute")
        def _hold(conn, cursor, statement, *args):
            if statement.lstrip().startswith("SELECT") and "FROM kernels" in statement and not read.is_set():
                read.set()
                time.sleep(0.3)  # the faster publish runs while this one holds what it read

        writer = threading.Thread(target=slow_store.publish, args=(slow_job, slow, served()))
        writer.start()
        assert read.wait(5)
        fast_store.publish(fast_job, fast, served())
        writer.join(10)
        assert fast_store.best_kernel("softmax", (1024, 1024), "float16", None)[0].median_ms == 1.0
    finally:
        slow_store.close()
        fast_store.close()


def test_best_kernel_exact_then_nearest(store):
    job = new_job(store, shapes=[(1024, 1024), (4096, 512), (8192, 8192)])
    for shape, ms in (((1024, 1024), 0.1), ((4096, 512), 0.2), ((8192, 8192), 3.0)):
        publish(store, job, shape, ms)

    kernel, exact = store.best_kernel("softmax", (4096, 512), "float16", None)
    assert exact and kernel.shape == [4096, 512]
    kernel, exact = store.best_kernel("softmax", (4000, 500), "float16", "sm_90")
    assert not exact and kernel.shape == [4096, 512]
    kernel, exact = store.best_kernel("softmax", (7000, 9000), "float16", None)
    assert not exact and kernel.shape == [8192, 8192]
    kernel, exact = store.best_kernel("softmax", (1, 1), "float16", None)
    assert not exact and kernel.shape == [1024, 1024]

    assert store.best_kernel("softmax", (1024, 1024), "float32", None) is None  # no kernel of that dtype
    assert store.best_kernel("softmax", (1024, 1024), "float16", "sm_80") is None  # nor for that arch
    assert store.best_kernel("matmul", (64, 64, 64), "float16", None) is None
    assert store.best_kernel("softmax", (1024, 1024, 3), "float16", None) is None  # no shape of that rank

    mlp = new_job(store, op="fused_mlp", shapes=[(64, 256, 1024, 256)], attrs={"act": "relu"})
    publish(store, mlp, (64, 256, 1024, 256), 1.0)
    found = store.best_kernel("fused_mlp", (64, 256, 1024, 256), "float16", None, {"act": "relu"})
    assert found is not None and found[1]
    assert store.best_kernel("fused_mlp", (64, 256, 1024, 256), "float16", None, {"act": "gelu_erf"}) is None


def test_nearest_shape_ties_prefer_this_gpu_model_then_the_highest_speedup_then_the_first():
    """Shapes as near as each other (1024 and 4096 for 2048) count alike: only the first one's kernels were
    weighed, so another GPU model's kernel at 1024 won over this GPU's at 4096."""
    from kernelmill.service.db.store import Served, nearest_shape

    served = [
        Served(1, [1024], "NVIDIA H100", 1.5),
        Served(2, [4096], "NVIDIA H200", 1.1),
        Served(3, [4096], "NVIDIA H100", 2.0),
        Served(4, [8192], "NVIDIA H200", 9.0),  # farther
    ]
    assert nearest_shape(served, [2048], "NVIDIA H200") == (2, False)
    assert nearest_shape(served, [2048], "NVIDIA A100") == (3, False)  # no kernel of its own: the highest speedup
    assert nearest_shape(served, [2048]) == (3, False)
    assert nearest_shape([Served(5, [1024]), Served(6, [4096])], [2048]) == (5, False)  # no speedups: the first
    assert nearest_shape(served, [4096], "NVIDIA H200") == (2, True)  # the exact shape before any other
    assert nearest_shape(served, [4096, 1]) is None  # no shape of that rank
    # No GPU model asked for: a kernel whose model is unrecorded is not taken for "this model's".
    assert nearest_shape([Served(7, [2048], None, 1.0), Served(8, [2048], "NVIDIA H100", 3.0)], [2048]) == (8, True)


def test_best_trial_of_a_gpu_model_takes_unrecorded_models_and_warm_starts_come_from_other_jobs(store):
    """A job resumed on another GPU model serves what was timed on that model, or on one not recorded (trials
    from before the column); warm starts are other jobs' best trials, never the job's own."""
    job, other = new_job(store), new_job(store)
    timed = [
        {**row("rowwise", ms=0.5, BLOCK=1), "device_name": "NVIDIA H100"},
        {**row("rowwise", ms=0.8, BLOCK=2), "device_name": None},
        {**row("rowwise", ms=0.9, BLOCK=3), "device_name": "NVIDIA H200"},
    ]
    store.record_trials(job.id, "1024x1024", timed)
    assert store.best_trial(job.id, "1024x1024").params == {"BLOCK": 1}
    assert store.best_trial(job.id, "1024x1024", "NVIDIA H200").params == {"BLOCK": 2}
    assert store.best_trial(job.id, "1024x1024", "NVIDIA H100").params == {"BLOCK": 1}
    store.record_trials(other.id, "1024x1024", [row("rowwise", ms=2.0, BLOCK=4)])
    assert [(t.params, j.id) for t, j in store.best_trials_elsewhere(store.get_job(job.id))] == [
        ({"BLOCK": 4}, other.id)
    ]
    assert [(t.params, j.id) for t, j in store.best_trials_elsewhere(store.get_job(other.id))] == [
        ({"BLOCK": 1}, job.id)
    ]


def test_served_problems_lists_each_problem_of_an_op_once(store):
    assert store.served_problems("fused_mlp") == []
    relu = new_job(store, op="fused_mlp", shapes=[(64, 256, 1024, 256), (8, 256, 1024, 256)], attrs={"act": "relu"})
    for shape in relu.shapes:
        publish(store, relu, shape, 1.0)  # two shapes of one problem: listed once
    gelu = new_job(store, op="fused_mlp", shapes=[(64, 256, 1024, 256)], dtype="float32", attrs={"act": "gelu_erf"})
    publish(store, gelu, (64, 256, 1024, 256), 1.0)
    publish(store, new_job(store), (1024, 1024), 1.0)  # another op's: not listed
    assert store.served_problems("fused_mlp") == [
        ("float16", "float16", "sm_90", {"act": "relu"}),
        ("float32", "float32", "sm_90", {"act": "gelu_erf"}),
    ]


def test_devices_upsert(store):
    store.upsert_device("gpu0", name="H100", arch="sm_90", sm_count=132, matrix_tflops={"float16": 700.0})
    store.upsert_device("gpu0", name="H100", arch="sm_90", copy_gbps=3000.0)
    store.upsert_device("gpu1", name="H100", arch="sm_90")
    devices = store.devices()
    assert [d.worker for d in devices] == ["gpu0", "gpu1"]
    assert devices[0].copy_gbps == 3000.0 and devices[0].matrix_tflops == {"float16": 700.0}


def test_trial_rows_roundtrip_json_and_binary(store):
    job = new_job(store)
    verify = {"seeds": [0, 1, 2], "max_rel_err": [1e-7, 2e-7, 3e-7]}
    ptxas = {"softmax_rowwise": {"registers": 32, "spill_stores_bytes": 0}}
    data = TrialResult(
        "rowwise",
        {"BLOCK": 256, "VEC": 4},
        "ok",
        None,
        "sm_90a",
        "vk",
        ptxas=ptxas,
        verify=verify,
        median_ms=0.25,
        cubin=bytes(range(256)),
        note="crossover",
    ).row()
    (trial,) = store.record_trials(job.id, "1024x1024", [data])
    back = store.trial(trial.id, with_cubin=True)
    assert isinstance(back, Trial)
    assert (back.params, back.ptxas, back.verify, back.note) == ({"BLOCK": 256, "VEC": 4}, ptxas, verify, "crossover")
    assert back.cubin == bytes(range(256)) and back.arch == "sm_90a"


def test_stores_opened_together_on_a_new_database_migrate_it_once(db_url):
    """API replicas starting together on an empty database: one migrates, the others wait and find it done."""
    import subprocess
    import sys

    opening = "import sys; from kernelmill.service.db.store import Store; Store(sys.argv[1]).close()"
    procs = [
        subprocess.Popen([sys.executable, "-c", opening, db_url], stderr=subprocess.PIPE, text=True) for _ in range(4)
    ]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], "\n".join(errors)
    from kernelmill.service.db.store import Store

    store = Store(db_url)
    try:
        assert store.list_jobs() == ([], 0)
    finally:
        store.close()


def test_migration_0004_counts_running_time_and_keeps_jobs(store):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from kernelmill.service.db.models import Base
    from kernelmill.service.db.store import downgrade, migrate

    with store.engine.connect() as conn:  # the whole schema, as migrated, is the models'
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    job = new_job(store)
    assert store.get_job(job.id).seconds_used == 0.0
    store.add_job_seconds(job.id, 1.5)
    store.add_job_seconds(job.id, 2.0)
    store.add_job_seconds(job.id, -3.0)  # never counts back
    assert store.get_job(job.id).seconds_used == pytest.approx(3.5)
    downgrade(store.engine, "0003")
    assert alembic_version(store) == ["0003"]
    migrate(store.engine)
    again = store.get_job(job.id)
    assert again.op == "softmax" and again.seconds_used == 0.0  # a job from before 0004 has used nothing yet


def test_tf32_and_ieee_kernels_are_served_apart(store):
    """A float32 matmul tuned on tensor cores computes in TF32: it is served as precision tf32, beside (never in
    place of) the IEEE float32 kernel, however much faster it is."""
    shape = (256, 256, 256)
    ieee = publish(store, new_job(store, op="matmul", shapes=[shape], dtype="float32"), shape, 1.0, family="simt")
    tf32 = publish(store, new_job(store, op="matmul", shapes=[shape], dtype="float32"), shape, 0.2, "tensorcore")
    assert (ieee.precision, tf32.precision) == ("float32", "tf32") and ieee.id != tf32.id
    kernel, exact = store.best_kernel("matmul", shape, "float32", None)
    assert exact and kernel.family == "simt"
    kernel, _ = store.best_kernel("matmul", (200, 256, 256), "float32", None, precision="tf32")
    assert kernel.family == "tensorcore"
    assert [k.family for k in store.list_kernels(op="matmul", precision="tf32")[0]] == ["tensorcore"]


def test_migration_0005_gives_served_kernels_their_precision(store):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from kernelmill.service.db.models import Base

    shape = (256, 256, 256)
    publish(store, new_job(store, op="matmul", shapes=[shape], dtype="float32"), shape, 1.0, family="simt")
    publish(store, new_job(store, op="matmul", shapes=[shape], dtype="float32"), shape, 0.2, "tensorcore")
    publish(store, new_job(store), (1024, 1024), 1.0)
    # Back to 0004, where a problem has one served kernel: the IEEE one stays.
    downgrade(store.engine, "0004")
    with store.engine.connect() as conn:
        rows = conn.execute(text("SELECT op, family FROM kernels ORDER BY op")).all()
    assert [tuple(r) for r in rows] == [("matmul", "simt"), ("softmax", "rowwise")]
    with store.engine.begin() as conn:  # a TF32 kernel served before 0005 (in the float32 slot)
        conn.execute(text("UPDATE kernels SET family = 'tensorcore' WHERE op = 'matmul'"))
    migrate(store.engine)
    with store.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    precisions = {k.op: k.precision for k in store.list_kernels()[0]}
    assert precisions == {"matmul": "tf32", "softmax": "float16"}  # an unknown family: its dtype
    assert store.best_kernel("matmul", shape, "float32", None) is None  # no longer served as IEEE


def test_migration_0007_keeps_one_kernel_a_gpu_model_and_its_downgrade_the_fastest(store):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from kernelmill.service.db.models import Base

    for device, ms, baseline in (("NVIDIA H200", 1.0, 2.0), ("NVIDIA H100 80GB HBM3", 1.6, 4.0)):
        job = new_job(store)
        store.start_job(job.id, "w", device)
        trial = store.record_trials(job.id, "1024x1024", [row("warp", ms=ms, BLOCK=int(ms * 10))])[0]
        store.publish(store.get_job(job.id), trial, {**served(), "baseline_ms": baseline})
    with store.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    assert {k.device_key for k in store.list_kernels()[0]} == {"NVIDIA H200", "NVIDIA H100 80GB HBM3"}
    downgrade(store.engine, "0006")  # one kernel a problem: the higher speedup (the H100's 2.5x) stays
    with store.engine.connect() as conn:
        assert [tuple(r) for r in conn.execute(text("SELECT device_name, median_ms FROM kernels"))] == [
            ("NVIDIA H100 80GB HBM3", 1.6)
        ]
    migrate(store.engine)
    (kernel,) = store.list_kernels()[0]
    assert kernel.device_key == "NVIDIA H100 80GB HBM3"


_HOLDER = """
import sys, time
from kernelmill.service.db.store import Store
store = Store(sys.argv[1])
values = dict(op="softmax", shapes=[[64, 64]], dtype="float16", attrs={}, strategy="random", budget_trials=1,
              budget_seconds=1.0)
store.create_job(**values)
print("ready", flush=True)
sys.stdin.readline()  # another process opens and closes the database meanwhile
store.create_job(**values)
print("written", flush=True)
time.sleep(60)
"""


def test_another_process_opening_the_database_loses_no_write_of_a_crashed_service(tmp_path):
    """A service's writes survive a kill -9 after another process (`kernelmill jobs`, say) opened and closed
    the SQLite database: the migration lock once closed a handle of the database file itself, which dropped
    SQLite's own locks, and the other process then deleted the service's WAL under it."""
    import subprocess
    import sys

    url = f"sqlite:///{tmp_path / 'km.db'}"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        other = Store(url)
        assert other.list_jobs()[1] == 1
        other.close()
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "written"
    finally:
        holder.kill()
        holder.wait()
    after = Store(url)
    try:
        assert after.list_jobs()[1] == 2
    finally:
        after.close()
