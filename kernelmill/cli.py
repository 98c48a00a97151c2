"""The ``kernelmill`` command line (typer). Bad input: one line on stderr and exit code 2.

Exit codes: 1 the work failed, 2 bad input, 3 no GPU (or nvcc) here, or a server or database that does not
answer, 4 no profiler (nsys) here, 5 the profiler ran but produced no report, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from functools import wraps
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from kernelmill import __version__
from kernelmill.kernels.compile import (
    MB,
    CompileError,
    Compiler,
    NvccMissing,
    normalize_arch,
    too_old,
    unknown_gpu,
)
from kernelmill.kernels.ops import OPS, get_op
from kernelmill.kernels.ops.base import DTYPES, SpecError, format_shape, numpy_dtype
from kernelmill.kernels.render import RenderError


class _Commands(TyperGroup):
    """Click's own usage errors (an unknown command or option, a missing one, a value that is not a number) as one
    line, ``error: ...`` with exit code 2, like kernelmill's bad input (typer drew them as a usage line, a hint and a
    boxed message); Ctrl-C as one line and exit code 130 (typer exited silently)."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except OSError as exc:  # what no command catches: stdout on a full disk (ENOSPC), say; EPIPE is typer's
            where = f" ({exc.filename})" if exc.filename else ""
            raise SystemExit(fail(f"{exc.strerror or exc}{where}", 1).exit_code) from None
        except typer.Abort:  # input ended at a prompt
            raise SystemExit(fail("aborted", 1).exit_code) from None
        except typer.TyperException as exc:  # click's ClickException, UsageError and their kind
            if type(exc).__name__ == "NoArgsIsHelpError":  # the help is printed: only the exit code is left
                raise SystemExit(exc.exit_code) from None
            ctx = getattr(exc, "ctx", None)
            see = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            raise SystemExit(fail(f"{exc.format_message()}{see}", exc.exit_code).exit_code) from None
        if code == EXIT_INTERRUPTED:  # typer's answer to KeyboardInterrupt; no command exits so itself
            fail("interrupted", EXIT_INTERRUPTED)
        raise SystemExit(code if isinstance(code, int) else 0)


app = typer.Typer(
    name="kernelmill",
    help="Generate, tune and serve CUDA kernels.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    cls=_Commands,
)
#: Columns of tables written to a pipe or a file (a log, `| tee`), where rich would otherwise assume 80 and
#: cut the cells of wide tables (`kernelmill kernels`) to "line…"; a terminal, or COLUMNS, sets its own.
PIPED_WIDTH = 160


def _console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    piped = not stream.isatty() and not os.environ.get("COLUMNS")
    return Console(stderr=stderr, width=PIPED_WIDTH if piped else None)


console = _console()
err_console = _console(stderr=True)

EXIT_USAGE = 2  # bad input
EXIT_UNAVAILABLE = 3  # the machine lacks what the command needs (GPU, nvcc), or a service does not answer
EXIT_NO_PROFILER = 4  # nsys (Nsight Systems) is not installed
EXIT_NO_REPORT = 5  # the profiler ran but wrote no usable report
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it)


def fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def user_errors(fn: Callable) -> Callable:
    """Turn domain errors into a one-line message and an exit code, never a traceback."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        from kernelmill.kernels.device import GpuUnavailable

        try:
            return fn(*args, **kwargs)
        except (SpecError, RenderError, ValueError) as exc:
            # A server or database that does not answer is unavailable, like a missing GPU: 3; bad input: 2.
            raise fail(str(exc), EXIT_UNAVAILABLE if getattr(exc, "unreachable", False) else EXIT_USAGE) from None
        except GpuUnavailable as exc:
            raise fail(
                f"no GPU here ({exc}). `kernelmill render` and `kernelmill compile` still work without one, and "
                "`tune --server URL` sends the job to a service with GPU workers.",
                EXIT_UNAVAILABLE,
            ) from None
        except MemoryError as exc:  # numpy's says what it could not allocate: sizes too large for this host
            raise fail(f"not enough memory on this host: {exc or 'an allocation failed'}; ask for less") from None

    return wrapper


def parse_pairs(pairs: list[str] | None, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SpecError(f"malformed {what} {pair!r}: expected NAME=VALUE")
        if key.strip() in out:
            raise SpecError(f"{what} {key.strip()} given twice")
        out[key.strip()] = value.strip()
    return out


def _variant(
    op: str,
    family: str,
    dtype: str,
    params: list[str] | None,
    attrs: list[str] | None,
    shape: tuple[int, ...] | None = None,
    sm_count: int | None = None,
):
    """A variant from --param / --attr pairs over the family's defaults: for a given shape the ones the runtime
    and tuning jobs start from (kernels.defaults.default_params), else the family's plain defaults."""
    from kernelmill.kernels.defaults import DEFAULT_SM_COUNT, default_params
    from kernelmill.kernels.ops import get_op
    from kernelmill.kernels.variant import Variant

    overrides = parse_pairs(params, "--param")
    if shape is not None:
        spec = get_op(op)
        spec.check_dtype(dtype)
        base = default_params(spec, spec.family(family), shape, dtype, sm_count or DEFAULT_SM_COUNT)
        overrides = {**base, **overrides}
    return Variant.create(op, family, dtype, overrides, parse_pairs(attrs, "--attr"))


ParamOpt = Annotated[list[str] | None, typer.Option("--param", "-p", help="template knob NAME=VALUE (repeatable)")]
AttrOpt = Annotated[list[str] | None, typer.Option("--attr", help="op attribute NAME=VALUE, e.g. act=relu")]
DtypeOpt = Annotated[str, typer.Option("--dtype", "-d", help=f"one of {', '.join(DTYPES)}")]
OpArg = Annotated[str, typer.Argument(help="the op, e.g. softmax (`kernelmill ops` lists them)", show_default=False)]


@app.command()
def version() -> None:
    """Print the version."""
    console.print(__version__)


def _print_version(asked: bool) -> None:
    if asked:
        console.print(__version__)
        raise typer.Exit()


