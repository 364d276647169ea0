"""The two ways ``fwd`` cuts a problem (``general`` has the overview): groups of rows, each an
interior op plus masked edges chained through its state; or one group split over the keys.

Layout of the emitted function: host arithmetic for every path first (``ir.Fn``), then the
choice of path (an ``scf.if`` chain), each path the whole call in straight-line explicit dispatch
regions (no ``scf.if`` inside a path: IREE copies a tensor that a nested branch updates, and
allocates the copy with a host wait for the work before it). The state and the masks are
threaded through a path's ops, so IREE updates them in place.
"""

from __future__ import annotations

import dataclasses
import math

from .attention import Operand, online_attention
from .banded import Banded, as_scratch_mask, band_mask, band_tier, banded_host, banded_ops
from .bounds import Bounds, edge_window, group_bounds
from .finalize import normalize_one, normalize_slots
from .operands import Ctx, Tier, kv_copied, kv_operand, kv_padded, no_copy, q_padded
from .ir import tensor_type as _ty
from .masks import MASK_TYPE, RAGGED_MASK_TYPE, edge_masks, mask_type
from .state import State, fresh_outs, new_state
from .window_pieces import WindowPieces, window_pieces_host, window_pieces_work

__all__ = ["body"]


@dataclasses.dataclass(frozen=True)
class _Carry:
    """The state the chosen path updates, ``[B, Hk, slots, rows]`` (one slot for the groups, one
    per piece and edge for split-KV), and the edges' mask tiles (read only)."""

    state: State
    mask: str  # [groups, 2, M, W] ([B, groups, 2, M, W] ragged)

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
    windows: list[tuple[tuple[str, str], tuple[str, str]]]  # per group (right, left): (start, keys)
    any_left: str  # i1: some group has a left edge
    fits: str  # i1: every window fits the keys that can be read


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
    windows: tuple[tuple[str, str], tuple[str, str]]  # (right, left): (start, keys)
    fits: str


def _q_rows(c: Ctx, qp: str, row0, m: str) -> Operand:
    ty = _ty(["?", "?", "?", c.p.dq], c.p.dtype)
    q = c.fn.let(f"tensor.extract_slice {qp}[0, 0, {c.fn._idx(row0)}, 0] [{c.b}, {c.hk}, {m}, {c.p.dq}] [1, 1, 1, 1] "
                 f": {ty} to {ty}", "qs")
    return Operand(q, ty, ("b0", "b1", "m", "k1"))


def _attend(c: Ctx, tier: Tier, q: Operand, k: Operand, v: Operand, outs: list[Operand], nb: int,
            mask: Operand | None = None) -> list[str]:
    return online_attention(c.fn, q=q, k=k, v=v, scale=c.scale, scale_type=c.p.dtype, outs=outs, nb=nb,
                            lowering=tier.lowering, dv=c.p.dv, mask=mask, softcap=c.p.softcap)


def _window(c: Ctx, lo: str, hi: str, live: str | None = None) -> tuple[str, str]:
    """The aligned window (start, keys) of the edge ``[lo, hi)``, empty when not ``live``."""
    fn, unit = c.fn, c.p.cols
    hi = hi if live is None else fn.select(live, hi, lo)
    start, keys = edge_window(fn, lo, hi, c.limit, unit)
    return fn.bounded(start), fn.assume_div(keys, unit)


