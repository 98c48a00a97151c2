"""/api/kernels: the served kernels, the best one for a problem, and its cubin."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Query, Response, status

from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.base import SpecError
from kernelmill.service.api.deps import get_store
from kernelmill.service.api.schemas import BestKernelOut, KernelOut, KernelSummary, Page
from kernelmill.service.db.store import Store

router = APIRouter(prefix="/api/kernels", tags=["kernels"])


def _kernel_out(store: Store, kernel_id: int) -> KernelOut:
    kernel = store.kernel(kernel_id)
    if kernel is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no kernel with id {kernel_id}")
    profile = None
    if kernel.trial_id is not None:
        trial = store.trial(kernel.trial_id)
        profile = trial.profile if trial else None
    return KernelOut.model_validate(kernel, from_attributes=True).model_copy(update={"profile": profile})


@router.get("")
def list_kernels(
    store: Store = Depends(get_store),
    op: str | None = None,
    dtype: str | None = None,
    arch: str | None = None,
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0),
) -> Page[KernelSummary]:
    rows, total = store.list_kernels(op, dtype, arch, limit, offset)
    return Page[KernelSummary](
        items=[KernelSummary.model_validate(k) for k in rows], total=total, limit=limit, offset=offset
    )


@router.get("/best")
def best_kernel(
    op: str,
    shape: str = Query(description="e.g. 8192x8192"),
    dtype: str = "float16",
    arch: str | None = None,
    act: str | None = Query(None, description="fused_mlp's activation"),
    store: Store = Depends(get_store),
) -> BestKernelOut:
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
    out = _kernel_out(store, kernel.id)
    return BestKernelOut(**out.model_dump(), exact=exact, requested_shape=list(dims))


@router.get("/{kernel_id}")
def get_kernel(kernel_id: int, store: Store = Depends(get_store)) -> KernelOut:
    return _kernel_out(store, kernel_id)


@router.get(
    "/{kernel_id}/cubin", response_class=Response, responses={200: {"content": {"application/octet-stream": {}}}}
)
def get_cubin(kernel_id: int, store: Store = Depends(get_store)) -> Response:
    kernel = store.kernel(kernel_id, with_cubin=True)
    if kernel is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no kernel with id {kernel_id}")
    name = f"{kernel.op}-{kernel.shape_key}-{kernel.dtype}-{kernel.arch}.cubin"
    return Response(
        kernel.cubin,
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )
