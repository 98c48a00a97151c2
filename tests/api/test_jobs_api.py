"""The whole job lifecycle over REST with the fake device (logic only), and every 422/404 path."""

import json
import re

import pytest

from kernelmill.service.jobs import MIN_BUDGET_SECONDS, JobError, validate_submission
from kernelmill.settings import Settings
from tests.api.conftest import SOFTMAX_JOB, make_client, wait_state


def test_job_lifecycle_serves_best_kernel(client):
    resp = client.post("/api/jobs", json=SOFTMAX_JOB)
    assert resp.status_code == 201, resp.text
    job = resp.json()
    assert job["state"] in ("queued", "running") and job["shapes"] == [[1024, 1024], [4096, 512]]

    job = wait_state(client, job["id"])
    assert job["state"] == "done", job
    assert job["trials_done"] == 24 and job["worker"].startswith("fake-gpu")
    for shape in job["per_shape"]:
        assert shape["trials"] == 12
        assert shape["best_ms"] and shape["baseline_ms"] == 1.0
        assert shape["speedup"] == pytest.approx(1.0 / shape["best_ms"])

    page = client.get(f"/api/jobs/{job['id']}/trials", params={"sort": "median_ms", "limit": 5}).json()
    assert page["total"] == 24 and len(page["items"]) == 5
    times = [t["median_ms"] for t in page["items"] if t["median_ms"] is not None]
    assert times == sorted(times)
    failed = client.get(f"/api/jobs/{job['id']}/trials", params={"status": "wrong_result"}).json()
    assert failed["total"] == job["trials_failed"]
    assert all(t["reason"] for t in failed["items"])

    best = client.get("/api/kernels/best", params={"op": "softmax", "shape": "1024x1024", "dtype": "float16"}).json()
    assert best["exact"] is True and best["median_ms"] == pytest.approx(job["per_shape"][0]["best_ms"])
    assert 'extern "C" __global__' in best["source"] and best["launches"][0]["entry"].startswith("softmax_")
    near = client.get("/api/kernels/best", params={"op": "softmax", "shape": "4000x500", "dtype": "float16"}).json()
    assert near["exact"] is False and near["shape"] == [4096, 512]

    kernel = client.get(f"/api/kernels/{best['id']}").json()
    assert kernel["params"] == best["params"]
    cubin = client.get(f"/api/kernels/{best['id']}/cubin")
    assert cubin.status_code == 200 and cubin.content == b"fake-cubin"
    listing = client.get("/api/kernels", params={"op": "softmax"}).json()
    assert listing["total"] == 2


def test_list_jobs_filters_and_pages(client):
    ids = [client.post("/api/jobs", json=SOFTMAX_JOB).json()["id"] for _ in range(3)]
    for job_id in ids:
        wait_state(client, job_id)
    page = client.get("/api/jobs", params={"limit": 2}).json()
    assert page["total"] == 3 and len(page["items"]) == 2 and page["items"][0]["id"] == ids[-1]
    assert client.get("/api/jobs", params={"state": "done", "op": "softmax"}).json()["total"] == 3
    assert client.get("/api/jobs", params={"op": "matmul"}).json()["total"] == 0
    for empty in ("op", "state"):  # an empty filter is no filter
        assert client.get("/api/jobs", params={empty: ""}).json()["total"] == 3
    served = client.get("/api/kernels").json()["total"]
    for field in ("dtype", "precision", "op", "arch"):
        assert served and client.get("/api/kernels", params={field: ""}).json()["total"] == served, field
    for url, said in [  # a typo answered an empty page
        ("/api/jobs?op=sofmax", "unknown op 'sofmax'"),
        ("/api/kernels?op=sofmax", "unknown op 'sofmax'"),
        ("/api/jobs?state=finished", "unknown state 'finished': one of queued, running, done, failed, cancelled"),
    ]:
        resp = client.get(url)
        assert resp.status_code == 422 and said in resp.json()["detail"], url


