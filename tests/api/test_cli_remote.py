"""`kernelmill tune --server`: the CLI against a running service (the app behind FastAPI's TestClient, the fake
executor), through the same httpx calls it makes to a real server."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from kernelmill import client as cli_client
from kernelmill.cli import app
from kernelmill.service.app import create_app
from kernelmill.settings import Settings

SERVER = "http://testserver"
TUNE = ["tune", "softmax", "--shape", "1024x1024", "--budget", "6", "--server", SERVER]


@pytest.fixture
def serve(tmp_path, api_db, monkeypatch):
    """Starts the app with ``workers`` fake GPUs and routes the CLI's httpx requests to it."""

    def start(workers: int, settings: Settings | None = None) -> TestClient:
        settings = settings or Settings(database_url=api_db, executor="fake", fake_workers=workers, fake_delay_s=0.0)
        tc = TestClient(create_app(settings)).__enter__()
        started.append(tc)

        def request(method, url, headers=None, timeout=None, **kw):
            return tc.request(method, url, headers=headers, **kw)

        monkeypatch.setattr(httpx, "request", request)
        return tc

    started: list[TestClient] = []
    yield start
    for tc in started:
        tc.__exit__(None, None, None)


def test_tune_against_a_server_follows_the_job_to_its_summary(serve, monkeypatch):
    serve(workers=1)
    monkeypatch.setattr(cli_client, "time", SimpleNamespace(sleep=lambda s: time.sleep(0.02), monotonic=time.monotonic))
    result = CliRunner().invoke(app, TUNE)
    assert result.exit_code == 0, result.output
    assert "job 1 submitted to http://testserver" in result.output
    assert "job 1 done" in result.output
    assert "1024x1024: best" in result.output and "6 trials, 0 failed" in result.output
    assert "no GPU worker" not in result.output


def test_tune_names_its_families_and_a_bad_one_is_one_line(serve, monkeypatch):
    tc = serve(workers=1)
    monkeypatch.setattr(cli_client, "time", SimpleNamespace(sleep=lambda s: time.sleep(0.02), monotonic=time.monotonic))
    result = CliRunner().invoke(app, [*TUNE, "--family", "warp_row", "-f", "block_row"])
    assert result.exit_code == 0, result.output
    job = tc.get("/api/jobs/1").json()
    assert job["families"] == ["warp_row", "block_row"]
    assert {t["family"] for t in tc.get("/api/jobs/1/trials").json()["items"]} <= {"warp_row", "block_row"}
    bad = CliRunner().invoke(app, [*TUNE, "--family", "nope"])
    assert bad.exit_code == 2 and "no family 'nope'" in bad.output and "Traceback" not in bad.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget", "0"], "error: --budget must be at least 1, got 0"),
        (["--shape", "64x64", "--budget", "1"], "error: --budget: 1 cannot try 2 shapes (one trial each at least)"),
        (["--seconds", "-1"], "error: --seconds must be at least 10 (a batch of trials takes seconds), got -1"),
        (["--shape", "1024x1024"], "error: --shape: 1024x1024 is given twice"),
        # Not checked against this machine's limits (the server's hold): inf reached the JSON encoder, which
        # refused it without naming --seconds ("Out of range float values are not JSON compliant").
        (["--seconds", "inf"], "error: --seconds must be a finite number, got inf"),
        (["--seconds", "1e400"], "error: --seconds must be a finite number, got inf"),
        (["--seconds", "nan"], "error: --seconds must be a finite number, got nan"),
    ],
)
def test_tune_names_its_options_in_a_refusal_not_the_apis_fields(args, message):
    result = CliRunner().invoke(app, [*TUNE, *args])
    assert result.exit_code == 2 and result.output.strip() == message


