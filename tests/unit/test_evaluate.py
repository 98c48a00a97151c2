"""A variant's evaluation where it ends before a GPU is needed (kernels/evaluate.py, LocalEvaluator's batch)."""

from types import SimpleNamespace

import pytest

from kernelmill.agents.evaluator import LocalEvaluator
from kernelmill.agents.space import Candidate
from kernelmill.kernels.evaluate import COMPILE_ERROR, evaluate
from kernelmill.kernels.ops import get_op
from kernelmill.kernels.variant import Variant

#: Renders for vec 4, not for vec 8: a plugin template's bug in one branch (StrictUndefined).
BROKEN = "{% if vec == 8 %}{{ not_a_knob }}{% endif %}__global__ void softmax_block_row() {}\n"


@pytest.fixture
def broken(tmp_path, monkeypatch):
    """softmax's block_row family with a template that cannot render at vec=8, added to softmax as "broken"."""
    (tmp_path / "broken.cu.j2").write_text(BROKEN)
    spec = get_op("softmax")
    block_row = spec.family("block_row")
    family = type("Broken", (type(block_row),), {"name": "broken", "template": "broken.cu.j2"})()
    family.template_root = tmp_path
    monkeypatch.setitem(spec.families, "broken", family)
    return family


class NoCompiler:
    def compile(self, source, arch):
        raise AssertionError("nvcc was asked to compile what did not render")

    def compile_many(self, sources, arch):
        raise AssertionError("nvcc was asked to compile what did not render")


def test_a_variant_whose_template_does_not_render_is_a_compile_error_not_a_raise(broken):
    """The RenderError went through evaluate(): one point a template could not render failed the job."""
    spec = get_op("softmax")
    variant = Variant(spec, broken, broken.resolve({"vec": 8}, "float16"), "float16", spec.resolve_attrs({}))
    result = evaluate(variant, (256, 256), None, NoCompiler(), arch="sm_90")
    assert result.status == COMPILE_ERROR and "'not_a_knob' is undefined" in result.reason


def test_a_batch_holding_a_variant_that_does_not_render_records_it_as_data(broken):
    """LocalEvaluator renders the whole batch to compile it in parallel first: the RenderError ended the batch."""
    evaluator = object.__new__(LocalEvaluator)  # its batch logic only: a device that is never launched on
    evaluator.device = SimpleNamespace(poisoned=False, info=SimpleNamespace(arch="sm_90"))
    evaluator.compiler, evaluator.flusher, evaluator.references = NoCompiler(), None, None
    evaluator.seeds, evaluator.reps, evaluator.timeout_s, evaluator._problem_seeds = 1, 1, 1.0, {}
    params = broken.resolve({"vec": 8}, "float16")
    [result] = evaluator.evaluate("softmax", (256, 256), "float16", {}, [Candidate.of("broken", params)])
    assert result.status == COMPILE_ERROR and "'not_a_knob' is undefined" in result.reason


def test_a_compiled_trial_records_the_digest_of_the_code_its_cubin_was_built_from():
    """What a served kernel's cubin was built from is checked against what the version that publishes it renders
    (service.jobs.StoreRecorder.publish_best): the trial has to say it."""
    from kernelmill.agents.evaluator import _result
    from kernelmill.kernels.render import code_digest

    spec = get_op("softmax")
    family = spec.family("warp_row")
    variant = Variant(spec, family, family.resolve({}, "float16"), "float16", spec.resolve_attrs({}))
    compiled = SimpleNamespace(arch="sm_90", key="k", report=lambda: {"kernels": {}})
    ev = SimpleNamespace(status="ok", reason=None, poisoned=False, compiled=compiled, verification=None, timing=None)
    result = _result(Candidate.of("warp_row", variant.params), ev, variant)
    assert result.code_sha256 == code_digest(variant.source) and result.row()["code_sha256"] == result.code_sha256
    unbuilt = _result(Candidate.of("warp_row", variant.params), SimpleNamespace(**{**vars(ev), "compiled": None}), None)
    assert unbuilt.code_sha256 is None
    # The knobs comment is not code: a parameter added since (named there) leaves the digest as it was.
    body = variant.source.partition("\n")[2]
    assert code_digest("// kernelmill variant: other knobs\n" + body) == code_digest(variant.source)
    assert code_digest(variant.source) != code_digest(variant.source + "// changed\n")


def test_a_fault_that_poisons_the_context_skips_the_rest_of_the_batch_and_refuses_the_next(monkeypatch):
    """Nothing launches in a poisoned context: the candidates after the fault come back skipped (proposed again
    on a fresh worker), and the next batch is the machine's failure (GpuUnavailable), not its candidates'."""
    import kernelmill.kernels.evaluate as ev
    from kernelmill.agents.evaluator import SKIPPED
    from kernelmill.kernels.device import GpuUnavailable

    evaluator = object.__new__(LocalEvaluator)
    evaluator.device = SimpleNamespace(poisoned=False, info=SimpleNamespace(arch="sm_90"))
    evaluator.compiler = SimpleNamespace(compile_many=lambda sources, arch: None)
    evaluator.flusher, evaluator.references = None, None
    evaluator.seeds, evaluator.reps, evaluator.timeout_s, evaluator._problem_seeds = 1, 1, 1.0, {}
    ran = []

    def faults_first(variant, shape, device, compiler, **kwargs):
        ran.append(variant.params)
        device.poisoned = True  # as Device._raise marks it
        return ev.Evaluation(variant, shape, ev.FAULT, "an illegal memory access was encountered", poisoned=True)

    monkeypatch.setattr(ev, "evaluate", faults_first)
    family = get_op("softmax").family("warp_row")
    batch = [Candidate.of("warp_row", family.resolve({"vec": vec}, "float32")) for vec in (1, 2, 4)]
    results = evaluator.evaluate("softmax", (4, 10), "float32", {}, batch)
    assert [r.status for r in results] == [ev.FAULT, SKIPPED, SKIPPED] and len(ran) == 1
    assert results[0].poisoned and results[1].reason == "context poisoned earlier in the batch"
    with pytest.raises(GpuUnavailable, match="left this process's CUDA context unusable"):
        evaluator.evaluate("softmax", (4, 10), "float32", {}, batch)
    assert len(ran) == 1
