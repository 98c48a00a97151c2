"""kernels/profile.py's ncu run, against stand-in ncu scripts that print what ncu prints (tests/unit/fake_ncu.py):
what the machine cannot do (ProfileUnavailable) is told apart from what one variant could not (ProfileFailed)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kernelmill.kernels.profile import NO_GPU, ProfileFailed, ProfileUnavailable, profile
from tests.unit import fake_ncu

SOFTMAX = ("softmax", "block_row", "float16", {"vec": 8, "unroll": 2, "threads": 256, "fast_exp": False}, (64, 64))


def _ncu(tmp_path: Path, monkeypatch, mode: str) -> Path:
    bin_dir = tmp_path / "bin"
    fake_ncu.install(bin_dir, mode)
    fake_ncu.on_path(monkeypatch, bin_dir)
    return bin_dir


def test_a_profile_is_the_longest_launch(tmp_path, monkeypatch):
    _ncu(tmp_path, monkeypatch, "ok")
    prof = profile(*SOFTMAX)
    assert prof.kernel == "softmax_block_row" and prof.metrics == {"duration_ns": 91232.0, "dram_pct": 71.25}


@pytest.mark.parametrize(
    "mode, said",
    [
        ("no-permission", "ERR_NVGPUCTRPERM"),
        ("lock-file", "lock file"),
        ("old-ncu", "not supported on this device"),
        ("unknown-metric", "Failed to find metric"),
    ],
)
def test_what_no_variant_could_get_past_is_unavailable(tmp_path, monkeypatch, mode, said):
    _ncu(tmp_path, monkeypatch, mode)
    with pytest.raises(ProfileUnavailable, match="cannot profile on this machine") as info:
        profile(*SOFTMAX)
    assert said in str(info.value)


@pytest.mark.parametrize(
    "mode, said",
    [
        ("crash", "CUDA_ERROR_ILLEGAL_ADDRESS"),  # the child's own last line: why it failed
        ("kernel-error", 'Failed to profile "softmax_block_row"'),
        ("no-kernel", "No kernels were profiled"),
    ],
)
def test_what_only_this_variant_hit_is_its_failure_not_the_machines(tmp_path, monkeypatch, mode, said):
    """They were all ProfileUnavailable, so the job profiled no other leader after one variant crashed."""
    _ncu(tmp_path, monkeypatch, mode)
    with pytest.raises(ProfileFailed, match="could not profile this variant") as info:
        profile(*SOFTMAX)
    assert not isinstance(info.value, ProfileUnavailable) and said in str(info.value)
    assert "==PROF==" not in str(info.value)  # progress lines are no reason


def test_no_gpu_in_the_child_is_the_machines_failure(tmp_path, monkeypatch):
    """The real child under a stand-in ncu: on this GPU-less machine it says so, and the parent reads it."""
    from kernelmill.kernels.device import gpu_available

    if gpu_available()[0]:
        pytest.skip("this machine has a GPU: the child would run the variant")
    _ncu(tmp_path, monkeypatch, "run-child")
    with pytest.raises(ProfileUnavailable, match=NO_GPU):
        profile(*SOFTMAX)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_a_hang_is_the_variants_failure_and_nothing_of_it_is_left_running(tmp_path, monkeypatch):
    """Only ncu was killed at the time limit: the child running the variant went on (on the GPU)."""
    bin_dir = _ncu(tmp_path, monkeypatch, "hang")
    started = time.monotonic()
    with pytest.raises(ProfileFailed, match="did not finish within 1 s") as info:
        profile(*SOFTMAX, timeout_s=1.0)
    assert not isinstance(info.value, ProfileUnavailable) and time.monotonic() - started < 10
    pid = int((bin_dir / "child.pid").read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:  # the killed child is reaped by init
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, 9)
        pytest.fail("ncu's child was left running after the time limit")


def test_an_ncu_that_cannot_be_started_is_unavailable(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    broken = bin_dir / "ncu"
    broken.write_text("#!/nonexistent/interpreter\n")
    broken.chmod(0o755)
    fake_ncu.on_path(monkeypatch, bin_dir)
    with pytest.raises(ProfileUnavailable, match="could not be started"):
        profile(*SOFTMAX)


def test_no_ncu_is_unavailable(tmp_path, monkeypatch):
    import kernelmill.kernels.profile as kprofile

    monkeypatch.setattr(kprofile, "find_ncu", lambda: None)
    with pytest.raises(ProfileUnavailable, match="not installed"):
        profile(*SOFTMAX)


def test_a_relative_kernelmill_ncu_is_found_from_the_folder_ncu_runs_in(tmp_path, monkeypatch):
    """./tools/ncu was started from the temporary folder ncu runs in, where it is not (FileNotFoundError)."""
    fake_ncu.install(tmp_path / "tools", "ok")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KERNELMILL_NCU", "./tools/ncu")
    assert profile(*SOFTMAX).kernel == "softmax_block_row"


def test_output_that_is_not_utf8_is_read_not_raised(tmp_path, monkeypatch):
    """ncu's output was decoded strictly: a byte that is not UTF-8 raised UnicodeDecodeError out of profile()."""
    _ncu(tmp_path, monkeypatch, "not-utf8")
    assert profile(*SOFTMAX).kernel == "softmax_block_row"
