"""The dashboard in a real browser: every page loads without console errors, the form submits a job that
shows on the overview and runs live, charts draw; a screenshot of each page is written for people to look at."""

from __future__ import annotations

import re

import httpx
import pytest

pytestmark = pytest.mark.browser


def _visit(page, url: str, shots, name: str, status: int = 200) -> None:
    response = page.goto(url, wait_until="networkidle")
    assert response is not None and response.status == status, f"{url}: {response and response.status}"
    page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
    if status == 404:  # chromium reports the document's own 404 on the console; nothing else may appear
        page.console.errors[:] = [e for e in page.console.errors if "status of 404" not in e]
    assert page.console.errors == [], f"{url}: {page.console.errors}"


def test_every_page_loads_without_console_errors(server, page, shots):
    ids = server.ids
    pages = {
        "overview": "/",
        "jobs": "/jobs",
        "new-job": "/jobs/new",
        "job": f"/jobs/{ids['softmax']}",
        "job-fused-mlp": f"/jobs/{ids['fused_mlp']}",
        "job-failed": f"/jobs/{ids['failed']}",
        "job-sorted": f"/jobs/{ids['softmax']}?sort=median_ms&order=asc&status=ok",
        "kernel": f"/kernels/{ids['kernel']}",
        "kernel-fused-mlp": f"/kernels/{ids['mlp_kernel']}",
        "compare": "/compare",
    }
    for name, path in pages.items():
        _visit(page, server.url + path, shots, name)
        assert page.locator("nav.nav a").count() >= 3
        assert page.title().endswith("kernelmill")
    _visit(page, f"{server.url}/jobs/98765", shots, "not-found", status=404)
    assert "There is no job 98765" in page.inner_text("h1")
    _visit(page, f"{server.url}/no/such/page", shots, "not-found-path", status=404)
    assert "There is no page at /no/such/page" in page.inner_text("h1")


def test_job_page_draws_charts(server, page, shots):
    _visit(page, f"{server.url}/jobs/{server.ids['softmax']}", shots, "job-charts")
    first = page.locator("section.shape-card").first
    convergence = first.locator("figure").nth(0).locator("svg")
    scatter = first.locator("figure").nth(1).locator("svg")
    assert convergence.locator("path.best-line").count() == 1
    assert convergence.locator("circle").count() >= 2
    assert scatter.locator("circle.st-ok").count() > 10
    failed = sum(scatter.locator(f"circle.st-{s}").count() for s in ("wrong_result", "compile_error", "fault"))
    assert failed > 0
    box = scatter.bounding_box()
    assert box and box["width"] > 300 and box["height"] > 120
    # sorting the trials table by time puts the fastest first
    page.click("#trials th a:has-text('Median')")
    page.wait_for_load_state("networkidle")
    assert "sort=median_ms" in page.url
    times = page.locator("#trials tbody tr td:nth-child(5)").all_inner_texts()[:5]
    values = [float(re.sub(r"[^0-9.]", "", t)) for t in times if t.strip() != "—"]
    assert values == sorted(values) and values
    assert page.console.errors == []


def test_kernel_page_shows_source_roofline_and_cubin(server, page, shots):
    _visit(page, f"{server.url}/kernels/{server.ids['kernel']}", shots, "kernel-detail")
    assert page.locator(".source .highlight span").count() > 50  # highlighted by Pygments
    roofline = page.locator("svg[aria-label^='roofline']")
    assert roofline.locator("path.roof").count() == 2 and roofline.locator("circle.pt-kernel").count() == 1
    href = page.get_attribute("a:has-text('Download cubin')", "href")
    assert httpx.get(server.url + href).content == b"seed-cubin"