def test_cancel(client):
    job = client.post("/api/jobs", json={**SOFTMAX_JOB, "budget": {"trials": 4000, "seconds": 600}}).json()
    resp = client.post(f"/api/jobs/{job['id']}/cancel")
    assert resp.status_code == 200
    # A running job says its cancel is pending (it looked like any running job); a queued one ends at once.
    answer = resp.json()
    assert answer["cancel_requested"] is True if answer["state"] == "running" else answer["state"] == "cancelled"
    job = wait_state(client, job["id"])
    assert job["state"] == "cancelled" and job["cancel_requested"] is False
    again = client.post(f"/api/jobs/{job['id']}/cancel")
    assert again.status_code == 409 and "already cancelled" in again.json()["detail"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"op": "conv2d"}, "unknown op"),
        ({"dtype": "float64"}, "unknown dtype"),
        ({"strategy": "telepathy"}, "unknown strategy"),
        ({"shapes": [[1024]]}, "2 dims"),
        ({"shapes": [[1024, 0]]}, "must be > 0"),
        ({"shapes": [[1024, -3]]}, "must be > 0"),
        ({"shapes": [[1, 99999999999]]}, "must be at most 2130706432"),
        ({"shapes": [f"{'1' * 5000}x4"]}, "rows must be at most 2130706432 (kernels index in 32 bits), got a"),
        ({"shapes": []}, "shapes"),
        ({"shapes": ["12xq"]}, "malformed shape"),
        ({"shapes": ["１２x64"]}, "malformed shape"),
        ({"shapes": [[True, 64]]}, "shapes.0.list[int].0: Input should be a valid integer"),
        ({"shapes": [[1e3, 64]]}, "Input should be a valid integer"),
        ({"budget": {"trials": 0, "seconds": 10}}, "budget.trials"),
        ({"budget": {"trials": True, "seconds": 10}}, "budget.trials: Input should be a valid integer"),  # was 1
        ({"budget": {"trials": 4, "seconds": "10"}}, "budget.seconds: Input should be a valid number"),
        ({"shapes": [[64, 64], [128, 128], [256, 256]], "budget": {"trials": 2, "seconds": 10}}, "2 cannot try 3"),
        ({"budget": {"trials": 10**6, "seconds": 10}}, "budget.trials"),
        ({"budget": {"trials": 10, "seconds": 10**9}}, "budget.seconds"),
        ({"budget": {"trials": 10, "seconds": 0.001}}, "budget.seconds must be in 10..21600"),  # was done, 0 trials
        ({"attrs": {"act": "relu"}}, "no attribute"),
        ({"arch": "hopper"}, "arch"),
        ({"arch": "sm_20"}, "arch: kernelmill's kernels need sm_80 or newer, not sm_20"),
        ({"arch": "sm_9999"}, "arch: sm_9999 is not a GPU nvcc targets; known: sm_80"),
        (  # a job no worker could run: every trial of it would fail, on an sm_80 or any other GPU
            {"op": "matmul", "shapes": [[64, 64, 64]], "families": ["wgmma"], "arch": "sm_80"},
            "family wgmma uses sm_90a instructions: it runs on sm_90 only, not sm_80",
        ),
        ({"shapes": [[1024, 1024], [4096, 512], [1024, 1024]]}, "shapes: 1024x1024 is given twice"),
        ({"shapes": [[1024, 1024], "1024x1024"]}, "shapes: 1024x1024 is given twice"),
        ({"surprise": 1}, "surprise"),
        ({"families": []}, "families"),
        ({"families": ["hand_written"]}, "no family 'hand_written'"),
        ({"families": ["warp_row", "warp_row"]}, "families: warp_row is given twice"),
        (
            {"op": "matmul", "shapes": [[64, 64, 64]], "dtype": "float32", "families": ["simt", "tensorcore"]},
            "different precisions",
        ),
        (
            {"op": "matmul", "shapes": [[64, 64, 64]], "dtype": "float32", "families": ["wgmma"]},
            "matmul family wgmma does not support float32",
        ),
        ({"op": "matmul", "shapes": [[64, 60, 64]], "families": ["wgmma"]}, "no matmul variant accepts 64x60x64"),
    ],
)
def test_submission_errors_are_422_with_reason(client, change, message):
    resp = client.post("/api/jobs", json={**SOFTMAX_JOB, **change})
    assert resp.status_code == 422, resp.text
    assert message in resp.json()["detail"]


