"""The functions that call fmha_iree's kernel from inside another module (a model exported with
``integrations.model_op``): one per call-site signature, each ending in the kernel's
``(q, k, v, scale, y, x)`` ABI (``codegen.link``).

- :func:`batch_wrapper`: batch mode, ``q [B, Sq, Hq, D]`` or ``[B, Hq, Sq, D]``: one call.
- :func:`varlen_wrapper`: group mode, ``q [Tq, Hq, D]`` packed with ``seqstart_q``, K / V packed
  with ``seqstart_k`` (``seqlen_k`` keys used, ``seqstart_padded_*`` physical starts) or a paged
  cache ``[pages, page, Hk, D]`` with ``block_table``: a loop over the sequences, one kernel call
  per sequence over its own rows (bshd views of them, a paged sequence's keys gathered first), so
  a sequence's result depends on it alone (batch invariant by construction).

Every kernel call hides its operands' sizes and the scale behind ``util.optimization_barrier``
so that the kernel is compiled with all of them runtime values, as in fmha_iree's own modules:
with a static ``B * Hk = 1`` and ``G > 1`` IREE 3.13 miscompiled the inlined CPU kernel
(docs/model-export.md, "The unit-batch miscompile"), and with a constant scale it hoisted the GPU
kernel's work into an initializer the VM conversion refused.
"""

from __future__ import annotations

import dataclasses

from ..problem.mask import Mask

__all__ = ["CallSite", "VarlenSite", "coords_linear", "batch_wrapper", "varlen_wrapper"]


@dataclasses.dataclass(frozen=True)
class CallSite:
    """One batch-mode call: what the op's constant arguments and operand types say."""

    dtype: str
    layout: str
    shape_q: tuple  # static sizes, -1 for dynamic ones
    shape_k: tuple
    shape_v: tuple
    mask: Mask
    scale: float

    @property
    def heads(self) -> tuple[int, int]:
        h = 1 if self.layout == "bhsd" else 2
        return self.shape_q[h], self.shape_k[h]


@dataclasses.dataclass(frozen=True)
class VarlenSite:
    """One group-mode call: q ``[Tq, Hq, Dq]``; K / V ``[Tk, Hk, D]`` or, ``paged``, a cache
    ``[pages, page, Hk, D]``; ``given``: which of ``seqstart_k, seqlen_k, seqstart_padded_q,
    seqstart_padded_k, block_table`` the call passes."""

    dtype: str
    hq: int
    hk: int
    dq: int
    dv: int
    given: tuple[str, ...]
    mask: Mask
    scale: float

    @property
    def paged(self) -> bool:
        return "block_table" in self.given


def coords_linear(mask: Mask) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``(y, x)`` of ``mask`` as ``a + b * Sq + c * Sk`` each (``Mask.coords`` is linear in the
    lengths): ``((a, b, c) of y, (a, b, c) of x)``."""
    y0, x0 = mask.coords(0, 0)
    yq, xq = mask.coords(1, 0)
    yk, xk = mask.coords(0, 1)
    return (y0, yq - y0, yk - y0), (x0, xq - x0, xk - x0)


def _tensor(shape, dtype: str) -> str:
    return "tensor<" + "x".join("?" if d < 0 else str(d) for d in shape) + f"x{dtype}>"


def _storage(dtype: str, backend: str) -> str:
    """The kernel's element type: bf16 travels as i16 bits on the CPU."""
    return "i16" if dtype == "bf16" and backend == "llvm-cpu" else dtype


class _Body:
    """Lines of a wrapper's body, with fresh SSA names."""

    def __init__(self, counter: list[int] | None = None):
        self.lines: list[str] = []
        self.counter = counter if counter is not None else [0]

    def sub(self) -> "_Body":
        """A body for a nested region, its names fresh in this one's too."""
        return _Body(self.counter)

    def fresh(self, name: str) -> str:
        self.counter[0] += 1
        return f"%{name}{self.counter[0]}"

    def __call__(self, op: str, name: str = "t") -> str:
        v = self.fresh(name)
        self.lines.append(f"  {v} = {op}")
        return v

    def bitcast(self, src: str, t_from: str, t_to: str) -> str:
        return self(f"arith.bitcast {src} : {t_from} to {t_to}", "bc") if t_from != t_to else src


