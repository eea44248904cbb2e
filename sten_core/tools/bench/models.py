"""The benchmarked models: a BERT-base encoder layer (paper Fig. 2) and a single
linear layer, built from configs with random weights (nothing is downloaded).

Example:
    >>> import torch
    >>> case = linear_case(out_features=8, in_features=16, tokens=4)
    >>> case.model(*case.inputs).shape
    torch.Size([4, 8])
    >>> case.weights
    ['weight']
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Case:
    """A model, its inputs and the names of the weights to sparsify."""

    name: str
    model: torch.nn.Module
    inputs: tuple
    weights: list[str]
    description: str


def linear_weight_names(model: torch.nn.Module) -> list[str]:
    """The ``weight`` of every ``nn.Linear`` in ``model``, in module order."""
    return [f"{path}.weight" if path else "weight" for path, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


BERT_SIZES = {"base": {}, "tiny": {"hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4}}


def bert_case(batch: int = 8, seq_len: int = 128, device: str = "cpu", dtype: torch.dtype = torch.float32,
              seed: int = 0, size: str = "base") -> Case:
    """``BertLayer(BertConfig())`` in eval mode with hidden states ``[batch, seq_len, 768]``
    (``size="tiny"``: hidden 64, for smoke tests)."""
    try:
        from transformers import BertConfig
        from transformers.models.bert.modeling_bert import BertLayer
    except ImportError as error:  # pragma: no cover - transformers is a test/bench dependency
        raise ValueError(f"the BERT benchmark needs transformers ({error}); pip install transformers") from None
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch and seq_len must be >= 1, got {batch} and {seq_len}")
    if size not in BERT_SIZES:
        raise ValueError(f"--size: unknown size {size!r}; valid choices: {', '.join(BERT_SIZES)}")
    torch.manual_seed(seed)
    config = BertConfig(**BERT_SIZES[size])
    config._attn_implementation = "eager"
    model = BertLayer(config).eval().to(device=device, dtype=dtype)
    x = torch.randn(batch, seq_len, config.hidden_size, device=device, dtype=dtype)
    name = "BERT-base" if size == "base" else f"BERT-{size}"
    return Case("bert_layer", model, (x,), linear_weight_names(model),
                f"{name} encoder layer, batch {batch}, sequence {seq_len}")


def linear_case(out_features: int = 3072, in_features: int = 768, tokens: int = 1024, device: str = "cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0) -> Case:
    """``nn.Linear(in_features, out_features)`` applied to ``[tokens, in_features]``."""
    for name, value in (("out_features", out_features), ("in_features", in_features), ("tokens", tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    torch.manual_seed(seed)
    model = torch.nn.Linear(in_features, out_features).eval().to(device=device, dtype=dtype)
    x = torch.randn(tokens, in_features, device=device, dtype=dtype)
    return Case("linear", model, (x,), ["weight"],
                f"Linear {in_features}->{out_features}, {tokens} tokens")
