"""The dashboard's routes: each validates its input, calls one function of ``views`` or ``forms``, renders.

``install(app)`` adds the pages, the static files and an HTML 404 page for
browsers; the REST API under /api is untouched.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException as StarletteHTTPException

from kernelmill import __version__
from kernelmill.kernels.compile import normalize_arch
from kernelmill.service.api.deps import get_settings_dep, get_store
from kernelmill.service.api.schemas import MAX_ID
from kernelmill.service.db.models import ACTIVE_STATES, JOB_STATES
from kernelmill.service.db.store import Store
from kernelmill.service.jobs import no_worker_for
from kernelmill.service.web import filters, forms, views
from kernelmill.settings import Settings

HERE = Path(__file__).parent
STATIC_DIR = HERE / "static"

templates = Jinja2Templates(directory=str(HERE / "templates"))
filters.register(templates.env)
templates.env.globals.update(version=__version__, statuses=views.STATUSES, job_states=JOB_STATES)

router = APIRouter(include_in_schema=False, default_response_class=HTMLResponse)


class DigitsConvertor(Convertor[str]):
    """A path segment of ASCII digits, kept as text: Starlette's ``int`` convertor calls int() while routing, which
    raises (a 500) on a number of over 4300 digits; the route reads it with ``_id``."""

    regex = "[0-9]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return str(value)


register_url_convertor("digits", DigitsConvertor())


def render(request: Request, name: str, context: dict[str, Any], status_code: int = 200, nav: str = "") -> Response:
    """A page, with the CSRF cookie its forms need (set once per browser)."""
    token = request.cookies.get(forms.CSRF_COOKIE)
    fresh = not token or len(token) < 32
    if fresh:
        token = forms.new_csrf_token()
    context = {
        **context,
        "nav": nav,
        "csrf": token,
        "root": request.scope.get("root_path", ""),
        "needs_token": bool(request.app.state.settings.api_token),
    }
    response = templates.TemplateResponse(request, name, context, status_code=status_code)
    if fresh:
        response.set_cookie(forms.CSRF_COOKIE, token, httponly=True, samesite="strict", path="/")
    return response


def not_found(request: Request, what: str) -> Response:
    return render(request, "404.html", {"what": what}, status_code=404)


def _number(raw: str | None, high: int) -> int | None:
    """``raw`` as a number in 1..high, None where it is not one: ASCII digits only (str.isdigit() is true of
    "²", which int() refuses), counted before int(), which raises past 4300 of them (leading zeros included)."""
    digits = raw.lstrip("0") if raw and raw.isascii() and raw.isdigit() else ""
    if not digits or len(digits) > len(str(high)) or int(digits) > high:
        return None
    return int(digits)


def _page_number(raw: str | None) -> int:
    return _number(raw, 10**6 - 1) or 1


def _id(digits: str) -> int | None:
    """A job's or kernel's id from the URL, None outside 1..MAX_ID."""
    return _number(digits, MAX_ID)


def _shown(digits: str) -> str:
    return digits if len(digits) <= 20 else f"{digits[:20]}... ({len(digits)} digits)"


@router.get("/")
def overview(request: Request, store: Store = Depends(get_store)) -> Response:
    return render(request, "overview.html", views.overview(store, request.app.state.executor), nav="overview")


@router.get("/jobs")
def jobs(
    request: Request,
    store: Store = Depends(get_store),
    state: str | None = None,
    op: str | None = None,
    page: str | None = None,
) -> Response:
    state = state if state in JOB_STATES else None
    context = views.jobs_list(store, state, op or None, _page_number(page))
    return render(request, "jobs.html", context, nav="jobs")


@router.get("/jobs/new")
def new_job(request: Request, settings: Settings = Depends(get_settings_dep)) -> Response:
    form = forms.JobForm.from_pairs(request.query_params)
    return render(request, "job_new.html", {"form": form, **forms.choices(settings)}, nav="new")


@router.post("/jobs/new")
async def submit_job(
    request: Request, store: Store = Depends(get_store), settings: Settings = Depends(get_settings_dep)
) -> Response:
    form = forms.JobForm.from_pairs(forms.parse_body(await request.body()))
    site = request.headers.get("sec-fetch-site")
    done = forms.submit_job(store, settings, form, request.cookies.get(forms.CSRF_COOKIE), site)
    if done.job is not None:
        return RedirectResponse(f"{request.scope.get('root_path', '')}/jobs/{done.job.id}", status_code=303)
    context = {"form": done.form, **forms.choices(settings)}
    return render(request, "job_new.html", context, status_code=done.status_code, nav="new")


def _job_context(request: Request, store: Store, job_id: int | None) -> dict[str, Any] | None:
    if job_id is None:
        return None
    q = request.query_params
    sort = q.get("sort", "seq")
    if sort not in views.TRIAL_SORTS and not sort.startswith("p:"):
        sort = "seq"
    order = "desc" if q.get("order") == "desc" else "asc"
    status = q.get("status") or None
    context = views.job_page(store, job_id, sort, order, status, _page_number(q.get("page")))
    if context is not None and context["job"].state == "queued":  # waiting for a GPU none of the workers has?
        archs = [w.arch for w in request.app.state.executor.workers()]
        context["waiting_why"] = no_worker_for(context["job"], archs)
    return context


@router.get("/jobs/{job_id:digits}")
def job(request: Request, job_id: str, store: Store = Depends(get_store)) -> Response:
    context = _job_context(request, store, _id(job_id))
    if context is None:
        return not_found(request, f"job {_shown(job_id)}")
    return render(request, "job.html", context, nav="jobs")


@router.get("/jobs/{job_id:digits}/live")
def job_live(request: Request, job_id: str, store: Store = Depends(get_store)) -> Response:
    """The live part of the job page, fetched by the page's script when the job moves."""
    context = _job_context(request, store, _id(job_id))
    if context is None:
        return not_found(request, f"job {_shown(job_id)}")
    return render(request, "job_live.html", context)


