"""From online-softmax state to results: split-KV slots combined, then normalized to the ABI.

State rows are ``(s, g)`` pairs (row ``s * G + g`` of KV head ``h`` is query head ``h * G + g`` at
position ``s``), ``max`` in log2 units. ``normalize`` writes ``out = acc / sum`` in the input type
and ``lse = (max + log2 sum) * ln 2``; rows whose sum is 0 (they see no key) get 0 and ``-inf``.
"""

from __future__ import annotations

from .ir import Fn, tensor_type
from .state import State

__all__ = ["combine_slots", "normalize"]

_FMIN = "-3.40282347E+38"


def _generic(fn: Fn, *, n_dims: int, iters: list[str], ins: list[tuple[str, str, str]], outs: list[tuple[str, str, str]],
             body: list[str], args: list[str]) -> list[str]:
    """A linalg.generic; ins / outs are (value, type, map result dims); ``body`` lines use ``args``
    as block argument names and end with linalg.yield."""
    d = ", ".join(f"d{i}" for i in range(n_dims))
    maps = ", ".join(f"affine_map<({d}) -> ({dims})>" for _, _, dims in ins + outs)
    names = [fn.fresh("gen") for _ in outs]
    it = ", ".join(f'"{t}"' for t in iters)
    in_part = f" ins({', '.join(v for v, _, _ in ins)} : {', '.join(t for _, t, _ in ins)})" if ins else ""
    out_tys = ", ".join(t for _, t, _ in outs)
    fn.emit(f"{', '.join(names)} = linalg.generic {{indexing_maps = [{maps}], iterator_types = [{it}]}}"
            f"{in_part} outs({', '.join(v for v, _, _ in outs)} : {out_tys}) {{")
    fn.emit(f"^bb0({', '.join(args)}):")
    for ln in body:
        fn.emit("  " + ln)
    fn.emit(f"}} -> {out_tys}")
    return names


def normalize(fn: Fn, st: State, *, sq: str, group: int, dtype: str, layout: str) -> tuple[str, str, str, str]:
    """Slots ``[B, Hk, S, M >= Sq*G, (Dv)]`` to ``out`` (``layout``, ``dtype``) and
    ``lse [B, Hq, Sq]``: ``max = max_s max_s``, ``sum = sum_s sum_s 2^(max_s - max)``, the same for
    acc, ``out = acc / sum``. Returns (out, out type, lse, lse type)."""
    G, dv = int(group), st.dv
    b, hk, ns, _ = st.lead
    rows = fn.mul(sq, G)
    t5, t4 = tensor_type(["?"] * 4 + [dv], "f32"), tensor_type(["?"] * 4, "f32")
    acc = fn.let(f"tensor.extract_slice {st.acc}[0, 0, 0, 0, 0] [{b}, {hk}, {ns}, {rows}, {dv}] [1, 1, 1, 1, 1] "
                 f": {st.acc_type} to {t5}", "sl")
    mx = fn.let(f"tensor.extract_slice {st.mx}[0, 0, 0, 0] [{b}, {hk}, {ns}, {rows}] [1, 1, 1, 1] : {st.mx_type} to {t4}", "sl")
    sm = fn.let(f"tensor.extract_slice {st.sm}[0, 0, 0, 0, 0] [{b}, {hk}, {ns}, {rows}, 1] [1, 1, 1, 1, 1] "
                f": {st.sm_type} to {t4}", "sl")
    t3 = tensor_type(["?"] * 3, "f32")
    a4 = tensor_type(["?"] * 3 + [dv], "f32")
    fmin, zero = fn.const(_FMIN, "f32", "fmin"), fn.const("0.0", "f32", "zero")

    def fill(value, ty):
        return fn.let(f"linalg.fill ins({value} : f32) outs({fn.let(f'tensor.empty({b}, {hk}, {rows}) : {ty}', 'e')} "
                      f": {ty}) -> {ty}", "f")

    red = ["parallel", "parallel", "reduction", "parallel"]
    (mstar,) = _generic(fn, n_dims=4, iters=red, ins=[(mx, t4, "d0, d1, d2, d3")], outs=[(fill(fmin, t3), t3, "d0, d1, d3")],
                        args=["%cm_in: f32", "%cm_o: f32"],
                        body=["%cm_r = arith.maximumf %cm_in, %cm_o : f32", "linalg.yield %cm_r : f32"])
    weight = ["%cw_d = arith.subf %cw_m, %cw_ms : f32", "%cw_w = math.exp2 %cw_d : f32",
              "%cw_t = arith.mulf %cw_x, %cw_w : f32", "%cw_r = arith.addf %cw_t, %cw_o : f32", "linalg.yield %cw_r : f32"]
    wargs = ["%cw_x: f32", "%cw_m: f32", "%cw_ms: f32", "%cw_o: f32"]
    (lstar,) = _generic(fn, n_dims=4, iters=red,
                        ins=[(sm, t4, "d0, d1, d2, d3"), (mx, t4, "d0, d1, d2, d3"), (mstar, t3, "d0, d1, d3")],
                        outs=[(fill(zero, t3), t3, "d0, d1, d3")], args=wargs, body=weight)
    (astar,) = _generic(fn, n_dims=5, iters=["parallel", "parallel", "parallel", "parallel", "reduction"],
                        ins=[(acc, t5, "d0, d1, d4, d2, d3"), (mx, t4, "d0, d1, d4, d2"), (mstar, t3, "d0, d1, d2")],
                        outs=[(fill(zero, a4), a4, "d0, d1, d2, d3")], args=wargs, body=weight)
    return _to_abi(fn, astar, mstar, lstar, b=b, hk=hk, sq=sq, group=G, dv=dv, dtype=dtype, layout=layout)


