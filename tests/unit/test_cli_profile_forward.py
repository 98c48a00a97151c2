"""`kernelmill profile-forward` without a GPU: no nsys (one line, exit 4), bad input (exit 2), and the whole
pipeline against a fake nsys on PATH: summary printed, written as JSON and stored; no report (exit 5,
nothing stored); no GPU in the child (exit 3)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kernelmill.cli import EXIT_NO_PROFILER, EXIT_NO_REPORT, EXIT_UNAVAILABLE, EXIT_USAGE, app
from kernelmill.service.db.store import Store
from tests.runtime import fake_nsys

runner = CliRunner()


@pytest.fixture
def db_url(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/cli.db"
    monkeypatch.setenv("KERNELMILL_DATABASE_URL", url)
    return url


def stored(url: str) -> int:
    store = Store(url)
    try:
        return store.list_forward_profiles()[1]
    finally:
        store.close()


@pytest.fixture
def nsys_bin(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    fake_nsys.on_path(monkeypatch, bin_dir)
    return bin_dir


def test_without_nsys_one_line_and_its_own_exit_code(tmp_path, monkeypatch, db_url):
    fake_nsys.nowhere(monkeypatch, tmp_path)
    keep = tmp_path / "reports" / "run1"
    result = runner.invoke(app, ["profile-forward", "--preset", "mlp-tiny", "--keep", str(keep)])
    assert result.exit_code == EXIT_NO_PROFILER == 4, result.output
    assert "nsys not found" in result.output and "nothing profiled" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) <= 3
    assert stored(db_url) == 0 and not (tmp_path / "reports").exists()  # no folder made for a profile not run


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "gpt"], "unknown preset"),
        ([], "give a model"),
        (["/no/such/model"], "no model at"),
        (["--preset", "mlp-tiny", "-d", "int8"], "unknown dtype"),
        (["--preset", "bert-tiny", "--seq", "100000"], "positions"),
        (["--preset", "bert-tiny", "--act", "relu"], "--act is for an MLP"),  # it was ignored
        (["--preset", "mlp-tiny", "--act", "swishy"], "unknown activation"),  # refused by the child, under nsys
    ],
)
def test_bad_input_exits_2_before_nsys(argv, message, nsys_bin):
    fake_nsys.install(nsys_bin, "ok")
    result = runner.invoke(app, ["profile-forward", *argv])
    assert result.exit_code == EXIT_USAGE, result.output
    assert message in result.output and "Traceback" not in result.output
    assert fake_nsys.calls(nsys_bin) == []  # nsys never started


def test_fake_nsys_summary_printed_written_and_stored(nsys_bin, db_url, tmp_path):
    fake_nsys.install(nsys_bin, "ok", "new")
    out = tmp_path / "forward.json"
    result = runner.invoke(
        app, ["profile-forward", "--preset", "mlp-tiny", "--batch", "8", "--iters", "2", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "in 4 launches" in result.output
    assert "launch gaps 5" in result.output and "memcpy 0.003 ms" in result.output
    assert "top kernels" in result.output and "linear_tensorcore" in result.output
    assert "NVTX ranges" in result.output and "forward" in result.output
    written = json.loads(out.read_text())
    assert written["kernel_launches"] == 4 and written["model"] == "mlp-tiny" and written["id"] >= 1
    assert f"stored as forward profile {written['id']}" in result.output
    store = Store(db_url)
    try:
        row = store.forward_profile(written["id"])
        assert row.kernel_launches == 4 and row.summary["gaps"]["count"] == 5
    finally:
        store.close()


def test_no_store_keeps_the_database_empty(nsys_bin, db_url):
    fake_nsys.install(nsys_bin, "ok", "old")
    result = runner.invoke(app, ["profile-forward", "--preset", "mlp-tiny", "--no-store"])
    assert result.exit_code == 0, result.output
    assert "gpukernsum" not in result.output and "linear_tensorcore" in result.output
    assert stored(db_url) == 0


def test_no_report_says_so_with_what_nsys_said_and_stores_nothing(nsys_bin, db_url):
    fake_nsys.install(nsys_bin, "no-report")
    result = runner.invoke(app, ["profile-forward", "--preset", "mlp-tiny"])
    assert result.exit_code == EXIT_NO_REPORT == 5, result.output
    assert "nsys wrote no report" in result.output and "nothing profiled" in result.output
    assert "No reports were generated" in result.output  # nsys's own words
    assert "Traceback" not in result.output
    assert stored(db_url) == 0


def test_no_gpu_in_the_child_is_exit_3(nsys_bin, db_url, monkeypatch):
    fake_nsys.install(nsys_bin, "run-child")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = runner.invoke(app, ["profile-forward", "--preset", "mlp-tiny", "--iters", "1"])
    assert result.exit_code == EXIT_UNAVAILABLE == 3, result.output
    assert "no GPU here" in result.output and "nothing profiled" in result.output
    assert stored(db_url) == 0


def test_where_the_profile_goes_and_its_time_limit_are_checked_before_nsys(nsys_bin, db_url, tmp_path):
    """They were checked after minutes of profiling: a --json into a missing folder lost the summary to a
    traceback, and --timeout-s 0 let nsys start only to be stopped at once."""
    fake_nsys.install(nsys_bin, "ok")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = [
        (["--json", str(tmp_path / "no" / "such" / "f.json")], "--json"),
        (["--json", str(tmp_path)], "is a folder; give a file name"),
        (["--keep", str(a_file)], "not a folder"),
        (["--keep", str(a_file / "sub")], "--keep"),
        (["--timeout-s", "0"], "--timeout-s must be a number of seconds above 0"),
        (["--timeout-s", "-5"], "--timeout-s must be"),
        (["--timeout-s", "inf"], "--timeout-s must be"),
        (["--timeout-s", "nan"], "--timeout-s must be"),
        (["--timeout-s", "1e300"], "at most 86400"),  # subprocess's waits overflowed past a day
    ]
    for argv, message in cases:
        result = runner.invoke(app, ["profile-forward", "--preset", "mlp-tiny", *argv])
        assert result.exit_code == EXIT_USAGE, (argv, result.output)
        assert message in result.output and "Traceback" not in result.output, (argv, result.output)
    assert fake_nsys.calls(nsys_bin) == [] and stored(db_url) == 0
    # A --keep folder that does not exist yet is made (as before), so a run can name a new one.
    fresh = tmp_path / "new" / "keep"
    result = runner.invoke(app, ["profile-forward", "--preset", "mlp-tiny", "--iters", "2", "--keep", str(fresh)])
    assert result.exit_code == 0, result.output
    assert fresh.is_dir()


def test_a_relative_kernelmill_nsys_is_found_from_the_work_folder_nsys_runs_in(tmp_path, db_url, monkeypatch):
    """./tools/nsys was started from nsys's temporary work folder, where it is not: a FileNotFoundError
    traceback."""
    fake_nsys.install(tmp_path / "tools", "ok")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KERNELMILL_NSYS", "./tools/nsys")
    result = runner.invoke(app, ["profile-forward", "--preset", "mlp-tiny", "--iters", "2"])
    assert result.exit_code == 0, result.output
    assert fake_nsys.calls(tmp_path / "tools") and stored(db_url) == 1


def test_an_nsys_that_cannot_be_started_is_one_line_and_exit_4(nsys_bin, db_url):
    """One on PATH whose interpreter is gone was started anyway: a FileNotFoundError traceback."""
    nsys_bin.mkdir(parents=True, exist_ok=True)
    broken = nsys_bin / "nsys"
    broken.write_text("#!/nonexistent/interpreter\n")
    broken.chmod(0o755)
    result = runner.invoke(app, ["profile-forward", "--preset", "mlp-tiny", "--iters", "1"])
    assert result.exit_code == EXIT_NO_PROFILER, result.output
    assert "could not be started" in result.output and "nothing profiled" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) <= 2
    assert stored(db_url) == 0


def test_a_database_that_cannot_be_opened_is_said_before_nsys_starts(nsys_bin, tmp_path, monkeypatch):
    """It was opened only after the profile (minutes on a GPU): its error then lost the summary, unprinted."""
    fake_nsys.install(nsys_bin, "ok")
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    monkeypatch.setenv("KERNELMILL_DATABASE_URL", f"sqlite:///{a_file}/cli.db")
    result = runner.invoke(app, ["profile-forward", "--preset", "mlp-tiny", "--iters", "2"])
    assert result.exit_code == EXIT_UNAVAILABLE, result.output
    assert "cannot open the database" in result.output and "Traceback" not in result.output
    assert fake_nsys.calls(nsys_bin) == []  # nothing profiled only to be lost


def test_a_database_lost_during_the_run_still_prints_and_writes_the_summary(nsys_bin, db_url, tmp_path, monkeypatch):
    from sqlalchemy.exc import OperationalError

    def gone(self, summary):
        raise OperationalError("INSERT INTO forward_profiles ...", {}, Exception("server closed the connection"))

    fake_nsys.install(nsys_bin, "ok")
    monkeypatch.setattr(Store, "record_forward_profile", gone)
    out = tmp_path / "summary.json"
    result = runner.invoke(app, ["profile-forward", "--preset", "mlp-tiny", "--iters", "2", "--json", str(out)])
    assert result.exit_code == EXIT_UNAVAILABLE, result.output
    assert "top kernels" in result.output and json.loads(out.read_text())["model"] == "mlp-tiny"
    assert "the summary could not be stored" in result.output and "server closed the connection" in result.output
    assert "Traceback" not in result.output