@app.callback()
def _options(
    show_version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Generate, tune and serve CUDA kernels."""


@app.command()
@user_errors
def ops(as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False) -> None:
    """List ops with their families, dtypes and parameter-space sizes."""
    listing = []
    for op in OPS.values():
        families = []
        for fam in op.families.values():
            families.append(
                {
                    "name": fam.name,
                    "description": fam.description,
                    "dtypes": list(fam.dtypes),
                    "params": {p.name: list(p.values) for p in fam.params},
                    "space_size": {dt: fam.space_size(dt) for dt in fam.dtypes},
                }
            )
        listing.append(
            {
                "op": op.name,
                "shape": "x".join(op.dims),
                "dtypes": [dt for dt in DTYPES if any(dt in fam.dtypes for fam in op.families.values())],
                "attributes": {a.name: list(a.values) for a in op.attributes},
                "families": families,
            }
        )
    if as_json:
        typer.echo(json.dumps(listing, indent=2))
        return
    table = Table(title="kernelmill ops")
    for col in ("op", "shape", "family", "dtypes", "space size"):
        table.add_column(col, overflow="fold")
    for entry in listing:
        for fam in entry["families"]:
            sizes = " ".join(f"{k}:{v}" for k, v in fam["space_size"].items())
            table.add_row(entry["op"], entry["shape"], fam["name"], ",".join(fam["dtypes"]), sizes)
    console.print(table)


@app.command()
@user_errors
def render(
    op: OpArg,
    family: Annotated[str, typer.Option("--family", "-f", help="template family")],
    dtype: DtypeOpt = "float16",
    param: ParamOpt = None,
    attr: AttrOpt = None,
) -> None:
    """Print the CUDA source of one variant."""
    typer.echo(_variant(op, family, dtype, param, attr).source)


@app.command()
@user_errors
def compile(  # noqa: A001 - the command's name
    op: OpArg,
    family: Annotated[str, typer.Option("--family", "-f", help="template family (`kernelmill ops` lists them)")],
    dtype: DtypeOpt = "float16",
    param: ParamOpt = None,
    attr: AttrOpt = None,
    arch: Annotated[str | None, typer.Option(help="target, e.g. sm_90 (default: this GPU's, else sm_90)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="the report as JSON on stdout")] = False,
) -> None:
    """Compile one variant with nvcc and print the ptxas report (or the compile error)."""
    variant = _variant(op, family, dtype, param, attr)
    target = normalize_arch(arch) if arch else None
    if target and (why := too_old(target) or unknown_gpu(target)):  # nvcc would fail on it: exit 1, not 2
        raise SpecError(why)
    try:
        compiled = variant.compile(Compiler(), target)
    except NvccMissing as exc:
        raise fail(str(exc), EXIT_UNAVAILABLE) from None
    except CompileError as exc:
        if as_json:
            typer.echo(json.dumps({"ok": False, "error": str(exc).splitlines()[0], "log": exc.log}, indent=2))
        else:
            err_console.print(f"[bold red]compile error:[/] {escape(str(exc))}", highlight=False)
        raise typer.Exit(1) from None
    report = {"ok": True, "variant": variant.describe(), **compiled.report()}
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    table = Table(title=f"{variant.describe()} on {compiled.arch}{' (cached)' if compiled.cached else ''}")
    for col in ("kernel", "registers", "smem B", "stack B", "spill st B", "spill ld B"):
        table.add_column(col, overflow="fold")
    for name, res in compiled.resources.items():
        table.add_row(
            name,
            *(str(v) for v in (res.registers, res.smem_bytes, res.stack_bytes, res.spill_stores_bytes)),
            str(res.spill_loads_bytes),
        )
    console.print(table)


@app.command()
@user_errors
def bench(
    op: OpArg,
    shape: Annotated[str, typer.Option("--shape", "-s", help="e.g. 8192x8192 (dims: see `kernelmill ops`)")],
    dtype: DtypeOpt = "float16",
    family: Annotated[str | None, typer.Option("--family", "-f", help="default: every family")] = None,
    param: ParamOpt = None,
    attr: AttrOpt = None,
    seeds: Annotated[
        int, typer.Option(min=1, help="random input sets to verify on (at least one per kind of input the op draws)")
    ] = 3,
    reps: Annotated[int, typer.Option(min=1, help="timed repetitions")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="the report as JSON on stdout")] = False,
) -> None:
    """Verify then time variants on this GPU, next to PyTorch and the roofline floor.

    Each family runs at its shape defaults (what the runtime runs untuned), --param on top."""
    from kernelmill.kernels.bench import L2Flusher, ceilings, time_torch
    from kernelmill.kernels.device import get_device
    from kernelmill.kernels.evaluate import evaluate

    spec = get_op(op)
    spec.check_dtype(dtype)
    dims = spec.parse_shape(shape)
    if param and not family:
        raise SpecError("--param needs --family")
    names = [family] if family else [name for name, fam in spec.families.items() if dtype in fam.dtypes]
    if not names:  # bad input, before "no GPU" is said
        raise SpecError(f"no {op} family supports {dtype}")
    # Each family at the shape defaults (what runs untuned), with --param on top: checked before the GPU is
    # looked for, then sized for its SM count.
    variants = [_variant(op, name, dtype, param, attr, dims) for name in names]
    device = get_device()
    variants = [_variant(op, name, dtype, param, attr, dims, device.info.sm_count) for name in names]
    compiler = Compiler()
    flusher = L2Flusher(device)
    # The precisions the variants compute in (float32 and, for TF32 variants, TF32): a matrix rate and a
    # PyTorch baseline each.
    precisions = sorted({v.precision for v in variants}, key=lambda p: p != dtype)
    ceil = ceilings(device, tuple(sorted({*precisions, dtype})) if spec.matrix_bound else ())
    floor_ms = ceil.floor_ms(spec, dims, dtype)
    rows = []
    for variant in variants:
        with _status(f"{variant.describe()}: compile, verify, time"):
            ev = evaluate(variant, dims, device, compiler, seeds=seeds, reps=reps, flusher=flusher)
        rows.append(ev)
        if ev.poisoned:
            break
    inputs = spec.make_inputs(dims, dtype, seed=0)
    torch_timings = {}  # by precision: a TF32 variant is compared with PyTorch in TF32
    for precision in precisions:
        with _status(f"PyTorch baseline ({precision})"):
            torch_timings[precision] = time_torch(
                device, spec, inputs, variants[0].attrs, flusher, reps=reps, precision=precision
            )
    report = _bench_report(spec, dims, dtype, device.info.name, ceil, floor_ms, rows, torch_timings)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        _print_bench(report)
    if not any(ev.ok for ev in rows):
        raise typer.Exit(1)


@contextlib.contextmanager
def _status(what: str) -> Iterator[None]:
    """Rich's spinner on a terminal; elsewhere (a log, a pipe) a plain line as the step starts: the spinner draws
    nothing there, and a bench of every family was minutes of silence. On stderr: stdout is the report (--json)."""
    if err_console.is_terminal:
        with err_console.status(Text(what)):
            yield
    else:
        err_console.print(f"{what} ...", markup=False, highlight=False, soft_wrap=True)
        yield


def _bench_report(spec, dims, dtype, device_name, ceil, floor_ms, rows, torch_timings) -> dict[str, Any]:
    nbytes, flops = spec.min_bytes(dims, dtype), spec.flops(dims)
    torch_timing = torch_timings.get(dtype)
    out = {
        "op": spec.name,
        "shape": format_shape(dims),
        "dtype": dtype,
        "device": device_name,
        "copy_gbps": round(ceil.copy_gbps, 1),
        "matrix_tflops": {k: round(v, 1) for k, v in ceil.matrix_tflops.items()},
        "floor_ms": floor_ms,
        "torch": torch_timing.to_dict() if torch_timing else None,
        # PyTorch in each precision a variant computes in (float32 and, for TF32 variants, TF32)
        "torch_by_precision": {p: t.to_dict() for p, t in torch_timings.items() if t},
        "variants": [],
    }
    for ev in rows:
        entry: dict[str, Any] = {
            "variant": ev.variant.describe(),
            "family": ev.variant.family.name,
            "params": ev.variant.params,
            "status": ev.status,
            "reason": ev.reason,
        }
        if ev.verification:
            entry["precision"] = ev.verification.precision
            entry["max_rel_err_per_seed"] = {str(k): v for k, v in ev.verification.per_seed().items()}
            entry["allowance_used"] = ev.verification.allowance_used
        if ev.timing:
            ms = ev.timing.median_ms
            baseline = torch_timings.get(ev.variant.precision)
            torch_ms = baseline.median_ms if baseline else None
            entry.update(
                timing=ev.timing.to_dict(),
                gbps=nbytes / (ms * 1e-3) / 1e9,
                tflops=flops / (ms * 1e-3) / 1e12,
                pct_of_floor=100.0 * ceil.floor_ms(spec, dims, dtype, ev.variant.precision) / ms,
                speedup_vs_torch=(torch_ms / ms) if torch_ms else None,
            )
        out["variants"].append(entry)
    return out


def _print_bench(report: dict[str, Any]) -> None:
    title = f"{report['op']} {report['shape']} {report['dtype']} on {report['device']}"
    table = Table(title=title)
    columns = ("family", "status", "max rel err", "worst elem", "median us", "spread", "GB/s", "TFLOP/s", "% floor")
    for col in (*columns, "vs torch"):
        table.add_column(col, justify="right" if col not in ("family", "status") else "left", overflow="fold")
    for v in report["variants"]:
        errs = v.get("max_rel_err_per_seed") or {}
        err = f"{max(errs.values()):.2e}" if errs else ""
        used = v.get("allowance_used")  # of the per-element error allowance, by the worst element
        worst = f"{100 * used:.0f}%" if used is not None else ""
        if "timing" not in v:
            table.add_row(v["family"], f"[red]{v['status']}[/]", err, worst, "", "", "", "", "", "")
            continue
        speedup = v["speedup_vs_torch"]
        table.add_row(
            v["family"],
            "[green]ok[/]",
            err,
            worst,
            f"{v['timing']['median_ms'] * 1e3:.1f}",
            f"{100 * v['timing']['spread']:.1f}%",
            f"{v['gbps']:.0f}",
            f"{v['tflops']:.2f}",
            f"{v['pct_of_floor']:.0f}%",
            f"{speedup:.2f}x" if speedup else "n/a",
        )
    for precision, torch_t in report["torch_by_precision"].items():
        table.add_row(
            "torch" if precision == report["dtype"] else f"torch ({precision})",
            "baseline",
            "",
            "",
            f"{torch_t['median_ms'] * 1e3:.1f}",
            f"{100 * torch_t['spread']:.1f}%",
            "",
            "",
            f"{100 * report['floor_ms'] / torch_t['median_ms']:.0f}%",
            "1.00x",
        )
    console.print(table)
    if len(report["torch_by_precision"]) > 1:
        console.print("each variant is compared with PyTorch in the precision it computes in")
    ceilings = f"copy {report['copy_gbps']:.0f} GB/s"
    if report["matrix_tflops"]:
        ceilings += ", matrix " + ", ".join(f"{k} {v:.0f} TFLOP/s" for k, v in report["matrix_tflops"].items())
    console.print(f"roofline floor {report['floor_ms'] * 1e3:.1f} us (measured {ceilings})")
    for v in report["variants"]:
        console.print(f"  {v['family']}: " + " ".join(f"{k}={p}" for k, p in v["params"].items()), highlight=False)
        if v["reason"]:
            console.print(f"[red]{escape(v['variant'])}[/]: {escape(v['reason'])}", highlight=False)


# -- service commands ----------------------------------------------------------------------


def _server_option(value: str | None) -> str | None:
    """--server (or KERNELMILL_SERVER) checked as it is parsed: a malformed URL is one line and exit 2."""
    from kernelmill.client import ServerError, server_url
    from kernelmill.settings import default_server

    # A bad KERNELMILL_SERVER is named as such: "malformed server URL" alone sent users looking for a --server
    # they had not given.
    from_env = value is None or value == os.environ.get("KERNELMILL_SERVER")
    value = value or default_server()  # typer reads the environment; .env is the settings'
    if not value:
        return None
    try:
        return server_url(value)
    except ServerError as exc:
        raise fail(f"KERNELMILL_SERVER: {exc}" if from_env else str(exc)) from None


ServerOpt = Annotated[
    str | None,
    typer.Option(
        "--server",
        envvar="KERNELMILL_SERVER",
        callback=_server_option,
        help="kernelmill service URL, e.g. http://127.0.0.1:8000",
    ),
]


def _check_listen(host: str, port: int) -> None:
    """Fails (exit 3) unless this process can listen on host:port, before the service starts its cluster."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.create_server((host, port), family=family):
            pass
    except OSError as exc:
        raise fail(f"cannot listen on {host}:{port}: {exc.strerror or exc}", EXIT_UNAVAILABLE) from None


#: How long `serve` and `worker` wait for a Dask scheduler that refuses connections before they give up.
SCHEDULER_WAIT_S = 10.0


def _check_scheduler(address: str) -> None:
    """Fails (exit 3) when a tcp:// Dask scheduler address does not accept connections within SCHEDULER_WAIT_S
    (Dask itself waits 20 s, then the service dies with a traceback), or something else answers there; other
    schemes are bad input (exit 2)."""
    import socket
    import time
    from urllib.parse import urlsplit

    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    if parts.scheme != "tcp":  # tls:// needs a security config kernelmill does not pass; the others crashed the start
        raise fail(f"scheduler address {address!r}: kernelmill joins Dask schedulers over tcp:// only")
    try:
        host, port = parts.hostname, parts.port or 8786
    except ValueError:
        raise fail(f"malformed scheduler address {address!r}; expected tcp://HOST:PORT") from None
    if not host:
        raise fail(f"malformed scheduler address {address!r}; expected tcp://HOST:PORT")
    deadline = time.monotonic() + SCHEDULER_WAIT_S  # a scheduler starting beside this process gets that long
    while True:
        try:
            socket.create_connection((host, port), timeout=5.0).close()
            break
        except OSError as exc:
            if time.monotonic() >= deadline:
                why = exc.strerror or exc
                message = f"cannot reach the Dask scheduler at {address} (tried for {SCHEDULER_WAIT_S:g} s): {why}"
                raise fail(message, EXIT_UNAVAILABLE) from None
        time.sleep(0.5)
    # Something listens there; another server (or a silent socket) would leave Dask waiting for ever.
    if why := _not_a_scheduler(f"tcp://{host}:{port}" if ":" not in host else f"tcp://[{host}]:{port}"):
        raise fail(f"{address} is not a Dask scheduler: {why}", EXIT_UNAVAILABLE)


def _not_a_scheduler(address: str, timeout_s: float | None = None) -> str | None:
    """None when a Dask scheduler answers Dask's handshake and ``identity`` at ``address`` within
    ``timeout_s`` (default SCHEDULER_WAIT_S); else what answered instead, in words."""
    import asyncio

    from distributed.comm import connect

    timeout_s = SCHEDULER_WAIT_S if timeout_s is None else timeout_s

    async def identity() -> object:
        comm = await connect(address, timeout=timeout_s)
        try:
            await comm.write({"op": "identity", "reply": True})
            return await comm.read()
        finally:
            comm.abort()

    try:
        answer = asyncio.run(asyncio.wait_for(identity(), timeout_s))
    except TimeoutError:
        return f"no Dask answer within {timeout_s:g} s"
    except (MemoryError, OverflowError):  # its first bytes read as a frame length of exabytes: an HTTP answer, say
        return "it does not speak Dask's protocol (its answer is no Dask message: a web server, say)"
    except Exception as exc:  # noqa: BLE001 - whatever the peer did to Dask's protocol, in one line
        said = str(exc).splitlines()[0] if str(exc) else ""
        return f"it does not speak Dask's protocol ({type(exc).__name__}: {said})"
    kind = answer.get("type") if isinstance(answer, dict) else None
    return None if kind == "Scheduler" else f"it answers as {kind or 'something else'}, not as a scheduler"


@app.command()
@user_errors
def serve(
    host: Annotated[str | None, typer.Option(help="bind address (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default 8000)", min=1, max=65535)] = None,
    scheduler: Annotated[str | None, typer.Option(help="existing Dask scheduler, tcp://HOST:8786")] = None,
    access_log: Annotated[
        bool | None, typer.Option("--access-log/--no-access-log", help="a log line per request (default on)")
    ] = None,
) -> None:
    """Run the REST service with its job runner (a local Dask cluster, one worker per GPU)."""
    import gc

    import uvicorn

    from kernelmill.service.app import create_app
    from kernelmill.service.db.store import Store
    from kernelmill.settings import get_settings

    given = {"host": host, "port": port, "scheduler": scheduler, "access_log": access_log}
    settings = get_settings().model_copy(update={k: v for k, v in given.items() if v is not None})
    if not settings.host.strip():  # uvicorn takes "" for every interface: say 0.0.0.0 if that is meant
        raise fail("--host (KERNELMILL_HOST) is empty: give an address, 0.0.0.0 for every interface")
    _check_listen(settings.host, settings.port)
    Store(settings.database_url).close()  # opened and migrated: DatabaseError (one line) before the service starts
    if settings.scheduler:
        _check_scheduler(settings.scheduler)
    shown = f"[{settings.host}]" if ":" in settings.host else settings.host  # an IPv6 address in a URL
    console.print(f"kernelmill {__version__} serving on http://{shown}:{settings.port} (docs at /docs)")
    # One process: the job runner and the GPU workers belong to it (several uvicorn workers would each start
    # their own). uvicorn picks httptools and uvloop, both dependencies, over its pure-Python h11 and asyncio.
    app = create_app(settings)
    # What the imports built lives as long as the process: out of the collector's sight, a full collection
    # scans only what came later (~100 ms stalls of every request become a few ms on two cores).
    gc.collect()
    gc.freeze()
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="info",
        log_config=serve_log_config(),
        access_log=settings.access_log,
    )


def serve_log_config() -> dict:
    """uvicorn's logging, with kernelmill's own INFO lines (jobs resumed, plateaus, budgets spent, workers
    replaced) through the same handler: without one they would go unseen (Python's last resort shows warnings
    only)."""
    from copy import deepcopy

    from uvicorn.config import LOGGING_CONFIG

    config = deepcopy(LOGGING_CONFIG)
    config["loggers"]["kernelmill"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


@app.command()
@user_errors
def worker(
    scheduler: Annotated[str, typer.Option(help="Dask scheduler to join, tcp://HOST:8786")],
    gpus: Annotated[int | None, typer.Option(help="GPUs to serve (default: all visible)")] = None,
    stop_grace: Annotated[
        float | None,
        typer.Option(help="seconds a task in flight may run on after SIGTERM before it is handed back (default 45)"),
    ] = None,
) -> None:
    """Start one GPU worker process per local GPU, joining an existing scheduler.

    SIGTERM (`docker stop`) lets each GPU's task in flight finish (within --stop-grace), then closes the workers."""
    import asyncio
    import math

    from kernelmill.service.executor import STOP_GRACE_S, run_workers

    if stop_grace is not None and not (math.isfinite(stop_grace) and stop_grace >= 0):
        raise fail(f"--stop-grace must be a number of seconds, 0 or more, not {stop_grace:g}")

    if gpus is not None and gpus < 1:  # bad input first: not after seconds of waiting for the scheduler
        raise fail(f"--gpus must be at least 1, not {gpus}")
    _check_scheduler(scheduler)
    try:
        asyncio.run(run_workers(scheduler, gpus, STOP_GRACE_S if stop_grace is None else stop_grace))
    except ValueError as exc:
        raise fail(str(exc), EXIT_USAGE) from None
    except RuntimeError as exc:
        raise fail(str(exc), EXIT_UNAVAILABLE) from None


StrategyOpt = Annotated[
    str, typer.Option(help="exhaustive, random, evolutionary, guided (profile-guided, warm-started) or llm")
]


#: The job fields a JobError names first, as tune's options name them.
_TUNE_OPTIONS = {"budget.trials": "--budget", "budget.seconds": "--seconds", "shapes": "--shape"}


def _as_tune_options(message: str) -> str:
    """A JobError's message with the job field it begins with (the API's name) as tune's option."""
    for field, option in _TUNE_OPTIONS.items():
        if message.startswith(field):
            return option + message[len(field) :]
    return message


@app.command()
@user_errors
def tune(
    op: OpArg,
    shape: Annotated[list[str], typer.Option("--shape", "-s", help="repeatable, e.g. 8192x8192")],
    dtype: DtypeOpt = "float16",
    strategy: StrategyOpt = "random",
    budget: Annotated[int, typer.Option(help="trials over all shapes")] = 64,
    seconds: Annotated[float, typer.Option(help="wall-clock budget")] = 3600.0,
    attr: AttrOpt = None,
    family: Annotated[
        list[str] | None,
        typer.Option(
            "--family",
            "-f",
            help="repeatable: search only these template families (`kernelmill ops` lists them); default: every "
            "family computing in the dtype itself (matmul's tensorcore family, float32 as TF32, only when named)",
        ),
    ] = None,
    arch: Annotated[
        str, typer.Option(help="with --server: the GPU to tune for, e.g. sm_90 (auto: any worker's)")
    ] = "auto",
    server: ServerOpt = None,
) -> None:
    """Tune a kernel: submit a job to a server, or run it here on this GPU when no server is given."""
    from kernelmill.service.jobs import JobError, validate_submission
    from kernelmill.settings import get_settings

    settings = get_settings()
    attrs = parse_pairs(attr, "--attr")
    if arch != "auto" and not server:
        raise fail("--arch needs --server: without one the job runs here, on this GPU")
    try:
        fields = validate_submission(
            settings,
            op,
            shape,
            dtype,
            strategy,
            budget,
            seconds,
            attrs,
            arch=arch,
            families=family,
            bounded=not server,  # a server holds a job to its own limits (its settings, not this machine's)
        )
    except JobError as exc:
        raise fail(_as_tune_options(str(exc))) from None
    if server:
        from kernelmill.client import tune_remote

        job = tune_remote(server, fields, console)
    else:
        from kernelmill.client import tune_embedded

        job = tune_embedded(settings, fields, console)
    if job["state"] in ("failed", "cancelled"):  # the summary said why; a script sees it in the exit code
        raise typer.Exit(1)


JsonListOpt = Annotated[
    bool, typer.Option("--json", help="the list as JSON on stdout (the API's fields; [] when empty)")
]


@app.command()
@user_errors
def jobs(
    server: ServerOpt = None,
    state: Annotated[str | None, typer.Option(help="queued, running, done, failed or cancelled")] = None,
    limit: Annotated[int, typer.Option(help="the most recent jobs listed")] = 20,
    as_json: JsonListOpt = False,
) -> None:
    """List recent jobs (from the server, or the local database)."""
    from kernelmill.client import fetch_jobs
    from kernelmill.service.api.jobs import MAX_JOBS_PAGE
    from kernelmill.service.db.models import JOB_STATES

    if state is not None and state not in JOB_STATES:
        raise fail(f"unknown state {state!r}; use one of {', '.join(JOB_STATES)}")
    if not 1 <= limit <= MAX_JOBS_PAGE:
        raise fail(f"--limit {limit} is out of range 1..{MAX_JOBS_PAGE}")
    listed = fetch_jobs(server, state, limit)
    if as_json:
        typer.echo(json.dumps(listed, indent=2))
        return
    if not listed:
        console.print(  # one line, a path in it whole: wrapped at the terminal's width, it broke inside the path
            f"no {state + ' ' if state else ''}jobs{_listed_from(server)} (submit one: kernelmill tune OP --shape S)",
            soft_wrap=True,
        )
        return
    table = Table(title="jobs")
    for col in ("id", "op", "shapes", "dtype", "strategy", "state", "trials", "failed", "best us", "speedup"):
        table.add_column(col, overflow="fold")
    for job in listed:
        best = [s for s in job["per_shape"] if s["best_ms"]]
        table.add_row(
            str(job["id"]),
            job["op"],
            " ".join("x".join(map(str, s)) for s in job["shapes"]),
            job["dtype"] + (f" ({job['precision']})" if job.get("precision", job["dtype"]) != job["dtype"] else ""),
            job["strategy"],
            job["state"],
            str(job["trials_done"]),
            str(job["trials_failed"]),
            " ".join(f"{s['best_ms'] * 1e3:.1f}" for s in best),
            " ".join(f"{s['speedup']:.2f}x" for s in best if s["speedup"]),
        )
    console.print(table)


@app.command()
@user_errors
def cancel(
    job_id: Annotated[int, typer.Argument(help="the job's id (`kernelmill jobs` lists them)", show_default=False)],
    server: ServerOpt = None,
) -> None:
    """Cancel a job (`kernelmill jobs` lists them).

    A queued one ends at once, a running one after its current batch (its trials so far are kept), one whose process
    died (its lease lapsed) at once."""
    from kernelmill.client import cancel_job
    from kernelmill.service.api.schemas import MAX_ID

    if not 1 <= job_id <= MAX_ID:  # past a 64-bit integer SQLite's driver raised OverflowError
        raise fail(f"job id {job_id} is out of range 1..{MAX_ID}")
    job, dead_runner = cancel_job(server, job_id)
    if dead_runner is not None:
        console.print(f"job {job_id} cancelled at once: {dead_runner}, which ran it, had stopped (its lease lapsed)")
    elif job["state"] == "cancelled":
        console.print(f"job {job_id} cancelled")
    else:
        console.print(f"job {job_id} {job['state']}: asked to stop; it ends after its current batch")


def _listed_from(server: str | None) -> str:
    """Where a listing came from, for a message that it is empty: a database file not made yet is named (a typo
    in its path, or a command run from another folder, looked like an empty database)."""
    from kernelmill.client import missing_local_database

    if server:
        return f" in {server}"
    missing = missing_local_database()
    return f": no database at {missing} yet (KERNELMILL_DATABASE_URL)" if missing else " in the local database"


@app.command()
@user_errors
def kernels(
    server: ServerOpt = None,
    op: Annotated[str | None, typer.Option(help="only this op's kernels")] = None,
    dtype: Annotated[str | None, typer.Option(help="only kernels of this dtype")] = None,
    as_json: JsonListOpt = False,
) -> None:
    """List served kernels: the best verified one per op, shape, dtype, precision and arch."""
    from kernelmill.client import fetch_kernels

    if op is not None:
        get_op(op)  # an unknown op is a one-line error naming the ops
    if dtype is not None:
        numpy_dtype(dtype)  # and an unknown dtype one naming the dtypes
    listed = fetch_kernels(server, op, dtype)
    if as_json:
        typer.echo(json.dumps(listed, indent=2))
        return
    if not listed:
        what = " ".join(v for v in (op, dtype) if v)
        where = _listed_from(server)
        console.print(
            f"no served {what + ' ' if what else ''}kernels{where} (a finished tuning job serves its best)",
            soft_wrap=True,
        )
        return
    table = Table(title="served kernels", caption=f"({len(listed)} kernel{'s' if len(listed) != 1 else ''})")
    for col in ("id", "op", "shape", "dtype", "arch", "family", "median us", "torch us", "speedup", "device"):
        table.add_column(col, overflow="fold")
    for k in listed:
        table.add_row(
            str(k["id"]),
            k["op"],
            "x".join(map(str, k["shape"])),
            k["dtype"] + (f" ({k['precision']})" if k.get("precision", k["dtype"]) != k["dtype"] else ""),
            k["arch"],
            k["family"],
            f"{k['median_ms'] * 1e3:.1f}",
            f"{k['baseline_ms'] * 1e3:.1f}" if k["baseline_ms"] else "",
            f"{k['speedup']:.2f}x" if k["speedup"] else "",
            k["device_name"] or "",
        )
    console.print(table)


# -- the compile cache ---------------------------------------------------------------------------------------

cache_app = typer.Typer(help="The compile cache: its size, and pruning it.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


def _mb(n: float) -> str:
    return f"{n / MB:.1f} MB"


@cache_app.command("info")
@user_errors
def cache_info() -> None:
    """Where the cache is, what each part of it holds, and the compile cache's limit."""
    from kernelmill.settings import get_settings

    settings = get_settings()
    root = Path(settings.cache_dir)
    table = Table(title=f"cache at {root}")
    for col, justify in (("part", "left"), ("files", "right"), ("size", "right"), ("what", "left")):
        table.add_column(col, justify=justify, overflow="fold")
    for part, what in CACHE_PARTS.items():
        files, size = _usage(root / part)
        table.add_row(part, str(files), _mb(size), what)
    console.print(table)
    limit = settings.compile_cache_max_mb
    console.print(f"compile cache limit: {_mb(limit * MB) if limit else 'none'} (KERNELMILL_COMPILE_CACHE_MAX_MB)")


def _usage(folder: Path) -> tuple[int, int]:
    """The files under ``folder`` and their bytes. One removed as it is counted (a prune or a write in another
    process) or unreadable is passed over: either raised a traceback."""
    files = size = 0
    for top, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(top, name), follow_symlinks=False)
                files, size = files + 1, size + st.st_size
    return files, size


CACHE_PARTS = {
    "cubin": "compiled variants with their ptxas reports (pruned, least recently used first)",
    "served": "kernels the runtime fetched from a service (kept: forwards run on them offline)",
    "verified": "the runtime's first-use checks, per GPU model",
    "chosen": "tiles and PDL edges the runtime chose at capture, per GPU model",
}


@cache_app.command("prune")
@user_errors
def cache_prune(
    max_mb: Annotated[
        float | None,
        typer.Option(help="cut the compile cache to this size (default: KERNELMILL_COMPILE_CACHE_MAX_MB)"),
    ] = None,
    clear: Annotated[bool, typer.Option("--all", help="remove every compiled variant")] = False,
) -> None:
    """Remove compiled variants, least recently used first: they are compiled again when next asked for."""
    from kernelmill.settings import get_settings

    if clear and max_mb is not None:
        raise fail("--all and --max-mb: give one")
    if max_mb is not None and not (math.isfinite(max_mb) and max_mb >= 0):  # inf (1e400) overflowed int()
        raise fail(f"--max-mb must be a finite number of MB, 0 or more, not {max_mb:g}")
    limit = 0.0 if clear else (get_settings().compile_cache_max_mb if max_mb is None else max_mb)
    if max_mb is None and not clear and not limit:
        raise fail("the compile cache has no limit (KERNELMILL_COMPILE_CACHE_MAX_MB=0): give --max-mb or --all")
    compiler = Compiler()
    report = compiler.prune(int(limit * MB))
    left = report.bytes - report.freed_bytes
    console.print(
        f"{report.removed} of {report.entries} compiled variants removed ({_mb(report.freed_bytes)}); "
        f"{_mb(left)} left in {compiler.cache_dir}"
    )
    if report.kept:  # a read-only cache raised a traceback at its first entry
        raise fail(f"{report.kept} compiled variants could not be removed: {report.error}", 1)


# -- a model's forward: tuning its problems, profiling it (nsys) ----------------------------------------------

ModelArg = Annotated[
    str | None, typer.Argument(help="a HuggingFace BERT directory or an MLP state_dict file", show_default=False)
]
PresetOpt = Annotated[str | None, typer.Option(help="a built-in model instead: bert-base, bert-tiny, mlp, mlp-tiny")]
BatchOpt = Annotated[int, typer.Option(help="rows (MLP) or sequences (BERT) per forward")]
SeqOpt = Annotated[int, typer.Option(help="sequence length (BERT)")]
ActOpt = Annotated[str | None, typer.Option(help="an MLP file's activation (default relu)")]


@app.command("tune-model")
@user_errors
def tune_model(
    model: ModelArg = None,
    preset: PresetOpt = None,
    batch: BatchOpt = 8,
    seq: SeqOpt = 128,
    dtype: DtypeOpt = "float16",
    act: ActOpt = None,
    strategy: StrategyOpt = "evolutionary",
    budget: Annotated[int, typer.Option(help="trials per job (one job per op, its shapes together)")] = 64,
    seconds: Annotated[float, typer.Option(help="wall-clock budget per job")] = 1800.0,
    server: ServerOpt = None,
    follow: Annotated[bool, typer.Option("--follow/--no-follow", help="watch the jobs to their end")] = True,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="list the problems; submit nothing")] = False,
) -> None:
    """Tune what a model's forward runs: a job per op of its forward goes to the server.

    One forward on the CPU collects its problems (op, shape, dtype), then a job per op goes to the server. Models
    loaded with that server then pull the tuned kernels."""
    from kernelmill.agents.strategies import strategy_class
    from kernelmill.runtime import Model
    from kernelmill.runtime import tune_model as submit
    from kernelmill.runtime.profile import ForwardSpec, build_module, example_inputs
    from kernelmill.runtime.tune import model_problems, submit_timeout

    spec = ForwardSpec(model, preset, batch, seq, dtype, act)
    spec.check()
    strategy_class(strategy)  # an unknown one is a ValueError: one line, exit 2
    if budget < 1:
        raise fail("--budget must be at least 1")
    if not 0 < seconds < math.inf:  # inf was sent, and refused by the JSON encoder ("Out of range float values")
        raise fail(f"--seconds must be a finite number above 0, not {seconds:g}")
    if not dry_run and not server:
        raise fail("tune-model submits jobs to a service: give --server URL (or set KERNELMILL_SERVER)")
    import httpx

    from kernelmill.client import follow_jobs

    base = (server or "").rstrip("/")
    collecting = f"one forward of {spec.model_name} on the CPU to collect its problems"
    if not console.is_terminal:  # rich's status shows only on a terminal: a log would see seconds of nothing
        console.print(collecting + " ...", markup=False, soft_wrap=True)  # a path is neither markup nor wrapped
    with console.status(Text(collecting)) as status:
        ran = 0

        def progress(problem: tuple) -> None:
            """Each op as the forward reaches it (a BERT-base forward takes tens of seconds on the CPU)."""
            nonlocal ran
            ran += 1
            op, shape, _dtype, attrs = problem
            knobs = "".join(f" {k}={v}" for k, v in attrs.items())
            if console.is_terminal:
                status.update(Text(f"{collecting}: op {ran}, {op} {format_shape(shape)}{knobs}"))
            else:  # a line each, which tests and logs read as this status (it starts the same way)
                line = f"one forward of {spec.model_name}: op {ran}, {op} {format_shape(shape)}{knobs}"
                console.print(line, markup=False, soft_wrap=True)

        module = build_module(spec)
        inputs = example_inputs(module, batch, seq)
        cpu_model = Model(module, "cpu")
        if dry_run:
            problems = model_problems(cpu_model, *inputs, progress=progress)
        else:
            with httpx.Client(base_url=base, timeout=submit_timeout()) as client:
                tuning = dict(dtype=dtype, strategy=strategy, trials=budget, seconds=seconds, client=client)
                jobs = submit(cpu_model, inputs, progress=progress, **tuning)
    if dry_run:
        table = Table(title=f"problems of one forward ({len(problems)}), as jobs would tune them in {dtype}")
        for col in ("op", "shape", "attrs"):
            table.add_column(col)
        for op, shape, _dtype, attrs in problems:
            table.add_row(op, format_shape(shape), " ".join(f"{k}={v}" for k, v in attrs.items()))
        console.print(table)
        return
    for job in jobs:
        shapes = ", ".join(format_shape(s) for s in job["shapes"])
        console.print(f"job {job['id']} submitted to {base}: {job['op']} {job['dtype']} {shapes}", highlight=False)
    if follow:
        follow_jobs(base, jobs, console)
    console.print(f"models loaded with server={base} (or KERNELMILL_SERVER) pull the tuned kernels")


