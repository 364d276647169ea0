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
Pieces of one 64-row sub-page each took 0.55 ms for a B32 decode against 0.31 for the contiguous
cache's 256-row pieces (each piece pays for its queries and its state); four sub-pages a piece,
0.33 against 0.28 (H200, 2026-12-03, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses

from .attention import Operand, online_attention
from .bounds import row_hi, row_lo
from .elementwise import Words, copy_attrs
from .ir import Fn, parallel, tensor_type
from .operands import Ctx
from .state import fresh_outs, new_state

__all__ = ["PACKED_SCALARS", "PAGE_ROWS", "MASK3", "Packed", "packed_host", "packed_work", "gather_pages"]

PACKED_SCALARS = ("W", "NPc", "P0", "S")
PAGE_ROWS = 64  # mode "pages": pieces are sub-pages of this many rows (a cache page a multiple of it)
PAGE_GROUP = 4  # mode "pages": sub-pages per whole piece (W = PAGE_GROUP * PAGE_ROWS keys)
MASK3 = tensor_type(["?", "?", "?"], "i1")
_FMIN = "-3.40282347E+38"


@dataclasses.dataclass(frozen=True)
class Packed:
    """Host values (SSA names) of the path."""

    w: str  # keys per piece (a multiple of Plan.cols)
    npc: str  # whole pieces
    p0: str  # the first whole piece, in units of W rows
    s: str  # slots per piece (0: the path is off)
    first: str  # offset of first[NPc + 1] in %idx
    k_at: str  # offset of the key starts (k_base [B, NP], NP = 1) in %idx
    desc_at: str  # offset of the descriptor [4, B] in %idx
    q_at: str  # offset of the query rows [B, Sq] in %idx
    rows: str  # R = Sq * G
    m: str  # state rows per piece: S * R rounded up to the tier's tile rows
    pn: str  # NPc + 1
    nr: str  # rows of K / V
    tail_lo: str  # (P0 + NPc) * W: the first row the tail piece counts
    one: str  # an opaque 1 (a batch dim of size 1 that stays a dynamic size)
    on: str  # i1: the host asked for this path and its rows can be read
    k_src: str = "%k"  # the K / V the pieces are rows of: the arguments, or a paged cache's pages gathered
    v_src: str = "%v"
    nt: str = ""  # tail pieces: 1 (the last W rows), or B (pages: each sequence's last sub-page)
    pid: str = ""  # pages: offset in %idx of the used sub-pages' numbers [NU] (whole pieces read in place)


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
        ok = fn.cmp("slt", r, _read(fn, at["pv"], u))
        row = fn.add(_read(fn, at["pb"], u), r)  # the source read as rows n * R + r
        src_rows = c.frame.src_rows[1 if which == "k" else 2]
        n, rr = fn.floordiv(row, src_rows), fn.arith(f"arith.remsi {row}, {src_rows} : index", "pr")
        val = fn.let(f"tensor.extract %{which}[{n}, {rr}, {hh}, {dd}] : {ty}", "pv")
        zero = fn.let(f"arith.constant 0.0 : {p.dtype}", "pz")
        return fn.let(f"arith.select {ok}, {val}, {zero} : {p.dtype}", "pv")

    # a copy's tiles (32 rows x D per workgroup, 8 elements per thread): without them IREE's own
    # config took 0.58 ms per gather of a B32 decode's 0.24 GB (H200, 2026-12-02)
    attrs = copy_attrs(p.main.lowering, rank=4, row_dim=1, inner=d)
    rows = h.nr if pages is None else fn.mul(pages, page)
    return _generic(fn, ty, [h.one, rows, c.hk], 4, element, attrs)


def _last_rows(fn: Fn, kl: str) -> str:
    """Keys of a sequence of ``kl`` before its last sub-page (pages: the whole pieces' keys)."""
    return fn.mul(fn.floordiv(fn.max(fn.sub(kl, 1), 0), PAGE_ROWS), PAGE_ROWS)


def _read(fn: Fn, at: str, i: str) -> str:
    """``%idx[at + i]`` as an index."""
    v = fn.let(f"tensor.extract %idx[{fn.add(at, i)}] : {tensor_type(['?'], 'i32')}", "pi")
    return fn.let(f"arith.index_cast {v} : i32 to index", "pi")


def _ori(fn: Fn, a: str, b: str) -> str:
    return fn.let(f"arith.ori {a}, {b} : i1", "po")


def _slot(c: Ctx, h: Packed, pi: str, m: str):
    """(valid, sequence b clamped into range, query row i, head in group g) of row ``m`` of piece
    ``pi`` (inside a generic)."""
    fn, G = c.fn, c.p.group
    t = fn.floordiv(m, h.rows)
    rem = fn.sub(m, fn.mul(t, h.rows))
    i, g = fn.floordiv(rem, G), fn.arith(f"arith.remsi {rem}, {fn.c(G)} : index", "pr")
    b = fn.add(_read(fn, h.first, pi), t)
    ok = fn.andi(fn.cmp("slt", t, h.s), fn.cmp("slt", b, c.b))
    return ok, fn.min(b, fn.sub(c.b, 1)), i, g


def _generic(fn: Fn, ty: str, sizes: list[str], rank: int, body, attrs: str = "") -> str:
    """One dispatch: a generic over a new ``ty`` of ``sizes`` whose element is ``body(indices)``
    (``attrs``: its lowering, ``elementwise.copy_attrs``)."""
    dd = ", ".join(f"d{i}" for i in range(rank))
    elt = ty.rsplit("x", 1)[1].rstrip(">")

    def region():
        empty = fn.let(f"tensor.empty({', '.join(sizes)}) : {ty}", "pe")
        out = fn.fresh("pg")
        fn.emit(f"{out} = linalg.generic {{indexing_maps = [affine_map<({dd}) -> ({dd})>], iterator_types = [{parallel(rank)}]}} "
                f"outs({empty} : {ty}){attrs} {{")
        with fn.region(f"^bb0(%pg_o: {elt}):", f"}} -> {ty}"), fn.local():
            ix = [fn.let(f"linalg.index {i} : index", "px") for i in range(rank)]
            fn.emit(f"linalg.yield {body(ix)} : {elt}")
        return [out]

    return fn.dispatch([(ty, sizes)], region)[0]


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
        ok = fn.andi(ok, fn.cmp("slt", i, _read(fn, h.desc_at, b)))
        row = _read(fn, h.q_at, fn.add(fn.mul(b, c.sq), fn.min(i, fn.sub(c.sq, 1))))
        ok = fn.andi(ok, fn.cmp("sge", row, 0))
        safe = fn.max(row, 0)
        n, r = fn.floordiv(safe, q_rows), fn.arith(f"arith.remsi {safe}, {q_rows} : index", "pr")
        val = fn.let(f"tensor.extract {q}[{n}, {r}, {fn.add(fn.mul(hh, p.group), g)}, {d}] : {q_ty}", "pv")
        zero = fn.let(f"arith.constant {w.zero} : {w.elt}", "pz")
        return fn.let(f"arith.select {ok}, {val}, {zero} : {w.elt}", "pv")

    size = [c.b if h.pid else h.pn, c.hk, h.m]
    out = _generic(fn, ty, size, 4, element, copy_attrs(p.main.lowering, rank=4, row_dim=2, inner=w.dw, vec=w.vec))
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
        b = fn.min(_read(fn, h.first, pi), fn.sub(c.b, 1))
        return fn.let(f"tensor.extract {src}[{b}, {hh}, {m}, {d}] : {ty}", "pv")

    size = [h.pn, c.hk, h.m]
    out = _generic(fn, ty, size, 4, element, copy_attrs(p.main.lowering, rank=4, row_dim=2, inner=w.dw, vec=w.vec))
    return w.result(fn, out, size)


def _mask(c: Ctx, h: Packed) -> str:
    """``[Pn, M, W]`` i1: whether row ``m`` of piece ``p`` sees the piece's key ``j``."""
    fn = c.fn

    def element(ix):
        pi, m, j = ix
        ok, b, i, _ = _slot(c, h, pi, m)
        whole = fn.cmp("slt", pi, h.npc)
        ql, kl, y, x = (_read(fn, h.desc_at, fn.add(fn.mul(k, c.b), b)) for k in range(4))
        at_whole = fn.add(fn.mul(fn.add(h.p0, pi), h.w), j)
        if h.pid:  # whole pieces hold the sub-pages before the last, a tail piece the last
            last = _last_rows(fn, kl)
            r = fn.select(whole, at_whole, fn.add(fn.add(_read(fn, h.k_at, b), last), j))
            inside = fn.let(f"arith.select {whole}, {fn.cmp('slt', fn.sub(r, _read(fn, h.k_at, b)), last)}, "
                            f"{fn.cmp('slt', j, PAGE_ROWS)} : i1", "pm")
            ok = fn.andi(ok, inside)
        else:  # the tail piece: the last W rows, less those of a whole piece
            r = fn.select(whole, at_whole, fn.add(fn.sub(h.nr, h.w), j))
            ok = fn.andi(ok, _ori(fn, whole, fn.cmp("sge", r, h.tail_lo)))
        key = fn.sub(r, _read(fn, h.k_at, b))  # k_base [B, 1]: the sequence's first row
        hi = fn.min(kl, row_hi(fn, i, x, c.sk))
        ok = fn.andi(fn.andi(ok, fn.cmp("slt", i, ql)), fn.andi(fn.cmp("sge", key, row_lo(fn, i, y, c.sk)),
                                                             fn.cmp("slt", key, hi)))
        return ok

    return _generic(fn, MASK3, [h.pn, h.m, h.w], 3, element)


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
        if h.pid and not tail:  # PAGE_GROUP sub-pages of the cache by number, read inside this dispatch
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
            return Operand(g, ts, ("b0", "k2o", "k2", "b1", dims[3]))
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
                               nb=2, lowering=tier.lowering, dv=p.dv, mask=mo, k2o=grouped)
        return st.insert(fn, res, [at, "0", "0", "0"], lead)

    return st.with_names(fn.dispatch(st.region_results(), region))


