#!/usr/bin/env python3
"""Prototype GPU step functions that read K/V through the original tensors (no per-unit gathers).

Builds one module per tile config: the package's torch ``init``/``finalize`` (ABI v1 state
``acc [NT, H, R, Dv]``, ``m``/``l`` ``[NT, H, R]``) plus, for a static bhsd f16 problem
``[B, H, S, D]`` (G = 1):

``attn_full(q, k, v) -> out``            the whole problem as ONE online_attention + normalize
                                          (the op's ceiling; no state)
``dense_step(q, k, v, acc, m, l)``        unmasked: ONE online_attention over all (b, h) and all keys,
                                          merged into the ABI state (replaces the 16 waves x 2 calls)
``causal_step(q, k, v, acc, m, l)``       bottom-right == top-left causal (Sq == Sk): the binary
                                          decomposition -- one masked dispatch for all C x C diagonal
                                          blocks (one broadcast [C, C] i1 mask) and one unmasked
                                          dispatch per level L = C * 2^j (odd Q blocks of size L
                                          against the even K block before them), all merged with the
                                          old state in one pass.

    python scripts/gpu_proto.py OUT_DIR   # writes OUT_DIR/proto_<cfg>.vmfb

Compiled here (CPU machine); run with scripts/gpu_bench.py on the GPU.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

B, H, S, D, R = 4, 16, 4096, 128, 64
BH = B * H
NTB = S // R
SCALE = 1.0 / math.sqrt(D)


def _maps(mask: bool, mask_map: str = "(d0, d1, d3)"):
    m = [
        "affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d2)>",
        "affine_map<(d0, d1, d2, d3, d4) -> (d0, d3, d2)>",
        "affine_map<(d0, d1, d2, d3, d4) -> (d0, d3, d4)>",
        "affine_map<(d0, d1, d2, d3, d4) -> ()>",
    ]
    if mask:
        m.append(f"affine_map<(d0, d1, d2, d3, d4) -> {mask_map}>")
    m += [
        "affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d4)>",
        "affine_map<(d0, d1, d2, d3, d4) -> (d0, d1)>",
        "affine_map<(d0, d1, d2, d3, d4) -> (d0, d1)>",
    ]
    return ",\n        ".join(m)


def attn(name, q, k, v, nb, m, n2, lw, mask=None, mask_ty=None):
    """online_attention over q [nb, m, D], k/v [nb, n2, D] from a fresh state; defines
    %{name}#0 acc [nb, m, D], #1 max, #2 sum."""
    from fmha_iree.mlir_templates import render_lowering_attrs

    props, attrs = render_lowering_attrs(lw, m_total=m, dv=D, c=n2)
    ins = f"{q}, {k}, {v}, %scale_h"
    tys = f"tensor<{nb}x{m}x{D}xf16>, tensor<{nb}x{n2}x{D}xf16>, tensor<{nb}x{n2}x{D}xf16>, f16"
    if mask:
        ins += f", {mask}"
        tys += f", {mask_ty}"
    return f"""
  %{name}_ae = tensor.empty() : tensor<{nb}x{m}x{D}xf32>
  %{name}_a0 = linalg.fill ins(%zero : f32) outs(%{name}_ae : tensor<{nb}x{m}x{D}xf32>) -> tensor<{nb}x{m}x{D}xf32>
  %{name}_me = tensor.empty() : tensor<{nb}x{m}xf32>
  %{name}_m0 = linalg.fill ins(%fmin : f32) outs(%{name}_me : tensor<{nb}x{m}xf32>) -> tensor<{nb}x{m}xf32>
  %{name}_l0 = linalg.fill ins(%zero : f32) outs(%{name}_me : tensor<{nb}x{m}xf32>) -> tensor<{nb}x{m}xf32>
  %{name}:3 = iree_linalg_ext.online_attention <{{{props}
      indexing_maps = [
        {_maps(bool(mask), "(d1, d3)")}]}}>{attrs}
      ins({ins} : {tys})
      outs(%{name}_a0, %{name}_m0, %{name}_l0 : tensor<{nb}x{m}x{D}xf32>, tensor<{nb}x{m}xf32>, tensor<{nb}x{m}xf32>) {{
  ^bb0(%sc: f32):
    iree_linalg_ext.yield %sc : f32
  }} -> tensor<{nb}x{m}x{D}xf32>, tensor<{nb}x{m}xf32>, tensor<{nb}x{m}xf32>
"""


