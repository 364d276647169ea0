"""Elementwise attention bias (CK's ``bias`` tensor: T5's relative positions, Swin's, a padding or
prefix bias): a float tensor added to each score after the scale and the soft-cap, before the mask
and the softmax; the LSE includes it.

The caller's bias is broadcastable to ``[B, Hq, Sq, Sk]`` (a dim of size 1 is shared): in batch
mode its dims are ``B`` or 1, ``Hq`` or 1, ``Sq`` or 1 and ``Sk`` or 1; in group mode (and over a
paged cache) it is laid out as a padded batch, ``[B or 1, Hq or 1, Sq' or 1, Sk' or 1]`` with
``Sq'`` / ``Sk'`` at least the longest sequence's query rows / keys, and sequence ``b`` reads
``bias[b, h, i, j]`` at its own row ``i`` and key ``j`` (CK's group mode packs the sequences'
blocks on one diagonal instead; a padded batch is what every mode shares here).

The kernels read it as planes of rows (``KernelBias``): a plane per batch entry (or one shared)
and KV head (or one shared), its rows the positions times the ``G`` query heads of the KV head
(``pos * G + g``: the rows of a tile, ``kernels.tiles``), in the module's dtype. Making that
copies the caller's tensor only where it must (another dtype, a size-1 row or key dim, ``G > 1``,
fewer rows than a tile). Host arrays stay numpy, torch tensors stay torch on their device.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..runtime.device import DeviceTensor
from .abi import BIAS_ROWS, BIAS_ROWS_SHORT
from .operand import as_operand

__all__ = ["KernelBias", "kernel_bias", "checked_bias", "refuse_both"]

_TORCH_DT = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}
_NUMPY_DT = {"f16": np.float16, "f32": np.float32}


@dataclasses.dataclass(frozen=True)
class KernelBias:
    """A bias as the kernels read it: ``array`` ``[P, rows, keys]`` (C-contiguous, the module's
    dtype; numpy, torch, or a DeviceTensor: made from those, or the caller's own, ``_in_place``),
    ``per_entry`` planes per batch entry or sequence (0: one set shared by all), ``head_stride`` 1
    where each KV head has its plane (0: shared), ``positions`` its planes' rows / G."""

    array: object
    per_entry: int
    head_stride: int
    positions: int

    def with_array(self, array) -> "KernelBias":
        return dataclasses.replace(self, array=array)

    def plane_base(self, entries: np.ndarray) -> np.ndarray:
        """The first plane of each sequence (its batch entry ``entries``)."""
        return np.asarray(entries, np.int64) * self.per_entry


def _shape(bias) -> tuple[int, ...]:
    if bias is None or isinstance(bias, (bool, str, bytes, int, float)):
        raise TypeError(f"bias must be a float tensor/array broadcastable to [B, Hq, Sq, Sk], got {type(bias).__name__}")
    if isinstance(bias, DeviceTensor):
        return tuple(bias.shape)
    if hasattr(bias, "detach"):
        if not bias.dtype.is_floating_point:
            raise TypeError(f"bias must hold floats, got {bias.dtype}")
        return tuple(int(s) for s in bias.shape)
    if not isinstance(bias, np.ndarray):
        raise TypeError(f"bias must be a torch.Tensor or numpy.ndarray, got {type(bias).__name__}")
    if bias.dtype.kind != "f":
        raise TypeError(f"bias must hold floats, got {bias.dtype}")
    return bias.shape


def _check_shape(shape, batch: int, hq: int, sq: int, sk: int, padded: bool):
    """``shape`` against the call's (batch entries or sequences, Hq, rows, keys); ``padded``:
    group mode's, rows and keys at least the longest sequence's."""
    want = f"[{batch} or 1, {hq} or 1, {sq}{'+' if padded else ''} or 1, {sk}{'+' if padded else ''} or 1]"
    if len(shape) != 4:
        raise ValueError(f"bias must be 4-D, broadcastable to {want}, got shape {list(shape)}")
    b, h, r, k = shape
    fits = (lambda n, want_n: n == want_n or n == 1 or (padded and n > want_n))
    if b not in (1, batch) or h not in (1, hq) or not fits(r, sq) or not fits(k, sk):
        raise ValueError(f"bias has shape {list(shape)}, not broadcastable to {want} ([B, Hq, Sq, Sk]"
                         + (": group mode's is a padded batch, rows and keys at least the longest sequence's)"
                            if padded else ")"))


def kernel_bias(bias, *, batch: int, hq: int, hk: int, sq: int, sk: int, dtype: str, padded: bool = False
                ) -> KernelBias:
    """The checked ``bias`` laid out for the kernels (module docstring). ``batch``: batch entries
    (group mode: sequences); ``sq`` / ``sk``: the rows and keys it must cover (group mode: the
    longest sequence's, ``padded``); ``dtype``: the module's."""
    shape = _shape(bias)
    _check_shape(shape, batch, hq, sq, sk, padded)
    b, h, r, k = shape
    g = hq // hk
    rows = max(r, sq) if r == 1 else r
    # a tile reads whole planes of its rows: at least a short tile's positions for decode-shaped
    # calls (kernels.tiles.SHORT_ROWS), else a long tile's (at most BIAS_ROWS rows on any target)
    need = -(-(BIAS_ROWS_SHORT if sq * g <= BIAS_ROWS_SHORT else BIAS_ROWS) // g)
    if isinstance(bias, DeviceTensor):  # read as it is
        return _in_place(bias, dtype, g, need, (k == 1 and sk > 1) or (r == 1 and sq > 1))
    torch_like = hasattr(bias, "detach")
    x = _as_dtype(bias, dtype, torch_like)
    x = _expand(x, (b, h, rows, max(k, sk) if k == 1 else k), torch_like)
    per_entry, hs = (h, int(h > 1))
    if g > 1:
        x = _grouped(x, g, hk, torch_like)
        per_entry, hs = (hk, 1) if h > 1 else (1, 0)
    if rows < need:
        x = _pad_rows(x, (need - rows) * g, torch_like)
    x = x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3])
    x = x.contiguous() if torch_like else np.ascontiguousarray(x)
    return KernelBias(x, per_entry if b > 1 else 0, hs, max(rows, need))


