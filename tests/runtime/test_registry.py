"""KernelRegistry without a GPU: the service (real app, fake GPU executor), nearest shapes, the local
cache, offline behaviour, compiled defaults; tune_model submitting jobs."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from kernelmill import runtime
from kernelmill.kernels.compile import CompileError
from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.matmul import TensorCoreCore
from kernelmill.kernels.render import render
from kernelmill.runtime import registry as registry_module
from kernelmill.runtime.registry import CUBIN_READS, DEFAULT, NEAREST, TUNED, KernelRegistry, default_params, excerpt
from kernelmill.service.app import create_app
from kernelmill.settings import Settings


def _wait_done(client, job_id, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/api/jobs/{job_id}").json()
        if job["state"] in ("done", "failed", "cancelled"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} not done")


@pytest.fixture
def service(tmp_path):
    settings = Settings(database_url=f"sqlite:///{tmp_path}/svc.db", executor="fake", fake_workers=1)
    with TestClient(create_app(settings)) as client:
        yield client


def _tune(client, op, shape, dtype, attrs=None, trials=6):
    body = {"op": op, "shapes": [shape], "dtype": dtype, "strategy": "random", "attrs": attrs or {}}
    body["budget"] = {"trials": trials, "seconds": 60}
    job = client.post("/api/jobs", json=body)
    assert job.status_code == 201, job.text
    assert _wait_done(client, job.json()["id"])["state"] == "done"


def test_tuned_then_nearest_from_the_service_and_the_local_cache(service, tmp_path, caplog):
    _tune(service, "linear", [64, 96, 32], "float16", {"act": "gelu_erf"})
    reg = KernelRegistry(client=service, arch="sm_90", cache_dir=tmp_path / "cache")
    with caplog.at_level(logging.INFO, logger="kernelmill.runtime.registry"):
        exact = reg.get("linear", (64, 96, 32), "float16", {"act": "gelu_erf"})
    assert exact.source == TUNED and exact.cubin == b"fake-cubin" and exact.kernel_id
    assert [launch.entry for launch in exact.launches][0].startswith("linear_")
    assert "tuned kernel #" in caplog.text
    near = reg.get("linear", (60, 96, 40), "float16", {"act": "gelu_erf"})
    assert near.source == NEAREST and near.served_shape == (64, 96, 32)
    # The launches are rebuilt for the actual shape (M, N, K are the last int arguments).
    assert near.launches[0].args[-3:] == (60, 96, 40)
    rows = {r["shape"]: r for r in reg.report()}
    assert rows["60x96x40"]["source"] == "nearest" and rows["60x96x40"]["served_shape"] == "64x96x32"

    # A second registry, offline, finds both in the local cache.
    offline = KernelRegistry(arch="sm_90", cache_dir=tmp_path / "cache", use_service=False)
    again = offline.get("linear", (64, 96, 32), "float16", {"act": "gelu_erf"})
    assert again.source == TUNED and again.cubin == b"fake-cubin" and again.note == "from the local cache"


def test_other_attrs_are_not_served(service, tmp_path):
    _tune(service, "linear", [64, 96, 32], "float16", {"act": "relu"})
    reg = KernelRegistry(client=service, arch="sm_90", cache_dir=tmp_path / "c", compiler=_NoCompile())
    with pytest.raises(_Compiled):
        reg.get("linear", (64, 96, 32), "float16", {"act": "silu"})


def test_every_op_attribute_goes_to_the_service(service, tmp_path):
    _tune(service, "layernorm", [64, 256], "float16", {"eps": "1e-5"})
    reg = KernelRegistry(client=service, arch="sm_90", cache_dir=tmp_path / "c", compiler=_NoCompile())
    served = reg.get("layernorm", (64, 256), "float16", {"eps": 1e-5})  # asked for as attr=eps:1e-05
    assert served.source == TUNED and served.attrs == {"eps": 1e-5}
    with pytest.raises(_Compiled):  # the default eps (1e-12) was never tuned: compiled, not served
        reg.get("layernorm", (64, 256), "float16")


class _Compiled(Exception):
    pass


class _NoCompile:
    """A compiler that says it was asked (the registry fell through to a default)."""

    def compile(self, source, arch):
        raise _Compiled(arch)


def _mock_service(kernel: dict | None, calls: list, cubin: bytes = b"served-cubin"):
    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(str(request.url))
        if request.url.path == "/api/kernels/best":
            if kernel is None or request.url.params.get("arch") != kernel["arch"]:
                return httpx.Response(404, json={"detail": "none"})
            return httpx.Response(200, json=kernel)
        if kernel is not None and request.url.path == f"/api/kernels/{kernel['id']}/cubin":
            return httpx.Response(200, content=cubin)
        return httpx.Response(404, json={"detail": "?"})

    return httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))


def _fused_kernel(**over):
    kernel = {
        "id": 7,
        "op": "fused_mlp",
        "shape": [4, 64, 128, 64],
        "dtype": "float16",
        "arch": "sm_90",
        "attrs": {"act": "gelu_erf"},
        "family": "small_batch",
        "params": {"core": "mma", "max_batch": 16, "hidden_per_block": 64, "threads": 256, "vec": 8, "unroll": 2},
        "launches": [],
        "workspace": {},
        "median_ms": 0.01,
        "speedup": 1.7,
        "exact": False,
    }
    kernel.update(over)
    return kernel


def test_a_cubin_may_take_longer_in_all_than_a_lookup(tmp_path, monkeypatch):
    calls: list = []
    reg = KernelRegistry(client=_mock_service(_fused_kernel(), calls), arch="sm_90", cache_dir=tmp_path, timeout_s=0.5)
    bounds = {}
    read = registry_module.request_within

    def recording(client, method, path, within, **kwargs):
        bounds[path.rsplit("/", 1)[-1]] = within
        return read(client, method, path, within, **kwargs)

    monkeypatch.setattr(registry_module, "request_within", recording)
    assert reg.get("fused_mlp", (8, 64, 128, 64), "float16", {"act": "gelu_erf"}).cubin == b"served-cubin"
    assert bounds == {"best": 0.5, "cubin": 0.5 * CUBIN_READS}


def test_nearest_kernel_used_only_when_its_family_accepts_the_shape(tmp_path):
    calls: list = []
    client = _mock_service(_fused_kernel(), calls)
    reg = KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path, compiler=_NoCompile())
    ok = reg.get("fused_mlp", (8, 64, 128, 64), "float16", {"act": "gelu_erf"})
    assert ok.source == NEAREST and ok.speedup == 1.7 and ok.cubin == b"served-cubin"
    assert ok.launches[1].args[-5:-1] == (8, 64, 128, 64)  # rebuilt for batch 8
    # batch 40 > max_batch 16 of the served small_batch variant: not used, the default is compiled instead.
    with pytest.raises(_Compiled):
        reg.get("fused_mlp", (40, 64, 128, 64), "float16", {"act": "gelu_erf"})


def test_the_service_revalidates_the_local_cache(tmp_path):
    problem = ("fused_mlp", (4, 64, 128, 64), "float16", {"act": "gelu_erf"})

    def registry(kernel, calls, cubin=b"served-cubin", **kw):
        client = _mock_service(kernel, calls, cubin)
        return KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path, compiler=_NoCompile(), **kw)

    first = registry(_fused_kernel(exact=True), []).get(*problem)
    assert first.source == TUNED and first.kernel_id == 7 and first.cubin == b"served-cubin"
    # The service still serves kernel 7: the cached cubin, nothing downloaded.
    calls: list = []
    same = registry(_fused_kernel(exact=True), calls).get(*problem)
    assert same.kernel_id == 7 and same.note == "from the local cache; still the service's"
    assert not any("/cubin" in c for c in calls)
    # A kernel tuned since (8) replaces it, here and in the cache.
    calls = []
    newer = registry(_fused_kernel(exact=True, id=8), calls, b"newer-cubin").get(*problem)
    assert newer.source == TUNED and newer.kernel_id == 8 and newer.cubin == b"newer-cubin"
    assert any("/api/kernels/8/cubin" in c for c in calls)
    offline = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False, compiler=_NoCompile())
    assert offline.get(*problem).cubin == b"newer-cubin"
    # A service with nothing for the shape, or only a nearest shape's kernel: the cached exact one stays.
    assert registry(None, []).get(*problem).kernel_id == 8
    nearest = _fused_kernel(id=9, shape=[8, 64, 128, 64])
    assert registry(nearest, []).get(*problem).kernel_id == 8


def test_a_cached_kernel_is_the_services_only_where_server_and_kernel_match_not_the_id_alone(tmp_path):
    """Kernel ids are per database, and a problem's better kernel is re-published under its id: a cache entry
    with the served id but from another server, or with other params, was used without downloading."""
    problem = ("fused_mlp", (4, 64, 128, 64), "float16", {"act": "gelu_erf"})

    def registry(server, kernel, calls, cubin):
        client = _mock_service(kernel, calls, cubin)
        return KernelRegistry(server, client=client, arch="sm_90", cache_dir=tmp_path, compiler=_NoCompile())

    staging = _fused_kernel(exact=True)
    assert registry("http://staging:8000", staging, [], b"staging-cubin").get(*problem).params["unroll"] == 2
    # Another server's kernel 7 (unroll=4): downloaded, and the cache now holds it.
    prod = _fused_kernel(exact=True, params={**staging["params"], "unroll": 4}, speedup=3.0)
    calls: list = []
    entry = registry("http://prod:8000", prod, calls, b"prod-cubin").get(*problem)
    assert (entry.params["unroll"], entry.cubin, entry.speedup) == (4, b"prod-cubin", 3.0)
    assert "/api/kernels/7/cubin" in calls[-1] and entry.note == ""
    # The same server and kernel again: the cached cubin, nothing downloaded.
    calls = []
    again = registry("http://prod:8000", prod, calls, b"prod-cubin").get(*problem)
    assert again.cubin == b"prod-cubin" and again.note == "from the local cache; still the service's"
    assert not any("/cubin" in c for c in calls)
    # Kernel 7 re-published on that server with other params (a better trial of the problem): downloaded.
    republished = _fused_kernel(exact=True, params={**staging["params"], "unroll": 8})
    calls = []
    newer = registry("http://prod:8000", republished, calls, b"republished-cubin").get(*problem)
    assert newer.params["unroll"] == 8 and newer.cubin == b"republished-cubin"
    assert any("/api/kernels/7/cubin" in c for c in calls)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"{}", "no id"),
        (b"[1, 2, 3]", "a JSON list, not an object"),
        (json.dumps(_fused_kernel(family=None)).encode(), "family is None"),
        (json.dumps(_fused_kernel(shape=[4, "64", 128, 64])).encode(), "shape is [4, '64', 128, 64]"),
        (json.dumps(_fused_kernel(median_ms="fast")).encode(), "median_ms is 'fast'"),
        (json.dumps(_fused_kernel(launches=[{"name": 1}])).encode(), "launches is [{'name': 1}]"),
        (
            json.dumps(_fused_kernel(shape=[4, 64, 128])).encode(),
            "shape is [4, 64, 128], of rank 3, for a problem of rank 4",
        ),
    ],
)
def test_an_unusable_answer_from_the_service_is_logged_and_the_default_used(tmp_path, caplog, body, why):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/kernels/best":
            return httpx.Response(200, content=body)
        return httpx.Response(404, json={"detail": "?"})

    client = httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))
    reg = KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path, compiler=_NoCompile())
    with caplog.at_level(logging.WARNING), pytest.raises(_Compiled):  # the default variant is compiled instead
        reg.get("fused_mlp", (4, 64, 128, 64), "float16", {"act": "gelu_erf"})
    assert "the service's answer is unusable: " + why in caplog.text


def test_the_services_answer_is_checked_against_the_question(tmp_path, caplog):
    """An answer claiming exact: true for another shape was taken as tuned at this one (so never verified at it),
    and one for another op, dtype or arch was taken as this problem's kernel."""
    problem = ("fused_mlp", (4, 64, 128, 64), "float16", {"act": "gelu_erf"})

    def registry(answer, cache):
        def handler(request: httpx.Request) -> httpx.Response:  # the same answer to every arch asked
            if request.url.path == "/api/kernels/best":
                return httpx.Response(200, json=answer)
            return httpx.Response(200, content=b"served-cubin")

        client = httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))
        return KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path / cache, compiler=_Recompile())

    claimed = registry(_fused_kernel(exact=True, shape=[8, 64, 128, 64]), "claimed").get(*problem)
    assert (claimed.source, claimed.served_shape) == (NEAREST, (8, 64, 128, 64))
    assert registry(_fused_kernel(exact=False), "unclaimed").get(*problem).source == TUNED  # at this very shape

    for field, value, asked in [
        ("op", "linear", "fused_mlp"),
        ("dtype", "bfloat16", "float16"),
        ("arch", "sm_80", "sm_90"),
    ]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kernelmill.runtime.registry"):
            entry = registry(_fused_kernel(exact=True, **{field: value}), field).get(*problem)
        assert entry.source == DEFAULT and entry.cubin == b"rebuilt-cubin"
        why = f"{field} is {value!r}, asked for {asked!r}"
        assert entry.note.startswith(f"service answered an unusable kernel ({why})")
        assert f"the service's answer is unusable: {why}" in caplog.text


