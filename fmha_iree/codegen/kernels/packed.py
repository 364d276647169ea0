"""Decode over K/V rows read where they lie: a ragged problem's keys as pieces of the caller's own
rows, with no frame gathered.

When every sequence's keys are one run of K/V rows, the runs in sequence order and not
overlapping (group mode; a padded batch with ``cu_seqlen_k``), and every sequence has few query
rows (``Sq * G`` up to ``Plan.short_rows``), the host passes ``S > 0`` (``frames.packed_pieces``)
and this path reads the rows ``[P0 * W, (P0 + NPc) * W)`` of K and V as ``NPc`` pieces of ``W``
rows (a batch dim), plus a tail piece of the last ``W`` rows ``[NR - W, NR)`` for rows past the
last whole piece. Piece ``p`` holds up to ``S`` sequences (slots) ``first[p] .. first[p] + S - 1``
(``first`` in the index table): its Q rows are those sequences' query rows (``R = Sq * G`` per
slot, the ``G`` query heads of a KV head as rows), its mask says which of its keys belong to a
slot's sequence and are visible to the row (CK's rule with that sequence's ``(qlen, klen, y, x)``;
the tail piece also drops the rows a whole piece holds). One op over the pieces and one over the
tail write each piece's state rows; a merge combines, per sequence, the pieces its keys span
(``[ks // W - P0, ceil((ks + kl) / W) - P0)``, the tail as piece ``NPc``) into the frame's out
and LSE, and the frame's last gathers put them in place (``ragged._Frame.leave``).

K and V are read once, in place: no copy and no padding to the longest sequence (the frame of a
decode batch over KV lengths 256..8192 holds twice the keys its sequences have).

Over a paged cache whose page is a multiple of ``PAGE_ROWS`` (``mode="pages"``), the pieces are
the cache's own rows in sub-pages of ``PAGE_ROWS`` rows, ``PAGE_GROUP`` sub-pages of one sequence
per whole piece (``W = PAGE_GROUP * PAGE_ROWS``), read in place: the whole-piece op's K / V are an
``iree_linalg_ext.gather`` of the sub-pages by number inside the op's dispatch, ``[N, PAGE_GROUP,
PAGE_ROWS, Hk, D]``, and the op has two key dims (sub-page, row; one sub-page per step, so each
gathered tile has one index: IREE 3.13 fails to vectorize a gather tile with an index vector,
docs/tried.md). A whole piece holds sub-pages before its sequence's last (a short group repeats
its first sub-page, masked: finite keys, never ``0 * NaN``). Each sequence's last sub-page may
hold rows it does not own, which may be NaN: it is copied with those rows zeroed into ``B`` tail
pieces (``gather_pages``), and the merge reads a sequence's whole pieces, then its tail piece.
Pieces of one 64-row sub-page each made a B32 decode much slower than the contiguous cache's
256-row pieces (each piece pays for its queries and its state); four sub-pages a piece closed most
of the gap on the H200 (docs/BENCHMARKS.md, "The paged decode in pieces of four sub-pages; the
pieces' Q as 64-bit words").
"""

from __future__ import annotations

from .attention import Operand, online_attention
from .bounds import row_hi, row_lo
from .elementwise import Words, copy_attrs
from .ir import Fn, tensor_type
from .operands import Ctx
from .packed_common import PAGE_GROUP, PAGE_ROWS, Packed, generic, last_rows, read_idx
from .packed_merge import merge
from .state import fresh_outs, new_state

__all__ = ["PACKED_SCALARS", "PAGE_ROWS", "PAGE_GROUP", "MASK3", "Packed", "packed_host", "packed_work", "gather_pages"]

from ...problem.abi import PACKED_SCALARS
MASK3 = tensor_type(["?", "?", "?"], "i1")


