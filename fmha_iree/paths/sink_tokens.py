"""Sink tokens (StreamingLLM; CK's mask option ``Mask.sink``): the first ``n`` keys of each
sequence stay visible beside a sliding window. Every path applies the window only; this module adds
the keys a row sees through the sink and not through its window, ``j < min(n, lo(i), hi(i))``
(``lo``/``hi`` the row's window ``[max(i - y + 1, 0), min(i + x, Sk))``: a key the window reaches is
counted once, a key right of the row's window is never seen), as a second attention over those at
most ``n`` keys merged with the path's ``(out, lse)`` the split-KV way:

    lse' = logaddexp(lse, lse_s),   out' = out exp(lse - lse') + out_s exp(lse_s - lse').

Its cost is ``n`` keys per row (the scores ``[rows, Hq, n]``), whatever the path; the sink keys are
gathered per row (group mode, paged caches) by indices made on the host from the call's lengths.
Computed in float32 with numpy for host results and torch on the tensors' device; the soft-cap
applies to the sink keys' scores as to the window's. Calls on DeviceTensors are refused.
"""

from __future__ import annotations

import numpy as np

from ..problem.mask import Mask, as_mask
from ..problem.plan import runs

__all__ = ["has_sink_tokens", "batch_sink_tokens", "varlen_sink_tokens", "with_batch_sink_tokens",
           "with_varlen_sink_tokens"]


def has_sink_tokens(mask) -> bool:
    """Whether ``mask`` (None, a CK string or a Mask) carries sink tokens; a string is parsed
    only when it could (a third number), so the common call pays nothing."""
    if isinstance(mask, Mask):
        return mask.sink > 0
    return isinstance(mask, str) and mask.count(",") == 2 and as_mask(mask).sink > 0


def _is_numpy(x) -> bool:
    return isinstance(x, np.ndarray)


def _f32(x):
    return x.astype(np.float32) if _is_numpy(x) else x.float()


def _like(a: np.ndarray, x):
    """The host int/bool array ``a`` as ``x``'s kind (torch on ``x``'s device)."""
    if _is_numpy(x):
        return a
    import torch

    return torch.as_tensor(a, device=x.device)


def _attend(q, keys, values, count, scale: float, softcap: float):
    """``(out, lse)`` of the float32 rows ``q`` ``[..., D]`` over the ``n`` keys ``keys`` /
    ``values`` (``[..., n, D]`` / ``[..., n, Dv]``, broadcast against ``q[..., None, :]``) where key
    ``j`` is seen iff ``j < count`` (broadcast to ``q[..., 0]``); a row that sees none gives out 0
    and lse -inf. Elementwise products and sums over the head dim and the ``n`` keys only, so that a
    row's result does not depend on how many rows are computed with it (a batched matmul's blocking
    would: one sequence differed by 3e-5 alone and in a batch)."""
    if _is_numpy(q):
        return _attend_np(q, keys, values, count, scale, softcap)
    s = (q[..., None, :] * keys).sum(-1) * scale  # [..., n]: one launch per step, not per key
    if softcap:
        s = s.div(softcap).tanh() * softcap
    n = s.shape[-1]
    s = s.masked_fill(count[..., None] <= _like(np.arange(n), s), float("-inf"))
    m = s.amax(dim=-1, keepdim=True).nan_to_num(0.0, 0.0, 0.0)
    e = (s - m).exp()
    tot = e.sum(-1)
    out = (e[..., None] * values).sum(-2) / tot.clamp_min(1e-38)[..., None]
    return out, tot.log() + m[..., 0]


