"""The two ways ``fwd`` cuts a problem (``general`` has the overview): groups of rows, each an
interior op plus masked edges chained through its state; or one group split over the keys.

Layout of the emitted function: host arithmetic for every path first (``ir.Fn``), then the
tensors all paths share (padded Q, the edge masks, the state), then the choice of path
(``scf.if``) holding only explicit dispatch regions that write into those tensors, then one
normalize of the state. The state and the mask tensor are threaded through every branch, so
IREE updates them in place (a branch that updated a tensor it does not yield would make IREE
copy it first).
"""

from __future__ import annotations

import dataclasses

from .attention import Operand, online_attention
from .bounds import Bounds, group_bounds
from .finalize import normalize
from .general import Tier, _Ctx, kv_operand, q_padded
from .ir import tensor_type as _ty
from .masks import MASK_TYPE, edge_masks
from .state import State, fresh_outs, new_state

__all__ = ["body"]


@dataclasses.dataclass(frozen=True)
class _Carry:
    """The state the chosen path updates, ``[B, Hk, slots, rows]`` (one slot for the groups, one
    per piece and edge for split-KV), and the edges' mask tiles (read only)."""

    state: State
    mask: str  # [groups, 2, M, W]

    def names(self) -> list[str]:
        return self.state.names()

    def types(self) -> list[str]:
        return self.state.types()

    def results(self) -> list[tuple[str, list[str]]]:
        return self.state.region_results()

    def with_names(self, names) -> "_Carry":
        return dataclasses.replace(self, state=self.state.with_names(names))

    with_state = with_names


@dataclasses.dataclass
class _Groups:
    """Host values of the prefill path."""

    rows: str
    groups: str
    m: str
    m_pad: str
    width: str
    bounds: list[Bounds]
    k2: list[str]
    widths: list[tuple[str, str]]  # (right, left) edge widths per group


@dataclasses.dataclass
class _Pieces:
    """Host values of the split-KV path."""

    m: str
    m_pad: str
    width: str
    bounds: Bounds
    pieces: str
    per: str
    rest: str
    rest_lo: str
    n_slots: str
    edge_slots: tuple[str, str]
    widths: tuple[str, str]


def _q_rows(c: _Ctx, qp: str, row0, m: str) -> Operand:
    ty = _ty(["?", "?", "?", c.p.dq], c.p.dtype)
    q = c.fn.let(f"tensor.extract_slice {qp}[0, 0, {c.fn._idx(row0)}, 0] [{c.b}, {c.hk}, {m}, {c.p.dq}] [1, 1, 1, 1] "
                 f": {ty} to {ty}", "qs")
    return Operand(q, ty, ("b0", "b1", "m", "k1"))


def _attend(c: _Ctx, tier: Tier, q: Operand, k: Operand, v: Operand, outs: list[Operand], nb: int,
            mask: Operand | None = None) -> list[str]:
    return online_attention(c.fn, q=q, k=k, v=v, scale=c.scale, scale_type=c.p.dtype, outs=outs, nb=nb,
                            lowering=tier.lowering, dv=c.p.dv, mask=mask)


def _groups_host(c: _Ctx, tier: Tier) -> _Groups:
    fn, p = c.fn, c.p
    unlimited = fn.andi(fn.cmp("sge", c.y, c.sq), fn.cmp("sge", c.x, c.sk))
    whole = fn.round_up(c.sq, tier.tile_rows)
    # at least p.rows, enough that the groups fit in p.max_groups, and enough rows that one group's
    # op fills the GPU (B * Hk * rows * G / tile_rows >= fill_wgs)
    fill = fn.round_up(fn.ceildiv(fn.c(p.fill_wgs * tier.tile_rows), fn.mul(fn.mul(c.b, c.hk), p.group)), tier.tile_rows)
    capped = fn.max(fn.max(fn.c(p.rows), fill), fn.round_up(fn.ceildiv(c.sq, p.max_groups), tier.tile_rows))
    rows = fn.select(unlimited, whole, fn.min(capped, whole))
    groups = fn.ceildiv(c.sq, rows)
    m = fn.assume_div(fn.mul(rows, p.group), tier.tile_rows)
    bounds, k2, widths = [], [], []
    for g in range(p.max_groups):
        bd = group_bounds(fn, g=g, rows=rows, sq=c.sq, sk=c.sk, y=c.y, x=c.x, cols=p.cols)
        bounds.append(bd)
        k2.append(fn.assume_div(fn.mul(bd.n_cols, p.cols), p.cols))
        widths.append((fn.sub(bd.right_hi, bd.right_lo), fn.sub(bd.left_hi, bd.left_lo)))
    # the mask tiles' width: the widest edge of a live group (at most rows + cols)
    width = fn.c(1)
    for g, (wr, wl) in enumerate(widths):
        width = fn.select(fn.cmp("slt", g, groups), fn.max(width, fn.max(wr, wl)), width)
    return _Groups(rows, groups, m, fn.mul(groups, m), width, bounds, k2, widths)


