"""Independent float64 reference for CK's FMHA forward (does NOT import fmha_iree).

Written from /work/shared/docs/ck-fmha-reference.md:

* mask window rules: top-left window ``i-l <= j <= i+r``; bottom-right is the same window
  shifted by ``Sk-Sq``; a negative side is unlimited;
* CK mask strings ``0, t, 1, b, 2, t:l,r, b:l,r, xt:w, xb:w``; ``t:l,r,s`` / ``b:l,r,s`` add ``s``
  sink tokens (issue 58, StreamingLLM): keys ``j < s`` are also visible to every row, within its
  right side (``j <= i + shift + r`` when ``r >= 0``);
* LSE is the natural log of the softmax denominator over the visible keys (float32 in the
  package; float64 here); rows that see no key give out 0 and lse -inf;
* GQA/MQA: query head ``h`` reads kv head ``h // (Hq // Hk)``;
* cu_seqlen_q / cu_seqlen_k (batch mode): batch ``b`` uses ``cu[b+1]-cu[b]`` rows/keys from the
  start of its slot, the tail is padding (out 0, lse -inf for padded query rows); the mask uses
  the effective lengths.

Tolerances for every dtype live here, in ``TOLERANCES`` / ``LSE_TOLERANCES``, and nowhere else.
"""

from __future__ import annotations

import re
import zlib

import numpy as np
import torch

# --------------------------------------------------------------------------------------------
# Tolerances (the ONE place): (atol, rtol), compared as |a - r| <= atol + rtol * |r|.
# Outputs of unit-variance random inputs; the reference gets the same (rounded) inputs as the
# kernel, so the error is the kernel's own rounding (P / output rounding, f32 accumulation).
# --------------------------------------------------------------------------------------------
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
# LSE is float32 for every input dtype; values are O(log Sk + max logit) ~ 1..10.
LSE_TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

_NP_TO_TORCH = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32}