@app.command("profile-forward")
@user_errors
def profile_forward(
    model: ModelArg = None,
    preset: PresetOpt = None,
    batch: BatchOpt = 8,
    seq: SeqOpt = 128,
    dtype: DtypeOpt = "float16",
    act: ActOpt = None,
    iters: Annotated[int, typer.Option(help="forwards profiled")] = 10,
    warmup: Annotated[int, typer.Option(help="forwards before the capture (kernels are compiled then)")] = 2,
    graphs: Annotated[
        bool, typer.Option("--graphs/--no-graphs", help="replay CUDA graphs (per-op ranges then exist only in warm-up)")
    ] = False,
    server: ServerOpt = None,
    keep: Annotated[Path | None, typer.Option(help="keep nsys's report and CSV tables in this folder")] = None,
    store: Annotated[bool, typer.Option("--store/--no-store", help="record the summary in the database")] = True,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the summary to this JSON file")] = None,
    timeout_s: Annotated[float, typer.Option(help="limit for nsys and for nsys stats, each")] = 1800.0,
) -> None:
    """Run a model's forwards under Nsight Systems with NVTX ranges per op; print and store the summary."""
    from kernelmill.runtime.profile import ForwardFailed, ForwardSpec, NsysNoReport, NsysUnavailable, find_nsys
    from kernelmill.runtime.profile import profile_forward as run_profile
    from kernelmill.settings import MAX_WAIT_S

    spec = ForwardSpec(model, preset, batch, seq, dtype, act, iters, warmup, graphs, server)
    spec.check()
    if not 0 < timeout_s <= MAX_WAIT_S:  # past a day, subprocess's waits overflowed (1e300 passed, then raised)
        raise fail(f"--timeout-s must be a number of seconds above 0 and at most {MAX_WAIT_S:.0f}, not {timeout_s}")
    if find_nsys() is None:  # before --keep's folder is made
        raise fail(_NO_NSYS, EXIT_NO_PROFILER)
    # What the profile is written to is checked before it runs: a profile takes minutes and is not lost at the end.
    if keep is not None:
        _output_dir(keep, "--keep")
    if json_out is not None:
        _output_file(json_out, "--json")
    if store:  # so is the database: one that cannot be opened lost the summary to its error at the end
        _open_store().close()
    try:
        with console.status(f"nsys: {iters} forwards of {spec.model_name}"):
            result = run_profile(spec, keep_dir=keep, timeout_s=timeout_s)
    except NsysUnavailable as exc:  # found above, but it cannot be started
        raise fail(f"{exc}; nothing profiled", EXIT_NO_PROFILER) from None
    except ForwardFailed as exc:
        if exc.kind == "no_gpu":
            raise fail(f"no GPU here ({exc.reason}); nothing profiled", EXIT_UNAVAILABLE) from None
        raise fail(
            f"the forward failed under nsys: {exc.reason}", EXIT_USAGE if exc.kind == "bad_input" else 1
        ) from None
    except NsysNoReport as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        if exc.tail:
            err_console.print("nsys said:\n" + escape(exc.tail), highlight=False, soft_wrap=True)
        raise typer.Exit(EXIT_NO_REPORT) from None
    summary = result.to_dict()
    not_stored = None
    if store:
        from sqlalchemy.exc import SQLAlchemyError

        try:
            db = _open_store()
            try:
                summary["id"] = db.record_forward_profile(summary).id
            finally:
                db.close()
        except (SQLAlchemyError, ValueError) as exc:  # gone since the check: the summary is still printed (and written)
            not_stored = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    _print_forward_profile(summary)
    if json_out is not None:
        try:
            json_out.write_text(json.dumps(summary, indent=2))
        except OSError as exc:  # gone or read-only since the check: the summary is printed (and stored) above
            raise fail(f"--json {json_out}: {exc.strerror or exc}; the summary is above", 1) from None
    if not_stored is not None:
        raise fail(f"the summary could not be stored ({not_stored}); it is above", EXIT_UNAVAILABLE)


