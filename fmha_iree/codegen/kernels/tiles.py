"""Attention as tiles that each run over their own keys (``fwd_tiles``): CK's one-launch form, for
group mode (packed tokens, ``[1, T, H, D]``) and batch mode (``[B, S, H, D]`` or ``[B, H, S, D]``,
each batch entry a sequence).

Every sequence's query rows are cut into tiles of ``R / G`` positions (``R`` state rows: the ``G``
query heads of a KV head as rows, as everywhere in the package). The host writes one row per tile
into the index table (``key_tiles.tile_table``): where its Q rows start, where its sequence's keys
start, its key counts, its first position, its sequence's key count, CK's ``x`` and ``y`` and its
batch entry (rows and keys count within it). Its keys ``[lo, lo + nk)`` are seen by every row of
the tile (the interior, ``nk`` a multiple of ``STEP``); its edge, ``ne`` keys (at most ``EW``)
seen by some rows, is the ``nl`` keys before the interior (a window's left slope), then those
after it. The table holds the tiles longest first (the GPU then starts its longest work first) and the
grid is ``(Hk, tiles)``: each workgroup reads its tile's row and loads exactly its slices of Q, K
and V (``flow.dispatch.workgroups``: IREE keeps the workgroup's ids in the loads' offsets and the
op's key count dynamic per workgroup, one loop whose trip count each workgroup reads). Dispatches:

1. the edge's keys copied per tile, rows its sequence does not own zeroed (a neighbour's NaN or a
   gap's stays out: a masked key adds ``-inf`` to its score and ``0 * V`` to the sum, so its K and
   V must be finite), and the edge's mask ``[tiles, R, EW]`` (CK's rule with the sequence's ``y``, ``x``);
2. the interior: an unmasked ``online_attention`` over ``nk`` keys read in place -> f32 state;
3. the edge: a masked op over ``ne`` keys chained on that state, normalized -> each tile's rows of
   out and LSE; two workgroups a tile (``EDGE_PARTS``), the first half of its rows over the ``nh``
   keys they see;
4. out (the layout of q) and LSE ``[NL, Hq, RL]`` gathered from the tiles' rows (the table's row
   maps; rows no sequence owns are 0 / -inf).

The table's columns, the function's shared values and the copies (1 and 4, and a paged cache's
rows) are ``tile_io``; this module holds the two attention dispatches and the function.

Masks: every CK mask (none, causal either alignment, windows), any Sq / Sk per sequence.
One op per workgroup cannot hold two (IREE 3.13: "multiple ops within dispatch trying to set the
translation info"), hence the state between 2 and 3; one masked op over all of a tile's keys (its
mask a slice of an all-true strip) measured slower on the H200 (docs/tried.md, "H200: tiles over
their own keys, how `fwd_tiles` reached its form").
"""

from __future__ import annotations

import dataclasses

from .attention import Operand, online_attention
from .ir import Fn, tensor_type
from .operands import Plan
from .tile_io import (STEP, TILE_COLUMNS, TILE_FIELDS, TilesFn, TilesShape, alibi_ramps, copies_q,
                      edge_inputs, f32_mask, gathered, gathered_keys, q_tiles, tile_row)
from .workgroups import Body, load, store, workgroups

__all__ = ["TILE_COLUMNS", "TILE_FIELDS", "STEP", "TilesShape", "tiles_shape", "render_tiles", "tiles_module"]

# Rows and key steps of the tiles' ops on GPUs: 128 rows with 64-key steps measured fastest on the
# H200 (sm_80 f16 d128) for the 16-sequence causal prefill and causal batches, against 32-key
# steps and 256-row tiles (docs/tried.md, "H200: tiles over their own keys, how `fwd_tiles`
# reached its form").
GPU_ROWS, GPU_K2 = 128, 64
CPU_ROWS, CPU_K2 = 64, 16  # llvm-cpu (tests): whole rows per workgroup, short vector steps
SHORT_ROWS = 16  # the short tiles' rows (``tiles_shape(short=True)``; the short tier's on GPUs)
# The edge's workgroups per tile, each over half the tile's rows and the keys those rows see (a
# causal tile's first half needs one key step of the two): measured faster than one part on the
# H100 (sm_80 f16 d128) for group-mode prefill and causal batches (docs/BENCHMARKS.md, "The
# tiles' edge in halves").
from ...problem.abi import BIAS_ROWS, BIAS_ROWS_SHORT, EDGE_PARTS

