"""What the API refuses: writes without the token, bodies over the limit (also chunked), and CUDA source."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn

from kernelmill.service.app import create_app
from kernelmill.settings import Settings
from tests.api.conftest import SOFTMAX_JOB, make_client

LIMIT = 64 * 1024
TOKEN = "s3cret-token"


def write_operations(client) -> list[tuple[str, str]]:
    """Every operation the schema lists that is not a read, with its path ids filled in."""
    ops = []
    for path, item in client.app.openapi()["paths"].items():
        for method in item:
            if method.lower() not in ("get", "head", "options"):
                ops.append((method.upper(), path.replace("{job_id}", "1").replace("{kernel_id}", "1")))
    return ops


# -- the write token -------------------------------------------------------------------------------


def test_every_write_needs_the_token(tmp_path):
    with make_client(tmp_path, api_token=TOKEN) as client:
        writes = write_operations(client)
        assert ("POST", "/api/jobs") in writes and ("POST", "/api/jobs/1/cancel") in writes
        refused = [
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Bearer {TOKEN}x"},
            {"Authorization": f"Basic {TOKEN}"},
            {"Authorization": TOKEN},
            {"X-Api-Token": TOKEN},
        ]
        for method, path in writes:
            for headers in refused:
                resp = client.request(method, path, json=SOFTMAX_JOB, headers=headers)
                assert resp.status_code == 401, (method, path, headers, resp.text)
                assert resp.headers["www-authenticate"] == "Bearer" and "KERNELMILL_API_TOKEN" in resp.json()["detail"]
            # Not a token in the query string either, and a malformed body is refused before it is read.
            assert client.request(method, path, params={"token": TOKEN}, json=SOFTMAX_JOB).status_code == 401
            assert client.request(method, path, content=b"{not json").status_code == 401
        ok = {"Authorization": f"Bearer {TOKEN}"}
        job = client.post("/api/jobs", json=SOFTMAX_JOB, headers=ok)
        assert job.status_code == 201
        assert client.post(f"/api/jobs/{job.json()['id']}/cancel", headers=ok).status_code in (200, 409)
        assert client.post("/api/jobs", json={**SOFTMAX_JOB, "op": "conv"}, headers=ok).status_code == 422


def test_reads_stay_open_when_a_token_is_set(tmp_path):
    with make_client(tmp_path, api_token=TOKEN) as client:
        for path, item in client.app.openapi()["paths"].items():
            if "get" in item and "{" not in path and path != "/api/kernels/best":
                assert client.get(path).status_code == 200, path


def test_another_site_cannot_write_through_a_browser(client):
    """Without a token, a page of another site (or another port: cookies and sites ignore ports) could have a
    visitor's browser post a form to the cancel route: a simple request, no preflight. Browsers say where a
    request comes from in Sec-Fetch-Site; one from elsewhere is refused, one from the service's own pages
    (/docs) or typed in is not, and clients that send no such header (the CLI, curl) are not either."""
    job = client.post("/api/jobs", json=SOFTMAX_JOB).json()
    form = {"Content-Type": "application/x-www-form-urlencoded", "Origin": "https://evil.example"}
    for site in ("cross-site", "same-site"):
        resp = client.post(f"/api/jobs/{job['id']}/cancel", content=b"", headers={**form, "Sec-Fetch-Site": site})
        assert resp.status_code == 403, (site, resp.text)
        assert "another site" in resp.json()["detail"]
        resp = client.post("/api/jobs", json=SOFTMAX_JOB, headers={"Sec-Fetch-Site": site})
        assert resp.status_code == 403, (site, resp.text)
    after = client.get(f"/api/jobs/{job['id']}").json()
    assert after["state"] != "cancelled" and not after["cancel_requested"]
    for site in ("same-origin", "none"):
        assert client.post("/api/jobs", json=SOFTMAX_JOB, headers={"Sec-Fetch-Site": site}).status_code == 201
    assert client.post(f"/api/jobs/{job['id']}/cancel").status_code in (200, 409)


def test_no_other_methods(client):
    for path in ("/api/jobs", "/api/jobs/1", "/api/kernels", "/api/kernels/1", "/api/health"):
        for method in ("PUT", "PATCH", "DELETE"):
            assert client.request(method, path).status_code == 405, (method, path)


# -- body size -------------------------------------------------------------------------------------


def padded_job(size: int) -> bytes:
    """A valid job submission, padded with JSON whitespace to exactly ``size`` bytes."""
    body = json.dumps(SOFTMAX_JOB).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


def test_body_over_the_limit_is_413_and_at_the_limit_accepted(client):
    headers = {"content-type": "application/json"}
    for path in ("/api/jobs", "/api/jobs/1/cancel"):
        resp = client.post(path, content=padded_job(LIMIT + 1), headers=headers)
        assert resp.status_code == 413 and str(LIMIT) in resp.json()["detail"], path
    assert client.post("/api/jobs", content=padded_job(LIMIT), headers=headers).status_code == 201


def test_chunked_body_over_the_limit_is_413_in_process(client):
    """No Content-Length: the body is counted as it arrives, and refused once past the limit."""

    def chunks(body: bytes, size: int = 4096):
        for i in range(0, len(body), size):
            yield body[i : i + size]

    headers = {"content-type": "application/json"}
    resp = client.post("/api/jobs", content=chunks(padded_job(LIMIT + 4096)), headers=headers)
    assert resp.status_code == 413
    resp = client.post("/api/jobs", content=chunks(padded_job(LIMIT)), headers=headers)
    assert resp.status_code == 201, resp.text


@pytest.fixture
def live_url(tmp_path):
    """The app under uvicorn on a loopback port (a real HTTP/1.1 server, chunked transfer included)."""
    settings = Settings(database_url=f"sqlite:///{tmp_path}/live.db", executor="fake", fake_workers=1)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(create_app(settings), log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield sock.getsockname()
    server.should_exit = True
    thread.join(10)
    sock.close()


def raw_chunked_post(addr, path: str, body: bytes, chunk: int = 8192) -> int:
    """POST with Transfer-Encoding: chunked over a plain socket; the response's status code."""
    with socket.create_connection(addr, timeout=10) as conn:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {addr[0]}:{addr[1]}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        try:
            conn.sendall(head.encode())
            for i in range(0, len(body), chunk):
                part = body[i : i + chunk]
                conn.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            conn.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before the whole body went out
        reply = b""
        while b"\r\n" not in reply:
            data = conn.recv(4096)
            if not data:
                break
            reply += data
    return int(reply.split(b" ", 2)[1])


