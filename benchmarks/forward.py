"""Model.forward of the kernelmill runtime against PyTorch eager and torch.compile, one process, one GPU.

(a) an MLP stack, 4 blocks of Linear(4096, 11008) -> GELU -> Linear(11008, 4096), batch 1, 16 and 256
    (--mlp-batches for others);
(b) a BERT-base-sized encoder (12 layers, hidden 768, 12 heads, random weights), sequence 128, batch 1 and 8.
All in float16. The runtime loads the same weights (a torch state_dict / a save_pretrained directory)
and runs its registry's kernels (tuned ones where KERNELMILL_SERVER or --server serves them, else the
template defaults, and at capture the defaults' runners-up where they replay faster on this GPU:
KERNELMILL_KERNEL_TUNE, on by default) with CUDA-graph replay, with programmatic dependent launch (PDL)
and without. Next to eager, the same eager forward captured in a CUDA graph (torch.cuda.CUDAGraph) and
replayed: PyTorch's own kernels without its per-launch cost, which tells kernel speed apart from launch
overhead. The contenders' timed repeats take turns. Prints a table and writes JSON.

A turn is at least ``--iters`` calls and at least ``--turn-ms`` of them (100 ms by default). Compute-bound
forwards (the MLP from batch 256 on) run at the GPU's power cap, where the clock follows the energy a forward
takes: turns of 25 ms spread by up to 23% there (docs/PERFORMANCE.md, "Large batches at the power cap").
``--sustained SECONDS`` makes each turn that many seconds of back-to-back forwards and samples the SM clock and
the board power meanwhile (nvidia-smi), so the table also gives each contender's clock, power and energy per
forward in the steady state.

    python benchmarks/forward.py --out forward.json [--server http://host:8000] [--no-compile] [--shape-defaults]
        [--sustained 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

#: nvidia-smi's sampling period (ms) in --sustained turns; the first third of a turn's samples is left out
#: (the clock and power settle after the previous contender's load).
SAMPLE_MS = 50


def _sync(torch) -> None:
    torch.cuda.synchronize()  # device-wide: waits for the runtime's stream as well


def time_ms(
    torch, fns: dict, warmup: int, iters: int, repeats: int, seconds: float = 0.0, sample: bool = False
) -> dict:
    """Wall time per call over a turn of back-to-back calls (launch overhead included), median of `repeats`
    turns, for each of ``fns``; the contenders' turns alternate (A, B, C, A, B, C, ...) so that a drifting clock
    or a neighbour's load hits every contender alike. A turn is `iters` calls, repeated (with a synchronisation
    after each `iters`) until it has lasted ``seconds``. With ``sample`` each turn also records the SM clock
    (MHz) and board power (W) that nvidia-smi sampled meanwhile, and their product with the time per call
    (mJ per call)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(torch)
    samples: dict = {name: [] for name in fns}
    gpu: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sampler = GpuSampler(torch) if sample else None
            calls, start = 0, time.perf_counter()
            while True:
                for _ in range(iters):
                    fn()
                _sync(torch)
                calls += iters
                if time.perf_counter() - start >= seconds:
                    break
            samples[name].append((time.perf_counter() - start) * 1e3 / calls)
            if sampler is not None:
                gpu[name].append(sampler.stop())
    out = {}
    for name, s in samples.items():
        out[name] = {"median_ms": statistics.median(s), "min_ms": min(s), "samples_ms": s}
        readings = [r for r in gpu[name] if r is not None]
        if readings:
            mhz = statistics.median(r[0] for r in readings)
            watts = statistics.median(r[1] for r in readings)
            out[name].update(sm_mhz=mhz, power_w=watts, mj_per_call=watts * out[name]["median_ms"])
    return out


class GpuSampler:
    """nvidia-smi sampling the current GPU's SM clock and power draw every SAMPLE_MS until ``stop()``, which
    returns the medians (MHz, W) of the samples after the first third, or None where nvidia-smi is missing
    or gave nothing."""

    def __init__(self, torch) -> None:
        cmd = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", f"-lms={SAMPLE_MS}"]
        uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "uuid", None)
        if uuid is not None:
            cmd.append(f"--id=GPU-{uuid}")
        try:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._proc = None

    def stop(self) -> tuple[float, float] | None:
        if self._proc is None:
            return None
        self._proc.terminate()
        out = self._proc.communicate()[0]
        return parse_samples(out)


def parse_samples(text: str) -> tuple[float, float] | None:
    """Medians (MHz, W) of nvidia-smi's "clock, power" lines after the first third; None if none parse."""
    rows = []
    for line in text.splitlines():
        try:
            mhz, watts = (float(v) for v in line.split(","))
        except ValueError:
            continue
        rows.append((mhz, watts))
    rows = rows[len(rows) // 3 :]
    if not rows:
        return None
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)


