"""/api/profiles/forward: what `kernelmill profile-forward` stored, listed and read back."""

from __future__ import annotations

import pytest

from kernelmill.service.db.store import Store
from tests.api.conftest import make_client
from tests.store.test_forward_profiles import summary


@pytest.fixture
def seeded(tmp_path, api_db):
    store = Store(api_db)
    ids = [store.record_forward_profile(summary(m)).id for m in ("mlp-tiny", "bert-tiny", "mlp-tiny")]
    store.close()
    with make_client(tmp_path, api_db) as client:
        yield client, ids


def test_list_newest_first_filtered_and_paged(seeded):
    client, ids = seeded
    page = client.get("/api/profiles/forward").json()
    assert page["total"] == 3 and [p["id"] for p in page["items"]] == ids[::-1]
    first = page["items"][-1]
    assert first["model"] == "mlp-tiny" and first["kernel_launches"] == 4 and first["memcpy_bytes"] == 8000
    assert first["gap_max_us"] == 55.0 and first["created_at"].endswith("Z")
    assert "summary" not in first
    page = client.get("/api/profiles/forward", params={"model": "mlp-tiny", "limit": 1, "offset": 1}).json()
    assert page["total"] == 2 and [p["id"] for p in page["items"]] == [ids[0]]


def test_one_profile_with_its_whole_summary(seeded):
    client, ids = seeded
    body = client.get(f"/api/profiles/forward/{ids[1]}").json()
    assert body["model"] == "bert-tiny" and body["nsys_version"] == "2025.3.1.90"
    s = body["summary"]
    assert s["top_kernels"][0]["name"] == "linear_tensorcore" and s["gaps"]["count"] == 5
    assert {r["name"] for r in s["ranges"]} >= {"forward", "linear 8x384x128 float16 act=none"}


def test_unknown_and_malformed_ids(client):
    resp = client.get("/api/profiles/forward/99")
    assert resp.status_code == 404 and "no forward profile with id 99" in resp.json()["detail"]
    assert client.get("/api/profiles/forward/0").status_code == 422
    assert client.get("/api/profiles/forward", params={"limit": 0}).status_code == 422
    assert client.get("/api/profiles/forward").json() == {"items": [], "total": 0, "limit": 50, "offset": 0}
