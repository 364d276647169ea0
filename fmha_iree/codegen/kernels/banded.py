"""A sliding window in pages: every group of query rows over the key pages its band holds, all
groups in one op (``fwd``'s banded path).

When each row sees a narrow band of keys (CK's windows ``(y, x)`` with both sides limited) the
groups' ops of ``general_paths`` are short (a band of ``y + x`` keys) and few workgroups each, and
a group's edges cost more than its interior. Here the rows are cut in groups of ``R`` positions
(``R * G`` state rows, a whole number of workgroup tiles and of pages) and K / V in pages of ``P``
keys (``Plan.cols``), read in place: ``[B * Hk * NP, P, D]`` (bhsd) or ``[B * NP, P, Hk, D]``
(bshd), ``NP = Sk / P``. Group ``g`` (rows ``a = g * R .. a + R - 1``) looks at the pages
``g * R / P + c0 + r`` for ``r < n``, ``c0 = floor((1 - y) / P)``: the same band relative to
the group for every group, so one op over all groups (a batch dim) gathers each group's pages by
number inside its dispatch (``iree_linalg_ext.gather``, one page a step: the op has two key dims,
slot and key). The band's pages ``[i0, i1)`` are its interior, pages every row of the group sees;
the rest are its edges.

Six ops write the state, each over a range of groups and of slots:

* the groups whose band starts at a page ``>= 0`` and whose interior lies in the whole pages of Sk
  (edge pages past the keys are clamped and masked): the interior slots unmasked, then the edge
  slots (both sides, one range: ``_page`` orders the slots interior first) masked, chained on the
  state;
* the groups after them (their interior ends past the whole pages of Sk), and the few before them
  whose band is cut by key 0 inside its left edge: all slots masked, with page numbers clamped
  into range (a clamped slot is masked whole);
* the first ``gf`` groups, whose band is cut by key 0 before its interior: a triangle (group ``g``
  sees pages ``[0, g * R / P + c0 + n)``, all of them whole but its last ones). Its lower half
  ``[0, gh)`` runs masked over pages ``[0, nm)``; its upper half ``[gh, gf)`` sees pages ``[0, nb)``
  whole (one unmasked op) and the rest masked over ``[nb, nb + nm)`` (``_lead_page``), in the
  lower half's op. (These groups ran every slot masked; the triangle measured faster on the H200:
  docs/BENCHMARKS.md, "Sliding windows: the first groups' triangle, and any Sk".)

The masks of all ops are one tensor ``[groups + 1, M, n, P]`` (row ``m`` of group ``g`` against key
``j`` of slot ``s``: CK's rule at the slot's own page, nothing outside ``[0, Sk)`` or past Sq),
made by one dispatch. Where ``Sk`` is no multiple of ``P`` the path reads copies of K / V padded
to whole pages (``kv_padded``: keys past Sk masked), returned with the call's scratch.
"""

from __future__ import annotations

import dataclasses

from .attention import Operand, online_attention
from .bounds import row_hi, row_lo
from .elementwise import block_attrs
from .ir import parallel, tensor_type
from .masks import MASK_TYPE
from .operands import Ctx, Tier
from .packed_common import generic
from .state import State, fresh_outs

__all__ = ["Banded", "banded_host", "banded_ops", "band_rows", "band_tier", "band_mask", "as_scratch_mask"]


# Workgroup rows of the banded ops on GPUs (0: the plan's main tier). 128 rows (edges half as wide)
# measured faster than the main tier's 256 on the H200 (docs/tried.md, "H200: the banded window
# path's first cuts"); 64 slowed the interior more than it saved ("the banded path with 64-row groups").
BAND_TILE_ROWS = 128


