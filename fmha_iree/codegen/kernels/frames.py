"""The gathers between a ragged problem's own tensors and the padded frame ``fwd_ragged`` runs
on (``kernels.ragged``), each one explicit dispatch: a ``linalg.generic`` over its result whose
body extracts the element it reads (any index array, no host loop).

``gather_rows``: result ``[A, R, H, D]`` (``bshd``) or ``[A, H, R, D]`` (``bhsd``) row ``(a, r)``
is source row ``idx[a, r]`` of a rank-4 source read as rows (``n * R_src + r``; ``bshd`` or
``bhsd``), zeros where the index is -1. Packing Q / K / V into the frame and unpacking the output
are both this. ``gather_lse``: ``[A, H, R]`` from the frame's ``[B, H, S]`` LSE, -inf where -1.
Rows of -1 write zeros, so a frame never holds the caller's padding (NaN in a key masked out
would still reach the sum as ``0 * NaN``).
"""

from __future__ import annotations

import dataclasses

from .elementwise import Words, copy_attrs
from .ir import Fn, parallel, tensor_type

__all__ = ["ExplicitRows", "PagedRows", "gather_rows", "gather_lse", "rows_dims"]


def rows_dims(layout: str) -> tuple[int, int]:
    """(row axis, head axis) of a rank-4 tensor in ``layout``."""
    return (1, 2) if layout == "bshd" else (2, 1)


def _index(fn: Fn, idx: tuple[str, str], a: str, r: str) -> str:
    """``[a, r]`` int32 from a 1-D tensor at an offset (``idx`` = (tensor, offset)), sliced inside
    the dispatch region that reads it (a slice of an argument there is a binding offset, not a
    copy)."""
    flat, two = tensor_type(["?"], "i32"), tensor_type(["?", "?"], "i32")
    part = fn.let(f"tensor.extract_slice {idx[0]}[{idx[1]}] [{fn.mul(a, r)}] [1] : {flat} to {flat}", "ix")
    return fn.let(f"tensor.expand_shape {part} [[0, 1]] output_shape [{a}, {r}] : {flat} into {two}", "ix")


@dataclasses.dataclass(frozen=True)
class ExplicitRows:
    """The source row of result row ``(a, r)`` is ``idx[a, r]`` of an ``[A, R]`` int32 table at
    ``at`` in the 1-D ``tensor`` (-1: none)."""

    tensor: str
    at: str

    def inputs(self, fn: Fn, a: str, r: str, r_dim: int):
        """(the generic's inputs as (value, type, map results), what ``row`` reads besides)."""
        return [(_index(fn, (self.tensor, self.at), a, r), tensor_type(["?", "?"], "i32"), f"d0, d{r_dim}")], None

    def row(self, fn: Fn, args: list[str], r_dim: int, extra) -> str:
        return fn.let(f"arith.index_cast {args[0]} : i32 to index", "gr")


@dataclasses.dataclass(frozen=True)
class PagedRows:
    """Row ``j`` of sequence ``a`` is ``base[a, j // page] + j % page`` while ``j < len[a]``, else
    none: ``base`` ``[A, pages]`` int32 at ``base_at``, ``len`` ``[A]`` at ``len_at`` of the 1-D
    ``tensor`` (a paged cache's block table times the page size; a contiguous sequence is one
    page of its start). The page column is clamped to the table, so no index leaves it."""

    tensor: str
    base_at: str
    pages: str
    page: str
    len_at: str

    def inputs(self, fn: Fn, a: str, r: str, r_dim: int):
        flat = tensor_type(["?"], "i32")
        lens = fn.let(f"tensor.extract_slice {self.tensor}[{self.len_at}] [{a}] [1] : {flat} to {flat}", "ix")
        return [(lens, flat, "d0")], _index(fn, (self.tensor, self.base_at), a, self.pages)

    def row(self, fn: Fn, args: list[str], r_dim: int, base_table: str) -> str:
        n = fn.let("arith.index_cast " + args[0] + " : i32 to index", "gr")
        a, j = fn.let("linalg.index 0 : index", "gx"), fn.let(f"linalg.index {r_dim} : index", "gx")
        col = fn.min(fn.floordiv(j, self.page), fn.sub(self.pages, 1))
        base = fn.let(f"tensor.extract {base_table}[{a}, {col}] : {tensor_type(['?', '?'], 'i32')}", "gb")
        row = fn.add(fn.let(f"arith.index_cast {base} : i32 to index", "gr"),
                     fn.arith(f"arith.remsi {j}, {self.page} : index", "gr"))
        return fn.select(fn.cmp("slt", j, n), row, -1)


