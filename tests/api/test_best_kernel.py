"""GET /api/kernels/best: any op attribute (attr=NAME:VALUE), refused queries, and its cache (hits answered
before routing exactly as the route answers; dropped when this process or another one publishes)."""

from __future__ import annotations

import time

import pytest

from kernelmill.service.api import kernels
from kernelmill.service.db.store import Store
from tests.api.conftest import wait_state
from tests.store.test_store import new_job, publish, row
from tests.store.test_store import served as stored_kernel

BEST = "/api/kernels/best"


def tune(client, op, shape, attrs=None, trials=6):
    body = {"op": op, "shapes": [shape], "dtype": "float16", "strategy": "random", "attrs": attrs or {}}
    job = client.post("/api/jobs", json={**body, "budget": {"trials": trials, "seconds": 60}})
    assert job.status_code == 201, job.text
    assert wait_state(client, job.json()["id"])["state"] == "done"


def best(client, query: str):
    return client.get(f"{BEST}?{query}")


def test_any_op_attribute_as_attr_name_value(client):
    tune(client, "layernorm", [256, 1024], {"eps": "1e-5"})  # job attributes are strings, as in the CLI
    found = best(client, "op=layernorm&shape=256x1024&dtype=float16&attr=eps:1e-05")
    assert found.status_code == 200, found.text
    assert found.json()["attrs"] == {"eps": 1e-5} and found.json()["exact"] is True
    same = best(client, "op=layernorm&shape=256x1024&dtype=float16&attr=eps:1e-5")  # as the value is written
    assert same.json()["id"] == found.json()["id"]
    near = best(client, "op=layernorm&shape=200x1000&dtype=float16&attr=eps:1e-05").json()
    assert near["id"] == found.json()["id"] and near["exact"] is False and near["requested_shape"] == [200, 1000]
    # Without the attribute, the op's default (eps 1e-12) is asked for: not tuned.
    missing = best(client, "op=layernorm&shape=256x1024&dtype=float16")
    assert missing.status_code == 404 and "submit a job" in missing.json()["detail"]


@pytest.mark.parametrize(
    ("query", "reason"),
    [
        ("op=layernorm&shape=8x8&attr=eps:0.1", "eps='0.1' is not allowed"),
        ("op=layernorm&shape=8x8&attr=momentum:0.9", "no attribute 'momentum'"),
        ("op=softmax&shape=8x8&attr=act:relu", "no attribute 'act'"),
        ("op=softmax&shape=8x8&act=relu", "no attribute 'act'"),
        ("op=layernorm&shape=8x8&attr=eps", "expected NAME:VALUE"),
        ("op=layernorm&shape=8x8&attr=:1e-05", "expected NAME:VALUE"),
        ("op=layernorm&shape=8x8&attr=eps:1e-05&attr=eps:1e-06", "eps given twice"),
        ("op=linear&shape=8x8x8&act=relu&attr=act:relu", "act given twice"),
        ("op=layernorm&shape=8x8&eps=1e-05", "unknown query parameter 'eps'"),
        ("op=layernorm&shape=8x8x8", "layernorm"),
    ],
)
def test_bad_attributes_are_422_with_a_reason(client, query, reason):
    resp = best(client, query)
    assert resp.status_code == 422 and reason in resp.json()["detail"], resp.text


def test_act_shorthand_and_attr_are_the_same_question(client):
    tune(client, "linear", [64, 96, 32], {"act": "relu"})
    short = best(client, "op=linear&shape=64x96x32&dtype=float16&act=relu")
    long = best(client, "op=linear&shape=64x96x32&dtype=float16&attr=act:relu")
    assert short.status_code == long.status_code == 200 and short.content == long.content
    assert short.json()["attrs"] == {"act": "relu"}
    assert best(client, "op=linear&shape=64x96x32&dtype=float16").status_code == 404  # act=none: not tuned