def _combine(c: Ctx, h: Packed, st, b: str, i: str, hq: str, d: str | None):
    """(max, sum, acc or None) of sequence ``b``'s query row ``i``, head ``hq``, over the pieces
    its keys span (inside a generic)."""
    fn, G = c.fn, c.p.group
    hh, g = fn.floordiv(hq, G), fn.arith(f"arith.remsi {hq}, {fn.c(G)} : index", "pr")
    ks, kl = _read(fn, h.k_at, b), _read(fn, h.desc_at, fn.add(c.b, b))
    end = fn.add(ks, kl)
    lo = fn.clamp(fn.sub(fn.floordiv(ks, h.w), h.p0), 0, h.npc)
    if h.pid:  # pages: the whole pieces of the sub-pages before the last, then its tail piece
        hi = fn.add(lo, fn.ceildiv(_last_rows(fn, kl), h.w))
        end = fn.select(fn.cmp("sgt", kl, 0), fn.add(hi, 1), lo)
    else:
        hi = fn.select(fn.cmp("sgt", end, h.tail_lo), h.pn, fn.clamp(fn.sub(fn.ceildiv(end, h.w), h.p0), 0, h.npc))
        hi = end = fn.select(fn.cmp("sgt", kl, 0), fn.max(hi, lo), lo)
    fmin, zero = fn.const(_FMIN, "f32", "fmin"), fn.const("0.0", "f32", "zero")

    def at(pi):
        if h.pid:  # pages: past the whole pieces, the sequence's tail piece (rows it does not own zeroed)
            pi = fn.select(fn.cmp("eq", pi, hi), fn.add(h.npc, b), pi)
        t = fn.sub(b, _read(fn, h.first, pi))
        ok = fn.andi(fn.cmp("sge", t, 0), fn.cmp("slt", t, h.s))
        m = fn.add(fn.mul(fn.clamp(t, 0, fn.max(fn.sub(h.s, 1), 0)), h.rows), fn.add(fn.mul(i, G), g))
        return ok, m, pi

    # one pass, rescaling as the max grows: over a B32 paged decode's 64-row pieces (about 58 per
    # sequence) the merge took 0.187 ms in two passes and 0.074 in one (H200, 2026-12-02)
    pi, mv, lv, av, res = fn.fresh("pi"), fn.fresh("pm"), fn.fresh("lv"), fn.fresh("av"), fn.fresh("comb")
    carried = f"{mv} = {fmin}, {lv} = {zero}" + (f", {av} = {zero}" if d else "")
    types = "f32, f32, f32" if d else "f32, f32"
    fn.emit(f"{res}:{3 if d else 2} = scf.for {pi} = {lo} to {end} step {fn.c(1)} iter_args({carried}) -> ({types}) {{")
    ok, m, px = at(pi)
    mi = fn.let(f"tensor.extract {st.mx}[{px}, {hh}, {fn.c(0)}, {m}] : {st.mx_type}", "px")
    mi = fn.let(f"arith.select {ok}, {mi}, {fmin} : f32", "px")
    li = fn.let(f"tensor.extract {st.sm}[{px}, {hh}, {fn.c(0)}, {m}, {fn.c(0)}] : {st.sm_type}", "px")
    li = fn.let(f"arith.select {ok}, {li}, {zero} : f32", "px")
    mn = fn.let(f"arith.maximumf {mv}, {mi} : f32", "px")
    wa = fn.let(f"math.exp2 {fn.let(f'arith.subf {mv}, {mn} : f32', 'px')} : f32", "px")
    wb = fn.let(f"math.exp2 {fn.let(f'arith.subf {mi}, {mn} : f32', 'px')} : f32", "px")
    ln = fn.let(f"arith.addf {fn.let(f'arith.mulf {lv}, {wa} : f32', 'px')}, "
                f"{fn.let(f'arith.mulf {li}, {wb} : f32', 'px')} : f32", "px")
    if d:
        ai = fn.let(f"tensor.extract {st.acc}[{px}, {hh}, {fn.c(0)}, {m}, {d}] : {st.acc_type}", "px")
        ai = fn.let(f"arith.select {ok}, {ai}, {zero} : f32", "px")
        an = fn.let(f"arith.addf {fn.let(f'arith.mulf {av}, {wa} : f32', 'px')}, "
                    f"{fn.let(f'arith.mulf {ai}, {wb} : f32', 'px')} : f32", "px")
        fn.emit(f"  scf.yield {mn}, {ln}, {an} : {types}")
    else:
        fn.emit(f"  scf.yield {mn}, {ln} : {types}")
    fn.emit("}")
    return f"{res}#0", f"{res}#1", (f"{res}#2" if d else None)