def packed_host(c: Ctx, s: dict, at: dict, k_rows: str, mode: str = "rows") -> Packed:
    """The path's host values from the scalars ``s`` and the table offsets ``at``; ``k_rows`` the
    rows per leading index of ``%k``. ``mode``: ``rows`` (K / V's own rows), ``gathered`` (the
    rows of the pages gathered one after the other by ``gather_pages``) or ``pages`` (the same
    rows, each page read in place); in the last two each sequence's first row is at
    ``at["starts"]``."""
    fn, p = c.fn, c.p
    paged = mode != "rows"
    tier = p.short or p.main
    w = fn.assume_div(fn.bounded(s["W"]), p.cols)
    rows = fn.mul(c.sq, p.group)
    m = fn.assume_div(fn.max(fn.round_up(fn.mul(s["S"], rows), tier.tile_rows), tier.tile_rows), tier.tile_rows)
    if paged:
        nr = fn.bounded(fn.mul(s["NU"], s["PG"]))
    else:
        nr = fn.bounded(fn.mul(fn.dim("%k", tensor_type(["?", "?", "?", p.dq], p.dtype), 0), k_rows))
    npc = fn.bounded(s["NPc"])
    tail_lo = fn.mul(fn.add(s["P0"], npc), w)
    whole = fn.cmp("eq", fn.arith(f"arith.remsi {s['W']}, {fn.c(p.cols)} : index", "pw"), 0)
    on = fn.andi(fn.andi(fn.andi(fn.cmp("sgt", s["S"], 0), whole), fn.cmp("sge", nr, w)), fn.cmp("sle", tail_lo, nr))
    nt = fn.opaque(1)
    if mode == "pages":  # pieces of PAGE_ROWS rows (the gather's static shape), one tail per sequence
        nt, on = c.b, fn.andi(on, fn.cmp("eq", s["W"], PAGE_GROUP * PAGE_ROWS))
    return Packed(w, npc, s["P0"], s["S"], at["first"], at["starts" if paged else "k"], at["desc"], at["q"], rows, m,
                  fn.add(npc, nt), nr, tail_lo, fn.opaque(1), on, nt=nt, pid=at["pid"] if mode == "pages" else "")


def gather_pages(c: Ctx, h: Packed, at: dict, which: str, pages: str | None = None) -> str:
    """``[1, n * PG, Hk, D]``: ``n`` pages (``pages``, default ``h.nr / PG``) of ``PG`` rows of
    ``%k`` / ``%v`` (read as rows) one after the other, page ``u`` from row ``at["pb"][u]`` on, its
    rows past ``at["pv"][u]`` zero (the unused end of a sequence's last page)."""
    fn, p = c.fn, c.p
    d = p.dq if which == "k" else p.dv
    ty = tensor_type(["?", "?", "?", d], p.dtype)
    page = c.frame.s["PG"]

    def element(ix):
        _, t, hh, dd = ix
        u = fn.floordiv(t, page)
        r = fn.sub(t, fn.mul(u, page))
        ok = fn.cmp("slt", r, read_idx(fn, at["pv"], u))
        row = fn.add(read_idx(fn, at["pb"], u), r)  # the source read as rows n * R + r
        src_rows = c.frame.src_rows[1 if which == "k" else 2]
        n, rr = fn.floordiv(row, src_rows), fn.arith(f"arith.remsi {row}, {src_rows} : index", "pr")
        val = fn.let(f"tensor.extract %{which}[{n}, {rr}, {hh}, {dd}] : {ty}", "pv")
        zero = fn.let(f"arith.constant 0.0 : {p.dtype}", "pz")
        return fn.let(f"arith.select {ok}, {val}, {zero} : {p.dtype}", "pv")

    # a copy's tiles (32 rows x D per workgroup, 8 elements per thread): IREE's own config gathered
    # a B32 decode's pages far slower on the H200 (docs/tried.md, "H200: decode with K / V read in place")
    attrs = copy_attrs(p.main.lowering, rank=4, row_dim=1, inner=d)
    rows = h.nr if pages is None else fn.mul(pages, page)
    return generic(fn, ty, [h.one, rows, c.hk], 4, element, attrs)


def _ori(fn: Fn, a: str, b: str) -> str:
    return fn.let(f"arith.ori {a}, {b} : i1", "po")


