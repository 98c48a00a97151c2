import json
import socket
import time

import pytest
from typer.testing import CliRunner

from kernelmill.cli import app
from kernelmill.kernels.ops import OPS

runner = CliRunner()


def test_ops_json_lists_every_op_family_and_space():
    result = runner.invoke(app, ["ops", "--json"])
    assert result.exit_code == 0
    listing = json.loads(result.stdout)
    assert {entry["op"] for entry in listing} == set(OPS)
    for entry in listing:
        assert len(entry["families"]) >= 1
        for fam in entry["families"]:
            assert all(size > 0 for size in fam["space_size"].values())
        # The op's dtypes are those some family of it supports (linear_t listed float32, which none takes).
        assert set(entry["dtypes"]) == {dt for fam in entry["families"] for dt in fam["dtypes"]}
    assert next(e for e in listing if e["op"] == "linear_t")["dtypes"] == ["float16", "bfloat16"]


def test_render_prints_source_with_params():
    result = runner.invoke(app, ["render", "softmax", "--family", "warp_row", "-d", "float32", "-p", "vec=2"])
    assert result.exit_code == 0
    assert "softmax_warp_row" in result.stdout and "typedef float T;" in result.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["render", "conv", "-f", "x"], "unknown op"),
        (["render", "softmax", "-f", "nope"], "no family"),
        (["render", "softmax", "-f", "warp_row", "-d", "int8"], "unknown dtype"),
        (["render", "softmax", "-f", "warp_row", "-p", "vec=3"], "not allowed"),
        (["render", "softmax", "-f", "warp_row", "-p", "novalue"], "NAME=VALUE"),
        (["render", "softmax", "-f", "warp_row", "-p", "bogus=1"], "no parameter"),
        (["bench", "softmax", "--shape", "12xq"], "malformed shape"),
        (["bench", "softmax", "--shape", "12x12x12"], "takes a shape of 2 dims"),
        (["compile", "softmax", "-f", "warp_row", "--arch", "hopper"], "malformed arch"),
        (["compile", "matmul", "-f", "wgmma", "--arch", "sm_80"], "family wgmma uses sm_90a instructions"),
        (["compile", "softmax", "-f", "warp_row", "--arch", "sm_70"], "kernelmill's kernels need sm_80 or newer"),
        (["compile", "softmax", "-f", "warp_row", "--arch", "sm_999"], "sm_999 is not a GPU nvcc targets"),
        (["compile", "softmax", "-f", "warp_row", "--arch", "sm_80a"], "sm_80a is no nvcc target"),  # nvcc: exit 1
        (["compile", "softmax", "-f", "warp_row", "--arch", "sm_101"], "sm_101 is not a GPU nvcc targets"),
        (["compile", "softmax", "-f", "warp_row", "--arch", "sm_٩٠"], "malformed arch"),
        (["bench", "linear_t", "-s", "1x1x1", "-d", "float32"], "no linear_t family supports float32"),  # "no GPU"
        (["compile", "softmax", "-f", "cluster_row", "--arch", "sm_80"], "cluster_row shares a row between 8 blocks"),
        (
            ["compile", "matmul", "-f", "gemv", "-p", "k_splits=2", "--arch", "sm_86"],
            "runs on sm_90 or newer, not sm_86",
        ),
        (["compile", "mlp_stack", "-f", "persistent", "--arch", "sm_89"], "persistent streams its weights with TMA"),
        (["render", "matmul", "-f", "simt", "-p", "BM=64", "-p", "BM=128"], "--param BM given twice"),
        (["jobs", "--state", "finished"], "unknown state 'finished'; use one of queued"),
        (["jobs", "--limit", "0"], "--limit 0 is out of range 1..500"),
        (["kernels", "--op", "conv"], "unknown op 'conv'"),
        (["kernels", "--dtype", "int9"], "unknown dtype 'int9'"),
        # Past int()'s 4300 digits: its own "Exceeds the limit" message was printed.
        (["bench", "softmax", "--shape", f"{'1' * 5000}x4"], "dim rows must be at most 2130706432"),
        (["tune", "softmax", "--shape", f"4x{'1' * 5000}"], "dim cols must be at most 2130706432"),
        (["compile", "softmax", "-f", "warp_row", "--arch", f"sm_{'1' * 5000}"], "sm_1111111111111... (5003 char"),
        (
            ["tune", "softmax", "-s", "4x4", "--arch", f"sm_{'1' * 5000}", "--server", "http://127.0.0.1:9"],
            "arch: sm_1111111111111... (5003 characters) is not a GPU nvcc targets",
        ),
        # int(inf * MB) raised OverflowError, a traceback; nan and -1 were refused in a box as "not >= 0"
        (["cache", "prune", "--max-mb", "inf"], "error: --max-mb must be a finite number of MB, 0 or more, not inf"),
        (["cache", "prune", "--max-mb", "1e400"], "error: --max-mb must be a finite number of MB, 0 or more, not inf"),
        (["cache", "prune", "--max-mb", "nan"], "error: --max-mb must be a finite number of MB, 0 or more, not nan"),
        (["cache", "prune", "--max-mb=-1"], "error: --max-mb must be a finite number of MB, 0 or more, not -1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message):
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) <= 3  # rich may wrap one long line