HEAD = f"""
  %zero = arith.constant 0.0 : f32
  %one = arith.constant 1.0 : f32
  %fmin = arith.constant -3.40282347E+38 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %scale_h = arith.constant {SCALE:.9e} : f16
  %c0 = arith.constant 0 : index
"""

QT = f"tensor<{B}x{H}x{S}x{D}xf16>"
ACC = f"tensor<{B * NTB}x{H}x{R}x{D}xf32>"
ML = f"tensor<{B * NTB}x{H}x{R}xf32>"


def flat(x):
    return (f"  {x}_f = tensor.collapse_shape {x} [[0, 1], [2], [3]] : {QT} into tensor<{BH}x{S}x{D}xf16>\n")


def attn_full(lw):
    body = HEAD + flat("%q") + flat("%k") + flat("%v")
    body += attn("a", "%q_f", "%k_f", "%v_f", BH, S, S, lw)
    body += f"""
  %oe = tensor.empty() : tensor<{BH}x{S}x{D}xf16>
  %o = linalg.generic {{indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d1)>,
                                        affine_map<(d0, d1, d2) -> (d0, d1, d2)>],
                       iterator_types = ["parallel", "parallel", "parallel"]}}
      ins(%a#0, %a#2 : tensor<{BH}x{S}x{D}xf32>, tensor<{BH}x{S}xf32>) outs(%oe : tensor<{BH}x{S}x{D}xf16>) {{
  ^bb0(%x: f32, %s: f32, %o0: f16):
    %y = arith.divf %x, %s : f32
    %h = arith.truncf %y : f32 to f16
    linalg.yield %h : f16
  }} -> tensor<{BH}x{S}x{D}xf16>
  %o4 = tensor.expand_shape %o [[0, 1], [2], [3]] output_shape [{B}, {H}, {S}, {D}] : tensor<{BH}x{S}x{D}xf16> into {QT}
  util.return %o4 : {QT}
"""
    return f"util.func public @attn_full(%q: {QT}, %k: {QT}, %v: {QT}) -> {QT} {{{body}}}\n"


