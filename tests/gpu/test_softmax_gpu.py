"""softmax's row-splitting families (cluster_row, smem_row) at odd shapes and every cluster size, and every
family with misaligned base pointers (marker gpu).

cluster_row once faulted with a misaligned address at 3x17 fp32: it took 16-byte accesses whenever a chunk's
length was a multiple of vec, though with an odd cols the chunk starts misaligned on every other row.
"""

from __future__ import annotations

import pytest

from kernelmill.kernels.compile import Compiler
from kernelmill.kernels.device import Buffer
from kernelmill.kernels.evaluate import evaluate
from kernelmill.kernels.ops.base import numpy_dtype
from kernelmill.kernels.ops.softmax import SOFTMAX
from kernelmill.kernels.variant import Variant
from kernelmill.kernels.verify import compare

pytestmark = pytest.mark.gpu

DTYPES = ("float32", "float16", "bfloat16")
#: Odd column counts (rows starting misaligned), one element, a long odd row, the issue-8 long rows.
ODD_SHAPES = [(3, 17), (1, 1), (5, 33333), (2, 32000), (1, 32000), (4, 32001), (7, 8)]


@pytest.fixture(scope="module")
def device():
    from kernelmill.kernels.device import get_device

    return get_device()


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    return Compiler(cache_dir=tmp_path_factory.mktemp("softmax-cubins"))


def _long_row_points(family: str, dtype: str) -> list[dict]:
    """Defaults, every cluster size, scalar accesses, and the points meant for 4096x32000 and 1x32000."""
    fam = SOFTMAX.family(family)
    base = fam.defaults(dtype)
    vec = base["vec"]
    points = [base, *({**base, "cluster": c} for c in fam.param("cluster").values), {**base, "vec": 1}]
    if family == "cluster_row":
        points += [{**base, "cluster": 8, "threads": 128, "unroll": 32 // vec}]
    else:
        points += [{**base, "cluster": 2, "threads": 256}, {**base, "threads": 1024, "unroll": max(1, 8 // vec)}]
    unique = []
    for p in points:
        if p not in unique and fam.check(p, dtype) is None:
            unique.append(p)
    return unique


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["cluster_row", "smem_row"])
def test_row_splitting_families_verify_on_odd_shapes(device, compiler, family, dtype):
    points = _long_row_points(family, dtype)
    ran = []
    for params in points:
        variant = Variant.create("softmax", family, dtype, params)
        shapes = [shape for shape in ODD_SHAPES if not variant.check_shape(shape)]
        for shape in shapes:
            ev = evaluate(variant, shape, device, compiler, seeds=2, timed=False)
            assert ev.ok, f"{variant.describe()} at {shape}: {ev.status}: {ev.reason}"
        ran.append(len(shapes))
    # Every point ran at some shape (a check_shape that refused them all passed with nothing run).
    assert points and all(ran), ran


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("family", list(SOFTMAX.families))
def test_misaligned_base_pointers_take_the_scalar_path(device, compiler, family, dtype):
    """Rows of a multiple of vec columns but x and y one element past an aligned address (as a view into a
    larger tensor can be): the kernels must see it and not take 16-byte accesses."""
    fam = SOFTMAX.family(family)
    variant = Variant.create("softmax", family, dtype, fam.defaults(dtype))
    module = device.load(variant.compile(compiler).cubin)
    np_dtype, item = numpy_dtype(dtype), numpy_dtype(dtype).itemsize
    for shape in [(3, 64), (2, 32000)]:
        x = SOFTMAX.make_inputs(shape, dtype, seed=11)["x"]
        ref = SOFTMAX.reference({"x": x}, {})["y"]
        nbytes = x.nbytes
        raw = {name: device.alloc(nbytes + 64) for name in ("x", "y")}
        bufs = {name: Buffer(raw[name].ptr + item, nbytes) for name in raw}
        for name, b in fam.workspace(shape, variant.params, dtype).items():
            bufs[name] = device.alloc(b)
        device.copy_in(bufs["x"], x)
        device.fill(raw["y"], 0xFF)
        for launch in fam.launches(shape, variant.params, dtype):
            args = [bufs[a] if isinstance(a, str) else a for a in launch.args]
            module.kernel(launch.entry).launch(launch.grid, launch.block, launch.smem_bytes, args)
        device.synchronize(timeout_s=10)
        y = device.download(bufs["y"], shape, np_dtype)
        check = compare(y, ref, 11, "y", SOFTMAX.tolerance(shape, dtype))
        assert check.failure() is None, f"{variant.describe()} at {shape}: {check}"
