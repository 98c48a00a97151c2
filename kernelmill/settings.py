"""All configuration in one place: ``KERNELMILL_*`` environment variables (pydantic-settings).

Every layer reads its settings from here; tests override them with
environment variables or ``override_settings``.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: The longest wait a timeout setting may name: a day. Python's waits overflow past their C types (subprocess's
#: poll() past ~24.8 days, sockets and threads further on), so KERNELMILL_COMPILE_TIMEOUT_S=1e300 was accepted and
#: every compile then ended in an OverflowError traceback.
MAX_WAIT_S = 86400.0


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kernelmill"


class Settings(BaseSettings):
    # No float setting means anything at inf or nan: KERNELMILL_COMPILE_CACHE_MAX_MB=inf overflowed int() in the
    # compiler, KERNELMILL_MAX_BUDGET_SECONDS=inf let a job of infinite seconds in (its page then 500ed).
    model_config = SettingsConfigDict(env_prefix="KERNELMILL_", env_file=".env", extra="ignore", allow_inf_nan=False)

    cache_dir: Path = Field(default_factory=_default_cache_dir, description="compiled cubins and ptxas reports")
    nvcc: str = Field("nvcc", description="nvcc executable")
    compile_timeout_s: float = Field(120.0, gt=0, le=MAX_WAIT_S, description="nvcc wall-clock limit per variant")
    compile_workers: int = Field(default_factory=lambda: max(1, os.cpu_count() or 1), ge=1)
    compile_cache_max_mb: float = Field(
        4096.0,
        ge=0,
        description="the compile cache (cache_dir/cubin) is kept under this size, its least recently used entries "
        "removed first; 0: no limit (`kernelmill cache prune` cuts it by hand)",
    )
    verify_seeds: int = Field(
        3, ge=1, description="random input sets per verification (at least one per kind of input an op draws)"
    )
    bench_reps: int = Field(30, ge=1, description="timed repetitions per trial")
    kernel_timeout_s: float = Field(10.0, gt=0, le=MAX_WAIT_S, description="a kernel running longer is a hang")
    nvtx: bool = Field(
        False, description="NVTX ranges around each runtime op on the GPU (profile-forward sets it in its child)"
    )
    nsys: str = Field("nsys", description="Nsight Systems executable (profile-forward)")
    pdl: bool = Field(
        True,
        description="runtime CUDA graphs launch each kernel of a PDL family early (programmatic dependent launch, "
        "sm_90): it sets up while the kernel before it finishes (KERNELMILL_PDL=false: off)",
    )
    pdl_tune: bool = Field(
        True,
        description="with pdl, a captured forward is recaptured with each PDL kernel on plain edges and the "
        "faster graph kept, once per input shape (KERNELMILL_PDL_TUNE=false: PDL for every such kernel)",
    )
    kernel_tune: bool = Field(
        True,
        description="a captured forward is recaptured with the defaults' runners-up in place of each untuned "
        "kernel that has them (wgmma tiles), outputs checked, and the faster graph kept, once per input shape; "
        "the choice is recorded per GPU model under cache_dir/chosen (where the replays timed for it were steady) "
        "and reused, so only the first capture of "
        "a shape on a GPU model pays for the runners-up's compiles and timing (KERNELMILL_KERNEL_TUNE=false: "
        "shape defaults only)",
    )

    runtime_check: bool = Field(
        True,
        description="the runtime verifies each kernel no tuning job verified at its shape (nearest-shape, default, "
        "rebuilt, runners-up) against a float64 reference on the GPU before its first launch, and passes over one "
        "that fails; outcomes are recorded per GPU model under cache_dir/verified (KERNELMILL_RUNTIME_CHECK=false: "
        "off)",
    )

    max_graphs: int = Field(
        16,
        ge=1,
        description="CUDA graphs a runtime Model keeps, one per input shape, each holding its forward's buffers; "
        "capturing one more releases the least recently replayed (KERNELMILL_MAX_GRAPHS)",
    )

    plugins: str = Field(
        "",
        description="comma-separated Python modules that register extra ops (operator-enabled; each module calls "
        "kernelmill.kernels.ops.register_op). Requests can never supply CUDA source themselves.",
    )

    # -- optional LLM proposer (an OpenAI-compatible chat endpoint) ------------
    llm_url: str | None = Field(None, description="e.g. http://127.0.0.1:8080/v1; unset: the llm strategy uses guided")
    llm_api_key: str | None = None
    llm_model: str = "gpt-4o-mini"
    llm_timeout_s: float = Field(30.0, gt=0, le=MAX_WAIT_S)

    # -- service ---------------------------------------------------------------
    database_url: str = Field("sqlite:///./kernelmill.db", description="any SQLAlchemy URL (PostgreSQL works)")
    api_token: str | None = Field(None, description="when set, writes need 'Authorization: Bearer <token>'")
    server: str | None = Field(None, description="the kernelmill service the runtime and the CLI's --server use")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    access_log: bool = Field(True, description="uvicorn's log line per request (KERNELMILL_ACCESS_LOG=false: off)")
    scheduler: str | None = Field(None, description="tcp://HOST:8786 of an existing Dask scheduler")
    executor: str = Field("dask", pattern="^(dask|fake)$", description="'fake' runs synthetic GPUs (tests only)")
    fake_workers: int = Field(2, ge=0, description="fake GPUs when executor=fake")
    fake_delay_s: float = Field(0.0, ge=0, le=MAX_WAIT_S, description="seconds per fake trial")
    # jobs.budget_trials is an INTEGER (32 bits on PostgreSQL): a larger job failed its insert (500).
    max_budget_trials: int = Field(4096, ge=1, le=2**31 - 1)
    max_budget_seconds: float = Field(6 * 3600.0, gt=0)
    max_shapes: int = Field(32, ge=1)
    max_body_bytes: int = Field(64 * 1024, ge=1024, description="request bodies larger than this get 413")
    batch_size: int = Field(8, ge=1, description="candidates per evaluation batch")
    worker_answer_timeout_s: float = Field(
        900.0, gt=0, le=MAX_WAIT_S, description="a GPU worker silent this long is replaced"
    )

    @field_validator("cache_dir", mode="before")
    @classmethod
    def _cache_dir_named(cls, value: object) -> object:
        # An empty KERNELMILL_CACHE_DIR would be Path(""): the current folder, filled with cubins.
        if isinstance(value, str) and not value.strip():
            raise ValueError("is empty; unset it for the default (~/.cache/kernelmill) or name a folder")
        return value

    @field_validator("nvcc", "nsys", "llm_model", "database_url")
    @classmethod
    def _not_empty(cls, value: str, info: ValidationInfo) -> str:
        # KERNELMILL_NVCC= was "nvcc not found ()" at the first compile, KERNELMILL_DATABASE_URL= "Could not parse
        # SQLAlchemy URL" at the first listing: an empty value is a mistake, said before anything runs.
        if not value.strip():
            raise ValueError(f"is empty; unset it for the default ({cls.model_fields[info.field_name].default})")
        return value

    @field_validator("llm_url")
    @classmethod
    def _llm_url_is_a_url(cls, value: str | None) -> str | None:
        # A malformed one (no scheme, "localhost:8080/v1") was found only by each llm job, which then fell back
        # to guided with a warning in the log.
        if value is None or not value.strip():
            return None  # unset: the llm strategy uses guided
        example = "give it as http://HOST:PORT/v1, e.g. http://127.0.0.1:8080/v1"
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 - raises ValueError for a port that is out of range or not a number
        except ValueError as exc:
            raise ValueError(f"is not a URL ({exc}); {example}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"is not an http(s) URL with a host; {example}")
        return value

    @field_validator("api_token")
    @classmethod
    def _token_fits_a_header(cls, value: str | None) -> str | None:
        # Clients send it in an HTTP header, which carries ASCII only: another token could never be matched.
        if value is not None and (not value.isascii() or not value.isprintable() or value != value.strip()):
            raise ValueError("must be printable ASCII without surrounding spaces (it travels in an HTTP header)")
        if value == "":
            raise ValueError("is empty; unset it to leave writes open, or set a token")
        return value


class SettingsError(ValueError):
    """A ``KERNELMILL_*`` value (environment or ``.env``) that is not valid; one line naming each variable."""


#: Settings whose values an error names but never shows: serve's error line lands in logs.
SECRETS = frozenset({"api_token", "llm_api_key", "database_url"})


def _named(exc: ValidationError) -> str:
    problems = []
    for err in exc.errors():
        name = "KERNELMILL_" + "_".join(str(part) for part in err["loc"]).upper()
        secret = bool(err["loc"]) and err["loc"][0] in SECRETS
        problems.append(f"{name} (not shown): {err['msg']}" if secret else f"{name}={err['input']!r}: {err['msg']}")
    return "; ".join(problems)


_current: Settings | None = None


def get_settings() -> Settings:
    """The process-wide settings, read from the environment on first use; SettingsError names what is wrong."""
    global _current
    if _current is None:
        try:
            _current = Settings()
        except ValidationError as exc:
            raise SettingsError(_named(exc)) from None
        except UnicodeDecodeError as exc:  # the .env file in the current folder
            raise SettingsError(
                f".env is not UTF-8 text ({exc.reason} at byte {exc.start}); fix or remove it"
            ) from None
    return _current


def default_server() -> str | None:
    """KERNELMILL_SERVER from the environment (read each time: a process may set it late), else from .env."""
    return os.environ.get("KERNELMILL_SERVER") or get_settings().server or None


def override_settings(**values) -> Settings:
    """Replace the process-wide settings (tests); ``reset_settings`` re-reads the environment."""
    global _current
    _current = Settings(**values)
    return _current


def reset_settings() -> None:
    global _current
    _current = None
