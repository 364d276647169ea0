"""Causal at a compiled-in length as a binary tree of dense blocks (``causal_s<S>``): levels of
unmasked blocks read in place, a masked diagonal, partials merged through their max/sum.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

from .copies import _blocks_view, _bty, _fenced_v_transpose, _grouped_q_once, _grouped_q_view, _pair_slice, _pin_batch
from .dense import TRANSPOSE_V_MIN_SEQLEN, _dense_common
from .lowering import lowering_for_runtime_sizes
from .ops import _attn_op, _attn_op_vt, _blocks_start, _merged_to_abi, diag_lowering

def _tree_blocks_vt(body: list, f: dict, *, S: int, C: int, sg, lowering):
    """The causal tree's diagonal and level ops reading one transposed V [BH, Dv, S] (a single
    `_transpose_copy`): each op runs over (BH, blocks), its Q / K / V^T blocks read in place
    (a grouped Q from its one copy, `_grouped_q_once`); partials `%dg_r*`, `%lv<j>_r*` as
    [BH * blocks, rows(, Dv)]."""
    G, T, DQ, DV = f["G"], f["T"], f["DQ"], f["DV"]
    nd = S // C
    body.extend(_fenced_v_transpose(f, S, sg))
    if G > 1:
        body.append(_grouped_q_once(f, S, C, sg))
    qty, kty, vty = f"tensor<?x?x{G}x{S}x{DQ}x{T}>", f"tensor<?x?x{S}x{DQ}x{T}>", f"tensor<?x{DV}x{S}x{T}>"
    ty = functools.partial(_bty, T)

    def blocks(name: str, x: str, nb: int, L: int, pick: int | None):
        """`name` = blocks of `x` (q, k or vt) per (b, hk): nb blocks of L rows (keys), or with
        `pick` half `pick` of nb blocks of 2L; the nb dim is left out where nb = 1."""
        span, bd = (L if pick is None else 2 * L), ([nb] if nb > 1 else [])
        sl = None if pick is None else (pick * L, L)
        if x == "vt":
            if nb == 1 and sl is None:
                body.append(f"  {name} = tensor.cast %vT : {vty} to {vty}")
                return
            if nb == 1:
                body.append(f"  {name} = tensor.extract_slice %vT[0, 0, {sl[0]}] [%BH, {DV}, {L}] [1, 1, 1] : {vty} to {ty(DV, L)}")
                return
            body.append(_blocks_view(name, "%vT", vty, [[0], [1], [2, 3]], ["%BH", DV, nb, span], None, ty(DV, nb, span),
                                     *(([0, 0, 0, sl[0]], [DV, nb, L], ty(DV, nb, L)) if sl else ())))
            return
        if x == "q" and G > 1:
            body.append(_grouped_q_view(name, f, nd=nd, C=C, nb=nb, span=span // C, pick=pick))
            return
        if x == "q":
            src, sty, exp, shape = "%qS", qty, [[0], [1], [2], [3, 4], [5]], ["%B", "%Hk", 1, nb, span, DQ]
            col = [[0, 1, 2], [3], [4], [5]] if nb > 1 else [[0, 1, 2, 3], [4], [5]]
        else:
            src, sty, exp, shape = "%kS", kty, [[0], [1], [2, 3], [4]], ["%B", "%Hk", nb, span, DQ]
            col = [[0, 1], [2], [3], [4]] if nb > 1 else [[0, 1, 2], [3], [4]]
        body.append(_blocks_view(name, src, sty, exp, shape, col, ty(*bd, span, DQ),
                                 *(([0, *[0] * len(bd), sl[0], 0], [*bd, L, DQ], ty(*bd, L, DQ)) if sl else ())))

    # diagonal blocks
    for x in ("q", "k", "vt"):
        blocks(f"%{x}Dp", x, nd, C, None)
    body.append(_attn_op_vt("dg", "%qDp", "%kDp", "%vtDp", f=f, nb=nd, rows=G * C, keys=C, lowering=diag_lowering(lowering),
                            mask="%dmask"))
    # level j: the odd L-blocks of rows against the even L-block of keys before each
    for j in range(nd.bit_length() - 1):
        L, nb = C << j, nd >> (j + 1)
        for x, pick in (("q", 1), ("k", 0), ("vt", 0)):
            blocks(f"%{x}P{j}", x, nb, L, pick)
        body.append(_attn_op_vt(f"lv{j}", f"%qP{j}", f"%kP{j}", f"%vtP{j}", f=f, nb=nb, rows=G * L, keys=L, lowering=lowering))


def _static_views(f: dict, S: int) -> list[str]:
    """Static-S views [B, Hk, G, S, Dq] of q and [B, Hk, S, D] of k, v (``%qS``, ``%kS``, ``%vS``)."""
    A, G, T, DQ, DV = f["A"], f["G"], f["T"], f["DQ"], f["DV"]
    body = []
    ST = S // A
    body.append(f"""  %qS5 = tensor.cast %qb : tensor<?x?x?x{A}x{DQ}x{T}> to tensor<?x?x{ST}x{A}x{DQ}x{T}>
  %qS6 = tensor.expand_shape %qS5 [[0], [1, 2], [3], [4], [5]] output_shape [%B, %Hk, {G}, {ST}, {A}, {DQ}]
      : tensor<?x?x{ST}x{A}x{DQ}x{T}> into tensor<?x?x{G}x{ST}x{A}x{DQ}x{T}>
  %qS = tensor.collapse_shape %qS6 [[0], [1], [2], [3, 4], [5]] : tensor<?x?x{G}x{ST}x{A}x{DQ}x{T}> into tensor<?x?x{G}x{S}x{DQ}x{T}>""")
    for x, d in (("k", DQ), ("v", DV)):
        body.append(f"""  %{x}S5 = tensor.cast %{x}b : tensor<?x?x?x{A}x{d}x{T}> to tensor<?x?x{ST}x{A}x{d}x{T}>
  %{x}S = tensor.collapse_shape %{x}S5 [[0], [1], [2, 3], [4]] : tensor<?x?x{ST}x{A}x{d}x{T}> into tensor<?x?x{S}x{d}x{T}>""")
    return body


def _diag_mask(G: int, C: int) -> str:
    """The diagonal blocks' mask [G*C, C]: row i (mod C) sees key j iff j <= i."""
    return f"""  %dmask_e = tensor.empty() : tensor<{G * C}x{C}xi1>
  %dmask = linalg.generic {{indexing_maps = [affine_map<(d0, d1) -> (d0, d1)>], iterator_types = ["parallel", "parallel"]}}
      outs(%dmask_e : tensor<{G * C}x{C}xi1>) {{
  ^bb0(%o: i1):
    %i0 = linalg.index 0 : index
    %j = linalg.index 1 : index
    %cC = arith.constant {C} : index
    %i = arith.remui %i0, %cC : index
    %vis = arith.cmpi ule, %j, %i : index
    linalg.yield %vis : i1
  }} -> tensor<{G * C}x{C}xi1>"""


