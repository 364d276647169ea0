"""The one place that emits visibility masks: every edge's ``[M, W]`` i1 tile, in one tensor
``[groups, 2, M, W]`` (``[B, groups, 2, M, W]`` in a ragged frame) computed by one dispatch
before the control flow.

Element ``(g, e, m, j)`` says whether row ``s = g * rows + m // G`` of the sequence sees key
``start + j``, where ``start`` is the aligned window of the group's right edge (``e = 0``) or left
edge (``e = 1``) (``bounds.group_bounds``, ``bounds.edge_window``; CK's rule ``lo(s) <= j < hi(s)``,
and only keys of the edge itself). Rows past ``Sq`` (tile padding) see nothing. In a ragged frame
element ``(b, g, e, m, j)`` applies batch ``b``'s own rule from its descriptor column ``(qlen,
klen, y, x)``: rows past ``qlen`` and keys past ``klen`` are never seen.

The uniform generator reads one element of an input (``anchor``) and folds it into its result in a
way that is always true: with no tensor input IREE 3.13 recomputes the whole tensor at every edge
that uses it (its producers are cloned into consumers), and an input it does not use is dropped.
(The ragged one reads its descriptor.)
"""

from __future__ import annotations

from .bounds import edge_window, group_bounds, row_hi, row_lo
from .ir import tensor_type
from .operands import Ctx

__all__ = ["MASK_TYPE", "RAGGED_MASK_TYPE", "mask_type", "edge_masks", "ragged_generator"]

MASK_TYPE = tensor_type(["?", 2, "?", "?"], "i1")
RAGGED_MASK_TYPE = tensor_type(["?", "?", 2, "?", "?"], "i1")
_BITS = {"f16": "i16", "bf16": "i16", "f32": "i32"}


def mask_type(ragged: bool) -> str:
    return RAGGED_MASK_TYPE if ragged else MASK_TYPE


def _edge_rule(c: Ctx, g: str, e: str, m: str, j: str, rows: str) -> tuple[str, str, str, str]:
    """(row s, key jj, the edge's own range lo, hi) of element ``(g, e, m, j)``."""
    fn = c.fn
    bd = group_bounds(fn, g=g, rows=rows, sq=c.sq, sk=c.sk, co=c.co, cols=c.p.cols)
    s = fn.add(bd.first, fn.floordiv(m, c.p.group))
    right = fn.cmp("eq", e, 0)
    lo, hi = fn.select(right, bd.right_lo, bd.left_lo), fn.select(right, bd.right_hi, bd.left_hi)
    jj = fn.add(edge_window(fn, lo, hi, c.limit, c.p.cols)[0], j)
    return s, jj, lo, hi


def edge_masks(c: Ctx, *, groups: str, rows: str, m_rows: str, width: str) -> str:
    """Emit the generator of the ``[groups, 2, m_rows, width]`` mask (``[B, ...]`` ragged) for
    groups of ``rows`` rows; ``width`` a proven multiple of ``cols`` (the edges' windows are)."""
    if c.desc is not None:
        return _ragged_masks(c, groups=groups, rows=rows, m_rows=m_rows, width=width)
    fn, elt = c.fn, c.p.dtype
    a, a_ty = c.k.name, c.k.type
    bits = _BITS[elt]

    def region():
        one = fn.let(f"tensor.extract_slice {a}[0, 0, 0, 0] [1, 1, 1, 1] [1, 1, 1, 1] : {a_ty} to tensor<{elt}>", "an")
        empty = fn.let(f"tensor.empty({groups}, {m_rows}, {width}) : {MASK_TYPE}", "me")
        out = fn.fresh("mask")
        fn.emit(f"{out} = linalg.generic {{indexing_maps = [affine_map<(d0, d1, d2, d3) -> ()>, "
                "affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>], "
                'iterator_types = ["parallel", "parallel", "parallel", "parallel"]}')
        with fn.region(f"    ins({one} : tensor<{elt}>) outs({empty} : {MASK_TYPE}) {{", f"}} -> {MASK_TYPE}"), fn.local():
            fn.emit(f"^bb0(%mask_anchor: {elt}, %mask_out: i1):")
            g, e, m, j = (fn.let(f"linalg.index {i} : index", "ix") for i in range(4))
            s, jj, lo, hi = _edge_rule(c, g, e, m, j, rows)
            ok = fn.andi(fn.andi(fn.cmp("slt", s, c.sq), fn.cmp("sge", jj, fn.max(lo, row_lo(fn, s, c.co.y, c.sk)))),
                         fn.cmp("slt", jj, fn.min(hi, row_hi(fn, s, c.co.x, c.sk))))
            ab = fn.let(f"arith.bitcast %mask_anchor : {elt} to {bits}", "ab")
            one_b = fn.let(f"arith.constant 1 : {bits}", "ab")
            zero_b = fn.let(f"arith.constant 0 : {bits}", "ab")
            nz = fn.let(f"arith.cmpi ne, {fn.let(f'arith.ori {ab}, {one_b} : {bits}', 'ab')}, {zero_b} : {bits}", "ab")
            fn.emit(f"linalg.yield {fn.andi(ok, nz)} : i1")
        return [out]

    return fn.dispatch([(MASK_TYPE, [groups, m_rows, width])], region)[0]