def test_a_cache_hit_answers_exactly_as_the_route(client):
    tune(client, "softmax", [1024, 1024])
    store = client.app.state.store
    cache = kernels.best_cache(store)
    for query in ("op=softmax&shape=1024x1024&dtype=float16", "op=softmax&shape=1000x900&dtype=float16"):
        first = best(client, query)  # the route, which fills the cache
        assert query.encode() in cache.answers
        second = best(client, query)  # the fast path, before routing
        assert first.status_code == second.status_code == 200
        assert first.content == second.content and first.headers == second.headers


def test_the_cache_follows_what_this_process_publishes(client):
    tune(client, "softmax", [1024, 1024])
    query = "op=softmax&shape=4000x4000&dtype=float16"
    assert best(client, query).json()["shape"] == [1024, 1024]
    assert best(client, "op=softmax&shape=4096x4096&dtype=float16").json()["exact"] is False
    tune(client, "softmax", [4096, 4096])  # published by this app's job runner
    assert best(client, query).json()["shape"] == [4096, 4096]
    assert best(client, "op=softmax&shape=4096x4096&dtype=float16").json()["exact"] is True


def test_the_cache_sees_what_other_processes_publish(client, monkeypatch):
    monkeypatch.setattr(kernels.BestCache, "ttl_s", 0.2)
    other = Store(client.app.state.store.url)  # another replica on the same database
    try:
        job = new_job(other, shapes=[(1024, 1024), (4096, 4096)], state="done")  # not for the runner
        publish(other, job, (1024, 1024), 2.0)
        query = "op=softmax&shape=4000x4000&dtype=float16"
        time.sleep(0.25)
        first = best(client, query).json()
        assert first["shape"] == [1024, 1024] and first["median_ms"] == 2.0
        publish(other, job, (1024, 1024), 1.5)  # a faster kernel for the same problem: the row is replaced
        time.sleep(0.25)
        assert best(client, query).json()["median_ms"] == 1.5
        publish(other, job, (4096, 4096), 3.0)  # a new tuned shape, nearer
        time.sleep(0.25)
        assert best(client, query).json()["shape"] == [4096, 4096]
    finally:
        other.close()


def test_a_tf32_kernel_is_served_only_to_who_asks_for_tf32(client):
    store = client.app.state.store
    shape = (256, 256, 256)
    for family, ms in (("simt", 1.0), ("tensorcore", 0.2)):
        job = new_job(store, op="matmul", shapes=[shape], dtype="float32", state="done")
        publish(store, job, shape, ms, family=family)
    query = "op=matmul&shape=256x256x256&dtype=float32"
    ieee = best(client, query).json()
    assert (ieee["family"], ieee["precision"]) == ("simt", "float32")
    assert best(client, query + "&precision=float32").json()["id"] == ieee["id"]
    tf32 = best(client, query + "&precision=tf32").json()
    assert (tf32["family"], tf32["precision"]) == ("tensorcore", "tf32")
    wrong = best(client, query + "&precision=float16")
    assert wrong.status_code == 422 and "matmul computes float32 in float32, tf32, not in 'float16'" in wrong.text
    none = best(client, "op=matmul&shape=64x64x64&dtype=float16&precision=float16")
    assert none.status_code == 404
    listed = client.get("/api/kernels", params={"op": "matmul", "precision": "tf32"}).json()
    assert [k["family"] for k in listed["items"]] == ["tensorcore"]


def test_the_askers_gpu_model_gets_the_kernel_tuned_on_it(client):
    store = client.app.state.store
    for device, ms in (("NVIDIA H200", 1.0), ("NVIDIA H100 80GB HBM3", 1.6)):
        job = new_job(store, state="done", device_name=device)  # done: not for the app's job runner
        publish(store, job, (1024, 1024), ms)
    query = "op=softmax&shape=1000x1000&dtype=float16"
    assert best(client, query + "&device=NVIDIA%20H200").json()["device_name"] == "NVIDIA H200"
    h100 = best(client, query + "&device=NVIDIA%20H100%2080GB%20HBM3").json()
    assert h100["device_name"] == "NVIDIA H100 80GB HBM3" and h100["exact"] is False
    # No model named, or one with no kernel of its own: the higher speedup over its own GPU's PyTorch.
    others = [best(client, query).json(), best(client, query + "&device=NVIDIA%20A100").json()]
    assert {k["speedup"] for k in others} == {max(k["speedup"] for k in (h100, *others))}


