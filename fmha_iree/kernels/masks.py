"""The one place that emits visibility masks: every edge's ``[M, W]`` i1 tile, in one tensor
``[groups, 2, M, W]`` computed by one dispatch before the control flow.

Element ``(g, e, m, j)`` says whether row ``s = g * rows + m // G`` of the sequence sees key
``start + j``, where ``start`` is the aligned window of the group's right edge (``e = 0``) or left
edge (``e = 1``) (``bounds.group_bounds``, ``bounds.edge_window``; CK's rule ``lo(s) <= j < hi(s)``,
and only keys of the edge itself). Rows past ``Sq`` (tile padding) see nothing.

The generator reads one element of an input (``anchor``) and folds it into its result in a way
that is always true: with no tensor input IREE 3.13 recomputes the whole tensor at every edge
that uses it (its producers are cloned into consumers), and an input it does not use is dropped.
"""

from __future__ import annotations

from .bounds import edge_window, group_bounds, row_hi, row_lo
from .ir import Fn, tensor_type

__all__ = ["MASK_TYPE", "edge_masks"]

MASK_TYPE = tensor_type(["?", 2, "?", "?"], "i1")
_BITS = {"f16": "i16", "bf16": "i16", "f32": "i32"}


def edge_masks(fn: Fn, *, groups: str, rows: str, m_rows: str, width: str, group: int, sq: str, sk: str,
               y: str, x: str, cols: int, anchor: tuple[str, str, str], limit: str) -> str:
    """Emit the generator; ``anchor`` is (value, type, element type) of a rank-4 input, ``width``
    a proven multiple of ``cols`` (the edges' windows are), ``limit`` the keys those windows may
    reach. Returns the ``[groups, 2, m_rows, width]`` mask."""
    a, a_ty, elt = anchor
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
            bd = group_bounds(fn, g=g, rows=rows, sq=sq, sk=sk, y=y, x=x, cols=cols)
            s = fn.add(bd.first, fn.floordiv(m, group))
            right = fn.cmp("eq", e, 0)
            lo, hi = fn.select(right, bd.right_lo, bd.left_lo), fn.select(right, bd.right_hi, bd.left_hi)
            jj = fn.add(edge_window(fn, lo, hi, limit, cols)[0], j)
            ok = fn.andi(fn.andi(fn.cmp("slt", s, sq), fn.cmp("sge", jj, fn.max(lo, row_lo(fn, s, y, sk)))),
                         fn.cmp("slt", jj, fn.min(hi, row_hi(fn, s, x, sk))))
            ab = fn.let(f"arith.bitcast %mask_anchor : {elt} to {bits}", "ab")
            one_b = fn.let(f"arith.constant 1 : {bits}", "ab")
            zero_b = fn.let(f"arith.constant 0 : {bits}", "ab")
            nz = fn.let(f"arith.cmpi ne, {fn.let(f'arith.ori {ab}, {one_b} : {bits}', 'ab')}, {zero_b} : {bits}", "ab")
            fn.emit(f"linalg.yield {fn.andi(ok, nz)} : i1")
        return [out]

    return fn.dispatch([(MASK_TYPE, [groups, m_rows, width])], region)[0]
