"""The tiles' table and data movement (``kernels.tiles``): the table's columns, the function's
shared values (``TilesFn``: sizes, q / k / v as rows), and the copies around the two attention
dispatches: a paged cache's used rows gathered in sequence order, the edges' K / V (rows a
sequence does not own zeroed) and mask, the tiles' Q rows where G > 1, and the tiles' out and LSE
gathered into the caller's layout. Copies move 64-bit words where the head dim allows."""

from __future__ import annotations

import dataclasses

from .elementwise import as_words, block_attrs, copy_attrs, from_words, word_elems
from .ir import Fn, parallel, tensor_type
from .operands import Plan
from .packed_common import generic, read_idx
from .workgroups import Body, inner_size, load

__all__ = ["TILE_COLUMNS", "TILE_FIELDS", "STEP", "TilesShape", "TilesFn", "tile_row", "gathered_keys", "edge_inputs",
           "q_tiles", "gathered", "edge_key", "alibi_ramps", "copies_q", "f32_mask"]

# a tile's row of the table; ``nh``: the edge keys its first half of positions sees (a prefix of ``ne``)
from ...problem.abi import TILE_COLUMNS, TILE_STEP as STEP

TILE_FIELDS = len(TILE_COLUMNS)

@dataclasses.dataclass(frozen=True)
class TilesShape:
    """The static sizes of ``fwd_tiles``: ``rows`` (R, state rows per tile), ``ew`` (edge keys at
    most), the op lowering (a workgroup is the whole op: ``workgroup_m == rows``), ``parts``: the
    edge's workgroups per tile (each over ``rows / parts`` rows; 1 or 2)."""

    rows: int
    group: int
    ew: int
    lowering: dict
    parts: int = 1

    @property
    def positions(self) -> int:
        return self.rows // self.group


def tile_row(b: Body, table, tile: str) -> dict[str, str]:
    """The tile's table row inside a tiles dispatch, as index values by column name."""
    at = b.let(f"arith.muli {tile}, {b.c(TILE_FIELDS)} : index")
    row = load(b, table, [at], [TILE_FIELDS], f"tensor<{TILE_FIELDS}xi32>")
    vals = {}
    for i, name in enumerate(TILE_COLUMNS):
        e = b.let(f"tensor.extract {row}[{b.c(i)}] : tensor<{TILE_FIELDS}xi32>")
        vals[name] = b.let(f"arith.index_cast {e} : i32 to index")
    return vals


def field(fn: Fn, tile: str, name: str) -> str:
    """Column ``name`` of the tile's table row, read in a generic's body (the table at the start of
    ``%idx``)."""
    at, col = fn.mul(tile, TILE_FIELDS), TILE_COLUMNS.index(name)
    return read_idx(fn, fn.c(0), fn.add(at, col) if col else at)