def test_start_up_warms_the_lookup_of_a_served_kernel(tmp_path):
    from tests.api.conftest import make_client

    url = f"sqlite:///{tmp_path}/warm.db"
    seeded = Store(url)
    try:
        publish(seeded, new_job(seeded, state="done"), (1024, 1024), 1.0)
    finally:
        seeded.close()
    with make_client(tmp_path, url) as client:
        cache = kernels.best_cache(client.app.state.store)
        assert len(cache.answers) == 1 and len(cache.kernels) == 1
        (query,) = cache.answers
        assert best(client, query.decode()).json()["shape"] == [1024, 1024]


def test_a_failed_warm_up_does_not_stop_the_service(tmp_path, monkeypatch):
    from tests.api.conftest import make_client

    def unavailable(*args):
        raise RuntimeError("database away")

    monkeypatch.setattr(Store, "list_kernels", unavailable)
    with make_client(tmp_path) as client:
        assert client.get("/api/health").status_code == 200
        assert best(client, "op=softmax&shape=64x64&dtype=float16").status_code == 404


def test_a_miss_names_what_was_asked_and_the_first_part_nothing_served_matches(client):
    miss = best(client, "op=layernorm&shape=256x1024&dtype=float16&attr=eps:1e-05")
    assert miss.status_code == 404
    assert miss.json()["detail"] == (
        "no tuned kernel for layernorm 256x1024 float16 with eps=1e-05, at this or any other shape: "
        "no layernorm kernel is served yet; submit a job to tune one"
    )
    tune(client, "layernorm", [256, 1024], {"eps": "1e-05"})  # the fake workers' GPU is an sm_90
    detail = {
        query: best(client, f"op=layernorm&shape=256x1024&{query}").json()["detail"]
        for query in ("dtype=float16", "dtype=float32&attr=eps:1e-05", "dtype=float16&attr=eps:1e-05&arch=sm_80")
    }
    # An attribute left to the op's default says so, and what the served kernels have instead.
    assert detail["dtype=float16"].startswith("no tuned kernel for layernorm 256x1024 float16 with eps=1e-12 (the ")
    assert detail["dtype=float16"].endswith(
        ": layernorm float16 kernels are served with eps=1e-05 only; submit a job to tune one"
    )
    assert ": layernorm kernels are served in float16 only;" in detail["dtype=float32&attr=eps:1e-05"]
    sm_80 = detail["dtype=float16&attr=eps:1e-05&arch=sm_80"]
    assert (
        "float16 for sm_80 with eps=1e-05," in sm_80
        and ": layernorm float16 kernels are served for sm_90 only;" in sm_80
    )
    # The runtime's client reads any 404 as "no served kernel": the answer for what is served is unchanged.
    assert best(client, "op=layernorm&shape=256x1024&dtype=float16&attr=eps:1e-05").status_code == 200


def test_a_miss_on_precision_names_the_precisions_served(client):
    store = client.app.state.store
    job = new_job(store, op="matmul", shapes=[(256, 256, 256)], dtype="float32", state="done")
    publish(store, job, (256, 256, 256), 0.2, family="tensorcore")  # TF32: served as precision tf32
    miss = best(client, "op=matmul&shape=256x256x256&dtype=float32")
    assert miss.status_code == 404
    assert ": matmul float32 kernels are served computed in tf32 only;" in miss.json()["detail"]
    tf32 = best(client, "op=matmul&shape=64x64x64&dtype=float32&precision=tf32&arch=sm_80").json()["detail"]
    assert tf32.startswith("no tuned kernel for matmul 64x64x64 float32 computed in tf32 for sm_80, at this or any")


