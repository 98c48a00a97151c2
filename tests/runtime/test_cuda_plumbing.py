"""The runtime's GPU code path with a fake device (no GPU here): every op's tensors reach its kernels'
arguments, models run end to end through the registry, and graph capture falls back to plain launches
with a log line when the driver cannot be reached."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import numpy as np
import pytest

from kernelmill import runtime
from kernelmill.kernels.compile import CompiledKernel
from kernelmill.kernels.device import Buffer
from kernelmill.runtime import Tensor, ops
from kernelmill.runtime import backend as backend_module
from kernelmill.runtime.registry import KernelRegistry


class FakeKernel:
    def __init__(self, log, entry):
        self.log, self.entry = log, entry

    def launch(self, grid, block, smem, args, stream=None):
        assert all(isinstance(a, Buffer | int) for a in args), args
        self.log.append(
            (self.entry, tuple(grid), tuple(block), smem, [a.ptr if isinstance(a, Buffer) else a for a in args])
        )


class FakeBackend:
    """Memory is a dict of bytes by address; kernels only record their launches."""

    def __init__(self):
        self.launches = []
        self.memory = {}
        self._next = 1 << 20
        self.device = SimpleNamespace(
            info=SimpleNamespace(arch="sm_90", sm_count=132, name="NVIDIA Fake H0"),
            load=lambda cubin, key: SimpleNamespace(kernel=lambda entry: FakeKernel(self.launches, entry)),
        )
        self.arch = "sm_90"
        self.stream = None
        self.stream_handle = 1
        self.copies_2d = []
        self.pdl = []  # before_launch's flag for each launch, in order
        self.constants = frozenset()  # what a capture would vouch for (Backend.capturing's constants)

    def before_launch(self, pdl, entry=None):
        self.pdl.append(pdl)

    def is_constant(self, ptr):
        return ptr in self.constants

    def after_launch(self, kernel, args):
        pass

    def alloc(self, nbytes, persistent=False):
        buf = Buffer(self._next, nbytes)
        self._next += (max(nbytes, 1) + 255) // 256 * 256
        return buf

    def upload(self, ptr, host):
        self.memory[ptr] = bytes(host.reshape(-1).view(np.uint8))

    def download(self, ptr, out):
        data = self.memory.get(ptr, b"\0" * out.nbytes)[: out.nbytes]
        out.reshape(-1).view(np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)

    def copy(self, dst, src, nbytes):
        self.memory[dst] = self.memory.get(src, b"\0" * nbytes)[:nbytes]

    def fill(self, ptr, byte, nbytes):
        self.memory[ptr] = bytes([byte]) * nbytes

    def copy_2d(self, dst, dst_pitch, src, src_pitch, width, height):
        self.copies_2d.append((dst, dst_pitch, src, src_pitch, width, height))

    def synchronize(self):
        pass


class StubCompiler:
    def compile(self, source, arch):
        return CompiledKernel(b"stub-cubin", arch, key=str(hash(source)))

    def compile_many(self, sources, arch):
        return [self.compile(source, arch) for source in sources]


@pytest.fixture
def fake(monkeypatch, tmp_path):
    backend = FakeBackend()
    monkeypatch.setattr(backend_module, "get_backend", lambda ordinal=0: backend)
    # Its kernels compute nothing, so they are not checked at first use (tests/runtime/test_check.py is).
    registry = KernelRegistry(
        backend=backend, use_service=False, compiler=StubCompiler(), cache_dir=tmp_path, check=False
    )
    with ops.using_registry(registry):
        yield backend, registry


def _cuda(*shape, dtype="float16"):
    return Tensor.from_numpy(np.ones(shape, np.float32), "cuda", dtype)


def test_gpu_embedding_checks_ids_against_its_tables(fake):
    """The kernel clamps an id past the table to its last row: id == vocab read word row vocab - 1 on the GPU,
    where the CPU and torch raise."""
    backend, _ = fake
    tables = (_cuda(100, 32), _cuda(20, 32), _cuda(2, 32))
    for ids, types, named in (
        (np.full((2, 5), 100), None, "ids out of range 0..99"),
        (Tensor.from_numpy(np.full((2, 5), -1, np.int64)), None, "ids out of range 0..99"),
        (np.zeros((2, 5), np.int64), np.full((2, 5), 2), "type_ids out of range 0..1"),
    ):
        with pytest.raises(IndexError, match=f"^embedding: {re.escape(named)}$"):
            ops.embedding(ids, *tables, types)
    assert backend.launches == []
    ops.embedding(np.full((2, 5), 99), *tables, np.ones((2, 5), np.int64))
    assert [launch[0] for launch in backend.launches] == ["embedding_gather"]


def test_every_op_maps_its_tensors_to_kernel_arguments(fake):
    backend, registry = fake
    x, w, b = _cuda(10, 32), _cuda(32, 48), _cuda(48)
    y = ops.linear(x, w, b, "gelu")
    entry, grid, block, smem, args = backend.launches[-1]
    # M = 10: the skinny gemv family, bias + act in its final sum.
    assert entry == "linear_gemv" and args[:4] == [x.ptr, w.ptr, y.ptr, b.ptr] and args[4:] == [10, 48, 32]
    ops.matmul(x, w)
    ops.relu(x)
    ops.add(x, x)
    ops.softmax(x)
    ops.layernorm(x, _cuda(32), _cuda(32), 1e-5, residual=x)
    ops.fused_mlp(x, w, b, _cuda(48, 32), _cuda(32), "relu")
    ops.embedding(np.zeros((2, 5), np.int64), _cuda(100, 32), _cuda(20, 32), _cuda(2, 32))
    ops.attention(_cuda(2, 5, 96), heads=4)
    ops.linear(x, w, None, "silu")  # matmul + bias_act
    entries = [launch[0] for launch in backend.launches]
    assert {"matmul_gemv", "bias_act", "add", "softmax_warp_row", "add_layernorm", "embedding_gather"} <= set(entries)
    assert "attention_fused" in entries
    # No tuned fused_mlp kernel: it runs as its two linears (act, then none).
    assert "fused_mlp_small_batch" not in entries
    rows = {r["op"]: r for r in registry.report()}
    assert "fused_mlp" not in rows and {"linear"} <= set(rows)
    assert rows["layernorm" if "layernorm" in rows else "add_layernorm"]["attrs"] == {"eps": 1e-5}
    assert all(r["source"] == "default" for r in rows.values())


def test_each_launch_says_whether_its_kernel_waits_for_the_one_before(fake, monkeypatch):
    backend, registry = fake
    x, w1, b1, w2, b2 = _cuda(4, 32), _cuda(32, 48), _cuda(48), _cuda(48, 32), _cuda(32)
    ops.linear(x, w1, b1, "gelu")  # gemv reads W before its wait: early only where W is vouched for
    ops.matmul(x, w1)  # the matmul op's gemv: not a PDL family (its B may be computed)
    ops.softmax(x)  # a PDL family
    monkeypatch.setattr(ops, "FUSED_MLP_DEFAULT_MAX_BATCH", 8)
    ops.fused_mlp(x, w1, b1, w2, b2, "gelu")  # small_batch: not one
    flags = dict(zip([launch[0] for launch in backend.launches], backend.pdl, strict=True))
    assert flags["softmax_warp_row"] and not flags["linear_gemv"] and not flags["matmul_gemv"]
    assert not any(pdl for entry, pdl in flags.items() if entry.startswith("fused_mlp_"))
    assert "fused_mlp_small_batch" in flags
    backend.constants = frozenset({w1.ptr})
    ops.linear(x, w1, b1, "gelu")
    ops.linear(x, w1.clone(), b1, "gelu")  # the same kernel on a weight nobody vouched for
    assert backend.launches[-2][0] == backend.launches[-1][0] == "linear_gemv"
    assert backend.pdl[-2:] == [True, False]


def test_a_model_vouches_for_its_parameters_when_it_captures(fake):
    from kernelmill.runtime.nn import MLP

    _backend, registry = fake
    model = runtime.Model(MLP.random(32, 64, 32), device="cuda", dtype="float16", registry=registry)
    params = {t.ptr for _, t in model.module.named_tensors()}
    assert model._constants() == params and len(params) == 4


def test_larger_batches_run_the_mlp_as_two_linears_and_say_so_once(fake, caplog):
    backend, registry = fake
    x, w1, b1, w2, b2 = _cuda(12, 32), _cuda(32, 48), _cuda(48), _cuda(48, 32), _cuda(32)
    with caplog.at_level(logging.INFO, logger="kernelmill.runtime.ops"):
        for _ in range(2):
            ops.fused_mlp(x, w1, b1, w2, b2, "gelu")
    assert [launch[0] for launch in backend.launches][-2:] == ["linear_gemv", "linear_gemv"]
    assert caplog.text.count("nothing tuned, running its two linears") == 1


def test_small_batches_run_as_two_linears_too_unless_the_fused_default_is_allowed(fake, monkeypatch):
    backend, registry = fake
    x, w1, b1, w2, b2 = _cuda(4, 32), _cuda(32, 48), _cuda(48), _cuda(48, 32), _cuda(32)
    ops.fused_mlp(x, w1, b1, w2, b2, "gelu")
    assert [launch[0] for launch in backend.launches][-2:] == ["linear_gemv", "linear_gemv"]
    monkeypatch.setattr(ops, "FUSED_MLP_DEFAULT_MAX_BATCH", 8)
    ops.fused_mlp(x, w1, b1, w2, b2, "gelu")
    assert [launch[0] for launch in backend.launches][-2] == "fused_mlp_small_batch"
    assert {r["op"] for r in registry.report()} == {"fused_mlp", "linear"}


def test_unaligned_inputs_are_copied(fake):
    backend, _ = fake
    x = _cuda(64)
    view = Tensor((63,), "float16", "cuda", buffer=Buffer(x.ptr + 2, 126), owner=x)
    ops.add(view, _cuda(63))
    args = backend.launches[-1][4]
    assert args[0] != view.ptr and args[0] % 16 == 0


def test_bert_runs_on_the_gpu_path_and_falls_back_from_graphs(fake, caplog):
    backend, registry = fake
    config = {"vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    config.update({"intermediate_size": 64, "max_position_embeddings": 16})
    model = runtime.Model(runtime.BertModel.random(config), device="cuda", dtype="float16", registry=registry)
    assert model.module.embeddings.word.device == "cuda" and model.module.embeddings.word.dtype == "float16"
    ids = np.arange(10).reshape(2, 5)
    out = model.forward(ids, attention_mask=np.ones((2, 5)))
    assert out.shape == (2, 5, 32) and out.device == "cuda" and model.last_run == "plain"
    per_forward = len(backend.launches)
    # 1 embedding + 1 layernorm, and per layer qkv, attention, out, add_layernorm, the MLP's two linears,
    # add_layernorm
    assert per_forward == 2 + 2 * 7
    with caplog.at_level(logging.WARNING):
        model.forward(ids, attention_mask=np.ones((2, 5)))  # the same signature again: capture is tried
        model.forward(ids, attention_mask=np.ones((2, 5)))
    assert model.last_run == "plain" and caplog.text.count("CUDA graph capture failed") == 1
    assert len(backend.launches) == 3 * per_forward
    report = model.kernel_report()
    assert {r["op"] for r in report} == {"embedding", "layernorm", "linear", "attention", "add_layernorm", "fused_mlp"}
    assert "default" in model.format_kernel_report()


def test_a_graph_the_driver_stops_accepting_is_dropped_for_plain_launches(fake, caplog):
    from kernelmill.runtime.graph import GraphUnavailable
    from kernelmill.runtime.nn import MLP

    backend, registry = fake
    model = runtime.Model(MLP.random(32, 64, 32), device="cuda", dtype="float16", registry=registry)
    x = np.ones((3, 32), np.float32)
    model.forward(x)
    (key,) = model._calls

    class Refusing:
        closed = False

        def replay(self, inputs):
            raise GraphUnavailable("cuGraphExecKernelNodeSetParams failed: CUresult 1")

        def close(self):
            Refusing.closed = True

    model._graphs[key] = Refusing()
    per_forward = len(backend.launches)
    with caplog.at_level(logging.WARNING):
        out = model.forward(x)
        model.forward(x)
    assert out.shape == (3, 32) and model.last_run == "plain" and Refusing.closed
    assert caplog.text.count("dropping the CUDA graph") == 1 and "CUresult 1" in caplog.text
    assert len(backend.launches) == 3 * per_forward  # both ran as plain launches


def test_the_kernel_report_says_how_graphs_launch_each_kernel(fake):
    from kernelmill.runtime.nn import MLP

    backend, registry = fake
    model = runtime.Model(MLP.random(32, 64, 32), device="cuda", dtype="float16", registry=registry)
    model.forward(np.ones((3, 32), np.float32))
    up, down = registry.entries()
    assert {r["launch"] for r in model.kernel_report()} == {None}  # no graph yet
    # A captured graph (as CapturedForward records it): the down linear early, the up kept on plain edges.
    model._graphs[("key",)] = SimpleNamespace(pdl_entries=[down, up], plain=frozenset({id(up)}))
    report = {r["shape"]: r["launch"] for r in model.kernel_report() if r["op"] == "linear"}
    assert report == {"3x64x32": "plain", "3x32x64": "early"}
    assert "launch" in model.format_kernel_report().splitlines()[0]


def test_the_per_kernel_pdl_choice_follows_its_setting(fake, monkeypatch):
    from kernelmill.runtime.nn import MLP
    from kernelmill.settings import reset_settings

    _backend, registry = fake
    monkeypatch.setenv("KERNELMILL_PDL_TUNE", "false")
    reset_settings()
    try:
        assert not runtime.Model(MLP.random(8, 16, 8), device="cuda", registry=registry).tune_pdl
        monkeypatch.delenv("KERNELMILL_PDL_TUNE")
        reset_settings()
        assert runtime.Model(MLP.random(8, 16, 8), device="cuda", registry=registry).tune_pdl
    finally:
        reset_settings()


def test_graph_timings_warm_each_graph_up_then_take_turns(fake, monkeypatch):
    from kernelmill.runtime import models as models_module
    from kernelmill.runtime.nn import MLP

    _backend, registry = fake
    model = runtime.Model(MLP.random(8, 16, 8), device="cuda", registry=registry)
    monkeypatch.setattr(models_module, "_WARMUP_S", 0.002)
    clock = _virtual_clock(monkeypatch, models_module)
    order = []

    class Timed:
        def __init__(self, name, seconds):
            self.name, self.seconds = name, seconds

        def replay(self, prepared, copy_output=True):
            assert copy_output is False
            order.append(self.name)
            clock.sleep(self.seconds)

    times = model._time_graphs({"a": Timed("a", 0.001), "b": Timed("b", 0.0002)}, (), rounds=3, replays=4)
    assert order[0] == "a" and order.index("b") >= 4  # a's warm-up first (at least one batch of replays)
    # Turns of 10 replays: at least 4, and at least _TURN_S (2 ms) of the faster graph's 0.2 ms replays.
    timed = order[-60:]
    assert timed == ["a"] * 10 + ["b"] * 10 + ["a"] * 10 + ["b"] * 10 + ["a"] * 10 + ["b"] * 10  # turns
    assert times == {"a": pytest.approx(1.0), "b": pytest.approx(0.2)}  # ms per replay, medians
    order.clear()
    model._time_graphs({"a": Timed("a", 0.001)}, (), rounds=2, replays=4)
    assert len(order) == 4 + 2 * 4  # slow enough: one warm-up batch, then two turns of 4


def _virtual_clock(monkeypatch, module) -> SimpleNamespace:
    """``module``'s time.perf_counter as a clock that only ``sleep`` moves: timings that do not depend on a
    loaded machine's sleep overshoot (a sleep-timed test failed 1 run in 15 under load)."""
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    clock = SimpleNamespace(perf_counter=lambda: now[0], sleep=sleep)
    monkeypatch.setattr(module, "time", clock)
    return clock


