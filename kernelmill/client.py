"""What the CLI does against a server (httpx) or, without one, against the local store and GPU."""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kernelmill.runtime.registry import answer_detail, checked_server_url, excerpt
from kernelmill.service.api.schemas import JobOut, KernelSummary, Page, WorkersOut
from kernelmill.service.db.models import ACTIVE_STATES
from kernelmill.settings import Settings, get_settings

log = logging.getLogger(__name__)


class ServerError(ValueError):
    """The server refused a request (``status``, where it answered one) or could not be reached
    (``unreachable``); the message says why."""

    def __init__(self, message: str, *, unreachable: bool = False, status: int | None = None) -> None:
        super().__init__(message)
        self.unreachable = unreachable
        self.status = status

    @property
    def transient(self) -> bool:
        """Whether asking again later may succeed: a server restarting (unreachable, or a proxy's 502-504)."""
        return self.unreachable or (self.status is not None and self.status >= 500)


#: How long ``follow_jobs`` keeps asking a server it lost (restarting, say) before it stops watching.
RECONNECT_S = 120.0


def server_url(url: str) -> str:
    """``url`` without a trailing slash where it is an http(s) URL with a host; ServerError says what is wrong."""
    try:
        return checked_server_url(url)
    except ValueError as exc:
        raise ServerError(str(exc)) from None


#: How long a request waits to connect, and then for each part of the answer.
ANSWER_TIMEOUT_S = 30.0


