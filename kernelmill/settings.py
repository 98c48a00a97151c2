"""All configuration in one place: ``KERNELMILL_*`` environment variables (pydantic-settings).

Every layer reads its settings from here; tests override them with
environment variables or ``override_settings``.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kernelmill"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KERNELMILL_", env_file=".env", extra="ignore")

    cache_dir: Path = Field(default_factory=_default_cache_dir, description="compiled cubins and ptxas reports")
    nvcc: str = Field("nvcc", description="nvcc executable")
    compile_timeout_s: float = Field(120.0, gt=0, description="nvcc wall-clock limit per variant")
    compile_workers: int = Field(default_factory=lambda: max(1, os.cpu_count() or 1), ge=1)
    verify_seeds: int = Field(3, ge=1, description="random input sets per verification")
    bench_warmup: int = Field(5, ge=0)
    bench_reps: int = Field(50, ge=1)


_current: Settings | None = None


def get_settings() -> Settings:
    """The process-wide settings, read from the environment on first use."""
    global _current
    if _current is None:
        _current = Settings()
    return _current


def override_settings(**values) -> Settings:
    """Replace the process-wide settings (tests); ``reset_settings`` re-reads the environment."""
    global _current
    _current = Settings(**values)
    return _current


def reset_settings() -> None:
    global _current
    _current = None