@pytest.mark.parametrize("damage", ["{}", "[1]", '{"family": "small_batch", "params": {}, "source": 3}', "{"])
def test_a_damaged_local_cache_entry_is_passed_over(tmp_path, damage):
    problem = ("fused_mlp", (4, 64, 128, 64), "float16", {"act": "gelu_erf"})
    client = _mock_service(_fused_kernel(exact=True), [])
    KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path, compiler=_NoCompile()).get(*problem)
    offline = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False, compiler=_NoCompile())
    assert offline.get(*problem).cubin == b"served-cubin"  # the entry, while whole
    metas = list((tmp_path / "served").rglob("*.json"))
    assert len(metas) == 1
    metas[0].write_text(damage)
    with pytest.raises(_Compiled):  # no KeyError / TypeError: the default variant is compiled instead
        KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False, compiler=_NoCompile()).get(*problem)


@pytest.mark.parametrize(
    ("attrs", "why"),
    [
        ({"act": "gelu_erf", "foo": 1}, "op fused_mlp has no attribute 'foo'; its attributes: act"),
        ({"act": "gelu_fast"}, "attribute act='gelu_fast' is not allowed; choose one of "),
    ],
)
def test_a_served_kernel_with_attributes_this_version_does_not_accept_is_passed_over(tmp_path, attrs, why):
    problem = ("fused_mlp", (4, 64, 128, 64), "float16", {"act": "gelu_erf"})
    kernel = _fused_kernel(exact=True, attrs=attrs)
    reg = KernelRegistry(client=_mock_service(kernel, []), arch="sm_90", cache_dir=tmp_path, compiler=_NoCompile())
    assert reg.find(*problem) is None  # was SpecError out of find(), so out of a forward
    reg = KernelRegistry(client=_mock_service(kernel, []), arch="sm_90", cache_dir=tmp_path, compiler=_Recompile())
    entry = reg.get(*problem)
    assert entry.source == DEFAULT and entry.cubin == b"rebuilt-cubin"
    assert entry.note.startswith("served kernel #7 not used: served kernel is not valid in this version: " + why)


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("attrs", {"act": "gelu_erf", "foo": 1}, "op fused_mlp has no attribute 'foo'; its attributes: act"),
        ("attrs", {"act": "gelu_fast"}, "served kernel is not valid in this version: attribute act='gelu_fast'"),
        ("source", "bogus", "source is 'bogus', not 'tuned' or 'nearest'"),
        ("source", "default", "source is 'default', not 'tuned' or 'nearest'"),
        ("served_shape", [4, 64], "served_shape is [4, 64], of rank 2, for a problem of rank 4"),
    ],
)
def test_a_local_cache_entry_this_version_cannot_trust_is_passed_over(tmp_path, field, value, why):
    problem = ("fused_mlp", (4, 64, 128, 64), "float16", {"act": "gelu_erf"})
    client = _mock_service(_fused_kernel(exact=True), [])
    KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path, compiler=_NoCompile()).get(*problem)
    (meta_path,) = (tmp_path / "served").rglob("*.json")
    meta = json.loads(meta_path.read_text())
    assert meta["source"] == TUNED
    meta_path.write_text(json.dumps({**meta, field: value}))

    offline = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False, compiler=_NoCompile())
    assert offline.find(*problem) is None  # neither a SpecError nor a kernel trusted as tuned
    offline = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False, compiler=_Recompile())
    entry = offline.get(*problem)
    assert entry.source == DEFAULT and entry.cubin == b"rebuilt-cubin"
    assert entry.note.startswith("local cache entry unusable: ") and why in entry.note


