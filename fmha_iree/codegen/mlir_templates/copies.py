"""Copies shared by the dense templates: tiled copies and V transposes with explicit tiles, the
batch dims pinned, a zero IREE cannot fold.
"""

from __future__ import annotations

from .lowering import _ilist

def _unit_groups(keep: list[int], rank: int) -> list[list[int]]:
    """Reassociation that folds the dims not in `keep` (unit dims) into a neighbouring kept dim:
    the one before, or the first for leading ones."""
    groups = [[i] for i in keep]
    for i in range(rank):
        if i not in keep:
            before = [g for g in groups if g[0] < i]
            (before[-1] if before else groups[0]).append(i)
    return [sorted(g) for g in groups]


def _copy_config(dst_ty: str, rank: int, subgroup: int) -> str:
    """GPU tiles for a `_copy` (IREE's own for these dynamic-batch copies are one element per
    thread): 16 rows x the innermost dim per workgroup, 8 elements (16 bytes of f16) per thread.
    Empty when the innermost dim is not a multiple of 8."""
    inner = int(dst_ty.split("x")[-2])
    if inner % 8 or (16 * inner // 8) > 1024:
        return ""
    wg = [1] * (rank - 2) + [16, inner]
    th = [1] * (rank - 1) + [8]
    return (" attrs = {compilation_info = #iree_codegen.compilation_info<"
            f"lowering_config = #iree_gpu.lowering_config<{{workgroup = {_ilist(wg)}, thread = {_ilist(th)}}}>, "
            "translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<TileAndFuse> "
            f"workgroup_size = [{16 * inner // 8}, 1, 1] subgroup_size = {int(subgroup)}>>}}")


def _copy(name: str, src: str, src_ty: str, dst_ty: str, rank: int, perm: list[int],
          pick: dict[int, int] | None = None, subgroup: int | None = None) -> str:
    """`%name` = elementwise copy of `src` into a fresh `dst_ty` (first two dims dynamic: %B, %Hk),
    dst dim i taken from src dim perm[i]: a contiguous batch for the next attention op. `pick`
    {src dim: index} reads one index of extra src dims (the src then has rank + len(pick) dims).

    Each element gets `%rt_zero` added (a zero IREE cannot fold: scale - scale), so the copy stays
    an elementwise kernel: a plain copy becomes IREE's `slow_memcpy` dispatch, one f16 per thread in
    64-thread workgroups, far below a copy's rate on the H200 (docs/tried.md, "H200: the causal tree
    and the compiled-in paths"). With `subgroup` (the GPU's subgroup size) the copy gets its own
    tiles (`_copy_config`); it then iterates over the non-unit dims of `dst_ty` only (IREE folds
    unit dims into a new op, dropping the tiles) and expands back."""
    pick = pick or {}
    et = src_ty.rsplit("x", 1)[1][:-1]
    dshape = dst_ty[len("tensor<"):-1].split("x")[:-1]
    sshape = src_ty[len("tensor<"):-1].split("x")[:-1]
    keep = [i for i, x in enumerate(dshape) if x != "1"] if subgroup else list(range(rank))
    skeep = [i for i, x in enumerate(sshape) if x != "1" or i in pick] if subgroup else list(range(len(sshape)))
    new_idx = {i: n for n, i in enumerate(keep)}
    dims = ", ".join(f"d{n}" for n in range(len(keep)))
    src_exprs, k = [], 0
    for i in range(rank + len(pick)):
        if i in pick:
            src_exprs.append(str(pick[i]))
            continue
        di = perm.index(k)
        k += 1
        if i in skeep:
            src_exprs.append(f"d{new_idx[di]}" if di in new_idx else "0")
    pre = ""
    if len(skeep) < len(sshape):  # fold the source's unit dims away first, for the same reason
        sred = "tensor<" + "x".join([sshape[i] for i in skeep] + [et]) + ">"
        pre = f"  %{name}_s = tensor.collapse_shape {src} {_unit_groups(skeep, len(sshape))} : {src_ty} into {sred}\n"
        src, src_ty = f"%{name}_s", sred
    red_ty = "tensor<" + "x".join([dshape[i] for i in keep] + [et]) + ">"
    par = ", ".join(['"parallel"'] * len(keep))
    cfg = _copy_config(red_ty, len(keep), subgroup) if subgroup else ""
    out = f"%{name}_r" if red_ty != dst_ty else f"%{name}"
    text = pre + f"""  %{name}_e = tensor.empty(%B, %Hk) : {red_ty}
  {out} = linalg.generic {{indexing_maps = [affine_map<({dims}) -> ({", ".join(src_exprs)})>, affine_map<({dims}) -> ({dims})>],
      iterator_types = [{par}]}} ins({src} : {src_ty}) outs(%{name}_e : {red_ty}){cfg} {{
  ^bb0(%x: {et}, %o: {et}):
    %x0 = arith.addf %x, %rt_zero : {et}
    linalg.yield %x0 : {et}
  }} -> {red_ty}
"""
    if red_ty != dst_ty:
        dyn = ["%B", "%Hk"]
        shape = ", ".join(dyn.pop(0) if x == "?" else x for x in dshape)
        text += (f"  %{name} = tensor.expand_shape {out} {_unit_groups(keep, rank)} output_shape [{shape}]"
                 f" : {red_ty} into {dst_ty}\n")
    return text


def _transpose_copy(name: str, src: str, src_ty: str, dst_ty: str, n: str, subgroup: int | None) -> str:
    """`%name` [N, b, a] = `src` [N, a, b] (N = `n`) plus `%rt_zero` (see `_copy`), iterated over
    the source's dims (the form IREE turns a transpose into), with IREE's shared-memory transpose
    tiles on GPUs, which it picks itself only for static shapes: 32 x 32 tiles staged through
    shared memory (`promote_operands`), 8 elements (16 bytes of f16) along the output's fastest
    dim per thread, 4 x 32 threads: measured faster on the H200 than 4 elements per thread (8 x 32
    threads) and than IREE's own tiles (docs/BENCHMARKS.md, "How the constants were chosen")."""
    et = src_ty.rsplit("x", 1)[1][:-1]
    a, b = (int(x) for x in src_ty[len("tensor<"):-1].split("x")[1:3])
    cfg = ""
    if subgroup and a % 32 == 0 and b % 32 == 0:
        cfg = (" attrs = {compilation_info = #iree_codegen.compilation_info<"
               "lowering_config = #iree_gpu.lowering_config<{workgroup = [1, 32, 32], thread = [1, 8, 1], "
               "promote_operands = [0]}>, "
               "translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<TileAndFuse> "
               f"workgroup_size = [4, 32, 1] subgroup_size = {int(subgroup)}>>}}")
    return f"""  %{name}_e = tensor.empty({n}) : {dst_ty}
  %{name} = linalg.generic {{indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d1, d2)>, affine_map<(d0, d1, d2) -> (d0, d2, d1)>],
      iterator_types = ["parallel", "parallel", "parallel"]}} ins({src} : {src_ty}) outs(%{name}_e : {dst_ty}){cfg} {{
  ^bb0(%x: {et}, %o: {et}):
    %x0 = arith.addf %x, %rt_zero : {et}
    linalg.yield %x0 : {et}
  }} -> {dst_ty}"""


def _pin_batch(name: str, src: str, ty: str, n: str) -> str:
    """`name` = `src` passed through a `flow.tensor.reshape` (to the same type, its dynamic batch
    size re-tied), so IREE does not fold the reshapes around it into the attention op, which would
    give the op several batch dims its GPU config cannot tile. (A `util.optimization_barrier` did
    the same but made the host wait for the GPU at that point of the call, which slowed the causal
    tree on the H200: docs/tried.md, "H200: the causal tree and the compiled-in paths".)"""
    return f"  {name} = flow.tensor.reshape {src} : {ty}{{{n}}} -> {ty}{{{n}}}"


def _rt_zero(T: str) -> list[str]:
    """`%rt_zero`: a zero of type T that IREE cannot fold (scale - scale), see `_copy`."""
    return ["  %rt_zero_f = arith.subf %scale_f32, %scale_f32 : f32",
            "  %rt_zero = arith.addf %rt_zero_f, %zero : f32" if T == "f32" else f"  %rt_zero = arith.truncf %rt_zero_f : f32 to {T}"]