def test_a_dim_of_thousands_of_digits_is_422_naming_the_dim(client):
    """int() raises past 4300 digits: the shape's parsing answered 500."""
    resp = best(client, f"op=softmax&shape={'1' * 5000}x4")
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"] == (
        "softmax shape dim rows must be at most 2130706432 (kernels index in 32 bits), got a number of 5000 digits"
    )


def test_the_kernel_list_refuses_a_dtype_or_precision_that_matches_nothing(client):
    """They answered 200 with an empty page, where /best answers 422 for the same values."""
    for query, word in (("dtype=float64", "dtype"), ("precision=bogus", "precision")):
        resp = client.get(f"/api/kernels?{query}")
        assert resp.status_code == 422 and word in resp.json()["detail"], query
    # A precision no kernel of the dtype computes in (only float32 runs as TF32) can match nothing either.
    for query in (
        "dtype=float16&precision=tf32",
        "dtype=bfloat16&precision=float32",
        "dtype=float32&precision=float16",
    ):
        resp = client.get(f"/api/kernels?{query}")
        assert resp.status_code == 422 and "is computed in" in resp.json()["detail"], query
    for query in (
        "dtype=bfloat16",
        "precision=tf32",
        "dtype=float32&precision=float32",
        "dtype=float32&precision=tf32",
    ):
        assert client.get(f"/api/kernels?{query}").status_code == 200, query


def test_an_arch_is_read_as_kernels_are_served_under_it_and_garbage_is_422(client):
    """arch=bogus answered 404 "no kernel for bogus", as if it were a GPU nothing was tuned for yet."""
    for url in (f"{BEST}?op=softmax&shape=64x64&arch=bogus", "/api/kernels?arch=hopper"):
        resp = client.get(url)
        assert resp.status_code == 422 and "arch: malformed arch" in resp.json()["detail"], url
    tune(client, "softmax", [256, 256])  # the fake workers' GPU is an sm_90
    served = best(client, "op=softmax&shape=256x256&dtype=float16&arch=sm_90").json()
    for arch in ("90", "SM_90", "9.0"):
        assert best(client, f"op=softmax&shape=256x256&dtype=float16&arch={arch}").json()["id"] == served["id"]
        assert [k["id"] for k in client.get(f"/api/kernels?arch={arch}").json()["items"]] == [served["id"]]
    assert best(client, "op=softmax&shape=256x256&dtype=float16&arch=sm_90a").status_code == 404  # wgmma's
    # Empty is no filter, as the dashboard's "any arch" sends it: it was read as sm_90, the default target, and
    # hid the kernels of every other GPU.
    store = client.app.state.store
    ampere = row("rowwise", ms=0.5)
    ampere["arch"] = "sm_80"
    job = new_job(store, shapes=[(512, 512)], state="done")
    store.publish(job, store.record_trials(job.id, "512x512", [ampere])[0], stored_kernel())
    on_ampere = best(client, "op=softmax&shape=512x512&dtype=float16&arch=")
    assert on_ampere.status_code == 200 and on_ampere.json()["arch"] == "sm_80"
    assert client.get("/api/kernels?arch=").json()["total"] == client.get("/api/kernels").json()["total"] == 2
    empty_act = best(client, "op=linear&shape=64x64x64&act=")  # read as "not given": act=none's 404
    assert empty_act.status_code == 422 and "act='' is not allowed" in empty_act.json()["detail"]