def _open_store():
    from kernelmill.service.db.store import Store
    from kernelmill.settings import get_settings

    return Store(get_settings().database_url)


_NO_NSYS = (
    "nsys not found: install Nsight Systems (its nsys command) and put it on PATH, or set KERNELMILL_NSYS; "
    "nothing profiled"
)


def _output_dir(path: Path, option: str) -> None:
    """Create folder ``path`` (for ``option``) now, or fail with one line saying why it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise fail(f"{option} {path}: not a folder") from None
    except OSError as exc:
        raise fail(f"{option} {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise fail(f"{option} {path}: not writable")


def _output_file(path: Path, option: str) -> None:
    """Fail with one line unless file ``path`` (for ``option``) can be written: its folder exists and is
    writable, and it is not a folder or a read-only file."""
    if path.is_dir():
        raise fail(f"{option} {path}: is a folder; give a file name")
    folder = path.parent
    if not folder.is_dir():
        raise fail(f"{option} {path}: no folder {folder}")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise fail(f"{option} {path}: not writable")


def _ms(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:.3f}"


def _us(ns: float | None) -> str:
    return "-" if ns is None else f"{ns / 1e3:.1f}"


def _print_table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """A rich table: the first column (a name) left-aligned, the figures right-aligned."""
    table = Table(title=title)
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _print_forward_profile(p: dict[str, Any]) -> None:
    shape = f"batch {p['batch']}" + (f" seq {p['seq']}" if p.get("seq") else "")
    where = f" on {p['device_name']}" if p.get("device_name") else ""
    console.print(
        f"[bold]{escape(p['model'])}[/] {p['dtype']} {shape}{escape(where)}: {p['iters']} forwards"
        f" ({p.get('run') or ('graph' if p['graphs'] else 'plain')} launches), nsys {p.get('nsys_version') or '?'}",
        highlight=False,
    )
    gaps, memcpy = p["gaps"], p["memcpy"]
    busy = p.get("gpu_busy_pct")
    console.print(
        f"kernels {_ms(p['kernel_time_ns'])} ms in {p['kernel_launches']} launches "
        f"({p['kernel_ms_per_forward']:.3f} ms per forward)"
        + (f", GPU busy {busy:.1f}% of {_ms(p['span_ns'])} ms" if busy is not None else ""),
        highlight=False,
    )
    console.print(
        f"launch gaps {gaps['count']}: total {_ms(gaps['total_ns'])} ms, median {_us(gaps['median_ns'])} us, "
        f"p90 {_us(gaps['p90_ns'])} us, max {_us(gaps['max_ns'])} us",
        highlight=False,
    )
    console.print(
        f"memcpy {_ms(memcpy['time_ns'])} ms, {memcpy['bytes'] / 1e6:.3f} MB in {memcpy['count']} copies",
        highlight=False,
    )
    _print_table(
        "top kernels",
        ("kernel", "ms", "%", "launches", "avg us"),
        [
            (escape(k["name"]), _ms(k["total_ns"]), f"{k['pct']:.1f}", str(k["instances"]), _us(k["avg_ns"]))
            for k in p["top_kernels"]
        ],
    )
    if p["ranges"]:
        _print_table(
            "NVTX ranges (GPU time projected onto each range)",
            ("range", "calls", "GPU ms", "CPU ms", "GPU ops"),
            [
                (escape(r["name"]), str(r["instances"]), _ms(r["gpu_ns"]), _ms(r["cpu_ns"]))
                + ("-" if r["gpu_ops"] is None else str(r["gpu_ops"]),)
                for r in p["ranges"]
            ],
        )
    if memcpy["by_operation"]:
        _print_table(
            "memory operations",
            ("operation", "ms", "count", "MB"),
            [
                (escape(m["operation"]), _ms(m["time_ns"]), str(m["count"]), f"{m['bytes'] / 1e6:.3f}")
                for m in memcpy["by_operation"]
            ],
        )
    if p["api"]:
        _print_table(
            "CUDA API (host)",
            ("call", "calls", "ms", "avg us"),
            [(escape(a["name"]), str(a["calls"]), _ms(a["total_ns"]), _us(a["avg_ns"])) for a in p["api"]],
        )
    for note in p.get("notes") or []:
        console.print(f"note: {escape(note)}", highlight=False)
    if p.get("report_path"):
        console.print(f"nsys report: {escape(p['report_path'])}", highlight=False)
    if p.get("id") is not None:
        console.print(f"stored as forward profile {p['id']} (GET /api/profiles/forward/{p['id']})", highlight=False)
