"""Strategies and the loop's logic (fake device: no kernel correctness here)."""

import pytest

from kernelmill.agents.evaluator import FakeEvaluator, TrialResult
from kernelmill.agents.loop import JobPlan, run_job
from kernelmill.agents.space import Observation, Space
from kernelmill.agents.strategies import STRATEGIES, get_strategy
from kernelmill.agents.strategies.evolutionary import Evolutionary
from kernelmill.agents.strategies.guided import diagnose
from kernelmill.kernels.ops import get_op
from kernelmill.kernels.ops.base import SpecError, format_shape


@pytest.fixture(scope="module")
def space():
    return Space(get_op("softmax"), "float16")


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_proposes_unseen_valid_points_until_exhausted(space, name):
    strategy = get_strategy(name, seed=3)
    history: list[Observation] = []
    first = strategy.propose(space, history, 8)
    assert first[: len(space.defaults())] == space.defaults()[: len(first)]  # defaults first
    while True:
        batch = strategy.propose(space, history, 64)
        if not batch:
            break
        keys = [c.key for c in batch]
        assert len(set(keys)) == len(keys)
        assert all(c in space for c in batch)
        assert not {o.candidate.key for o in history} & set(keys)
        history += [Observation(c, "ok", float(i)) for i, c in enumerate(batch)]
    assert len(history) == len(space)


def test_evolutionary_moves_near_the_best():
    """Its batches hold the best's neighbours (one knob away) far more often than random picks do: over 100
    seeds, 83 against 4 when written. (The crossover's children are of the best's family too.)"""
    space = Space(get_op("softmax"), "float16", ["warp_row", "block_row", "split_row"])
    best = space.candidates[40]
    history = [Observation(best, "ok", 0.1)] + [Observation(c, "ok", 1.0) for c in space.defaults()]
    near = {c.key for c in space.neighbours(best)}

    def batches_near(name: str) -> int:
        batches = (get_strategy(name, seed=seed).propose(space, history, 10) for seed in range(100))
        return sum(any(c.key in near for c in batch) for batch in batches)

    assert batches_near("evolutionary") >= 70 and batches_near("random") <= 15


def test_evolutionary_draws_its_explore_share_at_random_and_breeds_the_rest(space):
    strategy = get_strategy("evolutionary", seed=2)
    history = [Observation(c, "ok", 1.0 + i) for i, c in enumerate(space.defaults())]
    bred = iter(c for c in space.candidates if c not in space.defaults())
    strategy._child = lambda space, parents: next(bred)
    batch = strategy.propose(space, history, 10)
    children = [c for c in space.candidates if c not in space.defaults()][:8]
    assert batch[:8] == children and len(batch) == 10 and not set(batch[8:]) & set(children)


def _bred(parents: list[Observation], seed: int, **kw) -> list:
    """An evolutionary batch of children alone: the defaults already tried (failed), nothing drawn at random."""
    space = Space(get_op("softmax"), "float16", ["block_row", "warp_row"])
    history = [Observation(c, "error") for c in space.defaults()] + parents
    return Evolutionary(seed=seed, explore=0.0, **kw).propose(space, history, 4)


def test_evolutionary_children_can_mix_the_knobs_of_two_parents_of_one_family():
    space = Space(get_op("softmax"), "float16", ["block_row", "warp_row"])
    a = space.valid("block_row", {"vec": 1, "unroll": 1, "threads": 64, "fast_exp": False})
    b = space.valid("block_row", {"vec": 4, "unroll": 4, "threads": 256, "fast_exp": False})
    assert a and b  # every knob two steps apart: no neighbour of either is a mix of the two

    def mixed(c) -> bool:
        return (
            c.family == "block_row"
            and c not in (a, b)
            and all(v in (a.params[k], b.params[k]) for k, v in c.params.items())
        )

    batches = [_bred([Observation(a, "ok", 1.0), Observation(b, "ok", 2.0)], seed) for seed in range(20)]
    assert any(mixed(c) for batch in batches for c in batch)


def test_evolutionary_breeds_from_the_fastest_whatever_the_historys_order():
    space = Space(get_op("softmax"), "float16", ["block_row", "warp_row"])
    slow = space.valid("warp_row", {"vec": 2, "unroll": 2, "rows_per_block": 2, "fast_exp": False})
    fast = space.valid("block_row", {"vec": 2, "unroll": 2, "threads": 128, "fast_exp": False})
    near = set(space.neighbours(fast))
    for seed in range(5):
        batch = _bred([Observation(slow, "ok", 2.0), Observation(fast, "ok", 1.0)], seed, population=1)
        assert batch and set(batch) <= near


def test_neighbours_differ_by_one_knob(space):
    cand = space.defaults()[0]
    for n in space.neighbours(cand):
        diff = [k for k in cand.params if cand.params[k] != n.params[k]]
        assert len(diff) == 1


