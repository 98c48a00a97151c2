"""The new-job form and the cancel button: the API's validation, errors next to their fields, CSRF, the token."""

from __future__ import annotations

import re
from html import unescape

import pytest

from tests.web.conftest import csrf, field_error

VALID = {
    "op": "softmax",
    "shapes": "1024x1024\n4096x512",
    "dtype": "float16",
    "strategy": "random",
    "arch": "auto",
    "trials": "24",
    "seconds": "60",
}


def _post(client, data, token=None, path="/jobs/new"):
    body = {**data, "csrf": token if token is not None else csrf(client)}
    return client.post(path, data=body, follow_redirects=False)


def test_form_lists_ops_dtypes_strategies_and_attributes(empty):
    resp = empty.get("/jobs/new")
    html = resp.text
    assert resp.status_code == 200 and "kernelmill_csrf" in resp.headers.get("set-cookie", "")
    assert "samesite=strict" in resp.headers["set-cookie"].lower()
    for value in ("softmax", "matmul", "fused_mlp", "float32", "bfloat16", "exhaustive", "evolutionary"):
        assert f'value="{value}"' in html
    assert 'name="attr.fused_mlp.act"' in html and 'value="gelu_erf"' in html
    assert 'name="token"' not in html  # no API token configured


def test_query_string_prefills_the_form(empty):
    html = empty.get("/jobs/new?op=fused_mlp&shapes=8x64x64x64&dtype=bfloat16&attr.fused_mlp.act=gelu_erf").text
    assert '<option value="fused_mlp" selected>' in html
    assert ">8x64x64x64</textarea>" in html
    assert '<option value="bfloat16" selected>' in html and '<option value="gelu_erf" selected>' in html


def test_prefilled_attribute_selects_its_option_as_the_api_reads_it(empty):
    # The API takes eps=1e-5 as 1e-05; the form's select must show that option, not fall back to the first one.
    html = empty.get("/jobs/new?op=layernorm&shapes=4096x1024&attr.layernorm.eps=1e-5&attr.linear.act=RELU").text
    assert '<option value="1e-05" selected>' in html and '<option value="relu" selected>' in html
    assert html.count(" selected>") == 4  # op, eps, act and dtype: nothing else, no second eps option


def test_an_attribute_value_no_option_has_is_kept_next_to_its_error(empty):
    data = {**VALID, "op": "layernorm", "shapes": "4096x1024", "attr.layernorm.eps": "0.001"}
    resp = _post(empty, data)
    assert resp.status_code == 422 and "not allowed" in unescape(field_error(resp.text, "attr-layernorm-eps"))
    select = re.search(r'name="attr.layernorm.eps"[^>]*>(.*?)</select>', resp.text, re.S).group(1)
    assert re.findall(r'<option value="([^"]*)" selected', select) == ["0.001"]


def test_valid_submission_creates_the_job_and_redirects(empty):
    resp = _post(empty, {**VALID, "attr.fused_mlp.act": "gelu_erf"})  # another op's attribute is ignored
    assert resp.status_code == 303, resp.text[:2000]
    job_id = int(resp.headers["location"].rsplit("/", 1)[1])
    job = empty.get(f"/api/jobs/{job_id}").json()
    assert job["shapes"] == [[1024, 1024], [4096, 512]] and job["budget"] == {"trials": 24, "seconds": 60.0}
    assert job["attrs"] == {} and job["state"] == "queued"
    assert empty.get(resp.headers["location"]).status_code == 200
    assert f'href="/jobs/{job_id}"' in empty.get("/").text


def test_named_families_are_submitted(empty):
    data = {**VALID, "op": "matmul", "shapes": "256x256x256", "dtype": "float32", "families": " tensorcore "}
    resp = _post(empty, data)
    assert resp.status_code == 303, resp.text[:2000]
    job = empty.get(f"/api/jobs/{resp.headers['location'].rsplit('/', 1)[1]}").json()
    assert job["families"] == ["tensorcore"] and job["precision"] == "tf32"
    assert "matmul: <code>simt, tensorcore, wgmma, gemv</code>" in empty.get("/jobs/new").text


def test_op_attributes_are_submitted(empty):
    data = {**VALID, "op": "fused_mlp", "shapes": "16x256x1024x256", "attr.fused_mlp.act": "gelu_erf"}
    resp = _post(empty, data)
    assert resp.status_code == 303
    job = empty.get(f"/api/jobs/{resp.headers['location'].rsplit('/', 1)[1]}").json()
    assert job["op"] == "fused_mlp" and job["attrs"] == {"act": "gelu_erf"}


