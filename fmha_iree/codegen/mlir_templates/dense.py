"""One call for a whole aligned batch: ``dense`` (unmasked), ``dense_o_s<S>`` / ``causal_o_s<S>``
(fused, out only, unmasked or causal), from ``mlir/dense*.mlir.in``; the shared prologue
(``_dense_common``: shapes, workspace).
"""

from __future__ import annotations

from typing import Any, Mapping

from .copies import _pin_batch, _rt_zero, _transpose_copy
from .lowering import _DTYPES, _load, lowering_for_runtime_sizes, scale_operand

def _check_dense(dtype: str, layout: str, group: int, dq: int, dv: int, align: int, seqlen: int | None) -> str:
    """The element type of a dense template's arguments; ValueError for arguments it cannot take."""
    t = _DTYPES.get(str(dtype))
    if t is None:
        raise ValueError(f"dtype {dtype!r} not in f16/bf16/f32")
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout {layout!r} not in bshd/bhsd")
    for name, val in (("group", group), ("dq", dq), ("dv", dv), ("align", align)):
        if int(val) <= 0:
            raise ValueError(f"{name} must be positive, got {val}")
    if seqlen is not None and (int(seqlen) <= 0 or int(seqlen) % int(align)):
        raise ValueError(f"seqlen must be a positive multiple of align={int(align)}, got {seqlen}")
    return t


def _prologue(t: str, layout: str, group: int, a: int, st: str, dq: int, dv: int,
              scale: list[str]) -> tuple[list[str], dict]:
    """The prologue's lines (constants, ``scale``: the lines defining ``%scale_t``, q/k/v as bhsd
    ``%qb``/``%kb``/``%vb``, the dims ``%B``, ``%Hk``, ``%BH``) and the arguments' types."""
    ty = {x: f"tensor<?x?x?x{a}x{d}x{t}>" for x, d in (("q", dq), ("k", dq), ("v", dv))}
    lines = [
        "  %c0 = arith.constant 0 : index", "  %c1 = arith.constant 1 : index",
        "  %c2 = arith.constant 2 : index", "  %c3 = arith.constant 3 : index",
        f"  %cG = arith.constant {group} : index", f"  %cA = arith.constant {a} : index",
        "  %zero = arith.constant 0.0 : f32", "  %fmin = arith.constant -3.40282347E+38 : f32",
        "  %ln2 = arith.constant 0.693147180559945309 : f32",
        "  %scale_f32 = tensor.extract %scale[%c0] : tensor<1xf32>",
        *("  " + line for line in scale),
    ]
    arg_ty = {}
    for x in ("q", "k", "v"):
        d = dq if x != "v" else dv
        if layout == "bhsd":
            arg_ty[x] = f"tensor<?x?x{st}x{a}x{d}x{t}>"
            lines.append(f"  %{x}b = tensor.cast %{x}_arg : {arg_ty[x]} to {ty[x]}")
        else:  # [B, S/A, A, H, D] -> [B, H, S/A, A, D]
            arg_ty[x] = f"tensor<?x{st}x{a}x?x{d}x{t}>"
            src = f"tensor<?x?x{a}x?x{d}x{t}>"
            lines.append(f"  %{x} = tensor.cast %{x}_arg : {arg_ty[x]} to {src}")
            lines += [
                f"  %{x}_B = tensor.dim %{x}, %c0 : {src}", f"  %{x}_S = tensor.dim %{x}, %c1 : {src}",
                f"  %{x}_H = tensor.dim %{x}, %c3 : {src}",
                f"  %{x}_e = tensor.empty(%{x}_B, %{x}_H, %{x}_S) : {ty[x]}",
                f"  %{x}b = linalg.transpose ins(%{x} : {src}) outs(%{x}_e : {ty[x]}) permutation = [0, 3, 1, 2, 4]",
            ]
    lines += [
        f"  %B = tensor.dim %qb, %c0 : {ty['q']}", f"  %Sqt = tensor.dim %qb, %c2 : {ty['q']}",
        f"  %Hk = tensor.dim %kb, %c1 : {ty['k']}",
        "  %BH = arith.muli %B, %Hk : index",
    ]
    return lines, arg_ty


def _from_bhsd(t: str, layout: str, a: int, st: str, dv: int) -> tuple[str, str, str]:
    """(text turning ``%o4`` [B, Hq, S/A, A, Dv] into ``%out`` in ``layout``, its dynamic type,
    the result type)."""
    oty = f"tensor<?x?x?x{a}x{dv}x{t}>"
    if layout == "bhsd":
        from_bhsd = f"  %out = tensor.cast %o4 : {oty} to {oty}"
        res_dyn, res = oty, f"tensor<?x?x{st}x{a}x{dv}x{t}>"
    else:
        res_dyn, res = f"tensor<?x?x{a}x?x{dv}x{t}>", f"tensor<?x{st}x{a}x?x{dv}x{t}>"
        from_bhsd = "\n".join([
            f"  %o_B = tensor.dim %o4, %c0 : {oty}", f"  %o_H = tensor.dim %o4, %c1 : {oty}",
            f"  %o_S = tensor.dim %o4, %c2 : {oty}", f"  %o_e = tensor.empty(%o_B, %o_S, %o_H) : {res_dyn}",
            f"  %out = linalg.transpose ins(%o4 : {oty}) outs(%o_e : {res_dyn}) permutation = [0, 2, 3, 1, 4]",
        ])
    return from_bhsd, res_dyn, res