def _tree_blocks_inplace(body: list, f: dict, *, S: int, C: int, sg, lowering, props: str, attrs: str):
    """The tree's ops on blocks read in place (V as is): one masked op over the diagonal blocks,
    then per level j the odd L-row blocks against the even L-key block before each."""
    G, T, DQ, DV = f["G"], f["T"], f["DQ"], f["DV"]
    nd = S // C
    nl = nd.bit_length() - 1
    # diagonal blocks: q [B*Hk*nd, G*C, Dq] (rows g-major), k/v [B*Hk*nd, C, D]
    if G == 1:
        body.append(f"""  %qD6 = tensor.expand_shape %qS [[0], [1], [2], [3, 4], [5]] output_shape [%B, %Hk, {G}, {nd}, {C}, {DQ}]
          : tensor<?x?x{G}x{S}x{DQ}x{T}> into tensor<?x?x{G}x{nd}x{C}x{DQ}x{T}>""")
        body.append(f"  %qDc = tensor.collapse_shape %qD6 [[0, 1, 2, 3], [4], [5]] : tensor<?x?x1x{nd}x{C}x{DQ}x{T}> into tensor<?x{C}x{DQ}x{T}>")
    else:
        body.append(_grouped_q_once(f, S, C, sg))
        body.append(f"  %qDc = tensor.collapse_shape %qG [[0, 1, 2], [3, 4], [5]] : tensor<?x?x{nd}x{G}x{C}x{DQ}x{T}> into tensor<?x{G * C}x{DQ}x{T}>")
    for x, d in (("k", DQ), ("v", DV)):
        body.append(f"""  %{x}D5 = tensor.expand_shape %{x}S [[0], [1], [2, 3], [4]] output_shape [%B, %Hk, {nd}, {C}, {d}]
          : tensor<?x?x{S}x{d}x{T}> into tensor<?x?x{nd}x{C}x{d}x{T}>
      %{x}Dc = tensor.collapse_shape %{x}D5 [[0, 1, 2], [3], [4]] : tensor<?x?x{nd}x{C}x{d}x{T}> into tensor<?x{C}x{d}x{T}>""")
    body.append(f"  %cnd = arith.constant {nd} : index\n  %nD = arith.muli %BH, %cnd : index")
    for x, r, d in (("q", G * C, DQ), ("k", C, DQ), ("v", C, DV)):
        body.append(_pin_batch(f"%{x}Dp", f"%{x}Dc", f"tensor<?x{r}x{d}x{T}>", "%nD"))
    dprops, dattrs = lowering_for_runtime_sizes(diag_lowering(lowering), DV)
    body.append(_attn_op("dg", "%qDp", "%kDp", "%vDp", f=f, n=nd, rows=G * C, keys=C, props=dprops, attrs=dattrs,
                         mask="%dmask"))

    # level j: odd L-blocks of rows against the even L-block of keys before each, every block
    # read in place (`_pair_slice`; a grouped Q from its one copy `%qG`, rows (L/C, G, C))
    for j in range(nl):
        L, nb = C << j, nd >> (j + 1)
        body.append(f"  %cnb{j} = arith.constant {nb} : index\n  %nL{j} = arith.muli %BH, %cnb{j} : index")
        for x, src, d, off in (("k", "%kS", DQ, 0), ("v", "%vS", DV, 0)) + ((("q", "%qS", DQ, L),) if G == 1 else ()):
            body.append(_pair_slice(f"%{x}P{j}", src, 6 if x == "q" else 5, S, L, d, T, f"%nL{j}", off))
        if G > 1:
            body.append(_grouped_q_view(f"%qP{j}", f, nd=nd, C=C, nb=nb, span=2 << j, pick=1, flat=f"%nL{j}"))
        body.append(_attn_op(f"lv{j}", f"%qP{j}", f"%kP{j}", f"%vP{j}", f=f, n=nb, rows=G * L, keys=L, props=props, attrs=attrs))
        # compute_barrier.end: the merge's views of the partials would otherwise be propagated
        # through the op into its operands, putting reshapes between the slices and the op (IREE
        # clones a slice into its consumer's dispatch, not a reshape: each would become a copy)
        for idx, ty in enumerate((f"tensor<?x{G * L}x{DV}xf32>", f"tensor<?x{G * L}xf32>", f"tensor<?x{G * L}xf32>")):
            body.append(f"  %lv{j}_r{idx} = iree_tensor_ext.compute_barrier.end %lv{j}#{idx} : {ty}{{%nL{j}}} -> {ty}")


