"""Sample efficiency of the search strategies, replayed offline from stored exhaustive runs.

    # on a GPU host: exhaustive runs of the cases, recorded in a store (once)
    python benchmarks/search.py collect --db sqlite:///search.db
    # anywhere, no GPU: replay each strategy against what was measured
    python benchmarks/search.py replay --db sqlite:///search.db --json search.json

For each case, the exhaustive run gives the best time; each strategy then runs
with 5 seeds against the recorded trials (a candidate's time, status, ptxas
report, roofline share and, where measured, ncu profile are what the strategy
sees), and we count the evaluations it needs to get within 5% of that best.
The guided strategy is replayed with and without warm starts; its warm starts
come from the *other* cases in the store (never the case itself).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from kernelmill.agents.space import Candidate, Observation, Space
from kernelmill.agents.strategies import get_strategy
from kernelmill.kernels.ops import get_op


@dataclass(frozen=True)
class Case:
    op: str
    shape: tuple[int, ...]
    dtype: str
    families: tuple[str, ...]

    @property
    def key(self) -> str:
        return f"{self.op} {'x'.join(map(str, self.shape))} {self.dtype} [{','.join(self.families)}]"


CASES = [
    Case("softmax", (4096, 1024), "float16", ("block_row",)),
    Case("softmax", (2048, 4096), "float16", ("block_row",)),
    Case("softmax", (1024, 8192), "float32", ("block_row",)),
    Case("softmax", (8192, 512), "bfloat16", ("warp_row",)),
    Case("softmax", (16384, 256), "float16", ("warp_row",)),
]
STRATEGIES = ["random", "evolutionary", "guided", "guided+warm"]
SEEDS = range(5)
BATCH = 8


def collect(db: str, cases: list[Case]) -> None:
    """Exhaustive runs of every case on this GPU, each a job in the store."""
    from kernelmill.agents.evaluator import LocalEvaluator
    from kernelmill.agents.loop import JobPlan, run_job
    from kernelmill.service.db.store import Store
    from kernelmill.service.jobs import StoreRecorder

    evaluator = LocalEvaluator(0, seeds=2, reps=20)  # the GPU first: without one, no database file is left
    store = Store(db)
    facts = evaluator.facts()
    for case in cases:
        size = len(Space(get_op(case.op), case.dtype, case.families))
        job = store.create_job(
            op=case.op, shapes=[list(case.shape)], dtype=case.dtype, attrs={}, strategy="exhaustive",
            budget_trials=size, budget_seconds=3600, arch=facts.arch,
        )  # fmt: skip
        store.start_job(job.id, "benchmark", facts.name)
        plan = JobPlan(
            job.id, case.op, [case.shape], case.dtype, {}, "exhaustive", size, 3600, batch_size=32,
            plateau=10**9, warm_start=False, families=list(case.families),
        )  # fmt: skip
        start = time.monotonic()
        run_job(plan, evaluator, StoreRecorder(store, job.id))
        minutes = (time.monotonic() - start) / 60
        store.finish_job(job.id, "done")
        print(f"{case.key}: {size} trials in {minutes:.2f} min = {size / minutes:.0f} trials/min", flush=True)


def load_cases(db: str, devices: set[str] | None = None) -> dict[Case, dict[str, Observation]]:
    """Recorded exhaustive trials per case: candidate key -> what the strategy may see. ``devices`` gets the
    GPU models they were measured on."""
    from kernelmill.service.db.store import Store
    from kernelmill.service.jobs import _facts

    store = Store(db)
    out: dict[Case, dict[str, Observation]] = {}
    for job in store.jobs_in_state("done"):
        if job.strategy != "exhaustive":
            continue
        if devices is not None:
            devices.add(job.device_name or "unknown")
        for shape in job.shapes:
            trials = store.trials(job.id, "x".join(map(str, shape)))
            families = tuple(sorted({t.family for t in trials}))
            case = Case(job.op, tuple(shape), job.dtype, families)
            out[case] = {
                Candidate.of(t.family, t.params).key: Observation(
                    Candidate.of(t.family, t.params), t.status, t.median_ms, {**_facts(t), "profile": t.profile}
                )
                for t in trials
            }
    return out


def warm_candidates(case: Case, recorded: dict[Case, dict[str, Observation]]) -> list[Candidate]:
    """Best candidate of every other case of the op, nearest problem first (as the service does)."""
    ranked = []
    for other, trials in recorded.items():
        if other == case or other.op != case.op:
            continue
        ok = [o for o in trials.values() if o.ok]
        if not ok:
            continue
        best = min(ok, key=lambda o: o.median_ms)
        distance = sum(abs(math.log(a / b)) for a, b in zip(other.shape, case.shape, strict=True))
        distance += 0.0 if other.dtype == case.dtype else 2.0
        ranked.append((distance, best.candidate.because(f"warm start from {other.key}")))
    return [c for _, c in sorted(ranked, key=lambda r: r[0])]


def replay(case: Case, trials: dict[str, Observation], strategy_name: str, seed: int, warm: list[Candidate]) -> int:
    """Evaluations until a candidate within 5% of the exhaustive best is found."""
    space = Space(get_op(case.op), case.dtype, case.families)
    best = min(o.median_ms for o in trials.values() if o.ok)
    strategy = get_strategy(strategy_name.split("+")[0], seed=seed)
    warm = [c for c in warm if c in space] if strategy_name.endswith("+warm") else []
    history: list[Observation] = []
    while len(history) < len(space):
        seen = {o.candidate.key for o in history}
        batch = [c for c in warm if c.key not in seen][:BATCH]
        warm = [c for c in warm if c not in batch]
        if len(batch) < BATCH:
            batch += strategy.propose(space, history, BATCH - len(batch))
        if not batch:
            break
        for cand in batch:
            obs = trials.get(cand.key) or Observation(cand, "unsupported")
            history.append(obs)
            if obs.ok and obs.median_ms <= 1.05 * best:
                return len(history)
    return len(history)


def run_replay(db: str) -> dict:
    devices: set[str] = set()
    recorded = load_cases(db, devices)
    if not recorded:
        sys.exit(f"no exhaustive jobs in {db}: run `python benchmarks/search.py collect --db {db}` on a GPU first")
    rows = []
    for case, trials in recorded.items():
        size = len(Space(get_op(case.op), case.dtype, case.families))
        warm = warm_candidates(case, recorded)
        row = {"case": case.key, "space": size, "best_ms": min(o.median_ms for o in trials.values() if o.ok)}
        for name in STRATEGIES:
            evals = [replay(case, trials, name, seed, warm) for seed in SEEDS]
            row[name] = statistics.median(evals)
            row[f"{name}_pct"] = 100.0 * statistics.median(evals) / size
        rows.append(row)
    summary = {name: statistics.median(r[f"{name}_pct"] for r in rows) for name in STRATEGIES}
    return {
        "measured_on": sorted(devices), "rows": rows, "median_pct_of_space": summary, "seeds": len(SEEDS),
        "within": 0.05,
    }  # fmt: skip


def print_table(result: dict) -> None:
    head = f"{'case':52} {'space':>5} " + " ".join(f"{s:>16}" for s in STRATEGIES)
    print(head)
    for r in result["rows"]:
        cells = " ".join(f"{r[s]:>7.0f} ({r[f'{s}_pct']:4.1f}%)" for s in STRATEGIES)
        print(f"{r['case']:52} {r['space']:>5} {cells}")
    print(
        f"{'median % of the space':58} " + " ".join(f"{result['median_pct_of_space'][s]:>15.1f}%" for s in STRATEGIES)
    )


def main(argv: list[str] | None = None) -> int:
    from kernelmill.kernels.device import GpuUnavailable
    from kernelmill.service.db.store import DatabaseError

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["collect", "replay"])
    parser.add_argument("--db", default="sqlite:///search.db")
    parser.add_argument("--json", help="write the replay table here")
    args = parser.parse_args(argv)
    if args.json and not Path(args.json).resolve().parent.is_dir():  # found now, not after the run
        parser.error(f"argument --json: no folder {str(Path(args.json).parent)!r} to write {args.json!r} in")
    command = shlex.join(["python", "benchmarks/search.py", *(sys.argv[1:] if argv is None else argv)])
    try:
        if args.mode == "collect":
            collect(args.db, CASES)
            return 0
        result = run_replay(args.db)
    except GpuUnavailable as exc:
        print(f"search.py collect needs a CUDA GPU: {exc}", file=sys.stderr)
        return 3
    except DatabaseError as exc:
        print(f"search.py: {exc}", file=sys.stderr)
        return 3 if exc.unreachable else 2
    print_table(result)
    if args.json:
        result = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "command": command, **result}
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
