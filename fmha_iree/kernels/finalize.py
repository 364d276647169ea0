"""From online-softmax state to results: split-KV slots combined, then normalized to the ABI.

State rows are ``(s, g)`` pairs (row ``s * G + g`` of KV head ``h`` is query head ``h * G + g`` at
position ``s``), ``max`` in log2 units. ``normalize`` writes ``out = acc / sum`` in the input type
and ``lse = (max + log2 sum) * ln 2``; rows whose sum is 0 (they see no key) get 0 and ``-inf``.
"""

from __future__ import annotations

from .ir import Fn, tensor_type
from .state import State

__all__ = ["normalize"]

_FMIN = "-3.40282347E+38"


def _combine_body(fn: Fn, st: State, b: str, h: str, r: str, n: str | None) -> tuple[str, str, str]:
    """Loops over the slots of row ``r`` (and column ``n``): (max, sum, acc or None) combined."""
    fmin, zero = fn.const(_FMIN, "f32", "fmin"), fn.const("0.0", "f32", "zero")
    ns = st.lead[2]
    i, mv = fn.fresh("si"), fn.fresh("sm")
    mstar = fn.fresh("mstar")
    fn.emit(f"{mstar} = scf.for {i} = {fn.c(0)} to {ns} step {fn.c(1)} iter_args({mv} = {fmin}) -> (f32) {{")
    x = fn.fresh("x")
    fn.emit(f"  {x} = tensor.extract {st.mx}[{b}, {h}, {i}, {r}] : {st.mx_type}")
    y = fn.fresh("y")
    fn.emit(f"  {y} = arith.maximumf {mv}, {x} : f32")
    fn.emit(f"  scf.yield {y} : f32")
    fn.emit("}")
    j, lv, av = fn.fresh("sj"), fn.fresh("lv"), fn.fresh("av")
    res = fn.fresh("comb")
    carried = f"{lv} = {zero}" + (f", {av} = {zero}" if n else "")
    fn.emit(f"{res}:{2 if n else 1} = scf.for {j} = {fn.c(0)} to {ns} step {fn.c(1)} iter_args({carried}) -> "
            f"({'f32, f32' if n else 'f32'}) {{")
    mi, li, w, d, lw, ln = (fn.fresh(t) for t in ("mi", "li", "w", "dd", "lw", "ln"))
    fn.emit(f"  {mi} = tensor.extract {st.mx}[{b}, {h}, {j}, {r}] : {st.mx_type}")
    fn.emit(f"  {li} = tensor.extract {st.sm}[{b}, {h}, {j}, {r}, {fn.c(0)}] : {st.sm_type}")
    fn.emit(f"  {d} = arith.subf {mi}, {mstar} : f32")
    fn.emit(f"  {w} = math.exp2 {d} : f32")
    fn.emit(f"  {lw} = arith.mulf {li}, {w} : f32")
    fn.emit(f"  {ln} = arith.addf {lv}, {lw} : f32")
    if n:
        ai, aw, an = fn.fresh("ai"), fn.fresh("aw"), fn.fresh("an")
        fn.emit(f"  {ai} = tensor.extract {st.acc}[{b}, {h}, {j}, {r}, {n}] : {st.acc_type}")
        fn.emit(f"  {aw} = arith.mulf {ai}, {w} : f32")
        fn.emit(f"  {an} = arith.addf {av}, {aw} : f32")
        fn.emit(f"  scf.yield {ln}, {an} : f32, f32")
    else:
        fn.emit(f"  scf.yield {ln} : f32")
    fn.emit("}")
    return mstar, f"{res}#0", (f"{res}#1" if n else None)