def test_a_server_holds_a_job_to_its_own_limits_not_the_clients(serve, monkeypatch, api_db):
    """A server set up for longer jobs accepts one that this machine's settings would refuse, and the other way."""
    settings = Settings(database_url=api_db, executor="fake", fake_workers=1, fake_delay_s=0.0)
    tc = serve(workers=1, settings=settings.model_copy(update={"max_budget_seconds": 86400.0, "max_shapes": 2}))
    monkeypatch.setattr(cli_client, "time", SimpleNamespace(sleep=lambda s: time.sleep(0.02), monotonic=time.monotonic))
    result = CliRunner().invoke(app, [*TUNE, "--seconds", "50000"])
    assert result.exit_code == 0, result.output
    assert tc.get("/api/jobs/1").json()["budget"]["seconds"] == 50000
    three = ["--shape", "64x64", "--shape", "128x128"]  # 3 shapes: within this machine's limit, over the server's
    refused = CliRunner().invoke(app, [*TUNE, *three])
    assert refused.exit_code == 2 and "server answered 422: shapes: at most 2 per job, got 3" in refused.output


def test_a_job_queued_on_a_server_without_gpu_workers_says_why(serve, monkeypatch):
    tc = serve(workers=0)
    sleeps = []

    def stop_watching(seconds):  # Ctrl-C while the job waits
        sleeps.append(seconds)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_client, "time", SimpleNamespace(sleep=stop_watching, monotonic=time.monotonic))
    result = CliRunner().invoke(app, TUNE)
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())  # rich wraps long lines
    assert "http://testserver has no GPU worker: the fake executor was configured with 0 workers" in out
    assert "Job 1 waits in the queue until one joins" in out
    assert "stopped watching; job 1 goes on" in out
    assert sleeps and tc.get("/api/jobs/1").json()["state"] == "queued"


def test_a_job_for_a_gpu_no_worker_has_says_so(serve, monkeypatch):
    """It sat at "queued" with no word of why: the reason was a line in the service's log."""
    tc = serve(workers=1)  # an sm_90
    monkeypatch.setattr(
        cli_client,
        "time",
        SimpleNamespace(sleep=lambda s: (_ for _ in ()).throw(KeyboardInterrupt), monotonic=time.monotonic),
    )
    result = CliRunner().invoke(app, [*TUNE, "--arch", "sm_80"])
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "Job 1 waits: no GPU worker has sm_80; the workers have sm_90. It starts when one joins" in out
    page = tc.get("/jobs/1").text
    assert (
        "no GPU worker has sm_80; the workers have sm_90" in page and tc.get("/api/jobs/1").json()["state"] == "queued"
    )
    here = CliRunner().invoke(app, ["tune", "softmax", "--shape", "64x64", "--arch", "sm_80"])
    assert here.exit_code == 2 and "--arch needs --server" in here.output


def test_an_unreachable_server_is_one_line_and_exit_3():
    for argv in (["tune", "softmax", "--shape", "64x64"], ["jobs"], [*TUNE_MODEL]):
        result = CliRunner().invoke(app, [*argv, "--server", "http://127.0.0.1:9"])
        assert result.exit_code == 3, result.output  # unavailable, as a missing GPU or Dask scheduler is
        assert "cannot reach" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["tune", "softmax", "--shape", "64x64", "--server", "http://127.0.0.1:9"])
    assert "cannot reach http://127.0.0.1:9/api/jobs" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("url", ["http://[::1", "localhost:8000", "http://", "http://127.0.0.1:99999"])
def test_a_malformed_server_url_is_one_line_and_exit_2(url, monkeypatch):
    for argv in (["jobs", "--server", url], ["kernels", "--server", url], [*TUNE_MODEL, "--server", url]):
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 2, result.output
        assert f"malformed server URL {url!r}" in result.output and "http://HOST:PORT" in result.output
        assert "Traceback" not in result.output
        assert "KERNELMILL_SERVER" not in result.output
    # The same URL from the environment: the line names the variable, not a --server that was not given.
    monkeypatch.setenv("KERNELMILL_SERVER", url)
    result = CliRunner().invoke(app, ["jobs"])
    assert result.exit_code == 2 and f"error: KERNELMILL_SERVER: malformed server URL {url!r}" in result.output


def test_a_server_that_cannot_list_its_workers_still_has_its_job_followed(serve, monkeypatch):
    serve(workers=1)
    routed = httpx.request

    def no_workers_route(method, url, **kw):
        if url.endswith("/api/workers"):
            return httpx.Response(404, json={"detail": "Not Found"})
        return routed(method, url, **kw)

    monkeypatch.setattr(httpx, "request", no_workers_route)
    monkeypatch.setattr(cli_client, "time", SimpleNamespace(sleep=lambda s: time.sleep(0.02), monotonic=time.monotonic))
    result = CliRunner().invoke(app, TUNE)
    assert result.exit_code == 0, result.output
    assert "job 1 done" in result.output and "no GPU worker" not in result.output