class TilesFn:
    """The function's shared values (SSA names of the function) and static sizes."""

    def __init__(self, fn: Fn, p: Plan, t: TilesShape):
        self.fn, self.p, self.t = fn, p, t
        dq, dv = p.dq, p.dv
        self.q_ty = tensor_type(["?", "?", "?", dq], p.dtype)
        self.v_ty = tensor_type(["?", "?", "?", dv], p.dtype)
        s = {n: fn.bounded(fn.arith(f"arith.index_cast %{n} : i64 to index", n)) for n in ("N", "NL", "RL", "E")}
        self.n, self.nl, self.rl = s["N"], s["NL"], s["RL"]
        self.e = fn.assume_div(s["E"], STEP)  # edge keys of the widest edge (at most t.ew), a whole step
        self.bshd = p.layout == "bshd"
        r_ax, h_ax = (1, 2) if self.bshd else (2, 1)
        self.tq = fn.bounded(fn.dim("%q", self.q_ty, r_ax))
        self.tk = fn.bounded(fn.dim("%k", self.q_ty, r_ax))
        self.hq = fn.bounded(fn.dim("%q", self.q_ty, h_ax))
        self.hk = fn.bounded(fn.dim("%k", self.q_ty, h_ax))
        self.batch = fn.bounded(fn.dim("%q", self.q_ty, 0))
        self.at_out = fn.mul(self.n, TILE_FIELDS)
        self.at_lse = fn.add(self.at_out, fn.mul(self.batch, self.tq))
        self.table = fn.let(f"tensor.extract_slice %idx[0] [{self.at_out}] [1] : {tensor_type(['?'], 'i32')} to "
                            f"{tensor_type(['?'], 'i32')}", "tt")
        self.q_src: tuple = ("%q", self.q_ty, self.sizes(self.tq, self.hq))  # q_tiles'
        self.k, self.v = "%k", "%v"  # the keys the tiles read (``gathered_keys``: a paged cache's rows)
        if p.bias:  # the bias planes' sizes and head stride (``problem.bias``)
            self.bias_ty = tensor_type(["?", "?", "?"], p.dtype)
            self.bias_dims = [fn.bounded(fn.dim("%bias", self.bias_ty, i)) for i in range(3)]
            self.hs = fn.bounded(fn.arith("arith.index_cast %HS : i64 to index", "HS"))

    def sizes(self, rows: str, heads: str) -> list[str]:
        """The dynamic sizes of a q / k / v argument in the module's layout."""
        return [self.batch, rows, heads] if self.bshd else [self.batch, heads, rows]

    def at(self, bi, row, head, d) -> list:
        """Indices of (batch entry, row, head, d) in the module's layout."""
        return [bi, row, head, d] if self.bshd else [bi, head, row, d]

    def dim_ops(self) -> list[tuple[str, str, list]]:
        """Rows and heads of q and k, as index operands of a tiles dispatch."""
        return [(v, "index", []) for v in (self.tq, self.tk, self.hq, self.hk)]

    def dims_in(self, args: dict) -> dict:
        """``dim_ops``' values inside a dispatch (its ``args``)."""
        return {n: args[v] for n, v in zip(("tq", "tk", "hq", "hk"), (self.tq, self.tk, self.hq, self.hk))}

    def flat(self, which: str) -> tuple[str, str, list[str]]:
        """q / k / v (``which``) as rows: ``[B * T, H, D]`` (bshd) or ``[B * H * T, D]`` (bhsd), an
        operand of a tiles dispatch. (Loads from these are proven 16-byte aligned; from the 4-D
        tensors, with the batch entry as a third dynamic offset, IREE 3.13 read f16 one element at
        a time.)"""
        name = {"q": "%q", "k": self.k, "v": self.v}[which]
        d = self.p.dq if which != "v" else self.p.dv
        rows, heads = (self.tq, self.hq) if which == "q" else (self.tk, self.hk)
        src = self.q_ty if which != "v" else self.v_ty
        fn = self.fn
        if self.bshd:
            ty = tensor_type(["?", "?", d], self.p.dtype)
            v = fn.let(f"tensor.collapse_shape {name} [[0, 1], [2], [3]] : {src} into {ty}", "tf")
            return v, ty, [fn.mul(self.batch, rows), heads]
        ty = tensor_type(["?", d], self.p.dtype)
        v = fn.let(f"tensor.collapse_shape {name} [[0, 1, 2], [3]] : {src} into {ty}", "tf")
        return v, ty, [fn.mul(fn.mul(self.batch, heads), rows)]

    def load_rows(self, b: "Body", view, bi: str, row: str, head: str, n, rows_arg: str, heads_arg: str,
                  ty: str) -> str:
        """``n`` rows of head ``head`` of batch entry ``bi`` from ``row`` on, from a ``flat``
        view (``rows_arg`` / ``heads_arg``: the tensor's rows and heads inside the dispatch)."""
        first = b.let(f"arith.muli {bi}, {rows_arg} : index")
        if self.bshd:
            at = b.let(f"arith.addi {first}, {row} : index")
            return load(b, view, [at, head, b.c(0)], [n, 1, inner_size(ty)], ty)
        eh = b.let(f"arith.muli {bi}, {heads_arg} : index")
        eh = b.let(f"arith.addi {eh}, {head} : index")
        at = b.let(f"arith.muli {eh}, {rows_arg} : index")
        at = b.let(f"arith.addi {at}, {row} : index")
        return load(b, view, [at, b.c(0)], [n, inner_size(ty)], ty)


