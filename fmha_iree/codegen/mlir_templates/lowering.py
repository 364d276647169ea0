"""Lowering configs of the GPU entry points' attention ops (`render_lowering_attrs`,
`default_lowering`) and the loader of the `mlir/*.mlir.in` templates.

`render_online_step` (`step.py`) renders `mlir/online_step.mlir.in`: one wave of the plan (the
`step` function) as gathers + one `iree_linalg_ext.online_attention` (single collapsed batch dim
P*Hk, M = G*R, K1 = Dq, K2 = C, N = Dv) + scatters back into the state. `render_dense`,
`render_dense_out` (`dense.py`: `mlir/dense*.mlir.in`) are
the one-call entry points of a whole batch.

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
    qk_promote_operands  operands of Q@K^T staged in shared memory (default [1]: K; [0, 1] also
                     stages Q, read from there at every key step instead of held in registers)
    scale_on_scores  bf16: the softmax scale multiplies the f32 scores instead of Q (SCALE_ONE)
    softcap_exp2     the soft-cap through exp2 instead of math.tanh: True, or "fast" with an approximate
                     division (``scores.softcap_lines``; per target: ``source._SOFTCAP_FORM``)
    promote_operands operands of the attention op staged in shared memory (default [1, 2]: K, V;
                     as IREE's gfx942 tuning spec. [0, 1, 2] also stages Q: M=128 d=128 then
                     needs 80 KB LDS and fails on gfx9's 64 KB)
    llvm_func_attrs  optional dict of LLVM function attributes (e.g. {"amdgpu-waves-per-eu": "2"})
    prefetch_stages  optional gpu_pipeline_options prefetch_num_stages
    masked           optional dict of these fields for the ops with a mask operand (``fwd``'s
                     kernels, ``kernels.attention.lowering_attrs``; ``rdna_fwd_lowering``)

`lowering="cpu"` (or {"backend": "cpu", "workgroup_m": ..., "vector_m": ..., "reduction_k2": ...})
renders an llvm-cpu config that keeps N whole (distribution / vector tiles [1, workgroup_m, 0, 0, 0]
/ [1, vector_m (default 1), 0, 0, 0], keys in steps of reduction_k2); the CPU modules' step takes
`tiles.CPU_STEP_LOWERING`. With the fresh-outs structure of `mlir/online_step.mlir.in` IREE's own
llvm-cpu default (which tiles N by 8) is also correct, and slow.

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

from .scores import cap_exp2, score_region

_TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "mlir"

# A lowering's ``scale_on_scores`` (``kernels.attention``'s docstring): the op's scale is ln 2
# rounded to bf16, whose product with IREE's log2(e) (a bf16 constant, 1.4453125) rounds to exactly
# 1 in bf16, so IREE's multiply of Q folds away; the scores are multiplied by scale * LOG2E in f32.
SCALE_ONE = "6.914060e-01"
LOG2E = "1.44269504"


def scores_scale(scale_f32: str, scale_type: str, names: tuple[str, str, str]) -> tuple[list[str], list[str]]:
    """``scale_on_scores`` as text, for every template that writes the op: (the lines defining
    ``names`` = (the op's scale operand, SCALE_ONE; the log2(e) constant; the f32 factor
    ``scale_f32 * log2(e)``), the score region's lines computing ``%scaled`` = the scores times
    the factor; ``scores.score_region`` yields it)."""
    if scale_type != "bf16":  # SCALE_ONE folds to 1 with IREE's log2(e) in bf16 only
        raise ValueError(f"scale_on_scores: the op's scale type must be bf16, got {scale_type}")
    one, log2e, factor = names
    defs = [f"{one} = arith.constant {SCALE_ONE} : bf16", f"{log2e} = arith.constant {LOG2E} : f32",
            f"{factor} = arith.mulf {scale_f32}, {log2e} : f32"]
    return defs, [f"    %scaled = arith.mulf %score, {factor} : f32"]


def scale_operand(lowering, t: str, softcap: float = 0.0) -> tuple[list[str], str]:
    """The templates' scale: (the lines defining the op's scale operand ``%scale_t``, element type
    ``t``, from the caller's ``%scale_f32``; the op's score region body, ``scores.score_region``
    with ``softcap``). IREE's form casts the scale to ``t`` and takes the scores as they are; a
    lowering with ``scale_on_scores`` takes ``scores_scale``'s (``%scale_t`` = SCALE_ONE, the
    factor ``%scale_l`` on the scores)."""
    exp2 = cap_exp2(lowering)
    if isinstance(lowering, Mapping) and lowering.get("scale_on_scores"):
        defs, pre = scores_scale("%scale_f32", t, ("%scale_t", "%log2e_s", "%scale_l"))
        return defs, score_region(softcap, pre, "%scaled", exp2=exp2)
    if t == "f32":
        return ["%scale_t = arith.addf %scale_f32, %zero : f32"], score_region(softcap, exp2=exp2)
    return [f"%scale_t = arith.truncf %scale_f32 : f32 to {t}"], score_region(softcap, exp2=exp2)


_DTYPES = {"f16": "f16", "bf16": "bf16", "f32": "f32", "float16": "f16",
           "bfloat16": "bf16", "float32": "f32"}


def checked_fields(dtype, layout: str, **sizes) -> str:
    """The MLIR element type of ``dtype`` after checking a template's common fields: ``layout``
    bshd or bhsd, every size in ``sizes`` positive."""
    t = _DTYPES.get(str(dtype))
    if t is None:
        raise ValueError(f"dtype {dtype!r} not in f16/bf16/f32")
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout {layout!r} not in bshd/bhsd")
    for name, val in sizes.items():
        if int(val) <= 0:
            raise ValueError(f"{name} must be positive, got {val}")
    return t


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
                          c: int, batch_dims: int = 1, k2o: bool = False) -> tuple[str, str]:
    """(properties, attributes) text for the online_attention op; ("", "") for None.

    In IREE 3.13 the op prints as
      `online_attention <{decomposition_config = {...}, indexing_maps = [...]}> {compilation_info = ...}`
    i.e. decomposition_config is an inherent property (inside `<{...}>`) and compilation_info a
    discardable attribute (in the `{...}` that follows). `batch_dims`: the op's leading batch dims
    (the tiles below are given for one, each further one gets the batch's).
    """
    if not lowering:
        return "", ""
    lw = {"backend": lowering} if isinstance(lowering, str) else dict(lowering)
    # the first batch dim's entries (tiles 1 / 0); ops with no batch dim have none
    xb, x0 = [1] * batch_dims, [0] * batch_dims
    o = [0] if k2o else []  # an outer key dim: one per step
    if lw.get("backend") == "cpu":
        return "", _cpu_attrs(lw, m_total, xb, x0, o)
    wm = int(lw.get("workgroup_m", m_total))
    wn = int(lw.get("workgroup_n", dv))
    k2 = int(lw.get("reduction_k2", 64))
    if m_total % wm or dv % wn or c % k2:
        raise ValueError(f"tile (M={wm}, N={wn}, K2={k2}) must divide (G*R={m_total}, "
                         f"Dv={dv}, C={c})")
    sg, sgm, sgn, wg = _threads(lw)
    lc = (f"workgroup = {_ilist(xb + [wm, 0, *o, 0, wn])}, "
          f"reduction = {_ilist(x0 + [0, 0, *[1 for _ in o], k2, 0])}")
    promote = lw.get("promote_operands", [1, 2])
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
    return _decomposition(lw, xb, batch_dims, sgm, sgn, len(o)), attrs


def _cpu_attrs(lw: dict, m_total: int, xb: list, x0: list, o: list) -> str:
    """llvm-cpu, N kept whole (IREE's default tiles N by 8; with the old state chained through
    the op's outs that gave a sum Dv/8 times too large -- see the module docstring)."""
    wm = int(lw.get("workgroup_m", m_total))
    k2 = int(lw.get("reduction_k2", 2))
    vm = int(lw.get("vector_m", 1))
    return (" {compilation_info = #iree_codegen.compilation_info<\n"
            "        lowering_config = #iree_cpu.lowering_config<"
            f"distribution = {_ilist(xb + [wm, 0, *o, 0, 0])}, "
            f"vector_common_parallel = {_ilist(xb + [vm, 0, *o, 0, 0])}, "
            f"vector_reduction = {_ilist(x0 + [0, 0, *[1 for _ in o], k2, 0])}>,\n"
            "        translation_info = #iree_codegen.translation_info<"
            "pipeline = #iree_cpu.pipeline<LinalgExtTileAndVectorize>>>}")


def _threads(lw: dict) -> tuple[int, int, int, int]:
    """(subgroup size, subgroups along M, along N, workgroup size) of a GPU lowering."""
    sg = int(lw.get("subgroup_size", 64))
    sgm = lw.get("subgroups_m")
    sgn = int(lw.get("subgroups_n", 1))
    wg = lw.get("workgroup_size")
    if sgm is None:
        sgm = (int(wg) // sg // sgn) if wg else 4
    sgm = int(sgm)
    wg = int(sg * sgm * sgn if wg is None else wg)
    if wg != sg * sgm * sgn:
        raise ValueError(f"workgroup_size {wg} != subgroup_size {sg} * {sgm} * {sgn}")
    return sg, sgm, sgn, wg


def _decomposition(lw: dict, xb: list, batch_dims: int, sgm: int, sgn: int, nk2o: int = 0) -> str:
    """The op's decomposition_config: the intrinsics and subgroup layout of Q@K^T and P@V ("" when
    the lowering names no intrinsic)."""
    pv_kind = lw.get("mma_kind")
    if not pv_kind:
        return ""
    qk_kind = lw.get("qk_mma_kind", pv_kind)
    basis = _ilist(xb + [sgm, 1, *[1] * nk2o, 1, sgn])
    nb = batch_dims
    qk_dims, pv_dims = list(range(nb + 3 + nk2o)), list(range(nb + 1)) + list(range(nb + 2, nb + 4 + nk2o))
    qk = (f"mma_kind = {_mma_attr(qk_kind, lw.get('qk_virtual'))}, "
          f"subgroup_basis = [{basis}, {_ilist(qk_dims)}], "
          f"promote_operands = {_ilist(lw.get('qk_promote_operands', [1]))}")
    pv = (f"mma_kind = {_mma_attr(pv_kind, False)}, "
          f"subgroup_basis = [{basis}, {_ilist(pv_dims)}], "
          f"promote_operands = {_ilist(lw.get('pv_promote_operands', [1]))}")
    return ("decomposition_config = {\n"
            f"        qk_attrs = {{attention_qk_matmul, lowering_config = "
            f"#iree_gpu.lowering_config<{{{qk}}}>}},\n"
            f"        pv_attrs = {{attention_pv_matmul, lowering_config = "
            f"#iree_gpu.lowering_config<{{{pv}}}>}}}},")


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


def lowering_for_runtime_sizes(lowering, dv: int, batch_dims: int = 1, k2o: bool = False):
    """(props, attrs) for an op whose M and K2 are runtime sizes (the caller checks divisibility)."""
    if not lowering:
        return "", ""
    lw = {"backend": lowering} if isinstance(lowering, str) else dict(lowering)
    m = int(lw.get("workgroup_m", 1))
    k2 = int(lw.get("reduction_k2", 1))
    return render_lowering_attrs(lw, m_total=m, dv=int(dv), c=k2, batch_dims=batch_dims, k2o=k2o)


# ``fwd`` on wave32 RDNA, chosen by compiling it (with ``fwd_ragged`` / ``fwd_packed*``) for
# gfx1100 and gfx1201 and reading the dumped ISA (iree-compile 3.13; no RDNA GPU to
# time on; docs/BENCHMARKS.md, "`fwd` on RDNA"). With one subgroup per 16 rows holding all of Dv,
# masked ops spilled VGPRs to scratch (gfx1201 d128: 1; gfx1100 d128: up to 67); with two subgroups
# splitting Dv (each computes its rows' scores, half of P V) they did not. Masked ops take that
# layout everywhere; every op takes it where unmasked ones spilled too: (arch, dtype or "*", Dv)
# -> the tiles used there (gfx1100's d128 default tile splits Dv across workgroups, which fwd
# cannot do; 32-key steps spilled). gfx1100 f16 d128 takes 32-key steps and 16 in masked ops:
# bshd G = 4 modules then compile without a spill (before: 1-43 VGPRs in 11 kernels), bhsd G = 1
# ones stay without (docs/BENCHMARKS.md, "gfx1100 f16 d128 `bshd` without spills"). gfx1100 bf16
# d128 keeps 64-key steps with Q staged in shared memory (``qk_promote_operands``: LLVM otherwise
# hoists Q's loads out of the key loop and holds its fragments in 64 VGPRs) and 16-key steps in the
# short tier's masked ops (``short``): bshd G = 4 then compiles without a spill (before: 1-51 VGPRs
# in 11 kernels; other steps 1-14 in 7), bhsd G = 1 too (docs/BENCHMARKS.md "RDNA3 with Q in shared
# memory").
_RDNA_SPLIT_ALL = {("gfx1100", "f16", 128): {"workgroup_m": 32, "subgroups_m": 2, "reduction_k2": 32,
                                             "masked": {"reduction_k2": 16}},
                   ("gfx1100", "*", 128): {"workgroup_m": 32, "subgroups_m": 2, "reduction_k2": 64,
                                           "qk_promote_operands": [0, 1], "short": {"masked": {"reduction_k2": 16}}},
                   ("gfx1100", "*", 64): {}, ("gfx1201", "bf16", 128): {}}


# ``fwd`` on gfx12 at Dv 256 (192 computes at 256), where the module's other entry points keep
# IREE's own config: 16 rows a workgroup of four waves, each a quarter of Dv (each computes the
# rows' scores, a quarter of P V), 32-key steps, 16 in masked ops; the short tier likewise
# (``RDNA_SHORT_D256``). Chosen by compiling every ``fwd`` / ``fwd_ragged`` / ``fwd_packed*`` kernel
# of gfx1201 f16 / bf16 bhsd G = 1 and bshd G = 4 modules and reading the dumped ISA (iree-compile
# 3.13, docs/BENCHMARKS.md "`fwd` on RDNA at Dv 256"): no spill, every attention op on
# WMMA. Tried: 32 rows of 2 x 2 waves (bf16 bshd G = 4: 19-110 VGPRs spilled in 11 kernels), 16
# rows of 1 x 4 waves with 32-key masked steps (4-7 in 7) or the short tier at 2 waves (24-110 in
# 3), 32 rows of 2 x 4 waves (8 in 2 of fwd_ragged's). gfx1100 (RDNA3 WMMA holds Q twice over) at
# d256 spilled with each: 1 x 4 waves 10-102 VGPRs in 28 kernels, 1 x 8 6-16 in 7, 1 x 16 1-16 in 8.
RDNA_D256 = {"workgroup_m": 16, "reduction_k2": 32, "promote_operands": [1, 2], "subgroup_size": 32,
             "subgroups_m": 1, "subgroups_n": 4, "workgroup_size": 128, "masked": {"reduction_k2": 16}}
RDNA_SHORT_D256 = {"subgroups_n": 4, "workgroup_size": 128, "reduction_k2": 16}
# gfx11 at Dv 256: the same layout with Q staged in shared memory, where RDNA3's WMMA would
# hold each of its fragments twice over in VGPRs (128 of them for 16 x 256 of Q), and a short tier
# of sixteen waves along Dv (four spilled 20 VGPRs in bshd G = 4's split-KV op, eight 1 in three
# ops). f16 bhsd G = 1 and bshd G = 4 modules (d192 and d256) then compile without a spill, every
# attention op on WMMA (docs/BENCHMARKS.md "RDNA3 with Q in shared memory"). bf16 also
# needs the scale on the scores (``scale_on_scores``) and eight waves in its masked main-tier ops
# (four spilled 3 VGPRs in bshd G = 4; docs/BENCHMARKS.md "bf16's scale on the scores").
RDNA3_D256 = {"qk_promote_operands": [0, 1], "short": {"subgroups_n": 16, "workgroup_size": 512}}
RDNA3_BF16_D256_MASKED = {"reduction_k2": 16, "subgroups_n": 8, "workgroup_size": 256}


def rdna_fwd_lowering(main: dict | None, *, arch: str, dtype: str, dv: int) -> dict | None:
    """The main tier of ``fwd`` (``source.fwd_plan``) on RDNA from the module's ``main`` lowering
    (None where IREE picks the module's config): two subgroups along Dv for masked ops, or for all
    ops with the tiles of ``_RDNA_SPLIT_ALL``; at Dv >= 256 ``RDNA_D256`` on gfx12, and with
    ``RDNA3_D256`` on gfx11 (bf16's masked ops with ``RDNA3_BF16_D256_MASKED``). A ``main`` that
    still splits Dv is refused by ``fwd_plan`` itself. The result may carry ``short``: fields of
    the short-query tier's lowering (``source.fwd_plan``)."""
    if dv >= 256:
        gfx12 = arch.startswith("gfx12")
        if dtype not in ("f16", "bf16"):
            return None
        kind = f"{'WMMAR4' if gfx12 else 'WMMAR3'}_F32_16x16x16_{'F16' if dtype == 'f16' else 'BF16'}"
        low = {**RDNA_D256, "workgroup_n": dv, "mma_kind": kind, **({} if gfx12 else RDNA3_D256)}
        if not gfx12 and dtype == "bf16":
            low["masked"] = RDNA3_BF16_D256_MASKED
        return low
    if main is None:
        return None
    tiles = _RDNA_SPLIT_ALL.get((arch, dtype, dv), _RDNA_SPLIT_ALL.get((arch, "*", dv)))
    if tiles is not None:
        main = {**main, **tiles, "workgroup_n": dv}
    sg, sgm = int(main["subgroup_size"]), int(main["subgroups_m"])
    two = {"subgroups_n": 2, "workgroup_size": 2 * sg * sgm}
    return {**main, **two} if tiles is not None else {**main, "workgroup_size": sg * sgm, "masked": two}
