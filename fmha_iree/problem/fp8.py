"""fp8 K / V (an fp8 KV cache): K and V in ``float8_e4m3fn`` (OCP's E4M3: NVIDIA, gfx950) or
``float8_e4m3fnuz`` (gfx942's), with descale factors per tensor or per KV head, Q and the output
in f16 / bf16 (or f32).

The value of a key is ``k_descale[h] * fp8(k)``: K and V are dequantized to Q's dtype (each
element rounded once, from the exact fp8 value times its head's factor) before the paths see the
call, so every path of every mode takes an fp8 cache with no kernel of its own. The cost is one
pass over the keys the call reads, which a decode pays in full (docs/variants.md): a kernel reading
fp8 where it lies is the next step (docs/tried.md, "Score variants").

A paged cache is dequantized only in the pages its block table uses for the call's keys (the
others are never read); the block table is renumbered onto them.

Host arrays (numpy arrays of ml_dtypes' fp8 types, torch tensors on any device) are dequantized
where they lie, with numpy or torch; DeviceTensors hold no fp8 type and are not taken.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from .operand import _NUMPY_DTYPES, _TORCH_DTYPES

__all__ = ["FP8_FORMATS", "fp8_format", "fp8_values", "Fp8Kv", "check_fp8_kv", "dequantized_kv"]

# format -> (exponent bias, "fnuz": no negative zero, 0x80 is the NaN, no infinities)
FP8_FORMATS = {"float8_e4m3fn": (7, False), "float8_e4m3fnuz": (8, True)}


def fp8_format(x) -> str | None:
    """The fp8 format of ``x``'s dtype (a torch tensor or a numpy array), or None."""
    name = str(getattr(x, "dtype", "")).removeprefix("torch.")
    return name if name in FP8_FORMATS else None


@functools.lru_cache(maxsize=None)
def fp8_values(fmt: str) -> np.ndarray:
    """float32 ``[256]``: the value of each byte in format ``fmt`` (sign, 4 exponent bits, 3
    mantissa bits; subnormals at exponent 0)."""
    bias, fnuz = FP8_FORMATS[fmt]
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    mag = np.where(e == 0, m / 8 * 2.0 ** (1 - bias), (1 + m / 8) * 2.0 ** (e - bias))
    val = np.where(b >= 128, -mag, mag)
    nan = (b == 0x80) if fnuz else ((b & 0x7F) == 0x7F)
    out = np.where(nan, np.nan, val).astype(np.float32)
    out.flags.writeable = False  # shared between calls
    return out


def _descale(d, hk: int | None, name: str):
    """``d`` as a positive finite float, float32 ``[hk]`` numpy or a float torch tensor ``[hk]``
    (kept on its device; its values are not read here, so a traced call stays traceable)."""
    if d is None:
        return 1.0
    if isinstance(d, (bool, str, bytes)):
        raise TypeError(f"{name} must be a float or a float tensor/array of shape [Hk], got {type(d).__name__}")
    if hasattr(d, "detach"):
        if not d.dtype.is_floating_point:
            raise TypeError(f"{name} must hold floats, got {d.dtype}")
        _descale_shape(list(d.shape), hk, name)
        return d.detach().float().reshape(-1)
    if isinstance(d, (int, float)):  # plain Python: a traced call (torch.compile) reads no numpy
        if not math.isfinite(d) or d <= 0:
            raise ValueError(f"{name} must be finite and positive")
        return float(d)
    try:
        arr = np.asarray(d)
    except Exception as e:  # noqa: BLE001 (anything numpy cannot read is the caller's type error)
        raise TypeError(f"{name} must be a float or a float tensor/array of shape [Hk], got {type(d).__name__}") from e
    if arr.dtype.kind != "f":
        raise TypeError(f"{name} must hold floats, got {arr.dtype}")
    _descale_shape(list(arr.shape), hk, name)
    if not np.all(np.isfinite(arr)) or not np.all(arr > 0):
        raise ValueError(f"{name} must be finite and positive")
    return float(arr.reshape(())) if arr.size == 1 and arr.ndim == 0 else arr.astype(np.float32).reshape(-1)


def _descale_shape(shape: list, hk: int | None, name: str):
    if len(shape) > 1 or (len(shape) == 1 and hk is not None and shape[0] not in (1, hk)):
        raise ValueError(f"{name} must be a scalar or have shape [{hk if hk is not None else 'Hk'}] (one per KV head), "
                         f"got {shape}")


