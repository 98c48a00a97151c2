"""The tensor runtime on the GPU (marker gpu): BERT against transformers in float32 and float16,
zero-copy exchange with PyTorch, CUDA graph replay against plain launches, and the registry taking a
tuned kernel from a running service."""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

from kernelmill import runtime
from kernelmill.kernels.ops import OPS as OPS_BY_NAME
from kernelmill.runtime import Tensor, from_torch, ops, to_torch
from kernelmill.runtime.backend import AllocRecord
from kernelmill.runtime.registry import TUNED, KernelRegistry

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")


def rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def backend():
    from kernelmill.runtime.backend import get_backend

    return get_backend()


@pytest.fixture
def registry(backend, tmp_path):
    return KernelRegistry(backend=backend, use_service=False, cache_dir=tmp_path / "kernels")


# -- BERT -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.runtime.bert import small_bert

    path = tmp_path_factory.mktemp("bert-gpu")
    # 264 is not a multiple of the tiles.
    model = small_bert(path, vocab_size=307, hidden_size=128, intermediate_size=264, max_position_embeddings=80)
    return path, model


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("float16", 1e-2), ("bfloat16", 3e-2)])
def test_bert_matches_transformers(bert, registry, dtype, tol):
    from tests.runtime.bert import hf_hidden

    path, ref_model = bert
    model = runtime.load_model(path, device="cuda", dtype=dtype, registry=registry)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 307, size=(3, 37))
    mask = np.ones((3, 37), dtype=np.int64)
    mask[2, 25:] = 0
    types = rng.integers(0, 2, size=(3, 37))
    ref = hf_hidden(ref_model, ids, mask, types)
    graphs = _has_cuda_bindings()  # the gpu extra's: graphs need it
    for call in range(3):  # plain launches, then graph capture + replays
        out = model.forward(ids, attention_mask=mask, token_type_ids=types)
        assert out.device == "cuda" and out.dtype == dtype and out.shape == (3, 37, 128)
        assert rel_err(out.numpy().astype(np.float32)[mask.astype(bool)], ref[mask.astype(bool)]) < tol, call
        assert model.last_run == ("graph" if graphs and call >= model.warmup else "plain"), call
    report = model.kernel_report()
    # Nothing tuned: the MLP block runs as its two linears (a fused_mlp row without a kernel says so).
    ops = {"embedding", "layernorm", "linear", "attention", "add_layernorm", "fused_mlp"}
    assert {r["op"] for r in report} == ops
    assert all(r["source"] == "default" for r in report)
    assert all(r["family"] is None and "two linears" in r["note"] for r in report if r["op"] == "fused_mlp")
    print(model.format_kernel_report())


def _has_cuda_bindings() -> bool:
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return False
    return True


def test_bert_graph_replay_equals_plain_launches(bert, registry):
    pytest.importorskip("cuda.bindings")
    path, _ = bert
    plain = runtime.load_model(path, device="cuda", dtype="float16", registry=registry, graphs=False)
    # tune_kernels=False: the graph must run the plain launches' kernels (a capture-time choice would swap some).
    graphed = runtime.load_model(path, device="cuda", dtype="float16", registry=registry, tune_kernels=False)
    rng = np.random.default_rng(2)
    batches = [rng.integers(0, 307, size=(2, 64)) for _ in range(4)]
    for i, ids in enumerate(batches):
        want = plain.forward(ids).numpy()
        got = graphed.forward(ids)
        assert graphed.last_run == ("plain" if i == 0 else "graph")
        np.testing.assert_array_equal(got.numpy(), want)  # the same kernels: bit-identical
    # Another shape gets its own graph; the first one still replays.
    other = rng.integers(0, 307, size=(1, 17))
    np.testing.assert_array_equal(graphed.forward(other).numpy(), plain.forward(other).numpy())
    np.testing.assert_array_equal(graphed.forward(batches[0]).numpy(), plain.forward(batches[0]).numpy())
    assert graphed.last_run == "graph"
    # The replays read the token ids where they are and write a fresh output: no copies around them.
    for graph in graphed._graphs.values():
        assert graph.rebinding.movable[0] and graph.rebinding.movable[-1], graph.rebinding.movable
        # The second layer's buffers take the first's: the graph holds well under what its forward allocated.
        allocated = sum(r.nbytes for r in graph._work if isinstance(r, AllocRecord))
        assert 0 < graph.nbytes < 0.75 * allocated, (graph.nbytes, allocated)


