"""``fwd_ragged``: a ragged problem (group mode, cu_seqlen padding, a paged cache) in one call,
as a padded frame whose batch entries each carry their own lengths and CK mask.

Signature (``layout`` of the module; ``bshd`` shown)::

    fwd_ragged(q [Nq, Rq, Hq, Dq], k [Nk, Rk, Hk, Dq], v [Nk, Rk, Hk, Dv], idx: i32 [L], scale: f32,
               B, Sq, Sk, No, Ro, Nl, Rl, y, x, yu, xu, khi, khiu: i64)
        -> (out [No, Ro, Hq, Dv], lse [Nl, Hq, Rl] f32, scratch...)

``q`` / ``k`` / ``v`` are read as rows (``n * R + r``): group mode's packed ``[1, T, H, D]``, a
paged cache ``[pages, page_size, H, D]``, a padded batch ``[B, S, H, D]``. ``idx`` holds, one
after the other: the source row of each frame query row ``[B, Sq]`` and key ``[B, Sk]`` (-1: none,
zeros), the descriptor ``[4, B]`` (rows qlen, klen, y, x: each sequence's lengths and CK
coordinates), the frame row of each output row ``[No, Ro]`` and of each LSE column ``[Nl, Rl]``
(-1: zeros / -inf). The scalars are those sizes and the frame's interior and union coordinates
(``bounds.Coords``). The work: three gathers into the frame (``frames.gather_rows``), ``fwd``'s
cut of it (``general.fwd_body``: the interior shared by every sequence, edges masked per
sequence), two gathers out. The frames come back among the scratch results, which the caller
drops (``general``: allocated like outputs, freed without a host wait).
"""

from __future__ import annotations

from .bounds import Coords
from .frames import gather_lse, gather_rows, rows_dims
from .general import fwd_body
from .ir import Fn, tensor_type
from .operands import Plan

__all__ = ["render_ragged", "RAGGED_SCALARS"]

RAGGED_SCALARS = ("B", "Sq", "Sk", "No", "Ro", "Nl", "Rl", "y", "x", "yu", "xu", "khi", "khiu")


def _slice(fn: Fn, at: str, rows: str, cols: str) -> str:
    """``idx[at : at + rows * cols]`` as ``[rows, cols]``."""
    flat, two = tensor_type(["?"], "i32"), tensor_type(["?", "?"], "i32")
    n = fn.mul(rows, cols)
    part = fn.let(f"tensor.extract_slice %idx[{at}] [{n}] [1] : {flat} to {flat}", "ix")
    return fn.let(f"tensor.expand_shape {part} [[0, 1]] output_shape [{rows}, {cols}] : {flat} into {two}", "ix")


def render_ragged(plan: Plan, func_name: str = "fwd_ragged") -> str:
    """The MLIR text of ``util.func public @func_name`` (see the module docstring)."""
    fn, p = Fn(), plan
    T, lay = p.dtype, p.layout
    ty_q, ty_v = tensor_type(["?", "?", "?", p.dq], T), tensor_type(["?", "?", "?", p.dv], T)
    s = {n: fn.arith(f"arith.index_cast %{n} : i64 to index", n) for n in RAGGED_SCALARS}
    at_k = fn.mul(s["B"], s["Sq"])
    at_d = fn.add(at_k, fn.mul(s["B"], s["Sk"]))
    at_o = fn.add(at_d, fn.mul(4, s["B"]))
    at_l = fn.add(at_o, fn.mul(s["No"], s["Ro"]))
    q_idx, k_idx = _slice(fn, fn.c(0), s["B"], s["Sq"]), _slice(fn, at_k, s["B"], s["Sk"])
    desc = _slice(fn, at_d, fn.c(4), s["B"])
    o_idx, l_idx = _slice(fn, at_o, s["No"], s["Ro"]), _slice(fn, at_l, s["Nl"], s["Rl"])
    r_ax, h_ax = rows_dims(lay)
    hq, hk = fn.dim("%q", ty_q, h_ax), fn.dim("%k", ty_q, h_ax)
    low = p.main.lowering
    frame = {name: gather_rows(fn, src=f"%{name}", src_layout=lay, src_rows=fn.dim(f"%{name}", ty, r_ax), idx=ix,
                               size=(s["B"], keys), heads=h, out_layout=lay, dtype=T, d=d, lowering=low)
             for name, ty, ix, keys, h, d in (("q", ty_q, q_idx, s["Sq"], hq, p.dq), ("k", ty_q, k_idx, s["Sk"], hk, p.dq),
                                              ("v", ty_v, k_idx, s["Sk"], hk, p.dv))}
    co = lambda: Coords(s["y"], s["x"], s["yu"], s["xu"], s["khi"], s["khiu"])  # noqa: E731
    res = fwd_body(fn, p, frame["q"], frame["k"], frame["v"], co, desc=desc, sizes=(s["B"], s["Sq"], hq, s["Sk"], hk))
    out = gather_rows(fn, src=res[0][0], src_layout=lay, src_rows=s["Sq"], idx=o_idx, size=(s["No"], s["Ro"]), heads=hq,
                      out_layout=lay, dtype=T, d=p.dv, lowering=low)
    lse = gather_lse(fn, lse=res[1][0], idx=l_idx, size=(s["Nl"], s["Rl"]), heads=hq, rows=s["Sq"])
    results = [(out, ty_v), (lse, res[1][1]), (frame["q"], ty_q), (frame["k"], ty_q), (frame["v"], ty_v), *res[2:]]
    names, types = ", ".join(n for n, _ in results), ", ".join(t for _, t in results)
    scalars = ", ".join(f"%{n}: i64" for n in RAGGED_SCALARS)
    args = f"%q: {ty_q}, %k: {ty_q}, %v: {ty_v}, %idx: {tensor_type(['?'], 'i32')}, %scale: f32, {scalars}"
    return (f"util.func public @{func_name}({args}) -> ({types}) {{\n" + fn.text()
            + f"\n  util.return {names} : {types}\n}}\n")
