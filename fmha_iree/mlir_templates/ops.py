"""The attention ops of the one-call entry points (fresh online-softmax state per op, V read as is
or transposed), their start state, and the merge of partials back into the ABI layout.
"""

from __future__ import annotations

from typing import Mapping

from .copies import _rt_zero
from .lowering import lowering_for_runtime_sizes

def _fresh_online_attention(name: str, n: str, maps: list[str], ins: str, tys: str, acc: str, ml: str, props: str,
                            attrs: str, score: str) -> str:
    """`%name:3` = online_attention from a fresh state (acc 0, max -inf, sum 0) of types `acc` /
    `ml` (dynamic batch `n`); `score`: its score region's body (`_dense_common`'s `score_body`)."""
    return f"""  %{name}_ae = tensor.empty({n}) : {acc}
  %{name}_a0 = linalg.fill ins(%zero : f32) outs(%{name}_ae : {acc}) -> {acc}
  %{name}_me = tensor.empty({n}) : {ml}
  %{name}_m0 = linalg.fill ins(%fmin : f32) outs(%{name}_me : {ml}) -> {ml}
  %{name}_l0 = linalg.fill ins(%zero : f32) outs(%{name}_me : {ml}) -> {ml}
  %{name}:3 = iree_linalg_ext.online_attention <{{{props}
      indexing_maps = [{", ".join(maps)}]}}>{attrs}
      ins({ins} : {tys})
      outs(%{name}_a0, %{name}_m0, %{name}_l0 : {acc}, {ml}, {ml}) {{
  ^bb0(%score: f32):
{score}
  }} -> {acc}, {ml}, {ml}
"""


def _attn_op(name: str, q: str, k: str, v: str, *, f: dict, n: int, rows: int, keys: int, props: str,
             attrs: str, mask: str | None = None) -> str:
    """A fresh-state online_attention `%name:3` over q [N, rows, Dq], k/v [N, keys, D] with
    N = B * Hk * `n`, and an optional [rows, keys] i1 mask broadcast over N."""
    T, DQ, DV = f["T"], f["DQ"], f["DV"]
    m = "affine_map<(d0, d1, d2, d3, d4) -> "
    maps = [m + "(d0, d1, d2)>", m + "(d0, d3, d2)>", m + "(d0, d3, d4)>", m + "()>"]
    ins, tys = f"{q}, {k}, {v}, %scale_t", f"tensor<?x{rows}x{DQ}x{T}>, tensor<?x{keys}x{DQ}x{T}>, tensor<?x{keys}x{DV}x{T}>, {T}"
    if mask:
        maps.append(m + "(d1, d3)>")
        ins, tys = ins + f", {mask}", tys + f", tensor<{rows}x{keys}xi1>"
    maps += [m + "(d0, d1, d4)>", m + "(d0, d1)>", m + "(d0, d1)>"]
    acc, ml = f"tensor<?x{rows}x{DV}xf32>", f"tensor<?x{rows}xf32>"
    return (f"  %{name}_c = arith.constant {int(n)} : index\n  %{name}_n = arith.muli %BH, %{name}_c : index\n"
            + _fresh_online_attention(name, f"%{name}_n", maps, ins, tys, acc, ml, props, attrs, f["score_body"]))


def _attn_op_vt(name: str, q: str, k: str, vt: str, *, f: dict, nb: int, rows: int, keys: int, lowering,
                mask: str | None = None) -> str:
    """`_attn_op` over the batch dims (BH, nb) with V read transposed: q [BH, nb, rows, Dq],
    k [BH, nb, keys, Dq], vt [BH, Dv, nb, keys] (blocks of one transposed V, so V's batch dims
    are not adjacent and stay two); the nb dim is left out where nb = 1 (IREE would fold it,
    dropping the tiles). Results `%name_r0..2` as [BH * nb, rows(, Dv)]."""
    T, DQ, DV = f["T"], f["DQ"], f["DV"]
    two = nb > 1
    props, attrs = lowering_for_runtime_sizes(lowering, DV, batch_dims=2 if two else 1)
    d = "(d0, d1, d2, d3, d4, d5)" if two else "(d0, d2, d3, d4, d5)"
    m = f"affine_map<{d} -> "
    p = "d0, d1" if two else "d0"
    nbx = f"{nb}x" if two else ""
    maps = [m + f"({p}, d2, d3)>", m + f"({p}, d4, d3)>", m + ("(d0, d5, d1, d4)>" if two else "(d0, d5, d4)>"), m + "()>"]
    ins = f"{q}, {k}, {vt}, %scale_t"
    tys = (f"tensor<?x{nbx}{rows}x{DQ}x{T}>, tensor<?x{nbx}{keys}x{DQ}x{T}>, tensor<?x{DV}x{nbx}{keys}x{T}>, {T}")
    if mask:
        maps.append(m + "(d2, d4)>")
        ins, tys = ins + f", {mask}", tys + f", tensor<{rows}x{keys}xi1>"
    maps += [m + f"({p}, d2, d5)>", m + f"({p}, d2)>", m + f"({p}, d2)>"]
    acc, ml = f"tensor<?x{nbx}{rows}x{DV}xf32>", f"tensor<?x{nbx}{rows}xf32>"
    text = _fresh_online_attention(name, "%BH", maps, ins, tys, acc, ml, props, attrs, f["score_body"])
    # compute_barrier.end keeps the merge's reshapes of the partials out of the op (see `_pair_slice`)
    for i, (ty, cty, re) in enumerate(((acc, f"tensor<?x{rows}x{DV}xf32>", "[[0, 1], [2], [3]]"),
                                       (ml, f"tensor<?x{rows}xf32>", "[[0, 1], [2]]"),
                                       (ml, f"tensor<?x{rows}xf32>", "[[0, 1], [2]]"))):
        if two:
            text += (f"  %{name}_b{i} = iree_tensor_ext.compute_barrier.end %{name}#{i} : {ty}{{%BH}} -> {ty}\n"
                     f"  %{name}_r{i} = tensor.collapse_shape %{name}_b{i} {re} : {ty} into {cty}\n")
        else:
            text += f"  %{name}_r{i} = iree_tensor_ext.compute_barrier.end %{name}#{i} : {ty}{{%BH}} -> {ty}\n"
    return text