def normalize(fn: Fn, st: State, *, sq: str, group: int, dtype: str, layout: str) -> tuple[str, str, str, str]:
    """Slots ``[B, Hk, S, M >= Sq*G, (Dv)]`` to ``out`` (``layout``, ``dtype``) and
    ``lse [B, Hq, Sq]``: ``max = max_s max_s``, ``sum = sum_s sum_s 2^(max_s - max)``, the same for
    acc, ``out = acc / sum``, ``lse = (max + log2 sum) * ln 2``. Each output element loops over the
    slots itself (a linalg reduction over the short slot dim became one workgroup per element).
    Returns (out, out type, lse, lse type)."""
    G, dv = int(group), st.dv
    b, hk = st.lead[0], st.lead[1]
    par5 = ", ".join(['"parallel"'] * 5)
    if layout == "bhsd":  # out domain (b, h, g, s, n)
        o5_ty, sizes, names = tensor_type(["?", "?", G, "?", dv], dtype), f"{b}, {hk}, {sq}", ("b", "h", "g", "s", "n")
        o_reassoc = "[[0], [1, 2], [3], [4]]"
    else:  # (b, s, h, g, n)
        o5_ty, sizes, names = tensor_type(["?", "?", "?", G, dv], dtype), f"{b}, {sq}, {hk}", ("b", "s", "h", "g", "n")
        o_reassoc = "[[0], [1], [2, 3], [4]]"
    o_ty = tensor_type(["?", "?", "?", dv], dtype)
    d5 = "d0, d1, d2, d3, d4"
    o_e = fn.let(f"tensor.empty({sizes}) : {o5_ty}", "e")
    o5 = fn.fresh("nz")
    fn.emit(f"{o5} = linalg.generic {{indexing_maps = [affine_map<({d5}) -> ({d5})>], iterator_types = [{par5}]}} "
            f"outs({o_e} : {o5_ty}) {{")
    with fn.region(f"^bb0(%nz_o: {dtype}):", f"}} -> {o5_ty}"), fn.local():
        ix = dict(zip(names, (fn.let(f"linalg.index {i} : index", "ix") for i in range(5))))
        r = fn.add(fn.mul(ix["s"], G), ix["g"])
        _, l, a = _combine_body(fn, st, ix["b"], ix["h"], r, ix["n"])
        zero = fn.const("0.0", "f32", "zero")
        q, pos, v = fn.fresh("q"), fn.fresh("pos"), fn.fresh("v")
        fn.emit(f"{q} = arith.divf {a}, {l} : f32")
        fn.emit(f"{pos} = arith.cmpf ogt, {l}, {zero} : f32")
        fn.emit(f"{v} = arith.select {pos}, {q}, {zero} : f32")
        if dtype != "f32":
            t = fn.fresh("t")
            fn.emit(f"{t} = arith.truncf {v} : f32 to {dtype}")
            v = t
        fn.emit(f"linalg.yield {v} : {dtype}")
    out = fn.let(f"tensor.collapse_shape {o5} {o_reassoc} : {o5_ty} into {o_ty}", "out")
    lse4_ty = tensor_type(["?", "?", G, "?"], "f32")
    d4 = "d0, d1, d2, d3"
    par4 = ", ".join(['"parallel"'] * 4)
    l_e = fn.let(f"tensor.empty({b}, {hk}, {sq}) : {lse4_ty}", "e")
    lse4 = fn.fresh("ls")
    fn.emit(f"{lse4} = linalg.generic {{indexing_maps = [affine_map<({d4}) -> ({d4})>], iterator_types = [{par4}]}} "
            f"outs({l_e} : {lse4_ty}) {{")
    with fn.region("^bb0(%ls_o: f32):", f"}} -> {lse4_ty}"), fn.local():
        bb, hh, gg, ss = (fn.let(f"linalg.index {i} : index", "ix") for i in range(4))
        mstar, l, _ = _combine_body(fn, st, bb, hh, fn.add(fn.mul(ss, G), gg), None)
        zero = fn.const("0.0", "f32", "zero")
        ninf = fn.const("0xFF800000", "f32", "ninf")
        ln2 = fn.const("0.693147180559945309", "f32", "ln2")
        lg, t, e, pos, res = (fn.fresh(x) for x in ("lg", "tt", "ee", "pos", "rr"))
        fn.emit(f"{lg} = math.log2 {l} : f32")
        fn.emit(f"{t} = arith.addf {mstar}, {lg} : f32")
        fn.emit(f"{e} = arith.mulf {t}, {ln2} : f32")
        fn.emit(f"{pos} = arith.cmpf ogt, {l}, {zero} : f32")
        fn.emit(f"{res} = arith.select {pos}, {e}, {ninf} : f32")
        fn.emit(f"linalg.yield {res} : f32")
    lse_ty = tensor_type(["?", "?", "?"], "f32")
    lse = fn.let(f"tensor.collapse_shape {lse4} [[0], [1, 2], [3]] : {lse4_ty} into {lse_ty}", "lse")
    return out, o_ty, lse, lse_ty