def test_every_ops_example_shape_is_one_a_job_takes(empty):
    # The hint under Shapes gives an example per op; each must be a shape its op accepts in the form's dtype.
    html = empty.get("/jobs/new").text
    examples = dict(re.findall(r'data-op="(\w+)"><b>\w+</b>: [^<]*, e\.g\. <code>([0-9x]+)</code>', html))
    assert len(examples) == len(re.findall(r'class="op-hint"', html)) > 10
    for op, shape in examples.items():
        resp = _post(empty, {**VALID, "op": op, "shapes": shape})
        assert resp.status_code == 303, (op, shape, field_error(resp.text, "shapes"))


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"op": "conv2d"}, "op", "unknown op"),
        ({"dtype": "float64"}, "dtype", "unknown dtype"),
        ({"strategy": "telepathy"}, "strategy", "unknown strategy"),
        ({"shapes": "1024"}, "shapes", "2 dims"),
        ({"shapes": "1024x0"}, "shapes", "must be > 0"),
        ({"shapes": ""}, "shapes", "at least one shape"),
        ({"shapes": "12xq"}, "shapes", "malformed shape"),
        ({"shapes": "\n".join(["8x8"] * 40)}, "shapes", "at most 32"),
        ({"trials": "0"}, "trials", "budget.trials"),
        ({"trials": "ten"}, "trials", "whole number"),
        ({"trials": "1_0"}, "trials", "whole number"),
        ({"shapes": "１０24x64"}, "shapes", "malformed shape"),
        ({"trials": "1000000"}, "trials", "budget.trials"),
        ({"seconds": "1e9"}, "seconds", "budget.seconds"),
        ({"seconds": "soon"}, "seconds", "number of seconds"),
        ({"seconds": "1_0"}, "seconds", "number of seconds"),  # float() reads these: as trials, refused
        ({"seconds": "１０"}, "seconds", "number of seconds"),
        ({"seconds": "nan"}, "seconds", "number of seconds"),
        ({"arch": "hopper"}, "arch", "sm_90"),
        ({"arch": "sm_75"}, "arch", "need sm_80 or newer, not sm_75"),
        ({"shapes": "64x64\n128x64\n64x64"}, "shapes", "64x64 is given twice"),
        ({"op": "fused_mlp", "shapes": "8x8x8x8", "attr.fused_mlp.act": "swish"}, "attr-fused_mlp-act", "not allowed"),
        ({"families": "warp_row, nope"}, "families", "no family 'nope'"),
        (
            {"op": "matmul", "shapes": "64x64x64", "dtype": "float32", "families": "simt,tensorcore"},
            "families",
            "different precisions",
        ),
    ],
)
def test_each_error_is_shown_next_to_its_field(empty, change, field, message):
    resp = _post(empty, {**VALID, **change})
    assert resp.status_code == 422
    error = field_error(resp.text, field)
    assert error is not None and message in unescape(error), resp.text[:3000]
    assert empty.get("/api/jobs").json()["total"] == 0


def test_every_bad_field_is_reported_at_once_and_the_input_kept(empty):
    data = {**VALID, "dtype": "float64", "strategy": "telepathy", "shapes": "12xq", "trials": "0", "arch": "x"}
    resp = _post(empty, data)
    assert resp.status_code == 422
    for name in ("dtype", "strategy", "shapes", "trials", "arch"):
        assert field_error(resp.text, name), name
    assert field_error(resp.text, "op") is None and field_error(resp.text, "seconds") is None
    assert ">12xq</textarea>" in resp.text and 'value="float64" selected' in resp.text
    assert "5 fields to fix" in resp.text
    assert 'aria-invalid="true"' in resp.text


def test_unknown_op_still_checks_the_rest(empty):
    resp = _post(empty, {**VALID, "op": "conv2d", "strategy": "telepathy", "seconds": "-1"})
    for name in ("op", "strategy", "seconds"):
        assert field_error(resp.text, name), name


def test_post_without_the_csrf_token_is_refused(empty):
    empty.get("/jobs/new")
    resp = empty.post("/jobs/new", data=VALID, follow_redirects=False)
    assert resp.status_code == 403 and "reload the page" in resp.text
    resp = _post(empty, VALID, token="forged-" + "x" * 40)
    assert resp.status_code == 403
    assert empty.get("/api/jobs").json()["total"] == 0