def test_a_cached_cubin_that_is_not_the_one_its_entry_was_written_with_is_passed_over(tmp_path):
    problem = ("fused_mlp", (4, 64, 128, 64), "float16", {"act": "gelu_erf"})
    client = _mock_service(_fused_kernel(exact=True), [])
    KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path, compiler=_NoCompile()).get(*problem)
    (meta_path,) = (tmp_path / "served").rglob("*.json")
    meta = json.loads(meta_path.read_text())
    assert meta["cubin_sha256"] == hashlib.sha256(b"served-cubin").hexdigest()
    assert base64.b64decode(meta["cubin"]) == b"served-cubin"  # one record: no cubin file beside it
    assert sorted(p.name for p in meta_path.parent.iterdir()) == [meta_path.name]

    meta_path.write_text(json.dumps({**meta, "cubin": base64.b64encode(b"served-cubIn").decode()}))  # damaged
    offline = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False, compiler=_Recompile())
    entry = offline.get(*problem)
    assert entry.source == DEFAULT and entry.cubin == b"rebuilt-cubin"
    assert "is not the cubin its entry was written with (sha256 differs)" in entry.note

    # An entry of an earlier version, its cubin in a file beside it, is still read, checked by its digest...
    legacy = {k: v for k, v in meta.items() if k != "cubin"}
    meta_path.write_text(json.dumps(legacy))
    cubin_path = meta_path.with_suffix(".cubin")
    cubin_path.write_bytes(b"served-cubIn")
    offline = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False, compiler=_Recompile())
    assert offline.get(*problem).source == DEFAULT
    cubin_path.write_bytes(b"served-cubin")
    offline = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False, compiler=_NoCompile())
    assert offline.get(*problem).cubin == b"served-cubin"
    # ... and one written before the digest was recorded, unchecked.
    del legacy["cubin_sha256"]
    meta_path.write_text(json.dumps(legacy))
    cubin_path.write_bytes(b"served-cubIn")
    offline = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False, compiler=_NoCompile())
    assert offline.get(*problem).cubin == b"served-cubIn"
    # Replaced by this version, such an entry becomes one record, and its cubin file goes.
    KernelRegistry(client=_mock_service(_fused_kernel(exact=True, id=8), []), arch="sm_90", cache_dir=tmp_path,
                   compiler=_NoCompile()).get(*problem)  # fmt: skip
    assert not cubin_path.exists() and base64.b64decode(json.loads(meta_path.read_text())["cubin"])


class _Crash(BaseException):
    """The process dying between two writes (a BaseException: nothing in the registry catches it)."""


def _crashing_writes(monkeypatch, after: int) -> None:
    """Lets the kernel cache's first ``after`` writes complete, then dies at the next one."""
    write = registry_module.write_atomically
    done = []

    def crash_at_the_next(path, data):
        if len(done) == after:
            raise _Crash(path)
        write(path, data)
        done.append(path)

    monkeypatch.setattr(registry_module, "write_atomically", crash_at_the_next)


@pytest.mark.parametrize("after", [0, 1, 2])
def test_a_crash_while_the_cache_replaces_a_kernel_leaves_the_old_kernel_or_the_new(tmp_path, monkeypatch, after):
    """The cache wrote the cubin and its entry in two files: a crash between them left the new cubin under the
    old entry, whose sha256 no longer matched, so the kernel was lost until the service could be reached."""
    problem = ("fused_mlp", (4, 64, 128, 64), "float16", {"act": "gelu_erf"})
    client = _mock_service(_fused_kernel(exact=True), [])
    KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path, compiler=_NoCompile()).get(*problem)

    _crashing_writes(monkeypatch, after)
    client = _mock_service(_fused_kernel(exact=True, id=8), [], b"newer-cubin")
    newer = KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path, compiler=_NoCompile())
    with contextlib.suppress(_Crash):
        assert newer.get(*problem).kernel_id == 8  # no crash: every write was made
    monkeypatch.undo()

    offline = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False, compiler=_NoCompile())
    cached = offline.get(*problem)  # _NoCompile: never the default
    assert (cached.kernel_id, cached.cubin) in {(7, b"served-cubin"), (8, b"newer-cubin")}


class _Recompile:
    """A compiler that records what it is asked to build (or fails, given an error)."""

    def __init__(self, error: Exception | None = None):
        self.calls: list[tuple[str, str]] = []
        self.error = error

    def compile(self, source, arch):
        self.calls.append((source, arch))
        if self.error is not None:
            raise self.error
        return SimpleNamespace(cubin=b"rebuilt-cubin", key="rebuilt-key")

    def compile_many(self, sources, arch):
        return [self.compile(source, arch) for source in sources]


def _this_versions_source(kernel: dict) -> str:
    spec = get_op(kernel["op"])
    fam = spec.family(kernel["family"])
    return render(
        fam, fam.resolve(kernel["params"], kernel["dtype"]), kernel["dtype"], spec.resolve_attrs(kernel["attrs"])
    )


def test_a_kernel_tuned_with_another_template_is_rebuilt_from_this_one(tmp_path, caplog):
    problem = ("fused_mlp", (4, 64, 128, 64), "float16", {"act": "gelu_erf"})
    current = _this_versions_source(_fused_kernel())
    knobs, _, body = current.partition("\n")

    # Served code that is this version's: its cubin, no compile (_NoCompile would raise).
    same = _fused_kernel(exact=True, source=current)
    reg = KernelRegistry(client=_mock_service(same, []), arch="sm_90", cache_dir=tmp_path / "a", compiler=_NoCompile())
    entry = reg.get(*problem)
    assert entry.cubin == b"served-cubin" and not entry.rebuilt and entry.code is not None
    # Only the knobs comment differs (a parameter the kernel predates): the same code, not rebuilt.
    renamed = _fused_kernel(exact=True, source=knobs.replace("unroll=", "unroll =") + "\n" + body)
    reg = KernelRegistry(
        client=_mock_service(renamed, []), arch="sm_90", cache_dir=tmp_path / "b", compiler=_NoCompile()
    )
    assert reg.get(*problem).cubin == b"served-cubin"

    # Tuned with an older template: compiled from this version's, for this GPU, and the cache keeps that.
    old = _fused_kernel(exact=True, source=knobs + "\n// an older template\n")
    compiler = _Recompile()
    reg = KernelRegistry(client=_mock_service(old, []), arch="sm_90", cache_dir=tmp_path / "c", compiler=compiler)
    with caplog.at_level(logging.INFO, logger="kernelmill.runtime.registry"):
        entry = reg.get(*problem)
    assert compiler.calls == [(current, "sm_90")]
    assert entry.source == TUNED and entry.kernel_id == 7 and entry.speedup == 1.7
    assert entry.cubin == b"rebuilt-cubin" and entry.rebuilt and "rebuilt from this version's template" in entry.note
    assert "tuned kernel #7" in caplog.text and "rebuilt from this version's template" in caplog.text
    offline = KernelRegistry(arch="sm_90", cache_dir=tmp_path / "c", use_service=False, compiler=_NoCompile())
    cached = offline.get(*problem)
    assert cached.cubin == b"rebuilt-cubin" and cached.rebuilt  # no compile: the cache holds this version's code


class _FailsFirst(_Recompile):
    """A compiler whose first compile fails (this version's code of a served kernel), the rest succeed."""

    def compile(self, source, arch):
        if not self.calls:
            self.calls.append((source, arch))
            raise CompileError("ptxas: too much shared data")
        return super().compile(source, arch)


def test_a_kernel_tuned_with_another_template_that_does_not_rebuild_is_not_used(tmp_path, caplog):
    """Its cubin ran with the launches this version builds for its family, which are for other code (the
    arguments, grid and shared memory of this version's template): it was kept, and launched, as tuned."""
    problem = ("fused_mlp", (4, 64, 128, 64), "float16", {"act": "gelu_erf"})
    knobs = _this_versions_source(_fused_kernel()).partition("\n")[0]
    old = _fused_kernel(exact=True, source=knobs + "\n// an older template\n")
    reg = KernelRegistry(client=_mock_service(old, []), arch="sm_90", cache_dir=tmp_path, compiler=_FailsFirst())
    with caplog.at_level(logging.WARNING, logger="kernelmill.runtime.registry"):
        entry = reg.get(*problem)
    assert entry.source == DEFAULT and entry.cubin == b"rebuilt-cubin"
    why = "built from another template; this version's does not render or compile: ptxas: too much shared data"
    assert f"served kernel #7 not used: {why}" in entry.note
    assert f"tuned kernel #7 not used: {why}" in caplog.text

    # The same kernel in the local cache, written by the version it was tuned with (whose code it is): passed over.
    assert not (tmp_path / "served").exists()  # nor was it cached
    same = _fused_kernel(exact=True, source=_this_versions_source(_fused_kernel()))
    writer = KernelRegistry(client=_mock_service(same, []), arch="sm_90", cache_dir=tmp_path, compiler=_NoCompile())
    writer.get(*problem)
    (meta_path,) = (tmp_path / "served").rglob("*.json")
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "code": registry_module.code_digest(old["source"])}))
    offline = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False, compiler=_FailsFirst())
    entry = offline.get(*problem)
    assert entry.source == DEFAULT and f"local cache entry unusable: {why}" in entry.note


