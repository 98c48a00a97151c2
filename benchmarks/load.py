"""Load test of the REST service on loopback: best-kernel lookups at a fixed rate, then job submissions.

    python benchmarks/load.py                     # ~40 s; prints a table, writes JSON
    python benchmarks/load.py --out load.json --lookup-rps 200 --lookup-s 20 --submit-rps 20 --submit-s 10

Starts `kernelmill serve` as a subprocess on 127.0.0.1 (fake executor, a temporary SQLite database with
kernels published beforehand through the store), then:

1. GET /api/kernels/best, open loop at a fixed arrival rate (a request is sent on schedule whether or
   not earlier ones have answered); half ask for a tuned shape (exact), half for an untuned one (nearest).
   Latency is measured from the scheduled send time, so a stalled server cannot hide its queueing.
2. POST /api/jobs at a fixed rate with the write token; afterwards every accepted job (201) must be in
   the database, read directly through the store: nothing accepted may be lost.

The load generator speaks HTTP/1.1 itself (``Connection``: keep-alive, one request in flight per connection)
rather than through httpx, so that it takes little of the CPU it shares with the server (~0.5 ms a request
instead of ~3 ms on two cores).

Bounded: every phase has a fixed duration, every request a timeout, the whole run a deadline (60 s by
default), and traffic only ever goes to 127.0.0.1. Target: p99 <= 10 ms for the lookups.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlencode

import httpx

HOST = "127.0.0.1"  # loopback only, never anything else
P99_TARGET_MS = 10.0

# Tuned shapes published before the run: what the lookups find (exactly or as the nearest).
PUBLISHED = {
    ("softmax", "float16", ()): [(r, c) for r in (1024, 4096, 16384) for c in (512, 1024, 4096, 8192)],
    ("matmul", "float16", ()): [(n, n, n) for n in (256, 512, 1024, 2048, 4096, 8192)],
    ("fused_mlp", "float16", (("act", "gelu_tanh"),)): [(b, 1024, 4096, 1024) for b in (1, 8, 32, 128)],
}


@dataclass
class PhaseResult:
    name: str
    target_rps: float
    seconds: float
    sent: int = 0
    ok: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    achieved_rps: float = 0.0
    p50_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    service_p99_ms: float | None = None  # from the actual send (without client-side lateness)
    max_send_lag_ms: float | None = None  # how late the generator sent its latest request
    server_cpu_ms_per_request: float | None = None  # the service process, all its threads
    client_cpu_ms_per_request: float | None = None  # the load generator's processes


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return ordered[rank]


def seed_database(url: str) -> int:
    """Publish the PUBLISHED kernels through the store, as finished jobs would have."""
    from kernelmill.agents.evaluator import TrialResult
    from kernelmill.service.db.store import Store, shape_key

    store = Store(url)
    count = 0
    try:
        for (op, dtype, attrs), shapes in PUBLISHED.items():
            job = store.create_job(
                op=op, shapes=[list(s) for s in shapes], dtype=dtype, attrs=dict(attrs), strategy="random",
                budget_trials=len(shapes), budget_seconds=60.0, state="done",
            )  # fmt: skip
            for shape in shapes:
                key = shape_key(shape)
                ms = 1e-6 * math.prod(shape) + 0.01
                row = TrialResult(
                    "seeded", {"BLOCK": 256}, "ok", None, "sm_90", "seed", max_rel_err=1e-6, median_ms=ms,
                    min_ms=ms, spread=0.01, reps=10, cubin=b"\x7fELF" + bytes(4096),
                ).row()  # fmt: skip
                (trial,) = store.record_trials(job.id, key, [row])
                store.record_baseline(job.id, key, ms * 1.3, "FakeGPU")
                launches = [{"entry": f"{op}_seeded", "grid": [128, 1, 1], "block": [256, 1, 1], "smem_bytes": 0}]
                source = f'// seeded {op} {key}\nextern "C" __global__ void {op}_seeded() {{}}\n' + "//\n" * 200
                fields = {"source": source, "launches": launches, "workspace": {}, "cubin": row["cubin"]}
                store.publish(store.get_job(job.id), trial, {**fields, "baseline_ms": ms * 1.3})
                count += 1
    finally:
        store.close()
    return count


def lookup_queries(rng: random.Random, count: int, untuned: int) -> list[dict[str, str]]:
    """Half ask for a tuned shape (exact), half for an untuned one near a tuned one (the nearest path).

    Clients ask for the shapes of their models again and again: the untuned shapes come from a pool of
    ``untuned`` shapes; ``untuned=0`` makes each one new (every nearest lookup misses any cache).
    """
    problems = list(PUBLISHED.items())

    def near() -> tuple:
        (op, dtype, attrs), shapes = rng.choice(problems)
        shape = tuple(max(1, int(v * rng.uniform(0.6, 1.6))) for v in rng.choice(shapes))
        return (op, dtype, attrs), shape

    pool = [near() for _ in range(untuned)]
    queries = []
    for _ in range(count):
        if rng.random() < 0.5:
            (op, dtype, attrs), shapes = rng.choice(problems)
            shape = rng.choice(shapes)
        else:
            (op, dtype, attrs), shape = rng.choice(pool) if pool else near()
        queries.append({"op": op, "shape": "x".join(map(str, shape)), "dtype": dtype, **dict(attrs)})
    return queries


def job_body(rng: random.Random) -> dict:
    rows, cols = rng.choice([(1024, 1024), (2048, 512), (4096, 256), (512, 8192)])
    return {
        "op": "softmax",
        "shapes": [[rows, cols]],
        "dtype": rng.choice(["float16", "float32"]),
        "strategy": "random",
        "budget": {"trials": 4, "seconds": 60},
    }


@dataclass
class Samples:
    """What one load process saw: latencies in seconds (from the scheduled time and from the send)."""

    latencies: list[float] = field(default_factory=list)
    service: list[float] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    ok: int = 0
    sent: int = 0
    exact: int = 0
    accepted: dict[int, int] = field(default_factory=dict)  # request index -> job id (submissions)
    last_done: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time while sending


class HttpError(Exception):
    """A request that got no answer: the connection closed early or the answer was malformed."""


class Connection:
    """One HTTP/1.1 keep-alive connection, one request at a time (no pipelining).

    A minimal client on asyncio streams, so that the load generator spends a fraction of the CPU an
    httpx client does (the server shares two cores with it). It reads the status line, the headers and a
    body of Content-Length bytes (or chunked): all this service sends.
    """

    def __init__(self, host: str, port: int, headers: dict[str, str]) -> None:
        self.host, self.port = host, port
        self.head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": f"{host}:{port}", **headers}.items()).encode()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, target: str, body: bytes | None) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        extra = b"" if body is None else b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        line = b"%s %s HTTP/1.1\r\n" % (method.encode(), target.encode())
        self.writer.write(line + self.head + extra + b"\r\n" + (body or b""))
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            headers = {}
            for field_line in head.split(b"\r\n")[1:-2]:
                name, _, value = field_line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
                chunks = []
                while size := int((await self.reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16):
                    chunks.append((await self.reader.readexactly(size + 2))[:-2])
                await self.reader.readuntil(b"\r\n")  # no trailers
                content = b"".join(chunks)
            else:
                content = await self.reader.readexactly(int(headers.get(b"content-length", b"0")))
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise HttpError(f"{type(exc).__name__}: {exc}") from exc
        if headers.get(b"connection", b"").lower() == b"close":
            self.close()
        return status, content

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def send_on_schedule(
    connections: list[Connection], requests: dict[int, tuple[str, str, dict | None]],
    schedule: list[tuple[int, float]], deadline: float, timeout_s: float,
) -> Samples:  # fmt: skip
    """Send request ``i`` at its scheduled time (time.monotonic(), shared by processes), on schedule whether or
    not earlier ones have answered; at most one request in flight per connection: the rest wait here, on the
    clock (their latency counts from the scheduled time)."""
    out = Samples()
    idle: asyncio.Queue[Connection] = asyncio.Queue()
    for conn in connections:
        idle.put_nowait(conn)

    async def one(i: int, scheduled: float) -> None:
        method, url, body = requests[i]
        payload = None if body is None else json.dumps(body).encode()
        conn = await idle.get()
        try:
            sent = time.monotonic()
            out.lags.append(sent - scheduled)
            async with asyncio.timeout(timeout_s):
                status, content = await conn.request(method, url, payload)
        except (OSError, HttpError, TimeoutError) as exc:
            conn.close()  # the next request on it opens a fresh connection
            out.errors[type(exc).__name__] = out.errors.get(type(exc).__name__, 0) + 1
            return
        finally:
            idle.put_nowait(conn)
        done = time.monotonic()
        out.last_done = max(out.last_done, done)
        out.latencies.append(done - scheduled)
        out.service.append(done - sent)
        if not 200 <= status < 300:
            out.errors[f"HTTP {status}"] = out.errors.get(f"HTTP {status}", 0) + 1
            return
        out.ok += 1
        if b'"exact":true' in content:
            out.exact += 1
        if status == 201:
            out.accepted[i] = json.loads(content)["id"]

    tasks = []
    for i, scheduled in schedule:
        delay = scheduled - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if time.monotonic() > deadline:
            break
        tasks.append(asyncio.create_task(one(i, scheduled)))
        out.sent += 1
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.1, deadline - time.monotonic()))
    return out


def load_process(
    base: str, requests: dict, schedule: list, deadline: float, connections: int, timeout_s: float, headers: dict
) -> Samples:
    """One load-generating process (its own event loop, uvloop when installed, and connections)."""
    host, port = base.removeprefix("http://").rsplit(":", 1)

    async def go() -> Samples:
        conns = [Connection(host, int(port), headers) for _ in range(connections)]
        for status, _ in await asyncio.gather(*(c.request("GET", "/api/health", None) for c in conns)):
            if status != 200:  # every connection open and answered
                raise RuntimeError(f"GET /api/health answered {status}")
        cpu = time.process_time()
        samples = await send_on_schedule(conns, requests, schedule, deadline, timeout_s)
        samples.cpu_s = time.process_time() - cpu
        for conn in conns:
            conn.close()
        return samples

    try:
        import uvloop
    except ImportError:
        return asyncio.run(go())
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(go())


async def open_loop(
    result: PhaseResult, base: str, requests: list[tuple[str, str, dict | None]], deadline: float, args, token=None
) -> Samples:
    """``requests`` at ``result.target_rps`` over ``result.seconds`` from ``args.procs`` processes (request
    i of all of them at start + i / rate, dealt round-robin), merged into ``result``."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    procs = max(1, min(args.procs, len(requests)))
    start = time.monotonic() + 2.0  # time for the processes to start and connect
    schedule = [(i, start + i / result.target_rps) for i in range(len(requests))]
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(procs, mp_context=get_context("spawn")) as pool:
        futures = []
        for k in range(procs):
            mine = schedule[k::procs]
            subset = {i: requests[i] for i, _ in mine}
            futures.append(
                loop.run_in_executor(
                    pool, load_process, base, subset, mine, deadline, args.connections, args.timeout_s, headers
                )
            )
        parts = await asyncio.gather(*futures)
    merged = Samples()
    for part in parts:
        merged.latencies += part.latencies
        merged.service += part.service
        merged.lags += part.lags
        merged.ok, merged.sent, merged.exact = merged.ok + part.ok, merged.sent + part.sent, merged.exact + part.exact
        merged.accepted.update(part.accepted)
        merged.last_done, merged.cpu_s = max(merged.last_done, part.last_done), merged.cpu_s + part.cpu_s
        for kind, n in part.errors.items():
            merged.errors[kind] = merged.errors.get(kind, 0) + n
    elapsed = max(1e-9, merged.last_done - start)
    result.sent, result.ok, result.error_kinds = merged.sent, merged.ok, merged.errors
    result.errors = sum(merged.errors.values())
    result.achieved_rps = round((result.ok + result.errors) / elapsed, 1)
    ms = [v * 1e3 for v in merged.latencies]
    result.p50_ms, result.p90_ms, result.p99_ms = (percentile(ms, q) for q in (50, 90, 99))
    result.max_ms = max(ms) if ms else None
    result.service_p99_ms = percentile([v * 1e3 for v in merged.service], 99)
    result.max_send_lag_ms = max(merged.lags) * 1e3 if merged.lags else None
    result.client_cpu_ms_per_request = round(merged.cpu_s / max(1, merged.sent) * 1e3, 2)
    return merged


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_server(db_url: str, token: str, port: int, workdir: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "KERNELMILL_DATABASE_URL": db_url,
        "KERNELMILL_EXECUTOR": "fake",
        "KERNELMILL_FAKE_WORKERS": "2",
        "KERNELMILL_API_TOKEN": token,
        "KERNELMILL_CACHE_DIR": str(workdir / "cache"),
    }
    cmd = [sys.executable, "-m", "kernelmill", "serve", "--host", HOST, "--port", str(port)]
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)


