#!/usr/bin/env python3
"""Container health checks (Docker HEALTHCHECK / compose healthcheck): exit 0 when healthy, 1 otherwise.

    healthcheck.py api                      GET /api/health on this container's service port
    healthcheck.py scheduler                the Dask scheduler's HTTP /health (dashboard port)
    healthcheck.py worker tcp://HOST:8786   this host's GPU workers (<hostname>-gpu<i>) are attached there

Standard library only for api and scheduler; worker asks the scheduler over Dask's own protocol.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.request

TIMEOUT_S = 5.0


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
        return resp.status, resp.read()


def api() -> bool:
    port = os.environ.get("KERNELMILL_PORT", "8000")
    status, body = _get(f"http://127.0.0.1:{port}/api/health")
    return status == 200 and json.loads(body).get("status") == "ok"


def scheduler() -> bool:
    port = os.environ.get("DASK_DASHBOARD_PORT", "8787")
    status, body = _get(f"http://127.0.0.1:{port}/health")
    return status == 200 and body.strip() == b"ok"


def worker(address: str) -> bool:
    import asyncio

    from distributed.core import rpc

    async def names() -> list[str]:
        async with rpc(address, timeout=TIMEOUT_S) as sched:
            info = await asyncio.wait_for(sched.identity(), TIMEOUT_S)
        return [str(w.get("name")) for w in info.get("workers", {}).values()]

    prefix = f"{socket.gethostname()}-gpu"
    return any(name.startswith(prefix) for name in asyncio.run(names()))


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["api"]:
            ok = api()
        elif argv[:1] == ["scheduler"]:
            ok = scheduler()
        elif argv[:1] == ["worker"] and len(argv) == 2:
            ok = worker(argv[1])
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy", with the reason
        print(f"unhealthy: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if not ok:
        print("unhealthy", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
