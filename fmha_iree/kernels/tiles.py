"""Group mode as tiles that each run over their own keys (``fwd_tiles``): CK's one-launch form.

Every sequence's query rows are cut into tiles of ``R / G`` positions (``R`` state rows: the ``G``
query heads of a KV head as rows, as everywhere in the package). The host writes one row per tile
into the index table (``key_tiles.tile_table``): where its Q rows start, where its sequence's keys
start, ``nk`` and ``ne``, its key counts, its first position, its sequence's key count and CK's
``x``. A tile's keys are ``[0, nk + ne)`` of its sequence: ``[0, nk)`` are seen by every row of the
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
4. out ``[1, Tq, Hq, Dv]`` and LSE ``[1, Hq, L]`` gathered from the tiles' rows (the table's row
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
from .elementwise import copy_attrs
from .ir import Fn, tensor_type
from .operands import Plan
from .packed_common import generic, read_idx

__all__ = ["TILE_FIELDS", "STEP", "TilesShape", "tiles_shape", "render_tiles"]

TILE_FIELDS = 8  # q0, k0, nk, ne, pos0, kl, x, (unused)
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
    """The path's sizes for plan ``p``, or None where the module has no such path (a ``bhsd``
    module, head dims padded on the way, a GPU lowering IREE chooses itself, a group that does
    not divide the rows)."""
    lw = p.main.lowering
    if not p.tiles or p.layout != "bshd" or p.pads or not isinstance(lw, dict):
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


class _Body:
    """Lines of one ``flow.dispatch.workgroups`` body: it is isolated from the function, so its
    constants are its own."""

    def __init__(self, fn: Fn):
        self.fn = fn
        self.consts: dict[int, str] = {}

    def c(self, v: int) -> str:
        if v not in self.consts:
            self.consts[v] = self.fn.let(f"arith.constant {v} : index", "wc")
        return self.consts[v]

    def let(self, expr: str) -> str:
        return self.fn.let(expr, "w")


def _workgroups(fn: Fn, grid: tuple[str, str], operands: list[tuple[str, str, list[str]]],
                results: list[tuple[str, list[str]]], body) -> list[str]:
    """``flow.dispatch.workgroups[grid]``: ``operands`` (name, type, dynamic sizes; index scalars
    with type ``index``), ``results`` (type, sizes). ``body(b, args, outs)`` gets the body's
    builder, the operands' bound views (tensors tied to their sizes) and the results' views."""
    names = [fn.fresh("wr") for _ in results]
    sizes = [d for _, ty, ds in operands for d in ds if _tensor(ty)] + [d for _, ds in results for d in ds]
    index_args = [n for n, ty, _ in operands if ty == "index"]
    # every size the body needs travels as an index operand
    extra = [s for s in dict.fromkeys(sizes) if s not in index_args]
    ops = [(n, ty, ds) for n, ty, ds in operands] + [(s, "index", []) for s in extra]
    sig = ", ".join(f"{ty}{{{', '.join(ds)}}}" if ds else ty for _, ty, ds in ops)
    res = ", ".join(f"{ty}{{{', '.join(ds)}}}" for ty, ds in results)
    caps, inner = [], {}
    for i, (n, ty, ds) in enumerate(ops):
        cap = f"%wa{i}_{fn.fresh('x')[1:]}"
        inner[n] = cap
        mode = "readonly"
        caps.append(f"{cap}: " + (f"!iree_tensor_ext.dispatch.tensor<{mode}:{ty}>" if _tensor(ty) else ty))
    out_caps = []
    for i, (ty, ds) in enumerate(results):
        cap = f"%wo{i}_{fn.fresh('x')[1:]}"
        out_caps.append(cap)
        caps.append(f"{cap}: !iree_tensor_ext.dispatch.tensor<writeonly:{ty}>")
    fn.emit(f"{', '.join(names)} = flow.dispatch.workgroups[{grid[0]}, {grid[1]}]({', '.join(n for n, _, _ in ops)}) : "
            f"({sig}) -> ({res}) =")
    fn.emit(f"    ({', '.join(caps)}) {{")
    fn._depth += 1
    b = _Body(fn)
    with fn.local():
        args = {}
        for n, ty, ds in ops:
            if not _tensor(ty):
                args[n] = inner[n]
                continue
            dty = f"!iree_tensor_ext.dispatch.tensor<readonly:{ty}>"
            args[n] = (b.let(f"flow.dispatch.tie_shape {inner[n]} : {dty}{{{', '.join(inner[d] for d in ds)}}}"), dty,
                       [inner[d] for d in ds])
        outs = []
        for cap, (ty, ds) in zip(out_caps, results):
            dty = f"!iree_tensor_ext.dispatch.tensor<writeonly:{ty}>"
            outs.append((b.let(f"flow.dispatch.tie_shape {cap} : {dty}{{{', '.join(inner[d] for d in ds)}}}"), dty,
                         [inner[d] for d in ds]))
        body(b, args, outs)
    fn.emit("flow.return")
    fn._depth -= 1
    fn.emit("} count(%wgx: index, %wgy: index) -> (index, index, index) {")
    fn.emit("  %wg1 = arith.constant 1 : index")
    fn.emit("  flow.return %wgx, %wgy, %wg1 : index, index, index")
    fn.emit("}")
    return names


def _tensor(ty: str) -> bool:
    return ty.startswith("tensor<")


def _load(b: _Body, view, offsets: list[str], sizes: list, ty: str) -> str:
    name, dty, ds = view
    return b.let(f"iree_tensor_ext.dispatch.tensor.load {name}, offsets = [{', '.join(offsets)}], sizes = "
                 f"[{', '.join(map(str, sizes))}], strides = [{', '.join(['1'] * len(sizes))}] : {dty}{{{', '.join(ds)}}} "
                 f"-> {ty}")


def _store(b: _Body, value: str, ty: str, view, offsets: list[str], sizes: list):
    name, dty, ds = view
    b.fn.emit(f"iree_tensor_ext.dispatch.tensor.store {value}, {name}, offsets = [{', '.join(offsets)}], sizes = "
              f"[{', '.join(map(str, sizes))}], strides = [{', '.join(['1'] * len(sizes))}] : {ty} -> "
              f"{dty}{{{', '.join(ds)}}}")


def _tile_row(b: _Body, table, tile: str) -> list[str]:
    """The tile's table row as index values."""
    at = b.let(f"arith.muli {tile}, {b.c(TILE_FIELDS)} : index")
    row = _load(b, table, [at], [TILE_FIELDS], f"tensor<{TILE_FIELDS}xi32>")
    vals = []
    for i in range(TILE_FIELDS - 1):
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
        s = {n: fn.bounded(fn.arith(f"arith.index_cast %{n} : i64 to index", n)) for n in ("N", "L")}
        self.n, self.l = s["N"], s["L"]
        self.tq = fn.bounded(fn.dim("%q", self.q_ty, 1))
        self.tk = fn.bounded(fn.dim("%k", self.q_ty, 1))
        self.hq = fn.bounded(fn.dim("%q", self.q_ty, 2))
        self.hk = fn.bounded(fn.dim("%k", self.q_ty, 2))
        self.one = fn.bounded(fn.dim("%q", self.q_ty, 0))
        self.idx_n = fn.bounded(fn.dim("%idx", tensor_type(["?"], "i32"), 0))
        self.at_out = fn.mul(self.n, TILE_FIELDS)
        self.at_lse = fn.add(self.at_out, self.tq)
        self.table = fn.let(f"tensor.extract_slice %idx[0] [{self.at_out}] [1] : {tensor_type(['?'], 'i32')} to "
                            f"{tensor_type(['?'], 'i32')}", "tt")
        self.q_src: tuple = ("%q", self.q_ty, [self.one, self.tq, self.hq])  # _q_tiles'


