"""The one place that emits visibility masks: every edge's ``[M, W]`` i1 tile, in one tensor
``[groups, 2, M, W]`` (``[B, groups, 2, M, W]`` in a ragged frame) computed by one dispatch
before the control flow, from a ``[groups, 2]`` table of each edge's rows and keys (one small
dispatch before it).

Element ``(g, e, m, j)`` says whether row ``s = g * rows + m // G`` of the sequence sees key
``start + j``, where ``start`` is the aligned window of the group's right edge (``e = 0``) or left
edge (``e = 1``) (``bounds.group_bounds``, ``bounds.edge_window``; CK's rule ``lo(s) <= j < hi(s)``,
and only keys of the edge itself). Rows past ``Sq`` (tile padding) see nothing. In a ragged frame
element ``(b, g, e, m, j)`` applies batch ``b``'s own rule from its descriptor column ``(qlen,
klen, y, x)``: rows past ``qlen`` and keys past ``klen`` are never seen.

The table reads one element of an input (``anchor``: K, or the ragged frame's descriptor) and
folds it into its result in a way that is always true: with no tensor input IREE 3.13 recomputes
the whole tensor at every op that uses it (its producers are cloned into consumers), and an input
it does not use is dropped.
"""

from __future__ import annotations

from .bounds import edge_window, group_bounds, row_hi, row_lo
from .elementwise import block_attrs
from .ir import parallel, tensor_type
from .operands import Ctx

__all__ = ["MASK_TYPE", "RAGGED_MASK_TYPE", "mask_type", "edge_masks", "ragged_generator"]

MASK_TYPE = tensor_type(["?", 2, "?", "?"], "i1")
RAGGED_MASK_TYPE = tensor_type(["?", "?", 2, "?", "?"], "i1")
_BITS = {"f16": "i16", "bf16": "i16", "f32": "i32"}


def mask_type(ragged: bool) -> str:
    return RAGGED_MASK_TYPE if ragged else MASK_TYPE


_TABLE_TYPE = tensor_type(["?", 2], "i32")


def _always(fn, value: str, elt: str) -> str:
    """An i1 that is always true but depends on ``value`` (an element of type ``elt``)."""
    bits = _BITS.get(elt, elt)
    b = fn.let(f"arith.bitcast {value} : {elt} to {bits}", "ab") if bits != elt else value
    one, zero = fn.let(f"arith.constant 1 : {bits}", "ab"), fn.let(f"arith.constant 0 : {bits}", "ab")
    return fn.let(f"arith.cmpi ne, {fn.let(f'arith.ori {b}, {one} : {bits}', 'ab')}, {zero} : {bits}", "ab")


def _edge_table(c: Ctx, groups: str, rows: str) -> list[str]:
    """Four ``[groups, 2]`` i32 tensors from one small dispatch: per (group, edge) the group's
    first row, the first key of the edge's aligned window and the edge's own keys ``[lo, hi)``
    (``bounds.group_bounds``, ``bounds.edge_window``). The mask generators read them instead of
    deriving them per element, which cost the ragged generator of a 16-sequence prefill a sixth of
    the call on the H200 (docs/tried.md, "H200: group-mode prefill over the sequences each group
    holds"). The table reads one element of an input (``anchor``): without a tensor input IREE 3.13
    would clone it into every consumer."""
    fn = c.fn
    if c.desc is None:
        a, a_ty, elt = c.k.name, c.k.type, c.p.dtype
        at = "[0, 0, 0, 0] [1, 1, 1, 1] [1, 1, 1, 1]"
    else:
        a, a_ty, elt = c.desc[0], tensor_type(["?"], "i32"), "i32"
        at = f"[{c.desc[1]}] [1] [1]"

    def region():
        one = fn.let(f"tensor.extract_slice {a}{at} : {a_ty} to tensor<{elt}>", "an")
        empty = fn.let(f"tensor.empty({groups}) : {_TABLE_TYPE}", "te")
        outs = [fn.fresh("tab") for _ in range(4)]
        fn.emit(f"{', '.join(outs)} = linalg.generic {{indexing_maps = [affine_map<(d0, d1) -> ()>"
                + ", affine_map<(d0, d1) -> (d0, d1)>" * 4 + '], iterator_types = ["parallel", "parallel"]}')
        types = ", ".join([_TABLE_TYPE] * 4)
        with fn.region(f"    ins({one} : tensor<{elt}>) outs({', '.join([empty] * 4)} : {types}) {{", f"}} -> ({types})"), \
                fn.local():
            fn.emit(f"^bb0(%tab_anchor: {elt}, %t0: i32, %t1: i32, %t2: i32, %t3: i32):")
            g, e = (fn.let(f"linalg.index {i} : index", "ix") for i in range(2))
            bd = group_bounds(fn, g=g, rows=rows, sq=c.sq, sk=c.sk, co=c.co, cols=c.p.cols)
            right = fn.cmp("eq", e, 0)
            lo, hi = fn.select(right, bd.right_lo, bd.left_lo), fn.select(right, bd.right_hi, bd.left_hi)
            start = edge_window(fn, lo, hi, c.limit, c.p.cols)[0]
            ok = _always(fn, "%tab_anchor", elt)
            vals = [fn.let(f"arith.index_cast {fn.select(ok, v, 0)} : index to i32", "tv") for v in (bd.first, start, lo, hi)]
            fn.emit(f"linalg.yield {', '.join(vals)} : i32, i32, i32, i32")
        return outs

    return fn.dispatch([(_TABLE_TYPE, [groups])] * 4, region)