def test_compile_without_nvcc_is_exit_3(monkeypatch):
    monkeypatch.setenv("KERNELMILL_NVCC", "/nonexistent/nvcc")
    result = runner.invoke(app, ["compile", "softmax", "-f", "warp_row"])
    assert result.exit_code == 3 and "nvcc not found (/nonexistent/nvcc)" in result.output, result.output


def test_bench_without_gpu_says_what_it_cannot_do(monkeypatch):
    from kernelmill.kernels import device

    def no_gpu(ordinal=0):
        raise device.GpuUnavailable("no CUDA device is visible")

    monkeypatch.setattr(device, "get_device", no_gpu)
    result = runner.invoke(app, ["bench", "softmax", "--shape", "64x64"])
    assert result.exit_code == 3
    assert "no GPU" in result.output and "compile" in result.output


def test_bench_variants_start_from_the_shape_defaults():
    from kernelmill.cli import _variant

    # The mma attention at head_dim 128 needs its shape defaults (max_head_dim 128); --param goes on top.
    variant = _variant("sdpa", "mma", "float16", None, None, (4, 16, 512, 128))
    assert variant.params["max_head_dim"] == 128 and variant.check_shape((4, 16, 512, 128)) is None
    variant = _variant("sdpa", "mma", "float16", ["stages=3"], None, (4, 16, 512, 128))
    assert variant.params["stages"] == 3 and variant.params["max_head_dim"] == 128
    # Without a shape (render, compile): the family's plain defaults.
    assert _variant("sdpa", "mma", "float16", None, None).params["max_head_dim"] == 64


def test_bench_checks_params_before_looking_for_a_gpu(monkeypatch):
    from kernelmill.kernels import device

    def no_gpu(ordinal=0):
        raise device.GpuUnavailable("no CUDA device is visible")

    monkeypatch.setattr(device, "get_device", no_gpu)
    result = runner.invoke(app, ["bench", "sdpa", "-s", "2x3x64x64", "-f", "mma", "-p", "warps=3"])
    assert result.exit_code == 2, result.output
    assert "warps" in result.output and "Traceback" not in result.output


def test_listing_a_local_database_that_does_not_exist_does_not_create_it(tmp_path, monkeypatch):
    """The line naming the missing file is one line, its path whole: wrapped at the terminal's width, a long temp
    path broke inside a name ("none.d b")."""
    folder = tmp_path / ("a-long-folder-name-" * 6)
    monkeypatch.setenv("KERNELMILL_DATABASE_URL", f"sqlite:///{folder}/none.db")
    for argv in (["jobs"], ["kernels"]):
        result = runner.invoke(app, argv)
        assert (
            result.exit_code == 0 and f"no database at {folder}/none.db yet (KERNELMILL_DATABASE_URL)" in result.output
        )
    assert not (folder / "none.db").exists()