def test_chunked_body_over_the_limit_is_413_over_http(live_url):
    assert raw_chunked_post(live_url, "/api/jobs", padded_job(4 * LIMIT)) == 413
    assert raw_chunked_post(live_url, "/api/jobs", padded_job(LIMIT + 1)) == 413
    assert raw_chunked_post(live_url, "/api/jobs", padded_job(2048)) == 201


# -- no CUDA source in, ever --------------------------------------------------------------------------

CUDA = 'extern "C" __global__ void pwn(float* x) { x[threadIdx.x] = 0; }'


def test_the_schema_has_no_field_for_source(client):
    """Request bodies name an op, shapes, a dtype, a strategy, attributes, families (names of registered
    templates) and a budget; nothing else."""
    spec = client.app.openapi()
    schemas = spec["components"]["schemas"]
    bodies = []
    for item in spec["paths"].values():
        for op in item.values():
            content = op.get("requestBody", {}).get("content", {})
            bodies += [media["schema"]["$ref"].rsplit("/", 1)[1] for media in content.values()]
    assert bodies == ["JobCreate"]
    job = schemas["JobCreate"]
    assert set(job["properties"]) == {"op", "shapes", "dtype", "arch", "strategy", "attrs", "families", "budget"}
    assert job["additionalProperties"] is False and schemas["Budget"]["additionalProperties"] is False
    scalars = [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}]
    assert job["properties"]["attrs"]["additionalProperties"] == {"anyOf": scalars}  # values, never objects


@pytest.mark.parametrize(
    "change",
    [
        {"source": CUDA},
        {"cuda_source": CUDA},
        {"template": CUDA},
        {"cubin": "f0VMRgIBAQ=="},
        {"family": "block_row", "params": {"code": CUDA}},
        {"budget": {"trials": 8, "seconds": 60, "source": CUDA}},
    ],
)
def test_a_job_with_source_is_422(client, change):
    resp = client.post("/api/jobs", json={**SOFTMAX_JOB, **change})
    assert resp.status_code == 422, resp.text
    assert "Extra inputs are not permitted" in resp.json()["detail"]
    assert client.get("/api/jobs").json()["total"] == 0


def test_attributes_and_ops_are_names_not_code(client):
    mlp = {"op": "fused_mlp", "shapes": [[64, 256, 1024, 256]], "dtype": "float16", "budget": {"trials": 4}}
    for attrs in ({"act": CUDA}, {"act": "relu", "epilogue": CUDA}):
        resp = client.post("/api/jobs", json={**mlp, "attrs": attrs})
        assert resp.status_code == 422 and "act" in resp.json()["detail"], resp.text
    assert client.post("/api/jobs", json={**SOFTMAX_JOB, "op": CUDA}).status_code == 422
    assert client.post("/api/jobs", json={**SOFTMAX_JOB, "strategy": CUDA}).status_code == 422
    raw = client.post("/api/jobs", content=CUDA.encode(), headers={"content-type": "text/x-cuda"})
    assert raw.status_code == 415 and "send it as JSON" in raw.json()["detail"]
    assert client.get("/api/jobs").json()["total"] == 0
    assert client.post("/api/jobs", json={**mlp, "attrs": {"act": "relu"}}).status_code == 201


def test_head_is_answered_as_get_without_a_body(client):
    """HEAD was 405 on every route (monitors and curl -I use it)."""
    for url in ("/api/health", "/api/jobs", "/", "/jobs"):
        got, head = client.get(url), client.head(url)
        assert head.status_code == got.status_code == 200 and head.content == b"", url
        assert head.headers["content-type"] == got.headers["content-type"], url
    assert client.head("/api/jobs/999").status_code == 404


def test_a_database_that_fails_is_a_503_saying_so_not_a_bare_500(client, monkeypatch):
    """A PostgreSQL server gone (or restarting) answered every route with a plain-text 500 "Internal Server
    Error", health checks included: now a 503 (retried by clients and monitors) with the database's reason."""
    from sqlalchemy.exc import OperationalError

    store = client.app.state.store

    def gone(*args, **kwargs):
        raise OperationalError("SELECT", {}, Exception("server closed the connection unexpectedly\nmore"))

    for name in ("list_jobs", "get_job", "served_shapes", "served_fingerprint", "summaries"):
        monkeypatch.setattr(store, name, gone)
    for url in ("/api/health", "/api/jobs", "/api/jobs/1", "/api/kernels/best?op=layernorm&shape=8x8"):
        resp = client.get(url)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "5", (url, resp.text)
        assert resp.json() == {"detail": "the database is unavailable: server closed the connection unexpectedly"}