class Fp8Kv:
    """An fp8 K / V pair checked against Q: its format, descales and the KV heads' axis."""

    def __init__(self, q, k, v, k_descale, v_descale, head_axis: int):
        fk, fv = fp8_format(k), fp8_format(v)
        if fk != fv:
            raise TypeError(f"k and v must both be fp8 of one format (or neither), got k {getattr(k, 'dtype', None)}, "
                            f"v {getattr(v, 'dtype', None)}")
        if fp8_format(q) is not None:
            raise TypeError(f"q has dtype {q.dtype}: fp8 queries are not taken (Q and the output stay f16 / bf16 / f32; "
                            "fp8 K / V only)")
        torch_k = hasattr(k, "detach")
        if not all(hasattr(x, "detach") if torch_k else isinstance(x, np.ndarray) for x in (q, v)):
            raise TypeError("q, k and v must all be torch tensors or all numpy arrays when k and v are fp8 "
                            f"(got q {type(q).__name__}, k {type(k).__name__}, v {type(v).__name__})")
        if (str(q.dtype) not in _TORCH_DTYPES) if torch_k else (q.dtype not in _NUMPY_DTYPES):
            raise TypeError(f"q has dtype {q.dtype}; with fp8 K / V it must be float16, bfloat16 (torch) or float32")
        self.fmt, self.head_axis, self.torch = fk, head_axis, torch_k
        hk = k.shape[head_axis] if len(k.shape) > head_axis else None
        self.k_descale = _descale(k_descale, hk, "k_descale")
        self.v_descale = _descale(v_descale, hk, "v_descale")
        self.dtype = q.dtype

    def dequantize(self, x, descale):
        """``x`` (fp8) as Q's dtype, times its head's factor, rounded once."""
        if self.torch:
            return self._torch_dequantize(x, descale)
        y = fp8_values(self.fmt)[np.asarray(x).view(np.uint8)]
        if not isinstance(descale, float):
            y = y * descale.reshape(self._per_head(y.ndim))
        elif descale != 1.0:
            y = y * np.float32(descale)
        return y.astype(self.dtype)

    def _torch_dequantize(self, x, descale):
        """Eager: fp8 -> Q's dtype (exact), then the descale in place, computed in float32: two
        passes (3 + 4 bytes an element; float32 copies took three, 19). Traced (an exported model):
        through float32 (IREE's llvm-cpu has no fp8 -> f16 conversion; its elementwise ops fuse).
        The same values either way."""
        traced = _tracing()
        y = x.float() if traced else x.to(self.dtype)
        if not isinstance(descale, float):
            d = descale.to(y.device).view(self._per_head(y.dim()))
            y = y * d if traced else y.mul_(d)
        elif descale != 1.0:
            y = y * descale if traced else y.mul_(descale)
        return y.to(self.dtype) if traced else y

    def _per_head(self, ndim: int) -> list[int]:
        """The shape a per-head descale broadcasts as over an ``ndim``-dim K / V."""
        shape = [1] * ndim
        shape[self.head_axis] = -1
        return shape

    def kv(self, k, v, block_table=None, seqlen_k=None):
        """(k, v, block_table) dequantized; a paged cache (``block_table`` given) only in the pages
        the call's keys use, its table renumbered onto them."""
        if block_table is not None and seqlen_k is not None and len(k.shape) == 4 and not _tracing():
            got = used_pages(block_table, seqlen_k, k.shape[1], k.shape[0])
            if got is not None and got[0].size < k.shape[0]:  # every page used: no copy of the cache
                pages, table = got
                if self.torch or hasattr(block_table, "detach"):
                    import torch
                if hasattr(block_table, "detach"):  # the table in the caller's type
                    table = torch.from_numpy(table).to(block_table.device)
                block_table = table
                if self.torch:
                    at = torch.from_numpy(pages).to(k.device)
                    k, v = k[at], v[at]
                else:
                    k, v = np.asarray(k)[pages], np.asarray(v)[pages]
        return self.dequantize(k, self.k_descale), self.dequantize(v, self.v_descale), block_table


def check_fp8_kv(q, k, v, k_descale, v_descale, *, layout: str = "bhsd", group: bool = False,
                 paged: bool = False) -> Fp8Kv | None:
    """The fp8 K / V of a call, or None where K and V are not fp8 (then descales are refused):
    batch mode in ``layout``, group mode (``[T, Hk, D]``) or a paged cache (``[pages, rows, Hk, D]``)."""
    head_axis = 2 if paged or (not group and layout == "bshd") else 1
    if fp8_format(k) is None and fp8_format(v) is None:
        if k_descale is not None or v_descale is not None:
            raise ValueError("k_descale / v_descale are for fp8 K / V (float8_e4m3fn, float8_e4m3fnuz); "
                             f"k has dtype {getattr(k, 'dtype', type(k).__name__)}")
        return None
    return Fp8Kv(q, k, v, k_descale, v_descale, head_axis)


def _tracing() -> bool:
    """Whether torch is tracing the call (``torch.compile`` / ``torch.export``): the block table's
    values are then not host data."""
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and (torch.compiler.is_compiling() or torch.compiler.is_exporting())


def used_pages(block_table, seqlen_k, page_size: int, num_pages: int):
    """(the pages sequences' keys use, sorted; the block table renumbered onto them) from host
    ``block_table [B, P]`` and ``seqlen_k [B]``, or None where they cannot be read so (the paged
    cache's own checks then name what is wrong)."""
    try:
        table = np.asarray(block_table.cpu() if hasattr(block_table, "cpu") else block_table)
        lens = np.asarray(seqlen_k.cpu() if hasattr(seqlen_k, "cpu") else seqlen_k)
    except Exception:  # noqa: BLE001 (the cache's checks refuse it by name)
        return None
    if table.ndim != 2 or lens.shape != (table.shape[0],) or table.dtype.kind not in "iu" or lens.dtype.kind not in "iu":
        return None
    n = -(-lens.astype(np.int64) // page_size)
    if np.any(n < 0) or np.any(n > table.shape[1]):
        return None
    used = np.arange(table.shape[1])[None, :] < n[:, None]
    pages = np.unique(table[used])
    if not pages.size or pages[0] < 0 or pages[-1] >= num_pages:
        return None
    out = np.where(used, np.searchsorted(pages, table), 0).astype(np.int32)
    return pages.astype(np.int64), out


def dequantized_kv(q, k, v, k_descale, v_descale, *, layout: str = "bhsd", group: bool = False, block_table=None,
                   seqlen_k=None):
    """(k, v, block_table) as the paths take them: fp8 K / V dequantized (``Fp8Kv.kv``), anything
    else as given (descales refused)."""
    fp8 = check_fp8_kv(q, k, v, k_descale, v_descale, layout=layout, group=group, paged=block_table is not None)
    return (k, v, block_table) if fp8 is None else fp8.kv(k, v, block_table, seqlen_k)
