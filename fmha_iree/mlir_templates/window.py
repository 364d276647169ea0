"""A sliding window ``b:W,0`` at a compiled-in length (``window_s<S>``): each block of rows
attends its own block and the one before, masked.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

from .copies import _blocks_view, _bty, _copy, _fenced_v_transpose, _grouped_q_once, _grouped_q_view, _pin_batch
from .dense import TRANSPOSE_V_MIN_SEQLEN, _dense_common
from .ops import _attn_op, _attn_op_vt, _blocks_start, _merged_to_abi

def _window_blocks_vt(body: list, f: dict, *, S: int, C: int, sg):
    """The sliding window's blocks for two-batch-dim ops over one transposed V (as the causal
    tree's `_tree_blocks_vt`): `%qDp` / `%kDp` / `%vtDp`, the nd = S/C diagonal blocks, and
    `%qPp` / `%kPp` / `%vtPp`, row blocks 1..nd-1 against key blocks 0..nd-2 (slices [1:] and
    [:-1] of the block views, read in place; a grouped Q from its one copy, `_grouped_q_once`). With one previous
    block (nd = 2) those keep one batch dim."""
    G, T, DQ, DV = f["G"], f["T"], f["DQ"], f["DV"]
    nd = S // C
    n1 = nd - 1
    body.extend(_fenced_v_transpose(f, S, sg))
    qty, kty, vty = f"tensor<?x?x{G}x{S}x{DQ}x{T}>", f"tensor<?x?x{S}x{DQ}x{T}>", f"tensor<?x{DV}x{S}x{T}>"
    ty = functools.partial(_bty, T)

    body.append(_blocks_view("%kDp", "%kS", kty, [[0], [1], [2, 3], [4]], ["%B", "%Hk", nd, C, DQ], [[0, 1], [2], [3], [4]],
                             ty(nd, C, DQ)))
    body.append(_blocks_view("%vtDp", "%vT", vty, [[0], [1], [2, 3]], ["%BH", DV, nd, C], None, ty(DV, nd, C)))
    if n1 > 1:
        body.append(f"  %kPp = tensor.extract_slice %kDp[0, 0, 0, 0] [%BH, {n1}, {C}, {DQ}] [1, 1, 1, 1] : {ty(nd, C, DQ)} to {ty(n1, C, DQ)}")
        body.append(f"  %vtPp = tensor.extract_slice %vtDp[0, 0, 0, 0] [%BH, {DV}, {n1}, {C}] [1, 1, 1, 1] : {ty(DV, nd, C)} to {ty(DV, n1, C)}")
    else:
        body.append(f"  %kPp = tensor.extract_slice %kDp[0, 0, 0, 0] [%BH, 1, {C}, {DQ}] [1, 1, 1, 1] : {ty(nd, C, DQ)} to {ty(C, DQ)}")
        body.append(f"  %vtPp = tensor.extract_slice %vT[0, 0, 0] [%BH, {DV}, {C}] [1, 1, 1] : {vty} to {ty(DV, C)}")
    pb = [n1] if n1 > 1 else []
    if G == 1:
        body.append(_blocks_view("%qDp", "%qE", qty, [[0], [1], [2], [3, 4], [5]], ["%B", "%Hk", 1, nd, C, DQ],
                                 [[0, 1, 2], [3], [4], [5]], ty(nd, C, DQ)))
        body.append(f"  %qPp = tensor.extract_slice %qDp[0, 1, 0, 0] [%BH, {n1}, {C}, {DQ}] [1, 1, 1, 1]"
                    f" : {ty(nd, C, DQ)} to {ty(*pb, C, DQ)}")
        return
    body.append(_grouped_q_once(f, S, C, sg, src="%qE"))
    body.append(_grouped_q_view("%qDp", f, nd=nd, C=C, nb=nd, span=1, pick=None))
    body.append(f"  %qPp = tensor.extract_slice %qDp[0, 1, 0, 0] [%BH, {n1}, {G * C}, {DQ}] [1, 1, 1, 1]"
                f" : {ty(nd, G * C, DQ)} to {ty(*pb, G * C, DQ)}")


def window_block(seqlen: int, align: int) -> int:
    """Block C of the sliding-window entry at length S (0: none): S/2 up to S=2048, else S/4, a
    multiple of ``align``. Windows of up to C keys before each row take it."""
    c = seqlen // 2 if seqlen <= 2048 else seqlen // 4
    return c if c > 0 and seqlen % c == 0 and c % align == 0 else 0


def _window_views(f: dict, S: int, C: int) -> list[str]:
    """Static-S views of q (``%qD6`` [B, Hk, G, S/C, C, Dq]) and k, v (``%kS``, ``%kD5``
    [B, Hk, S/C, C, D], ...)."""
    A, G, T, DQ, DV = f["A"], f["G"], f["T"], f["DQ"], f["DV"]
    nd = S // C
    body = []
    ST = S // A
    body.append(f"""  %qS5 = tensor.cast %qb : tensor<?x?x?x{A}x{DQ}x{T}> to tensor<?x?x{ST}x{A}x{DQ}x{T}>
  %qS6 = tensor.expand_shape %qS5 [[0], [1, 2], [3], [4], [5]] output_shape [%B, %Hk, {G}, {ST}, {A}, {DQ}]
      : tensor<?x?x{ST}x{A}x{DQ}x{T}> into tensor<?x?x{G}x{ST}x{A}x{DQ}x{T}>
  %qE = tensor.collapse_shape %qS6 [[0], [1], [2], [3, 4], [5]] : tensor<?x?x{G}x{ST}x{A}x{DQ}x{T}> into tensor<?x?x{G}x{S}x{DQ}x{T}>
  %qD6 = tensor.expand_shape %qE [[0], [1], [2], [3, 4], [5]] output_shape [%B, %Hk, {G}, {nd}, {C}, {DQ}]
      : tensor<?x?x{G}x{S}x{DQ}x{T}> into tensor<?x?x{G}x{nd}x{C}x{DQ}x{T}>""")
    for x, d in (("k", DQ), ("v", DV)):
        body.append(f"""  %{x}S5 = tensor.cast %{x}b : tensor<?x?x?x{A}x{d}x{T}> to tensor<?x?x{ST}x{A}x{d}x{T}>
  %{x}S = tensor.collapse_shape %{x}S5 [[0], [1], [2, 3], [4]] : tensor<?x?x{ST}x{A}x{d}x{T}> into tensor<?x?x{S}x{d}x{T}>
  %{x}D5 = tensor.expand_shape %{x}S [[0], [1], [2, 3], [4]] output_shape [%B, %Hk, {nd}, {C}, {d}]
      : tensor<?x?x{S}x{d}x{T}> into tensor<?x?x{nd}x{C}x{d}x{T}>""")
    return body


def _window_blocks_inplace(body: list, f: dict, *, S: int, C: int, sg):
    """Both ops' operands with V as is: the diagonal blocks read in place (``%qDp``, ...), the
    previous blocks (row blocks 1.. against key blocks ..-1) copied into batches (``%qPp``, ...)."""
    G, T, DQ, DV = f["G"], f["T"], f["DQ"], f["DV"]
    nd = S // C
    n1 = nd - 1
    # diagonal blocks: q [B*Hk*nd, G*C, Dq] (rows g-major), k/v [B*Hk*nd, C, D], read in place
    if G == 1:
        body.append(f"  %qDc = tensor.collapse_shape %qD6 [[0, 1, 2, 3], [4], [5]] : tensor<?x?x1x{nd}x{C}x{DQ}x{T}> into tensor<?x{C}x{DQ}x{T}>")
    else:
        body.append(_copy("qDt", "%qD6", f"tensor<?x?x{G}x{nd}x{C}x{DQ}x{T}>", f"tensor<?x?x{nd}x{G}x{C}x{DQ}x{T}>", 6,
                          [0, 1, 3, 2, 4, 5], subgroup=sg))
        body.append(f"  %qDc = tensor.collapse_shape %qDt [[0, 1, 2], [3, 4], [5]] : tensor<?x?x{nd}x{G}x{C}x{DQ}x{T}> into tensor<?x{G * C}x{DQ}x{T}>")
    for x, d in (("k", DQ), ("v", DV)):
        body.append(f"  %{x}Dc = tensor.collapse_shape %{x}D5 [[0, 1, 2], [3], [4]] : tensor<?x?x{nd}x{C}x{d}x{T}> into tensor<?x{C}x{d}x{T}>")
    body.append(f"  %cnd = arith.constant {nd} : index\n  %nD = arith.muli %BH, %cnd : index")
    for x, r, d in (("q", G * C, DQ), ("k", C, DQ), ("v", C, DV)):
        body.append(_pin_batch(f"%{x}Dp", f"%{x}Dc", f"tensor<?x{r}x{d}x{T}>", "%nD"))

    # previous blocks: row blocks 1..nd-1 against key blocks 0..nd-2, copied into batches
    body.append(f"""  %qPs = tensor.extract_slice %qD6[0, 0, 0, 1, 0, 0] [%B, %Hk, {G}, {n1}, {C}, {DQ}] [1, 1, 1, 1, 1, 1]
          : tensor<?x?x{G}x{nd}x{C}x{DQ}x{T}> to tensor<?x?x{G}x{n1}x{C}x{DQ}x{T}>""")
    body.append(_copy("qPt", "%qPs", f"tensor<?x?x{G}x{n1}x{C}x{DQ}x{T}>", f"tensor<?x?x{n1}x{G}x{C}x{DQ}x{T}>", 6,
                      [0, 1, 3, 2, 4, 5], subgroup=sg))
    body.append(f"  %qPc = tensor.collapse_shape %qPt [[0, 1, 2], [3, 4], [5]] : tensor<?x?x{n1}x{G}x{C}x{DQ}x{T}> into tensor<?x{G * C}x{DQ}x{T}>")
    for x, d in (("k", DQ), ("v", DV)):
        body.append(f"""  %{x}Ps = tensor.extract_slice %{x}D5[0, 0, 0, 0, 0] [%B, %Hk, {n1}, {C}, {d}] [1, 1, 1, 1, 1]
          : tensor<?x?x{nd}x{C}x{d}x{T}> to tensor<?x?x{n1}x{C}x{d}x{T}>""")
        body.append(_copy(f"{x}Pt", f"%{x}Ps", f"tensor<?x?x{n1}x{C}x{d}x{T}>", f"tensor<?x?x{n1}x{C}x{d}x{T}>", 5,
                          [0, 1, 2, 3, 4], subgroup=sg))
        body.append(f"  %{x}Pc = tensor.collapse_shape %{x}Pt [[0, 1, 2], [3], [4]] : tensor<?x?x{n1}x{C}x{d}x{T}> into tensor<?x{C}x{d}x{T}>")
    body.append(f"  %cn1 = arith.constant {n1} : index\n  %nP = arith.muli %BH, %cn1 : index")
    for x, r, d in (("q", G * C, DQ), ("k", C, DQ), ("v", C, DV)):
        body.append(_pin_batch(f"%{x}Pp", f"%{x}Pc", f"tensor<?x{r}x{d}x{T}>", "%nP"))


def _window_masks(G: int, C: int) -> list[str]:
    """The two ops' masks [G*C, C] (row i0 = g*C + i) from the runtime W: ``%dmask`` (diagonal,
    i - W <= j <= i) and ``%pmask`` (previous block, j >= i + C - W)."""
    body = []
    # masks [G*C, C] (row i0 = g*C + i), from the runtime W
    for name, cond in (("dmask", ["    %lo = arith.addi %j, %w : index", "    %vis0 = arith.cmpi uge, %lo, %i : index",
                                   "    %vis1 = arith.cmpi ule, %j, %i : index", "    %vis = arith.andi %vis0, %vis1 : i1"]),
                       ("pmask", ["    %lo = arith.addi %j, %w : index", f"    %cC2 = arith.constant {C} : index",
                                  "    %ic = arith.addi %i, %cC2 : index", "    %vis = arith.cmpi uge, %lo, %ic : index"])):
        # W enters as an operand: a tensor.extract at function level would read it on the host
        body.append(f"""  %{name}_e = tensor.empty() : tensor<{G * C}x{C}xi1>
  %{name} = linalg.generic {{indexing_maps = [affine_map<(d0, d1) -> (0)>, affine_map<(d0, d1) -> (d0, d1)>],
      iterator_types = ["parallel", "parallel"]}} ins(%win : tensor<1xi32>) outs(%{name}_e : tensor<{G * C}x{C}xi1>) {{
  ^bb0(%wv: i32, %o: i1):
    %w = arith.index_cast %wv : i32 to index
    %i0 = linalg.index 0 : index
    %j = linalg.index 1 : index
    %cC = arith.constant {C} : index
    %i = arith.remui %i0, %cC : index
{chr(10).join(cond)}
    linalg.yield %vis : i1
  }} -> tensor<{G * C}x{C}xi1>""")
    return body


def _window_merge(body: list, f: dict, *, S: int, C: int, vt: bool):
    """Merge the diagonal and previous-block partials into out / lse, in the ABI layout."""
    G, T, DV = f["G"], f["T"], f["DV"]
    nd = S // C
    n1 = nd - 1
    # merge over (b, hk, g, blk, c[, d]); the previous-block partial (blocks 1..nd-1) is read
    # inside the region at blk - 1 (an affine map cannot skip block 0), and dropped for block 0
    dims6, dims5 = "d0, d1, d2, d3, d4, d5", "d0, d1, d2, d3, d4"
    for src, tag, n in (("%dg", "d", nd), ("%pv", "p", n1)):
        for idx, kind in ((0, "a"), (1, "m"), (2, "l")):
            tail = [DV] if kind == "a" else []
            ty_in = "tensor<?x" + "x".join(map(str, [G * C] + tail)) + "xf32>"
            ty = "tensor<" + "x".join(map(str, ["?", "?", n, G, C] + tail)) + "xf32>"
            re = "[[0, 1, 2], [3, 4]" + (", [5]]" if tail else "]")
            os_ = ", ".join(["%B", "%Hk", str(n), str(G), str(C)] + [str(t) for t in tail])
            part = f"{src}_r{idx}" if vt else f"{src}#{idx}"
            body.append(f"  %{tag}{kind}_v = tensor.expand_shape {part} {re} output_shape [{os_}] : {ty_in} into {ty}")
    pty = f"tensor<?x?x{n1}x{G}x{C}xf32>"
    paty = f"tensor<?x?x{n1}x{G}x{C}x{DV}xf32>"
    oty = f"tensor<?x?x{G}x{nd}x{C}x{DV}x{T}>"
    lty = f"tensor<?x?x{G}x{nd}x{C}xf32>"
    prev = ["    %b = linalg.index 0 : index", "    %hk = linalg.index 1 : index", "    %g = linalg.index 2 : index",
            "    %blk = linalg.index 3 : index", "    %c = linalg.index 4 : index",
            "    %first = arith.cmpi eq, %blk, %c0 : index", "    %blk1 = arith.subi %blk, %c1 : index",
            "    %bp = arith.select %first, %c0, %blk1 : index",
            f"    %m1r = tensor.extract %pm_v[%b, %hk, %bp, %g, %c] : {pty}",
            f"    %l1 = tensor.extract %pl_v[%b, %hk, %bp, %g, %c] : {pty}",
            "    %m1 = arith.select %first, %fmin, %m1r : f32"]
    drop = "\n".join(prev)
    drop_a = "\n".join(prev + ["    %d = linalg.index 5 : index",
                                f"    %a1 = tensor.extract %pa_v[%b, %hk, %bp, %g, %c, %d] : {paty}"])
    # the two partials' weights (shared by the out and lse passes): f_k = 2^(m_k - max), sl = sum f_k l_k
    weights = "\n".join(["    %mx = arith.maximumf %m0, %m1 : f32"] + [
        line for k in "01" for line in (f"    %e{k} = arith.subf %m{k}, %mx : f32", f"    %f{k} = math.exp2 %e{k} : f32")] + [
        f"    %s{k} = arith.mulf %f{k}, %l{k} : f32" for k in "01"] + ["    %sl = arith.addf %s0, %s1 : f32"])
    m6 = lambda e: f"affine_map<({dims6}) -> ({e})>"  # noqa: E731
    m5 = lambda e: f"affine_map<({dims5}) -> ({e})>"  # noqa: E731
    # iteration (b, hk, g, blk, c[, d]); partial views are (b, hk, blk, g, c[, d])
    body.append(f"""  %mo_e = tensor.empty(%B, %Hk) : {oty}
  %mo = linalg.generic {{indexing_maps = [{m6("d0, d1, d3, d2, d4, d5")}, {m6("d0, d1, d3, d2, d4")}, {m6("d0, d1, d3, d2, d4")}, {m6(dims6)}],
      iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel", "parallel"]}}
      ins(%da_v, %dm_v, %dl_v : tensor<?x?x{nd}x{G}x{C}x{DV}xf32>, tensor<?x?x{nd}x{G}x{C}xf32>, tensor<?x?x{nd}x{G}x{C}xf32>)
      outs(%mo_e : {oty}) {{
  ^bb0(%a0: f32, %m0: f32, %l0: f32, %o: {T}):
{drop_a}
{weights}
    %t0 = arith.mulf %f0, %a0 : f32
    %t1 = arith.mulf %f1, %a1 : f32
    %sa = arith.addf %t0, %t1 : f32
    %y = arith.divf %sa, %sl : f32
{f["out_cast"]}
  }} -> {oty}
  %ml_e = tensor.empty(%B, %Hk) : {lty}
  %ml = linalg.generic {{indexing_maps = [{m5("d0, d1, d3, d2, d4")}, {m5("d0, d1, d3, d2, d4")}, {m5(dims5)}],
      iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel"]}}
      ins(%dm_v, %dl_v : tensor<?x?x{nd}x{G}x{C}xf32>, tensor<?x?x{nd}x{G}x{C}xf32>)
      outs(%ml_e : {lty}) {{
  ^bb0(%m0: f32, %l0: f32, %o: f32):
{drop}
{weights}
    %lg = math.log2 %sl : f32
    %tt = arith.addf %mx, %lg : f32
    %e = arith.mulf %tt, %ln2 : f32
    linalg.yield %e : f32
  }} -> {lty}""")
    body.append(_merged_to_abi(f, S, oty, "[[0], [1, 2], [3, 4], [5]]", lty, "[[0], [1, 2], [3, 4]]"))


def render_window(*, func_name: str, dtype: str, layout: str, group: int, dq: int, dv: int, align: int,
                  seqlen: int, block: int, lowering: Mapping[str, Any] | str | None = None,
                  workspace: bool = False, vt: bool | None = None) -> str:
    """MLIR text of `util.func public @func_name(q, k, v, scale, win) -> (out, lse)`: a sliding
    window, Sq == Sk == `seqlen` fixed, row i sees key j iff i - W <= j <= i with W = win[0] a
    runtime value in [0, C] (C = `block`; CK's mask `b:W,0` / `t:W,0` at Sq == Sk). The rows are cut
    into S/C blocks; each block's keys lie in its own block and the one before, so the work is two
    masked online_attention ops over C x C blocks (2 S C instead of S^2):

    - diagonal: row block r against key block r, visible iff i - W <= j <= i (read in place);
    - previous: row block r >= 1 against key block r - 1, visible iff j >= i + C - W (copied into
      contiguous batches; with `vt` read in place);
    - a merge of the two partials (block 0 has the diagonal one only) into out / lse.

    `vt` (default: the lowering's `transpose_v` at S >= TRANSPOSE_V_MIN_SEQLEN): V transposed once
    and both ops over (BH, blocks) with their blocks read in place (`_window_blocks_vt`)."""
    f = _dense_common(dtype, layout, group, dq, dv, align, seqlen, workspace, extra_args=("%win: tensor<1xi32>",),
                      lowering=lowering)
    S, C, A, G = int(seqlen), int(block), f["A"], f["G"]
    T, DQ, DV = f["T"], f["DQ"], f["DV"]
    nd = S // C if C > 0 and S % C == 0 else 0
    if nd < 2 or C % A:
        raise ValueError(f"block={block}: seqlen {S} must be at least two blocks and block a multiple of {A}")
    if vt is None:
        vt = bool(isinstance(lowering, Mapping) and lowering.get("transpose_v")) and S >= TRANSPOSE_V_MIN_SEQLEN
    props, attrs, sg, body = _blocks_start(f, lowering)
    body += _window_views(f, S, C)
    n1 = nd - 1
    if vt:
        _window_blocks_vt(body, f, S=S, C=C, sg=sg)
    else:
        _window_blocks_inplace(body, f, S=S, C=C, sg=sg)

    body += _window_masks(G, C)
    if vt:
        for name, n, m in (("dg", nd, "%dmask"), ("pv", n1, "%pmask")):
            q_, k_, v_ = (f"%{x}{'D' if name == 'dg' else 'P'}p" for x in ("q", "k", "vt"))
            body.append(_attn_op_vt(name, q_, k_, v_, f=f, nb=n, rows=G * C, keys=C, lowering=lowering, mask=m))
    else:
        body.append(_attn_op("dg", "%qDp", "%kDp", "%vDp", f=f, n=nd, rows=G * C, keys=C, props=props, attrs=attrs, mask="%dmask"))
        body.append(_attn_op("pv", "%qPp", "%kPp", "%vPp", f=f, n=n1, rows=G * C, keys=C, props=props, attrs=attrs, mask="%pmask"))

    _window_merge(body, f, S=S, C=C, vt=vt)
    head = (f"// sliding window (mlir_templates.render_window): S={S}, blocks C={C}, G={G}, {T}, Dq={DQ}, Dv={DV}, {layout}\n"
            f"util.func public @{func_name}({f['args']})\n"
            f"    -> ({f['out_type']}, {f['lse_type']}) {{")
    return head + "\n" + "\n".join(body) + "\n}\n"
