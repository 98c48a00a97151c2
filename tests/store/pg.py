"""PostgreSQL for tests: a fresh, uniquely named database per test, created and dropped through the server.

``KERNELMILL_TEST_POSTGRES_URL`` names a database the test role can log in to; the role needs CREATEDB
(``.ci/postgres.sh`` sets one up). Where it lacks it, the tests share that database and every table is
dropped after each test instead. ``KERNELMILL_REQUIRE_POSTGRES=1`` turns "not configured" into a failure.

Importable from any conftest (the API suite can use ``fresh_database`` for its own URL).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

URL_VAR = "KERNELMILL_TEST_POSTGRES_URL"
REQUIRE_VAR = "KERNELMILL_REQUIRE_POSTGRES"


def postgres_url() -> str | None:
    return os.environ.get(URL_VAR) or None


def require_postgres() -> bool:
    return os.environ.get(REQUIRE_VAR) == "1"


def skip_or_fail_without_postgres() -> None:
    """Call when a test needs PostgreSQL: skips with the reason, or fails where it is required."""
    if postgres_url():
        return
    message = f"PostgreSQL not configured: set {URL_VAR} (bash .ci/postgres.sh prints one)"
    if require_postgres():
        pytest.fail(f"{REQUIRE_VAR}=1 but {message}", pytrace=False)
    pytest.skip(message)


@contextmanager
def fresh_database(base_url: str) -> Iterator[str]:
    """Yield the URL of a new empty database on ``base_url``'s server; drop it afterwards."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ProgrammingError

    base = make_url(base_url)
    name = f"kernelmill_t_{uuid.uuid4().hex[:16]}"
    admin = create_engine(base.set(database="postgres"), isolation_level="AUTOCOMMIT", poolclass=_null_pool())
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except ProgrammingError:  # no CREATEDB: share the configured database, emptied after the test
        admin.dispose()
        with _emptied_afterwards(base_url):
            yield base_url
        return
    try:
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        _drop_database(admin, name)
        admin.dispose()


#: SQLSTATE insufficient_privilege.
_INSUFFICIENT_PRIVILEGE = "42501"


def _drop_database(admin, name: str, attempts: int = 10) -> None:
    """DROP DATABASE ... WITH (FORCE) ends the test's own connections, but a test role cannot end a server
    process such as an autovacuum worker that started on the new database (insufficient_privilege, seen in
    CI); that worker finishes on its own, so the drop is tried again a few times before it fails."""
    from sqlalchemy import text
    from sqlalchemy.exc import ProgrammingError

    for attempt in range(attempts):
        try:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            return
        except ProgrammingError as exc:
            if attempt == attempts - 1 or getattr(exc.orig, "sqlstate", None) != _INSUFFICIENT_PRIVILEGE:
                raise
            time.sleep(0.1 * (attempt + 1))


@contextmanager
def _emptied_afterwards(url: str) -> Iterator[None]:
    from sqlalchemy import MetaData, create_engine, text

    try:
        yield
    finally:
        engine = create_engine(url, poolclass=_null_pool())
        with engine.begin() as conn:
            meta = MetaData()
            meta.reflect(conn)
            meta.drop_all(conn)
            conn.execute(text("DROP TABLE IF EXISTS alembic_version"))
        engine.dispose()


def _null_pool():
    from sqlalchemy.pool import NullPool

    return NullPool
