"""Every dashboard page over TestClient: 200s with what the store holds, 404 pages, empty states."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from html import unescape

import pytest

from kernelmill.service.db.store import Store
from tests.web.seed import add_job


def _text(html: str) -> str:
    return unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)))


PAGES = [
    "/",
    "/jobs",
    "/jobs?state=done&op=softmax",
    "/jobs/new",
    "/jobs/new?op=fused_mlp&shapes=8x64x64x64&dtype=bfloat16",
    "/jobs/{softmax}",
    "/jobs/{softmax}?sort=median_ms&order=desc",
    "/jobs/{softmax}?sort=p:vec&status=ok",
    "/jobs/{softmax}?sort=nonsense&order=sideways&page=zero",
    "/jobs/{softmax}?page=%C2%B2",  # "²": a digit to str.isdigit, not to int()
    "/jobs/{softmax}/live?page=%C2%B9",
    "/jobs?page=%C2%B2",
    f"/jobs?page={'9' * 5000}",  # past int()'s 4300 digits: the first page, as past the last
    f"/jobs/{{softmax}}?page={'9' * 5000}",
    f"/jobs/{{softmax}}/live?page={'9' * 5000}",
    f"/jobs?page={'0' * 5000}1",
    f"/jobs/{'0' * 5000}{{softmax}}",  # leading zeros are no size
    "/jobs/{fused_mlp}",
    "/jobs/{failed}",
    "/jobs/{cancelled}",
    "/jobs/{softmax}/live",
    "/kernels/{kernel}",
    "/kernels/{mlp_kernel}",
    "/compare",
    "/compare?arch=sm_90",
    "/compare?arch=sm_75",
]


@pytest.mark.parametrize("path", PAGES)
def test_every_page_renders(seeded, path):
    resp = seeded.get(path.format(**seeded.ids))
    assert resp.status_code == 200, resp.text[:2000]
    assert resp.headers["content-type"].startswith("text/html")
    if "/live" not in path:
        assert '<nav class="nav"' in resp.text and "/static/kernelmill.css" in resp.text
        assert resp.text.rstrip().endswith("</html>")


def test_static_files_are_served(seeded):
    for path, kind in (
        ("/static/kernelmill.css", "text/css"),
        ("/static/pygments.css", "text/css"),
        ("/static/kernelmill.js", "javascript"),
        ("/static/favicon.svg", "image/svg+xml"),
    ):
        resp = seeded.get(path)
        assert resp.status_code == 200 and kind in resp.headers["content-type"], path


@pytest.mark.parametrize(
    "path",
    [
        "/jobs/999",
        "/jobs/999/live",
        "/kernels/999",
        "/jobs/99999999999999999999999",
        "/kernels/10000000000000000000",
        "/jobs/2147483648",
        "/jobs/2147483648/live",
        "/kernels/2147483648",  # past PostgreSQL's INTEGER ids
        f"/jobs/{'9' * 5000}",  # past int()'s 4300 digits: Starlette's int convertor raised, a 500
        f"/jobs/{'9' * 5000}/live",
        f"/kernels/{'9' * 5000}",
    ],  # fmt: skip
)
def test_unknown_ids_get_the_404_page(seeded, path):
    resp = seeded.get(path)
    assert resp.status_code == 404
    assert "There is no" in resp.text and "Submit a job" in resp.text
    assert "9" * 30 not in resp.text  # a long id is named cut short


def test_cancelling_an_id_of_thousands_of_digits_is_the_404_page(seeded):
    resp = seeded.post(f"/jobs/{'9' * 5000}/cancel", data={}, follow_redirects=False)
    assert resp.status_code == 404 and "(5000 digits)" in resp.text


def test_unknown_paths_get_html_for_browsers_and_json_for_the_api(seeded):
    page = seeded.get("/jobs/abc", headers={"Accept": "text/html"})
    assert page.status_code == 404 and "There is no page at /jobs/abc" in unescape(page.text)
    api = seeded.get("/api/jobs/999", headers={"Accept": "text/html"})
    assert api.status_code == 404 and api.json()["detail"] == "no job with id 999"
    plain = seeded.get("/no/such/thing")
    assert plain.status_code == 404 and plain.json() == {"detail": "Not Found"}


def test_overview_shows_workers_jobs_and_best_speedups(seeded):
    text = _text(seeded.get("/").text)
    assert "fake-gpu0" in text and "fake-gpu1" in text and "idle" in text
    assert "copy 3,000 GB/s" in text and "ceilings not measured yet" in text  # gpu0 measured, gpu1 not
    assert "Recent jobs" in text and "#1" in text and "act=gelu_tanh" in text
    for op in ("softmax", "matmul", "fused_mlp"):
        assert op in text
    html = seeded.get("/").text
    assert f'href="/kernels/{seeded.ids["kernel"]}"' in html or "/kernels/" in html
    assert "No jobs yet" not in text


def test_progress_bars_have_an_accessible_name_and_value(seeded):
    for path in ("/", "/jobs", f"/jobs/{seeded.ids['failed']}"):
        bars = re.findall(r'<div [^>]*role="progressbar"[^>]*>', seeded.get(path).text)
        assert bars, path
        for bar in bars:
            assert 'aria-label="trials"' in bar and re.search(r'aria-valuetext="\d+ of \d+ trials', bar), bar


def test_empty_states_say_what_to_do_next(empty):
    text = _text(empty.get("/").text)
    assert "No jobs yet — submit one" in text
    assert "No GPU worker attached" in text and "0 workers" in text and "kernelmill worker" in text
    assert "No kernels served yet" in text
    assert 'href="/jobs/new"' in empty.get("/").text
    assert "No kernels served yet" in _text(empty.get("/compare").text)
    assert "No jobs yet — submit one" in _text(empty.get("/jobs").text)
    assert "No job matches these filters" in _text(empty.get("/jobs?state=running").text)


def _add_job(client, **fields):
    """A softmax job written straight to the app's store (``fields`` override the defaults)."""
    store = Store(client.app.state.settings.database_url)
    try:
        return store.create_job(
            **{
                "op": "softmax",
                "shapes": [[64, 64]],
                "dtype": "float16",
                "attrs": {},
                "strategy": "random",
                "budget_trials": 8,
                "budget_seconds": 60,
                **fields,
            }
        )
    finally:
        store.close()


