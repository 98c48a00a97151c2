"""tune_model: submit tuning jobs to a kernelmill service for the problems a model meets."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.base import SpecError
from kernelmill.runtime import ops
from kernelmill.runtime.registry import answer_detail, excerpt, named_server, request_within

log = logging.getLogger(__name__)

#: Shapes per job (the service's default KERNELMILL_MAX_SHAPES).
MAX_SHAPES_PER_JOB = 32

#: Seconds to connect to the service: a host that does not answer fails fast.
CONNECT_TIMEOUT_S = 3.0
#: Seconds the service may take to answer a submission (it validates and stores the job), per read.
SUBMIT_TIMEOUT_S = 15.0


def submit_timeout():
    """The httpx timeout of job submissions: ``CONNECT_TIMEOUT_S`` to connect, ``SUBMIT_TIMEOUT_S`` otherwise."""
    import httpx

    return httpx.Timeout(SUBMIT_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)


class TuneError(ValueError):
    """The service could not be reached or refused a job. ``jobs``: the jobs it had created before (they run
    on; the message gives their ids)."""

    def __init__(self, message: str, jobs: list[dict[str, Any]], *, unreachable: bool = False) -> None:
        if jobs:
            message += f"; submitted before it: job {', '.join(str(j.get('id')) for j in jobs)}"
        super().__init__(message)
        self.jobs, self.unreachable = jobs, unreachable


def model_problems(
    model: Any, *inputs: Any, progress: Callable[[tuple], None] | None = None, **kwargs: Any
) -> list[tuple[str, tuple[int, ...], str, dict]]:
    """The (op, shape, dtype, attrs) problems one forward of ``model`` on these inputs meets. The inputs go
    through the module's ``prepare`` as in ``Model.forward`` (padded to its buckets): NumPy arrays, torch tensors
    and lists all do. ``progress`` is called with each op's problem as the op begins (``ops.recording``)."""
    from kernelmill.runtime.models import Model

    module = model.module if isinstance(model, Model) else model
    registry = model.registry if isinstance(model, Model) else None
    prepared = model.prepare(*inputs, **kwargs)[0] if isinstance(model, Model) else module.prepare(*inputs, **kwargs)
    with ops.recording(progress) as seen:
        if registry is not None:
            with ops.using_registry(registry):
                module.forward_prepared(*prepared)
        else:
            module.forward_prepared(*prepared)
    return list(seen)


def _created_job(resp: Any) -> tuple[dict[str, Any] | None, str]:
    """(the job a submission's 2xx answer holds, or None and what the answer is instead)."""
    try:
        job = resp.json()
    except ValueError:
        return None, "something that is not JSON"
    if not isinstance(job, dict):
        return None, f"a JSON {type(job).__name__}, not a job"
    if "id" not in job:
        return None, "a JSON object without an id, not a job"
    return job, ""