def _edge_inputs(c: _Tiles) -> tuple[str, str, str]:
    """(mask ``[N, R, EW]`` i1, K and V edge copies ``[N, EW, Hk, D]``)."""
    fn, p, t = c.fn, c.p, c.t
    G, ew = t.group, t.ew

    def field(tile, i):
        return read_idx(fn, fn.c(0), fn.add(fn.mul(tile, TILE_FIELDS), i))

    def mask_el(ix):
        tile, m, j = ix
        nk, pos0, kl, x = field(tile, 2), field(tile, 4), field(tile, 5), field(tile, 6)
        pos = fn.add(pos0, fn.floordiv(m, G))
        key = fn.add(nk, j)
        return fn.cmp("slt", key, fn.min(fn.add(pos, x), kl))

    mask = generic(fn, tensor_type(["?", t.rows, ew], "i1"), [c.n], 3, mask_el)

    def kv(which: str, d: int) -> str:
        src = "%k" if which == "k" else "%v"
        ty = c.q_ty if which == "k" else c.v_ty

        def el(ix):
            tile, j, h, dd = ix
            k0, nk, kl = field(tile, 1), field(tile, 2), field(tile, 5)
            key = fn.add(nk, j)
            ok = fn.cmp("slt", key, kl)
            row = fn.min(fn.add(k0, key), fn.sub(c.tk, 1))
            val = fn.let(f"tensor.extract {src}[{fn.c(0)}, {row}, {h}, {dd}] : {ty}", "tv")
            zero = fn.let(f"arith.constant 0.0 : {p.dtype}", "tz")
            return fn.let(f"arith.select {ok}, {val}, {zero} : {p.dtype}", "tv")

        out_ty = tensor_type(["?", ew, "?", d], p.dtype)
        return generic(fn, out_ty, [c.n, c.hk], 4, el, copy_attrs(p.main.lowering, rank=4, row_dim=1, inner=d))

    return mask, kv("k", p.dq), kv("v", p.dv)


