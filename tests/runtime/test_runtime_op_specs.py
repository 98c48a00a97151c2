"""The runtime's OpSpecs (linear, bias_act, add, layernorm, add_layernorm, embedding, attention, sdpa): float64
references against PyTorch, launch geometry, constraints (no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest

from kernelmill.kernels.ops import OPS
from kernelmill.kernels.ops.attention import ATTENTION, smem_bytes
from kernelmill.kernels.ops.base import SpecError
from kernelmill.kernels.ops.embedding import EMBEDDING, pack_ids, unpack_ids
from kernelmill.kernels.ops.layernorm import LAYERNORM
from kernelmill.kernels.render import render
from kernelmill.kernels.variant import Variant

NEW_OPS = ["linear", "bias_act", "add", "layernorm", "add_layernorm", "embedding", "attention", "sdpa"]
SHAPES = {
    "linear": (5, 7, 9),
    "bias_act": (3, 13),
    "add": (29,),
    "layernorm": (4, 37),
    "add_layernorm": (4, 37),
    "embedding": (2, 5, 12, 30, 3),
    "attention": (2, 3, 7, 8),
    "sdpa": (2, 3, 7, 8),
}

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _torch_ref(op, ins, attrs):
    thunk = OPS[op].torch_reference({k: torch.from_numpy(np.asarray(v, dtype=v.dtype)) for k, v in ins.items()}, attrs)
    return thunk()


@pytest.mark.parametrize("op", NEW_OPS)
def test_registered_with_one_or_more_families_and_a_reference_matching_torch(op):
    spec = OPS[op]
    assert spec.families
    shape = SHAPES[op]
    attrs = spec.resolve_attrs({})
    ins = spec.make_inputs(shape, "float32", seed=3)
    for name, want in spec.tensor_shapes(shape).items():
        if name in ins:
            assert ins[name].shape == want, name
    (out_name,) = spec.outputs
    ref = spec.reference(ins, attrs)[out_name]
    assert ref.dtype == np.float64 and ref.shape == spec.tensor_shapes(shape)[out_name]
    got = _torch_ref(op, ins, attrs).double().numpy().reshape(ref.shape)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", NEW_OPS)
def test_launch_args_name_tensors_and_renders(op):
    spec = OPS[op]
    for fam in spec.families.values():
        # TMA (wgmma) needs 16-byte row strides: K and N multiples of 8. The mma attention takes head_dim in
        # multiples of 16, the wgmma attention 64 (its defaults) or 128.
        attention = len(SHAPES[op]) == 4
        wgmma = (2, 3, 7, 64) if attention else (5, 16, 24)
        shape = {"wgmma": wgmma, "mma": (2, 3, 7, 16)}.get(fam.name, SHAPES[op])
        for dtype in fam.dtypes:
            params = fam.defaults(dtype)
            assert fam.check(params, dtype) is None
            assert fam.check_shape(shape, params, dtype) is None
            names = set(spec.inputs) | set(spec.outputs) | set(fam.workspace(shape, params, dtype))
            for launch in fam.launches(shape, params, dtype):
                assert all(a in names for a in launch.args if isinstance(a, str)), launch
                assert 0 < launch.threads <= 1024 and all(g >= 1 for g in launch.grid)
            source = Variant.create(op, fam.name, dtype, params).source
            assert all(launch.entry in source for launch in fam.launches(shape, params, dtype))


def test_embedding_ids_are_packed_as_exact_nonzero_digits():
    ids = np.array([[0, 5, 255, 256], [30521, 65535, 70000, 256**3 - 1]])
    for dtype in ("float32", "float16", "bfloat16"):
        packed = pack_ids(ids, dtype)
        assert packed.shape == (2, 4, 3) and (packed.astype(np.float64) >= 1).all()
        assert np.array_equal(unpack_ids(packed), ids)
    with pytest.raises(ValueError):
        pack_ids(np.array([256**3]), "float16")
    ins = EMBEDDING.make_inputs((2, 3, 4, 10, 2), "bfloat16", seed=1)
    assert unpack_ids(ins["ids"]).max() < 10 and unpack_ids(ins["type_ids"]).max() < 2
    # A vocabulary the three digits cannot number is refused (it was accepted, then make_inputs raised).
    fam, params = EMBEDDING.family("gather"), EMBEDDING.family("gather").defaults("float16")
    assert fam.check_shape((1, 64, 1, 256**3, 1), params, "float16") is None
    assert "a vocabulary of 16777217 > 16777216 ids" in fam.check_shape((1, 64, 1, 256**3 + 1, 1), params, "float16")


def test_attention_limits_and_shared_memory():
    fam = ATTENTION.family("fused")
    params = fam.defaults("float16")
    assert "head_dim 200 > max_head_dim" in fam.check_shape((1, 1, 8, 200), params, "float16")
    (launch,) = fam.launches((2, 12, 128, 64), params, "float16")
    assert launch.grid == (8, 12, 2) and launch.smem_bytes == smem_bytes(params, 64) < 227 * 1024
    assert fam.check({**params, "rows_per_warp": 8, "max_head_dim": 256, "block_kv": 128}, "float16")
    # Every valid point fits shared memory at its largest head_dim.
    assert all(smem_bytes(p, p["max_head_dim"]) <= 227 * 1024 for p in fam.space("float32"))


def test_layernorm_eps_is_an_attribute_baked_into_the_source():
    assert LAYERNORM.resolve_attrs({}) == {"eps": 1e-12}
    assert LAYERNORM.resolve_attrs({"eps": "1e-05"}) == {"eps": 1e-5}
    with pytest.raises(SpecError):
        LAYERNORM.resolve_attrs({"eps": 0.1})
    fam = LAYERNORM.family("row")
    source = render(fam, fam.defaults("float32"), "float32", {"eps": 1e-5})
    assert "1e-05f" in source and "add_layernorm" not in source
    add_source = render(OPS["add_layernorm"].family("row"), fam.defaults("float32"), "float32", {"eps": 1e-12})
    assert "add_layernorm(" in add_source and "1e-12f" in add_source


def test_linear_tensorcore_serves_16_bit_only_and_simt_is_exact():
    spec = OPS["linear"]
    assert spec.family("tensorcore").dtypes == ("float16", "bfloat16")
    assert spec.family("simt").precision("float32") == "float32"
    assert spec.family("simt").defaults("float32")["BK"] == 16  # the bias epilogue spills at BK=8


def test_vec_families_refuse_wide_vectors():
    fam = OPS["add"].family("vec")
    assert fam.check({"vec": 8, "threads": 256}, "float32")
    assert fam.check({"vec": 8, "threads": 256}, "float16") is None
    assert fam.launches((1000,), {"vec": 4, "threads": 128}, "float32")[0].grid == (2, 1, 1)
