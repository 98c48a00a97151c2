"""A small random-config HuggingFace BERT saved to a folder: the reference model of the runtime tests."""

import numpy as np
import torch
import transformers


def small_bert(tmp_path, **overrides):
    fields = dict(
        vocab_size=211,
        hidden_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=160,
        max_position_embeddings=64,
        type_vocab_size=2,
        hidden_act="gelu",
    )
    config = transformers.BertConfig(**{**fields, **overrides})
    torch.manual_seed(0)
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    # Non-trivial LayerNorm and bias values (HF initializes them to 1 / 0).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    return model


def hf_hidden(model, ids: np.ndarray, mask: np.ndarray | None = None, types: np.ndarray | None = None) -> np.ndarray:
    """transformers' last hidden state for NumPy ids (with an attention mask and token types where given)."""
    given = {"attention_mask": mask, "token_type_ids": types}
    kwargs = {name: torch.from_numpy(value) for name, value in given.items() if value is not None}
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids), **kwargs).last_hidden_state.numpy()