def _slot(c: Ctx, h: Packed, pi: str, m: str):
    """(valid, sequence b clamped into range, query row i, head in group g) of row ``m`` of piece
    ``pi`` (inside a generic)."""
    fn, G = c.fn, c.p.group
    t = fn.floordiv(m, h.rows)
    rem = fn.sub(m, fn.mul(t, h.rows))
    i, g = fn.floordiv(rem, G), fn.arith(f"arith.remsi {rem}, {fn.c(G)} : index", "pr")
    b = fn.add(read_idx(fn, h.first, pi), t)
    ok = fn.andi(fn.cmp("slt", t, h.s), fn.cmp("slt", b, c.b))
    return ok, fn.min(b, fn.sub(c.b, 1)), i, g


def _q_pieces(c: Ctx, h: Packed, q_rows: str) -> tuple[str, tuple]:
    """``[Pn, Hk, M, Dq]``: each piece's slots' query rows (zeros where none); with pages
    (``h.pid``) ``[B, Hk, M, Dq]``, each sequence's rows once (``_q_from_sequences`` copies them
    per piece). Moved as 64-bit words where the head dim allows (``elementwise.Words``); returns
    (the copy, (its words, their type) for ``_q_from_sequences``)."""
    fn, p = c.fn, c.p
    w = Words(p.dtype, p.dq, p.dq)
    q, q_ty = w.source(fn, "%q")
    ty = tensor_type(["?", "?", "?", w.dw], w.elt)

    def element(ix):
        pi, hh, m, d = ix
        if h.pid:
            b, i, g = pi, fn.floordiv(m, p.group), fn.arith(f"arith.remsi {m}, {fn.c(p.group)} : index", "pr")
            ok = fn.cmp("slt", m, h.rows)
        else:
            ok, b, i, g = _slot(c, h, pi, m)
        ok = fn.andi(ok, fn.cmp("slt", i, read_idx(fn, h.desc_at, b)))
        row = read_idx(fn, h.q_at, fn.add(fn.mul(b, c.sq), fn.min(i, fn.sub(c.sq, 1))))
        ok = fn.andi(ok, fn.cmp("sge", row, 0))
        safe = fn.max(row, 0)
        n, r = fn.floordiv(safe, q_rows), fn.arith(f"arith.remsi {safe}, {q_rows} : index", "pr")
        val = fn.let(f"tensor.extract {q}[{n}, {r}, {fn.add(fn.mul(hh, p.group), g)}, {d}] : {q_ty}", "pv")
        zero = fn.let(f"arith.constant {w.zero} : {w.elt}", "pz")
        return fn.let(f"arith.select {ok}, {val}, {zero} : {w.elt}", "pv")

    size = [c.b if h.pid else h.pn, c.hk, h.m]
    out = generic(fn, ty, size, 4, element, copy_attrs(p.main.lowering, rank=4, row_dim=2, inner=w.dw, vec=w.vec))
    return w.result(fn, out, size), (out, ty)


def _q_from_sequences(c: Ctx, h: Packed, qs: tuple) -> str:
    """``[Pn, Hk, M, Dq]``: piece ``p``'s rows are its sequence's (``first[p]``) rows of ``qs``
    (``_q_pieces``' words and their type, ``[B, Hk, M, Dq / n]``; pages: one sequence per
    piece). Reading the sequences' rows once and copying them per piece is one dependent index
    read per element (a gather of them inside the op's dispatch was slow and wrong on the H200,
    docs/tried.md)."""
    fn, p = c.fn, c.p
    w = Words(p.dtype, p.dq, p.dq)
    src, ty = qs

    def element(ix):
        pi, hh, m, d = ix
        b = fn.min(read_idx(fn, h.first, pi), fn.sub(c.b, 1))
        return fn.let(f"tensor.extract {src}[{b}, {hh}, {m}, {d}] : {ty}", "pv")

    size = [h.pn, c.hk, h.m]
    out = generic(fn, ty, size, 4, element, copy_attrs(p.main.lowering, rank=4, row_dim=2, inner=w.dw, vec=w.vec))
    return w.result(fn, out, size)