def _dense_common(dtype: str, layout: str, group: int, dq: int, dv: int, align: int,
                  seqlen: int | None = None, workspace: bool = False, extra_args: tuple[str, ...] = (), *,
                  lowering=None, softcap: float = 0.0) -> dict:
    """Fields shared by the dense and causal templates.

    The sequence axis crosses the ABI split as (S / A, A) with A = `align` (the host reshapes, for
    free): IREE's GPU pipeline only distributes an attention whose M and K2 it can prove to be
    multiples of its tiles, and a product with a static factor is such a proof.
    `prologue` defines the constants, the ops' scale operand `%scale_t`, the inputs as bhsd
    (`%qb`, `%kb`, `%vb`: [B, H, S/A, A, D], a transpose each for bshd) and their dims;
    `from_bhsd` turns `%o4` [B, Hq, S/A, A, Dv] into `%out` in `layout`, `epilogue` casts it and
    `%lse` to the result types. `score_body` is the ops' score region (`lowering.scale_operand`:
    with the lowering's `scale_on_scores` the scale multiplies the f32 scores instead of Q).

    `seqlen` (a multiple of A) makes S static in the function's types (a shape-specialized entry
    point; the runtime refuses other lengths): the arguments are cast to the dynamic types the
    templates use and IREE propagates the static sizes into every dispatch.

    `extra_args` follow the scale. `workspace` adds `%workspace: !hal.buffer {iree.abi.transients}` last: the
    caller's buffer holds the function's intermediates (partials, copies), sized by IREE's
    generated `<func>_transients_size` query. Without it IREE allocates them per call, and its
    CUDA HAL frees them with a host wait for the call's last kernel (`queue_dealloca`), which
    serialized back-to-back calls."""
    t = _check_dense(dtype, layout, group, dq, dv, align, seqlen)
    a = int(align)
    st = "?" if seqlen is None else str(int(seqlen) // a)
    scale, score_body = scale_operand(lowering, t, softcap)
    lines, arg_ty = _prologue(t, layout, int(group), a, st, dq, dv, scale)
    from_bhsd, res_dyn, res = _from_bhsd(t, layout, a, st, dv)
    args = ", ".join([f"%{x}_arg: {arg_ty[x]}" for x in ("q", "k", "v")] + ["%scale: tensor<1xf32>", *extra_args]
                     + (["%workspace: !hal.buffer {iree.abi.transients}"] if workspace else []))
    lse_dyn, lse_ty = f"tensor<?x?x?x{a}xf32>", f"tensor<?x?x{st}x{a}xf32>"
    epilogue_out = "\n".join([from_bhsd, f"  %out_r = tensor.cast %out : {res_dyn} to {res}"])
    epilogue = epilogue_out + f"\n  %lse_r = tensor.cast %lse : {lse_dyn} to {lse_ty}"
    out_cast = ("    linalg.yield %y : f32" if t == "f32"
                else f"    %yt = arith.truncf %y : f32 to {t}\n    linalg.yield %yt : {t}")
    qd, kd, vd = (("[B,Hq,Sq/A,A,Dq]", "[B,Hk,Sk/A,A,Dq]", "[B,Hk,Sk/A,A,Dv]") if layout == "bhsd"
                  else ("[B,Sq/A,A,Hq,Dq]", "[B,Sk/A,A,Hk,Dq]", "[B,Sk/A,A,Hk,Dv]"))
    return dict(T=t, G=int(group), DQ=int(dq), DV=int(dv), A=a, layout=layout, prologue="\n".join(lines),
                epilogue=epilogue, epilogue_out=epilogue_out, out_cast=out_cast, q_shape_doc=qd, k_shape_doc=kd, v_shape_doc=vd,
                args=args, out_type=res, lse_type=lse_ty, seqlen=seqlen, score_body=score_body)


def _normalize(f: dict, suffix: str, rows: str) -> str:
    """`mlir/normalize.mlir.in` for the op `%att<suffix>` over `rows` rows per batch entry."""
    return _load("normalize.mlir.in").substitute(s=suffix, rows=rows, T=f["T"], DV=f["DV"], out_cast=f["out_cast"])


def render_dense(*, func_name: str, dtype: str, layout: str, group: int, dq: int, dv: int, align: int,
                 lowering: Mapping[str, Any] | str | None = None, seqlen: int | None = None,
                 workspace: bool = False, softcap: float = 0.0) -> str:
    """MLIR text of `util.func public @func_name(q, k, v, scale) -> (out, lse)`: attention where
    every row sees every key, as one online_attention (template `mlir/dense.mlir.in`). `seqlen`:
    Sq = Sk fixed at compile time, `workspace` (see `_dense_common`)."""
    f = _dense_common(dtype, layout, group, dq, dv, align, seqlen, workspace, lowering=lowering, softcap=softcap)
    props, attrs = lowering_for_runtime_sizes(lowering, dv)
    return _load("dense.mlir.in").substitute(func_name=func_name, attn_props=props, attn_attrs=attrs,
                                             normalize=_normalize(f, "", "%M"), **f)


def render_dense_out(*, func_name: str, dtype: str, layout: str, group: int, dq: int, dv: int, align: int,
                     lowering: Mapping[str, Any] | str | None = None, seqlen: int | None = None,
                     causal: bool = False, workspace: bool = False, softcap: float = 0.0) -> str:
    """MLIR text of `util.func public @func_name(q, k, v, scale) -> out`: `render_dense` without
    the LSE, as IREE's `attention` op, which normalizes inside the kernel and writes the output
    type directly (no f32 accumulator in memory, no second dispatch; template
    `mlir/dense_out.mlir.in`). `causal` (needs `seqlen`, Sq == Sk): row i sees keys j <= i
    through a broadcast [G*S, S] i1 mask; every block is still computed (IREE does not skip
    masked tiles). `workspace`: see `_dense_common`."""
    f = _dense_common(dtype, layout, group, dq, dv, align, seqlen, workspace, lowering=lowering, softcap=softcap)
    props, attrs = lowering_for_runtime_sizes(lowering, dv)
    mask = dict(mask="", mask_map="", mask_in="", mask_ty="", mask_doc="Every row sees every key.")
    if causal:
        if seqlen is None:
            raise ValueError("causal dense_out needs a static seqlen")
        S, M = int(seqlen), int(group) * int(seqlen)
        ty = f"tensor<{M}x{S}xi1>"
        mask = dict(
            mask_doc=f"Causal, Sq == Sk == {S}: row g*S + i sees key j iff j <= i (a broadcast [G*S, S] i1 mask).",
            mask=(f"  %cme = tensor.empty() : {ty}\n"
                  f"  %cmask = linalg.generic {{indexing_maps = [affine_map<(d0, d1) -> (d0, d1)>], "
                  f"iterator_types = [\"parallel\", \"parallel\"]}} outs(%cme : {ty}) {{\n"
                  f"  ^bb0(%o: i1):\n    %i0 = linalg.index 0 : index\n    %j = linalg.index 1 : index\n"
                  f"    %cS = arith.constant {S} : index\n    %i = arith.remui %i0, %cS : index\n"
                  f"    %vis = arith.cmpi ule, %j, %i : index\n    linalg.yield %vis : i1\n  }} -> {ty}"),
            mask_map="\n        affine_map<(d0, d1, d2, d3, d4) -> (d1, d3)>,",
            mask_in=", %cmask", mask_ty=f", {ty}")
    return _load("dense_out.mlir.in").substitute(func_name=func_name, attn_props=props, attn_attrs=attrs,
                                                 **mask, **_v_operand(f, lowering), **f)


# `transpose_v` pays from this compiled-in length on: on the H200 (d128, f16 and bf16) V copied
# transposed was slower below 2048 rows and faster from 2048 (docs/BENCHMARKS.md, "How the
# constants were chosen").
TRANSPOSE_V_MIN_SEQLEN = 2048


def _v_operand(f: dict, lowering) -> dict:
    """V as the attention op reads it. `transpose_v` in the lowering (static S of at least
    `TRANSPOSE_V_MIN_SEQLEN`) copies V to [BH, Dv, Sk] first (`_transpose_copy`): the P@V
    operand's pairs along keys are then adjacent in shared memory, read as 32-bit words instead
    of 16-bit halves (measured faster per kernel on the H200, d128 f16 M256: docs/BENCHMARKS.md,
    "How the constants were chosen")."""
    DV, T = f["DV"], f["T"]
    if (not (isinstance(lowering, Mapping) and lowering.get("transpose_v")) or f["seqlen"] is None
            or int(f["seqlen"]) < TRANSPOSE_V_MIN_SEQLEN):
        return dict(v_prep="", v_in="%v3p", v_ty=f"tensor<?x?x{DV}x{T}>", v_map="(d0, d3, d4)",
                    v_doc="V is read as [BH, Sk, Dv].")
    S = int(f["seqlen"])
    sg = lowering.get("subgroup_size") if lowering.get("backend") != "cpu" else None
    ty = f"tensor<?x{DV}x?x{T}>"
    prep = "\n".join([
        *_rt_zero(T),
        f"  %vS = tensor.cast %v3p : tensor<?x?x{DV}x{T}> to tensor<?x{S}x{DV}x{T}>",
        _transpose_copy("vt3", "%vS", f"tensor<?x{S}x{DV}x{T}>", f"tensor<?x{DV}x{S}x{T}>", "%BH", sg),
        _pin_batch("%vtp0", "%vt3", f"tensor<?x{DV}x{S}x{T}>", "%BH"),
        f"  %vtp = tensor.cast %vtp0 : tensor<?x{DV}x{S}x{T}> to {ty}",
    ])
    return dict(v_prep=prep, v_in="%vtp", v_ty=ty, v_map="(d0, d4, d3)",
                v_doc="V is copied to [BH, Dv, Sk] first (lowering transpose_v).")