def test_empty_listings_say_so_and_how_to_fill_them(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELMILL_DATABASE_URL", f"sqlite:///{tmp_path}/empty.db")
    from kernelmill.service.db.store import Store

    Store(f"sqlite:///{tmp_path}/empty.db").close()
    jobs = runner.invoke(app, ["jobs", "--state", "done"])
    assert (
        jobs.exit_code == 0 and "no done jobs in the local database" in jobs.output and "kernelmill tune" in jobs.output
    )
    kernels = runner.invoke(app, ["kernels", "--op", "softmax"])
    assert kernels.exit_code == 0 and "no served softmax kernels in the local database" in kernels.output


@pytest.mark.parametrize("job_id", ["9223372036854775808", "2147483648", "0", "-1"])
def test_cancelling_an_id_outside_1_to_max_id_is_one_line_and_exit_2(tmp_path, monkeypatch, job_id):
    """Past a 64-bit integer SQLite's driver raised OverflowError: a traceback."""
    monkeypatch.setenv("KERNELMILL_DATABASE_URL", f"sqlite:///{tmp_path}/jobs.db")
    from kernelmill.service.db.store import Store

    Store(f"sqlite:///{tmp_path}/jobs.db").close()
    result = runner.invoke(app, ["cancel", "--", job_id])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: job id {job_id} is out of range 1..2147483647"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_refuses_what_it_cannot_listen_on_or_reach_before_starting(monkeypatch, tmp_path):
    from kernelmill import cli

    monkeypatch.setattr(cli, "SCHEDULER_WAIT_S", 0.6)
    monkeypatch.setenv("KERNELMILL_DATABASE_URL", f"sqlite:///{tmp_path}/serve.db")
    assert runner.invoke(app, ["serve", "--port", "70000"]).exit_code == 2
    empty = runner.invoke(app, ["serve", "--host", " ", "--port", str(_free_port())])  # "" bound every interface
    assert empty.exit_code == 2 and "--host (KERNELMILL_HOST) is empty" in empty.output
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        busy = runner.invoke(app, ["serve", "--port", str(port)])
    assert busy.exit_code == 3 and f"cannot listen on 127.0.0.1:{port}" in busy.output
    closed = f"tcp://127.0.0.1:{_free_port()}"
    nobody = runner.invoke(app, ["serve", "--port", str(_free_port()), "--scheduler", closed])
    assert nobody.exit_code == 3 and f"cannot reach the Dask scheduler at {closed} (tried for 0.6 s)" in nobody.output
    assert "Traceback" not in nobody.output
    bad = runner.invoke(app, ["worker", "--scheduler", "tcp://:x"])
    assert bad.exit_code == 2 and "malformed scheduler address" in bad.output


@pytest.mark.parametrize(
    ("url", "code", "message"),
    [
        ("bogus://x", 2, "database URL bogus://x: Can't load plugin: sqlalchemy.dialects:bogus"),
        ("mysql://u:s3cret@127.0.0.1/x", 2, "database URL mysql://u:***@127.0.0.1/x: its driver is not installed"),
        ("sqlite:////nonexistent/dir/x.db", 3, "cannot open the database sqlite:////nonexistent/dir/x.db: unable"),
        ("postgresql://u:s3cret@127.0.0.1:9/db", 3, "cannot open the database postgresql://u:***@127.0.0.1:9/db: "),
    ],
)
def test_a_database_that_cannot_be_opened_is_one_line_before_anything_runs(monkeypatch, url, code, message):
    monkeypatch.setenv("KERNELMILL_DATABASE_URL", url)
    reads = [] if url.startswith("sqlite") else [["jobs"], ["kernels"]]  # no SQLite file: nothing to list
    for argv in (*reads, ["serve", "--port", str(_free_port())]):
        result = runner.invoke(app, argv)
        assert result.exit_code == code, result.output
        assert message in " ".join(result.output.split()) and "Traceback" not in result.output
        assert "s3cret" not in result.output and "serving on" not in result.output


def test_worker_refuses_a_gpu_count_below_one_and_a_host_without_gpus(monkeypatch):
    from kernelmill import cli
    from kernelmill.service import executor

    monkeypatch.setattr(cli, "_not_a_scheduler", lambda address: None)  # the socket below stands in for one
    monkeypatch.delenv("KERNELMILL_FAKE_DEVICE", raising=False)
    monkeypatch.setattr(executor, "count_gpus", lambda: (0, "nvidia-smi lists no GPU"))
    with socket.create_server(("127.0.0.1", 0)) as scheduler:  # reachable: the checks after that one decide
        address = f"tcp://127.0.0.1:{scheduler.getsockname()[1]}"
        for gpus in ("0", "-1"):
            low = runner.invoke(app, ["worker", "--scheduler", address, "--gpus", gpus])
            assert low.exit_code == 2 and f"--gpus must be at least 1, not {gpus}" in low.output, low.output
        # Bad input is said first, not after the seconds spent waiting for a scheduler that is not there.
        with monkeypatch.context() as m:
            m.setattr(cli, "_check_scheduler", lambda address: pytest.fail("the scheduler was checked first"))
            unchecked = runner.invoke(app, ["worker", "--scheduler", "tcp://127.0.0.1:1", "--gpus", "-1"])
        assert unchecked.exit_code == 2 and "--gpus must be at least 1, not -1" in unchecked.output
        # --gpus says how many to serve, not that they exist: without one, jobs would be taken only to fail.
        none = runner.invoke(app, ["worker", "--scheduler", address, "--gpus", "2"])
    assert none.exit_code == 3 and "no GPU to serve (nvidia-smi lists no GPU)" in none.output, none.output
    assert "Traceback" not in low.output + none.output
    # More than the host has: workers pinned to GPUs that are not there would take jobs only to bounce them.
    monkeypatch.setattr(executor, "count_gpus", lambda: (2, "nvidia-smi"))
    with socket.create_server(("127.0.0.1", 0)) as scheduler:
        address = f"tcp://127.0.0.1:{scheduler.getsockname()[1]}"
        more = runner.invoke(app, ["worker", "--scheduler", address, "--gpus", "4"])
    assert more.exit_code == 2 and "--gpus 4: this host has 2 (counted by nvidia-smi)" in more.output, more.output


@pytest.mark.parametrize("grace", ["-1", "nan", "inf"])
def test_worker_refuses_a_stop_grace_that_is_no_duration(monkeypatch, grace):
    from kernelmill import cli

    monkeypatch.setattr(cli, "_check_scheduler", lambda address: pytest.fail("the scheduler was checked first"))
    bad = runner.invoke(app, ["worker", "--scheduler", "tcp://127.0.0.1:1", "--stop-grace", grace])
    assert bad.exit_code == 2 and "--stop-grace must be a number of seconds, 0 or more" in bad.output, bad.output


def test_a_scheduler_that_starts_within_the_wait_is_reached(monkeypatch):
    import threading

    from kernelmill import cli

    monkeypatch.setattr(cli, "SCHEDULER_WAIT_S", 5.0)
    monkeypatch.setattr(cli, "_not_a_scheduler", lambda address: None)  # the late listener stands in for one
    # Bound now, so that no other process takes the port meanwhile; it listens only 0.7 s later.
    late = socket.socket()
    late.bind(("127.0.0.1", 0))
    port = late.getsockname()[1]
    listening = []

    def listen() -> None:
        listening.append(late)
        late.listen()

    timer = threading.Timer(0.7, listen)
    timer.start()
    try:
        cli._check_scheduler(f"tcp://127.0.0.1:{port}")  # returns once the late listener accepts
        assert listening
    finally:
        timer.join()
        late.close()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KERNELMILL_PORT": "99999"}, "error: KERNELMILL_PORT='99999': Input should be less than or equal to 65535"),
        ({"KERNELMILL_EXECUTOR": "bogus"}, "error: KERNELMILL_EXECUTOR='bogus': String should match pattern"),
        ({"KERNELMILL_PLUGINS": "no_such_plugin_mod"}, "error: KERNELMILL_PLUGINS: cannot import 'no_such_plugin_mod'"),
        # Path("") is the current folder: the cubin cache landed wherever the command ran.
        ({"KERNELMILL_CACHE_DIR": ""}, "error: KERNELMILL_CACHE_DIR='': Value error, is empty; unset it for"),
        # A header carries ASCII only: no request could ever match this token, so no write could be made.
        # Secrets are named, never shown: serve's error line lands in logs, and a token with a stray space (an
        # env file's) is the secret itself.
        ({"KERNELMILL_API_TOKEN": "clé"}, "error: KERNELMILL_API_TOKEN (not shown): Value error, must be printable"),
        ({"KERNELMILL_API_TOKEN": "s3cret-token "}, "error: KERNELMILL_API_TOKEN (not shown): Value error, must be"),
        ({"KERNELMILL_API_TOKEN": ""}, "error: KERNELMILL_API_TOKEN (not shown): Value error, is empty; unset it to"),
        # inf overflowed int() in the compiler; an infinite budget let a job in whose page then answered 500.
        (
            {"KERNELMILL_COMPILE_CACHE_MAX_MB": "inf"},
            "error: KERNELMILL_COMPILE_CACHE_MAX_MB='inf': Input should be a finite number",
        ),
        (
            {"KERNELMILL_MAX_BUDGET_SECONDS": "1e400"},
            "error: KERNELMILL_MAX_BUDGET_SECONDS='1e400': Input should be a finite number",
        ),
        (
            {"KERNELMILL_KERNEL_TIMEOUT_S": "nan"},
            "error: KERNELMILL_KERNEL_TIMEOUT_S='nan': Input should be a finite number",
        ),
        # Finite but past what Python's waits take: every compile ended in an OverflowError traceback.
        (
            {"KERNELMILL_COMPILE_TIMEOUT_S": "1e300"},
            "error: KERNELMILL_COMPILE_TIMEOUT_S='1e300': Input should be less than or equal to 86400",
        ),
        # Found only when used: "nvcc not found ()" at the first compile, "Could not parse SQLAlchemy URL".
        ({"KERNELMILL_NVCC": ""}, "error: KERNELMILL_NVCC='': Value error, is empty; unset it for the default (nvcc)"),
        ({"KERNELMILL_DATABASE_URL": " "}, "error: KERNELMILL_DATABASE_URL (not shown): Value error, is empty; unset"),
        # Found only by each llm job, which fell back to guided with a warning in the service's log.
        (
            {"KERNELMILL_LLM_URL": "localhost:8080/v1"},
            "error: KERNELMILL_LLM_URL='localhost:8080/v1': Value error, is not an http(s) URL with a host; give it",
        ),
        ({"KERNELMILL_LLM_URL": "http://[::1/v1"}, "error: KERNELMILL_LLM_URL='http://[::1/v1': Value error, is not a"),
        (
            {"KERNELMILL_WORKER_ANSWER_TIMEOUT_S": "1e10"},
            "error: KERNELMILL_WORKER_ANSWER_TIMEOUT_S='1e10': Input should be less than or equal to 86400",
        ),
    ],
)
def test_a_bad_setting_is_one_line_and_exit_2_before_any_command(env, message):
    """Settings are read (and plugins imported) when the CLI is imported: the entry point reports them."""
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "kernelmill", "ops"], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == done.stderr.strip().splitlines()[0] and done.stderr.startswith(message)
    assert "Traceback" not in done.stderr and not done.stdout
    assert "s3cret" not in done.stderr and "clé" not in done.stderr