def _in_place(bias, dtype: str, g: int, need: int, broadcast: bool) -> KernelBias:
    """A DeviceTensor bias as the kernels' planes, without a copy: it must already be laid out as
    they read it (the module's dtype, one query head per KV head or one plane for all, every row and
    key there, at least a tile's rows), since a device array is not rearranged here."""
    b, h, r, k = bias.shape
    why = [w for w, bad in ((f"dtype {dtype}, not {bias.dtype}", bias.dtype != dtype),
                            ("rows and keys not broadcast (size 1)", broadcast),
                            (f"at least {need} rows (a tile's), not {r}", r < need),
                            ("Hq == Hk (with GQA the planes interleave the group's rows)", g > 1)) if bad]
    if why:
        raise TypeError("bias: a DeviceTensor bias is read as it lies, so it needs " + "; ".join(why)
                        + " (or pass a torch tensor or a host array, laid out for the kernels first)")
    return KernelBias(bias.reshape((b * h, r, k)), h if b > 1 else 0, int(h > 1), r)


def checked_bias(bias, q, **dims) -> KernelBias | None:
    """``kernel_bias(bias, **dims)`` with its planes as the call's ABI array beside the Operand
    ``q`` (``operand.Operand``): a host array (``as_operand``) for host calls, a DeviceTensor on
    q's device for DeviceTensor calls (a torch GPU tensor shared, after torch's current stream; a
    host one uploaded); None for no bias."""
    if bias is None:
        return None
    kb = kernel_bias(bias, dtype=q.dtype, **dims)
    x = kb.array
    if isinstance(x, DeviceTensor):
        if not q.on_device or x.device_uri != q.array.device_uri:
            raise TypeError("bias: a DeviceTensor bias goes with DeviceTensor q, k, v on its device")
        return kb
    if q.on_device and hasattr(x, "detach") and x.device.type != "cpu":
        import torch

        torch.cuda.current_stream(x.device).synchronize()
        return kb.with_array(DeviceTensor.from_dlpack(x, q.array.device_uri))
    host = as_operand(x, "bias").array
    return kb.with_array(DeviceTensor.from_host(host, q.dtype, q.array.device_uri) if q.on_device else host)


def _as_dtype(x, dtype: str, torch_like: bool):
    if torch_like:
        import torch

        return x.detach().to(getattr(torch, _TORCH_DT[dtype]))
    if dtype not in _NUMPY_DT:
        raise TypeError(f"bias: a {dtype} call takes a torch tensor bias (numpy has no {dtype})")
    return x.astype(_NUMPY_DT[dtype], copy=False)


def _expand(x, shape, torch_like: bool):
    if tuple(x.shape) == tuple(shape):
        return x
    return x.expand(*shape) if torch_like else np.broadcast_to(x, shape)


def _grouped(x, g: int, hk: int, torch_like: bool):
    """``[B', H', S, K]`` as ``[B', Hk or 1, S * g, K]``, row ``pos * g + j`` holding query head
    ``hk * g + j`` (a shared head repeated ``g`` times)."""
    b, h, s, k = x.shape
    if h == 1:
        y = x[:, :, :, None, :]
        y = y.expand(b, 1, s, g, k) if torch_like else np.broadcast_to(y, (b, 1, s, g, k))
    else:
        y = x.reshape(b, hk, g, s, k)
        y = y.permute(0, 1, 3, 2, 4) if torch_like else y.transpose(0, 1, 3, 2, 4)
    y = y.contiguous() if torch_like else np.ascontiguousarray(y)
    return y.reshape(b, y.shape[1], s * g, k)


def _pad_rows(x, n: int, torch_like: bool):
    if torch_like:
        import torch

        return torch.nn.functional.pad(x, (0, 0, 0, n))
    return np.pad(x, ((0, 0), (0, 0), (0, n), (0, 0)))


def refuse_both(alibi_slopes, bias):
    """A call gives ALiBi slopes or a bias, as CK's ``bias_enum`` takes one."""
    if alibi_slopes is not None and bias is not None:
        raise ValueError("bias and alibi_slopes: give one of them (as CK's bias_enum; add ALiBi into the bias)")