def _kernel_call(b: _Body, kernel: str, results: list[str], operands, sq: str, sk: str, mask: Mask,
                 scale: float) -> str:
    """Call ``kernel`` on ``operands`` (``(value, type)`` of q, k, v, each a fully dynamic 4-D
    tensor) after the barriers, with CK's ``(y, x)`` of ``mask`` for the runtime lengths ``sq``,
    ``sk`` (index values), clipped as ``Mask.clipped_coords`` does. Returns the call's results'
    name (``%r`` of ``%r:<n>``)."""
    c = {i: b(f"arith.constant {i} : index", "c") for i in range(3)}
    sizes = [b(f"tensor.dim {v}, {c[i]} : {t}", "s") for v, t in operands for i in range(3)]
    hidden = b(f"util.optimization_barrier {', '.join(sizes)} : {', '.join(['index'] * 9)}", "h")
    b.lines[-1] = b.lines[-1].replace(f"{hidden} =", f"{hidden}:9 =")
    tied = []
    for n, (v, t) in enumerate(operands):
        o = b(f"util.optimization_barrier {v} : {t}", "o")
        dims = ", ".join(f"{hidden}#{3 * n + i}" for i in range(3))
        tied.append(b(f"flow.tensor.tie_shape {o} : {t}{{{dims}}}", "tied"))
    (ya, yq, yk), (xa, xq, xk) = coords_linear(mask)
    coords = []
    for a, cq, ck, lo, hi in ((ya, yq, yk, sk, sq), (xa, xq, xk, sq, sk)):
        lin = b(f"arith.constant {a} : index", "a")
        for coef, length in ((cq, sq), (ck, sk)):
            if coef:
                term = b(f"arith.muli {b(f'arith.constant {coef} : index', 'k')}, {length} : index", "m")
                lin = b(f"arith.addi {lin}, {term} : index", "a")
        low = b(f"arith.subi {c[0]}, {lo} : index", "lo")  # clipped to [-lo, hi + 1]
        high = b(f"arith.addi {hi}, {c[1]} : index", "hi")
        clipped = b(f"arith.minsi {b(f'arith.maxsi {lin}, {low} : index', 'mx')}, {high} : index", "mn")
        coords.append(b(f"arith.index_cast {clipped} : index to i64", "i"))
    # the scale a runtime value to the kernel too (see the module docstring)
    s = b(f"util.optimization_barrier {b(f'arith.constant {float(scale)!r} : f32', 'sc')} : f32", "scale")
    types = ", ".join(t for _, t in operands)
    r = b(f"util.call @{kernel}({', '.join(tied)}, {s}, {coords[0]}, {coords[1]}) : "
          f"({types}, f32, i64, i64) -> ({', '.join(results)})", "r")
    b.lines[-1] = b.lines[-1].replace(f"{r} =", f"{r}:{len(results)} =")
    return r