def test_served_kernels_from_before_a_new_parameter_still_serve(tmp_path):
    # A wgmma linear tuned before swap_ab existed: its params lack the knob, which defaults to the kernel it was.
    old = {"BM": 128, "BN": 128, "consumers": 2, "stages": 5, "ctas": 0, "stream_k": False, "k_splits": 2}
    kernel = _fused_kernel(op="linear", shape=[256, 4096, 4096], attrs={"act": "none"}, family="wgmma", params=old)
    reg = KernelRegistry(client=_mock_service(kernel, []), arch="sm_90", cache_dir=tmp_path, compiler=_NoCompile())
    entry = reg.get("linear", (256, 4096, 4096), "float16", {"act": "none"})
    assert entry.source == TUNED and entry.cubin == b"served-cubin"
    assert entry.launches[-1].grid == (2 * 32 * 2, 1, 1)  # 2 x 32 tiles of 128 x 128, clusters of 2: not swapped
    # A value this version would change (an unknown knob, a value out of its range) is not served.
    for params in ({**old, "unroll": 3}, {**old, "BN": 100}):
        bad = _fused_kernel(op="linear", shape=[256, 4096, 4096], attrs={"act": "none"}, family="wgmma", params=params)
        client = _mock_service(bad, [])
        strict = KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path / "s", compiler=_NoCompile())
        with pytest.raises(_Compiled):
            strict.get("linear", (256, 4096, 4096), "float16", {"act": "none"})


@pytest.mark.parametrize("dropped", ["rows_per_block", "vec"])
def test_a_kernel_saved_without_a_parameter_runs_with_its_default_served_or_cached(tmp_path, dropped):
    """Such a kernel (tuned before the parameter existed) raised a KeyError from the family's launches."""
    params = get_op("softmax").family("warp_row").defaults("float32")
    kernel = _fused_kernel(op="softmax", shape=[64, 512], attrs={}, family="warp_row", dtype="float32", exact=True)
    kernel["params"] = {k: v for k, v in params.items() if k != dropped}
    reg = KernelRegistry(client=_mock_service(kernel, []), arch="sm_90", cache_dir=tmp_path, compiler=_NoCompile())
    entry = reg.get("softmax", (64, 512), "float32")
    assert entry.source == TUNED and entry.params == params and entry.launches
    offline = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False, compiler=_NoCompile())
    cached = offline.get("softmax", (64, 512), "float32")
    assert cached.source == TUNED and cached.params == params


def test_a_nearest_shape_is_close_within_a_factor_of_two_in_every_dimension():
    from kernelmill.runtime.registry import _close

    assert _close((256, 4096, 11008), (128, 4096, 11008)) and _close((128, 4096, 11008), (256, 4096, 11008))
    assert not _close((256, 4096, 11008), (127, 4096, 11008)) and not _close((256, 4096), (256, 8193))
    assert _close((1, 64), (2, 64)) and _close((0, 64), (2, 64)) and not _close((1, 64), (3, 64))


def test_a_nearest_kernel_of_another_kind_does_not_stand_in(tmp_path, caplog):
    # A wgmma linear tuned at M = 256 serves M = 128 (wgmma's regime too) but not the batch-1 product (gemv's).
    params = {"BM": 128, "BN": 128, "consumers": 2, "stages": 5, "ctas": 0, "stream_k": False, "k_splits": 2}
    kernel = _fused_kernel(op="linear", shape=[256, 4096, 11008], attrs={"act": "none"}, family="wgmma", params=params)
    reg = KernelRegistry(client=_mock_service(kernel, []), arch="sm_90", cache_dir=tmp_path, compiler=_NoCompile())
    assert reg.get("linear", (128, 4096, 11008), "float16", {"act": "none"}).source == NEAREST
    assert reg.find("linear", (1, 4096, 11008), "float16", {"act": "none"}) is None
    compiling = KernelRegistry(client=_mock_service(kernel, []), arch="sm_90", cache_dir=tmp_path / "c")
    with caplog.at_level(logging.INFO, logger="kernelmill.runtime.registry"):
        entry = compiling.get("linear", (1, 4096, 11008), "float16", {"act": "none"})
    assert entry.source == DEFAULT and entry.family == "gemv"
    assert "served kernel #7 (tuned at 256x4096x11008) not used: family wgmma" in entry.note
    assert "default family is gemv" in caplog.text


def test_find_returns_only_tuned_kernels_and_never_compiles(tmp_path):
    calls: list = []
    reg = KernelRegistry(
        client=_mock_service(_fused_kernel(), calls), arch="sm_90", cache_dir=tmp_path, compiler=_NoCompile()
    )
    found = reg.find("fused_mlp", (8, 64, 128, 64), "float16", {"act": "gelu_erf"})
    assert found is not None and found.source == NEAREST
    assert reg.get("fused_mlp", (8, 64, 128, 64), "float16", {"act": "gelu_erf"}) is found
    # Nothing usable for batch 40 (and another act): None, remembered, and no default compiled.
    assert reg.find("fused_mlp", (40, 64, 128, 64), "float16", {"act": "gelu_erf"}) is None
    asked = len(calls)
    assert reg.find("fused_mlp", (40, 64, 128, 64), "float16", {"act": "gelu_erf"}) is None
    assert len(calls) == asked
    assert [r["op"] for r in reg.report()] == ["fused_mlp"]


def test_prepare_asks_the_service_once_per_problem(tmp_path):
    """prepare() asked for each problem in find() (is there a tuned kernel?) and, finding none, again in get()."""
    calls: list = []
    reg = KernelRegistry(client=_mock_service(None, calls), arch="sm_90", cache_dir=tmp_path, compiler=_Recompile())
    problems = [("add", (100,), "float16", {}), ("softmax", (64, 512), "float16", {})]
    reg.prepare(problems)
    assert len(calls) == 4  # each problem for sm_90 and sm_90a
    assert [reg.get(*problem).source for problem in problems] == [DEFAULT, DEFAULT]
    assert len(calls) == 4
    assert [row["note"] for row in reg.report()] == ["no tuned kernel on the service"] * 2


def test_served_arch_specific_kernels_and_tf32_policy(tmp_path):
    calls: list = []
    kernel = _fused_kernel(op="matmul", shape=[64, 64, 64], attrs={}, family="tensorcore", dtype="float32", exact=True)
    kernel["params"] = {**TensorCoreCore().defaults("float32")}
    kernel["arch"] = "sm_90a"
    reg = KernelRegistry(client=_mock_service(kernel, calls), arch="sm_90", cache_dir=tmp_path, compiler=_NoCompile())
    with pytest.raises(_Compiled):  # found under sm_90a, but TF32 for float32 is refused by default
        reg.get("matmul", (64, 64, 64), "float32")
    assert any("arch=sm_90a" in c for c in calls)
    lenient = KernelRegistry(
        client=_mock_service(kernel, calls), arch="sm_90", cache_dir=tmp_path / "b", allow_tf32=True
    )
    entry = lenient.get("matmul", (64, 64, 64), "float32")
    assert entry.source == TUNED and entry.arch == "sm_90a"


def _by_precision(ieee: dict, tf32: dict, calls: list | None = None):
    """A service's handler answering sm_90's best kernel: ``tf32`` where that precision is asked for, else ``ieee``
    (the precision each request asked for appended to ``calls``); cubins are their paths' bytes; else 404."""

    def handler(request: httpx.Request) -> httpx.Response:
        if calls is not None:
            calls.append(request.url.params.get("precision"))
        if request.url.path == "/api/kernels/best" and request.url.params.get("arch") == "sm_90":
            return httpx.Response(200, json=tf32 if request.url.params.get("precision") == "tf32" else ieee)
        if request.url.path.endswith("/cubin"):
            return httpx.Response(200, content=request.url.path.encode())
        return httpx.Response(404, json={"detail": "none"})

    return handler


def test_tf32_kernels_are_asked_for_by_name_and_cached_apart(tmp_path):
    ieee = _fused_kernel(op="matmul", shape=[64, 64, 64], attrs={}, family="simt", dtype="float32", exact=True)
    ieee.update(params=get_op("matmul").family("simt").defaults("float32"), median_ms=0.05)
    tf32 = {**ieee, "id": 8, "family": "tensorcore", "params": TensorCoreCore().defaults("float32"), "median_ms": 0.01}
    calls: list = []

    handler = _by_precision(ieee, tf32, calls)

    def registry(**kw):
        client = httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))
        return KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path, **kw)

    assert registry().get("matmul", (64, 64, 64), "float32").family == "simt"
    assert set(calls) == {None}  # IEEE only: no precision asked for (older services know no such parameter)
    faster = registry(allow_tf32=True).get("matmul", (64, 64, 64), "float32")
    assert faster.family == "tensorcore" and "tf32" in calls
    # Both are now in the local cache, apart: offline, each registry finds its own.
    offline = {"use_service": False, "compiler": _NoCompile()}
    assert registry(**offline).get("matmul", (64, 64, 64), "float32").family == "simt"
    assert registry(allow_tf32=True, **offline).get("matmul", (64, 64, 64), "float32").family == "tensorcore"