def _merge(parts):
    """Merge the old state and partials into the new state. ``parts``: list of (name, L) where the
    partial's rows are the odd blocks of size L (None: every row, [BH, S] layout). Returns MLIR text
    defining %acc_n, %m_n, %l_n. Level partials are read with tensor.extract (rows outside a level's
    odd blocks get factor 0)."""
    # pass 1 over (b, t, h, r): new max / sum and one factor per part (+ old)
    n = len(parts)
    fac_tys = ", ".join([ML] * (n + 1))
    outs = ", ".join(f"%fe{i}" for i in range(n + 1))
    txt = "".join(f"  %fe{i} = tensor.empty() : {ML}\n" for i in range(n + 1))
    txt += f"  %mne = tensor.empty() : {ML}\n  %lne = tensor.empty() : {ML}\n"
    lines = []
    lines.append("    %b = linalg.index 0 : index\n    %t = linalg.index 1 : index\n"
                 "    %h = linalg.index 2 : index\n    %r = linalg.index 3 : index\n"
                 f"    %bH = arith.muli %b, %cH : index\n    %bh = arith.addi %bH, %h : index\n"
                 f"    %tR = arith.muli %t, %cR : index\n    %s = arith.addi %tR, %r : index\n")
    ms, ls, valid = [], [], []
    for i, (nm, L) in enumerate(parts):
        if L is None:
            lines.append(f"    %pm{i} = tensor.extract %{nm}#1[%bh, %s] : tensor<{BH}x{S}xf32>\n"
                         f"    %pl{i} = tensor.extract %{nm}#2[%bh, %s] : tensor<{BH}x{S}xf32>\n")
            valid.append(None)
        else:
            nblk = S // (2 * L)
            lines.append(f"""    %blk{i} = arith.divui %s, %cL{i} : index
    %in{i} = arith.remui %s, %cL{i} : index
    %odd{i}i = arith.remui %blk{i}, %c2 : index
    %odd{i} = arith.cmpi eq, %odd{i}i, %c1 : index
    %j{i} = arith.divui %blk{i}, %c2 : index
    %bhn{i} = arith.muli %bh, %cN{i} : index
    %row{i} = arith.addi %bhn{i}, %j{i} : index
    %pm{i}x = tensor.extract %{nm}#1[%row{i}, %in{i}] : tensor<{BH * nblk}x{L}xf32>
    %pl{i} = tensor.extract %{nm}#2[%row{i}, %in{i}] : tensor<{BH * nblk}x{L}xf32>
    %pm{i} = arith.select %odd{i}, %pm{i}x, %fmin : f32
""")
            valid.append(f"%odd{i}")
        ms.append(f"%pm{i}")
        ls.append(f"%pl{i}")
    # old state
    lines.append("    %mx0 = arith.maximumf %mo, %pm0 : f32\n")
    cur = "%mx0"
    for i in range(1, n):
        lines.append(f"    %mx{i} = arith.maximumf {cur}, %pm{i} : f32\n")
        cur = f"%mx{i}"
    lines.append(f"    %fo = math.exp2 (arith.subf) : f32\n")
    lines[-1] = f"    %do = arith.subf %mo, {cur} : f32\n    %fo = math.exp2 %do : f32\n    %lacc0 = arith.mulf %fo, %lo : f32\n"
    lacc = "%lacc0"
    facs = ["%fo"]
    for i in range(n):
        lines.append(f"    %d{i} = arith.subf %pm{i}, {cur} : f32\n    %f{i}x = math.exp2 %d{i} : f32\n")
        if valid[i]:
            lines.append(f"    %f{i} = arith.select {valid[i]}, %f{i}x, %zero : f32\n")
        else:
            lines.append(f"    %f{i} = arith.addf %f{i}x, %zero : f32\n")
        lines.append(f"    %lt{i} = arith.mulf %f{i}, %pl{i} : f32\n    %lacc{i + 1} = arith.addf {lacc}, %lt{i} : f32\n")
        lacc = f"%lacc{i + 1}"
        facs.append(f"%f{i}")
    lines.append(f"    %seen = arith.cmpf ogt, {lacc}, %zero : f32\n    %mout = arith.select %seen, {cur}, %ninf : f32\n")
    lines.append(f"    linalg.yield %mout, {lacc}, {', '.join(facs)} : {', '.join(['f32'] * (n + 3))}\n")
    id4 = "affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>"
    txt += f"""  %mm:{n + 3} = linalg.generic {{indexing_maps = [{', '.join([id4] * (n + 5))}],
      iterator_types = ["parallel", "parallel", "parallel", "parallel"]}}
      ins(%m, %l : {ML}, {ML}) outs(%mne, %lne, {outs} : {ML}, {ML}, {fac_tys}) {{
  ^bb0(%mo: f32, %lo: f32, {', '.join(f'%oo{i}: f32' for i in range(n + 3))}):
{''.join(lines)}  }} -> ({', '.join([ML] * (n + 3))})
"""
    # pass 2 over (b, t, h, r, d)
    id5 = "affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d2, d3, d4)>"
    red5 = "affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d2, d3)>"
    l2 = ["    %b = linalg.index 0 : index\n    %t = linalg.index 1 : index\n"
          "    %h = linalg.index 2 : index\n    %r = linalg.index 3 : index\n    %d = linalg.index 4 : index\n"
          "    %bH = arith.muli %b, %cH : index\n    %bh = arith.addi %bH, %h : index\n"
          "    %tR = arith.muli %t, %cR : index\n    %s = arith.addi %tR, %r : index\n"
          "    %x0 = arith.mulf %g0, %ao : f32\n"]
    cur = "%x0"
    for i, (nm, L) in enumerate(parts):
        if L is None:
            l2.append(f"    %pa{i} = tensor.extract %{nm}#0[%bh, %s, %d] : tensor<{BH}x{S}x{D}xf32>\n")
        else:
            nblk = S // (2 * L)
            l2.append(f"""    %blk{i} = arith.divui %s, %cL{i} : index
    %in{i} = arith.remui %s, %cL{i} : index
    %j{i} = arith.divui %blk{i}, %c2 : index
    %bhn{i} = arith.muli %bh, %cN{i} : index
    %row{i} = arith.addi %bhn{i}, %j{i} : index
    %pa{i} = tensor.extract %{nm}#0[%row{i}, %in{i}, %d] : tensor<{BH * nblk}x{L}x{D}xf32>
""")
        l2.append(f"    %y{i} = arith.mulf %g{i + 1}, %pa{i} : f32\n    %x{i + 1} = arith.addf {cur}, %y{i} : f32\n")
        cur = f"%x{i + 1}"
    l2.append(f"    linalg.yield {cur} : f32\n")
    gs = ", ".join(f"%mm#{i + 2}" for i in range(n + 1))
    txt += f"""  %acce = tensor.empty() : {ACC}
  %acc_n = linalg.generic {{indexing_maps = [{id5}, {', '.join([red5] * (n + 1))}, {id5}],
      iterator_types = ["parallel", "parallel", "parallel", "parallel", "parallel"]}}
      ins(%acc, {gs} : {ACC}, {', '.join([ML] * (n + 1))}) outs(%acce : {ACC}) {{
  ^bb0(%ao: f32, {', '.join(f'%g{i}: f32' for i in range(n + 1))}, %oo: f32):
{''.join(l2)}  }} -> {ACC}
"""
    consts = f"  %cH = arith.constant {H} : index\n  %cR = arith.constant {R} : index\n"
    consts += "  %c1 = arith.constant 1 : index\n  %c2 = arith.constant 2 : index\n"
    for i, (nm, L) in enumerate(parts):
        if L is not None:
            consts += f"  %cL{i} = arith.constant {L} : index\n  %cN{i} = arith.constant {S // (2 * L)} : index\n"
    # acc/m/l carry 4-D shape [B*NTB, H, R(, D)]: index 0 is b*NTB + t, so expand first
    return consts + txt