def _copy(c: TilesFn, src: tuple[str, list, list[str]], out: tuple[list, list[str]], element, row_dim: int) -> str:
    """A copy dispatch ``out[ix] = element(ix, read, zero)``: ``src`` (value, shape, dynamic sizes)
    and ``out`` (shape, dynamic sizes) rank 4 of the plan's dtype with the head dim last, moved as
    64-bit words where it is a whole number of them (``elementwise.word_elems``); ``read(indices)``
    gives the source element there, ``zero`` a zero element."""
    fn, p = c.fn, c.p
    d = int(out[0][-1])
    n = word_elems(p.dtype, d, int(src[1][-1]))
    if n:
        value, ty = as_words(fn, src[0], src[1], src[2], p.dtype)
        elt, zero, width, vec = "i64", "0", d // n, 2
    else:
        value, ty, elt, zero, width, vec = src[0], tensor_type(src[1], p.dtype), p.dtype, "0.0", d, 8

    def read(ix):
        return fn.let(f"tensor.extract {value}[{', '.join(ix)}] : {ty}", "tv")

    def el(ix):
        return element(ix, read, fn.let(f"arith.constant {zero} : {elt}", "tz"), elt)

    shape = [*out[0][:-1], width]
    res = generic(fn, tensor_type(shape, elt), out[1], 4, el, copy_attrs(p.main.lowering, rank=4, row_dim=row_dim,
                                                                         inner=width, vec=vec))
    return from_words(fn, res, out[0], out[1], p.dtype) if n else res


def gathered_keys(c: TilesFn):
    """A paged cache's used rows gathered in sequence order (``fwd_tiles_paged``): K / V
    ``[1, TK, Hk, D]``, row ``t`` the cache row ``kmap[t]`` (after the LSE map in the table);
    the tiles then read them as packed keys."""
    fn, p = c.fn, c.p
    tk = fn.bounded(fn.arith("arith.index_cast %TK : i64 to index", "TK"))
    at = fn.add(c.at_lse, fn.mul(c.nl, c.rl))
    keys = []
    for name, d in (("%k", p.dq), ("%v", p.dv)):
        def el(ix, read, zero, elt):
            _, t, h, dd = ix
            return read([fn.c(0), read_idx(fn, at, t), h, dd])

        keys.append(_copy(c, (name, ["?", "?", "?", d], c.sizes(c.tk, c.hk)), (["?", "?", "?", d], [c.batch, tk, c.hk]),
                          el, row_dim=1))
    c.k, c.v = keys
    c.tk = tk
    return keys


def edge_key(fn: Fn, tile: str, j: str) -> str:
    """The sequence key of a tile's edge key ``j``: the ``nl`` keys before its interior
    ``[lo, lo + nk)`` (a window's left edge), then those after it (negative before the
    sequence's first key)."""
    lo, nk, nl = (field(fn, tile, n) for n in ("lo", "nk", "nl"))
    left = fn.cmp("slt", j, nl)
    before = fn.sub(fn.add(lo, j), nl)
    after = fn.add(before, nk)
    return fn.select(left, before, after)


