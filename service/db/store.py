"""The store: the database is the truth for jobs, trials, baselines, served kernels, devices and forward
profiles.

One function per question the API or the loop asks; routes and the loop never
build queries themselves.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from alembic.util import CommandError
from sqlalchemy import DateTime, Engine, create_engine, event, func, literal, or_, select, text, update
from sqlalchemy.exc import ArgumentError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, defer, sessionmaker, undefer

from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.base import SpecError
from kernelmill.service.db.models import Baseline, DeviceRow, ForwardProfileRow, Job, Kernel, Trial, utcnow

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).parent / "migrations"


def shape_key(shape: Sequence[int]) -> str:
    return "x".join(str(int(v)) for v in shape)


def attrs_key(attrs: dict[str, Any] | None) -> str:
    return json.dumps(attrs or {}, sort_keys=True)


@dataclass(frozen=True)
class Served:
    """What choosing among a problem's served kernels reads of each: not the row itself."""

    id: int
    shape: list[int]
    device_name: str | None = None
    speedup: float | None = None


def nearest_shape(
    served: Iterable[Served | tuple[int, Sequence[int]]], shape: Sequence[int], device: str | None = None
) -> tuple[int, bool] | None:
    """Of a problem's served kernels in id order: those with exactly ``shape``, else those of the nearest
    shapes of the same rank (the sum over dims of |log(tuned / wanted)|; shapes as near as each other, 1024 and
    4096 for 2048, all count); among those, the first tuned on ``device`` (a GPU model: an H100's best tiles
    are not an H200's), else the highest speedup over its own GPU's PyTorch, else the first. Returns
    ``(id, exact)``."""
    want = [max(int(v), 1) for v in shape]
    best: list[Served] = []
    best_distance = math.inf
    for item in served:
        row = item if isinstance(item, Served) else Served(item[0], list(item[1]))
        if len(row.shape) != len(want):
            continue
        distance = (
            0.0
            if list(row.shape) == want
            else sum(abs(math.log(max(a, 1) / b)) for a, b in zip(row.shape, want, strict=True))
        )
        if distance < best_distance:
            best, best_distance = [row], distance
        elif distance == best_distance:  # as near: another GPU model's kernel of the same shape, or another shape
            best.append(row)
    if not best:
        return None
    same = [row for row in best if device and row.device_name == device]
    pick = same[0] if same else max(best, key=lambda r: r.speedup if r.speedup is not None else -math.inf)
    return pick.id, list(pick.shape) == want


def _problem(op: str, dtype: str, arch: str | None, attrs: dict[str, Any] | None, precision: str | None = None) -> list:
    """The WHERE clauses of the kernels served for one problem (any arch when ``arch`` is None), computing in
    ``precision`` (default: the dtype itself)."""
    clauses = [Kernel.op == op, Kernel.dtype == dtype, Kernel.attrs_key == attrs_key(attrs)]
    clauses.append(Kernel.precision == (precision or dtype))
    return clauses + [Kernel.arch == arch] if arch else clauses


def family_precision(op: str, family: str, dtype: str) -> str:
    """The arithmetic ``family`` of ``op`` computes ``dtype`` in (tf32 for float32 on tensor cores); the dtype
    itself where the op or family is not known here (a plugin this process has not loaded)."""
    try:
        return get_op(op).family(family).precision(dtype)
    except SpecError:
        return dtype


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # WAL: readers never wait for the loop's writes
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True)


#: The PostgreSQL advisory lock taken while migrating (any constant of kernelmill's own).
_MIGRATION_LOCK = 0x6B6D_696C_6C00  # "kmill"


def migrate(engine: Engine, revision: str = "head") -> None:
    """Apply Alembic migrations up to ``revision``."""
    from alembic import command

    _migrating(engine, lambda cfg: command.upgrade(cfg, revision))


def downgrade(engine: Engine, revision: str = "base") -> None:
    """Undo Alembic migrations down to ``revision`` (rows are kept wherever the older schema holds them)."""
    from alembic import command

    _migrating(engine, lambda cfg: command.downgrade(cfg, revision))