class MemoryRecorder:
    def __init__(self):
        self.trials: dict[str, list[TrialResult]] = {}
        self.baselines: dict[str, float | None] = {}
        self.published: dict[str, tuple] = {}
        self.cancel_after: int | None = None
        self.warm: list = []
        self.profiles: dict = {}

    def observations(self, shape):
        return [Observation(r.candidate, r.status, r.median_ms) for r in self.trials.get(shape, [])]

    def record(self, shape, results):
        self.trials.setdefault(shape, []).extend(results)

    def baseline(self, shape):
        return shape in self.baselines, self.baselines.get(shape)

    def record_baseline(self, shape, median_ms, device_name):
        self.baselines[shape] = median_ms

    def cancelled(self):
        done = sum(len(v) for v in self.trials.values())
        return self.cancel_after is not None and done >= self.cancel_after

    def warm_start(self, shape):
        return list(self.warm)

    def record_profile(self, shape, candidate, profile):
        self.profiles[(shape, candidate.key)] = profile

    def publish_best(self, shape, served_fields):
        ok = [r for r in self.trials.get(shape, []) if r.status == "ok"]
        if ok:
            best = min(ok, key=lambda r: r.median_ms)
            self.published[shape] = (best, served_fields(best.family, best.params))


def plan(**kw):
    base = dict(
        job_id=1,
        op="softmax",
        shapes=[(256, 256), (64, 1000)],
        dtype="float16",
        attrs={},
        strategy="random",
        budget_trials=30,
        budget_seconds=60,
    )
    return JobPlan(**{**base, **kw})


def test_loop_spends_budget_per_shape_records_failures_and_publishes():
    rec = MemoryRecorder()
    progress = []
    state = run_job(plan(), FakeEvaluator(fail_every=5), rec, progress.append)
    assert state == "done"
    assert [len(rec.trials[s]) for s in ("256x256", "64x1000")] == [15, 15]
    assert any(r.status != "ok" for rs in rec.trials.values() for r in rs)
    assert set(rec.published) == {"256x256", "64x1000"}
    best, fields = rec.published["64x1000"]
    assert fields["launches"][0]["args"][-2:] == [64, 1000] and "__global__" in fields["source"]
    assert progress[-1].trials == 30 and progress[-1].speedup == pytest.approx(1.0 / progress[-1].best_ms)
    assert progress[-1].failed == sum(r.status != "ok" for rs in rec.trials.values() for r in rs) > 0


def test_the_trial_budget_is_split_over_the_shapes_and_never_exceeded():
    """A budget of 4 over 3 shapes ran 2 a shape (6 trials): each shape took the budget divided and rounded up."""
    rec = MemoryRecorder()
    progress = []
    shapes = [(256, 256), (64, 1000), (128, 512)]
    run_job(plan(shapes=shapes, budget_trials=4), FakeEvaluator(fail_every=0), rec, progress.append)
    assert [len(rec.trials[k]) for k in ("256x256", "64x1000", "128x512")] == [2, 1, 1]
    assert progress[-1].trials == 4 and progress[-1].budget == 4


def test_a_warm_start_that_is_also_a_shape_default_is_tried_once():
    """It went into the first batch twice: run twice on the GPU, and a trial counted that the store drops."""
    from kernelmill.agents.loop import shape_defaults
    from kernelmill.agents.space import Space
    from kernelmill.kernels.ops import get_op

    space = Space(get_op("softmax"), "float16").for_shape((256, 256))
    default = shape_defaults(space, (256, 256), FakeEvaluator().facts())[0]
    rec = MemoryRecorder()
    rec.warm = [default.because("warm start: best of softmax 512x512")]
    run_job(plan(shapes=[(256, 256)], budget_trials=6), FakeEvaluator(fail_every=0), rec)
    keys = [r.candidate.key for r in rec.trials["256x256"]]
    assert len(keys) == 6 and len(set(keys)) == 6 and keys[0] == default.key


def test_loop_resumes_from_history_without_rerunning():
    rec = MemoryRecorder()
    rec.cancel_after = 8  # stopped (a service stopping) within the first shape
    run_job(plan(budget_trials=20), FakeEvaluator(), rec)
    first = [r.candidate.key for r in rec.trials["256x256"]]
    rec.cancel_after = None
    run_job(plan(budget_trials=20), FakeEvaluator(), rec)
    keys = [r.candidate.key for r in rec.trials["256x256"]]
    assert len(first) == 8 and keys[:8] == first and len(keys) == 10 and len(set(keys)) == 10
    assert len(rec.trials["64x1000"]) == 10