def rel_err(torch, out, ref) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm())


def torch_graphed(torch, fn):
    """``fn`` (eager PyTorch on static inputs) captured in a CUDA graph, as a function that replays it; None
    (with a line on stderr) where capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # lazy initialisation (cuBLAS handles and workspaces) before the capture
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
    except Exception as exc:  # noqa: BLE001 - a contender that cannot be captured is left out, not fatal
        print(f"eager in a CUDA graph: capture failed ({type(exc).__name__}: {exc}); left out", file=sys.stderr)
        return None

    def replay():
        graph.replay()
        return out

    return replay


def run_case(torch, name, batch, model, runtime_fn, eager_fn, compiled_fn, args, defaults_fn=None) -> dict:
    """Times the runtime's graphs with PDL (the default) and without, eager, eager in a CUDA graph,
    torch.compile and (``defaults_fn``, --shape-defaults) a second model on the shape defaults alone
    (tune_kernels=False), taking turns."""
    row: dict = {"case": name, "batch": batch}
    out_rt = runtime_fn()
    out_eager = eager_fn()
    _sync(torch)
    row["rel_err_vs_eager"] = rel_err(torch, out_rt, out_eager)

    def with_pdl(flag):
        def run():
            model.pdl = flag
            return runtime_fn()

        return run

    setting = model.pdl
    fns = {"runtime": with_pdl(True), "runtime_no_pdl": with_pdl(False), "eager": eager_fn}
    if defaults_fn is not None:
        out_defaults = defaults_fn()
        _sync(torch)
        row["rel_err_defaults_vs_eager"] = rel_err(torch, out_defaults, out_eager)
        fns["runtime_defaults"] = defaults_fn
    graphed = torch_graphed(torch, eager_fn)
    if graphed is not None:
        row["rel_err_eager_graph"] = rel_err(torch, graphed(), out_eager)
        fns["eager_graph"] = graphed
    if compiled_fn is not None:
        start = time.perf_counter()
        compiled_fn()  # compiles
        _sync(torch)
        row["compile_s"] = time.perf_counter() - start
        fns["compiled"] = compiled_fn
    seconds = args.sustained or args.turn_ms / 1e3
    row.update(time_ms(torch, fns, args.warmup, args.iters, args.repeats, seconds, sample=args.sustained > 0))
    model.pdl = setting
    return row


def mlp_cases(torch, runtime, args, tmp: Path) -> list[dict]:
    d, hidden, layers = 4096, 11008, 4
    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, d))
        for _ in range(layers)
    ]
    ref_cpu = torch.nn.Sequential(*blocks).eval()
    path = tmp / "mlp.pt"
    torch.save(ref_cpu.state_dict(), path)
    load = dict(device="cuda", dtype="float16", act="gelu", server=args.server)
    model = runtime.load_model(path, **load)
    defaults = runtime.load_model(path, **load, tune_kernels=False) if args.shape_defaults else None
    ref = ref_cpu.half().cuda()
    del ref_cpu
    compiled = torch.compile(ref) if args.compile else None
    rows = []
    for batch in args.mlp_batches:
        x = torch.randn(batch, d, device="cuda", dtype=torch.float16)
        xt = runtime.from_torch(x)
        with torch.no_grad():
            row = run_case(
                torch,
                "mlp 4x(4096-11008-4096)",
                batch,
                model,
                lambda xt=xt: runtime.to_torch(model.forward(xt)),
                lambda x=x: ref(x),
                (lambda x=x: compiled(x)) if compiled is not None else None,
                args,
                (lambda xt=xt: runtime.to_torch(defaults.forward(xt))) if defaults is not None else None,
            )
        row["runtime_run"] = model.last_run
        rows.append(row)
    rows[-1]["kernels"] = model.kernel_report()
    if defaults is not None:
        rows[-1]["kernels_defaults"] = defaults.kernel_report()
    return rows


def bert_cases(torch, runtime, args, tmp: Path) -> list[dict]:
    import transformers

    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        intermediate_size=3072,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    ref_cpu = transformers.BertModel(config, add_pooling_layer=False).eval()
    path = tmp / "bert-base"
    ref_cpu.save_pretrained(path)
    load = dict(device="cuda", dtype="float16", server=args.server)
    model = runtime.load_model(path, **load)
    defaults = runtime.load_model(path, **load, tune_kernels=False) if args.shape_defaults else None
    ref = ref_cpu.half().cuda()
    del ref_cpu
    compiled = torch.compile(ref) if args.compile else None
    rows = []
    seq = 128
    for batch in (1, 8):
        ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")
        ids_host = ids.cpu().numpy()
        with torch.no_grad():
            row = run_case(
                torch,
                f"bert-base seq {seq}",
                batch,
                model,
                lambda ids_host=ids_host: runtime.to_torch(model.forward(ids_host)),
                lambda ids=ids: ref(input_ids=ids).last_hidden_state,
                (lambda ids=ids: compiled(input_ids=ids).last_hidden_state) if compiled is not None else None,
                args,
                (lambda ids_host=ids_host: runtime.to_torch(defaults.forward(ids_host)))
                if defaults is not None
                else None,
            )
        row["runtime_run"] = model.last_run
        rows.append(row)
    rows[-1]["kernels"] = model.kernel_report()
    if defaults is not None:
        rows[-1]["kernels_defaults"] = defaults.kernel_report()
    return rows


def print_table(rows: list[dict]) -> None:
    second = any("runtime_defaults" in r for r in rows)
    header = f"{'case':<26}{'batch':>6}{'runtime ms':>12}{'no PDL ms':>11}{'eager ms':>10}{'graphed ms':>12}"
    header += f"{'compile ms':>12}{'vs eager':>10}{'vs graphed':>11}{'vs compile':>11}{'rel err':>10}  run"
    header += f"{'defaults ms':>12}{'vs eager':>10}" if second else ""
    print(header)
    print("-" * len(header))
    for r in rows:
        rt, eager = r["runtime"]["median_ms"], r["eager"]["median_ms"]
        no_pdl = r["runtime_no_pdl"]["median_ms"]
        comp = r.get("compiled", {}).get("median_ms")
        comp_s = f"{comp:>12.3f}" if comp else f"{'-':>12}"
        vs_comp = f"{comp / rt:>10.2f}x" if comp else f"{'-':>11}"
        graphed = r.get("eager_graph", {}).get("median_ms")
        graphed_s = f"{graphed:>12.3f}" if graphed else f"{'-':>12}"
        vs_graphed = f"{graphed / rt:>10.2f}x" if graphed else f"{'-':>11}"
        print(
            f"{r['case']:<26}{r['batch']:>6}{rt:>12.3f}{no_pdl:>11.3f}{eager:>10.3f}{graphed_s}{comp_s}"
            f"{eager / rt:>9.2f}x{vs_graphed}{vs_comp}"
            f"{r['rel_err_vs_eager']:>10.2e}  {r['runtime_run']:<5}" + (_defaults_cells(r, eager) if second else "")
        )


#: Issue 4's targets: the runtime at least this much faster than eager at MLP batch 1, and never slower than
#: eager at any size.
TARGET_BATCH1 = 1.3
TARGET_EVERYWHERE = 1.0


def targets(rows: list[dict]) -> list[str]:
    """Issue 4's targets against this run's medians, one line each: the figure, the bar, met or missed."""
    lines = []
    ratio = {(r["case"], r["batch"]): r["eager"]["median_ms"] / r["runtime"]["median_ms"] for r in rows}
    batch1 = [r for r in rows if r["case"].startswith("mlp") and r["batch"] == 1]
    if batch1:
        row = batch1[0]
        value = ratio[(row["case"], 1)]
        verdict = "met" if value >= TARGET_BATCH1 else "missed"
        lines.append(
            f"MLP batch 1 vs eager {value:.2f}x (target >= {TARGET_BATCH1:.2f}x): {verdict}{_eager_context(row)}"
        )
    if ratio:
        (case, batch), worst = min(ratio.items(), key=lambda kv: kv[1])
        verdict = "met" if worst >= TARGET_EVERYWHERE else "missed"
        lines.append(
            f"slowest vs eager {worst:.2f}x ({case}, batch {batch}; target >= {TARGET_EVERYWHERE:.2f}x): {verdict}"
        )
    return lines


def _eager_context(row: dict) -> str:
    """What the batch-1 verdict rests on: eager's time over its own CUDA graph (above 1, eager paid launch
    gaps, which the ratio then rewards) and the runtime against eager's fastest turn; empty where the row
    has neither."""
    eager, parts = row["eager"], []
    graphed = row.get("eager_graph", {}).get("median_ms")
    if graphed:
        parts.append(f"eager {eager['median_ms']:.3f} ms, {eager['median_ms'] / graphed:.2f}x its CUDA graph")
    if "min_ms" in eager:
        parts.append(f"{eager['min_ms'] / row['runtime']['median_ms']:.2f}x eager's fastest turn")
    return f" ({'; '.join(parts)})" if parts else ""


#: The contenders of a row, in the order the power table lists them, with their column names.
_CONTENDERS = (
    ("runtime", "runtime"),
    ("runtime_no_pdl", "no PDL"),
    ("runtime_defaults", "defaults"),
    ("eager", "eager"),
    ("eager_graph", "graphed"),
    ("compiled", "compile"),
)


def print_power(rows: list[dict]) -> None:
    """Under the table, for --sustained runs: each contender's SM clock, board power and energy per forward
    (medians over its turns); nothing where no row has readings."""
    if not any("power_w" in r.get(key, {}) for r in rows for key, _ in _CONTENDERS):
        return
    print("\nsustained turns: SM clock MHz / power W / energy per forward mJ")
    for r in rows:
        cells = [
            f"{label} {r[key]['sm_mhz']:.0f} / {r[key]['power_w']:.0f} / {r[key]['mj_per_call']:.1f}"
            for key, label in _CONTENDERS
            if "power_w" in r.get(key, {})
        ]
        print(f"{r['case']:<26}{r['batch']:>6}  " + "; ".join(cells))


def _defaults_cells(row: dict, eager_ms: float) -> str:
    ms = row.get("runtime_defaults", {}).get("median_ms")
    return f"{ms:>12.3f}{eager_ms / ms:>9.2f}x" if ms else f"{'-':>12}{'-':>10}"


def _duration(unit: str, most: float, example: str):
    """An argparse type: a number of ``unit`` from 0 to ``most``, with a one-line reason otherwise."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {unit}, e.g. {example}") from None
        if not 0 <= value <= most:
            raise argparse.ArgumentTypeError(f"{text!r}: {unit} from 0 to {most:g}")
        return value

    return parse