def test_bert_graphs_beyond_max_graphs_are_released_and_captured_again(bert, registry):
    pytest.importorskip("cuda.bindings")
    path, _ = bert
    plain = runtime.load_model(path, device="cuda", dtype="float16", registry=registry, graphs=False)
    graphed = runtime.load_model(
        path, device="cuda", dtype="float16", registry=registry, tune_kernels=False, max_graphs=1
    )
    rng = np.random.default_rng(3)
    runs, released = [], []
    for shape in [(2, 40), (2, 40), (1, 64), (1, 64), (2, 40), (2, 40), (2, 40)]:
        ids = rng.integers(0, 307, size=shape)
        before = next(iter(graphed._graphs.values()), None)
        got = graphed.forward(ids)
        np.testing.assert_array_equal(got.numpy(), plain.forward(ids).numpy())
        runs.append(graphed.last_run)
        if before is not None and before not in graphed._graphs.values():
            released.append(before)
    assert runs == ["plain", "graph", "plain", "graph", "plain", "graph", "graph"]
    assert len(released) == 2 and len(graphed._graphs) == 1
    assert all(g.nbytes == 0 and g._exec is None for g in released)  # closed, its buffers back in the pool


def test_models_and_tensors_work_from_other_threads_one_forward_at_a_time(bert, registry):
    from concurrent.futures import ThreadPoolExecutor

    pytest.importorskip("cuda.bindings")
    path, _ = bert
    load = dict(device="cuda", dtype="float16", registry=registry, tune_kernels=False)
    model = runtime.load_model(path, **load)
    rng = np.random.default_rng(8)
    inputs = [rng.integers(0, 307, size=(2, 24)) for _ in range(6)]
    want = [model.forward(ids).numpy() for ids in inputs]  # this thread: plain launches, then the graph
    assert model.last_run == "graph"

    def serve(ids):  # a web server's worker: forward, then the result on the host (by DLPack for odd ids)
        out = model.forward(ids)
        return to_torch(out).cpu().numpy() if ids[0, 0] % 2 else out.numpy()

    def make_and_serve():  # a model loaded and run in a worker thread (the device exists already)
        other = runtime.load_model(path, **load)
        return [other.forward(ids).numpy() for ids in inputs[:3]], other.last_run

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(serve, inputs * 3))
        outs, run = pool.submit(make_and_serve).result()
    for g, w in zip(got, want * 3, strict=True):
        np.testing.assert_array_equal(g, w)  # graph replays, four threads taking turns
    for g, w in zip(outs, want[:3], strict=True):
        np.testing.assert_array_equal(g, w)
    assert run == "graph"  # captured in the worker thread
    np.testing.assert_array_equal(model.forward(inputs[0]).numpy(), want[0])  # and this thread still works


def test_empty_cache_hands_the_pools_unused_blocks_back(backend):
    t = Tensor.empty((1 << 20,), "float32", "cuda")  # 4 MiB from the pool
    del t  # back in the pool, held there
    assert runtime.empty_cache() >= 1 and backend.device._pool.held_blocks == 0


_LOAD_IN_A_THREAD = """
import threading
import numpy as np
from kernelmill import runtime
from kernelmill.runtime.nn import MLP

held, x = {}, np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)

def load_and_serve():  # e.g. a model loaded lazily by a web server's worker thread, which later ends
    held["model"] = model = runtime.Model(MLP.random(64, 128, 64), "cuda", "float16", tune_kernels=False)
    held["first"] = [model.forward(x).numpy() for _ in range(3)]

for target in (load_and_serve, lambda: held.setdefault("other", held["model"].forward(x).numpy())):
    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
here = held["model"].forward(x).numpy()
assert all((a == here).all() for a in [*held["first"], held["other"]])
print("served after the loading thread ended")
"""