def test_tune_kernels_keeps_a_faster_stand_in_only_if_its_output_matches(fake, monkeypatch, caplog):
    import dataclasses

    from kernelmill.runtime import graph as graph_module
    from kernelmill.runtime import models as models_module
    from kernelmill.runtime.nn import MLP

    backend, registry = fake
    model = runtime.Model(MLP.random(32, 64, 32), device="cuda", dtype="float16", registry=registry)
    model.forward(np.ones((12, 32), np.float32))  # plain launches resolve the problems
    problems = list(model.problems)
    linears = [p for p in problems if p[0] == "linear"]
    assert len(linears) == 2 and any(p[0] == "fused_mlp" for p in problems)  # ran as its linears: no kernel
    up, down = (registry.resolved(*p) for p in linears)

    def variant(entry, **params):
        return dataclasses.replace(entry, params={**entry.params, **params})

    fast, wrong, slow = variant(down, k_splits=2), variant(down, k_splits=3), variant(up, k_splits=2)
    stand_ins = {id(down): [wrong, fast], id(up): [slow]}
    monkeypatch.setattr(registry, "alternatives", lambda entry, limit=4: stand_ins.get(id(entry), []))
    cost = {id(up): 0.003, id(down): 0.003, id(fast): 0.0005, id(wrong): 0.00025, id(slow): 0.006}
    clock = _virtual_clock(monkeypatch, models_module)

    class FakeGraph:
        """What the forward would capture: the problems' kernels as the registry has them now."""

        def __init__(self, backend, fn, prepared, pdl=False, plain=frozenset(), constants=frozenset()):
            self.pdl, self.plain, self.constants, self.pdl_entries = pdl, plain, constants, []
            self.entries = [registry.resolved(*p) for p in linears]
            self.closed = False

        def replay(self, prepared, copy_output=True):
            # Early launch costs the up projection's default a lot: with PDL everywhere `slow` would win.
            clock.sleep(sum(cost[id(e)] for e in self.entries) + (0.006 if self.pdl and up in self.entries else 0))
            value = 2.0 if any(e is wrong for e in self.entries) else 1.0  # ReLU for GELU, say
            return Tensor.from_numpy(np.full((12, 32), value, np.float32), "cuda", "float16")

        def close(self):
            self.closed = True

    monkeypatch.setattr(graph_module, "CapturedForward", FakeGraph)
    monkeypatch.setattr(models_module, "_WARMUP_S", 0.001)
    timed = []
    time_graphs = model._time_graphs
    monkeypatch.setattr(
        model,
        "_time_graphs",
        lambda graphs, prepared: (timed.extend(graphs.values()), time_graphs(graphs, prepared))[1],
    )
    first = FakeGraph(backend, None, (), pdl=True)
    with caplog.at_level(logging.INFO, logger="kernelmill.runtime.models"):
        kept, line = model._tune_kernels(first, (), problems)
    assert first.closed and not kept.closed and kept.pdl is True  # recaptured with PDL for the edge choice
    assert [g.pdl for g in timed] and not any(g.pdl for g in timed)  # stand-ins timed with plain edges
    assert registry.resolved(*linears[1]) is fast and registry.resolved(*linears[0]) is up  # slow reverted
    assert kept.entries == [up, fast]
    assert fast.note.startswith("chosen at capture over") and "k_splits=2" in line and line.count("linear ") == 1
    assert "changed the forward's output by 1; not used" in caplog.text
    # The choices are on disk for this GPU model: the down projection's stand-in, and the up projection's default.
    assert registry.remembered_choice(down) == fast.params and registry.remembered_choice(up) == up.params
    assert len(list(registry.chosen_dir.glob("nvidia-fake-h0/linear/*.json"))) == 2
    # Nothing faster: the first graph stays and says nothing.
    stand_ins.clear()
    again = FakeGraph(backend, None, (), pdl=False)
    assert model._tune_kernels(again, (), problems) == (again, "")


