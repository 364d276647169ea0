"""MLIR templates for the GPU entry points.

`render_online_step` renders `mlir/online_step.mlir.in`: one wave of the plan (the `step`
function) as gathers + one `iree_linalg_ext.online_attention` (single collapsed batch dim
P*Hk, M = G*R, K1 = Dq, K2 = C, N = Dv) + scatters back into the state. `render_dense`,
`render_dense_out`, `render_causal` (`mlir/dense*.mlir.in`, `mlir/causal*.mlir.in`) are the one-call
entry points of a whole batch; `render_causal_tree` (generated here: its number of levels depends
on the length) is causal at a compiled-in length as a binary tree of dense blocks.

`lowering` (a dict, "cpu", or None to let IREE choose) becomes the op's `compilation_info` and
`decomposition_config`, in the form IREE 3.13's VectorDistribute pipeline reads:

    workgroup_m      rows of G*R per workgroup (CK kM0); must divide G*R
    workgroup_n      Dv columns per workgroup (CK kN1); must divide Dv
    reduction_k2     keys per inner step (CK kN0); must divide C
    subgroup_size    64 (CDNA wave64), 32 (RDNA wave32, NVIDIA warp)
    subgroups_m      subgroups along M (default: workgroup_size // subgroup_size)
    subgroups_n      subgroups along N (default 1)
    workgroup_size   threads (default: subgroup_size * subgroups_m * subgroups_n)
    mma_kind         intrinsic for P@V, e.g. "MFMA_F32_16x16x16_F16"
    qk_mma_kind      intrinsic for Q@K^T (default: mma_kind); may be a virtual one
                     ("VMFMA_F32_16x16x32_F16"), see `qk_virtual`
    qk_virtual       True if qk_mma_kind is a virtual_mma_layout (default: name starts with "V")
    promote_operands operands of the attention op staged in shared memory (default [1, 2]: K, V;
                     as IREE's gfx942 tuning spec. [0, 1, 2] also stages Q: M=128 d=128 then
                     needs 80 KB LDS and fails on gfx9's 64 KB)
    llvm_func_attrs  optional dict of LLVM function attributes (e.g. {"amdgpu-waves-per-eu": "2"})
    prefetch_stages  optional gpu_pipeline_options prefetch_num_stages

`lowering="cpu"` (or {"backend": "cpu", ...}) renders an llvm-cpu config that keeps N whole
(distribution/vector tiles [1, M, 0, 0, 0] / [1, 1, 0, 0, 0]). Not required: with the fresh-outs
structure below IREE's own llvm-cpu default (which tiles N by 8) is also correct.

The op starts from a fresh (0, -FLT_MAX, 0) and the chunk is merged into the old state afterwards,
so workgroup_n < Dv is safe (chaining the old state through the op's outs is not: IREE binds those
outs readwrite in place and N-split workgroups then race on max/sum).

Dims of the op's iteration domain are (B, M, K1, K2, N). IREE 3.13 prints/parses the op as
`online_attention <{decomposition_config = {...}, indexing_maps = [...]}> {compilation_info = ...}`
(decomposition_config is a property inside `<{...}>`; the old `{indexing_maps = ...}` attr-dict form
is rejected with "properties dictionary is missing required attribute: indexing_maps"). Rendered:

    compilation_info = #iree_codegen.compilation_info<
      lowering_config = #iree_gpu.lowering_config<{workgroup = [1, M, 0, 0, N],
                                                   reduction = [0, 0, 0, K2, 0],
                                                   promote_operands = [1, 2]}>,
      translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<VectorDistribute>
                                                        workgroup_size = [T, 1, 1] subgroup_size = W>>,
    decomposition_config = {
      qk_attrs = {attention_qk_matmul, lowering_config = #iree_gpu.lowering_config<{
          mma_kind = ..., subgroup_basis = [[1, SM, 1, 1, SN], [0, 1, 2, 3]], promote_operands = [1]}>},
      pv_attrs = {attention_pv_matmul, lowering_config = #iree_gpu.lowering_config<{
          mma_kind = ..., subgroup_basis = [[1, SM, 1, 1, SN], [0, 1, 3, 4]], promote_operands = [1]}>}}
"""

from __future__ import annotations

import functools
import string
from pathlib import Path
from typing import Any, Mapping

_TEMPLATE_DIR = Path(__file__).resolve().parent / "mlir"

_DTYPES = {"f16": "f16", "bf16": "bf16", "f32": "f32", "float16": "f16",
           "bfloat16": "bf16", "float32": "f32"}


def _load(name: str) -> string.Template:
    return string.Template((_TEMPLATE_DIR / name).read_text())


def _ilist(xs) -> str:
    return "[" + ", ".join(str(int(x)) for x in xs) + "]"


def _mma_attr(name: str, virtual: bool | None = None) -> str:
    if virtual is None:
        virtual = name.startswith("V")
    kind = "virtual_mma_layout" if virtual else "mma_layout"
    return f"#iree_gpu.{kind}<{name}>"