def edge_inputs(c: TilesFn) -> tuple[str, str, str]:
    """(mask ``[N, R, EW]`` i1 (with ALiBi or a bias ``[N, Hk, R, EW]`` f32: ``_alibi_edges``,
    ``_bias_edges``), K and V edge copies ``[N, Hk, EW, D]``)."""
    fn, p, t = c.fn, c.p, c.t
    G = t.group

    def mask_el(ix):
        tile, m, j = ix
        pos0, kl, x, y = (field(fn, tile, n) for n in ("pos0", "kl", "x", "y"))
        pos = fn.add(pos0, fn.floordiv(m, G))
        key = edge_key(fn, tile, j)
        below = fn.cmp("slt", key, fn.min(fn.add(pos, x), kl))
        above = fn.cmp("sge", key, fn.max(fn.sub(fn.add(pos, 1), y), 0))  # CK: i - y + 1 <= j, j >= 0
        return fn.andi(below, above)

    if p.alibi:
        mask = _alibi_edges(c, mask_el)
    elif p.bias:
        mask = _bias_edges(c, mask_el)
    else:
        # CUDA: a block of 16 rows x 64 keys per workgroup, 16 bytes a thread (as masks.py's generators)
        attrs = block_attrs(p.main.lowering, rank=3, block=(16, STEP), vec=16) if p.mask_blocks else ""
        mask = generic(fn, tensor_type(["?", t.rows, "?"], "i1"), [c.n, c.e], 3, mask_el, attrs)

    def kv(which: str, d: int) -> str:
        src = (c.k if which == "k" else c.v, ["?", "?", "?", d], c.sizes(c.tk, c.hk))

        def el(ix, read, zero, elt):
            tile, h, j, dd = ix
            k0, kl, bi = (field(fn, tile, n) for n in ("k0", "kl", "entry"))
            key = edge_key(fn, tile, j)
            ok = fn.andi(fn.cmp("slt", key, kl), fn.cmp("sge", key, 0))
            row = fn.max(fn.min(fn.add(k0, key), fn.sub(c.tk, 1)), 0)
            return fn.let(f"arith.select {ok}, {read(c.at(bi, row, h, dd))}, {zero} : {elt}", "tv")

        return _copy(c, src, (["?", "?", "?", d], [c.n, c.hk, c.e]), el, row_dim=2)

    return mask, kv("k", p.dq), kv("v", p.dv)


def slope(fn: Fn, tile: str, head: str, hq: str) -> str:
    """The f32 ALiBi slope of query head ``head`` for the tile's row of ``%slopes`` (``[rows * Hq]``)."""
    at = fn.add(fn.mul(field(fn, tile, "sr"), hq), head)
    return fn.let(f"tensor.extract %slopes[{at}] : {tensor_type(['?'], 'f32')}", "sl")


def as_f32(fn: Fn, i: str) -> str:
    """An index as f32 (exact below 2**24)."""
    w = fn.let(f"arith.index_cast {i} : index to i64", "ai")
    return fn.let(f"arith.sitofp {w} : i64 to f32", "af")


def _alibi_edges(c: TilesFn, visible) -> str:
    """The edges' float mask ``[N, Hk, R, EW]`` with ALiBi: ``-inf`` where ``visible`` (the i1
    rule) is false, else the bias ``-slope * |a0 + r - key|`` (``a0 + r``: row ``r``'s position in
    the mask's frame) plus ``slope * r``. The interior adds ``slope * (key - a0)``, equal to that for
    every key left of the row's position (the host keeps the interior there): a row's every score
    is its bias plus the same ``slope * r``, which ``gathered`` takes off the LSE. Two dispatches:
    the head-free ``r - |a0 + r - key|`` (``[N, R, EW]``, as the i1 masks' generator), then times
    each head's slope (G = 1 with ALiBi: row ``r`` is position ``r``)."""
    fn, R = c.fn, c.t.rows

    def el(ix):
        tile, m, j = ix
        d = fn.sub(fn.add(field(fn, tile, "a0"), m), edge_key(fn, tile, j))
        val = as_f32(fn, fn.sub(m, fn.max(d, fn.sub(fn.c(0), d))))
        ninf = fn.let("arith.constant 0xFF800000 : f32", "an")
        return fn.let(f"arith.select {visible(ix)}, {val}, {ninf} : f32", "am")

    base_ty, out_ty = tensor_type(["?", R, "?"], "f32"), tensor_type(["?", "?", R, "?"], "f32")
    # CUDA: blocks of 16 rows x 64 keys, 16 bytes a thread (as the i1 masks' generator)
    attrs = block_attrs(c.p.main.lowering, rank=3, block=(16, STEP), vec=4) if c.p.mask_blocks else ""
    base = generic(fn, base_ty, [c.n, c.e], 3, el, attrs)

    def region():
        empty = fn.let(f"tensor.empty({c.n}, {c.hk}, {c.e}) : {out_ty}", "pe")
        out = fn.fresh("pg")
        fn.emit(f"{out} = linalg.generic {{indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>, "
                f"affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>], iterator_types = [{parallel(4)}]}} "
                f"ins({base} : {base_ty}) outs({empty} : {out_ty}) {{")
        with fn.region("^bb0(%ab_in: f32, %ab_o: f32):", f"}} -> {out_ty}"), fn.local():
            tile, hk = (fn.let(f"linalg.index {i} : index", "px") for i in range(2))
            scaled = fn.let(f"arith.mulf %ab_in, {slope(fn, tile, hk, c.hq)} : f32", "ab")
            ninf = fn.let("arith.constant 0xFF800000 : f32", "an")
            seen = fn.let(f"arith.cmpf ogt, %ab_in, {ninf} : f32", "ab")  # -inf stays (slope 0 would give NaN)
            fn.emit(f"linalg.yield {fn.let(f'arith.select {seen}, {scaled}, {ninf} : f32', 'ab')} : f32")
        return [out]

    return fn.dispatch([(out_ty, [c.n, c.hk, c.e])], region)[0]


