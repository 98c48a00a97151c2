"""plan_rebinding: which buffers of a captured forward a replay may move, and which kernel arguments follow
them (no GPU: launch records with fake nodes)."""

from __future__ import annotations

from kernelmill.kernels.device import Buffer
from kernelmill.kernels.ops.base import TensorMapArg
from kernelmill.runtime.backend import LaunchRecord, MemRecord
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