def _groups_host(c: Ctx, tier: Tier, n: int) -> _Groups:
    """Host values of ``n`` groups of ``rows = ceil(Sq / n)`` rows (rounded so that ``rows * G`` is
    a whole tile); a group past Sq is dead: empty key ranges, so its ops only (re)write padding
    rows."""
    fn, p = c.fn, c.p
    unit = tier.tile_rows // math.gcd(tier.tile_rows, p.group)
    rows = fn.max(fn.round_up(fn.ceildiv(c.sq, n), unit), unit)
    m = fn.assume_div(fn.mul(rows, p.group), tier.tile_rows)
    bounds, k2, windows = [], [], []
    width, any_left = fn.c(p.cols), fn.cmp("slt", fn.c(1), fn.c(0))
    for g in range(n):
        live = fn.cmp("slt", fn.mul(g, rows), c.sq)
        bd = group_bounds(fn, g=g, rows=rows, sq=c.sq, sk=c.sk, co=c.co, cols=p.cols)
        bd = dataclasses.replace(bd, int_lo=fn.bounded(bd.int_lo))  # a key index: one 32-bit push constant
        bounds.append(bd)
        k2.append(fn.assume_div(fn.mul(fn.select(live, bd.n_cols, 0), p.cols), p.cols))
        wr, wl = _window(c, bd.right_lo, bd.right_hi, live), _window(c, bd.left_lo, bd.left_hi, live)
        windows.append((wr, wl))
        width = fn.max(width, fn.max(wr[1], wl[1]))
        any_left = fn.arith(f"arith.ori {any_left}, {fn.cmp('sgt', wl[1], 0)} : i1", "p")
    fits = fn.cmp("sle", width, c.limit)  # the widest window, so every one
    width = fn.assume_div(width, p.cols)
    return _Groups(rows, fn.opaque(n), m, fn.assume_div(fn.mul(m, n), tier.tile_rows), width, bounds, k2, windows, any_left, fits)


def _pieces_host(c: Ctx, tier: Tier) -> _Pieces:
    fn, p = c.fn, c.p
    L = p.cols
    m_pad = fn.assume_div(fn.round_up(fn.mul(c.sq, p.group), tier.tile_rows), tier.tile_rows)
    m = m_pad
    bd = group_bounds(fn, g=0, rows=c.sq, sq=c.sq, sk=c.sk, co=c.co, cols=L)
    bd = dataclasses.replace(bd, int_lo=fn.bounded(bd.int_lo))
    wgs = fn.mul(fn.mul(c.b, c.hk), fn.floordiv(m_pad, tier.tile_rows))
    pieces = fn.clamp(fn.ceildiv(p.split_target, fn.max(wgs, 1)), 1, fn.min(fn.max(bd.n_cols, 1), p.max_split))
    per_cols = fn.floordiv(bd.n_cols, pieces)
    rest = fn.sub(bd.n_cols, fn.mul(per_cols, pieces))
    per = fn.assume_div(fn.mul(per_cols, L), L)
    done = fn.add(pieces, rest)
    wr, wl = _window(c, bd.right_lo, bd.right_hi), _window(c, bd.left_lo, bd.left_hi)
    width = fn.max(fn.max(wr[1], wl[1]), L)
    fits = fn.cmp("sle", width, c.limit)
    return _Pieces(m, m_pad, fn.assume_div(width, L), bd, pieces, per, rest, fn.bounded(fn.add(bd.int_lo, fn.mul(pieces, per))),
                   fn.add(done, 2), (done, fn.add(done, 1)), (wr, wl), fits)


def _masked(c: Ctx, tier: Tier, cr: _Carry, *, qp: str, lo: str, w: str, m: str, row0, where: tuple,
            outs_at: tuple[list, list, bool]) -> list[str]:
    """An edge op over the window ``[lo, lo + w)`` with mask tile ``where`` = (path, group, edge),
    reading the state rows at ``outs_at`` = (offsets, sizes, chained: else fresh) and inserted
    there."""
    fn = c.fn
    offs, sizes, chained = outs_at

    def region():
        _, g, e = where
        if c.desc is None:
            tile, dims = _ty(["?", "?"], "i1"), ("m", "k2")
            mv = fn.let(f"tensor.extract_slice {cr.mask}[{g}, {e}, 0, 0] [1, 1, {m}, {w}] [1, 1, 1, 1] "
                        f": {MASK_TYPE} to {tile}", "ms")
        else:  # each batch its own tile
            tile, dims = _ty(["?", "?", "?"], "i1"), ("b0", "m", "k2")
            mv = fn.let(f"tensor.extract_slice {cr.mask}[0, {g}, {e}, 0, 0] [{c.b}, 1, 1, {m}, {w}] [1, 1, 1, 1, 1] "
                        f": {RAGGED_MASK_TYPE} to {tile}", "ms")
        outs = (cr.state.rows(fn, offs, sizes, ("b0", "b1", "m")) if chained
                else fresh_outs(fn, [c.b, c.hk, m], ("b0", "b1", "m"), c.p.dv))
        res = _attend(c, tier, _q_rows(c, qp, row0, m), kv_operand(c, "k", lo, w), kv_operand(c, "v", lo, w), outs, 2,
                      mask=Operand(mv, tile, dims))
        return cr.state.insert(fn, res, offs, sizes)

    return fn.dispatch(cr.results(), region)