def f32_mask(p: Plan) -> bool:
    """Whether the edges' mask is f32 per KV head (ALiBi, a bias) rather than i1 shared by the heads."""
    return p.alibi or p.bias


def bias_plane(fn: Fn, sr: str, hk: str, hs: str) -> str:
    """A tile's bias plane: its sequence's first (``sr``) plus its KV head times the head stride."""
    return fn.add(sr, fn.mul(hk, hs))


def _bias_edges(c: TilesFn, visible) -> str:
    """The edges' float mask ``[N, Hk, R, EW]`` with an elementwise bias: the bias at the tile's row
    and edge key where ``visible`` (the i1 rule) holds, else ``-inf`` (keys outside the sequence
    read its last one, then masked)."""
    fn, p, R = c.fn, c.p, c.t.rows
    keys = c.bias_dims[2]
    out_ty = tensor_type(["?", "?", R, "?"], "f32")

    def el(ix):
        tile, hk, m, j = ix
        plane = bias_plane(fn, field(fn, tile, "sr"), hk, c.hs)
        row = fn.add(fn.mul(field(fn, tile, "pos0"), c.t.group), m)
        key = fn.max(fn.min(edge_key(fn, tile, j), fn.sub(keys, 1)), 0)
        val = fn.let(f"tensor.extract %bias[{plane}, {row}, {key}] : {c.bias_ty}", "bv")
        if p.dtype != "f32":
            val = fn.let(f"arith.extf {val} : {p.dtype} to f32", "bv")
        ninf = fn.let("arith.constant 0xFF800000 : f32", "an")
        return fn.let(f"arith.select {visible((tile, m, j))}, {val}, {ninf} : f32", "am")

    return generic(fn, out_ty, [c.n, c.hk, c.e], 4, el)


def alibi_ramps(c: TilesFn) -> tuple[str, str, str]:
    """(the ramps ``[rows * Hq, AL]`` f32, element ``(s, u)`` = ``%slopes[s] * (u - AL + 1)``, their
    rows, ``AL``): the interior's bias ``slope * (key - a0)`` is the slice of its slope's ramp from
    ``lo - a0 + AL - 1`` (the host makes ``AL`` reach every interior's first key)."""
    fn = c.fn
    al = fn.bounded(fn.arith("arith.index_cast %AL : i64 to index", "AL"))
    ns = fn.bounded(fn.dim("%slopes", tensor_type(["?"], "f32"), 0))
    last = fn.sub(al, 1)

    def el(ix):
        s, u = ix
        sl = fn.let(f"tensor.extract %slopes[{s}] : {tensor_type(['?'], 'f32')}", "sl")
        return fn.let(f"arith.mulf {sl}, {as_f32(fn, fn.sub(u, last))} : f32", "ar")

    return generic(fn, tensor_type(["?", "?"], "f32"), [ns, al], 2, el), ns, al


