"""What ``kernels.packed`` and its merge (``kernels.packed_merge``) share: the path's host values
(``Packed``), the paged pieces' sizes, an entry of the host's index table ``%idx`` as an index,
and a dispatch of one ``linalg.generic`` whose element is computed from its indices."""

from __future__ import annotations

import dataclasses

from .ir import Fn, parallel, tensor_type

__all__ = ["PAGE_ROWS", "PAGE_GROUP", "Packed", "read_idx", "generic", "last_rows"]

from ...problem.abi import PAGE_GROUP, PAGE_ROWS


@dataclasses.dataclass(frozen=True)
class Packed:
    """Host values (SSA names) of the path."""

    w: str  # keys per piece (a multiple of Plan.cols)
    npc: str  # whole pieces
    p0: str  # the first whole piece, in units of W rows
    s: str  # slots per piece (0: the path is off)
    first: str  # offset of first[NPc + 1] in %idx
    k_at: str  # offset of the key starts (k_base [B, NP], NP = 1) in %idx
    desc_at: str  # offset of the descriptor [4, B] in %idx
    q_at: str  # offset of the query rows [B, Sq] in %idx
    rows: str  # R = Sq * G
    m: str  # state rows per piece: S * R rounded up to the tier's tile rows
    pn: str  # NPc + 1
    nr: str  # rows of K / V
    tail_lo: str  # (P0 + NPc) * W: the first row the tail piece counts
    one: str  # an opaque 1 (a batch dim of size 1 that stays a dynamic size)
    on: str  # i1: the host asked for this path and its rows can be read
    k_src: str = "%k"  # the K / V the pieces are rows of: the arguments, or a paged cache's pages gathered
    v_src: str = "%v"
    nt: str = ""  # tail pieces: 1 (the last W rows), or B (pages: each sequence's last sub-page)
    pid: str = ""  # pages: offset in %idx of the used sub-pages' numbers [NU] (whole pieces read in place)


def last_rows(fn: Fn, kl: str) -> str:
    """Keys of a sequence of ``kl`` before its last sub-page (pages: the whole pieces' keys)."""
    return fn.mul(fn.floordiv(fn.max(fn.sub(kl, 1), 0), PAGE_ROWS), PAGE_ROWS)


def read_idx(fn: Fn, at: str, i: str) -> str:
    """``%idx[at + i]`` as an index."""
    v = fn.let(f"tensor.extract %idx[{fn.add(at, i)}] : {tensor_type(['?'], 'i32')}", "pi")
    return fn.let(f"arith.index_cast {v} : i32 to index", "pi")


def generic(fn: Fn, ty: str, sizes: list[str], rank: int, body, attrs: str = "") -> str:
    """One dispatch: a generic over a new ``ty`` of ``sizes`` whose element is ``body(indices)``
    (``attrs``: its lowering, ``elementwise.copy_attrs``)."""
    dd = ", ".join(f"d{i}" for i in range(rank))
    elt = ty.rsplit("x", 1)[1].rstrip(">")

    def region():
        empty = fn.let(f"tensor.empty({', '.join(sizes)}) : {ty}", "pe")
        out = fn.fresh("pg")
        fn.emit(f"{out} = linalg.generic {{indexing_maps = [affine_map<({dd}) -> ({dd})>], iterator_types = [{parallel(rank)}]}} "
                f"outs({empty} : {ty}){attrs} {{")
        with fn.region(f"^bb0(%pg_o: {elt}):", f"}} -> {ty}"), fn.local():
            ix = [fn.let(f"linalg.index {i} : index", "px") for i in range(rank)]
            fn.emit(f"linalg.yield {body(ix)} : {elt}")
        return [out]

    return fn.dispatch([(ty, sizes)], region)[0]