def test_a_csrf_cookie_planted_by_another_site_does_not_pass(empty):
    """Cookies ignore ports, and a sibling subdomain can set one for the parent domain: a page at
    http://localhost:3000 can set the CSRF cookie the service at localhost:8000 gets, and post the form with the
    same value. Such a post is same-site, never same-origin (Sec-Fetch-Site), and is refused as another site's."""
    planted = "p" * 43
    empty.cookies.set("kernelmill_csrf", planted)
    for site in ("same-site", "cross-site"):
        headers = {"Sec-Fetch-Site": site, "Origin": "http://localhost:3000"}
        body = {**VALID, "csrf": planted}
        resp = empty.post("/jobs/new", data=body, headers=headers, follow_redirects=False)
        assert resp.status_code == 403 and "another site" in resp.text, site
    assert empty.get("/api/jobs").json()["total"] == 0
    ok = empty.post("/jobs/new", data={**VALID, "csrf": planted}, headers={"Sec-Fetch-Site": "same-origin"})
    assert ok.status_code == 200 and empty.get("/api/jobs").json()["total"] == 1
    job_id = empty.get("/api/jobs").json()["items"][0]["id"]
    same_site = {"Sec-Fetch-Site": "same-site"}
    refused = empty.post(f"/jobs/{job_id}/cancel", data={"csrf": planted}, headers=same_site, follow_redirects=False)
    assert refused.status_code == 403 and "Not cancelled" in refused.text
    assert empty.get(f"/api/jobs/{job_id}").json()["state"] == "queued"


def test_token_is_required_when_the_api_needs_one(authed):
    html = authed.get("/jobs/new").text
    assert 'name="token"' in html and "KERNELMILL_API_TOKEN" in html
    missing = _post(authed, VALID)
    assert missing.status_code == 401 and "needs its API token" in field_error(missing.text, "token")
    wrong = _post(authed, {**VALID, "token": "nope"})
    assert wrong.status_code == 401 and field_error(wrong.text, "token") == "wrong token"
    assert "nope" not in wrong.text  # the token is never echoed back
    bad_and_wrong = _post(authed, {**VALID, "trials": "0", "token": "nope"})
    assert field_error(bad_and_wrong.text, "trials") and field_error(bad_and_wrong.text, "token")
    assert authed.get("/api/jobs").json()["total"] == 0
    ok = _post(authed, {**VALID, "token": "s3cret"})
    assert ok.status_code == 303 and authed.get("/api/jobs").json()["total"] == 1


def _job_id(client) -> int:
    resp = _post(client, VALID)
    assert resp.status_code == 303
    return int(resp.headers["location"].rsplit("/", 1)[1])


def test_cancel_button(empty):
    job_id = _job_id(empty)  # no GPU worker: it stays queued
    page = empty.get(f"/jobs/{job_id}").text
    assert "Cancel job" in page and f'action="/jobs/{job_id}/cancel"' in page
    refused = empty.post(f"/jobs/{job_id}/cancel", data={}, follow_redirects=False)
    assert refused.status_code == 403 and "Not cancelled" in refused.text
    assert empty.get(f"/api/jobs/{job_id}").json()["state"] == "queued"
    done = empty.post(f"/jobs/{job_id}/cancel", data={"csrf": csrf(empty)}, follow_redirects=False)
    assert done.status_code == 303 and done.headers["location"] == f"/jobs/{job_id}"
    assert empty.get(f"/api/jobs/{job_id}").json()["state"] == "cancelled"
    assert "Cancel job" not in empty.get(f"/jobs/{job_id}").text
    # From a page opened before the job ended: said, not a silent redirect to a page that looks unchanged.
    again = empty.post(f"/jobs/{job_id}/cancel", data={"csrf": csrf(empty)}, follow_redirects=False)
    assert again.status_code == 409 and "Not cancelled: the job had already ended (cancelled)" in again.text
    assert empty.post("/jobs/999/cancel", data={"csrf": csrf(empty)}).status_code == 404


def test_cancel_needs_the_token_when_set(authed):
    job_id = int(_post(authed, {**VALID, "token": "s3cret"}).headers["location"].rsplit("/", 1)[1])
    assert 'name="token"' in authed.get(f"/jobs/{job_id}").text
    refused = authed.post(f"/jobs/{job_id}/cancel", data={"csrf": csrf(authed)}, follow_redirects=False)
    assert refused.status_code == 403 and "API token" in unescape(refused.text)
    ok = authed.post(f"/jobs/{job_id}/cancel", data={"csrf": csrf(authed), "token": "s3cret"}, follow_redirects=False)
    assert ok.status_code == 303 and authed.get(f"/api/jobs/{job_id}").json()["state"] == "cancelled"


def test_field_of_maps_every_validation_message():
    from kernelmill.service.web.forms import field_of

    assert field_of("unknown op 'x'; known ops: softmax", "x") == "op"
    assert field_of("no softmax family supports float64", "softmax") == "dtype"
    assert field_of("softmax takes a shape of 2 dims (rows x cols), got 1", "softmax") == "shapes"
    assert field_of("attribute act='swish' is not allowed; choose one of relu", "fused_mlp") == "attr.fused_mlp.act"
    assert field_of("something else entirely", "softmax") == "form"
    assert re.match(r"^budget", "budget.trials must be in 1..4096, got 0")