def _prefill(c: Ctx, tier: Tier, h: _Groups, qp: str, cr: _Carry, left: bool) -> _Carry:
    """All groups of ``h``, straight-line (one execution region: the host chose this variant
    before): per group the interior op, then its right edge (and with ``left`` its left edge)
    chained on its state. Dead groups and empty edges run as empty ops."""
    fn, p = c.fn, c.p
    for g, (bd, k2) in enumerate(zip(h.bounds, h.k2)):
        row0 = fn.bounded(fn.mul(fn.opaque(g), h.m))
        # a ragged frame ordered longest first: only its leading entries have rows in this group
        cg = c if c.frame is None else dataclasses.replace(c, b=c.frame.entries(c, bd.first))
        at = (["0", "0", "0", row0], [cg.b, c.hk, "1", h.m])

        def interior(bd=bd, k2=k2, row0=row0, cr=cr, at=at, cg=cg):
            res = _attend(cg, tier, _q_rows(cg, qp, row0, h.m), kv_operand(cg, "k", bd.int_lo, k2),
                          kv_operand(cg, "v", bd.int_lo, k2), fresh_outs(fn, [cg.b, c.hk, h.m], ("b0", "b1", "m"), p.dv), 2)
            return cr.state.insert(fn, res, *at)

        cr = cr.with_state(fn.dispatch(cr.results(), interior))
        for e, (lo, w) in enumerate(h.windows[g][:2 if left else 1]):
            cr = cr.with_names(_masked(cg, tier, cr, qp=qp, lo=lo, w=w, m=h.m, row0=row0,
                                       where=("groups", fn.opaque(g), e), outs_at=(*at, True)))
    return cr


def _split(c: Ctx, tier: Tier, h: _Pieces, qp: str, cr: _Carry, tag: str, rest: bool) -> _Carry:
    """One group of all rows; its interior in ``P`` pieces (with ``rest``: + ``r`` > 0 single
    columns) and its two edges, each into its own state slot (combined by ``normalize_slots``)."""
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

    if rest:
        cr = cr.with_names(rest_op())
    for e, (lo, w) in enumerate(h.windows):
        slot = h.edge_slots[e]
        at = (["0", "0", slot, "0"], [c.b, c.hk, "1", m], False)
        cr = cr.with_names(_masked(c, tier, cr, qp=qp, lo=lo, w=w, m=m, row0=0, where=(tag, 0, e), outs_at=at))
    return cr


_VARIANTS = (1, 2, 4, 8, 16)