def band_tier(main: Tier, rows: int = BAND_TILE_ROWS) -> Tier:
    """The tier of the banded ops: the main tier, or its GPU lowering cut to ``rows`` workgroup
    rows (as many rows per subgroup, fewer subgroups)."""
    lw = main.lowering
    if not rows or not isinstance(lw, dict) or lw.get("backend") == "cpu" or main.tile_rows <= rows:
        return main
    cut = main.tile_rows // rows
    sgm = int(lw.get("subgroups_m", 4))
    if sgm % cut:
        return main
    wg = int(lw.get("workgroup_size", int(lw.get("subgroup_size", 64)) * sgm))
    return Tier({**lw, "workgroup_m": rows, "subgroups_m": sgm // cut, "workgroup_size": wg // cut}, rows)


def band_rows(tile_rows: int, group: int, page: int) -> int:
    """Positions per group: a whole number of workgroup tiles (``R * G``) and of pages."""
    return max(tile_rows // group, page) if tile_rows % group == 0 else 0


@dataclasses.dataclass(frozen=True)
class Banded:
    """Host values (SSA names) of the path; ``rows`` (R), ``page`` (P) and ``m`` (R * G) static."""

    rows: int
    page: int
    m: int
    groups: str  # ceil(Sq / R)
    m_pad: str  # (groups + 1) * M: the groups and a spare one (``_op``)
    np: str  # Sk / P
    c0: str  # the first slot's page, relative to g * R / P
    n: str  # slots per group
    i0: str  # the interior: pages [i0, i1) of the band (relative to its first page)
    i1: str
    g_lo: str  # groups [g_lo, g_hi) have their band inside [0, ...) and their interior in range
    g_hi: str
    on: str  # i1: the path applies and pays
    gf: str  # groups [0, gf) have no left edge in range (their band cut by key 0 before i0)
    gh: str  # gf // 2: groups [gh, gf) see pages [0, nb) whole
    nb: str
    nm: str  # the masked slots of groups [0, gf) (``_lead_page``)
    padded: bool = False  # over copies of K / V padded to whole pages (``banded_host``)


def banded_host(c: Ctx, tier: Tier, padded: bool = False) -> Banded | None:
    """The path's host values, or None where the plan cannot take it (off in the plan, a ragged
    frame, a group count of rows that is no whole tile). ``padded``: over copies of K / V of
    ``c.limit`` keys (Sk rounded up to whole pages), for an Sk that is no multiple of ``P``. (The
    last, partial page is never interior: a band's last slot is always an edge, masked.)"""
    fn, p = c.fn, c.p
    P = p.cols
    R = band_rows(tier.tile_rows, p.group, P)
    if not p.banded or c.desc is not None or c.frame is not None or not R:
        return None
    co = c.co
    groups = fn.bounded(fn.ceildiv(c.sq, R))
    c0 = fn.floordiv(fn.sub(1, co.y), P)
    c1 = fn.floordiv(fn.add(co.x, R - 2), P)
    n = fn.max(fn.add(fn.sub(c1, c0), 1), 0)
    i0 = fn.clamp(fn.sub(fn.ceildiv(fn.sub(R, co.y), P), c0), 0, n)
    i1 = fn.clamp(fn.sub(fn.floordiv(co.x, P), c0), i0, n)
    inside = fn.bounded(fn.floordiv(c.sk, P))  # pages all of whose keys are below Sk
    np_ = fn.bounded(fn.floordiv(c.limit, P)) if padded else inside
    per = R // P
    g_lo = fn.clamp(fn.ceildiv(fn.sub(0, c0), per), 0, groups)
    # groups [g_lo, g_hi) have their interior inside the whole pages (edge slots past them are
    # clamped and masked); the groups after them run all masked
    g_hi = fn.clamp(fn.add(fn.floordiv(fn.sub(inside, fn.add(c0, i1)), per), 1), g_lo, groups)
    # this variant's keys: Sk a multiple of P (read in place), or not (over copies)
    keys = fn.cmp("eq" if not padded else "ne", fn.mul(inside, P), c.sk)
    # pays: a band of at most half the keys, and workgroups for two waves of the GPU in one op
    narrow = fn.cmp("sle", fn.mul(fn.mul(n, P), 2), c.sk)
    wgs = fn.mul(fn.mul(fn.mul(c.b, c.hk), groups), R * p.group // tier.tile_rows)
    fill = fn.andi(fn.cmp("sge", wgs, 2 * p.fill_wgs), fn.cmp("sgt", n, 0))
    on = fn.andi(fn.andi(keys, narrow), fill)
    m_pad = fn.assume_div(fn.mul(fn.add(groups, 1), R * p.group), tier.tile_rows)  # + the spare group
    gf = fn.clamp(fn.add(fn.floordiv(fn.sub(0, fn.add(c0, i0)), per), 1), 0, g_lo)
    gh = fn.floordiv(gf, 2)
    nb = fn.clamp(fn.add(fn.mul(gh, per), fn.add(c0, i1)), 0, n)
    end_lo = fn.add(fn.mul(fn.sub(gh, 1), per), fn.add(c0, n))  # the band end of group gh - 1
    end_hi = fn.sub(fn.add(fn.mul(fn.sub(gf, 1), per), fn.add(c0, n)), nb)  # of group gf - 1, past nb
    nm = fn.clamp(fn.max(end_lo, end_hi), 0, n)
    return Banded(R, P, R * p.group, groups, m_pad, np_, c0, n, i0, i1, g_lo, g_hi, on, gf, gh, nb, nm, padded)


def _page(fn, h: Banded, g: str, t: str) -> str:
    """The page of slot ``t`` of group ``g``. Slots are ordered interior first, then the edges (so
    the edges are one range): slot ``t < i1 - i0`` is the band's page ``i0 + t``, the next ``i0``
    its first pages, the rest its pages from ``i1`` on."""
    ni = fn.sub(h.i1, h.i0)
    rel = fn.select(fn.cmp("slt", t, ni), fn.add(h.i0, t), fn.select(fn.cmp("slt", t, h.i1), fn.sub(t, ni), t))
    return fn.add(fn.add(fn.mul(g, h.rows // h.page), h.c0), rel)


def _lead_page(fn, h: Banded, g: str, t: str) -> str:
    """The page of slot ``t`` of group ``g < gf`` in its masked op: page ``t`` for ``g < gh``,
    ``nb + t`` for the rest (their pages below ``nb`` run unmasked)."""
    return fn.add(t, fn.select(fn.cmp("sge", g, h.gh), h.nb, 0))


def _mapped_page(fn, h: Banded, g: str, t: str) -> str:
    """The page of slot ``t`` of group ``g`` in the masked ops and the mask: ``_lead_page`` for
    the groups whose band starts before key 0 with no left edge, ``_page`` for the others."""
    return fn.select(fn.cmp("slt", g, h.gf), _lead_page(fn, h, g, t), _page(fn, h, g, t))


def band_mask(c: Ctx, h: Banded) -> str:
    """``[groups + 1, M, n, P]`` i1: whether row ``m`` of group ``g`` sees key ``j`` of slot ``s``."""
    fn, G = c.fn, c.p.group
    ty = tensor_type(["?", h.m, "?", h.page], "i1")

    def element(ix):
        g, m, s, j = ix
        pos = fn.add(fn.mul(g, h.rows), fn.floordiv(m, G))
        pg = _mapped_page(fn, h, g, s)
        key = fn.add(fn.mul(pg, h.page), j)
        ok = fn.andi(fn.cmp("slt", pos, c.sq), fn.andi(fn.cmp("sge", pg, 0), fn.cmp("slt", pg, h.np)))
        return fn.andi(ok, fn.andi(fn.cmp("sge", key, row_lo(fn, pos, c.co.y, c.sk)),
                                   fn.cmp("slt", key, row_hi(fn, pos, c.co.x, c.sk))))

    # CUDA: blocks of 16 rows x one page per workgroup, 16 bytes per thread (as masks.py's
    # generators); IREE's own lowering was several times slower on the H200 (docs/BENCHMARKS.md,
    # "Sliding windows in pages: `kernels.banded`")
    attrs = block_attrs(c.p.main.lowering, rank=4, block=(16, 1, h.page), vec=16) if c.p.mask_blocks else ""
    return generic(fn, ty, [fn.add(h.groups, 1), h.n], 4, element, attrs)


def as_scratch_mask(c: Ctx, h: Banded, mask: str) -> str:
    """The mask as the paths' scratch type (``masks.MASK_TYPE``): ``[groups, 2, M / 2, n * P]``."""
    fn = c.fn
    m4 = tensor_type(["?", h.m, "?", h.page], "i1")
    m3 = tensor_type(["?", h.m, "?"], "i1")
    m4b = tensor_type(["?", 2, h.m // 2, "?"], "i1")
    flat = fn.let(f"tensor.collapse_shape {mask} [[0], [1], [2, 3]] : {m4} into {m3}", "bm")
    ex = fn.let(f"tensor.expand_shape {flat} [[0], [1, 2], [3]] output_shape [{fn.add(h.groups, 1)}, 2, {h.m // 2}, "
                f"{fn.mul(h.n, h.page)}] : {m3} into {m4b}", "bm")
    return fn.let(f"tensor.cast {ex} : {m4b} to {MASK_TYPE}", "bm")


@dataclasses.dataclass(frozen=True)
class Span:
    """What one op covers: groups ``[g0, g0 + cnt)``, slots ``[s0, s0 + ns)``; ``whole``: slot
    ``t`` is page ``t`` (the unmasked pages ``[0, nb)`` of groups ``[gh, gf)``), else
    ``_mapped_page``."""

    g0: str
    cnt: str
    s0: str
    ns: str
    whole: bool = False


def _pages(c: Ctx, h: Banded, which: str, sp: Span) -> Operand:
    """K or V as the pages of ``sp``'s slots and groups, gathered by number (page numbers made in
    the op's dispatch, clamped into ``[0, NP)``)."""
    fn, p = c.fn, c.p
    g0, cnt, s0, ns = sp.g0, sp.cnt, sp.s0, sp.ns
    d = p.dq if which == "k" else p.dv
    src = c.k if which == "k" else c.v
    P, bhsd = h.page, p.layout == "bhsd"
    kd = "k1" if which == "k" else "n"
    t4 = tensor_type(["?", "?", "?", d], p.dtype)
    if bhsd:  # rows (b, h, key) -> pages of P rows
        t2, pages_ty = tensor_type(["?", d], p.dtype), tensor_type(["?", P, d], p.dtype)
        flat = fn.let(f"tensor.collapse_shape {src.name} [[0, 1, 2], [3]] : {t4} into {t2}", "bp")
        total = fn.mul(fn.mul(c.b, c.hk), h.np)
        pages = fn.let(f"tensor.expand_shape {flat} [[0, 1], [2]] output_shape [{total}, {P}, {d}] : {t2} into {pages_ty}", "bp")
        lead, dims = [c.b, c.hk, cnt, ns], ("b0", "b1", "b2", "k2o", "k2", kd)
        out_ty = tensor_type(["?", "?", "?", "?", P, d], p.dtype)
    else:  # rows (b, key) -> pages of P rows, each [P, Hk, D]
        t3, pages_ty = tensor_type(["?", "?", d], p.dtype), tensor_type(["?", P, "?", d], p.dtype)
        flat = fn.let(f"tensor.collapse_shape {src.name} [[0, 1], [2], [3]] : {t4} into {t3}", "bp")
        pages = fn.let(f"tensor.expand_shape {flat} [[0, 1], [2], [3]] output_shape [{fn.mul(c.b, h.np)}, {P}, {c.hk}, {d}] "
                       f": {t3} into {pages_ty}", "bp")
        lead, dims = [c.b, cnt, ns], ("b0", "b2", "k2o", "k2", "b1", kd)
        out_ty = tensor_type(["?", "?", "?", P, "?", d], p.dtype)
    ids_ty = tensor_type(["?"] * len(lead), "i32")
    ids_e = fn.let(f"tensor.empty({', '.join(lead)}) : {ids_ty}", "bi")
    rank = len(lead)
    dd = ", ".join(f"d{i}" for i in range(rank))
    ids = fn.fresh("bi")
    fn.emit(f"{ids} = linalg.generic {{indexing_maps = [affine_map<({dd}) -> ({dd})>], iterator_types = "
            f"[{parallel(rank)}]}} outs({ids_e} : {ids_ty}) {{")
    with fn.region("^bb0(%bi_o: i32):", f"}} -> {ids_ty}"), fn.local():
        ix = [fn.let(f"linalg.index {i} : index", "bx") for i in range(rank)]
        g, s = fn.add(ix[-2], g0), fn.add(ix[-1], s0)
        pg = fn.clamp(s if sp.whole else _mapped_page(fn, h, g, s), 0, fn.sub(h.np, 1))
        base = fn.mul(fn.add(fn.mul(ix[0], c.hk), ix[1]), h.np) if bhsd else fn.mul(ix[0], h.np)
        v = fn.let(f"arith.index_cast {fn.add(base, pg)} : index to i32", "bx")
        fn.emit(f"linalg.yield {v} : i32")
    empty = fn.let(f"tensor.empty({', '.join(lead + ([] if bhsd else [c.hk]))}) : {out_ty}", "bp")
    g_ = fn.let(f"iree_linalg_ext.gather dimension_map = [0] ins({pages}, {ids} : {pages_ty}, {ids_ty}) "
                f"outs({empty} : {out_ty}) -> {out_ty}", "bp")
    return Operand(g_, out_ty, dims)


def _q(c: Ctx, h: Banded, qp: str, g0: str, cnt: str) -> Operand:
    fn, p = c.fn, c.p
    ty4, ty5 = tensor_type(["?", "?", "?", p.dq], p.dtype), tensor_type(["?", "?", "?", h.m, p.dq], p.dtype)
    rows = fn.mul(cnt, h.m)
    sl = fn.let(f"tensor.extract_slice {qp}[0, 0, {fn.mul(g0, h.m)}, 0] [{c.b}, {c.hk}, {rows}, {p.dq}] [1, 1, 1, 1] "
                f": {ty4} to {ty4}", "bq")
    q = fn.let(f"tensor.expand_shape {sl} [[0], [1], [2, 3], [4]] output_shape [{c.b}, {c.hk}, {cnt}, {h.m}, {p.dq}] "
               f": {ty4} into {ty5}", "bq")
    return Operand(q, ty5, ("b0", "b1", "b2", "m", "k1"))


def _rows_reassoc(tail: list) -> str:
    """The reassociation between a state part's rows ``[B, Hk, cnt * M(, Dv)]`` and its groups'
    rows ``[B, Hk, cnt, M(, Dv)]`` (``tail``: the part's trailing dims)."""
    return "[[0], [1], [2, 3], [4]]" if tail else "[[0], [1], [2, 3]]"


def _state_rows(c: Ctx, h: Banded, st: State, g0: str, cnt: str) -> list[Operand]:
    """The state rows of groups ``[g0, g0 + cnt)`` as the op's outs ``[B, Hk, cnt, M(, Dv)]``."""
    fn = c.fn
    flat = st.rows(fn, ["0", "0", "0", fn.mul(g0, h.m)], [c.b, c.hk, "1", fn.mul(cnt, h.m)], ("b0", "b1", "m"))
    out = []
    for o, tail in zip(flat, ([st.dv], [], [])):
        ty = tensor_type(["?", "?", "?", h.m, *tail], "f32")
        re = _rows_reassoc(tail)
        shape = ", ".join([c.b, c.hk, cnt, str(h.m), *map(str, tail)])
        v = fn.let(f"tensor.expand_shape {o.name} {re} output_shape [{shape}] : {o.type} into {ty}", "bs")
        out.append(Operand(v, ty, ("b0", "b1", "b2", "m") + (("n",) if tail else ())))
    return out


def _fresh(c: Ctx, h: Banded, cnt: str) -> list[Operand]:
    """(acc, max, sum) at (0, -FLT_MAX, 0), ``[B, Hk, cnt, M(, Dv)]`` (``state.fresh_outs`` with a
    static M)."""
    fn = c.fn
    outs = []
    for o in fresh_outs(fn, [c.b, c.hk, cnt, fn.c(h.m)], ("b0", "b1", "b2", "m"), c.p.dv):
        ty = o.type.replace("tensor<?x?x?x?", f"tensor<?x?x?x{h.m}", 1)
        outs.append(Operand(fn.let(f"tensor.cast {o.name} : {o.type} to {ty}", "bf"), ty, o.dims))
    return outs


def _op(c: Ctx, tier: Tier, h: Banded, st: State, qp: str, mask: str | None, sp: Span, chained: bool) -> State:
    """One op over ``sp``'s groups and slots, masked where ``mask`` is given; its results are
    written into the state rows of those groups. No slots is an op of no steps (fresh: the initial
    state). No groups runs on the spare group past the last one instead (its rows are never read),
    since a CUDA launch of zero workgroups fails (``CUDA_ERROR_INVALID_VALUE``)."""
    fn, p = c.fn, c.p
    g0, cnt, s0, ns = sp.g0, sp.cnt, sp.s0, sp.ns
    empty = fn.cmp("eq", cnt, 0)
    g0, cnt, ns = fn.select(empty, h.groups, g0), fn.select(empty, 1, cnt), fn.select(empty, 0, ns)
    live = Span(g0, cnt, s0, ns, sp.whole)

    def region():
        m = None
        if mask is not None:
            mty = tensor_type(["?", h.m, "?", h.page], "i1")
            mv = fn.let(f"tensor.extract_slice {mask}[{g0}, 0, {s0}, 0] [{cnt}, {h.m}, {ns}, {h.page}] [1, 1, 1, 1] "
                        f": {mty} to {mty}", "bm")
            m = Operand(mv, mty, ("b2", "m", "k2o", "k2"))
        outs = _state_rows(c, h, st, g0, cnt) if chained else _fresh(c, h, cnt)
        res = online_attention(fn, q=_q(c, h, qp, g0, cnt), k=_pages(c, h, "k", live),
                               v=_pages(c, h, "v", live), scale=c.scale, scale_type=p.dtype, outs=outs, nb=3,
                               lowering=tier.lowering, dv=p.dv, mask=m, k2o=True, softcap=p.softcap)
        rows = fn.mul(cnt, h.m)
        flat = []
        for r, o, tail in zip(res, outs, ([p.dv], [], [])):
            ty = tensor_type(["?", "?", "?", *tail], "f32")
            flat.append(fn.let(f"tensor.collapse_shape {r} {_rows_reassoc(tail)} : {o.type} into {ty}", "bs"))
        return st.insert(fn, flat, ["0", "0", "0", fn.mul(g0, h.m)], [c.b, c.hk, "1", rows])

    return st.with_names(fn.dispatch(st.region_results(), region))


def banded_ops(c: Ctx, tier: Tier, h: Banded, st: State, qp: str, mask: str) -> State:
    """The ops of the module docstring, in order (every state row written fresh once)."""
    fn = c.fn
    zero = fn.c(0)
    mid, tail_g = fn.sub(h.g_hi, h.g_lo), fn.sub(h.groups, h.g_hi)
    ni = fn.sub(h.i1, h.i0)
    st = _op(c, tier, h, st, qp, mask, Span(zero, h.gf, zero, h.nm), False)
    st = _op(c, tier, h, st, qp, None, Span(h.gh, fn.sub(h.gf, h.gh), zero, h.nb, True), True)
    st = _op(c, tier, h, st, qp, mask, Span(h.gf, fn.sub(h.g_lo, h.gf), zero, h.n), False)
    st = _op(c, tier, h, st, qp, None, Span(h.g_lo, mid, zero, ni), False)
    st = _op(c, tier, h, st, qp, mask, Span(h.g_hi, tail_g, zero, h.n), False)
    return _op(c, tier, h, st, qp, mask, Span(h.g_lo, mid, ni, fn.sub(h.n, ni)), True)