def _q_tile(b: _Body, c: _Tiles, q, q0: str, hk: str, tile: str) -> Operand:
    """The tile's Q rows ``[R, Dq]`` (positions x the G heads of KV head ``hk``): read in place
    where ``G == 1``, else from the tiles' copy (``_q_tiles``: rows of G heads are no strided view
    of Q, and a collapse inside the dispatch fails to compile for CUDA and llvm-cpu)."""
    p, t = c.p, c.t
    ty = tensor_type([t.rows, p.dq], p.dtype)
    if t.group == 1:
        return Operand(_load(b, q, [b.c(0), q0, hk, b.c(0)], [1, t.rows, 1, p.dq], ty), ty, ("m", "k1"))
    return Operand(_load(b, q, [tile, hk, b.c(0), b.c(0)], [1, 1, t.rows, p.dq], ty), ty, ("m", "k1"))


def _q_tiles(c: _Tiles) -> tuple[str, str, list[str]]:
    """(Q as the op reads it, its type, its sizes): ``%q`` itself where ``G == 1``, else each
    tile's rows copied ``[N, Hk, R, Dq]``."""
    fn, p, t = c.fn, c.p, c.t
    if t.group == 1:
        return "%q", c.q_ty, [c.one, c.tq, c.hq]
    G = t.group

    def el(ix):
        tile, hk, m, d = ix
        q0 = read_idx(fn, fn.c(0), fn.mul(tile, TILE_FIELDS))
        row = fn.min(fn.add(q0, fn.floordiv(m, G)), fn.sub(c.tq, 1))
        h = fn.add(fn.mul(hk, G), fn.arith(f"arith.remsi {m}, {fn.c(G)} : index", "tr"))
        return fn.let(f"tensor.extract %q[{fn.c(0)}, {row}, {h}, {d}] : {c.q_ty}", "tv")

    ty = tensor_type(["?", "?", t.rows, p.dq], p.dtype)
    out = generic(fn, ty, [c.n, c.hk], 4, el, copy_attrs(p.main.lowering, rank=4, row_dim=2, inner=p.dq))
    return out, ty, [c.n, c.hk]


def _state_types(c: _Tiles) -> list[str]:
    R = c.t.rows
    return [tensor_type(["?", "?", R, c.p.dv], "f32"), tensor_type(["?", "?", R], "f32"), tensor_type(["?", "?", R], "f32")]


def _fresh(b: _Body, c: _Tiles) -> list[Operand]:
    R, dv = c.t.rows, c.p.dv
    zero = b.let("arith.constant 0.0 : f32")
    fmin = b.let("arith.constant -3.40282347E+38 : f32")
    outs = []
    for shape, init, dims in (([R, dv], zero, ("m", "n")), ([R], fmin, ("m",)), ([R], zero, ("m",))):
        ty = tensor_type(shape, "f32")
        e = b.let(f"tensor.empty() : {ty}")
        outs.append(Operand(b.let(f"linalg.fill ins({init} : f32) outs({e} : {ty}) -> {ty}"), ty, dims))
    return outs


def _scale(b: _Body, c: _Tiles, scale: str) -> str:
    return scale if c.p.dtype == "f32" else b.let(f"arith.truncf {scale} : f32 to {c.p.dtype}")


