"""From online-softmax state to results: split-KV slots combined, then normalized to the ABI.

State rows are ``(s, g)`` pairs (row ``s * G + g`` of KV head ``h`` is query head ``h * G + g`` at
position ``s``), ``max`` in log2 units. ``normalize_one`` (one slot) and ``normalize_slots``
(split-KV slots, combined first) write ``out = acc / sum`` in the input type
and ``lse = (max + log2 sum) * ln 2``; rows whose sum is 0 (they see no key) get 0 and ``-inf``.
"""

from __future__ import annotations

from .elementwise import as_words, copy_attrs, from_words
from .ir import Fn, parallel, tensor_type
from .state import State

__all__ = ["normalize_one", "normalize_slots"]

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


def normalize_slots(fn: Fn, st: State, *, sq: str, group: int, dtype: str, layout: str,
                    dv_out: int | None = None) -> tuple[str, str, str, str]:
    """Slots ``[B, Hk, S, M >= Sq*G, (Dv)]`` to ``out`` (``layout``, ``dtype``; its first
    ``dv_out`` columns of Dv, default all) and
    ``lse [B, Hq, Sq]``: ``max = max_s max_s``, ``sum = sum_s sum_s 2^(max_s - max)``, the same for
    acc, ``out = acc / sum``, ``lse = (max + log2 sum) * ln 2``. Each output element loops over the
    slots itself (a linalg reduction over the short slot dim became one workgroup per element).
    Returns (out, out type, lse, lse type)."""
    G, dv = int(group), dv_out or st.dv
    b, hk = st.lead[0], st.lead[1]
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
    fn.emit(f"{o5} = linalg.generic {{indexing_maps = [affine_map<({d5}) -> ({d5})>], iterator_types = [{parallel(5)}]}} "
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
    l_e = fn.let(f"tensor.empty({b}, {hk}, {sq}) : {lse4_ty}", "e")
    lse4 = fn.fresh("ls")
    fn.emit(f"{lse4} = linalg.generic {{indexing_maps = [affine_map<({d4}) -> ({d4})>], iterator_types = [{parallel(4)}]}} "
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


def _out_layout(layout: str, G: int, dv: int, dtype: str, b: str, hk: str, sq: str):
    """(5-D out type, its dynamic sizes, the state's (b, h, s, g, n) dims in the out domain,
    reassociation)."""
    if layout == "bhsd":  # out domain (b, h, g, s, n)
        return (tensor_type(["?", "?", G, "?", dv], dtype), [b, hk, sq], ("d0", "d1", "d3", "d2", "d4"),
                "[[0], [1, 2], [3], [4]]")
    return (tensor_type(["?", "?", "?", G, dv], dtype), [b, sq, hk], ("d0", "d2", "d1", "d3", "d4"),
            "[[0], [1], [2, 3], [4]]")


def _one_body(dtype: str) -> str:
    cast = f"    %n1_y = arith.truncf %n1_v : f32 to {dtype}\n" if dtype != "f32" else "    %n1_y = arith.addf %n1_v, %n1_z : f32\n"
    return ("    %n1_z = arith.constant 0.0 : f32\n    %n1_q = arith.divf %n1_a, %n1_l : f32\n"
            "    %n1_p = arith.cmpf ogt, %n1_l, %n1_z : f32\n    %n1_v = arith.select %n1_p, %n1_q, %n1_z : f32\n"
            f"{cast}    linalg.yield %n1_y : {dtype}\n")


def _pair_body(dtype: str, word: str) -> str:
    """Two columns per element: ``%n1_a`` (i64: two f32 of acc, low first) over ``%n1_l``, packed
    into one ``word`` of two ``dtype`` values (low first); 0 where the sum is 0."""
    half = int(word[1:]) // 2
    lines = ["    %n1_z = arith.constant 0.0 : f32", "    %n1_p = arith.cmpf ogt, %n1_l, %n1_z : f32",
             "    %n1_32 = arith.constant 32 : i64", f"    %n1_sh = arith.constant {half} : {word}",
             "    %n1_hi = arith.shrui %n1_a, %n1_32 : i64"]
    for i, src in enumerate(("%n1_a", "%n1_hi")):
        lines += [f"    %n1_i{i} = arith.trunci {src} : i64 to i32", f"    %n1_f{i} = arith.bitcast %n1_i{i} : i32 to f32",
                  f"    %n1_q{i} = arith.divf %n1_f{i}, %n1_l : f32", f"    %n1_v{i} = arith.select %n1_p, %n1_q{i}, %n1_z : f32"]
        if dtype == "f32":
            lines += [f"    %n1_b{i} = arith.bitcast %n1_v{i} : f32 to i32", f"    %n1_e{i} = arith.extui %n1_b{i} : i32 to i64"]
        else:
            lines += [f"    %n1_t{i} = arith.truncf %n1_v{i} : f32 to {dtype}", f"    %n1_b{i} = arith.bitcast %n1_t{i} : {dtype} to i16",
                      f"    %n1_e{i} = arith.extui %n1_b{i} : i16 to {word}"]
    lines += [f"    %n1_s = arith.shli %n1_e1, %n1_sh : {word}", f"    %n1_w = arith.ori %n1_e0, %n1_s : {word}",
              f"    linalg.yield %n1_w : {word}"]
    return "\n".join(lines) + "\n"


def normalize_one(fn: Fn, st: State, *, sq: str, group: int, dtype: str, layout: str,
                  lowering=None, dv_out: int | None = None) -> tuple[str, str, str, str]:
    """A one-slot state to ``out`` / ``lse``: plain elementwise ops on slot 0 (tiled by
    ``elementwise.copy_attrs`` for ``lowering``); ``out`` gets the first ``dv_out`` columns."""
    G, full, dv = int(group), st.dv, dv_out or st.dv
    b, hk = st.lead[0], st.lead[1]
    # the whole state viewed as rows (s, g) first, then sliced: a slice of the first Sq * G rows
    # expanded afterwards is a copy IREE runs as one-workgroup `slow_memcpy` dispatches
    per = fn.floordiv(st.lead[3], G)
    m5, s6 = tensor_type(["?", "?", "?", "?", G], "f32"), tensor_type(["?", "?", "?", "?", G, 1], "f32")
    a5, m4 = tensor_type(["?", "?", "?", G, dv], "f32"), tensor_type(["?", "?", "?", G], "f32")

    def views(acc=st.acc, acc_cols=full, cols=dv, elt="f32"):
        """acc (``acc``: ``acc_cols`` columns of ``elt``; its first ``cols``), max, sum: slot 0,
        rows (s, g)."""
        a6, a5 = (tensor_type(["?", "?", "?", "?", G, acc_cols], elt), tensor_type(["?", "?", "?", G, cols], elt))
        acc6 = fn.let(f"tensor.expand_shape {acc} [[0], [1], [2], [3, 4], [5]] output_shape [{b}, {hk}, {st.lead[2]}, {per}, {G}, {acc_cols}] "
                      f": {tensor_type(['?'] * 4 + [acc_cols], elt)} into {a6}", "ex")
        mx5 = fn.let(f"tensor.expand_shape {st.mx} [[0], [1], [2], [3, 4]] output_shape [{b}, {hk}, {st.lead[2]}, {per}, {G}] "
                     f": {st.mx_type} into {m5}", "ex")
        sm6 = fn.let(f"tensor.expand_shape {st.sm} [[0], [1], [2], [3, 4], [5]] output_shape [{b}, {hk}, {st.lead[2]}, {per}, {G}, 1] "
                     f": {st.sm_type} into {s6}", "ex")
        return (fn.let(f"tensor.extract_slice {acc6}[0, 0, 0, 0, 0, 0] [{b}, {hk}, 1, {sq}, {G}, {cols}] [1, 1, 1, 1, 1, 1] : {a6} to {a5}", "sl"),
                fn.let(f"tensor.extract_slice {mx5}[0, 0, 0, 0, 0] [{b}, {hk}, 1, {sq}, {G}] [1, 1, 1, 1, 1] : {m5} to {m4}", "sl"),
                fn.let(f"tensor.extract_slice {sm6}[0, 0, 0, 0, 0, 0] [{b}, {hk}, 1, {sq}, {G}, 1] [1, 1, 1, 1, 1, 1] : {s6} to {m4}", "sl"))

    o5_ty, sizes, sdims, reassoc = _out_layout(layout, G, dv, dtype, b, hk, sq)
    d5 = "d0, d1, d2, d3, d4"
    st_map, ml_map = ", ".join(sdims), ", ".join(sdims[:4])
    # pairs of columns per element: acc read as 64-bit words, out written as 2-element words
    # (IREE 3.13 does not prove the buffers aligned, and NVPTX splits vectors of f32 / f16 into
    # element-sized accesses; elementwise.word_elems)
    paired = dv % 2 == 0 and full % 2 == 0
    o_word = {"f32": "i64"}.get(dtype, "i32")
    acc_w = as_words(fn, st.acc, ["?"] * 4 + [full], list(st.lead), "f32")[0] if paired else None
    o5w_ty = _out_layout(layout, G, dv // 2, o_word, b, hk, sq)[0] if paired else o5_ty
    attrs = (copy_attrs(lowering, rank=5, row_dim=3 if layout == "bhsd" else 1, inner=dv // 2, vec=2 if o_word == "i64" else 4)
             if paired else copy_attrs(lowering, rank=5, row_dim=3 if layout == "bhsd" else 1, inner=dv))

    def out_region():
        # an explicit dispatch, so that IREE keeps the op's rank and its lowering (``attrs``)
        acc5, _, sm4 = views(acc_w, full // 2, dv // 2, "i64") if paired else views()
        o_e = fn.let(f"tensor.empty({', '.join(sizes)}) : {o5w_ty}", "e")
        a_ty = tensor_type(["?", "?", "?", G, dv // 2], "i64") if paired else a5
        o_elt = o_word if paired else dtype
        return [fn.let(f"linalg.generic {{indexing_maps = [affine_map<({d5}) -> ({st_map})>, affine_map<({d5}) -> ({ml_map})>, "
                       f"affine_map<({d5}) -> ({d5})>], iterator_types = [{parallel(5)}]}} ins({acc5}, {sm4} : {a_ty}, {m4}) "
                       f"outs({o_e} : {o5w_ty}){attrs} {{\n  ^bb0(%n1_a: {'i64' if paired else 'f32'}, %n1_l: f32, %n1_o: {o_elt}):\n"
                       + (_pair_body(dtype, o_word) if paired else _one_body(dtype))
                       + f"  }} -> {o5w_ty}", "n1")]

    o5 = fn.dispatch([(o5w_ty, sizes)], out_region)[0]
    if paired:
        shape = ["?", "?", G, "?", dv] if layout == "bhsd" else ["?", "?", "?", G, dv]
        o5 = from_words(fn, o5, shape, sizes, dtype, o_word)
    _, mx4, sm4 = views()
    o_ty = tensor_type(["?", "?", "?", dv], dtype)
    out = fn.let(f"tensor.collapse_shape {o5} {reassoc} : {o5_ty} into {o_ty}", "out")
    lse, lse_ty = _lse_one(fn, mx4, sm4, m4, [b, hk, sq], G)
    return out, o_ty, lse, lse_ty


def _lse_one(fn: Fn, mx4: str, sm4: str, m4: str, sizes: list[str], G: int) -> tuple[str, str]:
    """``lse [B, Hq, Sq]`` from one slot's max and sum (``m4`` views ``[B, Hk, Sq, G]``):
    ``(max + log2 sum) * ln 2``, ``-inf`` where the sum is 0."""
    l4_ty = tensor_type(["?", "?", G, "?"], "f32")
    d4 = "d0, d1, d2, d3"
    l_e = fn.let(f"tensor.empty({', '.join(sizes)}) : {l4_ty}", "e")
    l4 = fn.let(f"linalg.generic {{indexing_maps = [affine_map<({d4}) -> (d0, d1, d3, d2)>, affine_map<({d4}) -> (d0, d1, d3, d2)>, "
                f"affine_map<({d4}) -> ({d4})>], iterator_types = [{parallel(4)}]}} ins({mx4}, {sm4} : {m4}, {m4}) "
                f"outs({l_e} : {l4_ty}) {{\n  ^bb0(%n2_m: f32, %n2_l: f32, %n2_o: f32):\n"
                "    %n2_z = arith.constant 0.0 : f32\n    %n2_ninf = arith.constant 0xFF800000 : f32\n"
                "    %n2_ln2 = arith.constant 0.693147180559945309 : f32\n    %n2_g = math.log2 %n2_l : f32\n"
                "    %n2_t = arith.addf %n2_m, %n2_g : f32\n    %n2_e = arith.mulf %n2_t, %n2_ln2 : f32\n"
                "    %n2_p = arith.cmpf ogt, %n2_l, %n2_z : f32\n    %n2_r = arith.select %n2_p, %n2_e, %n2_ninf : f32\n"
                f"    linalg.yield %n2_r : f32\n  }} -> {l4_ty}", "n2")
    lse_ty = tensor_type(["?", "?", "?"], "f32")
    return fn.let(f"tensor.collapse_shape {l4} [[0], [1, 2], [3]] : {l4_ty} into {lse_ty}", "lse"), lse_ty