def test_a_kernel_tuned_for_the_exact_shape_is_taken_before_a_faster_one_tuned_at_another(tmp_path):
    # The service's IEEE answer is for this very shape; its faster TF32 answer was tuned at 64 x 64 x 128.
    exact = _fused_kernel(op="matmul", shape=[64, 64, 64], attrs={}, family="simt", dtype="float32", exact=True)
    exact.update(params=get_op("matmul").family("simt").defaults("float32"), median_ms=0.05)
    near = {**exact, "id": 8, "family": "tensorcore", "params": TensorCoreCore().defaults("float32")}
    near.update(shape=[64, 64, 128], exact=False, median_ms=0.01)

    handler = _by_precision(exact, near)

    client = httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))
    reg = KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path, allow_tf32=True, compiler=_NoCompile())
    entry = reg.get("matmul", (64, 64, 64), "float32")
    assert (entry.source, entry.kernel_id, entry.family) == (TUNED, 7, "simt")
    assert entry.cubin == b"/api/kernels/7/cubin"
    # Tuned at this shape too, the faster one is taken.
    near.update(shape=[64, 64, 64], exact=True)
    client = httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))
    reg = KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path / "b", allow_tf32=True, compiler=_NoCompile())
    assert reg.get("matmul", (64, 64, 64), "float32").kernel_id == 8


def test_the_kernel_tuned_on_this_gpu_model_is_taken_before_a_faster_time_on_another(tmp_path):
    """The sm_90 and sm_90a answers may come from different GPU models: an H100's 0.045 ms was taken over this
    H200's own 0.050 ms, though the two times were never measured on one GPU."""
    linear = get_op("linear")
    mine = _fused_kernel(op="linear", shape=[256, 4096, 4096], attrs={"act": "none"}, exact=True, id=1)
    mine.update(family="tensorcore", params=linear.family("tensorcore").resolve({}, "float16"), median_ms=0.050)
    mine["device_name"] = "NVIDIA H200"
    other = {**mine, "id": 2, "arch": "sm_90a", "family": "wgmma", "median_ms": 0.045, "device_name": "NVIDIA H100"}
    other["params"] = linear.family("wgmma").resolve({}, "float16")

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/kernels/best":
            return httpx.Response(200, json=mine if request.url.params["arch"] == "sm_90" else other)
        return httpx.Response(200, content=request.url.path.encode())

    info = SimpleNamespace(name="NVIDIA H200", sm_count=132)
    backend = SimpleNamespace(
        arch="sm_90", device=SimpleNamespace(info=info, load=lambda cubin, key: None), capturing_graph=False
    )

    def chosen(cache: str) -> int:
        client = httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))
        reg = KernelRegistry(
            client=client, backend=backend, cache_dir=tmp_path / cache, compiler=_NoCompile(), check=False
        )
        return reg.get("linear", (256, 4096, 4096), "float16", {"act": "none"}).kernel_id

    assert chosen("a") == 1
    other["device_name"] = "NVIDIA H200"  # both timed on this GPU model: the faster
    assert chosen("b") == 2


def test_of_the_cached_precisions_the_kernel_timed_on_this_gpu_model_is_taken_first(tmp_path):
    """The local cache's IEEE and TF32 kernels were ranked by their times alone, though one was timed on an
    H100 and the other on this H200: as with the service's answers, this GPU model's comes first."""
    ieee = _fused_kernel(op="matmul", shape=[64, 64, 64], attrs={}, family="simt", dtype="float32", exact=True)
    ieee.update(params=get_op("matmul").family("simt").defaults("float32"), median_ms=0.05, device_name="NVIDIA H200")
    tf32 = {**ieee, "id": 8, "family": "tensorcore", "params": TensorCoreCore().defaults("float32"), "median_ms": 0.01}
    tf32["device_name"] = "NVIDIA H100"

    handler = _by_precision(ieee, tf32)

    def on(gpu: str, **kw) -> int:
        device = SimpleNamespace(info=SimpleNamespace(name=gpu, sm_count=132), load=lambda cubin, key: None)
        backend = SimpleNamespace(arch="sm_90", device=device, capturing_graph=False)
        client = httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))
        reg = KernelRegistry(
            client=client, backend=backend, cache_dir=tmp_path, compiler=_NoCompile(), check=False, **kw
        )
        return reg.get("matmul", (64, 64, 64), "float32").kernel_id

    assert on("NVIDIA H200") == 7 and on("NVIDIA H100", allow_tf32=True) == 8  # both cached now
    assert on("NVIDIA H200", allow_tf32=True, use_service=False) == 7
    assert on("NVIDIA H100", allow_tf32=True, use_service=False) == 8


def test_an_exact_kernel_whose_launches_are_not_this_versions_is_passed_over(tmp_path):
    problem = ("fused_mlp", (4, 64, 128, 64), "float16", {"act": "gelu_erf"})
    # The entries this version launches for the served parameters (served with no source: nothing to rebuild).
    probe = KernelRegistry(client=_mock_service(_fused_kernel(exact=True), []), arch="sm_90", cache_dir=tmp_path / "a")
    entries = [launch.entry for launch in probe.get(*problem).launches]
    assert entries

    same = _fused_kernel(exact=True, launches=[{"entry": e} for e in entries])
    reg = KernelRegistry(client=_mock_service(same, []), arch="sm_90", cache_dir=tmp_path / "b", compiler=_NoCompile())
    assert reg.get(*problem).source == TUNED

    other = _fused_kernel(exact=True, launches=[{"entry": "km_an_older_entry"}])
    reg = KernelRegistry(client=_mock_service(other, []), arch="sm_90", cache_dir=tmp_path / "c")
    entry = reg.get(*problem)
    assert entry.source == DEFAULT
    assert "served kernel #7 launches differ from this version's family" in entry.note


def test_unreachable_service_is_logged_once_and_skipped(tmp_path, caplog):
    reg = KernelRegistry("http://127.0.0.1:9", arch="sm_90", cache_dir=tmp_path, timeout_s=0.5, compiler=_NoCompile())
    with caplog.at_level(logging.WARNING), pytest.raises(_Compiled):
        reg.get("add", (100,), "float16")
    with pytest.raises(_Compiled):
        reg.get("add", (200,), "float16")
    assert caplog.text.count("unreachable") == 1


@pytest.mark.parametrize("url", ["http://localhost:80a", "http://[::1", "localhost:8000", "http://:8000"])
def test_a_malformed_server_url_is_one_clear_error_naming_where_it_came_from(tmp_path, monkeypatch, url):
    """httpx.InvalidURL escaped from every lookup and from tune_model; a bare host:port was "unreachable"."""
    with pytest.raises(ValueError, match=r"^server=: malformed server URL .*give it as http://HOST:PORT"):
        KernelRegistry(url, arch="sm_90", cache_dir=tmp_path)
    monkeypatch.setenv("KERNELMILL_SERVER", url)
    with pytest.raises(ValueError, match=r"^KERNELMILL_SERVER: malformed server URL"):
        KernelRegistry(arch="sm_90", cache_dir=tmp_path)
    config = {"vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    config.update({"intermediate_size": 64, "max_position_embeddings": 16})
    model = runtime.Model(runtime.BertModel.random(config), device="cpu")
    with pytest.raises(ValueError, match=r"^KERNELMILL_SERVER: malformed server URL"):
        runtime.tune_model(model, np.arange(10).reshape(2, 5), dtype="float16")


def test_unusable_answers_are_logged_once_per_kind_with_their_body_cut(tmp_path, caplog):
    """A service refusing a question (400) or answering a kernel that is not for the problem is kernelmill, so it
    is asked for every problem, for sm_90 and sm_90a: the first answer of a kind is a WARNING with its body cut to
    200 characters, the rest DEBUG."""
    detail = json.dumps({"detail": "boom " * 100})
    answer = {"status": 400, "body": detail.encode()}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(answer["status"], content=answer["body"])

    client = httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))
    reg = KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path, compiler=_Recompile())
    with caplog.at_level(logging.DEBUG, logger="kernelmill.runtime.registry"):
        reg.get("add", (100,), "float16")
        reg.get("add", (200,), "float16")
        answer.update(status=200, body=json.dumps(_fused_kernel(op="add", shape=[300], dtype="bfloat16")).encode())
        entry = reg.get("add", (300,), "float16")
    assert entry.source == DEFAULT and entry.note.startswith("service answered an unusable kernel (dtype is 'bfloat16'")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    shown = f"{detail[:200]!r}... ({len(detail)} characters)"
    assert warnings == [
        f"runtime: add 100: service answered 400: {shown} (more such answers from http://svc are logged at DEBUG)",
        "runtime: add 300: the service's answer is unusable: dtype is 'bfloat16', asked for 'float16' "
        "(more such answers from http://svc are logged at DEBUG)",
    ]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "answer" in r.getMessage()]
    assert debug == [
        f"runtime: add 100: service answered 400: {shown}",
        f"runtime: add 200: service answered 400: {shown}",
        f"runtime: add 200: service answered 400: {shown}",
        "runtime: add 300: the service's answer is unusable: dtype is 'bfloat16', asked for 'float16'",
    ]


