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