def render_lowering_attrs(lowering: Mapping[str, Any] | str | None, *, m_total: int, dv: int,
                          c: int, batch_dims: int = 1) -> tuple[str, str]:
    """(properties, attributes) text for the online_attention op; ("", "") for None.

    In IREE 3.13 the op prints as
      `online_attention <{decomposition_config = {...}, indexing_maps = [...]}> {compilation_info = ...}`
    i.e. decomposition_config is an inherent property (inside `<{...}>`) and compilation_info a
    discardable attribute (in the `{...}` that follows). `batch_dims`: the op's leading batch dims
    (the tiles below are given for one, each further one gets the batch's).
    """
    if not lowering:
        return "", ""
    if isinstance(lowering, str):
        lowering = {"backend": lowering}
    lw = dict(lowering)
    xb, x0 = [1] * (batch_dims - 1), [0] * (batch_dims - 1)
    if lw.get("backend") == "cpu":
        # llvm-cpu, N kept whole (IREE's default tiles N by 8; with the old state chained
        # through the op's outs that gave a sum Dv/8 times too large -- see module docstring).
        wm = int(lw.get("workgroup_m", m_total))
        k2 = int(lw.get("reduction_k2", 2))
        return "", (
            " {compilation_info = #iree_codegen.compilation_info<\n"
            "        lowering_config = #iree_cpu.lowering_config<"
            f"distribution = {_ilist(xb + [1, wm, 0, 0, 0])}, "
            f"vector_common_parallel = {_ilist(xb + [1, 1, 0, 0, 0])}, "
            f"vector_reduction = {_ilist(x0 + [0, 0, 0, k2, 0])}>,\n"
            "        translation_info = #iree_codegen.translation_info<"
            "pipeline = #iree_cpu.pipeline<LinalgExtTileAndVectorize>>>}")
    wm = int(lw.get("workgroup_m", m_total))
    wn = int(lw.get("workgroup_n", dv))
    k2 = int(lw.get("reduction_k2", 64))
    if m_total % wm or dv % wn or c % k2:
        raise ValueError(f"tile (M={wm}, N={wn}, K2={k2}) must divide (G*R={m_total}, "
                         f"Dv={dv}, C={c})")
    sg = int(lw.get("subgroup_size", 64))
    sgm = lw.get("subgroups_m")
    sgn = int(lw.get("subgroups_n", 1))
    wg = lw.get("workgroup_size")
    if sgm is None:
        sgm = (int(wg) // sg // sgn) if wg else 4
    sgm = int(sgm)
    if wg is None:
        wg = sg * sgm * sgn
    wg = int(wg)
    if wg != sg * sgm * sgn:
        raise ValueError(f"workgroup_size {wg} != subgroup_size {sg} * {sgm} * {sgn}")
    promote = lw.get("promote_operands", [1, 2])

    lc = f"workgroup = {_ilist(xb + [1, wm, 0, 0, wn])}, reduction = {_ilist(x0 + [0, 0, 0, k2, 0])}"
    if promote is not None:
        lc += f", promote_operands = {_ilist(promote)}"
    extra = []
    if lw.get("prefetch_stages") is not None:
        extra.append("gpu_pipeline_options = #iree_gpu.pipeline_options<prefetch_num_stages = "
                     f"{int(lw['prefetch_stages'])}>")
    if lw.get("llvm_func_attrs"):
        kv = ", ".join(f'"{k}" = "{v}"' for k, v in lw["llvm_func_attrs"].items())
        extra.append(f"llvm_func_attrs = {{{kv}}}")
    ti_extra = (", {" + ", ".join(extra) + "}") if extra else ""
    attrs = (
        " {compilation_info = #iree_codegen.compilation_info<\n"
        f"        lowering_config = #iree_gpu.lowering_config<{{{lc}}}>,\n"
        "        translation_info = #iree_codegen.translation_info<"
        "pipeline = #iree_gpu.pipeline<VectorDistribute>\n"
        f"          workgroup_size = [{wg}, 1, 1] subgroup_size = {sg}{ti_extra}>>}}"
    )
    props = ""
    pv_kind = lw.get("mma_kind")
    if pv_kind:
        qk_kind = lw.get("qk_mma_kind", pv_kind)
        basis = _ilist(xb + [1, sgm, 1, 1, sgn])
        nb = batch_dims
        qk_dims, pv_dims = list(range(nb + 3)), list(range(nb + 1)) + [nb + 2, nb + 3]
        qk = (f"mma_kind = {_mma_attr(qk_kind, lw.get('qk_virtual'))}, "
              f"subgroup_basis = [{basis}, {_ilist(qk_dims)}], "
              f"promote_operands = {_ilist(lw.get('qk_promote_operands', [1]))}")
        pv = (f"mma_kind = {_mma_attr(pv_kind, False)}, "
              f"subgroup_basis = [{basis}, {_ilist(pv_dims)}], "
              f"promote_operands = {_ilist(lw.get('pv_promote_operands', [1]))}")
        props = (
            "decomposition_config = {\n"
            f"        qk_attrs = {{attention_qk_matmul, lowering_config = "
            f"#iree_gpu.lowering_config<{{{qk}}}>}},\n"
            f"        pv_attrs = {{attention_pv_matmul, lowering_config = "
            f"#iree_gpu.lowering_config<{{{pv}}}>}}}},"
        )
    return props, attrs


def render_online_step(*, func_name: str, dtype: str, layout: str, group: int, r: int, c: int,
                       dq: int, dv: int, lowering: Mapping[str, Any] | str | None = None) -> str:
    """MLIR text of `util.func public @func_name` implementing one wave of the plan.

    Signature (dynamic: B, Sq, Sk, Hq, Hk, NT, P; M = group * r):
      (q, k, v: tensor<?x?x?xDxT> in `layout` ("bshd" or "bhsd"), scale: tensor<1xf32>,
       acc: tensor<?x?xMxDvxf32>, m: tensor<?x?xMxf32>, l: tensor<?x?xMxf32>,
       desc: tensor<?x10xi32>) -> (acc, m, l)
    """
    t = _DTYPES.get(str(dtype))
    if t is None:
        raise ValueError(f"dtype {dtype!r} not in f16/bf16/f32")
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout {layout!r} not in bshd/bhsd")
    for name, val in (("group", group), ("r", r), ("c", c), ("dq", dq), ("dv", dv)):
        if int(val) <= 0:
            raise ValueError(f"{name} must be positive, got {val}")
    m_total = int(group) * int(r)
    if layout == "bshd":
        seq_dim = 1
        q_index = "%b, %s, %hq, %i2"
        kv_index = "%b, %s, %h, %i2"
        q_doc, k_doc, v_doc = "[B,Sq,Hq,Dq]", "[B,Sk,Hk,Dq]", "[B,Sk,Hk,Dv]"
    else:
        seq_dim = 2
        q_index = "%b, %hq, %s, %i2"
        kv_index = "%b, %h, %s, %i2"
        q_doc, k_doc, v_doc = "[B,Hq,Sq,Dq]", "[B,Hk,Sk,Dq]", "[B,Hk,Sk,Dv]"
    if t == "f32":
        scale_cast = "  %scale_t = arith.addf %scale_f32, %zero : f32"
    else:
        scale_cast = f"  %scale_t = arith.truncf %scale_f32 : f32 to {t}"
    attn_props, attn_attrs = render_lowering_attrs(lowering, m_total=m_total, dv=int(dv),
                                                   c=int(c))
    return _load("online_step.mlir.in").substitute(
        func_name=func_name, T=t, G=int(group), R=int(r), C=int(c), DQ=int(dq), DV=int(dv),
        M=m_total, layout=layout, seq_dim=seq_dim, q_index=q_index, kv_index=kv_index,
        q_shape_doc=q_doc, k_shape_doc=k_doc, v_shape_doc=v_doc, scale_cast=scale_cast,
        attn_props=attn_props, attn_attrs=attn_attrs)


def default_lowering(target: str, *, dtype: str = "f16", r: int = 128, group: int = 1,
                     c: int = 64, dv: int = 128) -> dict | None:
    """A sensible `lowering` per GPU target family (None for CPU targets).

    gfx9 (CDNA: gfx90a/gfx942/gfx950): MFMA 16x16x16, wave64, 4 waves along M.
    gfx11/gfx12 (RDNA3/4): WMMA 16x16x16 (WMMAR3_/WMMAR4_), wave32, 4 waves along M.
    sm_80+: NV_MMA_SYNC 16x8x16, warp 32, 4 warps along M.
    Tiles: M = 64, N = Dv, K2 = 64 (32 when Dv >= 256 on 64 KB-LDS gfx9; M64 N256 K2=64 needs
    72 KB). Checked with iree-compile 3.13 (R=128, C=64): no VGPR spills for d = 64/128 on
    gfx90a/gfx942/gfx950/gfx1100/gfx1201, compiles for sm_80. RDNA with Dv >= 256 returns None
    (IREE's default): every explicit RDNA d256 config tried spilled (wave32, Q kept in VGPRs).
    M=128 on RDNA needs 8 waves (4 waves spill ~95 VGPRs at d128).
    """
    t = _DTYPES.get(str(dtype), str(dtype))
    tgt = target.lower()
    m_total = int(group) * int(r)
    wm = 64 if m_total % 64 == 0 else m_total
    k2 = 64 if c % 64 == 0 else (32 if c % 32 == 0 else c)
    if int(dv) >= 256 and tgt != "gfx950" and c % 32 == 0:
        k2 = 32
    base = {"workgroup_m": wm, "workgroup_n": int(dv), "reduction_k2": k2,
            "promote_operands": [1, 2]}
    if t == "f32":
        # No f32 MMA tiles are given for these; let IREE pick.
        return None
    if tgt.startswith("gfx9") or tgt in ("mi300x", "mi300a", "mi308x", "mi325x", "mi250x",
                                          "mi250", "mi210", "mi355x", "mi350x"):
        kind = "MFMA_F32_16x16x16_F16" if t == "f16" else "MFMA_F32_16x16x16_BF16"
        if tgt == "gfx90a" or tgt.startswith("mi2"):
            kind = "MFMA_F32_16x16x16_F16" if t == "f16" else "MFMA_F32_16x16x8_BF16"
        return {**base, "subgroup_size": 64, "subgroups_m": 4, "mma_kind": kind}
    if tgt.startswith("gfx11") or tgt.startswith("gfx12"):
        if int(dv) >= 256:
            return None
        gen = "WMMAR3" if tgt.startswith("gfx11") else "WMMAR4"
        kind = f"{gen}_F32_16x16x16_{'F16' if t == 'f16' else 'BF16'}"
        return {**base, "subgroup_size": 32, "subgroups_m": 4, "mma_kind": kind}
    if tgt.startswith("sm_"):
        kind = "NV_MMA_SYNC_F32_16x8x16_F16" if t == "f16" else "NV_MMA_SYNC_F32_16x8x16_BF16"
        return {**base, "subgroup_size": 32, "subgroups_m": 4, "mma_kind": kind}
    return None


def _dense_common(dtype: str, layout: str, group: int, dq: int, dv: int, align: int,
                  seqlen: int | None = None, workspace: bool = False, extra_args: tuple[str, ...] = ()) -> dict:
    """Fields shared by the dense and causal templates.

    The sequence axis crosses the ABI split as (S / A, A) with A = `align` (the host reshapes, for
    free): IREE's GPU pipeline only distributes an attention whose M and K2 it can prove to be
    multiples of its tiles, and a product with a static factor is such a proof.
    `prologue` defines the constants, `%scale_t`, the inputs as bhsd (`%qb`, `%kb`, `%vb`:
    [B, H, S/A, A, D], a transpose each for bshd) and their dims; `from_bhsd` turns `%o4`
    [B, Hq, S/A, A, Dv] into `%out` in `layout`, `epilogue` casts it and `%lse` to the result types.

    `seqlen` (a multiple of A) makes S static in the function's types (a shape-specialized entry
    point; the runtime refuses other lengths): the arguments are cast to the dynamic types the
    templates use and IREE propagates the static sizes into every dispatch.

    `extra_args` follow the scale. `workspace` adds `%workspace: !hal.buffer {iree.abi.transients}` last: the
    caller's buffer holds the function's intermediates (partials, copies), sized by IREE's
    generated `<func>_transients_size` query. Without it IREE allocates them per call, and its
    CUDA HAL frees them with a host wait for the call's last kernel (`queue_dealloca`), which
    serialized back-to-back calls."""
    t = _DTYPES.get(str(dtype))
    if t is None:
        raise ValueError(f"dtype {dtype!r} not in f16/bf16/f32")
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout {layout!r} not in bshd/bhsd")
    for name, val in (("group", group), ("dq", dq), ("dv", dv), ("align", align)):
        if int(val) <= 0:
            raise ValueError(f"{name} must be positive, got {val}")
    a = int(align)
    if seqlen is not None and (int(seqlen) <= 0 or int(seqlen) % a):
        raise ValueError(f"seqlen must be a positive multiple of align={a}, got {seqlen}")
    st = "?" if seqlen is None else str(int(seqlen) // a)
    ty = {x: f"tensor<?x?x?x{a}x{d}x{t}>" for x, d in (("q", dq), ("k", dq), ("v", dv))}
    lines = [
        "  %c0 = arith.constant 0 : index", "  %c1 = arith.constant 1 : index",
        "  %c2 = arith.constant 2 : index", "  %c3 = arith.constant 3 : index",
        f"  %cG = arith.constant {int(group)} : index", f"  %cA = arith.constant {a} : index",
        "  %zero = arith.constant 0.0 : f32", "  %fmin = arith.constant -3.40282347E+38 : f32",
        "  %ln2 = arith.constant 0.693147180559945309 : f32",
        "  %scale_f32 = tensor.extract %scale[%c0] : tensor<1xf32>",
        "  %scale_t = arith.addf %scale_f32, %zero : f32" if t == "f32"
        else f"  %scale_t = arith.truncf %scale_f32 : f32 to {t}",
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
                args=args, out_type=res, lse_type=lse_ty, seqlen=seqlen)


def _normalize(f: dict, suffix: str, rows: str) -> str:
    """`mlir/normalize.mlir.in` for the op `%att<suffix>` over `rows` rows per batch entry."""
    return _load("normalize.mlir.in").substitute(s=suffix, rows=rows, T=f["T"], DV=f["DV"], out_cast=f["out_cast"])


def _lowering_for_whole_rows(lowering, dv: int, batch_dims: int = 1):
    """(props, attrs) for an op whose M and K2 are runtime sizes (the caller checks divisibility)."""
    if not lowering:
        return "", ""
    lw = {"backend": lowering} if isinstance(lowering, str) else dict(lowering)
    m = int(lw.get("workgroup_m", 1))
    k2 = int(lw.get("reduction_k2", 1))
    return render_lowering_attrs(lw, m_total=m, dv=int(dv), c=k2, batch_dims=batch_dims)


def render_dense(*, func_name: str, dtype: str, layout: str, group: int, dq: int, dv: int, align: int,
                 lowering: Mapping[str, Any] | str | None = None, seqlen: int | None = None,
                 workspace: bool = False) -> str:
    """MLIR text of `util.func public @func_name(q, k, v, scale) -> (out, lse)`: attention where
    every row sees every key, as one online_attention (template `mlir/dense.mlir.in`). `seqlen`:
    Sq = Sk fixed at compile time, `workspace` (see `_dense_common`)."""
    f = _dense_common(dtype, layout, group, dq, dv, align, seqlen, workspace)
    props, attrs = _lowering_for_whole_rows(lowering, dv)
    return _load("dense.mlir.in").substitute(func_name=func_name, attn_props=props, attn_attrs=attrs,
                                             normalize=_normalize(f, "", "%M"), **f)


def _pin(f: dict, b: int) -> str:
    """`%q3p_b`, `%k3p_b`, `%v3p_b`: a row block's operands. With static lengths IREE would fold the
    surrounding reshapes into the op (two batch dims, which its GPU config cannot tile); an
    optimization barrier keeps the batch dims collapsed."""
    lines = []
    for x, d, rows in (("q", f["DQ"], "%GC"), ("k", f["DQ"], f"%K_{b}"), ("v", f["DV"], f"%K_{b}")):
        ty = f"tensor<?x?x{d}x{f['T']}>"
        if f["seqlen"] is None:
            lines.append(f"  %{x}3p_{b} = tensor.cast %{x}3_{b} : {ty} to {ty}")
        else:
            lines.append(_pin_batch(f"%{x}3p_{b}", f"%{x}3_{b}", ty, f"%BH, {rows}"))
    return "\n".join(lines)


def render_dense_out(*, func_name: str, dtype: str, layout: str, group: int, dq: int, dv: int, align: int,
                     lowering: Mapping[str, Any] | str | None = None, seqlen: int | None = None,
                     causal: bool = False, workspace: bool = False) -> str:
    """MLIR text of `util.func public @func_name(q, k, v, scale) -> out`: `render_dense` without
    the LSE, as IREE's `attention` op, which normalizes inside the kernel and writes the output
    type directly (no f32 accumulator in memory, no second dispatch; template
    `mlir/dense_out.mlir.in`). `causal` (needs `seqlen`, Sq == Sk): row i sees keys j <= i
    through a broadcast [G*S, S] i1 mask; every block is still computed (IREE does not skip
    masked tiles). `workspace`: see `_dense_common`."""
    f = _dense_common(dtype, layout, group, dq, dv, align, seqlen, workspace)
    props, attrs = _lowering_for_whole_rows(lowering, dv)
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


# `transpose_v` pays from this compiled-in length on. H200, B*S = 16k, bench.py, one run
# (2026-11-30, commit 0312255; docs/bench/h200_2026-11-30c_*): f16 d128 S = 512 / 1024 / 2048 / 4096 /
# 16384 0.52 / 0.88 / 1.61 / 3.08 / 11.95 ms -> 0.66 / 0.93 / 1.57 / 2.93 / 10.88; bf16 d128
# 0.51 / 0.89 / 1.61 / 3.05 / 11.67 -> 0.57 / 0.87 / 1.49 / 2.65 / 9.69 (the transpose itself
# 0.12 ms at B*S = 16k, H=16; 0.062 ms since commit 59a747a's 8 elements per thread, not re-measured here).
TRANSPOSE_V_MIN_SEQLEN = 2048


def _v_operand(f: dict, lowering) -> dict:
    """V as the attention op reads it. `transpose_v` in the lowering (static S of at least
    `TRANSPOSE_V_MIN_SEQLEN`) copies V to [BH, Dv, Sk] first (`_transpose_copy`): the P@V
    operand's pairs along keys are then adjacent in shared memory, read as 32-bit words instead
    of 16-bit halves (H200, d128 f16 M256: 2.75 against 3.01 ms per kernel at S=4096)."""
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


def render_causal(*, func_name: str, dtype: str, layout: str, group: int, dq: int, dv: int, blocks: int,
                  align: int, lowering: Mapping[str, Any] | str | None = None, seqlen: int | None = None,
                  workspace: bool = False) -> str:
    """MLIR text of `util.func public @func_name(q, k, v, scale) -> (out, lse)`: causal attention
    (Sq == Sk, S a multiple of `blocks * align`) as `blocks` independent row blocks, each against
    the keys up to its diagonal (templates `mlir/causal.mlir.in`, `mlir/causal_block.mlir.in`).
    `workspace`: see `_dense_common`."""
    f = _dense_common(dtype, layout, group, dq, dv, align, seqlen, workspace)
    nb = int(blocks)
    if nb < 1:
        raise ValueError(f"blocks must be positive, got {blocks}")
    props, attrs = _lowering_for_whole_rows(lowering, dv)
    block = _load("causal_block.mlir.in")
    parts = [block.substitute(b=b, b1=b + 1, attn_props=props, attn_attrs=attrs, pin=_pin(f, b),
                              normalize=_normalize(f, f"_{b}", "%GC"), **f) for b in range(nb)]
    rows = "  %o6_0 = tensor.cast %o6_e : {t} to {t}\n  %l5_0 = tensor.cast %l5_e : {u} to {u}".format(
        t=f"tensor<?x?x{f['G']}x?x{f['A']}x{f['DV']}x{f['T']}>", u=f"tensor<?x?x{f['G']}x?x{f['A']}xf32>")
    return _load("causal.mlir.in").substitute(func_name=func_name, NB=nb, row_blocks=rows + "".join(parts), **f)


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
            + _fresh_online_attention(name, f"%{name}_n", maps, ins, tys, acc, ml, props, attrs))


def _fresh_online_attention(name: str, n: str, maps: list[str], ins: str, tys: str, acc: str, ml: str, props: str,
                            attrs: str) -> str:
    """`%name:3` = online_attention from a fresh state (acc 0, max -inf, sum 0) of types `acc` /
    `ml` (dynamic batch `n`)."""
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
    iree_linalg_ext.yield %score : f32
  }} -> {acc}, {ml}, {ml}