def _merge_math(n_parts: int, nl: int, with_d: bool, out_cast: str) -> list[str]:
    """The merge region's body: the largest max over the parts whose rows hold the element (part
    0, the diagonal, always; level j's where bit ``nl - 1 - j`` of the row block is 1), each
    part's sum (and acc, ``with_d``) rescaled to it and added; out = acc / sum, lse = ln of the
    sum's exp2 scale."""
    calc = ["    %mx0 = arith.addf %m0, %zero : f32"]
    for i in range(1, n_parts):
        j = i - 1
        calc += [f"    %t{i} = linalg.index {3 + (nl - 1 - j)} : index",
                 f"    %ok{i} = arith.cmpi eq, %t{i}, %c1 : index",
                 f"    %ms{i} = arith.select %ok{i}, %m{i}, %fmin : f32",
                 f"    %mx{i} = arith.maximumf %mx{i - 1}, %ms{i} : f32"]
    mx = f"%mx{n_parts - 1}"
    for i in range(n_parts):
        calc += [f"    %dm{i} = arith.subf {'%m0' if i == 0 else f'%ms{i}'}, {mx} : f32",
                 f"    %fx{i} = math.exp2 %dm{i} : f32"]
        calc.append(f"    %f{i} = arith.select %ok{i}, %fx{i}, %zero : f32" if i else f"    %f{i} = arith.addf %fx{i}, %zero : f32")
        calc += [f"    %fl{i} = arith.mulf %f{i}, %l{i} : f32",
                 f"    %sl{i} = arith.addf {'%zero' if i == 0 else f'%sl{i - 1}'}, %fl{i} : f32"]
        if with_d:
            calc += [f"    %fa{i} = arith.mulf %f{i}, %a{i} : f32",
                     f"    %sa{i} = arith.addf {'%zero' if i == 0 else f'%sa{i - 1}'}, %fa{i} : f32"]
    n = n_parts - 1
    if with_d:
        calc.append(f"    %y = arith.divf %sa{n}, %sl{n} : f32")
        calc.append(out_cast)
    else:
        calc += [f"    %lg = math.log2 %sl{n} : f32", f"    %tt = arith.addf {mx}, %lg : f32",
                 "    %e = arith.mulf %tt, %ln2 : f32", "    linalg.yield %e : f32"]
    return calc