def test_loop_stops_on_cancel_and_on_time():
    rec = MemoryRecorder()
    rec.cancel_after = 8
    assert run_job(plan(budget_trials=200), FakeEvaluator(), rec) == "cancelled"
    assert sum(len(v) for v in rec.trials.values()) == 8
    ticks = iter(range(1000))
    rec2 = MemoryRecorder()
    assert run_job(plan(budget_seconds=3), FakeEvaluator(), rec2, clock=lambda: next(ticks)) == "done"
    assert sum(len(v) for v in rec2.trials.values()) < 30


def test_the_time_budget_is_shared_by_the_shapes():
    """The first shape took all of it: the others got not even a baseline, and the job ended "done"."""
    shapes = [(256, 256), (64, 1000), (128, 512)]
    ticks = iter(range(10_000))
    rec = MemoryRecorder()
    job = plan(shapes=shapes, budget_trials=600, budget_seconds=60, batch_size=2)
    assert run_job(job, FakeEvaluator(fail_every=0), rec, clock=lambda: next(ticks)) == "done"
    ran = [len(rec.trials.get(format_shape(s), [])) for s in shapes]
    assert all(n >= 2 for n in ran) and sum(ran) < 600 and set(rec.baselines) == {format_shape(s) for s in shapes}


def test_no_shape_starts_once_the_jobs_time_is_spent():
    """A later shape still timed its PyTorch baseline past the job's deadline."""
    now = [0.0]

    class Slow(FakeEvaluator):
        def evaluate(self, *args, **kwargs):
            now[0] += 100.0  # one batch outlives the 60 s budget
            return super().evaluate(*args, **kwargs)

    rec = MemoryRecorder()
    job = plan(shapes=[(256, 256), (64, 1000)], budget_trials=20, budget_seconds=60, batch_size=2)
    assert run_job(job, Slow(fail_every=0), rec, clock=lambda: now[0]) == "done"
    assert set(rec.baselines) == {"256x256"} and set(rec.trials) == {"256x256"}


def test_a_cancel_during_the_last_batch_or_profiling_ends_cancelled_and_publishes_nothing():
    """It ended "done" and published: the loop asked only before each batch."""
    rec = MemoryRecorder()
    rec.cancel_after = 6  # reached by the last batch of the only shape
    assert run_job(plan(shapes=[(256, 256)], budget_trials=6), FakeEvaluator(), rec) == "cancelled"
    assert rec.published == {}


def test_profiling_stops_at_the_time_budget():
    """It ran past the budget (16x over in one case) and left the later shapes no time."""
    profiled, batches = [], []

    class Profiling(FakeEvaluator):
        def evaluate(self, *args, **kwargs):
            batches.append(1)
            return super().evaluate(*args, **kwargs)

        def profile(self, op, shape, dtype, attrs, candidate):
            profiled.append(candidate)
            return {"dram_pct": 50.0}

    def clock() -> float:  # the one batch of trials takes the whole budget
        return 100.0 if batches else 0.0

    rec = MemoryRecorder()
    job = plan(shapes=[(256, 256)], budget_trials=8, batch_size=8, budget_seconds=60, profile_top_k=3)
    run_job(job, Profiling(fail_every=0), rec, clock=clock)
    assert len(rec.trials["256x256"]) == 8 and profiled == [] and "256x256" in rec.published
    run_job(plan(shapes=[(64, 64)], budget_trials=4, profile_top_k=2), Profiling(fail_every=0), MemoryRecorder())
    assert len(profiled) == 2  # within the budget: the top two


def test_an_evaluator_that_answers_fewer_results_than_candidates_is_named():
    class Short(FakeEvaluator):
        def evaluate(self, *args, **kwargs):
            return super().evaluate(*args, **kwargs)[:-1]

    with pytest.raises(RuntimeError, match=r"^the evaluator answered 7 results for 8 candidates$"):
        run_job(plan(shapes=[(256, 256)], budget_trials=8, batch_size=8), Short(), MemoryRecorder())


def test_loop_stops_on_plateau():
    rec = MemoryRecorder()
    run_job(plan(shapes=[(256, 256)], budget_trials=400, plateau=10, batch_size=2), FakeEvaluator(fail_every=0), rec)
    assert len(rec.trials["256x256"]) < 400


def test_the_plateau_counts_trials_since_the_last_gain_of_one_percent():
    """Scripted times, one trial a batch: gains under 1% do not reset the count, and the loop stops when the
    count reaches the plateau, not a trial later (each mutation survived the loose test above)."""
    times = iter([10.0, 9.0, 8.95, 8.92, 7.0, 6.95, 6.94, 6.93, 6.92, 6.91, 6.90, 6.89, 6.88])

    class Scripted(FakeEvaluator):
        def evaluate(self, *args, **kwargs):
            results = super().evaluate(*args, **kwargs)
            for r in results:
                r.status, r.reason, r.median_ms = "ok", None, next(times)
            return results

    rec = MemoryRecorder()
    run_job(plan(shapes=[(256, 256)], budget_trials=100, plateau=4, batch_size=1), Scripted(fail_every=0), rec)
    # 10, 9 (gain), 8.95 and 8.92 (under 1%), 7 (gain: the count starts again), then four under 1%: stop.
    assert [t.median_ms for t in rec.trials["256x256"]] == [10.0, 9.0, 8.95, 8.92, 7.0, 6.95, 6.94, 6.93, 6.92]


