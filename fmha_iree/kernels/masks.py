"""The one place that emits visibility masks: the edges' ``[groups, 2, M, W]`` i1 tensor.

Element ``(g, e, m, j)`` says whether row ``s = g * rows + m // G`` of the sequence sees key
``start + j``, where ``start`` is the group's right edge (``e = 0``) or left edge (``e = 1``) start
(``bounds.group_bounds``). Rows past ``Sq`` (tile padding) see nothing. The interior needs no
mask: every row of a group sees all of it.
"""

from __future__ import annotations

from .bounds import group_bounds, row_hi, row_lo
from .ir import Fn, tensor_type

__all__ = ["edge_masks"]


def edge_masks(fn: Fn, *, groups: str, rows: str, m_rows: str, width: str, group: int, sq: str, sk: str,
               y: str, x: str, cols: int) -> tuple[str, str]:
    """Emit the mask generator; returns (value, type) of the ``[groups, 2, m_rows, width]`` mask."""
    ty = tensor_type(["?", 2, "?", "?"], "i1")
    empty = fn.let(f"tensor.empty({groups}, {m_rows}, {width}) : {ty}", "me")
    out = fn.fresh("mask")
    fn.emit(f"{out} = linalg.generic {{indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>], "
            'iterator_types = ["parallel", "parallel", "parallel", "parallel"]}')
    with fn.region(f"    outs({empty} : {ty}) {{", f"}} -> {ty}"), fn.local():
        fn.emit("^bb0(%mask_out: i1):")
        g, e, m, j = (fn.let(f"linalg.index {i} : index", "ix") for i in range(4))
        bd = group_bounds(fn, g=g, rows=rows, sq=sq, sk=sk, y=y, x=x, cols=cols)
        s = fn.add(bd.first, fn.floordiv(m, group))
        is_right = fn.cmp("eq", e, 0)
        start = fn.select(is_right, bd.right_lo, bd.left_lo)
        jj = fn.add(start, j)
        ok_row = fn.cmp("slt", s, sq)
        ok_lo = fn.cmp("sge", jj, row_lo(fn, s, y, sk))
        ok_hi = fn.cmp("slt", jj, row_hi(fn, s, x, sk))
        vis = fn.andi(fn.andi(ok_row, ok_lo), ok_hi)
        fn.emit(f"linalg.yield {vis} : i1")
    return out, ty