def _tree_merge(body: list, f: dict, *, S: int, C: int, pinned: set):
    """Merge the partial (acc, max, sum) of the diagonal op and of every level into out / lse, in
    the ABI layout (``pinned``: the partials read through their ``compute_barrier`` results)."""
    G, T, DV = f["G"], f["T"], f["DV"]
    nl = (S // C).bit_length() - 1
    # merge: iteration space (b, hk, g, t_{n-1} .. t_0, r[, d]) with s = (t_{n-1} .. t_0) * C + r;
    # a level's partial has its rows as (G, lo bits, C), or (lo bits, G, C) after `_grouped_q_once`
    q_once = G > 1
    bits = [2] * nl
    it = ["d0", "d1", "d2"] + [f"d{3 + i}" for i in range(nl)] + [f"d{3 + nl}"]
    dd = f"d{4 + nl}"

    def view(src: str, rows: int, hi: int, lo: int, with_d: bool) -> tuple[str, str, str, str]:
        """Expand a partial [B*Hk*2^hi, G*2^lo*C(, Dv)] into [B, Hk, 2^hi bits, G, 2^lo bits, C(, Dv)]
        (G after the lo bits with `q_once`): (text, type, map from the merge's iteration space)."""
        mid = [2] * lo + [G] if q_once else [G] + [2] * lo
        shape = ["?", "?"] + [2] * hi + mid + [C] + ([DV] if with_d else [])
        ty = "tensor<" + "x".join(map(str, shape)) + "xf32>"
        sty = f"tensor<?x{rows}x{DV}xf32>" if with_d else f"tensor<?x{rows}xf32>"
        re = [list(range(0, 2 + hi)), list(range(2 + hi, 2 + hi + 1 + lo + 1))] + ([[3 + hi + lo + 1]] if with_d else [])
        os_ = ", ".join(["%B", "%Hk"] + [str(v) for v in shape[2:]])
        name = src.replace("#", "_") + ("_a" if with_d else "") + "_v"
        txt = (f"  {name} = tensor.expand_shape {src} {re} output_shape [{os_}] : {sty} into {ty}")
        hi_dims = it[3:3 + hi]
        lo_dims = it[3 + nl - lo:3 + nl]
        mid = lo_dims + ["d2"] if q_once else ["d2"] + lo_dims
        mp = ", ".join(["d0", "d1"] + hi_dims + mid + [it[-1]] + ([dd] if with_d else []))
        return txt, name, ty, mp

    parts = [("%dg", nl, 0, G * C)] + [(f"%lv{j}", nl - 1 - j, j, G * (C << j)) for j in range(nl)]
    dims_d = ", ".join(it + [dd])
    dims = ", ".join(it)
    out_shape = ["?", "?", G] + bits + [C]
    oty = "tensor<" + "x".join(map(str, out_shape + [DV])) + f"x{T}>"
    lty = "tensor<" + "x".join(map(str, out_shape)) + "xf32>"
    for with_d in (True, False):
        ins, tys, maps, args = [], [], [], []
        for i, (src, hi, lo, rows) in enumerate(parts):
            for kind, idx in ((("a", 0),) if with_d else ()) + (("m", 1), ("l", 2)):
                # max / sum views carry no Dv dim (in the output pass their maps project d away);
                # each pass expands its own views, named apart by the "d" suffix
                txt, name, ty, mp = view(f"{src}_r{idx}" if src in pinned else f"{src}#{idx}", rows, hi, lo,
                                         with_d and kind == "a")
                body.append(txt.replace(f"{name}", f"{name}{'d' if with_d else ''}", 1))
                ins.append(f"{name}{'d' if with_d else ''}")
                tys.append(ty)
                maps.append(f"affine_map<({dims_d if with_d else dims}) -> ({mp})>")
                args.append(f"%{kind}{i}: f32")
        res_ty = oty if with_d else lty
        maps.append(f"affine_map<({dims_d if with_d else dims}) -> ({dims_d if with_d else dims})>")
        rank = len(it) + (1 if with_d else 0)
        calc = _merge_math(len(parts), nl, with_d, f["out_cast"])
        nm = "mo" if with_d else "ml"
        body.append(f"""  %{nm}_e = tensor.empty(%B, %Hk) : {res_ty}
  %{nm} = linalg.generic {{indexing_maps = [{", ".join(maps)}],
      iterator_types = [{", ".join(['"parallel"'] * rank)}]}}
      ins({", ".join(ins)} : {", ".join(tys)}) outs(%{nm}_e : {res_ty}) {{
  ^bb0({", ".join(args)}, %o: {T if with_d else "f32"}):
{chr(10).join(calc)}
  }} -> {res_ty}""")
    grp = list(range(3, 4 + nl))
    body.append(_merged_to_abi(f, S, oty, f"[[0], [1, 2], {grp}, [{4 + nl}]]", lty, f"[[0], [1, 2], {grp}]"))


def render_causal_tree(*, func_name: str, dtype: str, layout: str, group: int, dq: int, dv: int, align: int,
                       seqlen: int, diag: int, lowering: Mapping[str, Any] | str | None = None,
                       workspace: bool = False, vt: bool | None = None) -> str:
    """MLIR text of `util.func public @func_name(q, k, v, scale) -> (out, lse)`: causal attention
    (Sq == Sk == `seqlen`, fixed at compile time) that computes only the lower triangle, as a
    binary tree of dense blocks. With C = `diag` and S = C * 2^n:

    - the S/C diagonal C x C blocks: ONE masked online_attention (row i sees key j iff j <= i);
    - level j = 0..n-1 (L = C * 2^j): the odd L-row blocks against the even L-key block before
      them, all unmasked, ONE online_attention per level;
    - one merge of the partial (acc, max, sum) of every row, normalized into out / lse.

    Every block is read in place (a uniformly strided batch); a grouped Q (G > 1) from one copy
    with G inside each C-row block (`_grouped_q_once`). `vt` (default: the lowering's `transpose_v`, at S >= TRANSPOSE_V_MIN_SEQLEN)
    copies V once to [BH, Dv, S] and gives each op its V^T blocks (`_tree_blocks_vt`).
    Work: S*C/2-ish masked plus S^2/2 - S*C/2 unmasked, about (1 + C/S) / 2 of the unmasked problem,
    in n + 1 attention dispatches. `workspace`: see `_dense_common`."""
    f = _dense_common(dtype, layout, group, dq, dv, align, seqlen, workspace, lowering=lowering)
    S, C, A, G = int(seqlen), int(diag), f["A"], f["G"]
    if vt is None:
        vt = bool(isinstance(lowering, Mapping) and lowering.get("transpose_v")) and S >= TRANSPOSE_V_MIN_SEQLEN
    T, DQ, DV = f["T"], f["DQ"], f["DV"]
    nd = S // C
    if C <= 0 or S % C or nd & (nd - 1) or C % A:
        raise ValueError(f"diag={diag}: seqlen {S} must be diag times a power of two and diag a multiple of {A}")
    nl = nd.bit_length() - 1
    props, attrs, sg, body = _blocks_start(f, lowering)
    pinned = set()
    body += _static_views(f, S) + [_diag_mask(G, C)]
    if vt:
        _tree_blocks_vt(body, f, S=S, C=C, sg=sg, lowering=lowering)
        pinned.update(["%dg"] + [f"%lv{j}" for j in range(nl)])
    else:
        _tree_blocks_inplace(body, f, S=S, C=C, sg=sg, lowering=lowering, props=props, attrs=attrs)
        pinned.update(f"%lv{j}" for j in range(nl))

    _tree_merge(body, f, S=S, C=C, pinned=pinned)
    head = (f"// causal attention as a binary tree of dense blocks (mlir_templates.render_causal_tree):\n"
            f"// S={S}, diagonal blocks C={C}, {nl} levels, G={G}, {T}, Dq={DQ}, Dv={DV}, {layout}\n"
            f"util.func public @{func_name}({f['args']})\n"
            f"    -> ({f['out_type']}, {f['lse_type']}) {{")
    return head + "\n" + "\n".join(body) + "\n}\n"
