"""Gathers between a ragged problem's own tensors and the padded frame ``fwd_ragged`` runs on.

``pack_<layout>_d<D>(src, idx) -> frame``: ``src`` ``[N, R, H, D]`` (``bshd``) or ``[N, H, R, D]``
(``bhsd``) read as ``N * R`` rows; ``idx`` int32 ``[B, S]`` names the source row of each frame row
(``n * R + r``), -1 for none (zeros). The frame is ``[B, S, H, D]`` or ``[B, H, S, D]`` in the
module's layout. Group mode packs ``[1, T, H, D]``, a paged cache ``[pages, page_size, H, D]``
(the index carries the block table), cu_seqlen batches their own ``[B, S, H, D]``.

``unpack_<layout>_d<D>(frame, idx) -> out``: the reverse, ``idx`` ``[N, R]`` naming the frame row
(``b * S + s``) of each output row, -1 for zeros. ``unpack_lse(lse, idx)``: ``[B, H, S]`` to
``[N, H, R]``, -inf for none.

Each is one ``linalg.generic`` over its result whose body extracts the element it reads (a gather:
any index array, no host loop); rows of -1 write zeros, so a frame never holds the caller's
padding (NaN in a key masked out would still reach the sum as ``0 * NaN``).
"""

from __future__ import annotations

from .elementwise import copy_attrs
from .ir import Fn, tensor_type

__all__ = ["pack_name", "unpack_name", "render_pack", "render_unpack", "render_unpack_lse"]


def pack_name(layout: str, d: int) -> str:
    return f"pack_{layout}_d{d}"


def unpack_name(layout: str, d: int) -> str:
    return f"unpack_{layout}_d{d}"


def _rows_dims(layout: str) -> tuple[int, int]:
    """(row axis, head axis) of a rank-4 tensor in ``layout``."""
    return (1, 2) if layout == "bshd" else (2, 1)


def _gather(fn: Fn, *, src: str, src_ty: str, src_layout: str, idx: str, out_shape: list[str], out_ty: str,
            out_layout: str, elt: str, fill: str, attrs: str) -> str:
    """The generic: result element ``(a, *, *, d)`` of row ``(a, r)`` reads source row
    ``idx[a, r]`` (flattened over the source's first two row dims)."""
    r_out, h_out = _rows_dims(out_layout)
    r_src, h_src = _rows_dims(src_layout)
    d4 = "d0, d1, d2, d3"
    par = ", ".join(['"parallel"'] * 4)
    i_ty = tensor_type(["?", "?"], "i32")
    src_rows = fn.dim(src, src_ty, r_src)
    empty = fn.let(f"tensor.empty({', '.join(out_shape)}) : {out_ty}", "ge")
    out = fn.fresh("g")
    fn.emit(f"{out} = linalg.generic {{indexing_maps = [affine_map<({d4}) -> (d0, d{r_out})>, "
            f"affine_map<({d4}) -> ({d4})>], iterator_types = [{par}]}} ins({idx} : {i_ty}) "
            f"outs({empty} : {out_ty}){attrs} {{")
    with fn.region("^bb0(%gi: i32, %go: " + elt + "):", f"}} -> {out_ty}"), fn.local():
        row = fn.let("arith.index_cast %gi : i32 to index", "gr")
        ok = fn.cmp("sge", row, 0)
        safe = fn.max(row, 0)
        n, r = fn.floordiv(safe, src_rows), fn.arith(f"arith.remsi {safe}, {src_rows} : index", "gr")
        h, d = fn.let(f"linalg.index {h_out} : index", "gx"), fn.let("linalg.index 3 : index", "gx")
        at = [n, r, h, d] if src_layout == "bshd" else [n, h, r, d]
        val = fn.let(f"tensor.extract {src}[{', '.join(at)}] : {src_ty}", "gv")
        zero = fn.let(f"arith.constant {fill} : {elt}", "gz")
        fn.emit(f"linalg.yield {fn.let(f'arith.select {ok}, {val}, {zero} : {elt}', 'gv')} : {elt}")
    return out


def _shape(fn: Fn, layout: str, lead: str, rows: str, heads: str, d: int) -> list[str]:
    return [lead, rows, heads, str(d)] if layout == "bshd" else [lead, heads, rows, str(d)]


