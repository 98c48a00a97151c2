"""The service with its dashboard, for the browser tests: ``python -m tests.browser.serve PORT``.

Configuration comes from the environment (KERNELMILL_DATABASE_URL,
KERNELMILL_EXECUTOR=fake, KERNELMILL_FAKE_WORKERS, KERNELMILL_FAKE_DELAY_S).
"""

from __future__ import annotations

import sys

import uvicorn

from kernelmill.service import web
from kernelmill.service.app import create_app


def build_app():
    app = create_app()
    if not any(getattr(route, "path", None) == "/jobs/new" for route in app.routes):
        web.install(app)  # until create_app installs the dashboard itself
    return app


if __name__ == "__main__":
    uvicorn.run(build_app(), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