def batch_wrapper(site: CallSite, backend: str, kernel: str, wrapper: str, arg_types: tuple[str, ...],
                  results: list[str]) -> str:
    """``util.func private @wrapper(q, k, v) -> (out, lse)`` over the call's operand types
    ``arg_types``: the kernel's out and lse with its own (dynamic) types, out in the call's dtype."""
    T, st = site.dtype, _storage(site.dtype, backend)
    dq, dv = site.shape_q[3], site.shape_v[3]
    s_ax = 2 if site.layout == "bhsd" else 1
    b = _Body()
    operands = []
    for n, t in zip("qkv", arg_types):
        x = b.bitcast(f"%{n}", t, t.replace(T, st))
        dyn = _tensor((-1, -1, -1, dv if n == "v" else dq), st)
        operands.append((b(f"tensor.cast {x} : {t.replace(T, st)} to {dyn}", "d"), dyn))
    c_s = b(f"arith.constant {s_ax} : index", "c")
    sq, sk = (b(f"tensor.dim {operands[i][0]}, {c_s} : {operands[i][1]}", "len") for i in (0, 1))
    r = _kernel_call(b, kernel, results, operands, sq, sk, site.mask, site.scale)
    out = b.bitcast(f"{r}#0", results[0], results[0].replace(st, T))
    head = f"util.func private @{wrapper}(%q: {arg_types[0]}, %k: {arg_types[1]}, %v: {arg_types[2]}) -> " \
           f"({results[0].replace(st, T)}, {results[1]}) {{"
    return "\n".join([head, *b.lines, f"  util.return {out}, {r}#1 : {results[0].replace(st, T)}, {results[1]}",
                      "}"]) + "\n"


def varlen_wrapper(site: VarlenSite, backend: str, kernel: str, wrapper: str, arg_types: dict[str, str],
                   results: list[str]) -> str:
    """``util.func private @wrapper(q, k, v, seqstart_q, <the given int tables>) -> (out [Tq, Hq,
    Dv], lse [Hq, seqstart_q[-1]])``: rows no sequence owns are 0 in out, and a sequence without
    keys has out 0 and lse -inf. ``arg_types``: each operand's type by its argument name."""
    T, st = site.dtype, _storage(site.dtype, backend)
    b = _Body()
    names = ["q", "k", "v", "seqstart_q", *site.given]
    x = {n: f"%{n}" for n in names}
    for n in "qkv":
        x[n] = b.bitcast(x[n], arg_types[n], arg_types[n].replace(T, st))
    kv = (-1, -1, site.hk) if site.paged else (-1, site.hk)
    want = {"q": _tensor((-1, site.hq, site.dq), st), "k": _tensor(kv + (site.dq,), st),
            "v": _tensor(kv + (site.dv,), st), "block_table": "tensor<?x?xi32>"}
    for n in names:
        want.setdefault(n, "tensor<?xi32>")
        x[n] = b(f"tensor.cast {x[n]} : {arg_types[n].replace(T, st) if n in 'qkv' else arg_types[n]} to {want[n]}",
                 "d")
    c0, c1 = b("arith.constant 0 : index", "c"), b("arith.constant 1 : index", "c")
    starts = x["seqstart_q"]
    nb = b(f"arith.subi {b(f'tensor.dim {starts}, {c0} : tensor<?xi32>', 'n')}, {c1} : index", "nb")
    total = _load(b, starts, nb)
    tq = b(f"tensor.dim {x['q']}, {c0} : {want['q']}", "tq")
    t_out, t_lse = _carried(site, st)
    zero = b(f"arith.constant 0{'.0' if st != 'i16' else ''} : {st}", "z")
    ninf = b("arith.constant 0xFF800000 : f32", "ninf")
    out0 = b(f"linalg.fill ins({zero} : {st}) outs({b(f'tensor.empty({tq}) : {t_out}', 'e')} : {t_out}) -> {t_out}",
             "o")
    lse0 = b(f"linalg.fill ins({ninf} : f32) outs({b(f'tensor.empty({total}) : {t_lse}', 'e')} : {t_lse}) -> "
             f"{t_lse}", "l")
    body = b.sub()
    # a while loop, not scf.for: IREE 3.13's expansion of dynamic tensor sizes into values
    # (ExpandTensorShapes) handles scf.while and scf.if but not scf.for, and left the kernel's
    # call inside an scf.for with its old signature (sm_80); the work in the loop's "before"
    # region (with it in "after", iree-util-ipo left an operand unlinked, sm_80)
    o_in = body(f"flow.tensor.tie_shape %oi : {t_out}{{{tq}}}", "ot")
    l_in = body(f"flow.tensor.tie_shape %li : {t_lse}{{{total}}}", "lt")
    more = body(f"arith.cmpi slt, %b, {nb} : index", "more")
    seq = body.sub()
    _sequence(seq, site, st, f"{wrapper}_seq", results, x, want, "%b", o_in, l_in, (tq, total))
    body.lines += [f"  %step:3 = scf.if {more} -> (index, {t_out}, {t_lse}) {{", *("  " + ln for ln in seq.lines),
                   "  } else {", f"    scf.yield %b, {o_in}, {l_in} : index, {t_out}, {t_lse}", "  }"]
    b.lines += [f"  %res:3 = scf.while (%b = {c0}, %oi = {out0}, %li = {lse0}) : (index, {t_out}, {t_lse}) -> "
                f"(index, {t_out}, {t_lse}) {{", *("  " + ln for ln in body.lines),
                f"    scf.condition({more}) %step#0, %step#1, %step#2 : index, {t_out}, {t_lse}",
                "  } do {", f"  ^bb0(%bn: index, %on: {t_out}, %ln: {t_lse}):",
                f"    scf.yield %bn, %on, %ln : index, {t_out}, {t_lse}", "  }"]
    res_o = b(f"flow.tensor.tie_shape %res#1 : {t_out}{{{tq}}}", "ot")
    res_l = b(f"flow.tensor.tie_shape %res#2 : {t_lse}{{{total}}}", "lt")
    out = b.bitcast(res_o, t_out, t_out.replace(st, T))
    args = ", ".join(f"%{n}: {arg_types[n]}" for n in names)
    text = [f"util.func private @{wrapper}({args}) -> ({t_out.replace(st, T)}, {t_lse}) {{", *b.lines,
            f"  util.return {out}, {res_l} : {t_out.replace(st, T)}, {t_lse}", "}"]
    return "\n".join(text) + "\n" + _per_sequence(site, st, kernel, f"{wrapper}_seq", results, backend != "llvm-cpu")