# -- tune-model: a model's problems as jobs --------------------------------------------------------------------

TUNE_MODEL = ["tune-model", "--preset", "bert-tiny", "--batch", "2", "--seq", "16", "--budget", "4"]
BERT_TINY_JOBS = [
    ("embedding", "2x16x128x1000x2"),
    ("layernorm", "32x128"),
    ("linear", "32x384x128, 32x128x128"),
    ("attention", "2x2x16x64"),
    ("add_layernorm", "32x128"),
    ("fused_mlp", "32x128x512x128"),
]


@pytest.fixture
def job_client(monkeypatch):
    """Routes the httpx.Client that tune-model submits through to the app that ``serve`` started."""

    class Routed:
        def __init__(self, tc: TestClient) -> None:
            self.tc, self.base_url = tc, SERVER

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def post(self, path, **kw):
            return self.tc.post(path, **kw)

    def route(tc: TestClient) -> None:
        monkeypatch.setattr(httpx, "Client", lambda base_url, timeout: Routed(tc))

    return route


def test_tune_model_submits_a_job_per_op_and_follows_them(serve, job_client, monkeypatch):
    tc = serve(workers=1)
    job_client(tc)
    monkeypatch.setattr(cli_client, "time", SimpleNamespace(sleep=lambda s: time.sleep(0.02), monotonic=time.monotonic))
    result = CliRunner().invoke(app, [*TUNE_MODEL, "--server", SERVER])
    assert result.exit_code == 0, result.output
    for i, (op, shapes) in enumerate(BERT_TINY_JOBS, 1):
        assert f"job {i} submitted to {SERVER}: {op} float16 {shapes}" in result.output
        assert f"job {i} done" in result.output
        job = tc.get(f"/api/jobs/{i}").json()
        assert (job["op"], job["state"], job["strategy"], job["budget"]["trials"]) == (op, "done", "evolutionary", 4)
    assert f"models loaded with server={SERVER}" in result.output


def test_tune_model_without_following_and_stopped_watching(serve, job_client, monkeypatch):
    tc = serve(workers=0)  # the jobs stay queued
    job_client(tc)
    result = CliRunner().invoke(app, [*TUNE_MODEL, "--server", SERVER, "--no-follow"])
    assert result.exit_code == 0, result.output
    assert "job 6 submitted" in result.output and "done" not in result.output

    def stop_watching(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_client, "time", SimpleNamespace(sleep=stop_watching, monotonic=time.monotonic))
    result = CliRunner().invoke(app, [*TUNE_MODEL, "--server", SERVER])
    out = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    assert (
        "stopped watching; jobs 7, 8, 9, 10, 11, 12 go on (cancel: kernelmill cancel ID --server http://testserver)"
        in out
    )
    assert [tc.get(f"/api/jobs/{i}").json()["state"] for i in (7, 12)] == ["queued", "queued"]


class _OneAnswer:
    """httpx.Client's stand-in for tune-model: every POST gets ``response``."""

    base_url = SERVER

    def __init__(self, response: httpx.Response) -> None:
        self.response = response

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def post(self, path, **kw):
        return self.response


def _without_status(output: str) -> str:
    """``output`` without tune-model's line that it runs a CPU forward (said where no spinner shows)."""
    return "".join(line for line in output.splitlines(keepends=True) if not line.startswith("one forward of "))


def test_tune_model_names_an_answer_that_is_not_a_job_in_one_line(monkeypatch):
    """A proxy's page where the service should be: one line, exit 2 (was 'error: Expecting value: line 1 ...')."""
    timeouts = []

    def client(base_url, timeout):
        timeouts.append(timeout)
        return _OneAnswer(httpx.Response(200, content=b"<html>oops</html>"))

    monkeypatch.setattr(httpx, "Client", client)
    result = CliRunner().invoke(app, [*TUNE_MODEL, "--server", SERVER])
    assert result.exit_code == 2, result.output
    assert _without_status(result.output).strip().splitlines() == [
        "error: the service answered the embedding job (200) with something that is not JSON: '<html>oops</html>'"
    ]
    assert [(t.connect, t.read) for t in timeouts] == [(3.0, 15.0)]  # a host that does not answer fails fast