def test_serve_shows_kernelmills_own_info_lines():
    """Job resumes, plateaus and replaced workers are INFO lines: serve's logging shows them (a subprocess, so
    this test's logging configuration stays its own)."""
    import subprocess
    import sys

    code = (
        "import logging, logging.config; from kernelmill.cli import serve_log_config; "
        "logging.config.dictConfig(serve_log_config()); log = logging.getLogger('kernelmill.service.jobs'); "
        "log.info('job 1 was running when the service stopped'); log.debug('not shown')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "job 1 was running when the service stopped" in done.stderr and "not shown" not in done.stderr


def test_a_port_that_is_not_a_dask_scheduler_is_one_line_and_exit_3(monkeypatch, tmp_path):
    """Something listening that is not a scheduler (a web server, a silent socket) left `serve` and `worker`
    waiting on Dask's handshake for ever."""
    import http.server
    import threading

    from distributed import LocalCluster

    from kernelmill import cli

    monkeypatch.setattr(cli, "SCHEDULER_WAIT_S", 1.0)
    monkeypatch.setenv("KERNELMILL_DATABASE_URL", f"sqlite:///{tmp_path}/serve.db")
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        with socket.create_server(("127.0.0.1", 0)) as silent:
            for port in (silent.getsockname()[1], web.server_address[1]):
                address = f"tcp://127.0.0.1:{port}"
                for argv in (
                    ["worker", "--scheduler", address],
                    ["serve", "--port", str(_free_port()), "--scheduler", address],
                ):
                    started = time.monotonic()
                    result = runner.invoke(app, argv)
                    assert result.exit_code == 3, result.output
                    assert f"error: {address} is not a Dask scheduler: no Dask answer within 1 s" in result.output
                    assert "Traceback" not in result.output and time.monotonic() - started < 10
    finally:
        web.shutdown()
        web.server_close()
    with LocalCluster(n_workers=0, processes=False, protocol="tcp://", dashboard_address=None) as cluster:
        assert cli._not_a_scheduler(cluster.scheduler_address) is None
        cli._check_scheduler(cluster.scheduler_address)  # returns: a scheduler answers
    # Other schemes crashed the service's start with a traceback after its banner (tls:// needs a security
    # config kernelmill does not pass): bad input now, before anything starts.
    for address in ("tls://127.0.0.1:1", "inproc://x", "ws://127.0.0.1:1"):
        result = runner.invoke(app, ["serve", "--port", str(_free_port()), "--scheduler", address])
        assert result.exit_code == 2 and "kernelmill joins Dask schedulers over tcp:// only" in result.output
        assert "serving on" not in result.output


def test_a_dot_env_that_is_not_utf8_is_one_line_and_kernelmill_server_is_read_from_it(tmp_path):
    """A byte that is not UTF-8 in ./.env was a 50-line traceback from every command, `version` included;
    KERNELMILL_SERVER in .env was ignored while every other setting there was read."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELMILL_")}
    (tmp_path / ".env").write_bytes(b"KERNELMILL_PORT=8000\n# caf\xe9\n")
    bad = subprocess.run([sys.executable, "-m", "kernelmill", "version"], cwd=tmp_path, env=env, capture_output=True)
    assert bad.returncode == 2 and bad.stderr.decode().strip().splitlines() == [
        "error: .env is not UTF-8 text (invalid continuation byte at byte 26); fix or remove it"
    ]
    (tmp_path / ".env").write_text("KERNELMILL_SERVER=ftp://not-a-server\n")
    read = subprocess.run([sys.executable, "-m", "kernelmill", "jobs"], cwd=tmp_path, env=env, capture_output=True)
    assert read.returncode == 2 and "malformed server URL 'ftp://not-a-server'" in read.stderr.decode()


def test_a_web_server_answering_the_dask_handshake_is_named_without_an_exabyte_memory_error():
    """uvicorn answers Dask's handshake with an HTTP 400, whose bytes Dask read as a frame length: the message
    quoted 'MemoryError: Unable to allocate 3.07 EiB'."""
    import threading

    from kernelmill import cli

    with socket.create_server(("127.0.0.1", 0)) as web:

        def answer() -> None:
            conn, _ = web.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(
                    b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\ncontent-length: 11\r\n\r\nInvalid req"
                )

        threading.Thread(target=answer, daemon=True).start()
        said = cli._not_a_scheduler(f"tcp://127.0.0.1:{web.getsockname()[1]}", timeout_s=5)
    assert said == "it does not speak Dask's protocol (its answer is no Dask message: a web server, say)"


def test_cache_info_and_prune(tmp_path, monkeypatch):
    import os

    from kernelmill.settings import reset_settings

    monkeypatch.setenv("KERNELMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    for i, key in enumerate(("aa" + "0" * 62, "ab" + "1" * 62, "bc" + "2" * 62)):
        folder = tmp_path / "cubin" / key[:2]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{key}.cubin").write_bytes(b"\x7fELF" + b"\0" * 496)
        (folder / f"{key}.json").write_text("{}" + " " * 98)
        os.utime(folder / f"{key}.cubin", (1000 + i, 1000 + i))  # the first the least recently used
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "k.json").write_text("{}")

    info = runner.invoke(app, ["cache", "info"])
    assert info.exit_code == 0, info.output
    assert f"cache at {tmp_path}" in info.stdout.replace("\n", "")
    assert "│ cubin    │     6 │" in info.stdout and "│ served   │     1 │" in info.stdout
    assert "compile cache limit: 4096.0 MB" in info.stdout

    pruned = runner.invoke(app, ["cache", "prune", "--max-mb", str(1300 / (1 << 20))])
    assert pruned.exit_code == 0, pruned.output
    assert "1 of 3 compiled variants removed" in pruned.stdout
    assert not (tmp_path / "cubin" / "aa").joinpath("aa" + "0" * 62 + ".cubin").exists()
    assert len(list((tmp_path / "cubin").rglob("*.cubin"))) == 2

    assert "2 of 2 compiled variants removed" in runner.invoke(app, ["cache", "prune", "--max-mb", "0"]).stdout
    assert (tmp_path / "served" / "k.json").exists()  # the served kernels are not the compile cache's

    monkeypatch.setenv("KERNELMILL_COMPILE_CACHE_MAX_MB", "0")
    reset_settings()
    refused = runner.invoke(app, ["cache", "prune"])
    assert refused.exit_code == 2 and "has no limit" in refused.stderr
    assert "0 of 0 compiled variants removed" in runner.invoke(app, ["cache", "prune", "--all"]).stdout


def test_cache_commands_on_a_read_only_or_changing_cache_say_so_in_a_line(tmp_path, monkeypatch):
    """cache prune on a read-only cache, or one with a folder where a cubin should be, and cache info on a
    cache a prune was removing files from, each ended in a traceback."""
    import os
    from pathlib import Path

    monkeypatch.setenv("KERNELMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    for key in ("aa" + "0" * 62, "ab" + "1" * 62):
        folder = tmp_path / "cubin" / key[:2]
        folder.mkdir(parents=True)
        (folder / f"{key}.cubin").write_bytes(b"\x7fELF" + b"\0" * 496)
        (folder / f"{key}.json").write_text("{}")
    stat = os.stat

    def vanishing(path, *args, **kwargs):
        if str(path).endswith(".json"):
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", vanishing)
    info = runner.invoke(app, ["cache", "info"])
    monkeypatch.setattr(os, "stat", stat)
    assert info.exit_code == 0, info.output
    assert "│ cubin    │     2 │" in info.stdout  # the two cubins; the reports went as they were counted

    unlink = Path.unlink

    def read_only(path, missing_ok=False):
        if path.name.startswith("aa"):
            raise OSError(30, "Read-only file system", str(path))
        return unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", read_only)
    pruned = runner.invoke(app, ["cache", "prune", "--all"])
    assert pruned.exit_code == 1 and "Traceback" not in pruned.output
    assert "1 of 2 compiled variants removed" in pruned.stdout
    assert "error: 1 compiled variants could not be removed: [Errno 30] Read-only file system" in pruned.stderr
    monkeypatch.setattr(Path, "unlink", unlink)

    cubin = tmp_path / "cubin" / "aa" / ("aa" + "0" * 62 + ".cubin")
    cubin.unlink()
    cubin.mkdir()
    cleared = runner.invoke(app, ["cache", "prune", "--all"])
    assert cleared.exit_code == 0, cleared.output
    assert "1 of 1 compiled variants removed" in cleared.stdout and not cubin.exists()


def test_cache_commands_on_a_cache_folder_under_a_file_say_it_is_empty(tmp_path, monkeypatch):
    """A KERNELMILL_CACHE_DIR under a file: cache prune raised NotADirectoryError (info said empty)."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("KERNELMILL_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    for args in (["cache", "info"], ["cache", "prune", "--all"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert "0 of 0 compiled variants removed" in result.stdout


def test_every_command_option_and_argument_has_help_and_a_one_line_summary():
    """`kernelmill --help` lists each command by its docstring's first paragraph, keeping its line breaks: bench's
    and cancel's summaries broke mid-sentence ("... at its" / "shape defaults"). compile --family, --json,
    jobs --limit, kernels --op/--dtype and the OP arguments had no help text."""
    import typer.main

    def commands(group, prefix=""):
        for name, command in group.commands.items():
            if hasattr(command, "commands"):
                yield from commands(command, f"{prefix}{name} ")
            else:
                yield f"{prefix}{name}", command

    for name, command in commands(typer.main.get_command(app)):
        assert "\n" not in command.help.strip().split("\n\n")[0], name
        for param in command.params:
            assert param.help, f"{name} {param.name}"


def test_usage_lines_name_the_kernelmill_command_under_python_m_too():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "kernelmill", "render", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "Usage: kernelmill render [OPTIONS]" in done.stdout, done.stdout


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["bogus"], "error: No such command 'bogus'. (see kernelmill --help)"),
        (["cache", "bogus"], "error: No such command 'bogus'. (see kernelmill cache --help)"),
        (["jobs", "--bogus"], "error: No such option: --bogus (see kernelmill jobs --help)"),
        (["render", "softmax"], "error: Missing option '--family' / '-f'. (see kernelmill render --help)"),
        (["jobs", "--limit", "x"], "error: Invalid value for '--limit': Input should be a valid integer"),
    ],
)
def test_clicks_usage_errors_are_one_line_and_exit_2(argv, line):
    """They were a usage line, a hint and a five-line box, unlike every other bad input."""
    result = runner.invoke(app, argv, prog_name="kernelmill")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(line) and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not result.stdout