def torch_dtype(dtype) -> torch.dtype:
    """Normalise a torch or numpy dtype to the torch dtype used as tolerance key."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return _NP_TO_TORCH[np.dtype(dtype)]


# --------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------
_LR_RE = re.compile(r"^([tb]):(-?\d+),(-?\d+)(?:,(\d+))?$")
_X_RE = re.compile(r"^(xt|xb):(-?\d+)$")


def parse_mask(mask) -> tuple[int, int, bool] | None:
    """CK mask string / (left, right, top_left) tuple / None -> (left, right, top_left) or None.

    None means no mask. A negative side means unlimited.
    """
    if mask is None:
        return None
    if isinstance(mask, tuple):
        left, right, top_left = mask
        return int(left), int(right), bool(top_left)
    if not isinstance(mask, str):
        raise TypeError(f"reference mask must be str/tuple/None, got {type(mask)!r}")
    s = mask.strip()
    if s == "0":
        return None
    if s in ("t", "1"):
        return (-1, 0, True)
    if s in ("b", "2"):
        return (-1, 0, False)
    m = _LR_RE.match(s)
    if m:
        return (int(m.group(2)), int(m.group(3)), m.group(1) == "t")
    m = _X_RE.match(s)
    if m:
        w = int(m.group(2))
        top_left = m.group(1) == "xt"
        # The doc says "w<0 causal"; CK's mask.hpp uses `if (window_size > 0)` i.e. w <= 0 is
        # causal. The tests never use w == 0, where the two readings differ.
        if w <= 0:
            return (-1, 0, top_left)
        left = w // 2
        return (left, w - 1 - left, top_left)
    raise ValueError(f"unknown mask string {mask!r}")


def visible(mask, sq: int, sk: int) -> np.ndarray:
    """bool [sq, sk]: row i may see key j. Built directly from the window rule."""
    spec = parse_mask(mask)
    if spec is None:
        return np.ones((sq, sk), dtype=bool)
    left, right, top_left = spec
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    shift = 0 if top_left else sk - sq  # bottom-right: window shifted by Sk-Sq
    right_ok = np.ones((sq, sk), dtype=bool) if right < 0 else (j <= i + shift + right)
    vis = right_ok.copy()
    if left >= 0:
        vis &= j >= i + shift - left
    return vis | (right_ok & (j < sink_tokens(mask)))


def sink_tokens(mask) -> int:
    """The sink-token count of a ``t:l,r,s`` / ``b:l,r,s`` mask string (0 otherwise)."""
    m = _LR_RE.match(mask.strip()) if isinstance(mask, str) else None
    return int(m.group(4) or 0) if m else 0


def visible_ck_coords(mask, sq: int, sk: int) -> np.ndarray:
    """Same as visible(), but through CK's (y, x) coordinates as written in the doc.

    Used only to cross-check visible() in test_reference.py.
    """
    spec = parse_mask(mask)
    if spec is None:
        return np.ones((sq, sk), dtype=bool)
    left, right, top_left = spec
    if left < 0:
        left = sq - 1 if top_left else sk - 1
    if right < 0:
        right = sk - 1 if top_left else sq - 1
    x = 1 + right + (0 if top_left else sk - sq)
    y = 1 + left + (0 if top_left else sq - sk)
    vis = np.zeros((sq, sk), dtype=bool)
    for i in range(sq):
        lo = max(i - y + 1, 0)
        hi = min(i + x, sk)
        if hi > lo:
            vis[i, lo:hi] = True
    return vis


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------
def to_f64(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _cu_lengths(cu, b: int, full: int, name: str) -> np.ndarray:
    if cu is None:
        return np.full(b, full, dtype=np.int64)
    cu = np.asarray(cu.cpu().numpy() if isinstance(cu, torch.Tensor) else cu, dtype=np.int64)
    assert cu.shape == (b + 1,), f"{name}: expected [{b + 1}], got {cu.shape}"
    lens = np.diff(cu)
    assert (lens >= 0).all() and (lens <= full).all(), f"{name}: bad lengths {lens}"
    return lens


def alibi_bias(mask, sq: int, sk: int, slope: float) -> np.ndarray:
    """float64 [sq, sk]: ALiBi (issue 58, CK's convention): ``-slope * |i + shift - j|``, the row's
    position in the mask's frame: shift 0 for a top-left mask, ``Sk - Sq`` for a bottom-right one
    and for no mask (CK's FROM_BOTTOM_RIGHT)."""
    spec = parse_mask(mask)
    shift = 0 if spec is not None and spec[2] and not (spec[0] < 0 and spec[1] < 0) else sk - sq
    i = np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    return -slope * np.abs(i + shift - j).astype(np.float64)


def attention_ref(q, k, v, *, mask=None, scale=None, layout="bhsd", cu_seqlen_q=None,
                  cu_seqlen_k=None, softcap=None, sinks=None, alibi_slopes=None, bias=None):
    """float64 reference. Returns (out, lse): out in the input layout, lse [B, Hq, Sq].

    ``softcap``: each score ``s = scale * q.k`` becomes ``softcap * tanh(s / softcap)`` before the
    mask. ``sinks`` ([Hq]): head h's sink logit joins every row's softmax denominator
    (``sum_j exp(s_j) + exp(sink)``, no value); LSE includes it, and a row that sees no key (a
    padding row too) gives out 0 and lse = the sink. ``alibi_slopes`` ([Hq] or [B, Hq]): ``alibi_bias``
    added after the soft-cap, before the mask. ``bias``: broadcastable to ``[B, Hq, Sq, Sk]`` (numpy
    rules; rows and keys may run past a sequence's: entry ``b`` reads ``bias[b, h, i, j]`` at its
    own row ``i`` and key ``j``), added there too."""
    q, k, v = to_f64(q), to_f64(k), to_f64(v)
    if layout == "bshd":
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    elif layout != "bhsd":
        raise ValueError(layout)
    B, Hq, Sq, Dq = q.shape
    _, Hk, Sk, _ = k.shape
    Dv = v.shape[-1]
    assert k.shape == (B, Hk, Sk, Dq) and v.shape == (B, Hk, Sk, Dv) and Hq % Hk == 0
    group = Hq // Hk
    if scale is None:
        scale = 1.0 / np.sqrt(Dq)
    lq = _cu_lengths(cu_seqlen_q, B, Sq, "cu_seqlen_q")
    lk = _cu_lengths(cu_seqlen_k, B, Sk, "cu_seqlen_k")

    out = np.zeros((B, Hq, Sq, Dv), dtype=np.float64)
    lse = np.full((B, Hq, Sq), -np.inf, dtype=np.float64)
    if sinks is not None:
        lse[:] = to_f64(sinks).reshape(1, Hq, 1)
    for b in range(B):
        sq, sk = int(lq[b]), int(lk[b])
        if sq == 0:
            continue
        vis = visible(mask, sq, sk)
        any_vis = vis.any(axis=1)
        if not any_vis.any():
            continue
        for h in range(Hq):
            kh = h // group
            s = scale * (q[b, h, :sq] @ k[b, kh, :sk].T)  # [sq, sk]
            if softcap:
                s = softcap * np.tanh(s / softcap)
            if alibi_slopes is not None:
                sl = to_f64(alibi_slopes).reshape(-1, Hq)
                s = s + alibi_bias(mask, sq, sk, float(sl[b if len(sl) > 1 else 0, h]))
            if bias is not None:
                bb = to_f64(bias)
                s = s + np.broadcast_to(bb[b if bb.shape[0] > 1 else 0, h if bb.shape[1] > 1 else 0],
                                        (max(sq, bb.shape[2]), max(sk, bb.shape[3])))[:sq, :sk]
            s = np.where(vis, s, -np.inf)
            if sinks is not None:
                out[b, h, :sq], lse[b, h, :sq] = _with_sink(s, vis, v[b, kh, :sk], float(to_f64(sinks)[h]))
                continue
            with np.errstate(invalid="ignore"):
                m = np.max(s, axis=1, keepdims=True) if sk > 0 else np.zeros((sq, 1))
                m_safe = np.where(any_vis[:, None], m, 0.0)
                p = np.exp(s - m_safe)
                p = np.where(vis, p, 0.0)
                l = p.sum(axis=1, keepdims=True)
                o = (p @ v[b, kh, :sk]) / np.where(any_vis[:, None], l, 1.0)
                row_lse = (m_safe + np.log(np.where(any_vis[:, None], l, 1.0)))[:, 0]
            # NaN rows stay NaN (NaN in q gives NaN logits; np.where keeps them for visible keys)
            out[b, h, :sq] = np.where(any_vis[:, None], o, 0.0)
            lse[b, h, :sq] = np.where(any_vis, row_lse, -np.inf)
    if layout == "bshd":
        out = out.transpose(0, 2, 1, 3)
    return out, lse


def _with_sink(s, vis, v, sink: float):
    """(out, lse) of masked scores ``s`` [sq, sk] whose denominator also holds ``exp(sink)``."""
    with np.errstate(invalid="ignore"):
        m = np.maximum(np.max(s, axis=1, keepdims=True, initial=-np.inf), sink)
        p = np.where(vis, np.exp(s - m), 0.0)
        l = p.sum(axis=1, keepdims=True) + np.exp(sink - m)
        return (p @ v) / l, (m + np.log(l))[:, 0]


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------
def assert_close(actual, ref, dtype, *, kind: str = "out", what: str = ""):
    """Compare a kernel result to the float64 reference.

    * shapes must agree;
    * NaN anywhere in ``actual`` fails unless ``ref`` has NaN at the same place (and vice versa);
    * -inf / +inf must match exactly (so -inf == -inf);
    * finite values: |a - r| <= atol + rtol * |r| with the per-dtype tolerance of ``kind``
      ("out" -> TOLERANCES, "lse" -> LSE_TOLERANCES).
    """
    a = to_f64(actual)
    r = np.asarray(ref, dtype=np.float64)
    label = f"{what} {kind}".strip()
    assert a.shape == r.shape, f"{label}: shape {a.shape} != reference {r.shape}"
    table = LSE_TOLERANCES if kind == "lse" else TOLERANCES
    atol, rtol = table[torch_dtype(dtype)]

    a_nan, r_nan = np.isnan(a), np.isnan(r)
    if (a_nan != r_nan).any():
        idx = np.argwhere(a_nan != r_nan)
        raise AssertionError(
            f"{label}: NaN mismatch at {len(idx)} element(s), first {tuple(idx[0])}: "
            f"actual={a[tuple(idx[0])]} ref={r[tuple(idx[0])]}")
    a_inf, r_inf = np.isinf(a), np.isinf(r)
    bad_inf = (a_inf | r_inf) & ~((a == r) & a_inf)
    if bad_inf.any():
        idx = np.argwhere(bad_inf)
        raise AssertionError(
            f"{label}: inf mismatch at {len(idx)} element(s), first {tuple(idx[0])}: "
            f"actual={a[tuple(idx[0])]} ref={r[tuple(idx[0])]}")
    fin = ~(r_nan | r_inf)
    if not fin.any():
        return
    with np.errstate(invalid="ignore"):
        err = np.where(fin, np.abs(a - r), 0.0)
    lim = atol + rtol * np.abs(np.where(fin, r, 0.0))
    bad = err > lim
    if bad.any():
        worst = np.unravel_index(np.argmax(np.where(fin, err - lim, -np.inf)), err.shape)
        raise AssertionError(
            f"{label}: {int(bad.sum())}/{int(fin.sum())} elements out of tolerance "
            f"(atol={atol}, rtol={rtol}); max abs err {err.max():.3e}; worst at {worst}: "
            f"actual={a[worst]!r} ref={r[worst]!r}")


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------
def seed_of(*parts) -> int:
    """A fixed seed derived from a test's parameters (different tests -> different inputs)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def make_qkv(seed, *, B=1, Hq=2, Hk=None, Sq=7, Sk=None, Dq=64, Dv=None, dtype=torch.float32,
             layout="bhsd"):
    """Random normal q, k, v (never zeros) as torch tensors in the given layout."""
    Hk = Hq if Hk is None else Hk
    Sk = Sq if Sk is None else Sk
    Dv = Dq if Dv is None else Dv
    g = torch.Generator().manual_seed(int(seed))
    q = torch.randn(B, Hq, Sq, Dq, generator=g, dtype=torch.float32)
    k = torch.randn(B, Hk, Sk, Dq, generator=g, dtype=torch.float32)
    v = torch.randn(B, Hk, Sk, Dv, generator=g, dtype=torch.float32)
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def ints(x) -> np.ndarray | None:
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        x = x.cpu().numpy()
    return np.asarray(x, dtype=np.int64)


def varlen_ref(q, k, v, seqstart_q, seqstart_k, *, seqlen_k=None, seqstart_padded_q=None,
               seqstart_padded_k=None, mask=None, scale=None, softcap=None, sinks=None, alibi_slopes=None,
               bias=None):
    """float64 group-mode reference built on ``attention_ref``: each sequence sliced out of the
    packed tensors and run as a B=1 bshd batch with its own lengths; ``bias`` a padded batch's
    (``[B or 1, Hq or 1, Sq' or 1, Sk' or 1]``), sequence ``b`` its entry ``b``.

    Returns (out [Tq_phys, Hq, Dv], lse [Hq, seqstart_q[-1]]); rows owned by no sequence are 0,
    lse entries default to -inf.
    """
    q64, k64, v64 = to_f64(q), to_f64(k), to_f64(v)
    sq_, sk_ = ints(seqstart_q), ints(seqstart_k)
    lk_used = ints(seqlen_k)
    pq = ints(seqstart_padded_q) if seqstart_padded_q is not None else sq_
    pk = ints(seqstart_padded_k) if seqstart_padded_k is not None else sk_
    B = len(sq_) - 1
    Tq, Hq, _ = q64.shape
    Dv = v64.shape[-1]
    out = np.zeros((Tq, Hq, Dv), dtype=np.float64)
    lse = np.full((Hq, int(sq_[-1])), -np.inf, dtype=np.float64)
    if sinks is not None:
        lse[:] = to_f64(sinks)[:, None]
    for b in range(B):
        nq = int(sq_[b + 1] - sq_[b])
        nk = int(sk_[b + 1] - sk_[b])
        if lk_used is not None:
            assert 0 <= lk_used[b] <= nk
            nk = int(lk_used[b])
        oq, ok = int(pq[b]), int(pk[b])
        if nq == 0:
            continue
        qs = q64[oq:oq + nq][None]  # [1, nq, Hq, Dq] (bshd)
        ks = k64[ok:ok + nk][None]
        vs = v64[ok:ok + nk][None]
        sl = None if alibi_slopes is None else to_f64(alibi_slopes).reshape(-1, Hq)
        sl = None if sl is None else sl[b if len(sl) > 1 else 0]
        bs = None if bias is None else to_f64(bias)
        bs = None if bs is None else bs[b:b + 1] if bs.shape[0] > 1 else bs
        o, l = attention_ref(qs, ks, vs, mask=mask, scale=scale, layout="bshd", softcap=softcap, sinks=sinks,
                             alibi_slopes=sl, bias=bs)
        out[oq:oq + nq] = o[0]
        lse[:, int(sq_[b]):int(sq_[b]) + nq] = l[0]
    return out, lse