def _per_sequence(site: VarlenSite, st: str, kernel: str, name: str, results: list[str], never_inline: bool) -> str:
    """``@name(q, k, v, sq, sk) -> (out, lse)``: one sequence's kernel call (bshd views of its rows,
    every size dynamic). Its own function on GPU targets, never inlined: called inside the
    wrapper's loop, the kernel's call had its unused results dropped by iree-util-ipo, which left
    the LSE's user with an unlinked operand (sm_80); a call of this function has no such results."""
    b = _Body()
    dq_t, dv_t = _tensor((-1, -1, -1, site.dq), st), _tensor((-1, -1, -1, site.dv), st)
    r = _kernel_call(b, kernel, results, [("%q", dq_t), ("%k", dq_t), ("%v", dv_t)], "%sq", "%sk", site.mask,
                     site.scale)
    attrs = "attributes {inlining_policy = #util.inline.never} " if never_inline else ""
    return "\n".join([f"util.func private @{name}(%q: {dq_t}, %k: {dq_t}, %v: {dv_t}, %sq: index, %sk: index) -> "
                      f"({results[0]}, {results[1]}) {attrs}{{", *b.lines,
                      f"  util.return {r}#0, {r}#1 : {results[0]}, {results[1]}", "}"]) + "\n"


def _carried(site: VarlenSite, st: str) -> tuple[str, str]:
    """The types the loop carries: out ``[Tq, Hq, Dv]`` and the LSE ``[Hq, seqstart_q[-1]]``."""
    return _tensor((-1, site.hq, site.dv), st), f"tensor<{site.hq}x?xf32>"


def _load(b: _Body, table: str, i: str, j: str | None = None) -> str:
    """``table[i]`` (or ``table[i, j]``), an i32 element, as an index."""
    at = f"{i}, {j}" if j else i
    t = "tensor<?x?xi32>" if j else "tensor<?xi32>"
    return b(f"arith.index_cast {b(f'tensor.extract {table}[{at}] : {t}', 'ld')} : i32 to index", "ix")