def test_a_shape_whose_every_trial_failed_says_so_and_a_job_with_none_verified_fails(caplog):
    """48 failures in a row were logged as "plateau after 48 trials", at info, as if the search had converged;
    and a job none of whose trials verified ended "done", nothing served and no reason given."""
    from kernelmill.agents.loop import NothingVerified

    class Failing(FakeEvaluator):
        def evaluate(self, op, shape, dtype, attrs, candidates):
            if shape == (512, 512):
                return super().evaluate(op, shape, dtype, attrs, candidates)
            statuses = ("compile_error", "compile_error", "wrong_result")
            return [TrialResult(c.family, c.params, statuses[i % 3], "boom") for i, c in enumerate(candidates)]

    rec = MemoryRecorder()
    with caplog.at_level("INFO", logger="kernelmill.agents.loop"), pytest.raises(NothingVerified) as failed:
        run_job(plan(shapes=[(256, 256)], budget_trials=100, plateau=12, batch_size=6), Failing(), rec)
    assert str(failed.value) == (
        "no trial verified, so nothing is served: 256x256: 12 trials: 8 compile_error, 4 wrong_result (each one's "
        "reason: the dashboard's /jobs/1, or GET /api/jobs/1/trials)"
    )
    assert len(rec.trials["256x256"]) == 12 and rec.published == {}
    said = [(r.levelname, r.getMessage()) for r in caplog.records if "256x256" in r.getMessage()]
    assert said == [
        ("WARNING", "job 1 256x256: no trial verified (12 trials: 8 compile_error, 4 wrong_result): nothing served")
    ]
    # One shape verified: the job is done, what verified served.
    rec = MemoryRecorder()
    both = plan(shapes=[(256, 256), (512, 512)], budget_trials=100, plateau=12, batch_size=6)
    assert run_job(both, Failing(), rec) == "done" and list(rec.published) == ["512x512"]


def test_a_resumed_job_counts_its_recorded_trials_towards_the_plateau():
    """Restarted, it began counting from 0 and spent another plateau's worth of trials on a shape that had
    stopped improving, before the shapes it had not reached."""
    rec = MemoryRecorder()
    job = plan(shapes=[(256, 256)], budget_trials=400, plateau=10, batch_size=2)
    run_job(job, FakeEvaluator(fail_every=0), rec)
    ran = len(rec.trials["256x256"])
    assert ran < 400
    run_job(job, FakeEvaluator(fail_every=0), rec)  # resumed: the plateau is already reached
    assert len(rec.trials["256x256"]) == ran


def test_a_resumed_job_leaves_the_shapes_an_earlier_start_finished():
    """A shape the first start had left at its share of the time was searched again when the job resumed, taking
    the time of the shapes after it (12 trials grew to 16, and the second shape got 4 trials, not 8)."""
    now = [0.0]

    class Slow(FakeEvaluator):
        def evaluate(self, *args, **kwargs):
            now[0] += 10.0  # a batch
            return super().evaluate(*args, **kwargs)

    rec = MemoryRecorder()
    rec.cancel_after = 14  # the service stops during the second shape's first batch
    job = plan(shapes=[(256, 256), (64, 1000)], budget_trials=400, budget_seconds=100, batch_size=2, plateau=1000)
    assert run_job(job, Slow(fail_every=0), rec, clock=lambda: now[0]) == "cancelled"
    assert {k: len(v) for k, v in rec.trials.items()} == {"256x256": 12, "64x1000": 2}  # the first at 60 s of 50
    rec.cancel_after, job.budget_seconds = None, 100 - now[0]  # resumed with the 30 s left
    assert run_job(job, Slow(fail_every=0), rec, clock=lambda: now[0]) == "done"
    assert {k: len(v) for k, v in rec.trials.items()} == {"256x256": 12, "64x1000": 2 + 8}