def _merge(c: Ctx, h: Packed, st) -> tuple[str, str]:
    """The frame's out ``[B, Sq, Hq, Dv]`` and LSE ``[B, Hq, Sq]`` from the pieces' state."""
    fn, p = c.fn, c.p
    dv = p.arg_dims[1]
    zero = lambda: fn.const("0.0", "f32", "zero")  # noqa: E731

    def out_element(ix):
        b, i, hq, d = ix
        _, l, a = _combine(c, h, st, b, i, hq, d)
        v = fn.let(f"arith.select {fn.let(f'arith.cmpf ogt, {l}, {zero()} : f32', 'px')}, "
                   f"{fn.let(f'arith.divf {a}, {l} : f32', 'px')}, {zero()} : f32", "px")
        return v if p.dtype == "f32" else fn.let(f"arith.truncf {v} : f32 to {p.dtype}", "px")

    def lse_element(ix):
        b, hq, i = ix
        mstar, l, _ = _combine(c, h, st, b, i, hq, None)
        lg = fn.let(f"arith.addf {mstar}, {fn.let(f'math.log2 {l} : f32', 'px')} : f32", "px")
        e = fn.let(f"arith.mulf {lg}, {fn.const('0.693147180559945309', 'f32', 'ln2')} : f32", "px")
        pos = fn.let(f"arith.cmpf ogt, {l}, {zero()} : f32", "px")
        return fn.let(f"arith.select {pos}, {e}, {fn.const('0xFF800000', 'f32', 'ninf')} : f32", "px")

    out = _generic(fn, tensor_type(["?", "?", "?", dv], p.dtype), [c.b, c.sq, c.hq], 4, out_element)
    lse = _generic(fn, tensor_type(["?", "?", "?"], "f32"), [c.b, c.hq, c.sq], 3, lse_element)
    return out, lse


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
    out, lse = _merge(c, h, st)
    return [out, lse, *([qs] if h.pid else []), qp, mask, *st.names()]
