"""Attention sinks (gpt-oss; StreamingLLM's learned form): one logit per query head that joins
every row's softmax denominator and carries no value,

    out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink)),   lse' = log(exp(lse) + exp(sink)),

applied to the ``(out, lse)`` any path returns: ``out' = out * sigmoid(lse - sink)`` (exactly the
formula above, since ``out = sum_j exp(s_j) v_j / exp(lse)``). So every path of every mode
takes sinks without a kernel of its own; a row that sees no key (lse ``-inf``: a masked-out row,
a padding row) gives out 0 and lse = the sink. Host results are rescaled in float32 (``out``
rounded once more); torch tensors in ``out``'s dtype, the factor rounded to it first (one pass
over ``out``: in float32 the three passes cost the H100 prefill 18%), so within about 1.5 units
in the last place beyond the kernel's own rounding.

Host results (numpy arrays, torch tensors on any device) are rescaled where they lie, with numpy
or torch; a call on DeviceTensors is refused (``with_sinks``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["check_sinks", "apply_sinks", "varlen_rows", "with_sinks"]


def check_sinks(sinks, hq: int | None):
    """``sinks`` as float32 ``[hq]`` (a torch tensor stays one, on its device; anything else becomes
    a numpy array); ``hq`` None skips the length check (the inputs' own check will refuse them).
    Tensors are told by their ``detach`` (a test ``torch.export`` traces through)."""
    if hasattr(sinks, "detach"):
        if not sinks.dtype.is_floating_point:
            raise TypeError(f"sinks must hold floats, got {sinks.dtype}")
        arr = sinks.detach().float()
    else:
        if isinstance(sinks, (bool, str, bytes)) or sinks is None:
            raise TypeError(f"sinks must be a float tensor/array of shape [Hq], got {type(sinks).__name__}")
        try:
            arr = np.asarray(sinks)
        except Exception as e:  # noqa: BLE001 (anything numpy cannot read is the caller's type error)
            raise TypeError(f"sinks must be a float tensor/array of shape [Hq], got {type(sinks).__name__}") from e
        if arr.dtype.kind not in "fiu":
            raise TypeError(f"sinks must hold floats, got {arr.dtype}")
        arr = arr.astype(np.float32)
    if arr.ndim != 1 or (hq is not None and arr.shape[0] != hq):
        want = "[Hq]" if hq is None else f"[{hq}] (one per query head)"
        raise ValueError(f"sinks must have shape {want}, got {list(arr.shape)}")
    return arr


def varlen_rows(seqstart_q, seqstart_padded_q) -> tuple[np.ndarray, np.ndarray] | None:
    """Group mode's (out rows, lse columns) of each query token where ``seqstart_padded_q`` places
    the rows elsewhere than the LSE's unpadded columns; None where they coincide."""
    if seqstart_padded_q is None:
        return None
    from ..problem.plan import runs
    from ..problem.spec import int_vector

    sq = int_vector(seqstart_q, "seqstart_q", None)
    pq = int_vector(seqstart_padded_q, "seqstart_padded_q", len(sq))
    b, i = runs(np.diff(sq))
    return pq[b] + i, sq[b] + i


def apply_sinks(out, lse, sinks, layout: str, rows=None):
    """``(out', lse')`` of a path's results with ``sinks`` (``check_sinks``'s). ``layout``: ``bhsd``
    (out ``[B, H, S, D]``, lse ``[B, H, S]``), ``bshd`` (out ``[B, S, H, D]``) or ``thd`` (group
    mode: out ``[T, H, D]``, lse ``[H, T']``; ``rows`` from ``varlen_rows``). Anything but a numpy
    ``out`` is a torch tensor (an isinstance test ``torch.export`` traces through)."""
    if not isinstance(out, np.ndarray):
        return _torch(out, lse, sinks, layout, rows)
    s = np.asarray(sinks, np.float32)
    lse = np.asarray(lse, np.float32)
    sink = s[None, :, None] if layout != "thd" else s[:, None]
    with np.errstate(over="ignore", invalid="ignore"):
        factor = 1.0 / (1.0 + np.exp(sink - lse))  # sigmoid(lse - sink): 0 at lse -inf
        lse2 = np.logaddexp(lse, sink).astype(np.float32)
    return _scaled(out.astype(np.float32), factor, layout, rows).astype(out.dtype), lse2


def _scaled(o, f, layout: str, rows):
    """``o`` times ``f`` broadcast to its rows (numpy or torch; ``o`` itself is not written)."""
    if rows is not None:  # group mode with padded starts: out row r[t] is the LSE's column c[t]
        r, c = rows
        o = o.copy() if isinstance(o, np.ndarray) else o.clone()
        o[r] = o[r] * f[:, c].T[..., None]
        return o
    if layout == "bhsd":
        return o * f[..., None]
    if layout == "bshd":
        return o * f.swapaxes(1, 2)[..., None]
    return o * _padded(f, o.shape[0]).T[..., None]  # group mode: token t of the LSE is out's row t; rows past it are 0


def _padded(factor, n: int):
    """``factor`` ``[H, T']`` padded with ones to ``[H, n]`` (a pad, not a slice of the output: an
    exported model's LSE length is data-dependent, and a slice of it would be a min of sizes)."""
    if isinstance(factor, np.ndarray):
        return np.pad(factor, ((0, 0), (0, n - factor.shape[1])), constant_values=1.0)
    import torch

    return torch.nn.functional.pad(factor, (0, n - factor.shape[1]), value=1.0)


def _torch(out, lse, sinks, layout: str, rows):
    import torch

    s = torch.as_tensor(sinks, dtype=torch.float32, device=lse.device)
    sink = s[None, :, None] if layout != "thd" else s[:, None]
    factor = torch.sigmoid(lse - sink)
    lse2 = torch.logaddexp(lse, sink.expand_as(lse))
    f = factor.to(out.dtype)  # one pass over out in its own dtype (the factor rounded once more)
    if rows is not None:
        rows = tuple(torch.as_tensor(x, device=out.device) for x in rows)
    return _scaled(out, f, layout, rows), lse2


def with_sinks(run, q, sinks, head_axis: int, layout: str, return_lse, rows=None):
    """``run()``'s ``(out, lse)`` with ``sinks``, checked before it runs (the public calls'
    ``sinks=``); ``q``'s axis ``head_axis`` holds the query heads."""
    from ..runtime.device import DeviceTensor

    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if isinstance(q, DeviceTensor):
        raise TypeError("sinks: calls on DeviceTensors take no sinks (they are applied to host or torch results); "
                        "pass torch tensors or host arrays")
    shape = getattr(q, "shape", None)
    ndim = 3 if layout == "thd" else 4  # another rank: q's own check refuses it
    hq = int(shape[head_axis]) if shape is not None and len(shape) == ndim else None
    s = check_sinks(sinks, hq)
    out, lse = run()
    out, lse = apply_sinks(out, lse, s, layout, rows)
    return (out, lse) if return_lse else out