def test_tune_kernels_reuses_a_choice_made_on_the_same_gpu_model(fake, monkeypatch, tmp_path):
    import dataclasses

    from kernelmill.runtime import graph as graph_module
    from kernelmill.runtime import models as models_module
    from kernelmill.runtime.nn import MLP

    backend, registry = fake
    model = runtime.Model(MLP.random(32, 64, 32), device="cuda", dtype="float16", registry=registry)
    model.forward(np.ones((12, 32), np.float32))
    problems = list(model.problems)
    down_problem = [p for p in problems if p[0] == "linear"][1]
    down = registry.resolved(*down_problem)
    faster = dataclasses.replace(down, params={**down.params, "k_splits": 2})
    registry.remember_choice(down, faster)
    compiled = []
    monkeypatch.setattr(registry, "alternatives", lambda entry, limit=4: compiled.append(entry) or [])

    class FakeGraph:
        def __init__(self, backend, fn, prepared, pdl=False, plain=frozenset(), constants=frozenset()):
            self.pdl, self.plain, self.constants, self.pdl_entries = pdl, plain, constants, []
            self.closed = False

        def replay(self, prepared, copy_output=True):
            return Tensor.from_numpy(np.ones((12, 32), np.float32), "cuda", "float16")

        def close(self):
            self.closed = True

    monkeypatch.setattr(graph_module, "CapturedForward", FakeGraph)
    monkeypatch.setattr(models_module, "_WARMUP_S", 0.001)
    first = FakeGraph(backend, None, (), pdl=True)
    kept, line = model._tune_kernels(first, (), problems)
    now = registry.resolved(*down_problem)
    assert now.params == faster.params and now.chosen and "earlier capture on this GPU" in now.note
    assert "(remembered)" in line and first.closed and kept.pdl is True
    assert [e.shape for e in compiled] == [(12, 64, 32)]  # only the up projection was timed
    # A record made against another default, or on another GPU model, does not hold.
    assert registry.remembered_choice(dataclasses.replace(down, params={**down.params, "stages": 3})) is None
    backend.device.info.name = "NVIDIA Fake H1"
    assert registry.remembered_choice(down) is None


