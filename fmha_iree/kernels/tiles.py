"""Attention as tiles that each run over their own keys (``fwd_tiles``): CK's one-launch form, for
group mode (packed tokens, ``[1, T, H, D]``) and batch mode (``[B, S, H, D]`` or ``[B, H, S, D]``,
each batch entry a sequence).

Every sequence's query rows are cut into tiles of ``R / G`` positions (``R`` state rows: the ``G``
query heads of a KV head as rows, as everywhere in the package). The host writes one row per tile
into the index table (``key_tiles.tile_table``): where its Q rows start, where its sequence's keys
start, ``nk`` and ``ne``, its key counts, its first position, its sequence's key count, CK's ``x``
and its batch entry (rows and keys count within it). A tile's keys are ``[0, nk + ne)`` of its sequence: ``[0, nk)`` are seen by every row of the
tile (the interior, a multiple of ``STEP``), ``[nk, nk + ne)`` by some (the edge, at most ``EW``
keys). The table holds the tiles longest first (the GPU then starts its longest work first) and the
grid is ``(Hk, tiles)``: each workgroup reads its tile's row and loads exactly its slices of Q, K
and V (``flow.dispatch.workgroups``: IREE keeps the workgroup's ids in the loads' offsets and the
op's key count dynamic per workgroup, one loop whose trip count each workgroup reads). Dispatches:

1. the edge's keys copied per tile, rows its sequence does not own zeroed (a neighbour's NaN or a
   gap's stays out: a masked key adds ``-inf`` to its score and ``0 * V`` to the sum, so its K and
   V must be finite), and the edge's mask ``[tiles, R, EW]`` (CK's rule with the sequence's ``x``);
2. the interior: an unmasked ``online_attention`` over ``nk`` keys read in place -> f32 state;
3. the edge: a masked op over ``ne`` keys chained on that state, normalized -> each tile's rows of
   out and LSE;
4. out (the layout of q) and LSE ``[NL, Hq, RL]`` gathered from the tiles' rows (the table's row
   maps; rows no sequence owns are 0 / -inf).

Masks: those whose rows all see key 0 onward (no limit on the left within the sequence: none,
causal either alignment, windows whose left side spans the sequence), any Sq / Sk per sequence.
One op per workgroup cannot hold two (IREE 3.13: "multiple ops within dispatch trying to set the
translation info"), hence the state between 2 and 3; one masked op over all of a tile's keys (its
mask a slice of an all-true strip) measured slower (H200, 2026-12-05, docs/tried.md).
"""

from __future__ import annotations

import dataclasses

from .attention import Operand, online_attention
from .elementwise import as_words, block_attrs, copy_attrs, from_words, word_elems
from .ir import Fn, tensor_type
from .operands import Plan
from .packed_common import generic, read_idx
from .workgroups import Body, inner_size, load, store, workgroups

__all__ = ["TILE_COLUMNS", "TILE_FIELDS", "STEP", "TilesShape", "tiles_shape", "render_tiles"]

TILE_COLUMNS = ("q0", "k0", "nk", "ne", "pos0", "kl", "x", "entry")  # a tile's row of the table
TILE_FIELDS = len(TILE_COLUMNS)
STEP = 64  # the interior's key count is a multiple of it (the ops' key steps divide it)
# Rows and key steps of the tiles' ops on GPUs: H200, sm_80 f16 d128, 16 causal sequences of
# 128..2047 (2026-12-05, docs/BENCHMARKS.md): 128 rows / 64 keys 0.961 ms of kernels, 128 / 32
# 0.958, 256 / 32 1.167; B4 S4096 causal 1.809 / 1.850 / 1.989.
GPU_ROWS, GPU_K2 = 128, 64
CPU_ROWS, CPU_K2 = 64, 16  # llvm-cpu (tests): whole rows per workgroup, short vector steps


