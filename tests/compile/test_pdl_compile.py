"""Every kernel of a PDL family (``Family.pdl``) waits for the previous grid, because runtime graphs launch
those kernels early (programmatic dependent launch): the PTX of each entry has ``griddepcontrol.wait``
(needs nvcc; runs in CI)."""

import os
import subprocess

import pytest

from kernelmill.kernels.ops import OPS
from kernelmill.kernels.variant import Variant

pytestmark = pytest.mark.nvcc

CASES = [(op.name, fam.name) for op in OPS.values() for fam in op.families.values() if fam.pdl]


def ptx_entries(source: str, arch: str, tmp_path) -> dict[str, str]:
    path = tmp_path / "kernel.cu"
    path.write_text(source)
    nvcc = os.environ.get("KERNELMILL_NVCC", "nvcc")
    ptx = subprocess.run(
        [nvcc, "-ptx", f"-arch={arch.replace('sm_', 'compute_')}", "-o", "-", str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    return {chunk.split("(")[0].strip(): chunk for chunk in ptx.split(".entry ")[1:]}


def test_the_families_the_runtime_chains_most_are_pdl():
    assert {("linear", "wgmma"), ("softmax", "warp_row"), ("layernorm", "row"), ("bias_act", "vec")} <= set(CASES)


@pytest.mark.parametrize(("op", "family"), CASES)
def test_every_kernel_of_a_pdl_family_waits_for_the_previous_grid(tmp_path, op, family):
    fam = OPS[op].family(family)
    dtype = "float16" if "float16" in fam.dtypes else fam.dtypes[0]
    variant = Variant.create(op, family, dtype)
    entries = ptx_entries(variant.source, "sm_90" + fam.arch_suffix, tmp_path)
    launched = {launch.entry for launch in fam.launches(tuple(257 for _ in OPS[op].dims), variant.params, dtype)}
    assert launched <= set(entries)
    for name, body in entries.items():
        assert "griddepcontrol.wait" in body, f"{name} never waits for the previous grid"
        assert "griddepcontrol.launch_dependents" in body, f"{name} never lets the next grid launch"
        wait, launch = body.index("griddepcontrol.wait"), body.index("griddepcontrol.launch_dependents")
        assert wait < launch, f"{name} lets the next grid launch before its own wait (a cascade)"