@pytest.mark.parametrize(
    ("status", "body", "why"),
    [
        (502, b"<html><body>502 Bad Gateway</body></html>", "answered 502"),  # a proxy before a dead service
        (500, b'{"detail": "Internal Server Error"}', "answered 500"),
        (200, b"<html>a login page</html>", "answered 200 not as kernelmill does"),
        (403, b"Forbidden", "answered 403 not as kernelmill does"),
    ],
)
def test_a_failing_service_or_one_that_is_not_kernelmill_is_not_asked_again(tmp_path, caplog, status, body, why):
    """Such a service was asked for every problem and both arches, each answer a wait (5 problems against a proxy
    answering 502 after 0.8 s: 16 s), as only a timeout stopped it."""
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(status, content=body)

    client = httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))
    reg = KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path, compiler=_Recompile())
    with caplog.at_level(logging.WARNING, logger="kernelmill.runtime.registry"):
        reg.prepare([("add", (100 * i,), "float16", {}) for i in range(1, 6)])
    assert len(calls) == 1
    assert [row["note"] for row in reg.report()] == [f"service {why}"] * 5
    shown = excerpt(body.decode())
    assert caplog.messages == [
        f"runtime: kernel service http://svc {why} ({shown}); using the local cache and default kernels"
    ]


def test_a_cubin_download_that_fails_stops_the_service_too(tmp_path, caplog):
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/api/kernels/best":
            if request.url.params["arch"] != "sm_90":
                return httpx.Response(404, json={"detail": "none"})
            return httpx.Response(200, json=_fused_kernel(exact=True))
        return httpx.Response(503, text="unavailable")

    client = httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))
    reg = KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path, compiler=_Recompile())
    with caplog.at_level(logging.WARNING, logger="kernelmill.runtime.registry"):
        entry = reg.get("fused_mlp", (4, 64, 128, 64), "float16", {"act": "gelu_erf"})
        reg.get("fused_mlp", (8, 64, 128, 64), "float16", {"act": "gelu_erf"})
    assert entry.source == DEFAULT and "cubin of kernel #7 not fetched" in entry.note
    assert calls == ["/api/kernels/best", "/api/kernels/best", "/api/kernels/7/cubin"]
    assert caplog.messages == [
        "runtime: kernel service http://svc answered 503 ('unavailable'); using the local cache and default kernels"
    ]


def test_a_cubin_of_other_code_than_the_answer_it_was_fetched_for_is_not_used(tmp_path):
    """The service re-published kernel #7 between its /best answer and the cubin read: the bytes name other code
    (CODE_HEADER) than the answer's source, so they are not used with the answer's launches."""
    from kernelmill.kernels.render import CODE_HEADER, code_digest

    source = "// kernelmill variant: x\nthe code the answer names"

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/api/kernels/best":
            return httpx.Response(200, json=_fused_kernel(exact=True, source=source))
        return httpx.Response(200, content=b"other-cubin", headers={CODE_HEADER: code_digest(source + "changed")})

    client = httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))
    reg = KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path, compiler=_Recompile())
    entry = reg.get("fused_mlp", (4, 64, 128, 64), "float16", {"act": "gelu_erf"})
    assert entry.source == DEFAULT and entry.cubin != b"other-cubin"
    assert "cubin of kernel #7 not used: it changed on the service since its answer" in entry.note


def test_kernelmills_own_404_is_nothing_tuned_and_logs_nothing(service, tmp_path, caplog):
    reg = KernelRegistry(client=service, arch="sm_90", cache_dir=tmp_path / "c", compiler=_Recompile())
    with caplog.at_level(logging.WARNING, logger="kernelmill.runtime.registry"):
        entry = reg.get("add", (100,), "float16")
    assert entry.source == DEFAULT and entry.note == "no tuned kernel on the service"
    assert caplog.messages == []


@pytest.mark.parametrize(
    ("body", "shown"),
    [
        (b"<html>not found</html>", "'<html>not found</html>'"),  # another server on that port, a proxy
        (b'{"detail": "Not Found"}', '\'{"detail": "Not Found"}\''),  # kernelmill's, under a wrong path prefix
        (b"", "''"),
    ],
)
def test_a_404_that_is_not_kernelmills_nothing_tuned_is_not_a_service(tmp_path, caplog, body, shown):
    """It was read as "nothing tuned", silently: a wrong port or path prefix looked like a service with no kernels."""
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return httpx.Response(404, content=body)

    client = httpx.Client(base_url="http://svc", transport=httpx.MockTransport(handler))
    reg = KernelRegistry(client=client, arch="sm_90", cache_dir=tmp_path, compiler=_Recompile())
    with caplog.at_level(logging.WARNING, logger="kernelmill.runtime.registry"):
        entry = reg.get("add", (100,), "float16")
        reg.get("add", (200,), "float16")
    assert entry.source == DEFAULT and entry.note == "service answered 404 not as kernelmill does"
    assert caplog.messages == [
        f"runtime: kernel service http://svc answered 404 not as kernelmill does ({shown}); "
        "using the local cache and default kernels"
    ]
    assert len(calls) == 1  # not asked again


