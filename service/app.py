"""The FastAPI application: store, executor and job runner wired together at start-up."""

from __future__ import annotations

import logging
import math
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from sqlalchemy.exc import OperationalError

from kernelmill import __version__
from kernelmill.service import web
from kernelmill.service.api import jobs, kernels, profiles, system
from kernelmill.service.db.store import Store
from kernelmill.service.executor import Executor, make_executor
from kernelmill.service.jobs import JobRunner
from kernelmill.settings import Settings, get_settings

log = logging.getLogger(__name__)


def create_app(
    settings: Settings | None = None, store: Store | None = None, executor: Executor | None = None
) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.store = store or Store(settings.database_url)
        app.state.executor = executor or make_executor(settings)
        app.state.runner = JobRunner(app.state.store, app.state.executor, settings)
        app.state.runner.start()
        await kernels.warm_up(app, app.state.store)
        try:
            yield
        finally:
            app.state.runner.stop()
            if executor is None:
                app.state.executor.close()
            if store is None:
                app.state.store.close()

    app = FastAPI(title="kernelmill", version=__version__, lifespan=lifespan)
    app.state.settings = settings

    app.add_middleware(kernels.BestKernelFastPath)  # best-kernel cache hits, before routing
    app.add_middleware(NoNulInUrl)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)  # outside the fast path
    app.add_middleware(HeadAsGet)

    @app.exception_handler(RequestValidationError)
    async def readable_422(request: Request, exc: RequestValidationError):
        problems = []
        for err in exc.errors():
            if err.get("type") == "json_invalid":  # loc is (body, offset): the cause is in ctx
                at, why = err.get("loc", ("", "?"))[-1], (err.get("ctx") or {}).get("error", "")
                problems.append(f"the body is not valid JSON at character {at}" + (f": {why}" if why else ""))
                continue
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        body = {"detail": "; ".join(problems), "errors": exc.errors()}
        return JSONResponse(jsonable(body), status_code=422)

    @app.exception_handler(OperationalError)
    async def database_unavailable(request: Request, exc: OperationalError):
        # The database server gone or restarting, SQLite busy past its timeout: the request may succeed again,
        # so 503 (clients and monitors retry 5xx), saying why, and never the bare 500 of a bug.
        said = str(exc.orig or exc).strip()
        why = said.splitlines()[0] if said else type(exc).__name__
        log.warning("%s %s: the database is unavailable: %s", request.method, request.url.path, why)
        detail = f"the database is unavailable: {why}"
        if not request.url.path.startswith("/api/"):
            return PlainTextResponse(detail, status_code=503, headers={"Retry-After": "5"})
        return JSONResponse(jsonable({"detail": detail}), status_code=503, headers={"Retry-After": "5"})

    app.include_router(jobs.router)
    app.include_router(kernels.router)
    app.include_router(profiles.router)
    app.include_router(system.router)
    web.install(app)  # dashboard pages at /, static files, an HTML 404 for browsers
    return app


class NoNulInUrl:
    """422 for a NUL character in the path or the query: no name or filter holds one, and PostgreSQL refuses it
    in text (a 500 from the driver otherwise)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and ("\x00" in scope["path"] or b"%00" in scope["query_string"]):
            body = {"detail": "a NUL character (%00) in the URL: no name or filter holds one"}
            return await JSONResponse(body, status_code=422)(scope, receive, send)
        return await self.app(scope, receive, send)


class HeadAsGet:
    """HEAD answered as GET without its body (health monitors, ``curl -I``): FastAPI's routes take GET alone,
    so a HEAD was 405 everywhere."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def headers_only(message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        return await self.app({**scope, "method": "GET"}, receive, headers_only)


class BodyLimit:
    """413 for a request body over ``limit`` bytes: by its Content-Length before reading it, and counted as it
    streams in when there is none (chunked), so that no route ever reads more than ``limit`` bytes."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit():  # the server holds the body to its declared length
            if int(length) > self.limit:
                return await self._too_large(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._too_large(scope, receive, send)
            more = message.get("more_body", False)
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send) -> None:
        body = {"detail": f"request body over {self.limit} bytes"}
        await JSONResponse(body, status_code=413, headers={"connection": "close"})(scope, receive, send)


def jsonable(body):
    """``body`` as JSON can hold it: what a rejected body held is echoed, and JSON has no NaN or infinity
    and UTF-8 no lone UTF-16 surrogate (``"\\ud800"`` decodes to one), so those are echoed as text."""
    from fastapi.encoders import jsonable_encoder

    def encodable(value):
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, str):
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
        if isinstance(value, dict):
            return {encodable(k): encodable(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [encodable(v) for v in value]
        return value

    return encodable(jsonable_encoder(body, custom_encoder={Exception: str}))
