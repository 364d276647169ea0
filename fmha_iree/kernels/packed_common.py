"""What ``kernels.packed`` and its merge (``kernels.packed_merge``) share: the paged pieces' sizes,
an entry of the host's index table ``%idx`` as an index, and a dispatch of one ``linalg.generic``
whose element is computed from its indices."""

from __future__ import annotations

from .ir import Fn, parallel, tensor_type

__all__ = ["PAGE_ROWS", "PAGE_GROUP", "read_idx", "generic", "last_rows"]

PAGE_ROWS = 64  # mode "pages": pieces are sub-pages of this many rows (a cache page a multiple of it)
PAGE_GROUP = 4  # mode "pages": sub-pages per whole piece (W = PAGE_GROUP * PAGE_ROWS keys)


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
