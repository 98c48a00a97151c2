"""ncu reads the counters of a real variant (needs ncu on the GPU host)."""

import pytest

from kernelmill.kernels.profile import ProfileUnavailable, find_ncu, profile

pytestmark = pytest.mark.gpu


def test_ncu_profile_of_softmax_has_the_metrics():
    if find_ncu() is None:
        pytest.skip("ncu is not installed here")
    params = {"vec": 8, "unroll": 2, "threads": 256, "fast_exp": False}
    try:
        prof = profile("softmax", "block_row", "float16", params, (4096, 4096))
    except ProfileUnavailable as exc:
        pytest.fail(f"ncu could not profile: {exc}")
    assert prof.kernel == "softmax_block_row"
    m = prof.metrics
    assert m["duration_ns"] > 1000 and 0 < m["dram_pct"] <= 100 and 0 < m["sm_pct"] <= 100
    assert 0 < m["achieved_occupancy_pct"] <= 100 and m["registers"] > 0
    assert prof.top_stalls(), "no warp-stall reasons read"


class _Events:
    """A recorder that keeps only the order of what the loop records: batches and profiles."""

    def __init__(self) -> None:
        self.events: list[tuple[str, bool]] = []

    def observations(self, shape):
        return []

    def record(self, shape, results):
        self.events.append(("batch", all(r.status == "ok" for r in results)))

    def baseline(self, shape):
        return True, None  # no PyTorch timing: not what this test is about

    def record_baseline(self, shape, median_ms, device_name):
        pass

    def cancelled(self):
        return False

    def warm_start(self, shape):
        return []

    def record_profile(self, shape, candidate, profile):
        self.events.append(("profile", "error" not in profile))

    def publish_best(self, shape, served_fields):
        pass


def test_a_guided_job_profiles_its_leader_with_ncu_between_batches():
    """guided reads ncu's word on the leader before it proposes again (ncu used to run only after the search)."""
    if find_ncu() is None:
        pytest.skip("ncu is not installed here")
    from kernelmill.agents.evaluator import LocalEvaluator
    from kernelmill.agents.loop import JobPlan, run_job

    plan = JobPlan(1, "softmax", [(4096, 4096)], "float16", {}, "guided", 24, 600.0, batch_size=8, warm_start=False)
    recorder = _Events()
    assert run_job(plan, LocalEvaluator(0), recorder) == "done"
    kinds = [kind for kind, _ in recorder.events]
    last_batch = len(kinds) - 1 - kinds[::-1].index("batch")
    assert "profile" in kinds[:last_batch], recorder.events  # a profile before the last batch was proposed
    assert all(ok for kind, ok in recorder.events if kind == "profile"), recorder.events