def copies_q(c: TilesFn) -> bool:
    """Whether the tiles read Q from their own copy (``q_tiles``) rather than in place."""
    return c.t.group > 1 or c.p.alibi or c.p.bias


def q_tiles(c: TilesFn) -> tuple[str, str, list[str]]:
    """(Q as the op reads it, its type, its sizes): ``%q`` itself where ``G == 1``, else each
    tile's rows copied ``[N, Hk, R, Dq]`` (with ALiBi too: its tiles take fewer rows than a tile,
    decode, rows past Q's end read as its last)."""
    fn, p, t = c.fn, c.p, c.t
    if not copies_q(c):
        return c.flat("q")
    G = t.group

    def el(ix, read, zero, elt):
        tile, hk, m, d = ix
        q0, bi = field(fn, tile, "q0"), field(fn, tile, "entry")
        row = fn.min(fn.add(q0, fn.floordiv(m, G)), fn.sub(c.tq, 1))
        h = fn.add(fn.mul(hk, G), fn.arith(f"arith.remsi {m}, {fn.c(G)} : index", "tr"))
        return read(c.at(bi, row, h, d))

    shape = ["?", "?", t.rows, p.dq]
    out = _copy(c, ("%q", ["?", "?", "?", p.dq], c.sizes(c.tq, c.hq)), (shape, [c.n, c.hk]), el, row_dim=2)
    return out, tensor_type(shape, p.dtype), [c.n, c.hk]


def gathered(c: TilesFn, out_t: str, lse_t: str) -> tuple[str, str]:
    """Dispatch 4: out (q's layout) and LSE ``[NL, Hq, RL]`` from the tiles' rows (the row maps
    after the table: tile * positions + position in the tile, or -1)."""
    fn, p, t = c.fn, c.p, c.t
    G, P, R = t.group, t.positions, t.rows
    lt_ty = tensor_type(["?", "?", R], "f32")

    def src(at: str, row: str, hq: str):
        r = read_idx(fn, at, row)
        ok = fn.cmp("sge", r, 0)
        rr = fn.max(r, 0)
        tile, pos = fn.floordiv(rr, P), fn.arith(f"arith.remsi {rr}, {fn.c(P)} : index", "tr")
        hk, g = fn.floordiv(hq, G), fn.arith(f"arith.remsi {hq}, {fn.c(G)} : index", "tr")
        return ok, tile, hk, fn.add(fn.mul(pos, G), g)

    def out_el(ix, read, zero, elt):
        bi, row, hq, d = ix if c.bshd else (ix[0], ix[2], ix[1], ix[3])
        ok, tile, hk, m = src(c.at_out, fn.add(fn.mul(bi, c.tq), row), hq)
        return fn.let(f"arith.select {ok}, {read([tile, hk, m, d])}, {zero} : {elt}", "tv")

    def lse_el(ix):
        n, hq, row = ix
        ok, tile, hk, m = src(c.at_lse, fn.add(fn.mul(n, c.rl), row), hq)
        val = fn.let(f"tensor.extract {lse_t}[{tile}, {hk}, {m}] : {lt_ty}", "tv")
        if p.alibi:  # every score of row r carried slope * r more than its bias (_alibi_edges)
            off = fn.let(f"arith.mulf {slope(fn, tile, hq, c.hq)}, {as_f32(fn, fn.floordiv(m, G))} : f32", "tv")
            val = fn.let(f"arith.subf {val}, {off} : f32", "tv")
        ninf = fn.let("arith.constant 0xFF800000 : f32", "tn")
        return fn.let(f"arith.select {ok}, {val}, {ninf} : f32", "tv")

    out = _copy(c, (out_t, ["?", "?", R, p.dv], [c.n, c.hk]), (["?", "?", "?", p.dv], c.sizes(c.tq, c.hq)), out_el,
                row_dim=1 if c.bshd else 2)
    lse = generic(fn, tensor_type(["?", "?", "?"], "f32"), [c.nl, c.hq, c.rl], 3, lse_el)
    return out, lse