def test_a_model_loaded_on_a_thread_that_ends_keeps_serving_and_the_process_exits_cleanly(backend):
    """Its own process: the device is made on that thread (pycuda aborts a process whose thread ends with a
    context pushed)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _LOAD_IN_A_THREAD], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "served after the loading thread ended" in done.stdout, done.stderr[-3000:]
    assert "PyCUDA ERROR" not in done.stderr and "could not be cleaned up" not in done.stderr, done.stderr[-3000:]


def _save_mlp(path, layers: int, seed: int, d: int = 256, hidden: int = 704) -> None:
    """A torch MLP stack (Linear -> GELU -> Linear per layer, random weights) saved as a state_dict."""
    torch.manual_seed(seed)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, d))
        for _ in range(layers)
    ]
    torch.save(torch.nn.Sequential(*blocks).state_dict(), path)


def test_pdl_graphs_launch_kernels_early_and_give_the_plain_launches_output(bert, registry, tmp_path):
    """Programmatic edges between the kernels of PDL families; many replays queued back to back (no sync in
    between) must each equal plain launches bit for bit: any kernel touching a buffer before the one
    before it is done would show here."""
    pytest.importorskip("cuda.bindings")
    path, _ = bert
    plain = runtime.load_model(path, device="cuda", dtype="float16", registry=registry, graphs=False)
    graphed = runtime.load_model(path, device="cuda", dtype="float16", registry=registry, pdl=True, tune_kernels=False)
    graphed.tune_pdl = False  # keep the PDL graph whichever replays faster
    rng = np.random.default_rng(5)
    batches = [rng.integers(0, 307, size=(2, 64)) for _ in range(6)]
    want = [plain.forward(ids).numpy() for ids in batches]
    graphed.forward(batches[0])  # plain launches, then capture from the second call
    outs = [graphed.forward(ids) for ids in batches]  # queued on the stream; downloaded after
    assert graphed.last_run == "graph"
    for got, expected in zip(outs, want, strict=True):
        np.testing.assert_array_equal(got.numpy(), expected)
    graph = next(g for k, g in graphed._graphs.items() if k[-1] is True)
    assert graph.programmatic_edges > 0

    # An MLP on gemv (batch 1) and wgmma (batch 40) linears, PDL on and off.
    _save_mlp(tmp_path / "mlp.pt", layers=3, seed=6)
    mlp_plain = runtime.load_model(
        tmp_path / "mlp.pt", device="cuda", dtype="float16", act="gelu", registry=registry, graphs=False
    )
    mlp = runtime.load_model(
        tmp_path / "mlp.pt", device="cuda", dtype="float16", act="gelu", registry=registry, tune_kernels=False
    )
    mlp.tune_pdl = False
    for batch in (1, 40):
        xs = [np.random.default_rng(batch * 10 + i).standard_normal((batch, 256)).astype(np.float32) for i in range(5)]
        want = [mlp_plain.forward(x).numpy() for x in xs]
        for pdl in (True, False):
            mlp.pdl = pdl
            mlp.forward(xs[0])
            outs = [mlp.forward(x) for x in xs]
            assert mlp.last_run == "graph"
            for got, expected in zip(outs, want, strict=True):
                np.testing.assert_array_equal(got.numpy(), expected)
    # Both get programmatic edges: the gemv linears at batch 1 (each warp loads its first weights, the model's
    # parameters, before its wait) and the wgmma linears at batch 40.
    edges = {k[0][0][0]: g.programmatic_edges for k, g in mlp._graphs.items() if k[-1] is True}
    assert edges[1] > 0 and edges[40] > 0


def test_graph_replays_read_inputs_and_write_outputs_in_place(tmp_path, registry):
    """The graph's kernel nodes are pointed at the caller's input and at a fresh output on each replay
    (batch 1: a gemv reads X by pointer; batch 40: a wgmma reads it through a tensor map, encoded again).
    Earlier outputs stay intact, the input is read when the replay runs, and an unaligned input is copied
    into the static buffer instead."""
    pytest.importorskip("cuda.bindings")
    _save_mlp(tmp_path / "mlp.pt", layers=2, seed=7)
    load = dict(device="cuda", dtype="float16", act="gelu", registry=registry)
    plain = runtime.load_model(tmp_path / "mlp.pt", graphs=False, **load)
    mlp = runtime.load_model(tmp_path / "mlp.pt", tune_kernels=False, **load)
    for batch in (1, 40):
        xs = [torch.randn(batch, 256, device="cuda", dtype=torch.float16) for _ in range(4)]
        torch.cuda.synchronize()
        want = [plain.forward(from_torch(x)).numpy() for x in xs]
        mlp.forward(from_torch(xs[0]))  # plain launches; the graph is captured on the next call
        outs = [mlp.forward(from_torch(x)) for x in xs]
        assert mlp.last_run == "graph"
        assert len({out.ptr for out in outs}) == len(outs)  # each replay wrote its own output
        for got, expected in zip(outs, want, strict=True):
            np.testing.assert_array_equal(got.numpy(), expected)
        graph = next(g for k, g in mlp._graphs.items() if k[0][0][0] == batch)
        assert graph.rebinding.movable == (True, True) and graph.rebinding.nodes
        assert graph.inputs[0].ptr not in graph._bound  # the static input is no longer read
        # The live tensor is read when the replay runs.
        xs[0].mul_(-0.5)
        torch.cuda.synchronize()
        np.testing.assert_array_equal(mlp.forward(from_torch(xs[0])).numpy(), plain.forward(from_torch(xs[0])).numpy())
        # Not 16-byte aligned: copied into the static input, which the nodes read again.
        flat = torch.randn(batch * 256 + 1, device="cuda", dtype=torch.float16)
        torch.cuda.synchronize()
        view = from_torch(flat[1:].view(batch, 256))
        assert view.ptr % 16
        np.testing.assert_array_equal(mlp.forward(view).numpy(), plain.forward(view).numpy())
        assert mlp.last_run == "graph" and graph._bound[0] == graph.inputs[0].ptr
        np.testing.assert_array_equal(mlp.forward(from_torch(xs[1])).numpy(), want[1])


def test_model_chooses_pdl_per_kernel_by_replay_time(tmp_path, registry, caplog, monkeypatch):
    pytest.importorskip("cuda.bindings")
    monkeypatch.setattr("kernelmill.runtime.models._REMEMBER_MAX_SPREAD", float("inf"))  # xdist shares the GPU
    _save_mlp(tmp_path / "mlp.pt", layers=1, seed=8)
    load = dict(device="cuda", dtype="float16", act="gelu", registry=registry)
    plain = runtime.load_model(tmp_path / "mlp.pt", graphs=False, **load)
    mlp = runtime.load_model(tmp_path / "mlp.pt", pdl=True, tune_kernels=False, **load)
    x = np.random.default_rng(9).standard_normal((40, 256)).astype(np.float32)  # wgmma linears: a PDL family
    with caplog.at_level("INFO", logger="kernelmill.runtime.models"):
        for _ in range(3):
            out = mlp.forward(x)
    assert mlp.last_run == "graph"
    np.testing.assert_array_equal(out.numpy(), plain.forward(x).numpy())
    (line,) = [r.getMessage() for r in caplog.records if "captured a CUDA graph" in r.getMessage()]
    assert "with PDL everywhere" in line, line
    (graph,) = mlp._graphs.values()
    # Both linears are a PDL family; the kept graph launches some of them on plain edges, or none.
    ops_plain = {e.op for e in registry.entries() if id(e) in graph.plain}
    assert ("plain edges into linear" in line) == bool(ops_plain) and ops_plain <= {"linear"}
    assert graph.plain or graph.programmatic_edges > 0
    # Another model of the same forward on this GPU model takes the recorded choice without timing it.
    caplog.clear()
    again = runtime.load_model(tmp_path / "mlp.pt", pdl=True, tune_kernels=False, **load)
    with caplog.at_level("INFO", logger="kernelmill.runtime.models"):
        for _ in range(2):
            out = again.forward(x)
    (line,) = [r.getMessage() for r in caplog.records if "captured a CUDA graph" in r.getMessage()]
    assert "(remembered)" in line and "with PDL everywhere" not in line, line
    (second,) = again._graphs.values()
    assert second.plain == graph.plain and again.last_run == "graph"
    np.testing.assert_array_equal(out.numpy(), plain.forward(x).numpy())


def test_model_chooses_among_the_defaults_runners_up_by_replay_time(tmp_path, registry, backend, caplog, monkeypatch):
    pytest.importorskip("cuda.bindings")
    from kernelmill.kernels.render import render

    _save_mlp(tmp_path / "mlp.pt", layers=2, seed=10)
    load = dict(device="cuda", dtype="float16", act="gelu")
    plain = runtime.load_model(
        tmp_path / "mlp.pt",
        graphs=False,
        registry=KernelRegistry(backend=backend, use_service=False, cache_dir=tmp_path / "plain"),
        **load,
    )
    # A stand-in that computes something else (ReLU for GELU) must be caught by the output check.
    real = registry.alternatives
    wrong = []

    def alternatives(entry, limit=4):
        found = real(entry, limit=2)
        if found and not wrong:
            spec = OPS_BY_NAME[entry.op]
            fam = spec.family(entry.family)
            act = entry.attrs.get("act", "none")
            attrs = {**entry.attrs, "act": "relu"} if act not in ("none", "relu") else None  # the up projection
            if attrs is not None:
                bad = registry.compiler.compile(render(fam, entry.params, entry.dtype, attrs), entry.arch)
                wrong.append(
                    registry._build(
                        spec,
                        entry.shape,
                        entry.dtype,
                        entry.attrs,
                        fam.name,
                        entry.params,
                        entry.source,
                        bad.cubin,
                        bad.key,
                        entry.arch,
                    )
                )
                found = [wrong[0], *found]
        return found

    registry.alternatives = alternatives
    # The choice is remembered whatever the replays' spread: pytest-xdist runs other tests on this GPU, which is
    # what keeps a choice from being remembered (tests/runtime/test_cuda_plumbing.py has that rule).
    monkeypatch.setattr("kernelmill.runtime.models._REMEMBER_MAX_SPREAD", float("inf"))
    mlp = runtime.load_model(tmp_path / "mlp.pt", registry=registry, tune_kernels=True, **load)
    mlp.tune_pdl = False
    x = np.random.default_rng(11).standard_normal((40, 256)).astype(np.float32)  # wgmma linears
    with caplog.at_level("INFO", logger="kernelmill.runtime.models"):
        for _ in range(3):
            out = mlp.forward(x)
    assert mlp.last_run == "graph" and wrong
    assert rel_err(out.numpy(), plain.forward(x).numpy()) < 1e-2
    messages = [r.getMessage() for r in caplog.records]
    assert any("changed the forward's output" in m and "not used" in m for m in messages)
    (line,) = [m for m in messages if "captured a CUDA graph" in m]
    kept = [e for e in registry.entries() if e.op == "linear" and "chosen at capture" in e.note]
    assert wrong[0] not in registry.entries()
    assert ("runners-up kept" in line) == bool(kept), line
    # The choice holds for the model's later captures.
    linears = {e.shape: e for e in registry.entries() if e.op == "linear"}
    mlp.reset_graphs()
    mlp.tune_kernels = False
    for _ in range(3):
        again = mlp.forward(x)
    np.testing.assert_array_equal(again.numpy(), out.numpy())
    assert {e.shape: e for e in registry.entries() if e.op == "linear"} == linears
    # Another process on this GPU model (a fresh registry on the same cache) takes the recorded choices:
    # nothing is compiled or timed again, and the kernels are the ones chosen.
    fresh = KernelRegistry(backend=backend, use_service=False, cache_dir=tmp_path / "kernels")
    later = runtime.load_model(tmp_path / "mlp.pt", registry=fresh, tune_kernels=True, **load)
    later.tune_pdl = False
    caplog.clear()
    with caplog.at_level("INFO", logger="kernelmill.runtime"):
        for _ in range(3):
            out_later = later.forward(x)
    assert later.last_run == "graph"
    assert not any("runners-up to time in place" in r.getMessage() for r in caplog.records)
    assert {e.shape: e.params for e in fresh.entries() if e.op == "linear"} == {
        shape: e.params for shape, e in linears.items()
    }
    assert rel_err(out_later.numpy(), out.numpy()) < 1e-3


def test_mlp_graph_replay_is_close(tmp_path, registry, monkeypatch):
    pytest.importorskip("cuda.bindings")
    monkeypatch.setattr(ops, "FUSED_MLP_DEFAULT_MAX_BATCH", 8)  # the fused kernel's atomics in a graph
    torch.manual_seed(3)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(256, 700), torch.nn.GELU(), torch.nn.Linear(700, 256)) for _ in range(2)
    ]
    ref = torch.nn.Sequential(*blocks).eval()
    path = tmp_path / "mlp.pt"
    torch.save(ref.state_dict(), path)
    model = runtime.load_model(path, device="cuda", dtype="float32", act="gelu", registry=registry)
    for batch in (3, 3, 3, 40, 40):  # fused small_batch (atomics) at 3, its two linears at 40
        x = np.random.default_rng(batch).standard_normal((batch, 256)).astype(np.float32)
        with torch.no_grad():
            want = ref(torch.from_numpy(x)).numpy()
        assert rel_err(model.forward(x).numpy(), want) < 1e-4
    assert model.last_run == "graph"


def test_a_graph_replays_the_weights_assigned_after_its_capture_not_the_freed_ones(registry):
    """A weight assigned anew freed the one the graph's kernels point at: replays read freed memory (the
    old values, or whatever the pool put there next) instead of the new weight."""
    pytest.importorskip("cuda.bindings")
    from kernelmill.runtime.nn import MLP

    model = runtime.Model(MLP.random(64, 128, 64), device="cuda", dtype="float32", registry=registry)
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    for _ in range(3):
        model.forward(x)
    assert model.last_run == "graph"
    new_down = np.random.default_rng(1).standard_normal((128, 64)).astype(np.float32) * 0.1
    model.module.down.weight = Tensor.from_numpy(new_down, "cuda", "float32")
    filler = [Tensor.from_numpy(np.full((128, 64), 1e3, np.float32), "cuda") for _ in range(4)]  # reuses freed blocks
    want = runtime.Model(model.module, device="cuda", dtype="float32", registry=registry, graphs=False).forward(x)
    for _ in range(3):
        got = model.forward(x)
        assert rel_err(got.numpy(), want.numpy()) < 1e-5
    assert model.last_run == "graph" and filler


def test_buckets_share_graphs_between_sizes_and_leave_real_tokens_and_rows_as_they_were(bert, registry, tmp_path):
    pytest.importorskip("cuda.bindings")
    path, ref_model = bert
    model = runtime.load_model(path, device="cuda", dtype="float16", registry=registry, buckets=[32, 64])
    rng = np.random.default_rng(6)
    for seq in (20, 20, 37, 37, 50, 50, 9):
        ids = rng.integers(0, 307, size=(3, seq))
        mask = np.ones((3, seq), dtype=np.int64)
        mask[1, seq // 2 :] = 0
        with torch.no_grad():
            ref = ref_model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state
        out = model.forward(ids, attention_mask=mask)
        assert out.shape == (3, seq, 128)
        keep = mask.astype(bool)
        assert rel_err(out.numpy().astype(np.float32)[keep], ref.numpy()[keep]) < 1e-2, seq
    # 20 and 9 -> 32, 37 and 50 -> 64: two graphs, the second size of each bucket replayed one.
    assert model.last_run == "graph" and sorted(k[0][0][:2] for k in model._graphs) == [(3, 32), (3, 64)]
    one = model.forward(ids[:1])  # batch 1: a view of the padded output
    with torch.no_grad():
        ref = ref_model(input_ids=torch.from_numpy(ids[:1])).last_hidden_state.numpy()
    assert one.shape == (1, 9, 128) and rel_err(one.numpy().astype(np.float32), ref) < 1e-2

    _save_mlp(tmp_path / "mlp.pt", layers=2, seed=7)
    mlp = runtime.load_model(tmp_path / "mlp.pt", device="cuda", dtype="float32", act="gelu", registry=registry)
    padded = runtime.load_model(
        tmp_path / "mlp.pt", device="cuda", dtype="float32", act="gelu", registry=registry, buckets=[8, 16]
    )
    for rows in (3, 3, 5, 5, 11):
        x = rng.standard_normal((rows, 256)).astype(np.float32)
        want = mlp.forward(x).numpy()
        got = padded.forward(x)
        assert got.shape == (rows, 256) and rel_err(got.numpy(), want) < 1e-5, rows
    assert [k[0][0] for k in padded._graphs] == [(8, 256)]  # 3 and 5 rows: one graph; 11 ran plain (once)


def test_capture_buckets_ahead_of_requests_gives_the_same_outputs(bert, registry):
    pytest.importorskip("cuda.bindings")
    path, ref_model = bert
    model = runtime.load_model(path, device="cuda", dtype="float16", registry=registry, buckets=[16, 48])
    example = np.ones((2, 5), dtype=np.int64)
    rows = model.capture_buckets(example, attention_mask=np.ones((2, 5), dtype=np.int64))
    assert [(r["size"], r["run"]) for r in rows] == [(16, "graph"), (48, "graph")]
    assert sorted(k[0][0][:2] for k in model._graphs) == [(2, 16), (2, 48)]
    rng = np.random.default_rng(9)
    for seq in (7, 30):  # the first request of each bucket replays its graph
        ids = rng.integers(0, 307, size=(2, seq))
        mask = np.ones((2, seq), dtype=np.int64)
        mask[0, seq // 2 :] = 0
        out = model.forward(ids, attention_mask=mask)
        assert model.last_run == "graph" and len(model._graphs) == 2
        with torch.no_grad():
            ref = ref_model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state
        keep = mask.astype(bool)
        assert rel_err(out.numpy().astype(np.float32)[keep], ref.numpy()[keep]) < 1e-2, seq


# -- zero-copy exchange ----------------------------------------------------------------------------------


def test_uploads_queue_behind_the_streams_work_and_the_host_array_may_change_at_once(backend):
    busy = Tensor.empty((1 << 28,), "float32", "cuda")  # 1 GiB: each fill keeps the GPU busy a while
    host = np.zeros((64, 64), np.float32)
    small = []
    for i in range(300):
        if i % 30 == 0:
            backend.fill(busy.ptr, i % 256, busy.nbytes)
        host[...] = i  # overwritten right after each upload
        small.append(Tensor.from_numpy(host, "cuda"))
    large = [Tensor.from_numpy(np.full(2 << 20, i, np.float32), "cuda") for i in range(6)]  # 8 MiB each
    assert backend.staging.held <= 4 * backend.STAGED_BYTES  # past the limit, uploads waited for copies
    assert all((t.numpy() == i).all() for i, t in enumerate(small))
    assert all((t.numpy() == i).all() for i, t in enumerate(large))
    big = np.arange(3 << 20, dtype=np.float32)  # 12 MiB: a synchronous copy
    np.testing.assert_array_equal(Tensor.from_numpy(big, "cuda").numpy(), big)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dlpack_round_trip_without_copies(backend, dtype):
    t = Tensor.from_numpy(np.arange(24, dtype=np.float32).reshape(4, 6), "cuda", dtype)
    tt = to_torch(t)
    assert tt.is_cuda and tt.data_ptr() == t.ptr and str(tt.dtype) == f"torch.{dtype}"
    back = from_torch(tt)
    assert back.ptr == t.ptr and back.shape == (4, 6)
    tt.mul_(2)  # torch writes (legacy default stream), the runtime reads the same memory
    assert float(back.numpy().astype(np.float32)[3, 5]) == 46.0
    del t, back
    torch.cuda.synchronize()
    assert float(tt[3, 5]) == 46.0  # the capsule kept the runtime's buffer alive


def test_a_0d_tensor_on_the_gpu(backend, registry):
    t = Tensor.from_numpy(np.array(-1.5, np.float32), "cuda")
    assert t.shape == () and t.numpy().shape == () and float(t.numpy()) == -1.5
    with ops.using_registry(registry):
        out = ops.gelu(t)
        assert out.shape == () and out.is_cuda
        torch.testing.assert_close(to_torch(out), torch.nn.functional.gelu(torch.tensor(-1.5, device="cuda")))
        with pytest.raises(ValueError, match="a 0-d input has no last dim"):
            ops.softmax(t)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_relu_keeps_a_nan_as_torch_does(backend, registry, dtype):
    """fmaxf(NaN, 0) is 0: a ReLU epilogue hid an upstream NaN on the GPU only."""
    x = np.array([[1.5, -2.0, np.nan, 0.25, -np.inf, np.inf, -0.5, 3.0]], np.float32)
    finite = np.nan_to_num(x, nan=0.75, posinf=1.0, neginf=-1.0)
    bias = np.where(np.isnan(x[0]), np.nan, 0.0).astype(np.float32)  # the NaN comes in through the bias
    with ops.using_registry(registry):
        relu = ops.relu(Tensor.from_numpy(x, "cuda", dtype))  # bias_act
        linear = ops.linear(  # the GEMV's epilogue: x @ I + bias
            Tensor.from_numpy(finite, "cuda", dtype),
            Tensor.from_numpy(np.eye(8, dtype=np.float32), "cuda", dtype),
            Tensor.from_numpy(bias, "cuda", dtype),
            "relu",
        )
    np.testing.assert_array_equal(relu.numpy().astype(np.float32), torch.relu(torch.from_numpy(x)).numpy())
    want = torch.relu(torch.from_numpy(finite + bias)).numpy()
    np.testing.assert_array_equal(linear.numpy().astype(np.float32), want)  # NaN where want has it


def test_empty_batches_on_the_gpu_launch_nothing_and_answer_empty(bert, registry, tmp_path):
    """A batch of 0 reached the kernels as a zero-size grid, which CUDA refuses."""
    model = runtime.load_model(bert[0], device="cuda", dtype="float32", registry=registry)
    out = model.forward(np.zeros((0, 7), np.int64))
    assert out.is_cuda and out.numpy().shape == (0, 7, 128)
    with ops.using_registry(registry):
        x = Tensor.from_numpy(np.zeros((0, 64), np.float32), "cuda")
        assert ops.softmax(x).numpy().shape == (0, 64)
        w = Tensor.from_numpy(np.ones((64, 32), np.float32), "cuda")
        b = Tensor.from_numpy(np.ones(32, np.float32), "cuda")
        assert ops.linear(x, w, b).numpy().shape == (0, 32)
        with pytest.raises(ValueError, match=r"^matmul: 0x32x0 has an empty dimension to reduce over"):
            ops.matmul(Tensor.from_numpy(np.zeros((5, 0), np.float32), "cuda"), w.rows(0, 0))


def test_the_device_keeps_its_most_recent_modules_and_one_still_held_runs(backend):
    """Loaded modules are cached by key up to MODULE_CACHE_SIZE: those dropped unload in the live context, and
    one something still holds keeps running."""
    import gc

    from kernelmill.kernels import device as device_module
    from kernelmill.kernels.compile import Compiler

    dev = backend.device
    source = 'extern "C" __global__ void km_fill(int* y, int v) { y[threadIdx.x] = v; }\n'
    compiled = Compiler().compile(source, backend.arch)
    held = dev.load(compiled.cubin, "module-cache-test-held")
    for i in range(device_module.MODULE_CACHE_SIZE + 20):
        dev.load(compiled.cubin, f"module-cache-test-{i}")
    gc.collect()
    assert "module-cache-test-held" not in dev._modules and len(dev._modules) == device_module.MODULE_CACHE_SIZE
    out = dev.alloc(32 * 4)
    held.kernel("km_fill").launch((1, 1, 1), (32, 1, 1), 0, [out, 7])
    dev.synchronize()
    assert (dev.download(out, (32,), np.int32) == 7).all()


def test_cuda_array_interface_and_runtime_ops_on_torch_memory(backend, registry):
    a = torch.randn(33, 65, device="cuda")
    b = torch.randn(33, 65, device="cuda")
    ta, tb = from_torch(a), from_torch(b)
    assert ta.ptr == a.data_ptr()
    cai = ta.__cuda_array_interface__
    assert cai["data"][0] == a.data_ptr() and cai["shape"] == (33, 65) and cai["typestr"] == "<f4"
    assert torch.as_tensor(ta, device="cuda").data_ptr() == a.data_ptr()
    with ops.using_registry(registry):
        out = to_torch(ops.add(ta, tb))
    torch.testing.assert_close(out, a + b)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float16, 1e-2)])
def test_sdpa_on_torch_tensors_matches_torch(backend, registry, dtype, tol):
    """ops.scaled_dot_product_attention on (batch, heads, seq, head_dim) CUDA tensors: the sdpa op's fused
    kernel, against F.scaled_dot_product_attention on the same tensors, with and without a key mask."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 77, 64, device="cuda", dtype=dtype) for _ in range(3))
    mask = torch.zeros(2, 77, device="cuda", dtype=dtype)
    mask[1, 50:] = -1e4
    for m in (None, mask):
        with ops.using_registry(registry):
            out = ops.scaled_dot_product_attention(*map(from_torch, (q, k, v)), None if m is None else from_torch(m))
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), attn_mask=None if m is None else m.double()[:, None, None, :]
        )
        got = to_torch(out)
        assert got.shape == q.shape and got.dtype == dtype
        assert rel_err(got.double().cpu(), ref.cpu()) < tol


