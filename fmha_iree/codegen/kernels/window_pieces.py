"""Split-KV for a ragged frame: the union of every sequence's visible keys as one masked window,
cut into pieces.

In a frame whose sequences have different key counts (a decode batch over KV lengths 256..8192),
the interior that every sequence sees ends at the shortest one (``bounds``), so ``_split``'s
pieces cover almost nothing and its right edge, one masked op with one workgroup per (batch, KV
head, row tile), walks the rest of the keys alone. Here the union ``[lo, hi)`` of all sequences'
keys (the frame's loosest coordinates, ``bounds.Coords``) is read as ``P`` pieces of ``per`` keys
each (a batch dim, ``P`` even, ``per`` a multiple of ``Plan.cols``), from ``start = max(0,
min(lo, limit - P * per))``; every element is masked with its own sequence's rule and each piece
writes its own state slot, merged by ``finalize.normalize_slots``. The pieces are disjoint, so
every key is counted once.

The mask is one tensor of the ragged mask type ``[B, P / 2, 2, M, per]`` (the pieces in pairs
along the edge dim, so that every path returns scratch of one type): element ``(b, h, e, m, j)``
says whether row ``s = m // G`` of sequence ``b`` sees key ``start + (2 h + e) * per + j``
(CK's ``lo(s) <= j < hi(s)`` with that sequence's ``(qlen, klen, y, x)``; rows past ``qlen`` and
keys past ``klen`` see nothing).
"""

from __future__ import annotations

import dataclasses

from .attention import Operand, online_attention
from .bounds import group_bounds, row_hi, row_lo
from .finalize import normalize_slots
from .ir import tensor_type
from .masks import RAGGED_MASK_TYPE, ragged_generator
from .operands import Ctx, Tier, kv_operand, q_padded
from .state import fresh_outs, new_state

__all__ = ["WindowPieces", "window_pieces_host", "window_pieces_work"]


@dataclasses.dataclass(frozen=True)
class WindowPieces:
    """Host values (SSA names) of the path."""

    m_pad: str  # state rows: Sq * G rounded up to the tier's tile rows
    half: str  # P / 2
    pieces: str  # P
    per: str  # keys per piece, a multiple of Plan.cols
    start: str  # the first key of piece 0
    fits: str  # i1: the P * per keys from start can be read
    row_unit: int  # m_pad is a proven multiple of it (the tier's tile rows)


def window_pieces_host(c: Ctx, tier: Tier) -> WindowPieces:
    """The pieces: enough of them that ``B * Hk * tiles * P`` reaches ``Plan.split_target``
    workgroups, at most ``Plan.max_split`` and at most one per ``Plan.cols`` keys of the window."""
    fn, p = c.fn, c.p
    L = p.cols
    m_pad = fn.assume_div(fn.round_up(fn.mul(c.sq, p.group), tier.tile_rows), tier.tile_rows)
    bd = group_bounds(fn, g=0, rows=c.sq, sq=c.sq, sk=c.sk, co=c.co, cols=L)
    width = fn.max(fn.round_up(fn.sub(bd.right_hi, bd.left_lo), L), L)
    wgs = fn.max(fn.mul(fn.mul(c.b, c.hk), fn.floordiv(m_pad, tier.tile_rows)), 1)
    most = fn.max(fn.min(fn.ceildiv(fn.floordiv(width, L), 2), p.max_split // 2), 1)
    half = fn.clamp(fn.ceildiv(p.split_target, fn.mul(wgs, 2)), 1, most)
    pieces = fn.mul(half, 2)
    per = fn.assume_div(fn.round_up(fn.ceildiv(width, pieces), L), L)
    total = fn.mul(pieces, per)
    start = fn.bounded(fn.max(fn.min(bd.left_lo, fn.sub(c.limit, total)), 0))
    return WindowPieces(m_pad, half, pieces, per, start, fn.cmp("sle", total, c.limit), tier.tile_rows)


def _window_mask(c: Ctx, h: WindowPieces) -> str:
    """The generator of the ``[B, P / 2, 2, M, per]`` mask."""
    fn = c.fn

    def element(ql, kl, yb, xb, ix):
        hh, e, m, j = ix
        s = fn.floordiv(m, c.p.group)
        key = fn.add(fn.add(h.start, fn.mul(fn.add(fn.mul(hh, 2), e), h.per)), j)
        hi = fn.min(row_hi(fn, s, xb, c.sk), kl)
        return fn.andi(fn.andi(fn.cmp("slt", s, ql), fn.cmp("sge", key, row_lo(fn, s, yb, c.sk))), fn.cmp("slt", key, hi))

    return ragged_generator(c, [c.b, h.half, h.m_pad, h.per], element, h.row_unit)


def window_pieces_work(c: Ctx, tier: Tier, h: WindowPieces) -> list[str]:
    """The path's work on ``c``'s frame: the mask, Q copied into padded rows, one op over the
    pieces, the slots normalized. Returns out, lse, then the scratch (padded Q, mask, state)."""
    fn, p = c.fn, c.p
    mask = _window_mask(c, h)
    qp = q_padded(c, c.q, h.m_pad)
    st = new_state(fn, [c.b, c.hk, h.pieces, h.m_pad], p.dv)
    dims = ("b0", "b1", "b2", "m")
    lead = [c.b, c.hk, h.pieces, h.m_pad]

    def region():
        m_ty = tensor_type(["?", "?", "?", "?"], "i1")
        mv = fn.let(f"tensor.collapse_shape {mask} [[0], [1, 2], [3], [4]] : {RAGGED_MASK_TYPE} into {m_ty}", "mc")
        q_ty = tensor_type(["?", "?", "?", p.dq], p.dtype)
        q = Operand(qp, q_ty, ("b0", "b1", "m", "k1"))
        res = online_attention(fn, q=q, k=kv_operand(c, "k", h.start, h.per, h.pieces),
                               v=kv_operand(c, "v", h.start, h.per, h.pieces), scale=c.scale, scale_type=p.dtype,
                               outs=fresh_outs(fn, lead, dims, p.dv), nb=3, lowering=tier.lowering, dv=p.dv,
                               mask=Operand(mv, m_ty, ("b0", "b2", "m", "k2")), softcap=p.softcap)
        return st.insert(fn, res, ["0", "0", "0", "0"], lead)

    st = st.with_names(fn.dispatch(st.region_results(), region))
    out, _, lse, _ = normalize_slots(fn, st, sq=c.sq, group=p.group, dtype=p.dtype, layout=p.layout,
                                     dv_out=p.arg_dims[1])
    return [out, lse, qp, mask, *st.names()]