@dataclasses.dataclass(frozen=True)
class TilesShape:
    """The static sizes of ``fwd_tiles``: ``rows`` (R, state rows per tile), ``ew`` (edge keys at
    most), the op lowering (a workgroup is the whole op: ``workgroup_m == rows``)."""

    rows: int
    group: int
    ew: int
    lowering: dict

    @property
    def positions(self) -> int:
        return self.rows // self.group


def tiles_shape(p: Plan) -> TilesShape | None:
    """The path's sizes for plan ``p``, or None where the module has no such path (off in the plan,
    head dims padded on the way, a GPU lowering IREE chooses itself, a group that does not divide
    the rows)."""
    lw = p.main.lowering
    if not p.tiles or p.pads or not isinstance(lw, dict):
        return None
    if lw.get("backend") == "cpu":
        rows, low = CPU_ROWS, {"backend": "cpu", "workgroup_m": CPU_ROWS, "vector_m": 2, "reduction_k2": CPU_K2}
    else:
        from .banded import band_tier

        tier = band_tier(p.main, GPU_ROWS)
        rows = tier.tile_rows
        k2 = min(GPU_K2, STEP) if STEP % int(tier.lowering.get("reduction_k2", 32)) == 0 else 0
        if not k2:
            return None
        low = {**{k: v for k, v in tier.lowering.items() if k != "masked"}, "reduction_k2": k2, "workgroup_m": rows}
    if rows % p.group:
        return None
    pos = rows // p.group
    ew = -(-(pos + STEP - 2) // STEP) * STEP  # an edge: < STEP keys of rounding + pos - 1 of slope
    return TilesShape(rows, p.group, ew, low)


def _tile_row(b: Body, table, tile: str) -> list[str]:
    """The tile's table row as index values."""
    at = b.let(f"arith.muli {tile}, {b.c(TILE_FIELDS)} : index")
    row = load(b, table, [at], [TILE_FIELDS], f"tensor<{TILE_FIELDS}xi32>")
    vals = []
    for i in range(TILE_FIELDS):
        e = b.let(f"tensor.extract {row}[{b.c(i)}] : tensor<{TILE_FIELDS}xi32>")
        vals.append(b.let(f"arith.index_cast {e} : i32 to index"))
    return vals


class _Tiles:
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
        self.q_src: tuple = ("%q", self.q_ty, self.sizes(self.tq, self.hq))  # _q_tiles'
        self.k, self.v = "%k", "%v"  # the keys the tiles read (``_gathered_keys``: a paged cache's rows)

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


def _copy(c: _Tiles, src: tuple[str, list, list[str]], out: tuple[list, list[str]], element, row_dim: int) -> str:
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


def _gathered_keys(c: _Tiles):
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


def _edge_inputs(c: _Tiles) -> tuple[str, str, str]:
    """(mask ``[N, R, EW]`` i1, K and V edge copies ``[N, Hk, EW, D]``)."""
    fn, p, t = c.fn, c.p, c.t
    G = t.group

    def field(tile, i):
        return read_idx(fn, fn.c(0), fn.add(fn.mul(tile, TILE_FIELDS), i))

    def mask_el(ix):
        tile, m, j = ix
        nk, pos0, kl, x = field(tile, 2), field(tile, 4), field(tile, 5), field(tile, 6)
        pos = fn.add(pos0, fn.floordiv(m, G))
        key = fn.add(nk, j)
        return fn.cmp("slt", key, fn.min(fn.add(pos, x), kl))

    # CUDA: a block of 16 rows x 64 keys per workgroup, 16 bytes a thread (as masks.py's generators)
    attrs = block_attrs(p.main.lowering, rank=3, block=(16, STEP), vec=16) if p.mask_blocks else ""
    mask = generic(fn, tensor_type(["?", t.rows, "?"], "i1"), [c.n, c.e], 3, mask_el, attrs)

    def kv(which: str, d: int) -> str:
        src = (c.k if which == "k" else c.v, ["?", "?", "?", d], c.sizes(c.tk, c.hk))

        def el(ix, read, zero, elt):
            tile, h, j, dd = ix
            k0, nk, kl, bi = field(tile, 1), field(tile, 2), field(tile, 5), field(tile, 7)
            key = fn.add(nk, j)
            ok = fn.cmp("slt", key, kl)
            row = fn.min(fn.add(k0, key), fn.sub(c.tk, 1))
            return fn.let(f"arith.select {ok}, {read(c.at(bi, row, h, dd))}, {zero} : {elt}", "tv")

        return _copy(c, src, (["?", "?", "?", d], [c.n, c.hk, c.e]), el, row_dim=2)

    return mask, kv("k", p.dq), kv("v", p.dv)


def _q_tile(b: Body, c: _Tiles, q, row: list[str], hk: str, tile: str, dims: dict) -> Operand:
    """The tile's Q rows ``[R, Dq]`` (positions x the G heads of KV head ``hk``): read in place
    where ``G == 1``, else from the tiles' copy (``_q_tiles``: rows of G heads are no strided view
    of Q, and a collapse inside the dispatch fails to compile for CUDA and llvm-cpu)."""
    p, t = c.p, c.t
    ty = tensor_type([t.rows, p.dq], p.dtype)
    if t.group == 1:
        loaded = c.load_rows(b, q, row[7], row[0], hk, t.rows, dims["tq"], dims["hq"], ty)
        return Operand(loaded, ty, ("m", "k1"))
    return Operand(load(b, q, [tile, hk, b.c(0), b.c(0)], [1, 1, t.rows, p.dq], ty), ty, ("m", "k1"))


def _q_tiles(c: _Tiles) -> tuple[str, str, list[str]]:
    """(Q as the op reads it, its type, its sizes): ``%q`` itself where ``G == 1``, else each
    tile's rows copied ``[N, Hk, R, Dq]``."""
    fn, p, t = c.fn, c.p, c.t
    if t.group == 1:
        return c.flat("q")
    G = t.group

    def el(ix, read, zero, elt):
        tile, hk, m, d = ix
        q0 = read_idx(fn, fn.c(0), fn.mul(tile, TILE_FIELDS))
        bi = read_idx(fn, fn.c(0), fn.add(fn.mul(tile, TILE_FIELDS), 7))
        row = fn.min(fn.add(q0, fn.floordiv(m, G)), fn.sub(c.tq, 1))
        h = fn.add(fn.mul(hk, G), fn.arith(f"arith.remsi {m}, {fn.c(G)} : index", "tr"))
        return read(c.at(bi, row, h, d))

    shape = ["?", "?", t.rows, p.dq]
    out = _copy(c, ("%q", ["?", "?", "?", p.dq], c.sizes(c.tq, c.hq)), (shape, [c.n, c.hk]), el, row_dim=2)
    return out, tensor_type(shape, p.dtype), [c.n, c.hk]


def _state_types(c: _Tiles) -> list[str]:
    R = c.t.rows
    return [tensor_type(["?", "?", R, c.p.dv], "f32"), tensor_type(["?", "?", R], "f32"), tensor_type(["?", "?", R], "f32")]


def _fresh(b: Body, c: _Tiles) -> list[Operand]:
    R, dv = c.t.rows, c.p.dv
    zero = b.let("arith.constant 0.0 : f32")
    fmin = b.let("arith.constant -3.40282347E+38 : f32")
    outs = []
    for shape, init, dims in (([R, dv], zero, ("m", "n")), ([R], fmin, ("m",)), ([R], zero, ("m",))):
        ty = tensor_type(shape, "f32")
        e = b.let(f"tensor.empty() : {ty}")
        outs.append(Operand(b.let(f"linalg.fill ins({init} : f32) outs({e} : {ty}) -> {ty}"), ty, dims))
    return outs


def _scale(b: Body, c: _Tiles, scale: str) -> str:
    return scale if c.p.dtype == "f32" else b.let(f"arith.truncf {scale} : f32 to {c.p.dtype}")


def _interior(c: _Tiles) -> list[str]:
    """Dispatch 2: the f32 state ``[N, Hk, R(, Dv)]`` of each tile over its interior keys."""
    fn, p, t = c.fn, c.p, c.t
    R = t.rows
    grid = (c.hk, c.n)
    sizes = [c.n, c.hk]
    kf, vf = c.flat("k"), c.flat("v")
    ops = [c.q_src, kf, vf, (c.table, tensor_type(["?"], "i32"), [c.at_out]), ("%scale", "f32", []), *c.dim_ops()]

    def body(b: Body, a, outs):
        hk = b.let("flow.dispatch.workgroup.id[0] : index")
        tile = b.let("flow.dispatch.workgroup.id[1] : index")
        row = _tile_row(b, a[c.table], tile)
        k0, bi = row[1], row[7]
        nk = b.let(f"util.assume.int {row[2]}<umin = 0, umax = 2147483647, udiv = {STEP}> : index")
        dims = c.dims_in(a)
        q = _q_tile(b, c, a[c.q_src[0]], row, hk, tile, dims)
        kv = []
        for view, d, role in ((kf, p.dq, "k1"), (vf, p.dv, "n")):
            ty = tensor_type(["?", d], p.dtype)
            kv.append(Operand(c.load_rows(b, a[view[0]], bi, k0, hk, nk, dims["tk"], dims["hk"], ty), ty, ("k2", role)))
        res = online_attention(fn, q=q, k=kv[0], v=kv[1], scale=_scale(b, c, a["%scale"]), scale_type=p.dtype,
                               outs=_fresh(b, c), nb=0, lowering=t.lowering, dv=p.dv)
        for r, o, (view, shape) in zip(res, _fresh_types(c), zip(outs, ([1, 1, R, p.dv], [1, 1, R], [1, 1, R]))):
            store(b, r, o, view, [tile, hk] + [b.c(0)] * (len(shape) - 2), shape)

    return workgroups(fn, grid, ops, [(ty, sizes) for ty in _state_types(c)], body)


def _fresh_types(c: _Tiles) -> list[str]:
    R, dv = c.t.rows, c.p.dv
    return [tensor_type([R, dv], "f32"), tensor_type([R], "f32"), tensor_type([R], "f32")]


def _edge(c: _Tiles, state: list[str], mask: str, ek: str, ev: str) -> list[str]:
    """Dispatch 3: the edge keys chained on the state, normalized: each tile's out ``[N, Hk, R,
    Dv]`` and LSE ``[N, Hk, R]`` (natural log; -inf where a row saw no key)."""
    fn, p, t = c.fn, c.p, c.t
    R, ew = t.rows, t.ew
    st_tys = _state_types(c)
    ops = [c.q_src, *c.dim_ops(), (ek, tensor_type(["?", "?", "?", p.dq], p.dtype), [c.n, c.hk, c.e]),
           (ev, tensor_type(["?", "?", "?", p.dv], p.dtype), [c.n, c.hk, c.e]),
           (mask, tensor_type(["?", R, "?"], "i1"), [c.n, c.e]),
           (c.table, tensor_type(["?"], "i32"), [c.at_out]), ("%scale", "f32", [])]
    ops += [(s, ty, [c.n, c.hk]) for s, ty in zip(state, st_tys)]
    out_tys = [tensor_type(["?", "?", R, p.dv], p.dtype), tensor_type(["?", "?", R], "f32")]

    def body(b: Body, a, outs):
        hk = b.let("flow.dispatch.workgroup.id[0] : index")
        tile = b.let("flow.dispatch.workgroup.id[1] : index")
        row = _tile_row(b, a[c.table], tile)
        ne = b.let(f"util.assume.int {row[3]}<umin = 0, umax = {ew}, udiv = {STEP}> : index")
        q = _q_tile(b, c, a[c.q_src[0]], row, hk, tile, c.dims_in(a))
        kv = []
        for name, d, role in ((ek, p.dq, "k1"), (ev, p.dv, "n")):
            ty = tensor_type(["?", d], p.dtype)
            kv.append(Operand(load(b, a[name], [tile, hk, b.c(0), b.c(0)], [1, 1, ne, d], ty), ty, ("k2", role)))
        mty = tensor_type([R, "?"], "i1")
        m = Operand(load(b, a[mask], [tile, b.c(0), b.c(0)], [1, R, ne], mty), mty, ("m", "k2"))
        prev = []
        for s, ty, dims, shape in zip(state, _fresh_types(c), (("m", "n"), ("m",), ("m",)),
                                      ([1, 1, R, p.dv], [1, 1, R], [1, 1, R])):
            prev.append(Operand(load(b, a[s], [tile, hk] + [b.c(0)] * (len(shape) - 2), shape, ty), ty, dims))
        acc, mx, sm = online_attention(fn, q=q, k=kv[0], v=kv[1], scale=_scale(b, c, a["%scale"]), scale_type=p.dtype,
                                       outs=prev, nb=0, lowering=t.lowering, dv=p.dv, mask=m)
        o, lse = _normalized(b, c, acc, mx, sm)
        store(b, o, tensor_type([R, p.dv], p.dtype), outs[0], [tile, hk, b.c(0), b.c(0)], [1, 1, R, p.dv])
        store(b, lse, tensor_type([R], "f32"), outs[1], [tile, hk, b.c(0)], [1, 1, R])

    return workgroups(fn, (c.hk, c.n), ops, [(ty, [c.n, c.hk]) for ty in out_tys], body)


def _normalized(b: Body, c: _Tiles, acc: str, mx: str, sm: str) -> tuple[str, str]:
    """(acc / sum in the input type, LSE = (max + log2 sum) ln 2), 0 and -inf where sum is 0."""
    R, dv, dt = c.t.rows, c.p.dv, c.p.dtype
    at, vt = tensor_type([R, dv], "f32"), tensor_type([R], "f32")
    ot = tensor_type([R, dv], dt)
    e = b.let(f"tensor.empty() : {ot}")
    o = b.fn.fresh("w")
    b.fn.emit(f"{o} = linalg.generic {{indexing_maps = [affine_map<(r, d) -> (r, d)>, affine_map<(r, d) -> (r)>, "
              f"affine_map<(r, d) -> (r, d)>], iterator_types = [\"parallel\", \"parallel\"]}} "
              f"ins({acc}, {sm} : {at}, {vt}) outs({e} : {ot}) {{")
    b.fn.emit(f"^bb0(%wa: f32, %wl: f32, %wo: {dt}):")
    b.fn.emit("  %wz = arith.constant 0.0 : f32")
    b.fn.emit("  %wq = arith.divf %wa, %wl : f32")
    b.fn.emit("  %wp = arith.cmpf ogt, %wl, %wz : f32")
    b.fn.emit("  %ws = arith.select %wp, %wq, %wz : f32")
    b.fn.emit(f"  %wt = arith.truncf %ws : f32 to {dt}" if dt != "f32" else "  %wt = arith.addf %ws, %wz : f32")
    b.fn.emit(f"  linalg.yield %wt : {dt}")
    b.fn.emit(f"}} -> {ot}")
    e2 = b.let(f"tensor.empty() : {vt}")
    lse = b.fn.fresh("w")
    b.fn.emit(f"{lse} = linalg.generic {{indexing_maps = [affine_map<(r) -> (r)>, affine_map<(r) -> (r)>, "
              f"affine_map<(r) -> (r)>], iterator_types = [\"parallel\"]}} "
              f"ins({mx}, {sm} : {vt}, {vt}) outs({e2} : {vt}) {{")
    b.fn.emit("^bb0(%wm: f32, %wl: f32, %wo: f32):")
    b.fn.emit("  %wz = arith.constant 0.0 : f32")
    b.fn.emit("  %wn = arith.constant 0xFF800000 : f32")
    b.fn.emit("  %wln2 = arith.constant 0.693147180559945309 : f32")
    b.fn.emit("  %wg = math.log2 %wl : f32")
    b.fn.emit("  %wh = arith.addf %wm, %wg : f32")
    b.fn.emit("  %wi = arith.mulf %wh, %wln2 : f32")
    b.fn.emit("  %wp = arith.cmpf ogt, %wl, %wz : f32")
    b.fn.emit("  %wr = arith.select %wp, %wi, %wn : f32")
    b.fn.emit("  linalg.yield %wr : f32")
    b.fn.emit(f"}} -> {vt}")
    return o, lse


def _gathered(c: _Tiles, out_t: str, lse_t: str) -> tuple[str, str]:
    """Dispatch 4: out ``[1, Tq, Hq, Dv]`` and LSE ``[1, Hq, L]`` from the tiles' rows (the row
    maps after the table: tile * positions + position in the tile, or -1)."""
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
        ninf = fn.let("arith.constant 0xFF800000 : f32", "tn")
        return fn.let(f"arith.select {ok}, {val}, {ninf} : f32", "tv")

    out = _copy(c, (out_t, ["?", "?", R, p.dv], [c.n, c.hk]), (["?", "?", "?", p.dv], c.sizes(c.tq, c.hq)), out_el,
                row_dim=1 if c.bshd else 2)
    lse = generic(fn, tensor_type(["?", "?", "?"], "f32"), [c.nl, c.hq, c.rl], 3, lse_el)
    return out, lse


def render_tiles(p: Plan, func_name: str = "fwd_tiles", paged: bool = False) -> str | None:
    """``util.func public @func_name(q, k, v, idx, scale, N, NL, RL, E)`` (q / k / v in the plan's
    layout, ``B`` entries of ``Tq`` / ``Tk`` rows) -> (out in that layout, LSE ``[NL, Hq, RL]``,
    then the scratch: mask, edge K / V, state, the tiles' out and LSE, the tiles' Q where G > 1);
    None where ``tiles_shape`` has no path for the plan. ``idx``: the table ``[N, TILE_FIELDS]``,
    then the out rows' map ``[B * Tq]`` and the LSE rows' ``[NL * RL]`` (tile * positions +
    position in it, or -1); ``E``: the widest edge's keys, a multiple of ``STEP`` up to the
    shape's ``ew`` (the edge copies and mask hold that many keys per tile). ``paged``
    (``fwd_tiles_paged``, bshd): k / v are a paged cache's rows ``[1, pages * page, Hk, D]``, the
    table ends with the cache row of each of the ``TK`` keys in sequence order (a scalar more),
    gathered first (``_gathered_keys``)."""
    t = tiles_shape(p)
    if t is None:
        return None
    if paged and p.layout != "bshd":
        return None
    fn = Fn()
    c = _Tiles(fn, p, t)
    gathered = _gathered_keys(c) if paged else []
    mask, ek, ev = _edge_inputs(c)
    c.q_src = _q_tiles(c)
    state = _interior(c)
    out_t, lse_t = _edge(c, state, mask, ek, ev)
    out, lse = _gathered(c, out_t, lse_t)
    R = t.rows
    names = [out, lse, mask, ek, ev, *state, out_t, lse_t, *([c.q_src[0]] if t.group > 1 else []), *gathered]
    types = [tensor_type(["?", "?", "?", p.dv], p.dtype), tensor_type(["?", "?", "?"], "f32"),
             tensor_type(["?", R, "?"], "i1"), tensor_type(["?", "?", "?", p.dq], p.dtype),
             tensor_type(["?", "?", "?", p.dv], p.dtype), *_state_types(c),
             tensor_type(["?", "?", R, p.dv], p.dtype), tensor_type(["?", "?", R], "f32"),
             *([c.q_src[1]] if t.group > 1 else []), *([c.q_ty, c.v_ty] if paged else [])]
    args = (f"%q: {c.q_ty}, %k: {c.q_ty}, %v: {c.v_ty}, %idx: {tensor_type(['?'], 'i32')}, %scale: f32, "
            "%N: i64, %NL: i64, %RL: i64, %E: i64" + (", %TK: i64" if paged else ""))
    tys = ", ".join(types)
    return (f"util.func public @{func_name}({args}) -> ({tys}) {{\n" + fn.text()
            + f"\n  util.return {', '.join(names)} : {tys}\n}}\n")