def _blocks_start(f: dict, lowering) -> tuple[str, str, int | None, list[str]]:
    """(attention props, attrs, GPU subgroup size or None, first body lines) of the block-split
    templates (causal tree, sliding window)."""
    props, attrs = lowering_for_runtime_sizes(lowering, f["DV"])
    sg = lowering.get("subgroup_size") if isinstance(lowering, Mapping) and lowering.get("backend") != "cpu" else None
    return props, attrs, sg, [f["prologue"], "  %Hq = arith.muli %Hk, %cG : index", *_rt_zero(f["T"])]


def _merged_to_abi(f: dict, S: int, oty: str, ogrp: str, lty: str, lgrp: str) -> str:
    """The merged `%mo` (type `oty`) and `%ml` (`lty`), collapsed by `ogrp` / `lgrp` to
    [B, Hq, S(, Dv)], as the function's results in the ABI's (S/A, A) split, and the return."""
    A, DV, T, ST = f["A"], f["DV"], f["T"], S // f["A"]
    return f"""  %o4s = tensor.collapse_shape %mo {ogrp} : {oty} into tensor<?x?x{S}x{DV}x{T}>
  %o4x = tensor.expand_shape %o4s [[0], [1], [2, 3], [4]] output_shape [%B, %Hq, {ST}, {A}, {DV}]
      : tensor<?x?x{S}x{DV}x{T}> into tensor<?x?x{ST}x{A}x{DV}x{T}>
  %o4 = tensor.cast %o4x : tensor<?x?x{ST}x{A}x{DV}x{T}> to tensor<?x?x?x{A}x{DV}x{T}>
  %lse3 = tensor.collapse_shape %ml {lgrp} : {lty} into tensor<?x?x{S}xf32>
  %lsex = tensor.expand_shape %lse3 [[0], [1], [2, 3]] output_shape [%B, %Hq, {ST}, {A}]
      : tensor<?x?x{S}xf32> into tensor<?x?x{ST}x{A}xf32>
  %lse = tensor.cast %lsex : tensor<?x?x{ST}x{A}xf32> to tensor<?x?x?x{A}xf32>
{f["epilogue"]}
  util.return %out_r, %lse_r : {f['out_type']}, {f['lse_type']}"""


def diag_lowering(lowering):
    """The causal tree's masked diagonal op's lowering: a GPU lowering of 256 or more rows per
    workgroup at half the rows and half the subgroups (its C x C blocks are short in keys; twice
    the workgroups fill the GPU better): measured faster on the H200 (f16 d128, M=256, 8
    subgroups) than the full lowering and than 8 subgroups of 16 rows (docs/BENCHMARKS.md, "How the
    constants were chosen"; the profiles' driver is in git history at commit 67bfe0c). Other
    lowerings unchanged (not measured)."""
    if not isinstance(lowering, Mapping) or lowering.get("backend") == "cpu":
        return lowering
    wm, sgm = int(lowering.get("workgroup_m", 0)), lowering.get("subgroups_m")
    if wm < 256 or sgm is None or int(sgm) % 2:
        return lowering
    lw = dict(lowering, workgroup_m=wm // 2, subgroups_m=int(sgm) // 2)
    if lw.get("workgroup_size"):
        lw["workgroup_size"] = int(lw["workgroup_size"]) // 2
    return lw