def _ragged_masks(c: Ctx, *, groups: str, rows: str, m_rows: str, width: str) -> str:
    def element(ql, kl, yb, xb, ix):
        g, e, m, j = ix
        s, jj, lo, hi = _edge_rule(c, g, e, m, j, rows)
        hi = c.fn.min(hi, c.fn.min(row_hi(c.fn, s, xb, c.sk), kl))
        return c.fn.andi(c.fn.andi(c.fn.cmp("slt", s, ql), c.fn.cmp("sge", jj, c.fn.max(lo, row_lo(c.fn, s, yb, c.sk)))),
                         c.fn.cmp("slt", jj, hi))

    return ragged_generator(c, [c.b, groups, m_rows, width], element)


def ragged_generator(c: Ctx, sizes: list[str], element) -> str:
    """One dispatch making a ``[B, ?, 2, ?, ?]`` i1 tensor of ``sizes`` (the dynamic ones) whose
    element ``(b, i1..i4)`` is ``element(qlen, klen, y, x, (i1..i4))`` with batch ``b``'s
    descriptor column (read through ``(d0)`` maps, which IREE treats as elementwise)."""
    fn = c.fn
    src, at = c.desc
    col_ty = tensor_type(["?"], "i32")
    starts = [fn.add(at, fn.mul(i, c.b)) for i in range(4)]
    d5 = "d0, d1, d2, d3, d4"
    par = ", ".join(['"parallel"'] * 5)

    def region():
        cols = [fn.let(f"tensor.extract_slice {src}[{o}] [{c.b}] [1] : {col_ty} to {col_ty}", "dc") for o in starts]
        empty = fn.let(f"tensor.empty({', '.join(sizes)}) : {RAGGED_MASK_TYPE}", "me")
        out = fn.fresh("mask")
        maps = ", ".join([f"affine_map<({d5}) -> (d0)>"] * 4)
        fn.emit(f"{out} = linalg.generic {{indexing_maps = [{maps}, affine_map<({d5}) -> ({d5})>], "
                f"iterator_types = [{par}]}}")
        with fn.region(f"    ins({', '.join(cols)} : {', '.join([col_ty] * 4)}) outs({empty} : {RAGGED_MASK_TYPE}) {{",
                       f"}} -> {RAGGED_MASK_TYPE}"), fn.local():
            fn.emit("^bb0(%rq: i32, %rk: i32, %ry: i32, %rx: i32, %mask_out: i1):")
            desc = [fn.let(f"arith.index_cast {v} : i32 to index", "rd") for v in ("%rq", "%rk", "%ry", "%rx")]
            ix = tuple(fn.let(f"linalg.index {i} : index", "ix") for i in range(1, 5))
            fn.emit(f"linalg.yield {element(*desc, ix)} : i1")
        return [out]

    return fn.dispatch([(RAGGED_MASK_TYPE, sizes)], region)[0]