def test_tune_model_dry_run_lists_the_problems_without_a_server():
    result = CliRunner().invoke(app, [*TUNE_MODEL, "--dry-run", "-d", "bfloat16"])
    assert result.exit_code == 0, result.output
    assert "problems of one forward (7), as jobs would tune them in bfloat16" in " ".join(result.output.split())
    for op, shape in (("embedding", "2x16x128x1000x2"), ("fused_mlp", "32x128x512x128"), ("linear", "32x128x128")):
        assert op in result.output and shape in result.output
    assert "act=gelu_erf" in result.output and "eps=1e-12" in result.output
    # Not a terminal: said in a line before the forward's seconds, not only by a spinner a log never sees.
    assert result.output.startswith("one forward of ") and "on the CPU to collect its problems ..." in result.output


def test_tune_model_shows_each_op_of_its_cpu_forward_as_it_reaches_it():
    """A BERT-base forward takes tens of seconds on the CPU, which showed nothing between its first line and
    the table (or the jobs)."""
    result = CliRunner().invoke(app, [*TUNE_MODEL, "--dry-run"])
    assert result.exit_code == 0, result.output
    shown = [line for line in result.output.splitlines() if line.startswith("one forward of bert-tiny: op ")]
    assert len(shown) == 14  # the embedding, its layernorm, then 6 ops in each of 2 layers
    assert shown[0] == "one forward of bert-tiny: op 1, embedding 2x16x128x1000x2"
    assert shown[6] == "one forward of bert-tiny: op 7, fused_mlp 32x128x512x128 act=gelu_erf"
    assert shown[-1] == "one forward of bert-tiny: op 14, add_layernorm 32x128 eps=1e-12"


