"""/api/workers and /api/health."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from kernelmill import __version__
from kernelmill.service.api.deps import get_store
from kernelmill.service.api.schemas import Health, WorkerOut, WorkersOut
from kernelmill.service.db.store import Store

router = APIRouter(prefix="/api", tags=["system"])


@router.get("/workers")
def workers(request: Request) -> WorkersOut:
    executor = request.app.state.executor
    listing = [WorkerOut(**w.__dict__) for w in executor.workers()]
    return WorkersOut(workers=listing, reason=None if listing else executor.why_none())


@router.get("/health")
def health(request: Request, store: Store = Depends(get_store)) -> Health:
    store.list_jobs(limit=1)  # touches the database
    return Health(
        status="ok",
        version=__version__,
        database=store.engine.url.get_backend_name(),
        workers=len(request.app.state.executor.workers()),
    )
