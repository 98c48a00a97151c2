"""plan_rebinding: which buffers of a captured forward a replay may move, and which kernel arguments follow
them (no GPU: launch records with fake nodes)."""

from __future__ import annotations

from kernelmill.kernels.device import Buffer
from kernelmill.kernels.ops.base import TensorMapArg
from kernelmill.runtime.backend import AllocRecord, CaptureArena, LaunchRecord, MemRecord
from kernelmill.runtime.graph import plan_rebinding

X, H, Y = 0x1000, 0x9000, 0x20000  # a static input, a hidden buffer, the output
SLOTS = [(X, 0x400), (Y, 0x100)]


def launch(*args, node="n"):
    return LaunchRecord(node, kernel=None, args=list(args))


def test_arguments_into_inputs_and_output_follow_them_with_their_offsets():
    tmap = TensorMapArg("tensor_map", 2, (64, 16), (64, 16), "float16", 128)
    work = [
        launch(tmap, Buffer(X, 0), Buffer(H, 0), 16, node="up"),  # reads X (a map is built over it), writes H
        launch(Buffer(H, 0), Buffer(X + 0x200, 0), Buffer(Y, 0), 7, node="down"),  # a view into X at +0x200
        launch(Buffer(H, 0), node="other"),  # touches neither
    ]
    plan = plan_rebinding(work, SLOTS)
    assert plan.movable == (True, True)
    assert plan.nodes == ((0, ((1, 0, 0),)), (1, ((1, 0, 0x200), (2, 1, 0))))


def test_copies_and_fills_pin_what_they_touch():
    work = [launch(Buffer(X, 0), Buffer(Y, 0)), MemRecord(dst=Y + 0x80, nbytes=0x10)]
    assert plan_rebinding(work, SLOTS).movable == (True, False)
    plan = plan_rebinding([MemRecord(dst=H, nbytes=0x10, src=X + 0x3F0), launch(Buffer(X, 0), Buffer(Y, 0))], SLOTS)
    assert plan.movable == (False, True)
    assert plan.nodes == ((1, ((1, 1, 0),)),)  # only the output argument moves
    # Bytes just past a slot are someone else's.
    assert plan_rebinding([MemRecord(dst=X + 0x400, nbytes=8)], SLOTS).movable == (True, True)


def test_launches_without_a_known_node_and_overlapping_or_missing_slots_pin():
    work = [launch(Buffer(X, 0), Buffer(H, 0), node=None), launch(Buffer(H, 0), Buffer(Y, 0))]
    plan = plan_rebinding(work, SLOTS)
    assert plan.movable == (False, True) and plan.nodes == ((1, ((1, 1, 0),)),)
    assert plan_rebinding(work, [(X, 0x400), (X + 0x100, 0x10)]).movable == (False, False)  # an output inside X
    assert plan_rebinding(work, [None, (Y, 0x100)]).movable == (False, True)  # an input of None, or a view output
    assert plan_rebinding(work, [(X, 0), (Y, 0x100)]).movable == (False, True)  # nothing to move


def test_a_slot_is_its_bytes_only_from_their_last_allocation():
    # The output took the bytes of a buffer that the capture dropped: the work before its allocation is that
    # buffer's, neither moved with the output nor pinning it.
    work = [
        AllocRecord(Y, 0x200),  # a hidden buffer, later dropped
        launch(Buffer(X, 0), Buffer(Y, 0), node="up"),
        MemRecord(dst=Y + 0x10, nbytes=0x10),
        AllocRecord(Y, 0x100),  # the output
        launch(Buffer(Y, 0), Buffer(X, 0), node="down"),
    ]
    plan = plan_rebinding(work, SLOTS)
    assert plan.movable == (True, True)
    assert plan.nodes == ((1, ((0, 0, 0),)), (4, ((0, 1, 0), (1, 0, 0))))
    # A fill after the output's allocation still pins it.
    assert plan_rebinding([*work, MemRecord(dst=Y, nbytes=4)], SLOTS).movable == (True, False)


class _Device:
    """Hands out fresh addresses (no GPU)."""

    def __init__(self):
        self.next, self.allocs = 0x10000, []

    def alloc(self, nbytes):
        self.allocs.append(nbytes)
        self.next += 0x1000
        return Buffer(self.next, nbytes)


def test_the_capture_arena_hands_dropped_buffers_to_later_allocations_only():
    import gc

    arena = CaptureArena(_Device())
    a, b = arena.alloc(256), arena.alloc(512)
    a_ptr, b_ptr = a.ptr, b.ptr
    assert a_ptr != b_ptr and arena.owns(a) and not arena.owns(Buffer(a_ptr, 256))
    del a
    gc.collect()
    c = arena.alloc(128)  # fits the dropped 256 bytes
    assert c.ptr == a_ptr and c.nbytes == 128
    d = arena.alloc(256)  # b is in use, c holds a's bytes: new memory
    assert d.ptr not in (a_ptr, b_ptr) and arena.nbytes == 256 + 512 + 256
    del b, c
    gc.collect()
    assert arena.alloc(200).ptr == a_ptr  # the smallest block that fits
    assert arena.alloc(300).ptr == b_ptr
    assert arena.device.allocs == [256, 512, 256]
    arena.close()
    del d
    gc.collect()  # dropped after close: nothing comes back
    assert arena.nbytes == 0 and arena._free == []