"""


def _attn_op_vt(name: str, q: str, k: str, vt: str, *, f: dict, nb: int, rows: int, keys: int, lowering,
                mask: str | None = None) -> str:
    """`_attn_op` over the batch dims (BH, nb) with V read transposed: q [BH, nb, rows, Dq],
    k [BH, nb, keys, Dq], vt [BH, Dv, nb, keys] (blocks of one transposed V, so V's batch dims
    are not adjacent and stay two); the nb dim is left out where nb = 1 (IREE would fold it,
    dropping the tiles). Results `%name_r0..2` as [BH * nb, rows(, Dv)]."""
    T, DQ, DV = f["T"], f["DQ"], f["DV"]
    two = nb > 1
    props, attrs = _lowering_for_whole_rows(lowering, DV, batch_dims=2 if two else 1)
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
    text = _fresh_online_attention(name, "%BH", maps, ins, tys, acc, ml, props, attrs)
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


def _blocks_view(name: str, src: str, src_ty: str, exp: list, shape: list, col: list | None, view_ty: str,
                 off: list | None = None, size: list | None = None, out_ty: str | None = None, n: str = "%BH") -> str:
    """`name` = `src` expanded by `exp` to `shape`, collapsed by `col` to `view_ty` (dynamic dim:
    `n`), pinned, and (with `off`) sliced to `size` / `out_ty`: blocks read in place."""
    base = name.lstrip("%")
    ety = "tensor<" + "x".join(str(x) if not str(x).startswith("%") else "?" for x in shape) + "x" + src_ty.rsplit("x", 1)[1]
    lines = [f"  %{base}_x = tensor.expand_shape {src} {exp} output_shape [{', '.join(map(str, shape))}] : {src_ty} into {ety}"]
    if col:
        lines.append(f"  %{base}_c = tensor.collapse_shape %{base}_x {col} : {ety} into {view_ty}")
    lines.append(_pin_batch(f"%{base}_p" if off else name, f"%{base}_c" if col else f"%{base}_x", view_ty, n))
    if off:
        lines.append(f"  {name} = tensor.extract_slice %{base}_p[{', '.join(map(str, off))}] [{n}, {', '.join(map(str, size))}]"
                     f" [{', '.join(['1'] * len(off))}] : {view_ty} to {out_ty}")
    return "\n".join(lines)


def _copy(name: str, src: str, src_ty: str, dst_ty: str, rank: int, perm: list[int],
          pick: dict[int, int] | None = None, subgroup: int | None = None) -> str:
    """`%name` = elementwise copy of `src` into a fresh `dst_ty` (first two dims dynamic: %B, %Hk),
    dst dim i taken from src dim perm[i]: a contiguous batch for the next attention op. `pick`
    {src dim: index} reads one index of extra src dims (the src then has rank + len(pick) dims).

    Each element gets `%rt_zero` added (a zero IREE cannot fold: scale - scale), so the copy stays
    an elementwise kernel: a plain copy becomes IREE's `slow_memcpy` dispatch, one f16 per thread
    in 64-thread workgroups (0.16 ms per 32 MiB on the H200, 2026-11-30). With `subgroup` (the
    GPU's subgroup size) the copy gets its own tiles (`_copy_config`); it then iterates over the
    non-unit dims of `dst_ty` only (IREE folds unit dims into a new op, dropping the tiles) and
    expands back."""
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
    dim per thread, 4 x 32 threads. H200, [64, 4096, 128] f16 (2026-11-30, commit 59a747a;
    docs/bench/h200_2026-11-30e_*): 0.062 ms in the module against 0.12 with 4 elements per
    thread (8 x 32 threads); IREE's own tiles 0.53 ms."""
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


def _pin_batch(name: str, src: str, ty: str, n: str) -> str:
    """`name` = `src` passed through a `flow.tensor.reshape` (to the same type, its dynamic batch
    size re-tied), so IREE does not fold the reshapes around it into the attention op, which would
    give the op several batch dims its GPU config cannot tile. (A `util.optimization_barrier` did
    the same but made the host wait for the GPU at that point of the call: on the H200 three such
    waits cost the S=16384 causal tree ~2.8 ms per call, 2026-11-30.)"""
    return f"  {name} = flow.tensor.reshape {src} : {ty}{{{n}}} -> {ty}{{{n}}}"


def _pair_slice(name: str, src: str, rank: int, S: int, L: int, d: int, T: str, n: str, off: int) -> str:
    """`name` [N, L, d] = rows off..off+L of every 2L-row block of `src` ([B, Hk, S, d], or
    [B, Hk, 1, S, d] with `rank` 6), N = `n` = B * Hk * S / (2L): the blocks are a uniformly strided
    batch, so the slice is read in place by the attention dispatch it feeds (IREE clones an
    extract_slice into its consumer) instead of being copied. The [N, 2L, d] view is pinned
    (`_pin_batch`) so IREE keeps one batch dim."""
    nb, base = S // (2 * L), name.lstrip("%")
    full = "x".join(["?", "?"] + (["1"] if rank == 6 else []) + [str(S), str(d), T])
    blk = "x".join(["?", "?"] + (["1"] if rank == 6 else []) + [str(nb), str(2 * L), str(d), T])
    lead = [[0], [1], [2]] if rank == 6 else [[0], [1]]
    k = len(lead)
    exp = lead + [[k, k + 1], [k + 2]]
    col = [list(range(k + 1)), [k + 1], [k + 2]]
    shape = ", ".join(["%B", "%Hk"] + (["1"] if rank == 6 else []) + [str(nb), str(2 * L), str(d)])
    vty = f"tensor<?x{2 * L}x{d}x{T}>"
    return "\n".join([
        f"  %{base}_x = tensor.expand_shape {src} {exp} output_shape [{shape}] : tensor<{full}> into tensor<{blk}>",
        f"  %{base}_c = tensor.collapse_shape %{base}_x {col} : tensor<{blk}> into {vty}",
        _pin_batch(f"%{base}_p", f"%{base}_c", vty, n),
        f"  {name} = tensor.extract_slice %{base}_p[0, {off}, 0] [{n}, {L}, {d}] [1, 1, 1] : {vty} to tensor<?x{L}x{d}x{T}>",
    ])


def _bty(T: str, *dims) -> str:
    """`tensor<?x{dims}x{T}>`: a block view's type, its leading (B * Hk) dim dynamic."""
    return "tensor<?x" + "".join(f"{x}x" for x in dims) + f"{T}>"


def _grouped_q_once(f: dict, S: int, C: int, sg, src: str = "%qS") -> str:
    """`%qG` [B, Hk, S/C, G, C, Dq] = the grouped Q `src` [B, Hk, G, S, Dq] copied once with G inside
    each C-row block: every op of the block-split templates then reads its Q blocks in place (the
    rows of a block of L = m * C rows come as (m, G, C), which attention does not mind and the
    merge's views follow). Fenced (`compute_barrier.end`) so that no reshape is folded into it."""
    G, DQ, nd = f["G"], f["DQ"], S // C
    ty = functools.partial(_bty, f["T"])
    xty = ty("?", G, nd, C, DQ)
    return "\n".join([
        f"  %qGx = tensor.expand_shape {src} [[0], [1], [2], [3, 4], [5]] output_shape [%B, %Hk, {G}, {nd}, {C}, {DQ}]"
        f" : {ty('?', G, S, DQ)} into {xty}",
        _copy("qGt", "%qGx", xty, ty("?", nd, G, C, DQ), 6, [0, 1, 3, 2, 4, 5], subgroup=sg).rstrip("\n"),
        f"  %qG = iree_tensor_ext.compute_barrier.end %qGt : {ty('?', nd, G, C, DQ)}{{%B, %Hk}} -> {ty('?', nd, G, C, DQ)}",
    ])


def _grouped_q_view(name: str, f: dict, *, nd: int, C: int, nb: int, span: int, pick: int | None,
                    flat: str | None = None) -> str:
    """`name` = blocks of `%qG` (`_grouped_q_once`) read in place: nb blocks of `span` C-blocks
    ([BH(, nb), span*G*C, Dq]), or with `pick` half `pick` of each. `flat`: the blocks folded into
    one batch dim of that size ([B*Hk*nb, ...], the ops of one batch dim)."""
    G, DQ = f["G"], f["DQ"]
    ty = functools.partial(_bty, f["T"])
    rows, bd = span * G * C, ([nb] if nb > 1 and not flat else [])
    col = [[0, 1], [2], [3, 4, 5], [6]] if bd else [[0, 1, 2], [3, 4, 5], [6]]
    sl = () if pick is None else ([0, *[0] * len(bd), pick * rows // 2, 0], [*bd, rows // 2, DQ], ty(*bd, rows // 2, DQ))
    return _blocks_view(name, "%qG", ty("?", nd, G, C, DQ), [[0], [1], [2, 3], [4], [5], [6]],
                        ["%B", "%Hk", nb, span, G, C, DQ], col, ty(*bd, rows, DQ), *sl, n=flat or "%BH")


def _fenced_v_transpose(f: dict, S: int, sg) -> list[str]:
    """`%vT` [BH, Dv, S] = `%vS` transposed (`_transpose_copy`), for the block-split templates' V^T
    blocks. Fenced on both sides so that no reshape is folded into the transpose (IREE would
    re-create the op and drop its tiles: 0.48 instead of 0.12 ms at B*S = 16k, H=16 on the H200)."""
    DV, T = f["DV"], f["T"]
    src, dst = f"tensor<?x{S}x{DV}x{T}>", f"tensor<?x{DV}x{S}x{T}>"
    return [f"  %vF = tensor.collapse_shape %vS [[0, 1], [2], [3]] : tensor<?x?x{S}x{DV}x{T}> into {src}",
            _pin_batch("%vFp", "%vF", src, "%BH"),
            _transpose_copy("vT0", "%vFp", src, dst, "%BH", sg),
            f"  %vT = iree_tensor_ext.compute_barrier.end %vT0 : {dst}{{%BH}} -> {dst}"]


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


def diag_lowering(lowering):
    """The causal tree's masked diagonal op's lowering: a GPU lowering of 256 or more rows per
    workgroup at half the rows and half the subgroups (its C x C blocks are short in keys; twice
    the workgroups fill the GPU better). H200, f16 d128 (M=256, 8 subgroups), causal_profile.py
    (2026-11-30, commit 59a747a; docs/bench/h200_2026-11-30e_profile_*): the diagonal kernel 0.301 ->
    0.281 ms at S=2048 and 0.303 -> 0.283 ms at S=4096; with 8 subgroups of 16 rows instead
    0.40 ms. Other lowerings unchanged (not measured)."""
    if not isinstance(lowering, Mapping) or lowering.get("backend") == "cpu":
        return lowering
    wm, sgm = int(lowering.get("workgroup_m", 0)), lowering.get("subgroups_m")
    if wm < 256 or sgm is None or int(sgm) % 2:
        return lowering
    lw = dict(lowering, workgroup_m=wm // 2, subgroups_m=int(sgm) // 2)
    if lw.get("workgroup_size"):
        lw["workgroup_size"] = int(lw["workgroup_size"]) // 2
    return lw


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
    f = _dense_common(dtype, layout, group, dq, dv, align, seqlen, workspace)
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
    ST = S // A
    # static-S views [B, Hk, G, S, Dq] of q and [B, Hk, S, D] of k, v
    body.append(f"""  %qS5 = tensor.cast %qb : tensor<?x?x?x{A}x{DQ}x{T}> to tensor<?x?x{ST}x{A}x{DQ}x{T}>
  %qS6 = tensor.expand_shape %qS5 [[0], [1, 2], [3], [4], [5]] output_shape [%B, %Hk, {G}, {ST}, {A}, {DQ}]
      : tensor<?x?x{ST}x{A}x{DQ}x{T}> into tensor<?x?x{G}x{ST}x{A}x{DQ}x{T}>
  %qS = tensor.collapse_shape %qS6 [[0], [1], [2], [3, 4], [5]] : tensor<?x?x{G}x{ST}x{A}x{DQ}x{T}> into tensor<?x?x{G}x{S}x{DQ}x{T}>""")
    for x, d in (("k", DQ), ("v", DV)):
        body.append(f"""  %{x}S5 = tensor.cast %{x}b : tensor<?x?x?x{A}x{d}x{T}> to tensor<?x?x{ST}x{A}x{d}x{T}>
  %{x}S = tensor.collapse_shape %{x}S5 [[0], [1], [2, 3], [4]] : tensor<?x?x{ST}x{A}x{d}x{T}> into tensor<?x?x{S}x{d}x{T}>""")

    body.append(f"""  %dmask_e = tensor.empty() : tensor<{G * C}x{C}xi1>
  %dmask = linalg.generic {{indexing_maps = [affine_map<(d0, d1) -> (d0, d1)>], iterator_types = ["parallel", "parallel"]}}
      outs(%dmask_e : tensor<{G * C}x{C}xi1>) {{
  ^bb0(%o: i1):
    %i0 = linalg.index 0 : index
    %j = linalg.index 1 : index
    %cC = arith.constant {C} : index
    %i = arith.remui %i0, %cC : index
    %vis = arith.cmpi ule, %j, %i : index
    linalg.yield %vis : i1
  }} -> tensor<{G * C}x{C}xi1>""")
    if vt:
        _tree_blocks_vt(body, f, S=S, C=C, sg=sg, lowering=lowering)
        pinned.update(["%dg"] + [f"%lv{j}" for j in range(nl)])
    else:
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
        dprops, dattrs = _lowering_for_whole_rows(diag_lowering(lowering), DV)
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
            pinned.add(f"%lv{j}")

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
        calc = ["    %mx0 = arith.addf %m0, %zero : f32"]
        for i in range(1, len(parts)):
            j = i - 1
            calc += [f"    %t{i} = linalg.index {3 + (nl - 1 - j)} : index",
                     f"    %ok{i} = arith.cmpi eq, %t{i}, %c1 : index",
                     f"    %ms{i} = arith.select %ok{i}, %m{i}, %fmin : f32",
                     f"    %mx{i} = arith.maximumf %mx{i - 1}, %ms{i} : f32"]
        mx = f"%mx{len(parts) - 1}"
        for i in range(len(parts)):
            calc += [f"    %dm{i} = arith.subf {'%m0' if i == 0 else f'%ms{i}'}, {mx} : f32",
                     f"    %fx{i} = math.exp2 %dm{i} : f32"]
            calc.append(f"    %f{i} = arith.select %ok{i}, %fx{i}, %zero : f32" if i else f"    %f{i} = arith.addf %fx{i}, %zero : f32")
            calc += [f"    %fl{i} = arith.mulf %f{i}, %l{i} : f32",
                     f"    %sl{i} = arith.addf {'%zero' if i == 0 else f'%sl{i - 1}'}, %fl{i} : f32"]
            if with_d:
                calc += [f"    %fa{i} = arith.mulf %f{i}, %a{i} : f32",
                         f"    %sa{i} = arith.addf {'%zero' if i == 0 else f'%sa{i - 1}'}, %fa{i} : f32"]
        n = len(parts) - 1
        if with_d:
            calc.append(f"    %y = arith.divf %sa{n}, %sl{n} : f32")
            calc.append(f["out_cast"])
        else:
            calc += [f"    %lg = math.log2 %sl{n} : f32", f"    %tt = arith.addf {mx}, %lg : f32",
                     "    %e = arith.mulf %tt, %ln2 : f32", "    linalg.yield %e : f32"]
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
    head = (f"// causal attention as a binary tree of dense blocks (mlir_templates.render_causal_tree):\n"
            f"// S={S}, diagonal blocks C={C}, {nl} levels, G={G}, {T}, Dq={DQ}, Dv={DV}, {layout}\n"
            f"util.func public @{func_name}({f['args']})\n"
            f"    -> ({f['out_type']}, {f['lse_type']}) {{")
    return head + "\n" + "\n".join(body) + "\n}\n"


def _rt_zero(T: str) -> list[str]:
    """`%rt_zero`: a zero of type T that IREE cannot fold (scale - scale), see `_copy`."""
    return ["  %rt_zero_f = arith.subf %scale_f32, %scale_f32 : f32",
            "  %rt_zero = arith.addf %rt_zero_f, %zero : f32" if T == "f32" else f"  %rt_zero = arith.truncf %rt_zero_f : f32 to {T}"]


def _blocks_start(f: dict, lowering) -> tuple[str, str, int | None, list[str]]:
    """(attention props, attrs, GPU subgroup size or None, first body lines) of the block-split
    templates (causal tree, sliding window)."""
    props, attrs = _lowering_for_whole_rows(lowering, f["DV"])
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
    f = _dense_common(dtype, layout, group, dq, dv, align, seqlen, workspace, extra_args=("%win: tensor<1xi32>",))
    S, C, A, G = int(seqlen), int(block), f["A"], f["G"]
    T, DQ, DV = f["T"], f["DQ"], f["DV"]
    nd = S // C if C > 0 and S % C == 0 else 0
    if nd < 2 or C % A:
        raise ValueError(f"block={block}: seqlen {S} must be at least two blocks and block a multiple of {A}")
    if vt is None:
        vt = bool(isinstance(lowering, Mapping) and lowering.get("transpose_v")) and S >= TRANSPOSE_V_MIN_SEQLEN
    props, attrs, sg, body = _blocks_start(f, lowering)
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

    n1 = nd - 1
    if vt:
        _window_blocks_vt(body, f, S=S, C=C, sg=sg)
    else:
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
    if vt:
        for name, n, m in (("dg", nd, "%dmask"), ("pv", n1, "%pmask")):
            q_, k_, v_ = (f"%{x}{'D' if name == 'dg' else 'P'}p" for x in ("q", "k", "vt"))
            body.append(_attn_op_vt(name, q_, k_, v_, f=f, nb=n, rows=G * C, keys=C, lowering=lowering, mask=m))
    else:
        body.append(_attn_op("dg", "%qDp", "%kDp", "%vDp", f=f, n=nd, rows=G * C, keys=C, props=props, attrs=attrs, mask="%dmask"))
        body.append(_attn_op("pv", "%qPp", "%kPp", "%vPp", f=f, n=n1, rows=G * C, keys=C, props=props, attrs=attrs, mask="%pmask"))

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
    head = (f"// sliding window (mlir_templates.render_window): S={S}, blocks C={C}, G={G}, {T}, Dq={DQ}, Dv={DV}, {layout}\n"
            f"util.func public @{func_name}({f['args']})\n"
            f"    -> ({f['out_type']}, {f['lse_type']}) {{")
    return head + "\n" + "\n".join(body) + "\n}\n"
