"""How tensors cross a torch-exported entry point's ABI: bf16 as int16 bit patterns (numpy has no
bfloat16), every other dtype as itself; and the constants the graphs share."""

from __future__ import annotations

import math

import torch

__all__ = ["LOG2E", "LN2", "NEG_INF", "from_abi", "to_abi", "abi_dtype"]

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)
NEG_INF = float("-inf")

_TORCH_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def from_abi(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """An ABI argument as a tensor of ``dtype``."""
    return t.view(torch.bfloat16) if dtype == "bf16" else t


def to_abi(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """A result in ``dtype``, as the ABI returns it."""
    t = t.to(_TORCH_DTYPES[dtype])
    return t.view(torch.int16) if dtype == "bf16" else t


def abi_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of an ABI tensor of ``dtype``."""
    return torch.int16 if dtype == "bf16" else _TORCH_DTYPES[dtype]
