"""MLIR templates for the GPU path of the work-unit plan.

`render_online_step` renders `mlir/online_step.mlir.in`: one wave of the plan (the `step`
function) as gathers + one `iree_linalg_ext.online_attention` (single collapsed batch dim
P*Hk, M = G*R, K1 = Dq, K2 = C, N = Dv) + scatters back into the state.

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
                          c: int) -> tuple[str, str]:
    """(properties, attributes) text for the online_attention op; ("", "") for None.

    In IREE 3.13 the op prints as
      `online_attention <{decomposition_config = {...}, indexing_maps = [...]}> {compilation_info = ...}`
    i.e. decomposition_config is an inherent property (inside `<{...}>`) and compilation_info a
    discardable attribute (in the `{...}` that follows).
    """
    if not lowering:
        return "", ""
    if isinstance(lowering, str):
        lowering = {"backend": lowering}
    lw = dict(lowering)
    if lw.get("backend") == "cpu":
        # llvm-cpu, N kept whole (IREE's default tiles N by 8; with the old state chained
        # through the op's outs that gave a sum Dv/8 times too large -- see module docstring).
        wm = int(lw.get("workgroup_m", m_total))
        k2 = int(lw.get("reduction_k2", 2))
        return "", (
            " {compilation_info = #iree_codegen.compilation_info<\n"
            "        lowering_config = #iree_cpu.lowering_config<"
            f"distribution = {_ilist([1, wm, 0, 0, 0])}, "
            "vector_common_parallel = [1, 1, 0, 0, 0], "
            f"vector_reduction = {_ilist([0, 0, 0, k2, 0])}>,\n"
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

    lc = f"workgroup = {_ilist([1, wm, 0, 0, wn])}, reduction = {_ilist([0, 0, 0, k2, 0])}"
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
        basis = _ilist([1, sgm, 1, 1, sgn])
        qk = (f"mma_kind = {_mma_attr(qk_kind, lw.get('qk_virtual'))}, "
              f"subgroup_basis = [{basis}, [0, 1, 2, 3]], "
              f"promote_operands = {_ilist(lw.get('qk_promote_operands', [1]))}")
        pv = (f"mma_kind = {_mma_attr(pv_kind, False)}, "
              f"subgroup_basis = [{basis}, [0, 1, 3, 4]], "
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


def _dense_common(dtype: str, layout: str, group: int, dq: int, dv: int, align: int) -> dict:
    """Fields shared by the dense and causal templates.

    The sequence axis crosses the ABI split as (S / A, A) with A = `align` (the host reshapes, for
    free): IREE's GPU pipeline only distributes an attention whose M and K2 it can prove to be
    multiples of its tiles, and a product with a static factor is such a proof.
    `prologue` defines the constants, `%scale_t`, the inputs as bhsd (`%qb`, `%kb`, `%vb`:
    [B, H, S/A, A, D], a transpose each for bshd) and their dims; `from_bhsd` turns `%o4`
    [B, Hq, S/A, A, Dv] into `%out` in `layout`."""
    t = _DTYPES.get(str(dtype))
    if t is None:
        raise ValueError(f"dtype {dtype!r} not in f16/bf16/f32")
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout {layout!r} not in bshd/bhsd")
    for name, val in (("group", group), ("dq", dq), ("dv", dv), ("align", align)):
        if int(val) <= 0:
            raise ValueError(f"{name} must be positive, got {val}")
    a = int(align)
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
    for x in ("q", "k", "v"):
        if layout == "bhsd":
            lines.append(f"  %{x}b = tensor.cast %{x} : {ty[x]} to {ty[x]}")
        else:  # [B, S/A, A, H, D] -> [B, H, S/A, A, D]
            d = dq if x != "v" else dv
            src = f"tensor<?x?x{a}x?x{d}x{t}>"
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
        args = f"%q: {ty['q']}, %k: {ty['k']}, %v: {ty['v']}"
        res = oty
    else:
        res = f"tensor<?x?x{a}x?x{dv}x{t}>"
        from_bhsd = "\n".join([
            f"  %o_B = tensor.dim %o4, %c0 : {oty}", f"  %o_H = tensor.dim %o4, %c1 : {oty}",
            f"  %o_S = tensor.dim %o4, %c2 : {oty}", f"  %o_e = tensor.empty(%o_B, %o_S, %o_H) : {res}",
            f"  %out = linalg.transpose ins(%o4 : {oty}) outs(%o_e : {res}) permutation = [0, 2, 3, 1, 4]",
        ])
        args = ", ".join(f"%{x}: tensor<?x?x{a}x?x{dq if x != 'v' else dv}x{t}>" for x in ("q", "k", "v"))
    out_cast = ("    linalg.yield %y : f32" if t == "f32"
                else f"    %yt = arith.truncf %y : f32 to {t}\n    linalg.yield %yt : {t}")
    qd, kd, vd = (("[B,Hq,Sq/A,A,Dq]", "[B,Hk,Sk/A,A,Dq]", "[B,Hk,Sk/A,A,Dv]") if layout == "bhsd"
                  else ("[B,Sq/A,A,Hq,Dq]", "[B,Sk/A,A,Hk,Dq]", "[B,Sk/A,A,Hk,Dv]"))
    return dict(T=t, G=int(group), DQ=int(dq), DV=int(dv), A=a, layout=layout, prologue="\n".join(lines),
                from_bhsd=from_bhsd, out_cast=out_cast, q_shape_doc=qd, k_shape_doc=kd, v_shape_doc=vd,
                args=args, out_type=res)


def _normalize(f: dict, suffix: str, rows: str) -> str:
    """`mlir/normalize.mlir.in` for the op `%att<suffix>` over `rows` rows per batch entry."""
    return _load("normalize.mlir.in").substitute(s=suffix, rows=rows, T=f["T"], DV=f["DV"], out_cast=f["out_cast"])


def _lowering_for_whole_rows(lowering, dv: int):
    """(props, attrs) for an op whose M and K2 are runtime sizes (the caller checks divisibility)."""
    if not lowering:
        return "", ""
    lw = {"backend": lowering} if isinstance(lowering, str) else dict(lowering)
    m = int(lw.get("workgroup_m", 1))
    k2 = int(lw.get("reduction_k2", 1))
    return render_lowering_attrs(lw, m_total=m, dv=int(dv), c=k2)


def render_dense(*, func_name: str, dtype: str, layout: str, group: int, dq: int, dv: int, align: int,
                 lowering: Mapping[str, Any] | str | None = None) -> str:
    """MLIR text of `util.func public @func_name(q, k, v, scale) -> (out, lse)`: attention where
    every row sees every key, as one online_attention (template `mlir/dense.mlir.in`)."""
    f = _dense_common(dtype, layout, group, dq, dv, align)
    props, attrs = _lowering_for_whole_rows(lowering, dv)
    return _load("dense.mlir.in").substitute(func_name=func_name, attn_props=props, attn_attrs=attrs,
                                             normalize=_normalize(f, "", "%M"), **f)


def render_causal(*, func_name: str, dtype: str, layout: str, group: int, dq: int, dv: int, blocks: int,
                  align: int, lowering: Mapping[str, Any] | str | None = None) -> str:
    """MLIR text of `util.func public @func_name(q, k, v, scale) -> (out, lse)`: causal attention
    (Sq == Sk, S a multiple of `blocks * align`) as `blocks` independent row blocks, each against
    the keys up to its diagonal (templates `mlir/causal.mlir.in`, `mlir/causal_block.mlir.in`)."""
    f = _dense_common(dtype, layout, group, dq, dv, align)
    nb = int(blocks)
    if nb < 1:
        raise ValueError(f"blocks must be positive, got {blocks}")
    props, attrs = _lowering_for_whole_rows(lowering, dv)
    block = _load("causal_block.mlir.in")
    parts = [block.substitute(b=b, b1=b + 1, attn_props=props, attn_attrs=attrs,
                              normalize=_normalize(f, f"_{b}", "%GC"), **f) for b in range(nb)]
    rows = "  %o6_0 = tensor.cast %o6_e : {t} to {t}\n  %l5_0 = tensor.cast %l5_e : {u} to {u}".format(
        t=f"tensor<?x?x{f['G']}x?x{f['A']}x{f['DV']}x{f['T']}>", u=f"tensor<?x?x{f['G']}x?x{f['A']}xf32>")
    return _load("causal.mlir.in").substitute(func_name=func_name, NB=nb, row_blocks=rows + "".join(parts), **f)