def test_run_time_is_what_the_budget_counts_not_the_wall_time_since_the_first_start(empty):
    """A job queued again after a restart had its time in the queue shown against its time budget."""
    now = datetime.now(UTC)
    start = now - timedelta(hours=2)
    counted = _add_job(empty, state="done", started_at=start, finished_at=now, seconds_used=90, budget_seconds=600)
    text = _text(empty.get(f"/jobs/{counted.id}").text)
    assert "Run time 1 min 30 s / 10 min 00 s" in text
    uncounted = _add_job(empty, state="done", started_at=start, finished_at=start + timedelta(seconds=42))
    assert "Run time 42 s / 1 min 00 s" in _text(empty.get(f"/jobs/{uncounted.id}").text)  # a row from before


def test_queued_job_page_says_it_waits_for_a_gpu(empty):
    job = _add_job(empty)
    text = _text(empty.get(f"/jobs/{job.id}").text)
    assert "queued" in text and "waiting for a GPU" in text and "No trials yet" in text
    assert "Cancel job" in text
    assert "no trials yet" in empty.get(f"/jobs/{job.id}").text  # the empty charts


def test_job_page_has_progress_charts_failures_and_trials(seeded):
    job_id = seeded.ids["softmax"]
    html = seeded.get(f"/jobs/{job_id}").text
    text = _text(html)
    assert "96 / 96" in text and "done" in text
    # per shape: a convergence chart (a step path) and a scatter of every trial coloured by status
    assert html.count('class="best-line"') == 2
    assert html.count('aria-label="convergence for') == 2 and html.count('aria-label="all trials for') == 2
    assert len(re.findall(r'<circle [^>]*class="pt st-ok"', html)) > 40
    for status in ("wrong_result", "compile_error", "fault", "timeout", "unsupported"):
        assert f'class="pt st-{status}"' in html, status
        assert f'class="badge st-{status}"' in html, status
    # failures grouped with their reasons, the compile log in full
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in text and 'identifier "__shfl_xor_sync_bad" is undefined' in text
    # the served kernels and the live hooks
    assert f'href="/kernels/{seeded.ids["kernel"]}"' in html
    assert f'data-api="/api/jobs/{job_id}"' in html and f'data-partial="/jobs/{job_id}/live' in html
    # the trials table has a column per parameter
    for param in ("vec", "unroll", "rows_per_block", "fast_exp"):
        assert f"sort=p%3A{param}" in html


def _times(html: str) -> list[float]:
    body = html.split('id="trials"', 1)[1]
    rows = re.findall(r'<tr id="trial-\d+".*?</tr>', body, re.S)
    out = []
    for row in rows:
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)
        raw = _text(cells[4]).strip()  # '#', shape, family, status, median
        if raw != "—":
            value, unit = raw.split()
            out.append(float(value) / (1000 if unit == "µs" else 1))
    return out