def _trickling_server(status: bytes) -> tuple[socket.socket, list, str]:
    """A server that answers ``status`` with a 1000-byte body sent a byte every 50 ms: (its listening socket,
    to close; the connections it accepted; its URL)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    accepted: list = []

    def trickle():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            accepted.append(conn)
            conn.recv(65536)
            try:
                conn.sendall(
                    b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                )
                for _ in range(1000):
                    conn.sendall(b" ")
                    time.sleep(0.05)
            except OSError:  # the client gave up
                pass
            finally:
                conn.close()

    threading.Thread(target=trickle, daemon=True).start()
    return listener, accepted, f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_service_that_trickles_its_answer_is_given_up_within_the_timeout(tmp_path, caplog):
    """httpx's timeouts bound each read: a server sending a byte every 50 ms would hold a lookup for as long as
    it likes. The registry reads an answer within timeout_s in all, then takes the service for unreachable."""
    listener, accepted, server = _trickling_server(status=b"200 OK")
    reg = KernelRegistry(server, arch="sm_90", cache_dir=tmp_path, timeout_s=0.5, compiler=_NoCompile())
    start = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="kernelmill.runtime.registry"), pytest.raises(_Compiled):
            reg.get("add", (100,), "float16")
        waited_s = time.monotonic() - start
        with pytest.raises(_Compiled):
            reg.get("add", (200,), "float16")  # not asked again
    finally:
        listener.close()
    assert waited_s < 1.5  # was 50 s: each byte reset httpx's read timeout
    assert len(accepted) == 1
    assert caplog.messages == [
        f"runtime: kernel service {server} unreachable (ReadTimeout: no whole answer to /api/kernels/best within "
        "0.5 s); using the local cache and default kernels"
    ]


def test_default_tiles_follow_the_problem_size():
    from kernelmill.kernels.ops import OPS

    fam = OPS["linear"].family("tensorcore")
    big = default_params(OPS["linear"], fam, (8192, 8192, 4096), "float16")
    assert (big["BM"], big["BN"]) == (128, 128)
    small = default_params(OPS["linear"], fam, (128, 768, 768), "float16")
    assert small["BM"] * small["BN"] < 128 * 128 and fam.check(small, "float16") is None
    epi = OPS["fused_mlp"].family("epilogue")
    p = default_params(OPS["fused_mlp"], epi, (256, 4096, 11008, 4096), "float16")
    assert epi.check(p, "float16") is None
    simt = OPS["matmul"].family("simt")
    assert simt.check(default_params(OPS["matmul"], simt, (100, 100, 100), "float32"), "float32") is None


def test_default_wgmma_tiles_fill_the_gpu():
    from kernelmill.kernels.ops import OPS

    fam = OPS["linear"].family("wgmma")

    def tile(shape):
        p = default_params(OPS["linear"], fam, shape, "float16", sm_count=132)
        assert fam.check(p, "float16") is None
        return p["BM"], p["BN"], p["ctas"]

    assert tile((256, 4096, 11008)) == (128, 64, 0)  # 128 tiles rather than 32
    assert tile((256, 11008, 4096)) == (128, 192, 0)  # 116 tiles in one wave
    # Past one wave: a persistent grid of 128 blocks whose C tiles leave by TMA stores while the next tile runs.
    assert tile((4096, 4096, 11008)) == (128, 256, 128)  # 512 tiles: 3 rounds of 132 and 116 tiles
    assert default_params(OPS["linear"], fam, (4096, 4096, 11008), "float16", sm_count=132)["tma_store"]
    # ... of 132 blocks where its last round would hold at most half of them: 1376 tiles are 10 rounds and 56
    # tiles, each of those cut in 2 k parts (sk_tail).
    big = default_params(OPS["linear"], fam, (4096, 11008, 4096), "float16", sm_count=132)
    assert tile((4096, 11008, 4096)) == (128, 256, 132) and big["sk_tail"] and big["tma_store"]
    assert fam.sk_tail_split((4096, 11008, 4096), big) == (56, 2)
    assert not default_params(OPS["linear"], fam, (1024, 11008, 4096), "float16", sm_count=132)["sk_tail"]  # 80 left
    assert tile((512, 11008, 4096)) == (128, 192, 128)  # 232 tiles
    assert default_params(OPS["linear"], fam, (512, 11008, 4096), "float16", sm_count=132)["stages"] == 4
    assert tile((1024, 4096, 11008)) == (128, 256, 0)  # 128 tiles, one wave: a block per tile
    # A GPU with fewer SMs than the persistent grid keeps a block per tile.
    assert default_params(OPS["linear"], fam, (4096, 11008, 4096), "float16", sm_count=114)["ctas"] == 0
    # Weights larger than L2, M <= 128: one row tile, so they stream once (two 64-row tiles stream them twice)...
    assert tile((128, 4096, 11008)) == (128, 64, 0) and tile((96, 4096, 11008)) == (128, 64, 0)
    assert tile((64, 4096, 11008)) == (64, 64, 0)  # (64 rows cover M)
    # ... while weights that stay in L2 may be read by several row tiles (BERT-base's FFN at sequence 128).
    assert tile((128, 768, 3072)) == (64, 64, 0)
    # 128 x 64 tiles over weights streamed from DRAM keep 8 stages in flight, over weights in L2 6.
    stages = {
        s: default_params(OPS["linear"], fam, s, "float16")["stages"] for s in ((256, 4096, 11008), (1024, 768, 768))
    }
    assert stages == {(256, 4096, 11008): 8, (1024, 768, 768): 6}


def test_short_m_runners_up_include_a_narrow_swapped_tile_with_a_deep_ring():
    from kernelmill.kernels.defaults import default_alternatives
    from kernelmill.kernels.ops import OPS

    spec = OPS["linear"]
    fam = spec.family("wgmma")

    def narrow(shape):
        found = [
            p
            for p in default_alternatives(spec, fam, shape, "float16")[:4]  # what the runtime times in place
            if p["swap_ab"] and p["BN"] == 32
        ]
        assert all(fam.check(p, "float16") is None and p["stages"] == 10 for p in found)
        return [p["k_splits"] for p in found]

    assert narrow((32, 4096, 11008)) == [2]  # 32 tiles, in two-block clusters
    assert narrow((32, 11008, 4096)) == [1]  # 86 tiles: split, they would not fit one wave
    assert narrow((64, 4096, 11008)) == [] and narrow((32, 768, 768)) == []  # M > 32; weights in L2


def test_default_wgmma_splits_k_over_clusters_where_tiles_leave_sms_idle():
    from kernelmill.kernels.ops import OPS

    fam = OPS["linear"].family("wgmma")

    def split(shape):
        p = default_params(OPS["linear"], fam, shape, "float16", sm_count=132)
        assert fam.check(p, "float16") is None and fam.check_shape(shape, p, "float16") is None
        return fam.tiles(shape, p), p["k_splits"]

    assert split((128, 768, 3072)) == (24, 4)  # BERT-base's FFN down at batch 1: 96 blocks, not 24
    assert split((128, 768, 768)) == (24, 4)
    assert split((256, 1024, 8192)) == (64, 2)  # 3 x 64 blocks would take two waves
    assert split((128, 3072, 768)) == (96, 1)  # two blocks a tile would not fit one wave
    assert split((256, 11008, 4096)) == (116, 1)
    assert split((128, 768, 192)) == (24, 1)  # 3 k tiles: too few to share
    assert split((128, 768, 256)) == (24, 2)  # 4 k tiles: 2 each
    assert default_params(OPS["linear"], fam, (128, 768, 3072), "float16", sm_count=24)["k_splits"] == 1


def test_default_splits_count_the_clusters_the_gpcs_place_at_once():
    from kernelmill.kernels.defaults import _k_splits
    from kernelmill.kernels.ops import OPS

    fam = OPS["linear"].family("wgmma")
    # 128 x 256 tiles take a whole SM's shared memory; clusters of 4 fill only 120 of an H100's 132 SMs.
    wide = {**fam.defaults("float16"), "ctas": 0}
    shape = (256, 4096, 11008)
    assert fam.tiles(shape, wide) == 32
    assert _k_splits(fam, shape, wide, "float16", 132) == 3  # 96 blocks in one wave, not 128 in two
    # 64 x 64 tiles fit two blocks an SM: 32 tiles x 4 = 128 blocks is one wave.
    small = {**wide, "BM": 64, "BN": 64, "consumers": 1, "stages": 6}
    assert fam.tiles((64, 2048, 4096), small) == 32 and _k_splits(fam, (64, 2048, 4096), small, "float16", 132) == 4


def test_default_family_choice_by_dtype_and_shape(tmp_path):
    reg = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False)
    from kernelmill.kernels.ops import OPS

    fam, _ = reg.default_choice(OPS["matmul"], (64, 64, 64), "float16", {})
    assert fam.name == "wgmma"  # Hopper's own path on sm_90
    fam, _ = reg.default_choice(OPS["matmul"], (64, 60, 64), "float16", {})
    assert fam.name == "tensorcore"  # N % 8 != 0: TMA cannot take it
    older = KernelRegistry(arch="sm_80", cache_dir=tmp_path, use_service=False)
    assert older.default_choice(OPS["matmul"], (64, 64, 64), "float16", {})[0].name == "tensorcore"
    fam, params = reg.default_choice(OPS["linear"], (16, 4096, 4096), "float16", {"act": "gelu_tanh"})
    assert fam.name == "gemv" and params["mma"] and params["max_m"] == 16
    fam, params = reg.default_choice(OPS["linear"], (1, 4096, 4096), "bfloat16", {"act": "none"})
    assert fam.name == "gemv" and params["max_m"] == 8
    fam, params = reg.default_choice(OPS["matmul"], (3, 64, 64), "float32", {})
    assert fam.name == "gemv" and not params["mma"]  # exact fp32 FMA engine
    fam, _ = reg.default_choice(OPS["matmul"], (64, 64, 64), "float32", {})
    assert fam.name == "simt"  # exact float32, no TF32
    fam, params = reg.default_choice(OPS["fused_mlp"], (4, 64, 128, 64), "float16", {"act": "relu"})
    assert fam.name == "small_batch"
    fam, _ = reg.default_choice(OPS["fused_mlp"], (300, 64, 128, 64), "float16", {"act": "relu"})
    assert fam.name == "wgmma"  # two Hopper GEMMs on sm_90
    assert older.default_choice(OPS["fused_mlp"], (300, 64, 128, 64), "float16", {"act": "relu"})[0].name == "epilogue"


@pytest.mark.nvcc
def test_default_kernels_are_compiled_on_first_use(tmp_path, caplog):
    reg = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False)
    with caplog.at_level(logging.INFO, logger="kernelmill.runtime.registry"):
        entry = reg.get("add", (1000,), "float16")
        again = reg.get("add", (1000,), "float16")
    assert entry is again and entry.source == DEFAULT and entry.cubin and entry.launches[0].entry == "add"
    assert caplog.text.count("add 1000 float16: default") == 1
    assert (tmp_path / "cubin").exists()  # the compile cache under the registry's folder


@pytest.mark.nvcc
def test_alternatives_compile_the_defaults_runners_up_for_a_default_kernel(tmp_path, caplog):
    from kernelmill.kernels.defaults import default_alternatives
    from kernelmill.kernels.ops import OPS

    reg = KernelRegistry(arch="sm_90", cache_dir=tmp_path, use_service=False)
    shape = (256, 4096, 11008)
    entry = reg.get("linear", shape, "float16", {"act": "none"})
    assert entry.source == DEFAULT and entry.family == "wgmma"
    fam = OPS["linear"].family("wgmma")
    ranked = default_alternatives(OPS["linear"], fam, shape, "float16")
    assert ranked and entry.params not in ranked  # (128 x 128 split 2 ways first: the H200's best measured)
    with caplog.at_level(logging.INFO, logger="kernelmill.runtime.registry"):
        (stand_in,) = reg.alternatives(entry, limit=1)
    assert "linear 256x4096x11008: compiling 1 runners-up to time in place" in caplog.text  # said before it waits
    assert stand_in.params == ranked[0] and stand_in.family == "wgmma" and stand_in.source == DEFAULT
    assert stand_in.cubin and stand_in.cubin_key != entry.cubin_key and stand_in.arch == "sm_90a"
    assert stand_in.launches == fam.launches(shape, stand_in.params, "float16")
    reg.put(stand_in)
    assert reg.get("linear", shape, "float16", {"act": "none"}) is stand_in
    # Families without runners-up, and kernels a tuning job measured, get none.
    assert reg.alternatives(reg.get("add", (1000,), "float16")) == []
    entry.source = TUNED
    assert reg.alternatives(entry) == []


def test_tune_model_submits_one_job_per_op_and_attrs(service):
    config = {"vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    config.update({"intermediate_size": 64, "max_position_embeddings": 16})
    model = runtime.Model(runtime.BertModel.random(config), device="cpu")
    ids = np.arange(10).reshape(2, 5)
    jobs = runtime.tune_model(model, ids, client=service, dtype="float16", trials=4, seconds=30)
    by_op = {j["op"]: j for j in jobs}
    assert set(by_op) == {"embedding", "layernorm", "linear", "attention", "add_layernorm", "fused_mlp"}
    assert by_op["linear"]["shapes"] == [[10, 96, 32], [10, 32, 32]] and by_op["linear"]["dtype"] == "float16"
    assert by_op["fused_mlp"]["attrs"] == {"act": "gelu_erf"}
    assert by_op["attention"]["shapes"] == [[2, 2, 5, 16]]
    assert json.loads(json.dumps(by_op["layernorm"]["attrs"])) == {"eps": 1e-12}
    for job in jobs:
        assert _wait_done(service, job["id"])["state"] == "done"


def test_tune_model_refuses_a_model_with_attributes_no_kernel_takes_before_submitting(service):
    config = {"vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    config.update({"intermediate_size": 64, "max_position_embeddings": 16, "layer_norm_eps": 1e-3})
    model = runtime.Model(runtime.BertModel.random(config), device="cpu")  # NumPy takes any eps

    class Recording:
        base_url = "http://svc"
        posts = 0

        def post(self, *args, **kwargs):
            self.posts += 1
            return service.post(*args, **kwargs)

    client = Recording()
    with pytest.raises(ValueError, match=r"this model's \w*layernorm has no GPU kernel to tune \(.*eps.*0\.001"):
        runtime.tune_model(model, np.arange(10).reshape(2, 5), client=client, dtype="float16", trials=2)
    assert client.posts == 0
    # Fewer trials than a job's shapes: the service would refuse that job (each shape needs one), after others.
    config["layer_norm_eps"] = 1e-12
    model = runtime.Model(runtime.BertModel.random(config), device="cpu")
    with pytest.raises(ValueError, match=r"^trials=1 cannot try the 2 linear shapes of one job .* trials >= 2; noth"):
        runtime.tune_model(model, np.arange(10).reshape(2, 5), client=client, dtype="float16", trials=1)
    assert client.posts == 0


def test_tune_model_takes_what_forward_takes(service):
    """An MLP from random weights with a NumPy batch (and a list), as Model.forward takes them: the inputs
    go through the module's prepare (the module's forward alone got the raw array and failed)."""
    model = runtime.Model(runtime.nn.Sequential(runtime.nn.MLP.random(16, 48, 16, "gelu_tanh")), device="cpu")
    jobs = runtime.tune_model(model, np.zeros((3, 16), np.float32), client=service, dtype="float16", trials=2)
    assert [(j["op"], j["shapes"], j["dtype"], j["attrs"]) for j in jobs] == [
        ("fused_mlp", [[3, 16, 48, 16]], "float16", {"act": "gelu_tanh"})
    ]
    jobs = runtime.tune_model(model, [[0.5] * 16], client=service, trials=2)
    assert [(j["shapes"], j["dtype"]) for j in jobs] == [([[1, 16, 48, 16]], "float32")]


def test_tune_model_failures_name_the_jobs_already_submitted(service, tmp_path):
    config = {"vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    config.update({"intermediate_size": 64, "max_position_embeddings": 16})
    model = runtime.Model(runtime.BertModel.random(config), device="cpu")
    ids = np.arange(10).reshape(2, 5)

    class Refusing:
        """The service until the third job, then a 503."""

        base_url = "http://svc"
        posts = 0

        def post(self, *args, **kwargs):
            self.posts += 1
            return service.post(*args, **kwargs) if self.posts < 3 else httpx.Response(503, text="draining")

    refused = r"refused the \w+ job \(503\): not a kernelmill answer: 'draining'; submitted before it: job 1, 2"
    with pytest.raises(runtime.TuneError, match=refused):
        runtime.tune_model(model, ids, client=Refusing(), dtype="float16", trials=4, seconds=30)
    with pytest.raises(runtime.TuneError, match="cannot reach the service at http://127.0.0.1:9") as unreachable:
        runtime.tune_model(model, ids, server="http://127.0.0.1:9", dtype="float16")
    assert unreachable.value.jobs == []


@pytest.mark.parametrize(
    ("body", "what"),
    [
        (b"<html>oops</html>", "something that is not JSON: '<html>oops</html>'"),
        (b"[1, 2]", "a JSON list, not a job: '[1, 2]'"),
        (b'{"detail": "ok"}', """a JSON object without an id, not a job: '{"detail": "ok"}'"""),
        (b"x" * 100, f"something that is not JSON: '{'x' * 80}'... (100 characters)"),
    ],
)
def test_tune_model_names_an_answer_that_is_not_a_job_and_the_jobs_before_it(service, body, what):
    seq = runtime.nn.Sequential(runtime.nn.MLP.random(16, 48, 16, "relu"), runtime.nn.Linear.random(16, 8))
    model = runtime.Model(seq, device="cpu")

    class Garbling:
        """The service for the first job, then a 200 that is not a job (a proxy's page, another API)."""

        base_url = "http://svc"
        posts = 0

        def post(self, *args, **kwargs):
            self.posts += 1
            return service.post(*args, **kwargs) if self.posts < 2 else httpx.Response(200, content=body)

    with pytest.raises(runtime.TuneError) as garbled:  # was JSONDecodeError / AttributeError
        runtime.tune_model(model, np.zeros((3, 16), np.float32), client=Garbling(), trials=2)
    assert str(garbled.value) == f"the service answered the linear job (200) with {what}; submitted before it: job 1"
    assert [job["op"] for job in garbled.value.jobs] == ["fused_mlp"] and not garbled.value.unreachable


def test_tune_model_connects_within_seconds_and_bounds_each_answer(monkeypatch):
    from kernelmill.runtime import tune

    timeout = tune.submit_timeout()
    assert (timeout.connect, timeout.read, timeout.write, timeout.pool) == (3.0, 15.0, 15.0, 15.0)
    # A service that takes the connection and never answers: the read timeout, not 30 s.
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    server = f"http://127.0.0.1:{listener.getsockname()[1]}"
    monkeypatch.setattr(tune, "SUBMIT_TIMEOUT_S", 0.3)
    model = runtime.Model(runtime.nn.Sequential(runtime.nn.MLP.random(16, 48, 16, "relu")), device="cpu")
    start = time.monotonic()
    try:
        with pytest.raises(runtime.TuneError, match=f"cannot reach the service at {server}: timed out") as hung:
            runtime.tune_model(model, np.zeros((2, 16), np.float32), server=server)
    finally:
        listener.close()
    assert hung.value.unreachable and time.monotonic() - start < 5
    # One that answers a byte every 50 ms: each byte restarted httpx's read timeout, for ever.
    listener, _, server = _trickling_server(status=b"201 Created")
    start = time.monotonic()
    try:
        with pytest.raises(runtime.TuneError, match="no whole answer to /api/jobs within 0.3 s") as slow:
            runtime.tune_model(model, np.zeros((2, 16), np.float32), server=server)
    finally:
        listener.close()
    assert slow.value.unreachable and time.monotonic() - start < 5


def test_tune_model_tunes_the_dtype_a_cpu_model_was_loaded_for(service, caplog):
    mlp = runtime.nn.MLP.random(16, 48, 16, "relu")
    x = np.zeros((3, 16), np.float32)
    half = runtime.Model(runtime.nn.Sequential(mlp), device="cpu", dtype="float16")
    assert half.dtype == "float32" and half.requested_dtype == "float16"  # the CPU computes in float32
    with caplog.at_level(logging.INFO, logger="kernelmill.runtime.tune"):
        jobs = runtime.tune_model(half, x, client=service, trials=2)
    assert [job["dtype"] for job in jobs] == ["float16"]
    assert (
        "runtime: tuning float16 kernels, the dtype the model was loaded for (its cpu forward computes float32); "
        "dtype= tunes another" in caplog.messages
    )
    assert [job["dtype"] for job in runtime.tune_model(half, x, client=service, dtype="float32", trials=2)] == [
        "float32"
    ]
    plain = runtime.Model(runtime.nn.Sequential(mlp), device="cpu")
    assert [job["dtype"] for job in runtime.tune_model(plain, x, client=service, trials=2)] == ["float32"]


def test_an_excerpt_is_one_quoted_line_naming_the_whole_length():
    from kernelmill.runtime.registry import excerpt

    assert excerpt("<html>\n  <body>oops</body>\n</html>") == "'<html> <body>oops</body> </html>'"
    assert excerpt("x" * 30, 10) == "'xxxxxxxxxx'... (30 characters)"
    assert excerpt("a  b", quote=False) == "a b"
