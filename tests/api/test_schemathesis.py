"""Property-based tests of the whole REST API from its own OpenAPI schema (schemathesis, in process).

Every operation gets generated requests, valid and not; each response must be no server error, match
its documented schema, and carry a documented status code. Bounded: a few dozen examples per operation,
no Hypothesis deadline, so the file runs in well under a minute on two cores.

The app runs with the fake executor on a temporary SQLite database that holds a served kernel, a
finished job and a forward profile, so the id-taking routes answer 200 as well as 404.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kernelmill.service.app import create_app  # noqa: E402
from kernelmill.settings import Settings  # noqa: E402

CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]
MAX_EXAMPLES = int(os.environ.get("KERNELMILL_SCHEMATHESIS_EXAMPLES", "40"))


# The schema is read from the app object itself (no server, no lifespan at collection time); the
# requests go to the same app in process, whose lifespan schemathesis starts on the first call.
_DB_DIR = Path(tempfile.mkdtemp(prefix="kernelmill-schemathesis-"))
atexit.register(shutil.rmtree, _DB_DIR, True)
SETTINGS = Settings(database_url=f"sqlite:///{_DB_DIR}/api.db", executor="fake", fake_workers=1)
APP = create_app(SETTINGS)
schema = schemathesis.openapi.from_dict(json.loads(json.dumps(APP.openapi())))
schema.app = APP  # what schemathesis.openapi.from_asgi("/openapi.json", APP) sets, without starting the app
schema.location = "/openapi.json"


@pytest.fixture(scope="module", autouse=True)
def seeded():
    """A finished job (trials, a served kernel) and a forward profile in the database before the app under
    test starts."""
    from fastapi.testclient import TestClient

    from kernelmill.service.db.store import Store
    from tests.api.conftest import SOFTMAX_JOB
    from tests.store.test_forward_profiles import summary

    store = Store(SETTINGS.database_url)
    store.record_forward_profile(summary())
    store.close()

    with TestClient(create_app(SETTINGS)) as client:
        job = client.post("/api/jobs", json={**SOFTMAX_JOB, "budget": {"trials": 8, "seconds": 60}}).json()
        deadline = time.monotonic() + 30
        while client.get(f"/api/jobs/{job['id']}").json()["state"] not in ("done", "failed"):
            assert time.monotonic() < deadline, "seed job did not finish"
            time.sleep(0.05)
    yield
    from schemathesis.python.asgi import shutdown_lifespans

    shutdown_lifespans()


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture],
)
def test_every_operation_conforms(case):
    case.call_and_validate(checks=CHECKS)
