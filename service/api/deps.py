"""Dependencies shared by the routes: the store, the runner, settings and the write token."""

from __future__ import annotations

import hmac

from fastapi import Depends, HTTPException, Query, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.base import SpecError
from kernelmill.service.db.models import JOB_STATES
from kernelmill.service.db.store import Store
from kernelmill.settings import Settings

_bearer = HTTPBearer(auto_error=False)


# Async: plain attribute reads, so FastAPI runs them on the event loop instead of a worker thread each.
async def get_store(request: Request) -> Store:
    return request.app.state.store


async def get_settings_dep(request: Request) -> Settings:
    return request.app.state.settings


#: What browsers send in Sec-Fetch-Site for a request of the service's own pages (/docs), or one typed in.
OWN_SITE = ("same-origin", "none")


def from_another_site(sec_fetch_site: str | None) -> bool:
    """Whether a browser marked the request as sent from a page other than the service's own."""
    return sec_fetch_site is not None and sec_fetch_site.lower() not in OWN_SITE


async def require_writer(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    """Writes need the bearer token when KERNELMILL_API_TOKEN is set, and are never taken from another site's page.

    A form on any page can post to the cancel route (a simple request: no preflight), and without a token the
    visitor's browser would cancel the job; browsers name the request's origin in Sec-Fetch-Site (the CLI and
    curl send none)."""
    site = request.headers.get("sec-fetch-site")
    if from_another_site(site):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            detail=f"a browser sent this write from another site's page (Sec-Fetch-Site: {site[:40]}): "
            "writes come from kernelmill's own pages or a client such as the CLI",
        )
    token = request.app.state.settings.api_token
    if not token:
        return
    if credentials is None or not hmac.compare_digest(credentials.credentials.encode(), token.encode()):
        detail = (
            "this server needs 'Authorization: Bearer <token>' for writes (KERNELMILL_API_TOKEN)"
            if credentials is None
            else "this server refused the bearer token: it is not the server's KERNELMILL_API_TOKEN"
        )
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, detail=detail, headers={"WWW-Authenticate": "Bearer"})


async def op_filter(op: str | None = Query(None, description="only this op's rows")) -> str | None:
    """A list's ``op=`` filter: None where it is not given or empty; 422 for an op that does not exist (a typo
    would otherwise answer an empty page, as if nothing were there)."""
    if op is None or not op.strip():
        return None
    try:
        return get_op(op).name
    except SpecError as exc:
        raise HTTPException(422, detail=str(exc)) from None


async def state_filter(
    state: str | None = Query(None, description=f"only jobs in this state: {', '.join(JOB_STATES)}"),
) -> str | None:
    """A job list's ``state=`` filter: None where it is not given or empty (as ``op=``); 422 for no such state."""
    if state is None or not state.strip():
        return None
    if state not in JOB_STATES:
        raise HTTPException(422, detail=f"unknown state {state!r}: one of {', '.join(JOB_STATES)}")
    return state


async def json_body(request: Request) -> None:
    """415 for a body not sent as JSON (a form, text/plain, no Content-Type: curl -d sends a form): FastAPI
    reads it as no object at all, and the 422 said 'Input should be a valid dictionary'."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json" and not kind.endswith("+json"):
        raise HTTPException(
            status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
            detail=f"the body is {kind or 'sent without a Content-Type'}: send it as JSON, with "
            "'Content-Type: application/json'",
        )