def tune_model(
    model: Any,
    sample_input: Any,
    server: str | None = None,
    *,
    dtype: str | None = None,
    strategy: str = "evolutionary",
    trials: int = 64,
    seconds: float = 1800.0,
    arch: str = "auto",
    client: Any = None,
    progress: Callable[[tuple], None] | None = None,
    **forward_kwargs: Any,
) -> list[dict[str, Any]]:
    """Runs one forward on ``sample_input`` (a tuple for several inputs) to collect the model's problems,
    then POSTs one /api/jobs per (op, dtype, attrs) with its shapes. Returns the created jobs.

    ``dtype`` overrides the problems' dtype (e.g. tune float16 kernels from a float32 CPU run). Without it, a
    Model loaded for another dtype than its CPU forward computes in (``load_model(..., device="cpu",
    dtype="float16")`` runs in float32) is tuned in the dtype it was loaded for.

    A client of its own (``server`` or KERNELMILL_SERVER) connects within ``CONNECT_TIMEOUT_S`` (3 s) and waits
    ``SUBMIT_TIMEOUT_S`` (15 s) per read for each answer. The first failure stops: a TuneError (``jobs``: those
    created before it) where the service cannot be reached, refuses a job, or answers one with something that
    is not a job. ``progress`` is called with each op's problem as the CPU forward reaches it."""
    import httpx

    from kernelmill.runtime.models import Model
    from kernelmill.settings import get_settings

    if dtype is None and isinstance(model, Model):
        asked = getattr(model, "requested_dtype", model.dtype)
        if asked != model.dtype:
            log.info(
                "runtime: tuning %s kernels, the dtype the model was loaded for (its %s forward computes %s); "
                "dtype= tunes another",
                asked,
                model.device,
                model.dtype,
            )
            dtype = asked
    inputs = sample_input if isinstance(sample_input, tuple) else (sample_input,)
    problems = model_problems(model, *inputs, progress=progress, **forward_kwargs)
    groups: dict[tuple, list[list[int]]] = {}
    attrs_of: dict[tuple, dict] = {}
    for op, shape, problem_dtype, attrs in problems:
        key = (op, dtype or problem_dtype, tuple(sorted((k, str(v)) for k, v in attrs.items())))
        attrs_of[key] = {k: str(v) for k, v in attrs.items()}
        if list(shape) not in groups.setdefault(key, []):
            groups[key].append(list(shape))
    for op, _, attrs in groups:  # before anything is submitted: a job the service would refuse stops them all
        try:
            get_op(op).resolve_attrs(dict(attrs))
        except SpecError as exc:
            raise ValueError(f"this model's {op} has no GPU kernel to tune ({exc}); nothing was submitted") from None
    most = max((min(len(shapes), MAX_SHAPES_PER_JOB) for shapes in groups.values()), default=0)
    if trials < most:  # a job splits its trials over its shapes, one at least each: the service would refuse it
        busiest = max(groups, key=lambda k: len(groups[k]))[0]
        raise ValueError(
            f"trials={trials} cannot try the {most} {busiest} shapes of one job (one trial each at least): give "
            f"trials >= {most}; nothing was submitted"
        )
    own_client, base = client is None, ""
    if own_client:
        base = named_server(server or None)
        if not base:
            raise ValueError("tune_model needs a server (argument or KERNELMILL_SERVER)")
        client = httpx.Client(base_url=base, timeout=submit_timeout())
    token = get_settings().api_token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    jobs: list[dict[str, Any]] = []
    try:
        for (op, job_dtype, _), shapes in groups.items():
            for start in range(0, len(shapes), MAX_SHAPES_PER_JOB):
                body = {
                    "op": op,
                    "shapes": shapes[start : start + MAX_SHAPES_PER_JOB],
                    "dtype": job_dtype,
                    "arch": arch,
                    "strategy": strategy,
                    "attrs": attrs_of[(op, job_dtype, _)],
                    "budget": {"trials": trials, "seconds": seconds},
                }
                try:  # the whole answer within the read timeout: a server sending a byte a second held it for ever
                    resp = request_within(client, "POST", "/api/jobs", SUBMIT_TIMEOUT_S, json=body, headers=headers)
                except httpx.HTTPError as exc:
                    where = base or client.base_url
                    raise TuneError(f"cannot reach the service at {where}: {exc}", jobs, unreachable=True) from None
                if resp.status_code >= 400:
                    raise TuneError(
                        f"the service refused the {op} job ({resp.status_code}): {answer_detail(resp)}", jobs
                    )
                job, instead = _created_job(resp)
                if job is None:
                    raise TuneError(
                        f"the service answered the {op} job ({resp.status_code}) with {instead}: {excerpt(resp.text)}",
                        jobs,
                    )
                shown = len(body["shapes"])
                log.info("runtime: submitted job %s: %s %s x%d shapes", job.get("id"), op, job_dtype, shown)
                jobs.append(job)
    finally:
        if own_client:
            client.close()
    return jobs