def _edge_rule(c: Ctx, m: str, j: str, tab: list[str]) -> tuple[str, str, str, str]:
    """(row s, key jj, the edge's own range lo, hi) of element ``(g, e, m, j)`` from its table
    entries (i32 values: first row, window start, lo, hi)."""
    fn = c.fn
    first, start, lo, hi = (fn.let(f"arith.index_cast {t} : i32 to index", "te") for t in tab)
    return fn.add(first, fn.floordiv(m, c.p.group)), fn.add(start, j), lo, hi


def edge_masks(c: Ctx, *, groups: str, rows: str, m_rows: str, width: str, row_unit: int) -> str:
    """Emit the generator of the ``[groups, 2, m_rows, width]`` mask (``[B, ...]`` ragged) for
    groups of ``rows`` rows; ``m_rows`` a proven multiple of ``row_unit`` (the tier's tile rows),
    ``width`` of ``cols`` (the edges' windows are)."""
    tables = _edge_table(c, groups, rows)
    if c.desc is not None:
        return _ragged_masks(c, tables, groups=groups, m_rows=m_rows, width=width, row_unit=row_unit)
    fn = c.fn

    def element(ix, t0, t1, t2, t3):
        _, _, m, j = ix
        s, jj, lo, hi = _edge_rule(c, m, j, [t0, t1, t2, t3])
        return fn.andi(fn.andi(fn.cmp("slt", s, c.sq), fn.cmp("sge", jj, fn.max(lo, row_lo(fn, s, c.co.y, c.sk)))),
                       fn.cmp("slt", jj, fn.min(hi, row_hi(fn, s, c.co.x, c.sk))))

    ins = [(t, _TABLE_TYPE, "(d0, d1)") for t in tables]
    return _generator(c, MASK_TYPE, [groups, m_rows, width], 2, ins, element, row_unit)


def _ragged_masks(c: Ctx, tables: list[str], *, groups: str, m_rows: str, width: str, row_unit: int) -> str:
    def element(ql, kl, yb, xb, ix, *tab):
        _, _, m, j = ix
        s, jj, lo, hi = _edge_rule(c, m, j, list(tab))
        hi = c.fn.min(hi, c.fn.min(row_hi(c.fn, s, xb, c.sk), kl))
        return c.fn.andi(c.fn.andi(c.fn.cmp("slt", s, ql), c.fn.cmp("sge", jj, c.fn.max(lo, row_lo(c.fn, s, yb, c.sk)))),
                         c.fn.cmp("slt", jj, hi))

    return ragged_generator(c, [c.b, groups, m_rows, width], element, row_unit, tables)


