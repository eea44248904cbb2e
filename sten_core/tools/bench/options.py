"""Parse the benchmark's command-line values; bad input raises a one-line
``ValueError`` naming the option and the valid choices.

Example:
    >>> parse_sparsities("50,0.9,95")
    [0.5, 0.9, 0.95]
    >>> parse_shape("3072x768")
    (3072, 768)
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _items(text: str, option: str) -> list[str]:
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise ValueError(f"{option}: expected a comma-separated list, got {text!r}")
    return items


def parse_sparsities(text: str) -> list[float]:
    """Percentages (``50``) or fractions (``0.5``), each in [0, 100) %."""
    values = []
    for item in _items(text, "--sparsities"):
        try:
            value = float(item)
        except ValueError:
            raise ValueError(f"--sparsities: {item!r} is not a number; give percentages like 50,75,90 or fractions like 0.5") from None
        fraction = value / 100 if value > 1 else value
        if not 0 <= fraction < 1:
            read = " (a value up to 1 is a fraction: 1 is 100 %; for 1 % give 0.01)" if value == 1 else ""
            raise ValueError(f"--sparsities: {item!r} is out of range{read}; valid sparsities are 0 <= s < 100 (%)")
        fraction = round(fraction, 6)
        if fraction not in values:
            values.append(fraction)
    return sorted(values)


def parse_threads(text: str | None) -> list[int | None]:
    """Thread counts ``1,2,4`` (``None``: torch's current setting)."""
    if text is None:
        return [None]
    values = []
    for item in _items(text, "--threads"):
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"--threads: {item!r} is not a positive integer; give counts like 1,2")
        values.append(int(item))
    return list(dict.fromkeys(values))


def parse_layouts(text: str | None) -> list[str] | None:
    return None if text is None else _items(text, "--layouts")


def parse_device(text: str) -> str:
    """``cpu``, ``cuda`` (``cuda:N``) or ``auto`` (CUDA when there is one)."""
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cpu":
        return "cpu"
    if text == "cuda" or text.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device: {text!r} is not available (torch sees no CUDA device); valid choices here: cpu, auto")
        return text
    raise ValueError(f"--device: unknown device {text!r}; valid choices: auto, cpu, cuda")


def parse_dtype(text: str | None, device: str) -> torch.dtype:
    """``float32``/``float16``/``bfloat16``; default float32 on CPU, float16 on CUDA."""
    if text is None:
        return torch.float16 if device.startswith("cuda") else torch.float32
    if text not in DTYPES:
        raise ValueError(f"--dtype: unknown dtype {text!r}; valid choices: {', '.join(DTYPES)}")
    return DTYPES[text]


def parse_shape(text: str) -> tuple[int, int]:
    """``OUTxIN`` (the weight's shape), e.g. ``3072x768``."""
    parts = str(text).lower().replace("*", "x").split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--shape: expected OUTxIN with positive integers, e.g. 3072x768, got {text!r}")
    return int(parts[0]), int(parts[1])