@pytest.mark.parametrize("arch", ["9" * 400, "sm_" + "9" * 400, "sm_99999", "sm_99999a"])
def test_an_arch_of_more_digits_than_any_gpu_is_422(client, arch):
    """They answered an empty 200 (and /best a 404 that echoed all 400 digits), as if nothing were tuned for a
    GPU that cannot exist; an arch newer than this version knows (sm_130) is still asked for."""
    for url in (f"/api/kernels?arch={arch}", f"{BEST}?op=softmax&shape=64x64&arch={arch}"):
        resp = client.get(url)
        detail = resp.json()["detail"]
        assert resp.status_code == 422 and detail.startswith("arch: ") and "at most 4 digits" in detail, url
        assert len(detail) < 200, url
    assert client.get("/api/kernels?arch=sm_130").status_code == 200
    assert best(client, "op=softmax&shape=64x64&arch=sm_130").status_code == 404


def test_a_served_kernel_says_what_code_its_cubin_was_built_from(client):
    """The runtime took the served source for what the cubin was built from; the digest is now served with it
    (null where it was never recorded: the fake evaluator's trials, kernels published before migration 0010)."""
    from kernelmill.kernels.render import code_digest

    store = client.app.state.store
    job = new_job(store, shapes=[(512, 512)], state="done")
    trial = store.record_trials(job.id, "512x512", [row("rowwise", ms=0.5)])[0]
    fields = stored_kernel("// kernelmill variant: x\nthe code")
    kernel = store.publish(job, trial, {**fields, "code_sha256": code_digest(fields["source"])})
    for url in (f"/api/kernels/{kernel.id}", f"{BEST}?op=softmax&shape=512x512"):
        assert client.get(url).json()["code_sha256"] == code_digest(fields["source"]), url
    tune(client, "softmax", [256, 256])
    assert best(client, "op=softmax&shape=256x256").json()["code_sha256"] is None


def test_a_cubin_names_the_code_it_was_built_from(client):
    """A kernel re-published under its id between a client's /best and its cubin read would pair one kernel's
    cubin with the other's source: the cubin's answer names its code's digest, recorded or (never recorded)
    taken from its source, for the runtime to compare with the answer it read."""
    from kernelmill.kernels.render import CODE_HEADER, code_digest

    store = client.app.state.store
    job = new_job(store, shapes=[(512, 512)], state="done")
    trial = store.record_trials(job.id, "512x512", [row("rowwise", ms=0.5)])[0]
    fields = stored_kernel("// kernelmill variant: x\nthe code")
    recorded = store.publish(job, trial, {**fields, "code_sha256": "ab" * 32})
    assert client.get(f"/api/kernels/{recorded.id}/cubin").headers[CODE_HEADER] == "ab" * 32
    tune(client, "softmax", [256, 256])
    unrecorded = best(client, "op=softmax&shape=256x256").json()
    cubin = client.get(f"/api/kernels/{unrecorded['id']}/cubin")
    assert cubin.headers[CODE_HEADER] == code_digest(unrecorded["source"])


def test_the_cached_answers_are_bounded_in_bytes():
    """Each variation of a query string (another device=, shape or parameter order) is an answer of its own,
    holding a kernel's source: 4096 of them could hold about 400 MB for anyone who may read."""
    from types import SimpleNamespace

    cache, store = kernels.BestCache(), SimpleNamespace(served_version=0)
    cache.max_answer_bytes = 100
    for i in range(3):
        cache.put(store, cache.generation, cache.answers, f"q{i}".encode(), b"x" * 40)
    assert list(cache.answers) == [b"q1", b"q2"] and cache.answer_bytes == 80  # the least recent went
    cache.put(store, cache.generation, cache.answers, b"q2", b"y" * 50)  # replaced: counted once
    assert list(cache.answers) == [b"q1", b"q2"] and cache.answer_bytes == 90
    cache.put(store, cache.generation, cache.answers, b"big", b"z" * 500)  # alone over the bound: the newest stays
    assert list(cache.answers) == [b"big"] and cache.answer_bytes == 500
    read_in = cache.generation
    store.served_version += 1  # a publish drops everything, and what was read before it is not kept
    cache.put(store, read_in, cache.answers, b"q3", b"x" * 10)
    assert list(cache.answers) == [] and cache.answer_bytes == 0