def _rows_graphs(monkeypatch, nbytes: int) -> tuple[list, list]:
    """Fake captures of an MLP forward with 8 outputs: each replays a (rows, 8) output filled with the rows it was
    captured for. Returns the rows of each capture and of each close, in order."""
    from kernelmill.runtime import graph as graph_module

    captured, closed = [], []

    class FakeGraph:
        nodes, programmatic_edges, pdl_entries = 2, 0, []

        def __init__(self, backend, fn, prepared, pdl=False, plain=frozenset(), constants=frozenset()):
            self.rows, self.nbytes = prepared[0].shape[0], nbytes
            captured.append(self.rows)

        def replay(self, prepared, copy_output=True):
            assert prepared[0].shape[0] == self.rows
            return Tensor.from_numpy(np.full((self.rows, 8), self.rows, np.float32), "cuda", "float16")

        def close(self):
            closed.append(self.rows)

    monkeypatch.setattr(graph_module, "CapturedForward", FakeGraph)
    return captured, closed


def test_a_model_keeps_at_most_max_graphs_and_releases_the_least_recently_replayed(fake, monkeypatch, caplog):
    from kernelmill.runtime.nn import MLP

    _backend, registry = fake
    captured, closed = _rows_graphs(monkeypatch, nbytes=3 * 2**20)
    model = runtime.Model(MLP.random(8, 16, 8), device="cuda", registry=registry, tune_kernels=False, max_graphs=2)

    def forward(rows):
        return model.forward(np.ones((rows, 8), np.float32))

    for rows in (1, 2):
        forward(rows)  # plain (warm-up)
        assert forward(rows).numpy()[0, 0] == rows and model.last_run == "graph"
    assert captured == [1, 2] and not closed
    assert forward(1).numpy()[0, 0] == 1  # replayed: 2 is now the least recently used
    forward(3)
    with caplog.at_level(logging.INFO, logger="kernelmill.runtime.models"):
        forward(3)
    assert captured == [1, 2, 3] and closed == [2] and len(model._graphs) == 2
    assert "3.0 MiB of buffers" in caplog.text
    assert "released the CUDA graph for inputs 2x8 (3.0 MiB; the least recently used of more than max_graphs=2)" in (
        caplog.text
    )
    # Back again: a plain forward first (its kernels are still resolved), then a new capture.
    assert "pads them to a few sizes" not in caplog.text
    forward(2)
    assert model.last_run == "plain" and captured == [1, 2, 3]
    with caplog.at_level(logging.WARNING, logger="kernelmill.runtime.models"):
        assert forward(2).numpy()[0, 0] == 2 and model.last_run == "graph" and closed == [2, 1]
    # As many graphs released as it keeps: the log suggests buckets, once.
    assert caplog.text.count("2 CUDA graphs released to keep max_graphs=2") == 1 and "buckets=[...]" in caplog.text
    model.reset_graphs()
    assert sorted(closed) == [1, 2, 2, 3]