def _attend_np(q, keys, values, count, scale: float, softcap: float):
    """:func:`_attend` in numpy, key by key (no ``[..., n, D]`` product held)."""
    n = keys.shape[-2]
    s = np.stack([(q * keys[..., j, :]).sum(-1) for j in range(n)], -1) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    s = np.where(np.arange(n) < count[..., None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    tot = e.sum(-1)
    out = sum(e[..., j, None] * values[..., j, :] for j in range(n))
    with np.errstate(divide="ignore"):
        return out / np.where(tot > 0, tot, 1.0)[..., None], np.log(tot) + m[..., 0]


def _merge(out, lse, out_s, lse_s):
    """The merged ``(out, lse)`` (float32; ``lse`` broadcast like ``out[..., 0]``)."""
    with np.errstate(invalid="ignore", over="ignore"):
        if _is_numpy(out):
            new = np.logaddexp(lse, lse_s)
            f1 = np.nan_to_num(np.exp(lse - new), nan=0.0)
            f2 = np.nan_to_num(np.exp(lse_s - new), nan=0.0)
        else:
            new = lse.logaddexp(lse_s)
            f1, f2 = (lse - new).exp().nan_to_num(0.0), (lse_s - new).exp().nan_to_num(0.0)
    return out * f1[..., None] + out_s * f2[..., None], new


def _counts(mask: Mask, i, q_len, k_len, seq):
    """Sink keys each row sees outside its window, ``min(n, lo, hi)`` clipped at 0: row ``i``
    (host int array) of sequence ``seq`` (its index into the per-sequence ``q_len``/``k_len``,
    broadcast with ``i``); rows past their sequence's length see none."""
    yx = [mask.window_only.coords(int(a), int(b)) for a, b in zip(q_len, k_len)]
    y, x = (np.asarray([c[t] for c in yx], np.int64).reshape(-1) for t in (0, 1))
    ql, kl, y, x = q_len[seq], k_len[seq], y[seq], x[seq]
    lo, hi = np.maximum(i - y + 1, 0), np.minimum(i + x, kl)
    return np.where(i < ql, np.maximum(np.minimum(np.minimum(lo, hi), mask.sink), 0), 0)


def _check_host_or_torch(q):
    from ..runtime.device import DeviceTensor

    if isinstance(q, DeviceTensor):
        raise TypeError("mask: sink tokens are added to host or torch results; calls on DeviceTensors take none "
                        "(pass torch tensors or host arrays)")


def batch_sink_tokens(out, lse, q, k, v, *, mask: Mask, scale: float, softcap: float, layout: str, q_lens, k_lens,
                      return_lse: bool):
    """A batch-mode path's ``(out, lse)`` for ``mask.window_only`` with ``mask``'s sink tokens
    added (``q_lens``/``k_lens``: each batch's lengths; host or torch results)."""
    tr = (lambda a: a.transpose(0, 2, 1, 3)) if _is_numpy(q) else (lambda a: a.transpose(1, 2))
    qb, kb, vb = (a if layout == "bhsd" else tr(a) for a in (q, k, v))  # [B, H, S, D]
    B, Hq, Sq, D = qb.shape
    Hk, n = kb.shape[1], min(mask.sink, kb.shape[2])
    q_lens, k_lens = np.asarray(q_lens, np.int64), np.asarray(k_lens, np.int64)
    count = _counts(mask, np.arange(Sq)[None, :], q_lens, k_lens, np.arange(B)[:, None])
    qg = _f32(qb).reshape(B, Hk, Hq // Hk, Sq, D)
    keys, values = (_f32(x[:, :, None, None, :n]) for x in (kb, vb))  # [B, Hk, 1, 1, n, D]
    o_s, l_s = _attend(qg, keys, values, _like(count.reshape(B, 1, 1, Sq), qg), scale, softcap)
    o_s, l_s = o_s.reshape(B, Hq, Sq, -1), l_s.reshape(B, Hq, Sq)
    o, lse2 = _merge(_f32(out if layout == "bhsd" else tr(out)), lse, o_s, l_s)
    o = o if layout == "bhsd" else tr(o)
    o = o.astype(out.dtype) if _is_numpy(o) else o.to(out.dtype)
    return (o, lse2) if return_lse else o


def varlen_sink_tokens(out, lse, q, k, v, *, mask: Mask, scale: float, softcap: float, starts, page_rows=None,
                       return_lse: bool):
    """A group-mode path's ``(out, lse)`` for ``mask.window_only`` with ``mask``'s sink tokens added.
    ``starts``: the validated ``(q_start, q_len, k_start, k_len, lse_start)`` (physical starts,
    lengths, each sequence's first LSE column); ``page_rows(b, j)``: a paged cache's flat row of
    sequence ``b``'s key ``j`` (``k``/``v`` then ``[pages * page_size, Hk, D]`` views)."""
    q_start, q_len, k_start, k_len, lse_start = (np.asarray(a, np.int64) for a in starts)
    b, i = runs(q_len)
    cnt = _counts(mask, i, q_len, k_len, b)
    keep = cnt > 0
    b, i, cnt = b[keep], i[keep], cnt[keep]
    n = int(cnt.max()) if cnt.size else 0
    if n == 0:
        return (out, lse) if return_lse else out
    j = np.minimum(np.arange(n)[None, :], np.maximum(k_len[b, None] - 1, 0))
    key_rows = k_start[b, None] + j if page_rows is None else page_rows(b[:, None], j)
    rows, cols = q_start[b] + i, lse_start[b] + i
    qr = _f32(q[_like(rows, q)])  # [R, Hq, D]
    kr, vr = _f32(k[_like(key_rows, k)]), _f32(v[_like(key_rows, v)])  # [R, n, Hk, D]
    R, Hq, D = qr.shape
    Hk = kr.shape[2]
    qg = qr.reshape(R, Hk, Hq // Hk, D)
    tr = (lambda x: x.transpose(0, 2, 1, 3)) if _is_numpy(kr) else (lambda x: x.transpose(1, 2))
    keys, values = (tr(x)[:, :, None] for x in (kr, vr))  # [R, Hk, 1, n, D]
    o_s, l_s = _attend(qg, keys, values, _like(cnt.reshape(R, 1, 1), qg), scale, softcap)  # [R, Hk, G, Dv]
    rows_t, cols_t = _like(rows, out), _like(cols, lse)
    lse_r = lse[:, cols_t].T  # [R, Hq]
    o, l2 = _merge(_f32(out[rows_t]), lse_r, o_s.reshape(R, Hq, -1), l_s.reshape(R, Hq))
    out2, lse2 = (out.copy(), lse.copy()) if _is_numpy(out) else (out.clone(), lse.clone())
    out2[rows_t] = o.astype(out.dtype) if _is_numpy(o) else o.to(out.dtype)
    lse2[:, cols_t] = l2.T
    return (out2, lse2) if return_lse else out2


def _page_rows(table: np.ndarray, page: int):
    """A paged cache's flat row of sequence ``b``'s key ``j`` (int arrays, broadcast)."""
    return lambda b, j: table[b, j // page] * page + j % page


def with_batch_sink_tokens(run, q, k, v, *, mask, scale, layout, cu_seqlen_q, cu_seqlen_k, softcap, return_lse):
    """The public batch-mode calls' sink tokens: ``run(window_mask)`` (the call itself with
    ``return_lse=True``, which checks every argument first) and the sink keys added. The lengths
    are read from the call's own arguments, not from a second check of the tensors (which copies
    GPU tensors to the host: 130 ms on the H100's prefill row)."""
    from ..problem.spec import check_scale, check_seqlens, check_softcap

    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    mask = as_mask(mask)
    _check_host_or_torch(q)
    out, lse = run(mask.window_only)
    sq, sk = (x.shape[2] if layout == "bhsd" else x.shape[1] for x in (q, k))
    b = q.shape[0]
    q_lens = np.full(b, sq, np.int64) if cu_seqlen_q is None else check_seqlens(cu_seqlen_q, "cu_seqlen_q", b, sq)
    k_lens = np.full(b, sk, np.int64) if cu_seqlen_k is None else check_seqlens(cu_seqlen_k, "cu_seqlen_k", b, sk)
    return batch_sink_tokens(out, lse, q, k, v, mask=mask, scale=check_scale(scale, q.shape[-1]),
                             softcap=check_softcap(softcap), layout=layout, q_lens=q_lens, k_lens=k_lens,
                             return_lse=return_lse)


def with_varlen_sink_tokens(run, q, k, v, seqstart_q, seqstart_k, *, seqlen_k, seqstart_padded_q, seqstart_padded_k,
                            block_table, mask, scale, softcap, return_lse):
    """As :func:`with_batch_sink_tokens` for group mode (a paged cache with ``block_table``)."""
    from ..problem.spec import check_scale, check_softcap, int_array, int_vector

    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    mask = as_mask(mask)
    _check_host_or_torch(q)
    out, lse = run(mask.window_only)
    sq = int_vector(seqstart_q, "seqstart_q", None)
    q_len = np.diff(sq)
    q_start = sq[:-1] if seqstart_padded_q is None else int_vector(seqstart_padded_q, "seqstart_padded_q", None)[:-1]
    page_rows, kr, vr = None, k, v
    if block_table is not None:
        n, page = int(k.shape[0]), int(k.shape[1])
        kr, vr = k.reshape(n * page, *k.shape[2:]), v.reshape(n * page, *v.shape[2:])
        page_rows = _page_rows(int_array(block_table, "block_table"), page)
        k_start, k_len = np.zeros(len(q_len), np.int64), int_vector(seqlen_k, "seqlen_k", None)
    else:
        sk = int_vector(seqstart_k, "seqstart_k", None)
        k_len = np.diff(sk) if seqlen_k is None else int_vector(seqlen_k, "seqlen_k", None)
        k_start = sk[:-1] if seqstart_padded_k is None else int_vector(seqstart_padded_k, "seqstart_padded_k", None)[:-1]
    return varlen_sink_tokens(out, lse, q, kr, vr, mask=mask, scale=check_scale(scale, q.shape[-1]),
                              softcap=check_softcap(softcap), starts=(q_start, q_len, k_start, k_len, sq[:-1]),
                              page_rows=page_rows, return_lse=return_lse)