def _state_views():
    # the state's tile axis is b * NTB + t; the generics index (b, t, h, r) directly on [B, NTB, H, R]
    return (f"  %acc = tensor.expand_shape %acc_in [[0, 1], [2], [3], [4]] output_shape [{B}, {NTB}, {H}, {R}, {D}]"
            f" : {ACC} into tensor<{B}x{NTB}x{H}x{R}x{D}xf32>\n"
            f"  %m = tensor.expand_shape %m_in [[0, 1], [2], [3]] output_shape [{B}, {NTB}, {H}, {R}]"
            f" : {ML} into tensor<{B}x{NTB}x{H}x{R}xf32>\n"
            f"  %l = tensor.expand_shape %l_in [[0, 1], [2], [3]] output_shape [{B}, {NTB}, {H}, {R}]"
            f" : {ML} into tensor<{B}x{NTB}x{H}x{R}xf32>\n")


def _fix_types(txt):
    # the merge generics work on the 5-D / 4-D views
    return (txt.replace(ACC, f"tensor<{B}x{NTB}x{H}x{R}x{D}xf32>")
               .replace(ML, f"tensor<{B}x{NTB}x{H}x{R}xf32>"))


def _ret():
    a5, m4 = f"tensor<{B}x{NTB}x{H}x{R}x{D}xf32>", f"tensor<{B}x{NTB}x{H}x{R}xf32>"
    return (f"  %acc_o = tensor.collapse_shape %acc_n [[0, 1], [2], [3], [4]] : {a5} into {ACC}\n"
            f"  %m_o = tensor.collapse_shape %mm#0 [[0, 1], [2], [3]] : {m4} into {ML}\n"
            f"  %l_o = tensor.collapse_shape %mm#1 [[0, 1], [2], [3]] : {m4} into {ML}\n"
            f"  util.return %acc_o, %m_o, %l_o : {ACC}, {ML}, {ML}\n")


SIG = lambda name: (f"util.func public @{name}(%q: {QT}, %k: {QT}, %v: {QT}, %acc_in: {ACC}, %m_in: {ML}, %l_in: {ML})"  # noqa
                    f" -> ({ACC}, {ML}, {ML}) {{")