def test_trials_table_sorts_filters_and_pages(seeded):
    job_id = seeded.ids["softmax"]
    asc = _times(seeded.get(f"/jobs/{job_id}?sort=median_ms").text)
    desc = _times(seeded.get(f"/jobs/{job_id}?sort=median_ms&order=desc").text)
    assert asc == sorted(asc) and desc == sorted(desc, reverse=True) and len(asc) == len(desc) > 40
    failed = seeded.get(f"/jobs/{job_id}?status=fault").text
    rows = re.findall(r'<tr id="trial-\d+" class="row-(\w+)"', failed)
    assert rows and set(rows) == {"fault"}
    by_param = seeded.get(f"/jobs/{job_id}?sort=p:rows_per_block&order=desc").text
    assert 'aria-sort="descending"' in by_param

    store = Store(seeded.app.state.settings.database_url)
    try:
        big = add_job(store, "matmul", [[256, 256, 256]], "float16", trials_per_shape=130, seed=9, publish=False)
    finally:
        store.close()
    first = seeded.get(f"/jobs/{big}").text
    assert "1–100 of 130" in first and "next →" in first
    second = seeded.get(f"/jobs/{big}?page=2").text
    assert "101–130 of 130" in second and len(re.findall(r'<tr id="trial-', second)) == 30
    past = seeded.get(f"/jobs/{big}?page=9").text  # a stale link: the last page, not an empty table
    assert "101–130 of 130" in past and len(re.findall(r'<tr id="trial-', past)) == 30


def test_a_jobs_page_past_the_last_shows_the_last(seeded):
    """It showed "No jobs yet — submit one" with no pager over a store full of jobs."""
    text = _text(seeded.get("/jobs?page=7").text)
    assert "No jobs yet" not in text and f"#{seeded.ids['softmax']}" in text
    filtered = _text(seeded.get("/jobs?state=done&op=softmax&page=3").text)
    assert "No job matches" not in filtered and f"#{seeded.ids['softmax']}" in filtered


def test_live_partial_is_the_dynamic_part_only(seeded):
    resp = seeded.get(f"/jobs/{seeded.ids['softmax']}/live?sort=median_ms")
    assert "<html" not in resp.text and "<svg" in resp.text and 'id="trials"' in resp.text
    assert 'aria-sort="ascending"' in resp.text


def test_failed_job_shows_its_error(seeded):
    text = _text(seeded.get(f"/jobs/{seeded.ids['failed']}").text)
    assert "The job failed:" in text and "the worker died three times in a row" in text


def test_jobs_list_says_why_a_job_failed(seeded):
    job = _add_job(seeded, state="failed", error="\nRuntimeError: nvcc died\n" + "  detail line\n" * 50)
    html = seeded.get("/jobs?state=failed").text
    row = re.search(rf'<tr>\s*<td><a class="strong" href="/jobs/{job.id}">.*?</tr>', html, re.S).group(0)
    assert '<span class="reason" title="' in row and ">RuntimeError: nvcc died</span>" in row
    first = re.search(rf'href="/jobs/{seeded.ids["failed"]}">.*?</tr>', html, re.S).group(0)
    assert ">RuntimeError: the worker died three times in a row</span>" in first


def test_first_line_filter():
    from kernelmill.service.web.filters import first_line

    assert first_line("\n  boom  \nmore") == "boom" and first_line(None) == "" and first_line("   ") == ""
    assert first_line("x" * 300) == "x" * 197 + "..."


def test_text_from_the_store_is_escaped(seeded):
    job = _add_job(seeded, state="failed", error="<script>alert(1)</script>")
    html = seeded.get(f"/jobs/{job.id}").text
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)" in html


def test_kernel_page(seeded):
    kernel_id = seeded.ids["kernel"]
    html = seeded.get(f"/kernels/{kernel_id}").text
    text = _text(html)
    assert '<div class="highlight">' in html and '<span class="k' in html  # Pygments
    assert 'extern "C" __global__' in text
    entries = ("softmax_warp_row", "softmax_block_row", "softmax_cluster_row", "softmax_smem_row", "softmax_split_norm")
    assert any(entry in text for entry in entries)  # ptxas and launches per entry (the seeded best's family)
    assert "Registers" in text and "Spill stores" in text
    assert f'href="/api/kernels/{kernel_id}/cubin"' in html
    assert "dram_throughput_pct" in text and "l2.hit_rate_pct" in text  # profile, flattened
    assert html.count('class="roof"') == 2 and 'class="pt-kernel"' in html and 'class="pt-torch"' in html
    assert "copy 3,000 GB/s" in text and "float16 matrix 700 TFLOP/s" in text
    assert "PyTorch" in text and "speedup" in text.lower()
    assert seeded.get(f"/api/kernels/{kernel_id}/cubin").content == b"seed-cubin"


