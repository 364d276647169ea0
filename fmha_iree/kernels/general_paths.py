"""The two ways ``fwd`` cuts a problem (``general`` has the overview): groups of rows, each an
interior op plus masked edges chained through its state; or one group split over the keys.

Layout of the emitted function: host arithmetic for every path first (``ir.Fn``), then the
tensors all paths share (padded Q, the edge masks, empty state and slot tensors), then the
choice of path (``scf.if``) holding only explicit dispatch regions, then one normalize of the
state the chosen path yields.
"""

from __future__ import annotations

import dataclasses

from .attention import Operand, online_attention
from .bounds import Bounds, group_bounds
from .finalize import normalize
from .general import Tier, _Ctx, kv_operand, q_padded
from .ir import tensor_type as _ty
from .masks import edge_masks
from .state import State, fresh_outs, new_state

__all__ = ["body"]


@dataclasses.dataclass
class _Shared:
    """Tensors every path reads or writes (defined before the choice of path)."""

    qp: str
    mask: str
    mask_ty: str
    state: State  # [B, Hk, slots, rows]: one slot for the groups, one per piece and edge for split-KV
    m_pad: str


def _q_rows(c: _Ctx, qp: str, row0, m: str) -> Operand:
    ty = _ty(["?", "?", "?", c.p.dq], c.p.dtype)
    q = c.fn.let(f"tensor.extract_slice {qp}[0, 0, {c.fn._idx(row0)}, 0] [{c.b}, {c.hk}, {m}, {c.p.dq}] [1, 1, 1, 1] "
                 f": {ty} to {ty}", "qs")
    return Operand(q, ty, ("b0", "b1", "m", "k1"))


def _mask_slice(c: _Ctx, sh: _Shared, g: int, e: int, m: str, w: str) -> Operand:
    ty = _ty(["?", "?"], "i1")
    v = c.fn.let(f"tensor.extract_slice {sh.mask}[{g}, {e}, 0, 0] [1, 1, {m}, {w}] [1, 1, 1, 1] : {sh.mask_ty} to {ty}", "ms")
    return Operand(v, ty, ("m", "k2"))


def _attend(c: _Ctx, tier: Tier, q: Operand, k: Operand, v: Operand, outs: list[Operand], nb: int,
            mask: Operand | None = None) -> list[str]:
    return online_attention(c.fn, q=q, k=k, v=v, scale=c.scale, scale_type=c.p.dtype, outs=outs, nb=nb,
                            lowering=tier.lowering, dv=c.p.dv, mask=mask)


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


def _groups_host(c: _Ctx, tier: Tier) -> _Groups:
    fn, p = c.fn, c.p
    unlimited = fn.andi(fn.cmp("sge", c.y, c.sq), fn.cmp("sge", c.x, c.sk))
    whole = fn.round_up(c.sq, tier.tile_rows)
    capped = fn.max(fn.c(p.rows), fn.round_up(fn.ceildiv(c.sq, p.max_groups), tier.tile_rows))
    rows = fn.select(unlimited, whole, fn.min(capped, whole))
    groups = fn.ceildiv(c.sq, rows)
    m = fn.assume_div(fn.mul(rows, p.group), tier.tile_rows)
    m_pad = fn.mul(groups, m)
    bounds, k2, widths = [], [], []
    for g in range(p.max_groups):
        bd = group_bounds(fn, g=g, rows=rows, sq=c.sq, sk=c.sk, y=c.y, x=c.x, cols=p.cols)
        bounds.append(bd)
        k2.append(fn.assume_div(fn.mul(bd.n_cols, p.cols), p.cols))
        widths.append((fn.sub(bd.right_hi, bd.right_lo), fn.sub(bd.left_hi, bd.left_lo)))
    return _Groups(rows, groups, m, m_pad, fn.add(rows, p.cols), bounds, k2, widths)


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
    return _Pieces(m, m_pad, fn.add(c.sq, L), bd, pieces, per, rest, fn.add(bd.int_lo, fn.mul(pieces, per)),
                   fn.add(done, 2), (done, fn.add(done, 1)),
                   (fn.sub(bd.right_hi, bd.right_lo), fn.sub(bd.left_hi, bd.left_lo)))


def _prefill(c: _Ctx, tier: Tier, h: _Groups, sh: _Shared) -> State:
    """Groups of rows: interior op, then right and left edges chained on its state."""
    fn, p = c.fn, c.p
    state = sh.state
    for g in range(p.max_groups):
        bd, k2 = h.bounds[g], h.k2[g]
        row0 = fn.mul(g, h.m)

        def group(g=g, bd=bd, k2=k2, row0=row0, state=state):
            def interior():
                res = _attend(c, tier, _q_rows(c, sh.qp, row0, h.m), kv_operand(c, "k", bd.int_lo, k2),
                              kv_operand(c, "v", bd.int_lo, k2), fresh_outs(fn, [c.b, c.hk, h.m], ("b0", "b1", "m"), p.dv), 2)
                return state.insert(fn, res, ["0", "0", "0", row0], [c.b, c.hk, "1", h.m])

            st = state.with_names(fn.dispatch(state.region_results(), interior))
            for e, lo in enumerate((bd.right_lo, bd.left_lo)):
                w = h.widths[g][e]
                st = st.with_names(fn.if_else(
                    fn.cmp("sgt", w, 0), st.types(),
                    lambda lo=lo, w=w, st=st, e=e: _edge(c, tier, sh, st, row0, h.m, lo, w, (g, e)),
                    lambda st=st: st.names()))
            return st.names()

        state = state.with_names(fn.if_else(fn.cmp("slt", g, h.groups), state.types(), group,
                                            lambda state=state: state.names()))
    return state