def _migrating(engine: Engine, step: Callable[[Any], None]) -> None:
    """Run an Alembic ``step`` on one connection: serialized between processes, and on SQLite with foreign keys
    off. SQLite drops or alters a column by rebuilding the table (batch mode); dropping the old table with
    foreign keys on deleted or nulled every row pointing at it (ON DELETE CASCADE / SET NULL): a downgrade
    emptied the trials and baselines. The keys are checked once the step is done, and turned on again."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    # Alembic's config interpolates "%": a URL holding one (sqlite:///:memory: renders as %3A, a percent-encoded
    # password) failed as "invalid interpolation syntax".
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    # Processes opening a new database together (API replicas, `serve` and the CLI): one migrates, the others
    # wait for it and then find the database at head.
    with _sqlite_file_lock(engine), engine.connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        if sqlite:  # outside any transaction: inside one SQLite ignores it
            conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
            conn.commit()
        try:
            with conn.begin():
                if sqlite:  # pysqlite runs DDL outside a transaction: a migration failing half way left its half
                    conn.exec_driver_sql("BEGIN")  # (another app's file got kernelmill's tables, one per attempt)
                if conn.dialect.name == "postgresql":
                    conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})
                cfg.attributes["connection"] = conn
                step(cfg)
                if sqlite and (broken := conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()):
                    table, rowid, parent, _ = broken[0]
                    raise DatabaseError(
                        f"migrating left {len(broken)} rows pointing at rows that are not there (the first: "
                        f"{table} row {rowid}, into {parent})",
                        unreachable=False,
                    )
        finally:
            if sqlite:
                conn.exec_driver_sql("PRAGMA foreign_keys=ON")
                conn.commit()


@contextmanager
def _sqlite_file_lock(engine: Engine) -> Iterator[None]:
    """An exclusive flock on a lock file beside an SQLite database (``<database>.lock``) while it is migrated
    (pysqlite runs DDL outside a transaction, so SQLite's own locks do not serialize two migrations).

    Never on the database file itself: closing any handle of a file drops every fcntl lock the process holds
    on it, SQLite's included, and the next process to close the database then took itself for the last
    one, checkpointed and deleted the WAL under a running service, whose later writes were lost on a crash."""
    database = engine.url.database if engine.dialect.name == "sqlite" else None
    if not database or database == ":memory:" or database.startswith("file:"):
        yield
        return
    import fcntl

    try:
        handle = open(database + ".lock", "ab")  # noqa: SIM115 - closed below
    except OSError:  # no such folder, no permission: SQLite says so when it opens the database
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass
class ShapeSummary:
    shape: str
    trials: int
    failed: int
    best_ms: float | None
    best_trial_id: int | None
    baseline_ms: float | None

    @property
    def speedup(self) -> float | None:
        if self.best_ms and self.baseline_ms:
            return self.baseline_ms / self.best_ms
        return None


class DatabaseError(ValueError):
    """The database URL is malformed, or the database cannot be opened or migrated (``unreachable``)."""

    def __init__(self, message: str, *, unreachable: bool) -> None:
        super().__init__(message)
        self.unreachable = unreachable


def _shown(url: str) -> str:
    """``url`` with its password hidden, for messages."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url.split("://", 1)[0] + "://..." if "://" in url else repr(url)


#: A running job put back in the queue, to resume from its recorded trials: no GPU, no owner.
_REQUEUED: dict[str, Any] = dict(state="queued", worker=None, device_name=None, runner=None, lease_until=None)


def _held(statement, runner: str | None):
    """``statement`` (on jobs) narrowed to a job ``runner`` still runs; unchanged where runner is None."""
    return statement if runner is None else statement.where(Job.runner == runner, Job.state == "running")


class Store:
    def __init__(self, url: str, *, migrate_on_open: bool = True) -> None:
        self.url = url
        try:
            self.engine = make_engine(url)
            if migrate_on_open:
                migrate(self.engine)
        except CommandError as exc:  # a revision this kernelmill does not know: the schema is newer than it
            raise DatabaseError(
                f"cannot migrate the database {_shown(url)}: {exc} (was it written by a newer kernelmill? run that "
                "one, or a copy of the database made before it)",
                unreachable=False,
            ) from None
        except ArgumentError as exc:  # NoSuchModuleError too: an unknown dialect or driver
            raise DatabaseError(f"database URL {_shown(url)}: {str(exc).splitlines()[0]}", unreachable=False) from None
        except SQLAlchemyError as exc:
            why = str(getattr(exc, "orig", None) or exc).splitlines()[0]
            if "already exists" in why:  # a first migration meeting tables of its own names: another app's
                raise DatabaseError(
                    f"the database {_shown(url)} is not kernelmill's ({why}): name another with "
                    "KERNELMILL_DATABASE_URL; nothing was changed in it",
                    unreachable=False,
                ) from None
            raise DatabaseError(f"cannot open the database {_shown(url)}: {why}", unreachable=True) from None
        except ImportError as exc:  # the dialect is known, its driver (DBAPI module) is not installed
            raise DatabaseError(
                f"database URL {_shown(url)}: its driver is not installed ({exc}); install it, or name an "
                "installed one in the URL (postgresql+psycopg://, mysql+pymysql://, ...)",
                unreachable=False,
            ) from None
        self._session = sessionmaker(self.engine, expire_on_commit=False)
        # Publishing reads the served kernel then replaces it: serialized here, and across processes by a row
        # lock (PostgreSQL) or the write lock taken before the read (SQLite), so a slower trial never overwrites
        # a faster one.
        self._publish_lock = threading.Lock()
        # Bumped by every publish through this store: caches of served kernels (the API's best-kernel
        # lookups) drop what they hold when it changes.
        self.served_version = 0

    def session(self) -> Session:
        return self._session()

    def close(self) -> None:
        self.engine.dispose()

    # -- jobs --------------------------------------------------------------------

    def create_job(self, **fields: Any) -> Job:
        with self.session() as s, s.begin():
            job = Job(**fields)
            s.add(job)
        return job

    def create_running_job(
        self, worker: str, device_name: str | None, runner: str, lease_s: float, **fields: Any
    ) -> Job:
        """A job that starts running at once for ``runner`` (a local ``kernelmill tune``): created already
        leased, so no service on the database can take it as queued before its runner starts it."""
        with self.session() as s, s.begin():
            now = self._now(s)
            job = Job(**fields, state="running", worker=worker, device_name=device_name, runner=runner)
            job.started_at, job.lease_until = now, now + timedelta(seconds=lease_s)
            s.add(job)
        return job

    def get_job(self, job_id: int) -> Job | None:
        with self.session() as s:
            return s.get(Job, job_id)

    def list_jobs(
        self, state: str | None = None, op: str | None = None, limit: int = 50, offset: int = 0
    ) -> tuple[list[Job], int]:
        query = select(Job)
        if state:
            query = query.where(Job.state == state)
        if op:
            query = query.where(Job.op == op)
        with self.session() as s:
            total = s.scalar(select(func.count()).select_from(query.subquery())) or 0
            rows = s.scalars(query.order_by(Job.id.desc()).limit(limit).offset(offset)).all()
        return list(rows), total

    def jobs_in_state(self, *states: str) -> list[Job]:
        with self.session() as s:
            return list(s.scalars(select(Job).where(Job.state.in_(states)).order_by(Job.id)).all())

    def update_job(self, job_id: int, **fields: Any) -> Job:
        with self.session() as s, s.begin():
            job = s.get(Job, job_id)
            if job is None:
                raise KeyError(job_id)
            for key, value in fields.items():
                setattr(job, key, value)
        return job

    def start_job(
        self, job_id: int, worker: str | None, device_name: str | None, runner: str | None = None,
        lease_s: float | None = None,
    ) -> Job | None:  # fmt: skip
        """The job, now running on ``worker`` for ``runner`` (its lease held ``lease_s`` seconds); None where
        it is no longer queued (cancelled, or started by another runner, meanwhile). One conditional UPDATE,
        so a cancel and a start, or two runners' starts, never both win."""
        with self.session() as s, s.begin():
            now = self._now(s)
            started = func.coalesce(Job.started_at, now)  # a resumed job keeps its first start
            lease = now + timedelta(seconds=lease_s) if lease_s is not None else None
            moved = s.execute(
                update(Job)
                .where(Job.id == job_id, Job.state == "queued")
                .values(
                    state="running",
                    worker=worker,
                    device_name=device_name,
                    started_at=started,
                    runner=runner,
                    lease_until=lease,
                )
            ).rowcount
        return self.get_job(job_id) if moved else None

    def requeue_job(self, job_id: int, runner: str | None = None) -> bool:
        """A running job back in the queue, to resume from its recorded trials: no GPU, no owner. With
        ``runner``, only while that runner still holds it (a runner whose lease lapsed must not move a job
        another one took over); whether it moved."""
        return self._update_held(job_id, runner, _REQUEUED)

    def _update_held(self, job_id: int, runner: str | None, values: dict[str, Any]) -> bool:
        """``values`` set on the job, where ``runner`` is None or still holds it running: one conditional UPDATE."""
        if runner is None:
            self.update_job(job_id, **values)
            return True
        with self.session() as s, s.begin():
            return bool(s.execute(_held(update(Job).where(Job.id == job_id), runner).values(**values)).rowcount)

    def renew_leases(self, runner: str, job_ids: Iterable[int], lease_s: float) -> None:
        """``runner`` still runs ``job_ids``: their leases hold ``lease_s`` seconds more."""
        ids = list(job_ids)
        if not ids:
            return
        with self.session() as s, s.begin():
            lease = self._now(s) + timedelta(seconds=lease_s)
            s.execute(_held(update(Job).where(Job.id.in_(ids)), runner).values(lease_until=lease))

    def _now(self, s: Session) -> datetime:
        """Now (UTC), by the clock leases are set and read by: the database server's where there is one
        (PostgreSQL), so runners on hosts whose clocks differ agree on when a lease lapses; for SQLite this
        host's, which every process opening its file shares."""
        if self.engine.dialect.name == "postgresql":
            return s.scalar(select(self._now_sql()))
        return utcnow()

    def _now_sql(self):
        """``_now`` as an expression a query compares with, so a read of leases is one round trip: the server's
        clock where it has one (PostgreSQL), this host's otherwise."""
        if self.engine.dialect.name == "postgresql":
            return func.timezone("UTC", func.clock_timestamp(), type_=DateTime)
        return literal(utcnow(), DateTime)

    def _lapsed(self, now):
        """Running jobs whose runner died: the lease lapsed, or there was none (rows older than leases)."""
        return (Job.state == "running") & (Job.lease_until.is_(None) | (Job.lease_until < now))

    def lapsed_jobs(self) -> list[Job]:
        with self.session() as s:
            return list(s.scalars(select(Job).where(self._lapsed(self._now_sql())).order_by(Job.id)).all())

    def recover_lapsed(self, job_id: int) -> str | None:
        """A running job whose lease lapsed: ended ``cancelled`` where a cancel was asked, else queued again.
        The new state, or None where the job is not (or no longer) lapsed: one conditional UPDATE, so a job
        whose owner renewed meanwhile, or that two runners recover at once, moves once."""
        with self.session() as s, s.begin():
            now = self._now(s)
            lapsed = (Job.id == job_id) & self._lapsed(now)
            if s.execute(
                update(Job).where(lapsed, Job.cancel_requested.is_(True)).values(state="cancelled", finished_at=now)
            ).rowcount:
                return "cancelled"
            moved = s.execute(update(Job).where(lapsed).values(**_REQUEUED)).rowcount
        return "queued" if moved else None

    def workers_held(self, runner: str) -> set[str]:
        """The GPU workers running a job for another runner whose lease holds (not to be given a job here)."""
        with self.session() as s:
            held = (Job.state == "running") & (Job.runner != runner) & (Job.lease_until >= self._now_sql())
            rows = s.scalars(select(Job.worker).where(held, Job.worker.is_not(None)))
            return set(rows.all())

    def add_job_seconds(self, job_id: int, seconds: float, runner: str | None = None) -> bool:
        """Count ``seconds`` more of running time against the job's budget (one UPDATE, no read); with
        ``runner``, only while that runner still holds the job. Whether they were counted."""
        added = Job.seconds_used + max(0.0, seconds)
        with self.session() as s, s.begin():
            return bool(
                s.execute(_held(update(Job).where(Job.id == job_id), runner).values(seconds_used=added)).rowcount
            )

    def holds(self, job_id: int, runner: str) -> bool:
        """Whether ``runner`` still runs the job: not if its lease lapsed and the job was queued again (another
        runner may have taken it over), nor once the job ended."""
        with self.session() as s:
            return s.scalar(_held(select(Job.id).where(Job.id == job_id), runner)) is not None

    def finish_job(self, job_id: int, state: str, error: str | None = None, runner: str | None = None) -> bool:
        """The job ended in ``state``; with ``runner``, only while that runner still holds it; whether it did."""
        return self._update_held(job_id, runner, dict(state=state, error=error, finished_at=utcnow()))

    def request_cancel(self, job_id: int) -> Job:
        """Queued jobs are cancelled at once; running ones at the loop's next check. Conditional UPDATEs: a job
        that starts meanwhile (``start_job``) is asked to stop instead, never left running."""
        with self.session() as s, s.begin():
            queued = s.execute(
                update(Job)
                .where(Job.id == job_id, Job.state == "queued")
                .values(state="cancelled", finished_at=utcnow())
            ).rowcount
            if not queued:
                s.execute(update(Job).where(Job.id == job_id, Job.state == "running").values(cancel_requested=True))
        job = self.get_job(job_id)
        if job is None:
            raise KeyError(job_id)
        return job

    def cancel_requested(self, job_id: int) -> bool:
        with self.session() as s:
            return bool(s.scalar(select(Job.cancel_requested).where(Job.id == job_id)))

    # -- trials ------------------------------------------------------------------

    def trials(self, job_id: int, shape: str | None = None) -> list[Trial]:
        query = select(Trial).where(Trial.job_id == job_id)
        if shape is not None:
            query = query.where(Trial.shape_key == shape)
        with self.session() as s:
            return list(s.scalars(query.order_by(Trial.seq)).all())

    def record_trials(
        self, job_id: int, shape: str, rows: Iterable[dict[str, Any]], runner: str | None = None
    ) -> list[Trial] | None:
        """Insert trials; a candidate already recorded for this job and shape is skipped (no duplicates). With
        ``runner``, only while that runner still holds the job: None where it does not (nothing recorded)."""
        added = []
        with self.session() as s:
            # The job's row first, written unchanged where the runner holds it: its lock (SQLite's write lock, a
            # row lock elsewhere) keeps another writer's trials, and a takeover, out until the commit.
            touched = s.execute(_held(update(Job).where(Job.id == job_id), runner).values(id=Job.id)).rowcount
            if not touched:
                s.rollback()
                return None
            seq = s.scalar(select(func.coalesce(func.max(Trial.seq), 0)).where(Trial.job_id == job_id)) or 0
            for row in rows:
                seq += 1
                trial = Trial(job_id=job_id, shape_key=shape, seq=seq, **row)
                try:
                    with s.begin_nested():
                        s.add(trial)
                except IntegrityError:
                    seq -= 1
                    log.info("job %s: trial %s %s already recorded", job_id, row.get("family"), row.get("params"))
                    continue
                added.append(trial)
            s.commit()
        return added

    def list_trials(
        self,
        job_id: int,
        sort: str = "seq",
        descending: bool = False,
        status: str | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> tuple[list[Trial], int]:
        column = {"seq": Trial.seq, "median_ms": Trial.median_ms, "status": Trial.status, "family": Trial.family}[sort]
        query = select(Trial).where(Trial.job_id == job_id)
        if status:
            query = query.where(Trial.status == status)
        order = column.desc() if descending else column.asc()
        with self.session() as s:
            total = s.scalar(select(func.count()).select_from(query.subquery())) or 0
            rows = s.scalars(query.order_by(order.nulls_last(), Trial.seq).limit(limit).offset(offset)).all()
        return list(rows), total

    def set_trial_profile(self, job_id: int, shape: str, family: str, params_key: str, profile: dict) -> None:
        with self.session() as s, s.begin():
            trial = s.scalar(
                select(Trial).where(
                    Trial.job_id == job_id, Trial.shape_key == shape, Trial.family == family,
                    Trial.params_key == params_key,
                )
            )  # fmt: skip
            if trial is not None:
                trial.profile = profile

    def best_trials_elsewhere(self, job: Job, limit_jobs: int = 50) -> list[tuple[Trial, Job]]:
        """The fastest verified trial of each (job, shape) of other jobs of the same op (warm starts)."""
        with self.session() as s:
            others = s.scalars(
                select(Job).where(Job.op == job.op, Job.id != job.id).order_by(Job.id.desc()).limit(limit_jobs)
            ).all()
            out = []
            for other in others:
                for shape in other.shapes:
                    best = s.scalar(
                        select(Trial)
                        .where(Trial.job_id == other.id, Trial.shape_key == shape_key(shape), Trial.status == "ok")
                        .order_by(Trial.median_ms.asc())
                        .limit(1)
                    )
                    if best is not None:
                        out.append((best, other))
        return out

    def trial(self, trial_id: int, with_cubin: bool = False) -> Trial | None:
        with self.session() as s:
            opts = [undefer(Trial.cubin)] if with_cubin else []
            return s.get(Trial, trial_id, options=opts)

    def trial_profile(self, trial_id: int) -> dict[str, Any] | None:
        """A trial's profile alone (what a served kernel shows of its trial), without loading the row."""
        with self.session() as s:
            return s.scalar(select(Trial.profile).where(Trial.id == trial_id))

    def best_trial(
        self, job_id: int, shape: str, device_name: str | None = None, passed_over: Sequence[int] = ()
    ) -> Trial | None:
        """The fastest verified trial of a job's shape, cubin loaded; with ``device_name``, of those timed on
        that GPU model (or on an unrecorded one: rows from before trials had one); none of ``passed_over``."""
        query = (
            select(Trial)
            .options(undefer(Trial.cubin))
            .where(Trial.job_id == job_id, Trial.shape_key == shape, Trial.status == "ok")
            .order_by(Trial.median_ms.asc(), Trial.id.asc())  # the earlier of equal times, as ``summaries``
            .limit(1)
        )
        if device_name:
            query = query.where(or_(Trial.device_name == device_name, Trial.device_name.is_(None)))
        if passed_over:
            query = query.where(Trial.id.not_in(list(passed_over)))
        with self.session() as s:
            return s.scalar(query)

    def summary(self, job: Job) -> list[ShapeSummary]:
        """Per shape: trials done and failed, best time, PyTorch baseline."""
        return self.summaries([job])[job.id]

    def summaries(self, jobs: Sequence[Job]) -> dict[int, list[ShapeSummary]]:
        """``summary`` of each job, by id, in three queries whatever the jobs and shapes (a page of 500 jobs of 32
        shapes each took three queries a shape: 48,000)."""
        ids = [job.id for job in jobs]
        if not ids:
            return {}
        with self.session() as s:
            counts: dict[tuple[int, str], dict[str, int]] = {}
            by_status = (
                select(Trial.job_id, Trial.shape_key, Trial.status, func.count())
                .where(Trial.job_id.in_(ids))
                .group_by(Trial.job_id, Trial.shape_key, Trial.status)
            )
            for job_id, key, status, n in s.execute(by_status):
                counts.setdefault((job_id, key), {})[status] = n
            # The fastest ok trial of each job and shape (the earlier of equal times).
            rank = (
                func.row_number()
                .over(partition_by=(Trial.job_id, Trial.shape_key), order_by=(Trial.median_ms.asc(), Trial.id.asc()))
                .label("rank")
            )
            ranked = (
                select(Trial.job_id, Trial.shape_key, Trial.id, Trial.median_ms, rank)
                .where(Trial.job_id.in_(ids), Trial.status == "ok")
                .subquery()
            )
            fastest = select(ranked.c.job_id, ranked.c.shape_key, ranked.c.id, ranked.c.median_ms).where(
                ranked.c.rank == 1
            )
            best = {(job_id, key): (trial_id, ms) for job_id, key, trial_id, ms in s.execute(fastest)}
            baselines = select(Baseline.job_id, Baseline.shape_key, Baseline.median_ms).where(Baseline.job_id.in_(ids))
            base = {(job_id, key): ms for job_id, key, ms in s.execute(baselines)}
        out: dict[int, list[ShapeSummary]] = {}
        for job in jobs:
            rows = out[job.id] = []
            for shape in job.shapes:
                key = shape_key(shape)
                tally = counts.get((job.id, key), {})
                total = sum(tally.values())
                trial_id, ms = best.get((job.id, key), (None, None))
                rows.append(ShapeSummary(key, total, total - tally.get("ok", 0), ms, trial_id, base.get((job.id, key))))
        return out

    # -- baselines -----------------------------------------------------------------

    def record_baseline(self, job_id: int, shape: str, median_ms: float | None, device_name: str | None) -> None:
        with self.session() as s, s.begin():
            row = s.scalar(select(Baseline).where(Baseline.job_id == job_id, Baseline.shape_key == shape))
            if row is None:
                s.add(Baseline(job_id=job_id, shape_key=shape, median_ms=median_ms, device_name=device_name))
            else:
                row.median_ms, row.device_name = median_ms, device_name

    def has_baseline(self, job_id: int, shape: str) -> bool:
        with self.session() as s:
            query = select(Baseline.id).where(Baseline.job_id == job_id, Baseline.shape_key == shape)
            return s.scalar(query) is not None

    def baseline(self, job_id: int, shape: str) -> float | None:
        with self.session() as s:
            return s.scalar(select(Baseline.median_ms).where(Baseline.job_id == job_id, Baseline.shape_key == shape))

    def baseline_device(self, job_id: int, shape: str) -> str | None:
        """The GPU model a job's baseline for ``shape`` was timed on (None: none recorded, or not said)."""
        with self.session() as s:
            query = select(Baseline.device_name).where(Baseline.job_id == job_id, Baseline.shape_key == shape)
            return s.scalar(query)

    # -- served kernels --------------------------------------------------------------

    def publish(self, job: Job, trial: Trial, fields: dict[str, Any]) -> Kernel | None:
        """Serve ``trial`` for its problem on its job's GPU model unless a faster kernel is already served for
        it there. Each GPU model of an arch has its own (an H100's best tiles are not an H200's): lookups
        prefer the asker's model and otherwise take the highest speedup over each GPU's own PyTorch."""
        with self._publish_lock:
            try:
                return self._publish(job, trial, fields)
            except IntegrityError:  # another process published the same problem first: compare with it
                return self._publish(job, trial, fields)
            finally:
                self.served_version += 1

    def _publish(self, job: Job, trial: Trial, fields: dict[str, Any]) -> Kernel | None:
        key = attrs_key(job.attrs)
        precision = family_precision(job.op, trial.family, job.dtype)
        with self.session() as s, s.begin():
            if s.get_bind().dialect.name == "sqlite":
                # SQLite has no FOR UPDATE, and its driver begins a transaction at the first write, after this
                # read: another process could then replace the kernel read here. Take the write lock first.
                s.execute(text("BEGIN IMMEDIATE"))
            current = s.scalar(
                select(Kernel)
                .where(
                    Kernel.op == job.op,
                    Kernel.shape_key == trial.shape_key,
                    Kernel.dtype == job.dtype,
                    Kernel.arch == trial.arch,
                    Kernel.attrs_key == key,
                    Kernel.precision == precision,
                    Kernel.device_key == (job.device_name or ""),
                )
                .with_for_update()
            )
            if current is not None and current.trial_id != trial.id and not trial.median_ms < current.median_ms:
                return current
            kernel = current or Kernel(
                op=job.op,
                shape_key=trial.shape_key,
                dtype=job.dtype,
                arch=trial.arch,
                precision=precision,
                device_key=job.device_name or "",
            )
            kernel.shape = [int(v) for v in trial.shape_key.split("x")]
            kernel.attrs, kernel.attrs_key = dict(job.attrs or {}), key
            kernel.family, kernel.params = trial.family, trial.params
            kernel.median_ms, kernel.max_rel_err, kernel.ptxas = trial.median_ms, trial.max_rel_err, trial.ptxas
            kernel.trial_id, kernel.job_id, kernel.device_name = trial.id, job.id, job.device_name
            for name, value in fields.items():
                setattr(kernel, name, value)
            # None where this trial's job timed no baseline: not the speedup of the kernel it replaces.
            kernel.speedup = kernel.baseline_ms / kernel.median_ms if kernel.baseline_ms else None
            s.add(kernel)
        return kernel

    def list_kernels(
        self,
        op: str | None = None,
        dtype: str | None = None,
        arch: str | None = None,
        limit: int = 100,
        offset: int = 0,
        precision: str | None = None,
    ) -> tuple[list[Kernel], int]:
        query = select(Kernel)
        filters = ((Kernel.op, op), (Kernel.dtype, dtype), (Kernel.arch, arch), (Kernel.precision, precision))
        for column, value in filters:
            if value:
                query = query.where(column == value)
        with self.session() as s:
            total = s.scalar(select(func.count()).select_from(query.subquery())) or 0
            rows = s.scalars(query.order_by(Kernel.op, Kernel.shape_key, Kernel.id).limit(limit).offset(offset)).all()
        return list(rows), total

    def served_fingerprint(self) -> int:
        """A digest of the served kernels (each row's id, trial and last change): it changes whenever any
        process publishes, so that caches of served answers know when to drop what they hold."""
        with self.session() as s:
            rows = s.execute(select(Kernel.id, Kernel.trial_id, Kernel.updated_at).order_by(Kernel.id)).all()
        return hash(tuple(tuple(row) for row in rows))

    def kernel(self, kernel_id: int, with_cubin: bool = False) -> Kernel | None:
        with self.session() as s:
            opts = [undefer(Kernel.cubin)] if with_cubin else []
            return s.get(Kernel, kernel_id, options=opts)

    def served_shapes(
        self,
        op: str,
        dtype: str,
        arch: str | None,
        attrs: dict[str, Any] | None = None,
        precision: str | None = None,
    ) -> list[Served]:
        """Every kernel served for a problem (id, shape, GPU model, speedup), in id order; of any arch when
        ``arch`` is None; computing in ``precision`` (default: the dtype itself)."""
        problem = _problem(op, dtype, arch, attrs, precision)
        columns = (Kernel.id, Kernel.shape, Kernel.device_name, Kernel.speedup)
        with self.session() as s:
            rows = s.execute(select(*columns).where(*problem).order_by(Kernel.id))
            return [Served(kernel_id, list(shape), device, speedup) for kernel_id, shape, device, speedup in rows]

    def served_problems(self, op: str) -> list[tuple[str, str, str, dict[str, Any]]]:
        """The problems ``op`` has kernels served for, each once: (dtype, precision, arch, attributes), sorted;
        what a best-kernel lookup that missed is told it could have asked for."""
        columns = (Kernel.dtype, Kernel.precision, Kernel.arch, Kernel.attrs_key)
        with self.session() as s:
            rows = s.execute(select(*columns).where(Kernel.op == op).distinct()).all()
        return [(dtype, precision, arch, json.loads(key)) for dtype, precision, arch, key in sorted(set(rows))]

    def best_kernel(
        self,
        op: str,
        shape: Sequence[int],
        dtype: str,
        arch: str | None,
        attrs: dict[str, Any] | None = None,
        precision: str | None = None,
        device: str | None = None,
    ) -> tuple[Kernel, bool] | None:
        """The kernel for exactly this shape, else the nearest tuned shape, with ``exact``; of those, the one
        tuned on ``device`` where there is one (``nearest_shape``); computing in ``precision`` (default: the
        dtype itself). Only the chosen kernel's row is loaded."""
        found = nearest_shape(self.served_shapes(op, dtype, arch, attrs, precision), shape, device)
        if found is None:
            return None
        with self.session() as s:
            kernel = s.get(Kernel, found[0])
        return None if kernel is None else (kernel, found[1])

    # -- devices ---------------------------------------------------------------------

    def upsert_device(self, worker: str, **fields: Any) -> DeviceRow:
        try:
            return self._upsert_device(worker, fields)
        except IntegrityError:  # another service inserted the same worker's row first: update that one
            return self._upsert_device(worker, fields)

    def _upsert_device(self, worker: str, fields: dict[str, Any]) -> DeviceRow:
        with self.session() as s, s.begin():
            row = s.scalar(select(DeviceRow).where(DeviceRow.worker == worker))
            if row is None:
                row = DeviceRow(worker=worker, **fields)
                s.add(row)
            else:
                for key, value in fields.items():
                    setattr(row, key, value)
            row.last_seen = utcnow()
        return row

    def devices(self) -> list[DeviceRow]:
        with self.session() as s:
            return list(s.scalars(select(DeviceRow).order_by(DeviceRow.worker)).all())

    # -- forward profiles (kernelmill profile-forward) ------------------------------------------------

    def record_forward_profile(self, summary: dict[str, Any]) -> ForwardProfileRow:
        """Store one complete summary (``ForwardProfile.to_dict()``) in one insert; returns the row."""
        gaps, memcpy = summary.get("gaps") or {}, summary.get("memcpy") or {}

        def us(value: float | None) -> float | None:
            return None if value is None else value / 1e3

        row = ForwardProfileRow(
            model=summary["model"],
            dtype=summary["dtype"],
            batch=summary["batch"],
            seq=summary.get("seq"),
            iters=summary["iters"],
            graphs=bool(summary.get("graphs")),
            device_name=summary.get("device_name"),
            nsys_version=summary.get("nsys_version"),
            kernel_time_ms=summary["kernel_time_ns"] / 1e6,
            kernel_launches=summary["kernel_launches"],
            kernel_ms_per_forward=summary["kernel_time_ns"] / 1e6 / summary["iters"],
            gap_total_ms=(gaps.get("total_ns") or 0.0) / 1e6,
            gap_median_us=us(gaps.get("median_ns")),
            gap_max_us=us(gaps.get("max_ns")),
            memcpy_time_ms=(memcpy.get("time_ns") or 0.0) / 1e6,
            memcpy_bytes=int(memcpy.get("bytes") or 0),
            summary=summary,
        )
        with self.session() as s, s.begin():
            s.add(row)
        return row

    def list_forward_profiles(
        self, model: str | None = None, limit: int = 50, offset: int = 0
    ) -> tuple[list[ForwardProfileRow], int]:
        """Newest first, without their summaries."""
        query = select(ForwardProfileRow).options(defer(ForwardProfileRow.summary))
        if model:
            query = query.where(ForwardProfileRow.model == model)
        with self.session() as s:
            total = s.scalar(select(func.count()).select_from(query.subquery())) or 0
            rows = s.scalars(query.order_by(ForwardProfileRow.id.desc()).limit(limit).offset(offset)).all()
        return list(rows), total

    def forward_profile(self, profile_id: int) -> ForwardProfileRow | None:
        with self.session() as s:
            return s.get(ForwardProfileRow, profile_id)