@pytest.mark.parametrize("strategy", ["guided", "evolutionary"])
@pytest.mark.parametrize("change", ["value", "knob added", "family renamed"])
def test_a_job_resumed_past_a_change_of_a_templates_knobs_goes_on(space, strategy, change):
    """Its trials recorded before an upgrade changed a knob (a value dropped, a knob added) or renamed a family
    were parents whose knob values were not in the list: ValueError ("3 is not in list") or KeyError, and the
    resumed job failed."""
    block_row = next(c for c in space.defaults() if c.family == "block_row").params
    stale = {**block_row, "vec": 3} if change == "value" else {k: v for k, v in block_row.items() if k != "vec"}
    family = "old_row" if change == "family renamed" else "block_row"
    stale = block_row if change == "family renamed" else stale
    rec = MemoryRecorder()
    old = [
        TrialResult("block_row", block_row, "ok", median_ms=0.1),
        TrialResult(family, stale, "ok", median_ms=0.2),  # a parent of each strategy (the second fastest)
    ]
    rec.trials["256x256"] = old
    job = plan(shapes=[(256, 256)], strategy=strategy, budget_trials=18, batch_size=8)
    assert run_job(job, FakeEvaluator(fail_every=0), rec) == "done"
    keys = [r.candidate.key for r in rec.trials["256x256"]]
    assert len(keys) == 18 and len(set(keys)) == 18


def test_warm_start_candidates_go_right_after_the_shape_defaults_with_their_reason(space):
    """The defaults first: a small share spent on warm starts left the runtime's own default untried."""
    from kernelmill.agents.loop import shape_defaults

    rec = MemoryRecorder()
    picks = [space.candidates[77], space.candidates[200]]
    rec.warm = [c.because("warm start: best of softmax 512x512") for c in picks]
    defaults = shape_defaults(space.for_shape((256, 256)), (256, 256), FakeEvaluator().facts())
    run_job(plan(shapes=[(256, 256)], budget_trials=len(defaults) + 3), FakeEvaluator(fail_every=0), rec)
    tried = rec.trials["256x256"]
    assert [r.candidate for r in tried[: len(defaults)]] == defaults
    warm = tried[len(defaults) : len(defaults) + 2]
    assert [r.candidate for r in warm] == picks
    assert all(r.note.startswith("warm start") for r in warm)


def test_a_search_on_a_gpu_without_wgmma_never_tries_it():
    """wgmma runs on sm_90 alone: on an sm_80 GPU its shape default was compiled, refused by Family.target,
    and the uncaught SpecError failed the job."""
    matmul = get_op("matmul")
    assert any(c.family == "wgmma" for c in Space(matmul, "float16").for_arch("sm_90").candidates)
    assert not any(c.family == "wgmma" for c in Space(matmul, "float16").for_arch("sm_80").candidates)
    rec = MemoryRecorder()
    job = plan(op="matmul", shapes=[(256, 1024, 1024)], budget_trials=12, batch_size=4)
    assert run_job(job, FakeEvaluator(arch="sm_80", fail_every=0), rec) == "done"
    families = {r.candidate.family for r in rec.trials["256x1024x1024"]}
    assert len(rec.trials["256x1024x1024"]) == 12 and "wgmma" not in families and "tensorcore" in families


def test_a_job_with_a_shape_no_variant_runs_at_on_its_gpu_fails_saying_so():
    """A job for any arch naming wgmma, run on an sm_80 GPU: it timed PyTorch and ended "done" without a trial or
    a word beyond a log line that blamed the shape."""
    rec = MemoryRecorder()
    job = plan(op="matmul", shapes=[(256, 512, 512), (64, 64, 64)], families=["wgmma"], budget_trials=20)
    said = r"^256x512x512: no variant of matmul float16 \(wgmma\) runs at this shape on sm_80$"
    with pytest.raises(SpecError, match=said):
        run_job(job, FakeEvaluator(arch="sm_80", fail_every=0), rec)
    assert rec.baselines == {} and rec.trials == {}
    refused = r"^64x64x64: no variant of matmul float16 \(gemv\) runs at this shape on sm_90: M=64 > max_m=32"
    with pytest.raises(SpecError, match=refused):  # the shape's own reason, where the families refuse it anywhere
        run_job(plan(op="matmul", shapes=[(64, 64, 64)], families=["gemv"]), FakeEvaluator(), rec)


class SkippingEvaluator(FakeEvaluator):
    """Its first batch: the first candidate faults and poisons the context, the others are skipped."""

    def __init__(self, skip_all: bool = False):
        super().__init__(fail_every=0)
        self.batches: list[list[str]] = []
        self.skip_all = skip_all

    def evaluate(self, op, shape, dtype, attrs, candidates):
        from kernelmill.agents.evaluator import SKIPPED

        self.batches.append([c.key for c in candidates])
        results = super().evaluate(op, shape, dtype, attrs, candidates)
        if len(self.batches) == 1 or self.skip_all:
            faulted = [] if self.skip_all else [TrialResult(results[0].family, results[0].params, "fault", "boom")]
            skipped = [TrialResult(r.family, r.params, SKIPPED, "context poisoned") for r in results[len(faulted) :]]
            return faulted + skipped
        return results


