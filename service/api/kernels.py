"""/api/kernels: the served kernels, the best one for a problem, and its cubin."""

from __future__ import annotations

import time
from collections import OrderedDict
from weakref import WeakKeyDictionary

from fastapi import APIRouter, Depends, HTTPException, Query, Response, status
from starlette.concurrency import run_in_threadpool

from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.base import SpecError
from kernelmill.service.api.deps import get_store
from kernelmill.service.api.schemas import BestKernelOut, KernelId, KernelOut, KernelSummary, Offset, Page, problems
from kernelmill.service.db.models import Kernel
from kernelmill.service.db.store import Store

router = APIRouter(prefix="/api/kernels", tags=["kernels"])


def _kernel_out(store: Store, kernel_id: int, kernel: Kernel | None = None) -> KernelOut:
    kernel = kernel or store.kernel(kernel_id)
    if kernel is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no kernel with id {kernel_id}")
    profile = store.trial_profile(kernel.trial_id) if kernel.trial_id is not None else None
    return KernelOut.model_validate(kernel, from_attributes=True).model_copy(update={"profile": profile})


@router.get("", responses=problems(422))
def list_kernels(
    store: Store = Depends(get_store),
    op: str | None = None,
    dtype: str | None = None,
    arch: str | None = None,
    limit: int = Query(100, ge=1, le=1000),
    offset: Offset = 0,
) -> Page[KernelSummary]:
    rows, total = store.list_kernels(op, dtype, arch, limit, offset)
    return Page[KernelSummary](
        items=[KernelSummary.model_validate(k) for k in rows], total=total, limit=limit, offset=offset
    )


class _BestCache:
    """Recent best-kernel answers (the JSON), per store: the lookup hot path answers from memory.

    An entry is dropped when this process publishes a kernel (the store's ``served_version``), and
    after ``ttl_s`` so that what other processes publish (replicas on PostgreSQL) shows within a second.
    Only found kernels are kept, never a 404 or 422.
    """

    ttl_s = 1.0
    max_entries = 4096

    def __init__(self) -> None:
        self.entries: OrderedDict[tuple, tuple[int, float, bytes]] = OrderedDict()

    def get(self, key: tuple, version: int) -> bytes | None:
        hit = self.entries.get(key)
        if hit is None or hit[0] != version or hit[1] < time.monotonic():
            return None
        self.entries.move_to_end(key)
        return hit[2]

    def put(self, key: tuple, version: int, body: bytes) -> None:
        self.entries[key] = (version, time.monotonic() + self.ttl_s, body)
        self.entries.move_to_end(key)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)


_best_caches: WeakKeyDictionary[Store, _BestCache] = WeakKeyDictionary()


@router.get("/best", response_model=BestKernelOut, responses=problems(404, 422))
async def best_kernel(
    op: str,
    shape: str = Query(description="e.g. 8192x8192"),
    dtype: str = "float16",
    arch: str | None = None,
    act: str | None = Query(None, description="fused_mlp's activation"),
    store: Store = Depends(get_store),
) -> Response:
    # The hot path: async (a sync route costs three worker-thread hops: dependencies, the endpoint, then
    # response validation), answered from the cache, else with the database work in one hop.
    cache = _best_caches.setdefault(store, _BestCache())
    key, version = (op, shape, dtype, arch, act), store.served_version
    body = cache.get(key, version)
    if body is None:
        out = await run_in_threadpool(_best_kernel, store, op, shape, dtype, arch, act)
        body = out.model_dump_json().encode()
        cache.put(key, version, body)
    return Response(body, media_type="application/json")


def _best_kernel(store: Store, op: str, shape: str, dtype: str, arch: str | None, act: str | None) -> BestKernelOut:
    try:
        spec = get_op(op)
        spec.check_dtype(dtype)
        dims = spec.parse_shape(shape)
        attrs = spec.resolve_attrs({"act": act} if act else {})
    except SpecError as exc:
        raise HTTPException(422, detail=str(exc)) from None
    found = store.best_kernel(op, dims, dtype, arch, attrs)
    if found is None:
        where = f" for {arch}" if arch else ""
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            detail=f"no tuned {op} kernel for {dtype}{where} at any shape; submit a job to tune one",
        )
    kernel, exact = found
    out = _kernel_out(store, kernel.id, kernel)  # already loaded: no second query
    return BestKernelOut(**out.model_dump(), exact=exact, requested_shape=list(dims))


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
    return Response(
        kernel.cubin,
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )
