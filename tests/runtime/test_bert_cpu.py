"""The runtime's no-GPU path: a HuggingFace BERT checkpoint and a torch MLP state_dict, loaded with
runtime.load_model(device="cpu"), match PyTorch."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kernelmill import runtime  # noqa: E402
from tests.runtime.bert import hf_hidden, small_bert  # noqa: E402


def rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bert")
    model = small_bert(path)
    return path, model


def test_bert_last_hidden_state_matches_transformers(bert_dir):
    path, ref_model = bert_dir
    assert (path / "model.safetensors").exists()
    model = runtime.load_model(path, device="cpu")
    assert model.device == "cpu" and model.dtype == "float32"
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 211, size=(3, 17))
    mask = np.ones((3, 17), dtype=np.int64)
    mask[1, 11:] = 0  # padding in one sequence
    types = rng.integers(0, 2, size=(3, 17))
    out = model.forward(ids, attention_mask=mask, token_type_ids=types)
    assert isinstance(out, runtime.Tensor) and out.shape == (3, 17, 96) and out.dtype == "float32"
    ref = hf_hidden(ref_model, ids, mask, types)
    assert rel_err(out.numpy(), ref) < 1e-4
    # Padded positions are computed too (HF computes them); compare the unpadded ones exactly as well.
    assert rel_err(out.numpy()[1, :11], ref[1, :11]) < 1e-4


def test_bert_without_mask_and_types(bert_dir):
    path, ref_model = bert_dir
    model = runtime.load_model(path, device="cpu")
    ids = np.random.default_rng(2).integers(0, 211, size=(2, 33))
    out = model(ids)
    with torch.no_grad():
        ref = ref_model(input_ids=torch.from_numpy(ids)).last_hidden_state.numpy()
    assert rel_err(out.numpy(), ref) < 1e-4


def test_bert_report_lists_every_op_on_numpy(bert_dir):
    path, _ = bert_dir
    model = runtime.load_model(path, device="cpu")
    model.forward(np.zeros((1, 5), dtype=np.int64))
    rows = model.kernel_report()
    ops = {r["op"] for r in rows}
    assert ops == {"embedding", "layernorm", "linear", "attention", "add_layernorm", "fused_mlp"}
    assert all(r["source"] == "numpy" for r in rows)
    mlp = next(r for r in rows if r["op"] == "fused_mlp")
    assert mlp["shape"] == "5x96x160x96" and mlp["attrs"] == {"act": "gelu_erf"}
    assert "fused_mlp act=gelu_erf" in model.format_kernel_report()


def test_bert_out_of_range_ids_are_an_error(bert_dir):
    path, _ = bert_dir
    model = runtime.load_model(path, device="cpu")
    with pytest.raises(IndexError, match="out of range"):
        model.forward(np.array([[1, 2, 211]]))


def test_bert_mask_and_types_of_another_shape_are_an_error(bert_dir):
    path, _ = bert_dir
    model = runtime.load_model(path, device="cpu")
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 2\); input_ids has \(2, 3\)"):
        model.forward(ids, np.ones((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="token_type_ids has shape"):
        model.forward(ids, None, np.zeros((6,), dtype=np.int64))
    # One sequence may come without its batch dimension, like input_ids.
    one = model.forward(np.array([1, 2, 3]), np.array([1, 1, 0])).numpy()
    assert np.isfinite(one).all() and one.shape[:2] == (1, 3)


def test_ragged_input_ids_say_to_pad(bert_dir):
    """NumPy's "setting an array element with a sequence ... inhomogeneous shape" before."""
    model = runtime.load_model(bert_dir[0], device="cpu")
    with pytest.raises(ValueError) as err:
        model.forward([[1, 2, 3], [4, 5]])
    assert str(err.value) == (
        "the input's rows have different lengths (2, 3): pad them to one length (a BERT model's padding masked "
        "out with attention_mask)"
    )
    with pytest.raises(ValueError, match=r"^the input's rows have different lengths \(1, 2\)"):
        runtime.Tensor.from_numpy([[1.0, 2.0], [3.0]])


@pytest.mark.parametrize("act", ["gelu_new", "gelu_fast", "gelu_python", "gelu_accurate", "linear"])
def test_bert_with_transformers_activation_names(tmp_path, act):
    """gelu_fast, gelu_python, gelu_accurate and linear were refused as unknown activations."""
    ref_model = small_bert(tmp_path, hidden_act=act)
    model = runtime.load_model(tmp_path, device="cpu")
    ids = np.random.default_rng(3).integers(0, 211, size=(2, 9))
    with torch.no_grad():
        ref = ref_model(input_ids=torch.from_numpy(ids)).last_hidden_state.numpy()
    assert rel_err(model.forward(ids).numpy(), ref) < 1e-4


def _mlp_blocks(d, hidden, layers, act):
    act_layer = {"relu": torch.nn.ReLU, "gelu": torch.nn.GELU}[act]
    torch.manual_seed(4)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(d, hidden), act_layer(), torch.nn.Linear(hidden, d)) for _ in range(layers)
    ]
    return torch.nn.Sequential(*blocks).eval()


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_mlp_state_dict_blocks_match_torch(tmp_path, act):
    ref = _mlp_blocks(24, 56, 3, act)
    path = tmp_path / "mlp.pt"
    torch.save(ref.state_dict(), path)
    model = runtime.load_model(path, device="cpu", act=act)
    assert [type(layer).__name__ for layer in model.module.layers] == ["MLP", "MLP", "MLP"]
    x = np.random.default_rng(5).standard_normal((7, 24)).astype(np.float32)
    with torch.no_grad():
        want = ref(torch.from_numpy(x)).numpy()
    assert rel_err(model.forward(x).numpy(), want) < 1e-5
    assert {r["op"] for r in model.kernel_report()} == {"fused_mlp"}


def test_an_mlp_saved_in_bfloat16_loads_and_takes_bfloat16_inputs(tmp_path):
    ref = _mlp_blocks(24, 56, 2, "relu").to(torch.bfloat16)
    path = tmp_path / "bf16.pt"
    torch.save(ref.state_dict(), path)
    model = runtime.load_model(path, device="cpu", act="relu")
    x = torch.from_numpy(np.random.default_rng(8).standard_normal((5, 24)).astype(np.float32)).to(torch.bfloat16)
    with torch.no_grad():  # the same bf16 weights and input, in float32 on both sides
        want = ref.float()(x.float()).numpy()
    assert rel_err(model.forward(x).numpy(), want) < 1e-5


def test_mlp_flat_sequential_and_act_in_the_file(tmp_path):
    torch.manual_seed(6)
    ref = torch.nn.Sequential(
        torch.nn.Linear(10, 20), torch.nn.GELU(), torch.nn.Linear(20, 30), torch.nn.GELU(), torch.nn.Linear(30, 5)
    ).eval()
    path = tmp_path / "flat.pt"
    torch.save({"state_dict": ref.state_dict(), "act": "gelu"}, path)
    model = runtime.load_model(path, device="cpu")
    # A training checkpoint: the model's state_dict next to the optimizer's (refused before).
    trained = tmp_path / "trained.pt"
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.1).state_dict()
    torch.save({"model_state_dict": ref.state_dict(), "optimizer_state_dict": optimizer, "epoch": 3}, trained)
    assert [layer.act for layer in runtime.load_model(trained, device="cpu", act="gelu").module.layers] == [
        "gelu_erf",
        "gelu_erf",
        "none",
    ]
    assert [layer.act for layer in model.module.layers] == ["gelu_erf", "gelu_erf", "none"]
    x = np.random.default_rng(7).standard_normal((4, 10)).astype(np.float32)
    with torch.no_grad():
        want = ref(torch.from_numpy(x)).numpy()
    assert rel_err(model(x).numpy(), want) < 1e-5


#: A one-layer BERT's config.json, for checkpoints that are refused before any weight is used.
_ONE_LAYER_CONFIG = {"model_type": "bert", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 1,
                     "num_attention_heads": 2}  # fmt: skip


def test_mlp_without_an_activation_says_it_assumes_relu(tmp_path, caplog):
    ref = _mlp_blocks(8, 16, 1, "relu")
    path = tmp_path / "mlp.pt"
    torch.save(ref.state_dict(), path)
    with caplog.at_level("WARNING", logger="kernelmill.runtime.models"):
        model = runtime.load_model(path, device="cpu")
    assert model.module.layers[0].act == "relu"
    assert any("names no activation" in r.getMessage() and "relu" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="kernelmill.runtime.models"):
        runtime.load_model(path, device="cpu", act="relu")
    assert not caplog.records
    torch.save(torch.nn.Linear(8, 4).state_dict(), path)  # one Linear: no activation runs, none to name
    with caplog.at_level("WARNING", logger="kernelmill.runtime.models"):
        runtime.load_model(path, device="cpu")
    assert not caplog.records


def test_files_that_are_not_models_are_one_line_errors(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a checkpoint\n")
    with pytest.raises(ValueError, match="not a PyTorch file") as err:
        runtime.load_model(text, device="cpu")
    assert "\n" not in str(err.value) and "Unsupported operand" in str(err.value)
    # torch's own message opened on weights_only=False, in terminal escapes, and left out the cause
    whole = tmp_path / "whole.pt"
    torch.save(torch.nn.Sequential(torch.nn.Linear(2, 2)), whole)
    with pytest.raises(ValueError) as err:
        runtime.load_model(whole, device="cpu")
    assert str(err.value) == (
        f"{whole} holds a pickled module (Sequential), not a state_dict: save module.state_dict(); expected an MLP "
        "state_dict (torch.save(module.state_dict(), path)) or a HuggingFace directory"
    )
    pickled_list = tmp_path / "list.pt"
    torch.save([torch.zeros(2)], pickled_list)
    with pytest.raises(ValueError, match="holds a list, not a state_dict"):
        runtime.load_model(pickled_list, device="cpu")
    with pytest.raises(ValueError, match="no config.json"):
        runtime.load_model(tmp_path, device="cpu")
    with pytest.raises(FileNotFoundError, match="missing.pt: no such model"):
        runtime.load_model(tmp_path / "missing.pt", device="cpu")
    int_keys = tmp_path / "int_keys.pt"
    torch.save({0: torch.ones(2, 2)}, int_keys)  # a KeyError: '0'
    with pytest.raises(ValueError, match="^the state_dict has keys that are not names: 0;"):
        runtime.load_model(int_keys, device="cpu", act="relu")
    # A HF directory whose pytorch_model.bin is not a state_dict of tensors: AttributeErrors before.
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(_ONE_LAYER_CONFIG))
    for content, message in (
        ([torch.zeros(2)], "pytorch_model.bin holds a list, not a state_dict of tensors"),
        ({"state_dict": {"step": 3}}, "pytorch_model.bin holds entries that are not named tensors: 'step' \\(not a"),
    ):
        torch.save(content, hf / "pytorch_model.bin")
        with pytest.raises(ValueError, match=message):
            runtime.load_model(hf, device="cpu")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{not json", r"config.json is not valid JSON \(Expecting property name"),
        (b"\xff\xfe{}", "config.json is not valid JSON"),
        ("[1, 2]", "config.json holds a JSON list, not an object"),
        (
            '{"model_type": "bert", "num_hidden_layers": 2}',
            "config.json: num_attention_heads is missing \\(the tensors cannot say how many heads\\)",
        ),
        (
            '{"model_type": "bert", "num_hidden_layers": "2", "num_attention_heads": 2}',
            "num_hidden_layers must be a positive whole number",
        ),
        (
            '{"model_type": "bert", "num_hidden_layers": 1, "num_attention_heads": 2, "layer_norm_eps": "abc"}',
            "config.json: layer_norm_eps must be a small positive number, got 'abc'",
        ),
    ],
)
def test_a_broken_config_json_is_a_one_line_error_naming_the_file(tmp_path, config, message):
    (tmp_path / "config.json").write_bytes(config if isinstance(config, bytes) else config.encode())
    with pytest.raises(ValueError, match=message) as err:
        runtime.load_model(tmp_path, device="cpu")
    assert "\n" not in str(err.value)


def test_a_checkpoint_missing_a_weight_is_a_one_line_error_naming_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_ONE_LAYER_CONFIG))
    torch.save({"bert.embeddings.word_embeddings.weight": torch.zeros(50, 32)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="checkpoint has no bert.embeddings.position_embeddings.weight"):
        runtime.load_model(tmp_path, device="cpu")


def test_mlp_state_dicts_whose_layers_do_not_fit_are_refused_at_load(tmp_path):
    """A bias of the wrong length or layers whose widths do not chain: a one-line error at load naming the
    keys, not a broadcast error (CPU) or a kernel reading past a bias (GPU) at the first forward."""
    path = tmp_path / "mlp.pt"
    torch.save({"0.weight": torch.zeros(16, 8), "0.bias": torch.zeros(15)}, path)
    with pytest.raises(ValueError, match=r"0.bias has shape \(15,\) for 0.weight \(16, 8\)"):
        runtime.load_model(path, device="cpu", act="relu")
    sd = {"0.weight": torch.zeros(16, 8), "0.bias": torch.zeros(16), "2.weight": torch.zeros(8, 12)}
    torch.save(sd, path)
    with pytest.raises(ValueError, match="2.weight takes 12 inputs but 0.weight gives 16: the layers do not chain"):
        runtime.load_model(path, device="cpu", act="relu")
    blocks = {f"{i}.{j}.weight": torch.zeros(*s) for i in range(2) for j, s in ((0, (16, 8)), (2, (8, 16)))}
    blocks["1.2.weight"] = torch.zeros(4, 16)  # the second block's output (4) does not feed a third: fine
    torch.save(blocks, path)
    assert runtime.load_model(path, device="cpu", act="relu").forward(np.zeros((1, 8), np.float32)).shape == (1, 4)
    blocks["1.0.weight"] = torch.zeros(16, 5)
    torch.save(blocks, path)
    with pytest.raises(ValueError, match="1.0.weight takes 5 inputs but 0.2.weight gives 8"):
        runtime.load_model(path, device="cpu", act="relu")


def test_random_bert_runs_on_cpu():
    config = {"vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    config.update({"intermediate_size": 64, "max_position_embeddings": 16})
    model = runtime.Model(runtime.BertModel.random(config), device="cpu")
    out = model.forward(np.arange(10).reshape(2, 5))
    assert out.shape == (2, 5, 32) and np.isfinite(out.numpy()).all()
    for bucketed in (model, runtime.Model(runtime.BertModel.random(config), device="cpu", buckets=[8, 16])):
        with pytest.raises(ValueError, match=r"input_ids has no tokens \(shape \(2, 0\)\)"):
            bucketed.forward(np.zeros((2, 0), np.int64))


def test_a_cuda_model_without_a_gpu_says_the_cpu_runs_it(bert_dir, monkeypatch):
    from kernelmill.kernels.device import GpuUnavailable
    from kernelmill.runtime import backend

    def no_gpu(ordinal=0):
        raise GpuUnavailable("no CUDA device is visible")

    monkeypatch.setattr(backend, "get_backend", no_gpu)
    with pytest.raises(GpuUnavailable, match="no CUDA device is visible; device='cpu' runs the model on NumPy"):
        runtime.load_model(bert_dir[0], device="cuda")


def test_buckets_pad_the_sequence_and_leave_every_real_token_as_it_was(bert_dir):
    path, ref_model = bert_dir
    exact = runtime.load_model(path, device="cpu")
    bucketed = runtime.load_model(path, device="cpu", buckets=[32, 16, 48])
    assert bucketed.buckets == (16, 32, 48)
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 211, size=(3, 21))
    mask = np.ones((3, 21), dtype=np.int64)
    mask[2, 15:] = 0
    types = rng.integers(0, 2, size=(3, 21))
    for args in ((ids,), (ids, mask), (ids, mask, types), (ids[:1],)):  # batch 1: the output is a view
        want = exact.forward(*args).numpy()
        got = bucketed.forward(*args)
        assert got.shape == want.shape and got.numpy().flags.c_contiguous
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        ref = ref_model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state
    assert rel_err(bucketed.forward(ids, mask).numpy(), ref.numpy()) < 1e-4
    assert {p[1] for p in bucketed.problems if p[0] == "attention"} == {(3, 4, 32, 24), (1, 4, 32, 24)}
    # A sequence with no real token: its keys score -inf, so attention gives it 0, padded or not, as transformers'
    # default (sdpa) attention gives (its eager attention's lowest-value mask attended to every key evenly).
    mask[0] = 0
    got, want = bucketed.forward(ids, mask).numpy(), exact.forward(ids, mask).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        ref = ref_model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state
    assert ref_model.config._attn_implementation == "sdpa"
    assert rel_err(got, ref.numpy()) < 1e-4
    # A sequence that fills its bucket gets a mask as well: the same tensors (and graph) as a padded one.
    full, restore = bucketed.prepare(np.tile(ids[:, :16], 2))
    padded, _ = bucketed.prepare(ids[:, :30])

    def shapes(tensors):
        return [None if t is None else t.shape for t in tensors]

    assert restore is None and shapes(full) == shapes(padded) == [(3, 32), None, (3, 32)]
    assert full[2] is not None and not full[2].numpy().any()  # nothing masked
    # Past the largest bucket, or a bucket past the position embeddings (64): the exact sequence.
    for model, seq in ((bucketed, 50), (runtime.load_model(path, device="cpu", buckets=[100]), 21)):
        ids = rng.integers(0, 211, size=(2, seq))
        np.testing.assert_allclose(model.forward(ids).numpy(), exact.forward(ids).numpy(), rtol=1e-6)
        assert (2, 4, seq, 24) in {p[1] for p in model.problems if p[0] == "attention"}


def test_buckets_pad_an_mlps_rows(tmp_path):
    stack = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.GELU(), torch.nn.Linear(40, 8))
    torch.save(stack.state_dict(), tmp_path / "mlp.pt")
    model = runtime.load_model(tmp_path / "mlp.pt", device="cpu", act="gelu", buckets=(4, 8))
    for shape in ((3, 16), (2, 3, 16), (8, 16), (9, 16), (2, 2, 16)):
        x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
        out = model.forward(x)
        with torch.no_grad():
            ref = stack(torch.from_numpy(x)).numpy()
        assert out.shape == ref.shape
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-5)
    assert sorted({p[1][0] for p in model.problems}) == [4, 8, 9]  # 3 -> 4, 6 -> 8, 8, 9 (past the largest), 4
    assert model.prepare(np.ones((2, 2, 16)))[0][0].shape == model.prepare(np.ones((3, 16)))[0][0].shape == (4, 16)
    problems = runtime.tune.model_problems(model, np.ones((5, 16), np.float32))
    assert {p[1][0] for p in problems} == {8}  # tuning asks for the shapes that run


def test_buckets_need_a_module_that_pads_and_positive_sizes(bert_dir):
    from kernelmill.runtime.nn import MultiHeadAttention

    path, _ = bert_dir
    attn = MultiHeadAttention.from_torch(*(np.ones((8, 8)), np.ones(8)) * 4, heads=2)
    with pytest.raises(ValueError, match="MultiHeadAttention has no dimension to pad"):
        runtime.Model(attn, device="cpu", buckets=[8])
    for bad in ([0, 8], [], ["x"], 8, "32", [7.9], [True]):  # "32" was buckets 2 and 3, 7.9 was 7
        with pytest.raises(ValueError, match="buckets must be positive integers"):
            runtime.load_model(path, device="cpu", buckets=bad)
    assert runtime.load_model(path, device="cpu", buckets=(b for b in (16, 8))).buckets == (8, 16)  # was refused
    # A wrong type of ids names the ids given, not the padded ones ("got float64 (1, 8)" for a (1, 3) input).
    with pytest.raises(ValueError, match=r"input_ids must be integers of shape \(batch, seq\), got float64 \(1, 3\)"):
        runtime.load_model(path, device="cpu", buckets=[8]).forward(np.ones((1, 3)))


def test_resize_inputs_makes_an_example_request_a_buckets_size(bert_dir):
    from kernelmill.runtime.nn import MultiHeadAttention

    path, _ = bert_dir
    bert = runtime.load_model(path, device="cpu", buckets=[4, 32, 100])
    ids, mask = np.arange(10).reshape(2, 5), np.ones((2, 5), np.int64)
    (short,), extra = bert.module.resize_inputs(4, ids, attention_mask=mask)
    assert short.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8]] and extra["attention_mask"].shape == (2, 4)
    (long,), extra = bert.module.resize_inputs(12, ids[0], token_type_ids=np.zeros(5, np.int64))
    assert long.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]] and list(extra) == ["token_type_ids"]
    assert bert.module.resize_inputs(100, ids) is None  # past the 64 position embeddings: not padded
    with pytest.raises(ValueError, match="attention_mask"):
        bert.module.resize_inputs(8, ids, attention_mask=np.ones((2, 4)))
    with pytest.raises(ValueError, match="capture_buckets needs buckets"):
        runtime.load_model(path, device="cpu").capture_buckets(ids)
    with pytest.raises(ValueError, match="3 buckets but max_graphs=2"):
        runtime.load_model(path, device="cpu", buckets=[4, 8, 16], max_graphs=2).capture_buckets(ids)
    assert bert.capture_buckets(ids) == []  # nothing to capture on the CPU

    from kernelmill.runtime.nn import Linear, Sequential

    mlp = runtime.Model(Sequential(Linear.random(3, 2)), device="cpu", buckets=[4])
    (rows,), _ = mlp.module.resize_inputs(5, np.arange(12.0).reshape(2, 2, 3))
    assert rows.shape == (5, 3) and rows[4].tolist() == [0, 1, 2]  # rows repeated
    with pytest.raises(ValueError, match="has no dimension to pad"):
        MultiHeadAttention.from_torch(*(np.ones((8, 8)), np.ones(8)) * 4, heads=2).resize_inputs(4, np.ones((4, 8)))


def test_a_bucketed_model_names_the_input_as_given_not_as_padded():
    """The error read "fused_mlp: input (8, 15)" for a (3, 15) input: the padded shape, never given."""
    from kernelmill.runtime.nn import MLP, Activation, LayerNorm, Sequential

    body = [Activation("relu"), MLP.random(16, 48, 16, "gelu_tanh"), LayerNorm(np.ones(16), np.zeros(16))]
    for module in (Sequential(*body), body[1], body[2]):
        model = runtime.Model(module, device="cpu", buckets=[8, 64])
        for shape in ((3, 15), (2, 3, 15)):
            with pytest.raises(ValueError, match=rf"^input \({shape[0]}, .*15\): its last dim must be 16, the "):
                model(np.zeros(shape, np.float32))
        assert model(np.ones((3, 16), np.float32)).shape == (3, 16)


def test_modules_are_built_from_torch_parameters_and_bfloat16_tensors():
    """np.asarray refused a Parameter that requires grad, and torch's bfloat16."""
    from kernelmill.runtime.nn import LayerNorm, Linear, Sequential

    lin, ln = torch.nn.Linear(8, 4), torch.nn.LayerNorm(4)
    model = runtime.Model(
        Sequential(Linear.from_torch(lin.weight, lin.bias), LayerNorm(ln.weight, ln.bias, ln.eps)), "cpu"
    )
    x = np.random.default_rng(3).standard_normal((5, 8)).astype(np.float32)
    with torch.no_grad():
        assert rel_err(model.forward(x).numpy(), ln(lin(torch.from_numpy(x))).numpy()) < 1e-6
    half = Linear.from_torch(lin.weight.detach().bfloat16(), lin.bias.detach().bfloat16())
    assert half.weight.dtype == "float32" and half.weight.shape == (8, 4)


def test_an_mlp_takes_integer_inputs_as_values():
    """As float64 always was; an int64 input failed in the first op ("expected tensors of one float dtype")."""
    from kernelmill.runtime.nn import MLP, Sequential

    model = runtime.Model(Sequential(MLP.random(4, 8, 4, "relu")), device="cpu")
    ints = np.arange(8).reshape(2, 4)
    assert np.array_equal(model.forward(ints).numpy(), model.forward(ints.astype(np.float32)).numpy())


# -- MLP state_dicts: the layers' order and what a state_dict may hold ----------------------------------------


def _load_mlp(tmp_path, state, act="relu"):
    path = tmp_path / "mlp.pt"
    torch.save(state, path)
    return runtime.load_model(path, device="cpu", act=act)


def _matches_torch(model, ref, d_in) -> float:
    x = np.random.default_rng(9).standard_normal((5, d_in)).astype(np.float32)
    with torch.no_grad():
        want = ref(torch.from_numpy(x)).numpy()
    return rel_err(model.forward(x).numpy(), want)


class _UpDown(torch.nn.Module):
    """Names whose sorted order (down, up) is not the order they run in."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(24, 24), torch.nn.Linear(24, 24)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class _BodyHead(torch.nn.Module):
    """A Sequential body and a head: key names mixed (body.0, body.2, head)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 48))
        self.head = torch.nn.Linear(48, 8)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class _ListHead(torch.nn.Module):
    """layers.0 .. layers.10 and a head: sorting by key path put head first (or layers.10 before layers.2)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(24, 24) for _ in range(11))
        self.head = torch.nn.Linear(24, 8)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


@pytest.mark.parametrize("module", [_UpDown, _BodyHead, _ListHead])
def test_mlp_layers_run_in_the_state_dicts_order(tmp_path, module):
    torch.manual_seed(10)
    ref = module().eval()
    model = _load_mlp(tmp_path, ref.state_dict())
    assert _matches_torch(model, ref, 24) < 1e-5  # up-down, body-head: 1.35 and 1.08 relative error before


def test_mlp_with_numbered_and_named_keys_and_lone_linears_among_blocks(tmp_path):
    torch.manual_seed(11)
    ref = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
    state = ref.state_dict()
    mixed = {"0.weight": state["0.weight"], "0.bias": state["0.bias"], "head.weight": state["2.weight"]}
    mixed["head.bias"] = state["2.bias"]
    assert _matches_torch(_load_mlp(tmp_path, mixed), ref, 24) < 1e-5  # was a TypeError from the sort
    # Sequential(block, block, Linear): no activation between the blocks or before the last Linear.
    block = [torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 24)]
    blocks = torch.nn.Sequential(torch.nn.Sequential(*block), _mlp_blocks(24, 40, 1, "gelu")[0], torch.nn.Linear(24, 8))
    model = _load_mlp(tmp_path, blocks.state_dict(), act="gelu")
    assert [type(layer).__name__ for layer in model.module.layers] == ["MLP", "MLP", "Linear"]
    assert _matches_torch(model, blocks.eval(), 24) < 1e-5


def _seq(*layers):
    return torch.nn.Sequential(*layers).eval()


@pytest.mark.parametrize(
    ("ref", "kinds"),
    [
        # Sequential indices in a row: nothing between the Linears (an activation was added: 0.61 and 0.68 error)
        (lambda: _seq(_seq(torch.nn.Linear(24, 40), torch.nn.Linear(40, 24))), ["Linear", "Linear"]),
        (
            lambda: _seq(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 48), torch.nn.Linear(48, 8)),
            ["MLP", "Linear"],
        ),
        # a module without parameters between two blocks: the activation
        (
            lambda: _seq(
                _seq(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 24)),
                torch.nn.ReLU(),
                _seq(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8)),
            ),
            ["Linear", "Linear", "Linear", "Linear"],
        ),
    ],
)
def test_mlp_sequential_indices_say_where_no_activation_runs(tmp_path, ref, kinds):
    torch.manual_seed(12)
    ref = ref()
    model = _load_mlp(tmp_path, ref.state_dict())
    assert [type(layer).__name__ for layer in model.module.layers] == kinds
    assert _matches_torch(model, ref, 24) < 1e-5


class _ListLoop(torch.nn.Module):
    """A ModuleList of Linears run in a loop with GELU between them: the keys of a Sequential of Linears alone."""

    def __init__(self, head: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(24, 24) for _ in range(3))
        self.head = torch.nn.Linear(24, 8) if head else None

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = torch.nn.functional.gelu(x) if i < 2 or self.head is not None else x
        return x if self.head is None else self.head(x)


@pytest.mark.parametrize("head", [False, True])
def test_mlp_linears_at_indices_all_in_a_row_take_what_act_says(tmp_path, head, caplog):
    """layers.0, layers.1, layers.2: a Sequential of Linears alone, or a ModuleList run with an activation between
    them? The keys cannot say. Before, the ModuleList ran with no activation (0.23 error) unless a head sat after
    it, which flipped the reading (and a Sequential of Linears and a head ran with activations between them)."""
    torch.manual_seed(13)
    loop = _ListLoop(head).eval()
    path = tmp_path / "mlp.pt"
    torch.save(loop.state_dict(), path)
    with caplog.at_level("WARNING", logger="kernelmill.runtime.models"), pytest.raises(ValueError) as err:
        runtime.load_model(path, device="cpu")  # no act said
    assert not caplog.records  # no "the MLP uses relu" ahead of the refusal to guess
    message = str(err.value)
    assert message.startswith("layers.0.weight, layers.1.weight, layers.2.weight are Linears at indices in a row")
    assert "give act='none' (--act none) for the first, or the loop's activation (act='relu', --act relu" in message
    assert _matches_torch(runtime.load_model(path, device="cpu", act="gelu"), loop, 24) < 1e-5
    plain = _seq(torch.nn.Linear(24, 40), torch.nn.Linear(40, 24))  # nothing between them
    torch.save(plain.state_dict(), path)
    with pytest.raises(ValueError, match=r"^0.weight, 1.weight are Linears at indices in a row"):
        runtime.load_model(path, device="cpu")
    model = runtime.load_model(path, device="cpu", act="none")
    assert [type(layer).__name__ for layer in model.module.layers] == ["Linear", "Linear"]
    assert _matches_torch(model, plain, 24) < 1e-5


def test_mlp_layers_that_do_not_chain_in_the_state_dicts_order_name_the_keys(tmp_path):
    state = {"b.weight": torch.zeros(16, 8), "a.weight": torch.zeros(4, 16)}
    assert _load_mlp(tmp_path, state).forward(np.zeros((1, 8), np.float32)).shape == (1, 4)
    with pytest.raises(
        ValueError, match="b.weight takes 8 inputs but a.weight gives 4: the layers do not chain"
    ) as err:
        _load_mlp(tmp_path, dict(reversed(state.items())))
    assert "they run in the state_dict's order: a.weight, b.weight" in str(err.value)


@pytest.mark.parametrize(
    ("layers", "named"),
    [
        (
            lambda: [torch.nn.Linear(24, 48), torch.nn.ReLU(), torch.nn.LayerNorm(48), torch.nn.Linear(48, 8)],
            "2.weight (shape (48,)), 2.bias (shape (48,))",
        ),
        (
            lambda: [torch.nn.Linear(24, 48), torch.nn.BatchNorm1d(48), torch.nn.ReLU(), torch.nn.Linear(48, 8)],
            "1.weight (shape (48,)), 1.bias (shape (48,)), 1.running_mean (shape (48,)), 1.running_var (shape "
            "(48,)), 1.num_batches_tracked (shape () of int64)",
        ),
    ],
)
def test_mlp_state_dicts_with_other_layers_are_refused_naming_their_keys(tmp_path, layers, named):
    """A LayerNorm or BatchNorm between the Linears was dropped without a word (a LayerNorm: 0.68 relative
    error against torch)."""
    state = torch.nn.Sequential(*layers()).state_dict()
    with pytest.raises(ValueError) as err:
        _load_mlp(tmp_path, state)
    message = str(err.value)
    assert message.startswith(f"the state_dict has entries an MLP cannot run: {named}; an MLP state_dict holds ")
    assert "in the order they run" in message and "act=" in message and "'act' entry next to 'state_dict'" in message
    assert "LayerNorm, BatchNorm" in message and "\n" not in message


def test_mlp_state_dicts_with_stray_entries_are_refused(tmp_path):
    state = _mlp_blocks(8, 16, 1, "relu").state_dict()
    with pytest.raises(ValueError, match=r"entries an MLP cannot run: scale \(shape \(16,\)\);"):
        _load_mlp(tmp_path, {**state, "scale": torch.ones(16)})
    stray = r"entries an MLP cannot run: epoch \(not a tensor: int\), 0.2.gamma \(shape \(8,\)\);"
    with pytest.raises(ValueError, match=stray):
        _load_mlp(tmp_path, {**state, "epoch": 3, "0.2.gamma": torch.ones(8)})
    # A training checkpoint's {"model": ..., "optimizer": ...} holds the state_dict under "model" (was refused).
    ref = _mlp_blocks(8, 16, 1, "relu")
    assert _matches_torch(_load_mlp(tmp_path, {"model": state, "optimizer": {}}), ref, 8) < 1e-6
    with pytest.raises(ValueError, match=r"entries an MLP cannot run: weights \(a dict\), optimizer \(a dict\);"):
        _load_mlp(tmp_path, {"weights": state, "optimizer": {}})
    # A bare Linear's state_dict ("weight", "bias") is one Linear layer.
    linear = torch.nn.Linear(8, 3)
    assert _matches_torch(_load_mlp(tmp_path, linear.state_dict()), linear, 8) < 1e-6


@pytest.mark.parametrize(
    ("weight", "named"),
    [
        (torch.ones(16, 8, dtype=torch.int64), "0.0.weight (shape (16, 8) of int64)"),
        (torch.ones(16, 8, dtype=torch.int8), "0.0.weight (shape (16, 8) of int8)"),
        (torch.ones(16, 8, dtype=torch.bool), "0.0.weight (shape (16, 8) of bool)"),
        (torch.ones(16, 8, dtype=torch.complex64), "0.0.weight (shape (16, 8) of complex64)"),
        (torch.ones(16, 8, device="meta"), "0.0.weight (shape (16, 8) on the meta device, without values)"),
    ],
)
def test_mlp_weights_that_are_not_floating_point_numbers_are_refused_naming_their_dtype(tmp_path, weight, named):
    """Integer, boolean and complex weights were cast to float32 and ran (a complex one without its imaginary
    part); a meta tensor's (a model built on torch's meta device) raised NotImplementedError from torch."""
    state = _mlp_blocks(8, 16, 1, "relu").state_dict()
    with pytest.raises(ValueError) as err:
        _load_mlp(tmp_path, {**state, "0.0.weight": weight})
    # Its bias goes with it: a Linear's that has no weight.
    assert str(err.value).startswith(f"the state_dict has entries an MLP cannot run: {named}, 0.0.bias (shape (16,));")
    assert "floating point" in str(err.value)


def test_bert_weights_that_are_not_floating_point_numbers_are_refused_by_name(bert_dir, tmp_path):
    """An int8 weight (a quantized checkpoint's) was cast to float32 and ran as if it were the weight."""
    from safetensors.numpy import load_file, save_file

    path, _ = bert_dir
    key = "encoder.layer.0.attention.self.query.weight"
    tensors = load_file(str(path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes((path / "config.json").read_bytes())
    save_file({**tensors, key: tensors[key].astype(np.int8)}, str(tmp_path / "model.safetensors"))
    why = f"checkpoint tensor {key} holds int8 values; the model needs floating-point weights"
    with pytest.raises(ValueError, match=why):
        runtime.load_model(tmp_path, device="cpu")
    # The same in pytorch_model.bin, where an integer buffer the model leaves unused (position_ids) still loads.
    (tmp_path / "model.safetensors").unlink()
    state = {k: torch.from_numpy(v) for k, v in tensors.items()}
    state["embeddings.position_ids"] = torch.arange(64)[None]
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert runtime.load_model(tmp_path, device="cpu").dtype == "float32"
    torch.save({**state, key: state[key].to(torch.int32)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=why.replace("int8", "int32")):
        runtime.load_model(tmp_path, device="cpu")


def test_an_embedding_table_is_not_read_as_a_bias_free_linear(tmp_path):
    """A square nn.Embedding ahead of a Linear chained, and loaded as a matrix product of its inputs."""
    for rows in (16, 100):
        table, fc = torch.nn.Embedding(rows, 16), torch.nn.Linear(16, 8)
        for name in ("embed", "tok_embeddings", "wte"):
            state = {f"{name}.weight": table.weight, "fc.weight": fc.weight, "fc.bias": fc.bias}
            with pytest.raises(
                ValueError, match=rf"^{name}.weight looks like an embedding table \(module '{name}', no"
            ):
                _load_mlp(tmp_path, state)
    # A bias-free Linear under another name still loads, and runs as torch's.
    bias_free = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    assert _matches_torch(_load_mlp(tmp_path, bias_free.state_dict()), bias_free, 16) < 1e-5


# -- BERT checkpoints: what is refused at load, and why ---------------------------------------------------------


def _variant(bert_dir, tmp_path, tensors=None, **config):
    """A copy of the reference checkpoint with config.json's fields changed (None deletes one) and, where
    ``tensors`` is given, the safetensors made of tensors(state_dict)."""
    from safetensors.numpy import load_file, save_file

    src, _ = bert_dir
    path = tmp_path / "variant"
    path.mkdir(parents=True)
    fields = {**json.loads((src / "config.json").read_text()), **config}
    (path / "config.json").write_text(json.dumps({k: v for k, v in fields.items() if v is not None}))
    sd = load_file(str(src / "model.safetensors"))
    save_file(sd if tensors is None else tensors(sd), str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"is_decoder": True},
            "is_decoder is true: a BERT decoder masks attention causally, which the runtime does not "
            "(BERT encoders only)",
        ),
        ({"add_cross_attention": True}, "add_cross_attention is true: cross-attention layers are not supported"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key' is not supported"),
        ({"hidden_act": "quick_gelu"}, "hidden_act: unknown activation 'quick_gelu'"),
    ],
)
def test_bert_configs_the_runtime_would_run_differently_from_hf_are_refused(bert_dir, tmp_path, config, message):
    path = _variant(bert_dir, tmp_path, **config)
    with pytest.raises(ValueError) as err:
        runtime.load_model(path, device="cpu")
    assert str(err.value).startswith(f"{path / 'config.json'}: {message}")


def test_bert_with_fewer_layers_in_the_config_than_the_checkpoint_is_refused(bert_dir, tmp_path):
    """num_hidden_layers 1 on a 2-layer checkpoint ran the first layer only, silently."""
    path = _variant(bert_dir, tmp_path, num_hidden_layers=1)
    with pytest.raises(ValueError) as err:
        runtime.load_model(path, device="cpu")
    assert str(err.value).startswith(
        "checkpoint tensors the model does not use (it has 2 encoder layers; num_hidden_layers is 1): "
        "encoder.layer.1.attention.output.LayerNorm.bias, "
    )
    assert str(err.value).endswith(" and 12 more")  # 16 tensors a layer
    stray = _variant(
        bert_dir, tmp_path / "b", lambda sd: {**sd, "encoder.layer.0.extra.weight": np.ones(3, np.float32)}
    )
    with pytest.raises(ValueError, match=r"^checkpoint tensors the model does not use: encoder.layer.0.extra.weight$"):
        runtime.load_model(stray, device="cpu")


def test_bert_layer_counts_and_prefixes_read_from_the_tensors(bert_dir, tmp_path):
    src, ref_model = bert_dir
    ids = np.random.default_rng(14).integers(0, 211, size=(2, 7))
    with torch.no_grad():
        want = ref_model(input_ids=torch.from_numpy(ids)).last_hidden_state.numpy()
    # No num_hidden_layers: counted from the tensors (transformers' default, 12, would fail on them).
    counted = runtime.load_model(_variant(bert_dir, tmp_path / "a", num_hidden_layers=None), device="cpu")
    assert len(counted.module.layers) == 2 and rel_err(counted.forward(ids).numpy(), want) < 1e-4
    # Any one prefix (a model holding its BERT as "encoder"), not only "bert.".
    nested = _variant(bert_dir, tmp_path / "b", lambda sd: {f"encoder.{k}": v for k, v in sd.items()})
    assert rel_err(runtime.load_model(nested, device="cpu").forward(ids).numpy(), want) < 1e-4
    refusals = (
        (
            _variant(bert_dir, tmp_path / "c", num_hidden_layers=3),
            "checkpoint has no encoder layer 2: it holds 2 (num_hidden_layers is 3 in config.json)",
        ),
        (
            _variant(bert_dir, tmp_path / "d", lambda sd: {**sd, **{f"doc.{k}": v for k, v in sd.items()}}),
            "checkpoint holds 2 BERT models ('', 'doc.' prefixes): save the one to load on its own",
        ),
        (
            _variant(bert_dir, tmp_path / "e", lambda sd: {"x.weight": np.ones((2, 2), np.float32)}),
            "checkpoint has no embeddings.word_embeddings.weight, under any prefix: not a BERT checkpoint",
        ),
    )
    for path, message in refusals:
        assert _refusal(path) == message


def test_bert_ignores_what_hf_ignores_buffers_pooler_and_task_heads(bert_dir, tmp_path):
    path, ref_model = bert_dir
    hidden = 96

    def with_extras(sd):
        extras = {
            "embeddings.position_ids": np.arange(64, dtype=np.int64)[None],
            "pooler.dense.weight": np.zeros((hidden, hidden), np.float32),
            "pooler.dense.bias": np.zeros(hidden, np.float32),
        }
        heads = {"cls.predictions.bias": np.zeros(211, np.float32), "cls.seq_relationship.weight": np.zeros((2, 96))}
        return {**{f"bert.{k}": v for k, v in {**sd, **extras}.items()}, **heads}

    model = runtime.load_model(_variant(bert_dir, tmp_path, with_extras), device="cpu")
    ids = np.random.default_rng(12).integers(0, 211, size=(2, 7))
    with torch.no_grad():
        ref = ref_model(input_ids=torch.from_numpy(ids)).last_hidden_state.numpy()
    assert rel_err(model.forward(ids).numpy(), ref) < 1e-4


def test_an_mlm_checkpoint_loads_as_its_encoder(tmp_path):
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48
    )
    torch.manual_seed(13)
    mlm = transformers.BertForMaskedLM(config).eval()
    mlm.save_pretrained(tmp_path)
    ids = np.random.default_rng(13).integers(0, 50, size=(2, 6))
    with torch.no_grad():
        ref = mlm.bert(input_ids=torch.from_numpy(ids)).last_hidden_state.numpy()
    assert rel_err(runtime.load_model(tmp_path, device="cpu").forward(ids).numpy(), ref) < 1e-4


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"hidden_size": 128},
            "checkpoint tensor embeddings.word_embeddings.weight has shape (211, 96); the model needs (211, 128) "
            "(vocab_size=211 in config.json, hidden_size=128 in config.json)",
        ),
        (
            {"vocab_size": 50},
            "checkpoint tensor embeddings.word_embeddings.weight has shape (211, 96); the model needs (50, 96) "
            "(vocab_size=50 in config.json, hidden_size=96 in config.json)",
        ),
        (
            {"intermediate_size": 200},
            "checkpoint tensor encoder.layer.0.intermediate.dense.weight has shape (160, 96); the model needs "
            "(200, 96) (intermediate_size=200 in config.json, hidden_size=96 in config.json)",
        ),
        (
            {"intermediate_size": None, "hidden_size": None, "num_attention_heads": 5},
            "hidden_size 96 (from embeddings.word_embeddings.weight) is not a multiple of num_attention_heads 5",
        ),
    ],
)
def test_bert_config_sizes_that_disagree_with_the_tensors_are_refused_at_load(bert_dir, tmp_path, config, message):
    """They failed at the first forward, with an op's message (or, for vocab_size, not at all)."""
    with pytest.raises(ValueError) as err:
        runtime.load_model(_variant(bert_dir, tmp_path, **config), device="cpu")
    assert str(err.value) == message


def test_a_tensor_of_another_shape_than_its_layer_is_refused_naming_it(bert_dir, tmp_path):
    key = "encoder.layer.1.output.LayerNorm.weight"
    path = _variant(bert_dir, tmp_path, lambda sd: {**sd, key: sd[key][:32]})
    with pytest.raises(ValueError) as err:
        runtime.load_model(path, device="cpu")
    assert (
        str(err.value)
        == f"checkpoint tensor {key} has shape (32,); the model needs (96,) (hidden_size=96 in config.json)"
    )


def test_sharded_checkpoints_load_from_their_index(bert_dir, tmp_path):
    """save_pretrained shards a model over max_shard_size (5 GB by default): such a directory was refused as
    having 'neither model.safetensors nor pytorch_model.bin'."""
    src, ref_model = bert_dir
    ids = np.random.default_rng(13).integers(0, 211, size=(2, 12))
    with torch.no_grad():
        want = ref_model(input_ids=torch.from_numpy(ids)).last_hidden_state.numpy()
    sharded = tmp_path / "sharded"
    ref_model.save_pretrained(sharded, max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (sharded / "model.safetensors").exists()
    assert rel_err(runtime.load_model(sharded, device="cpu").forward(ids).numpy(), want) < 1e-4

    # The .bin form: its index and shards as transformers names them, written with torch.save.
    bins = tmp_path / "bins"
    bins.mkdir()
    (bins / "config.json").write_text((src / "config.json").read_text())
    state = ref_model.state_dict()
    names = list(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for shard, keys in halves.items():
        torch.save({k: state[k] for k in keys}, bins / shard)
    weight_map = {k: shard for shard, keys in halves.items() for k in keys}
    (bins / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert rel_err(runtime.load_model(bins, device="cpu").forward(ids).numpy(), want) < 1e-4
    # a shard file passed alone
    assert "is a file of the HuggingFace checkpoint directory" in _refusal(bins / "pytorch_model-00001-of-00002.bin")

    (bins / "pytorch_model-00002-of-00002.bin").unlink()
    assert _refusal(bins) == (
        f"{bins / 'pytorch_model.bin.index.json'} names the shard pytorch_model-00002-of-00002.bin, which {bins} "
        "does not hold"
    )
    (bins / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"x": "../elsewhere.bin"}}))
    assert "names '../elsewhere.bin' as a shard: expected a file name in" in _refusal(bins)
    (bins / "pytorch_model.bin.index.json").unlink()
    assert _refusal(bins) == (
        f"{bins} holds no weights: none of model.safetensors, model.safetensors.index.json, pytorch_model.bin, "
        "pytorch_model.bin.index.json"
    )


def _refusal(path) -> str:
    """load_model's ValueError for ``path``, as text."""
    with pytest.raises(ValueError) as err:
        runtime.load_model(path, device="cpu")
    return str(err.value)


def test_load_errors_say_what_is_wrong_first(bert_dir, tmp_path):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_head": 4}))
    with pytest.raises(ValueError) as err:  # was: num_attention_heads must be a positive whole number
        runtime.load_model(gpt2, device="cpu")
    assert str(err.value) == f"{gpt2 / 'config.json'}: model_type 'gpt2' is not supported (BERT only)"
    src, _ = bert_dir
    for name in ("model.safetensors", "config.json"):
        with pytest.raises(ValueError) as err:
            runtime.load_model(src / name, device="cpu")
        assert str(err.value) == (
            f"{src / name} is a file of the HuggingFace checkpoint directory {src}: pass the directory instead"
        )
    for content in (b"", b"garbage" * 10):
        path = _variant(bert_dir, tmp_path / f"st{len(content)}")
        (path / "model.safetensors").write_bytes(content)
        with pytest.raises(ValueError, match="is not a readable safetensors file") as err:
            runtime.load_model(path, device="cpu")
        message = str(err.value)
        assert message.startswith(f"{path / 'model.safetensors'} is not a readable safetensors file (")
        assert "\n" not in message


def test_a_config_without_model_type_is_bert_only_where_its_architectures_say_so(bert_dir, tmp_path):
    """A config.json without model_type was read as BERT's whatever it was: a RoBERTa's (BERT's tensor names,
    positions from padding_idx + 1) loaded and ran silently, its output all wrong."""
    src, ref_model = bert_dir
    ids = np.random.default_rng(15).integers(0, 211, size=(2, 7))
    with torch.no_grad():
        want = ref_model(input_ids=torch.from_numpy(ids)).last_hidden_state.numpy()
    for architectures in (["BertModel"], ["BertForMaskedLM", "BertForPreTraining"]):
        path = _variant(bert_dir, tmp_path / architectures[0], model_type=None, architectures=architectures)
        assert rel_err(runtime.load_model(path, device="cpu").forward(ids).numpy(), want) < 1e-4
    roberta = tmp_path / "roberta"
    config = transformers.RobertaConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48
    )
    transformers.RobertaModel(config, add_pooling_layer=False).save_pretrained(roberta)
    assert _refusal(roberta) == f"{roberta / 'config.json'}: model_type 'roberta' is not supported (BERT only)"
    fields = json.loads((roberta / "config.json").read_text())
    del fields["model_type"]
    for architectures, named in (
        (["RobertaModel"], 'architectures ["RobertaModel"], not BERT classes alone'),
        (["BertModel", "RobertaModel"], 'architectures ["BertModel", "RobertaModel"], not BERT classes alone'),
        (["BertGenerationEncoder"], 'architectures ["BertGenerationEncoder"], not BERT classes alone'),
        (None, "no architectures"),
        ([], "no architectures"),
    ):
        (roberta / "config.json").write_text(json.dumps({**fields, "architectures": architectures}))
        assert _refusal(roberta) == (
            f"{roberta / 'config.json'} has no model_type and {named}: the model is not known to be a BERT "
            '(BERT only; add "model_type": "bert" if it is one)'
        )


def test_act_is_refused_for_a_bert_directory(bert_dir):
    with pytest.raises(ValueError) as err:
        runtime.load_model(bert_dir[0], device="cpu", act="relu")
    assert str(err.value) == (
        f"act='relu' is for an MLP state_dict file; a BERT checkpoint's activation is hidden_act in "
        f"{bert_dir[0] / 'config.json'}"
    )


# -- BERT inputs, devices, layer_norm_eps --------------------------------------------------------------------------


