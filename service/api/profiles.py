"""/api/profiles/forward: the summaries ``kernelmill profile-forward`` stored (nsys over a model's forwards)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Query, status

from kernelmill.service.api.deps import get_store
from kernelmill.service.api.schemas import ForwardProfileOut, ForwardProfileSummary, Offset, Page, ProfileId, problems
from kernelmill.service.db.store import Store

router = APIRouter(prefix="/api/profiles/forward", tags=["profiles"])


@router.get("", responses=problems(422))
def list_forward_profiles(
    store: Store = Depends(get_store),
    model: str | None = Query(None, description="a preset's name or a model's path"),
    limit: int = Query(50, ge=1, le=1000),
    offset: Offset = 0,
) -> Page[ForwardProfileSummary]:
    rows, total = store.list_forward_profiles(model, limit, offset)
    items = [ForwardProfileSummary.model_validate(r) for r in rows]
    return Page[ForwardProfileSummary](items=items, total=total, limit=limit, offset=offset)


@router.get("/{profile_id}", responses=problems(404, 422))
def get_forward_profile(profile_id: ProfileId, store: Store = Depends(get_store)) -> ForwardProfileOut:
    row = store.forward_profile(profile_id)
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"no forward profile with id {profile_id}")
    return ForwardProfileOut.model_validate(row)