def test_graphs_are_dropped_once_the_parameters_they_were_captured_with_are_replaced(fake, monkeypatch, caplog):
    """A graph launches its kernels on the addresses of the weights it was captured with: after a weight was
    assigned anew (or ``model.module.to(...)``) it replayed on the old one's freed, maybe reused, memory."""
    from kernelmill.runtime.nn import MLP

    _backend, registry = fake
    captured, closed = _rows_graphs(monkeypatch, nbytes=2**20)
    model = runtime.Model(MLP.random(8, 16, 8), device="cuda", registry=registry, tune_kernels=False)
    x = np.ones((3, 8), np.float32)
    model.forward(x)
    model.forward(x)
    assert model.last_run == "graph" and captured == [3] and not closed
    model.module.down.weight = Tensor.from_numpy(np.zeros((16, 8), np.float32), "cuda", "float16")
    with caplog.at_level(logging.INFO, logger="kernelmill.runtime.models"):
        model.forward(x)
    assert model.last_run == "plain" and closed == [3]
    assert "the module's parameters were replaced since its CUDA graphs were captured" in caplog.text
    model.forward(x)
    assert model.last_run == "graph" and captured == [3, 3]
    model.forward(x)  # the new weights are watched in turn: the graph stays while they do
    assert model.last_run == "graph" and captured == [3, 3] and closed == [3]
    model.module.to(dtype="float32")  # every weight a new tensor: the float16 graph goes (its memory with it)
    model.forward(x)
    assert model.last_run == "plain" and closed == [3, 3]