def test_unaligned_views_are_copied_before_a_kernel(backend, registry):
    base = torch.randn(1001, device="cuda", dtype=torch.float16)
    x, y = from_torch(base[1:]), from_torch(base[:-1].clone())
    assert x.ptr % 16
    with ops.using_registry(registry):
        out = to_torch(ops.add(x, y))
    torch.testing.assert_close(out, base[1:] + base[:-1])


# -- the registry and a running service --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def running_service(tmp_path):
    import uvicorn

    from kernelmill.service.app import create_app
    from kernelmill.settings import Settings

    url = f"sqlite:///{tmp_path}/served.db"
    settings = Settings(database_url=url, executor="fake", fake_workers=0)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "service did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", url
    server.should_exit = True
    thread.join(10)


def _publish(db_url, op, shape, dtype, attrs, family, params, arch):
    from kernelmill.agents.loop import served_fields
    from kernelmill.kernels.variant import Variant
    from kernelmill.service.db.store import Store

    compiled = Variant.create(op, family, dtype, params, attrs).compile(arch=arch)
    store = Store(db_url)
    try:
        key = "x".join(str(v) for v in shape)
        job = store.create_job(
            op=op,
            shapes=[list(shape)],
            dtype=dtype,
            attrs=attrs,
            arch=arch,
            strategy="random",
            budget_trials=1,
            budget_seconds=1.0,
            state="done",
        )
        row = {
            "family": family,
            "params": params,
            "params_key": json.dumps(params, sort_keys=True),
            "status": "ok",
            "arch": arch,
            "median_ms": 0.01,
            "max_rel_err": 1e-3,
            "cubin": compiled.cubin,
        }
        (trial,) = store.record_trials(job.id, key, [row])
        fields = served_fields(op, tuple(shape), dtype, attrs)(family, params)
        fields.update(cubin=compiled.cubin, baseline_ms=0.02)
        return store.publish(job, trial, fields).id
    finally:
        store.close()