def gather_rows(fn: Fn, *, src: str, src_layout: str, src_rows: str, rows, size: tuple[str, str],
                heads: str, out_layout: str, dtype: str, d: int, d_src: int, lowering) -> str:
    """Emit the dispatch; ``rows`` (``ExplicitRows`` or ``PagedRows``) gives each result row's
    source row, ``size`` = (A, R), ``src_rows`` the source's row count per leading index, ``heads``
    the head count (host values); the result's head dim ``d`` >= the source's ``d_src`` (zeros
    past it). Returns the result."""
    r_out, h_out = rows_dims(out_layout)
    a, r = size
    shape = [a, r, heads] if out_layout == "bshd" else [a, heads, r]
    w = Words(dtype, d, d_src)  # moved as 64-bit words where the head dims allow
    src, src_ty = w.source(fn, src, tag="gd")  # sizes read where src is (it may be made in a path)
    elt, dw, dw_src = w.elt, w.dw, w.dw_src
    ty = tensor_type(["?", "?", "?", dw], elt)
    attrs = copy_attrs(lowering, rank=4, row_dim=r_out, inner=dw, vec=w.vec)
    d4 = "d0, d1, d2, d3"

    def region():
        ins, extra = rows.inputs(fn, a, r, r_out)
        empty = fn.let(f"tensor.empty({', '.join(shape)}) : {ty}", "ge")
        out = fn.fresh("g")
        maps = "".join(f"affine_map<({d4}) -> ({m})>, " for _, _, m in ins)
        fn.emit(f"{out} = linalg.generic {{indexing_maps = [{maps}affine_map<({d4}) -> ({d4})>], "
                f"iterator_types = [{parallel(4)}]}} ins({', '.join(v for v, _, _ in ins)} : {', '.join(t for _, t, _ in ins)}) "
                f"outs({empty} : {ty}){attrs} {{")
        args = [f"%gi{i}" for i in range(len(ins))]
        head = ", ".join(f"{x}: i32" for x in args)
        with fn.region(f"^bb0({head}, %go: {elt}):", f"}} -> {ty}"), fn.local():
            row = rows.row(fn, args, r_out, extra)
            ok = fn.cmp("sge", row, 0)
            safe = fn.max(row, 0)
            n, rr = fn.floordiv(safe, src_rows), fn.arith(f"arith.remsi {safe}, {src_rows} : index", "gr")
            h, dd = fn.let(f"linalg.index {h_out} : index", "gx"), fn.let("linalg.index 3 : index", "gx")
            if dw_src < dw:
                ok = fn.andi(ok, fn.cmp("slt", dd, dw_src))
                dd = fn.min(dd, dw_src - 1)
            at = [n, rr, h, dd] if src_layout == "bshd" else [n, h, rr, dd]
            val = fn.let(f"tensor.extract {src}[{', '.join(at)}] : {src_ty}", "gv")
            zero = fn.let(f"arith.constant {w.zero} : {elt}", "gz")
            fn.emit(f"linalg.yield {fn.let(f'arith.select {ok}, {val}, {zero} : {elt}', 'gv')} : {elt}")
        return [out]

    out = fn.dispatch([(ty, shape)], region)[0]
    return w.result(fn, out, shape)


def gather_lse(fn: Fn, *, lse: str, idx: tuple[str, str], size: tuple[str, str], heads: str, rows: str) -> str:
    """Emit the LSE gather: ``[A, H, R]`` (``size`` = (A, R), host values) from ``lse`` ``[B, H,
    rows]`` by the ``[A, R]`` index at ``idx`` (as ``gather_rows``)."""
    ty, i_ty = tensor_type(["?", "?", "?"], "f32"), tensor_type(["?", "?"], "i32")
    a, r = size
    d3 = "d0, d1, d2"

    def region():
        ix = _index(fn, idx, a, r)
        empty = fn.let(f"tensor.empty({a}, {heads}, {r}) : {ty}", "le")
        out = fn.fresh("ul")
        fn.emit(f"{out} = linalg.generic {{indexing_maps = [affine_map<({d3}) -> (d0, d2)>, affine_map<({d3}) -> ({d3})>], "
                f'iterator_types = ["parallel", "parallel", "parallel"]}} ins({ix} : {i_ty}) outs({empty} : {ty}) {{')
        with fn.region("^bb0(%li: i32, %lo: f32):", f"}} -> {ty}"), fn.local():
            row = fn.let("arith.index_cast %li : i32 to index", "lr")
            ok = fn.cmp("sge", row, 0)
            safe = fn.max(row, 0)
            bb, s = fn.floordiv(safe, rows), fn.arith(f"arith.remsi {safe}, {rows} : index", "lr")
            h = fn.let("linalg.index 1 : index", "lx")
            val = fn.let(f"tensor.extract {lse}[{bb}, {h}, {s}] : {ty}", "lv")
            ninf = fn.let("arith.constant 0xFF800000 : f32", "lz")
            fn.emit(f"linalg.yield {fn.let(f'arith.select {ok}, {val}, {ninf} : f32', 'lv')} : f32")
        return [out]

    return fn.dispatch([(ty, [a, heads, r])], region)[0]