def dense_step(lw):
    body = HEAD + flat("%q") + flat("%k") + flat("%v") + _state_views()
    body += attn("a", "%q_f", "%k_f", "%v_f", BH, S, S, lw)
    body += _fix_types(_merge([("a", None)])) + _ret()
    return SIG("dense_step") + body + "}\n"


def causal_step(lw, c):
    body = HEAD + flat("%q") + flat("%k") + flat("%v") + _state_views()
    nd = S // c
    # diagonal blocks: [BH * S/C, C, D] views (contiguous), one broadcast [C, C] mask
    body += f"""  %cmask_e = tensor.empty() : tensor<{c}x{c}xi1>
  %cmask = linalg.generic {{indexing_maps = [affine_map<(d0, d1) -> (d0, d1)>], iterator_types = ["parallel", "parallel"]}}
      outs(%cmask_e : tensor<{c}x{c}xi1>) {{
  ^bb0(%o: i1):
    %i = linalg.index 0 : index
    %j = linalg.index 1 : index
    %vis = arith.cmpi ule, %j, %i : index
    linalg.yield %vis : i1
  }} -> tensor<{c}x{c}xi1>
"""
    for x in ("q", "k", "v"):
        body += (f"  %{x}_d = tensor.expand_shape %{x}_f [[0], [1, 2], [3]] output_shape [{BH}, {nd}, {c}, {D}]"
                 f" : tensor<{BH}x{S}x{D}xf16> into tensor<{BH}x{nd}x{c}x{D}xf16>\n"
                 f"  %{x}_dc = tensor.collapse_shape %{x}_d [[0, 1], [2], [3]]"
                 f" : tensor<{BH}x{nd}x{c}x{D}xf16> into tensor<{BH * nd}x{c}x{D}xf16>\n")
    lwd = dict(lw)
    body += attn("dg", "%q_dc", "%k_dc", "%v_dc", BH * nd, c, c, lwd, mask="%cmask", mask_ty=f"tensor<{c}x{c}xi1>")
    # the diagonal partial in [BH, S] row order
    parts = []
    L = c
    lvl = 0
    while 2 * L <= S:
        nb = S // (2 * L)
        for x, sel in (("q", 1), ("k", 0), ("v", 0)):
            body += (f"  %{x}_e{lvl} = tensor.expand_shape %{x}_f [[0], [1, 2, 3], [4]] output_shape [{BH}, {nb}, 2, {L}, {D}]"
                     f" : tensor<{BH}x{S}x{D}xf16> into tensor<{BH}x{nb}x2x{L}x{D}xf16>\n"
                     f"  %{x}_s{lvl} = tensor.extract_slice %{x}_e{lvl}[0, 0, {sel}, 0, 0] [{BH}, {nb}, 1, {L}, {D}] [1, 1, 1, 1, 1]"
                     f" : tensor<{BH}x{nb}x2x{L}x{D}xf16> to tensor<{BH}x{nb}x{L}x{D}xf16>\n"
                     # an explicit elementwise copy (IREE's own copy of a strided slice is a
                     # "slow_memcpy" dispatch at ~0.4 TB/s)
                     f"  %{x}_y{lvl}e = tensor.empty() : tensor<{BH}x{nb}x{L}x{D}xf16>\n"
                     f"  %{x}_y{lvl} = linalg.generic {{indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>, "
                     f"affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>], iterator_types = [\"parallel\", \"parallel\", "
                     f"\"parallel\", \"parallel\"]}} ins(%{x}_s{lvl} : tensor<{BH}x{nb}x{L}x{D}xf16>) "
                     f"outs(%{x}_y{lvl}e : tensor<{BH}x{nb}x{L}x{D}xf16>) {{\n  ^bb0(%in: f16, %o: f16):\n"
                     f"    linalg.yield %in : f16\n  }} -> tensor<{BH}x{nb}x{L}x{D}xf16>\n"
                     f"  %{x}_c{lvl} = tensor.collapse_shape %{x}_y{lvl} [[0, 1], [2], [3]]"
                     f" : tensor<{BH}x{nb}x{L}x{D}xf16> into tensor<{BH * nb}x{L}x{D}xf16>\n")
        for x in ("q", "k", "v"):  # keep the batch dims collapsed (a 6-dim op ignores the 5-dim config)
            body += (f"  %{x}_b{lvl} = util.optimization_barrier %{x}_c{lvl} : tensor<{BH * nb}x{L}x{D}xf16>\n")
        body += attn(f"lv{lvl}", f"%q_b{lvl}", f"%k_b{lvl}", f"%v_b{lvl}", BH * nb, L, L, lw)
        parts.append((f"lv{lvl}", L))
        L *= 2
        lvl += 1
    # diagonal partial rows: [BH*nd, c] -> treat as [BH, S] (row bh*nd + s/c, in s%c == bh*S + s)
    body += (f"  %dgM = tensor.collapse_shape %dg#1 [[0, 1]] : tensor<{BH * nd}x{c}xf32> into tensor<{BH * nd * c}xf32>\n"
             f"  %dgm = tensor.expand_shape %dgM [[0, 1]] output_shape [{BH}, {S}] : tensor<{BH * nd * c}xf32> into tensor<{BH}x{S}xf32>\n"
             f"  %dgL = tensor.collapse_shape %dg#2 [[0, 1]] : tensor<{BH * nd}x{c}xf32> into tensor<{BH * nd * c}xf32>\n"
             f"  %dgl = tensor.expand_shape %dgL [[0, 1]] output_shape [{BH}, {S}] : tensor<{BH * nd * c}xf32> into tensor<{BH}x{S}xf32>\n"
             f"  %dgAc = tensor.collapse_shape %dg#0 [[0, 1], [2]] : tensor<{BH * nd}x{c}x{D}xf32> into tensor<{BH * nd * c}x{D}xf32>\n"
             f"  %dga = tensor.expand_shape %dgAc [[0, 1], [2]] output_shape [{BH}, {S}, {D}] : tensor<{BH * nd * c}x{D}xf32> into tensor<{BH}x{S}x{D}xf32>\n")
    merge = _merge([("dgv", None)] + parts)
    merge = merge.replace("%dgv#0", "%dga").replace("%dgv#1", "%dgm").replace("%dgv#2", "%dgl")
    body += _fix_types(merge) + _ret()
    return SIG(f"causal_step") + body + "}\n"