def _pieces_host(c: _Ctx, tier: Tier) -> _Pieces:
    fn, p = c.fn, c.p
    L = p.cols
    m_pad = fn.round_up(fn.mul(c.sq, p.group), tier.tile_rows)
    m = fn.assume_div(m_pad, tier.tile_rows)
    bd = group_bounds(fn, g=0, rows=c.sq, sq=c.sq, sk=c.sk, y=c.y, x=c.x, cols=L)
    wgs = fn.mul(fn.mul(c.b, c.hk), fn.floordiv(m_pad, tier.tile_rows))
    pieces = fn.clamp(fn.ceildiv(p.split_target, fn.max(wgs, 1)), 1, fn.min(fn.max(bd.n_cols, 1), p.max_split))
    per_cols = fn.floordiv(bd.n_cols, pieces)
    rest = fn.sub(bd.n_cols, fn.mul(per_cols, pieces))
    per = fn.assume_div(fn.mul(per_cols, L), L)
    done = fn.add(pieces, rest)
    widths = (fn.sub(bd.right_hi, bd.right_lo), fn.sub(bd.left_hi, bd.left_lo))
    return _Pieces(m, m_pad, fn.max(fn.max(widths[0], widths[1]), 1), bd, pieces, per, rest, fn.add(bd.int_lo, fn.mul(pieces, per)),
                   fn.add(done, 2), (done, fn.add(done, 1)),
                   (fn.sub(bd.right_hi, bd.right_lo), fn.sub(bd.left_hi, bd.left_lo)))


def _masked(c: _Ctx, tier: Tier, cr: _Carry, *, qp: str, lo: str, w: str, m: str, row0, where: tuple,
            outs_at: tuple[list, list, bool]) -> list[str]:
    """An edge op over keys ``[lo, lo + w)`` with mask tile ``where`` = (path, group, edge),
    reading the state rows at ``outs_at`` = (offsets, sizes, chained: else fresh) and inserted
    there."""
    fn = c.fn
    offs, sizes, chained = outs_at

    def region():
        tile = _ty(["?", "?"], "i1")
        _, g, e = where
        mv = fn.let(f"tensor.extract_slice {cr.mask}[{g}, {e}, 0, 0] [1, 1, {m}, {w}] [1, 1, 1, 1] : {MASK_TYPE} to {tile}", "ms")
        outs = (cr.state.rows(fn, offs, sizes, ("b0", "b1", "m")) if chained
                else fresh_outs(fn, [c.b, c.hk, m], ("b0", "b1", "m"), c.p.dv))
        res = _attend(c, tier, _q_rows(c, qp, row0, m), kv_operand(c, "k", lo, w), kv_operand(c, "v", lo, w), outs, 2,
                      mask=Operand(mv, tile, ("m", "k2")))
        return cr.state.insert(fn, res, offs, sizes)

    return fn.dispatch(cr.results(), region)


def _prefill(c: _Ctx, tier: Tier, h: _Groups, qp: str, cr: _Carry) -> _Carry:
    """Groups of rows: interior op, then right and left edges chained on its state."""
    fn, p = c.fn, c.p
    for g in range(p.max_groups):
        bd, k2 = h.bounds[g], h.k2[g]
        row0 = fn.mul(g, h.m)
        at = (["0", "0", "0", row0], [c.b, c.hk, "1", h.m])

        def group(g=g, bd=bd, k2=k2, row0=row0, cr=cr, at=at):
            def interior():
                res = _attend(c, tier, _q_rows(c, qp, row0, h.m), kv_operand(c, "k", bd.int_lo, k2),
                              kv_operand(c, "v", bd.int_lo, k2), fresh_outs(fn, [c.b, c.hk, h.m], ("b0", "b1", "m"), p.dv), 2)
                return cr.state.insert(fn, res, *at)

            cur = cr.with_state(fn.dispatch(cr.results(), interior))
            for e, lo in enumerate((bd.right_lo, bd.left_lo)):
                w = h.widths[g][e]
                cur = cur.with_names(fn.if_else(
                    fn.cmp("sgt", w, 0), cur.types(),
                    lambda lo=lo, w=w, cur=cur, e=e: _masked(c, tier, cur, qp=qp, lo=lo, w=w, m=h.m, row0=row0,
                                                             where=("groups", g, e), outs_at=(*at, True)),
                    lambda cur=cur: cur.names()))
            return cur.names()

        cr = cr.with_names(fn.if_else(fn.cmp("slt", g, h.groups), cr.types(), group, lambda cr=cr: cr.names()))
    return cr


