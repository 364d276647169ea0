"""An input converted for the IREE ABI (``Operand``): torch tensors and numpy arrays checked and
made C-contiguous host arrays (bf16 as its int16 bits), DeviceTensors taken as they are. Only
numpy is needed (torch tensors are recognised by duck typing)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..runtime.device import DeviceTensor

__all__ = ["Operand", "as_operand"]

_NUMPY_DTYPES = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}
_TORCH_DTYPES = {"torch.float16": "f16", "torch.bfloat16": "bf16", "torch.float32": "f32"}


@dataclasses.dataclass
class Operand:
    """An input converted for the IREE ABI: a C-contiguous numpy array (bf16 as int16 bits), or a
    :class:`fmha_iree.runtime.device.DeviceTensor` already on a device."""

    array: np.ndarray
    dtype: str
    is_torch: bool

    @property
    def on_device(self) -> bool:
        return not isinstance(self.array, np.ndarray)


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def as_operand(x, name: str) -> Operand:
    """Convert a torch tensor or numpy array (or take a DeviceTensor as it is); reject anything
    else naming ``name``."""
    if isinstance(x, DeviceTensor):
        return Operand(x, x.dtype, False)
    if _is_torch(x):
        _check_torch_kind(x, name)
        dt = _TORCH_DTYPES.get(str(x.dtype))
        if dt is None:
            raise TypeError(f"{name} has dtype {x.dtype}; supported: float16, bfloat16, float32")
        t = x.detach().cpu().contiguous()
        if dt == "bf16":
            import torch

            t = t.view(torch.int16)
        return Operand(t.numpy(), dt, True)
    if isinstance(x, np.ndarray):
        dt = _NUMPY_DTYPES.get(x.dtype)
        if dt is None:
            raise TypeError(f"{name} has dtype {x.dtype}; numpy inputs support float16 and float32")
        return Operand(np.ascontiguousarray(x), dt, False)
    raise TypeError(f"{name} must be a torch.Tensor, numpy.ndarray or fmha_iree.DeviceTensor, got {type(x).__name__}")


def _check_torch_kind(x, name: str):
    """Refuse torch tensors whose data cannot be read as one dense array (meta, sparse, nested),
    and inputs that expect a gradient: there is no backward pass, so an output would silently have
    none."""
    import torch

    if x.is_meta or x.device.type == "meta":
        raise TypeError(f"{name} is a meta tensor (no data); pass a tensor with storage")
    if getattr(x, "is_nested", False):
        raise TypeError(f"{name} is a nested tensor; pass a dense one (group mode: fmha_fwd_varlen)")
    if x.layout != torch.strided:
        raise TypeError(f"{name} has layout {x.layout}; only dense (torch.strided) tensors are supported")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} requires grad, but fmha_iree has no backward pass: pass {name}.detach() "
                         "or call under torch.no_grad()")