def test_candidates_a_poisoned_context_skipped_run_first_in_the_next_batch():
    evaluator, rec = SkippingEvaluator(), MemoryRecorder()
    run_job(plan(shapes=[(256, 256)], budget_trials=8, batch_size=4), evaluator, rec)
    first, second = evaluator.batches[:2]
    assert second[:3] == first[1:]  # the shape defaults it skipped, before anything new
    assert [r.status for r in rec.trials["256x256"]][:4] == ["fault", "ok", "ok", "ok"]


def test_a_batch_skipped_whole_is_an_error_not_an_endless_loop():
    with pytest.raises(RuntimeError, match="skipped every candidate of a batch of 4"):
        run_job(
            plan(shapes=[(256, 256)], budget_trials=8, batch_size=4), SkippingEvaluator(skip_all=True), MemoryRecorder()
        )


def test_the_runtime_default_for_the_shape_is_among_the_first_trials():
    from kernelmill.kernels.defaults import default_params
    from kernelmill.kernels.ops import get_op

    rec = MemoryRecorder()
    shape = (1, 4096, 11008)
    job = plan(op="matmul", shapes=[shape], budget_trials=8, batch_size=8)
    run_job(job, FakeEvaluator(fail_every=0), rec)
    spec = get_op("matmul")
    gemv = default_params(spec, spec.family("gemv"), shape, "float16")
    first = rec.trials["1x4096x11008"][:8]
    assert gemv["pipeline"] == 2 and gemv["k_splits"] == 8  # few column strips: the deep split
    assert any(r.candidate.family == "gemv" and r.candidate.params == gemv for r in first)
    assert all(r.note == "default for this shape" for r in first if r.candidate.params == gemv)


def test_split_and_swapped_wgmma_tiles_are_tried_early():
    rec = MemoryRecorder()
    job = plan(op="linear", shapes=[(256, 4096, 11008)], budget_trials=16, batch_size=8)
    run_job(job, FakeEvaluator(fail_every=0), rec)
    first = [r for r in rec.trials["256x4096x11008"][:8] if r.candidate.family == "wgmma"]  # the seeds
    tiles = {(p["BM"], p["BN"], p["k_splits"], p["swap_ab"]) for p in (r.candidate.params for r in first)}
    assert (128, 64, 1, False) in tiles  # the shape default
    assert {(128, 128, 2, False), (128, 128, 2, True)} <= tiles  # the H200's best down projection, split 2 ways
    assert all(r.note in ("default for this shape", "a split or swapped tile for this shape") for r in first)


def test_a_search_never_spends_trials_on_variants_that_reject_its_shape():
    from kernelmill.kernels.ops import get_op

    spec = get_op("linear")
    space = Space(spec, "float16")
    at_256 = space.for_shape((256, 4096, 4096))
    gemv = [c for c in space.candidates if c.family == "gemv"]
    assert gemv and not any(c.family == "gemv" for c in at_256.candidates)  # gemv serves M <= max_m <= 32
    assert 0 < len(at_256) < len(space) and all(c in space for c in at_256.candidates)
    assert all(c.family != "gemv" for c in at_256.defaults())
    rec = MemoryRecorder()
    job = plan(op="linear", shapes=[(256, 4096, 4096)], budget_trials=40, batch_size=8)
    run_job(job, FakeEvaluator(fail_every=0), rec)
    trials = rec.trials["256x4096x4096"]
    assert len(trials) == 40 and all(r.candidate.family != "gemv" for r in trials)


def test_top_trials_are_profiled_after_the_search():
    rec = MemoryRecorder()
    run_job(plan(shapes=[(256, 256)], budget_trials=12, profile_top_k=2), FakeEvaluator(fail_every=0), rec)
    ok = sorted((r for r in rec.trials["256x256"] if r.status == "ok"), key=lambda r: r.median_ms)
    assert set(rec.profiles) == {("256x256", r.candidate.key) for r in ok[:2]}


