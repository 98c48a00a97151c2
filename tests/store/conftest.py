"""``db_url``: every store test runs on SQLite, and on PostgreSQL where KERNELMILL_TEST_POSTGRES_URL is set.

Without it the PostgreSQL half skips with the reason, unless KERNELMILL_REQUIRE_POSTGRES=1 (CI), where it fails.
"""

from __future__ import annotations

import pytest

from tests.store.pg import fresh_database, postgres_url, skip_or_fail_without_postgres


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/store.db"
        return
    skip_or_fail_without_postgres()
    with fresh_database(postgres_url()) as url:
        yield url


@pytest.fixture
def store(db_url):
    from kernelmill.service.db.store import Store

    s = Store(db_url)
    yield s
    s.close()