def body(c: Ctx) -> list[tuple[str, str]]:
    """Emit the whole function body; returns its results as (name, type): out, lse, then the
    scratch tensors (``scratch_types``)."""
    fn, p = c.fn, c.p
    main = p.main
    variants = [n for n in _VARIANTS if n <= p.max_groups]
    grps = {n: _groups_host(c, main, n) for n in variants}
    spl = _pieces_host(c, main)
    # the group count: groups of at least p.rows state rows (rows * G), and enough that one
    # group's op fills the GPU (B * Hk * rows * G / tile_rows >= fill_wgs); a single group when
    # no row is limited
    unlimited = fn.andi(fn.cmp("sge", c.co.y, c.sq), fn.cmp("sge", c.co.x, c.sk))
    fill = fn.ceildiv(fn.c(p.fill_wgs * main.tile_rows), fn.mul(fn.mul(c.b, c.hk), p.group))
    target = fn.max(fn.c(-(-p.rows // p.group)), fill)
    need = fn.select(unlimited, fn.c(1), fn.ceildiv(c.sq, target))
    few = fn.andi(fn.cmp("eq", need, 1),
                  fn.cmp("slt", fn.mul(fn.mul(c.b, c.hk), fn.floordiv(spl.m_pad, main.tile_rows)), p.split_below))
    # (condition, path) in order, the last one unconditional; a path whose edge windows do not
    # fit the keys (an edge spanning nearly all of a short Sk) yields to the next one, and the
    # last runs one group over zero-padded copies of K and V
    paths = []
    if c.desc is not None:  # a ragged frame: its sequences' union of keys, masked, in pieces
        paths += _window_paths(c, few)
    if p.short:
        sho = _pieces_host(c, p.short)
        short = fn.andi(fn.cmp("sle", fn.mul(c.sq, p.group), p.short_rows), sho.fits)
        paths += [(fn.andi(short, fn.cmp("sgt", sho.rest, 0)), lambda: _split_path(c, p.short, sho, "short", True)),
                  (short, lambda: _split_path(c, p.short, sho, "short", False))]
    few = fn.andi(few, spl.fits)
    paths += [(fn.andi(few, fn.cmp("sgt", spl.rest, 0)), lambda: _split_path(c, main, spl, "split", True)),
              (few, lambda: _split_path(c, main, spl, "split", False))]
    band = band_tier(main)
    bnd = banded_host(c, band)
    if bnd is not None:  # a narrow band of keys per row: all groups in one op per slot range
        cp = _to_pages(c)
        bpad = banded_host(cp, band, padded=True)  # (keys to whole pages: over copies)
        paths += [(bnd.on, lambda: _banded_path(c, band, bnd)), (bpad.on, lambda: _banded_path(cp, band, bpad))]
    for k, n in enumerate(variants):
        h = grps[n]
        cond = fn.andi(fn.cmp("sle", need, n), h.fits) if k < len(variants) - 1 else h.fits
        paths += [(fn.andi(cond, h.any_left), lambda h=h: _groups_path(c, main, h, True)),
                  (cond, lambda h=h: _groups_path(c, main, h, False))]
    padded = _to_pages(c)
    one = _groups_host(padded, main, 1)
    paths += [(one.any_left, lambda: _padded_path(padded, main, one, True)),
              (None, lambda: _padded_path(padded, main, one, False))]
    o_ty, l_ty = _ty(["?", "?", "?", p.arg_dims[1]], p.dtype), _ty(["?", "?", "?"], "f32")
    kv_copies = [_ty(["?", "?", "?", d], p.dtype) for d in (p.dq, p.dv)] if p.kv_slots else []
    types = [o_ty, l_ty, *(c.frame.types() if c.frame is not None else kv_copies), *scratch_types(p)]

    def chain(i: int):
        cond, run = paths[i]
        if cond is None:
            return run()
        return fn.if_else(cond, types, run, lambda: chain(i + 1))

    names = chain(0)
    return list(zip(names, types))


def _to_pages(c: Ctx) -> Ctx:
    """``c`` with ``limit`` at Sk rounded up to whole ``Plan.cols`` columns (the keys of the
    padded copies that the banded and padded paths read)."""
    return dataclasses.replace(c, limit=c.fn.assume_div(c.fn.round_up(c.sk, c.p.cols), c.p.cols))


def _window_paths(c: Ctx, few: str) -> list:
    """(condition, path) of a ragged frame's split-KV (``window_pieces``): short queries on the
    short tier, a frame of too few workgroups on the main tier."""
    fn, p = c.fn, c.p
    paths = []
    if p.short:
        sho = window_pieces_host(c, p.short)
        short = fn.andi(fn.cmp("sle", fn.mul(c.sq, p.group), p.short_rows), sho.fits)
        paths.append((short, lambda: _window_path(c, p.short, sho)))
    spl = window_pieces_host(c, p.main)
    paths.append((fn.andi(few, spl.fits), lambda: _window_path(c, p.main, spl)))
    return paths


def _window_path(c: Ctx, tier: Tier, h: WindowPieces) -> list[str]:
    c, entered = _entered(c)
    return _finish(c, entered, window_pieces_work(c, tier, h))


def scratch_types(p) -> list[str]:
    """Types of the tensors a path works in, returned after ``out`` and ``lse``: padded Q, the
    edge masks, the state (acc, max, sum)."""
    st = State("", "", "", ("", "", "", ""), p.dv)
    return [_ty(["?", "?", "?", p.dq], p.dtype), mask_type(p.ragged), *st.types()]


def _entered(c: Ctx) -> tuple[Ctx, object]:
    """``c`` with its inputs made inside the path (a ragged frame's gathers, ``Ctx.frame``; K and
    V copied zero-padded to the plan's head dims, ``Plan.pads``), and what ``_finish`` needs of
    them."""
    if c.frame is not None:
        return c.frame.enter(c)
    if not c.p.pads:
        return c, None
    k, v = kv_padded(c, "k"), kv_padded(c, "v")
    return dataclasses.replace(c, k=k, v=v, held=(c.p.dq, c.p.dv)), (k.name, v.name)


def _finish(c: Ctx, entered, results: list[str]) -> list[str]:
    """A path's results; a ragged frame's gathered out (``Ctx.frame``); the padded K / V copies
    after out and lse (returned, not transients: IREE 3.13's CUDA HAL frees a transient with a
    host wait for the call's last kernel), empty where the path made none (``Plan.kv_slots``)."""
    if c.frame is not None:
        return c.frame.leave(c, entered, results)
    if entered is None and c.p.kv_slots:
        entered = [no_copy(c.fn, d, c.p.dtype) for d in (c.p.dq, c.p.dv)]
    return results if entered is None else [*results[:2], *entered, *results[2:]]


def _groups_path(c: Ctx, tier: Tier, h: _Groups, left: bool) -> list[str]:
    """The whole call as ``h``'s groups of rows: Q copy, edge masks, ops, normalize (each path
    defines its own tensors, so a call's work is one execution region whose allocations wait on
    nothing but the call's inputs)."""
    c, entered = _entered(c)
    return _finish(c, entered, _groups_work(c, tier, h, left))


def _groups_work(c: Ctx, tier: Tier, h: _Groups, left: bool) -> list[str]:
    fn, p = c.fn, c.p
    mask = edge_masks(c, groups=h.groups, rows=h.rows, m_rows=h.m, width=h.width, row_unit=tier.tile_rows)
    qp = q_padded(c, c.q, h.m_pad)
    cr = _prefill(c, tier, h, qp, _Carry(new_state(fn, [c.b, c.hk, fn.opaque(1), h.m_pad], p.dv), mask), left)
    out, _, lse, _ = normalize_one(fn, cr.state, sq=c.sq, group=p.group, dtype=p.dtype, layout=p.layout,
                                  lowering=tier.lowering, dv_out=p.arg_dims[1])
    return [out, lse, qp, mask, *cr.state.names()]


def _padded_path(c: Ctx, tier: Tier, h: _Groups, left: bool) -> list[str]:
    """``_groups_path`` over copies of K and V zero-padded to ``c.limit`` keys (so that every edge
    window can be read); the copies are returned where the plan has ``kv_slots``, else they are
    transients of this path."""
    c, entered = kv_copied(*_entered(c))
    return _finish(c, entered, _groups_work(c, tier, h, left))


def _banded_path(c: Ctx, tier: Tier, h: Banded) -> list[str]:
    """The whole call as ``kernels.banded``'s ops over the groups' key pages (over copies of K and
    V where ``c.limit`` is more than Sk)."""
    c, entered = _entered(c)
    if h.padded:
        c, entered = kv_copied(c, entered)
    fn, p = c.fn, c.p
    mask = band_mask(c, h)
    qp = q_padded(c, c.q, h.m_pad)
    st = banded_ops(c, tier, h, new_state(fn, [c.b, c.hk, fn.opaque(1), h.m_pad], p.dv), qp, mask)
    out, _, lse, _ = normalize_one(fn, st, sq=c.sq, group=p.group, dtype=p.dtype, layout=p.layout,
                                  lowering=tier.lowering, dv_out=p.arg_dims[1])
    return _finish(c, entered, [out, lse, qp, as_scratch_mask(c, h, mask), *st.names()])


def _split_path(c: Ctx, tier: Tier, h: _Pieces, tag: str, rest: bool) -> list[str]:
    """The whole call as one group split over the keys (``_split``), slots combined at the end."""
    c, entered = _entered(c)
    fn, p = c.fn, c.p
    mask = edge_masks(c, groups=fn.opaque(1), rows=c.sq, m_rows=h.m, width=h.width, row_unit=tier.tile_rows)
    qp = q_padded(c, c.q, h.m_pad)
    cr = _split(c, tier, h, qp, _Carry(new_state(fn, [c.b, c.hk, h.n_slots, h.m_pad], p.dv), mask), tag, rest)
    out, _, lse, _ = normalize_slots(fn, cr.state, sq=c.sq, group=p.group, dtype=p.dtype, layout=p.layout,
                                     dv_out=p.arg_dims[1])
    return _finish(c, entered, [out, lse, qp, mask, *cr.state.names()])