def test_guided_reads_the_leaders_profile_while_it_searches_and_ncu_missing_is_asked_once(monkeypatch):
    """ncu ran only after a shape's search, so guided's ncu diagnosis could never fire during it."""
    import kernelmill.agents.loop as loop_module

    seen_profiles = []

    def recording(name, seed=0):
        strategy = get_strategy(name, seed=seed)
        propose = strategy.propose

        def watched(space, history, n):
            ranked = sorted((o for o in history if o.ok), key=lambda o: o.median_ms)
            seen_profiles.append(bool(ranked) and "profile" in ranked[0].facts)
            return propose(space, history, n)

        strategy.propose = watched
        return strategy

    monkeypatch.setattr(loop_module, "get_strategy", recording)
    rec = MemoryRecorder()
    run_job(plan(strategy="guided", shapes=[(256, 256)], budget_trials=32), FakeEvaluator(fail_every=0), rec)
    # Its first batch has no trial to read; each later one sees the leader's profile.
    assert seen_profiles[0] is False and all(seen_profiles[1:]) and len(seen_profiles) >= 3
    assert len(rec.profiles) >= 3  # the leaders as they changed, then the top 3 at the end

    class NoNcu(FakeEvaluator):
        asked = 0

        def profile(self, op, shape, dtype, attrs, candidate):
            NoNcu.asked += 1
            return {"error": "ncu is not installed"}

    job = plan(strategy="guided", shapes=[(256, 256), (512, 512)], budget_trials=32)
    run_job(job, NoNcu(fail_every=0), MemoryRecorder())
    assert NoNcu.asked == 1  # not again after each batch, nor for the next shape


def test_one_variant_that_fails_under_ncu_does_not_stop_the_others_being_profiled():
    """A variant that crashed or hung under ncu was taken as "ncu cannot run here": no other was profiled."""
    asked = []

    class OneFails(FakeEvaluator):
        def profile(self, op, shape, dtype, attrs, candidate):
            asked.append(candidate.key)
            if len(asked) == 1:
                return {"error": "ncu could not profile this variant (exit 1): ...", "unavailable": False}
            return super().profile(op, shape, dtype, attrs, candidate)

    rec = MemoryRecorder()
    run_job(plan(shapes=[(256, 256), (512, 512)], budget_trials=24, profile_top_k=3), OneFails(fail_every=0), rec)
    assert len(asked) == 6  # the top three of each shape, the first failing
    failed = [p for p in rec.profiles.values() if "error" in p]
    assert len(failed) == 1 and failed[0]["unavailable"] is False  # its reason is stored with its trial

    class NoCounters(FakeEvaluator):
        asked = 0

        def profile(self, op, shape, dtype, attrs, candidate):
            NoCounters.asked += 1
            return {"error": "ncu cannot profile on this machine: ERR_NVGPUCTRPERM", "unavailable": True}

    run_job(plan(shapes=[(256, 256), (512, 512)], budget_trials=24, profile_top_k=3), NoCounters(), MemoryRecorder())
    assert NoCounters.asked == 1  # the machine's failure: once is enough


def test_the_local_evaluator_tells_the_machines_profiling_failure_from_the_variants(monkeypatch):
    from types import SimpleNamespace

    import kernelmill.kernels.profile as kprofile
    from kernelmill.agents.evaluator import LocalEvaluator
    from kernelmill.agents.space import Candidate

    evaluator = LocalEvaluator.__new__(LocalEvaluator)  # no GPU here: only its profile() is under test
    evaluator.device = SimpleNamespace(info=SimpleNamespace(arch="sm_90"))
    cand = Candidate.of("block_row", {"vec": 8, "unroll": 2, "threads": 256, "fast_exp": False})
    for exc, unavailable in ((kprofile.ProfileFailed("hung"), False), (kprofile.ProfileUnavailable("no ncu"), True)):

        def failing(*args, exc=exc, **kwargs):
            raise exc

        monkeypatch.setattr(kprofile, "profile", failing)
        got = evaluator.profile("softmax", (64, 64), "float16", {}, cand)
        assert got == {"error": str(exc), "unavailable": unavailable}


def test_profiling_leaders_mid_search_takes_at_most_its_share_of_the_shapes_time():
    """ncu takes seconds a kernel: a leader changing at every batch would have had the search mostly profiling."""
    now = [0.0]
    events = []

    class Slow(FakeEvaluator):
        def evaluate(self, op, shape, dtype, attrs, candidates):
            now[0] += 5.0  # a batch
            events.append("batch")
            return super().evaluate(op, shape, dtype, attrs, candidates)

        def profile(self, op, shape, dtype, attrs, candidate):
            now[0] += 100.0  # an ncu run
            events.append("profile")
            return super().profile(op, shape, dtype, attrs, candidate)

    rec = MemoryRecorder()
    job = plan(strategy="guided", shapes=[(256, 256)], budget_trials=64, budget_seconds=10_000, plateau=1000)
    run_job(job, Slow(fail_every=0), rec, clock=lambda: now[0])
    last_batch = len(events) - 1 - events[::-1].index("batch")
    ranked = [min(r.median_ms for r in rec.trials["256x256"][: 8 * (i + 1)] if r.status == "ok") for i in range(8)]
    assert len(set(ranked)) >= 2  # the leader changed: without the share, its new leader was profiled too
    assert events[:last_batch].count("profile") == 1  # the first; then 100 s had to be under a quarter of the time


