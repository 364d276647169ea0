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
    any_left: str  # i1: some group has a left edge


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


def _groups_host(c: _Ctx, tier: Tier, n: int) -> _Groups:
    """Host values of ``n`` groups of ``rows = ceil(Sq / n)`` rows (rounded to the tile); a group
    past Sq is dead: empty key ranges, so its ops only (re)write padding rows."""
    fn, p = c.fn, c.p
    rows = fn.max(fn.round_up(fn.ceildiv(c.sq, n), tier.tile_rows), tier.tile_rows)
    m = fn.assume_div(fn.mul(rows, p.group), tier.tile_rows)
    bounds, k2, widths = [], [], []
    width, any_left = fn.c(1), fn.cmp("slt", fn.c(1), fn.c(0))
    for g in range(n):
        live = fn.cmp("slt", fn.mul(g, rows), c.sq)
        bd = group_bounds(fn, g=g, rows=rows, sq=c.sq, sk=c.sk, y=c.y, x=c.x, cols=p.cols)
        bounds.append(bd)
        k2.append(fn.assume_div(fn.mul(fn.select(live, bd.n_cols, 0), p.cols), p.cols))
        wr = fn.select(live, fn.sub(bd.right_hi, bd.right_lo), 0)
        wl = fn.select(live, fn.sub(bd.left_hi, bd.left_lo), 0)
        widths.append((wr, wl))
        width = fn.max(width, fn.max(wr, wl))
        any_left = fn.arith(f"arith.ori {any_left}, {fn.cmp('sgt', wl, 0)} : i1", "p")
    return _Groups(rows, fn.c(n), m, fn.mul(m, n), width, bounds, k2, widths, any_left)


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


def _prefill(c: _Ctx, tier: Tier, h: _Groups, qp: str, cr: _Carry, left: bool) -> _Carry:
    """All groups of ``h``, straight-line (one execution region: the host chose this variant
    before): per group the interior op, then its right edge (and with ``left`` its left edge)
    chained on its state. Dead groups and empty edges run as empty ops."""
    fn, p = c.fn, c.p
    for g, (bd, k2) in enumerate(zip(h.bounds, h.k2)):
        row0 = fn.mul(fn.opaque(g), h.m)
        at = (["0", "0", "0", row0], [c.b, c.hk, "1", h.m])

        def interior(bd=bd, k2=k2, row0=row0, cr=cr, at=at):
            res = _attend(c, tier, _q_rows(c, qp, row0, h.m), kv_operand(c, "k", bd.int_lo, k2),
                          kv_operand(c, "v", bd.int_lo, k2), fresh_outs(fn, [c.b, c.hk, h.m], ("b0", "b1", "m"), p.dv), 2)
            return cr.state.insert(fn, res, *at)

        cr = cr.with_state(fn.dispatch(cr.results(), interior))
        for e, lo in enumerate((bd.right_lo, bd.left_lo)[:2 if left else 1]):
            cr = cr.with_names(_masked(c, tier, cr, qp=qp, lo=lo, w=h.widths[g][e], m=h.m, row0=row0,
                                       where=("groups", fn.opaque(g), e), outs_at=(*at, True)))
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


_VARIANTS = (1, 2, 4, 8, 16)


def body(c: _Ctx):
    """Emit the whole function body; returns (out, out type, lse, lse type)."""
    fn, p = c.fn, c.p
    main = p.main
    variants = [n for n in _VARIANTS if n <= p.max_groups]
    grps = {n: _groups_host(c, main, n) for n in variants}
    spl = _pieces_host(c, main)
    # the group count: rows of at least p.rows, and enough that one group's op fills the GPU
    # (B * Hk * rows * G / tile_rows >= fill_wgs); a single group when no row is limited
    unlimited = fn.andi(fn.cmp("sge", c.y, c.sq), fn.cmp("sge", c.x, c.sk))
    fill = fn.ceildiv(fn.c(p.fill_wgs * main.tile_rows), fn.mul(fn.mul(c.b, c.hk), p.group))
    target = fn.max(fn.c(p.rows), fill)
    need = fn.select(unlimited, fn.c(1), fn.ceildiv(c.sq, target))
    picks = [fn.cmp("sle", need, n) for n in variants[:-1]]  # variant k when need <= n_k (first such)

    def pick(values):
        """The chosen variant's value among ``values`` (one per variant)."""
        out = values[-1]
        for cond, v in zip(reversed(picks), reversed(values[:-1])):
            out = fn.select(cond, v, out)
        return out

    g_m_pad, g_m, g_width, g_rows = (pick([getattr(grps[n], a) for n in variants]) for a in ("m_pad", "m", "width", "rows"))
    g_groups = pick([fn.c(n) for n in variants])
    few = fn.andi(fn.cmp("eq", need, 1),
                  fn.cmp("slt", fn.mul(fn.mul(c.b, c.hk), fn.floordiv(spl.m_pad, main.tile_rows)), p.split_below))
    short = fn.cmp("sle", fn.mul(c.sq, p.group), p.short_rows) if p.short else None
    sho = _pieces_host(c, p.short) if p.short else None
    # the chosen path's sizes, for the tensors every path shares
    split_sizes = (spl.m_pad, spl.m, spl.width, spl.n_slots)
    if sho is not None:
        split_sizes = tuple(fn.select(short, a, b) for a, b in zip((sho.m_pad, sho.m, sho.width, sho.n_slots), split_sizes))
    any_split = few if short is None else fn.arith(f"arith.ori {short}, {few} : i1", "p")
    m_pad, m_rows, width, n_slots = (fn.select(any_split, s_, g_) for s_, g_ in zip(
        split_sizes, (g_m_pad, g_m, g_width, fn.c(1))))
    # every tensor defined before the first dispatch: IREE 3.13's transient emplacement places the
    # combined size of transients at the first one (a later definition then fails to dominate it)
    state = new_state(fn, [c.b, c.hk, n_slots, m_pad], p.dv)
    groups = fn.select(any_split, fn.c(1), g_groups)
    rows = fn.select(any_split, c.sq, g_rows)
    mask = edge_masks(fn, groups=groups, rows=rows, m_rows=m_rows, width=width, group=p.group, sq=c.sq, sk=c.sk,
                      y=c.y, x=c.x, cols=p.cols, anchor=(c.k.name, c.k.type, p.dtype))
    cr = _Carry(state, mask)
    qp = q_padded(c, "%q", m_pad)

    def groups_path(k: int):
        n = variants[k]
        h = grps[n]
        run = lambda: fn.if_else(h.any_left, cr.types(), lambda: _prefill(c, main, h, qp, cr, True).names(),  # noqa: E731
                                 lambda: _prefill(c, main, h, qp, cr, False).names())
        if k == len(variants) - 1:
            return run()
        return fn.if_else(picks[k], cr.types(), run, lambda: groups_path(k + 1))

    def main_path():
        return fn.if_else(few, cr.types(), lambda: _split(c, main, spl, qp, cr, "split").names(),
                          lambda: groups_path(0))

    if short is None:
        names = main_path()
    else:
        names = fn.if_else(short, cr.types(), lambda: _split(c, p.short, sho, qp, cr, "short").names(), main_path)
    return normalize(fn, cr.with_names(names).state, sq=c.sq, group=p.group, dtype=p.dtype, layout=p.layout)
