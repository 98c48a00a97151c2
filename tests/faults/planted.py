"""A plugin op whose one family plants a fault chosen by its `fault` knob (fault tests only).

Enabled the way an operator enables plugins: KERNELMILL_PLUGINS=tests.faults.planted.
It computes a row softmax, correctly when fault=none.
"""

from pathlib import Path

from kernelmill.kernels.ops import register_op
from kernelmill.kernels.ops.base import Family, Launch, Param, cdiv
from kernelmill.kernels.ops.softmax import Softmax

FAULTS = ("none", "oob", "hang", "race", "nan", "wrong", "hang_timed")


class Planted(Family):
    name = "planted"
    template = "planted/planted.cu.j2"
    template_root = Path(__file__).parent / "templates"
    description = (
        "plants one fault per point: out-of-bounds write, hang, race, NaN, wrong result, a hang only when run "
        "again on its last output (as timing runs it)"
    )
    params = (Param("fault", FAULTS),)

    def defaults(self, dtype):
        return {"fault": "none"}

    def launches(self, shape, params, dtype):
        rows, cols = shape
        return [Launch("planted", (cdiv(rows, 4), 1, 1), (128, 1, 1), 0, ("x", "y", rows, cols))]


class PlantedSoftmax(Softmax):
    name = "planted_softmax"
    families = {"planted": Planted()}


PLANTED = register_op(PlantedSoftmax())
