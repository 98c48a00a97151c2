"""The FastAPI application: store, executor and job runner wired together at start-up."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from kernelmill import __version__
from kernelmill.service.api import jobs, kernels, system
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

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > settings.max_body_bytes:
            return JSONResponse({"detail": f"request body over {settings.max_body_bytes} bytes"}, status_code=413)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def readable_422(request: Request, exc: RequestValidationError):
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return JSONResponse({"detail": "; ".join(problems), "errors": jsonable(exc.errors())}, status_code=422)

    app.include_router(jobs.router)
    app.include_router(kernels.router)
    app.include_router(system.router)
    return app


def jsonable(errors):
    from fastapi.encoders import jsonable_encoder

    return jsonable_encoder(errors, custom_encoder={Exception: str})