def test_capture_buckets_captures_every_bucket_ahead_of_the_requests(fake, monkeypatch, caplog):
    from kernelmill.runtime.nn import MLP

    _backend, registry = fake
    captured, _closed = _rows_graphs(monkeypatch, nbytes=2**20)
    batches = []
    compile_many = registry.compiler.compile_many
    monkeypatch.setattr(
        registry.compiler,
        "compile_many",
        lambda sources, arch: [batches.append(len(sources)), compile_many(sources, arch)][1],
    )
    model = runtime.Model(MLP.random(8, 16, 8), device="cuda", registry=registry, tune_kernels=False, buckets=[4, 16])
    with caplog.at_level(logging.INFO, logger="kernelmill.runtime.models"):
        rows = model.capture_buckets(np.ones((3, 8), np.float32))
    assert [(r["size"], r["inputs"], r["run"]) for r in rows] == [(4, "4x8", "graph"), (16, "16x8", "graph")]
    assert captured == [4, 16] and "bucket 2/2 (16): inputs 16x8, output 16x8, graph in" in caplog.text
    # Both buckets' kernels (each MLP as two linears) compiled in one round, before the first forward.
    assert batches == [4] and "kernels of 2 input shapes planned and compiled" in caplog.text
    # Requests replay those graphs from the first on: nothing planned or captured again.
    monkeypatch.setattr(model, "_plan", lambda inputs: pytest.fail("planned again"))
    out = model.forward(np.ones((2, 3, 8), np.float32))
    assert out.shape == (2, 3, 8) and model.last_run == "graph" and captured == [4, 16]
    assert model.forward(np.ones((9, 8), np.float32)).numpy()[0, 0] == 16


def test_inputs_whose_graph_was_released_are_not_planned_again(fake, monkeypatch):
    from kernelmill.runtime.nn import MLP

    _backend, registry = fake
    model = runtime.Model(MLP.random(8, 16, 8), device="cuda", registry=registry, tune_kernels=False, graphs=False)
    planned = []
    plan = model._plan
    monkeypatch.setattr(model, "_plan", lambda inputs: planned.append(len(inputs)) or plan(inputs))
    for rows in (1, 2, 1, 2):
        model.forward(np.ones((rows, 8), np.float32))
    model._calls.clear()  # what releasing the graphs does
    model.forward(np.ones((1, 8), np.float32))
    assert len(planned) == 2


def test_max_graphs_comes_from_the_settings(fake, monkeypatch):
    from kernelmill.runtime.nn import MLP
    from kernelmill.settings import reset_settings

    _backend, registry = fake
    monkeypatch.setenv("KERNELMILL_MAX_GRAPHS", "3")
    reset_settings()
    try:
        assert runtime.Model(MLP.random(8, 16, 8), device="cuda", registry=registry).max_graphs == 3
        assert runtime.Model(MLP.random(8, 16, 8), device="cuda", registry=registry, max_graphs=1).max_graphs == 1
        monkeypatch.setenv("KERNELMILL_MAX_GRAPHS", "0")
        reset_settings()
        with pytest.raises(ValueError, match="KERNELMILL_MAX_GRAPHS=.0.: Input should be greater than or equal to 1"):
            runtime.Model(MLP.random(8, 16, 8), device="cuda", registry=registry)
    finally:
        monkeypatch.delenv("KERNELMILL_MAX_GRAPHS")
        reset_settings()