def _to_abi(fn: Fn, acc: str, mx: str, sm: str, *, b, hk, sq, group: int, dv: int, dtype: str, layout: str):
    """Combined ``[B, Hk, Sq*G, (Dv)]`` rows to the ABI's out and lse."""
    G = group
    st_ty, ml_ty = tensor_type(["?", "?", "?", dv], "f32"), tensor_type(["?", "?", "?"], "f32")
    a3, m3, l3 = acc, mx, sm
    a5_ty, ml4_ty = tensor_type(["?", "?", "?", G, dv], "f32"), tensor_type(["?", "?", "?", G], "f32")
    a5 = fn.let(f"tensor.expand_shape {a3} [[0], [1], [2, 3], [4]] output_shape [{b}, {hk}, {sq}, {G}, {dv}] : {st_ty} into {a5_ty}", "ex")
    m4 = fn.let(f"tensor.expand_shape {m3} [[0], [1], [2, 3]] output_shape [{b}, {hk}, {sq}, {G}] : {ml_ty} into {ml4_ty}", "ex")
    l4 = fn.let(f"tensor.expand_shape {l3} [[0], [1], [2, 3]] output_shape [{b}, {hk}, {sq}, {G}] : {ml_ty} into {ml4_ty}", "ex")
    # output domain (b, hk, g, s, d) for bhsd, (b, s, hk, g, d) for bshd; state read as (b, hk, s, g, d)
    if layout == "bhsd":
        o5_ty = tensor_type(["?", "?", G, "?", dv], dtype)
        o5_sizes, st_map, ml_map = f"{b}, {hk}, {sq}", "d0, d1, d3, d2, d4", "d0, d1, d3, d2"
        o_reassoc, o_ty = "[[0], [1, 2], [3], [4]]", tensor_type(["?", "?", "?", dv], dtype)
    else:
        o5_ty = tensor_type(["?", "?", "?", G, dv], dtype)
        o5_sizes, st_map, ml_map = f"{b}, {sq}, {hk}", "d0, d2, d1, d3, d4", "d0, d2, d1, d3"
        o_reassoc, o_ty = "[[0], [1], [2, 3], [4]]", tensor_type(["?", "?", "?", dv], dtype)
    cast = ["%nz_y = arith.truncf %nz_v : f32 to " + dtype] if dtype != "f32" else ["%nz_y = arith.addf %nz_v, %nz_zero : f32"]
    o_e = fn.let(f"tensor.empty({o5_sizes}) : {o5_ty}", "e")
    (o5,) = _generic(fn, n_dims=5, iters=["parallel"] * 5,
                     ins=[(a5, a5_ty, st_map), (l4, ml4_ty, ml_map)], outs=[(o_e, o5_ty, "d0, d1, d2, d3, d4")],
                     args=["%nz_a: f32", "%nz_l: f32", f"%nz_o: {dtype}"],
                     body=[f"%nz_zero = arith.constant 0.0 : f32", "%nz_q = arith.divf %nz_a, %nz_l : f32",
                           "%nz_pos = arith.cmpf ogt, %nz_l, %nz_zero : f32",
                           "%nz_v = arith.select %nz_pos, %nz_q, %nz_zero : f32", *cast, f"linalg.yield %nz_y : {dtype}"])
    out = fn.let(f"tensor.collapse_shape {o5} {o_reassoc} : {o5_ty} into {o_ty}", "out")
    lse4_ty = tensor_type(["?", "?", G, "?"], "f32")
    l_e = fn.let(f"tensor.empty({b}, {hk}, {sq}) : {lse4_ty}", "e")
    (lse4,) = _generic(fn, n_dims=4, iters=["parallel"] * 4,
                       ins=[(m4, ml4_ty, "d0, d1, d3, d2"), (l4, ml4_ty, "d0, d1, d3, d2")],
                       outs=[(l_e, lse4_ty, "d0, d1, d2, d3")],
                       args=["%ls_m: f32", "%ls_l: f32", "%ls_o: f32"],
                       body=["%ls_zero = arith.constant 0.0 : f32", "%ls_ninf = arith.constant 0xFF800000 : f32",
                             "%ls_ln2 = arith.constant 0.693147180559945309 : f32",
                             "%ls_lg = math.log2 %ls_l : f32", "%ls_t = arith.addf %ls_m, %ls_lg : f32",
                             "%ls_e = arith.mulf %ls_t, %ls_ln2 : f32", "%ls_pos = arith.cmpf ogt, %ls_l, %ls_zero : f32",
                             "%ls_r = arith.select %ls_pos, %ls_e, %ls_ninf : f32", "linalg.yield %ls_r : f32"])
    lse_ty = tensor_type(["?", "?", "?"], "f32")
    lse = fn.let(f"tensor.collapse_shape {lse4} [[0], [1, 2], [3]] : {lse4_ty} into {lse_ty}", "lse")
    return out, o_ty, lse, lse_ty