def _edge(c: _Ctx, tier: Tier, sh: _Shared, st: State, row0: str, m: str, lo: str, w: str,
          where: tuple[int, int]) -> list[str]:
    def region():
        res = _attend(c, tier, _q_rows(c, sh.qp, row0, m), kv_operand(c, "k", lo, w), kv_operand(c, "v", lo, w),
                      st.rows(c.fn, ["0", "0", "0", row0], [c.b, c.hk, "1", m], ("b0", "b1", "m")), 2,
                      mask=_mask_slice(c, sh, *where, m, w))
        return st.insert(c.fn, res, ["0", "0", "0", row0], [c.b, c.hk, "1", m])

    return c.fn.dispatch(st.region_results(), region)


def _split(c: _Ctx, tier: Tier, h: _Pieces, sh: _Shared) -> State:
    """One group of all rows; its interior in ``P`` pieces (+ ``r`` single columns) and its two
    edges, each into its own state slot; slots combined into the [B, Hk, M] state."""
    fn, p = c.fn, c.p
    L, bd, m = p.cols, h.bounds, h.m
    d3, d2 = ("b0", "b1", "b2", "m"), ("b0", "b1", "m")

    def pieces_op(slots=sh.state):
        res = _attend(c, tier, _q_rows(c, sh.qp, 0, m), kv_operand(c, "k", bd.int_lo, h.per, h.pieces),
                      kv_operand(c, "v", bd.int_lo, h.per, h.pieces), fresh_outs(fn, [c.b, c.hk, h.pieces, m], d3, p.dv), 3)
        return slots.insert(fn, res, ["0", "0", "0", "0"], [c.b, c.hk, h.pieces, m])

    slots = sh.state.with_names(fn.dispatch(sh.state.region_results(), pieces_op))

    def rest_op(slots=slots):
        def region():
            res = _attend(c, tier, _q_rows(c, sh.qp, 0, m), kv_operand(c, "k", h.rest_lo, L, h.rest),
                          kv_operand(c, "v", h.rest_lo, L, h.rest), fresh_outs(fn, [c.b, c.hk, h.rest, m], d3, p.dv), 3)
            return slots.insert(fn, res, ["0", "0", h.pieces, "0"], [c.b, c.hk, h.rest, m])
        return fn.dispatch(slots.region_results(), region)

    slots = slots.with_names(fn.if_else(fn.cmp("sgt", h.rest, 0), slots.types(), rest_op,
                                        lambda slots=slots: slots.names()))
    for e, lo in enumerate((bd.right_lo, bd.left_lo)):
        w, slot = h.widths[e], h.edge_slots[e]

        def edge_op(lo=lo, w=w, slot=slot, e=e, slots=slots):
            res = _attend(c, tier, _q_rows(c, sh.qp, 0, m), kv_operand(c, "k", lo, w), kv_operand(c, "v", lo, w),
                          fresh_outs(fn, [c.b, c.hk, m], d2, p.dv), 2, mask=_mask_slice(c, sh, 0, e, m, w))
            return slots.insert(fn, res, ["0", "0", slot, "0"], [c.b, c.hk, "1", m])

        slots = slots.with_names(fn.dispatch(slots.region_results(), edge_op))
    return slots


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
    split_sizes = (spl.m_pad, fn.c(1), c.sq, spl.m, spl.width, spl.n_slots)
    if sho is not None:
        split_sizes = tuple(fn.select(short, a, b) for a, b in zip(
            (sho.m_pad, fn.c(1), c.sq, sho.m, sho.width, sho.n_slots), split_sizes))
    any_split = few if short is None else fn.arith(f"arith.ori {short}, {few} : i1", "p")
    m_pad, groups, rows, m_rows, width, n_slots = (
        fn.select(any_split, s, g) for s, g in zip(split_sizes, (grp.m_pad, grp.groups, grp.rows, grp.m, grp.width, fn.c(1))))
    qp = q_padded(c, "%q", m_pad)
    mask, mask_ty = edge_masks(fn, groups=groups, rows=rows, m_rows=m_rows, width=width, group=p.group, sq=c.sq,
                               sk=c.sk, y=c.y, x=c.x, cols=p.cols)
    state = new_state(fn, [c.b, c.hk, n_slots, m_pad], p.dv)
    sh = _Shared(qp, mask, mask_ty, state, m_pad)

    def main_path():
        return fn.if_else(few, state.types(), lambda: _split(c, main, spl, sh).names(),
                          lambda: _prefill(c, main, grp, sh).names())

    if short is None:
        names = main_path()
    else:
        names = fn.if_else(short, state.types(), lambda: _split(c, p.short, sho, sh).names(), main_path)
    return normalize(fn, state.with_names(names), sq=c.sq, group=p.group, dtype=p.dtype, layout=p.layout)