def test_kernel_page_without_measured_ceilings(tmp_path):
    from tests.web.conftest import make_client

    url = f"sqlite:///{tmp_path}/web.db"
    store = Store(url)
    try:
        add_job(store, "softmax", [[1024, 1024]], "float32", trials_per_shape=6, seed=3)
        kernel_id = store.list_kernels()[0][0].id
    finally:
        store.close()
    client, _ = make_client(tmp_path, seed=False)
    with client:
        html = client.get(f"/kernels/{kernel_id}").text
    text = _text(html)
    assert "are not measured yet" in text and "device ceilings not measured yet" in text
    assert 'class="roof"' not in html and 'class="pt-kernel"' in html
    assert "No profile metrics" not in text  # the seeded trial has a profile


def test_compare_grid(seeded):
    html = seeded.get("/compare").text
    text = _text(html)
    for op in ("softmax", "matmul", "fused_mlp"):
        assert op in text
    assert "4096x4096" in text and "8192x1024" in text and "act=gelu_tanh" in text
    chips = re.findall(r'<a class="cell-chip" href="/kernels/(\d+)" style="([^"]*)"', html)
    assert len(chips) == 5
    assert any("hsl(142" in style for _, style in chips) and any("hsl(0" in style for _, style in chips)
    # an empty cell links to the form, pre-filled for that op, shape and dtype
    assert "/jobs/new?op=softmax&amp;shapes=4096x4096&amp;dtype=float32" in html
    assert "attr.fused_mlp.act=gelu_tanh" in html
    assert "No kernel served for sm_75" in _text(seeded.get("/compare?arch=sm_75").text)
    # The arch read as the API reads it: "90" showed "No kernel served for 90".
    by_number = seeded.get("/compare?arch=90").text
    assert len(re.findall(r'class="cell-chip"', by_number)) == 5 and "No kernel served" not in by_number
    assert "No kernel served for hopper" in _text(seeded.get("/compare?arch=hopper").text)


def test_compare_names_the_gpu_model_of_each_chip_where_there_are_several(tmp_path):
    from tests.web.conftest import make_client

    store = Store(f"sqlite:///{tmp_path}/web.db")
    try:
        add_job(store, "softmax", [[4096, 4096]], "float16", trials_per_shape=4, seed=1)
        add_job(store, "softmax", [[4096, 4096]], "float16", trials_per_shape=4, seed=2, device="NVIDIA H100 PCIe")
    finally:
        store.close()
    client, _ = make_client(tmp_path, seed=False)
    with client:
        html = client.get("/compare").text
    chips = re.findall(r'<a class="cell-chip"[^>]*>(.*?)</a>', html, re.S)
    assert len(chips) == 2 and sum("H100 PCIe" in c for c in chips) == 1, chips


def test_a_tf32_kernels_roofline_uses_the_tf32_matrix_rate(tmp_path):
    from kernelmill.service.db.models import Job, Kernel
    from tests.web.conftest import make_client
    from tests.web.seed import DEVICE, WORKER

    url = f"sqlite:///{tmp_path}/web.db"
    store = Store(url)
    try:
        store.upsert_device(WORKER, name=DEVICE, arch="sm_90", sm_count=132, copy_gbps=3000.0,
                            matrix_tflops={"float32": 50.0, "tf32": 400.0})  # fmt: skip
        add_job(store, "matmul", [[2048, 2048, 2048]], "float32", trials_per_shape=4, seed=5)
        kernel = store.list_kernels()[0][0]
        with store.session() as session:  # served as a TF32 kernel (a tensorcore family computing float32)
            session.get(Kernel, kernel.id).precision = "tf32"
            session.get(Job, kernel.job_id).families = ["tensorcore"]
            session.commit()
    finally:
        store.close()
    client, _ = make_client(tmp_path, seed=False)
    with client:
        text = _text(client.get(f"/kernels/{kernel.id}").text)
        job_page = _text(client.get(f"/jobs/{kernel.job_id}").text)
        compare = _text(client.get("/compare").text)
    assert "tf32 matrix 400 TFLOP/s" in text and "float32 matrix" not in text and "float32 in tf32" in text
    assert "float32 in tf32" in job_page and "families tensorcore" in job_page
    assert "· tf32" in compare