def _mask(c: Ctx, h: Packed) -> str:
    """``[Pn, M, W]`` i1: whether row ``m`` of piece ``p`` sees the piece's key ``j``."""
    fn = c.fn

    def element(ix):
        pi, m, j = ix
        ok, b, i, _ = _slot(c, h, pi, m)
        whole = fn.cmp("slt", pi, h.npc)
        ql, kl, y, x = (read_idx(fn, h.desc_at, fn.add(fn.mul(k, c.b), b)) for k in range(4))
        at_whole = fn.add(fn.mul(fn.add(h.p0, pi), h.w), j)
        if h.pid:  # whole pieces hold the sub-pages before the last, a tail piece the last
            last = last_rows(fn, kl)
            r = fn.select(whole, at_whole, fn.add(fn.add(read_idx(fn, h.k_at, b), last), j))
            inside = fn.let(f"arith.select {whole}, {fn.cmp('slt', fn.sub(r, read_idx(fn, h.k_at, b)), last)}, "
                            f"{fn.cmp('slt', j, PAGE_ROWS)} : i1", "pm")
            ok = fn.andi(ok, inside)
        else:  # the tail piece: the last W rows, less those of a whole piece
            r = fn.select(whole, at_whole, fn.add(fn.sub(h.nr, h.w), j))
            ok = fn.andi(ok, _ori(fn, whole, fn.cmp("sge", r, h.tail_lo)))
        key = fn.sub(r, read_idx(fn, h.k_at, b))  # k_base [B, 1]: the sequence's first row
        hi = fn.min(kl, row_hi(fn, i, x, c.sk))
        ok = fn.andi(fn.andi(ok, fn.cmp("slt", i, ql)), fn.andi(fn.cmp("sge", key, row_lo(fn, i, y, c.sk)),
                                                             fn.cmp("slt", key, hi)))
        return ok

    return generic(fn, MASK3, [h.pn, h.m, h.w], 3, element)


def _sub_pages(c: Ctx, h: Packed, which: str, d: int, n: str) -> Operand:
    """``%k`` / ``%v`` as ``n`` whole pieces of ``PAGE_GROUP`` sub-pages of the cache by number
    (``[n, PAGE_GROUP, PAGE_ROWS, Hk, D]``), gathered inside the op's dispatch: keys as dims
    ``(k2o, k2)``, one sub-page a step, so each gathered tile has one index."""
    fn, p = c.fn, c.p
    t4, t3 = tensor_type(["?", "?", "?", d], p.dtype), tensor_type(["?", "?", d], p.dtype)
    i32, i32x2 = tensor_type(["?"], "i32"), tensor_type(["?", PAGE_GROUP], "i32")
    page_ty = tensor_type(["?", PAGE_ROWS, "?", d], p.dtype)  # static rows: a gather's tile is one index
    ts = tensor_type(["?", PAGE_GROUP, PAGE_ROWS, "?", d], p.dtype)
    ids = fn.let(f"tensor.extract_slice %idx[{h.pid}] [{fn.mul(n, PAGE_GROUP)}] [1] : {i32} to {i32}", "pk")
    ids = fn.let(f"tensor.expand_shape {ids} [[0, 1]] output_shape [{n}, {PAGE_GROUP}] : {i32} into {i32x2}", "pk")
    flat = fn.let(f"tensor.collapse_shape %{which} [[0, 1], [2], [3]] : {t4} into {t3}", "pk")
    n_pages = fn.floordiv(fn.mul(fn.dim(f"%{which}", t4, 0), fn.dim(f"%{which}", t4, 1)), PAGE_ROWS)
    cache = fn.let(f"tensor.expand_shape {flat} [[0, 1], [2], [3]] output_shape [{n_pages}, {PAGE_ROWS}, {c.hk}, "
                   f"{d}] : {t3} into {page_ty}", "pk")
    empty = fn.let(f"tensor.empty({n}, {c.hk}) : {ts}", "pk")
    g = fn.let(f"iree_linalg_ext.gather dimension_map = [0] ins({cache}, {ids} : {page_ty}, {i32x2}) "
               f"outs({empty} : {ts}) -> {ts}", "pk")
    return Operand(g, ts, ("b0", "k2o", "k2", "b1", "k1" if which == "k" else "n"))