def _sequence(b: _Body, site: VarlenSite, st: str, callee: str, results: list[str], x: dict, want: dict, seq: str,
              out: str, lse: str, sizes: tuple[str, str]) -> None:
    """The loop body for sequence ``seq``: its rows and keys, the kernel call when it has both,
    its out rows and LSE inserted into ``out`` / ``lse``; ``scf.yield`` of the two."""
    c0, c1 = b("arith.constant 0 : index", "c"), b("arith.constant 1 : index", "c")
    nxt = b(f"arith.addi {seq}, {c1} : index", "nx")
    q0 = _load(b, x["seqstart_q"], seq)
    ql = b(f"arith.subi {_load(b, x['seqstart_q'], nxt)}, {q0} : index", "ql")
    qs = _load(b, x["seqstart_padded_q"], seq) if "seqstart_padded_q" in x else q0
    if site.paged:
        ks, kl = c0, _load(b, x["seqlen_k"], seq)
    else:
        k0 = _load(b, x["seqstart_k"], seq)
        kl = _load(b, x["seqlen_k"], seq) if "seqlen_k" in x else \
            b(f"arith.subi {_load(b, x['seqstart_k'], nxt)}, {k0} : index", "kl")
        ks = _load(b, x["seqstart_padded_k"], seq) if "seqstart_padded_k" in x else k0
    go = b(f"arith.andi {b(f'arith.cmpi sgt, {ql}, {c0} : index', 'g')}, "
           f"{b(f'arith.cmpi sgt, {kl}, {c0} : index', 'g')} : i1", "go")
    t_out, t_lse = _carried(site, st)
    inner = b.sub()
    operands = [_rows(inner, x["q"], want["q"], qs, ql, site.hq, site.dq, st)]
    for n, d in (("k", site.dq), ("v", site.dv)):
        operands.append(_paged_rows(inner, x[n], x["block_table"], seq, kl, site.hk, d, st) if site.paged else
                        _rows(inner, x[n], want[n], ks, kl, site.hk, d, st))
    types = ", ".join(t for _, t in operands)
    r = inner(f"util.call @{callee}({', '.join(v for v, _ in operands)}, {ql}, {kl}) : ({types}, index, index) "
              f"-> ({results[0]}, {results[1]})", "r")
    inner.lines[-1] = inner.lines[-1].replace(f"{r} =", f"{r}:2 =")
    # the kernel's results tied to their known sizes before the static casts (the casts' size
    # checks would otherwise need the sizes of the kernel's results, which flow cannot resolve)
    c_hq = inner(f"arith.constant {site.hq} : index", "c")
    o_t = inner(f"flow.tensor.tie_shape {r}#0 : {results[0]}{{{c1}, {ql}, {c_hq}}}", "ot")
    l_t = inner(f"flow.tensor.tie_shape {r}#1 : {results[1]}{{{c1}, {c_hq}, {ql}}}", "lt")
    o4 = inner(f"tensor.cast {o_t} : {results[0]} to {_tensor((1, -1, site.hq, site.dv), st)}", "oc")
    o3 = inner(f"tensor.collapse_shape {o4} [[0, 1], [2], [3]] : {_tensor((1, -1, site.hq, site.dv), st)} into "
               f"{t_out}", "o")
    l3 = inner(f"tensor.cast {l_t} : {results[1]} to tensor<1x{site.hq}x?xf32>", "lc")
    l2 = inner(f"tensor.collapse_shape {l3} [[0, 1], [2]] : tensor<1x{site.hq}x?xf32> into {t_lse}", "l")
    o_new = inner(f"tensor.insert_slice {o3} into {out}[{qs}, 0, 0] [{ql}, {site.hq}, {site.dv}] [1, 1, 1] : "
                  f"{t_out} into {t_out}", "oi")
    l_new = inner(f"tensor.insert_slice {l2} into {lse}[0, {q0}] [{site.hq}, {ql}] [1, 1] : {t_lse} into {t_lse}",
                  "li")
    b.lines += [f"  %seq:2 = scf.if {go} -> ({t_out}, {t_lse}) {{", *("  " + ln for ln in inner.lines),
                f"    scf.yield {o_new}, {l_new} : {t_out}, {t_lse}", "  } else {",
                f"    scf.yield {out}, {lse} : {t_out}, {t_lse}", "  }"]
    o_next = b(f"flow.tensor.tie_shape %seq#0 : {t_out}{{{sizes[0]}}}", "ot")
    l_next = b(f"flow.tensor.tie_shape %seq#1 : {t_lse}{{{sizes[1]}}}", "lt")
    b.lines.append(f"  scf.yield {nxt}, {o_next}, {l_next} : index, {t_out}, {t_lse}")