def ragged_generator(c: Ctx, sizes: list[str], element, row_unit: int, tables: list[str] = ()) -> str:
    """One dispatch making a ``[B, ?, 2, ?, ?]`` i1 tensor of ``sizes`` (the dynamic ones; rows a
    proven multiple of ``row_unit``, keys of ``Plan.cols``) whose
    element ``(b, i1..i4)`` is ``element(qlen, klen, y, x, (i1..i4), *t)`` with batch ``b``'s
    descriptor column (read through ``(d0)`` maps, which IREE treats as elementwise) and ``t``
    the ``(i1, i2)`` entries of the ``[?, 2]`` i32 ``tables``."""
    fn = c.fn
    src, at = c.desc
    col_ty = tensor_type(["?"], "i32")
    starts = [fn.add(at, fn.mul(i, c.b)) for i in range(4)]

    def column(o):  # made inside the region: one binding of the descriptor, read at four offsets
        return lambda: fn.let(f"tensor.extract_slice {src}[{o}] [{c.b}] [1] : {col_ty} to {col_ty}", "dc")

    def body(ix, *vals):
        desc = [fn.let(f"arith.index_cast {v} : i32 to index", "rd") for v in vals[:4]]
        return element(*desc, ix[1:], *vals[4:])

    ins = [(column(o), col_ty, "(d0)") for o in starts] + [(t, _TABLE_TYPE, "(d1, d2)") for t in tables]
    return _generator(c, RAGGED_MASK_TYPE, sizes, 3, ins, body, row_unit)


_BLOCK_ROWS = 16  # rows of a mask block (a divisor of every tier's tile rows)


def _generator(c: Ctx, ty: str, sizes: list[str], lead: int, ins: list, element, row_unit: int) -> str:
    """One dispatch making the i1 tensor ``ty`` of dynamic ``sizes``, whose last two dims (rows,
    a proven multiple of ``row_unit``; keys, of ``Plan.cols``) are split into static loops of
    those units (as IREE would split them itself, dropping a lowering it was given) and generated
    in blocks of 16 rows x ``cols`` keys (``elementwise.block_attrs``). ``ins``: (tensor, or a
    function emitting one inside the region; type; map over the ``lead`` leading dims);
    ``element(ix, *in_values)`` gives the i1 at index ``ix`` (one per dim of ``ty``)."""
    fn, C = c.fn, c.p.cols
    rank = lead + 4
    dims = ", ".join(f"d{i}" for i in range(rank))
    shape = ty[len("tensor<"):-len("xi1>")].split("x")
    ex_ty = tensor_type([*shape[:lead], "?", row_unit, "?", C], "i1")
    ex_sizes = [*sizes[:-2], fn.floordiv(sizes[-2], row_unit), fn.floordiv(sizes[-1], C)]
    blocks = c.p.mask_blocks and row_unit % _BLOCK_ROWS == 0
    attrs = block_attrs(c.p.main.lowering, rank=rank, block=(_BLOCK_ROWS, 1, C), vec=16) if blocks else ""

    def region():
        names = [v() if callable(v) else v for v, _, _ in ins]
        empty = fn.let(f"tensor.empty({', '.join(ex_sizes)}) : {ex_ty}", "me")
        out = fn.fresh("mask")
        maps = "".join(f"affine_map<({dims}) -> {m}>, " for _, _, m in ins)
        fn.emit(f"{out} = linalg.generic {{indexing_maps = [{maps}affine_map<({dims}) -> ({dims})>], "
                f"iterator_types = [{parallel(rank)}]}}")
        types = ", ".join(t for _, t, _ in ins)
        with fn.region(f"    ins({', '.join(names)} : {types}) outs({empty} : {ex_ty}){attrs} {{",
                       f"}} -> {ex_ty}"), fn.local():
            vals = [f"%gi{i}" for i in range(len(ins))]
            fn.emit("^bb0(" + "".join(f"{v}: {t.split('x')[-1][:-1]}, " for v, (_, t, _) in zip(vals, ins))
                    + "%mask_out: i1):")
            ix = [fn.let(f"linalg.index {i} : index", "ix") for i in range(rank)]
            row = fn.add(fn.mul(ix[lead], row_unit), ix[lead + 1])
            key = fn.add(fn.mul(ix[lead + 2], C), ix[lead + 3])
            fn.emit(f"linalg.yield {element((*ix[:lead], row, key), *vals)} : i1")
        groups = ", ".join(f"[{i}]" for i in range(lead)) + f", [{lead}, {lead + 1}], [{lead + 2}, {lead + 3}]"
        return [fn.let(f"tensor.collapse_shape {out} [{groups}] : {ex_ty} into {ty}", "mc")]

    return fn.dispatch([(ty, sizes)], region)[0]