def test_no_command_still_prints_the_help():
    result = runner.invoke(app, [], prog_name="kernelmill")
    assert result.exit_code == 2 and "Commands" in result.stdout and not result.stderr


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch):
    """typer ended an interrupted command silently."""
    from kernelmill import client

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(client, "fetch_jobs", interrupted)
    result = runner.invoke(app, ["jobs"])
    assert result.exit_code == 130 and result.stderr.strip() == "error: interrupted", result.output


def test_bench_into_a_pipe_says_each_step_on_stderr_and_keeps_stdout_json(monkeypatch):
    """Rich's spinner draws nothing without a terminal: a bench of every family, minutes, printed nothing until
    its end. The steps go to stderr, so that --json's stdout stays JSON."""
    from types import SimpleNamespace

    from kernelmill.kernels import bench, device, evaluate

    gpu = SimpleNamespace(info=SimpleNamespace(name="Fake GPU", sm_count=132))
    monkeypatch.setattr(device, "get_device", lambda ordinal=0: gpu)
    monkeypatch.setattr(bench, "L2Flusher", lambda device: None)
    ceil = SimpleNamespace(copy_gbps=3000.0, matrix_tflops={}, floor_ms=lambda *args: 0.01)
    monkeypatch.setattr(bench, "ceilings", lambda device, precisions: ceil)
    monkeypatch.setattr(bench, "time_torch", lambda *args, **kwargs: None)

    def failing(variant, dims, device, compiler, **kwargs):
        failed = dict(ok=False, poisoned=False, status="compile_error", reason="x", verification=None, timing=None)
        return SimpleNamespace(variant=variant, **failed)

    monkeypatch.setattr(evaluate, "evaluate", failing)
    result = runner.invoke(app, ["bench", "softmax", "-s", "64x64", "-d", "float32", "--json"])
    assert result.exit_code == 1, result.output  # no variant ran
    report = json.loads(result.stdout)
    steps = result.stderr.splitlines()
    assert [f"{v['variant']}: compile, verify, time ..." for v in report["variants"]] == steps[:-1]
    assert steps[-1] == "PyTorch baseline (float32) ..." and "\x1b" not in result.stderr