def test_attention_mask_values_other_than_one_keep_their_token_as_hf_does(bert_dir):
    import warnings

    path, ref_model = bert_dir
    model = runtime.load_model(path, device="cpu")
    ids = np.random.default_rng(14).integers(0, 211, size=(2, 9))
    mask = np.array([[1, 1, 2, 0, 0, 0, 0, 0, 0], [1, 3, 1, 1, 1, 1, 1, 1, 0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a 2 overflowed the softmax (RuntimeWarning) and the row was wrong
        out = model.forward(ids, mask).numpy()
    with torch.no_grad():
        ref = ref_model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state
        ones = ref_model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(np.minimum(mask, 1)))
    assert rel_err(ref.numpy(), ones.last_hidden_state.numpy()) == 0  # HF: any nonzero keeps the token
    assert rel_err(out, ref.numpy()) < 1e-4


def test_token_type_ids_must_be_whole_numbers_in_range(bert_dir):
    path, ref_model = bert_dir
    model = runtime.load_model(path, device="cpu")
    ids = np.array([[5, 6, 7]])
    with pytest.raises(ValueError) as err:  # was truncated to 1 without a word
        model.forward(ids, None, np.array([[0.0, 1.6, 1.0]]))
    assert str(err.value) == "token_type_ids must be whole numbers 0..1, got 1.6"
    for bad in (np.array([[0, 2, 1]]), np.array([[0, -1, 1]])):
        with pytest.raises(IndexError) as err:
            model.forward(ids, None, bad)
        assert str(err.value) == "token_type_ids out of range 0..1 (type_vocab_size 2)"
    with pytest.raises(ValueError, match="token_type_ids must be integers 0..1, got dtype <U1"):
        model.forward(ids, None, np.array([["0", "1", "1"]]))
    with torch.no_grad():
        ref = ref_model(input_ids=torch.from_numpy(ids), token_type_ids=torch.tensor([[0, 1, 1]])).last_hidden_state
    assert rel_err(model.forward(ids, None, np.array([[0.0, 1.0, 1.0]])).numpy(), ref.numpy()) < 1e-4


def test_devices_and_dtypes_are_checked_before_the_checkpoint_is_read(bert_dir, monkeypatch):
    from kernelmill.runtime import models
    from kernelmill.runtime.tensor import Tensor

    def not_read(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the device and dtype were checked")

    monkeypatch.setattr(models, "load_module", not_read)
    cases = [
        ({"device": "cudax"}, "unknown device 'cudax'; use 'cpu' or 'cuda'"),
        ({"device": "cuda:1"}, "only cuda:0 is supported by the runtime for now, got 'cuda:1'"),
        ({"device": "gpu"}, "unknown device 'gpu'; use 'cpu' or 'cuda'"),
        ({"device": "cpu", "dtype": "fp16"}, "unknown dtype 'fp16'; use one of float32, float16, bfloat16"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as err:
            runtime.load_model(bert_dir[0], **kwargs)
        assert str(err.value) == message
    with pytest.raises(ValueError) as err:  # the same words as Tensor's
        Tensor.from_numpy(np.zeros(2, np.float32), "cuda:1")
    assert str(err.value) == "only cuda:0 is supported by the runtime for now, got 'cuda:1'"
    with pytest.raises(ValueError, match="unknown device 'cudax'"):
        runtime.Model(runtime.nn.Linear.random(4, 4), device="cudax")
    assert runtime.Model(runtime.nn.Linear.random(4, 4), device=torch.device("cpu")).device == "cpu"


def test_a_layer_norm_eps_no_gpu_kernel_takes_runs_on_the_cpu_and_is_refused_for_the_gpu(tmp_path):
    """layer_norm_eps 2e-05 made format_kernel_report() raise SpecError on the CPU; on the GPU the first
    layernorm would have failed to find a kernel."""
    ref_model = small_bert(tmp_path, layer_norm_eps=2e-5)
    model = runtime.load_model(tmp_path, device="cpu")
    ids = np.random.default_rng(15).integers(0, 211, size=(2, 5))
    with torch.no_grad():
        ref = ref_model(input_ids=torch.from_numpy(ids)).last_hidden_state.numpy()
    assert rel_err(model.forward(ids).numpy(), ref) < 1e-4
    rows = [r for r in model.kernel_report() if r["op"] == "layernorm"]
    assert rows == [{**rows[0], "attrs": {"eps": 2e-5}, "source": "numpy"}]
    assert "layernorm eps=2e-05" in model.format_kernel_report()
    with pytest.raises(ValueError) as err:  # before it looks for a GPU
        runtime.load_model(tmp_path, device="cuda")
    assert str(err.value) == (
        "config.json's layer_norm_eps is 2e-05, which the GPU's layernorm kernels do not take (they take 1e-12, "
        "1e-05, 1e-06, 1e-07, 1e-08); device='cpu' runs any eps"
    )


def test_a_layer_norm_eps_written_from_a_float32_is_the_kernels_eps():
    """1e-12 through a float32 (9.99999996e-13) was refused for the GPU as "1e-12, which the kernels do not take
    (they take 1e-12, ...)"."""
    from kernelmill.runtime.models import _check_gpu_eps

    for eps in (1e-12, 1e-5):
        rounded = float(np.float32(eps))
        assert rounded != eps and runtime.nn.LayerNorm(np.ones(4), np.zeros(4), rounded).eps == eps
    _check_gpu_eps(runtime.nn.LayerNorm(np.ones(4), np.zeros(4), float(np.float32(1e-12))))  # no error
    assert runtime.nn.LayerNorm(np.ones(4), np.zeros(4), 1.0001e-12).eps == 1.0001e-12  # not a rounding: kept


@pytest.mark.parametrize("act, said", [(None, "null"), (3, "3"), (["gelu"], '["gelu"]')])
def test_a_hidden_act_that_is_not_a_name_is_refused(tmp_path, act, said):
    """null ran the model with no activation at all (HF refuses such a config)."""
    small_bert(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": act}))
    with pytest.raises(ValueError) as err:
        runtime.load_model(tmp_path, device="cpu")
    assert str(err.value) == f"{tmp_path / 'config.json'}: hidden_act must name an activation, got {said}"


def test_an_mlp_in_a_safetensors_file_is_refused_since_its_keys_lose_the_layer_order(tmp_path):
    """safetensors sorts its keys as text (0, 10, 2, ...): an MLP read from it ran its layers out of order."""
    from safetensors.torch import save_file

    layers = [m for _ in range(6) for m in (torch.nn.Linear(16, 16), torch.nn.ReLU())][:-1]
    path = tmp_path / "deep.safetensors"
    save_file(torch.nn.Sequential(*layers).state_dict(), str(path))
    with pytest.raises(ValueError, match="keeps its keys sorted as text"):
        runtime.load_model(path, device="cpu", act="relu")


class _ListBlocksHead(torch.nn.Module):
    """A ModuleList of Sequential(Linear, GELU, Linear) blocks and a head: blocks.0.0 .. blocks.1.2, head."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_mlp_blocks(24, 40, 2, "gelu"))
        self.head = torch.nn.Linear(24, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _NamedBlocks(torch.nn.Module):
    """layers.<i>.fc1 / fc2: a ModuleList of blocks with named Linears."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict({"fc1": torch.nn.Linear(24, 40), "fc2": torch.nn.Linear(40, 24)}) for _ in range(2)
        )


@pytest.mark.parametrize(
    ("state", "named"),
    [
        (  # Sequential(Sequential(Linear, ReLU), Sequential(Linear)): loaded with no activation at all before
            lambda: torch.nn.Sequential(
                torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU()),
                torch.nn.Sequential(torch.nn.Linear(40, 8)),
            ).state_dict(),
            "block 0 holds one Linear (0.0.weight): whether an activation follows it cannot be read",
        ),
        (  # blocks and a head: loaded with an activation between the blocks, which run without one
            lambda: _ListBlocksHead().state_dict(),
            "the Linear layers sit in several modules (blocks.0, blocks.1): whether an activation runs between",
        ),
        (lambda: _NamedBlocks().state_dict(), "several modules (layers.0, layers.1)"),
    ],
)
def test_mlp_layouts_whose_activations_a_state_dict_cannot_place_are_refused(tmp_path, state, named):
    with pytest.raises(ValueError) as err:
        _load_mlp(tmp_path, state(), act="gelu")
    message = str(err.value)
    assert named in message and "nn.Sequential(Linear, act, Linear) blocks" in message and "\n" not in message


@pytest.mark.parametrize(
    "lengths",
    [
        [1],  # a sequence of one token
        [1, 1, 1],
        [13, 1, 5, 12],  # a batch of different lengths, padded to the longest
        [7, 0],  # a sequence with no real token: 0 from attention, as transformers' sdpa attention gives
        [64, 30],  # the position table's full length
    ],
)
def test_bert_padded_batches_match_transformers(bert_dir, lengths):
    path, ref_model = bert_dir
    model = runtime.load_model(path, device="cpu")
    rng = np.random.default_rng(len(lengths))
    seq = max(max(lengths), 1)
    ids = rng.integers(0, 211, size=(len(lengths), seq))
    mask = (np.arange(seq)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    types = rng.integers(0, 2, size=ids.shape)
    out = model.forward(ids, attention_mask=mask, token_type_ids=types).numpy()
    ref = hf_hidden(ref_model, ids, mask, types)
    assert np.isfinite(out).all()
    for row, length in enumerate(lengths):  # each sequence on its own: a short one is not drowned by the rest
        if length:
            assert rel_err(out[row, :length], ref[row, :length]) < 1e-5
        assert rel_err(out[row], ref[row]) < 1e-5  # padded positions too, as transformers computes them