# an elementwise bias's planes hold BIAS_ROWS (BIAS_ROWS_SHORT) rows at least (problem.bias)
assert max(GPU_ROWS, CPU_ROWS) <= BIAS_ROWS and SHORT_ROWS <= BIAS_ROWS_SHORT


def tiles_shape(p: Plan, short: bool = False) -> TilesShape | None:
    """The path's sizes for plan ``p``, or None where the module has no such path (off in the plan,
    head dims padded on the way, a GPU lowering IREE chooses itself, a group that does not divide
    the rows). ``short``: tiles of the short tier's 16 rows (decode; ALiBi modules, whose only path
    this is)."""
    lw = p.main.lowering
    if not p.tiles or p.pads or not isinstance(lw, dict) or (p.alibi and p.group > 1):
        return None
    if lw.get("backend") == "cpu":
        rows = SHORT_ROWS if short else CPU_ROWS
        low = {"backend": "cpu", "workgroup_m": rows, "vector_m": 2, "reduction_k2": CPU_K2}
        if rows % p.group:
            return None
        parts = EDGE_PARTS if (rows // p.group) % EDGE_PARTS == 0 else 1
        low["masked"] = {"workgroup_m": rows // parts}
    else:
        from .banded import band_tier

        tier = p.short if short else band_tier(p.main, GPU_ROWS)
        rows, red = tier.tile_rows, int(tier.lowering.get("reduction_k2", 32))
        k2 = (red if short else min(GPU_K2, STEP)) if STEP % red == 0 else 0
        if not k2 or rows % p.group:
            return None
        low = {**{k: v for k, v in tier.lowering.items() if k != "masked"}, "reduction_k2": k2, "workgroup_m": rows}
        parts, low["masked"] = _gpu_edge(low, rows, rows // p.group, p.dv)
    pos = rows // p.group
    # an edge: before the interior, pos - 1 keys of a window's left slope; after it, < STEP keys of
    # rounding + pos - 1 of the right slope (key_tiles.tile_table)
    ew = -(-(pos - 1) // STEP) * STEP + -(-(pos + STEP - 2) // STEP) * STEP
    return TilesShape(rows, p.group, ew, low, parts)


def _gpu_edge(low: dict, rows: int, pos: int, dv: int) -> tuple[int, dict]:
    """(parts, the masked op's layout) on GPUs. The edge takes one subgroup per 16 rows where Dv
    >= 128: at 32 rows a warp both ops spill (ptxas for sm_90, f16 d128: interior 388 bytes, edge
    228), at 16 neither; the edge then ran the 16-sequence prefill faster on the H100
    (docs/BENCHMARKS.md, "The tiles' edge on one warp per 16 rows"). It splits in
    ``EDGE_PARTS`` where a part keeps the interior's threads: with fewer, each thread copies more
    of K / V into shared memory and the edge spills (sm_90: d256 44 bytes on 4 warps, none on 8;
    d32 G = 8 24 bytes on 2 warps, none on 4)."""
    sg, sgn = int(low.get("subgroup_size", 32)), int(low.get("subgroups_n", 1))  # subgroups along Dv (RDNA)
    edge_rows = 16 if dv >= 128 else rows // int(low.get("subgroups_m", 1))
    threads = int(low.get("workgroup_size", sg * int(low.get("subgroups_m", 1)) * sgn))
    m = rows // EDGE_PARTS
    split = pos % EDGE_PARTS == 0 and m % edge_rows == 0 and sg * sgn * m // edge_rows >= threads
    parts, m = (EDGE_PARTS, m) if split else (1, rows)
    return parts, {"workgroup_m": m, "subgroups_m": m // edge_rows, "workgroup_size": sg * sgn * m // edge_rows}


def _q_tile(b: Body, c: TilesFn, q, row: dict[str, str], hk: str, tile: str, dims: dict, rows: tuple | None = None
            ) -> Operand:
    """The tile's Q rows ``[R, Dq]`` (positions x the G heads of KV head ``hk``), or ``rows`` =
    (first, count) of them: read in place where ``G == 1``, else from the tiles' copy (``q_tiles``:
    rows of G heads are no strided view of Q, and a collapse inside the dispatch fails to compile
    for CUDA and llvm-cpu)."""
    p, t = c.p, c.t
    r0, n = rows or (b.c(0), t.rows)
    ty = tensor_type([n, p.dq], p.dtype)
    if not copies_q(c):
        first = b.let(f"arith.addi {row['q0']}, {r0} : index")
        loaded = c.load_rows(b, q, row["entry"], first, hk, n, dims["tq"], dims["hq"], ty)
        return Operand(loaded, ty, ("m", "k1"))
    return Operand(load(b, q, [tile, hk, r0, b.c(0)], [1, 1, n, p.dq], ty), ty, ("m", "k1"))


@dataclasses.dataclass(frozen=True)
class _Part:
    """One part of the tiles' online-softmax state (acc, max, sum): ``shape`` one tile's, ``dims``
    the op's dims that index it; the whole part is ``[N, Hk, *shape]``."""

    shape: tuple
    dims: tuple

    @property
    def tile_type(self) -> str:
        return tensor_type(list(self.shape), "f32")

    @property
    def type(self) -> str:
        return tensor_type(["?", "?", *self.shape], "f32")

    def at(self, b: Body, tile: str, hk: str, rows: tuple | None = None) -> tuple[list[str], list[int]]:
        """(offsets, sizes) of the tile's slice for ``load`` / ``store``, or of ``rows`` =
        (first, count) of its rows."""
        r0, n = rows or (b.c(0), self.shape[0])
        return [tile, hk, r0] + [b.c(0)] * (len(self.shape) - 1), [1, 1, n, *self.shape[1:]]

    def rows_type(self, n: int) -> str:
        return tensor_type([n, *self.shape[1:]], "f32")


def _parts(c: TilesFn) -> list[_Part]:
    R = c.t.rows
    return [_Part((R, c.p.dv), ("m", "n")), _Part((R,), ("m",)), _Part((R,), ("m",))]


def _fresh(b: Body, c: TilesFn) -> list[Operand]:
    """The state a tile starts from: (0, -FLT_MAX, 0)."""
    zero = b.let("arith.constant 0.0 : f32")
    fmin = b.let("arith.constant -3.40282347E+38 : f32")
    outs = []
    for part, init in zip(_parts(c), (zero, fmin, zero)):
        ty = part.tile_type
        e = b.let(f"tensor.empty() : {ty}")
        outs.append(Operand(b.let(f"linalg.fill ins({init} : f32) outs({e} : {ty}) -> {ty}"), ty, part.dims))
    return outs


def _scale(b: Body, c: TilesFn, scale: str) -> str:
    return scale if c.p.dtype == "f32" else b.let(f"arith.truncf {scale} : f32 to {c.p.dtype}")


def _interior(c: TilesFn, ramps: tuple[str, str, str] | None = None) -> list[str]:
    """Dispatch 2: the f32 state ``[N, Hk, R(, Dv)]`` of each tile over its interior keys;
    ``ramps`` (``tile_io.alibi_ramps``, G = 1): each key's ALiBi bias as the op's float mask; with
    an elementwise bias, the tile's ``[R, nk]`` block of it."""
    fn, p, t = c.fn, c.p, c.t
    grid = (c.hk, c.n)
    sizes = [c.n, c.hk]
    kf, vf = c.flat("k"), c.flat("v")
    ops = [c.q_src, kf, vf, (c.table, tensor_type(["?"], "i32"), [c.at_out]), ("%scale", "f32", []), *c.dim_ops()]
    if ramps is not None:
        ops += [(ramps[0], tensor_type(["?", "?"], "f32"), [ramps[1], ramps[2]]), (ramps[2], "index", [])]
    if p.bias:
        ops += [("%bias", c.bias_ty, c.bias_dims), (c.hs, "index", [])]

    def body(b: Body, a, outs):
        hk = b.let("flow.dispatch.workgroup.id[0] : index")
        tile = b.let("flow.dispatch.workgroup.id[1] : index")
        row = tile_row(b, a[c.table], tile)
        nk = b.let(f"util.assume.int {row['nk']}<umin = 0, umax = 2147483647, udiv = {STEP}> : index")
        dims = c.dims_in(a)
        q = _q_tile(b, c, a[c.q_src[0]], row, hk, tile, dims)
        first = b.let(f"arith.addi {row['k0']}, {row['lo']} : index")
        kv = []
        for view, d, role in ((kf, p.dq, "k1"), (vf, p.dv, "n")):
            ty = tensor_type(["?", d], p.dtype)
            kv.append(Operand(c.load_rows(b, a[view[0]], row["entry"], first, hk, nk, dims["tk"], dims["hk"], ty), ty,
                              ("k2", role)))
        bias = None
        if ramps is not None:  # the slope's ramp from lo - a0 + AL - 1: slope * (key - a0)
            u0 = b.let(f"arith.subi {row['lo']}, {row['a0']} : index")
            u0 = b.let(f"arith.addi {u0}, {a[ramps[2]]} : index")
            u0 = b.let(f"arith.subi {u0}, {b.c(1)} : index")
            sh = b.let(f"arith.muli {row['sr']}, {dims['hq']} : index")
            sh = b.let(f"arith.addi {sh}, {hk} : index")
            bty = tensor_type(["?"], "f32")
            bias = Operand(load(b, a[ramps[0]], [sh, u0], [1, nk], bty), bty, ("k2",))
        elif p.bias:  # the tile's rows of its plane, its interior keys
            r0 = b.let(f"arith.muli {row['pos0']}, {b.c(t.group)} : index")
            plane = b.let(f"arith.muli {hk}, {a[c.hs]} : index")
            plane = b.let(f"arith.addi {row['sr']}, {plane} : index")
            bty = tensor_type([t.rows, "?"], p.dtype)
            bias = Operand(load(b, a["%bias"], [plane, r0, row["lo"]], [1, t.rows, nk], bty), bty, ("m", "k2"))
        res = online_attention(fn, q=q, k=kv[0], v=kv[1], scale=_scale(b, c, a["%scale"]), scale_type=p.dtype,
                               outs=_fresh(b, c), nb=0, lowering=t.lowering, dv=p.dv, softcap=p.softcap, bias=bias)
        for r, part, view in zip(res, _parts(c), outs):
            store(b, r, part.tile_type, view, *part.at(b, tile, hk))

    return workgroups(fn, grid, ops, [(part.type, sizes) for part in _parts(c)], body)


def _edge(c: TilesFn, state: list[str], mask: str, ek: str, ev: str) -> list[str]:
    """Dispatch 3: the edge keys chained on the state, normalized: each tile's out ``[N, Hk, R,
    Dv]`` and LSE ``[N, Hk, R]`` (natural log; -inf where a row saw no key). With ``parts == 2``
    a workgroup takes half a tile's rows: the first half the ``nh`` keys its rows see (a prefix of
    the edge: the left slope, then the keys after the interior), the second all ``ne``."""
    fn, p, t = c.fn, c.p, c.t
    R, ew, parts = t.rows, t.ew, t.parts
    rh = R // parts
    ops = [c.q_src, *c.dim_ops(), (ek, tensor_type(["?", "?", "?", p.dq], p.dtype), [c.n, c.hk, c.e]),
           (ev, tensor_type(["?", "?", "?", p.dv], p.dtype), [c.n, c.hk, c.e]),
           (mask, _mask_type(c), [c.n, c.hk, c.e] if f32_mask(p) else [c.n, c.e]),
           (c.table, tensor_type(["?"], "i32"), [c.at_out]), ("%scale", "f32", [])]
    ops += [(s, part.type, [c.n, c.hk]) for s, part in zip(state, _parts(c))]
    out_tys = [tensor_type(["?", "?", R, p.dv], p.dtype), tensor_type(["?", "?", R], "f32")]

    def body(b: Body, a, outs):
        hk = b.let("flow.dispatch.workgroup.id[0] : index")
        wid = b.let("flow.dispatch.workgroup.id[1] : index")
        tile, r0 = wid, b.c(0)
        if parts > 1:
            tile = b.let(f"arith.divui {wid}, {b.c(parts)} : index")
            half = b.let(f"arith.remui {wid}, {b.c(parts)} : index")
            r0 = b.let(f"arith.muli {half}, {b.c(rh)} : index")
        row = tile_row(b, a[c.table], tile)
        ne = row["ne"]
        if parts > 1:
            first = b.let(f"arith.cmpi eq, {half}, {b.c(0)} : index")
            ne = b.let(f"arith.select {first}, {row['nh']}, {ne} : index")
        ne = b.let(f"util.assume.int {ne}<umin = 0, umax = {ew}, udiv = {STEP}> : index")
        rows = (r0, rh)
        q = _q_tile(b, c, a[c.q_src[0]], row, hk, tile, c.dims_in(a), rows)
        kv = []
        for name, d, role in ((ek, p.dq, "k1"), (ev, p.dv, "n")):
            ty = tensor_type(["?", d], p.dtype)
            kv.append(Operand(load(b, a[name], [tile, hk, b.c(0), b.c(0)], [1, 1, ne, d], ty), ty, ("k2", role)))
        mty = tensor_type([rh, "?"], "f32" if f32_mask(p) else "i1")
        at, sz = ([tile, hk, r0, b.c(0)], [1, 1, rh, ne]) if f32_mask(p) else ([tile, r0, b.c(0)], [1, rh, ne])
        m = Operand(load(b, a[mask], at, sz, mty), mty, ("m", "k2"))
        prev = [Operand(load(b, a[s], *part.at(b, tile, hk, rows), part.rows_type(rh)), part.rows_type(rh), part.dims)
                for s, part in zip(state, _parts(c))]
        acc, mx, sm = online_attention(fn, q=q, k=kv[0], v=kv[1], scale=_scale(b, c, a["%scale"]), scale_type=p.dtype,
                                       outs=prev, nb=0, lowering=t.lowering, dv=p.dv, mask=m,
                                       softcap=p.softcap)
        o, lse = _normalized(b, c, acc, mx, sm, rh)
        store(b, o, tensor_type([rh, p.dv], p.dtype), outs[0], [tile, hk, r0, b.c(0)], [1, 1, rh, p.dv])
        store(b, lse, tensor_type([rh], "f32"), outs[1], [tile, hk, r0], [1, 1, rh])

    return workgroups(fn, (c.hk, fn.mul(c.n, parts) if parts > 1 else c.n), ops,
                      [(ty, [c.n, c.hk]) for ty in out_tys], body)


def _mask_type(c: TilesFn) -> str:
    """The edges' mask: i1 ``[N, R, EW]``, with ALiBi or a bias f32 ``[N, Hk, R, EW]`` (``tile_io``)."""
    R = c.t.rows
    return tensor_type(["?", "?", R, "?"], "f32") if f32_mask(c.p) else tensor_type(["?", R, "?"], "i1")


def _normalized(b: Body, c: TilesFn, acc: str, mx: str, sm: str, R: int) -> tuple[str, str]:
    """(acc / sum of ``R`` rows in the input type, LSE = (max + log2 sum) ln 2), 0 and -inf where
    sum is 0."""
    dv, dt = c.p.dv, c.p.dtype
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
    if dt != "f32":
        b.fn.emit(f"  %wt = arith.truncf %ws : f32 to {dt}")
    b.fn.emit(f"  linalg.yield {'%wt' if dt != 'f32' else '%ws'} : {dt}")
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


def render_tiles(p: Plan, func_name: str = "fwd_tiles", paged: bool = False, short: bool = False) -> str | None:
    """``util.func public @func_name(q, k, v, idx, scale, N, NL, RL, E)`` (q / k / v in the plan's
    layout, ``B`` entries of ``Tq`` / ``Tk`` rows) -> (out in that layout, LSE ``[NL, Hq, RL]``,
    then the scratch: mask, edge K / V, state, the tiles' out and LSE, the tiles' Q where G > 1);
    None where ``tiles_shape`` has no path for the plan. ``idx``: the table ``[N, TILE_FIELDS]``,
    then the out rows' map ``[B * Tq]`` and the LSE rows' ``[NL * RL]`` (tile * positions +
    position in it, or -1); ``E``: the widest edge's keys, a multiple of ``STEP`` up to the
    shape's ``ew`` (the edge copies and mask hold that many keys per tile). ``paged``
    (``fwd_tiles_paged``, bshd): k / v are a paged cache's rows ``[1, pages * page, Hk, D]``, the
    table ends with the cache row of each of the ``TK`` keys in sequence order (a scalar more),
    gathered first (``tile_io.gathered_keys``). ``short``: ``tiles_shape``'s short tiles. ALiBi
    modules take ``slopes`` after ``idx`` and ``AL`` last, bias modules ``bias`` (planes ``[P,
    rows, keys]``, ``problem.bias``) and ``HS`` (the head stride of its planes)."""
    t = tiles_shape(p, short)
    if t is None:
        return None
    if paged and p.layout != "bshd":
        return None
    fn = Fn()
    c = TilesFn(fn, p, t)
    kv_rows = gathered_keys(c) if paged else []
    mask, ek, ev = edge_inputs(c)
    c.q_src = q_tiles(c)
    ramps = alibi_ramps(c) if p.alibi else None
    state = _interior(c, ramps)
    out_t, lse_t = _edge(c, state, mask, ek, ev)
    out, lse = gathered(c, out_t, lse_t)
    R = t.rows
    names = [out, lse, mask, ek, ev, *state, out_t, lse_t, *([c.q_src[0]] if copies_q(c) else []), *kv_rows]
    types = [tensor_type(["?", "?", "?", p.dv], p.dtype), tensor_type(["?", "?", "?"], "f32"),
             _mask_type(c), tensor_type(["?", "?", "?", p.dq], p.dtype),
             tensor_type(["?", "?", "?", p.dv], p.dtype), *(part.type for part in _parts(c)),
             tensor_type(["?", "?", R, p.dv], p.dtype), tensor_type(["?", "?", R], "f32"),
             *([c.q_src[1]] if copies_q(c) else []), *([c.q_ty, c.v_ty] if paged else [])]
    slopes = f"%slopes: {tensor_type(['?'], 'f32')}, " if p.alibi else ""
    slopes += f"%bias: {c.bias_ty}, " if p.bias else ""
    args = (f"%q: {c.q_ty}, %k: {c.q_ty}, %v: {c.v_ty}, %idx: {tensor_type(['?'], 'i32')}, {slopes}%scale: f32, "
            "%N: i64, %NL: i64, %RL: i64, %E: i64" + (", %TK: i64" if paged else "") + (", %AL: i64" if p.alibi else "")
            + (", %HS: i64" if p.bias else ""))
    tys = ", ".join(types)
    return (f"util.func public @{func_name}({args}) -> ({tys}) {{\n" + fn.text()
            + f"\n  util.return {', '.join(names)} : {tys}\n}}\n")


def tiles_module(p: Plan | None, name: str) -> str:
    """An ALiBi or bias module: ``fwd_tiles`` / ``fwd_tiles_paged`` with the slopes or the bias as
    an argument, and their 16-row forms (``fwd_tiles_short*``) for decode-shaped calls (the 128-row
    tiles computed 128 rows for one: docs/BENCHMARKS.md, "ALiBi"); they take every mode (batch,
    group, paged, decode)."""
    kinds = [(f"fwd_tiles{sfx}{'_paged' if paged else ''}", paged, short)
             for sfx, short in (("", False), ("_short", True)) for paged in (False, True)]
    funcs = [f for f in (render_tiles(p, n, paged=pg, short=sh) for n, pg, sh in kinds)
             if f is not None] if p is not None else []
    if not funcs:
        what = ("alibi_slopes: no ALiBi kernel for {} (one query head per KV head, " if p is None or p.alibi else
                "bias: no bias kernel for {} (").format(name)
        raise ValueError(what + "head dims the target's tiles take without padding)")
    return f"module @{name} {{\n" + "\n".join(funcs) + "}\n"