def test_registry_uses_a_tuned_kernel_from_a_running_service(backend, running_service, tmp_path):
    server, db_url = running_service
    params = {"BM": 64, "BN": 64, "BK": 32, "WM": 32, "WN": 32, "stages": 2, "split_k": 2}
    attrs = {"act": "gelu_erf"}
    kernel_id = _publish(db_url, "linear", (200, 300, 160), "float16", attrs, "tensorcore", params, backend.arch)
    reg = KernelRegistry(server, backend=backend, cache_dir=tmp_path / "client-cache")
    x = torch.randn(200, 160, device="cuda", dtype=torch.float16)
    w = torch.randn(160, 300, device="cuda", dtype=torch.float16) / 12
    b = torch.randn(300, device="cuda", dtype=torch.float16)
    with ops.using_registry(reg):
        y = to_torch(ops.linear(from_torch(x), from_torch(w), from_torch(b), "gelu_erf"))
        y_near = to_torch(ops.linear(from_torch(x[:190]), from_torch(w), from_torch(b), "gelu_erf"))
    want = torch.nn.functional.gelu(x.float() @ w.float() + b.float())
    assert rel_err(y.float().cpu(), want.cpu()) < 1e-2
    assert rel_err(y_near.float().cpu(), want[:190].cpu()) < 1e-2
    rows = {r["shape"]: r for r in reg.report()}
    assert rows["200x300x160"]["source"] == TUNED and rows["200x300x160"]["kernel_id"] == kernel_id
    assert rows["200x300x160"]["params"] == params and rows["200x300x160"]["speedup"] == pytest.approx(2.0)
    assert rows["190x300x160"]["source"] == "nearest"