def module_text(lw, c):
    from fmha_iree.graph import export_module
    from fmha_iree.spec import KernelSpec, check_tiles
    from fmha_iree.targets import Target

    t = Target.from_name("sm_80")
    tiles = check_tiles(None, t, D, D, "f16")
    spec = KernelSpec("f16", "bhsd", 1, D, D, tiles, t)
    text = export_module(spec, with_step=False).rstrip()
    assert text.endswith("}")
    fns = os.environ.get("PROTO_FUNCS", "attn_full,dense_step,causal_step").split(",")
    body = ""
    if "attn_full" in fns:
        body += attn_full(lw)
    if "dense_step" in fns:
        body += dense_step(lw)
    if "causal_step" in fns:
        body += causal_step(lw, c)
    return text[:-1] + body + "\n}\n", spec


CONFIGS = {
    # name: (lowering overrides, diagonal block C)
    "m64k32": (dict(workgroup_m=64, reduction_k2=32), 512),
    "m64k64": (dict(workgroup_m=64, reduction_k2=64), 512),
    "m128k32": (dict(workgroup_m=128, reduction_k2=32), 512),
    "m64k32c256": (dict(workgroup_m=64, reduction_k2=32), 256),
    "m64k32c1024": (dict(workgroup_m=64, reduction_k2=32), 1024),
}


def main():
    from fmha_iree.mlir_templates import default_lowering

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    names = sys.argv[2:] or list(CONFIGS)
    for name in names:
        over, c = CONFIGS[name]
        lw = {**default_lowering("sm_80", dtype="f16", r=R, c=S, dv=D), **over}
        text, spec = module_text(lw, c)
        src = out / f"proto_{name}.mlir"
        src.write_text(text)
        cmd = ["iree-compile", str(src), "--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80",
               "--iree-input-type=auto", "--iree-opt-const-eval=false", "-o", str(out / f"proto_{name}.vmfb")]
        r = subprocess.run(cmd, capture_output=True, text=True)
        print(name, "rc", r.returncode, r.stderr[-3000:])


if __name__ == "__main__":
    main()