def render_pack(*, dtype: str, src_layout: str, frame_layout: str, d: int, lowering) -> str:
    """``pack_<src_layout>_d<d>``: a module whose frames are ``frame_layout``."""
    fn = Fn()
    ty = tensor_type(["?", "?", "?", d], dtype)
    i_ty = tensor_type(["?", "?"], "i32")
    b, s = fn.dim("%idx", i_ty, 0), fn.dim("%idx", i_ty, 1)
    heads = fn.dim("%src", ty, _rows_dims(src_layout)[1])
    r_out = _rows_dims(frame_layout)[0]
    attrs = copy_attrs(lowering, rank=4, row_dim=r_out, inner=d)

    def body():
        return [_gather(fn, src="%src", src_ty=ty, src_layout=src_layout, idx="%idx",
                        out_shape=_shape(fn, frame_layout, b, s, heads, d)[:3], out_ty=ty, out_layout=frame_layout,
                        elt=dtype, fill="0.0", attrs=attrs)]

    out = fn.dispatch([(ty, _shape(fn, frame_layout, b, s, heads, d)[:3])], body)[0]
    return (f"util.func public @{pack_name(src_layout, d)}(%src: {ty}, %idx: {i_ty}) -> {ty} {{\n" + fn.text()
            + f"\n  util.return {out} : {ty}\n}}\n")


def render_unpack(*, dtype: str, frame_layout: str, out_layout: str, d: int, lowering) -> str:
    """``unpack_<out_layout>_d<d>``: a module whose frames are ``frame_layout``."""
    fn = Fn()
    ty = tensor_type(["?", "?", "?", d], dtype)
    i_ty = tensor_type(["?", "?"], "i32")
    n, r = fn.dim("%idx", i_ty, 0), fn.dim("%idx", i_ty, 1)
    heads = fn.dim("%frame", ty, _rows_dims(frame_layout)[1])
    attrs = copy_attrs(lowering, rank=4, row_dim=_rows_dims(out_layout)[0], inner=d)
    shape = _shape(fn, out_layout, n, r, heads, d)[:3]

    def body():
        return [_gather(fn, src="%frame", src_ty=ty, src_layout=frame_layout, idx="%idx", out_shape=shape, out_ty=ty,
                        out_layout=out_layout, elt=dtype, fill="0.0", attrs=attrs)]

    out = fn.dispatch([(ty, shape)], body)[0]
    return (f"util.func public @{unpack_name(out_layout, d)}(%frame: {ty}, %idx: {i_ty}) -> {ty} {{\n" + fn.text()
            + f"\n  util.return {out} : {ty}\n}}\n")


def render_unpack_lse() -> str:
    """``unpack_lse``: ``[B, H, S]`` frame LSE to ``[N, H, R]`` by ``idx`` ``[N, R]``."""
    fn = Fn()
    ty = tensor_type(["?", "?", "?"], "f32")
    i_ty = tensor_type(["?", "?"], "i32")
    n, r = fn.dim("%idx", i_ty, 0), fn.dim("%idx", i_ty, 1)
    heads, rows = fn.dim("%lse", ty, 1), fn.dim("%lse", ty, 2)
    d3 = "d0, d1, d2"

    def body():
        empty = fn.let(f"tensor.empty({n}, {heads}, {r}) : {ty}", "le")
        out = fn.fresh("ul")
        fn.emit(f"{out} = linalg.generic {{indexing_maps = [affine_map<({d3}) -> (d0, d2)>, affine_map<({d3}) -> ({d3})>], "
                f'iterator_types = ["parallel", "parallel", "parallel"]}} ins(%idx : {i_ty}) outs({empty} : {ty}) {{')
        with fn.region("^bb0(%li: i32, %lo: f32):", f"}} -> {ty}"), fn.local():
            row = fn.let("arith.index_cast %li : i32 to index", "lr")
            ok = fn.cmp("sge", row, 0)
            safe = fn.max(row, 0)
            bb, s = fn.floordiv(safe, rows), fn.arith(f"arith.remsi {safe}, {rows} : index", "lr")
            h = fn.let("linalg.index 1 : index", "lx")
            val = fn.let(f"tensor.extract %lse[{bb}, {h}, {s}] : {ty}", "lv")
            ninf = fn.let("arith.constant 0xFF800000 : f32", "lz")
            fn.emit(f"linalg.yield {fn.let(f'arith.select {ok}, {val}, {ninf} : f32', 'lv')} : f32")
        return [out]

    out = fn.dispatch([(ty, [n, heads, r])], body)[0]
    return (f"util.func public @unpack_lse(%lse: {ty}, %idx: {i_ty}) -> {ty} {{\n" + fn.text()
            + f"\n  util.return {out} : {ty}\n}}\n")