def _split(c: _Ctx, tier: Tier, h: _Pieces, qp: str, cr: _Carry, tag: str) -> _Carry:
    """One group of all rows; its interior in ``P`` pieces (+ ``r`` single columns) and its two
    edges, each into its own state slot (combined by ``normalize``)."""
    fn, p = c.fn, c.p
    L, bd, m = p.cols, h.bounds, h.m
    d3 = ("b0", "b1", "b2", "m")

    def pieces_op(cr=cr):
        res = _attend(c, tier, _q_rows(c, qp, 0, m), kv_operand(c, "k", bd.int_lo, h.per, h.pieces),
                      kv_operand(c, "v", bd.int_lo, h.per, h.pieces), fresh_outs(fn, [c.b, c.hk, h.pieces, m], d3, p.dv), 3)
        return cr.state.insert(fn, res, ["0", "0", "0", "0"], [c.b, c.hk, h.pieces, m])

    cr = cr.with_state(fn.dispatch(cr.results(), pieces_op))

    def rest_op(cr=cr):
        def region():
            res = _attend(c, tier, _q_rows(c, qp, 0, m), kv_operand(c, "k", h.rest_lo, L, h.rest),
                          kv_operand(c, "v", h.rest_lo, L, h.rest), fresh_outs(fn, [c.b, c.hk, h.rest, m], d3, p.dv), 3)
            return cr.state.insert(fn, res, ["0", "0", h.pieces, "0"], [c.b, c.hk, h.rest, m])
        return fn.dispatch(cr.results(), region)

    cr = cr.with_names(fn.if_else(fn.cmp("sgt", h.rest, 0), cr.types(), rest_op, lambda cr=cr: cr.names()))
    for e, lo in enumerate((bd.right_lo, bd.left_lo)):
        w, slot = h.widths[e], h.edge_slots[e]
        at = (["0", "0", slot, "0"], [c.b, c.hk, "1", m], False)
        cr = cr.with_names(_masked(c, tier, cr, qp=qp, lo=lo, w=w, m=m, row0=0, where=(tag, 0, e), outs_at=at))
    return cr


def body(c: _Ctx):
    """Emit the whole function body; returns (out, out type, lse, lse type)."""
    fn, p = c.fn, c.p
    main = p.main
    grp, spl = _groups_host(c, main), _pieces_host(c, main)
    few = fn.andi(fn.cmp("eq", grp.groups, 1),
                  fn.cmp("slt", fn.mul(fn.mul(c.b, c.hk), fn.floordiv(spl.m_pad, main.tile_rows)), p.split_below))
    short = fn.cmp("sle", fn.mul(c.sq, p.group), p.short_rows) if p.short else None
    sho = _pieces_host(c, p.short) if p.short else None
    # the chosen path's sizes, for the tensors every path shares
    split_sizes = (spl.m_pad, spl.m, spl.width, spl.n_slots)
    if sho is not None:
        split_sizes = tuple(fn.select(short, a, b) for a, b in zip((sho.m_pad, sho.m, sho.width, sho.n_slots), split_sizes))
    any_split = few if short is None else fn.arith(f"arith.ori {short}, {few} : i1", "p")
    m_pad, m_rows, width, n_slots = (fn.select(any_split, s, g) for s, g in zip(
        split_sizes, (grp.m_pad, grp.m, grp.width, fn.c(1))))
    # every tensor defined before the first dispatch: IREE 3.13's transient emplacement places the
    # combined size of transients at the first one (a later definition then fails to dominate it)
    state = new_state(fn, [c.b, c.hk, n_slots, m_pad], p.dv)
    groups = fn.select(any_split, fn.c(1), grp.groups)
    rows = fn.select(any_split, c.sq, grp.rows)
    mask = edge_masks(fn, groups=groups, rows=rows, m_rows=m_rows, width=width, group=p.group, sq=c.sq, sk=c.sk,
                      y=c.y, x=c.x, cols=p.cols, anchor=(c.k.name, c.k.type, p.dtype))
    cr = _Carry(state, mask)
    qp = q_padded(c, "%q", m_pad)

    def main_path():
        return fn.if_else(few, cr.types(), lambda: _split(c, main, spl, qp, cr, "split").names(),
                          lambda: _prefill(c, main, grp, qp, cr).names())

    if short is None:
        names = main_path()
    else:
        names = fn.if_else(short, cr.types(), lambda: _split(c, p.short, sho, qp, cr, "short").names(), main_path)
    return normalize(fn, cr.with_names(names).state, sq=c.sq, group=p.group, dtype=p.dtype, layout=p.layout)