def test_submitting_the_form_creates_a_job_that_runs_live(server, page, shots):
    _visit(page, f"{server.url}/jobs/new", shots, "form")
    page.select_option("#op", "fused_mlp")
    assert page.locator("fieldset.attrs[data-op='fused_mlp']").is_visible()
    page.fill("#shapes", "16x256x1024x256\n16x512xbad")
    page.fill("#trials", "0")
    page.click("button:has-text('Submit job')")
    page.wait_for_load_state("networkidle")
    page.screenshot(path=str(shots / "form-errors.png"), full_page=True)
    assert [e for e in page.console.errors if "status of 422" not in e] == []  # the re-rendered form is a 422
    page.console.errors.clear()
    assert "malformed shape" in page.inner_text("#error-shapes")
    assert "budget.trials" in page.inner_text("#error-trials")
    assert page.locator("fieldset.attrs[data-op='fused_mlp']").is_visible()
    assert page.input_value("#shapes").startswith("16x256x1024x256")

    page.fill("#shapes", "16x256x1024x256\n32x256x1024x256")
    page.fill("#trials", "400")
    page.select_option("#attr-fused_mlp-act", "gelu_erf")
    page.check("input[name=strategy][value=evolutionary]")
    page.click("button:has-text('Submit job')")
    page.wait_for_url(re.compile(r"/jobs/\d+$"))
    job_id = int(page.url.rsplit("/", 1)[1])
    assert "fused_mlp" in page.inner_text("h1") and "act=gelu_erf" in page.inner_text(".meta")

    # the fake GPU records a trial every 0.1 s: the page follows the job without a reload
    page.wait_for_function(
        "() => /^running:[1-9]/.test(document.querySelector('[data-live]').getAttribute('data-version'))",
        timeout=30_000,
    )
    page.screenshot(path=str(shots / "job-running.png"), full_page=True)
    assert page.locator("section.shape-card").first.locator("svg circle").count() > 0
    assert "running" in page.inner_text(".job-head h1")

    page.click("button:has-text('Cancel job')")
    page.wait_for_function(
        "() => document.querySelector('[data-live]').getAttribute('data-version').startsWith('cancelled:')",
        timeout=30_000,
    )
    page.screenshot(path=str(shots / "job-cancelled.png"), full_page=True)
    assert "cancelled" in page.inner_text(".job-head h1")
    assert page.console.errors == []

    page.goto(server.url + "/", wait_until="networkidle")
    row = page.locator(f"#recent tr:has(a[href='/jobs/{job_id}'])")
    assert row.count() == 1 and "fused_mlp" in row.inner_text() and "cancelled" in row.inner_text()
    page.screenshot(path=str(shots / "overview-after-submit.png"), full_page=True)
    assert page.console.errors == []


def test_empty_states_point_to_the_next_step(empty_server, page, shots):
    _visit(page, empty_server.url + "/", shots, "empty-overview")
    assert "No jobs yet — submit one" in page.inner_text("#recent")
    assert "No GPU worker attached" in page.inner_text("#gpus")
    page.click("#recent a:has-text('Submit a job')")
    page.wait_for_url(re.compile(r"/jobs/new$"))
    for name, path in {"empty-compare": "/compare", "empty-jobs": "/jobs"}.items():
        _visit(page, empty_server.url + path, shots, name)
        assert page.locator(".empty a[href='/jobs/new']").count() == 1


def test_a_long_job_error_keeps_its_lines_and_the_page_its_width(server, page, shots):
    from kernelmill.service.db.store import Store

    path = "/opt/" + "a_folder_name_without_any_spaces_" * 12 + "kernel.cu"
    error = "Traceback (most recent call last):\n" + "\n".join(f'  File "{path}", line {i}' for i in range(20))
    store = Store(server.db)
    try:
        job = store.create_job(
            op="softmax", shapes=[[64, 64]], dtype="float16", attrs={}, strategy="random", budget_trials=8,
            budget_seconds=60, state="failed", error=error,
        )  # fmt: skip
    finally:
        store.close()
    for url, name in ((f"/jobs/{job.id}", "job-long-error"), ("/jobs?state=failed", "jobs-failed")):
        _visit(page, server.url + url, shots, name)
        assert page.evaluate("document.documentElement.scrollWidth") <= 1360, url
    _visit(page, server.url + f"/jobs/{job.id}", shots, "job-long-error")
    assert page.inner_text(".job-error").count("\n") == 20  # the traceback's lines, not one run-on line


def test_the_live_page_keeps_a_token_being_typed_into_its_cancel_form(token_server, page):
    from tests.browser.conftest import TOKEN

    body = {"op": "softmax", "shapes": [[1024, 1024]], "dtype": "float16", "budget": {"trials": 400, "seconds": 600}}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    job = httpx.post(f"{token_server.url}/api/jobs", json=body, headers=auth, timeout=10).json()
    live = "document.querySelector('[data-live]').getAttribute('data-version')"
    try:
        page.goto(f"{token_server.url}/jobs/{job['id']}", wait_until="networkidle")
        page.wait_for_function(f"() => /^running:[1-9]/.test({live})", timeout=30_000)
        page.fill("input[name=token]", "half-typed")
        polls = f"/api/jobs/{job['id']}"
        for _ in range(2):  # two polls of a running job: the first would have swapped the part in before the second
            with page.expect_request(lambda r: r.url.endswith(polls), timeout=15_000):
                pass
        assert page.input_value("input[name=token]") == "half-typed"
        before = page.evaluate(f"() => {live}")
        page.fill("input[name=token]", "")
        page.locator("h1").click()  # done with the form: the page follows the job again
        page.wait_for_function(f"() => {live} !== {before!r}", timeout=15_000)
    finally:
        httpx.post(f"{token_server.url}/api/jobs/{job['id']}/cancel", headers=auth, timeout=10)
    assert page.console.errors == []
