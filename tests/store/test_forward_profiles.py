"""forward_profiles (migration 0003): up and down, the table matching its model, and the store's methods."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from kernelmill.runtime.profile import REPORTS, ForwardProfile, parse_stats_csv, summarize
from kernelmill.service.db.models import Base
from kernelmill.service.db.store import Store, downgrade, migrate
from tests.runtime.fake_nsys import REPORTS as FIXTURES
from tests.store.test_store import alembic_version, head_revision, new_job


def summary(model: str = "mlp-tiny", **fields) -> dict:
    """A real summary: the canned nsys tables of tests/runtime/nsys_reports, reduced."""
    tables = {t: parse_stats_csv((FIXTURES / "new" / f"{c[0]}.csv").read_text()) for t, c in REPORTS.items()}
    values = dict(model=model, dtype="float16", batch=8, seq=None, iters=2, graphs=False)
    values.update(device_name="NVIDIA H100 80GB HBM3", nsys_version="2025.3.1.90", **summarize(tables))
    values.update(fields)
    return ForwardProfile(**values).to_dict()


def tables(store: Store) -> set[str]:
    return set(inspect(store.engine).get_table_names())


def test_migration_0003_up_and_down(store):
    assert "forward_profiles" in tables(store) and alembic_version(store) == [head_revision()]
    job = new_job(store)
    store.record_forward_profile(summary())
    downgrade(store.engine, "0002")
    assert "forward_profiles" not in tables(store) and alembic_version(store) == ["0002"]
    with store.engine.connect() as conn:  # the rest is untouched (read as 0002 has it: no later columns)
        assert conn.execute(text("SELECT op FROM jobs WHERE id = :id"), {"id": job.id}).scalar() == "softmax"
    migrate(store.engine)
    assert alembic_version(store) == [head_revision()]
    assert store.list_forward_profiles() == ([], 0)  # recreated empty
    assert store.record_forward_profile(summary()).id >= 1


def test_the_table_matches_its_model(store):
    with store.engine.connect() as conn:
        diffs = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert [d for d in diffs if "forward_profiles" in repr(d)] == []


def test_record_list_and_read_back(store):
    first = store.record_forward_profile(summary("mlp-tiny"))
    second = store.record_forward_profile(summary("bert-tiny", seq=128, batch=2))
    assert first.kernel_time_ms == pytest.approx(0.076) and first.kernel_launches == 4
    assert first.kernel_ms_per_forward == pytest.approx(0.038)
    assert first.gap_total_ms == pytest.approx(0.07) and first.gap_median_us == 2.5 and first.gap_max_us == 55.0
    assert first.memcpy_time_ms == pytest.approx(0.003) and first.memcpy_bytes == 8000
    rows, total = store.list_forward_profiles()
    assert total == 2 and [r.id for r in rows] == [second.id, first.id]  # newest first
    rows, total = store.list_forward_profiles(model="bert-tiny")
    assert total == 1 and rows[0].seq == 128 and rows[0].batch == 2
    rows, total = store.list_forward_profiles(limit=1, offset=1)
    assert total == 2 and [r.id for r in rows] == [first.id]
    back = store.forward_profile(first.id)
    assert back.summary["top_kernels"][0]["name"] == "linear_tensorcore"
    assert back.summary["gaps"]["count"] == 5 and back.device_name == "NVIDIA H100 80GB HBM3"
    assert store.forward_profile(10**9) is None


def test_a_summary_without_gaps_or_copies_stores_zeros(store):
    row = store.record_forward_profile(
        summary(gaps={"count": 0, "total_ns": 0.0, "median_ns": None, "p90_ns": None, "max_ns": None})
    )
    assert row.gap_total_ms == 0.0 and row.gap_median_us is None and row.gap_max_us is None