@router.post("/jobs/{raw_id:digits}/cancel")
async def cancel_job(
    request: Request, raw_id: str, store: Store = Depends(get_store), settings: Settings = Depends(get_settings_dep)
) -> Response:
    job_id = _id(raw_id)
    job = store.get_job(job_id) if job_id is not None else None
    if job is None:
        return not_found(request, f"job {_shown(raw_id)}")
    body, site = forms.parse_body(await request.body()), request.headers.get("sec-fetch-site")
    refused = forms.check_write(settings, body, request.cookies.get(forms.CSRF_COOKIE), site)
    status = 403
    if refused is None and job.state not in ACTIVE_STATES:  # it ended while the page was open: say so
        refused, status = f"the job had already ended ({job.state})", 409
    if refused is not None:
        context = _job_context(request, store, job_id) or {}
        return render(request, "job.html", {**context, "cancel_error": refused}, status_code=status, nav="jobs")
    store.request_cancel(job_id)
    return RedirectResponse(f"{request.scope.get('root_path', '')}/jobs/{job_id}", status_code=303)


@router.get("/kernels/{kernel_id:digits}")
def kernel(request: Request, kernel_id: str, store: Store = Depends(get_store)) -> Response:
    found = _id(kernel_id)
    context = views.kernel_page(store, found) if found is not None else None
    if context is None:
        return not_found(request, f"kernel {_shown(kernel_id)}")
    return render(request, "kernel.html", context, nav="compare")


@router.get("/compare")
def compare(request: Request, store: Store = Depends(get_store), arch: str | None = None) -> Response:
    arch = arch if arch and arch.strip() else None
    with contextlib.suppress(ValueError):  # as the API reads it ("90" is sm_90); no arch at all matches nothing
        arch = normalize_arch(arch) if arch else None
    return render(request, "compare.html", views.compare(store, arch), nav="compare")


def mount_static(app: FastAPI) -> None:
    """Serve service/web/static at /static."""
    app.mount("/static", StaticFiles(directory=str(STATIC_DIR)), name="static")


def install(app: FastAPI) -> None:
    """Add the dashboard to ``app``: the pages, /static, and an HTML 404 for browsers outside /api."""
    app.include_router(router)
    mount_static(app)

    async def html_404(request: Request, exc: StarletteHTTPException) -> Response:
        wants_html = "text/html" in request.headers.get("accept", "")
        if exc.status_code == 404 and wants_html and not request.url.path.startswith(("/api", "/static")):
            return not_found(request, f"page at {request.url.path}")
        return await http_exception_handler(request, exc)

    app.add_exception_handler(StarletteHTTPException, html_404)


__all__ = ["install", "mount_static", "router"]