def _op(c: Ctx, tier, h: Packed, qp: str, mask: str, st, tail: bool):
    """The op over the whole pieces, or over the tail piece; returns the state's new names."""
    fn, p = c.fn, c.p
    n = h.nt if tail else h.npc
    at = h.npc if tail else "0"
    lead = [n, c.hk, "1", h.m]
    width = fn.c(PAGE_ROWS) if h.pid and tail else h.w  # keys per piece (pages: a tail is one sub-page)
    grouped = bool(h.pid) and not tail

    def kv(which: str, d: int) -> Operand:
        src = h.k_src if which == "k" else h.v_src
        t4, t3 = tensor_type(["?", "?", "?", d], p.dtype), tensor_type(["?", "?", d], p.dtype)
        dims = ("b0", "k2", "b1", "k1" if which == "k" else "n")
        if h.pid and not tail:
            return _sub_pages(c, h, which, d, n)
        flat = fn.let(f"tensor.collapse_shape {src} [[0, 1], [2], [3]] : {t4} into {t3}", "pk")
        lo = "0" if h.pid else fn.sub(h.nr, h.w) if tail else fn.mul(h.p0, h.w)
        sl = fn.let(f"tensor.extract_slice {flat}[{lo}, 0, 0] [{fn.mul(n, width)}, {c.hk}, {d}] [1, 1, 1] : {t3} to {t3}",
                    "pk")
        ex = fn.let(f"tensor.expand_shape {sl} [[0, 1], [2], [3]] output_shape [{n}, {width}, {c.hk}, {d}] : {t3} into {t4}",
                    "pk")
        return Operand(ex, t4, dims)

    def region():
        q_ty = tensor_type(["?", "?", "?", p.dq], p.dtype)
        q = fn.let(f"tensor.extract_slice {qp}[{at}, 0, 0, 0] [{n}, {c.hk}, {h.m}, {p.dq}] [1, 1, 1, 1] : {q_ty} to {q_ty}",
                   "pq")
        m_ty = MASK3
        if grouped:  # the keys as (sub-page, row)
            m3, m4 = (tensor_type(["?", "?", PAGE_GROUP * PAGE_ROWS], "i1"),
                      tensor_type(["?", "?", PAGE_GROUP, PAGE_ROWS], "i1"))
            mv = fn.let(f"tensor.extract_slice {mask}[{at}, 0, 0] [{n}, {h.m}, {PAGE_GROUP * PAGE_ROWS}] [1, 1, 1] : "
                        f"{m_ty} to {m3}", "pm")
            mo = Operand(fn.let(f"tensor.expand_shape {mv} [[0], [1], [2, 3]] output_shape [{n}, {h.m}, {PAGE_GROUP}, "
                                f"{PAGE_ROWS}] : {m3} into {m4}", "pm"), m4, ("b0", "m", "k2o", "k2"))
        else:
            mv = fn.let(f"tensor.extract_slice {mask}[{at}, 0, 0] [{n}, {h.m}, {width}] [1, 1, 1] : {m_ty} to {m_ty}", "pm")
            mo = Operand(mv, m_ty, ("b0", "m", "k2"))
        res = online_attention(fn, q=Operand(q, q_ty, ("b0", "b1", "m", "k1")), k=kv("k", p.dq), v=kv("v", p.dv),
                               scale=c.scale, scale_type=p.dtype, outs=fresh_outs(fn, [n, c.hk, h.m], ("b0", "b1", "m"), p.dv),
                               nb=2, lowering=tier.lowering, dv=p.dv, mask=mo, k2o=grouped, softcap=p.softcap)
        return st.insert(fn, res, [at, "0", "0", "0"], lead)

    return st.with_names(fn.dispatch(st.region_results(), region))


def packed_work(c: Ctx, h: Packed, q_rows: str) -> list[str]:
    """The work: the frame's out and LSE, then the scratch (with pages each sequence's Q rows, then
    the Q pieces, mask, state: returned, not transients, as ``ragged._Frame.types`` says)."""
    fn, p = c.fn, c.p
    tier = p.short or p.main
    qp, words = _q_pieces(c, h, q_rows)
    qs = qp
    if h.pid:
        qp = _q_from_sequences(c, h, words)
    mask = _mask(c, h)
    st = new_state(fn, [h.pn, c.hk, h.one, h.m], p.dv)
    st = _op(c, tier, h, qp, mask, st, tail=False)
    st = _op(c, tier, h, qp, mask, st, tail=True)
    out, lse = merge(c, h, st)
    return [out, lse, *([qs] if h.pid else []), qp, mask, *st.names()]