def _interior(c: _Tiles) -> list[str]:
    """Dispatch 2: the f32 state ``[N, Hk, R(, Dv)]`` of each tile over its interior keys."""
    fn, p, t = c.fn, c.p, c.t
    R = t.rows
    grid = (c.hk, c.n)
    sizes = [c.n, c.hk]
    ops = [c.q_src, ("%k", c.q_ty, [c.one, c.tk, c.hk]),
           ("%v", c.v_ty, [c.one, c.tk, c.hk]), (c.table, tensor_type(["?"], "i32"), [c.at_out]), ("%scale", "f32", [])]

    def body(b: _Body, a, outs):
        hk = b.let("flow.dispatch.workgroup.id[0] : index")
        tile = b.let("flow.dispatch.workgroup.id[1] : index")
        q0, k0, nk0, *_ = _tile_row(b, a[c.table], tile)
        nk = b.let(f"util.assume.int {nk0}<umin = 0, umax = 2147483647, udiv = {STEP}> : index")
        q = _q_tile(b, c, a[c.q_src[0]], q0, hk, tile)
        kv = []
        for name, d in (("%k", p.dq), ("%v", p.dv)):
            ty = tensor_type(["?", d], p.dtype)
            kv.append(Operand(_load(b, a[name], [b.c(0), k0, hk, b.c(0)], [1, nk, 1, d], ty), ty,
                              ("k2", "k1" if name == "%k" else "n")))
        res = online_attention(fn, q=q, k=kv[0], v=kv[1], scale=_scale(b, c, a["%scale"]), scale_type=p.dtype,
                               outs=_fresh(b, c), nb=0, lowering=t.lowering, dv=p.dv)
        for r, o, (view, shape) in zip(res, _fresh_types(c), zip(outs, ([1, 1, R, p.dv], [1, 1, R], [1, 1, R]))):
            _store(b, r, o, view, [tile, hk] + [b.c(0)] * (len(shape) - 2), shape)

    return _workgroups(fn, grid, ops, [(ty, sizes) for ty in _state_types(c)], body)


def _fresh_types(c: _Tiles) -> list[str]:
    R, dv = c.t.rows, c.p.dv
    return [tensor_type([R, dv], "f32"), tensor_type([R], "f32"), tensor_type([R], "f32")]


def _edge(c: _Tiles, state: list[str], mask: str, ek: str, ev: str) -> list[str]:
    """Dispatch 3: the edge keys chained on the state, normalized: each tile's out ``[N, Hk, R,
    Dv]`` and LSE ``[N, Hk, R]`` (natural log; -inf where a row saw no key)."""
    fn, p, t = c.fn, c.p, c.t
    R, ew = t.rows, t.ew
    st_tys = _state_types(c)
    ops = [c.q_src, (ek, tensor_type(["?", ew, "?", p.dq], p.dtype), [c.n, c.hk]),
           (ev, tensor_type(["?", ew, "?", p.dv], p.dtype), [c.n, c.hk]), (mask, tensor_type(["?", R, ew], "i1"), [c.n]),
           (c.table, tensor_type(["?"], "i32"), [c.at_out]), ("%scale", "f32", [])]
    ops += [(s, ty, [c.n, c.hk]) for s, ty in zip(state, st_tys)]
    out_tys = [tensor_type(["?", "?", R, p.dv], p.dtype), tensor_type(["?", "?", R], "f32")]

    def body(b: _Body, a, outs):
        hk = b.let("flow.dispatch.workgroup.id[0] : index")
        tile = b.let("flow.dispatch.workgroup.id[1] : index")
        q0, _, _, ne0, *_ = _tile_row(b, a[c.table], tile)
        ne = b.let(f"util.assume.int {ne0}<umin = 0, umax = {ew}, udiv = {STEP}> : index")
        q = _q_tile(b, c, a[c.q_src[0]], q0, hk, tile)
        kv = []
        for name, d, role in ((ek, p.dq, "k1"), (ev, p.dv, "n")):
            ty = tensor_type(["?", d], p.dtype)
            kv.append(Operand(_load(b, a[name], [tile, b.c(0), hk, b.c(0)], [1, ne, 1, d], ty), ty, ("k2", role)))
        mty = tensor_type([R, "?"], "i1")
        m = Operand(_load(b, a[mask], [tile, b.c(0), b.c(0)], [1, R, ne], mty), mty, ("m", "k2"))
        prev = []
        for s, ty, dims, shape in zip(state, _fresh_types(c), (("m", "n"), ("m",), ("m",)),
                                      ([1, 1, R, p.dv], [1, 1, R], [1, 1, R])):
            prev.append(Operand(_load(b, a[s], [tile, hk] + [b.c(0)] * (len(shape) - 2), shape, ty), ty, dims))
        acc, mx, sm = online_attention(fn, q=q, k=kv[0], v=kv[1], scale=_scale(b, c, a["%scale"]), scale_type=p.dtype,
                                       outs=prev, nb=0, lowering=t.lowering, dv=p.dv, mask=m)
        o, lse = _normalized(b, c, acc, mx, sm)
        _store(b, o, tensor_type([R, p.dv], p.dtype), outs[0], [tile, hk, b.c(0), b.c(0)], [1, 1, R, p.dv])
        _store(b, lse, tensor_type([R], "f32"), outs[1], [tile, hk, b.c(0)], [1, 1, R])

    return _workgroups(fn, (c.hk, c.n), ops, [(ty, [c.n, c.hk]) for ty in out_tys], body)