async def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float) -> float:
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=base, timeout=1.0) as client:
        while time.perf_counter() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"kernelmill serve exited with {proc.returncode}")
            try:
                if (await client.get("/api/health")).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("kernelmill serve did not become healthy")


async def run(args: argparse.Namespace) -> dict:
    hard_deadline = time.monotonic() + args.max_s
    workdir = Path(tempfile.mkdtemp(prefix="kernelmill-load-"))
    db_url = f"sqlite:///{workdir}/load.db"
    published = seed_database(db_url)
    token = secrets.token_urlsafe(16)
    port = free_port()
    base = f"http://{HOST}:{port}"
    proc = start_server(db_url, token, port, workdir)
    report: dict = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "database": "sqlite (file, WAL)",
        "published_kernels": published,
        "untuned_shapes": args.untuned_shapes or "a new one per lookup",
        "p99_target_ms": P99_TARGET_MS,
    }
    try:
        report["startup_s"] = round(await wait_healthy(base, proc, 30), 2)
        rng = random.Random(args.seed)
        lookups = PhaseResult("GET /api/kernels/best", args.lookup_rps, args.lookup_s)
        queries = lookup_queries(rng, int(args.lookup_rps * args.lookup_s), args.untuned_shapes)
        requests = [("GET", f"/api/kernels/best?{urlencode(q)}", None) for q in queries]
        cpu = process_cpu_s(proc.pid)
        seen = await open_loop(lookups, base, requests, hard_deadline, args)
        lookups.server_cpu_ms_per_request = round((process_cpu_s(proc.pid) - cpu) / max(1, lookups.sent) * 1e3, 2)
        report["lookups"] = {**asdict(lookups), "exact_answers": seen.exact, "nearest_answers": seen.ok - seen.exact}

        submits = PhaseResult("POST /api/jobs", args.submit_rps, args.submit_s)
        bodies = [job_body(rng) for _ in range(int(args.submit_rps * args.submit_s))]
        base_args = argparse.Namespace(**{**vars(args), "procs": 1})
        cpu = process_cpu_s(proc.pid)
        seen = await open_loop(
            submits, base, [("POST", "/api/jobs", body) for body in bodies], hard_deadline, base_args, token
        )
        submits.server_cpu_ms_per_request = round((process_cpu_s(proc.pid) - cpu) / max(1, submits.sent) * 1e3, 2)
        accepted = {job_id: bodies[i] for i, job_id in seen.accepted.items()}
        report["submissions"] = asdict(submits)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    report["submissions"].update(check_jobs(db_url, accepted))
    report["total_s"] = round(args.max_s - (hard_deadline - time.monotonic()), 1)
    report["load_average_1m_at_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    report["lookup_p99_ok"] = report["lookups"]["p99_ms"] is not None and report["lookups"]["p99_ms"] <= P99_TARGET_MS
    return report


def check_jobs(db_url: str, accepted: dict[int, dict]) -> dict:
    """Every job the service accepted is in the database, as submitted."""
    from kernelmill.service.db.store import Store

    store = Store(db_url)
    try:
        missing, changed = [], []
        for job_id, body in accepted.items():
            job = store.get_job(job_id)
            if job is None:
                missing.append(job_id)
            elif (job.op, job.shapes, job.dtype) != (body["op"], body["shapes"], body["dtype"]):
                changed.append(job_id)
        _, total = store.list_jobs(limit=1)
        states: dict[str, int] = {}
        for state in ("queued", "running", "done", "failed", "cancelled"):
            states[state] = store.list_jobs(state=state, limit=1)[1]
    finally:
        store.close()
    return {
        "accepted": len(accepted),
        "in_database": len(accepted) - len(missing),
        "missing": missing,
        "changed": changed,
        "jobs_in_database": total - 3,  # less the three seeding jobs
        "states_at_end": states,
    }


def print_table(report: dict) -> None:
    rows = [report["lookups"], report["submissions"]]
    cols = ["phase", "target/s", "achieved/s", "sent", "ok", "errors", "p50 ms", "p90 ms", "p99 ms", "max ms"]
    table = [cols]
    for r in rows:
        fmt = [f"{r[k]:.2f}" if r[k] is not None else "-" for k in ("p50_ms", "p90_ms", "p99_ms", "max_ms")]
        table.append([r["name"], f"{r['target_rps']:g}", f"{r['achieved_rps']:g}", *map(str, (r["sent"], r["ok"])),
                      str(r["errors"]), *fmt])  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for n, row in enumerate(table):
        print(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            print("  ".join("-" * w for w in widths))
    lk, sb = report["lookups"], report["submissions"]
    verdict = "meets" if report["lookup_p99_ok"] else "MISSES"
    print(f"\nlookups: p99 {lk['p99_ms']:.2f} ms {verdict} the {P99_TARGET_MS:g} ms target "
          f"(service-side p99 {lk['service_p99_ms']:.2f} ms; {lk['exact_answers']} exact, "
          f"{lk['nearest_answers']} nearest; {report['published_kernels']} kernels published)")  # fmt: skip
    print(f"jobs: {sb['accepted']} accepted, {sb['in_database']} in the database, missing {sb['missing'] or 'none'}; "
          f"states at the end {sb['states_at_end']}")  # fmt: skip
    print(
        f"CPU per request: server {lk['server_cpu_ms_per_request']} ms (lookups), {sb['server_cpu_ms_per_request']} ms"
        f" (submissions); load generator {lk['client_cpu_ms_per_request']} ms (lookups)"
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"total {report['total_s']} s on {report['cpus']} CPUs (server and load generator share them;"
        f" load average {load:.2f} at the end)"
    )


def _number(kind: type, least: float, strict: bool = False):
    """An argparse type: a ``kind`` (int or float) of at least ``least`` (above it when ``strict``)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            expected = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}") from None
        if value < least or (strict and value == least) or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r}: {'above' if strict else 'at least'} {least:g}")
        return value

    return parse


_positive = _number(float, 0, strict=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lookup-rps", type=_positive, default=200.0)
    parser.add_argument("--lookup-s", type=_positive, default=20.0)
    parser.add_argument("--submit-rps", type=_positive, default=20.0)
    parser.add_argument("--submit-s", type=_positive, default=10.0)
    parser.add_argument(
        "--connections", type=_number(int, 1), default=8, help="HTTP keep-alive connections (in flight at most)"
    )
    parser.add_argument("--timeout-s", type=_positive, default=2.0, help="per request")
    parser.add_argument("--max-s", type=_positive, default=60.0, help="deadline for the whole run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--procs", type=_number(int, 1), default=2, help="load-generating processes for the lookups")
    parser.add_argument(
        "--untuned-shapes", type=_number(int, 0), default=64,
        help="distinct untuned shapes asked for (0: a new one each time)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="JSON report (default: a temporary file)")
    args = parser.parse_args(argv)
    if args.lookup_s + args.submit_s > args.max_s - 10:
        parser.error("the phases must leave 10 s of the deadline for start-up and checks")
    if int(args.lookup_rps * args.lookup_s) < 1 or int(args.submit_rps * args.submit_s) < 1:
        parser.error("each phase must send a request at least (rate x seconds >= 1)")
    if args.out is not None and not args.out.resolve().parent.is_dir():  # found now, not after the run
        parser.error(f"argument --out: no folder {str(args.out.parent)!r} to write {str(args.out)!r} in")
    command = shlex.join(["python", "benchmarks/load.py", *(sys.argv[1:] if argv is None else argv)])
    report = {"command": command, **asyncio.run(run(args))}
    print_table(report)
    out = args.out or Path(tempfile.mkdtemp(prefix="kernelmill-load-report-")) / "load.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"report: {out}")
    lost = report["submissions"]["missing"] or report["submissions"]["changed"]
    return 1 if lost or report["lookups"]["errors"] or report["submissions"]["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
