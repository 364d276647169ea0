"""The packed decode's merge (``kernels.packed``): each sequence's query rows combined over the
pieces its keys span, through their max and sum, into the frame's out and LSE."""

from __future__ import annotations

from .ir import tensor_type
from .operands import Ctx
from .packed_common import Packed, generic, last_rows, read_idx

__all__ = ["merge"]

_FMIN = "-3.40282347E+38"


def _combine(c: Ctx, h: Packed, st, b: str, i: str, hq: str, d: str | None):
    """(max, sum, acc or None) of sequence ``b``'s query row ``i``, head ``hq``, over the pieces
    its keys span (inside a generic)."""
    fn, G = c.fn, c.p.group
    hh, g = fn.floordiv(hq, G), fn.arith(f"arith.remsi {hq}, {fn.c(G)} : index", "pr")
    ks, kl = read_idx(fn, h.k_at, b), read_idx(fn, h.desc_at, fn.add(c.b, b))
    end = fn.add(ks, kl)
    lo = fn.clamp(fn.sub(fn.floordiv(ks, h.w), h.p0), 0, h.npc)
    if h.pid:  # pages: the whole pieces of the sub-pages before the last, then its tail piece
        hi = fn.add(lo, fn.ceildiv(last_rows(fn, kl), h.w))
        end = fn.select(fn.cmp("sgt", kl, 0), fn.add(hi, 1), lo)
    else:
        hi = fn.select(fn.cmp("sgt", end, h.tail_lo), h.pn, fn.clamp(fn.sub(fn.ceildiv(end, h.w), h.p0), 0, h.npc))
        hi = end = fn.select(fn.cmp("sgt", kl, 0), fn.max(hi, lo), lo)
    fmin, zero = fn.const(_FMIN, "f32", "fmin"), fn.const("0.0", "f32", "zero")

    def at(pi):
        if h.pid:  # pages: past the whole pieces, the sequence's tail piece (rows it does not own zeroed)
            pi = fn.select(fn.cmp("eq", pi, hi), fn.add(h.npc, b), pi)
        t = fn.sub(b, read_idx(fn, h.first, pi))
        ok = fn.andi(fn.cmp("sge", t, 0), fn.cmp("slt", t, h.s))
        m = fn.add(fn.mul(fn.clamp(t, 0, fn.max(fn.sub(h.s, 1), 0)), h.rows), fn.add(fn.mul(i, G), g))
        return ok, m, pi

    # one pass, rescaling as the max grows: over a B32 paged decode's 64-row pieces (about 58 per
    # sequence) it measured faster than two passes on the H200 (docs/BENCHMARKS.md, "A paged cache
    # read in place: `fwd_packed_pages`")
    pi, mv, lv, av, res = fn.fresh("pi"), fn.fresh("pm"), fn.fresh("lv"), fn.fresh("av"), fn.fresh("comb")
    carried = f"{mv} = {fmin}, {lv} = {zero}" + (f", {av} = {zero}" if d else "")
    types = "f32, f32, f32" if d else "f32, f32"
    fn.emit(f"{res}:{3 if d else 2} = scf.for {pi} = {lo} to {end} step {fn.c(1)} iter_args({carried}) -> ({types}) {{")
    ok, m, px = at(pi)
    mi = fn.let(f"tensor.extract {st.mx}[{px}, {hh}, {fn.c(0)}, {m}] : {st.mx_type}", "px")
    mi = fn.let(f"arith.select {ok}, {mi}, {fmin} : f32", "px")
    li = fn.let(f"tensor.extract {st.sm}[{px}, {hh}, {fn.c(0)}, {m}, {fn.c(0)}] : {st.sm_type}", "px")
    li = fn.let(f"arith.select {ok}, {li}, {zero} : f32", "px")
    mn = fn.let(f"arith.maximumf {mv}, {mi} : f32", "px")
    wa = fn.let(f"math.exp2 {fn.let(f'arith.subf {mv}, {mn} : f32', 'px')} : f32", "px")
    wb = fn.let(f"math.exp2 {fn.let(f'arith.subf {mi}, {mn} : f32', 'px')} : f32", "px")
    ln = fn.let(f"arith.addf {fn.let(f'arith.mulf {lv}, {wa} : f32', 'px')}, "
                f"{fn.let(f'arith.mulf {li}, {wb} : f32', 'px')} : f32", "px")
    if d:
        ai = fn.let(f"tensor.extract {st.acc}[{px}, {hh}, {fn.c(0)}, {m}, {d}] : {st.acc_type}", "px")
        ai = fn.let(f"arith.select {ok}, {ai}, {zero} : f32", "px")
        an = fn.let(f"arith.addf {fn.let(f'arith.mulf {av}, {wa} : f32', 'px')}, "
                    f"{fn.let(f'arith.mulf {ai}, {wb} : f32', 'px')} : f32", "px")
        fn.emit(f"  scf.yield {mn}, {ln}, {an} : {types}")
    else:
        fn.emit(f"  scf.yield {mn}, {ln} : {types}")
    fn.emit("}")
    return f"{res}#0", f"{res}#1", (f"{res}#2" if d else None)


def merge(c: Ctx, h: Packed, st) -> tuple[str, str]:
    """The frame's out ``[B, Sq, Hq, Dv]`` and LSE ``[B, Hq, Sq]`` from the pieces' state."""
    fn, p = c.fn, c.p
    dv = p.arg_dims[1]
    zero = lambda: fn.const("0.0", "f32", "zero")  # noqa: E731

    def out_element(ix):
        b, i, hq, d = ix
        _, l, a = _combine(c, h, st, b, i, hq, d)
        v = fn.let(f"arith.select {fn.let(f'arith.cmpf ogt, {l}, {zero()} : f32', 'px')}, "
                   f"{fn.let(f'arith.divf {a}, {l} : f32', 'px')}, {zero()} : f32", "px")
        return v if p.dtype == "f32" else fn.let(f"arith.truncf {v} : f32 to {p.dtype}", "px")

    def lse_element(ix):
        b, hq, i = ix
        mstar, l, _ = _combine(c, h, st, b, i, hq, None)
        lg = fn.let(f"arith.addf {mstar}, {fn.let(f'math.log2 {l} : f32', 'px')} : f32", "px")
        e = fn.let(f"arith.mulf {lg}, {fn.const('0.693147180559945309', 'f32', 'ln2')} : f32", "px")
        pos = fn.let(f"arith.cmpf ogt, {l}, {zero()} : f32", "px")
        return fn.let(f"arith.select {pos}, {e}, {fn.const('0xFF800000', 'f32', 'ninf')} : f32", "px")

    out = generic(fn, tensor_type(["?", "?", "?", dv], p.dtype), [c.b, c.sq, c.hq], 4, out_element)
    lse = generic(fn, tensor_type(["?", "?", "?"], "f32"), [c.b, c.hq, c.sq], 3, lse_element)
    return out, lse