_seconds = _duration("seconds", 60, "2")
_turn_ms = _duration("milliseconds", 10_000, "100")


def _batches(text: str) -> tuple[int, ...]:
    try:
        batches = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated batch sizes, e.g. 1,16,256") from None
    if not batches or min(batches) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch sizes are positive integers")
    return batches


def _count(least: int):
    """An argparse type: an integer of at least ``least``, with a one-line reason otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r}: at least {least}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="forward.json", help="JSON results")
    parser.add_argument("--server", default=None, help="kernelmill service for tuned kernels (else KERNELMILL_SERVER)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile")
    parser.add_argument("--only", choices=("mlp", "bert"), default=None)
    parser.add_argument(
        "--shape-defaults",
        action="store_true",
        help="also time a second runtime model on the shape defaults alone (load_model(tune_kernels=False)), "
        "next to the first one's capture-time choice among their runners-up (KERNELMILL_KERNEL_TUNE)",
    )
    parser.add_argument(
        "--mlp-batches", type=_batches, default=(1, 16, 256), help="comma-separated MLP batch sizes (default 1,16,256)"
    )
    parser.add_argument("--warmup", type=_count(0), default=5)
    parser.add_argument("--iters", type=_count(1), default=20, help="calls a turn at least (default 20)")
    parser.add_argument(
        "--turn-ms",
        type=_turn_ms,
        default=100.0,
        help="milliseconds a turn lasts at least (default 100; 0: exactly --iters calls)",
    )
    parser.add_argument("--repeats", type=_count(1), default=5)
    parser.add_argument(
        "--sustained",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="time each turn as SECONDS of back-to-back forwards and report SM clock, power and energy per "
        "forward (the power-capped steady state of compute-bound batches); 0 (default): off",
    )
    args = parser.parse_args(argv)
    if not Path(args.out).resolve().parent.is_dir():  # found now, not after minutes of GPU time
        parser.error(f"argument --out: no folder {str(Path(args.out).parent)!r} to write {args.out!r} in")
    command = shlex.join(["python", "benchmarks/forward.py", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import torch

    from kernelmill import runtime

    if not torch.cuda.is_available():
        print("benchmarks/forward.py needs a CUDA GPU", file=sys.stderr)
        return 3
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kernelmill-forward-") as tmp:
        if args.only in (None, "mlp"):
            rows += mlp_cases(torch, runtime, args, Path(tmp))
            torch.cuda.empty_cache()
        if args.only in (None, "bert"):
            rows += bert_cases(torch, runtime, args, Path(tmp))
    print_table(rows)
    print_power(rows)
    verdicts = targets(rows)
    print("\ntargets (issue 4, medians of this run):\n" + "\n".join(f"  {line}" for line in verdicts))
    result = {
        "device": torch.cuda.get_device_name(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": command,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "dtype": "float16",
        "shape_defaults_column": args.shape_defaults,
        "timing": (
            f"wall time per forward, {args.sustained} s of back-to-back calls a turn"
            if args.sustained
            else f"wall time per forward, turns of at least {args.iters} calls and {args.turn_ms:g} ms"
        )
        + f" after {args.warmup} warm-up, median of {args.repeats} (contenders take turns)",
        "rows": rows,
        "targets": verdicts,
    }
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