def test_buckets_on_the_gpu_path_pad_before_the_kernels_and_cut_after(fake):
    from kernelmill.runtime.nn import MLP

    backend, registry = fake
    config = {"vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    config.update({"intermediate_size": 64, "max_position_embeddings": 16})
    bert = runtime.Model(runtime.BertModel.random(config), device="cuda", registry=registry, buckets=[8, 16])
    out = bert.forward(np.arange(10).reshape(2, 5))
    assert out.shape == (2, 5, 32)
    attention = [launch for launch in backend.launches if launch[0].startswith("attention")]
    assert attention and {p[1] for p in bert.problems if p[0] == "attention"} == {(2, 2, 8, 16)}
    row = 32 * 2  # bytes of one token's hidden state in float16
    ((dst, dst_pitch, _src, src_pitch, width, height),) = backend.copies_2d
    assert (dst, dst_pitch, src_pitch, width, height) == (out.ptr, 5 * row, 8 * row, 5 * row, 2)
    one = bert.forward(np.arange(5).reshape(1, 5))  # batch 1: a view of the padded output, no copy
    assert one.shape == (1, 5, 32) and len(backend.copies_2d) == 1

    mlp = runtime.Model(MLP.random(8, 16, 8), device="cuda", registry=registry, buckets=[4])
    out = mlp.forward(np.ones((3, 8), np.float32))
    assert out.shape == (3, 8) and ("fused_mlp", (4, 8, 16, 8)) in {p[:2] for p in mlp.problems}


def _edge_choice(fake, monkeypatch, cost):
    """A one-layer MLP forward on the fake backend and a stand-in for CapturedForward whose replay takes
    ``cost(plain_ops)`` seconds of a virtual clock (``plain_ops``: "up" / "down" for the linears on plain
    edges). Returns the model, its problems, the up and down entries, the graph class and the graphs it made."""
    from kernelmill.runtime import graph as graph_module
    from kernelmill.runtime import models as models_module
    from kernelmill.runtime.nn import MLP

    backend, registry = fake
    model = runtime.Model(MLP.random(32, 64, 32), device="cuda", dtype="float16", registry=registry)
    model.forward(np.ones((12, 32), np.float32))
    up, down = registry.entries()
    captures = []
    clock = _virtual_clock(monkeypatch, models_module)

    class FakeGraph:
        def __init__(self, backend, fn, prepared, pdl=False, plain=frozenset(), constants=frozenset()):
            self.pdl, self.plain, self.constants = pdl, frozenset(plain), constants
            self.pdl_entries = [e for e in (up, down) if id(e) not in self.plain]
            self.closed = False
            captures.append(self)

        def replay(self, prepared, copy_output=True):
            assert not self.closed
            clock.sleep(cost({name for name, e in (("up", up), ("down", down)) if id(e) in self.plain}))

        def close(self):
            self.closed = True

    monkeypatch.setattr(graph_module, "CapturedForward", FakeGraph)
    monkeypatch.setattr(models_module, "_WARMUP_S", 0.001)
    return model, list(model.problems), up, down, FakeGraph, captures


def test_pdl_edge_choices_are_timed_once_per_gpu_model_and_forward(fake, monkeypatch):
    # The down projection is slower launched early, the up projection faster (by far: no noise decides).
    backend, registry = fake
    model, problems, up, down, FakeGraph, captures = _edge_choice(
        fake, monkeypatch, lambda plain: 0.0008 + 0.0006 * ("up" in plain) - 0.0006 * ("down" in plain)
    )
    kept, line = model._tune_edges(FakeGraph(backend, None, ()), (), problems)
    assert kept.plain == {id(down)} and "plain edges into linear 12x32x64" in line and "remembered" not in line
    assert "with PDL everywhere" in line and "with plain edges everywhere" in line, line
    # The first, one trial per PDL kernel, then plain edges everywhere for the last round.
    assert len(captures) == 4 and captures[-1].plain == {id(up), id(down)}
    assert [g.closed for g in captures] == [True, True, False, True]
    # Another capture of the same forward on the same GPU model: the recorded choice, no timing.
    monkeypatch.setattr(model, "_time_graphs", lambda graphs, prepared: pytest.fail("timed again"))
    captures.clear()
    kept, line = model._tune_edges(FakeGraph(backend, None, ()), (), problems)
    assert kept.plain == {id(down)} and line == "; plain edges into linear 12x32x64 (remembered)"
    assert len(captures) == 2  # the first and the one with the remembered edges
    # Another forward (other problems) or another GPU model is timed afresh.
    assert registry.remembered_edges([up, down], problems[:1]) is None
    backend.device.info.name = "NVIDIA Fake H1"
    assert registry.remembered_edges([up, down], problems) is None


def test_choices_timed_while_replays_varied_are_not_remembered(fake, monkeypatch):
    """A choice timed while other work loaded the GPU was remembered for the GPU model: an H200's batch-256 MLP
    took runners-up chosen beside a test suite on the other GPU, and later processes ran it at 0.89x eager."""
    replays = []

    def cost(plain):  # plain edges into the down projection win by far, but every other 10 replays run 3x slower
        replays.append(1)
        return (0.0008 - 0.0006 * ("down" in plain)) * (3 if (len(replays) - 1) // 10 % 2 else 1)

    backend, registry = fake
    model, problems, up, down, FakeGraph, _ = _edge_choice(fake, monkeypatch, cost)
    model._timing_spread = 0.0
    kept, line = model._tune_edges(FakeGraph(backend, None, ()), (), problems)
    assert id(down) in kept.plain  # used by this process
    assert model._timing_spread > 0.5 and not model._steady_timing()
    assert registry.remembered_edges([up, down], problems) is None  # but not remembered
    # Steady replays: remembered, as before.
    model, problems, up, down, FakeGraph, _ = _edge_choice(
        fake, monkeypatch, lambda plain: 0.0008 - 0.0006 * ("down" in plain)
    )
    model._timing_spread = 0.0
    model._tune_edges(FakeGraph(backend, None, ()), (), problems)
    assert model._timing_spread < 1e-9 and registry.remembered_edges([up, down], problems) == {1}


@pytest.mark.parametrize("corner", ["plain", "pdl"])
def test_pdl_edge_choice_takes_turns_with_both_corners(fake, monkeypatch, corner):
    """Choices that pay only together (plain edges everywhere), and a choice that a later round shows slower
    than PDL everywhere (drift at the power cap), are settled by the last round of turns with both corners."""
    rounds = []

    def cost(plain):
        if corner == "plain":  # one plain edge alone costs, both together gain
            return 0.0005 if plain == {"up", "down"} else 0.0008 + 0.0004 * bool(plain)
        # "pdl": the down projection's plain edge wins its own turn, then loses in the last round
        return 0.0008 + 0.0006 * ("up" in plain) + (0.0004 if len(rounds) > 2 else -0.0004) * ("down" in plain)

    backend, registry = fake
    model, problems, up, down, FakeGraph, captures = _edge_choice(fake, monkeypatch, cost)
    time_graphs = model._time_graphs
    monkeypatch.setattr(
        model, "_time_graphs", lambda graphs, prepared: (rounds.append(1), time_graphs(graphs, prepared))[1]
    )
    first = FakeGraph(backend, None, ())
    kept, line = model._tune_edges(first, (), problems)
    assert len(rounds) == 3  # one turn per PDL kernel, then the last round
    if corner == "plain":
        assert kept.plain == {id(up), id(down)} and first.closed
        assert "plain edges into linear" in line and "12x32x64" in line and "12x64x32" in line, line
        assert registry.remembered_edges([up, down], problems) == {0, 1}
    else:
        assert kept is first and not first.closed and "PDL for every kernel that has it" in line, line
        assert registry.remembered_edges([up, down], problems) == set()
    # Every graph but the one kept was closed, and the logged times are that last round's.
    assert [g for g in captures if not g.closed] == [kept]
    assert "with PDL everywhere" in line and "with plain edges everywhere" in line, line


def test_a_first_forward_lists_its_kernels_without_launching_and_compiles_them_together(fake, monkeypatch):
    from kernelmill.runtime.nn import MLP

    backend, registry = fake
    batches = []
    compile_many = registry.compiler.compile_many

    def counted(sources, arch):
        batches.append(len(sources))
        return compile_many(sources, arch)

    monkeypatch.setattr(registry.compiler, "compile_many", counted)
    model = runtime.Model(MLP.random(32, 64, 32), device="cuda", dtype="float16", registry=registry)
    x = Tensor.from_numpy(np.ones((12, 32), np.float32), "cuda", "float16")
    with ops.planning() as planned:
        model.module.forward_prepared(x)
    # The MLP runs as its two linears (nothing tuned for fused_mlp): those are what it would launch.
    assert [p[:2] for p in planned] == [("linear", (12, 64, 32)), ("linear", (12, 32, 64))]
    assert backend.launches == [] and registry.entries() == []
    model.forward(np.ones((12, 32), np.float32))
    assert batches == [2] and len(registry.entries()) == 2  # one round of compiles, then the launches
    assert [launch[0] for launch in backend.launches] == ["linear_gemv", "linear_gemv"]
    model.forward(np.ones((12, 32), np.float32))
    assert batches == [2]  # the same signature: nothing to prepare


def test_the_runners_up_of_several_kernels_compile_in_one_round(fake, monkeypatch):
    _backend, registry = fake
    entries = [registry.get("linear", (256, n, 4096), "float16", {"act": "none"}) for n in (4096, 11008)]
    options = [registry._alternative_params(e, 4) for e in entries]
    assert all(e.family == "wgmma" for e in entries) and all(options)
    rounds = []
    monkeypatch.setattr(registry.compiler, "compile_many", lambda sources, arch: rounds.append((len(sources), arch)))
    registry.compile_alternatives(entries)
    assert rounds == [(len(options[0]) + len(options[1]), entries[0].arch)]