def _rows(b: _Body, src: str, t_src: str, start: str, length: str, heads: int, d: int, st: str) -> tuple[str, str]:
    """Rows ``[start, start + length)`` of a packed ``[T, H, D]`` tensor as a bshd ``[1, length, H,
    D]`` with every size dynamic: ``(value, type)``."""
    t3 = _tensor((-1, heads, d), st)
    rows = b(f"tensor.extract_slice {src}[{start}, 0, 0] [{length}, {heads}, {d}] [1, 1, 1] : {t_src} to {t3}", "rw")
    t4 = _tensor((1, -1, heads, d), st)
    e = b(f"tensor.expand_shape {rows} [[0, 1], [2], [3]] output_shape [1, {length}, {heads}, {d}] : {t3} into {t4}",
          "ex")
    dyn = _tensor((-1, -1, -1, d), st)
    return b(f"tensor.cast {e} : {t4} to {dyn}", "dy"), dyn


def _paged_rows(b: _Body, cache: str, table: str, seq: str, length: str, heads: int, d: int,
                st: str) -> tuple[str, str]:
    """Keys ``[0, length)`` of sequence ``seq`` gathered from a paged cache ``[pages, page, H, D]``
    (key ``j`` in page ``table[seq, j // page]``, row ``j % page``) as a bshd ``[1, length, H, D]``."""
    t_cache = _tensor((-1, -1, heads, d), st)
    c1 = b("arith.constant 1 : index", "c")
    page = b(f"tensor.dim {cache}, {c1} : {t_cache}", "pg")
    t4 = _tensor((1, -1, heads, d), st)
    empty = b(f"tensor.empty({length}) : {t4}", "e")
    g = b.fresh("g")[2:]
    lines = [f"  %gat{g} = linalg.generic {{indexing_maps = [affine_map<(i, j, h, e) -> (i, j, h, e)>], "
             f"iterator_types = [\"parallel\", \"parallel\", \"parallel\", \"parallel\"]}} outs({empty} : {t4}) {{",
             f"  ^bb0(%ge{g}: {st}):",
             f"    %gj{g} = linalg.index 1 : index", f"    %gh{g} = linalg.index 2 : index",
             f"    %gd{g} = linalg.index 3 : index",
             f"    %gp{g} = arith.divui %gj{g}, {page} : index", f"    %gr{g} = arith.remui %gj{g}, {page} : index",
             f"    %gt{g} = tensor.extract {table}[{seq}, %gp{g}] : tensor<?x?xi32>",
             f"    %gi{g} = arith.index_cast %gt{g} : i32 to index",
             f"    %gv{g} = tensor.extract {cache}[%gi{g}, %gr{g}, %gh{g}, %gd{g}] : {t_cache}",
             f"    linalg.yield %gv{g} : {st}", f"  }} -> {t4}"]
    b.lines += lines
    dyn = _tensor((-1, -1, -1, d), st)
    return b(f"tensor.cast %gat{g} : {t4} to {dyn}", "dy"), dyn