def test_ids_past_the_id_columns_and_nul_characters_are_422_not_a_driver_error(client):
    """PostgreSQL's INTEGER ids end at 2**31 - 1 and its text holds no NUL: both were 500s there."""
    too_big = 2**31
    for url in (
        f"/api/jobs/{too_big}", f"/api/jobs/{too_big}/trials", f"/api/kernels/{too_big}",
        f"/api/kernels/{too_big}/cubin", f"/api/profiles/forward/{too_big}",
    ):  # fmt: skip
        resp = client.get(url)
        assert resp.status_code == 422 and "less than or equal to 2147483647" in resp.json()["detail"], url
    assert client.post(f"/api/jobs/{too_big}/cancel").status_code == 422
    assert client.get(f"/api/jobs/{too_big - 1}").status_code == 404
    for url in (
        "/api/jobs?op=%00", "/api/kernels?op=%00", "/api/kernels?dtype=a%00b", "/api/kernels?arch=%00",
        "/api/kernels/best?op=softmax&shape=64x64&arch=%00", "/api/profiles/forward?model=%00", "/jobs?op=%00",
    ):  # fmt: skip
        resp = client.get(url)
        assert resp.status_code == 422 and "NUL" in resp.json()["detail"], url
    long_arch = client.post("/api/jobs", json={**SOFTMAX_JOB, "arch": "sm_12345678901234"})
    assert long_arch.status_code == 422 and "arch" in long_arch.json()["detail"]
    assert client.get("/api/jobs").json()["total"] == 0


def test_unknown_ids_are_404(client):
    for url in ("/api/jobs/999", "/api/jobs/999/trials", "/api/kernels/999", "/api/kernels/999/cubin"):
        resp = client.get(url)
        assert resp.status_code == 404 and "999" in resp.json()["detail"]
    assert client.post("/api/jobs/999/cancel").status_code == 404


def test_best_kernel_missing_is_404_with_reason_and_bad_query_422(client):
    resp = client.get("/api/kernels/best", params={"op": "matmul", "shape": "64x64x64", "dtype": "float16"})
    assert resp.status_code == 404 and "submit a job" in resp.json()["detail"]
    resp = client.get("/api/kernels/best", params={"op": "matmul", "shape": "64x64", "dtype": "float16"})
    assert resp.status_code == 422
    # An op with attributes: the 404 names the ones it looked for (the defaults too), so a wrong eps shows.
    resp = client.get("/api/kernels/best", params={"op": "layernorm", "shape": "8x768", "attr": "eps:1e-12"})
    assert resp.status_code == 404
    assert resp.json()["detail"].startswith("no tuned kernel for layernorm 8x768 float16 with eps=1e-12, at this or")


def test_trials_status_filter_takes_only_trial_statuses(client):
    job = wait_state(client, client.post("/api/jobs", json=SOFTMAX_JOB).json()["id"])
    resp = client.get(f"/api/jobs/{job['id']}/trials", params={"status": "okay"})
    assert resp.status_code == 422 and "status" in resp.json()["detail"], resp.text
    for status in ("ok", "compile_error", "unsupported", "wrong_result", "fault", "timeout"):
        assert client.get(f"/api/jobs/{job['id']}/trials", params={"status": status}).status_code == 200


def test_the_trial_status_filter_names_every_status_the_evaluator_gives():
    from typing import get_args

    from kernelmill.kernels.evaluate import TRIAL_STATUSES
    from kernelmill.service.api.schemas import TrialStatus

    assert set(get_args(TrialStatus)) == set(TRIAL_STATUSES)


def test_a_job_for_a_gpu_arch_keeps_its_base_arch_and_waits_for_such_a_worker(client):
    # The fake workers are sm_90: an sm_90a job runs on them, an sm_80 job waits (queued) for an sm_80 worker.
    hopper = client.post("/api/jobs", json={**SOFTMAX_JOB, "arch": "sm_90a"}).json()
    ampere = client.post("/api/jobs", json={**SOFTMAX_JOB, "arch": "sm_80"}).json()
    assert (hopper["arch"], ampere["arch"]) == ("sm_90", "sm_80")
    assert wait_state(client, hopper["id"])["state"] == "done"
    waiting = client.get(f"/api/jobs/{ampere['id']}").json()
    assert waiting["state"] == "queued" and waiting["trials_done"] == 0