def _request(method: str, url: str, *, expect: Any = None, **kw) -> Any:
    """The JSON the server answers, checked against ``expect`` (a type of the API's schemas) where given: a
    ServerError says when it is not JSON or not what the API answers (another service on that port, a proxy)."""
    token = get_settings().api_token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        resp = httpx.request(method, url, headers=headers, timeout=ANSWER_TIMEOUT_S, **kw)
    except httpx.TimeoutException as exc:  # "cannot reach ...: timed out" read as a server down, not a slow one
        what = f"could not connect to {url}" if isinstance(exc, httpx.ConnectTimeout) else f"no answer from {url}"
        raise ServerError(f"{what} within {ANSWER_TIMEOUT_S:g} s", unreachable=True) from None
    except httpx.HTTPError as exc:
        raise ServerError(f"cannot reach {url}: {exc}", unreachable=True) from None
    if resp.status_code >= 400:
        raise ServerError(f"server answered {resp.status_code}: {answer_detail(resp)}", status=resp.status_code)
    try:
        data = resp.json()
    except ValueError:
        raise ServerError(f"{url} answered something that is not JSON: {excerpt(resp.text, 60)}") from None
    if expect is not None:
        from pydantic import TypeAdapter, ValidationError

        try:
            TypeAdapter(expect).validate_python(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "the body"
            name = getattr(expect, "__name__", str(expect))
            raise ServerError(f"{url} answered what is not a {name} ({where}: {first['msg']})") from None
    return data


#: Without a terminal (a log, a pipe), the most often a job's plain progress line is printed while it advances.
PLAIN_EVERY_S = 10.0


class _JobProgress(Progress):
    """Rich's progress bars on a terminal. Elsewhere rich draws nothing until the end, which for an hour's job is
    an hour of silence in a log: there a task's plain line is printed whenever its description (state, shape)
    changes, and at most every ``PLAIN_EVERY_S`` while it advances."""

    def __init__(self, console: Console) -> None:
        super().__init__(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("failed {task.fields[failed]}"),
            TextColumn("best {task.fields[best]}"),
            TextColumn("vs torch {task.fields[speedup]}"),
            TimeElapsedColumn(),
            console=console,
        )
        self._plain = not console.is_terminal
        self._said: dict[Any, tuple[float, str, str]] = {}  # task -> (when, description, line)

    def update(self, task_id, **kwargs: Any) -> None:
        super().update(task_id, **kwargs)
        if not self._plain:
            return
        task = next(t for t in self.tasks if t.id == task_id)
        f = task.fields
        line = (
            f"{task.description}: {task.completed:g}/{task.total:g} trials, failed {f['failed']}, best {f['best']}, "
            f"vs torch {f['speedup']}"
        )
        when, description, said = self._said.get(task_id, (-math.inf, "", ""))
        now = time.monotonic()
        if line != said and (task.description != description or now - when >= PLAIN_EVERY_S):
            self._said[task_id] = (now, task.description, line)
            self.console.print(line, markup=False, highlight=False)


def _progress(console: Console) -> Progress:
    return _JobProgress(console)


def _fmt(best_ms: float | None, speedup: float | None) -> dict[str, str]:
    return {
        "best": f"{best_ms * 1e3:.1f} us" if best_ms else "-",
        "speedup": f"{speedup:.2f}x" if speedup else "-",
    }


def tune_remote(server: str, fields: dict[str, Any], console: Console, poll_s: float = 1.0) -> dict[str, Any]:
    base = server.rstrip("/")
    body = {
        "op": fields["op"],
        "shapes": fields["shapes"],
        "dtype": fields["dtype"],
        "strategy": fields["strategy"],
        "attrs": {k: str(v) for k, v in fields["attrs"].items()},
        "budget": {"trials": fields["budget_trials"], "seconds": fields["budget_seconds"]},
    }
    if fields.get("families"):  # only when named: a service from before families refuses the field
        body["families"] = fields["families"]
    if fields.get("arch", "auto") != "auto":
        body["arch"] = fields["arch"]
    job = _request("POST", f"{base}/api/jobs", json=body, expect=JobOut)
    console.print(f"job {job['id']} submitted to {base}")
    return follow_jobs(base, [job], console, poll_s)[0]


def follow_jobs(server: str, jobs: list[dict[str, Any]], console: Console, poll_s: float = 1.0) -> list[dict[str, Any]]:
    """Watches submitted jobs to their end, a progress bar each (trials, failures, best time, speedup), then
    prints each one's summary; returns their last states. While one waits on a server with no GPU worker it
    says why, once. Ctrl-C stops watching and says the jobs go on."""
    base = server.rstrip("/")
    jobs = list(jobs)
    said_idle, next_check = False, 0.0
    lost_since: float | None = None  # when the server stopped answering (a restart: its jobs go on)
    try:
        with _progress(console) as bar:
            tasks = [
                bar.add_task(f"job {j['id']} {j['state']}", total=j["budget"]["trials"], failed=0, **_fmt(None, None))
                for j in jobs
            ]
            while any(j["state"] in ACTIVE_STATES for j in jobs):
                queued = next((j for j in jobs if j["state"] == "queued"), None)
                if queued is not None and not said_idle and time.monotonic() >= next_check:
                    said_idle, next_check = _say_why_queued(base, queued, bar.console), time.monotonic() + 15.0
                time.sleep(poll_s)
                for i, job in enumerate(jobs):
                    if job["state"] not in ACTIVE_STATES:
                        continue
                    try:
                        jobs[i] = job = _request("GET", f"{base}/api/jobs/{job['id']}", expect=JobOut)
                    except ServerError as exc:
                        if not exc.transient:
                            raise
                        if lost_since is None:
                            lost_since = time.monotonic()
                            bar.console.print(f"{exc}; asking again for up to {RECONNECT_S:g} s (jobs go on there)")
                        elif time.monotonic() - lost_since > RECONNECT_S:
                            _say_going_on(console, base, jobs)
                            raise
                        break
                    if lost_since is not None:
                        lost_since = None
                        bar.console.print(f"{base} answers again")
                    shapes = [s for s in job["per_shape"] if s["best_ms"]]
                    best = min(shapes, key=lambda s: s["best_ms"], default=None)
                    bar.update(
                        tasks[i],
                        completed=job["trials_done"],
                        failed=job["trials_failed"],
                        description=f"job {job['id']} {job['state']}",
                        **_fmt(best and best["best_ms"], best and best["speedup"]),
                    )
    except KeyboardInterrupt:
        _say_going_on(console, base, jobs)
        return jobs
    for job in jobs:
        _summary(console, job)
    return jobs


def _say_going_on(console: Console, base: str, jobs: list[dict[str, Any]]) -> None:
    going = [j for j in jobs if j["state"] in ACTIVE_STATES] or jobs
    ids = ", ".join(str(j["id"]) for j in going)
    what, which = (f"job {ids} goes on", ids) if len(going) == 1 else (f"jobs {ids} go on", "ID")
    console.print(f"stopped watching; {what} (cancel: kernelmill cancel {which} --server {base})")


def _say_why_queued(base: str, job: dict[str, Any], console: Console) -> bool:
    """While a job waits: if the server has no GPU worker, or none with the job's GPU (arch), says so once with
    the reason (else the bar would sit at "queued" with no word of why). True once said, or where the server
    cannot tell."""
    from kernelmill.service.jobs import no_worker_for

    try:
        workers = _request("GET", f"{base}/api/workers", expect=WorkersOut)
    except ServerError:  # only a hint: watching the job goes on
        return True
    stop = "Ctrl-C stops watching; the job stays queued"
    if not workers.get("workers"):
        console.print(
            f"{base} has no GPU worker: {workers.get('reason') or 'none has joined'}. Job {job['id']} waits in the "
            f"queue until one joins ({stop})."
        )
        return True
    why = no_worker_for(job, [w.get("arch") for w in workers["workers"]])
    if why is None:
        return False
    console.print(f"Job {job['id']} waits: {why}. It starts when one joins ({stop}), or cancel it.")
    return True


def _summary(console: Console, job: dict[str, Any]) -> None:
    console.print(f"job {job['id']} {job['state']}" + (f": {job['error']}" if job.get("error") else ""))
    for s in job["per_shape"]:
        best = f"{s['best_ms'] * 1e3:.1f} us" if s["best_ms"] else "no verified kernel"
        torch = f"{s['baseline_ms'] * 1e3:.1f} us" if s["baseline_ms"] else "n/a"
        speed = f" ({s['speedup']:.2f}x)" if s["speedup"] else ""
        console.print(f"  {s['shape']}: best {best}, torch {torch}{speed}; {s['trials']} trials, {s['failed']} failed")


def tune_embedded(settings: Settings, fields: dict[str, Any], console: Console) -> dict[str, Any]:
    """Run the job in this process on this GPU, recorded in the local database."""
    from kernelmill.agents.evaluator import LocalEvaluator
    from kernelmill.agents.loop import JobPlan, NothingVerified, run_job
    from kernelmill.kernels.compile import NvccMissing
    from kernelmill.kernels.device import GpuUnavailable
    from kernelmill.service.api.jobs import job_out
    from kernelmill.service.db.store import Store
    from kernelmill.service.jobs import JobRunner, StoreRecorder

    evaluator = LocalEvaluator(0, settings.verify_seeds, settings.bench_reps, settings.kernel_timeout_s)
    store = Store(settings.database_url)
    facts = evaluator.facts()
    # Created running and leased to this process like a service's runner, so a service on the same database
    # neither takes it while queued or as lapsed while it runs here, nor finds it stuck "running" should this
    # process die.
    runner = f"tune@{socket.gethostname()}:{os.getpid()}"
    job = store.create_running_job("embedded", facts.name, runner, JobRunner.lease_s, **{**fields, "arch": facts.arch})
    plan = JobPlan(
        job.id,
        job.op,
        [tuple(s) for s in job.shapes],
        job.dtype,
        job.attrs,
        job.strategy,
        job.budget_trials,
        job.budget_seconds,
        batch_size=settings.batch_size,
        families=job.families,
    )
    console.print(
        f"job {job.id} on {facts.name} ({facts.arch}), recorded in {_without_password(settings.database_url)}"
    )
    with _progress(console) as bar:
        task = bar.add_task(f"job {job.id}", total=job.budget_trials, failed=0, **_fmt(None, None))

        def show(p) -> None:
            bar.update(
                task,
                completed=p.trials,
                failed=p.failed,
                description=f"job {job.id} {p.shape}",
                **_fmt(p.best_ms, p.speedup),
            )

        error = None
        try:
            with _lease_kept(store, runner, job.id):
                state = run_job(plan, evaluator, StoreRecorder(store, job.id, runner=runner), show)
        except KeyboardInterrupt:
            store.finish_job(job.id, "cancelled", "interrupted", runner=runner)
            raise
        except NothingVerified as exc:  # the search ran and none of its trials verified: nothing served
            state, error = "failed", str(exc)
        except NvccMissing as exc:  # the machine has no nvcc: every trial would have been a "compile_error"
            state, error = "failed", f"stopped: {exc}; the trials so far are recorded"
        except GpuUnavailable as exc:  # a fault poisoned this process's context: nothing more runs here
            state = "failed"
            error = (
                f"stopped: {exc}; the trials so far are recorded (a service's worker is replaced after such a fault "
                "and the job goes on: kernelmill serve, then tune --server)"
            )
        except BaseException as exc:
            store.finish_job(job.id, "failed", f"{type(exc).__name__}: {exc}", runner=runner)
            raise
    if not store.finish_job(job.id, state, error, runner=runner):
        console.print(f"job {job.id} stopped here: its lease lapsed and it was queued again, to resume elsewhere")
    out = job_out(store, store.get_job(job.id)).model_dump()
    _summary(console, out)
    return out


@contextmanager
def _lease_kept(store: Any, runner: str, job_id: int) -> Iterator[None]:
    """Renews ``runner``'s lease on the job every third of its length, from a thread, while the body runs."""
    from kernelmill.service.jobs import JobRunner

    stop = threading.Event()

    def renew() -> None:
        while not stop.wait(JobRunner.lease_s / 3):
            try:
                store.renew_leases(runner, [job_id], JobRunner.lease_s)
            except Exception as exc:  # noqa: BLE001 - a busy database: the next renewal may pass
                log.warning("job %s: renewing its lease failed: %s", job_id, exc)

    keeper = threading.Thread(target=renew, name=f"lease-job-{job_id}", daemon=True)
    keeper.start()
    try:
        yield
    finally:
        stop.set()
        keeper.join()


def fetch_jobs(server: str | None, state: str | None, limit: int) -> list[dict[str, Any]]:
    if server:
        params = {"limit": limit, **({"state": state} if state else {})}
        return _request("GET", f"{server.rstrip('/')}/api/jobs", params=params, expect=Page[JobOut])["items"]
    from kernelmill.service.api.jobs import jobs_out
    from kernelmill.service.db.store import Store

    if missing_local_database():
        return []
    store = Store(get_settings().database_url)
    rows, _ = store.list_jobs(state, None, limit)
    return [j.model_dump(mode="json") for j in jobs_out(store, rows)]  # as the API answers them


def cancel_job(server: str | None, job_id: int) -> tuple[dict[str, Any], str | None]:
    """Asks a job to stop (a queued one is cancelled at once, a running one after its current batch) on the server,
    or in the local database, where a `serve` or `tune` running it sees the request; returns the job, and the
    runner that had held it where the job ended at once because that runner had died (its lease lapsed: no process
    would ever see the request). A job that does not exist or has ended is a ServerError (not found, or already
    ended)."""
    if server:
        return _request("POST", f"{server.rstrip('/')}/api/jobs/{job_id}/cancel", expect=JobOut), None
    from kernelmill.service.api.jobs import job_out
    from kernelmill.service.db.models import ENDED_STATES
    from kernelmill.service.db.store import Store

    missing = missing_local_database()
    if missing:
        raise ServerError(f"no job {job_id}: no database at {missing} yet (KERNELMILL_DATABASE_URL)")
    store = Store(get_settings().database_url)
    job = store.get_job(job_id)
    if job is None:
        raise ServerError(f"no job with id {job_id} in the local database")
    if job.state in ENDED_STATES:
        raise ServerError(f"job {job_id} is already {job.state}")
    asked = store.request_cancel(job_id)
    # A service recovers the lapsed jobs of its database, but with none running a dead `tune`'s job stayed
    # "running" for ever: it is ended here, as a service would (only while its lease is still lapsed).
    if asked.state == "running" and store.recover_lapsed(job_id) == "cancelled":
        return job_out(store, store.get_job(job_id)).model_dump(), asked.runner or "its runner"
    return job_out(store, asked).model_dump(), None


def fetch_kernels(server: str | None, op: str | None, dtype: str | None) -> list[dict[str, Any]]:
    """Every served kernel that matches, page after page."""
    if server:
        params = {k: v for k, v in {"op": op, "dtype": dtype}.items() if v}
        url, page = f"{server.rstrip('/')}/api/kernels", Page[KernelSummary]

        def fetch(offset: int) -> tuple[list[dict[str, Any]], int]:
            got = _request("GET", url, params={**params, "limit": KERNELS_PAGE, "offset": offset}, expect=page)
            return got["items"], got["total"]

        return _all_pages(fetch)
    from kernelmill.service.db.store import Store

    if missing_local_database():
        return []
    store = Store(get_settings().database_url)

    def fetch_local(offset: int) -> tuple[list[dict[str, Any]], int]:
        rows, total = store.list_kernels(op, dtype, limit=KERNELS_PAGE, offset=offset)
        return [KernelSummary.model_validate(k).model_dump(mode="json") for k in rows], total

    return _all_pages(fetch_local)


#: Kernels asked for a page (the API's largest page).
KERNELS_PAGE = 1000


def _all_pages(fetch) -> list[dict[str, Any]]:
    """The items of ``fetch(offset) -> (items, total)`` from offset 0 until ``total`` are in (or a page is empty:
    rows removed meanwhile)."""
    items: list[dict[str, Any]] = []
    while True:
        page, total = fetch(len(items))
        items += page
        if not page or len(items) >= total:
            return items


def _without_password(database_url: str) -> str:
    """The database URL (one Store opened) for a terminal line: a PostgreSQL password in it is shown as ***."""
    from sqlalchemy.engine import make_url

    return make_url(database_url).render_as_string(hide_password=True)


def missing_local_database() -> Path | None:
    """The local database's file where it is an SQLite file that does not exist yet, else None: listing it is
    listing nothing, and a read-only command does not create it."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(get_settings().database_url)
    except ArgumentError:
        return None  # Store says what is wrong with it
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    path = Path(url.database).absolute()
    return None if path.exists() else path