def test_listings_on_a_narrow_terminal_fold_their_cells_and_cut_none(monkeypatch):
    """Rich cut cells that did not fit to "fused_…", "4096x1…", "12…" (an id), even piped at 160 columns a long
    family name: what the user needed to read, or copy, was lost."""
    from rich.console import Console

    from kernelmill import cli, client

    kernel = {"id": 123456, "op": "fused_mlp", "shape": [4096, 11008, 4096], "dtype": "bfloat16",
              "precision": "bfloat16", "arch": "sm_90a", "family": "a_very_long_family_name_" * 3, "median_ms": 0.0123,
              "baseline_ms": 0.02, "speedup": 1.62, "device_name": "NVIDIA H200 NVL"}  # fmt: skip
    job = {"id": 654321, "op": "fused_mlp", "shapes": [[4096, 11008, 4096], [1, 4096, 4096]], "dtype": "bfloat16",
           "strategy": "evolutionary", "state": "running", "trials_done": 4095, "trials_failed": 1234,
           "per_shape": [{"best_ms": 0.0123, "speedup": 1.62}]}  # fmt: skip
    monkeypatch.setattr(client, "fetch_kernels", lambda *args: [kernel])
    monkeypatch.setattr(client, "fetch_jobs", lambda *args: [job])
    for width in (60, 160):
        monkeypatch.setattr(cli, "console", Console(width=width))
        for argv in (["kernels"], ["jobs"]):
            result = runner.invoke(app, argv)
            assert result.exit_code == 0 and "…" not in result.stdout, result.stdout


def test_output_that_cannot_be_written_is_one_line_and_exit_1(monkeypatch):
    """`kernelmill ops > /dev/full` ended in an OSError traceback (typer handles a closed pipe only)."""
    import errno
    import io

    from rich.console import Console

    from kernelmill import cli

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cli, "console", Console(file=Full()))
    result = runner.invoke(app, ["ops"])
    assert result.exit_code == 1 and result.stderr.strip() == "error: No space left on device", result.output