def test_attributes_may_be_json_numbers(client):
    job = {"op": "layernorm", "shapes": [[8, 768]], "dtype": "float16"}
    as_number = client.post("/api/jobs", json={**job, "attrs": {"eps": 1e-12}})
    as_text = client.post("/api/jobs", json={**job, "attrs": {"eps": "1e-12"}})
    assert as_number.status_code == as_text.status_code == 201, as_number.text
    assert as_number.json()["attrs"] == as_text.json()["attrs"] == {"eps": 1e-12}
    wrong = client.post("/api/jobs", json={**job, "attrs": {"eps": 0.5}})
    assert wrong.status_code == 422 and "attribute eps=0.5 is not allowed" in wrong.json()["detail"], wrong.text


def test_workers_and_health(client):
    workers = client.get("/api/workers").json()
    assert [w["name"] for w in workers["workers"]] == ["fake-gpu0", "fake-gpu1"] and workers["reason"] is None
    health = client.get("/api/health").json()
    assert health["status"] == "ok" and health["database"] in ("sqlite", "postgresql") and health["workers"] == 2


def test_body_size_limit(client):
    resp = client.post("/api/jobs", content=b"{" + b" " * 100_000 + b"}", headers={"content-type": "application/json"})
    assert resp.status_code == 413


def test_auth_on_guards_writes_only(authed):
    missing = authed.post("/api/jobs", json=SOFTMAX_JOB)
    assert missing.status_code == 401 and "needs 'Authorization: Bearer <token>'" in missing.json()["detail"]
    bad = authed.post("/api/jobs", json=SOFTMAX_JOB, headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and "refused the bearer token" in bad.json()["detail"]  # not "needs" again
    ok = authed.post("/api/jobs", json=SOFTMAX_JOB, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 201
    assert authed.post(f"/api/jobs/{ok.json()['id']}/cancel").status_code == 401
    assert authed.get("/api/jobs").status_code == 200  # reads stay open


def test_auth_off_accepts_writes(client):
    assert client.post("/api/jobs", json=SOFTMAX_JOB).status_code == 201


def test_a_nan_in_a_rejected_body_is_echoed_as_text_in_a_422(client):
    body = '{"op": "softmax", "shapes": [[8, 8]], "dtype": "float16", "budget": {"seconds": NaN}}'
    r = client.post("/api/jobs", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "budget.seconds" in r.json()["detail"], r.text
    assert "nan" in json.dumps(r.json()["errors"]).lower()


@pytest.mark.parametrize(
    "body",
    [
        '{"op": "softmax", "shapes": ["4x4"], "arch": "\\ud800"}',
        '{"op": "softmax", "shapes": [["\\ud800"]]}',
        '{"\\ud800": 1}',
        '{"op": "softmax", "shapes": ["4x4"], "budget": {"trials": 8, "seconds": "\\ud800"}}',
    ],
)
def test_a_lone_surrogate_in_a_rejected_body_is_echoed_escaped_in_a_422(client, body):
    # "\ud800" is valid JSON but no UTF-8 holds the string it decodes to: echoing it was a 500.
    r = client.post("/api/jobs", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert "\\ud800" in r.text and "\\ud800" in json.dumps(r.json()["errors"])


@pytest.mark.parametrize("seconds", ["Infinity", "-Infinity", "NaN"])
def test_a_budget_of_infinite_seconds_is_422_under_any_limit(tmp_path, seconds):
    """With KERNELMILL_MAX_BUDGET_SECONDS=inf such a job was accepted, and its page then answered 500."""
    with pytest.raises(ValueError, match="max_budget_seconds\n  Input should be a finite number"):
        Settings(max_budget_seconds=float("inf"))
    body = f'{{"op": "softmax", "shapes": [[8, 8]], "budget": {{"trials": 8, "seconds": {seconds}}}}}'
    with make_client(tmp_path, max_budget_seconds=1e308) as client:
        r = client.post("/api/jobs", content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and r.json()["detail"] == "budget.seconds: Input should be a finite number", r.text
        assert client.get("/api/jobs").json()["total"] == 0


def test_a_trial_limit_past_the_trials_column_is_refused_in_the_settings(tmp_path):
    """With KERNELMILL_MAX_BUDGET_TRIALS over 2^31 - 1, a job of more trials passed validation and failed its
    insert into the 32-bit column on PostgreSQL: a 500."""
    with pytest.raises(ValueError, match="max_budget_trials\n  Input should be less than or equal to 2147483647"):
        Settings(max_budget_trials=2**31)
    with make_client(tmp_path, max_budget_trials=2**31 - 1) as client:
        body = {"op": "softmax", "shapes": [[8, 8]], "budget": {"trials": 2**31, "seconds": 60}}
        r = client.post("/api/jobs", json=body)
        assert r.status_code == 422 and r.json()["detail"].startswith("budget.trials must be in 1..2147483647"), r.text


LIMITS = Settings(max_shapes=32, max_budget_trials=4096, max_budget_seconds=6 * 3600.0)


def submit(shapes: int = 1, trials: int = 8, seconds: float = 60.0) -> dict:
    distinct = [[8, 8 * (i + 1)] for i in range(shapes)]
    return validate_submission(LIMITS, "softmax", distinct, "float16", "random", trials, seconds)


@pytest.mark.parametrize(
    "at_limit, past_limit, said",
    [
        ({"shapes": 3, "trials": 3}, {"shapes": 3, "trials": 2}, "budget.trials: 2 cannot try 3 shapes"),
        ({"trials": 4096}, {"trials": 4097}, "budget.trials must be in 1..4096, got 4097"),
        ({"trials": 1}, {"trials": 0}, "budget.trials must be in 1..4096, got 0"),
        ({"seconds": MIN_BUDGET_SECONDS}, {"seconds": 9.999}, "budget.seconds must be in 10..21600"),
        ({"seconds": 21600.0}, {"seconds": 21600.5}, "budget.seconds must be in 10..21600"),
        ({"shapes": 32, "trials": 32}, {"shapes": 33, "trials": 33}, "shapes: at most 32 per job, got 33"),
    ],
)
def test_a_submission_at_each_limit_is_accepted_and_one_past_it_refused(at_limit, past_limit, said):
    assert MIN_BUDGET_SECONDS == 10.0
    accepted = submit(**at_limit)
    assert (len(accepted["shapes"]), accepted["budget_trials"]) == (
        at_limit.get("shapes", 1),
        at_limit.get("trials", 8),
    )
    with pytest.raises(JobError, match=re.escape(said)):
        submit(**past_limit)


def test_a_body_that_is_not_json_is_422_naming_where_and_why(client):
    body = '{"op": "softmax", "shapes": [[1024, 1024]],}'
    r = client.post("/api/jobs", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == (
        "the body is not valid JSON at character 43: Expecting property name enclosed in double quotes"
    )


def test_a_shape_no_variant_accepts_is_422_at_submission(client):
    # mlp_stack runs batch <= 8: such a job used to finish "done" with no trial and no error.
    job = {"op": "mlp_stack", "shapes": [[4, 64, 64, 2], [64, 64, 64, 2]], "dtype": "float16"}
    r = client.post("/api/jobs", json=job)
    assert r.status_code == 422 and "no mlp_stack variant accepts 64x64x64x2 in float16" in r.json()["detail"], r.text
    assert client.post("/api/jobs", json={**job, "shapes": [[4, 64, 64, 2]]}).status_code == 201


def test_a_job_naming_a_tf32_family_is_served_as_tf32_beside_the_ieee_kernel(client):
    matmul = {"op": "matmul", "shapes": [[256, 256, 256]], "dtype": "float32", "strategy": "random",
              "budget": {"trials": 4, "seconds": 60}}  # fmt: skip
    ieee = client.post("/api/jobs", json=matmul).json()
    assert ieee["families"] is None and ieee["precision"] == "float32"
    tf32 = client.post("/api/jobs", json={**matmul, "families": ["tensorcore"]}).json()
    assert tf32["families"] == ["tensorcore"] and tf32["precision"] == "tf32"
    for job in (ieee, tf32):
        assert wait_state(client, job["id"])["state"] == "done"
    trials = client.get(f"/api/jobs/{tf32['id']}/trials", params={"limit": 100}).json()["items"]
    assert {t["family"] for t in trials} == {"tensorcore"}
    query = {"op": "matmul", "shape": "256x256x256", "dtype": "float32"}
    served = client.get("/api/kernels/best", params=query).json()
    assert served["precision"] == "float32" and served["family"] != "tensorcore"
    served = client.get("/api/kernels/best", params={**query, "precision": "tf32"}).json()
    assert served["precision"] == "tf32" and served["family"] == "tensorcore" and served["job_id"] == tf32["id"]
