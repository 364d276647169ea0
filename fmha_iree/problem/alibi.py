"""ALiBi (BLOOM, MPT, Baichuan; CK's ``alibi_slopes``): query head ``h`` adds ``-slope[h] * |p - j|``
to its score of key ``j``, ``p`` the row's position in the mask's frame: ``i`` for a top-left
mask, ``i + Sk - Sq`` for a bottom-right one and for no mask (CK's ``FROM_BOTTOM_RIGHT``), so the
last query sits on the last key when ``Sq != Sk``. The bias joins the score after the scale (and
the soft-cap), before the mask and the softmax, and the LSE includes it.

Slopes are float ``[Hq]`` (every sequence) or ``[B, Hq]`` (one row per batch entry, or per
sequence in group mode), as CK takes them. Only numpy is needed here.
"""

from __future__ import annotations

import numpy as np

from .mask import Mask

__all__ = ["check_alibi", "checked_alibi", "frame_offset", "refuse_sink_tokens"]


def check_alibi(slopes, rows: int, hq: int) -> np.ndarray:
    """``slopes`` as float32 ``[1 or rows, hq]``; a ``TypeError`` / ``ValueError`` naming
    ``alibi_slopes`` for anything else. ``rows``: the batch entries (group mode: sequences)."""
    if slopes is None or isinstance(slopes, (bool, str, bytes)):
        raise TypeError(f"alibi_slopes must be a float tensor/array of shape [Hq] or [B, Hq], got {type(slopes).__name__}")
    if hasattr(slopes, "detach"):  # a torch tensor, on any device
        if not slopes.dtype.is_floating_point:
            raise TypeError(f"alibi_slopes must hold floats, got {slopes.dtype}")
        arr = slopes.detach().float().cpu().numpy()
    else:
        try:
            arr = np.asarray(slopes)
        except Exception as e:  # noqa: BLE001 (anything numpy cannot read is the caller's type error)
            raise TypeError(f"alibi_slopes must be a float tensor/array, got {type(slopes).__name__}") from e
        if arr.dtype.kind not in "fiu":
            raise TypeError(f"alibi_slopes must hold floats, got {arr.dtype}")
    arr = np.ascontiguousarray(arr, np.float32)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.shape[1] != hq or arr.shape[0] not in (1, rows):
        raise ValueError(f"alibi_slopes must have shape [{hq}] or [{rows}, {hq}] ([Hq] or [B, Hq]), "
                         f"got {list(np.shape(slopes))}")
    if not np.isfinite(arr).all():
        raise ValueError("alibi_slopes must be finite")
    return arr


def frame_offset(mask: Mask, q_len, k_len) -> np.ndarray:
    """Each sequence's ``p - i`` (module docstring): 0 for a top-left mask, ``Sk - Sq`` otherwise."""
    q_len, k_len = np.asarray(q_len, np.int64), np.asarray(k_len, np.int64)
    if mask.top_left and not mask.is_none:
        return np.zeros_like(q_len)
    return k_len - q_len


def refuse_sink_tokens(slopes, bias=None):
    """Sink tokens are added to a path's results by a second attention without the score's bias
    (``paths.sink_tokens``): with ALiBi slopes or an elementwise bias they are refused, naming it."""
    if slopes is not None:
        raise ValueError("alibi_slopes: not with sink tokens (a mask with sink tokens adds them without the bias)")
    if bias is not None:
        raise ValueError("bias: not with sink tokens (a mask with sink tokens adds them without the bias)")


def checked_alibi(slopes, rows: int, hq: int, hk: int) -> np.ndarray | None:
    """The checked slopes of a call with ``hq`` / ``hk`` heads (``check_alibi``), None for none."""
    if slopes is None:
        return None
    arr = check_alibi(slopes, rows, hq)
    if hq != hk:
        raise ValueError(f"alibi_slopes: ALiBi takes one query head per KV head here (Hq == Hk), got Hq {hq}, Hk {hk}")
    return arr