def _normalized(b: _Body, c: _Tiles, acc: str, mx: str, sm: str) -> tuple[str, str]:
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
    ot_ty = tensor_type(["?", "?", R, p.dv], p.dtype)
    lt_ty = tensor_type(["?", "?", R], "f32")

    def src(at: str, row: str, hq: str):
        r = read_idx(fn, at, row)
        ok = fn.cmp("sge", r, 0)
        rr = fn.max(r, 0)
        tile, pos = fn.floordiv(rr, P), fn.arith(f"arith.remsi {rr}, {fn.c(P)} : index", "tr")
        hk, g = fn.floordiv(hq, G), fn.arith(f"arith.remsi {hq}, {fn.c(G)} : index", "tr")
        return ok, tile, hk, fn.add(fn.mul(pos, G), g)

    def out_el(ix):
        _, row, hq, d = ix
        ok, tile, hk, m = src(c.at_out, row, hq)
        val = fn.let(f"tensor.extract {out_t}[{tile}, {hk}, {m}, {d}] : {ot_ty}", "tv")
        zero = fn.let(f"arith.constant 0.0 : {p.dtype}", "tz")
        return fn.let(f"arith.select {ok}, {val}, {zero} : {p.dtype}", "tv")

    def lse_el(ix):
        _, hq, row = ix
        ok, tile, hk, m = src(c.at_lse, row, hq)
        val = fn.let(f"tensor.extract {lse_t}[{tile}, {hk}, {m}] : {lt_ty}", "tv")
        ninf = fn.let("arith.constant 0xFF800000 : f32", "tn")
        return fn.let(f"arith.select {ok}, {val}, {ninf} : f32", "tv")

    out = generic(fn, tensor_type(["?", "?", "?", p.dv], p.dtype), [c.one, c.tq, c.hq], 4, out_el,
                  copy_attrs(p.main.lowering, rank=4, row_dim=1, inner=p.dv))
    lse = generic(fn, tensor_type(["?", "?", "?"], "f32"), [c.one, c.hq, c.l], 3, lse_el)
    return out, lse


def render_tiles(p: Plan, func_name: str = "fwd_tiles") -> str | None:
    """``util.func public @func_name(q [1, Tq, Hq, Dq], k [1, Tk, Hk, Dq], v, idx, scale, N, L)``
    -> (out ``[1, Tq, Hq, Dv]``, LSE ``[1, Hq, L]``, then the scratch: mask, edge K / V, state,
    the tiles' out and LSE); None where ``tiles_shape`` has no path for the plan. ``idx``: the
    table ``[N, TILE_FIELDS]``, then the out rows' map ``[Tq]`` and the LSE rows' ``[L]``."""
    t = tiles_shape(p)
    if t is None:
        return None
    fn = Fn()
    c = _Tiles(fn, p, t)
    mask, ek, ev = _edge_inputs(c)
    c.q_src = _q_tiles(c)
    state = _interior(c)
    out_t, lse_t = _edge(c, state, mask, ek, ev)
    out, lse = _gathered(c, out_t, lse_t)
    R, ew = t.rows, t.ew
    names = [out, lse, mask, ek, ev, *state, out_t, lse_t, *([c.q_src[0]] if t.group > 1 else [])]
    types = [tensor_type(["?", "?", "?", p.dv], p.dtype), tensor_type(["?", "?", "?"], "f32"),
             tensor_type(["?", R, ew], "i1"), tensor_type(["?", ew, "?", p.dq], p.dtype),
             tensor_type(["?", ew, "?", p.dv], p.dtype), *_state_types(c),
             tensor_type(["?", "?", R, p.dv], p.dtype), tensor_type(["?", "?", R], "f32"),
             *([c.q_src[1]] if t.group > 1 else [])]
    args = (f"%q: {c.q_ty}, %k: {c.q_ty}, %v: {c.v_ty}, %idx: {tensor_type(['?'], 'i32')}, %scale: f32, "
            "%N: i64, %L: i64")
    tys = ", ".join(types)
    return (f"util.func public @{func_name}({args}) -> ({tys}) {{\n" + fn.text()
            + f"\n  util.return {', '.join(names)} : {tys}\n}}\n")