def test_guided_explains_moves_and_shrinks_spilling_tiles():
    space = Space(get_op("matmul"), "float16", ["simt"])
    strategy = get_strategy("guided", seed=0)
    default = space.defaults()[0]
    history = [Observation(default, "ok", 1.0, {"spill_bytes": 64, "registers": 255})]
    batch = strategy.propose(space, history, 6)
    assert all(c.note for c in batch)
    moved = [c for c in batch if c.note.startswith("best spills")]
    assert moved, [c.note for c in batch]
    for c in moved[:3]:
        knob = next(k for k in default.params if default.params[k] != c.params[k])
        assert c.params[knob] < default.params[knob]  # the top-scored moves shrink a tile knob


def test_guided_memory_bound_profile_asks_for_more_in_flight():
    space = Space(get_op("softmax"), "float16", ["block_row"])
    base = space.valid("block_row", {"vec": 4, "unroll": 2, "threads": 256, "fast_exp": False})
    profile = {"dram_pct": 55.0, "sm_pct": 20.0, "achieved_occupancy_pct": 60.0, "registers": 40}
    history = [Observation(c, "ok", 2.0) for c in space.defaults()]
    history.append(Observation(base, "ok", 0.5, {"profile": profile}))
    batch = get_strategy("guided").propose(space, history, 4)
    first = batch[0]
    assert first.note.startswith("memory-bound at 55%")
    knob = next(k for k in base.params if base.params[k] != first.params[k])
    assert knob in {"vec", "unroll"} and first.params[knob] > base.params[knob]


@pytest.mark.parametrize(
    "facts, goal",
    [
        ({"profile": {"dram_pct": 30.0, "sm_pct": 90.0}}, "refine"),  # compute-bound: not memory-bound
        ({"profile": {"dram_pct": 85.0, "sm_pct": 20.0}}, "refine"),  # DRAM near its peak: nothing more in flight
        ({"profile": {"dram_pct": 55.0, "sm_pct": 20.0}}, "in_flight"),
        (
            {"profile": {"dram_pct": 20.0, "sm_pct": 90.0, "achieved_occupancy_pct": 20.0, "registers": 200}},
            "occupancy",
        ),
        ({"roofline_pct": 30.0}, "in_flight"),  # no profile: a low share of the roofline
        ({"roofline_pct": 90.0}, "refine"),
        ({}, "refine"),
    ],
)
def test_guided_diagnosis_follows_the_profile_and_the_roofline(facts, goal):
    space = Space(get_op("softmax"), "float16", ["block_row"])
    assert diagnose(Observation(space.defaults()[0], "ok", 1.0, facts))[0] == goal


class PrecisionRecorder(FakeEvaluator):
    """A fake GPU that remembers the precision each PyTorch baseline was asked in."""

    def __init__(self):
        super().__init__(fail_every=0)
        self.baseline_precisions = []

    def baseline_ms(self, op, shape, dtype, attrs, precision=None):
        self.baseline_precisions.append(precision)
        return 1.0


def test_float32_searches_are_ieee_unless_a_tf32_family_is_named():
    spec = get_op("matmul")
    default = Space(spec, "float32")
    assert default.precision == "float32" and "tensorcore" not in default.families and "simt" in default.families
    assert Space(spec, "float16").precision == "float16" and "tensorcore" in Space(spec, "float16").families
    assert Space(spec, "float32", ["tensorcore"]).precision == "tf32"
    with pytest.raises(SpecError, match=r"simt as float32, tensorcore as tf32.*separate jobs"):
        Space(spec, "float32", ["simt", "tensorcore"])


@pytest.mark.parametrize(("families", "want"), [(None, "float32"), (["tensorcore"], "tf32")])
def test_the_baseline_is_timed_in_the_searchs_precision(families, want):
    evaluator = PrecisionRecorder()
    job = plan(op="matmul", dtype="float32", shapes=[(64, 64, 64)], budget_trials=4, families=families)
    run_job(job, evaluator, MemoryRecorder())
    assert evaluator.baseline_precisions == [want]
    assert Space.refuses(get_op("matmul"), "float32", (64, 64, 64)) is None


@pytest.mark.parametrize(
    ("op", "dtype", "shape", "families", "said"),
    [  # the loosest limit among the variants, not the first variant's (it said max_head_dim 32, max_m=1)
        ("attention", "float32", (1, 1, 1, 257), None, "head_dim 257 > max_head_dim 256 of this variant"),
        ("matmul", "float16", (4096, 4096, 4096), ["gemv"], "M=4096 > max_m=32"),
        ("mlp_stack", "float16", (64, 64, 64, 2), None, "batch=64 > max_m=8"),
    ],
)
def test_a_refused_shape_is_refused_with_the_loosest_limit_of_its_variants(op, dtype, shape, families, said):
    assert Space.refuses(get_op(op), dtype, shape, families).startswith(said)
