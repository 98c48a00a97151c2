"""/api/kernels: the served kernels, the best one for a problem, and its cubin."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlencode
from weakref import WeakKeyDictionary

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response, status
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from kernelmill.kernels.compile import base_arch, normalize_arch
from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.base import DTYPES, SpecError, format_shape
from kernelmill.kernels.render import CODE_HEADER, code_digest
from kernelmill.service.api.deps import get_store, op_filter
from kernelmill.service.api.schemas import BestKernelOut, KernelId, KernelOut, KernelSummary, Offset, Page, problems
from kernelmill.service.db.models import Kernel
from kernelmill.service.db.store import Store, attrs_key, nearest_shape

log = logging.getLogger(__name__)

router = APIRouter(prefix="/api/kernels", tags=["kernels"])

#: The most digits of a GPU's compute capability (sm_120: 3); a query's arch with more names no GPU.
MAX_ARCH_DIGITS = 4


def _kernel_out(store: Store, kernel_id: int, kernel: Kernel | None = None) -> KernelOut:
    kernel = kernel or store.kernel(kernel_id)
    if kernel is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no kernel with id {kernel_id}")
    profile = store.trial_profile(kernel.trial_id) if kernel.trial_id is not None else None
    return KernelOut.model_validate(kernel, from_attributes=True).model_copy(update={"profile": profile})


def _query_arch(arch: str | None) -> str | None:
    """A query's arch as kernels are served under it ("90" -> "sm_90"; "sm_90a" stays: wgmma kernels are
    served as sm_90a); None where none is given, or it is empty (as the dashboard's "any arch" sends it);
    SpecError where it is no arch at all, which could only match nothing: malformed, or a number of more digits
    than any GPU's (a GPU newer than this version knows is still asked for)."""
    if arch is None or not arch.strip():
        return None
    try:
        normalized = normalize_arch(arch)
    except ValueError as exc:
        raise SpecError(f"arch: {exc}") from None
    digits = base_arch(normalized).removeprefix("sm_")
    if len(digits) > MAX_ARCH_DIGITS:
        shown = normalized if len(normalized) <= 24 else f"{normalized[:16]}... ({len(normalized)} characters)"
        raise SpecError(f"arch: {shown} is no GPU: compute capabilities have at most {MAX_ARCH_DIGITS} digits")
    return normalized


@router.get("", responses=problems(422))
def list_kernels(
    store: Store = Depends(get_store),
    op: str | None = Depends(op_filter),
    dtype: str | None = None,
    arch: str | None = None,
    precision: str | None = None,
    limit: int = Query(100, ge=1, le=1000),
    offset: Offset = 0,
) -> Page[KernelSummary]:
    # An empty filter is no filter (as op= and arch=); one that can match nothing is a typo: say so (as /best
    # does) rather than answer an empty page.
    dtype, precision = dtype or None, precision or None
    if dtype is not None and dtype not in DTYPES:
        raise HTTPException(422, f"unknown dtype {dtype!r}: one of {', '.join(DTYPES)}")
    precisions = (*DTYPES, "tf32")  # a dtype computed in itself, or float32 on TF32 tensor cores
    if precision is not None and precision not in precisions:
        raise HTTPException(422, f"unknown precision {precision!r}: one of {', '.join(precisions)}")
    computed_in = (dtype, "tf32") if dtype == "float32" else (dtype,)  # only float32 also runs as TF32
    if dtype is not None and precision is not None and precision not in computed_in:
        raise HTTPException(422, f"precision {precision!r}: {dtype} is computed in {' or '.join(computed_in)} only")
    try:
        arch = _query_arch(arch)
    except SpecError as exc:
        raise HTTPException(422, str(exc)) from None
    rows, total = store.list_kernels(op, dtype, arch, limit, offset, precision=precision)
    return Page[KernelSummary](
        items=[KernelSummary.model_validate(k) for k in rows], total=total, limit=limit, offset=offset
    )


BEST_PATH = "/api/kernels/best"
#: The query parameters of GET /api/kernels/best; any other is refused (422), so that an attribute given
#: under its own name (``eps=1e-05``) is never silently ignored and answered with another attribute's kernel.
BEST_QUERY = frozenset({"op", "shape", "dtype", "arch", "attr", "act", "precision", "device"})


class BestCache:
    """What ``GET /api/kernels/best`` needs, in memory, one cache per store.

    Three levels, each bounded (least recently used goes first):

    - ``answers``: the JSON of found kernels (never a 404 or 422) by raw query string, which
      ``BestKernelFastPath`` serves before FastAPI routes the request; bounded in bytes too, since every
      variation of a query string is an answer of its own, each holding a kernel's source (up to ~100 KB);
    - ``problems``: the served (id, shape) pairs of a problem (op, dtype, arch, attributes), so that a new
      shape of a known problem finds its nearest tuned shape without the database;
    - ``kernels``: a served kernel's fields by id.

    Everything is dropped when this process publishes (the store's ``served_version``, compared on every
    lookup) and when another process has (replicas on PostgreSQL): the served kernels' fingerprint is read
    again once ``ttl_s`` has passed since the last read (one query for all keys, in a worker thread), so
    what other processes publish shows within about a second. What a worker thread read is kept only if
    nothing was dropped while it read (the ``generation`` it started in is still the current one).
    """

    ttl_s = 1.0
    max_answers = 4096
    max_answer_bytes = 64 * 2**20
    max_problems = 1024
    max_kernels = 1024

    def __init__(self) -> None:
        self.answers: OrderedDict[bytes, bytes] = OrderedDict()
        self.problems: OrderedDict[tuple, list[tuple[int, list[int]]]] = OrderedDict()
        self.kernels: OrderedDict[int, KernelOut] = OrderedDict()
        self.answer_bytes = 0  # the bodies in ``answers``
        self.generation = 0  # bumped whenever everything is dropped
        self._served_version: int | None = None
        self._fingerprint: int | None = None
        self._checked_at = -math.inf
        self._checking: asyncio.Future | None = None

    async def refresh(self, store: Store) -> int:
        """Drop what may be stale; the generation that what is read from now on belongs to."""
        self._follow_local(store)
        if time.monotonic() - self._checked_at >= self.ttl_s:
            if self._checking is None:  # one fingerprint read at a time, however many lookups wait on it
                self._checking = asyncio.ensure_future(self._check(store))
            await asyncio.shield(self._checking)
            self._follow_local(store)
        return self.generation

    def get(self, level: OrderedDict, key: Any) -> Any:
        """``level[key]`` or None (after ``refresh``)."""
        value = level.get(key)
        if value is not None:
            level.move_to_end(key)
        return value

    def put(self, store: Store, generation: int, level: OrderedDict, key: Any, value: Any) -> None:
        """``level[key] = value``, unless something was dropped since ``generation`` (it may be stale)."""
        self._follow_local(store)
        if generation != self.generation:
            return
        answers = level is self.answers
        if answers:
            self.answer_bytes += len(value) - len(level.get(key, b""))
        level[key] = value
        level.move_to_end(key)
        limit = {id(self.answers): self.max_answers, id(self.problems): self.max_problems}.get(id(level))
        while len(level) > (limit or self.max_kernels) or (
            answers and self.answer_bytes > self.max_answer_bytes and len(level) > 1
        ):
            _, dropped = level.popitem(last=False)
            if answers:
                self.answer_bytes -= len(dropped)

    def _follow_local(self, store: Store) -> None:
        if store.served_version != self._served_version:
            self._served_version = store.served_version
            self._drop()

    async def _check(self, store: Store) -> None:
        started = time.monotonic()
        try:
            fingerprint = await run_in_threadpool(store.served_fingerprint)
        except Exception:  # noqa: BLE001 - nothing is answered from memory until the database answers again
            log.warning("best-kernel cache: cannot read the served kernels; not answering from memory", exc_info=True)
            self._drop()
            return
        finally:
            self._checking = None
        if fingerprint != self._fingerprint:
            self._fingerprint = fingerprint
            self._drop()
        self._checked_at = started

    def _drop(self) -> None:
        self.answers.clear()
        self.answer_bytes = 0
        self.problems.clear()
        self.kernels.clear()
        self.generation += 1


_best_caches: WeakKeyDictionary[Store, BestCache] = WeakKeyDictionary()


def best_cache(store: Store) -> BestCache:
    cache = _best_caches.get(store)
    if cache is None:
        cache = _best_caches[store] = BestCache()
    return cache


class BestKernelFastPath:
    """ASGI middleware: answers ``GET /api/kernels/best`` from the store's BestCache before FastAPI routes the
    request. FastAPI's routing, dependencies and query parsing cost about 0.3 ms of CPU a request, more than
    ten times a cache hit; a miss goes on to the route, which answers and fills the cache."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and _route_path(scope) == BEST_PATH:
            store = getattr(scope["app"].state, "store", None)  # set at start-up
            if store is not None:
                cache = best_cache(store)
                await cache.refresh(store)
                body = cache.get(cache.answers, scope["query_string"])
                if body is not None:
                    return await Response(body, media_type="application/json")(scope, receive, send)
        await self.app(scope, receive, send)


async def warm_up(app: ASGIApp, store: Store) -> None:
    """One best-kernel lookup through the whole app at start-up, for a served kernel when there is one.

    What is built on first use (FastAPI's route tables, anyio's worker threads, compiled SQL, the first
    answer's serializer) costs the first lookup about 75 ms of CPU on two cores; paid here, before the server
    accepts connections, the first clients do not queue behind it. The answer is an ordinary one (200, or
    404 when nothing is served), kept in the cache like any other.
    """
    try:
        served, _ = await run_in_threadpool(store.list_kernels, None, None, None, 1, 0)
        await app(_warm_up_scope(served[0] if served else None), _empty_body, _ignore)
    except Exception:  # noqa: BLE001 - only a head start: the service starts without it
        log.warning("best-kernel lookup warm-up failed", exc_info=True)


def _warm_up_scope(kernel: Kernel | None) -> Scope:
    if kernel is not None:
        query: dict[str, Any] = {"op": kernel.op, "shape": kernel.shape_key, "dtype": kernel.dtype, "arch": kernel.arch}
        query["attr"] = [f"{name}:{value}" for name, value in sorted((kernel.attrs or {}).items())]
        if kernel.precision != kernel.dtype:
            query["precision"] = kernel.precision
    else:
        query = {"op": "softmax", "shape": "1x1", "dtype": "float16"}
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": BEST_PATH, "raw_path": BEST_PATH.encode(), "root_path": "", "headers": [(b"host", b"localhost")],
        "query_string": urlencode(query, doseq=True).encode(), "client": None, "server": None,
    }  # fmt: skip


async def _empty_body() -> dict:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _ignore(message: dict) -> None:
    pass


def _route_path(scope: Scope) -> str:
    root, path = scope.get("root_path", ""), scope["path"]
    return path[len(root) :] if root and path.startswith(root) else path


@router.get("/best", response_model=BestKernelOut, responses=problems(404, 422))
async def best_kernel(
    request: Request,
    op: str,
    shape: str = Query(description="e.g. 8192x8192"),
    dtype: str = "float16",
    arch: str | None = None,
    attr: list[str] = Query(
        [],
        description="an op attribute NAME:VALUE, repeatable, e.g. attr=eps:1e-05 (layernorm) or attr=act:relu; "
        "attributes not given take the op's defaults (`kernelmill ops --json` lists them)",
    ),
    act: str | None = Query(None, description="shorthand for attr=act:VALUE (fused_mlp, linear, bias_act)"),
    precision: str | None = Query(
        None,
        description="the arithmetic the kernel computes the dtype in: the dtype itself (the default), or tf32 for "
        "a float32 kernel on tensor cores; kernels of other precisions are never served in its place",
    ),
    device: str | None = Query(
        None,
        max_length=128,
        description="the asker's GPU model (e.g. 'NVIDIA H200'): of the kernels served for the shape, the one tuned "
        "on that model is preferred; otherwise (or without it) the highest speedup over its own GPU's PyTorch",
    ),
    store: Store = Depends(get_store),
) -> Response:
    # Cache hits never get here (BestKernelFastPath answers them). Async: checking the query is cheap, and
    # the database work, only for what the cache lacks, takes one worker-thread hop per level.
    unknown = sorted(set(request.query_params) - BEST_QUERY)
    try:
        if unknown:
            raise SpecError(f"unknown query parameter {unknown[0]!r}; give op attributes as attr=NAME:VALUE")
        spec = get_op(op)
        spec.check_dtype(dtype)
        dims = spec.parse_shape(shape)
        given_attrs = query_attrs(attr, act)
        attrs = spec.resolve_attrs(given_attrs)
        precision = served_precision(spec, dtype, precision)
        arch = _query_arch(arch)
    except SpecError as exc:
        raise HTTPException(422, detail=str(exc)) from None
    cache = best_cache(store)
    generation = await cache.refresh(store)
    problem = (op, dtype, arch or None, attrs_key(attrs), precision)
    served = cache.get(cache.problems, problem)
    if served is None:
        served = await run_in_threadpool(store.served_shapes, op, dtype, arch, attrs, precision)
        cache.put(store, generation, cache.problems, problem, served)
    found = nearest_shape(served, dims, device)
    out = cache.get(cache.kernels, found[0]) if found else None
    if found and out is None:
        out = await run_in_threadpool(_kernel_out_or_none, store, found[0])
        if out is not None:
            cache.put(store, generation, cache.kernels, found[0], out)
    if out is None:  # none served (or, never in practice, deleted since its shape was read)
        served_problems = await run_in_threadpool(store.served_problems, op)
        detail = best_miss(op, dims, dtype, precision, arch, attrs, set(given_attrs), served_problems)
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=detail)
    answer = BestKernelOut.model_construct(**dict(out), exact=found[1], requested_shape=list(dims))
    body = answer.model_dump_json().encode()
    cache.put(store, generation, cache.answers, request.scope["query_string"], body)
    return Response(body, media_type="application/json")


def best_miss(
    op: str,
    dims: tuple[int, ...],
    dtype: str,
    precision: str,
    arch: str | None,
    attrs: dict[str, Any],
    given: set[str],
    served: list[tuple[str, str, str, dict[str, Any]]],
) -> str:
    """The 404 detail of a best-kernel lookup that found nothing: what was asked (attributes the query left to
    the op's defaults marked so), and the first part of it that no served kernel of ``op`` matches, with what is
    served there instead (``served``: Store.served_problems)."""
    named = [f"{k}={v}" + ("" if k in given else " (the default)") for k, v in sorted(attrs.items())]
    computed = f" computed in {precision}" if precision != dtype else ""
    asked = f"{op} {format_shape(dims)} {dtype}{computed}" + (f" for {arch}" if arch else "")
    asked += f" with {', '.join(named)}" if named else ""
    reason = _first_mismatch(op, dtype, precision, arch, attrs, served)
    because = f": {reason}" if reason else ""
    return f"no tuned kernel for {asked}, at this or any other shape{because}; submit a job to tune one"


def _first_mismatch(
    op: str,
    dtype: str,
    precision: str,
    arch: str | None,
    attrs: dict[str, Any],
    served: list[tuple[str, str, str, dict[str, Any]]],
) -> str | None:
    """Narrows ``served`` by dtype, precision, arch (where asked) and attributes, in that order; says where
    nothing is left and what was there."""
    if not served:
        return f"no {op} kernel is served yet"

    def only(values: Iterable[str]) -> str:
        shown = sorted(set(values))
        more = f" and {len(shown) - 5} more" if len(shown) > 5 else ""
        return ", ".join(shown[:5]) + more + " only"

    left = [p for p in served if p[0] == dtype]
    if not left:
        return f"{op} kernels are served in {only(p[0] for p in served)}"
    matching = [p for p in left if p[1] == precision]
    if not matching:
        return f"{op} {dtype} kernels are served computed in {only(p[1] for p in left)}"
    left = matching
    if arch:
        matching = [p for p in left if p[2] == arch]
        if not matching:
            return f"{op} {dtype} kernels are served for {only(p[2] for p in left)}"
        left = matching
    if all(p[3] != attrs for p in left):
        return f"{op} {dtype} kernels are served with {only(_other_attrs(p[3], attrs) for p in left)}"
    return None


def _other_attrs(served: dict[str, Any], asked: dict[str, Any]) -> str:
    """The attributes of a served kernel where they differ from those asked for (or those it lacks)."""
    differing = [f"{k}={v}" for k, v in sorted(served.items()) if k not in asked or asked[k] != v]
    return " ".join(differing) or "no " + ", ".join(sorted(set(asked) - set(served)))


def served_precision(spec, dtype: str, precision: str | None) -> str:
    """The precision a best-kernel query asks for: the dtype itself unless named; SpecError where no family of
    the op computes ``dtype`` in it."""
    if precision is None:
        return dtype
    known = sorted({f.precision(dtype) for f in spec.families.values() if dtype in f.dtypes})
    if precision not in known:
        raise SpecError(f"{spec.name} computes {dtype} in {', '.join(known)}, not in {precision!r}")
    return precision


def query_attrs(attr: list[str], act: str | None) -> dict[str, str]:
    """The attributes of ``attr=NAME:VALUE`` query parameters (and ``act=``), not yet checked against the op."""
    raw: dict[str, str] = {}
    for item in attr:
        name, sep, value = item.partition(":")
        name = name.strip()
        if not sep or not name:
            raise SpecError(f"malformed attr {item!r}: expected NAME:VALUE, e.g. eps:1e-05")
        if name in raw:
            raise SpecError(f"attribute {name} given twice")
        raw[name] = value.strip()
    if act is not None:  # act= empty is refused as attr=act: is, not read as "not given"
        if "act" in raw:
            raise SpecError("act given twice: as act= and as attr=act:")
        raw["act"] = act
    return raw


def _kernel_out_or_none(store: Store, kernel_id: int) -> KernelOut | None:
    try:
        return _kernel_out(store, kernel_id)
    except HTTPException:
        return None


@router.get("/{kernel_id}", responses=problems(404, 422))
def get_kernel(kernel_id: KernelId, store: Store = Depends(get_store)) -> KernelOut:
    return _kernel_out(store, kernel_id)


@router.get(
    "/{kernel_id}/cubin",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}}, **problems(404, 422)},
)
def get_cubin(kernel_id: KernelId, store: Store = Depends(get_store)) -> Response:
    kernel = store.kernel(kernel_id, with_cubin=True)
    if kernel is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no kernel with id {kernel_id}")
    name = f"{kernel.op}-{kernel.shape_key}-{kernel.dtype}-{kernel.arch}.cubin"
    # The code these bytes were built from: a kernel re-published under its id between a client's /best and this
    # read would otherwise pair one kernel's cubin with the other's source and launches, unseen.
    code = kernel.code_sha256 or code_digest(kernel.source)
    return Response(
        kernel.cubin,
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{name}"', CODE_HEADER: code},
    )