def test_a_batch_too_large_for_this_host_is_one_line_not_a_memory_error_traceback():
    result = CliRunner().invoke(app, ["tune-model", "--preset", "mlp-tiny", "--batch", str(10**13), "--dry-run"])
    assert result.exit_code == 2, result.output
    assert _without_status(result.output).startswith("error: not enough memory on this host: Unable to allocate")
    assert "ask for less" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "tune-model submits jobs to a service: give --server URL"),
        (["--strategy", "hill"], "unknown strategy 'hill'; choose one of exhaustive"),
        (["--budget", "0", "--server", SERVER], "--budget must be at least 1"),
        (["--seconds", "inf", "--server", SERVER], "error: --seconds must be a finite number above 0, not inf"),
        (["--seconds", "nan", "--dry-run"], "error: --seconds must be a finite number above 0, not nan"),
    ],
)
def test_tune_model_bad_input_is_one_line_and_exit_2(args, message, monkeypatch):
    monkeypatch.delenv("KERNELMILL_SERVER", raising=False)
    result = CliRunner().invoke(app, [*TUNE_MODEL, *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output


@pytest.mark.parametrize("server", [[], ["--server", SERVER]])
def test_tune_model_names_a_config_json_it_cannot_parse(tmp_path, server, monkeypatch):
    """Checked before anything is submitted: with a server given, nothing reaches it (SERVER answers nothing)."""
    monkeypatch.delenv("KERNELMILL_SERVER", raising=False)
    config = tmp_path / "config.json"
    config.write_text("{not json")
    dry_run = [] if server else ["--dry-run"]
    result = CliRunner().invoke(app, ["tune-model", str(tmp_path), *dry_run, *server])
    assert result.exit_code == 2, result.output
    lines = _without_status(result.output).strip().splitlines()
    assert lines == [f"error: {config} is not valid JSON (Expecting property name enclosed in double quotes: line 1 "
                     "column 2 (char 1))"], result.output  # fmt: skip


@pytest.mark.parametrize(
    ("body", "argv", "message"),
    [
        (b"<html>hello</html>", ["jobs"], "/api/jobs answered something that is not JSON: '<html>hello</html>'"),
        (b"{}", ["jobs"], "/api/jobs answered what is not a Page[JobOut] (items: Field required)"),
        (b"[1, 2, 3]", ["kernels"], "/api/kernels answered what is not a Page[KernelSummary]"),
        (b'{"id": 1}', TUNE[:-2], "/api/jobs answered what is not a JobOut"),
    ],
)
def test_an_answer_that_is_not_the_apis_is_one_line_and_exit_2(monkeypatch, body, argv, message):
    """Another service on that port, or a proxy's page: the CLI says so, never a KeyError."""

    def request(method, url, headers=None, timeout=None, **kw):
        return httpx.Response(200, content=body, request=httpx.Request(method, url))

    monkeypatch.setattr(httpx, "request", request)
    result = CliRunner().invoke(app, [*argv, "--server", SERVER])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output


PAGE_404 = b"<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head>\n<body>" + b"<p>nothing here</p>" * 200


@pytest.mark.parametrize(
    ("status", "body", "said"),
    [
        (404, PAGE_404, "server answered 404: not a kernelmill answer: '<!DOCTYPE html> <html><head><title>404 Not"),
        (500, b'["a", "list"]', 'server answered 500: not a kernelmill answer: \'["a", "list"]\''),
        (403, b"", "server answered 403: an empty answer"),
        (422, b'{"detail": "arch: sm_9999 is not a GPU nvcc targets"}', "server answered 422: arch: sm_9999 is"),
    ],
)
def test_a_refusal_from_another_server_is_one_short_line(monkeypatch, status, body, said):
    """Another web server's error page was printed whole (kilobytes of HTML); a JSON list was a traceback."""

    def request(method, url, headers=None, timeout=None, **kw):
        return httpx.Response(status, content=body, request=httpx.Request(method, url))

    monkeypatch.setattr(httpx, "request", request)
    result = CliRunner().invoke(app, ["jobs", "--server", SERVER])
    assert result.exit_code == 2, result.output
    assert said in " ".join(result.output.split()) and "Traceback" not in result.output
    assert len(result.output) < 400


def test_tune_model_refused_by_another_server_is_one_short_line(monkeypatch):
    monkeypatch.setattr(httpx, "Client", lambda base_url, timeout: _OneAnswer(httpx.Response(404, content=PAGE_404)))
    result = CliRunner().invoke(app, [*TUNE_MODEL, "--server", SERVER])
    assert result.exit_code == 2, result.output
    assert "the service refused the embedding job (404): not a kernelmill answer: '<!DOCTYPE" in result.output
    assert len(_without_status(result.output)) < 500


@pytest.mark.parametrize("state, code", [("cancelled", 1), ("failed", 1), ("done", 0), ("running", 0)])
def test_tune_exits_1_when_its_job_ends_failed_or_cancelled(state, code, monkeypatch):
    """A script sees a job that did not finish in the exit code (it was 0); one still running after Ctrl-C is
    not a failure."""
    monkeypatch.setattr(cli_client, "tune_remote", lambda server, fields, console: {"state": state})
    result = CliRunner().invoke(app, TUNE)
    assert result.exit_code == code, result.output


def test_kernels_lists_every_page_of_the_servers_kernels(monkeypatch):
    """The CLI took the server's first page (100 kernels) for the whole list, and said nothing of the rest."""
    total, asked = 1234, []
    row = {"id": 0, "op": "softmax", "shape": [1024, 1024], "dtype": "float16", "precision": "float16",
           "arch": "sm_90", "attrs": {}, "family": "warp_row", "params": {}, "median_ms": 0.01, "baseline_ms": None,
           "speedup": None, "device_name": None, "job_id": None, "trial_id": None,
           "updated_at": "2026-11-29T12:00:00Z"}  # fmt: skip

    def request(method, url, headers=None, timeout=None, params=None, **kw):
        limit, offset = int(params["limit"]), int(params["offset"])
        asked.append(offset)
        items = [{**row, "id": i + 1} for i in range(offset, min(offset + limit, total))]
        page = {"items": items, "total": total, "limit": limit, "offset": offset}
        return httpx.Response(200, json=page, request=httpx.Request(method, url))

    monkeypatch.setattr(httpx, "request", request)
    listed = cli_client.fetch_kernels(SERVER, "softmax", None)
    assert [k["id"] for k in listed] == list(range(1, total + 1)) and asked == [0, 1000]
    result = CliRunner().invoke(app, ["kernels", "--server", SERVER], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert " 1234 " in result.output and "(1234 kernels)" in result.output


@pytest.mark.parametrize("lost", [3, None])
def test_tune_rides_out_a_server_restart_and_gives_up_saying_the_job_goes_on(serve, monkeypatch, lost):
    """The first refused connection while following ended the CLI with "cannot reach" (exit 3); the job went on
    and finished on the restarted server, and the user was told nothing of it."""
    serve(workers=1)
    through = httpx.request  # the fixture's route to the app
    refused = []

    def restarting(method, url, **kw):
        if method == "GET" and url.endswith("/api/jobs/1") and (lost is None or len(refused) < lost):
            refused.append(url)
            raise httpx.ConnectError("[Errno 111] Connection refused")
        return through(method, url, **kw)

    monkeypatch.setattr(httpx, "request", restarting)
    monkeypatch.setattr(cli_client, "RECONNECT_S", 0.3)
    monkeypatch.setattr(cli_client, "time", SimpleNamespace(sleep=lambda s: time.sleep(0.02), monotonic=time.monotonic))
    result = CliRunner().invoke(app, TUNE)
    out = " ".join(result.output.split())
    assert "Connection refused; asking again for up to 0.3 s (jobs go on there)" in out, result.output
    if lost is None:
        assert result.exit_code == 3 and "stopped watching; job 1 goes on (cancel: kernelmill cancel 1 --server" in out
        assert "error: cannot reach http://testserver/api/jobs/1" in out
    else:
        assert result.exit_code == 0 and len(refused) == lost, result.output
        assert "http://testserver answers again" in out and "job 1 done" in out


def test_following_a_job_into_a_log_prints_plain_progress_lines(serve, monkeypatch, api_db):
    """Without a terminal rich drew nothing until the job ended: an hour's job was an hour of silence in a log."""
    settings = Settings(database_url=api_db, executor="fake", fake_workers=1, fake_delay_s=0.05)
    serve(workers=1, settings=settings)
    monkeypatch.setattr(cli_client, "PLAIN_EVERY_S", 0.0)
    monkeypatch.setattr(cli_client, "time", SimpleNamespace(sleep=lambda s: time.sleep(0.02), monotonic=time.monotonic))
    result = CliRunner().invoke(app, TUNE)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("job 1 ") and " trials, failed " in line]
    assert len(lines) >= 2 and len(set(lines)) == len(lines), result.output  # each says something new
    assert any(line.startswith("job 1 running: ") for line in lines)
    assert lines[-1].startswith("job 1 done: 6/6 trials, failed 0, best ")


def test_cancel_a_job_on_a_server_and_in_the_local_database(serve, monkeypatch, api_db, tmp_path):
    """Ctrl-C's hint was a curl line (POST .../cancel): the CLI had no way to cancel a job."""
    tc = serve(workers=0)  # no worker: the job stays queued, and is cancelled at once
    job = tc.post("/api/jobs", json={"op": "softmax", "shapes": [[64, 64]], "budget": {"trials": 4, "seconds": 60}})
    result = CliRunner().invoke(app, ["cancel", str(job.json()["id"]), "--server", SERVER])
    assert result.exit_code == 0 and result.output.strip() == "job 1 cancelled", result.output
    again = CliRunner().invoke(app, ["cancel", "1", "--server", SERVER])
    assert again.exit_code == 2 and "server answered 409: job 1 is already cancelled" in again.output
    unknown = CliRunner().invoke(app, ["cancel", "99", "--server", SERVER])
    assert unknown.exit_code == 2 and "server answered 404: no job with id 99" in unknown.output

    store = _local_store(monkeypatch, tmp_path)
    queued, running = _local_job(store), _local_job(store)
    store.start_job(running.id, "tune@host:1", "NVIDIA H200", "tune@host:1", lease_s=30.0)  # a live `tune`'s
    assert CliRunner().invoke(app, ["cancel", str(queued.id)]).output.strip() == f"job {queued.id} cancelled"
    asked = CliRunner().invoke(app, ["cancel", str(running.id)])
    assert asked.exit_code == 0 and "asked to stop; it ends after its current batch" in asked.output
    assert store.cancel_requested(running.id) and store.get_job(running.id).state == "running"
    assert store.get_job(queued.id).state == "cancelled"
    ended = CliRunner().invoke(app, ["cancel", str(queued.id)])
    assert ended.exit_code == 2 and f"job {queued.id} is already cancelled" in ended.output


def _local_store(monkeypatch, tmp_path):
    """The local database the CLI uses without --server, in tmp_path."""
    from kernelmill.service.db.store import Store
    from kernelmill.settings import reset_settings

    url = f"sqlite:///{tmp_path}/local.db"
    monkeypatch.setenv("KERNELMILL_DATABASE_URL", url)
    reset_settings()
    return Store(url)


def _local_job(store):
    return store.create_job(op="softmax", shapes=[[64, 64]], dtype="float16", attrs={}, strategy="random",
                            budget_trials=4, budget_seconds=60.0)  # fmt: skip


def test_cancelling_a_local_job_whose_process_died_ends_it_at_once(monkeypatch, tmp_path):
    """A `tune` killed mid-job left it "running", its lease lapsed: without a service to recover it, cancel only
    asked it to stop, and nothing ever would."""
    store = _local_store(monkeypatch, tmp_path)
    job = _local_job(store)
    store.start_job(job.id, "embedded", "NVIDIA H200", "tune@host:4242", lease_s=-1.0)  # its lease has lapsed
    result = CliRunner().invoke(app, ["cancel", str(job.id)])
    assert result.exit_code == 0, result.output
    said = f"job {job.id} cancelled at once: tune@host:4242, which ran it, had stopped (its lease lapsed)"
    assert " ".join(result.output.split()) == said
    ended = store.get_job(job.id)
    assert ended.state == "cancelled" and ended.finished_at is not None


@pytest.mark.parametrize(
    ("timeout", "said"),
    [
        (httpx.ReadTimeout, "error: no answer from http://testserver/api/jobs within 30 s"),
        (httpx.ConnectTimeout, "error: could not connect to http://testserver/api/jobs within 30 s"),
    ],
)
def test_a_server_that_does_not_answer_in_time_is_said_so(monkeypatch, timeout, said):
    """A slow server was "cannot reach http://...: timed out", which read as one that is down."""

    def request(method, url, **kw):
        raise timeout("timed out")

    monkeypatch.setattr(httpx, "request", request)
    result = CliRunner().invoke(app, ["jobs", "--server", SERVER])
    assert result.exit_code == 3 and result.output.strip() == said, result.output


def test_jobs_and_kernels_list_as_json_from_a_server_and_the_local_database(serve, monkeypatch, tmp_path):
    """Machine output: JSON alone on stdout, the API's fields, from a server or the local database alike."""
    serve(workers=1)
    monkeypatch.setattr(cli_client, "time", SimpleNamespace(sleep=lambda s: time.sleep(0.02), monotonic=time.monotonic))
    assert CliRunner().invoke(app, TUNE).exit_code == 0
    remote_jobs = json.loads(CliRunner().invoke(app, ["jobs", "--json", "--server", SERVER]).stdout)
    assert [(j["id"], j["state"]) for j in remote_jobs] == [(1, "done")]
    remote_kernels = json.loads(CliRunner().invoke(app, ["kernels", "--json", "--server", SERVER]).stdout)
    assert [(k["op"], k["shape"]) for k in remote_kernels] == [("softmax", [1024, 1024])]

    store = _local_store(monkeypatch, tmp_path)
    job = _local_job(store)
    local = CliRunner().invoke(app, ["jobs", "--json"])
    assert local.exit_code == 0, local.output
    (listed,) = json.loads(local.stdout)
    assert listed["id"] == job.id and set(listed) == set(remote_jobs[0])  # its times as the API writes them
    empty = CliRunner().invoke(app, ["kernels", "--json", "--op", "matmul"])
    assert empty.exit_code == 0 and json.loads(empty.stdout) == []
