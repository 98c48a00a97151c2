"""docker/check-compose.sh finds every variable compose.yaml reads, braced or not, on a copy of docker/."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

DOCKER = Path(__file__).resolve().parents[2] / "docker"


def _has_compose() -> bool:
    if shutil.which("docker-compose"):
        return True
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not _has_compose(), reason="needs docker compose or docker-compose")


def _check(tmp_path: Path, line: str) -> subprocess.CompletedProcess:
    copy = tmp_path / "docker"
    shutil.copytree(DOCKER, copy)
    compose = copy / "compose.yaml"
    text = compose.read_text()
    anchor = '      KERNELMILL_PORT: "8000"\n'
    assert anchor in text
    compose.write_text(text.replace(anchor, anchor + f"      {line}\n"))
    return subprocess.run(["bash", str(copy / "check-compose.sh")], capture_output=True, text=True, timeout=120)


def test_an_unbraced_variable_missing_from_the_example_env_fails(tmp_path):
    done = _check(tmp_path, "KERNELMILL_LOG_LEVEL: $LOG_LEVEL")
    assert done.returncode != 0
    assert "compose.yaml reads $LOG_LEVEL but docker/.env.example does not set it" in done.stderr


def test_an_escaped_dollar_is_the_containers_variable_not_one_compose_reads(tmp_path):
    done = _check(tmp_path, "KERNELMILL_LOG_LEVEL: $${LOG_LEVEL}")
    assert done.returncode == 0, done.stderr
    assert "docker/compose.yaml is valid" in done.stdout
